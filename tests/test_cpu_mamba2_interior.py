"""Mamba2 states inside a prefill chunk on vLLM-CPU: planned from the block table by the
metadata-builder patch, stored from the SSD scan's chunk states by the checkpoint-store patch.

Checked with vLLM's own chunk table and CPU scan: every interior block (NaN-poisoned before)
holds the conv window of its prefix exactly and the state of vLLM's CPU scan run over that
prefix alone (to the scan's float rounding); vLLM's own checkpoint is still stored; nothing
else is written. The builder wrapper gives a step without vLLM's checkpoint an empty one, and
another KV-cache group re-gathers its own destination blocks.
"""

from __future__ import annotations

import dataclasses
import random
import types

import pytest
import torch

from vllm_hybrid_backends import compat
from vllm_hybrid_backends.patches import (
    patch_vllm_model_executor_layers_mamba_ops_ssd_combined as scan_patch,
)
from vllm_hybrid_backends.patches import patch_vllm_v1_attention_backends_mamba2_attn as plan_patch
from vllm_hybrid_backends.testing.bits import assert_same_bits

ssd_combined = pytest.importorskip("vllm.model_executor.layers.mamba.ops.ssd_combined")
cpu_ssm = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm")
mamba_mixer2 = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_mixer2")
layer_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
mamba_attn = pytest.importorskip("vllm.v1.attention.backends.mamba_attn")
if not compat.has_mamba2_prefill_checkpoint():
    pytest.skip("this vLLM has no Mamba2 prefill checkpoint to carry interior states (0.32+)",
                allow_module_level=True)
checkpoint_md = pytest.importorskip("vllm.model_executor.layers.mamba.checkpoint")

CPU_SCAN = cpu_ssm._mamba_chunk_scan_combined_fwd_cpu
COMPUTE_CHUNKS = mamba_attn.BaseMambaAttentionMetadataBuilder._compute_chunk_metadata
HEADS, HEAD_DIM, GROUPS, D_STATE = 4, 6, 2, 5
CHUNK, BLOCK = 16, 32
KERNEL, DIM = 4, 7  # conv kernel 4: a window of 3 inputs
NUM_BLOCKS = 48
# the CPU scan works in 4-token vector steps: a chunked scan equals one call to rounding
SCAN_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}






@dataclasses.dataclass
class Step:
    """One step's batch: a decode row, then prefill rows (computed tokens, query length)."""

    prefills: list[tuple[int, int]]
    table: torch.Tensor  # block table, row 0 the decode
    vllm_offsets: list[int]  # vLLM's own checkpoint per prefill row (0: none)

    @property
    def query_start(self) -> torch.Tensor:
        return torch.tensor([0, 1, *(1 + torch.tensor([n for _, n in self.prefills]).cumsum(0)).tolist()])

    @property
    def seq_lens(self) -> torch.Tensor:
        return torch.tensor([200, *(c + n for c, n in self.prefills)])


def _step(rng: random.Random) -> Step:
    """Row 1 fresh [0, 110) with vLLM's checkpoint at 96 and an interior block at 32 (column 1
    null); row 2 resumed [64, 164) with interior blocks at 96, 128, 160; row 3 inside a block."""
    prefills = [(0, 110), (64, 100), (40, 20)]
    blocks = iter(rng.sample(range(1, NUM_BLOCKS), 12))
    table = torch.zeros(4, 8, dtype=torch.int32)
    table[0, 6] = next(blocks)
    table[1, [0, 2, 3]] = torch.tensor([next(blocks) for _ in range(3)], dtype=torch.int32)
    table[2, [2, 3, 4, 5]] = torch.tensor([next(blocks) for _ in range(4)], dtype=torch.int32)
    table[3, 1] = next(blocks)
    return Step(prefills, table, [96, 0, 0])


