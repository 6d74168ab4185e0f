"""Surviving vllm-ascend: optional patches in ``apply_all``, and the backend still being the one
vLLM's worker calls after vllm-ascend's ``NPUWorker.__init__`` re-assigned ``mamba_utils``.

vllm-ascend is not installed here: a fake package in ``sys.modules`` reproduces its patch order
(general plugins, then the platform's kernel overrides, then ``NPUWorker.__init__`` with plain
attribute assignments, as ``adapt_patch()`` does)."""

from __future__ import annotations

import builtins
import importlib.machinery
import sys
import types

import numpy as np
import pytest
import torch

import vllm_hybrid_backends
from vllm_hybrid_backends import hookimpl, patches
from vllm_hybrid_backends.patches import patch_vllm_ascend_worker_worker as ascend_patch
from vllm_hybrid_backends.patches import patch_vllm_platforms as platform_patch
from vllm_hybrid_backends.patches import patch_vllm_v1_worker_mamba_utils as copy_patch
from vllm_hybrid_backends.types import Availability, BackendIdentity, DeviceKind

mamba_utils = pytest.importorskip("vllm.v1.worker.mamba_utils")
kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
layer_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
dispatcher = pytest.importorskip("vllm.triton_utils.dispatcher")


# ---- apply_all with optional patches ---------------------------------------------------------------


def _patch(name, missing=(), optional=False, applied=None):
    return types.SimpleNamespace(__name__=f"x.{name}", PROCESS="worker", OPTIONAL=optional,
                                 missing=lambda: list(missing), apply=lambda: applied.append(name))


def test_an_optional_patch_that_cannot_apply_does_not_block_the_others(monkeypatch):
    applied, logged = [], []
    modules = [_patch("required", applied=applied),
               _patch("optional_absent", ["vllm_ascend is not installed"], True, applied),
               _patch("optional_present", optional=True, applied=applied)]
    monkeypatch.setattr(patches, "patch_modules", lambda process=None: modules)
    monkeypatch.setattr(patches, "_applied", set())
    monkeypatch.setattr(patches, "_announced", set())
    monkeypatch.setattr(patches.logger, "info", lambda msg, *args: logged.append(msg % args))
    assert patches.apply_all("worker") is True
    assert applied == ["required", "optional_present"]
    assert len(logged) == 1  # one line per process: what was applied, what not and why
    assert logged[0].endswith("applied required, optional_present; not needed: optional_absent "
                              "(vllm_ascend is not installed)")


def test_a_required_patch_that_cannot_apply_still_stops_everything(monkeypatch):
    applied = []
    modules = [_patch("required", ["vllm.some.symbol"], applied=applied),
               _patch("optional_present", optional=True, applied=applied)]
    monkeypatch.setattr(patches, "patch_modules", lambda process=None: modules)
    monkeypatch.setattr(patches, "_applied", set())
    assert patches.apply_all("worker") is False
    assert applied == []


def test_the_ascend_patch_is_optional_and_imports_nothing_without_vllm_ascend(monkeypatch):
    real_import = builtins.__import__

    def guarded(name, *args, **kwargs):
        assert not name.startswith(("vllm_ascend", "torch_npu")), f"imported {name}"
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "vllm_ascend", raising=False)
    monkeypatch.setattr(builtins, "__import__", guarded)
    assert ascend_patch.OPTIONAL is True
    assert ascend_patch.missing() == ["vllm_ascend is not installed"]
    assert ascend_patch in patches.patch_modules("worker")


def test_the_ascend_patch_stays_off_when_vllm_ascend_is_not_the_platform(monkeypatch):
    _install_fake_vllm_ascend(monkeypatch, calls=[])

    class CpuPlatform:
        device_name = "cpu"

    monkeypatch.setattr(platform_patch, "_platform_class", lambda: CpuPlatform)
    assert ascend_patch.missing() == [
        f"the current platform ({__name__}.CpuPlatform) is not vllm-ascend's"]


# ---- the reassignment order of vllm-ascend, reproduced ----------------------------------------------

