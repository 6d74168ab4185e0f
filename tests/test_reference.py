"""Semantics of the reference (``cpu``) backend, pinned on hand-computed cases.

Every case goes through the public facades in :mod:`vllm_hybrid_backends.plugins` with the
``cpu`` backend selected, so these are also the contract every device backend must meet.
"""

from __future__ import annotations

import pytest
import torch

from vllm_hybrid_backends import reference
from vllm_hybrid_backends.types import CheckpointBatch, MambaStateTensor, StateKind

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]


def numbered(shape, dtype=torch.float32):
    """A tensor whose every element is distinct and exactly representable (values < 256)."""
    count = 1
    for size in shape:
        count *= size
    return (torch.arange(count) % 251).reshape(shape).to(dtype)


def ids(*rows):
    return torch.tensor(rows, dtype=torch.int64)


# ---- hb_copy_state_blocks ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [StateKind.CONV_SD, StateKind.CONV_DS, StateKind.TEMPORAL])
def test_copy_state_blocks_copies_whole_blocks(fresh_plugins, kind, dtype):
    tensor = numbered((6, 3, 4), dtype)
    before = tensor.clone()
    state = MambaStateTensor(tensor, kind)
    fresh_plugins.copy_state_blocks([state], ids([1, 4]), ids([2, 5]))
    assert torch.equal(tensor[2], before[1])
    assert torch.equal(tensor[5], before[4])
    for untouched in (0, 1, 3, 4):
        assert torch.equal(tensor[untouched], before[untouched])


def test_copy_state_blocks_reads_everything_before_writing(fresh_plugins):
    # chain 0 -> 1 -> 2: block 2 must receive block 1's *old* content (snapshot semantics)
    tensor = numbered((4, 2, 2))
    before = tensor.clone()
    fresh_plugins.copy_state_blocks([MambaStateTensor(tensor, StateKind.TEMPORAL)], ids([0, 1]), ids([1, 2]))
    assert torch.equal(tensor[1], before[0])
    assert torch.equal(tensor[2], before[1])


def test_copy_state_blocks_fans_out_a_duplicated_source(fresh_plugins):
    tensor = numbered((5, 3))
    before = tensor.clone()
    fresh_plugins.copy_state_blocks([MambaStateTensor(tensor, StateKind.TEMPORAL)], ids([3, 3, 3]), ids([0, 1, 4]))
    for dst in (0, 1, 4):
        assert torch.equal(tensor[dst], before[3])


def test_copy_state_blocks_uses_each_groups_own_block_ids(fresh_plugins):
    conv = numbered((4, 3, 2))
    ssm = numbered((4, 5)) + 1000
    conv_before, ssm_before = conv.clone(), ssm.clone()
    states = [MambaStateTensor(conv, StateKind.CONV_SD, group=0), MambaStateTensor(ssm, StateKind.TEMPORAL, group=1)]
    fresh_plugins.copy_state_blocks(states, ids([0], [3]), ids([1], [2]))
    assert torch.equal(conv[1], conv_before[0])
    assert torch.equal(ssm[2], ssm_before[3])
    assert torch.equal(conv[2], conv_before[2]) and torch.equal(ssm[1], ssm_before[1])


def test_copy_state_blocks_same_block_is_a_no_op(fresh_plugins):
    tensor = numbered((3, 4))
    before = tensor.clone()
    fresh_plugins.copy_state_blocks([MambaStateTensor(tensor, StateKind.TEMPORAL)], ids([2]), ids([2]))
    assert torch.equal(tensor, before)


def test_copy_state_blocks_rejects_duplicate_destinations(fresh_plugins):
    state = MambaStateTensor(numbered((4, 2)), StateKind.TEMPORAL)
    with pytest.raises(ValueError, match="lists block 3 twice"):
        fresh_plugins.copy_state_blocks([state], ids([0, 1]), ids([3, 3]))


def test_copy_state_blocks_rejects_out_of_range_blocks(fresh_plugins):
    state = MambaStateTensor(numbered((4, 2)), StateKind.TEMPORAL)
    with pytest.raises(IndexError, match=r"block 7; allowed 0\.\.3"):
        fresh_plugins.copy_state_blocks([state], ids([7]), ids([1]))


def test_copy_state_blocks_rejects_a_group_without_block_ids(fresh_plugins):
    state = MambaStateTensor(numbered((4, 2)), StateKind.TEMPORAL, group=1, layer="layers.3")
    with pytest.raises(ValueError, match="layers.3 has group 1"):
        fresh_plugins.copy_state_blocks([state], ids([0]), ids([1]))


