#!/usr/bin/env python3
"""Fetch, verify, cache and extract the pinned vLLM sdist.

    python tools/upstream.py fetch [--sdist PATH | --tree PATH] [--dest DIR] [--force]

The sdist is looked up through the package client's configured indexes (pip's
``index-url`` / ``extra-index-url`` from ``pip config`` or ``PIP_INDEX_URL`` /
``PIP_EXTRA_INDEX_URL``; pip's own default when none is configured), never a
hard-coded host. ``pip download`` cannot be used: it prepares the sdist's
metadata, which imports torch and setuptools_rust. Offline overrides:
``--sdist``/``DEEPINFER_VLLM_SDIST`` (a tarball) and ``--tree``/``DEEPINFER_VLLM_TREE``
(an extracted tree).

The result is ``build/vllm-0.33.0``: a git repository with one baseline commit of
the pristine sdist. Every failure (checksum, size, content, dirty target) stops
before anything is written to the destination. A ``--tree`` is identified by content: the
files the series touches must have the pinned sha256 (patches/vllm-0.33.0/UPSTREAM),
whatever its version string says (another string, or none, only warns).
"""
from __future__ import annotations

import argparse
import html.parser
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    SDIST_NAME, SDIST_SHA256, SDIST_SIZE, UPSTREAM_TREE, VLLM_VERSION, ToolError,
    identify_tree, pinned_files, run_main, sha256_file,
)

CACHE = Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer"))
BASELINE_MSG = f"vLLM {VLLM_VERSION} sdist (pristine baseline)"


# --------------------------------------------------------------------------- index lookup
def configured_indexes() -> list[str]:
    """Index URLs in pip's order: index-url first, then extra-index-urls."""
    primary: list[str] = []
    extra: list[str] = []
    if os.environ.get("PIP_INDEX_URL"):
        primary = os.environ["PIP_INDEX_URL"].split()
    if os.environ.get("PIP_EXTRA_INDEX_URL"):
        extra = os.environ["PIP_EXTRA_INDEX_URL"].split()
    if not primary or not extra:
        try:
            out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                                 capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            key, _, val = line.partition("=")
            val = val.strip().strip("'\"")
            if key.endswith(".index-url") and not key.endswith("extra-index-url") and not primary:
                primary = val.split()
            elif key.endswith(".extra-index-url") and not extra:
                extra = val.split()
    if not primary:
        try:  # pip's own default, so no host is written down here
            from pip._internal.models.index import PyPI
            primary = [PyPI.simple_url]
        except Exception:  # pragma: no cover - pip without that module
            pass
    return primary + extra


