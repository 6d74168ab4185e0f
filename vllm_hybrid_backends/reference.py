"""The ``cpu`` backend: every hook in pure torch, on tensors of any device.

It is the backend used on CPU and the oracle every device backend is tested against, so it
favours obviously-correct code over speed: all sources are gathered before any destination is
written (snapshot semantics, see :mod:`.hookspecs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backends import plan
from .backends.plan import RowMoves
from .hookspecs import hookimpl
from .types import (
    Availability,
    BackendIdentity,
    BackendStatus,
    CheckpointBatch,
    DeviceKind,
    MambaStateTensor,
    StateKind,
)

NAME = "cpu"
PAD_BLOCK_ID = -1


def _window(state: MambaStateTensor, block: torch.Tensor | int, start: int, stop: int) -> torch.Tensor:
    """Conv positions ``[start, stop)`` of one block, as a view in the state's layout."""
    if state.kind is StateKind.CONV_SD:
        return state.tensor[block, start:stop]
    return state.tensor[block, :, start:stop]


PER_BLOCK_COPY_BYTES = 4096
"""Blocks at least this large, when no block of the group is both read and written, are copied
one by one: a single pass over the data. Otherwise (chains, tiny blocks, device-resident ids)
all sources are gathered, then scattered."""


def copy_state_blocks(
    states: Sequence[MambaStateTensor], src_blocks: torch.Tensor, dst_blocks: torch.Tensor
) -> None:
    on_host = src_blocks.device.type == "cpu" and dst_blocks.device.type == "cpu"
    src_rows = src_blocks.tolist() if on_host else []
    dst_rows = dst_blocks.tolist() if on_host else []
    # groups whose moves can go block by block: ids on the host, no block both read and written
    disjoint = {g for g, (s, d) in enumerate(zip(src_rows, dst_rows)) if set(s).isdisjoint(d)}
    indices: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
    for state in states:
        tensor, group = state.tensor, state.group
        block_bytes = tensor[0].numel() * tensor.element_size() if len(tensor) else 0
        if group in disjoint and block_bytes >= PER_BLOCK_COPY_BYTES:
            for src, dst in zip(src_rows[group], dst_rows[group]):
                tensor[dst].copy_(tensor[src])
            continue
        key = (group, tensor.device)
        if key not in indices:
            indices[key] = (src_blocks[group].to(device=tensor.device, dtype=torch.long),
                            dst_blocks[group].to(device=tensor.device, dtype=torch.long))
        src_index, dst_index = indices[key]
        tensor[dst_index] = tensor[src_index]  # advanced indexing gathers first


def apply_row_moves(states: Sequence[MambaStateTensor], moves: RowMoves) -> None:
    """Perform a :class:`~.backends.plan.RowMoves` plan in torch: every read before any write."""
    if moves.shift.device.type == "cpu":
        _host_row_moves(states, moves)
    else:
        _device_row_moves(states, moves)


def _host_row_moves(states: Sequence[MambaStateTensor], moves: RowMoves) -> None:
    """Index tensors on the host: only the moving rows, block by block (small copies stay on
    one thread), conv windows grouped by shift."""
    picks: dict[tuple[int, bool], list[tuple[int, list[int], list[int]]]] = {}
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for state in states:
        tensor, conv = state.tensor, state.kind.is_conv
        key = (state.group, conv)
        if key not in picks:
            src, dst = moves.of(state)
            rows = (dst >= 0).nonzero().squeeze(1)
            src, dst, shift = src[rows], dst[rows], moves.shift[rows]
            picks[key] = ([(b, src[shift == b].tolist(), dst[shift == b].tolist())
                           for b in shift.unique().tolist()] if conv else [(0, src.tolist(), dst.tolist())])
        for bias, src_ids, dst_ids in picks[key]:
            if not conv:
                staged.extend((tensor[d], tensor[s].clone()) for s, d in zip(src_ids, dst_ids))
                continue
            axis, length = (0 if state.kind is StateKind.CONV_SD else 1), state.state_len
            if bias >= length:
                raise ValueError(f"token bias {bias} is outside [0, {length}) (conv state_len of "
                                 f"layer {state.layer or '?'})")
            staged.extend((tensor[d].narrow(axis, 0, length - bias),
                           tensor[s].narrow(axis, bias, length - bias).clone())
                          for s, d in zip(src_ids, dst_ids))
    for target, value in staged:
        target.copy_(value)


