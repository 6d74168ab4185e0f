"""Keep the Mamba states at the plugin's checkpoints and at decode boundaries, and evict a
finished request's cached prefix from its end, all groups together.

- Targets: ``vllm.v1.core.kv_cache_coordinator.replay_boundaries``,
  ``KVCacheCoordinator.cache_blocks`` and ``KVCacheCoordinator.free``.
- Why: with the default ``prefix_cache_retention_interval=0`` vLLM hashes (keeps) a Mamba state
  only at the prompt's replay boundary and a shared-prefix junction; every other state is freed
  unhashed, so the tail checkpoints the scheduler patch stops at, and the states crossed while
  decoding, could never be hit. The decode-end state is what the next conversation turn needs.
  ``free`` hands each group's blocks to the pool group after group, attention first, so all of a
  request's attention blocks are evicted before any of its Mamba states: kept snapshots then
  outlive the attention prefix they need and push other prefixes out.
- How: ``cache_blocks`` records the request it is caching for (a context variable) and delegates
  to the original; the wrapped ``replay_boundaries`` returns vLLM's positions plus
  :func:`vllm_hybrid_backends.align.retained_boundaries` for that request. Only the masks of
  sparse Mamba retention read these positions; attention groups cache every block anyway.
  ``free`` pops every group's blocks (``pop_blocks_for_free``, so subclasses keep their
  bookkeeping) and frees them in :func:`vllm_hybrid_backends.align.suffix_eviction_order`.
- Upstream: vLLM #50551 (decode-end states for conversation reuse, open); retention semantics in
  ``vllm_map.md`` §4(d).
- vLLM versions: 0.32.x, 0.33.x (same signatures).
- Removal: when vLLM keeps caller-chosen boundaries itself.
"""

from __future__ import annotations

import contextvars
import importlib
from typing import Any

from .. import align

TARGET_MODULE = "vllm.v1.core.kv_cache_coordinator"
TARGET_SYMBOLS = ("replay_boundaries", "KVCacheCoordinator.cache_blocks", "KVCacheCoordinator.free")
PROCESS = "engine"

_ORIGINALS: dict[str, Any] = {}
_caching_for: contextvars.ContextVar[Any] = contextvars.ContextVar("hybrid_caching_for", default=None)


def _module() -> Any:
    return importlib.import_module(TARGET_MODULE)


def missing() -> list[str]:
    try:
        module = _module()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    problems = []
    if not callable(getattr(module, "replay_boundaries", None)):
        problems.append("replay_boundaries")
    coordinator = getattr(module, "KVCacheCoordinator", None)
    for name in ("cache_blocks", "free", "pop_blocks_for_free"):
        if not callable(getattr(coordinator, name, None)):
            problems.append(f"KVCacheCoordinator.{name}")
    return problems


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool) -> tuple[int, ...]:
    base = _ORIGINALS["replay_boundaries"](num_prompt_tokens, scheduler_block_size, use_eagle)
    request = _caching_for.get()
    if request is None:
        return base
    extra = align.retained_boundaries(num_prompt_tokens, request.num_tokens, scheduler_block_size,
                                      align.current_policy())
    return tuple(sorted(set(base).union(extra))) if extra else base


def cache_blocks(self: Any, request: Any, num_computed_tokens: int) -> None:
    token = _caching_for.set(request)
    try:
        _ORIGINALS["KVCacheCoordinator.cache_blocks"](self, request, num_computed_tokens)
    finally:
        _caching_for.reset(token)


def free(self: Any, request_id: str) -> None:
    if not align.current_policy().suffix_eviction:
        _ORIGINALS["KVCacheCoordinator.free"](self, request_id)
        return
    groups = [(manager.block_size, manager.pop_blocks_for_free(request_id))
              for manager in self.single_type_managers]
    self.block_pool.free_blocks(align.suffix_eviction_order(groups))


def apply() -> None:
    module = _module()
    if module.replay_boundaries is not replay_boundaries:
        _ORIGINALS["replay_boundaries"] = module.replay_boundaries
        module.replay_boundaries = replay_boundaries
    if module.KVCacheCoordinator.cache_blocks is not cache_blocks:
        _ORIGINALS["KVCacheCoordinator.cache_blocks"] = module.KVCacheCoordinator.cache_blocks
        module.KVCacheCoordinator.cache_blocks = cache_blocks
    if module.KVCacheCoordinator.free is not free:
        _ORIGINALS["KVCacheCoordinator.free"] = module.KVCacheCoordinator.free
        module.KVCacheCoordinator.free = free


def revert() -> None:
    module = _module()
    if "replay_boundaries" in _ORIGINALS:
        module.replay_boundaries = _ORIGINALS.pop("replay_boundaries")
    if "KVCacheCoordinator.cache_blocks" in _ORIGINALS:
        module.KVCacheCoordinator.cache_blocks = _ORIGINALS.pop("KVCacheCoordinator.cache_blocks")
    if "KVCacheCoordinator.free" in _ORIGINALS:
        module.KVCacheCoordinator.free = _ORIGINALS.pop("KVCacheCoordinator.free")
