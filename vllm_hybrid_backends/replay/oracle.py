"""The fake hybrid model: per-block Mamba "states" that fingerprint exactly the tokens processed.

:class:`FakeHybridWorker` stands in for vLLM's V1 GPU model runner of a hybrid model in align
mode. Each Mamba group has two state tensors shaped like a real layer's, but tiny:

- a conv state ``(num_blocks, state_len, 1)`` (or ``(num_blocks, 1, state_len)`` in the DS
  layout) holding ``token id + 1`` of the last ``conv_kernel - 1`` tokens (0 = before the
  sequence start), ``state_len = conv_kernel - 1 + num_speculative_tokens``;
- a temporal state ``(num_blocks, 2)`` holding ``(number of tokens, rolling hash of them)``.

Every step does what vLLM's worker does, in the same order, and every state movement goes
through the selected backend's hooks via the plugin's facades
(``vllm_hybrid_backends.plugins``):

1. apply the scheduler's copy-on-write block copies (``copy_state_blocks``);
2. ``preprocess_mamba``: move each request's previous running state (or, for a prefix-cache
   hit, the cached block column) into this step's running column, with the spec-decode token
   bias (``copy_state_blocks`` without bias, ``precopy_running_states`` with one);
3. the forward: read the initial state, **check it** (:class:`Mismatch` when it is not the
   fingerprint of exactly the request's first ``num_computed_tokens`` tokens), fold the
   scheduled tokens in, write the running state (and the per-draft temporal states);
   Mamba2-style groups also export the prefill checkpoint through ``store_checkpoints``;
4. with speculative decoding, ``postprocess_accepted_states``.

The new state is always computed from the state that was read, as a real model does, so a
wrong restore also poisons every state derived from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import interior, plugins
from ..types import CheckpointBatch, MambaStateTensor, StateKind

__all__ = ["FakeHybridWorker", "Mismatch", "fingerprint"]

HASH_MOD = (1 << 61) - 1
HASH_BASE = 1_000_003


def fingerprint(tokens: Sequence[int]) -> int:
    """Rolling hash of a token sequence (what a temporal state holds after those tokens)."""
    value = 0
    for token in tokens:
        value = (value * HASH_BASE + token + 1) % HASH_MOD
    return value


@dataclass(frozen=True)
class Mismatch:
    """A state read that is not the fingerprint of the tokens the scheduler says are computed."""

    request_id: str
    group: int  # vLLM KV-cache group id
    block: int
    column: int
    expected_tokens: int
    found_tokens: int
    what: str  # "temporal" or "conv"
    resume: bool  # first read after a prefix-cache hit / external load

    def describe(self) -> str:
        where = "resume from cache" if self.resume else "running state"
        if self.what == "conv":
            found = ("conv window does not hold the last tokens before position "
                     f"{self.expected_tokens}")
        elif self.found_tokens < 0:
            found = "temporal state holds a never-written value"
        elif self.found_tokens != self.expected_tokens:
            found = f"temporal state is the state after {self.found_tokens} tokens"
        else:
            found = f"temporal state covers {self.found_tokens} tokens of other content"
        return (f"{self.request_id}: group {self.group} block {self.block} (column "
                f"{self.column}): {found}; expected the state after the first "
                f"{self.expected_tokens} tokens ({where})")


@dataclass
class _Request:
    prompt_len: int
    block_ids: list[list[int]]
    num_computed: int = 0
    prefix_hash: list[int] = field(default_factory=lambda: [0])
    poisoned: bool = False  # a mismatch was reported and not yet cleared by a correct read

    def hash_upto(self, tokens: Sequence[int], n: int) -> int:
        ph = self.prefix_hash
        while len(ph) <= n:
            ph.append((ph[-1] * HASH_BASE + tokens[len(ph) - 1] + 1) % HASH_MOD)
        return ph[n]


class FakeHybridWorker:
    """The worker side of a replay: Mamba fingerprints, moved through the backend hooks.

    :param setup: the :class:`~.engine_config.EngineSetup` of the run.
    :param token_source: ``request_id -> list of all token ids`` (prompt + outputs so far).
    """

    def __init__(self, setup: Any, token_source: Any, *, conv_kernel: int,
                 num_spec_tokens: int = 0, conv_layout: str = "SD") -> None:
        from vllm.utils.math_utils import cdiv
        from vllm.v1.kv_cache_interface import MambaSpec

        self._cdiv = cdiv
        self.setup = setup
        self.tokens = token_source
        self.kernel = conv_kernel
        self.num_spec = num_spec_tokens
        groups = setup.kv_cache_config.kv_cache_groups
        self.group_ids: list[int] = list(setup.mamba_group_ids)
        specs = [groups[g].kv_cache_spec for g in self.group_ids]
        assert all(isinstance(s, MambaSpec) for s in specs)
        sizes = {s.block_size for s in specs}
        if len(sizes) != 1:
            raise ValueError(f"Mamba groups with different block sizes {sorted(sizes)}: vLLM's "
                             "preprocess_mamba uses one Mamba spec for all groups")
        self.block_size = sizes.pop()
        self.spec = specs[0]
        self.checkpoint_alignment = getattr(self.spec, "prefill_checkpoint_alignment", None) \
            if getattr(self.spec, "num_prefill_checkpoint_blocks", 0) > 0 else None  # 0.30+
        # the groups the KV-cache manager gives interior blocks (the engine's own decision)
        from ..patches.patch_vllm_v1_core_kv_cache_coordinator import stores_interior

        self.stores_interior = stores_interior(self.spec)
        num_blocks = setup.kv_cache_config.num_blocks
        self.state_len = conv_kernel - 1 + num_spec_tokens
        if conv_layout not in ("SD", "DS"):
            raise ValueError(f"conv_layout must be 'SD' or 'DS', got {conv_layout!r}")
        self.conv_kind = StateKind.CONV_SD if conv_layout == "SD" else StateKind.CONV_DS
        self.states: list[MambaStateTensor] = []
        self.conv: list[torch.Tensor] = []
        self.temporal: list[torch.Tensor] = []
        self.conv_np: list[Any] = []
        self.temporal_np: list[Any] = []
        for row, group in enumerate(self.group_ids):
            shape = (num_blocks, self.state_len, 1) if conv_layout == "SD" \
                else (num_blocks, 1, self.state_len)
            conv = torch.full(shape, -7, dtype=torch.int64)
            temporal = torch.full((num_blocks, 2), -7, dtype=torch.int64)
            self.conv.append(conv)
            self.temporal.append(temporal)
            # numpy views (shared memory) for the fake model's own fast element access
            self.conv_np.append(conv.numpy().reshape(num_blocks, self.state_len) if
                                conv_layout == "SD" else conv.numpy()[:, 0, :])
            self.temporal_np.append(temporal.numpy())
            self.states.append(MambaStateTensor(conv, self.conv_kind, row, f"group{group}.conv"))
            self.states.append(MambaStateTensor(temporal, StateKind.TEMPORAL, row,
                                                f"group{group}.temporal"))
        self.requests: dict[str, _Request] = {}
        self.mamba_state_idx: dict[str, int] = {}
        self.num_accepted: dict[str, int] = {}
        self.in_batch: set[str] = set()
        self.fresh: set[str] = set()  # new or resumed this step: their first read is a resume
        self.mismatches: list[Mismatch] = []
        self.num_checks = 0
        self.external_loads = 0

    # ---- helpers -------------------------------------------------------------------------------

    def _window(self, row: int, block: int, offset: int) -> list[int]:
        return self.conv_np[row][block, offset: offset + self.kernel - 1].tolist()

    def _true_window(self, tokens: Sequence[int], end: int) -> list[int]:
        return [tokens[p] + 1 if p >= 0 else 0 for p in range(end - self.kernel + 1, end)]

    def write_state(self, request_id: str, row: int, column: int, num_tokens: int) -> None:
        """Write the exact state after ``num_tokens`` tokens into a column (external loads)."""
        req = self.requests[request_id]
        tokens = self.tokens(request_id)
        block = req.block_ids[self.group_ids[row]][column]
        self.temporal_np[row][block] = (num_tokens, req.hash_upto(tokens, num_tokens))
        self.conv_np[row][block, : self.kernel - 1] = self._true_window(tokens, num_tokens)

    # ---- one step ------------------------------------------------------------------------------

    def update_states(self, out: Any) -> None:
        """Mirror ``GPUModelRunner._update_states``: requests, block ids, CoW copies."""
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            self.num_accepted.pop(req_id, None)
            self.in_batch.discard(req_id)
        copies = getattr(out, "kv_cache_block_copies", None)
        if copies:
            src = torch.tensor([[c.src_block_id for c in copies]] * len(self.group_ids))
            dst = torch.tensor([[c.dst_block_id for c in copies]] * len(self.group_ids))
            plugins.copy_state_blocks(self.states, src, dst)
        scheduled = set(out.num_scheduled_tokens)
        self.in_batch &= scheduled
        self.fresh = {new.req_id for new in out.scheduled_new_reqs} | set(
            out.scheduled_cached_reqs.resumed_req_ids)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = _Request(
                prompt_len=len(new.prompt_token_ids or ()),
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed=new.num_computed_tokens,
            )
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self.requests[req_id]
            req.num_computed = cached.num_computed_tokens[i]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                assert new_ids is not None
                req.block_ids = [list(ids) for ids in new_ids]
                self.in_batch.discard(req_id)
            elif new_ids is not None:
                for ids, extra in zip(req.block_ids, new_ids):
                    ids.extend(extra)
        for req_id in scheduled - self.in_batch:
            self.num_accepted[req_id] = 1  # InputBatch.add_request
        self.in_batch = scheduled

    def preprocess(self, out: Any) -> set[str]:
        """Mirror ``mamba_utils.preprocess_mamba``; return the requests whose state moved."""
        cached = out.scheduled_cached_reqs
        for req_id in (*out.finished_req_ids, *(out.preempted_req_ids or ()),
                       *cached.resumed_req_ids):
            self.mamba_state_idx.pop(req_id, None)
        moves: list[tuple[str, int, int, int]] = []
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            prev = self.mamba_state_idx.get(req_id)
            if prev is None:
                prev = (req.num_computed - 1) // self.block_size
            curr = self._cdiv(req.num_computed + num_scheduled, self.block_size) - 1
            self.mamba_state_idx[req_id] = curr
            if prev != -1 and prev != curr:
                moves.append((req_id, prev, curr, self.num_accepted[req_id] - 1))
                self.num_accepted[req_id] = 1
        if not moves:
            return set()
        rows = range(len(self.group_ids))
        if not any(bias for *_, bias in moves):
            src = [[self.requests[r].block_ids[self.group_ids[g]][p] for r, p, _, _ in moves]
                   for g in rows]
            dst = [[self.requests[r].block_ids[self.group_ids[g]][c] for r, _, c, _ in moves]
                   for g in rows]
            plugins.copy_state_blocks(self.states, torch.tensor(src), torch.tensor(dst))
        else:
            plugins.precopy_running_states(
                self.states, self._tables([r for r, *_ in moves]),
                torch.tensor([p for _, p, _, _ in moves]), torch.tensor([c for *_, c, _ in moves]),
                torch.tensor([b for *_, b in moves]))
        return {r for r, *_ in moves}

    def _tables(self, req_ids: Sequence[str]) -> list[torch.Tensor]:
        tables = []
        for group in self.group_ids:
            width = max(len(self.requests[r].block_ids[group]) for r in req_ids)
            table = torch.zeros((len(req_ids), width), dtype=torch.int64)
            for i, r in enumerate(req_ids):
                ids = self.requests[r].block_ids[group]
                table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            tables.append(table)
        return tables

    def forward(self, out: Any) -> None:
        """Check every initial state read, then write the new running states."""
        spec_tokens = out.scheduled_spec_decode_tokens
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            tokens = self.tokens(req_id)
            drafts = list(spec_tokens.get(req_id, ()))
            start = req.num_computed
            real_end = start + num_scheduled - len(drafts)
            processed = list(tokens[start:real_end]) + drafts
            running_col = self.mamba_state_idx[req_id]
            offset = self.num_accepted[req_id] - 1
            resume = req_id in self.fresh
            for row, group in enumerate(self.group_ids):
                ids = req.block_ids[group]
                if start == 0:
                    length, value, window = 0, 0, [0] * (self.kernel - 1)
                elif running_col + offset >= len(ids):
                    raise RuntimeError(
                        f"{req_id}: group {group} has {len(ids)} block ids, the running state "
                        f"is at column {running_col + offset}: the worker's block table is "
                        "shorter than vLLM's preprocess_mamba expects")
                else:
                    block = ids[running_col + offset]
                    length, value = self.temporal_np[row][block].tolist()
                    window = self._window(row, ids[running_col], offset)
                    self._check(req_id, req, tokens, row, group, ids, running_col + offset,
                                length, value, window, start, resume)
                # vLLM's Mamba2 forward writes the final conv state, then the prefill
                # checkpoint (conv and SSM), then the final SSM state: same order here.
                self._write_conv(row, ids, running_col, window, processed, real_end - start)
                checkpoint_col = -1
                if self.checkpoint_alignment is not None:
                    checkpoint_col = self._store_checkpoint(
                        req_id, req, row, ids, start, num_scheduled, length, value, window,
                        processed)
                if self.stores_interior:
                    self._store_interior(req_id, req, row, ids, start, real_end, length, value,
                                         window, processed, skip_column=checkpoint_col)
                self._write_temporal(req, tokens, row, ids, running_col, length, value,
                                     processed, real_end - start)

    def _check(self, req_id: str, req: _Request, tokens: Sequence[int], row: int, group: int,
               ids: list[int], column: int, length: int, value: int, window: list[int],
               start: int, resume: bool) -> None:
        self.num_checks += 1
        ok_temporal = length == start and value == req.hash_upto(tokens, start)
        ok_conv = window == self._true_window(tokens, start)
        if ok_temporal and ok_conv:
            req.poisoned = False
            return
        if req.poisoned and not resume:
            return  # already reported for this request; its state stays wrong
        req.poisoned = True
        self.mismatches.append(Mismatch(
            request_id=req_id, group=group, block=ids[column], column=column,
            expected_tokens=start, found_tokens=length,
            what="temporal" if not ok_temporal else "conv", resume=resume))

    def _write_temporal(self, req: _Request, tokens: Sequence[int], row: int, ids: list[int],
                        running_col: int, length: int, value: int, processed: list[int],
                        num_real: int) -> None:
        """The state after the real tokens, then after each draft token (next columns)."""
        real_hash = self._fold(req, tokens, value, req.num_computed, num_real)
        temporal = self.temporal_np[row]
        temporal[ids[running_col]] = (length + num_real, real_hash)
        h = real_hash
        for j, draft in enumerate(processed[num_real:], start=1):
            h = (h * HASH_BASE + draft + 1) % HASH_MOD
            temporal[ids[running_col + j]] = (length + num_real + j, h)

    def _write_conv(self, row: int, ids: list[int], running_col: int, window: list[int],
                    processed: list[int], num_real: int) -> None:
        """The window starting kernel-1 tokens before the real end, the drafts after it."""
        tail = processed[max(0, num_real - self.kernel + 1):]
        seq = window + [t + 1 for t in tail] if num_real < self.kernel - 1 else \
            [t + 1 for t in tail]
        stored = seq[len(seq) - (self.kernel - 1) - (len(processed) - num_real):]
        self.conv_np[row][ids[running_col], : len(stored)] = stored

    @staticmethod
    def _fold(req: _Request, tokens: Sequence[int], value: int, start: int, count: int) -> int:
        """``value`` (a hash) extended by ``tokens[start:start+count]`` in O(1)."""
        end_hash = req.hash_upto(tokens, start + count)
        scale = pow(HASH_BASE, count, HASH_MOD)
        segment = (end_hash - req.prefix_hash[start] * scale) % HASH_MOD
        return (value * scale + segment) % HASH_MOD

    def _store_checkpoint(self, req_id: str, req: _Request, row: int, ids: list[int], start: int,
                          num_scheduled: int, length: int, value: int, window: list[int],
                          processed: list[int]) -> int:
        """Mamba2-style internal prefill checkpoint, as vLLM's checkpoint builder plans it;
        returns the block-table column written (-1: none)."""
        from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

        cfg = self.setup.kv_cache_config
        offsets, cols = compute_mamba_prefill_checkpoints(
            [start + num_scheduled], [num_scheduled], hash_block_size=cfg.hash_block_size,
            mamba_block_size=self.block_size, checkpoint_alignment=self.checkpoint_alignment,
            drop_eagle_block=False, cache_hit_alignment_tokens=cfg.cache_hit_alignment_tokens)
        if cols[0] < 0:
            return -1
        offset = offsets[0]
        tokens = self.tokens(req_id)
        h = self._fold(req, tokens, value, start, offset)
        # Token-major conv input ending at the checkpoint: the kernel-1 inputs before it, then
        # the spec-decode slots of the window (unused in prefill) as zeros.
        rows = (window + [t + 1 for t in processed])[offset: offset + self.kernel - 1]
        rows = rows + [0] * self.num_spec
        conv_source = torch.tensor(rows, dtype=torch.int64).reshape(-1, 1)
        temporal_source = torch.tensor([[length + offset, h]], dtype=torch.int64)
        block = ids[cols[0]]
        batch = CheckpointBatch(
            token_end=torch.tensor([len(rows)]), seq_start=torch.tensor([0]),
            initial_block=torch.tensor([-1]), dst_block=torch.tensor([block]),
            temporal_row=torch.tensor([0]))
        plugins.store_checkpoints(self.states[2 * row: 2 * row + 2],
                                  [conv_source, temporal_source], batch)
        return cols[0]

    def _store_interior(self, req_id: str, req: _Request, row: int, ids: list[int], start: int,
                        end: int, length: int, value: int, window: list[int],
                        processed: list[int], skip_column: int = -1) -> None:
        """States at the interior checkpoints the KV-cache manager gave blocks, read from the
        block table as the worker reads it (:func:`vllm_hybrid_backends.interior.checkpoints`).

        ``skip_column``: the column vLLM's own Mamba2 prefill checkpoint went to
        (``cdiv(seq_len, block) - 2``). It is left to vLLM, as the plugin's plan does
        (``vllm_hybrid_backends.interior.vllm_checkpoint_column``) and as vLLM
        alone, which stores no interior states, does: when the checkpoint is not that column's
        block boundary (a ``prefix_match_unit`` below the block, or an alignment above a finer
        Mamba block) the manager keys the block at the checkpoint, so an interior state there
        would be cached under the checkpoint's hash."""
        points = [(offset, block) for offset, block in
                  interior.checkpoints(ids, start, end, self.block_size)
                  if interior.column_of(start, offset, self.block_size) != skip_column]
        if not points:
            return
        tokens = self.tokens(req_id)
        # token-major conv input with the initial window in front, so no window reaches before it
        rows = window + [t + 1 for t in processed]
        conv_source = torch.tensor(rows, dtype=torch.int64).reshape(-1, 1)
        temporal_source = torch.tensor(
            [[length + offset, self._fold(req, tokens, value, start, offset)]
             for offset, _ in points], dtype=torch.int64)
        count = len(points)
        batch = CheckpointBatch(
            token_end=torch.tensor([len(window) + offset for offset, _ in points]),
            seq_start=torch.zeros(count, dtype=torch.int64),
            initial_block=torch.full((count,), -1, dtype=torch.int64),
            dst_block=torch.tensor([block for _, block in points]),
            temporal_row=torch.arange(count))
        plugins.store_checkpoints(self.states[2 * row: 2 * row + 2],
                                  [conv_source, temporal_source], batch)

    def postprocess(self, out: Any, num_sampled: dict[str, int]) -> None:
        """Mirror ``postprocess_mamba_align_gpu`` (speculative decoding only)."""
        if not self.num_spec or not out.num_scheduled_tokens:
            return
        req_ids = list(out.num_scheduled_tokens)
        spec_tokens = out.scheduled_spec_decode_tokens
        running = [self.requests[r].num_computed + out.num_scheduled_tokens[r]
                   - len(spec_tokens.get(r, ())) for r in req_ids]
        accepted = torch.tensor([max(num_sampled.get(r, 1), 1) for r in req_ids])
        result = plugins.postprocess_accepted_states(
            self.states, self._tables(req_ids),
            torch.tensor([self.mamba_state_idx[r] for r in req_ids]), torch.tensor(running),
            accepted, self.block_size, accepted.clone())
        for r, value in zip(req_ids, result.tolist()):
            self.num_accepted[r] = int(value)

    def execute(self, out: Any, after_update: Any = None) -> None:
        """Steps 1-3 of a worker step (postprocess runs after sampling).

        ``after_update(out)`` runs between the state update and the pre-copy: where a KV
        connector's synchronous load lands.
        """
        self.update_states(out)
        if after_update is not None:
            after_update(out)
        self.preprocess(out)
        self.forward(out)
