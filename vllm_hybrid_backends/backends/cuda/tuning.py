"""Launch shapes of the ``cuda`` backend's Triton kernels, per NVIDIA architecture (one table).

The kernels are pure memory streams, so the shapes aim at bandwidth: each program moves a few
tens of KiB in 16-byte-per-lane steps (wide, coalesced), enough programs to fill every SM even for
one request, no software pipelining (``num_stages=1``: a copy has no loop-carried reuse).

These are starting points derived from the hardware's warp size and SM counts, not values tuned
on the hardware: this project's CI has no NVIDIA GPU. ``bench/kernels.py`` on a GPU machine is
the way to revisit them; change the table, nothing else.

Keys are Triton's target arch for CUDA (compute capability as an int: 80 = A100, 90 = H100/H200,
100 = B200); ``"interpreter"`` is used under ``TRITON_INTERPRET=1`` (CPU tensors, where every
program costs Python time, so programs are made large).
"""

from __future__ import annotations

from ..triton_state_kernels import LaunchTuning

_DEFAULT = LaunchTuning(
    name="cuda-default", lanes_per_warp=32, num_warps=4, flat_step_bytes=4096, flat_steps=4,
    window_tile_bytes=8192, checkpoint_tile_elems=2048, gather_rows=64,
    memcpy_chunk_bytes=4096, memcpy_split=8,
)

TABLE: dict[str, LaunchTuning] = {
    "default": _DEFAULT,
    # Ampere (A100): 108 SMs, 40 MB L2
    "80": _DEFAULT,
    # Hopper (H100/H200): 132 SMs, higher bandwidth per SM: larger programs, 8 warps
    "90": LaunchTuning(
        name="cuda-sm90", lanes_per_warp=32, num_warps=8, flat_step_bytes=8192, flat_steps=4,
        window_tile_bytes=16384, checkpoint_tile_elems=4096, gather_rows=64,
        memcpy_chunk_bytes=8192, memcpy_split=16,
    ),
    # Blackwell (B200): as Hopper
    "100": LaunchTuning(
        name="cuda-sm100", lanes_per_warp=32, num_warps=8, flat_step_bytes=8192, flat_steps=4,
        window_tile_bytes=16384, checkpoint_tile_elems=4096, gather_rows=64,
        memcpy_chunk_bytes=8192, memcpy_split=16,
    ),
    # small tiles so the parity tests cover multi-tile items, multi-step loops and chunk order
    "interpreter": LaunchTuning(
        name="cuda-interpreter", lanes_per_warp=32, num_warps=4, flat_step_bytes=256,
        flat_steps=2, window_tile_bytes=1024, checkpoint_tile_elems=8, gather_rows=4,
        memcpy_chunk_bytes=64, memcpy_split=2,
    ),
}


def for_target(backend: str, arch: str) -> LaunchTuning:
    """The table entry for Triton's target ``(backend, arch)`` (see the module docstring)."""
    if backend == "interpreter":
        return TABLE["interpreter"]
    if backend != "cuda":
        raise RuntimeError(
            f"the cuda backend's kernels run on NVIDIA GPUs, but Triton's active target is {backend!r} "
            "(on AMD GPUs select the rocm backend)"
        )
    return TABLE.get(arch, TABLE["default"])
