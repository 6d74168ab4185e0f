"""vLLM's Triton kernel modules from a vLLM source tree, without importing vLLM.

``gpu_check --interior --vllm-source DIR`` runs vLLM's own gated-delta-net (FLA) and Mamba2 (SSD)
kernels on a machine where vLLM is not installed: ``DIR`` holds a ``vllm/`` package tree (a
copy of ``site-packages/vllm``, or the subset ``scripts/gpu_vllm_source.sh`` copies).
:func:`install` puts a finder first on ``sys.meta_path`` that answers every ``vllm`` /
``vllm.*`` import from ``DIR``:

- every package (``vllm``, ``vllm.third_party``, ``vllm.model_executor.layers.mamba.ops``, ...)
  is a bare module whose ``__path__`` points into ``DIR``: no ``__init__.py`` of vLLM runs
  (``vllm/__init__.py`` would pull vLLM's whole dependency tree; FLA's ``ops/__init__.py`` its
  layernorm module, which needs einops and vLLM's JIT warm-up);
- every other module is vLLM's own file from ``DIR`` (the FLA ops, the SSD ops,
  ``vllm/_version.py``, ``vllm/envs.py``, ``vllm/utils/math_utils.py``,
  ``vllm/utils/gpu_sync_debug.py``), except these stand-ins for the vLLM utilities the kernel
  modules import, each with only what they use:

  - ``vllm.triton_utils``: the real ``triton``, ``triton.language`` (``tl``) and
    ``libdevice`` (``tldevice``), ``HAS_TRITON = True``; under the interpreter ``triton`` whose
    ``autotune`` keeps the first config (the interpreter cannot benchmark);
  - ``vllm.platforms`` (``current_platform``) and ``vllm.platforms.rocm`` (``on_gfx1x``): the
    platform from torch (CUDA, ROCm; under the interpreter a GPU-like platform that is none of
    them, so the kernels take their Triton path);
  - ``vllm.logger``: ``init_logger`` = ``logging.getLogger`` with ``*_once`` methods;
  - ``vllm.utils.platform_utils``: ``num_compute_units``, ``get_device_name_as_file_name``,
    ``is_pin_memory_available`` (vLLM's needs the ``regex`` package);
  - ``vllm.utils.torch_utils``: ``async_tensor_h2d`` (a plain copy; vLLM's module needs numpy);
  - ``vllm._custom_ops``: nothing (vLLM's compiled ops; ``mamba_ssm.py`` imports it for its
    decode kernels, which the check does not run);
  - ``vllm.v1.attention.backends.utils``: ``NULL_BLOCK_ID`` (0, vLLM's null block);
  - ``vllm.model_executor.layers.mamba.mamba_utils``: ``is_conv_state_dim_first`` (the check
    sets the conv layout it stores in; vLLM's module imports its config system).

``einops`` (``ssd_combined.py`` imports it) comes from ``DIR/einops`` when it is not installed.
``vllm.__version__`` is ``DIR/vllm/_version.py``'s, so the plugin's version checks hold.
"""

from __future__ import annotations
import __future__

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys
import types
from collections.abc import Callable
from typing import Any

#: The kernel files a source tree must hold (relative to ``DIR/vllm``).
REQUIRED = ("_version.py", "third_party/flash_linear_attention/ops/chunk.py",
            "model_executor/layers/mamba/ops/ssd_combined.py",
            "v1/attention/backends/mamba_attn.py")
#: vLLM's Mamba chunk table (module, ``Class.method``); its file, relative to ``DIR/vllm``.
CHUNK_METADATA = ("vllm.v1.attention.backends.mamba_attn",
                  "BaseMambaAttentionMetadataBuilder._compute_chunk_metadata")
CHUNK_METADATA_FILE = "v1/attention/backends/mamba_attn.py"
FLA = "vllm.third_party.flash_linear_attention.ops"
SSD = "vllm.model_executor.layers.mamba.ops"


class VllmSourceError(RuntimeError):
    """vLLM's kernels cannot be loaded; the message is one line naming the path and the need."""


# ---- stand-ins -----------------------------------------------------------------------------------

def _triton_utils(module: Any, interpret: bool) -> None:
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    module.triton = _FirstConfig(triton) if interpret else triton
    module.tl, module.tldevice, module.HAS_TRITON = tl, tldevice, True


