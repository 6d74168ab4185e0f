"""Stop align-mode prefill chunks at the plugin's checkpoints and on the Mamba grid.

- Targets: ``vllm.v1.core.sched.scheduler.Scheduler._mamba_block_aligned_split`` and
  ``Scheduler._preempt_request`` (plus the stats and junction targets below).
- Why: vLLM materialises a Mamba state only where a prefill chunk ends, and keeps just the
  prompt's last aligned boundary (plus a shared-prefix junction seen *while* a second request
  prefills). A request that later diverges inside an earlier prompt therefore recomputes from
  token 0 (the agentic/incremental miss). Separately, the split aligns on
  ``cache_config.block_size`` (the smallest group's block), so with a coarser Mamba block a
  chunk can end off the Mamba grid and a state is cached under the wrong boundary.
- How: a decode step (the chunk starts at or past the prefill end, where vLLM's split returns
  the count unchanged: ``tests/test_align.py`` checks it on the installed vLLM) returns at
  once, the scheduler calls this for every running request each step; it only arms the KV-cache
  patches for the allocation that follows where that needs them (a multi-token step, a Mamba
  block that may fill: ``patch_vllm_v1_core_kv_cache_manager.arm``,
  ``patch_vllm_v1_core_kv_cache_coordinator.watch_caching``), so that every other decode step
  runs vLLM's own allocation and caching; a prefill chunk arms both (and ``_preempt_request``
  resets the request's next-fill mark: its cached blocks go). Both wrappers sit on the class
  that defines the method, so subclasses of vLLM's scheduler (its AsyncScheduler,
  vllm-ascend's) all reach them. Otherwise the original
  decides the chunk; :func:`vllm_hybrid_backends.align.chunk_end` then stops
  it at the first tail checkpoint inside it (``VLLM_HYBRID_TAIL_CHECKPOINTS``) and floors a
  non-final end to the scheduler's LCM block (``VLLM_HYBRID_MAMBA_GRID``). Tail kinds the
  retention ledger does not admit for the request are not stopped at
  (``VLLM_HYBRID_ADAPTIVE_RETENTION``), and none for models whose Mamba layers export the
  prompt checkpoint internally (:func:`vllm_hybrid_backends.align.policy_for_model`). Where the
  forward stores tail checkpoints inside the chunk
  (``patch_vllm_v1_core_kv_cache_coordinator``), the chunk is not stopped at them. Only
  requests of models with Mamba groups in align mode are touched.
- Stats: with ``VLLM_HYBRID_STATS=1``, ``Scheduler.update_from_output`` also hands the change
  of :mod:`vllm_hybrid_backends.stats` since it last did to the step's ``SchedulerStats.hybrid``
  (field added by ``patch_vllm_v1_metrics_stats``), but only on a step whose stats travel with a
  request output: the offline ``LLMEngine.step`` of vLLM 0.23 and 0.26 records no stats of a
  step without one (``vllm/v1/engine/llm_engine.py:325`` in 0.26, ``len(outputs.outputs) > 0``;
  0.31+ record every step), so the states kept by a prefill chunk that samples nothing were
  lost there. Held back, they ride on the next step with an output. Not wrapped otherwise.
- Sub-block junctions (vLLM 0.32, 0.33, with ``prefix_match_unit`` below the block size and
  ``VLLM_HYBRID_SUBBLOCK_JUNCTIONS``): ``Scheduler._get_local_prefix_cache_hit`` is wrapped to
  set ``request.shared_prefix_boundary`` to where the prompt forks from the recent prompts
  (:func:`vllm_hybrid_backends.junctions.fork`, once per request: a shared prefix that one
  of them went on past; not where they all ended, as for a resend or a conversation's next
  turn, whose end state vLLM keeps) when that lies past the hit; vLLM's own shared-prefix
  checkpoint (``enable_mamba_shared_prefix_checkpoint``, which vLLM turns on only with EAGLE)
  is switched on for that scheduler, so its split ends the chunk at the junction and its
  Mamba managers cache the state there. The attention groups register
  a key at the junction on the block that holds it
  (``FullAttentionManager._cache_partial_tail_block``, which vLLM's ``cache_blocks`` calls only
  when the hash unit is below the block, wrapped to add it), so the next request that shares
  the prefix hits it in both groups. A junction is made only while
  :data:`JUNCTION_SPARE_BLOCKS` blocks beyond the prompt's are free (under pressure its state
  and two extra chunks cost preemptions), only once its depth times the ways remembered
  prompts went on past it reaches the state's blocks in prompt tokens (:func:`_junction_pays`:
  a 64-token system prompt is not worth six blocks of nemotron-h-8b state until 98
  conversations opened with it), and not with EAGLE (vLLM's own junction there). vLLM's own
  sub-block junction (the attention hit's end, past the Mamba hit: with the switch on it would
  be kept exactly, e.g. in every conversation turn whose end state was evicted) is floored to
  its block, as vLLM does without the switch, unless it is where the prompt forks (then it is
  kept exactly even where the plugin's state there did not pay or had no room: measured
  better with the first count of the rule, branching/qwen3.5-0.8b 65,536 at unit 16 0.3227
  against 0.3015 floored). Without ``prefix_match_unit`` nothing changes.
- Resume states (``VLLM_HYBRID_RESUME_STATES``, issue 15 item 4): ``_preempt_request`` keeps
  a prefill's Mamba state at the last block boundary it computed before vLLM frees its blocks
  (:func:`patch_vllm_v1_core_kv_cache_coordinator.keep_resume_state`), so the request resumes
  there; vLLM frees that state unhashed and the request recomputes from its first hit. The
  passed state it resumed from keeps its LRU place too
  (:func:`patch_vllm_v1_core_kv_cache_coordinator.keep_passed_in_place`). Called only on
  preemption; nothing on a scheduler step.
- Upstream: vLLM #54076 (chunk ends off the Mamba grid, open); the agentic miss is §4(a) of
  ``vllm_map.md``; junction checkpoints #37898 only help the third request.
- vLLM versions: 0.23.x, 0.26.x, 0.30.x-0.33.x (the method's signature is checked when it
  binds). A chunk runs past a tail checkpoint only where the coordinator patch plans an
  interior block for it (never on 0.23).
- Removal: when vLLM retains intermediate boundaries itself and splits on the Mamba block.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

from .. import align, junctions, stats
from ..compat import signature_problem, version_allows
from . import patch_vllm_v1_core_kv_cache_coordinator as coordinator_patch
from . import patch_vllm_v1_core_kv_cache_manager as manager_patch

TARGET_MODULE = "vllm.v1.core.sched.scheduler"
TARGET_SYMBOLS = ("Scheduler._mamba_block_aligned_split", "Scheduler.update_from_output",
                  "Scheduler._get_local_prefix_cache_hit", "Scheduler._preempt_request",
                  "vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager"
                  "._cache_partial_tail_block")
PROCESS = "engine"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"

_ORIGINALS: dict[str, Any] = {}
#: Junction methods the patched class inherited (not in its own ``vars``): revert deletes them.
_INHERITED: set[str] = set()
#: The classes whose ``_preempt_request`` and ``_mamba_block_aligned_split`` are wrapped.
_OWNERS: dict[str, type] = {}
#: Free blocks a junction state must leave (:func:`_roomy_for_junction`).
JUNCTION_SPARE_BLOCKS = 64


def _scheduler_class() -> Any:
    return importlib.import_module(TARGET_MODULE).Scheduler


def missing() -> list[str]:
    try:
        cls = _scheduler_class()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    lacking = [f"Scheduler.{name}" for name in ("_mamba_block_aligned_split", "update_from_output",
                                                "_preempt_request")
               if not callable(getattr(cls, name, None))]
    if lacking:
        return lacking
    split = _ORIGINALS.get("_mamba_block_aligned_split", cls._mamba_block_aligned_split)
    problem = signature_problem(split, TARGET_SYMBOLS[0], (
        "self", "request", "num_new_tokens", "num_new_local_computed_tokens",
        "num_external_computed_tokens"))
    problems = [problem] if problem else []
    preempt = signature_problem(_ORIGINALS.get("_preempt_request", cls._preempt_request),
                                "Scheduler._preempt_request", ("self", "request"), closed=False)
    if preempt:
        problems.append(preempt)
    for owner, name, _ in _junction_targets():
        lookup = owner is cls  # the lookup's wrapper passes the rest through
        expected = ("self", "request") if lookup else ("self", "request", "num_tokens")
        found = signature_problem(_ORIGINALS.get(name, getattr(owner, name)),
                                  f"{owner.__name__}.{name}", expected, closed=not lookup)
        if found:
            problems.append(found)
    return problems


def _mamba_block_aligned_split(self: Any, request: Any, num_new_tokens: int,
                               num_new_local_computed_tokens: int = 0,
                               num_external_computed_tokens: int = 0) -> int:
    start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
    prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
    if start >= prefill_end:  # decoding: vLLM splits only prefills, the count stays
        # Arm the plugin's allocation and caching only where this step needs them (a
        # multi-token step; a Mamba block that may fill up: at most these tokens are cached);
        # every other decode step runs vLLM's own methods.
        if num_new_tokens > 1:
            manager_patch.arm(self.kv_cache_manager)
        try:
            next_fill = request._hybrid_next_fill  # see patch_vllm_v1_core_kv_cache_coordinator
        except AttributeError:  # not prefilled here (a KV connector's load)
            next_fill = 0
        if start + num_new_tokens >= next_fill:
            coordinator_patch.watch_caching(self.kv_cache_manager.coordinator)
        return num_new_tokens
    scheduled = _ORIGINALS["_mamba_block_aligned_split"](
        self, request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)
    if scheduled <= 0:
        return scheduled
    request._hybrid_next_fill = 0  # found again once this chunk is cached
    manager_patch.arm(self.kv_cache_manager)  # a prefill chunk: plan its interior blocks,
    coordinator_patch.watch_caching(self.kv_cache_manager.coordinator)  # keep its boundaries
    policy, interior_states = _split_policy(self)
    admitted = None
    if policy.adaptive_retention:
        ledger = coordinator_patch.state_of(self.kv_cache_manager.coordinator).ledger
        admitted = lambda kind: ledger.admits(kind, request.request_id)  # noqa: E731
    end = align.chunk_end(start, start + scheduled, request.num_prompt_tokens, prefill_end,
                          split_block_size=self.cache_config.block_size,
                          state_block_size=self.block_size, policy=policy, admitted=admitted,
                          interior_states=interior_states)
    return max(end - start, 0)


def _split_policy(scheduler: Any) -> tuple[align.AlignPolicy, bool]:
    """The active policy as it applies to the scheduler's model, and whether the forward
    stores tail checkpoints inside the chunk (so chunks are not stopped at them); derived once
    per active policy."""
    active = align.active_policy()
    known = scheduler.__dict__.get("_hybrid_split_policy")
    if known is None or known[0] is not active:
        policy = align.policy_for_model(active, internal_prefill_checkpoints=getattr(
            scheduler, "mamba_has_prefill_checkpoint_blocks", False))
        known = scheduler._hybrid_split_policy = (
            active, policy, policy.interior_states and _stores_interior(scheduler))
    return known[1], known[2]


def _stores_interior(scheduler: Any) -> bool:
    """Whether every Mamba group's forward stores tail checkpoints inside a chunk and the
    KV-cache manager plans blocks for them: the same groups the coordinator patch plans for
    (none on vLLM 0.23, whose allocation count cannot tell a partial local hit)."""
    known = scheduler.__dict__.get("_hybrid_stores_interior")
    if known is None:
        coordinator = scheduler.kv_cache_manager.coordinator
        managers = coordinator_patch._mamba_managers(coordinator)
        known = bool(managers) and len(coordinator_patch._interior_managers(coordinator)) == len(
            managers)
        scheduler._hybrid_stores_interior = known
    return known


def _get_local_prefix_cache_hit(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """vLLM's lookup (0.33 adds ``max_cache_hit_length``, passed through), then the junction.
    (The connector's re-lookup after a diverged hit calls the manager directly: no junction.)"""
    found = _ORIGINALS["_get_local_prefix_cache_hit"](self, request, *args, **kwargs)
    seen = _seen_prefixes(self)
    if seen is None:
        return found
    known = request.__dict__.get("_hybrid_junction")
    if known is None:  # once per request: a waiting request is looked up every step
        at, branches = junctions.fork(seen, request.block_hashes, request.num_prompt_tokens,
                                      self.hash_block_size)
        request._hybrid_fork = at
        known = at if at and _junction_pays(self, at, branches) and _roomy_for_junction(
            self, request) else 0
        request._hybrid_junction = known
    blocks, num_local, boundary, *rest = found
    if known > num_local and known > boundary:
        return (blocks, num_local, known, *rest)
    if boundary % self.block_size and boundary != request.__dict__.get("_hybrid_fork", 0):
        # vLLM's own junction (where the attention hit outruns the Mamba one; with the switch
        # on, kept exactly) is no fork here, e.g. a conversation turn whose end state was
        # evicted: it gets what vLLM gives it without the switch, the block below
        return (blocks, num_local, boundary // self.block_size * self.block_size, *rest)
    return found


def _junction_pays(scheduler: Any, position: int, branches: int) -> bool:
    """Whether a junction state is worth its blocks: once its depth times the ways remembered
    prompts went on past it reaches the state's blocks in prompt tokens
    (:func:`junctions.pays_for_state`).
    Not waived while the pool has room (production-style conversations with 16-token units
    at unit 16, nemotron-h-8b 262,144, with a first count of every prompt through the prefix:
    waived until lookups lost a quarter of their hits,
    0.277 against 0.3085; the 24 system-prompt junctions made early then stay hot under LRU,
    and evicting such states once the pool ran short did not recover it: 0.274)."""
    return junctions.pays_for_state(position, branches,
                                    scheduler.__dict__.get("_hybrid_state_tokens", 0))


def _roomy_for_junction(scheduler: Any, request: Any) -> bool:
    """Whether the pool has room for a junction state: once the request's prompt has its
    blocks, :data:`JUNCTION_SPARE_BLOCKS` free ones (cached or not) remain. Under pressure the
    state and the two extra chunks cost running requests their blocks (preemptions)."""
    pool = scheduler.kv_cache_manager.block_pool
    needed = -(-request.num_prompt_tokens // scheduler.block_size) + JUNCTION_SPARE_BLOCKS
    return pool.get_num_free_blocks() >= needed


def _seen_prefixes(scheduler: Any) -> junctions.SeenPrefixes | None:
    """The scheduler's recent prompt prefixes, or None where sub-block junctions are off;
    decided once per active policy."""
    active = align.active_policy()
    known = scheduler.__dict__.get("_hybrid_seen_prefixes")
    if known is None or known[0] is not active:
        known = scheduler._hybrid_seen_prefixes = (
            active, _enable_junctions(scheduler) if active.subblock_junctions else None)
    return known[1]


def _enable_junctions(scheduler: Any) -> junctions.SeenPrefixes | None:
    """Switch vLLM's shared-prefix checkpoint on where hits may end inside a Mamba block (align
    mode, ``prefix_match_unit`` below the block) and no MTP tail is re-prefilled (vLLM's own
    exclusion: its managers then cache a different count); None elsewhere."""
    manager = scheduler.kv_cache_manager
    coordinator = manager.coordinator
    if not getattr(scheduler, "mamba_partial_cache_hit", False) or coordinator.__dict__.get(
            "num_reprefillable_tokens", 0) or getattr(coordinator, "eagle_group_ids", ()):
        return None  # with EAGLE, vLLM's own junction (its lookups drop a unit)
    mamba = coordinator_patch._mamba_managers(coordinator)
    if not mamba or not all(hasattr(m, "shared_prefix_checkpoint") for m in mamba):
        return None
    for mamba_manager in mamba:
        mamba_manager.shared_prefix_checkpoint = True
    manager.mamba_shared_prefix_checkpoint = True
    scheduler.mamba_shared_prefix_checkpoint = True
    unit = scheduler.hash_block_size
    pool_units = coordinator.block_pool.num_gpu_blocks * scheduler.block_size // unit
    scheduler._hybrid_state_tokens = _state_tokens(coordinator, mamba)
    return junctions.SeenPrefixes(max(junctions.MIN_SEEN_PREFIXES, pool_units))


def _state_tokens(coordinator: Any, mamba: list[Any]) -> int:
    """A Mamba state's blocks (the Mamba groups of the first one's block size: all of them in
    the models vLLM builds) as prompt tokens of attention prefix, the bar of
    :func:`_junction_pays`; a model without attention groups: the state's own tokens."""
    state_blocks, attention_blocks = coordinator_patch._blocks_per_boundary(
        coordinator, coordinator_patch.state_of(coordinator))
    return math.ceil(state_blocks * mamba[0].block_size / (attention_blocks or 1))


def _cache_partial_tail_block(self: Any, request: Any, num_tokens: int) -> Any:
    """vLLM's (the prompt's last unit boundary), then a key at the plugin's junction on the
    attention block that holds it: the attention half of a sub-block junction hit. vLLM drops
    a block's shorter keys when it keys the prompt's tail in the same block and all partial
    keys when the block fills (``BlockPool.cache_partial_block``, ``cache_full_blocks``), so
    the key is added again after each prefill chunk from the junction on and once the block
    is full; then the request is done with it (adding a key it has is a no-op)."""
    result = _ORIGINALS["_cache_partial_tail_block"](self, request, num_tokens)
    junction = request.__dict__.get("_hybrid_junction")
    if junction and num_tokens >= junction and junction % self.block_size \
            and request.shared_prefix_boundary == junction:
        index = junction // self.block_size
        full = num_tokens >= (index + 1) * self.block_size
        if full or num_tokens <= request.num_prompt_tokens:
            blocks = self.req_to_blocks[request.request_id]
            if index < len(blocks) and not blocks[index].is_null:
                self.block_pool.cache_partial_block(
                    request=request, block=blocks[index], num_tokens=junction,
                    kv_cache_group_id=self.kv_cache_group_id, block_size=self.block_size)
            if full:
                request._hybrid_junction = 0  # keyed for good: the block no longer changes
    return result


def _full_attention_class() -> Any:
    return importlib.import_module("vllm.v1.core.single_type_kv_cache_manager").FullAttentionManager


def _junction_targets() -> list[tuple[Any, str, Any]]:
    """(owner, method, wrapper) of the sub-block junction wiring where this vLLM has both
    seams (0.32+); empty before."""
    if not version_allows(">=0.32"):  # no prefix_match_unit before 0.32: nothing to wire
        return []
    scheduler = _scheduler_class()
    attention = _full_attention_class()
    if not callable(getattr(scheduler, "_get_local_prefix_cache_hit", None)) or not callable(
            getattr(attention, "_cache_partial_tail_block", None)):
        return []
    return [(scheduler, "_get_local_prefix_cache_hit", _get_local_prefix_cache_hit),
            (attention, "_cache_partial_tail_block", _cache_partial_tail_block)]


def _preempt_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    request._hybrid_next_fill = 0  # its blocks go: none is cached when it comes back
    coordinator = getattr(self.kv_cache_manager, "coordinator", None)
    if coordinator is not None and getattr(self.kv_cache_manager, "enable_caching", False):
        coordinator_patch.keep_resume_state(coordinator, request)
        coordinator_patch.keep_passed_in_place(coordinator, request.request_id)
    return _ORIGINALS["_preempt_request"](self, request, *args, **kwargs)


def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
    outputs = _ORIGINALS["update_from_output"](self, *args, **kwargs)
    for eco in outputs.values():
        if eco.scheduler_stats is not None:  # vLLM puts a step's stats on one front-end's outputs
            if eco.outputs:
                eco.scheduler_stats.hybrid = stats.take_delta()
            break
    return outputs


def apply() -> None:
    align.refresh_policy()
    cls = _scheduler_class()
    if stats.refresh() and cls.update_from_output is not update_from_output:
        _ORIGINALS["update_from_output"] = cls.update_from_output
        cls.update_from_output = update_from_output
    for owner, name, wrapper in _junction_targets():
        if getattr(owner, name) is not wrapper:
            # a subclass that replaced the module's Scheduler (vllm-ascend's BalanceScheduler)
            # inherits the method: wrap what it inherits, and remove the wrapper on revert
            _ORIGINALS[name] = getattr(owner, name)
            if name not in vars(owner):
                _INHERITED.add(name)
            setattr(owner, name, wrapper)
    # on the class that defines each: a scheduler that replaced vLLM's (vllm-ascend's) and
    # vLLM's AsyncScheduler, subclassed from vLLM's before that, both reach the wrappers
    for name, wrapper in (("_preempt_request", _preempt_request),
                          ("_mamba_block_aligned_split", _mamba_block_aligned_split)):
        owner = next(k for k in cls.__mro__ if name in vars(k))
        if vars(owner)[name] is not wrapper:
            _ORIGINALS[name] = vars(owner)[name]
            _OWNERS[name] = owner
            setattr(owner, name, wrapper)


def revert() -> None:
    for owner, name, _ in _junction_targets():
        if name in _ORIGINALS:
            original = _ORIGINALS.pop(name)
            if name in _INHERITED:
                _INHERITED.discard(name)
                delattr(owner, name)
            else:
                setattr(owner, name, original)
    if "update_from_output" in _ORIGINALS:
        _scheduler_class().update_from_output = _ORIGINALS.pop("update_from_output")
    for name in ("_preempt_request", "_mamba_block_aligned_split"):
        if name in _ORIGINALS:
            setattr(_OWNERS.pop(name), name, _ORIGINALS.pop(name))
