"""``gpu_check --interior``: the interior Mamba states of the device path, on the GPU, with vLLM's
own kernels.

For each row of the table (gated delta net fp32 and bf16, Mamba2 fp32 and bf16 states) one
varlen step as the engine plans it: a decode row, then prefill rows with block boundaries
inside their chunk, one of them left without a block (the null block, ``-1`` in the plan):

- gated delta net (Qwen3.5, Qwen3-Next): vLLM's FLA ``chunk_gated_delta_rule_fwd`` with the
  plugin's wrap (``patch_vllm_third_party_flash_linear_attention_ops_chunk``) capturing its
  per-chunk states, the GDN metadata patch's device plan (``plan_device_states``, block table on
  the device), the GDN layer patch's store (``store_interior_states``) through the Triton
  backend's ``hb_store_checkpoints``. Each stored state must equal, bit for bit, the final
  state of the same kernel run over that prefix alone, cast to the cache dtype, and be close to
  the token-by-token recurrence (``testing/gdn_reference.py``);
- Mamba2 (Nemotron-H, Granite-4.0-H): vLLM's Triton SSD scan
  ``mamba_chunk_scan_combined_varlen(..., return_intermediate_states=True)`` over vLLM's chunk
  table (its ``_compute_chunk_metadata``, with vLLM's own prefill checkpoint in one row), the
  Mamba2 metadata patch's plan (``plan_interior_states``), the Mamba2 store patch
  (``store_prefill_checkpoint``). Each stored state must be close to the same scan over that
  prefix alone (whether it is bit-exact is reported).

Both conv layouts are stored; every conv window must be the prefix's last inputs, exactly;
destinations are NaN-poisoned before, every other block must keep its bits and the null-block
candidate must write nothing (the caches handed to the stores are views with a guard block on
either side, so a write to block ``-1`` or one past the end is caught too). A non-finite error is
a failure. Tolerances (relative RMS error ``|got - want|_2 / |want|_2``, the
measure FLA's own tests use):

- gated delta net vs the fp32 recurrence: fp32 1e-3 (Triton runs fp32 ``tl.dot`` as TF32 on
  NVIDIA GPUs, ~2^-11 per product); bf16 5e-3, a judgement, not derived (measured 3.3e-3 on an
  H100: ``h`` is kept and fed to the next chunk's dots in the input dtype, so one bf16
  rounding, 2^-9, per chunk and per dot operand adds up). A state one FLA chunk (64 tokens)
  off is O(1) away, so either bound tells the right boundary;
- Mamba2 vs the same scan over the prefix: fp32 1e-5 (the same kernels on the same chunks: only
  summation order may differ); bf16 4e-3 (2^-8: one rounding of the state to bf16).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import random
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .vllm_source import (
    CHUNK_METADATA,
    FLA,
    SSD,
    VllmSourceError,
    install,
    interpreter_workarounds,
    vllm_function,
)

NUM_BLOCKS = 40
CONV_WIDTH = 4  # conv kernel: windows of 3 tokens
#: Relative RMS error bound per (kind, dtype), see the module docstring.
TOLERANCE = {("gdn", torch.float32): 1e-3, ("gdn", torch.bfloat16): 5e-3,
             ("mamba2", torch.float32): 1e-5, ("mamba2", torch.bfloat16): 4e-3}
LAYOUT_MODULE = "vllm.model_executor.layers.mamba.mamba_utils"


@dataclasses.dataclass
class Kernels:
    """vLLM's modules the checks run (loaded by :func:`load_kernels`)."""

    fla_chunk: Any
    ssd_combined: Any
    compute_chunk_metadata: Callable[..., Any]
    layout: Any  # vLLM's mamba_utils (or its stand-in): is_conv_state_dim_first
    source: str  # where they came from


