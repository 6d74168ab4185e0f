"""Triton-Ascend kernels of the ``ascend`` backend (A2/A3) and their host-side launchers.

Imported only when the Triton path runs, never at package import (it imports ``triton``).

Every state operation becomes a list of *region copies*: a ``rows x cols`` window of words with
its own row and column strides, from a source address to a destination address. One kernel,
:func:`copy_regions_kernel`, moves all of them for all layers and groups of a step; the host
(:class:`RegionCopies`) orders them so the result has the hooks' snapshot semantics.

Triton-Ascend constraints this file keeps (``tests/backends/test_ascend_contract.py`` checks
them on the source and on every launch):

- address buffers are ``int64`` tensors (Ascend has no ``DT_UINT64`` for several ops);
- an address becomes a pointer only as a *scalar*: ``tl.load(table + i).to(tl.pointer_type(..))``,
  then vector offsets are added to that pointer (casting ``base + offsets`` vectors hits a
  triton-ascend ``PtrOffsetInfo`` assertion, vllm-ascend PR #10888);
- one grid axis, sized by :func:`.tuning.launch_grid` (about one program per vector core, never
  above the 65535-program limit); programs loop over their jobs;
- vector offsets are ``int32``; anything that could exceed it is added to the scalar pointer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from ...types import MambaStateTensor, StateKind
from . import tuning

JOB_FIELDS = 8
"""Columns of a job table row: src address, dst address, rows, cols, src row stride, dst row
stride, src col stride, dst col stride (addresses in bytes, the rest in words)."""

TABLE_FIELDS = 3
"""Columns of a block-table descriptor row: base address, row stride (elements), width."""

_WORDS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_INT32_MAX = 2**31 - 1

LaunchObserver = Callable[[str, int, int, tuple[Any, ...], dict[str, Any]], None]
launch_observers: list[LaunchObserver] = []
"""Called as ``observer(kernel_name, grid, num_jobs, args, constexprs)`` before every launch."""


@triton.jit
def copy_regions_kernel(jobs_ptr, num_jobs, WORD: tl.constexpr, TILE_ROWS: tl.constexpr,
                        TILE_COLS: tl.constexpr, UNIT_COLS: tl.constexpr):
    """Copy ``num_jobs`` 2-D regions described by the int64 table at ``jobs_ptr``.

    Each program takes jobs ``pid, pid + num_programs, ...`` and moves a job tile by tile, low
    addresses first; a tile is loaded completely before it is stored.
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tile_rows = tl.arange(0, TILE_ROWS)[:, None]
    tile_cols = tl.arange(0, TILE_COLS)[None, :]
    for job in range(pid, num_jobs, num_programs):
        fields = jobs_ptr + job * 8
        src = tl.load(fields).to(tl.pointer_type(WORD))
        dst = tl.load(fields + 1).to(tl.pointer_type(WORD))
        rows = tl.load(fields + 2)
        cols = tl.load(fields + 3)
        src_row_stride = tl.load(fields + 4)
        dst_row_stride = tl.load(fields + 5)
        src_col_stride = tl.load(fields + 6).to(tl.int32)
        dst_col_stride = tl.load(fields + 7).to(tl.int32)
        src_rows = tile_rows * src_row_stride.to(tl.int32)
        dst_rows = tile_rows * dst_row_stride.to(tl.int32)
        for row0 in range(0, rows, TILE_ROWS):
            src_tile = src + row0 * src_row_stride
            dst_tile = dst + row0 * dst_row_stride
            row_ok = tile_rows < rows - row0
            for col0 in range(0, cols, TILE_COLS):
                col = (col0 + tile_cols).to(tl.int32)
                mask = row_ok & (tile_cols < cols - col0)
                if UNIT_COLS:
                    words = tl.load(src_tile + (src_rows + col), mask=mask)
                    tl.store(dst_tile + (dst_rows + col), words, mask=mask)
                else:
                    words = tl.load(src_tile + (src_rows + col * src_col_stride), mask=mask)
                    tl.store(dst_tile + (dst_rows + col * dst_col_stride), words, mask=mask)


