"""Keep the Mamba states at the plugin's checkpoints and at decode boundaries, and evict a
finished request's cached prefix from its end, all groups together.

- Targets: ``vllm.v1.core.kv_cache_coordinator.replay_boundaries``,
  ``KVCacheCoordinator.cache_blocks``, ``KVCacheCoordinator.free``,
  ``KVCacheCoordinator.remove_skipped_blocks`` and
  ``HybridKVCacheCoordinator.find_longest_cache_hit``.
- Why: with the default ``prefix_cache_retention_interval=0`` vLLM hashes (keeps) a Mamba state
  only at the prompt's replay boundary and a shared-prefix junction; every other state is freed
  unhashed, so the tail checkpoints the scheduler patch stops at, and the states crossed while
  decoding, could never be hit. The decode-end state is what the next conversation turn needs.
  ``free`` hands each group's blocks to the pool group after group, attention first, so all of a
  request's attention blocks are evicted before any of its Mamba states: kept snapshots then
  outlive the attention prefix they need and push other prefixes out.
- How: ``cache_blocks`` records the request it is caching for (a context variable) and delegates
  to the original; the wrapped ``replay_boundaries`` returns vLLM's positions plus
  :func:`vllm_hybrid_backends.align.retained_boundaries_by_kind` for that request (the kinds
  the retention ledger admits). Only the masks of
  sparse Mamba retention read these positions; attention groups cache every block anyway.
  ``free`` pops every group's blocks (``pop_blocks_for_free``, so subclasses keep their
  bookkeeping) and frees them in :func:`vllm_hybrid_backends.align.suffix_eviction_order`.
  With ``VLLM_HYBRID_ADAPTIVE_RETENTION``, a :class:`vllm_hybrid_backends.align.RetentionLedger`
  learns which kinds of extra state get reused: ``cache_blocks`` records the states it kept,
  ``find_longest_cache_hit`` the ones a hit ends on; a kind that is not reused is no longer
  kept (nor split for, see the scheduler patch). When vLLM hands a kept state back to the pool
  (align mode does so mid-run, in ``remove_skipped_blocks``, or in ``free``) and it was never
  reused and its kind is unproven, it moves in front of every other cached block in vLLM's free
  queue (after the uncached ones), so a snapshot nobody reuses never evicts an attention prefix
  or a state vLLM itself keeps.
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
TARGET_SYMBOLS = ("replay_boundaries", "KVCacheCoordinator.cache_blocks", "KVCacheCoordinator.free",
                  "KVCacheCoordinator.remove_skipped_blocks",
                  "HybridKVCacheCoordinator.find_longest_cache_hit")
PROCESS = "engine"

_ORIGINALS: dict[str, Any] = {}
#: (request, policy, memo of admitted boundaries) while ``cache_blocks`` runs for a request.
_caching_for: contextvars.ContextVar[Any] = contextvars.ContextVar("hybrid_caching_for", default=None)
#: What this engine process has learned about which extra states get reused (one per process).
LEDGER = align.RetentionLedger()
#: request id -> {ledger block id: (that block, its hash, the state's blocks in every Mamba group)}
#: for the extra states it kept, until vLLM hands them back to the pool.
_KEPT_STATES: dict[str, dict[int, tuple[Any, Any, list[Any]]]] = {}


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
    for name in ("cache_blocks", "free", "pop_blocks_for_free", "remove_skipped_blocks"):
        if not callable(getattr(coordinator, name, None)):
            problems.append(f"KVCacheCoordinator.{name}")
    hybrid = getattr(module, "HybridKVCacheCoordinator", None)
    if not callable(getattr(hybrid, "find_longest_cache_hit", None)):
        problems.append("HybridKVCacheCoordinator.find_longest_cache_hit")
    return problems


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool) -> tuple[int, ...]:
    base = _ORIGINALS["replay_boundaries"](num_prompt_tokens, scheduler_block_size, use_eagle)
    caching = _caching_for.get()
    if caching is None:
        return base
    request, policy, memo = caching
    extra = _admitted_boundaries(request, policy, num_prompt_tokens, scheduler_block_size, memo)
    if not extra:
        return base
    return tuple(sorted(set(base).union(p for positions in extra.values() for p in positions)))


def _admitted_boundaries(request: Any, policy: align.AlignPolicy, num_prompt_tokens: int,
                         block_size: int, memo: dict[Any, Any]) -> dict[str, tuple[int, ...]]:
    found = memo.get((num_prompt_tokens, block_size))
    if found is None:
        kinds = align.retained_boundaries_by_kind(num_prompt_tokens, request.num_tokens,
                                                  block_size, policy)
        found = {kind: positions for kind, positions in kinds.items()
                 if not policy.adaptive_retention or LEDGER.admits(kind, request.request_id)}
        memo[(num_prompt_tokens, block_size)] = found
    return found


def _mamba_managers(coordinator: Any) -> list[Any]:
    known = getattr(coordinator, "_hybrid_mamba_managers", None)
    if known is None:
        known = [m for m in coordinator.single_type_managers
                 if hasattr(m, "has_prefill_checkpoint_blocks")]
        coordinator._hybrid_mamba_managers = known
    return known


def _one_per_block_size(coordinator: Any, managers: list[Any]) -> list[Any]:
    known = getattr(coordinator, "_hybrid_mamba_per_block_size", None)
    if known is None:
        known = list({m.block_size: m for m in managers}.values())
        coordinator._hybrid_mamba_per_block_size = known
    return known


def _record_kept_states(coordinator: Any, request: Any, policy: align.AlignPolicy,
                        memo: dict[Any, Any]) -> None:
    managers = _mamba_managers(coordinator)
    if not managers:
        return
    manager = managers[0]  # every Mamba group keeps the same positions
    size = manager.block_size
    extra = _admitted_boundaries(request, policy, request.num_prompt_tokens, size, memo)
    blocks = manager.req_to_blocks.get(request.request_id, ())
    for kind, positions in extra.items():
        for position in positions:
            index = position // size - 1
            if position % size or not 0 <= index < len(blocks):
                continue
            block = blocks[index]
            if block.is_null or block.block_hash is None:
                continue
            if getattr(block, "block_hash_num_tokens", position) == position:
                LEDGER.record_kept(kind, block.block_id, block.block_hash)
                group_blocks = [m.req_to_blocks[request.request_id][index] for m in managers
                                if m.block_size == size
                                and index < len(m.req_to_blocks.get(request.request_id, ()))]
                _KEPT_STATES.setdefault(request.request_id, {})[block.block_id] = (
                    block, block.block_hash, [b for b in group_blocks if not b.is_null])


def _release_probation(block_pool: Any, request_id: str, *, finished: bool) -> None:
    """Move a request's kept extra states that vLLM has handed back to the pool and that are
    on probation (:meth:`align.RetentionLedger.on_probation`) in front of the cached blocks."""
    kept = _KEPT_STATES.get(request_id)
    if not kept:
        return
    front: list[Any] = []
    for key_id, (key, key_hash, blocks) in list(kept.items()):
        if key.block_hash != key_hash:  # evicted and reused meanwhile
            del kept[key_id]
            continue
        if all(b.ref_cnt == 0 and b.prev_free_block is not None for b in blocks):
            del kept[key_id]
            if LEDGER.on_probation(key_id, key_hash):
                front += [b for b in blocks if b.block_hash is not None]
    if finished:
        _KEPT_STATES.pop(request_id, None)
    if front:
        _evict_first_among_cached(block_pool.free_block_queue, front)


def remove_skipped_blocks(self: Any, request_id: str, *args: Any, **kwargs: Any) -> None:
    _ORIGINALS["KVCacheCoordinator.remove_skipped_blocks"](self, request_id, *args, **kwargs)
    if request_id in _KEPT_STATES:
        _release_probation(self.block_pool, request_id, finished=False)


def _internal_prefill_checkpoints(coordinator: Any) -> bool:
    """The scheduler's ``mamba_has_prefill_checkpoint_blocks``, from the coordinator's managers."""
    known = getattr(coordinator, "_hybrid_internal_prefill_checkpoints", None)
    if known is None:
        mamba = _mamba_managers(coordinator)
        known = bool(mamba) and all(m.has_prefill_checkpoint_blocks for m in mamba)
        coordinator._hybrid_internal_prefill_checkpoints = known
    return known


def cache_blocks(self: Any, request: Any, num_computed_tokens: int) -> None:
    managers = _mamba_managers(self)
    for manager in _one_per_block_size(self, managers):  # groups of one size cache in lockstep
        if manager.num_cached_block.get(request.request_id, 0) < num_computed_tokens // manager.block_size:
            break
    else:
        # No Mamba block becomes full: the boundaries cannot matter (the hot decode path).
        _ORIGINALS["KVCacheCoordinator.cache_blocks"](self, request, num_computed_tokens)
        return
    policy = align.active_policy()
    if policy.tail_checkpoints and _internal_prefill_checkpoints(self):
        policy = align.policy_for_model(policy, internal_prefill_checkpoints=True)
    memo: dict[Any, Any] = {}
    token = _caching_for.set((request, policy, memo))
    try:
        _ORIGINALS["KVCacheCoordinator.cache_blocks"](self, request, num_computed_tokens)
    finally:
        _caching_for.reset(token)
    if policy.adaptive_retention:
        _record_kept_states(self, request, policy, memo)


def find_longest_cache_hit(self: Any, block_hashes: Any, max_cache_hit_length: int) -> Any:
    result = _ORIGINALS["HybridKVCacheCoordinator.find_longest_cache_hit"](
        self, block_hashes, max_cache_hit_length)
    managers = _mamba_managers(self)
    if result[1] > 0 and managers:
        hit = result[0][self.single_type_managers.index(managers[0])]
        if hit and not hit[-1].is_null and hit[-1].block_hash is not None:
            LEDGER.record_hit(hit[-1].block_id, hit[-1].block_hash)
    return result


def free(self: Any, request_id: str) -> None:
    LEDGER.forget_request(request_id)
    if not align.active_policy().suffix_eviction:
        _ORIGINALS["KVCacheCoordinator.free"](self, request_id)
        _release_probation(self.block_pool, request_id, finished=True)
        return
    groups = [(manager.block_size, manager.pop_blocks_for_free(request_id))
              for manager in self.single_type_managers]
    ordered = align.suffix_eviction_order(groups)
    self.block_pool.free_blocks(ordered)
    _release_probation(self.block_pool, request_id, finished=True)


#: How far past the uncached free blocks to look for the oldest cached one; beyond it the pool
#: has that many uncached blocks free, nothing is under pressure and LRU order is kept.
PROBATION_SCAN = 64


def _evict_first_among_cached(queue: Any, blocks: list[Any]) -> None:
    """Move freed ``blocks`` from the LRU end of vLLM's free queue to just before its oldest
    cached block: after the uncached free blocks (reused first anyway), before every cached one."""
    blocks = [b for b in blocks if b.ref_cnt == 0 and b.prev_free_block is not None]
    if not blocks:
        return
    anchor = queue.fake_free_list_head
    for _ in range(PROBATION_SCAN):
        following = anchor.next_free_block
        if following is queue.fake_free_list_tail or following.block_hash is not None:
            break
        anchor = following
    else:
        return  # plenty of uncached blocks free: no pressure, LRU order stays
    for block in blocks:
        queue.remove(block)
    following = anchor.next_free_block
    for block in blocks:
        anchor.next_free_block, block.prev_free_block = block, anchor
        anchor = block
    anchor.next_free_block, following.prev_free_block = following, anchor
    queue.num_free_blocks += len(blocks)


def apply() -> None:
    global LEDGER
    align.refresh_policy()
    module = _module()
    if module.HybridKVCacheCoordinator.find_longest_cache_hit is not find_longest_cache_hit:
        LEDGER = align.RetentionLedger()
        _KEPT_STATES.clear()
        _ORIGINALS["HybridKVCacheCoordinator.find_longest_cache_hit"] = (
            module.HybridKVCacheCoordinator.find_longest_cache_hit)
        module.HybridKVCacheCoordinator.find_longest_cache_hit = find_longest_cache_hit
    if module.replay_boundaries is not replay_boundaries:
        _ORIGINALS["replay_boundaries"] = module.replay_boundaries
        module.replay_boundaries = replay_boundaries
    if module.KVCacheCoordinator.cache_blocks is not cache_blocks:
        _ORIGINALS["KVCacheCoordinator.cache_blocks"] = module.KVCacheCoordinator.cache_blocks
        module.KVCacheCoordinator.cache_blocks = cache_blocks
    if module.KVCacheCoordinator.remove_skipped_blocks is not remove_skipped_blocks:
        _ORIGINALS["KVCacheCoordinator.remove_skipped_blocks"] = (
            module.KVCacheCoordinator.remove_skipped_blocks)
        module.KVCacheCoordinator.remove_skipped_blocks = remove_skipped_blocks
    if module.KVCacheCoordinator.free is not free:
        _ORIGINALS["KVCacheCoordinator.free"] = module.KVCacheCoordinator.free
        module.KVCacheCoordinator.free = free


def revert() -> None:
    module = _module()
    if "HybridKVCacheCoordinator.find_longest_cache_hit" in _ORIGINALS:
        module.HybridKVCacheCoordinator.find_longest_cache_hit = _ORIGINALS.pop(
            "HybridKVCacheCoordinator.find_longest_cache_hit")
    if "replay_boundaries" in _ORIGINALS:
        module.replay_boundaries = _ORIGINALS.pop("replay_boundaries")
    if "KVCacheCoordinator.cache_blocks" in _ORIGINALS:
        module.KVCacheCoordinator.cache_blocks = _ORIGINALS.pop("KVCacheCoordinator.cache_blocks")
    if "KVCacheCoordinator.remove_skipped_blocks" in _ORIGINALS:
        module.KVCacheCoordinator.remove_skipped_blocks = _ORIGINALS.pop(
            "KVCacheCoordinator.remove_skipped_blocks")
    if "KVCacheCoordinator.free" in _ORIGINALS:
        module.KVCacheCoordinator.free = _ORIGINALS.pop("KVCacheCoordinator.free")
