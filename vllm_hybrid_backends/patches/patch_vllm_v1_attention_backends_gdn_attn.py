"""Tell the gated-delta-net forward where to store states inside a prefill chunk.

- Target: ``vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadataBuilder.build``.
- Why: the KV-cache manager gives the plugin's tail checkpoints a block inside a prefill chunk
  (``patch_vllm_v1_core_kv_cache_coordinator``); vLLM's GDN metadata keeps only each
  row's running-state index, so the forward cannot see those blocks.
- How: after vLLM's build, each prefill row's block-table row is read with
  :func:`vllm_hybrid_backends.interior.checkpoints_of_rows` (a real block at a column the chunk
  crosses; vLLM pads every other such column with the null block) and the result, ``{row:
  [(offset in the row's query, block id), ...]}``, is set on the metadata as
  :data:`INTERIOR_ATTR`. Only align mode without speculative decoding, with the block table on
  the CPU, is read (the manager gives interior blocks to nothing else, and reading a device
  table would sync); every other build is returned untouched.
- Upstream: none; FlashInfer's GDN checkpoint plan (``plan_flashinfer_checkpoints``) exports one
  state per row.
- vLLM versions: 0.32.x, 0.33.x (same builder fields).
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


def build(self: Any, common_prefix_len: int, common_attn_metadata: Any, *args: Any,
          **kwargs: Any) -> Any:
    metadata = _ORIGINALS["build"](self, common_prefix_len, common_attn_metadata, *args, **kwargs)
    if (not metadata.num_prefills or common_attn_metadata.block_table_tensor.device.type != "cpu"
            or metadata.spec_sequence_masks is not None
            or getattr(self.vllm_config.cache_config, "mamba_cache_mode", None) != "align"
            or self.kv_cache_spec.num_speculative_blocks):
        return metadata
    m = common_attn_metadata
    seq_lens = m.seq_lens_cpu_upper_bound if m.seq_lens_cpu_upper_bound is not None \
        else m.seq_lens.cpu()
    rows = range(metadata.num_decodes, metadata.num_decodes + metadata.num_prefills)
    plan = plan_interior_checkpoints(m.block_table_tensor, m.query_start_loc_cpu, seq_lens, rows,
                                     self.kv_cache_spec.block_size)
    if plan:
        setattr(metadata, INTERIOR_ATTR, plan)
    return metadata


def apply() -> None:
    cls = _builder_class()
    if cls.build is not build:
        _ORIGINALS["build"] = cls.build
        cls.build = build


def revert() -> None:
    if "build" in _ORIGINALS:
        _builder_class().build = _ORIGINALS.pop("build")
