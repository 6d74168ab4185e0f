"""The backend interface: one pluggy hook per Mamba state operation vLLM's align mode needs.

A backend is an ordinary pluggy plugin (a module or object with ``@hookimpl`` functions)
registered under its own name. The built-in ``cpu`` backend (:mod:`.reference`) implements
every hook in pure torch; it is the CPU backend and the oracle every other backend is tested
against. A backend may implement any subset of the *state operation* hooks: the ones it leaves
out are delegated to ``cpu``, and ``doctor`` says which.

Call sites never use ``pm.hook.*`` directly: :mod:`.plugins` exposes typed facade functions that
validate inputs and call the *selected* backend's implementation.

Conventions shared by every state-operation hook:

- ``states`` is a sequence of :class:`~.types.MambaStateTensor`; dimension 0 of every tensor is
  the cache block. ``state.group`` selects the row of per-group block ids / the block table.
- Index tensors are integer tensors on the states' device or on the CPU.
- Every read happens before any write ("snapshot" semantics): overlapping source and destination
  regions, including in-place conv-window shifts inside one block, give the same result as if
  all sources were copied out first.
- A destination block may appear at most once per group; the facade rejects duplicates.
- Per-step hooks (precopy, postprocess, checkpoint store, index gather) never read a device
  tensor's values on the host (no ``.item()``, ``.tolist()``, ``.cpu()``, boolean-mask indexing):
  *which* rows move where is :mod:`.backends.plan`, tensor ops written once for every backend; a
  backend implements only the move. The facades check plans made from host tensors.
- Returning ``None`` means the operation was done (these hooks write into ``states``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch

    from .types import (
        Availability,
        BackendIdentity,
        BackendStatus,
        CheckpointBatch,
        MambaStateTensor,
    )

PROJECT_NAME = "hybrid_backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# ---------------------------------------------------------------------------------------------
# Identity and selection: called in every vLLM process (front-end, engine core, workers) and by
# ``doctor``, the first time a backend is needed.
# ---------------------------------------------------------------------------------------------


@hookspec
def hb_backend_identity() -> BackendIdentity:
    """Return this backend's identity: name, device kind and ``auto``-selection priority.

    Every backend plugin implements it; the name must equal the name the plugin was registered
    under. Cheap: no device initialisation, no heavy imports.
    """


@hookspec
def hb_backend_probe() -> Availability:
    """Say whether this backend can run in the current process, and why.

    Called once per backend per process by selection and ``doctor``. May import the device
    runtime lazily (``torch_npu``, ``triton``) but must never raise: failures become
    ``Availability(False, reason)`` with a reason a user can act on.
    """


@hookspec(firstresult=True)
def hb_select_backend(
    requested: str, device_kind: str, candidates: Sequence[BackendStatus]
) -> str | None:
    """Pick the backend to use; the first non-``None`` answer wins.

    :param requested: the value of ``VLLM_HYBRID_BACKEND`` (``auto`` or a backend name),
        already checked against the registered names.
    :param device_kind: the detected :class:`~.types.DeviceKind` value of this process.
    :param candidates: every registered backend with its availability, in registration order.

    The built-in selector (registered ``trylast``) honours an explicit name and, for ``auto``,
    takes the highest-priority available backend for ``device_kind``, else ``cpu``. A plugin
    implements this hook to impose another policy; returning ``None`` defers to the next one.
    Asking for an unavailable backend is an error raised by the caller, never a fallback.
    """


# ---------------------------------------------------------------------------------------------
# State operations: called in vLLM worker processes, on every scheduler step that needs them,
# with the worker's cache tensors. Implementations must not synchronise with the host beyond
# what their inputs force: per-step hooks make none (tests/backends/test_no_host_reads.py).
# ---------------------------------------------------------------------------------------------


@hookspec
def hb_copy_state_blocks(
    states: Sequence[MambaStateTensor], src_blocks: torch.Tensor, dst_blocks: torch.Tensor
) -> None:
    """Batched block-to-block copy: ``state.tensor[dst_blocks[g, i]] = state.tensor[src_blocks[g, i]]``.

    The operation behind vLLM's ``batch_memcpy`` path (moving a running state into a new block),
    copy-on-write and prefix-hit restores. Whole blocks of every state kind are copied, both conv
    layouts included.

    :param states: the state tensors of every layer of every Mamba group involved.
    :param src_blocks: int tensor ``[num_groups, N]``; row ``g`` addresses states of group ``g``.
    :param dst_blocks: int tensor ``[num_groups, N]``, same shape.
    """


@hookspec
def hb_precopy_running_states(
    states: Sequence[MambaStateTensor],
    block_tables: Sequence[torch.Tensor],
    src_cols: torch.Tensor,
    dst_cols: torch.Tensor,
    token_bias: torch.Tensor,
) -> None:
    """Before the forward: move each request's previous running state into its new block column.

    Called once per step by the align-mode pre-forward path (vLLM ``preprocess_mamba`` /
    ``precopy_mamba_align_fused_kernel``). For request ``r`` with ``src_cols[r] >= 0`` and not
    (``src_cols[r] == dst_cols[r]`` and ``token_bias[r] == 0``), with ``bt = block_tables[g][r]``
    and ``b = token_bias[r]`` (accepted speculative tokens minus one):

    - conv state: the window shifted left by ``b`` tokens,
      ``state[bt[dst], :L-b] = state[bt[src], b:]`` along the ``state_len`` axis (``L``), the
      last ``b`` positions of the destination left as they were;
    - temporal state: the accepted speculative column, ``state[bt[dst]] = state[bt[src + b]]``.

    Each request owns its running blocks: no request reads a block another request writes (the
    facade rejects it for host tensors; vLLM's block tables never do it), so a mover needs no
    staging across requests. Rows whose columns fall outside their table move nothing.

    :param block_tables: one int tensor ``[num_reqs, max_cols]`` per Mamba group.
    :param src_cols: int ``[num_reqs]``, previous running column, ``-1`` for none.
    :param dst_cols: int ``[num_reqs]``, the running column for this step.
    :param token_bias: int ``[num_reqs]``, ``>= 0`` and ``< L``.
    """


@hookspec
def hb_postprocess_accepted_states(
    states: Sequence[MambaStateTensor],
    block_tables: Sequence[torch.Tensor],
    running_cols: torch.Tensor,
    num_running_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    block_size: int,
    num_accepted_out: torch.Tensor,
) -> None:
    """After the forward with speculative decoding: save the state at the last aligned boundary.

    Called once per step by the align-mode post-forward path (vLLM ``postprocess_mamba_align_gpu``
    / ``postprocess_mamba_fused_kernel``). Per request ``r``: the running state in column
    ``running_cols[r]`` covers ``num_running_tokens[r]`` tokens and ``num_accepted[r] >= 1``
    tokens were accepted, so ``new = num_running_tokens + num_accepted - 1`` tokens are computed.
    With ``aligned = new // block_size * block_size``: if ``aligned >= num_running_tokens``, the
    state after exactly ``aligned`` tokens is copied from column ``running_cols[r]`` with token
    bias ``aligned - num_running_tokens`` (same copy rule as :func:`hb_precopy_running_states`)
    into column ``aligned // block_size - 1``; when that column equals the running column,
    ``num_accepted_out[r]`` is set to ``1``. Other entries of ``num_accepted_out`` are untouched.
    Requests own their blocks as in :func:`hb_precopy_running_states`. A row given
    ``2 * block_size - 1`` running tokens and 1 accepted moves nothing
    (:func:`.backends.plan.skipped_row_inputs`).

    :param num_accepted_out: int ``[num_reqs]``, may be the same tensor as ``num_accepted``.
    """


@hookspec
def hb_store_checkpoints(
    states: Sequence[MambaStateTensor],
    sources: Sequence[torch.Tensor],
    checkpoints: CheckpointBatch,
) -> None:
    """Write the states at aligned positions inside a prefill chunk into their cache blocks.

    Called by a layer's forward (or a patch around it) after the scan, for the boundaries the
    scheduler asked to keep, so no extra forward step is needed to materialise them.
    ``states[j]`` is filled from ``sources[j]``:

    - conv state: ``sources[j]`` is the token-major pre-conv input ``[num_tokens, dim]``; the
      window for checkpoint ``k`` is rows ``[token_end[k] - L, token_end[k])``, where rows before
      ``seq_start[k]`` come from the tail of ``initial_block[k]``'s conv state (zeros when ``-1``);
      it is stored in the state's own layout.
    - temporal state: ``sources[j][temporal_row[k]]`` (same trailing shape as a block) is stored,
      cast to the state's dtype.

    A checkpoint whose ``dst_block[k]`` is negative is skipped (a planned boundary whose block
    table column holds no block, found on the device without a host read). A checkpoint may not
    start from a block the same call writes, and a block is written at most once (the facade
    rejects both for host tensors).
    """


@hookspec
def hb_gather_aligned_state_indices(
    block_tables: Sequence[torch.Tensor], seq_lens: torch.Tensor, block_size: int, num_slots: int
) -> torch.Tensor:
    """Gather the state block ids each request reads and writes this step, for all groups at once.

    ``out[g, r, j] = block_tables[g][r, max((seq_lens[r] - 1) // block_size, 0) + j]`` for
    ``j < num_slots`` (1 + speculative blocks); a column past the table's width gives ``-1``.
    Used by attention-metadata builders (vLLM ``get_aligned_state_indices_multi_group_kernel``).

    :return: int32 tensor ``[num_groups, num_reqs, num_slots]`` on the block tables' device.
    """


# ---------------------------------------------------------------------------------------------
# Wiring into vLLM: called once per worker process, after vLLM's platform registered its own
# Triton-kernel overrides.
# ---------------------------------------------------------------------------------------------


@hookspec
def hb_kernel_overrides(platform_name: str) -> dict[str, Callable[..., object]] | None:
    """Return vLLM Triton kernels this backend replaces: ``{dotted kernel path: implementation}``.

    Installed through ``vllm.triton_utils.dispatcher.register_kernels`` in every worker process,
    *after* the platform's ``register_triton_kernel_overrides``, so for a name both define the
    backend's implementation is the one vLLM calls (the platform's stays reachable as the
    wrapped original). Implementations take the kernel's own arguments, grid dropped.
    Only the selected backend's overrides are installed. ``None`` means none.

    :param platform_name: vLLM's ``current_platform.device_name`` (``cpu``, ``cuda``, ...).
    """


STATE_OPERATION_HOOKS = (
    "hb_copy_state_blocks",
    "hb_precopy_running_states",
    "hb_postprocess_accepted_states",
    "hb_store_checkpoints",
    "hb_gather_aligned_state_indices",
    "hb_kernel_overrides",
)
"""Hooks a backend may implement or delegate to ``cpu``; reported per backend by ``doctor``."""
