"""The replay harness: vLLM's real ``Scheduler`` and ``KVCacheManager`` driven by a trace.

One :func:`run_replay` call builds the scheduler the way vLLM's engine core does
(:mod:`.engine_config`), adds the trace's requests on a simulated clock, and runs
``schedule()`` -> fake worker -> ``update_from_output()`` until every request finished. The
fake worker (:class:`~.oracle.FakeHybridWorker`) emits the trace's forced output tokens and
keeps fingerprint Mamba states that it moves through the selected backend's hooks and checks.

With ``ReplayConfig.kv_offloading_size`` the scheduler also runs vLLM's own CPU tier, its
``OffloadingConnector``, whose worker side :mod:`.offload` simulates over the same blocks.

The simulated clock only orders arrivals: a step lasts ``STEP_BASE_S + STEP_PER_TOKEN_S`` x
scheduled tokens. Measured wall time is reported separately (``sched_step_us``: the median
time of ``schedule()`` + ``update_from_output()``).
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import stats
from .engine_config import (
    EngineSetup,
    KVLayout,
    build_engine_setup,
    shape_from_model_config,
    vllm_has_retention_interval,
)
from .oracle import FakeHybridWorker, Mismatch
from .policy import Policy
from .shapes import MODEL_SHAPES, ModelShape, derive_cache_geometry, get_shape
from .workloads import Trace, TraceRequest

__all__ = ["ReplayConfig", "ReplayError", "RequestRecord", "RunResult", "prefix_match_units",
           "resolve_model_shape", "run_replay"]

STEP_BASE_S = 0.010
STEP_PER_TOKEN_S = 0.00005
DEFAULT_CACHE_TOKENS = 262_144
MISS_REASONS = ("no_mamba_state_at_boundary", "evicted", "prefix_shorter_than_block",
                "groups_disagreed", "other")


class ReplayError(RuntimeError):
    """The replay could not run (bad configuration, or the scheduler stopped making progress)."""


@dataclass(frozen=True)
class ReplayConfig:
    """Everything a replay run depends on besides the trace and the policy."""

    model_shape: str = "qwen3.5-0.8b"
    #: An explicit shape (tests, fuzzing) instead of a named one.
    shape: ModelShape | None = None
    platform: str = "cuda"
    block_size: int | None = None
    #: Mamba groups' block size when it differs from the attention block size (testing).
    mamba_block_size: int | None = None
    #: KV pool capacity in tokens of attention KV (the pool is shared with the Mamba states).
    cache_tokens: int = DEFAULT_CACHE_TOKENS
    #: vLLM's ``vllm serve`` defaults on an H100 (``EngineArgs`` usage-context defaults).
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    long_prefill_token_threshold: int = 0
    num_spec_tokens: int = 0
    conv_layout: str = "SD"
    #: vLLM's ``prefix_match_unit`` (sub-block hits with copy-on-write); None = off.
    prefix_match_unit: int | None = None
    #: vLLM's ``prefix_cache_retention_interval`` for both policies (0.32+): 0 = the installed
    #: vLLM's default (0.32: Mamba states at the replay boundary and junctions; 0.26 and 0.23
    #: keep their own rule), a multiple of the scheduler block = also every that many tokens,
    #: ``None`` = every boundary a chunk or decode step ends on (dense).
    retention_interval: int | None = 0
    max_model_len: int | None = None
    max_steps: int = 2_000_000
    #: vLLM's ``--kv-offloading-size`` (GiB): its OffloadingConnector as a CPU tier
    #: (:mod:`.offload`); None = off. The attention-only bound run stays GPU-only.
    kv_offloading_size: float | None = None
    #: Drive vLLM's ``AsyncScheduler`` (vllm serve's default with async scheduling) instead of
    #: ``Scheduler``. Steps still run one after another (each output is processed before the
    #: next ``schedule``), so its per-request caching after each output runs, without overlap.
    async_scheduler: bool = False

    def resolved_shape(self) -> ModelShape:
        """``shape``, else the built-in shape named ``model_shape``, else the shape vLLM
        derives from the config.json (or model directory) at that path."""
        return self.shape if self.shape is not None else resolve_model_shape(self.model_shape)

    def layout(self, *, attention_only: bool = False) -> KVLayout:
        shape = self.resolved_shape()
        geometry = derive_cache_geometry(shape.with_spec_tokens(self.num_spec_tokens),
                                         self.platform, self.block_size)
        block_size = geometry.block_size
        if self.cache_tokens < block_size:
            raise ReplayError(f"--cache-tokens {self.cache_tokens} is less than one block "
                              f"({block_size} tokens)")
        unit = self.prefix_match_unit
        if unit is not None:
            allowed = prefix_match_units(block_size, self.mamba_block_size)
            if unit not in allowed:
                sizes = sorted({block_size, self.mamba_block_size or block_size})
                raise ReplayError(
                    f"--prefix-match-unit {unit}: vLLM needs a divisor of every KV-cache "
                    f"group's block size ({', '.join(map(str, sizes))} here); allowed: "
                    f"{', '.join(map(str, allowed))}")
        interval = self.retention_interval
        if interval != 0 and not vllm_has_retention_interval():
            from ..compat import installed_vllm_version

            raise ReplayError(
                "--prefix-cache-retention-interval needs vLLM's CacheConfig."
                f"prefix_cache_retention_interval (0.32+); this vLLM is "
                f"{installed_vllm_version()} (0.26 reads VLLM_PREFIX_CACHE_RETENTION_INTERVAL, "
                "0.23 keeps every state)")
        scheduler_block = math.lcm(block_size, self.mamba_block_size or block_size)
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int)
                                     or interval < 0 or interval % scheduler_block):
            raise ReplayError(
                f"--prefix-cache-retention-interval {interval!r}: vLLM needs 0 (its default), "
                f"a multiple of the scheduler block size ({scheduler_block} tokens here) or "
                "dense")
        if attention_only and unit is not None and unit < block_size:
            # vLLM rejects a sub-block unit for a single (attention) group: the attention-only
            # bound at that unit is an attention cache of unit-sized blocks, same capacity.
            block_size = unit
        return KVLayout(block_size=block_size, num_blocks=self.cache_tokens // block_size + 1,
                        mamba_page_padded=geometry.mamba_page_padded,
                        mamba_block_size=self.mamba_block_size, attention_only=attention_only,
                        num_spec_tokens=self.num_spec_tokens,
                        prefix_match_unit=None if attention_only else unit,
                        retention_interval=0 if attention_only else interval)


def parse_retention_interval(text: str) -> int | None:
    """``--prefix-cache-retention-interval``: an integer >= 0, or ``dense`` (vLLM's ``None``)."""
    if text == "dense":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError("--prefix-cache-retention-interval must be an integer >= 0 or "
                         f"'dense', got {text!r}")
    return value


def retention_label(interval: int | None) -> int | str:
    """How reports name a retention interval: its tokens, or ``dense``."""
    return "dense" if interval is None else interval


def resolve_model_shape(value: str) -> ModelShape:
    """The built-in shape named ``value``, else the shape vLLM derives from the config.json (or
    model directory) at that path, once per file version; ``ValueError`` names what is allowed."""
    if value not in MODEL_SHAPES and os.path.exists(value):
        return _derived_shape(os.path.realpath(value), os.stat(value).st_mtime_ns)
    return get_shape(value)


@functools.lru_cache(maxsize=8)
def _derived_shape(path: str, mtime_ns: int) -> ModelShape:
    return shape_from_model_config(path)


def prefix_match_units(block_size: int, mamba_block_size: int | None = None) -> list[int]:
    """The ``prefix_match_unit`` values vLLM 0.32 accepts: divisors of every group's block."""
    sizes = {block_size, mamba_block_size or block_size}
    return [u for u in range(1, min(sizes) + 1) if all(s % u == 0 for s in sizes)]


@dataclass
class RequestRecord:
    """What happened to one trace request in one run."""

    prompt_len: int
    admitted_order: int = -1
    #: Prompt tokens served from the local prefix cache at first admission.
    hit_tokens: int = 0
    external_tokens: int = 0
    finish_time: float | None = None
    #: Hybrid runs: why chunks between the hit and the attention-only bound were missed.
    miss_chunks: dict[str, int] = field(default_factory=dict)


@dataclass
class RunResult:
    policy: str
    attention_only: bool
    block_size: int
    num_blocks: int
    backend: str
    requests: dict[str, RequestRecord]
    hash_block_size: int = 0
    pool_bytes: int = 0
    steps: int = 0
    prefill_tokens_computed: int = 0
    #: Tokens computed again after a preemption (positions below what the request had reached:
    #: computed, or served from the cache, before); the prompt's part and all positions.
    recomputed_prompt_tokens: int = 0
    recomputed_tokens: int = 0
    mamba_blocks_peak: int = 0
    mamba_blocks_mean: float = 0.0
    evictions_attention: int = 0
    evictions_mamba: int = 0
    preemptions: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    state_checks: int = 0
    step_us: list[float] = field(default_factory=list)
    blocks_leaked: int = 0
    patches: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    #: With the CPU tier: :meth:`.offload.TierStats.to_json`.
    offload: dict[str, Any] | None = None
    #: Under the plugin: its retention ledger at the end (:meth:`.align.RetentionLedger.snapshot`).
    retention_ledger: dict[str, Any] | None = None

    @property
    def sched_step_us_median(self) -> float:
        return statistics.median(self.step_us) if self.step_us else 0.0


AcceptFn = Callable[[str, int], int]
ExternalFn = Callable[[str, int, int], int]


def _default_accept(seed: int = 0) -> AcceptFn:
    """Each draft token matches with probability 0.7, until the first miss."""
    rng = random.Random(seed)

    def accept(request_id: str, max_drafts: int) -> int:
        matched = 0
        while matched < max_drafts and rng.random() < 0.7:
            matched += 1
        return matched

    return accept


def _make_pd_connector(kv_cache_config: Any, external: ExternalFn) -> Any:
    """A KV connector whose "remote prefill" delivers exact Mamba states (P/D testing).

    Scheduler side only: it answers ``get_num_new_matched_tokens`` from ``external`` (loads are
    synchronous) and remembers what it promised; the harness then writes the remote state into
    the block vLLM's worker reads it from.
    """
    # built lazily: subclasses vLLM's connector base
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        SupportsHMA,
    )

    class Meta(KVConnectorMetadata):
        pass

    class Connector(KVConnectorBase_V1, SupportsHMA):
        def __init__(self, kv_cache_config: Any, external: ExternalFn) -> None:
            # KVConnectorBase_V1.__init__ needs a kv_transfer_config; set its fields here
            self._connector_metadata = None
            self.__dict__["_kv_transfer_config"] = None
            self._kv_cache_config = kv_cache_config
            self._kv_cache_manager = None
            self.external = external
            self.loaded: dict[str, int] = {}

        def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> Any:
            limit = request.num_tokens - 1 - num_computed
            return max(0, min(self.external(request.request_id, num_computed,
                                            request.num_tokens), limit)), False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_ext: int) -> None:
            if num_ext:
                self.loaded[request.request_id] = num_ext

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return Meta()

        def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
            return False, None

        def request_finished(self, request: Any, block_ids: Any) -> Any:
            return False, None

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            pass

        def wait_for_layer_load(self, layer_name: str) -> None:
            pass

        def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
            pass

        def wait_for_save(self) -> None:
            pass

    return Connector(kv_cache_config, external)


