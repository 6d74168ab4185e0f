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
from pathlib import Path
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
    "KVCacheManager.allocate_slots (armed)": (manager_patch.allocate_slots,),
    "cache_blocks (armed)": (coordinator_patch.cache_blocks,),
    "cache_blocks, a Mamba block full": (coordinator_patch._cache_blocks,),
    "KVCacheCoordinator.free": (coordinator_patch.free,),
    "KVCacheCoordinator.remove_skipped_blocks (armed)": (coordinator_patch.remove_skipped_blocks,),
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


def _replay_under(profile: Any, workload: str = "agentic", config: ReplayConfig = CONFIG,
                  **shape: Any) -> Any:
    """The plugin's replay of ``workload`` with ``profile`` as the Python profiler."""
    trace = make_workload(workload, block_size=config.layout().block_size, **shape)
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        return run_replay(trace, config, get_policy("plugin"))
    finally:
        sys.setprofile(previous)


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


def test_decode_steps_run_vllms_own_coordinator_methods():
    """The allocation hooks run only inside a multi-token ``allocate_slots`` and the boundary
    wrapper only inside ``_cache_blocks`` (a Mamba block became full): a one-token decode
    allocation enters none of them."""
    pytest.importorskip("vllm.v1.core.kv_cache_coordinator")
    module = coordinator_patch._module()
    form = coordinator_patch._boundary_form(module)
    allocations = {manager_patch.allocate_slots.__code__}
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

    result = _replay_under(profile, sessions=2, turns=3)
    assert result.patches and result.steps > 0
    assert hook_tokens and min(hook_tokens) > 1, sorted(set(hook_tokens))[:5]
    if boundaries:  # dense retention (0.23) has no boundary wrapper
        assert boundary_calls["inside"] > 0 and boundary_calls["outside"] == 0, boundary_calls


def test_decode_steps_enter_no_plugin_frame_and_miss_no_full_mamba_block():
    """vLLM's one-token ``allocate_slots`` (a decode step: one call per running request per
    step) enters a frame of this plugin only to keep the boundaries of a Mamba block it fills,
    to release kept states or to take a new block (the probation queue, coherent eviction: once
    per block a request fills, not per step); and every
    ``cache_blocks`` call that fills a Mamba block, from whichever caller, runs through the
    plugin's (the arming in the split misses none)."""
    pytest.importorskip("vllm.v1.core.kv_cache_coordinator")
    module = coordinator_patch._module()
    package = Path(coordinator_patch.__file__).parents[1]
    harness = str(package / "replay")  # the replay's oracle, not the plugin
    vllm_allocate = manager_patch._manager_class().allocate_slots.__code__
    vllm_caching = {vars(cls)["cache_blocks"].__code__
                    for cls in coordinator_patch._coordinator_classes(module)
                    if "cache_blocks" in vars(cls)}
    allowed = {coordinator_patch.cache_blocks.__name__,
               coordinator_patch.remove_skipped_blocks.__name__, "popleft_n",
               "maybe_evict_cached_block"}
    open_allocations: list[int] = []
    entered: Counter[str] = Counter()
    fills = {"through the plugin": 0, "missed": 0}
    decode_allocations = Counter[str]()

    def plugin(code: Any) -> bool:
        return code.co_filename.startswith(str(package)) and not code.co_filename.startswith(
            harness)

    def outermost_plugin_frame(frame: Any) -> bool:
        caller = frame.f_back
        while caller is not None and caller.f_code is not vllm_allocate:
            if caller.f_code.co_filename.startswith(str(package)):  # the plugin's or the oracle's
                return False
            caller = caller.f_back
        return True

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if code is vllm_allocate:
            if event == "call":
                open_allocations.append(frame.f_locals["num_new_tokens"])
                decode_allocations["all"] += open_allocations[-1] <= 1
            elif event == "return":
                open_allocations.pop()
            return
        if event != "call":
            return
        if code is manager_patch.allocate_slots.__code__:  # armed (a stale arm: one-token)
            decode_allocations["armed"] += frame.f_locals["num_new_tokens"] <= 1
        elif code in vllm_caching and frame.f_back.f_code not in vllm_caching:
            local = frame.f_locals
            if coordinator_patch.fills_mamba_block(local["self"], local["request"].request_id,
                                                  local["num_computed_tokens"]):
                through = frame.f_back.f_code is coordinator_patch._cache_blocks.__code__
                fills["through the plugin" if through else "missed"] += 1
        elif (open_allocations and open_allocations[-1] <= 1 and plugin(code)
              and outermost_plugin_frame(frame)):
            entered[code.co_name] += 1
            decode_allocations["entering the plugin"] += 1

    result = _replay_under(profile, sessions=2, turns=3)
    assert result.patches and result.steps > 0
    assert fills["through the plugin"] > 0 and fills["missed"] == 0, fills
    assert set(entered) <= allowed, entered
    assert decode_allocations["entering the plugin"] < decode_allocations["all"] / 4, (
        decode_allocations, entered)
    assert decode_allocations["armed"] < decode_allocations["all"] / 20, decode_allocations


