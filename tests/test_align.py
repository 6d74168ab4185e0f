"""The align-mode decisions (pure functions) and the scheduler / coordinator patches that wire
them into vLLM."""

from __future__ import annotations

import types

import pytest

from vllm_hybrid_backends import align
from vllm_hybrid_backends.patches import (
    patch_vllm_v1_core_kv_cache_coordinator as coordinator_patch,
)
from vllm_hybrid_backends.patches import patch_vllm_v1_core_sched_scheduler as scheduler_patch

DEFAULT = align.AlignPolicy()
OFF = align.AlignPolicy(tail_checkpoints=0, decode_checkpoints=False, mamba_grid=False)


def test_tail_checkpoints_double_away_from_the_last_boundary():
    # 1500 tokens, block 128: vLLM keeps 1408; the plugin adds 1280, 1152, 896, 384
    assert align.tail_checkpoints(1500, 128, 4) == (384, 896, 1152, 1280)
    assert align.tail_checkpoints(1500, 128, 2) == (1152, 1280)
    assert align.tail_checkpoints(1500, 128, 0) == ()
    assert align.tail_checkpoints(200, 128, 4) == ()  # one block: nothing before the last boundary
    assert align.tail_checkpoints(129, 128, 4) == ()


@pytest.mark.parametrize("prompt", [1, 127, 128, 129, 1000, 4096, 100_003])
@pytest.mark.parametrize("block", [16, 128, 528])
def test_tail_checkpoints_are_aligned_distinct_and_before_the_last_boundary(prompt, block):
    last = align.last_prompt_boundary(prompt, block)
    points = align.tail_checkpoints(prompt, block, 8)
    assert len(points) == len(set(points)) <= 8
    assert all(0 < p < last and p % block == 0 for p in points)


def test_decode_boundary_is_kept_from_the_prompt_end_on():
    assert align.decode_boundary(1500, 1500, 128) is None  # still inside the prompt's last block
    assert align.decode_boundary(1500, 1537, 128) == 1536
    assert align.decode_boundary(1536, 1536, 128) == 1536  # an aligned prompt end
    assert align.retained_boundaries(1500, 1537, 128, DEFAULT) == (384, 896, 1152, 1280, 1536)
    assert align.retained_boundaries(1500, 1537, 128, OFF) == ()


def test_chunk_end_stops_at_the_first_checkpoint_inside_the_chunk():
    assert align.chunk_end(0, 1500, 1500, 1500, 128, 128, DEFAULT) == 384
    assert align.chunk_end(384, 1500, 1500, 1500, 128, 128, DEFAULT) == 896
    assert align.chunk_end(1280, 1500, 1500, 1500, 128, 128, DEFAULT) == 1500
    assert align.chunk_end(0, 1500, 1500, 1500, 128, 128, OFF) == 1500
    assert align.chunk_end(1500, 1501, 1500, 1500, 128, 128, DEFAULT) == 1501  # decode: untouched


def test_chunk_end_floors_to_the_mamba_grid_when_it_is_coarser():
    # scheduler block 8 (attention), Mamba state block 16: a chunk may not end at 24
    grid_only = align.AlignPolicy(tail_checkpoints=0)
    assert align.chunk_end(0, 24, 100, 100, 8, 16, grid_only) == 16
    assert align.chunk_end(16, 24, 100, 100, 8, 16, grid_only) == 24  # too short: keeps its end
    assert align.chunk_end(16, 100, 100, 100, 8, 16, grid_only) == 100  # the final chunk is exempt
    assert align.chunk_end(0, 24, 100, 100, 8, 16, OFF) == 24


def test_policy_from_the_environment(monkeypatch):
    monkeypatch.setenv(align.TAIL_CHECKPOINTS_ENV, "2")
    monkeypatch.setenv(align.DECODE_CHECKPOINTS_ENV, "off")
    assert align.current_policy() == align.AlignPolicy(2, False, True)
    monkeypatch.setenv(align.TAIL_CHECKPOINTS_ENV, "many")
    with pytest.raises(ValueError, match="VLLM_HYBRID_TAIL_CHECKPOINTS='many': allowed values are integers 0..64"):
        align.current_policy()
    monkeypatch.setenv(align.TAIL_CHECKPOINTS_ENV, "1")
    monkeypatch.setenv(align.MAMBA_GRID_ENV, "maybe")
    with pytest.raises(ValueError, match="VLLM_HYBRID_MAMBA_GRID='maybe'"):
        align.current_policy()


# ---- the patches, on vLLM's real classes --------------------------------------------------------


@pytest.fixture
def scheduler_patched():
    scheduler_patch.apply()
    yield scheduler_patch._scheduler_class()
    scheduler_patch.revert()


def _fake_scheduler(block, min_block, original_result):
    fake = types.SimpleNamespace(block_size=block, cache_config=types.SimpleNamespace(block_size=min_block))
    return fake, (lambda self, request, n, local=0, external=0: original_result)


