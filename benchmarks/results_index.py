#!/usr/bin/env python3
"""benchmarks/results/INDEX.md: which results file is current, per benchmark suite, e2e step,
GPU test file, sweep and A100 model prediction, with its commit, GPU and headline figures.

    python3 benchmarks/results_index.py --write     # (re)write benchmarks/results/INDEX.md
    python3 benchmarks/results_index.py --check     # exit 1, one line, if INDEX.md is stale
                                                    # or a results file lacks provenance
    python3 benchmarks/results_index.py --archive   # git mv superseded files (and their
                                                    # charts) into benchmarks/results/archive/,
                                                    # rewrite references, rewrite INDEX.md

Standard library only: runs under a plain ``python3`` (no venv, no torch). It reads every
results file under benchmarks/results/ and benchmarks/results/archive/ (``*.json``; ``*.jsonl``
with the meta on its first line), and the charts under ``charts/`` beside them.

Groups (a file can be in several; the rules are written out in INDEX.md's header too):

* benchmark suite (benchmarks/run.py): rows whose ``kernel`` belongs to a suite
  (``SUITE_OF``), grouped by that suite;
* e2e step (benchmarks/e2e): rows of one e2e row kernel (``E2E_STEP``);
* GPU test file: ``gpu_tests`` rows, one group per test file named in ``shape.file``;
* A100 model prediction: ``a100-model-*`` files (tools/a100_model.py), by file-name stem;
* sweep / probe / diagnostic: files whose rows carry no ``kernel``, by file-name stem (the
  ``<gpu>-<date>-`` prefix and a trailing ``-<commit>`` taken off).

Current = the newest file of a group; superseded = a file current in no group. Newest is decided
by git history (``History``): the measured commit (``meta.code_commit`` where the code that ran
differs from ``meta.commit``, else ``meta.commit``) of a descendant sorts after its ancestors
(generation number), commits unrelated by ancestry by committer date, then a file recomputed
from another (``meta.source``) after its source, then ``meta.date``, then the file name. A group
holding a commit git does not know is ordered by date instead (``meta.date``, else the date in
the file name), and INDEX.md says so. The output depends only on the files and the git history,
never on the clock or the machine; ``--check`` refuses to judge without full history (a
shallow clone: fetch with ``fetch-depth: 0``).

Provenance: every file's meta must carry non-empty ``gpu``, ``torch``, ``triton`` and
``commit`` (``REQUIRED``); ``--check`` names the first file that does not.
"""
from __future__ import annotations

import argparse
import bisect
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "benchmarks") not in sys.path:   # its two siblings, however it is imported
    sys.path.insert(0, str(REPO / "benchmarks"))
import results_archive  # noqa: E402  (--archive: the git mv and the reference rewrite)
from results_headlines import EXTRA_STEP, headline  # noqa: E402  (INDEX.md's headlines)

RESULTS_REL = Path("benchmarks") / "results"
INDEX_NAME = "INDEX.md"
ARCHIVE = "archive"
CHARTS = "charts"

# The provenance every results file's meta must carry: what ran it (gpu; for an a100-model
# file the modelled GPUs), with which torch and Triton, at which commit.
REQUIRED = ("gpu", "torch", "triton", "commit")

# Row kernel -> benchmarks/suites/<suite>.py that writes it (tests/test_results_index.py
# checks each name appears in that suite's source). A kernel of the form "family.sub" is
# looked up by the whole name, then by "family".
SUITE_OF = {
    "topk_swa": "topk_swa",
    "kv_gather": "kv_gather",
    "fp8_decode": "fp8", "ue8m0_exponent": "fp8",
    "v41_rope_quant_insert": "fp8_writers", "v41_indexer_k_store": "fp8_writers",
    "v4_indexer_q_rope_quant": "fp8_writers", "v4_inv_rope_fp8_quant": "fp8_writers",
    "v4_compress_c4a": "fp8_writers_v4_compress", "v4_compress_c128a": "fp8_writers_v4_compress",
    "v4_compress_indexer": "fp8_writers_v4_compress",
    "sparse_mla_decode": "sparse_mla_decode",
    "sparse_mla_prefill": "sparse_mla_prefill",
    "indexer_logits": "indexer_logits",
    "one_layer": "one_layer",
    "mhc_fused_post_pre": "mhc", "mhc_pre": "mhc", "mhc_post": "mhc", "hc_head": "mhc",
    "yoco": "yoco",
}

