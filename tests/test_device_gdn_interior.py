"""The gated-delta-net layer wrap of the device path: it reads the step's plan from vLLM's
forward context, keeps the per-chunk states of the one FLA recurrence its prefill runs, and
stores the planned boundaries from them (vLLM's FLA kernels themselves, interpreted, are in
tests/backends/test_triton_interior.py)."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_hybrid_backends import compat, interior, plugins
from vllm_hybrid_backends.patches import (
    patch_vllm_model_executor_layers_mamba_gdn_qwen_gdn_linear_attn as gdn_layer,
)
from vllm_hybrid_backends.patches import (
    patch_vllm_third_party_flash_linear_attention_ops_chunk as fla_wrap,
)
from vllm_hybrid_backends.patches import patch_vllm_v1_attention_backends_gdn_attn as gdn_plan
from vllm_hybrid_backends.types import CheckpointBatch

pytest.importorskip("vllm.third_party.flash_linear_attention.ops.chunk")
forward_context = pytest.importorskip("vllm.forward_context")

PREFIX = "model.layers.3.linear_attn"


def _plan(dst):
    dst = torch.tensor(dst)
    n = dst.numel()
    batch = CheckpointBatch(token_end=torch.tensor([5, 9])[:n], seq_start=torch.zeros(n, dtype=torch.long),
                            initial_block=torch.full((n,), -1), dst_block=dst,
                            temporal_row=torch.tensor([2, 0])[:n])
    return interior.InteriorPlan(batch, torch.zeros(n, dtype=torch.long), torch.arange(n))


@pytest.fixture
def wrapped(monkeypatch):
    """Both wraps in place over stand-ins: FLA's ``chunk_gated_delta_rule_fwd_h`` returns a
    labelled ``h``; vLLM's ``_forward_core`` calls it ``calls`` times."""
    h = torch.arange(3.0).view(1, 3, 1, 1, 1).expand(1, 3, 2, 2, 2).contiguous()
    monkeypatch.setitem(fla_wrap._ORIGINALS, "chunk_gated_delta_rule_fwd_h",
                        lambda *args, **kwargs: (h, None, None))
    ran = {"calls": 1, "core": 0}

    def vllms_forward_core(self, mixed_qkv, b, a, core_attn_out):
        ran["core"] += 1
        for _ in range(ran["calls"]):
            fla_wrap.chunk_gated_delta_rule_fwd_h(k=None, w=None, u=None)

    monkeypatch.setitem(gdn_layer._ORIGINALS, "_forward_core", vllms_forward_core)
    return ran


