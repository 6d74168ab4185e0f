"""vllm-hybrid-backends: correct, high-hit-rate prefix caching for hybrid models in vLLM.

vLLM calls :func:`register` (entry point ``vllm.general_plugins: hybrid_backends``) in the
front-end, the engine core and every worker process when ``VLLM_PLUGINS`` allows it.
"""

from __future__ import annotations

from .hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["__version__", "hookimpl", "register"]

_registered = False
_unsupported_warned = False


def register() -> None:
    """vLLM general-plugin entry point: cheap, idempotent per process.

    On a supported vLLM it applies the engine-side patches and wraps the platform's worker-side
    kernel-override hook (see :mod:`.patches.patch_vllm_platforms`), where the worker patches
    go in; on vLLM 0.30, which lacks that hook, it applies the worker patches itself.
    On any other version it warns once and patches nothing.
    """
    global _registered, _unsupported_warned
    if _registered:
        return
    _registered = True

    from .compat import installed_vllm_version, is_supported, unsupported_reason
    from .logs import logger
    from .trace import trace_event

    version = installed_vllm_version()
    if not is_supported(version):
        if not _unsupported_warned:
            _unsupported_warned = True
            logger.warning("hybrid_backends: %s; the plugin patches nothing",
                           unsupported_reason(version))
        trace_event("register_unsupported", vllm_version=version)
        return
    from . import patches
    from .patches import patch_vllm_platforms

    applied = patches.apply_all("engine")
    if applied and not patch_vllm_platforms.has_worker_seam():
        # vLLM 0.30: no worker-only hook; register() runs in every worker before the
        # model is built, so the worker patches go in here (harmless where no model runs).
        if patches.apply_all("worker"):
            from . import plugins

            trace_event("worker_side_installed", backend=plugins.selected_backend(), kernels=[],
                        via="register")
    trace_event("registered", vllm_version=version, patched=applied)
