"""Software fp8 (vllm.deepinfer.fp8): e4m3fn and UE8M0 decode/encode, bit-exact against torch.

Runs the Triton helpers through the torch-level wrappers; on a CPU-only machine under
TRITON_INTERPRET=1 (conftest). Variant "sm80" (= "cpu") is the integer path; "sm90" is the
hardware-cvt path, which the interpreter emulates imperfectly: it decodes 0x7F/0xFF as ±480
instead of NaN, and its fp32 -> fp8e4nv rounding is not round-to-nearest-even (it rounds
half up and drops mantissa carries), so the HW path is only checked where the interpreter is
right: non-NaN decodes and encodes of exactly representable values.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm.deepinfer import fp8, kv_record

SW, HW = "sm80", "sm90"
CODES = torch.arange(256, dtype=torch.uint8)
NAN_CODES = (CODES & 0x7F) == 0x7F
SUITE = Path(__file__).resolve().parent.parent / "benchmarks" / "suites" / "fp8.py"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _torch_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).view(torch.uint8)


def _skip_without_hw_fp8(device):
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("hardware e4m3 needs sm_89+")


@pytest.fixture(scope="module")
def bench():
    """benchmarks/suites/fp8.py as a module (its kernels are tested here too)."""
    spec = importlib.util.spec_from_file_location("bench_fp8", SUITE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- e4m3 decode
@pytest.mark.parametrize("variant", [SW, "cpu"])
def test_decode_all_codes_bit_identical(variant, device):
    ref = CODES.view(torch.float8_e4m3fn).float()
    got = fp8.e4m3_decode(CODES.to(device), variant).cpu()
    assert torch.equal(_bits(got), _bits(ref))  # NaN codes included: 0x7FF00000 | sign
    assert _bits(got)[0x7F].item() == 0x7FF00000 and _bits(got)[0xFF].item() == -0x00100000


def test_decode_hw_path(device):
    _skip_without_hw_fp8(device)
    ref = CODES.view(torch.float8_e4m3fn).float()
    got = fp8.e4m3_decode(CODES.to(device), HW).cpu()
    assert torch.equal(_bits(got[~NAN_CODES]), _bits(ref[~NAN_CODES]))
    if device != "cpu":  # the interpreter decodes 0x7F/0xFF as ±480, not NaN
        assert got[NAN_CODES].isnan().all()


@pytest.mark.parametrize("name", ["int", "lut", "e4b15", "f16bits"])
def test_candidate_decoders_exact(bench, name, device):
    """The benchmark's candidates, through the benchmark's own code path."""
    res = bench.codes_check(name, device)
    assert res["exact"] and res["nan_bits_equal"]


def test_decode_shapes_and_strides(device):
    x = torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8).to(device)
    got = fp8.e4m3_decode(x.transpose(0, 2), SW)  # non-contiguous
    assert got.shape == (7, 5, 3)
    assert torch.equal(_bits(got.cpu()), _bits(x.transpose(0, 2).cpu().view(torch.float8_e4m3fn).float()))
    assert fp8.e4m3_decode(torch.empty(0, 4, dtype=torch.uint8, device=device)).shape == (0, 4)
    strided = x.reshape(-1)[::3]  # 1-D but not contiguous
    assert torch.equal(_bits(fp8.e4m3_decode(strided, SW).cpu()),
                       _bits(strided.cpu().view(torch.float8_e4m3fn).float()))
    amax = torch.logspace(-5, 5, 300)[::7].to(device)
    assert torch.equal(fp8.ue8m0_encode(amax), fp8.ue8m0_encode(amax.contiguous()))


# --------------------------------------------------------------------------- UE8M0
def test_ue8m0_decode_all_bytes(device):
    got = fp8.ue8m0_decode(CODES.to(device), SW).cpu()
    ref = torch.exp2(CODES.double() - 127).float()  # exact: 2^-127 is an fp32 denormal
    assert torch.equal(_bits(got), _bits(ref))
    assert _bits(got)[0].item() == 0x00400000  # byte 0: 2^-127, built explicitly (0 << 23 is +0)
    assert got[255].item() == math.inf  # byte 255: +inf, what upstream's exp2(128) gives
    assert torch.equal(_bits(got[1:255]), (CODES[1:255].int() << 23))


def _exact_exponent(amax: torch.Tensor) -> torch.Tensor:
    """ceil(log2(max(amax, 1e-4) / 448)) by float64 frexp, independent of the bit trick.

    a/448 for fp32 a is either exactly a power of two (a = 448 * 2^k, exact in float64) or
    at least 1/(7 * 2^24) relatively away from one, far above float64 rounding (2^-53).
    """
    a = amax.double().numpy()
    a = np.where(a > np.float32(1e-4), a, np.float64(np.float32(1e-4)))  # NaN -> the floor
    m, p = np.frexp(a / 448.0)  # a/448 = m * 2^p, m in [0.5, 1)
    e = np.where(m == 0.5, p - 1, p)
    return torch.from_numpy(np.where(np.isinf(a), 128, e).astype(np.int32))


def _ue8m0_inputs(bench) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    rand_bits = torch.randint(0, 0x7F800000, (200_000,), generator=g, dtype=torch.int32)
    eps = np.float32(1e-4)
    special = torch.tensor([0.0, -0.0, -1.0, -math.inf, math.nan, math.inf, 1e-4, 448.0,
                            float(np.nextafter(eps, np.float32(0))), float(np.nextafter(eps, np.float32(1))),
                            448 * 2.0 ** -22, 448 * 2.0 ** -23, 3.4028234663852886e38,
                            1.401298464324817e-45], dtype=torch.float32)
    return torch.cat([bench.positive_bf16_values(), bench.scale_band_values(),
                      rand_bits.view(torch.float32), special])


def test_ue8m0_encode_exact(bench, device):
    amax = _ue8m0_inputs(bench)
    got = fp8.ue8m0_encode(amax.to(device), SW).cpu()
    want = (_exact_exponent(amax) + 127).clamp(0, 255).to(torch.uint8)
    assert torch.equal(got, want)
    assert got.min().item() == 105 and fp8.ue8m0_encode(
        torch.tensor([3.4028234663852886e38, math.inf, math.nan, -5.0], device=device)).tolist() == [247, 255, 105, 105]


def test_ue8m0_matches_upstream_formula_on_bf16_amax(bench, upstream, device):
    """Every positive finite bf16 amax >= 1e-4: upstream's fp32 ceil(log2(amax / 448))
    (its ``_mxfp8_scale_bits``, interpreted: numpy log2) equals the exact exponent."""
    v = bench.positive_bf16_values()
    v = v[v >= 1e-4].to(device)
    assert torch.equal(bench.upstream_scale_bytes(v).cpu(), fp8.ue8m0_encode(v).int().cpu())


def test_ue8m0_upstream_formula_band(bench, upstream, device):
    """fp32 amax: upstream's rounded log2 picks one exponent too small for amax 1..39 ulps
    above 448 * 2^k (k >= 4 or k <= -5:
    the fp32 log2 of such a value rounds to the integer k), never
    elsewhere. This is the interpreter's numpy log2; the H200 row of the fp8 suite measures
    the GPU's (libdevice log2f after div.full.f32)."""
    band = bench.scale_band_values()
    up = bench.upstream_scale_bytes(band.to(device)).cpu()
    ours = fp8.ue8m0_encode(band.to(device)).int().cpu()
    bad = (up != ours).nonzero().flatten()
    assert bad.numel() > 0 and set((up - ours)[bad].tolist()) == {-1}
    ulps = (bad % 129) - 64  # offset from 448 * 2^k in fp32 ulps
    k = bad // 129 - 22
    assert ulps.min().item() >= 1 and ulps.max().item() <= 39
    # ceil(log2) of a value just above 2^k lands on k when the fp32 log2 rounds to k,
    # i.e. when log2's ulp near k is coarse: k >= 4 or k <= -5 (every such k is hit).
    assert set(k.tolist()) == {kk for kk in range(-22, 120) if kk >= 4 or kk <= -5}


