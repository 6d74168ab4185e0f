"""The Triton backend's per-vendor data: which vendor a registration is for, how its devices are
found, and the launch shapes of the kernels per architecture. Vendors differ here and nowhere
else: :mod:`.backend` and :mod:`.kernels` are one code path for both.

Launch shapes. The kernels are pure memory streams, so the shapes aim at bandwidth: each program
moves a few tens of KiB in 16-byte-per-lane steps (wide, coalesced), enough programs to fill
every SM/CU even for one request, no software pipelining (``num_stages=1``: a copy has no
loop-carried reuse, and the AMD pipeliner is where known compiler crashes live, below). NVIDIA
executes 32-lane warps, AMD CDNA 64-lane wavefronts (``num_warps`` counts wavefronts there). The
values follow from lane widths and SM/CU counts. Checked once on an H100 (2026-11-27,
docs/kernels.md): with the ``"90"`` entry the copy kernel's device time is 0.96-1.0x a
``copy_`` of the same bytes, and other step sizes, step counts and warp counts did no better;
the other entries are untested on hardware (CI has none). ``make gpu-check`` /
``bench/kernels.py`` on a GPU is how to revisit them: change a table, nothing else.

Keys are Triton's target arch: the CUDA compute capability as an int (80 = A100, 90 = H100/H200,
100 = B200), the HIP gfx name (``gfx90a`` MI210/MI250, ``gfx942`` MI300X/MI325X, ``gfx950``
MI350X/MI355X); ``"interpreter"`` under ``TRITON_INTERPRET=1`` (CPU tensors, where each program
costs Python time; small tiles so the parity tests cover multi-tile items and chunk order).

AMD notes. Overlap semantics (vLLM #50729). vLLM's ``batch_memcpy_kernel`` raced on AMD CI: a spec-decode
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

from collections.abc import Mapping
from dataclasses import dataclass

from ...types import DeviceKind


@dataclass(frozen=True)
class LaunchTuning:
    """Launch shapes for one device architecture."""

    name: str
    lanes_per_warp: int  # 32 on NVIDIA, 64 (wavefront) on AMD CDNA
    num_warps: int
    flat_step_bytes: int  # bytes one program moves per load/store step of a whole-block copy
    flat_steps: int  # steps per program: a program copies flat_step_bytes * flat_steps bytes
    window_tile_bytes: int  # bytes of one (tokens x channels) tile of a conv-window copy
    checkpoint_tile_elems: int  # elements per program in a checkpoint store
    gather_rows: int  # block-table rows per program in the aligned-index gather
    memcpy_chunk_bytes: int  # bytes per step of the batch_memcpy override
    memcpy_split: int  # programs sharing one non-overlapping batch_memcpy entry
    num_stages: int = 1  # no software pipelining: these kernels are pure streams


_NVIDIA_DEFAULT = LaunchTuning(
    name="cuda-default", lanes_per_warp=32, num_warps=4, flat_step_bytes=4096, flat_steps=4,
    window_tile_bytes=8192, checkpoint_tile_elems=2048, gather_rows=64,
    memcpy_chunk_bytes=4096, memcpy_split=8,
)

NVIDIA_TABLE: dict[str, LaunchTuning] = {
    "default": _NVIDIA_DEFAULT,
    # Ampere (A100): 108 SMs, 40 MB L2
    "80": _NVIDIA_DEFAULT,
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


_AMD_DEFAULT = LaunchTuning(
    name="rocm-default", lanes_per_warp=64, num_warps=4, flat_step_bytes=8192, flat_steps=4,
    window_tile_bytes=16384, checkpoint_tile_elems=4096, gather_rows=64,
    memcpy_chunk_bytes=8192, memcpy_split=8,
)

AMD_TABLE: dict[str, LaunchTuning] = {
    "default": _AMD_DEFAULT,
    # MI210/MI250 (CDNA2): 104/110 CUs per die
    "gfx90a": _AMD_DEFAULT,
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


@dataclass(frozen=True)
class Vendor:
    """One registration of the Triton backend."""

    name: str  # the backend's name, and vLLM's current_platform.device_name it overrides for
    device_kind: DeviceKind
    description: str
    torch_build: str  # "cuda" or "hip": which torch.version attribute says the build has it
    build_label: str  # how users name that build and its devices
    visible_devices_env: str  # named in the "no device visible" reason
    triton_target: str  # Triton's target backend name on this vendor's GPUs
    table: Mapping[str, LaunchTuning]

    def for_target(self, backend: str, arch: str) -> LaunchTuning:
        """The table entry for Triton's target ``(backend, arch)``."""
        if backend == "interpreter":
            return self.table["interpreter"]
        if backend != self.triton_target:
            other = "rocm" if self.name == "cuda" else "cuda"
            raise RuntimeError(
                f"the {self.name} backend's kernels run on {self.triton_target!r} targets, but "
                f"Triton's active target is {backend!r} (select the {other} backend there)")
        return self.table.get(arch.split(":")[0], self.table["default"])


NVIDIA = Vendor(name="cuda", device_kind=DeviceKind.CUDA, description="Triton kernels for NVIDIA GPUs",
                torch_build="cuda", build_label="CUDA", visible_devices_env="CUDA_VISIBLE_DEVICES",
                triton_target="cuda", table=NVIDIA_TABLE)
AMD = Vendor(name="rocm", device_kind=DeviceKind.ROCM, description="Triton kernels for AMD GPUs (ROCm)",
             torch_build="hip", build_label="ROCm/HIP", visible_devices_env="HIP_VISIBLE_DEVICES",
             triton_target="hip", table=AMD_TABLE)