def _device_row_moves(states: Sequence[MambaStateTensor], moves: RowMoves) -> None:
    """Index tensors on a device: every row is gathered and written back, nothing is read on the
    host; a row that moves nothing writes the first moving row's block with that row's new
    value (the same bytes twice)."""
    staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for state in states:
        tensor = state.tensor
        (src, dst), shift = moves.of(state), moves.shift
        src, dst, shift = (t.to(tensor.device, non_blocking=True) for t in (src, dst, shift))
        moving = dst >= 0
        src, dst = src.clamp(min=0), dst.clamp(min=0)
        old, new = tensor.index_select(0, dst), tensor.index_select(0, src)
        if state.kind.is_conv:
            axis = 1 if state.kind is StateKind.CONV_SD else 2
            length = tensor.shape[axis]
            pos = torch.arange(length, device=tensor.device)[None, :] + shift[:, None]
            shape = [-1, 1, 1]
            shape[axis] = length
            pos = pos.view(*shape).expand_as(new)
            new = torch.where(pos < length, torch.gather(new, axis, pos.clamp(max=length - 1)), old)
        keep = moving.view(-1, *([1] * (new.dim() - 1)))
        new = torch.where(keep, new, old)
        first = torch.argmax(moving.to(torch.int32)).view(1)  # a tensor index: no host read
        dst = torch.where(moving, dst, dst.index_select(0, first))
        new = torch.where(keep, new, new.index_select(0, first))
        staged.append((tensor, dst, new))
    for tensor, dst, new in staged:
        tensor.index_copy_(0, dst, new)


def precopy_running_states(
    states: Sequence[MambaStateTensor],
    block_tables: Sequence[torch.Tensor],
    src_cols: torch.Tensor,
    dst_cols: torch.Tensor,
    token_bias: torch.Tensor,
) -> None:
    apply_row_moves(states, plan.precopy_moves(block_tables, src_cols, dst_cols, token_bias))


def postprocess_accepted_states(
    states: Sequence[MambaStateTensor],
    block_tables: Sequence[torch.Tensor],
    running_cols: torch.Tensor,
    num_running_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    block_size: int,
    num_accepted_out: torch.Tensor,
) -> None:
    moves, reset = plan.postprocess_moves(block_tables, running_cols, num_running_tokens,
                                          num_accepted, block_size)
    apply_row_moves(states, moves)
    plan.apply_reset(num_accepted_out, reset)


def store_checkpoints(
    states: Sequence[MambaStateTensor], sources: Sequence[torch.Tensor], checkpoints: CheckpointBatch
) -> None:
    staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # read everything, then write
    for state, source in zip(states, sources):
        tensor = state.tensor
        dst = checkpoints.dst_block.to(tensor.device, torch.long, non_blocking=True)
        if not state.kind.is_conv:
            rows = checkpoints.temporal_row.to(source.device, torch.long, non_blocking=True)
            staged.append((tensor, dst, source.index_select(0, rows).to(tensor.device)))
            continue
        length, device = state.state_len, source.device
        end, start = (getattr(checkpoints, f).to(device, torch.long, non_blocking=True)[:, None]
                      for f in ("token_end", "seq_start"))
        pos = end - length + torch.arange(length, device=device)[None, :]  # input row of each slot
        from_input = (pos >= start)[:, :, None]
        if source.shape[0]:
            taken = source[pos.clamp(0, source.shape[0] - 1)]  # [K, L, dim]
        else:
            taken = source.new_zeros((pos.shape[0], length, source.shape[1]))
        # slots before the sequence start: the tail of the initial block's window, or zeros
        initial = checkpoints.initial_block.to(tensor.device, torch.long, non_blocking=True)
        previous = tensor.index_select(0, initial.clamp(min=0))
        if state.kind is StateKind.CONV_DS:
            previous = previous.transpose(1, 2)
        at = (length + pos - start).clamp(0, length - 1).to(tensor.device)
        previous = torch.gather(previous, 1, at[:, :, None].expand(-1, -1, previous.shape[2]))
        previous = torch.where((initial >= 0)[:, None, None], previous.to(source.dtype).to(device), 0)
        window = torch.where(from_input, taken, previous)
        if state.kind is StateKind.CONV_DS:
            window = window.transpose(1, 2)
        staged.append((tensor, dst, window.to(tensor.device)))
    for tensor, dst, value in staged:
        _write_kept_blocks(tensor, dst, value.to(tensor.dtype))


