"""Run a workload under one or more policies and report it: table, JSON, plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..compat import installed_vllm_version
from .harness import (
    MISS_REASONS,
    ReplayConfig,
    prefix_match_units,
    retention_label,
    run_replay,
)
from .metrics import GAP_CAUSES, PolicyMetrics, policy_metrics, request_differences
from .policy import get_policy
from .workloads import Trace

__all__ = ["PLOT_INSTALL_HINT", "Report", "compare_policies", "compare_with_cpu_tier",
           "plot_capacity_sweep",
           "render_table", "sweep_prefix_match_units", "sweep_units", "CapacityPoint"]

PLOT_INSTALL_HINT = "pip install 'vllm-hybrid-backends[plot]'"
PLOT_CAPACITY_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0)
#: ``--prefix-match-unit best`` tries the allowed units of at least this many tokens (finer
#: ones hash every few tokens and give the bound run one block per unit: far slower).
SWEEP_MIN_UNIT = 16


@dataclass
class Report:
    trace: Trace
    config: ReplayConfig
    block_size: int
    num_blocks: int
    pool_bytes: int
    policies: dict[str, PolicyMetrics] = field(default_factory=dict)
    #: ``--prefix-match-unit best``: each policy's token hit rate at every unit tried.
    unit_sweep: dict[str, dict[int, float]] | None = None

    def to_json(self) -> dict[str, Any]:
        shape = self.config.resolved_shape()
        return {
            "vllm_version": installed_vllm_version(),
            "workload": self.trace.name,
            "num_requests": len(self.trace.requests),
            "prompt_tokens": self.trace.num_prompt_tokens,
            "model_shape": shape.name,
            "model_source": shape.source,
            "block_size": self.block_size,
            "cache_tokens": self.config.cache_tokens,
            "num_blocks": self.num_blocks,
            "pool_bytes": self.pool_bytes,
            "platform_rule": self.config.platform,
            **({} if self.config.kv_offloading_size is None
               else {"kv_offloading_size_gib": self.config.kv_offloading_size}),
            **({} if self.config.retention_interval == 0 else {
                "prefix_cache_retention_interval": retention_label(
                    self.config.retention_interval)}),
            "workload_params": self.trace.params,
            "policies": {name: m.to_json() for name, m in self.policies.items()},
            **({} if self.unit_sweep is None else {"prefix_match_unit_sweep": {
                name: {str(u): round(rate, 6) for u, rate in rates.items()}
                for name, rates in self.unit_sweep.items()}}),
        }


def _step_time(runs: Sequence[float], median: float) -> str:
    """The median step time, with the range of the repeats' medians when there are several."""
    if len(runs) < 2:
        return f"{median:.0f}"
    return f"{median:.0f} ({min(runs):.0f}-{max(runs):.0f})"


def compare_policies(trace: Trace, config: ReplayConfig, policies: Sequence[str],
                     progress: Any = None, timing_repeats: int = 1) -> Report:
    """For each policy: the attention-only bound run, then the hybrid run; combine.

    ``timing_repeats`` > 1 replays the hybrid runs that many times in all, the policies
    interleaved, and reports the median of each policy's per-replay median step times (the
    replays are deterministic; only the clock differs), so a step-time ratio is not one run's
    noise; the per-replay medians are kept in ``sched_step_us_runs``.
    """
    if timing_repeats < 1:
        raise ValueError(f"timing_repeats={timing_repeats}: allowed values are integers >= 1")
    report: Report | None = None
    first_hits: dict[str, int] | None = None
    for name in policies:
        policy = get_policy(name)
        bound = run_replay(trace, config, policy, attention_only=True, progress=progress)
        hybrid = run_replay(trace, config, policy, progress=progress,
                            bound_hits={k: r.hit_tokens for k, r in bound.requests.items()})
        hits = {k: r.hit_tokens for k, r in hybrid.requests.items()}
        if report is None:
            report = Report(trace, config, hybrid.block_size, hybrid.num_blocks,
                            hybrid.pool_bytes)
            first_hits = hits
        report.policies[name] = replace(policy_metrics(trace, hybrid, bound),
                                        prefix_match_unit=config.prefix_match_unit
                                        or hybrid.block_size,
                                        sched_step_us_runs=[hybrid.sched_step_us_median],
                                        versus_first=None if hits is first_hits else
                                        request_differences(first_hits or {}, hits,
                                                            policies[0]))
    assert report is not None, "no policy given"
    for _ in range(timing_repeats - 1):
        for name in policies:
            again = run_replay(trace, config, get_policy(name), progress=progress)
            report.policies[name].sched_step_us_runs.append(again.sched_step_us_median)
    for name, metrics in report.policies.items():
        report.policies[name] = replace(
            metrics, sched_step_us_median=statistics.median(metrics.sched_step_us_runs))
    return report


