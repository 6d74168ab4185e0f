"""``VLLM_HYBRID_COHERENT_EVICTION``: once the pool evicts a block of a Mamba state (or the
attention block at its position), the state's free blocks in the other Mamba groups are evicted
too, so no cached state is left that a lookup cannot use. Checked on the cache vLLM's real
scheduler leaves after a replay under memory pressure (nemotron-h-8b: six Mamba groups, a state
is six blocks; a 63-block pool). ``VLLM_HYBRID_DUPLICATE_EVICTION``: a free attention block
whose full-block key a running request caches again is evicted then (vLLM's ``BlockPool``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllm_hybrid_backends import align
from vllm_hybrid_backends.compat import version_allows
from vllm_hybrid_backends.patches import (
    patch_vllm_v1_core_kv_cache_coordinator as coordinator_patch,
)
from vllm_hybrid_backends.replay.engine_config import vllm_has_prefix_match_unit
from vllm_hybrid_backends.replay.harness import ReplayConfig, run_replay
from vllm_hybrid_backends.replay.policy import get_policy
from vllm_hybrid_backends.replay.workloads import make_workload

pytestmark = pytest.mark.slow

CONFIG = ReplayConfig(model_shape="nemotron-h-8b", cache_tokens=65_536)


def _replayed_coordinator(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """The plugin's replay of the agentic workload; its KV-cache coordinator, and the run."""
    seen: list[Any] = []
    real = coordinator_patch.state_of

    def state_of(coordinator: Any) -> Any:
        if not seen:
            seen.append(coordinator)
        return real(coordinator)

    monkeypatch.setattr(coordinator_patch, "state_of", state_of)
    trace = make_workload("agentic", block_size=CONFIG.layout().block_size)
    run = run_replay(trace, CONFIG, get_policy("plugin"))
    assert seen, "the plugin saw no KV-cache coordinator"
    assert coordinator_patch.state_of(seen[0]).evicts_coherently == (
        align.active_policy().coherent_eviction)
    return seen[0], run


def _unusable_states(coordinator: Any) -> int:
    """Free Mamba blocks cached under a hash that another Mamba group, or the attention group of
    the same block size, no longer holds: no lookup can end on them."""
    from vllm.v1.core.kv_cache_utils import (
        get_block_hash,
        get_group_id,
        make_block_hash_with_group_id,
    )

    managers = coordinator.single_type_managers
    mamba = {gid for gid, m in enumerate(managers) if coordinator_patch._is_mamba_manager(m)}
    pool = coordinator.block_pool
    cached = pool.cached_block_hash_to_block
    unusable = 0
    for block in pool.blocks:
        if block.block_hash is None or block.ref_cnt or get_group_id(block.block_hash) not in mamba:
            continue
        group = get_group_id(block.block_hash)
        block_hash = get_block_hash(block.block_hash)
        unusable += any(
            cached.get_one_block(make_block_hash_with_group_id(block_hash, other)) is None
            for other, m in enumerate(managers)
            if other != group and m.block_size == managers[group].block_size)
    return unusable


@pytest.mark.parametrize("coherent", [
    pytest.param(True, id="on", marks=pytest.mark.skipif(not version_allows(">=0.26"), reason=(
        "vLLM 0.23 keeps every Mamba state (dense retention) and the plugin plans no interior "
        "state there; the rows this guards are measured on 0.30+"))),
    pytest.param(False, id="off", marks=pytest.mark.skipif(not version_allows(">=0.32"), reason=(
        "measured on 0.32+; the 0.30 and 0.31 engines leave no partial state at the end of "
        "this row (their evictions fall differently); the BlockPool tests cover the rule"))),
])
def test_states_left_cached_in_part_of_their_groups(monkeypatch, coherent):
    monkeypatch.setenv("VLLM_HYBRID_COHERENT_EVICTION", "1" if coherent else "0")
    if not coherent:  # the run measured before duplicate eviction (it leaves none there)
        monkeypatch.setenv(align.DUPLICATE_EVICTION_ENV, "0")
    coordinator, run = _replayed_coordinator(monkeypatch)
    assert run.evictions_mamba > 0, "the row must evict states"
    unusable = _unusable_states(coordinator)
    # without the rule some are left (measured on 0.32: 2 of 14 cached states)
    assert unusable == 0 if coherent else unusable > 0


