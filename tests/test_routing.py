"""The routing rules of tests/conftest.py, run on throwaway test files in a subprocess."""

from __future__ import annotations

import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

SUITE = '''
import pytest

def test_cuda_in_the_name_only():
    pass

@pytest.mark.parametrize("backend", ["cuda", "rocm"])
def test_ids_that_name_devices(backend):
    pass

@pytest.mark.cuda
def test_meant_for_cuda():
    pass

@pytest.mark.ascend
class TestMeantForAscend:
    def test_inside(self):
        pass

@pytest.mark.no_device
def test_needs_a_bare_host():
    pass
'''


def _outcomes(tmp_path: Path, *args: str) -> dict[str, str]:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_suite.py").write_text(SUITE)
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "/dev/null",
                    f"--rootdir={tmp_path}", f"--junitxml={report}", *args, str(tmp_path)],
                   cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "skipped" if case.find("skipped") is not None else "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        outcomes[case.get("name")] = outcome
    return outcomes


def test_the_cpu_run_routes_by_marker_not_by_name(tmp_path):
    assert _outcomes(tmp_path) == {
        "test_cuda_in_the_name_only": "passed",
        "test_ids_that_name_devices[cuda]": "passed",
        "test_ids_that_name_devices[rocm]": "passed",
        "test_meant_for_cuda": "skipped",
        "test_inside": "skipped",
        "test_needs_a_bare_host": "passed",
    }


@pytest.mark.parametrize(("job", "selected"), [("cuda", {"test_meant_for_cuda"}),
                                               ("ascend", {"test_inside"}),
                                               ("rocm", set())])
def test_a_device_job_selects_only_its_tests(tmp_path, job, selected):
    # On this CPU host the selected tests then skip (no device); the others are not collected.
    outcomes = _outcomes(tmp_path, f"--device-job={job}")
    assert outcomes == {name: "skipped" for name in selected}


def test_an_unknown_device_job_is_refused_naming_the_choices(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", "/dev/null",
                           f"--rootdir={tmp_path}", "--device-job=tpu", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode != 0
    assert "tpu" in done.stderr and "'ascend', 'cuda', 'rocm'" in done.stderr
