"""The one exact comparison of state tensors the kernel tests share."""

from __future__ import annotations

import torch

__all__ = ["assert_same_bits"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal dtype, shape and raw bits (NaN payloads and signed zeros included); the message
    names ``what``, how many elements differ and the first one."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    a = got.contiguous().view(_INT_VIEW[got.element_size()])
    b = want.contiguous().view(_INT_VIEW[want.element_size()])
    if not torch.equal(a, b):
        where = (a != b).nonzero()
        first = tuple(where[0].tolist())
        raise AssertionError(f"{what}: {where.shape[0]} element(s) differ; first at {first}: "
                             f"got {got[first].item()!r}, want {want[first].item()!r}")
