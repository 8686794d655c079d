"""Shared constants and small helpers for the tools/ scripts (stdlib only)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.33.0"
SDIST_NAME = f"vllm-{VLLM_VERSION}.tar.gz"
# The published vllm-0.33.0.tar.gz: the series was made against exactly this file. The
# index's own metadata (its #sha256= fragment) must agree with both values.
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
SDIST_SIZE = 47_101_396

PATCH_DIR = REPO / "patches" / f"vllm-{VLLM_VERSION}"
COMBINED_PATCH = REPO / "patches" / f"vllm-{VLLM_VERSION}-deepinfer.patch"
OVERLAY_PKG = REPO / "overlay" / "vllm" / "deepinfer"
BUILD = Path(os.environ.get("DEEPINFER_BUILD", REPO / "build"))
UPSTREAM_TREE = BUILD / f"vllm-{VLLM_VERSION}"
OVERLAY_OUT = BUILD / "overlay"
UPSTREAM_RECORD = PATCH_DIR / "UPSTREAM"


class ToolError(Exception):
    """A failure the user can act on; printed without a traceback."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_vllm_version(tree: Path) -> str | None:
    """Version of a vLLM source tree or installed package, read without importing it.

    ``tree`` is either the sdist root (holding ``vllm/``) or the ``vllm`` package dir.
    """
    pkg = tree / "vllm" if (tree / "vllm").is_dir() else tree
    vf = pkg / "_version.py"
    if not vf.is_file():
        return None
    for line in vf.read_text().splitlines():
        s = line.replace(" ", "")
        for key in ("__version__=version=", "__version__=", "version="):
            if s.startswith(key):
                return s[len(key):].strip("'\"")
    return None


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def pinned_files(record_path: Path | None = None) -> dict[str, str]:
    """rel path -> pinned upstream sha256 of every file the series touches (UPSTREAM)."""
    f = record_path or UPSTREAM_RECORD
    try:
        rec = json.loads(f.read_text())
        files = rec["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no files")
    except FileNotFoundError:
        raise ToolError(f"{f} missing: the checkout is incomplete (git checkout -- {f.name})") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ToolError(f"{f} is not a valid record ({e}): restore it from git") from None
    return files


def identify_tree(root: Path, files: dict[str, str], what: str) -> str | None:
    """Identity by content: ``root`` (holding ``vllm/``) is the pinned vLLM when every file
    in ``files`` (rel -> sha256) has that sha256, whatever ``vllm/_version.py`` says.

    Refuses (ToolError, naming the files) when any differs or is missing; warns when the
    files match but the version string is absent (a git checkout) or another one (a local
    build such as 0.33.0+cu130). Returns the version string."""
    bad = []
    for rel, want in sorted(files.items()):
        p = root / rel
        if not p.is_file():
            bad.append(f"{rel} (missing)")
        elif sha256_file(p) != want:
            bad.append(f"{rel} (sha256 differs)")
    version = tree_vllm_version(root)
    if bad:
        said = f"says vLLM {version}" if version else "has no vllm/_version.py"
        shown = "; ".join(bad[:6]) + (f"; and {len(bad) - 6} more" if len(bad) > 6 else "")
        raise ToolError(f"{what} {root} ({said}) is not vLLM {VLLM_VERSION} by content: {shown} "
                        f"-- use an unmodified vLLM {VLLM_VERSION}")
    if version != VLLM_VERSION:
        said = f"says vLLM {version}" if version else "has no vllm/_version.py"
        warn(f"{what} {root} {said}, but all {len(files)} files this project changes match "
             f"vLLM {VLLM_VERSION} byte for byte: treating it as {VLLM_VERSION}")
    return version


def load_envs(path: Path | None = None):
    """The overlay's envs.py loaded on its own (stdlib only: no torch, no vLLM)."""
    path = path or OVERLAY_PKG / "envs.py"
    if not path.is_file():
        return None
    name = "_deepinfer_envs_standalone"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look the module up while the class is made
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def check_environment(envs_py: Path | None = None) -> None:
    """Unknown or malformed DEEPINFER_* variables stop a tool before it changes anything."""
    envs = load_envs(envs_py)
    if envs is None:
        return
    found = envs.problems()
    if found:
        raise ToolError("; ".join(found))


def run_main(main) -> None:
    try:
        sys.exit(main())
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # last resort for permissions, read-only or full file systems:
        print(f"error: {e}", file=sys.stderr)  # one line naming the file, no traceback
        sys.exit(2)


def check_writable(dirs, hint: str) -> None:
    """Refuse, naming the first directory (or its nearest existing parent) where a file cannot
    be created; ``hint`` says what to do instead. Nothing is left behind."""
    import tempfile
    seen = set()
    for d in sorted(Path(x) for x in dirs):
        while not d.exists() and d != d.parent:
            d = d.parent
        if d in seen:
            continue
        seen.add(d)
        try:
            fd, name = tempfile.mkstemp(prefix=".deepinfer-probe-", dir=d)
            os.close(fd)
            os.unlink(name)
        except OSError as e:
            raise ToolError(f"{d} is not writable ({e.strerror}): nothing was changed; "
                            f"{hint}") from None