# e2e row kernel -> the step of benchmarks/e2e/e2e.py (or the script) that writes it
# (tests/test_results_index.py checks each name appears in benchmarks/e2e/).
E2E_STEP = {
    "sm80_audit": "agree (sm_80 audit)",
    "e2e_agreement": "agree, graphs",
    "e2e": "tput",
    "yoco_e2e": "yoco",
    "e2e_repeat": "yoco (run-to-run floor)",
    "yoco_verify": "yoco (verify modes)",
    "zero_compile": "nocompile",
    "e2e_vs_fp32_reference": "reference",
    "e2e_reference_check": "reference (check)",
    "e2e_determinism": "determinism.py",
    **EXTRA_STEP,   # per-rank shapes, the long step's agreement (results_headlines.py: why)
}
GPU_TESTS = "gpu_tests"

CATEGORIES = (
    ("suite", "Benchmark suites (benchmarks/run.py)"),
    ("e2e", "End-to-end steps (benchmarks/e2e)"),
    ("tests", "GPU test runs (pytest on the GPU machine), per test file"),
    ("sweep", "Sweeps, probes and diagnostics (benchmarks/diag and others)"),
    ("model", "A100 model predictions (tools/a100_model.py; predictions, not measurements)"),
    ("other", "Rows of kernels this index does not know (add them to SUITE_OF or E2E_STEP)"),
)

_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")
_PREFIX = re.compile(r"^[a-z0-9]+-\d{4}-\d{2}-\d{2}-")   # "<gpu>-<date>-"
_COMMIT_SUFFIX = re.compile(r"-[0-9a-f]{7,40}$")
_HEX = re.compile(r"^[0-9a-f]{7,40}$")   # git's shortest default abbreviation is 7


class ResultsError(Exception):
    """A results file this tool cannot read; the message names it."""


