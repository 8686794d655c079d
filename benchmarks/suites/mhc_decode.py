"""mhc_decode suite: the one-launch mHC decode kernel (vllm.deepinfer.mhc.decode_fused)
beside upstream's two TileLang launches, at T = 1, 2, 4, 6, 8, 12, 16, 24, 32 tokens and
hidden 4096/5120/7168, in one process on one GPU.

Set up as the mhc suite (benchmarks/suites/mhc.py: vLLM 0.33.0 with the DeepInfer overlay
installed, TileLang 0.1.12; upstream's side with ``DEEPINFER_MHC=0``, ours with
``DEEPINFER_ARCH=sm80 DEEPINFER_MHC=1 DEEPINFER_MHC_DECODE=1``; ``is_deep_gemm_supported()``
answering False as below 9.0 and PDL off in the kernels module, so both sides run the
Ampere builds' code compiled for this GPU). **On the H200 these are H200 figures of the
Ampere code, not A100 figures.** Both sides call the real op functions of
``vllm.model_executor.kernels.mhc.tilelang``:

  kernel ``mhc_decode``, variant ``v41``: ``mhc_fused_post_pre_delayed_tilelang`` with the
      carried pre-mix and the RMSNorm weight (V4.1's shifted boundary, as its model calls it)
  variant ``v4``: ``mhc_fused_post_pre_tilelang`` with the RMSNorm weight (V4)
  variant ``v41-ch64``: ours only, with 64-column k-slices (half the slices; not the
      dispatched width), beside the same upstream time (BENCH_MHC_DECODE_CH64=0 skips it)

``ours_us``/``upstream_us``: GPU time per call, every call of a ring of input copies
(> 2x L2) captured in one CUDA graph (``Harness.time_graph``). Extra fields: ``ours_path``
(the decode kernel's variant name, or "upstream" if it declined), ``exact`` (the new
residual streams bit-identical to upstream's), ``max_abs_diff`` (largest difference of the
other outputs between the sides), ``ours_err_ref``/``upstream_err_ref`` (each side against
the fp32 reference vllm.deepinfer.mhc.reference: largest difference over post, comb and, in
V4.1's form, the next pre-mix) and ``*_input_err_ref`` (the bf16 layer input),
``ours_launches``/``upstream_launches`` (CUDA kernels per call, from the profiler, at the
smallest and largest T). ``bytes``: what a call must move
(x and the residual streams read, the new streams and the layer input written, the fp32
projection weights read once).

No A100 predictions: tools/a100_model.py models one Triton kernel whose CTAs all run the
same code; this kernel's CTAs take one of three roles and two of them wait on the first,
and upstream's side is TileLang, which the model does not read.

Before timing, the compiles both sides need (upstream's fused kernel in its two geometries
and its two epilogues per hidden size; ours in two token classes and two forms) run in
parallel worker processes, one per hidden size, into TileLang's and Triton's disk caches
(``BENCH_MHC_DECODE_PRECOMPILE=0`` skips it; the timed process then compiles them itself).
``BENCH_MHC_HIDDEN=5120`` / ``BENCH_MHC_T=1,6,12`` pick sizes; ``--quick``: hidden 5120.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from harness import REPO, Harness  # noqa: F401 (REPO: the workers' cwd)

TOKENS = (1, 2, 4, 6, 8, 12, 16, 24, 32)
HIDDEN = (4096, 5120, 7168)
FORMS = ("v41", "v4")


class _Ours:
    """Our side with the decode kernel explicitly on (whatever the environment says)."""

    def __init__(self, dg):
        from suites.mhc import _Side
        self.side = _Side(dg, ours=True)

    def __enter__(self):
        self.saved = os.environ.get("DEEPINFER_MHC_DECODE")
        os.environ["DEEPINFER_MHC_DECODE"] = "1"
        self.side.__enter__()
        return self

    def __exit__(self, *exc):
        self.side.__exit__(*exc)
        if self.saved is None:
            os.environ.pop("DEEPINFER_MHC_DECODE", None)
        else:
            os.environ["DEEPINFER_MHC_DECODE"] = self.saved
        from vllm.deepinfer import routing
        routing.reset()


def _call(ops, form, w, x, **kw):
    from suites.mhc import EPS
    a = (x["x"], x["res"], x["post"], x["comb"], w["fn"], w["scale"], w["base"], *EPS.values())
    if form == "v41":
        return ops.mhc_fused_post_pre_delayed_tilelang(*a, pre_mix=x["pre"], norm_weight=w["w"],
                                                       norm_eps=1e-6, **kw)
    return ops.mhc_fused_post_pre_tilelang(*a, norm_weight=w["w"], norm_eps=1e-6, **kw)


def _ours_direct(form, w, x, ch):
    from suites.mhc import EPS
    from vllm.deepinfer.mhc import decode_fused as df
    a = (x["x"], x["res"], x["post"], x["comb"], w["fn"], w["scale"], w["base"], *EPS.values())
    if form == "v41":
        return df.delayed(*a, pre_mix=x["pre"], norm_weight=w["w"], norm_eps=1e-6, ch=ch)
    return df.fused(*a, norm_weight=w["w"], norm_eps=1e-6, ch=ch)


def _launches(fn) -> int:
    """CUDA kernels one call launches (torch profiler; the memory allocations are not)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if str(e.device_type).endswith("CUDA")
               and "memset" not in e.name.lower() and "memcpy" not in e.name.lower())


