"""Route align-mode Mamba state operations in vLLM's worker through the selected backend's hooks.

- Targets: ``vllm.v1.worker.mamba_utils.collect_mamba_copy_meta`` and ``do_mamba_copy_block``
  (the V1 scalar copy path), and the methods of ``MambaSpecDecodeGPUContext`` that launch the
  fused Triton kernels: ``initialize_from_forward_context``, ``run_fused_precopy``,
  ``run_fused_postprocess``, ``run_fused_postprocess_align`` and
  ``compute_aligned_state_indices``.
- Why: in V1 (the CPU model runner, and CUDA with ``VLLM_USE_V2_MODEL_RUNNER=0``) every
  align-mode move of a running state into a new block, including the restore after a prefix-cache
  hit, is flattened into raw addresses and sent to ``batch_memcpy_kernel``; a backend never sees
  which states and blocks move. With speculative decoding (V1) and always in V2, the moves go
  instead through ``MambaSpecDecodeGPUContext``, whose fused kernels
  (``precopy_mamba_align_fused_kernel``, ``postprocess_mamba_fused_kernel``,
  ``get_aligned_state_indices_multi_group_kernel``) read raw addresses too and have no CPU
  implementation: on vLLM-CPU, speculative decoding with prefix caching fails on the first
  pre-copy (``'function' object is not subscriptable``).
- How: ``collect_mamba_copy_meta`` records (source column, destination column, bias, block ids)
  per request instead of addresses, for layers whose copy functions are vLLM's conv / temporal
  ones; anything else falls through to the original. ``do_mamba_copy_block`` flushes the records
  as one batched ``hb_copy_state_blocks`` (no bias) or ``hb_precopy_running_states`` call, then
  calls the original for whatever it collected. ``initialize_from_forward_context`` runs the
  original, then keeps a tensor-level view on the context: the state tensors of every Mamba
  layer (kinds from the copy functions, conv layout from ``is_conv_state_dim_first()``) and the
  persistent per-group block tables. The ``run_fused_*`` methods turn their per-request inputs
  into the hook's columns, biases and counts with the kernels' own decision rules, on the
  inputs' device and without a host sync (V1 batch order; V2 through ``idx_mapping`` with
  ``-1`` rows skipped and the precomputed new computed count), and call
  ``hb_precopy_running_states`` / ``hb_postprocess_accepted_states``;
  ``compute_aligned_state_indices`` fills vLLM's persistent output through
  ``hb_gather_aligned_state_indices`` (columns past a table's width give ``-1``; the kernel reads
  past the row there). A context without the view (initialised before the patch) keeps vLLM's
  methods.
- Upstream: vLLM's own comment "TODO(Chen): we need to optimize this function a lot" in
  ``preprocess_mamba``; the fused kernels' missing CPU versions have no issue number.
- vLLM versions: 0.30.x-0.33.x (``v1/worker/mamba_utils.py`` is identical in 0.32 and 0.33;
  0.30/0.31 index the V2 block tables by batch position under an ``idx_mapping`` and have no
  ``aligned_index_block_tables``: both handled where the rows are chosen). 0.26: the scalar
  path only (one tuple of copy functions for every layer); its ``MambaSpecDecodeGPUContext`` is
  an earlier design the replacements do not fit, so its fused kernels stay vLLM's
  (:func:`limitation`, shown by doctor). 0.23: as 0.26; ``is_conv_state_dim_first`` is found in
  ``vllm.model_executor.layers.mamba.mamba_utils`` (:func:`_conv_layout_function`).
- Removal: when vLLM exposes a block-level state-copy seam and CPU versions of the fused kernels.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from ..compat import version_allows
from ..trace import trace_event, trace_path
from ..types import MambaStateTensor, StateKind

TARGET_MODULE = "vllm.v1.worker.mamba_utils"
CONTEXT_CLASS = "MambaSpecDecodeGPUContext"
CONTEXT_METHODS = ("initialize_from_forward_context", "run_fused_precopy", "run_fused_postprocess",
                   "run_fused_postprocess_align", "compute_aligned_state_indices")
TARGET_SYMBOLS = ("collect_mamba_copy_meta", "do_mamba_copy_block",
                  *(f"{CONTEXT_CLASS}.{name}" for name in CONTEXT_METHODS))
PROCESS = "worker"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"

_ORIGINALS: dict[str, Any] = {}
#: vLLM 0.30/0.31's V2 block tables are in batch order under an idx_mapping (0.32: request slots)
_TABLES_IN_BATCH_ORDER = version_allows("<0.32")


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
    needed = ("collect_mamba_copy_meta", "do_mamba_copy_block", "get_conv_copy_spec",
              "get_temporal_copy_spec")
    problems = [f"{TARGET_MODULE}.{name}" for name in needed if not hasattr(module, name)]
    if _conv_layout_function(module) is None:
        problems.append(f"is_conv_state_dim_first (in {TARGET_MODULE} or {LAYOUT_MODULE})")
    if not problems and not SCALAR_PATH_ONLY:
        problems = _context_problems(module)
    return problems


#: Where vLLM 0.23 defines the conv-state layout check (0.26+ also re-export it from the target).
LAYOUT_MODULE = "vllm.model_executor.layers.mamba.mamba_utils"


def _conv_layout_function(module: Any) -> Any:
    """vLLM's ``is_conv_state_dim_first``: imported into the target module (0.26+) or only in
    the layers' ``mamba_utils`` (0.23); None if neither has it."""
    found = getattr(module, "is_conv_state_dim_first", None)
    if found is None:
        try:
            found = getattr(importlib.import_module(LAYOUT_MODULE), "is_conv_state_dim_first", None)
        except Exception:
            return None
    return found if callable(found) else None


