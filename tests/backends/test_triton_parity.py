"""The ``cuda`` and ``rocm`` Triton kernels against the ``cpu`` reference, on CPU tensors under
``TRITON_INTERPRET=1``, plus routing and the kernel-override contract.

Every parity case builds fresh random inputs (a generator seeded from the case id), poisons
every destination block with NaN in both copies, runs the backend's hook implementation on one
copy and the reference on the other, and compares the raw bits of every output tensor
(:func:`assert_same_bits`), so a value written where the reference leaves the poison fails too.
The probes say "unavailable" here, so the hook implementations are called directly.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from vllm_hybrid_backends import plugins, reference
from vllm_hybrid_backends.backends.triton.backend import CUDA as cuda_backend
from vllm_hybrid_backends.backends.triton.backend import ROCM as rocm_backend
from vllm_hybrid_backends.hookspecs import STATE_OPERATION_HOOKS
from vllm_hybrid_backends.testing.bits import assert_same_bits
from vllm_hybrid_backends.types import CheckpointBatch, MambaStateTensor, StateKind

BACKENDS = [pytest.param(cuda_backend, id="cuda-backend"), pytest.param(rocm_backend, id="rocm-backend")]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
CONV_KINDS = [pytest.param(StateKind.CONV_SD, id="SD"), pytest.param(StateKind.CONV_DS, id="DS")]
MEMCPY_KERNEL = "vllm.v1.worker.mamba_utils.batch_memcpy_kernel"


@pytest.fixture(scope="module", autouse=True)
def _interpreted(interpreted_kernels):
    """Every test of this module runs the kernels in the Triton interpreter (conftest.py)."""
    return interpreted_kernels


# ---- shared helpers ---------------------------------------------------------------------------

def random_states(rng: torch.Generator, dtype: torch.dtype, specs: list[tuple[StateKind, tuple, int]],
                  num_blocks: int) -> list[MambaStateTensor]:
    """States with random values; each spec is (kind, per-block shape, group)."""
    states = []
    for i, (kind, shape, group) in enumerate(specs):
        tensor = (torch.randn((num_blocks, *shape), generator=rng) * 8).to(dtype)
        states.append(MambaStateTensor(tensor, kind, group, f"layers.{i}.{kind.value}"))
    return states


def poison_all_but(states: list[MambaStateTensor], sources: dict[int, set[int]]) -> None:
    """NaN into every block no move reads: destinations, and blocks nothing should touch."""
    for state in states:
        keep = sources.get(state.group, set())
        for block in range(state.tensor.shape[0]):
            if block not in keep:
                state.tensor[block] = float("nan")


def clone_states(states: list[MambaStateTensor]) -> list[MambaStateTensor]:
    return [MambaStateTensor(s.tensor.clone(), s.kind, s.group, s.layer) for s in states]


def run_parity(run_backend: Callable[[list[MambaStateTensor]], object],
               run_reference: Callable[[list[MambaStateTensor]], object],
               states: list[MambaStateTensor]) -> None:
    """Run both on their own copy of ``states``; every state tensor must match bit for bit."""
    ours, theirs = clone_states(states), clone_states(states)
    run_backend(ours)
    run_reference(theirs)
    for mine, ref in zip(ours, theirs):
        assert_same_bits(mine.tensor, ref.tensor, mine.layer)


def conv_shape(kind: StateKind, state_len: int, dim: int) -> tuple[int, int]:
    return (state_len, dim) if kind is StateKind.CONV_SD else (dim, state_len)


# ---- hb_copy_state_blocks ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conv_kind", CONV_KINDS)
def test_copy_state_blocks_matches_reference(backend, dtype, conv_kind, rng):
    # two groups; odd sizes (dim 7 and 129, state_len 3 and 6); per group: plain moves, a
    # chain (a block both read and written), a 2-cycle, a fanned-out source and a self-copy
    specs = [
        (conv_kind, conv_shape(conv_kind, 3, 129), 0),
        (StateKind.TEMPORAL, (3, 7, 5), 0),
        (conv_kind, conv_shape(conv_kind, 6, 7), 1),
        (StateKind.TEMPORAL, (2, 129), 1),
        (StateKind.TEMPORAL, (4, 8), 1),  # 16-byte multiple: the aligned (vector) launch
    ]
    num_blocks = 24
    states = random_states(rng, dtype, specs, num_blocks)
    src, dst = [], []
    for _ in range(2):
        b = torch.randperm(num_blocks, generator=rng).tolist()
        # b0->b1, b1->b2 (chain), b3<->b4 (cycle), b5->b6, b5->b7 (fan-out), b8->b8 (self), b9->b10
        src.append([b[0], b[1], b[3], b[4], b[5], b[5], b[8], b[9]])
        dst.append([b[1], b[2], b[4], b[3], b[6], b[7], b[8], b[10]])
    poison_all_but(states, {g: set(src[g]) for g in range(2)})
    src_t, dst_t = torch.tensor(src), torch.tensor(dst, dtype=torch.int32)
    run_parity(lambda s: backend.hb_copy_state_blocks(states=s, src_blocks=src_t, dst_blocks=dst_t),
               lambda s: reference.copy_state_blocks(s, src_t, dst_t), states)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_state_blocks_on_page_strided_views_of_one_buffer(backend, rng):
    # vLLM's layout: each block is a padded page holding the conv state then the SSM state;
    # fp16 rows of 7 elements make the conv windows 2-byte aligned only
    num_blocks, conv_shape_, ssm_shape = 10, (3, 7), (4, 5)
    conv_bytes, ssm_bytes = 3 * 7 * 2, 4 * 5 * 2
    page = conv_bytes + ssm_bytes + 10  # padding after each page
    raw = torch.full((num_blocks * page,), 0x7E, dtype=torch.uint8)
    conv = torch.as_strided(raw.view(torch.float16), (num_blocks, *conv_shape_), (page // 2, 7, 1))
    ssm = torch.as_strided(raw.view(torch.float16), (num_blocks, *ssm_shape), (page // 2, 5, 1),
                           conv_bytes // 2)
    conv.copy_(torch.randn(conv.shape, generator=rng).half())
    ssm.copy_(torch.randn(ssm.shape, generator=rng).half())
    src, dst = torch.tensor([[1, 2, 7]]), torch.tensor([[2, 5, 8]])
    ours, theirs = raw.clone(), raw.clone()

    def views(buffer):
        c = torch.as_strided(buffer.view(torch.float16), conv.shape, conv.stride())
        s = torch.as_strided(buffer.view(torch.float16), ssm.shape, ssm.stride(), conv_bytes // 2)
        return [MambaStateTensor(c, StateKind.CONV_SD), MambaStateTensor(s, StateKind.TEMPORAL)]

    backend.hb_copy_state_blocks(states=views(ours), src_blocks=src, dst_blocks=dst)
    reference.copy_state_blocks(views(theirs), src, dst)
    assert_same_bits(ours, theirs, "raw cache buffer (padding included)")


# ---- hb_precopy_running_states ----------------------------------------------------------------


def _request_tables(rng, num_groups, num_reqs, width, num_blocks):
    """Block tables whose rows own disjoint blocks (as vLLM's requests do)."""
    tables = []
    for _ in range(num_groups):
        blocks = torch.randperm(num_blocks, generator=rng)[: num_reqs * width]
        tables.append(blocks.reshape(num_reqs, width).to(torch.int32))
    return tables


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conv_kind", CONV_KINDS)
def test_precopy_matches_reference(backend, dtype, conv_kind, rng):
    state_len = 4
    specs = [
        (conv_kind, conv_shape(conv_kind, state_len, 129), 0),
        (StateKind.TEMPORAL, (3, 7, 5), 0),
        (conv_kind, conv_shape(conv_kind, state_len, 3), 1),
        (StateKind.TEMPORAL, (5, 3), 1),
    ]
    num_reqs, width, num_blocks = 8, 6, 64
    states = random_states(rng, dtype, specs, num_blocks)
    tables = _request_tables(rng, 2, num_reqs, width, num_blocks)
    # every bias 0..L-1, same-column in-place shifts, a fresh request, an unmoved one
    src_cols = torch.tensor([0, 1, 2, 1, 3, -1, 2, 0])
    dst_cols = torch.tensor([1, 2, 2, 1, 4, 0, 2, 3])
    bias = torch.tensor([0, 1, 2, 3, 1, 0, 0, 2])
    read_cols = [(r, c) for r, (s, b) in enumerate(zip(src_cols.tolist(), bias.tolist())) if s >= 0
                 for c in (s, s + b)]  # conv reads column s, temporal column s + b
    poison_all_but(states, {g: {int(tables[g][r, c]) for r, c in read_cols} for g in range(2)})
    run_parity(
        lambda s: backend.hb_precopy_running_states(
            states=s, block_tables=tables, src_cols=src_cols, dst_cols=dst_cols, token_bias=bias),
        lambda s: reference.precopy_running_states(s, tables, src_cols, dst_cols, bias),
        states,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_launch_layouts_are_built_once_per_states_and_dropped_with_them(backend, interpreted_kernels,
                                                                        monkeypatch, rng):
    # vLLM passes the same state objects every step: the launch layout (segment tables) is built
    # on the first step and reused with each step's moves; a dead state's layout must go, or a
    # new state that reuses its id would be written through the old tensor's addresses
    kernels = interpreted_kernels
    builds = []
    compile_launches = kernels._compile_launches
    monkeypatch.setattr(kernels, "_compile_launches",
                        lambda *args: builds.append(1) or compile_launches(*args))
    specs = [(StateKind.CONV_SD, (4, 33), 0), (StateKind.TEMPORAL, (3, 5), 0),
             (StateKind.CONV_DS, (17, 4), 1), (StateKind.TEMPORAL, (6,), 1)]
    num_reqs, width, num_blocks = 6, 5, 64
    ours = random_states(rng, torch.float16, specs, num_blocks)
    theirs = clone_states(ours)

    def copy_both_and_compare(states):
        order = torch.randperm(num_blocks, generator=rng)
        src, dst = order[:8].view(2, 4), order[8:16].view(2, 4)
        backend.hb_copy_state_blocks(states=states, src_blocks=src, dst_blocks=dst)
        reference.copy_state_blocks(theirs, src, dst)
        for mine, ref in zip(states, theirs):
            assert_same_bits(mine.tensor, ref.tensor, mine.layer)

    for _ in range(3):  # fresh moves every step, same state objects
        tables = _request_tables(rng, 2, num_reqs, width, num_blocks)
        src_cols = torch.randint(-1, width - 1, (num_reqs,), generator=rng)
        dst_cols = (src_cols + torch.randint(0, 2, (num_reqs,), generator=rng)).clamp(0, width - 1)
        bias = torch.randint(0, 4, (num_reqs,), generator=rng)
        backend.hb_precopy_running_states(states=ours, block_tables=tables, src_cols=src_cols,
                                          dst_cols=dst_cols, token_bias=bias)
        reference.precopy_running_states(theirs, tables, src_cols, dst_cols, bias)
        copy_both_and_compare(ours)  # compares the precopy's result too
    assert len(builds) == 2  # one layout for the row moves, one for the block copies
    # a tensor whose storage is swapped in place (same objects, new addresses): laid out again
    ours[1].tensor.set_(ours[1].tensor.clone())
    copy_both_and_compare(ours)
    assert len(builds) == 3
    ids = tuple(map(id, ours))
    assert sum(key[3] == ids for key in kernels._layouts) == 3
    del ours
    assert not [key for key in kernels._layouts if key[3] == ids]


# ---- hb_postprocess_accepted_states -----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conv_kind", CONV_KINDS)
def test_postprocess_matches_reference(backend, dtype, conv_kind, rng):
    block_size, state_len = 4, 6  # spec decode: window = conv width 3 + 3 speculative tokens
    specs = [
        (conv_kind, conv_shape(conv_kind, state_len, 7), 0),
        (StateKind.TEMPORAL, (3, 7, 5), 0),
        (conv_kind, conv_shape(conv_kind, state_len, 129), 1),
        (StateKind.TEMPORAL, (2, 129), 1),
    ]
    num_reqs, width, num_blocks = 10, 8, 96
    states = random_states(rng, dtype, specs, num_blocks)
    tables = _request_tables(rng, 2, num_reqs, width, num_blocks)
    # accept patterns: no boundary crossed (rows 0, 9), boundary == running (bias 0, same
    # column: rows 1, 3), in-place shifts by 1..3 (rows 2, 4, 5, 7), moves to the next (6, 9)
    # and to an earlier column (8)
    running_cols = torch.tensor([1, 1, 1, 0, 2, 2, 0, 3, 2, 0])
    running = torch.tensor([5, 8, 7, 4, 9, 11, 6, 13, 5, 7])
    accepted = torch.tensor([2, 1, 4, 3, 4, 2, 3, 4, 4, 2])
    out = torch.full((num_reqs,), 9, dtype=torch.int64)
    reads = {(r, c) for r, (c, n, a) in enumerate(zip(running_cols.tolist(), running.tolist(),
                                                      accepted.tolist()))
             for c in (c, c + max(0, (n + a - 1) // block_size * block_size - n))}
    poison_all_but(states, {g: {int(tables[g][r, c]) for r, c in reads} for g in range(2)})
    expected_out = out.clone()
    run_parity(
        lambda s: backend.hb_postprocess_accepted_states(
            states=s, block_tables=tables, running_cols=running_cols, num_running_tokens=running,
            num_accepted=accepted, block_size=block_size, num_accepted_out=out),
        lambda s: reference.postprocess_accepted_states(
            s, tables, running_cols, running, accepted, block_size, expected_out),
        states,
    )
    assert_same_bits(out, expected_out, "num_accepted_out")
    assert out.tolist() != [9] * num_reqs  # some rows were reset


@pytest.mark.parametrize("backend", BACKENDS)
def test_postprocess_accepted_counts_may_alias_the_output(backend, rng):
    states = random_states(rng, torch.float32, [(StateKind.TEMPORAL, (3,), 0)], 16)
    tables = _request_tables(rng, 1, 3, 4, 16)
    args = (torch.tensor([1, 0, 1]), torch.tensor([6, 3, 5]))
    ours, theirs = torch.tensor([3, 2, 2]), torch.tensor([3, 2, 2])
    run_parity(
        lambda s: backend.hb_postprocess_accepted_states(
            states=s, block_tables=tables, running_cols=args[0], num_running_tokens=args[1],
            num_accepted=ours, block_size=4, num_accepted_out=ours),
        lambda s: reference.postprocess_accepted_states(s, tables, *args, theirs, 4, theirs),
        states,
    )
    assert ours.tolist() == theirs.tolist() == [1, 1, 2]


# ---- hb_store_checkpoints ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("source_dtype", DTYPES)
def test_store_checkpoints_matches_reference(backend, source_dtype, state_dtype, rng):
    # both conv layouts and a temporal state; the conv input is a strided view; checkpoints that
    # need 0, some and all rows from the initial block, and fresh sequences (zeros)
    dim, state_len, num_blocks = 19, 4, 12
    specs = [(StateKind.CONV_SD, (state_len, dim), 0), (StateKind.CONV_DS, (dim, state_len), 0),
             (StateKind.TEMPORAL, (3, 7), 0)]
    states = random_states(rng, state_dtype, specs, num_blocks)
    x = (torch.randn(14, 2 * dim, generator=rng) * 50).to(source_dtype)[:, 1::2]
    chunk_states = (torch.randn(5, 3, 7, generator=rng) * 50).to(source_dtype)
    batch = CheckpointBatch(*(torch.tensor(v) for v in (
        [4, 1, 8, 12, 10],  # token_end
        [0, 0, 6, 10, 10],  # seq_start
        [-1, -1, 0, 5, 2],  # initial_block
        [1, 3, 4, 6, 9],  # dst_block
        [2, 0, 1, 4, 3],  # temporal_row
    )))
    poison_all_but(states, {0: {b for b in batch.initial_block.tolist() if b >= 0}})
    sources = [x, x, chunk_states]
    run_parity(lambda s: backend.hb_store_checkpoints(states=s, sources=sources, checkpoints=batch),
               lambda s: reference.store_checkpoints(s, sources, batch), states)


# ---- hb_gather_aligned_state_indices ----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtypes", [pytest.param((torch.int32, torch.int32), id="int32"),
               pytest.param((torch.int64, torch.int64), id="int64"),
               pytest.param((torch.int32, torch.int64), id="mixed")],
)
@pytest.mark.parametrize("num_slots", [1, 3])
def test_gather_aligned_state_indices_matches_reference(backend, dtypes, num_slots, rng):
    num_rows = 13
    tables = [
        torch.randint(0, 1000, (num_rows, 9), generator=rng).to(dtypes[0]),
        torch.randint(0, 1000, (num_rows, 2 * 5), generator=rng).to(dtypes[1])[:, ::2],  # strided
    ]
    seq_lens = torch.randint(0, 45, (num_rows,), generator=rng)
    seq_lens[:3] = torch.tensor([0, 1, 36])
    got = backend.hb_gather_aligned_state_indices(
        block_tables=tables, seq_lens=seq_lens, block_size=4, num_slots=num_slots)
    expected = reference.gather_aligned_state_indices(tables, seq_lens, 4, num_slots)
    assert_same_bits(got, expected, "aligned state indices")
    assert (expected == -1).any()  # some columns fall past a table's width


# ---- vLLM kernel override: batch_memcpy_kernel --------------------------------------------------


def _memmove_oracle(buffer: torch.Tensor, entries: list[tuple[int, int, int]]) -> torch.Tensor:
    """vLLM-CPU's implementation of the kernel: ctypes.memmove per entry, in order."""
    out = buffer.clone()
    for src, dst, size in entries:
        ctypes.memmove(out.data_ptr() + dst, out.data_ptr() + src, size)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("aligned", [pytest.param(True, id="8-byte-words"),
                                     pytest.param(False, id="bytes")])
def test_batch_memcpy_override_is_memmove(backend, aligned, rng):
    impl = backend.hb_kernel_overrides(platform_name=backend.PLATFORM)[MEMCPY_KERNEL]
    buffer = torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=rng)
    skew = 0 if aligned else 3
    entries = [
        (0, 2048 + skew, 1000 - skew),  # disjoint, several chunks shared by programs
        (4096 + 64, 4096, 800),  # left overlap: a window shifting down inside one block
        (6000, 6000 + 8 * (1 + skew) + skew, 520),  # right overlap
        (7000, 7000, 100),  # onto itself
        (7500, 7600, 0),  # empty
    ]
    expected = _memmove_oracle(buffer, entries)
    base = buffer.data_ptr()
    impl(torch.tensor([base + s for s, _, _ in entries], dtype=torch.uint64),
         torch.tensor([base + d for _, d, _ in entries], dtype=torch.uint64),
         torch.tensor([n for *_, n in entries], dtype=torch.int32), BLOCK_SIZE=1024)
    assert_same_bits(buffer, expected, "buffer after batch_memcpy")


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_overrides_only_for_the_backends_platform(backend):
    assert backend.hb_kernel_overrides(platform_name="cpu") is None
    other = "rocm" if backend.PLATFORM == "cuda" else "cuda"
    assert backend.hb_kernel_overrides(platform_name=other) is None
    assert set(backend.hb_kernel_overrides(platform_name=backend.PLATFORM)) == {MEMCPY_KERNEL}


# ---- errors -----------------------------------------------------------------------------------


def test_moves_a_mover_cannot_do_exactly_are_rejected_by_the_facade(rng):
    # the checks run where the plan's inputs are on the host; backends only move
    states = random_states(rng, torch.float32, [(StateKind.CONV_SD, (3, 4), 0)], 8)
    args = ([torch.tensor([[0, 1, 2]])], torch.tensor([0]), torch.tensor([2]), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"token bias 3 of request row 0 is outside \[0, 3\)"):
        plugins.precopy_running_states(states, *args)
    # a chain across requests: request 1 writes the block request 0 reads
    chain = ([torch.tensor([[0, 1], [2, 0]])], torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="request row 0 reads block 0 of group 0, which request row 1 writes"):
        plugins.precopy_running_states(states, *chain)
    with pytest.raises(ValueError, match="request rows 0 and 1 both write block 5"):
        plugins.postprocess_accepted_states(states, [torch.tensor([[1, 5], [2, 5]])], torch.tensor([0, 0]),
                                            torch.tensor([6, 6]), torch.tensor([3, 3]), 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_get_one_clear_error(backend, rng):
    states = random_states(rng, torch.float32, [(StateKind.TEMPORAL, (4,), 0)], 6)
    with pytest.raises(ValueError, match="writes block 3 twice"):
        backend.hb_copy_state_blocks(states, torch.tensor([[0, 1]]), torch.tensor([[3, 3]]))
    with pytest.raises(IndexError, match=r"block 9 of state layers.0.temporal; allowed 0\.\.5"):
        backend.hb_copy_state_blocks(states, torch.tensor([[9]]), torch.tensor([[1]]))
    transposed = MambaStateTensor(torch.zeros(6, 4, 3).transpose(1, 2), StateKind.CONV_SD, layer="conv.t")
    with pytest.raises(ValueError, match="conv.t has non-contiguous blocks"):
        backend.hb_copy_state_blocks([transposed], torch.tensor([[0]]), torch.tensor([[1]]))
    conv = random_states(rng, torch.float32, [(StateKind.CONV_SD, (3, 4), 0)], 6)
    batch = CheckpointBatch(*(torch.tensor(v) for v in ([3, 3], [0, 0], [2, -1], [1, 2], [0, 0])))
    with pytest.raises(ValueError, match="checkpoint 0 starts from block 2, which this call also writes"):
        plugins.store_checkpoints(conv, [torch.zeros(5, 4)], batch)


# ---- routing ----------------------------------------------------------------------------------


def _fail(*args, **kwargs):
    raise AssertionError("the reference ran instead of the Triton kernels")


@pytest.mark.parametrize("backend", BACKENDS)
def test_hooks_run_the_triton_kernels_not_the_reference(backend, interpreted_kernels, monkeypatch, rng):
    for name in ("copy_state_blocks", "precopy_running_states", "postprocess_accepted_states",
                 "store_checkpoints", "gather_aligned_state_indices"):
        monkeypatch.setattr(reference, name, _fail)
    kernels = (interpreted_kernels._state_copy_kernel, interpreted_kernels._checkpoint_kernel,
               interpreted_kernels._gather_indices_kernel, interpreted_kernels._batch_memcpy_kernel)
    assert all(type(k).__name__ == "InterpretedFunction" for k in kernels)
    counts = interpreted_kernels.launch_counts
    before = dict(counts)
    # 16-byte multiples, as vLLM's pages: every call is a single launch
    states = random_states(rng, torch.float32, [(StateKind.CONV_SD, (3, 4), 0), (StateKind.TEMPORAL, (4,), 0)], 8)
    table = [torch.tensor([[0, 1, 2, 3]])]
    backend.hb_copy_state_blocks(states, torch.tensor([[0]]), torch.tensor([[5]]))
    backend.hb_precopy_running_states(states, table, torch.tensor([0]), torch.tensor([1]), torch.tensor([1]))
    backend.hb_postprocess_accepted_states(states, table, torch.tensor([1]), torch.tensor([6]),
                                           torch.tensor([3]), 4, torch.tensor([3]))
    backend.hb_store_checkpoints(states, [torch.zeros(6, 4), torch.zeros(2, 4)],
                                 CheckpointBatch(*(torch.tensor([v]) for v in (4, 0, -1, 6, 1))))
    backend.hb_gather_aligned_state_indices(table, torch.tensor([5]), 4, 1)
    assert counts["state_copy"] - before.get("state_copy", 0) == 3
    assert counts["checkpoint"] - before.get("checkpoint", 0) == 1
    assert counts["gather_indices"] - before.get("gather_indices", 0) == 1


def test_every_state_hook_is_implemented_by_both_backends_themselves():
    for module in (cuda_backend, rocm_backend):
        missing = [hook for hook in STATE_OPERATION_HOOKS if not hasattr(module, hook)]
        assert missing == [], f"{module.NAME} delegates {missing}"


def test_importing_the_backends_does_not_import_triton():
    code = ("import sys, vllm_hybrid_backends.backends.triton.backend, "
            "vllm_hybrid_backends.backends.triton.tuning; "
            "sys.exit(3 if 'triton' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
