"""Download one wheel, resuming after a dropped connection: python scripts/fetch_wheel.py NAME==VERSION DIR.

`pip download` restarts a 336 MB wheel (vLLM 0.33.0) from zero when the connection drops and
then fails with a bare traceback; this fetches the same file pip would pick (the best wheel for
this interpreter's tags, from pip's own index and find-links settings), continues an interrupted
transfer with HTTP Range requests, checks the index's sha256, and says why when it cannot
(no such wheel, not enough disk, the index unreachable after every attempt).  Prints the
wheel's path as its last line.  Falls back to `pip download` (retried) for an index it cannot
read as a PEP 503 / 691 simple index.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

try:
    from packaging.tags import sys_tags
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
    from packaging.version import InvalidVersion, Version
except ImportError:  # a bare interpreter: pip's vendored copy
    from pip._vendor.packaging.tags import sys_tags  # type: ignore
    from pip._vendor.packaging.utils import (  # type: ignore
        InvalidWheelFilename,
        canonicalize_name,
        parse_wheel_filename,
    )
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore

DEFAULT_INDEX = "https://pypi.org/simple/"
UNPACK_HEADROOM = 256 * 2**20  # the unpacked Python beside the wheel (vLLM 0.33.0: 56 MB)
CHUNK = 2**20
#: What a dropped or garbled transfer raises (``IncompleteRead``, ``RemoteDisconnected``...).
TRANSFER_ERRORS = (OSError, urllib.error.URLError, http.client.HTTPException)
ACCEPT = ("application/vnd.pypi.simple.v1+json, "
          "application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1")


class FetchError(Exception):
    """Why the wheel could not be fetched (printed as one line)."""


@dataclass(frozen=True)
class Candidate:
    filename: str
    url: str
    sha256: str | None
    size: int | None

    def _replace_url(self, url: str) -> Candidate:
        return Candidate(self.filename, url, self.sha256, self.size)


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (href, text)
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href, self._text = dict(attrs).get("href"), []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def parse_index_page(body: bytes, content_type: str, page_url: str) -> list[Candidate]:
    """The files a PEP 691 (JSON) or PEP 503 (HTML) project page lists."""
    if "json" in content_type:
        files = json.loads(body)["files"]
        return [Candidate(f["filename"], urllib.parse.urljoin(page_url, f["url"]),
                          f.get("hashes", {}).get("sha256"), f.get("size"))
                for f in files]
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    found = []
    for href, text in parser.links:
        url, _, fragment = href.partition("#")
        sha256 = fragment[len("sha256="):] if fragment.startswith("sha256=") else None
        filename = text or urllib.parse.unquote(url.rsplit("/", 1)[-1])
        found.append(Candidate(filename, urllib.parse.urljoin(page_url, url), sha256, None))
    return found


def best_wheel(candidates: list[Candidate], name: str, version: str,
               tags: list | None = None) -> Candidate | None:
    """The wheel of NAME==VERSION whose most specific tag this interpreter supports (pip's choice)."""
    rank = {tag: i for i, tag in enumerate(tags if tags is not None else sys_tags())}
    wanted_name, wanted_version = canonicalize_name(name), Version(version)
    best: tuple[int, Candidate] | None = None
    for candidate in candidates:
        if not candidate.filename.endswith(".whl"):
            continue
        try:
            wheel_name, wheel_version, _, wheel_tags = parse_wheel_filename(candidate.filename)
        except InvalidWheelFilename:
            continue
        if wheel_name != wanted_name or wheel_version != wanted_version:
            continue
        score = min((rank[t] for t in wheel_tags if t in rank), default=None)
        if score is not None and (best is None or score < best[0]):
            best = (score, candidate)
    return best[1] if best else None


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective configuration (`pip config list`), environment variables included."""
    try:
        out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                             text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    settings: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:  # pip prints each value as a Python literal: 'a\nb' for a multi-line one
            try:
                parsed = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                parsed = value.strip().strip("'\"")
            settings[key.strip()] = str(parsed)
    return settings


def index_sources(settings: dict[str, str]) -> tuple[list[str], list[str]]:
    """(index URLs, find-links locations) in the order pip consults them."""
    def setting(option: str) -> str | None:
        for scope in (":env:", "download", "global"):
            if f"{scope}.{option}" in settings:
                return settings[f"{scope}.{option}"]
        return None
    indexes = [setting("index-url") or DEFAULT_INDEX] + (setting("extra-index-url") or "").split()
    if (setting("no-index") or "").lower() in ("1", "true", "yes", "on"):
        indexes = []
    return indexes, (setting("find-links") or "").split()


def redact(url: str) -> str:
    """``url`` without its password or token, as pip prints it."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    user, _, host = parts.netloc.rpartition("@")
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user.split(':')[0]}:****@{host}"))