def test_copy_state_blocks_rejects_float_indices(fresh_plugins):
    state = MambaStateTensor(numbered((4, 2)), StateKind.TEMPORAL)
    with pytest.raises(TypeError, match="integer tensor"):
        fresh_plugins.copy_state_blocks([state], torch.tensor([[0.0]]), ids([1]))


# ---- hb_precopy_running_states ----------------------------------------------------------------


def _table(*rows):
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_precopy_shifts_sd_conv_window_and_picks_temporal_column(fresh_plugins, dtype):
    # request 0: src col 0 -> dst col 2 with 2 accepted speculative tokens (bias 1)
    conv = numbered((8, 4, 3), dtype)  # SD: (blocks, state_len=4, dim=3)
    ssm = numbered((8, 2, 2), dtype) + 100
    conv_before, ssm_before = conv.clone(), ssm.clone()
    states = [MambaStateTensor(conv, StateKind.CONV_SD), MambaStateTensor(ssm, StateKind.TEMPORAL)]
    table = _table([5, 6, 7, 1])
    fresh_plugins.precopy_running_states(states, [table], ids(0), ids(2), ids(1))
    assert torch.equal(conv[7, :3], conv_before[5, 1:])
    assert torch.equal(conv[7, 3], conv_before[7, 3])  # the last `bias` positions are left alone
    assert torch.equal(ssm[7], ssm_before[6])  # column src + bias = 1 -> block 6
    for block in (0, 1, 2, 3, 4, 5, 6):
        assert torch.equal(conv[block], conv_before[block])


def test_precopy_shifts_ds_conv_window_along_the_last_axis(fresh_plugins):
    conv = numbered((4, 3, 5))  # DS: (blocks, dim=3, state_len=5)
    before = conv.clone()
    fresh_plugins.precopy_running_states(
        [MambaStateTensor(conv, StateKind.CONV_DS)], [_table([0, 2])], ids(0), ids(1), ids(2)
    )
    assert torch.equal(conv[2, :, :3], before[0, :, 2:])
    assert torch.equal(conv[2, :, 3:], before[2, :, 3:])


def test_precopy_in_place_shift_inside_one_block_is_memmove_safe(fresh_plugins):
    # src and dst columns name the same block: the window shifts left over itself
    conv = numbered((2, 5, 2))
    before = conv.clone()
    table = _table([1, 1])
    fresh_plugins.precopy_running_states([MambaStateTensor(conv, StateKind.CONV_SD)], [table], ids(0), ids(1), ids(3))
    assert torch.equal(conv[1, :2], before[1, 3:])
    assert torch.equal(conv[1, 2:], before[1, 2:])


def test_precopy_skips_fresh_requests_and_unmoved_states(fresh_plugins):
    ssm = numbered((6, 3))
    before = ssm.clone()
    table = _table([0, 1], [2, 3], [4, 5])
    # row 0 fresh (src -1), row 1 stays in its column, row 2 moves col 0 -> col 1
    fresh_plugins.precopy_running_states(
        [MambaStateTensor(ssm, StateKind.TEMPORAL)], [table], ids(-1, 1, 0), ids(0, 1, 1), ids(0, 0, 0)
    )
    assert torch.equal(ssm[5], before[4])
    for block in range(5):
        assert torch.equal(ssm[block], before[block])


def test_precopy_rejects_a_bias_longer_than_the_window(fresh_plugins):
    conv = MambaStateTensor(numbered((3, 2, 2)), StateKind.CONV_SD, layer="mixer.0")
    with pytest.raises(ValueError, match="token bias 2 .* outside"):
        fresh_plugins.precopy_running_states([conv], [_table([0, 1, 2])], ids(0), ids(2), ids(2))


def test_precopy_rejects_negative_bias(fresh_plugins):
    conv = MambaStateTensor(numbered((3, 2, 2)), StateKind.CONV_SD)
    with pytest.raises(ValueError, match="token_bias must be >= 0, got -1"):
        fresh_plugins.precopy_running_states([conv], [_table([0, 1, 2])], ids(0), ids(2), ids(-1))


# ---- hb_postprocess_accepted_states -----------------------------------------------------------