def _plan(step: Step, prune: bool = True) -> plan_patch.InteriorPlan | None:
    return plan_patch.plan_interior_states(step.table, step.query_start, step.seq_lens, 1,
                                           len(step.prefills), 1, BLOCK, CHUNK, step.vllm_offsets,
                                           COMPUTE_CHUNKS, prune_on_host=prune)


def test_plan_reads_the_blocks_each_prefill_crosses_and_leaves_vllms_checkpoint_to_vllm():
    step = _step(random.Random(0))
    plan = _plan(step)
    assert plan is not None
    t = step.table
    # row 1: column 0 (state after 32); column 2 is vLLM's checkpoint (96), column 3 running
    # row 2: columns 2, 3, 4 (after 96, 128, 160); column 5 running
    assert plan.batch.dst_block.tolist() == [int(t[1, 0]), int(t[2, 2]), int(t[2, 3]), int(t[2, 4])]
    assert plan.request_rows.tolist() == [1, 2, 2, 2]
    assert plan.block_cols.tolist() == [0, 2, 3, 4]
    # prefill tokens: row 1 starts at 0, row 2 at 110
    assert plan.batch.token_end.tolist() == [32, 110 + 32, 110 + 64, 110 + 96]
    assert plan.batch.seq_start.tolist() == [0, 110, 110, 110]
    assert plan.batch.initial_block.tolist() == [-1] * 4
    bounds, owners, _, _ = COMPUTE_CHUNKS(CHUNK, 3, torch.tensor([0, 64, 40]),
                                          step.query_start[1:] - 1, step.vllm_offsets)
    assert [bounds[c + 1] for c in plan.batch.temporal_row.tolist()] == plan.batch.token_end.tolist()
    assert [owners[c] for c in plan.batch.temporal_row.tolist()] == [0, 1, 1, 1]

    other = step.table + 100
    again = plan.regather(other)
    assert again.batch.dst_block.tolist() == [b + 100 for b in plan.batch.dst_block.tolist()]
    assert torch.equal(again.batch.token_end, plan.batch.token_end)


def test_vllms_checkpoint_at_a_unit_boundary_keeps_its_column():
    """With a ``prefix_match_unit`` below the block, vLLM's checkpoint is the prompt's last unit
    boundary (104 with unit 8), written to the column of the block boundary below it (96):
    the plan must leave that column to vLLM, or two states go to one block."""
    step = _step(random.Random(0))
    step.vllm_offsets = [104, 0, 0]
    plan = _plan(step)
    assert plan is not None
    assert plan.request_rows.tolist() == [1, 2, 2, 2]
    assert plan.block_cols.tolist() == [0, 2, 3, 4]
    assert len(set(plan.batch.dst_block.tolist())) == 4


def test_a_device_table_is_planned_without_a_host_read():
    """On a GPU the block table is a device tensor: every candidate boundary is planned, its
    destination gathered where the table lives, -1 where the manager left the null block."""
    step = _step(random.Random(0))
    host = plan_patch.plan_interior_states(step.table, step.query_start, step.seq_lens, 1,
                                           len(step.prefills), 1, BLOCK, CHUNK, step.vllm_offsets,
                                           COMPUTE_CHUNKS, prune_on_host=False)
    assert host is not None
    t = step.table
    # row 1: columns 0, 1 (null); column 2 is vLLM's checkpoint; row 2: columns 2, 3, 4
    assert host.block_cols.tolist() == [0, 1, 2, 3, 4]
    assert host.batch.dst_block.tolist() == [int(t[1, 0]), -1, int(t[2, 2]), int(t[2, 3]), int(t[2, 4])]
    pruned = _plan(step)
    kept = [k for k, b in enumerate(host.batch.dst_block.tolist()) if b >= 0]
    for field in ("token_end", "seq_start", "dst_block", "temporal_row"):
        assert getattr(pruned.batch, field).tolist() == [getattr(host.batch, field).tolist()[k] for k in kept]
    # a meta table has no values: any host read would fail
    on_device = plan_patch.plan_interior_states(step.table.to("meta"), step.query_start, step.seq_lens,
                                                1, len(step.prefills), 1, BLOCK, CHUNK,
                                                step.vllm_offsets, COMPUTE_CHUNKS)
    assert on_device is not None and on_device.batch.dst_block.device.type == "meta"
    assert on_device.batch.temporal_row.shape == host.batch.temporal_row.shape


