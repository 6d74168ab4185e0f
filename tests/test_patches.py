"""Patches over vLLM: the V1 copy route against vLLM's own address path, the platform hook,
kernel-override precedence, and all-or-nothing application."""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest
import torch

from vllm_hybrid_backends import hookimpl, patches
from vllm_hybrid_backends.compat import (
    has_mamba2_prefill_checkpoint,
    installed_vllm_version,
    version_allows,
)
from vllm_hybrid_backends.patches import patch_vllm_platforms as platform_patch
from vllm_hybrid_backends.patches import patch_vllm_v1_worker_mamba_utils as copy_patch
from vllm_hybrid_backends.types import Availability, BackendIdentity, DeviceKind

mamba_utils = pytest.importorskip("vllm.v1.worker.mamba_utils")
kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
layer_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")


@pytest.fixture
def v1_copy_patch(monkeypatch):
    """Apply the V1 copy patch for one test, restoring vLLM's module afterwards."""
    for name in copy_patch.TARGET_SYMBOLS:  # "function" or "Class.method"
        owner, _, attr = name.rpartition(".")
        host = getattr(mamba_utils, owner) if owner else mamba_utils
        if attr in vars(host):  # vLLM 0.26's context lacks some of the methods
            monkeypatch.setattr(host, attr, vars(host)[attr])
    copy_patch._ORIGINALS.clear()
    copy_patch._state_cache.clear()
    copy_patch.apply()
    yield
    copy_patch._ORIGINALS.clear()
    copy_patch._state_cache.clear()


def _model(num_blocks=20, conv_dim=6, state_len=4, dtype=torch.float32, generator=None):
    """Attention group 0 plus two Mamba2 groups (1, 2), one layer each, random states."""
    backend_enum = kv_iface.MambaSpec.__dataclass_fields__["mamba_type"].default
    spec = kv_iface.MambaSpec(block_size=16, shapes=((state_len, conv_dim), (2, 3, 5)),
                              dtypes=(dtype, dtype), mamba_type=backend_enum, mamba_cache_mode="align")
    attn = kv_iface.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=dtype)
    groups = [kv_iface.KVCacheGroupSpec(["attn.0"], attn),
              kv_iface.KVCacheGroupSpec(["mamba.1"], spec),
              kv_iface.KVCacheGroupSpec(["mamba.2"], spec)]
    config = kv_iface.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    forward_context = {}
    for layer in ("mamba.1", "mamba.2"):
        conv = torch.randn(num_blocks, state_len, conv_dim, generator=generator).to(dtype)
        ssm = torch.randn(num_blocks, 2, 3, 5, generator=generator).to(dtype)
        forward_context[layer] = types.SimpleNamespace(kv_cache=[conv, ssm])
    funcs = (layer_utils.get_conv_copy_spec, layer_utils.get_temporal_copy_spec)
    # vLLM 0.30+ key the copy functions by Mamba type; 0.26 gives every layer one tuple
    copy_funcs = funcs if version_allows("<0.30") else {backend_enum: funcs}
    return config, forward_context, copy_funcs


def _copy_bufs():
    def buf(dtype):
        return types.SimpleNamespace(np=np.zeros(64, dtype=dtype))

    return types.SimpleNamespace(src_ptrs=buf(np.int64), dst_ptrs=buf(np.int64), sizes=buf(np.int32),
                                 offset=0)


def _clone_context(forward_context):
    return {k: types.SimpleNamespace(kv_cache=[t.clone() for t in v.kv_cache]) for k, v in forward_context.items()}


def _run_vllm_address_path(moves, config, forward_context, copy_funcs):
    """vLLM's own collector, with batch_memcpy done by memmove (what vLLM-CPU does)."""
    bufs = _copy_bufs()
    for src_col, dst_col, bias, req in moves:
        copy_patch._ORIGINALS["collect_mamba_copy_meta"](
            bufs, config, copy_funcs, [1, 2], src_col, dst_col, bias, req, forward_context)
    for i in range(bufs.offset):
        ctypes.memmove(int(bufs.dst_ptrs.np[i]), int(bufs.src_ptrs.np[i]), int(bufs.sizes.np[i]))


def _run_patched_path(moves, config, forward_context, copy_funcs):
    bufs = _copy_bufs()
    for src_col, dst_col, bias, req in moves:
        mamba_utils.collect_mamba_copy_meta(bufs, config, copy_funcs, [1, 2], src_col, dst_col, bias, req,
                                            forward_context)
    assert bufs.offset == 0  # nothing went to the address path
    mamba_utils.do_mamba_copy_block(bufs)


