"""``bench/placement_sweep.py``: its argument checks and the per-seed summary (no replay runs
here; the rows in docs/results.md come from real runs)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "placement_sweep.py"


def _module():
    spec = importlib.util.spec_from_file_location("placement_sweep", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_bad_seed_is_refused_naming_it():
    proc = subprocess.run([sys.executable, str(BENCH), "--seeds", "0,-2"], capture_output=True,
                          text=True, check=False, timeout=120)
    assert proc.returncode == 2
    assert "'-2': seeds are integers >= 0" in proc.stderr, proc.stderr


def test_the_seed_summary_counts_the_seeds_below_upstream_per_row():
    def row(workload, seed, upstream, plugin, computed=(100, 100)):
        return {"workload": workload, "model_shape": "nemotron-h-8b", "cache_tokens": 65536,
                "seed": seed, "upstream": upstream, "plugin": plugin,
                "prefill_tokens_computed": dict(zip(("upstream", "plugin"), computed))}

    # seed 0 hits less, yet computes fewer prompt tokens (its preempted prefills resumed)
    rows = [row("agentic", 0, 0.30, 0.25, (100, 90)), row("agentic", 1, 0.30, 0.40, (100, 80)),
            row("agentic", 2, 0.20, 0.20, (100, 103)), row("chat", 0, 0.10, 0.12)]
    agentic, chat = _module().seed_summary(rows)
    assert (agentic["seeds"], agentic["below_upstream"]) == (3, 1)
    assert (agentic["min_delta"], agentic["max_delta"]) == (-0.05, 0.1)
    assert agentic["mean_delta"] == 0.0167
    assert agentic["computes_more_than_upstream"] == 1
    assert agentic["mean_prefill_ratio"] == 0.91
    assert (chat["workload"], chat["seeds"], chat["below_upstream"]) == ("chat", 1, 0)
    assert (chat["computes_more_than_upstream"], chat["mean_prefill_ratio"]) == (0, 1.0)


def test_one_prefix_match_unit_is_taken():
    proc = subprocess.run([sys.executable, str(BENCH), "--prefix-match-unit", "16,32"],
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 2
    assert "--prefix-match-unit takes one unit, got [16, 32]" in proc.stderr, proc.stderr


def test_a_bad_time_scale_is_refused_naming_it():
    proc = subprocess.run([sys.executable, str(BENCH), "--time-scales", "1,0"],
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 2
    assert "'0': a time scale is a finite number > 0" in proc.stderr, proc.stderr


def test_runs_at_several_time_scales_average_rates_and_sum_counts():
    def run(upstream, plugin, bound, preempted, mismatches, fewer):
        return {"block_size": 1040, "num_blocks": 64, "upstream": upstream, "plugin": plugin,
                "bound": bound, "ideal": 0.5, "preemptions": {"upstream": preempted, "plugin": 1},
                "requests_versus_upstream": {"against": "upstream", "requests_fewer": fewer},
                "state_mismatches": mismatches, "blocks_leaked": 0}

    row = _module()._combine([run(0.30, 0.25, 0.40, 5, 0, 3), run(0.10, 0.20, 0.20, 7, 2, 0)])
    assert (row["upstream"], row["plugin"], row["bound"], row["ideal"]) == (0.2, 0.225, 0.3, 0.5)
    assert row["plugin_over_bound"] == 0.75 and row["upstream_over_bound"] == 0.6667
    assert row["preemptions"] == {"upstream": 12, "plugin": 2}
    assert row["requests_versus_upstream"] == {"against": "upstream", "requests_fewer": 3}
    assert (row["state_mismatches"], row["blocks_leaked"]) == (2, 0)
    assert (row["block_size"], row["num_blocks"]) == (1040, 64)


def test_a_bad_retention_interval_is_refused_naming_it():
    proc = subprocess.run([sys.executable, str(BENCH), "--prefix-cache-retention-interval",
                           "sometimes"], capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 2
    assert "an integer >= 0 or 'dense', got 'sometimes'" in proc.stderr, proc.stderr


def test_a_retention_interval_is_checked_against_every_shape_before_any_row():
    # 4,352 is 8 of qwen3.5-0.8b's 544-token blocks and no multiple of nemotron-h-8b's 1,040
    proc = subprocess.run([sys.executable, str(BENCH), "--shapes", "qwen3.5-0.8b,nemotron-h-8b",
                           "--prefix-cache-retention-interval", "4352"],
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 2
    assert "nemotron-h-8b: --prefix-cache-retention-interval 4352" in proc.stderr, proc.stderr
    assert "upstream" not in proc.stderr        # no row ran
