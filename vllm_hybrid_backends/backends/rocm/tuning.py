"""Launch shapes of the ``rocm`` backend's Triton kernels, per AMD architecture (one table), and
the known ROCm Triton compiler problems with their environment workarounds.

Shapes. CDNA GPUs execute 64-lane wavefronts (``num_warps`` counts wavefronts on AMD), so a
step of ``flat_step_bytes`` is 64 lanes x 4 wavefronts x 32 bytes: every lane moves two 16-byte
words per step. ``num_stages=1`` everywhere: a copy has nothing to pipeline, and the AMD
pipeliner is where the crashes below live. These values follow from the wavefront width and CU
counts; they were not tuned on AMD hardware (this project's CI has none). ``bench/kernels.py``
on a ROCm machine is how to revisit them; change the table, nothing else.

Keys are Triton's target arch for HIP: ``gfx90a`` (MI210/MI250), ``gfx942`` (MI300X/MI325X),
``gfx950`` (MI350X/MI355X); ``"interpreter"`` under ``TRITON_INTERPRET=1``.

Overlap semantics (vLLM #50729). vLLM's ``batch_memcpy_kernel`` raced on AMD CI: a spec-decode
conv-window shift copies inside one block with overlapping source and destination, and lanes
stored before other lanes had loaded. Here every overlapping move is explicit and tested
(``tests/backends/test_triton_parity.py``): an in-place window shift is done by one program per
channel tile that loads the whole window, passes a barrier, then stores; the ``batch_memcpy``
override moves an overlapping entry with one program, chunk by chunk in memmove order, a barrier
between each chunk's loads and stores.

Known ROCm Triton compiler problems and their workarounds (public reports):

- Pointer canonicalisation / buffer ops. ``TritonAMDGPUCanonicalizePointers`` failed
  ("PassManager::run failed") on gfx950 compiling vLLM's ``_causal_conv1d_update_kernel``
  (ROCm/triton#941, open); scripts work around it with ``AMDGCN_USE_BUFFER_OPS=0``. Buffer ops
  also gave memory access faults with int64 indexing (ROCm/triton#830, reproduced with
  ``AMDGCN_USE_BUFFER_OPS=1``, fine with ``=0``), which is why their default enablement was
  reverted on release branches (triton-lang/triton#7456, #8013); the canonicalisation fix is
  triton-lang/triton#9541 (cherry-picked to 3.6 in ROCm/triton#935 and to 3.7 in #9872).
  Our kernels address memory through int64 values cast to pointers, the pattern these reports
  involve: if a ROCm Triton build fails to compile or faults in them, set
  ``AMDGCN_USE_BUFFER_OPS=0``.
- Software pipeliner. ``TritonAMDGPUPipeline`` crashes with ``num_stages=4`` (triton-lang/triton
  #9815 on MI300X/gfx942 with Triton 3.6; vLLM #44973 on gfx90a; ROCm/aiter#4163 forces
  ``num_stages=1`` on gfx950 for the same reason). Every entry below uses ``num_stages=1``.
"""

from __future__ import annotations

from ..triton_state_kernels import LaunchTuning

_DEFAULT = LaunchTuning(
    name="rocm-default", lanes_per_warp=64, num_warps=4, flat_step_bytes=8192, flat_steps=4,
    window_tile_bytes=16384, checkpoint_tile_elems=4096, gather_rows=64,
    memcpy_chunk_bytes=8192, memcpy_split=8,
)

TABLE: dict[str, LaunchTuning] = {
    "default": _DEFAULT,
    # MI210/MI250 (CDNA2): 104/110 CUs per die
    "gfx90a": _DEFAULT,
    # MI300X/MI325X (CDNA3): 304 CUs: more programs per entry to fill them
    "gfx942": LaunchTuning(
        name="rocm-gfx942", lanes_per_warp=64, num_warps=4, flat_step_bytes=8192, flat_steps=4,
        window_tile_bytes=16384, checkpoint_tile_elems=4096, gather_rows=64,
        memcpy_chunk_bytes=8192, memcpy_split=16,
    ),
    # MI350X/MI355X (CDNA4): 256 CUs
    "gfx950": LaunchTuning(
        name="rocm-gfx950", lanes_per_warp=64, num_warps=4, flat_step_bytes=8192, flat_steps=4,
        window_tile_bytes=16384, checkpoint_tile_elems=4096, gather_rows=64,
        memcpy_chunk_bytes=8192, memcpy_split=16,
    ),
    # small tiles so the parity tests cover multi-tile items, multi-step loops and chunk order
    "interpreter": LaunchTuning(
        name="rocm-interpreter", lanes_per_warp=64, num_warps=4, flat_step_bytes=256,
        flat_steps=2, window_tile_bytes=1024, checkpoint_tile_elems=8, gather_rows=4,
        memcpy_chunk_bytes=64, memcpy_split=2,
    ),
}


def for_target(backend: str, arch: str) -> LaunchTuning:
    """The table entry for Triton's target ``(backend, arch)`` (see the module docstring)."""
    if backend == "interpreter":
        return TABLE["interpreter"]
    if backend != "hip":
        raise RuntimeError(
            f"the rocm backend's kernels run on AMD GPUs, but Triton's active target is {backend!r} "
            "(on NVIDIA GPUs select the cuda backend)"
        )
    return TABLE.get(arch.split(":")[0], TABLE["default"])
