"""SeenPrefixes: where a prompt leaves the recent ones, in hash units."""

from __future__ import annotations

import importlib
import random

import pytest

from vllm_hybrid_backends.junctions import SeenPrefixes, fork


def junction(seen: SeenPrefixes, unit_hashes: list[bytes], num_prompt_tokens: int,
             unit: int) -> int:
    """The fork position alone (0: none)."""
    return fork(seen, unit_hashes, num_prompt_tokens, unit)[0]


def _chain(tokens: list[int], unit: int) -> list[bytes]:
    """Chained unit hashes like vLLM's: the k-th names the whole prefix of k units."""
    return [repr(tuple(tokens[:(k + 1) * unit])).encode() for k in range(len(tokens) // unit)]


def test_a_prompt_learns_where_it_leaves_an_earlier_one():
    seen = SeenPrefixes(64)
    first = list(range(40))
    second = first[:12] + [900 + i for i in range(28)]
    assert junction(seen, _chain(first, 4), len(first), 4) == 0  # nothing seen yet
    assert junction(seen, _chain(second, 4), len(second), 4) == 12
    third = first[:12] + [700] * 8 + list(range(50, 70))
    assert junction(seen, _chain(third, 4), len(third), 4) == 12


def test_a_prompt_that_only_extends_an_earlier_one_makes_no_junction():
    seen = SeenPrefixes(64)
    prompt = list(range(33))
    junction(seen, _chain(prompt, 4), len(prompt), 4)
    # a resend, or a conversation's next turn, goes on where the earlier prompt ended: vLLM
    # keeps that prompt's end state itself, and the next turn extends the new prompt
    assert junction(seen, _chain(prompt, 4), len(prompt), 4) == 0
    turn = prompt + [900 + i for i in range(20)]
    assert junction(seen, _chain(turn, 4), len(turn), 4) == 0
    # a retry of that turn forks from it where its own tokens begin (the unit holding token 33)
    retry = prompt + [700 + i for i in range(20)]
    assert junction(seen, _chain(retry, 4), len(retry), 4) == 32
    # a prompt that stops inside a remembered one: that one went on, a unit short of the end
    shorter = list(range(32))
    assert junction(seen, _chain(shorter, 4), len(shorter), 4) == 28


def test_a_prefix_another_prompt_went_on_past_stays_a_fork_when_one_ends_there():
    seen = SeenPrefixes(64)
    first = list(range(40))
    junction(seen, _chain(first, 4), len(first), 4)
    # a prompt ending 13 tokens in (3 units recorded: its hit stops at 12) ends inside it
    assert junction(seen, _chain(first[:13], 4), 13, 4) == 12
    # the first one went on past 12 tokens, whoever ended there since: still a fork at 12
    other = first[:12] + [600 + i for i in range(20)]
    assert junction(seen, _chain(other, 4), len(other), 4) == 12


def test_a_fork_is_remembered_for_prompts_that_extend_the_shared_prefix():
    seen = SeenPrefixes(64)
    system = list(range(12))
    junction(seen, _chain(system, 4), len(system), 4)  # ends at 8 (a hit stops a token short)
    first = system + [500 + i for i in range(20)]
    assert junction(seen, _chain(first, 4), len(first), 4) == 0  # extends it: no fork yet
    second = system + [800 + i for i in range(20)]
    assert junction(seen, _chain(second, 4), len(second), 4) == 12  # first went on past 12


def test_forgetting_keeps_every_prefix_of_a_remembered_one():
    rng = random.Random(0)
    seen = SeenPrefixes(50)
    prompts = [[rng.randrange(4) for _ in range(rng.randrange(8, 80))] for _ in range(200)]
    for prompt in prompts:
        seen.record(_chain(prompt, 2), len(prompt) // 2)
        assert len(seen) <= 50
    for prompt in prompts[-5:]:
        chain = _chain(prompt, 2)
        remembered = [hash(h) in seen._seen for h in chain]
        # the binary search in longest() is right only if remembered prefixes are closed
        assert remembered == sorted(remembered, reverse=True)
        assert seen.longest(chain, len(chain)) == sum(remembered)


def test_a_bad_capacity_is_named():
    with pytest.raises(ValueError, match=r"capacity=0: allowed values are integers >= 1"):
        SeenPrefixes(0)


def test_nothing_is_wired_for_junctions_before_vllm_032(monkeypatch):
    pytest.importorskip("vllm")
    from vllm_hybrid_backends import compat
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_sched_scheduler as scheduler_patch

    if compat.version_allows(">=0.32"):  # the seams exist here: both are wired
        assert [name for _, name, _ in scheduler_patch._junction_targets()] == [
            "_get_local_prefix_cache_hit", "_cache_partial_tail_block"]
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.31.0")
    assert scheduler_patch._junction_targets() == []


def test_a_scheduler_subclass_that_replaced_vllms_gets_the_junction_wiring_and_loses_it(monkeypatch):
    # vllm-ascend replaces vllm.v1.core.sched.scheduler.Scheduler with BalanceScheduler, a
    # subclass that inherits _get_local_prefix_cache_hit: wrapping must not need the method in
    # the subclass's own dict, and reverting must leave the subclass inheriting vLLM's again
    pytest.importorskip("vllm")
    from vllm_hybrid_backends import compat
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_sched_scheduler as scheduler_patch

    if not compat.version_allows(">=0.32"):
        pytest.skip("no junction seams before vLLM 0.32")
    module = importlib.import_module(scheduler_patch.TARGET_MODULE)
    vllm_scheduler = module.Scheduler
    hit_search = vars(vllm_scheduler)["_get_local_prefix_cache_hit"]
    assert hit_search is not scheduler_patch._get_local_prefix_cache_hit  # not patched already
    split = vars(vllm_scheduler)["_mamba_block_aligned_split"]
    sibling = type("AsyncScheduler", (vllm_scheduler,), {})  # subclassed before the swap
    balance = type("BalanceScheduler", (vllm_scheduler,), {})
    monkeypatch.setattr(module, "Scheduler", balance)
    assert scheduler_patch.missing() == []
    scheduler_patch.apply()
    try:
        # the split (which arms the plugin's allocation and caching) reaches both subclasses
        assert sibling._mamba_block_aligned_split is scheduler_patch._mamba_block_aligned_split
        assert balance._mamba_block_aligned_split is scheduler_patch._mamba_block_aligned_split
        assert vars(balance)["_get_local_prefix_cache_hit"] is scheduler_patch._get_local_prefix_cache_hit
        assert vars(vllm_scheduler)["_get_local_prefix_cache_hit"] is hit_search  # vLLM's untouched
        assert scheduler_patch._ORIGINALS["_get_local_prefix_cache_hit"] is hit_search
        assert scheduler_patch.missing() == []
    finally:
        scheduler_patch.revert()
    assert "_get_local_prefix_cache_hit" not in vars(balance)
    assert balance._get_local_prefix_cache_hit is hit_search
    assert vars(vllm_scheduler)["_mamba_block_aligned_split"] is split
    assert "_mamba_block_aligned_split" not in vars(balance)


def test_branches_count_the_ways_prompts_went_on_not_the_turns_that_extend_one():
    seen = SeenPrefixes(256)
    system = list(range(12))

    def opens(session: int, turns: int) -> list[tuple[int, int]]:
        prompt, found = list(system), []
        for turn in range(turns):  # each turn extends the previous one
            prompt = prompt + [10000 * (session + 1) + 100 * turn + t for t in range(20)]
            found.append(fork(seen, _chain(prompt, 4), len(prompt), 4))
        return found

    # the first conversation forks from nothing; its turns only extend it
    assert opens(0, 5) == [(0, 0)] * 5
    # each later one forks at the system prompt: past it, 1, then 2 ways went on
    assert opens(1, 5) == [(12, 1)] + [(0, 0)] * 4
    assert opens(2, 1) == [(12, 2)]
    assert opens(3, 1) == [(12, 3)]
    # a retry of a turn forks where that turn's own tokens begin, one way on so far
    retry = system + [10000 + t for t in range(20)] + [7] * 20
    assert fork(seen, _chain(retry, 4), len(retry), 4) == (32, 1)


@pytest.mark.parametrize(("boundary", "fork_at", "junction_at", "expected"), [
    (20, 0, 0, 16),    # vLLM's junction, no fork (a turn whose end state was evicted): floored
    (20, 12, 12, 16),  # a fork elsewhere: vLLM's own junction still floored
    (20, 20, 0, 20),   # vLLM's junction is the fork (the plugin's state did not pay): exact
    (32, 0, 0, 32),    # on the block grid: vLLM's own, as it is
    (0, 0, 0, 0),      # no junction at all
])
def test_vllms_own_sub_block_junction_is_kept_exactly_only_at_a_fork(monkeypatch, boundary,
                                                                      fork_at, junction_at,
                                                                      expected):
    from types import SimpleNamespace

    from vllm_hybrid_backends import align
    from vllm_hybrid_backends.patches import patch_vllm_v1_core_sched_scheduler as patch

    scheduler = SimpleNamespace(block_size=16, hash_block_size=4, _hybrid_seen_prefixes=(
        align.active_policy(), SeenPrefixes(8)))
    request = SimpleNamespace(_hybrid_junction=junction_at, _hybrid_fork=fork_at)
    # vLLM's lookup: 8 tokens hit in every group, the attention hit runs on to ``boundary``
    monkeypatch.setitem(patch._ORIGINALS, "_get_local_prefix_cache_hit",
                        lambda self, req: ("blocks", 8, boundary, False))
    assert patch._get_local_prefix_cache_hit(scheduler, request) == \
        ("blocks", 8, expected, False)
