"""``vllm-hybrid-backends replay``: flags, errors, JSON, plot."""

from __future__ import annotations

import json
import sys

import pytest

from vllm_hybrid_backends.cli import main
from vllm_hybrid_backends.replay.engine_config import vllm_has_prefix_match_unit
from vllm_hybrid_backends.replay.harness import ReplayConfig
from vllm_hybrid_backends.replay.report import PLOT_INSTALL_HINT, plot_capacity_sweep
from vllm_hybrid_backends.replay.shapes import tiny_shape
from vllm_hybrid_backends.replay.workloads import Trace, TraceRequest

POLICY_FIELDS = {"token_hit_rate", "bound_hit_rate", "prefill_tokens_computed",
                 "state_mismatches", "mamba_blocks_peak", "sched_step_us_median", "miss_reasons"}


def test_a_malformed_trace_line_fails_with_its_line_number(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "prompt_token_ids": [1, 2], "max_tokens": 2}\n'
                    '{"id": "b", "prompt_token_ids": "1 2 3", "max_tokens": 2}\n')
    assert main(["replay", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2: 'prompt_token_ids' must be a non-empty list of token ids" in err


@pytest.mark.parametrize(("flags", "message"), [
    pytest.param(["--cache-tokens", "0"], "--cache-tokens must be a positive integer, got 0",
                 id="cache-tokens"),
    pytest.param(["--block-size", "-4"], "--block-size must be a positive integer, got -4",
                 id="block-size"),
    pytest.param(["--cache-tokens", "100"], "--cache-tokens 100 is less than one block (544",
                 id="below-one-block"),
    pytest.param(["--timing-repeats", "0"], "--timing-repeats must be a positive integer, got 0",
                 id="timing-repeats"),
])
def test_bad_sizes_are_rejected(flags, message, capsys):
    assert main(["replay", *flags]) == 2
    assert message in capsys.readouterr().err


def test_workload_and_trace_are_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["replay", "--workload", "short", "--trace", str(tmp_path / "x.jsonl")])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.slow
def test_replay_json_reports_both_policies(capsys):
    status = main(["replay", "--workload", "short", "--json"])
    out = capsys.readouterr().out
    report = json.loads(out)
    assert status == 0
    assert report["workload"] == "short" and report["model_shape"] == "qwen3.5-0.8b"
    assert report["vllm_version"]
    assert set(report["policies"]) == {"upstream", "plugin"}
    for metrics in report["policies"].values():
        assert POLICY_FIELDS <= set(metrics)
        assert metrics["state_mismatches"] == 0
        assert set(metrics["miss_reasons"]) >= {"no_mamba_state_at_boundary", "evicted",
                                                "prefix_shorter_than_block", "groups_disagreed"}


def _tiny_trace() -> Trace:
    prefix = list(range(100, 148))
    return Trace("tiny", [TraceRequest(f"r{i}", prefix + [60 + i] * 9, [7, 8], 0.2 * i)
                          for i in range(4)])


def test_plot_writes_hit_rate_against_cache_capacity(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sweep.png"
    config = ReplayConfig(shape=tiny_shape(), platform="any", block_size=8, cache_tokens=1024,
                          max_num_batched_tokens=32)
    points = plot_capacity_sweep(_tiny_trace(), config, ["upstream", "plugin"], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.cache_tokens for p in points] == sorted(p.cache_tokens for p in points)
    assert all(set(p.token_hit_rate) == {"upstream", "plugin"} for p in points)
    # the ideal does not depend on capacity here (one admission order) and tops everything
    assert len({p.ideal_hit_rate for p in points}) == 1
    assert all(max(*p.token_hit_rate.values(), p.bound_hit_rate) <= p.ideal_hit_rate
               for p in points)


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    config = ReplayConfig(shape=tiny_shape(), platform="any", block_size=8, cache_tokens=1024)
    with pytest.raises(RuntimeError, match=r"--plot needs matplotlib: pip install "
                                           r"'vllm-hybrid-backends\[plot\]'"):
        plot_capacity_sweep(_tiny_trace(), config, ["upstream"], str(tmp_path / "x.png"))
    assert PLOT_INSTALL_HINT in "pip install 'vllm-hybrid-backends[plot]'"


def test_timing_repeats_report_the_median_of_interleaved_runs(monkeypatch):
    from vllm_hybrid_backends.replay import report as report_module

    medians = iter([900.0, 500.0, 700.0, 800.0, 300.0, 600.0])  # upstream, plugin, interleaved
    real_run = report_module.run_replay

    def run(trace, config, policy, **kwargs):
        result = real_run(trace, config, policy, **kwargs)
        if not kwargs.get("attention_only"):
            result.step_us = [next(medians)]
        return result

    monkeypatch.setattr(report_module, "run_replay", run)
    config = ReplayConfig(shape=tiny_shape(), platform="any", block_size=8, cache_tokens=4096,
                          max_num_batched_tokens=16, max_num_seqs=4)
    result = report_module.compare_policies(_tiny_trace(), config, ["upstream", "plugin"],
                                            timing_repeats=3)
    assert result.policies["upstream"].sched_step_us_runs == [900.0, 700.0, 300.0]
    assert result.policies["plugin"].sched_step_us_runs == [500.0, 800.0, 600.0]
    assert result.policies["upstream"].sched_step_us_median == 700.0
    assert result.policies["plugin"].sched_step_us_median == 600.0
    with pytest.raises(ValueError, match="timing_repeats=0: allowed values are integers >= 1"):
        report_module.compare_policies(_tiny_trace(), config, ["upstream"], timing_repeats=0)


@pytest.mark.parametrize(("value", "message"), [
    pytest.param("100", "--prefix-match-unit 100: vLLM needs a divisor of every KV-cache group's "
                 "block size (544 here); allowed: 1, 2, 4, 8, 16, 17, 32, 34, 68, 136, 272, 544",
                 id="not-a-divisor"),
    pytest.param("fine", "--prefix-match-unit must be a positive integer or 'best', got 'fine'",
                 id="not-a-number"),
    pytest.param("-8", "--prefix-match-unit must be a positive integer or 'best', got '-8'",
                 id="negative"),
])
@pytest.mark.skipif(not vllm_has_prefix_match_unit(),
                    reason="this vLLM has no CacheConfig.prefix_match_unit (added in 0.32)")
def test_bad_prefix_match_units_are_refused(value, message, capsys):
    assert main(["replay", "--workload", "short", f"--prefix-match-unit={value}"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("value", "message"), [
    pytest.param("100", "--prefix-cache-retention-interval 100: vLLM needs 0 (its default), a "
                 "multiple of the scheduler block size (544 tokens here) or dense",
                 id="off-the-grid"),
    pytest.param("often", "--prefix-cache-retention-interval must be an integer >= 0 or "
                 "'dense', got 'often'", id="not-a-number"),
    pytest.param("-544", "--prefix-cache-retention-interval must be an integer >= 0 or "
                 "'dense', got '-544'", id="negative"),
])
def test_bad_retention_intervals_are_refused(value, message, capsys):
    assert main(["replay", "--workload", "short",
                 f"--prefix-cache-retention-interval={value}"]) == 2
    assert message in capsys.readouterr().err


def _conversation_trace(tmp_path):
    # Conversations in the Mooncake format: each turn repeats the previous turn's units.
    lines, stamp = [], 0
    for conversation in range(3):
        units = [100]  # a shared system prompt
        for turn in range(3):
            units = units + [1000 * conversation + 10 * turn + k for k in range(3)]
            stamp += 700
            lines.append({"timestamp": stamp, "input_length": 256 * len(units) - 20,
                          "output_length": 8, "hash_ids": units})
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.slow
@pytest.mark.skipif(not vllm_has_prefix_match_unit(),
                    reason="this vLLM has no CacheConfig.prefix_match_unit (added in 0.32)")
def test_replay_best_prefix_match_unit_reports_the_sweep(tmp_path, capsys):
    path = _conversation_trace(tmp_path)
    status = main(["replay", "--trace", str(path), "--hash-block-size", "256", "--limit", "5",
                   "--prefix-match-unit", "best", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0
    for name, metrics in report["policies"].items():
        sweep = report["prefix_match_unit_sweep"][name]
        assert list(sweep) == ["544", "272", "136", "68", "34", "32", "17", "16"]
        assert metrics["token_hit_rate"] == max(sweep.values())
        assert sweep[str(metrics["prefix_match_unit"])] == metrics["token_hit_rate"]
        assert sum(metrics["gap_to_ideal"].values()) == sum(metrics["miss_reasons"].values())
    # 236-token prompt tails past the 256-token units: some unit below the block hits more
    assert report["policies"]["upstream"]["prefix_match_unit"] < 544


@pytest.mark.slow
def test_replay_reads_a_hash_block_trace(tmp_path, capsys):
    path = _conversation_trace(tmp_path)
    status = main(["replay", "--trace", str(path), "--hash-block-size", "256", "--limit", "8",
                   "--time-scale", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["num_requests"] == 8
    assert report["workload_params"] == {"format": "hash-block", "hash_block_size": 256,
                                         "timestamp_unit": "ms", "time_scale": 2.0, "limit": 8}
    upstream, plugin = report["policies"]["upstream"], report["policies"]["plugin"]
    assert upstream["state_mismatches"] == plugin["state_mismatches"] == 0
    assert plugin["token_hit_rate"] >= upstream["token_hit_rate"]
    assert plugin["bound_hit_rate"] > 0


@pytest.mark.slow
def test_the_table_says_how_a_hash_block_trace_was_read(tmp_path, capsys):
    path = _conversation_trace(tmp_path)  # 256-token units, ms, 700 ms apart
    status = main(["replay", "--trace", str(path), "--limit", "4", "--time-scale", "2",
                   "--policy", "upstream"])
    first = capsys.readouterr().out.splitlines()[0]
    assert status == 0
    assert first.endswith("(hash-block trace: 256 tokens per hash id, timestamps in ms x 2, "
                          "arrivals over 4 s)"), first


def test_prefix_match_unit_on_an_older_vllm_names_the_version(monkeypatch, capsys):
    from vllm_hybrid_backends.replay import engine_config

    monkeypatch.setattr(engine_config, "vllm_has_prefix_match_unit", lambda: False)
    assert main(["replay", "--workload", "short", "--prefix-match-unit", "16"]) == 2
    assert "--prefix-match-unit needs vLLM's CacheConfig.prefix_match_unit (0.32+); this " \
        "vLLM is" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--limit", "3"], ["--timestamp-unit", "s"]])
def test_trace_flags_need_a_trace(capsys, flag):
    assert main(["replay", "--workload", "short", *flag]) == 2
    assert "--hash-block-size, --timestamp-unit and --limit apply to --trace only" \
        in capsys.readouterr().err


@pytest.mark.slow
def test_the_report_counts_requests_hitting_more_and_less_than_the_first_policy():
    from vllm_hybrid_backends.replay.report import compare_policies, render_table
    from vllm_hybrid_backends.replay.workloads import make_workload

    config = ReplayConfig(model_shape="qwen3.5-0.8b", cache_tokens=65_536)
    trace = make_workload("agentic", block_size=config.layout().block_size, seed=0)
    report = compare_policies(trace, config, ["upstream", "plugin"])
    upstream, plugin = report.policies["upstream"], report.policies["plugin"]
    assert upstream.versus_first is None
    # the plugin's ledger comes with it (agentic retries reuse tail states)
    assert upstream.retention_ledger is None
    kinds = plugin.retention_ledger["kinds"]
    assert all(row["reused"] <= row["kept"] for row in kinds.values())
    tails = plugin.retention_ledger["families"]["tail"]
    assert tails["reused"] > 0 and tails["saved_tokens"] > 0
    assert any(row["proven"] for kind, row in kinds.items() if kind.startswith("tail-"))
    versus = plugin.versus_first
    assert versus is not None and versus["against"] == "upstream"
    # the per-request sums agree with the two hit rates, computed from the runs separately
    net = round((plugin.token_hit_rate - upstream.token_hit_rate) * trace.num_prompt_tokens)
    assert versus["tokens_more"] - versus["tokens_fewer"] == net != 0
    assert versus["requests_more"] > 0 and versus["tokens_more"] > 0
    assert versus["requests_more"] + versus["requests_fewer"] <= len(trace.requests)
    table = render_table(report)
    assert ("requests hitting more than upstream" in table
            and f"{versus['requests_more']} (+{versus['tokens_more']:,})" in table)
    assert f"{versus['requests_fewer']} (-{versus['tokens_fewer']:,})" in table


def test_request_differences_need_the_same_requests():
    from vllm_hybrid_backends.replay.metrics import request_differences

    with pytest.raises(ValueError, match=r"different requests \(2 and 1\); allowed: runs of one"):
        request_differences({"a": 1, "b": 2}, {"a": 1}, "upstream")


@pytest.mark.parametrize(("flags", "message"), [
    (["--workload", "short", "--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--trace", "t.jsonl", "--seed", "1"], "--seed applies to a bundled --workload only"),
])
def test_a_bad_seed_is_refused(capsys, flags, message):
    assert main(["replay", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_seed_draws_another_workload_and_is_reported(capsys):
    reports = []
    for seed in ([], ["--seed", "3"]):
        assert main(["replay", "--workload", "branching", "--policy", "upstream", *seed,
                     "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    default, third = reports
    assert "seed" not in default["workload_params"] and third["workload_params"]["seed"] == 3
    assert default["prompt_tokens"] != third["prompt_tokens"]