FAKE_KERNEL = "hb_fake_ascend_ops.batch_memcpy_kernel"


def _install_fake_vllm_ascend(monkeypatch, calls):
    """A fake vllm_ascend whose NPUWorker.__init__ re-assigns vLLM's mamba_utils functions."""

    def ascend_collect(copy_bufs, kv_cache_config, copy_funcs, group_ids, src, dst, bias, req, ctx):
        calls.append(("ascend_collect", src, dst))

    def ascend_do(copy_bufs):
        calls.append(("ascend_do",))

    def ascend_preprocess(copy_bufs, kv_cache_config, copy_funcs, group_ids, moves, ctx):
        # like vllm-ascend's preprocess_mamba: looks the collector up on vLLM's module
        for src, dst, bias, req in moves:
            mamba_utils.collect_mamba_copy_meta(copy_bufs, kv_cache_config, copy_funcs, group_ids,
                                                src, dst, bias, req, ctx)

    def ascend_kernel(x):
        calls.append(("ascend_kernel", x))

    class NPUWorker:
        def __init__(self, vllm_config=None, local_rank=0, rank=0, distributed_init_method="",
                     is_driver_worker=False, **kwargs):
            # adapt_patch(): vllm-ascend's worker patches are plain attribute assignments
            mamba_utils.collect_mamba_copy_meta = ascend_collect
            mamba_utils.do_mamba_copy_block = ascend_do
            mamba_utils.preprocess_mamba = ascend_preprocess
            sys.modules["hb_fake_ascend_ops"].batch_memcpy_kernel = ascend_kernel
            self.installed_by_adapt_patch = (mamba_utils.collect_mamba_copy_meta,
                                             mamba_utils.do_mamba_copy_block)

    class NPUPlatform:
        device_name = "npu"

        @classmethod
        def register_triton_kernel_overrides(cls):
            calls.append(("platform_overrides",))

    NPUPlatform.__module__ = "vllm_ascend.platform"
    modules = {name: types.ModuleType(name) for name in
               ("vllm_ascend", "vllm_ascend.worker", "vllm_ascend.worker.worker",
                "vllm_ascend.platform", "hb_fake_ascend_ops")}
    for name, module in modules.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package="." not in name)
        monkeypatch.setitem(sys.modules, name, module)
    modules["vllm_ascend.worker.worker"].NPUWorker = NPUWorker
    modules["vllm_ascend.platform"].NPUPlatform = NPUPlatform
    modules["hb_fake_ascend_ops"].batch_memcpy_kernel = lambda x: calls.append(("vllm_kernel", x))
    return types.SimpleNamespace(NPUWorker=NPUWorker, NPUPlatform=NPUPlatform, collect=ascend_collect,
                                 do=ascend_do, preprocess=ascend_preprocess, kernel=ascend_kernel,
                                 ops=modules["hb_fake_ascend_ops"])


class SpyBackend:
    """Records the state operations and kernel launches that reach it."""

    def __init__(self, calls):
        self.calls = calls

    @hookimpl
    def hb_backend_identity(self):
        return BackendIdentity("spy", DeviceKind.NPU, priority=-1)

    @hookimpl
    def hb_backend_probe(self):
        return Availability(True, "test spy")

    @hookimpl
    def hb_copy_state_blocks(self, states, src_blocks, dst_blocks):
        self.calls.append(("spy_copy", src_blocks.tolist(), dst_blocks.tolist()))

    @hookimpl
    def hb_kernel_overrides(self, platform_name):
        if platform_name != "npu":
            return None
        return {FAKE_KERNEL: lambda x: self.calls.append(("spy_kernel", x))}