def test_ue8m0_matches_upstream_writer(bench, upstream, device):
    """upstream's real writer (quantize_and_insert_k_kernel, bf16 input) stores the same
    scale bytes: bf16 amax at, just below and just above 448 * 2^k for every k, and around
    the 1e-4 floor."""
    v = bench.positive_bf16_values()
    bits = v.view(torch.int32)
    near = torch.tensor([448.0 * 2.0 ** k for k in range(-24, 119)]).to(torch.bfloat16).float()
    nb = near.view(torch.int32)
    sel = torch.cat([nb - 0x10000, nb, nb + 0x10000]).view(torch.float32)  # ±1 bf16 ulp
    sel = torch.cat([sel, v[(v > 2e-5) & (v < 5e-4)][::4], v[bits % 997 == 0]])
    got = bench.upstream_writer_scale_bytes(sel.to(torch.bfloat16).to(device)).cpu()
    assert torch.equal(got, fp8.ue8m0_encode(sel.to(device)).cpu())


def test_ue8m0_matches_kv_record_reference(device):
    k = (torch.randn(64, 512) * torch.logspace(-6, 6, 64)[:, None]).to(torch.bfloat16)
    _, scales, _ = kv_record.quantize_rows(k)
    amax = k[:, :448].float().abs().reshape(64, 7, 64).amax(-1)
    assert torch.equal(fp8.ue8m0_encode(amax.to(device)).cpu(), scales[:, :7])


