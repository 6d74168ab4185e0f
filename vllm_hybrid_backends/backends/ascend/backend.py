"""The ``ascend`` backend: Huawei Ascend NPUs, every state operation implemented here.

Two execution paths, chosen per process from the probed SoC (``VLLM_HYBRID_ASCEND_PATH``
overrides it):

- ``triton`` (A2/A3): :mod:`.kernels`, Triton-Ascend kernels that move every layer and group of
  a step in one launch per tile shape;
- ``torch`` (310P, which has no Triton): :mod:`.torch_npu_ops`, plain torch ops vectorised over
  requests.

Both give exactly the reference's results (``vllm_hybrid_backends.reference``), snapshot
semantics included. Which request moves which column, with which bias, is the shared plan
(:mod:`..plan`, tensor ops). Index tensors on the NPU, and the torch path, use the shared torch
movers: nothing is read back to the host. The Triton path turns plans made from host tensors
(vLLM's V1 path hands the hooks host tensors) into its region copies on the host.

``torch_npu`` (and ``triton``) are imported only when the backend is probed or used, through
:mod:`vllm_hybrid_backends.device`, never when this module is imported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from ... import reference
from ...device import (
    ascend_soc_name,
    ascend_vector_cores,
    import_torch_npu,
    npu_count,
    torch_npu_installed,
    triton_ascend_available,
)
from ...hookspecs import hookimpl
from ...logs import logger
from ...types import Availability, BackendIdentity, CheckpointBatch, DeviceKind, MambaStateTensor
from .. import plan
from . import torch_npu_ops, tuning

NAME = "ascend"
TRITON, TORCH = "triton", "torch"
ZERO, INPUT, STATE = torch_npu_ops.ZERO, torch_npu_ops.INPUT, torch_npu_ops.STATE


# ---- which path runs -----------------------------------------------------------------------------


@functools.cache
def kernel_path() -> str:
    """``triton`` or ``torch`` for this process: the SoC's default unless the env var forces one."""
    requested = tuning.requested_path()
    soc = ascend_soc_name()
    triton_ok, why = triton_ascend_available()
    if requested == TRITON and not triton_ok:
        raise RuntimeError(f"{tuning.PATH_ENV}=triton, but Triton-Ascend cannot run here: {why}")
    if requested == TRITON or requested == "auto" and tuning.for_soc(soc).triton and triton_ok:
        path = TRITON
    else:
        path = TORCH
    logger.info("hybrid_backends: ascend backend uses the %s path (SoC %r, %s requested%s)", path,
                soc or "unknown", requested, "" if triton_ok else f"; no Triton-Ascend: {why}")
    return path


def _tuning() -> tuning.SocTuning:
    return tuning.for_soc(ascend_soc_name())


def _vector_cores(tune: tuning.SocTuning) -> int:
    return ascend_vector_cores() or tune.vector_cores


def _kernels() -> ModuleType:
    from . import kernels  # imports triton: only on the Triton path

    return kernels


# ---- host-side planning (shared by both paths) ----------------------------------------------------


def _host(values: torch.Tensor) -> np.ndarray:
    """An int64 host copy of an index tensor (no copy for CPU int64 tensors)."""
    return values.detach().to("cpu").numpy().astype(np.int64, copy=False).reshape(-1)


def _occurrence(values: np.ndarray) -> np.ndarray:
    """``out[i]`` = how many times ``values[i]`` appeared before position ``i``."""
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    starts = np.r_[0, np.flatnonzero(ranked[1:] != ranked[:-1]) + 1]
    counts = np.diff(np.r_[starts, len(values)])
    out = np.empty(len(values), np.int64)
    out[order] = np.arange(len(values)) - np.repeat(starts, counts)
    return out


def _lookup(table: torch.Tensor, rows: np.ndarray, cols: np.ndarray, group: int) -> np.ndarray:
    """``table[rows, cols]`` as host int64, after checking every column exists."""
    width = int(table.shape[1])
    bad = np.flatnonzero((cols < 0) | (cols >= width))
    if bad.size:
        i = int(bad[0])
        raise IndexError(f"request row {int(rows[i])} needs column {int(cols[i])} of "
                         f"block_tables[{group}], which has columns 0..{width - 1}")
    if table.device.type == "cpu":
        return table.numpy()[rows, cols].astype(np.int64)
    picked = table[torch.from_numpy(rows).to(table.device), torch.from_numpy(cols).to(table.device)]
    return _host(picked)


def _check_blocks(state: MambaStateTensor, name: str, blocks: np.ndarray) -> None:
    """Block ids become raw addresses on the Triton path: reject any outside the tensor."""
    num_blocks = int(state.tensor.shape[0])
    bad = np.flatnonzero((blocks < 0) | (blocks >= num_blocks))
    if bad.size:
        raise IndexError(f"{name} contains block {int(blocks[bad[0]])} for layer "
                         f"{state.layer or '?'}; allowed 0..{num_blocks - 1}")


