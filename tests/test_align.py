"""The align-mode decisions (pure functions) and the scheduler / coordinator patches that wire
them into vLLM."""

from __future__ import annotations

import json
import types
import zlib

import pytest

from vllm_hybrid_backends import align, interior
from vllm_hybrid_backends.compat import has_mamba2_prefill_checkpoint, version_allows
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


def test_dense_tail_checkpoints_cover_every_block_up_to_the_same_reach():
    assert align.tail_checkpoints(1500, 128, 4, dense=True) == (384, 512, 640, 768, 896, 1024,
                                                                1152, 1280)
    assert align.tail_checkpoints(1500, 128, 2, dense=True) == (1152, 1280)
    assert align.tail_checkpoints(1500, 128, 64, dense=True)[0] == 128  # stops before token 0
    assert align.tail_checkpoints(200, 128, 4, dense=True) == ()
    kinds = align.tail_checkpoints_by_kind(1500, 128, 4, dense=True)
    assert list(kinds) == [f"tail-{d}" for d in range(1, 9)]


def test_policy_for_model_makes_tails_dense_only_where_they_are_stored_inside_the_chunk():
    assert align.policy_for_model(DEFAULT, internal_prefill_checkpoints=False).dense_tails is False
    dense = align.policy_for_model(DEFAULT, internal_prefill_checkpoints=False, interior_states=True)
    assert dense.dense_tails is True
    no_interior = align.AlignPolicy(interior_states=False)
    assert align.policy_for_model(no_interior, internal_prefill_checkpoints=False,
                                  interior_states=True).dense_tails is False
    # beside vLLM's internal prompt checkpoint (Mamba2): tails only where stored inside the chunk
    assert align.policy_for_model(DEFAULT, internal_prefill_checkpoints=True).tail_checkpoints == 0
    beside = align.policy_for_model(DEFAULT, internal_prefill_checkpoints=True, interior_states=True)
    assert (beside.tail_checkpoints, beside.dense_tails) == (DEFAULT.tail_checkpoints, True)
    assert align.policy_for_model(no_interior, internal_prefill_checkpoints=True,
                                  interior_states=True).tail_checkpoints == 0
    assert align.retained_boundaries_by_kind(1500, 1500, 128, dense)["tail-3"] == (1024,)


@pytest.mark.parametrize("prompt", [1, 127, 128, 129, 1000, 4096, 100_003])
@pytest.mark.parametrize("block", [16, 128, 528])
@pytest.mark.parametrize("dense", [False, True])
def test_tail_checkpoints_are_aligned_distinct_and_before_the_last_boundary(prompt, block, dense):
    last = align.last_prompt_boundary(prompt, block)
    points = align.tail_checkpoints(prompt, block, 8, dense=dense)
    assert len(points) == len(set(points)) <= (128 if dense else 8)
    assert all(0 < p < last and p % block == 0 for p in points)
    assert all(last - p <= 128 * block for p in points)


@pytest.mark.parametrize("prompt", [1, 1000, 4096, 100_003])
@pytest.mark.parametrize("block", [16, 128, 528])
def test_far_checkpoints_lie_past_the_dense_reach_at_doubling_distances(prompt, block):
    last = align.last_prompt_boundary(prompt, block)
    near = align.tail_checkpoints(prompt, block, 4, dense=True)
    far = align.far_checkpoints_by_kind(prompt, block, 4)
    points = sorted(far.values(), reverse=True)
    assert all(0 < p < min(near, default=last) and p % block == 0 for p in points)
    gaps = [last - p for p in points]
    assert all(b == 2 * a for a, b in zip(gaps, gaps[1:]))  # each twice as far as the last
    # every boundary down to the first block is within a factor of two of a kept one
    if last >= 32 * block:
        assert min(points) <= last // 2
    assert all(align.is_far(kind) for kind in far) and not align.far_checkpoints_by_kind(
        prompt, block, 0)


def test_far_checkpoints_only_where_tails_are_stored_inside_the_chunk():
    dense = align.policy_for_model(DEFAULT, internal_prefill_checkpoints=False, interior_states=True)
    kept = align.retained_boundaries_by_kind(5000, 5000, 128, dense)
    assert {kind: p for kind, p in kept.items() if align.is_far(kind)} == {
        "far-16": (4992 - 16 * 128,), "far-32": (4992 - 32 * 128,)}
    assert not any(align.is_far(k) for k in align.retained_boundaries_by_kind(5000, 5000, 128,
                                                                             DEFAULT))
    no_far = align.AlignPolicy(far_checkpoints=False, dense_tails=True)
    no_ledger = align.AlignPolicy(adaptive_retention=False, dense_tails=True)
    for policy in (no_far, no_ledger):  # without the ledger nothing keeps them speculative
        assert not any(align.is_far(k) for k in align.retained_boundaries_by_kind(
            5000, 5000, 128, policy))
    assert align.tail_kind_at(896, 5000, 128, dense) == "far-32"
    assert align.tail_kind_at(4864, 5000, 128, dense) == "tail-1"
    assert align.tail_kind_at(896, 5000, 128, no_ledger) is None
    assert align.tail_kind_at(900, 5000, 128, dense) is None
    inside = align.interior_tail_checkpoints_by_kind(0, 2048, 5000, 128, dense)
    assert inside == {"far-32": 896} and align.chunk_end(0, 2048, 5000, 5000, 128, 128, dense,
                                                         interior_states=True) == 2048


def test_far_kinds_are_kept_only_on_trial_and_never_proven():
    ledger = align.RetentionLedger()
    for block_id in range(40):  # a record that would prove any other kind
        ledger.record_kept("far-16", block_id, f"h{block_id}")
        ledger.record_hit(block_id, f"h{block_id}")
        ledger.record_kept("tail-1", 100 + block_id, f"t{block_id}")
        ledger.record_hit(100 + block_id, f"t{block_id}")
    assert ledger.proven("tail-1") and not ledger.proven("far-16")
    assert ledger.admits("tail-1", "r0") and not ledger.admits("far-16", "r0")
    ledger.keep_on_trial(["far-16"], "r1")
    assert ledger.admits("far-16", "r1")
    ledger.record_kept("far-16", 999, "fresh")
    assert ledger.on_probation(999, "fresh")  # evicted before what upstream keeps


def test_decode_boundary_is_kept_from_the_prompt_end_on():
    assert align.decode_boundary(1500, 1500, 128) is None  # still inside the prompt's last block
    assert align.decode_boundary(1500, 1537, 128) == 1536
    assert align.decode_boundary(1536, 1536, 128) == 1536  # an aligned prompt end
    assert align.retained_boundaries_by_kind(1500, 1537, 128, DEFAULT) == {
        "tail-1": (1280,), "tail-2": (1152,), "tail-4": (896,), "tail-8": (384,), "decode": (1536,)}
    assert align.retained_boundaries_by_kind(1500, 1537, 128, OFF) == {}


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


@pytest.fixture(autouse=True)
def _policy_reread_after_each_test():
    yield
    align._active = None


@pytest.fixture
def scheduler_patched():
    scheduler_patch.apply()
    yield scheduler_patch._scheduler_class()
    scheduler_patch.revert()


def _fake_scheduler(block, min_block, original_result, stores_interior=False):
    fake = types.SimpleNamespace(block_size=block, cache_config=types.SimpleNamespace(block_size=min_block),
                                 _hybrid_stores_interior=stores_interior,
                                 kv_cache_manager=types.SimpleNamespace(coordinator=types.SimpleNamespace()))
    return fake, (lambda self, request, n, local=0, external=0: original_result)


def test_scheduler_patch_clips_vllms_chunk(scheduler_patched, monkeypatch):
    fake, original = _fake_scheduler(128, 128, 1500)
    monkeypatch.setitem(scheduler_patch._ORIGINALS, "_mamba_block_aligned_split", original)
    request = types.SimpleNamespace(num_computed_tokens=0, num_prompt_tokens=1500, num_tokens=1500,
                                    request_id="r")
    assert scheduler_patched._mamba_block_aligned_split(fake, request, 1500) == 384
    request.num_computed_tokens = 384
    assert scheduler_patched._mamba_block_aligned_split(fake, request, 1116) == 896 - 384
    monkeypatch.setenv(align.TAIL_CHECKPOINTS_ENV, "0")
    align.refresh_policy()
    request.num_computed_tokens = 0
    assert scheduler_patched._mamba_block_aligned_split(fake, request, 1500) == 1500


