"""Device detection, done once per process. Nothing else in the project touches
``torch.cuda``, ``torch.version.hip`` or ``torch_npu`` directly."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType
from typing import Any

from .types import DeviceKind


@functools.cache
def cuda_build() -> bool:
    """torch was built with CUDA (not HIP)."""
    import torch

    return torch.version.cuda is not None and getattr(torch.version, "hip", None) is None


@functools.cache
def hip_build() -> bool:
    """torch was built with ROCm/HIP."""
    import torch

    return getattr(torch.version, "hip", None) is not None


@functools.cache
def gpu_count() -> int:
    """Visible CUDA or HIP devices (0 on a CPU build)."""
    import torch

    if not (cuda_build() or hip_build()):
        return 0
    try:
        return int(torch.cuda.device_count())
    except Exception:  # a broken driver must not take the process down
        return 0


@functools.cache
def torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


@functools.cache
def import_torch_npu() -> tuple[ModuleType | None, str]:
    """Import torch_npu lazily; return (module, "") or (None, why it failed)."""
    if not torch_npu_installed():
        return None, "torch_npu is not installed"
    try:
        return importlib.import_module("torch_npu"), ""
    except Exception as exc:  # without CANN the import raises
        return None, f"import torch_npu failed: {type(exc).__name__}: {exc}"


@functools.cache
def npu_count() -> int:
    module, _ = import_torch_npu()
    if module is None:
        return 0
    try:
        import torch

        return int(torch.npu.device_count())  # type: ignore[attr-defined]
    except Exception:
        return 0


@functools.cache
def triton_available() -> tuple[bool, str]:
    """Triton importable with a GPU backend (what the CUDA and ROCm kernels need)."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    try:
        importlib.import_module("triton")
    except Exception as exc:
        return False, f"import triton failed: {type(exc).__name__}: {exc}"
    return True, ""


@functools.cache
def ascend_soc_name() -> str:
    """Name of NPU 0 as torch_npu reports it (``Ascend910B2``, ``Ascend910_9392``,
    ``Ascend310P3``); ``""`` when no NPU is usable. Imports torch_npu lazily."""
    if npu_count() == 0:
        return ""
    try:
        import torch

        return str(torch.npu.get_device_name(0))  # type: ignore[attr-defined]
    except Exception:
        return ""


@functools.cache
def triton_ascend_available() -> tuple[bool, str]:
    """Triton importable and its active driver is triton-ascend's (an NPU target)."""
    has_triton, why = triton_available()
    if not has_triton:
        return False, why
    try:
        import triton

        driver = triton.runtime.driver.active
        backend = str(getattr(driver.get_current_target(), "backend", ""))
    except Exception as exc:
        return False, f"triton has no usable NPU driver: {type(exc).__name__}: {exc}"
    if backend != "npu" and "ascend" not in type(driver).__module__:
        return False, f"triton's active backend is {backend!r}, not triton-ascend"
    return True, ""


@functools.cache
def ascend_vector_cores() -> int:
    """Vector cores of the current NPU from triton-ascend's driver; 0 when it cannot say."""
    if not triton_ascend_available()[0]:
        return 0
    try:
        import torch
        import triton

        device = torch.npu.current_device()  # type: ignore[attr-defined]
        properties = triton.runtime.driver.active.utils.get_device_properties(device)
        return int(properties.get("num_vectorcore", 0))
    except Exception:
        return 0


@functools.cache
def detect_device_kind() -> DeviceKind:
    """The accelerator this process would run vLLM on: NPU, ROCm, CUDA, else CPU."""
    if torch_npu_installed() and npu_count() > 0:
        return DeviceKind.NPU
    if hip_build() and gpu_count() > 0:
        return DeviceKind.ROCM
    if cuda_build() and gpu_count() > 0:
        return DeviceKind.CUDA
    return DeviceKind.CPU


def to_device(tensor: Any, device: Any) -> Any:
    """``tensor`` on ``device``. A host tensor bound for a CUDA/HIP device goes through pinned
    memory and the copy is queued without waiting (a pageable ``.to`` syncs the host)."""
    import torch

    target = torch.device(device)
    if target.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(target, non_blocking=True)
    return tensor.to(target)


def host_ints(values: Any, device: Any) -> Any:
    """Host integers as an int64 tensor on ``device`` (:func:`to_device`)."""
    import torch

    return to_device(torch.tensor(values, dtype=torch.long), device)


def reset_caches() -> None:
    """Forget every detection result (tests that fake a device use this)."""
    for fn in (cuda_build, hip_build, gpu_count, torch_npu_installed, import_torch_npu,
               npu_count, triton_available, detect_device_kind, ascend_soc_name,
               triton_ascend_available, ascend_vector_cores):
        fn.cache_clear()
