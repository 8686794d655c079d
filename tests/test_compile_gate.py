"""GPU-free compile gate: every registered Triton kernel compiles for sm_80 and sm_86 (no
fp8e4nv, <= 48 KiB shared memory per CTA) and for sm_90. The registry grows as kernel
modules land; REQUIRED_FEATURES keeps a kernel family from silently dropping out.

Compilation needs the real @triton.jit functions, which TRITON_INTERPRET=1 (set for the rest
of the suite on CPU) replaces, so the gate runs once in a subprocess without it.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import subproc
from vllm.deepinfer import compile_gate

REPO = Path(__file__).resolve().parent.parent
SPECS = compile_gate.specs()
CASES = [(s.name, cc) for s in SPECS for cc in s.targets]
REQUIRED_FEATURES = {"fp8_sw", "kv_gather", "topk_swa", "sparse_mla_decode",
                     "sparse_mla_prefill"}


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "overlay"), str(REPO / "tests")])
    return env


@pytest.fixture(scope="module")
def gate_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate") / "gate.json"
    r = subproc.run([sys.executable, "-m", "vllm.deepinfer.compile_gate", "--json", str(out)],
                    env=_env(), cap=1500)
    print(r.stdout)
    if not out.is_file():
        pytest.fail(f"compile gate did not run: {r.stderr[-2000:]}")
    return {(d["name"], d["cc"]): d for d in json.loads(out.read_text())}


def test_registry_covers_the_sm80_path():
    have = {s.feature for s in SPECS}
    missing = REQUIRED_FEATURES - have
    assert not missing, f"no kernel registered for {sorted(missing)}"
    for s in SPECS:
        assert set(s.targets) & {80, 86} or set(s.variants) <= {"sm89", "sm90", "sm100"}, s.name
    ampere = {s.feature for s in SPECS if {80, 86} <= set(s.targets)}
    assert REQUIRED_FEATURES <= ampere


@pytest.mark.parametrize("name,cc", CASES, ids=[f"{n}@sm_{cc}" for n, cc in CASES])
def test_kernel_compiles_within_budget(gate_results, name, cc):
    r = gate_results[(name, cc)]
    assert r["ok"], f"{name} sm_{cc}: {r['error']}"
    if cc < compile_gate.HW_FP8_MIN_CC:
        assert r["uses_fp8e4nv"] is False
        assert r["shared"] <= 48 * 1024


def test_gate_rejects_fp8e4nv_and_oversized_tiles():
    r = subproc.run([sys.executable, str(REPO / "tests" / "gate_probes.py")], env=_env(), cap=300)
    assert r.returncode == 0 and "probes ok" in r.stdout, r.stderr[-3000:]


def test_gate_refuses_interpreter_mode():
    env = dict(_env(), TRITON_INTERPRET="1")
    r = subproc.run([sys.executable, "-m", "vllm.deepinfer.compile_gate"], env=env, cap=120)
    assert r.returncode == 2 and "unset TRITON_INTERPRET" in r.stderr


def test_gate_targets_option():
    """``--targets`` (make verify's GATE_TARGETS) builds only the named capabilities; a bad
    list is an argparse error, and a list naming no spec's target compiles nothing and fails
    rather than passing empty."""
    bad = subproc.run([sys.executable, "-m", "vllm.deepinfer.compile_gate", "--targets", "sm80"],
                      env=_env(), cap=120)
    assert bad.returncode == 2 and "--targets" in bad.stderr
    none = subproc.run([sys.executable, "-m", "vllm.deepinfer.compile_gate", "--targets", "999"],
                       env=_env(), cap=120)
    assert none.returncode == 1 and "0 passed, 0 failed" in none.stderr
