"""Model shapes from public configs, and vLLM's hybrid block/page-size derivation.

A :class:`ModelShape` holds what the KV cache of a hybrid model depends on: which layers are
attention and which carry a Mamba-style state, the attention KV heads and head size, the state
shapes and dtypes (computed with the same formulas as vLLM's ``MambaStateShapeCalculator``),
and the ``config.json`` fields vLLM reads to build the model's config.

:func:`derive_cache_geometry` mirrors ``Platform._align_hybrid_block_size`` (vLLM 0.32/0.33):
the attention block size is the smallest multiple of the kernel block alignment whose page
(``block_size * 2 * kv_heads * head_size * dtype_bytes`` per layer) holds one Mamba state, and
the Mamba page is padded up to that page. ``tests/replay/test_shapes.py`` checks the shapes and
the CPU result against vLLM's own model classes and platform code.

Config sources (Hugging Face ``config.json`` of each checkpoint):
``Qwen/Qwen3.5-0.8B`` (text config), ``Qwen/Qwen3-Next-80B-A3B-Instruct``,
``nvidia/Nemotron-H-8B-Base-8K``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CacheGeometry",
    "MODEL_SHAPES",
    "ModelShape",
    "PLATFORMS",
    "PlatformBlockRule",
    "StateLayout",
    "derive_cache_geometry",
    "get_shape",
    "tiny_shape",
]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class StateLayout:
    """The state of one Mamba-style layer: one shape and dtype per state tensor.

    ``kind`` is vLLM's ``MambaAttentionBackendEnum`` member name (``GDN_ATTN``, ``MAMBA2``...).
    The conv state comes first with shape ``(state_len, dim)`` (vLLM's default SD layout).
    """

    kind: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    conv_kernel: int
    #: Mamba2 layers export a prefill checkpoint from inside the forward (vLLM 0.32+:
    #: ``MambaMixer2.get_kv_cache_spec`` sets ``num_prefill_checkpoint_blocks=1``).
    prefill_checkpoint: bool = False

    @property
    def page_bytes(self) -> int:
        return sum(math.prod(s) * DTYPE_BYTES[d] for s, d in zip(self.shapes, self.dtypes))


@dataclass(frozen=True)
class ModelShape:
    """One hybrid model's cache-relevant shape (tensor parallel size 1)."""

    name: str
    source: str
    architecture: str
    layer_kinds: tuple[str, ...]  # per layer: "attention", "mamba" or "mlp"
    num_kv_heads: int
    head_size: int
    dtype: str
    state: StateLayout
    #: The config.json vLLM reads (architectures, model_type and the fields above).
    hf_config: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def num_attention_layers(self) -> int:
        return self.layer_kinds.count("attention")

    @property
    def num_mamba_layers(self) -> int:
        return self.layer_kinds.count("mamba")

    @property
    def attention_page_bytes_per_token(self) -> int:
        """K and V of one token in one attention layer."""
        return 2 * self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]

    def with_spec_tokens(self, num_spec: int) -> ModelShape:
        """The shape when speculative decoding keeps ``num_spec`` extra conv positions."""
        if num_spec == 0:
            return self
        conv, *rest = self.state.shapes
        state = StateLayout(
            self.state.kind, ((conv[0] + num_spec, conv[1]), *rest), self.state.dtypes,
            self.state.conv_kernel, self.state.prefill_checkpoint,
        )
        return ModelShape(self.name, self.source, self.architecture, self.layer_kinds,
                          self.num_kv_heads, self.head_size, self.dtype, state, self.hf_config)


def _gdn_state(num_k_heads: int, num_v_heads: int, head_k: int, head_v: int, kernel: int,
               conv_dtype: str, ssm_dtype: str) -> StateLayout:
    # vLLM MambaStateShapeCalculator.gated_delta_net_state_shape (tp=1)
    conv_dim = head_k * num_k_heads * 2 + head_v * num_v_heads
    return StateLayout("GDN_ATTN", ((kernel - 1, conv_dim), (num_v_heads, head_v, head_k)),
                       (conv_dtype, ssm_dtype), kernel)


def _mamba2_state(intermediate: int, n_groups: int, num_heads: int, head_dim: int,
                  state_size: int, kernel: int, conv_dtype: str, ssm_dtype: str) -> StateLayout:
    # vLLM MambaStateShapeCalculator.mamba2_state_shape (tp=1)
    conv_dim = intermediate + 2 * n_groups * state_size
    return StateLayout("MAMBA2", ((kernel - 1, conv_dim), (num_heads, head_dim, state_size)),
                       (conv_dtype, ssm_dtype), kernel, prefill_checkpoint=True)


def _qwen35_08b() -> ModelShape:
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    cfg = {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 3584,
        "layer_types": layer_types * 6, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "vocab_size": 248320, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "mamba_ssm_dtype": "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25},
    }
    kinds = tuple("attention" if t == "full_attention" else "mamba" for t in layer_types * 6)
    return ModelShape("qwen3.5-0.8b", "Qwen/Qwen3.5-0.8B", "Qwen3_5ForCausalLM", kinds, 2, 256,
                      "bfloat16", _gdn_state(16, 16, 128, 128, 4, "bfloat16", "float32"), cfg)


