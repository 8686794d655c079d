"""Shared constants and small helpers for the tools/ scripts (stdlib only)."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.33.0"
SDIST_NAME = f"vllm-{VLLM_VERSION}.tar.gz"
# Pinned in ../shared/DESIGN.md; the index's own metadata must agree with both.
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
SDIST_SIZE = 47_101_396

PATCH_DIR = REPO / "patches" / f"vllm-{VLLM_VERSION}"
COMBINED_PATCH = REPO / "patches" / f"vllm-{VLLM_VERSION}-deepinfer.patch"
OVERLAY_PKG = REPO / "overlay" / "vllm" / "deepinfer"
BUILD = Path(os.environ.get("DEEPINFER_BUILD", REPO / "build"))
UPSTREAM_TREE = BUILD / f"vllm-{VLLM_VERSION}"
OVERLAY_OUT = BUILD / "overlay"


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


def run_main(main) -> None:
    try:
        sys.exit(main())
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
