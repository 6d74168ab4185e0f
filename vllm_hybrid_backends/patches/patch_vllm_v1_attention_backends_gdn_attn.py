"""Tell the gated-delta-net forward where to store states inside a prefill chunk.

- Target: ``vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadataBuilder.build`` and
  ``.update_block_table``.
- Why: the KV-cache manager gives the plugin's tail checkpoints a block inside a prefill chunk
  (``patch_vllm_v1_core_kv_cache_coordinator``); vLLM's GDN metadata keeps only each
  row's running-state index, so the forward cannot see those blocks.
- How: after vLLM's build, each prefill row's block-table row is read with
  :func:`vllm_hybrid_backends.interior.checkpoints_of_rows` (a real block at a column the chunk
  crosses; vLLM pads every other such column with the null block) and the result, ``{row:
  [(offset in the row's query, block id), ...]}``, is set on the metadata as
  :data:`INTERIOR_ATTR` (vLLM-CPU's forward reads it). With the block table on a device
  (CUDA, ROCm), nothing is read on the host: every aligned boundary strictly inside a prefill
  row's chunk (found from the host query starts and sequence lengths) is a candidate whose
  destination is gathered on the device, ``-1`` at the null block (skipped by
  ``hb_store_checkpoints``); its recurrent state is row ``chunk_offsets[row] + offset / 64`` of
  FLA's per-chunk states, its conv window ends at the row's first token + offset. The
  :class:`~vllm_hybrid_backends.interior.InteriorPlan` is set as :data:`DEVICE_PLAN_ATTR` and
  stored by ``patch_vllm_model_executor_layers_mamba_gdn_qwen_gdn_linear_attn``;
  ``update_block_table`` (other KV-cache groups of the same spec, MRV2) re-gathers the
  destinations from that group's table. Only align mode without speculative decoding is read
  (the manager gives interior blocks to nothing else); every other build is returned untouched.
- Upstream: none; FlashInfer's GDN checkpoint plan (``plan_flashinfer_checkpoints``) exports one
  state per row.
- vLLM versions: 0.32.x, 0.33.x (same builder fields); ``update_block_table`` where the
  builder has it.
- Removal: when vLLM plans several prefill checkpoints per row itself.
"""

from __future__ import annotations

import importlib
from typing import Any

from .. import interior

TARGET_MODULE = "vllm.v1.attention.backends.gdn_attn"
TARGET_SYMBOLS = ("GDNAttentionMetadataBuilder.build",)
PROCESS = "worker"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"

#: Attribute of a ``GDNAttentionMetadata`` holding ``{row: [(offset, block id), ...]}``.
INTERIOR_ATTR = "hybrid_interior_checkpoints"
#: Attribute of a ``GDNAttentionMetadata`` holding the device path's :class:`InteriorPlan`.
DEVICE_PLAN_ATTR = "hybrid_interior_plan"
#: FLA's chunk size: the per-chunk states exist every 64 tokens of a sequence.
FLA_CHUNK = 64

_ORIGINALS: dict[str, Any] = {}


def _builder_class() -> Any:
    return importlib.import_module(TARGET_MODULE).GDNAttentionMetadataBuilder


def missing() -> list[str]:
    try:
        cls = _builder_class()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    return [] if callable(getattr(cls, "build", None)) else [TARGET_SYMBOLS[0]]


def plan_interior_checkpoints(block_table: Any, query_start_loc: Any, seq_lens: Any,
                              rows: range, block_size: int) -> dict[int, list[tuple[int, int]]]:
    """``{row: [(offset, block id), ...]}`` for the rows whose chunk crosses a real block."""
    return {row: points for row, (_, points) in interior.checkpoints_of_rows(
        block_table, query_start_loc, seq_lens, rows, block_size).items()}


