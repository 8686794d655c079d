"""A small fake installed vLLM and a matching overlay, for the installer's fault-injection and
bad-input tests: three files replaced (one in the package root, two in nested directories,
with different modes), three added in a new package with a subdirectory, and one untouched
file. Small so that killing the installer at every step stays fast; shaped like the real
overlay (tools/install_overlay.py reads nothing else).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import subproc

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"

UPSTREAM = {"a.py": ("x = 1\n", 0o644), "sub/b.py": ("y = 2\n", 0o755),
            "sub/deep/c.py": ("z = 3\n", 0o600)}
PATCHED = {"a.py": "x = 1  # patched\n", "sub/b.py": "y = 2  # patched\n",
           "sub/deep/c.py": "z = 3  # patched\n"}
ADDED = {"deepinfer/__init__.py": "", "deepinfer/z.py": "ours = True\n",
         "deepinfer/x/y.py": "deeper = True\n"}
UNTOUCHED = {"untouched.py": "keep = 1\n"}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def make_site(root: Path, version: str | None = "0.33.0") -> Path:
    """``root``/vllm as an installed vLLM package; returns the vllm dir."""
    vllm = root / "vllm"
    for rel, (text, mode) in UPSTREAM.items():
        p = vllm / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        os.chmod(p, mode)
    for rel, text in UNTOUCHED.items():
        (vllm / rel).write_text(text)
    if version is not None:
        (vllm / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    return vllm


def make_overlay(root: Path) -> Path:
    """An overlay dir (vllm/... + MANIFEST.json) for the fake site; returns it."""
    entries = []
    for rel, text in PATCHED.items():
        entries.append({"path": f"vllm/{rel}", "upstream_sha256": _sha(UPSTREAM[rel][0]),
                        "result_sha256": _sha(text)})
    for rel, text in ADDED.items():
        entries.append({"path": f"vllm/{rel}", "upstream_sha256": None, "result_sha256": _sha(text)})
    for rel, text in {**PATCHED, **ADDED}.items():
        p = root / "vllm" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (root / "MANIFEST.json").write_text(json.dumps(
        {"vllm_version": "0.33.0", "series": ["fake"], "files": entries}, indent=1))
    return root


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (hidden ones, directories and modes included)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        rel = str(p.relative_to(root))
        if stat.S_ISDIR(st.st_mode):
            out[rel] = ("dir", stat.S_IMODE(st.st_mode))
        else:
            out[rel] = ("file", stat.S_IMODE(st.st_mode), hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, symlinks=True)  # copy2: modes kept


def run_tool(tool: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subproc.run([sys.executable, str(TOOLS / tool), *args], env=env, cap=120)


def clean_env(**extra) -> dict:
    """The environment minus every DEEPINFER_* variable (plus ``extra``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env.update(extra)
    return env


# Runs install_overlay.main(argv) and SIGKILLs itself at the Nth checkpoint (0: never),
# or at the Nth checkpoint whose label starts with a given prefix; prints the count.
KILL_DRIVER = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import install_overlay as io
io.FSYNC = False  # a killed process needs no fsync; it only costs time
kill_at, prefix, skip = int(sys.argv[2]), sys.argv[3], sys.argv[4]
n = 0
def checkpoint(label):
    global n
    if label.startswith(prefix) and not (skip and skip in label):
        n += 1
        if n == kill_at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
io._checkpoint = checkpoint
rc = io.main(sys.argv[5:])
print("CHECKPOINTS", n)
sys.exit(rc)
"""


def run_killed(kill_at: int, argv: list[str], prefix: str = "", skip: str = "") -> subprocess.CompletedProcess:
    return subproc.run([sys.executable, "-c", KILL_DRIVER, str(TOOLS), str(kill_at), prefix,
                        skip, *argv], env=clean_env(), cap=120)
