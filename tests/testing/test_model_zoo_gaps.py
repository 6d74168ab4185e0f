"""The zoo's record of vLLM releases whose own engine cannot run a zoo model."""

from __future__ import annotations

from vllm_hybrid_backends.testing.model_zoo import ENGINE_GAPS, ZOO, engine_gap


def test_gaps_name_zoo_models():
    assert set(ENGINE_GAPS) <= set(ZOO)


def test_a_gap_applies_on_its_release_only():
    assert "Qwen3_5ForCausalLM" in str(engine_gap("qwen35", "0.23.0"))
    assert "linear_attention" in str(engine_gap("granite_hybrid", "0.23.0"))
    for version in ("0.22.0", "0.26.0", "0.32.0", "0.33.0"):
        assert engine_gap("qwen35", version) is None, version