# --------------------------------------------------------------------------- e4m3 encode
def _e4m3_magnitudes() -> np.ndarray:
    """The 127 non-negative finite e4m3 values, ascending, as float64."""
    return np.sort(CODES[:127].view(torch.float8_e4m3fn).double().numpy())


def _encode_cases() -> torch.Tensor:
    """Ties, their fp32 neighbours, the values themselves and theirs, subnormals, ±0, ±448,
    binade-crossing roundings (ties between 1.875*2^e and 2^(e+1) go up), fp32 denormals,
    plus 4M random values (uniform and log-uniform) in [-448, 448]."""
    mags = _e4m3_magnitudes()
    mids = (mags[:-1] + mags[1:]) / 2  # exact in fp32: one more mantissa bit
    pts = np.concatenate([mags, mids, [2.0 ** -10, 2.0 ** -11, 1e-30, 1e-40, 1.4e-45]]).astype(np.float32)
    up = np.nextafter(pts, np.float32(np.inf))
    down = np.nextafter(pts, np.float32(-np.inf))
    special = np.concatenate([pts, up, down])
    special = special[np.abs(special) <= 448]
    g = torch.Generator().manual_seed(1)
    uni = torch.rand(1 << 21, generator=g) * 896 - 448
    mant = torch.randint(0, 1 << 23, (1 << 21,), generator=g, dtype=torch.int32)
    expo = torch.randint(127 - 30, 127 + 9, (1 << 21,), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (1 << 21,), generator=g, dtype=torch.int32) << 31
    logu = (sign | (expo << 23) | mant).view(torch.float32).clamp(-448, 448)
    s = torch.from_numpy(special)
    return torch.cat([s, -s, uni, logu])


@pytest.fixture(scope="module")
def encode_cases():
    return _encode_cases()


@pytest.mark.parametrize("variant", [SW, "cpu"])
def test_encode_fp32_byte_identical(encode_cases, variant, device):
    x = encode_cases
    assert x.numel() > 4_000_000
    got = fp8.e4m3_encode(x.to(device), variant).cpu()
    want = _torch_e4m3(x)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. x={x[bad[:5]].tolist()}"
    assert _torch_e4m3(torch.tensor([-0.0])).item() == 0x80 == fp8.e4m3_encode(
        torch.tensor([-0.0], device=device), variant).item()


