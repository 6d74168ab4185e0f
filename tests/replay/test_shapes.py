"""Model shapes and the hybrid block/page-size derivation, checked against vLLM itself."""

from __future__ import annotations

import copy

import pytest

from vllm_hybrid_backends.replay.shapes import (
    MODEL_SHAPES,
    ModelShape,
    _gdn_state,
    derive_cache_geometry,
    get_shape,
)

SHAPES = [pytest.param(name, id=name) for name in MODEL_SHAPES]


def test_required_shapes_are_bundled():
    assert {"qwen3.5-0.8b", "qwen3-next-80b-a3b", "nemotron-h-8b"} <= set(MODEL_SHAPES)


@pytest.mark.parametrize(("name", "attention", "mamba"), [
    pytest.param("qwen3.5-0.8b", 6, 18, id="qwen3.5-0.8b"),
    pytest.param("qwen3-next-80b-a3b", 12, 36, id="qwen3-next-80b-a3b"),
    pytest.param("nemotron-h-8b", 4, 24, id="nemotron-h-8b"),
])
def test_layer_counts_match_the_public_configs(name, attention, mamba):
    shape = get_shape(name)
    assert (shape.num_attention_layers, shape.num_mamba_layers) == (attention, mamba)
    assert len(shape.layer_kinds) == shape.hf_config["num_hidden_layers"]


def test_cuda_rule_reproduces_the_block_size_users_report_for_qwen35_4b():
    # vllm#40696: Qwen3.5-4B gets 528-token blocks (4 KV heads x 256, GDN 16/32 heads x 128,
    # fp32 SSM state): 4 * 256 * 2 * 2 B/token; state 49 152 + 2 097 152 B -> 524 -> 528.
    shape = ModelShape("qwen3.5-4b", "", "Qwen3_5ForCausalLM", ("attention", "mamba"), 4, 256,
                       "bfloat16", _gdn_state(16, 32, 128, 128, 4, "bfloat16", "float32"))
    assert derive_cache_geometry(shape, "cuda").block_size == 528


@pytest.mark.parametrize(("name", "block"), [
    pytest.param("qwen3.5-0.8b", 544, id="qwen3.5-0.8b"),
    pytest.param("qwen3-next-80b-a3b", 544, id="qwen3-next-80b-a3b"),
    pytest.param("nemotron-h-8b", 1040, id="nemotron-h-8b"),
])
def test_cuda_block_sizes(name, block):
    geometry = derive_cache_geometry(get_shape(name), "cuda")
    assert geometry.block_size == block
    assert geometry.mamba_page_padded == geometry.attention_page_bytes >= geometry.mamba_page_bytes


def test_a_forced_block_size_is_raised_only_when_a_page_cannot_hold_a_state():
    shape = get_shape("qwen3.5-0.8b")
    assert derive_cache_geometry(shape, "cuda", block_size=16).block_size == 544
    assert derive_cache_geometry(shape, "cuda", block_size=1024).block_size == 1024


def test_bad_names_and_sizes_are_rejected():
    with pytest.raises(ValueError, match="unknown model shape 'x'; allowed: qwen3.5-0.8b"):
        get_shape("x")
    with pytest.raises(ValueError, match="unknown platform 'tpu'; allowed: cuda, cpu, any"):
        derive_cache_geometry(get_shape("qwen3.5-0.8b"), "tpu")
    with pytest.raises(ValueError, match="block size must be positive, got 0"):
        derive_cache_geometry(get_shape("qwen3.5-0.8b"), "cuda", block_size=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", SHAPES)
def test_state_shapes_and_block_sizes_match_vllms_own_code(name):
    """vLLM's model class gives the same state shapes/dtypes; its CPU platform the same block."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from vllm_hybrid_backends.replay.engine_config import vllm_config_for

    shape = get_shape(name)
    config = copy.deepcopy(vllm_config_for(shape))
    model_cls, _ = ModelRegistry.resolve_model_cls(config.model_config.architecture,
                                                   model_config=config.model_config)
    assert tuple(map(tuple, model_cls.get_mamba_state_shape_from_config(config))) == \
        shape.state.shapes
    dtypes = tuple(str(d).removeprefix("torch.")
                   for d in model_cls.get_mamba_state_dtype_from_config(config))
    assert dtypes == shape.state.dtypes
    config.cache_config.block_size = 128  # the CPU platform's default, before alignment
    config.cache_config.mamba_page_size_padded = None
    CpuPlatform._align_hybrid_block_size(config, CPUAttentionBackend)
    ours = derive_cache_geometry(shape, "cpu")
    assert config.cache_config.block_size == ours.block_size
    assert config.cache_config.mamba_block_size == ours.block_size
    assert (config.cache_config.mamba_page_size_padded or ours.mamba_page_bytes) == \
        ours.mamba_page_padded
