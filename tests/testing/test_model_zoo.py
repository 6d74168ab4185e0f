"""The tiny-model zoo: names, caching, determinism and the config keys vLLM needs."""

from __future__ import annotations

import json

import pytest

from vllm_hybrid_backends.testing import model_zoo
from vllm_hybrid_backends.testing.model_zoo import ZOO, build_model


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"'nope'.*granite_hybrid, lfm2, qwen35"):
        build_model("nope")


def test_entries_record_a_run_dtype():
    assert {n: e.dtype for n, e in ZOO.items()} == {
        "qwen35": "bfloat16", "lfm2": "float32", "granite_hybrid": "float32"}


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_HYBRID_MODEL_CACHE", str(tmp_path))
    assert model_zoo.model_dir("lfm2").parent == tmp_path


def test_build_is_cached_deterministic_and_vllm_ready(tmp_path):
    first = build_model("lfm2", tmp_path / "a")
    again = build_model("lfm2", tmp_path / "a")
    other = build_model("lfm2", tmp_path / "b")
    assert first == again and first.name == other.name
    assert (first / "model.safetensors").read_bytes() == (other / "model.safetensors").read_bytes()
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["Lfm2ForCausalLM"]
    assert config["conv_dim"] == config["block_dim"] == config["hidden_size"]  # read by vLLM
    assert model_zoo.entry_for_dir(first)["dtype"] == "float32"
    assert not list((tmp_path / "a").glob(".*"))  # no temporary directory left behind
