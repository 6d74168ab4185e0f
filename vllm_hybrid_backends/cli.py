"""``vllm-hybrid-backends``: the command line (``doctor``, ``replay``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
from typing import Any

from . import __version__

ENV_SHOWN = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "ASCEND_RT_VISIBLE_DEVICES",
    "VLLM_PLUGINS",
    "VLLM_TARGET_DEVICE",
)
PLUGIN_NAME = "hybrid_backends"
ASCEND_PLUGINS = "ascend,ascend_kv_connector,ascend_model_loader,ascend_service_profiling,ascend_model"


def _vllm_ascend_installed() -> bool:
    if importlib.util.find_spec("vllm_ascend") is not None:
        return True
    try:
        importlib.metadata.version("vllm-ascend")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def environment() -> dict[str, str]:
    shown = {name: os.environ[name] for name in ENV_SHOWN if name in os.environ}
    shown.update({k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_HYBRID_")})
    return shown


def environment_warnings(env: dict[str, str], vllm_ascend_installed: bool) -> list[str]:
    """Known traps in the device and plugin environment variables."""
    warnings = []
    plugins_var = env.get("VLLM_PLUGINS")
    if plugins_var is not None:
        names = [n.strip() for n in plugins_var.split(",")]
        if PLUGIN_NAME not in names:
            warnings.append(
                f"VLLM_PLUGINS={plugins_var!r} does not include {PLUGIN_NAME!r}: vLLM will not "
                "load this plugin"
            )
        if vllm_ascend_installed and "ascend" not in names:
            warnings.append(
                f"VLLM_PLUGINS={plugins_var!r} lacks 'ascend' while vllm-ascend is installed: "
                "vLLM then loses the NPU platform; leave VLLM_PLUGINS unset or use "
                f"VLLM_PLUGINS={ASCEND_PLUGINS},{PLUGIN_NAME}"
            )
    if "ROCR_VISIBLE_DEVICES" in env and "HIP_VISIBLE_DEVICES" in env:
        warnings.append(
            "ROCR_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES are both set: HIP remaps devices a "
            "second time on top of ROCR's selection; set only one"
        )
    hip, cuda = env.get("HIP_VISIBLE_DEVICES"), env.get("CUDA_VISIBLE_DEVICES")
    if hip is not None and cuda is not None and hip != cuda:
        warnings.append(
            f"HIP_VISIBLE_DEVICES={hip!r} and CUDA_VISIBLE_DEVICES={cuda!r} disagree: vLLM on "
            "ROCm refuses to start; make them equal or unset one"
        )
    return warnings


def _vllm_platform() -> str:
    try:
        from vllm.platforms import current_platform

        return str(getattr(current_platform, "device_name", None) or type(current_platform).__name__)
    except Exception as exc:
        return f"unavailable ({type(exc).__name__}: {exc})"


def _vllm_ascend_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm-ascend")
    except importlib.metadata.PackageNotFoundError:
        return None


def _patch_statuses(version: str | None) -> list[dict[str, str]]:
    """Each patch: ready (would apply) / applied / not needed / refused, with the reason."""
    if version is None:
        return []
    from . import patches

    statuses = []
    for module in patches.patch_modules():
        try:
            statuses.append(patches.check(module).to_json())
        except Exception as exc:  # a check that crashes is a refusal, reported, not a doctor crash
            statuses.append({"patch": module.__name__.rsplit(".", 1)[-1], "process": module.PROCESS,
                             "state": "refused", "reason": f"check failed: {exc!r}"})
    return statuses


def _worker_handshake() -> dict[str, Any]:
    """What the engine enables only after every worker reported the patches it needs, and the
    result where this process ran an engine core's handshake (doctor itself runs none)."""
    from . import handshake

    support = handshake.current()
    return {
        "when": "at each engine start, before the scheduler is built "
                "(EngineCore._initialize_kv_caches, patch_vllm_v1_engine_core)",
        "features": {feature: list(needed) for feature, needed in handshake.WORKER_FEATURES.items()},
        "result": support.to_json() if support.established else None,
    }


