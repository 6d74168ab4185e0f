"""No backend reads a device tensor's values on the host in its per-step hooks (issue 13).

Every per-step hook of every backend runs with index tensors that stand for device tensors:
``meta`` tensors for the torch movers (the reference, Ascend's torch path), and, for the Triton
kernels under ``TRITON_INTERPRET=1`` (CPU tensors only), CPU tensors of a marker subclass. A
``TorchFunctionMode`` refuses every operation that would read such a tensor on the host (on a GPU:
a device-to-host sync): ``.item()``, ``.tolist()``, ``bool()``, ``int()``, ``.numpy()``,
``nonzero``, boolean-mask indexing, printing... Only the Triton kernel launch itself may read
them: on a device it is the move, queued without waiting.

``copy_state_blocks`` is called with host block ids, as vLLM's copy path passes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from vllm_hybrid_backends import plugins, reference
from vllm_hybrid_backends.backends.triton import backend as triton_backend
from vllm_hybrid_backends.types import CheckpointBatch, MambaStateTensor, StateKind

REFUSED = {
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
    "__array__", "__format__", "__repr__", "__str__", "nonzero", "argwhere", "unique",
    "unique_consecutive", "masked_select", "bincount", "repeat_interleave",
}


class HostRead(AssertionError):
    pass


class OnDevice(torch.Tensor):
    """A CPU tensor standing for a device tensor (for the Triton interpreter)."""


def _device_resident(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.device.type == "meta" or isinstance(value, OnDevice))


def _tensors(values: Any) -> list[Any]:
    out: list[Any] = []
    for value in values:
        if isinstance(value, (list, tuple)):
            out.extend(_tensors(value))
        else:
            out.append(value)
    return out


class RefuseHostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.refused: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            name = getattr(func, "__name__", str(func))
            operands = _tensors(list(args) + list(kwargs.values()))
            if any(_device_resident(t) for t in operands):
                bool_index = name in ("__getitem__", "__setitem__") and any(
                    isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in operands[1:2])
                if name in REFUSED or bool_index:
                    self.refused.append(name)
                    raise HostRead(f"{name} read a device tensor on the host")
                try:
                    return func(*args, **kwargs)
                except NotImplementedError as exc:  # meta: "Cannot copy out of meta tensor"
                    if "copy out of meta" in str(exc):
                        self.refused.append(name)
                        raise HostRead(f"{name} copied a device tensor to the host") from exc
                    raise
        return func(*args, **kwargs)


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("meta")


def _tag(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone().as_subclass(OnDevice)


def _states(device: str) -> list[MambaStateTensor]:
    return [
        MambaStateTensor(torch.zeros(16, 4, 8, device=device), StateKind.CONV_SD, group=0, layer="c0"),
        MambaStateTensor(torch.zeros(16, 8, 4, device=device), StateKind.CONV_DS, group=1, layer="c1"),
        MambaStateTensor(torch.zeros(16, 3, 5, device=device), StateKind.TEMPORAL, group=0, layer="t0"),
        MambaStateTensor(torch.zeros(16, 6, device=device), StateKind.TEMPORAL, group=1, layer="t1"),
    ]


def _per_step_calls(states: list[MambaStateTensor], on_device: Callable[[torch.Tensor], torch.Tensor],
                    impl: Any) -> dict[str, Callable[[], object]]:
    """Every per-step hook, with device-standing index tensors (``impl`` takes hook kwargs)."""
    tables = [on_device(torch.arange(12).view(3, 4)), on_device(torch.arange(12).view(3, 4) + 4)]
    cols = [on_device(torch.tensor(v)) for v in ([0, -1, 1], [1, 0, 1], [1, 0, 2])]
    running = [on_device(torch.tensor(v)) for v in ([0, 1, 1], [3, 6, 7], [3, 1, 2])]
    out = on_device(torch.tensor([5, 5, 5]))
    dim = 8
    sources = [torch.zeros(10, dim, device=states[0].tensor.device),
               torch.zeros(10, dim, device=states[0].tensor.device),
               torch.zeros(4, 3, 5, device=states[0].tensor.device),
               torch.zeros(4, 6, device=states[0].tensor.device)]
    batch = CheckpointBatch(*(on_device(torch.tensor(v)) for v in ([8, 10], [0, 5], [-1, 3], [12, 13], [1, 2])))
    return {
        "hb_copy_state_blocks": lambda: impl.hb_copy_state_blocks(
            states=states, src_blocks=torch.tensor([[0, 1], [2, 3]]), dst_blocks=torch.tensor([[4, 5], [6, 7]])),
        "hb_precopy_running_states": lambda: impl.hb_precopy_running_states(
            states=states, block_tables=tables, src_cols=cols[0], dst_cols=cols[1], token_bias=cols[2]),
        "hb_postprocess_accepted_states": lambda: impl.hb_postprocess_accepted_states(
            states=states, block_tables=tables, running_cols=running[0], num_running_tokens=running[1],
            num_accepted=running[2], block_size=4, num_accepted_out=out),
        "hb_store_checkpoints": lambda: impl.hb_store_checkpoints(
            states=states, sources=sources, checkpoints=batch),
        "hb_gather_aligned_state_indices": lambda: impl.hb_gather_aligned_state_indices(
            block_tables=tables, seq_lens=running[1], block_size=4, num_slots=2),
    }


def _run_all(calls: dict[str, Callable[[], object]], guard: RefuseHostReads) -> dict[str, str]:
    failures = {}
    for hook, call in calls.items():
        try:
            with guard:
                call()
        except HostRead as exc:
            failures[hook] = str(exc)
    return failures


class _Hooks:
    """Hook-named calls onto plain functions (for the Ascend torch path's module functions)."""

    def __init__(self, module: Any, **extra: Any) -> None:
        self.module, self.extra = module, extra

    def __getattr__(self, hook: str) -> Callable[..., object]:
        function = getattr(self.module, hook.removeprefix("hb_"))
        return lambda **kwargs: function(**kwargs, **self.extra)


def test_the_reference_reads_no_device_value():
    assert _run_all(_per_step_calls(_states("meta"), _meta, reference), RefuseHostReads()) == {}


def test_the_facades_read_no_device_value():
    calls = _per_step_calls(_states("meta"), _meta, _Hooks(plugins))
    assert _run_all(calls, RefuseHostReads()) == {}


def test_the_ascend_torch_path_reads_no_device_value():
    from vllm_hybrid_backends.backends.ascend import backend as ascend

    calls = _per_step_calls(_states("meta"), _meta, _Hooks(ascend, path=ascend.TORCH))
    assert _run_all(calls, RefuseHostReads()) == {}


class _Launch:
    """A Triton kernel whose launches run with the guard paused, on plain tensors."""

    def __init__(self, kernel: Any, guard: RefuseHostReads) -> None:
        self.kernel, self.guard = kernel, guard

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            plain = [a.as_subclass(torch.Tensor) if isinstance(a, torch.Tensor) else a for a in args]
            self.guard.paused = True
            try:
                self.kernel[grid](*plain, **kwargs)
            finally:
                self.guard.paused = False
        return launch


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_the_triton_backend_reads_no_device_value(vendor, interpreted_kernels, monkeypatch):
    backend = getattr(triton_backend, vendor.upper())
    guard = RefuseHostReads()
    for name in ("_state_copy_kernel", "_checkpoint_kernel", "_gather_indices_kernel"):
        monkeypatch.setattr(interpreted_kernels, name, _Launch(getattr(interpreted_kernels, name), guard))
    states = [MambaStateTensor(_tag(s.tensor), s.kind, s.group, s.layer) for s in _states("cpu")]
    assert _run_all(_per_step_calls(states, _tag, backend), guard) == {}


def test_the_guard_catches_a_host_read():
    """The guard itself: the reads it must see are refused, device-side work is not."""
    guard = RefuseHostReads()
    for make in (_meta, _tag):
        ids = make(torch.tensor([1, 2]))
        with guard:
            (ids + 1).gather(0, ids.clamp(max=1))
        for read in (lambda t=ids: t.tolist(), lambda t=ids: int(t[0]), lambda t=ids: bool((t > 1).any()),
                     lambda t=ids: t[t > 1], lambda t=ids: f"{t}"):
            with pytest.raises(HostRead), guard:
                read()
    with guard:
        assert torch.tensor([1, 2]).tolist() == [1, 2]  # host tensors may be read
