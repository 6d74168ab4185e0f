"""Counters of the plugin's cache decisions, for vLLM's logging line and Prometheus endpoint.

Off unless ``VLLM_HYBRID_STATS=1`` (read when the patches are applied). The engine process
counts, in :data:`COUNTERS`:

- ``kept``: Mamba states hashed (kept in the prefix cache) by kind: ``tail``, ``decode`` and ``far``
  (the plugin's extra states, :func:`vllm_hybrid_backends.align.retained_boundaries_by_kind`),
  ``resume`` (a preempted prefill's last boundary) and ``vllm`` (those vLLM keeps itself:
  the prompt's replay boundary, junctions); ``passed``: a state of vLLM's that a later prompt
  resumed from and went on past (``VLLM_HYBRID_PASSED_STATES``), counted again when it
  becomes one (kept as ``vllm`` first); its reuse and eviction from then on count as ``passed``;
- ``reused``: prefix hits that end on a kept state, by the state's kind;
- ``evicted``: kept states that vLLM's block pool evicted, by kind;
- ``missed_tokens``: per lookup, the tokens the attention groups held past the hit that the
  hit could not reach, in chunks of the Mamba block, by the replay's reasons
  (:data:`MISS_REASONS`, see :mod:`vllm_hybrid_backends.replay.metrics`).

The scheduler patch hands the change since it last did to ``SchedulerStats.hybrid``
(:func:`take_delta`) on a step with a request output; the loggers patch adds it to ``vllm:hybrid_*`` counters and the log line.
Costs: a few dict updates when a Mamba block is cached or evicted and per lookup; nothing on
a decode step that fills no block.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

STATS_ENV = "VLLM_HYBRID_STATS"
#: Kinds of kept Mamba state.
KINDS = ("vllm", "tail", "decode", "far", "resume", "passed")
#: Reasons a lookup missed tokens the attention cache held (the replay's chunk reasons).
MISS_REASONS = ("no_mamba_state_at_boundary", "evicted", "groups_disagreed", "other")
#: Counter families: name -> (label, label values, help text).
FAMILIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "kept": ("kind", KINDS, "Mamba states kept in the prefix cache, by kind"),
    "reused": ("kind", KINDS, "Prefix-cache hits that end on a kept Mamba state, by its kind"),
    "evicted": ("kind", KINDS, "Kept Mamba states evicted from the prefix cache, by kind"),
    "missed_tokens": ("reason", MISS_REASONS,
                      "Prompt tokens held by the attention cache that a hit could not reach, "
                      "by reason"),
}
#: Forget evicted hashes past this many (the ``evicted`` miss reason then reads ``no state``).
EVICTED_MEMORY = 1 << 16

enabled = False
COUNTERS: Counter[str] = Counter()
_reported: Counter[str] = Counter()
#: block id -> (kind, hash) of the kept Mamba states still cached
_kept: dict[int, tuple[str, Any]] = {}
#: hashes (with group) of evicted Mamba states
_evicted_keys: set[Any] = set()


def _flag() -> bool:
    value = os.environ.get(STATS_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{STATS_ENV}={value!r}: allowed values are 1/0, true/false, yes/no, on/off")


def refresh() -> bool:
    """Read ``VLLM_HYBRID_STATS`` and start from zero."""
    global enabled
    enabled = _flag()
    reset()
    return enabled


def reset() -> None:
    COUNTERS.clear()
    _reported.clear()
    _kept.clear()
    _evicted_keys.clear()


def key(family: str, label: str) -> str:
    return f"{family}:{label}"


def record_kept(kind: str, block: Any) -> None:
    if _kept.get(block.block_id, (None, None))[1] == block.block_hash:
        return
    _kept[block.block_id] = (kind, block.block_hash)
    COUNTERS[key("kept", kind)] += 1


def record_passed(block: Any) -> None:
    """A kept state of vLLM's became a passed one (its later reuse and eviction count so)."""
    if _kept.get(block.block_id, (None, None))[1] == block.block_hash:
        _kept[block.block_id] = ("passed", block.block_hash)
        COUNTERS[key("kept", "passed")] += 1


def kind_of(block: Any) -> str | None:
    entry = _kept.get(block.block_id)
    return entry[0] if entry is not None and entry[1] == block.block_hash else None


def record_reused(block: Any) -> None:
    kind = kind_of(block)
    if kind is not None:
        COUNTERS[key("reused", kind)] += 1


def record_evicted(block_id: int, mamba_keys: Any) -> None:
    """A block was evicted from the pool; ``mamba_keys``: its hashes (with group id) in Mamba
    groups."""
    entry = _kept.pop(block_id, None)
    if entry is not None:
        COUNTERS[key("evicted", entry[0])] += 1
    if mamba_keys:
        if len(_evicted_keys) >= EVICTED_MEMORY:
            _evicted_keys.clear()
        _evicted_keys.update(mamba_keys)


def was_evicted(group_key: Any) -> bool:
    return group_key in _evicted_keys


