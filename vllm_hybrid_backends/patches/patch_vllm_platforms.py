"""Install the selected backend's kernel overrides and worker patches after the platform's own.

- Targets: ``register_triton_kernel_overrides`` of the class of ``vllm.platforms.current_platform``
  (``Platform``, ``CpuPlatform``, an out-of-tree platform such as vllm-ascend's ``NPUPlatform``).
- Why: vLLM calls general plugins and then the platform's ``register_triton_kernel_overrides``,
  once per worker process (``WorkerWrapperBase.init_worker``). A plugin that registered kernels
  from ``register()`` would be shadowed by the platform for any name both override, and the
  platform hook is the only worker-only moment before the model is built.
- How: the classmethod is wrapped; the wrapper calls the platform's original first, then
  registers the selected backend's ``hb_kernel_overrides`` through
  ``vllm.triton_utils.dispatcher.register_kernels`` (so the backend wins over the platform for a
  shared name; the platform's implementation stays inside as the wrapped original) and applies
  the worker-side patch modules. Runs once per process.
- Upstream: no issue; this is the documented seam (``vllm/triton_utils/dispatcher.py``).
- vLLM versions: 0.32.x, 0.33.x (identical hook and dispatcher in both). Not needed on 0.30,
  which has neither: there :func:`vllm_hybrid_backends.register` applies the worker patches
  itself (vLLM calls it in every worker, ``WorkerWrapperBase.init_worker`` ->
  ``load_general_plugins``, before the model is built) and backends' kernel overrides are
  unavailable (doctor says so).
- Removal: when vLLM offers a post-platform plugin hook in workers.
"""

from __future__ import annotations

from typing import Any

from ..logs import logger
from ..trace import trace_event

TARGET_MODULE = "vllm.platforms"
TARGET_SYMBOLS = ("current_platform.register_triton_kernel_overrides",
                  "vllm.triton_utils.dispatcher.register_kernels")
PROCESS = "engine"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"

_MARK = "_hybrid_backends_wrapped"


def _platform_class() -> Any:
    from vllm.platforms import current_platform

    return type(current_platform)


def has_worker_seam() -> bool:
    """Whether this vLLM has the post-platform worker hook and the kernel dispatcher (0.31+)."""
    try:
        cls = _platform_class()
        from vllm.triton_utils import dispatcher  # noqa: F401
    except Exception:
        return False
    return callable(getattr(cls, "register_triton_kernel_overrides", None))


def not_needed() -> str | None:
    if has_worker_seam():
        return None
    return ("this vLLM has no Platform.register_triton_kernel_overrides / "
            "vllm.triton_utils.dispatcher (added in 0.31): register() applies the worker "
            "patches in every process; backend kernel overrides are unavailable")


def missing() -> list[str]:
    problems = []
    try:
        cls = _platform_class()
    except Exception as exc:
        return [f"vllm.platforms.current_platform unavailable: {exc}"]
    if not callable(getattr(cls, "register_triton_kernel_overrides", None)):
        problems.append(f"{cls.__name__}.register_triton_kernel_overrides")
    try:
        from vllm.triton_utils import dispatcher

        if not callable(getattr(dispatcher, "register_kernels", None)):
            problems.append("vllm.triton_utils.dispatcher.register_kernels")
    except Exception as exc:
        problems.append(f"vllm.triton_utils.dispatcher: {exc}")
    return problems


def install_worker_side(platform_name: str) -> None:
    """What runs in a worker right after the platform's own kernel overrides."""
    from vllm.triton_utils.dispatcher import register_kernels

    from .. import patches, plugins

    if not patches.apply_all("worker"):
        return
    overrides = plugins.kernel_overrides(platform_name)
    if overrides:
        register_kernels(overrides)
    trace_event("worker_side_installed", backend=plugins.selected_backend(),
                kernels=sorted(overrides), via="platform hook")


def apply() -> None:
    cls = _platform_class()
    current = cls.__dict__.get("register_triton_kernel_overrides")
    if getattr(current, _MARK, False) or getattr(
        getattr(current, "__func__", None), _MARK, False
    ):
        return
    original = cls.register_triton_kernel_overrides  # bound classmethod

    def register_triton_kernel_overrides(klass: Any) -> None:
        original()
        if getattr(klass, "_hybrid_backends_worker_done", False):
            return
        klass._hybrid_backends_worker_done = True
        try:
            install_worker_side(getattr(klass, "device_name", "") or "")
        except Exception:
            logger.exception("hybrid_backends: worker-side installation failed")
            raise

    register_triton_kernel_overrides._hybrid_backends_wrapped = True  # type: ignore[attr-defined]
    cls.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)
