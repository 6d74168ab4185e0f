"""The ``rocm`` backend: AMD GPUs. Probe here; Triton kernels arrive in ``kernels.py``.

Until then every state operation is delegated to the reference ``cpu`` backend, which runs
on HIP tensors (``doctor`` lists the delegated hooks).
"""

from __future__ import annotations

from ...device import gpu_count, hip_build, triton_available
from ...hookspecs import hookimpl
from ...types import Availability, BackendIdentity, DeviceKind

NAME = "rocm"


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
