"""The ``rocm`` backend: AMD GPUs (ROCm), every state operation in Triton (``kernels.py``).

The kernels are shared with ``cuda`` (:mod:`..triton_state_kernels`); launch shapes per
architecture are in ``tuning.py``. ``triton`` is imported only when a hook first runs: this
module is imported on every machine by the plugin manager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...device import gpu_count, hip_build, triton_available
from ...hookspecs import hookimpl
from ...types import Availability, BackendIdentity, DeviceKind

NAME = "rocm"
PLATFORM = "rocm"  # vLLM's current_platform.device_name this backend overrides kernels for
BATCH_MEMCPY_KERNEL = "vllm.v1.worker.mamba_utils.batch_memcpy_kernel"


def _kernels() -> Any:
    from . import kernels

    return kernels


@hookimpl
def hb_backend_identity() -> BackendIdentity:
    return BackendIdentity(NAME, DeviceKind.ROCM, priority=100,
                           description="Triton kernels for AMD GPUs (ROCm)")


@hookimpl
def hb_backend_probe() -> Availability:
    if not hip_build():
        return Availability(False, "torch is not a ROCm/HIP build")
    if gpu_count() == 0:
        return Availability(False, "no HIP device visible (check HIP_VISIBLE_DEVICES)")
    has_triton, why = triton_available()
    if not has_triton:
        return Availability(False, why)
    return Availability(True, f"{gpu_count()} HIP device(s), triton importable")


@hookimpl
def hb_copy_state_blocks(states, src_blocks, dst_blocks) -> None:
    """One launch for every layer and group. Snapshot semantics: a block that one pair reads and
    another writes (chains, cycles) is staged into a scratch buffer by a first launch; with no
    such block there is a single launch and each block moves once."""
    _kernels().copy_state_blocks(states, src_blocks, dst_blocks)


@hookimpl
def hb_precopy_running_states(states, block_tables, src_cols, dst_cols, token_bias) -> None:
    """One launch for every request, layer and group. An in-place conv shift (same block) is
    memmove-safe: one program per channel tile loads every token, passes a barrier, then
    stores; sources another request overwrites are staged first."""
    _kernels().precopy_running_states(states, block_tables, src_cols, dst_cols, token_bias)


@hookimpl
def hb_postprocess_accepted_states(
    states, block_tables, running_cols, num_running_tokens, num_accepted, block_size, num_accepted_out
) -> None:
    """The boundary-state copies as in :func:`hb_precopy_running_states` (same kernel, same
    overlap rules), then ``num_accepted_out`` is reset where the column did not change."""
    _kernels().postprocess_accepted_states(
        states, block_tables, running_cols, num_running_tokens, num_accepted, block_size,
        num_accepted_out,
    )


@hookimpl
def hb_store_checkpoints(states, sources, checkpoints) -> None:
    """One launch per (source dtype, state dtype) pair; casts round like torch. A checkpoint
    may not start from a block the same call writes (rejected: reads come before writes)."""
    _kernels().store_checkpoints(states, sources, checkpoints)


@hookimpl
def hb_gather_aligned_state_indices(block_tables, seq_lens, block_size, num_slots):
    """Every group in one launch."""
    return _kernels().gather_aligned_state_indices(block_tables, seq_lens, block_size, num_slots)


@hookimpl
def hb_kernel_overrides(platform_name: str) -> dict[str, Callable[..., object]] | None:
    """vLLM's ``batch_memcpy_kernel`` (the V1 align-mode copy of raw address ranges) becomes an
    overlap-safe Triton memmove with wide words; only on vLLM's ``rocm`` platform."""
    if platform_name != PLATFORM:
        return None

    def batch_memcpy(src_ptrs, dst_ptrs, sizes, BLOCK_SIZE=None):
        _kernels().batch_memcpy(src_ptrs, dst_ptrs, sizes, BLOCK_SIZE)

    return {BATCH_MEMCPY_KERNEL: batch_memcpy}