def _context_problems(module: Any) -> list[str]:
    """What the fused-path replacements need of ``MambaSpecDecodeGPUContext`` and cannot find."""
    context = getattr(module, CONTEXT_CLASS, None)
    if context is None:
        return [f"{TARGET_MODULE}.{CONTEXT_CLASS}"]
    problems = [] if hasattr(module, "_get_mamba_spec_for_layer") else [
        f"{TARGET_MODULE}._get_mamba_spec_for_layer"]
    problems += [f"{TARGET_MODULE}.{CONTEXT_CLASS}.{name}" for name in CONTEXT_METHODS
                 if not callable(getattr(context, name, None))]
    fields = getattr(context, "__dataclass_fields__", {})
    problems += [f"{TARGET_MODULE}.{CONTEXT_CLASS} field {name}"
                 for name in ("block_size", "mamba_group_ids", "num_accepted_tokens_out",
                              "aligned_state_indices", "is_initialized")
                 if name not in fields]
    return problems


#: vLLM 0.23 and 0.26 give every Mamba layer one tuple of copy functions and their
#: ``MambaSpecDecodeGPUContext`` is an earlier design (no ``compute_aligned_state_indices``,
#: no ``aligned_state_indices``, no ``_get_mamba_spec_for_layer``); there only the V1 scalar
#: copy path is routed, and the fused spec-decode kernels stay vLLM's.
SCALAR_PATH_ONLY = version_allows("<0.30")


def limitation() -> str | None:
    """What this patch leaves to vLLM on this version (doctor shows it beside ``applied``)."""
    try:
        module = _module()
    except Exception:
        return None
    if not SCALAR_PATH_ONLY:
        return None
    lacking = _context_problems(module)
    return ("only the V1 scalar copy path is routed; vLLM's fused spec-decode kernels "
            f"(MambaSpecDecodeGPUContext) are left alone: this vLLM lacks {', '.join(lacking)}"
            if lacking else "only the V1 scalar copy path is routed")


def _layer_copy_funcs(module: Any, copy_funcs: Any, group: Any, layer_name: str) -> Any:
    """The copy functions of one layer: by the layer's Mamba type (0.30+), or the one tuple
    every layer shares (0.26)."""
    if isinstance(copy_funcs, tuple):
        return copy_funcs
    return copy_funcs[module._get_mamba_spec_for_layer(group, layer_name).mamba_type]