def test_next_fill_stays_a_lower_bound_through_preemptions():
    """``request._hybrid_next_fill`` (where the split arms the plugin's caching) never exceeds
    the request's real next Mamba fill at any split, preempted requests included (their blocks,
    and so their cached count, go), and no fill bypasses the plugin under pressure."""
    pytest.importorskip("vllm.v1.core.kv_cache_coordinator")
    module = coordinator_patch._module()
    split = scheduler_patch._mamba_block_aligned_split.__code__
    vllm_caching = {vars(cls)["cache_blocks"].__code__
                    for cls in coordinator_patch._coordinator_classes(module)
                    if "cache_blocks" in vars(cls)}
    checks = {"splits": 0, "above the real fill": 0, "fills missed": 0}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        local = frame.f_locals
        if frame.f_code is split:
            request = local["request"]
            known = request.__dict__.get("_hybrid_next_fill")
            if known is not None:
                checks["splits"] += 1
                coordinator = local["self"].kv_cache_manager.coordinator
                real = min((m.num_cached_block.get(request.request_id, 0) + 1) * m.block_size
                           for m in coordinator_patch._per_block_size(coordinator))
                checks["above the real fill"] += known > real
        elif frame.f_code in vllm_caching and frame.f_back.f_code not in vllm_caching:
            missed = frame.f_back.f_code is not coordinator_patch._cache_blocks.__code__
            checks["fills missed"] += missed and coordinator_patch.fills_mamba_block(
                local["self"], local["request"].request_id, local["num_computed_tokens"])

    # long decodes in a small pool: requests are preempted mid-decode and come back
    result = _replay_under(profile, "chat", ReplayConfig(model_shape="qwen3.5-0.8b",
                                                         cache_tokens=65_536))
    assert result.preemptions > 0, "no preemption: the test needs some"
    assert checks["splits"] > 0, checks
    assert checks["above the real fill"] == 0 and checks["fills missed"] == 0, checks


def test_vllms_async_scheduler_caches_through_the_plugin_too():
    """vLLM's ``AsyncScheduler`` (vllm serve's default) with the plugin: it also caches each
    running request after its output (``KVCacheManager.cache_blocks``, whose wrapper runs here);
    no Mamba fill bypasses the plugin and the replay gives the synchronous scheduler's hits.
    Steps run one after another here, so every fill comes through the allocation's caching; a
    fill first reached after an output (overlapping steps) is not exercised."""
    pytest.importorskip("vllm.v1.core.sched.async_scheduler")
    module = coordinator_patch._module()
    vllm_caching = {vars(cls)["cache_blocks"].__code__
                    for cls in coordinator_patch._coordinator_classes(module)
                    if "cache_blocks" in vars(cls)}
    after_output = coordinator_patch.manager_cache_blocks.__code__
    seen = {"through the plugin": 0, "missed": 0, "after an output": 0}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        if frame.f_code is after_output:
            seen["after an output"] += 1
        elif frame.f_code in vllm_caching and frame.f_back.f_code not in vllm_caching:
            local = frame.f_locals
            if coordinator_patch.fills_mamba_block(local["self"], local["request"].request_id,
                                                  local["num_computed_tokens"]):
                through = frame.f_back.f_code is coordinator_patch._cache_blocks.__code__
                seen["through the plugin" if through else "missed"] += 1

    trace_args = {"sessions": 2, "turns": 3}
    result = _replay_under(profile, config=ReplayConfig(async_scheduler=True), **trace_args)
    assert seen["after an output"] > 0 and seen["through the plugin"] > 0, seen
    assert seen["missed"] == 0, seen
    synchronous = run_replay(make_workload("agentic", block_size=CONFIG.layout().block_size,
                                           **trace_args), CONFIG, get_policy("plugin"))
    assert not result.mismatches and [r.hit_tokens for r in result.requests.values()] == [
        r.hit_tokens for r in synchronous.requests.values()]
