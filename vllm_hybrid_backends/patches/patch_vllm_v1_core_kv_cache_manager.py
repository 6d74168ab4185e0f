"""Tell the KV-cache coordinator which request a block allocation is for.

- Target: ``vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots``.
- Why: ``KVCacheCoordinator.get_num_blocks_to_allocate`` and ``allocate_new_blocks`` get only a
  request id and token counts; where the plugin's interior tail checkpoints fall depends on the
  request's prompt length (see ``patch_vllm_v1_core_kv_cache_coordinator``).
- How: :func:`allocate_slots` sets :data:`allocating_for` (a context variable) to an
  :class:`Allocation` for the request while vLLM's runs. Interior blocks are optional: when the
  coordinator counted some (``Allocation.interior``) and vLLM then found too few free blocks, it
  allocates once more without them, so they never keep a request from being scheduled.
  The coordinator's ``get_num_blocks_to_allocate`` and ``allocate_new_blocks`` hooks are
  bound on the coordinator instance for that allocation only (:data:`allocation_hooks`).
  It is not installed on the class: the scheduler patch binds it on the manager instance
  (:func:`arm`) just before vLLM allocates a prefill chunk or a multi-token decode step, and it
  unbinds itself once the allocation succeeds. A one-token decode step (most calls: one per
  running request per step) calls vLLM's own ``allocate_slots`` and coordinator methods, with no
  frame of this plugin's.
- Upstream: none (no seam passes the request down).
- vLLM versions: 0.23.x, 0.26.x, 0.30.x-0.33.x (``self, request, num_new_tokens`` first, checked
  when the patch applies).
- Removal: with the interior states of ``patch_vllm_v1_core_kv_cache_coordinator``.
"""

from __future__ import annotations

import contextvars
import importlib
from types import MethodType
from typing import Any

from ..compat import signature_problem

TARGET_MODULE = "vllm.v1.core.kv_cache_manager"
TARGET_SYMBOLS = ("KVCacheManager.allocate_slots",)
PROCESS = "engine"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"

class Allocation:
    """The request ``allocate_slots`` is allocating for, whether interior blocks were counted,
    and where the coordinator planned them for ``allocate_new_blocks``."""

    __slots__ = ("request", "interior", "plan", "trial", "end_trial")

    def __init__(self, request: Any) -> None:
        self.request = request
        self.interior = False
        #: [(KV-cache group index, block-table columns)] of the interior blocks to place, or None
        self.plan: list[tuple[int, list[int]]] | None = None
        #: block-table column -> kind of the planned interior states the ledger refused, kept on
        #: trial once their blocks are placed
        self.trial: dict[int, str] = {}
        #: kinds (refused or far) of the chunk end's state, kept on trial once the chunk's
        #: blocks are allocated
        self.end_trial: list[str] = []


#: The allocation ``KVCacheManager.allocate_slots`` is running, or None.
allocating_for: contextvars.ContextVar[Allocation | None] = contextvars.ContextVar(
    "hybrid_allocating_for", default=None)
#: (method name, function) of the coordinator methods that act only inside a multi-token
#: allocation: bound on the request's coordinator instance while :func:`_allocate` runs, so a
#: decode step calls vLLM's own. Set by ``patch_vllm_v1_core_kv_cache_coordinator.apply``.
allocation_hooks: tuple[tuple[str, Any], ...] = ()


def _manager_class() -> Any:
    return importlib.import_module(TARGET_MODULE).KVCacheManager


def missing() -> list[str]:
    try:
        cls = _manager_class()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    if not callable(getattr(cls, "allocate_slots", None)):
        return [TARGET_SYMBOLS[0]]
    problem = signature_problem(cls.allocate_slots, TARGET_SYMBOLS[0],
                                ("self", "request", "num_new_tokens"), closed=False)
    return [problem] if problem else []


def arm(manager: Any) -> None:
    """Route ``manager``'s next successful ``allocate_slots`` through :func:`allocate_slots`
    (bound on the instance): the scheduler patch arms it for a prefill chunk or a multi-token
    decode step just before vLLM allocates for it, so a one-token decode step calls vLLM's own
    method, with no frame of this plugin's."""
    manager.allocate_slots = MethodType(allocate_slots, manager)


def allocate_slots(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
    """Armed on the manager instance (:func:`arm`) for one allocation; disarms once it succeeds
    (vLLM retries a failed one for the same request after a preemption)."""
    original = type(self).allocate_slots
    if num_new_tokens <= 1:  # no chunk to plan interior blocks in
        blocks = original(self, request, num_new_tokens, *args, **kwargs)
    else:
        blocks = _allocate(original, self, request, num_new_tokens, args, kwargs)
    if blocks is not None:
        disarm(self, "allocate_slots")
    return blocks


def disarm(instance: Any, name: str) -> None:
    """Remove the plugin's method ``name`` bound on ``instance`` (``delattr``: reading the
    instance's ``__dict__`` would give up its compact attribute storage for good)."""
    try:
        delattr(instance, name)
    except AttributeError:
        pass  # disarmed already (a nested call)


def _allocate(original: Any, manager: Any, request: Any, num_new_tokens: int,
              args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    allocation = Allocation(request)
    coordinator, hooks = manager.coordinator, allocation_hooks
    for name, hook in hooks:
        setattr(coordinator, name, MethodType(hook, coordinator))
    token = allocating_for.set(allocation)
    try:
        blocks = original(manager, request, num_new_tokens, *args, **kwargs)
        if blocks is None and allocation.interior:
            allocating_for.set(None)  # not enough blocks with them: allocate without
            blocks = original(manager, request, num_new_tokens, *args, **kwargs)
        return blocks
    finally:
        for name, _ in hooks:  # delattr, not vars(): keeps the instance's attribute storage
            delattr(coordinator, name)
        allocating_for.reset(token)


def apply() -> None:
    """Nothing on the class: :func:`arm` binds the wrapper per allocation."""


def revert() -> None:
    """Nothing on the class; an instance still armed belongs to an engine built under the
    plugin."""