def test_scheduler_patch_clips_vllms_chunk(scheduler_patched, monkeypatch):
    fake, original = _fake_scheduler(128, 128, 1500)
    monkeypatch.setitem(scheduler_patch._ORIGINALS, "_mamba_block_aligned_split", original)
    request = types.SimpleNamespace(num_computed_tokens=0, num_prompt_tokens=1500, num_tokens=1500)
    assert scheduler_patched._mamba_block_aligned_split(fake, request, 1500) == 384
    request.num_computed_tokens = 384
    assert scheduler_patched._mamba_block_aligned_split(fake, request, 1116) == 896 - 384
    monkeypatch.setenv(align.TAIL_CHECKPOINTS_ENV, "0")
    request.num_computed_tokens = 0
    assert scheduler_patched._mamba_block_aligned_split(fake, request, 1500) == 1500


def test_scheduler_patch_reverts_to_vllms_method():
    cls = scheduler_patch._scheduler_class()
    original = cls._mamba_block_aligned_split
    scheduler_patch.apply()
    scheduler_patch.apply()
    assert cls._mamba_block_aligned_split is scheduler_patch._mamba_block_aligned_split
    scheduler_patch.revert()
    assert cls._mamba_block_aligned_split is original


def test_coordinator_patch_adds_boundaries_only_while_caching_a_request():
    module = coordinator_patch._module()
    original = module.replay_boundaries
    coordinator_patch.apply()
    try:
        assert module.replay_boundaries(1500, 128, False) == original(1500, 128, False)
        request = types.SimpleNamespace(num_tokens=1537)
        token = coordinator_patch._caching_for.set(request)
        try:
            assert module.replay_boundaries(1500, 128, False) == (384, 896, 1152, 1280, 1499, 1536)
        finally:
            coordinator_patch._caching_for.reset(token)
    finally:
        coordinator_patch.revert()
    assert module.replay_boundaries is original


def test_suffix_eviction_order_forgets_the_prefix_from_its_end_across_groups():
    attention = (16, ["a0", "a1", "a2", "a3"])  # ends 16, 32, 48, 64
    mamba = (32, ["m0", "m1"])  # ends 32, 64
    assert align.suffix_eviction_order([attention, mamba]) == ["a3", "m1", "a2", "a1", "m0", "a0"]
    assert align.suffix_eviction_order([mamba, attention]) == ["m1", "a3", "a2", "m0", "a1", "a0"]
    assert align.suffix_eviction_order([(16, []), mamba]) == ["m1", "m0"]


def test_coordinator_free_hands_the_pool_one_suffix_ordered_list(monkeypatch):
    freed = []
    managers = [types.SimpleNamespace(block_size=16, pop_blocks_for_free=lambda rid: ["a0", "a1"]),
                types.SimpleNamespace(block_size=32, pop_blocks_for_free=lambda rid: ["m0"])]
    coordinator = types.SimpleNamespace(single_type_managers=managers,
                                        block_pool=types.SimpleNamespace(free_blocks=freed.append))
    coordinator_patch.free(coordinator, "req-1")
    assert freed == [["a1", "m0", "a0"]]
    monkeypatch.setenv(align.SUFFIX_EVICTION_ENV, "0")
    monkeypatch.setitem(coordinator_patch._ORIGINALS, "KVCacheCoordinator.free",
                        lambda self, rid: freed.append(("vllm", rid)))
    coordinator_patch.free(coordinator, "req-2")
    assert freed[-1] == ("vllm", "req-2")



def test_plugin_policy_caches_no_state_under_the_wrong_boundary_with_coarser_mamba_blocks():
    """vLLM #54076, reproduced by the replay oracle (tests/replay/test_harness.py xfail):
    upstream caches a Mamba block holding the state after 12 tokens as the 16-token boundary."""
    from vllm_hybrid_backends.replay.harness import ReplayConfig, run_replay
    from vllm_hybrid_backends.replay.policy import get_policy
    from vllm_hybrid_backends.replay.shapes import tiny_shape
    from vllm_hybrid_backends.replay.workloads import Trace, TraceRequest

    trace = Trace("hetero", [TraceRequest("r0", [16] * 19, [16], 0.01),
                             TraceRequest("r1", [16], [16]), TraceRequest("r2", [16], [16]),
                             TraceRequest("r3", [16] * 21, [16])])
    config = ReplayConfig(shape=tiny_shape(("mamba", "attention")), platform="any", block_size=4, mamba_block_size=8,
                          cache_tokens=264, max_num_batched_tokens=8, max_num_seqs=3)
    assert len(run_replay(trace, config, get_policy("upstream")).mismatches) > 0
    plugin = run_replay(trace, config, get_policy("plugin"))
    assert [m.describe() for m in plugin.mismatches] == []
    assert plugin.requests["r0"].hit_tokens == 16
