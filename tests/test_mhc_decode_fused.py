"""The one-launch mHC decode kernel (vllm.deepinfer.mhc.decode_fused): V4.1's shifted post +
pre (``delayed``) and V4's fused post + pre (``fused``) at 1-32 tokens.

CPU (Triton interpreter, hidden 256 = 8 k-slices of 32 columns): every output against
plain torch --
  * the new residual streams bit-identical (uint16 bit patterns) to upstream's mhc_post
    arithmetic, emulated here in the order nvcc compiles ``mhc_post_tilelang`` and
    ``mhc_fused_tilelang`` to on sm_80 and sm_90 (one fp32 multiply comb[0] * residual[0],
    a fused multiply-add of post * x into it, then one per input stream k = 1..3, round to
    nearest even to bf16; their SASS, read on the CPU machine). The interpreter computes
    ``tl.fma`` as a multiply and an add and truncates fp32 -> bf16, so the fixture below
    makes it fuse (exactly: float64 with round-to-odd) and round as a GPU does
    (tests/interp_bf16.py);
  * post, comb, the next pre-mix and the layer input against the fp32 reference
    (vllm.deepinfer.mhc.reference), each no further from it than upstream's own
    arithmetic at these token counts on the same inputs (upstream's fused kernel projects
    the fp32 streams before their bf16 rounding; ``_upstream_form`` computes exactly that
    in torch), with the absolute bounds of test_mhc_gpu.py beside (COEF_ATOL 2e-3, the
    layer input within two bf16 ulps of the reference);
  * V4.1's aux stream mean bit-identical to upstream's (0 + s0 + s1 + s2 + s3, / 4);
  * determinism (two launches, same bits) and the workspace counters back at zero.
Routing (which calls the kernel takes), the warmup keys against the launch keys, and the
sm_80/sm_86 builds of the heaviest configurations (compile gate: 48 KiB of shared memory,
no register spills) run on the CPU too. ``gpu`` tests (the H200 with the vLLM kit, TileLang
importable) compare with upstream's TileLang kernels at hidden 4096/5120/7168.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import interp_bf16
from vllm.deepinfer import routing
from vllm.deepinfer.mhc import decode_fused as df
from vllm.deepinfer.mhc import reference as ref

REPO = Path(__file__).resolve().parent.parent
HC = 4
EPS = (1e-6, 1e-6, 1e-6, 2.0, 20)   # rms_eps, hc_pre_eps, hc_sinkhorn_eps, post mult, iters
NORM_EPS = 1e-6
COEF_ATOL = 2e-3
TOKENS = (1, 2, 4, 6, 8, 12, 16, 24, 32)
# The interpreter runs S + 2T programs per launch (hidden 256: S = 8), about 45 ms each
# here: a subset of the token counts on the CPU (both token classes, both sides of 16),
# every one of them on a GPU.
_GPU = torch.cuda.is_available()
V41_TOKENS = TOKENS if _GPU else (1, 2, 4, 6, 12, 17, 32)
V4_TOKENS = TOKENS if _GPU else (1, 8, 24)
CPU_HIDDEN = 256


# --------------------------------------------------------------------------- emulation
def fma32(a, b, c) -> np.ndarray:
    """fp32 fused multiply-add, rounded once: the product is exact in float64, the sum is
    rounded to odd in float64 (TwoSum error, then a step towards it when the result is
    even), and float64 -> float32 rounds to nearest even -- correct, as 53 >= 24 + 2."""
    a64, b64, c64 = (np.asarray(v, dtype=np.float64) for v in (a, b, c))
    p = a64 * b64
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    fix = (err != 0) & ((s.view(np.int64) & 1) == 0)
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


@pytest.fixture
def gpu_like_interpreter(monkeypatch):
    """Under the interpreter: tl.fma fused (fma32) and fp32 -> bf16 to nearest even."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        yield
        return
    from triton.runtime import interpreter as itp
    interp_bf16.patch(monkeypatch.setattr)
    orig = itp.InterpreterBuilder.create_fma

    def create_fma(self, x, y, z):
        if z.data.dtype == np.float32:
            return itp.TensorHandle(fma32(x.data, y.data, z.data), z.dtype.scalar)
        return orig(self, x, y, z)
    monkeypatch.setattr(itp.InterpreterBuilder, "create_fma", create_fma)
    yield


