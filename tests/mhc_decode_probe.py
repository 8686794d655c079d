"""Probe of the PATCHED vLLM 0.33.0 mHC ops (patch 0030) routing 1-32 tokens to the
one-launch decode kernel (vllm.deepinfer.mhc.decode_fused). Run by
tests/test_mhc_decode_fused.py in a subprocess:

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched \
        python tests/mhc_decode_probe.py

printing one JSON object (the last stdout line). Upstream's TileLang kernel objects are
replaced by stand-ins that record their calls and compute with vllm.deepinfer.mhc.reference
(TileLang cannot run on a CPU; DEEPINFER_MHC_TUNED=0 keeps the 40-token case off our
tensor-core TileLang projection too); our kernel runs in the Triton interpreter. What is proved:
which path each call takes (ours: no upstream kernel launched), under the switches, and
that the op returns our outputs in upstream's shapes.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

RESULTS: dict = {}


def record(key: str, fn):
    try:
        RESULTS[key] = {"ok": True, "value": fn()}
    except BaseException as e:  # noqa: BLE001 - the probe reports everything
        RESULTS[key] = {"ok": False, "error": type(e).__name__, "message": str(e)[:2000],
                        "trace": traceback.format_exc()[-3000:]}


def main() -> int:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import interp_bf16
    interp_bf16.patch(setattr)
    import vllm.model_executor.kernels.mhc.tilelang as tl_ops
    import vllm.model_executor.kernels.mhc.tilelang_kernels as tk
    import vllm.model_executor.kernels.mhc.warmup as wu
    import vllm.utils.deep_gemm as dg
    from vllm.deepinfer import routing
    from vllm.deepinfer.mhc import reference as ref

    calls: list = []
    dg.is_deep_gemm_supported = lambda: False

    def post(comb, residual, post_mix, x, out, hc, hidden):
        calls.append("post")
        out.copy_(ref.post(x, residual, post_mix, comb).to(torch.bfloat16))

    def fused(comb, residual, post_mix, x, weight_t, hc, hidden, n_out):
        calls.append("fused")
        new = ref.post(x, residual, post_mix, comb).to(torch.bfloat16)
        m, q = ref.prenorm_gemm(new.view(new.shape[0], -1), weight_t.reshape(n_out, -1))
        return m[None], q[None], new

    def prenorm(x, fn, out, sqrsum, hidden_size, hc_mult, **kw):
        calls.append("prenorm")
        m, q = ref.prenorm_gemm(x, fn)
        out[0].copy_(m)
        sqrsum[0].copy_(q)

    def delayed_epilogue(mixes, sqrsum, hc_scale, hc_base, residual, post_mix, comb_mix,
                         layer_input, norm_weight, pre_in, pre_out, aux, *, rms_numel,
                         hc_mult, use_pre_mix_in, norm_eps, rms_eps, hc_pre_eps,
                         hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, **kw):
        calls.append("epilogue_delayed")
        pre, pm, comb = ref.coefficients(mixes.sum(0), sqrsum.sum(0), rms_numel, hc_scale,
                                         hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                                         hc_post_mult_value, sinkhorn_repeat, hc_mult)
        use = pre_in if use_pre_mix_in else torch.nn.functional.one_hot(
            torch.zeros(residual.shape[0], dtype=torch.long), hc_mult).float()
        layer_input.copy_(ref.collapse_norm(residual, use, norm_weight, norm_eps,
                                            round_before_norm=True))
        post_mix.copy_(pm)
        comb_mix.copy_(comb.view(comb_mix.shape))
        pre_out.copy_(pre)

    def big_fuse(gemm_out_mul, gemm_out_sqrsum, hc_scale, hc_base, residual, post_mix,
                 comb_mix, layer_input, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                 hc_post_mult_value, sinkhorn_repeat, *, residual_out=None, norm_weight=None,
                 norm_eps=0.0):
        calls.append("epilogue")
        hc = residual.shape[1]
        pre, pm, comb = ref.coefficients(gemm_out_mul.sum(0), gemm_out_sqrsum.sum(0),
                                         hc * residual.shape[2], hc_scale, hc_base, rms_eps,
                                         hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                                         sinkhorn_repeat, hc)
        post_mix.copy_(pm)
        comb_mix.copy_(comb.view(comb_mix.shape))
        layer_input.copy_(ref.collapse_norm(residual, pre, norm_weight, norm_eps))

    tk._MHC_POST_TILELANG_KERNEL = post
    tk._MHC_FUSED_TILELANG_KERNEL = fused
    tk._HC_PRENORM_GEMM_TILELANG_KERNEL = prenorm
    tk._MHC_PRE_BIG_FUSE_TILELANG_KERNEL = big_fuse
    wu.MHC_PRE_NORM_KERNEL = delayed_epilogue

    hc, eps = 4, (1e-6, 1e-6, 1e-6, 2.0, 20)

    def make(t, hidden):
        g = torch.Generator().manual_seed(t)
        n = hc * (hc + 2)
        return dict(
            x=torch.randn(t, hidden, generator=g).to(torch.bfloat16),
            res=torch.randn(t, hc, hidden, generator=g).to(torch.bfloat16),
            post=2 * torch.rand(t, hc, 1, generator=g),
            comb=torch.softmax(torch.randn(t, hc, hc, generator=g), -1).contiguous(),
            pre=torch.rand(t, hc, generator=g) + 0.1,
            fn=torch.randn(n, hc * hidden, generator=g) * (hc * hidden) ** -0.5,
            scale=torch.tensor([0.8, 1.2, 1.5]), base=torch.randn(n, generator=g) * 0.1,
            w=(1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16))

    def case(form, t, hidden=256, decode=None):
        if decode is None:
            os.environ.pop("DEEPINFER_MHC_DECODE", None)
        else:
            os.environ["DEEPINFER_MHC_DECODE"] = decode
        os.environ["DEEPINFER_ARCH"] = "sm80"
        # above 32 tokens the projection would be our tensor-core TileLang GEMM (no CPU run)
        os.environ["DEEPINFER_MHC_TUNED"] = "0"
        routing.reset()
        calls.clear()
        d = make(t, hidden)
        a = (d["x"], d["res"], d["post"], d["comb"], d["fn"], d["scale"], d["base"], *eps)
        if form == "v41":
            got = tl_ops.mhc_fused_post_pre_delayed_tilelang(*a, pre_mix=d["pre"],
                                                             norm_weight=d["w"], norm_eps=1e-6)
            want = ref.fused_post_pre(*a, norm_weight=d["w"], norm_eps=1e-6,
                                      pre_mix=d["pre"], delayed=True)
            got = got[:5]
        else:
            got = tl_ops.mhc_fused_post_pre_tilelang(*a, norm_weight=d["w"], norm_eps=1e-6)
            want = ref.fused_post_pre(*a, norm_weight=d["w"], norm_eps=1e-6)[:4]
        return {"calls": list(calls), "shapes": [list(g.shape) for g in got],
                "err": [float((g.float() - w.float()).abs().max()) for g, w in zip(got, want)]}

    record("v41/6", lambda: case("v41", 6, decode="1"))
    record("v41/6/default", lambda: case("v41", 6))
    record("v41/6/off", lambda: case("v41", 6, decode="0"))
    record("v41/40", lambda: case("v41", 40))
    record("v4/6", lambda: case("v4", 6, decode="1"))
    record("v4/6/off", lambda: case("v4", 6, decode="0"))
    print(json.dumps(RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
