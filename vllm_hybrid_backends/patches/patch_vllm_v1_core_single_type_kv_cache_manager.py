"""Give the plugin's tail checkpoints a Mamba block inside the prefill chunk, so the forward
stores them and the scheduler need not stop the chunk there.

- Targets: ``vllm.v1.core.single_type_kv_cache_manager.MambaManager.get_num_blocks_to_allocate``
  and ``MambaManager.allocate_new_blocks``.
- Why: in align mode a chunk's only new state is its last one: every block the chunk skips
  is padded with the null block. To keep a state at a tail checkpoint the scheduler patch had
  to end a chunk there, one extra forward step (all layers, sampling, scheduling) per
  checkpoint. Item 4 of the align-mode issue; ``vllm_map.md`` §4(a) option A.
- How: where the Mamba layers' forward stores interior states (:func:`stores_interior`:
  vLLM-CPU's gated delta net with this plugin's worker patches, or the replay's fake model),
  ``get_num_blocks_to_allocate`` adds one block per admitted tail checkpoint strictly inside
  the chunk (:func:`vllm_hybrid_backends.align.interior_tail_checkpoints`) to vLLM's count and
  remembers their columns; ``allocate_new_blocks`` then puts a fresh block where vLLM padded
  those columns with the null block. The worker finds them in its block table
  (:func:`vllm_hybrid_backends.align.interior_checkpoints`) and stores the state there through
  ``hb_store_checkpoints``; ``cache_blocks`` hashes them like any kept boundary, and
  ``remove_skipped_blocks`` hands them back to the pool after the step, still cached. Requests
  with a partial-block hit, speculative blocks or an internal prefill checkpoint keep vLLM's
  allocation (the scheduler then splits, as before). ``VLLM_HYBRID_INTERIOR_STATES=0`` turns it
  off.
- Upstream: none open for interior states; #37898 junction checkpoints cover one boundary.
- vLLM versions: 0.32.x, 0.33.x (same signatures and align-mode padding).
- Removal: when vLLM allocates caller-chosen interior state blocks itself.
"""

from __future__ import annotations

import importlib
from typing import Any

from .. import align
from . import patch_vllm_v1_core_kv_cache_coordinator as coordinator_patch
from . import patch_vllm_v1_core_kv_cache_manager as manager_patch

TARGET_MODULE = "vllm.v1.core.single_type_kv_cache_manager"
TARGET_SYMBOLS = ("MambaManager.get_num_blocks_to_allocate", "MambaManager.allocate_new_blocks")
PROCESS = "engine"

#: Mamba layer kinds (vLLM's ``MambaAttentionBackendEnum`` names) whose forward on vLLM-CPU
#: stores interior states through this plugin's worker patches.
CPU_INTERIOR_KINDS = frozenset({"GDN_ATTN"})
#: Set by the replay harness, whose fake model stores interior states for every kind; None
#: means "decide from the platform".
interior_override: bool | None = None

_ORIGINALS: dict[str, Any] = {}


def _manager_class() -> Any:
    return importlib.import_module(TARGET_MODULE).MambaManager


def missing() -> list[str]:
    try:
        cls = _manager_class()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    return [f"MambaManager.{name}" for name in ("get_num_blocks_to_allocate", "allocate_new_blocks")
            if not callable(getattr(cls, name, None))]


def _cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_cpu())
    except Exception:
        return False


def stores_interior(spec: Any) -> bool:
    """Whether the forward of this Mamba group's layers stores states inside a prefill chunk."""
    if (getattr(spec, "mamba_cache_mode", None) != "align" or spec.num_speculative_blocks
            or spec.num_prefill_checkpoint_blocks):
        return False
    if interior_override is not None:
        return interior_override
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    return kind in CPU_INTERIOR_KINDS and _cpu_platform() and _worker_patches_apply()


_worker_patches_checked: list[bool] = []