def _check_conv_biases(state: MambaStateTensor, rows: np.ndarray, biases: np.ndarray) -> None:
    length = state.state_len
    bad = np.flatnonzero((biases < 0) | (biases >= length))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"token bias {int(biases[i])} of request row {int(rows[i])} is outside "
                         f"[0, {length}) (conv state_len of layer {state.layer or '?'})")


def plan_conv_windows(checkpoints: dict[str, np.ndarray], length: int, num_tokens: int
                      ) -> dict[int, list[tuple[int, int, int]]]:
    """The conv window each destination block ends up with, as ``length`` row sources
    ``(kind, a, row)``: ZERO, INPUT row ``a``, or row ``row`` of block ``a``'s *original* window.

    Every window reads the state as it was before the call (snapshot semantics, like the
    reference): a prefix from a block another checkpoint of the batch writes takes its old rows.
    """
    windows: dict[int, list[tuple[int, int, int]]] = {}
    for end, start, initial, dst in zip(checkpoints["token_end"], checkpoints["seq_start"],
                                        checkpoints["initial_block"], checkpoints["dst_block"]):
        end, start, initial, dst = int(end), int(start), int(initial), int(dst)
        if not (0 <= start and 0 <= end <= num_tokens):
            raise ValueError(f"checkpoint with seq_start={start}, token_end={end} is outside the "
                             f"conv input's {num_tokens} rows")
        first = max(end - length, start)
        from_input = max(0, end - first)
        missing = length - from_input
        rows: list[tuple[int, int, int]] = []
        if missing and initial >= 0:
            rows = [(STATE, initial, r) for r in range(length - missing, length)]
        elif missing:
            rows = [(ZERO, 0, 0)] * missing
        windows[dst] = rows + [(INPUT, first + i, 0) for i in range(from_input)]
    return windows


def window_runs(windows: dict[int, list[tuple[int, int, int]]]
                ) -> list[tuple[int, int, int, int, int, int]]:
    """Merge consecutive row sources into ``(dst_block, position, length, kind, a, row)`` runs."""
    runs: list[tuple[int, int, int, int, int, int]] = []
    for dst, rows in windows.items():
        start = 0
        for p in range(1, len(rows) + 1):
            if p < len(rows) and _continues(rows[p - 1], rows[p]):
                continue
            kind, a, row = rows[start]
            runs.append((dst, start, p - start, kind, a, row))
            start = p
    return runs


def _continues(previous: tuple[int, int, int], current: tuple[int, int, int]) -> bool:
    if previous[0] != current[0]:
        return False
    if current[0] == INPUT:
        return current[1] == previous[1] + 1
    if current[0] == STATE:
        return current[1] == previous[1] and current[2] == previous[2] + 1
    return True


# ---- operations ---------------------------------------------------------------------------------


class _Executor:
    """Runs one hook call on the chosen path: Triton region copies where a state's layout allows,
    the torch ops otherwise (states are independent tensors, so mixing is safe)."""

    def __init__(self, states: Sequence[MambaStateTensor], path: str | None):
        self.path = path or kernel_path()
        self.copies: Any = None
        if self.path == TRITON and states:
            tune = _tuning()
            self.copies = _kernels().RegionCopies(states[0].tensor.device, tune, _vector_cores(tune))

    def geometry(self, tensor: torch.Tensor, state: MambaStateTensor) -> Any:
        return _kernels().geometry(tensor, state.kind) if self.copies is not None else None

    def finish(self) -> None:
        if self.copies is not None:
            self.copies.run()


def copy_state_blocks(states: Sequence[MambaStateTensor], src_blocks: torch.Tensor,
                      dst_blocks: torch.Tensor, path: str | None = None) -> None:
    run = _Executor(states, path)
    if run.copies is None:  # torch path: no host round trip at all
        for state in states:
            torch_npu_ops.copy_blocks(state, src_blocks[state.group], dst_blocks[state.group])
        return
    src_all, dst_all = _host_rows(src_blocks), _host_rows(dst_blocks)
    for state in states:
        src, dst = src_all[state.group], dst_all[state.group]
        _check_blocks(state, "src_blocks", src)
        _check_blocks(state, "dst_blocks", dst)
        geo = run.geometry(state.tensor, state)
        if geo is None:
            torch_npu_ops.copy_blocks(state, src_blocks[state.group], dst_blocks[state.group])
        else:
            _kernels().add_block_moves(run.copies, state, geo, src, dst, np.zeros_like(src),
                                       _occurrence(dst))
    run.finish()


def _host_rows(blocks: torch.Tensor) -> np.ndarray:
    return blocks.detach().to("cpu").numpy().astype(np.int64, copy=False)