def upstream_post(x, residual, post, comb) -> torch.Tensor:
    """upstream's new residual streams, bf16, in the order nvcc compiles TileLang's source
    to (sm_80 and sm_90 SASS alike): FMUL comb[0, j] * residual[0], FFMA post[j] * x into
    it, then FFMA comb[k, j] * residual[k] for k = 1, 2, 3. The source reads
    ``post * x`` first; nvcc's contraction fuses that multiply and keeps the other."""
    t, hc, h = residual.shape
    xf = x.float().cpu().numpy()
    rf = residual.float().cpu().numpy()
    pm = post.reshape(t, hc).float().cpu().numpy()
    cm = comb.float().cpu().numpy()
    out = np.empty((t, hc, h), np.float32)
    for j in range(hc):
        v = (cm[:, 0, j:j + 1] * rf[:, 0]).astype(np.float32)
        v = fma32(np.broadcast_to(pm[:, j:j + 1], v.shape), xf, v)
        for k in range(1, hc):
            v = fma32(np.broadcast_to(cm[:, k, j:j + 1], v.shape), rf[:, k], v)
        out[:, j] = v
    return torch.from_numpy(out).to(torch.bfloat16).to(residual.device)


def _upstream_form(d, delayed: bool):
    """Coefficients as upstream's fused kernel forms them at 1-32 tokens: the projection and
    its squared sum over the fp32 streams (before their bf16 rounding), fp32 otherwise."""
    t = d["x"].shape[0]
    new = ref.post(d["x"], d["res"], d["post"], d["comb"]).view(t, -1)
    mixes, sq = new @ d["fn"].float().T, new.square().sum(-1)
    pre, pm, comb = ref.coefficients(mixes, sq, new.shape[1], d["scale"], d["base"], *EPS, HC)
    return pm[:, :, None], comb, pre


