"""The engine/worker handshake in one process (the real-engine mismatch runs are in
``tests/e2e/test_engine_worker_handshake.py``)."""

from __future__ import annotations

import types

import pytest

from vllm_hybrid_backends import handshake, patches
from vllm_hybrid_backends.compat import version_allows
from vllm_hybrid_backends.patches import (
    patch_vllm_v1_core_kv_cache_coordinator as coordinator_patch,
)
from vllm_hybrid_backends.patches import patch_vllm_v1_engine_core as engine_core_patch

INTERIOR = handshake.WORKER_FEATURES["gdn_interior_states"]


@pytest.fixture(autouse=True)
def _no_handshake():
    handshake.reset()
    yield
    handshake.reset()


def _report(pid, **states):
    every = {n for needed in handshake.WORKER_FEATURES.values() for n in needed}
    return {"pid": pid, "patches": {name: states.get(name, patches.APPLIED) for name in every},
            "forward_limits": {feature: "" for feature in handshake.WORKER_FEATURES}}


def test_a_feature_is_off_where_a_workers_forward_cannot_give_the_states():
    cannot = dict(_report(2), forward_limits={"gdn_interior_states": "no GDN forward here",
                                              "mamba2_interior_states": ""})
    support = handshake.combine([_report(1), cannot])
    assert support.supports("mamba2_interior_states")
    assert not support.supports("gdn_interior_states")
    assert support.reasons["gdn_interior_states"] == "worker pid 2: no GDN forward here"
    silent = {"pid": 3, "patches": _report(3)["patches"]}  # a report without forward limits
    assert not handshake.combine([silent]).supports("mamba2_interior_states")


def test_a_feature_is_on_only_when_every_worker_applied_its_patches():
    assert handshake.combine([_report(1), _report(2)]).supports("gdn_interior_states")
    lacking = handshake.combine([_report(1), _report(2, **{INTERIOR[0]: patches.REFUSED})])
    assert lacking.established and not lacking.supports("gdn_interior_states")
    assert lacking.reasons["gdn_interior_states"] == f"worker pid 2: {INTERIOR[0]} refused"


def test_no_answer_means_no_support():
    assert not handshake.current().supports("gdn_interior_states")
    silent = handshake.combine([])
    assert not silent.established and not silent.supports("gdn_interior_states")
    with pytest.raises(ValueError, match="unknown worker feature 'decode'; known: gdn_interior_states, mamba2_interior_states"):
        silent.supports("decode")


def test_establish_asks_through_collective_rpc_and_sets_current():
    asked = []

    def collective_rpc(method):
        asked.append(method)
        return [_report(7)]

    support = handshake.establish(collective_rpc)
    assert asked == [handshake.worker_report]
    assert handshake.current() is support and support.supports("gdn_interior_states")


def test_a_failing_rpc_leaves_every_feature_off():
    def collective_rpc(method):
        raise TimeoutError("worker gone")

    support = handshake.establish(collective_rpc)
    assert not support.established and not support.supports("gdn_interior_states")
    assert support.reasons["gdn_interior_states"] == "no worker answered the handshake"


def test_worker_report_shows_a_forced_refusal(monkeypatch):
    monkeypatch.setenv(patches.REFUSE_ENV, INTERIOR[0])
    report = handshake.worker_report()
    assert report["patches"][INTERIOR[0]] == patches.REFUSED
    assert not handshake.combine([report]).supports("gdn_interior_states")


def test_refusal_env_is_checked_and_can_name_a_process(monkeypatch):
    monkeypatch.setenv(patches.REFUSE_ENV, f"{INTERIOR[0]}@NoSuchProcess, {INTERIOR[0]}")
    assert patches.forced_refusals() == {INTERIOR[0]}
    monkeypatch.setenv(patches.REFUSE_ENV, "patch_nothing")
    with pytest.raises(ValueError, match="VLLM_HYBRID_REFUSE_PATCHES names 'patch_nothing', which is no patch"):
        patches.forced_refusals()


def _gdn_align_spec():
    return types.SimpleNamespace(mamba_cache_mode="align", num_speculative_blocks=0,
                                 num_prefill_checkpoint_blocks=0,
                                 mamba_type=types.SimpleNamespace(name="GDN_ATTN"))


@pytest.mark.skipif(not version_allows(">=0.32"), reason="interior states are used from vLLM 0.32")
def test_the_coordinator_plans_interior_states_only_after_the_workers_said_so(monkeypatch):
    monkeypatch.setattr(coordinator_patch, "interior_override", None)
    spec = _gdn_align_spec()
    assert not coordinator_patch.stores_interior(spec)  # no handshake yet
    handshake.establish(lambda method: [_report(1, **{INTERIOR[0]: patches.READY})])
    assert not coordinator_patch.stores_interior(spec)  # ready is not applied
    handshake.establish(lambda method: [_report(1), _report(2)])
    assert coordinator_patch.stores_interior(spec)


