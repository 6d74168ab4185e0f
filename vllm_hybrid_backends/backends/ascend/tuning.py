"""Ascend launch limits and per-SoC tuning, kept in one place.

Facts the numbers come from (Triton-Ascend programming guide, vllm-ascend):

- Triton-Ascend flattens the whole launch grid into one core dimension that must not exceed
  65535 programs; the guide recommends launching about one program per physical vector core and
  looping over the work inside the kernel (``range(pid, n, num_programs)``).
- A program stages every tile it loads in the core's Unified Buffer (192 KiB on A2/A3); a tile
  of at most half of it leaves room for double buffering. We use far less.
- 310P has no Triton-Ascend (vllm-ascend's CI uninstalls it), so it takes the torch path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GRID_LIMIT = 65535
"""Most programs one Triton-Ascend launch may have (all grid axes multiplied)."""

PATH_ENV = "VLLM_HYBRID_ASCEND_PATH"
PATHS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class SocTuning:
    """How the ``ascend`` backend runs on one SoC family."""

    family: str
    triton: bool  # Triton-Ascend kernels run here
    vector_cores: int  # fallback when the driver cannot say
    tile_bytes: int  # bytes one program moves per load/store (fits the Unified Buffer)
    split_bytes: int  # copies larger than this are split so several cores share them


_FAMILIES = {
    # A2 (Atlas 800T A2, 910B*): 20-24 AI cores, two vector cores each.
    "a2": SocTuning("a2", triton=True, vector_cores=40, tile_bytes=16 * 1024, split_bytes=256 * 1024),
    # A3 (Atlas A3, 910_93*): same core as A2, two dies.
    "a3": SocTuning("a3", triton=True, vector_cores=48, tile_bytes=16 * 1024, split_bytes=256 * 1024),
    # 310P: inference card without Triton-Ascend.
    "310p": SocTuning("310p", triton=False, vector_cores=8, tile_bytes=8 * 1024, split_bytes=128 * 1024),
    # Anything else (A5, future parts, CPU tensors under the Triton interpreter): A2 values,
    # Triton only if triton-ascend turns out to be usable.
    "unknown": SocTuning("unknown", triton=True, vector_cores=40, tile_bytes=16 * 1024,
                         split_bytes=256 * 1024),
}


def soc_family(soc_name: str) -> str:
    """Map torch_npu's device name (``Ascend910B2``, ``Ascend910_9392``, ``Ascend310P3``) to a family."""
    name = soc_name.lower().replace(" ", "")
    if "310p" in name:
        return "310p"
    if "910_93" in name or "910c" in name:
        return "a3"
    if "910b" in name:
        return "a2"
    return "unknown"


def for_soc(soc_name: str) -> SocTuning:
    return _FAMILIES[soc_family(soc_name)]


def requested_path() -> str:
    """``VLLM_HYBRID_ASCEND_PATH``: ``auto`` (by SoC), ``triton`` or ``torch``; bad values raise."""
    value = os.environ.get(PATH_ENV, "auto").strip().lower() or "auto"
    if value not in PATHS:
        raise ValueError(f"{PATH_ENV}={value!r} is not a path; allowed values: {', '.join(PATHS)}")
    return value


def launch_grid(num_jobs: int, vector_cores: int) -> int:
    """Programs for a launch over ``num_jobs`` independent jobs: one per job, at most one per
    vector core, never more than :data:`GRID_LIMIT`, at least 1. Programs loop over the rest."""
    if num_jobs < 0 or vector_cores < 1:
        raise ValueError(f"need num_jobs >= 0 and vector_cores >= 1, got {num_jobs}, {vector_cores}")
    return max(1, min(num_jobs, vector_cores, GRID_LIMIT))


def tile_shape(max_cols: int, word_bytes: int, tile_bytes: int) -> tuple[int, int]:
    """(rows, cols) of the 2-D tile one program moves at a time, both powers of two.

    ``cols`` covers the widest job row (up to the whole tile), the remaining tile budget goes to
    rows, so short rows (a DS conv window is 3-4 elements wide) still move a full tile at once.
    """
    if max_cols < 1 or word_bytes not in (1, 2, 4, 8) or tile_bytes < word_bytes:
        raise ValueError(f"bad tile request: max_cols={max_cols}, word_bytes={word_bytes}, "
                         f"tile_bytes={tile_bytes}")
    words = _floor_pow2(tile_bytes // word_bytes)
    cols = min(_ceil_pow2(max_cols), words)
    return words // cols, cols


def _ceil_pow2(value: int) -> int:
    return 1 << (value - 1).bit_length()


def _floor_pow2(value: int) -> int:
    return 1 << (value.bit_length() - 1)