def test_postprocess_saves_the_state_at_the_crossed_boundary(fresh_plugins):
    # block_size 4. Row 0: running state covers 6 tokens in column 1, 3 accepted -> 8 computed:
    # boundary 8 crossed, state after 8 tokens = running + bias 2 goes to column 8/4-1 = 1
    # (same column: in-place shift, num_accepted reset to 1).
    # Row 1: running 5 tokens in col 1, 2 accepted -> 6: no boundary crossed, nothing happens.
    # Row 2: running 7 tokens in col 1, 4 accepted -> 10: boundary 8, bias 1, dst col 1 (same).
    # Row 3: running 4 tokens in col 0, 3 accepted -> 6 tokens: boundary 4 == running, bias 0,
    # dst col 0 == src: no copy but num_accepted reset to 1.
    conv = numbered((12, 4, 2))  # state_len 4 (conv width 2 + 2 speculative tokens)
    ssm = numbered((12, 3)) + 500
    conv_before, ssm_before = conv.clone(), ssm.clone()
    states = [MambaStateTensor(conv, StateKind.CONV_SD), MambaStateTensor(ssm, StateKind.TEMPORAL)]
    table = _table([0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 3, 4, 0], [2, 9, 10, 11, 0])
    accepted = ids(3, 2, 4, 3)
    out = accepted.clone()
    fresh_plugins.postprocess_accepted_states(
        states, [table], ids(1, 1, 1, 0), ids(6, 5, 7, 4), accepted, 4, out
    )
    assert out.tolist() == [1, 2, 1, 1]
    assert torch.equal(conv[1, :2], conv_before[1, 2:])  # row 0 shifted by 2 within block 1
    assert torch.equal(ssm[1], ssm_before[3])  # row 0 temporal from column 1 + 2
    assert torch.equal(conv[11, :3], conv_before[11, 1:])  # row 2 shifted by 1 within block 11
    assert torch.equal(ssm[11], ssm_before[3])  # row 2 temporal from column 2
    for block in (5, 6, 7, 8, 9, 2):
        assert torch.equal(conv[block], conv_before[block]) and torch.equal(ssm[block], ssm_before[block])


def test_postprocess_copies_to_an_earlier_column_when_the_boundary_is_behind(fresh_plugins):
    # running state covers 3 tokens in column 0; 2 accepted -> 4 computed, boundary 4:
    # bias 1, dst column 0 == src; a longer run: running 3 tokens col 0, accepted 6 -> 8,
    # boundary 8, bias 5 would exceed the window and is rejected by the reference
    ssm = numbered((4, 2))
    before = ssm.clone()
    out = fresh_plugins.postprocess_accepted_states(
        [MambaStateTensor(ssm, StateKind.TEMPORAL)], [_table([0, 1, 2, 3])], ids(0), ids(3), ids(2), 4
    )
    assert out.tolist() == [1]
    assert torch.equal(ssm[0], before[1])


def test_postprocess_rejects_zero_accepted(fresh_plugins):
    ssm = MambaStateTensor(numbered((4, 2)), StateKind.TEMPORAL)
    with pytest.raises(ValueError, match="num_accepted must be >= 1, got 0"):
        fresh_plugins.postprocess_accepted_states([ssm], [_table([0, 1])], ids(0), ids(3), ids(0), 4)


# ---- hb_store_checkpoints ---------------------------------------------------------------------