def _inputs(t, hidden, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = HC * (HC + 2)
    d = dict(x=torch.randn(t, hidden, generator=g).to(torch.bfloat16),
             res=torch.randn(t, HC, hidden, generator=g).to(torch.bfloat16),
             post=2 * torch.rand(t, HC, 1, generator=g),
             comb=torch.softmax(torch.randn(t, HC, HC, generator=g), -1).contiguous(),
             pre=torch.rand(t, HC, generator=g) + 0.1,
             fn=torch.randn(n, HC * hidden, generator=g) * (HC * hidden) ** -0.5,
             scale=torch.tensor([0.8, 1.2, 1.5]), base=torch.randn(n, generator=g) * 0.1,
             w=(1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16))
    return {k: v.to(device) for k, v in d.items()}


def _call(d, form, pre=True, aux=False):
    a = (d["x"], d["res"], d["post"], d["comb"], d["fn"], d["scale"], d["base"], *EPS)
    if form == "v41":
        return df.delayed(*a, pre_mix=d["pre"] if pre else None, norm_weight=d["w"],
                          norm_eps=NORM_EPS, capture_aux=aux)
    return df.fused(*a, norm_weight=d["w"], norm_eps=NORM_EPS)


def _err(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _bf16_ulps(got, want, ulps: float) -> bool:
    """|got - want| <= ulps bf16 ulps of |want| (at least of 2^-6)."""
    scale = want.float().abs().clamp_min(2.0 ** -6)
    return bool(((got.float() - want.float()).abs() <= ulps * 2.0 ** -7 * scale).all())


@pytest.fixture
def ampere(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ARCH", "sm80" if torch.cuda.is_available() else "cpu")
    for k in ("DEEPINFER_MHC", "DEEPINFER_DISABLE"):
        monkeypatch.delenv(k, raising=False)
    # the kernel under test: off by default on the GPU variants (envs.py)
    monkeypatch.setenv("DEEPINFER_MHC_DECODE", "1")
    routing.reset()
    yield
    routing.reset()


def _check_against_reference(d, got, form, pre=True):
    t, hidden = d["x"].shape
    a = (d["x"], d["res"], d["post"], d["comb"], d["fn"], d["scale"], d["base"], *EPS)
    want = ref.fused_post_pre(*a, norm_weight=d["w"], norm_eps=NORM_EPS,
                              pre_mix=d["pre"] if (pre and form == "v41") else None,
                              delayed=form == "v41")
    # the residual streams: upstream's bits
    assert got[0].shape == (t, HC, hidden) and got[0].dtype == torch.bfloat16
    assert torch.equal(_bits(got[0]), _bits(upstream_post(d["x"], d["res"], d["post"], d["comb"])))
    # coefficients: within upstream's own distance from the fp32 reference
    up = _upstream_form(d, form == "v41")
    pairs = [(got[1], want[1], up[0]), (got[2], want[2], up[1])]
    if form == "v41":
        pairs.append((got[4], want[4], up[2]))
    for ours, w, u in pairs:
        e_ours, e_up = _err(ours, w), _err(u, w)
        assert e_ours <= max(e_up, 1e-5), (e_ours, e_up)
        assert e_ours <= COEF_ATOL
    # the layer input: bf16, two ulps of the reference (RMSNorm sum order, one rounding)
    assert got[3].shape == (t, hidden) and got[3].dtype == torch.bfloat16
    assert _bf16_ulps(got[3], want[3], 2.0), _err(got[3], want[3])
    return want


# --------------------------------------------------------------------------- CPU / interpreter
@triton.jit
def _post_probe_kernel(x, r, p, c, out, N: tl.constexpr):
    """The kernel's own post-mapping helper on one stream, fp32 out (no bf16 rounding)."""
    o = tl.arange(0, N)
    tl.store(out + o, df._post_stream(
        tl.load(x + o), tl.load(r + o), tl.load(r + N + o), tl.load(r + 2 * N + o),
        tl.load(r + 3 * N + o), tl.load(p), tl.load(c), tl.load(c + 1), tl.load(c + 2),
        tl.load(c + 3)))


@pytest.mark.usefixtures("gpu_like_interpreter")
def test_post_operation_order(device):
    """fp32 bits of the post mapping: FMUL comb[0] * residual[0], FFMA post * x, then FFMA
    comb[k] * residual[k] for k = 1, 2, 3 -- the order upstream's TileLang kernels compile
    to (their SASS on sm_80 and sm_90). The bf16 rounding hides most reorderings from the
    stored streams (about 2e-5 of the elements); the fp32 result does not."""
    g = torch.Generator().manual_seed(5)
    n = 4096
    x = torch.randn(n, generator=g).to(torch.bfloat16).float()
    r = torch.randn(4, n, generator=g).to(torch.bfloat16).float()
    p = 2 * torch.rand(1, generator=g)
    c = torch.rand(4, generator=g)
    out = torch.empty(n)
    dev = [t.to(device) for t in (x, r, p, c, out)]
    _post_probe_kernel[(1,)](*dev, N=n)
    v = (c[0].numpy() * r[0].numpy()).astype(np.float32)
    v = fma32(np.full(n, p.item(), np.float32), x.numpy(), v)
    for k in range(1, 4):
        v = fma32(np.full(n, c[k].item(), np.float32), r[k].numpy(), v)
    got = dev[4].cpu().numpy()
    assert np.array_equal(got.view(np.int32), v.view(np.int32)), int((got != v).sum())
    # the test can tell: the source's order (post * x rounded first, which the GPU test run
    # at 5f3a658 showed upstream does not compute) differs in many elements
    w = (p.numpy() * x.numpy()).astype(np.float32)
    for k in range(4):
        w = fma32(np.full(n, c[k].item(), np.float32), r[k].numpy(), w)
    assert (w != v).sum() > 10


@pytest.mark.usefixtures("gpu_like_interpreter", "ampere")
@pytest.mark.parametrize("t", V41_TOKENS)
def test_v41_shifted_post_pre(device, t):
    d = _inputs(t, CPU_HIDDEN, device, seed=t)
    got = _call(d, "v41")
    assert got is not None, "the decode kernel declined a call it covers"
    assert [tuple(g.shape) for g in got] == [(t, HC, CPU_HIDDEN), (t, HC, 1), (t, HC, HC),
                                             (t, CPU_HIDDEN), (t, HC), (0, CPU_HIDDEN)]
    _check_against_reference(d, got, "v41")
    _, ctr = df._workspace(d["x"].device)
    assert ctr.tolist() == [0, 0, 0, 0]


@pytest.mark.usefixtures("gpu_like_interpreter", "ampere")
@pytest.mark.parametrize("t", V4_TOKENS)
def test_v4_fused_post_pre(device, t):
    d = _inputs(t, CPU_HIDDEN, device, seed=100 + t)
    got = _call(d, "v4")
    assert got is not None
    assert [tuple(g.shape) for g in got] == [(t, HC, CPU_HIDDEN), (t, HC, 1), (t, HC, HC),
                                             (t, CPU_HIDDEN)]
    _check_against_reference(d, got, "v4")
    _, ctr = df._workspace(d["x"].device)
    assert ctr.tolist() == [0, 0, 0, 0]


@pytest.mark.usefixtures("gpu_like_interpreter", "ampere")
def test_v41_model_entry_and_aux(device):
    """No carried pre-mix (stream 0 collapses) and the aux stream mean of draft models."""
    t = 5
    d = _inputs(t, CPU_HIDDEN, device, seed=7)
    got = _call(d, "v41", pre=False, aux=True)
    _check_against_reference(d, got, "v41", pre=False)
    new = upstream_post(d["x"], d["res"], d["post"], d["comb"]).float()
    aux = ((((0.0 + new[:, 0]) + new[:, 1]) + new[:, 2]) + new[:, 3]) / 4
    assert torch.equal(_bits(got[5]), _bits(aux.to(torch.bfloat16)))


@pytest.mark.usefixtures("gpu_like_interpreter", "ampere")
def test_deterministic_and_leading_shape(device):
    """Two launches give the same bits; V4's form keeps the caller's leading shape."""
    d = _inputs(12, CPU_HIDDEN, device, seed=3)
    a, b = _call(d, "v41"), _call(d, "v41")
    assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))
    d2 = {k: v.view(3, 4, *v.shape[1:]) if k in ("x", "res", "post", "comb") else v
          for k, v in d.items()}
    got = _call(d2, "v4")
    assert [tuple(g.shape) for g in got] == [(3, 4, HC, CPU_HIDDEN), (3, 4, HC, 1),
                                             (3, 4, HC, HC), (3, 4, CPU_HIDDEN)]
    flat = _call(d, "v4")
    assert all(torch.equal(_bits(x.reshape(y.shape)), _bits(y)) for x, y in zip(got, flat))


@pytest.mark.usefixtures("gpu_like_interpreter", "ampere")
@pytest.mark.parametrize("form,t", [("v41", 3), ("v4", 3), ("v4", 17)])
def test_scratch_picks_give_the_same_bits(monkeypatch, device, form, t):
    """The coefficient CTA (and V4's norm CTA) reading its summed record through a scratch
    row (SCRATCH_PICKS) or through one reduction per scalar: bit-identical outputs."""
    d = _inputs(t, CPU_HIDDEN, device, seed=50 + t)
    monkeypatch.setattr(df, "SCRATCH_PICKS", True)
    a = _call(d, form)
    monkeypatch.setattr(df, "SCRATCH_PICKS", False)
    b = _call(d, form)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(_bits(x), _bits(y))


# --------------------------------------------------------------------------- routing
def test_feature_defaults():
    from vllm.deepinfer import envs
    # off on every GPU variant until a GPU has run it (envs.py says why); on for the CPU's
    assert envs.FEATURES[df.FEATURE].default_on == frozenset({"cpu"})


@pytest.mark.usefixtures("ampere")
@pytest.mark.parametrize("env,want", [
    ({"DEEPINFER_ARCH": "cpu"}, True),
    ({"DEEPINFER_ARCH": "sm80"}, False),
    ({"DEEPINFER_ARCH": "sm80", "DEEPINFER_MHC_DECODE": "1"}, True),
    ({"DEEPINFER_MHC_DECODE": "0"}, False),
    ({"DEEPINFER_MHC": "0"}, False),
    ({"DEEPINFER_DISABLE": "mhc_decode"}, False),
    ({"DEEPINFER_ARCH": "sm90"}, False),
    ({"DEEPINFER_ARCH": "sm90", "DEEPINFER_MHC": "1", "DEEPINFER_MHC_DECODE": "1"}, True),
])
def test_switches(monkeypatch, env, want):
    monkeypatch.delenv("DEEPINFER_MHC_DECODE")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    routing.reset()
    assert df.enabled() is want


@pytest.mark.usefixtures("ampere")
def test_declines_what_it_does_not_cover(monkeypatch):
    monkeypatch.setenv("DEEPINFER_MHC_DECODE", "1")
    routing.reset()
    d = _inputs(4, CPU_HIDDEN, "cpu")

    def fits(**over):
        e = dict(d, **over)
        return df._fits(e["x"], e["res"], e["post"], e["comb"], e["fn"], e["scale"],
                        e["base"], e["w"], 20, e["pre"])
    monkeypatch.setattr(df.arch, "interpreting", lambda: True)
    assert fits()
    big = _inputs(33, CPU_HIDDEN, "cpu")
    assert not fits(**{k: big[k] for k in ("x", "res", "post", "comb", "pre")})   # 33 tokens
    odd = _inputs(4, 320, "cpu")                                                  # 320 % 256
    assert not fits(**{k: odd[k] for k in ("x", "res", "fn", "w")})
    assert not fits(w=None)
    assert not fits(w=d["w"].float())
    assert not fits(x=d["x"].float())
    assert not fits(res=d["res"].transpose(1, 2).contiguous().transpose(1, 2))    # strided
    assert not fits(x=torch.cat([torch.zeros(1, dtype=torch.bfloat16),
                                 d["x"].flatten()])[1:].view_as(d["x"]))          # unaligned
    monkeypatch.setattr(df.arch, "interpreting", lambda: False)
    assert not fits()                                                             # CPU tensors
    monkeypatch.setattr(df.arch, "interpreting", lambda: True)
    monkeypatch.setenv("DEEPINFER_MHC_DECODE", "0")
    routing.reset()
    assert not fits()


PROBE = Path(__file__).with_name("mhc_decode_probe.py")


def test_patched_ops_route_to_the_decode_kernel():
    """Through the patched tree (patch 0030): 1-32 tokens run ours and no upstream kernel;
    DEEPINFER_MHC_DECODE=0 and 40 tokens run upstream's kernels (recorded stand-ins)."""
    from test_vllm_import import PATCHED, _need_tree
    import subproc
    _need_tree()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DEEPINFER_") or k == "DEEPINFER_BUILD"}
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(PATCHED),
               PYTHONDONTWRITEBYTECODE="1")
    r = subproc.run([sys.executable, str(PROBE)], env=env, cwd=REPO, cap=600)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    res = json.loads(lines[-1])
    val = {}
    for k, v in res.items():
        assert v["ok"], (k, v.get("message"), v.get("trace"))
        val[k] = v["value"]
    assert val["v41/6"]["calls"] == [] and val["v4/6"]["calls"] == []
    assert val["v41/6/off"]["calls"] == ["fused", "epilogue_delayed"]
    assert val["v41/6/default"]["calls"] == ["fused", "epilogue_delayed"]   # off on sm80
    assert val["v4/6/off"]["calls"] == ["fused", "epilogue"]
    assert val["v41/40"]["calls"] == ["post", "prenorm", "epilogue_delayed"]
    assert val["v41/6"]["shapes"] == [[6, 4, 256], [6, 4, 1], [6, 4, 4], [6, 256], [6, 4]]
    assert val["v4/6"]["shapes"] == [[6, 4, 256], [6, 4, 1], [6, 4, 4], [6, 256]]
    for k in ("v41/6", "v4/6"):
        err = val[k]["err"]
        assert err[0] <= 2 ** -7 * 8 and max(err[1:3]) < 1e-4 and err[3] <= 2 ** -7 * 8, err


