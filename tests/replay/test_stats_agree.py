"""The plugin's online counters (VLLM_HYBRID_STATS) agree with the replay's lookup-time miss
attribution: equal where both see the same attention reach (nothing evicted), the same reasons
and no more tokens where the hybrid pool evicted attention blocks too."""

from __future__ import annotations

import pytest

from vllm_hybrid_backends import stats
from vllm_hybrid_backends.compat import version_allows
from vllm_hybrid_backends.replay.harness import ReplayConfig, run_replay
from vllm_hybrid_backends.replay.policy import get_policy
from vllm_hybrid_backends.replay.shapes import tiny_shape
from vllm_hybrid_backends.replay.workloads import Trace, TraceRequest

pytestmark = pytest.mark.slow


def _config(**overrides):
    base = dict(shape=tiny_shape(), platform="any", block_size=8, cache_tokens=4096,
                max_num_batched_tokens=16, max_num_seqs=4)
    base.update(overrides)
    return ReplayConfig(**base)


def _evicting_trace() -> Trace:
    # "a" keeps states; unrelated prompts push some of them out; "b" resends a's prompt,
    # "c" continues a's conversation past its answer
    a_prompt = list(range(1000, 1041))
    fillers = [TraceRequest(f"f{i}", list(range(2000 + 100 * i, 2041 + 100 * i)), [7] * 2,
                            arrival_s=1.0 + i) for i in range(3)]
    return Trace("evict", [TraceRequest("a", a_prompt, [5] * 20), *fillers,
                           TraceRequest("b", a_prompt + [9] * 8, [5] * 2, arrival_s=20.0),
                           TraceRequest("c", a_prompt + [5] * 20 + [3] * 9, [5] * 2,
                                        arrival_s=30.0)])


# The evicting pool. vLLM 0.23 keeps a running request's Mamba state at every block boundary
# (dense retention; 0.26+ keeps only the states it may reuse), so each filler holds about twice
# the blocks it holds on later versions: in 28 blocks the fillers evict every state "a" kept
# before "b" and "c" arrive (measured on 0.23: kept 17, evicted 15, reused 0, no hit under
# either policy) and the case has nothing to compare. 44 blocks still evict there (evicted 12)
# while a kept state is reused.
EVICTING_BLOCKS = 28 if version_allows(">=0.26") else 44


@pytest.mark.parametrize("cache_tokens", [pytest.param(8 * EVICTING_BLOCKS, id="evicting"),
                                          pytest.param(4096, id="roomy")])
def test_online_miss_counters_match_the_replay_attribution(monkeypatch, cache_tokens):
    monkeypatch.setenv(stats.STATS_ENV, "1")
    trace = _evicting_trace()
    config = _config(cache_tokens=cache_tokens, max_num_batched_tokens=64)
    policy = get_policy("plugin")
    bound = run_replay(trace, config, policy, attention_only=True)
    stats.reset()
    hybrid = run_replay(trace, config, policy,
                        bound_hits={k: r.hit_tokens for k, r in bound.requests.items()})
    assert hybrid.mismatches == []
    replay_reasons: dict[str, int] = {}
    for record in hybrid.requests.values():
        for reason, tokens in record.miss_chunks.items():
            replay_reasons[reason] = replay_reasons.get(reason, 0) + tokens
    online = {k.split(":", 1)[1]: v for k, v in stats.COUNTERS.items()
              if k.startswith("missed_tokens:") and v}
    if cache_tokens < 4096:
        # The replay bounds each lookup by the attention-only run's hit, the plugin by the
        # attention blocks still cached: where those were evicted too, only the replay counts.
        # (per reason they may differ: the deepest state decides, and the two walks start from
        # different bounds)
        assert online and sum(online.values()) < sum(replay_reasons.values())
    else:
        assert online == replay_reasons
    kept = sum(v for k, v in stats.COUNTERS.items() if k.startswith("kept:"))
    reused = sum(v for k, v in stats.COUNTERS.items() if k.startswith("reused:"))
    assert kept > 0
    hits = sum(1 for r in hybrid.requests.values() if r.hit_tokens)
    assert 0 < reused <= hits
    if cache_tokens < 4096:
        assert sum(v for k, v in stats.COUNTERS.items() if k.startswith("evicted:")) > 0
    else:
        assert not any(k.startswith("evicted:") for k in stats.COUNTERS)


def test_a_replay_with_stats_on_leaves_scheduler_stats_as_it_was(monkeypatch):
    from vllm.v1.metrics.stats import SchedulerStats

    before = set(SchedulerStats.__dataclass_fields__)
    monkeypatch.setenv(stats.STATS_ENV, "1")
    run_replay(_evicting_trace(), _config(cache_tokens=4096, max_num_batched_tokens=64),
               get_policy("plugin"))
    assert set(SchedulerStats.__dataclass_fields__) == before
    assert "hybrid" not in SchedulerStats.__dataclass_fields__


def test_every_count_travels_with_a_request_output(monkeypatch):
    """vLLM 0.23/0.26's offline ``LLMEngine.step`` records no stats of a step without a request
    output (a prefill chunk that samples nothing): every count must reach the front-end on
    steps with one, so such a front-end still sees all of them."""
    from vllm.v1.core.sched.scheduler import Scheduler

    delivered: dict[str, int] = {}
    silent_steps = []
    init = Scheduler.__init__

    def init_logging_stats(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "log_stats": True})
        update = self.update_from_output  # as patched by the plugin

        def front_end_view(*args, **kwargs):
            outputs = update(*args, **kwargs)
            carrier = next(eco for eco in outputs.values() if eco.scheduler_stats is not None)
            hybrid = getattr(carrier.scheduler_stats, "hybrid", None)
            if carrier.outputs:
                for name, value in (hybrid or {}).items():
                    delivered[name] = delivered.get(name, 0) + value
            else:
                silent_steps.append(hybrid)
            return outputs

        self.update_from_output = front_end_view

    monkeypatch.setattr(Scheduler, "__init__", init_logging_stats)
    monkeypatch.setenv(stats.STATS_ENV, "1")
    stats.reset()
    run_replay(_evicting_trace(), _config(max_num_batched_tokens=16), get_policy("plugin"))
    counted = {k: v for k, v in stats.COUNTERS.items() if v}
    assert silent_steps, "no prefill chunk without an output: the case tests nothing"
    assert all(hybrid is None for hybrid in silent_steps)
    assert counted.get("kept:tail", 0) > 0 and counted.get("kept:vllm", 0) > 0, counted
    assert delivered == counted
