"""The plugin against the REAL vllm-ascend releases, each beside the vLLM it pairs with, imported
with a stand-in for torch_npu/CANN only (``npu_standin``). Sources come from
``scripts/setup_ascend_contract.sh``; without them these tests skip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ascend_contract, pytest.mark.slow]

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
SRC = ROOT / ".venv-matrix" / "src"
RELEASES = [pytest.param(("0.23.0", "0.23.0"), id="vllm-ascend-0.23.0"),
            pytest.param(("0.26.0", "0.26.0rc1"), id="vllm-ascend-0.26.0rc1")]
# What vllm-ascend's patch_mamba_utils re-assigns in NPUWorker.__init__ on non-310P hosts; the
# plugin's patch_vllm_ascend_worker_worker re-applies its worker patches after these.
REASSIGNED = {"batch_memcpy", "batch_memcpy_kernel", "postprocess_mamba_fused_kernel",
              "preprocess_mamba"}


@pytest.fixture(scope="module", params=RELEASES)
def probed(request):
    if "ascend_contract" not in (request.config.getoption("-m") or ""):
        pytest.skip("selected by make test-ascend-contract (-m ascend_contract)")
    vllm_version, ascend_version = request.param
    paths = [SRC / f"vllm-{vllm_version}", SRC / f"vllm_ascend-{ascend_version}"]
    if not all(p.is_dir() for p in paths):
        pytest.skip("run scripts/setup_ascend_contract.sh (make test-ascend-contract) first")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*map(str, paths), str(ROOT / ".venv-matrix" / "extra"), str(HERE), str(ROOT)]))
    done = subprocess.run([sys.executable, str(HERE / "probe.py")], env=env, cwd=HERE,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["vllm_ascend_file"]).resolve().is_relative_to(paths[1].resolve())
    return result


def test_only_npu_runtime_modules_are_stood_in(probed):
    assert set(probed["standins_served"]) <= {"torch", "torch_npu", "acl", "torchair",
                                               "npugraph_ex", "mindie_turbo"}


def test_the_plugin_wraps_the_real_npu_worker_init(probed):
    assert probed["npu_worker_wrapped"] is True


def test_vllm_ascend_reassigns_the_mamba_utils_functions_the_plugin_reapplies_after(probed):
    assert REASSIGNED <= set(probed["mamba_utils_reassigned"])


def test_balance_scheduler_replaces_scheduler_and_inherits_the_align_split(probed):
    # the plugin must patch the class that defines the split (vLLM's Scheduler), not the
    # module's current Scheduler, or vllm-ascend's other schedulers keep vLLM's split
    assert probed["scheduler_replaced_by"] == "BalanceScheduler"
    assert probed["split_defined_on_original"] and not probed["split_overridden_by_replacement"]


def test_ascend_coordinator_overrides_only_find_longest_cache_hit(probed):
    assert probed["ascend_coordinator_bases"] == ["HybridKVCacheCoordinator", "KVCacheCoordinator"]
    assert probed["ascend_coordinator_overrides"] == ["find_longest_cache_hit"]
    # cache_blocks is overridden by vLLM's own HybridKVCacheCoordinator on these versions: a
    # wrapper on the base KVCacheCoordinator would be bypassed
    assert probed["vllm_hybrid_coordinator_overrides_cache_blocks"] is True


def test_the_plugin_wraps_the_ascend_coordinators_own_hit_search_and_delegates_to_it(probed):
    # AscendHybridKVCacheCoordinator overrides find_longest_cache_hit: a wrapper on vLLM's
    # HybridKVCacheCoordinator alone would never see its hits (wrap_subclass_hit_searches)
    assert probed["hit_searches_wrapped"] == [
        "vllm_ascend.patch.platform.patch_kv_cache_coordinator.AscendHybridKVCacheCoordinator"]
    assert probed["ascend_hit_search_wrapper_keeps_theirs"] is True
