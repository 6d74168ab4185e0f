"""vLLM's own CPU tier (``OffloadingConnector``) in the replay, alone and with the plugin."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_hybrid_backends.cli import main
from vllm_hybrid_backends.compat import installed_vllm_version
from vllm_hybrid_backends.replay import offload
from vllm_hybrid_backends.replay.harness import ReplayConfig, ReplayError, run_replay
from vllm_hybrid_backends.replay.policy import get_policy
from vllm_hybrid_backends.replay.shapes import tiny_shape
from vllm_hybrid_backends.replay.workloads import Trace, TraceRequest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    offload.tier_problem() is not None, reason=str(offload.tier_problem()))]

A_PROMPT = list(range(1000, 1041))  # 41 tokens: states at 8, 16, 24, 32, 40 are possible
#: vLLM's CPU tier is sized in GiB; the tiny shape's 512-byte pages align to 4 KiB chunks
TIER_GIB = 1 / 1024  # 256 chunks, more than the whole trace stores


def _config(tier: float | None = TIER_GIB, **overrides) -> ReplayConfig:
    # 28 blocks of 8 tokens: three 41-token fillers push "a"'s blocks out of the GPU pool
    base = dict(shape=tiny_shape(), platform="any", block_size=8, cache_tokens=8 * 28,
                max_num_batched_tokens=64, max_num_seqs=4, kv_offloading_size=tier)
    base.update(overrides)
    return ReplayConfig(**base)


def _evicted_then_resent(shared: int) -> Trace:
    """"a", three unrelated prompts that evict it from the GPU pool, then "b" sharing the
    first ``shared`` tokens of a's prompt."""
    fillers = [TraceRequest(f"f{i}", list(range(2000 + 100 * i, 2041 + 100 * i)), [7] * 2,
                            arrival_s=1.0 + i) for i in range(3)]
    b_prompt = A_PROMPT[:shared] + [9] * (49 - shared)
    return Trace("evict", [TraceRequest("a", A_PROMPT, [5] * 2), *fillers,
                           TraceRequest("b", b_prompt, [5] * 2, arrival_s=20.0)])


def _served(result) -> dict[str, int]:
    return {rid: r.hit_tokens + r.external_tokens for rid, r in result.requests.items()}


@pytest.mark.parametrize("policy", ["upstream", "plugin"])
def test_a_prefix_evicted_from_the_gpu_is_loaded_from_the_cpu_tier_exactly(policy):
    trace = _evicted_then_resent(shared=41)
    gpu_only = run_replay(trace, _config(tier=None), get_policy(policy))
    tiered = run_replay(trace, _config(), get_policy(policy))
    assert gpu_only.requests["b"].hit_tokens == 0 and gpu_only.evictions_mamba > 0
    b = tiered.requests["b"]
    # the state at 40 and the five attention blocks before it come back through the connector
    assert (b.hit_tokens, b.external_tokens) == (0, 40)
    assert tiered.mismatches == []
    assert tiered.blocks_leaked == 0
    stats = tiered.offload
    assert stats["loaded"] == {"attention": 5, "mamba": 2}  # two Mamba groups, one state each
    assert stats["mamba_reused_by_place"]["prompt_end"] == 2
    assert stats["pinned_chunks_at_end"] == 0 and stats["load_jobs"] == 1


def test_the_plugins_states_inside_the_prompt_compose_with_the_tier():
    # "b" branches from "a" at 24 tokens: vLLM keeps a's state at its prompt end (40) only,
    # the plugin also one inside the prompt, which vLLM's connector offloads like any other
    trace = _evicted_then_resent(shared=24)
    served = {(policy, tier is not None): _served(run_replay(trace, _config(tier=tier),
                                                             get_policy(policy)))["b"]
              for policy in ("upstream", "plugin") for tier in (None, TIER_GIB)}
    assert served[("plugin", True)] == 24
    assert served[("plugin", True)] > served[("plugin", False)]
    assert served[("plugin", True)] > served[("upstream", True)]


