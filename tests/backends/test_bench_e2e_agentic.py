"""``bench/e2e_agentic.py``: the workloads it sends (no engine is started here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from vllm_hybrid_backends.testing.model_zoo import VOCAB_SIZE

BENCH = Path(__file__).resolve().parents[2] / "bench" / "e2e_agentic.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_e2e_agentic", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e_agentic"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_e2e_agentic", None)


def _shared(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("name", ["agentic", "chat"])
def test_workload_is_deterministic_in_vocab_and_within_max_length(bench, name):
    requests = bench.build_workload(name)
    assert requests and requests == bench.build_workload(name)
    assert requests != bench.build_workload(name, seed=1)
    assert len({r.id for r in requests}) == len(requests)
    for r in requests:
        assert r.workload == name
        assert 0 < len(r.prompt) <= bench.DEFAULT_MAX_PROMPT < bench.MAX_MODEL_LEN
        assert all(1 <= t < VOCAB_SIZE for t in r.prompt)
    cap = {"agentic": 2200, "chat": 1000}[name]
    short = bench.build_workload(name, max_prompt=cap)
    assert short and all(len(r.prompt) <= cap for r in short) and len(short) < len(requests)


def test_mapping_keeps_prefixes(bench):
    tokens = list(range(16, 5000))
    mapped = bench.map_tokens(tokens)
    assert bench.map_tokens(tokens[:1234]) == mapped[: len(bench.map_tokens(tokens[:1234]))]
    assert 0.35 < len(mapped) / len(tokens) < 0.55  # about DEFAULT_KEEP_PERCENT (45) kept


def test_workloads_keep_their_prefix_structure(bench):
    agentic = bench.build_workload("agentic")
    turns = [(a, b) for a, b in zip(agentic, agentic[1:], strict=False)
             if a.id.split("-")[0] == b.id.split("-")[0]]
    assert turns
    for a, b in turns:
        # the next turn diverges before the previous prompt's last full block (the tail)
        shared = _shared(a.prompt, b.prompt)
        assert 0 < shared < (len(a.prompt) - 1) // bench.BLOCK_SIZE * bench.BLOCK_SIZE
    chat = bench.build_workload("chat")
    for a, b in zip(chat, chat[1:], strict=False):
        if a.id.split("-")[0] == b.id.split("-")[0]:
            assert b.prompt[: len(a.prompt)] == a.prompt  # each turn extends the previous one
