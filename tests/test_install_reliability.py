"""The installer killed with SIGKILL at every step, of install and of restore.

Each run kills a real process (tools/install_overlay.py's main in a subprocess) right after
one change on disk. Afterwards ``status`` must say what state the tree is in, ``restore`` must
bring it back byte-identical (contents, modes, directories, hidden files), and ``install``
must resume to a verified install. A small fake vLLM keeps every kill point cheap
(tests/reliability_fakes.py); one test repeats the reported case on the real overlay.
"""
from __future__ import annotations

import json
import shutil

import pytest

import install_overlay as io
from _common import ToolError
from reliability_fakes import copy_tree, make_overlay, make_site, run_killed, snapshot


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch):
    # fsync guards against power loss, which no test here can cause; a kill needs none
    monkeypatch.setattr(io, "FSYNC", False)


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake")
    make_site(root / "pristine")
    overlay = make_overlay(root / "overlay")
    return root, overlay, snapshot(root / "pristine" / "vllm")


def _fresh(fake, tmp_path, name="site"):
    root, overlay, _ = fake
    copy_tree(root / "pristine", tmp_path / name)
    return tmp_path / name / "vllm", overlay


def _count(argv) -> int:
    r = run_killed(0, argv)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split("CHECKPOINTS")[1])


def test_status_restore_and_resume_after_sigkill_at_every_install_step(fake, tmp_path):
    _, overlay, pristine = fake
    vllm, _ = _fresh(fake, tmp_path, "count")
    argv = lambda d: ["install", "--vllm-dir", str(d), "--overlay", str(overlay)]  # noqa: E731
    n = _count(argv(vllm))
    assert n >= 20  # journal, backups, copies, directories: every one is a kill point
    installed = snapshot(vllm)
    for k in range(1, n + 1):
        site, _ = _fresh(fake, tmp_path, f"k{k}")
        r = run_killed(k, argv(site))
        assert r.returncode == -9, (k, r.stdout, r.stderr)
        code, line = io.status(site, overlay)
        if k == 1:  # only the journal's temporary file exists: nothing else changed yet
            assert code == io.STATUS_ABSENT and "killed before its first copy" in line, line
        elif k == n:  # killed right after the final journal landed
            assert code == io.STATUS_ACTIVE, (k, line)
        else:
            assert code == io.STATUS_NEEDS_ACTION and "PARTIAL install" in line, (k, line)
            assert f"install --vllm-dir {site}" in line and f"restore --vllm-dir {site}" in line
        # resume on a copy of the killed tree ...
        copy_tree(site.parent, tmp_path / f"r{k}")
        resumed = tmp_path / f"r{k}" / "vllm"
        io.install(resumed, overlay)
        assert snapshot(resumed) == installed, k
        assert io.status(resumed, overlay)[0] == io.STATUS_ACTIVE
        # ... and undo on the killed tree itself: byte-identical to before the install
        io.restore(site)
        assert snapshot(site) == pristine, k
        assert io.status(site, overlay)[0] == io.STATUS_ABSENT
        shutil.rmtree(site.parent)
        shutil.rmtree(resumed.parent)


def test_restore_completes_after_sigkill_at_every_restore_step(fake, tmp_path):
    _, overlay, pristine = fake
    vllm, _ = _fresh(fake, tmp_path, "count")
    io.install(vllm, overlay)
    n = _count(["restore", "--vllm-dir", str(vllm)])
    assert snapshot(vllm) == pristine and n >= 10
    for k in range(1, n + 1):
        site, _ = _fresh(fake, tmp_path, f"k{k}")
        io.install(site, overlay)
        r = run_killed(k, ["restore", "--vllm-dir", str(site)])
        assert r.returncode == -9, (k, r.stderr)
        code, line = io.status(site, overlay)
        if k == n:  # killed right after the journal was removed: done
            assert code == io.STATUS_ABSENT, line
            assert snapshot(site) == pristine
            continue
        if k == 1:  # only the new journal's temporary file exists: still installed
            assert code == io.STATUS_ACTIVE, line
            io.restore(site)
            assert snapshot(site) == pristine
            continue
        assert code == io.STATUS_NEEDS_ACTION and "PARTIAL restore" in line, (k, line)
        with pytest.raises(ToolError, match=f"restore --vllm-dir {site}"):
            io.install(site, overlay)  # refuses, naming the exact next command
        io.restore(site)
        assert snapshot(site) == pristine, k
        shutil.rmtree(site.parent)


def test_exception_midway_rolls_back_in_process(fake, tmp_path, monkeypatch):
    _, overlay, pristine = fake
    vllm, _ = _fresh(fake, tmp_path)
    seen = []

    def disk_full(label):
        seen.append(label)
        if len(seen) == 9:
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(io, "_checkpoint", disk_full)
    with pytest.raises(ToolError, match="No space left on device.*rolled back"):
        io.install(vllm, overlay)
    assert snapshot(vllm) == pristine


def test_reported_case_real_overlay_killed_after_30_of_40_copies(tmp_path):
    """SIGKILL after 30 of the real overlay's 40 files: status names the partial install,
    restore brings the tree back byte-identical (before: 'not installed', restore and install
    both refused)."""
    import _common
    import patchset
    if not _common.UPSTREAM_TREE.is_dir():
        pytest.skip("build/vllm-0.33.0 missing: run `make upstream`")
    record = patchset.read_record()
    overlay = patchset.build_overlay(tmp_path / "overlay")
    site = tmp_path / "site"
    for rel in list(record["files"]) + ["vllm/_version.py"]:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(_common.UPSTREAM_TREE / rel, site / rel)
    vllm = site / "vllm"
    before = snapshot(vllm)
    # count only the overlay's own files landing (not backups, not the journal)
    r = run_killed(30, ["install", "--vllm-dir", str(vllm), "--overlay", str(overlay)],
                   prefix=f"in place {vllm}/", skip=".deepinfer-")
    assert r.returncode == -9, r.stderr
    code, line = io.status(vllm, overlay)
    total = len(json.loads((overlay / "MANIFEST.json").read_text())["files"])
    assert code == io.STATUS_NEEDS_ACTION and f"PARTIAL install (30 of {total} files copied" in line
    io.restore(vllm)
    assert snapshot(vllm) == before


def test_install_made_by_the_earlier_journal_less_version_is_restored(fake, tmp_path):
    """Earlier versions wrote only .deepinfer-backup/state.json, after all copies: such an
    install still reads as installed and restores byte-identical."""
    import json
    _, overlay, pristine = fake
    vllm, _ = _fresh(fake, tmp_path)
    io.install(vllm, overlay)
    journal = json.loads((vllm / io.JOURNAL).read_text())
    (vllm / io.JOURNAL).unlink()
    manifest = json.loads((overlay / "MANIFEST.json").read_text())
    (vllm / io.BACKUP / io.LEGACY_STATE).write_text(json.dumps({
        "vllm_version": "0.33.0", "manifest": manifest,
        "files": [{"rel": s["rel"], "action": s["action"]} for s in journal["steps"]]}))
    code, line = io.status(vllm, overlay)
    assert code == io.STATUS_ACTIVE, line
    io.restore(vllm)
    assert snapshot(vllm) == pristine