def test_engine_core_asks_the_workers_before_building_kv_caches(monkeypatch):
    from vllm.v1.engine.core import EngineCore

    assert engine_core_patch.missing() == []
    order = []
    monkeypatch.setitem(engine_core_patch._ORIGINALS, "EngineCore._initialize_kv_caches",
                        lambda self, config: order.append(("kv caches", config)) or "kv config")
    monkeypatch.setattr(EngineCore, "_initialize_kv_caches", engine_core_patch._initialize_kv_caches)
    fake_core = types.SimpleNamespace(
        collective_rpc=lambda method: order.append("handshake") or [method(None)])
    assert EngineCore._initialize_kv_caches(fake_core, "config") == "kv config"
    assert order == ["handshake", ("kv caches", "config")]
    assert handshake.current().established


def test_a_coordinator_subclass_defined_later_keeps_its_search_and_the_plugin_records_hits(monkeypatch):
    """vllm-ascend's AscendHybridKVCacheCoordinator overrides find_longest_cache_hit (checked
    against its real 0.23.0 / 0.26.0rc1 sources, tests/ascend_contract) and may be defined after
    the plugin's patches applied: engine start wraps it; its own search runs, the hit is recorded
    once, and revert restores it."""
    module = coordinator_patch._module()
    recorded = []
    monkeypatch.setattr(coordinator_patch, "_record_hit",
                        lambda self, result, hashes, limit: recorded.append(result) or result)
    calls = []

    def vllms_search(self, block_hashes, max_cache_hit_length):
        calls.append("vllm")
        return (), 42

    # undone after revert(), which puts back what apply() found
    monkeypatch.setattr(module.HybridKVCacheCoordinator, "find_longest_cache_hit", vllms_search)
    coordinator_patch.apply()
    try:

        class LaterHybridCoordinator(module.HybridKVCacheCoordinator):
            def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
                calls.append("subclass")
                return super().find_longest_cache_hit(block_hashes, max_cache_hit_length)

        own = vars(LaterHybridCoordinator)["find_longest_cache_hit"]
        monkeypatch.setitem(engine_core_patch._ORIGINALS, "EngineCore._initialize_kv_caches",
                            lambda self, config: None)
        engine_core_patch._initialize_kv_caches(types.SimpleNamespace(collective_rpc=lambda m: []), None)
        wrapped = vars(LaterHybridCoordinator)["find_longest_cache_hit"]
        assert wrapped is not own and wrapped._hybrid_backends_wrapper
        coordinator = LaterHybridCoordinator.__new__(LaterHybridCoordinator)  # no vLLM state needed
        assert coordinator.find_longest_cache_hit([], 99) == ((), 42)
        assert calls == ["subclass", "vllm"] and recorded == [((), 42)]
        assert coordinator_patch.wrap_subclass_hit_searches() == []  # once
    finally:
        coordinator_patch.revert()
    assert vars(LaterHybridCoordinator)["find_longest_cache_hit"] is own


# ---- the gated delta net on the device (Triton/FLA) path --------------------------------------

DEVICE_GDN = handshake.GDN_FORWARD_PATCHES["device"]


def _gdn_worker(layer_class_name="QwenGatedDeltaNetAttention", backend="triton",
                ssm_cache_dtype="auto", model_dtype=None, block_size=576):
    """A worker whose model holds one real vLLM GDN layer object (built without its weights)."""
    import torch

    gdn = pytest.importorskip("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")
    olmo = pytest.importorskip("vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn")
    cls = {"QwenGatedDeltaNetAttention": gdn.QwenGatedDeltaNetAttention,
           "OlmoHybridGatedDeltaNetAttention": olmo.OlmoHybridGatedDeltaNetAttention}[layer_class_name]
    model_dtype = model_dtype or torch.bfloat16
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.prefix, layer.gdn_prefill_backend = "model.layers.0.linear_attn", backend
    layer.model_config = types.SimpleNamespace(dtype=model_dtype)
    layer.cache_config = types.SimpleNamespace(mamba_cache_dtype="auto",
                                               mamba_ssm_cache_dtype=ssm_cache_dtype)
    model = torch.nn.Sequential(layer)
    return types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: model),
                                 vllm_config=types.SimpleNamespace(
                                     model_config=types.SimpleNamespace(dtype=model_dtype),
                                     cache_config=types.SimpleNamespace(block_size=block_size)))


def _wraps_in_place(monkeypatch, in_place=True):
    from vllm_hybrid_backends.patches import (
        patch_vllm_model_executor_layers_mamba_gdn_qwen_gdn_linear_attn as layer_wrap,
    )
    from vllm_hybrid_backends.patches import (
        patch_vllm_third_party_flash_linear_attention_ops_chunk as fla_wrap,
    )

    monkeypatch.setattr(fla_wrap, "is_applied", lambda: in_place)
    monkeypatch.setattr(layer_wrap, "is_applied", lambda: True)


def _device_limit(monkeypatch, worker=None, **states):
    monkeypatch.setattr(handshake, "_platform_name", lambda: "cuda")
    _wraps_in_place(monkeypatch)
    applied = {name: states.get(name, patches.APPLIED) for name in DEVICE_GDN}
    return handshake.forward_limits(patch_states=applied, worker=worker)["gdn_interior_states"]