# ============================================================================ reading
@dataclass
class Result:
    rel: str            # path under benchmarks/results/: "NAME" or "archive/NAME"
    meta: dict
    rows: list
    data: dict          # the whole file (jsonl: {"meta":..., "rows":...})
    charts: list = field(default_factory=list)   # paths under benchmarks/results/

    @property
    def name(self) -> str:
        return self.rel.rsplit("/", 1)[-1]

    @property
    def stem(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def archived(self) -> bool:
        return self.rel.startswith(ARCHIVE + "/")

    @property
    def date(self) -> str:
        d = self.meta.get("date")
        if isinstance(d, str) and d:
            return d
        m = _DATE.search(self.name)
        return m.group(1) if m else ""

    @property
    def commit(self) -> str | None:
        """The commit whose code ran (code_commit where the file names one)."""
        c = self.meta.get("code_commit") or self.meta.get("commit")
        return c if isinstance(c, str) and c else None


def _load(path: Path, rel: str) -> Result:
    text = path.read_text()
    try:
        if path.suffix == ".jsonl":
            meta, rows = None, []
            for i, line in enumerate(text.splitlines()):
                if not line.strip():
                    continue
                obj = json.loads(line)
                if meta is None and isinstance(obj, dict) and set(obj) == {"meta"}:
                    meta = obj["meta"]
                else:
                    rows.append(obj)
            data = {"meta": meta, "rows": rows}
        else:
            data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResultsError(f"{rel}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict):
        raise ResultsError(f"{rel}: no meta dict (a results file is {{\"meta\": ..., \"rows\": ...}})")
    rows = data.get("rows") or []
    if not isinstance(rows, list):
        raise ResultsError(f"{rel}: rows is not a list")
    return Result(rel=rel, meta=data["meta"], rows=rows, data=data)


def load_results(results: Path) -> tuple[list[Result], list[str]]:
    """The results files (benchmarks/results/ then archive/) with their charts, and the charts
    that belong to no results file."""
    out = []
    for sub in ("", ARCHIVE):
        d = results / sub if sub else results
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if p.is_file() and p.suffix in (".json", ".jsonl"):
                out.append(_load(p, f"{sub}/{p.name}" if sub else p.name))
    charts = []
    for sub in (CHARTS, f"{ARCHIVE}/{CHARTS}"):
        d = results / sub
        if d.is_dir():
            charts += [f"{sub}/{p.name}" for p in sorted(d.iterdir()) if p.suffix == ".png"]
    by_stem = {r.stem: r for r in out}
    orphans = []
    for c in charts:
        # A chart is <results stem>-<what>.png (charts.py, a100_model.py): the longest
        # results stem it starts with owns it.
        cstem = c.rsplit("/", 1)[-1][:-len(".png")]
        owner = max((s for s in by_stem if cstem == s or cstem.startswith(s + "-")),
                    key=len, default=None)
        if owner is None:
            orphans.append(c)
        else:
            by_stem[owner].charts.append(c)
    return out, orphans


def missing_provenance(r: Result) -> list[str]:
    return [k for k in REQUIRED if not (isinstance(r.meta.get(k), str) and r.meta[k].strip())]


# ============================================================================ git history
def _git(root: Path, *args: str) -> str | None:
    try:
        p = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                           check=False)
    except OSError:
        return None
    return p.stdout if p.returncode == 0 else None


class History:
    """The commits reachable from HEAD: generation (1 + the largest parent's; a root is 1)
    and committer time, both properties of a commit alone, so the order they give does not
    change when commits are added."""

    def __init__(self, root: Path):
        self.gen: dict[str, int] = {}
        self.time: dict[str, int] = {}
        self.reason = None
        if _git(root, "rev-parse", "--git-dir") is None:
            self.reason = "not a git checkout"
            return
        if (_git(root, "rev-parse", "--is-shallow-repository") or "").strip() == "true":
            self.reason = "shallow clone (fetch the full history: git fetch --unshallow, " \
                          "or fetch-depth: 0 in CI)"
            return
        log = _git(root, "log", "--topo-order", "--reverse", "--format=%H %ct %P", "HEAD")
        if log is None:
            self.reason = "git log HEAD failed (no commits?)"
            return
        for line in log.splitlines():
            sha, ct, *parents = line.split()
            self.gen[sha] = 1 + max((self.gen.get(p, 0) for p in parents), default=0)
            self.time[sha] = int(ct)
        self._shas = sorted(self.gen)

    @property
    def available(self) -> bool:
        return self.reason is None

    def resolve(self, commit: str | None) -> str | None:
        """The full sha a recorded commit names ("abc1234", "abc1234+dirty", a full sha), or
        None when it names no single commit of this history."""
        if not commit or not self.available:
            return None
        c = commit.strip().split("+", 1)[0].lower()
        if not _HEX.match(c):
            return None
        i = bisect.bisect_left(self._shas, c)
        hits = []
        while i < len(self._shas) and self._shas[i].startswith(c):
            hits.append(self._shas[i])
            i += 1
        return hits[0] if len(hits) == 1 else None


# ============================================================================ grouping
@dataclass
class Group:
    category: str
    key: str
    members: list = field(default_factory=list)      # [(Result, rows of this group)]
    by_git: bool = True
    unknown_commits: list = field(default_factory=list)

    @property
    def current(self):
        return self.members[-1]


def sweep_key(r: Result) -> str:
    s = _PREFIX.sub("", r.stem)
    return _COMMIT_SUFFIX.sub("", s) or s


def _suite_of(kernel: str, meta: dict) -> str | None:
    if kernel in SUITE_OF:
        return SUITE_OF[kernel]
    fam = kernel.split(".", 1)[0]
    if fam in SUITE_OF:
        return SUITE_OF[fam]
    suites = meta.get("suites")
    if isinstance(suites, list) and len(suites) == 1:
        return suites[0]
    return None


def classify(r: Result) -> dict[tuple[str, str], list]:
    """(category, key) -> the rows of r in that group."""
    if r.name.startswith("a100-model-"):
        return {("model", sweep_key(r)): r.rows}
    out: dict[tuple[str, str], list] = {}
    kernel_rows = [row for row in r.rows if isinstance(row, dict) and isinstance(row.get("kernel"), str)]
    if not kernel_rows:
        return {("sweep", sweep_key(r)): r.rows}
    for row in kernel_rows:
        k = row["kernel"]
        if k == GPU_TESTS:
            files = str((row.get("shape") or {}).get("file") or "?").split()
            keys = [("tests", f) for f in files]
        elif k in E2E_STEP:
            keys = [("e2e", k)]
        else:
            s = _suite_of(k, r.meta)
            keys = [("suite", s)] if s else [("other", k)]
        for key in keys:
            out.setdefault(key, []).append(row)
    return out


def _depths(results: list[Result]) -> dict[str, int]:
    """How many recomputations a file is from a measurement (meta.source names its source)."""
    by_name = {r.name: r for r in results}
    out: dict[str, int] = {}

    def depth(r: Result, seen=()) -> int:
        if r.name in out:
            return out[r.name]
        src = r.meta.get("source")
        d = 0
        if isinstance(src, str):
            s = by_name.get(src.rsplit("/", 1)[-1])
            if s is not None and s.name not in seen and s is not r:
                d = 1 + depth(s, seen + (r.name,))
        out[r.name] = d
        return d

    for r in results:
        depth(r)
    return out


def build_groups(results: list[Result], hist: History) -> list[Group]:
    groups: dict[tuple[str, str], Group] = {}
    for r in results:
        for (cat, key), rows in classify(r).items():
            groups.setdefault((cat, key), Group(cat, key)).members.append((r, rows))
    depth = _depths(results)
    for g in groups.values():
        shas = {m[0].rel: hist.resolve(m[0].commit) for m in g.members}
        g.unknown_commits = sorted({m[0].commit or "(none)" for m in g.members
                                    if shas[m[0].rel] is None})
        g.by_git = hist.available and not g.unknown_commits
        if g.by_git:
            g.members.sort(key=lambda m: (hist.gen[shas[m[0].rel]], hist.time[shas[m[0].rel]],
                                          depth[m[0].name], m[0].date, m[0].rel))
        else:
            g.members.sort(key=lambda m: (m[0].date, depth[m[0].name], m[0].rel))
    order = {c: i for i, (c, _) in enumerate(CATEGORIES)}
    steps = {k: i for i, k in enumerate(E2E_STEP)}
    return sorted(groups.values(), key=lambda g: (order[g.category], steps.get(g.key, 0)
                                                  if g.category == "e2e" else 0, g.key))


# ============================================================================ INDEX.md
HEADER = """\
# Results index

GENERATED by `python3 benchmarks/results_index.py --write` (`make results-index`) from the
results files in this folder; `python3 benchmarks/results_index.py --check` (CI) fails when it
is stale or a file lacks provenance. Do not edit by hand: regenerate it whenever a results
file is added, changed, moved or removed.

The GPU column is the machine that measured the file. Every GPU figure committed here is an
H200 (SM90) measurement: `sm80` rows are our Ampere kernels run on the H200, and the e2e `a100`
mode is the A100 kernel selection emulated on the H200; none of them is an A100 timing. The
a100-model files hold predictions of tools/a100_model.py (their GPU column names the modelled
GPUs), not measurements. Headline figures are computed from the current file's rows of the
group alone.

## Rules

- **Groups.** A *suite* group holds the rows of one benchmark suite (row `kernel` -> suite,
  `SUITE_OF` in benchmarks/results_index.py); an *e2e step* group the rows of one e2e row
  kernel (`E2E_STEP`); a *GPU test* group the `gpu_tests` rows naming one test file; *sweeps*
  (rows without `kernel`) and *A100 model* files group by file name less its `<gpu>-<date>-`
  prefix and trailing `-<commit>`. One file can be in several groups.
- **Current** is the newest file of a group. **Newest**: the file whose measured commit
  (`meta.code_commit` where the code that ran differs from `meta.commit`, else `meta.commit`)
  comes later in git history: a commit after every one of its ancestors (generation number: the
  longest parent chain from the root), commits unrelated by ancestry by committer date; at one
  commit, a file recomputed from another (`meta.source`) after its source, then the later
  `meta.date`, then the file name. A group holding a commit that git does not know is ordered
  by date (`meta.date`, else the date in the file name), and says so.
- **Superseded**: a file current in no group. `--archive` moves superseded files (and their
  charts) into `archive/` and rewrites references to them.
- **Provenance**: every file's meta carries `gpu`, `torch`, `triton` and `commit`; values filled in
  afterwards say where they came from (`provenance_note`, `source_note`, `commit_note`).
"""


def _link(rel: str) -> str:
    return f"[`{rel}`]({rel})"


def _cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _short(commit: str | None) -> str:
    if not commit:
        return "—"
    c = commit.split("+", 1)
    return c[0][:7] + ("+" + c[1] if len(c) > 1 else "")


def _charts(r: Result) -> str:
    if not r.charts:
        return ""
    names = [c.rsplit("/", 1)[-1][len(r.stem) + 1:-len(".png")] or "chart" for c in r.charts]
    return "; charts: " + ", ".join(f"[{n}]({c})" for n, c in zip(names, r.charts))


def render(results: list[Result], groups: list[Group], orphans: list[str]) -> str:
    lines = [HEADER]
    titles = dict(CATEGORIES)
    current_of: dict[str, list[str]] = {}
    for g in groups:
        current_of.setdefault(g.current[0].rel, []).append(f"{g.category}:{g.key}")
    for cat, title in CATEGORIES:
        gs = [g for g in groups if g.category == cat]
        if not gs:
            continue
        first = "step (row kernel)" if cat == "e2e" else {"suite": "suite", "tests": "test file",
                                                           "sweep": "sweep", "model": "prediction",
                                                           "other": "row kernel"}[cat]
        lines += [f"## {title}", "",
                  f"| {first} | current file | commit | GPU | date | headline (current file) | older |",
                  "|---|---|---|---|---|---|---|"]
        for g in gs:
            r = g.current[0]
            name = f"{E2E_STEP[g.key]} (`{g.key}`)" if cat == "e2e" else f"`{g.key}`"
            older = len(g.members) - 1
            order = "" if g.by_git else (" (ordered by date: commit "
                                         + ", ".join(g.unknown_commits) + " not in git history)")
            lines.append("| " + " | ".join(_cell(x) for x in (
                name, _link(r.rel) + (" (in archive/)" if r.archived else ""), _short(r.commit),
                r.meta.get("gpu", "—"), r.date[:10] or "—",
                headline(g.category, g.key, *g.current) + _charts(r), f"{older}{order}")) + " |")
        lines.append("")
    sup = [r for r in results if r.rel not in current_of]
    lines += ["## Superseded files", ""]
    if not sup:
        lines += ["None.", ""]
    else:
        lines += ["| file | commit | GPU | date | superseded in (group: current file) |",
                  "|---|---|---|---|---|"]
        for r in sorted(sup, key=lambda r: r.rel):
            by = []
            for g in groups:
                if any(m[0] is r for m in g.members):
                    by.append(f"{g.category}:{g.key}: `{g.current[0].name}`")
            lines.append("| " + " | ".join(_cell(x) for x in (
                _link(r.rel) + _charts(r).replace("; charts:", " — charts:"), _short(r.commit),
                r.meta.get("gpu", "—"), r.date[:10] or "—", "; ".join(by))) + " |")
        lines.append("")
    if orphans:
        lines += ["## Charts without a results file", ""] + [f"- {_link(c)}" for c in orphans] + [""]
    lines.append(f"{len(results)} results files, {len(results) - len(sup)} current, "
                 f"{len(sup)} superseded ({sum(r.archived for r in sup)} of them in archive/).")
    return "\n".join(lines) + "\n"


def generate(root: Path) -> tuple[str, list[Result], list[Group], History]:
    results_dir = root / RESULTS_REL
    results, orphans = load_results(results_dir)
    hist = History(root)
    groups = build_groups(results, hist)
    return render(results, groups, orphans), results, groups, hist


# ============================================================================ check
def _listed(text: str) -> set[str]:
    return set(re.findall(r"\[`([^`]+\.jsonl?)`\]", text))


def check(root: Path) -> str | None:
    """None when INDEX.md is current and every file has provenance; else one line saying what
    differs."""
    try:
        text, results, groups, hist = generate(root)
    except ResultsError as e:
        return str(e)
    for r in results:
        miss = missing_provenance(r)
        if miss:
            return f"{RESULTS_REL / r.rel}: meta lacks {', '.join(miss)} (provenance: {', '.join(REQUIRED)})"
    if not hist.available:
        return f"cannot order runs by commit: {hist.reason}"
    for g in groups:
        if g.current[0].archived:
            return (f"{RESULTS_REL / g.current[0].rel} is the current file of {g.category}:{g.key} "
                    f"but lies in archive/: move it back")
    index = root / RESULTS_REL / INDEX_NAME
    if not index.is_file():
        return f"{RESULTS_REL / INDEX_NAME} is missing: run python3 benchmarks/results_index.py --write"
    old = index.read_text()
    if old == text:
        return None
    fix = "run python3 benchmarks/results_index.py --write"
    new_files, gone = _listed(text) - _listed(old), _listed(old) - _listed(text)
    if new_files:
        return f"{RESULTS_REL / INDEX_NAME} is stale: {', '.join(sorted(new_files))} not in it ({fix})"
    if gone:
        return f"{RESULTS_REL / INDEX_NAME} is stale: lists {', '.join(sorted(gone))}, no longer there ({fix})"
    a, b = old.splitlines(), text.splitlines()
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    want = b[n] if n < len(b) else "(end of file)"
    return (f"{RESULTS_REL / INDEX_NAME} is stale at line {n + 1}: expected {want[:160]!r} ({fix})")


# ============================================================================ archive
def archive(root: Path) -> dict:
    """Move every superseded file still in benchmarks/results/ (and its charts) into
    benchmarks/results/archive/ with git mv, rewrite references to them in tracked text files,
    rewrite INDEX.md. Nothing is committed. Files under patches/ are never rewritten (the
    combined patch is generated and the series is checked by sha256): references found there are
    reported instead. The moving and rewriting are benchmarks/results_archive.py's."""
    text, results, groups, hist = generate(root)
    if not hist.available:
        raise SystemExit(f"results_index --archive: cannot order runs by commit: {hist.reason}")
    moves = results_archive.superseded_moves(results, {g.current[0].rel for g in groups}, ARCHIVE)
    results_archive.git_mv(root, RESULTS_REL, moves)
    rewritten, untouched = results_archive.rewrite_references(
        root, moves, CHARTS, skip={str(RESULTS_REL / INDEX_NAME)})
    text, *_ = generate(root)
    (root / RESULTS_REL / INDEX_NAME).write_text(text)
    return {"moved": moves, "rewritten": rewritten, "left_in_patches": untouched,
            "overlay_changed": any(p.startswith("overlay/") for p in rewritten)}


# ============================================================================ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write benchmarks/results/INDEX.md")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 with one line when INDEX.md is stale or provenance is missing")
    mode.add_argument("--archive", action="store_true",
                      help="git mv superseded files into benchmarks/results/archive/")
    mode.add_argument("--print", action="store_true", help="print the index to stdout")
    ap.add_argument("--root", type=Path, default=REPO, help="repository root (default: this one)")
    a = ap.parse_args(argv)
    root = a.root.resolve()
    if a.check:
        msg = check(root)
        if msg:
            print(f"results_index --check: {msg}", file=sys.stderr)
            return 1
        print("results_index --check: INDEX.md current, provenance complete")
        return 0
    if a.archive:
        out = archive(root)
        for old, new in out["moved"]:
            print(f"moved {RESULTS_REL / old} -> {RESULTS_REL / new}")
        for rel in out["rewritten"]:
            print(f"rewrote references in {rel}")
        for rel in out["left_in_patches"]:
            print(f"NOT rewritten (patches/ is generated or sha-checked): {rel}: fix its source")
        if out["overlay_changed"]:
            print("overlay/ changed: regenerate the combined patch (make combined)")
        print(f"wrote {RESULTS_REL / INDEX_NAME}; review and commit (nothing was committed)")
        return 0
    try:
        text, results, _, hist = generate(root)
    except ResultsError as e:
        print(f"results_index: {e}", file=sys.stderr)
        return 1
    if a.print:
        sys.stdout.write(text)
        return 0
    (root / RESULTS_REL / INDEX_NAME).write_text(text)
    note = "" if hist.available else f" (WARNING: {hist.reason}: ordered by date)"
    print(f"wrote {RESULTS_REL / INDEX_NAME}: {len(results)} results files{note}")
    for r in results:
        miss = missing_provenance(r)
        if miss:
            print(f"  {r.rel}: meta lacks {', '.join(miss)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
