"""The zoo's record of vLLM releases whose own engine cannot run a zoo model."""

from __future__ import annotations

import pytest

from vllm_hybrid_backends.testing.engine import EngineError
from vllm_hybrid_backends.testing.model_zoo import (
    ENGINE_GAPS,
    ZOO,
    assert_engine_gap,
    engine_gap,
    served_with_plugin,
)


def test_gaps_name_zoo_models():
    assert set(ENGINE_GAPS) <= set(ZOO)


def test_a_gap_applies_on_its_release_only():
    assert "Qwen3_5ForCausalLM" in str(engine_gap("qwen35", "0.23.0"))
    assert "linear_attention" in str(engine_gap("granite_hybrid", "0.23.0"))
    assert served_with_plugin("qwen35", "0.23.0") and not served_with_plugin("lfm2", "0.23.0")
    for version in ("0.22.0", "0.26.0", "0.32.0", "0.33.0"):
        assert engine_gap("qwen35", version) is None, version
        assert served_with_plugin("lfm2", version), version


def _fails_with(log):
    def run():
        raise EngineError("engine process exited with 1", log=log)
    return run


def test_assert_engine_gap_accepts_only_the_recorded_failure():
    gap = engine_gap("qwen35", "0.23.0")
    assert gap is not None
    log = f"Worker failed with error '{gap.failure}', please check the stack trace"
    assert assert_engine_gap("qwen35", _fails_with(log), version="0.23.0") is gap
    with pytest.raises(AssertionError, match="but without"):
        assert_engine_gap("qwen35", _fails_with("CUDA out of memory"), version="0.23.0")
    with pytest.raises(AssertionError, match="ran 'qwen35' although"):
        assert_engine_gap("qwen35", lambda: None, version="0.23.0")
    with pytest.raises(ValueError, match="no engine gap on vLLM 0.32.0"):
        assert_engine_gap("qwen35", lambda: None, version="0.32.0")
