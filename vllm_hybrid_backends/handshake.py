"""Engine/worker handshake: the engine enables a policy that needs worker-side support only
after every worker reported that support applied.

The engine-side patches plan work that only a patched worker does (today: interior GDN and
Mamba2 states, blocks inside a prefill chunk that the worker's forward fills through
``hb_store_checkpoints``). Whether a feature works depends on the worker's patches and on its
platform's forward (:func:`forward_limits`), so the worker reports both.
Engine and workers are separate processes and each applies its own patches, so one side can be
patched while the other is not (issue 12: the engine planned interior blocks, no worker wrote
them, and a later request "hit" 896 tokens of garbage state).

- :func:`worker_report` runs in every worker (``collective_rpc`` from the engine core, see
  ``patches/patch_vllm_v1_engine_core.py``) and says which worker patches applied there, and
  what its forward cannot do.
- :func:`establish` combines the reports into one :class:`WorkerSupport`: a feature is
  supported only when every worker has all the patches it needs applied. It is set once, at
  engine-core start, before the scheduler is built; the coordinator and scheduler read
  :func:`current` once per instance (cached), so the per-step path does no extra work.
- Until a handshake ran (no engine core in this process, or an engine whose patches did not
  apply) :func:`current` supports nothing: the engine then plans only what vLLM's own worker
  writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .logs import logger
from .trace import trace_event

#: Feature -> the worker patch modules that must all be applied in every worker for it (the
#: forward that stores the states differs by platform: :func:`forward_limits`).
WORKER_FEATURES: Mapping[str, tuple[str, ...]] = {
    # the GDN metadata builder finds the interior blocks (host dict on CPU, device plan elsewhere)
    "gdn_interior_states": ("patch_vllm_v1_attention_backends_gdn_attn",),
    # the Mamba2 metadata builder plans them, the SSD scan returns chunk states, the
    # checkpoint store writes them
    "mamba2_interior_states": ("patch_vllm_v1_attention_backends_mamba2_attn",
                               "patch_vllm_model_executor_layers_mamba_ops_ssd_combined",
                               "patch_vllm_model_executor_layers_mamba_mamba_mixer2"),
}
#: Mamba kind (vLLM's ``MambaAttentionBackendEnum`` name) -> the feature storing its interior states
INTERIOR_FEATURE_OF_KIND = {"GDN_ATTN": "gdn_interior_states", "MAMBA2": "mamba2_interior_states"}
#: The patches whose forward stores GDN interior states: vLLM-CPU's forward, or (CUDA, ROCm)
#: vLLM's Triton/FLA chunk kernel wrapped with the Qwen GDN layer's core.
GDN_FORWARD_PATCHES = {
    "cpu": ("patch_vllm_model_executor_layers_mamba_ops_cpu_gdn_attention",),
    "device": ("patch_vllm_third_party_flash_linear_attention_ops_chunk",
               "patch_vllm_model_executor_layers_mamba_gdn_qwen_gdn_linear_attn"),
}

#: Platforms (``current_platform.device_name``) whose GDN prefill is vLLM's Triton/FLA kernel.
FLA_PLATFORMS = ("cuda", "rocm")
#: FLA's chunk (tokens): its per-chunk states fall on block boundaries only for block sizes
#: that are multiples of it.
FLA_CHUNK = 64

SSD_MODULE = "vllm.model_executor.layers.mamba.ops.ssd_combined"


def forward_limits(scan_patched: bool | None = None,
                   patch_states: Mapping[str, str] | None = None,
                   worker: object = None) -> dict[str, str]:
    """Feature -> why this process's Mamba forward cannot give the states it stores ("" where
    it can): the per-platform part of a feature, beside its patches. Run in a worker, after
    its patches applied.

    - gated delta net: on vLLM-CPU its forward is wrapped to store inside the chunk; elsewhere
      FLA's chunked Triton kernel gives the per-chunk states (its wrap and the Qwen GDN layer's
      must be applied) and, given the ``worker``, every GDN layer of its model must be a Qwen
      GDN layer whose prefill kernel is Triton/FLA (not FlashInfer, CuteDSL or AITER FlyDSL)
      with a recurrent-state cache no wider than the model dtype (FLA keeps the chunk states in
      the model dtype), and the block size a multiple of FLA's 64-token chunk (vLLM's default
      for Qwen3.5 / Qwen3-Next on CUDA, 544, is not; ``--block-size 64`` gives 576). Without a
      worker (doctor) the layers are not checked.
    - Mamba2: the SSD scan must return its chunk states: vLLM's Triton scan (CUDA, ROCm) does,
      vLLM-CPU's does through ``patch_vllm_model_executor_layers_mamba_ops_ssd_combined``;
      any other scan (e.g. one a platform plugin put in its place) is not trusted.

    ``scan_patched``: count vLLM-CPU's scan as patched (doctor, whose process applies no
    patch); default: whether it is. ``patch_states``: this process's worker patch states
    (default: asked now).
    """
    if patch_states is None:
        from . import patches

        patch_states = {status.name: status.state for status in patches.statuses("worker")}
    limits = {feature: "" for feature in WORKER_FEATURES}
    limits["gdn_interior_states"] = _gdn_forward_limit(patch_states, worker)
    limits["mamba2_interior_states"] = _ssd_scan_limit(scan_patched)
    return limits


def _gdn_forward_limit(patch_states: Mapping[str, str], worker: object) -> str:
    from .patches import APPLIED

    platform = _platform_name()
    if platform != "cpu" and platform not in FLA_PLATFORMS:
        return (f"the gated-delta-net prefill on {platform} is not vLLM's Triton/FLA kernel the "
                f"plugin wraps (on {' and '.join(FLA_PLATFORMS)})")
    needed = GDN_FORWARD_PATCHES["cpu" if platform == "cpu" else "device"]
    lacking = [f"{name} {patch_states.get(name, 'unknown')}" for name in needed
               if patch_states.get(name) != APPLIED]
    if lacking:
        return (f"the gated-delta-net forward on {platform} is not wrapped to store states "
                f"inside the chunk ({'; '.join(lacking)})")
    if platform == "cpu" or worker is None:
        return ""
    from .patches import patch_vllm_model_executor_layers_mamba_gdn_qwen_gdn_linear_attn as layer
    from .patches import patch_vllm_third_party_flash_linear_attention_ops_chunk as fla

    if not (fla.is_applied() and layer.is_applied()):  # e.g. a platform plugin replaced them since
        return ("the gated-delta-net forward was replaced after the plugin wrapped it "
                f"(FLA wrap in place: {fla.is_applied()}, GDN layer wrap: {layer.is_applied()})")
    return _gdn_layers_limit(worker)


def _gdn_layers_limit(worker: object) -> str:
    """Why some GDN layer of the worker's model cannot give its chunk states ("" if none)."""
    try:
        from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
            QwenGatedDeltaNetAttention,
        )

        model: Any = worker.model_runner.get_model()  # type: ignore[attr-defined]
        model = model.unwrap() if hasattr(model, "unwrap") else model
        layers = [m for m in model.modules() if isinstance(m, GatedDeltaNetAttention)]
        model_dtype = worker.vllm_config.model_config.dtype  # type: ignore[attr-defined]
        block_size = worker.vllm_config.cache_config.block_size  # type: ignore[attr-defined]
    except Exception as exc:
        return f"the worker's GDN layers could not be inspected ({type(exc).__name__}: {exc})"
    if layers and block_size % FLA_CHUNK:
        return (f"the block size {block_size} is not a multiple of FLA's chunk ({FLA_CHUNK} "
                f"tokens), so block boundaries fall inside FLA's chunks (--block-size {FLA_CHUNK} "
                f"makes vLLM round the hybrid block size up to a multiple of {FLA_CHUNK})")
    for layer in layers:
        name = getattr(layer, "prefix", type(layer).__name__)
        if not isinstance(layer, QwenGatedDeltaNetAttention):
            return f"GDN layer {name} is a {type(layer).__name__}, whose forward is not wrapped"
        backend = getattr(layer, "gdn_prefill_backend", None)
        if backend != "triton":
            return (f"GDN layer {name} prefills with the {backend} kernel, not Triton/FLA "
                    "(--gdn-prefill-backend triton gives the chunk states)")
        state_dtype = layer.get_state_dtype()[-1]
        if state_dtype.itemsize > model_dtype.itemsize:
            return (f"GDN layer {name} caches its recurrent state in {state_dtype}, wider than "
                    f"FLA's chunk states ({model_dtype}): an interior state would be rounded")
    return ""