def _states_for(kv_cache_config: Any, copy_funcs: Any, group_ids: list[int],
                forward_context: dict[str, Any]) -> list[MambaStateTensor] | None:
    """Every state tensor of the given groups, or None if a layer uses unknown copy functions."""
    module = _module()
    first_layer = kv_cache_config.kv_cache_groups[group_ids[0]].layer_names[0]
    key = (id(forward_context), tuple(group_ids),
           forward_context[first_layer].kv_cache[0].data_ptr())
    if key in _state_cache:
        return _state_cache[key]
    conv_kind = StateKind.CONV_DS if _conv_layout_function(module)() else StateKind.CONV_SD
    kinds = {module.get_conv_copy_spec: conv_kind, module.get_temporal_copy_spec: StateKind.TEMPORAL}
    states: list[MambaStateTensor] = []
    known = True
    for group_index, group_id in enumerate(group_ids):
        group = kv_cache_config.kv_cache_groups[group_id]
        for layer_name in group.layer_names:
            funcs = _layer_copy_funcs(module, copy_funcs, group, layer_name)
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


# ---- the fused align path: MambaSpecDecodeGPUContext ----------------------------------------

_VIEW_ATTR = "_hybrid_backends_view"


@dataclass(frozen=True)
class _ContextView:
    """What the hooks need of one context: its states and its persistent block tables."""

    states: list[MambaStateTensor]
    block_tables: list[Any]  # one per Mamba group, rows = request state slots
    aligned_index_block_tables: list[Any]  # one per Mamba group, rows = batch rows


def _all_rows(table: Any) -> Any:
    """The persistent 2-D table behind ``table``, which may be a leading-rows slice of it.

    V1 hands the context ``block_table.gpu[:num_reqs]`` of the first step; later steps use more
    rows of the same storage, so the view must cover every row the storage holds.
    """
    if table.dim() != 2 or table.shape[1] == 0:
        return table
    elements = table.untyped_storage().nbytes() // table.element_size() - table.storage_offset()
    rows = (elements - (table.shape[1] - 1) * table.stride(1) - 1) // table.stride(0) + 1
    return table.as_strided((max(rows, table.shape[0]), table.shape[1]), table.stride())


def _view(ctx: Any) -> _ContextView | None:
    return getattr(ctx, _VIEW_ATTR, None)


def initialize_from_forward_context(self: Any, kv_cache_config: Any, forward_context: dict[str, Any],
                                    mamba_state_copy_funcs: Any, block_tables: list[Any],
                                    aligned_index_block_tables: list[Any] | None = None) -> None:
    # vLLM 0.30/0.31 have no aligned_index_block_tables parameter
    extra = () if aligned_index_block_tables is None else (aligned_index_block_tables,)
    _ORIGINALS["initialize_from_forward_context"](
        self, kv_cache_config, forward_context, mamba_state_copy_funcs, block_tables, *extra)
    if not self.is_initialized or _view(self) is not None:
        return
    states = _states_for(kv_cache_config, mamba_state_copy_funcs, list(self.mamba_group_ids),
                         forward_context)
    if states is None:
        return  # a layer with other copy functions: vLLM's kernels keep the whole context
    setattr(self, _VIEW_ATTR, _ContextView(
        states=states,
        block_tables=[_all_rows(t) for t in block_tables],
        aligned_index_block_tables=[_all_rows(t) for t in (aligned_index_block_tables or block_tables)],
    ))


_traced: set[str] = set()


def _trace_first(event: str, values: Any, above: int) -> None:
    """With tracing on, record once per process the first call whose ``values`` exceed ``above``
    (speculative tokens accepted / a token bias routed through the hooks); a host read only then."""
    if event in _traced or trace_path() is None or values.numel() == 0:
        return
    largest = int(values.max())
    if largest > above:
        _traced.add(event)
        trace_event(event, largest=largest)


