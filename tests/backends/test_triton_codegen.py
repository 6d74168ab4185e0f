"""The shared Triton kernels compile for real NVIDIA and AMD targets, with 16-byte accesses on
the whole-block path, without a GPU (Triton compiles ahead of time for a named target).

The interpreter runs the kernels' Python and cannot see compile-time errors (it once accepted a
name whose type differed between the branches of an ``if``, which the compiler rejects), nor
whether accesses are vectorised.
"""

from __future__ import annotations

import collections
import re

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vllm_hybrid_backends.backends.triton import kernels as shared  # noqa: E402

pytestmark = pytest.mark.skipif(shared.INTERPRETED, reason="kernels built for the interpreter")

TARGETS = [pytest.param(GPUTarget("cuda", 90, 32), id="sm90"),
           pytest.param(GPUTarget("hip", "gfx942", 64), id="gfx942")]
ALIGNED = [["tt.divisibility", 16]]  # what Triton infers for a 16-byte-aligned tensor argument


def _compile(kernel, signature, constexprs, target, aligned_args=()):
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(i,): ALIGNED for i in aligned_args}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=target, options={"num_warps": 4, "num_stages": 1, "enable_fp_fusion": False})
    if target.backend == "cuda":
        found = re.findall(r"\n\s+(?:@%p\d+ )?((?:ld|st)\.global[\w.]*)", compiled.asm["ptx"])
    else:
        found = re.findall(r"\n\s+((?:global|buffer)_(?:load|store)\w*)", compiled.asm["amdgcn"])
    return collections.Counter(found)


def _has_16_byte_accesses(accesses, target) -> bool:
    wide = ("v2.b64", "v4.b32") if target.backend == "cuda" else ("dwordx4",)
    return (any(k.startswith(("ld", "buffer_load", "global_load")) and k.endswith(wide) for k in accesses)
            and any(k.startswith(("st", "buffer_store", "global_store")) and k.endswith(wide)
                    for k in accesses))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("word_type", "word"), [("*u64", 8), ("*u16", 2)])
def test_state_copy_kernel_compiles_with_16_byte_block_copies(target, word_type, word):
    signature = {"words": word_type, "table": "*i64", "items": "*i64", "num_segments": "i32",
                 "num_items": "i32"}
    constexprs = {"VEC": 16 // word, "SEG_P2": 256, "FLAT_BLOCK": 8192 // word, "FLAT_STEPS": 4,
                  "WIN_T": 8, "WIN_C": 256}
    accesses = _compile(shared._state_copy_kernel, signature, constexprs, target, (0, 1, 2))
    assert _has_16_byte_accesses(accesses, target), dict(accesses)


@pytest.mark.parametrize("target", TARGETS)
def test_checkpoint_gather_and_memcpy_kernels_compile(target):
    checkpoint = _compile(
        shared._checkpoint_kernel,
        {"src_words": "*u16", "dst_words": "*u32", "table": "*i64", "items": "*i64",
         "num_segments": "i32", "num_items": "i32"},
        {"SRC_KIND": shared._K_BF16.value, "DST_KIND": shared._K_F32.value, "VEC_SRC": 8,
         "VEC_DST": 4, "VEC_MASK": 8, "SEG_P2": 16, "WIN_T": 4, "WIN_C": 512, "FLAT_BLOCK": 4096},
        target, (0, 1),
    )
    assert _has_16_byte_accesses(checkpoint, target), dict(checkpoint)
    gather = _compile(
        shared._gather_indices_kernel,
        {"table_addrs": "*i64", "widths": "*i64", "row_strides": "*i64", "col_strides": "*i64",
         "seq_lens": "*i64", "out": "*i32", "num_rows": "i32", "num_slots": "i32", "block_size": "i32"},
        {"TABLE_T": triton.language.int32, "ROWS": 64, "SLOTS": 4}, target,
    )
    assert sum(gather.values()) > 0
    memcpy = _compile(shared._batch_memcpy_kernel, {"src_ptrs": "*u64", "dst_ptrs": "*u64", "sizes": "*i32"},
                      {"CHUNK": 8192, "SPLIT": 16}, target)
    assert sum(memcpy.values()) > 0
