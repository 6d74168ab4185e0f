"""``replay --model-shape PATH``: a hybrid model's shape derived by vLLM from its config.json."""

from __future__ import annotations

import json

import pytest

from vllm_hybrid_backends.cli import main
from vllm_hybrid_backends.replay.engine_config import shape_from_model_config
from vllm_hybrid_backends.replay.shapes import MODEL_SHAPES

pytestmark = pytest.mark.slow


def _write(tmp_path, config: dict, name: str = "model"):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _cache_geometry(shape):
    return (shape.layer_kinds, shape.num_kv_heads, shape.head_size, shape.dtype, shape.state)


@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_built_in_shapes_are_what_vllm_derives_from_their_public_configs(tmp_path, name):
    """The hand-written shapes (from the checkpoints' configs, with vLLM's formulas) equal what
    the derivation gets from the same config.json: layer kinds, KV heads, dtypes, state."""
    built_in = MODEL_SHAPES[name]
    derived = shape_from_model_config(_write(tmp_path, built_in.hf_config) / "config.json")
    assert _cache_geometry(derived) == _cache_geometry(built_in)
    assert derived.architecture == built_in.architecture


def test_a_multimodal_qwen35_config_gives_its_text_models_shape(tmp_path):
    """Qwen3.5 checkpoints ship Qwen3_5ForConditionalGeneration with a nested text_config."""
    text = {k: v for k, v in MODEL_SHAPES["qwen3.5-0.8b"].hf_config.items() if k != "architectures"}
    directory = _write(tmp_path, {"architectures": ["Qwen3_5ForConditionalGeneration"],
                                  "model_type": "qwen3_5", "text_config": text,
                                  "tie_word_embeddings": True, "torch_dtype": "bfloat16"})
    derived = shape_from_model_config(directory)
    assert _cache_geometry(derived) == _cache_geometry(MODEL_SHAPES["qwen3.5-0.8b"])
    assert derived.name == "model" and derived.source == str(directory / "config.json")


@pytest.mark.parametrize(("entry", "kind", "states"), [
    ("lfm2", "SHORT_CONV", 1),
    ("granite_hybrid", "MAMBA2", 2),
])
def test_other_hybrid_families_replay_with_the_oracle_clean(tmp_path, capsys, entry, kind, states):
    """LFM2 (short convolutions: a conv state only) and Granite-4.0-H (Mamba2), from the
    configs of the test zoo's tiny models: both policies replay with every hit's state checked."""
    from vllm_hybrid_backends.testing.model_zoo import get_entry

    directory = tmp_path / entry
    get_entry(entry).make_config().save_pretrained(directory)
    trace = tmp_path / "branches.jsonl"  # 8 prompts of 600 tokens on a 400-token stem
    trace.write_text("".join(json.dumps({
        "id": f"r{i}", "arrival_s": 0.5 * i, "max_tokens": 8,
        "prompt_token_ids": [7 + t % 300 for t in range(400)] + [i * 200 + t for t in range(200)],
    }) + "\n" for i in range(8)))
    assert main(["replay", "--trace", str(trace), "--model-shape", str(directory), "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{\n"):])  # vLLM may log to stdout if set up earlier
    assert report["model_shape"] == entry
    assert report["model_source"] == str((directory / "config.json").resolve())
    for metrics in report["policies"].values():
        assert metrics["state_mismatches"] == 0 and metrics["state_checks"] > 0
        assert metrics["blocks_leaked"] == 0
    stem = 400 // report["block_size"] * report["block_size"]
    for metrics in report["policies"].values():  # the stem, block-aligned, from the 3rd on
        assert metrics["token_hit_rate"] >= 6 * stem / (8 * 600)
    derived = shape_from_model_config(directory)
    assert derived.state.kind == kind and len(derived.state.shapes) == states
    assert derived.layer_kinds == ("mamba", "mamba", "attention", "mamba")


