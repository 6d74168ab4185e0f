"""How far LRU eviction is from an offline order on a trace, and whether simple online orders help.

    python bench/eviction_headroom.py --trace conversation_trace.jsonl --limit 600 \\
        --model-shape nemotron-h-8b --cache-tokens 1000000,2000000,4000000

A cache model, not a replay: requests in arrival order (a follow-up's delay counted from the
arrival of the request it follows, not from its end), nothing running, no decode. Each
request's prompt is cut into the shape's blocks (the replay's CUDA block rule); it leaves its
full attention blocks cached and, as vLLM 0.32 align mode keeps them by default, a Mamba state
at its replay boundary (the last block before its last token), one where its prompt left a
cached prefix (a junction), and the one it resumed from, read again; a state costs one block
per Mamba group, an attention position one per attention group. A hit is the deepest block with
every attention block before it and a state at it cached (``--attention-only``: the longest
cached prefix, no states), at most the prompt less one token. Eviction orders, all over the
same items:

- ``lru``: vLLM's order. A request's states, then its blocks tail first, join the recent end.
- ``offline``: evict the item whose next reader (a later request whose blocks pass through it)
  is farthest away. It knows the future, but a reader may stop short of the item or resume
  from a deeper state, so it is a heuristic, not a bound; it shows what knowing the future is
  worth to an order over the same items.
- ``two-segment``: items read again after they were stored move to a protected segment (80% of
  the cache); the rest are evicted first (SLRU, SGLang-style two lists).
- ``lineage``: a request whose prefix was cached once but was evicted (its predecessor came back
  too late) is expected to come back too late again: its own items go in front of the LRU
  order, the latest such request's first and its tail before its head; items other requests
  keep at their LRU place stay there.
- ``size-aware``: GreedyDual-Size (Marconi's FLOP-aware utility in its simplest form): a
  request's items get the priority ``clock + depth / blocks held``, the prefill its path saves
  per block it holds; the lowest goes first and sets the clock. Without states
  (``--attention-only``) it is LRU.

The question it answers for issue 15 item 2: is there a value order for vLLM's own blocks and
states worth building? ``offline`` far above ``lru`` says the future would pay; an online order
has to predict it from what the cache saw.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
from collections import OrderedDict, defaultdict
from typing import Any, NamedTuple

POLICIES = ("lru", "offline", "two-segment", "lineage", "size-aware")
PROTECTED_SHARE = 0.8
NEVER = sys.maxsize

Key = tuple[str, int]


class Request(NamedTuple):
    blocks: tuple[int, ...]      # chained hashes of the full prompt blocks
    hit_limit: int               # most blocks a hit may cover (prompt less one token)
    prompt_tokens: int
    block: int
    output_tokens: int


def block_hashes(tokens: list[int], block: int) -> tuple[int, ...]:
    hashes, parent = [], 0
    for start in range(0, len(tokens) - block + 1, block):
        parent = hash((parent, tuple(tokens[start:start + block])))
        hashes.append(parent)
    return tuple(hashes)


def arrival_order(trace) -> list:
    """Requests by arrival; a follow-up's ``arrival_s`` is its delay after the one it follows."""
    at: dict[str, float] = {}
    for request in trace.requests:
        at[request.id] = (at[request.after] if request.after else 0.0) + request.arrival_s
    return sorted(trace.requests, key=lambda r: at[r.id])


def requests_of(trace, block: int) -> list[Request]:
    return [Request(block_hashes(r.prompt_token_ids, block),
                    (len(r.prompt_token_ids) - 1) // block, len(r.prompt_token_ids), block,
                    r.max_tokens)
            for r in arrival_order(trace)]


def stored_items(request: Request, state_blocks: int, hit: int, shared: int,
                 attention_blocks: int = 1) -> list[tuple[Key, int]]:
    """What a finished request leaves cached, first to evict first: the state it resumed from
    (read again), the state vLLM keeps where its prompt left a cached prefix (``shared`` blocks
    deeper than ``hit``: a junction) and the one at its replay boundary (the last block before
    the prompt's last token), then its attention blocks tail first."""
    states: list[int] = []
    if state_blocks:
        depths = ([hit] if hit else []) + ([shared] if shared > hit else []) + \
            [request.hit_limit]
        states = list(dict.fromkeys(d for d in depths if d > 0))
    return [(("s", request.blocks[d - 1]), state_blocks) for d in states] + \
        [(("a", h), attention_blocks) for h in reversed(request.blocks)]


def hit_blocks(request: Request, cached, states: bool) -> int:
    best = 0
    for depth, h in enumerate(request.blocks[:request.hit_limit], start=1):
        if ("a", h) not in cached:
            break
        if not states or ("s", h) in cached:
            best = depth
    return best


class LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self.items: OrderedDict[Key, int] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self.items

    def _take(self, items) -> None:
        for key, _ in items:
            self.used -= self.items.pop(key, 0)

    def store(self, index: int, items, hit: int, reachable: int) -> None:
        self._take(items)
        for key, cost in items:
            self.items[key] = cost
            self.used += cost
        self._fit()

    def _fit(self) -> None:
        while self.used > self.capacity:
            self.used -= self.items.popitem(last=False)[1]