def test_keys_and_warmup_cover_every_launch():
    from vllm.deepinfer.mhc import warmup
    # 32-column slices everywhere (64 is a benchmark-only variant): 128-224 slices
    for sm in (108, 132, 56):
        assert [df.slice_columns(h, sm) for h in (4096, 5120, 7168)] == [32, 32, 32]
    assert df.key_for(3, 7168, 108, sinkhorn=20, delayed=True, ch=64).slices == 112
    for delayed in (True, False):
        for h in (4096, 5120, 7168):
            sms = warmup.AMPERE_SM_COUNTS
            keys = df.warmup_keys(h, 8192, sms, sinkhorn=20, delayed=delayed)
            launched = {df.key_for(t, h, sm, sinkhorn=20, delayed=delayed)
                        for sm in sms for t in range(1, df.MAX_TOKENS + 1)}
            assert launched == set(keys)
            assert len(keys) == 2       # the two token classes
            for k in keys:
                assert k.slices * k.ch == h and k.grid(32) == k.slices + (k.norm_ctas + 1) * 32
    assert df.warmup_keys(5120, 4, (108,), sinkhorn=20, delayed=True) == [
        df.key_for(1, 5120, 108, sinkhorn=20, delayed=True)]
    assert df.warmup_keys(1000, 32, (108,), sinkhorn=20, delayed=True) == []


