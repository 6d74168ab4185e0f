"""Replay workloads: deterministic generators and the user-trace (JSONL) loader.

Every request has a prompt and *forced* output tokens (the fake model emits exactly those), so
a replay is deterministic and a later turn of a conversation can contain an earlier turn's
output. Times are in seconds of the harness's simulated clock.

Trace lines (JSONL, optionally gzip-compressed ``.jsonl.gz``), one request per line::

    {"id": "r1", "arrival_s": 0.5, "prompt_token_ids": [1, 2, 3], "output_token_ids": [7, 8]}
    {"id": "r2", "prompt_token_ids": [1, 2, 3, 7, 8, 4], "max_tokens": 16, "after": "r1"}

- ``id`` (string or integer, unique), ``prompt_token_ids`` (non-empty list of token ids >= 0);
- ``output_token_ids`` (non-empty list) or ``max_tokens`` (integer >= 1; the outputs are then
  generated deterministically from the id); both may be given if they agree;
- ``arrival_s`` (number >= 0, default 0): arrival time;
- ``after`` (extension, optional): id of an earlier request; ``arrival_s`` then counts from the
  moment that request finishes (closed-loop sessions: a turn follows the previous answer).

Hash-block traces (the Mooncake FAST'25 format and Alibaba's Qwen-Bailian traces, both of
which ``vllm bench serve --dataset-name timed_trace`` reads) are recognised by their
``hash_ids`` key and read as they are::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}
    {"chat_id": 159, "parent_chat_id": 55, "timestamp": 61.114, "input_length": 521,
     "output_length": 132, "type": "text", "turn": 2, "hash_ids": [1089, 1090, ...]}

- ``timestamp``: arrival time (the first line's is time 0, an earlier one on a later line is
  read as 0), in ``timestamp_unit``: ``"ms"`` or ``"s"``; by default seconds for lines that carry
  Bailian's ``parent_chat_id``, else milliseconds (Mooncake). ``input_length``: prompt
  tokens; ``output_length``: output tokens (0 is read as 1: a server always generates one);
  ``hash_ids``: one id per shared unit of ``hash_block_size`` tokens (Mooncake 512, Bailian 16).
  By default the unit is read from the trace: the power of two ``u`` with
  ``len(hash_ids) == ceil(input_length / u)`` (or ``floor``) on the lines with more than one
  id among its first :data:`UNIT_SAMPLE_LINES` (:func:`infer_hash_block_size`). Other keys are
  ignored.
- The same hash id gives the same tokens in any process (seeded from the id, never Python's
  ``hash``); a partial last unit is the first tokens of its id's unit. Prompt tokens beyond the
  units the hash ids cover are unique to the line; hash ids beyond ``input_length`` are dropped.
- Requests are named ``t<line number>``.

``time_scale`` multiplies every arrival time (2.0 = half the request rate); ``limit`` keeps the
first requests.

A malformed line raises :class:`TraceError` naming the file, the line number and the problem.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ConversationShape",
    "Trace",
    "TraceError",
    "TraceRequest",
    "WORKLOADS",
    "conversation_lines",
    "infer_hash_block_size",
    "load_trace",
    "make_workload",
    "scale_arrivals",
    "write_trace",
]

#: Token ids the generators draw from (any vocabulary of the shapes holds them).
TOKEN_LOW, TOKEN_HIGH = 16, 32000
TRACE_KEYS = ("id", "arrival_s", "prompt_token_ids", "output_token_ids", "max_tokens", "after")
HASH_BLOCK_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
DEFAULT_HASH_BLOCK_SIZE = 512
#: Seconds per ``timestamp`` unit of a hash-block trace.
TIMESTAMP_UNITS = {"ms": 0.001, "s": 1.0}
#: A key only Alibaba's Qwen-Bailian traces (timestamps in seconds) carry.
BAILIAN_KEY = "parent_chat_id"
#: Lines the hash unit is read from, and the share of them it must fit.
UNIT_SAMPLE_LINES, UNIT_MIN_FIT = 2000, 0.9
HASH_UNIT_CANDIDATES = tuple(1 << k for k in range(17))


class TraceError(ValueError):
    """A trace file (or line) that cannot be replayed."""


@dataclass(frozen=True)
class TraceRequest:
    id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    arrival_s: float = 0.0
    after: str | None = None

    @property
    def max_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass
class Trace:
    name: str
    requests: list[TraceRequest]
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def generated_outputs(request_id: str, count: int) -> list[int]:
    """Deterministic output tokens for a trace line that gives only ``max_tokens``."""
    seed = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little")
    return _tokens(random.Random(seed), count)


# ---- generators ---------------------------------------------------------------------------------


def agentic(block_size: int, seed: int = 0, sessions: int = 12, turns: int = 8) -> Trace:
    """Tool-use sessions: shared system prompt, growing history, a long shared instruction tail.

    Turn ``t`` of a session is ``system + task + (answer_i + tool_result_i for i < t) + tail``.
    The next turn inserts the new answer and tool result *before* the tail, so two consecutive
    turns share a prefix that ends well before the earlier turn's last full block (the tail is
    several blocks long): the only Mamba state upstream align mode keeps for a prompt, the one
    at its last block boundary, lies inside the tail and is never reused.
    """
    rng = random.Random(seed)
    system = _tokens(rng, 2000)
    tail = _tokens(rng, max(1800, 3 * block_size + 17))
    requests = []
    for s in range(sessions):
        history = _tokens(rng, rng.randint(300, 600))  # the task
        previous = None
        for t in range(turns):
            output = _tokens(rng, rng.randint(40, 300))
            rid = f"agent{s}-turn{t}"
            requests.append(TraceRequest(
                rid, system + history + tail, output,
                arrival_s=round(2.0 * s, 3) if previous is None else round(rng.uniform(0.2, 3.0), 3),
                after=previous))
            history = history + output + _tokens(rng, int(rng.lognormvariate(math.log(500), 0.6)) + 50)
            previous = rid
    return Trace("agentic", requests, agentic.__doc__.split("\n")[0],  # type: ignore[union-attr]
                 {"sessions": sessions, "turns": turns, "system": len(system), "tail": len(tail)})


def chat(block_size: int, seed: int = 0, conversations: int = 24) -> Trace:
    """Multi-turn conversations shaped like vLLM's ``benchmarks/multi_turn`` default config.

    ``generate_multi_turn.json``: turns uniform 12-18, a 500-token prefix common to all
    conversations, a per-conversation prefix (lognormal, average 1000, max 5000) on the first
    turn, user turns uniform 120-160 tokens, assistant answers uniform 80-120. Each turn follows
    the previous answer immediately.
    """
    rng = random.Random(seed)
    common = _tokens(rng, 500)
    requests = []
    for c in range(conversations):
        own = min(5000, max(1, int(rng.lognormvariate(math.log(1000) - 0.5 * 0.35 ** 2, 0.35))))
        context = common + _tokens(rng, own)
        previous = None
        for t in range(rng.randint(12, 18)):
            context = context + _tokens(rng, rng.randint(120, 160))
            answer = _tokens(rng, rng.randint(80, 120))
            rid = f"conv{c}-turn{t}"
            requests.append(TraceRequest(rid, list(context), answer,
                                         arrival_s=round(0.25 * c, 3) if previous is None else 0.0,
                                         after=previous))
            context = context + answer
            previous = rid
    return Trace("chat", requests, chat.__doc__.split("\n")[0],  # type: ignore[union-attr]
                 {"conversations": conversations})


def prefix_repetition(block_size: int, seed: int = 0, prefix_len: int = 2048,
                      suffix_len: int = 256, num_prefixes: int = 10, num_prompts: int = 200,
                      output_len: int = 128) -> Trace:
    """Like ``vllm bench serve --dataset-name prefix_repetition``: shuffled prompts over shared
    prefixes, all sent at once.

    ``num_prompts // num_prefixes`` prompts per random prefix, each with its own random suffix,
    shuffled. The prefix is 2048 tokens instead of the benchmark's default 256, which is shorter
    than one hybrid block (so nothing could ever hit).
    """
    rng = random.Random(seed)
    requests = []
    for p in range(num_prefixes):
        prefix = _tokens(rng, prefix_len)
        for i in range(num_prompts // num_prefixes):
            requests.append(TraceRequest(f"prefix{p}-{i}", prefix + _tokens(rng, suffix_len),
                                         _tokens(rng, output_len)))
    rng.shuffle(requests)
    return Trace("prefix-repetition", requests,
                 prefix_repetition.__doc__.split("\n")[0],  # type: ignore[union-attr]
                 {"prefix_len": prefix_len, "suffix_len": suffix_len,
                  "num_prefixes": num_prefixes, "num_prompts": num_prompts})


def short(block_size: int, seed: int = 0, num_prompts: int = 200, rate: float = 20.0) -> Trace:
    """Prompts shorter than one block sharing a 64-token system prompt (Poisson arrivals).

    No block-granular prefix cache can hit them: every miss is "prefix shorter than a block".
    """
    rng = random.Random(seed)
    system = _tokens(rng, min(64, block_size // 4))
    requests, now = [], 0.0
    for i in range(num_prompts):
        now += rng.expovariate(rate)
        length = rng.randint(max(len(system) + 1, block_size // 4), block_size - 1)
        requests.append(TraceRequest(f"short{i}", system + _tokens(rng, length - len(system)),
                                     _tokens(rng, 64), arrival_s=round(now, 4)))
    return Trace("short", requests, short.__doc__.split("\n")[0],  # type: ignore[union-attr]
                 {"num_prompts": num_prompts, "rate": rate})


def branching(block_size: int, seed: int = 0, tasks: int = 10, steps: int = 6,
              fanout: int = 3) -> Trace:
    """An agent that explores: each step forks several attempts from the same history.

    A task is ``system + task``; each step sends ``fanout`` attempts that share the history and
    differ from a random point inside the last observation on (retries, sampled plans, parallel
    tool calls), then continues from one of them. Branch points fall anywhere inside a block,
    never where a scheduler would stop a chunk.
    """
    rng = random.Random(seed)
    system = _tokens(rng, 1500)
    requests = []
    for t in range(tasks):
        history = system + _tokens(rng, rng.randint(200, 800))
        previous = None
        for step in range(steps):
            observation = _tokens(rng, rng.randint(300, 1500))
            chosen = None
            for attempt in range(fanout):
                cut = rng.randint(0, len(observation))
                prompt = history + observation[:cut] + _tokens(rng, len(observation) - cut + 40)
                rid = f"task{t}-step{step}-try{attempt}"
                output = _tokens(rng, rng.randint(30, 200))
                requests.append(TraceRequest(
                    rid, prompt, output,
                    arrival_s=round(1.5 * t, 3) if previous is None else round(rng.uniform(0.0, 0.5), 3),
                    after=previous))
                if chosen is None:
                    chosen = (prompt, output)
            assert chosen is not None
            history = chosen[0] + chosen[1]
            previous = f"task{t}-step{step}-try0"
    return Trace("branching", requests, branching.__doc__.split("\n")[0],  # type: ignore[union-attr]
                 {"tasks": tasks, "steps": steps, "fanout": fanout})


def rag(block_size: int, seed: int = 0, num_prompts: int = 240, corpus: int = 120,
        per_prompt: int = 4, rate: float = 4.0) -> Trace:
    """Retrieval-augmented prompts: a system prompt, a few retrieved passages, a question.

    Passages are drawn from a corpus with Zipf-like popularity (weight ``1 / rank``), so some
    pairs and orders recur: a prompt shares the system prompt with every other one and its
    first passages with some. Passages are 200-900 tokens, so they start anywhere in a block.
    Poisson arrivals.
    """
    rng = random.Random(seed)
    system = _tokens(rng, 700)
    passages = [_tokens(rng, rng.randint(200, 900)) for _ in range(corpus)]
    weights = [1.0 / (rank + 1) for rank in range(corpus)]
    requests, now = [], 0.0
    for i in range(num_prompts):
        now += rng.expovariate(rate)
        chosen: list[int] = []
        while len(chosen) < per_prompt:
            pick = rng.choices(range(corpus), weights)[0]
            if pick not in chosen:
                chosen.append(pick)
        prompt = list(system)
        for pick in chosen:
            prompt += passages[pick]
        prompt += _tokens(rng, rng.randint(20, 120))
        requests.append(TraceRequest(f"rag{i}", prompt, _tokens(rng, rng.randint(20, 200)),
                                     arrival_s=round(now, 4)))
    return Trace("rag", requests, rag.__doc__.split("\n")[0],  # type: ignore[union-attr]
                 {"num_prompts": num_prompts, "corpus": corpus, "per_prompt": per_prompt,
                  "rate": rate})


@dataclass(frozen=True)
class ConversationShape:
    """How :func:`conversation_lines` draws a conversation service's hash-block trace.

    Sessions start ``session_rate`` per second (Poisson); each opens with one of the system
    prompts (``system_blocks`` units each, drawn by ``system_popularity``; with
    ``ragged_system`` each ends 1 to ``unit - 1`` tokens short of its last unit) and runs
    ``turns`` turns ``think_s`` apart, each adding ``user_tokens`` to the previous prompt and
    asking ``output_tokens``.  The two choices that tell the generators apart:

    - ``whole_units_only``: a next prompt keeps only the previous prompt's *full* units and the
      answer counts in its length (Mooncake's public traces: a unit is shared only when all of
      it is, and the answer is prompt text of the next turn).  Off: it keeps every unit id of
      the previous prompt, the last partial one too, and the answer is not in it;
    - ``branch_prob``: after a turn past the first, the chance of a branch: a request that
      leaves the session after an earlier turn (an edited or regenerated message), keeping that
      turn's full units only (needs ``whole_units_only``).
    """

    sessions: int = 60
    session_rate: float = 0.5
    system_blocks: tuple[int, ...] = (2, 3, 5, 8)
    system_popularity: tuple[float, ...] = (0.45, 0.3, 0.15, 0.1)
    ragged_system: bool = True
    turns: tuple[int, int] = (1, 10)
    user_tokens: tuple[int, int] = (50, 1500)
    output_tokens: tuple[int, int] = (20, 400)
    think_s: tuple[float, float] = (2.0, 30.0)
    whole_units_only: bool = False
    branch_prob: float = 0.0
    #: a turn whose prompt would be longer ends its session (``None``: no limit)
    max_input: int | None = None

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.session_rate <= 0:
            raise ValueError(f"sessions {self.sessions}, session_rate {self.session_rate}: "
                             "allowed sessions >= 1 and a rate > 0")
        if len(self.system_blocks) != len(self.system_popularity) or not self.system_blocks \
                or min(self.system_blocks) < 1:
            raise ValueError(f"system_blocks {self.system_blocks} with popularity "
                             f"{self.system_popularity}: allowed one weight per system prompt "
                             "of >= 1 unit")
        if not 0.0 <= self.branch_prob <= 1.0 or (self.branch_prob and not
                                                   self.whole_units_only):
            raise ValueError(f"branch_prob {self.branch_prob}: allowed 0..1, above 0 only "
                             "with whole_units_only")


def conversation_lines(shape: ConversationShape = ConversationShape(), seed: int = 0,
                       unit: int = DEFAULT_HASH_BLOCK_SIZE) -> list[dict[str, Any]]:
    """A conversation service's trace lines in the hash-block (Mooncake FAST'25) format, sorted
    by ``timestamp`` (ms); deterministic in ``seed``.  Besides ``timestamp``, ``input_length``,
    ``output_length`` and ``hash_ids`` (one id per ``unit`` tokens), each line says where it
    comes from: ``session``, ``turn`` and, for a branch, ``branch_of`` (the turn it leaves
    after; else ``None``).  :data:`HASH_BLOCK_KEYS` selects the format's own keys."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    def units(tokens: int) -> int:
        return -(-tokens // unit)

    systems = [(fresh(k), k * unit - (rng.randint(1, unit - 1) if shape.ragged_system else 0))
               for k in shape.system_blocks]
    lines: list[dict[str, Any]] = []
    start = 0.0
    for session in range(shape.sessions):
        start += rng.expovariate(shape.session_rate)
        system_ids, length = rng.choices(systems, shape.system_popularity)[0]
        ids, t = list(system_ids), start
        history: list[tuple[list[int], int]] = []  # (full unit ids, tokens) of each prompt
        for turn in range(rng.randint(*shape.turns)):
            if not shape.whole_units_only:
                keep = len(ids)
            else:  # the block the answer completes holds tokens no earlier prompt had
                keep = (length if turn == 0 else history[-1][1]) // unit
            length += rng.randint(*shape.user_tokens)
            if shape.max_input is not None and length > shape.max_input:
                break
            ids = ids[:keep] + fresh(max(0, units(length) - keep))
            out = rng.randint(*shape.output_tokens)
            lines.append({"t": t, "input_length": length, "output_length": out,
                          "hash_ids": list(ids), "session": session, "turn": turn,
                          "branch_of": None})
            history.append((ids[:length // unit], length))
            if shape.branch_prob and turn and rng.random() < shape.branch_prob:
                parent = rng.randrange(turn)
                kept, kept_len = history[parent]
                fork_len = kept_len + rng.randint(*shape.user_tokens)
                if shape.max_input is not None:
                    fork_len = min(fork_len, shape.max_input)
                lines.append({"t": t + rng.uniform(*shape.think_s) / 2, "input_length": fork_len,
                              "output_length": rng.randint(*shape.output_tokens),
                              "hash_ids": kept + fresh(units(fork_len) - len(kept)),
                              "session": session, "turn": turn, "branch_of": parent})
            if shape.whole_units_only:
                length += out
            t += rng.uniform(*shape.think_s)
    for line in lines:
        line["timestamp"] = round(line.pop("t") * 1000)
    lines.sort(key=lambda line: line["timestamp"])  # stable: a tie keeps generation order
    return lines


def production_lines(seed: int = 0, sessions: int = 60, unit: int = DEFAULT_HASH_BLOCK_SIZE,
                     rate: float = 0.5) -> list[dict[str, Any]]:
    """Hash-block trace lines (Mooncake FAST'25 format) of a conversation service
    (:func:`conversation_lines` with :class:`ConversationShape`'s defaults).

    A few system prompts of uneven popularity and length (not whole units), sessions of 1-10
    turns whose next prompt repeats the previous one's units and adds new ones (the answer is
    not a unit of the next prompt, as in the public traces), think times of seconds, Poisson
    session starts, outputs 20-400 tokens.
    """
    shape = ConversationShape(sessions=sessions, session_rate=rate)
    return [{k: line[k] for k in HASH_BLOCK_KEYS} for line in conversation_lines(shape, seed, unit)]


def production(block_size: int, seed: int = 0, sessions: int = 60,
               unit: int = DEFAULT_HASH_BLOCK_SIZE) -> Trace:
    """A conversation service's traffic as a hash-block trace (:func:`production_lines`),
    read the way ``replay --trace`` reads such a file."""
    reader = HashBlockReader(unit)
    requests = [reader.request(line, number)
                for number, line in enumerate(production_lines(seed, sessions, unit), start=1)]
    return Trace("production", requests, production.__doc__.split("\n")[0],  # type: ignore[union-attr]
                 {"sessions": sessions, "hash_block_size": unit})


WORKLOADS: dict[str, Callable[..., Trace]] = {
    "agentic": agentic,
    "chat": chat,
    "prefix-repetition": prefix_repetition,
    "short": short,
    "branching": branching,
    "rag": rag,
    "production": production,
}


def make_workload(name: str, *, block_size: int, seed: int = 0, **params: Any) -> Trace:
    try:
        generator = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; allowed: {', '.join(WORKLOADS)}") from None
    return generator(block_size, seed, **params)


def _check_time_scale(time_scale: Any) -> None:
    if (isinstance(time_scale, bool) or not isinstance(time_scale, (int, float))
            or not math.isfinite(time_scale) or time_scale <= 0):
        raise ValueError(f"time_scale must be a number > 0, got {time_scale!r}")


def scale_arrivals(trace: Trace, time_scale: float) -> Trace:
    """``trace`` with every arrival time (and follow-up delay) multiplied by ``time_scale``
    (2.0 = half the request rate); the trace itself when it is 1."""
    _check_time_scale(time_scale)
    if time_scale == 1.0:
        return trace
    requests = [dataclasses.replace(r, arrival_s=r.arrival_s * time_scale) for r in trace.requests]
    params = dict(trace.params)
    params["time_scale"] = params.get("time_scale", 1.0) * time_scale
    return Trace(trace.name, requests, trace.description, params)


# ---- user traces ---------------------------------------------------------------------------------


def _token_list(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{key!r} must be a non-empty list of token ids")
    for position, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"{key!r}[{position}] is {token!r}; token ids are integers >= 0")
    return value


def parse_trace_line(obj: Any, seen: set[str]) -> TraceRequest:
    """One decoded trace line; raises ``ValueError`` saying what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(TRACE_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                         f"{', '.join(TRACE_KEYS)}")
    if "id" not in obj:
        raise ValueError("missing 'id'")
    rid = obj["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise ValueError(f"'id' must be a non-empty string or an integer, got {rid!r}")
    rid = str(rid)
    if rid in seen:
        raise ValueError(f"duplicate id {rid!r}")
    if "prompt_token_ids" not in obj:
        raise ValueError("missing 'prompt_token_ids'")
    prompt = _token_list(obj["prompt_token_ids"], "prompt_token_ids")
    outputs = obj.get("output_token_ids")
    max_tokens = obj.get("max_tokens")
    if outputs is None and max_tokens is None:
        raise ValueError("give 'output_token_ids' or 'max_tokens'")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise ValueError(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    if outputs is not None:
        outputs = _token_list(outputs, "output_token_ids")
        if max_tokens is not None and max_tokens != len(outputs):
            raise ValueError(f"'max_tokens' is {max_tokens} but 'output_token_ids' has "
                             f"{len(outputs)} tokens")
    else:
        assert max_tokens is not None
        outputs = generated_outputs(rid, max_tokens)
    arrival = obj.get("arrival_s", 0.0)
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not \
            math.isfinite(arrival) or arrival < 0:
        raise ValueError(f"'arrival_s' must be a number >= 0, got {arrival!r}")
    after = obj.get("after")
    if after is not None:
        after = str(after)
        if after not in seen:
            raise ValueError(f"'after' names {after!r}, which is not an earlier request id")
    return TraceRequest(rid, prompt, outputs, float(arrival), after)


def _open_lines(path: Path) -> Iterable[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _seeded_tokens(label: str, count: int) -> list[int]:
    seed = int.from_bytes(hashlib.sha256(label.encode()).digest()[:8], "little")
    return _tokens(random.Random(seed), count)


def _count(obj: dict[str, Any], key: str, low: int) -> int:
    if key not in obj:
        raise ValueError(f"missing {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key!r} must be an integer >= {low}, got {value!r}")
    return value


class HashBlockReader:
    """Turns hash-block trace lines into requests; caches one unit of tokens per hash id."""

    def __init__(self, hash_block_size: int, timestamp_unit: str = "ms") -> None:
        self.unit = hash_block_size
        self.timestamp_unit = timestamp_unit
        self._seconds = TIMESTAMP_UNITS[timestamp_unit]
        self._units: dict[int, list[int]] = {}
        self._first: float | None = None

    def _unit_tokens(self, hash_id: int) -> list[int]:
        tokens = self._units.get(hash_id)
        if tokens is None:
            tokens = self._units[hash_id] = _seeded_tokens(f"hash-block:{hash_id}", self.unit)
        return tokens

    def request(self, obj: Any, number: int) -> TraceRequest:
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        missing = [key for key in HASH_BLOCK_KEYS if key not in obj]
        if missing:
            raise ValueError(f"missing {', '.join(map(repr, missing))} (a hash-block trace line "
                             f"has {', '.join(HASH_BLOCK_KEYS)})")
        stamp = obj["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or \
                not math.isfinite(stamp) or stamp < 0:
            raise ValueError(f"'timestamp' must be a number >= 0 (in {self.timestamp_unit}), "
                             f"got {stamp!r}")
        length = _count(obj, "input_length", 1)
        outputs = max(_count(obj, "output_length", 0), 1)
        hash_ids = obj["hash_ids"]
        if not isinstance(hash_ids, list):
            raise ValueError(f"'hash_ids' must be a list of integers, got {hash_ids!r}")
        for position, hash_id in enumerate(hash_ids):
            if isinstance(hash_id, bool) or not isinstance(hash_id, int):
                raise ValueError(f"'hash_ids'[{position}] is {hash_id!r}; hash ids are integers")
        prompt: list[int] = []
        for hash_id in hash_ids:
            if len(prompt) >= length:
                break
            prompt.extend(self._unit_tokens(hash_id)[:length - len(prompt)])
        if len(prompt) < length:
            prompt.extend(_seeded_tokens(f"hash-block-line:{number}", length - len(prompt)))
        if self._first is None:
            self._first = float(stamp)
        rid = f"t{number}"
        arrival = max(float(stamp) - self._first, 0.0) * self._seconds
        return TraceRequest(rid, prompt, generated_outputs(rid, outputs), arrival)


def infer_hash_block_size(lengths: Iterable[tuple[int, int]]) -> int:
    """The tokens per hash id of a hash-block trace, from its lines' ``(input_length,
    len(hash_ids))``: the power of two ``u`` with ``len(hash_ids) == ceil(input_length / u)``
    (a hashed partial last unit, as Mooncake and vLLM's ``timed_trace``) or, on every line
    alike, ``floor`` (full units only), on most lines with more than one id (a one-id line fits
    every large ``u``). :data:`DEFAULT_HASH_BLOCK_SIZE` when no line has two ids;
    ``ValueError`` when no power of two fits :data:`UNIT_MIN_FIT` of them (ids that cover less
    than the prompt, or another unit)."""
    votes: dict[tuple[int, str], int] = {}
    informative = 0
    for length, ids in lengths:
        if ids < 2:
            continue
        informative += 1
        for unit in HASH_UNIT_CANDIDATES:
            if -(-length // unit) == ids:
                votes[unit, "ceil"] = votes.get((unit, "ceil"), 0) + 1
            if length // unit == ids:
                votes[unit, "floor"] = votes.get((unit, "floor"), 0) + 1
    if not informative:
        return DEFAULT_HASH_BLOCK_SIZE
    best = max(votes, key=lambda vote: (votes[vote], vote[1] == "ceil"), default=(0, ""))
    fits = votes.get(best, 0)
    if not best[0] or fits < UNIT_MIN_FIT * informative:
        found = f"{best[0]} tokens fit {fits}" if best[0] else "no power of two fits any"
        raise ValueError(
            f"cannot tell how many tokens a hash id stands for: {found} of the {informative} "
            "lines with more than one id (len(hash_ids) == ceil or floor of input_length / "
            "unit); give the unit (--hash-block-size; Mooncake traces: 512, Qwen-Bailian "
            "traces: 16)")
    return best[0]


def _hash_block_sample(path: Path, count: int) -> list[tuple[int, int]]:
    """``(input_length, len(hash_ids))`` of the first ``count`` well-formed lines (the full read
    reports the malformed ones)."""
    sample: list[tuple[int, int]] = []
    with _open_lines(path) as lines:  # type: ignore[attr-defined]
        for line in lines:
            if len(sample) >= count:
                break
            try:
                obj = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("hash_ids"), list) and \
                    type(obj.get("input_length")) is int and obj["input_length"] > 0 and \
                    all(type(hash_id) is int for hash_id in obj["hash_ids"]):
                sample.append((obj["input_length"], len(obj["hash_ids"])))
    return sample


def load_trace(path: str | Path, *, hash_block_size: int | None = None,
               timestamp_unit: str | None = None, time_scale: float = 1.0,
               limit: int | None = None) -> Trace:
    """Read a JSONL / JSONL.gz trace, in this project's format or the hash-block format (see the
    module docstring); raises :class:`TraceError` on the first bad line.  ``hash_block_size``
    and ``timestamp_unit`` (hash-block traces only) are read from the trace when not given."""
    if hash_block_size is not None and (isinstance(hash_block_size, bool) or
                                        not isinstance(hash_block_size, int) or
                                        hash_block_size < 1):
        raise ValueError(f"hash_block_size must be an integer >= 1, got {hash_block_size!r}")
    if timestamp_unit is not None and timestamp_unit not in TIMESTAMP_UNITS:
        raise ValueError(f"timestamp_unit must be one of {', '.join(TIMESTAMP_UNITS)}, got "
                         f"{timestamp_unit!r}")
    _check_time_scale(time_scale)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    requests: list[TraceRequest] = []
    seen: set[str] = set()
    hash_blocks: HashBlockReader | None = None
    try:
        with _open_lines(path) as lines:  # type: ignore[attr-defined]
            for number, line in enumerate(lines, start=1):
                if limit is not None and len(requests) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
                if not requests and isinstance(obj, dict) and "hash_ids" in obj:
                    if hash_block_size is None:
                        sample = _hash_block_sample(path, UNIT_SAMPLE_LINES)
                        try:
                            hash_block_size = infer_hash_block_size(sample)
                        except ValueError as exc:
                            raise TraceError(f"{path}: {exc}") from None
                    unit_of_time = timestamp_unit or ("s" if BAILIAN_KEY in obj else "ms")
                    hash_blocks = HashBlockReader(hash_block_size, unit_of_time)
                try:
                    if hash_blocks is not None:
                        request = hash_blocks.request(obj, number)
                    else:
                        request = parse_trace_line(obj, seen)
                except ValueError as exc:
                    raise TraceError(f"{path}:{number}: {exc}") from None
                seen.add(request.id)
                requests.append(request)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from None
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    params: dict[str, Any] = {"format": "hash-block" if hash_blocks else "tokens"}
    if hash_blocks:
        params["hash_block_size"] = hash_blocks.unit
        params["timestamp_unit"] = hash_blocks.timestamp_unit
    if limit is not None:
        params["limit"] = limit
    return scale_arrivals(Trace(path.name, requests, f"user trace {path}", params), time_scale)


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write a trace in the JSONL format :func:`load_trace` reads (gzip for ``.gz``)."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as out:  # type: ignore[operator]
        for r in trace.requests:
            line: dict[str, Any] = {"id": r.id, "arrival_s": r.arrival_s,
                                    "prompt_token_ids": r.prompt_token_ids,
                                    "output_token_ids": r.output_token_ids}
            if r.after is not None:
                line["after"] = r.after
            out.write(json.dumps(line) + "\n")
