"""Sparse MLA prefill over the gathered bf16 keys (DeepSeek-V4.1/V4 on the Ampere path).

Replaces upstream vLLM 0.33.0's ``_rocm_sparse_attn_prefill_triton`` (dense indices ->
``build_ragged_indices_from_dense`` -> ``_sparse_attn_prefill_ragged_kernel``, grid (T,
cdiv(H, 16)), BLOCK_H 16, BLOCK_K 16, 4 warps) and ``_rocm_sparse_attn_prefill_ragged_triton``;
the arguments mean what they mean there. Per query token and head: attend over the token's
key list (rows of the bf16 workspace ``kv`` [rows, 512] that the gather filled: top-k
compressed rows, then the SWA window), keys and values being the same 512-dim rows, with the
per-head attention sink in the softmax denominator.

What differs from upstream:

* sm90: one program owns all 64 heads of a token on wgmma, so every key tile it loads
  serves all of them (upstream: 16 heads per program on mma.sync, each 64-head token reading
  every key row four times). The programs of one token are adjacent in the grid, so the head
  tiles of a 128-head token share key rows through L2.
* sm80/sm86: 16 heads per program (the 48 KiB budget) on 2 warps, so the 16 x 16 score
  tile is exactly the two warps' n8 columns and no warp repeats another's QK^T mma
  (upstream's 4 warps compute it twice). ``Tile.split_d`` (the 512 dims split across the
  warps) is the other form; the H200 sweep put the 2-warp plain form ahead (``TILES``).
* Dense indices are read as they are: row t's keys are ``indices[t, :lens[t]]`` (entries < 0
  or >= rows skipped), the same set upstream's dense -> ragged compaction keeps, without its
  two kernels and cumsum. Ragged (indices, indptr) is accepted too.
* Alignment is proven to the compiler (``ALIGNED``: the host checked 16-byte aligned bases
  and strides), so key rows load as 16-byte vectors through ``cp.async`` and Triton's
  software pipeliner overlaps the next key tile's gather with the current tile's math.
* Softmax in the exp2 domain (scale * log2(e) folded into one multiply).

Semantics kept from upstream (tests/test_sparse_mla_prefill.py runs both): entries < 0 or >= rows are skipped; a row with no valid key gives zeros; a
(token, head) whose softmax sum is not a positive number — a NaN or infinite key or query
entry makes it NaN — gives zeros (upstream's ``where(l > 0, ..., 0)``, its only NaN scrub:
the prefill does not zero NaN key entries the way the decode does); ``out`` may be 448 wide
(NoPE dims only) or 512.

Keys come from the gathered bf16 workspace, not straight from the 584-byte records: on the
committed one-layer H200 runs the gather is 15-18 us of a 1.9 ms prefill stage (<1%), and
reading records here would put an e4m3 decode of every key element into each program's inner
loop (software decode on sm80; kernels/kv_gather.py compares the decoders), repeated by
every head tile that reads the row.
docs/sparse-mla-prefill.md has the tile choices and their compile-gate figures.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from vllm.deepinfer import arch
from vllm.deepinfer.compile_gate import GateSpec, register
from vllm.deepinfer.kernels import sparse_mla_prefill_gluon as glp
from vllm.deepinfer.kernels.checks import (FLOAT_DTYPES, INDEX_DTYPES, check, check_mla_query,
                                           check_tensor)
from vllm.deepinfer.kernels.qk_halves import halves_start, halves_step
from vllm.deepinfer.kv_record import HEAD_DIM, NOPE_DIM, ROPE_DIM
from vllm.deepinfer.kv_record import TL_HEAD_DIM as _D  # 512 columns per key row and query

__all__ = ["sparse_attn_prefill", "launch_plan", "covers", "gate_constexprs", "Tile", "TILES",
           "GATE_VARIANTS", "gluon_ws_spec", "uses_gluon_ws"]

FEATURE = "sparse_mla_prefill"
# Softmax runs in the exp2 domain: scores are multiplied by scale * log2(e) once, the sink by
# log2(e).
LOG2E = tl.constexpr(1.4426950408889634)
# Finite "minus infinity" for masked scores and the running max (upstream's value): a row
# that has seen no valid key keeps m = NEG_LARGE and exp2(m - m) = 1 stays finite, where
# -inf would give inf - inf = NaN.
NEG_LARGE = tl.constexpr(-3.4028234663852886e38)
# The smallest softmax denominator upstream divides by (its 1.0e-30 clamp).
MIN_DENOM = tl.constexpr(1.0e-30)
# bf16 elements per 16 bytes: the alignment (in elements) ALIGNED promises for every row
# start of q, kv and out.
_VEC = 8


@dataclasses.dataclass(frozen=True)
class Tile:
    block_h: int      # heads of one token per program (the Q tile is [block_h, 512] bf16)
    block_n: int      # keys per tile (the key tile is [block_n, 512] bf16, stored once)
    num_warps: int
    num_stages: int   # Triton software-pipeline stages of the key loop
    # 1: the plain form (Q [block_h, 512] x K^T, then P x V; wgmma on sm90). > 1: the
    # 512 dims are cut into split_d slices of 512 / split_d, one per warp (a batched dot
    # whose batch is the slice): each warp reads only its slice of Q and of the key tile,
    # the partial scores are summed across warps, and each warp accumulates its slice of
    # the output. Needs num_warps == split_d (mma.sync only: Triton has no batched wgmma).
    split_d: int = 1
    # Key-loop knobs for the sm90 sweep (benchmarks/diag/sweep_prefill.py); the defaults
    # compile to the same code as before they existed. warp_spec: tl.range(warp_specialize=)
    # (Triton's automatic warp specialization; its hopper pass). unroll: tl.range(
    # loop_unroll_factor=) (0: not set). loop_stages: tl.range(num_stages=), which pipelines
    # the loop's other loads too (the index list), not only the dot operands (0: not set; the
    # kernel's num_stages applies).
    warp_spec: bool = False
    unroll: int = 0
    loop_stages: int = 0
    # > 0: deferred rescale (FlashAttention-3/4's trick). The running max m moves only when a
    # key tile's max exceeds it by more than rescale_tau (log2 units), and the accumulator and
    # sum are rescaled only in iterations where some row's max moved (one branch per tile);
    # otherwise p = exp2(s - m) with the stale m, at most 2^rescale_tau. The epilogue divides
    # by the sum taken with the same m, so the result is the same softmax (rounding aside:
    # bf16 p keeps its relative precision at any magnitude). 0: rescale every tile.
    rescale_tau: float = 0.0
    # Plain form only: Q.K^T as two dots over dims [0, 256) and [256, 512) with their own
    # accumulators, and the output in two halves. mma.sync chains one dot's 32 k-steps
    # through one accumulator; two halves give the scheduler two independent chains (the
    # two-phase Ampere decode's Tile.qk_halves, measured there first).
    qk_halves: bool = False
    # Hopper: run kernels/sparse_mla_prefill_gluon.py (producer and consumer warpgroups,
    # 64 heads x 64-key blocks) instead of the Triton kernel. The other fields then describe
    # the Triton tile a launch falls back to where that kernel cannot run (no Gluon, the
    # interpreter, a GPU below sm_90, unaligned rows); ``uses_gluon_ws`` decides.
    gluon_ws: bool = False
    # gluon_ws only: one program per SM looping over (token, head tile) work items (the
    # Gluon kernel's PERSISTENT), or one program per item.
    persistent: bool = True

    def __post_init__(self):
        if self.qk_halves and (self.split_d != 1 or self.rescale_tau):
            raise ValueError(f"Tile: qk_halves needs split_d 1 (the plain form) and no "
                             f"rescale_tau, got split_d {self.split_d}, rescale_tau "
                             f"{self.rescale_tau}")


# Tile table keyed by variant (docs/sparse-mla-prefill.md: compile-gate figures and why).
# Ampere, 48 KiB per CTA: Q [16, 512] bf16 (16 KiB) stays in shared memory and the key tile
# (16 KiB) is stored once (Triton's cp.async pipeline); 32 heads or 32 keys would need a
# second 16 KiB. Chosen from benchmarks/results/archive/h200-2026-12-01-sweep-prefill-4ab26c8.json.
# Its timings are H200 timings of these sm_80-targeted tiles (Triton built them for sm_90,
# the H200's target; no Ampere GPU has run them), x upstream's kernel at T=2048 / 64 heads,
# T=2048 / 128 heads, T=512 / top-k 8192:
#   plain, 2 warps, split_d 1 (this tile)   1.15 / 1.16 / 1.17x  (1654 / 3245 / 5181 us)
#   split_d 2, 2 warps                      1.11 / 1.12 / 1.12x  (1723 / 3376 / 5419 us)
#   plain, 4 warps                          0.99 / 1.00 / 0.98x
#   split_d 4, 4 warps (previous tile)      0.80 / 0.81 / 0.82x
# The same tile for sm80 and sm86. Its compile-gate figures: sm_80 255 registers and 8 bytes
# of stack, sm_86 254 and none. The sm_80 stack is two values parked once per program (2 STL
# before the key loop, 2 LDL after it), none inside the loop, and the timed sm_90 build of
# the tile parks more (13 STL / 12 LDL, also outside the loop), so that spill is not a reason
# to take split_d 2 (255 / 239 registers, no stack, 3-4% slower) on sm80. Caveats: 255
# registers leaves sm_80 no headroom (re-run sweep_prefill.py --gate-only after a Triton
# update); and on sm86 (100 KiB of shared memory per SM) 33 KiB per CTA fits 2 CTAs = 4
# warps per SM, half the 8 the H200 run had, which no measurement covers yet.
# Why 2 warps: the 16 x 16 score tile is exactly two warps' n8 columns, so no QK^T mma is
# repeated; per key x 64 heads the sm_80 loop is 376 instructions, 32 HMMA, 32.5 ldmatrix
# (4-warp plain: 497, 48, 57; split_d 4: 480, 32, 24, plus the cross-warp sum of the
# partial scores through shared memory). tools/a100_model.py has no prefill workload; driven
# by hand for these launches it misranks the sweep's tiles on the H200 (split_d forms off by
# -62% to +38%), so no A100 prediction decided this (docs/sparse-mla-prefill.md).
# qk_halves on: the sweep of 3a8606c (benchmarks/results/h200-2026-12-01-sweep-prefill-
# 3a8606c.json, same shapes) ran it at 1.38 / 1.40 / 1.45x upstream (1387 / 2695 / 4173 us)
# against 1.16 / 1.16 / 1.17x without; its sm_80 loop is 619 instructions per warp and tile
# against 752 (same HMMA and ldmatrix counts, about half the address arithmetic), 40 B of
# stack outside the loop (8 B without).
_AMPERE = Tile(block_h=16, block_n=16, num_warps=2, num_stages=2, split_d=1, qk_halves=True)
TILES: dict[str, Tile] = {
    "sm80": _AMPERE,
    "sm86": _AMPERE,
    # Interpreter (CPU tensors): the sm80 tile.
    "cpu": _AMPERE,
    # Ada: mma.sync like Ampere, 99 KiB per block. Not measured: the Ampere tile.
    "sm89": _AMPERE,
    # Hopper: the Gluon producer/consumer kernel (kernels/sparse_mla_prefill_gluon.py: 64
    # heads x 64-key blocks, a producer warpgroup gathering, two consumer warpgroups on
    # alternate blocks, one program per SM looping over (token, head tile) items). H200
    # sweep at 7ee19c4 (benchmarks/results/h200-2026-12-01-sweep-prefill-gws-7ee19c4.json;
    # T=2048 after 64K with top-k 512 + 128 at 64 / 128 heads, T=512 after 1M with top-k
    # 8192, T=2048 after 8K with top-k 8192 (208-key lists)): 438 / 845 / 1018 / 249 us,
    # 57 / 59 / 80 / 33% of the bf16 matmul rate; one program per item 458 / 892 / 1001 /
    # 256 us; the Triton tile 799 / 1577 / 2168 / 375 us. The other fields are the Triton
    # tile it falls back to (``uses_gluon_ws``).
    "sm90": Tile(block_h=64, block_n=64, num_warps=8, num_stages=2, gluon_ws=True),
    # The Triton tile alone (the sm90 row until the Gluon kernel): one program owns 64 heads
    # (wgmma's M), Q [64, 512] 64 KiB + two 64-key stages of 64 KiB = 197 KiB of 227, 8 warps
    # (two warpgroups split the 512 output columns: 128 accumulator registers each), no
    # spills.
    "sm90-triton": Tile(block_h=64, block_n=64, num_warps=8, num_stages=2),
    # Blackwell 10.x/12.x, not measured: 99 KiB per block (12.x) rules out the Hopper tile;
    # the Ampere tile fits.
    "sm100": _AMPERE,
}


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _key_list(ptr_ptr, tok, idx_stride0, width, DENSE: tl.constexpr):
    """(first index entry, key count) of token ``tok``'s list."""
    if DENSE:
        start = tok * idx_stride0
        n = tl.minimum(tl.maximum(tl.load(ptr_ptr + tok), 0), width).to(tl.int32)
    else:
        start = tl.load(ptr_ptr + tok).to(tl.int64)
        n = (tl.load(ptr_ptr + tok + 1) - start).to(tl.int32)
    return start, n