def _write_kept_blocks(tensor: torch.Tensor, dst: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor[dst[k]] = value[k]`` for every ``dst[k] >= 0``; negative destinations are
    skipped without reading ``dst`` on the host: each skipped row writes its block's value back
    (block 0's, or the checkpoint that writes that block), so duplicate indices agree."""
    kept = dst >= 0
    block = dst.clamp(min=0)
    writer = torch.full((tensor.shape[0],), -1, dtype=torch.long, device=tensor.device)
    order = torch.arange(dst.shape[0], device=tensor.device)
    writer.scatter_reduce_(0, block, torch.where(kept, order, -1), reduce="amax")
    written_by = writer.index_select(0, block)
    shape = (-1,) + (1,) * (tensor.dim() - 1)
    final = torch.where((written_by >= 0).view(shape), value.index_select(0, written_by.clamp(min=0)),
                        tensor.index_select(0, block))
    tensor.index_copy_(0, block, final)


def gather_aligned_state_indices(
    block_tables: Sequence[torch.Tensor], seq_lens: torch.Tensor, block_size: int, num_slots: int
) -> torch.Tensor:
    device = block_tables[0].device
    first = ((seq_lens.to(device=device, dtype=torch.long) - 1) // block_size).clamp(min=0)
    cols = first[:, None] + torch.arange(num_slots, device=device)[None, :]
    out = []
    for table in block_tables:
        width = table.shape[1]
        valid = cols < width
        gathered = torch.gather(table.long(), 1, cols.clamp(max=width - 1))
        out.append(torch.where(valid, gathered, torch.full_like(gathered, PAD_BLOCK_ID)))
    return torch.stack(out).to(torch.int32)


# ---- hook implementations -------------------------------------------------------------------


@hookimpl
def hb_backend_identity() -> BackendIdentity:
    return BackendIdentity(
        name=NAME,
        device_kind=DeviceKind.CPU,
        priority=0,
        description="pure-torch reference; runs on any device's tensors; the oracle",
    )


@hookimpl
def hb_backend_probe() -> Availability:
    return Availability(True, "pure torch: available on every device")


@hookimpl(trylast=True)
def hb_select_backend(requested: str, device_kind: str, candidates: Sequence[BackendStatus]) -> str:
    if requested != "auto":
        return requested
    fitting = [
        c
        for c in candidates
        if c.availability.available and c.identity.device_kind.value == device_kind
    ]
    if fitting:
        return max(fitting, key=lambda c: c.identity.priority).name
    return NAME


@hookimpl
def hb_copy_state_blocks(states, src_blocks, dst_blocks) -> None:
    copy_state_blocks(states, src_blocks, dst_blocks)


@hookimpl
def hb_precopy_running_states(states, block_tables, src_cols, dst_cols, token_bias) -> None:
    precopy_running_states(states, block_tables, src_cols, dst_cols, token_bias)


@hookimpl
def hb_postprocess_accepted_states(
    states, block_tables, running_cols, num_running_tokens, num_accepted, block_size, num_accepted_out
) -> None:
    postprocess_accepted_states(
        states, block_tables, running_cols, num_running_tokens, num_accepted, block_size, num_accepted_out
    )


@hookimpl
def hb_store_checkpoints(states, sources, checkpoints) -> None:
    store_checkpoints(states, sources, checkpoints)


@hookimpl
def hb_gather_aligned_state_indices(block_tables, seq_lens, block_size, num_slots) -> torch.Tensor:
    return gather_aligned_state_indices(block_tables, seq_lens, block_size, num_slots)


@hookimpl
def hb_kernel_overrides(platform_name: str) -> None:
    """The reference reaches vLLM through patch modules, not Triton-kernel overrides."""
    return None
