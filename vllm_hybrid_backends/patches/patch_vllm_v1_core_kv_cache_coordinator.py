"""Keep the Mamba states at the plugin's checkpoints and at decode boundaries.

- Targets: ``vllm.v1.core.kv_cache_coordinator.replay_boundaries`` and
  ``KVCacheCoordinator.cache_blocks``.
- Why: with the default ``prefix_cache_retention_interval=0`` vLLM hashes (keeps) a Mamba state
  only at the prompt's replay boundary and a shared-prefix junction; every other state is freed
  unhashed, so the tail checkpoints the scheduler patch stops at, and the states crossed while
  decoding, could never be hit. The decode-end state is what the next conversation turn needs.
- How: ``cache_blocks`` records the request it is caching for (a context variable) and delegates
  to the original; the wrapped ``replay_boundaries`` returns vLLM's positions plus
  :func:`vllm_hybrid_backends.align.retained_boundaries` for that request. Only the masks of
  sparse Mamba retention read these positions; attention groups cache every block anyway.
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
TARGET_SYMBOLS = ("replay_boundaries", "KVCacheCoordinator.cache_blocks")
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
    if not callable(getattr(getattr(module, "KVCacheCoordinator", None), "cache_blocks", None)):
        problems.append("KVCacheCoordinator.cache_blocks")
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


def apply() -> None:
    module = _module()
    if module.replay_boundaries is not replay_boundaries:
        _ORIGINALS["replay_boundaries"] = module.replay_boundaries
        module.replay_boundaries = replay_boundaries
    if module.KVCacheCoordinator.cache_blocks is not cache_blocks:
        _ORIGINALS["KVCacheCoordinator.cache_blocks"] = module.KVCacheCoordinator.cache_blocks
        module.KVCacheCoordinator.cache_blocks = cache_blocks


def revert() -> None:
    module = _module()
    if "replay_boundaries" in _ORIGINALS:
        module.replay_boundaries = _ORIGINALS.pop("replay_boundaries")
    if "KVCacheCoordinator.cache_blocks" in _ORIGINALS:
        module.KVCacheCoordinator.cache_blocks = _ORIGINALS.pop("KVCacheCoordinator.cache_blocks")
