"""The per-step move plan, written once for every backend: which state block moves where.

Computed with tensor ops on the index tensors' own device: no value is read back to the host,
so on a GPU or NPU the plan is queued like any kernel and a backend only implements the *move*
(see :func:`vllm_hybrid_backends.reference.apply_row_moves` and the Triton kernels).

Rows that move nothing keep ``dst = -1``; movers skip them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowMoves:
    """One move per request row and Mamba group: ``dst[g, r] <- conv_src[g, r]`` for conv states
    (window shifted left by ``shift[r]`` tokens), ``dst[g, r] <- temporal_src[g, r]`` for temporal
    states. Block ids are int64 on the block tables' device; ``dst`` is ``-1`` for no move."""

    conv_src: torch.Tensor  # [groups, rows]
    temporal_src: torch.Tensor  # [groups, rows]
    dst: torch.Tensor  # [groups, rows]
    shift: torch.Tensor  # [rows]


def _lookup(table: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``table[r, cols[r]]``, ``-1`` where the column is outside the table."""
    width = table.shape[1]
    if width == 0:
        return torch.full_like(cols, -1)
    picked = torch.gather(table.long(), 1, cols.clamp(0, width - 1)[:, None]).squeeze(1)
    return torch.where((cols >= 0) & (cols < width), picked, -1)


def _row_moves(block_tables: Sequence[torch.Tensor], active: torch.Tensor, src_cols: torch.Tensor,
               dst_cols: torch.Tensor, shift: torch.Tensor) -> RowMoves:
    conv, temporal, dst = [], [], []
    for table in block_tables:
        c, t, d = _lookup(table, src_cols), _lookup(table, src_cols + shift), _lookup(table, dst_cols)
        moves = active & (c >= 0) & (t >= 0) & (d >= 0)
        conv.append(c)
        temporal.append(t)
        dst.append(torch.where(moves, d, -1))
    return RowMoves(torch.stack(conv), torch.stack(temporal), torch.stack(dst), shift)


def _on(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device=device, dtype=torch.long, non_blocking=True) for t in tensors]


def precopy_moves(block_tables: Sequence[torch.Tensor], src_cols: torch.Tensor,
                  dst_cols: torch.Tensor, token_bias: torch.Tensor) -> RowMoves:
    """``hb_precopy_running_states``: a row moves when it has a previous column and it is not
    the same column with no bias."""
    src, dst, bias = _on(block_tables[0].device, src_cols, dst_cols, token_bias)
    active = (src >= 0) & ~((src == dst) & (bias == 0))
    return _row_moves(block_tables, active, src, dst, torch.where(active, bias, 0))


def postprocess_moves(block_tables: Sequence[torch.Tensor], running_cols: torch.Tensor,
                      num_running_tokens: torch.Tensor, num_accepted: torch.Tensor,
                      block_size: int) -> tuple[RowMoves, torch.Tensor]:
    """``hb_postprocess_accepted_states``: the moves and the rows whose accepted count becomes 1.

    ``aligned = (running + accepted - 1) // block_size * block_size``; a row whose aligned
    boundary is not behind its running tokens stores the state after ``aligned`` tokens (bias
    ``aligned - running``) into column ``aligned // block_size - 1``.
    """
    cols, running, accepted = _on(block_tables[0].device, running_cols, num_running_tokens,
                                  num_accepted)
    aligned = torch.div(running + accepted - 1, block_size, rounding_mode="floor") * block_size
    crossed = aligned >= running
    bias = aligned - running
    dst = torch.div(aligned, block_size, rounding_mode="floor") - 1
    reset = crossed & (cols == dst)
    active = crossed & ~(reset & (bias == 0))
    return _row_moves(block_tables, active, cols, dst, torch.where(active, bias, 0)), reset


def apply_reset(num_accepted_out: torch.Tensor, reset: torch.Tensor) -> None:
    """``num_accepted_out[r] = 1`` where ``reset[r]``; others untouched (no host read)."""
    num_accepted_out.masked_fill_(reset.to(num_accepted_out.device, non_blocking=True), 1)


def skipped_row_inputs(valid: torch.Tensor, running_tokens: torch.Tensor, accepted: torch.Tensor,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs that make :func:`postprocess_moves` leave a row alone: ``2 * block_size - 1``
    running tokens and 1 accepted put the last boundary (``block_size``) behind it."""
    if block_size < 2:
        raise ValueError(f"Mamba block_size {block_size} < 2 cannot mark skipped rows")
    return (torch.where(valid, running_tokens, 2 * block_size - 1),
            torch.where(valid, accepted, torch.ones_like(accepted)))
