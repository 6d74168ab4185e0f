"""scripts/fetch_wheel.py against a real HTTP server on loopback that drops connections."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fetch_wheel.py"
spec = importlib.util.spec_from_file_location("fetch_wheel", SCRIPT)
assert spec is not None and spec.loader is not None
fetch_wheel = importlib.util.module_from_spec(spec)
sys.modules["fetch_wheel"] = fetch_wheel  # its dataclass resolves annotations through it
spec.loader.exec_module(fetch_wheel)

WHEEL = "toy_pkg-1.2.0-py3-none-any.whl"


class Index:
    """A simple index serving one project's files, cutting the first `drops` transfers short."""

    def __init__(self, files: dict[str, bytes], drops: int = 0, cut_after: int = 0,
                 html: bool = False, sha256: dict[str, str] | None = None,
                 cuts: list[int] | None = None, ignores_range: bool = False):
        self.files, self.html, self.ignores_range = files, html, ignores_range
        #: bytes each response sends before the connection drops, in order (then whole ones)
        self.cuts = list(cuts) if cuts is not None else [cut_after] * drops
        self.sha256 = sha256 or {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
        self.ranges: list[str | None] = []
        self.authorization: list[str | None] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                index.authorization.append(self.headers.get("Authorization"))
                if self.path == "/simple/toy-pkg/":
                    return self.page()
                name = self.path.removeprefix("/files/")
                if name not in index.files:
                    self.send_error(404)
                    return
                data = index.files[name]
                requested = self.headers.get("Range")
                index.ranges.append(requested)
                start = int(requested.removeprefix("bytes=").rstrip("-")) if requested else 0
                if index.ignores_range:
                    start, requested = 0, None
                if start >= len(data) and requested:
                    self.send_error(416)
                    return
                self.send_response(206 if requested else 200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                body = data[start:]
                if index.cuts:
                    body = body[:index.cuts.pop(0)]
                    self.close_connection = True
                self.wfile.write(body)

            def page(self):
                if index.html:
                    links = "".join(f'<a href="/files/{n}#sha256={index.sha256[n]}">{n}</a>'
                                    for n in index.files)
                    body, kind = f"<html><body>{links}</body></html>".encode(), "text/html"
                else:
                    body = json.dumps({"files": [
                        {"filename": n, "url": f"/files/{n}", "hashes": {"sha256": index.sha256[n]},
                         "size": len(b)} for n, b in index.files.items()]}).encode()
                    kind = "application/vnd.pypi.simple.v1+json"
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def settings(self, userinfo: str = "") -> dict[str, str]:
        return {"global.index-url": self.url.replace("//", f"//{userinfo}@" if userinfo else "//")}


@pytest.fixture
def serve():
    started: list[Index] = []

    def start(*args, **kwargs) -> Index:
        started.append(Index(*args, **kwargs))
        return started[-1]

    yield start
    for index in started:
        index.server.shutdown()
        index.server.server_close()


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    monkeypatch.setattr(fetch_wheel.time, "sleep", lambda seconds: None)


@pytest.mark.parametrize("html", [False, True], ids=["pep691-json", "pep503-html"])
def test_dropped_transfers_resume_where_they_stopped(serve, tmp_path, html):
    data = os.urandom(3 * 2**20 + 17)
    index = serve({WHEEL: data}, drops=2, cut_after=2**20, html=html)
    path = fetch_wheel.fetch("toy-pkg==1.2.0", tmp_path, settings=index.settings())
    assert path == tmp_path / WHEEL
    assert path.read_bytes() == data
    assert index.ranges == [None, f"bytes={2**20}-", f"bytes={2 * 2**20}-"]
    assert not list(tmp_path.glob("*.part"))


def _candidate(index):
    return fetch_wheel.best_wheel(fetch_wheel.index_candidates(index.url, "toy-pkg", 5.0),
                                  "toy-pkg", "1.2.0")


def test_attempts_that_move_the_transfer_on_do_not_use_up_the_retries(serve, tmp_path):
    data = os.urandom(8 * 2**20)
    index = serve({WHEEL: data}, drops=7, cut_after=2**20)
    assert fetch_wheel.download(_candidate(index), tmp_path, attempts=3).read_bytes() == data
    assert len(index.ranges) == 8


def test_gives_up_after_the_attempts_without_progress_and_a_rerun_resumes(serve, tmp_path):
    data = os.urandom(3 * 2**20)
    index = serve({WHEEL: data}, cuts=[2**20, 0, 0, 0])
    with pytest.raises(fetch_wheel.FetchError,
                       match=r"3 attempts in a row failed .* resume from 1,048,576 bytes"):
        fetch_wheel.download(_candidate(index), tmp_path, attempts=3)
    assert fetch_wheel.download(_candidate(index), tmp_path).read_bytes() == data
    assert index.ranges[-1] == f"bytes={2**20}-"


def test_a_server_that_ignores_ranges_or_a_stale_part_starts_over(serve, tmp_path):
    data = os.urandom(2 * 2**20)
    index = serve({WHEEL: data}, cuts=[2**20], ignores_range=True)
    assert fetch_wheel.download(_candidate(index), tmp_path).read_bytes() == data
    (tmp_path / WHEEL).unlink()
    (tmp_path / (WHEEL + ".part")).write_bytes(os.urandom(3 * 2**20))  # longer than the file
    index = serve({WHEEL: data})
    assert fetch_wheel.download(_candidate(index), tmp_path).read_bytes() == data
    assert index.ranges == [f"bytes={3 * 2**20}-", None]


def test_index_credentials_go_in_a_header_and_never_into_the_log(serve, tmp_path, capsys):
    import base64

    data = os.urandom(4096)
    index = serve({WHEEL: data}, cuts=[100])
    path = fetch_wheel.fetch("toy-pkg==1.2.0", tmp_path, settings=index.settings("ci:s3cret"))
    assert path.read_bytes() == data
    assert set(index.authorization) == {"Basic " + base64.b64encode(b"ci:s3cret").decode()}
    err = capsys.readouterr().err
    assert "ci:****@127.0.0.1" in err and "s3cret" not in err


def test_pips_own_config_is_read_multi_line_values_included(tmp_path, monkeypatch):
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nextra-index-url =\n    https://a.example/simple\n"
                      "    https://b.example/simple\nfind-links = /srv/wheels\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)  # the environment's settings come first
    indexes, links = fetch_wheel.index_sources(fetch_wheel.pip_settings(sys.executable))
    assert indexes[-2:] == ["https://a.example/simple", "https://b.example/simple"]
    assert "/srv/wheels" in links


def test_a_wrong_digest_is_refused_and_the_download_removed(serve, tmp_path):
    data = os.urandom(4096)
    index = serve({WHEEL: data}, sha256={WHEEL: "0" * 64})
    with pytest.raises(fetch_wheel.FetchError, match=f"sha256 {hashlib.sha256(data).hexdigest()} "
                                                     f"is not the index's {'0' * 64}"):
        fetch_wheel.fetch("toy-pkg==1.2.0", tmp_path, settings=index.settings())
    assert list(tmp_path.iterdir()) == []


def test_not_enough_disk_is_said_before_downloading(serve, tmp_path, monkeypatch):
    index = serve({WHEEL: os.urandom(3 * 2**20)})
    usage = fetch_wheel.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(fetch_wheel.shutil, "disk_usage",
                        lambda path: usage._replace(free=100 * 2**20))
    with pytest.raises(fetch_wheel.FetchError, match=r"needs 3 MiB \(\+ 256 MiB to unpack\) .* 100 MiB free"):
        fetch_wheel.fetch("toy-pkg==1.2.0", tmp_path, settings=index.settings())
    assert index.ranges == []


def test_a_missing_file_fails_at_once(serve, tmp_path):
    index = serve({WHEEL: b"x"})
    missing = fetch_wheel.Candidate(WHEEL, index.url.replace("/simple/", "/files/gone.whl"), None, None)
    with pytest.raises(fetch_wheel.FetchError, match="HTTP 404"):
        fetch_wheel.download(missing, tmp_path)


def test_no_wheel_for_the_version_names_the_spec(serve, tmp_path):
    index = serve({WHEEL: b"x", "toy_pkg-1.3.0-py3-none-any.whl": b"y"})
    with pytest.raises(fetch_wheel.FetchError, match="no wheel of toy-pkg==1.2.1"):
        fetch_wheel.fetch("toy-pkg==1.2.1", tmp_path, settings=index.settings())
    for spec in ("toy-pkg", "toy-pkg==1.*"):
        with pytest.raises(fetch_wheel.FetchError, match=f"'{spec}' is not NAME==VERSION with an"
                                                         " exact version".replace("*", r"\*")):
            fetch_wheel.fetch(spec, tmp_path, settings=index.settings())


def test_the_most_specific_supported_wheel_is_chosen():
    from packaging.tags import Tag

    tags = [Tag("cp311", "cp311", "manylinux_2_28_x86_64"), Tag("cp38", "abi3", "manylinux_2_28_x86_64"),
            Tag("py3", "none", "any")]  # sys_tags()' order on CPython 3.11, x86_64
    names = ["toy_pkg-1.2.0-py3-none-any.whl", "toy_pkg-1.2.0-cp38-abi3-manylinux_2_28_x86_64.whl",
             "toy_pkg-1.2.0-cp38-abi3-manylinux_2_28_aarch64.whl",
             "toy_pkg-1.3.0-cp311-cp311-manylinux_2_28_x86_64.whl", "toy_pkg-1.2.0.tar.gz"]
    candidates = [fetch_wheel.Candidate(n, n, None, None) for n in names]
    assert fetch_wheel.best_wheel(candidates, "toy-pkg", "1.2.0", tags).filename == names[1]
    assert fetch_wheel.best_wheel(candidates[:1], "Toy_Pkg", "1.2.0", tags).filename == names[0]
    assert fetch_wheel.best_wheel(candidates[2:], "toy-pkg", "1.2.0", tags) is None


def test_pip_settings_order_env_over_download_over_global():
    settings = {"global.index-url": "https://a/simple", ":env:.index-url": "https://b/simple",
                "global.extra-index-url": "file:///x https://c/simple", "global.find-links": "/w"}
    assert fetch_wheel.index_sources(settings) == (
        ["https://b/simple", "file:///x", "https://c/simple"], ["/w"])
    assert fetch_wheel.index_sources({}) == ([fetch_wheel.DEFAULT_INDEX], [])


def test_a_wheel_in_find_links_is_taken_without_the_network(serve, tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    (links / WHEEL).write_bytes(b"local wheel")
    index = serve({WHEEL: b"remote wheel"})
    path = fetch_wheel.fetch("toy-pkg==1.2.0", tmp_path / "out",
                             settings={**index.settings(), "global.find-links": str(links)})
    assert path.read_bytes() == b"local wheel"
    assert index.ranges == []
