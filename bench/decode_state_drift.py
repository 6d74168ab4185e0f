"""How far a decode-end Mamba state drifts from the prefill state of the same tokens.

For each tiny zoo hybrid model (GDN: qwen35, Mamba2: granite_hybrid), model dtype and decode
length N, through the model's own forward (transformers' reference kernels on CPU):

- ``prefill``: one forward over prompt + N generated tokens (the reference state);
- ``chunked``: the prompt, then the N tokens as a second chunk (another prefill path: the noise
  any prefix-cache hit already carries);
- ``decode``: the prompt, then the N tokens one decode step at a time (what the plugin keeps
  as a decode-end state with ``VLLM_HYBRID_DECODE_CHECKPOINTS=1``).

After every forward call the recurrent state is rounded to ``--state-dtypes`` (the dtype a
serving engine's cache stores it in, e.g. bf16 for vLLM-CPU's GDN state on most hosts): a
decode-end state went through N roundings, a prefill state through one per chunk.

Reported per path: the relative L2 distance of the recurrent states (all linear-attention /
Mamba layers together) to the reference, and the largest next-token logprob deviation over a
16-token teacher-forced continuation resumed from that cache, against the reference (the
no-cache run). ``--json`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Any

MODELS = ("qwen35", "granite_hybrid")
DTYPES = ("bfloat16", "float32")
LENGTHS = (8, 32, 128)
CONTINUATION = 16


def _states(cache: Any) -> Any:
    import torch

    parts = [state.float().flatten() for layer in cache.layers
             for state in (getattr(layer, "recurrent_states", None) or {}).values()]
    return torch.cat(parts)


#: dtype the recurrent state is stored in between forward calls (None: as the model keeps it)
_state_dtype: Any = None


def _forward(model: Any, ids: Any, cache: Any = None) -> Any:
    """One forward call; the state is rounded to the storage dtype after it, as a serving
    engine stores it in its cache after every step (prefill chunk or decode token)."""
    import torch

    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
    if _state_dtype is not None:
        for layer in out.past_key_values.layers:
            states = getattr(layer, "recurrent_states", None) or {}
            for key, state in states.items():
                states[key] = state.to(_state_dtype).to(state.dtype)
    return out


def _continue(model: Any, cache: Any, tokens: Any) -> Any:
    import torch

    out = _forward(model, tokens, copy.deepcopy(cache))
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def measure(name: str, dtype: str, state_dtype: str, lengths: tuple[int, ...], prompt_len: int,
            seed: int) -> list[dict[str, Any]]:
    import torch
    import transformers

    global _state_dtype
    _state_dtype = getattr(torch, state_dtype)

    from vllm_hybrid_backends.testing.model_zoo import VOCAB_SIZE, ZOO, build_model

    model = getattr(transformers, ZOO[name].architecture).from_pretrained(
        build_model(name), dtype=getattr(torch, dtype)).eval()
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB_SIZE, (1, prompt_len), generator=gen)
    follow = torch.randint(3, VOCAB_SIZE, (1, CONTINUATION), generator=gen)
    # greedy decode once to the longest N; every N uses a prefix of these tokens
    out = _forward(model, prompt)
    cache, step_caches, generated = out.past_key_values, {}, []
    token = out.logits[0, -1].argmax().view(1, 1)
    for n in range(1, max(lengths) + 1):
        generated.append(int(token))
        out = _forward(model, token, cache)
        cache = out.past_key_values
        if n in lengths:
            step_caches[n] = copy.deepcopy(cache)
        token = out.logits[0, -1].argmax().view(1, 1)
    rows = []
    for n in lengths:
        answer = torch.tensor([generated[:n]])
        full = torch.cat([prompt, answer], dim=1)
        reference = _forward(model, full).past_key_values
        chunked = _forward(model, answer, _forward(model, prompt).past_key_values).past_key_values
        ref_state = _states(reference)
        ref_lp = _continue(model, reference, follow)
        row: dict[str, Any] = {"model": name, "dtype": dtype, "state_dtype": state_dtype,
                               "decode_steps": n}
        for path, cache_n in (("chunked", chunked), ("decode", step_caches[n])):
            state = _states(cache_n)
            lp = _continue(model, cache_n, follow)
            row[f"{path}_state_rel_l2"] = float((state - ref_state).norm() / ref_state.norm())
            chosen = ref_lp.argmax(dim=-1)
            row[f"{path}_max_logprob_dev"] = float(
                (lp.gather(1, chosen[:, None]) - ref_lp.gather(1, chosen[:, None])).abs().max())
            row[f"{path}_greedy_agree"] = int((lp.argmax(dim=-1) == chosen).sum())
        row["decode_over_chunked"] = (row["decode_state_rel_l2"] / row["chunked_state_rel_l2"]
                                      if row["chunked_state_rel_l2"] else float("inf"))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # partial results survive a kill
    return rows


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the report
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=DTYPES,
                        help="model (weights and activations) dtype")
    parser.add_argument("--state-dtypes", nargs="+", default=list(DTYPES), choices=DTYPES,
                        help="dtype the recurrent state is stored in between steps")
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.lengths):
        parser.error(f"--lengths {args.lengths}: every N must be >= 1")
    rows = []
    for name in args.models:
        for dtype in args.dtypes:
            for state_dtype in args.state_dtypes:
                start = time.monotonic()
                rows += measure(name, dtype, state_dtype, tuple(sorted(set(args.lengths))),
                                args.prompt_len, args.seed)
                print(f"{name} {dtype} state {state_dtype}: {time.monotonic() - start:.0f} s",
                      file=sys.stderr)
    if args.json:
        print(json.dumps({"continuation": CONTINUATION, "prompt_len": args.prompt_len,
                          "rows": rows}, indent=1))
        return 0
    header = ("model", "dtype", "state", "N", "chunked rel L2", "decode rel L2", "ratio",
              "chunked max dlogp", "decode max dlogp", "greedy agree c/d")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join([r["model"], r["dtype"], r["state_dtype"], str(r["decode_steps"]),
                          f"{r['chunked_state_rel_l2']:.2e}", f"{r['decode_state_rel_l2']:.2e}",
                          f"{r['decode_over_chunked']:.1f}",
                          f"{r['chunked_max_logprob_dev']:.3f}",
                          f"{r['decode_max_logprob_dev']:.3f}",
                          f"{r['chunked_greedy_agree']}/{r['decode_greedy_agree']} of "
                          f"{CONTINUATION}"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