def _worker_patches_apply() -> bool:
    """Whether the worker processes (same vLLM) apply this plugin's patches, which store the
    interior states: all or none of them apply, so a lacking one means no interior blocks."""
    if not _worker_patches_checked:
        from . import is_optional, patch_modules

        _worker_patches_checked.append(all(
            not module.missing() for module in patch_modules("worker") if not is_optional(module)))
    return _worker_patches_checked[0]


def _stores_interior(manager: Any) -> bool:
    known = manager.__dict__.get("_hybrid_stores_interior")
    if known is None:
        known = stores_interior(manager.kv_cache_spec)
        manager._hybrid_stores_interior = known
    return known


def _interior_columns(manager: Any, request_id: str, start: int, end: int) -> list[int]:
    request = manager_patch.allocating_for.get()
    if request is None or request.request_id != request_id or not _stores_interior(manager):
        return []
    policy = align.active_policy()
    if not policy.interior_states or request_id in manager._partial_hit_reqs:
        return []
    if start >= max(request.num_prompt_tokens, request.num_tokens - 1):
        return []
    admitted = None
    if policy.adaptive_retention:
        ledger = coordinator_patch.LEDGER
        admitted = lambda kind: ledger.admits(kind, request_id)  # noqa: E731
    size = manager.block_size
    return [p // size - 1 for p in align.interior_tail_checkpoints(
        start, end, request.num_prompt_tokens, size, policy, admitted)]


def get_num_blocks_to_allocate(self: Any, request_id: str, num_tokens: int,
                               new_computed_blocks: Any, total_computed_tokens: int,
                               num_local_computed_tokens: int, num_tokens_main_model: int,
                               apply_admission_cap: bool = False, prefill_end: int = 0) -> int:
    count = _ORIGINALS["get_num_blocks_to_allocate"](
        self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
        num_local_computed_tokens, num_tokens_main_model,
        apply_admission_cap=apply_admission_cap, prefill_end=prefill_end)
    if self.mamba_cache_mode != "align":
        return count
    if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
        columns = []
    else:
        columns = _interior_columns(self, request_id, total_computed_tokens, num_tokens_main_model)
    if not apply_admission_cap:
        plans = self.__dict__.setdefault("_hybrid_interior_plans", {})
        if columns:
            plans[request_id] = columns
        else:
            plans.pop(request_id, None)
    return count + len(columns)


def allocate_new_blocks(self: Any, request_id: str, num_tokens: int,
                        num_tokens_main_model: int) -> list[Any]:
    plans = self.__dict__.get("_hybrid_interior_plans")
    plan = plans.pop(request_id, None) if plans else None
    if not plan:
        return _ORIGINALS["allocate_new_blocks"](self, request_id, num_tokens, num_tokens_main_model)
    blocks = self.req_to_blocks[request_id]
    before = len(blocks)
    returned = _ORIGINALS["allocate_new_blocks"](self, request_id, num_tokens, num_tokens_main_model)
    columns = [c for c in plan if before <= c < len(blocks) and blocks[c].is_null]
    if not columns:
        return returned
    for column, block in zip(columns, self.block_pool.get_new_blocks(len(columns))):
        blocks[column] = block
    # vLLM returns the blocks appended to the request (after a copy-on-write block, if any)
    appended = len(blocks) - before
    return list(returned[:len(returned) - appended]) + blocks[before:]


def apply() -> None:
    cls = _manager_class()
    if cls.get_num_blocks_to_allocate is not get_num_blocks_to_allocate:
        _ORIGINALS["get_num_blocks_to_allocate"] = cls.get_num_blocks_to_allocate
        cls.get_num_blocks_to_allocate = get_num_blocks_to_allocate
    if cls.allocate_new_blocks is not allocate_new_blocks:
        _ORIGINALS["allocate_new_blocks"] = cls.allocate_new_blocks
        cls.allocate_new_blocks = allocate_new_blocks


def revert() -> None:
    cls = _manager_class()
    for name in ("get_num_blocks_to_allocate", "allocate_new_blocks"):
        if name in _ORIGINALS:
            setattr(cls, name, _ORIGINALS.pop(name))