def _checkpoints(token_end, seq_start, initial_block, dst_block, temporal_row):
    return CheckpointBatch(*(torch.tensor(v, dtype=torch.int64) for v in
                             (token_end, seq_start, initial_block, dst_block, temporal_row)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_checkpoints_writes_conv_windows_and_temporal_rows(fresh_plugins, dtype):
    # two sequences in one chunk: rows 0..5 (fresh) and rows 6..9 (continuing from block 0)
    dim, state_len = 3, 3
    x = numbered((10, dim), dtype) + 1
    conv_sd = torch.full((5, state_len, dim), float("nan"), dtype=dtype)
    conv_sd[0] = numbered((state_len, dim), dtype) + 200
    conv_ds = torch.full((5, dim, state_len), float("nan"), dtype=dtype)
    conv_ds[0] = conv_sd[0].transpose(0, 1)
    chunk_states = numbered((3, 2, 2), torch.float32) + 0.5
    ssm = torch.full((5, 2, 2), float("nan"), dtype=dtype)
    states = [MambaStateTensor(conv_sd, StateKind.CONV_SD), MambaStateTensor(conv_ds, StateKind.CONV_DS),
              MambaStateTensor(ssm, StateKind.TEMPORAL)]
    # checkpoint A: after row 4 of seq 1 (token_end 4) -> block 1, chunk state row 2
    # checkpoint B: after 1 token of seq 1 (token_end 1) -> block 2, zeros fill the window
    # checkpoint C: after 2 tokens of seq 2 (token_end 8) -> block 3, window = old state tail + rows 6, 7
    batch = _checkpoints([4, 1, 8], [0, 0, 6], [-1, -1, 0], [1, 2, 3], [2, 0, 1])
    fresh_plugins.store_checkpoints(states, [x, x, chunk_states], batch)

    assert torch.equal(conv_sd[1], x[1:4])
    assert torch.equal(conv_sd[2][:2], torch.zeros(2, dim, dtype=dtype)) and torch.equal(conv_sd[2][2], x[0])
    expected_c = torch.cat([(numbered((state_len, dim), dtype) + 200)[2:], x[6:8]])
    assert torch.equal(conv_sd[3], expected_c)
    for block, expected in ((1, x[1:4]), (3, expected_c)):
        assert torch.equal(conv_ds[block], expected.transpose(0, 1))
    assert torch.equal(ssm[1], chunk_states[2].to(dtype))
    assert torch.equal(ssm[3], chunk_states[1].to(dtype))
    assert torch.isnan(ssm[4]).all() and torch.isnan(conv_sd[4]).all()


def test_store_checkpoints_rejects_a_source_of_the_wrong_width(fresh_plugins):
    conv = MambaStateTensor(torch.zeros(2, 3, 4), StateKind.CONV_SD, layer="conv.1")
    with pytest.raises(ValueError, match=r"conv.1 must be \[num_tokens, 4\], got \(5, 3\)"):
        fresh_plugins.store_checkpoints([conv], [torch.zeros(5, 3)], _checkpoints([3], [0], [-1], [1], [0]))


def test_store_checkpoints_rejects_ragged_checkpoint_fields(fresh_plugins):
    conv = MambaStateTensor(torch.zeros(2, 3, 4), StateKind.CONV_SD)
    with pytest.raises(ValueError, match="differ in length"):
        fresh_plugins.store_checkpoints([conv], [torch.zeros(5, 4)], _checkpoints([3, 4], [0], [-1], [1], [0]))


# ---- hb_gather_aligned_state_indices ----------------------------------------------------------


def test_gather_aligned_state_indices_by_hand(fresh_plugins):
    group0 = _table([10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33])
    group1 = _table([40, 41, 42, 43], [50, 51, 52, 53], [60, 61, 62, 63])
    seq_lens = ids(0, 5, 13)  # block_size 4: first slots 0, 1, 3
    out = fresh_plugins.gather_aligned_state_indices([group0, group1], seq_lens, 4, num_slots=2)
    assert out.dtype == torch.int32 and out.shape == (2, 3, 2)
    assert out[0].tolist() == [[10, 11], [21, 22], [33, -1]]
    assert out[1].tolist() == [[40, 41], [51, 52], [63, -1]]


def test_gather_aligned_state_indices_rejects_mismatched_rows(fresh_plugins):
    with pytest.raises(ValueError, match="has 1 rows but seq_lens has 2"):
        fresh_plugins.gather_aligned_state_indices([_table([1, 2])], ids(1, 2), 4)


def test_store_checkpoints_reads_initial_blocks_before_writing(fresh_plugins):
    # checkpoint 0 writes block 1; checkpoint 1 starts its window from block 1's *old* state
    conv = numbered((3, 3, 2)) + 10
    before = conv.clone()
    x = numbered((4, 2)) + 100
    batch = _checkpoints([2, 3], [0, 2], [-1, 1], [1, 2], [0, 0])
    states = [MambaStateTensor(conv, StateKind.CONV_SD)]
    # the facade rejects it (the Triton kernels cannot order those reads); the reference can
    with pytest.raises(ValueError, match="checkpoint 1 starts from block 1, which this call also writes"):
        fresh_plugins.store_checkpoints(states, [x], batch)
    assert torch.equal(conv, before)
    reference.store_checkpoints(states, [x], batch)
    assert torch.equal(conv[1], torch.cat([torch.zeros(1, 2), x[0:2]]))
    assert torch.equal(conv[2], torch.cat([before[1][1:], x[2:3]]))
