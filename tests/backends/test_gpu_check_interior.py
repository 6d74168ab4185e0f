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
from vllm_hybrid_backends import vllm_source as source

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("triton")


def _child(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.fixture(scope="module")
def vllm_source(tmp_path_factory):
    """``scripts/gpu_vllm_source.sh`` run on the installed vLLM, into a fresh directory; its
    ``vllm/__init__.py`` and FLA's ``ops/__init__.py`` are tripwires that fail when executed.
    Skipped unless the installed vLLM has what the interior check runs (0.32+: FLA under
    ``third_party``, ``_compute_chunk_metadata(..., checkpoint_offsets_p)``), read from its files."""
    root = source.installed_root()
    if root is None:
        pytest.skip("vLLM is not installed")
    problem = source.support_problem(root)
    if problem is not None:
        pytest.skip(f"the installed vLLM ({root}/vllm) {problem}")
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


CHUNK_METADATA_032 = """
class BaseMambaAttentionMetadataBuilder:
    @staticmethod
    def _compute_chunk_metadata(chunk_size, num_prefills, num_computed_tokens_p_cpu,
                                query_start_loc_p_cpu, checkpoint_offsets_p=None):
        raise AssertionError("a fake tree: nothing of it runs")
"""
CHUNK_METADATA_030 = """
class BaseMambaAttentionMetadataBuilder:
    def _compute_chunk_metadata(self, chunk_size, num_prefills, num_computed_tokens_p_cpu,
                                query_start_loc_p_cpu):
        raise AssertionError("a fake tree: nothing of it runs")
"""


def fake_tree(root: Path, version: str = "0.32.0", chunk_metadata: str = CHUNK_METADATA_032,
              without: str | None = None) -> Path:
    """A ``vllm/`` tree with only ``vllm_source.REQUIRED``'s files (but ``without``), none of
    them runnable: enough for every check made before anything is imported."""
    for name in source.REQUIRED:
        if name != without:
            (root / "vllm" / name).parent.mkdir(parents=True, exist_ok=True)
            (root / "vllm" / name).write_text("raise SystemExit('a fake tree was executed')\n")
    (root / "vllm/_version.py").write_text(f"__version__ = version = '{version}'\n")
    (root / "vllm" / source.CHUNK_METADATA_FILE).write_text(chunk_metadata)
    return root


def test_a_fake_032_tree_passes_the_checks_made_before_importing(tmp_path):
    assert source.support_problem(str(fake_tree(tmp_path))) is None
    assert source.check_tree(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize("make, message", [
    pytest.param(lambda tmp: tmp / "absent", "{dir}: no vLLM kernel sources there", id="missing"),
    pytest.param(lambda tmp: tmp, "{dir}: no vLLM kernel sources there", id="no-vllm-tree"),
    pytest.param(lambda tmp: fake_tree(tmp, "0.30.0", CHUNK_METADATA_030),
                 "{dir} holds vLLM 0.30.0; the interior check needs vLLM 0.32+ (its "
                 "BaseMambaAttentionMetadataBuilder._compute_chunk_metadata takes no checkpoint_offsets_p)",
                 id="vllm-0.30"),
    pytest.param(lambda tmp: fake_tree(tmp, "0.23.0", CHUNK_METADATA_030, without=source.REQUIRED[1]),
                 "{dir} holds vLLM 0.23.0; the interior check needs vLLM 0.32+ ({dir}/vllm/"
                 "third_party/flash_linear_attention/ops/chunk.py is missing)", id="vllm-0.23"),
    pytest.param(lambda tmp: fake_tree(tmp) / "vllm",
                 "{dir}: that is the vllm/ package itself; DIR is the folder containing vllm/ "
                 "(--vllm-source {parent})", id="the-vllm-package"),
])
def test_a_vllm_source_without_the_kernels_is_one_clear_line(tmp_path, capsys, make, message):
    where = make(tmp_path)
    assert gpu_check.main(["--interior", "--vllm-source", str(where)]) == gpu_check.NO_KERNELS_EXIT
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith("gpu-check: --vllm-source " + message.format(dir=where, parent=where.parent)), lines[0]
    if "no vLLM kernel sources" in message:
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

# Mamba2's first planned state moved to the next SSD chunk, its end and its chunk row together
# (a consistent plan for the wrong boundary): the check, which knows the boundaries, must fail it
MAMBA2_NEXT_CHUNK = """
import dataclasses, sys
from vllm_hybrid_backends import vllm_source
vllm_source.install(sys.argv[1], interpret=True)
from vllm_hybrid_backends.patches import patch_vllm_v1_attention_backends_mamba2_attn as mamba2
plan_fn = mamba2.plan_interior_states
def plan(*args, **kwargs):
    p = plan_fn(*args, **kwargs)
    token_end, temporal_row = p.batch.token_end.clone(), p.batch.temporal_row.clone()
    token_end[0] += 16  # the SSD chunk under the interpreter (scale 1)
    temporal_row[0] += 1
    return dataclasses.replace(p, batch=dataclasses.replace(p.batch, token_end=token_end, temporal_row=temporal_row))
mamba2.plan_interior_states = plan
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
    assert set(rows) == {"gdn fp32", "mamba2 fp32"}
    for row in rows.values():
        assert not row["ok"] and row["bit_exact_vs_prefix"] is False and row["err_ratio"] > 1e-2, row

    moved = _child(MAMBA2_NEXT_CHUNK, str(vllm_source), env=env)
    assert moved.returncode == 1, moved.stdout[-3000:] + moved.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads(moved.stdout)["interior"]}
    assert set(rows) == {"gdn fp32", "mamba2 fp32"} and rows["gdn fp32"]["ok"], rows
    assert [p.split(" ending")[0] for p in rows["mamba2 fp32"]["problems"]] == [
        "plan: rows [1, 1, 2, 2, 2]"], rows["mamba2 fp32"]


@pytest.mark.cuda
@pytest.mark.rocm
def test_on_a_gpu_the_interior_states_pass():
    """On the device job: with vLLM installed, or from ``VLLM_HYBRID_VLLM_SOURCE`` (default
    ``.devrun/vllm-src`` when it exists) on a machine without it. Skipped, with gpu_check's one
    line as the reason, when no tree is given and the installed vLLM predates the check (the
    CI images: vLLM 0.30 on CUDA, 0.23 on ROCm)."""
    tree = os.environ.get("VLLM_HYBRID_VLLM_SOURCE") or (
        str(ROOT / ".devrun/vllm-src") if (ROOT / ".devrun/vllm-src").is_dir() else None)
    args = ["--interior", "--json"] + (["--vllm-source", tree] if tree else [])
    done = _child(f"import sys; from vllm_hybrid_backends import gpu_check; sys.exit(gpu_check.main({args!r}))")
    installed = source.installed_root()
    if (done.returncode == gpu_check.NO_KERNELS_EXIT and tree is None and installed is not None
            and source.support_problem(installed) is not None):
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] and {row["check"] for row in report["interior"]} == {
        "gdn fp32", "gdn bf16", "mamba2 fp32", "mamba2 bf16"}


@pytest.mark.no_device
def test_without_a_gpu_the_interior_check_says_so_in_one_line(tmp_path, capsys):
    assert gpu_check.main(["--interior", "--vllm-source", str(fake_tree(tmp_path))]) == gpu_check.NO_GPU_EXIT
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA/HIP GPU visible"), lines


@pytest.mark.parametrize("block", [pytest.param(0, id="block-minus-1"), pytest.param(-1, id="one-past-the-end")])
def test_a_write_outside_the_cache_is_caught_by_the_guard_blocks(block):
    import torch

    from vllm_hybrid_backends import gpu_check_interior as interior

    buffers = interior._caches(torch.Generator().manual_seed(0), False, 8, (2, 4), torch.float32, "cpu", [3])
    before = (buffers[0].clone(), buffers[1].clone())
    buffers[0][1:-1][3] = 1.0  # the planned store
    buffers[1][1:-1][3] = 1.0
    result = interior.Result("x")
    interior._check_untouched(result, buffers, before, [3], "conv SD")
    assert result.ok, result.problems
    buffers[1][block] += 1  # what a store to destination -1 (or NUM_BLOCKS) of buffers[1][1:-1] does
    interior._check_untouched(result, buffers, before, [3], "conv SD")
    assert len(result.problems) == 1 and "guard block" in result.problems[0] and "ssm" in result.problems[0]


def test_a_non_finite_error_fails_the_row():
    import torch

    from vllm_hybrid_backends import gpu_check_interior as interior

    result = interior.Result("x", tolerance=1e-3)
    interior._compare(result, torch.ones(4), torch.ones(4))
    interior._compare(result, torch.full((4,), float("nan")), torch.ones(4))
    interior._compare(result, torch.ones(4), torch.ones(4))
    interior._check_bound(result, "the prefix scan")
    assert result.problems == ["error vs the prefix scan is not finite (nan)"]