class TwoSegment(LRU):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.protected: OrderedDict[Key, int] = OrderedDict()
        self.protected_used = 0

    def __contains__(self, key: Key) -> bool:
        return key in self.items or key in self.protected

    def store(self, index: int, items, hit: int, reachable: int) -> None:
        read = {key for key, _ in items if key in self}
        for key, _ in items:
            self.used -= self.items.pop(key, 0)
            cost = self.protected.pop(key, 0)
            self.used -= cost
            self.protected_used -= cost
        for key, cost in items:
            segment = self.protected if key in read else self.items
            segment[key] = cost
            self.used += cost
            if key in read:
                self.protected_used += cost
        while self.protected_used > PROTECTED_SHARE * self.capacity:
            key, cost = self.protected.popitem(last=False)
            self.protected_used -= cost
            self.items[key] = cost
            self.items.move_to_end(key)
        while self.used > self.capacity:
            segment = self.items if self.items else self.protected
            cost = segment.popitem(last=False)[1]
            self.used -= cost
            if segment is self.protected:
                self.protected_used -= cost


class Lineage(LRU):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.front: OrderedDict[Key, int] = OrderedDict()   # last in, first evicted

    def __contains__(self, key: Key) -> bool:
        return key in self.items or key in self.front

    def store(self, index: int, items, hit: int, reachable: int) -> None:
        if reachable <= hit:
            for key, _ in items:
                self.used -= self.front.pop(key, 0)
            super().store(index, items, hit, reachable)
            return
        # its prefix came back too late once: its own items go first, tail before head;
        # what other requests keep at its LRU place stays there
        for key, cost in reversed(items):
            if key in self.items:
                self.items.move_to_end(key)
                continue
            self.used -= self.front.pop(key, 0)
            self.front[key] = cost
            self.used += cost
        while self.used > self.capacity:
            if self.front:
                self.used -= self.front.popitem(last=True)[1]
            else:
                self.used -= self.items.popitem(last=False)[1]


class Offline:
    def __init__(self, capacity: int, requests: list[Request]) -> None:
        self.capacity, self.used = capacity, 0
        self.readers: dict[int, list[int]] = defaultdict(list)   # block hash -> request indices
        for index, request in enumerate(requests):
            for h in request.blocks:
                self.readers[h].append(index)
        for indices in self.readers.values():
            indices.reverse()
        self.items: dict[Key, tuple[int, int]] = {}
        self.heap: list[tuple[int, Key]] = []

    def __contains__(self, key: Key) -> bool:
        return key in self.items

    def _next_reader(self, h: int, index: int) -> int:
        indices = self.readers[h]
        while indices and indices[-1] <= index:
            indices.pop()
        return indices[-1] if indices else NEVER

    def store(self, index: int, items, hit: int, reachable: int) -> None:
        for key, cost in items:
            following = self._next_reader(key[1], index)
            self.used -= self.items.get(key, (0, 0))[1]
            self.items[key] = (following, cost)
            self.used += cost
            heapq.heappush(self.heap, (-following, key))
        while self.used > self.capacity:
            negative, key = heapq.heappop(self.heap)
            entry = self.items.get(key)
            if entry is None or entry[0] != -negative:
                continue
            if entry[0] <= index:   # its reader has come: when is the next one?
                following = self._next_reader(key[1], index)
                self.items[key] = (following, entry[1])
                heapq.heappush(self.heap, (-following, key))
                continue
            del self.items[key]
            self.used -= entry[1]


class SizeAware:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.used, self.clock, self.sequence = capacity, 0, 0.0, 0
        self.items: dict[Key, tuple[float, int, int]] = {}   # priority, cost, sequence
        self.heap: list[tuple[float, int, Key]] = []

    def __contains__(self, key: Key) -> bool:
        return key in self.items

    def store(self, index: int, items, hit: int, reachable: int, saving: float) -> None:
        for key, cost in items:
            old = self.items.get(key)
            priority = max(self.clock + saving, old[0] if old else 0.0)
            self.used += cost - (old[1] if old else 0)
            self.sequence += 1
            self.items[key] = (priority, cost, self.sequence)
            heapq.heappush(self.heap, (priority, self.sequence, key))
        while self.used > self.capacity:
            priority, sequence, key = heapq.heappop(self.heap)
            entry = self.items.get(key)
            if entry is not None and entry[2] == sequence:
                del self.items[key]
                self.used -= entry[1]
                self.clock = priority


