"""The greedy-output comparison rule shared by the engine tests."""

from __future__ import annotations

import pytest

from vllm_hybrid_backends.testing.compare import assert_same_greedy, greedy_mismatch
from vllm_hybrid_backends.testing.engine import RequestResult


def _result(tokens, logits, margins):
    return RequestResult(prompt_len=10, num_cached_tokens=0, output_token_ids=tokens,
                         output_logits=logits, output_margins=margins)


WANT = _result([5, 6, 7], [30.0, 31.0, 32.0], [4.0, 0.1, 5.0])


@pytest.mark.parametrize("got, ok", [
    pytest.param(_result([5, 6, 7], [30.0, 31.0, 32.0], [4.0, 0.1, 5.0]), True, id="identical"),
    pytest.param(_result([5, 6, 7], [30.1, 31.2, 31.9], [4.0, 0.1, 5.0]), True, id="within-rtol"),
    pytest.param(_result([5, 6, 7], [33.0, 31.0, 32.0], [4.0, 0.1, 5.0]), False, id="logit-off"),
    pytest.param(_result([5, 9, 1], [30.0, 31.0, 40.0], [4.0, 0.1, 9.0]), True,
                 id="near-tie-flip-ends-comparison"),
    pytest.param(_result([8, 6, 7], [30.0, 31.0, 32.0], [4.0, 0.1, 5.0]), False,
                 id="clear-margin-flip"),
    pytest.param(_result([5, 6], [30.0, 31.0], [4.0, 0.1]), False, id="shorter"),
])
def test_greedy_mismatch(got, ok):
    assert (greedy_mismatch(got, WANT, rtol=0.01) is None) is ok


def test_assert_same_greedy_uses_dtype_tolerance():
    got = _result([5, 6, 7], [30.4, 31.0, 32.0], [4.0, 0.1, 5.0])  # 1.3% off
    assert_same_greedy(got, WANT, dtype="bfloat16")
    with pytest.raises(AssertionError, match="step 0"):
        assert_same_greedy(got, WANT, dtype="float32")