@triton.jit
def _key_rows(idx_ptr, start, k0, n, kv_ptr, kv_stride0, num_rows, ALIGNED: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Row pointers of keys k0 .. k0 + BLOCK_N of the list (invalid ones: row 0) and their
    validity (inside the list, 0 <= slot < num_rows)."""
    j = k0 + tl.arange(0, BLOCK_N)
    slot = tl.load(idx_ptr + start + j, mask=j < n, other=-1)
    valid = (slot >= 0) & (slot < num_rows)
    rows = kv_ptr + tl.where(valid, slot, 0).to(tl.int64) * kv_stride0
    if ALIGNED:  # host checked: base 16-byte aligned, row stride a multiple of 8 elements
        rows = tl.multiple_of(rows, [16])
    return rows, valid


@triton.jit
def _row_scale(m_i, l_i, sink_ptr, heads, hmask, HAS_SINK: tl.constexpr):
    """Upstream's epilogue as one factor per row: the sink joins the denominator; output =
    acc * factor where the sum is positive, else 0 (no valid key, or a NaN sum)."""
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * LOG2E
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        l_f = l_i * alpha + tl.exp2(sink - m_f)
        factor = alpha / tl.maximum(l_f, MIN_DENOM)
    else:
        l_f = l_i
        factor = 1.0 / tl.maximum(l_f, MIN_DENOM)
    return factor, l_f > 0.0


@triton.jit
def _attend_halves(q_rows, out_rows, kv_ptr, idx_ptr, start, n, kv_stride0, num_rows, sink_ptr,
                   heads, hmask, qk_scale, HAS_SINK: tl.constexpr, OUT_D: tl.constexpr,
                   DOT_FP32: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_N: tl.constexpr, LOOP_STAGES: tl.constexpr, UNROLL: tl.constexpr,
                   WARP_SPEC: tl.constexpr):
    """The plain form's key loop and epilogue with Q, the keys and the output split at dim
    256 (``Tile.qk_halves``; the step is kernels/qk_halves.py's)."""
    HD: tl.constexpr = _D // 2
    hc = tl.arange(0, HD)
    qa, qb, m_i, l_i, acc_a, acc_b = halves_start(q_rows, hmask, DOT_FP32, BLOCK_H)
    for k0 in tl.range(0, n, BLOCK_N, num_stages=LOOP_STAGES, loop_unroll_factor=UNROLL,
                       warp_specialize=WARP_SPEC):
        rows, valid = _key_rows(idx_ptr, start, k0, n, kv_ptr, kv_stride0, num_rows, ALIGNED,
                                BLOCK_N)
        ka = tl.load(rows[:, None] + hc[None, :], mask=valid[:, None], other=0.0)
        kb = tl.load(rows[:, None] + HD + hc[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc_a, acc_b = halves_step(qa, qb, ka, kb, valid, m_i, l_i, acc_a, acc_b,
                                             qk_scale, DOT_FP32)
    factor, ok = _row_scale(m_i, l_i, sink_ptr, heads, hmask, HAS_SINK)
    oa = tl.where(ok[:, None], acc_a * factor[:, None], 0.0)
    ob = tl.where(ok[:, None], acc_b * factor[:, None], 0.0)
    dt = out_rows.dtype.element_ty
    tl.store(out_rows[:, None] + hc[None, :], oa.to(dt),
             mask=hmask[:, None] & (hc[None, :] < OUT_D))
    tl.store(out_rows[:, None] + HD + hc[None, :], ob.to(dt),
             mask=hmask[:, None] & (HD + hc[None, :] < OUT_D))


# Integers whose runtime values are not multiples of 16 in production (workspace rows, the
# head count per rank, head tiles 1/2/4/8) stay unspecialized, so one compile (and the JIT
# warmup's key) serves every value; strides and the dense row width are multiples of 16.
@triton.jit(do_not_specialize=["num_rows", "num_heads", "head_tiles"])
def _sparse_mla_prefill_kernel(
    q_ptr, kv_ptr, idx_ptr, ptr_ptr, sink_ptr, out_ptr,
    q_stride0, q_stride1, kv_stride0, idx_stride0, out_stride0, out_stride1,
    num_rows, num_heads, head_tiles, width, qk_scale,
    DENSE: tl.constexpr, HAS_SINK: tl.constexpr, OUT_D: tl.constexpr, DOT_FP32: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_D: tl.constexpr, WARP_SPEC: tl.constexpr = False, UNROLL: tl.constexpr = None,
    LOOP_STAGES: tl.constexpr = None, RESCALE_TAU: tl.constexpr = 0.0,
    QK_HALVES: tl.constexpr = False,
):
    """Grid (tokens * head_tiles,): program p owns head tile p % head_tiles of token
    p // head_tiles (the head tiles of a token are adjacent). ``qk_scale`` = softmax scale *
    log2(e).

    DENSE: row t's keys are ``idx[t * idx_stride0 + j]`` for j < clamp(lens[t], 0, width)
    (``ptr_ptr`` = lens); else ragged, ``idx[indptr[t] + j]`` for j < indptr[t+1] - indptr[t]
    (``ptr_ptr`` = indptr). SPLIT_D, WARP_SPEC, UNROLL, LOOP_STAGES, RESCALE_TAU, QK_HALVES:
    ``Tile``'s split_d, warp_spec, unroll, loop_stages, rescale_tau (0 as None), qk_halves
    (plain form only: then its key loop is ``_attend_halves``). DOT_FP32
    is an interpreter-only switch: the Triton interpreter computes bf16 ``tl.dot`` on raw
    bit patterns, so there the dots take fp32 operands.
    """
    D: tl.constexpr = _D
    C: tl.constexpr = D // SPLIT_D           # columns per slice
    pid = tl.program_id(0)
    tok = (pid // head_tiles).to(tl.int64)
    pid_h = pid % head_tiles
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    # The split form's columns as (slice, column in slice): [SPLIT_D, 1, C] offsets (the
    # plain form uses tl.arange(0, D) instead).
    cols3 = tl.arange(0, SPLIT_D)[:, None, None] * C + tl.arange(0, C)[None, None, :]

    q_rows = q_ptr + tok * q_stride0 + heads.to(tl.int64) * q_stride1
    out_rows = out_ptr + tok * out_stride0 + heads.to(tl.int64) * out_stride1
    if ALIGNED:  # host checked: bases 16-byte aligned, strides multiples of 8 elements
        q_rows = tl.multiple_of(q_rows, [16])
        out_rows = tl.multiple_of(out_rows, [16])
    start, n = _key_list(ptr_ptr, tok, idx_stride0, width, DENSE)
    m_i = tl.full((BLOCK_H,), NEG_LARGE, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)

    if QK_HALVES:
        tl.static_assert(SPLIT_D == 1, "qk_halves needs the plain form")
        _attend_halves(q_rows, out_rows, kv_ptr, idx_ptr, start, n, kv_stride0, num_rows,
                       sink_ptr, heads, hmask, qk_scale, HAS_SINK, OUT_D, DOT_FP32, ALIGNED,
                       BLOCK_H, BLOCK_N, LOOP_STAGES, UNROLL, WARP_SPEC)
        return
    if SPLIT_D == 1:
        cols = tl.arange(0, D)
        q = tl.load(q_rows[:, None] + cols[None, :], mask=hmask[:, None], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        acc = tl.zeros((BLOCK_H, D), tl.float32)
    else:
        # Q as [slice, head, column in slice]: warp w owns slice w.
        q = tl.load(q_rows[None, :, None] + cols3, mask=hmask[None, :, None], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        acc = tl.zeros((SPLIT_D, BLOCK_H, C), tl.float32)

    for k0 in tl.range(0, n, BLOCK_N, num_stages=LOOP_STAGES, loop_unroll_factor=UNROLL,
                       warp_specialize=WARP_SPEC):
        rows, valid = _key_rows(idx_ptr, start, k0, n, kv_ptr, kv_stride0, num_rows, ALIGNED,
                                BLOCK_N)
        if SPLIT_D == 1:
            k = tl.load(rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k))
        else:
            k = tl.load(rows[None, :, None] + cols3, mask=valid[None, :, None], other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.sum(tl.dot(q, tl.permute(k, (0, 2, 1))), axis=0)  # partial QK^T per slice
        s = tl.where(valid[None, :], s * qk_scale, NEG_LARGE)
        if RESCALE_TAU > 0:
            m_blk = tl.max(s, axis=1)
            grow = m_blk > m_i + RESCALE_TAU  # False for NaN: p is NaN, so the row is too
            if tl.max(grow.to(tl.int32), axis=0) > 0:
                m_new = tl.where(grow, m_blk, m_i)
                alpha = tl.exp2(m_i - m_new)  # exactly 1 for the rows that keep their m
                l_i = l_i * alpha
                if SPLIT_D == 1:
                    acc = acc * alpha[:, None]
                else:
                    acc = acc * alpha[None, :, None]
                m_i = m_new
            p = tl.exp2(s - m_i[:, None])
            p = tl.where(valid[None, :], p, 0.0)
            l_i = l_i + tl.sum(p, axis=1)
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            p = tl.where(valid[None, :], p, 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if SPLIT_D == 1:
                acc = acc * alpha[:, None]
            else:
                acc = acc * alpha[None, :, None]
            m_i = m_new
        if not DOT_FP32:
            p = p.to(tl.bfloat16)
        if SPLIT_D == 1:
            acc = tl.dot(p, k, acc)
        else:
            acc = tl.dot(tl.broadcast_to(p[None, :, :], (SPLIT_D, BLOCK_H, BLOCK_N)), k, acc)

    factor, ok = _row_scale(m_i, l_i, sink_ptr, heads, hmask, HAS_SINK)
    if SPLIT_D == 1:
        o = tl.where(ok[:, None], acc * factor[:, None], 0.0)
        tl.store(out_rows[:, None] + cols[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=hmask[:, None] & (cols[None, :] < OUT_D))
    else:
        o = tl.where(ok[None, :, None], acc * factor[None, :, None], 0.0)
        tl.store(out_rows[None, :, None] + cols3, o.to(out_ptr.dtype.element_ty),
                 mask=hmask[None, :, None] & (cols3 < OUT_D))


# ----------------------------------------------------------------------------- host side
_BF16 = (torch.bfloat16,)


def covers(q, kv, output, nope_head_dim: int, rope_head_dim: int) -> bool:
    """Whether our kernel takes this call (the routing asks; False: upstream runs it):
    bf16 query, workspace and output, 512-dim rows split 448 + 64, last dims contiguous."""
    return (q.dtype == kv.dtype == output.dtype == torch.bfloat16
            and q.dim() == 3 and q.shape[-1] == HEAD_DIM and kv.shape[-1] == HEAD_DIM
            and nope_head_dim == NOPE_DIM and rope_head_dim == ROPE_DIM
            and output.dim() == 3 and output.shape[-1] in (NOPE_DIM, HEAD_DIM)
            and q.stride(-1) == 1 and kv.stride(-1) == 1 and output.stride(-1) == 1)


def launch_plan(heads: int, tile: Tile) -> tuple[int, int]:
    """(heads per program, head tiles per token)."""
    # Fewer heads than the tile: shrink it (tl.dot needs at least 16 rows).
    block_h = max(16, min(tile.block_h, triton.next_power_of_2(max(heads, 1))))
    return block_h, triton.cdiv(heads, block_h)


def _aligned(*tensors_and_strides) -> bool:
    return all(t.data_ptr() % 16 == 0 and all(s % _VEC == 0 for s in strides)
               for t, strides in tensors_and_strides)


def uses_gluon_ws(tile: Tile, device: torch.device, aligned: bool) -> bool:
    """Whether a launch on ``tile`` runs the Gluon producer/consumer kernel. A ``gluon_ws``
    row that cannot (no Gluon in this Triton, the interpreter, tensors off CUDA, a device
    below sm_90, rows not 16-byte aligned) runs its Triton tile; either way it says which
    kernel runs, once per reason."""
    if not tile.gluon_ws:
        return False
    if not glp.AVAILABLE:
        _gluon_fallback("this Triton has no Gluon")
    elif arch.interpreting():
        _gluon_fallback("the Triton interpreter runs no Gluon kernel")
    elif device.type != "cuda":
        _gluon_fallback(f"tensors on {device.type}, not on a CUDA device")
    elif (cc := torch.cuda.get_device_capability(device))[0] * 10 + cc[1] < glp.MIN_CC:
        _gluon_fallback(f"compute capability {cc[0]}.{cc[1]}: warp specialization needs 9.0")
    elif not aligned:
        _gluon_fallback("q, kv or out rows not 16-byte aligned")
    else:
        arch.log_once("sparse_mla_prefill", "the sm90 row runs the Gluon producer/consumer "
                      "kernel", f"compute capability {cc[0]}.{cc[1]}")
        return True
    return False


def _gluon_fallback(reason: str) -> None:
    arch.log_once("sparse_mla_prefill", "the Gluon producer/consumer row runs the Triton tile",
                  reason)


def _dot_fp32() -> bool:
    """The interpreter's bf16 tl.dot is wrong (tests/interp_bf16.py); fp32 operands there."""
    return arch.interpreting()


def sparse_attn_prefill(q, kv, scale, attn_sink, nope_head_dim, rope_head_dim, *,
                        indices=None, topk_length=None, ragged_indices=None,
                        ragged_indptr=None, out=None, variant=None):
    """Sparse MLA prefill; returns ``out`` [tokens, heads, 512 or 448] bf16.

    ``q`` [tokens, heads, 512] bf16; ``kv`` [rows, 512] bf16 (or [rows, 1, 512]) — the
    gathered workspace, row stride free, last dim contiguous; ``scale`` the softmax scale;
    ``attn_sink`` [>= heads] float or None (the first ``heads`` entries are used, as
    upstream slices them). Keys per token, one of:

    * dense ``indices`` [tokens, width] (any trailing shape, flattened per row) with
      ``topk_length`` [tokens], as upstream's ``_rocm_sparse_attn_prefill_triton`` takes
      them: row t's keys are its first ``topk_length[t]`` entries (None: as many as the row
      has entries >= 0, upstream's default);
    * ``ragged_indices`` [nnz] with ``ragged_indptr`` [tokens + 1].

    Entries < 0 or >= rows are skipped. ``out`` None allocates [tokens, heads, 512].
    ``variant``: a row of ``TILES`` (None: this process's variant; "cpu" runs the sm80 tile
    in the interpreter).
    """
    tile = TILES[arch.table_key(variant, TILES)]
    check_mla_query(q, nope_head_dim, rope_head_dim, scale)
    dev = q.device
    tokens, heads, _ = q.shape
    check_tensor(kv, "kv", dtypes=_BF16, device=dev)
    if kv.dim() == 3 and kv.shape[1] == 1:
        kv = kv.squeeze(1)
    check(kv.dim() == 2 and kv.shape[1] == HEAD_DIM and kv.stride(1) == 1, "kv",
          lambda: f"expected [rows, {HEAD_DIM}] (or [rows, 1, {HEAD_DIM}]) with a contiguous "
          f"last dim, got shape {tuple(kv.shape)} strides {kv.stride()}")

    dense = indices is not None
    check(dense != (ragged_indices is not None), "indices/ragged_indices",
          "give dense indices (with topk_length) or ragged_indices with ragged_indptr, "
          "not both and not neither")
    if dense:
        check(ragged_indptr is None, "ragged_indptr", "given without ragged_indices")
        check_tensor(indices, "indices", dtypes=INDEX_DTYPES, device=dev)
        check(indices.dim() >= 1 and indices.shape[0] == tokens, "indices",
              lambda: f"expected [{tokens}, width] (one row per query token), got "
              f"{tuple(indices.shape)}")
        idx = indices.flatten(1) if indices.dim() > 1 else indices[:, None]
        if idx.stride(-1) != 1:
            idx = idx.contiguous()
        width = idx.shape[1]
        if topk_length is None:  # upstream's default length: the row's entries >= 0
            lens = (idx >= 0).sum(dim=-1, dtype=torch.int32)
        else:
            check_tensor(topk_length, "topk_length", dtypes=INDEX_DTYPES, device=dev)
            check(topk_length.numel() == tokens, "topk_length",
                  lambda: f"expected {tokens} entries (one per query token), got "
                  f"{tuple(topk_length.shape)}")
            lens = topk_length.reshape(-1).contiguous()
        ptr, idx_stride0 = lens, idx.stride(0)
    else:
        check(topk_length is None, "topk_length", "is for dense indices, not ragged ones")
        check_tensor(ragged_indices, "ragged_indices", dtypes=INDEX_DTYPES, ndim=1, device=dev)
        check_tensor(ragged_indptr, "ragged_indptr", dtypes=INDEX_DTYPES, ndim=1, device=dev)
        check(ragged_indptr.numel() == tokens + 1, "ragged_indptr",
              lambda: f"expected {tokens + 1} entries (tokens + 1), got "
              f"{ragged_indptr.numel()}")
        idx, ptr, width, idx_stride0 = (ragged_indices.contiguous(),
                                        ragged_indptr.contiguous(), 0, 0)

    has_sink = attn_sink is not None
    if has_sink:
        check_tensor(attn_sink, "attn_sink", dtypes=FLOAT_DTYPES, ndim=1, device=dev)
        check(attn_sink.numel() >= heads, "attn_sink",
              lambda: f"expected at least {heads} entries (one per head), got "
              f"{tuple(attn_sink.shape)}")
        attn_sink = attn_sink[:heads].contiguous()
    if out is None:
        out = torch.empty(tokens, heads, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    else:
        check_tensor(out, "out", dtypes=_BF16, ndim=3, device=dev)
        check(out.shape[:2] == q.shape[:2] and out.shape[2] in (NOPE_DIM, HEAD_DIM)
              and out.stride(2) == 1, "out",
              lambda: f"expected [{tokens}, {heads}, {HEAD_DIM} or {NOPE_DIM}] with a "
              f"contiguous last dim, got shape {tuple(out.shape)} strides {out.stride()}")
    if tokens == 0 or heads == 0:
        return out

    block_h, head_tiles = launch_plan(heads, tile)
    aligned = _aligned((q, (q.stride(0), q.stride(1))), (kv, (kv.stride(0),)),
                       (out, (out.stride(0), out.stride(1))))
    if uses_gluon_ws(tile, dev, aligned):
        return glp.attend(q, kv, idx, ptr, attn_sink if has_sink else out, out, idx_stride0,
                          width, float(scale) * LOG2E.value, dense=dense, has_sink=has_sink,
                          sm_count=arch.sm_count(dev), persistent=tile.persistent)
    _sparse_mla_prefill_kernel[(tokens * head_tiles,)](
        q, kv, idx, ptr, attn_sink if has_sink else out, out,
        q.stride(0), q.stride(1), kv.stride(0), idx_stride0, out.stride(0), out.stride(1),
        kv.shape[0], heads, head_tiles, width, float(scale) * LOG2E.value,
        DENSE=dense, HAS_SINK=has_sink, OUT_D=out.shape[2], DOT_FP32=_dot_fp32(),
        ALIGNED=aligned, BLOCK_H=block_h, BLOCK_N=tile.block_n, **_loop_constexprs(tile),
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


# ----------------------------------------------------------------------------- compile gate
_SIG = {
    "q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "ptr_ptr": "*i32",
    "sink_ptr": "*fp32", "out_ptr": "*bf16",
    **{k: "i32" for k in ("q_stride0", "q_stride1", "kv_stride0", "idx_stride0",
                          "out_stride0", "out_stride1", "num_rows", "num_heads", "head_tiles",
                          "width")},
    "qk_scale": "fp32",
    **{k: "constexpr" for k in ("DENSE", "HAS_SINK", "OUT_D", "DOT_FP32", "ALIGNED", "BLOCK_H",
                                "BLOCK_N", "SPLIT_D", "WARP_SPEC", "UNROLL", "LOOP_STAGES",
                                "RESCALE_TAU", "QK_HALVES")},
}
# Variants the gate builds ("sm80" also covers sm_86; sm86's tile is sm80's).
GATE_VARIANTS = ("sm80", "sm89", "sm90", "sm100")


def gate_constexprs(tile: Tile, dense: bool = True) -> dict:
    """The constexprs of a production launch of ``tile`` (64 heads or more, sink, aligned
    workspace, 512-wide output)."""
    return dict(DENSE=dense, HAS_SINK=True, OUT_D=HEAD_DIM, DOT_FP32=False, ALIGNED=True,
                BLOCK_H=tile.block_h, BLOCK_N=tile.block_n, **_loop_constexprs(tile))


def _loop_constexprs(tile: Tile) -> dict:
    """The kernel's constexprs for ``tile``'s split_d and key-loop knobs (0 -> None)."""
    return dict(SPLIT_D=tile.split_d, WARP_SPEC=tile.warp_spec, UNROLL=tile.unroll or None,
                LOOP_STAGES=tile.loop_stages or None, RESCALE_TAU=float(tile.rescale_tau),
                QK_HALVES=tile.qk_halves)


def gluon_ws_spec(name: str = "sparse_mla_prefill.gluon_ws[sm90]", **overrides) -> GateSpec:
    """The Gluon producer/consumer kernel's production launch (dense lists, sink, 512-wide
    output) as a compile-gate spec; ``overrides`` replace constexprs (the sweep's register
    splits)."""
    return GateSpec(name=name, kernel=glp._prefill_ws_kernel, signature=glp.SIGNATURE,
                    constexprs={**glp.gate_constexprs(), **overrides}, variants=("sm90",),
                    num_warps=glp.NUM_WARPS, feature=FEATURE, aligned_pointers=True,
                    maxnreg=glp.MAXNREG)


def _register() -> None:
    for v in GATE_VARIANTS:
        t = TILES[v]
        register(GateSpec(name=f"sparse_mla_prefill[{v}]", kernel=_sparse_mla_prefill_kernel,
                          signature=_SIG, constexprs=gate_constexprs(t), variants=(v,),
                          num_warps=t.num_warps, num_stages=t.num_stages, feature=FEATURE))
    if glp.AVAILABLE:
        register(gluon_ws_spec())


_register()
