"""Hand the gated-delta-net chunk states FLA computes to the plugin's interior-state store.

- Target: ``vllm.third_party.flash_linear_attention.ops.chunk.chunk_gated_delta_rule_fwd_h``,
  the name ``chunk_gated_delta_rule_fwd`` (behind ``chunk_gated_delta_rule``, the Triton/FLA
  prefill kernel of every GDN layer on CUDA and ROCm) calls to run the recurrence chunk by chunk.
- Why: the plugin stores tail states at block boundaries inside a prefill chunk instead of
  splitting the chunk (``patch_vllm_v1_attention_backends_gdn_attn``). FLA already computes
  them: ``h[0, chunk_offsets[n] + i]`` is sequence ``n``'s state before its chunk ``i`` (64
  tokens each, counted from the sequence's first token in the batch), i.e. after ``64 * i``
  tokens, in the kernel's input dtype. ``chunk_gated_delta_rule`` returns only the final states.
- How: the wrapper calls vLLM's function with the same arguments and returns what it returns;
  inside :func:`capturing_chunk_states` (opened by the GDN layer patch,
  ``patch_vllm_model_executor_layers_mamba_gdn_qwen_gdn_linear_attn``, only in a step with
  interior states planned) it also keeps ``h``. Nothing of FLA is copied. The capability check
  refuses, naming the function and the vLLM version, when the signature or the call from
  ``chunk_gated_delta_rule_fwd`` changed, or the chunk size is not 64.
- Upstream: none; FLA's public entry returns ``h`` only for training
  (``GDN_RECOMPUTE_SUPPRESS_LEVEL >= 3``).
- vLLM versions: 0.32.x, 0.33.x (FLA vendored under ``vllm/third_party``); not needed before
  (0.23/0.26 keep FLA under ``model_executor/layers/fla``: there the scheduler splits chunks).
- Removal: when vLLM stores GDN states at several boundaries of a prefill chunk itself.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator
from typing import Any

from ..compat import installed_vllm_version, signature_problem

TARGET_MODULE = "vllm.third_party.flash_linear_attention.ops.chunk"
TARGET_SYMBOLS = ("chunk_gated_delta_rule_fwd_h",)
PROCESS = "worker"
VLLM_VERSIONS = ">=0.32.0,<0.34.0"
#: A failed check (FLA or the GDN layer changed) leaves this feature off, the rest of the
#: plugin on: the workers then report no GDN interior states and the engine splits chunks.
OPTIONAL = True

#: The parameters the wrapper relies on, in vLLM's order (it passes everything through).
FWD_H_PARAMETERS = ("k", "w", "u", "g", "gk", "initial_state", "output_final_state",
                    "chunk_size", "save_new_value", "cu_seqlens", "chunk_indices",
                    "chunk_offsets")
#: FLA's chunk: every stored boundary is a multiple of it from the sequence's first token.
CHUNK_SIZE = 64

_ORIGINALS: dict[str, Any] = {}
#: The ``h`` tensors captured since :func:`capturing_chunk_states` opened, or None (not capturing).
_captured: list[Any] | None = None


def _module() -> Any:
    return importlib.import_module(TARGET_MODULE)


def not_needed() -> str | None:
    from ..compat import version_allows

    if not version_allows(">=0.32"):
        return ("the device GDN interior states are written for vLLM 0.32+ (the engine plans "
                "none before): gated-delta-net tail states cost chunk splits on devices")
    if importlib.util.find_spec("vllm.third_party") is not None and \
            importlib.util.find_spec("vllm.third_party.flash_linear_attention") is not None:
        return None
    return ("this vLLM has no FLA under vllm/third_party (0.23/0.26 keep it in "
            "model_executor/layers/fla): gated-delta-net tail states cost chunk splits on devices")


def missing() -> list[str]:
    try:
        module = _module()
        utils = importlib.import_module("vllm.third_party.flash_linear_attention.ops.utils")
    except Exception as exc:
        return [f"import {TARGET_MODULE}: {exc}"]
    fwd_h = _ORIGINALS.get("chunk_gated_delta_rule_fwd_h",
                           getattr(module, "chunk_gated_delta_rule_fwd_h", None))
    if fwd_h is None:
        return [f"{TARGET_MODULE}.chunk_gated_delta_rule_fwd_h"]
    problems = []
    problem = signature_problem(fwd_h, f"{TARGET_MODULE}.chunk_gated_delta_rule_fwd_h",
                                FWD_H_PARAMETERS, closed=False)
    if problem:
        problems.append(problem)
    caller = getattr(module, "chunk_gated_delta_rule_fwd", None)
    if "chunk_gated_delta_rule_fwd_h" not in getattr(getattr(caller, "__code__", None),
                                                     "co_names", ()):
        problems.append(f"{TARGET_MODULE}.chunk_gated_delta_rule_fwd no longer calls "
                        f"chunk_gated_delta_rule_fwd_h by name (vLLM {installed_vllm_version()})")
    if getattr(utils, "FLA_CHUNK_SIZE", None) != CHUNK_SIZE:
        problems.append(f"FLA_CHUNK_SIZE is {getattr(utils, 'FLA_CHUNK_SIZE', None)}, not "
                        f"{CHUNK_SIZE} (vLLM {installed_vllm_version()})")
    return problems


@contextlib.contextmanager
def capturing_chunk_states() -> Iterator[list[Any]]:
    """Collect the ``h`` of every FLA chunk recurrence run inside the block (one per GDN
    prefill forward); the list is filled when the block ends."""
    global _captured
    if _captured is not None:
        raise RuntimeError("FLA chunk states are already being captured (nested GDN forward)")
    found: list[Any] = []
    _captured = found
    try:
        yield found
    finally:
        _captured = None


def is_applied() -> bool:
    try:
        return _module().chunk_gated_delta_rule_fwd_h is chunk_gated_delta_rule_fwd_h
    except Exception:
        return False


def chunk_gated_delta_rule_fwd_h(*args: Any, **kwargs: Any) -> Any:
    result = _ORIGINALS["chunk_gated_delta_rule_fwd_h"](*args, **kwargs)
    if _captured is not None:
        _captured.append(result[0])
    return result


def apply() -> None:
    module = _module()
    if module.chunk_gated_delta_rule_fwd_h is not chunk_gated_delta_rule_fwd_h:
        _ORIGINALS["chunk_gated_delta_rule_fwd_h"] = module.chunk_gated_delta_rule_fwd_h
        module.chunk_gated_delta_rule_fwd_h = chunk_gated_delta_rule_fwd_h


def revert() -> None:
    if "chunk_gated_delta_rule_fwd_h" in _ORIGINALS:
        _module().chunk_gated_delta_rule_fwd_h = _ORIGINALS.pop("chunk_gated_delta_rule_fwd_h")
