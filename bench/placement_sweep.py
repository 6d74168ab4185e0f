"""Plugin vs upstream over a capacity sweep: hit rates, bound, ideal, mismatches, leaks.

    python bench/placement_sweep.py                      # the full grid (tens of minutes)
    python bench/placement_sweep.py --workloads agentic --shapes qwen3.5-0.8b --capacities 65536
    python bench/placement_sweep.py --json --check       # exit 1 if a row breaks the rules
    python bench/placement_sweep.py --capacities 65536 --seeds 0,1,2,3   # each row per seed
    python bench/placement_sweep.py --prefix-match-unit 16   # sub-block hits, both policies
    python bench/placement_sweep.py --time-scales 0.96,0.98,1,1.02,1.04   # mean over schedules
    python bench/placement_sweep.py --prefix-cache-retention-interval dense   # vLLM's dense states

Each row replays one workload on one model shape at one KV capacity (tokens) through vLLM's
real scheduler, upstream and plugin (report.compare_policies, the same runs as `replay`).
``--check`` fails a row where the plugin hits less than upstream, or any state mismatch or
leaked block occurs. Rows print to stderr as they finish; ``--json`` prints all of them.
``--seeds`` replays each row on workloads drawn with each seed (the generators' ``seed``) and
ends with one line per row: on how many seeds the plugin was below upstream, and the mean and
range of plugin - upstream, so a loss can be told from one draw's luck; and on how many the
plugin computed more prompt tokens than upstream (recomputation after preemption included: the
hit rate counts a request's first admission only), with the mean ratio.
``--prefix-match-unit N`` runs both policies and the bound with vLLM's ``prefix_match_unit``
(hits at N-token boundaries; N must divide every shape's blocks: 16 divides 544 and 1040),
and both policies once more at the block (``*_block``, ``*_at_unit``): ``upstream`` and
``plugin`` are then each policy at its better unit of the two; the bound and ideal are at N.
``--time-scales`` replays each row with its arrival times (and follow-up delays) scaled by each
factor, as ``replay --time-scale`` does: in a pool that preempts, a 2% change in timing moves
which request finds its prefix cached, for upstream as much as for the plugin, so one schedule
cannot tell a loss from luck. The row's rates are then each policy's mean over the factors
(``by_time_scale`` has each), its counts the sums, and ``--check`` compares the means.
``--prefix-cache-retention-interval N|dense`` sets vLLM's retention for both policies (the
states vLLM itself keeps: 0, its default, the replay boundary and junctions only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

DEFAULT_WORKLOADS = ("agentic", "chat", "branching", "rag", "production")
DEFAULT_SHAPES = ("qwen3.5-0.8b", "qwen3-next-80b-a3b", "nemotron-h-8b")
DEFAULT_CAPACITIES = (65_536, 131_072, 262_144, 2_000_000)


def sweep_row(workload: str, shape: str, cache_tokens: int, seed: int = 0,
              prefix_match_unit: int | None = None,
              time_scales: Sequence[float] = (1.0,),
              retention_interval: int | None = 0) -> dict[str, Any]:
    """One row; with several ``time_scales`` each policy's rates are its mean over the
    workload replayed with its arrival times scaled by each, and counts are summed."""
    from vllm_hybrid_backends.replay.harness import ReplayConfig, retention_label
    from vllm_hybrid_backends.replay.workloads import make_workload, scale_arrivals

    config = ReplayConfig(model_shape=shape, cache_tokens=cache_tokens,
                          prefix_match_unit=prefix_match_unit,
                          retention_interval=retention_interval)
    trace = make_workload(workload, block_size=config.layout().block_size, seed=seed)
    started = time.perf_counter()
    runs = [_replay_row(scale_arrivals(trace, scale), config) for scale in time_scales]
    row = {"workload": workload, "model_shape": shape, "cache_tokens": cache_tokens,
           "seed": seed, **_combine(runs)}
    if retention_interval != 0:
        row["prefix_cache_retention_interval"] = retention_label(retention_interval)
    if list(time_scales) != [1.0]:
        row["time_scales"] = list(time_scales)
        row["by_time_scale"] = [{"time_scale": scale, "upstream": round(run["upstream"], 4),
                                 "plugin": round(run["plugin"], 4)}
                                for scale, run in zip(time_scales, runs, strict=True)]
        row["below_on_time_scales"] = sum(run["plugin"] < run["upstream"] for run in runs)
    row["wall_s"] = round(time.perf_counter() - started, 1)
    return row


def _replay_row(trace: Any, config: Any) -> dict[str, Any]:
    from vllm_hybrid_backends.replay.harness import ReplayConfig
    from vllm_hybrid_backends.replay.report import compare_policies

    report = compare_policies(trace, config, ["upstream", "plugin"])
    up, plug = report.policies["upstream"], report.policies["plugin"]
    upstream, plugin = up.token_hit_rate, plug.token_hit_rate
    at_unit: dict[str, Any] = {}
    runs = [up, plug]
    if config.prefix_match_unit is not None:
        at_block = ReplayConfig(model_shape=config.model_shape, cache_tokens=config.cache_tokens,
                                retention_interval=config.retention_interval)
        block = compare_policies(trace, at_block, ["upstream", "plugin"]).policies
        at_unit = {"prefix_match_unit": config.prefix_match_unit, "upstream_at_unit": upstream,
                   "plugin_at_unit": plugin,
                   "upstream_block": block["upstream"].token_hit_rate,
                   "plugin_block": block["plugin"].token_hit_rate}
        upstream = max(upstream, at_unit["upstream_block"])
        plugin = max(plugin, at_unit["plugin_block"])
        runs += block.values()
    return {
        "block_size": report.block_size, "num_blocks": report.num_blocks, **at_unit,
        "upstream": upstream, "plugin": plugin,
        "bound": plug.bound_hit_rate, "ideal": plug.ideal_hit_rate,
        "preemptions": {"upstream": up.preemptions, "plugin": plug.preemptions},
        # the work the cache left: prompt tokens computed, recomputation after preemption in
        "prefill_tokens_computed": {"upstream": up.prefill_tokens_computed,
                                    "plugin": plug.prefill_tokens_computed},
        "recomputed_prompt_tokens": {"upstream": up.recomputed_prompt_tokens,
                                     "plugin": plug.recomputed_prompt_tokens},
        "evictions_mamba": {"upstream": up.evictions_mamba, "plugin": plug.evictions_mamba},
        # requests the plugin hit more / fewer tokens for than upstream, both at the run's
        # unit (--prefix-match-unit N: the *_at_unit rates; else the block)
        "requests_versus_upstream": plug.versus_first,
        "state_mismatches": sum(run.state_mismatches for run in runs),
        "blocks_leaked": sum(run.blocks_leaked for run in runs),
    }


#: Row fields that are hit rates (averaged over time scales); the rest of the numbers are counts.
RATE_FIELDS = ("upstream", "plugin", "bound", "ideal", "upstream_at_unit", "plugin_at_unit",
               "upstream_block", "plugin_block")


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one row at several time scales as one: rates averaged, counts summed."""
    row: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [run[key] for run in runs]
        if key in RATE_FIELDS:
            row[key] = round(sum(values) / len(values), 4)
        elif key in ("block_size", "num_blocks", "prefix_match_unit") or first is None:
            row[key] = first
        elif isinstance(first, dict):
            row[key] = {k: v if isinstance(v, str) else sum(run[key][k] for run in runs)
                        for k, v in first.items()}
        else:
            row[key] = sum(values)
    bound = row["bound"]
    row["plugin_over_bound"] = round(row["plugin"] / bound, 4) if bound else None
    row["upstream_over_bound"] = round(row["upstream"] / bound, 4) if bound else None
    return row


