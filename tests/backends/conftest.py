"""Fixtures shared by the backend tests."""

from __future__ import annotations

import importlib
import os

import pytest


@pytest.fixture(scope="module")
def interpreted_kernels():
    """The Triton kernels rebuilt for the interpreter (CPU tensors), rebuilt normally afterwards.

    ``TRITON_INTERPRET`` is read when a kernel is defined, so it is set only while the module is
    (re)imported: engine subprocesses started by other tests never inherit it.
    """
    pytest.importorskip("triton")
    from vllm_hybrid_backends.backends.triton import kernels as shared

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.reload(shared)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    assert shared.INTERPRETED
    yield shared
    importlib.reload(shared)
