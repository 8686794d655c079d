"""mHC at decode token counts (1-32 tokens): post, projection, Sinkhorn and pre-mix in ONE
Triton launch, for V4.1's shifted/delayed boundary and V4's fused one (docs/mhc.md, section
6, "The decode kernel"). Why this file stays whole: one kernel whose three CTA roles share
the ticket and release protocol, its workspace and its launcher; split, each wait would sit
in another file than the release it waits on.

Upstream (vLLM 0.33.0, ``kernels/mhc/tilelang.py``) runs a layer boundary at these sizes as
two TileLang launches: the fused post + split-k projection (``mhc_fused_tilelang``, one
block per token x projection tile x k-split, each re-reading its slice of the 24 x 4H fp32
weights ``fn`` and recomputing the post mapping) and the epilogue (split sum, Sinkhorn,
collapse and RMSNorm, one block per token). Its time at 1-32 tokens is fixed cost: the
weights (1.6-2.8 MB) take under 0.7 us to stream on the H200, the op 8.4-12 us.

One launch of ``S + (G + 1) * T`` CTAs of 4 warps: ``S = hidden / 32`` k-slices of 32
hidden columns (128-224 at hidden 4096-7168), ``G`` norm CTAs and one coefficient CTA per
token. Every CTA first takes a ticket from a counter (one atomic); the ticket, not
``program_id``, gives its role, so a CTA only ever waits for CTAs holding smaller tickets --
CTAs that are already running -- whatever order the hardware starts them in and however few
SMs there are (the argument CUB's single-pass scan makes for its dynamically numbered tiles):

* tickets ``[0, S)``, slice CTAs, never wait. For its columns and all T tokens (in groups
  of 16, the MMA height), against the slice's ``fn`` columns loaded once: the post mapping
  ``new[j] = post[j] * x + sum_k comb[k, j] * residual[k]`` in upstream's compiled operation
  order (FMUL comb[0, j] * residual[0], FFMA post[j] * x, then one FFMA per stream k = 1..3:
  the SASS nvcc makes of ``mhc_post_tilelang`` and ``mhc_fused_tilelang`` on sm_80 and
  sm_90), stored bf16; the projection of those bf16 streams on
  tensor cores, each fp32 weight split exactly into three bf16 terms (its significand in
  8-bit pieces), so three bf16 MMAs with fp32 accumulation form every product exactly -- an
  fp32-class projection, not a tf32 one; the squared sum; and, in V4.1's form, the collapse
  of the four streams with the carried pre-mix (bf16, unnormalised, into ``layer_input``),
  its squared sum and the aux stream mean. One 32-float record per (token, slice) goes to
  the workspace; then a CTA barrier and a release increment of the "done" counter.
* tickets ``[S, S + G * T)``, norm CTAs, wait (acquire) until done == S. V4.1 (``G`` = one
  per 4096 columns): sum the token's collapse squared sums and scale its columns of the
  layer input by the RMSNorm. V4 (``G = 1``): sum the token's records (one [S, 32] block,
  one reduction), derive this boundary's pre-mix, collapse the stored streams with it and
  normalise.
* tickets ``[S + G * T, S + (G + 1) * T)``, coefficient CTAs, wait likewise, sum the
  token's records and run the gates and the Sinkhorn normalisation (per-thread scalars, one
  reciprocal per row or column) and store post, comb and (V4.1) the next pre-mix.

The last waiter to pass its wait resets the counters (every ticket has been taken by then:
waiters hold the largest ones), so the workspace needs no clearing launch and a CUDA graph
replays the launch as captured. Deterministic run to run: every reduction has a fixed order
(the slice records in slice order, tl.sum trees fixed by the compiled layout), no
floating-point atomics; the counters carry only integers. The workspace is per (device,
stream), so launches on two streams never share one.

Accuracy against the fp32 reference (vllm.deepinfer.mhc.reference, which projects the bf16
streams): the projection differs by fp32 accumulation order only; upstream's fused kernel
projects the fp32 streams before their bf16 rounding, so its coefficients sit further from
that reference (tests/test_mhc_decode_fused.py measures both on the same inputs). The layer
input differs from upstream's by the order of its RMSNorm sum (a bf16 ulp, rarely).

Routing: patch 0030 asks ``delayed`` / ``fused`` first in upstream's
``mhc_fused_post_pre_delayed_tilelang`` / ``mhc_fused_post_pre_tilelang``; None keeps
upstream's path. On with the ``mhc`` and ``mhc_decode`` features (default off on GPUs: docs/mhc.md), for
1-32 tokens, hc_mult 4, a hidden size that is a multiple of 256 up to 8192, a bf16 norm
weight, 16-byte-aligned contiguous inputs on a CUDA device (or CPU tensors under the Triton
interpreter). ``DEEPINFER_MHC_DECODE=0`` restores upstream's kernels.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import triton
import triton.language as tl

from vllm.deepinfer import arch, compile_gate, routing

logger = logging.getLogger("vllm.deepinfer")

__all__ = ["FEATURE", "MAX_TOKENS", "DecodeKey", "delayed", "fused", "key_for", "slice_columns",
           "compile_key", "supported_hidden"]

FEATURE = "mhc_decode"
MAX_TOKENS = 32          # upstream's fused post + pre band; above it the tensor-core path runs
HC = 4                   # hc_mult: 4 streams, 24 projection outputs
N_OUT = HC * (HC + 2)
# floats per (token, slice) record: 24 mixes, the squared sum, V4.1's collapse squared sum
REC = tl.constexpr(32)
NUM_WARPS = 4
# Token classes: 1-16 and 17-32 tokens. A slice CTA works through its tokens in groups of
# 16 (the MMA height, m16n8k16) against weights it loads once.
BLOCK_T = (16, 32)
# V4.1's norm CTAs scale NORM_BLOCK columns each (32 per thread: one CTA per token at
# hidden 4096, two at 5120/7168); V4's one norm CTA per token walks its row in blocks of
# COL_BLOCK columns, loading a block ahead (8 columns of 4 streams per thread).
NORM_BLOCK = 4096
COL_BLOCK = 1024
MAX_HIDDEN = 8192
# Slice widths the kernel builds: 32 columns is what the Ampere path dispatches (every SM of
# an A100 or H200 gets one or more slices at hidden 4096-7168; 124-128 registers per thread);
# 64 (half the slices, 185-194 registers, and an 8-byte stack frame in V4's sm_86 build) is
# a variant for the benchmark's comparison only (``ch=64``), not gated, not dispatched.
SLICE_COLUMNS = (32, 64)
# Phase stamps (diagnostic only: benchmarks/diag/mhc_decode_phases.py sets TRACE_PHASES): with
# the TRACE constexpr on, every CTA writes TRACE_COLS int64 values after the records in the
# workspace: its ticket, then %globaltimer at entry, after its ticket, after its wait (waiters)
# or its release (slices), after the records' sum and after the Sinkhorn loop (coefficient
# CTAs), and at its end. Off (the default, and every dispatched build), no code is emitted.
TRACE_PHASES = False
TRACE_COLS = tl.constexpr(8)
TRACE_ROWS = 512          # >= the largest grid: 256 slices + 3 CTAs x 32 tokens
# How the coefficient CTA (and V4's norm CTA) reads the 25 scalars of its summed record.
# False: one cross-thread tl.sum over the 32-float vector per scalar (the 5f3a658 kernel: 24
# or 5 reductions, each across the CTA's warps). True: the vector stored once to a per-token
# scratch row of the workspace, one CTA barrier, then 25 scalar loads. The phase stamps at
# b8745b3 put 1.7 us between the slices' release and the summed records and 3.3 us in the
# coefficient chain (benchmarks/results/h200-2026-12-02-mhc-decode-phases-b8745b3.json); the
# picks are part of both. Same values either way (the sum adds zeros to the one element).
# Measured on the H200 at 76ae0bd (benchmarks/diag/mhc_decode_phases.py --picks scratch,sum;
# benchmarks/results/h200-2026-12-02-mhc-decode-phases-76ae0bd.json): scratch 0-0.43 us
# faster per call in V4.1 (10.55 against 10.82 us at hidden 4096, T=12), within 0.07 us
# either way in V4; on because it is never measurably slower.
SCRATCH_PICKS = True


@triton.jit
def _stamp(ws, row, col: tl.constexpr, dep, TRACE: tl.constexpr):
    """Phase stamp ``col`` of CTA ``row`` (TRACE only): %globaltimer, read once ``dep`` (an
    int32 scalar) is computed, stored after the workspace's records."""
    if TRACE:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep],
                                      dtype=tl.int64, is_pure=False, pack=1)
        base = ws.to(tl.pointer_type(tl.int64)) + _TRACE_BASE
        tl.store(base + row * TRACE_COLS + col, t)


