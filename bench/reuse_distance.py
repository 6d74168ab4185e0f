"""Where a trace's reusable prefixes are lost, by reuse distance against the cache's capacity.

    python bench/reuse_distance.py --trace conversation_trace.jsonl --time-scale 4 --limit 600 \\
        --model-shape qwen3.5-0.8b --cache-tokens 2000000

Each request's reusable prefix is its longest common prefix with an earlier request's prompt
and output (the earliest such request is its source), counted when it spans at least one block (a
shorter one cannot hit on the block grid); its reuse distance is the prompt and
output tokens of the requests that arrived between the source and it. Requests are grouped by
that distance in multiples of ``--cache-tokens`` and, per group, the prefix tokens (the ideal)
are set beside the hit tokens of the attention-only bound, upstream and the plugin (one replay
each, vLLM's real scheduler, as ``replay``). A group the bound keeps and the hybrid policies do
not is lost to where the Mamba states are, not to capacity.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

#: Group edges, in multiples of the cache capacity.
EDGES = (0.5, 1.0, 2.0)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def sources(trace) -> list[tuple[int, int | None, int]]:
    """Per request: (reusable prefix tokens, source index or None, reuse distance in tokens)."""
    prompts = [np.asarray(r.prompt_token_ids) for r in trace.requests]
    seen = [np.asarray(r.prompt_token_ids + r.output_token_ids) for r in trace.requests]
    sizes = np.cumsum([0] + [len(s) for s in seen])
    found = []
    for i, prompt in enumerate(prompts):
        best, source = 0, None
        for j in range(i):
            shared = common_prefix(prompt, seen[j])
            if shared > best:
                best, source = shared, j
        found.append((best, source, int(sizes[i] - sizes[source + 1]) if source is not None else 0))
    return found


def group(distance: int, capacity: int) -> str:
    for edge in EDGES:
        if distance < edge * capacity:
            return f"< {edge:g} x cache"
    return f">= {EDGES[-1]:g} x cache"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="a trace `replay --trace` reads")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--model-shape", default="qwen3.5-0.8b",
                        help="a built-in shape or a hybrid model's config.json")
    parser.add_argument("--cache-tokens", type=int, default=2_000_000)
    parser.add_argument("--json", action="store_true", help="print the groups as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_hybrid_backends.replay.harness import ReplayConfig, run_replay
    from vllm_hybrid_backends.replay.policy import get_policy
    from vllm_hybrid_backends.replay.workloads import load_trace

    trace = load_trace(args.trace, time_scale=args.time_scale, limit=args.limit)
    config = ReplayConfig(model_shape=args.model_shape, cache_tokens=args.cache_tokens)
    hits = {"bound": run_replay(trace, config, get_policy("upstream"), attention_only=True)}
    for name in ("upstream", "plugin"):
        hits[name] = run_replay(trace, config, get_policy(name))
    block = config.layout().block_size
    rows: dict[str, dict[str, int]] = {}
    for request, (shared, source, distance) in zip(trace.requests, sources(trace)):
        if source is None or shared < block:
            continue
        row = rows.setdefault(group(distance, args.cache_tokens),
                              {"requests": 0, "ideal": 0, "bound": 0, "upstream": 0, "plugin": 0})
        row["requests"] += 1
        row["ideal"] += shared
        for name, result in hits.items():
            row[name] += result.requests[request.id].hit_tokens
    order = [f"< {edge:g} x cache" for edge in EDGES] + [f">= {EDGES[-1]:g} x cache"]
    rows = {name: rows[name] for name in order if name in rows}
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'reuse distance':18s} {'requests':>8s} {'ideal':>10s} {'bound':>10s} "
          f"{'upstream':>10s} {'plugin':>10s}", file=sys.stderr)
    for name, row in rows.items():
        print(f"{name:18s} {row['requests']:8d} {row['ideal']:10,d} {row['bound']:10,d} "
              f"{row['upstream']:10,d} {row['plugin']:10,d}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