@pytest.mark.usefixtures("ampere")
def test_warmup_registration_follows_the_switch(monkeypatch):
    from vllm.deepinfer.mhc import warmup
    monkeypatch.setenv("DEEPINFER_MHC_DECODE", "1")
    routing.reset()
    assert warmup.decode_keys(5120, 64, sinkhorn=20, delayed=True, sm_counts=(108,))
    monkeypatch.setenv("DEEPINFER_MHC_DECODE", "0")
    routing.reset()
    assert warmup.decode_keys(5120, 64, sinkhorn=20, delayed=True, sm_counts=(108,)) == []


# --------------------------------------------------------------------------- compile gate
GATE_PROBE = r"""
import json, os, re, shutil, subprocess, sys, tempfile
import triton
from vllm.deepinfer import compile_gate as cg
from vllm.deepinfer.mhc import decode_fused  # registers its specs
bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
tool = bundled if os.access(bundled, os.X_OK) else shutil.which("cuobjdump")
out = []
for name in sys.argv[1:]:
    spec = cg._REGISTRY[name]
    for cc in spec.targets:
        r = cg.check(spec, cc, want_regs=False)
        stack = None
        if r.ok and tool:
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(cg.compile_spec(spec, cc).asm["cubin"])
                f.flush()
                res = subprocess.run([tool, "--dump-resource-usage", f.name],
                                     capture_output=True, text=True).stdout
            m = re.search(r"STACK:(\d+)", res)
            stack = int(m.group(1)) if m else None
        out.append(dict(name=name, cc=cc, ok=r.ok, shared=r.shared, budget=r.budget,
                        stack=stack, error=r.error))
print(json.dumps(out))
"""