def _request(url: str, headers: dict[str, str]) -> urllib.request.Request:
    """A request for ``url``, its user:password (a private index's) sent as Basic auth."""
    parts = urllib.parse.urlsplit(url)
    if "@" in parts.netloc:
        userinfo, _, host = parts.netloc.rpartition("@")
        user, _, password = userinfo.partition(":")
        token = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
        headers = {**headers, "Authorization": "Basic " + base64.b64encode(token.encode()).decode()}
        url = urllib.parse.urlunsplit(parts._replace(netloc=host))
    return urllib.request.Request(url, headers=headers)


def local_candidates(location: str) -> list[Candidate]:
    path = Path(urllib.parse.urlparse(location).path if location.startswith("file:") else location)
    if not path.is_dir():
        return []
    return [Candidate(p.name, p.as_uri(), None, p.stat().st_size) for p in path.glob("*.whl")]


def index_candidates(index: str, name: str, timeout: float) -> list[Candidate]:
    if index.startswith("file:"):
        page = Path(urllib.parse.urlparse(index).path) / canonicalize_name(name)
        index_html = page / "index.html"
        if not index_html.is_file():
            return []
        return parse_index_page(index_html.read_bytes(), "text/html", index_html.as_uri())
    page_url = index.rstrip("/") + "/" + canonicalize_name(name) + "/"
    with urllib.request.urlopen(_request(page_url, {"Accept": ACCEPT}),
                                timeout=timeout) as response:
        found = parse_index_page(response.read(), response.headers.get("Content-Type", ""),
                                 response.geturl())
    base = urllib.parse.urlsplit(page_url)
    if "@" not in base.netloc:
        return found
    # files on the index's own host need its credentials too
    host = base.netloc.rpartition("@")[2]
    return [c if urllib.parse.urlsplit(c.url).netloc != host else c._replace_url(
        urllib.parse.urlunsplit(urllib.parse.urlsplit(c.url)._replace(netloc=base.netloc)))
        for c in found]


def log(message: str) -> None:
    print(f"fetch_wheel: {message}", file=sys.stderr, flush=True)