def _uses_torch_ops(path: str | None, *index_tensors: torch.Tensor) -> bool:
    """The torch path, and index tensors on the NPU (reading them would sync), take the shared
    torch movers; the Triton path plans its region copies on the host from host tensors."""
    return (path or kernel_path()) == TORCH or not plan.on_host(*index_tensors)


def _row_moves(states: Sequence[MambaStateTensor], moves: plan.RowMoves, path: str | None) -> None:
    """Perform a :class:`~..plan.RowMoves` plan (made from host tensors on the Triton path)."""
    if not states:
        return
    if _uses_torch_ops(path, moves.conv_dst):
        reference.apply_row_moves(states, moves)
        return
    run = _Executor(states, path)
    shifts = moves.shift.numpy()
    for state in states:
        src, dst = (ids.numpy() for ids in moves.of(state))
        rows = np.flatnonzero(dst >= 0)
        if rows.size == 0:
            continue
        src, dst = src[rows], dst[rows]
        shift = shifts[rows] if state.kind.is_conv else np.zeros_like(rows)
        if state.kind.is_conv:
            _check_conv_biases(state, rows, shift)
        _check_blocks(state, "source block", src)
        _check_blocks(state, "destination block", dst)
        geo = run.geometry(state.tensor, state)
        if geo is None:
            torch_npu_ops.shift_copy(state, src, dst, shift, _occurrence(dst))
        else:
            _kernels().add_block_moves(run.copies, state, geo, src, dst, shift, _occurrence(dst))
    run.finish()


def precopy_running_states(states: Sequence[MambaStateTensor], block_tables: Sequence[torch.Tensor],
                           src_cols: torch.Tensor, dst_cols: torch.Tensor, token_bias: torch.Tensor,
                           path: str | None = None) -> None:
    _row_moves(states, plan.precopy_moves(block_tables, src_cols, dst_cols, token_bias), path)


def postprocess_accepted_states(states: Sequence[MambaStateTensor],
                                block_tables: Sequence[torch.Tensor], running_cols: torch.Tensor,
                                num_running_tokens: torch.Tensor, num_accepted: torch.Tensor,
                                block_size: int, num_accepted_out: torch.Tensor,
                                path: str | None = None) -> None:
    moves, reset = plan.postprocess_moves(block_tables, running_cols, num_running_tokens,
                                          num_accepted, block_size)
    _row_moves(states, moves, path)
    plan.apply_reset(num_accepted_out, reset)


def store_checkpoints(states: Sequence[MambaStateTensor], sources: Sequence[torch.Tensor],
                      checkpoints: CheckpointBatch, path: str | None = None) -> None:
    names = ("token_end", "seq_start", "initial_block", "dst_block", "temporal_row")
    if _uses_torch_ops(path, *(getattr(checkpoints, name) for name in names)):
        reference.store_checkpoints(states, sources, checkpoints)
        return
    fields = {name: _host(getattr(checkpoints, name)) for name in names}
    kept = fields["dst_block"] >= 0  # negative destinations are skipped
    fields = {name: values[kept] for name, values in fields.items()}
    if not states or fields["dst_block"].size == 0:
        return
    run = _Executor(states, path)
    plans: dict[tuple[int, int], dict[int, list[tuple[int, int, int]]]] = {}
    temporal_final = dict(zip(fields["dst_block"].tolist(), fields["temporal_row"].tolist()))
    temporal_dst = np.fromiter(temporal_final.keys(), np.int64, len(temporal_final))
    temporal_rows = np.fromiter(temporal_final.values(), np.int64, len(temporal_final))
    for state, source in zip(states, sources):
        _check_blocks(state, "dst_block", fields["dst_block"])
        if not state.kind.is_conv:
            _store_temporal(run, state, source, temporal_dst, temporal_rows)
            continue
        key = (state.state_len, int(source.shape[0]))
        if key not in plans:
            plans[key] = plan_conv_windows(fields, *key)
        initial = fields["initial_block"]
        _check_blocks(state, "initial_block", initial[initial >= 0])
        geo = run.geometry(state.tensor, state)
        if geo is not None and source.dtype == state.tensor.dtype and min(source.stride()) >= 1:
            _kernels().add_conv_window_moves(run.copies, state, geo, source, window_runs(plans[key]))
        else:
            windows = plans[key]
            kind, index, row = (np.array([[r[i] for r in rows] for rows in windows.values()],
                                         dtype=np.int64).reshape(len(windows), state.state_len)
                                for i in range(3))
            torch_npu_ops.store_conv_windows(state, source, np.fromiter(windows, np.int64),
                                             kind, index, row)
    run.finish()


