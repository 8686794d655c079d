"""Probes of the PATCHED vLLM 0.33.0 mHC path (build/patched) on a CPU-only machine. Run by
tests/test_mhc.py in a subprocess:

    CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched python tests/mhc_vllm_probe.py SCENARIO

printing one JSON object (the last stdout line). Not collected by pytest.

Scenarios:
    projection   the other projections without DeepGEMM (patch 0030) and the fused geometry
                 (0031) through the patched ops, with torch stand-ins for the TileLang kernels
    warmup       what V4.1's and V4's layers register with vLLM's JIT warmup on the Ampere
                 path (patches 0031/0032) and the keys that expands to
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
            assert norm_weight is not None
            broadcast = residual_out is not None
            hc = residual_out.shape[1] if broadcast else residual.shape[1]
            numel = residual.shape[1] if broadcast else hc * residual.shape[2]
            calls.append(["epilogue", int(gemm_out_mul.shape[0])])
            pre, pm, comb = ref.coefficients(
                gemm_out_mul.sum(0), gemm_out_sqrsum.sum(0), numel, hc_scale,
                hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                sinkhorn_repeat, hc)
            post_mix.copy_(pm)
            comb_mix.copy_(comb.view(comb_mix.shape))
            streams = residual
            if broadcast:
                residual_out.copy_(residual[:, None, :].expand_as(residual_out))
                streams = residual_out
            layer_input.copy_(ref.collapse_norm(streams, pre, norm_weight, norm_eps))

    def deep_gemm_stand_in(x, fn, out, sqrsum, num_split):
        calls.append(["deep_gemm", int(num_split)])
        raise RuntimeError("DeepGEMM tf32_hc_prenorm_gemm called (unavailable below 9.0)")

    _install_tc_stand_in(calls)
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


def _install_tc_stand_in(calls: list) -> None:
    """Our tensor-core projection (a TileLang kernel: no CPU run) as a torch stand-in with
    the real split choice (kernels.key_for at 108 SMs, an A100)."""
    from vllm.deepinfer import mhc
    from vllm.deepinfer.mhc import kernels
    from vllm.deepinfer.mhc import reference as ref

    def tc(x, fn, sm_count):
        import torch
        key = kernels.key_for(x.shape[0], x.shape[1], fn.shape[0], sm_count)
        calls.append(["tc", int(x.shape[1]), key.n_splits, key.block_m])
        s = key.n_splits
        out = torch.zeros(s, x.shape[0], fn.shape[0])
        sq = torch.zeros(s, x.shape[0])
        step = x.shape[1] // s
        for i in range(s):  # genuine k-slices: the epilogue must add them up
            m, q = ref.prenorm_gemm(x[:, i * step:(i + 1) * step], fn[:, i * step:(i + 1) * step])
            out[i], sq[i] = m, q
        return out, sq

    kernels.prenorm_gemm_tc = tc
    mhc.sm_count = lambda device: 108


def scenario_projection() -> None:
    """The three other projections without DeepGEMM (patch 0030) and the fused geometry (0031):
    which kernels run at which token counts, and the outputs against the fp32 reference."""
    import torch

    import vllm.model_executor.kernels.mhc.tilelang as tl_ops
    import vllm.model_executor.kernels.mhc.tilelang_kernels as tk
    import vllm.model_executor.kernels.mhc.warmup as wu
    import vllm.utils.deep_gemm as dg
    from vllm.deepinfer import routing
    from vllm.deepinfer.mhc import reference as ref

    calls: list = []
    _install_tc_stand_in(calls)
    dg.is_deep_gemm_supported = lambda: False
    dg.tf32_hc_prenorm_gemm = lambda *a: calls.append(["deep_gemm"])

    def fma(x, fn, out, sqrsum, hidden_size, hc_mult, **kw):
        calls.append(["fma", int(x.shape[1]), hc_mult])
        m, q = ref.prenorm_gemm(x, fn)
        out[0].copy_(m)
        sqrsum[0].copy_(q)

    def post(comb, residual, post_mix, x, out, hc, hidden):
        calls.append(["post"])
        out.copy_(ref.post(x, residual, post_mix, comb).to(torch.bfloat16))

    def fused(comb, residual, post_mix, x, weight_t, hc, hidden, n_out):
        cfg = tk.require_fused_post_pre_config(residual.shape[0], hidden, hc)
        calls.append(["fused", list(cfg)])
        new = ref.post(x, residual, post_mix, comb).to(torch.bfloat16)
        m, q = ref.prenorm_gemm(new.view(new.shape[0], -1), weight_t.reshape(n_out, -1))
        return m[None], q[None], new

    def delayed(mixes, sqrsum, hc_scale, hc_base, residual, post_mix, comb_mix, layer_input,
                norm_weight, pre_in, pre_out, aux, *, hidden_size, rms_eps, hc_pre_eps,
                hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_eps, hc_mult,
                use_pre_mix_in, save_pre_mix, rms_numel, write_aux=False, **kw):
        calls.append(["epilogue_delayed", int(mixes.shape[0])])
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

    tk._HC_PRENORM_GEMM_TILELANG_KERNEL = fma
    tk._MHC_POST_TILELANG_KERNEL = post
    tk._MHC_FUSED_TILELANG_KERNEL = fused
    wu.MHC_PRE_NORM_KERNEL = delayed
    tk._MHC_PRE_BIG_FUSE_TILELANG_KERNEL = _big_fuse_stand_in(calls)

    gen = torch.Generator().manual_seed(1)
    hc, eps = 4, 1e-6
    args_eps = (eps, 1e-2, 1e-2, 2.0, 20)

    def make(t, hidden):
        n = hc * (hc + 2)
        return dict(
            x=(torch.randn(t, hidden, generator=gen) * 0.5).to(torch.bfloat16),
            res=torch.randn(t, hc, hidden, generator=gen).to(torch.bfloat16),
            post=2 * torch.rand(t, hc, 1, generator=gen),
            comb=torch.softmax(torch.randn(t, hc, hc, generator=gen), -1).contiguous(),
            pre=torch.rand(t, hc, generator=gen) + 0.1,
            fn=torch.randn(n, hc * hidden, generator=gen) * 0.02,
            scale=torch.tensor([0.9, 1.1, 1.3]), base=torch.randn(n, generator=gen) * 0.1,
            w=(1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16))

    def err(got, want):
        return [float((g.float() - w.float()).abs().max()) for g, w in zip(got, want)]

    def delayed_case(arch, mhc_env, t, hidden):
        set_env(DEEPINFER_ARCH=arch, DEEPINFER_MHC=mhc_env)
        routing.reset()
        calls.clear()
        d = make(t, hidden)
        a = (d["x"], d["res"], d["post"], d["comb"], d["fn"], d["scale"], d["base"], *args_eps)
        got = tl_ops.mhc_fused_post_pre_delayed_tilelang(*a, pre_mix=d["pre"], norm_weight=d["w"],
                                                         norm_eps=eps)
        want = ref.fused_post_pre(*a, norm_weight=d["w"], norm_eps=eps, pre_mix=d["pre"],
                                  delayed=True)
        return {"calls": list(calls), "err": err(got[:5], want)}

    def v4_case(arch, mhc_env, t, hidden):
        set_env(DEEPINFER_ARCH=arch, DEEPINFER_MHC=mhc_env)
        routing.reset()
        calls.clear()
        d = make(t, hidden)
        a = (d["x"], d["res"], d["post"], d["comb"], d["fn"], d["scale"], d["base"], *args_eps)
        got = tl_ops.mhc_fused_post_pre_tilelang(*a, norm_weight=d["w"], norm_eps=eps)
        want = ref.fused_post_pre(*a, norm_weight=d["w"], norm_eps=eps)
        return {"calls": list(calls), "err": err(got, want[:4])}

    def first_v41(arch, mhc_env, t, hidden):
        set_env(DEEPINFER_ARCH=arch, DEEPINFER_MHC=mhc_env)
        routing.reset()
        calls.clear()
        d = make(t, hidden)
        n = hc * (hc + 2)
        fn_b = d["fn"].view(n, hc, hidden).sum(1).contiguous()
        res = d["x"][:, None, :].expand(-1, hc, -1).contiguous()
        got = tl_ops.mhc_pre_delayed_tilelang(res, fn_b, d["scale"], d["base"], *args_eps,
                                              x=d["x"], norm_weight=d["w"], norm_eps=eps)
        m, q = ref.prenorm_gemm(d["x"], fn_b)
        pre, pm, comb = ref.coefficients(m, q, hidden, d["scale"], d["base"], *args_eps, hc)
        return {"calls": list(calls), "err": err([got[0], got[1], got[3]],
                                                 [pm[:, :, None], comb, pre])}

    for arch, env in (("sm80", None), ("sm80", "0")):
        for t, hidden in ((6, 5120), (20, 5120), (20, 1024), (40, 1024), (300, 1024)):
            record(f"delayed/{arch}/{env}/{t}/{hidden}", lambda: delayed_case(arch, env, t, hidden))
        for t, hidden in ((6, 5120), (40, 1024)):
            record(f"v4/{arch}/{env}/{t}/{hidden}", lambda: v4_case(arch, env, t, hidden))
        for t in (5, 20, 40):
            record(f"first_v41/{arch}/{env}/{t}", lambda: first_v41(arch, env, t, 1024))
    set_env(DEEPINFER_ARCH=None, DEEPINFER_MHC=None)


def _big_fuse_stand_in(calls):
    """``_MHC_PRE_BIG_FUSE_TILELANG_KERNEL`` (V4 epilogues) computed with the reference."""
    from vllm.deepinfer.mhc import reference as ref

    def epilogue(gemm_out_mul, gemm_out_sqrsum, hc_scale, hc_base, residual, post_mix, comb_mix,
                 layer_input, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                 sinkhorn_repeat, *, residual_out=None, norm_weight=None, norm_eps=0.0):
        broadcast = residual_out is not None
        hc = residual_out.shape[1] if broadcast else residual.shape[1]
        numel = residual.shape[1] if broadcast else hc * residual.shape[2]
        calls.append(["epilogue", int(gemm_out_mul.shape[0])])
        pre, pm, comb = ref.coefficients(gemm_out_mul.sum(0), gemm_out_sqrsum.sum(0), numel,
                                         hc_scale, hc_base, rms_eps, hc_pre_eps,
                                         hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat,
                                         hc)
        post_mix.copy_(pm)
        comb_mix.copy_(comb.view(comb_mix.shape))
        streams = residual
        if broadcast:
            residual_out.copy_(residual[:, None, :].expand_as(residual_out))
            streams = residual_out
        layer_input.copy_(ref.collapse_norm(streams, pre, norm_weight, norm_eps))
    return epilogue


def scenario_warmup() -> None:
    """What V4.1's and V4's layers register (patches 0031/0032) on the Ampere path, and the
    compile keys the registrations expand to, with the mhc feature on and off."""
    from types import SimpleNamespace

    import vllm.model_executor.kernels.mhc.tilelang_kernels as tk
    import vllm.model_executor.kernels.mhc.warmup as wu
    import vllm.utils.deep_gemm as dg
    from vllm.deepinfer import routing
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    dg.is_deep_gemm_supported = lambda: False
    tk.compute_num_split = lambda block_k, k, grid: 28  # what a 108-SM A100 computes
    eps = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult_value=2.0,
               sinkhorn_repeat=20)
    hidden, max_tokens = 1024, 256
    vcfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens))

    def registered(mhc_env):
        set_env(DEEPINFER_ARCH="sm80", DEEPINFER_MHC=mhc_env)
        routing.reset()
        reg = JitWarmupRegistry(vcfg)
        with reg.activate():
            # V4.1's layer: the delayed epilogue over the hc stream and the embedding row.
            for rms_numel, pre_in in ((4 * hidden, True), (hidden, False)):
                wu.MHC_PRE_NORM_KERNEL.register_warmup(
                    split_mode="fused", max_tokens=max_tokens, hidden_size=hidden,
                    norm_eps=1e-6, hc_mult=4, rms_numel=rms_numel, use_pre_mix_in=pre_in,
                    extra_splits=tk.mhc_fused_post_pre_splits(hidden, 4), **eps)
            # V4's first layer.
            tk._MHC_PRE_BIG_FUSE_TILELANG_KERNEL.register_warmup(
                vcfg, hidden_size=hidden, hc_mult=4, use_norm_weight=True,
                include_pre_gemm_splits=False, include_broadcast_splits=True,
                norm_eps=(1e-6,), broadcast_norm_eps=1e-6, **eps)
        out = {}
        for kernel, regs in reg._registrations.items():
            keys = []
            for args, kwargs in regs:
                keys += [repr(k) for k in kernel.get_warmup_keys(*args, **kwargs)]
            out[type(kernel).__name__] = sorted(set(keys))
        return out

    record("on", lambda: registered(None))
    record("off", lambda: registered("0"))
    set_env(DEEPINFER_ARCH=None, DEEPINFER_MHC=None)


SCENARIOS = {"first_layer": scenario_first_layer, "projection": scenario_projection,
             "warmup": scenario_warmup}


def main() -> int:
    name = sys.argv[1]
    record("_scenario", SCENARIOS[name])
    print(json.dumps(RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
