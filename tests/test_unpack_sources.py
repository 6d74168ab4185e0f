"""scripts/unpack_sources.py keeps a wheel's Python and data and leaves its native parts out."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "unpack_sources.py"
spec = importlib.util.spec_from_file_location("unpack_sources", SCRIPT)
assert spec is not None and spec.loader is not None
unpack_sources = importlib.util.module_from_spec(spec)
spec.loader.exec_module(unpack_sources)

EXECUTABLE = 0o100755 << 16
PLAIN = 0o100644 << 16
KEPT = {
    "pkg/__init__.py": PLAIN,
    "pkg/solver.sol": PLAIN,
    "pkg/LICENSE": EXECUTABLE,  # suffix-less and executable, but not a binary
    "pkg-1.0.dist-info/RECORD": EXECUTABLE,
    "pkg/configs/E=8.json": PLAIN,
    "pkg/templates/chat.jinja": PLAIN,
    "pkg/third_party/pynvml.py": PLAIN,
    "pkg/run.sh": EXECUTABLE,
    "pkg-1.0.dist-info/METADATA": PLAIN,
}
LEFT_OUT = {
    "pkg/_C.abi3.so": EXECUTABLE,
    "pkg/libfoo.so.1.2": PLAIN,
    "pkg/vllm-rs": EXECUTABLE,  # an ELF binary without a suffix
    "pkg/third_party/cutlass/include/mma.hpp": PLAIN,
}


def contents(name: str) -> bytes:
    binary = name.endswith("vllm-rs")
    return (b"\x7fELF\x02\x01" if binary else b"") + f"contents of {name}".encode()


def make_wheel(path: Path, entries: dict[str, int]) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        for name, mode in entries.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = mode
            archive.writestr(info, contents(name))


def test_only_python_and_data_are_unpacked(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    make_wheel(wheel, {**KEPT, **LEFT_OUT})
    dest = tmp_path / "site"
    kept = unpack_sources.unpack(wheel, dest)
    found = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    assert found == set(KEPT)
    assert (dest / "pkg/__init__.py").read_text() == "contents of pkg/__init__.py"
    assert kept == sum(len(contents(name)) for name in KEPT)


def test_an_entry_outside_the_destination_is_refused(tmp_path):
    wheel = tmp_path / "evil-1.0-py3-none-any.whl"
    make_wheel(wheel, {"../escaped.py": PLAIN})
    with pytest.raises(SystemExit, match="escaped.py"):
        unpack_sources.unpack(wheel, tmp_path / "site")
    assert not (tmp_path / "escaped.py").exists()
