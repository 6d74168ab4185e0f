"""The interior-states protocol: Mamba states stored inside a prefill chunk, at block boundaries.

In align mode a chunk's only new state is its last one; vLLM pads every column of the block
table the chunk skips with the null block. Where the forward can store states inside the chunk
(``patch_vllm_v1_core_kv_cache_coordinator.stores_interior``), the plugin asks for them through
the block table alone, so the engine and the workers need no other channel:

1. Plan (engine, KV-cache coordinator): the tail checkpoints strictly inside the chunk
   (:func:`vllm_hybrid_backends.align.interior_tail_checkpoints`) become block-table columns,
   :func:`planned_columns`.
2. Allocate (engine): :func:`place_blocks` puts a fresh block at each planned column vLLM
   padded with the null block.
3. Read (worker metadata builders, the replay's fake model): a real block at a column the chunk
   crosses asks for the state after that column's last token, :func:`checkpoints` for one row,
   :func:`checkpoints_of_rows` for a batch; the states are stored through
   ``hb_store_checkpoints``.
4. Release (engine): the coordinator hashes the blocks like any kept boundary (``cache_blocks``)
   and vLLM's ``remove_skipped_blocks`` hands them back to the pool after the step, still
   cached, as it does every column before the running state's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

#: vLLM's null block: the KV-cache manager pads the columns a chunk skips with it.
NULL_BLOCK_ID = 0


def planned_columns(positions: Sequence[int], block_size: int) -> list[int]:
    """The block-table columns whose block holds the state after each token position."""
    return [position // block_size - 1 for position in positions]


def place_blocks(blocks: list[Any], columns: Sequence[int], first_new_column: int,
                 new_blocks: Callable[[int], list[Any]]) -> list[int]:
    """Put a fresh block (from ``new_blocks(count)``) at each planned column that this
    allocation appended (``>= first_new_column``) and vLLM padded with the null block;
    returns the columns filled."""
    columns = [c for c in columns if first_new_column <= c < len(blocks) and blocks[c].is_null]
    if columns:
        for column, block in zip(columns, new_blocks(len(columns))):
            blocks[column] = block
    return columns


def column_of(start: int, offset: int, block_size: int) -> int:
    """The block-table column of the state ``offset`` tokens into a chunk starting at ``start``."""
    return (start + offset) // block_size - 1


def vllm_checkpoint_column(seq_len: int, block_size: int) -> int:
    """The block-table column vLLM stores a row's prefill checkpoint in: ``cdiv(seq_len,
    block_size) - 2`` (``compute_mamba_prefill_checkpoints`` in
    ``model_executor/layers/mamba/checkpoint.py``, ``checkpoint_idx`` in
    ``MambaManager.get_num_blocks_to_allocate``), whatever the checkpoint's position: with a
    ``prefix_match_unit`` below the block that is a unit boundary up to a block past the column's
    boundary, with a cache-hit alignment above the Mamba block (a Mamba block finer than the
    attention block) a boundary a block or more below it. The worker's interior plan leaves that
    column to vLLM, and the KV-cache manager keeps no boundary state there, or two states go to
    one block."""
    return -(-seq_len // block_size) - 2


def crossed_columns(start: int, end: int, block_size: int) -> tuple[int, int]:
    """The columns ``[first, last)`` that may hold interior states of the chunk ``[start, end)``:
    earlier ones hold the states the request started from (a partial first block's is the hit's),
    the running state's column ends at or past ``end``."""
    return -(-start // block_size), -(-end // block_size) - 1


def checkpoints(block_ids: Sequence[int], start: int, end: int, block_size: int,
                null_block_id: int = 0) -> list[tuple[int, int]]:
    """Where a forward over tokens ``[start, end)`` of a request stores states inside the chunk:
    ``(offset from start, block id)`` pairs, ascending, one per real block in
    :func:`crossed_columns` of the request's block-table row ``block_ids``."""
    first, last = crossed_columns(start, end, block_size)
    last = min(len(block_ids), last)
    return [((c + 1) * block_size - start, int(block_ids[c])) for c in range(first, last)
            if int(block_ids[c]) != null_block_id]


def checkpoints_of_rows(block_table: Any, query_start_loc: Any, seq_lens: Any, rows: range,
                        block_size: int) -> dict[int, tuple[int, list[tuple[int, int]]]]:
    """``{row: (chunk start token, [(offset, block id), ...])}`` for the rows of a batch whose
    chunk crosses a real block; host tensors (``block_table`` is ``[rows, columns]``), only the
    crossed columns of each row are read."""
    found: dict[int, tuple[int, list[tuple[int, int]]]] = {}
    for row in rows:
        query_len = int(query_start_loc[row + 1]) - int(query_start_loc[row])
        if query_len <= block_size:
            continue
        end = int(seq_lens[row])
        start = end - query_len
        first, last = crossed_columns(start, end, block_size)
        if first >= last:
            continue
        ids = [0] * first + block_table[row, first:last].tolist()
        points = checkpoints(ids, start, end, block_size)
        if points:
            found[row] = (start, points)
    return found


def crossed_boundaries(query_start_loc: Any, seq_lens: Any, rows: range,
                       block_size: int, width: int) -> Iterator[tuple[int, int, int, int]]:
    """``(row, column, row's first token, offset into its chunk)`` of every aligned boundary
    strictly inside each row's chunk (:func:`crossed_columns`, columns below ``width``), in
    row then column order; ``query_start_loc`` and ``seq_lens`` are host tensors."""
    for row in rows:
        first_token = int(query_start_loc[row])
        start = int(seq_lens[row]) - (int(query_start_loc[row + 1]) - first_token)
        first, last = crossed_columns(start, int(seq_lens[row]), block_size)
        for column in range(first, min(width, last)):
            yield row, column, first_token, (column + 1) * block_size - start


def device_plan(block_table: Any, rows: list[int], cols: list[int], token_end: list[int],
                seq_start: list[int], temporal_row: list[int],
                dst_block: Any = None) -> InteriorPlan:
    """The :class:`InteriorPlan` of host candidate lists, its tensors where ``block_table``
    lives; the destinations are gathered from the table (:func:`destinations`) unless given."""
    import torch

    from .device import host_ints
    from .types import CheckpointBatch

    device = block_table.device

    def as_long(values: list[int]) -> Any:
        return host_ints(values, device)

    request_rows, block_cols = as_long(rows), as_long(cols)
    if dst_block is None:
        dst_block = destinations(block_table, request_rows, block_cols)
    batch = CheckpointBatch(token_end=as_long(token_end), seq_start=as_long(seq_start),
                            initial_block=torch.full((len(rows),), -1, dtype=torch.long,
                                                     device=device),
                            dst_block=dst_block, temporal_row=as_long(temporal_row))
    return InteriorPlan(batch, request_rows, block_cols)


def destinations(block_table: Any, request_rows: Any, block_cols: Any) -> Any:
    """``block_table[request_rows, block_cols]``, ``-1`` where that is the null block (a
    candidate the engine gave no block; ``hb_store_checkpoints`` skips it), computed where the
    table lives: no host read of a device table."""
    import torch

    blocks = block_table[request_rows, block_cols].long()
    return torch.where(blocks == NULL_BLOCK_ID, -1, blocks)


@dataclasses.dataclass(frozen=True)
class InteriorPlan:
    """The interior states of one step on the device path: what to store
    (a :class:`~vllm_hybrid_backends.types.CheckpointBatch`) and where each destination came
    from in the block table (``block_table[request_rows[k], block_cols[k]]``)."""

    batch: Any  # CheckpointBatch
    request_rows: Any
    block_cols: Any

    def regather(self, block_table: Any) -> InteriorPlan:
        """The same plan for another KV-cache group, whose blocks are in ``block_table``."""
        blocks = destinations(block_table, self.request_rows, self.block_cols)
        return dataclasses.replace(self, batch=dataclasses.replace(self.batch, dst_block=blocks))
