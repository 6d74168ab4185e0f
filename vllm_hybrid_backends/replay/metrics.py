"""Per-policy metrics of a replay, and the miss attribution.

For every request (at its first admission) the tokens a perfect token-granular prefix cache
would have reused, ``ideal = min(longest prefix shared with any earlier admitted request's
prompt + output, prompt_len - 1)``, are split into the hit and the reasons for the rest:

- ``prefix_shorter_than_block``: the part of ``ideal`` past its last full hash block (a shared
  prefix shorter than one block is entirely this);
- ``evicted``: full blocks the attention-only bound run could not reuse either (its KV was
  evicted), plus the chunks up to the deepest boundary whose Mamba state was lost to eviction at
  lookup time: evicted in every Mamba group that lacks it, or present with the attention blocks
  before it evicted (kept, it would have given the hit all of them);
- ``no_mamba_state_at_boundary``: chunks the attention-only run reused past the deepest
  boundary where any Mamba group ever held a state;
- ``groups_disagreed``: the chunks up to the deepest boundary where some Mamba groups held the
  state and another never had it;
- ``other``: anything left (the chunks up to a boundary every group had at lookup time, with
  its attention blocks, that the lookup still missed; expected to stay 0).

The hybrid-run chunks are classified when the request's prefix-cache lookup runs (the last
lookup before admission), against the block pool's state at that moment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .harness import MISS_REASONS, RunResult
from .oracle import HASH_BASE, HASH_MOD
from .workloads import Trace

__all__ = ["GAP_CAUSES", "PolicyMetrics", "gap_to_ideal", "ideal_hits", "policy_metrics"]

#: The gap to the ideal by cause, from the miss reasons (their sum is ideal - hit, in tokens).
GAP_CAUSES: dict[str, tuple[str, ...]] = {
    "capacity": ("evicted",),
    "placement": ("no_mamba_state_at_boundary", "groups_disagreed"),
    "granularity": ("prefix_shorter_than_block",),
    "other": ("other",),
}

_GRANULE = 16


def _prefix_hashes(tokens: list[int], limit: int) -> list[int]:
    """Hash of every prefix length 0..limit."""
    out = [0]
    h = 0
    for token in tokens[:limit]:
        h = (h * HASH_BASE + token + 1) % HASH_MOD
        out.append(h)
    return out


def _common_length(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def ideal_hits(trace: Trace, order: dict[str, int]) -> dict[str, int]:
    """Token-granular longest shared prefix with any earlier admitted request (see module).

    Exact (up to 61-bit hash collisions): every earlier prompt + output is indexed by the hash
    of each of its prefixes at a multiple of ``_GRANULE`` tokens, with the distinct next
    ``_GRANULE - 1`` tokens seen after it. A request's longest granule-aligned shared prefix is
    found by binary search (shared prefixes are prefix-closed), then extended token by token
    against every continuation stored there.
    """
    by_id = {r.id: r for r in trace.requests}
    continuations: dict[int, set[tuple[int, ...]]] = {}
    result: dict[str, int] = {}
    for rid in sorted(order, key=order.__getitem__):
        request = by_id[rid]
        prompt = request.prompt_token_ids
        limit = len(prompt) - 1
        shared = 0
        if continuations and limit > 0:
            hashes = _prefix_hashes(prompt, limit)
            lo, hi = 1, limit // _GRANULE + 1  # granule 0 (the empty prefix) is always seen
            while lo < hi:
                mid = (lo + hi) // 2
                if hashes[mid * _GRANULE] in continuations:
                    lo = mid + 1
                else:
                    hi = mid
            best = (lo - 1) * _GRANULE
            head = prompt[best:limit]
            shared = best + max(_common_length(c, head)
                                for c in continuations[hashes[best]])
        result[rid] = shared
        full = prompt + request.output_token_ids
        full_hashes = _prefix_hashes(full, len(full))
        for p in range(0, len(full) + 1, _GRANULE):
            continuations.setdefault(full_hashes[p], set()).add(
                tuple(full[p:p + _GRANULE - 1]))
    return result


def gap_to_ideal(miss_reasons: dict[str, int]) -> dict[str, int]:
    """Group the miss reasons by cause: capacity, placement, granularity (and other)."""
    return {cause: sum(miss_reasons[r] for r in reasons) for cause, reasons in GAP_CAUSES.items()}


@dataclass
class PolicyMetrics:
    """The numbers reported for one policy (``--json`` field names)."""

    token_hit_rate: float
    bound_hit_rate: float
    ideal_hit_rate: float
    prefill_tokens_computed: int
    recomputed_prompt_tokens: int
    recomputed_tokens: int
    scheduler_steps: int
    mamba_blocks_peak: int
    mamba_blocks_mean: float
    evictions_attention: int
    evictions_mamba: int
    preemptions: int
    state_mismatches: int
    state_checks: int
    sched_step_us_median: float
    miss_reasons: dict[str, int]
    #: ``ideal - hit`` in tokens split by cause (:data:`GAP_CAUSES`); the parts add up exactly.
    gap_to_ideal: dict[str, int]
    backend: str
    patches: list[str]
    blocks_leaked: int
    wall_s: float
    mismatch_examples: list[str] = field(default_factory=list)
    #: The hit granularity it ran at: ``--prefix-match-unit``, else the block size.
    prefix_match_unit: int = 0
    #: Median scheduler step of each interleaved replay (``--timing-repeats``), in run order;
    #: ``sched_step_us_median`` is their median.
    sched_step_us_runs: list[float] = field(default_factory=list)
    #: Prompt tokens loaded through a KV connector (the CPU tier, P/D) at first admission,
    #: over all prompt tokens; ``token_hit_rate`` counts local prefix-cache hits only.
    external_hit_rate: float = 0.0
    #: With vLLM's CPU tier (``--kv-offloading-size``): what it stored and loaded.
    offload: dict[str, Any] | None = None
    #: Against the first policy of the comparison (:func:`request_differences`): how many
    #: requests hit more / fewer prompt tokens at first admission, and how many tokens.
    versus_first: dict[str, Any] | None = None
    #: The plugin's retention ledger at the end of the run (None under upstream).
    retention_ledger: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in vars(self).items()}


def policy_metrics(trace: Trace, hybrid: RunResult, bound: RunResult) -> PolicyMetrics:
    """Combine a hybrid run and its attention-only bound run into :class:`PolicyMetrics`."""
    prompt_tokens = trace.num_prompt_tokens
    order = {rid: rec.admitted_order for rid, rec in hybrid.requests.items()
             if rec.admitted_order >= 0}
    ideal = ideal_hits(trace, order)
    granule = hybrid.hash_block_size
    reasons = dict.fromkeys(MISS_REASONS, 0)
    for rid, record in hybrid.requests.items():
        best = ideal.get(rid, 0)
        hit = record.hit_tokens + record.external_tokens
        bound_hit = bound.requests[rid].hit_tokens
        if hit >= best:
            reasons["other"] += best - hit  # a hit beyond the ideal would be a bug: shows here
            continue
        block_floor = best // granule * granule
        reasons["prefix_shorter_than_block"] += best - max(block_floor, hit)
        reasons["evicted"] += max(0, block_floor - max(bound_hit, hit))
        chunks = dict(record.miss_chunks)
        covered = sum(chunks.values())
        expected = max(0, min(bound_hit, block_floor) - hit)
        if covered != expected:  # the lookup saw a different bound (should not happen)
            chunks["other"] = chunks.get("other", 0) + expected - covered
        for reason, tokens in chunks.items():
            reasons[reason] += tokens
    return PolicyMetrics(
        token_hit_rate=sum(r.hit_tokens for r in hybrid.requests.values()) / prompt_tokens,
        bound_hit_rate=sum(r.hit_tokens for r in bound.requests.values()) / prompt_tokens,
        ideal_hit_rate=sum(ideal.values()) / prompt_tokens,
        prefill_tokens_computed=hybrid.prefill_tokens_computed,
        recomputed_prompt_tokens=hybrid.recomputed_prompt_tokens,
        recomputed_tokens=hybrid.recomputed_tokens,
        scheduler_steps=hybrid.steps,
        mamba_blocks_peak=hybrid.mamba_blocks_peak,
        mamba_blocks_mean=hybrid.mamba_blocks_mean,
        evictions_attention=hybrid.evictions_attention,
        evictions_mamba=hybrid.evictions_mamba,
        preemptions=hybrid.preemptions,
        state_mismatches=len(hybrid.mismatches),
        state_checks=hybrid.state_checks,
        sched_step_us_median=hybrid.sched_step_us_median,
        miss_reasons=reasons,
        gap_to_ideal=gap_to_ideal(reasons),
        backend=hybrid.backend,
        patches=hybrid.patches,
        blocks_leaked=hybrid.blocks_leaked,
        wall_s=hybrid.wall_s,
        mismatch_examples=[m.describe() for m in hybrid.mismatches[:5]],
        external_hit_rate=sum(r.external_tokens for r in hybrid.requests.values())
        / prompt_tokens,
        offload=hybrid.offload,
        retention_ledger=hybrid.retention_ledger,
    )


def request_differences(baseline: dict[str, int], other: dict[str, int],
                        against: str) -> dict[str, Any]:
    """Per request, first-admission hit tokens of ``other`` against ``baseline`` (request id ->
    hit tokens, the same requests): how many requests hit more and fewer, and by how many tokens
    in all. A hit-rate difference made of a few requests moved by a changed schedule reads
    differently from one every request shares."""
    if baseline.keys() != other.keys():
        raise ValueError(f"the runs replayed different requests ({len(baseline)} and "
                         f"{len(other)}); allowed: runs of one trace")
    more = [other[k] - baseline[k] for k in baseline if other[k] > baseline[k]]
    fewer = [baseline[k] - other[k] for k in baseline if other[k] < baseline[k]]
    return {"against": against, "requests_more": len(more), "tokens_more": sum(more),
            "requests_fewer": len(fewer), "tokens_fewer": sum(fewer)}