@pytest.mark.parametrize("bias", [pytest.param(0, id="plain-copy"), pytest.param(2, id="spec-bias")])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_patched_v1_copies_equal_vllms_address_path(v1_copy_patch, fresh_plugins, bias, dtype):
    generator = torch.Generator().manual_seed(1234 + bias)
    config, context, funcs = _model(dtype=dtype, generator=generator)
    req_a = types.SimpleNamespace(block_ids=([0, 1], [2, 3, 4, 5, 6], [7, 8, 9, 10, 11]))
    req_b = types.SimpleNamespace(block_ids=([0], [13, 16, 12, 15, 14], [19, 17, 18, 1, 0]))
    moves = [(0, 1, bias, req_a), (1, 2, bias, req_b), (2, 2, 0, req_a)]  # last one: no move
    expected = _clone_context(context)
    _run_vllm_address_path(moves, config, expected, funcs)
    _run_patched_path(moves, config, context, funcs)
    for layer in context:
        for got, want in zip(context[layer].kv_cache, expected[layer].kv_cache):
            assert torch.equal(got, want), layer


def test_patched_v1_copies_go_through_the_selected_backend(v1_copy_patch, fresh_plugins, monkeypatch):
    seen = []

    class Spy:
        @hookimpl
        def hb_backend_identity(self):
            return BackendIdentity("spy", DeviceKind.CPU, priority=-1)

        @hookimpl
        def hb_backend_probe(self):
            return Availability(True, "test spy")

        @hookimpl
        def hb_copy_state_blocks(self, states, src_blocks, dst_blocks):
            seen.append(([(s.layer, s.kind.value, s.group) for s in states], src_blocks.tolist(), dst_blocks.tolist()))

    fresh_plugins.register_backend(Spy())
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", "spy")
    try:
        config, context, funcs = _model()
        req = types.SimpleNamespace(block_ids=([0], [2, 3], [7, 8]))
        _run_patched_path([(0, 1, 0, req)], config, context, funcs)
    finally:
        fresh_plugins.unregister_backend("spy")
    assert seen == [(
        [("mamba.1", "conv_sd", 0), ("mamba.1", "temporal", 0), ("mamba.2", "conv_sd", 1), ("mamba.2", "temporal", 1)],
        [[2], [7]],
        [[3], [8]],
    )]


def test_unknown_copy_functions_fall_back_to_vllms_path(v1_copy_patch, fresh_plugins):
    config, context, funcs = _model()

    def custom_spec(state, block_ids, cur_block_idx, num_accepted_tokens):
        return layer_utils.get_temporal_copy_spec(state, block_ids, cur_block_idx, num_accepted_tokens)

    custom = (layer_utils.get_conv_copy_spec, custom_spec)
    funcs = custom if isinstance(funcs, tuple) else {next(iter(funcs)): custom}
    bufs = _copy_bufs()
    req = types.SimpleNamespace(block_ids=([0], [2, 3], [7, 8]))
    mamba_utils.collect_mamba_copy_meta(bufs, config, funcs, [1, 2], 0, 1, 0, req, context)
    assert bufs.offset == 4  # vLLM's collector took it: 2 layers x 2 states


# ---- platform hook and kernel-override precedence ----------------------------------------------


@pytest.mark.skipif(not platform_patch.has_worker_seam(),
                    reason="this vLLM has no kernel dispatcher (added in 0.32)")
def test_kernels_registered_after_the_platform_win(monkeypatch, fresh_plugins):
    from vllm.triton_utils import dispatcher

    module = types.ModuleType("hb_fake_kernels")

    def fake_kernel(x):
        return "triton"

    module.fake_kernel = fake_kernel
    monkeypatch.setitem(sys.modules, "hb_fake_kernels", module)
    name = "hb_fake_kernels.fake_kernel"
    order = []

    class FakePlatform:
        device_name = "fake"

        @classmethod
        def register_triton_kernel_overrides(cls):
            order.append("platform")
            dispatcher.register_kernels({name: lambda x: "platform"})

    class KernelBackend:
        @hookimpl
        def hb_backend_identity(self):
            return BackendIdentity("kernels", DeviceKind.CPU, priority=-1)

        @hookimpl
        def hb_backend_probe(self):
            return Availability(True, "test")

        @hookimpl
        def hb_kernel_overrides(self, platform_name):
            order.append(f"backend({platform_name})")
            return {name: lambda x: "backend"}

    monkeypatch.setattr(platform_patch, "_platform_class", lambda: FakePlatform)
    monkeypatch.setattr(patches, "apply_all", lambda process: order.append(process) or True)
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", "kernels")
    fresh_plugins.register_backend(KernelBackend())
    try:
        platform_patch.apply()
        platform_patch.apply()  # idempotent: wrapped once
        FakePlatform.register_triton_kernel_overrides()
        assert order == ["platform", "worker", "backend(fake)"]
        assert module.fake_kernel(0) == "backend"
        FakePlatform.register_triton_kernel_overrides()  # a second call installs nothing more
        assert order == ["platform", "worker", "backend(fake)", "platform"]
    finally:
        dispatcher._registry.pop(name, None)
        fresh_plugins.unregister_backend("kernels")


