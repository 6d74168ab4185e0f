"""Re-install the worker patches and kernel overrides after vllm-ascend's ``NPUWorker.__init__``.

- Targets: ``vllm_ascend.worker.worker.NPUWorker.__init__`` (optional: only where vllm-ascend is
  installed and its platform is vLLM's current platform).
- Why: vLLM loads general plugins and calls the platform's ``register_triton_kernel_overrides``
  (where this plugin's worker patches and kernel overrides go in) *before* it builds the worker.
  ``NPUWorker.__init__`` then runs vllm-ascend's ``adapt_patch()``, which re-assigns
  ``vllm.v1.worker.mamba_utils`` attributes as plain assignments: ``do_mamba_copy_block``,
  ``batch_memcpy``, ``batch_memcpy_kernel``, ``preprocess_mamba``,
  ``postprocess_mamba_fused_kernel`` and, on 310P, ``collect_mamba_copy_meta`` and
  ``postprocess_mamba_align_gpu``. Without this patch the selected backend would silently stop
  being called on Ascend.
- How: ``NPUWorker.__init__`` is wrapped. After the original returns, every other worker patch
  applied in this process runs its ``apply()`` again (each wraps whatever is installed at that
  moment, so vllm-ascend's functions become the originals our replacements delegate to for the
  cases they do not handle) and the selected backend's ``hb_kernel_overrides`` are registered again (the backend's
  kernels win; vllm-ascend's stay reachable as the wrapped originals). Worker subclasses that
  call ``super().__init__`` (the 310P worker) are covered. Nothing from vllm-ascend or torch_npu
  is imported unless vllm-ascend is installed and is the current platform.
- Upstream: vllm-ascend applies its worker patches from ``NPUWorker.__init__``
  (``vllm_ascend/patch/worker/patch_mamba_utils.py``); vLLM RFC #31467 proposes a per-backend
  dispatch for Triton kernels that would make such re-assignments unnecessary.
- vLLM versions: 0.23.x and 0.26.x (vllm-ascend 0.23.0 / 0.26.0rc1, whose real
  ``NPUWorker.__init__`` the contract tests run), 0.30.x-0.33.x; checked by capability (the
  class and its ``__init__``), not by version. Kernel overrides are re-registered only where
  vLLM has ``vllm.triton_utils.dispatcher`` (0.31+): on 0.23 / 0.26 importing it failed inside
  ``NPUWorker.__init__`` and took the worker down, and so did re-applying patches this vLLM
  does not need (only the patches applied in this process are re-applied).
- Removal: when vllm-ascend stops re-assigning ``mamba_utils`` functions in ``NPUWorker.__init__``
  (for example by using vLLM's kernel-override seam).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from typing import Any

from ..logs import logger
from ..trace import trace_event

TARGET_MODULE = "vllm_ascend.worker.worker"
TARGET_SYMBOLS = ("NPUWorker.__init__",)
PROCESS = "worker"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"
OPTIONAL = True

_MARK = "_hybrid_backends_reapplies_patches"


def _platform_class() -> Any:
    from . import patch_vllm_platforms

    return patch_vllm_platforms._platform_class()


def _vllm_ascend_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm_ascend") is not None
    except (ImportError, ValueError):  # a module in sys.modules without a spec
        return "vllm_ascend" in sys.modules


def missing() -> list[str]:
    if not _vllm_ascend_installed():
        return ["vllm_ascend is not installed"]
    try:
        platform = _platform_class()
    except Exception as exc:
        return [f"vllm.platforms.current_platform unavailable: {exc}"]
    if not platform.__module__.startswith("vllm_ascend"):
        return [f"the current platform ({platform.__module__}.{platform.__name__}) is not "
                "vllm-ascend's"]
    try:
        module = importlib.import_module(TARGET_MODULE)
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {type(exc).__name__}: {exc}"]
    worker = getattr(module, "NPUWorker", None)
    if not isinstance(worker, type) or "__init__" not in vars(worker):
        return [f"{TARGET_MODULE}.NPUWorker.__init__"]
    return []


def reapply_worker_patches() -> None:
    """Apply the other worker patches again, then the selected backend's kernel overrides
    (only where vLLM has the kernel dispatcher, 0.31+; vllm-ascend's 0.23 / 0.26 pairings
    have none, and their ``batch_memcpy_kernel`` stays vllm-ascend's)."""
    from .. import patches, plugins
    from . import patch_vllm_platforms

    applied = []
    for module in patches.patch_modules(PROCESS):
        # only what this process applied: a patch not needed on this vLLM has no target here
        if module.__name__ == __name__ or patches.check(module).state != patches.APPLIED:
            continue
        module.apply()
        applied.append(module.__name__.rsplit(".", 1)[-1])
    overrides: dict[str, Any] = {}
    if patch_vllm_platforms.has_worker_seam():
        from vllm.triton_utils.dispatcher import register_kernels

        platform_name = getattr(_platform_class(), "device_name", "") or ""
        overrides = plugins.kernel_overrides(platform_name)
        if overrides:
            register_kernels(overrides)
    logger.info("hybrid_backends: re-applied %s and %d kernel override(s) after vllm-ascend's "
                "NPUWorker.__init__", ", ".join(applied) or "no patches", len(overrides))
    trace_event("worker_patches_reapplied", after="NPUWorker.__init__", patches=applied,
                kernels=sorted(overrides))


def apply() -> None:
    worker = importlib.import_module(TARGET_MODULE).NPUWorker
    original = vars(worker)["__init__"]
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        reapply_worker_patches()

    setattr(__init__, _MARK, True)
    worker.__init__ = __init__
