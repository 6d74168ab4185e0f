"""Bundled workload generators and the user-trace loader (no vLLM needed)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from vllm_hybrid_backends.replay.workloads import (
    WORKLOADS,
    TraceError,
    load_trace,
    make_workload,
    scale_arrivals,
    write_trace,
)

BLOCK = 544


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_generators_are_deterministic_and_seeded(name):
    first = make_workload(name, block_size=BLOCK, seed=3)
    again = make_workload(name, block_size=BLOCK, seed=3)
    other = make_workload(name, block_size=BLOCK, seed=4)
    assert first.requests == again.requests
    assert first.requests != other.requests
    assert len({r.id for r in first.requests}) == len(first.requests)


def test_agentic_inserts_new_content_before_the_previous_turns_last_full_block():
    trace = make_workload("agentic", block_size=BLOCK)
    by_id = {r.id: r for r in trace.requests}
    followers = [r for r in trace.requests if r.after is not None]
    assert followers
    for turn in followers:
        previous = by_id[turn.after].prompt_token_ids
        shared = 0
        while turn.prompt_token_ids[shared] == previous[shared]:
            shared += 1
        # the divergence lies before the previous prompt's last full-block boundary
        assert shared < (len(previous) - 1) // BLOCK * BLOCK
        # ... and the turn ends with the same long instruction tail
        tail = trace.params["tail"]
        assert turn.prompt_token_ids[-tail:] == previous[-tail:]
        # the previous answer is part of the new prompt (it follows the shared prefix)
        answer = by_id[turn.after].output_token_ids
        assert turn.prompt_token_ids[shared: shared + len(answer)] == answer


def test_chat_turns_extend_the_previous_turn_and_its_answer():
    trace = make_workload("chat", block_size=BLOCK)
    by_id = {r.id: r for r in trace.requests}
    for turn in (r for r in trace.requests if r.after):
        previous = by_id[turn.after]
        history = previous.prompt_token_ids + previous.output_token_ids
        assert turn.prompt_token_ids[: len(history)] == history
    assert 12 * 24 <= len(trace.requests) <= 18 * 24


def test_short_prompts_are_shorter_than_one_block():
    trace = make_workload("short", block_size=BLOCK)
    assert max(len(r.prompt_token_ids) for r in trace.requests) < BLOCK


def test_unknown_workload_names_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown workload 'nope'; allowed: agentic, chat"):
        make_workload("nope", block_size=BLOCK)


@pytest.mark.parametrize("suffix", [pytest.param(".jsonl", id="jsonl"),
                                    pytest.param(".jsonl.gz", id="jsonl-gz")])
def test_trace_round_trip(tmp_path, suffix):
    trace = make_workload("chat", block_size=BLOCK, conversations=2)
    path = tmp_path / f"trace{suffix}"
    write_trace(trace, path)
    loaded = load_trace(path)
    assert loaded.requests == trace.requests


def test_max_tokens_only_lines_get_deterministic_outputs(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": 7, "prompt_token_ids": [1, 2], "max_tokens": 5}) + "\n")
    first, second = load_trace(path), load_trace(path)
    assert first.requests[0].id == "7"
    assert len(first.requests[0].output_token_ids) == 5
    assert first.requests == second.requests


GOOD = {"id": "a", "prompt_token_ids": [1, 2, 3], "output_token_ids": [4]}
BAD_LINES = [
    pytest.param("{not json", "not valid JSON", id="bad-json"),
    pytest.param("[1, 2]", "expected a JSON object, got list", id="not-object"),
    pytest.param(json.dumps({"prompt_token_ids": [1], "max_tokens": 1}), "missing 'id'",
                 id="no-id"),
    pytest.param(json.dumps(GOOD), "duplicate id 'a'", id="duplicate-id"),
    pytest.param(json.dumps({"id": "b", "max_tokens": 1}), "missing 'prompt_token_ids'",
                 id="no-prompt"),
    pytest.param(json.dumps({"id": "b", "prompt_token_ids": [], "max_tokens": 1}),
                 "'prompt_token_ids' must be a non-empty list", id="empty-prompt"),
    pytest.param(json.dumps({"id": "b", "prompt_token_ids": [1, -2], "max_tokens": 1}),
                 r"'prompt_token_ids'\[1\] is -2", id="negative-token"),
    pytest.param(json.dumps({"id": "b", "prompt_token_ids": [1, 2.5], "max_tokens": 1}),
                 r"'prompt_token_ids'\[1\] is 2.5", id="float-token"),
    pytest.param(json.dumps({"id": "b", "prompt_token_ids": [1]}),
                 "give 'output_token_ids' or 'max_tokens'", id="no-outputs"),
    pytest.param(json.dumps({"id": "b", "prompt_token_ids": [1], "max_tokens": 0}),
                 "'max_tokens' must be an integer >= 1, got 0", id="zero-max-tokens"),
    pytest.param(json.dumps({"id": "b", "prompt_token_ids": [1], "output_token_ids": [2],
                             "max_tokens": 3}),
                 "'max_tokens' is 3 but 'output_token_ids' has 1 tokens", id="disagree"),
    pytest.param(json.dumps({"id": "b", "prompt_token_ids": [1], "max_tokens": 1,
                             "arrival_s": -1}),
                 "'arrival_s' must be a number >= 0, got -1", id="negative-arrival"),
    pytest.param(json.dumps({"id": "b", "prompt_token_ids": [1], "max_tokens": 1,
                             "after": "zz"}),
                 "'after' names 'zz', which is not an earlier request id", id="after-unknown"),
    pytest.param(json.dumps({"id": "b", "prompt_ids": [1], "max_tokens": 1}),
                 "unknown key\\(s\\) 'prompt_ids'; allowed: id, arrival_s", id="typo-key"),
    pytest.param(json.dumps({"id": True, "prompt_token_ids": [1], "max_tokens": 1}),
                 "'id' must be a non-empty string or an integer, got True", id="bool-id"),
]


@pytest.mark.parametrize("gz", [pytest.param(False, id="jsonl"), pytest.param(True, id="gz")])
@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_a_malformed_line_fails_with_its_line_number(tmp_path, line, message, gz):
    text = json.dumps(GOOD) + "\n\n" + line + "\n"  # the bad line is line 3
    path = tmp_path / ("t.jsonl.gz" if gz else "t.jsonl")
    if gz:
        with gzip.open(path, "wt") as out:
            out.write(text)
    else:
        path.write_text(text)
    with pytest.raises(TraceError, match=rf"t\.jsonl(\.gz)?:3: {message}"):
        load_trace(path)


def test_empty_and_missing_traces_are_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="the trace has no requests"):
        load_trace(empty)
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "missing.jsonl")


# ---- hash-block (Mooncake / vllm bench timed_trace) traces ------------------------------------

def _mooncake(tmp_path, lines, name="mooncake.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


MOONCAKE = [
    {"timestamp": 1000, "input_length": 40, "output_length": 3, "hash_ids": [7, 8, 9]},
    # shares unit 7 and the first 6 tokens of unit 8, as its partial last unit
    {"timestamp": 1500, "input_length": 22, "output_length": 0, "hash_ids": [7, 8]},
    # more prompt than its hash ids cover: the rest is its own
    {"timestamp": 4000, "input_length": 36, "output_length": 2, "hash_ids": [7], "extra": "x"},
    {"timestamp": 4000, "input_length": 36, "output_length": 2, "hash_ids": [7]},
]


def test_hash_block_lines_become_shared_units(tmp_path):
    trace = load_trace(_mooncake(tmp_path, MOONCAKE), hash_block_size=16)
    a, b, c, d = trace.requests
    assert [r.id for r in trace.requests] == ["t1", "t2", "t3", "t4"]
    assert [len(r.prompt_token_ids) for r in trace.requests] == [40, 22, 36, 36]
    assert [r.max_tokens for r in trace.requests] == [3, 1, 2, 2]
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.5, 3.0, 3.0]
    assert b.prompt_token_ids == a.prompt_token_ids[:22]  # unit 7 + the head of unit 8
    assert c.prompt_token_ids[:16] == a.prompt_token_ids[:16]
    # uncovered tokens are unique to their line, even for an identical line
    assert c.prompt_token_ids[16:] != d.prompt_token_ids[16:]
    assert a.prompt_token_ids[16:32] != a.prompt_token_ids[:16]  # units differ
    assert trace.params == {"format": "hash-block", "hash_block_size": 16, "timestamp_unit": "ms"}
    # the unit is read from the lines that have more than one id (the first two): 16
    assert load_trace(_mooncake(tmp_path, MOONCAKE, "again.jsonl")).requests == trace.requests


def test_hash_block_tokens_do_not_depend_on_the_process(tmp_path):
    path = _mooncake(tmp_path, MOONCAKE)
    code = ("import sys, hashlib, json; from vllm_hybrid_backends.replay.workloads import "
            "load_trace; t = load_trace(sys.argv[1]); print(hashlib.sha256(json.dumps("
            "[r.prompt_token_ids + r.output_token_ids for r in t.requests]).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code, str(path)], check=True, text=True,
                              capture_output=True, env={**os.environ, "PYTHONHASHSEED": seed}
                              ).stdout for seed in ("1", "2")}
    assert len(digests) == 1


def test_time_scale_and_limit(tmp_path):
    path = _mooncake(tmp_path, MOONCAKE)
    trace = load_trace(path, hash_block_size=16, time_scale=4.0, limit=3)
    assert [r.arrival_s for r in trace.requests] == [0.0, 2.0, 12.0]
    assert trace.params["time_scale"] == 4.0 and trace.params["limit"] == 3
    mine = _mooncake(tmp_path, [GOOD, {**GOOD, "id": "b", "arrival_s": 1.5}], "own.jsonl")
    assert [r.arrival_s for r in load_trace(mine, time_scale=2.0).requests] == [0.0, 3.0]
    with pytest.raises(ValueError, match="time_scale must be a number > 0, got 0"):
        load_trace(path, time_scale=0)
    with pytest.raises(ValueError, match="limit must be an integer >= 1, got 0"):
        load_trace(path, limit=0)


def test_scale_arrivals_scales_arrivals_and_follow_up_delays_only():
    trace = make_workload("agentic", block_size=BLOCK, seed=1)
    scaled = scale_arrivals(trace, 1.25)
    followers = [r for r in trace.requests if r.after is not None]
    assert followers and any(r.arrival_s > 0 for r in followers)  # delays are scaled too
    for before, after in zip(trace.requests, scaled.requests, strict=True):
        assert after.arrival_s == before.arrival_s * 1.25
        assert (after.id, after.after, after.prompt_token_ids, after.output_token_ids) == (
            before.id, before.after, before.prompt_token_ids, before.output_token_ids)
    assert scaled.params["time_scale"] == 1.25 and "time_scale" not in trace.params
    assert scale_arrivals(scaled, 2.0).params["time_scale"] == 2.5
    assert scale_arrivals(trace, 1.0) is trace
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="time_scale must be a number > 0, got"):
            scale_arrivals(trace, bad)


@pytest.mark.parametrize(("line", "message"), [
    pytest.param({"timestamp": 1, "input_length": 4, "hash_ids": [1]}, "missing 'output_length'",
                 id="no-output-length"),
    pytest.param({"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": [1]},
                 "'input_length' must be an integer >= 1, got 0", id="empty-prompt"),
    pytest.param({"timestamp": -5, "input_length": 4, "output_length": 1, "hash_ids": [1]},
                 r"'timestamp' must be a number >= 0 \(in ms\), got -5", id="negative-time"),
    pytest.param({"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [1, "x"]},
                 r"'hash_ids'\[1\] is 'x'; hash ids are integers", id="string-hash"),
    pytest.param({"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": 3},
                 "'hash_ids' must be a list of integers, got 3", id="not-a-list"),
    pytest.param({"id": "x", "prompt_token_ids": [1], "max_tokens": 1}, "missing 'timestamp'",
                 id="mixed-formats"),
])
def test_a_bad_hash_block_line_names_its_line(tmp_path, line, message):
    path = _mooncake(tmp_path, [MOONCAKE[0], line])
    with pytest.raises(TraceError, match=rf"mooncake\.jsonl:2: {message}"):
        load_trace(path)


def test_branching_attempts_share_the_history_and_diverge_inside_a_block():
    trace = make_workload("branching", block_size=BLOCK, tasks=3, steps=3, fanout=3)
    by_id = {r.id: r for r in trace.requests}
    misaligned = 0
    for t in range(3):
        for step in range(3):
            tries = [by_id[f"task{t}-step{step}-try{a}"] for a in range(3)]
            if step:  # the history is the previous step's chosen prompt and answer
                chosen = by_id[f"task{t}-step{step - 1}-try0"]
                history = chosen.prompt_token_ids + chosen.output_token_ids
                assert all(r.prompt_token_ids[:len(history)] == history for r in tries)
                assert all(r.after == chosen.id for r in tries)
            a, b = tries[0].prompt_token_ids, tries[1].prompt_token_ids
            common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            misaligned += common % BLOCK != 0
    assert misaligned >= 6  # branch points are not on the block grid


def test_rag_prompts_share_the_system_prompt_and_popular_passages():
    trace = make_workload("rag", block_size=BLOCK, num_prompts=60)
    prompts = [r.prompt_token_ids for r in trace.requests]
    system = prompts[0][:700]
    assert all(p[:700] == system for p in prompts)
    firsts = {tuple(p[700:900]) for p in prompts}
    assert len(firsts) < len(prompts) / 2  # the same first passage recurs (popularity)
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)


def test_production_is_a_hash_block_trace_read_like_a_file(tmp_path):
    from vllm_hybrid_backends.replay.workloads import production_lines

    lines = production_lines(seed=1, sessions=20)
    path = tmp_path / "prod.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    from_file = load_trace(path)
    generated = make_workload("production", block_size=BLOCK, seed=1, sessions=20)
    assert [r.prompt_token_ids for r in from_file.requests] == \
        [r.prompt_token_ids for r in generated.requests]
    assert all(len(r.prompt_token_ids) == line["input_length"]
               for r, line in zip(generated.requests, lines))
    # a later turn repeats the earlier turn's units: its prompt extends the earlier prompt
    by_units: dict[int, list[int]] = {}
    extended = 0
    for r, line in zip(generated.requests, lines):
        for other in by_units.values():
            if len(other) < len(r.prompt_token_ids) and \
                    r.prompt_token_ids[:len(other)] == other:
                extended += 1
                break
        by_units[line["hash_ids"][-1]] = r.prompt_token_ids
    assert extended >= len(lines) // 3


def _fingerprint(lines: list[dict]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(lines, sort_keys=True).encode()).hexdigest()


def test_production_lines_are_those_recorded_results_were_made_with():
    """production_lines now runs through conversation_lines: the same lines, bit for bit, as
    the generator docs/results.md's production rows came from (its digest, taken before)."""
    from vllm_hybrid_backends.replay.workloads import production_lines

    lines = production_lines(seed=0, sessions=60)
    assert len(lines) == 306
    assert _fingerprint(lines) == \
        "95700d5fc66810e8150f0c20dfc06e7f6dd29d7bc5e8fca9efeba42adf725ce0"


