"""The pinned-upstream pipeline: fetch, patch series, combined patch, overlay, installer.

Every bad input must fail with a message naming the problem and leave the tree as it was.
The tests work on a small vLLM tree: the pristine files the series touches plus
vllm/_version.py, copied from build/vllm-0.33.0 (made by `make upstream`).
"""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import _common
import install_overlay
import patchset
import upstream
from _common import ToolError

PRISTINE = _common.UPSTREAM_TREE


@pytest.fixture(scope="module")
def record():
    if not PRISTINE.is_dir():
        pytest.skip("build/vllm-0.33.0 missing: run `make upstream`")
    return patchset.read_record()


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".git" not in p.parts}


@pytest.fixture
def mini_tree(tmp_path, record) -> Path:
    root = tmp_path / "vllm-src"
    for rel in list(record["files"]) + ["vllm/_version.py"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PRISTINE / rel, root / rel)
    return root


# --------------------------------------------------------------------------- fetch
def test_sdist_wrong_size_and_checksum(tmp_path):
    fake = tmp_path / "vllm-0.33.0.tar.gz"
    fake.write_bytes(b"not the sdist")
    with pytest.raises(ToolError, match="size 13 bytes, expected 47101396"):
        upstream.verify_sdist(fake)
    dest = tmp_path / "out"
    with pytest.raises(ToolError, match="size"):
        upstream.fetch(fake, None, dest, force=False)
    assert not dest.exists()


def test_sdist_checksum_mismatch_same_size(tmp_path, monkeypatch):
    fake = tmp_path / "x.tar.gz"
    fake.write_bytes(b"\0" * 64)
    monkeypatch.setattr(upstream, "SDIST_SIZE", 64)
    with pytest.raises(ToolError, match="sha256 .* does not match the pinned"):
        upstream.verify_sdist(fake)


def test_fetch_from_tree_identified_by_content(tmp_path, mini_tree, record, capsys):
    rel = sorted(record["files"])[0]
    (mini_tree / rel).write_text((mini_tree / rel).read_text() + "# edited\n")
    dest = tmp_path / "dest"
    with pytest.raises(ToolError, match="not vLLM 0.33.0 by content: " + rel.replace(".", r"\.")):
        upstream.fetch(None, mini_tree, dest, force=False)
    assert not dest.exists()
    shutil.copy2(PRISTINE / rel, mini_tree / rel)
    (mini_tree / "vllm/_version.py").unlink()  # a git checkout: no _version.py
    upstream.fetch(None, mini_tree, dest, force=False)
    assert "has no vllm/_version.py, but all" in capsys.readouterr().err
    assert (dest / rel).read_bytes() == (PRISTINE / rel).read_bytes()


def test_fetch_from_tree_then_dirty_target_refused(tmp_path, mini_tree):
    dest = tmp_path / "dest"
    upstream.fetch(None, mini_tree, dest, force=False)
    assert upstream.is_baseline_repo(dest)
    # no detached auto-gc may pack objects while `make patched` copies the tree
    assert upstream.git(dest, "config", "gc.auto").stdout.strip() == "0"
    assert upstream.git(dest, "config", "maintenance.auto").stdout.strip() == "false"
    upstream.fetch(None, mini_tree, dest, force=False)  # clean baseline: kept
    f = dest / "vllm/_version.py"
    f.write_text(f.read_text() + "# local edit\n")
    with pytest.raises(ToolError, match="uncommitted changes"):
        upstream.fetch(None, mini_tree, dest, force=False)
    assert f.read_text().endswith("# local edit\n")  # nothing lost


def test_fetch_refuses_foreign_target(tmp_path, mini_tree):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep")
    with pytest.raises(ToolError, match="not a tree made by this tool"):
        upstream.fetch(None, mini_tree, dest, force=False)
    assert (dest / "mine.txt").read_text() == "keep"


def test_fetch_from_tarball_extracts_baseline(tmp_path, mini_tree, monkeypatch):
    tar = tmp_path / "vllm-0.33.0.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:
        tf.add(mini_tree, arcname="vllm-0.33.0")
    monkeypatch.setattr(upstream, "SDIST_SIZE", tar.stat().st_size)
    monkeypatch.setattr(upstream, "SDIST_SHA256", hashlib.sha256(tar.read_bytes()).hexdigest())
    dest = tmp_path / "dest"
    upstream.fetch(tar, None, dest, force=False)
    assert snapshot(dest) == snapshot(mini_tree)
    assert upstream.git(dest, "status", "--porcelain").stdout == ""


