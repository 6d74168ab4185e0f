"""The ideal, the gap decomposition and sub-block units (``--prefix-match-unit``)."""

from __future__ import annotations

import random

import pytest

from vllm_hybrid_backends.replay import engine_config
from vllm_hybrid_backends.replay.engine_config import ReplayVersionError
from vllm_hybrid_backends.replay.harness import ReplayConfig, ReplayError, run_replay
from vllm_hybrid_backends.replay.metrics import ideal_hits, policy_metrics
from vllm_hybrid_backends.replay.policy import get_policy
from vllm_hybrid_backends.replay.report import sweep_prefix_match_units
from vllm_hybrid_backends.replay.shapes import tiny_shape
from vllm_hybrid_backends.replay.workloads import Trace, TraceRequest

#: sub-block hits (``prefix_match_unit``) exist from vLLM 0.32 on
needs_prefix_match_unit = pytest.mark.skipif(
    not engine_config.vllm_has_prefix_match_unit(),
    reason="this vLLM has no CacheConfig.prefix_match_unit (added in 0.32)")


def _brute_force_ideal(trace: Trace) -> dict[str, int]:
    """Longest common prefix with any earlier request's prompt + output, capped at len - 1."""
    result: dict[str, int] = {}
    earlier: list[list[int]] = []
    for request in trace.requests:
        prompt = request.prompt_token_ids
        best = 0
        for sequence in earlier:
            n = 0
            while n < len(prompt) - 1 and n < len(sequence) and sequence[n] == prompt[n]:
                n += 1
            best = max(best, n)
        result[request.id] = best
        earlier.append(prompt + request.output_token_ids)
    return result


def test_ideal_hits_equal_a_brute_force_longest_common_prefix():
    rng = random.Random(7)
    system = [rng.randrange(16, 400) for _ in range(37)]
    # A shared head followed by a common tail that each request follows for a different length:
    # the longest match is with one request among many sharing the head, so every
    # continuation after the head has to be considered, not a few.
    tail = [rng.randrange(16, 400) for _ in range(40)]
    requests = []
    for i in range(30):
        follow = rng.randrange(0, len(tail))
        prompt = system + tail[:follow] + [rng.randrange(400, 500) for _ in range(rng.randrange(1, 9))]
        if i % 5 == 4:  # a follow-up turn: an earlier request's prompt and output, extended
            previous = requests[rng.randrange(len(requests))]
            prompt = previous.prompt_token_ids + previous.output_token_ids + [7, 8, 9][: 1 + i % 3]
        requests.append(TraceRequest(f"r{i}", prompt, [rng.randrange(16, 500) for _ in range(5)]))
    trace = Trace("lcp", requests)
    order = {r.id: i for i, r in enumerate(requests)}
    expected = _brute_force_ideal(trace)
    assert ideal_hits(trace, order) == expected
    assert sum(expected.values()) > len(requests) * len(system)  # continuations really count


def _tiny(**overrides):
    base = dict(shape=tiny_shape(), platform="any", block_size=8, cache_tokens=4096,
                max_num_batched_tokens=32, max_num_seqs=4)
    base.update(overrides)
    return ReplayConfig(**base)


def _branching_trace() -> Trace:
    """Sessions sharing a 45-token system prompt (not a block multiple); each turn resends
    the previous prompt + answer plus new tokens; unrelated fillers in between evict."""
    system = list(range(100, 145))
    requests: list[TraceRequest] = []
    for s in range(3):
        prompt = system + [300 + 10 * s + k for k in range(3 + s)]
        for turn in range(3):
            rid = f"s{s}t{turn}"
            output = [600 + 20 * s + turn] * 4
            requests.append(TraceRequest(rid, prompt, output, arrival_s=2.0 * (3 * turn + s)))
            prompt = prompt + output + [700 + s * 9 + turn] * (2 + turn)
        requests.append(TraceRequest(f"f{s}", list(range(2000 + 200 * s, 2080 + 200 * s)),
                                     [9] * 3, arrival_s=2.0 * (3 * s + 1) + 0.5))
    return Trace("branching", requests)


def _metrics(trace: Trace, config: ReplayConfig, policy: str = "upstream"):
    bound = run_replay(trace, config, get_policy(policy), attention_only=True)
    hybrid = run_replay(trace, config, get_policy(policy),
                        bound_hits={k: r.hit_tokens for k, r in bound.requests.items()})
    return hybrid, bound, policy_metrics(trace, hybrid, bound)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["upstream", "plugin"])
@pytest.mark.parametrize("unit", [None, pytest.param(4, marks=needs_prefix_match_unit)],
                         ids=["block-grid", "unit-4"])
