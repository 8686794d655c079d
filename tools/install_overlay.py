#!/usr/bin/env python3
"""Install the drop-in overlay tree (``make overlay``) into an installed vLLM, or restore it.

    install_overlay.py install [--vllm-dir DIR] [--overlay build/overlay] [--dry-run]
    install_overlay.py restore [--vllm-dir DIR] [--dry-run]
    install_overlay.py status  [--vllm-dir DIR]

``--vllm-dir`` is the installed ``vllm`` package directory (default: the one Python would
import, found without importing it). ``install`` refuses, naming the problem, unless the
installed vLLM is the pinned version and every file it replaces has the pinned upstream
sha256 (from the overlay's MANIFEST.json); it backs up each replaced file under
``<vllm>/.deepinfer-backup/`` before copying, and undoes everything on any failure.
``restore`` puts the backed-up files back and removes ``vllm/deepinfer``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import OVERLAY_OUT, VLLM_VERSION, ToolError, run_main, sha256_file, tree_vllm_version  # noqa: E402

BACKUP = ".deepinfer-backup"
STATE = "state.json"


def find_vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ToolError("no installed vLLM found on this Python's path; pass --vllm-dir")
    return Path(list(spec.submodule_search_locations)[0])


def load_manifest(overlay: Path) -> dict:
    mf = overlay / "MANIFEST.json"
    if not mf.is_file():
        raise ToolError(f"{mf} missing: build the overlay with `make overlay`")
    m = json.loads(mf.read_text())
    if m.get("vllm_version") != VLLM_VERSION:
        raise ToolError(f"{mf} is for vLLM {m.get('vllm_version')}, expected {VLLM_VERSION}")
    for e in m["files"]:
        src = overlay / e["path"]
        if not src.is_file() or sha256_file(src) != e["result_sha256"]:
            raise ToolError(f"overlay file {e['path']} is missing or differs from MANIFEST.json; "
                            "rebuild with `make overlay`")
    return m


def _pkg_rel(path: str) -> str:
    """Manifest paths start with 'vllm/'; the install target is the vllm package dir."""
    if not path.startswith("vllm/"):
        raise ToolError(f"manifest path {path} is outside the vllm package")
    return path[len("vllm/"):]


def plan_install(vllm_dir: Path, manifest: dict) -> list[dict]:
    version = tree_vllm_version(vllm_dir)
    if version != VLLM_VERSION:
        raise ToolError(f"{vllm_dir} is vLLM {version or '(unknown: no _version.py)'}; "
                        f"the overlay is for {VLLM_VERSION}")
    if (vllm_dir / BACKUP).exists():
        raise ToolError(f"{vllm_dir / BACKUP} exists: the overlay is installed already "
                        "(run `restore` first)")
    plan, problems = [], []
    for e in manifest["files"]:
        rel = _pkg_rel(e["path"])
        dst = vllm_dir / rel
        if e["upstream_sha256"] is None:
            if dst.exists():
                problems.append(f"{rel} exists but the overlay adds it (a previous install?)")
            plan.append({"rel": rel, "action": "add"})
        elif not dst.is_file():
            problems.append(f"{rel} is missing from the installed vLLM")
        elif sha256_file(dst) != e["upstream_sha256"]:
            problems.append(f"{rel} has sha256 {sha256_file(dst)[:16]}…, not the pinned "
                            f"vLLM {VLLM_VERSION} file ({e['upstream_sha256'][:16]}…)")
        else:
            plan.append({"rel": rel, "action": "replace"})
    if problems:
        raise ToolError("refusing to install: " + "; ".join(problems))
    return plan


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".deepinfer-tmp")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def install(vllm_dir: Path, overlay: Path, dry_run: bool = False, _fail_after: int | None = None) -> list[dict]:
    manifest = load_manifest(overlay)
    plan = plan_install(vllm_dir, manifest)
    if dry_run:
        return plan
    backup = vllm_dir / BACKUP
    backup.mkdir()
    done: list[dict] = []
    try:
        for i, step in enumerate(plan):
            dst = vllm_dir / step["rel"]
            if step["action"] == "replace":
                _copy_atomic(dst, backup / step["rel"])
            _copy_atomic(overlay / "vllm" / step["rel"], dst)
            done.append(step)
            if _fail_after is not None and i + 1 >= _fail_after:
                raise ToolError("injected failure (test hook)")
        (backup / STATE).write_text(json.dumps({"vllm_version": VLLM_VERSION, "files": plan,
                                                "manifest": manifest}, indent=1))
    except BaseException:
        _undo(vllm_dir, done)
        shutil.rmtree(backup, ignore_errors=True)
        raise
    return plan


def _undo(vllm_dir: Path, steps: list[dict]) -> None:
    backup = vllm_dir / BACKUP
    for step in reversed(steps):
        dst = vllm_dir / step["rel"]
        if step["action"] == "replace":
            _copy_atomic(backup / step["rel"], dst)
        elif dst.exists():
            dst.unlink()
    _prune_empty(vllm_dir / "deepinfer")


def _prune_empty(d: Path) -> None:
    if not d.is_dir():
        return
    for sub in sorted(d.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if sub.is_dir() and sub.name == "__pycache__":
            shutil.rmtree(sub)
        elif sub.is_dir() and not any(sub.iterdir()):
            sub.rmdir()
    if not any(d.iterdir()):
        d.rmdir()


def restore(vllm_dir: Path, dry_run: bool = False) -> list[dict]:
    backup = vllm_dir / BACKUP
    state_f = backup / STATE
    if not state_f.is_file():
        raise ToolError(f"{vllm_dir} has no overlay installed by this tool (no {BACKUP}/{STATE})")
    state = json.loads(state_f.read_text())
    ups = {_pkg_rel(e["path"]): e["upstream_sha256"] for e in state["manifest"]["files"]}
    for step in state["files"]:
        if step["action"] == "replace" and sha256_file(backup / step["rel"]) != ups[step["rel"]]:
            raise ToolError(f"backup of {step['rel']} is corrupt (sha256 mismatch); not restoring")
    if not dry_run:
        _undo(vllm_dir, state["files"])
        shutil.rmtree(backup)
    return state["files"]


def status(vllm_dir: Path) -> str:
    installed = (vllm_dir / BACKUP / STATE).is_file()
    return (f"vLLM {tree_vllm_version(vllm_dir)} at {vllm_dir}: deepinfer overlay "
            f"{'installed' if installed else 'not installed'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("install", "restore", "status"):
        p = sub.add_parser(name)
        p.add_argument("--vllm-dir", type=Path)
        if name != "status":
            p.add_argument("--dry-run", action="store_true")
        if name == "install":
            p.add_argument("--overlay", type=Path, default=OVERLAY_OUT)
    a = ap.parse_args(argv)
    vllm_dir = (a.vllm_dir or find_vllm_dir()).resolve()
    if not vllm_dir.is_dir():
        raise ToolError(f"--vllm-dir {vllm_dir}: no such directory")
    if a.cmd == "status":
        print(status(vllm_dir))
        return 0
    if a.cmd == "install":
        steps = install(vllm_dir, a.overlay, a.dry_run)
    else:
        steps = restore(vllm_dir, a.dry_run)
    verb = {"install": "install", "restore": "restore"}[a.cmd]
    for s in steps:
        print(f"{'would ' if a.dry_run else ''}{verb}: {s['action']:7s} vllm/{s['rel']}")
    print(f"{'dry run: nothing changed' if a.dry_run else 'done'} ({len(steps)} files, {vllm_dir})")
    return 0


if __name__ == "__main__":
    run_main(main)
