"""The docs state the present and name every run by its commit and results file.

Run-by-run history lives in CHANGELOG.md. The docs (docs/*.md, README.md,
benchmarks/README.md, benchmarks/e2e/README.md) and CHANGELOG.md itself may not name a run by
its place in time ("the fourth ...", "the last run", "earlier", "a previous GPU run", "the
first wave") or speak of "sessions"; and every results file they cite must exist exactly
where it is cited (a superseded file moved to benchmarks/results/archive/ must be cited there).

Standard library and pytest only; reads a few hundred KB of text.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

# The files held to "state the present"; CHANGELOG.md is held to the same wording rules
# (it names runs by commit too) and to the path check.
DOCS = sorted((REPO / "docs").glob("*.md")) + [
    REPO / "README.md", REPO / "benchmarks" / "README.md", REPO / "benchmarks" / "e2e" / "README.md"]
CHANGELOG = REPO / "CHANGELOG.md"
WORDING_FILES = DOCS + [CHANGELOG]

# Words that place a run in time instead of naming it. An ordinal or a relative word is only
# refused before a noun that names a run (so "the first layer", "the last prefill chunk" and
# "one wave of CTAs" stay legal); "earlier", "previous(ly)" and "session(s)" are refused
# everywhere, since the docs have no use for them that a commit would not say better.
_ORDINAL = (r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|"
            r"last|latest|next|later|prior|recent|former")
_RUN_NOUN = (r"runs?|sessions?|waves?|sweeps?|rounds?|measurements?|results|attempts?|"
             r"tries|try|calls?|builds?")
# What may stand between the ordinal and the noun: words that qualify a run, not other nouns
# ("the first layer calls DeepGEMM" is not a run).
_RUN_QUALIFIER = (r"GPU|H200|A100|CPU|device|served|e2e|end-to-end|engine|suite|full|quick|"
                  r"cold|warm|benchmark|test|GPU-test|pytest|tile|such|of|the|a|an")
FORBIDDEN = [
    ("session", re.compile(r"\bsessions?\b", re.I)),
    ("earlier", re.compile(r"\bearlier\b", re.I)),
    ("previous", re.compile(r"\bprevious(?:ly)?\b", re.I)),
    # up to three words between, e.g. "the fourth H200 GPU run", "first served run"
    ("ordinal run", re.compile(rf"\b(?:{_ORDINAL})(?:[ -](?:{_RUN_QUALIFIER})){{0,3}}[ -]"
                               rf"(?:{_RUN_NOUN})\b", re.I)),
    ("relative time", re.compile(r"\b(?:so far|since then|at the time|back then|this round)\b",
                                 re.I)),
]

# A results path as the docs write it: benchmarks/results/<name>, possibly with a {a,b}
# alternation; placeholders (<gpu>, DATE, FILE, *, ...) are templates, not citations.
_PATH = re.compile(r"benchmarks/results/[A-Za-z0-9_./{},<>*+-]*[A-Za-z0-9_}>*]")
_TEMPLATE = re.compile(r"[<>*]|DATE|FILE|RESULTS|PATH|\bF\.json")
# A results file named without its folder (h200-..., a100-model-...), or a chart as
# charts/<name>.png: these must name a file that exists in benchmarks/results/ (any folder)
# or in benchmarks/results/charts/.
_BARE = re.compile(r"(?<![\w/.<-])((?:h200|a100-model)-[A-Za-z0-9_.{},-]*?\.(?:jsonl|json|png))\b")
_CHART = re.compile(r"(?<![\w/])charts/([A-Za-z0-9_.{},-]+?\.png)\b")


def _expand(path: str) -> list[str]:
    """`a{,-b}.json` -> [`a.json`, `a-b.json`]; several groups multiply."""
    parts = re.split(r"(\{[^{}]*\})", path)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def _lines(path: Path):
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        yield n, line


def _wording_problems(text_lines):
    out = []
    for n, line in text_lines:
        for name, rx in FORBIDDEN:
            for m in rx.finditer(line):
                out.append((n, name, m.group(0)))
    return out


def _cited_paths(text: str) -> set[str]:
    cited = set()
    for m in _PATH.finditer(text):
        p = m.group(0).rstrip(".,;:")
        if _TEMPLATE.search(p) or "." not in p.rsplit("/", 1)[-1]:  # a template or a folder
            continue
        cited.update(_expand(p))
    return cited


def _bare_names(text: str) -> set[str]:
    names = set()
    for m in _BARE.finditer(text):
        start = m.start(1)
        if text[max(0, start - len("benchmarks/results/")):start].endswith("/"):
            continue
        if _TEMPLATE.search(m.group(1)):
            continue
        names.update(_expand(m.group(1)))
    return names


def _existing_names() -> set[str]:
    return {p.name for p in RESULTS.rglob("*") if p.is_file()}


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


@pytest.mark.parametrize("path", [p for p in WORDING_FILES if p.exists()], ids=_rel)
def test_no_run_named_by_its_place_in_time(path):
    problems = _wording_problems(_lines(path))
    assert not problems, (
        f"{_rel(path)} names runs by time, not by commit and results file (history goes to "
        "CHANGELOG.md): " + "; ".join(f"line {n}: {name} {word!r}" for n, name, word in problems))


def test_changelog_exists_and_names_commits():
    text = CHANGELOG.read_text(encoding="utf-8")
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert len(heads) >= 10, "CHANGELOG.md: one section per commit expected"
    no_commit = [h for h in heads if not re.search(r"\b[0-9a-f]{7,40}\b", h)]
    assert not no_commit, f"CHANGELOG.md sections without a commit: {no_commit}"


@pytest.mark.parametrize("path", [p for p in WORDING_FILES if p.exists()], ids=_rel)
def test_every_cited_results_file_exists_as_cited(path):
    text = path.read_text(encoding="utf-8")
    missing = sorted(p for p in _cited_paths(text) if not (REPO / p).is_file())
    assert not missing, f"{_rel(path)} cites results files that are not there: {missing}"
    names = _existing_names()
    missing_names = sorted(n for n in _bare_names(text) if n not in names)
    assert not missing_names, (
        f"{_rel(path)} names results files that are in no folder of benchmarks/results/: "
        f"{missing_names}")
    charts = {p.name for p in (RESULTS / "charts").glob("*.png")}
    missing_charts = sorted(c for m in _CHART.finditer(text) for c in _expand(m.group(1))
                            if c not in charts)
    assert not missing_charts, (
        f"{_rel(path)} names charts that are not in benchmarks/results/charts/: {missing_charts}")


# The checks themselves: each pattern refuses what the issue quotes and lets plain uses pass.

@pytest.mark.parametrize("bad", [
    "Results of the fourth GPU session (H200)", "as the last run showed", "measured earlier",
    "the previous GPU run", "the first wave of runs", "the second H200 sweep",
    "Latest results: see below", "first served run", "in the runs so far",
])
def test_wording_patterns_catch_run_naming_by_time(bad):
    assert _wording_problems([(1, bad)]), bad


@pytest.mark.parametrize("good", [
    "V4's first layer calls DeepGEMM", "one wave of CTAs", "the first differing position",
    "timed on engine steps after the last prefill chunk", "measured in the same run",
    "the suite at 0e7e399 (`benchmarks/results/h200-2026-12-01-sparse_mla_decode-0e7e399.json`)",
])
def test_wording_patterns_let_plain_uses_pass(good):
    assert not _wording_problems([(1, good)]), good


def test_path_extraction():
    text = ("see benchmarks/results/h200-2026-11-29-decode-tile-sweep{,-stages}.json, "
            "`benchmarks/results/<gpu>-<date>.json` and benchmarks/results/FILE.json; "
            "bare h200-2026-11-29-final.json and charts/h200-2026-12-01-yoco-d80f014-yoco.png.")
    assert _cited_paths(text) == {
        "benchmarks/results/h200-2026-11-29-decode-tile-sweep.json",
        "benchmarks/results/h200-2026-11-29-decode-tile-sweep-stages.json"}
    assert _bare_names(text) == {"h200-2026-11-29-final.json"}
    assert [m.group(1) for m in _CHART.finditer(text)] == ["h200-2026-12-01-yoco-d80f014-yoco.png"]
    # a cited path that is not in the tree is reported exactly as written
    assert not (REPO / "benchmarks/results/h200-1999-01-01-none.json").is_file()