def _err(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _bits_equal(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16),
                                              b.contiguous().view(torch.int16))


def _sizes(quick: bool):
    hidden = (5120,) if quick else HIDDEN
    if os.environ.get("BENCH_MHC_HIDDEN"):
        hidden = tuple(int(v) for v in os.environ["BENCH_MHC_HIDDEN"].split(","))
    tokens = TOKENS
    if os.environ.get("BENCH_MHC_T"):
        tokens = tuple(int(v) for v in os.environ["BENCH_MHC_T"].split(","))
    return hidden, tokens


# ----------------------------------------------------------------------------- precompile
def _compile_sizes(hidden: int, tokens) -> None:
    """Worker: run each side once per hidden size, token class and form (compiles only)."""
    from suites.mhc import _Side, _inputs, _setup, _weights
    ops, tk, dg = _setup()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w = _weights(dev, hidden, gen)
    classes = sorted({1 if t < 16 else 16 for t in tokens})  # upstream's two geometries
    classes += [t for t in (17,) if max(tokens) > 16]         # our 32-token class
    for t in classes:
        x = _inputs(dev, t, hidden, gen)
        for form in FORMS:
            with _Side(dg, ours=False):
                _call(ops, form, w, x)
            with _Ours(dg):
                _call(ops, form, w, x)
                if form == "v41" and os.environ.get("BENCH_MHC_DECODE_CH64", "1") != "0":
                    _ours_direct(form, w, x, 64)
    torch.cuda.synchronize()


