"""The Triton backend: every state operation in Triton (``kernels.py``), registered twice, as
``cuda`` (NVIDIA) and ``rocm`` (AMD). What differs between the two is data (``tuning.py``:
device discovery, Triton target, launch shapes per architecture), never code.

``triton`` is imported only when a hook first runs: this module is imported on every machine
by the plugin manager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...device import cuda_build, gpu_count, hip_build, triton_available
from ...hookspecs import hookimpl
from ...types import Availability, BackendIdentity
from . import tuning

BATCH_MEMCPY_KERNEL = "vllm.v1.worker.mamba_utils.batch_memcpy_kernel"
_TORCH_BUILDS: dict[str, Callable[[], bool]] = {"cuda": cuda_build, "hip": hip_build}


def _kernels() -> Any:
    from . import kernels

    return kernels


class TritonBackend:
    """One registration of the Triton backend for one vendor."""

    def __init__(self, vendor: tuning.Vendor) -> None:
        self.vendor = vendor
        self.NAME = self.PLATFORM = vendor.name  # PLATFORM: vLLM's current_platform.device_name

    def __repr__(self) -> str:
        return f"TritonBackend({self.vendor.name})"

    def launch_tuning(self, device: Any) -> tuning.LaunchTuning:
        """The tuning-table entry for the GPU the kernels will run on."""
        return self.vendor.for_target(*_kernels().device_target(device))

    @hookimpl
    def hb_backend_identity(self) -> BackendIdentity:
        return BackendIdentity(self.vendor.name, self.vendor.device_kind, priority=100,
                               description=self.vendor.description)

    @hookimpl
    def hb_backend_probe(self) -> Availability:
        label = self.vendor.build_label
        if not _TORCH_BUILDS[self.vendor.torch_build]():
            return Availability(False, f"torch is not a {label} build")
        if gpu_count() == 0:
            return Availability(False, f"no {label} device visible (check "
                                       f"{self.vendor.visible_devices_env})")
        has_triton, why = triton_available()
        if not has_triton:
            return Availability(False, why)
        return Availability(True, f"{gpu_count()} {label} device(s), triton importable")

    @hookimpl
    def hb_copy_state_blocks(self, states, src_blocks, dst_blocks) -> None:
        """One launch for every layer and group. Snapshot semantics: a block that one pair reads
        and another writes (chains, cycles) is staged into a scratch buffer by a first launch;
        with no such block there is a single launch and each block moves once."""
        _kernels().copy_state_blocks(states, src_blocks, dst_blocks,
                                     self.launch_tuning(states[0].tensor.device))

    @hookimpl
    def hb_precopy_running_states(self, states, block_tables, src_cols, dst_cols, token_bias) -> None:
        """One launch for every request, layer and group, its block ids read on the device
        (:mod:`..plan`). An in-place conv shift (same block) is memmove-safe: one program per
        channel tile loads every token, passes a barrier, then stores."""
        _kernels().precopy_running_states(states, block_tables, src_cols, dst_cols, token_bias,
                                          self.launch_tuning(states[0].tensor.device))

    @hookimpl
    def hb_postprocess_accepted_states(self, states, block_tables, running_cols, num_running_tokens,
                                       num_accepted, block_size, num_accepted_out) -> None:
        """The boundary-state copies as in :meth:`hb_precopy_running_states` (same kernel, same
        overlap rules), then ``num_accepted_out`` is reset where the column did not change."""
        _kernels().postprocess_accepted_states(
            states, block_tables, running_cols, num_running_tokens, num_accepted, block_size,
            num_accepted_out, self.launch_tuning(states[0].tensor.device))

    @hookimpl
    def hb_store_checkpoints(self, states, sources, checkpoints) -> None:
        """One launch per (source dtype, state dtype) pair; casts round like torch; the batch is
        read on the device. A checkpoint may not start from a block the same call writes."""
        _kernels().store_checkpoints(states, sources, checkpoints,
                                     self.launch_tuning(states[0].tensor.device))

    @hookimpl
    def hb_gather_aligned_state_indices(self, block_tables, seq_lens, block_size, num_slots):
        """Every group in one launch."""
        return _kernels().gather_aligned_state_indices(
            block_tables, seq_lens, block_size, num_slots, self.launch_tuning(block_tables[0].device))

    @hookimpl
    def hb_kernel_overrides(self, platform_name: str) -> dict[str, Callable[..., object]] | None:
        """vLLM's ``batch_memcpy_kernel`` (the V1 align-mode copy of raw address ranges) becomes
        an overlap-safe Triton memmove with wide words; only on this vendor's vLLM platform.
        vLLM's ``BLOCK_SIZE`` is ignored: the chunk size comes from the tuning table."""
        if platform_name != self.PLATFORM:
            return None

        def batch_memcpy(src_ptrs, dst_ptrs, sizes, BLOCK_SIZE=None):
            _kernels().batch_memcpy(src_ptrs, dst_ptrs, sizes, self.launch_tuning(src_ptrs.device))

        return {BATCH_MEMCPY_KERNEL: batch_memcpy}


CUDA = TritonBackend(tuning.NVIDIA)
ROCM = TritonBackend(tuning.AMD)