class _FirstConfig:
    """``triton`` whose ``autotune`` keeps the first config (the interpreter has no device to
    benchmark configs on)."""

    def __init__(self, triton: Any) -> None:
        self._triton = triton

    def __getattr__(self, name: str) -> Any:
        return getattr(self._triton, name)

    def autotune(self, configs: list[Any], *args: Any, **kwargs: Any) -> Any:
        return self._triton.autotune(configs[:1], *args, **kwargs)


class _Platform:
    """``current_platform`` as far as the FLA and SSD kernel modules ask."""

    def __init__(self, interpret: bool) -> None:
        from .device import cuda_build, hip_build

        self.interpret = interpret
        self.hip = not interpret and hip_build()
        self.cuda = not interpret and cuda_build()
        self.device_name = "cuda" if not interpret else "interpreter"

    def is_cuda(self) -> bool:
        return self.cuda

    def is_rocm(self) -> bool:
        return self.hip

    def is_cuda_alike(self) -> bool:
        return self.cuda or self.hip

    def is_cpu(self) -> bool:
        return False  # the Triton path, also under the interpreter

    def is_xpu(self) -> bool:
        return False

    def is_device_capability(self, capability: int) -> bool:
        import torch

        if not self.cuda:
            return False
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor == capability

    def is_arch_support_pdl(self) -> bool:
        return False

    def is_pin_memory_available(self) -> bool:
        return self.cuda or self.hip

    def get_device_name(self, device_id: int = 0) -> str:
        import torch

        return torch.cuda.get_device_name(device_id) if self.cuda or self.hip else "interpreter"

    def num_compute_units(self, device_id: int = 0) -> int:
        import torch

        if self.cuda or self.hip:
            return int(torch.cuda.get_device_properties(device_id).multi_processor_count)
        return 1


def _platforms(module: Any, interpret: bool) -> None:
    module.current_platform = _Platform(interpret)


def _platforms_rocm(module: Any, interpret: bool) -> None:
    def on_gfx1x() -> bool:
        import torch

        return str(getattr(torch.cuda.get_device_properties(0), "gcnArchName", "")).startswith("gfx1")

    module.on_gfx1x = on_gfx1x


class _Logger(logging.LoggerAdapter):  # type: ignore[type-arg]
    def _once(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("scope", None)
        self.log(level, msg, *args, **kwargs)

    def info_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.INFO, msg, *args, **kwargs)

    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.WARNING, msg, *args, **kwargs)

    def debug_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once(logging.DEBUG, msg, *args, **kwargs)


def _logger(module: Any, interpret: bool) -> None:
    module.init_logger = lambda name: _Logger(logging.getLogger(name), {})


def _platform_utils(module: Any, interpret: bool) -> None:
    def platform() -> _Platform:
        return sys.modules["vllm.platforms"].current_platform  # type: ignore[no-any-return]

    module.num_compute_units = lambda device_id=0: platform().num_compute_units(device_id)
    module.get_device_name_as_file_name = lambda device_id=0: "_".join(
        platform().get_device_name(device_id).replace("/", " ").split())
    module.is_pin_memory_available = lambda: platform().is_pin_memory_available()


def _torch_utils(module: Any, interpret: bool) -> None:
    import torch

    def async_tensor_h2d(data: Any, device: Any = None, dtype: Any = None, out: Any = None) -> Any:
        tensor = torch.as_tensor(data, dtype=dtype if dtype is not None or out is None else out.dtype)
        if out is not None:
            return out.copy_(tensor, non_blocking=True)
        return tensor.to(device, non_blocking=True)

    module.async_tensor_h2d = async_tensor_h2d


def _nothing(module: Any, interpret: bool) -> None:
    pass


def _attention_utils(module: Any, interpret: bool) -> None:
    from .interior import NULL_BLOCK_ID

    module.NULL_BLOCK_ID = NULL_BLOCK_ID


def _mamba_utils(module: Any, interpret: bool) -> None:
    module.is_conv_state_dim_first = lambda: False  # vLLM's default layout, SD


#: Module name -> what fills its stand-in (see the module docstring).
STAND_INS: dict[str, Callable[[Any, bool], None]] = {
    "vllm.triton_utils": _triton_utils,
    "vllm.platforms": _platforms,
    "vllm.platforms.rocm": _platforms_rocm,
    "vllm.logger": _logger,
    "vllm.utils.platform_utils": _platform_utils,
    "vllm.utils.torch_utils": _torch_utils,
    "vllm._custom_ops": _nothing,
    "vllm.v1.attention.backends.utils": _attention_utils,
    "vllm.model_executor.layers.mamba.mamba_utils": _mamba_utils,
}


# ---- the finder --------------------------------------------------------------------------------

