"""The replay harness on vLLM's real scheduler: oracle, policies, metrics, attribution.

Small versions of the bundled workloads keep this file to a few seconds per test once vLLM is
imported; the full-size default run is exercised by ``test_cli.py``.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

from vllm_hybrid_backends import hookimpl, plugins, reference
from vllm_hybrid_backends.compat import has_mamba2_prefill_checkpoint, version_allows
from vllm_hybrid_backends.replay.engine_config import (
    vllm_has_prefix_match_unit,
    vllm_has_retention_interval,
)
from vllm_hybrid_backends.replay.harness import ReplayConfig, ReplayError, run_replay
from vllm_hybrid_backends.replay.metrics import ideal_hits, policy_metrics
from vllm_hybrid_backends.replay.policy import get_policy
from vllm_hybrid_backends.replay.shapes import tiny_shape
from vllm_hybrid_backends.replay.workloads import Trace, TraceRequest, load_trace, make_workload
from vllm_hybrid_backends.types import Availability, BackendIdentity, DeviceKind

pytestmark = pytest.mark.slow
#: Harness scenarios vLLM 0.26 cannot run as written (the plugin's own call-path and
#: agentic/chat replays run there); each reason names what 0.26 does differently.
pd_not_on_026 = pytest.mark.skipif(version_allows("<0.30"), reason=(
    "vLLM 0.26's scheduler, with a KV connector and Mamba layers, takes the attention-only hit "
    "(HybridKVCacheCoordinator.find_longest_cache_hit_per_group, v1/core/sched/scheduler.py:"
    "716-742) and leaves the Mamba state at that position to the connector (NIXL sends it "
    "unconditionally); the harness's fake connector delivers states only for the tokens it "
    "reports as external (the 0.30+ contract), so a local hit resumes from a state no one wrote"))
spec_decode_not_on_026 = pytest.mark.skipif(version_allows("<0.30"), reason=(
    "vLLM 0.26 in align mode needs block_size <= max_num_batched_tokens and a "
    "long_prefill_token_threshold of 0 or >= block_size (vllm/config/vllm.py:2264-2272): "
    "its _mamba_block_aligned_split (v1/core/sched/scheduler.py:387-392) gives an empty chunk "
    "below a block, and the request (and every one behind it) is never scheduled; these "
    "scenarios have 16-token blocks under an 8-token budget (request skipped for a step) or "
    "an 8-token long-prefill threshold (spec-decode full pool)"))
coarser_mamba_not_on_026 = pytest.mark.skipif(version_allows("<0.30"), reason=(
    "vLLM 0.26 cannot configure a Mamba block coarser than the attention block: "
    "resolve_kv_cache_block_sizes (v1/core/kv_cache_utils.py:671-676) then hashes at the "
    "scheduler block size (8), which HybridKVCacheCoordinator asserts divides every group's "
    "block size (v1/core/kv_cache_coordinator.py:563-569; the attention block is 4)"))
no_interior_blocks_on_023 = pytest.mark.skipif(version_allows("<0.26"), reason=(
    "vLLM 0.23's get_num_blocks_to_allocate has no num_local_computed_tokens: the plugin plans "
    "no interior state blocks there and splits the chunk at tail checkpoints instead"))
CONFIG = ReplayConfig()  # qwen3.5-0.8b, 544-token blocks
SMALL = {
    "agentic": {"sessions": 3, "turns": 4},
    "chat": {"conversations": 3},
    "prefix-repetition": {"num_prompts": 30, "num_prefixes": 3},
    "short": {"num_prompts": 40},
}


def small(name: str) -> Trace:
    return make_workload(name, block_size=CONFIG.layout().block_size, **SMALL[name])


def both_runs(trace: Trace, policy: str = "upstream", config: ReplayConfig = CONFIG):
    bound = run_replay(trace, config, get_policy(policy), attention_only=True)
    hybrid = run_replay(trace, config, get_policy(policy),
                        bound_hits={k: r.hit_tokens for k, r in bound.requests.items()})
    return hybrid, bound


@pytest.mark.parametrize("policy", ["upstream", "plugin"])
@pytest.mark.parametrize("workload", sorted(SMALL))
def test_bundled_workloads_replay_with_exact_states(workload, policy):
    trace = small(workload)
    hybrid, bound = both_runs(trace, policy)
    metrics = policy_metrics(trace, hybrid, bound)
    assert metrics.state_mismatches == 0, metrics.mismatch_examples
    assert metrics.state_checks > 0
    assert hybrid.blocks_leaked == 0 and bound.blocks_leaked == 0
    assert all(r.finish_time is not None for r in hybrid.requests.values())
    assert 0.0 <= metrics.token_hit_rate <= metrics.ideal_hit_rate <= 1.0
    missed = sum(metrics.miss_reasons.values())
    ideal_tokens = round(metrics.ideal_hit_rate * trace.num_prompt_tokens)
    hit_tokens = round(metrics.token_hit_rate * trace.num_prompt_tokens)
    assert missed == ideal_tokens - hit_tokens  # every missed reusable token has a reason


def test_upstream_agentic_misses_are_mostly_no_mamba_state_at_boundary():
    trace = small("agentic")
    hybrid, bound = both_runs(trace)
    metrics = policy_metrics(trace, hybrid, bound)
    reasons = metrics.miss_reasons
    assert metrics.bound_hit_rate > metrics.token_hit_rate
    assert reasons["no_mamba_state_at_boundary"] > 0.5 * sum(
        v for k, v in reasons.items() if k != "prefix_shorter_than_block")


def test_short_prompts_miss_only_because_they_are_shorter_than_a_block():
    trace = small("short")
    metrics = policy_metrics(trace, *both_runs(trace))
    assert metrics.token_hit_rate == 0.0
    assert metrics.miss_reasons["prefix_shorter_than_block"] > 0
    assert sum(metrics.miss_reasons.values()) == metrics.miss_reasons["prefix_shorter_than_block"]


class OffByOneCopy:
    """A broken backend: every block copy reads the block after the source."""

    @hookimpl
    def hb_backend_identity(self):
        return BackendIdentity("offbyone", DeviceKind.CPU, priority=-1)

    @hookimpl
    def hb_backend_probe(self):
        return Availability(True, "test double")

    @hookimpl
    def hb_copy_state_blocks(self, states, src_blocks, dst_blocks):
        num_blocks = states[0].tensor.shape[0]
        reference.copy_state_blocks(states, (src_blocks + 1) % num_blocks, dst_blocks)


def test_a_wrong_copy_in_a_backend_hook_is_reported_as_mismatches(monkeypatch):
    name = plugins.register_backend(OffByOneCopy())
    try:
        monkeypatch.setenv(plugins.BACKEND_ENV, name)
        plugins.forget_selection()
        trace = small("chat")
        result = run_replay(trace, CONFIG, get_policy("upstream"))
    finally:
        plugins.unregister_backend(name)
        monkeypatch.delenv(plugins.BACKEND_ENV)
        plugins.forget_selection()
    assert result.backend == "offbyone"
    assert len(result.mismatches) > 0
    first = result.mismatches[0]
    assert first.request_id in {r.id for r in trace.requests}
    assert "expected the state after the first" in first.describe()


def test_plugin_policy_applies_its_patches_only_during_the_run():
    import importlib

    from vllm_hybrid_backends import patches
    from vllm_hybrid_backends.replay.policy import _resolve_owner

    modules = [m for m in patches.patch_modules("engine") if patches.check(m).state == patches.READY]
    targets = []
    for module in modules:
        target = importlib.import_module(module.TARGET_MODULE)
        for symbol in module.TARGET_SYMBOLS:
            owners, attr = _resolve_owner(target, symbol)
            targets += [(owner, attr) for owner in owners]
    before = [vars(owner).get(attr) for owner, attr in targets]
    with get_policy("plugin").active() as applied:
        during = [vars(owner).get(attr) for owner, attr in targets]
    assert applied == [m.__name__.rsplit(".", 1)[-1] for m in modules]
    assert "patch_vllm_v1_core_kv_cache_coordinator" in applied
    assert during != before  # something was patched ...
    assert [vars(owner).get(attr) for owner, attr in targets] == before  # ... and restored
    with get_policy("upstream").active() as none:
        assert none == []


def test_upstream_refuses_to_run_with_the_plugin_patched_in_for_good():
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_sched_scheduler
    from vllm_hybrid_backends.replay.policy import revertible_patches

    with revertible_patches([patch_vllm_v1_core_sched_scheduler]):  # as if vLLM loaded the plugin
        with pytest.raises(RuntimeError, match="patches are already applied in this process"):
            with get_policy("upstream").active():
                pass


def test_unknown_policy_names_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown policy 'x'; allowed: upstream, plugin"):
        get_policy("x")


def _tiny(**overrides):
    base = dict(shape=tiny_shape(), platform="any", block_size=8, cache_tokens=4096,
                max_num_batched_tokens=16, max_num_seqs=4)
    base.update(overrides)
    return ReplayConfig(**base)


def _sharing_trace(n: int = 3) -> Trace:
    prefix = list(range(100, 160))
    return Trace("sharing", [TraceRequest(f"r{i}", prefix + [200 + i] * (5 + i), [300 + i] * 3,
                                          arrival_s=0.5 * i) for i in range(n)])


def test_prefix_hits_resume_from_the_restored_state():
    result = run_replay(_sharing_trace(), _tiny(), get_policy("upstream"))
    assert result.mismatches == []
    later = [result.requests[f"r{i}"].hit_tokens for i in (1, 2)]
    assert max(later) > 0  # a later request really resumed from a cached Mamba state


@pd_not_on_026
def test_external_tokens_from_a_pd_connector_resume_exactly():
    trace = _sharing_trace(2)
    result = run_replay(trace, _tiny(), get_policy("upstream"),
                        external=lambda rid, local, n: 24 - local if rid == "r1" else 0)
    assert result.mismatches == []
    assert result.requests["r1"].external_tokens > 0


def test_spec_decode_with_partial_accepts_keeps_states_exact():
    trace = Trace("spec", [TraceRequest("a", list(range(40, 77)), list(range(500, 530)))])
    pattern = iter([0, 1, 2, 3, 2, 0, 3] * 20)
    result = run_replay(trace, _tiny(num_spec_tokens=3), get_policy("upstream"),
                        accept=lambda rid, k: min(next(pattern), k))
    assert result.mismatches == []
    assert result.steps < 30  # drafts were accepted: fewer steps than output tokens


def test_preemption_under_a_tiny_cache_keeps_states_exact():
    trace = Trace("tight", [TraceRequest(f"r{i}", list(range(16 + i, 80 + i)), [5] * 12)
                            for i in range(4)])
    result = run_replay(trace, _tiny(cache_tokens=8 * 24, max_num_batched_tokens=32),
                        get_policy("upstream"))
    assert result.preemptions > 0
    assert result.mismatches == [] and result.blocks_leaked == 0


def test_recomputed_tokens_after_preemption_match_the_scheduler_outputs(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    # Distinct prompts (no sharing between requests) in a pool too small for all four.
    trace = Trace("tight", [TraceRequest(f"r{i}", [1000 * (i + 1) + t for t in range(64)],
                                         [5] * 12) for i in range(4)])
    outputs = []
    original = Scheduler.schedule

    def recording(self):
        out = original(self)
        outputs.append((out, {r: self.requests[r].num_prompt_tokens
                              for r in out.num_scheduled_tokens}))
        return out

    monkeypatch.setattr(Scheduler, "schedule", recording)
    result = run_replay(trace, _tiny(cache_tokens=8 * 24, max_num_batched_tokens=32),
                        get_policy("upstream"))
    assert result.preemptions > 0 and result.mismatches == []
    # Independently, from the scheduler outputs alone: every position a request is scheduled to
    # compute that it had already computed (or been served from the cache) before.
    had: dict[str, set[int]] = {}
    recomputed = recomputed_prompt = 0
    preempted: set[str] = set()
    for out, prompt_lens in outputs:
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        starts.update(zip(out.scheduled_cached_reqs.req_ids,
                          out.scheduled_cached_reqs.num_computed_tokens))
        for rid, n in out.num_scheduled_tokens.items():
            positions = had.setdefault(rid, set())
            positions.update(range(starts[rid]))
            again = positions.intersection(range(starts[rid], starts[rid] + n))
            if again:
                assert rid in preempted  # only a preempted request recomputes
            recomputed += len(again)
            recomputed_prompt += sum(1 for p in again if p < prompt_lens[rid])
            positions.update(range(starts[rid], starts[rid] + n))
        preempted.update(out.preempted_req_ids or ())
    assert recomputed_prompt > 0
    assert (result.recomputed_tokens, result.recomputed_prompt_tokens) == (
        recomputed, recomputed_prompt)
    # nothing is shared, so every prompt token is computed once past the first hit, plus again
    assert result.prefill_tokens_computed == sum(
        r.prompt_len - r.hit_tokens for r in result.requests.values()) + recomputed_prompt


def test_a_preempted_prefill_resumes_from_its_last_boundary_state(monkeypatch):
    from vllm_hybrid_backends import align, stats

    # A decode that outgrows a tiny pool preempts a long prefill mid-prompt (on a block
    # boundary: 16-token chunks, 8-token blocks); the prefill comes back once the decode ends.
    trace = Trace("preempted-prefill", [
        TraceRequest("decode", list(range(1000, 1016)), [5] * 28),
        TraceRequest("prefill", list(range(2000, 2080)), [6] * 2, arrival_s=0.05)])
    config = _tiny(cache_tokens=8 * 20)
    monkeypatch.setenv(stats.STATS_ENV, "1")
    # stranded eviction changes this tiny run (one preemption, on a state vLLM keeps anyway)
    monkeypatch.setenv(align.STRANDED_EVICTION_ENV, "0")
    runs, counters = {}, {}
    for resume in ("0", "1"):
        monkeypatch.setenv(align.RESUME_STATES_ENV, resume)
        runs[resume] = run_replay(trace, config, get_policy("plugin"))
        counters[resume] = dict(stats.COUNTERS)
    off, on = runs["0"], runs["1"]
    for run in (off, on):
        assert run.preemptions > 0 and run.mismatches == [] and run.blocks_leaked == 0
    assert "kept:resume" not in counters["0"]
    # the preempted prefill came back to the state kept for it (the oracle checked it)
    assert counters["1"].get("reused:resume", 0) > 0
    assert on.recomputed_prompt_tokens < off.recomputed_prompt_tokens
    assert on.prefill_tokens_computed < off.prefill_tokens_computed


def test_resume_states_stay_exact_over_tiny_pools_and_shared_prefixes(monkeypatch):
    from vllm_hybrid_backends import stats

    # Decodes that outgrow tiny pools preempt prefills on and off block boundaries; a third
    # request resends half the preempted prompt. Every replay stays exact and frees every block.
    monkeypatch.setenv(stats.STATS_ENV, "1")
    kept = reused = replays = 0
    for cache_blocks, prompt_len, output_len, shared in itertools.product(
            (20, 22, 24), (72, 80, 96), (20, 28, 36), (0, 40)):
        prefix = list(range(3000, 3000 + shared))
        trace = Trace("preempted-prefills", [
            TraceRequest("decode", prefix + list(range(1000, 1016)), [5] * output_len),
            TraceRequest("prefill", prefix + list(range(2000, 2000 + prompt_len)), [6] * 2,
                         arrival_s=0.05),
            TraceRequest("resend", prefix + list(range(2000, 2000 + prompt_len // 2)), [7] * 3,
                         arrival_s=0.4)])
        try:
            result = run_replay(trace, _tiny(cache_tokens=8 * cache_blocks), get_policy("plugin"))
        except ReplayError:
            continue  # a prompt the pool can never hold
        replays += 1
        assert result.mismatches == [] and result.blocks_leaked == 0, (cache_blocks, prompt_len)
        kept += stats.COUNTERS.get("kept:resume", 0)
        reused += stats.COUNTERS.get("reused:resume", 0)
    assert replays >= 30 and kept >= 2 and reused > 0


def test_an_evicted_mamba_state_is_counted_and_attributed_as_evicted():
    # "a" caches a state at its prompt boundary (40); three unrelated prompts then pass
    # through a pool too small to keep it; "b" resends a's prompt and finds the state gone.
    a_prompt = list(range(1000, 1041))
    fillers = [TraceRequest(f"f{i}", list(range(2000 + 100 * i, 2041 + 100 * i)), [7] * 2,
                            arrival_s=1.0 + i) for i in range(3)]
    trace = Trace("evict", [TraceRequest("a", a_prompt, [5] * 2), *fillers,
                            TraceRequest("b", a_prompt + [9] * 8, [5] * 2, arrival_s=20.0)])
    hybrid, bound = both_runs(trace, config=_tiny(cache_tokens=8 * 28, max_num_batched_tokens=64))
    assert hybrid.evictions_mamba > 0
    assert bound.requests["b"].hit_tokens == 40 and hybrid.requests["b"].hit_tokens == 0
    # Boundaries 8..32 never had a state (upstream keeps the prompt's last one only); the
    # state at 40 existed and was evicted: kept, it gives all 40 tokens (capacity, not placement).
    assert hybrid.requests["b"].miss_chunks == {"evicted": 40}


@pytest.mark.skipif(not vllm_has_retention_interval(), reason=(
    "this vLLM has no CacheConfig.prefix_cache_retention_interval (added in 0.32)"))
@pytest.mark.parametrize(("shared", "expected"), [
    # a's 44-token prompt runs in 16-token chunks: vLLM computes states at 16, 32 and 40
    pytest.param(24, {0: 0, 32: 0, None: 16}, id="branch-at-24"),
    pytest.param(36, {0: 0, 32: 32, None: 32}, id="branch-at-36"),
])
def test_retention_interval_keeps_vllms_chunk_states_for_a_branch(shared, expected):
    # Under vLLM's default only a's replay boundary (40) keeps its state; every 32 tokens
    # keeps 32 too; dense keeps every chunk's. The plugin composes: exact, never fewer hits.
    a = list(range(100, 144))
    trace = Trace("branch", [TraceRequest("a", a, [1, 2]),
                             TraceRequest("b", a[:shared] + list(range(300, 320)), [3],
                                          arrival_s=1.0)])
    hits: dict[str, dict[int | None, int]] = {"upstream": {}, "plugin": {}}
    for interval in expected:
        for policy in hits:
            result = run_replay(trace, _tiny(retention_interval=interval), get_policy(policy))
            assert result.mismatches == [] and result.blocks_leaked == 0
            hits[policy][interval] = result.requests["b"].hit_tokens
    assert hits["upstream"] == expected
    assert all(hits["plugin"][i] >= expected[i] for i in expected), hits


@pytest.mark.parametrize(("overrides", "scheduler_block"), [
    pytest.param({"retention_interval": 12}, 8, id="off-the-block"),
    # vLLM checks the scheduler block: the lcm of every group's block size
    pytest.param({"retention_interval": 8, "mamba_block_size": 16}, 16, id="off-the-lcm"),
])
def test_a_retention_interval_off_the_scheduler_block_grid_is_refused(overrides,
                                                                       scheduler_block):
    interval = overrides["retention_interval"]
    with pytest.raises(ReplayError, match=(
            rf"--prefix-cache-retention-interval {interval}: vLLM needs 0 \(its default\), a "
            rf"multiple of the scheduler block size \({scheduler_block} tokens here\) or dense")):
        _tiny(**overrides).layout()


def test_a_retention_interval_on_a_vllm_without_the_setting_is_refused(monkeypatch):
    from vllm_hybrid_backends.replay import harness

    monkeypatch.setattr(harness, "vllm_has_retention_interval", lambda: False)
    _tiny().layout()                                  # vLLM's own default: nothing to set
    with pytest.raises(ReplayError, match=r"--prefix-cache-retention-interval needs vLLM's "
                                          r"CacheConfig\.prefix_cache_retention_interval "
                                          r"\(0\.32\+\); this vLLM is "):
        _tiny(retention_interval=None).layout()


@pytest.mark.skipif(not vllm_has_retention_interval(), reason=(
    "this vLLM has no CacheConfig.prefix_cache_retention_interval (added in 0.32)"))
def test_a_retention_interval_reaches_the_report_and_not_the_next_run():
    from vllm_hybrid_backends.replay.report import compare_policies

    a = list(range(100, 144))
    trace = Trace("branch", [TraceRequest("a", a, [1, 2]),
                             TraceRequest("b", a[:36] + list(range(300, 320)), [3],
                                          arrival_s=1.0)])
    dense = compare_policies(trace, _tiny(retention_interval=None), ["upstream"])
    assert dense.to_json()["prefix_cache_retention_interval"] == "dense"
    assert dense.policies["upstream"].token_hit_rate > 0       # the chunk state at 32
    assert dense.policies["upstream"].bound_hit_rate > 0       # the bound ran, at 0
    default = compare_policies(trace, _tiny(), ["upstream"])
    assert "prefix_cache_retention_interval" not in default.to_json()
    assert default.policies["upstream"].token_hit_rate == 0    # nothing left over from dense


def test_ideal_hits_are_token_granular_longest_shared_prefixes():
    trace = Trace("t", [TraceRequest("a", [1, 2, 3, 4, 5], [6, 7]),
                        TraceRequest("b", [1, 2, 3, 9], [1]),
                        TraceRequest("c", [1, 2, 3, 4, 5, 6, 7, 8, 9], [1]),
                        TraceRequest("d", [8, 8], [1])])
    ideal = ideal_hits(trace, {"a": 0, "b": 1, "c": 2, "d": 3})
    # b shares 3 tokens (capped at prompt-1 = 3); c shares a's prompt and output (7 tokens)
    assert ideal == {"a": 0, "b": 3, "c": 7, "d": 0}


def test_mamba_block_smaller_than_attention_block_keeps_states_exact():
    trace = _sharing_trace(4)
    config = _tiny(shape=tiny_shape(("mamba", "mamba", "attention")), block_size=16,
                   mamba_block_size=8, max_num_batched_tokens=24)
    result = run_replay(trace, config, get_policy("upstream"))
    assert result.mismatches == [] and result.blocks_leaked == 0
    assert max(r.hit_tokens for r in result.requests.values()) > 0


#: Mamba2's internal prefill checkpoint exists from vLLM 0.32 on
needs_mamba2_checkpoint = pytest.mark.skipif(
    not has_mamba2_prefill_checkpoint(),
    reason="this vLLM has no Mamba2 prefill checkpoint (Mamba2AttentionMetadata.checkpoint_meta, "
           "added in 0.32; 0.31's layers/mamba/checkpoint.py serves KDA only)")


def upstream_bug(raises, reason, *, plugin_gap=None):
    """Parametrize ``policy`` over a reproduced upstream bug: upstream fails (strict xfail) and
    its twin under the plugin's policy passes, or is a strict xfail saying why the plugin does
    not fix it (``plugin_gap``)."""
    upstream = pytest.param("upstream", marks=pytest.mark.xfail(strict=True, raises=raises,
                                                                reason=reason))
    plugin_marks = () if plugin_gap is None else pytest.mark.xfail(strict=True, raises=raises,
                                                                   reason=plugin_gap)
    return pytest.mark.parametrize("policy", [upstream, pytest.param("plugin", marks=plugin_marks)])


@upstream_bug(AssertionError, (
    "vLLM 0.32 aligns Mamba chunk ends on cache_config.block_size, the smallest group block "
    "size, not the Mamba block size: a Mamba block holding the state after 12 tokens is "
    "cached as the 16-token boundary (open upstream PR #54076)"))
@coarser_mamba_not_on_026
def test_mamba_block_larger_than_attention_block(policy):
    trace = Trace("hetero", [TraceRequest("r0", [16] * 19, [16], 0.01),
                             TraceRequest("r1", [16], [16]), TraceRequest("r2", [16], [16]),
                             TraceRequest("r3", [16] * 21, [16])])
    config = _tiny(shape=tiny_shape(("mamba", "attention")), block_size=4, mamba_block_size=8,
                   cache_tokens=264, max_num_batched_tokens=8, max_num_seqs=3)
    result = run_replay(trace, config, get_policy(policy))
    assert [m.describe() for m in result.mismatches] == []


# Was pinned as an upstream bug ("the Mamba block cached for the 48-token boundary holds the
# state after 56 tokens"): vLLM writes its checkpoint (48) to column cdiv(57, 8) - 2 = 6, the
# column of the 56 boundary, and the fake model's interior store overwrote it with the state
# after 56; vLLM alone stores no interior states, the plugin's plan leaves that column to vLLM.
@pytest.mark.parametrize("policy", ["upstream", "plugin"])
@needs_mamba2_checkpoint
def test_mamba2_checkpoint_with_a_smaller_mamba_block(policy):
    first = list(range(100, 157))
    trace = Trace("ckpt-fine-mamba", [
        TraceRequest("r1", first, [7]), TraceRequest("r2", first + [7, 7], [7], after="r1"),
        TraceRequest("r4", first[:15] + first[:42], [7])])
    config = _tiny(shape=tiny_shape(("mamba", "attention"), kind="MAMBA2"), block_size=16,
                   mamba_block_size=8, cache_tokens=288, max_num_batched_tokens=64,
                   max_num_seqs=1)
    result = run_replay(trace, config, get_policy(policy))
    assert [m.describe() for m in result.mismatches] == []


@pytest.mark.skipif(not vllm_has_prefix_match_unit(), reason=(
    "sub-block hits need vLLM's prefix_match_unit (0.32+)"))
@needs_mamba2_checkpoint
@pytest.mark.parametrize("policy", ["upstream", "plugin"])
def test_mamba2_checkpoint_at_a_unit_boundary_keeps_its_column(policy):
    # r1's one chunk [0, 23): vLLM's checkpoint is the last unit boundary, 20, written to column
    # cdiv(23, 8) - 2 = 1 and keyed at 20; no interior state (16) may go to that block, or r2,
    # which hits 20 tokens, resumes from the state after 16 (branching nemotron-h-8b unit 16).
    first = list(range(100, 123))
    trace = Trace("ckpt-unit", [TraceRequest("r1", first, [7]),
                                TraceRequest("r2", first + [9] * 10, [7], after="r1")])
    config = _tiny(shape=tiny_shape(("mamba", "attention"), kind="MAMBA2"), block_size=8,
                   prefix_match_unit=4, cache_tokens=256, max_num_batched_tokens=64,
                   max_num_seqs=1)
    result = run_replay(trace, config, get_policy(policy))
    assert result.requests["r2"].hit_tokens == 20
    assert [m.describe() for m in result.mismatches] == []


@pytest.mark.skipif(not vllm_has_prefix_match_unit(), reason=(
    "sub-block hits need vLLM's prefix_match_unit (0.32+)"))
@needs_mamba2_checkpoint
def test_interior_blocks_stay_off_the_column_of_vllms_checkpoint():
    # Found on this run: a chunk that stops at a shared-prefix junction inside a block (3,536)
    # is not the prompt's last, so vLLM's manager plans no checkpoint; its worker still writes
    # the checkpoint (3,520) to column cdiv(3536, 1040) - 2, and an interior block the plugin
    # placed there was cached under that column's boundary (3,120): six resumes read the
    # state after 3,520 where 3,120 was promised. (Upstream's run has vLLM's mid-block bug,
    # MID_BLOCK_BUG; only the plugin's is asserted.)
    config = ReplayConfig(model_shape="nemotron-h-8b", cache_tokens=262144, prefix_match_unit=16)
    trace = make_workload("branching", block_size=config.layout().block_size, seed=0)
    result = run_replay(trace, config, get_policy("plugin"))
    assert result.state_checks > 100_000
    assert [m.describe() for m in result.mismatches] == []


@upstream_bug(AssertionError, (
    "vLLM 0.32 V1 worker: the Mamba2 prefill checkpoint of a non-final chunk targets block "
    "column cdiv(end, block)-2, where the worker's appended block table still lists the "
    "speculative block the manager just relocated to the running column; the checkpoint's "
    "conv window overwrites the running conv state"), plugin_gap=(
    "not fixed by the plugin yet: the stale column is in the worker's appended block table "
    "(vLLM's model runner), which no plugin patch rewrites; the plugin's checkpoint store "
    "writes where that table points"))
@needs_mamba2_checkpoint
def test_mamba2_checkpoint_with_spec_decode_hits_relocated_block(policy):
    trace = Trace("ckpt", [TraceRequest("r0", list(range(16, 33)), [16])])
    config = _tiny(shape=tiny_shape(("mamba", "attention"), kind="MAMBA2"), block_size=4,
                   cache_tokens=96, max_num_batched_tokens=8, max_num_seqs=1, num_spec_tokens=1)
    result = run_replay(trace, config, get_policy(policy))
    assert [m.describe() for m in result.mismatches] == []


@upstream_bug(AssertionError, (
    "vLLM 0.32 V1 worker: a running request that is not scheduled for one step leaves the "
    "persistent batch, and InputBatch.add_request resets its num_accepted_tokens to 1; after "
    "an accepted draft in the same block the next forward then reads the state from before it"), plugin_gap=(
    "not fixed by the plugin yet: the reset happens in vLLM's InputBatch.add_request on the "
    "worker, outside the align-mode functions the plugin patches"))
@spec_decode_not_on_026
def test_spec_decode_request_skipped_for_a_step(policy):
    # r2's prefill chunks take the whole 8-token budget ahead of r3 in the running list, so
    # r3 (which just accepted a draft) is skipped for one step.
    long_prompt = [1745, 1745, 804, 1568, 1839, 877, 98] * 2 + list(range(546, 572))
    trace = Trace("skip", [
        TraceRequest("r0", [1745], [1745]),
        TraceRequest("r1", [1745], [1745, 804, 1568, 1839, 877, 98]),
        TraceRequest("r2", long_prompt, [1745]),
        TraceRequest("r3", [1745], [1745, 804, 1568, 1839]),
        TraceRequest("r4", [1745], [1745]),
    ])
    config = _tiny(shape=tiny_shape(("mamba", "attention")), block_size=16, cache_tokens=288,
                   max_num_batched_tokens=8, max_num_seqs=3, num_spec_tokens=1)
    result = run_replay(trace, config, get_policy(policy), accept=lambda rid, k: min(1, k))
    assert [m.describe() for m in result.mismatches] == []


FULL_POOL_CASES = [
    pytest.param("pd_spec_full_pool.jsonl", {"r0": 64, "r4": 80},
                 dict(shape=tiny_shape(("mamba", "attention")), block_size=16, cache_tokens=480,
                      max_num_batched_tokens=32, max_num_seqs=4,
                      long_prefill_token_threshold=8, num_spec_tokens=1), id="spec-decode",
                 marks=(spec_decode_not_on_026, pd_not_on_026)),
    pytest.param("pd_mamba2_full_pool.jsonl", {"r3": 18, "r6": 128},
                 dict(shape=tiny_shape(("mamba", "attention"), kind="MAMBA2"), block_size=4,
                      cache_tokens=304, max_num_batched_tokens=64, max_num_seqs=4),
                 id="mamba2-checkpoint-block", marks=needs_mamba2_checkpoint),
]


@upstream_bug(ReplayError, (
    "vLLM 0.32: a request admitted with external computed tokens (P/D connector) takes one "
    "block more than get_num_blocks_to_allocate counted when its Mamba group needs a block "
    "beyond the external-state and running ones (a speculative block, or Mamba2's prefill "
    "checkpoint block; e.g. 8 taken = 5 attention + external-state, running and speculative "
    "Mamba blocks, 7 counted), so in a nearly full pool BlockPool raises 'Cannot get 1 free "
    "blocks' inside schedule()"))
@pytest.mark.parametrize(("trace_file", "loads", "overrides"), FULL_POOL_CASES)
def test_external_tokens_in_a_full_pool(trace_file, loads, overrides, policy):
    trace = load_trace(Path(__file__).parent / "data" / trace_file)
    run_replay(trace, _tiny(**overrides), get_policy(policy), accept=lambda rid, k: 0,
               external=lambda rid, local, n: max(0, loads.get(rid, 0) - local))


MID_BLOCK_BUG = (
    "vLLM 0.32, Mamba2 internal checkpoints with prefix_match_unit below the block size: a "
    "prefill chunk that starts mid-block (after a sub-block hit, or e.g. 76 externally loaded "
    "tokens with block 8, unit 4) is not stopped at the block boundary because the checkpoint "
    "is exportable, so the block holding the state at the chunk start is cached as the "
    "block-boundary state")
_EXTERNAL = ("pd_mamba2_checkpoint_mid_block.jsonl", {"r2": 76},
             dict(cache_tokens=272, max_num_batched_tokens=24))
_SUB_BLOCK = ("mamba2_checkpoint_partial_hit.jsonl", {},
              dict(cache_tokens=128, max_num_batched_tokens=16))
MID_BLOCK_CASES = [
    pytest.param(*_EXTERNAL, "upstream", id="external-load-upstream",
                 marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=MID_BLOCK_BUG)),
    pytest.param(*_EXTERNAL, "plugin", id="external-load-plugin"),
    pytest.param(*_SUB_BLOCK, "upstream", id="sub-block-hit-upstream",
                 marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=MID_BLOCK_BUG)),
    pytest.param(*_SUB_BLOCK, "plugin", id="sub-block-hit-plugin"),
]


@needs_mamba2_checkpoint
@pytest.mark.parametrize(("trace_file", "loads", "overrides", "policy"), MID_BLOCK_CASES)
def test_mamba2_checkpoint_chunk_starting_mid_block(trace_file, loads, overrides, policy):
    trace = load_trace(Path(__file__).parent / "data" / trace_file)
    config = _tiny(shape=tiny_shape(("mamba", "attention"), kind="MAMBA2"), block_size=8,
                   max_num_seqs=1, prefix_match_unit=4, **overrides)
    external = (lambda rid, local, n: max(0, loads.get(rid, 0) - local)) if loads else None
    result = run_replay(trace, config, get_policy(policy), external=external)
    assert [m.describe() for m in result.mismatches] == []


def _engines_in_one_process(trace: Trace, config: ReplayConfig, count: int) -> list[tuple[Any, Any]]:
    """``count`` plugin engines built and run one after another under one application of the
    patches (as the replay's engines share a process); (result, coordinator state) of each."""
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_kv_cache_coordinator as coordinator
    from vllm_hybrid_backends.replay import harness

    policy = get_policy("plugin")
    previous, coordinator.interior_override = coordinator.interior_override, True
    try:
        with policy.active():
            runs = [harness._Run(trace, config, policy, False, {}, harness._default_accept(), None,
                                 None) for _ in range(count)]
            return [(run.run(), coordinator.state_of(run.scheduler.kv_cache_manager.coordinator))
                    for run in runs]
    finally:
        coordinator.interior_override = previous


def _one_shot_trace() -> Trace:
    # Unrelated single-turn requests whose outputs cross a block boundary: every decode state
    # is kept at first, none is ever reused, so the ledger soon keeps only sampled ones.
    return Trace("one-shot", [TraceRequest(f"r{i}", list(range(3000 + 50 * i, 3020 + 50 * i)),
                                           [7] * 12, arrival_s=float(i)) for i in range(60)])


def test_adaptive_retention_stops_keeping_decode_states_nobody_resumes_from(monkeypatch):
    from vllm_hybrid_backends import align

    [(result, state)] = _engines_in_one_process(_one_shot_trace(), _tiny(), 1)
    assert result.mismatches == []
    kept = state.ledger.kept["decode"]
    assert state.ledger.reused["decode"] == 0
    assert align.RETENTION_WARMUP <= kept < align.RETENTION_WARMUP + 60 // 4
    monkeypatch.setenv(align.ADAPTIVE_RETENTION_ENV, "0")
    [(_, state)] = _engines_in_one_process(_one_shot_trace(), _tiny(), 1)
    assert state.ledger.kept == {}  # off: the ledger records nothing


def test_two_engines_in_one_process_learn_and_evict_independently():
    # The second engine starts from nothing: it keeps (and puts on probation) exactly what an
    # engine alone does, not what is left of the first one's ledger and probation queue.
    config = _tiny(cache_tokens=1024)
    [(alone, alone_state)] = _engines_in_one_process(_one_shot_trace(), config, 1)
    (first, first_state), (second, second_state) = _engines_in_one_process(
        _one_shot_trace(), config, 2)
    assert alone.mismatches == first.mismatches == second.mismatches == []
    assert alone_state.ledger.kept["decode"] >= 1 and alone_state.probation
    for state in (first_state, second_state):
        assert state.ledger.kept == alone_state.ledger.kept
        assert state.ledger.reused == alone_state.ledger.reused
        assert sorted(state.probation) == sorted(alone_state.probation)
    assert second.steps == alone.steps and second.evictions_mamba == alone.evictions_mamba


@pd_not_on_026
@pytest.mark.parametrize("policy, expected_hit", [("upstream", 0), ("plugin", 40)])
def test_decode_side_of_pd_resumes_the_next_turn_from_a_decode_state(policy, expected_hit):
    # "a" arrives with 37 of its 38 prompt tokens computed remotely (P/D): no boundary state
    # exists locally (37 is off the 8-token grid). Decoding crosses 40; the next turn ("b" =
    # a's prompt + answer + a new message) resumes there with the plugin, from nothing upstream.
    prompt = list(range(1000, 1038))
    trace = Trace("pd", [TraceRequest("a", prompt, [5] * 3),
                         TraceRequest("b", prompt + [5] * 3 + [9] * 20, [5] * 2, arrival_s=5.0)])
    result = run_replay(trace, _tiny(), get_policy(policy),
                        external=lambda rid, local, n: n - 1 - local if rid == "a" else 0)
    assert result.mismatches == [] and result.requests["a"].external_tokens == 37
    assert result.requests["a"].hit_tokens == 0  # external tokens are not counted as local hits
    assert result.requests["b"].hit_tokens == expected_hit


def _edited_resend_trace() -> Trace:
    # "b" resends a's 100-token prompt edited at token 70: the tail checkpoint at 64 is the
    # nearest state before the edit (block 8: tails 88, 80, 64, 32)
    prompt = list(range(2000, 2100))
    edited = prompt[:70] + [9] + prompt[71:]
    return Trace("edited", [TraceRequest("a", prompt, [5] * 2),
                            TraceRequest("b", edited, [5] * 2, arrival_s=5.0)])


@no_interior_blocks_on_023
def test_tail_checkpoints_stored_inside_the_chunk_need_no_split(monkeypatch):
    from vllm_hybrid_backends import align

    config = _tiny(max_num_batched_tokens=128)
    inside = run_replay(_edited_resend_trace(), config, get_policy("plugin"))
    monkeypatch.setenv(align.INTERIOR_STATES_ENV, "0")
    split = run_replay(_edited_resend_trace(), config, get_policy("plugin"))
    assert inside.mismatches == [] and split.mismatches == []
    assert inside.requests["b"].hit_tokens == split.requests["b"].hit_tokens == 64
    # "a" prefills in one step instead of stopping at 32, 64, 80 and 88; "b" (from 64) instead
    # of stopping at its own tails 80 and 88
    assert split.steps - inside.steps == 4 + 2
    assert inside.blocks_leaked == 0


@needs_mamba2_checkpoint
def test_mamba2_tail_states_inside_the_chunk_beside_vllms_checkpoint(monkeypatch):
    # The replay models CUDA, where vLLM's Triton scan gives Mamba2's chunk states: the
    # KV-cache manager gives Mamba2 groups interior blocks beside vLLM's prefill checkpoint
    # (the harness's rule, nothing patched here); the fake model stores them (and vLLM's
    # checkpoint) and the oracle checks every state a hit resumes from.
    from vllm_hybrid_backends import align

    config = _tiny(shape=tiny_shape(("mamba", "attention"), kind="MAMBA2"),
                   max_num_batched_tokens=128)
    first_only = Trace("a", _edited_resend_trace().requests[:1])
    inside = run_replay(_edited_resend_trace(), config, get_policy("plugin"))
    inside_first = run_replay(first_only, config, get_policy("plugin"))
    monkeypatch.setenv(align.TAIL_CHECKPOINTS_ENV, "0")
    no_tails = run_replay(_edited_resend_trace(), config, get_policy("plugin"))
    no_tails_first = run_replay(first_only, config, get_policy("plugin"))
    assert inside.mismatches == [] and no_tails.mismatches == []
    # the tail state at 64 serves "b"; without tail states only vLLM's checkpoint (96) exists
    assert (inside.requests["b"].hit_tokens, no_tails.requests["b"].hit_tokens) == (64, 0)
    # "a" keeps its tail states (32, 64, 80, 88) without a chunk split: one prefill step
    assert inside_first.steps == no_tails_first.steps == 2  # prefill, then its second token
    assert inside.blocks_leaked == 0


@no_interior_blocks_on_023
def test_interior_blocks_the_model_does_not_fill_are_reported_as_mismatches(monkeypatch):
    from vllm_hybrid_backends.replay.oracle import FakeHybridWorker

    monkeypatch.setattr(FakeHybridWorker, "_store_interior", lambda self, *args, **kwargs: None)
    result = run_replay(_edited_resend_trace(), _tiny(max_num_batched_tokens=128),
                        get_policy("plugin"))
    assert result.requests["b"].hit_tokens == 64
    assert result.mismatches  # one per Mamba group
    assert {(m.request_id, m.expected_tokens) for m in result.mismatches} == {("b", 64)}


@pytest.mark.parametrize("cache_tokens", [96, 128, 192, 256, 384])
def test_interior_blocks_never_keep_a_request_from_being_scheduled(cache_tokens):
    # A pool too small for a chunk's interior blocks: vLLM's own allocation must still run
    # (without them), as it does upstream; a request must never wait on blocks that are optional.
    prefix = list(range(100, 148))
    trace = Trace("tight", [TraceRequest(f"r{i}", prefix + [60 + i] * 9, [7, 8], 0.2 * i)
                            for i in range(4)])
    config = _tiny(cache_tokens=cache_tokens, max_num_batched_tokens=64)
    upstream = run_replay(trace, config, get_policy("upstream"))
    plugin = run_replay(trace, config, get_policy("plugin"))
    assert upstream.mismatches == [] and plugin.mismatches == []
    assert all(r.finish_time is not None for r in plugin.requests.values())
    assert plugin.blocks_leaked == 0


def test_a_smaller_block_after_a_larger_one_gets_its_own_hash_block_size():
    # runs share one vLLM config per process; vLLM 0.23 took the previous run's hash block size
    # (8) as a request and refused 4-token blocks ("Invalid hash_block_size=8")
    trace = Trace("one", [TraceRequest("r0", list(range(100, 120)), [5, 6])])
    for block in (8, 4):
        result = run_replay(trace, _tiny(block_size=block), get_policy("plugin"))
        assert result.mismatches == [] and result.requests["r0"].finish_time is not None, block


@pytest.mark.parametrize("kind, setting, resumes_past_answer", [
    pytest.param("GDN_ATTN", None, True, id="gdn-default-on"),
    pytest.param("MAMBA2", None, False, id="mamba2-default-off"),
    pytest.param("GDN_ATTN", "0", False, id="gdn-set-off"),
    pytest.param("MAMBA2", "1", True, id="mamba2-set-on"),
])
def test_decode_states_default_by_kind(monkeypatch, kind, setting, resumes_past_answer):
    # docs/decode_states.md decides: on for the gated delta net (its drift stays within
    # prefill-path noise), off for Mamba2 unless set. "b" is a's prompt + answer + a new
    # message: past the answer only from a decode state (block 8: the prompt's last boundary
    # is 32, decoding crosses 40 and 48)
    from vllm_hybrid_backends import align

    if setting is None:
        monkeypatch.delenv(align.DECODE_CHECKPOINTS_ENV, raising=False)
    else:
        monkeypatch.setenv(align.DECODE_CHECKPOINTS_ENV, setting)
    prompt, answer = list(range(1000, 1036)), [5] * 14
    trace = Trace("two-turns", [TraceRequest("a", prompt, answer),
                                TraceRequest("b", prompt + answer + [9] * 20, [5] * 2,
                                             arrival_s=5.0)])
    result = run_replay(trace, _tiny(shape=tiny_shape(kind=kind)), get_policy("plugin"))
    assert result.mismatches == []
    hit = result.requests["b"].hit_tokens
    # vLLM 0.23 keeps every decode-boundary state itself (no retention interval for Mamba), so
    # there upstream resumes past the answer too and the setting only decides what is added
    upstream = run_replay(trace, _tiny(shape=tiny_shape(kind=kind)), get_policy("upstream"))
    upstream_hit = upstream.requests["b"].hit_tokens
    assert upstream_hit in (32, 48) and upstream.mismatches == []
    assert hit == max(48 if resumes_past_answer else 32, upstream_hit), (hit, upstream_hit)


@needs_mamba2_checkpoint
def test_mamba2_sub_block_hit_without_decode_states(monkeypatch):
    from vllm_hybrid_backends import align

    monkeypatch.setenv(align.DECODE_CHECKPOINTS_ENV, "0")
    test_mamba2_checkpoint_chunk_starting_mid_block(*_SUB_BLOCK, "plugin")


def _shared_system_prompt_trace(prefix_len: int = 12, own_len: int = 40,
                                prompts: int = 4) -> Trace:
    """``prompts`` prompts that share only a ``prefix_len``-token system prompt, shorter than
    a block, each arriving after the previous one finished."""
    system = list(range(500, 500 + prefix_len))
    requests = []
    for i in range(prompts):
        own = [1000 * (i + 1) + t for t in range(own_len)]
        requests.append(TraceRequest(f"r{i}", system + own, [7] * 2, arrival_s=0.1,
                                     after=f"r{i - 1}" if i else None))
    return Trace("system-prompt", requests)


@pytest.mark.skipif(not vllm_has_prefix_match_unit(), reason=(
    "sub-block hits need vLLM's prefix_match_unit (0.32+)"))
@pytest.mark.parametrize(("shape", "maker"), [
    # two GDN groups: a state holds 32 tokens of prefix; 12 tokens x 3 branches reach it
    (tiny_shape(), 3),
    # one Mamba2 group: 16 tokens, from the second branch
    (tiny_shape(("mamba", "attention"), kind="MAMBA2"), 2)], ids=["gdn", "mamba2"])
def test_a_system_prompt_inside_a_block_is_hit_once_its_state_pays(monkeypatch, shape, maker):
    from vllm_hybrid_backends import align

    config = _tiny(shape=shape, block_size=16, prefix_match_unit=4, max_num_batched_tokens=64)
    trace = _shared_system_prompt_trace(prompts=5)
    runs = {policy: run_replay(trace, config, get_policy(policy))
            for policy in ("upstream", "plugin")}
    monkeypatch.setenv(align.SUBBLOCK_JUNCTIONS_ENV, "0")
    runs["plugin, junctions off"] = run_replay(trace, config, get_policy("plugin"))
    hits = {name: [run.requests[f"r{i}"].hit_tokens for i in range(5)]
            for name, run in runs.items()}
    # r1 learns where it leaves r0 (12 tokens); the request that finds enough branches
    # keeps both groups' state there, and every later one hits it
    assert hits == {"upstream": [0] * 5, "plugin": [0] * (maker + 1) + [12] * (4 - maker),
                    "plugin, junctions off": [0] * 5}
    for run in runs.values():
        assert run.mismatches == [] and run.blocks_leaked == 0


@pytest.mark.skipif(not vllm_has_prefix_match_unit(), reason=(
    "sub-block hits need vLLM's prefix_match_unit (0.32+)"))
def test_no_junction_state_where_the_pool_has_no_room(monkeypatch):
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_sched_scheduler as scheduler_patch

    # 1,024 tokens of 16-token blocks: fewer free blocks than a prompt's 4 + 64 spare
    config = _tiny(block_size=16, prefix_match_unit=4, max_num_batched_tokens=64,
                   cache_tokens=1024)
    trace = _shared_system_prompt_trace(prompts=5)
    tight = run_replay(trace, config, get_policy("plugin"))
    monkeypatch.setattr(scheduler_patch, "JUNCTION_SPARE_BLOCKS", 0)
    spare_ignored = run_replay(trace, config, get_policy("plugin"))
    assert [tight.requests[f"r{i}"].hit_tokens for i in range(5)] == [0] * 5
    assert [spare_ignored.requests[f"r{i}"].hit_tokens for i in range(5)] == [0] * 4 + [12]
    assert tight.mismatches == [] and spare_ignored.mismatches == []


@pytest.mark.skipif(not vllm_has_prefix_match_unit(), reason=(
    "sub-block hits need vLLM's prefix_match_unit (0.32+)"))
def test_a_junction_in_the_block_of_the_prompts_end_keeps_its_attention_key():
    # 4 shared tokens + 8 own in 16-token blocks: vLLM keys the prompt's last unit (8) on the
    # junction's block and drops its shorter keys; the junction's key must come back
    config = _tiny(block_size=16, prefix_match_unit=4, max_num_batched_tokens=64)
    result = run_replay(_shared_system_prompt_trace(4, 8, prompts=10), config,
                        get_policy("plugin"))
    # 4 tokens against a 32-token state: kept once 8 prompts went on past it (by r8), hit by r9
    assert [result.requests[f"r{i}"].hit_tokens for i in range(10)] == [0] * 9 + [4]
    assert result.mismatches == [] and result.blocks_leaked == 0


@pytest.mark.skipif(not vllm_has_prefix_match_unit(), reason=(
    "sub-block hits need vLLM's prefix_match_unit (0.32+)"))
@needs_mamba2_checkpoint
def test_mamba2_tail_state_is_not_kept_in_vllms_checkpoint_column():
    # Found by `make fuzz`: r0's first chunk [0, 16) with unit 4 and 8-token blocks: vLLM's
    # worker writes its checkpoint (12, the last unit below 16) to column 0, the column of
    # r0's tail state at 8; keeping that block as the state at 8 gave r3 the state after 12
    first = [1745, 804, 1568, 1839, 877, 98, 546, 1993, 1063, 1011, 845, 1896, 1621, 1715,
             637, 1998, 1745]
    trace = Trace("ckpt-column", [TraceRequest("r0", first, [1745]),
                                  TraceRequest("r3", first[:8] + [1745], [1745], after="r0")])
    config = _tiny(shape=tiny_shape(("mamba", "attention"), kind="MAMBA2"), block_size=8,
                   prefix_match_unit=4, cache_tokens=128, max_num_batched_tokens=16,
                   max_num_seqs=1)
    result = run_replay(trace, config, get_policy("plugin"))
    assert [m.describe() for m in result.mismatches] == []


def _deep_branch_trace() -> Trace:
    # "b" shares a's first 150 tokens of 400 (block 8: a's last boundary is 392, the dense tail
    # reach 8 blocks back ends at 328; far states at 16 and 32 blocks back: 264 and 136)
    prompt = list(range(3000, 3400))
    return Trace("deep", [TraceRequest("a", prompt, [5] * 2),
                          TraceRequest("b", prompt[:150] + list(range(7000, 7100)), [6] * 2,
                                       arrival_s=5.0)])


@no_interior_blocks_on_023
@pytest.mark.parametrize("shape", [
    pytest.param(tiny_shape(), id="gdn"),
    pytest.param(tiny_shape(("mamba", "attention"), kind="MAMBA2"), id="mamba2",
                 marks=needs_mamba2_checkpoint)])
@pytest.mark.parametrize("budget", [128, 136], ids=["inside-a-chunk", "at-a-chunk-end"])
def test_a_branch_deep_inside_an_earlier_prompt_resumes_from_a_far_state(monkeypatch, shape,
                                                                          budget):
    from vllm_hybrid_backends import align

    # 136-token chunks end on the far state at 136: it is kept on the same terms as one
    # stored inside a chunk
    config = _tiny(shape=shape, max_num_batched_tokens=budget)
    runs = {policy: run_replay(_deep_branch_trace(), config, get_policy(policy))
            for policy in ("upstream", "plugin")}
    monkeypatch.setenv(align.FAR_CHECKPOINTS_ENV, "0")
    runs["plugin, far off"] = run_replay(_deep_branch_trace(), config, get_policy("plugin"))
    assert {name: run.requests["b"].hit_tokens for name, run in runs.items()} == {
        "upstream": 0, "plugin": 136, "plugin, far off": 0}
    for run in runs.values():
        assert run.mismatches == [] and run.blocks_leaked == 0
    # stored inside the chunk: "a" alone prefills in as many steps with far states as without
    alone = Trace("alone", _deep_branch_trace().requests[:1])
    steps_off = run_replay(alone, config, get_policy("plugin")).steps
    monkeypatch.delenv(align.FAR_CHECKPOINTS_ENV)
    assert run_replay(alone, config, get_policy("plugin")).steps == steps_off


@no_interior_blocks_on_023
def test_no_far_state_where_the_pool_has_no_room(monkeypatch):
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_kv_cache_coordinator as coordinator

    # 100 blocks: a's prompt alone holds 50 attention blocks; fewer than 64 uncached blocks
    # would remain after the far states' blocks
    config = _tiny(max_num_batched_tokens=128, cache_tokens=800)
    tight = run_replay(_deep_branch_trace(), config, get_policy("plugin"))
    monkeypatch.setattr(coordinator, "ROOMY_UNCACHED_BLOCKS", 0)
    room_ignored = run_replay(_deep_branch_trace(), config, get_policy("plugin"))
    assert (tight.requests["b"].hit_tokens, room_ignored.requests["b"].hit_tokens) == (0, 136)
    assert tight.mismatches == [] and room_ignored.mismatches == []


def _one_off_prompts_trace(prompts: int = 200, every: int = 10, lag: int = 40) -> Trace:
    # 83-token prompts that share nothing; one in ``every`` comes back ``lag`` prompts later
    # leaving it inside its last full block (block 8: the hit is 72 tokens, one block before
    # the prompt's last boundary, 80: a tail-1 state); no kind is reused 1 in 8
    requests = []
    for i in range(prompts):
        prompt = [10000 * (i + 1) + k for k in range(83)]
        requests.append(TraceRequest(f"p{i}", prompt, [1] * 2, arrival_s=i * 0.5))
        if i % every == 0:
            requests.append(TraceRequest(f"f{i}", prompt[:74] + [7] * 20, [2] * 2,
                                         arrival_s=(i + lag) * 0.5 + 0.25))
    return Trace("one-off", sorted(requests, key=lambda r: r.arrival_s))


@no_interior_blocks_on_023
def test_a_rarely_reused_tail_kind_is_kept_when_it_saves_more_per_block_than_vllms_own(monkeypatch):
    from vllm_hybrid_backends import align

    # 2,000 blocks: the pool fills (trial states on probation are evicted before their
    # follow-up) but every follow-up still finds its prompt's attention blocks
    config = _tiny(cache_tokens=16000, max_num_batched_tokens=256)
    runs = {"upstream": run_replay(_one_off_prompts_trace(), config, get_policy("upstream")),
            "plugin": run_replay(_one_off_prompts_trace(), config, get_policy("plugin"))}
    monkeypatch.setenv(align.VALUE_RETENTION_ENV, "0")
    runs["value rule off"] = run_replay(_one_off_prompts_trace(), config, get_policy("plugin"))
    hits = {name: sum(r.hit_tokens for key, r in run.requests.items() if key.startswith("f"))
            for name, run in runs.items()}
    assert hits["upstream"] == 0 and hits["plugin"] == 20 * 72
    assert hits["value rule off"] < hits["plugin"] // 2
    for run in runs.values():
        assert run.mismatches == [] and run.blocks_leaked == 0


def _conversations_trace(sessions: int = 16, turns: int = 5, siblings: int = 0) -> Trace:
    # Interleaved conversations whose every turn resends the previous prompt and adds 10-30
    # tokens; with ``siblings``, each turn's message is also replaced by another one soon
    # after (an edited message: a fork at the previous turn's end, which the turn went past).
    rng = random.Random(0)
    requests = []
    for s in range(sessions):
        prompt = [50000 + 1000 * s + k for k in range(rng.randint(12, 30))]
        start = s * 0.6
        for turn in range(turns):
            previous, fresh = prompt, 60000 + 1000 * s + 40 * turn
            prompt = prompt + [fresh + k for k in range(rng.randint(10, 30))]
            at = start + 4.0 * turn
            requests.append(TraceRequest(f"s{s}t{turn}", list(prompt), [7] * 3, arrival_s=at))
            for b in range(siblings if turn else 0):
                edited = previous + [90000 + 1000 * s + 40 * turn + 10 * b + k for k in range(12)]
                requests.append(TraceRequest(f"s{s}t{turn}b{b}", edited, [7] * 3,
                                             arrival_s=at + 0.3 + 0.2 * b))
    return Trace("conversations", sorted(requests, key=lambda r: r.arrival_s))


@pytest.mark.parametrize("cache_tokens", [1600, 2000])
def test_a_conversations_earlier_turn_states_go_before_the_states_its_next_turn_needs(
        monkeypatch, cache_tokens):
    from vllm_hybrid_backends import align, stats

    # Under pressure vLLM's LRU keeps every turn's state of a conversation; once the next turn
    # has gone past one, the cache holds the deeper one the turn after will need.
    config = _tiny(cache_tokens=cache_tokens)
    monkeypatch.setenv(stats.STATS_ENV, "1")
    # passed states alone (with stranded eviction, on by default, the plugin hits more either
    # way: 2,288 and 4,360 tokens with them, 1,568 and 3,560 without; upstream 1,520 and 3,000)
    monkeypatch.setenv(align.STRANDED_EVICTION_ENV, "0")
    hits, counters = {}, {}
    for name, policy, passed in (("upstream", "upstream", "1"), ("off", "plugin", "0"),
                                 ("on", "plugin", "1")):
        monkeypatch.setenv(align.PASSED_STATES_ENV, passed)
        run = run_replay(_conversations_trace(), config, get_policy(policy))
        assert run.mismatches == [] and run.blocks_leaked == 0
        hits[name] = sum(r.hit_tokens for r in run.requests.values())
        counters[name] = dict(stats.COUNTERS)
    assert hits["on"] >= 1.25 * hits["off"] and hits["off"] >= hits["upstream"]
    # the operator's counters show the rule at work: passed states, most evicted unused
    assert "kept:passed" not in counters["off"]
    assert counters["on"]["kept:passed"] >= align.RETENTION_WARMUP
    assert counters["on"].get("evicted:passed", 0) > counters["on"].get("reused:passed", 0)


def test_passed_states_that_forks_resume_from_keep_their_lru_place(monkeypatch):
    from vllm_hybrid_backends import align

    # Every turn is retried from inside it soon after: the passed states are reused, so the
    # ledger never puts them on probation (a fork found them where upstream keeps them).
    config = _tiny(cache_tokens=1600)
    runs = {}
    for passed in ("0", "1"):
        monkeypatch.setenv(align.PASSED_STATES_ENV, passed)
        [(runs[passed], state)] = _engines_in_one_process(
            _conversations_trace(siblings=1), config, 1)
        assert runs[passed].mismatches == [] and runs[passed].blocks_leaked == 0
    assert state.ledger.kept[align.PASSED] >= align.RETENTION_WARMUP
    assert state.ledger.reused[align.PASSED] * align.RETENTION_MIN_REUSE >= \
        state.ledger.kept[align.PASSED]
    assert not state.passed  # never moved
    assert [r.hit_tokens for r in runs["1"].requests.values()] == \
        [r.hit_tokens for r in runs["0"].requests.values()]
