"""Run Python code that compiles kernels in a subprocess without TRITON_INTERPRET (the CPU
suite sets it, and the interpreter replaces jit functions with Python ones that cannot be
compiled)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import subproc

REPO = Path(__file__).resolve().parent.parent


def run_json(code: str, timeout: int = 600):
    """Run ``code`` with overlay/ on the path and no interpreter; the JSON its stdout's last
    line holds."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO / "overlay")
    r = subproc.run([sys.executable, "-c", code], env=env, cap=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
