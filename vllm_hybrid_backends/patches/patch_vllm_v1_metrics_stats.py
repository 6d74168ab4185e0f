"""Give ``SchedulerStats`` a ``hybrid`` field that carries the plugin's counters.

- Targets: ``vllm.v1.metrics.stats.SchedulerStats``.
- Why: the engine core sends its ``SchedulerStats`` to the front-end's stat loggers (logging
  line, Prometheus) as msgpack; an attribute that is not a dataclass field is dropped on the way.
- How: with ``VLLM_HYBRID_STATS=1`` only, adds the field ``hybrid: dict[str, int] | None``
  (default None) to the dataclass's fields and annotations, in every process, so vLLM's msgpack
  encoder sends it and its decoder (built after plugins load) restores it. A decoder on the
  other side without the field ignores it. The values are the change of
  :data:`vllm_hybrid_backends.stats.COUNTERS` since the previous stats (scheduler patch).
- Upstream: none (a stats extension point for plugins would replace it).
- vLLM versions: 0.32.x, 0.33.x.
- Removal: when vLLM lets plugins add scheduler stats.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from .. import stats

TARGET_MODULE = "vllm.v1.metrics.stats"
TARGET_SYMBOLS = ("SchedulerStats",)
PROCESS = "engine"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"


def not_needed() -> str | None:
    """Off unless VLLM_HYBRID_STATS is set: then nothing is wrapped at all."""
    from .. import stats

    return None if stats._flag() else f"{stats.STATS_ENV} is off"
FIELD = "hybrid"


def _cls() -> Any:
    return importlib.import_module(TARGET_MODULE).SchedulerStats


def missing() -> list[str]:
    try:
        cls = _cls()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    if not dataclasses.is_dataclass(cls):
        return ["SchedulerStats (not a dataclass)"]
    return []


def apply() -> None:
    cls = _cls()
    if not stats.refresh() or FIELD in cls.__dataclass_fields__:
        return
    field: Any = dataclasses.field(default=None)
    field.name, field.type = FIELD, "dict[str, int] | None"
    field._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
    setattr(cls, FIELD, None)
    cls.__annotations__[FIELD] = field.type
    cls.__dataclass_fields__[FIELD] = field


def revert() -> None:
    cls = _cls()
    if FIELD in cls.__dataclass_fields__:
        del cls.__dataclass_fields__[FIELD]
        del cls.__annotations__[FIELD]
        delattr(cls, FIELD)
