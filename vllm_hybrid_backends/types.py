"""Plain data types shared by the hook specifications, the backends and the CLI."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class DeviceKind(str, enum.Enum):
    """The kind of accelerator a process runs on (detected once in :mod:`.device`)."""

    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"
    NPU = "npu"


class StateKind(str, enum.Enum):
    """How one Mamba state tensor is laid out, per block (dimension 0 is always the block).

    ``CONV_SD``: ``(num_blocks, state_len, dim)``, vLLM's default conv layout.
    ``CONV_DS``: ``(num_blocks, dim, state_len)``, ``VLLM_SSM_CONV_STATE_LAYOUT=DS``.
    ``TEMPORAL``: SSM / recurrent / linear-attention state, any trailing shape.
    """

    CONV_SD = "conv_sd"
    CONV_DS = "conv_ds"
    TEMPORAL = "temporal"

    @property
    def is_conv(self) -> bool:
        return self is not StateKind.TEMPORAL


@dataclass(frozen=True)
class MambaStateTensor:
    """One state tensor of one Mamba layer: ``tensor[block]`` is the state held in that block.

    ``group`` selects the row of the per-group block ids / block table that addresses it
    (vLLM allocates blocks per KV-cache group).
    """

    tensor: torch.Tensor
    kind: StateKind
    group: int = 0
    layer: str = ""

    @property
    def state_len(self) -> int:
        """Tokens in a conv window (conv kinds only)."""
        if self.kind is StateKind.CONV_SD:
            return int(self.tensor.shape[1])
        if self.kind is StateKind.CONV_DS:
            return int(self.tensor.shape[2])
        raise ValueError(f"state_len is defined for conv states only, not {self.kind.value}")


@dataclass(frozen=True)
class CheckpointBatch:
    """Aligned boundaries inside one prefill forward whose states are stored into cache blocks.

    One entry per checkpoint ``k`` (all int tensors of length K):

    - ``token_end[k]``: row of the token-major conv input just past the checkpoint: the stored
      conv window is the ``state_len`` inputs ending before this row.
    - ``seq_start[k]``: first row of that checkpoint's sequence in the conv input; window rows
      before it come from ``initial_block[k]``.
    - ``initial_block[k]``: block holding the conv state the sequence started from, or ``-1``
      for a fresh sequence (zeros).
    - ``dst_block[k]``: block that receives the state.
    - ``temporal_row[k]``: row of the temporal source (e.g. the scan's chunk states) holding the
      state at that checkpoint.
    """

    token_end: torch.Tensor
    seq_start: torch.Tensor
    initial_block: torch.Tensor
    dst_block: torch.Tensor
    temporal_row: torch.Tensor


@dataclass(frozen=True)
class BackendIdentity:
    """Who a backend is. ``priority`` breaks ties in ``auto`` selection (higher wins)."""

    name: str
    device_kind: DeviceKind
    priority: int
    description: str = ""


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run in this process, and why (or why not)."""

    available: bool
    reason: str


@dataclass(frozen=True)
class BackendStatus:
    """A backend as seen by selection and ``doctor``: identity, availability, hook coverage."""

    identity: BackendIdentity
    availability: Availability
    hooks: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.identity.name