def plan_device_states(block_table: Any, query_start_loc: Any, seq_lens: Any, first_row: int,
                       num_prefills: int, block_size: int,
                       chunk_size: int = FLA_CHUNK) -> interior.InteriorPlan | None:
    """The interior states of the prefill rows ``first_row ..`` as a device plan, or None when
    no chunk crosses a boundary. ``query_start_loc`` and ``seq_lens`` are host tensors; the
    destinations are gathered from ``block_table`` where it lives (``-1`` at the null block).

    ``temporal_row`` indexes FLA's per-chunk states of the prefill rows (chunks of
    ``chunk_size`` tokens counted from each row's first token, rows one after another);
    ``token_end`` / ``seq_start`` index the step's token-major input (decodes first)."""
    prefill_rows = range(first_row, first_row + num_prefills)
    chunks_before: dict[int, int] = {}  # row -> FLA chunks of the prefill rows before it
    total = 0
    for r in prefill_rows:
        chunks_before[r] = total
        total += -(-(int(query_start_loc[r + 1]) - int(query_start_loc[r])) // chunk_size)
    rows: list[int] = []
    cols: list[int] = []
    token_end: list[int] = []
    seq_start: list[int] = []
    chunk_rows: list[int] = []
    for r, c, first_token, offset in interior.crossed_boundaries(
            query_start_loc, seq_lens, prefill_rows, block_size, block_table.shape[1]):
        if offset % chunk_size:
            raise ValueError(
                f"GDN interior state at offset {offset} of request row {r} (chunk from token "
                f"{(c + 1) * block_size - offset}) is not a multiple of FLA's chunk size "
                f"{chunk_size}: block size {block_size} must be a multiple of {chunk_size} and "
                "chunks must start at block boundaries")
        rows.append(r)
        cols.append(c)
        seq_start.append(first_token)
        token_end.append(first_token + offset)
        chunk_rows.append(chunks_before[r] + offset // chunk_size)
    if not rows:
        return None
    return interior.device_plan(block_table, rows, cols, token_end, seq_start, chunk_rows)


def build(self: Any, common_prefix_len: int, common_attn_metadata: Any, *args: Any,
          **kwargs: Any) -> Any:
    metadata = _ORIGINALS["build"](self, common_prefix_len, common_attn_metadata, *args, **kwargs)
    if (not metadata.num_prefills or metadata.spec_sequence_masks is not None
            or getattr(self.vllm_config.cache_config, "mamba_cache_mode", None) != "align"
            or self.kv_cache_spec.num_speculative_blocks):
        return metadata
    m = common_attn_metadata
    if m.block_table_tensor.device.type != "cpu":
        # seq_lens_cpu_upper_bound is exact for prefill rows (no device read); FLA's chunk
        # states fall on block boundaries only for multiples of its chunk (the handshake keeps
        # the engine from planning otherwise)
        if m.seq_lens_cpu_upper_bound is None or self.kv_cache_spec.block_size % FLA_CHUNK:
            return metadata
        device_plan = plan_device_states(m.block_table_tensor, m.query_start_loc_cpu,
                                         m.seq_lens_cpu_upper_bound, metadata.num_decodes,
                                         metadata.num_prefills, self.kv_cache_spec.block_size)
        if device_plan is not None:
            setattr(metadata, DEVICE_PLAN_ATTR, device_plan)
        return metadata
    seq_lens = m.seq_lens_cpu_upper_bound if m.seq_lens_cpu_upper_bound is not None \
        else m.seq_lens.cpu()
    rows = range(metadata.num_decodes, metadata.num_decodes + metadata.num_prefills)
    plan = plan_interior_checkpoints(m.block_table_tensor, m.query_start_loc_cpu, seq_lens, rows,
                                     self.kv_cache_spec.block_size)
    if plan:
        setattr(metadata, INTERIOR_ATTR, plan)
    return metadata


def update_block_table(self: Any, metadata: Any, blk_table: Any, slot_mapping: Any) -> Any:
    updated = _ORIGINALS["update_block_table"](self, metadata, blk_table, slot_mapping)
    plan = getattr(metadata, DEVICE_PLAN_ATTR, None)
    if plan is not None:
        if updated is metadata:  # vLLM returned the source itself: keep the source's plan alone
            import dataclasses

            updated = dataclasses.replace(metadata)
        setattr(updated, DEVICE_PLAN_ATTR, plan.regather(blk_table))
    return updated


_WRAPPERS = (("build", build), ("update_block_table", update_block_table))


def apply() -> None:
    cls = _builder_class()
    for name, wrapper in _WRAPPERS:
        if callable(getattr(cls, name, None)) and getattr(cls, name) is not wrapper:
            _ORIGINALS[name] = getattr(cls, name)
            setattr(cls, name, wrapper)


def revert() -> None:
    cls = _builder_class()
    for name, _ in _WRAPPERS:
        if name in _ORIGINALS:
            setattr(cls, name, _ORIGINALS.pop(name))