#: How the plugin composes with vllm-ascend's own patches (checked against the real sources of
#: vllm-ascend 0.23.0 / 0.26.0rc1 by ``make test-ascend-contract``; docs/ascend.md).
VLLM_ASCEND_COMPOSITION = (
    "NPUWorker.__init__ re-assigns mamba_utils copy functions: the plugin re-applies its worker "
    "patches after it (patch_vllm_ascend_worker_worker), so the selected backend stays the one "
    "called",
    "preprocess_mamba: vllm-ascend's is kept (it defers the copy until the KV-transfer load "
    "ran); it calls mamba_utils.collect_mamba_copy_meta, the plugin's, so its moves reach the "
    "selected backend when the runner calls do_mamba_copy_block",
    "310P builds replace collect_mamba_copy_meta / do_mamba_copy_block with tensor-view copies "
    "(_collect_mamba_copy_meta_torch, _do_mamba_copy_block_torch): the plugin's re-apply wraps "
    "them and keeps them for layers whose copy functions it does not know",
    "BalanceScheduler replaces the module's Scheduler but inherits vLLM's "
    "_mamba_block_aligned_split, which the plugin patches: it gets the plugin's chunk split",
    "AscendHybridKVCacheCoordinator.find_longest_cache_hit: the plugin defers the hit search to "
    "it (it carries vllm-ascend's PD / full-attention-only hit logic) and only records the hits "
    "it returns (wrapped at engine start)",
)
#: What the plugin leaves to vllm-ascend, and why (same checks; docs/ascend.md).
VLLM_ASCEND_DEFERRED = (
    "MambaCopyBuffers.create (int64 pointer buffers: the NPU has no uint64 zero): vllm-ascend's, "
    "untouched",
    "batch_memcpy / batch_memcpy_kernel: vllm-ascend's Triton-Ascend copy, reached only by "
    "copies of layers the plugin does not know; on vLLM < 0.31 (no vllm.triton_utils.dispatcher) "
    "the backend registers no kernel override",
    "speculative-decoding align postprocess on vLLM 0.23 / 0.26 (postprocess_mamba_align_gpu with "
    "vllm-ascend's postprocess_mamba_fused_kernel; on 310P _postprocess_mamba_align_gpu_cpu_fallback)"
    ": vllm-ascend's; the plugin routes only the scalar copy path on these versions",
    "AscendGDNAttentionMetadataBuilder.build never runs vLLM's build, so the plugin's gdn_attn "
    "patch does not run under vllm-ascend: the worker reports gdn_interior_states off on npu and "
    "the engine plans no GDN states inside a prefill chunk there",
    "AscendMambaManager.find_longest_cache_hit / get_num_blocks_to_allocate: vllm-ascend's, not "
    "wrapped (the plugin's coordinator-level wrappers call them; on vLLM 0.26 the plugin wraps "
    "MambaManager.reachable_block_mask, which AscendMambaManager inherits)",
    "HybridAttentionMambaModelConfig.verify_and_update_config (page sizes, block alignment): "
    "vllm-ascend's, untouched",
)
#: Mamba layer kinds (vLLM's ``MambaAttentionBackendEnum`` names) and whether vLLM's own
#: layer exports a prefill checkpoint from inside the forward (Mamba2 does, from vLLM 0.32).
MAMBA_KINDS = (("GDN_ATTN", False), ("MAMBA2", True), ("MAMBA1", False), ("SHORT_CONV", False))