def load_kernels(vllm_source: str | None, interpret: bool = False) -> Kernels:
    """vLLM's FLA chunk module, SSD scan and chunk table, from the installed vLLM or from the
    tree ``vllm_source`` (:mod:`vllm_hybrid_backends.vllm_source`); :class:`VllmSourceError`
    (one line) when they cannot be loaded."""
    if vllm_source is not None:
        install(vllm_source, interpret)
    where = vllm_source or "the installed vLLM"
    try:
        fla_chunk = importlib.import_module(FLA + ".chunk")
        ssd = importlib.import_module(SSD + ".ssd_combined")
        layout = importlib.import_module(LAYOUT_MODULE)
        if vllm_source is not None:
            math_utils = importlib.import_module("vllm.utils.math_utils")
            chunks = vllm_function(*CHUNK_METADATA, {"torch": torch, "cdiv": math_utils.cdiv})
        else:
            module, qualname = CHUNK_METADATA
            owner, name = qualname.split(".")
            chunks = getattr(getattr(importlib.import_module(module), owner), name)
    except VllmSourceError:
        raise
    except Exception as exc:
        hint = "" if vllm_source else "; install vLLM 0.32+ or pass --vllm-source DIR"
        raise VllmSourceError(f"vLLM's kernels could not be loaded from {where}: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0]}{hint}") from exc
    if ssd._mamba_chunk_scan_combined_fwd.__module__ != ssd.__name__:
        raise VllmSourceError(f"{where}: ssd_combined binds {ssd._mamba_chunk_scan_combined_fwd.__module__}"
                              "'s scan, not its Triton one (a CPU build of vLLM?)")
    if interpret:
        interpreter_workarounds()
    return Kernels(fla_chunk, ssd, chunks, layout, where)


def _err_ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and bool(torch.equal(a.contiguous().view(words), b.contiguous().view(words)))


@dataclasses.dataclass
class Result:
    """One row of the table."""

    check: str
    states: int = 0
    max_abs_err: float = 0.0
    err_ratio: float = 0.0
    tolerance: float = 0.0
    bit_exact_vs_prefix: bool | None = None  # None: nothing compared
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}


@contextmanager
def _conv_layout(kernels: Kernels, dim_first: bool) -> Iterator[None]:
    previous = kernels.layout.is_conv_state_dim_first
    kernels.layout.is_conv_state_dim_first = lambda: dim_first
    try:
        yield
    finally:
        kernels.layout.is_conv_state_dim_first = previous


