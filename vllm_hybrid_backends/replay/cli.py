"""vllm-hybrid-backends replay: what hit rate a hybrid model gets on a workload, and why not more.

Set VLLM_HYBRID_VLLM_PATH to a directory of vLLM sources (e.g. vLLM 0.33's pure-Python tree from
`make setup-vllm033`: .venv-vllm033/site) to replay against that vLLM instead of the installed
one: the command re-runs itself in a subprocess with that directory first on PYTHONPATH (and
VLLM_TARGET_DEVICE=cpu unless set: the harness needs no device). Exit status: 0, 1 when the
state oracle reported a mismatch, 2 on a usage error. See docs/replay.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from typing import Any

VLLM_PATH_ENV = "VLLM_HYBRID_VLLM_PATH"
_REEXEC_MARK = "VLLM_HYBRID_REPLAY_REEXEC"


def add_parser(commands: Any) -> None:
    from .harness import DEFAULT_CACHE_TOKENS
    from .shapes import MODEL_SHAPES
    from .workloads import WORKLOADS

    parser = commands.add_parser(
        "replay", help="replay a workload through vLLM's scheduler: hit rate and why it misses",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                        help="a bundled workload (default: agentic)")
    source.add_argument("--trace", metavar="PATH",
                        help="a JSONL or JSONL.gz trace: id, arrival_s, prompt_token_ids, "
                             "output_token_ids or max_tokens (one request per line); or a "
                             "hash-block trace (Mooncake, Qwen-Bailian, vllm bench timed_trace: "
                             "timestamp, input_length, output_length, hash_ids)")
    parser.add_argument("--hash-block-size", type=int, metavar="N", default=None,
                        help="tokens per hash id of a hash-block trace (default: read from the "
                             "trace, the power of two that fits its lengths; Mooncake 512, "
                             "Qwen-Bailian 16)")
    parser.add_argument("--timestamp-unit", choices=("ms", "s"), default=None,
                        help="unit of a hash-block trace's timestamps (default: s for "
                             "Qwen-Bailian lines, which carry parent_chat_id; else ms)")
    parser.add_argument("--time-scale", type=float, metavar="X", default=1.0,
                        help="multiply the arrival times (of the trace or workload) by X "
                             "(2 = half the rate)")
    parser.add_argument("--seed", type=int, metavar="N", default=None,
                        help="draw the bundled workload with this seed (default 0; "
                             "bench/placement_sweep.py --seeds replays several)")
    parser.add_argument("--limit", type=int, metavar="N",
                        help="replay only the trace's first N requests")
    parser.add_argument("--model-shape", metavar="NAME|PATH", default="qwen3.5-0.8b",
                        help="a built-in model shape (" + ", ".join(sorted(MODEL_SHAPES)) + "; "
                             "layer kinds, state and KV sizes from public configs), or the "
                             "config.json (or directory) of a hybrid model: vLLM derives its "
                             "layers and state shapes from it, nothing is loaded (default: "
                             "qwen3.5-0.8b)")
    parser.add_argument("--block-size", type=int, metavar="N",
                        help="attention block size; vLLM raises it if a page cannot hold a "
                             "Mamba state (default: vLLM's derivation with CUDA kernel blocks)")
    parser.add_argument("--cache-tokens", type=int, metavar="N", default=DEFAULT_CACHE_TOKENS,
                        help=f"KV cache capacity in tokens (default {DEFAULT_CACHE_TOKENS:,})")
    parser.add_argument("--prefix-match-unit", metavar="N|best", default=None,
                        help="vLLM's prefix_match_unit: prefix hits at N-token boundaries "
                             "inside a block (N must divide the block size); the "
                             "attention-only bound runs at the same unit. 'best': replay every "
                             "allowed unit of at least 16 tokens and report each policy at "
                             "its best (default: off, hits on the block grid)")
    parser.add_argument("--prefix-cache-retention-interval", metavar="N|dense", default="0",
                        help="vLLM's prefix_cache_retention_interval (0.32+), for both "
                             "policies: 0 keeps a Mamba state at the prompt's replay boundary "
                             "and shared-prefix junctions only (vLLM's default), N (a multiple "
                             "of the scheduler block size) also every N tokens, 'dense' at "
                             "every block boundary a prefill chunk or decode step ends on; the "
                             "attention-only bound is the same either way (default: 0)")
    parser.add_argument("--kv-offloading-size", type=float, metavar="GIB", default=None,
                        help="vLLM's --kv-offloading-size: a CPU tier of GIB GiB through vLLM's "
                             "own OffloadingConnector; each policy is reported without it and "
                             "with it (<policy>+cpu). The attention-only bound stays GPU-only "
                             "(default: off)")
    parser.add_argument("--policy", choices=("upstream", "plugin", "both"), default="both",
                        help="upstream = installed vLLM, plugin off; plugin = with the "
                             "plugin's scheduler-process patches (default: both)")
    parser.add_argument("--timing-repeats", type=int, metavar="N", default=1,
                        help="replay each policy N times in all, interleaved, and report its "
                             "lowest median step time (hit rates do not change; default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="PNG",
                        help="also write hit rate against cache capacity for each policy")


def _reexec_with_vllm_path(argv: list[str]) -> int | None:
    path = os.environ.get(VLLM_PATH_ENV)
    if not path or os.environ.get(_REEXEC_MARK):
        return None
    if not os.path.isdir(path):
        print(f"error: {VLLM_PATH_ENV}={path!r} is not a directory", file=sys.stderr)
        return 2
    env = dict(os.environ, **{_REEXEC_MARK: "1"})
    # The harness uses no device; a source tree's (e.g. CUDA-built) platform detection must not
    # look for one.
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    return subprocess.call([sys.executable, "-m", "vllm_hybrid_backends.cli", "replay", *argv],
                           env=env)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    status = _reexec_with_vllm_path(argv)
    if status is not None:
        return status
    # vLLM logs INFO lines to stdout by default; keep stdout for the report.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from .harness import ReplayConfig, ReplayError, parse_retention_interval, resolve_model_shape
    from .report import (
        compare_policies,
        compare_with_cpu_tier,
        plot_capacity_sweep,
        render_table,
        sweep_prefix_match_units,
        sweep_units,
    )
    from .workloads import TraceError, load_trace, make_workload, scale_arrivals

    for name, value in (("--block-size", args.block_size), ("--cache-tokens", args.cache_tokens),
                        ("--timing-repeats", args.timing_repeats),
                        ("--hash-block-size", args.hash_block_size), ("--limit", args.limit)):
        if value is not None and value <= 0:
            print(f"error: {name} must be a positive integer, got {value}", file=sys.stderr)
            return 2
    if args.seed is not None and args.seed < 0:
        print(f"error: --seed must be an integer >= 0, got {args.seed}", file=sys.stderr)
        return 2
    if args.trace and args.seed is not None:
        print("error: --seed applies to a bundled --workload only (a trace is what it is)",
              file=sys.stderr)
        return 2
    unit: int | None = None
    if args.prefix_match_unit is not None and args.prefix_match_unit != "best":
        try:
            unit = int(args.prefix_match_unit)
        except ValueError:
            unit = 0
        if unit <= 0:
            print("error: --prefix-match-unit must be a positive integer or 'best', got "
                  f"{args.prefix_match_unit!r}", file=sys.stderr)
            return 2
    try:
        retention = parse_retention_interval(args.prefix_cache_retention_interval)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.time_scale > 0 or args.time_scale == float("inf"):
        print(f"error: --time-scale must be a finite number > 0, got {args.time_scale}",
              file=sys.stderr)
        return 2
    if not args.trace and (args.hash_block_size is not None or args.limit is not None
                           or args.timestamp_unit is not None):
        print("error: --hash-block-size, --timestamp-unit and --limit apply to --trace only",
              file=sys.stderr)
        return 2
    tier = args.kv_offloading_size
    if tier is not None:
        from .offload import tier_problem

        problem = None if 0 < tier < float("inf") else (
            f"--kv-offloading-size must be a finite number of GiB > 0, got {tier}")
        for flag, used in (("--prefix-match-unit", args.prefix_match_unit is not None),
                           ("--plot", args.plot is not None),
                           ("--timing-repeats", args.timing_repeats != 1)):
            if used and problem is None:
                problem = f"--kv-offloading-size cannot be combined with {flag}"
        problem = problem or tier_problem()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    # after the flag combinations: a usage error is one on every vLLM
    from .engine_config import vllm_has_prefix_match_unit

    if args.prefix_match_unit is not None and not vllm_has_prefix_match_unit():
        from ..compat import installed_vllm_version

        print(f"error: --prefix-match-unit needs vLLM's CacheConfig.prefix_match_unit (0.32+); "
              f"this vLLM is {installed_vllm_version()}", file=sys.stderr)
        return 2
    policies = ["upstream", "plugin"] if args.policy == "both" else [args.policy]
    try:
        shape = resolve_model_shape(args.model_shape)
    except ValueError as exc:
        print(f"error: --model-shape: {exc}", file=sys.stderr)
        return 2
    config = ReplayConfig(model_shape=shape.name, shape=shape, block_size=args.block_size,
                          cache_tokens=args.cache_tokens, prefix_match_unit=unit,
                          retention_interval=retention, kv_offloading_size=tier)
    sweep = args.prefix_match_unit == "best"
    try:
        config.layout()  # refuses a bad unit or retention interval before any trace is read
        units = len(sweep_units(config)) if sweep else 1
        if args.trace:
            trace = load_trace(args.trace, hash_block_size=args.hash_block_size,
                               timestamp_unit=args.timestamp_unit, time_scale=args.time_scale,
                               limit=args.limit)
        else:
            trace = scale_arrivals(make_workload(args.workload or "agentic",
                                                 block_size=config.layout().block_size,
                                                 seed=args.seed or 0),
                                   args.time_scale)
            if args.seed is not None:
                trace.params["seed"] = args.seed
    except (TraceError, ReplayError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    runs = (1 + args.timing_repeats + (tier is not None)) * len(policies)
    with tqdm(total=units * runs * len(trace.requests), desc=f"replay {trace.name}", unit="req",
              file=sys.stderr, disable=None) as bar, contextlib.redirect_stdout(sys.stderr):
        try:
            if tier is not None:
                report = compare_with_cpu_tier(trace, config, policies, progress=bar)
            elif sweep:
                report = sweep_prefix_match_units(trace, config, policies, progress=bar,
                                                  timing_repeats=args.timing_repeats)
            else:
                report = compare_policies(trace, config, policies, progress=bar,
                                          timing_repeats=args.timing_repeats)
            points = None
            if args.plot:
                bar.reset(total=5 * runs * len(trace.requests))
                bar.set_description(f"replay {trace.name} (plot)")
                points = plot_capacity_sweep(trace, config, policies, args.plot, progress=bar)
        except (ReplayError, RuntimeError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.json:
        payload = report.to_json()
        if points is not None:
            payload["plot"] = {"path": args.plot, "points": [vars(p) for p in points]}
        print(json.dumps(payload, indent=2))
    else:
        print(render_table(report))
        if args.plot:
            print(f"plot written to {args.plot}")
    mismatches = sum(m.state_mismatches for m in report.policies.values())
    return 1 if mismatches else 0