def _fake_patch(name, applied, *, missing=(), versions=">=0.1", not_needed=None):
    module = types.SimpleNamespace(__name__=f"x.{name}", PROCESS="worker", VLLM_VERSIONS=versions,
                                   missing=lambda: list(missing),
                                   apply=lambda: applied.append(name))
    if not_needed is not None:
        module.not_needed = lambda: not_needed
    return module


def test_apply_all_patches_nothing_if_any_patch_cannot_apply(monkeypatch):
    applied = []
    good = _fake_patch("patch_good", applied)
    bad = _fake_patch("patch_bad", applied, missing=["vllm.some.symbol"])
    monkeypatch.setattr(patches, "_applied", set())
    monkeypatch.setattr(patches, "patch_modules", lambda process=None: [good, bad])
    assert patches.apply_all("worker") is False
    assert applied == []
    monkeypatch.setattr(patches, "patch_modules", lambda process=None: [good])
    assert patches.apply_all("worker") is True
    assert applied == ["patch_good"]
    assert patches.check(good).state == patches.APPLIED


def test_a_patch_written_for_other_versions_refuses_the_whole_process(monkeypatch):
    applied = []
    good = _fake_patch("patch_good", applied)
    old = _fake_patch("patch_old", applied, versions="<0.1")
    monkeypatch.setattr(patches, "_applied", set())
    monkeypatch.setattr(patches, "patch_modules", lambda process=None: [good, old])
    status = patches.check(old)
    assert status.state == patches.REFUSED
    assert status.reason == f"written for vLLM <0.1, this is {installed_vllm_version()}"
    assert patches.apply_all("worker") is False and applied == []


def test_a_patch_this_vllm_does_not_need_is_skipped_with_its_reason(monkeypatch):
    applied = []
    good = _fake_patch("patch_good", applied)
    unneeded = _fake_patch("patch_unneeded", applied, missing=["checked only when needed"],
                           not_needed="no such feature before 0.32")
    monkeypatch.setattr(patches, "_applied", set())
    monkeypatch.setattr(patches, "patch_modules", lambda process=None: [good, unneeded])
    assert patches.check(unneeded) == patches.PatchStatus(
        "patch_unneeded", "worker", patches.NOT_NEEDED, "no such feature before 0.32")
    assert patches.apply_all("worker") is True and applied == ["patch_good"]


def test_every_patch_applies_to_the_installed_vllm():
    for module in patches.patch_modules():
        status = patches.check(module)
        assert status.state != patches.REFUSED, status
        if status.state == patches.NOT_NEEDED:  # says why, and only where that is true
            assert status.reason
            assert (patches.is_optional(module) or version_allows("<0.32")
                    or status.reason == "VLLM_HYBRID_STATS is off"), status


def test_mamba2_checkpoint_patches_agree_on_whether_vllm_has_the_checkpoint():
    # vLLM 0.31 ships mamba/checkpoint.py for KDA only: its Mamba2 has no prefill checkpoint,
    # so the metadata patch must be "not needed" exactly where the store patch is
    from vllm_hybrid_backends.patches import (
        patch_vllm_model_executor_layers_mamba_mamba_mixer2 as store_patch,
    )
    from vllm_hybrid_backends.patches import (
        patch_vllm_v1_attention_backends_mamba2_attn as metadata_patch,
    )

    store_unneeded = patches.check(store_patch).state == patches.NOT_NEEDED
    assert (patches.check(metadata_patch).state == patches.NOT_NEEDED) == store_unneeded
    assert has_mamba2_prefill_checkpoint() == (not store_unneeded)


def test_applicable_patches_say_what_they_leave_to_this_vllm():
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_kv_cache_coordinator as coordinator

    copy_status = patches.check(copy_patch)
    assert copy_status.state in (patches.READY, patches.APPLIED), copy_status
    if version_allows("<0.30"):  # 0.26's spec-decode context is an earlier design
        assert "only the V1 scalar copy path" in copy_status.reason
        assert "compute_aligned_state_indices" in copy_status.reason
    else:
        assert copy_status.reason == ""
    limits = coordinator.limitation() or ""
    if version_allows(">=0.26"):
        assert limits == ""
    else:  # 0.23: dense retention, no pop_blocks_for_free, no local-token count
        assert "suffix eviction" in limits and "interior states" in limits
