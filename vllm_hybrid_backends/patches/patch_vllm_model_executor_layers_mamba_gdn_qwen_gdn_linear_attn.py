"""Store gated-delta-net states inside a prefill chunk on the device (Triton/FLA) path.

- Target: ``vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention._forward_core``
  (conv + recurrence of Qwen3-Next / Qwen3.5 GDN layers on CUDA and ROCm; every prefill goes
  through it, AITER's ROCm path included).
- Why: the KV-cache manager gives the plugin's tail checkpoints blocks inside a prefill chunk
  instead of splitting it (``patch_vllm_v1_core_kv_cache_coordinator``); vLLM's forward writes
  only each row's final state.
- How: where the GDN metadata carries a device plan
  (``patch_vllm_v1_attention_backends_gdn_attn``: destinations gathered from the block table on
  the device, ``-1`` where the manager left the null block), vLLM's ``_forward_core`` runs
  unchanged inside ``capturing_chunk_states``
  (``patch_vllm_third_party_flash_linear_attention_ops_chunk``), which keeps the per-chunk
  states FLA's chunked recurrence computes; then one ``hb_store_checkpoints`` call stores, for
  every planned boundary, the conv window from the pre-conv input ``mixed_qkv`` and the
  recurrent state from FLA's ``h`` (cast to the cache dtype). Without a plan vLLM's function
  runs alone. A plan whose forward ran no FLA chunk kernel (another prefill backend) raises
  rather than leave planned blocks unwritten; the handshake keeps the engine from planning
  there (:func:`vllm_hybrid_backends.handshake.forward_limits`).
- Upstream: none.
- vLLM versions: 0.32.x, 0.33.x (same ``_forward_core(self, mixed_qkv, b, a, core_attn_out)``);
  not needed before (no ``layers/mamba/gdn`` package).
- Removal: when vLLM stores GDN states at several boundaries of a prefill chunk itself.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from ..compat import signature_problem

TARGET_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
TARGET_SYMBOLS = ("QwenGatedDeltaNetAttention._forward_core",)
PROCESS = "worker"
VLLM_VERSIONS = ">=0.32.0,<0.34.0"
#: A failed check (FLA or the GDN layer changed) leaves this feature off, the rest of the
#: plugin on: the workers then report no GDN interior states and the engine splits chunks.
OPTIONAL = True

LAYOUT_MODULE = "vllm.model_executor.layers.mamba.mamba_utils"

_ORIGINALS: dict[str, Any] = {}


def _layer_class() -> Any:
    return importlib.import_module(TARGET_MODULE).QwenGatedDeltaNetAttention


def not_needed() -> str | None:
    from ..compat import version_allows

    if not version_allows(">=0.32"):
        return ("the device GDN interior states are written for vLLM 0.32+ (the engine plans "
                "none before): gated-delta-net tail states cost chunk splits on devices")
    if importlib.util.find_spec("vllm.model_executor.layers.mamba.gdn") is not None:
        return None
    return ("this vLLM has no layers/mamba/gdn package (0.23/0.26): gated-delta-net tail "
            "states cost chunk splits on devices")


def missing() -> list[str]:
    try:
        cls = _layer_class()
        importlib.import_module(LAYOUT_MODULE).is_conv_state_dim_first  # noqa: B018
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    function = _ORIGINALS.get("_forward_core", getattr(cls, "_forward_core", None))
    if function is None:
        return [f"{TARGET_MODULE}.{TARGET_SYMBOLS[0]}"]
    problem = signature_problem(function, f"{TARGET_MODULE}.{TARGET_SYMBOLS[0]}",
                                ("self", "mixed_qkv", "b", "a", "core_attn_out"))
    return [problem] if problem else []


def is_applied() -> bool:
    try:
        return _layer_class()._forward_core is _forward_core
    except Exception:
        return False


def _plan_of(layer: Any) -> Any:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    from .patch_vllm_v1_attention_backends_gdn_attn import DEVICE_PLAN_ATTR

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict):
        return None
    return getattr(metadata.get(layer.prefix), DEVICE_PLAN_ATTR, None)


def store_interior_states(layer: Any, plan: Any, mixed_qkv: Any, chunk_states: Any) -> None:
    """Store ``plan`` (an :class:`~vllm_hybrid_backends.interior.InteriorPlan`): conv windows
    from the token-major pre-conv input ``mixed_qkv``, recurrent states from FLA's ``h``
    (``[1, chunks, heads, v, k]``) into ``layer.kv_cache``."""
    from .. import plugins
    from ..types import MambaStateTensor, StateKind

    conv_state, ssm_state = layer.kv_cache[0], layer.kv_cache[1]
    if importlib.import_module(LAYOUT_MODULE).is_conv_state_dim_first():
        conv = MambaStateTensor(conv_state, StateKind.CONV_DS)
    else:
        conv = MambaStateTensor(conv_state, StateKind.CONV_SD)
    plugins.store_checkpoints([conv, MambaStateTensor(ssm_state, StateKind.TEMPORAL)],
                              [mixed_qkv, chunk_states[0]], plan.batch)


def _forward_core(self: Any, mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any) -> Any:
    from .patch_vllm_third_party_flash_linear_attention_ops_chunk import capturing_chunk_states

    original = _ORIGINALS["_forward_core"]
    plan = _plan_of(self)
    if plan is None:
        return original(self, mixed_qkv, b, a, core_attn_out)
    with capturing_chunk_states() as captured:
        result = original(self, mixed_qkv, b, a, core_attn_out)
    if len(captured) != 1:
        raise RuntimeError(
            f"GDN layer {self.prefix}: interior states are planned but its prefill ran "
            f"{len(captured)} FLA chunk recurrences (one expected; prefill backend "
            f"{getattr(self, 'gdn_prefill_backend', '?')!r})")
    store_interior_states(self, plan, mixed_qkv, captured[0])
    return result


def apply() -> None:
    cls = _layer_class()
    if cls._forward_core is not _forward_core:
        _ORIGINALS["_forward_core"] = cls._forward_core
        cls._forward_core = _forward_core


def revert() -> None:
    if "_forward_core" in _ORIGINALS:
        _layer_class()._forward_core = _ORIGINALS.pop("_forward_core")