def _corrupt_one_kind(monkeypatch, kind: str) -> None:
    original = offload.CPUTierWorker._write

    def write(self, group, block, stored):
        original(self, group, block, stored)
        if stored.kind == kind == "mamba":
            row = self.mamba_row[group]
            self.worker.temporal_np[row][block] += np.array([0, 1])  # same length, wrong hash
        elif stored.kind == kind == "attention":
            self.kv[group][block] += np.array([0, 1])

    monkeypatch.setattr(offload.CPUTierWorker, "_write", write)


@pytest.mark.parametrize("kind", ["mamba", "attention"])
def test_a_corrupted_load_is_caught_as_a_mismatch(monkeypatch, kind):
    _corrupt_one_kind(monkeypatch, kind)
    result = run_replay(_evicted_then_resent(shared=41), _config(), get_policy("upstream"))
    assert result.requests["b"].external_tokens == 40
    assert result.mismatches and {m.request_id for m in result.mismatches} == {"b"}
    assert all(m.resume for m in result.mismatches)
    found = {m.what for m in result.mismatches}
    assert found == ({"attention"} if kind == "attention" else {"temporal"})
    assert "(resume from cache)" in result.mismatches[0].describe()


def test_a_vllm_without_the_offloading_connector_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(offload, "_REQUIRED", (
        *offload._REQUIRED, ("vllm.v1.core.sched.output", "KVConnectorBlockState",
                             "no_such_field")))
    problem = offload.tier_problem()
    assert problem is not None
    assert "vllm.v1.core.sched.output.KVConnectorBlockState.no_such_field" in problem
    assert f"vLLM {installed_vllm_version()} has no" in problem
    with pytest.raises(ReplayError, match="no_such_field"):
        run_replay(_evicted_then_resent(41), _config(), get_policy("upstream"))


@pytest.mark.parametrize(("overrides", "message"), [
    pytest.param({"kv_offloading_size": 0.0}, "allowed values are finite GiB > 0", id="zero"),
    pytest.param({"prefix_match_unit": 4}, "with --prefix-match-unit (4)", id="sub-block"),
    pytest.param({"num_spec_tokens": 2}, "with speculative tokens (2)", id="spec-decode"),
])
def test_what_the_tier_does_not_simulate_is_refused(overrides, message):
    with pytest.raises(ReplayError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_replay(_evicted_then_resent(41), _config(**overrides), get_policy("upstream"))


@pytest.mark.parametrize(("flags", "message"), [
    pytest.param(["--kv-offloading-size", "-1"],
                 "--kv-offloading-size must be a finite number of GiB > 0, got -1.0", id="neg"),
    pytest.param(["--kv-offloading-size", "1", "--prefix-match-unit", "16"],
                 "--kv-offloading-size cannot be combined with --prefix-match-unit", id="unit"),
    pytest.param(["--kv-offloading-size", "1", "--timing-repeats", "3"],
                 "--kv-offloading-size cannot be combined with --timing-repeats", id="repeats"),
])
def test_cli_refuses_bad_tier_flags(flags, message, capsys):
    assert main(["replay", "--workload", "short", *flags]) == 2
    assert message in capsys.readouterr().err


def test_cli_reports_each_policy_without_and_with_the_tier(tmp_path, capsys):
    path = tmp_path / "evict.jsonl"
    path.write_text("".join(json.dumps({"id": r.id, "arrival_s": r.arrival_s,
                                        "prompt_token_ids": r.prompt_token_ids,
                                        "output_token_ids": r.output_token_ids}) + "\n"
                            for r in _evicted_then_resent(24).requests))
    status = main(["replay", "--trace", str(path), "--model-shape", "qwen3.5-0.8b",
                   "--cache-tokens", "4096", "--kv-offloading-size", "0.5", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["kv_offloading_size_gib"] == 0.5
    policies = report["policies"]
    assert list(policies) == ["upstream", "upstream+cpu", "plugin", "plugin+cpu"]
    assert policies["upstream"]["offload"] is None
    tier = policies["plugin+cpu"]["offload"]
    assert tier["capacity_chunks"] > 0 and tier["pinned_chunks_at_end"] == 0
    assert all(p["state_mismatches"] == 0 and p["blocks_leaked"] == 0 for p in policies.values())