def test_plan_refuses_a_block_size_that_is_not_a_multiple_of_the_chunk():
    step = _step(random.Random(1))
    with pytest.raises(ValueError, match="multiple of the chunk size"):
        plan_patch.plan_interior_states(step.table, step.query_start, step.seq_lens, 1, 3, 1,
                                        BLOCK, 24, step.vllm_offsets, COMPUTE_CHUNKS)


def test_no_real_block_inside_the_chunk_means_no_plan():
    step = _step(random.Random(2))
    step.table[1:, :5] = 0
    assert _plan(step) is None


def _inputs(gen: torch.Generator, tokens: int) -> dict[str, torch.Tensor]:
    return dict(
        x=torch.randn(tokens, HEADS, HEAD_DIM, generator=gen),
        dt=torch.randn(tokens, HEADS, generator=gen),
        A=-torch.rand(HEADS, generator=gen),
        B=torch.randn(tokens, GROUPS, D_STATE, generator=gen),
        C=torch.randn(tokens, GROUPS, D_STATE, generator=gen),
        D=torch.randn(HEADS, generator=gen),
        dt_bias=torch.randn(HEADS, generator=gen),
    )


@pytest.mark.parametrize("dim_first", [pytest.param(False, id="conv-SD"), pytest.param(True, id="conv-DS")])
@pytest.mark.parametrize("state_dtype", [pytest.param(torch.float32, id="fp32-states"),
                                         pytest.param(torch.bfloat16, id="bf16-states")])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("pruned", [pytest.param(True, id="host-plan"),
                                    pytest.param(False, id="device-plan")])  # -1: skipped
