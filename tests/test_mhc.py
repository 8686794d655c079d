"""mHC without DeepGEMM (vllm.deepinfer.mhc): the routing decision of V4's first-layer pre,
pure and through the PATCHED vLLM tree (patch 0030, tests/mhc_vllm_probe.py in a
subprocess with CUDA_VISIBLE_DEVICES="", as tests/test_vllm_import.py runs its probes).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from vllm.deepinfer import envs, mhc, routing
from test_vllm_import import REQUIRE, _unavailable
from test_vllm_import import _probe_env as _base_probe_env
import subproc

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).with_name("mhc_vllm_probe.py")


def _probe_env() -> dict[str, str]:
    """The probes test the Ampere geometry and tensor-core projection as designed: with the
    (default-off, unmeasured) mhc_tuned feature on."""
    return dict(_base_probe_env(), DEEPINFER_MHC_TUNED="1")


@pytest.fixture(autouse=True)
def _tuned_on(monkeypatch):
    monkeypatch.setenv("DEEPINFER_MHC_TUNED", "1")
    routing.reset()
    yield
    routing.reset()


def test_tuned_defaults_follow_the_measurement(monkeypatch):
    """Measured by the mhc suite (H200, Ampere builds): the tensor-core projection above 32
    tokens is on by default on the Ampere variants; the fused geometry stays upstream's (the
    candidate did not win); DEEPINFER_MHC_TUNED=0 turns the projection off."""
    monkeypatch.delenv("DEEPINFER_MHC_TUNED")
    monkeypatch.setenv("DEEPINFER_ARCH", "sm80")
    routing.reset()
    assert {v for v in envs.FEATURES["mhc"].default_on if envs.enabled("mhc_tuned", v)} == {
        "sm80", "sm86", "cpu"}
    assert mhc.fused_post_pre_config(6, 5120, 4) is mhc.UPSTREAM
    assert not mhc.projection_on_tc(32, 5120, 24, False)
    assert mhc.projection_on_tc(33, 5120, 24, False)
    monkeypatch.setenv("DEEPINFER_MHC_TUNED", "0")
    routing.reset()
    assert not mhc.projection_on_tc(8192, 5120, 24, False)


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
    r = subproc.run([sys.executable, str(PROBE), "first_layer"], env=_probe_env(), cwd=REPO,
                    cap=600)
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
    ("sm90/no_deep_gemm", 1024, 1024), ("sm90/deep_gemm/mhc=1", 1024, 1024)])
def test_patched_first_layer_runs_tilelang_prenorm(first_layer, case, hidden, n_thr):
    v = _val(first_layer, case)
    # TileLang's prenorm GEMM at hc_mult=1 over the hidden row, one split; the epilogue
    # reads that one split; DeepGEMM never called.
    assert v["calls"][0][:4] == ["tilelang_prenorm", hidden, 1, 1]
    assert v["calls"][0][4] == n_thr
    assert v["calls"][1] == ["epilogue", 1]
    assert not any(c[0] == "deep_gemm" for c in v["calls"])
    assert max(v["max_abs_diff"]) == 0.0  # the stand-ins compute the reference exactly


@pytest.fixture(scope="module")
def projection():
    _need_probe()
    r = subproc.run([sys.executable, str(PROBE), "projection"], env=_probe_env(), cwd=REPO, cap=600)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        pytest.fail(f"mhc probe failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
    res = json.loads(lines[-1])
    assert res["_scenario"]["ok"], res["_scenario"]
    return res


# (case, kernels the patched op runs): sm80 with the mhc feature on, then switched off.
ROUTES = [
    # As measured (mhc suite, H200): upstream's fused geometry up to 32 tokens, the
    # tensor-core projection from 33 (TC_MIN_TOKENS) where upstream has no fused kernel.
    ("delayed/sm80/None/6/5120", [["fused", [2, 8, 128]], ["epilogue_delayed", 1]]),
    ("delayed/sm80/None/20/5120", [["fused", [6, 8, 128]], ["epilogue_delayed", 1]]),
    ("delayed/sm80/None/20/1024", [["fused", [6, 8, 128]], ["epilogue_delayed", 1]]),
    ("delayed/sm80/None/40/1024", [["post"], ["tc", 4096, "S"], ["epilogue_delayed", "S"]]),
    ("delayed/sm80/None/300/1024", [["post"], ["tc", 4096, "S"], ["epilogue_delayed", "S"]]),
    ("v4/sm80/None/6/5120", [["fused", [2, 8, 128]], ["epilogue", 1]]),
    ("v4/sm80/None/40/1024", [["post"], ["tc", 4096, "S"], ["epilogue", "S"]]),
    ("first_v41/sm80/None/5", [["fma", 1024, 1], ["epilogue_delayed", 1]]),
    ("first_v41/sm80/None/20", [["fma", 1024, 1], ["epilogue_delayed", 1]]),
    ("first_v41/sm80/None/40", [["tc", 1024, "S"], ["epilogue_delayed", "S"]]),
    ("delayed/sm80/0/6/5120", [["fused", [2, 8, 128]], ["epilogue_delayed", 1]]),
    ("delayed/sm80/0/20/5120", [["fused", [6, 8, 128]], ["epilogue_delayed", 1]]),
    ("delayed/sm80/0/40/1024", [["post"], ["fma", 4096, 1], ["epilogue_delayed", 1]]),
    ("v4/sm80/0/40/1024", [["post"], ["fma", 4096, 4], ["epilogue", 1]]),
    ("first_v41/sm80/0/20", [["fma", 1024, 1], ["epilogue_delayed", 1]]),
]


@pytest.mark.parametrize("case,want", ROUTES, ids=[c for c, _ in ROUTES])
def test_patched_ops_route(projection, case, want):
    v = _val(projection, case)
    got = [c[:3] if c[0] == "tc" else c for c in v["calls"]]
    splits = [c[2] for c in v["calls"] if c[0] == "tc"]
    want = [[splits[0] if x == "S" else x for x in c] for c in want]
    assert got == want
    assert not splits or splits[0] > 1  # decode-sized batches spread over k-slices
    # Stand-ins compute in fp32: what differs is the order the splits are summed in, and
    # one bf16 rounding of the layer input.
    coef = v["err"] if case.startswith("first_v41") else v["err"][:3] + v["err"][4:]
    assert max(coef) < 1e-5, v["err"]
    if not case.startswith("first_v41"):
        assert v["err"][3] <= 2 ** -7 * 8, v["err"]  # a few bf16 ulps at |x| < 8


def test_patched_first_layer_large_batch_on_tensor_cores(first_layer):
    # 130 embedding rows: our tensor-core projection (K = hidden), its splits summed by
    # upstream's broadcast epilogue.
    v = _val(first_layer, "sm80/no_deep_gemm/hidden5120")
    assert v["calls"][0][:2] == ["tc", 5120] and v["calls"][1] == ["epilogue", v["calls"][0][2]]
    assert v["calls"][0][2] > 1
    assert max(v["max_abs_diff"][:3]) < 1e-4
    assert v["max_abs_diff"][3] <= 2 ** -7 * 8  # layer input: bf16 ulps from the split sums


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


# --------------------------------------------------------------------------- Ampere configs
def test_fused_geometry_5120(arch_env, monkeypatch):
    arch_env("sm80")
    # As measured, no Ampere entry: upstream's geometry at every token count.
    for t in (1, 6, 12, 16, 32, 33):
        assert mhc.fused_post_pre_config(t, 5120, 4) is mhc.UPSTREAM
    # The table's form (the candidate the suite measured): 8 slices of 640 columns, 5 per
    # thread; 24 projections in 4 tiles of 6; no fused kernel above the band.
    monkeypatch.setitem(mhc.FUSED_GEOMETRY, 5120, ((15, (6, 8, 128)),))
    for t in range(1, 16):
        assert mhc.fused_post_pre_config(t, 5120, 4) == (6, 8, 128)
    for t in (16, 32, 8192):
        assert mhc.fused_post_pre_config(t, 5120, 4) is None


@pytest.mark.parametrize("hidden", [4096, 7168])
def test_fused_geometry_defers_to_upstream_where_unmeasured(arch_env, hidden):
    arch_env("sm80")
    assert mhc.fused_post_pre_config(6, hidden, 4) is mhc.UPSTREAM


def test_fused_geometry_off_when_switched_off(arch_env):
    arch_env("sm80", "0")
    assert mhc.fused_post_pre_config(6, 5120, 4) is mhc.UPSTREAM
    arch_env("sm90")
    assert mhc.fused_post_pre_config(6, 5120, 4) is mhc.UPSTREAM


def test_fused_geometry_table_rejects_a_bad_entry(arch_env, monkeypatch):
    arch_env("sm80")
    monkeypatch.setitem(mhc.FUSED_GEOMETRY, 5120, ((15, (5, 8, 128)),))
    with pytest.raises(ValueError, match="FUSED_GEOMETRY"):
        mhc.fused_post_pre_config(4, 5120, 4)


@pytest.mark.parametrize("t,want", [(15, False), (32, False), (33, True), (8192, True)])
def test_projection_threshold(arch_env, t, want):
    arch_env("sm80")
    assert mhc.projection_on_tc(t, 20480, 24, deep_gemm_supported=False) is want
    arch_env("sm90")
    assert mhc.projection_on_tc(t, 20480, 24, deep_gemm_supported=True) is False


def test_projection_shapes_it_cannot_tile(arch_env):
    arch_env("sm80")
    assert not mhc.projection_on_tc(64, 20480 + 32, 24, False)  # K not a multiple of 64
    assert not mhc.projection_on_tc(64, 20480, 40, False)       # more outputs than one tile


def test_tc_tiles_and_splits():
    from vllm.deepinfer.mhc import kernels as k
    assert [k.block_m_for(t) for t in (16, 17, 64, 65, 8192)] == [16, 32, 32, 64, 64]
    # A100 (108 SMs), K = 4 x 5120: the most splits whose grid fits two waves.
    assert k.splits_for(16, 20480, 16, 108) == 64      # one token tile: 64 k-slices
    assert k.splits_for(8192, 20480, 64, 108) == 1
    assert k.splits_for(1024, 20480, 64, 108) == 4      # 16 tiles x 4 = 64 blocks
    for t in (16, 100, 1000, 8192):
        key = k.key_for(t, 20480, 24, 108)
        assert key.n_splits in k.SPLIT_BUCKETS and 20480 % (key.n_splits * k.BLOCK_K) == 0
    # shared memory of the largest tile stays inside the 48 KiB Ampere budget
    bm = 64
    smem = k.NUM_STAGES * (bm * k.BLOCK_K * 2 + k.BLOCK_N * k.BLOCK_K * 4) + bm * k.BLOCK_K * 4
    assert smem <= 48 * 1024


def test_warmup_keys_cover_every_dispatched_projection(arch_env):
    from vllm.deepinfer.mhc import kernels as k
    from vllm.deepinfer.mhc import warmup as w
    arch_env("sm80")
    keys = w.tc_keys(20480, 24, 8192, (108,))
    assert {k.key_for(t, 20480, 24, 108) for t in range(mhc.TC_MIN_TOKENS, 8193)} == set(keys)
    assert w.tc_keys(20480, 24, mhc.TC_MIN_TOKENS - 1, (108,)) == []
    assert w.projection_splits(20480, 24, 8192, (108,)) == {key.n_splits for key in keys}
    arch_env("sm80", "0")
    assert w.projection_splits(20480, 24, 8192, (108,)) == set()


# --------------------------------------------------------------------------- warmup (0031/0032)
@pytest.fixture(scope="module")
def warm():
    _need_probe()
    r = subproc.run([sys.executable, str(PROBE), "warmup"], env=_probe_env(), cwd=REPO, cap=600)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        pytest.fail(f"mhc probe failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
    res = json.loads(lines[-1])
    assert res["_scenario"]["ok"], res["_scenario"]
    return {k: _val(res, k) for k in ("on", "off")}


def _splits(keys):
    import re
    return {int(re.search(r"n_splits=(\d+)", k).group(1)) for k in keys}


def test_warmup_registers_every_ampere_kernel(warm):
    from vllm.deepinfer.mhc import warmup as w
    on = warm["on"]
    # hidden 1024, 256 tokens, no GPU visible: the keys of every Ampere SM count.
    want = {repr(k) for kk in (4096, 1024)
            for k in w.tc_keys(kk, 24, 256, w.AMPERE_SM_COUNTS)}
    assert set(on["MhcTcProjection"]) == want
    # First-layer batches under 16 tokens: TileLang's prenorm GEMM over the embedding row.
    assert all("hc_mult=1" in k for k in on["HcPrenormGemmTileLangKernel"])
    # The fused post + pre kernel, which V4.1's model itself never registers.
    assert on["MhcFusedTileLangKernel"]
    # Epilogues at every split count the projection writes.
    tc = {kk: w.projection_splits(kk, 24, 256, w.AMPERE_SM_COUNTS) for kk in (4096, 1024)}
    assert tc[4096] <= _splits(on["MHCPreNormKernel"])
    big = on["MhcPreBigFuseTileLangKernel"]
    assert tc[4096] <= _splits(k for k in big if "is_broadcast=False" in k)
    assert tc[1024] | {1} <= _splits(k for k in big if "is_broadcast=True" in k)


def test_warmup_untouched_when_switched_off(warm):
    off = warm["off"]
    assert set(off) == {"MHCPreNormKernel", "MhcPreBigFuseTileLangKernel"}
    assert _splits(off["MHCPreNormKernel"]) == {1, 8}  # no DeepGEMM: one split + fused splits