@pytest.mark.parametrize(("params", "message"), [
    pytest.param({"sessions": 0}, "sessions 0, session_rate 0.5: allowed", id="sessions"),
    pytest.param({"system_blocks": (2, 3)}, r"system_blocks \(2, 3\) with popularity", id="weights"),
    pytest.param({"branch_prob": 0.3}, "branch_prob 0.3: allowed 0..1, above 0 only with "
                 "whole_units_only", id="branch-needs-whole-units"),
])
def test_conversation_shape_refuses_what_it_cannot_draw(params, message):
    from vllm_hybrid_backends.replay.workloads import ConversationShape

    with pytest.raises(ValueError, match=message):
        ConversationShape(**params)


def test_conversation_lines_whole_units_carry_only_full_units_and_the_answer():
    from vllm_hybrid_backends.replay.workloads import ConversationShape, conversation_lines

    unit = 64
    kept_all = conversation_lines(ConversationShape(sessions=6), seed=2, unit=unit)
    whole = conversation_lines(ConversationShape(sessions=6, whole_units_only=True), seed=2,
                               unit=unit)
    for lines, whole_only in ((kept_all, False), (whole, True)):
        turns = {(line["session"], line["turn"]): line for line in lines}
        for (session, turn), line in turns.items():
            if not turn:
                continue
            prev = turns[(session, turn - 1)]
            shared = 0
            while line["hash_ids"][shared] == prev["hash_ids"][shared]:
                shared += 1
                if shared == min(len(line["hash_ids"]), len(prev["hash_ids"])):
                    break
            if whole_only:  # full units only; the answer is in the prompt
                assert shared == prev["input_length"] // unit
                assert line["input_length"] > prev["input_length"] + prev["output_length"]
            else:  # every unit id, the partial last one too
                assert shared == len(prev["hash_ids"])
    # the same draws: a whole-units prompt is longer by the session's earlier answers
    answers: dict[int, int] = {}
    for a, b in zip(kept_all, whole, strict=True):
        assert (a["session"], a["turn"]) == (b["session"], b["turn"])
        assert b["input_length"] == a["input_length"] + answers.get(a["session"], 0)
        answers[a["session"]] = answers.get(a["session"], 0) + a["output_length"]