def simulate(requests: list[Request], capacity_blocks: int, state_blocks: int,
             policy: str, attention_blocks: int = 1) -> float:
    """Token hit rate of ``policy`` over ``requests`` in a cache of ``capacity_blocks``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown eviction order {policy!r}; known: {', '.join(POLICIES)}")
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or \
            capacity_blocks < 1:
        raise ValueError(f"capacity must be a block count >= 1, got {capacity_blocks!r}")
    cache: Any = Offline(capacity_blocks, requests) if policy == "offline" else \
        {"lru": LRU, "two-segment": TwoSegment, "lineage": Lineage,
         "size-aware": SizeAware}[policy](capacity_blocks)
    seen: set[Key] = set()
    states = state_blocks > 0
    hit_tokens = 0
    for index, request in enumerate(requests):
        hit = hit_blocks(request, cache, states)
        shared = hit_blocks(request, cache, False)
        reachable = hit_blocks(request, seen, states)
        hit_tokens += hit * request.block
        items = stored_items(request, state_blocks, hit, shared, attention_blocks)
        seen.update(key for key, _ in items)
        if policy == "size-aware":
            depth = len(request.blocks)
            held = depth * attention_blocks + state_blocks
            cache.store(index, items, hit, reachable, depth / held if held else 0.0)
        else:
            cache.store(index, items, hit, reachable)
    prompt_tokens = sum(r.prompt_tokens for r in requests)
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0


def _quartile(value: int, edges: list[int]) -> str:
    for number, edge in enumerate(edges, start=1):
        if value <= edge:
            return f"q{number} (<= {edge:,})"
    return f"q4 (> {edges[-1]:,})"


def reuse_by_feature(requests: list[Request]) -> dict[str, dict[str, list[int]]]:
    """Per feature an online order could see when a request's state is stored, and per value:
    ``[states, read again]`` (a later request's blocks pass through the state's block)."""
    readers: dict[int, int] = {}
    for index, request in enumerate(requests):
        for h in request.blocks:
            readers[h] = index                      # the last reader
    prompts = sorted(r.prompt_tokens for r in requests)
    outputs = sorted(r.output_tokens for r in requests)
    prompt_edges = [prompts[len(prompts) * k // 4] for k in (1, 2, 3)]
    output_edges = [outputs[len(outputs) * k // 4] for k in (1, 2, 3)]
    table: dict[str, dict[str, list[int]]] = defaultdict(dict)
    seen: set[Key] = set()
    for index, request in enumerate(requests):
        if not request.hit_limit:
            continue
        reused = readers[request.blocks[request.hit_limit - 1]] > index
        shared = hit_blocks(request, seen, False)
        for feature, value in (
                ("all", "all"),
                ("prefix seen before", "yes" if shared else "no"),
                ("prompt tokens", _quartile(request.prompt_tokens, prompt_edges)),
                ("output tokens", _quartile(request.output_tokens, output_edges))):
            counts = table[feature].setdefault(value, [0, 0])
            counts[0] += 1
            counts[1] += reused
        seen.update(("a", h) for h in request.blocks)
    return {feature: dict(sorted(values.items())) for feature, values in table.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="a trace `replay --trace` reads")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--model-shape", default="qwen3.5-0.8b",
                        help="a built-in shape or a hybrid model's config.json")
    parser.add_argument("--cache-tokens", default="2000000", help="comma-separated token counts")
    parser.add_argument("--attention-only", action="store_true",
                        help="no Mamba states: hits at any cached prefix")
    parser.add_argument("--reuse", action="store_true",
                        help="also: how often a stored state is read again, by what an online "
                             "order sees when it is stored")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    try:
        capacities = [int(x) for x in args.cache_tokens.split(",")]
    except ValueError:
        parser.error(f"--cache-tokens {args.cache_tokens!r}: comma-separated integers expected")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_hybrid_backends.replay.engine_config import build_engine_setup
    from vllm_hybrid_backends.replay.harness import ReplayConfig
    from vllm_hybrid_backends.replay.workloads import load_trace

    trace = load_trace(args.trace, limit=args.limit)
    config = ReplayConfig(model_shape=args.model_shape)
    layout = config.layout()
    block = layout.block_size
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in trace.requests)
    setup = build_engine_setup(config.resolved_shape(), layout, max_num_batched_tokens=8192,
                               max_num_seqs=1024, max_model_len=(longest // block + 2) * block)
    state_blocks = 0 if args.attention_only else len(setup.mamba_group_ids)
    attention_blocks = len(setup.attention_group_ids)
    requests = requests_of(trace, block)
    rows: list[dict[str, float]] = []
    for tokens in capacities:
        if tokens < block:
            parser.error(f"--cache-tokens {tokens} is less than one block ({block} tokens)")
        row: dict[str, float] = {"cache_tokens": tokens, "blocks": tokens // block, "block_size": block,
               "state_blocks": state_blocks}
        for policy in POLICIES:
            row[policy] = round(simulate(requests, tokens // block, state_blocks, policy,
                                         attention_blocks), 4)
        rows.append(row)
        if not args.json:
            print(f"{tokens:>12,d} tokens  " + "  ".join(f"{p} {row[p]:.4f}" for p in POLICIES),
                  file=sys.stderr)
    reuse = reuse_by_feature(requests) if args.reuse else None
    if reuse and not args.json:
        for feature, values in reuse.items():
            print(f"{feature}: " + ", ".join(f"{value} {read}/{states} read again"
                                            for value, (states, read) in values.items()),
                  file=sys.stderr)
    if args.json:
        print(json.dumps({"rows": rows, "reuse": reuse} if reuse else rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
