"""Bundled workload generators and the user-trace loader (no vLLM needed)."""

from __future__ import annotations

import gzip
import json

import pytest

from vllm_hybrid_backends.replay.workloads import (
    WORKLOADS,
    TraceError,
    load_trace,
    make_workload,
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
