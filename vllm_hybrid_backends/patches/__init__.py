"""Patches over vLLM, one module per patched vLLM module (``patch_<vllm module path>.py``).

Every patch module exposes ``TARGET_MODULE``, ``TARGET_SYMBOLS``, ``PROCESS`` (``worker`` or
``engine``), ``missing() -> list[str]`` (capability check: what it needs and cannot find) and
``apply()`` (idempotent). :func:`apply_all` checks every patch of a process first and applies
none if any check fails: never a half-patched engine. A module with ``OPTIONAL = True`` patches
a package that is not always there (vllm-ascend): when its check fails it is skipped, with one
log line, and never blocks the others. ``docs/patches.md`` is generated from the module
docstrings (``python -m vllm_hybrid_backends.docs``) and a test keeps it current.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..logs import logger
from ..trace import trace_event

PATCH_MODULES = (
    "vllm_hybrid_backends.patches.patch_vllm_platforms",
    "vllm_hybrid_backends.patches.patch_vllm_v1_worker_mamba_utils",
    "vllm_hybrid_backends.patches.patch_vllm_model_executor_layers_mamba_ops_ssd_combined",
    "vllm_hybrid_backends.patches.patch_vllm_model_executor_layers_mamba_mamba_mixer2",
    "vllm_hybrid_backends.patches.patch_vllm_model_executor_layers_mamba_ops_cpu_gdn_attention",
    "vllm_hybrid_backends.patches.patch_vllm_v1_attention_backends_gdn_attn",
    "vllm_hybrid_backends.patches.patch_vllm_ascend_worker_worker",
    "vllm_hybrid_backends.patches.patch_vllm_v1_core_sched_scheduler",
    "vllm_hybrid_backends.patches.patch_vllm_v1_core_kv_cache_coordinator",
    "vllm_hybrid_backends.patches.patch_vllm_v1_core_kv_cache_manager",
    "vllm_hybrid_backends.patches.patch_vllm_v1_metrics_stats",
    "vllm_hybrid_backends.patches.patch_vllm_v1_metrics_loggers",
)


def patch_modules(process: str | None = None) -> list[ModuleType]:
    modules = [importlib.import_module(name) for name in PATCH_MODULES]
    return [m for m in modules if process is None or m.PROCESS == process]


def is_optional(module: ModuleType) -> bool:
    return bool(getattr(module, "OPTIONAL", False))


def _short(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def apply_all(process: str) -> bool:
    """Apply every patch of ``process`` if all required ones can apply; return whether they did.

    Optional patches whose check fails are left out (one log line each); they never stop the
    required ones, and nothing applies when a required one cannot.
    """
    checked = [(module, module.missing()) for module in patch_modules(process)]
    problems = [f"{_short(m)}: {what}" for m, lacking in checked if not is_optional(m)
                for what in lacking]
    if problems:
        logger.warning(
            "hybrid_backends: this vLLM lacks what the %s patches need (%s); patching nothing",
            process, "; ".join(problems),
        )
        trace_event("patches_skipped", scope=process, problems=problems)
        return False
    skipped = [m for m, lacking in checked if lacking]  # only optional ones can lack anything here
    for module, lacking in checked:
        if lacking:
            logger.info("hybrid_backends: optional patch %s not applied: %s", _short(module),
                        "; ".join(lacking))
    applied = [m for m, lacking in checked if not lacking]
    for module in applied:
        module.apply()
    trace_event("patches_applied", scope=process, patches=[m.__name__ for m in applied],
                optional_skipped=[m.__name__ for m in skipped])
    return True


def revert_all(process: str) -> None:
    """Undo every patch of ``process`` that can be undone (the replay harness compares
    plugin and upstream scheduling in one process)."""
    for module in patch_modules(process):
        revert = getattr(module, "revert", None)
        if revert is not None:
            revert()
    trace_event("patches_reverted", scope=process)


def render_index() -> str:
    """Markdown index of every patch, generated from the modules' docstrings."""
    lines = ["# Patches over vLLM", "",
             "Generated from the patch modules' docstrings by "
             "`python -m vllm_hybrid_backends.docs`; do not edit by hand.", ""]
    for module in patch_modules():
        short = module.__name__.rsplit(".", 1)[-1]
        lines += [f"## `{short}`", "",
                  f"- target: `{module.TARGET_MODULE}`: "
                  + ", ".join(f"`{s}`" for s in module.TARGET_SYMBOLS),
                  f"- runs in: {module.PROCESS} processes",
                  *(["- optional: applied only where its capability check passes; otherwise "
                     "skipped without blocking the other patches"] if is_optional(module) else []),
                  "",
                  (module.__doc__ or "").strip(), ""]
    return "\n".join(lines)