#: Report name of a policy run with vLLM's CPU tier.
CPU_TIER_SUFFIX = "+cpu"


def compare_with_cpu_tier(trace: Trace, config: ReplayConfig, policies: Sequence[str],
                          progress: Any = None) -> Report:
    """Each policy without and with vLLM's CPU tier (``config.kv_offloading_size``).

    Per policy: the attention-only bound (GPU pool only), the hybrid run without the tier
    (named as the policy) and with it (``<policy>+cpu``); both hybrid runs are measured
    against that bound.
    """
    if config.kv_offloading_size is None:
        raise ValueError("compare_with_cpu_tier needs config.kv_offloading_size")
    gpu_only = replace(config, kv_offloading_size=None)
    report: Report | None = None
    for name in policies:
        policy = get_policy(name)
        bound = run_replay(trace, gpu_only, policy, attention_only=True, progress=progress)
        hits = {k: r.hit_tokens for k, r in bound.requests.items()}
        for label, run_config in ((name, gpu_only), (name + CPU_TIER_SUFFIX, config)):
            hybrid = run_replay(trace, run_config, policy, progress=progress, bound_hits=hits)
            if report is None:
                report = Report(trace, config, hybrid.block_size, hybrid.num_blocks,
                                hybrid.pool_bytes)
            metrics = policy_metrics(trace, hybrid, bound)
            report.policies[label] = replace(
                metrics, prefix_match_unit=hybrid.block_size,
                sched_step_us_runs=[metrics.sched_step_us_median])
    assert report is not None, "no policy given"
    return report


def sweep_units(config: ReplayConfig, min_unit: int = SWEEP_MIN_UNIT) -> list[int]:
    """The units ``--prefix-match-unit best`` tries, coarsest first (the block size always)."""
    block = config.layout().block_size
    return sorted((u for u in prefix_match_units(block, config.mamba_block_size)
                   if u >= min_unit or u == block), reverse=True)


def sweep_prefix_match_units(trace: Trace, config: ReplayConfig, policies: Sequence[str],
                             progress: Any = None, timing_repeats: int = 1,
                             min_unit: int = SWEEP_MIN_UNIT) -> Report:
    """Replay at every unit of :func:`sweep_units`; report each policy at its best unit.

    The best unit is the one with the highest token hit rate (the coarsest among equals); its
    metrics, bound included, are the policy's row. ``Report.unit_sweep`` keeps every rate.
    """
    best: Report | None = None
    sweep: dict[str, dict[int, float]] = {name: {} for name in policies}
    block = config.layout().block_size
    for unit in sweep_units(config, min_unit):
        report = compare_policies(trace, replace(config, prefix_match_unit=None if unit == block
                                                 else unit), policies, progress, timing_repeats)
        if best is None:
            best = replace(report, policies=dict(report.policies))
        for name, metrics in report.policies.items():
            sweep[name][unit] = metrics.token_hit_rate
            if metrics.token_hit_rate > best.policies[name].token_hit_rate:
                best.policies[name] = metrics
    assert best is not None, "no unit to sweep"
    best.unit_sweep = sweep
    first = best.policies[policies[0]].prefix_match_unit
    for name, metrics in best.policies.items():  # compared at one unit: only that unit's
        if metrics.prefix_match_unit != first:
            best.policies[name] = replace(metrics, versus_first=None)
    return best


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _retention_note(interval: int | None) -> str:
    if interval == 0:
        return ""
    kept = "every chunk's end" if interval is None else f"every {interval:,} tokens"
    return f"; Mamba states retained at {kept} (prefix_cache_retention_interval)"


