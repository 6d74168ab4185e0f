"""The engine harness's multimodal view: a text-only zoo model laid out as the multimodal class
that some vLLM releases serve it through (vLLM 0.26: Qwen3.5 only as
``Qwen3_5ForConditionalGeneration``)."""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_hybrid_backends.testing.engine import multimodal_view
from vllm_hybrid_backends.testing.model_zoo import build_model


@pytest.fixture
def qwen35_copy(tmp_path):
    source = build_model("qwen35")
    copy = tmp_path / source.name
    shutil.copytree(source, copy)
    return copy


def test_view_holds_the_same_tensors_and_text_config_under_the_multimodal_layout(qwen35_copy):
    from safetensors.torch import load_file

    view = multimodal_view(qwen35_copy)
    assert view == qwen35_copy.with_name(f"{qwen35_copy.name}-as-Qwen3_5ForConditionalGeneration")
    assert multimodal_view(qwen35_copy) == view  # built once
    text = json.loads((qwen35_copy / "config.json").read_text())
    config = json.loads((view / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5"
    for key in ("hidden_size", "layer_types", "linear_num_value_heads", "rope_parameters",
                "vocab_size", "model_type"):
        assert config["text_config"][key] == text[key], key
    assert config["text_config"]["mamba_ssm_dtype"] == "float32"
    original = load_file(qwen35_copy / "model.safetensors")
    viewed = load_file(view / "model.safetensors")
    assert len(viewed) == len(original)
    for name, tensor in original.items():
        new = ("model.language_model." + name[len("model."):]) if name.startswith("model.") \
            else name
        assert viewed[new].dtype == tensor.dtype and viewed[new].equal(tensor), name
    assert not list(qwen35_copy.parent.glob(".*"))  # no temporary directory left behind


def test_vllm_maps_every_view_weight_into_its_language_model(qwen35_copy):
    # vLLM's own name mapping for the class (its hf_to_vllm_mapper) must place every tensor
    # of the view under the language model it builds with language_model_only.
    qwen3_5 = pytest.importorskip("vllm.model_executor.models.qwen3_5")
    from safetensors.torch import load_file

    mapper = qwen3_5.Qwen3_5ForConditionalGeneration.hf_to_vllm_mapper
    weights = load_file(multimodal_view(qwen35_copy) / "model.safetensors")
    mapped = [name for name, _ in mapper.apply(weights.items())]
    assert len(mapped) == len(weights)
    assert all(name.startswith("language_model.") for name in mapped), mapped


def test_an_architecture_without_a_view_is_refused_by_name(tmp_path):
    lfm2 = build_model("lfm2")
    with pytest.raises(ValueError, match=r"'Lfm2ForCausalLM'.*Qwen3_5ForCausalLM"):
        multimodal_view(lfm2)
