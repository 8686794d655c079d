"""GPU-free compile gate of the mHC TileLang kernels for sm_80 and sm_86
(vllm.deepinfer.mhc.gate, ``make gate-mhc``): every kernel form the Ampere path dispatches
compiles for both targets within the 48 KiB shared-memory budget, with registers reported
and no sm_90-only instruction; the gate itself rejects PDL code and oversized shared memory.

Runs the gate in a subprocess on the patched vLLM tree (CUDA_VISIBLE_DEVICES="",
PYTHONPATH=build/patched), sharing TileLang's build cache with ``make gate-mhc``
(``TILELANG_CACHE_DIR``: ``$DEEPINFER_CACHE/tilelang``, by default
~/.cache/deepinfer/tilelang, set by the Makefile and tests/conftest.py), so after
``make verify`` this costs seconds.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from test_mhc import _need_probe
from test_vllm_import import BUILD, _probe_env
import subproc

REPO = Path(__file__).resolve().parent.parent
BUDGET = 48 * 1024
FAMILIES = {"_MHC_FUSED_TILELANG_KERNEL", "_HC_PRENORM_GEMM_TILELANG_KERNEL", "prenorm_gemm_tc",
            "_MHC_POST_TILELANG_KERNEL", "_HC_HEAD_FUSED_TILELANG_KERNEL",
            "_MHC_PRE_BIG_FUSE_TILELANG_KERNEL", "MHC_PRE_NORM_KERNEL"}
GEOMETRY = {"_MHC_FUSED_TILELANG_KERNEL", "_HC_PRENORM_GEMM_TILELANG_KERNEL"}


def _env():
    env = _probe_env()
    env["DEEPINFER_BUILD"] = str(BUILD)
    return env


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    _need_probe()
    out = tmp_path_factory.mktemp("gate-mhc") / "gate-mhc.json"
    r = subproc.run([sys.executable, "-m", "vllm.deepinfer.mhc.gate", "--json", str(out)],
                    env=_env(), cwd=REPO, cap=1800)
    if not out.is_file():
        pytest.fail(f"mhc gate did not run (rc {r.returncode}): {r.stderr[-3000:]}")
    print(r.stdout)
    return json.loads(out.read_text()), r.returncode


def test_gate_passes(gate):
    results, rc = gate
    bad = [f"{d['name']} sm_{d['cc']}: {d['error']}" for d in results if not d["ok"]]
    assert not bad and rc == 0, "\n".join(bad)


def test_gate_covers_every_kernel_family_for_both_targets(gate):
    results, _ = gate
    at_5120 = {(d["kernel"], d["cc"]) for d in results if d["hidden"] == 5120}
    for fam in FAMILIES:
        assert (fam, 80) in at_5120 and (fam, 86) in at_5120, fam
    for h in (4096, 7168):
        have = {d["kernel"] for d in results if d["hidden"] == h and d["cc"] == 80}
        assert GEOMETRY <= have, (h, GEOMETRY - have)
    # The tensor-core projection at each tile height it dispatches.
    heights = {json.dumps(d["name"]).split("block_m=")[1].split(",")[0]
               for d in results if d["kernel"] == "prenorm_gemm_tc"}
    # From TC_MIN_TOKENS (33) on: 32- and 64-row tiles (16-row tiles serve <= 16 tokens).
    from vllm.deepinfer import mhc
    from vllm.deepinfer.mhc import kernels
    assert heights == {str(kernels.block_m_for(t)) for t in range(mhc.TC_MIN_TOKENS, 8193)}
    assert heights == {"32", "64"}


def test_gate_reports_resources(gate):
    results, _ = gate
    for d in results:
        assert d["regs"] is not None and 0 < d["regs"] <= 255, d
        assert d["shared"] is not None and d["shared"] <= BUDGET, d
        assert d["sm90_only"] == [], d
        assert d["local"] == 0, d  # no register spills
    # The largest upstream epilogue stages hidden 5120 bf16 in shared memory (~31 KB).
    epi = [d["shared"] for d in results if d["kernel"] == "MHC_PRE_NORM_KERNEL"
           and d["hidden"] == 5120]
    assert max(epi) > 5120 * 2


def test_gate_rejects_pdl_and_oversized_shared_memory():
    _need_probe()
    r = subproc.run([sys.executable, str(REPO / "tests" / "mhc_gate_probes.py")], env=_env(),
                    cwd=REPO, cap=900)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    got = json.loads(lines[-1])
    assert not got["pdl"]["ok"], got["pdl"]
    assert "PDL" in got["pdl"]["error"] or "griddepcontrol" in got["pdl"]["error"], got["pdl"]
    assert not got["smem"]["ok"] and "budget" in got["smem"]["error"], got["smem"]
    assert got["smem"]["shared"] >= 64 * 1024


def test_gate_needs_the_vllm_tree():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = str(REPO / "overlay")
    r = subproc.run([sys.executable, "-m", "vllm.deepinfer.mhc.gate", "--list"], env=env,
                    cwd=REPO, cap=300)
    assert r.returncode == 2 and "build/patched" in r.stderr, r.stderr[-2000:]


def test_sm80_and_sm86_lower_to_the_same_source(gate):
    results, _ = gate
    by_key: dict = {}
    for d in results:
        by_key.setdefault(d["name"], {})[d["cc"]] = d["source_sha256"]
    pairs = [v for v in by_key.values() if len(v) == 2]
    assert pairs and all(v[80] == v[86] for v in pairs)
