"""Replay policies: which patches over vLLM's scheduler process are active during a run.

``upstream`` is the installed vLLM with its defaults and the plugin off. ``plugin`` applies the
plugin's engine-process patches (``vllm_hybrid_backends.patches`` with ``PROCESS == "engine"``)
for the duration of the run and reverts them afterwards, so both policies can run in one
process. A scheduling/caching patch joins the ``plugin`` policy by being an engine-process patch
module; :class:`Policy` takes any further patch modules explicitly (``extra_patches``).

Reverting is generic: before a patch module's ``apply()`` runs, every attribute named by its
``TARGET_SYMBOLS`` (dotted paths relative to ``TARGET_MODULE`` or absolute module paths) is
snapshotted on the object that owns it (for an instance attribute path, also on the instance's
class, where patches usually install classmethods), and restored on exit.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = ["POLICIES", "Policy", "get_policy", "patched_targets", "revertible_patches"]

_MISSING = object()


def _resolve_owner(module: ModuleType, symbol: str) -> tuple[list[Any], str]:
    """Objects that may own ``symbol``'s last attribute, and that attribute's name."""
    *path, attr = symbol.split(".")
    owner: Any = module
    if path and path[0] == "vllm":  # an absolute module path
        for split in range(len(path), 0, -1):
            try:
                owner = importlib.import_module(".".join(path[:split]))
            except ImportError:
                continue
            for name in path[split:]:
                owner = getattr(owner, name)
            break
    else:
        for name in path:
            owner = getattr(owner, name)
    owners = [owner]
    if not isinstance(owner, (ModuleType, type)):
        owners.append(type(owner))
    return owners, attr


@contextlib.contextmanager
def revertible_patches(patch_modules: Sequence[ModuleType]) -> Iterator[list[str]]:
    """Apply the patch modules (all-or-nothing), yield their names, restore on exit.

    The same checks as :func:`vllm_hybrid_backends.patches.apply_all`: a patch this vLLM does
    not need (or an optional one whose check fails) is left out, a refused one fails the rest.
    """
    from ..patches import APPLIED, NOT_NEEDED, REFUSED, check

    statuses = {m: check(m) for m in patch_modules}
    problems = [f"{m.__name__}: {status.reason}" for m, status in statuses.items()
                if status.state == REFUSED]
    if problems:
        raise RuntimeError("cannot apply the plugin's patches: " + "; ".join(problems))
    patch_modules = [m for m in patch_modules if statuses[m].state not in (NOT_NEEDED, APPLIED)]
    saved: list[tuple[Any, str, Any]] = []
    for module in patch_modules:
        target = importlib.import_module(module.TARGET_MODULE)
        for symbol in module.TARGET_SYMBOLS:
            owners, attr = _resolve_owner(target, symbol)
            for owner in owners:
                saved.append((owner, attr, vars(owner).get(attr, _MISSING)))
    try:
        for module in patch_modules:
            module.apply()
        yield [m.__name__.rsplit(".", 1)[-1] for m in patch_modules]
    finally:
        # a patch's own revert undoes what no symbol snapshot sees (e.g. a dataclass field)
        for module in reversed(patch_modules):
            revert = getattr(module, "revert", None)
            if revert is not None:
                revert()
        for owner, attr, value in reversed(saved):
            if value is _MISSING:
                if attr in vars(owner):
                    delattr(owner, attr)
            else:
                setattr(owner, attr, value)


@dataclass(frozen=True)
class Policy:
    """A named set of scheduler-process patches applied around one replay run."""

    name: str
    use_plugin_patches: bool
    description: str
    extra_patches: tuple[str, ...] = field(default=())

    def patch_modules(self) -> list[ModuleType]:
        modules: list[ModuleType] = []
        if self.use_plugin_patches:
            from .. import patches

            modules += patches.patch_modules("engine")
        modules += [importlib.import_module(name) for name in self.extra_patches]
        return modules

    @contextlib.contextmanager
    def active(self) -> Iterator[list[str]]:
        """Apply this policy's patches for the duration of the block; yield their names."""
        if not self.use_plugin_patches:
            from .. import patches

            leftover = patched_targets(patches.patch_modules("engine"))
            if leftover:
                # e.g. vLLM loaded the plugin in this process (general plugins), for good
                raise RuntimeError(
                    "the plugin's patches are already applied in this process ("
                    + ", ".join(leftover) + "), so an upstream baseline cannot run here; "
                    "use a fresh process, or VLLM_PLUGINS without hybrid_backends")
        with revertible_patches(self.patch_modules()) as applied:
            yield applied


def patched_targets(patch_modules: Sequence[ModuleType]) -> list[str]:
    """The patch targets whose current value comes from this package (i.e. patched)."""
    found = []
    for module in patch_modules:
        try:
            target = importlib.import_module(module.TARGET_MODULE)
        except ImportError:
            continue
        for symbol in module.TARGET_SYMBOLS:
            try:
                owners, attr = _resolve_owner(target, symbol)
            except (AttributeError, ImportError):
                continue
            value = getattr(owners[-1], attr, None)
            value = getattr(value, "__func__", value)
            if getattr(value, "__module__", "").startswith(__name__.split(".")[0] + "."):
                found.append(symbol)
    return found


POLICIES = {
    "upstream": Policy("upstream", False, "installed vLLM, its defaults, plugin off"),
    "plugin": Policy("plugin", True, "installed vLLM with the plugin's engine-process patches"),
}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; allowed: {', '.join(POLICIES)}") from None
