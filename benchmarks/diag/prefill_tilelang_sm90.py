#!/usr/bin/env python3
"""Probe: a TileLang sparse MLA prefill for sm_90 whose two warpgroups do disjoint work.

Why: our Triton sm90 tile (64 heads x 64 keys per program, 8 warps, wgmma) reaches ~30% of
the bf16 matmul rate on the H200; with M = 64 heads on two warpgroups Triton has both
warpgroups compute the whole 64 x 64 score tile (1.5x the useful tensor work), and one
warpgroup spills the 64 x 512 fp32 accumulator. This probe tries the structure that avoids
both, written in TileLang:

* one CTA per (query token, 64-head group): 128 heads = two CTAs per token, adjacent in the
  grid so they share the gathered key rows through L2;
* 256 threads = two consumer warpgroups; both GEMMs use a warp partition of 4 warps on M
  (wgmma's 64 rows: one warpgroup) x 2 on N, so
    - QK^T  [64 heads, 64 keys] (K = 512): each warpgroup computes a 64 x 32 score block;
    - PV    [64 heads, 512 dims] (K = 64 keys): each warpgroup owns 256 output columns
      (64 x 256 fp32 = 128 accumulator registers per thread, plus 16 for the score block);
  the row max / row sum of the online softmax cross the two warpgroups through shared
  memory (TileLang's reduce across the 8 warps), P goes to shared memory as bf16 once and
  both warpgroups read all 64 keys of it for their half of PV;
* keys gathered by index from the bf16 workspace into shared memory (one 16-byte cp.async
  per 8 elements, invalid entries zero-filled), software-pipelined over 2 stages
  (T.Pipelined): Q 64 KiB + 2 x 64 KiB key stages + P 8 KiB;
* online softmax in fp32, exp2 domain (scale * log2(e) folded into one multiply), finite
  NEG_LARGE for masked scores, the sink in the denominator only, zeros where the softmax sum
  is not positive (no valid key, or a NaN/inf sum): the semantics of
  overlay/vllm/deepinfer/kernels/sparse_mla_prefill.py.

Interface (dense form of our kernel): q [T, H, 512] bf16, kv [rows, 512] bf16, indices
[T, width] int32, lens [T] int32 (row t's keys are indices[t, :clamp(lens[t], 0, width)],
entries < 0 or >= rows skipped), sink [H] fp32, out [T, H, 512] bf16; H a multiple of 64,
all contiguous.

    python3 benchmarks/diag/prefill_tilelang_sm90.py --gate            # CPU: lower for sm_90a
    python3 benchmarks/diag/prefill_tilelang_sm90.py [--out F.json]    # H200: check + time

The GPU run builds the sparse_mla_prefill suite's inputs (T = 2048 new tokens after 64K,
top-k 512 + window 128, 64 and 128 heads), checks the TileLang kernel against the suite's
fp32 reference and against our Triton sm90 kernel, and times TileLang, Triton sm90 and
upstream's kernel with the suite's method (CUDA graph over an input ring, Harness). A
TileLang failure (compile or mismatch) is printed and recorded; the rest still runs.
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

D = 512                 # key / value / query width
HG = 64                 # heads per CTA (wgmma M)
LOG2E = 1.4426950408889634
NEG_LARGE = -3.4028234663852886e38
MIN_DENOM = 1.0e-30


# ----------------------------------------------------------------------------- kernel
def build(qk_scale: float, has_sink: bool = True, block_n: int = 64, stages: int = 2,
          threads: int = 256, policy: str = "FullRow", zfill: bool = False,
          static_width: int | None = None):
    """The TileLang prim_func. ``qk_scale`` = softmax scale * log2(e) (baked in)."""
    import tilelang.language as T

    BN = block_n
    n_tok = T.dynamic("n_tok")
    n_heads = T.dynamic("n_heads")
    n_rows = T.dynamic("n_rows")
    width = T.dynamic("width") if static_width is None else static_width
    pol = getattr(T.GemmWarpPolicy, policy)
    bf16, f32, i32 = "bfloat16", "float32", "int32"

    @T.prim_func
    def sparse_prefill(
        Q: T.Tensor([n_tok, n_heads, D], bf16),
        KV: T.Tensor([n_rows, D], bf16),
        Idx: T.Tensor([n_tok, width], i32),
        Lens: T.Tensor([n_tok], i32),
        Sink: T.Tensor([n_heads], f32),
        Out: T.Tensor([n_tok, n_heads, D], bf16),
    ):
        groups = n_heads // HG
        with T.Kernel(n_tok * groups, threads=threads) as bx:
            tok = bx // groups
            h0 = (bx % groups) * HG

            q_s = T.alloc_shared([HG, D], bf16)
            k_s = T.alloc_shared([BN, D], bf16)
            p_s = T.alloc_shared([HG, BN], bf16)
            valid = T.alloc_fragment([BN], "bool")
            s = T.alloc_fragment([HG, BN], f32)
            acc = T.alloc_fragment([HG, D], f32)
            m_i = T.alloc_fragment([HG], f32)
            m_prev = T.alloc_fragment([HG], f32)
            l_i = T.alloc_fragment([HG], f32)
            rsum = T.alloc_fragment([HG], f32)
            alpha = T.alloc_fragment([HG], f32)

            n = T.min(T.max(Lens[tok], 0), width)
            T.copy(Q[tok, h0:h0 + HG, :], q_s)
            T.fill(acc, 0)
            T.fill(l_i, 0)
            T.fill(m_i, NEG_LARGE)

            n_it = T.ceildiv(n, BN) if static_width is None else T.ceildiv(static_width, BN)
            for it in T.Pipelined(n_it, num_stages=stages):
                # Validity of the tile's keys: inside the list and 0 <= slot < rows.
                for j in T.Parallel(BN):
                    valid[j] = (it * BN + j < n) and (Idx[tok, T.min(it * BN + j, width - 1)] >= 0) \
                        and (Idx[tok, T.min(it * BN + j, width - 1)] < n_rows)
                # Gather: row j of the tile = kv[clamp(slot, 0, rows - 1)], one 16-byte
                # cp.async per 8 elements. An invalid entry's row is read too (its scores are
                # masked and its P is 0). ``zfill`` (zeros for invalid entries, so a NaN/inf
                # in the aliased row cannot reach P x V as 0 * NaN) is exact but TileLang
                # 0.1.12 then emits plain loads: no cp.async, no 2-stage pipeline.
                for j, d in T.Parallel(BN, D):
                    if not zfill:
                        k_s[j, d] = KV[T.max(T.min(Idx[tok, T.min(it * BN + j, width - 1)],
                                                   n_rows - 1), 0), d]
                    else:
                      k_s[j, d] = T.if_then_else(
                        (it * BN + j < n)
                        and (Idx[tok, T.min(it * BN + j, width - 1)] >= 0)
                        and (Idx[tok, T.min(it * BN + j, width - 1)] < n_rows),
                        KV[Idx[tok, T.min(it * BN + j, width - 1)], d], T.cast(0, bf16))
                T.clear(s)
                T.gemm(q_s, k_s, s, transpose_B=True, policy=pol)
                T.copy(m_i, m_prev)
                for h, j in T.Parallel(HG, BN):
                    s[h, j] = T.if_then_else(valid[j], s[h, j] * qk_scale, NEG_LARGE)
                T.reduce_max(s, m_i, dim=1, clear=False)
                for h in T.Parallel(HG):
                    alpha[h] = T.exp2(m_prev[h] - m_i[h])
                for h, j in T.Parallel(HG, BN):
                    s[h, j] = T.if_then_else(valid[j], T.exp2(s[h, j] - m_i[h]), 0.0)
                T.reduce_sum(s, rsum, dim=1)
                for h in T.Parallel(HG):
                    l_i[h] = l_i[h] * alpha[h] + rsum[h]
                for h, d in T.Parallel(HG, D):
                    acc[h, d] = acc[h, d] * alpha[h]
                T.copy(s, p_s)
                T.gemm(p_s, k_s, acc, policy=pol)

            # Epilogue (upstream's): the sink joins the denominator; zeros where the sum is
            # not a positive number. alpha := factor, rsum := final sum.
            for h in T.Parallel(HG):
                if has_sink:
                    m_prev[h] = T.max(m_i[h], Sink[h0 + h] * LOG2E)
                    rsum[h] = l_i[h] * T.exp2(m_i[h] - m_prev[h]) \
                        + T.exp2(Sink[h0 + h] * LOG2E - m_prev[h])
                    alpha[h] = T.exp2(m_i[h] - m_prev[h]) / T.max(rsum[h], MIN_DENOM)
                else:
                    rsum[h] = l_i[h]
                    alpha[h] = 1.0 / T.max(rsum[h], MIN_DENOM)
            for h, d in T.Parallel(HG, D):
                # l_i > 0: some valid key (a row without one is zeros even where an invalid
                # entry aliased a NaN row); rsum > 0: the sum is a positive number.
                acc[h, d] = T.if_then_else((l_i[h] > 0.0) and (rsum[h] > 0.0),
                                           acc[h, d] * alpha[h], 0.0)
            T.copy(acc, q_s)  # Q is dead after the loop: stage the output for wide stores
            T.copy(q_s, Out[tok, h0:h0 + HG, :])

    return sparse_prefill


def _pass_configs():
    import tilelang
    return {tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
            tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def _env():
    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(tempfile.gettempdir(),
                                                             "tilelang-cache-prefill-probe"))


# ----------------------------------------------------------------------------- gate (CPU)
def lower_sm90(qk_scale: float, **kw):
    """(CUDA source, dynamic shared bytes) of the kernel lowered for sm_90a; no GPU."""
    _env()
    import tilelang
    from tilelang import tvm
    func = build(qk_scale, **kw)
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}) as tg:
        with tvm.transform.PassContext(config=_pass_configs()):
            art = tilelang.lower(func, target=tg)
    dev = str(art.device_mod.script())
    m = re.search(r'"dyn_shared_memory_buf": (\d+)', dev)
    return art.kernel_source, int(m.group(1)) if m else None


def gate(scale: float) -> dict:
    """Lower for sm_90a, build cubin and PTX with nvcc: shared memory, registers, spills,
    wgmma in the source / PTX / SASS, the wgmma shapes (per warpgroup: M x N x K)."""
    from tilelang import env as tl_env
    t0 = time.time()
    res = {"target": "sm_90a", "ok": False}
    try:
        src, shared = lower_sm90(scale * LOG2E)
    except Exception as e:
        res["error"] = f"lower: {type(e).__name__}: {str(e).strip().splitlines()[-1][:400]}"
        return res
    res["lower_s"] = round(time.time() - t0, 1)
    res["shared_dynamic_bytes"] = shared
    res["wgmma_in_source"] = "wgmma" in src
    res["wgmma_shapes"] = sorted(set(re.findall(
        r"wgmma_ss<[^>]*?kFloat32, (\d+), (\d+), (\d+)", src)))
    res["cp_async_in_source"] = "cp_async" in src
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        res["error"] = "nvcc not found (lowered only)"
        return res
    tmp = Path(tempfile.mkdtemp(prefix="tl-prefill-gate-"))
    (tmp / "k.cu").write_text(src)
    inc = ["-I" + tl_env.CUTLASS_INCLUDE_DIR, "-I" + tl_env.TILELANG_TEMPLATE_PATH]
    base = [nvcc, "-std=c++20", "-w", "-Xcudafe", "--diag_suppress=177",
            "-gencode", "arch=compute_90a,code=sm_90a", *inc]
    r = subprocess.run(base + ["-cubin", "--ptxas-options=-v", "-o", str(tmp / "k.cubin"),
                               str(tmp / "k.cu")], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        res["error"] = "nvcc: " + (r.stderr.strip().splitlines() or ["?"])[-1][:400]
        return res
    log = r.stderr + r.stdout
    m = re.search(r"Used (\d+) registers", log)
    res["registers"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                  log)
    if m:
        res["stack_bytes"], res["spill_store_bytes"], res["spill_load_bytes"] = map(int, m.groups())
    r = subprocess.run([nvcc, "-std=c++20", "-w", "-Xcudafe", "--diag_suppress=177", "-arch",
                        "sm_90a", *inc, "-ptx", "-o", str(tmp / "k.ptx"), str(tmp / "k.cu")],
                       capture_output=True, text=True, timeout=300)
    if r.returncode == 0:
        ptx = (tmp / "k.ptx").read_text()
        res["wgmma_in_ptx"] = ptx.count("wgmma.mma_async")
        res["cp_async_in_ptx"] = ptx.count("cp.async.cg") + ptx.count("cp.async.ca")
    dump = shutil.which("cuobjdump")
    try:  # Triton bundles one (as the mHC gate finds it)
        import triton
        b = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        dump = str(b) if os.access(b, os.X_OK) else dump
    except ImportError:
        pass
    if dump:
        sass = subprocess.run([dump, "-sass", str(tmp / "k.cubin")], capture_output=True,
                              text=True, timeout=120).stdout
        res["HGMMA_in_sass"] = len(re.findall(r"\bHGMMA\.", sass))
        res["LDGSTS_in_sass"] = len(re.findall(r"\bLDGSTS", sass))
    res["seconds"] = round(time.time() - t0, 1)
    res["ok"] = bool(res["wgmma_in_source"] and shared and shared <= 227 * 1024)
    shutil.rmtree(tmp, ignore_errors=True)
    return res


# ----------------------------------------------------------------------------- GPU run
def _compile_gpu(scale: float):
    _env()
    import tilelang
    return tilelang.compile(build(scale * LOG2E), out_idx=None, target="cuda",
                            pass_configs=_pass_configs())


def run_gpu(out_path: str | None, heads_list=(64, 128), tokens=2048, ctx=64 << 10) -> list:
    import torch
    sys.path.insert(0, str(REPO / "benchmarks"))
    from harness import Harness, max_abs_diff
    from suites import sparse_mla_prefill as suite

    h = Harness()
    rows: list[dict] = []
    meta = dict(h.meta, probe="prefill_tilelang_sm90")
    try:
        import tilelang
        meta["tilelang"] = tilelang.__version__
    except Exception as e:
        meta["tilelang"] = f"import failed: {e}"

    def dump():
        if out_path:
            Path(out_path).parent.mkdir(parents=True, exist_ok=True)
            Path(out_path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")

    tl_kernel, tl_error = None, None
    t0 = time.time()
    try:
        tl_kernel = _compile_gpu(suite.SCALE)
    except Exception as e:
        tl_error = f"compile: {type(e).__name__}: {str(e).strip()[-600:]}"
        traceback.print_exc()
    meta["tilelang_compile_s"] = round(time.time() - t0, 1)

    topk, ratio = suite.LAYERS[0]
    for heads in heads_list:
        shape = dict(tokens=tokens, ctx=ctx, topk=topk, ratio=ratio, heads=heads,
                     window=suite.WINDOW)
        per_copy = (tokens * heads * D * 2 * 2 + ((ctx + tokens) // ratio + tokens) * D * 2
                    + tokens * suite.topk_swa.combined_width(topk, suite.WINDOW) * 4)
        inputs = h.copies(lambda: suite.make_case(h.dev, tokens, ctx, topk, ratio, heads,
                                                  seed=int(torch.randint(0, 1 << 30, ()))),
                          per_copy, max_copies=8)
        ring = list(range(len(inputs)))
        x = inputs[0]
        flops = 2 * 2 * heads * D * int(x["lens"].sum())
        sample = torch.linspace(0, tokens - 1, min(suite.SAMPLE, tokens), device=h.dev).long()
        ref = suite.reference(x, sample)
        outs = [torch.empty_like(xi["q"]) for xi in inputs]

        def row(impl, us, **extra):
            r = dict(impl=impl, shape=shape, us=None if us is None else round(us, 3),
                     flops=flops, copies=len(inputs), **extra)
            if us:
                r["tflops"] = round(flops / (us * 1e-6) / 1e12, 2)
                r["matmul_tflops"] = round(h.matmul_tflops, 1)
                r["matmul_share"] = round(r["tflops"] / h.matmul_tflops, 4)
            rows.append(r)
            print(json.dumps(r), flush=True)
            dump()
            return r

        # upstream's kernel (ragged indices built outside the timing, as the suite does)
        ragged = [suite.upstream_ragged(xi) for xi in inputs]
        got_up = suite.upstream_kernel(x, *ragged[0], outs[0])[sample].float().clone()
        up_us = h.time_graph(lambda i: suite.upstream_kernel(inputs[i], *ragged[i], outs[i]),
                             ring)
        row("upstream", up_us, max_abs_diff_ref=max_abs_diff(got_up, ref))
        del ragged
        # our Triton sm90 tile
        got_tr = suite.ours(x, "sm90", out=outs[0])[sample].float().clone()
        tr_diff = max_abs_diff(got_tr, ref)
        tr_us = h.time_graph(lambda i: suite.ours(inputs[i], "sm90", out=outs[i]), ring)
        row("triton_sm90", tr_us, max_abs_diff_ref=tr_diff)
        # the TileLang probe
        err, us, diffs = tl_error, None, {}
        if tl_kernel is not None:
            def tl_launch(i):
                xi = inputs[i]
                tl_kernel(xi["q"], xi["kv"], xi["idx"], xi["lens"], xi["sink"], outs[i])
                return outs[i]
            try:
                outs[0].fill_(float("nan"))
                got = tl_launch(0)
                torch.cuda.synchronize()
                full = got.float()
                diffs["max_abs_diff_ref"] = max_abs_diff(full[sample], ref)
                tr_full = suite.ours(x, "sm90", out=torch.empty_like(x["q"])).float()
                diffs["max_abs_diff_triton"] = max_abs_diff(full, tr_full)
                diffs["nan_count"] = int(full.isnan().sum())
                tol = 3 * tr_diff + 2e-3
                if not (diffs["max_abs_diff_ref"] <= tol):
                    err = (f"mismatch: max_abs_diff_ref {diffs['max_abs_diff_ref']} > "
                           f"{tol:.4g} (3 x Triton's + 2e-3)")
                del tr_full, full
            except Exception as e:
                err = f"run: {type(e).__name__}: {str(e).strip()[-600:]}"
                traceback.print_exc()
            if err is None or err.startswith("mismatch"):
                try:
                    us = h.time_graph(tl_launch, ring)
                    diffs["timing"] = "cuda_graph"
                except Exception as e:   # e.g. a launch outside the capturing stream
                    print(f"tilelang: CUDA-graph timing failed ({e}); eager ring", flush=True)
                    torch.cuda.synchronize()
                    us = h.time_ring(tl_launch, ring)
                    diffs["timing"] = f"eager_ring (graph failed: {str(e)[:200]})"
        if err:
            print(f"TILELANG FAILURE ({heads} heads): {err}", flush=True)
        r = row("tilelang_sm90", us, ok=err is None, error=err, **diffs)
        if us and tr_us:
            r["vs_triton_sm90"] = round(tr_us / us, 3)
            r["vs_upstream"] = round(up_us / us, 3)
            dump()
        del inputs, outs
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gate", action="store_true", help="lower/compile for sm_90a (no GPU)")
    ap.add_argument("--out", help="write JSON here")
    ap.add_argument("--heads", default="64,128")
    a = ap.parse_args(argv)
    if a.gate:
        res = gate(D ** -0.5)
        print(json.dumps(res, indent=1))
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        return 0 if res["ok"] else 1
    t0 = time.time()
    run_gpu(a.out, tuple(int(x) for x in a.heads.split(",")))
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
