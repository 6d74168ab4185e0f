"""Triton kernels for the Mamba state operations of the Triton backend (``cuda`` and ``rocm``).

The kernels are the same for both vendors; each call takes the launch shapes of the vendor's
tuning table (:mod:`.tuning`). This module imports ``triton`` at import time, so the backend
imports it lazily, the first time a hook runs.

How the work is laid out (the same for every hook):

- A call is turned, on the host, into *segments*: one per (state tensor, copy mode), each with the
  tensor's base address and strides, and a shared list of *items* (source block, destination
  block, token shift). One launch then covers every layer and every group of the step: program
  ``p`` finds its segment by comparing ``p`` with the segments' first program ids (one vector
  load), then its item and its tile inside the item.
- Addresses are int64. The copy and checkpoint kernels address memory as offsets from a tensor
  argument (an *anchor*): a kernel argument is known to be 16-byte aligned, so offsets hinted as
  multiples of 16 bytes give 16-byte vector loads and stores. The gather and ``batch_memcpy``
  kernels cast one scalar address to a pointer, then add offsets (never a vector of integers
  cast to pointers).
- Copies move raw bits as integer words, the widest of 8/4/2/1 bytes that the addresses, strides
  and sizes allow, so fp32/fp16/bf16 states are copied bit for bit. Only the checkpoint store
  converts dtypes, with torch's rounding (round-to-nearest-even, done in integer arithmetic so the
  Triton interpreter and the GPU agree).
- Snapshot semantics (every read before any write), as the hook specs require:
  * a block that is read by one move and written by another (a chain or a cycle) is staged: a
    first launch copies the endangered sources into a scratch buffer and the main launch reads
    them from there. Only those blocks travel twice; when no block is both, there is one launch.
  * an in-place conv-window shift (source and destination are the same block) is done by one
    program per channel tile that loads the whole window, waits at a barrier, then stores:
    reads and writes of different programs never touch the same bytes (vLLM #50729 was a race
    between overlapping same-block copies).
- Host work per call is kept small: the segment tables of a list of states are laid out once
  (:func:`_cached_launches`; vLLM passes the same states every step) and each call only adds
  its items; the tables and any host items travel to the device in one pinned copy.
- ``hb_copy_state_blocks`` reads its block ids on the host (the V1 copy patch passes host
  tensors; snapshot semantics needs them there: which blocks are both read and written decides
  the staging). The per-step hooks take their plan from :mod:`..plan`, on the device.

``TRITON_INTERPRET=1`` set before this module is imported makes the kernels run on CPU tensors
(the parity tests do this); without it they need CUDA/HIP tensors.
"""

from __future__ import annotations

import collections
import math
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

from ...device import host_ints, to_device
from ...types import CheckpointBatch, MambaStateTensor, StateKind
from .. import plan
from .tuning import LaunchTuning

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
"""The kernels of this module object were built for the Triton interpreter (CPU tensors)."""

launch_counts: collections.Counter[str] = collections.Counter()
"""Kernel launches made by this process, by kernel name (routing tests read it)."""


# ---- kernel constants -------------------------------------------------------------------------

_NEVER = tl.constexpr(2**62)  # first-program id of a padding segment: never <= a program id

# fields of a segment (table is field-major: field f of segment s at f * S + s); strides are in
# elements of the kernel's word; the checkpoint kernel reads _SRC_BLOCK / _SRC_CHAN as the row /
# channel stride of its source
_SRC_BASE = tl.constexpr(0)
_SRC_BLOCK = tl.constexpr(1)
_SRC_TOK = tl.constexpr(2)
_SRC_CHAN = tl.constexpr(3)
_DST_BASE = tl.constexpr(4)
_DST_BLOCK = tl.constexpr(5)
_DST_TOK = tl.constexpr(6)
_DST_CHAN = tl.constexpr(7)
_TOKENS = tl.constexpr(8)
_CHANNELS = tl.constexpr(9)
_ITEM0 = tl.constexpr(10)
_TILES = tl.constexpr(11)
_PROG0 = tl.constexpr(12)
_MODE = tl.constexpr(13)
_SHIFT_MUL = tl.constexpr(14)  # words per token of a window segment's shift (1 unless DS splits a token)
_NUM_FIELDS = 15

MODE_FLAT = 0  # whole blocks: `channels` words from each block's start
MODE_WINDOW = 1  # conv window: tokens [shift, L) -> [0, L - shift), every channel

# dtype kinds of the checkpoint store
_K_F32 = tl.constexpr(0)
_K_F16 = tl.constexpr(1)
_K_BF16 = tl.constexpr(2)
_K_RAW = tl.constexpr(3)  # same dtype on both sides: bits are copied, whatever the dtype


# ---- kernels ----------------------------------------------------------------------------------


# tl.sum is a jit function of triton.language.standard, built when triton was first imported:
# if TRITON_INTERPRET was set only later (for this module), it cannot run in interpreted kernels,
# which then count segments with a scalar loop instead (SUM_OK=False).
SUM_OK = tl.constexpr(not INTERPRETED or type(tl.sum).__name__ == "InterpretedFunction")


@triton.jit
def _find_segment(table, num_segments, pid, SEG_P2: tl.constexpr):
    """Index of the segment whose program range holds ``pid`` (ranges are sorted)."""
    if SUM_OK:
        offs = tl.arange(0, SEG_P2)
        first = tl.load(table + _PROG0 * num_segments + offs, mask=offs < num_segments, other=_NEVER)
        return tl.sum((first <= pid).to(tl.int32), axis=0) - 1
    else:
        seg = 0
        for s in range(1, num_segments):
            if tl.load(table + _PROG0 * num_segments + s) <= pid:
                seg = s
        return seg


