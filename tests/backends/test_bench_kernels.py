"""``bench/kernels.py --json``: the fields the issue asks for, measured on a small workload."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


def test_bench_json_reports_each_available_backend_against_the_ceiling(capsys, fresh_plugins, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_kernels", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:  # only the smallest workload (Qwen3.5-0.8B, one request: 18.6 MiB) fits under 20 MiB
        assert bench.main(["--json", "--repeats", "1", "--max-mib", "20"]) == 0
    finally:
        torch.set_num_threads(threads)  # the bench sets its own
    report = json.loads(capsys.readouterr().out)
    assert report["device"].startswith("cpu")
    (row,) = report["results"]
    assert set(row) == {"backend", "shape", "bytes", "gbps", "ceiling_gbps", "ratio"}
    assert row["backend"] == "cpu" and row["shape"].startswith("Qwen3.5-0.8B x1")
    assert row["bytes"] == 18 * (3 * 6144 * 2 + 16 * 128 * 128 * 4)
    assert row["gbps"] > 0 and row["ceiling_gbps"] > 0
    assert abs(row["ratio"] - row["gbps"] / row["ceiling_gbps"]) < 0.01
    assert len(report["skipped"]) == 8  # every other (model, batch) pair, each with a reason


def test_bench_backends_flag_names_an_unavailable_backend_and_what_is_available(capsys, fresh_plugins,
                                                                                 monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_kernels", bench)
    spec.loader.exec_module(bench)
    try:
        bench.main(["--json", "--backends", "cuda"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("an unavailable backend was accepted")
    err = capsys.readouterr().err
    assert "--backends 'cuda': cuda not available here; available: cpu" in err


@pytest.mark.no_device
def test_gpu_hook_times_without_a_gpu_says_so_in_one_line_and_fails():
    bench = Path(__file__).resolve().parents[2] / "bench" / "gpu_hook_times.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(bench.parents[1])}
    done = subprocess.run([sys.executable, str(bench), "--calls", "2"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "gpu_hook_times: no CUDA/HIP GPU visible to torch; run it on a machine with one"]
