"""benchmarks/results_index.py: benchmarks/results/INDEX.md is current, every results file
carries its provenance, --check fails on what it must catch, --archive moves superseded files
and rewrites references to them."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import results_index as ri  # noqa: E402

SCRIPT = REPO / "benchmarks" / "results_index.py"
RESULTS = REPO / "benchmarks" / "results"


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    # The script is standard library only: run it as CI does, in its own interpreter.
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), *args],
                          capture_output=True, text=True)


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t",
                           "-c", "commit.gpgsign=false", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


# ============================================================================ the real tree
def test_index_is_current():
    hist = ri.History(REPO)
    if not hist.available:
        pytest.fail(f"INDEX.md is ordered by git history, unavailable here: {hist.reason}")
    text, results, groups, _ = ri.generate(REPO)
    committed = (RESULTS / "INDEX.md").read_text()
    assert text == committed, ri.check(REPO)
    # Nothing of this machine in it (the same text on a fresh clone).
    assert str(REPO) not in text and "/work/" not in text
    listed = ri._listed(committed)
    assert listed == {r.rel for r in results}


@pytest.mark.parametrize("name", sorted(p.name for p in RESULTS.iterdir()
                                        if p.suffix in (".json", ".jsonl")))
def test_every_results_file_has_provenance(name):
    r = ri._load(RESULTS / name, name)
    assert ri.missing_provenance(r) == [], f"{name}: meta lacks {ri.missing_provenance(r)}"


def test_every_recorded_commit_is_a_commit_of_this_history():
    """The order INDEX.md gives rests on each file's commit resolving in git."""
    hist = ri.History(REPO)
    if not hist.available:
        pytest.fail(hist.reason)
    results, _ = ri.load_results(RESULTS)
    unknown = [(r.rel, r.commit) for r in results if hist.resolve(r.commit) is None]
    assert unknown == []


def test_the_kernel_tables_name_what_the_writers_write():
    for kernel, suite in ri.SUITE_OF.items():
        src = (REPO / "benchmarks" / "suites" / f"{suite}.py").read_text()
        assert kernel in src, f"{kernel} is not written by benchmarks/suites/{suite}.py"
    e2e = "".join(p.read_text() for p in (REPO / "benchmarks" / "e2e").glob("*.py"))
    for kernel in ri.E2E_STEP:
        assert f'kernel="{kernel}"' in e2e, f"no benchmarks/e2e script writes rows kernel={kernel}"


def test_the_recomputed_reference_check_is_current_over_its_source():
    _, _, groups, _ = ri.generate(REPO)
    g = next(g for g in groups if (g.category, g.key) == ("e2e", "e2e_reference_check"))
    assert g.by_git
    assert g.current[0].name == "h200-2026-12-01-e2e-reference-recheck-5f462a5.json"
    assert "h200-2026-12-01-e2e-5f462a5.json" in [m[0].name for m in g.members[:-1]]


# ============================================================================ --check on a copy
@pytest.fixture
def copy(tmp_path):
    """A clone of this repository's history with the working tree's results folder and INDEX.md."""
    root = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(REPO), str(root)], check=True)
    shutil.copytree(RESULTS, root / "benchmarks" / "results")
    return root


def test_check_passes_on_an_unchanged_copy(copy):
    p = _run(copy, "--check")
    assert p.returncode == 0, p.stderr


def test_check_fails_on_a_results_file_not_in_the_index(copy):
    src = copy / "benchmarks" / "results" / "h200-2026-12-01-yoco-d80f014.json"
    new = src.with_name("h200-2026-12-02-yoco-d80f014.json")
    data = json.loads(src.read_text())
    data["meta"]["date"] = "2026-12-02T00:00:00+00:00"
    new.write_text(json.dumps(data))
    p = _run(copy, "--check")
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "h200-2026-12-02-yoco-d80f014.json not in it" in lines[0]
    assert _run(copy, "--write").returncode == 0
    assert _run(copy, "--check").returncode == 0
    # Same commit, later date: the new file is the yoco suite's current one.
    assert "| `yoco` | [`h200-2026-12-02-yoco-d80f014.json`]" in \
        (copy / "benchmarks" / "results" / "INDEX.md").read_text()


