"""vLLM's own CPU tier in the replay: the real ``OffloadingConnector``, a simulated worker side.

``replay --kv-offloading-size GIB`` (vLLM's ``--kv-offloading-size``, same unit) runs the
scheduler with ``kv_transfer_config`` set the way vLLM's ``VllmConfig`` sets it for that flag
(``OffloadingConnector``, ``kv_role="kv_both"``, ``cpu_bytes_to_use``), so vLLM's ``Scheduler``
builds the connector itself: its scheduler side, its CPU ``OffloadingManager`` (LRU) and its
hybrid align-mode handling (Mamba groups are stored from the block manager's boundary-state
hand-off, looked up as one-chunk sliding windows) all run unchanged.

Only the worker side is simulated, by :class:`CPUTierWorker`, in the order vLLM's
``OffloadingConnectorWorker`` runs it: flushed stores before the step's state update, the
previous step's deferred stores and this step's loads after it, this step's stores deferred to
the next step; every transfer reports done in the step that runs it. A transfer copies what
the fake model holds in the blocks: Mamba fingerprints (:mod:`.oracle`) and, for attention
blocks, a stand-in written by every forward (tokens covered, hash of the prefix up to there).
A request's first read after admission checks both, so a load of the wrong chunk or the wrong
block is a state mismatch, as a wrong local hit is.

Not covered: sub-block hits (``--prefix-match-unit``; vLLM's partial-tail offload), speculative
decoding, ``blocks_per_chunk`` > 1. The attention-only bound stays GPU-only.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .oracle import FakeHybridWorker, Mismatch

__all__ = ["AttentionMismatch", "CPUTierWorker", "TierStats", "tier_problem",
           "tier_transfer_config"]

CONNECTOR = "OffloadingConnector"
#: What the harness uses of vLLM's offloading (0.32+): module, symbol, attribute (or "").
_REQUIRED = (
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector", CONNECTOR, ""),
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.common",
     "OffloadingWorkerMetadata", ""),
    ("vllm.v1.kv_offload.cpu.spec", "CPUOffloadingSpec", ""),
    ("vllm.v1.core.sched.output", "KVConnectorBlockState", "boundary_state_offloads"),
)
_POISON = -5  # what a load of a chunk of another kind of group writes


def tier_problem() -> str | None:
    """Why this vLLM cannot run the CPU tier (None when it can)."""
    missing = []
    for module_name, symbol, attribute in _REQUIRED:
        try:
            found = getattr(importlib.import_module(module_name), symbol)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{symbol}")
            continue
        fields = getattr(found, "__dataclass_fields__", {})
        if attribute and attribute not in fields and not hasattr(found, attribute):
            missing.append(f"{module_name}.{symbol}.{attribute}")
    if not missing:
        return None
    from ..compat import installed_vllm_version

    return (f"--kv-offloading-size needs vLLM's OffloadingConnector with hybrid align-mode "
            f"support (0.32+); vLLM {installed_vllm_version()} has no {', '.join(missing)}")


@contextlib.contextmanager
def tier_transfer_config(vllm_config: Any, size_gib: float) -> Iterator[None]:
    """``kv_transfer_config`` as vLLM sets it for ``--kv-offloading-size`` (native backend)."""
    from vllm.config import KVTransferConfig

    previous = vllm_config.kv_transfer_config
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR, kv_role="kv_both", engine_id="hb-replay",
        kv_connector_extra_config={"cpu_bytes_to_use": size_gib * (1 << 30)})
    try:
        yield
    finally:
        vllm_config.kv_transfer_config = previous


@dataclass(frozen=True)
class AttentionMismatch(Mismatch):
    """An attention block whose stand-in KV is not that of the prefix it should hold."""

    def describe(self) -> str:
        return (f"{self.request_id}: attention group {self.group} block {self.block} (column "
                f"{self.column}) holds KV of {self.found_tokens} tokens of another prefix or "
                f"length; expected the first {self.expected_tokens} tokens "
                f"({'resume from cache' if self.resume else 'running'})")


#: Where a stored Mamba state sits in the request that stored it.
MAMBA_PLACES = ("prompt_end", "inside_prompt", "decode")


@dataclass
class TierStats:
    """What the tier stored and loaded (counts of chunks = one group's block each)."""

    capacity_chunks: int = 0
    stored: dict[str, int] = field(default_factory=lambda: {"attention": 0, "mamba": 0})
    loaded: dict[str, int] = field(default_factory=lambda: {"attention": 0, "mamba": 0})
    #: stores whose chunk was loaded at least once before it was overwritten
    reused: dict[str, int] = field(default_factory=lambda: {"attention": 0, "mamba": 0})
    mamba_stored_by_place: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(MAMBA_PLACES, 0))
    mamba_reused_by_place: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(MAMBA_PLACES, 0))
    loaded_tokens: int = 0
    load_jobs: int = 0
    store_jobs: int = 0
    #: CPU chunks still pinned (being written or read) after the run drained: a leak if > 0
    pinned_chunks_at_end: int = 0

    def to_json(self) -> dict[str, Any]:
        reuse = {kind: (self.reused[kind] / self.stored[kind] if self.stored[kind] else 0.0)
                 for kind in self.stored}
        return {**vars(self), "reused_fraction": reuse}