class _Instruments:
    """Counters hooked onto the scheduler's block pool (they observe; behaviour is unchanged)."""

    def __init__(self, scheduler: Any, setup: EngineSetup) -> None:
        self.pool = scheduler.kv_cache_manager.block_pool
        self.setup = setup
        self.mamba_groups = set(setup.mamba_group_ids)
        self.evicted_mamba_keys: set[Any] = set()
        self.evictions_attention = 0
        self.evictions_mamba = 0
        original = self.pool._maybe_evict_cached_block

        from ..patches.patch_vllm_v1_core_kv_cache_coordinator import cached_hashes

        def evict(block: Any) -> bool:
            keys = set(cached_hashes(self.pool, block))
            evicted = original(block)
            if evicted:
                from vllm.v1.core.kv_cache_utils import get_group_id

                groups = {get_group_id(k) for k in keys}
                if groups & self.mamba_groups:
                    self.evictions_mamba += 1
                    self.evicted_mamba_keys.update(
                        k for k in keys if get_group_id(k) in self.mamba_groups)
                else:
                    self.evictions_attention += 1
            return bool(evicted)

        self.pool._maybe_evict_cached_block = evict
        self.mamba_managers = [
            m for gid, m in enumerate(scheduler.kv_cache_manager.coordinator.single_type_managers)
            if gid in self.mamba_groups
        ]

    def mamba_blocks_in_use(self) -> int:
        ids: set[int] = set()
        for manager in self.mamba_managers:
            for blocks in manager.req_to_blocks.values():
                ids.update(b.block_id for b in blocks if not b.is_null)
        return len(ids)

    def has_key(self, block_hash: Any, group: int) -> bool:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        key = make_block_hash_with_group_id(block_hash, group)
        return bool(self.pool.cached_block_hash_to_block.get_one_block(key))

    def was_evicted(self, block_hash: Any, group: int) -> bool:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        return make_block_hash_with_group_id(block_hash, group) in self.evicted_mamba_keys

    def classify_misses(self, request: Any, hit: int, bound: int) -> dict[str, int]:
        """Why the hit-sized chunks in ``(hit, bound]`` were not a hit for this lookup
        (:func:`vllm_hybrid_backends.stats.attribute_gap`: the deepest boundary with a state
        decides up to it, the boundaries past it had none).

        Chunks are as long as vLLM's hit granularity: the scheduler block, or with sub-block
        hits (``prefix_match_unit``) the hash unit. A state or partial block at boundary ``p``
        is keyed by the request's hash at ``p`` (each hash is chained over its whole prefix,
        which is also how vLLM keys a full block of any size).
        """
        step = self.setup.hit_alignment
        hash_size = self.setup.hash_block_size
        groups = self.setup.kv_cache_config.kv_cache_groups
        block_hashes = request.block_hashes

        def has_key_at(p: int, group: int) -> bool:
            index = p // hash_size - 1
            return index < len(block_hashes) and self.has_key(block_hashes[index], group)

        full_run: dict[int, int] = {}  # attention group -> tokens of its cached full blocks
        for g in self.setup.attention_group_ids:
            size, n = groups[g].kv_cache_spec.block_size, 0
            while has_key_at((n + 1) * size, g):
                n += 1
            full_run[g] = n * size

        def attention_at(p: int) -> bool:
            for g, run in full_run.items():
                size = groups[g].kv_cache_spec.block_size
                if run < p and not (run >= p - p % size and has_key_at(p, g)):
                    return False
            return True

        def reason_at(p: int) -> str:
            have, evicted = [], []
            for g in self.setup.mamba_group_ids:
                index = p // hash_size - 1
                known = index < len(block_hashes)
                have.append(known and self.has_key(block_hashes[index], g))
                evicted.append(known and self.was_evicted(block_hashes[index], g))
            return stats.miss_reason(have, evicted, attention_at(p) if all(have) else True)

        return stats.attribute_gap(hit, bound, step, reason_at)