def _pool_with_two_mamba_groups(hash_block_size: int = 4,
                                counted: Any = None) -> tuple[Any, Any, Any]:
    """vLLM's block pool behind a coordinator of one attention group and two Mamba groups of
    one block size, the plugin's eviction hook installed (after the ledger's eviction counter,
    into ``counted``'s ledger, as ``_record_hit`` installs them); a helper caching a block."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=12, enable_caching=True, hash_block_size=hash_block_size)
    managers = [SimpleNamespace(block_size=4),
                *(SimpleNamespace(block_size=4, has_prefill_checkpoint_blocks=False)
                  for _ in range(2))]
    coordinator = SimpleNamespace(single_type_managers=managers, block_pool=pool)
    if counted is not None:
        coordinator_patch._count_evicted_blocks(pool, counted)
    coordinator_patch._evict_coherently(coordinator, coordinator_patch.CoordinatorState())

    def cache(block: Any, block_hash: bytes, group: int) -> None:
        request = SimpleNamespace(block_hashes=[block_hash], request_id="r")
        pool.cache_full_blocks(request, [block], 0, 1, 4, group)

    return pool, cache, coordinator


def _cached(pool: Any, block_hash: bytes, group: int) -> bool:
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    return pool.cached_block_hash_to_block.get_one_block(
        make_block_hash_with_group_id(block_hash, group)) is not None


def test_evicting_one_group_of_a_state_evicts_the_others_unless_a_copy_remains():
    pool, cache, _ = _pool_with_two_mamba_groups()
    shared, alone = b"s" * 32, b"a" * 32
    attention, attention_copy, state_1, state_2 = pool.get_new_blocks(4)
    lone_attention, lone_1, lone_2 = pool.get_new_blocks(3)
    for block, block_hash, group in ((attention, shared, 0), (attention_copy, shared, 0),
                                     (state_1, shared, 1), (state_2, shared, 2),
                                     (lone_attention, alone, 0), (lone_1, alone, 1),
                                     (lone_2, alone, 2)):
        cache(block, block_hash, group)
    pool.free_blocks([attention, state_1, state_2, attention_copy,
                      lone_attention, lone_1, lone_2])
    uncached = pool.get_num_free_blocks() - 7
    pool.get_new_blocks(uncached + 1)  # evicts `attention`: its copy still holds the prefix
    assert _cached(pool, shared, 1) and _cached(pool, shared, 2)
    pool.get_new_blocks(1)  # evicts `state_1`: the state's block in group 2 is dead
    assert not _cached(pool, shared, 2) and state_2.block_hash is None
    assert pool.free_block_queue.fake_free_list_head.next_free_block is state_2
    assert _cached(pool, shared, 0)  # attention blocks stay: a longer hit may use them
    pool.get_new_blocks(1)  # takes `state_2` (moved to the front), nothing else
    assert _cached(pool, alone, 1) and _cached(pool, alone, 2)
    pool.get_new_blocks(1)  # evicts `attention_copy`
    pool.get_new_blocks(1)  # evicts `lone_attention`: the state after it is unreachable
    assert not _cached(pool, alone, 1) and not _cached(pool, alone, 2)
    assert pool.get_num_free_blocks() == 2


@pytest.mark.skipif(not vllm_has_prefix_match_unit(), reason=(
    "no prefix_match_unit before vLLM 0.32: no key ends inside a block (0.23's blocks do not "
    "even record where their key ends)"))
def test_a_sub_block_attention_key_takes_no_state_along():
    """With ``prefix_match_unit`` below the block an attention block can be cached under a key
    ending inside it (here: 2 tokens of a 4-token block); its tokens may still be reached through
    another block, so the Mamba states under that key stay."""
    pool, _, _ = _pool_with_two_mamba_groups(hash_block_size=2)
    key = b"p" * 32
    attention, state_1, state_2 = pool.get_new_blocks(3)
    for block, group in ((attention, 0), (state_1, 1), (state_2, 2)):
        request = SimpleNamespace(block_hashes=[key], request_id="r")
        pool.cache_full_blocks(request, [block], 0, 1, 2, group)  # keyed at 2 tokens
    pool.free_blocks([attention, state_1, state_2])
    pool.get_new_blocks(pool.get_num_free_blocks() - 2)  # evicts `attention`
    assert attention.block_hash is None
    assert _cached(pool, key, 1) and _cached(pool, key, 2)


def test_states_evicted_along_are_counted_in_the_stats(monkeypatch):
    from vllm_hybrid_backends import stats

    monkeypatch.setattr(stats, "enabled", True)
    stats.reset()
    pool, cache, _ = _pool_with_two_mamba_groups()
    key = b"k" * 32
    attention, state_1, state_2 = pool.get_new_blocks(3)
    for block, group in ((attention, 0), (state_1, 1), (state_2, 2)):
        cache(block, key, group)
    stats.record_kept("tail", state_2)  # kept by the plugin, evicted along with `attention`
    pool.free_blocks([attention, state_1, state_2])
    pool.get_new_blocks(pool.get_num_free_blocks() - 2)  # evicts `attention`
    assert state_2.block_hash is None
    assert stats.COUNTERS[stats.key("evicted", "tail")] == 1
    stats.reset()


def _pool_evicting_duplicates(hash_block_size: int = 4) -> tuple[Any, Any]:
    """vLLM's block pool behind a coordinator of one attention group (0) and one Mamba group
    (1), the duplicate-eviction hook installed; ``cache(block, hash, group, tokens)``."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=10, enable_caching=True, hash_block_size=hash_block_size)
    managers = [SimpleNamespace(block_size=4),
                SimpleNamespace(block_size=4, has_prefill_checkpoint_blocks=False)]
    coordinator = SimpleNamespace(single_type_managers=managers, block_pool=pool)
    coordinator_patch._evict_duplicates(coordinator, coordinator_patch.CoordinatorState())

    def cache(block: Any, block_hash: bytes, group: int, tokens: int = 4) -> None:
        request = SimpleNamespace(block_hashes=[block_hash] * (4 // hash_block_size),
                                  request_id="r")
        pool.cache_full_blocks(request, [block], 0, 1, tokens, group)

    return pool, cache


def _front(pool: Any) -> Any:
    return pool.free_block_queue.fake_free_list_head.next_free_block


def test_a_free_attention_block_cached_again_is_evicted():
    pool, cache = _pool_evicting_duplicates()
    key, other_key = b"d" * 32, b"o" * 32
    old, unrelated = pool.get_new_blocks(2)
    cache(old, key, 0)
    cache(unrelated, other_key, 0)
    pool.free_blocks([old, unrelated])
    assert old.block_hash is not None and _front(pool) is not old  # cached, at its LRU place
    (new,) = pool.get_new_blocks(1)  # an uncached block: nothing evicted
    cache(new, key, 0)  # a running request computed the same block again
    assert old.block_hash is None and _front(pool) is old  # taken next, before cached blocks
    assert pool.cached_block_hash_to_block.get_one_block(
        _group_key(key, 0)) is new
    assert unrelated.block_hash is not None


def _group_key(block_hash: bytes, group: int) -> Any:
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    return make_block_hash_with_group_id(block_hash, group)


def test_a_copy_in_use_or_a_mamba_state_stays_cached():
    pool, cache = _pool_evicting_duplicates()
    key = b"u" * 32
    in_use, state = pool.get_new_blocks(2)
    cache(in_use, key, 0)  # held by a running request: not free
    cache(state, key, 1)
    pool.free_blocks([state])
    second, second_state = pool.get_new_blocks(2)
    cache(second, key, 0)
    cache(second_state, key, 1)  # Mamba groups keep their copies (vLLM may drop the new one)
    assert in_use.block_hash is not None and state.block_hash is not None


@pytest.mark.skipif(not vllm_has_prefix_match_unit(), reason=(
    "no prefix_match_unit before vLLM 0.32: no key ends inside a block"))
def test_a_key_ending_inside_the_block_evicts_no_copy():
    pool, cache = _pool_evicting_duplicates(hash_block_size=2)
    key = b"p" * 32
    old, new = pool.get_new_blocks(2)
    cache(old, key, 0, tokens=2)  # keyed at 2 tokens of a 4-token block
    pool.free_blocks([old])
    cache(new, key, 0, tokens=2)
    assert old.block_hash is not None


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_switch_installs_the_hook_at_the_first_lookup(monkeypatch, switch):
    monkeypatch.setenv(align.DUPLICATE_EVICTION_ENV, switch)
    monkeypatch.setenv(align.STRANDED_EVICTION_ENV, "0")  # it watches the map's insert too
    align.refresh_policy()
    try:
        coordinator, _ = _replayed_coordinator(monkeypatch)
        pool_map = coordinator.block_pool.cached_block_hash_to_block
        installed = coordinator_patch.state_of(coordinator).duplicates_map is pool_map
        assert installed == (switch == "1") and ("insert" in vars(pool_map)) == installed
    finally:
        monkeypatch.delenv(align.DUPLICATE_EVICTION_ENV)
        monkeypatch.delenv(align.STRANDED_EVICTION_ENV)
        align.refresh_policy()


def _queue_ids(pool: Any) -> list[int]:
    queue = pool.free_block_queue
    ids, block = [], queue.fake_free_list_head.next_free_block
    while block is not queue.fake_free_list_tail:
        ids.append(block.block_id)
        block = block.next_free_block
    return ids


def test_with_coherent_eviction_a_duplicate_takes_no_state_along_and_survives_a_reset():
    # the real setup: both hooks on one pool; the state at the duplicated key must stay (the
    # new copy holds the key when the old one is evicted), and vLLM's reset_prefix_cache,
    # which replaces the hash map, must not switch either hook off
    pool, cache, coordinator = _pool_with_two_mamba_groups()
    state = coordinator_patch.CoordinatorState()
    coordinator_patch._evict_duplicates(coordinator, state)
    key = b"c" * 32
    old, state_1, state_2 = pool.get_new_blocks(3)
    for block, group in ((old, 0), (state_1, 1), (state_2, 2)):
        cache(block, key, group)
    pool.free_blocks([old, state_1, state_2])
    free = pool.get_num_free_blocks()
    (new,) = pool.get_new_blocks(1)
    cache(new, key, 0)
    assert old.block_hash is None and _front(pool) is old
    assert _cached(pool, key, 1) and _cached(pool, key, 2)  # the state stays
    assert pool.get_num_free_blocks() == free - 1 == len(_queue_ids(pool))
    pool.free_blocks([new])
    assert pool.reset_prefix_cache()
    assert state.duplicates_map is not pool.cached_block_hash_to_block  # reinstalled on lookup
    coordinator_patch._evict_duplicates(coordinator, state)
    first, second = pool.get_new_blocks(2)
    cache(first, key, 0)
    pool.free_blocks([first])
    cache(second, key, 0)
    assert first.block_hash is None
    third, state_1, state_2 = pool.get_new_blocks(3)
    for block, group in ((third, 0), (state_1, 1), (state_2, 2)):
        cache(block, b"r" * 32, group)
    pool.free_blocks([third, state_1, state_2])
    pool.get_new_blocks(pool.get_num_free_blocks() - 2)  # evicts `third` (coherent, new map)
    assert not _cached(pool, b"r" * 32, 1) and not _cached(pool, b"r" * 32, 2)


def test_a_copy_with_more_keys_stays(monkeypatch):
    pool, cache = _pool_evicting_duplicates()
    key = b"m" * 32
    old, new = pool.get_new_blocks(2)
    cache(old, key, 0)
    if hasattr(pool, "cached_block_hashes_by_block"):  # 0.26+: a block may hold more keys
        monkeypatch.setattr(pool, "cached_block_hashes_by_block", {old.block_id: {"other"}})
    pool.free_blocks([old])
    cache(new, key, 0)
    assert (old.block_hash is not None) == hasattr(pool, "cached_block_hashes_by_block")


def test_the_ledger_counts_every_cached_block_evicted_siblings_included():
    """The eviction price's denominator (``_count_evicted_blocks``, inside coherent eviction):
    each cached block evicted counts once, the state blocks coherent eviction takes along
    included (a kind's value counts every group's blocks); uncached blocks do not."""
    state = coordinator_patch.CoordinatorState()
    pool, cache, _ = _pool_with_two_mamba_groups(counted=state)
    key, other = b"k" * 32, b"o" * 32
    attention, state_1, state_2, lone = pool.get_new_blocks(4)
    for block, block_hash, group in ((attention, key, 0), (state_1, key, 1), (state_2, key, 2),
                                     (lone, other, 0)):
        cache(block, block_hash, group)
    pool.free_blocks([state_1, state_2, attention, lone])
    uncached = pool.get_num_free_blocks() - 4
    pool.get_new_blocks(uncached)
    assert state.ledger.evicted_blocks == 0
    pool.get_new_blocks(1)  # evicts `state_1`; coherent eviction takes `state_2` along
    assert state_2.block_hash is None and state.ledger.evicted_blocks == 2
    pool.get_new_blocks(2)  # `state_2` (now uncached), then `attention`
    assert attention.block_hash is None and state.ledger.evicted_blocks == 3
