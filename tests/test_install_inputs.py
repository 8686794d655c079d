"""Every bad input to the installer: one line on stderr naming the file or variable and what
to do, exit code 2, nothing changed (the tree is compared entry by entry, hidden files and
modes included). Also: version identity by content, the overlay's permissions, and the
read-only bind-mount recipe of docs/docker.md run against a pristine tree.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import install_overlay as io
from reliability_fakes import REPO, clean_env, copy_tree, make_overlay, make_site, run_tool, snapshot


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch):
    monkeypatch.setattr(io, "FSYNC", False)


@pytest.fixture
def site(tmp_path):
    return make_site(tmp_path / "site")


@pytest.fixture
def overlay(tmp_path):
    return make_overlay(tmp_path / "overlay")


def _refused(r, *needles):
    """Exit 2, exactly one line on stderr, no traceback, naming every needle."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _install(site, overlay, *extra, env=None):
    return run_tool("install_overlay.py", "install", "--vllm-dir", str(site), "--overlay",
                    str(overlay), *extra, env=env or clean_env())


# --------------------------------------------------------------------------- manifest
def test_missing_overlay_and_manifest(site, overlay, tmp_path):
    before = snapshot(site)
    _refused(_install(site, tmp_path / "nope"), "nope", "make overlay")
    (overlay / "MANIFEST.json").unlink()
    _refused(_install(site, overlay), "MANIFEST.json missing", "make overlay")
    assert snapshot(site) == before


@pytest.mark.parametrize("text, needle", [
    ('{"vllm_version": "0.33.0", "files": [', "is not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"vllm_version": "0.33.0", "files": []}', "no files list"),
    ('{"vllm_version": "0.33.0", "files": [{"path": "../etc/passwd", "upstream_sha256": null,'
     ' "result_sha256": "' + "0" * 64 + '"}]}', "not a path inside vllm/"),
    ('{"vllm_version": "0.33.0", "files": [{"path": "vllm/a.py", "upstream_sha256": 5,'
     ' "result_sha256": "' + "0" * 64 + '"}]}', "upstream_sha256 is neither null nor a sha256"),
    ('{"vllm_version": "0.32.0", "files": [{"path": "vllm/a.py", "upstream_sha256": null,'
     ' "result_sha256": "' + "0" * 64 + '"}]}', "is for vLLM 0.32.0"),
])
def test_corrupt_or_malformed_manifest(site, overlay, text, needle):
    before = snapshot(site)
    (overlay / "MANIFEST.json").write_text(text)
    for extra in ((), ("--dry-run",)):
        _refused(_install(site, overlay, *extra), str(overlay / "MANIFEST.json"), needle)
    assert snapshot(site) == before


# --------------------------------------------------------------------------- environment
@pytest.mark.parametrize("var, value, needles", [
    ("DEEPINFER_KVGATHER", "0", ["unknown environment variable DEEPINFER_KVGATHER",
                                 "did you mean DEEPINFER_KV_GATHER", "DEEPINFER_DISABLE"]),
    ("DEEPINFER_DISABLE", "bogus,kv_gather", ["DEEPINFER_DISABLE", "bogus", "kv_gather"]),
    ("DEEPINFER_KV_GATHER", "maybe", ["DEEPINFER_KV_GATHER='maybe'", "expected 0 or 1"]),
    ("DEEPINFER_ENV_CHECK", "loud", ["DEEPINFER_ENV_CHECK='loud'", "error or warn"]),
])
def test_bad_environment_refused_by_install_and_apply(site, overlay, tmp_path, var, value, needles):
    before = snapshot(site)
    env = clean_env(**{var: value})
    for extra in ((), ("--dry-run",)):
        _refused(_install(site, overlay, *extra, env=env), *needles)
    _refused(run_tool("patchset.py", "apply", "--tree", str(site.parent), env=env), *needles)
    assert snapshot(site) == before


# --------------------------------------------------------------------------- read-only target
def _can_userns_mount() -> bool:
    if not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount --bind / /mnt 2>/dev/null || "
                        "mount -t tmpfs none /tmp"], capture_output=True)
    return r.returncode == 0


def _run_read_only(target, argv):
    """Run ``argv`` with ``target`` read-only: a read-only bind mount in a private mount
    namespace (what a container's :ro mount or a read-only image gives, even to root), or,
    where that is not allowed, write permission removed (enough for a non-root user)."""
    if _can_userns_mount():
        script = ('mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"')
        return subprocess.run(["unshare", "-rm", "sh", "-c", script, str(target), *argv],
                              capture_output=True, text=True, env=clean_env())
    if os.geteuid() == 0:
        pytest.skip("root without user namespaces: no way to make a directory read-only")
    modes = {p: p.stat().st_mode for p in [target, *target.rglob("*")] if p.is_dir()}
    for p in modes:
        os.chmod(p, modes[p] & ~0o222)
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=clean_env())
    finally:
        for p, m in modes.items():
            os.chmod(p, m)