def test_compile_gate_sm80_sm86():
    """The heaviest builds (the 32-token class at 5120 and 7168) compile for sm_80 and sm_86
    inside 48 KiB of shared memory without register spills; every gate key is registered."""
    names = {f"mhc_decode.{k.name}" for k in df.gate_keys()}
    from vllm.deepinfer import compile_gate
    assert names <= set(compile_gate._REGISTRY)
    assert {k.block_t for k in df.gate_keys()} == set(df.BLOCK_T)
    assert {k.delayed for k in df.gate_keys()} == {True, False}
    heavy = [f"mhc_decode.{k.name}" for k in (
        df.key_for(32, 5120, 108, sinkhorn=20, delayed=True),
        df.key_for(32, 7168, 108, sinkhorn=20, delayed=False))]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO / "overlay"), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", GATE_PROBE, *heavy], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert {(g["name"], g["cc"]) for g in got} == {(n, cc) for n in heavy for cc in (80, 86)}
    for g in got:
        assert g["ok"], g
        assert g["shared"] <= 48 * 1024 == g["budget"], g
        assert g["stack"] in (0, None), g   # None: no cuobjdump to read it with


# --------------------------------------------------------------------------- GPU: upstream
def _vllm_ops():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("tilelang") is None:
        pytest.skip("needs vLLM 0.33.0 and TileLang importable (the vLLM kit)")
    import vllm
    overlay = str(REPO / "overlay" / "vllm")
    if importlib.util.find_spec("vllm.deepinfer") is None and overlay not in vllm.__path__:
        vllm.__path__.append(overlay)
    from vllm.model_executor.kernels.mhc import tilelang as ops
    if "_deepinfer_decode" not in Path(ops.__file__).read_text():
        pytest.fail(f"{ops.__file__} lacks patch 0030's decode routing: install the overlay "
                    "(python3 tools/install_overlay.py install --vllm-dir ... --overlay "
                    "build/overlay)")
    return ops


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [4096, 5120, 7168])
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("form", ["v41", "v4"])
def test_against_upstream_tilelang(monkeypatch, form, t, hidden):
    """Upstream's op (DEEPINFER_MHC=0: its fused TileLang kernel and epilogue) beside ours
    on the same inputs: residual streams bit-identical, coefficients no further from the
    fp32 reference than upstream's, the layer input within two bf16 ulps of upstream's,
    and three launches of ours bit-identical."""
    ops = _vllm_ops()
    d = _inputs(t, hidden, "cuda", seed=t * 7 + hidden)
    a = (d["x"], d["res"], d["post"], d["comb"], d["fn"], d["scale"], d["base"], *EPS)
    monkeypatch.setenv("DEEPINFER_MHC", "0")
    routing.reset()
    if form == "v41":
        up = ops.mhc_fused_post_pre_delayed_tilelang(*a, pre_mix=d["pre"], norm_weight=d["w"],
                                                     norm_eps=NORM_EPS)
    else:
        up = ops.mhc_fused_post_pre_tilelang(*a, norm_weight=d["w"], norm_eps=NORM_EPS)
    monkeypatch.setenv("DEEPINFER_MHC", "1")
    monkeypatch.setenv("DEEPINFER_MHC_DECODE", "1")
    monkeypatch.setenv("DEEPINFER_ARCH", "sm80")
    routing.reset()
    runs = [_call(d, form) for _ in range(3)]
    ours = runs[0]
    assert ours is not None
    for other in runs[1:]:
        assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(ours, other))
    assert torch.equal(_bits(ours[0]), _bits(up[0]))
    want = ref.fused_post_pre(*a, norm_weight=d["w"], norm_eps=NORM_EPS,
                              pre_mix=d["pre"] if form == "v41" else None,
                              delayed=form == "v41")
    idx = (1, 2, 4) if form == "v41" else (1, 2)
    for i in idx:
        e_ours, e_up = _err(ours[i], want[i]), _err(up[i], want[i])
        print(f"{form} T={t} hidden={hidden} output {i}: ours {e_ours:.2e} upstream {e_up:.2e}")
        assert e_ours <= max(e_up, 1e-5), (i, e_ours, e_up)
    if form == "v41":   # the collapse weights are an input: upstream's layer input to 2 ulps
        assert _bf16_ulps(ours[3], up[3], 2.0), _err(ours[3], up[3])
    else:
        # V4 derives its pre-mix from the projection, which upstream forms from the fp32
        # streams; where the collapse cancels, upstream's layer input sat 0.016-0.031 from
        # ours on the H200 (5f3a658). The reference projects the bf16 streams, as ours does.
        # Two ulps of the output is no bound where the collapse cancels: at 3e2842d ours was
        # 0.0156 from the reference at T = 24 and 32, hidden 5120, where upstream was 0.031
        # (benchmarks/results/h200-2026-12-02-gpu-tests-3e2842d.json). So: within two ulps,
        # or no further from the reference than upstream's.
        e_ours, e_up = _err(ours[3], want[3]), _err(up[3], want[3])
        assert _bf16_ulps(ours[3], want[3], 2.0) or e_ours <= e_up, (e_ours, e_up)
    # through upstream's op, as the model calls it: the patched function returns ours
    got = (ops.mhc_fused_post_pre_delayed_tilelang(*a, pre_mix=d["pre"], norm_weight=d["w"],
                                                   norm_eps=NORM_EPS)
           if form == "v41" else
           ops.mhc_fused_post_pre_tilelang(*a, norm_weight=d["w"], norm_eps=NORM_EPS))
    assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(got, ours))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 32])
def test_cuda_graph_replay(monkeypatch, t):
    """Captured once, replayed: the workspace counters reset inside every launch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("DEEPINFER_ARCH", "sm80")
    monkeypatch.setenv("DEEPINFER_MHC_DECODE", "1")
    routing.reset()
    d = _inputs(t, 5120, "cuda", seed=11)
    first = _call(d, "v41")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _call(d, "v41")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _call(d, "v41")
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(first, out))