# ---- the hash unit and the timestamp unit, read from the trace ----------------------------------

def _bailian(lines: list[dict]) -> list[dict]:
    """conversation_lines in Alibaba's Qwen-Bailian layout: chat ids, seconds, request type."""
    out, last_of_session = [], {}
    for chat_id, line in enumerate(lines):
        parent = last_of_session.get(line["session"], -1)
        last_of_session[line["session"]] = chat_id
        out.append({"chat_id": chat_id, "parent_chat_id": parent,
                    "timestamp": line["timestamp"] / 1000, "input_length": line["input_length"],
                    "output_length": line["output_length"], "type": "text",
                    "turn": line["turn"] + 1, "hash_ids": line["hash_ids"]})
    return out


@pytest.mark.parametrize("unit", [16, 64, 512])
def test_the_hash_unit_is_read_from_the_trace(tmp_path, unit):
    from vllm_hybrid_backends.replay.workloads import ConversationShape, conversation_lines

    lines = conversation_lines(ConversationShape(sessions=12), seed=3, unit=unit)
    path = _mooncake(tmp_path, lines)
    read = load_trace(path)
    assert read.params["hash_block_size"] == unit
    assert [r.prompt_token_ids for r in read.requests] == \
        [r.prompt_token_ids for r in load_trace(path, hash_block_size=unit).requests]
    # read with the other conventional unit the prompts differ (the flag is not ignored)
    other = 16 if unit != 16 else 512
    assert [r.prompt_token_ids for r in load_trace(path, hash_block_size=other).requests] != \
        [r.prompt_token_ids for r in read.requests]