def render_table(report: Report) -> str:
    """The comparison table ``replay`` prints."""
    shape = report.config.resolved_shape()
    trace = report.trace
    names = list(report.policies)
    m = report.policies
    width = max(12, *(len(n) + 2 for n in names))
    read_as = ""
    if trace.params.get("format") == "hash-block":
        span = max((r.arrival_s for r in trace.requests), default=0.0)
        scale = trace.params.get("time_scale", 1.0)
        read_as = (f" (hash-block trace: {trace.params['hash_block_size']} tokens per hash id, "
                   f"timestamps in {trace.params['timestamp_unit']}"
                   f"{f' x {scale:g}' if scale != 1.0 else ''}, arrivals over {span:,.0f} s)")
    lines = [
        f"workload {trace.name}: {len(trace.requests)} requests, "
        f"{trace.num_prompt_tokens:,} prompt tokens{read_as}",
        f"model shape {shape.name} ({shape.num_attention_layers} attention + "
        f"{shape.num_mamba_layers} {shape.state.kind} layers), block {report.block_size} tokens "
        f"({report.config.platform} rule), cache {report.config.cache_tokens:,} tokens = "
        f"{report.num_blocks - 1} blocks ({report.pool_bytes / 2**30:.2f} GiB)"
        + ("" if report.config.kv_offloading_size is None else
           f"; CPU tier (vLLM's OffloadingConnector) {report.config.kv_offloading_size:g} GiB")
        + _retention_note(report.config.retention_interval),
        f"vLLM {installed_vllm_version()}, state backend {m[names[0]].backend}",
        "",
        f"{'':34}" + "".join(f"{n:>{width}}" for n in names),
    ]

    def row(label: str, values: Sequence[str]) -> None:
        lines.append(f"{label:34}" + "".join(f"{v:>{width}}" for v in values))

    if report.unit_sweep is not None or any(m[n].prefix_match_unit != report.block_size
                                            for n in names):
        row("prefix match unit (tokens)", [str(m[n].prefix_match_unit) for n in names])
    row("token hit rate", [_pct(m[n].token_hit_rate) for n in names])
    row("attention-only bound", [_pct(m[n].bound_hit_rate) for n in names])
    row("ideal (token-granular, unbounded)", [_pct(m[n].ideal_hit_rate) for n in names])
    row("prefill tokens computed", [f"{m[n].prefill_tokens_computed:,}" for n in names])
    row("scheduler steps", [f"{m[n].scheduler_steps:,}" for n in names])
    row("Mamba state blocks peak / mean",
        [f"{m[n].mamba_blocks_peak} / {m[n].mamba_blocks_mean:.1f}" for n in names])
    row("evictions attention / Mamba",
        [f"{m[n].evictions_attention} / {m[n].evictions_mamba}" for n in names])
    row("preemptions", [str(m[n].preemptions) for n in names])
    row("recomputed after preemption", [f"{m[n].recomputed_tokens:,}" for n in names])
    row("  of which prompt tokens", [f"{m[n].recomputed_prompt_tokens:,}" for n in names])
    if len(names) > 1 and m[names[1]].versus_first is not None:
        row(f"requests hitting more than {names[0]}", [_versus(m[n].versus_first, "more")
                                                      for n in names])
        row(f"requests hitting less than {names[0]}", [_versus(m[n].versus_first, "fewer")
                                                      for n in names])
    if any(m[n].offload is not None for n in names):
        _tier_rows(row, [m[n] for n in names])
    row("state mismatches (checks)",
        [f"{m[n].state_mismatches} ({m[n].state_checks:,})" for n in names])
    row("median scheduler step (us)", [_step_time(m[n].sched_step_us_runs, m[n].sched_step_us_median)
                                       for n in names])
    lines.append("missed reusable prompt tokens, by reason:")
    for reason in MISS_REASONS:
        row(f"  {reason.replace('_', ' ')}", [f"{m[n].miss_reasons[reason]:,}" for n in names])
    lines.append("gap to the ideal (tokens), by cause:")
    for cause in GAP_CAUSES:
        row(f"  {cause}", [f"{m[n].gap_to_ideal[cause]:,}" for n in names])
    if report.unit_sweep is not None:
        for n in names:
            rates = ", ".join(f"{u}: {_pct(r)}" for u, r in report.unit_sweep[n].items())
            lines.append(f"{n}: hit rate by prefix match unit: {rates}")
    for n in names:
        if m[n].patches:
            lines.append(f"{n}: patches applied: {', '.join(m[n].patches)}")
        for example in m[n].mismatch_examples:
            lines.append(f"{n}: MISMATCH {example}")
    return "\n".join(lines)


