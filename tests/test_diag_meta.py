"""benchmarks/diag's shared meta (diag_meta) and the GPU diagnostics that use it: their dry
runs work without a GPU, and the commit they record follows DEEPINFER_COMMIT (a tree copy
without git) before the checkout's HEAD."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DIAG = REPO / "benchmarks" / "diag"
sys.path.insert(0, str(DIAG))
import diag_meta  # noqa: E402


def test_commit_prefers_the_environment(monkeypatch):
    monkeypatch.setenv("DEEPINFER_COMMIT", "feedbee")
    assert diag_meta.commit() == "feedbee"
    monkeypatch.delenv("DEEPINFER_COMMIT")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert diag_meta.commit() == (head or "unknown")


def test_version_by_distribution():
    import pytest as _p
    assert diag_meta.version("pytest") == _p.__version__
    assert diag_meta.version("no-such-distribution-here") is None


def test_dry_runs_plan_without_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for script, n in (("mhc_decode_phases.py", 16), ("cuda_ops_offsets.py", 4),
                      ("warmup_threads.py", 2)):
        r = subprocess.run([sys.executable, str(DIAG / script), "--dry-run"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert len(json.loads(r.stdout)) == n, script