def test_a_qwen_bailian_trace_reads_as_its_mooncake_twin(tmp_path):
    from vllm_hybrid_backends.replay.workloads import ConversationShape, conversation_lines

    lines = conversation_lines(ConversationShape(sessions=10), seed=5, unit=16)
    mooncake = load_trace(_mooncake(tmp_path, lines), hash_block_size=16)
    bailian = load_trace(_mooncake(tmp_path, _bailian(lines), "qwen_traceA_blksz_16.jsonl"))
    assert bailian.params == {"format": "hash-block", "hash_block_size": 16,
                              "timestamp_unit": "s"}
    assert [r.prompt_token_ids for r in bailian.requests] == \
        [r.prompt_token_ids for r in mooncake.requests]
    assert [r.arrival_s for r in bailian.requests] == \
        pytest.approx([r.arrival_s for r in mooncake.requests])
    assert bailian.requests[-1].arrival_s > 10  # seconds, not 1000x compressed
    # the unit can be forced either way
    as_ms = load_trace(_mooncake(tmp_path, _bailian(lines), "b.jsonl"), timestamp_unit="ms")
    assert [r.arrival_s for r in as_ms.requests] == \
        pytest.approx([r.arrival_s / 1000 for r in bailian.requests])
    with pytest.raises(ValueError, match="timestamp_unit must be one of ms, s, got 'us'"):
        load_trace(_mooncake(tmp_path, _bailian(lines), "c.jsonl"), timestamp_unit="us")