@triton.jit
def _state_copy_kernel(
    words, table, items, num_segments, num_items,
    VEC: tl.constexpr, SEG_P2: tl.constexpr, FLAT_BLOCK: tl.constexpr,
    FLAT_STEPS: tl.constexpr, WIN_T: tl.constexpr, WIN_C: tl.constexpr,
):
    """Block and conv-window copies of every segment; one program per (item, tile).

    ``words`` is a tensor of the word dtype; every address is a word offset from it. As a kernel
    argument it is known to be 16-byte aligned, so with offsets hinted as multiples of ``VEC``
    words whole-block copies use 16-byte vector loads and stores.
    """
    pid = tl.program_id(0).to(tl.int64)
    seg = _find_segment(table, num_segments, pid, SEG_P2)
    row = table + seg
    tiles = tl.load(row + _TILES * num_segments)
    local = pid - tl.load(row + _PROG0 * num_segments)
    item = tl.load(row + _ITEM0 * num_segments) + local // tiles
    tile = local % tiles
    src_block = tl.load(items + item)
    dst_block = tl.load(items + num_items + item)
    shift = tl.load(items + 2 * num_items + item) * tl.load(row + _SHIFT_MUL * num_segments)
    src_at = tl.load(row + _SRC_BASE * num_segments) + src_block * tl.load(row + _SRC_BLOCK * num_segments)
    dst_at = tl.load(row + _DST_BASE * num_segments) + dst_block * tl.load(row + _DST_BLOCK * num_segments)
    # a row the plan does not move (dst -1) copies nothing
    channels = tl.where(dst_block >= 0, tl.load(row + _CHANNELS * num_segments), 0)
    # (names differ between the branches: Triton merges a name assigned in both into one type)
    if tl.load(row + _MODE * num_segments) == 0:
        start = tile * (FLAT_BLOCK * FLAT_STEPS)
        flat_src = words + tl.multiple_of(src_at + start, VEC)
        flat_dst = words + tl.multiple_of(dst_at + start, VEC)
        remaining = tl.multiple_of(channels - start, VEC)
        lanes = tl.arange(0, FLAT_BLOCK)
        for step in tl.static_range(FLAT_STEPS):
            offs = step * FLAT_BLOCK + lanes
            in_block = offs < remaining
            tl.store(flat_dst + offs, tl.load(flat_src + offs, mask=in_block), mask=in_block)
    else:
        tokens = tl.load(row + _TOKENS * num_segments)
        t = tl.arange(0, WIN_T).to(tl.int64)[:, None]
        c = tile * WIN_C + tl.arange(0, WIN_C).to(tl.int64)[None, :]
        in_window = (t < tokens - shift) & (c < channels)
        src_offs = (t + shift) * tl.load(row + _SRC_TOK * num_segments)
        src_offs += c * tl.load(row + _SRC_CHAN * num_segments)
        window = tl.load(words + src_at + src_offs, mask=in_window)
        # the tile holds every token of its channels: once all lanes have loaded, no store can
        # clobber a value another lane still has to read (in-place shifts are memmove-safe)
        tl.debug_barrier()
        dst_offs = t * tl.load(row + _DST_TOK * num_segments) + c * tl.load(row + _DST_CHAN * num_segments)
        tl.store(words + dst_at + dst_offs, window, mask=in_window)