@triton.jit
def gather_aligned_indices_kernel(tables_ptr, seq_lens_ptr, out_ptr, num_groups, num_reqs,
                                  BLOCK_SIZE: tl.constexpr, NUM_SLOTS: tl.constexpr,
                                  TABLE_WORD: tl.constexpr, TILE_REQS: tl.constexpr,
                                  TILE_SLOTS: tl.constexpr):
    """``out[g, r, j] = table_g[r, max((seq_lens[r] - 1) // BLOCK_SIZE, 0) + j]``, ``-1`` past
    the table's width; ``tables_ptr`` is an int64 ``[num_groups, 3]`` descriptor table."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tile_reqs = tl.arange(0, TILE_REQS)[:, None]
    slots = tl.arange(0, TILE_SLOTS)[None, :]
    tiles_per_group = (num_reqs + TILE_REQS - 1) // TILE_REQS
    for item in range(pid, num_groups * tiles_per_group, num_programs):
        group = item // tiles_per_group
        req0 = (item % tiles_per_group) * TILE_REQS
        fields = tables_ptr + group * 3
        table = tl.load(fields).to(tl.pointer_type(TABLE_WORD))
        row_stride = tl.load(fields + 1)
        width = tl.load(fields + 2).to(tl.int32)
        req_ok = tile_reqs < num_reqs - req0
        seq_len = tl.load(seq_lens_ptr + (req0 + tile_reqs), mask=req_ok, other=1).to(tl.int32)
        col = tl.maximum((seq_len - 1) // BLOCK_SIZE, 0) + slots
        inside = req_ok & (slots < NUM_SLOTS) & (col < width)
        rows = table + req0 * row_stride
        block = tl.load(rows + (tile_reqs * row_stride.to(tl.int32) + col), mask=inside, other=-1)
        out_tile = out_ptr + (group * num_reqs + req0) * NUM_SLOTS
        tl.store(out_tile + (tile_reqs * NUM_SLOTS + slots), block.to(tl.int32),
                 mask=req_ok & (slots < NUM_SLOTS))


# ---- launching ---------------------------------------------------------------------------------


def _launch(kernel: Any, grid: int, num_jobs: int, *args: Any, **constexprs: Any) -> None:
    if not 1 <= grid <= tuning.GRID_LIMIT:
        raise ValueError(f"grid {grid} is outside 1..{tuning.GRID_LIMIT} (Triton-Ascend limit)")
    name = str(getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "?"))
    for observer in launch_observers:
        observer(name, grid, num_jobs, args, dict(constexprs))
    kernel[(grid,)](*args, **constexprs)


def _int64_table(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 device tensor from a host array (the kernels' address buffers)."""
    table = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    return table.to(device, non_blocking=True) if device.type != "cpu" else table


@dataclass(frozen=True)
class Geometry:
    """One cache block of a tensor as a 2-D window: ``rows x cols`` elements with strides."""

    base: int  # address of element 0 (bytes)
    block_stride: int  # elements between consecutive blocks
    rows: int
    cols: int
    row_stride: int
    col_stride: int
    elem: int  # bytes per element


def geometry(tensor: torch.Tensor, kind: StateKind) -> Geometry | None:
    """How a state tensor's blocks are laid out, or ``None`` if no 2-D window describes them."""
    if tensor.dim() < 2 or any(s < 1 for s, n in zip(tensor.stride(), tensor.shape) if n > 1):
        return None
    elem = tensor.element_size()
    if elem not in _WORDS or tensor.shape[0] == 0:
        return None
    block = tensor[0]
    if kind.is_conv or tensor.dim() == 3 and not block.is_contiguous():
        if tensor.dim() != 3:
            return None
        rows, cols = int(tensor.shape[1]), int(tensor.shape[2])
        row_stride, col_stride = int(tensor.stride(1)), int(tensor.stride(2))
    elif block.is_contiguous():
        rows, cols, row_stride, col_stride = 1, int(block.numel()), int(block.numel()), 1
    elif tensor.dim() == 2:
        rows, cols, row_stride, col_stride = 1, int(tensor.shape[1]), 0, int(tensor.stride(1))
    else:
        return None
    return Geometry(int(tensor.data_ptr()), int(tensor.stride(0)), rows, cols, row_stride,
                    col_stride, elem)


_MOVE_FIELDS = ("key", "src_block", "dst_block", "src_addr", "dst_addr", "rows", "cols",
                "src_rs", "dst_rs", "src_cs", "dst_cs", "elem", "round")