def test_interior_states_equal_a_forward_over_the_prefix(mamba2_scan_patched, mamba2_store_patched,
                                                         monkeypatch, dim_first, state_dtype, seed,
                                                         pruned):
    monkeypatch.setattr(layer_utils, "is_conv_state_dim_first", lambda: dim_first)
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    step = _step(rng)
    plan = _plan(step, pruned)
    assert plan is not None
    prefill_start = step.query_start[1:] - 1
    lengths = [n for _, n in step.prefills]
    tokens = sum(lengths)
    inputs = _inputs(gen, tokens)
    initial = torch.randn(len(lengths), HEADS, HEAD_DIM, D_STATE, generator=gen)
    initial[0] = 0  # row 1 is fresh
    x = torch.randn(DIM, tokens, generator=gen)  # the pre-conv input, (dim, tokens)
    conv = torch.randn(NUM_BLOCKS, *((DIM, KERNEL - 1) if dim_first else (KERNEL - 1, DIM)),
                       generator=gen)
    ssm = torch.randn(NUM_BLOCKS, HEADS, HEAD_DIM, D_STATE, generator=gen).to(state_dtype)

    # vLLM's chunk table with its checkpoint, and the scan's chunk states (the patched CPU scan)
    bounds, owners, last, vllm_chunks = COMPUTE_CHUNKS(
        CHUNK, 3, torch.tensor([c for c, _ in step.prefills]), prefill_start, step.vllm_offsets)
    states = ssd_combined.mamba_chunk_scan_combined_varlen(
        chunk_size=CHUNK, cu_seqlens=prefill_start.int(), cu_chunk_seqlens=torch.tensor(bounds, dtype=torch.int32),
        last_chunk_indices=torch.tensor(last), seq_idx=torch.tensor(owners, dtype=torch.int32),
        out=torch.empty(tokens, HEADS, HEAD_DIM), initial_states=initial, dt_softplus=True,
        return_intermediate_states=True, state_dtype=state_dtype, **inputs)
    vllm_block = int(step.table[1, 2])
    checkpoint = checkpoint_md.MambaPrefillCheckpointMetadata(
        checkpoint_offsets=torch.tensor(step.vllm_offsets, dtype=torch.int32),
        state_indices=torch.tensor([vllm_block, 0, 0], dtype=torch.int32), offsets=step.vllm_offsets)
    setattr(checkpoint, plan_patch.INTERIOR_ATTR, plan)
    written = [vllm_block, *(b for b in plan.batch.dst_block.tolist() if b >= 0)]
    conv[written] = float("nan")
    ssm[written] = float("nan")
    before = (conv.clone(), ssm.clone())

    mamba_mixer2.store_prefill_checkpoint(
        checkpoint, torch.tensor([max(c, 0) for c in vllm_chunks]), x,
        conv if dim_first else conv.transpose(-1, -2), states, ssm, prefill_start, state_len=KERNEL - 1)

    ends = [(0, 96, vllm_block)] + [(int(p) - 1, int(e) - int(prefill_start[int(p) - 1]), int(b))
                                    for p, e, b in zip(plan.request_rows, plan.batch.token_end,
                                                       plan.batch.dst_block) if b >= 0]
    assert len(ends) == 5
    for row, offset, block in ends:
        first = int(prefill_start[row])
        window = x[:, first + offset - (KERNEL - 1): first + offset]
        assert_same_bits(conv[block], window if dim_first else window.T.contiguous(),
                         f"conv window of row {row} at {offset}")
        prefix = {k: v[first: first + offset] if v.dim() > 1 and v.shape[0] == tokens else v
                  for k, v in inputs.items()}
        want = CPU_SCAN(chunk_size=CHUNK, out=torch.empty(offset, HEADS, HEAD_DIM),
                        cu_seqlens=torch.tensor([0, offset], dtype=torch.int32),
                        initial_states=initial[row: row + 1], dt_softplus=True,
                        state_dtype=state_dtype, **prefix)[0]
        torch.testing.assert_close(ssm[block], want, **SCAN_TOL[state_dtype],
                                   msg=lambda m, r=row, o=offset: f"state of row {r} at {o}: {m}")
    untouched = [b for b in range(NUM_BLOCKS) if b not in written]
    assert torch.equal(conv[untouched], before[0][untouched])
    assert torch.equal(ssm[untouched], before[1][untouched])


@dataclasses.dataclass
class _Metadata:
    """The fields of ``Mamba2AttentionMetadata`` the builder patch reads and replaces."""

    num_prefills: int
    num_decodes: int
    num_decode_tokens: int
    chunk_size: int
    checkpoint_meta: object = None
    checkpoint_chunk_idx: object = None


def _builder(mode: str = "align", spec_blocks: int = 0):
    return types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(cache_config=types.SimpleNamespace(mamba_cache_mode=mode)),
        kv_cache_spec=types.SimpleNamespace(num_speculative_blocks=spec_blocks, block_size=BLOCK),
        _compute_chunk_metadata=COMPUTE_CHUNKS)


def _common(step: Step, table: torch.Tensor | None = None):
    return types.SimpleNamespace(block_table_tensor=step.table if table is None else table,
                                 query_start_loc=step.query_start, query_start_loc_cpu=step.query_start,
                                 seq_lens_cpu_upper_bound=step.seq_lens)