@triton.jit
def _bits_to_f32(bits, KIND: tl.constexpr):
    if KIND == _K_F32:
        return bits.to(tl.float32, bitcast=True)
    elif KIND == _K_F16:
        return bits.to(tl.float16, bitcast=True).to(tl.float32)
    else:  # bf16: the upper half of an fp32
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bits(value, KIND: tl.constexpr):
    if KIND == _K_F32:
        return value.to(tl.uint32, bitcast=True)
    elif KIND == _K_F16:
        return value.to(tl.float16).to(tl.uint16, bitcast=True)
    else:
        # bf16, round to nearest even exactly as torch does (NaN -> 0x7FC0)
        u = value.to(tl.uint32, bitcast=True)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return tl.where(value != value, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def _convert_bits(bits, SRC_KIND: tl.constexpr, DST_KIND: tl.constexpr):
    if SRC_KIND == DST_KIND:
        return bits
    else:
        return _f32_to_bits(_bits_to_f32(bits, SRC_KIND), DST_KIND)


@triton.jit
def _checkpoint_kernel(
    src_words, dst_words, table, items, num_segments, num_items,
    SRC_KIND: tl.constexpr, DST_KIND: tl.constexpr, VEC_SRC: tl.constexpr, VEC_DST: tl.constexpr,
    VEC_MASK: tl.constexpr, SEG_P2: tl.constexpr, WIN_T: tl.constexpr, WIN_C: tl.constexpr,
    FLAT_BLOCK: tl.constexpr,
):
    """Checkpoint stores: conv windows from the token-major input, temporal rows, cast.

    Addresses are element offsets from ``src_words`` / ``dst_words`` (unsigned tensors of the
    source's / the state's element size), as in :func:`_state_copy_kernel`.
    """
    pid = tl.program_id(0).to(tl.int64)
    seg = _find_segment(table, num_segments, pid, SEG_P2)
    row = table + seg
    tiles = tl.load(row + _TILES * num_segments)
    local = pid - tl.load(row + _PROG0 * num_segments)
    item = tl.load(row + _ITEM0 * num_segments) + local // tiles
    tile = local % tiles
    dst_block = tl.load(items + item)
    states_at = tl.load(row + _DST_BASE * num_segments)
    block_stride = tl.load(row + _DST_BLOCK * num_segments)
    dst_at = states_at + dst_block * block_stride
    src_at = tl.load(row + _SRC_BASE * num_segments)
    channels = tl.load(row + _CHANNELS * num_segments)
    if tl.load(row + _MODE * num_segments) == 0:
        # temporal: row `temporal_row` of the source, contiguous, same trailing shape
        start = tile * FLAT_BLOCK
        src_row = tl.load(items + 4 * num_items + item)
        row_at = src_at + src_row * tl.load(row + _SRC_BLOCK * num_segments) + start
        flat_src = src_words + tl.multiple_of(row_at, VEC_SRC)
        flat_dst = dst_words + tl.multiple_of(dst_at + start, VEC_DST)
        remaining = tl.multiple_of(channels - start, VEC_MASK)
        lanes = tl.arange(0, FLAT_BLOCK)
        # a negative destination is a skipped checkpoint (compared as a tensor, see below)
        in_block = (lanes < remaining) & (tl.full(lanes.shape, 0, tl.int64) + dst_block >= 0)
        bits = tl.load(flat_src + lanes, mask=in_block)
        tl.store(flat_dst + lanes, _convert_bits(bits, SRC_KIND, DST_KIND), mask=in_block)
    else:
        end = tl.load(items + num_items + item)
        begin = tl.load(items + 2 * num_items + item)
        initial = tl.load(items + 3 * num_items + item)
        length = tl.load(row + _TOKENS * num_segments)
        tok = tl.load(row + _DST_TOK * num_segments)
        chan = tl.load(row + _DST_CHAN * num_segments)
        t = tl.arange(0, WIN_T).to(tl.int64)[:, None]
        c = tile * WIN_C + tl.arange(0, WIN_C).to(tl.int64)[None, :]
        valid = (t < length) & (c < channels) & (tl.full(t.shape, 0, tl.int64) + dst_block >= 0)
        token = end - length + t  # row of the token-major input this position holds
        from_input = valid & (token >= begin)
        x_offs = token * tl.load(row + _SRC_BLOCK * num_segments) + c * tl.load(row + _SRC_CHAN * num_segments)
        x_bits = tl.load(src_words + src_at + x_offs, mask=from_input, other=0)
        value = _convert_bits(x_bits, SRC_KIND, DST_KIND)
        # positions before the sequence start: the tail of the initial block's window, cast
        # through the input dtype and back as the reference concatenates it; zeros without one
        # (initial >= 0 compared as a tensor: the interpreter mis-types scalar & tensor masks)
        from_initial = valid & (token < begin) & (tl.full(token.shape, 0, tl.int64) + initial >= 0)
        initial_offs = initial * block_stride + (length + token - begin) * tok + c * chan
        p_bits = tl.load(dst_words + states_at + initial_offs, mask=from_initial, other=0)
        p_value = _convert_bits(_convert_bits(p_bits, DST_KIND, SRC_KIND), SRC_KIND, DST_KIND)
        out = tl.where(from_input, value, tl.where(from_initial, p_value, tl.full(value.shape, 0, value.dtype)))
        tl.store(dst_words + dst_at + t * tok + c * chan, out, mask=valid)


@triton.jit
def _gather_indices_kernel(
    table_addrs, widths, row_strides, col_strides, seq_lens, out, num_rows, num_slots,
    block_size, TABLE_T: tl.constexpr, ROWS: tl.constexpr, SLOTS: tl.constexpr,
):
    """out[g, r, j] = table_g[r, max((seq_lens[r] - 1) // block_size, 0) + j], -1 past the width."""
    group = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)[:, None]
    slots = tl.arange(0, SLOTS).to(tl.int64)[None, :]
    table = tl.load(table_addrs + group).to(tl.pointer_type(TABLE_T))
    width = tl.load(widths + group)
    in_range = (rows < num_rows) & (slots < num_slots)
    lens = tl.load(seq_lens + rows, mask=rows < num_rows, other=0).to(tl.int64)
    # C division truncates where Python floors, but both clamp to 0 for lens < 1
    first = tl.maximum((lens - 1) // block_size, 0)
    col = first + slots
    valid = in_range & (col < width)
    offs = rows * tl.load(row_strides + group) + col * tl.load(col_strides + group)
    ids = tl.load(table + offs, mask=valid, other=0).to(tl.int32)
    result = tl.where(valid, ids, -1)
    tl.store(out + (group * num_rows + rows) * num_slots + slots, result, mask=in_range)


@triton.jit
def _move_chunk(src, dst, start, size, BLOCK: tl.constexpr, ORDERED: tl.constexpr):
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    keep = offs < size
    data = tl.load(src + offs, mask=keep)
    if ORDERED:
        tl.debug_barrier()  # the whole chunk is read before any lane writes
    tl.store(dst + offs, data, mask=keep)


@triton.jit
def _memmove_entry(src_addr, dst_addr, count, overlap, backward, part, WORD_T: tl.constexpr,
                   BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    """Copy ``count`` WORD_T elements; overlapping ranges are moved by one program, in order."""
    src = src_addr.to(tl.pointer_type(WORD_T))
    dst = dst_addr.to(tl.pointer_type(WORD_T))
    chunks = (count + BLOCK - 1) // BLOCK
    if overlap:
        if part == 0:
            # memmove: ascending when the destination is below the source, else descending;
            # a chunk's stores then only overwrite source bytes that are already read
            for k in range(0, chunks):
                chunk = tl.where(backward, chunks - 1 - k, k)
                _move_chunk(src, dst, chunk * BLOCK, count, BLOCK, True)
    else:
        for chunk in range(part, chunks, SPLIT):
            _move_chunk(src, dst, chunk * BLOCK, count, BLOCK, False)


@triton.jit
def _batch_memcpy_kernel(src_ptrs, dst_ptrs, sizes, CHUNK: tl.constexpr, SPLIT: tl.constexpr):
    """vLLM's ``batch_memcpy_kernel`` contract, overlap-safe; program (entry, part)."""
    entry = tl.program_id(0)
    part = tl.program_id(1).to(tl.int64)
    src_addr = tl.load(src_ptrs + entry).to(tl.int64)
    dst_addr = tl.load(dst_ptrs + entry).to(tl.int64)
    size = tl.load(sizes + entry).to(tl.int64)
    overlap = (dst_addr < src_addr + size) & (src_addr < dst_addr + size)
    backward = dst_addr > src_addr
    if (size > 0) & (src_addr != dst_addr):
        if ((src_addr | dst_addr | size) & 7) == 0:  # 8-byte words
            _memmove_entry(src_addr, dst_addr, size // 8, overlap, backward, part, tl.int64,
                           CHUNK // 8, SPLIT)
        else:
            _memmove_entry(src_addr, dst_addr, size, overlap, backward, part, tl.uint8, CHUNK, SPLIT)


# ---- host side: checks and shared helpers -----------------------------------------------------


def _check_device(tensor: torch.Tensor, what: str) -> None:
    """Raise unless ``tensor`` lives where this module's kernels can run."""
    if INTERPRETED:
        if tensor.device.type != "cpu":
            raise RuntimeError(
                f"{what} is on {tensor.device}, but the Triton kernels were built for the "
                "interpreter (TRITON_INTERPRET=1), which only runs on CPU tensors"
            )
        return
    if tensor.device.type != "cuda":
        raise RuntimeError(
            f"{what} is on {tensor.device}; the Triton kernels need CUDA/HIP tensors "
            "(set TRITON_INTERPRET=1 before the first hook call to run them on CPU tensors)"
        )
    current = triton.runtime.driver.active.get_current_device()
    if tensor.device.index not in (None, current):
        raise RuntimeError(
            f"{what} is on {tensor.device} but the current device is {current}; "
            "launch from the tensors' device"
        )


def device_target(device: torch.device) -> tuple[str, str]:
    """``(backend, arch)`` of the device the kernels run on: ("interpreter", "") under
    TRITON_INTERPRET, else Triton's target, e.g. ("cuda", "90") or ("hip", "gfx942")."""
    if INTERPRETED:
        return "interpreter", ""
    target = triton.runtime.driver.active.get_current_target()
    return str(target.backend), str(target.arch)


def _pow2_at_least(value: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, int(value) - 1).bit_length())


def _pow2_at_most(value: int) -> int:
    return 1 << (max(1, int(value)).bit_length() - 1)


def _widest_word(*byte_values: int) -> int:
    """Largest of 8, 4, 2, 1 that divides every value (addresses, strides, sizes in bytes)."""
    for word in (8, 4, 2):
        if all(v % word == 0 for v in byte_values):
            return word
    return 1


_WORD_DTYPES = {8: torch.uint64, 4: torch.uint32, 2: torch.uint16, 1: torch.uint8}
_anchors: dict[tuple[str, int], torch.Tensor] = {}


def _anchor(device: torch.device, word: int) -> torch.Tensor:
    """A one-element tensor of ``word``-byte unsigned ints: kernels address memory as offsets
    from it (a kernel argument is known to be 16-byte aligned, an address loaded from a table
    is not; see :func:`_state_copy_kernel`)."""
    key = (str(device), word)
    if key not in _anchors:
        _anchors[key] = torch.empty(1, dtype=_WORD_DTYPES[word], device=device)
    return _anchors[key]


def _offset_from(anchor: torch.Tensor, address: int, word: int) -> int:
    delta = address - anchor.data_ptr()
    assert delta % word == 0, f"address {address:#x} is not {word}-byte aligned"
    return delta // word


def _as_host_rows(tensor: torch.Tensor) -> list[Any]:
    """Index values as Python lists; only for tensors the caller has on the host."""
    return tensor.detach().to("cpu").tolist()


def _block_bytes(state: MambaStateTensor) -> int:
    return math.prod(state.tensor.shape[1:]) * state.tensor.element_size()


def _check_contiguous_blocks(state: MambaStateTensor) -> None:
    tensor = state.tensor
    if tensor.shape[0] and not tensor[0].is_contiguous():
        raise ValueError(
            f"state {state.layer or '?'} has non-contiguous blocks (strides {tuple(tensor.stride())}); "
            "the Triton kernels need each block's trailing dimensions contiguous, as vLLM lays them out"
        )


def _check_block_ids(ids: Sequence[int], state: MambaStateTensor, what: str) -> None:
    count = state.tensor.shape[0]
    for block in ids:
        if not 0 <= block < count:
            raise IndexError(
                f"{what} names block {block} of state {state.layer or '?'}; allowed 0..{count - 1}"
            )


def _check_unique_destinations(ids: Sequence[int], group: int, what: str) -> None:
    seen: set[int] = set()
    for block in ids:
        if block in seen:
            raise ValueError(
                f"{what}: group {group} writes block {block} twice; a destination block may "
                "appear at most once per group and call"
            )
        seen.add(block)


# ---- host side: block copies (copy_state_blocks, precopy, postprocess) -----------------------


@dataclass
class _Segment:
    fields: list[int]  # the _NUM_FIELDS values; bases are byte addresses until launch
    key: Hashable  # which items (source, destination, shift) the segment reads: see _run_launches
    word: int  # bytes per element moved (copies); element size of the state (checkpoints)
    window_tokens: int = 0  # L of a window segment (sizes the tile)
    aligned: bool | None = None  # flat segments: every access 16-byte aligned; windows: None


def _aligned16(*byte_values: int) -> bool:
    return all(v % 16 == 0 for v in byte_values)


def _launch_groups(segments: Sequence[_Segment], key: Any) -> dict[tuple[Any, bool], list[_Segment]]:
    """Segments by ``(key(segment), aligned)``; window segments join the aligned launch when
    there is one (the alignment hint only applies to flat accesses)."""
    flat: dict[tuple[Any, bool], list[_Segment]] = {}
    windows: dict[Any, list[_Segment]] = {}
    for segment in segments:
        if segment.aligned is None:
            windows.setdefault(key(segment), []).append(segment)
        else:
            flat.setdefault((key(segment), segment.aligned), []).append(segment)
    for k, group in windows.items():
        target = (k, (k, True) in flat or (k, False) not in flat)
        flat[target] = flat.get(target, []) + group
    return flat


@dataclass
class _MovePlan:
    """The moves of one group and state kind, shared by all its state tensors and planned once
    per call: ``dst <- src`` (conv windows shifted left by ``shift`` tokens), split by how each
    is done. Items are (source, destination, shift); staged items read scratch slot numbers."""

    direct_flat: list[tuple[int, int, int]] = field(default_factory=list)
    direct_window: list[tuple[int, int, int]] = field(default_factory=list)
    staged_flat: list[tuple[int, int, int]] = field(default_factory=list)
    staged_window: list[tuple[int, int, int]] = field(default_factory=list)
    staging: list[tuple[int, int, int]] = field(default_factory=list)  # (source, slot, 0)
    lowest: int = 0
    highest: int = -1


def _plan_moves(src: list[int], dst: list[int], shift: list[int]) -> _MovePlan:
    """Snapshot semantics: a source that another move overwrites is staged first."""
    plan = _MovePlan()
    if src:
        plan.lowest, plan.highest = min(min(src), min(dst)), max(max(src), max(dst))
    written = set(dst)
    for s, d, b in zip(src, dst, shift):
        if s == d and b == 0:
            continue  # a block onto itself
        if s in written and s != d:
            slot = len(plan.staging)
            plan.staging.append((s, slot, 0))
            (plan.staged_window if b else plan.staged_flat).append((slot, d, b))
        else:
            (plan.direct_window if b else plan.direct_flat).append((s, d, b))
    return plan


def _layout(state: MambaStateTensor) -> tuple[int, int, int, int, int]:
    """(base address, block stride, token stride, channel stride, state_len) in bytes/tokens."""
    tensor = state.tensor
    size = tensor.element_size()
    if state.kind is StateKind.CONV_SD:
        tok, chan, length = tensor.stride(1), tensor.stride(2), tensor.shape[1]
    elif state.kind is StateKind.CONV_DS:
        tok, chan, length = tensor.stride(2), tensor.stride(1), tensor.shape[2]
    else:
        tok, chan, length = 0, 1, 1
    return tensor.data_ptr(), tensor.stride(0) * size, tok * size, chan * size, length


def _flat_segment(src_base: int, src_block: int, dst_base: int, dst_block: int, nbytes: int,
                  key: Hashable) -> _Segment:
    word = _widest_word(src_base, src_block, dst_base, dst_block, nbytes)
    fields = [src_base, src_block // word, 0, 1, dst_base, dst_block // word, 0, 1,
              1, nbytes // word, 0, 0, 0, MODE_FLAT, 1]
    return _Segment(fields, key, word,
                    aligned=_aligned16(src_base, src_block, dst_base, dst_block, nbytes))


def _window_segment(state: MambaStateTensor, src_base: int, src_block: int, dst_base: int,
                    key: Hashable) -> _Segment:
    """Shifted conv-window copies; source may be a staged (contiguous) copy of the blocks."""
    base, block, tok, chan, length = _layout(state)
    size = state.tensor.element_size()
    dim = state.tensor.shape[2] if state.kind is StateKind.CONV_SD else state.tensor.shape[1]
    if chan == size:  # channels contiguous (SD): several channels may share one word
        word = _widest_word(src_base, src_block, dst_base, block, tok, dim * size)
        channels, chan_words, tokens, tok_words, per_token = dim * size // word, 1, length, tok // word, 1
    else:  # tokens contiguous (DS): a token is size // word words
        word = _widest_word(src_base, src_block, dst_base, block, chan, size)
        per_token = size // word
        channels, chan_words, tokens, tok_words = dim, chan // word, length * per_token, 1
    fields = [src_base, src_block // word, tok_words, chan_words, dst_base, block // word,
              tok_words, chan_words, tokens, channels, 0, 0, 0, MODE_WINDOW, per_token]
    return _Segment(fields, key, word, window_tokens=tokens)


@dataclass
class _Launch:
    """One launch of the copy kernel, laid out once: its segments' fields (bases as offsets from
    ``anchor``), tiles per item and item keys; :func:`_run_launches` adds the items."""

    anchor: torch.Tensor
    table: list[int]  # field-major segment table; the _ITEM0 and _PROG0 rows are set per call
    tiles: list[int]
    keys: list[Hashable]
    meta: dict[str, int]  # constexprs and launch options


def _compile_launches(segments: list[_Segment], tuning: LaunchTuning,
                      device: torch.device) -> list[_Launch]:
    """One launch per (word size, vector width) over all segments: usually one in all."""
    groups = _launch_groups(segments, lambda s: s.word)
    launches = []
    for word, aligned in sorted(groups, reverse=True):
        group = groups[(word, aligned)]
        anchor = _anchor(device, word)
        flat_block = _pow2_at_most(max(tuning.flat_step_bytes // word, tuning.lanes_per_warp))
        flat_tile = flat_block * tuning.flat_steps
        win_t = _pow2_at_least(max((s.window_tokens for s in group), default=1))
        win_c = _pow2_at_most(max(tuning.window_tile_bytes // (win_t * word), 16))
        columns, tiles = [], []
        for segment in group:
            fields = list(segment.fields)
            for at in (_SRC_BASE.value, _DST_BASE.value):
                fields[at] = _offset_from(anchor, fields[at], word)
            per_tile = flat_tile if fields[_MODE.value] == MODE_FLAT else win_c
            fields[_TILES.value] = max(1, -(-fields[_CHANNELS.value] // per_tile))
            columns.append(fields)
            tiles.append(fields[_TILES.value])
        table = [value for f in range(_NUM_FIELDS) for value in (col[f] for col in columns)]
        launches.append(_Launch(anchor, table, tiles, [s.key for s in group], dict(
            VEC=16 // word if aligned else 1, SEG_P2=_pow2_at_least(len(columns), 16),
            FLAT_BLOCK=flat_block, FLAT_STEPS=tuning.flat_steps, WIN_T=win_t, WIN_C=win_c,
            num_warps=tuning.num_warps, num_stages=tuning.num_stages)))
    return launches


def _run_launches(launches: list[_Launch], items: torch.Tensor,
                  spans: dict[Hashable, tuple[int, int]], device: torch.device) -> None:
    """Launch ``launches`` over ``items`` (int64 ``[3, N]``: sources, destinations, shifts, on the
    host or ``device``); a segment reads the items ``spans[key] = (first, count)``, none if its
    key is absent. Every segment table and host item goes to the device in one copy."""
    flat: list[int] = []
    runs = []
    for launch in launches:
        firsts, starts, programs = [], [], 0
        for tiles, key in zip(launch.tiles, launch.keys):
            first, count = spans.get(key, (0, 0))
            firsts.append(first)
            starts.append(programs)
            programs += tiles * count
        if programs:
            n = len(firsts)
            runs.append((launch, len(flat), n, programs))
            static = launch.table
            flat += static[: _ITEM0.value * n]
            flat += firsts
            flat += static[(_ITEM0.value + 1) * n: _PROG0.value * n]
            flat += starts
            flat += static[(_PROG0.value + 1) * n:]
    if not runs:
        return
    if items.device.type == "cpu":
        packed = to_device(torch.cat([torch.tensor(flat, dtype=torch.int64), items.reshape(-1)]),
                            device)
        tables, item_words = packed[: len(flat)], packed[len(flat):]
    else:
        tables = host_ints(flat, device)
        item_words = items.to(device=device, dtype=torch.int64).reshape(-1)
    for launch, at, num_segments, programs in runs:
        _state_copy_kernel[(programs,)](
            launch.anchor, tables[at: at + _NUM_FIELDS * num_segments], item_words, num_segments,
            items.shape[1], **launch.meta)
        launch_counts["state_copy"] += 1


_LAYOUT_CACHE_SIZE = 32
_layouts: dict[tuple[Any, ...], tuple[list[weakref.ref[MambaStateTensor]], list[_Launch]]] = {}


def _cached_launches(kind: str, states: Sequence[MambaStateTensor], tuning: LaunchTuning,
                     build: Any) -> list[_Launch]:
    """``build()``'s launches for these state objects, built once: vLLM passes the same states
    every step, and a state (frozen) keeps its tensor. An entry is dropped when one of its
    states dies, so ids in a key are never another object's."""
    device = INTERPRETED or triton.runtime.driver.active.get_current_device()
    # the tensors' addresses too: a tensor's storage can be swapped in place (``set_``)
    key = (kind, tuning, device, tuple(map(id, states)),
           tuple(state.tensor.data_ptr() for state in states))
    hit = _layouts.get(key)
    if hit is not None:
        return hit[1]
    launches = build()
    if len(_layouts) >= _LAYOUT_CACHE_SIZE:
        _layouts.pop(next(iter(_layouts)), None)

    def drop(_: object) -> None:
        _layouts.pop(key, None)

    _layouts[key] = ([weakref.ref(state, drop) for state in states], launches)
    return launches


def _check_states(states: Sequence[MambaStateTensor]) -> None:
    for state in states:
        _check_device(state.tensor, f"state {state.layer or '?'}")
        _check_contiguous_blocks(state)


def _host_items(lists: dict[Hashable, list[tuple[int, int, int]]]
                ) -> tuple[torch.Tensor, dict[Hashable, tuple[int, int]]]:
    """Host item lists -> one int64 ``[3, N]`` tensor and each key's span in it."""
    spans, rows, first = {}, [], 0
    for key, moves in lists.items():
        if moves:
            spans[key] = (first, len(moves))
            rows.extend(moves)
            first += len(moves)
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).T, spans


def _run_moves(states: Sequence[MambaStateTensor], plans: dict[int, _MovePlan],
               tuning: LaunchTuning) -> None:
    """Perform every planned move (see :func:`_plan_moves`): the staging launch, if any, then
    one launch for everything else. Without staging the launches are laid out once."""
    jobs = [(state, plans[state.group]) for state in states if plans[state.group].highest >= 0]
    if not jobs:
        return
    device = jobs[0][0].tensor.device
    for state, moves in jobs:
        _check_block_ids((moves.lowest, moves.highest), state, "a move")
    if not any(moves.staging or moves.direct_window for moves in plans.values()):
        def build() -> list[_Launch]:
            _check_states([state for state, _ in jobs])
            return _compile_launches([_copy_segment(state, ("direct", state.group))
                                      for state, _ in jobs], tuning, device)

        items, spans = _host_items({("direct", g): moves.direct_flat for g, moves in plans.items()})
        _run_launches(_cached_launches("copy", [state for state, _ in jobs], tuning, build),
                      items, spans, device)
        return
    _check_states([state for state, _ in jobs])
    pitches = [-(-_block_bytes(state) // 16) * 16 for state, _ in jobs]
    total = sum(len(moves.staging) * pitch for (_, moves), pitch in zip(jobs, pitches))
    scratch = torch.empty(total, dtype=torch.uint8, device=device)
    staging: list[_Segment] = []
    main: list[_Segment] = []
    offset = 0
    for (state, moves), pitch in zip(jobs, pitches):
        base, block, *_ = _layout(state)
        nbytes = _block_bytes(state)
        main.append(_flat_segment(base, block, base, block, nbytes, ("direct", state.group)))
        if moves.direct_window:
            main.append(_window_segment(state, base, block, base, ("direct_window", state.group)))
        if moves.staging:
            staged = scratch.data_ptr() + offset
            offset += len(moves.staging) * pitch
            staging.append(_flat_segment(base, block, staged, pitch, nbytes, ("staging", state.group)))
            main.append(_flat_segment(staged, pitch, base, block, nbytes, ("staged", state.group)))
            if moves.staged_window:
                main.append(_window_segment(state, staged, pitch, base,
                                            ("staged_window", state.group)))
    lists: dict[Hashable, list[tuple[int, int, int]]] = {}
    for g, moves in plans.items():
        lists.update({("direct", g): moves.direct_flat, ("direct_window", g): moves.direct_window,
                      ("staging", g): moves.staging, ("staged", g): moves.staged_flat,
                      ("staged_window", g): moves.staged_window})
    items, spans = _host_items(lists)
    _run_launches(_compile_launches(staging, tuning, device), items, spans, device)
    _run_launches(_compile_launches(main, tuning, device), items, spans, device)
    del scratch  # the caching allocator keeps it valid for the launches queued on this stream


def _copy_segment(state: MambaStateTensor, key: Hashable) -> _Segment:
    base, block, *_ = _layout(state)
    return _flat_segment(base, block, base, block, _block_bytes(state), key)


def copy_state_blocks(states: Sequence[MambaStateTensor], src_blocks: torch.Tensor,
                      dst_blocks: torch.Tensor, tuning: LaunchTuning) -> None:
    """``hb_copy_state_blocks``: whole blocks, every layer and group in one launch."""
    src_rows, dst_rows = _as_host_rows(src_blocks), _as_host_rows(dst_blocks)
    for group, row in enumerate(dst_rows):
        _check_unique_destinations(row, group, "dst_blocks")
    plans: dict[int, _MovePlan] = {}
    for state in states:
        if state.group not in plans:
            src, dst = src_rows[state.group], dst_rows[state.group]
            plans[state.group] = _plan_moves(src, dst, [0] * len(src))
    _run_moves(states, plans, tuning)


def _run_row_moves(states: Sequence[MambaStateTensor], moves: plan.RowMoves,
                   tuning: LaunchTuning) -> None:
    """Perform a :class:`~.plan.RowMoves` plan in one launch: its block ids stay on the device.

    Every row reads blocks of its own request (hookspecs: no request reads a block another one
    writes), so nothing is staged; an in-place conv shift is memmove-safe in the window kernel.
    """
    if not states:
        return
    device = states[0].tensor.device

    def build() -> list[_Launch]:
        _check_states(states)
        segments = []
        for state in states:
            base, block, *_ = _layout(state)
            key = (state.group, state.kind.is_conv)
            segments.append(_window_segment(state, base, block, base, key) if state.kind.is_conv
                            else _flat_segment(base, block, base, block, _block_bytes(state), key))
        return _compile_launches(segments, tuning, device)

    launches = _cached_launches("rows", states, tuning, build)
    groups, rows = moves.conv_src.shape
    # conv moves of every group, then temporal ones; flat (temporal) segments ignore the shift
    items = torch.stack([torch.cat([moves.conv_src, moves.temporal_src]).reshape(-1),
                         torch.cat([moves.conv_dst, moves.temporal_dst]).reshape(-1),
                         moves.shift.expand(2 * groups, rows).reshape(-1)])
    spans: dict[Hashable, tuple[int, int]] = {
        (g, conv): ((g if conv else groups + g) * rows, rows)
        for g in range(groups) for conv in (True, False)}
    _run_launches(launches, items, spans, device)


def precopy_running_states(states: Sequence[MambaStateTensor], block_tables: Sequence[torch.Tensor],
                           src_cols: torch.Tensor, dst_cols: torch.Tensor, token_bias: torch.Tensor,
                           tuning: LaunchTuning) -> None:
    """``hb_precopy_running_states``: one launch for every request, layer and group."""
    _run_row_moves(states, plan.precopy_moves(block_tables, src_cols, dst_cols, token_bias), tuning)


def postprocess_accepted_states(states: Sequence[MambaStateTensor], block_tables: Sequence[torch.Tensor],
                                running_cols: torch.Tensor, num_running_tokens: torch.Tensor,
                                num_accepted: torch.Tensor, block_size: int,
                                num_accepted_out: torch.Tensor, tuning: LaunchTuning) -> None:
    """``hb_postprocess_accepted_states``: the copies in one launch, then the accepted counts."""
    moves, reset = plan.postprocess_moves(block_tables, running_cols, num_running_tokens,
                                          num_accepted, block_size)
    _run_row_moves(states, moves, tuning)
    plan.apply_reset(num_accepted_out, reset)


# ---- host side: checkpoint store --------------------------------------------------------------

_KINDS = {torch.float32: _K_F32.value, torch.float16: _K_F16.value, torch.bfloat16: _K_BF16.value}


def _dtype_pair(source: torch.Tensor, state: MambaStateTensor) -> tuple[int, int]:
    if source.dtype == state.tensor.dtype:
        return _K_RAW.value, _K_RAW.value
    if source.dtype in _KINDS and state.tensor.dtype in _KINDS:
        return _KINDS[source.dtype], _KINDS[state.tensor.dtype]
    raise TypeError(
        f"checkpoint source of {state.layer or '?'} is {source.dtype} and the state is "
        f"{state.tensor.dtype}; casts are supported between float32, float16 and bfloat16 only"
    )


def store_checkpoints(states: Sequence[MambaStateTensor], sources: Sequence[torch.Tensor],
                      checkpoints: CheckpointBatch, tuning: LaunchTuning) -> None:
    """``hb_store_checkpoints``: one launch per (source dtype, state dtype) pair.

    Every read happens before any write: a checkpoint may not start from a block that the same
    call writes, and a block is written at most once (the facade rejects both for host batches).
    """
    device = states[0].tensor.device if states else torch.device("cpu")
    # field-major (dst, end, start, initial, temporal row), read by the kernel on the device;
    # the values are checked by the facade where they are on the host (plan.check_checkpoints)
    fields_of = ("dst_block", "token_end", "seq_start", "initial_block", "temporal_row")
    items = torch.stack([getattr(checkpoints, f).to(device, torch.int64, non_blocking=True)
                         for f in fields_of])
    count = items.shape[1]
    segments: list[tuple[tuple[int, int, int, int], _Segment]] = []
    keep_alive: list[torch.Tensor] = []  # contiguous copies of sources, until the launches ran
    for state, source in zip(states, sources):
        _check_device(state.tensor, f"state {state.layer or '?'}")
        _check_device(source, f"checkpoint source of {state.layer or '?'}")
        _check_contiguous_blocks(state)
        src_kind, dst_kind = _dtype_pair(source, state)
        base, block, tok, chan, length = _layout(state)
        size = state.tensor.element_size()
        if state.kind.is_conv:
            # source: the token-major conv input, any strides (row stride in _SRC_BLOCK)
            fields = [source.data_ptr(), source.stride(0), 0, source.stride(1), base, block // size,
                      tok // size, chan // size, length, source.shape[1], 0, 0, 0, MODE_WINDOW, 1]
            segment = _Segment(fields, None, size, window_tokens=length)
        else:
            if not source[0].is_contiguous():
                source = source.contiguous()  # rows must be contiguous; vLLM's already are
                keep_alive.append(source)
            numel = math.prod(state.tensor.shape[1:])
            src_size = source.element_size()
            fields = [source.data_ptr(), source.stride(0), 1, 0, base, block // size,
                      0, 1, 1, numel, 0, 0, 0, MODE_FLAT, 1]
            aligned = (_aligned16(source.data_ptr(), source.stride(0) * src_size, base, block)
                       and numel % (16 // min(src_size, size)) == 0)
            segment = _Segment(fields, None, size, window_tokens=1, aligned=aligned)
        segments.append(((source.element_size(), size, src_kind, dst_kind), segment))
    if count == 0:  # checked above, nothing to store
        return
    keys = {id(segment): key for key, segment in segments}
    launches = _launch_groups([segment for _, segment in segments], lambda seg: keys[id(seg)])
    for ((src_size, dst_size, src_kind, dst_kind), aligned), launch in launches.items():
        vec_src, vec_dst = (16 // src_size, 16 // dst_size) if aligned else (1, 1)
        src_anchor, dst_anchor = _anchor(device, src_size), _anchor(device, dst_size)
        win_t = _pow2_at_least(max(s.window_tokens for s in launch))
        win_c = _pow2_at_most(max(tuning.checkpoint_tile_elems // win_t, 16))
        flat_block = _pow2_at_most(max(tuning.checkpoint_tile_elems, 16))
        columns, programs = [], 0
        for segment in launch:
            fields = list(segment.fields)
            fields[_SRC_BASE.value] = _offset_from(src_anchor, fields[_SRC_BASE.value], src_size)
            fields[_DST_BASE.value] = _offset_from(dst_anchor, fields[_DST_BASE.value], dst_size)
            per_tile = win_c if fields[_MODE.value] == MODE_WINDOW else flat_block
            tiles = max(1, -(-fields[_CHANNELS.value] // per_tile))
            fields[_ITEM0.value], fields[_TILES.value], fields[_PROG0.value] = 0, tiles, programs
            programs += tiles * count
            columns.append(fields)
        table = host_ints([value for f in range(_NUM_FIELDS) for value in (col[f] for col in columns)],
                             device)
        num_segments = len(columns)
        _checkpoint_kernel[(programs,)](
            src_anchor, dst_anchor, table, items.reshape(-1), num_segments, count,
            SRC_KIND=src_kind, DST_KIND=dst_kind, VEC_SRC=vec_src, VEC_DST=vec_dst,
            VEC_MASK=max(vec_src, vec_dst), SEG_P2=_pow2_at_least(num_segments, 16),
            WIN_T=win_t, WIN_C=win_c, FLAT_BLOCK=flat_block,
            num_warps=tuning.num_warps, num_stages=tuning.num_stages,
        )
        launch_counts["checkpoint"] += 1
    del keep_alive  # the launches are queued; the caching allocator keeps the memory valid


# ---- host side: aligned state-index gather ----------------------------------------------------

_TABLE_TYPES = {torch.int64: tl.int64, torch.int32: tl.int32, torch.int16: tl.int16,
                torch.int8: tl.int8, torch.uint8: tl.uint8}


def gather_aligned_state_indices(block_tables: Sequence[torch.Tensor], seq_lens: torch.Tensor,
                                 block_size: int, num_slots: int, tuning: LaunchTuning) -> torch.Tensor:
    """``hb_gather_aligned_state_indices``: every group in one launch; int32 output."""
    tables = list(block_tables)
    device = tables[0].device
    if len({t.dtype for t in tables}) > 1:
        tables = [t.to(torch.int64) for t in tables]
    for g, table in enumerate(tables):
        _check_device(table, f"block_tables[{g}]")
    lens = to_device(seq_lens, device)
    num_rows = lens.shape[0]
    out = torch.empty((len(tables), num_rows, num_slots), dtype=torch.int32, device=device)
    if num_rows == 0:
        return out
    meta = host_ints([t.data_ptr() for t in tables] + [t.shape[1] for t in tables]
                        + [t.stride(0) for t in tables] + [t.stride(1) for t in tables],
                        device).view(4, len(tables))
    rows = _pow2_at_most(max(1, tuning.gather_rows))
    grid = (-(-num_rows // rows), len(tables))
    _gather_indices_kernel[grid](
        meta[0], meta[1], meta[2], meta[3], lens, out, num_rows, num_slots, block_size,
        TABLE_T=_TABLE_TYPES[tables[0].dtype], ROWS=rows, SLOTS=_pow2_at_least(num_slots),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )
    launch_counts["gather_indices"] += 1
    return out


# ---- vLLM kernel override ---------------------------------------------------------------------


def batch_memcpy(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor,
                 tuning: LaunchTuning) -> None:
    """Overlap-safe replacement for vLLM's ``batch_memcpy_kernel`` (grid dropped).

    Entry ``i`` moves ``sizes[i]`` bytes from address ``src_ptrs[i]`` to ``dst_ptrs[i]`` with
    memmove semantics: when the two ranges overlap (a conv-window shift inside one block, vLLM
    #50729), one program moves the entry chunk by chunk in the safe direction, reading each chunk
    completely before writing it; otherwise several programs share the entry. 8-byte words when
    both addresses and the size allow it, bytes otherwise. Distinct entries must not overlap each
    other (vLLM's never do: each writes its own request's new block).
    """
    count = src_ptrs.shape[0]
    if count == 0:
        return
    for name, tensor in (("src_ptrs", src_ptrs), ("dst_ptrs", dst_ptrs), ("sizes", sizes)):
        _check_device(tensor, name)
    chunk = _pow2_at_most(max(tuning.memcpy_chunk_bytes, 8))
    _batch_memcpy_kernel[(count, tuning.memcpy_split)](
        src_ptrs, dst_ptrs, sizes, CHUNK=chunk, SPLIT=tuning.memcpy_split,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )
    launch_counts["batch_memcpy"] += 1
