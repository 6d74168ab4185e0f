"""Give vLLM-CPU's Mamba2 SSD scan the chunk-end states align mode asks for.

- Target: ``vllm.model_executor.layers.mamba.ops.ssd_combined._mamba_chunk_scan_combined_fwd``,
  which on CPU is bound (at import) to ``ops.cpu.mamba_ssm._mamba_chunk_scan_combined_fwd_cpu``;
  ``mamba_chunk_scan_combined_varlen`` calls it through that module-level name.
- Why: in align mode ``MambaMixer2`` declares an internal prefill checkpoint, calls the scan with
  ``return_intermediate_states=True`` and indexes the result by chunk (``last_chunk_indices``,
  ``checkpoint_chunk_idx``). The CPU scan accepts the flag but returns only one final state per
  sequence, so every Mamba2 hybrid (GraniteMoeHybrid, NemotronH, FalconH1, Mamba2) dies on its
  first prefill with prefix caching: ``IndexError: index 23 is out of bounds for dimension 0
  with size 1``.
- How: with the flag set, the scan runs chunk by chunk over vLLM's own chunk table
  (``cu_chunk_seqlens``, ``seq_idx``: chunks end at absolute multiples of ``chunk_size``, at
  sequence ends and at checkpoint offsets), each call starting from the previous chunk's fp32
  state, and returns the state after every chunk, ``(num_chunks, heads, head_dim, d_state)`` in
  ``state_dtype``: what the Triton scan returns. The carried state stays fp32, so outputs and
  final states equal one call over the whole sequence up to float rounding (the CPU kernel works
  in 4-token vector steps and a cut reorders a few additions; tested to 1e-5). Without the flag
  the original runs unchanged. On other platforms the name
  holds vLLM's Triton scan, which already returns the chunk states, and nothing is patched.
- Upstream: no issue found; vLLM-CPU 0.32.0's ``_mamba_chunk_scan_combined_fwd_cpu`` ignores
  ``return_intermediate_states``.
- vLLM versions: 0.32.x, 0.33.x (same CPU binding; 0.33 adds ``final_states_out``, passed through).
  0.23/0.26: not needed (:func:`not_needed`), there is no CPU scan.
- Removal: when the CPU scan returns intermediate states itself.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from ..logs import logger

TARGET_MODULE = "vllm.model_executor.layers.mamba.ops.ssd_combined"
TARGET_SYMBOLS = ("_mamba_chunk_scan_combined_fwd",)
PROCESS = "worker"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"

CPU_SCAN_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm"
CPU_SCAN_NAME = "_mamba_chunk_scan_combined_fwd_cpu"

_ORIGINALS: dict[str, Any] = {}


def _module() -> Any:
    return importlib.import_module(TARGET_MODULE)


def not_needed() -> str | None:
    """vLLM before 0.30 has no CPU Mamba2 scan: the name holds the Triton scan, which returns
    the chunk states already (and does not run on vLLM-CPU)."""
    try:
        _module()
        if importlib.util.find_spec(CPU_SCAN_MODULE) is not None:
            return None
    except Exception:
        return None  # missing() names the import problem
    return ("this vLLM has no CPU Mamba2 scan (no ops/cpu/mamba_ssm.py; added in 0.30): the "
            "scan is vLLM's Triton one, which returns the chunk states itself")


def missing() -> list[str]:
    try:
        module = _module()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    return [f"{TARGET_MODULE}.{name}" for name in TARGET_SYMBOLS if not hasattr(module, name)]


def is_cpu_scan(fn: Any) -> bool:
    """Whether ``fn`` is vLLM-CPU's scan, the one without chunk states."""
    return (getattr(fn, "__module__", None) == CPU_SCAN_MODULE
            and getattr(fn, "__name__", None) == CPU_SCAN_NAME)


def scan_with_chunk_states(scan: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, chunk_size: int,
                           out: Any, *, D: Any = None, z: Any = None, dt_bias: Any = None,
                           initial_states: Any = None, cu_chunk_seqlens: Any, seq_idx: Any,
                           dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
                           state_dtype: Any = None, **kwargs: Any) -> Any:
    """Run ``scan`` (a per-sequence scan returning final states) once per chunk, carrying the
    fp32 state, and return the state after every chunk."""
    import torch

    bounds = [int(b) for b in cu_chunk_seqlens.tolist()]
    owners = [int(s) for s in seq_idx.tolist()]
    if len(owners) != len(bounds) - 1:
        raise ValueError(f"seq_idx has {len(owners)} entries for {len(bounds) - 1} chunks")
    heads, head_dim = x.shape[1], x.shape[2]
    d_state = B.shape[2]
    carried: dict[int, Any] = {}
    chunk_states = []
    for chunk, owner in enumerate(owners):
        start, end = bounds[chunk], bounds[chunk + 1]
        state = carried.get(owner)
        if state is None and initial_states is not None:
            state = initial_states[owner : owner + 1]
        if end > start:
            lengths = torch.tensor([0, end - start], dtype=torch.int32, device=x.device)
            state = scan(x[start:end], dt[start:end], A, B[start:end], C[start:end], chunk_size,
                         out[start:end], D=D, z=None if z is None else z[start:end], dt_bias=dt_bias,
                         initial_states=state, cu_seqlens=lengths, dt_softplus=dt_softplus,
                         dt_limit=dt_limit, state_dtype=torch.float32, **kwargs)
        elif state is None:
            state = torch.zeros(1, heads, head_dim, d_state, dtype=torch.float32, device=x.device)
        carried[owner] = state
        chunk_states.append(state[0])
    result = torch.stack(chunk_states) if chunk_states else x.new_zeros((0, heads, head_dim, d_state))
    return result.to(state_dtype if state_dtype is not None else x.dtype)


def _mamba_chunk_scan_combined_fwd(x: Any, dt: Any, A: Any, B: Any, C: Any, chunk_size: int, out: Any,
                                   *args: Any, **kwargs: Any) -> Any:
    original = _ORIGINALS["_mamba_chunk_scan_combined_fwd"]
    if args or not kwargs.get("return_intermediate_states"):
        return original(x, dt, A, B, C, chunk_size, out, *args, **kwargs)
    kwargs.pop("return_intermediate_states")
    for unused in ("cu_seqlens", "last_chunk_indices"):  # per chunk, the scan gets its own
        kwargs.pop(unused, None)
    return scan_with_chunk_states(original, x, dt, A, B, C, chunk_size, out, **kwargs)


def apply() -> None:
    module = _module()
    current = module._mamba_chunk_scan_combined_fwd
    if current is _mamba_chunk_scan_combined_fwd:
        return
    if not is_cpu_scan(current):
        logger.debug("hybrid_backends: %s is not vLLM-CPU's scan; left as is", TARGET_MODULE)
        return
    _ORIGINALS["_mamba_chunk_scan_combined_fwd"] = current
    module._mamba_chunk_scan_combined_fwd = _mamba_chunk_scan_combined_fwd