# ids "meta.<field>": a bare "gpu" id would read as the gpu marker (tests/conftest.py).
@pytest.mark.parametrize("field", ri.REQUIRED, ids=[f"meta.{f}" for f in ri.REQUIRED])
def test_check_fails_on_a_missing_meta_field(copy, field):
    f = copy / "benchmarks" / "results" / "h200-2026-12-01-mhc-d80f014.json"
    data = json.loads(f.read_text())
    del data["meta"][field]
    f.write_text(json.dumps(data, indent=1))
    p = _run(copy, "--check")
    assert p.returncode == 1
    assert p.stderr.count("\n") == 1
    assert "h200-2026-12-01-mhc-d80f014.json: meta lacks " + field in p.stderr


def test_check_fails_on_an_edited_index(copy):
    index = copy / "benchmarks" / "results" / "INDEX.md"
    index.write_text(index.read_text().replace("| `mhc` |", "| `mhc_old` |"))
    p = _run(copy, "--check")
    assert p.returncode == 1 and "stale at line" in p.stderr and "`mhc`" in p.stderr


# ============================================================================ a small repo
def _results_file(path: Path, commit: str, date: str, kernel="topk_swa", **meta):
    rows = [{"kernel": kernel, "variant": "sm80", "shape": {"T": t}, "ours_us": 1.0,
             "upstream_us": s, "speedup": s, "exact": True} for t, s in ((1, 2.0), (2, 4.0), (3, 3.0))]
    path.write_text(json.dumps({"meta": dict(gpu="NVIDIA H200", torch="2.11.0+cu130",
                                             triton="3.6.0", commit=commit, date=date, **meta),
                                "rows": rows}, indent=1) + "\n")


@pytest.fixture
def small(tmp_path):
    """A git repo with commits A < B and results old (at A, dated later) and new (at B)."""
    root = tmp_path / "small"
    res = root / "benchmarks" / "results"
    (res / "charts").mkdir(parents=True)
    _git(root.parent, "init", "-q", str(root))
    (root / "README.md").write_text("x\n")
    _git(root, "add", "README.md")
    _git(root, "commit", "-q", "-m", "A")
    a = _git(root, "rev-parse", "--short=7", "HEAD")
    (root / "README.md").write_text("y\n")
    _git(root, "commit", "-q", "-am", "B")
    b = _git(root, "rev-parse", "--short=7", "HEAD")
    # The older commit carries the later date: git history decides, not the date.
    _results_file(res / "h200-2026-12-02-topk-old.json", a, "2026-12-02T10:00:00+00:00")
    _results_file(res / "h200-2026-12-01-topk-new.json", b, "2026-12-01T10:00:00+00:00")
    (res / "charts" / "h200-2026-12-02-topk-old-topk_swa.png").write_bytes(b"\x89PNG\r\n\x1a\n\0")
    (root / "docs").mkdir()
    (root / "docs" / "notes.md").write_text(
        "See benchmarks/results/h200-2026-12-02-topk-old.json and `h200-2026-12-02-topk-old.json`,\n"
        "![chart](../benchmarks/results/charts/h200-2026-12-02-topk-old-topk_swa.png);\n"
        "not benchmarks/results/h200-2026-12-02-topk-old.jsonl nor x-h200-2026-12-02-topk-old.json.\n")
    (root / "tool.py").write_text('P = ROOT / "benchmarks" / "results" / "h200-2026-12-02-topk-old.json"\n')
    (root / "patches").mkdir()
    (root / "patches" / "x.patch").write_text("+# benchmarks/results/h200-2026-12-02-topk-old.json\n")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "results")
    return root, a, b