def check_space(directory: Path, needed: int, filename: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed + UNPACK_HEADROOM:
        raise FetchError(
            f"{filename} needs {needed / 2**20:.0f} MiB (+ {UNPACK_HEADROOM / 2**20:.0f} MiB to "
            f"unpack) in {directory}, which has {free / 2**20:.0f} MiB free")


def download(candidate: Candidate, directory: Path, attempts: int = 6, timeout: float = 60.0,
              backoff: float = 2.0) -> Path:
    """CANDIDATE into DIRECTORY, resuming across dropped connections; the sha256 is checked."""
    target = directory / candidate.filename
    partial = target.with_name(target.name + ".part")
    if candidate.url.startswith("file:"):
        shutil.copyfile(urllib.parse.urlparse(candidate.url).path, partial)
    else:
        total = candidate.size
        if total is not None:
            check_space(directory, total - (partial.stat().st_size if partial.exists() else 0),
                        candidate.filename)
        failures: list[str] = []  # attempts in a row that moved nothing
        while True:
            have = partial.stat().st_size if partial.exists() else 0
            started = have
            if total is not None and have == total:
                break
            headers = {"Range": f"bytes={have}-"} if have else {}
            try:
                with urllib.request.urlopen(_request(candidate.url, headers),
                                            timeout=timeout) as response:
                    resumed = response.status == 206
                    length = int(response.headers.get("Content-Length", "-1"))
                    if total is None and length >= 0:
                        total = length + (have if resumed else 0)
                        check_space(directory, total - (have if resumed else 0), candidate.filename)
                    with open(partial, "ab" if resumed else "wb") as out:
                        while chunk := response.read(CHUNK):
                            out.write(chunk)
                have = partial.stat().st_size
                if total is None or have == total:
                    break
                raise OSError(f"connection closed at {have:,} of {total:,} bytes")
            except urllib.error.HTTPError as error:
                if error.code == 416 and have:  # range past the end: the .part is stale
                    partial.unlink()
                    continue
                if error.code not in (408, 429) and error.code < 500:
                    raise FetchError(f"{redact(candidate.url)}: HTTP {error.code} "
                                     f"{error.reason}") from None
                failures.append(f"HTTP {error.code}")
            except TRANSFER_ERRORS as error:
                failures.append(f"{type(error).__name__}: {getattr(error, 'reason', error)}")
            if partial.exists() and partial.stat().st_size > started:
                failures = failures[-1:]  # this attempt moved the transfer on
            if len(failures) >= attempts:
                raise FetchError(f"{candidate.filename}: {attempts} attempts in a row failed "
                                 f"(last: {failures[-1]}); rerun to resume from "
                                 f"{partial.stat().st_size if partial.exists() else 0:,} bytes")
            wait = min(backoff * 2 ** (len(failures) - 1), 30.0)
            log(f"{candidate.filename}: {failures[-1]}; resuming in {wait:.0f} s "
                f"(attempt {len(failures) + 1} of {attempts})")
            time.sleep(wait)
    if candidate.sha256 is not None:
        digest = hashlib.sha256()
        with open(partial, "rb") as data:
            while chunk := data.read(CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != candidate.sha256:
            partial.unlink()
            raise FetchError(f"{candidate.filename}: sha256 {digest.hexdigest()} is not the "
                             f"index's {candidate.sha256}; the partial download was removed")
    partial.replace(target)
    return target


def pip_download(python: str, spec: str, directory: Path, attempts: int = 3) -> Path:
    name, _, version = spec.partition("==")
    for attempt in range(1, attempts + 1):
        done = subprocess.run([python, "-m", "pip", "download", "--quiet", "--no-deps",
                               "--only-binary=:all:", "--dest", str(directory), spec], check=False)
        found = best_wheel([Candidate(p.name, p.as_uri(), None, None)
                            for p in directory.glob("*.whl")], name, version)
        if done.returncode == 0 and found is not None:  # pip skips a wheel already there
            return directory / found.filename
        log(f"pip download {spec} failed (attempt {attempt} of {attempts})")
        time.sleep(5 * attempt)
    raise FetchError(f"pip download {spec} failed {attempts} times")


def fetch(spec: str, directory: Path, python: str = sys.executable,
          settings: dict[str, str] | None = None) -> Path:
    name, sep, version = spec.partition("==")
    try:
        Version(version)
    except InvalidVersion:
        sep = ""
    if not sep or not name or not version:
        raise FetchError(f"{spec!r} is not NAME==VERSION with an exact version (e.g. vllm==0.33.0)")
    directory.mkdir(parents=True, exist_ok=True)
    indexes, find_links = index_sources(pip_settings(python) if settings is None else settings)
    for location in find_links:
        local = best_wheel(local_candidates(location), name, version)
        if local is not None:
            log(f"{local.filename} from find-links {location}")
            return download(local, directory)
    unreadable = []
    for index in indexes:
        try:
            candidates = index_candidates(index, name, timeout=60.0)
        except (*TRANSFER_ERRORS, ValueError, KeyError) as error:
            unreadable.append(f"{redact(index)} ({getattr(error, 'reason', error)})")
            continue
        wheel = best_wheel(candidates, name, version)
        if wheel is not None:
            size = f" ({wheel.size / 2**20:.0f} MiB)" if wheel.size else ""
            log(f"{wheel.filename}{size} from {redact(index)}")
            return download(wheel, directory)
    if unreadable:
        log("could not read " + "; ".join(unreadable) + "; trying pip download")
        return pip_download(python, spec, directory)
    where = ", ".join(map(redact, indexes + find_links)) or "no index (pip's no-index)"
    raise FetchError(f"no wheel of {spec} for this interpreter ({next(iter(sys_tags()))}) "
                     f"on {where}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/fetch_wheel.py NAME==VERSION DIR", file=sys.stderr)
        return 2
    try:
        print(fetch(argv[0], Path(argv[1]), python=os.environ.get("PY", sys.executable)))
    except FetchError as error:
        log(str(error))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
