"""Model shapes and the hybrid block/page-size derivation, checked against vLLM itself."""

from __future__ import annotations

import copy

import pytest

from vllm_hybrid_backends.compat import version_allows
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


def _skip_bf16_recurrent_state(name: str) -> None:
    if name.startswith("qwen3.5") and version_allows("<0.26"):
        pytest.skip("vLLM 0.23 keeps Qwen3.5's recurrent state in bfloat16 (0.26+: float32); the "
                    "harness's shape and the replay's pool geometry follow 0.26+")


@pytest.mark.slow
@pytest.mark.parametrize("name", SHAPES)
def test_state_shapes_and_block_sizes_match_vllms_own_code(name):
    """vLLM's model class gives the same state shapes/dtypes; its CPU platform the same block."""
    _skip_bf16_recurrent_state(name)
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


def _force_host_cpu(monkeypatch, *, accelerated: bool) -> None:
    """Make this host look like a CPU with (or without) AVX-512 BF16, AMX and many threads."""
    import torch
    import vllm.platforms.cpu

    from vllm_hybrid_backends.replay import engine_config

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: accelerated)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: accelerated)
    monkeypatch.setattr(vllm.platforms.cpu, "get_max_threads",
                        lambda pid=0: 96 if accelerated else 2)
    if accelerated:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    else:
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(engine_config, "_VLLM_CONFIGS", {})  # build it again, on this "host"


def _derived(shape):
    """Everything the harness derives from vLLM's config for ``shape``, as comparable values."""
    from vllm.model_executor.models import ModelRegistry

    from vllm_hybrid_backends.replay.engine_config import KVLayout, build_engine_setup

    geometry = derive_cache_geometry(shape, "cuda")
    setup = build_engine_setup(
        shape, KVLayout(geometry.block_size, 64, geometry.mamba_page_padded),
        max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=8192)
    config = setup.vllm_config
    model_cls, _ = ModelRegistry.resolve_model_cls(config.model_config.architecture,
                                                   model_config=config.model_config)
    return {
        "ssm_cache_dtype": config.cache_config.mamba_ssm_cache_dtype,
        "conv_cache_dtype": config.cache_config.mamba_cache_dtype,
        "model_state_dtypes": tuple(str(d).removeprefix("torch.")
                                    for d in model_cls.get_mamba_state_dtype_from_config(config)),
        "model_state_shapes": tuple(map(tuple, model_cls.get_mamba_state_shape_from_config(config))),
        "block_sizes": (setup.scheduler_block_size, setup.hash_block_size,
                        config.cache_config.block_size, config.cache_config.mamba_block_size),
        "pool": (setup.pool_bytes, setup.kv_cache_config.num_blocks),
        "groups": [repr(g.kv_cache_spec) for g in setup.kv_cache_config.kv_cache_groups],
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", SHAPES)
def test_config_derivation_does_not_depend_on_the_host_cpu(name, monkeypatch):
    _skip_bf16_recurrent_state(name)
    """AVX-512 BF16 / AMX hosts (vLLM-CPU then changes Mamba dtypes) derive what others do."""
    import os

    shape = get_shape(name)
    seen, environment_changes = {}, {}
    for accelerated in (True, False):
        with monkeypatch.context() as patch:
            _force_host_cpu(patch, accelerated=accelerated)
            before = dict(os.environ)
            seen[accelerated] = _derived(shape)
            environment_changes[accelerated] = {
                k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k)}
    assert seen[True] == seen[False]
    assert seen[True]["model_state_dtypes"] == shape.state.dtypes
    assert seen[True]["model_state_shapes"] == shape.state.shapes
    assert environment_changes == {True: set(), False: set()}


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items()
                if k not in ("sched_step_us_median", "sched_step_us_runs", "wall_s")}
    return value


@pytest.mark.slow
def test_replay_json_is_the_same_on_any_host_cpu(monkeypatch, capsys):
    import json

    from vllm_hybrid_backends.cli import main

    outputs = {}
    for accelerated in (True, False):
        with monkeypatch.context() as patch:
            _force_host_cpu(patch, accelerated=accelerated)
            assert main(["replay", "--json", "--workload", "short",
                         "--model-shape", "qwen3-next-80b-a3b"]) == 0
            outputs[accelerated] = json.loads(capsys.readouterr().out)
    assert outputs[True]["policies"]["upstream"]["sched_step_us_median"] > 0  # timings present
    assert _without_timings(outputs[True]) == _without_timings(outputs[False])
