"""A narrow stand-in for torch_npu and CANN (``acl``) so vllm-ascend's real sources import on a
host without an NPU. Only these top-level names are served; vllm_ascend itself is never faked.
Every attribute of a stand-in module is another stand-in object: callable, subscriptable,
usable as a base class or decorator. ``SERVED`` records what vllm-ascend asked for."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

# torch_npu and what ships with it in the CANN toolkit (acl runtime, torchair / npugraph_ex graph
# compilers, triton-ascend's NPU driver hooks).
STANDIN_ROOTS = ("torch_npu", "acl", "torchair", "npugraph_ex", "mindie_turbo")
SERVED: list[str] = []


class _StandinModule(types.ModuleType):
    """A module that is also a harmless value: every attribute is a stand-in submodule (so
    ``importlib.reload(sys.modules["torchair.x"])`` works), callable, subscriptable, usable in
    ``X | None`` annotations, as a decorator and as a base class."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return importlib.import_module(f"{self.__name__}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return self

    def __getitem__(self, key: Any) -> Any:
        return self

    def __or__(self, other: Any) -> Any:
        return self

    __ror__ = __or__

    def __iter__(self):
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] not in STANDIN_ROOTS and not fullname.startswith("torch.npu."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        SERVED.append(module.__name__)
        if module.__name__ == "torch_npu":
            _attach_torch_npu()


def _attach_torch_npu() -> None:
    """What importing torch_npu does to torch: a ``torch.npu`` namespace (never available)."""
    import torch

    if "torch.npu" not in sys.modules:
        npu = _FINDER.create_module(importlib.machinery.ModuleSpec("torch.npu", _FINDER))
        npu.__spec__ = importlib.machinery.ModuleSpec("torch.npu", _FINDER, is_package=True)
        npu.is_available = lambda: False  # type: ignore[attr-defined]
        sys.modules["torch.npu"] = npu
        torch.npu = npu  # type: ignore[attr-defined]


_FINDER = _Finder()


def install() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _attach_torch_npu()


#: SoC names torch_npu reports and the numbers ``torch_npu.npu.get_soc_version()`` gives for
#: them (vllm-ascend's ``check_ascend_device_type``: 220-225 A2, 200-205 310P).
SOC_VERSIONS = {"Ascend910B2": 223, "Ascend310P3": 202}


def show_one_npu(soc_name: str) -> None:
    """What a host with one visible NPU of ``soc_name`` answers to device *queries*, and what
    importing the real torch_npu does to torch: the ``npu`` device type (PrivateUse1 renamed,
    so ``torch.device("npu")`` parses) and ``torch.distributed.is_hccl_available``. No op is
    mapped: tensors stay on the CPU and every copy runs as a CPU torch op."""
    import torch
    import torch.distributed

    install()
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    if not hasattr(torch.distributed, "is_hccl_available"):
        torch.distributed.is_hccl_available = lambda: False  # type: ignore[attr-defined]
    npu = sys.modules["torch.npu"]
    npu.device_count = lambda: 1  # type: ignore[attr-defined]
    npu.get_device_name = lambda device=0: soc_name  # type: ignore[attr-defined]
    importlib.import_module("torch_npu").npu.get_soc_version = lambda: SOC_VERSIONS[soc_name]
