"""mhc suite: vLLM 0.33.0's mHC TileLang ops as the Ampere path runs them, upstream's
choices beside ours, in one process on one GPU.

Needs vLLM 0.33.0 with the DeepInfer overlay installed (the patched ``tilelang.py``,
``tilelang_kernels.py``, ``warmup.py`` of patches 0030-0032 and ``vllm/deepinfer``) and
TileLang 0.1.12 — on the H200: the vLLM kit, ``make overlay`` here, then
``python3 tools/install_overlay.py install --vllm-dir /tmp/site/vllm --overlay build/overlay``.
Both sides call the real op functions of ``vllm.model_executor.kernels.mhc.tilelang`` in
one process: upstream with ``DEEPINFER_MHC=0`` (the patched code defers to upstream's
rules), ours with ``DEEPINFER_ARCH=sm80`` and ``DEEPINFER_MHC=1``. Ampere is emulated by
vLLM's ``is_deep_gemm_supported()`` answering False (what it answers below 9.0), so
upstream's side is its Ampere path (TileLang FMA projection, one split) — except the row
``mhc_pre``/``v4_first_layer_vs_deepgemm``, whose upstream side is DeepGEMM's
``tf32_hc_prenorm_gemm`` (upstream cannot run V4's first layer without it). PDL is switched
off in the kernels module before anything compiles (``ENABLE_PDL``: on from 9.0, off on
Ampere), so the kernels are the Ampere builds' code compiled for sm_90: **these are H200
figures of the Ampere configurations, not A100 figures.**

Rows (``ours_us``/``upstream_us``: GPU time per call, launches captured in a CUDA graph,
``Harness.time_graph``; T tokens, hidden 4096/5120/7168, hc_mult 4):
  mhc_fused_post_pre   ``mhc_fused_post_pre_delayed_tilelang`` (V4.1's shifted post + pre):
                       upstream's fused geometry or post + FMA projection vs ours (the
                       FUSED_GEOMETRY table, post + tensor-core projection from 16 tokens)
  mhc_pre              ``v41_first_layer``: ``mhc_pre_delayed_tilelang`` over the embedding row;
                       ``v4_first_layer_vs_deepgemm``: ``mhc_pre_broadcast_tilelang``
  mhc_post             ``mhc_post_tilelang`` (the same kernel on both sides: bit-identity and
                       the timing noise floor)
  hc_head              ``hc_head_fused_kernel_tilelang`` (same kernel on both sides)
Extra fields: ``ours_path``/``upstream_path`` (which kernels ran), ``exact`` (the new
residual streams bit-identical), ``max_abs_diff`` (largest difference of the fp32/bf16
outputs between the two sides), ``ours_err_ref``/``upstream_err_ref`` (each side against
the fp32 reference vllm.deepinfer.mhc.reference: largest difference over post, comb and
next pre-mix; and over the bf16 layer input, ``*_input_err_ref``). ``bytes``: residual
streams read and written, x read, layer input written (the post + pre's unavoidable
traffic). ``--quick``: hidden 5120 only; ``BENCH_MHC_HIDDEN=4096,7168`` picks the hidden
sizes (a full run takes about three times the quick one), ``BENCH_MHC_T=6,12,16`` the token
counts. Our side runs the Ampere geometry and tensor-core threshold (``DEEPINFER_MHC_TUNED=1``,
off by default in the package until this suite has measured it); ``BENCH_MHC_TUNED=0`` times
our side without them (then only V4's first layer differs from upstream).
"""
from __future__ import annotations

import importlib.util
import os

import torch

from harness import REPO, Harness

TOKENS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 64, 128, 1024, 8192)
HIDDEN = (4096, 5120, 7168)
HC = 4
EPS = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult_value=2.0,
           sinkhorn_repeat=20)


def _setup():
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("tilelang") is None:
        raise RuntimeError("mhc suite: needs vLLM 0.33.0 and TileLang 0.1.12 importable "
                         "(the vLLM kit: PYTHONPATH=/tmp/site)")
    import vllm
    if importlib.util.find_spec("vllm.deepinfer.mhc") is None:
        raise RuntimeError("mhc suite: vllm.deepinfer is not installed in this vLLM: make overlay "
                         "here, then python3 tools/install_overlay.py install --vllm-dir "
                         f"{os.path.dirname(vllm.__path__[0])}/vllm --overlay build/overlay")
    import vllm.model_executor.kernels.mhc.tilelang as ops
    import vllm.model_executor.kernels.mhc.tilelang_kernels as tk
    import vllm.utils.deep_gemm as dg
    if "_deepinfer_mhc" not in open(ops.__file__).read():
        raise RuntimeError(f"mhc suite: {ops.__file__} is not patched (patch 0030): install "
                         "the overlay (see this suite's docstring)")
    tk.ENABLE_PDL = False  # Ampere builds: PDL exists only from 9.0
    return ops, tk, dg


