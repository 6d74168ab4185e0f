"""Each engine-side patch is on vLLM's call path, on whichever vLLM is installed.

"Applied" is not enough: vLLM 0.26-0.31's ``HybridKVCacheCoordinator`` overrides
``cache_blocks``, so a wrapper on the base class alone would be installed and never run (the
plugin "applied" and the hit rate stayed the same). Here a small agentic replay runs on vLLM's
real scheduler under the plugin policy, with a profiler recording which of the plugin's wrapper
functions vLLM called; each one must have been called, and each version's retention form too.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import pytest

from vllm_hybrid_backends.patches import (
    patch_vllm_v1_core_kv_cache_coordinator as coordinator_patch,
)
from vllm_hybrid_backends.patches import patch_vllm_v1_core_kv_cache_manager as manager_patch
from vllm_hybrid_backends.patches import patch_vllm_v1_core_sched_scheduler as scheduler_patch
from vllm_hybrid_backends.replay.harness import ReplayConfig, run_replay
from vllm_hybrid_backends.replay.policy import get_policy
from vllm_hybrid_backends.replay.workloads import make_workload

pytestmark = pytest.mark.slow
CONFIG = ReplayConfig()

#: The wrappers every supported vLLM must call during an agentic replay, by what they wrap (where
#: a patch installs one of two forms by the installed signature, either counts).
ALWAYS_CALLED: dict[str, tuple[Any, ...]] = {
    "Scheduler._mamba_block_aligned_split": (scheduler_patch._mamba_block_aligned_split,),
    "KVCacheManager.allocate_slots": (manager_patch.allocate_slots,
                                      manager_patch.allocate_slots_positional),
    "cache_blocks (every coordinator class defining one)": (coordinator_patch._cache_blocks,),
    "KVCacheCoordinator.free": (coordinator_patch.free,),
    "KVCacheCoordinator.remove_skipped_blocks": (
        coordinator_patch.remove_skipped_blocks,
        coordinator_patch.remove_skipped_blocks_positional),
    "KVCacheCoordinator.get_num_blocks_to_allocate": (
        coordinator_patch.get_num_blocks_to_allocate,),
    "KVCacheCoordinator.allocate_new_blocks": (coordinator_patch.allocate_new_blocks,),
    "HybridKVCacheCoordinator.find_longest_cache_hit": (
        coordinator_patch.find_longest_cache_hit,),
}
#: The wrapper of the installed vLLM's retention form (see ``_boundary_form``).
BOUNDARY_WRAPPERS = {
    "replay_boundaries": (coordinator_patch.replay_boundaries,),
    "KVCacheCoordinator.get_replay_boundaries": (coordinator_patch.get_replay_boundaries,),
    "MambaManager.reachable_block_mask": (coordinator_patch._reachable_block_mask,),
}


def _calls_during(run: Any, functions: dict[str, tuple[Any, ...]]) -> Counter[str]:
    """How often any of each name's ``functions`` was entered while ``run()`` ran (Python
    profiler)."""
    by_code = {function.__code__: name for name, forms in functions.items() for function in forms}
    calls: Counter[str] = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in by_code:
            calls[by_code[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
    return calls


def test_every_engine_wrapper_runs_inside_vllms_scheduler():
    pytest.importorskip("vllm.v1.core.kv_cache_coordinator")
    module = coordinator_patch._module()
    form = coordinator_patch._boundary_form(module)
    assert form in (*BOUNDARY_WRAPPERS, coordinator_patch.DENSE_RETENTION), form
    wanted = dict(ALWAYS_CALLED)
    if form in BOUNDARY_WRAPPERS:  # dense retention (0.23) keeps every state: nothing to wrap
        wanted[form] = BOUNDARY_WRAPPERS[form]
    if not coordinator_patch._counts_local_tokens(module.KVCacheCoordinator):  # 0.23's form
        wanted["KVCacheCoordinator.get_num_blocks_to_allocate"] = (
            coordinator_patch.get_num_blocks_to_allocate_without_local,)
    trace = make_workload("agentic", block_size=CONFIG.layout().block_size, sessions=2, turns=3)
    results = []
    calls = _calls_during(lambda: results.append(run_replay(trace, CONFIG, get_policy("plugin"))),
                          wanted)
    assert results[0].patches, "the plugin policy applied no patch"
    not_called = sorted(name for name in wanted if calls[name] == 0)
    assert not not_called, f"installed but never called by vLLM: {not_called}"


def test_cache_blocks_is_wrapped_on_every_class_that_defines_it():
    module = pytest.importorskip("vllm.v1.core.kv_cache_coordinator")
    definers = [cls for cls in coordinator_patch._coordinator_classes(module)
                if "cache_blocks" in vars(cls)]
    assert module.KVCacheCoordinator in definers

    def wrapped() -> list[bool]:
        return [getattr(vars(cls)["cache_blocks"], "_hybrid_backends_wrapper", False)
                for cls in definers]

    with get_policy("plugin").active():
        assert all(wrapped()), [cls.__name__ for cls in definers]
    assert not any(wrapped())  # vLLM's own again once the policy ends


def test_decode_steps_run_vllms_own_coordinator_methods():
    """The allocation hooks run only inside a multi-token ``allocate_slots`` and the boundary
    wrapper only inside ``_cache_blocks`` (a Mamba block became full): a one-token decode
    allocation enters none of them."""
    pytest.importorskip("vllm.v1.core.kv_cache_coordinator")
    module = coordinator_patch._module()
    form = coordinator_patch._boundary_form(module)
    allocations = {manager_patch.allocate_slots.__code__, manager_patch.allocate_slots_positional.__code__}
    hooks = {coordinator_patch.get_num_blocks_to_allocate.__code__,
             coordinator_patch.get_num_blocks_to_allocate_without_local.__code__,
             coordinator_patch.allocate_new_blocks.__code__}
    boundaries = {forms[0].__code__ for name, forms in BOUNDARY_WRAPPERS.items() if name == form}
    caching = coordinator_patch._cache_blocks.__code__
    open_allocations: list[int] = []
    open_caching: list[bool] = []
    hook_tokens: list[int] = []
    boundary_calls = {"inside": 0, "outside": 0}

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if code in allocations:
            if event == "call":
                open_allocations.append(frame.f_locals["num_new_tokens"])
            elif event == "return":
                open_allocations.pop()
        elif code is caching:
            if event == "call":
                open_caching.append(True)
            elif event == "return":
                open_caching.pop()
        elif event == "call" and code in hooks:
            hook_tokens.append(open_allocations[-1] if open_allocations else 0)
        elif event == "call" and code in boundaries:
            boundary_calls["inside" if open_caching else "outside"] += 1

    trace = make_workload("agentic", block_size=CONFIG.layout().block_size, sessions=2, turns=3)
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = run_replay(trace, CONFIG, get_policy("plugin"))
    finally:
        sys.setprofile(previous)
    assert result.patches and result.steps > 0
    assert hook_tokens and min(hook_tokens) > 1, sorted(set(hook_tokens))[:5]
    if boundaries:  # dense retention (0.23) has no boundary wrapper
        assert boundary_calls["inside"] > 0 and boundary_calls["outside"] == 0, boundary_calls