def test_a_device_worker_gives_gdn_states_where_fla_is_wrapped_and_every_layer_prefills_with_it(
        monkeypatch):
    assert _device_limit(monkeypatch) == ""  # doctor: no model to check
    assert _device_limit(monkeypatch, _gdn_worker()) == ""
    assert _device_limit(monkeypatch, _gdn_worker(), **{DEVICE_GDN[0]: patches.REFUSED}) == (
        "the gated-delta-net forward on cuda is not wrapped to store states inside the chunk "
        f"({DEVICE_GDN[0]} refused)")
    assert _device_limit(monkeypatch, _gdn_worker(block_size=544)) == (
        "the block size 544 is not a multiple of FLA's chunk (64 tokens), so block boundaries "
        "fall inside FLA's chunks (--block-size 64 makes vLLM round the hybrid block size up to "
        "a multiple of 64)")
    assert _device_limit(monkeypatch, _gdn_worker(backend="flashinfer")) == (
        "GDN layer model.layers.0.linear_attn prefills with the flashinfer kernel, not "
        "Triton/FLA (--gdn-prefill-backend triton gives the chunk states)")
    assert _device_limit(monkeypatch, _gdn_worker(ssm_cache_dtype="float32")) == (
        "GDN layer model.layers.0.linear_attn caches its recurrent state in torch.float32, wider "
        "than FLA's chunk states (torch.bfloat16): an interior state would be rounded")
    assert _device_limit(monkeypatch, _gdn_worker("OlmoHybridGatedDeltaNetAttention")) == (
        "GDN layer model.layers.0.linear_attn is a OlmoHybridGatedDeltaNetAttention, whose "
        "forward is not wrapped")
    unreadable = types.SimpleNamespace(model_runner=None)
    assert _device_limit(monkeypatch, unreadable).startswith(
        "the worker's GDN layers could not be inspected (AttributeError")
    monkeypatch.setattr(handshake, "_platform_name", lambda: "xpu")
    assert handshake.forward_limits(patch_states={}, worker=_gdn_worker())["gdn_interior_states"] == (
        "the gated-delta-net prefill on xpu is not vLLM's Triton/FLA kernel the plugin wraps "
        "(on cuda and rocm)")


def test_a_gdn_forward_replaced_after_the_wrap_gives_no_states(monkeypatch):
    monkeypatch.setattr(handshake, "_platform_name", lambda: "rocm")
    _wraps_in_place(monkeypatch, in_place=False)  # e.g. a platform plugin's worker rebound it
    applied = {name: patches.APPLIED for name in DEVICE_GDN}
    assert handshake.forward_limits(patch_states=applied, worker=_gdn_worker())[
        "gdn_interior_states"] == ("the gated-delta-net forward was replaced after the plugin "
                                   "wrapped it (FLA wrap in place: False, GDN layer wrap: True)")


def test_a_cpu_worker_needs_vllm_cpus_gdn_forward_wrapped(monkeypatch):
    monkeypatch.setattr(handshake, "_platform_name", lambda: "cpu")
    cpu_forward = handshake.GDN_FORWARD_PATCHES["cpu"][0]
    limits = handshake.forward_limits(patch_states={cpu_forward: patches.APPLIED})
    assert limits["gdn_interior_states"] == ""
    limits = handshake.forward_limits(patch_states={cpu_forward: patches.READY, DEVICE_GDN[0]: patches.APPLIED})
    assert limits["gdn_interior_states"] == (
        "the gated-delta-net forward on cpu is not wrapped to store states inside the chunk "
        f"({cpu_forward} ready)")


@pytest.mark.skipif(not version_allows(">=0.32"), reason="interior states are used from vLLM 0.32")
def test_the_engine_plans_gdn_interior_blocks_where_every_device_worker_reports_them(monkeypatch):
    """Both ways: device workers whose FLA prefill gives the chunk states get GDN interior
    blocks; one worker prefilling with FlashInfer keeps the engine splitting chunks."""
    monkeypatch.setattr(coordinator_patch, "interior_override", None)
    states = {name: patches.APPLIED for needed in handshake.WORKER_FEATURES.values() for name in needed}
    states.update({name: patches.APPLIED for name in DEVICE_GDN})

    def report(pid, worker):
        return {"pid": pid, "patches": states,
                "forward_limits": handshake.forward_limits(patch_states=states, worker=worker)}

    monkeypatch.setattr(handshake, "_platform_name", lambda: "cuda")
    _wraps_in_place(monkeypatch)
    monkeypatch.setattr(handshake, "_ssd_scan_limit", lambda scan_patched: "")
    spec = _gdn_align_spec()
    handshake.establish(lambda method: [report(1, _gdn_worker()), report(2, _gdn_worker())])
    assert coordinator_patch.stores_interior(spec)
    handshake.establish(lambda method: [report(1, _gdn_worker()),
                                        report(2, _gdn_worker(backend="flashinfer"))])
    assert not coordinator_patch.stores_interior(spec)
    assert handshake.current().reasons["gdn_interior_states"].startswith(
        "worker pid 2: GDN layer model.layers.0.linear_attn prefills with the flashinfer kernel")