def tail_state_paths(version: str | None) -> list[dict[str, Any]]:
    """Per Mamba kind: whether the plugin's tail states are stored inside the prefill chunk in
    this process's setting, or what it does instead, and why (the engine's own decision,
    ``stores_interior``, asked for an align-mode group of that kind without spec decoding)."""
    if version is None:
        return []
    import types

    from . import align
    from .patches import patch_vllm_v1_core_kv_cache_coordinator as coordinator

    try:
        policy = align.current_policy()
    except ValueError as exc:
        return [{"kind": kind, "inside_chunk": False, "how": str(exc)} for kind, _ in MAMBA_KINDS]
    platform = _vllm_platform()
    from .compat import has_mamba2_prefill_checkpoint

    has_checkpoint = has_mamba2_prefill_checkpoint()
    from . import handshake

    expected = handshake.expected_here()  # established per engine at its start; see doctor
    rows = []
    for kind, vllm_checkpoint in MAMBA_KINDS:
        vllm_checkpoint = vllm_checkpoint and has_checkpoint  # Mamba2 from 0.32
        spec = types.SimpleNamespace(mamba_cache_mode="align", num_speculative_blocks=0,
                                     num_prefill_checkpoint_blocks=int(vllm_checkpoint),
                                     mamba_type=types.SimpleNamespace(name=kind))
        inside = policy.interior_states and policy.tail_checkpoints > 0 and \
            coordinator.stores_interior(spec, expected)
        fallback = ("no tail states, vLLM's one prefill checkpoint" if vllm_checkpoint
                    else "chunk splits")
        if not policy.tail_checkpoints:
            how = f"no tail states ({align.TAIL_CHECKPOINTS_ENV}=0)"
        elif inside:
            how = "inside the chunk (the forward stores them through hb_store_checkpoints)"
            if kind == "GDN_ATTN" and handshake._platform_name() in handshake.FLA_PLATFORMS:
                how += (f"; on {platform} only where every GDN layer prefills with Triton/FLA "
                        "(--gdn-prefill-backend triton) and the block size is a multiple of "
                        f"{handshake.FLA_CHUNK} (--block-size {handshake.FLA_CHUNK}): the "
                        "workers check at engine start, else chunk splits")
        elif not policy.interior_states:
            how = f"{fallback} ({align.INTERIOR_STATES_ENV}=0)"
        elif kind not in coordinator.INTERIOR_KINDS:
            how = f"{fallback}: no forward of this kind stores states inside the chunk yet"
        elif expected.reasons.get(handshake.INTERIOR_FEATURE_OF_KIND[kind]):
            how = (f"{fallback} on {platform}: "
                   f"{expected.reasons[handshake.INTERIOR_FEATURE_OF_KIND[kind]]}")
        else:
            how = (f"{fallback}: not stored inside the chunk on vLLM {version} (verified on "
                   "0.32+, with every worker patch applying)")
        rows.append({"kind": kind, "inside_chunk": bool(inside), "how": how})
    return rows


def mamba_cache_mode_default() -> str | None:
    """The ``mamba_cache_mode`` vLLM picks with prefix caching on when the user sets none, and
    what the plugin does about it (None without vLLM)."""
    try:
        from typing import get_args

        from vllm.config.cache import MambaCacheMode
    except ImportError:
        return None
    if "all" not in get_args(MambaCacheMode):
        return "align for every hybrid model (vLLM's only caching mode): the plugin's policy applies"
    # vLLM 0.23-0.29 (MambaModelConfig.verify_and_update_config): "all" where the model class
    # supports_mamba_prefix_caching (the Mamba2 family), else "align". "all" caches the state at
    # every block (a Mamba page per block of every running request, and per request
    # cdiv(max_model_len, block_size) pages in vLLM's memory check, against 2 for align); align
    # on these versions caches it only at chunk ends and the plugin's split points (no prefill
    # checkpoint), fewer reusable states: the plugin keeps vLLM's choice, never the user's.
    return ("'all' for models that support Mamba prefix caching (the Mamba2 family: a state "
            "cached at every block, one Mamba page per block), 'align' for the others (GDN); "
            "the plugin keeps vLLM's choice (align caches fewer states here: chunk ends and "
            "the plugin's split points, no prefill checkpoint) and its align policy applies "
            "only to align-mode groups; "
            "--mamba-cache-mode align trades hits for memory")


def doctor_report() -> tuple[dict[str, Any], int]:
    """Everything ``doctor`` prints, and its exit status (0 when a backend is selected)."""
    from . import plugins
    from .compat import (
        SUPPORTED_VLLM_TEXT,
        installed_vllm_version,
        is_supported,
        unsupported_reason,
    )
    from .device import detect_device_kind

    version = installed_vllm_version()
    env = environment()
    patch_statuses = _patch_statuses(version)
    refused = [p for p in patch_statuses if p["state"] == "refused"]
    in_range = is_supported(version)
    report: dict[str, Any] = {
        "plugin_version": __version__,
        "vllm_version": version,
        "vllm_ascend_version": _vllm_ascend_version(),
        # supported = in the declared range and every required patch can apply (the same checks
        # the patches run when vLLM loads the plugin)
        "vllm_supported": in_range and not refused,
        "vllm_supported_range": SUPPORTED_VLLM_TEXT,
        "vllm_supported_reason": (
            unsupported_reason(version) if not in_range else
            "; ".join(f"{p['patch']} refused: {p['reason']}" for p in refused) or
            "every required patch can apply"),
        "patches": patch_statuses,
        "worker_handshake": _worker_handshake(),
        "vllm_ascend_composition": list(VLLM_ASCEND_COMPOSITION) if _vllm_ascend_version() else [],
        "vllm_ascend_deferred": list(VLLM_ASCEND_DEFERRED) if _vllm_ascend_version() else [],
        "tail_states": tail_state_paths(version),
        "mamba_cache_mode_default": mamba_cache_mode_default(),
        "platform": _vllm_platform(),
        "device_kind": detect_device_kind().value,
        "selected_backend": None,
        "selection_reason": None,
        "backends": [
            {
                "name": status.name,
                "device_kind": status.identity.device_kind.value,
                "priority": status.identity.priority,
                "available": status.availability.available,
                "reason": status.availability.reason,
                "hooks": status.hooks,
            }
            for status in plugins.backend_statuses()
        ],
        "env": env,
        "warnings": environment_warnings(env, _vllm_ascend_installed()),
    }
    try:
        report["selected_backend"] = plugins.selected_backend()
        report["selection_reason"] = plugins.selection_explanation()
    except plugins.BackendSelectionError as exc:
        report["error"] = str(exc)
        return report, 2
    return report, 0


