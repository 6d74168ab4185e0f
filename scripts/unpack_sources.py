"""Unpack a wheel's pure-Python part: python scripts/unpack_sources.py WHEEL DEST.

What the source-only trees (vLLM 0.23/0.26/0.33, vllm-ascend) need is the Python modules, their
data (JSON configs, templates) and the dist-info.  Left out: compiled extensions (``*.so``),
ELF executables and the vendored C++/CUDA headers under ``third_party/`` -- about 93 % of a
CUDA vLLM wheel (0.33.0: 813 MB installed, 56 MB kept).  Prints the bytes kept.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path, PurePosixPath

SHARED_LIBRARY = re.compile(r"\.so(\.\d+)*$")  # libfoo.so, libfoo.so.1.2
NATIVE_SUFFIXES = (".dylib", ".dll", ".pyd", ".a", ".o")
KEPT_UNDER_THIRD_PARTY = (".py", ".pyi", ".json")
ELF_MAGIC = b"\x7fELF"


def is_native(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bool:
    path = PurePosixPath(info.filename)
    if any(part.endswith(".dist-info") for part in path.parts[:-1]):
        return False
    if SHARED_LIBRARY.search(path.name) or path.suffix in NATIVE_SUFFIXES:
        return True
    if "third_party" in path.parts and path.suffix not in KEPT_UNDER_THIRD_PARTY:
        return True
    if path.suffix:
        return False
    with archive.open(info) as member:  # e.g. vllm/vllm-rs, a 60 MB executable
        return member.read(len(ELF_MAGIC)) == ELF_MAGIC


def unpack(wheel: Path, dest: Path) -> int:
    kept = 0
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if info.is_dir() or is_native(archive, info):
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