def test_a_step_without_vllms_checkpoint_gets_an_empty_one_carrying_the_plan(monkeypatch):
    step = _step(random.Random(3))
    step.vllm_offsets = [0, 0, 0]
    built = _Metadata(3, 1, 1, CHUNK)
    monkeypatch.setitem(plan_patch._ORIGINALS, "build", lambda *args, **kwargs: built)
    metadata = plan_patch.build(_builder(), 0, _common(step))
    checkpoint = metadata.checkpoint_meta
    # MambaMixer2 then asks the scan for chunk states and calls the store, which stores nothing
    # for vLLM (every offset 0) and the plan's states
    assert metadata.checkpoint_chunk_idx.tolist() == [0, 0, 0]
    assert checkpoint.offsets == [0, 0, 0] and checkpoint.checkpoint_offsets.tolist() == [0, 0, 0]
    plan = getattr(checkpoint, plan_patch.INTERIOR_ATTR)
    assert plan.block_cols.tolist() == [0, 2, 2, 3, 4]  # row 1's column 2 is an interior block now
    # another KV-cache group: its own blocks, the source group's metadata left alone
    monkeypatch.setitem(plan_patch._ORIGINALS, "update_block_table",
                        lambda self, md, table, slots: dataclasses.replace(
                            md, checkpoint_meta=md.checkpoint_meta.regather_state_indices(table)))
    other = plan_patch.update_block_table(_builder(), metadata, step.table + 100, None)
    assert getattr(other.checkpoint_meta, plan_patch.INTERIOR_ATTR).batch.dst_block.tolist() == [
        b + 100 for b in plan.batch.dst_block.tolist()]
    assert getattr(checkpoint, plan_patch.INTERIOR_ATTR) is plan


@pytest.mark.parametrize(("mode", "spec_blocks"), [
    pytest.param("all", 0, id="not-align"),
    pytest.param("align", 2, id="spec-decode"),
])
def test_builds_the_manager_gives_no_interior_blocks_are_left_alone(monkeypatch, mode, spec_blocks):
    step = _step(random.Random(4))
    built = _Metadata(3, 1, 1, CHUNK)
    monkeypatch.setitem(plan_patch._ORIGINALS, "build", lambda *args, **kwargs: built)
    metadata = plan_patch.build(_builder(mode, spec_blocks), 0, _common(step))
    assert metadata is built and built.checkpoint_meta is None


def test_a_build_with_a_device_table_carries_a_device_plan(monkeypatch):
    step = _step(random.Random(4))
    step.vllm_offsets = [0, 0, 0]
    monkeypatch.setitem(plan_patch._ORIGINALS, "build", lambda *args, **kwargs: _Metadata(3, 1, 1, CHUNK))
    metadata = plan_patch.build(_builder(), 0, _common(step, step.table.to("meta")))
    plan = getattr(metadata.checkpoint_meta, plan_patch.INTERIOR_ATTR)
    assert plan.batch.dst_block.device.type == "meta"
    assert plan.batch.dst_block.shape == (6,)  # every candidate (columns 0-2, 2-4): no host read


def test_the_builder_patch_applies_to_the_installed_vllm():
    assert plan_patch.missing() == []
    assert plan_patch.not_needed() is None


def _spec(kind: str, prefill_checkpoint_blocks: int, spec_blocks: int = 0):
    return types.SimpleNamespace(mamba_cache_mode="align", num_speculative_blocks=spec_blocks,
                                 num_prefill_checkpoint_blocks=prefill_checkpoint_blocks,
                                 mamba_type=types.SimpleNamespace(name=kind))


def _worker_report(platform: str, scan: object) -> dict:
    """What a worker on ``platform`` whose SSD scan is ``scan`` reports (every patch applied)."""
    from vllm_hybrid_backends import handshake, patches

    every = {name for needed in handshake.WORKER_FEATURES.values() for name in needed}
    every |= {name for needed in handshake.GDN_FORWARD_PATCHES.values() for name in needed}
    states = {name: patches.APPLIED for name in every}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(handshake, "_platform_name", lambda: platform)
        m.setattr(ssd_combined, "_mamba_chunk_scan_combined_fwd", scan)
        limits = handshake.forward_limits(patch_states=states)
    return {"pid": 1, "patches": states, "forward_limits": limits}