def _check_cpu_tier(config: ReplayConfig, with_pd: bool) -> None:
    """Refuse a CPU tier this vLLM or the replay's simulation of its worker side cannot run."""
    from .offload import tier_problem

    size = config.kv_offloading_size
    if size is None or not 0 < size < math.inf:
        raise ReplayError(f"--kv-offloading-size {size}: allowed values are finite GiB > 0")
    problem = tier_problem()
    if problem:
        raise ReplayError(problem)
    for name, value in (("--prefix-match-unit", config.prefix_match_unit),
                        ("speculative tokens", config.num_spec_tokens or None),
                        ("a P/D connector", with_pd or None)):
        if value is not None:
            raise ReplayError(f"--kv-offloading-size with {name} ({value}): the replay's CPU "
                              "tier supports whole-block hits without speculative decoding "
                              "and no other connector")


def _make_cpu_tier(scheduler: Any, worker: FakeHybridWorker, setup: EngineSetup,
                   records: dict[str, RequestRecord]) -> Any:
    """The worker side of vLLM's CPU tier (:mod:`.offload`)."""
    from .offload import CPUTierWorker

    try:
        return CPUTierWorker(scheduler, worker, setup,
                             {rid: r.prompt_len for rid, r in records.items()})
    except RuntimeError as exc:
        raise ReplayError(str(exc)) from exc


