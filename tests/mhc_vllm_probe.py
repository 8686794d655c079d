"""Probes of the PATCHED vLLM 0.33.0 mHC path (build/patched) on a CPU-only machine. Run by
tests/test_mhc.py in a subprocess:

    CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched python tests/mhc_vllm_probe.py SCENARIO

printing one JSON object (the last stdout line). Not collected by pytest.

Scenarios:
    first_layer  V4's ``mhc_pre_broadcast_tilelang`` (patch 0030) under forced variants,
                 DeepGEMM reported supported or not, and the DEEPINFER_MHC switch. TileLang
                 kernels cannot run on a CPU, so upstream's two kernel objects are replaced
                 by torch stand-ins that keep their launch contracts (the prenorm GEMM's
                 shape asserts and its real compile-key ``dispatch``; the epilogue's
                 argument list) and compute with vllm.deepinfer.mhc.reference; DeepGEMM's
                 ``tf32_hc_prenorm_gemm`` is replaced by one that records the call and
                 raises, as it does below 9.0. What is proved: which projection runs, with
                 which arguments, and that its outputs reach the epilogue intact.
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


def set_env(**kv) -> None:
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def scenario_first_layer() -> None:
    import torch

    import vllm.model_executor.kernels.mhc.tilelang as tl_ops
    import vllm.model_executor.kernels.mhc.tilelang_kernels as tk
    import vllm.utils.deep_gemm as dg
    from vllm.deepinfer import routing
    from vllm.deepinfer.mhc import reference as ref

    calls: list = []
    state = {"deep_gemm_supported": False}

    class PrenormStandIn:
        """``_HC_PRENORM_GEMM_TILELANG_KERNEL``'s launch contract, computed in torch."""

        def __call__(self, x, fn, out, sqrsum, hidden_size, hc_mult, tile_n=12, n_thr=512,
                     n_splits=1):
            assert out.shape[0] == n_splits and sqrsum.shape[0] == n_splits
            assert x.shape[1] == hc_mult * hidden_size, (x.shape, hc_mult, hidden_size)
            assert (x.shape[1] // n_splits) % n_thr == 0
            key = tk._HC_PRENORM_GEMM_TILELANG_KERNEL_REAL.dispatch(
                num_tokens=x.shape[0], hc_hidden_size=x.shape[1], hidden_size=hidden_size,
                hc_mult=hc_mult, n_out=fn.shape[0], n_thr=n_thr, tile_n=tile_n,
                n_splits=n_splits)
            assert x.shape[1] % key.n_thr == 0, key
            calls.append(["tilelang_prenorm", hidden_size, hc_mult, n_splits, key.n_thr,
                          key.tile_n])
            m, s = ref.prenorm_gemm(x, fn)
            out[0].copy_(m)
            sqrsum[0].copy_(s)

    class EpilogueStandIn:
        """``_MHC_PRE_BIG_FUSE_TILELANG_KERNEL`` (broadcast form), computed in torch."""

        def __call__(self, gemm_out_mul, gemm_out_sqrsum, hc_scale, hc_base, residual,
                     post_mix, comb_mix, layer_input, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                     hc_post_mult_value, sinkhorn_repeat, *, residual_out=None,
                     norm_weight=None, norm_eps=0.0):
            assert residual_out is not None and norm_weight is not None
            hc = residual_out.shape[1]
            calls.append(["epilogue", int(gemm_out_mul.shape[0])])
            pre, pm, comb = ref.coefficients(
                gemm_out_mul.sum(0), gemm_out_sqrsum.sum(0), residual.shape[1], hc_scale,
                hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                sinkhorn_repeat, hc)
            post_mix.copy_(pm)
            comb_mix.copy_(comb.view(comb_mix.shape))
            residual_out.copy_(residual[:, None, :].expand_as(residual_out))
            layer_input.copy_(ref.collapse_norm(residual_out, pre, norm_weight, norm_eps))

    def deep_gemm_stand_in(x, fn, out, sqrsum, num_split):
        calls.append(["deep_gemm", int(num_split)])
        raise RuntimeError("DeepGEMM tf32_hc_prenorm_gemm called (unavailable below 9.0)")

    tk._HC_PRENORM_GEMM_TILELANG_KERNEL_REAL = tk._HC_PRENORM_GEMM_TILELANG_KERNEL
    tk._HC_PRENORM_GEMM_TILELANG_KERNEL = PrenormStandIn()
    tk._MHC_PRE_BIG_FUSE_TILELANG_KERNEL = EpilogueStandIn()
    tk.compute_num_split = lambda block_k, k, grid: 4  # no device properties on a CPU
    dg.tf32_hc_prenorm_gemm = deep_gemm_stand_in
    dg.is_deep_gemm_supported = lambda: state["deep_gemm_supported"]

    gen = torch.Generator().manual_seed(0)
    hc, eps = 4, 1e-6

    def inputs(t, hidden):
        n = hc * (hc + 2)
        x = (torch.randn(t, hidden, generator=gen) * 0.5).to(torch.bfloat16)
        fn = torch.randn(n, hc * hidden, generator=gen) * 0.02
        fn_b = fn.view(n, hc, hidden).sum(1)
        scale = torch.tensor([0.9, 1.1, 1.3])
        base = torch.randn(n, generator=gen) * 0.1
        w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
        return x, fn, fn_b, scale, base, w

    def run(case, arch, deep_gemm, mhc_env=None, t=5, hidden=1024):
        set_env(DEEPINFER_ARCH=arch, DEEPINFER_MHC=mhc_env)
        routing.reset()
        state["deep_gemm_supported"] = deep_gemm
        calls.clear()
        x, fn, fn_b, scale, base, w = inputs(t, hidden)
        args = (scale, base, eps, 1e-2, 1e-2, 2.0, 20)
        try:
            got = tl_ops.mhc_pre_broadcast_tilelang(x, fn, *args, norm_weight=w, norm_eps=eps,
                                                    fn_broadcast=fn_b)
        except RuntimeError as e:
            return {"calls": list(calls), "raised": str(e)}
        want = ref.broadcast_pre(x, fn_b, *args, w, eps, hc)
        diffs = [float((g.float() - r.float()).abs().max()) if g.numel() else 0.0
                 for g, r in zip(got, want)]
        shapes = [list(g.shape) for g in got]
        return {"calls": list(calls), "max_abs_diff": diffs, "shapes": shapes}

    record("sm80/no_deep_gemm", lambda: run("a", "sm80", False))
    record("sm86/no_deep_gemm", lambda: run("a", "sm86", False, hidden=7168, t=3))
    record("sm80/no_deep_gemm/hidden5120", lambda: run("a", "sm80", False, hidden=5120, t=130))
    record("sm90/no_deep_gemm", lambda: run("b", "sm90", False))
    record("sm90/deep_gemm", lambda: run("c", "sm90", True))
    record("sm90/deep_gemm/mhc=1", lambda: run("d", "sm90", True, "1"))
    record("sm80/no_deep_gemm/mhc=0", lambda: run("e", "sm80", False, "0"))
    record("sm80/no_deep_gemm/zero_tokens", lambda: run("f", "sm80", False, t=0))
    record("sm80/no_deep_gemm/hidden1000", lambda: run("g", "sm80", False, hidden=1000))
    set_env(DEEPINFER_ARCH=None, DEEPINFER_MHC=None)


SCENARIOS = {"first_layer": scenario_first_layer}


def main() -> int:
    name = sys.argv[1]
    record("_scenario", SCENARIOS[name])
    print(json.dumps(RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