def _model():
    """Attention group 0 and two Mamba2 groups (1, 2), one layer each."""
    backend_enum = kv_iface.MambaSpec.__dataclass_fields__["mamba_type"].default
    spec = kv_iface.MambaSpec(block_size=16, shapes=((3, 4), (2, 5)), dtypes=(torch.float32,) * 2,
                              mamba_type=backend_enum, mamba_cache_mode="align")
    attn = kv_iface.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [kv_iface.KVCacheGroupSpec(["attn.0"], attn), kv_iface.KVCacheGroupSpec(["mamba.1"], spec),
              kv_iface.KVCacheGroupSpec(["mamba.2"], spec)]
    config = kv_iface.KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups)
    context = {layer: types.SimpleNamespace(kv_cache=[torch.zeros(10, 3, 4), torch.zeros(10, 2, 5)])
               for layer in ("mamba.1", "mamba.2")}
    funcs = {backend_enum: (layer_utils.get_conv_copy_spec, layer_utils.get_temporal_copy_spec)}
    return config, context, funcs, backend_enum


def _copy_bufs():
    def buf(dtype):
        return types.SimpleNamespace(np=np.zeros(16, dtype=dtype))

    return types.SimpleNamespace(src_ptrs=buf(np.int64), dst_ptrs=buf(np.int64), sizes=buf(np.int32),
                                 offset=0)


@pytest.fixture
def vllm_worker_module(monkeypatch):
    """Every attribute the patches or the fake vllm-ascend touch is restored afterwards."""
    for name in (*copy_patch.TARGET_SYMBOLS, "preprocess_mamba"):
        owner, _, attr = name.rpartition(".")
        host = getattr(mamba_utils, owner) if owner else mamba_utils
        monkeypatch.setattr(host, attr, vars(host)[attr])
    monkeypatch.setattr(patches, "PATCH_MODULES", (platform_patch.__name__, copy_patch.__name__,
                                                   ascend_patch.__name__))
    monkeypatch.setattr(vllm_hybrid_backends, "_registered", False)
    copy_patch._ORIGINALS.clear()
    copy_patch._state_cache.clear()
    yield
    copy_patch._ORIGINALS.clear()
    copy_patch._state_cache.clear()
    copy_patch._pending.clear()
    dispatcher._registry.pop(FAKE_KERNEL, None)


@pytest.mark.parametrize("with_ascend_patch", [pytest.param(True, id="with-ascend-patch"),
                                               pytest.param(False, id="control-without-it")])
def test_backend_is_still_called_after_npu_worker_reassigns_mamba_utils(
        vllm_worker_module, fresh_plugins, monkeypatch, with_ascend_patch):
    calls: list[tuple] = []
    fake = _install_fake_vllm_ascend(monkeypatch, calls)
    monkeypatch.setattr(platform_patch, "_platform_class", lambda: fake.NPUPlatform)
    if not with_ascend_patch:
        monkeypatch.setattr(ascend_patch, "missing", lambda: ["disabled for the control run"])
    fresh_plugins.register_backend(SpyBackend(calls))
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", "spy")
    try:
        # 1. vLLM loads general plugins: our register() wraps the platform hook
        vllm_hybrid_backends.register()
        # 2. WorkerWrapperBase.init_worker: the platform's kernel overrides (ours go in after)
        fake.NPUPlatform.register_triton_kernel_overrides()
        # 3. the worker class is built: vllm-ascend's adapt_patch() re-assigns mamba_utils
        worker = fake.NPUWorker(vllm_config=None, local_rank=0, rank=0, distributed_init_method="")
        assert worker.installed_by_adapt_patch == (fake.collect, fake.do)

        config, context, funcs, backend_enum = _model()
        request = types.SimpleNamespace(block_ids=([0], [2, 3], [7, 8]))
        bufs = _copy_bufs()
        mamba_utils.preprocess_mamba(bufs, config, funcs, [1, 2], [(0, 1, 0, request)], context)
        mamba_utils.do_mamba_copy_block(bufs)
        custom = {backend_enum: (layer_utils.get_conv_copy_spec, lambda *a: None)}
        other_context = dict(context)  # the patch caches its view per forward context
        mamba_utils.collect_mamba_copy_meta(bufs, config, custom, [1, 2], 0, 1, 0, request,
                                            other_context)
        fake.ops.batch_memcpy_kernel("x")
    finally:
        fresh_plugins.unregister_backend("spy")

    if with_ascend_patch:
        assert mamba_utils.preprocess_mamba is fake.preprocess  # vllm-ascend's own stays
        assert mamba_utils.collect_mamba_copy_meta is copy_patch.collect_mamba_copy_meta
        assert copy_patch._ORIGINALS["collect_mamba_copy_meta"] is fake.collect
        assert copy_patch._ORIGINALS["do_mamba_copy_block"] is fake.do
        assert calls == [
            ("platform_overrides",),
            ("spy_copy", [[2], [7]], [[3], [8]]),  # the move reached the selected backend ...
            ("ascend_do",),  # ... then vllm-ascend's flush ran for whatever it collected
            ("ascend_collect", 0, 1),  # unknown copy functions: delegated to vllm-ascend
            ("spy_kernel", "x"),  # the backend's kernel override won over vllm-ascend's kernel
        ]
    else:  # what happens without the patch: vllm-ascend's functions silently take over
        assert calls == [("platform_overrides",), ("ascend_collect", 0, 1), ("ascend_do",),
                         ("ascend_collect", 0, 1), ("ascend_kernel", "x")]


