"""Where the real vllm-ascend releases are (``scripts/setup_ascend_contract.sh``) and how a
script runs beside one of them, with a stand-in for torch_npu/CANN only (``npu_standin``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
SRC = ROOT / ".venv-matrix" / "src"
#: (vLLM, vllm-ascend) pairs: each vllm-ascend release beside the vLLM it pairs with
RELEASES = [pytest.param(("0.23.0", "0.23.0"), id="vllm-ascend-0.23.0"),
            pytest.param(("0.26.0", "0.26.0rc1"), id="vllm-ascend-0.26.0rc1")]


def run_beside(release: tuple[str, str], script: str, *args: str) -> dict:
    """Run ``script`` (in this folder) with the release's vLLM and vllm-ascend sources first on
    sys.path; return the JSON object it prints last. Skips when the sources are absent."""
    vllm_version, ascend_version = release
    paths = [SRC / f"vllm-{vllm_version}", SRC / f"vllm_ascend-{ascend_version}"]
    if not all(p.is_dir() for p in paths):
        pytest.skip("run scripts/setup_ascend_contract.sh (make test-ascend-contract) first")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [*map(str, paths), str(ROOT / ".venv-matrix" / "extra"), str(HERE), str(ROOT)]))
    done = subprocess.run([sys.executable, str(HERE / script), *args], env=env, cwd=HERE,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
