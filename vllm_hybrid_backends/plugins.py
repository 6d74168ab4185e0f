"""The one owner of the pluggy ``PluginManager``, backend selection, and the typed facades
every call site uses (never ``pm.hook.*`` directly).

Backends come from :data:`BUILTIN_BACKENDS` and from the entry-point group
:data:`ENTRY_POINT_GROUP` (third-party backends). Each is registered under the name its
``hb_backend_identity`` returns.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import pluggy

from . import hookspecs
from .device import detect_device_kind
from .hookspecs import STATE_OPERATION_HOOKS
from .logs import logger
from .trace import traced_first_call
from .types import Availability, BackendStatus, CheckpointBatch, MambaStateTensor

ENTRY_POINT_GROUP = "vllm_hybrid_backends.backends"
BACKEND_ENV = "VLLM_HYBRID_BACKEND"
AUTO = "auto"
REFERENCE = "cpu"

#: ``module`` (the module is the plugin) or ``module:attribute`` (an object in it is).
BUILTIN_BACKENDS = (
    "vllm_hybrid_backends.reference",
    "vllm_hybrid_backends.backends.triton.backend:CUDA",
    "vllm_hybrid_backends.backends.triton.backend:ROCM",
    "vllm_hybrid_backends.backends.ascend.backend",
)


def _builtin(spec: str) -> object:
    module_name, _, attribute = spec.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


class BackendSelectionError(RuntimeError):
    """``VLLM_HYBRID_BACKEND`` names no backend, or one that cannot run here."""


_pm: pluggy.PluginManager | None = None


def get_plugin_manager() -> pluggy.PluginManager:
    """Build the manager on first use: specs, built-ins, entry points, ``check_pending``."""
    global _pm
    if _pm is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        for spec in BUILTIN_BACKENDS:
            register_backend(_builtin(spec), pm)
        _load_entry_point_backends(pm)
        pm.check_pending()
        _pm = pm
    return _pm


def _load_entry_point_backends(pm: pluggy.PluginManager) -> None:
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            register_backend(entry_point.load(), pm)
        except Exception as exc:
            logger.warning("backend entry point %r failed to load: %s", entry_point.name, exc)


def register_backend(plugin: object, pm: pluggy.PluginManager | None = None) -> str:
    """Register a backend plugin under its identity name; return that name."""
    pm = pm or get_plugin_manager()
    identity_impl = getattr(plugin, "hb_backend_identity", None)
    if identity_impl is None:
        raise TypeError(f"backend plugin {plugin!r} does not implement hb_backend_identity")
    name = identity_impl().name
    if pm.get_plugin(name) is not None:
        raise ValueError(f"a backend named {name!r} is already registered")
    pm.register(plugin, name=name)
    forget_selection()
    return name


def unregister_backend(name: str) -> None:
    pm = get_plugin_manager()
    if pm.get_plugin(name) is not None:
        pm.unregister(name=name)
    forget_selection()


def forget_selection() -> None:
    """Drop cached statuses and the selection (after registering or unregistering plugins)."""
    backend_statuses.cache_clear()
    selected_backend.cache_clear()
    _implementation.cache_clear()


def reset() -> None:
    """Drop the manager and every cached decision (tests)."""
    global _pm
    _pm = None
    forget_selection()


def _impl_of(plugin_name: str, hook_name: str) -> Callable[..., Any] | None:
    for impl in getattr(get_plugin_manager().hook, hook_name).get_hookimpls():
        if impl.plugin_name == plugin_name:
            return impl.function
    return None


def backend_names() -> list[str]:
    pm = get_plugin_manager()
    return [impl.plugin_name for impl in pm.hook.hb_backend_identity.get_hookimpls()]


def _probe(name: str) -> Availability:
    probe = _impl_of(name, "hb_backend_probe")
    if probe is None:
        return Availability(False, "backend implements no hb_backend_probe")
    try:
        return probe()
    except Exception as exc:  # a probe must not take vLLM down
        return Availability(False, f"probe raised {type(exc).__name__}: {exc}")


def _implementer(name: str, hook: str) -> str:
    """Who serves ``hook`` for backend ``name``: itself, the reference, or nobody."""
    if _impl_of(name, hook) is not None:
        return name
    if hook == "hb_kernel_overrides":
        return "none"  # kernel overrides are device specific: never delegated
    return REFERENCE


@functools.cache
def backend_statuses() -> tuple[BackendStatus, ...]:
    """Every registered backend with availability and, per state hook, who implements it."""
    statuses = []
    for name in backend_names():
        identity = _impl_of(name, "hb_backend_identity")()  # type: ignore[misc]
        hooks = {hook: _implementer(name, hook) for hook in STATE_OPERATION_HOOKS}
        statuses.append(BackendStatus(identity, _probe(name), hooks))
    return tuple(statuses)


def requested_backend() -> str:
    """``VLLM_HYBRID_BACKEND``, validated against the registered names."""
    value = os.environ.get(BACKEND_ENV, AUTO).strip().lower() or AUTO
    allowed = [AUTO, *backend_names()]
    if value not in allowed:
        raise BackendSelectionError(
            f"{BACKEND_ENV}={value!r} is not a backend; allowed values: {', '.join(allowed)}"
        )
    return value


@functools.cache
def selected_backend() -> str:
    """Name of the backend this process uses; raises :class:`BackendSelectionError`."""
    requested = requested_backend()
    statuses = backend_statuses()
    device_kind = detect_device_kind().value
    choice = get_plugin_manager().hook.hb_select_backend(
        requested=requested, device_kind=device_kind, candidates=statuses
    )
    by_name = {status.name: status for status in statuses}
    if choice not in by_name:
        raise BackendSelectionError(f"backend selector returned unknown backend {choice!r}")
    status = by_name[choice]
    if not status.availability.available:
        raise BackendSelectionError(
            f"{BACKEND_ENV}={requested}: backend {choice!r} is not available here: "
            f"{status.availability.reason}"
        )
    logger.info(
        "hybrid_backends: using backend %r (requested %s, device %s)", choice, requested, device_kind
    )
    return choice


def selection_explanation() -> str:
    """One sentence on why the selected backend was chosen (for ``doctor``)."""
    requested = requested_backend()
    name = selected_backend()
    if requested != AUTO:
        return f"{BACKEND_ENV}={requested} asked for it"
    return (
        f"auto: highest-priority available backend for device kind "
        f"{detect_device_kind().value!r} (falls back to the reference 'cpu')"
        if name == REFERENCE
        else f"auto: highest-priority available backend for device kind {detect_device_kind().value!r}"
    )


@functools.cache
def _implementation(hook_name: str) -> Callable[..., Any]:
    backend = selected_backend()
    impl = _impl_of(backend, hook_name)
    if impl is None:
        backend, impl = REFERENCE, _impl_of(REFERENCE, hook_name)
    if impl is None:
        raise RuntimeError(f"no implementation of {hook_name} (reference backend missing?)")
    return traced_first_call(hook_name, backend, impl)


# ---- typed facades ----------------------------------------------------------------------------


def _check_int_tensor(name: str, tensor: Any, dims: int) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"{name} must be an integer tensor, got dtype {tensor.dtype}")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s), got shape {tuple(tensor.shape)}")


def _check_states(states: Sequence[MambaStateTensor], num_groups: int) -> None:
    for state in states:
        if not 0 <= state.group < num_groups:
            raise ValueError(
                f"state {state.layer or '?'} has group {state.group}, but only groups "
                f"0..{num_groups - 1} were given"
            )
        if state.kind.is_conv and state.tensor.dim() != 3:
            raise ValueError(
                f"conv state {state.layer or '?'} must be 3-D (blocks, ., .), got shape "
                f"{tuple(state.tensor.shape)}"
            )


def _check_blocks_in_range(name: str, blocks: Any, num_blocks: int) -> None:
    if blocks.device.type != "cpu" or blocks.numel() == 0:
        return  # values on a device are not read back (no host sync on the hot path)
    low, high = int(blocks.min()), int(blocks.max())
    if low < 0 or high >= num_blocks:
        bad = low if low < 0 else high
        raise IndexError(f"{name} contains block {bad}; allowed 0..{num_blocks - 1}")


def copy_state_blocks(states: Sequence[MambaStateTensor], src_blocks: Any, dst_blocks: Any) -> None:
    """Facade of :func:`.hookspecs.hb_copy_state_blocks` (validates, then calls the backend)."""
    _check_int_tensor("src_blocks", src_blocks, 2)
    _check_int_tensor("dst_blocks", dst_blocks, 2)
    if src_blocks.shape != dst_blocks.shape:
        raise ValueError(
            f"src_blocks shape {tuple(src_blocks.shape)} != dst_blocks shape {tuple(dst_blocks.shape)}"
        )
    _check_states(states, src_blocks.shape[0])
    if dst_blocks.device.type == "cpu":
        for group, row in enumerate(dst_blocks.tolist()):
            if len(set(row)) != len(row):
                block = next(b for b in row if row.count(b) > 1)
                raise ValueError(
                    f"dst_blocks[{group}] lists block {block} twice; each destination may "
                    "be written once per call"
                )
    smallest: dict[int, int] = {}  # per group: the fewest blocks of any of its states
    for state in states:
        blocks = state.tensor.shape[0]
        smallest[state.group] = min(blocks, smallest.get(state.group, blocks))
    for group, blocks in smallest.items():
        _check_blocks_in_range("src_blocks", src_blocks[group], blocks)
        _check_blocks_in_range("dst_blocks", dst_blocks[group], blocks)
    if src_blocks.shape[1] == 0 or not states:
        return
    _implementation("hb_copy_state_blocks")(states=states, src_blocks=src_blocks, dst_blocks=dst_blocks)


def precopy_running_states(
    states: Sequence[MambaStateTensor],
    block_tables: Sequence[Any],
    src_cols: Any,
    dst_cols: Any,
    token_bias: Any,
) -> None:
    """Facade of :func:`.hookspecs.hb_precopy_running_states`."""
    for name, tensor in (("src_cols", src_cols), ("dst_cols", dst_cols), ("token_bias", token_bias)):
        _check_int_tensor(name, tensor, 1)
    for g, table in enumerate(block_tables):
        _check_int_tensor(f"block_tables[{g}]", table, 2)
    if not (src_cols.shape == dst_cols.shape == token_bias.shape):
        raise ValueError("src_cols, dst_cols and token_bias must have the same length")
    _check_states(states, len(block_tables))
    if token_bias.device.type == "cpu" and token_bias.numel() and int(token_bias.min()) < 0:
        raise ValueError(f"token_bias must be >= 0, got {int(token_bias.min())}")
    if not states or src_cols.numel() == 0:
        return
    from .backends import plan

    if plan.on_host(*block_tables, src_cols, dst_cols, token_bias):
        plan.check_row_moves(states, plan.precopy_moves(block_tables, src_cols, dst_cols, token_bias),
                             "precopy")
    _implementation("hb_precopy_running_states")(
        states=states, block_tables=block_tables, src_cols=src_cols, dst_cols=dst_cols,
        token_bias=token_bias,
    )


def postprocess_accepted_states(
    states: Sequence[MambaStateTensor],
    block_tables: Sequence[Any],
    running_cols: Any,
    num_running_tokens: Any,
    num_accepted: Any,
    block_size: int,
    num_accepted_out: Any | None = None,
) -> Any:
    """Facade of :func:`.hookspecs.hb_postprocess_accepted_states`; returns ``num_accepted_out``."""
    for name, tensor in (
        ("running_cols", running_cols),
        ("num_running_tokens", num_running_tokens),
        ("num_accepted", num_accepted),
    ):
        _check_int_tensor(name, tensor, 1)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if num_accepted.device.type == "cpu" and num_accepted.numel() and int(num_accepted.min()) < 1:
        raise ValueError(f"num_accepted must be >= 1, got {int(num_accepted.min())}")
    _check_states(states, len(block_tables))
    if num_accepted_out is None:
        num_accepted_out = num_accepted
    from .backends import plan

    if states and plan.on_host(*block_tables, running_cols, num_running_tokens, num_accepted):
        moves, _ = plan.postprocess_moves(block_tables, running_cols, num_running_tokens,
                                          num_accepted, block_size)
        plan.check_row_moves(states, moves, "postprocess")
    _implementation("hb_postprocess_accepted_states")(
        states=states, block_tables=block_tables, running_cols=running_cols,
        num_running_tokens=num_running_tokens, num_accepted=num_accepted, block_size=block_size,
        num_accepted_out=num_accepted_out,
    )
    return num_accepted_out


def store_checkpoints(
    states: Sequence[MambaStateTensor], sources: Sequence[Any], checkpoints: CheckpointBatch
) -> None:
    """Facade of :func:`.hookspecs.hb_store_checkpoints`."""
    if len(states) != len(sources):
        raise ValueError(f"{len(states)} states but {len(sources)} sources; give one source per state")
    lengths = {
        name: getattr(checkpoints, name).shape
        for name in ("token_end", "seq_start", "initial_block", "dst_block", "temporal_row")
    }
    if len(set(lengths.values())) != 1:
        raise ValueError(f"checkpoint fields differ in length: {lengths}")
    for state, source in zip(states, sources):
        if state.kind.is_conv:
            width = state.tensor.shape[2] if state.kind.value == "conv_sd" else state.tensor.shape[1]
            if source.dim() != 2 or source.shape[1] != width:
                raise ValueError(
                    f"conv source for {state.layer or '?'} must be [num_tokens, {width}], got "
                    f"{tuple(source.shape)}"
                )
        elif tuple(source.shape[1:]) != tuple(state.tensor.shape[1:]):
            raise ValueError(
                f"temporal source for {state.layer or '?'} must be [rows, "
                f"{', '.join(map(str, state.tensor.shape[1:]))}], got {tuple(source.shape)}"
            )
    if not states or checkpoints.dst_block.numel() == 0:
        return
    from .backends import plan

    if plan.on_host(*(getattr(checkpoints, f) for f in ("dst_block", "initial_block", "token_end",
                                                          "seq_start", "temporal_row"))):
        plan.check_checkpoints(states, sources, checkpoints)
    _implementation("hb_store_checkpoints")(states=states, sources=sources, checkpoints=checkpoints)


def gather_aligned_state_indices(
    block_tables: Sequence[Any], seq_lens: Any, block_size: int, num_slots: int = 1
) -> Any:
    """Facade of :func:`.hookspecs.hb_gather_aligned_state_indices`."""
    if not block_tables:
        raise ValueError("block_tables is empty; give one table per Mamba group")
    for g, table in enumerate(block_tables):
        _check_int_tensor(f"block_tables[{g}]", table, 2)
        if table.shape[0] != seq_lens.shape[0]:
            raise ValueError(
                f"block_tables[{g}] has {table.shape[0]} rows but seq_lens has {seq_lens.shape[0]}"
            )
    _check_int_tensor("seq_lens", seq_lens, 1)
    if block_size <= 0 or num_slots <= 0:
        raise ValueError(f"block_size and num_slots must be positive, got {block_size}, {num_slots}")
    return _implementation("hb_gather_aligned_state_indices")(
        block_tables=block_tables, seq_lens=seq_lens, block_size=block_size, num_slots=num_slots
    )


def kernel_overrides(platform_name: str) -> dict[str, Callable[..., object]]:
    """The selected backend's vLLM kernel overrides (only its own: none are delegated)."""
    impl = _impl_of(selected_backend(), "hb_kernel_overrides")
    return dict(impl(platform_name=platform_name) or {}) if impl else {}
