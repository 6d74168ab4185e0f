"""The ``cuda`` backend: NVIDIA GPUs. Probe here; Triton kernels arrive in ``kernels.py``.

Until then every state operation is delegated to the reference ``cpu`` backend, which runs
on CUDA tensors (``doctor`` lists the delegated hooks).
"""

from __future__ import annotations

from ...device import cuda_build, gpu_count, triton_available
from ...hookspecs import hookimpl
from ...types import Availability, BackendIdentity, DeviceKind

NAME = "cuda"


@hookimpl
def hb_backend_identity() -> BackendIdentity:
    return BackendIdentity(NAME, DeviceKind.CUDA, priority=100,
                           description="Triton kernels for NVIDIA GPUs")


@hookimpl
def hb_backend_probe() -> Availability:
    if not cuda_build():
        return Availability(False, "torch is not a CUDA build")
    if gpu_count() == 0:
        return Availability(False, "no CUDA device visible (check CUDA_VISIBLE_DEVICES)")
    has_triton, why = triton_available()
    if not has_triton:
        return Availability(False, why)
    return Availability(True, f"{gpu_count()} CUDA device(s), triton importable")