def row_problems(row: dict[str, Any]) -> list[str]:
    problems = []
    if row["plugin"] < row["upstream"]:
        versus = row.get("requests_versus_upstream")
        problems.append(f"plugin {row['plugin']} < upstream {row['upstream']}" + (
            "" if not versus else
            f" (hit less on {versus['requests_fewer']} requests, -{versus['tokens_fewer']:,} "
            f"tokens; more on {versus['requests_more']}, +{versus['tokens_more']:,})"))
    if row["state_mismatches"]:
        problems.append(f"{row['state_mismatches']} state mismatches")
    if row["blocks_leaked"]:
        problems.append(f"{row['blocks_leaked']} leaked blocks")
    return problems


def _list_of(convert: Any, valid: Any, what: str) -> Any:
    """An argparse type: comma-separated values, each ``convert``-ed and ``valid``, else an
    error naming the bad part and ``what`` is allowed."""

    def parse(text: str) -> list[Any]:
        values = []
        for part in text.split(","):
            try:
                value = convert(part)
            except ValueError:
                value = None
            if value is None or not valid(value):
                raise argparse.ArgumentTypeError(f"{part!r}: {what}")
            values.append(value)
        return values

    return parse


def _int_list(minimum: int, what: str) -> Any:
    """Comma-separated integers >= ``minimum`` (``_`` separators allowed)."""
    return _list_of(lambda part: int(part.replace("_", "")), lambda v: v >= minimum, what)


#: Comma-separated arrival-time factors, each a finite number > 0.
_time_scales = _list_of(float, lambda v: 0 < v < float("inf"),
                        "a time scale is a finite number > 0")


