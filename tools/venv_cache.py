#!/usr/bin/env python3
"""Build the test virtual environment once per set of requirements, not once per clone
(stdlib only; ``make venv`` runs it).

    python tools/venv_cache.py --venv .venv --stage NAME --key-file F [--key-file F ...] \\
        [--cache DIR] -- PIP_INSTALL_ARGS...

A stage is one ``pip install PIP_INSTALL_ARGS`` into the environment, recorded by the stamp
``VENV/.ok`` (stage ``ok``) or ``VENV/.ok-NAME``, which holds the sha256 of the stage's
arguments and the contents of the files they name (``-r F``). A stage whose stamp matches
is not installed again.

With ``--cache DIR`` (the Makefile passes ``$(DEEPINFER_CACHE)/venvs``) the environment
itself lives in ``DIR/venv-KEY`` and ``VENV`` is a symbolic link to it. KEY is the sha256 of
the Python version and the ``--key-file`` files (every requirements file of every stage), so
a fresh clone on a machine that already built the same requirements links the finished
environment instead of reinstalling it (pip's download cache saves the downloads only;
unpacking torch, Triton and TileLang is most of an install). A changed requirements file
gives a new KEY and a new environment; the ``KEEP`` most recently used are kept. A ``VENV``
that is a real directory (an older checkout, or ``--cache ''``) is installed into in place,
as ``python -m venv`` + ``pip install`` always did. Concurrent builds of one KEY wait on a
lock; a build that died midway (no ``.created`` stamp) is removed and redone.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Keyed environments kept in the cache (about 2.2 GB each): the current requirements, the
# previous ones (a branch switched back) and one more; older ones are deleted.
KEEP = 3


def _stage_hash(pip_args: list[str], cwd: Path) -> str:
    h = hashlib.sha256()
    for i, a in enumerate(pip_args):
        h.update(a.encode() + b"\0")
        if i and pip_args[i - 1] in ("-r", "--requirement", "-c", "--constraint"):
            h.update((cwd / a).read_bytes())
    return h.hexdigest()


def venv_key(key_files: list[Path]) -> str:
    h = hashlib.sha256(sys.version.encode() + sys.platform.encode() + b"\0")
    for f in key_files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _stamp(env: Path, stage: str) -> Path:
    return env / (".ok" if stage == "ok" else f".ok-{stage}")


def _run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _create(env: Path) -> None:
    if env.is_symlink() or env.is_file():
        env.unlink()
    elif env.exists() and not (env / ".created").is_file():
        shutil.rmtree(env)  # a build that died before it finished creating the venv
    if not (env / ".created").is_file():
        _run([sys.executable, "-m", "venv", str(env)])
        _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--upgrade", "pip"])
        (env / ".created").write_text("")


def _link(link: Path, target: Path) -> None:
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    if link.exists() and not link.is_symlink():
        raise SystemExit(f"venv_cache: {link} is a real directory; not replacing it")
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)


def prune(cache: Path, keep: int = KEEP, current: Path | None = None) -> list[Path]:
    """Delete keyed environments beyond the ``keep`` most recently used (by their newest
    stamp); one being built or used right now (its lock held) is left alone."""
    envs = [p for p in cache.glob("venv-*") if p.is_dir() and not p.is_symlink()]

    def last_use(p: Path) -> float:
        stamps = list(p.glob(".ok*")) + [p / ".created"]
        return max((s.stat().st_mtime for s in stamps if s.exists()), default=0.0)

    envs.sort(key=last_use, reverse=True)
    gone = []
    for p in envs[keep:]:
        if current is not None and p == current:
            continue
        with open(cache / f"{p.name}.lock", "w") as lk:
            try:
                fcntl.flock(lk, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def ensure(venv: Path, stage: str, pip_args: list[str], key_files: list[Path],
           cache: Path | None, cwd: Path) -> Path:
    """Make ``venv`` hold stage ``stage``; returns the directory installed into."""
    want = _stage_hash(pip_args, cwd)
    if cache is not None and (venv.is_symlink() or not venv.exists()):
        cache.mkdir(parents=True, exist_ok=True)
        env = cache / f"venv-{venv_key(key_files)}"
        lock_path = cache / f"{env.name}.lock"
    else:
        env = venv
        # beside nothing in the checkout: a lock file there would show as untracked
        lock_path = Path(tempfile.gettempdir()) / (
            "deepinfer-venv-" + hashlib.sha256(str(venv).encode()).hexdigest()[:16] + ".lock")
    with open(lock_path, "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        stamp = _stamp(env, stage)
        if not (stamp.is_file() and stamp.read_text().strip() == want):
            if env == venv and not (venv / "bin" / "python").exists():
                _run([sys.executable, "-m", "venv", str(env)])
                _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--upgrade",
                      "pip"])
                (env / ".created").write_text("")
            elif env != venv:
                _create(env)
            t0 = time.time()
            _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", *pip_args])
            stamp.write_text(want + "\n")
            print(f"venv_cache: stage {stage} installed into {env} in {time.time() - t0:.0f} s",
                  flush=True)
        else:
            stamp.touch()  # newer than its inputs for make; a recent use for prune()
            print(f"venv_cache: stage {stage} already in {env}", flush=True)
        if env != venv:
            _link(venv, env)
    if cache is not None and env != venv:
        for p in prune(cache, current=env):
            print(f"venv_cache: removed unused {p}", flush=True)
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, required=True)
    ap.add_argument("--stage", required=True, help="ok (the .ok stamp) or a name (.ok-NAME)")
    ap.add_argument("--key-file", type=Path, action="append", default=[],
                    help="a requirements file of any stage (the cached venv's key)")
    ap.add_argument("--cache", default="", help="keyed venvs live here ('' : no cache)")
    ap.add_argument("pip_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    pip_args = a.pip_args[1:] if a.pip_args[:1] == ["--"] else a.pip_args
    if not pip_args:
        ap.error("nothing to install: give pip's arguments after --")
    if a.cache and not a.key_file:
        ap.error("--cache needs --key-file (what the cached venv is keyed by)")
    venv = Path(os.path.abspath(a.venv))
    ensure(venv, a.stage, pip_args, [Path(f) for f in a.key_file],
           Path(os.path.abspath(os.path.expanduser(a.cache))) if a.cache else None, Path.cwd())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
