"""Plugin vs upstream over a capacity sweep: hit rates, bound, ideal, mismatches, leaks.

    python bench/placement_sweep.py                      # the full grid (tens of minutes)
    python bench/placement_sweep.py --workloads agentic --shapes qwen3.5-0.8b --capacities 65536
    python bench/placement_sweep.py --json --check       # exit 1 if a row breaks the rules
    python bench/placement_sweep.py --capacities 65536 --seeds 0,1,2,3   # each row per seed
    python bench/placement_sweep.py --prefix-match-unit 16   # sub-block hits, both policies

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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

DEFAULT_WORKLOADS = ("agentic", "chat", "branching", "rag", "production")
DEFAULT_SHAPES = ("qwen3.5-0.8b", "qwen3-next-80b-a3b", "nemotron-h-8b")
DEFAULT_CAPACITIES = (65_536, 131_072, 262_144, 2_000_000)


def sweep_row(workload: str, shape: str, cache_tokens: int, seed: int = 0,
              prefix_match_unit: int | None = None) -> dict[str, Any]:
    from vllm_hybrid_backends.replay.harness import ReplayConfig
    from vllm_hybrid_backends.replay.report import compare_policies
    from vllm_hybrid_backends.replay.workloads import make_workload

    config = ReplayConfig(model_shape=shape, cache_tokens=cache_tokens,
                          prefix_match_unit=prefix_match_unit)
    trace = make_workload(workload, block_size=config.layout().block_size, seed=seed)
    started = time.perf_counter()
    report = compare_policies(trace, config, ["upstream", "plugin"])
    up, plug = report.policies["upstream"], report.policies["plugin"]
    upstream, plugin = round(up.token_hit_rate, 4), round(plug.token_hit_rate, 4)
    at_unit: dict[str, Any] = {}
    runs = [up, plug]
    if prefix_match_unit is not None:
        block = compare_policies(trace, ReplayConfig(model_shape=shape, cache_tokens=cache_tokens),
                                 ["upstream", "plugin"]).policies
        at_unit = {"prefix_match_unit": prefix_match_unit, "upstream_at_unit": upstream,
                   "plugin_at_unit": plugin,
                   "upstream_block": round(block["upstream"].token_hit_rate, 4),
                   "plugin_block": round(block["plugin"].token_hit_rate, 4)}
        upstream = max(upstream, at_unit["upstream_block"])
        plugin = max(plugin, at_unit["plugin_block"])
        runs += block.values()
    return {
        "workload": workload, "model_shape": shape, "cache_tokens": cache_tokens, "seed": seed,
        "block_size": report.block_size, "num_blocks": report.num_blocks, **at_unit,
        "upstream": upstream, "plugin": plugin,
        "bound": round(plug.bound_hit_rate, 4), "ideal": round(plug.ideal_hit_rate, 4),
        "plugin_over_bound": round(plugin / plug.bound_hit_rate, 4)
        if plug.bound_hit_rate else None,
        "upstream_over_bound": round(upstream / plug.bound_hit_rate, 4)
        if plug.bound_hit_rate else None,
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
        "wall_s": round(time.perf_counter() - started, 1),
    }


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


def _int_list(minimum: int, what: str) -> Any:
    """An argparse type: comma-separated integers >= ``minimum`` (``_`` separators allowed)."""

    def parse(text: str) -> list[int]:
        values = []
        for part in text.split(","):
            try:
                value = int(part.replace("_", ""))
            except ValueError:
                value = minimum - 1
            if value < minimum:
                raise argparse.ArgumentTypeError(f"{part!r}: {what}")
            values.append(value)
        return values

    return parse


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
    rows, failed = [], []
    for workload in workloads:
        for shape in shapes:
            for capacity in args.capacities:
                for seed in args.seeds:
                    row = sweep_row(workload, shape, capacity, seed, unit)
                    rows.append(row)
                    problems = row_problems(row)
                    if problems:
                        failed.append((row, problems))
                    print(f"{workload:10s} {shape:20s} {capacity:>9,d}"
                          f"{f'  seed {seed}' if len(args.seeds) > 1 else ''}"
                          f"  upstream {row['upstream']:.4f}"
                          f"  plugin {row['plugin']:.4f}  bound {row['bound']:.4f}"
                          f"  ideal {row['ideal']:.4f}  preempt {row['preemptions']['plugin']}"
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
