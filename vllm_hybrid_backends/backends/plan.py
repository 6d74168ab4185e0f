"""The per-step move plan, written once for every backend: which state block moves where.

Computed with tensor ops on the index tensors' own device: no value is read back to the host,
so on a GPU or NPU the plan is queued like any kernel and a backend only implements the *move*
(see :func:`vllm_hybrid_backends.reference.apply_row_moves` and the Triton kernels).

Rows that move nothing get destination ``-1``; movers skip them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..types import CheckpointBatch, MambaStateTensor


@dataclass(frozen=True)
class RowMoves:
    """One move per request row and Mamba group: ``conv_dst[g, r] <- conv_src[g, r]`` for conv
    states (window shifted left by ``shift[r]`` tokens), ``temporal_dst[g, r] <-
    temporal_src[g, r]`` for temporal states. Block ids are int64 on the block tables' device;
    a destination of ``-1`` means no move."""

    conv_src: torch.Tensor  # [groups, rows]
    conv_dst: torch.Tensor  # [groups, rows]
    temporal_src: torch.Tensor  # [groups, rows]
    temporal_dst: torch.Tensor  # [groups, rows]
    shift: torch.Tensor  # [rows]

    def of(self, state: MambaStateTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sources, destinations) of ``state``'s group and kind."""
        if state.kind.is_conv:
            return self.conv_src[state.group], self.conv_dst[state.group]
        return self.temporal_src[state.group], self.temporal_dst[state.group]


def _lookup(tables: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``tables[g, r, cols[k, r]]`` as ``[g, r, k]``, ``-1`` where a column is outside the table."""
    groups, rows, width = tables.shape
    if width == 0:
        return torch.full((groups, rows, cols.shape[0]), -1, dtype=torch.long, device=cols.device)
    inside = cols.clamp(0, width - 1)
    picked = torch.gather(tables, 2, inside.T.expand(groups, rows, -1))
    return torch.where((inside == cols).T, picked, -1)


def _row_moves(block_tables: Sequence[torch.Tensor], active: torch.Tensor, src_cols: torch.Tensor,
               dst_cols: torch.Tensor, shift: torch.Tensor) -> RowMoves:
    cols = torch.stack([src_cols, src_cols + shift, dst_cols])  # conv, temporal source; destination
    tables = [t[: cols.shape[1]] for t in block_tables]  # a row per request (extra rows unused)
    if len({(t.shape, t.dtype) for t in tables}) == 1:  # vLLM's groups: one op for all
        found = _lookup(torch.stack(tables).long(), cols)
    else:
        found = torch.cat([_lookup(t.long()[None], cols) for t in tables])
    sources, dst = found[..., :2], found[..., 2:]
    # a row moves a state when it is active, has a destination and that state has a source
    dsts = torch.where((sources >= 0) & (dst >= 0) & active[:, None], dst, -1)
    return RowMoves(sources[..., 0], dsts[..., 0], sources[..., 1], dsts[..., 1], shift)


def _on(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device=device, dtype=torch.long, non_blocking=True) for t in tensors]


def precopy_moves(block_tables: Sequence[torch.Tensor], src_cols: torch.Tensor,
                  dst_cols: torch.Tensor, token_bias: torch.Tensor) -> RowMoves:
    """``hb_precopy_running_states``: a row moves when it has a previous column and it is not
    the same column with no bias."""
    src, dst, bias = _on(block_tables[0].device, src_cols, dst_cols, token_bias)
    active = (src >= 0) & ((src != dst) | (bias != 0))
    return _row_moves(block_tables, active, src, dst, bias * active)


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


# ---- checks of plans made from host tensors (the facades run them; device plans are trusted) ----


def on_host(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def check_row_moves(states: Sequence[MambaStateTensor], moves: RowMoves, what: str) -> None:
    """Reject, with one clear error, a host-made plan that a mover could not do exactly: a conv
    bias outside the window, a block written twice, a request reading a block another request
    writes (each request owns its running blocks), a block id outside a state tensor."""
    shifts = moves.shift.tolist()
    done: set[tuple[int, bool, int, int]] = set()
    for state in states:
        conv, group = state.kind.is_conv, state.group
        key = (group, conv, state.state_len if conv else 0, state.tensor.shape[0])
        if key in done:
            continue
        done.add(key)
        src, dst = (ids.tolist() for ids in moves.of(state))
        rows = [r for r, d in enumerate(dst) if d >= 0]
        writer: dict[int, int] = {}
        for r in rows:
            if conv and shifts[r] >= state.state_len:
                raise ValueError(
                    f"token bias {shifts[r]} of request row {r} is outside [0, {state.state_len}) "
                    f"(conv state_len of layer {state.layer or '?'})"
                )
            for name, block in (("source", src[r]), ("destination", dst[r])):
                if block >= state.tensor.shape[0]:
                    raise IndexError(f"{what}: request row {r} names {name} block {block} of state "
                                     f"{state.layer or '?'}; allowed 0..{state.tensor.shape[0] - 1}")
            if dst[r] in writer:
                raise ValueError(f"{what}: request rows {writer[dst[r]]} and {r} both write block "
                                 f"{dst[r]} of group {group}; a destination may be written once")
            writer[dst[r]] = r
        for r in rows:
            other = writer.get(src[r], r)
            if other != r:
                raise ValueError(f"{what}: request row {r} reads block {src[r]} of group {group}, "
                                 f"which request row {other} writes; each request must own its "
                                 "running blocks")


def check_checkpoints(states: Sequence[MambaStateTensor], sources: Sequence[torch.Tensor],
                      checkpoints: CheckpointBatch) -> None:
    """Reject host checkpoint batches a store could not do exactly (see hb_store_checkpoints)."""
    dst = [block for block in checkpoints.dst_block.tolist() if block >= 0]  # < 0: skipped
    initial = checkpoints.initial_block.tolist()
    token_end, seq_start = checkpoints.token_end.tolist(), checkpoints.seq_start.tolist()
    temporal_rows = checkpoints.temporal_row.tolist()
    if len(set(dst)) != len(dst):
        block = next(b for b in dst if dst.count(b) > 1)
        raise ValueError(f"checkpoint dst_block: block {block} is written twice; a destination "
                         "may be written once per call")
    for k, block in enumerate(initial):
        if block in dst:
            raise ValueError(f"checkpoint {k} starts from block {block}, which this call also "
                             "writes; initial and destination blocks must differ")
    for state, source in zip(states, sources):
        count = state.tensor.shape[0]
        for name, ids in (("dst_block", dst), ("initial_block", [i for i in initial if i >= 0])):
            bad = [b for b in ids if not 0 <= b < count]
            if bad:
                raise IndexError(f"checkpoint {name} names block {bad[0]} of state "
                                 f"{state.layer or '?'}; allowed 0..{count - 1}")
        rows = source.shape[0]
        for k, (end, start, row) in enumerate(zip(token_end, seq_start, temporal_rows)):
            if state.kind.is_conv and not 0 <= start <= end <= rows:
                raise ValueError(f"checkpoint {k}: need 0 <= seq_start <= token_end <= {rows} (rows "
                                 f"of the conv input of {state.layer or '?'}), got seq_start={start}, "
                                 f"token_end={end}")
            if not state.kind.is_conv and not 0 <= row < rows:
                raise IndexError(f"checkpoint {k}: temporal_row {row} is outside the {rows} rows of "
                                 f"the temporal source of {state.layer or '?'}")