@triton.jit
def _post_stream(xv, r0, r1, r2, r3, p, c0, c1, c2, c3):
    # upstream's order as nvcc compiles TileLang's mhc_post / mhc_fused (their SASS, sm_80 and
    # sm_90 alike): FMUL comb[0] * residual[0], FFMA post * x into it, then FFMA per stream
    # k = 1..3. The source reads post * x first; nvcc fuses that multiply, not the other.
    v = c0 * r0
    v = tl.fma(p, xv, v)
    v = tl.fma(c1, r1, v)
    v = tl.fma(c2, r2, v)
    return tl.fma(c3, r3, v)


@triton.jit
def _slice_stream(xv, r0, r1, r2, r3, post_in, comb_in, toks, tm, j: tl.constexpr, out_ptrs,
                  m2, b, acc, sq, col, aux, q, DELAYED: tl.constexpr, WRITE_AUX: tl.constexpr,
                  PIN: tl.constexpr):
    """Stream ``j`` of a slice: post mapping, bf16 store, projection onto ``b`` [CH, 32], and
    its terms of the squared sum, (V4.1) the collapse with pre-mix weight ``q`` and the aux
    sum -- accumulated here so that no stream stays live past its own step."""
    p = tl.load(post_in + toks * 4 + j, mask=tm, other=0.0)[:, None]
    c0 = tl.load(comb_in + toks * 16 + j, mask=tm, other=0.0)[:, None]
    c1 = tl.load(comb_in + toks * 16 + 4 + j, mask=tm, other=0.0)[:, None]
    c2 = tl.load(comb_in + toks * 16 + 8 + j, mask=tm, other=0.0)[:, None]
    c3 = tl.load(comb_in + toks * 16 + 12 + j, mask=tm, other=0.0)[:, None]
    v = _post_stream(xv, r0, r1, r2, r3, p, c0, c1, c2, c3)
    if PIN:
        # An identity the compiler may not duplicate: without it Triton computes the whole
        # post mapping in the MMA operand layout, each of the 4 warps redoing every element
        # (4x the arithmetic and the registers: 226 of them at a 16 x 32 tile, not 124).
        v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.float32,
                                      is_pure=False, pack=1)
    vb = v.to(tl.bfloat16)
    tl.store(out_ptrs, vb, mask=m2)
    # The projection of the bf16 stream: each fp32 weight is exactly the sum of three bf16
    # terms (its top 8 significant bits, the next 8, the last 8), so three bf16 MMAs with
    # fp32 accumulation form every product exactly (8 x 8 bits) -- an fp32-class GEMM on
    # tensor cores, with the stream itself as the MMA operand (no fp32 copy of it).
    w1 = (b.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    rem = b - w1
    w2 = (rem.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    acc = tl.dot(vb, w1.to(tl.bfloat16), acc)
    acc = tl.dot(vb, w2.to(tl.bfloat16), acc)
    acc = tl.dot(vb, (rem - w2).to(tl.bfloat16), acc)
    a = vb.to(tl.float32)
    sq += a * a
    if DELAYED:
        if j == 0:
            col = q * a                 # upstream's collapse: pre[0] * x[0], then FFMAs
        else:
            col = tl.fma(q, a, col)
        if WRITE_AUX:
            aux += a
    return acc, sq, col, aux


@triton.jit
def _pre_in(pre_in, toks, tm, j: tl.constexpr, USE_PRE_IN: tl.constexpr):
    if USE_PRE_IN:
        return tl.load(pre_in + toks * 4 + j, mask=tm, other=0.0)[:, None]
    else:  # model entry: stream 0
        return 1.0 if j == 0 else 0.0


@triton.jit
def _slice_tokens(t0, x, residual, post_in, comb_in, pre_in, residual_out, layer_input,
                  aux_out, ws, s, num_tokens, b0, b1, b2, b3, H: tl.constexpr,
                  CH: tl.constexpr, DELAYED: tl.constexpr, USE_PRE_IN: tl.constexpr,
                  WRITE_AUX: tl.constexpr, PIN: tl.constexpr):
    """Tokens [t0, t0 + 16) of slice ``s`` (one MMA height), against the slice's weights."""
    S: tl.constexpr = H // CH
    toks = t0 + tl.arange(0, 16)
    tm = toks < num_tokens
    m2 = tm[:, None]
    cols = s * CH + tl.arange(0, CH)
    xo = toks[:, None] * H + cols[None, :]
    ro = toks[:, None] * (4 * H) + cols[None, :]
    xv = tl.load(x + xo, mask=m2, other=0.0).to(tl.float32)
    r0 = tl.load(residual + ro, mask=m2, other=0.0).to(tl.float32)
    r1 = tl.load(residual + ro + H, mask=m2, other=0.0).to(tl.float32)
    r2 = tl.load(residual + ro + 2 * H, mask=m2, other=0.0).to(tl.float32)
    r3 = tl.load(residual + ro + 3 * H, mask=m2, other=0.0).to(tl.float32)
    nn = tl.arange(0, REC)
    acc = tl.zeros((16, REC), tl.float32)
    sq = tl.zeros((16, CH), tl.float32)
    col = tl.zeros((16, CH), tl.float32)
    aux = tl.zeros((16, CH), tl.float32)   # upstream's aux: 0 + x[0] + x[1] + ...
    acc, sq, col, aux = _slice_stream(
        xv, r0, r1, r2, r3, post_in, comb_in, toks, tm, 0, residual_out + ro, m2, b0, acc,
        sq, col, aux, _pre_in(pre_in, toks, tm, 0, USE_PRE_IN), DELAYED, WRITE_AUX, PIN)
    acc, sq, col, aux = _slice_stream(
        xv, r0, r1, r2, r3, post_in, comb_in, toks, tm, 1, residual_out + ro + H, m2, b1, acc,
        sq, col, aux, _pre_in(pre_in, toks, tm, 1, USE_PRE_IN), DELAYED, WRITE_AUX, PIN)
    acc, sq, col, aux = _slice_stream(
        xv, r0, r1, r2, r3, post_in, comb_in, toks, tm, 2, residual_out + ro + 2 * H, m2, b2,
        acc, sq, col, aux, _pre_in(pre_in, toks, tm, 2, USE_PRE_IN), DELAYED, WRITE_AUX, PIN)
    acc, sq, col, aux = _slice_stream(
        xv, r0, r1, r2, r3, post_in, comb_in, toks, tm, 3, residual_out + ro + 3 * H, m2, b3,
        acc, sq, col, aux, _pre_in(pre_in, toks, tm, 3, USE_PRE_IN), DELAYED, WRITE_AUX, PIN)
    rec = tl.where(nn[None, :] == 24, tl.sum(sq, axis=1)[:, None], acc)
    if DELAYED:
        rb = col.to(tl.bfloat16)   # the bf16 boundary before the delayed RMSNorm
        tl.store(layer_input + xo, rb, mask=m2)
        rf = rb.to(tl.float32)
        rec = tl.where(nn[None, :] == 25, tl.sum(rf * rf, axis=1)[:, None], rec)
        if WRITE_AUX:
            tl.store(aux_out + xo, (aux * 0.25).to(tl.bfloat16), mask=m2)
    tl.store(ws + (toks[:, None] * S + s) * REC + nn[None, :], rec, mask=m2)


@triton.jit
def _slice_role(s, x, residual, post_in, comb_in, fn, pre_in, residual_out, layer_input,
                aux_out, ws, ctr, num_tokens, H: tl.constexpr, CH: tl.constexpr,
                BT: tl.constexpr, DELAYED: tl.constexpr, USE_PRE_IN: tl.constexpr,
                WRITE_AUX: tl.constexpr, PIN: tl.constexpr):
    # the slice's weights first (the DRAM part), kept for every 16-token group
    cols = s * CH + tl.arange(0, CH)
    nn = tl.arange(0, REC)
    fo = nn[None, :] * (4 * H) + cols[:, None]
    fm = (nn < 24)[None, :]
    b0 = tl.load(fn + fo, mask=fm, other=0.0)
    b1 = tl.load(fn + fo + H, mask=fm, other=0.0)
    b2 = tl.load(fn + fo + 2 * H, mask=fm, other=0.0)
    b3 = tl.load(fn + fo + 3 * H, mask=fm, other=0.0)
    for g in tl.static_range(BT // 16):
        _slice_tokens(g * 16, x, residual, post_in, comb_in, pre_in, residual_out,
                      layer_input, aux_out, ws, s, num_tokens, b0, b1, b2, b3, H, CH,
                      DELAYED, USE_PRE_IN, WRITE_AUX, PIN)
    tl.debug_barrier()                          # the CTA's records, then one release
    tl.atomic_add(ctr + 1, 1, sem="release")


@triton.jit
def _wait_and_check_in(ctr, S: tl.constexpr, waiters):
    """Wait (acquire) for the S slice CTAs; the last of the waiters resets the counters."""
    while tl.atomic_add(ctr + 1, 0, sem="acquire") < S:
        pass
    tl.debug_barrier()
    if tl.atomic_add(ctr + 2, 1, sem="acq_rel") == waiters - 1:
        tl.atomic_xchg(ctr, 0)
        tl.atomic_xchg(ctr + 1, 0)
        tl.atomic_xchg(ctr + 2, 0)


@triton.jit
def _records(ws, t, S: tl.constexpr, S_PAD: tl.constexpr):
    """Token ``t``'s slice records summed in one fixed-order reduction: [REC]."""
    s = tl.arange(0, S_PAD)
    k = tl.arange(0, REC)
    blk = tl.load(ws + (t * S + s[:, None]) * REC + k[None, :], mask=(s < S)[:, None],
                  other=0.0, cache_modifier=".cg")
    return tl.sum(blk, axis=0), k


@triton.jit
def _pick(v, k, i: tl.constexpr):
    return tl.sum(tl.where(k == i, v, 0.0), axis=0)


@triton.jit
def _picker(ws, row, mix, k, SCRATCH: tl.constexpr):
    """With SCRATCH: store the summed record ``mix`` to scratch row ``row`` of the workspace
    and fence the CTA, so that ``_get`` reads its scalars by plain loads; the row's address
    (unused without SCRATCH)."""
    sp = ws + _SCRATCH_BASE + row * REC
    if SCRATCH:
        tl.store(sp + k, mix)
        tl.debug_barrier()
    return sp


@triton.jit
def _get(mix, k, sp, i: tl.constexpr, SCRATCH: tl.constexpr):
    if SCRATCH:
        return tl.load(sp + i)
    else:
        return _pick(mix, k, i)


@triton.jit
def _norm4(a, b, c, d, eps):
    inv = 1.0 / ((((a + b) + c) + d) + eps)
    return a * inv, b * inv, c * inv, d * inv


@triton.jit
def _softmax4(a, b, c, d, eps):
    mx = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    ea = tl.exp(a - mx)
    eb = tl.exp(b - mx)
    ec = tl.exp(c - mx)
    ed = tl.exp(d - mx)
    inv = 1.0 / (((ea + eb) + ec) + ed)
    return ea * inv + eps, eb * inv + eps, ec * inv + eps, ed * inv + eps


@triton.jit
def _comb_row(mix, k, sp, hc_base, rms, s2, e, i: tl.constexpr, PICKS: tl.constexpr):
    """One row of the comb logits (mix[i .. i + 3], scaled and biased), softmaxed."""
    return _softmax4(_get(mix, k, sp, i, PICKS) * rms * s2 + tl.load(hc_base + i),
                     _get(mix, k, sp, i + 1, PICKS) * rms * s2 + tl.load(hc_base + i + 1),
                     _get(mix, k, sp, i + 2, PICKS) * rms * s2 + tl.load(hc_base + i + 2),
                     _get(mix, k, sp, i + 3, PICKS) * rms * s2 + tl.load(hc_base + i + 3), e)


@triton.jit
def _norm_group_role(t, g, ws, norm_w, layer_input, norm_eps, H: tl.constexpr,
                     CH: tl.constexpr, S_PAD: tl.constexpr, NB: tl.constexpr):
    """V4.1: columns [g * NB, (g + 1) * NB) of token t's layer input, RMSNorm'd in place (the
    slices stored the bf16 collapse; its squared sum is in record column 25)."""
    S: tl.constexpr = H // CH
    s = tl.arange(0, S_PAD)
    cols = g * NB + tl.arange(0, NB)
    cm = cols < H
    csq = tl.sum(tl.load(ws + (t * S + s) * REC + 25, mask=s < S, other=0.0,
                         cache_modifier=".cg"), axis=0)
    v = tl.load(layer_input + t * H + cols, mask=cm, other=0.0, cache_modifier=".cg")
    w = tl.load(norm_w + cols, mask=cm, other=0.0).to(tl.float32)
    rs = tl.math.rsqrt(csq / H + norm_eps)
    tl.store(layer_input + t * H + cols, ((v.to(tl.float32) * rs) * w).to(tl.bfloat16),
             mask=cm)


@triton.jit
def _norm_row_role(t, ws, hc_scale, hc_base, residual_out, norm_w, layer_input,
                   rms_eps, hc_pre_eps, norm_eps, H: tl.constexpr, CH: tl.constexpr,
                   S_PAD: tl.constexpr, CB: tl.constexpr, PICKS: tl.constexpr):
    """V4: token t's pre-mix from the projection, the collapse of the stored streams with it,
    and its RMSNorm (two passes over the row, each loading a block ahead)."""
    S: tl.constexpr = H // CH
    NC: tl.constexpr = (H + CB - 1) // CB
    mix, k = _records(ws, t, S, S_PAD)
    sp = _picker(ws, 2 * t + 1, mix, k, PICKS)
    rms = tl.math.rsqrt(_get(mix, k, sp, 24, PICKS) / (4 * H) + rms_eps)
    s0 = tl.load(hc_scale)
    q0 = tl.sigmoid(_get(mix, k, sp, 0, PICKS) * rms * s0 + tl.load(hc_base)) + hc_pre_eps
    q1 = tl.sigmoid(_get(mix, k, sp, 1, PICKS) * rms * s0 + tl.load(hc_base + 1)) + hc_pre_eps
    q2 = tl.sigmoid(_get(mix, k, sp, 2, PICKS) * rms * s0 + tl.load(hc_base + 2)) + hc_pre_eps
    q3 = tl.sigmoid(_get(mix, k, sp, 3, PICKS) * rms * s0 + tl.load(hc_base + 3)) + hc_pre_eps
    base = tl.arange(0, CB)
    ro = t * (4 * H) + base
    n0 = tl.load(residual_out + ro, mask=base < H, other=0.0, cache_modifier=".cg")
    n1 = tl.load(residual_out + ro + H, mask=base < H, other=0.0, cache_modifier=".cg")
    n2 = tl.load(residual_out + ro + 2 * H, mask=base < H, other=0.0, cache_modifier=".cg")
    n3 = tl.load(residual_out + ro + 3 * H, mask=base < H, other=0.0, cache_modifier=".cg")
    ssq = tl.zeros((CB,), tl.float32)
    for c in tl.static_range(NC):
        v0 = n0
        v1 = n1
        v2 = n2
        v3 = n3
        if c + 1 < NC:
            nm = (c + 1) * CB + base < H
            n0 = tl.load(residual_out + ro + (c + 1) * CB, mask=nm, other=0.0,
                         cache_modifier=".cg")
            n1 = tl.load(residual_out + ro + (c + 1) * CB + H, mask=nm, other=0.0,
                         cache_modifier=".cg")
            n2 = tl.load(residual_out + ro + (c + 1) * CB + 2 * H, mask=nm, other=0.0,
                         cache_modifier=".cg")
            n3 = tl.load(residual_out + ro + (c + 1) * CB + 3 * H, mask=nm, other=0.0,
                         cache_modifier=".cg")
        col = q0 * v0.to(tl.float32)
        col = tl.fma(q1, v1.to(tl.float32), col)
        col = tl.fma(q2, v2.to(tl.float32), col)
        col = tl.fma(q3, v3.to(tl.float32), col)
        ssq += col * col          # V4 squares the fp32 collapse (its epilogue does)
        tl.store(layer_input + t * H + c * CB + base, col.to(tl.bfloat16),
                 mask=c * CB + base < H)
    rs = tl.math.rsqrt(tl.sum(ssq, axis=0) / H + norm_eps)
    tl.debug_barrier()
    li = layer_input + t * H + base
    nv = tl.load(li, mask=base < H, other=0.0, cache_modifier=".cg")
    nw = tl.load(norm_w + base, mask=base < H, other=0.0)
    for c in tl.static_range(NC):
        v = nv
        w = nw
        if c + 1 < NC:
            nm = (c + 1) * CB + base < H
            nv = tl.load(li + (c + 1) * CB, mask=nm, other=0.0, cache_modifier=".cg")
            nw = tl.load(norm_w + (c + 1) * CB + base, mask=nm, other=0.0)
        tl.store(li + c * CB, ((v.to(tl.float32) * rs) * w.to(tl.float32)).to(tl.bfloat16),
                 mask=c * CB + base < H)


@triton.jit
def _coef_role(t, ws, hc_scale, hc_base, post_out, comb_out, pre_out, rms_eps, hc_pre_eps,
               hc_sinkhorn_eps, hc_post_mult, H: tl.constexpr, CH: tl.constexpr,
               S_PAD: tl.constexpr, SINKHORN: tl.constexpr, DELAYED: tl.constexpr,
               row, TRACE: tl.constexpr, PICKS: tl.constexpr):
    S: tl.constexpr = H // CH
    mix, k = _records(ws, t, S, S_PAD)
    sp = _picker(ws, 2 * t, mix, k, PICKS)
    rms = tl.math.rsqrt(_get(mix, k, sp, 24, PICKS) / (4 * H) + rms_eps)
    _stamp(ws, row, 4, rms.to(tl.int32, bitcast=True), TRACE)
    s0 = tl.load(hc_scale)
    s1 = tl.load(hc_scale + 1)
    s2 = tl.load(hc_scale + 2)
    if DELAYED:  # the next boundary's pre-mix
        for j in tl.static_range(4):
            z = _get(mix, k, sp, j, PICKS) * rms * s0 + tl.load(hc_base + j)
            tl.store(pre_out + t * 4 + j, tl.sigmoid(z) + hc_pre_eps)
    for j in tl.static_range(4):
        z = _get(mix, k, sp, 4 + j, PICKS) * rms * s1 + tl.load(hc_base + 4 + j)
        tl.store(post_out + t * 4 + j, tl.sigmoid(z) * hc_post_mult)
    # comb logits m[j][k] = mix[8 + 4j + k]: softmax over each row, then Sinkhorn
    e = hc_sinkhorn_eps
    m00, m01, m02, m03 = _comb_row(mix, k, sp, hc_base, rms, s2, e, 8, PICKS)
    m10, m11, m12, m13 = _comb_row(mix, k, sp, hc_base, rms, s2, e, 12, PICKS)
    m20, m21, m22, m23 = _comb_row(mix, k, sp, hc_base, rms, s2, e, 16, PICKS)
    m30, m31, m32, m33 = _comb_row(mix, k, sp, hc_base, rms, s2, e, 20, PICKS)
    m00, m10, m20, m30 = _norm4(m00, m10, m20, m30, e)
    m01, m11, m21, m31 = _norm4(m01, m11, m21, m31, e)
    m02, m12, m22, m32 = _norm4(m02, m12, m22, m32, e)
    m03, m13, m23, m33 = _norm4(m03, m13, m23, m33, e)
    if rms >= 0.0:  # a NaN row (CUDA-graph padding) skips the rest, as upstream's epilogue
        for _ in range(SINKHORN - 1):
            m00, m01, m02, m03 = _norm4(m00, m01, m02, m03, e)
            m10, m11, m12, m13 = _norm4(m10, m11, m12, m13, e)
            m20, m21, m22, m23 = _norm4(m20, m21, m22, m23, e)
            m30, m31, m32, m33 = _norm4(m30, m31, m32, m33, e)
            m00, m10, m20, m30 = _norm4(m00, m10, m20, m30, e)
            m01, m11, m21, m31 = _norm4(m01, m11, m21, m31, e)
            m02, m12, m22, m32 = _norm4(m02, m12, m22, m32, e)
            m03, m13, m23, m33 = _norm4(m03, m13, m23, m33, e)
    _stamp(ws, row, 5, m33.to(tl.int32, bitcast=True), TRACE)
    o = comb_out + t * 16
    tl.store(o + 0, m00)
    tl.store(o + 1, m01)
    tl.store(o + 2, m02)
    tl.store(o + 3, m03)
    tl.store(o + 4, m10)
    tl.store(o + 5, m11)
    tl.store(o + 6, m12)
    tl.store(o + 7, m13)
    tl.store(o + 8, m20)
    tl.store(o + 9, m21)
    tl.store(o + 10, m22)
    tl.store(o + 11, m23)
    tl.store(o + 12, m30)
    tl.store(o + 13, m31)
    tl.store(o + 14, m32)
    tl.store(o + 15, m33)


@triton.jit(do_not_specialize=["num_tokens"])
def _mhc_decode_kernel(x, residual, post_in, comb_in, fn, hc_scale, hc_base, pre_in, norm_w,
                       residual_out, post_out, comb_out, layer_input, pre_out, aux_out, ws,
                       ctr, num_tokens, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult,
                       norm_eps, H: tl.constexpr, CH: tl.constexpr, S_PAD: tl.constexpr,
                       BT: tl.constexpr, NB: tl.constexpr, CB: tl.constexpr,
                       SINKHORN: tl.constexpr, DELAYED: tl.constexpr,
                       USE_PRE_IN: tl.constexpr, WRITE_AUX: tl.constexpr, PIN: tl.constexpr,
                       TRACE: tl.constexpr, PICKS: tl.constexpr):
    S: tl.constexpr = H // CH
    # norm CTAs per token: V4.1 one per NB columns (the slices left only a scale to apply);
    # V4 one for the whole row (it collapses with a pre-mix it derives itself)
    NG: tl.constexpr = (H + NB - 1) // NB if DELAYED else 1
    waiters = num_tokens * (NG + 1)
    row = tl.program_id(0)
    _stamp(ws, row, 1, row, TRACE)
    ticket = tl.atomic_add(ctr, 1, sem="relaxed")   # the role, in the order CTAs start
    _stamp(ws, row, 2, ticket, TRACE)
    if TRACE:
        tl.store(ws.to(tl.pointer_type(tl.int64)) + _TRACE_BASE + row * TRACE_COLS,
                 ticket.to(tl.int64))
    if ticket < S:
        _slice_role(ticket, x, residual, post_in, comb_in, fn, pre_in, residual_out,
                    layer_input, aux_out, ws, ctr, num_tokens, H, CH, BT, DELAYED,
                    USE_PRE_IN, WRITE_AUX, PIN)
        _stamp(ws, row, 3, ticket, TRACE)
    else:
        # every other role waits (acquire) for the S slice CTAs first
        _wait_and_check_in(ctr, S, waiters)
        _stamp(ws, row, 3, ticket, TRACE)
        if ticket < S + NG * num_tokens:
            i = ticket - S
            if DELAYED:
                _norm_group_role(i // NG, i % NG, ws, norm_w, layer_input, norm_eps, H, CH,
                                 S_PAD, NB)
            else:
                _norm_row_role(i, ws, hc_scale, hc_base, residual_out, norm_w, layer_input,
                               rms_eps, hc_pre_eps, norm_eps, H, CH, S_PAD, CB, PICKS)
        else:
            _coef_role(ticket - S - NG * num_tokens, ws, hc_scale, hc_base, post_out,
                       comb_out, pre_out, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult,
                       H, CH, S_PAD, SINKHORN, DELAYED, row, TRACE, PICKS)
        _stamp(ws, row, 6, ticket, TRACE)


# ----------------------------------------------------------------------------- host side
@dataclasses.dataclass(frozen=True)
class DecodeKey:
    """One compile of the kernel (its constexprs; the launch passes num_warps=NUM_WARPS)."""
    hidden: int
    ch: int
    block_t: int
    sinkhorn: int
    delayed: bool
    use_pre_in: bool
    write_aux: bool

    @property
    def slices(self) -> int:
        return self.hidden // self.ch

    @property
    def norm_ctas(self) -> int:
        """Norm CTAs per token (V4.1: one per NORM_BLOCK columns; V4: one per row)."""
        return -(-self.hidden // self.constexprs()["NB"]) if self.delayed else 1

    def grid(self, num_tokens: int) -> int:
        return self.slices + (self.norm_ctas + 1) * num_tokens

    def constexprs(self) -> dict:
        return dict(H=self.hidden, CH=self.ch, S_PAD=triton.next_power_of_2(self.slices),
                    BT=self.block_t, NB=min(NORM_BLOCK, triton.next_power_of_2(self.hidden)),
                    CB=min(COL_BLOCK, triton.next_power_of_2(self.hidden)),
                    SINKHORN=self.sinkhorn, DELAYED=self.delayed, USE_PRE_IN=self.use_pre_in,
                    WRITE_AUX=self.write_aux, PIN=True, TRACE=False, PICKS=SCRATCH_PICKS)

    @property
    def name(self) -> str:
        form = ("v41" + ("" if self.use_pre_in else ".entry") + (".aux" if self.write_aux else "")
                if self.delayed else "v4")
        return f"{form}.h{self.hidden}.ch{self.ch}.bt{self.block_t}"


def supported_hidden(hidden: int) -> bool:
    return 0 < hidden <= MAX_HIDDEN and hidden % 256 == 0


def slice_columns(hidden: int, sm_count: int, block_t: int = BLOCK_T[0]) -> int:
    """Columns per k-slice the Ampere path dispatches: 32 (hidden / 32 = 128-224 slices at
    4096-7168, at least one per SM on every Ampere GPU and the H200). ``sm_count`` and
    ``block_t`` are the inputs a measured rule would read; none has been measured yet."""
    return SLICE_COLUMNS[0]


def block_t_for(num_tokens: int) -> int:
    return BLOCK_T[0] if num_tokens <= BLOCK_T[0] else BLOCK_T[1]


def key_for(num_tokens: int, hidden: int, sm_count: int, *, sinkhorn: int, delayed: bool,
            use_pre_in: bool = True, write_aux: bool = False, ch: int | None = None) -> DecodeKey:
    bt = block_t_for(num_tokens)
    return DecodeKey(hidden=hidden, ch=ch or slice_columns(hidden, sm_count, bt),
                     block_t=bt, sinkhorn=int(sinkhorn),
                     delayed=bool(delayed), use_pre_in=bool(use_pre_in) if delayed else False,
                     write_aux=bool(write_aux) if delayed else False)


def enabled() -> bool:
    """The ``mhc`` and ``mhc_decode`` features (routing decisions, cached per process)."""
    from vllm.deepinfer import mhc
    return routing.use(mhc.FEATURE) and routing.use(FEATURE)


_WORKSPACES: dict = {}
# The workspace: the records (32 floats per token and slice, up to MAX_TOKENS tokens and the
# slices of MAX_HIDDEN), then the phase stamps (int64, TRACE only) at int64 index _TRACE_BASE,
# then the scratch rows (_SCRATCH_BASE).
_RECORD_FLOATS = MAX_TOKENS * triton.next_power_of_2(MAX_HIDDEN // SLICE_COLUMNS[0]) * REC.value
_TRACE_BASE = tl.constexpr(_RECORD_FLOATS // 2)
# Then the scratch rows of SCRATCH_PICKS (REC floats each: 2t for token t's coefficient CTA,
# 2t + 1 for V4's norm CTA), in floats.
_SCRATCH_BASE = tl.constexpr(_RECORD_FLOATS + 2 * TRACE_ROWS * TRACE_COLS.value)
_SCRATCH_FLOATS = 2 * MAX_TOKENS * REC.value


def _workspace(device):
    """(records, counters) of the launches on this device's current stream. The counters
    start at zero and every launch leaves them at zero (its last waiter resets them)."""
    import torch
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    got = _WORKSPACES.get(key)
    if got is None:
        got = _WORKSPACES[key] = (
            torch.empty(_SCRATCH_BASE.value + _SCRATCH_FLOATS, dtype=torch.float32,
                        device=device),
            torch.zeros(4, dtype=torch.int32, device=device))
    return got


def _aligned(*tensors) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _fits(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, norm_weight,
          sinkhorn_repeat, pre_mix=None) -> bool:
    """Whether this call is one the kernel covers (otherwise upstream's path runs)."""
    import torch
    if residual.dim() < 3 or residual.shape[-2] != HC:
        return False
    hidden = residual.shape[-1]
    tokens = residual.numel() // (HC * hidden) if hidden else 0
    if not (0 < tokens <= MAX_TOKENS) or not supported_hidden(hidden) or sinkhorn_repeat < 1:
        return False
    if not enabled():
        return False
    if not (residual.is_cuda or (residual.device.type == "cpu" and arch.interpreting())):
        return False
    tensors = [x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, norm_weight]
    if pre_mix is not None:
        tensors.append(pre_mix)
    if norm_weight is None or any(t is None for t in tensors):
        return False
    if (x.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16
            or norm_weight.dtype != torch.bfloat16 or norm_weight.numel() != hidden
            or fn.dtype != torch.float32 or fn.shape != (N_OUT, HC * hidden)
            or x.numel() != tokens * hidden or post_layer_mix.numel() != tokens * HC
            or comb_res_mix.numel() != tokens * HC * HC
            or any(t.dtype != torch.float32 for t in (post_layer_mix, comb_res_mix, hc_scale,
                                                      hc_base))
            or (pre_mix is not None and (pre_mix.dtype != torch.float32
                                         or pre_mix.numel() != tokens * HC))):
        return False
    return (all(t.is_contiguous() and t.device == residual.device for t in tensors)
            and _aligned(*tensors))


@functools.cache
def _log_variant(key: DecodeKey) -> None:
    """Once per variant: which kernel the boundary runs (INFO, the ``vllm.deepinfer`` logger)."""
    form = "V4.1 shifted post + pre" if key.delayed else "V4 fused post + pre"
    logger.info("deepinfer: mHC decode kernel %s (one Triton launch) for %s: hidden %d, "
                "up to %d tokens, %d k-slices of %d columns, %d norm + 1 Sinkhorn CTAs per "
                "token (DEEPINFER_MHC_DECODE=0 restores upstream's two TileLang launches)",
                key.name, form, key.hidden, key.block_t, key.slices, key.ch, key.norm_ctas)


def _launch(key: DecodeKey, tokens: int, x, residual, post_layer_mix, comb_res_mix, fn,
            hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
            pre_mix, norm_weight, norm_eps, capture_aux):
    import torch
    dev = residual.device
    hidden = key.hidden
    residual_out = torch.empty(tokens, HC, hidden, dtype=torch.bfloat16, device=dev)
    post = torch.empty(tokens, HC, dtype=torch.float32, device=dev)
    comb = torch.empty(tokens, HC * HC, dtype=torch.float32, device=dev)
    layer_input = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=dev)
    next_pre = torch.empty(tokens, HC, dtype=torch.float32, device=dev) if key.delayed else post
    aux = torch.empty(tokens if capture_aux else 0, hidden, dtype=torch.bfloat16, device=dev)
    ws, ctr = _workspace(dev)
    _log_variant(key)
    _mhc_decode_kernel[(key.grid(tokens),)](
        x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base,
        pre_mix if pre_mix is not None else post_layer_mix, norm_weight, residual_out, post,
        comb, layer_input, next_pre, aux if capture_aux else layer_input, ws, ctr, tokens,
        float(rms_eps), float(hc_pre_eps), float(hc_sinkhorn_eps), float(hc_post_mult_value),
        float(norm_eps), **dict(key.constexprs(), PIN=not arch.interpreting(),
                                TRACE=TRACE_PHASES),
        num_warps=NUM_WARPS)
    return residual_out, post, comb, layer_input, next_pre, aux


def _sm_count(device) -> int:
    return arch.sm_count(device) if device.type == "cuda" else 108  # interpreter: an A100


def delayed(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps,
            hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, pre_mix=None,
            norm_weight=None, norm_eps=1e-6, capture_aux=False, *, ch: int | None = None):
    """Patch 0030: ``mhc_fused_post_pre_delayed_tilelang`` (V4.1) in one launch, or None.

    Returns upstream's tuple: residual streams [T, 4, H] bf16, post [T, 4, 1], comb
    [T, 4, 4], layer input [T, H] bf16, next pre-mix [T, 4], aux [T or 0, H] bf16."""
    if not _fits(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, norm_weight,
                 sinkhorn_repeat, pre_mix):
        return None
    tokens, _, hidden = residual.shape
    key = key_for(tokens, hidden, _sm_count(residual.device), sinkhorn=sinkhorn_repeat,
                  delayed=True, use_pre_in=pre_mix is not None, write_aux=capture_aux, ch=ch)
    res, post, comb, li, nxt, aux = _launch(
        key, tokens, x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base,
        rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, pre_mix, norm_weight,
        norm_eps, capture_aux)
    return res, post.unsqueeze(-1), comb.view(tokens, HC, HC), li, nxt, aux


def fused(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps,
          hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_weight=None,
          norm_eps=1e-6, *, ch: int | None = None):
    """Patch 0030: ``mhc_fused_post_pre_tilelang`` (V4) in one launch, or None.

    Returns upstream's tuple with the caller's leading shape: residual streams
    [..., 4, H] bf16, post [..., 4, 1], comb [..., 4, 4], layer input [..., H] bf16."""
    if not _fits(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, norm_weight,
                 sinkhorn_repeat):
        return None
    outer = residual.shape[:-2]
    hidden = residual.shape[-1]
    tokens = residual.numel() // (HC * hidden)
    key = key_for(tokens, hidden, _sm_count(residual.device), sinkhorn=sinkhorn_repeat,
                  delayed=False, ch=ch)
    res, post, comb, li, _, _ = _launch(
        key, tokens, x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base,
        rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, None, norm_weight, norm_eps,
        False)
    return (res.view(*outer, HC, hidden), post.view(*outer, HC, 1),
            comb.view(*outer, HC, HC), li.view(*outer, hidden))


# ----------------------------------------------------------------------------- warmup, gate
def warmup_keys(hidden: int, max_tokens: int, sm_counts, *, sinkhorn: int, delayed: bool,
                use_pre_in: bool = True, write_aux: bool = False) -> list[DecodeKey]:
    """Every key a batch of 1..min(max_tokens, MAX_TOKENS) tokens can take on these SMs."""
    if not supported_hidden(hidden) or max_tokens < 1:
        return []
    out: list[DecodeKey] = []
    for sm in sm_counts:
        for t in range(1, min(max_tokens, MAX_TOKENS) + 1):
            k = key_for(t, hidden, sm, sinkhorn=sinkhorn, delayed=delayed,
                        use_pre_in=use_pre_in, write_aux=write_aux)
            if k not in out:
                out.append(k)
    return out


SIGNATURE = {
    "x": "*bf16", "residual": "*bf16", "post_in": "*fp32", "comb_in": "*fp32", "fn": "*fp32",
    "hc_scale": "*fp32", "hc_base": "*fp32", "pre_in": "*fp32", "norm_w": "*bf16",
    "residual_out": "*bf16", "post_out": "*fp32", "comb_out": "*fp32", "layer_input": "*bf16",
    "pre_out": "*fp32", "aux_out": "*bf16", "ws": "*fp32", "ctr": "*i32", "num_tokens": "i32",
    "rms_eps": "fp32", "hc_pre_eps": "fp32", "hc_sinkhorn_eps": "fp32", "hc_post_mult": "fp32",
    "norm_eps": "fp32", "H": "constexpr", "CH": "constexpr", "S_PAD": "constexpr",
    "BT": "constexpr", "NB": "constexpr", "CB": "constexpr", "SINKHORN": "constexpr",
    "DELAYED": "constexpr", "USE_PRE_IN": "constexpr", "WRITE_AUX": "constexpr",
    "PIN": "constexpr", "TRACE": "constexpr", "PICKS": "constexpr",
}


def compile_key(key: DecodeKey) -> None:
    """Compile ``key`` for the current GPU without launching it (vLLM's JIT warmup): the
    arguments as the launcher passes them (16-byte-aligned pointers, num_tokens
    unspecialized, fp32 scalars)."""
    import torch
    args = []
    for name, ty in SIGNATURE.items():
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            args.append({"bf16": torch.bfloat16, "fp32": torch.float32,
                         "i32": torch.int32}[ty[1:]])
        elif ty == "fp32":
            args.append(1.5)
        else:
            args.append(16)
    _mhc_decode_kernel.warmup(*args, grid=(1,), num_warps=NUM_WARPS, **key.constexprs())


# The compile gate (vllm.deepinfer.compile_gate, sm_80 and sm_86) builds what the Ampere path
# dispatches (32-column slices): both forms in the 32-token class, the heavier one (two
# 16-token groups per slice), at every served hidden size; at 5120 also the 16-token class
# and V4.1's model-entry and aux variants. 10 specs, 20 builds (about a minute from an empty
# Triton cache on the 2-core CPU machine).
GATE_HIDDEN = (4096, 5120, 7168)
GATE_SINKHORN = 20


def gate_keys() -> list[DecodeKey]:
    out = [key_for(BLOCK_T[1], h, 108, sinkhorn=GATE_SINKHORN, delayed=dl)
           for h in GATE_HIDDEN for dl in (True, False)]
    out += [key_for(BLOCK_T[0], 5120, 108, sinkhorn=GATE_SINKHORN, delayed=dl)
            for dl in (True, False)]
    out.append(key_for(1, 5120, 108, sinkhorn=GATE_SINKHORN, delayed=True, use_pre_in=False))
    out.append(key_for(1, 5120, 108, sinkhorn=GATE_SINKHORN, delayed=True, write_aux=True))
    return out


def _register() -> None:
    for key in gate_keys():
        compile_gate.register(compile_gate.GateSpec(
            name=f"mhc_decode.{key.name}", kernel=_mhc_decode_kernel, signature=dict(SIGNATURE),
            constexprs=key.constexprs(), variants=("sm80",), num_warps=NUM_WARPS,
            num_stages=2, feature=FEATURE, aligned_pointers=True))


_register()