def seed_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, shape, capacity): seeds run, seeds with plugin below upstream, and the
    mean, lowest and highest plugin - upstream token hit rate."""
    grouped: dict[tuple[str, str, int], list[float]] = {}
    computed: dict[tuple[str, str, int], list[float]] = {}
    for row in rows:
        key = (row["workload"], row["model_shape"], row["cache_tokens"])
        grouped.setdefault(key, []).append(row["plugin"] - row["upstream"])
        work = row["prefill_tokens_computed"]
        computed.setdefault(key, []).append(work["plugin"] / max(work["upstream"], 1))
    return [{"workload": w, "model_shape": s, "cache_tokens": c, "seeds": len(deltas),
             "below_upstream": sum(d < 0 for d in deltas),
             "mean_delta": round(sum(deltas) / len(deltas), 4),
             "min_delta": round(min(deltas), 4), "max_delta": round(max(deltas), 4),
             "computes_more_than_upstream": sum(r > 1 for r in computed[(w, s, c)]),
             "mean_prefill_ratio": round(sum(computed[(w, s, c)]) / len(deltas), 4)}
            for (w, s, c), deltas in grouped.items()]


def _retention(text: str) -> int | None:
    from vllm_hybrid_backends.replay.harness import parse_retention_interval

    try:
        return parse_retention_interval(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    from vllm_hybrid_backends.replay.shapes import MODEL_SHAPES
    from vllm_hybrid_backends.replay.workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                        help=f"comma-separated, of: {', '.join(sorted(WORKLOADS))}")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help=f"comma-separated, of: {', '.join(sorted(MODEL_SHAPES))}, or paths to "
                             "hybrid models' config.json (replay --model-shape PATH)")
    parser.add_argument("--capacities", type=_int_list(1, "capacities are positive integers"),
                        default=list(DEFAULT_CAPACITIES), help="comma-separated token counts")
    parser.add_argument("--seeds", type=_int_list(0, "seeds are integers >= 0"), default=[0],
                        help="comma-separated workload seeds; each row runs once per seed")
    parser.add_argument("--prefix-match-unit", type=_int_list(1, "a unit is a positive integer"),
                        default=None, metavar="N",
                        help="vLLM's prefix_match_unit for both policies (each also at the "
                             "block; the better of the two is its row)")
    parser.add_argument("--time-scales", type=_time_scales, default=[1.0], metavar="X,Y,...",
                        help="replay each row with its arrival times scaled by each factor "
                             "(replay --time-scale) and compare the policies' mean hit rates")
    parser.add_argument("--prefix-cache-retention-interval", type=_retention, default=0,
                        metavar="N|dense",
                        help="vLLM's prefix_cache_retention_interval for both policies "
                             "(replay --prefix-cache-retention-interval; default 0, vLLM's)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if plugin < upstream, a state mismatch or a leak occurs")
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    shapes = [s for s in args.shapes.split(",") if s]
    for name, known, what in ((workloads, WORKLOADS, "workload"), (shapes, MODEL_SHAPES, "shape")):
        unknown = [n for n in name if n not in known and not (what == "shape" and os.path.exists(n))]
        if unknown:
            parser.error(f"unknown {what} {unknown[0]!r}; allowed: {', '.join(sorted(known))}"
                         + (" or a model's config.json / directory" if what == "shape" else ""))
    unit = None
    if args.prefix_match_unit is not None:
        if len(args.prefix_match_unit) != 1:
            parser.error(f"--prefix-match-unit takes one unit, got {args.prefix_match_unit}")
        unit = args.prefix_match_unit[0]
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.prefix_cache_retention_interval != 0:
        from vllm_hybrid_backends.replay.harness import ReplayConfig, ReplayError

        for shape in shapes:   # every shape (and the vLLM) before the first row
            try:
                ReplayConfig(model_shape=shape,
                             retention_interval=args.prefix_cache_retention_interval).layout()
            except ReplayError as exc:
                parser.error(f"{shape}: {exc}")
    rows, failed = [], []
    for workload in workloads:
        for shape in shapes:
            for capacity in args.capacities:
                for seed in args.seeds:
                    row = sweep_row(workload, shape, capacity, seed, unit, args.time_scales,
                                    args.prefix_cache_retention_interval)
                    rows.append(row)
                    problems = row_problems(row)
                    if problems:
                        failed.append((row, problems))
                    print(f"{workload:10s} {shape:20s} {capacity:>9,d}"
                          f"{f'  seed {seed}' if len(args.seeds) > 1 else ''}"
                          f"  upstream {row['upstream']:.4f}"
                          f"  plugin {row['plugin']:.4f}  bound {row['bound']:.4f}"
                          f"  ideal {row['ideal']:.4f}  preempt {row['preemptions']['plugin']}"
                          + (f"  below on {row['below_on_time_scales']} of "
                             f"{len(args.time_scales)} time scales"
                             if "time_scales" in row else "") +
                          f"  {row['wall_s']}s{'  ' + '; '.join(problems) if problems else ''}",
                          file=sys.stderr, flush=True)
    if len(args.seeds) > 1:
        for line in seed_summary(rows):
            print(f"{line['workload']:10s} {line['model_shape']:20s} {line['cache_tokens']:>9,d}"
                  f"  below upstream on {line['below_upstream']} of {line['seeds']} seeds;"
                  f"  plugin - upstream mean {line['mean_delta']:+.4f}"
                  f" [{line['min_delta']:+.4f}, {line['max_delta']:+.4f}];"
                  f"  computes more prompt tokens on {line['computes_more_than_upstream']};"
                  f"  plugin / upstream computed, mean {line['mean_prefill_ratio']:.4f}",
                  file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    if args.check and failed:
        print(f"{len(failed)} of {len(rows)} rows broke the rules", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
