"""Show the plugin's counters in vLLM's periodic logging line and Prometheus endpoint.

- Targets: ``vllm.v1.metrics.loggers.PrometheusStatLogger.__init__``,
  ``PrometheusStatLogger.record``, ``LoggingStatLogger.record``, ``LoggingStatLogger.log``.
- Why: operators watch vLLM's stats line and ``/metrics``; the plugin's decisions (Mamba states
  kept by kind, reused, evicted; prompt tokens missed by reason) were visible nowhere.
- How: with ``VLLM_HYBRID_STATS=1`` only. The engine core's counters arrive as
  ``SchedulerStats.hybrid`` (changes since the previous stats, ``patch_vllm_v1_metrics_stats``).
  ``PrometheusStatLogger`` gets one counter per family of
  :data:`vllm_hybrid_backends.stats.FAMILIES`, ``vllm:hybrid_<family>`` with vLLM's labels
  (``model_name``, ``engine``) and the family's label (``kind`` or ``reason``), created after
  vLLM's own (which unregisters every ``vllm:`` collector first) and incremented in ``record``.
  ``LoggingStatLogger`` sums them per engine and, at each ``log`` where they changed, adds one
  line with the totals.
- Upstream: none.
- vLLM versions: 0.32.x, 0.33.x.
- Removal: when vLLM lets plugins add scheduler stats and metrics.
"""

from __future__ import annotations

import importlib
from typing import Any

from .. import stats
from ..logs import logger

TARGET_MODULE = "vllm.v1.metrics.loggers"
TARGET_SYMBOLS = ("PrometheusStatLogger.__init__", "PrometheusStatLogger.record",
                  "LoggingStatLogger.record", "LoggingStatLogger.log")
PROCESS = "engine"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"


def not_needed() -> str | None:
    """Off unless VLLM_HYBRID_STATS is set: then nothing is wrapped at all."""
    from .. import stats

    return None if stats._flag() else f"{stats.STATS_ENV} is off"

_ORIGINALS: dict[str, Any] = {}


def _module() -> Any:
    return importlib.import_module(TARGET_MODULE)


def missing() -> list[str]:
    try:
        module = _module()
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    return [symbol for symbol in TARGET_SYMBOLS
            if not callable(getattr(getattr(module, symbol.split(".")[0], None),
                                    symbol.split(".")[1], None))]


def prometheus_init(self: Any, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
    _ORIGINALS["PrometheusStatLogger.__init__"](self, vllm_config, engine_indexes)
    self.hybrid_counters = {}
    for family, (label, values, text) in stats.FAMILIES.items():
        counter = self._counter_cls(name=f"vllm:hybrid_{family}", documentation=text,
                                    labelnames=["model_name", "engine", label])
        for engine, labelvalues in self.per_engine_labelvalues.items():
            for value in values:
                self.hybrid_counters[(engine, stats.key(family, value))] = counter.labels(
                    *labelvalues, value)


def prometheus_record(self: Any, scheduler_stats: Any, iteration_stats: Any,
                      mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
    _ORIGINALS["PrometheusStatLogger.record"](self, scheduler_stats, iteration_stats,
                                              mm_cache_stats, engine_idx)
    delta = getattr(scheduler_stats, "hybrid", None)
    if delta:
        for name, value in delta.items():
            counter = self.hybrid_counters.get((engine_idx, name))
            if counter is not None:
                counter.inc(value)


def logging_record(self: Any, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
    _ORIGINALS["LoggingStatLogger.record"](self, scheduler_stats, iteration_stats,
                                           mm_cache_stats, engine_idx)
    delta = getattr(scheduler_stats, "hybrid", None)
    if delta:
        totals = self.__dict__.setdefault("hybrid_totals", {})
        for name, value in delta.items():
            totals[name] = totals.get(name, 0) + value
        self.hybrid_changed = True


def logging_log(self: Any) -> None:
    _ORIGINALS["LoggingStatLogger.log"](self)
    if self.__dict__.pop("hybrid_changed", False):
        logger.info("Engine %03d: %s", self.engine_index, stats.summary(self.hybrid_totals))


_WRAPPERS = {"PrometheusStatLogger.__init__": prometheus_init,
             "PrometheusStatLogger.record": prometheus_record,
             "LoggingStatLogger.record": logging_record, "LoggingStatLogger.log": logging_log}


def apply() -> None:
    if not stats.refresh():
        return
    module = _module()
    for symbol, wrapper in _WRAPPERS.items():
        cls_name, name = symbol.split(".")
        cls = getattr(module, cls_name)
        if cls.__dict__.get(name) is not wrapper:
            _ORIGINALS[symbol] = cls.__dict__[name]
            setattr(cls, name, wrapper)


def revert() -> None:
    module = _module()
    for symbol in list(_ORIGINALS):
        cls_name, name = symbol.split(".")
        setattr(getattr(module, cls_name), name, _ORIGINALS.pop(symbol))