class _Bare(importlib.abc.Loader):
    """A package module with nothing executed (vLLM's ``__init__.py`` files do not run)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__hybrid_vllm_source__ = True  # type: ignore[attr-defined]


class _StandIn(_Bare):
    def __init__(self, fill: Callable[[Any, bool], None], interpret: bool) -> None:
        self.fill, self.interpret = fill, interpret

    def exec_module(self, module: types.ModuleType) -> None:
        super().exec_module(module)
        module.__hybrid_stand_in__ = True  # type: ignore[attr-defined]
        self.fill(module, self.interpret)


class VllmSourceFinder(importlib.abc.MetaPathFinder):
    """Answers ``vllm`` and ``vllm.*`` from ``root/vllm`` (see the module docstring), and
    ``einops`` from ``root/einops`` where it is not installed."""

    def __init__(self, root: str, interpret: bool) -> None:
        self.root, self.interpret = root, interpret
        self.einops = (importlib.machinery.PathFinder.find_spec("einops") is None
                       and os.path.isfile(os.path.join(root, "einops", "__init__.py")))

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == "einops" and self.einops:
            return importlib.machinery.PathFinder.find_spec(name, [self.root])
        if name != "vllm" and not name.startswith("vllm."):
            return None
        if name in STAND_INS:
            spec = importlib.machinery.ModuleSpec(name, _StandIn(STAND_INS[name], self.interpret),
                                                  is_package=True)
            spec.submodule_search_locations = []
            return spec
        base = os.path.join(self.root, *name.split("."))
        if os.path.isdir(base):
            spec = importlib.machinery.ModuleSpec(name, _Bare(), is_package=True)
            spec.submodule_search_locations = [base]
            return spec
        if os.path.isfile(base + ".py"):
            return importlib.util.spec_from_file_location(name, base + ".py")
        raise ModuleNotFoundError(
            f"{name} is neither in the vLLM source tree {self.root} nor one of the gpu check's "
            "stand-ins (vllm_hybrid_backends/vllm_source.py)", name=name)


def tree_version(root: str) -> str | None:
    """``__version__`` of the ``vllm/`` tree under ``root``, read from ``vllm/_version.py``
    without running it; None when that file is absent or names no version."""
    try:
        with open(os.path.join(root, "vllm", "_version.py"), encoding="utf-8") as source:
            text = source.read()
    except OSError:
        return None
    found = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else None


def chunk_metadata_takes_checkpoints(path: str) -> bool:
    """Whether ``path`` (vLLM's ``mamba_attn.py``) defines ``CHUNK_METADATA``'s method with a
    ``checkpoint_offsets_p`` parameter (vLLM 0.32+: the prefill checkpoints the Mamba2 plan
    builds on); read from the file, not imported."""
    try:
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), path)
    except (OSError, SyntaxError):
        return False
    owner, name = CHUNK_METADATA[1].split(".")
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == owner:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    params = item.args.posonlyargs + item.args.args + item.args.kwonlyargs
                    return any(a.arg == "checkpoint_offsets_p" for a in params)
    return False


def support_problem(root: str) -> str | None:
    """Why the ``vllm/`` tree under ``root`` cannot run the interior check (one clause naming
    its version and the need), or None when it can. Read from its files: nothing imported."""
    vllm = os.path.join(root, "vllm")
    absent = [os.path.join(vllm, p) for p in REQUIRED if not os.path.isfile(os.path.join(vllm, p))]
    version = tree_version(root)
    if version is None:
        missing = absent[0] if absent else os.path.join(vllm, "_version.py")
        return (f"no vLLM kernel sources there ({missing} is missing); it needs a vllm/ tree "
                "(0.32+) with third_party/flash_linear_attention/ops and "
                "model_executor/layers/mamba/ops, e.g. made by `bash scripts/gpu_vllm_source.sh "
                "DIR` on a machine with vLLM installed")
    if absent:
        why = f"{absent[0]} is missing"
    elif not chunk_metadata_takes_checkpoints(os.path.join(vllm, CHUNK_METADATA_FILE)):
        why = f"its {CHUNK_METADATA[1]} takes no checkpoint_offsets_p"
    else:
        return None
    return f"holds vLLM {version}; the interior check needs vLLM 0.32+ ({why})"


def check_tree(root: str) -> str:
    """``root`` made absolute, or :class:`VllmSourceError` naming what is missing: checked
    before anything of it is imported."""
    root = os.path.abspath(root)
    if not os.path.isdir(os.path.join(root, "vllm")) and os.path.isfile(os.path.join(root, "_version.py")) \
            and os.path.basename(root) == "vllm":
        raise VllmSourceError(
            f"--vllm-source {root}: that is the vllm/ package itself; DIR is the folder "
            f"containing vllm/ (--vllm-source {os.path.dirname(root)})")
    problem = support_problem(root)
    if problem is not None:
        raise VllmSourceError(f"--vllm-source {root}{'' if problem.startswith('holds') else ':'} {problem}")
    return root


def installed_root() -> str | None:
    """The folder containing the installed (importable) ``vllm`` package, found without
    importing it; None when there is none."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))


def install(root: str, interpret: bool = False) -> VllmSourceFinder:
    """Answer ``vllm`` imports from the tree at ``root`` in this process (first on
    ``sys.meta_path``); ``vllm.__version__`` from its ``_version.py``."""
    root = check_tree(root)
    for finder in sys.meta_path:
        if isinstance(finder, VllmSourceFinder) and finder.root == root:
            return finder  # installed already
    loaded = sorted(name for name in sys.modules if name == "vllm" or name.startswith("vllm."))
    if loaded:
        raise VllmSourceError(f"--vllm-source {root}: vLLM is already imported in this process "
                              f"({loaded[0]}); the source tree must be installed first")
    finder = VllmSourceFinder(root, interpret)
    sys.meta_path.insert(0, finder)
    vllm = importlib.import_module("vllm")
    version = importlib.import_module("vllm._version")
    vllm.__version__ = version.__version__  # type: ignore[attr-defined]
    from . import compat

    compat.installed_vllm_version.cache_clear()
    return finder


def vllm_function(module: str, qualname: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    """vLLM's function ``qualname`` (``Class.method`` or ``function``) from ``module``'s file,
    compiled alone with the globals ``namespace`` (for code in a module whose imports pull
    vLLM's config system: ``BaseMambaAttentionMetadataBuilder._compute_chunk_metadata``). Its
    decorators are dropped; any global it reads that ``namespace`` lacks is an error."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise VllmSourceError(f"{module}: not found")
    with open(spec.origin, encoding="utf-8") as source:
        tree = ast.parse(source.read(), spec.origin)
    node: Any = tree
    for part in qualname.split("."):
        node = next((n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))
                     and n.name == part), None)
        if node is None:
            raise VllmSourceError(f"{module}.{qualname}: not in {spec.origin}")
    node.decorator_list = []
    code = compile(ast.Module(body=[node], type_ignores=[]), spec.origin, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    scope = dict(namespace)
    exec(code, scope)  # noqa: S102  (vLLM's own function, from its file)
    function: Callable[..., Any] = scope[node.name]
    import builtins
    import dis

    unknown = sorted({i.argval for i in dis.get_instructions(function)
                      if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")
                      and i.argval not in scope and not hasattr(builtins, i.argval)})
    if unknown:
        raise VllmSourceError(f"{module}.{qualname} reads globals the check does not give it: "
                              f"{', '.join(unknown)}")
    return function


# ---- what the interpreter cannot run as written (CPU tests only) -------------------------------

def interpreter_workarounds(prefix: str = FLA) -> None:
    """Make FLA's kernel modules runnable under ``TRITON_INTERPRET=1`` (never on a GPU):

    1. ``op.py`` binds ``tl.exp`` / ``tl.exp2`` / ``tl.log`` ... to module names; the
       interpreter swaps its builtins in as attributes of ``triton.language`` only while a
       kernel runs, so a name bound before still holds the compiled-mode builtin ("Did you
       forget to add @triton.jit ?"). Such names are rebound to look the builtin up at call time.
    2. ``chunk_delta_h``'s kernel calls ``i_t.to(tl.int64)`` on its ``for i_t in range(NT)``
       index, a Python int under the interpreter; that module's ``range`` yields interpreter
       scalars instead.
    """
    import builtins

    import triton.language as tl

    def looked_up(name: str) -> Callable[..., Any]:
        return lambda *args, **kwargs: getattr(tl, name)(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith(prefix) and module is not None:
            for attr, value in list(vars(module).items()):
                if tl.core.is_builtin(value):
                    setattr(module, attr, looked_up(value.__name__))

    def scalar_range(*args: Any) -> Any:
        for i in builtins.range(*(int(a) for a in args)):
            yield tl.full((), i, tl.int32)

    sys.modules[prefix + ".chunk_delta_h"].range = scalar_range  # type: ignore[attr-defined]
