"""Run python on the patched vLLM tree (``make patched``: build/patched) in a subprocess and
return the JSON its last stdout line prints. Skips when the tree or vLLM's pure-Python import
dependencies are missing, fails instead under ``DEEPINFER_REQUIRE_UPSTREAM=1`` (CI)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import subproc

REPO = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("DEEPINFER_BUILD", REPO / "build"))
PATCHED = BUILD / "patched"


def _skip_or_fail(why: str) -> None:
    if os.environ.get("DEEPINFER_REQUIRE_UPSTREAM") == "1":
        pytest.fail(why)
    pytest.skip(why)


def run_json(args: list[str], env: dict[str, str], timeout: int = 600):
    """``python *args`` with PYTHONPATH=build/patched, no GPU, the caller's ``env`` added to
    this environment minus every DEEPINFER_* and TRITON_INTERPRET variable."""
    if not (PATCHED / ".ok").is_file():
        _skip_or_fail("build/patched missing: run `make patched`")
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("DEEPINFER_") and k != "TRITON_INTERPRET"}
    full.update(env, PYTHONPATH=str(PATCHED), CUDA_VISIBLE_DEVICES="")
    r = subproc.run([sys.executable, *args], env=full, cap=timeout, cwd=str(REPO))
    last = (r.stderr.strip().splitlines() or [""])[-1]
    if r.returncode != 0 and last.startswith("ModuleNotFoundError"):
        _skip_or_fail(last)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
