"""Where a new prompt leaves every earlier one, below the block size.

With vLLM's ``prefix_match_unit`` (0.32+) the prefix cache hashes a prompt every ``unit``
tokens and a hit may end inside a block, but a hybrid model hits only where a Mamba state was
kept: at block ends and at each prompt's last unit boundary. A system prompt shorter than a
block, or any shared prefix ending inside one, is never hit. vLLM can keep a state at a
*junction* (``enable_mamba_shared_prefix_checkpoint``), but only for EAGLE drafts and only
where another group's hit already reaches it, which a junction inside the first block never
does.

:class:`SeenPrefixes` remembers the unit hashes of recent prompts, so the second request to
share a prefix learns where it leaves the first one (:func:`fork`); the scheduler then ends a
chunk there and both groups cache it, and every later request that shares the prefix hits it.
Only a fork counts: where the new prompt leaves an earlier one that went on past that point.
Where the earlier prompts all *ended* (a conversation's next turn extending the last one, a
resend), the earlier prompt's own end state is vLLM's replay boundary, already kept; a state
made there again would serve only another extension of the earlier prompt, which the next turn
is not (it extends the new one), and costs a state and a chunk stop per request (production-
style conversations at ``--prefix-match-unit 16``, nemotron-h-8b 262,144: 0.34 against
vLLM's 0.42 with every extension kept, 0.42 forks only).

A junction must also pay for its state: it saves its depth once per later request that shares
the prefix, and the state's blocks would hold as many prompt tokens of prefix as
:func:`pays_for_state` is given. It is made only once its depth times the ways remembered
prompts went on past it reaches that (the prefix's fan-out so far as the guess of its reuse; a
conversation's later turns, which extend its own earlier turn, do not add to it): a 64-token
system prompt under nemotron-h-8b's six-block state (6,240 tokens) once 98 conversations
opened with it, a 512-token one under qwen3.5-0.8b's (1,632 tokens) once 4 did, a 4,000-token
prefix at its first fork there and its second under nemotron-h-8b.
(Production-style conversations with 16-token hash units at unit 16, nemotron-h-8b 262,144:
0.26 with every fork kept against vLLM's 0.31.)

Pure Python over the chained hashes vLLM already computed; no vLLM import.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

#: The fewest prefixes kept, whatever the pool's size.
MIN_SEEN_PREFIXES = 4096


class SeenPrefixes:
    """The unit prefixes of the most recent prompts, at most ``capacity`` of them.

    A key is the chained hash of a prompt's first ``k`` units, so one key stands for a whole
    prefix; :meth:`record` inserts a prompt's longest prefix first, so its shortest ones are
    the newest and every prefix of a remembered one is remembered too (the search in
    :meth:`longest` relies on it). Each key also says whether a prompt recorded with it went on
    past that prefix (it stays set while the key is remembered, even once
    that prompt's longer prefixes are forgotten) and how many ways prompts went on past it
    (:meth:`branches`). Keys are Python's ``hash`` of vLLM's block hashes: a collision can only
    suggest a junction, never a hit (vLLM looks the real hash up).
    """

    __slots__ = ("capacity", "_seen")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"SeenPrefixes capacity={capacity!r}: allowed values are integers >= 1")
        self.capacity = capacity
        #: key -> prompts that left the remembered ones right after it * 2 + whether one
        #: went on past it
        self._seen: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def longest(self, unit_hashes: Sequence[Any], limit: int) -> int:
        """How many leading units of ``unit_hashes`` (at most ``limit``) an earlier prompt had."""
        seen = self._seen
        low, high = 0, min(limit, len(unit_hashes))
        while low < high:
            mid = (low + high + 1) // 2
            if hash(unit_hashes[mid - 1]) in seen:
                low = mid
            else:
                high = mid - 1
        return low

    def branches(self, unit_hashes: Sequence[Any], count: int) -> int:
        """How many ways remembered prompts went on past the first ``count`` units of
        ``unit_hashes`` (0 if none did): the first one that went on, and each that left the
        remembered ones right there. A conversation's later turns, which extend their own
        earlier turn, add nothing to the prefixes they share with other conversations (while
        that turn is remembered: once its longer prefixes are forgotten, the next turn leaves
        the remembered ones where they end)."""
        value = self._seen.get(hash(unit_hashes[count - 1]), 0)
        return (value >> 1) + 1 if value & 1 else 0

    def record(self, unit_hashes: Sequence[Any], count: int, known: int | None = None) -> None:
        """Remember the first ``count`` unit prefixes of a prompt, forgetting the oldest: the
        prefix it leaves the remembered ones after gains a branch. ``known``: what
        :meth:`longest` gives for ``count`` (found again when not given)."""
        seen = self._seen
        last = min(count, len(unit_hashes)) - 1
        if known is None:
            known = self.longest(unit_hashes, last + 1)  # remembered prefixes close downwards
        # the longest remembered prefix, if this prompt goes on past it where another did
        branch = hash(unit_hashes[known - 1]) if 0 < known <= last else None
        if branch is not None and not seen[branch] & 1:
            branch = None
        for index in range(last, -1, -1):
            key = hash(unit_hashes[index])
            seen[key] = seen.get(key, 0) | (index < last)
            seen.move_to_end(key)
        if branch is not None:
            seen[branch] += 2
        while len(seen) > self.capacity:
            seen.popitem(last=False)


def fork(seen: SeenPrefixes, unit_hashes: Sequence[Any], num_prompt_tokens: int,
         unit: int) -> tuple[int, int]:
    """Where this prompt forks from the remembered ones and how many ways they went on past
    that prefix (:meth:`SeenPrefixes.branches`) ((0, 0): no fork), then remember its prefixes.
    The fork is the end of the longest remembered prefix it shares, if a remembered prompt went
    on past it. A hit stops one token short of the prompt, so the fork does: a prompt that ends
    inside a remembered one gets its own last unit boundary (kept by vLLM too, as its replay
    boundary; ending a chunk there still made more hits on production/nemotron-h-8b 262,144 at
    unit 16, 0.4191 against 0.4174 without)."""
    limit = (num_prompt_tokens - 1) // unit
    found = seen.longest(unit_hashes, limit)
    branches = seen.branches(unit_hashes, found) if found else 0
    seen.record(unit_hashes, limit, found)
    return (found * unit, branches) if branches else (0, 0)


def pays_for_state(position: int, branches: int, state_tokens: int) -> bool:
    """Whether a junction state at ``position``, past which remembered prompts went on in
    ``branches`` ways, has saved, had it been kept, as many prompt tokens as its blocks hold
    (``state_tokens``): each branch after the first would have hit it."""
    return position * branches >= state_tokens