def test_scheduler_patch_does_not_split_where_the_forward_stores_interior_states(scheduler_patched,
                                                                                monkeypatch):
    fake, original = _fake_scheduler(128, 128, 1500, stores_interior=True)
    monkeypatch.setitem(scheduler_patch._ORIGINALS, "_mamba_block_aligned_split", original)
    request = types.SimpleNamespace(num_computed_tokens=0, num_prompt_tokens=1500, num_tokens=1500,
                                    request_id="r")
    assert scheduler_patched._mamba_block_aligned_split(fake, request, 1500) == 1500
    monkeypatch.setenv(align.INTERIOR_STATES_ENV, "0")
    align.refresh_policy()
    assert scheduler_patched._mamba_block_aligned_split(fake, request, 1500) == 384


@pytest.mark.parametrize("computed, prompt, tokens, scheduled", [
    pytest.param(100, 100, 101, 1, id="decode"),
    pytest.param(100, 100, 101, 4, id="decode-with-drafts"),
    pytest.param(150, 100, 151, 1, id="decode-after-resume"),
])
def test_decode_steps_return_before_vllms_split_which_leaves_them_unchanged(
        scheduler_patched, monkeypatch, computed, prompt, tokens, scheduled):
    request = types.SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt,
                                    num_tokens=tokens, request_id="r")
    vllms = scheduler_patch._ORIGINALS["_mamba_block_aligned_split"]
    # vLLM's own split returns a decode step's count without reading the scheduler at all
    assert vllms(types.SimpleNamespace(), request, scheduled) == scheduled

    def not_for_decode_steps(*args):
        raise AssertionError("vLLM's split was called for a decode step")

    monkeypatch.setitem(scheduler_patch._ORIGINALS, "_mamba_block_aligned_split",
                        not_for_decode_steps)
    fake, _ = _fake_scheduler(128, 128, None)
    assert scheduler_patched._mamba_block_aligned_split(fake, request, scheduled) == scheduled


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
    request = types.SimpleNamespace(num_tokens=1537, num_prompt_tokens=1500, request_id="r")
    if coordinator_patch._boundary_form(module) == coordinator_patch.DENSE_RETENTION:
        _dense_retention_keeps_every_state_with_and_without_the_patch(request)
        return
    if hasattr(module, "replay_boundaries"):  # vLLM 0.32+: a module function
        original = module.replay_boundaries

        def boundaries():
            return module.replay_boundaries(1500, 128, False)
    elif hasattr(module.KVCacheCoordinator, "get_replay_boundaries"):  # 0.30/0.31: a method
        original = module.KVCacheCoordinator.get_replay_boundaries
        coordinator = types.SimpleNamespace(eagle_group_ids=[], scheduler_block_size=128)

        def boundaries():
            return module.KVCacheCoordinator.get_replay_boundaries(coordinator, request)
    else:  # 0.26: the Mamba manager's sparse-retention mask keeps reachable boundaries
        import torch
        from vllm.v1.kv_cache_interface import MambaSpec

        mamba = coordinator_patch._mamba_manager_class()
        original = vars(mamba)["reachable_block_mask"]
        spec = MambaSpec(block_size=128, shapes=((1, 1),), dtypes=(torch.float32,),
                         mamba_cache_mode="align")

        def boundaries():
            mask = mamba.reachable_block_mask(0, 13, 128, spec, False, 0, (1499,))
            return tuple((i + 1) * 128 for i, kept in enumerate(mask) if kept)
    plain = boundaries()
    coordinator_patch.apply()
    try:
        assert boundaries() == plain
        owner, attribute, _ = coordinator_patch._BOUNDARY_HOOK
        assert vars(owner)[attribute] is original  # vLLM's own between caching calls
        with coordinator_patch._keeping_boundaries(request, align.AlignPolicy(), {},
                                                   align.RetentionLedger()):
            assert boundaries() == tuple(sorted({384, 896, 1152, 1280, 1536, *plain}))
        assert boundaries() == plain and vars(owner)[attribute] is original
        with coordinator_patch._keeping_boundaries(request, align.AlignPolicy(tail_checkpoints=0),
                                                   {}, align.RetentionLedger()):
            assert boundaries() == tuple(sorted({1536, *plain}))
    finally:
        coordinator_patch.revert()
    if hasattr(module, "replay_boundaries"):
        assert module.replay_boundaries is original
    elif hasattr(module.KVCacheCoordinator, "get_replay_boundaries"):
        assert module.KVCacheCoordinator.get_replay_boundaries is original
    else:
        assert vars(coordinator_patch._mamba_manager_class())["reachable_block_mask"] is original