def record_misses(reasons: dict[str, int]) -> None:
    for reason, tokens in reasons.items():
        COUNTERS[key("missed_tokens", reason)] += tokens


def take_delta() -> dict[str, int] | None:
    """What changed since the previous call (for one ``SchedulerStats``), or None."""
    if COUNTERS == _reported:
        return None
    delta = {k: v - _reported[k] for k, v in COUNTERS.items() if v != _reported[k]}
    _reported.update(delta)
    return delta


def summary(totals: dict[str, int]) -> str:
    """One log line from cumulative totals."""
    parts = []
    for family, (_, labels, _) in FAMILIES.items():
        values = ", ".join(f"{label} {totals.get(key(family, label), 0)}" for label in labels)
        parts.append(f"{family.replace('_', ' ')}: {values}")
    return "hybrid_backends Mamba states: " + "; ".join(parts)


def group_hashes(block_hashes: Any, hash_block_size: int, block_size: int) -> Any:
    if block_size == hash_block_size:
        return block_hashes
    from vllm.v1.core.kv_cache_utils import BlockHashListWithBlockSize

    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)


def attention_reach(coordinator: Any, mamba_managers: list[Any], block_hashes: Any, hit: int,
                    max_length: int) -> int:
    """How far past ``hit`` (up to ``max_length``) every attention group holds the prefix."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    cached = coordinator.block_pool.cached_block_hash_to_block
    mamba_ids = {id(m) for m in mamba_managers}
    reach = max_length
    for gid, manager in enumerate(coordinator.single_type_managers):
        if id(manager) in mamba_ids or reach <= hit:
            continue
        size = manager.block_size
        hashes = group_hashes(block_hashes, coordinator.hash_block_size, size)
        n = hit // size
        while (n + 1) * size <= reach and n < len(hashes) and cached.get_one_block(
                make_block_hash_with_group_id(hashes[n], gid)):
            n += 1
        reach = min(reach, n * size)
    return reach


NO_STATE = "no_mamba_state_at_boundary"


def miss_reason(have: list[bool], evicted: list[bool], attention: bool) -> str:
    """Why a boundary was no hit, from each Mamba group's state there (``have``: cached now,
    ``evicted``: cached once and evicted) and whether the attention blocks before it are cached:
    a state lost in any way (evicted in the groups that lack it, or its attention prefix
    evicted) is ``evicted``; a group that never had it, beside ones that do,
    ``groups_disagreed``; none ever, :data:`NO_STATE`."""
    if not any(have):
        return "evicted" if any(evicted) else NO_STATE
    if not all(have):
        return "evicted" if all(h or e for h, e in zip(have, evicted)) else "groups_disagreed"
    return "other" if attention else "evicted"


def attribute_gap(hit: int, reach: int, step: int,
                  reason_at: Callable[[int], str]) -> dict[str, int]:
    """Split the tokens in ``(hit, reach]`` that a hit could not reach by cause, in ``step``
    chunks: ``reason_at(p)`` says why the boundary ``p`` was no hit (a :data:`MISS_REASONS`
    entry; :data:`NO_STATE` where no Mamba group ever held a state there).

    The deepest boundary that has or had a state decides for everything up to it (with that
    state kept, the hit would have reached it, whatever the boundaries before it had: an
    evicted state there is capacity, not placement); the boundaries past it had no state,
    which is placement. Walks from ``reach`` down and stops at that boundary."""
    first, last = (hit // step + 1) * step, reach // step * step
    position = last
    while position >= first:
        reason = reason_at(position)
        if reason != NO_STATE:
            missed = {reason: position - first + step}
            if last > position:
                missed[NO_STATE] = last - position
            return missed
        position -= step
    return {NO_STATE: last - first + step} if last >= first else {}


def classify_misses(coordinator: Any, mamba_managers: list[Any], block_hashes: Any,
                    hit: int, max_length: int) -> dict[str, int]:
    """Why the Mamba-block chunks past ``hit`` that the attention groups hold were missed
    (:func:`attribute_gap`).

    The same reasons as the replay's lookup-time attribution, with the attention groups'
    reach now (not the replay's attention-only run) as the bound. Runs per lookup.
    """
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    cached = coordinator.block_pool.cached_block_hash_to_block
    hash_size = coordinator.hash_block_size
    reach = attention_reach(coordinator, mamba_managers, block_hashes, hit, max_length)
    if reach <= hit or not mamba_managers:
        return {}
    step = mamba_managers[0].block_size
    groups = [(coordinator.single_type_managers.index(m), m.block_size,
               group_hashes(block_hashes, hash_size, m.block_size)) for m in mamba_managers]

    def reason_at(position: int) -> str:
        have, evicted = [], []
        for gid, size, hashes in groups:
            index = position // size - 1
            known = position % size == 0 and index < len(hashes)
            group_key = make_block_hash_with_group_id(hashes[index], gid) if known else None
            have.append(known and bool(cached.get_one_block(group_key)))
            evicted.append(known and was_evicted(group_key))
        return miss_reason(have, evicted, attention=True)

    return attribute_gap(hit, reach, step, reason_at)
