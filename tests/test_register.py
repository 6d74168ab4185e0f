"""``register()``: idempotent, version-gated (warn once, patch nothing outside the range)."""

from __future__ import annotations

import pytest

import vllm_hybrid_backends
from vllm_hybrid_backends import compat, patches


@pytest.fixture
def registration(monkeypatch):
    """Fresh registration state; records apply_all calls and warnings instead of acting."""
    monkeypatch.setattr(vllm_hybrid_backends, "_registered", False)
    monkeypatch.setattr(vllm_hybrid_backends, "_unsupported_warned", False)
    calls, warnings = [], []
    monkeypatch.setattr(patches, "apply_all", lambda process: calls.append(process) or True)
    from vllm_hybrid_backends import logs

    monkeypatch.setattr(logs.logger, "warning", lambda msg, *args: warnings.append(msg % args))
    return calls, warnings


@pytest.mark.parametrize("seam", [True, False], ids=["worker-hook", "no-worker-hook"])
@pytest.mark.parametrize("version", ["0.23.0", "0.23.1", "0.26.0", "0.30.0", "0.31.1", "0.32.0", "0.32.0+cpu",
                                     "0.33.0", "0.33.4.dev12"])
def test_supported_versions_apply_the_engine_patches_once(registration, monkeypatch, version, seam):
    from vllm_hybrid_backends.patches import patch_vllm_platforms

    calls, warnings = registration
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: version)
    monkeypatch.setattr(patch_vllm_platforms, "has_worker_seam", lambda: seam)
    vllm_hybrid_backends.register()
    vllm_hybrid_backends.register()
    # Without the platform's worker-side hook (vLLM 0.30) register() installs the worker patches too.
    assert calls == (["engine"] if seam else ["engine", "worker"])
    assert warnings == []


@pytest.mark.parametrize("version", ["0.22.0", "0.24.0", "0.25.1", "0.27.0", "0.29.9", "0.34.0",
                                     "1.0.0", "not-a-version", None])
def test_unsupported_versions_warn_once_and_patch_nothing(registration, monkeypatch, version):
    calls, warnings = registration
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: version)
    vllm_hybrid_backends.register()
    monkeypatch.setattr(vllm_hybrid_backends, "_registered", False)  # as if called again
    vllm_hybrid_backends.register()
    assert calls == []
    assert len(warnings) == 1
    assert compat.SUPPORTED_VLLM_TEXT in warnings[0]
    if version:
        assert version in warnings[0]


def test_installed_vllm_is_supported():
    assert compat.is_supported(compat.installed_vllm_version())