def test_gap_to_ideal_parts_add_up_to_ideal_minus_hit(policy, unit):
    trace = _branching_trace()
    config = _tiny(cache_tokens=8 * 26, prefix_match_unit=unit)
    hybrid, bound, metrics = _metrics(trace, config, policy)
    assert metrics.state_mismatches == 0, metrics.mismatch_examples
    order = {rid: rec.admitted_order for rid, rec in hybrid.requests.items()}
    ideal = sum(ideal_hits(trace, order).values())
    hit = sum(r.hit_tokens for r in hybrid.requests.values())
    gap = metrics.gap_to_ideal
    assert sum(gap.values()) == ideal - hit
    assert gap["other"] == 0
    # the trace exercises every cause: a 45-token system prompt (granularity), branch points
    # without states (placement) and fillers through a small pool (capacity)
    # (the plugin may close the placement part: its states sit at the branch points)
    assert gap["granularity"] > 0 and gap["capacity"] > 0, gap
    assert gap["placement"] > 0 if policy == "upstream" else gap["placement"] >= 0, gap


@pytest.mark.slow
@needs_prefix_match_unit
def test_a_sub_block_unit_runs_the_bound_at_that_unit_and_hits_inside_blocks():
    trace = _branching_trace()
    hybrid, bound, metrics = _metrics(trace, _tiny(prefix_match_unit=4))
    grid_hybrid, grid_bound, grid = _metrics(trace, _tiny())
    assert bound.block_size == 4 and grid_bound.block_size == 8
    assert metrics.state_mismatches == 0 and hybrid.blocks_leaked == 0
    # some hit ends inside an 8-token block, on the 4-token grid
    ends = {r.hit_tokens % 8 for r in hybrid.requests.values() if r.hit_tokens}
    assert 4 in ends and all(r.hit_tokens % 4 == 0 for r in hybrid.requests.values())
    assert {r.hit_tokens % 4 for r in bound.requests.values()} == {0}
    assert metrics.bound_hit_rate > grid.bound_hit_rate
    assert metrics.gap_to_ideal["granularity"] < grid.gap_to_ideal["granularity"]


@pytest.mark.parametrize("unit", [3, 16, 0])
def test_a_unit_that_does_not_divide_the_block_is_refused_naming_the_allowed_ones(unit):
    with pytest.raises(ReplayError, match=rf"--prefix-match-unit {unit}: vLLM needs a divisor "
                       r"of every KV-cache group's block size \(8 here\); allowed: 1, 2, 4, 8$"):
        _tiny(prefix_match_unit=unit).layout()


@pytest.mark.slow
@needs_prefix_match_unit
def test_best_unit_sweep_reports_each_policy_at_its_best_unit():
    trace = _branching_trace()
    config = _tiny(block_size=16)
    report = sweep_prefix_match_units(trace, config, ["upstream", "plugin"], min_unit=4)
    for name, metrics in report.policies.items():
        assert list(report.unit_sweep[name]) == [16, 8, 4]
        best = max(report.unit_sweep[name].values())
        assert metrics.token_hit_rate == best
        assert report.unit_sweep[name][metrics.prefix_match_unit] == best
    alone = _metrics(trace, _tiny(block_size=16, prefix_match_unit=4))[2]
    assert report.unit_sweep["upstream"][4] == alone.token_hit_rate
    # the per-request comparison holds only between runs at one unit
    units = {name: metrics.prefix_match_unit for name, metrics in report.policies.items()}
    assert report.policies["upstream"].versus_first is None
    assert (report.policies["plugin"].versus_first is None) == (units["plugin"] != units["upstream"])


def test_a_unit_on_a_vllm_without_prefix_match_unit_is_refused(monkeypatch):
    monkeypatch.setattr(engine_config, "vllm_has_prefix_match_unit", lambda: False)
    with pytest.raises(ReplayVersionError, match=r"prefix_match_unit=4: vLLM .* has no "
                       r"CacheConfig.prefix_match_unit \(sub-block hits need vLLM 0.32\+\)"):
        run_replay(_branching_trace(), _tiny(prefix_match_unit=4), get_policy("upstream"))


@pytest.mark.slow
@needs_prefix_match_unit
@pytest.mark.parametrize("plugin_prefers_fine", [True, False], ids=["units-differ", "same-unit"])
def test_the_best_unit_sweep_compares_requests_only_at_one_unit(monkeypatch, plugin_prefers_fine):
    from dataclasses import replace

    from vllm_hybrid_backends.replay import report as report_module

    real = report_module.compare_policies

    def compare(trace, config, policies, *args, **kwargs):  # upstream's best unit is 16
        result = real(trace, config, policies, *args, **kwargs)
        unit = result.policies["upstream"].prefix_match_unit
        for name, metrics in result.policies.items():
            prefers_fine = name == "plugin" and plugin_prefers_fine
            result.policies[name] = replace(metrics, token_hit_rate=1 / unit if prefers_fine
                                            else unit / 100)
        return result

    monkeypatch.setattr(report_module, "compare_policies", compare)
    report = sweep_prefix_match_units(_branching_trace(), _tiny(block_size=16),
                                      ["upstream", "plugin"], min_unit=4)
    units = {name: metrics.prefix_match_unit for name, metrics in report.policies.items()}
    assert units == {"upstream": 16, "plugin": 4 if plugin_prefers_fine else 16}
    versus = report.policies["plugin"].versus_first
    assert (versus is None) == plugin_prefers_fine
