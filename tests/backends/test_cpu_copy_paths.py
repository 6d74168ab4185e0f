"""The ``cpu`` backend's two block-copy paths (per block for large disjoint moves, gather then
scatter otherwise) give the same bits; each case checks which path ran."""

from __future__ import annotations

import zlib

import pytest
import torch

from vllm_hybrid_backends import reference
from vllm_hybrid_backends.types import MambaStateTensor, StateKind

_INT_VIEW = {2: torch.int16, 4: torch.int32}


def _states(seed: int, dtype: torch.dtype) -> list[MambaStateTensor]:
    generator = torch.Generator().manual_seed(seed)
    conv = (torch.randn(12, 3, 700, generator=generator) * 4).to(dtype)  # >= 4 KiB blocks
    ssm = (torch.randn(12, 4, 33, 16, generator=generator) * 4).to(dtype)
    tiny = (torch.randn(12, 3, generator=generator) * 4).to(dtype)  # below the threshold
    return [MambaStateTensor(conv, StateKind.CONV_SD, 0), MambaStateTensor(ssm, StateKind.TEMPORAL, 1),
            MambaStateTensor(tiny, StateKind.TEMPORAL, 1)]


def _copy_with_gather_only(states, src, dst, monkeypatch):
    monkeypatch.setattr(reference, "PER_BLOCK_COPY_BYTES", 1 << 60)
    reference.copy_state_blocks(states, src, dst)
    monkeypatch.undo()


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize(
    ("src", "dst", "per_block_copies"),
    [
        pytest.param([[0, 5, 7], [1, 2, 3]], [[9, 4, 2], [8, 6, 10]], 6, id="disjoint"),
        pytest.param([[0, 1, 2], [3, 4, 5]], [[1, 2, 11], [4, 3, 10]], 0, id="chains-and-cycles"),
        pytest.param([[6, 6, 6], [7, 8, 9]], [[1, 2, 3], [0, 11, 5]], 6, id="fan-out"),
    ],
)
def test_per_block_and_gather_paths_agree(dtype, src, dst, per_block_copies, monkeypatch, request):
    seed = zlib.crc32(request.node.nodeid.encode())
    fast, slow = _states(seed, dtype), _states(seed, dtype)
    for states in (fast, slow):
        for state in states:
            for group_dst, group_src in zip(dst, src):
                for block in set(group_dst) - set(group_src):
                    state.tensor[block] = float("nan")
    src_t, dst_t = torch.tensor(src), torch.tensor(dst)
    copies = []
    original_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, other, *a, **k: copies.append(1)
                        or original_copy(self, other, *a, **k))
    reference.copy_state_blocks(fast, src_t, dst_t)
    monkeypatch.undo()
    assert len(copies) == per_block_copies  # large disjoint groups went block by block
    _copy_with_gather_only(slow, src_t, dst_t, monkeypatch)
    for a, b in zip(fast, slow):
        view = _INT_VIEW[a.tensor.element_size()]
        assert torch.equal(a.tensor.view(view), b.tensor.view(view))