def _dense_retention_keeps_every_state_with_and_without_the_patch(request):
    """vLLM 0.23: the Mamba manager inherits the base mask (None: cache every full block), so
    there are no boundaries to add and the patch must leave the mask alone, caching or not."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = coordinator_patch._mamba_manager_class()
    spec = MambaSpec(block_size=128, shapes=((1, 1),), dtypes=(torch.float32,),
                     mamba_cache_mode="align")
    assert mamba.reachable_block_mask(0, 13, 128, spec, False, 0) is None
    before = dict(vars(mamba))
    coordinator_patch.apply()
    try:
        token = coordinator_patch._caching_for.set((request, align.AlignPolicy(), {}))
        try:
            assert mamba.reachable_block_mask(0, 13, 128, spec, False, 0) is None
        finally:
            coordinator_patch._caching_for.reset(token)
        assert dict(vars(mamba)) == before
    finally:
        coordinator_patch.revert()


def test_suffix_eviction_order_forgets_the_prefix_from_its_end_across_groups():
    attention = (16, ["a0", "a1", "a2", "a3"])  # ends 16, 32, 48, 64
    mamba = (32, ["m0", "m1"])  # ends 32, 64
    assert align.suffix_eviction_order([attention, mamba]) == ["a3", "m1", "a2", "a1", "m0", "a0"]
    assert align.suffix_eviction_order([mamba, attention]) == ["m1", "a3", "a2", "m0", "a1", "a0"]
    assert align.suffix_eviction_order([(16, []), mamba]) == ["m1", "m0"]


def test_coordinator_free_hands_the_pool_one_suffix_ordered_list(monkeypatch):
    freed = []
    a0, a1, m0 = (types.SimpleNamespace(name=n, block_id=i, block_hash=None)
                  for i, n in enumerate(("a0", "a1", "m0")))
    managers = [types.SimpleNamespace(block_size=16, pop_blocks_for_free=lambda rid: [a0, a1]),
                types.SimpleNamespace(block_size=32, pop_blocks_for_free=lambda rid: [m0])]
    coordinator = types.SimpleNamespace(single_type_managers=managers,
                                        block_pool=types.SimpleNamespace(free_blocks=freed.append))
    monkeypatch.setattr(coordinator_patch, "_POPS_BLOCKS", True)  # managers that pop (0.26+)
    coordinator_patch.free(coordinator, "req-1")
    assert [[b.name for b in blocks] for blocks in freed] == [["a1", "m0", "a0"]]
    monkeypatch.setenv(align.SUFFIX_EVICTION_ENV, "0")
    align.refresh_policy()
    monkeypatch.setitem(coordinator_patch._ORIGINALS, "KVCacheCoordinator.free",
                        lambda self, rid: freed.append(("vllm", rid)))
    coordinator_patch.free(coordinator, "req-2")
    assert freed[-1] == ("vllm", "req-2")



@pytest.mark.skipif(version_allows("<0.30"), reason=(
    "vLLM 0.26's HybridKVCacheCoordinator asserts every group's block size is divisible by the "
    "hash block size: a Mamba block coarser than the attention block cannot be configured"))
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


def test_tail_checkpoints_are_off_for_models_with_internal_prefill_checkpoints():
    policy = align.AlignPolicy(tail_checkpoints=4)
    assert align.policy_for_model(policy, internal_prefill_checkpoints=False) == policy
    mamba2 = align.policy_for_model(policy, internal_prefill_checkpoints=True)
    assert mamba2.tail_checkpoints == 0
    assert (mamba2.decode_checkpoints, mamba2.mamba_grid, mamba2.suffix_eviction) == (None, True, True)


@pytest.mark.parametrize("setting, kinds, expected", [
    (None, frozenset({"GDN_ATTN"}), True), (None, frozenset({"MAMBA2"}), False),
    (None, frozenset({"SHORT_CONV", "MAMBA2"}), False), (True, frozenset({"MAMBA2"}), True),
    (False, frozenset({"GDN_ATTN"}), False), (None, None, None)])
def test_decode_states_left_to_the_model_follow_its_mamba_kinds(setting, kinds, expected):
    policy = align.AlignPolicy(decode_checkpoints=setting)
    resolved = align.policy_for_model(policy, internal_prefill_checkpoints=False, mamba_kinds=kinds)
    assert resolved.decode_checkpoints is expected


@pytest.mark.parametrize("flags, expected", [((), False), ((True,), True), ((True, False), False)])
def test_coordinator_reads_internal_checkpoints_like_the_scheduler(flags, expected):
    attention = types.SimpleNamespace()
    managers = [attention, *(types.SimpleNamespace(has_prefill_checkpoint_blocks=f) for f in flags)]
    coordinator = types.SimpleNamespace(single_type_managers=managers)
    assert coordinator_patch._internal_prefill_checkpoints(coordinator) is expected


# ---- adaptive retention -----------------------------------------------------------------------


def test_a_kind_is_admitted_while_warming_up_or_reused_and_sampled_otherwise():
    warm, ratio = align.RETENTION_WARMUP, align.RETENTION_MIN_REUSE
    assert align.admits_kind(warm - 1, 0, "r")
    assert align.admits_kind(warm * ratio, warm, "r")
    assert not align.admits_kind(warm * ratio, warm - 1, "r") or zlib.crc32(b"r") % align.RETENTION_EXPLORE == 0
    sampled = [align.admits_kind(1000, 0, f"req-{i}") for i in range(1600)]
    assert 0 < sum(sampled) < 1600 / align.RETENTION_EXPLORE * 1.5
    assert sampled == [align.admits_kind(1000, 0, f"req-{i}") for i in range(1600)]  # deterministic


def test_ledger_learns_reuse_per_kind_and_keeps_a_requests_decision():
    ledger = align.RetentionLedger()
    assert ledger.admits("decode", "r0")
    for block in range(align.RETENTION_WARMUP):
        ledger.record_kept("decode", block, ("h", block))
        ledger.record_kept("decode", block, ("h", block))  # the same state again: counted once
    assert ledger.kept["decode"] == align.RETENTION_WARMUP and not ledger.proven("decode")
    assert ledger.on_probation(3, ("h", 3)) and not ledger.on_probation(3, ("other", 3))
    assert ledger.admits("decode", "r0")  # decided before the evidence: stays until freed
    refused = [r for r in (f"r{i}" for i in range(1, 200)) if not ledger.admits("decode", r)]
    assert len(refused) > 150
    ledger.record_hit(3, ("h", 3))
    ledger.record_hit(3, ("h", 3))  # one state reused twice counts once
    assert ledger.reused["decode"] == 1 and not ledger.on_probation(3, ("h", 3))
    for block in range(4):
        ledger.record_hit(block, ("h", block))
    assert ledger.proven("decode") and not ledger.on_probation(10, ("h", 10))
    ledger.forget_request(refused[0])
    assert ledger.admits("decode", refused[0])  # decided afresh, now with reuse on record


def test_the_ledger_snapshot_reports_counts_savings_and_proven_kinds():
    ledger = align.RetentionLedger()
    for block in range(align.RETENTION_WARMUP):
        ledger.record_kept("tail-2", block, ("t", block), blocks=6)
    ledger.record_kept("decode", 100, ("d", 0), blocks=6)
    ledger.record_kept(align.VLLM_KIND, 200, ("v", 0), blocks=6)
    ledger.record_held(10)
    ledger.record_hit(0, ("t", 0), tokens=3000)
    ledger.record_hit(0, ("t", 0), tokens=3000)  # reused once only
    ledger.record_lookup(hit=3000, lost=520)
    snap = ledger.snapshot()
    tail = snap["kinds"]["tail-2"]
    assert (tail["kept"], tail["reused"], tail["saved_tokens"], tail["blocks_held"]) == (
        align.RETENTION_WARMUP, 1, 3000.0, 6.0 * align.RETENTION_WARMUP)
    assert tail["saved_per_block"] == round(3000 / (6 * align.RETENTION_WARMUP), 1)
    assert tail["saving_hits"] == 1.0 and snap["families"]["tail"]["saving_hits"] == 1.0
    assert tail["proven"] and not snap["kinds"]["decode"]["proven"]
    assert snap["kinds"]["decode"]["saved_per_block"] == 0.0
    assert snap["kinds"][align.VLLM_KIND]["blocks_held"] == 16.0  # its state and attention
    assert snap["families"]["tail"]["kept"] == align.RETENTION_WARMUP
    assert snap["lookups"] == {"count": 1.0, "hit_tokens": 3000.0, "lost_tokens": 520.0}
    assert snap["capacity_bound"] is True  # too few lookups to say otherwise
    json.dumps(snap)  # plain data


def test_window_halves_the_counts():
    ledger = align.RetentionLedger()
    for block in range(align.RETENTION_WINDOW + 1):
        ledger.record_kept("tail-1", block, block)
    assert ledger.kept["tail-1"] == (align.RETENTION_WINDOW + 1) // 2


def _ledger_with_baseline(saved_per_block: float, hit_lookups: int = 128,
                          lost_per_lookup: int = 0) -> align.RetentionLedger:
    """A ledger whose vLLM states (6 blocks each, plus 10 attention blocks) saved
    ``saved_per_block`` prompt tokens per block held."""
    ledger = align.RetentionLedger()
    states = align.VALUE_MIN_SAMPLES
    for block in range(states):
        ledger.record_kept(align.VLLM_KIND, block, ("v", block), blocks=6)
        ledger.record_held(10)
    for block in range(states):  # (6 + 10) blocks per state
        ledger.record_hit(block, ("v", block), tokens=int(saved_per_block * 16))
    for _ in range(hit_lookups):
        ledger.record_lookup(100, lost_per_lookup)
    return ledger


def _keep_tail_states(ledger: align.RetentionLedger, count: int, hits: int, tokens: int) -> None:
    for block in range(1000, 1000 + count):
        ledger.record_kept("tail-1", block, ("t", block), blocks=6)
    for block in range(1000, 1000 + hits):
        ledger.record_hit(block, ("t", block), tokens=tokens)


def test_value_rule_admits_a_rarely_reused_kind_that_saves_more_per_block_than_vllms_own():
    kept = align.VALUE_MIN_SAMPLES * 2
    # one tail state in 16 reused (under the 1-in-8 bar), saving 8,000 tokens each:
    # 8,000 * 8 / (128 * 6) = 83 tokens per block, against vLLM's 16
    ledger = _ledger_with_baseline(saved_per_block=16)
    _keep_tail_states(ledger, kept, kept // 16, 8000)
    assert ledger.reused["tail-1"] * align.RETENTION_MIN_REUSE < kept
    assert ledger.earns_blocks("tail-1") and ledger.proven("tail-1")
    assert ledger.admits("tail-1", "r") and ledger.admits("tail-1", "r-2")
    assert not ledger.on_probation(1100, ("t", 1100))
    ledger.compares_value = False  # VLLM_HYBRID_VALUE_RETENTION=0
    assert not ledger.proven("tail-1") and ledger.on_probation(1100, ("t", 1100))
    # vLLM's own blocks saving more per block: refused
    richer = _ledger_with_baseline(saved_per_block=100)
    _keep_tail_states(richer, kept, kept // 16, 8000)
    assert not richer.earns_blocks("tail-1") and not richer.proven("tail-1")


def test_value_rule_is_off_while_the_cache_is_capacity_bound_or_has_few_samples():
    kept = align.VALUE_MIN_SAMPLES * 2
    bound = _ledger_with_baseline(saved_per_block=16, lost_per_lookup=100 // align.VALUE_MAX_LOST + 1)
    _keep_tail_states(bound, kept, kept // 16, 8000)
    assert bound.capacity_bound() and not bound.proven("tail-1")
    roomy = _ledger_with_baseline(saved_per_block=16, lost_per_lookup=100 // align.VALUE_MAX_LOST - 1)
    _keep_tail_states(roomy, kept, kept // 16, 8000)
    assert not roomy.capacity_bound() and roomy.proven("tail-1")
    early = _ledger_with_baseline(saved_per_block=16, hit_lookups=align.VALUE_MIN_SAMPLES - 1)
    _keep_tail_states(early, kept, kept // 16, 8000)
    assert early.capacity_bound() and not early.proven("tail-1")
    few = _ledger_with_baseline(saved_per_block=16)
    _keep_tail_states(few, align.VALUE_MIN_SAMPLES - 1, 4, 8000)
    assert not few.earns_blocks("tail-1")


def _pressed_ledger(lost_first: int, evicted: int) -> align.RetentionLedger:
    """A capacity-bound ledger (lookups lose more than they hit) whose requests' first lookups
    lost ``lost_first`` tokens in all while the pool evicted ``evicted`` cached blocks."""
    ledger = _ledger_with_baseline(saved_per_block=16)
    requests = [[f"hashes-{i}"] for i in range(align.VALUE_MIN_SAMPLES)]
    for hashes in requests:
        ledger.record_lookup(10, lost_first // len(requests), requester=hashes)
        ledger.record_lookup(10, 10_000, requester=hashes)  # the same request again: not counted
    ledger.record_evicted(evicted)
    assert ledger.capacity_bound()
    return ledger


def test_under_pressure_a_reused_kind_must_save_what_an_evicted_block_was_worth():
    kept = align.VALUE_MIN_SAMPLES
    # one tail state in 4 reused (over the 1-in-8 bar), 1,200 tokens a hit, 6 blocks a state:
    # 50 tokens per block held; from 16 hits, 37.5 taken one standard error low
    cheap = _pressed_ledger(lost_first=64 * 30, evicted=64)  # an evicted block: 30 tokens
    _keep_tail_states(cheap, kept, kept // 4, 1200)
    assert cheap.eviction_price() == 30.0
    assert cheap.pays_under_pressure("tail-1") and cheap.proven("tail-1")
    assert cheap.admits("tail-1", "r")
    dear = _pressed_ledger(lost_first=64 * 60, evicted=64)  # an evicted block: 60 tokens
    _keep_tail_states(dear, kept, kept // 4, 1200)
    assert dear.eviction_price() == 60.0
    assert not dear.pays_under_pressure("tail-1") and not dear.proven("tail-1")
    refused = [r for r in (f"r{i}" for i in range(64)) if not dear.admits("tail-1", r)]
    assert len(refused) >= 56  # only the explorers keep them
    assert dear.on_probation(1000 + kept - 1, ("t", 1000 + kept - 1))  # never reused
    assert dear.pays_under_pressure(align.VLLM_KIND) and dear.pays_under_pressure(align.PASSED)
    even = _pressed_ledger(lost_first=64 * 75 // 2, evicted=64)  # exactly the low saving
    _keep_tail_states(even, kept, kept // 4, 1200)
    assert even.pays_under_pressure("tail-1")
    above_the_low = _pressed_ledger(lost_first=64 * 40, evicted=64)  # under 50, over 37.5
    _keep_tail_states(above_the_low, kept, kept // 4, 1200)
    assert not above_the_low.pays_under_pressure("tail-1")
    young = _pressed_ledger(lost_first=64 * 60, evicted=64)
    _keep_tail_states(young, align.RETENTION_WARMUP - 1, 2, 1200)
    assert young.pays_under_pressure("tail-1")  # too few states to judge
    # the family pays too: a distance that pays is refused while its family does not
    mixed = _pressed_ledger(lost_first=64 * 60, evicted=64)
    _keep_tail_states(mixed, kept, kept // 4, 1200)
    for block in range(3000, 3000 + kept):  # another distance, never reused
        mixed.record_kept("tail-2", block, ("u", block), blocks=6)
    mixed.value["tail-1"] = [90.0 * 6 * kept, 6.0 * kept]  # tail-1 alone: 90 a block, 67.5 low
    assert mixed.pays_under_pressure("tail-1")
    assert not mixed.pays_under_pressure("tail", family=True)
    assert not any(mixed.admits("tail-1", f"q{i}") for i in range(64) if not align.explores(f"q{i}"))


def test_under_pressure_no_single_hit_pays_the_price_and_paying_proves_a_rare_kind():
    kept = align.VALUE_MIN_SAMPLES * 2
    # one long hit: 76,800 tokens over 128 states of 6 blocks, 100 a block, against a price of 1
    lucky = _pressed_ledger(lost_first=64, evicted=64)
    _keep_tail_states(lucky, kept, 1, 76_800)
    assert lucky.value["tail-1"][0] / lucky.value["tail-1"][1] == 100
    assert not lucky.pays_under_pressure("tail-1") and not lucky.proven("tail-1")
    assert lucky.on_probation(1000 + kept - 1, ("t", 1000 + kept - 1))
    # nine hits (one state in 14, under the 1-in-8 bar), 8,000 tokens each: 93.75 a block,
    # 62.5 one standard error low: worth its blocks at a price of 60, not at 65
    paying = _pressed_ledger(lost_first=64 * 60, evicted=64)
    _keep_tail_states(paying, kept, 9, 8000)
    assert paying.reused["tail-1"] * align.RETENTION_MIN_REUSE < kept
    assert not paying.earns_blocks("tail-1")  # the value rule is off under pressure
    assert paying.proven("tail-1") and not paying.on_probation(1000 + kept - 1,
                                                                ("t", 1000 + kept - 1))
    # and admitted, not only kept on trial: the ledger's proof and its admission agree
    assert all(paying.admits("tail-1", f"r{i}") for i in range(64))
    dear = _pressed_ledger(lost_first=64 * 65, evicted=64)
    _keep_tail_states(dear, kept, 9, 8000)
    assert not dear.proven("tail-1")
    assert not any(dear.admits("tail-1", f"r{i}") for i in range(64)
                   if not align.explores(f"r{i}"))
    # without pressure the price proves nothing: the reuse count or the value rule decide
    roomy = _ledger_with_baseline(saved_per_block=200)
    _keep_tail_states(roomy, kept, 9, 8000)
    assert not roomy.prices_blocks() and not roomy.proven("tail-1")


def test_the_eviction_price_waits_for_pressure_and_samples_and_follows_the_traffic():
    kept = align.VALUE_MIN_SAMPLES
    few = _pressed_ledger(lost_first=64 * 60, evicted=align.VALUE_MIN_SAMPLES - 1)
    _keep_tail_states(few, kept, kept // 4, 1200)
    assert few.pays_under_pressure("tail-1")  # too few evictions to price a block
    roomy = _ledger_with_baseline(saved_per_block=16, hit_lookups=400)  # hits 40,000 tokens
    roomy.record_lookup(10, 64 * 60, requester=["r"])
    roomy.record_evicted(64)
    _keep_tail_states(roomy, kept, kept // 4, 1200)
    assert not roomy.capacity_bound() and roomy.pays_under_pressure("tail-1")
    assert roomy.snapshot()["eviction_price"] == 60.0
    assert align.RetentionLedger().eviction_price() is None
    # past the window both counts halve: the price keeps, the next evictions weigh more
    roomy.record_evicted(align.PRICE_WINDOW - 64)
    assert roomy.evicted_blocks == align.PRICE_WINDOW and roomy.eviction_price() < 60
    roomy.record_evicted()
    assert roomy.evicted_blocks == (align.PRICE_WINDOW + 1) / 2
    assert roomy.lost_first == 64 * 60 / 2


def test_a_hit_an_evicted_state_would_have_given_counts_toward_value_not_reuse():
    ledger = _ledger_with_baseline(saved_per_block=16)
    kept = align.VALUE_MIN_SAMPLES * 2
    _keep_tail_states(ledger, kept, 1, 100)  # one real hit, 100 tokens
    assert not ledger.earns_blocks("tail-1")
    for block in range(1001, 1001 + kept // 16):  # evicted, prefix still cached
        ledger.record_lookup(0, 0, ("t", block), 8000)
        ledger.record_lookup(0, 0, ("t", block), 8000)  # once per state
    ledger.record_lookup(0, 0, ("t", 1000), 8000)  # already reused: not again
    ledger.record_hit(1001, ("t", 1001), tokens=8000)  # credited by a lookup: not again
    ledger.record_lookup(0, 0, ("unknown", 1), 8000)
    assert ledger.reused["tail-1"] == 1
    assert ledger.value["tail-1"][0] == 100 + kept // 16 * 8000
    assert ledger.earns_blocks("tail-1")
    assert ledger.remembers(("t", 1000)) and not ledger.remembers(("unknown", 1))


def test_vllms_own_state_at_a_later_prompts_tail_distance_counts_for_that_kind():
    ledger = align.RetentionLedger()
    ledger.record_kept(align.VLLM_KIND, 5, "h5", blocks=3)
    ledger.record_kept(align.VLLM_KIND, 5, "h5", blocks=3)  # counted once
    ledger.record_kept("tail-2", 5, "h5", blocks=3)  # a later prompt hit it, two blocks back
    ledger.record_kept("tail-2", 5, "h5", blocks=3)
    ledger.record_hit(5, "h5", tokens=40)
    # vLLM's counts give it up: charged once, to the kind
    assert ledger.kept == {align.VLLM_KIND: 0, "tail-2": 1}
    assert ledger.reused == {align.VLLM_KIND: 0, "tail-2": 1}
    assert ledger.value["tail-2"] == [40, 3] and ledger.value[align.VLLM_KIND] == [0, 0]


def test_chunk_end_skips_tail_checkpoints_of_kinds_not_admitted():
    kinds = align.tail_checkpoints_by_kind(1500, 128, 4)
    assert kinds == {"tail-1": 1280, "tail-2": 1152, "tail-4": 896, "tail-8": 384}
    only_4 = lambda kind: kind == "tail-4"  # noqa: E731
    assert align.chunk_end(0, 1500, 1500, 1500, 128, 128, DEFAULT, admitted=only_4) == 896
    assert align.chunk_end(896, 1500, 1500, 1500, 128, 128, DEFAULT, admitted=only_4) == 1500


def _queue_with(blocks):
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    return FreeKVCacheBlockQueue(blocks)


def _ids(queue):
    out, block = [], queue.fake_free_list_head.next_free_block
    while block is not queue.fake_free_list_tail:
        out.append(block.block_id)
        block = block.next_free_block
    return out


def _block(block_id, hashed):
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    block = KVCacheBlock(block_id=block_id)
    if hashed:
        _set_hash(block, f"h{block_id}".encode())
    return block


def _set_hash(block, block_hash: bytes) -> None:
    if hasattr(block, "set_block_hash"):
        block.set_block_hash(block_hash, num_tokens=16)
    else:  # vLLM 0.23: a plain property, no token count
        block.block_hash = block_hash


def test_probation_blocks_go_after_the_uncached_free_blocks_before_every_cached_one():
    blocks = [_block(0, False), _block(1, False), _block(2, True), _block(3, True),
              _block(8, True), _block(9, True)]
    queue = _queue_with(blocks)
    coordinator_patch._evict_first_among_cached(coordinator_patch.CoordinatorState(), queue,
                                                [blocks[4], blocks[5]])
    assert _ids(queue) == [0, 1, 8, 9, 2, 3]
    assert queue.num_free_blocks == 6
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 8, 9, 2, 3]


def test_probation_keeps_lru_order_when_many_uncached_blocks_are_free():
    uncached = [_block(i, False) for i in range(coordinator_patch.PROBATION_SCAN + 1)]
    late = [_block(100, True), _block(101, True)]
    queue = _queue_with(uncached + late)
    coordinator_patch._evict_first_among_cached(coordinator_patch.CoordinatorState(), queue, late)
    assert _ids(queue)[-2:] == [100, 101] and queue.num_free_blocks == len(uncached) + 2


def test_probation_freed_without_pressure_is_still_evicted_before_cached_blocks():
    # freed while many uncached blocks were free (LRU place kept), a never-reused state must
    # still go before a block vLLM keeps once an allocation evicts (rag, nemotron-h-8b, 2M)
    uncached = [_block(i, False) for i in range(coordinator_patch.PROBATION_SCAN + 1)]
    kept_by_vllm, late = _block(50, True), [_block(100, True), _block(101, True)]
    queue = _queue_with(uncached + [kept_by_vllm] + late)
    coordinator_patch._evict_first_among_cached(coordinator_patch.CoordinatorState(), queue, late)
    assert _ids(queue)[-3:] == [50, 100, 101]
    popped = queue.popleft_n(len(uncached) - 1)  # no cached block reached: nothing moves
    assert [b.block_id for b in popped] == list(range(len(uncached) - 1))
    assert _ids(queue) == [len(uncached) - 1, 50, 100, 101]
    popped = queue.popleft_n(2)
    assert [b.block_id for b in popped] == [len(uncached) - 1, 100]
    assert _ids(queue) == [101, 50] and queue.num_free_blocks == 2
    popped = queue.popleft_n(1)
    assert [b.block_id for b in popped] == [101] and _ids(queue) == [50]


def test_deferred_probation_skips_blocks_hit_or_reused_meanwhile():
    uncached = [_block(i, False) for i in range(coordinator_patch.PROBATION_SCAN + 1)]
    kept_by_vllm, hit, reused = _block(50, True), _block(100, True), _block(101, True)
    queue = _queue_with(uncached + [kept_by_vllm, hit, reused])
    coordinator_patch._evict_first_among_cached(coordinator_patch.CoordinatorState(), queue,
                                                [hit, reused])
    queue.remove(hit)  # a later request's hit took it out of the free queue
    reused.reset_hash()  # evicted and cached again under another key
    _set_hash(reused, b"other")
    popped = queue.popleft_n(len(uncached) + 1)
    assert popped[-1] is kept_by_vllm and _ids(queue) == [101]


def test_kept_states_handed_back_mid_run_go_on_probation_once_every_group_is_free():
    state = coordinator_patch.CoordinatorState()
    ledger = state.ledger
    old, state_g1, state_g2 = _block(1, True), _block(5, True), _block(6, True)
    queue = _queue_with([_block(0, False), old])
    ledger.record_kept("decode", 5, state_g1.block_hash)
    kept = {5: (state_g1, state_g1.block_hash, [state_g1, state_g2])}
    state.kept_states["r"] = kept
    state_g1.ref_cnt = state_g2.ref_cnt = 0
    queue.append_n([state_g1])  # group 2 still holds its block: not yet
    pool = types.SimpleNamespace(free_block_queue=queue)
    coordinator_patch._release_probation(state, pool, "r", finished=False)
    assert _ids(queue) == [0, 1, 5] and 5 in kept
    queue.append_n([state_g2])
    coordinator_patch._release_probation(state, pool, "r", finished=False)
    assert _ids(queue) == [0, 5, 6, 1] and not kept
    assert "r" not in state.kept_states  # none left: the release wrapper can unbind itself


def test_a_reused_or_proven_state_keeps_its_lru_place():
    state_of_cache = coordinator_patch.CoordinatorState()
    ledger = state_of_cache.ledger
    spare, old, state, sibling = _block(0, False), _block(1, True), _block(5, True), _block(6, True)
    state.ref_cnt = sibling.ref_cnt = 0
    queue = _queue_with([spare, old, state, sibling])
    ledger.record_kept("tail-4", 5, state.block_hash)
    ledger.record_hit(5, state.block_hash)
    ledger.record_kept("decode", 6, sibling.block_hash)  # never hit, its kind unproven
    state_of_cache.kept_states["r"] = {
        5: (state, state.block_hash, [state]), 6: (sibling, sibling.block_hash, [sibling])}
    coordinator_patch._release_probation(state_of_cache, types.SimpleNamespace(free_block_queue=queue),
                                         "r", finished=True)
    assert _ids(queue) == [0, 6, 1, 5] and "r" not in state_of_cache.kept_states
    for block in range(align.RETENTION_WARMUP):  # decode states get reused: proven
        ledger.record_kept("decode", 100 + block, ("h", block))
        ledger.record_hit(100 + block, ("h", block))
    assert ledger.proven("decode") and not ledger.on_probation(6, sibling.block_hash)


def test_probation_is_first_in_first_out():
    blocks = [_block(0, False), _block(1, True), _block(7, True), _block(8, True), _block(9, True)]
    queue = _queue_with(blocks)
    state = coordinator_patch.CoordinatorState()
    coordinator_patch._evict_first_among_cached(state, queue, [blocks[2]])
    coordinator_patch._evict_first_among_cached(state, queue, [blocks[3]])
    coordinator_patch._evict_first_among_cached(state, queue, [blocks[4]])
    assert _ids(queue) == [0, 7, 8, 9, 1]  # the oldest state on probation is evicted first
    # one leaves the queue (a hit touched it): the next still queues behind the newest
    queue.remove(blocks[4])
    late = _block(10, True)
    queue.append_n([late])
    coordinator_patch._evict_first_among_cached(state, queue, [late])
    assert _ids(queue) == [0, 7, 8, 10, 1]


def test_interior_tail_checkpoints_match_the_splits_they_replace():
    # the chunk splits chunk_end makes without interior states are exactly these checkpoints
    for start in (0, 384, 512, 1280):
        stops, position = [], start
        while position < 1500:
            position = align.chunk_end(position, 1500, 1500, 1500, 128, 128, DEFAULT)
            stops.append(position)
        inside = align.interior_tail_checkpoints(start, 1500, 1500, 128, DEFAULT)
        assert inside == stops[:-1]
        assert align.chunk_end(start, 1500, 1500, 1500, 128, 128, DEFAULT,
                               interior_states=True) == 1500
    only_4 = lambda kind: kind == "tail-4"  # noqa: E731
    assert align.interior_tail_checkpoints(0, 1500, 1500, 128, DEFAULT, only_4) == [896]
    assert align.interior_tail_checkpoints(0, 1500, 1500, 128, OFF) == []
    assert align.interior_tail_checkpoints(300, 1500, 1500, 128, DEFAULT) == [896, 1152, 1280]
    assert align.interior_tail_checkpoints(257, 1500, 1500, 128, DEFAULT) == [896, 1152, 1280]


@pytest.mark.parametrize(("variable", "field"), [
    (align.INTERIOR_STATES_ENV, "interior_states"), (align.PASSED_STATES_ENV, "passed_states")])
def test_a_switch_is_read_from_the_environment(monkeypatch, variable, field):
    monkeypatch.setenv(variable, "0")
    assert getattr(align.current_policy(), field) is False
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(ValueError, match=f"{variable}='maybe'"):
        align.current_policy()


def test_decode_states_past_the_step_limit_are_not_kept(monkeypatch):
    near = align.AlignPolicy(tail_checkpoints=0, decode_max_steps=64)
    # boundary 1536 is 36 decode steps past a 1500-token prompt; 1664 is 164 steps past it
    assert align.retained_boundaries_by_kind(1500, 1537, 128, near) == {"decode": (1536,)}
    assert align.retained_boundaries_by_kind(1500, 1665, 128, near) == {}
    monkeypatch.setenv(align.DECODE_MAX_STEPS_ENV, "64")
    assert align.current_policy().decode_max_steps == 64
    monkeypatch.setenv(align.DECODE_MAX_STEPS_ENV, "-3")
    with pytest.raises(ValueError, match=r"DECODE_CHECKPOINT_MAX_STEPS='-3'.*>= 0"):
        align.current_policy()


def test_a_family_of_kinds_nobody_reuses_stops_being_admitted_as_a_whole():
    # dense tails: eight distances, none warmed up alone, none ever reused
    ledger = align.RetentionLedger()
    block = 0
    for distance in range(1, 9):
        for _ in range(align.RETENTION_WARMUP - 1):
            ledger.record_kept(f"tail-{distance}", block, ("h", block))
            block += 1
    assert all(ledger.kept[f"tail-{d}"] < align.RETENTION_WARMUP for d in range(1, 9))
    admitted = [r for r in (f"r{i}" for i in range(200)) if ledger.admits("tail-3", r)]
    assert len(admitted) < 200 / align.RETENTION_EXPLORE * 1.5  # only exploration
    # reuse anywhere in the family lets every distance warm up on its own again
    for hit in range(0, block, 2):
        ledger.record_hit(hit, ("h", hit))
    assert all(ledger.admits("tail-5", f"s{i}") for i in range(50))
    assert ledger.admits("decode", "r0")  # other families are not affected


def test_deferred_probation_leaves_a_state_whose_kind_was_proven_meanwhile():
    state = coordinator_patch.CoordinatorState()
    uncached = [_block(i, False) for i in range(coordinator_patch.PROBATION_SCAN + 1)]
    kept_by_vllm, tail_state = _block(50, True), _block(100, True)
    tail_state.ref_cnt = 0
    queue = _queue_with(uncached + [kept_by_vllm])
    queue.append_n([tail_state])
    state.ledger.record_kept("tail-2", 100, tail_state.block_hash)
    state.kept_states["r"] = {100: (tail_state, tail_state.block_hash, [tail_state])}
    coordinator_patch._release_probation(state, types.SimpleNamespace(free_block_queue=queue),
                                         "r", finished=True)
    assert 100 in state.deferred
    for block in range(align.RETENTION_WARMUP):  # tail-2 states get reused: proven
        state.ledger.record_kept("tail-2", 200 + block, ("h", block))
        state.ledger.record_hit(200 + block, ("h", block))
    popped = queue.popleft_n(len(uncached) + 1)
    assert popped[-1] is kept_by_vllm and _ids(queue) == [100]


def _proven_tail_2(ledger) -> None:
    for block in range(align.RETENTION_WARMUP):  # tail-2 states get reused: proven
        ledger.record_kept("tail-2", 200 + block, ("h", block))
        ledger.record_hit(200 + block, ("h", block))
    assert ledger.proven("tail-2")


def _released_at_lru_place(proven_after: bool):
    """A tail-2 state of a proven kind, released behind a block vLLM keeps, then (unless
    ``proven_after``) its kind loses the proof; the queue, the state's blocks and vLLM's block."""
    state = coordinator_patch.CoordinatorState()
    _proven_tail_2(state.ledger)
    spare, kept_by_vllm = _block(0, False), _block(50, True)
    tail_state, sibling, hit_state = _block(100, True), _block(101, True), _block(102, True)
    queue = _queue_with([spare, kept_by_vllm])
    for block in (tail_state, sibling, hit_state):
        block.ref_cnt = 0
    queue.append_n([tail_state, sibling, hit_state])
    state.ledger.record_kept("tail-2", 100, tail_state.block_hash, blocks=2)
    state.ledger.record_kept("tail-2", 102, hit_state.block_hash)
    state.ledger.record_hit(102, hit_state.block_hash)  # reused: keeps its place whatever
    state.kept_states["r"] = {100: (tail_state, tail_state.block_hash, [tail_state, sibling]),
                              102: (hit_state, hit_state.block_hash, [hit_state])}
    coordinator_patch._release_probation(state, types.SimpleNamespace(free_block_queue=queue),
                                         "r", finished=True)
    assert _ids(queue) == [0, 50, 100, 101, 102]  # proven: LRU places
    if not proven_after:
        for block in range(300, 300 + 8 * align.RETENTION_WARMUP):  # never reused
            state.ledger.record_kept("tail-2", block, ("n", block))
        assert not state.ledger.proven("tail-2")
    return state, queue


def test_extras_at_lru_places_are_evicted_first_once_their_kind_loses_its_proof():
    state, queue = _released_at_lru_place(proven_after=False)
    popped = queue.popleft_n(1)  # only the uncached block: nothing moves yet
    assert [b.block_id for b in popped] == [0] and _ids(queue) == [50, 100, 101, 102]
    popped = queue.popleft_n(2)  # would evict vLLM's block: the demoted state goes first
    assert [b.block_id for b in popped] == [100, 101] and _ids(queue) == [50, 102]
    assert not state.lru_extras  # the kind is forgotten, checked once


def test_extras_at_lru_places_keep_them_while_their_kind_is_proven():
    state, queue = _released_at_lru_place(proven_after=True)
    popped = queue.popleft_n(2)
    assert [b.block_id for b in popped] == [0, 50] and _ids(queue) == [100, 101, 102]
    assert list(state.lru_extras["tail-2"]) == [100]  # 102 was reused: never demoted


def test_demotion_skips_a_state_whose_block_was_evicted_and_cached_again():
    state, queue = _released_at_lru_place(proven_after=False)
    sibling = queue.fake_free_list_tail.prev_free_block.prev_free_block
    assert sibling.block_id == 101
    sibling.reset_hash()  # evicted and cached again under another key
    _set_hash(sibling, b"other")
    popped = queue.popleft_n(2)
    assert [b.block_id for b in popped] == [0, 50]  # the state is not whole: left as is


def test_demotion_skips_a_state_whose_block_a_request_holds():
    state, queue = _released_at_lru_place(proven_after=False)
    sibling = queue.fake_free_list_tail.prev_free_block.prev_free_block
    queue.remove(sibling)  # taken out of the free queue again (a hit holds it)
    sibling.ref_cnt = 1
    popped = queue.popleft_n(2)
    assert [b.block_id for b in popped] == [0, 50] and _ids(queue) == [100, 102]


def test_a_state_recomputed_into_a_remembered_block_is_moved_once():
    # remembered at its LRU place, evicted, recomputed into the same blocks under the same
    # hash, released again once its kind lost its proof: on probation, not demoted a second time
    state, queue = _released_at_lru_place(proven_after=False)
    tail_state = queue.fake_free_list_tail.prev_free_block.prev_free_block.prev_free_block
    sibling = tail_state.next_free_block
    assert (tail_state.block_id, sibling.block_id) == (100, 101)
    for block in (tail_state, sibling):
        queue.remove(block)
        block.ref_cnt = 1
    for block in (tail_state, sibling):  # the new request frees them again
        block.ref_cnt = 0
    queue.append_n([tail_state, sibling])
    state.kept_states["r2"] = {100: (tail_state, tail_state.block_hash, [tail_state, sibling])}
    coordinator_patch._release_probation(state, types.SimpleNamespace(free_block_queue=queue),
                                         "r2", finished=True)
    assert _ids(queue) == [0, 100, 101, 50, 102]  # on probation at once (unproven)
    assert not state.lru_extras and not state.lru_extra_kinds  # the old record is gone
    popped = queue.popleft_n(4)  # reaches vLLM's block: nothing is demoted twice
    assert [b.block_id for b in popped] == [0, 100, 101, 50] and _ids(queue) == [102]


def test_a_remembered_state_deferred_again_is_moved_once():
    state, queue = _released_at_lru_place(proven_after=False)
    tail_state = queue.fake_free_list_tail.prev_free_block.prev_free_block.prev_free_block
    sibling = tail_state.next_free_block
    # the same blocks, still free and unchanged, also deferred (freed while the pool was roomy)
    state.deferred[100] = (tail_state, tail_state.block_hash)
    state.deferred[101] = (sibling, sibling.block_hash)
    popped = queue.popleft_n(3)
    assert [b.block_id for b in popped] == [0, 100, 101] and _ids(queue) == [50, 102]
    assert queue.num_free_blocks == 2


def test_a_reused_extra_is_not_remembered_for_demotion():
    state, _ = _released_at_lru_place(proven_after=True)
    assert 102 not in state.lru_extra_kinds and list(state.lru_extras["tail-2"]) == [100]


def test_unproven_interior_states_take_only_blocks_no_upstream_state_needs():
    state = coordinator_patch.CoordinatorState()
    probation_block = _block(7, True)
    queue = _queue_with([_block(0, False), _block(1, False), probation_block, _block(2, True),
                         _block(3, True)])
    state.probation[7] = probation_block.block_hash  # an extra on probation: may be taken
    pool = types.SimpleNamespace(free_block_queue=queue)
    planned = [(1, [3, 4, 5]), (2, [3, 4, 5]), (3, [])]
    # three blocks spare (two uncached, one on probation), one reserved for vLLM's own: one
    # column per group, the one nearest the chunk's end
    assert coordinator_patch._affordable_interior(state, pool, 1, planned) == [(1, [5]), (2, [5])]
    assert coordinator_patch._affordable_interior(state, pool, 3, planned) == []
    roomy = types.SimpleNamespace(free_block_queue=_queue_with(
        [_block(i, False) for i in range(10, 20)]))
    assert coordinator_patch._affordable_interior(state, roomy, 2, planned) == planned[:2]


def test_interior_columns_part_proven_kinds_from_the_ones_still_on_trial():
    ledger = align.RetentionLedger()
    for block in range(align.RETENTION_WARMUP):  # tail-1 states warmed up and reused
        ledger.record_kept("tail-1", block, ("h", block))
        ledger.record_hit(block, ("h", block))
    manager = types.SimpleNamespace(block_size=128, _partial_hit_reqs=set())
    request = types.SimpleNamespace(request_id="r", num_prompt_tokens=1500, num_tokens=1500)
    proven, trial, refused, far = coordinator_patch._interior_columns(ledger, manager, request,
                                                                      0, 1500)
    policy = align.policy_for_model(align.active_policy(), internal_prefill_checkpoints=False,
                                    interior_states=True)
    every = align.interior_tail_checkpoints(0, 1500, 1500, 128, policy)
    assert proven == interior.planned_columns([1280], 128)  # tail-1: 1408 - 128
    assert sorted(proven + trial) == interior.planned_columns(every, 128) and len(trial) > 1
    assert refused == {} and far == {}  # 11 blocks: nothing past the dense reach


@pytest.mark.skipif(not has_mamba2_prefill_checkpoint(), reason=(
    "this vLLM has no Mamba2 prefill checkpoint (0.32+)"))
@pytest.mark.parametrize("eagle_drop", [False, True], ids=["no-eagle", "eagle-block-drop"])
def test_interior_columns_leave_the_column_of_vllms_checkpoint_to_it(eagle_drop):
    # vLLM's Mamba2 worker writes its prefill checkpoint into the block at column
    # cdiv(end, block) - 2 of every chunk it finds valid, final or not; below the block the
    # checkpoint is a unit boundary, not that column's boundary (with EAGLE's block drop a unit
    # lower still), so an interior block placed there would be cached under the boundary's key
    # holding the checkpoint's state (branching nemotron-h-8b 262,144 at unit 16: a resume
    # from 3,120 found the state after 3,520).
    from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

    size, unit, prompt = 64, 16, 1600
    manager = types.SimpleNamespace(block_size=size, _partial_hit_reqs=set(),
                                    cache_hit_alignment_tokens=unit,
                                    has_prefill_checkpoint_blocks=True,
                                    drop_eagle_checkpoint_block=eagle_drop)
    request = types.SimpleNamespace(request_id="r", num_prompt_tokens=prompt, num_tokens=prompt)
    policy = align.policy_for_model(align.active_policy(), internal_prefill_checkpoints=False,
                                    interior_states=True)
    would_have_taken = lost = 0
    for start in range(0, 1200, 8):  # also starts off the unit: vLLM finds those invalid
        for end in range(start + size + 1, min(start + 400, prompt) + 1):
            offsets, cols = compute_mamba_prefill_checkpoints(
                [end], [end - start], hash_block_size=unit, mamba_block_size=size,
                checkpoint_alignment=1, drop_eagle_block=eagle_drop,
                cache_hit_alignment_tokens=unit)
            found = coordinator_patch._interior_columns(align.RetentionLedger(), manager,
                                                        request, start, end)
            planned = {*found.proven, *found.on_trial, *found.refused, *found.far}
            candidates = set(interior.planned_columns(align.interior_tail_checkpoints_by_kind(
                start, end, prompt, size, policy).values(), size))
            if cols[0] < 0:  # no checkpoint written: at most vLLM's column is left out
                column = interior.vllm_checkpoint_column(end, size)
                assert planned in (candidates, candidates - {column}), (start, end)
                lost += planned != candidates
            elif start + offsets[0] == (cols[0] + 1) * size:  # the boundary's own state
                assert planned == candidates, (start, end)
            else:
                would_have_taken += cols[0] in candidates
                assert planned == candidates - {cols[0]}, (start, end, offsets[0], cols[0])
    assert would_have_taken > 100 and lost < would_have_taken


def test_interior_columns_offer_kinds_the_ledger_refuses_for_trial():
    ledger = align.RetentionLedger()
    for block in range(align.RETENTION_WARMUP * align.RETENTION_MIN_REUSE):  # never reused
        ledger.record_kept("tail-1", block, ("h", block))
    request = types.SimpleNamespace(request_id="r", num_prompt_tokens=1500, num_tokens=1500)
    assert zlib.crc32(b"r") % align.RETENTION_EXPLORE  # "r" is not sampled for exploration
    assert not ledger.admits("tail-1", "r")
    manager = types.SimpleNamespace(block_size=128, _partial_hit_reqs=set())
    proven, trial, refused, far = coordinator_patch._interior_columns(ledger, manager, request,
                                                                      0, 1500)
    tail_1 = interior.planned_columns([1280], 128)[0]  # 1408 - 128
    assert proven == [] and refused[tail_1] == "tail-1" and tail_1 not in trial and far == {}
    # the pool gave its block: the request keeps that state after all, the others stay as decided
    ledger.keep_on_trial([refused[tail_1]], "r")
    assert zlib.crc32(b"q") % align.RETENTION_EXPLORE
    assert ledger.admits("tail-1", "r") and not ledger.admits("tail-1", "q")
    assert "tail-2" in refused.values() and not ledger.admits("tail-2", "r")
    ledger.forget_request("r")
    assert not ledger.admits("tail-1", "r")


def test_refused_kinds_get_interior_blocks_only_from_a_roomy_pool():
    margin = coordinator_patch.ROOMY_UNCACHED_BLOCKS
    planned = [(1, [3, 4]), (2, [3, 4]), (3, [])]
    # four columns, two blocks reserved for vLLM's own: 6 + margin uncached blocks needed
    roomy = _queue_with([_block(i, False) for i in range(6 + margin)] + [_block(900, True)])
    assert coordinator_patch._roomy_interior(roomy, 2, planned) == planned[:2]
    short = _queue_with([_block(i, False) for i in range(5 + margin)])
    assert coordinator_patch._roomy_interior(short, 2, planned) == []
    # a cached block (an extra on probation too: it has a hash) ends the count
    split = _queue_with([_block(i, False) for i in range(3)] + [_block(900, True)]
                        + [_block(i, False) for i in range(10, 20 + margin)])
    assert coordinator_patch._roomy_interior(split, 2, planned) == []
    assert coordinator_patch._roomy_interior(roomy, 2, [(1, []), (2, [])]) == []



def test_a_state_of_vllms_that_a_later_prompt_goes_past_becomes_passed_and_loses_its_place_only_on_evidence():
    ledger = align.RetentionLedger()
    ledger.record_kept(align.VLLM_KIND, 1, "s1", 2)
    ledger.record_hit(1, "s1", 40)  # the next turn resumes from it ...
    assert ledger.pass_on(1, "s1", 2)  # ... and goes on past it
    assert ledger.kind_of(1, "s1") == align.PASSED
    assert not ledger.pass_on(1, "s1", 2)  # a second prompt going past it: a fork, no change
    ledger.record_kept("tail-1", 2, "s2")
    assert not ledger.pass_on(2, "s2") and ledger.kind_of(2, "s2") == "tail-1"  # not vLLM's
    assert not ledger.pass_on(3, "never kept")
    # vLLM's own: its LRU place stays until the kind shows it is rarely reused
    assert not ledger.on_probation(1, "s1")
    for n in range(align.RETENTION_WARMUP):
        ledger.record_kept(align.VLLM_KIND, 100 + n, ("p", n))
        ledger.pass_on(100 + n, ("p", n))
    assert ledger.on_probation(1, "s1") and ledger.on_probation(100, ("p", 0))
    ledger.record_hit(100, ("p", 0), 40)  # a second prompt resumed from it: a fork, kept
    assert not ledger.on_probation(100, ("p", 0)) and ledger.on_probation(1, "s1")
    # the states (and their blocks) moved to the new kind; the hit that came first stays vLLM's
    assert ledger.kept[align.VLLM_KIND] == 0 and ledger.kept[align.PASSED] == 1 + align.RETENTION_WARMUP
    assert ledger.value[align.VLLM_KIND] == [40.0, 0.0]
    assert ledger.reused[align.VLLM_KIND] == 1 and ledger.reused[align.PASSED] == 1
    # one in RETENTION_MIN_REUSE passed states reused: every one keeps its LRU place again
    needed = -(-ledger.kept[align.PASSED] // align.RETENTION_MIN_REUSE) - 1
    assert needed >= 1
    for n in range(needed):
        ledger.record_hit(101 + n, ("p", 1 + n), 40)
    assert not ledger.on_probation(1, "s1")


def test_an_extra_kind_at_a_passed_states_boundary_takes_it_over():
    ledger = align.RetentionLedger()
    ledger.record_kept(align.VLLM_KIND, 1, "s1", 3)
    ledger.pass_on(1, "s1", 3)
    ledger.record_kept("tail-2", 1, "s1", 3)  # a later prompt's tail-2 boundary is this state
    assert ledger.kind_of(1, "s1") == "tail-2"
    assert ledger.kept[align.PASSED] == 0 and ledger.value[align.PASSED][1] == 0
    assert ledger.kept["tail-2"] == 1 and ledger.kept[align.VLLM_KIND] == 0


def test_passed_states_queue_behind_the_probation_segment_and_extras_never_take_them():
    state = coordinator_patch.CoordinatorState()
    uncached, lru = _block(0, False), _block(1, True)
    extra, passed, passed_late = _block(7, True), _block(8, True), _block(9, True)
    queue = _queue_with([uncached, lru, extra, passed, passed_late])
    coordinator_patch._evict_first_among_cached(state, queue, [extra])
    coordinator_patch._evict_before_lru(state, queue, [passed])
    assert _ids(queue) == [0, 7, 8, 1, 9]
    coordinator_patch._evict_before_lru(state, queue, [passed_late])
    assert _ids(queue) == [0, 7, 8, 9, 1]  # first in, first out among passed states
    extra_late = _block(10, True)
    queue.append_n([extra_late])
    coordinator_patch._evict_first_among_cached(state, queue, [extra_late])
    assert _ids(queue) == [0, 7, 10, 8, 9, 1]  # extras nobody reused still go first
    # an unproven extra may take uncached and probation blocks, never a passed state's
    assert coordinator_patch._spare_for_extras(state, queue, 10) == 3
    roomy = _queue_with([_block(i, False) for i in range(20, 21 + coordinator_patch.PROBATION_SCAN)]
                        + [_block(11, True)])
    coordinator_patch._evict_before_lru(coordinator_patch.CoordinatorState(), roomy,
                                        [roomy.fake_free_list_tail.prev_free_block])
    assert _ids(roomy)[-1] == 11  # plenty of uncached blocks free: LRU order stays


def test_a_state_cached_again_where_an_earlier_copy_was_reused_is_a_fork_never_passed():
    ledger = align.RetentionLedger()
    ledger.record_kept(align.VLLM_KIND, 1, "system prompt")
    ledger.record_hit(1, "system prompt", 40)  # another session resumed from it
    ledger.record_kept(align.VLLM_KIND, 9, "system prompt")  # evicted, cached again elsewhere
    assert not ledger.pass_on(9, "system prompt")
    ledger.record_kept(align.VLLM_KIND, 2, "a turn's end")  # never reused: passed by the next
    ledger.record_kept(align.VLLM_KIND, 3, "a turn's end")
    assert ledger.pass_on(3, "a turn's end")
    # a hit an evicted copy would have given makes the place a fork too
    ledger.record_kept(align.VLLM_KIND, 4, "edited turn")
    ledger.record_lookup(40, 0, "edited turn", 40)
    ledger.record_kept(align.VLLM_KIND, 5, "edited turn")
    assert not ledger.pass_on(5, "edited turn")


def test_a_state_a_second_request_resumed_from_is_a_fork_never_passed():
    ledger = align.RetentionLedger()
    ledger.record_kept(align.VLLM_KIND, 1, "turn")
    ledger.record_hit(1, "turn", 40, requester="regenerate")  # a resend resumed from it
    ledger.record_hit(1, "turn", 40, requester="next turn")
    assert not ledger.pass_on(1, "turn")
    ledger.record_kept(align.VLLM_KIND, 2, "other turn")
    ledger.record_hit(2, "other turn", 40, requester="next turn")
    ledger.record_hit(2, "other turn", 40, requester="next turn")  # looked up again, waiting
    assert ledger.pass_on(2, "other turn")


def test_a_segment_end_that_was_hit_and_freed_again_is_not_an_anchor():
    # the passed state 8 is hit (leaves the queue) and freed again at the LRU end: the next
    # passed state still goes in front of the LRU blocks, not behind 8
    state = coordinator_patch.CoordinatorState()
    blocks = [_block(0, False), _block(1, True), _block(2, True), _block(8, True), _block(9, True)]
    queue = _queue_with(blocks[:4])
    coordinator_patch._evict_before_lru(state, queue, [blocks[3]])
    assert _ids(queue) == [0, 8, 1, 2]
    queue.remove(blocks[3])
    queue.append_n([blocks[3], blocks[4]])
    coordinator_patch._evict_before_lru(state, queue, [blocks[4]])
    assert _ids(queue) == [0, 9, 1, 2, 8]
    # the same for the probation segment
    extra, late = _block(20, True), _block(21, True)
    queue.append_n([extra])
    coordinator_patch._evict_first_among_cached(state, queue, [extra])
    assert _ids(queue) == [0, 20, 9, 1, 2, 8]
    queue.remove(extra)
    queue.append_n([extra, late])
    coordinator_patch._evict_first_among_cached(state, queue, [late])
    assert _ids(queue) == [0, 21, 9, 1, 2, 8, 20]


def test_a_passed_hit_goes_to_the_passed_segment_only_while_passed_and_refused():
    state = coordinator_patch.CoordinatorState()
    ledger = state.ledger
    for n in range(align.RETENTION_WARMUP):  # passed states nobody resumed from: refused
        ledger.record_kept(align.VLLM_KIND, 100 + n, ("p", n))
        ledger.pass_on(100 + n, ("p", n))
    request = next(f"r{n}" for n in range(100) if not align.explores(f"r{n}"))
    explorer = next(f"r{n}" for n in range(100) if align.explores(f"r{n}"))
    lru, passed, taken_over, explored = _block(1, True), _block(5, True), _block(6, True), _block(7, True)
    queue = _queue_with([_block(0, False), lru, passed, taken_over, explored])
    for block in (passed, taken_over, explored):
        block.ref_cnt = 0
        ledger.record_kept(align.VLLM_KIND, block.block_id, block.block_hash)
        assert ledger.pass_on(block.block_id, block.block_hash)
        state.passed_keys.add(block.block_id)
    ledger.record_kept("tail-2", 6, taken_over.block_hash)  # a tail kind's boundary: not passed
    state.kept_states[request] = {5: (passed, passed.block_hash, [passed]),
                                  6: (taken_over, taken_over.block_hash, [taken_over])}
    state.kept_states[explorer] = {7: (explored, explored.block_hash, [explored])}
    pool = types.SimpleNamespace(free_block_queue=queue)
    coordinator_patch._release_probation(state, pool, request, finished=True)
    coordinator_patch._release_probation(state, pool, explorer, finished=True)
    assert _ids(queue) == [0, 5, 1, 6, 7]  # the tail kind's state and the sample's stay put
    assert not state.kept_states and not state.passed_keys


def test_a_preempted_request_leaves_its_passed_state_in_place_and_no_entry_behind():
    state = coordinator_patch.CoordinatorState()
    coordinator = types.SimpleNamespace(_hybrid_state=state)
    coordinator.remove_skipped_blocks = object()  # the release wrapper, bound
    block = _block(5, True)
    state.passed_keys.add(5)
    state.kept_states["r"] = {5: (block, block.block_hash, [block])}
    coordinator_patch.keep_passed_in_place(coordinator, "r")
    assert state.kept_states == {} and state.passed_keys == set()
    assert "remove_skipped_blocks" not in vars(coordinator)
