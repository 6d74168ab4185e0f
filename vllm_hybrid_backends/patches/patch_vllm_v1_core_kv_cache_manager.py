"""Tell the KV-cache coordinator which request a block allocation is for.

- Target: ``vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots``.
- Why: ``KVCacheCoordinator.get_num_blocks_to_allocate`` and ``allocate_new_blocks`` get only a
  request id and token counts; where the plugin's interior tail checkpoints fall depends on the
  request's prompt length (see ``patch_vllm_v1_core_kv_cache_coordinator``).
- How: the wrapper sets :data:`allocating_for` (a context variable) to an :class:`Allocation`
  for the request while the original runs. Interior blocks are optional: when the coordinator
  counted some (``Allocation.interior``) and vLLM then found too few free blocks, the wrapper
  allocates once more without them, so they never keep a request from being scheduled.
- Upstream: none (no seam passes the request down).
- vLLM versions: 0.30.x-0.33.x (same signature, checked when it binds).
- Removal: with the interior states of ``patch_vllm_v1_core_kv_cache_coordinator``.
"""

from __future__ import annotations

import contextvars
import importlib
from typing import Any

from ..compat import signature_problem

TARGET_MODULE = "vllm.v1.core.kv_cache_manager"
TARGET_SYMBOLS = ("KVCacheManager.allocate_slots",)
PROCESS = "engine"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"

_ORIGINALS: dict[str, Any] = {}
class Allocation:
    """The request ``allocate_slots`` is allocating for, and whether interior blocks were counted."""

    __slots__ = ("request", "interior")

    def __init__(self, request: Any) -> None:
        self.request = request
        self.interior = False


#: The allocation ``KVCacheManager.allocate_slots`` is running, or None.
allocating_for: contextvars.ContextVar[Allocation | None] = contextvars.ContextVar(
    "hybrid_allocating_for", default=None)


def _manager_class() -> Any:
    return importlib.import_module(TARGET_MODULE).KVCacheManager


def missing() -> list[str]:
    try:
        cls = _manager_class()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    if not callable(getattr(cls, "allocate_slots", None)):
        return [TARGET_SYMBOLS[0]]
    problem = signature_problem(_ORIGINALS.get("allocate_slots", cls.allocate_slots),
                                TARGET_SYMBOLS[0], ("self", "request", "num_new_tokens"),
                                closed=False)
    return [problem] if problem else []


def allocate_slots(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
    if num_new_tokens <= 1:  # a decode step: no chunk to plan interior blocks in
        return _ORIGINALS["allocate_slots"](self, request, num_new_tokens, *args, **kwargs)
    allocation = Allocation(request)
    token = allocating_for.set(allocation)
    try:
        blocks = _ORIGINALS["allocate_slots"](self, request, num_new_tokens, *args, **kwargs)
        if blocks is None and allocation.interior:
            allocating_for.set(None)  # not enough blocks with them: allocate without
            blocks = _ORIGINALS["allocate_slots"](self, request, num_new_tokens, *args, **kwargs)
        return blocks
    finally:
        allocating_for.reset(token)


def apply() -> None:
    cls = _manager_class()
    if cls.allocate_slots is not allocate_slots:
        _ORIGINALS["allocate_slots"] = cls.allocate_slots
        cls.allocate_slots = allocate_slots


def revert() -> None:
    if "allocate_slots" in _ORIGINALS:
        _manager_class().allocate_slots = _ORIGINALS.pop("allocate_slots")
