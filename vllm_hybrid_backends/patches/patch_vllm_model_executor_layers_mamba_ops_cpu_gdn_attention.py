"""Keep vLLM-CPU's gated-delta-net conv window right when a verify step has fewer drafts.

- Target: ``vllm.model_executor.layers.mamba.ops.cpu.gdn_attention._spec_forward`` (the CPU
  GDN forward for speculative-decoding rows, called by ``_cpu_gdn_attention_spec_aware``).
- Why: with speculative decoding a GDN conv state holds ``width - 1 + num_spec`` positions and the
  window for "``a`` tokens accepted" starts at position ``a - 1``. vLLM-CPU rolls the buffer as if
  every verify step had ``1 + num_spec`` tokens. vLLM-CPU disables async scheduling, so drafts are
  never padded and an n-gram drafter proposes fewer tokens (often none) whenever it finds a
  shorter match: the roll then leaves stale positions between the history and the new tokens
  (wrong outputs), and when more tokens were accepted than the step has it fails outright
  (``RuntimeError: The size of tensor a (6) must match the size of tensor b (3)``). Speculative
  decoding of Qwen3.5 / Qwen3-Next on CPU, with or without prefix caching, is unusable with an
  n-gram drafter.
- How: steps where every row has ``1 + num_spec`` tokens run vLLM's function unchanged. Otherwise
  the conv part runs here, per row: the window at ``num_accepted - 1``, the causal conv over
  window + new tokens, and the buffer rewritten as the window's newest ``width - 2`` positions
  followed by the new tokens (the layout the next step, the align-mode pre-copy shift and the
  boundary save all read); the remaining positions are scratch. The recurrent update is vLLM's
  own CPU op, called as vLLM calls it.
- Upstream: fixed in vLLM 0.33.0, whose ``_spec_forward`` rolls the buffer the same way and keeps
  the native kernel for full-length steps only.
- vLLM versions: 0.32.x only; on 0.33.x ``apply()`` leaves vLLM's function in place.
- Removal: with 0.32 support.
"""

from __future__ import annotations

import importlib
from typing import Any

TARGET_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
TARGET_SYMBOLS = ("_spec_forward",)
PROCESS = "worker"

FIXED_IN = "0.33.0"

_ORIGINALS: dict[str, Any] = {}
_NEEDED = ("_spec_forward", "_unpacked_conv_weight", "ops")


def _module() -> Any:
    return importlib.import_module(TARGET_MODULE)


def missing() -> list[str]:
    try:
        module = _module()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    problems = [f"{TARGET_MODULE}.{name}" for name in _NEEDED if not hasattr(module, name)]
    ops = getattr(module, "ops", None)
    if ops is not None and not hasattr(ops, "fused_sigmoid_gating_delta_rule_update_spec_cpu"):
        problems.append("vllm._custom_ops.fused_sigmoid_gating_delta_rule_update_spec_cpu")
    return problems


def roll_conv_window(window: Any, conv_input: Any, width: int) -> None:
    """After a verify step: positions ``[0, width - 2 + q)`` get the newest ``width - 2``
    history inputs followed by the step's ``q`` inputs (``conv_input`` is window + inputs)."""
    window[:, : conv_input.shape[1] - 1].copy_(conv_input[:, 1:])


def _spec_forward(layer: Any, attn_metadata_i: Any, mixed_qkv_spec: Any, b_spec: Any, a_spec: Any,
                  conv_buf: Any, ssm_state: Any, width: int, state_len: int) -> Any:
    import torch
    import torch.nn.functional as F

    original = _ORIGINALS["_spec_forward"]
    rows = int(attn_metadata_i.num_spec_decodes)
    query_start = attn_metadata_i.spec_query_start_loc[: rows + 1]
    lengths = [int(n) for n in (query_start[1:] - query_start[:-1]).tolist()]
    full = state_len - width + 2  # 1 + num_spec
    if all(n == full for n in lengths):
        return original(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state,
                        width, state_len)

    module = _module()
    weight = module._unpacked_conv_weight(layer).unsqueeze(1)
    bias = layer.conv1d.bias
    channels = mixed_qkv_spec.shape[-1]
    starts = [int(s) for s in query_start[:-1].tolist()]
    slots = [int(s) for s in attn_metadata_i.spec_state_indices_tensor[:rows, 0].tolist()]
    accepted = [int(a) for a in attn_metadata_i.num_accepted_tokens[:rows].tolist()]
    conv_out = torch.empty_like(mixed_qkv_spec)
    for start, length, slot, count in zip(starts, lengths, slots, accepted):
        if length == 0:
            continue
        window = conv_buf[slot]  # (dim, state_len)
        new = mixed_qkv_spec[start : start + length].transpose(0, 1).to(window.dtype)
        offset = count - 1
        conv_input = torch.cat([window[:, offset : offset + width - 1], new], dim=-1)
        out = F.conv1d(conv_input.unsqueeze(0).to(weight.dtype), weight, bias, groups=channels)[0]
        if layer.activation == "silu":
            out = F.silu(out)
        conv_out[start : start + length] = out.transpose(0, 1).to(conv_out.dtype)
        roll_conv_window(window, conv_input, width)

    query, key, value = layer.rearrange_mixed_qkv(conv_out)
    return module.ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
        A_log=layer.A_log,
        dt_bias=layer.dt_bias,
        q=query.squeeze(0),
        k=key.squeeze(0),
        v=value.squeeze(0),
        a=a_spec,
        b=b_spec,
        initial_state_source=ssm_state,
        spec_state_indices=attn_metadata_i.spec_state_indices_tensor[:rows].to(torch.int32).contiguous(),
        num_accepted_tokens=attn_metadata_i.num_accepted_tokens[:rows].to(torch.int32).contiguous(),
        cu_seqlens=query_start.to(torch.int32).contiguous(),
        use_qk_l2norm_in_kernel=True,
    )


def needed(vllm_version: str | None) -> bool:
    """Whether this vLLM has the fixed-length roll (releases before :data:`FIXED_IN`)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(Version(vllm_version or "").base_version) < Version(FIXED_IN)
    except InvalidVersion:
        return False


def apply() -> None:
    from ..compat import installed_vllm_version

    module = _module()
    current = module._spec_forward
    if current is _spec_forward or not needed(installed_vllm_version()):
        return
    _ORIGINALS["_spec_forward"] = current
    module._spec_forward = _spec_forward