@dataclass
class _Stored:
    kind: str  # "attention" or "mamba"
    group: int
    payload: tuple[Any, ...]
    place: str = ""
    loads: int = 0


class CPUTierWorker:
    """The worker side of vLLM's ``OffloadingConnector`` over the fake model's blocks.

    :param scheduler: vLLM's ``Scheduler``, built with :func:`tier_transfer_config`.
    :param worker: the run's :class:`~.oracle.FakeHybridWorker` (Mamba fingerprints).
    :param prompt_lens: request id -> prompt length (where a stored Mamba state sits).
    """

    def __init__(self, scheduler: Any, worker: FakeHybridWorker, setup: Any,
                 prompt_lens: dict[str, int]) -> None:
        connector = scheduler.connector
        if type(connector).__name__ != CONNECTOR:
            raise RuntimeError(f"the scheduler's KV connector is {type(connector).__name__}, "
                               f"not vLLM's {CONNECTOR}")
        self.connector = connector
        side = connector.connector_scheduler
        offload = side.config
        if offload.blocks_per_chunk != 1 or offload.supports_partial_tail:
            raise RuntimeError("the replay's CPU tier simulates one block per chunk and no "
                               f"partial tails (blocks_per_chunk={offload.blocks_per_chunk}, "
                               f"partial tails {offload.supports_partial_tail})")
        self.manager = side.manager
        self.worker = worker
        self.prompt_lens = prompt_lens
        groups = setup.kv_cache_config.kv_cache_groups
        #: offloaded groups in the connector's order (GPULoadStoreSpec.group_sizes order)
        self.groups = [c.group_idx for c in offload.kv_group_configs]
        self.block_size = {g: int(groups[g].kv_cache_spec.block_size) for g in self.groups}
        self.mamba_row = {g: row for row, g in enumerate(worker.group_ids)}
        self.attention_groups = [g for g in setup.attention_group_ids if g in self.block_size]
        num_blocks = setup.kv_cache_config.num_blocks
        #: attention stand-in per group and block: (tokens covered, hash of that prefix)
        self.kv = {g: np.full((num_blocks, 2), -7, dtype=np.int64)
                   for g in self.attention_groups}
        self.chunks: dict[int, _Stored] = {}
        self._deferred: list[tuple[int, str, Any, Any]] = []
        self._completed: dict[int, int] = {}
        self._recving: set[str] = set()
        self._load_requests: dict[int, str] = {}
        self.mismatches: list[Mismatch] = []
        self.stats = TierStats(capacity_chunks=int(getattr(self.manager, "_num_chunks", 0)))
        #: request id -> tokens its last admission loads from the tier
        self.loaded_tokens: dict[str, int] = {}
        original = connector.update_state_after_alloc

        def update_state_after_alloc(request: Any, blocks: Any, num_external: int) -> Any:
            if num_external:
                self.loaded_tokens[request.request_id] = num_external
                self.stats.loaded_tokens += num_external
            return original(request, blocks, num_external)

        connector.update_state_after_alloc = update_state_after_alloc

    # ---- block contents --------------------------------------------------------------------

    def _read(self, group: int, block: int) -> tuple[str, tuple[Any, ...]]:
        if group in self.mamba_row:
            row = self.mamba_row[group]
            return "mamba", (self.worker.temporal_np[row][block].copy(),
                             self.worker.conv_np[row][block].copy())
        return "attention", (self.kv[group][block].copy(),)

    def _write(self, group: int, block: int, stored: _Stored) -> None:
        kind = "mamba" if group in self.mamba_row else "attention"
        right = stored.kind == kind
        if kind == "mamba":
            row = self.mamba_row[group]
            self.worker.temporal_np[row][block] = stored.payload[0] if right else _POISON
            self.worker.conv_np[row][block] = stored.payload[1] if right else _POISON
        else:
            self.kv[group][block] = stored.payload[0] if right else _POISON

    def _pairs(self, gpu_spec: Any, chunk_ids: Any) -> Iterator[tuple[int, int, int, int]]:
        """(group, block index in the request, GPU block, CPU chunk) of one transfer."""
        blocks = [int(b) for b in gpu_spec.block_ids]
        chunks = [int(c) for c in chunk_ids]
        if len(blocks) != len(chunks):
            raise RuntimeError(f"a transfer pairs {len(blocks)} GPU blocks with {len(chunks)} "
                               "CPU chunks (the replay simulates one block per chunk)")
        i = 0
        for group, size, first in zip(self.groups, gpu_spec.group_sizes,
                                      gpu_spec.block_indices):
            for j in range(size):
                yield group, first + j, blocks[i], chunks[i]
                i += 1

    def _store(self, job_id: int, request_id: str, gpu_spec: Any, cpu_spec: Any) -> None:
        for group, index, block, chunk in self._pairs(gpu_spec, cpu_spec.block_ids):
            kind, payload = self._read(group, block)
            place = ""
            if kind == "mamba":
                boundary = (index + 1) * self.block_size[group]
                prompt = self.prompt_lens.get(request_id, 0)
                place = ("decode" if boundary > prompt else "prompt_end"
                         if boundary > prompt - self.block_size[group] else "inside_prompt")
                self.stats.mamba_stored_by_place[place] += 1
            self.chunks[chunk] = _Stored(kind, group, payload, place)
            self.stats.stored[kind] += 1
        self.stats.store_jobs += 1
        self._completed[job_id] = 1

    def _load(self, job_id: int, request_id: str, cpu_spec: Any, gpu_spec: Any) -> None:
        for group, _, block, chunk in self._pairs(gpu_spec, cpu_spec.block_ids):
            stored = self.chunks.get(chunk)
            if stored is None:
                raise RuntimeError(f"{request_id}: load of CPU chunk {chunk}, never stored")
            self._write(group, block, stored)
            self.stats.loaded[stored.kind] += 1
            if stored.loads == 0:
                self.stats.reused[stored.kind] += 1
                if stored.kind == "mamba":
                    self.stats.mamba_reused_by_place[stored.place] += 1
            stored.loads += 1
        self.stats.load_jobs += 1
        self._completed[job_id] = 1
        self._recving.add(request_id)

    # ---- one step, in the order of vLLM's OffloadingConnectorWorker ------------------------

    def handle_preemptions(self, out: Any) -> None:
        """Before the state update: flushed stores, then every deferred store."""
        meta = out.kv_connector_metadata
        for job_id in meta.jobs_to_flush or ():
            job = meta.store_jobs.pop(job_id, None)
            if job is not None:
                self._deferred.append((job_id, job.req_id, job.src_spec, job.dst_spec))
        if meta.jobs_to_flush:
            self._run_deferred()

    def _run_deferred(self) -> None:
        for job_id, request_id, gpu_spec, cpu_spec in self._deferred:
            self._store(job_id, request_id, gpu_spec, cpu_spec)
        self._deferred.clear()

    def start_transfers(self, out: Any) -> None:
        """After the state update: deferred stores, this step's loads, then the reads' check."""
        self._run_deferred()
        for job_id, job in out.kv_connector_metadata.load_jobs.items():
            self._load(job_id, job.req_id, job.src_spec, job.dst_spec)
        self.check_attention(out)

    def check_attention(self, out: Any) -> None:
        """Every block below a fresh request's computed tokens holds its prefix's KV."""
        worker = self.worker
        for req_id in worker.fresh:
            req = worker.requests[req_id]
            if req.num_computed == 0:
                continue
            tokens = worker.tokens(req_id)
            for group in self.attention_groups:
                size = self.block_size[group]
                ids = req.block_ids[group]
                for index in range(req.num_computed // size):
                    end = (index + 1) * size
                    length, value = self.kv[group][ids[index]].tolist()
                    if length != end or value != req.hash_upto(tokens, end):
                        self.mismatches.append(AttentionMismatch(
                            request_id=req_id, group=group, block=ids[index], column=index,
                            expected_tokens=end, found_tokens=length, what="attention",
                            resume=True))
                        break

    def after_forward(self, out: Any) -> None:
        """Write the attention stand-ins of the computed tokens; defer this step's stores."""
        worker = self.worker
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            req = worker.requests[req_id]
            tokens = worker.tokens(req_id)
            start = req.num_computed
            end = start + num_scheduled - len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            for group in self.attention_groups:
                size = self.block_size[group]
                ids = req.block_ids[group]
                for index in range(start // size, -(-end // size)):
                    upto = min((index + 1) * size, end)
                    self.kv[group][ids[index]] = (upto, req.hash_upto(tokens, upto))
        for job_id, job in out.kv_connector_metadata.store_jobs.items():
            self._deferred.append((job_id, job.req_id, job.src_spec, job.dst_spec))

    def take_output(self) -> Any:
        """The step's ``KVConnectorOutput`` (None when nothing finished)."""
        if not self._completed:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        meta = OffloadingWorkerMetadata(completed_jobs=self._completed)
        output = KVConnectorOutput(finished_sending=set(), finished_recving=self._recving,
                                   kv_connector_worker_meta=meta)
        self._completed, self._recving = {}, set()
        return output

    def pinned_chunks(self) -> int:
        """CPU chunks held by a transfer (vLLM's manager counters; 0 once drained)."""
        manager = self.manager
        try:
            allocated = manager._num_allocated_chunks - len(manager._free_list)
            return int(allocated - manager._num_evictable_cache_chunks)
        except AttributeError:
            return 0
