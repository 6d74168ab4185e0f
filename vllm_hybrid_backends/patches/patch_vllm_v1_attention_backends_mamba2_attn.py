"""Tell Mamba2's forward where to store states inside a prefill chunk.

- Target: ``vllm.v1.attention.backends.mamba2_attn.Mamba2AttentionMetadataBuilder.build`` and
  ``.update_block_table``.
- Why: the KV-cache manager gives the plugin's tail checkpoints blocks inside a prefill chunk
  instead of splitting it (``patch_vllm_v1_core_kv_cache_coordinator``); vLLM's Mamba2 metadata
  describes one prefill checkpoint per row (``checkpoint_meta``), so the forward cannot see
  those blocks.
- How: after vLLM's build, every aligned boundary strictly inside a prefill row's chunk (the
  rule of :func:`vllm_hybrid_backends.interior.crossed_columns`, found from the host copies
  of the query starts and sequence lengths) is a candidate, except the column of vLLM's own
  checkpoint; its destination is gathered from the block table where the table lives (a device
  table on GPUs: no host read), ``-1`` where the manager left the null block, which
  ``hb_store_checkpoints`` skips. On a host table the skipped candidates are dropped at once.
  Every such boundary ends a chunk of vLLM's
  SSD chunk table (chunks end at absolute multiples of the chunk size, and Mamba block sizes
  are multiples of it), so the scan's chunk states hold the state there: vLLM-CPU's scan
  through ``patch_vllm_model_executor_layers_mamba_ops_ssd_combined``, vLLM's Triton scan
  (CUDA, ROCm) natively. The boundaries become
  one :class:`~vllm_hybrid_backends.types.CheckpointBatch` per step (conv window ends in the
  prefill tokens, chunk rows, destination blocks), set on ``checkpoint_meta`` as
  :data:`INTERIOR_ATTR`; the Mamba2 checkpoint-store patch
  (``patch_vllm_model_executor_layers_mamba_mamba_mixer2``) stores it with vLLM's checkpoint
  through ``hb_store_checkpoints``. A step where vLLM places no checkpoint gets an empty one
  (every offset 0, so vLLM stores nothing), which makes ``MambaMixer2`` ask the scan for its
  chunk states and call the store. ``update_block_table`` (the other KV-cache groups of the same
  spec) re-gathers the destination blocks from that group's table: same rows and columns.
  Only align mode without speculative decoding is planned (the manager gives interior blocks
  to nothing else).
- Upstream: none; vLLM plans one prefill checkpoint per row (``compute_mamba_prefill_checkpoints``).
- vLLM versions: 0.32.x, 0.33.x (same builder, ``checkpoint_meta`` and chunk table).
- Removal: when vLLM plans several prefill checkpoints per row itself.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from .. import interior
from ..compat import has_mamba2_prefill_checkpoint

TARGET_MODULE = "vllm.v1.attention.backends.mamba2_attn"
TARGET_SYMBOLS = ("Mamba2AttentionMetadataBuilder.build",
                  "Mamba2AttentionMetadataBuilder.update_block_table")
PROCESS = "worker"
VLLM_VERSIONS = ">=0.32.0,<0.34.0"

CHECKPOINT_MODULE = "vllm.model_executor.layers.mamba.checkpoint"
#: Attribute of a ``MambaPrefillCheckpointMetadata`` holding the step's :class:`InteriorPlan`.
INTERIOR_ATTR = "hybrid_interior_plan"
NULL_BLOCK_ID = interior.NULL_BLOCK_ID

_ORIGINALS: dict[str, Any] = {}


InteriorPlan = interior.InteriorPlan


def _builder_class() -> Any:
    return importlib.import_module(TARGET_MODULE).Mamba2AttentionMetadataBuilder


def not_needed() -> str | None:
    """vLLM before 0.32 has no Mamba2 prefill checkpoint to carry the interior states."""
    try:
        importlib.import_module(TARGET_MODULE)
    except Exception:
        return None  # missing() names the import problem
    if not has_mamba2_prefill_checkpoint():
        return ("this vLLM's Mamba2AttentionMetadata has no prefill checkpoint "
                "(checkpoint_meta, added in 0.32)")
    return None


def missing() -> list[str]:
    try:
        cls = _builder_class()
        checkpoint = importlib.import_module(CHECKPOINT_MODULE)
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    problems = [f"{TARGET_MODULE}.{symbol}" for symbol in TARGET_SYMBOLS
                if not callable(getattr(cls, symbol.split(".")[1], None))]
    if not callable(getattr(cls, "_compute_chunk_metadata", None)):
        problems.append(f"{TARGET_MODULE}.Mamba2AttentionMetadataBuilder._compute_chunk_metadata")
    fields = {f.name for f in dataclasses.fields(checkpoint.MambaPrefillCheckpointMetadata)}
    for name in ("checkpoint_offsets", "state_indices", "offsets", "request_rows", "block_cols"):
        if name not in fields:
            problems.append(f"{CHECKPOINT_MODULE}.MambaPrefillCheckpointMetadata.{name}")
    return problems


def plan_interior_states(block_table: Any, query_start_loc: Any, seq_lens: Any, first_row: int,
                         num_prefills: int, num_decode_tokens: int, block_size: int,
                         chunk_size: int, vllm_offsets: list[int] | None,
                         compute_chunk_metadata: Any,
                         prune_on_host: bool | None = None) -> InteriorPlan | None:
    """The interior states of the prefill rows ``first_row ..``, or None.

    Every aligned boundary strictly inside a row's chunk is a candidate (the rule of
    :func:`vllm_hybrid_backends.interior.crossed_columns`); its destination is gathered from
    ``block_table`` where the table lives, and a column holding the null block gets ``-1``
    (skipped by ``hb_store_checkpoints``), so a device table is never read on the host.
    ``query_start_loc`` and ``seq_lens`` are host tensors. ``prune_on_host`` (default: the
    table is on the CPU) drops the skipped candidates, and returns None when none is left.
    ``vllm_offsets`` are vLLM's own checkpoint offsets per prefill row (0: none): the column
    vLLM stores its checkpoint in is skipped here
    (:func:`vllm_hybrid_backends.interior.vllm_checkpoint_column`);
    ``compute_chunk_metadata`` is vLLM's ``_compute_chunk_metadata`` (the chunk table the scan
    runs over, so each boundary's chunk index is the one vLLM's scan returns its state at).
    """
    rows, cols, token_end, seq_start, ends = [], [], [], [], []
    for r, c, first_token, offset in interior.crossed_boundaries(
            query_start_loc, seq_lens, range(first_row, first_row + num_prefills), block_size,
            block_table.shape[1]):
        p = r - first_row
        if vllm_offsets and vllm_offsets[p] and c == interior.vllm_checkpoint_column(
                int(seq_lens[r]), block_size):
            continue
        rows.append(r)
        cols.append(c)
        seq_start.append(first_token - num_decode_tokens)
        token_end.append(first_token - num_decode_tokens + offset)
        ends.append((p, offset))
    if not rows:
        return None
    blocks = None
    if prune_on_host if prune_on_host is not None else block_table.device.type == "cpu":
        import torch

        index = torch.tensor([rows, cols], dtype=torch.long, device=block_table.device)
        all_blocks = interior.destinations(block_table, index[0], index[1])
        kept = [k for k, block in enumerate(all_blocks.tolist()) if block >= 0]
        if not kept:
            return None
        rows, cols = [rows[k] for k in kept], [cols[k] for k in kept]
        seq_start, token_end = [seq_start[k] for k in kept], [token_end[k] for k in kept]
        ends = [ends[k] for k in kept]
        blocks = all_blocks[kept]
    query_start_p = query_start_loc[first_row: first_row + num_prefills + 1] - num_decode_tokens
    computed_p = seq_lens[first_row: first_row + num_prefills] - (query_start_p[1:] -
                                                                    query_start_p[:-1])
    bounds, owners, _, _ = compute_chunk_metadata(chunk_size, num_prefills, computed_p,
                                                  query_start_p, vllm_offsets)
    chunk_ending: dict[tuple[int, int], int] = {}  # (prefill row, query offset) -> chunk ending there
    for chunk, owner in enumerate(owners):
        chunk_ending.setdefault((owner, bounds[chunk + 1] - int(query_start_p[owner])), chunk)
    chunks = []
    for p, offset in ends:
        if (p, offset) not in chunk_ending:
            raise ValueError(
                f"Mamba2 interior state at offset {offset} of prefill row {p} is not a chunk end "
                f"(block size {block_size}, SSD chunk size {chunk_size}): the block size must be "
                "a multiple of the chunk size")
        chunks.append(chunk_ending[(p, offset)])
    return interior.device_plan(block_table, rows, cols, token_end, seq_start, chunks, blocks)


def _empty_checkpoint(m: Any, first_row: int, num_prefills: int) -> Any:
    """vLLM's checkpoint metadata for a step without its checkpoints: every offset 0."""
    import torch

    checkpoint = importlib.import_module(CHECKPOINT_MODULE)
    device = m.query_start_loc.device
    zeros = torch.zeros(num_prefills, dtype=torch.int32, device=device)
    return checkpoint.MambaPrefillCheckpointMetadata(
        checkpoint_offsets=zeros, state_indices=zeros.clone(), offsets=[0] * num_prefills,
        request_rows=torch.arange(first_row, first_row + num_prefills, device=device),
        block_cols=torch.full((num_prefills,), -1, dtype=torch.long, device=device))