def _store_temporal(run: _Executor, state: MambaStateTensor, source: torch.Tensor,
                    dst: np.ndarray, rows: np.ndarray) -> None:
    bad = np.flatnonzero((rows < 0) | (rows >= source.shape[0]))
    if bad.size:
        raise IndexError(f"temporal_row {int(rows[bad[0]])} is outside the temporal source of "
                         f"layer {state.layer or '?'} (rows 0..{source.shape[0] - 1})")
    geo = run.geometry(state.tensor, state)
    source_geo = run.geometry(source, state) if geo is not None else None
    if (geo is not None and source_geo is not None and source.dtype == state.tensor.dtype
            and (geo.rows, geo.cols) == (source_geo.rows, source_geo.cols)):
        _kernels().add_temporal_checkpoint_moves(run.copies, geo, source_geo, dst, rows)
    else:
        torch_npu_ops.store_temporal(state, source, dst, rows)


def gather_aligned_state_indices(block_tables: Sequence[torch.Tensor], seq_lens: torch.Tensor,
                                 block_size: int, num_slots: int, path: str | None = None
                                 ) -> torch.Tensor:
    if (path or kernel_path()) == TRITON:
        return _kernels().gather_aligned_state_indices(block_tables, seq_lens, block_size, num_slots,
                                                       _vector_cores(_tuning()))
    return torch_npu_ops.gather_aligned_state_indices(block_tables, seq_lens, block_size, num_slots)


# ---- hook implementations -----------------------------------------------------------------------


@hookimpl
def hb_backend_identity() -> BackendIdentity:
    return BackendIdentity(NAME, DeviceKind.NPU, priority=100,
                           description="Triton-Ascend kernels (A2/A3) and torch ops (310P) for "
                                       "Ascend NPUs")


@hookimpl
def hb_backend_probe() -> Availability:
    if not torch_npu_installed():
        return Availability(False, "torch_npu is not installed (pip install torch-npu; needs CANN)")
    module, why = import_torch_npu()
    if module is None:
        return Availability(False, why)
    if npu_count() == 0:
        return Availability(False, "no Ascend NPU visible (check ASCEND_RT_VISIBLE_DEVICES)")
    try:
        path = kernel_path()
    except (RuntimeError, ValueError) as exc:
        return Availability(False, str(exc))
    soc = ascend_soc_name() or "unknown SoC"
    return Availability(True, f"{npu_count()} NPU(s) ({soc}), {path} path")


@hookimpl
def hb_copy_state_blocks(states, src_blocks, dst_blocks) -> None:
    copy_state_blocks(states, src_blocks, dst_blocks)


@hookimpl
def hb_precopy_running_states(states, block_tables, src_cols, dst_cols, token_bias) -> None:
    precopy_running_states(states, block_tables, src_cols, dst_cols, token_bias)


@hookimpl
def hb_postprocess_accepted_states(states, block_tables, running_cols, num_running_tokens,
                                   num_accepted, block_size, num_accepted_out) -> None:
    postprocess_accepted_states(states, block_tables, running_cols, num_running_tokens,
                                num_accepted, block_size, num_accepted_out)


@hookimpl
def hb_store_checkpoints(states, sources, checkpoints) -> None:
    store_checkpoints(states, sources, checkpoints)


@hookimpl
def hb_gather_aligned_state_indices(block_tables, seq_lens, block_size, num_slots) -> torch.Tensor:
    return gather_aligned_state_indices(block_tables, seq_lens, block_size, num_slots)


BATCH_MEMCPY_KERNEL = "vllm.v1.worker.mamba_utils.batch_memcpy_kernel"


@hookimpl
def hb_kernel_overrides(platform_name: str) -> dict[str, Callable[..., object]] | None:
    """On vllm-ascend (``npu``) with the Triton path: vLLM's ``batch_memcpy_kernel``.

    Precedence: vLLM installs these after the platform's own ``register_triton_kernel_overrides``,
    so ours win over any ``NPUPlatform`` override of the same name. vllm-ascend then re-assigns
    ``mamba_utils.batch_memcpy_kernel`` (and ``batch_memcpy``) as plain attributes in
    ``NPUWorker.__init__``; the ``patch_vllm_ascend_worker_worker`` patch re-registers these
    overrides right after that ``__init__``, so the dispatcher rebinds vllm-ascend's kernel
    object, wherever it was imported, to ours (vllm-ascend's stays reachable as the wrapped
    original). With our V1 copy patch the align-mode moves no longer reach this kernel at all;
    it serves copies with copy functions we do not recognise. On the torch path (310P) there is
    no override: a raw-address copy needs Triton, and vllm-ascend routes 310P around it.
    """
    if platform_name != "npu" or kernel_path() != TRITON:
        return None
    tune = _tuning()
    return {BATCH_MEMCPY_KERNEL: _kernels().make_batch_memcpy_kernel(tune, _vector_cores(tune))}
