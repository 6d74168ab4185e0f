"""Tell the KV-cache coordinator which request a block allocation is for.

- Target: ``vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots``.
- Why: ``KVCacheCoordinator.get_num_blocks_to_allocate`` and ``allocate_new_blocks`` get only a
  request id and token counts; where the plugin's interior tail checkpoints fall depends on the
  request's prompt length (see ``patch_vllm_v1_core_kv_cache_coordinator``).
- How: the wrapper sets :data:`allocating_for` (a context variable) to the request while the
  original runs; nothing else changes.
- Upstream: none (no seam passes the request down).
- vLLM versions: 0.32.x, 0.33.x (same signature).
- Removal: with the interior states of ``patch_vllm_v1_core_kv_cache_coordinator``.
"""

from __future__ import annotations

import contextvars
import importlib
from typing import Any

TARGET_MODULE = "vllm.v1.core.kv_cache_manager"
TARGET_SYMBOLS = ("KVCacheManager.allocate_slots",)
PROCESS = "engine"

_ORIGINALS: dict[str, Any] = {}
#: The request whose slots ``KVCacheManager.allocate_slots`` is allocating, or None.
allocating_for: contextvars.ContextVar[Any] = contextvars.ContextVar("hybrid_allocating_for",
                                                                     default=None)


def _manager_class() -> Any:
    return importlib.import_module(TARGET_MODULE).KVCacheManager


def missing() -> list[str]:
    try:
        cls = _manager_class()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    return [] if callable(getattr(cls, "allocate_slots", None)) else [TARGET_SYMBOLS[0]]


def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    token = allocating_for.set(request)
    try:
        return _ORIGINALS["allocate_slots"](self, request, *args, **kwargs)
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