def _table_rows(rows: Any, idx_mapping: Any) -> Any:
    """Block-table rows of the batch rows: request-state slots (vLLM 0.32+), or, under an
    ``idx_mapping`` on 0.30/0.31, the batch positions (their V2 tables are in batch order)."""
    if idx_mapping is None or not _TABLES_IN_BATCH_ORDER:
        return rows
    import torch

    return torch.arange(rows.shape[0], device=rows.device)


def _batch_rows(num_reqs: int, idx_mapping: Any, device: Any) -> tuple[Any, Any]:
    """Request-slot row of each batch row (``-1`` rows clamped to 0) and the valid mask."""
    import torch

    if idx_mapping is None:  # V1: the per-request arrays are already in batch order
        return torch.arange(num_reqs, device=device), None
    rows = idx_mapping[:num_reqs].long()
    return rows.clamp(min=0), rows >= 0


def run_fused_precopy(self: Any, num_reqs: int, state_idx_gpu: Any, src_col_gpu: Any,
                      token_bias_gpu: Any, idx_mapping: Any) -> None:
    view = _view(self)
    if view is None:
        _ORIGINALS["run_fused_precopy"](self, num_reqs, state_idx_gpu, src_col_gpu, token_bias_gpu,
                                        idx_mapping)
        return
    if num_reqs == 0 or not self.is_initialized:
        return
    import torch

    from .. import plugins

    rows, valid = _batch_rows(num_reqs, idx_mapping, state_idx_gpu.device)
    dst = state_idx_gpu[rows]
    src = src_col_gpu[rows]
    # precopy_mamba_align_fused_kernel: nothing to do for a fresh state or the same column
    skip = (src < 0) | (src == dst)
    if valid is not None:
        skip = skip | ~valid
    bias = torch.where(skip, 0, token_bias_gpu[rows])
    _trace_first("precopy_token_bias", bias, 0)
    table_rows = _table_rows(rows, idx_mapping)
    plugins.precopy_running_states(view.states, [table[table_rows] for table in view.block_tables],
                                   torch.where(skip, -1, src), dst, bias)


def _postprocess(ctx: Any, view: _ContextView, rows: Any, valid: Any, running_cols: Any,
                 running_tokens: Any, accepted: Any, accepted_out: Any) -> None:
    """``rows``: the block-table rows (:func:`_table_rows`)."""
    """One ``hb_postprocess_accepted_states`` call for the given request-slot rows."""
    from .. import plugins
    from ..backends import plan

    block_size = int(ctx.block_size)
    if valid is not None:
        running_tokens, accepted = plan.skipped_row_inputs(valid, running_tokens, accepted, block_size)
    _trace_first("postprocess_accepted_tokens", accepted, 1)
    plugins.postprocess_accepted_states(
        view.states, [table[rows] for table in view.block_tables], running_cols, running_tokens,
        accepted, block_size, accepted_out)


def run_fused_postprocess(self: Any, num_reqs: int, num_accepted_tokens_gpu: Any,
                          mamba_state_idx_gpu: Any, num_scheduled_tokens_gpu: Any,
                          num_computed_tokens_gpu: Any, num_draft_tokens_gpu: Any) -> None:
    view = _view(self)
    if view is None:
        _ORIGINALS["run_fused_postprocess"](
            self, num_reqs, num_accepted_tokens_gpu, mamba_state_idx_gpu, num_scheduled_tokens_gpu,
            num_computed_tokens_gpu, num_draft_tokens_gpu)
        return
    if num_reqs == 0 or not self.is_initialized:
        return
    n = num_reqs
    out = self.num_accepted_tokens_out[:n]
    out.copy_(num_accepted_tokens_gpu[:n])  # unchanged unless the boundary is the running column
    # postprocess_mamba_fused_kernel: the running state covers computed + scheduled - drafts
    running_tokens = (num_computed_tokens_gpu[:n] + num_scheduled_tokens_gpu[:n]
                      - num_draft_tokens_gpu[:n])
    rows, _ = _batch_rows(n, None, num_accepted_tokens_gpu.device)
    _postprocess(self, view, rows, None, mamba_state_idx_gpu[:n], running_tokens,
                 num_accepted_tokens_gpu[:n], out)


