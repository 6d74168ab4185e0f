"""Sub-block junctions on the real vLLM-CPU engine (``VLLM_HYBRID_SUBBLOCK_JUNCTIONS``).

Six prompts share a system prompt shorter than the Mamba block, and nothing else; they run one
after another with ``prefix_match_unit=16``. vLLM alone keeps no state there, so none hits.
With the plugin the second prompt learns the junction, and the first prompt that finds enough
branches to pay for a state there (system prompt x branches >= the state's blocks in
prompt tokens: 112 x 4 >= 3 x 128 on qwen35, 240 x 4 >= 3 x 256 on granite_hybrid, three Mamba
groups each) keeps both groups' state; the next hits it. Its greedy tokens and logits equal a
run without caching: the state vLLM's junction checkpoint copied out is the forward's over the
system prompt. vLLM-CPU 0.32 alone cannot run the Mamba2 model with ``prefix_match_unit``
(its checkpoint store raises ``IndexError``; the plugin stores that checkpoint itself), so
"vLLM keeps nothing there" is checked on the gated delta net only.
"""

from __future__ import annotations

import random

import pytest

from vllm_hybrid_backends.replay.engine_config import vllm_has_prefix_match_unit
from vllm_hybrid_backends.testing.compare import assert_same_greedy
from vllm_hybrid_backends.testing.engine import run_engine
from vllm_hybrid_backends.testing.model_zoo import ZOO, build_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not vllm_has_prefix_match_unit(), reason=(
                  "sub-block hits need vLLM's prefix_match_unit (0.32+)"))]

ENGINE = {"max_model_len": 4096, "kv_cache_memory_bytes": 512 * 1024 * 1024,
          "prefix_match_unit": 16}
PROMPTS = 6
CASES = [pytest.param("qwen35", 128, 112, True, id="gdn-qwen35"),
         pytest.param("granite_hybrid", 256, 240, False, id="mamba2-granite_hybrid")]


@pytest.mark.parametrize(("model", "block", "system_len", "vllm_runs"), CASES)
def test_a_system_prompt_inside_a_block_is_hit_once_its_state_pays(model, block, system_len,
                                                                    vllm_runs):
    rng = random.Random(5)
    system = [rng.randrange(3, 500) for _ in range(system_len)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(300)] for _ in range(PROMPTS)]
    kwargs = {"dtype": ZOO[model].dtype, "max_tokens": 4, "single_process": True}
    configs = [("plugin", True, "hybrid_backends"), ("plain", False, "")]
    if vllm_runs:
        configs.append(("vllm", True, ""))
    runs = {
        name: run_engine(build_model(model), prompts, enable_prefix_caching=caching,
                         plugins=plugins, extra_llm_kwargs=ENGINE if caching else None, **kwargs)
        for name, caching, plugins in configs}
    assert f"kv lcm block sizes {block}" in runs["plugin"].log, "vLLM chose another block size"
    if vllm_runs:
        assert [r.num_cached_tokens for r in runs["vllm"].requests] == [0] * PROMPTS
    assert [r.num_cached_tokens for r in runs["plugin"].requests] == [0] * 5 + [system_len]
    for got, want in zip(runs["plugin"].requests, runs["plain"].requests, strict=True):
        assert_same_greedy(got, want, dtype=ZOO[model].dtype)
