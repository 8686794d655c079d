"""The repository stands alone and its docs say what the tools do.

No file refers to anything outside the repository or uses words from outside the project;
the README's hardware table and install method are right; docs/docker.md gives the
in-container check; `make verify` prints its OK line only after its tests pass; and every
row of the fault table in docs/reliability.md names a test that exists.
"""
from __future__ import annotations

import os
import re
import stat
import subprocess

import pytest

from reliability_fakes import REPO
import subproc

# Assembled from pieces so that this file does not match itself.
_OUTSIDE = ["../" + "shared", "DESIGN" + ".md"]
_INTERNAL = [re.compile(p, re.I) for p in (r"\bthe " + "lead\\b", r"\blead" + "'s\\b",
                                           r"\(issue" + r" \d", r"\bissue" + r" #?\d+\b")]


def _tracked_text_files():
    r = subprocess.run(["git", "-c", "safe.directory=*", "ls-files", "-z"], cwd=REPO,
                       capture_output=True)
    if r.returncode == 0 and r.stdout:
        names = [n for n in r.stdout.decode().split("\0") if n]
        # also what is about to be committed in this checkout
        u = subprocess.run(["git", "-c", "safe.directory=*", "ls-files", "-z", "--others",
                            "--exclude-standard"], cwd=REPO, capture_output=True)
        names += [n for n in u.stdout.decode().split("\0") if n]
    else:  # an exported tree without .git
        names = [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()
                 and not {".git", ".venv", "build", "__pycache__"} & set(p.relative_to(REPO).parts)]
    for n in sorted(set(names)):
        p = REPO / n
        if not p.is_file() or p.suffix in {".png", ".gz", ".whl", ".pyc"}:
            continue
        try:
            yield n, p.read_text()
        except UnicodeDecodeError:
            continue


def test_no_reference_outside_the_repository_and_no_internal_words():
    bad = []
    for name, text in _tracked_text_files():
        for needle in _OUTSIDE:
            if needle in text:
                bad.append(f"{name}: {needle}")
        for rx in _INTERNAL:
            m = rx.search(text)
            if m:
                bad.append(f"{name}: {m.group(0)!r}")
    assert not bad, "; ".join(bad)


def test_readme_hardware_and_install_sections():
    readme = (REPO / "README.md").read_text()
    row = next(ln for ln in readme.splitlines() if ln.startswith("| 8.6, 8.7 |"))
    assert "A10 (Orin)" not in row and "Orin (8.7)" in row  # the A10 is GA102 (8.6)
    install = readme[readme.index("## Install"):readme.index("## Benchmarks")]
    for must in ("git apply --check -v", "tools/patchset.py verify --tree", "--directory=",
                 "RESULTS.sha256", "install_overlay.py status", "docs/reliability.md"):
        assert must in install, must


def test_docker_doc_gives_the_in_container_check():
    doc = (REPO / "docs" / "docker.md").read_text()
    assert "install_overlay.py status" in doc and "--vllm-dir" in doc
    assert "install_overlay.py mounts --site" in doc and ":ro" in doc


def test_fault_table_rows_name_existing_tests():
    doc = (REPO / "docs" / "reliability.md").read_text()
    table = doc[doc.index("## Fault-injection table"):]
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "`tests/" in ln]
    assert len(rows) >= 20
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 4 and cells[2], row  # what was tried | what happened | lost | test
        refs = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", cells[3])
        assert refs, row
        for path, name in refs:
            src = (REPO / path).read_text()
            assert re.search(rf"^def {name}\(", src, re.M), f"{path}::{name} (docs/reliability.md)"


def test_combined_patch_is_generated_whitespace_clean():
    text = (REPO / "patches" / "vllm-0.33.0-deepinfer.patch").read_text()
    assert not text.endswith("\n\n")
    added = [ln for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert not [ln for ln in added if ln != ln.rstrip()], "trailing whitespace in the patch"


def _fake_python(tmp_path, rc):
    f = tmp_path / "py"
    f.write_text(f"#!/bin/sh\necho PYTEST-RAN\nexit {rc}\n")
    f.chmod(f.stat().st_mode | stat.S_IXUSR)
    return f


@pytest.mark.parametrize("rc", [0, 1])
def test_make_verify_prints_ok_only_after_its_tests_pass(tmp_path, rc):
    """Before: the recipe echo showed the OK line before pytest ran (and even when it failed)."""
    if subprocess.run(["make", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no make")
    old = ["-o", "venv", "-o", "venv-base", "-o", "upstream-kernels", "-o", "build/patched/.ok",
           "-o", "combined-check", "-o", "overlay", "-o", "gate"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    r = subproc.run(["make", "--no-print-directory", *old, "verify",
                     f"PY={_fake_python(tmp_path, rc)}", "STEP_MAKEFLAGS=" + " ".join(old)],
                    cwd=REPO, env=env, cap=120)
    out = r.stdout + r.stderr
    assert "PYTEST-RAN" in out, out
    if rc == 0:
        assert r.returncode == 0 and "verify: OK" in out
        assert out.index("verify: OK") > out.index("PYTEST-RAN"), out
    else:
        assert r.returncode != 0 and "verify: OK" not in out, out
