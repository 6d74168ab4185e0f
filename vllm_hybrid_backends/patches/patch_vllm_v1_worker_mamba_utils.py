"""Route V1 align-mode state copies through the selected backend's hooks.

- Targets: ``vllm.v1.worker.mamba_utils.collect_mamba_copy_meta`` and ``do_mamba_copy_block``.
- Why: in V1 (the CPU model runner, and CUDA with ``VLLM_USE_V2_MODEL_RUNNER=0``) every
  align-mode move of a running state into a new block, including the restore after a prefix-cache
  hit, is flattened into raw addresses and sent to ``batch_memcpy_kernel``; a backend never sees
  which states and blocks move. This patch keeps the block-level view so the move goes through
  ``hb_copy_state_blocks`` (no token bias) or ``hb_precopy_running_states`` (spec-decode bias,
  both conv layouts, which the address path cannot do for the DS layout).
- How: ``collect_mamba_copy_meta`` records (source column, destination column, bias, block ids)
  per request instead of addresses, for layers whose copy functions are vLLM's conv / temporal
  ones; anything else falls through to the original. ``do_mamba_copy_block`` flushes the records
  as one batched hook call, then calls the original for whatever it collected.
- Upstream: vLLM's own comment "TODO(Chen): we need to optimize this function a lot" in
  ``preprocess_mamba``; no issue number.
- vLLM versions: 0.32.x, 0.33.x (``v1/worker/mamba_utils.py`` is identical in both).
- Removal: when vLLM exposes a block-level state-copy seam.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from ..types import MambaStateTensor, StateKind

TARGET_MODULE = "vllm.v1.worker.mamba_utils"
TARGET_SYMBOLS = ("collect_mamba_copy_meta", "do_mamba_copy_block")
PROCESS = "worker"

_ORIGINALS: dict[str, Any] = {}


@dataclass
class _PendingCopies:
    """Requests whose running state moves this step, gathered by the patched collector."""

    states: list[MambaStateTensor] = field(default_factory=list)
    src_cols: list[int] = field(default_factory=list)
    dst_cols: list[int] = field(default_factory=list)
    biases: list[int] = field(default_factory=list)
    block_ids: list[list[list[int]]] = field(default_factory=list)  # [request][group] -> ids


_pending: dict[int, _PendingCopies] = {}
_state_cache: dict[tuple, list[MambaStateTensor] | None] = {}


def _module() -> Any:
    return importlib.import_module(TARGET_MODULE)


def missing() -> list[str]:
    try:
        module = _module()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    needed = (*TARGET_SYMBOLS, "get_conv_copy_spec", "get_temporal_copy_spec",
              "is_conv_state_dim_first", "_get_mamba_spec_for_layer")
    return [f"{TARGET_MODULE}.{name}" for name in needed if not hasattr(module, name)]


def _states_for(kv_cache_config: Any, copy_funcs: Any, group_ids: list[int],
                forward_context: dict[str, Any]) -> list[MambaStateTensor] | None:
    """Every state tensor of the given groups, or None if a layer uses unknown copy functions."""
    module = _module()
    first_layer = kv_cache_config.kv_cache_groups[group_ids[0]].layer_names[0]
    key = (id(forward_context), tuple(group_ids),
           forward_context[first_layer].kv_cache[0].data_ptr())
    if key in _state_cache:
        return _state_cache[key]
    conv_kind = StateKind.CONV_DS if module.is_conv_state_dim_first() else StateKind.CONV_SD
    kinds = {module.get_conv_copy_spec: conv_kind, module.get_temporal_copy_spec: StateKind.TEMPORAL}
    states: list[MambaStateTensor] = []
    known = True
    for group_index, group_id in enumerate(group_ids):
        group = kv_cache_config.kv_cache_groups[group_id]
        for layer_name in group.layer_names:
            spec = module._get_mamba_spec_for_layer(group, layer_name)
            funcs = copy_funcs[spec.mamba_type]
            known = known and all(f in kinds for f in funcs)
            if known:
                tensors = forward_context[layer_name].kv_cache
                states += [MambaStateTensor(t, kinds[f], group_index, layer_name)
                           for t, f in zip(tensors, funcs)]
    _state_cache[key] = states if known else None
    return _state_cache[key]


def collect_mamba_copy_meta(copy_bufs: Any, kv_cache_config: Any, mamba_state_copy_funcs: Any,
                            mamba_group_ids: list[int], src_block_idx: int, dest_block_idx: int,
                            accept_token_bias: int, req_state: Any,
                            forward_context: dict[str, Any]) -> None:
    if src_block_idx == dest_block_idx and accept_token_bias == 0:
        return
    states = _states_for(kv_cache_config, mamba_state_copy_funcs, mamba_group_ids, forward_context)
    if states is None:
        _ORIGINALS["collect_mamba_copy_meta"](
            copy_bufs, kv_cache_config, mamba_state_copy_funcs, mamba_group_ids, src_block_idx,
            dest_block_idx, accept_token_bias, req_state, forward_context)
        return
    pending = _pending.setdefault(id(copy_bufs), _PendingCopies())
    pending.states = states
    pending.src_cols.append(src_block_idx)
    pending.dst_cols.append(dest_block_idx)
    pending.biases.append(accept_token_bias)
    pending.block_ids.append([req_state.block_ids[g] for g in mamba_group_ids])


def flush(pending: _PendingCopies) -> None:
    """Send one step's recorded moves to the selected backend as a single batched call."""
    import torch

    from .. import plugins

    num_groups = len(pending.block_ids[0])
    if not any(pending.biases):
        src = [[ids[g][c] for ids, c in zip(pending.block_ids, pending.src_cols)]
               for g in range(num_groups)]
        dst = [[ids[g][c] for ids, c in zip(pending.block_ids, pending.dst_cols)]
               for g in range(num_groups)]
        plugins.copy_state_blocks(pending.states, torch.tensor(src), torch.tensor(dst))
        return
    tables = []
    for g in range(num_groups):
        width = max(len(ids[g]) for ids in pending.block_ids)
        table = torch.zeros((len(pending.block_ids), width), dtype=torch.int64)
        for row, ids in enumerate(pending.block_ids):
            table[row, : len(ids[g])] = torch.tensor(ids[g])
        tables.append(table)
    plugins.precopy_running_states(pending.states, tables, torch.tensor(pending.src_cols),
                                   torch.tensor(pending.dst_cols), torch.tensor(pending.biases))


def do_mamba_copy_block(copy_bufs: Any) -> None:
    pending = _pending.pop(id(copy_bufs), None)
    if pending is not None and pending.src_cols:
        flush(pending)
    _ORIGINALS["do_mamba_copy_block"](copy_bufs)


def apply() -> None:
    module = _module()
    for name, replacement in (("collect_mamba_copy_meta", collect_mamba_copy_meta),
                              ("do_mamba_copy_block", do_mamba_copy_block)):
        current = getattr(module, name)
        if current is replacement:
            continue
        _ORIGINALS[name] = current
        setattr(module, name, replacement)