def test_the_descendant_commit_is_current_whatever_the_dates(small):
    root, a, b = small
    text, results, groups, hist = ri.generate(root)
    (g,) = groups
    assert (g.category, g.key, g.by_git) == ("suite", "topk_swa", True)
    assert g.current[0].name == "h200-2026-12-01-topk-new.json"
    assert "## Superseded files" in text and "[`h200-2026-12-02-topk-old.json`]" in text.split("## Superseded files")[1]
    # Headline figures come from the current file's rows: speedups 2, 4, 3.
    assert "sm80 ×3.00 (min ×2.00, 3)" in text and "bit-exact 3/3" in text


def test_a_recomputed_file_sorts_after_its_source_at_one_commit(small):
    root, a, b = small
    res = root / "benchmarks" / "results"
    # Same commit and date as the source, a name that sorts first: only meta.source orders it.
    _results_file(res / "h200-2026-12-01-a-recheck.json", b, "2026-12-01T10:00:00+00:00",
                  source="h200-2026-12-01-topk-new.json")
    _, _, (g,), _ = ri.generate(root)
    assert g.current[0].name == "h200-2026-12-01-a-recheck.json"


def test_a_commit_git_does_not_know_orders_the_group_by_date(small):
    root, a, b = small
    res = root / "benchmarks" / "results"
    _results_file(res / "h200-2026-12-03-topk-dev.json", "dev", "2026-12-03T00:00:00+00:00")
    text, _, (g,), _ = ri.generate(root)
    assert not g.by_git and g.unknown_commits == ["dev"]
    assert g.current[0].name == "h200-2026-12-03-topk-dev.json"
    assert "ordered by date: commit dev not in git history" in text


def test_check_refuses_a_shallow_clone(small, tmp_path):
    root, a, b = small
    assert _run(root, "--write").returncode == 0
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "index")
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{root}", str(shallow)], check=True)
    p = _run(shallow, "--check")
    assert p.returncode == 1 and "shallow clone" in p.stderr
    assert _run(root, "--check").returncode == 0


def test_archive_moves_superseded_files_and_rewrites_references(small):
    root, a, b = small
    assert _run(root, "--write").returncode == 0
    p = _run(root, "--archive")
    assert p.returncode == 0, p.stderr
    res = root / "benchmarks" / "results"
    assert not (res / "h200-2026-12-02-topk-old.json").exists()
    assert (res / "archive" / "h200-2026-12-02-topk-old.json").is_file()
    assert (res / "archive" / "charts" / "h200-2026-12-02-topk-old-topk_swa.png").is_file()
    assert (res / "h200-2026-12-01-topk-new.json").is_file()
    staged = _git(root, "diff", "--cached", "--name-status", "-M").splitlines()
    assert "R100\tbenchmarks/results/h200-2026-12-02-topk-old.json\t" \
           "benchmarks/results/archive/h200-2026-12-02-topk-old.json" in staged
    assert (root / "docs" / "notes.md").read_text() == (
        "See benchmarks/results/archive/h200-2026-12-02-topk-old.json and "
        "`archive/h200-2026-12-02-topk-old.json`,\n"
        "![chart](../benchmarks/results/archive/charts/h200-2026-12-02-topk-old-topk_swa.png);\n"
        "not benchmarks/results/h200-2026-12-02-topk-old.jsonl nor x-h200-2026-12-02-topk-old.json.\n")
    assert (root / "tool.py").read_text() == \
        'P = ROOT / "benchmarks" / "results" / "archive/h200-2026-12-02-topk-old.json"\n'
    # patches/ is generated or sha-checked: reported, not rewritten.
    assert (root / "patches" / "x.patch").read_text() == \
        "+# benchmarks/results/h200-2026-12-02-topk-old.json\n"
    assert "NOT rewritten" in p.stdout and "patches/x.patch" in p.stdout
    index = (res / "INDEX.md").read_text()
    assert "[`archive/h200-2026-12-02-topk-old.json`](archive/h200-2026-12-02-topk-old.json)" in index
    assert "archive/charts/h200-2026-12-02-topk-old-topk_swa.png" in index
    assert _run(root, "--check").returncode == 0
    # A second run has nothing left to move and rewrites nothing twice.
    before = (root / "docs" / "notes.md").read_text()
    p2 = _run(root, "--archive")
    assert p2.returncode == 0 and "moved" not in p2.stdout
    assert (root / "docs" / "notes.md").read_text() == before