def _print_human(report: dict[str, Any]) -> None:
    supported = "supported" if report["vllm_supported"] else "NOT supported"
    print(f"vllm-hybrid-backends {report['plugin_version']}")
    print(f"vLLM:      {report['vllm_version']} ({supported}; range {report['vllm_supported_range']})")
    if not report["vllm_supported"]:
        print(f"           {report['vllm_supported_reason']}")
    if report["vllm_ascend_version"]:
        print(f"vllm-ascend: {report['vllm_ascend_version']}")
        for line in report["vllm_ascend_composition"]:
            print(f"  - {line}")
        print("  left to vllm-ascend:")
        for line in report["vllm_ascend_deferred"]:
            print(f"  - {line}")
    if report["patches"]:
        print("patches:")
        for patch in report["patches"]:
            reason = f": {patch['reason']}" if patch["reason"] else ""
            print(f"  {patch['patch']:<58} {patch['process']:<6} {patch['state']}{reason}")
    shake = report["worker_handshake"]
    print(f"handshake: {shake['when']}; the engine enables")
    for feature, needed in shake["features"].items():
        print(f"  {feature:<22} only if every worker applied {', '.join(needed)}")
    if shake["result"] is not None:
        on = ", ".join(shake["result"]["features"]) or "none"
        print(f"  this engine: {len(shake['result']['workers'])} worker(s); on: {on}")
    if report["tail_states"]:
        print("tail states (align mode, no speculative decoding):")
        for row in report["tail_states"]:
            print(f"  {row['kind']:<10} {row['how']}")
    if report["mamba_cache_mode_default"]:
        print(f"mamba_cache_mode with prefix caching, unset: {report['mamba_cache_mode_default']}")
    print(f"platform:  {report['platform']}   device kind: {report['device_kind']}")
    if report["selected_backend"]:
        print(f"backend:   {report['selected_backend']}  ({report['selection_reason']})")
    else:
        print(f"backend:   none: {report['error']}")
    print("backends:")
    for backend in report["backends"]:
        mark = "yes" if backend["available"] else "no "
        own = [h for h, who in backend["hooks"].items() if who == backend["name"]]
        delegated = [h for h, who in backend["hooks"].items() if who not in (backend["name"], "none")]
        print(f"  {backend['name']:<8} available={mark} priority={backend['priority']:<4} {backend['reason']}")
        print(f"           own hooks: {', '.join(own) or '-'}")
        if delegated:
            print(f"           delegated to cpu: {', '.join(delegated)}")
    print("env:       " + (", ".join(f"{k}={v}" for k, v in report["env"].items()) or "(none set)"))
    for warning in report["warnings"]:
        print(f"WARNING:   {warning}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-hybrid-backends", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="show vLLM, the platform and the backends")
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    argv = sys.argv[1:] if argv is None else argv
    if "replay" in argv or "--json" in argv:
        # vLLM logs to stdout by default and configures its logger when first imported (which
        # the replay parser's imports may do): keep stdout for the report.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from .replay import cli as replay_cli

    replay_cli.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "replay":
        return replay_cli.run(args, argv[argv.index("replay") + 1:])

    if args.command == "doctor":
        report, status = doctor_report()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_human(report)
        if status:
            print(f"error: {report['error']}", file=sys.stderr)
        return status
    return 2


if __name__ == "__main__":
    sys.exit(main())
