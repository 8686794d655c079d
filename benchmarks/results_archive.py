"""The machinery of ``python3 benchmarks/results_index.py --archive``: which files move into
benchmarks/results/archive/, the ``git mv`` of each, and the rewrite of references to them in
the tracked text files.

Standard library only, like results_index.py, which decides what is superseded (its grouping
and git-history order) and regenerates INDEX.md afterwards; this module knows nothing of
groups and does not import results_index (it imports this one). Nothing here commits.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

# A reference to a results file starts right after "results/" or where no name character,
# ".", "/" or "-" precedes it (so "x-NAME.json" and ".../other/NAME.json" are not it), and ends
# where no word character follows (so "NAME.json" does not match inside "NAME.jsonl").
_BOUND_L = r"(?:(?<=results/)|(?<![\w./-]))"
_BOUND_R = r"(?![\w])"


def superseded_moves(results, current: set[str], archive: str) -> list[tuple[str, str]]:
    """(old, new) paths under benchmarks/results/ for every results file (results_index.Result:
    rel, name, archived, charts) not current and not yet archived, then its charts not yet
    archived: NAME -> archive/NAME, charts/NAME.png -> archive/charts/NAME.png."""
    moves = []
    for r in results:
        if r.rel in current or r.archived:
            continue
        moves.append((r.rel, f"{archive}/{r.name}"))
        for c in r.charts:
            if not c.startswith(archive + "/"):
                moves.append((c, f"{archive}/{c}"))
    return moves


def git_mv(root: Path, results_rel: Path, moves: list[tuple[str, str]]) -> None:
    """git mv each (old, new) under root/results_rel; SystemExit naming the first that fails."""
    base = root / results_rel
    for old, new in moves:
        (base / new).parent.mkdir(parents=True, exist_ok=True)
        p = subprocess.run(["git", "-C", str(root), "mv", str(results_rel / old), str(results_rel / new)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"results_index --archive: git mv {old} failed: {p.stderr.strip()}")


def reference_patterns(moves: list[tuple[str, str]], charts: str):
    """(name, regex, replacement) per moved file. Results names are relative to
    benchmarks/results/ wherever they are written bare (results files' "source" fields,
    a100_model.py's table, docs), so "NAME" and ".../results/NAME" both become archive/NAME;
    charts (moved from the ``charts`` folder) likewise ("charts/NAME" -> "archive/charts/NAME")."""
    pats = []
    for old, new in moves:
        name = old.rsplit("/", 1)[-1]
        if old.startswith(charts + "/"):
            rx = re.compile(_BOUND_L + r"(?:" + re.escape(charts) + "/)?" + re.escape(name) + _BOUND_R)
        else:
            rx = re.compile(_BOUND_L + re.escape(name) + _BOUND_R)
        pats.append((name, rx, new))
    return pats


def tracked_files(root: Path) -> list[str]:
    """The paths git tracks under root (empty when git is unavailable)."""
    try:
        p = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True,
                           text=True, check=False)
    except OSError:
        return []
    return [f for f in p.stdout.split("\0") if f] if p.returncode == 0 else []


def rewrite_references(root: Path, moves: list[tuple[str, str]], charts: str,
                       skip: set[str]) -> tuple[list[str], list[str]]:
    """Rewrite references to the moved files in tracked text files (not those in skip).
    Files under patches/ are never rewritten (the combined patch is generated and the series is
    checked by sha256): they are returned as the second list instead, for the user to fix at
    their source. Returns (rewritten, left in patches/)."""
    pats = reference_patterns(moves, charts)
    rewritten, untouched = [], []
    for rel in tracked_files(root):
        path = root / rel
        if rel in skip or not path.is_file():
            continue
        try:
            data = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if "\0" in data or not any(name in data for name, _, _ in pats):
            continue
        new = data
        for name, rx, repl in pats:
            if name in new:
                new = rx.sub(repl, new)
        if new == data:
            continue
        if rel.startswith("patches/"):
            untouched.append(rel)
            continue
        path.write_text(new)
        rewritten.append(rel)
    return rewritten, untouched
