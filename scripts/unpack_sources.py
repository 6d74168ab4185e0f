"""Unpack a wheel's pure-Python part: python scripts/unpack_sources.py WHEEL DEST.

What the source-only trees (vLLM 0.23/0.26/0.33, vllm-ascend) need is the Python modules, their
data (JSON configs, templates) and the dist-info.  Left out: compiled extensions (``*.so``),
native executables and the vendored C++/CUDA headers under ``third_party/`` -- about 94 % of a
CUDA vLLM wheel (0.33.0: 813 MB installed, 51 MB of it Python and data).  Prints the bytes kept.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path, PurePosixPath

NATIVE_SUFFIXES = (".so", ".dylib", ".dll", ".pyd", ".a", ".o")
KEPT_UNDER_THIRD_PARTY = (".py", ".pyi", ".json")


def is_native(name: str, external_attr: int) -> bool:
    path = PurePosixPath(name)
    if any(suffix in NATIVE_SUFFIXES or suffix.startswith(".so") for suffix in path.suffixes):
        return True
    if "third_party" in path.parts and path.suffix not in KEPT_UNDER_THIRD_PARTY:
        return True
    executable = (external_attr >> 16) & 0o111
    return bool(executable) and not path.suffix  # e.g. vllm/vllm-rs (a 60 MB binary)


def unpack(wheel: Path, dest: Path) -> int:
    kept = 0
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if info.is_dir() or is_native(info.filename, info.external_attr):
                continue
            target = dest / info.filename
            if not target.resolve().is_relative_to(dest.resolve()):
                raise SystemExit(f"unpack_sources: {wheel.name} entry {info.filename!r} "
                                 f"points outside {dest}")
            archive.extract(info, dest)
            kept += info.file_size
    return kept


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/unpack_sources.py WHEEL DEST", file=sys.stderr)
        return 2
    wheel, dest = Path(argv[0]), Path(argv[1])
    dest.mkdir(parents=True, exist_ok=True)
    kept = unpack(wheel, dest)
    print(f"{kept / 1e6:.0f} MB of Python and data from {wheel.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
