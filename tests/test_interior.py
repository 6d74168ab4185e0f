"""The interior-states protocol (vllm_hybrid_backends.interior): the block-table rule alone, and
one round trip through vLLM's real KV-cache manager with the plugin's patches applied."""

from __future__ import annotations

import pytest
import torch

from vllm_hybrid_backends import interior
from vllm_hybrid_backends.compat import version_allows


def test_checkpoints_read_real_blocks_the_chunk_crosses():
    # block 128, chunk [256, 1000): columns 2..6 cross it; 7 holds the running state
    table = [5, 0, 9, 0, 11, 0, 13, 17]
    assert interior.checkpoints(table, 256, 1000, 128) == [(128, 9), (384, 11), (640, 13)]
    # column 1 ends exactly at the start: it is the state the chunk resumes from
    assert interior.checkpoints([0, 4, 6, 7], 256, 512, 128) == [(128, 6)]
    assert interior.checkpoints([0, 4, 6], 256, 384, 128) == []
    # an aligned end: its column holds the running state, never an interior one
    assert interior.checkpoints([0, 0, 3, 4], 0, 512, 128) == [(384, 3)]
    # a partial first block (a fine-grained hit at 200): column 1 is the hit's copy
    assert interior.checkpoints([0, 8, 9, 10], 200, 512, 128) == [(184, 9)]
    assert interior.checkpoints([], 0, 1000, 128) == []


def test_rows_of_a_batch_read_only_their_crossed_columns():
    # row 0 decodes (1 token), row 1 prefills [8, 40) over block 8, row 2 is one block long;
    # row 1's column 0 holds its resume state and column 4 its running state: never read
    table = torch.tensor([[3, 0, 0, 0, 0, 0],
                          [7, 21, 0, 22, 99, 0],
                          [4, 5, 0, 0, 0, 0]])
    query_start = torch.tensor([0, 1, 33, 41])
    seq_lens = torch.tensor([9, 40, 16])
    found = interior.checkpoints_of_rows(table, query_start, seq_lens, range(3), 8)
    assert found == {1: (8, [(8, 21), (24, 22)])}
    assert [interior.column_of(8, offset, 8) for offset, _ in found[1][1]] == [1, 3]


def test_place_blocks_fills_only_null_columns_this_allocation_appended():
    class Block:
        def __init__(self, name, is_null=False):
            self.name, self.is_null = name, is_null

    null = Block("null", True)
    blocks = [Block("kept"), null, null, Block("vllm"), null]
    fresh = iter([Block("n1"), Block("n2")])
    filled = interior.place_blocks(blocks, [1, 2, 3, 4, 7], 2,
                                   lambda count: [next(fresh) for _ in range(count)])
    # column 1 was there before this allocation, 3 is vLLM's, 7 is past the row
    assert filled == [2, 4]
    assert [b.name for b in blocks] == ["kept", "null", "n1", "vllm", "n2"]


@pytest.mark.skipif(version_allows("<0.32"), reason=(
    "interior states are planned on vLLM 0.32+ only (the coordinator's _INTERIOR_VERIFIED)"))
def test_round_trip_plan_block_table_worker_read_release():
    # A 100-token prompt over 8-token blocks, prefilled in one chunk: with interior states the
    # plugin's dense tail checkpoints inside it are every boundary from 32 to 88. The engine
    # plans them, vLLM's manager allocates, the worker reads the block table back, and
    # releasing the chunk's skipped columns frees exactly those blocks.
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_kv_cache_coordinator as coordinator
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_kv_cache_manager as manager_patch
    from vllm_hybrid_backends.replay import harness
    from vllm_hybrid_backends.replay.policy import get_policy
    from vllm_hybrid_backends.replay.shapes import tiny_shape
    from vllm_hybrid_backends.replay.workloads import Trace, TraceRequest

    spec = TraceRequest("a", list(range(2000, 2100)), [5, 5])
    config = harness.ReplayConfig(shape=tiny_shape(), platform="any", block_size=8,
                                  cache_tokens=4096, max_num_batched_tokens=128, max_num_seqs=4)
    policy = get_policy("plugin")
    previous, coordinator.interior_override = coordinator.interior_override, True
    try:
        with policy.active():
            run = harness._Run(Trace("one", [spec]), config, policy, False, {},
                               harness._default_accept(), None, None)
            manager = run.scheduler.kv_cache_manager
            request = run._make_request(spec, 0.0)
            manager_patch.arm(manager)  # as the scheduler patch's split does for a prefill chunk
            coordinator.watch_caching(manager.coordinator)
            assert manager.allocate_slots(request, 100) is not None
            assert not {"get_num_blocks_to_allocate", "allocate_new_blocks"} & set(
                vars(manager.coordinator))  # the hooks were bound for that allocation only
            assert "allocate_slots" not in vars(manager)  # and the wrapper for that one
            groups = [group for group, _ in coordinator._interior_managers(manager.coordinator)]
            assert groups == run.setup.mamba_group_ids and len(groups) == 2
            rows = [list(manager.coordinator.single_type_managers[g].req_to_blocks["a"])
                    for g in groups]
            planned = [(p, p // 8 - 1) for p in range(32, 96, 8)]  # (token offset, column)
            for blocks in rows:
                assert len(blocks) == 13  # column 12 holds the running state (tokens 96..100)
                assert [c for c, b in enumerate(blocks[:12]) if not b.is_null] == list(range(3, 11))
                table = torch.tensor([[b.block_id for b in blocks]])
                read = interior.checkpoints_of_rows(table, torch.tensor([0, 100]),
                                                    torch.tensor([100]), range(1), 8)
                assert read == {0: (0, [(offset, blocks[c].block_id) for offset, c in planned])}
            interior_blocks = {blocks[c].block_id for blocks in rows for _, c in planned}
            assert len(interior_blocks) == 16 and all(blocks[c].ref_cnt == 1
                                                     for blocks in rows for _, c in planned)
            held = {b.block_id for g, m in enumerate(manager.coordinator.single_type_managers)
                    for b in m.req_to_blocks["a"] if not b.is_null}
            request.num_computed_tokens = 100
            manager.remove_skipped_blocks("a", 100, num_prompt_tokens=100)
            still = {b.block_id for m in manager.coordinator.single_type_managers
                     for b in m.req_to_blocks["a"] if not b.is_null}
            assert held - still == interior_blocks
            assert all(blocks[c].ref_cnt == 0 and blocks[c].block_hash is not None
                       for blocks in rows for _, c in planned)  # freed, still cached
    finally:
        coordinator.interior_override = previous