def _stored(result: Result, store: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """Run ``store(*args, **kwargs)``; a store that launched no Triton checkpoint kernel is a
    problem."""
    from .backends.triton import kernels

    before = kernels.launch_counts.get("checkpoint", 0)
    store(*args, **kwargs)
    if kernels.launch_counts.get("checkpoint", 0) <= before:
        result.problems.append("the Triton checkpoint kernel did not run")


def _caches(gen: torch.Generator, dim_first: bool, dim: int, state: tuple[int, ...],
            dtype: torch.dtype, device: str, written: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv and SSM buffers: ``NUM_BLOCKS + 2`` random blocks, the planned destinations
    NaN-poisoned. ``buffer[1:-1]`` is the cache handed to the store; blocks 0 and -1 of the
    buffer are guards, where a write to block ``-1`` or ``NUM_BLOCKS`` of the cache lands."""
    conv_shape = (dim, CONV_WIDTH - 1) if dim_first else (CONV_WIDTH - 1, dim)
    conv = torch.randn(NUM_BLOCKS + 2, *conv_shape, generator=gen).to(dtype).to(device)
    ssm = torch.randn(NUM_BLOCKS + 2, *state, generator=gen).to(dtype).to(device)
    for buffer in (conv, ssm):
        buffer[1:-1][written] = float("nan")
    return conv, ssm


def _check_untouched(result: Result, buffers: tuple[torch.Tensor, torch.Tensor],
                     before: tuple[torch.Tensor, torch.Tensor], written: list[int], what: str) -> None:
    """Every block of the buffers (:func:`_caches`) but the planned ones keeps its bits, the
    two guard blocks included; every planned one was stored."""
    untouched = [b + 1 for b in range(NUM_BLOCKS) if b not in written]
    for now, then, name in zip(buffers, before, ("conv", "ssm")):
        for guard, where in ((0, "before"), (NUM_BLOCKS + 1, "after")):
            if not _same_bits(now[guard], then[guard]):
                result.problems.append(f"{what}: the guard block {where} the {name} cache changed "
                                       "(a write to a block outside the cache, e.g. -1)")
        if not _same_bits(now[untouched], then[untouched]):
            result.problems.append(f"{what}: a {name} block outside the plan changed "
                                   "(the null-block candidate or a stray write)")
        if now[1:-1][written].isnan().any():
            result.problems.append(f"{what}: a planned {name} block was not stored")


def _compare(result: Result, got: torch.Tensor, want: torch.Tensor) -> None:
    """Keep the largest errors; a non-finite one (NaN in a stored state) sticks, so that the
    bound check (``not err <= bound``) fails it."""
    def worse(kept: float, new: float) -> float:
        return kept if math.isnan(kept) or new <= kept else new  # a NaN ``new`` is kept

    result.max_abs_err = worse(result.max_abs_err, float((got.float().cpu() - want.float().cpu()).abs().max()))
    result.err_ratio = worse(result.err_ratio, _err_ratio(got, want))


def _check_bound(result: Result, against: str) -> None:
    if not result.err_ratio <= result.tolerance:  # NaN included
        result.problems.append(f"error vs {against} {result.err_ratio:.2e} > {result.tolerance:.0e}"
                               if math.isfinite(result.err_ratio) else
                               f"error vs {against} is not finite ({result.err_ratio})")


# ---- gated delta net -----------------------------------------------------------------------------

GDN_BLOCK = 128


def gdn_step(pick: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The gated-delta-net step of :func:`check_gdn` (and of the interpreted tests): query
    starts, sequence lengths, a block table with blocks for 128 and 256 of row 2 and 256 of row
    3 (384 of row 3 left at the null block), and those three blocks, drawn by ``pick``."""
    query_start = torch.tensor([0, 1, 101, 401, 681])
    seq_lens = torch.tensor([500, 100, 300, 408])
    table = torch.zeros(4, 5, dtype=torch.int32)
    blocks = pick.sample(range(1, NUM_BLOCKS), 3)
    table[2, [0, 1]] = torch.tensor(blocks[:2], dtype=torch.int32)
    table[3, 1] = blocks[2]
    return query_start, seq_lens, table, blocks


def check_gdn(kernels: Kernels, dtype: torch.dtype, device: str, heads: int, dim: int,
              seed: int = 0) -> Result:
    """A decode, then prefill rows [0, 100) fresh, [0, 300) fresh with boundaries 128 and 256
    inside, [128, 408) from a state with 256 (a block) and 384 (the null block) inside."""
    from .patches import (
        patch_vllm_model_executor_layers_mamba_gdn_qwen_gdn_linear_attn as layer_patch,
    )
    from .patches import patch_vllm_third_party_flash_linear_attention_ops_chunk as wrap
    from .patches import patch_vllm_v1_attention_backends_gdn_attn as gdn_plan
    from .testing.gdn_reference import gated_delta_rule_state

    result = Result(f"gdn {_name(dtype)}", tolerance=TOLERANCE[("gdn", dtype)])
    query_start, seq_lens, table, blocks = gdn_step(random.Random(seed))
    plan = gdn_plan.plan_device_states(table.to(device), query_start, seq_lens, 1, 3, GDN_BLOCK)
    want_dst = [blocks[0], blocks[1], blocks[2], -1]
    if plan is None or plan.batch.dst_block.tolist() != want_dst:
        result.problems.append(f"plan: destinations {None if plan is None else plan.batch.dst_block.tolist()}, "
                               f"expected {want_dst}")
        return result

    gen = torch.Generator().manual_seed(seed)
    tokens = 680  # the prefill rows; the decode token is not FLA's
    k = torch.nn.functional.normalize(torch.randn(1, tokens, heads, dim, generator=gen), dim=-1)
    inputs = {"q": torch.randn(1, tokens, heads, dim, generator=gen).to(dtype), "k": k.to(dtype),
              "v": torch.randn(1, tokens, heads, dim, generator=gen).to(dtype),
              "g": torch.nn.functional.logsigmoid(torch.randn(1, tokens, heads, generator=gen)) * 0.2,
              "beta": torch.rand(1, tokens, heads, generator=gen).to(dtype)}
    initial = (torch.randn(3, heads, dim, dim, generator=gen) * 0.1).to(dtype)
    initial[:2] = 0  # prefill rows 0 and 1 are fresh
    prefill_start = [0, 100, 400]
    stored = [(1, 128), (1, 256), (2, 128)]  # (prefill row, offset) with a block
    pieces = {name: torch.cat([v[:, prefill_start[p]: prefill_start[p] + o] for p, o in stored], 1)
              for name, v in inputs.items()}
    ends = [0, *torch.tensor([o for _, o in stored]).cumsum(0).tolist()]
    on = {name: v.to(device) for name, v in inputs.items()}
    with wrap.capturing_chunk_states() as captured:
        kernels.fla_chunk.chunk_gated_delta_rule_fwd(
            **on, scale=dim ** -0.5, initial_state=initial.to(device), output_final_state=True,
            cu_seqlens=torch.tensor([0, 100, 400, 680], dtype=torch.int32, device=device))
    prefix_final = kernels.fla_chunk.chunk_gated_delta_rule_fwd(
        **{name: v.to(device) for name, v in pieces.items()}, scale=dim ** -0.5,
        initial_state=initial[[p for p, _ in stored]].to(device), output_final_state=True,
        cu_seqlens=torch.tensor(ends, dtype=torch.int32, device=device))[3]
    if len(captured) != 1 or tuple(captured[0].shape) != (1, 2 + 5 + 5, heads, dim, dim):
        result.problems.append(f"the wrap captured {[tuple(h.shape) for h in captured]}, expected one "
                               f"h of {(1, 12, heads, dim, dim)}")
        return result
    h = captured[0]

    conv_dim = 8
    mixed_qkv = torch.randn(681, conv_dim, generator=gen).to(dtype).to(device)  # decode first
    written = want_dst[:3]
    for dim_first in (False, True):
        what = f"conv {'DS' if dim_first else 'SD'}"
        buffers = _caches(gen, dim_first, conv_dim, (heads, dim, dim), dtype, device, written)
        before = (buffers[0].clone(), buffers[1].clone())
        conv, ssm = buffers[0][1:-1], buffers[1][1:-1]
        layer = types.SimpleNamespace(kv_cache=(conv, ssm), prefix="model.layers.0.linear_attn")
        with _conv_layout(kernels, dim_first):
            _stored(result, layer_patch.store_interior_states, layer, plan, mixed_qkv, h)
        for i, ((p, offset), block) in enumerate(zip(stored, written)):
            first = prefill_start[p]
            same = _same_bits(ssm[block], prefix_final[i].to(dtype))
            result.bit_exact_vs_prefix = result.bit_exact_vs_prefix is not False and same
            if not same:
                result.problems.append(f"{what}: state of prefill row {p} at {offset} differs from "
                                       "the kernel over that prefix alone")
            prefix = {n: inputs[n][0, first: first + offset].float() for n in ("k", "v", "g", "beta")}
            want = gated_delta_rule_state(prefix["k"], prefix["v"], prefix["g"], prefix["beta"],
                                          initial_state=initial[p].float())
            _compare(result, ssm[block], want)
            window = mixed_qkv[1 + first + offset - (CONV_WIDTH - 1): 1 + first + offset]
            if not _same_bits(conv[block], window.T if dim_first else window):
                result.problems.append(f"{what}: conv window of prefill row {p} at {offset} differs")
        _check_untouched(result, buffers, before, written, what)
        result.states += len(written)
    _check_bound(result, "the recurrence")
    return result


# ---- Mamba2 ------------------------------------------------------------------------------------

def check_mamba2(kernels: Kernels, dtype: torch.dtype, device: str, scale: int, heads: int,
                 head_dim: int, d_state: int, seed: int = 0) -> Result:
    """tests/backends/test_triton_interior.py's Mamba2 step, ``scale`` times longer (SSD chunk
    16 * scale, block 32 * scale): a decode, then [0, 110) with vLLM's checkpoint at 96 and
    column 1 null, and [64, 164)."""
    from .patches import patch_vllm_model_executor_layers_mamba_mamba_mixer2 as mamba2_store
    from .patches import patch_vllm_v1_attention_backends_mamba2_attn as mamba2_plan

    result = Result(f"mamba2 {_name(dtype)}", tolerance=TOLERANCE[("mamba2", dtype)])
    chunk, block, s = 16 * scale, 32 * scale, scale
    query_start = torch.tensor([0, 1, 1 + 110 * s, 1 + 210 * s])
    seq_lens = torch.tensor([300 * s, 110 * s, 164 * s])
    computed = [0, 64 * s]
    pick = random.Random(seed)
    blocks = pick.sample(range(1, NUM_BLOCKS), 7)
    table = torch.zeros(3, 8, dtype=torch.int32)
    table[1, [0, 2, 3]] = torch.tensor(blocks[:3], dtype=torch.int32)
    table[2, [2, 3, 4, 5]] = torch.tensor(blocks[3:], dtype=torch.int32)
    vllm_offsets = [96 * s, 0]
    prefill_start = query_start[1:] - 1
    plan = mamba2_plan.plan_interior_states(table.to(device), query_start, seq_lens, 1, 2, 1, block,
                                            chunk, vllm_offsets, kernels.compute_chunk_metadata,
                                            prune_on_host=False)
    # (prefill row, offset in its new tokens, destination): block boundaries 32 and 64 (column
    # 1, the null block) of row 0; 96, 128, 160 of row 1, which starts at 64. vLLM's own
    # checkpoint (row 0 at 96) is not the plan's.
    planned = [(0, 32 * s, blocks[0]), (0, 64 * s, -1),
               (1, 32 * s, blocks[3]), (1, 64 * s, blocks[4]), (1, 96 * s, blocks[5])]
    want_dst = [b for _, _, b in planned]
    if plan is None or plan.batch.dst_block.tolist() != want_dst:
        result.problems.append(f"plan: destinations {None if plan is None else plan.batch.dst_block.tolist()}, "
                               f"expected {want_dst}")
        return result
    want_rows = [1 + r for r, _, _ in planned]  # the decode row first
    want_ends = [int(prefill_start[r]) + o for r, o, _ in planned]
    if plan.request_rows.tolist() != want_rows or plan.batch.token_end.tolist() != want_ends:
        result.problems.append(f"plan: rows {plan.request_rows.tolist()} ending at tokens "
                               f"{plan.batch.token_end.tolist()}, expected {want_rows} ending at {want_ends}")
        return result

    gen = torch.Generator().manual_seed(seed)
    tokens = 210 * s
    inputs = {"x": torch.randn(tokens, heads, head_dim, generator=gen).to(dtype),
              "dt": torch.randn(tokens, heads, generator=gen).to(dtype),
              "A": -torch.rand(heads, generator=gen), "B": torch.randn(tokens, 1, d_state, generator=gen).to(dtype),
              "C": torch.randn(tokens, 1, d_state, generator=gen).to(dtype), "D": torch.randn(heads, generator=gen),
              "dt_bias": torch.randn(heads, generator=gen)}
    initial = torch.randn(2, heads, head_dim, d_state, generator=gen).to(dtype)
    initial[0] = 0  # prefill row 0 is fresh

    def scan(given: dict[str, torch.Tensor], starts: list[int], done: list[int], init: torch.Tensor,
             offsets: list[int] | None) -> tuple[torch.Tensor, list[int], list[int]]:
        bounds, owners, last, ckpt = kernels.compute_chunk_metadata(
            chunk, len(done), torch.tensor(done), torch.tensor(starts), offsets)
        states = kernels.ssd_combined.mamba_chunk_scan_combined_varlen(
            **{name: v.to(device) for name, v in given.items()}, chunk_size=chunk,
            cu_seqlens=torch.tensor(starts, dtype=torch.int32, device=device),
            cu_chunk_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),
            last_chunk_indices=torch.tensor(last, device=device),
            seq_idx=torch.tensor(owners, dtype=torch.int32, device=device),
            out=torch.empty(starts[-1], heads, head_dim, dtype=dtype, device=device),
            initial_states=init.to(device), dt_softplus=True, return_intermediate_states=True,
            state_dtype=dtype)
        return states, last, ckpt

    chunk_states, _, vllm_chunks = scan(inputs, prefill_start.tolist(), computed, initial, vllm_offsets)
    ends = [(0, 96 * s, blocks[1])] + [(r, o, b) for r, o, b in planned if b >= 0]  # vLLM's checkpoint first
    per_token = {name for name, v in inputs.items() if v.dim() > 1}
    pieces = {name: torch.cat([v[int(prefill_start[r]): int(prefill_start[r]) + o] for r, o, _ in ends])
              if name in per_token else v for name, v in inputs.items()}
    piece_starts = [0, *torch.tensor([o for _, o, _ in ends]).cumsum(0).tolist()]
    prefix_states, prefix_last, _ = scan(pieces, piece_starts, [computed[r] for r, _, _ in ends],
                                         initial[[r for r, _, _ in ends]], None)

    x = torch.randn(heads * 2, tokens, generator=gen).to(dtype).to(device)  # pre-conv input (dim, tokens)
    written = [blocks[1], *(b for b in want_dst if b >= 0)]
    checkpoint = types.SimpleNamespace(  # the fields of vLLM's MambaPrefillCheckpointMetadata it reads
        offsets=vllm_offsets, checkpoint_offsets=torch.tensor(vllm_offsets, dtype=torch.int32, device=device),
        state_indices=torch.tensor([blocks[1], 0], dtype=torch.int32, device=device))
    setattr(checkpoint, mamba2_plan.INTERIOR_ATTR, plan)
    for dim_first in (False, True):
        what = f"conv {'DS' if dim_first else 'SD'}"
        buffers = _caches(gen, dim_first, heads * 2, (heads, head_dim, d_state), dtype, device, written)
        before = (buffers[0].clone(), buffers[1].clone())
        conv, ssm = buffers[0][1:-1], buffers[1][1:-1]
        with _conv_layout(kernels, dim_first):
            _stored(result, mamba2_store.store_prefill_checkpoint, checkpoint,
                    torch.tensor([max(c, 0) for c in vllm_chunks], device=device), x,
                    conv if dim_first else conv.transpose(-1, -2), chunk_states, ssm,
                    prefill_start.to(device), state_len=CONV_WIDTH - 1)
        for i, (row, offset, blk) in enumerate(ends):
            first = int(prefill_start[row])
            want = prefix_states[prefix_last[i]]
            same = _same_bits(ssm[blk], want.to(dtype))
            result.bit_exact_vs_prefix = result.bit_exact_vs_prefix is not False and same
            _compare(result, ssm[blk], want)
            window = x[:, first + offset - (CONV_WIDTH - 1): first + offset]
            if not _same_bits(conv[blk], window if dim_first else window.T):
                result.problems.append(f"{what}: conv window of prefill row {row} at {offset} differs")
        _check_untouched(result, buffers, before, written, what)
        result.states += len(written)
    _check_bound(result, "the prefix scan")
    return result


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


# ---- the run -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shapes:
    gdn: dict[str, int]
    mamba2: dict[str, int]
    dtypes: tuple[torch.dtype, ...]


#: Shapes per device: real head sizes on a GPU (Qwen3.5's GDN heads of 128, Nemotron-H's Mamba2
#: chunk 128, head 64, state 128), small ones under the interpreter (CPU test, fp32 only).
SHAPES = {"gpu": Shapes({"heads": 4, "dim": 128},
                        {"scale": 8, "heads": 8, "head_dim": 64, "d_state": 128},
                        (torch.float32, torch.bfloat16)),
          "interpreter": Shapes({"heads": 1, "dim": 32},
                                {"scale": 1, "heads": 2, "head_dim": 4, "d_state": 8},
                                (torch.float32,))}


def _select_triton_backend(interpret: bool) -> str:
    """Select the Triton backend for ``hb_store_checkpoints`` (under the interpreter a Triton
    backend offered on CPU tensors); its name."""
    from . import plugins  # after the source tree's finder: the plugin logs through vllm.logger
    from .backends.triton import backend as triton_backend
    from .backends.triton import tuning

    if interpret:
        from .hookspecs import hookimpl
        from .types import Availability, BackendIdentity, DeviceKind

        class Interpreted(triton_backend.TritonBackend):
            @hookimpl
            def hb_backend_identity(self) -> BackendIdentity:
                return BackendIdentity("triton-interpreted", DeviceKind.CPU, priority=-1)

            @hookimpl
            def hb_backend_probe(self) -> Availability:
                return Availability(True, "Triton interpreter on CPU tensors (gpu_check --device cpu)")

        plugins.register_backend(Interpreted(tuning.NVIDIA))
        name = "triton-interpreted"
    else:
        from .device import hip_build

        name = (triton_backend.ROCM if hip_build() else triton_backend.CUDA).NAME
    os.environ[plugins.BACKEND_ENV] = name
    plugins.forget_selection()
    if plugins.selected_backend() != name:
        raise RuntimeError(f"backend {plugins.selected_backend()} selected instead of {name}")
    return name


def run_checks(kernels: Kernels, device: str) -> tuple[str, list[Result]]:
    interpret = device == "cpu"
    from . import patches  # after the source tree's finder: the patches log through vllm.logger
    from .patches import patch_vllm_third_party_flash_linear_attention_ops_chunk as wrap

    status = patches.check(wrap)
    if status.state not in ("ready", "applied"):
        raise VllmSourceError(f"the plugin's FLA wrap does not apply to {kernels.source}: "
                              f"{status.state}: {status.reason}")
    wrap.apply()
    backend = _select_triton_backend(interpret)
    shapes = SHAPES["interpreter" if interpret else "gpu"]
    results = []
    for dtype in shapes.dtypes:
        results.append(_guarded(f"gdn {_name(dtype)}", check_gdn, kernels, dtype, device, **shapes.gdn))
    for dtype in shapes.dtypes:
        results.append(_guarded(f"mamba2 {_name(dtype)}", check_mamba2, kernels, dtype, device,
                                **shapes.mamba2))
    return backend, results


def _guarded(name: str, check: Callable[..., Result], *args: Any, **kwargs: Any) -> Result:
    try:
        return check(*args, **kwargs)
    except Exception as exc:  # a failure is a result of the check
        return Result(name, problems=[f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"])


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def report(results: list[Result]) -> list[str]:
    lines = [f"{'check':12} {'states':>6} {'max abs err':>12} {'rel err':>9} {'bound':>7} "
             f"{'bit-exact vs prefix run':>24}  result"]
    for r in results:
        lines.append(f"{r.check:12} {r.states:>6} {r.max_abs_err:>12.3e} {r.err_ratio:>9.2e} "
                     f"{r.tolerance:>7.0e} {_yes_no(r.bit_exact_vs_prefix):>24}  "
                     f"{'ok' if r.ok else '; '.join(r.problems)}")
    return lines
