"""VLLM_HYBRID_STATS: off by default (nothing wrapped), a bad value names itself, and the
counters cross vLLM's engine-core -> front-end msgpack channel inside SchedulerStats."""

from __future__ import annotations

import pytest

from vllm_hybrid_backends import stats
from vllm_hybrid_backends.patches import (
    patch_vllm_v1_core_sched_scheduler as scheduler_patch,
)
from vllm_hybrid_backends.patches import patch_vllm_v1_metrics_loggers as loggers_patch
from vllm_hybrid_backends.patches import patch_vllm_v1_metrics_stats as stats_patch


def test_bad_value_names_it_and_the_allowed_ones(monkeypatch):
    monkeypatch.setenv(stats.STATS_ENV, "maybe")
    with pytest.raises(ValueError, match=r"VLLM_HYBRID_STATS='maybe'.*1/0"):
        stats.refresh()


def test_off_by_default_wraps_nothing(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    monkeypatch.delenv(stats.STATS_ENV, raising=False)
    update, record = Scheduler.update_from_output, PrometheusStatLogger.record
    try:
        for module in (stats_patch, loggers_patch, scheduler_patch):
            module.apply()
        assert not stats.enabled
        assert Scheduler.update_from_output is update and PrometheusStatLogger.record is record
        assert "hybrid" not in SchedulerStats.__dataclass_fields__
    finally:
        for module in (scheduler_patch, loggers_patch, stats_patch):
            module.revert()


def test_counters_cross_the_msgpack_channel(monkeypatch):
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    monkeypatch.setenv(stats.STATS_ENV, "1")
    try:
        stats_patch.apply()
        stats.COUNTERS[stats.key("kept", "decode")] += 3
        sent = SchedulerStats()
        sent.hybrid = stats.take_delta()  # type: ignore[attr-defined]
        assert stats.take_delta() is None  # nothing new since
        wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=sent))
        got = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats
        assert got.hybrid == {"kept:decode": 3}
        stats.COUNTERS[stats.key("kept", "decode")] += 2
        assert stats.take_delta() == {"kept:decode": 2}
    finally:
        stats_patch.revert()
        stats.reset()
    assert "hybrid" not in SchedulerStats.__dataclass_fields__


@pytest.mark.parametrize(("hit", "reach", "states", "expected"), [
    # a state at 40 was evicted, none ever at 8..32: kept, it would have given all 40 tokens
    pytest.param(0, 40, {40: "evicted"}, {"evicted": 40}, id="evicted-at-the-reach"),
    # past the deepest evicted state (24) no boundary ever had one: placement from there on
    pytest.param(0, 48, {8: "evicted", 24: "evicted"},
                 {"evicted": 24, stats.NO_STATE: 24}, id="placement-past-an-evicted-state"),
    # the deepest state decides, whatever a shallower one was
    pytest.param(8, 40, {16: "evicted", 32: "groups_disagreed"},
                 {"groups_disagreed": 24, stats.NO_STATE: 8}, id="deepest-decides"),
    pytest.param(0, 32, {}, {stats.NO_STATE: 32}, id="never-a-state"),
    # hit and reach off the 8-token grid: the chunk holding the hit counts whole (the replay's
    # hits and bounds lie on the grid), the one the reach cuts does not
    pytest.param(5, 30, {16: "evicted"}, {"evicted": 16, stats.NO_STATE: 8}, id="off-grid"),
    pytest.param(24, 30, {}, {}, id="no-chunk-past-the-hit"),
])
def test_the_deepest_boundary_with_a_state_decides_the_gap_up_to_it(hit, reach, states, expected):
    asked = []

    def reason_at(position):
        asked.append(position)
        return states.get(position, stats.NO_STATE)

    assert stats.attribute_gap(hit, reach, 8, reason_at) == expected
    deepest = max((p for p in states if hit < p <= reach), default=None)
    # walked down from the reach, and no further than the deepest state
    assert asked == sorted(asked, reverse=True) and (deepest is None or min(asked) == deepest)


@pytest.mark.parametrize(("have", "evicted", "attention", "reason"), [
    pytest.param([False, False], [False, False], True, stats.NO_STATE, id="never-a-state"),
    pytest.param([False, False], [True, False], True, "evicted", id="evicted-everywhere-it-was"),
    pytest.param([True, False], [False, True], True, "evicted", id="one-group-evicted"),
    pytest.param([True, False], [False, False], True, "groups_disagreed", id="one-group-never"),
    pytest.param([True, True], [False, False], False, "evicted", id="attention-prefix-evicted"),
    pytest.param([True, True], [False, False], True, "other", id="all-there"),
])
def test_a_state_lost_to_eviction_is_capacity_and_only_a_group_that_never_had_it_disagrees(
        have, evicted, attention, reason):
    assert stats.miss_reason(have, evicted, attention) == reason