def test_a_jamba_config_gives_mamba1_layers_where_its_period_puts_them(tmp_path):
    import transformers

    config = transformers.JambaConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
        vocab_size=512, num_hidden_layers=8, attn_layer_period=4, attn_layer_offset=2,
        expert_layer_period=100, num_experts=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)
    config.architectures = ["JambaForCausalLM"]
    config.save_pretrained(tmp_path)
    derived = shape_from_model_config(tmp_path / "config.json")
    assert derived.layer_kinds == ("mamba", "mamba", "attention", "mamba") * 2
    assert derived.state.kind == "MAMBA1" and derived.state.conv_kernel == 4
    assert derived.state.shapes == ((3, 512), (512, 16))  # conv (kernel - 1, d_inner); SSM
    assert (derived.num_kv_heads, derived.head_size) == (2, 64)


@pytest.mark.parametrize(("config", "message"), [
    pytest.param({"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
                 "architecture 'LlamaForCausalLM' is not a hybrid model the replay knows; "
                 "allowed: GraniteMoeHybridForCausalLM, JambaForCausalLM", id="not-hybrid"),
    pytest.param({"model_type": "qwen3_next"}, "no 'architectures' list", id="no-architectures"),
    pytest.param({**MODEL_SHAPES["qwen3-next-80b-a3b"].hf_config, "full_attention_interval": 100},
                 "0 attention and 48 Mamba-style layers; a hybrid model has both",
                 id="no-attention-layer"),
])
def test_configs_it_cannot_replay_are_refused_by_name(tmp_path, capsys, config, message):
    directory = _write(tmp_path, config)
    with pytest.raises(ValueError, match="config.json: " + message.replace("(", r"\(")):
        shape_from_model_config(directory)
    assert main(["replay", "--model-shape", str(directory)]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_or_unreadable_config_is_a_usage_error(tmp_path, capsys):
    assert main(["replay", "--model-shape", "granite-4.0-h"]) == 2
    assert ("--model-shape: unknown model shape 'granite-4.0-h'; allowed: qwen3.5-0.8b, "
            "qwen3-next-80b-a3b, nemotron-h-8b, or the path of a hybrid model's config.json or "
            "its directory" in capsys.readouterr().err)
    (tmp_path / "config.json").write_text("{not json")
    assert main(["replay", "--model-shape", str(tmp_path)]) == 2
    assert "config.json: not a readable JSON config" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["replay", "--model-shape", str(empty)]) == 2
    assert "no such config.json (a model directory or its config.json)" in capsys.readouterr().err


def test_the_derivation_does_not_depend_on_the_host(tmp_path, monkeypatch):
    """An AVX-512 BF16 / AMX host (vLLM-CPU then changes Mamba dtypes) with the DS conv layout
    set, already looked up (vLLM caches it), derives what the built-in shape says."""
    import torch
    from vllm.model_executor.layers.mamba import mamba_utils

    built_in = MODEL_SHAPES["nemotron-h-8b"]
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: True)
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    mamba_utils.get_conv_state_layout.cache_clear()
    assert mamba_utils.get_conv_state_layout() == "DS"
    try:
        derived = shape_from_model_config(_write(tmp_path, built_in.hf_config))
    finally:
        mamba_utils.get_conv_state_layout.cache_clear()
    assert _cache_geometry(derived) == _cache_geometry(built_in)


def test_the_python_api_and_the_sweep_take_a_path_as_the_shape(tmp_path):
    from vllm_hybrid_backends.replay.harness import ReplayConfig

    directory = _write(tmp_path, MODEL_SHAPES["qwen3-next-80b-a3b"].hf_config)
    config = ReplayConfig(model_shape=str(directory))
    assert _cache_geometry(config.resolved_shape()) == \
        _cache_geometry(MODEL_SHAPES["qwen3-next-80b-a3b"])
    assert config.layout().block_size == ReplayConfig(model_shape="qwen3-next-80b-a3b").layout().block_size
    with pytest.raises(ValueError, match="unknown model shape 'nope'"):
        ReplayConfig(model_shape="nope").resolved_shape()
