"""A CI-sized capacity sweep (``bench/placement_sweep.py``'s rules on small rows): the plugin
hits at least as many prompt tokens as upstream, with no state mismatch and no leaked block.

Small versions of the sweep's ``rag`` rows (shared system prompt and Zipf-popular passages,
no preemption), one under pressure on each Mamba layout: the gated delta net with interior
tail states (qwen3.5-0.8b) and Mamba2 with vLLM's prefill checkpoint (nemotron-h-8b). They
guard the rules; the small rows tried so far (rag, 60-120 prompts, 262,144-1,000,000 tokens)
do not reproduce the full row's loss on the code before deferred probation. Both policies run
through vLLM's real scheduler (``replay.harness.run_replay``). A tiny scenario checks the
rule behind them (issue 15 item 3): a state a request got from a hit is not its extra, so
it is not put on probation ahead of the states upstream keeps, and interior tail blocks of a
kind the ledger has not proven do not evict it either. (Proven kinds may: gating them too cost
the bundled agentic replay 0.594 -> 0.537.)
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from vllm_hybrid_backends import align
from vllm_hybrid_backends.compat import version_allows
from vllm_hybrid_backends.replay.harness import ReplayConfig, run_replay
from vllm_hybrid_backends.replay.policy import get_policy
from vllm_hybrid_backends.replay.shapes import tiny_shape
from vllm_hybrid_backends.replay.workloads import Trace, TraceRequest, make_workload

pytestmark = pytest.mark.slow

ROWS = [
    pytest.param("rag", {"num_prompts": 60, "corpus": 30}, "qwen3.5-0.8b", 131_072,
                 id="rag-60-qwen3.5-0.8b-131072"),
    pytest.param("rag", {"num_prompts": 60, "corpus": 30}, "nemotron-h-8b", 524_288,
                 id="rag-60-nemotron-h-8b-524288", marks=pytest.mark.skipif(
                     version_allows(">=0.23,<0.24"), reason=(
                         "vLLM 0.23: neither policy hits on this Mamba2 row (measured: 0 prompt "
                         "tokens each; 0.23 has no Mamba2 prefill checkpoint and the plugin "
                         "plans no interior state there), so it guards nothing"))),
]


def _hit_tokens(trace: Any, config: ReplayConfig, policy: str) -> tuple[int, Any]:
    run = run_replay(trace, config, get_policy(policy))
    return sum(record.hit_tokens for record in run.requests.values()), run


@pytest.mark.parametrize(("workload", "params", "shape", "cache_tokens"), ROWS)
def test_plugin_hits_at_least_upstream_without_mismatch_or_leak(workload, params, shape,
                                                                 cache_tokens):
    config = ReplayConfig(model_shape=shape, cache_tokens=cache_tokens)
    trace = make_workload(workload, block_size=config.layout().block_size, **params)
    upstream, upstream_run = _hit_tokens(trace, config, "upstream")
    plugin, plugin_run = _hit_tokens(trace, config, "plugin")
    # vLLM 0.23 and 0.26 keep no Mamba state where these prompts part: upstream hits nothing
    # there (measured: 0.23 qwen3.5 row upstream 0, plugin 42,976 tokens; 0.26 nemotron row
    # upstream 0, plugin 33,280)
    assert upstream > 0 or version_allows("<0.30"), "the row must have hits to lose"
    assert plugin > 0, "the row must have hits"
    assert plugin >= upstream, f"plugin hit {plugin} prompt tokens, upstream {upstream}"
    for run in (upstream_run, plugin_run):
        assert not run.mismatches, run.mismatches[:1]
        assert run.blocks_leaked == 0


def _state_upstream_keeps_trace(pressure_tokens: int) -> Trace:
    """r1's last prompt boundary (16) is a state vLLM keeps; r2 extends r1's prompt, hits it,
    and 16 is also one of r2's tail distances; a unique r3 of ``pressure_tokens`` then needs
    blocks, and r4, a sibling of r1, resumes at 16 if the state is still cached."""
    first = list(range(100, 120))
    return Trace("state-upstream-keeps", [
        TraceRequest("r0", list(range(1000, 1040)), [7] * 3),
        TraceRequest("r1", first, [7] * 3, after="r0"),
        TraceRequest("r2", first + list(range(500, 520)), [7] * 3, after="r1"),
        TraceRequest("r3", list(range(2000, 2000 + pressure_tokens)), [7] * 3, after="r2"),
        TraceRequest("r4", first + list(range(600, 610)), [7] * 3, after="r3")])


@pytest.mark.parametrize("pressure_tokens", [
    # main before hb-place2: r2 recorded the state it hit as its own tail state and put it
    # on probation, so it went before every block vLLM keeps (r4: plugin 0, upstream 16)
    pytest.param(40, id="hit-state-is-not-an-extra"),
    # ... and r3's interior tail states (of kinds not yet proven) took blocks by evicting it
    # (r4: plugin 0, upstream 16)
    pytest.param(72, id="unproven-interior-states-evict-no-kept-block"),
])
def test_a_state_a_request_hit_is_not_put_on_probation(pressure_tokens):
    config = ReplayConfig(shape=tiny_shape(), platform="any", block_size=8, cache_tokens=240,
                          max_num_batched_tokens=64, max_num_seqs=4)
    trace = _state_upstream_keeps_trace(pressure_tokens)
    upstream = run_replay(trace, config, get_policy("upstream"))
    plugin = run_replay(trace, config, get_policy("plugin"))
    assert upstream.requests["r4"].hit_tokens == 16, "upstream must still hold r1's state"
    assert plugin.requests["r4"].hit_tokens >= 16
    for run in (upstream, plugin):
        assert not run.mismatches, run.mismatches[:1]
        assert run.blocks_leaked == 0


def _rarely_reused_tails_trace(producer: str) -> Trace:
    """Ten one-off prompts teach the ledger that tail states are never reused (as in the
    public Mooncake conversation trace, where most prompts share only the system prompt);
    then ``producer``'s prompt is extended by a follow-up that leaves it one block before its
    last boundary (32), at 24, where only a tail state can serve it."""
    requests, previous = [], None
    for number in range(10):
        requests.append(TraceRequest(f"w{number}", list(range(1000 + 100 * number,
                                                              1040 + 100 * number)),
                                     [7] * 3, after=previous))
        previous = requests[-1].id
    prompt = list(range(100, 140))
    requests.append(TraceRequest(producer, prompt, [7] * 3, after=previous))
    requests.append(TraceRequest("follow-up", prompt[:24] + list(range(500, 516)), [7] * 3,
                                 after=producer))
    return Trace("rarely-reused-tails", requests)


def test_a_tail_state_of_a_kind_the_ledger_refuses_is_kept_while_the_pool_has_room():
    producer = "p2"
    assert zlib.crc32(producer.encode()) % align.RETENTION_EXPLORE  # not sampled to explore
    config = ReplayConfig(shape=tiny_shape(), platform="any", block_size=8, cache_tokens=4000,
                          max_num_batched_tokens=64, max_num_seqs=4)
    trace = _rarely_reused_tails_trace(producer)
    upstream = run_replay(trace, config, get_policy("upstream"))
    plugin = run_replay(trace, config, get_policy("plugin"))
    assert upstream.requests["follow-up"].hit_tokens == 0
    # main before the trial rule: 0, the ledger had stopped admitting every tail distance
    assert plugin.requests["follow-up"].hit_tokens == 24
    for run in (upstream, plugin):
        assert not run.mismatches, run.mismatches[:1]
        assert run.blocks_leaked == 0
        assert run.evictions_attention == run.evictions_mamba == 0  # nothing was pushed out


def test_plugin_reaches_the_attention_bound_where_the_pool_holds_the_working_set():
    """The bundled agentic workload at the replay's default cache (the README's headline): the
    plugin's Mamba states are where its turns branch, so it hits within 5 % of the
    attention-only bound (1.00 measured). A rule that keeps interior states from evicting LRU
    cached blocks (tried in hb-place2) fell to 0.90 here."""
    from vllm_hybrid_backends.replay.report import compare_policies

    config = ReplayConfig()
    trace = make_workload("agentic", block_size=config.layout().block_size)
    metrics = compare_policies(trace, config, ["plugin"]).policies["plugin"]
    assert metrics.state_mismatches == 0
    # vLLM 0.23 plans no interior state (its allocation count cannot tell a partial local hit)
    # and retains densely: 0.90 of the bound measured there (0.5347 / 0.5939)
    floor = 0.88 if version_allows("<0.26") else 0.95
    assert metrics.token_hit_rate >= floor * metrics.bound_hit_rate, (
        metrics.token_hit_rate, metrics.bound_hit_rate)

