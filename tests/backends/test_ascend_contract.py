"""The ``ascend`` backend without an NPU: kernel-source contract, launch limits, and parity of
both paths (Triton-Ascend kernels under ``TRITON_INTERPRET=1``, torch ops) with the reference.

Every parity case builds fresh random states (a seeded generator per case id), poisons the
destination blocks with NaN in both copies, runs the reference and the backend, and compares
the raw bits of every state tensor (and the padding around page-strided ones).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_hybrid_backends import plugins, reference
from vllm_hybrid_backends.backends.ascend import backend, torch_npu_ops, tuning
from vllm_hybrid_backends.types import CheckpointBatch, MambaStateTensor, StateKind

KERNELS_PATH = Path(backend.__file__).with_name("kernels.py")

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
PATHS = [pytest.param("torch", id="torch-path"), pytest.param("triton", id="triton-path")]


@pytest.fixture(scope="module")
def kernels():
    """The Triton-Ascend kernels module, imported with the interpreter on (CPU tensors)."""
    pytest.importorskip("triton")
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module("vllm_hybrid_backends.backends.ascend.kernels")
        if type(module.copy_regions_kernel).__name__ != "InterpretedFunction":
            module = importlib.reload(module)  # imported earlier without the interpreter
        yield module
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


@pytest.fixture
def launches(kernels):
    """Every kernel launch of the test: (name, grid, num_jobs, args, constexprs)."""
    seen: list[tuple] = []
    kernels.launch_observers.append(lambda *launch: seen.append(launch))
    yield seen
    kernels.launch_observers.clear()


@pytest.fixture(params=PATHS)
def path(request):
    if request.param == "triton":
        request.getfixturevalue("kernels")
    return request.param


# ---- one comparison rule ----------------------------------------------------------------------


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(int_type)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal dtype, shape and raw bits (signed zeros count); NaN equals NaN, whatever its
    payload, because dtype conversions (fp16 -> fp32 -> fp16) may canonicalise it."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    same = _bits(got) == _bits(want)
    if got.is_floating_point():
        same |= got.isnan() & want.isnan()
    diff = (~same).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}"


class Model:
    """Random Mamba states of two groups: SD conv, DS conv, an SD conv with strided columns,
    a contiguous temporal state and a page-padded temporal state (block stride > block size)."""

    def __init__(self, gen: torch.Generator, dtype: torch.dtype, num_blocks: int = 13,
                 device: str = "cpu"):
        self.num_blocks = num_blocks
        self.backing: list[torch.Tensor] = []
        self.states: list[MambaStateTensor] = []

        def random(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        for group in (0, 1):
            self._add(random(num_blocks, 4, 5), StateKind.CONV_SD, group)
            self._add(random(num_blocks, 7, 3), StateKind.CONV_DS, group)
            self._add(random(num_blocks, 3, 4), StateKind.TEMPORAL, group)
        transposed = random(num_blocks, 6, 4)
        self.backing.append(transposed)
        self.states.append(MambaStateTensor(transposed.transpose(1, 2), StateKind.CONV_SD, 0, "sd-strided"))
        padded = random(num_blocks * 40)
        self.backing.append(padded)
        self.states.append(MambaStateTensor(padded.as_strided((num_blocks, 3, 5, 2), (40, 10, 2, 1)),
                                            StateKind.TEMPORAL, 1, "temporal-padded"))

    def _add(self, tensor: torch.Tensor, kind: StateKind, group: int) -> None:
        self.backing.append(tensor)
        self.states.append(MambaStateTensor(tensor, kind, group, f"{kind.value}.{group}"))

    def poison(self, blocks_by_group: dict[int, list[int]]) -> None:
        for state in self.states:
            for block in blocks_by_group.get(state.group, []):
                state.tensor[block] = float("nan")

    def clone(self) -> Model:
        twin = object.__new__(Model)
        twin.num_blocks = self.num_blocks
        twin.backing = [b.clone() for b in self.backing]
        twin.states = []
        for state, old, new in zip(self.states, self.backing, twin.backing):
            view = new.as_strided(state.tensor.shape, state.tensor.stride(),
                                  state.tensor.storage_offset() - old.storage_offset())
            twin.states.append(MambaStateTensor(view, state.kind, state.group, state.layer))
        return twin

    def assert_same(self, want: Model) -> None:
        for state, got, expected in zip(self.states, self.backing, want.backing):
            assert_same_bits(got.cpu(), expected.cpu(), state.layer)

    def to_cpu(self) -> Model:
        twin = self.clone()
        twin.backing = [b.cpu() for b in twin.backing]
        twin.states = [MambaStateTensor(b.as_strided(s.tensor.shape, s.tensor.stride(), s.tensor.storage_offset()),
                                        s.kind, s.group, s.layer) for s, b in zip(twin.states, twin.backing)]
        return twin


def _generator(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def _tables(gen, model, rows, cols):
    # each request owns its blocks (hookspecs: no request reads a block another one writes)
    if model.num_blocks < rows * cols:  # too few blocks to own: ids shared between requests
        return [torch.randint(0, model.num_blocks, (rows, cols), generator=gen) for _ in (0, 1)]
    return [torch.randperm(model.num_blocks, generator=gen)[: rows * cols].view(rows, cols) for _ in (0, 1)]


# ---- parity: every hook, both paths --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", ["disjoint", "chains-and-cycles", "fan-out"])
def test_copy_state_blocks_matches_reference(request, path, dtype, pattern):
    gen = _generator(request)
    model = Model(gen, dtype)
    dst = torch.stack([torch.randperm(model.num_blocks, generator=gen)[:6] for _ in (0, 1)])
    if pattern == "disjoint":
        pool = torch.stack([torch.randperm(model.num_blocks, generator=gen) for _ in (0, 1)])
        dst, src = pool[:, :6], pool[:, 6:12]
    elif pattern == "chains-and-cycles":  # sources are other moves' destinations
        src = dst[:, torch.randperm(6, generator=gen)]
    else:
        src = torch.randint(0, 3, (2, 6), generator=gen)
    model.poison({g: dst[g].tolist() for g in (0, 1)})
    want = model.clone()
    reference.copy_state_blocks(want.states, src, dst)
    backend.copy_state_blocks(model.states, src, dst, path=path)
    model.assert_same(want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_precopy_matches_reference(request, path, dtype):
    gen = _generator(request)
    model = Model(gen, dtype, num_blocks=96)
    rows = 9
    tables = _tables(gen, model, rows, 6)  # random ids: requests share and collide in blocks
    src_cols = torch.randint(-1, 4, (rows,), generator=gen)
    dst_cols = torch.randint(0, 4, (rows,), generator=gen)
    bias = torch.randint(0, 2, (rows,), generator=gen)
    src_cols[0], dst_cols[0], bias[0] = 2, 2, 1  # in-place shift inside one block
    src_cols[1], dst_cols[1], bias[1] = 1, 1, 0  # no move
    model.poison({g: tables[g][:, :4].flatten().tolist()[:5] for g in (0, 1)})
    want = model.clone()
    reference.precopy_running_states(want.states, tables, src_cols, dst_cols, bias)
    backend.precopy_running_states(model.states, tables, src_cols, dst_cols, bias, path=path)
    model.assert_same(want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_postprocess_matches_reference(request, path, dtype):
    gen = _generator(request)
    model = Model(gen, dtype, num_blocks=96)
    rows, block_size = 10, 4
    tables = _tables(gen, model, rows, 8)
    running_tokens = torch.randint(1, 17, (rows,), generator=gen)
    accepted = torch.randint(1, 4, (rows,), generator=gen)
    running_cols = (running_tokens - 1) // block_size
    running_tokens[0], accepted[0], running_cols[0] = 6, 3, 1  # boundary 8 in the running column: shift by 2
    running_tokens[1], accepted[1], running_cols[1] = 8, 1, 1  # boundary 8 reached exactly: reset only
    out_want, out_got = accepted.clone(), accepted.clone()
    model.poison({g: tables[g][:, :3].flatten().tolist()[:4] for g in (0, 1)})
    want = model.clone()
    reference.postprocess_accepted_states(want.states, tables, running_cols, running_tokens, accepted,
                                          block_size, out_want)
    backend.postprocess_accepted_states(model.states, tables, running_cols, running_tokens, accepted,
                                        block_size, out_got, path=path)
    model.assert_same(want)
    assert torch.equal(out_got, out_want)
    assert (out_got == 1).any() and (out_got != accepted).any()  # the reset rule was exercised


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source_dtype", [pytest.param(None, id="same-dtype"),
                                          pytest.param(torch.float32, id="fp32-sources")])
def test_store_checkpoints_matches_reference(request, path, dtype, source_dtype):
    gen = _generator(request)
    model = Model(gen, dtype)
    tokens = 23
    sources = []
    for state in model.states:
        shape = ((tokens, state.tensor.shape[2 if state.kind is StateKind.CONV_SD else 1])
                 if state.kind.is_conv else (6, *state.tensor.shape[1:]))
        sources.append(torch.randn(*shape, generator=gen).to(source_dtype or dtype))
    checkpoints = CheckpointBatch(
        # fresh sequence; window across the sequence start (prefix from block 2); a prefix
        # block (5) written earlier in the batch; a duplicate destination (5 again)
        token_end=torch.tensor([3, 9, 14, 16, 23]),
        seq_start=torch.tensor([0, 8, 13, 13, 20]),
        initial_block=torch.tensor([-1, 2, 5, 5, 11]),
        dst_block=torch.tensor([5, 7, 9, 5, 2]),  # block 2 is read (2nd) before it is written (5th)
        temporal_row=torch.tensor([0, 4, 1, 5, 3]),
    )
    model.poison({g: [5, 7, 9, 2] for g in (0, 1)})
    want = model.clone()
    reference.store_checkpoints(want.states, sources, checkpoints)
    backend.store_checkpoints(model.states, sources, checkpoints, path=path)
    model.assert_same(want)


@pytest.mark.parametrize("table_dtypes", [pytest.param((torch.int32, torch.int32), id="int32"),
                                          pytest.param((torch.int64, torch.int32), id="mixed")])
@pytest.mark.parametrize("num_slots", [1, 3])
def test_gather_aligned_state_indices_matches_reference(request, path, table_dtypes, num_slots):
    gen = _generator(request)
    rows, block_size = 11, 4
    tables = [torch.randint(0, 50, (rows, width), generator=gen).to(dtype)
              for width, dtype in zip((5, 9), table_dtypes)]
    seq_lens = torch.randint(0, 45, (rows,), generator=gen)
    seq_lens[0] = 0
    want = reference.gather_aligned_state_indices(tables, seq_lens, block_size, num_slots)
    got = backend.gather_aligned_state_indices(tables, seq_lens, block_size, num_slots, path=path)
    assert_same_bits(got, want, "aligned state indices")
    assert (want == -1).any()  # some columns ran past a table


@pytest.mark.parametrize(("pattern", "copies_per_move"), [pytest.param("disjoint", 1, id="no-hazard"),
                                                         pytest.param("swap", 2, id="swap-staged")])
def test_only_blocks_that_are_read_and_written_travel_twice(request, launches, pattern, copies_per_move):
    """Snapshot semantics cost a scratch round trip only for hazardous blocks."""
    model = Model(_generator(request), torch.float32)
    src = torch.tensor([[1, 2], [1, 2]])
    dst = torch.tensor([[3, 4], [3, 4]]) if pattern == "disjoint" else torch.tensor([[2, 1], [2, 1]])
    want = model.clone()
    reference.copy_state_blocks(want.states, src, dst)
    backend.copy_state_blocks(model.states, src, dst, path="triton")
    model.assert_same(want)
    jobs = sum(num_jobs for _, _, num_jobs, _, _ in launches)
    assert jobs == copies_per_move * 2 * len(model.states)  # no state is big enough to be split


# ---- bad input: one clear error, nothing written ------------------------------------------------


def test_out_of_range_blocks_are_rejected_before_any_copy(request, kernels):
    """On the Triton path block ids become raw addresses: a bad one must never reach a kernel."""
    model = Model(_generator(request), torch.float32)
    before = model.clone()
    with pytest.raises(IndexError, match="src_blocks contains block 99 for layer conv_sd.1; allowed 0..12"):
        backend.copy_state_blocks(model.states, torch.tensor([[1], [99]]), torch.tensor([[2], [3]]),
                                  path="triton")
    model.assert_same(before)


def test_conv_bias_outside_the_window_is_rejected(request, path):
    model = Model(_generator(request), torch.float32)
    tables = [torch.arange(8).reshape(2, 4), torch.arange(8).reshape(2, 4)]
    args = (model.states, tables, torch.tensor([-1, 0]), torch.tensor([0, 1]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="token bias 3 of request row 1 is outside"):
        if path == "torch":  # the shared torch mover trusts its plan; the facade checks host plans
            plugins.precopy_running_states(*args)
        else:
            backend.precopy_running_states(*args, path=path)


# ---- routing: the chosen path's code runs ---------------------------------------------------------


@pytest.mark.parametrize(("soc", "triton_ok"), [pytest.param("Ascend910B2", True, id="a2-triton"),
                                                pytest.param("Ascend310P3", False, id="310p-torch")])
def test_the_facade_reaches_the_ascend_backends_own_code(request, monkeypatch, fresh_plugins, soc,
                                                         triton_ok):
    launched = request.getfixturevalue("launches") if triton_ok else []
    torch_ops: list[int] = []
    _fake_npu(monkeypatch, soc, triton_ok)
    original = torch_npu_ops.copy_blocks
    monkeypatch.setattr(torch_npu_ops, "copy_blocks", lambda *a: torch_ops.append(1) or original(*a))
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", "ascend")
    model = Model(_generator(request), torch.float16)
    want = model.clone()
    src, dst = torch.tensor([[0, 1], [2, 3]]), torch.tensor([[4, 5], [6, 7]])
    reference.copy_state_blocks(want.states, src, dst)
    fresh_plugins.copy_state_blocks(model.states, src, dst)
    assert fresh_plugins.selected_backend() == "ascend"
    model.assert_same(want)
    assert (len(launched) > 0, len(torch_ops) > 0) == (triton_ok, not triton_ok)


def test_triton_path_launches_the_ascend_kernels(request, launches):
    model = Model(_generator(request), torch.float16)
    tables = _tables(_generator(request), model, 4, 6)
    backend.precopy_running_states(model.states, tables, torch.tensor([0, 1, 2, -1]),
                                   torch.tensor([1, 2, 3, 0]), torch.tensor([1, 0, 2, 0]), path="triton")
    assert [name for name, *_ in launches] and {name for name, *_ in launches} == {"copy_regions_kernel"}


def test_torch_path_never_touches_torch_npu_or_triton(request, monkeypatch):
    class Trap:
        def __getattr__(self, name):
            raise AssertionError(f"the torch path used torch_npu.{name}")

    calls = []
    monkeypatch.setitem(sys.modules, "torch_npu", Trap())
    original = reference.apply_row_moves
    monkeypatch.setattr(reference, "apply_row_moves", lambda *a: calls.append(1) or original(*a))
    model = Model(_generator(request), torch.bfloat16)
    tables = _tables(_generator(request), model, 3, 6)
    backend.precopy_running_states(model.states, tables, torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]),
                                   torch.tensor([1, 0, 2]), path="torch")
    assert len(calls) == 1


@pytest.mark.parametrize(("soc", "triton_ok", "env", "expected"), [
    pytest.param("Ascend910B2", True, None, "triton", id="a2-triton"),
    pytest.param("Ascend910_9392", True, None, "triton", id="a3-triton"),
    pytest.param("Ascend310P3", True, None, "torch", id="310p-no-triton"),
    pytest.param("Ascend910B2", False, None, "torch", id="a2-without-triton-ascend"),
    pytest.param("Ascend910B2", True, "torch", "torch", id="forced-torch"),
])
def test_path_is_chosen_from_the_soc(monkeypatch, soc, triton_ok, env, expected):
    _fake_npu(monkeypatch, soc, triton_ok)
    if env:
        monkeypatch.setenv(tuning.PATH_ENV, env)
    assert backend.kernel_path() == expected
    availability = backend.hb_backend_probe()
    assert availability.available and f"{expected} path" in availability.reason and soc in availability.reason


def test_bad_path_requests_make_the_backend_unavailable_with_the_reason(monkeypatch):
    _fake_npu(monkeypatch, "Ascend310P3", False)
    monkeypatch.setenv(tuning.PATH_ENV, "cuda")
    availability = backend.hb_backend_probe()
    assert not availability.available
    assert "VLLM_HYBRID_ASCEND_PATH='cuda' is not a path; allowed values: auto, triton, torch" in availability.reason
    monkeypatch.setenv(tuning.PATH_ENV, "triton")
    with pytest.raises(RuntimeError, match="Triton-Ascend cannot run here: no triton-ascend"):
        backend.kernel_path()


def _fake_npu(monkeypatch, soc, triton_ok):
    monkeypatch.delenv(tuning.PATH_ENV, raising=False)
    backend.kernel_path.cache_clear()
    monkeypatch.setattr(backend, "torch_npu_installed", lambda: True)
    monkeypatch.setattr(backend, "import_torch_npu", lambda: (object(), ""))
    monkeypatch.setattr(backend, "npu_count", lambda: 1)
    monkeypatch.setattr(backend, "ascend_soc_name", lambda: soc)
    monkeypatch.setattr(backend, "triton_ascend_available",
                        lambda: (triton_ok, "" if triton_ok else "no triton-ascend"))


@pytest.fixture(autouse=True)
def _fresh_path_cache():
    backend.kernel_path.cache_clear()
    yield
    backend.kernel_path.cache_clear()


def test_torch_npu_is_imported_only_when_the_backend_is_probed(tmp_path):
    fake = tmp_path / "torch_npu"
    fake.mkdir()
    (fake / "__init__.py").write_text("import os\nos.environ['FAKE_TORCH_NPU_IMPORTED'] = '1'\n")
    script = textwrap.dedent("""
        import os, sys
        from vllm_hybrid_backends import plugins
        plugins.get_plugin_manager()  # registers every backend, ascend included
        import vllm_hybrid_backends.backends.ascend.backend as ascend
        before = 'torch_npu' in sys.modules or 'FAKE_TORCH_NPU_IMPORTED' in os.environ
        kernels_loaded = 'vllm_hybrid_backends.backends.ascend.kernels' in sys.modules
        reason = ascend.hb_backend_probe().reason
        print(before, kernels_loaded, 'torch_npu' in sys.modules, reason)
    """)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip().splitlines()[-1]
    assert out == "False False True no Ascend NPU visible (check ASCEND_RT_VISIBLE_DEVICES)"


# ---- kernel-source contract (AST) -------------------------------------------------------------


def _kernel_functions() -> list[ast.FunctionDef]:
    tree = ast.parse(KERNELS_PATH.read_text())
    return [node for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(ast.unparse(d) in ("triton.jit", "triton.jit()") for d in node.decorator_list)]


def _vector_names(fn: ast.FunctionDef) -> set[str]:
    """Names bound (directly or through other such names) to values built from ``tl.arange``."""
    names: set[str] = set()
    changed = True
    while changed:
        changed = False
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                used = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
                if "tl.arange" in ast.unparse(node.value) or used & names:
                    for target in node.targets:
                        for n in ast.walk(target):
                            if isinstance(n, ast.Name) and n.id not in names:
                                names.add(n.id)
                                changed = True
    return names


def test_kernels_exist_and_use_one_grid_axis():
    kernels_src = _kernel_functions()
    assert {fn.name for fn in kernels_src} == {"copy_regions_kernel", "gather_aligned_indices_kernel"}
    for fn in kernels_src:
        axes = [ast.unparse(call.args[0]) for call in ast.walk(fn) if isinstance(call, ast.Call)
                and ast.unparse(call.func) in ("tl.program_id", "tl.num_programs")]
        assert axes and set(axes) == {"0"}, f"{fn.name} uses grid axes {axes}"


def test_addresses_become_pointers_only_as_scalars():
    casts = 0
    for fn in _kernel_functions():
        vectors = _vector_names(fn)
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "to" and call.args
                    and "pointer_type" in ast.unparse(call.args[0])):
                continue
            casts += 1
            receiver = call.func.value
            assert isinstance(receiver, ast.Call) and ast.unparse(receiver.func) == "tl.load", \
                f"{fn.name}: pointer cast of {ast.unparse(receiver)} (cast a loaded scalar address)"
            used = {n.id for n in ast.walk(receiver) if isinstance(n, ast.Name)}
            assert not used & vectors and "tl.arange" not in ast.unparse(receiver), \
                f"{fn.name}: pointer cast of a vector address {ast.unparse(receiver)}"
    assert casts >= 3


def test_every_launch_goes_through_the_capped_grid():
    tree = ast.parse(KERNELS_PATH.read_text())
    launch_sites = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Subscript)]
    assert len(launch_sites) == 1  # the one inside _launch
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and ast.unparse(node.func) == "_launch"]
    assert len(calls) >= 3
    for call in calls:
        assert ast.unparse(call.args[1]).startswith("tuning.launch_grid("), ast.unparse(call)


def test_launch_grid_is_capped_for_huge_inputs():
    assert tuning.launch_grid(10**12, 10**9) == tuning.GRID_LIMIT == 65535
    assert tuning.launch_grid(10**12, 48) == 48
    assert tuning.launch_grid(7, 48) == 7
    assert tuning.launch_grid(0, 48) == 1
    with pytest.raises(ValueError, match="vector_cores >= 1"):
        tuning.launch_grid(5, 0)


@pytest.mark.parametrize("max_cols", [1, 3, 5, 1000, 10**9])
@pytest.mark.parametrize("word", [1, 2, 4, 8])
def test_tile_shape_fits_the_unified_buffer(max_cols, word):
    tune = tuning.for_soc("Ascend910B2")
    rows, cols = tuning.tile_shape(max_cols, word, tune.tile_bytes)
    assert rows * cols * word <= tune.tile_bytes <= 96 * 1024  # half of A2/A3's 192 KiB UB
    assert rows & (rows - 1) == 0 and cols & (cols - 1) == 0
    assert cols >= min(max_cols, tune.tile_bytes // word)


def test_launch_parameters_stay_within_the_limits(request, launches):
    """Run every hook on the Triton path and check what was launched."""
    gen = _generator(request)
    model = Model(gen, torch.bfloat16, num_blocks=40)
    src = torch.stack([torch.randperm(40, generator=gen)[:20] for _ in (0, 1)])
    dst = torch.stack([torch.randperm(40, generator=gen)[:20] for _ in (0, 1)])
    backend.copy_state_blocks(model.states, src, dst, path="triton")
    tables = _tables(gen, model, 12, 6)
    backend.precopy_running_states(model.states, tables, torch.randint(0, 3, (12,), generator=gen),
                                   torch.randint(0, 3, (12,), generator=gen),
                                   torch.randint(0, 2, (12,), generator=gen), path="triton")
    backend.gather_aligned_state_indices(tables, torch.randint(0, 20, (12,), generator=gen), 4, 2,
                                         path="triton")
    tune = tuning.for_soc("")
    assert len(launches) >= 3
    for name, grid, num_jobs, args, meta in launches:
        assert 1 <= grid <= min(tuning.GRID_LIMIT, tune.vector_cores, max(num_jobs, 1)), name
        assert args[0].dtype == torch.int64, f"{name}: address buffer is {args[0].dtype}"
        tile = [v for k, v in meta.items() if k.startswith("TILE_")]
        assert all(v & (v - 1) == 0 for v in tile), meta
        if name == "copy_regions_kernel":
            word_bytes = meta["WORD"].primitive_bitwidth // 8
            assert meta["TILE_ROWS"] * meta["TILE_COLS"] * word_bytes <= tune.tile_bytes


# ---- vLLM's batch_memcpy_kernel override -------------------------------------------------------


def test_batch_memcpy_override_has_vllms_signature_and_moves_bytes(kernels):
    mamba_utils = pytest.importorskip("vllm.v1.worker.mamba_utils")
    small_tiles = dataclasses.replace(tuning.for_soc(""), tile_bytes=128)  # entries span tiles
    impl = kernels.make_batch_memcpy_kernel(small_tiles, vector_cores=4)
    dispatcher = pytest.importorskip("vllm.triton_utils.dispatcher")
    kernel_args = dispatcher._kernel_arg_names(mamba_utils.batch_memcpy_kernel)
    assert tuple(inspect.signature(impl).parameters) == kernel_args  # forwarded by name
    data = torch.arange(256, dtype=torch.uint8).repeat(8)
    expected = data.clone().numpy()
    base = data.data_ptr()
    # a plain copy, a left-overlapping shift inside one region (memmove), a 0-byte entry
    entries = [(base + 10, base + 1200, 300), (base + 600, base + 590, 400), (base, base + 5, 0)]
    for src, dst, size in entries:
        expected[dst - base:dst - base + size] = expected[src - base:src - base + size].copy()
    to_tensor = lambda i, dtype: torch.tensor([e[i] for e in entries], dtype=dtype)  # noqa: E731
    impl(to_tensor(0, torch.uint64), to_tensor(1, torch.uint64), to_tensor(2, torch.int32), 1024)
    assert np.array_equal(data.numpy(), expected)


def test_kernel_overrides_only_on_npu_with_the_triton_path(monkeypatch, kernels):
    _fake_npu(monkeypatch, "Ascend910B2", True)
    assert backend.hb_kernel_overrides("cpu") is None
    overrides = backend.hb_kernel_overrides("npu")
    assert list(overrides) == ["vllm.v1.worker.mamba_utils.batch_memcpy_kernel"]
    _fake_npu(monkeypatch, "Ascend310P3", False)
    assert backend.hb_kernel_overrides("npu") is None


def test_doctor_lists_every_hook_as_the_backends_own(fresh_plugins):
    from vllm_hybrid_backends.hookspecs import STATE_OPERATION_HOOKS

    status = {s.name: s for s in fresh_plugins.backend_statuses()}["ascend"]
    assert status.hooks == {hook: "ascend" for hook in STATE_OPERATION_HOOKS}
    assert not status.availability.available and status.availability.reason


@pytest.mark.parametrize(("soc", "family"), [
    ("Ascend910B2", "a2"), ("Ascend910B4", "a2"), ("Ascend910_9392", "a3"),
    ("Ascend310P3", "310p"), ("Ascend950PR", "unknown"), ("", "unknown"),
])
def test_soc_names_map_to_families(soc, family):
    assert tuning.soc_family(soc) == family
    assert tuning.for_soc(soc).triton is (family != "310p")


@pytest.mark.no_device
def test_device_helpers_report_no_npu_here():
    from vllm_hybrid_backends import device

    assert device.ascend_soc_name() == ""
    available, why = device.triton_ascend_available()
    assert not available and why
    assert device.ascend_vector_cores() == 0


@pytest.mark.ascend
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_hook_on_npu_tensors_matches_reference(request, dtype):
    """On an Ascend machine: the path this SoC selects, on NPU tensors, against the reference."""
    gen = _generator(request)
    model = Model(gen, dtype, device="npu")
    want = model.to_cpu()
    tables = _tables(gen, model, 6, 6)
    src_cols, dst_cols = torch.tensor([0, 1, -1, 2, 3, 1]), torch.tensor([1, 2, 0, 2, 4, 3])
    bias = torch.tensor([1, 0, 0, 1, 2, 0])
    reference.precopy_running_states(want.states, tables, src_cols, dst_cols, bias)
    backend.precopy_running_states(model.states, [t.to("npu") for t in tables], src_cols.to("npu"),
                                   dst_cols.to("npu"), bias.to("npu"))
    model.assert_same(want)
    src = torch.stack([torch.randperm(13, generator=gen)[:5] for _ in (0, 1)])
    dst = torch.stack([torch.randperm(13, generator=gen)[:5] for _ in (0, 1)])
    reference.copy_state_blocks(want.states, src, dst)
    backend.copy_state_blocks(model.states, src, dst)
    model.assert_same(want)
    seq_lens = torch.randint(0, 30, (6,), generator=gen)
    expected = reference.gather_aligned_state_indices(tables, seq_lens, 4, 2)
    got = backend.gather_aligned_state_indices([t.to("npu") for t in tables], seq_lens.to("npu"), 4, 2)
    assert torch.equal(got.cpu(), expected)