def _in_step(monkeypatch, plan):
    metadata = types.SimpleNamespace()
    if plan is not None:
        setattr(metadata, gdn_plan.DEVICE_PLAN_ATTR, plan)
    monkeypatch.setattr(forward_context, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(forward_context, "get_forward_context",
                        lambda: types.SimpleNamespace(attn_metadata={PREFIX: metadata}))


def test_a_planned_step_stores_each_boundary_from_the_captured_chunk_states(wrapped, monkeypatch):
    stored = []
    monkeypatch.setattr(plugins, "store_checkpoints",
                        lambda states, sources, batch: stored.append((states, sources, batch)))
    monkeypatch.setattr(gdn_layer.importlib.import_module(gdn_layer.LAYOUT_MODULE),
                        "is_conv_state_dim_first", lambda: True)
    plan = _plan([11, -1])
    _in_step(monkeypatch, plan)
    conv, ssm = torch.zeros(20, 4, 3), torch.zeros(20, 2, 2, 2)
    layer = types.SimpleNamespace(prefix=PREFIX, kv_cache=(conv, ssm), gdn_prefill_backend="triton")
    mixed_qkv = torch.randn(12, 4)
    gdn_layer._forward_core(layer, mixed_qkv, None, None, None)
    assert wrapped["core"] == 1 and len(stored) == 1
    (conv_state, temporal), (conv_source, chunk_states), batch = stored[0]
    assert conv_state.tensor is conv and conv_state.kind.value == "conv_ds"
    assert temporal.tensor is ssm and conv_source is mixed_qkv and batch is plan.batch
    assert chunk_states[2, 0, 0, 0] == 2  # h[0]: chunk 2's row is the one temporal_row names
    assert fla_wrap._captured is None  # capture closed after the step


def test_without_a_plan_vllms_forward_runs_alone_and_nothing_is_kept(wrapped, monkeypatch):
    monkeypatch.setattr(plugins, "store_checkpoints",
                        lambda *args: pytest.fail("stored without a plan"))
    _in_step(monkeypatch, None)
    layer = types.SimpleNamespace(prefix=PREFIX)
    gdn_layer._forward_core(layer, torch.zeros(3, 4), None, None, None)
    assert wrapped["core"] == 1 and fla_wrap._captured is None


@pytest.mark.parametrize("calls", [pytest.param(0, id="no-fla-call"), pytest.param(2, id="two-fla-calls")])
def test_a_plan_whose_prefill_ran_no_single_fla_recurrence_is_an_error(wrapped, monkeypatch, calls):
    wrapped["calls"] = calls
    _in_step(monkeypatch, _plan([11]))
    layer = types.SimpleNamespace(prefix=PREFIX, gdn_prefill_backend="flashinfer")
    with pytest.raises(RuntimeError, match=f"GDN layer {PREFIX}: interior states are planned but its "
                       f"prefill ran {calls} FLA chunk recurrences .*'flashinfer'"):
        gdn_layer._forward_core(layer, torch.zeros(3, 4), None, None, None)
    assert fla_wrap._captured is None


def test_the_wraps_check_vllms_functions():
    assert fla_wrap.missing() == []
    assert gdn_layer.missing() == []
    original = fla_wrap._module().chunk_gated_delta_rule_fwd_h
    try:
        fla_wrap._ORIGINALS["chunk_gated_delta_rule_fwd_h"] = lambda k, u, w: None
        problems = fla_wrap.missing()
    finally:
        fla_wrap._ORIGINALS.pop("chunk_gated_delta_rule_fwd_h")
    assert fla_wrap._module().chunk_gated_delta_rule_fwd_h is original
    assert len(problems) == 1 and problems[0].startswith(
        f"{fla_wrap.TARGET_MODULE}.chunk_gated_delta_rule_fwd_h changed: expected (k, w, u, g, gk, ")
    assert problems[0].endswith(f"in vLLM {compat.installed_vllm_version()}")


@pytest.mark.parametrize("block_size,planned", [pytest.param(576, 2, id="576-planned"),
                                                pytest.param(544, 0, id="544-not-a-multiple-of-64")])
def test_the_builder_plans_on_a_device_table_without_reading_it(monkeypatch, block_size, planned):
    """A ``meta`` table stands for a device one (no host can read it): the plan is built from
    the host query starts and sequence lengths alone; with a block size FLA's 64-token chunks do
    not reach (vLLM's 544 for the Qwen shapes on CUDA) nothing is planned."""
    built = types.SimpleNamespace(num_prefills=1, num_decodes=0, spec_sequence_masks=None)
    monkeypatch.setitem(gdn_plan._ORIGINALS, "build", lambda self, prefix, m, *a, **k: built)
    builder = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(cache_config=types.SimpleNamespace(mamba_cache_mode="align")),
        kv_cache_spec=types.SimpleNamespace(num_speculative_blocks=0, block_size=block_size))
    common = types.SimpleNamespace(block_table_tensor=torch.zeros(1, 4, dtype=torch.int32, device="meta"),
                                   query_start_loc_cpu=torch.tensor([0, 1200]),
                                   seq_lens_cpu_upper_bound=torch.tensor([1200]))
    metadata = gdn_plan.build(builder, 0, common)
    plan = getattr(metadata, gdn_plan.DEVICE_PLAN_ATTR, None)
    if not planned:
        assert plan is None
        return
    assert plan.batch.dst_block.device.type == "meta" and plan.batch.dst_block.numel() == planned
    assert plan.batch.temporal_row.device.type == "meta"
    assert getattr(metadata, gdn_plan.INTERIOR_ATTR, None) is None  # the host dict is vLLM-CPU's
