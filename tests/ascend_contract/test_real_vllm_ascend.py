"""The plugin against the REAL vllm-ascend releases, each beside the vLLM it pairs with, imported
with a stand-in for torch_npu/CANN only (``npu_standin``). Sources come from
``scripts/setup_ascend_contract.sh``; without them these tests skip."""

from __future__ import annotations

from pathlib import Path

import pytest
from ascend_sources import RELEASES, SRC, run_beside

from vllm_hybrid_backends import cli

pytestmark = [pytest.mark.ascend_contract, pytest.mark.slow]

# What vllm-ascend's patch_mamba_utils re-assigns in NPUWorker.__init__ on non-310P hosts; the
# plugin's patch_vllm_ascend_worker_worker re-applies its worker patches after these.
REASSIGNED = {"batch_memcpy", "batch_memcpy_kernel", "postprocess_mamba_fused_kernel",
              "preprocess_mamba"}


@pytest.fixture(scope="module", params=RELEASES)
def probed(request):
    result = run_beside(request.param, "probe.py")
    ascend_source = SRC / f"vllm_ascend-{request.param[1]}"
    assert Path(result["vllm_ascend_file"]).resolve().is_relative_to(ascend_source.resolve())
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


def test_each_vllm_ascend_function_the_plugin_wraps_here_is_named_in_doctor(probed):
    composed = " ".join(cli.VLLM_ASCEND_COMPOSITION)
    wrapped = [f"{name.rsplit('.', 1)[-1]}.find_longest_cache_hit"
               for name in probed["hit_searches_wrapped"]]
    assert probed["npu_worker_wrapped"] is True
    assert all(name in composed for name in ["NPUWorker.__init__", *wrapped])