class _Side:
    """Environment of one side: upstream (mhc off) or ours (sm80, mhc on); DeepGEMM reported
    absent unless ``deep_gemm``."""

    def __init__(self, dg, ours: bool, deep_gemm: bool = False):
        self.dg, self.ours, self.deep_gemm = dg, ours, deep_gemm
        self.real = dg.is_deep_gemm_supported

    def __enter__(self):
        from vllm.deepinfer import routing
        self.saved = {k: os.environ.get(k)
                      for k in ("DEEPINFER_MHC", "DEEPINFER_ARCH", "DEEPINFER_MHC_TUNED")}
        os.environ["DEEPINFER_MHC"] = "1" if self.ours else "0"
        os.environ["DEEPINFER_MHC_TUNED"] = (
            os.environ.get("BENCH_MHC_TUNED", "1") if self.ours else "0")
        os.environ["DEEPINFER_ARCH"] = "sm80"
        routing.reset()
        if not self.deep_gemm:
            self.dg.is_deep_gemm_supported = lambda: False
        return self

    def __exit__(self, *exc):
        from vllm.deepinfer import routing
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.dg.is_deep_gemm_supported = self.real
        routing.reset()


def _weights(dev, h, gen):
    n = HC * (HC + 2)
    fn = torch.randn(n, HC * h, device=dev, generator=gen) * (HC * h) ** -0.5
    return {"fn": fn, "fn_b": fn.view(n, HC, h).sum(1).contiguous(),
            "scale": torch.tensor([0.8, 1.2, 1.5], device=dev),
            "base": torch.randn(n, device=dev, generator=gen) * 0.1,
            "w": (1 + 0.1 * torch.randn(h, device=dev, generator=gen)).to(torch.bfloat16),
            "head_fn": torch.randn(HC, HC * h, device=dev, generator=gen) * (HC * h) ** -0.5,
            "head_scale": torch.tensor([1.1], device=dev),
            "head_base": torch.randn(HC, device=dev, generator=gen) * 0.1}


def _inputs(dev, t, h, gen):
    comb = torch.softmax(torch.randn(t, HC, HC, device=dev, generator=gen), -1)
    return {"x": torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16),
            "res": torch.randn(t, HC, h, device=dev, generator=gen).to(torch.bfloat16),
            "post": 2 * torch.rand(t, HC, 1, device=dev, generator=gen),
            "comb": comb.contiguous(),
            "pre": torch.rand(t, HC, device=dev, generator=gen) + 0.1}


def _fused(ops, w, x):
    return ops.mhc_fused_post_pre_delayed_tilelang(
        x["x"], x["res"], x["post"], x["comb"], w["fn"], w["scale"], w["base"], *EPS.values(),
        pre_mix=x["pre"], norm_weight=w["w"], norm_eps=1e-6)


def _pre_v41(ops, w, x):
    return ops.mhc_pre_delayed_tilelang(
        x["res"], w["fn_b"], w["scale"], w["base"], *EPS.values(), x=x["x"],
        norm_weight=w["w"], norm_eps=1e-6)


def _pre_v4(ops, w, x):
    return ops.mhc_pre_broadcast_tilelang(
        x["x"], w["fn"], w["scale"], w["base"], *EPS.values(), norm_weight=w["w"],
        norm_eps=1e-6, fn_broadcast=w["fn_b"])


def _path(ops, tk, t, h, ours: bool) -> str:
    from vllm.deepinfer import mhc
    cfg = tk.mhc_fused_post_pre_split_config(t, h, HC)
    if cfg is not None:
        return f"fused{cfg}"
    if mhc.projection_on_tc(t, HC * h, HC * (HC + 2), deep_gemm_supported=False):
        return "post+tc_gemm"
    return "post+fma_gemm"


