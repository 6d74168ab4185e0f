"""The ``cuda`` backend's state operations: the shared Triton kernels
(:mod:`..triton_state_kernels`) launched with the NVIDIA shapes of :mod:`.tuning`.

Imported lazily, by the first hook call, because it imports ``triton``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...types import CheckpointBatch, MambaStateTensor
from .. import triton_state_kernels as shared
from . import tuning


def launch_tuning(device: torch.device) -> shared.LaunchTuning:
    """The tuning-table entry for the GPU the kernels will run on."""
    return tuning.for_target(*shared.device_target(device))


def copy_state_blocks(states: Sequence[MambaStateTensor], src_blocks: torch.Tensor,
                      dst_blocks: torch.Tensor) -> None:
    shared.copy_state_blocks(states, src_blocks, dst_blocks, launch_tuning(states[0].tensor.device))


def precopy_running_states(states: Sequence[MambaStateTensor], block_tables: Sequence[torch.Tensor],
                           src_cols: torch.Tensor, dst_cols: torch.Tensor,
                           token_bias: torch.Tensor) -> None:
    shared.precopy_running_states(states, block_tables, src_cols, dst_cols, token_bias,
                                  launch_tuning(states[0].tensor.device))


def postprocess_accepted_states(states: Sequence[MambaStateTensor],
                                block_tables: Sequence[torch.Tensor], running_cols: torch.Tensor,
                                num_running_tokens: torch.Tensor, num_accepted: torch.Tensor,
                                block_size: int, num_accepted_out: torch.Tensor) -> None:
    shared.postprocess_accepted_states(states, block_tables, running_cols, num_running_tokens,
                                       num_accepted, block_size, num_accepted_out,
                                       launch_tuning(states[0].tensor.device))


def store_checkpoints(states: Sequence[MambaStateTensor], sources: Sequence[torch.Tensor],
                      checkpoints: CheckpointBatch) -> None:
    shared.store_checkpoints(states, sources, checkpoints, launch_tuning(states[0].tensor.device))


def gather_aligned_state_indices(block_tables: Sequence[torch.Tensor], seq_lens: torch.Tensor,
                                 block_size: int, num_slots: int) -> torch.Tensor:
    return shared.gather_aligned_state_indices(block_tables, seq_lens, block_size, num_slots,
                                               launch_tuning(block_tables[0].device))


def batch_memcpy(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor,
                 BLOCK_SIZE: int | None = None) -> None:
    """Replaces ``vllm.v1.worker.mamba_utils.batch_memcpy_kernel`` (same arguments, grid dropped;
    vLLM's BLOCK_SIZE is ignored: the chunk size comes from the tuning table)."""
    shared.batch_memcpy(src_ptrs, dst_ptrs, sizes, launch_tuning(src_ptrs.device))