def _selected_backend() -> str:
    from .. import plugins

    return plugins.selected_backend()


def run_replay(trace: Trace, config: ReplayConfig, policy: Policy, *,
               attention_only: bool = False, bound_hits: dict[str, int] | None = None,
               accept: AcceptFn | None = None, external: ExternalFn | None = None,
               progress: Any = None) -> RunResult:
    """Replay ``trace`` once under ``policy``; see the module docstring.

    :param attention_only: the attention-only bound: same block size and block pool, no
        Mamba groups (no fake Mamba states either).
    :param bound_hits: per-request hits of the bound run, for the miss attribution.
    :param accept: spec decoding: ``(request_id, num_drafts) -> drafts that will match``.
    :param external: P/D: ``(request_id, local_hit, num_tokens) -> external tokens`` a fake KV
        connector supplies (loaded synchronously, with the exact Mamba state).
    :param progress: optional tqdm-like object; ``update(n)`` is called per finished request.
    """
    from ..patches import patch_vllm_v1_core_kv_cache_coordinator as coordinator_patch

    tier: Any = contextlib.nullcontext()
    if config.kv_offloading_size is not None and not attention_only:
        from .engine_config import vllm_config_for
        from .offload import tier_transfer_config

        _check_cpu_tier(config, external is not None)
        tier = tier_transfer_config(vllm_config_for(config.resolved_shape(),
                                                    num_spec_tokens=config.num_spec_tokens),
                                    config.kv_offloading_size)
    # the fake model stores interior states for every kind of Mamba layer
    previous, coordinator_patch.interior_override = (coordinator_patch.interior_override,
                                                       not attention_only)
    try:
        with policy.active() as patches, tier:
            result = _Run(trace, config, policy, attention_only, bound_hits or {},
                          accept or _default_accept(), external, progress).run()
    finally:
        coordinator_patch.interior_override = previous
    result.patches = patches
    return result