def _err(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def run(h: Harness) -> None:
    from vllm.deepinfer.mhc import reference as ref
    ops, tk, dg = _setup()
    dev = h.dev
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden = (5120,) if h.quick else HIDDEN
    if os.environ.get("BENCH_MHC_HIDDEN"):  # e.g. 4096,7168: split a long run in two
        hidden = tuple(int(v) for v in os.environ["BENCH_MHC_HIDDEN"].split(","))
    tokens = TOKENS
    if os.environ.get("BENCH_MHC_T"):
        tokens = tuple(int(v) for v in os.environ["BENCH_MHC_T"].split(","))
    for hs in hidden:
        w = _weights(dev, hs, gen)
        for t in tokens:
            per = 2 * t * HC * hs * 2 + t * hs * 2 * 2
            ring = h.copies(lambda: _inputs(dev, t, hs, gen), per)
            x0 = ring[0]
            want = ref.fused_post_pre(x0["x"], x0["res"], x0["post"], x0["comb"], w["fn"],
                                      w["scale"], w["base"], *EPS.values(), norm_weight=w["w"],
                                      pre_mix=x0["pre"], delayed=True)
            res = {}
            for side in (False, True):
                with _Side(dg, ours=side):
                    path = _path(ops, tk, t, hs, side)
                    out = _fused(ops, w, x0)
                    us = h.time_graph(lambda x: _fused(ops, w, x), ring)
                res[side] = (us, out, path)
            (uu, uo, up), (ou, oo, op) = res[False], res[True]
            # outputs: residual, post, comb, layer_input, next_pre, aux
            coef = lambda o: max(_err(o[1], want[1]), _err(o[2], want[2]),  # noqa: E731
                                 _err(o[4], want[4]))
            h.add("mhc_fused_post_pre", "ampere", {"hidden": hs, "T": t}, ou, uu, bytes=per,
                  exact=bool(torch.equal(oo[0], uo[0])),
                  max_abs_diff=max(_err(oo[i], uo[i]) for i in (1, 2, 3, 4)),
                  ours_path=op, upstream_path=up, ours_err_ref=coef(oo),
                  upstream_err_ref=coef(uo), ours_input_err_ref=_err(oo[3], want[3]),
                  upstream_input_err_ref=_err(uo[3], want[3]))

            # mhc_pre: V4.1's first layer (embedding row), both sides without DeepGEMM.
            res = {}
            for side in (False, True):
                with _Side(dg, ours=side):
                    out = _pre_v41(ops, w, x0)
                    us = h.time_graph(lambda x: _pre_v41(ops, w, x), ring)
                res[side] = (us, out)
            h.add("mhc_pre", "v41_first_layer", {"hidden": hs, "T": t}, res[True][0],
                  res[False][0], exact=None,
                  max_abs_diff=max(_err(a, b) for a, b in zip(res[True][1], res[False][1])))
            # mhc_pre: V4's first layer; upstream needs DeepGEMM (Hopper), ours does not.
            res = {}
            for side in (False, True):
                with _Side(dg, ours=side, deep_gemm=not side):
                    out = _pre_v4(ops, w, x0)
                    us = h.time_graph(lambda x: _pre_v4(ops, w, x), ring)
                res[side] = (us, out)
            want4 = ref.broadcast_pre(x0["x"], w["fn_b"], w["scale"], w["base"], *EPS.values(),
                                      w["w"], 1e-6, HC)
            h.add("mhc_pre", "v4_first_layer_vs_deepgemm", {"hidden": hs, "T": t},
                  res[True][0], res[False][0], exact=bool(torch.equal(res[True][1][0],
                                                                      res[False][1][0])),
                  max_abs_diff=max(_err(a, b) for a, b in zip(res[True][1], res[False][1])),
                  ours_err_ref=max(_err(res[True][1][i], want4[i]) for i in (1, 2)),
                  upstream_err_ref=max(_err(res[False][1][i], want4[i]) for i in (1, 2)))

            # mhc_post and hc_head: one kernel on both sides (identity and noise floor).
            post = lambda x: ops.mhc_post_tilelang(x["x"], x["res"], x["post"], x["comb"])  # noqa: E731
            with _Side(dg, ours=False):
                up_out = post(x0)
                uu = h.time_graph(post, ring)
            with _Side(dg, ours=True):
                our_out = post(x0)
                ou = h.time_graph(post, ring)
            h.add("mhc_post", "ampere", {"hidden": hs, "T": t}, ou, uu, bytes=per,
                  exact=bool(torch.equal(our_out, up_out)),
                  max_abs_diff=_err(our_out, ref.post(x0["x"], x0["res"], x0["post"],
                                                      x0["comb"]).to(torch.bfloat16)))
            head = lambda x: ops.hc_head_fused_kernel_tilelang(  # noqa: E731
                x["res"], w["head_fn"], w["head_scale"], w["head_base"], 1e-6, 1e-6)
            with _Side(dg, ours=False):
                up_out = head(x0)
                uu = h.time_graph(head, ring)
            with _Side(dg, ours=True):
                our_out = head(x0)
                ou = h.time_graph(head, ring)
            h.add("hc_head", "ampere", {"hidden": hs, "T": t}, ou, uu,
                  bytes=t * HC * hs * 2 + t * hs * 2, exact=bool(torch.equal(our_out, up_out)),
                  max_abs_diff=_err(our_out, ref.hc_head(x0["res"], w["head_fn"],
                                                         w["head_scale"], w["head_base"],
                                                         1e-6, 1e-6)))
