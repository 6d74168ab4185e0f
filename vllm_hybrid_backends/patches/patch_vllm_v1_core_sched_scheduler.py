"""Stop align-mode prefill chunks at the plugin's checkpoints and on the Mamba grid.

- Targets: ``vllm.v1.core.sched.scheduler.Scheduler._mamba_block_aligned_split``.
- Why: vLLM materialises a Mamba state only where a prefill chunk ends, and keeps just the
  prompt's last aligned boundary (plus a shared-prefix junction seen *while* a second request
  prefills). A request that later diverges inside an earlier prompt therefore recomputes from
  token 0 (the agentic/incremental miss). Separately, the split aligns on
  ``cache_config.block_size`` (the smallest group's block), so with a coarser Mamba block a
  chunk can end off the Mamba grid and a state is cached under the wrong boundary.
- How: a decode step (the chunk starts at or past the prefill end, where vLLM's split returns
  the count unchanged: ``tests/test_align.py`` checks it on the installed vLLM) returns at
  once, the scheduler calls this for every running request each step. Otherwise the original
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
- Upstream: vLLM #54076 (chunk ends off the Mamba grid, open); the agentic miss is §4(a) of
  ``vllm_map.md``; junction checkpoints #37898 only help the third request.
- vLLM versions: 0.23.x, 0.26.x, 0.30.x-0.33.x (the method's signature is checked when it
  binds). A chunk runs past a tail checkpoint only where the coordinator patch plans an
  interior block for it (never on 0.23).
- Removal: when vLLM retains intermediate boundaries itself and splits on the Mamba block.
"""

from __future__ import annotations

import importlib
from typing import Any

from .. import align, stats
from ..compat import signature_problem
from . import patch_vllm_v1_core_kv_cache_coordinator as coordinator_patch

TARGET_MODULE = "vllm.v1.core.sched.scheduler"
TARGET_SYMBOLS = ("Scheduler._mamba_block_aligned_split", "Scheduler.update_from_output")
PROCESS = "engine"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"

_ORIGINALS: dict[str, Any] = {}


def _scheduler_class() -> Any:
    return importlib.import_module(TARGET_MODULE).Scheduler


def missing() -> list[str]:
    try:
        cls = _scheduler_class()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    lacking = [f"Scheduler.{name}" for name in ("_mamba_block_aligned_split", "update_from_output")
               if not callable(getattr(cls, name, None))]
    if lacking:
        return lacking
    split = _ORIGINALS.get("_mamba_block_aligned_split", cls._mamba_block_aligned_split)
    problem = signature_problem(split, TARGET_SYMBOLS[0], (
        "self", "request", "num_new_tokens", "num_new_local_computed_tokens",
        "num_external_computed_tokens"))
    return [problem] if problem else []


def _mamba_block_aligned_split(self: Any, request: Any, num_new_tokens: int,
                               num_new_local_computed_tokens: int = 0,
                               num_external_computed_tokens: int = 0) -> int:
    start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
    prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
    if start >= prefill_end:  # decoding: vLLM splits only prefills, the count stays
        return num_new_tokens
    scheduled = _ORIGINALS["_mamba_block_aligned_split"](
        self, request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)
    if scheduled <= 0:
        return scheduled
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
    current = cls._mamba_block_aligned_split
    if current is _mamba_block_aligned_split:
        return
    _ORIGINALS["_mamba_block_aligned_split"] = current
    cls._mamba_block_aligned_split = _mamba_block_aligned_split


def revert() -> None:
    if "update_from_output" in _ORIGINALS:
        _scheduler_class().update_from_output = _ORIGINALS.pop("update_from_output")
    if "_mamba_block_aligned_split" in _ORIGINALS:
        _scheduler_class()._mamba_block_aligned_split = _ORIGINALS.pop("_mamba_block_aligned_split")
