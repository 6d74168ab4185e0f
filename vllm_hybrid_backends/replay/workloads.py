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

A malformed line raises :class:`TraceError` naming the file, the line number and the problem.
"""

from __future__ import annotations

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
    "Trace",
    "TraceError",
    "TraceRequest",
    "WORKLOADS",
    "load_trace",
    "make_workload",
    "write_trace",
]

#: Token ids the generators draw from (any vocabulary of the shapes holds them).
TOKEN_LOW, TOKEN_HIGH = 16, 32000
TRACE_KEYS = ("id", "arrival_s", "prompt_token_ids", "output_token_ids", "max_tokens", "after")


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


WORKLOADS: dict[str, Callable[..., Trace]] = {
    "agentic": agentic,
    "chat": chat,
    "prefix-repetition": prefix_repetition,
    "short": short,
}


def make_workload(name: str, *, block_size: int, seed: int = 0, **params: Any) -> Trace:
    try:
        generator = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; allowed: {', '.join(WORKLOADS)}") from None
    return generator(block_size, seed, **params)


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


def load_trace(path: str | Path) -> Trace:
    """Read a JSONL / JSONL.gz trace; raises :class:`TraceError` on the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    requests: list[TraceRequest] = []
    seen: set[str] = set()
    try:
        with _open_lines(path) as lines:  # type: ignore[attr-defined]
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
                try:
                    request = parse_trace_line(obj, seen)
                except ValueError as exc:
                    raise TraceError(f"{path}:{number}: {exc}") from None
                seen.add(request.id)
                requests.append(request)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from None
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    return Trace(path.name, requests, f"user trace {path}")


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