def test_encode_ties_go_to_even(device):
    mags = _e4m3_magnitudes()
    mids = torch.from_numpy(((mags[:-1] + mags[1:]) / 2).astype(np.float32))
    got = fp8.e4m3_encode(mids.to(device), SW).cpu()
    assert (got.int() % 2 == 0).all()  # the even code of each adjacent pair
    assert torch.equal(got, _torch_e4m3(mids))


def test_encode_all_bf16_patterns(device):
    """bf16 input: all 65536 bit patterns (NaN and out-of-range included) — the bf16 -> fp32
    step is exact, so this equals the fp32 path; torch 2.13 agrees on every pattern."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    got = fp8.e4m3_encode(x.to(device), SW).cpu()
    assert torch.equal(got, fp8.e4m3_encode(x.float().to(device), SW).cpu())
    inr = x.float().abs() <= 448
    assert torch.equal(got[inr], _torch_e4m3(x[inr]))
    assert torch.equal(got[x.isnan()], torch.where(_bits(x.float()[x.isnan()]) < 0, 0xFF, 0x7F).to(torch.uint8))


def test_encode_saturates_and_nan(device):
    """Beyond ±448 the software path saturates to ±448 (0x7E/0xFE), ±inf included — the
    hardware cvt.rn.satfinite's result. (torch 2.13 on CPU does the same; older torch
    returned NaN from 464 up, so this is checked against fixed bytes, not torch.) NaN ->
    0x7F, with its sign bit 0xFF."""
    big = torch.tensor([448.00003, 449.0, 463.99, 464.0, 464.01, 479.99, 480.0, 1e10,
                        3.4028234663852886e38, math.inf])
    got = fp8.e4m3_encode(torch.cat([big, -big]).to(device), SW).cpu()
    assert got.tolist() == [0x7E] * len(big) + [0xFE] * len(big)
    nan = torch.tensor([math.nan, -math.nan, math.nan], dtype=torch.float32)
    nan[2] = torch.tensor(0x7FC00001, dtype=torch.int32).view(torch.float32)  # payload NaN
    assert fp8.e4m3_encode(nan.to(device), SW).cpu().tolist() == [0x7F, 0xFF, 0x7F]


@pytest.mark.parametrize("variant", [SW, HW])
def test_round_trip(variant, device):
    """encode(decode(c)) == c for every non-NaN code, on both paths (the HW encode is only
    meaningful in the interpreter for representable values — these are); and decode(encode(x))
    is torch's rounding of x."""
    if variant == HW:
        _skip_without_hw_fp8(device)
    c = CODES[~NAN_CODES].to(device)
    assert torch.equal(fp8.e4m3_encode(fp8.e4m3_decode(c, variant), variant), c)
    x = (torch.rand(50_000, generator=torch.Generator().manual_seed(2)) * 896 - 448)
    if variant == SW:
        got = fp8.e4m3_decode(fp8.e4m3_encode(x.to(device), variant), variant).cpu()
        assert torch.equal(_bits(got), _bits(x.to(torch.float8_e4m3fn).float()))


@pytest.mark.parametrize("hw", [False, True])
def test_roundtrip_kernel(hw, device):
    if hw:
        _skip_without_hw_fp8(device)
    y = torch.empty(256, dtype=torch.uint8, device=device)
    fp8._fp8_roundtrip_kernel[(1,)](CODES.to(device), y, 256, HW_FP8=hw, BLOCK=256)
    y = y.cpu()
    assert torch.equal(y[~NAN_CODES], CODES[~NAN_CODES])
    if not hw:  # NaN codes come back as NaN (HW in the interpreter: 480 saturates to 448)
        assert y[NAN_CODES].tolist() == [0x7F, 0xFF]


