"""mHC without DeepGEMM (vllm.deepinfer.mhc): the routing decision of V4's first-layer pre,
pure and through the PATCHED vLLM tree (patch 0030, tests/mhc_vllm_probe.py in a
subprocess with CUDA_VISIBLE_DEVICES="", as tests/test_vllm_import.py runs its probes).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm.deepinfer import envs, mhc, routing
from test_vllm_import import REQUIRE, _probe_env, _unavailable

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).with_name("mhc_vllm_probe.py")


@pytest.fixture
def arch_env(monkeypatch):
    def set_(arch, mhc_env=None, disable=None):
        monkeypatch.setenv("DEEPINFER_ARCH", arch)
        for k, v in (("DEEPINFER_MHC", mhc_env), ("DEEPINFER_DISABLE", disable)):
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, v)
        routing.reset()
    yield set_
    routing.reset()


def test_feature_defaults():
    assert "mhc" in envs.FEATURES
    on = {v for v in ("sm80", "sm86", "sm89", "sm90", "sm100", "cpu")
          if v in envs.FEATURES["mhc"].default_on}
    assert on == {"sm80", "sm86", "sm89", "cpu"}


@pytest.mark.parametrize("arch,deep_gemm,mhc_env,disable,want", [
    ("sm80", False, None, None, True),    # Ampere: ours
    ("sm86", False, None, None, True),
    ("sm89", False, None, None, True),    # Ada has no DeepGEMM either
    ("sm90", True, None, None, False),    # Hopper with DeepGEMM: upstream
    ("sm90", False, None, None, True),    # DeepGEMM reported unsupported (capability 8.0 emulated)
    ("sm100", True, None, None, False),
    ("sm90", True, "1", None, True),      # forced on
    ("sm80", False, "0", None, False),    # switched back to upstream
    ("sm80", False, None, "mhc", False),
    ("sm80", False, None, "all", False),
])
def test_first_layer_decision(arch_env, arch, deep_gemm, mhc_env, disable, want):
    arch_env(arch, mhc_env, disable)
    assert mhc.first_layer_on_tilelang(deep_gemm) is want


def test_first_layer_declines_without_launching(arch_env):
    arch_env("sm90")
    # Upstream's path: no tensor is even inspected, so no vLLM import happens.
    assert mhc.broadcast_prenorm_gemm(object(), object(), True) is None


def test_first_layer_rejects_bad_inputs(arch_env):
    import torch
    arch_env("sm80")
    fn = torch.zeros(24, 1024)
    with pytest.raises(ValueError, match="bf16"):
        mhc.broadcast_prenorm_gemm(torch.zeros(2, 1024), fn, False)
    with pytest.raises(ValueError, match="fn_broadcast"):
        mhc.broadcast_prenorm_gemm(torch.zeros(2, 1024, dtype=torch.bfloat16),
                                   torch.zeros(24, 512), False)
    with pytest.raises(ValueError, match="multiple of 512"):
        mhc.broadcast_prenorm_gemm(torch.zeros(2, 1000, dtype=torch.bfloat16),
                                   torch.zeros(24, 1000), False)


# --------------------------------------------------------------------------- patched tree
def _need_probe():
    why = _unavailable()
    if why is None and importlib.util.find_spec("tilelang") is None:
        why = "tilelang missing: pip install -r requirements-test.txt (or `make venv`)"
    if why:
        if REQUIRE:
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def first_layer():
    _need_probe()
    r = subprocess.run([sys.executable, str(PROBE), "first_layer"], env=_probe_env(), cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        pytest.fail(f"mhc probe failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
    res = json.loads(lines[-1])
    assert res["_scenario"]["ok"], res["_scenario"]
    return res


def _val(res, key):
    r = res[key]
    assert r["ok"], f"{key}: {r['error']}: {r['message']}\n{r.get('trace', '')}"
    return r["value"]


@pytest.mark.parametrize("case,hidden,n_thr", [
    ("sm80/no_deep_gemm", 1024, 1024), ("sm86/no_deep_gemm", 7168, 1024),
    ("sm80/no_deep_gemm/hidden5120", 5120, 512), ("sm90/no_deep_gemm", 1024, 1024),
    ("sm90/deep_gemm/mhc=1", 1024, 1024)])
def test_patched_first_layer_runs_tilelang_prenorm(first_layer, case, hidden, n_thr):
    v = _val(first_layer, case)
    # TileLang's prenorm GEMM at hc_mult=1 over the hidden row, one split; the epilogue
    # reads that one split; DeepGEMM never called.
    assert v["calls"][0][:4] == ["tilelang_prenorm", hidden, 1, 1]
    assert v["calls"][0][4] == n_thr
    assert v["calls"][1] == ["epilogue", 1]
    assert not any(c[0] == "deep_gemm" for c in v["calls"])
    assert max(v["max_abs_diff"]) == 0.0  # the stand-ins compute the reference exactly


@pytest.mark.parametrize("case", ["sm90/deep_gemm", "sm80/no_deep_gemm/mhc=0"])
def test_patched_first_layer_upstream_path(first_layer, case):
    v = _val(first_layer, case)
    assert v["calls"] == [["deep_gemm", 4]]
    assert "DeepGEMM" in v["raised"]


def test_patched_first_layer_zero_tokens(first_layer):
    v = _val(first_layer, "sm80/no_deep_gemm/zero_tokens")
    assert v["shapes"] == [[0, 4, 1024], [0, 4, 1], [0, 4, 4], [0, 1024]]
    assert [c[0] for c in v["calls"]] == ["epilogue"]  # nothing to project


def test_patched_first_layer_bad_hidden(first_layer):
    r = first_layer["sm80/no_deep_gemm/hidden1000"]
    assert not r["ok"] and r["error"] == "ValueError" and "multiple of 512" in r["message"]