def test_index_lookup_is_configured_not_hardcoded(monkeypatch, tmp_path):
    idx = tmp_path / "simple" / "vllm"
    idx.mkdir(parents=True)
    (idx / "index.html").write_text(
        f'<a href="../../files/vllm-0.33.0.tar.gz#sha256={_common.SDIST_SHA256}">vllm-0.33.0.tar.gz</a>')
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "simple").as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    assert upstream.configured_indexes()[0] == (tmp_path / "simple").as_uri()
    url, sha, _ = upstream.find_sdist_url((tmp_path / "simple").as_uri())
    assert url.endswith("/files/vllm-0.33.0.tar.gz") and sha == _common.SDIST_SHA256
    src = Path(upstream.__file__).read_text() + Path(_common.__file__).read_text()
    assert "pypi.org" not in src and "pythonhosted" not in src


# --------------------------------------------------------------------------- series
def test_series_files_are_recorded(record):
    owner = patchset.series_ownership(patchset.read_series())
    assert set(owner) == set(record["files"])
    for rel, sha in record["files"].items():
        assert _common.sha256_file(PRISTINE / rel) == sha


def test_apply_all_then_refuse_second_time(mini_tree, record):
    before = snapshot(mini_tree)
    changed = patchset.apply_series(mini_tree)
    after = snapshot(mini_tree)
    assert all(after[f] != before[f] for f in record["files"])
    assert (mini_tree / "vllm/deepinfer/routing.py").is_file()
    assert set(record["files"]) <= set(changed)
    with pytest.raises(ToolError, match="patched already"):
        patchset.apply_series(mini_tree)
    assert snapshot(mini_tree) == after


def test_apply_dry_run_changes_nothing(mini_tree):
    before = snapshot(mini_tree)
    patchset.apply_series(mini_tree, dry_run=True)
    assert snapshot(mini_tree) == before


def test_apply_refuses_edited_file_whatever_the_version_says(mini_tree, record):
    rel = sorted(record["files"])[3]
    with open(mini_tree / rel, "a") as f:
        f.write("# edited\n")
    before = snapshot(mini_tree)
    with pytest.raises(ToolError, match="says vLLM 0.33.0.*not vLLM 0.33.0 by content"):
        patchset.apply_series(mini_tree)
    assert snapshot(mini_tree) == before


def test_apply_refuses_edited_file_and_names_it(mini_tree, record):
    rel = sorted(record["files"])[0]
    with open(mini_tree / rel, "a") as f:
        f.write("# edited\n")
    before = snapshot(mini_tree)
    with pytest.raises(ToolError, match=rel.replace(".", r"\.")):
        patchset.apply_series(mini_tree)
    assert snapshot(mini_tree) == before


def test_apply_rolls_back_on_failure(mini_tree):
    before = snapshot(mini_tree)
    with pytest.raises(ToolError, match="injected failure"):
        patchset.apply_series(mini_tree, _fail_after=2)
    assert snapshot(mini_tree) == before
    assert not (mini_tree / "vllm/deepinfer").exists()


def test_refresh_round_trip_and_new_patch(tmp_path, mini_tree, monkeypatch, record):
    pdir = tmp_path / "patches"
    shutil.copytree(_common.PATCH_DIR, pdir)
    monkeypatch.setattr(patchset, "PATCH_DIR", pdir)
    work = tmp_path / "work"
    upstream.fetch(None, mini_tree, work, force=False)
    patchset.apply_series(work)
    assert patchset.refresh(work) == []  # unchanged tree: patches identical
    for p in patchset.read_series():
        assert p.read_text() == (_common.PATCH_DIR / p.name).read_text()
    rel = sorted(record["files"])[0]
    with open(work / rel, "a") as f:
        f.write("# refreshed edit\n")
    written = patchset.refresh(work)
    assert len(written) == 1 and "+# refreshed edit" in (pdir / written[0]).read_text()
    # an edit to a file no patch owns needs --new
    (work / "vllm/newfile.py").write_text("x = 1\n")
    with pytest.raises(ToolError, match="vllm/newfile.py"):
        patchset.refresh(work)
    written = patchset.refresh(work, new_patch="Add newfile")
    assert written[-1].startswith(f"{len(record['files']) + 1:04d}-add-newfile")
    assert "vllm/newfile.py" in patchset.series_ownership(patchset.read_series())


def test_combined_patch_is_up_to_date(record):
    """CI fails here when patches/vllm-0.33.0-deepinfer.patch is stale."""
    assert patchset.combined_patch_text() == _common.COMBINED_PATCH.read_text(), (
        "run `make combined` and commit patches/vllm-0.33.0-deepinfer.patch")