class _Anchors(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def find_sdist_url(index: str) -> tuple[str, str | None, int | None]:
    """Return (url, sha256 from the index or None, size or None) for the pinned sdist."""
    page = index.rstrip("/") + "/vllm/"
    if page.startswith("file:"):  # a local index: a directory holding index.html
        local = Path(urllib.request.url2pathname(urllib.parse.urlparse(page).path))
        body, ctype = (local / "index.html").read_bytes(), "text/html"
    else:
        req = urllib.request.Request(page, headers={
            "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
        with urllib.request.urlopen(req, timeout=120) as r:
            body = r.read()
            ctype = r.headers.get("Content-Type", "")
    if "json" in ctype:
        for f in json.loads(body)["files"]:
            if f["filename"] == SDIST_NAME:
                return (urllib.parse.urljoin(page, f["url"]), f.get("hashes", {}).get("sha256"),
                        f.get("size"))
    else:
        p = _Anchors()
        p.feed(body.decode("utf-8", "replace"))
        for text, href in p.links:
            if text == SDIST_NAME or href.split("#")[0].endswith("/" + SDIST_NAME):
                url, _, frag = href.partition("#")
                sha = frag[len("sha256="):] if frag.startswith("sha256=") else None
                return urllib.parse.urljoin(page, url), sha, None
    raise LookupError(f"{SDIST_NAME} not listed at {page}")


def download_sdist(dest: Path) -> None:
    errors = []
    for index in configured_indexes():
        try:
            url, sha, size = find_sdist_url(index)
        except Exception as e:  # try the next configured index
            errors.append(f"{index}: {e}")
            continue
        if sha is not None and sha != SDIST_SHA256:
            raise ToolError(f"index {index} lists {SDIST_NAME} with sha256 {sha}, "
                            f"expected the pinned {SDIST_SHA256}")
        if size is not None and size != SDIST_SIZE:
            raise ToolError(f"index {index} lists {SDIST_NAME} with size {size}, "
                            f"expected the pinned {SDIST_SIZE}")
        print(f"downloading {SDIST_NAME} via {index}", file=sys.stderr)
        tmp = dest.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        try:
            verify_sdist(tmp)
        except ToolError:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(dest)
        return
    raise ToolError(f"no configured index serves {SDIST_NAME}: " + "; ".join(errors)
                    + " (offline: pass --sdist PATH or --tree PATH)")


def verify_sdist(path: Path) -> None:
    size = path.stat().st_size
    if size != SDIST_SIZE:
        raise ToolError(f"{path}: size {size} bytes, expected {SDIST_SIZE} for {SDIST_NAME}")
    digest = sha256_file(path)
    if digest != SDIST_SHA256:
        raise ToolError(f"{path}: sha256 {digest} does not match the pinned {SDIST_SHA256}")


def cached_sdist(sdist: Path | None) -> Path:
    if sdist is not None:
        if not sdist.is_file():
            raise ToolError(f"--sdist {sdist}: no such file")
        verify_sdist(sdist)
        return sdist
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / SDIST_NAME
    if path.is_file():
        try:
            verify_sdist(path)
            return path
        except ToolError as e:
            print(f"cached copy rejected ({e}); downloading again", file=sys.stderr)
            path.unlink()
    download_sdist(path)
    return path


# --------------------------------------------------------------------------- extraction
def git(tree: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_AUTHOR_NAME="deepinfer", GIT_AUTHOR_EMAIL="deepinfer@localhost",
               GIT_COMMITTER_NAME="deepinfer", GIT_COMMITTER_EMAIL="deepinfer@localhost")
    return subprocess.run(["git", "-c", "safe.directory=*", "-C", str(tree), *args],
                          capture_output=True, text=True, check=check, env=env)


def is_baseline_repo(tree: Path) -> bool:
    if not (tree / ".git").exists():
        return False
    log = git(tree, "log", "--format=%s", check=False).stdout.splitlines()
    return log[-1:] == [BASELINE_MSG]


def check_target(dest: Path, force: bool) -> str:
    """'create', 'keep' (a clean baseline exists) or raise on a dirty/foreign target."""
    if not dest.exists():
        return "create"
    if not is_baseline_repo(dest):
        raise ToolError(f"{dest} exists and is not a tree made by this tool; move it away")
    dirty = git(dest, "status", "--porcelain", "--untracked-files=all").stdout.strip()
    head_is_base = git(dest, "rev-list", "--count", "HEAD").stdout.strip() == "1"
    if dirty or not head_is_base:
        if not force:
            what = "uncommitted changes" if dirty else "commits on top of the baseline"
            raise ToolError(f"{dest} has {what} (git -C {dest} status); "
                            "refresh or save them, or pass --force to discard them")
        return "create"
    return "keep"


def extract_tree(src_tar: Path | None, src_tree: Path | None, dest: Path) -> None:
    """Build the baseline repo in a temp dir beside ``dest`` and rename it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".vllm-extract-", dir=dest.parent))
    try:
        root = tmp / "tree"
        if src_tar is not None:
            with tarfile.open(src_tar) as tf:
                top = f"vllm-{VLLM_VERSION}/"
                members = [m for m in tf.getmembers() if m.name.startswith(top)]
                for m in members:
                    m.name = m.name[len(top):]
                    m.uid = m.gid = 0
                    m.uname = m.gname = ""
                members = [m for m in members if m.name]
                tf.extractall(root, members=members, filter="data")
        else:
            shutil.copytree(src_tree, root, ignore=shutil.ignore_patterns(".git"))
        if src_tar is None:  # a tarball was checked by its sha256 already
            identify_tree(root, pinned_files(), "--tree")
        git(root, "init", "-q")
        # No automatic gc or maintenance in this repository: the baseline commit below (or a
        # later one in a copy of it) may start a detached `git gc --auto` that packs the loose
        # objects while `make patched` copies the tree with cp -r, and the copy fails on the
        # objects that vanished under it ("cp: cannot stat .git/objects/..": seen in a make
        # verify whose kit build loaded the same 2 cores).
        git(root, "config", "gc.auto", "0")
        git(root, "config", "maintenance.auto", "false")
        git(root, "add", "-A", "-f")  # the sdist's .gitignore hides vllm/_version.py & co.
        git(root, "commit", "-q", "--no-verify", "-m", BASELINE_MSG)
        if dest.exists():
            shutil.rmtree(dest)
        root.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch(sdist: Path | None, tree: Path | None, dest: Path, force: bool) -> Path:
    sdist = sdist or (Path(os.environ["DEEPINFER_VLLM_SDIST"]) if os.environ.get("DEEPINFER_VLLM_SDIST") else None)
    tree = tree or (Path(os.environ["DEEPINFER_VLLM_TREE"]) if os.environ.get("DEEPINFER_VLLM_TREE") else None)
    if sdist and tree:
        raise ToolError("give either --sdist or --tree, not both")
    if tree is not None:
        if not tree.is_dir():
            raise ToolError(f"--tree {tree}: no such directory")
        # identity by content: the files the series touches must be the pinned ones (a git
        # checkout has no vllm/_version.py; a local build says e.g. 0.33.0+cu130)
        identify_tree(tree, pinned_files(), "--tree")
    action = check_target(dest, force)
    if action == "keep":
        print(f"{dest}: clean baseline of vLLM {VLLM_VERSION} already present")
        return dest
    src_tar = None if tree is not None else cached_sdist(sdist)
    extract_tree(src_tar, tree, dest)
    print(f"{dest}: vLLM {VLLM_VERSION} extracted, baseline committed")
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="fetch + verify + extract the pinned sdist")
    f.add_argument("--sdist", type=Path, help="offline: path to vllm-0.33.0.tar.gz")
    f.add_argument("--tree", type=Path, help="offline: path to an extracted vllm-0.33.0 tree")
    f.add_argument("--dest", type=Path, default=UPSTREAM_TREE)
    f.add_argument("--force", action="store_true", help="discard changes in an existing --dest")
    sub.add_parser("indexes", help="print the index URLs that would be tried")
    a = ap.parse_args(argv)
    if a.cmd == "indexes":
        print("\n".join(configured_indexes()))
        return 0
    fetch(a.sdist, a.tree, a.dest, a.force)
    return 0


if __name__ == "__main__":
    run_main(main)