def _platform_name() -> str:
    try:
        from vllm.platforms import current_platform

        return "cpu" if current_platform.is_cpu() else str(
            getattr(current_platform, "device_name", None) or type(current_platform).__name__)
    except Exception as exc:
        return f"an unknown platform ({type(exc).__name__}: {exc})"


def _ssd_scan_limit(scan_patched: bool | None) -> str:
    import importlib

    from .patches import patch_vllm_model_executor_layers_mamba_ops_ssd_combined as scan_patch

    try:
        scan = importlib.import_module(SSD_MODULE)._mamba_chunk_scan_combined_fwd
    except Exception as exc:
        return f"no Mamba2 SSD scan to read chunk states from ({type(exc).__name__}: {exc})"
    if scan is scan_patch._mamba_chunk_scan_combined_fwd:
        return ""  # vLLM-CPU's scan, patched to return chunk states
    if scan_patch.is_cpu_scan(scan):
        if scan_patched:
            return ""
        return "vLLM-CPU's SSD scan returns no chunk states (its patch is not applied)"
    if getattr(scan, "__module__", None) == SSD_MODULE:
        return ""  # vLLM's Triton scan: return_intermediate_states gives the chunk states
    return (f"the Mamba2 SSD scan is {getattr(scan, '__module__', '?')}."
            f"{getattr(scan, '__name__', '?')}, not vLLM's, so its chunk states are not trusted")


