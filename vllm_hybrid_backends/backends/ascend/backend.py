"""The ``ascend`` backend: Huawei Ascend NPUs. Probe here; kernels arrive in ``kernels.py``.

``torch_npu`` is imported only by the probe (through :mod:`vllm_hybrid_backends.device`), never
at import time. Until the kernels land every state operation is delegated to ``cpu``.
"""

from __future__ import annotations

from ...device import import_torch_npu, npu_count, torch_npu_installed
from ...hookspecs import hookimpl
from ...types import Availability, BackendIdentity, DeviceKind

NAME = "ascend"


@hookimpl
def hb_backend_identity() -> BackendIdentity:
    return BackendIdentity(NAME, DeviceKind.NPU, priority=100,
                           description="torch_npu / Triton-Ascend kernels for Ascend NPUs")


@hookimpl
def hb_backend_probe() -> Availability:
    if not torch_npu_installed():
        return Availability(False, "torch_npu is not installed (pip install torch-npu; needs CANN)")
    module, why = import_torch_npu()
    if module is None:
        return Availability(False, why)
    if npu_count() == 0:
        return Availability(False, "no Ascend NPU visible (check ASCEND_RT_VISIBLE_DEVICES)")
    return Availability(True, f"{npu_count()} NPU(s), torch_npu importable")
