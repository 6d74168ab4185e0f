"""Run inside a process whose sys.path has one vLLM release and its vllm-ascend first: import
vllm-ascend's real patches and worker, then print what they did to vLLM as JSON."""

from __future__ import annotations

import json
import sys

import npu_standin

npu_standin.install()

import vllm.v1.core.kv_cache_coordinator as coordinator  # noqa: E402
import vllm.v1.core.sched.scheduler as scheduler  # noqa: E402
import vllm.v1.worker.mamba_utils as mamba_utils  # noqa: E402

original_scheduler = scheduler.Scheduler
before = {name: getattr(mamba_utils, name) for name in dir(mamba_utils)}

import vllm_ascend  # noqa: E402
import vllm_ascend.patch.platform.patch_balance_schedule  # noqa: E402,F401
import vllm_ascend.patch.platform.patch_kv_cache_coordinator as ascend_coordinator  # noqa: E402
import vllm_ascend.patch.worker.patch_mamba_utils  # noqa: E402,F401
import vllm_ascend.worker.worker as ascend_worker  # noqa: E402

from vllm_hybrid_backends.patches import patch_vllm_ascend_worker_worker as plugin_worker  # noqa: E402
from vllm_hybrid_backends.patches import (  # noqa: E402
    patch_vllm_v1_core_kv_cache_coordinator as plugin_coordinator,
)

ascend_coord = ascend_coordinator.AscendHybridKVCacheCoordinator
plugin_worker_before = vars(ascend_worker.NPUWorker)["__init__"]
plugin_worker.apply()
ascend_search = vars(ascend_coord)["find_longest_cache_hit"]
hit_searches_wrapped = plugin_coordinator.wrap_subclass_hit_searches()
ascend_search_key = f"{ascend_coord.__module__}.{ascend_coord.__qualname__}.find_longest_cache_hit"
print(json.dumps({
    "vllm_ascend_file": vllm_ascend.__file__,
    "mamba_utils_reassigned": sorted(n for n, v in before.items()
                                     if getattr(mamba_utils, n) is not v),
    "scheduler_replaced_by": scheduler.Scheduler.__name__,
    "split_defined_on_original": "_mamba_block_aligned_split" in vars(original_scheduler),
    "split_overridden_by_replacement": "_mamba_block_aligned_split" in vars(scheduler.Scheduler),
    "ascend_coordinator_bases": [c.__name__ for c in ascend_coord.__mro__[1:3]],
    "ascend_coordinator_overrides": sorted(
        n for n in ("find_longest_cache_hit", "cache_blocks", "free", "remove_skipped_blocks",
                    "get_num_blocks_to_allocate", "allocate_new_blocks") if n in vars(ascend_coord)),
    "vllm_hybrid_coordinator_overrides_cache_blocks":
        "cache_blocks" in vars(coordinator.HybridKVCacheCoordinator),
    "npu_worker_wrapped": vars(ascend_worker.NPUWorker)["__init__"] is not plugin_worker_before
        and getattr(vars(ascend_worker.NPUWorker)["__init__"], plugin_worker._MARK, False),
    "hit_searches_wrapped": hit_searches_wrapped,
    "ascend_hit_search_wrapper_keeps_theirs":
        getattr(vars(ascend_coord)["find_longest_cache_hit"], "_hybrid_backends_wrapper", False)
        and plugin_coordinator._ORIGINALS.get(ascend_search_key) is ascend_search,
    "standins_served": sorted({s.split(".")[0] for s in npu_standin.SERVED}),
}), file=sys.stdout)