@dataclass(frozen=True)
class WorkerSupport:
    """What every worker of this engine can do, as they reported it at engine start."""

    #: whether a handshake ran (False: no worker answered, so nothing is supported)
    established: bool
    features: frozenset[str] = frozenset()
    #: one report per worker (:func:`worker_report`)
    reports: tuple[Mapping[str, Any], ...] = ()
    #: feature -> why it is off (which worker lacks which patch), for features that are off
    reasons: Mapping[str, str] = field(default_factory=dict)

    def supports(self, feature: str) -> bool:
        if feature not in WORKER_FEATURES:
            raise ValueError(f"unknown worker feature {feature!r}; known: "
                             f"{', '.join(sorted(WORKER_FEATURES))}")
        return feature in self.features

    def to_json(self) -> dict[str, Any]:
        return {"established": self.established, "features": sorted(self.features),
                "reasons": dict(self.reasons), "workers": [dict(r) for r in self.reports]}


NOT_ESTABLISHED = WorkerSupport(
    established=False,
    reasons={feature: "no handshake with the workers ran in this process"
             for feature in WORKER_FEATURES})
_current = NOT_ESTABLISHED


def current() -> WorkerSupport:
    """The support established at this engine's start (:data:`NOT_ESTABLISHED` before)."""
    return _current


def reset() -> None:
    """Forget the handshake (tests, and the replay harness between engines)."""
    global _current
    _current = NOT_ESTABLISHED


def expected_here() -> WorkerSupport:
    """What a handshake would find if every worker were this process (doctor runs no engine):
    a patch that is ready or applied here counts as applied."""
    from .patches import APPLIED, READY

    report = worker_report()
    report["patches"] = {name: APPLIED if state in (READY, APPLIED) else state
                         for name, state in report["patches"].items()}
    scan_patch = "patch_vllm_model_executor_layers_mamba_ops_ssd_combined"
    report["forward_limits"] = forward_limits(report["patches"].get(scan_patch) == APPLIED,
                                              patch_states=report["patches"])
    return combine([report])


def worker_report(worker: object = None) -> dict[str, Any]:
    """Run in a worker: the state of each worker patch there (applied / refused / ...) and
    what its forward cannot do (:func:`forward_limits`).

    ``worker`` is the vLLM worker ``collective_rpc`` passes to a callable (its model's GDN
    layers are checked)."""
    from . import patches

    states = {status.name: status.state for status in patches.statuses("worker")}
    return {"pid": os.getpid(), "patches": states,
            "forward_limits": forward_limits(patch_states=states, worker=worker)}


def combine(reports: Sequence[Mapping[str, Any]]) -> WorkerSupport:
    """One :class:`WorkerSupport` from the workers' reports: a feature is on only when every
    worker has every patch it needs applied and its forward can give the states
    (:func:`forward_limits`; a report without them counts as unable)."""
    from .patches import APPLIED

    if not reports:
        return WorkerSupport(established=False, reasons={
            f: "no worker answered the handshake" for f in WORKER_FEATURES})
    features, reasons = set(), {}
    for feature, needed in WORKER_FEATURES.items():
        lacking = [f"worker pid {report.get('pid', '?')}: {name} "
                   f"{report.get('patches', {}).get(name, 'unknown')}"
                   for report in reports for name in needed
                   if report.get("patches", {}).get(name) != APPLIED]
        lacking += [f"worker pid {report.get('pid', '?')}: "
                    f"{report.get('forward_limits', {}).get(feature, 'no forward report')}"
                    for report in reports
                    if report.get("forward_limits", {}).get(feature, "no forward report")]
        if lacking:
            reasons[feature] = "; ".join(lacking)
        else:
            features.add(feature)
    return WorkerSupport(established=True, features=frozenset(features), reports=tuple(reports),
                         reasons=reasons)


def establish(collective_rpc: Callable[..., list[Any]]) -> WorkerSupport:
    """Ask every worker (``collective_rpc(worker_report)``) and set :func:`current`; logs one
    line. A failing call leaves nothing supported (and is logged), it does not stop vLLM."""
    global _current
    try:
        reports = [dict(r) for r in collective_rpc(worker_report) if r is not None]
    except Exception as exc:
        logger.warning("hybrid_backends: the workers did not answer the handshake (%s: %s); "
                       "features that need worker support stay off", type(exc).__name__, exc)
        reports = []
    _current = combine(reports)
    logger.info("hybrid_backends: handshake with %d worker(s): %s", len(reports),
                ", ".join(f"{f} {'on' if f in _current.features else 'off (' + _current.reasons[f] + ')'}"
                          for f in WORKER_FEATURES))
    trace_event("handshake", **_current.to_json())
    return _current