def _versus(differences: dict[str, Any] | None, side: str) -> str:
    """``requests (tokens)`` of one side of :func:`request_differences`; ``-`` for the first."""
    if differences is None:
        return "-"
    sign = "+" if side == "more" else "-"
    return f"{differences['requests_' + side]} ({sign}{differences['tokens_' + side]:,})"


def _tier_rows(row: Any, metrics: Sequence[PolicyMetrics]) -> None:
    """The CPU tier's rows: hits it served, what it stored and which of that came back."""
    def each(value: Any) -> list[str]:
        return [value(p.offload) if p.offload is not None else "-" for p in metrics]

    def fraction(done: int, of: int) -> str:
        return f"{done}/{of}" + (f" ({100 * done / of:.0f} %)" if of else "")

    row("loaded from the CPU tier", [_pct(p.external_hit_rate) for p in metrics])
    row("  local + CPU tier", [_pct(p.token_hit_rate + p.external_hit_rate) for p in metrics])
    row("CPU tier capacity (chunks)", each(lambda o: f"{o['capacity_chunks']:,}"))
    for kind in ("attention", "mamba"):
        label = "attention blocks" if kind == "attention" else "Mamba states"
        row(f"{label} stored / later loaded",
            each(lambda o, k=kind: fraction(o["reused"][k], o["stored"][k])))
    for place in ("prompt_end", "inside_prompt", "decode"):
        row(f"  Mamba at {place.replace('_', ' ')}",
            each(lambda o, p=place: fraction(o["mamba_reused_by_place"][p],
                                             o["mamba_stored_by_place"][p])))
    row("CPU chunks pinned after the run", each(lambda o: str(o["pinned_chunks_at_end"])))


@dataclass
class CapacityPoint:
    """One capacity of :func:`plot_capacity_sweep`: each policy's hit rate, the bound, the ideal."""

    cache_tokens: int
    token_hit_rate: dict[str, float]
    bound_hit_rate: float
    ideal_hit_rate: float


def plot_capacity_sweep(trace: Trace, config: ReplayConfig, policies: Sequence[str], path: str,
                        progress: Any = None) -> list[CapacityPoint]:
    """Token hit rate against cache capacity for each policy, the bound and the ideal (PNG).

    Re-runs the workload at :data:`PLOT_CAPACITY_FACTORS` times ``config.cache_tokens``. The
    bound and the ideal are the first policy's (the ideal changes with capacity only through
    the order requests are admitted in).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(f"--plot needs matplotlib: {PLOT_INSTALL_HINT}") from None
    block = config.layout().block_size
    points: list[CapacityPoint] = []
    for factor in PLOT_CAPACITY_FACTORS:
        tokens = max(block, int(config.cache_tokens * factor) // block * block)
        report = compare_policies(trace, replace(config, cache_tokens=tokens), policies,
                                  progress)
        first = next(iter(report.policies.values()))
        points.append(CapacityPoint(tokens, {n: p.token_hit_rate
                                             for n, p in report.policies.items()},
                                    first.bound_hit_rate, first.ideal_hit_rate))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [p.cache_tokens for p in points]
    for name in policies:
        ax.plot(xs, [100 * p.token_hit_rate[name] for p in points], marker="o", label=name)
    ax.plot(xs, [100 * p.bound_hit_rate for p in points], linestyle="--", color="gray",
            label="attention-only bound")
    ax.plot(xs, [100 * p.ideal_hit_rate for p in points], linestyle=":", color="black",
            label="ideal (token-granular, unbounded)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV cache capacity (tokens)")
    ax.set_ylabel("token hit rate (%)")
    unit = f", prefix match unit {config.prefix_match_unit}" if config.prefix_match_unit else ""
    ax.set_title(f"{trace.name} on {config.resolved_shape().name}, block {block}{unit}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return points
