"""Tail states stored inside the prefill chunk on the real vLLM-CPU engine, for Mamba2
(``granite_hybrid``) and the gated delta net (``qwen35``).

Prompt A (1500 tokens) is prefilled in one chunk; B shares A's first tokens up to the middle
of the block after A's tail-1 checkpoint (one block before A's last prompt boundary), so its
longest Mamba hit is the state stored inside A's chunk at that checkpoint. Checked:

- B hits exactly that boundary (the state exists and is served),
- B's greedy tokens and logits equal a run without caching (the stored state equals a
  forward over the prefix: a wrong or missing state moves logits far past the tolerance),
- no extra chunk split: the engine ran one prefill step per prompt and one per decoded
  token (``vllm:iteration_tokens_total`` count), the step count of a run without tail states.

The same for a far state (``VLLM_HYBRID_FAR_CHECKPOINTS``): B leaves a 3000-token A past the
dense tail reach, and hits A's first far state (nothing without far states).
"""

from __future__ import annotations

import random
import re

import pytest

from vllm_hybrid_backends import align
from vllm_hybrid_backends.compat import version_allows
from vllm_hybrid_backends.testing.compare import assert_same_greedy
from vllm_hybrid_backends.testing.engine import run_engine
from vllm_hybrid_backends.testing.model_zoo import ZOO, build_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not version_allows(">=0.32"), reason=(
                  "the CPU forward stores states inside the chunk from vLLM 0.32 on; before, "
                  "tail states cost chunk splits"))]

ENGINE = {"max_model_len": 4096, "kv_cache_memory_bytes": 512 * 1024 * 1024}
MAX_TOKENS = 8
PROMPT = 1500
#: Mamba block size vLLM-CPU 0.32 picks for the zoo model (its log: "kv lcm block sizes")
CASES = [pytest.param("granite_hybrid", 256, id="mamba2-granite_hybrid"),
         pytest.param("qwen35", 128, id="gdn-qwen35")]


def _steps(metrics_text: str) -> int:
    match = re.search(r"^vllm:iteration_tokens_total_count\{[^}]*\} (\S+)$", metrics_text, re.M)
    assert match, "vllm:iteration_tokens_total missing from the metrics text"
    return int(float(match.group(1)))


def _branch_hits(model: str, block: int, a: list[int], b: list[int], hit: int) -> str:
    """Run A then B with the plugin and without caching; B must hit ``hit`` tokens and both must
    decode as without caching. Returns the cached run's metrics text."""
    kwargs = {"dtype": ZOO[model].dtype, "max_tokens": MAX_TOKENS, "extra_llm_kwargs": ENGINE,
              "single_process": True}
    cached = run_engine(build_model(model), [a, b], enable_prefix_caching=True,
                        plugins="hybrid_backends", metrics=True, **kwargs)
    assert f"kv lcm block sizes {block}" in cached.log, "vLLM chose another Mamba block size"
    plain = run_engine(build_model(model), [a, b], enable_prefix_caching=False, plugins="", **kwargs)
    assert [r.num_cached_tokens for r in cached.requests] == [0, hit]
    for got, want in zip(cached.requests, plain.requests, strict=True):
        assert_same_greedy(got, want, dtype=ZOO[model].dtype)
    assert len(set(cached.requests[1].output_token_ids)) > 1
    return cached.metrics_text


@pytest.mark.parametrize(("model", "block"), CASES)
def test_tail_state_stored_inside_the_chunk_serves_a_branch(model, block):
    rng = random.Random(11)
    a = [rng.randrange(3, 500) for _ in range(PROMPT)]
    tail = align.last_prompt_boundary(PROMPT, block) - block  # A's tail-1 checkpoint
    b = a[: tail + block // 2] + [rng.randrange(3, 500) for _ in range(300)]
    metrics_text = _branch_hits(model, block, a, b, tail)
    # one prefill step per prompt (a chunk split per tail state would add a step each)
    assert _steps(metrics_text) == 2 * MAX_TOKENS



#: (model, Mamba block, tail-checkpoint count N: the first far state is 2**N blocks back); the
#: zoo models take 4096 positions, so granite_hybrid's 256-token blocks need N = 3
FAR_CASES = [pytest.param("granite_hybrid", 256, 3, id="mamba2-granite_hybrid"),
             pytest.param("qwen35", 128, 4, id="gdn-qwen35")]


@pytest.mark.parametrize(("model", "block", "count"), FAR_CASES)
def test_far_state_serves_a_branch_deep_inside_the_prompt(monkeypatch, model, block, count):
    # B leaves A half a block past A's first far state (VLLM_HYBRID_FAR_CHECKPOINTS): past the
    # dense tail reach, the first time that prefix is shared
    monkeypatch.setenv(align.TAIL_CHECKPOINTS_ENV, str(count))
    prompt = 3000
    rng = random.Random(12)
    a = [rng.randrange(3, 500) for _ in range(prompt)]
    far = align.last_prompt_boundary(prompt, block) - 2 ** count * block
    assert far in align.far_checkpoints_by_kind(prompt, block, count).values()
    b = a[: far + block // 2] + [rng.randrange(3, 500) for _ in range(300)]
    _branch_hits(model, block, a, b, far)