def test_read_only_target_refused_even_by_dry_run(site, overlay):
    before = snapshot(site)
    tool = str(REPO / "tools" / "install_overlay.py")
    for extra in (["--dry-run"], []):
        r = _run_read_only(site, [sys.executable, tool, "install", "--vllm-dir", str(site),
                                  "--overlay", str(overlay), *extra])
        _refused(r, str(site), "is not writable", "nothing was changed")
    assert snapshot(site) == before


def test_read_only_tree_refused_by_apply(tmp_path):
    import _common
    import patchset
    if not _common.UPSTREAM_TREE.is_dir():
        pytest.skip("build/vllm-0.33.0 missing: run `make upstream`")
    tree = tmp_path / "tree"
    for rel in list(patchset.read_record()["files"]) + ["vllm/_version.py"]:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(_common.UPSTREAM_TREE / rel, tree / rel)
    before = snapshot(tree)
    tool = str(REPO / "tools" / "patchset.py")
    for extra in (["--dry-run"], []):
        r = _run_read_only(tree, [sys.executable, tool, "apply", "--tree", str(tree), *extra])
        _refused(r, "is not writable", "nothing was changed")
    assert snapshot(tree) == before


# --------------------------------------------------------------------------- other refusals
def test_backup_without_journal_and_foreign_added_file(site, overlay):
    (site / io.BACKUP).mkdir()
    before = snapshot(site)
    _refused(_install(site, overlay), ".deepinfer-backup exists without", "move it away")
    assert snapshot(site) == before
    (site / io.BACKUP).rmdir()
    (site / "deepinfer").mkdir()
    (site / "deepinfer" / "z.py").write_text("mine\n")
    before = snapshot(site)
    _refused(_install(site, overlay), "deepinfer/z.py exists but the overlay adds it")
    assert snapshot(site) == before


def test_restore_refuses_to_lose_edits_made_after_install(site, overlay, tmp_path):
    pristine = snapshot(site)
    io.install(site, overlay)
    (site / "a.py").write_text("x = 1  # patched\n# my edit\n")
    r = run_tool("install_overlay.py", "restore", "--vllm-dir", str(site), env=clean_env())
    _refused(r, "a.py changed since the overlay was installed", "--force")
    code, line = io.status(site, overlay)
    assert code == io.STATUS_NEEDS_ACTION and "a.py" in line
    io.restore(site, force=True)
    assert snapshot(site) == pristine


def test_install_into_another_overlay_refused_with_next_command(site, overlay, tmp_path):
    io.install(site, overlay)
    other = make_overlay(tmp_path / "other")
    (other / "vllm" / "deepinfer" / "z.py").write_text("ours = False\n")
    m = json.loads((other / "MANIFEST.json").read_text())
    import hashlib
    for e in m["files"]:
        e["result_sha256"] = hashlib.sha256((other / e["path"]).read_bytes()).hexdigest()
    (other / "MANIFEST.json").write_text(json.dumps(m))
    before = snapshot(site)
    _refused(_install(site, other), "another overlay build",
             f"install_overlay.py restore --vllm-dir {site}")
    assert snapshot(site) == before


# --------------------------------------------------------------------------- identity by content
@pytest.mark.parametrize("version", [None, "0.33.0+cu130", "0.34.0.dev1"])
def test_version_string_ignored_when_files_match(tmp_path, overlay, version):
    site = make_site(tmp_path / "s", version=version)
    pristine = snapshot(site)
    r = _install(site, overlay)
    assert r.returncode == 0, r.stderr
    assert "warning:" in r.stderr and "byte for byte" in r.stderr
    assert io.status(site, overlay)[0] == io.STATUS_ACTIVE
    io.restore(site)
    assert snapshot(site) == pristine


def test_files_differ_refused_whatever_version_string(tmp_path, overlay):
    site = make_site(tmp_path / "s", version="0.33.0")
    (site / "sub" / "b.py").write_text("y = 20\n")
    before = snapshot(site)
    _refused(_install(site, overlay), "says vLLM 0.33.0", "not vLLM 0.33.0 by content",
             "sub/b.py has sha256")
    assert snapshot(site) == before


# --------------------------------------------------------------------------- modes
def test_installed_files_keep_modes_and_added_files_are_world_readable(site, overlay):
    modes = {rel: (site / rel).stat().st_mode & 0o777 for rel in ("a.py", "sub/b.py", "sub/deep/c.py")}
    old = os.umask(0o077)
    try:
        io.install(site, overlay)
    finally:
        os.umask(old)
    for rel, mode in modes.items():
        assert (site / rel).stat().st_mode & 0o777 == mode
    for p in [site / "deepinfer", *(site / "deepinfer").rglob("*")]:
        want = 0o755 if p.is_dir() else 0o644
        assert p.stat().st_mode & 0o777 == want, p