def test_the_engine_plans_interior_blocks_where_the_workers_forward_gives_the_states(monkeypatch):
    """The platform rule comes from the workers' report: Mamba2 inside the chunk on vLLM-CPU
    (patched scan) and on CUDA/ROCm (vLLM's Triton scan), the gated delta net on vLLM-CPU and
    on CUDA/ROCm (FLA wrapped; the layers' prefill kernel is checked with a worker, see
    tests/test_handshake.py), neither on another platform."""
    from vllm_hybrid_backends import handshake
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_kv_cache_coordinator as coordinator

    monkeypatch.setattr(coordinator, "interior_override", None)
    monkeypatch.setattr(coordinator, "_INTERIOR_VERIFIED", True)
    triton_scan = types.FunctionType(CPU_SCAN.__code__, {}, "_mamba_chunk_scan_combined_fwd")
    triton_scan.__module__ = ssd_combined.__name__  # stands for vLLM's Triton scan on a GPU
    foreign = types.FunctionType(CPU_SCAN.__code__, {}, "npu_scan")
    foreign.__module__ = "vllm_ascend.ops.ssd"
    cases = {
        "cpu, patched scan": (_worker_report("cpu", scan_patch._mamba_chunk_scan_combined_fwd),
                              {"MAMBA2", "GDN_ATTN"}),
        "cpu, unpatched scan": (_worker_report("cpu", CPU_SCAN), {"GDN_ATTN"}),
        "cuda, vLLM's Triton scan": (_worker_report("cuda", triton_scan), {"MAMBA2", "GDN_ATTN"}),
        "npu, another scan": (_worker_report("npu", foreign), set()),
    }
    for case, (report, kinds) in cases.items():
        support = handshake.combine([report])
        stored = {kind for kind in ("MAMBA2", "GDN_ATTN", "MAMBA1")
                  if coordinator.stores_interior(_spec(kind, int(kind == "MAMBA2")), support)}
        assert stored == kinds, case
    npu = handshake.combine([cases["npu, another scan"][0]])
    assert npu.reasons["gdn_interior_states"] == (
        "worker pid 1: the gated-delta-net prefill on npu is not vLLM's Triton/FLA kernel the "
        "plugin wraps (on cuda and rocm)")
    assert "vllm_ascend.ops.ssd.npu_scan, not vLLM's" in npu.reasons["mamba2_interior_states"]
    # one worker that cannot is enough to keep the engine from planning them
    mixed = handshake.combine([cases["cpu, patched scan"][0], cases["cpu, unpatched scan"][0]])
    assert not coordinator.stores_interior(_spec("MAMBA2", 1), mixed)


def test_the_kind_rule_of_the_engine(monkeypatch):
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_kv_cache_coordinator as coordinator

    monkeypatch.setattr(coordinator, "interior_override", None)
    monkeypatch.setattr(coordinator.handshake, "current", lambda: coordinator.handshake.WorkerSupport(
        established=True, features=frozenset(coordinator.handshake.WORKER_FEATURES)))
    monkeypatch.setattr(coordinator, "_INTERIOR_VERIFIED", True)
    # MambaMixer2's spec carries vLLM's prefill checkpoint block; the interior blocks go beside it
    assert coordinator.stores_interior(_spec("MAMBA2", 1))
    assert coordinator.stores_interior(_spec("GDN_ATTN", 0))
    assert not coordinator.stores_interior(_spec("MAMBA2", 1, spec_blocks=2))
    assert not coordinator.stores_interior(_spec("MAMBA1", 0))  # no forward stores them
    assert not coordinator.stores_interior(_spec("GDN_ATTN", 1))
    # the replay's fake model stores them for every kind, beside vLLM's checkpoint as a
    # worker does (Mamba2 only)
    monkeypatch.setattr(coordinator, "interior_override", True)
    assert coordinator.stores_interior(_spec("MAMBA2", 1))
    assert coordinator.stores_interior(_spec("MAMBA1", 0))
    assert not coordinator.stores_interior(_spec("GDN_ATTN", 1))