def _qwen3_next_80b() -> ModelShape:
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    kinds = tuple("attention" if (i + 1) % 4 == 0 else "mamba" for i in range(48))
    # The public config has no mamba_ssm_dtype and vLLM has no Qwen3-Next config hook, so on
    # CUDA mamba_ssm_cache_dtype stays "auto": the SSM state takes the model dtype (bfloat16).
    return ModelShape("qwen3-next-80b-a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct",
                      "Qwen3NextForCausalLM", kinds, 2, 256, "bfloat16",
                      _gdn_state(16, 32, 128, 128, 4, "bfloat16", "bfloat16"), cfg)


def _nemotron_h_8b() -> ModelShape:
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    cfg = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hidden_size": 4096, "num_hidden_layers": len(pattern),
        "hybrid_override_pattern": pattern, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
        "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
        "conv_kernel": 4, "expand": 2, "chunk_size": 128, "use_conv_bias": True,
        "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "use_bias": False,
        "use_mamba_kernels": True, "residual_in_fp32": False, "rescale_prenorm_residual": True,
        "vocab_size": 131072, "max_position_embeddings": 8192, "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    kinds = tuple({"M": "mamba", "*": "attention", "-": "mlp"}[c] for c in pattern)
    # vLLM's NemotronHForCausalLMConfig sets the SSM cache dtype to float32 by default.
    return ModelShape("nemotron-h-8b", "nvidia/Nemotron-H-8B-Base-8K", "NemotronHForCausalLM",
                      kinds, 8, 128, "bfloat16",
                      _mamba2_state(8192, 8, 128, 64, 128, 4, "bfloat16", "float32"), cfg)


MODEL_SHAPES: dict[str, ModelShape] = {
    shape.name: shape for shape in (_qwen35_08b(), _qwen3_next_80b(), _nemotron_h_8b())
}


def tiny_shape(layer_kinds: tuple[str, ...] = ("mamba", "mamba", "attention"), *,
               kind: str = "GDN_ATTN", conv_kernel: int = 4) -> ModelShape:
    """A made-up miniature hybrid model (not a real checkpoint) for tests and fuzzing.

    One KV head of size 16 in bfloat16 (64 bytes per token per layer) and a 136-byte Mamba
    state, so any block size from 4 tokens up works with the ``any`` platform rule.
    ``kind="MAMBA2"`` gives the Mamba2 prefill-checkpoint path.
    """
    if kind == "MAMBA2":
        state = _mamba2_state(4, 1, 1, 4, 2, conv_kernel, "bfloat16", "float32")
    elif kind == "GDN_ATTN":
        state = _gdn_state(1, 1, 4, 4, conv_kernel, "bfloat16", "float32")
    else:
        raise ValueError(f"kind must be GDN_ATTN or MAMBA2, got {kind!r}")
    arch = "NemotronHForCausalLM" if kind == "MAMBA2" else "Qwen3NextForCausalLM"
    base = (_nemotron_h_8b() if kind == "MAMBA2" else _qwen3_next_80b()).hf_config
    return ModelShape(f"tiny-{kind.lower()}", "made up (testing)", arch, tuple(layer_kinds), 1,
                      16, "bfloat16", state, base)


def get_shape(name: str) -> ModelShape:
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ValueError(
            f"unknown model shape {name!r}; allowed: {', '.join(MODEL_SHAPES)}, or the path of "
            f"a hybrid model's config.json or its directory"
        ) from None


@dataclass(frozen=True)
class PlatformBlockRule:
    """What ``_align_hybrid_block_size`` reads from the platform and attention backend."""

    name: str
    #: The smallest kernel block size of the attention backend (``MultipleOf(n)``).
    kernel_block: int
    #: ``CacheConfig.block_size`` before alignment (the platform default).
    default_block_size: int


PLATFORMS = {
    # FlashAttention / FlashInfer on CUDA: kernel blocks MultipleOf(16), default block 16.
    "cuda": PlatformBlockRule("cuda", kernel_block=16, default_block_size=16),
    # vLLM's CPU attention backend: MultipleOf(32); the CPU platform defaults to 128.
    "cpu": PlatformBlockRule("cpu", kernel_block=32, default_block_size=128),
    # No kernel constraint: any block size whose page holds a state (tests, fuzzing).
    "any": PlatformBlockRule("any", kernel_block=1, default_block_size=1),
}


@dataclass(frozen=True)
class CacheGeometry:
    """Block and page sizes of a hybrid model's KV cache, as vLLM derives them."""

    block_size: int
    attention_page_bytes: int
    mamba_page_bytes: int
    mamba_page_padded: int

    @property
    def mamba_padding_pct(self) -> float:
        return 100.0 * (self.mamba_page_padded - self.mamba_page_bytes) / self.mamba_page_bytes


def derive_cache_geometry(shape: ModelShape, platform: str = "cuda",
                          block_size: int | None = None) -> CacheGeometry:
    """Block size and pages as ``Platform._align_hybrid_block_size`` computes them.

    ``block_size`` forces a size (like ``--block-size``); vLLM still raises it if one page
    cannot hold a Mamba state, and so does this function.
    """
    try:
        rule = PLATFORMS[platform]
    except KeyError:
        raise ValueError(f"unknown platform {platform!r}; allowed: {', '.join(PLATFORMS)}") from None
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    per_token = shape.attention_page_bytes_per_token
    mamba_page = shape.state.page_bytes
    start = block_size if block_size is not None else rule.default_block_size
    alignment = max(rule.kernel_block, start)
    needed = alignment * math.ceil(mamba_page / (alignment * per_token))
    needed = rule.kernel_block * math.ceil(needed / rule.kernel_block)
    final = max(start, needed)
    return CacheGeometry(final, final * per_token, mamba_page, final * per_token)
