"""Backend registration, selection, delegation and entry-point discovery."""

from __future__ import annotations

import importlib.metadata
import types

import pytest
import torch

from vllm_hybrid_backends import hookimpl
from vllm_hybrid_backends.types import (
    Availability,
    BackendIdentity,
    DeviceKind,
    MambaStateTensor,
    StateKind,
)


def make_backend(name, *, device=DeviceKind.CPU, priority=50, available=True, copy=None, overrides=None):
    """A fake backend plugin; ``copy`` becomes its hb_copy_state_blocks."""
    ns = types.SimpleNamespace()

    @hookimpl
    def hb_backend_identity():
        return BackendIdentity(name, device, priority)

    @hookimpl
    def hb_backend_probe():
        return Availability(available, "fake says yes" if available else "fake device missing")

    ns.hb_backend_identity = hb_backend_identity
    ns.hb_backend_probe = hb_backend_probe
    if copy is not None:
        ns.hb_copy_state_blocks = hookimpl(copy)
    if overrides is not None:
        ns.hb_kernel_overrides = hookimpl(lambda platform_name: overrides)
    return ns


@pytest.fixture
def registered(fresh_plugins):
    """Register fake backends for one test; always unregistered afterwards."""
    names = []

    def register(plugin):
        names.append(fresh_plugins.register_backend(plugin))
        return names[-1]

    yield register
    for name in names:
        fresh_plugins.unregister_backend(name)


def test_builtin_backends_are_registered_with_reasons(fresh_plugins):
    statuses = {s.name: s for s in fresh_plugins.backend_statuses()}
    assert list(statuses) == ["cpu", "cuda", "rocm", "ascend"]
    assert statuses["cpu"].availability.available
    for name in ("cuda", "rocm", "ascend"):
        assert not statuses[name].availability.available
        assert statuses[name].availability.reason


def test_builtin_backends_implement_every_hook_themselves(fresh_plugins):
    statuses = {s.name: s for s in fresh_plugins.backend_statuses()}
    for name in ("cpu", "cuda", "rocm", "ascend"):
        assert set(statuses[name].hooks.values()) == {name}, statuses[name].hooks


def test_a_backend_without_kernel_overrides_reports_none(registered, fresh_plugins):
    registered(make_backend("bare", priority=-1))
    status = {s.name: s for s in fresh_plugins.backend_statuses()}["bare"]
    assert status.hooks["hb_kernel_overrides"] == "none"
    assert status.hooks["hb_store_checkpoints"] == "cpu"


def test_auto_selects_cpu_here(fresh_plugins):
    assert fresh_plugins.selected_backend() == "cpu"


def test_invalid_backend_names_the_allowed_values(fresh_plugins, monkeypatch):
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", "bogus")
    with pytest.raises(fresh_plugins.BackendSelectionError, match="'bogus'.*allowed values: auto, cpu, cuda, rocm, ascend"):
        fresh_plugins.selected_backend()


@pytest.mark.parametrize("cuda_torch, reason", [
    pytest.param(False, "torch is not a CUDA build", id="cpu-torch"),
    pytest.param(True, r"no CUDA device visible \(check CUDA_VISIBLE_DEVICES\)", id="cuda-torch-no-gpu"),
])
def test_unavailable_backend_is_an_error_with_its_reason(fresh_plugins, monkeypatch, cuda_torch, reason):
    from vllm_hybrid_backends.backends.triton import backend

    # the same on every host, whichever torch build it has
    monkeypatch.setitem(backend._TORCH_BUILDS, "cuda", lambda: cuda_torch)
    monkeypatch.setattr(backend, "gpu_count", lambda: 0)
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", "cuda")
    with pytest.raises(fresh_plugins.BackendSelectionError, match=f"'cuda' is not available here: {reason}$"):
        fresh_plugins.selected_backend()


def test_explicit_selection_is_case_insensitive(fresh_plugins, monkeypatch):
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", " CPU ")
    assert fresh_plugins.selected_backend() == "cpu"


def test_auto_prefers_the_highest_priority_backend_for_the_device(registered, fresh_plugins):
    registered(make_backend("fast_cpu", priority=10))
    registered(make_backend("faster_cpu", priority=20))
    registered(make_backend("broken_cpu", priority=99, available=False))
    registered(make_backend("gpu_thing", device=DeviceKind.CUDA, priority=1000))
    assert fresh_plugins.selected_backend() == "faster_cpu"