class _Run:
    def __init__(self, trace: Trace, config: ReplayConfig, policy: Policy, attention_only: bool,
                 bound_hits: dict[str, int], accept: AcceptFn, external: ExternalFn | None,
                 progress: Any) -> None:
        self.trace = trace
        self.config = config
        self.policy = policy
        self.attention_only = attention_only
        self.bound_hits = bound_hits
        self.accept = accept
        self.progress = progress
        shape = config.resolved_shape()
        layout = config.layout(attention_only=attention_only)
        longest = max(len(r.prompt_token_ids) + r.max_tokens for r in trace.requests)
        max_model_len = config.max_model_len or (
            math.ceil((longest + config.num_spec_tokens + 1) / layout.block_size + 1)
            * layout.block_size)
        self.setup = build_engine_setup(
            shape, layout, max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold)
        self.layout = layout
        self.scheduler = self._make_scheduler()
        self.connector = None
        if external is not None:
            self.connector = _make_pd_connector(self.setup.kv_cache_config, external)
            self.scheduler.connector = self.connector
        self.instruments = _Instruments(self.scheduler, self.setup)
        self.outputs = {r.id: r.output_token_ids for r in trace.requests}
        self.worker: FakeHybridWorker | None = None
        if not attention_only and self.setup.mamba_group_ids:
            self.worker = FakeHybridWorker(
                self.setup, lambda rid: self.scheduler.requests[rid].all_token_ids,
                conv_kernel=shape.state.conv_kernel, num_spec_tokens=config.num_spec_tokens,
                conv_layout=config.conv_layout)
        self.records = {r.id: RequestRecord(len(r.prompt_token_ids)) for r in trace.requests}
        self.tier: Any = None
        if config.kv_offloading_size is not None and not attention_only:
            if self.worker is None:
                raise ReplayError(f"--kv-offloading-size: {shape.name} has no Mamba layers; "
                                  "the replay's CPU tier is for hybrid shapes")
            self.tier = _make_cpu_tier(self.scheduler, self.worker, self.setup, self.records)
            self._wrap_tier_lookup()
        #: per request, the furthest position it has computed or been served from the cache
        self.reached: dict[str, int] = {}
        self._wrap_lookup()

    def _make_scheduler(self) -> Any:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        config = self.setup.vllm_config
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(self.setup.hash_block_size, hash_fn)
        scheduler: Any = Scheduler
        if self.config.async_scheduler:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler as scheduler
        return scheduler(
            vllm_config=config, kv_cache_config=self.setup.kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=self.setup.scheduler_block_size,
            hash_block_size=self.setup.hash_block_size, log_stats=False)

    def _wrap_tier_lookup(self) -> None:
        """With the CPU tier: classify the misses past what the connector will load.

        The connector is asked right after the local lookup, in the same pass, so the pool
        is the one the local lookup saw.
        """
        connector = self.scheduler.connector
        original = connector.get_num_new_matched_tokens
        records = self.records

        def get_num_new_matched_tokens(request: Any, num_computed: int) -> Any:
            ext, load_async = original(request, num_computed)
            record = records.get(request.request_id)
            if (ext and record is not None and record.admitted_order < 0
                    and request.request_id in self.bound_hits):
                bound = min(self.bound_hits[request.request_id], request.num_tokens - 1)
                record.miss_chunks = self.instruments.classify_misses(
                    request, num_computed + ext, bound)
            return ext, load_async

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens

    def _wrap_lookup(self) -> None:
        manager = self.scheduler.kv_cache_manager
        original = manager.get_computed_blocks
        records = self.records

        def lookup(request: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(request, *args, **kwargs)
            record = records.get(request.request_id)
            if (record is not None and record.admitted_order < 0 and self.worker is not None
                    and request.request_id in self.bound_hits):
                bound = min(self.bound_hits[request.request_id], request.num_tokens - 1)
                record.miss_chunks = self.instruments.classify_misses(request, result[1], bound)
            return result

        manager.get_computed_blocks = lookup

    # ---- the loop --------------------------------------------------------------------------------

    def _make_request(self, spec: TraceRequest, now: float) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, temperature=0.0)
        return Request(request_id=spec.id, prompt_token_ids=list(spec.prompt_token_ids),
                       sampling_params=params, pooling_params=None, arrival_time=now,
                       block_hasher=self.block_hasher)

    def run(self) -> RunResult:
        started = time.perf_counter()
        sched = self.scheduler
        result = RunResult(self.policy.name, self.attention_only, self.layout.block_size,
                           self.layout.num_blocks, _selected_backend(), self.records,
                           hash_block_size=self.setup.hash_block_size,
                           pool_bytes=self.setup.pool_bytes)
        followers: dict[str, list[TraceRequest]] = {}
        arrivals: list[tuple[float, int, TraceRequest]] = []
        for index, spec in enumerate(self.trace.requests):
            if spec.after is None:
                heapq.heappush(arrivals, (spec.arrival_s, index, spec))
            else:
                followers.setdefault(spec.after, []).append(spec)
        order = {spec.id: i for i, spec in enumerate(self.trace.requests)}
        now = 0.0
        admitted = 0
        finished = 0
        blocks_sum = 0
        iterations = 0
        idle_steps = 0
        total = len(self.trace.requests)
        while finished < total:
            while arrivals and arrivals[0][0] <= now:
                _, _, spec = heapq.heappop(arrivals)
                sched.add_request(self._make_request(spec, now))
            if not sched.has_requests():
                if not arrivals:
                    raise ReplayError(f"{total - finished} requests never arrived (an 'after' "
                                      "names a request that never finished?)")
                now = arrivals[0][0]
                continue
            if result.steps >= self.config.max_steps:
                raise ReplayError(f"gave up after {result.steps} scheduler steps")
            t0 = time.perf_counter()
            try:
                out = sched.schedule()
            except Exception as exc:
                raise ReplayError(f"vLLM's scheduler raised at step {result.steps + 1} "
                                  f"(simulated t={now:.3f}s): {type(exc).__name__}: {exc}") from exc
            t1 = time.perf_counter()
            for new in out.scheduled_new_reqs:
                record = self.records[new.req_id]
                if record.admitted_order < 0:
                    record.admitted_order = admitted
                    admitted += 1
                    ext = self.connector.loaded.get(new.req_id, 0) if self.connector else 0
                    if self.tier is not None:
                        ext = self.tier.loaded_tokens.pop(new.req_id, 0)
                    record.external_tokens = ext
                    record.hit_tokens = new.num_computed_tokens - ext
            result.preemptions += len(out.preempted_req_ids or ())
            model_output = self._execute(out, result)
            t2 = time.perf_counter()
            engine_outputs = sched.update_from_output(out, model_output)
            t3 = time.perf_counter()
            if self.config.num_spec_tokens:
                self._propose_drafts()
            if out.total_num_scheduled_tokens:
                result.steps += 1
                result.step_us.append((t1 - t0 + t3 - t2) * 1e6)
                idle_steps = 0
            else:
                idle_steps += 1
                if idle_steps > 1000:
                    raise ReplayError("the scheduler scheduled nothing for 1000 steps with "
                                      f"{sched.get_num_unfinished_requests()} requests waiting")
            blocks = self.instruments.mamba_blocks_in_use()
            result.mamba_blocks_peak = max(result.mamba_blocks_peak, blocks)
            blocks_sum += blocks
            iterations += 1
            now += STEP_BASE_S + STEP_PER_TOKEN_S * out.total_num_scheduled_tokens
            for outputs in engine_outputs.values():
                for output in outputs.outputs:
                    if output.finish_reason is None:
                        continue
                    finished += 1
                    self.records[output.request_id].finish_time = now
                    if self.progress is not None:
                        self.progress.update(1)
                    for spec in followers.pop(output.request_id, ()):
                        heapq.heappush(arrivals, (now + spec.arrival_s, order[spec.id], spec))
        if self.tier is not None:
            self._drain_tier(result)
        result.mamba_blocks_mean = blocks_sum / max(1, iterations)
        result.evictions_attention = self.instruments.evictions_attention
        result.evictions_mamba = self.instruments.evictions_mamba
        if self.worker is not None:
            result.mismatches = list(self.worker.mismatches)
            result.state_checks = self.worker.num_checks
        if self.tier is not None:
            result.mismatches += self.tier.mismatches
            self.tier.stats.pinned_chunks_at_end = self.tier.pinned_chunks()
            result.offload = self.tier.stats.to_json()
        from ..patches.patch_vllm_v1_core_kv_cache_coordinator import existing_state

        hybrid_state = existing_state(sched.kv_cache_manager.coordinator)
        if hybrid_state is not None:
            result.retention_ledger = hybrid_state.ledger.snapshot()
        pool = sched.kv_cache_manager.block_pool
        result.blocks_leaked = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        result.wall_s = time.perf_counter() - started
        return result

    def _drain_tier(self, result: RunResult) -> None:
        """Step on while the connector has transfers in flight (vLLM's engine core does)."""
        sched = self.scheduler
        for _ in range(16):
            if not sched.connector.has_pending_push_work():
                return
            out = sched.schedule()
            sched.update_from_output(out, self._execute(out, result))

    def _execute(self, out: Any, result: RunResult) -> Any:
        """The fake model: forced outputs, Mamba fingerprints, prefill accounting."""
        from vllm.v1.outputs import ModelRunnerOutput

        sched = self.scheduler
        spec_tokens = out.scheduled_spec_decode_tokens
        computed: dict[str, int] = {new.req_id: new.num_computed_tokens
                                    for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        if self.tier is not None:
            self.tier.handle_preemptions(out)
            self.tier.worker.execute(out, after_update=self.tier.start_transfers)
            self.tier.after_forward(out)
        elif self.worker is not None:
            self.worker.execute(out, after_update=self._load_external)
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        num_sampled: dict[str, int] = {}
        for req_id in req_ids:
            request = sched.requests[req_id]
            start = computed[req_id]
            n = out.num_scheduled_tokens[req_id]
            drafts = spec_tokens.get(req_id, ())
            real_end = start + n - len(drafts)
            prompt_len = request.num_prompt_tokens
            result.prefill_tokens_computed += max(0, min(real_end, prompt_len) - start)
            reached = max(self.reached.get(req_id, 0), start)
            if start < reached:  # resumed after a preemption, below where it had been
                result.recomputed_tokens += min(real_end, reached) - start
                result.recomputed_prompt_tokens += max(0, min(real_end, reached, prompt_len)
                                                       - start)
            self.reached[req_id] = max(reached, real_end)
            if real_end < request.num_tokens:
                sampled.append([])  # a partial prefill samples nothing
                continue
            forced = self.outputs[req_id]
            produced = request.num_output_tokens
            accepted = 0
            while (accepted < len(drafts) and produced + accepted < len(forced)
                   and drafts[accepted] == forced[produced + accepted]):
                accepted += 1
            tokens = list(forced[produced: produced + accepted + 1])
            sampled.append(tokens)
            num_sampled[req_id] = len(tokens)
        if self.worker is not None:
            self.worker.postprocess(out, num_sampled)
        output = ModelRunnerOutput(req_ids=req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled)
        if self.tier is not None:
            output.kv_connector_output = self.tier.take_output()
        return output

    def _load_external(self, out: Any) -> None:
        """P/D: the fake connector writes the remote prefill's Mamba state (sync load)."""
        if self.connector is None or self.worker is None:
            return
        cached = out.scheduled_cached_reqs
        admitted = [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs]
        admitted += [(rid, num) for rid, num in zip(cached.req_ids, cached.num_computed_tokens)
                     if rid in cached.resumed_req_ids]
        for req_id, num in admitted:
            if not self.connector.loaded.pop(req_id, 0):
                continue
            column = (num - 1) // self.worker.block_size
            for row in range(len(self.worker.group_ids)):
                self.worker.write_state(req_id, row, column, num)
            self.worker.external_loads += 1

    def _propose_drafts(self) -> None:
        from vllm.v1.outputs import DraftTokenIds

        sched = self.scheduler
        req_ids, drafts = [], []
        k = self.config.num_spec_tokens
        for request in sched.running:
            if request.is_prefill_chunk or request.is_finished():
                continue
            forced = self.outputs[request.request_id]
            produced = request.num_output_tokens
            good = min(self.accept(request.request_id, k), k)
            proposal = list(forced[produced: produced + good])
            while len(proposal) < k:
                proposal.append(1 + (len(proposal) % 7))  # never an output token (>= 16)
            req_ids.append(request.request_id)
            drafts.append(proposal)
        if req_ids:
            sched.update_draft_token_ids(DraftTokenIds(req_ids, drafts))