def test_archived_current_file_fails_the_check(small):
    root, a, b = small
    res = root / "benchmarks" / "results"
    (res / "archive").mkdir()
    _git(root, "mv", "benchmarks/results/h200-2026-12-01-topk-new.json",
         "benchmarks/results/archive/h200-2026-12-01-topk-new.json")
    assert _run(root, "--write").returncode == 0
    p = _run(root, "--check")
    assert p.returncode == 1 and "lies in archive/" in p.stderr


def test_jsonl_sweeps_read_their_meta_from_the_first_line(tmp_path):
    f = tmp_path / "h200-2026-11-29-x-sweep-abcdef1.jsonl"
    f.write_text(json.dumps({"meta": {"gpu": "g", "torch": "t", "triton": "3", "commit": "abcdef1"}})
                 + "\n" + json.dumps({"us": 1.0}) + "\n" + json.dumps({"us": 2.0}) + "\n")
    r = ri._load(f, f.name)
    assert r.meta["commit"] == "abcdef1" and len(r.rows) == 2 and ri.missing_provenance(r) == []
    assert ri.classify(r) == {("sweep", "x-sweep"): r.rows}


# ============================================================================ the split
def test_the_index_and_its_two_siblings_need_only_the_standard_library():
    """results_index.py runs under a plain python3 (CI, no venv): it and the two modules it
    imports (results_headlines.py, results_archive.py) import only the standard library and
    one another, and the siblings do not import results_index (no circle)."""
    import ast
    own = {"results_index", "results_headlines", "results_archive"}
    for stem in sorted(own):
        p = REPO / "benchmarks" / f"{stem}.py"
        mods = set()
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(n, ast.Import):
                mods |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom):
                mods.add((n.module or "").split(".")[0])
        foreign = {m for m in mods - own if m not in sys.stdlib_module_names and m != "__future__"}
        assert not foreign, f"benchmarks/{stem}.py imports {sorted(foreign)}"
        if stem != "results_index":
            assert "results_index" not in mods, f"benchmarks/{stem}.py imports results_index"


def test_headline_dispatch_by_category():
    import results_headlines as rh
    rows = [{"kernel": "topk_swa", "variant": "sm80", "speedup": s, "exact": e}
            for s, e in ((2.0, True), (4.0, False))]
    assert ri.headline is rh.headline
    assert rh.headline("suite", "topk_swa", None, rows) == \
        "speedup vs upstream, median: sm80 ×3.00 (min ×2.00, 2); bit-exact 1/2"
    assert rh.headline("other", "mystery", None, rows) == "2 rows"


def test_reference_patterns_leave_longer_and_prefixed_names_alone():
    import results_archive as ra
    ((name, rx, new),) = ra.reference_patterns([("a-x.json", "archive/a-x.json")], "charts")
    text = "results/a-x.json `a-x.json` a-x.jsonl b-a-x.json other/a-x.json"
    assert rx.sub(new, text) == \
        "results/archive/a-x.json `archive/a-x.json` a-x.jsonl b-a-x.json other/a-x.json"
    ((_, crx, cnew),) = ra.reference_patterns([("charts/a-x-k.png", "archive/charts/a-x-k.png")],
                                              "charts")
    assert crx.sub(cnew, "results/charts/a-x-k.png") == "results/archive/charts/a-x-k.png"