# --------------------------------------------------------------------------- validation
def test_validation_errors(device, monkeypatch):
    with pytest.raises(ValueError, match="^x: dtype torch.float32, expected torch.uint8$"):
        fp8.e4m3_decode(torch.zeros(4, device=device))
    with pytest.raises(ValueError, match="^x: dtype torch.float16, expected torch.float32 or torch.bfloat16$"):
        fp8.e4m3_encode(torch.zeros(4, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="^amax: dtype .*, expected torch.float32$"):
        fp8.ue8m0_encode(torch.zeros(4, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="^b: expected a torch.Tensor"):
        fp8.ue8m0_decode([1, 2])
    with pytest.raises(ValueError, match="^variant: 'sm75' is not one of"):
        fp8.e4m3_decode(torch.zeros(4, dtype=torch.uint8, device=device), "sm75")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="^x: a CPU tensor"):
        fp8.e4m3_decode(torch.zeros(4, dtype=torch.uint8))


# --------------------------------------------------------------------------- compile gate
_GATE_SCRIPT = r"""
import dataclasses, importlib.util, json, sys
sys.path[:0] = sys.argv[1:3]
from vllm.deepinfer import compile_gate
spec = importlib.util.spec_from_file_location("bench_fp8", sys.argv[3])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
jobs = [(s, cc) for s in compile_gate.specs() if s.name.startswith("fp8.") for cc in s.targets]
jobs += [(s, cc) for s in bench.gate_specs() for cc in ((80, 90) if 80 in s.targets else (90,))]
print(json.dumps([dataclasses.asdict(compile_gate.check(s, cc, want_regs=False)) for s, cc in jobs]))
"""


@pytest.fixture(scope="module")
def gate():
    """Compile results {(name, cc): GateResult dict}. Compiling needs real @triton.jit
    functions, so it runs in a subprocess without TRITON_INTERPRET."""
    import json
    import os
    import sys

    import subproc
    repo = SUITE.parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subproc.run([sys.executable, "-c", _GATE_SCRIPT, str(repo / "overlay"),
                       str(repo / "build"), str(SUITE)], env=env, cap=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {(r["name"], r["cc"]): r for r in json.loads(out.stdout.strip().splitlines()[-1])}


def test_gate_roundtrip_kernel(gate):
    """fp8.py registers the roundtrip kernel: software for sm_80/sm_86 (no fp8e4nv), hardware
    for sm_90."""
    for cc in (80, 86):
        r = gate[("fp8._fp8_roundtrip_kernel[sm80]", cc)]
        assert r["ok"] and r["uses_fp8e4nv"] is False, r
    r = gate[("fp8._fp8_roundtrip_kernel[sm90]", 90)]
    assert r["ok"] and r["uses_fp8e4nv"] is True, r
    assert ("fp8._fp8_roundtrip_kernel[sm90]", 80) not in gate


def test_gate_all_fp8_specs(gate):
    fp8_rows = [r for (name, _), r in gate.items() if name.startswith("fp8.")]
    assert len(fp8_rows) >= 18
    assert all(r["ok"] for r in fp8_rows), [r for r in fp8_rows if not r["ok"]]
    assert not any(r["uses_fp8e4nv"] for r in fp8_rows if r["cc"] < 89)


def test_benchmark_kernels_compile(gate, bench):
    """Every QK-loop build of the fp8 suite compiles for sm_90; the software candidates with
    sm80 tiles also for sm_80, inside the 48 KiB budget and without fp8e4nv."""
    names = {s.name for s in bench.gate_specs()}
    rows = [r for (name, _), r in gate.items() if name in names]
    assert {r["name"] for r in rows if r["cc"] == 90} == names
    assert len([r for r in rows if r["cc"] == 80]) == 4
    for r in rows:
        assert r["ok"], r
        if r["cc"] == 80:
            assert r["uses_fp8e4nv"] is False and r["shared"] <= 48 * 1024