def test_selected_backend_runs_its_hook_and_delegates_the_rest(registered, fresh_plugins, monkeypatch):
    calls = []

    def copy(states, src_blocks, dst_blocks):
        calls.append((src_blocks.tolist(), dst_blocks.tolist()))

    registered(make_backend("spy", copy=copy))
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", "spy")
    tensor = torch.arange(8.0).reshape(4, 2)
    state = MambaStateTensor(tensor, StateKind.TEMPORAL)
    fresh_plugins.copy_state_blocks([state], torch.tensor([[0]]), torch.tensor([[1]]))
    assert calls == [([[0]], [[1]])]
    assert tensor[1].tolist() == [2.0, 3.0]  # the spy did not copy; the reference was not called
    out = fresh_plugins.gather_aligned_state_indices([torch.tensor([[7, 8]])], torch.tensor([5]), 4)
    assert out.tolist() == [[[8]]]  # delegated to cpu
    status = {s.name: s for s in fresh_plugins.backend_statuses()}["spy"]
    assert status.hooks["hb_copy_state_blocks"] == "spy"
    assert status.hooks["hb_gather_aligned_state_indices"] == "cpu"


def test_a_selector_plugin_can_impose_its_policy(registered, fresh_plugins):
    registered(make_backend("chosen", priority=-5))

    class Selector:
        @hookimpl(tryfirst=True)
        def hb_select_backend(self, requested, device_kind, candidates):
            assert requested == "auto" and device_kind == "cpu"
            return "chosen"

    pm = fresh_plugins.get_plugin_manager()
    pm.register(Selector(), name="selector")
    fresh_plugins.forget_selection()
    try:
        assert fresh_plugins.selected_backend() == "chosen"
    finally:
        pm.unregister(name="selector")
        fresh_plugins.forget_selection()


def test_registering_a_backend_twice_is_an_error(registered):
    registered(make_backend("twin"))
    with pytest.raises(ValueError, match="'twin' is already registered"):
        registered(make_backend("twin"))


def test_entry_point_backends_are_discovered(fresh_plugins, monkeypatch):
    module = types.ModuleType("fake_hybrid_backend_ep")
    backend = make_backend("from_entry_point", priority=7)
    module.hb_backend_identity = backend.hb_backend_identity
    module.hb_backend_probe = backend.hb_backend_probe
    monkeypatch.setitem(__import__("sys").modules, "fake_hybrid_backend_ep", module)
    entry_point = importlib.metadata.EntryPoint(
        name="from_entry_point", value="fake_hybrid_backend_ep", group=fresh_plugins.ENTRY_POINT_GROUP
    )
    real = importlib.metadata.entry_points

    def entry_points(**kwargs):
        if kwargs.get("group") == fresh_plugins.ENTRY_POINT_GROUP:
            return importlib.metadata.EntryPoints([entry_point])
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    fresh_plugins.reset()
    names = fresh_plugins.backend_names()
    assert "from_entry_point" in names
    assert fresh_plugins.selected_backend() == "from_entry_point"  # priority 7 > cpu's 0


def test_a_broken_entry_point_is_logged_not_fatal(fresh_plugins, monkeypatch):
    entry_point = importlib.metadata.EntryPoint(
        name="broken", value="no_such_module_for_hybrid_backends", group=fresh_plugins.ENTRY_POINT_GROUP
    )
    real = importlib.metadata.entry_points
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda **kw: importlib.metadata.EntryPoints([entry_point]) if kw.get("group") == fresh_plugins.ENTRY_POINT_GROUP else real(**kw),
    )
    fresh_plugins.reset()
    assert fresh_plugins.backend_names() == ["cpu", "cuda", "rocm", "ascend"]


def test_kernel_overrides_come_only_from_the_selected_backend(registered, fresh_plugins, monkeypatch):
    impl = object()
    registered(make_backend("with_kernels", priority=-1, overrides={"some.module.kernel": impl}))
    assert fresh_plugins.kernel_overrides("cpu") == {}  # cpu selected: it overrides nothing
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", "with_kernels")
    fresh_plugins.forget_selection()
    assert fresh_plugins.kernel_overrides("cpu") == {"some.module.kernel": impl}
