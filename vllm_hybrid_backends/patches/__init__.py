"""Patches over vLLM, one module per patched vLLM module (``patch_<vllm module path>.py``).

Every patch module exposes ``TARGET_MODULE``, ``TARGET_SYMBOLS``, ``PROCESS`` (``worker`` or
``engine``), ``VLLM_VERSIONS`` (the vLLM releases it was written for, a specifier),
``missing() -> list[str]`` (capability check: what it needs and cannot find, including target
signatures that changed, :func:`vllm_hybrid_backends.compat.signature_problem`) and ``apply()``
(idempotent); optionally ``not_needed() -> str | None`` (this vLLM lacks what the patch fixes,
e.g. Mamba2's prefill checkpoint before 0.32) and ``limitation() -> str | None`` (what an
applicable patch leaves to vLLM on this version: the reason of a ready/applied status). :func:`check` turns these into one
:class:`PatchStatus` per module: ``ready``, ``not needed`` or ``refused``; doctor shows the
same. :func:`apply_all` applies the ready patches of a process only if none of its required
patches is refused: never a half-patched engine. A module with ``OPTIONAL = True`` patches a
package that is not always there (vllm-ascend): when its check fails it counts as not needed.
``VLLM_HYBRID_REFUSE_PATCHES`` (comma-separated short names, each optionally ``@<part of a process
name>``) refuses the named patches as if their check had failed: how the tests put engine and
workers out of step (the handshake,
:mod:`vllm_hybrid_backends.handshake`). ``docs/patches.md`` is generated from the module
docstrings (``python -m vllm_hybrid_backends.docs``) and a test keeps it current.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
from dataclasses import dataclass
from types import ModuleType

from ..compat import installed_vllm_version, version_allows
from ..logs import logger
from ..trace import trace_event

READY, NOT_NEEDED, REFUSED, APPLIED = "ready", "not needed", "refused", "applied"
REFUSE_ENV = "VLLM_HYBRID_REFUSE_PATCHES"

PATCH_MODULES = (
    "vllm_hybrid_backends.patches.patch_vllm_platforms",
    "vllm_hybrid_backends.patches.patch_vllm_v1_worker_mamba_utils",
    "vllm_hybrid_backends.patches.patch_vllm_model_executor_layers_mamba_ops_ssd_combined",
    "vllm_hybrid_backends.patches.patch_vllm_model_executor_layers_mamba_mamba_mixer2",
    "vllm_hybrid_backends.patches.patch_vllm_model_executor_layers_mamba_ops_cpu_gdn_attention",
    "vllm_hybrid_backends.patches.patch_vllm_third_party_flash_linear_attention_ops_chunk",
    "vllm_hybrid_backends.patches.patch_vllm_model_executor_layers_mamba_gdn_qwen_gdn_linear_attn",
    "vllm_hybrid_backends.patches.patch_vllm_v1_attention_backends_gdn_attn",
    "vllm_hybrid_backends.patches.patch_vllm_v1_attention_backends_mamba2_attn",
    "vllm_hybrid_backends.patches.patch_vllm_ascend_worker_worker",
    "vllm_hybrid_backends.patches.patch_vllm_v1_engine_core",
    "vllm_hybrid_backends.patches.patch_vllm_v1_core_sched_scheduler",
    "vllm_hybrid_backends.patches.patch_vllm_v1_core_kv_cache_coordinator",
    "vllm_hybrid_backends.patches.patch_vllm_v1_core_kv_cache_manager",
    "vllm_hybrid_backends.patches.patch_vllm_v1_metrics_stats",
    "vllm_hybrid_backends.patches.patch_vllm_v1_metrics_loggers",
)
_announced: set[str] = set()  # process kinds whose patches were announced in this process


def patch_modules(process: str | None = None) -> list[ModuleType]:
    modules = [importlib.import_module(name) for name in PATCH_MODULES]
    return [m for m in modules if process is None or m.PROCESS == process]


def is_optional(module: ModuleType) -> bool:
    return bool(getattr(module, "OPTIONAL", False))


def _short(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class PatchStatus:
    """What one patch module would do (or did) in this process, and why."""

    name: str
    process: str
    state: str  # ready / not needed / refused / applied
    reason: str = ""

    def to_json(self) -> dict[str, str]:
        return {"patch": self.name, "process": self.process, "state": self.state,
                "reason": self.reason}


_applied: set[str] = set()


def forced_refusals() -> set[str]:
    """The patches ``VLLM_HYBRID_REFUSE_PATCHES`` refuses in this process: ``name`` refuses it
    everywhere, ``name@Proc`` only in processes whose name contains ``Proc`` (``EngineCore``,
    ``Worker``). An unknown patch name is an error."""
    process = multiprocessing.current_process().name
    known = {module.rsplit(".", 1)[-1] for module in PATCH_MODULES}
    names = set()
    for entry in filter(None, (e.strip() for e in os.environ.get(REFUSE_ENV, "").split(","))):
        name, _, where = entry.partition("@")
        if name not in known:
            raise ValueError(f"{REFUSE_ENV} names {name!r}, which is no patch; allowed: "
                             f"{', '.join(sorted(known))} (each optionally @<process name part>)")
        if not where or where in process:
            names.add(name)
    return names


def check(module: ModuleType) -> PatchStatus:
    """The status of one patch module against the installed vLLM (the checks apply_all runs)."""
    name, process = _short(module), module.PROCESS
    limitation = getattr(module, "limitation", None)
    limits = (limitation() if limitation is not None else None) or ""
    if name in _applied:
        return PatchStatus(name, process, APPLIED, limits)
    if name in forced_refusals():
        return PatchStatus(name, process, REFUSED, f"refused by {REFUSE_ENV}")
    not_needed = getattr(module, "not_needed", None)
    why_not = not_needed() if not_needed is not None else None
    if why_not:
        return PatchStatus(name, process, NOT_NEEDED, why_not)
    versions = getattr(module, "VLLM_VERSIONS", None)
    if versions is not None and not version_allows(versions):
        return PatchStatus(name, process, REFUSED, f"written for vLLM {versions}, this is "
                                                   f"{installed_vllm_version()}")
    lacking = module.missing()
    if lacking:
        state = NOT_NEEDED if is_optional(module) else REFUSED
        return PatchStatus(name, process, state, "; ".join(lacking))
    return PatchStatus(name, process, READY, limits)


def statuses(process: str | None = None) -> list[PatchStatus]:
    return [check(module) for module in patch_modules(process)]


def apply_all(process: str) -> bool:
    """Apply every ready patch of ``process`` if no required one is refused; return whether
    they were applied. Says once per process what was patched and what not, and why."""
    modules = patch_modules(process)
    checked = [(module, check(module)) for module in modules]
    refused = [status for _, status in checked if status.state == REFUSED]
    if refused:
        problems = [f"{status.name}: {status.reason}" for status in refused]
        logger.warning(
            "hybrid_backends: the %s patches cannot all apply to vLLM %s (%s); patching nothing",
            process, installed_vllm_version(), "; ".join(problems))
        trace_event("patches_skipped", scope=process, problems=problems)
        return False
    applied = [module for module, status in checked if status.state == READY]
    for module in applied:
        module.apply()
        _applied.add(_short(module))
    skipped = [status for _, status in checked if status.state == NOT_NEEDED]
    if process not in _announced:  # once per process kind: what was patched, and what not
        _announced.add(process)
        logger.info("hybrid_backends: %s patches on vLLM %s (pid %d): applied %s%s", process,
                    installed_vllm_version(), os.getpid(),
                    ", ".join(_short(m) for m in applied) or "none",
                    "".join(f"; not needed: {s.name} ({s.reason})" for s in skipped))
    trace_event("patches_applied", scope=process, patches=[m.__name__ for m in applied],
                optional_skipped=[m.__name__ for m, status in checked
                                  if status.state == NOT_NEEDED])
    return True


def revert_all(process: str) -> None:
    """Undo every patch of ``process`` that can be undone (the replay harness compares
    plugin and upstream scheduling in one process)."""
    for module in patch_modules(process):
        revert = getattr(module, "revert", None)
        if revert is not None:
            revert()
        _applied.discard(_short(module))
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
                  f"- written for vLLM: `{module.VLLM_VERSIONS}`",
                  *(["- optional: applied only where its capability check passes; otherwise "
                     "skipped without blocking the other patches"] if is_optional(module) else []),
                  "",
                  (module.__doc__ or "").strip(), ""]
    return "\n".join(lines)

