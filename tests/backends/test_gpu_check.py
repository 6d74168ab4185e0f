"""``python -m vllm_hybrid_backends.gpu_check``: without vLLM, without a GPU, and its checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from vllm_hybrid_backends import gpu_check, reference
from vllm_hybrid_backends.backends.triton.backend import CUDA

# a finder that makes `import vllm` (and its submodules) fail, as on a machine without vLLM
BLOCK_VLLM = """
import importlib.abc, sys
class _NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, _NoVllm())
"""


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_VLLM + code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_the_check_and_everything_it_imports_work_without_vllm():
    code = """
import vllm_hybrid_backends.gpu_check as check
from vllm_hybrid_backends.backends.triton import kernels  # imports triton, not vLLM
check._triton_backend()
try:
    import vllm
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the blocker let vllm through")
assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")], "vllm imported"
print("imported")
"""
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "imported"


@pytest.mark.no_device
def test_without_a_gpu_it_says_so_in_one_line_and_fails():
    code = "from vllm_hybrid_backends.gpu_check import main; sys.exit(main(['--json']))"
    result = _run(code, {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""})
    assert result.returncode == gpu_check.NO_GPU_EXIT
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA/HIP GPU visible"), result.stderr



@pytest.mark.no_device
def test_without_torch_the_module_run_says_so_in_one_line_and_fails():
    code = """
sys.modules["torch"] = None  # as on a machine where torch is not installed
import runpy
runpy.run_module("vllm_hybrid_backends.gpu_check", run_name="__main__")
"""
    result = _run(code)
    assert result.returncode == gpu_check.NO_GPU_EXIT, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: torch is not installed"), result.stderr

def test_parity_passes_for_the_triton_kernels_in_the_interpreter(interpreted_kernels):
    assert gpu_check.check_parity(CUDA, "cpu") == {hook: "ok" for hook in gpu_check.parity_cases("cpu")}


class _SkipsPrecopy:
    """The Triton backend with a precopy that moves nothing."""

    def __getattr__(self, hook):
        return getattr(CUDA, hook)

    def hb_precopy_running_states(self, **kwargs):
        return None


def test_parity_reports_a_hook_that_differs(interpreted_kernels):
    results = gpu_check.check_parity(_SkipsPrecopy(), "cpu")
    assert results["hb_precopy_running_states"].startswith("differs in ")
    assert results["hb_copy_state_blocks"] == "ok"


def test_the_reference_is_poisoned_where_the_cases_do_not_read():
    # the cases leave NaN in blocks nobody reads: a hook reading one would show NaN in its output
    states = gpu_check.parity_cases("cpu")["hb_precopy_running_states"](reference)
    assert any(bool(s.tensor.float().isnan().any()) for s in states)


@pytest.mark.cuda
@pytest.mark.rocm
def test_on_a_gpu_every_check_passes_and_prints_json(capsys):
    assert gpu_check.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and set(report["sync"].values()) == {"ok"}
    assert report["bandwidth"][0]["operation"] == "copy_(same bytes)"
    assert torch.cuda.is_available()


def test_random_layouts_match_the_reference_in_the_interpreter(interpreted_kernels):
    results = gpu_check.check_fuzz(CUDA, "cpu", 6)
    assert results == {hook: "ok (6 cases)" for hook in (
        "hb_copy_state_blocks", "hb_precopy_running_states", "hb_postprocess_accepted_states")}


def test_random_layouts_catch_copies_that_ignore_snapshot_order(interpreted_kernels, monkeypatch):
    # a move planner that never stages: a chain reads a block after another move overwrote it
    kernels = interpreted_kernels
    plan_moves = kernels._plan_moves

    def no_staging(src, dst, shift):
        moves = plan_moves(src, dst, shift)
        slot_source = {slot: source for source, slot, _ in moves.staging}
        moves.direct_flat += [(slot_source[slot], d, b) for slot, d, b in moves.staged_flat]
        moves.staging, moves.staged_flat = [], []
        return moves

    monkeypatch.setattr(kernels, "_plan_moves", no_staging)
    results = gpu_check.check_fuzz(CUDA, "cpu", 6)
    assert "differs in" in results["hb_copy_state_blocks"]
    assert results["hb_precopy_running_states"] == "ok (6 cases)"


def test_a_negative_fuzz_count_is_refused_with_its_value(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--fuzz", "-3"])
    assert exit_.value.code == 2
    assert "--fuzz must be >= 0, got -3" in capsys.readouterr().err
