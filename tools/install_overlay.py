#!/usr/bin/env python3
"""Install the drop-in overlay tree (``make overlay``) into an installed vLLM, or restore it.

    install_overlay.py install [--vllm-dir DIR] [--overlay build/overlay] [--dry-run]
    install_overlay.py restore [--vllm-dir DIR] [--dry-run] [--force]
    install_overlay.py status  [--vllm-dir DIR] [--overlay build/overlay]
    install_overlay.py mounts  --site DIR [--overlay build/overlay]   # docker -v flags

``--vllm-dir`` is the installed ``vllm`` package directory (default: the one Python would
import, found without importing it).

``install`` refuses, naming the problem, unless every file it replaces has the pinned
upstream sha256 (from the overlay's MANIFEST.json; the version string only earns a warning
when the files match), every file it adds is absent, and every directory it writes is
writable (``--dry-run`` makes all of these checks). It is crash-safe: before the first
copy it writes an intent journal, ``<vllm>/.deepinfer-install.json`` (every step with the
sha256 before and after), then backs up each replaced file under ``<vllm>/.deepinfer-backup/``
and copies each file through a temporary file and a rename, checking its sha256. Killed at
any point (even SIGKILL), the journal tells ``status`` that the install is partial,
``install`` resumes it, and ``restore`` undoes it; both work from the files' hashes, so they
can themselves be interrupted and run again. ``restore`` puts the backed-up files back,
removes what was added and leaves the tree byte-identical to before.

``status`` exits 0 when the overlay is in place (installed, or bind-mounted / copied and
matching MANIFEST.json), 1 when it is not installed, 3 when the tree needs action (a partial
install or restore, or files changed since); bad input exits 2 like every command.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    OVERLAY_OUT, OVERLAY_PKG, VLLM_VERSION, ToolError, check_environment, check_writable, run_main,
    sha256_file,
    tree_vllm_version, warn,
)

JOURNAL = ".deepinfer-install.json"
BACKUP = ".deepinfer-backup"
LEGACY_STATE = "state.json"  # the journal-less format of earlier versions, inside BACKUP
TMP_SUFFIX = ".deepinfer-tmp"
JOURNAL_FORMAT = 1
# Added files and directories: world-readable (site-packages is read by every user).
FILE_MODE, DIR_MODE = 0o644, 0o755
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

STATUS_ACTIVE, STATUS_ABSENT, STATUS_NEEDS_ACTION = 0, 1, 3
# fsync each copy and the journal before the rename that publishes it, so that after a power
# loss the journal never points at a backup that is not on disk. A killed process needs no
# fsync (the kernel keeps its writes); the kill tests switch it off to stay fast.
FSYNC = True


def _checkpoint(label: str) -> None:
    """Called after every change on disk ("written/copied/in place/made/removed PATH");
    tests replace it to kill the process there (tests/test_install_reliability.py)."""


# --------------------------------------------------------------------------- inputs
def find_vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ToolError("no installed vLLM found on this Python's path; pass --vllm-dir")
    return Path(list(spec.submodule_search_locations)[0])


def load_manifest(overlay: Path, verify_files: bool = True) -> dict:
    """MANIFEST.json, checked field by field (and, by default, every overlay file's sha256)."""
    if not overlay.is_dir():
        raise ToolError(f"--overlay {overlay}: no such directory; build it with `make overlay`")
    mf = overlay / "MANIFEST.json"
    if not mf.is_file():
        raise ToolError(f"{mf} missing: build the overlay with `make overlay`")
    try:
        m = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise ToolError(f"{mf} is not valid JSON ({e.msg} at line {e.lineno}): "
                        "rebuild it with `make overlay`") from None
    except UnicodeDecodeError:
        raise ToolError(f"{mf} is not UTF-8 text: rebuild it with `make overlay`") from None
    bad = _manifest_problem(m)
    if bad:
        raise ToolError(f"{mf} is malformed ({bad}): rebuild it with `make overlay`")
    if m["vllm_version"] != VLLM_VERSION:
        raise ToolError(f"{mf} is for vLLM {m['vllm_version']}, expected {VLLM_VERSION}: "
                        "rebuild it with `make overlay`")
    if verify_files:
        for e in m["files"]:
            src = overlay / e["path"]
            if not src.is_file() or sha256_file(src) != e["result_sha256"]:
                raise ToolError(f"overlay file {src} is missing or differs from MANIFEST.json; "
                                "rebuild with `make overlay`")
    return m


def _manifest_problem(m) -> str | None:
    if not isinstance(m, dict):
        return "not a JSON object"
    if not isinstance(m.get("vllm_version"), str):
        return "no vllm_version"
    files = m.get("files")
    if not isinstance(files, list) or not files:
        return "no files list"
    seen = set()
    for i, e in enumerate(files):
        if not isinstance(e, dict):
            return f"files[{i}] is not an object"
        path = e.get("path")
        if not isinstance(path, str) or not path.startswith("vllm/") or ".." in path.split("/"):
            return f"files[{i}].path {path!r} is not a path inside vllm/"
        if path in seen:
            return f"{path} listed twice"
        seen.add(path)
        up, res = e.get("upstream_sha256"), e.get("result_sha256")
        if not (up is None or (isinstance(up, str) and _HEX64.match(up))):
            return f"{path}: upstream_sha256 is neither null nor a sha256"
        if not (isinstance(res, str) and _HEX64.match(res)):
            return f"{path}: result_sha256 is not a sha256"
    return None


def _pkg_rel(path: str) -> str:
    """Manifest paths start with 'vllm/'; the install target is the vllm package dir."""
    return path[len("vllm/"):]


def _sha(p: Path) -> str | None:
    return sha256_file(p) if p.is_file() else None


def _cmd(sub: str, vllm_dir: Path, overlay: Path | None = None) -> str:
    tool = Path(__file__).resolve()
    extra = f" --overlay {overlay}" if overlay is not None else ""
    return f"python {tool} {sub} --vllm-dir {vllm_dir}{extra}"


# --------------------------------------------------------------------------- journal
def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        if FSYNC:
            os.fsync(f.fileno())
    _checkpoint(f"written {tmp}")
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    _checkpoint(f"in place {path}")


def _fsync_dir(d: Path) -> None:
    if not FSYNC:
        return
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_journal(vllm_dir: Path) -> dict | None:
    jf = vllm_dir / JOURNAL
    if jf.is_file():
        try:
            j = json.loads(jf.read_text())
            if j.get("format") != JOURNAL_FORMAT or not isinstance(j.get("steps"), list):
                raise ValueError("unknown format")
        except (ValueError, UnicodeDecodeError, AttributeError) as e:
            raise ToolError(f"{jf} is unreadable ({e}); it records an install of the overlay: "
                            "compare the files by hand with the overlay's MANIFEST.json") from None
        return j
    legacy = vllm_dir / BACKUP / LEGACY_STATE
    if legacy.is_file():  # an install finished by an earlier version of this tool
        try:
            st = json.loads(legacy.read_text())
            entries = {e["path"]: e for e in st["manifest"]["files"]}
            steps = [{"rel": s["rel"], "action": s["action"],
                      "upstream_sha256": entries["vllm/" + s["rel"]]["upstream_sha256"],
                      "result_sha256": entries["vllm/" + s["rel"]]["result_sha256"],
                      "mode": None} for s in st["files"]]  # None: the backup's mode
        except (ValueError, KeyError, TypeError) as e:
            raise ToolError(f"{legacy} is unreadable ({e})") from None
        # that version made the directories of the files it added (vllm/deepinfer/...)
        new_dirs = sorted({str(Path(s["rel"]).parents[i]) for s in steps if s["action"] == "add"
                           for i in range(len(Path(s["rel"]).parents) - 1)},
                          key=lambda r: (r.count("/"), r))
        return {"format": JOURNAL_FORMAT, "phase": "installed", "steps": steps,
                "new_dirs": new_dirs, "overlay": None, "legacy": True}
    return None


def _journal_matches(j: dict, plan_steps: list[dict]) -> bool:
    key = lambda s: (s["rel"], s["action"], s["upstream_sha256"], s["result_sha256"])  # noqa: E731
    return sorted(map(key, j["steps"])) == sorted(map(key, plan_steps))


# --------------------------------------------------------------------------- planning
def plan_install(vllm_dir: Path, manifest: dict) -> dict:
    """The journal an install would write: steps, new directories, and the checks passed."""
    problems, steps = [], []
    for e in manifest["files"]:
        rel = _pkg_rel(e["path"])
        dst = vllm_dir / rel
        step = {"rel": rel, "upstream_sha256": e["upstream_sha256"],
                "result_sha256": e["result_sha256"]}
        if e["upstream_sha256"] is None:
            if dst.exists():
                problems.append(f"{rel} exists but the overlay adds it (left by a copy by hand?)")
            steps.append({**step, "action": "add", "mode": FILE_MODE})
        elif not dst.is_file():
            problems.append(f"{rel} is missing from the installed vLLM")
        elif sha256_file(dst) != e["upstream_sha256"]:
            problems.append(f"{rel} has sha256 {sha256_file(dst)[:16]}…, not the pinned "
                            f"vLLM {VLLM_VERSION} file ({e['upstream_sha256'][:16]}…)")
        else:
            steps.append({**step, "action": "replace", "mode": dst.stat().st_mode & 0o7777})
    version = tree_vllm_version(vllm_dir)
    if problems:
        said = f"says vLLM {version}" if version else "has no _version.py"
        raise ToolError(f"refusing to install into {vllm_dir} ({said}): it is not vLLM "
                        f"{VLLM_VERSION} by content: " + "; ".join(problems))
    if version != VLLM_VERSION:
        said = f"says vLLM {version}" if version else "has no _version.py"
        warn(f"{vllm_dir} {said}, but every file the overlay replaces matches vLLM "
             f"{VLLM_VERSION} byte for byte: treating it as {VLLM_VERSION}")
    new_dirs = sorted({str(d.relative_to(vllm_dir)) for s in steps if s["action"] == "add"
                       for d in [*(vllm_dir / s["rel"]).parents]
                       if d != vllm_dir and vllm_dir in d.parents and not d.exists()},
                      key=lambda r: (r.count("/"), r))
    return {"format": JOURNAL_FORMAT, "phase": "installing", "vllm_version": VLLM_VERSION,
            "vllm_version_string": version, "steps": steps, "new_dirs": new_dirs}


def probe_writable(vllm_dir: Path, steps: list[dict]) -> None:
    """Create and remove a file in every directory an install or restore writes (the nearest
    existing one for a directory still to be made): a read-only target fails here, before
    anything is changed, with or without --dry-run."""
    check_writable({vllm_dir} | {(vllm_dir / s["rel"]).parent for s in steps},
                   "install as a user who may write there, into a writable copy of vLLM, or "
                   "bind-mount the overlay read-only instead (docs/docker.md)")


# --------------------------------------------------------------------------- copying
def _copy_verified(src: Path, dst: Path, want: str, mode: int) -> None:
    """Copy ``src`` to ``dst`` through ``dst``+TMP_SUFFIX and a rename, after checking the
    copy's sha256: ``dst`` is at every instant either its old content or ``want``."""
    tmp = dst.with_name(dst.name + TMP_SUFFIX)
    shutil.copyfile(src, tmp)
    os.chmod(tmp, mode)
    if FSYNC:
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    if sha256_file(tmp) != want:
        tmp.unlink()
        raise ToolError(f"copy of {src} to {dst} has the wrong sha256 (disk or file system "
                        "problem?)")
    _checkpoint(f"copied {tmp}")
    os.replace(tmp, dst)
    _checkpoint(f"in place {dst}")


def _clean_tmp(vllm_dir: Path, steps: list[dict]) -> None:
    for s in steps:
        for p in (vllm_dir / s["rel"], vllm_dir / BACKUP / s["rel"]):
            t = p.with_name(p.name + TMP_SUFFIX)
            if t.exists():
                t.unlink()
    t = vllm_dir / (JOURNAL + TMP_SUFFIX)
    if t.exists():
        t.unlink()


def _make_dirs(vllm_dir: Path, new_dirs: list[str]) -> None:
    for rel in new_dirs:
        d = vllm_dir / rel
        if not d.is_dir():
            d.mkdir()
            os.chmod(d, DIR_MODE)
            _checkpoint(f"made {d}")


def _do_steps(vllm_dir: Path, overlay: Path, j: dict) -> None:
    """Every install step, idempotent: a step already done (by the hashes) is skipped."""
    backup = vllm_dir / BACKUP
    if not backup.is_dir():
        backup.mkdir()
        _checkpoint(f"made {backup}")
    _make_dirs(vllm_dir, j["new_dirs"])
    for s in j["steps"]:
        dst, src = vllm_dir / s["rel"], overlay / "vllm" / s["rel"]
        have = _sha(dst)
        if have == s["result_sha256"]:
            continue
        if s["action"] == "add":
            if have is not None:
                raise ToolError(f"{dst} appeared during the install and is not the overlay's file")
            _copy_verified(src, dst, s["result_sha256"], s["mode"])
            continue
        if have != s["upstream_sha256"]:
            raise ToolError(f"{dst} changed during the install (sha256 {str(have)[:16]}…)")
        bk = backup / s["rel"]
        if _sha(bk) != s["upstream_sha256"]:
            bk.parent.mkdir(parents=True, exist_ok=True)
            _copy_verified(dst, bk, s["upstream_sha256"], s["mode"])
        _copy_verified(src, dst, s["result_sha256"], s["mode"])


def _undo_steps(vllm_dir: Path, j: dict) -> None:
    """Every restore step, idempotent: back to the upstream files, added files removed."""
    backup = vllm_dir / BACKUP
    for s in reversed(j["steps"]):
        dst = vllm_dir / s["rel"]
        if s["action"] == "add":
            if dst.exists():
                dst.unlink()
                _checkpoint(f"removed {dst}")
        elif _sha(dst) != s["upstream_sha256"]:
            bk = backup / s["rel"]
            mode = s["mode"] if s["mode"] is not None else bk.stat().st_mode & 0o7777
            _copy_verified(bk, dst, s["upstream_sha256"], mode)
    _clean_tmp(vllm_dir, j["steps"])
    for rel in reversed(j["new_dirs"]):  # deepest first; only what the install made
        d = vllm_dir / rel
        if d.is_dir():
            for cache in d.glob("__pycache__"):
                shutil.rmtree(cache)
            if not any(d.iterdir()):
                d.rmdir()
                _checkpoint(f"removed {d}")
    if backup.exists():
        shutil.rmtree(backup)
        _checkpoint(f"removed {backup}")
    jf = vllm_dir / JOURNAL
    if jf.exists():
        jf.unlink()
        _fsync_dir(vllm_dir)
        _checkpoint(f"removed {jf}")


def _changed_since(vllm_dir: Path, j: dict) -> list[str]:
    """Files that are neither the overlay's nor the upstream one (edited after install)."""
    out = []
    for s in j["steps"]:
        have = _sha(vllm_dir / s["rel"])
        if have not in (s["result_sha256"], s["upstream_sha256"]):
            out.append(s["rel"])
    return out


# --------------------------------------------------------------------------- commands
@contextlib.contextmanager
def _locked(vllm_dir: Path):
    """One install or restore at a time per tree: an exclusive flock on the directory itself
    (no lock file, so nothing is left behind)."""
    fd = os.open(vllm_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ToolError(f"another install_overlay.py is working on {vllm_dir}; wait for it "
                            "to finish, then run `status`") from None
        yield
    finally:
        os.close(fd)


def install(vllm_dir: Path, overlay: Path, dry_run: bool = False) -> list[dict]:
    vllm_dir = vllm_dir.resolve()
    check_environment()
    with _locked(vllm_dir):
        return _install(vllm_dir, overlay, dry_run)


def _install(vllm_dir: Path, overlay: Path, dry_run: bool) -> list[dict]:
    manifest = load_manifest(overlay)
    overlay = overlay.resolve()
    j = read_journal(vllm_dir)
    if j is not None:
        plan_steps = [{"rel": _pkg_rel(e["path"]), "upstream_sha256": e["upstream_sha256"],
                       "result_sha256": e["result_sha256"],
                       "action": "replace" if e["upstream_sha256"] else "add"}
                      for e in manifest["files"]]
        same = _journal_matches(j, plan_steps)
        if not same:
            raise ToolError(f"{vllm_dir} holds an install of another overlay build "
                            f"({j['phase']}): undo it first with `{_cmd('restore', vllm_dir)}`")
        if j["phase"] == "restoring":
            raise ToolError(f"a restore of {vllm_dir} was interrupted: finish it with "
                            f"`{_cmd('restore', vllm_dir)}`, then install again")
        changed = _changed_since(vllm_dir, j)
        if changed:
            raise ToolError(f"{', '.join(changed[:5])} changed since the overlay was installed; "
                            f"move the edits away, then `{_cmd('restore', vllm_dir)} --force`")
        if j["phase"] == "installed":
            print(f"the same overlay is installed already at {vllm_dir}; nothing to do")
            return []
        # an interrupted install of this same overlay: resume it
        probe_writable(vllm_dir, j["steps"])
        if dry_run:
            return j["steps"]
        print(f"resuming the interrupted install at {vllm_dir}", file=sys.stderr)
    else:
        if (vllm_dir / BACKUP).exists():
            raise ToolError(f"{vllm_dir / BACKUP} exists without {JOURNAL}: it was not left by "
                            "this tool's install; look inside, then move it away")
        j = plan_install(vllm_dir, manifest)
        j["overlay"] = str(overlay)
        probe_writable(vllm_dir, j["steps"])
        if dry_run:
            return j["steps"]
        _write_json_atomic(vllm_dir / JOURNAL, j)  # the intent, before the first change
    try:
        _clean_tmp(vllm_dir, j["steps"])
        _do_steps(vllm_dir, overlay, j)
        wrong = [s["rel"] for s in j["steps"] if _sha(vllm_dir / s["rel"]) != s["result_sha256"]]
        if wrong:
            raise ToolError(f"after copying, {', '.join(wrong[:5])} differ from MANIFEST.json")
        _write_json_atomic(vllm_dir / JOURNAL, {**j, "phase": "installed"})
    except BaseException as e:  # Ctrl-C included: the tree goes back to how it was
        _undo_steps(vllm_dir, j)
        why = e if isinstance(e, ToolError) else f"{type(e).__name__}: {e}"
        raise ToolError(f"install failed ({why}); rolled back: "
                        f"{vllm_dir} is as it was") from None
    return j["steps"]


def restore(vllm_dir: Path, dry_run: bool = False, force: bool = False) -> list[dict]:
    vllm_dir = vllm_dir.resolve()
    with _locked(vllm_dir):
        return _restore(vllm_dir, dry_run, force)


def _restore(vllm_dir: Path, dry_run: bool, force: bool) -> list[dict]:
    j = read_journal(vllm_dir)
    if j is None:
        leftover = vllm_dir / (JOURNAL + TMP_SUFFIX)
        if leftover.exists() and not dry_run:  # killed while writing the first journal:
            leftover.unlink()                   # nothing else had changed
            print(f"removed {leftover.name} left by an install killed before its first copy")
            return []
        raise ToolError(f"{vllm_dir} has no overlay installed by this tool (no {JOURNAL}); "
                        "nothing to restore")
    backup = vllm_dir / BACKUP
    changed = _changed_since(vllm_dir, j)
    if changed and not force:
        raise ToolError(f"{', '.join(changed[:5])} changed since the overlay was installed; "
                        "restoring would lose those edits: move them away, or pass --force")
    for s in j["steps"]:
        if s["action"] == "replace" and _sha(vllm_dir / s["rel"]) != s["upstream_sha256"] \
                and _sha(backup / s["rel"]) != s["upstream_sha256"]:
            raise ToolError(f"the backup of {s['rel']} ({backup / s['rel']}) is missing or "
                            "corrupt; nothing was restored")
    probe_writable(vllm_dir, j["steps"])
    if dry_run:
        return j["steps"]
    if j["phase"] != "restoring" and not j.get("legacy"):
        _write_json_atomic(vllm_dir / JOURNAL, {**j, "phase": "restoring"})
    _undo_steps(vllm_dir, j)  # a legacy state.json goes with the backup directory
    return j["steps"]


def status(vllm_dir: Path, overlay: Path | None = None) -> tuple[int, str]:
    """(exit code, one line): STATUS_ACTIVE, STATUS_ABSENT or STATUS_NEEDS_ACTION."""
    vllm_dir = vllm_dir.resolve()
    head = f"vLLM {tree_vllm_version(vllm_dir) or '(no _version.py)'} at {vllm_dir}"
    j = read_journal(vllm_dir)
    if j is not None:
        n = len(j["steps"])
        done = sum(_sha(vllm_dir / s["rel"]) == s["result_sha256"] for s in j["steps"])
        changed = _changed_since(vllm_dir, j)
        if changed:
            return STATUS_NEEDS_ACTION, (
                f"{head}: overlay {j['phase']}, but {len(changed)} files changed since "
                f"(e.g. {changed[0]}): move the edits away, then `{_cmd('restore', vllm_dir)} --force`")
        if j["phase"] == "installed" and done == n:
            return STATUS_ACTIVE, f"{head}: deepinfer overlay installed ({n} files match the journal)"
        if j["phase"] == "restoring":
            return STATUS_NEEDS_ACTION, (f"{head}: PARTIAL restore (interrupted; {done} of {n} "
                                         f"files still the overlay's): finish it with "
                                         f"`{_cmd('restore', vllm_dir)}`")
        ov = Path(j["overlay"]) if j.get("overlay") else None
        return STATUS_NEEDS_ACTION, (
            f"{head}: PARTIAL install ({done} of {n} files copied, interrupted): finish it with "
            f"`{_cmd('install', vllm_dir, ov)}` or undo it with `{_cmd('restore', vllm_dir)}`")
    if (vllm_dir / BACKUP).exists():
        return STATUS_NEEDS_ACTION, (f"{head}: {BACKUP} exists without {JOURNAL}: not left by "
                                     "this tool's install; look inside, then move it away")
    note = ""
    if (vllm_dir / (JOURNAL + TMP_SUFFIX)).exists():
        note = (f" (an install was killed before its first copy; "
                f"`{_cmd('restore', vllm_dir)}` removes its unfinished journal)")
    if overlay is None or not (overlay / "MANIFEST.json").is_file():
        return STATUS_ABSENT, f"{head}: deepinfer overlay not installed{note}"
    m = load_manifest(overlay, verify_files=False)
    res = up = 0
    other = []
    for e in m["files"]:
        have = _sha(vllm_dir / _pkg_rel(e["path"]))
        if have == e["result_sha256"]:
            res += 1
        elif have == e["upstream_sha256"]:
            up += 1
        else:
            other.append(_pkg_rel(e["path"]))
    n = len(m["files"])
    if res == n:
        return STATUS_ACTIVE, (f"{head}: deepinfer overlay active: all {n} files match "
                               f"{overlay / 'MANIFEST.json'} (bind-mounted or copied; no journal)")
    if res == 0 and not [r for r in other if (vllm_dir / r).exists()]:
        return STATUS_ABSENT, f"{head}: deepinfer overlay not installed{note}"
    return STATUS_NEEDS_ACTION, (
        f"{head}: MIXED: {res} of {n} files are the overlay's, {up} the pinned upstream's, "
        f"{len(other)} neither or missing (e.g. {(other or ['-'])[0]}); no journal, so this tool "
        "did not make this state: check the mounts or copies against MANIFEST.json")


def mounts(site: str, overlay: Path) -> list[str]:
    """``docker run`` read-only bind-mount flags: each replaced file, and the added package
    directory, from ``overlay`` onto the image's ``site`` (the dir holding ``vllm/``)."""
    m = load_manifest(overlay)
    overlay = overlay.resolve()
    flags, pkgs = [], set()
    for e in m["files"]:
        if e["upstream_sha256"] is None:
            pkgs.add("/".join(e["path"].split("/")[:2]))  # vllm/deepinfer
        else:
            flags.append(f"-v {overlay / e['path']}:{site.rstrip('/')}/{e['path']}:ro")
    flags += [f"-v {overlay / p}:{site.rstrip('/')}/{p}:ro" for p in sorted(pkgs)]
    return flags


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("install", "restore", "status"):
        p = sub.add_parser(name)
        p.add_argument("--vllm-dir", type=Path)
        if name != "status":
            p.add_argument("--dry-run", action="store_true")
        if name in ("install", "status"):
            p.add_argument("--overlay", type=Path, default=OVERLAY_OUT)
        if name == "restore":
            p.add_argument("--force", action="store_true",
                           help="restore even over files edited since the install")
    mp = sub.add_parser("mounts", help="print docker -v flags for a read-only bind mount")
    mp.add_argument("--site", required=True, help="the image's dir holding vllm/ "
                    "(e.g. /usr/local/lib/python3.12/dist-packages)")
    mp.add_argument("--overlay", type=Path, default=OVERLAY_OUT)
    a = ap.parse_args(argv)
    if a.cmd == "mounts":
        print(" ".join(mounts(a.site, a.overlay)))
        return 0
    vllm_dir = (a.vllm_dir or find_vllm_dir()).resolve()
    if not vllm_dir.is_dir():
        raise ToolError(f"--vllm-dir {vllm_dir}: no such directory")
    if a.cmd == "status":
        code, line = status(vllm_dir, a.overlay)
        print(line)
        return code
    if a.cmd == "install":
        steps = install(vllm_dir, a.overlay, a.dry_run)
    else:
        steps = restore(vllm_dir, a.dry_run, a.force)
    if not steps:
        return 0
    for s in steps:
        print(f"{'would ' if a.dry_run else ''}{a.cmd}: {s['action']:7s} vllm/{s['rel']}")
    checked = " (sha256, version by content, writability checked)" if a.dry_run else ""
    print(f"{'dry run: nothing changed' + checked if a.dry_run else 'done'} "
          f"({len(steps)} files, {vllm_dir})")
    return 0


if __name__ == "__main__":
    run_main(main)
