"""Ask every worker which worker-side patches applied before the scheduler is built.

- Target: ``vllm.v1.engine.core.EngineCore._initialize_kv_caches``.
- Why: the engine-side patches plan work only a patched worker does (interior GDN states, see
  ``patch_vllm_v1_core_kv_cache_coordinator``). Engine and workers apply their patches each in
  their own process, so they can disagree; in one probe the engine planned interior blocks no
  worker wrote, and a later request was served 896 tokens from one (issue 12).
- How: ``EngineCore.__init__`` starts the executor (workers initialised, model loaded, worker
  patches applied or refused), then calls ``_initialize_kv_caches``, then builds the scheduler.
  The wrapper first runs :func:`vllm_hybrid_backends.handshake.establish` with the engine
  core's ``collective_rpc`` (every worker runs :func:`~vllm_hybrid_backends.handshake.worker_report`),
  then delegates to the original. The coordinator and the scheduler read the result once per
  instance; a feature some worker lacks stays off. Once per engine start, never per step.
  The same moment, with every plugin loaded, wraps the hit search of coordinator subclasses
  defined after the patches applied (vllm-ascend's ``AscendHybridKVCacheCoordinator``).
- Upstream: none (vLLM's own worker/engine handshake is for KV connectors only).
- vLLM versions: 0.30.x-0.33.x (same ``_initialize_kv_caches(self, vllm_config)`` between
  executor start and scheduler construction; ``collective_rpc`` accepts a callable).
- Removal: when vLLM lets plugins report worker capabilities to the scheduler.
"""

from __future__ import annotations

import importlib
from typing import Any

from .. import handshake
from ..compat import signature_problem
from . import patch_vllm_v1_core_kv_cache_coordinator as coordinator_patch

TARGET_MODULE = "vllm.v1.engine.core"
TARGET_SYMBOLS = ("EngineCore._initialize_kv_caches",)
PROCESS = "engine"
VLLM_VERSIONS = ">=0.23.0,<0.34.0"

_ORIGINALS: dict[str, Any] = {}


def _engine_core() -> Any:
    return importlib.import_module(TARGET_MODULE).EngineCore


def missing() -> list[str]:
    try:
        core = _engine_core()
    except Exception as exc:
        return [f"import {TARGET_MODULE}.EngineCore: {exc}"]
    problems = [f"EngineCore.{name}" for name in ("_initialize_kv_caches", "collective_rpc")
                if not callable(getattr(core, name, None))]
    if problems:
        return problems
    function = _ORIGINALS.get("EngineCore._initialize_kv_caches", core._initialize_kv_caches)
    problem = signature_problem(function, "EngineCore._initialize_kv_caches",
                                ("self", "vllm_config"))
    return [problem] if problem else []


def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
    handshake.establish(self.collective_rpc)
    # every plugin has loaded by now: reach coordinator subclasses defined after apply()
    coordinator_patch.wrap_subclass_hit_searches()
    return _ORIGINALS["EngineCore._initialize_kv_caches"](self, vllm_config)


_initialize_kv_caches._hybrid_backends_wrapper = True  # type: ignore[attr-defined]


def apply() -> None:
    core = _engine_core()
    if core._initialize_kv_caches is not _initialize_kv_caches:
        _ORIGINALS["EngineCore._initialize_kv_caches"] = core._initialize_kv_caches
        core._initialize_kv_caches = _initialize_kv_caches


def revert() -> None:
    if "EngineCore._initialize_kv_caches" in _ORIGINALS:
        _engine_core()._initialize_kv_caches = _ORIGINALS.pop("EngineCore._initialize_kv_caches")
    handshake.reset()
