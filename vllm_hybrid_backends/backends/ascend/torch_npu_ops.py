"""The ``ascend`` backend's torch path: plain torch ops on NPU tensors, for the 310P (no Triton)
and for state tensors no 2-D region describes.

Nothing here imports torch_npu: the ops are ordinary torch ops (``index_select``,
``index_copy_``, indexed assignment, ``gather``) that torch_npu dispatches to the NPU, and that
run unchanged on CPU tensors, which is how they are tested. Work is vectorised over requests; the
only Python loops are over layers, distinct token biases and (with duplicate destinations,
never in vLLM) write rounds.

Which rows move, with which bias, into which blocks is decided on the host by ``backend.py``;
these functions only execute it, reading every source before writing any destination.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...types import MambaStateTensor, StateKind

ZERO, INPUT, STATE = 0, 1, 2
"""Where a conv-window row comes from (same codes as ``kernels.py``)."""


def _index(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(device)


def copy_blocks(state: MambaStateTensor, src_blocks: torch.Tensor, dst_blocks: torch.Tensor) -> None:
    """``state[dst] = state[src]`` for whole blocks; the gather copies before the scatter writes."""
    tensor = state.tensor
    src = src_blocks.to(device=tensor.device, dtype=torch.long)
    dst = dst_blocks.to(device=tensor.device, dtype=torch.long)
    tensor.index_copy_(0, dst, tensor.index_select(0, src))


def shift_copy(state: MambaStateTensor, src_blocks: np.ndarray, dst_blocks: np.ndarray,
               biases: np.ndarray, rounds: np.ndarray) -> None:
    """Per row ``i``: conv window of block ``src_blocks[i]`` shifted left by ``biases[i]`` tokens
    (or the whole temporal block) into ``dst_blocks[i]``; rows of a later round write later."""
    tensor, device = state.tensor, state.tensor.device
    groups = np.unique(biases) if state.kind.is_conv else np.zeros(1, np.int64)
    writes: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    for bias in (int(b) for b in groups):
        rows = np.flatnonzero(biases == bias) if state.kind.is_conv else np.arange(len(src_blocks))
        values = tensor.index_select(0, _index(src_blocks[rows], device))
        if state.kind is StateKind.CONV_SD:
            values = values[:, bias:]
        elif state.kind is StateKind.CONV_DS:
            values = values[:, :, bias:]
        for round_ in np.unique(rounds[rows]):
            members = np.flatnonzero(rounds[rows] == round_)
            writes.append((int(round_), bias, _index(dst_blocks[rows][members], device),
                           values.index_select(0, _index(members, device))))
    for _, bias, dst, values in sorted(writes, key=lambda w: w[0]):
        if state.kind is StateKind.CONV_SD:
            tensor[dst, : state.state_len - bias] = values
        elif state.kind is StateKind.CONV_DS:
            tensor[dst, :, : state.state_len - bias] = values
        else:
            tensor.index_copy_(0, dst, values)


def store_conv_windows(state: MambaStateTensor, source: torch.Tensor, dst_blocks: np.ndarray,
                       kind: np.ndarray, index: np.ndarray, row: np.ndarray) -> None:
    """Write whole conv windows: window ``w`` row ``p`` is zeros, input row ``index[w, p]`` or
    row ``row[w, p]`` of block ``index[w, p]``'s window, assembled in the input's dtype (as the
    reference does) and stored in the state's dtype and layout."""
    tensor, device = state.tensor, state.tensor.device
    inputs = np.unique(index[kind == INPUT])
    pairs = np.unique(np.stack([index[kind == STATE], row[kind == STATE]], axis=1), axis=0)
    blocks, positions = _index(pairs[:, 0], device), _index(pairs[:, 1], device)
    if state.kind is StateKind.CONV_SD:
        state_rows = tensor[blocks, positions]
    else:
        state_rows = tensor[blocks, :, positions]
    pool = torch.cat([source.new_zeros((1, source.shape[1])),
                      source.index_select(0, _index(inputs, source.device)),
                      state_rows.to(device=source.device, dtype=source.dtype)])
    input_slot = 1 + np.searchsorted(inputs, index)
    state_slot = 1 + len(inputs) + _pair_slot(pairs, index, row)
    slots = np.where(kind == INPUT, input_slot, np.where(kind == STATE, state_slot, 0))
    windows = pool[_index(slots, source.device)].to(device=device, dtype=tensor.dtype)
    if state.kind is StateKind.CONV_DS:
        windows = windows.transpose(1, 2)
    tensor[_index(dst_blocks, device)] = windows


def _pair_slot(pairs: np.ndarray, index: np.ndarray, row: np.ndarray) -> np.ndarray:
    """Position of each ``(index, row)`` in the sorted unique ``pairs`` (0 where absent)."""
    if len(pairs) == 0:
        return np.zeros_like(index)
    span = int(max(pairs[:, 1].max(), row.max())) + 1
    keys = pairs[:, 0] * span + pairs[:, 1]
    found = np.searchsorted(keys, index * span + row)
    return np.minimum(found, len(keys) - 1)


def store_temporal(state: MambaStateTensor, source: torch.Tensor, dst_blocks: np.ndarray,
                   source_rows: np.ndarray) -> None:
    """``state[dst_blocks[i]] = source[source_rows[i]]`` cast to the state's dtype."""
    tensor = state.tensor
    values = source.index_select(0, _index(source_rows, source.device))
    tensor[_index(dst_blocks, tensor.device)] = values.to(device=tensor.device, dtype=tensor.dtype)


def gather_aligned_state_indices(block_tables: Sequence[torch.Tensor], seq_lens: torch.Tensor,
                                 block_size: int, num_slots: int) -> torch.Tensor:
    """All groups' aligned state block ids, ``-1`` past a table's width, as int32."""
    device = block_tables[0].device
    lengths = seq_lens.to(device=device, dtype=torch.long)
    first = torch.div(lengths - 1, block_size, rounding_mode="floor").clamp_min(0)
    cols = first[:, None] + torch.arange(num_slots, device=device)[None, :]
    out = torch.full((len(block_tables), lengths.shape[0], num_slots), -1, dtype=torch.int32,
                     device=device)
    for group, table in enumerate(block_tables):
        width = table.shape[1]
        if width == 0:
            continue
        ids = table.gather(1, cols.clamp(max=width - 1)).to(torch.int32)
        out[group] = torch.where(cols < width, ids, out[group])
    return out
