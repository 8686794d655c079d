#!/usr/bin/env python3
"""The versioned patch series: apply, refresh, combine, build the drop-in overlay.

    patchset.py apply   --tree DIR [--series-only] [--dry-run]
    patchset.py refresh --tree DIR [--new NAME]
    patchset.py combine [--check]
    patchset.py overlay [--out build/overlay]
    patchset.py record          # rewrite UPSTREAM's file hashes from the pristine tree

The series lives in patches/vllm-0.33.0/: ``series`` (patch order), numbered patches and
``UPSTREAM`` (JSON: version, sdist sha256, sha256 of every upstream file the series
touches). Each upstream file belongs to exactly one patch, so ``refresh`` regenerates each
patch as the diff of its own files against the tree's baseline commit (tools/upstream.py).
Our own modules (overlay/vllm/deepinfer/) are new files: ``apply`` copies them in, the
combined patch carries them, ``refresh`` never touches them (edit them in overlay/).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    COMBINED_PATCH, OVERLAY_OUT, OVERLAY_PKG, PATCH_DIR, SDIST_SHA256, UPSTREAM_TREE, VLLM_VERSION,
    ToolError, run_main, sha256_bytes, sha256_file, tree_vllm_version,
)

OUR_PKG_REL = "vllm/deepinfer"
_DIFF_HEAD = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)


# --------------------------------------------------------------------------- series model
def read_series(patch_dir: Path | None = None) -> list[Path]:
    patch_dir = patch_dir or PATCH_DIR
    f = patch_dir / "series"
    if not f.is_file():
        raise ToolError(f"{f} missing")
    names = [ln.strip() for ln in f.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    for n in names:
        if not (patch_dir / n).is_file():
            raise ToolError(f"series names {n}, which is not in {patch_dir}")
    return [patch_dir / n for n in names]


def patch_files(patch: Path) -> list[str]:
    return sorted({m.group(2) for m in _DIFF_HEAD.finditer(patch.read_text())})


def read_record(patch_dir: Path | None = None) -> dict:
    f = (patch_dir or PATCH_DIR) / "UPSTREAM"
    if not f.is_file():
        raise ToolError(f"{f} missing")
    rec = json.loads(f.read_text())
    if rec.get("version") != VLLM_VERSION or rec.get("sdist_sha256") != SDIST_SHA256:
        raise ToolError(f"{f} records vLLM {rec.get('version')} / {rec.get('sdist_sha256')}, "
                        f"but the tools pin {VLLM_VERSION} / {SDIST_SHA256}")
    return rec


def write_record(files: dict[str, str], patch_dir: Path | None = None) -> None:
    patch_dir = patch_dir or PATCH_DIR
    rec = {"version": VLLM_VERSION, "sdist": f"vllm-{VLLM_VERSION}.tar.gz",
           "sdist_sha256": SDIST_SHA256,
           "files": dict(sorted(files.items()))}
    (patch_dir / "UPSTREAM").write_text(json.dumps(rec, indent=1) + "\n")


def series_ownership(series: list[Path]) -> dict[str, Path]:
    owner: dict[str, Path] = {}
    for p in series:
        for f in patch_files(p):
            if f in owner:
                raise ToolError(f"{f} is touched by both {owner[f].name} and {p.name}; "
                                "each upstream file belongs to one patch")
            owner[f] = p
    return owner


def our_files() -> list[Path]:
    return sorted(p for p in OVERLAY_PKG.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


# --------------------------------------------------------------------------- helpers
def _git(cwd: Path, *args: str, check: bool = True, input: str | None = None):
    env = dict(os.environ, GIT_AUTHOR_NAME="deepinfer", GIT_AUTHOR_EMAIL="deepinfer@localhost",
               GIT_COMMITTER_NAME="deepinfer", GIT_COMMITTER_EMAIL="deepinfer@localhost",
               GIT_CONFIG_NOSYSTEM="1", HOME=str(cwd))
    r = subprocess.run(["git", "-c", "safe.directory=*", "-c", "core.autocrlf=false", *args],
                       cwd=cwd, capture_output=True, text=True, env=env, input=input)
    if check and r.returncode != 0:
        raise ToolError(f"git {' '.join(args[:3])} failed in {cwd}: {r.stderr.strip()}")
    return r


def check_pristine(tree: Path, record: dict) -> None:
    """Refuse a tree of another version or whose touched files differ from the pin."""
    version = tree_vllm_version(tree)
    if version != VLLM_VERSION:
        raise ToolError(f"{tree} holds vLLM {version or '(unknown: no vllm/_version.py)'}; "
                        f"this series is for {VLLM_VERSION}")
    bad = []
    for rel, want in record["files"].items():
        p = tree / rel
        if not p.is_file():
            bad.append(f"{rel} (missing)")
        elif sha256_file(p) != want:
            bad.append(f"{rel} (sha256 differs from vLLM {VLLM_VERSION}; already patched or edited?)")
    if bad:
        raise ToolError(f"{tree} does not match the pinned upstream: " + "; ".join(bad))
    if (tree / OUR_PKG_REL).exists():
        raise ToolError(f"{tree / OUR_PKG_REL} already exists: the series was applied before")


class Transaction:
    """Remembers files before changing them; ``rollback`` restores them and removes new ones."""

    def __init__(self, root: Path):
        self.root = root
        self.saved: dict[str, bytes | None] = {}

    def touch(self, rel: str) -> None:
        if rel not in self.saved:
            p = self.root / rel
            self.saved[rel] = p.read_bytes() if p.is_file() else None

    def rollback(self) -> None:
        for rel, data in self.saved.items():
            p = self.root / rel
            if data is None:
                if p.exists():
                    p.unlink()
            else:
                p.write_bytes(data)
        pkg = self.root / OUR_PKG_REL
        if self.saved.get("__pkg_created__", b"") is None and pkg.exists():
            shutil.rmtree(pkg)


def apply_series(tree: Path, series_only: bool = False, dry_run: bool = False,
                 _fail_after: int | None = None) -> list[str]:
    """Apply every patch (and copy our package) or nothing. Returns the changed paths."""
    tree = tree.resolve()
    if not tree.is_dir():
        raise ToolError(f"--tree {tree}: no such directory")
    record = read_record()
    series = read_series()
    check_pristine(tree, record)
    owner = series_ownership(series)
    missing = sorted(set(owner) - set(record["files"]) - {f for f in owner if not (tree / f).exists()})
    if missing:
        raise ToolError(f"UPSTREAM lacks hashes for {', '.join(missing)}: run `patchset.py record`")
    tx = Transaction(tree)
    changed: list[str] = []
    try:
        for i, patch in enumerate(series):
            for rel in patch_files(patch):
                tx.touch(rel)
            args = ["apply", "--whitespace=nowarn", "--unidiff-zero"]
            r = _git(tree, *args, "--check", str(patch), check=False)
            if r.returncode != 0:
                raise ToolError(f"{patch.name} does not apply to {tree}: {r.stderr.strip()}")
            if not dry_run:
                _git(tree, *args, str(patch))
            changed += patch_files(patch)
            if _fail_after is not None and i + 1 >= _fail_after:
                raise ToolError(f"injected failure after {patch.name} (test hook)")
        if not series_only:
            pkg = tree / OUR_PKG_REL
            tx.saved["__pkg_created__"] = None
            if not dry_run:
                shutil.copytree(OVERLAY_PKG, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            changed += [f"{OUR_PKG_REL}/{p.relative_to(OVERLAY_PKG)}" for p in our_files()]
    except BaseException:
        tx.rollback()
        raise
    return changed


# --------------------------------------------------------------------------- refresh
def baseline_commit(tree: Path) -> str:
    r = _git(tree, "rev-list", "--max-parents=0", "HEAD", check=False)
    if r.returncode != 0 or not r.stdout.strip():
        raise ToolError(f"{tree} is not a git tree with a baseline commit (make it with "
                        "tools/upstream.py fetch --dest DIR)")
    return r.stdout.split()[0]


def _header(patch_text: str) -> str:
    m = _DIFF_HEAD.search(patch_text)
    return patch_text[: m.start()] if m else patch_text


def _diff(tree: Path, base: str, files: list[str]) -> str:
    return _git(tree, "diff", "--no-color", "--no-ext-diff", "--no-renames", "--full-index",
                base, "--", *files).stdout


def refresh(tree: Path, new_patch: str | None = None) -> list[str]:
    tree = tree.resolve()
    base = baseline_commit(tree)
    series = read_series()
    owner = series_ownership(series)
    _git(tree, "add", "-A", "-N", "--", ".", f":!{OUR_PKG_REL}")  # let diff see new files
    changed = [ln for ln in _git(tree, "diff", "--name-only", "--no-renames", base).stdout.splitlines()
               if ln and not ln.startswith(OUR_PKG_REL + "/")]
    unowned = sorted(set(changed) - set(owner))
    if unowned and not new_patch:
        raise ToolError("changed upstream files not in any patch: " + ", ".join(unowned)
                        + " (pass --new NAME to start a patch for them)")
    written = []
    for patch in series:
        files = [f for f, p in owner.items() if p == patch]
        text = _header(patch.read_text()) + _diff(tree, base, files)
        if text != patch.read_text():
            patch.write_text(text)
            written.append(patch.name)
    if unowned and new_patch:
        n = len(series) + 1
        name = f"{n:04d}-{re.sub(r'[^a-z0-9]+', '-', new_patch.lower()).strip('-')}.patch"
        (PATCH_DIR / name).write_text(f"Subject: {new_patch}\n\n" + _diff(tree, base, unowned))
        with open(PATCH_DIR / "series", "a") as f:
            f.write(name + "\n")
        written.append(name)
    # Record the pristine hashes of every touched file from the baseline commit.
    files = {}
    for f in series_ownership(read_series()):
        blob = subprocess.run(["git", "-c", "safe.directory=*", "show", f"{base}:{f}"], cwd=tree,
                              capture_output=True)
        if blob.returncode == 0:
            files[f] = sha256_bytes(blob.stdout)
    write_record(files)
    ours = tree / OUR_PKG_REL
    if ours.is_dir():
        stale = [str(p.relative_to(OVERLAY_PKG)) for p in our_files()
                 if not (ours / p.relative_to(OVERLAY_PKG)).is_file()
                 or (ours / p.relative_to(OVERLAY_PKG)).read_bytes() != p.read_bytes()]
        if stale:
            print(f"note: {OUR_PKG_REL} in the tree differs from overlay/ for {', '.join(stale[:5])}"
                  " — our modules are edited in overlay/, not in the tree", file=sys.stderr)
    return written


# --------------------------------------------------------------------------- generated outputs
def _patched_scratch(pristine: Path, work: Path) -> tuple[Path, dict]:
    """A git repo in ``work`` holding the pristine touched files (committed) with the series
    and our package applied on top (uncommitted). Returns (repo, record)."""
    record = read_record()
    if not pristine.is_dir():
        raise ToolError(f"{pristine} not found: run `make upstream` first")
    if tree_vllm_version(pristine) != VLLM_VERSION:
        raise ToolError(f"{pristine} is not vLLM {VLLM_VERSION}")
    repo = work / "tree"
    for rel, want in record["files"].items():
        src = pristine / rel
        if sha256_file(src) != want:
            raise ToolError(f"{src} differs from the pinned upstream (dirty upstream tree?)")
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, repo / rel)
    (repo / "vllm").mkdir(parents=True, exist_ok=True)
    shutil.copy2(pristine / "vllm" / "_version.py", repo / "vllm" / "_version.py")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A", "-f")
    _git(repo, "commit", "-q", "--no-verify", "-m", "pristine")
    for patch in read_series():
        _git(repo, "apply", "--whitespace=nowarn", str(patch))
    shutil.copytree(OVERLAY_PKG, repo / OUR_PKG_REL, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _git(repo, "add", "-A", "-f")
    return repo, record


def combined_patch_text(pristine: Path | None = None) -> str:
    pristine = pristine or UPSTREAM_TREE
    with tempfile.TemporaryDirectory() as tmp:
        repo, _ = _patched_scratch(pristine, Path(tmp))
        body = _git(repo, "diff", "--cached", "--no-color", "--no-ext-diff", "--no-renames",
                    "--full-index", "--binary").stdout
    series = ", ".join(p.name for p in read_series())
    head = (f"DeepInfer-SM80 combined patch for vLLM {VLLM_VERSION} (sdist sha256 {SDIST_SHA256}).\n"
            f"GENERATED by `make combined` from patches/vllm-{VLLM_VERSION}/ ({series}) and\n"
            f"overlay/vllm/deepinfer/. Apply at the root of a vLLM {VLLM_VERSION} tree: git apply {COMBINED_PATCH.name}\n\n")
    return head + body


def combine(check: bool = False, pristine: Path | None = None) -> int:
    text = combined_patch_text(pristine)
    if check:
        have = COMBINED_PATCH.read_text() if COMBINED_PATCH.is_file() else ""
        if have != text:
            raise ToolError(f"{COMBINED_PATCH.relative_to(COMBINED_PATCH.parents[1])} is out of date "
                            "with the series and overlay/vllm/deepinfer/: run `make combined` and commit it")
        print(f"{COMBINED_PATCH.name} is up to date")
        return 0
    COMBINED_PATCH.write_text(text)
    print(f"wrote {COMBINED_PATCH}")
    return 0


def build_overlay(out: Path | None = None, pristine: Path | None = None) -> Path:
    out, pristine = out or OVERLAY_OUT, pristine or UPSTREAM_TREE
    with tempfile.TemporaryDirectory() as tmp:
        repo, record = _patched_scratch(pristine, Path(tmp))
        stage = Path(tempfile.mkdtemp(prefix=".overlay-", dir=out.parent if out.parent.exists() else None))
        try:
            entries = []
            for rel in sorted(set(record["files"]) | {f"{OUR_PKG_REL}/{p.relative_to(OVERLAY_PKG)}"
                                                       for p in our_files()}):
                src = repo / rel
                dst = stage / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
                entries.append({"path": rel, "upstream_sha256": record["files"].get(rel),
                                "result_sha256": sha256_file(dst)})
            manifest = {"vllm_version": VLLM_VERSION, "sdist_sha256": SDIST_SHA256,
                        "series": [p.name for p in read_series()], "files": entries}
            (stage / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
            if out.exists():
                shutil.rmtree(out)
            out.parent.mkdir(parents=True, exist_ok=True)
            stage.rename(out)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    print(f"wrote {out} ({len(entries)} files, MANIFEST.json)")
    return out


def record_hashes(pristine: Path | None = None) -> None:
    pristine = pristine or UPSTREAM_TREE
    files = {}
    for rel in series_ownership(read_series()):
        p = pristine / rel
        if p.is_file():
            files[rel] = sha256_file(p)
    write_record(files)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("apply")
    a.add_argument("--tree", type=Path, required=True)
    a.add_argument("--series-only", action="store_true", help="do not copy vllm/deepinfer in")
    a.add_argument("--dry-run", action="store_true")
    r = sub.add_parser("refresh")
    r.add_argument("--tree", type=Path, required=True)
    r.add_argument("--new", metavar="NAME")
    c = sub.add_parser("combine")
    c.add_argument("--check", action="store_true")
    c.add_argument("--pristine", type=Path, default=UPSTREAM_TREE)
    o = sub.add_parser("overlay")
    o.add_argument("--out", type=Path, default=OVERLAY_OUT)
    o.add_argument("--pristine", type=Path, default=UPSTREAM_TREE)
    rc = sub.add_parser("record")
    rc.add_argument("--pristine", type=Path, default=UPSTREAM_TREE)
    args = ap.parse_args(argv)
    if args.cmd == "apply":
        changed = apply_series(args.tree, args.series_only, args.dry_run)
        verb = "would change" if args.dry_run else "applied; changed"
        print(f"{verb} {len(changed)} files in {args.tree}")
    elif args.cmd == "refresh":
        written = refresh(args.tree, args.new)
        print("refreshed: " + (", ".join(written) or "nothing changed"))
    elif args.cmd == "combine":
        return combine(args.check, args.pristine)
    elif args.cmd == "overlay":
        build_overlay(args.out, args.pristine)
    elif args.cmd == "record":
        record_hashes(args.pristine)
    return 0


if __name__ == "__main__":
    run_main(main)