def test_a_trace_whose_ids_fit_no_unit_asks_for_it(tmp_path):
    from vllm_hybrid_backends.replay.workloads import infer_hash_block_size

    # ids cover about half of each prompt: no power of two fits most lines
    lines = [{"timestamp": k, "input_length": 100 * k + 37, "output_length": 1,
              "hash_ids": list(range(k + 1))} for k in range(1, 40)]
    with pytest.raises(TraceError, match=r"x\.jsonl: cannot tell how many tokens a hash id "
                       r"stands for: 64 tokens fit 2 of the 39 lines.*--hash-block-size"):
        load_trace(_mooncake(tmp_path, lines, "x.jsonl"))
    assert load_trace(_mooncake(tmp_path, lines, "y.jsonl"), hash_block_size=64).params[
        "hash_block_size"] == 64
    # one-id lines fit every unit: they decide nothing
    assert infer_hash_block_size([(300, 1), (9000, 1)]) == 512
    assert infer_hash_block_size([(300, 1), (40, 3), (33, 3)]) == 16
    assert infer_hash_block_size([(1024, 2)] * 9 + [(5000, 2)]) == 512  # 9 of 10 fit
    # a tie between conventions goes to ceil (600 tokens, 2 ids: ceil 512 or floor 256)
    assert infer_hash_block_size([(600, 2), (700, 2), (513, 2)]) == 512
    # full units only (no id for a partial last unit): floor on every line
    assert infer_hash_block_size([(40, 2), (47, 2), (100, 6), (33, 2)]) == 16
    # one line that fits no unit among the first five does not refuse a --limit 5 replay
    fine = [{"timestamp": k, "input_length": 16 * (k + 1) + 3, "output_length": 1,
             "hash_ids": list(range(100 * k, 100 * k + k + 2))} for k in range(40)]
    fine[1] = {**fine[1], "hash_ids": fine[1]["hash_ids"] * 3}
    assert load_trace(_mooncake(tmp_path, fine, "z.jsonl"), limit=5).params[
        "hash_block_size"] == 16
    with pytest.raises(ValueError, match="512 tokens fit 8 of the 10 lines"):
        infer_hash_block_size([(1024, 2)] * 8 + [(5000, 2)] * 2)
