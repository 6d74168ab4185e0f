"""`make demo`: a real vLLM-CPU engine run of a tiny Qwen3.5-style hybrid model with the plugin.

Builds the zoo's ``qwen35`` model (3 gated-delta-net layers + 1 attention layer, random weights,
no download), starts vLLM with prefix caching and ``VLLM_PLUGINS=hybrid_backends``, sends four
requests one after another and prints how many prompt tokens each one got from the prefix cache:

* A: 1500 random tokens;
* A again: the same prompt;
* B: A with token 1000 changed, so it diverges mid-prompt and then shares A's tail;
* C: A's first 1000 tokens followed by new ones.

"shared prefix" is the longest prefix a request shares with an earlier one: the most a cache could
reuse.  In vLLM's "align" mode a hybrid model can only reuse whole blocks whose Mamba state was
kept, so hits are multiples of the block size and can be far below the shared prefix.

Run: ``python -m vllm_hybrid_backends.demo`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import random
import re
import sys
import time

PROMPT_LEN = 1500
DIVERGE_AT = 1000
SEED = 2026


def _prompts() -> list[tuple[str, str, list[int]]]:
    from vllm_hybrid_backends.testing.model_zoo import VOCAB_SIZE

    rng = random.Random(SEED)
    a = [rng.randrange(3, VOCAB_SIZE) for _ in range(PROMPT_LEN)]
    b = list(a)
    b[DIVERGE_AT] = 3 + (b[DIVERGE_AT] - 3 + 1) % (VOCAB_SIZE - 3)
    c = a[:DIVERGE_AT] + [rng.randrange(3, VOCAB_SIZE) for _ in range(PROMPT_LEN - DIVERGE_AT)]
    return [
        ("A", f"{PROMPT_LEN} random tokens", a),
        ("A again", "the same prompt", a),
        ("B", f"A with token {DIVERGE_AT} changed", b),
        ("C", f"A's first {DIVERGE_AT} tokens + new ones", c),
    ]


def _shared_prefix(prompt: list[int], earlier: list[list[int]]) -> int:
    best = 0
    for other in earlier:
        n = 0
        for x, y in zip(prompt, other, strict=False):
            if x != y:
                break
            n += 1
        best = max(best, n)
    return best


def main() -> int:
    from vllm_hybrid_backends.testing.engine import run_engine
    from vllm_hybrid_backends.testing.model_zoo import ZOO, build_model

    entry = ZOO["qwen35"]
    print(f"Building (or reusing) the tiny model: {entry.description} ...", flush=True)
    model = build_model("qwen35")
    print(f"  {model}")
    print("Starting vLLM-CPU with prefix caching and VLLM_PLUGINS=hybrid_backends "
          "(engine start takes a while) ...", flush=True)
    requests = _prompts()
    start = time.monotonic()
    run = run_engine(
        model,
        [p for _, _, p in requests],
        dtype=entry.dtype,
        enable_prefix_caching=True,
        max_tokens=8,
        plugins="hybrid_backends",
    )
    total = time.monotonic() - start

    block = re.search(r"kv lcm block sizes (\d+)", run.log)
    rows = [("request", "prompt", "prompt tokens", "shared prefix", "cached tokens", "time s")]
    for i, ((name, what, prompt), result) in enumerate(zip(requests, run.requests, strict=True)):
        shared = _shared_prefix(prompt, [p for _, _, p in requests[:i]])
        rows.append((name, what, str(result.prompt_len), str(shared),
                     str(result.num_cached_tokens), f"{result.wall_s:.2f}"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    print()
    for n, row in enumerate(rows):
        print("  ".join(cell.ljust(w) if c < 2 else cell.rjust(w)
                        for c, (cell, w) in enumerate(zip(row, widths, strict=True))))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print()
    if block:
        print(f"KV cache block size: {block.group(1)} tokens (hits are whole blocks).")
    print(f"Engine start {run.init_s:.1f} s, whole run {total:.1f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