def test_combined_patch_applies_with_git_apply(mini_tree):
    subprocess.run(["git", "init", "-q"], cwd=mini_tree, check=True)
    r = subprocess.run(["git", "apply", str(_common.COMBINED_PATCH)], cwd=mini_tree,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for p in patchset.our_files():
        rel = p.relative_to(_common.OVERLAY_PKG)
        assert (mini_tree / "vllm/deepinfer" / rel).read_bytes() == p.read_bytes()


# --------------------------------------------------------------------------- overlay + installer
@pytest.fixture
def built_overlay(tmp_path, record) -> Path:
    return patchset.build_overlay(tmp_path / "overlay")


def test_overlay_manifest(built_overlay, record):
    m = json.loads((built_overlay / "MANIFEST.json").read_text())
    paths = {e["path"]: e for e in m["files"]}
    for rel, sha in record["files"].items():
        assert paths[rel]["upstream_sha256"] == sha
        assert paths[rel]["result_sha256"] != sha
    assert paths["vllm/deepinfer/__init__.py"]["upstream_sha256"] is None
    for e in m["files"]:
        assert _common.sha256_file(built_overlay / e["path"]) == e["result_sha256"]


@pytest.fixture
def site_vllm(mini_tree) -> Path:
    return mini_tree / "vllm"


def test_install_dry_run_install_restore(built_overlay, site_vllm):
    before = snapshot(site_vllm)
    install_overlay.install(site_vllm, built_overlay, dry_run=True)
    assert snapshot(site_vllm) == before
    plan = install_overlay.install(site_vllm, built_overlay)
    assert {s["action"] for s in plan} == {"add", "replace"}
    assert (site_vllm / "deepinfer/__init__.py").is_file()
    installed = snapshot(site_vllm)
    assert install_overlay.install(site_vllm, built_overlay) == []  # same overlay: nothing to do
    assert snapshot(site_vllm) == installed
    install_overlay.restore(site_vllm)
    assert snapshot(site_vllm) == before
    assert not (site_vllm / "deepinfer").exists()


def test_install_refuses_wrong_files_whatever_the_version_says(built_overlay, site_vllm, record):
    rel = sorted(record["files"])[0][len("vllm/"):]
    with open(site_vllm / rel, "a") as f:
        f.write("# another release\n")
    (site_vllm / "_version.py").write_text("__version__ = version = '0.33.0'\n")
    before = snapshot(site_vllm)
    with pytest.raises(ToolError, match="says vLLM 0.33.0.*not vLLM 0.33.0 by content"):
        install_overlay.install(site_vllm, built_overlay)
    assert snapshot(site_vllm) == before


def test_install_refuses_modified_file(built_overlay, site_vllm, record):
    rel = sorted(record["files"])[-1][len("vllm/"):]
    with open(site_vllm / rel, "a") as f:
        f.write("# site edit\n")
    before = snapshot(site_vllm)
    with pytest.raises(ToolError, match=rel.replace(".", r"\.") + " has sha256"):
        install_overlay.install(site_vllm, built_overlay)
    assert snapshot(site_vllm) == before


def test_install_rolls_back_on_failure(built_overlay, site_vllm, monkeypatch):
    before = snapshot(site_vllm)
    calls = []

    def fail_midway(label):
        calls.append(label)
        if len(calls) == 12:
            raise OSError(28, "No space left on device (injected)")
    monkeypatch.setattr(install_overlay, "_checkpoint", fail_midway)
    with pytest.raises(ToolError, match="No space left.*rolled back"):
        install_overlay.install(site_vllm, built_overlay)
    assert snapshot(site_vllm) == before
    assert not (site_vllm / install_overlay.BACKUP).exists()
    assert not (site_vllm / install_overlay.JOURNAL).exists()


def test_install_refuses_tampered_overlay(built_overlay, site_vllm):
    f = built_overlay / "vllm/deepinfer/arch.py"
    f.write_text(f.read_text() + "# tampered\n")
    with pytest.raises(ToolError, match="differs from MANIFEST.json"):
        install_overlay.install(site_vllm, built_overlay)


def test_cli_errors_exit_2_with_message(tmp_path):
    r = subprocess.run([sys.executable, str(_common.REPO / "tools/patchset.py"), "apply",
                        "--tree", str(tmp_path / "nope")], capture_output=True, text=True)
    assert r.returncode == 2 and "no such directory" in r.stderr and "Traceback" not in r.stderr
