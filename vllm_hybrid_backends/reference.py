"""The ``cpu`` backend: every hook in pure torch, on tensors of any device.

It is the backend used on CPU and the oracle every device backend is tested against, so it
favours obviously-correct code over speed: all sources are gathered before any destination is
written (snapshot semantics, see :mod:`.hookspecs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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


def _shifted_copies(
    states: Sequence[MambaStateTensor],
    block_tables: Sequence[torch.Tensor],
    rows: list[int],
    src_cols: list[int],
    dst_cols: list[int],
    biases: list[int],
) -> None:
    """Copy state (column ``src``, bias ``b``) → column ``dst`` for each listed request row."""
    staged: list[tuple[MambaStateTensor, int, torch.Tensor]] = []
    for state in states:
        table = block_tables[state.group]
        for row, src, dst, bias in zip(rows, src_cols, dst_cols, biases):
            dst_block = int(table[row, dst])
            if state.kind.is_conv:
                length = state.state_len
                if not 0 <= bias < length:
                    raise ValueError(
                        f"token bias {bias} of request row {row} is outside [0, {length}) "
                        f"(conv state_len of layer {state.layer or '?'})"
                    )
                source = _window(state, int(table[row, src]), bias, length).clone()
            else:
                source = state.tensor[int(table[row, src + bias])].clone()
            staged.append((state, dst_block, source))
    for state, dst_block, source in staged:
        if state.kind.is_conv:
            _window(state, dst_block, 0, source.shape[0 if state.kind is StateKind.CONV_SD else 1]).copy_(source)
        else:
            state.tensor[dst_block].copy_(source)


def precopy_running_states(
    states: Sequence[MambaStateTensor],
    block_tables: Sequence[torch.Tensor],
    src_cols: torch.Tensor,
    dst_cols: torch.Tensor,
    token_bias: torch.Tensor,
) -> None:
    rows, srcs, dsts, biases = [], [], [], []
    for row, (src, dst, bias) in enumerate(zip(src_cols.tolist(), dst_cols.tolist(), token_bias.tolist())):
        if src < 0 or (src == dst and bias == 0):
            continue
        rows.append(row)
        srcs.append(src)
        dsts.append(dst)
        biases.append(bias)
    _shifted_copies(states, block_tables, rows, srcs, dsts, biases)


def postprocess_accepted_states(
    states: Sequence[MambaStateTensor],
    block_tables: Sequence[torch.Tensor],
    running_cols: torch.Tensor,
    num_running_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    block_size: int,
    num_accepted_out: torch.Tensor,
) -> None:
    rows, srcs, dsts, biases, reset = [], [], [], [], []
    for row, (src, running, accepted) in enumerate(
        zip(running_cols.tolist(), num_running_tokens.tolist(), num_accepted.tolist())
    ):
        aligned = (running + accepted - 1) // block_size * block_size
        if aligned < running:
            continue
        bias = aligned - running
        dst = aligned // block_size - 1
        if src == dst:
            reset.append(row)
            if bias == 0:
                continue
        rows.append(row)
        srcs.append(src)
        dsts.append(dst)
        biases.append(bias)
    _shifted_copies(states, block_tables, rows, srcs, dsts, biases)
    if reset:
        num_accepted_out[torch.tensor(reset, device=num_accepted_out.device)] = 1


def store_checkpoints(
    states: Sequence[MambaStateTensor], sources: Sequence[torch.Tensor], checkpoints: CheckpointBatch
) -> None:
    token_end = checkpoints.token_end.tolist()
    seq_start = checkpoints.seq_start.tolist()
    initial = checkpoints.initial_block.tolist()
    dst_blocks = checkpoints.dst_block.tolist()
    temporal_rows = checkpoints.temporal_row.tolist()
    staged: list[tuple[MambaStateTensor, int, torch.Tensor]] = []  # read everything, then write
    for state, source in zip(states, sources):
        for k, dst in enumerate(dst_blocks):
            if not state.kind.is_conv:
                staged.append((state, dst, source[temporal_rows[k]]))
                continue
            length = state.state_len
            end, start = token_end[k], seq_start[k]
            from_input = source[max(end - length, start) : end]  # [rows, dim]
            missing = length - from_input.shape[0]
            if missing:
                if initial[k] >= 0:
                    prefix = _window(state, initial[k], length - missing, length)
                    if state.kind is StateKind.CONV_DS:
                        prefix = prefix.transpose(0, 1)
                    prefix = prefix.to(from_input.dtype)
                else:
                    prefix = from_input.new_zeros((missing, from_input.shape[1]))
                from_input = torch.cat([prefix, from_input], dim=0)
            else:
                from_input = from_input.clone()
            window = from_input if state.kind is StateKind.CONV_SD else from_input.transpose(0, 1)
            staged.append((state, dst, window))
    for state, dst, value in staged:
        state.tensor[dst].copy_(value)


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
