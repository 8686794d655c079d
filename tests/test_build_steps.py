"""The build pipeline's helpers: tools/steptime.py (the per-step timing table make verify and
make test print), tools/venv_cache.py (the venv keyed by its requirements and linked into a
clone), and the Makefile's verify graph (every check verify made before is still a step of
it, each step waits only on its inputs)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import steptime
import subproc
import venv_cache

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"


# ----------------------------------------------------------------------------- steptime
def test_steptime_records_each_step_and_passes_the_exit_status_through(tmp_path, capfd):
    d = tmp_path / "t"
    steptime.reset(d)
    assert steptime.run(d, "quick", [sys.executable, "-c", "print('hello')"]) == 0
    assert steptime.run(d, "bad", [sys.executable, "-c", "import sys; sys.exit(7)"]) == 7
    assert steptime.run(d, "missing", ["/nonexistent/command"]) == 127
    assert "hello" in capfd.readouterr().out  # the step's output is not swallowed
    recs = {r["name"]: r for r in steptime.load(d)}
    assert set(recs) == {"quick", "bad", "missing"}
    assert recs["bad"]["rc"] == 7 and recs["quick"]["end"] >= recs["quick"]["start"]
    table = steptime.table(steptime.load(d), "make verify steps")
    lines = table.splitlines()
    assert lines[0].startswith("make verify steps")
    assert [ln.split()[0] for ln in lines[2:5]] == ["quick", "bad", "missing"]  # start order
    assert "FAILED (exit 7)" in table and "FAILED (exit 127)" in table
    assert lines[-1].strip().startswith("wall")
    steptime.reset(d)
    assert steptime.load(d) == [] and "no step ran" in steptime.table([], "x")


def test_steptime_table_shows_parallel_steps_overlapping():
    recs = [{"name": "a", "start": 100.0, "end": 160.0, "rc": 0},
            {"name": "b", "start": 100.0, "end": 130.0, "rc": 0},
            {"name": "c", "start": 130.0, "end": 225.0, "rc": 0}]
    t = steptime.table(recs, "s")
    assert "+0.0 s" in t and "+30.0 s" in t and "1 min 00 s" in t and "1 min 35 s" in t
    # wall 125 s from the first start to the last end, 185 s of steps
    assert "wall 2 min 05 s for 3 min 05 s of steps (1.5 at a time" in t


def test_steptime_command_line(tmp_path):
    d = str(tmp_path / "t")
    tool = [sys.executable, str(TOOLS / "steptime.py"), "--dir", d]
    r = subproc.run(tool + ["run", "one", "--", sys.executable, "-c", "raise SystemExit(3)"],
                    cap=60)
    assert r.returncode == 3
    r = subproc.run(tool + ["report", "--title", "T"], cap=60)
    assert r.returncode == 0 and r.stdout.startswith("T (") and "FAILED (exit 3)" in r.stdout


# ----------------------------------------------------------------------------- venv_cache
def test_venv_key_follows_the_requirements(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("torch==2.13.0\n")
    b.write_text("regex\n")
    k = venv_cache.venv_key([a, b])
    assert len(k) == 16 and k == venv_cache.venv_key([a, b])
    b.write_text("regex>=2024\n")
    assert venv_cache.venv_key([a, b]) != k
    # a stage's stamp covers its arguments and the contents of the files they name
    h = venv_cache._stage_hash(["-r", "a.txt"], tmp_path)
    a.write_text("torch==2.13.0\npytest\n")
    assert venv_cache._stage_hash(["-r", "a.txt"], tmp_path) != h
    assert venv_cache._stage_hash(["torch==2.13.0", "-r", "a.txt"], tmp_path) != \
        venv_cache._stage_hash(["-r", "a.txt"], tmp_path)


def test_prune_keeps_the_most_recently_used(tmp_path):
    now = time.time()
    for i in range(5):
        env = tmp_path / f"venv-{i:016d}"
        env.mkdir()
        (env / ".ok").write_text("x")
        os.utime(env / ".ok", (now - 1000 * i, now - 1000 * i))  # venv-0 newest
    import fcntl
    with open(tmp_path / "venv-0000000000000004.lock", "w") as held:  # in use: kept
        fcntl.flock(held, fcntl.LOCK_EX)
        gone = venv_cache.prune(tmp_path, keep=2)
    assert sorted(p.name for p in gone) == ["venv-0000000000000002", "venv-0000000000000003"]
    assert sorted(p.name for p in tmp_path.glob("venv-*") if p.is_dir()) == [
        "venv-0000000000000000", "venv-0000000000000001", "venv-0000000000000004"]


def test_a_clone_links_the_cached_venv_and_installs_nothing_twice(tmp_path):
    """Two clones, one requirements set: the first builds the keyed venv, the second links it
    without running pip; a changed requirements file gives a new venv. The requirement is pip
    itself (installed with the venv), so nothing is downloaded."""
    cache = tmp_path / "cache"
    reqs = {}
    for clone in ("one", "two"):
        c = tmp_path / clone
        c.mkdir()
        (c / "req.txt").write_text("pip\n")
        reqs[clone] = c

    def ensure(clone: str):
        c = reqs[clone]
        return subproc.run([sys.executable, str(TOOLS / "venv_cache.py"), "--venv", ".venv",
                            "--stage", "ok", "--key-file", "req.txt", "--cache", str(cache),
                            "--", "-r", "req.txt"], cwd=str(c), cap=600)

    r = ensure("one")
    assert r.returncode == 0, r.stdout + r.stderr
    link = reqs["one"] / ".venv"
    assert link.is_symlink() and (link / "bin" / "python").exists()
    target = Path(os.readlink(link))
    assert target.parent == cache and (target / ".ok").read_text().strip()
    r = ensure("two")
    assert r.returncode == 0 and "already in" in r.stdout and "pip install" not in r.stdout
    assert Path(os.readlink(reqs["two"] / ".venv")) == target
    out = subproc.run([str(reqs["two"] / ".venv" / "bin" / "python"), "-c",
                       "import sys; print(sys.prefix)"], cap=60).stdout.strip()
    assert Path(out).resolve() == target.resolve()
    (reqs["two"] / "req.txt").write_text("pip\n# changed\n")
    r = ensure("two")
    assert r.returncode == 0, r.stdout + r.stderr
    assert Path(os.readlink(reqs["two"] / ".venv")) != target
    assert Path(os.readlink(reqs["one"] / ".venv")) == target  # the other clone keeps its own


def test_a_real_venv_directory_is_installed_into_in_place(tmp_path):
    """An existing .venv directory (a checkout from before the cache) is never replaced by a
    link: its stage is installed into it."""
    (tmp_path / "req.txt").write_text("pip\n")
    assert subproc.run([sys.executable, "-m", "venv", str(tmp_path / ".venv")],
                       cap=300).returncode == 0
    r = subproc.run([sys.executable, str(TOOLS / "venv_cache.py"), "--venv", ".venv", "--stage",
                     "extra", "--key-file", "req.txt", "--cache", str(tmp_path / "cache"), "--",
                     "-r", "req.txt"], cwd=str(tmp_path), cap=600)
    assert r.returncode == 0, r.stdout + r.stderr
    venv = tmp_path / ".venv"
    assert venv.is_dir() and not venv.is_symlink() and (venv / ".ok-extra").is_file()
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("venv-*"))


# ----------------------------------------------------------------------------- Makefile
def _make_db() -> dict[str, list[str]]:
    """Each target's prerequisites, from make's database (nothing is run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    r = subproc.run(["make", "-pqn", "-f", str(REPO / "Makefile"), "help"], cwd=str(REPO),
                    env=env, cap=120)
    db = {}
    for line in r.stdout.splitlines():
        if ":" in line and not line.startswith(("#", "\t", " ")) and "=" not in line.split(":")[0]:
            name, _, deps = line.partition(":")
            if deps.startswith(("=", ":")):
                continue
            db.setdefault(name.strip(), deps.split())
    return db


def test_verify_keeps_every_check_and_runs_them_side_by_side():
    if subprocess.run(["make", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no make")
    db = _make_db()
    steps = set(db["verify-steps"])
    assert {"combined-check", "overlay", "gate", "gate-mhc", "verify-exact"} <= steps, steps
    assert any(s.endswith("patched/.ok") for s in steps), steps
    # each check waits on its inputs only: the exactness tests and the Triton gate on the
    # first venv stage, not on the gates or on vLLM's import packages
    assert set(db["verify-exact"]) == {"venv-base", "upstream-kernels"}
    assert db["gate"] == ["venv-base"]
    assert "venv" in db["gate-mhc"]  # the mHC gate imports vLLM: the full venv
    assert {"results-index-check", "test-suite"} <= set(db["test-steps"])
    assert db["verify"] == [] and db["test"] == []  # both run their steps in a sub-make


def test_results_index_targets():
    text = (REPO / "Makefile").read_text()
    assert "benchmarks/results_index.py --write" in text
    assert "benchmarks/results_index.py --check" in text
    assert (REPO / "benchmarks" / "results_index.py").is_file()
