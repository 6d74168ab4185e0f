"""``bench/eviction_headroom.py``: the cache model behind the LRU / offline comparison (the
table in docs/results.md comes from a real run on the public traces)."""

from __future__ import annotations

import pytest

from vllm_hybrid_backends.replay.workloads import Trace, TraceRequest

BLOCK = 4


def _trace(*prompts: list[int], after: dict[int, int] | None = None) -> Trace:
    after = after or {}
    return Trace("t", [TraceRequest(f"r{i}", p, [1], arrival_s=float(i),
                                    after=f"r{after[i]}" if i in after else None)
                       for i, p in enumerate(prompts)], "test")


def _blocks(*ids: int) -> list[int]:
    return [token for i in ids for token in [i] * BLOCK]


def test_a_hybrid_hit_stops_at_the_deepest_state_an_attention_hit_does_not(load_bench):
    bench = load_bench("eviction_headroom")
    # r0 leaves blocks a b c and a state at c; r1 shares a b only, so no state lies on its path.
    requests = bench.requests_of(_trace(_blocks(1, 2, 3) + [9], _blocks(1, 2, 7) + [9]), BLOCK)
    for policy in bench.POLICIES:
        hybrid = bench.simulate(requests, 100, 2, policy)
        attention = bench.simulate(requests, 100, 0, policy)
        assert hybrid == 0.0, policy
        assert attention == pytest.approx(2 * BLOCK / (2 * (3 * BLOCK + 1))), policy


def test_the_state_sits_at_the_replay_boundary_before_the_last_token(load_bench):
    bench = load_bench("eviction_headroom")
    # r1 repeats r0 exactly (three full blocks): a hit must leave the last token, so vLLM
    # keeps r0's state after two blocks, and r1 resumes there.
    requests = bench.requests_of(_trace(_blocks(1, 2, 3), _blocks(1, 2, 3)), BLOCK)
    assert requests[1].hit_limit == 2
    for states in (1, 0):
        assert bench.simulate(requests, 100, states, "lru") == pytest.approx(2 * BLOCK / 24)


def test_a_junction_keeps_a_state_where_a_prompt_leaves_a_cached_prefix(load_bench):
    bench = load_bench("eviction_headroom")
    # a and b share two blocks; b finds them cached with no state there, so vLLM keeps one at
    # the junction, and c (a third branch) resumes from it.
    requests = bench.requests_of(_trace(_blocks(1, 2, 3) + [9], _blocks(1, 2, 4) + [9],
                                        _blocks(1, 2, 5) + [9]), BLOCK)
    total = 3 * (3 * BLOCK + 1)
    for policy in bench.POLICIES:
        assert bench.simulate(requests, 100, 1, policy) == pytest.approx(2 * BLOCK / total)


def test_a_loop_larger_than_the_cache_starves_lru_and_not_the_offline_order(load_bench):
    bench = load_bench("eviction_headroom")
    # Four conversations, each asking the same two-block prompt in turn, five times: a hit
    # reuses its attention blocks and the state at the second. The cache holds three of them.
    prompts = [_blocks(10 * conv + 1, 10 * conv + 2) + [5] for _ in range(5) for conv in range(4)]
    requests = bench.requests_of(_trace(*prompts), BLOCK)
    capacity = 3 * (2 + 1)
    lru = bench.simulate(requests, capacity, 1, "lru")
    offline = bench.simulate(requests, capacity, 1, "offline")
    roomy = bench.simulate(requests, 10_000, 1, "lru")
    assert lru == 0.0
    assert 0.0 < offline <= roomy
    for policy in bench.POLICIES:
        assert bench.simulate(requests, 10_000, 1, policy) == roomy, policy


def test_follow_ups_come_right_after_the_request_they_follow(load_bench):
    bench = load_bench("eviction_headroom")
    trace = Trace("t", [TraceRequest("r0", [1] * 8, [1], 0.0),
                        TraceRequest("r1", [2] * 8, [1], 1.0),
                        TraceRequest("r2", [3] * 8, [1], 0.5, after="r0")], "test")
    assert [r.id for r in bench.arrival_order(trace)] == ["r0", "r2", "r1"]


@pytest.mark.parametrize(("policy", "capacity", "message"), [
    pytest.param("belady", 10, "unknown eviction order 'belady'", id="policy"),
    pytest.param("lru", 0, "capacity must be a block count >= 1, got 0", id="capacity"),
])
def test_bad_input_names_the_value(load_bench, policy, capacity, message):
    bench = load_bench("eviction_headroom")
    requests = bench.requests_of(_trace(_blocks(1, 2)), BLOCK)
    with pytest.raises(ValueError, match=message):
        bench.simulate(requests, capacity, 1, policy)


def test_size_aware_keeps_the_state_that_saves_more_per_block_and_is_lru_without_states(load_bench):
    bench = load_bench("eviction_headroom")
    # A four-block conversation and a one-block one take turns; the cache (6 blocks, a state
    # costs one) holds the long one's path and state (5) or the short one's (2), not both.
    long_, short = _blocks(1, 2, 3, 4) + [9], _blocks(7) + [9]
    requests = bench.requests_of(_trace(*[long_, short] * 4), BLOCK)
    assert bench.simulate(requests, 6, 1, "lru") == 0.0
    size_aware = bench.simulate(requests, 6, 1, "size-aware")
    total = 4 * (len(long_) + len(short))
    assert size_aware == pytest.approx(3 * 4 * BLOCK / total)   # the long one, rounds 2-4
    for capacity in (3, 6, 9, 40):
        assert bench.simulate(requests, capacity, 0, "size-aware") == \
            bench.simulate(requests, capacity, 0, "lru"), capacity


def test_reuse_counts_a_state_read_again_by_what_was_seen_when_it_was_stored(load_bench):
    bench = load_bench("eviction_headroom")
    # r0's state (at b) is passed by r2; r1's (at d) by nobody; r2 starts on r0's blocks.
    requests = bench.requests_of(_trace(_blocks(1, 2) + [9], _blocks(4) + [9],
                                        _blocks(1, 2, 3) + [9], [5]), BLOCK)
    reuse = bench.reuse_by_feature(requests)
    assert reuse["all"] == {"all": [3, 1]}               # r3 has no full block, no state
    assert reuse["prefix seen before"] == {"no": [2, 1], "yes": [1, 0]}
    assert sum(states for states, _ in reuse["prompt tokens"].values()) == 3