@dataclass
class RegionCopies:
    """Region copies of one hook call, executed with snapshot semantics.

    Semantics: every source is read before any destination is written; copies into the same
    destination block land in the order they were added (``round``: the occurrence number of
    that destination). ``key`` names the tensor a ``src_block``/``dst_block`` belongs to;
    ``src_block = -1`` marks a source outside the states (layer inputs, zeros).

    Plan: copies whose source block is also written in this call are *staged* (source copied to
    a scratch buffer first); copies writing a block a staged copy reads wait for the staging
    launch. Without such hazards (every step vLLM takes) everything is one launch per tile shape.
    """

    device: torch.device
    tune: tuning.SocTuning
    vector_cores: int
    _parts: dict[str, list[np.ndarray]] = field(default_factory=lambda: {f: [] for f in _MOVE_FIELDS})
    _keep_alive: list[torch.Tensor] = field(default_factory=list)

    def add(self, **columns: Any) -> None:
        """Add copies: each keyword is a scalar or an array of one value per copy."""
        if set(columns) != set(_MOVE_FIELDS):
            raise TypeError(f"RegionCopies.add needs exactly {_MOVE_FIELDS}, got {sorted(columns)}")
        arrays = np.broadcast_arrays(*(np.asarray(columns[f], dtype=np.int64) for f in _MOVE_FIELDS))
        for name, array in zip(_MOVE_FIELDS, arrays):
            self._parts[name].append(np.atleast_1d(array).ravel())

    def zeros(self, nbytes: int) -> int:
        """Address of ``nbytes`` zero bytes on the device, valid until :meth:`run` returns."""
        buffer = torch.zeros(max(nbytes, 8), dtype=torch.uint8, device=self.device)
        self._keep_alive.append(buffer)
        return int(buffer.data_ptr())

    def run(self) -> None:
        moves = {name: np.concatenate(parts) if parts else np.zeros(0, np.int64)
                 for name, parts in self._parts.items()}
        keep = (moves["rows"] > 0) & (moves["cols"] > 0)
        moves = {name: column[keep] for name, column in moves.items()}
        if moves["key"].size:
            for phase in self._phases(moves):
                self._launch_jobs(phase)
        self._keep_alive.clear()

    def _phases(self, m: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        _, key_index = np.unique(m["key"], return_inverse=True)
        span = int(max(m["dst_block"].max(), m["src_block"].max())) + 2
        dst_pair = key_index * span + m["dst_block"]
        src_pair = np.where(m["src_block"] >= 0, key_index * span + m["src_block"], -1)
        staged = (src_pair >= 0) & np.isin(src_pair, dst_pair)
        deferred = ~staged & np.isin(dst_pair, src_pair[staged])

        # staged regions are packed row-major into one scratch buffer, 8-byte aligned
        nbytes = m["rows"] * m["cols"] * m["elem"]
        slot = (nbytes[staged] + 7) // 8 * 8
        scratch_addr = np.full(m["key"].shape, -1, np.int64)
        if slot.size:
            scratch = torch.empty(int(slot.sum()), dtype=torch.uint8, device=self.device)
            self._keep_alive.append(scratch)
            scratch_addr[staged] = int(scratch.data_ptr()) + np.cumsum(slot) - slot

        def jobs(mask: np.ndarray, src_from_scratch: bool = False,
                 dst_to_scratch: bool = False) -> dict[str, np.ndarray]:
            job = {name: m[name][mask] for name in ("src_addr", "dst_addr", "rows", "cols",
                                                    "src_rs", "dst_rs", "src_cs", "dst_cs", "elem")}
            if src_from_scratch:  # scratch holds the region packed row-major
                job["src_addr"], job["src_rs"] = scratch_addr[mask], job["cols"].copy()
                job["src_cs"] = np.ones_like(job["cols"])
            if dst_to_scratch:
                job["dst_addr"], job["dst_rs"] = scratch_addr[mask], job["cols"].copy()
                job["dst_cs"] = np.ones_like(job["cols"])
            return job

        rounds = m["round"]
        phases = [_concat(jobs(staged, dst_to_scratch=True),
                          jobs(~staged & ~deferred & (rounds == 0)))]
        for r in range(int(rounds.max()) + 1):
            phases.append(_concat(
                jobs(staged & (rounds == r), src_from_scratch=True),
                jobs(~staged & (rounds == r) & (deferred if r == 0 else True))))
        return [p for p in phases if p["rows"].size]

    def _launch_jobs(self, job: dict[str, np.ndarray]) -> None:
        job = _widen(job)
        job = _split(job, self.tune.split_bytes)
        word, unit = job["word"], (job["src_cs"] == 1) & (job["dst_cs"] == 1)
        tile_words = np.array([_floor_pow2(self.tune.tile_bytes // w) for w in (1, 2, 4, 8)])
        tile_cols = np.minimum(_ceil_pow2(job["cols"]), tile_words[np.log2(word).astype(int)])
        classes = np.stack([word, unit.astype(np.int64), tile_cols], axis=1)
        for word_bytes, is_unit, cols in np.unique(classes, axis=0):
            select = (word == word_bytes) & (unit == bool(is_unit)) & (tile_cols == cols)
            table = np.stack([job[f][select] for f in ("src_addr", "dst_addr", "rows", "cols",
                                                       "src_rs", "dst_rs", "src_cs", "dst_cs")],
                             axis=1)
            tile_rows, tile_cols_ = tuning.tile_shape(int(cols), int(word_bytes), self.tune.tile_bytes)
            _check_int32_offsets(table, tile_rows)
            num_jobs = int(table.shape[0])
            _launch(copy_regions_kernel, tuning.launch_grid(num_jobs, self.vector_cores), num_jobs,
                    _int64_table(table, self.device), num_jobs, WORD=_WORDS[int(word_bytes)],
                    TILE_ROWS=tile_rows, TILE_COLS=tile_cols_, UNIT_COLS=bool(is_unit))


def _ceil_pow2(values: np.ndarray) -> np.ndarray:
    return (2 ** np.ceil(np.log2(np.maximum(values, 1)))).astype(np.int64)


def _floor_pow2(value: int) -> int:
    return 1 << (value.bit_length() - 1)


def _concat(*parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _widen(job: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Pick per job the widest word (8, 4, 2 or 1 bytes) every address and length allows;
    strided columns move one element at a time. Lengths and strides become words."""
    elem = job["elem"]
    unit = (job["src_cs"] == 1) & (job["dst_cs"] == 1)
    multi_row = job["rows"] > 1
    bits = (job["src_addr"] | job["dst_addr"] | job["cols"] * elem
            | np.where(multi_row, job["src_rs"] * elem | job["dst_rs"] * elem, 0) | 8)
    word = np.where(unit, bits & -bits, elem)
    out = dict(job)
    out["word"] = word
    out["cols"] = job["cols"] * elem // word
    out["src_rs"] = job["src_rs"] * elem // word
    out["dst_rs"] = job["dst_rs"] * elem // word
    return out


def _split(job: dict[str, np.ndarray], split_bytes: int) -> dict[str, np.ndarray]:
    """Cut jobs larger than ``split_bytes`` into pieces (row groups, or column ranges of a
    single row) so several programs share a large copy."""
    row_bytes = job["cols"] * job["word"]
    rows_per_piece = np.where(job["rows"] > 1, np.maximum(1, split_bytes // np.maximum(row_bytes, 1)),
                              1)
    pieces = -(-job["rows"] // rows_per_piece)
    job = _repeat(job, pieces)
    start_row = _rank_in_group(pieces) * np.repeat(rows_per_piece, pieces)
    job["rows"] = np.minimum(np.repeat(rows_per_piece, pieces), job["rows"] - start_row)
    job["src_addr"] = job["src_addr"] + start_row * job["src_rs"] * job["word"]
    job["dst_addr"] = job["dst_addr"] + start_row * job["dst_rs"] * job["word"]

    single = job["rows"] == 1
    cols_per_piece = np.where(single, np.maximum(1, split_bytes // job["word"]), job["cols"])
    pieces = -(-job["cols"] // cols_per_piece)
    job = _repeat(job, pieces)
    start_col = _rank_in_group(pieces) * np.repeat(cols_per_piece, pieces)
    job["cols"] = np.minimum(np.repeat(cols_per_piece, pieces), job["cols"] - start_col)
    job["src_addr"] = job["src_addr"] + start_col * job["src_cs"] * job["word"]
    job["dst_addr"] = job["dst_addr"] + start_col * job["dst_cs"] * job["word"]
    return job


def _repeat(job: dict[str, np.ndarray], counts: np.ndarray) -> dict[str, np.ndarray]:
    return {name: np.repeat(column, counts) for name, column in job.items()}


def _rank_in_group(counts: np.ndarray) -> np.ndarray:
    """``[0..c0-1, 0..c1-1, ...]`` for group sizes ``counts``."""
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - starts


def _check_int32_offsets(table: np.ndarray, tile_rows: int) -> None:
    """The kernel's vector offsets are int32: reject a job whose in-tile span could overflow."""
    span = (tile_rows * np.abs(table[:, 4:6]).max(axis=1)
            + table[:, 3] * np.abs(table[:, 6:8]).max(axis=1))
    if span.size and int(span.max()) > _INT32_MAX:
        raise ValueError(f"a copy spans {int(span.max())} words within one tile; the Ascend "
                         f"kernels address at most {_INT32_MAX} (int32 offsets)")


# ---- per-hook move builders --------------------------------------------------------------------


def add_block_moves(copies: RegionCopies, state: MambaStateTensor, geo: Geometry,
                    src_blocks: np.ndarray, dst_blocks: np.ndarray, biases: np.ndarray,
                    rounds: np.ndarray) -> None:
    """Copies of :func:`hb_copy_state_blocks` (bias 0) and the shifted pre/post copies.

    ``src_blocks`` is already the block to read (for temporal states the accepted column's).
    """
    src_offset: np.ndarray | int
    rows: np.ndarray | int
    cols: np.ndarray | int
    if state.kind is StateKind.CONV_SD:
        src_offset, rows, cols = biases * geo.row_stride, geo.rows - biases, geo.cols
    elif state.kind is StateKind.CONV_DS:
        src_offset, rows, cols = biases * geo.col_stride, geo.rows, geo.cols - biases
    else:
        src_offset, rows, cols = 0, geo.rows, geo.cols
    copies.add(key=geo.base, src_block=src_blocks, dst_block=dst_blocks,
               src_addr=geo.base + (src_blocks * geo.block_stride + src_offset) * geo.elem,
               dst_addr=geo.base + dst_blocks * geo.block_stride * geo.elem,
               rows=rows, cols=cols, src_rs=geo.row_stride, dst_rs=geo.row_stride,
               src_cs=geo.col_stride, dst_cs=geo.col_stride, elem=geo.elem, round=rounds)


ZERO, INPUT, STATE = 0, 1, 2
"""Where a conv-window row comes from (see ``backend.plan_conv_windows``)."""


def add_conv_window_moves(copies: RegionCopies, state: MambaStateTensor, geo: Geometry,
                          source: torch.Tensor, runs: Sequence[tuple[int, int, int, int, int, int]]) -> None:
    """Checkpoint conv windows: ``runs`` are ``(dst_block, position, length, kind, a, row)``:
    window rows ``[position, position + length)`` of ``dst_block`` come from input rows
    ``a..`` (INPUT), block ``a``'s window rows ``row..`` (STATE), or zeros (ZERO)."""
    if not runs:
        return
    dst, pos, length, kind, a, row = (np.array(c, dtype=np.int64) for c in zip(*runs))
    in_base, in_s0, in_s1 = int(source.data_ptr()), int(source.stride(0)), int(source.stride(1))
    sd = state.kind is StateKind.CONV_SD
    step = geo.row_stride if sd else geo.col_stride  # elements between window rows (tokens)
    zeros = copies.zeros(int((length.max() if not sd else geo.cols) * geo.elem)) if (kind == ZERO).any() else 0
    src_addr = np.select(
        [kind == INPUT, kind == STATE],
        [in_base + a * in_s0 * geo.elem, geo.base + (a * geo.block_stride + row * step) * geo.elem],
        zeros)
    rows: np.ndarray | int
    cols: np.ndarray | int
    if sd:  # a window row is a state row: rows = tokens, cols = dim
        src_rs = np.select([kind == INPUT, kind == STATE], [in_s0, geo.row_stride], 0)
        src_cs = np.select([kind == INPUT, kind == STATE], [in_s1, geo.col_stride], 1)
        rows, cols = length, geo.cols
    else:  # DS: rows = dim, cols = tokens
        src_rs = np.select([kind == INPUT, kind == STATE], [in_s1, geo.row_stride], 0)
        src_cs = np.select([kind == INPUT, kind == STATE], [in_s0, geo.col_stride], 1)
        rows, cols = geo.rows, length
    copies.add(key=geo.base, src_block=np.where(kind == STATE, a, -1), dst_block=dst,
               src_addr=src_addr, dst_addr=geo.base + (dst * geo.block_stride + pos * step) * geo.elem,
               rows=rows, cols=cols, src_rs=src_rs, dst_rs=geo.row_stride, src_cs=src_cs,
               dst_cs=geo.col_stride, elem=geo.elem, round=0)


def add_temporal_checkpoint_moves(copies: RegionCopies, geo: Geometry, source_geo: Geometry,
                                  dst_blocks: np.ndarray, source_rows: np.ndarray) -> None:
    copies.add(key=geo.base, src_block=-1, dst_block=dst_blocks,
               src_addr=source_geo.base + source_rows * source_geo.block_stride * geo.elem,
               dst_addr=geo.base + dst_blocks * geo.block_stride * geo.elem,
               rows=geo.rows, cols=geo.cols, src_rs=source_geo.row_stride, dst_rs=geo.row_stride,
               src_cs=source_geo.col_stride, dst_cs=geo.col_stride, elem=geo.elem, round=0)


# ---- aligned state indices and vLLM's batch_memcpy_kernel -----------------------------------------


def gather_aligned_state_indices(block_tables: Sequence[torch.Tensor], seq_lens: torch.Tensor,
                                 block_size: int, num_slots: int, vector_cores: int) -> torch.Tensor:
    device = block_tables[0].device
    dtypes = {t.dtype for t in block_tables}
    word = next(iter(dtypes)) if len(dtypes) == 1 and next(iter(dtypes)) in (torch.int32, torch.int64) \
        else torch.int64
    tables = [t.to(word) if t.dtype != word else t for t in block_tables]
    tables = [t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous() for t in tables]
    descriptors = np.array([[t.data_ptr(), t.stride(0), t.shape[1]] for t in tables], dtype=np.int64)
    num_groups, num_reqs = len(tables), int(seq_lens.shape[0])
    out = torch.empty((num_groups, num_reqs, num_slots), dtype=torch.int32, device=device)
    if num_reqs == 0:
        return out
    lengths = seq_lens.to(device=device).contiguous()
    tile_slots = 1 << (num_slots - 1).bit_length()
    tile_reqs = max(1, min(64, 1024 // tile_slots))
    items = num_groups * (-(-num_reqs // tile_reqs))
    _launch(gather_aligned_indices_kernel, tuning.launch_grid(items, vector_cores), items,
            _int64_table(descriptors, device), lengths, out, num_groups, num_reqs,
            BLOCK_SIZE=block_size, NUM_SLOTS=num_slots,
            TABLE_WORD=tl.int32 if word == torch.int32 else tl.int64, TILE_REQS=tile_reqs,
            TILE_SLOTS=tile_slots)
    return out


def make_batch_memcpy_kernel(tune: tuning.SocTuning, vector_cores: int) -> Callable[..., None]:
    """vLLM's ``batch_memcpy_kernel`` (kernel-override form: its arguments, grid dropped).

    Entries are independent byte copies; each runs in one program, tile by tile from low to high
    addresses, so a left-overlapping entry (a conv shift inside one block) is memmove-safe.
    Addresses arrive as uint64 or int64 tensors and are reinterpreted as int64 on the device:
    no host synchronisation.
    """

    def batch_memcpy_kernel(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor,
                            BLOCK_SIZE: int = 0) -> None:
        num = int(src_ptrs.shape[0])
        if num == 0:
            return
        jobs = torch.zeros((num, JOB_FIELDS), dtype=torch.int64, device=src_ptrs.device)
        jobs[:, 0] = _as_int64(src_ptrs)
        jobs[:, 1] = _as_int64(dst_ptrs)
        jobs[:, 2] = 1
        jobs[:, 3] = sizes.to(torch.int64)
        jobs[:, 6:8] = 1
        _launch(copy_regions_kernel, tuning.launch_grid(num, vector_cores), num, jobs, num,
                WORD=tl.int8, TILE_ROWS=1, TILE_COLS=tuning.tile_shape(tune.tile_bytes, 1,
                                                                      tune.tile_bytes)[1],
                UNIT_COLS=True)

    return batch_memcpy_kernel


def _as_int64(addresses: torch.Tensor) -> torch.Tensor:
    if addresses.dtype == torch.uint64:
        return addresses.view(torch.int64)
    return addresses.to(torch.int64)