def test_built_overlay_is_world_readable_under_umask_077(tmp_path):
    import _common
    import patchset
    if not _common.UPSTREAM_TREE.is_dir():
        pytest.skip("build/vllm-0.33.0 missing: run `make upstream`")
    old = os.umask(0o077)
    try:
        out = patchset.build_overlay(tmp_path / "overlay")
    finally:
        os.umask(old)
    for p in [out, *out.rglob("*")]:
        mode = p.stat().st_mode & 0o777
        assert mode == (0o755 if p.is_dir() else 0o644), (p, oct(mode))


# --------------------------------------------------------------------------- bind mount recipe
def _mount_flags(site_root, overlay):
    r = run_tool("install_overlay.py", "mounts", "--site", str(site_root), "--overlay", str(overlay),
                 env=clean_env())
    assert r.returncode == 0, r.stderr
    parts = r.stdout.split()
    assert parts[::2] == ["-v"] * (len(parts) // 2)
    return [tuple(v.rsplit(":", 2)) for v in parts[1::2]]


def _status(site, overlay, wrap=()):
    return subprocess.run([*wrap, sys.executable, str(REPO / "tools" / "install_overlay.py"),
                           "status", "--vllm-dir", str(site), "--overlay", str(overlay)],
                          capture_output=True, text=True, env=clean_env())


def test_docker_recipe_copied_read_only_over_a_pristine_tree(site, overlay):
    """docs/docker.md: `mounts` gives the -v flags; every target then matches MANIFEST.json
    and the in-container check (`status --vllm-dir ... --overlay ...`) says so."""
    r = _status(site, overlay)
    assert r.returncode == io.STATUS_ABSENT and "not installed" in r.stdout
    flags = _mount_flags(site.parent, overlay)
    assert {m for _, _, m in flags} == {"ro"}
    for src, dst, _ in flags:  # a copy stands in for each read-only bind mount
        src, dst = os.fspath(src), os.fspath(dst)
        if os.path.isdir(src):
            shutil.copytree(src, dst)
        else:
            shutil.copyfile(src, dst)
    r = _status(site, overlay)
    assert r.returncode == io.STATUS_ACTIVE and "overlay active: all 6 files match" in r.stdout
    (site / "sub" / "b.py").write_text("y = 2\n")  # one mount forgotten: upstream's file
    r = _status(site, overlay)
    assert r.returncode == io.STATUS_NEEDS_ACTION and "MIXED" in r.stdout


def test_docker_recipe_real_read_only_bind_mounts(site, overlay):
    if not _can_userns_mount():
        pytest.skip("no user namespaces here: the copy variant above covers the recipe")
    before = snapshot(site)
    flags = _mount_flags(site.parent, overlay)
    script = "set -e\n" + "".join(
        f'[ -e "{dst}" ] || mkdir "{dst}"\nmount --bind "{src}" "{dst}"\n'
        f'mount -o remount,bind,ro "{dst}"\n' for src, dst, _ in flags)
    script += 'exec "$@"'
    r = _status(site, overlay, wrap=("unshare", "-rm", "sh", "-c", script, "sh"))
    assert r.returncode == io.STATUS_ACTIVE, (r.stdout, r.stderr)
    assert "overlay active: all 6 files match" in r.stdout
    (site / "deepinfer").rmdir()  # the mount point docker would have made
    assert snapshot(site) == before


def test_second_installer_at_the_same_time_is_refused(site, overlay):
    import fcntl
    before = snapshot(site)
    fd = os.open(site, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a running install or restore holds
        _refused(_install(site, overlay), "another install_overlay.py is working on", str(site))
        r = run_tool("install_overlay.py", "restore", "--vllm-dir", str(site), env=clean_env())
        _refused(r, "another install_overlay.py is working on")
    finally:
        os.close(fd)
    assert snapshot(site) == before


def test_read_only_probe_in_process(site, overlay, monkeypatch):
    """The same refusal where no read-only mount can be made (root without user
    namespaces): the probe's file creation fails as on a read-only file system."""
    import errno
    import tempfile

    def erofs(*a, dir=None, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)
    monkeypatch.setattr(tempfile, "mkstemp", erofs)
    before = snapshot(site)
    for dry in (True, False):
        with pytest.raises(io.ToolError, match="is not writable \\(Read-only file system\\): "
                           "nothing was changed"):
            io.install(site, overlay, dry_run=dry)
    assert snapshot(site) == before
