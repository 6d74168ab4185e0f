"""Opt-in trace of what the plugin did in each process, for routing tests and bug reports.

Set ``VLLM_HYBRID_TRACE_FILE=/path/file.jsonl``: every process appends one JSON line when the
plugin registers, when patches apply, and on the first call of each hook per backend.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

TRACE_ENV = "VLLM_HYBRID_TRACE_FILE"


def trace_path() -> str | None:
    return os.environ.get(TRACE_ENV) or None


def trace_event(event: str, **fields: Any) -> None:
    path = trace_path()
    if path is None:
        return
    record = {
        "event": event,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "process": multiprocessing.current_process().name,
        **fields,
    }
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, default=str) + "\n")


def traced_first_call(hook: str, backend: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``fn`` so its first call in this process is traced (nothing added afterwards)."""
    if trace_path() is None:
        return fn
    state = {"calls": 0}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state["calls"] += 1
        if state["calls"] == 1:
            trace_event("hook_called", hook=hook, backend=backend)
        return fn(*args, **kwargs)

    return wrapper
