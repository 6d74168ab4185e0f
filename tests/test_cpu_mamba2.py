"""Mamba2 align mode on vLLM-CPU: the SSD scan's chunk-end states and the checkpoint store.

- The patched CPU scan returns the state after every chunk of vLLM's own chunk table; each one
  equals the CPU scan run over that prefix alone, and the outputs and final states are those of
  one call over the whole batch (to float rounding: the CPU kernel works in 4-token steps).
- The patched ``store_prefill_checkpoint`` writes what vLLM's ``_store_prefill_checkpoint_kernel``
  writes (its semantics written out below): both conv layouts, conv caches widened for
  speculative decoding, rows without a checkpoint, bf16/fp32; and it goes through the selected
  backend's ``hb_store_checkpoints``.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_hybrid_backends import compat, hookimpl
from vllm_hybrid_backends.patches import (
    patch_vllm_model_executor_layers_mamba_mamba_mixer2 as store_patch,
)
from vllm_hybrid_backends.patches import (
    patch_vllm_model_executor_layers_mamba_ops_ssd_combined as scan_patch,
)
from vllm_hybrid_backends.testing.bits import assert_same_bits
from vllm_hybrid_backends.types import Availability, BackendIdentity, DeviceKind

ssd_combined = pytest.importorskip("vllm.model_executor.layers.mamba.ops.ssd_combined")
cpu_ssm = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm")
mamba_mixer2 = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_mixer2")
layer_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
mamba_attn = pytest.importorskip("vllm.v1.attention.backends.mamba_attn")
checkpoint_md = pytest.importorskip("vllm.model_executor.layers.mamba.checkpoint")

CPU_SCAN = cpu_ssm._mamba_chunk_scan_combined_fwd_cpu
#: vLLM's chunk table also ends chunks at prefill checkpoint offsets (0.32+: Mamba2's prefill
#: checkpoint); before that the scan's chunk states serve ``mamba_cache_mode="all"`` only.
CHUNK_TABLE_HAS_CHECKPOINTS = compat.has_mamba2_prefill_checkpoint()
HEADS, HEAD_DIM, GROUPS, D_STATE = 4, 6, 2, 5
CHUNK = 16


def _seed(request) -> int:
    return sum(map(ord, request.node.name))




# ---- the scan ----------------------------------------------------------------------------------




def _scan_inputs(gen: torch.Generator, tokens: int):
    return dict(
        x=torch.randn(tokens, HEADS, HEAD_DIM, generator=gen),
        dt=torch.randn(tokens, HEADS, generator=gen),
        A=-torch.rand(HEADS, generator=gen),
        B=torch.randn(tokens, GROUPS, D_STATE, generator=gen),
        C=torch.randn(tokens, GROUPS, D_STATE, generator=gen),
        D=torch.randn(HEADS, generator=gen),
        dt_bias=torch.randn(HEADS, generator=gen),
    )


def _run_scan(inputs, lengths, computed, checkpoints, initial, state_dtype):
    """The patched scan through vLLM's entry point, with vLLM's own chunk table for this batch:
    chunks end at absolute multiples of CHUNK, at sequence ends and at forced checkpoint ends."""
    query_start = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    compute = mamba_attn.BaseMambaAttentionMetadataBuilder._compute_chunk_metadata
    if CHUNK_TABLE_HAS_CHECKPOINTS:
        cu_chunks, seq_idx, last_chunks, checkpoint_chunks = compute(
            CHUNK, len(lengths), torch.tensor(computed), query_start, checkpoints)
    else:  # before 0.32 an instance method (self unused), without checkpoint offsets
        assert not any(checkpoints)
        cu_chunks, seq_idx, last_chunks = compute(None, CHUNK, len(lengths), torch.tensor(computed),
                                                  query_start)
        checkpoint_chunks = [-1] * len(lengths)
    out = torch.full((sum(lengths), HEADS, HEAD_DIM), float("nan"))
    states = ssd_combined.mamba_chunk_scan_combined_varlen(
        chunk_size=CHUNK, cu_seqlens=query_start, cu_chunk_seqlens=torch.tensor(cu_chunks, dtype=torch.int32),
        last_chunk_indices=torch.tensor(last_chunks), seq_idx=torch.tensor(seq_idx, dtype=torch.int32),
        out=out, initial_states=initial, dt_softplus=True, return_intermediate_states=True,
        state_dtype=state_dtype, **inputs)
    assert states.shape == (len(cu_chunks) - 1, HEADS, HEAD_DIM, D_STATE) and states.dtype == state_dtype
    assert all(c >= 0 for c, offset in zip(checkpoint_chunks, checkpoints) if offset)
    return query_start, cu_chunks, seq_idx, last_chunks, out, states


def _prefix_state(inputs, start, end, initial, owner, state_dtype):
    """vLLM's CPU scan over one sequence's tokens [start, end) alone: its final state."""
    tokens = next(iter(inputs.values())).shape[0]
    prefix = {k: (v[start:end] if v.dim() > 1 and v.shape[0] == tokens else v) for k, v in inputs.items()}
    state = CPU_SCAN(chunk_size=CHUNK, out=torch.empty(end - start, HEADS, HEAD_DIM),
                     cu_seqlens=torch.tensor([0, end - start], dtype=torch.int32),
                     initial_states=None if initial is None else initial[owner : owner + 1],
                     dt_softplus=True, state_dtype=state_dtype, **prefix)
    return state[0]


# vLLM-CPU's scan works in 4-token vector steps: cutting a sequence into chunks reorders a few
# float additions, so the chunked scan matches one call to rounding, not bit for bit
SCAN_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


_NEEDS_CHECKPOINTS = pytest.mark.skipif(not CHUNK_TABLE_HAS_CHECKPOINTS,
                                        reason="this vLLM's chunk table has no prefill checkpoint "
                                               "offsets (Mamba2 prefill checkpoint: 0.32+)")


@pytest.mark.parametrize("state_dtype", [pytest.param(torch.float32, id="fp32-states"),
                                         pytest.param(torch.bfloat16, id="bf16-states")])
@pytest.mark.parametrize("with_initial", [pytest.param(True, id="initial-states"),
                                          pytest.param(False, id="fresh")])
@pytest.mark.parametrize(("computed", "checkpoints"), [
    pytest.param([16, 0, 32], [32, 0, 16], id="block-aligned", marks=_NEEDS_CHECKPOINTS),  # align mode
    pytest.param([5, 0, 3], [35, 0, 19], id="unaligned", marks=_NEEDS_CHECKPOINTS),
    pytest.param([16, 0, 32], [0, 0, 0], id="no-checkpoints"),  # mamba_cache_mode="all"
])
def test_scan_returns_the_state_after_every_chunk(mamba2_scan_patched, request, state_dtype, with_initial,
                                                  computed, checkpoints):
    gen = torch.Generator().manual_seed(_seed(request))
    lengths = [53, 7, 40]
    inputs = _scan_inputs(gen, sum(lengths))
    initial = torch.randn(len(lengths), HEADS, HEAD_DIM, D_STATE, generator=gen) if with_initial else None
    query_start, cu_chunks, seq_idx, last_chunks, out, states = _run_scan(
        inputs, lengths, computed, checkpoints, initial, state_dtype)
    assert len(cu_chunks) - 1 > len(lengths) + 1  # several chunks per sequence, checkpoint ends included

    # one call of vLLM's CPU scan over the batch: the same outputs and final states
    want_out = torch.full_like(out, float("nan"))
    want_final = CPU_SCAN(chunk_size=CHUNK, out=want_out, cu_seqlens=query_start, initial_states=initial,
                          dt_softplus=True, state_dtype=state_dtype, **inputs)
    torch.testing.assert_close(out, want_out, **SCAN_TOL[torch.float32])
    torch.testing.assert_close(states[torch.tensor(last_chunks)], want_final, **SCAN_TOL[state_dtype])
    # every chunk state: the CPU scan run over that sequence's prefix alone
    for chunk, owner in enumerate(seq_idx):
        want = _prefix_state(inputs, int(query_start[owner]), cu_chunks[chunk + 1], initial, owner, state_dtype)
        torch.testing.assert_close(states[chunk], want, **SCAN_TOL[state_dtype],
                                   msg=lambda m, c=chunk, o=owner: f"chunk {c} of sequence {o}: {m}")


def test_scan_without_the_flag_is_vllms(mamba2_scan_patched, request):
    gen = torch.Generator().manual_seed(_seed(request))
    inputs = _scan_inputs(gen, 30)
    cu = torch.tensor([0, 30], dtype=torch.int32)
    got = ssd_combined._mamba_chunk_scan_combined_fwd(chunk_size=CHUNK, out=torch.empty(30, HEADS, HEAD_DIM),
                                                      cu_seqlens=cu, **inputs)
    want = CPU_SCAN(chunk_size=CHUNK, out=torch.empty(30, HEADS, HEAD_DIM), cu_seqlens=cu, **inputs)
    assert_same_bits(got, want, "final state")


def test_scan_patch_leaves_a_non_cpu_scan_alone(monkeypatch):
    def triton_scan(*args, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setattr(ssd_combined, "_mamba_chunk_scan_combined_fwd", triton_scan)
    monkeypatch.setattr(scan_patch, "_ORIGINALS", {})
    scan_patch.apply()
    assert ssd_combined._mamba_chunk_scan_combined_fwd is triton_scan
    assert scan_patch.missing() == []


# ---- the checkpoint store ----------------------------------------------------------------------


def vllm_store_kernel_semantics(checkpoint, chunk_idx, x, conv_state, chunk_states, ssm_state,
                                query_start_loc, *, state_len):
    """``_store_prefill_checkpoint_kernel`` written out: per row with offset > 0, conv positions
    ``h < state_len`` of block ``dst`` get input ``query_start + offset - state_len + h``; the SSM
    block gets chunk state ``chunk_idx[row]``. (The Triton interpreter cannot run the kernel
    itself: it rejects the kernel's scalar-and-vector mask.)"""
    for row, offset in enumerate(checkpoint.checkpoint_offsets.tolist()):
        if offset <= 0:
            continue
        dst = int(checkpoint.state_indices[row])
        end = int(query_start_loc[row]) + offset
        conv_state[dst, :, :state_len] = x[:, end - state_len : end]
        ssm_state[dst] = chunk_states[int(chunk_idx[row])]




KERNEL = 4  # conv kernel: state_len 3
DIM = 7
NUM_BLOCKS = 24


def _store_case(gen: torch.Generator, rng: random.Random, dim_first: bool, num_spec: int, dtype: torch.dtype):
    """A 3-row prefill (row 1 without a checkpoint) and the caches vLLM would pass."""
    width = KERNEL - 1 + num_spec
    lengths, offsets = [40, 9, 33], [32, 0, 16]
    query_start = torch.tensor([0, 40, 49, 82], dtype=torch.int32)
    x = torch.randn(DIM, sum(lengths), generator=gen).to(dtype)  # pre-conv input, (dim, tokens)
    conv_cache = torch.randn(NUM_BLOCKS, *((DIM, width) if dim_first else (width, DIM)), generator=gen).to(dtype)
    ssm_cache = torch.randn(NUM_BLOCKS, HEADS, HEAD_DIM, D_STATE, generator=gen).to(dtype)
    conv_cache[0] = float("nan")
    ssm_cache[0] = float("nan")
    chunk_states = torch.randn(9, HEADS, HEAD_DIM, D_STATE, generator=gen).to(dtype)
    dst = rng.sample(range(1, NUM_BLOCKS), 3)
    checkpoint = checkpoint_md.MambaPrefillCheckpointMetadata(
        checkpoint_offsets=torch.tensor(offsets, dtype=torch.int32),
        state_indices=torch.tensor([dst[0], 0, dst[2]], dtype=torch.int32),  # no checkpoint: null block
        offsets=offsets)
    chunk_idx = torch.tensor([2, -1, 7], dtype=torch.int64)
    return checkpoint, chunk_idx, x, conv_cache, chunk_states, ssm_cache, query_start


def _conv_view(conv_cache: torch.Tensor, dim_first: bool) -> torch.Tensor:
    """What MambaMixer2 passes: (blocks, dim, width), a transpose for the SD layout."""
    return conv_cache if dim_first else conv_cache.transpose(-1, -2)


@pytest.mark.parametrize("dim_first", [pytest.param(False, id="conv-SD"), pytest.param(True, id="conv-DS")])
@pytest.mark.parametrize("num_spec", [pytest.param(0, id="no-spec"), pytest.param(2, id="spec-widened")])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_store_equals_vllms_kernel(mamba2_store_patched, monkeypatch, request, dim_first, num_spec, dtype):
    seed = _seed(request)
    monkeypatch.setattr(layer_utils, "is_conv_state_dim_first", lambda: dim_first)
    ours = _store_case(torch.Generator().manual_seed(seed), random.Random(seed), dim_first, num_spec, dtype)
    theirs = _store_case(torch.Generator().manual_seed(seed), random.Random(seed), dim_first, num_spec, dtype)

    checkpoint, chunk_idx, x, conv_cache, chunk_states, ssm_cache, query_start = ours
    mamba_mixer2.store_prefill_checkpoint(checkpoint, chunk_idx, x, _conv_view(conv_cache, dim_first),
                                          chunk_states, ssm_cache, query_start, state_len=KERNEL - 1)

    checkpoint, chunk_idx, x, conv_cache_v, chunk_states, ssm_cache_v, query_start = theirs
    vllm_store_kernel_semantics(checkpoint, chunk_idx, x, _conv_view(conv_cache_v, dim_first), chunk_states,
                                ssm_cache_v, query_start, state_len=KERNEL - 1)
    assert_same_bits(conv_cache, conv_cache_v, "conv cache")
    assert_same_bits(ssm_cache, ssm_cache_v, "ssm cache")
    fresh = _store_case(torch.Generator().manual_seed(seed), random.Random(seed), dim_first, num_spec, dtype)
    stored = checkpoint.state_indices[0]
    assert not torch.equal(conv_cache[stored], fresh[3][stored]), "nothing was stored"
    assert not torch.equal(ssm_cache[stored], fresh[5][stored]), "nothing was stored"

class Spy:
    def __init__(self):
        self.calls = []

    @hookimpl
    def hb_backend_identity(self):
        return BackendIdentity("spy", DeviceKind.CPU, priority=-1)

    @hookimpl
    def hb_backend_probe(self):
        return Availability(True, "test spy")

    @hookimpl
    def hb_store_checkpoints(self, states, sources, checkpoints):
        self.calls.append(([(s.kind.value, tuple(s.tensor.shape)) for s in states],
                           [tuple(s.shape) for s in sources],
                           {k: getattr(checkpoints, k).tolist() for k in
                            ("token_end", "seq_start", "initial_block", "dst_block", "temporal_row")}))


def test_store_goes_through_the_selected_backend(mamba2_store_patched, fresh_plugins, monkeypatch):
    spy = Spy()
    fresh_plugins.register_backend(spy)
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", "spy")
    monkeypatch.setattr(layer_utils, "is_conv_state_dim_first", lambda: False)
    try:
        checkpoint, chunk_idx, x, conv_cache, chunk_states, ssm_cache, query_start = _store_case(
            torch.Generator().manual_seed(1), random.Random(1), False, 2, torch.float32)
        mamba_mixer2.store_prefill_checkpoint(checkpoint, chunk_idx, x, _conv_view(conv_cache, False), chunk_states,
                                              ssm_cache, query_start, state_len=KERNEL - 1)
    finally:
        fresh_plugins.unregister_backend("spy")
    (states, sources, batch), = spy.calls
    # the SD cache in its own layout, narrowed to the kernel's 3 history positions
    assert states == [("conv_sd", (NUM_BLOCKS, KERNEL - 1, DIM)), ("temporal", (NUM_BLOCKS, HEADS, HEAD_DIM, D_STATE))]
    assert sources == [(82, DIM), (9, HEADS, HEAD_DIM, D_STATE)]
    dst = checkpoint.state_indices.tolist()
    assert batch == {"token_end": [32, 49 + 16], "seq_start": [0, 49], "initial_block": [-1, -1],
                     "dst_block": [dst[0], dst[2]], "temporal_row": [2, 7]}


def test_store_rejects_a_window_reaching_before_the_query(mamba2_store_patched, monkeypatch):
    monkeypatch.setattr(layer_utils, "is_conv_state_dim_first", lambda: False)
    checkpoint, chunk_idx, x, conv_cache, chunk_states, ssm_cache, query_start = _store_case(
        torch.Generator().manual_seed(2), random.Random(2), False, 0, torch.float32)
    checkpoint.offsets[2] = 2
    checkpoint.checkpoint_offsets[2] = 2
    with pytest.raises(ValueError, match=r"\(2, 2\).*conv window \(3 tokens\)"):
        mamba_mixer2.store_prefill_checkpoint(checkpoint, chunk_idx, x, _conv_view(conv_cache, False), chunk_states,
                                              ssm_cache, query_start, state_len=KERNEL - 1)


def test_every_mamba2_patch_applies_to_the_installed_vllm():
    assert scan_patch.missing() == []
    # the checkpoint store exactly where this vLLM has Mamba2's prefill checkpoint (0.32+)
    assert (store_patch.not_needed() is None) == compat.has_mamba2_prefill_checkpoint()
    if store_patch.not_needed() is None:
        assert store_patch.missing() == []