def run_fused_postprocess_align(self: Any, num_reqs: int, num_accepted_tokens_gpu: Any,
                                state_idx_gpu: Any, new_num_computed_tokens_gpu: Any,
                                idx_mapping: Any) -> None:
    view = _view(self)
    if view is None:
        _ORIGINALS["run_fused_postprocess_align"](
            self, num_reqs, num_accepted_tokens_gpu, state_idx_gpu, new_num_computed_tokens_gpu,
            idx_mapping)
        return
    if num_reqs == 0 or not self.is_initialized:
        return
    import torch

    # the kernel reads a snapshot of the counts it updates in place
    self.num_accepted_tokens_out.copy_(num_accepted_tokens_gpu)
    rows, valid = _batch_rows(num_reqs, idx_mapping, num_accepted_tokens_gpu.device)
    accepted = self.num_accepted_tokens_out[rows]
    # PRECOMPUTED_NEW_COMPUTED: the running state covers new_computed - accepted + 1 tokens
    running_tokens = new_num_computed_tokens_gpu[rows] - accepted + 1
    out = accepted.clone()
    _postprocess(self, view, _table_rows(rows, idx_mapping), valid, state_idx_gpu[rows],
                 running_tokens, accepted, out)
    # write back without a host sync: the hook only lowers counts (to 1); skipped rows keep theirs
    if valid is not None:
        out = torch.where(valid, out, torch.full_like(out, torch.iinfo(out.dtype).max))
    num_accepted_tokens_gpu.scatter_reduce_(0, rows, out.to(num_accepted_tokens_gpu.dtype), "amin")


def compute_aligned_state_indices(self: Any, seq_lens: Any, num_reqs: int) -> Any:
    view = _view(self)
    if view is None:
        return _ORIGINALS["compute_aligned_state_indices"](self, seq_lens, num_reqs)
    from .. import plugins

    if not self.is_initialized:
        raise RuntimeError("compute_aligned_state_indices called before the context was initialised")
    target = self.aligned_state_indices
    if not 0 <= num_reqs <= min(seq_lens.shape[0], target.shape[1]):
        raise ValueError(f"num_reqs={num_reqs} is outside 0..{min(seq_lens.shape[0], target.shape[1])}")
    if num_reqs == 0:
        return target[:, :0]
    indices = plugins.gather_aligned_state_indices(
        [table[:num_reqs] for table in view.aligned_index_block_tables], seq_lens[:num_reqs],
        int(self.block_size), int(target.shape[2]))
    target[:, :num_reqs].copy_(indices)
    return target[:, :num_reqs]


_CONTEXT_REPLACEMENTS: dict[str, Any] = {
    "initialize_from_forward_context": initialize_from_forward_context,
    "run_fused_precopy": run_fused_precopy,
    "run_fused_postprocess": run_fused_postprocess,
    "run_fused_postprocess_align": run_fused_postprocess_align,
    "compute_aligned_state_indices": compute_aligned_state_indices,
}


def apply() -> None:
    module = _module()
    functions: dict[str, Any] = {"collect_mamba_copy_meta": collect_mamba_copy_meta,
                                 "do_mamba_copy_block": do_mamba_copy_block}
    for name, replacement in functions.items():
        current = getattr(module, name)
        if current is replacement:
            continue
        _ORIGINALS[name] = current
        setattr(module, name, replacement)
    if SCALAR_PATH_ONLY:
        return
    context = getattr(module, CONTEXT_CLASS)
    for name, method in _CONTEXT_REPLACEMENTS.items():
        current = context.__dict__.get(name, getattr(context, name))
        if current is method:
            continue
        _ORIGINALS[name] = current
        setattr(context, name, method)
