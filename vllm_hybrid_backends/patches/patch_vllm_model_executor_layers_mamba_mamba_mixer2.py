"""Store Mamba2's mid-prefill checkpoints through the selected backend's ``hb_store_checkpoints``.

- Target: ``vllm.model_executor.layers.mamba.mamba_mixer2.store_prefill_checkpoint`` (the name
  ``MambaMixer2.conv_ssm_forward`` calls; imported from ``ops/ssd_checkpoint.py``).
- Why: in align mode ``MambaMixer2`` exports the state at the last aligned boundary inside a
  prefill chunk (``num_prefill_checkpoint_blocks=1``) with ``_store_prefill_checkpoint_kernel``,
  a Triton kernel with no CPU implementation: once the scan returns chunk states on vLLM-CPU
  (see ``patch_vllm_model_executor_layers_mamba_ops_ssd_combined``), this store is the next
  crash. On GPUs it is the one checkpoint store of the backend interface vLLM calls.
- How: the rows with a checkpoint (the host copy ``checkpoint.offsets``, so no device sync) become
  one :class:`~vllm_hybrid_backends.types.CheckpointBatch`: the conv window ends at
  ``query_start_loc[row] + offset`` of the token-major pre-conv input, the temporal state is chunk
  state ``chunk_idx[row]``, the destination is ``checkpoint.state_indices[row]``. The conv state
  is handed over in its own layout (``is_conv_state_dim_first()``) and narrowed to the kernel's
  ``state_len`` (conv kernel - 1) positions: with speculative decoding the cache is wider and
  its extra positions are scratch the kernel leaves alone. vLLM only places a checkpoint at least
  one hash block into the query, so a window never reaches before it; a request that would is
  rejected with an error rather than stored wrong. The interior states the plugin plans on the
  checkpoint metadata (``patch_vllm_v1_attention_backends_mamba2_attn``: tail checkpoints inside
  the chunk, from the same chunk states) go into the same ``hb_store_checkpoints`` call.
- Upstream: none (the kernel works on CUDA/ROCm; CPU has no Triton).
- vLLM versions: 0.32.x, 0.33.x (``ops/ssd_checkpoint.py`` identical; same call in
  ``mamba_mixer2.py``); not needed before 0.32, which has no Mamba2 prefill checkpoint.
- Removal: when vLLM-CPU implements the store, and vLLM exposes a checkpoint-store seam.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from ..types import CheckpointBatch, MambaStateTensor, StateKind

TARGET_MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"
TARGET_SYMBOLS = ("store_prefill_checkpoint",)
PROCESS = "worker"
VLLM_VERSIONS = ">=0.32.0,<0.34.0"

LAYOUT_MODULE = "vllm.model_executor.layers.mamba.mamba_utils"

_ORIGINALS: dict[str, Any] = {}


def _module() -> Any:
    return importlib.import_module(TARGET_MODULE)


CHECKPOINT_MODULE = "vllm.model_executor.layers.mamba.ops.ssd_checkpoint"


def not_needed() -> str | None:
    """vLLM before 0.32 has no Mamba2 prefill checkpoint: nothing to store."""
    try:
        module = _module()
    except Exception:
        return None  # missing() names the import problem
    if hasattr(module, "store_prefill_checkpoint") or importlib.util.find_spec(
            CHECKPOINT_MODULE) is not None:
        return None
    return ("this vLLM has no Mamba2 prefill checkpoint (no mamba_mixer2.store_prefill_checkpoint, "
            "no ops/ssd_checkpoint.py; added in 0.32)")


def missing() -> list[str]:
    try:
        module = _module()
        layout = importlib.import_module(LAYOUT_MODULE)
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    problems = [f"{TARGET_MODULE}.{name}" for name in TARGET_SYMBOLS if not hasattr(module, name)]
    if not hasattr(layout, "is_conv_state_dim_first"):
        problems.append(f"{LAYOUT_MODULE}.is_conv_state_dim_first")
    return problems


def store_prefill_checkpoint(checkpoint: Any, chunk_idx: Any, x: Any, conv_state: Any,
                             chunk_states: Any, ssm_state: Any, query_start_loc: Any, *,
                             state_len: int) -> None:
    """Same arguments as vLLM's ``ops.ssd_checkpoint.store_prefill_checkpoint``; also stores
    the interior states planned on ``checkpoint`` (:data:`INTERIOR_ATTR`), in the same call."""
    import torch

    from .. import plugins
    from ..device import host_ints
    from .patch_vllm_v1_attention_backends_mamba2_attn import INTERIOR_ATTR

    offsets = checkpoint.offsets
    if offsets is None:
        offsets = checkpoint.checkpoint_offsets.tolist()
    rows = [row for row, offset in enumerate(offsets) if offset > 0]
    interior = getattr(checkpoint, INTERIOR_ATTR, None)
    if not rows and interior is None:
        return
    short = [(row, offsets[row]) for row in rows if offsets[row] < state_len]
    if short:
        raise ValueError(
            f"prefill checkpoint offsets {short} (row, offset) are shorter than the conv window "
            f"({state_len} tokens); only offsets >= {state_len} can be stored from this query"
        )
    batches = [] if interior is None else [interior.batch]
    if rows:
        device = query_start_loc.device
        index = host_ints(rows, device)
        starts = query_start_loc[index].long()
        batches.insert(0, CheckpointBatch(
            token_end=starts + checkpoint.checkpoint_offsets.to(device)[index].long(),
            seq_start=starts,
            initial_block=torch.full_like(starts, -1),
            dst_block=checkpoint.state_indices.to(device)[index].long(),
            temporal_row=chunk_idx.to(device)[index].long(),
        ))
    batch = batches[0] if len(batches) == 1 else CheckpointBatch(**{
        field: torch.cat([getattr(b, field) for b in batches])
        for field in ("token_end", "seq_start", "initial_block", "dst_block", "temporal_row")})
    # vLLM hands the conv cache as (blocks, dim, width); give the hook the cache's own layout
    if importlib.import_module(LAYOUT_MODULE).is_conv_state_dim_first():
        conv = MambaStateTensor(conv_state[:, :, :state_len], StateKind.CONV_DS)
    else:
        conv = MambaStateTensor(conv_state.transpose(1, 2)[:, :state_len], StateKind.CONV_SD)
    temporal = MambaStateTensor(ssm_state, StateKind.TEMPORAL)
    plugins.store_checkpoints([conv, temporal], [x.transpose(0, 1), chunk_states], batch)


def apply() -> None:
    module = _module()
    current = module.store_prefill_checkpoint
    if current is store_prefill_checkpoint:
        return
    _ORIGINALS["store_prefill_checkpoint"] = current
    module.store_prefill_checkpoint = store_prefill_checkpoint
