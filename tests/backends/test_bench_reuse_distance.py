"""``bench/reuse_distance.py``: each request's source and reuse distance (no replay here; the
table in docs/results.md comes from a real run)."""

from __future__ import annotations

from vllm_hybrid_backends.replay.workloads import Trace, TraceRequest


def test_the_source_is_the_earliest_longest_prefix_and_the_distance_what_came_between(load_bench):
    bench = load_bench("reuse_distance")
    stem = list(range(100, 140))
    trace = Trace("t", [
        TraceRequest("a", stem + [1, 2], [7, 7, 7]),        # 45 tokens
        TraceRequest("b", [9] * 30, [8] * 5),                # 35, shares nothing
        TraceRequest("c", stem + [1, 2, 7, 7, 5], [6]),      # a's prompt and output, 44 shared
        TraceRequest("d", stem + [3], [4, 4]),               # a and c share 40: a is earlier
    ], "test")
    found = bench.sources(trace)
    assert found[0] == (0, None, 0) and found[1] == (0, None, 0)
    assert found[2] == (44, 0, 35)          # b's 35 tokens between a and c
    assert found[3] == (40, 0, 35 + 46)     # b and c (45 + 1) between a and d


def test_groups_are_multiples_of_the_cache(load_bench):
    bench = load_bench("reuse_distance")
    assert [bench.group(d, 1000) for d in (0, 499, 500, 999, 1000, 1999, 2000, 10**6)] == [
        "< 0.5 x cache", "< 0.5 x cache", "< 1 x cache", "< 1 x cache", "< 2 x cache",
        "< 2 x cache", ">= 2 x cache", ">= 2 x cache"]
