"""Align-mode decisions shared by every backend: where prefill chunks stop and which Mamba
states are kept. Pure functions of token counts; the patches in :mod:`.patches` only wire them
into vLLM's scheduler and KV-cache coordinator.

Settings (read once per call from the environment, so a process can switch them):

- ``VLLM_HYBRID_TAIL_CHECKPOINTS`` (default 4, ``0`` = off): besides the prompt's last aligned
  boundary (which vLLM keeps), keep up to this many Mamba states at boundaries 1, 2, 4, 8, ...
  blocks before it. A later request that diverges inside the prompt then resumes from the
  nearest one instead of recomputing from zero (vLLM's own junction checkpoint only helps the
  *third* request of a branch).
- ``VLLM_HYBRID_DECODE_CHECKPOINTS`` (default 1): keep the Mamba state at every block boundary
  crossed while decoding, so the next turn of a conversation (prompt + output + new message)
  hits past the output (vLLM #50551).
- ``VLLM_HYBRID_SUFFIX_EVICTION`` (default 1): free a finished request's blocks so the cache
  forgets its prefix from the end, all groups together (attention blocks past a Mamba state
  cannot be hit without it, and a state cannot be hit without the attention blocks before it).
  vLLM frees group by group, so every attention block of a request is evicted before any of
  its Mamba states: kept snapshots then push attention prefixes out of the cache.
- ``VLLM_HYBRID_MAMBA_GRID`` (default 1): when the scheduler's block size is smaller than the
  Mamba block size, floor non-final chunk ends to the Mamba grid, so a state is never cached
  under the wrong boundary (vLLM #54076).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

TAIL_CHECKPOINTS_ENV = "VLLM_HYBRID_TAIL_CHECKPOINTS"
DECODE_CHECKPOINTS_ENV = "VLLM_HYBRID_DECODE_CHECKPOINTS"
MAMBA_GRID_ENV = "VLLM_HYBRID_MAMBA_GRID"
SUFFIX_EVICTION_ENV = "VLLM_HYBRID_SUFFIX_EVICTION"
DEFAULT_TAIL_CHECKPOINTS = 4


@dataclass(frozen=True)
class AlignPolicy:
    """What the plugin changes about align-mode scheduling and retention."""

    tail_checkpoints: int = DEFAULT_TAIL_CHECKPOINTS
    decode_checkpoints: bool = True
    mamba_grid: bool = True
    suffix_eviction: bool = True


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    value = value.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: allowed values are 1/0, true/false, yes/no, on/off")


def current_policy() -> AlignPolicy:
    """The policy from the environment; a bad value raises naming it and what is allowed."""
    raw = os.environ.get(TAIL_CHECKPOINTS_ENV, "").strip()
    if raw == "":
        tail = DEFAULT_TAIL_CHECKPOINTS
    else:
        try:
            tail = int(raw)
        except ValueError:
            tail = -1
        if not 0 <= tail <= 64:
            raise ValueError(f"{TAIL_CHECKPOINTS_ENV}={raw!r}: allowed values are integers 0..64")
    return AlignPolicy(
        tail_checkpoints=tail,
        decode_checkpoints=_flag(DECODE_CHECKPOINTS_ENV, True),
        mamba_grid=_flag(MAMBA_GRID_ENV, True),
        suffix_eviction=_flag(SUFFIX_EVICTION_ENV, True),
    )


def last_prompt_boundary(num_prompt_tokens: int, block_size: int) -> int:
    """The last boundary vLLM keeps for a prompt: the state a resend of it resumes from."""
    return max(num_prompt_tokens - 1, 0) // block_size * block_size


def tail_checkpoints(num_prompt_tokens: int, block_size: int, count: int) -> tuple[int, ...]:
    """Boundaries 1, 2, 4, ... blocks before the prompt's last boundary (at most ``count``).

    Spacing doubles away from the end: divergence near the end (agentic histories, edited
    turns) loses at most the distance to the end, and a prompt of ``n`` blocks keeps
    ``O(log n)`` extra states.
    """
    last = last_prompt_boundary(num_prompt_tokens, block_size)
    positions: list[int] = []
    distance = block_size
    while len(positions) < count and last - distance > 0:
        positions.append(last - distance)
        distance *= 2
    return tuple(sorted(positions))


def decode_boundary(num_prompt_tokens: int, num_tokens: int, block_size: int) -> int | None:
    """The newest boundary at or past the prompt's end (its state is kept for the next turn), or None."""
    boundary = num_tokens // block_size * block_size
    return boundary if boundary >= num_prompt_tokens and boundary > 0 else None


def retained_boundaries(
    num_prompt_tokens: int, num_tokens: int, block_size: int, policy: AlignPolicy
) -> tuple[int, ...]:
    """Extra token positions whose Mamba state the KV-cache manager must keep (hash)."""
    kept = set(tail_checkpoints(num_prompt_tokens, block_size, policy.tail_checkpoints))
    if policy.decode_checkpoints:
        decoded = decode_boundary(num_prompt_tokens, num_tokens, block_size)
        if decoded is not None:
            kept.add(decoded)
    return tuple(sorted(kept))


def chunk_end(
    start: int,
    end: int,
    num_prompt_tokens: int,
    prefill_end: int,
    split_block_size: int,
    state_block_size: int,
    policy: AlignPolicy,
) -> int:
    """Where a prefill chunk ``[start, end)`` (as vLLM chose it) must stop instead.

    ``split_block_size`` is the block vLLM aligned the chunk on; ``state_block_size`` the block
    on which every group can hold a state (the scheduler's LCM block; equal in the common case).
    Stops at the first tail checkpoint strictly inside the chunk and, when the state block is
    coarser, floors a non-final end to the state grid (unless that leaves nothing to schedule:
    a chunk too short to reach the next boundary keeps its end, its state private).
    """
    if start >= prefill_end:
        return end
    checkpoints = tail_checkpoints(num_prompt_tokens, state_block_size, policy.tail_checkpoints)
    stops = [c for c in checkpoints if start < c < end]
    if stops:
        end = stops[0]
    if policy.mamba_grid and state_block_size > split_block_size and end < prefill_end:
        floored = end // state_block_size * state_block_size
        if floored > start:
            end = floored
    return end


def suffix_eviction_order(groups: Sequence[tuple[int, Sequence[T]]]) -> list[T]:
    """A request's blocks of every group, in the order the cache should evict them.

    ``groups`` holds, per KV-cache group, its block size and its blocks in position order
    (block ``i`` covers tokens ``[i * size, (i + 1) * size)``). Blocks that end later go first;
    at equal ends the groups keep their given order, each group's blocks stay tail first.
    """
    keyed = [((index + 1) * size, group, block)
             for group, (size, blocks) in enumerate(groups)
             for index, block in enumerate(blocks)]
    keyed.sort(key=lambda item: (-item[0], item[1]))
    return [block for _, _, block in keyed]
