"""``gpu_check --interior [--vllm-source DIR]``: the loader of vLLM's kernel sources, the checks
under the Triton interpreter (CPU), and on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hybrid_backends import gpu_check

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("triton")


def _child(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.fixture(scope="module")
def vllm_source(tmp_path_factory):
    """``scripts/gpu_vllm_source.sh`` run on the installed vLLM, into a fresh directory; its
    ``vllm/__init__.py`` and FLA's ``ops/__init__.py`` are tripwires that fail when executed."""
    pytest.importorskip("vllm.third_party.flash_linear_attention.ops.chunk")
    out = tmp_path_factory.mktemp("vllm-src")
    done = subprocess.run(["bash", "scripts/gpu_vllm_source.sh", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{out}: vLLM 0.3"), done.stdout
    for init in ("vllm/__init__.py", "vllm/third_party/flash_linear_attention/ops/__init__.py"):
        (out / init).write_text(f"raise SystemExit('{init} was executed')\n")
    return out


LOAD = """
import importlib, sys
from vllm_hybrid_backends import gpu_check_interior as interior, vllm_source
kernels = interior.load_kernels(sys.argv[1])
import vllm
root = sys.argv[1]
assert getattr(vllm, "__file__", None) is None, vllm.__file__
assert vllm.__path__ == [root + "/vllm"], vllm.__path__
assert vllm.__version__.startswith("0.3"), vllm.__version__
for module in (kernels.fla_chunk, kernels.ssd_combined, sys.modules["vllm.envs"],
               sys.modules[vllm_source.FLA + ".chunk_delta_h"], sys.modules[vllm_source.SSD + ".ssd_chunk_scan"]):
    assert module.__file__.startswith(root + "/vllm/"), module.__file__
    assert not hasattr(module, "__hybrid_stand_in__"), module.__name__
assert kernels.fla_chunk.chunk_gated_delta_rule_fwd.__code__.co_filename.startswith(root)
assert kernels.ssd_combined._mamba_chunk_scan_combined_fwd.__module__ == kernels.ssd_combined.__name__
assert kernels.compute_chunk_metadata.__code__.co_filename == root + "/vllm/v1/attention/backends/mamba_attn.py"
import torch
assert kernels.compute_chunk_metadata(16, 1, torch.tensor([0]), torch.tensor([0, 40]), None)[0] == [0, 16, 32, 40]
stand_ins = sorted(n for n, m in sys.modules.items() if n.startswith("vllm.") and getattr(m, "__hybrid_stand_in__", False))
assert set(stand_ins) <= set(vllm_source.STAND_INS), stand_ins
assert "vllm.config" not in sys.modules and "vllm.v1.attention.backends.mamba_attn" not in sys.modules
from vllm_hybrid_backends import patches
from vllm_hybrid_backends.patches import patch_vllm_third_party_flash_linear_attention_ops_chunk as wrap
assert patches.check(wrap).state == "ready", patches.check(wrap)
print(" ".join(stand_ins))
"""


def test_the_source_loader_runs_vllms_own_kernel_files_and_no_package_init(vllm_source):
    # the installed vLLM is importable here, yet every vllm import comes from the copied tree
    result = _child(LOAD, str(vllm_source))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "vllm.triton_utils" in result.stdout.split()


@pytest.mark.parametrize("make", [
    pytest.param(lambda tmp: tmp / "absent", id="missing"),
    pytest.param(lambda tmp: tmp, id="no-vllm-tree"),
])
def test_a_vllm_source_without_the_kernels_is_one_clear_line(tmp_path, capsys, make):
    assert gpu_check.main(["--interior", "--vllm-source", str(make(tmp_path))]) == gpu_check.NO_KERNELS_EXIT
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith(f"gpu-check: --vllm-source {make(tmp_path)}: no vLLM kernel sources there")
    assert "scripts/gpu_vllm_source.sh" in lines[0]


def test_vllm_source_without_interior_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--vllm-source", "x"])
    assert "--vllm-source and --device go with --interior" in capsys.readouterr().err


RUN = """
import sys
from vllm_hybrid_backends import gpu_check
sys.exit(gpu_check.main(["--interior", "--vllm-source", sys.argv[1], "--device", "cpu", "--json"]))
"""

# the same run with each plan pointing one state off (FLA: the 64-token chunk before; Mamba2: the
# next SSD chunk): the checks must fail it
OFF_BY_ONE_CHUNK = """
import dataclasses, sys
from vllm_hybrid_backends import vllm_source
vllm_source.install(sys.argv[1], interpret=True)  # before the patches import the plugin's logger
from vllm_hybrid_backends.patches import patch_vllm_v1_attention_backends_gdn_attn as gdn
from vllm_hybrid_backends.patches import patch_vllm_v1_attention_backends_mamba2_attn as mamba2
def shifted(plan_fn, by):
    def plan(*args, **kwargs):
        p = plan_fn(*args, **kwargs)
        return dataclasses.replace(p, batch=dataclasses.replace(p.batch, temporal_row=p.batch.temporal_row + by))
    return plan
gdn.plan_device_states = shifted(gdn.plan_device_states, -1)
mamba2.plan_interior_states = shifted(mamba2.plan_interior_states, 1)
""" + RUN


def test_interior_states_of_vllms_kernels_in_the_interpreter(vllm_source):
    """The whole ``--interior`` path on CPU tensors under ``TRITON_INTERPRET=1`` (fp32, small
    heads): vLLM's FLA and SSD kernels from the copied tree, the plugin's wrap, plans and stores
    through the Triton backend; then the same with plans one chunk off, which must fail."""
    env = {"TRITON_INTERPRET": "1"}
    done = _child(RUN, str(vllm_source), env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] and report["backend"] == "triton-interpreted"
    rows = {row["check"]: row for row in report["interior"]}
    assert set(rows) == {"gdn fp32", "mamba2 fp32"}
    assert rows["gdn fp32"]["states"] == 6 and rows["mamba2 fp32"]["states"] == 10
    assert all(row["bit_exact_vs_prefix"] and row["ok"] for row in rows.values())

    wrong = _child(OFF_BY_ONE_CHUNK, str(vllm_source), env=env)
    assert wrong.returncode == 1, wrong.stdout[-3000:] + wrong.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads(wrong.stdout)["interior"]}
    for row in rows.values():
        assert not row["ok"] and row["bit_exact_vs_prefix"] is False and row["err_ratio"] > 1e-2, row


@pytest.mark.cuda
@pytest.mark.rocm
def test_on_a_gpu_the_interior_states_pass():
    """On the device job: with vLLM installed, or from ``VLLM_HYBRID_VLLM_SOURCE`` (default
    ``.devrun/vllm-src`` when it exists) on a machine without it."""
    source = os.environ.get("VLLM_HYBRID_VLLM_SOURCE") or (
        str(ROOT / ".devrun/vllm-src") if (ROOT / ".devrun/vllm-src").is_dir() else None)
    args = ["--interior", "--json"] + (["--vllm-source", source] if source else [])
    done = _child(f"import sys; from vllm_hybrid_backends import gpu_check; sys.exit(gpu_check.main({args!r}))")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] and {row["check"] for row in report["interior"]} == {
        "gdn fp32", "gdn bf16", "mamba2 fp32", "mamba2 bf16"}


@pytest.mark.no_device
def test_without_a_gpu_the_interior_check_says_so_in_one_line(vllm_source, capsys):
    assert gpu_check.main(["--interior", "--vllm-source", str(vllm_source)]) == gpu_check.NO_GPU_EXIT
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA/HIP GPU visible"), lines
