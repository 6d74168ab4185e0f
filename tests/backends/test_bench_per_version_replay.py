"""``bench/per_version_replay.py``: its argument checks and failure reporting (no replay runs here;
the rows in docs/results.md "Per vLLM version" come from real runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "per_version_replay.py"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                          check=False, timeout=120)


def test_unknown_workload_is_refused_naming_it_and_the_allowed_ones():
    proc = _bench("--workloads", "agentic,nope")
    assert proc.returncode == 2
    assert "unknown ['nope']" in proc.stderr and "agentic, chat" in proc.stderr, proc.stderr


def test_a_replay_that_fails_is_reported_and_fails_the_run(tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no vLLM here' >&2\nexit 3\n")
    broken.chmod(0o755)
    proc = _bench("--python", str(broken), "--workloads", "short", "--json")
    assert proc.returncode == 1
    assert '"rows": []' in proc.stdout
    assert "short: exit status 3: no vLLM here" in proc.stderr, proc.stderr