def build(self: Any, common_prefix_len: int, common_attn_metadata: Any, *args: Any,
          **kwargs: Any) -> Any:
    metadata = _ORIGINALS["build"](self, common_prefix_len, common_attn_metadata, *args, **kwargs)
    m = common_attn_metadata
    if (not metadata.num_prefills
            or getattr(self.vllm_config.cache_config, "mamba_cache_mode", None) != "align"
            or self.kv_cache_spec.num_speculative_blocks or m.seq_lens_cpu_upper_bound is None):
        return metadata
    first_row = metadata.num_decodes
    checkpoint = metadata.checkpoint_meta
    plan = plan_interior_states(
        m.block_table_tensor, m.query_start_loc_cpu, m.seq_lens_cpu_upper_bound, first_row,
        metadata.num_prefills, metadata.num_decode_tokens, self.kv_cache_spec.block_size,
        metadata.chunk_size, None if checkpoint is None else checkpoint.offsets,
        self._compute_chunk_metadata)
    if plan is None:
        return metadata
    if checkpoint is None:
        import torch

        checkpoint = _empty_checkpoint(m, first_row, metadata.num_prefills)
        metadata = dataclasses.replace(
            metadata, checkpoint_meta=checkpoint,
            checkpoint_chunk_idx=torch.zeros(metadata.num_prefills, dtype=torch.long,
                                             device=m.query_start_loc.device))
    setattr(checkpoint, INTERIOR_ATTR, plan)
    return metadata


def update_block_table(self: Any, metadata: Any, blk_table: Any, slot_mapping: Any) -> Any:
    updated = _ORIGINALS["update_block_table"](self, metadata, blk_table, slot_mapping)
    plan = getattr(metadata.checkpoint_meta, INTERIOR_ATTR, None)
    if plan is not None:
        checkpoint = updated.checkpoint_meta
        if checkpoint is metadata.checkpoint_meta:  # not re-gathered: keep the source's alone
            checkpoint = dataclasses.replace(checkpoint)
            updated = dataclasses.replace(updated, checkpoint_meta=checkpoint)
        setattr(checkpoint, INTERIOR_ATTR, plan.regather(blk_table))
    return updated


def apply() -> None:
    cls = _builder_class()
    for name, wrapper in (("build", build), ("update_block_table", update_block_table)):
        if getattr(cls, name) is not wrapper:
            _ORIGINALS[name] = getattr(cls, name)
            setattr(cls, name, wrapper)


def revert() -> None:
    cls = _builder_class()
    for name in ("build", "update_block_table"):
        if name in _ORIGINALS:
            setattr(cls, name, _ORIGINALS.pop(name))
