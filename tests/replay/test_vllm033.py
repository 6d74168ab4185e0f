"""The harness against vLLM 0.33's sources (``make setup-vllm033``), in a subprocess.

Skipped when the 0.33 tree is absent. ``VLLM_HYBRID_VLLM_PATH`` points at another tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TREE = Path(os.environ.get("VLLM_HYBRID_VLLM_PATH")
            or Path(__file__).resolve().parents[2] / ".venv-vllm033" / "site")

SCRIPT = """
import json, vllm
from vllm_hybrid_backends.replay.harness import ReplayConfig, run_replay
from vllm_hybrid_backends.replay.metrics import policy_metrics
from vllm_hybrid_backends.replay.policy import get_policy
from vllm_hybrid_backends.replay.workloads import make_workload
config = ReplayConfig()
trace = make_workload("agentic", block_size=config.layout().block_size, sessions=2, turns=3)
policy = get_policy("upstream")
bound = run_replay(trace, config, policy, attention_only=True)
hybrid = run_replay(trace, config, policy,
                    bound_hits={k: r.hit_tokens for k, r in bound.requests.items()})
m = policy_metrics(trace, hybrid, bound)
print(json.dumps({"version": vllm.__version__, "mismatches": m.state_mismatches,
                  "checks": m.state_checks, "leaked": hybrid.blocks_leaked,
                  "hit": m.token_hit_rate}))
"""


def _run_on_033(script: str) -> dict:
    """Run ``script`` with the 0.33 tree first on the path; its last line of output, as JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(TREE), os.environ.get("PYTHONPATH")) if p), VLLM_TARGET_DEVICE="cpu",
        VLLM_LOGGING_LEVEL="ERROR")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["version"].startswith("0.33")
    return result


@pytest.mark.slow
@pytest.mark.skipif(not (TREE / "vllm").is_dir(), reason=f"no vLLM source tree at {TREE}")
def test_replay_runs_on_the_vllm_033_scheduler():
    result = _run_on_033(SCRIPT)
    assert result["mismatches"] == 0 and result["checks"] > 0 and result["leaked"] == 0


JUNCTION_SCRIPT = """
import json, vllm
from vllm_hybrid_backends.replay.harness import ReplayConfig, run_replay
from vllm_hybrid_backends.replay.policy import get_policy
from vllm_hybrid_backends.replay.shapes import tiny_shape
from vllm_hybrid_backends.replay.workloads import Trace, TraceRequest
system = list(range(500, 512))
trace = Trace("system-prompt", [
    TraceRequest(f"r{i}", system + [1000 * (i + 1) + t for t in range(40)], [7] * 2,
                 arrival_s=0.1, after=f"r{i - 1}" if i else None) for i in range(5)])
config = ReplayConfig(shape=tiny_shape(), platform="any", block_size=16, cache_tokens=4096,
                      max_num_batched_tokens=64, max_num_seqs=4, prefix_match_unit=4)
out = {"version": vllm.__version__}
for name in ("upstream", "plugin"):
    run = run_replay(trace, config, get_policy(name))
    out[name] = [run.requests[f"r{i}"].hit_tokens for i in range(5)]
    out[name + "_mismatches"] = len(run.mismatches)
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not (TREE / "vllm").is_dir(), reason=f"no vLLM source tree at {TREE}")
def test_sub_block_junctions_on_the_vllm_033_scheduler():
    result = _run_on_033(JUNCTION_SCRIPT)
    # a 12-token junction under a 32-token state (two GDN groups): kept by r3, whose 3
    # branches reach it, and hit by r4
    assert (result["upstream"], result["plugin"]) == ([0] * 5, [0, 0, 0, 0, 12])
    assert result["upstream_mismatches"] == result["plugin_mismatches"] == 0