def test_reapplying_the_copy_patch_wraps_the_new_functions_once(vllm_worker_module):
    def replacement_collect(*args):
        return "replacement"

    def replacement_do(copy_bufs):
        return "replacement"

    copy_patch.apply()
    first = dict(copy_patch._ORIGINALS)
    copy_patch.apply()  # nothing changed: no wrapper around our own function
    assert copy_patch._ORIGINALS == first
    assert first["collect_mamba_copy_meta"] is not copy_patch.collect_mamba_copy_meta
    mamba_utils.collect_mamba_copy_meta = replacement_collect
    mamba_utils.do_mamba_copy_block = replacement_do
    copy_patch.apply()
    assert mamba_utils.collect_mamba_copy_meta is copy_patch.collect_mamba_copy_meta
    assert copy_patch._ORIGINALS["collect_mamba_copy_meta"] is replacement_collect
    assert copy_patch._ORIGINALS["do_mamba_copy_block"] is replacement_do


def test_npu_worker_init_is_wrapped_once(monkeypatch, vllm_worker_module):
    fake = _install_fake_vllm_ascend(monkeypatch, calls=[])
    monkeypatch.setattr(platform_patch, "_platform_class", lambda: fake.NPUPlatform)
    reapplied = []
    monkeypatch.setattr(ascend_patch, "reapply_worker_patches", lambda: reapplied.append(1))
    assert ascend_patch.missing() == []
    ascend_patch.apply()
    ascend_patch.apply()
    fake.NPUWorker()
    assert reapplied == [1]
    assert fake.NPUWorker.__init__.__wrapped__.__qualname__.endswith("NPUWorker.__init__")


def test_the_reapply_runs_only_patches_applied_here_and_no_kernel_override_without_dispatcher(
        monkeypatch):
    """vLLM 0.23 / 0.26 (vllm-ascend's pairings): patches this vLLM does not need were never
    applied and have no target, and there is no kernel dispatcher; the re-apply after the real
    NPUWorker.__init__ once tried both and took the worker down (make test-ascend-contract)."""
    applied = []
    modules = [_patch("was_applied", applied=applied), _patch("not_needed_here", applied=applied)]
    monkeypatch.setattr(patches, "patch_modules", lambda process=None: modules)
    monkeypatch.setattr(patches, "_applied", {"was_applied"})
    monkeypatch.setattr(patches, "check", lambda module: patches.PatchStatus(
        module.__name__, "worker", patches.APPLIED if module.__name__ == "x.was_applied"
        else patches.NOT_NEEDED))
    monkeypatch.setattr(platform_patch, "has_worker_seam", lambda: False)
    monkeypatch.setattr(vllm_hybrid_backends.plugins, "kernel_overrides",
                        lambda name: pytest.fail("kernel overrides asked for without a dispatcher"))
    ascend_patch.reapply_worker_patches()
    assert applied == ["was_applied"]