def _precompile(hidden, tokens) -> None:
    if os.environ.get("BENCH_MHC_DECODE_PRECOMPILE", "1") == "0":
        return
    t0 = time.time()
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
            "from suites.mhc_decode import _compile_sizes; "
            "_compile_sizes(int(sys.argv[3]), tuple(int(v) for v in sys.argv[4].split(',')))")
    bench = str(REPO / "benchmarks")
    procs = [subprocess.Popen([sys.executable, "-c", code, bench, str(REPO / "overlay"),
                               str(h), ",".join(map(str, tokens))], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for h in hidden]
    for h, p in zip(hidden, procs):
        _, err = p.communicate()
        if p.returncode:
            print(f"# mhc_decode precompile for hidden {h} failed (the timed run compiles it "
                  f"itself): {err.strip().splitlines()[-1] if err.strip() else p.returncode}",
                  flush=True)
    print(f"# mhc_decode precompile: {time.time() - t0:.0f} s for hidden {hidden}", flush=True)


# ----------------------------------------------------------------------------- run
def run(h: Harness) -> None:
    from suites.mhc import EPS, HC, _Side, _inputs, _setup, _weights
    from vllm.deepinfer.mhc import decode_fused as df
    from vllm.deepinfer.mhc import reference as ref
    ops, tk, dg = _setup()
    dev = h.dev
    hidden, tokens = _sizes(h.quick)
    _precompile(hidden, tokens)
    gen = torch.Generator(device=dev).manual_seed(0)
    ch64 = os.environ.get("BENCH_MHC_DECODE_CH64", "1") != "0"
    for hs in hidden:
        w = _weights(dev, hs, gen)
        for form in FORMS:
            for t in tokens:
                per = 2 * t * HC * hs * 2 + 2 * t * hs * 2
                weights = HC * (HC + 2) * HC * hs * 4
                ring = h.copies(lambda: _inputs(dev, t, hs, gen), per)
                x0 = ring[0]
                want = ref.fused_post_pre(
                    x0["x"], x0["res"], x0["post"], x0["comb"], w["fn"], w["scale"],
                    w["base"], *EPS.values(), norm_weight=w["w"],
                    pre_mix=x0["pre"] if form == "v41" else None, delayed=form == "v41")
                with _Side(dg, ours=False):
                    up = _call(ops, form, w, x0)
                    up_us = h.time_graph(lambda x: _call(ops, form, w, x), ring)
                    up_launches = (_launches(lambda: _call(ops, form, w, x0))
                                   if t in (tokens[0], tokens[-1]) else None)
                with _Ours(dg):
                    path = df.key_for(t, hs, h.sm_count, sinkhorn=EPS["sinkhorn_repeat"],
                                      delayed=form == "v41").name
                    if _ours_direct(form, w, x0, None) is None:
                        path = "upstream"
                    ours = _call(ops, form, w, x0)
                    ours_us = h.time_graph(lambda x: _call(ops, form, w, x), ring)
                    ours_launches = (_launches(lambda: _call(ops, form, w, x0))
                                     if t in (tokens[0], tokens[-1]) else None)
                coef = (1, 2, 4) if form == "v41" else (1, 2)
                h.add("mhc_decode", form, {"hidden": hs, "T": t}, ours_us, up_us,
                      bytes=per + weights, exact=_bits_equal(ours[0], up[0]),
                      max_abs_diff=max(_err(ours[i], up[i]) for i in (*coef, 3)),
                      ours_path=path, upstream_path="upstream",
                      ours_err_ref=max(_err(ours[i], want[i]) for i in coef),
                      upstream_err_ref=max(_err(up[i], want[i]) for i in coef),
                      ours_input_err_ref=_err(ours[3], want[3]),
                      upstream_input_err_ref=_err(up[3], want[3]),
                      ours_launches=ours_launches, upstream_launches=up_launches)
                if form == "v41" and ch64:
                    with _Ours(dg):
                        o64 = _ours_direct(form, w, x0, 64)
                        us64 = h.time_graph(lambda x: _ours_direct(form, w, x, 64), ring)
                    h.add("mhc_decode", "v41-ch64", {"hidden": hs, "T": t}, us64, up_us,
                          bytes=per + weights, exact=_bits_equal(o64[0], up[0]),
                          max_abs_diff=max(_err(o64[i], up[i]) for i in (1, 2, 3, 4)),
                          ours_path=df.key_for(t, hs, h.sm_count, delayed=True, ch=64,
                                               sinkhorn=EPS["sinkhorn_repeat"]).name,
                          ours_err_ref=max(_err(o64[i], want[i]) for i in (1, 2, 4)),
                          upstream_err_ref=max(_err(up[i], want[i]) for i in (1, 2, 4)))
