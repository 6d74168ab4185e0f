"""Tell the KV-cache coordinator which request a block allocation is for.

- Target: ``vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots``.
- Why: ``KVCacheCoordinator.get_num_blocks_to_allocate`` and ``allocate_new_blocks`` get only a
  request id and token counts; where the plugin's interior tail checkpoints fall depends on the
  request's prompt length (see ``patch_vllm_v1_core_kv_cache_coordinator``).
- How: the wrapper sets :data:`allocating_for` (a context variable) to an :class:`Allocation`
  for the request while the original runs. Interior blocks are optional: when the coordinator
  counted some (``Allocation.interior``) and vLLM then found too few free blocks, the wrapper
  allocates once more without them, so they never keep a request from being scheduled.
  The coordinator's ``get_num_blocks_to_allocate`` and ``allocate_new_blocks`` hooks are
  bound on the coordinator instance for that allocation only (:data:`allocation_hooks`).
  A one-token allocation (a decode step) goes straight to vLLM, and vLLM's own coordinator
  methods run under it: no other frame of this plugin's. Where the installed
  ``allocate_slots`` takes exactly the parameters of :func:`allocate_slots_positional` (vLLM
  0.32), that wrapper is installed: it forwards them positionally, several times cheaper per
  call than ``*args, **kwargs`` (about 17 calls a step on a decode-heavy batch).
- Upstream: none (no seam passes the request down).
- vLLM versions: 0.30.x-0.33.x (same signature, checked when it binds).
- Removal: with the interior states of ``patch_vllm_v1_core_kv_cache_coordinator``.
"""

from __future__ import annotations

import contextvars
import importlib
from types import MethodType
from typing import Any

from ..compat import same_parameters, signature_problem

TARGET_MODULE = "vllm.v1.core.kv_cache_manager"
TARGET_SYMBOLS = ("KVCacheManager.allocate_slots",)
PROCESS = "engine"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"

_ORIGINALS: dict[str, Any] = {}


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
    problem = signature_problem(_ORIGINALS.get("allocate_slots", cls.allocate_slots),
                                TARGET_SYMBOLS[0], ("self", "request", "num_new_tokens"),
                                closed=False)
    return [problem] if problem else []


def allocate_slots(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
    original = _ORIGINALS["allocate_slots"]
    if num_new_tokens <= 1:  # a decode step: no chunk to plan interior blocks in
        return original(self, request, num_new_tokens, *args, **kwargs)
    return _allocate(original, self, request, num_new_tokens, args, kwargs)


def allocate_slots_positional(self: Any, request: Any, num_new_tokens: int,
                              num_new_computed_tokens: int = 0, new_computed_blocks: Any = None,
                              num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                              delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                              full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                              has_scheduled_reqs: bool = True,
                              skip_zeroing_group_ids: tuple[int, ...] = ()) -> Any:
    """:func:`allocate_slots` for a vLLM whose ``allocate_slots`` takes exactly these parameters."""
    original = _ORIGINALS["allocate_slots"]
    if num_new_tokens <= 1:  # a decode step: no chunk to plan interior blocks in
        return original(self, request, num_new_tokens, num_new_computed_tokens,
                        new_computed_blocks, num_lookahead_tokens, num_external_computed_tokens,
                        delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit,
                        reserved_blocks, has_scheduled_reqs, skip_zeroing_group_ids)
    return _allocate(original, self, request, num_new_tokens, (
        num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
        num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens,
        full_sequence_must_fit, reserved_blocks, has_scheduled_reqs, skip_zeroing_group_ids), {})


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


_WRAPPERS = (allocate_slots, allocate_slots_positional)


def apply() -> None:
    cls = _manager_class()
    if cls.allocate_slots not in _WRAPPERS:
        _ORIGINALS["allocate_slots"] = cls.allocate_slots
        cls.allocate_slots = (allocate_slots_positional
                              if same_parameters(cls.allocate_slots, allocate_slots_positional)
                              else allocate_slots)


def revert() -> None:
    if "allocate_slots" in _ORIGINALS:
        _manager_class().allocate_slots = _ORIGINALS.pop("allocate_slots")
