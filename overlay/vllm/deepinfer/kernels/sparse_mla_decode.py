"""Unified 512-dim sparse MLA decode over 584-byte KV records (DeepSeek-V4.1/V4).

Replaces upstream vLLM 0.33.0's ``_sparse_attn_decode_ragged_kernel`` (the CUDA fallback of
``_rocm_sparse_attn_decode_ragged_triton``) and its split-K pair
``_sparse_attn_decode_partial_kernel`` + ``_sparse_attn_decode_reduce_kernel``; the
arguments mean what they mean there. Per decode token and head: attend over the token's
ragged key list (``main`` rows, e.g. the SWA cache, then ``extra`` rows, e.g. compressed
top-k), keys and values being the same dequantized 512-dim rows, with the per-head attention
sink in the softmax denominator.

What differs from upstream:

* One operand per key row. Each key tile is built as one [BLOCK_N, 512] matrix: columns
  < 448 are the e4m3 NoPE bytes times their UE8M0 block scale (scale by bit shift,
  ``fp8.ue8m0_to_f32``), columns >= 448 the bf16 RoPE tail; one ``tl.dot`` for QK^T and
  one for PV per tile (upstream: a 448-padded-to-512 dot plus a separate 64-wide dot).
* Many heads per program: BLOCK_H heads of one token share every dequantized key tile
  (on sm90 one program owns all 64 heads of a token), online softmax in the exp2 domain.
* One virtual key list per token (main then extra), so a tile may straddle the boundary,
  and split-K slices it into BLOCK_N-aligned chunks. Split-K only when the grid is too
  small to fill the GPU (``choose_num_splits``); with one split the kernel writes the bf16
  output itself (no workspace, no reduce launch).
* Inverse RoPE: with ``inv_rope_positions`` the GPT-J inverse rotation of dims 448..511 is
  applied exactly once, in the reduce (split path) or the kernel epilogue (no-split path),
  on the fp32 result before the bf16 cast. Upstream's CUDA fallback silently ignores
  ``inv_rope_positions`` while ``rocm_sparse_attn_decode`` reports the rows as rotated.

Semantics kept from upstream: slots < 0 or >= blocks*block_size are skipped; NaN key
entries are zeroed (NaN scrub); rows without a valid key give zeros, never NaN.

Variants (``TILES``): sm80/sm86/cpu decode e4m3 in software and fit 48 KiB of shared
memory per CTA; sm89/sm90/sm100 use the hardware e4m3 conversion. See
docs/sparse-mla-decode.md for the tile choices and their compile-gate figures.
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch
import triton
import triton.language as tl

from vllm.deepinfer import arch, envs
from vllm.deepinfer.compile_gate import GateSpec, add_provider, register
from vllm.deepinfer.fp8 import (cvt_e4m3_to_f32, e4m3_to_f32_e4b15, e4m3_to_f32_f16bits,
                                ue8m0_to_f32)
from vllm.deepinfer.kernels import shapes
from vllm.deepinfer.kernels import sparse_mla_decode_gluon as glk
from vllm.deepinfer.kernels.checks import (FLOAT_DTYPES, INDEX_DTYPES, check, check_mla_query,
                                           check_tensor)
from vllm.deepinfer.kernels.qk_halves import halves_step
from vllm.deepinfer.kv_record import HEAD_DIM, NOPE_DIM, RECORD_BYTES, ROPE_DIM
# Record geometry as kernel constants. A key row is built as [BLOCK_N, 8, 64]: the 7 NoPE
# chunks of one UE8M0 scale each, then the RoPE tail, which is exactly one chunk wide.
from vllm.deepinfer.kv_record import TL_DATA_BYTES as _DATA  # 576; a page's scales follow
from vllm.deepinfer.kv_record import TL_HEAD_DIM as _D  # 512 columns per key row
from vllm.deepinfer.kv_record import TL_NOPE_DIM as _NOPE  # 448 e4m3 columns, then bf16
from vllm.deepinfer.kv_record import TL_QUANT_BLOCK as _CHUNK  # 64 columns per UE8M0 scale
from vllm.deepinfer.kv_record import TL_SCALE_BYTES as _SCALE  # 8 scale bytes (7 + pad)

__all__ = ["sparse_attn_decode", "choose_num_splits", "launch_plan", "select_tile",
           "launch_tiles", "Tile", "TILES", "REDUCE_UNROLL", "GATE_VARIANTS",
           "PREDEQUANT_FEATURE", "PREDEQUANT_MIN_TOKENS", "PREDEQUANT_BLOCK_N",
           "PREDEQUANT_WARPS", "PREDEQUANT_PROGRAMS_PER_SM", "PREDEQUANT_DECODES",
           "phase2_tile", "uses_gluon", "scratch_specs", "scratch_plan", "GRID_TOKENS",
           "INDEX_LIMIT"]

FEATURE = "sparse_mla_decode"
# Softmax runs in the exp2 domain: scores and the sink are multiplied by log2(e) once.
LOG2E = tl.constexpr(1.4426950408889634)
# Finite "minus infinity" for masked scores and the running max (upstream's value): a row
# that has seen no valid key keeps m = NEG_LARGE and exp2(m - m) = 1 stays finite, where
# -inf would give inf - inf = NaN.
NEG_LARGE = tl.constexpr(-3.4028234663852886e38)
# Split partials the reduce kernel loads per round: 4 independent [8, 512] fp32 loads in
# flight (32 registers each over 128 threads) instead of one dependent load per split.
REDUCE_UNROLL = 4
# Tokens per launch. CUDA allows at most 65,535 programs on grid axes y and z, and the decode
# puts its tokens there (the attention kernel's z, the first phase's and the reduce's y): a
# launch of more tokens (up to max_num_seqs x (1 + speculative tokens)) runs in chunks of at
# most GRID_TOKENS, same plan (tile, heads per program, splits), same bits. 65,520 = 4,095 x
# 16, the largest multiple of 16 within the limit: every chunk starts 16-byte aligned in the
# per-token int32/int64 tensors (indptr, positions), so chunks run the kernels an unchunked
# launch compiles (Triton specializes pointers on 16-byte alignment).
GRID_TOKENS = 65520
# Largest list the decode can address: indptr values and a two-phase row's first workspace
# row (main_indptr[t] + extra_indptr[t]) are int32 in the kernels.
INDEX_LIMIT = 2 ** 31 - 1
# The two-phase path (Tile.predequant). Its switch for sm80/sm86/cpu: DEEPINFER_DECODE_PREDEQUANT.
PREDEQUANT_FEATURE = "decode_predequant"
# Decode tokens (rows of q) from which a software-e4m3 variant (sm80, sm86, cpu) takes its
# two-phase row ("<variant>-2p") while decode_predequant is on (select_tile); fewer take the
# single-phase row. From benchmarks/results/archive/h200-2026-12-01-sparse_mla_decode-4ab26c8.json:
# H200 timings of the sm_80-targeted kernels run on Hopper (rows "sm80" vs "sm80-2p"; not
# A100 figures, no A100 was measured), top-k 512 + window 128, CUDA-graph replays:
#   64 heads, tokens 1 / 4 / 16 / 64 / 128: two-phase 42.3 / 30.8 / 42.9 / 135.3 / 273.6 us,
#     single-phase 40.2 / 34.0 / 60.6 / 257.1 / 502.5 us (batch 64: 39.7 vs 20.9 TFLOP/s);
#   128 heads, same tokens: 31.3 / 30.4 / 60.0 / 229.0 / 369.2 vs
#     31.9 / 39.1 / 104.8 / 481.4 / 931.6 us;
#   top-k 8192, 64 heads, 1 / 16 / 64 tokens: 75.5 / 355.2 / 1563.2 vs 91.1 / 605.6 / 3196.0 us.
# Two-phase loses only at 1 token x 64 heads x 640 keys (5% slower) and wins by 2% at 1 token
# x 128 heads: the crossover is between 1 and 4 tokens at 64 heads (2 and 3 not measured),
# at or below 1 at 128. 4 is the smallest batch at which two-phase won in every measured row.
PREDEQUANT_MIN_TOKENS = 4
# Phase 1 moves 584 B in and 1 KiB out per key, like the KV gather: its tile (16 keys,
# 4 warps) is the gather's, measured best there (kernels/kv_gather.py). Each program walks
# key tiles p, p + P, ... of its token; P from 4 programs per SM, about what is resident
# at once (95 registers: 5 CTAs), so one wave overlaps the loads of many tiles: the A100
# model (tools/a100_model.py) puts phase 1 at 31 us for 64 tokens x 640 keys with 4, at
# 69 us with 16 (several waves of latency-bound programs). The H200 sweep
# (benchmarks/results/archive/h200-2026-12-01-decode-2p-sweep-3dcac6f.json, phase 1 alone, e4b15)
# disagreed: 16 programs per SM 33.6 / 58.8 us at 64 / 128 tokens against 40.2 / 70.2 with 4,
# 32-key tiles 36.6 / 61.1. Kept at 4 until the grid and the f16bits decoder (now the
# default) are timed together; nothing here changes an output.
PREDEQUANT_BLOCK_N = 16
PREDEQUANT_WARPS = 4
PREDEQUANT_PROGRAMS_PER_SM = 4
# Exact software e4m3 decoders phase 1 can use (fp8.py; all bit-exact, NaN included):
# the integer unpack, the fp16-bits shift, Triton's fp8e4b15 conversion. The "-2p" tiles
# take f16bits (TILES: the H200 sweep timed phase 1 at 32.6 / 54.3 us with it against e4b15's
# 40.2 / 70.2 at 64 / 128 tokens), although the gather measured e4b15 fastest and the A100
# model puts phase 1 at 51.5 us with e4b15 against 62.7 us with the integer unpack.
PREDEQUANT_DECODES = {"int": 0, "f16bits": 1, "e4b15": 2}


@dataclasses.dataclass(frozen=True)
class Tile:
    block_h: int      # heads of one token per program (the Q tile is [block_h, 512])
    block_n: int      # keys per tile
    num_warps: int
    num_stages: int
    # Resident CTAs per SM the split heuristic aims to fill (occupancy of this tile).
    ctas_per_sm: int
    # Reduce kernel: heads per program (8: a batch-1 decode of 64 heads still gets 8
    # programs) and warps.
    reduce_block_h: int = 8
    reduce_warps: int = 4
    # Load the next key tile's bytes before computing on the current one (register double
    # buffering; Triton's own pipeliner does not stage these gathered loads). Off everywhere:
    # on the H200 (benchmarks/results/h200-2026-11-29-decode-tile-sweep.json, 64 heads,
    # 512 + 128 keys) it made the sm90 tile 1.5-2.1x slower (batch 64: 95.7 vs 58.1 us; the
    # [64, 512] fp32 accumulator already holds most registers) and the sm80 tile run there
    # only 0-10% faster (batch 128: 365 vs 382 us), too little to risk spills on sm_80, whose
    # build is at 255 registers already.
    prefetch: bool = False
    # Two phases (Ampere): a first kernel dequantizes each token's keys once into a bf16
    # workspace (one pass over the records, shared by every head tile of the token); the
    # attention kernel then reads plain bf16 rows, contiguous per token, with no e4m3 work
    # and no slot arithmetic in its loop. Rows "*-2p" of this table: a software-e4m3
    # variant's launches take its "-2p" row from PREDEQUANT_MIN_TOKENS decode tokens on
    # (select_tile; DEEPINFER_DECODE_PREDEQUANT=0 keeps them single-phase); naming a "-2p"
    # row always runs two phases.
    predequant: bool = False
    # Phase 1's software e4m3 decoder (a PREDEQUANT_DECODES key).
    predequant_decode: str = "int"
    # Phase 2 only: compute Q.K^T as two dots over dims [0, 256) and [256, 512), each with
    # its own accumulator, and keep the output in two halves. mma.sync chains one dot's 32
    # k-steps through one accumulator (dependent HMMAs); two halves give the scheduler two
    # independent chains of 16. Same instructions and shared memory, other summation order.
    qk_halves: bool = False
    # Phase 2 only, 0 or one of glk.HEADS: launches of at least that many heads run the Gluon
    # kernel of kernels/sparse_mla_decode_gluon.py (that many heads per program, Q held in
    # registers, each key tile staged once per program) instead of the Triton loop; fewer
    # heads, the interpreter and a Triton without Gluon keep the Triton loop (uses_gluon).
    gluon_heads: int = 0


# Tile table keyed by variant name (docs/sparse-mla-decode.md has the gate figures).
TILES: dict[str, Tile] = {
    # Ampere, 48 KiB of shared memory per CTA (two CTAs per SM on SM86). mma.sync reads
    # operands through shared memory: Q [16, 512] bf16 (16 KiB) stays there for the whole
    # loop and each key tile is stored twice (one swizzle per dot, 2 x BLOCK_N KiB), so
    # BLOCK_N 16 is the largest that fits: exactly 48 KiB. num_stages 1: a second stage of
    # cp.async buffers would not fit (59 KiB at BLOCK_N 16).
    "sm80": Tile(block_h=16, block_n=16, num_warps=4, num_stages=1, ctas_per_sm=2),
    "sm86": Tile(block_h=16, block_n=16, num_warps=4, num_stages=1, ctas_per_sm=2),
    # Interpreter (CPU tensors): the sm80 code path and tile.
    "cpu": Tile(block_h=16, block_n=16, num_warps=4, num_stages=1, ctas_per_sm=1),
    # The two-phase Ampere path (``predequant``): selected by name (benchmarks, tests), and
    # by sm80/sm86/cpu launches of PREDEQUANT_MIN_TOKENS tokens or more unless
    # DEEPINFER_DECODE_PREDEQUANT=0 (select_tile). Its attention kernel reads
    # contiguous bf16 rows, which Triton's pipeliner stages with cp.async straight into
    # shared memory, stored once for both dots: with 2 stages the sm_80 build takes 33 KiB
    # (one stage: 48 KiB, the tile stored twice). Chosen with the A100 model over warps
    # {2, 4, 8} x stages {1, 2, 3} x keys {16, 32} within 48 KiB (docs/a100-model.md);
    # 32 keys x 2 stages needs 49 KiB. Then timed on the H200 by benchmarks/diag/
    # sweep_decode_2p.py (benchmarks/results/archive/h200-2026-12-01-decode-2p-sweep-3dcac6f.json,
    # 64 heads, top-k 512 + window 128, each phase also timed alone): 2 warps, 2 stages
    # (the 16 x 16 score tile is exactly two warps' n8 columns, so no QK^T mma is repeated,
    # as in the prefill's Ampere tile) ran phase 2 in 84.0 / 100.4 us at 64 / 128 tokens
    # where 4 warps took 98.8 / 205.5 (227 registers, no spill, 33,280 B on sm_80; the A100
    # model also ranks it first: 132 vs 148 us at 64 tokens). Phase 1's "f16bits" decoder
    # took 32.6 / 54.3 us against e4b15's 40.2 / 70.2 (the model: equal on an A100, 149.6
    # vs 148.4 us); every decoder is exact, so outputs are the same bytes. The two choices
    # were timed apart, not together; no A100 has run either.
    # ctas_per_sm 4 on sm80: the tile's residency (227 registers x 64 threads and 33,280 B
    # + 1 KiB per CTA fit 4 per SM on an A100, 164 KiB; sm86's 100 KiB fit 2). The split
    # heuristic then splits the keys of grids up to a quarter of the slots. Timed together
    # with the two choices above on the H200 (benchmarks/results/h200-2026-12-01-decode-2p-
    # sweep-76b7288.json, 64 heads, top-k 512 + window 128): 64 tokens 93.0 us against
    # 114.1 at 2 (phase 2 64.9 vs 85.6: two splits, 512 CTAs in 528 slots), 128 tokens
    # 153.5 vs 153.2, 16 tokens 42.6 vs 40.2. An A100's 108 SMs give 432 slots, so there
    # 64 tokens x 64 heads (256 head tiles) stays unsplit and 32 tokens split 3 ways.
    # qk_halves on (two independent Q.K^T chains): the H200 sweep of 9a2f512
    # (benchmarks/results/archive/h200-2026-12-01-decode-2p-sweep-9a2f512.json, same shapes) ran
    # phase 2 at 64 tokens in 60.3 us against 64.3 with one chain (total 88.9 vs 92.4), 128
    # tokens unchanged (152.5 vs 152.4), 16 tokens 40.6 vs 42.4. The sm_80 builds with the
    # launches' specialization (benchmarks/results/a100-model-decode-2p-sweep-229e42c.json):
    # 33,280 B, 255 registers (one chain: 227), no local-memory instructions either way.
    "sm80-2p": Tile(block_h=16, block_n=16, num_warps=2, num_stages=2, ctas_per_sm=4,
                    predequant=True, predequant_decode="f16bits", qk_halves=True),
    "sm86-2p": Tile(block_h=16, block_n=16, num_warps=2, num_stages=2, ctas_per_sm=2,
                    predequant=True, predequant_decode="f16bits", qk_halves=True),
    "cpu-2p": Tile(block_h=16, block_n=16, num_warps=2, num_stages=1, ctas_per_sm=1,
                   predequant=True, predequant_decode="f16bits", qk_halves=True),
    # Phase 2 as the Gluon kernel with 64 or 32 heads per program (Tile.gluon_heads);
    # benchmark rows.
    **{f"sm80-2p-h{g}": Tile(block_h=16, block_n=16, num_warps=2, num_stages=2, ctas_per_sm=4,
                             predequant=True, predequant_decode="f16bits", qk_halves=True,
                             gluon_heads=g) for g in (64, 32)},
    # Ada: hardware e4m3, mma.sync like Ampere (no wgmma), 100 KiB per SM: the Ampere tile
    # keeps two CTAs per SM. Not measured by this project.
    "sm89": Tile(block_h=16, block_n=16, num_warps=4, num_stages=1, ctas_per_sm=2),
    # Hopper: one program owns 64 heads of a token (wgmma needs 64 rows); the key tile is
    # stored once (both wgmmas read it, one through a transposed view). Tuned on H200.
    "sm90": Tile(block_h=64, block_n=64, num_warps=8, num_stages=1, ctas_per_sm=1),
    # Blackwell 10.x/12.x, not measured: 99 KiB per block (12.x) rules out the Hopper tile,
    # whose split-K epilogue alone stages [64, 512] fp32 (128 KiB) through shared memory;
    # 32-head tiles spill heavily. 16 heads x 32 keys: 80 KiB, one stage.
    "sm100": Tile(block_h=16, block_n=32, num_warps=4, num_stages=1, ctas_per_sm=1),
}


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _inv_rope_gptj(out, pos_ptr, cs_ptr, cs_stride, tok, BLOCK_H: tl.constexpr,
                   D: tl.constexpr, NOPE: tl.constexpr):
    """Inverse GPT-J RoPE of dims NOPE.. of an fp32 [BLOCK_H, D] tile (upstream's reduce
    formula): pairs (a, b) = (even, odd) become (a*cos + b*sin, b*cos - a*sin) with
    cos = cs[pos, k], sin = cs[pos, HALF + k] (HALF = (D - NOPE) / 2); NoPE pairs take
    cos 1, sin 0."""
    HALF: tl.constexpr = (D - NOPE) // 2
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    pair = tl.arange(0, D // 2) - NOPE // 2
    is_rope = pair >= 0
    k = tl.maximum(pair, 0)
    row = cs_ptr + pos * cs_stride
    cos = tl.load(row + k, mask=is_rope, other=1.0).to(tl.float32)
    sin = tl.load(row + HALF + k, mask=is_rope, other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(out, (BLOCK_H, D // 2, 2)))
    return tl.reshape(tl.join(even * cos[None, :] + odd * sin[None, :],
                              odd * cos[None, :] - even * sin[None, :]), (BLOCK_H, D))


@triton.jit
def _load_key_tile(k0, hi, main_cache_ptr, main_idx_ptr, main_start, main_len, main_stride0,
                   main_rows, extra_cache_ptr, extra_idx_ptr, extra_start, extra_stride0,
                   extra_rows, HAS_EXTRA: tl.constexpr, ALIGNED: tl.constexpr,
                   MAIN_BS: tl.constexpr, EXTRA_BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Raw bytes of key rows k0 .. k0 + BLOCK_N of the virtual list [main keys, extra keys]
    (rows >= hi, and invalid slots, masked): (e4m3 codes [BLOCK_N, 8, 64] with chunk 7
    zero, UE8M0 bytes [BLOCK_N, 8], RoPE bits [BLOCK_N, 64] int16, valid [BLOCK_N])."""
    NOPE: tl.constexpr = _NOPE
    chunk = tl.arange(0, _D // _CHUNK)
    lane = tl.arange(0, _CHUNK)
    chunk_off = chunk[:, None] * _CHUNK + lane[None, :]
    is_nope_chunk = chunk < NOPE // _CHUNK
    j = k0 + tl.arange(0, BLOCK_N)
    live = j < hi
    if HAS_EXTRA:
        in_main = j < main_len
        idx = tl.where(in_main, main_idx_ptr + main_start + j,
                       extra_idx_ptr + (extra_start - main_len) + j)
        slot = tl.load(idx, mask=live, other=-1)
        valid = (slot >= 0) & (slot < tl.where(in_main, main_rows, extra_rows))
        # Unsigned division by the constexpr block sizes: shifts for powers of two. Each
        # cache divides its own slots (one of the two is 0), so no division by a select.
        s_main = tl.where(valid & in_main, slot, 0).to(tl.uint32)
        s_extra = tl.where(valid & ~in_main, slot, 0).to(tl.uint32)
        pos = (s_main % MAIN_BS + s_extra % EXTRA_BS).to(tl.int32)
        page = tl.where(in_main, main_cache_ptr + (s_main // MAIN_BS).to(tl.int64) * main_stride0,
                        extra_cache_ptr + (s_extra // EXTRA_BS).to(tl.int64) * extra_stride0)
        scales = page + tl.where(in_main, MAIN_BS * _DATA, EXTRA_BS * _DATA) + pos * _SCALE
    else:
        slot = tl.load(main_idx_ptr + main_start + j, mask=live, other=-1)
        valid = (slot >= 0) & (slot < main_rows)
        s_main = tl.where(valid, slot, 0).to(tl.uint32)
        pos = (s_main % MAIN_BS).to(tl.int32)
        page = main_cache_ptr + (s_main // MAIN_BS).to(tl.int64) * main_stride0
        scales = page + MAIN_BS * _DATA + pos * _SCALE  # 7 UE8M0 bytes + pad
    data = page + pos * _DATA               # 448 e4m3 bytes, then 64 bf16
    if ALIGNED:  # host checked: caches 16-byte aligned, page strides multiples of 16
        data = tl.multiple_of(data, [16])
    code = tl.load(data[:, None, None] + chunk_off[None, :, :],
                   mask=valid[:, None, None] & is_nope_chunk[None, :, None], other=0)
    sbyte = tl.load(scales[:, None] + chunk[None, :],
                    mask=valid[:, None] & is_nope_chunk[None, :], other=127)
    rope_bits = tl.load((data + NOPE).to(tl.pointer_type(tl.int16))[:, None] + lane[None, :],
                        mask=valid[:, None], other=0)
    return code, sbyte, rope_bits, valid


@triton.jit
def _build_key_rows(code, sbyte, rope_bits, HW_FP8: tl.constexpr, BLOCK_N: tl.constexpr,
                    DECODE: tl.constexpr = 0):
    """[BLOCK_N, 512] fp32 key rows from a tile's raw bytes: chunks 0..6 the NoPE bytes times
    their chunk's UE8M0 scale, chunk 7 the bf16 RoPE tail; NaN entries zeroed (upstream's
    scrub). Every value is exact in bf16 (e4m3 times a power of two, or a bf16). DECODE
    picks the exact software e4m3 decoder when HW_FP8 is off (PREDEQUANT_DECODES)."""
    NOPE: tl.constexpr = _NOPE
    chunk = tl.arange(0, _D // _CHUNK)
    is_nope_chunk = chunk < NOPE // _CHUNK
    if HW_FP8 or DECODE == 0:
        x = cvt_e4m3_to_f32(code, HW_FP8)
    elif DECODE == 1:
        x = e4m3_to_f32_f16bits(code)
    else:
        x = e4m3_to_f32_e4b15(code)
    nope = x * ue8m0_to_f32(sbyte)[:, :, None]
    rope = (rope_bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)  # exact bf16->f32
    k = tl.where(is_nope_chunk[None, :, None], nope, rope[:, None, :])
    k = tl.reshape(k, (BLOCK_N, _D))
    return tl.where(k == k, k, 0.0)


# Cache row counts vary with the cache size (V4's C128A pages hold 2 entries: an odd block
# count is not a multiple of 16): unspecialized, as in the attention kernel below.
@triton.jit(do_not_specialize=["main_rows", "extra_rows"])
def _predequant_kernel(
    main_cache_ptr, main_idx_ptr, main_indptr_ptr, extra_cache_ptr, extra_idx_ptr,
    extra_indptr_ptr, ws_ptr, valid_ptr, main_stride0, extra_stride0, main_rows, extra_rows,
    HAS_EXTRA: tl.constexpr, HW_FP8: tl.constexpr, ALIGNED: tl.constexpr,
    MAIN_BS: tl.constexpr, EXTRA_BS: tl.constexpr, BLOCK_N: tl.constexpr, DECODE: tl.constexpr,
):
    """Phase 1 of the two-phase decode. Grid (programs per token, tokens): program p of a
    token dequantizes key tiles p, p + P, ... of the token's virtual list [main keys, extra
    keys] into bf16 workspace rows ``main_indptr[t] + extra_indptr[t] + j`` (the prefix
    sum of the tokens' key counts, so each token's rows are contiguous) and writes a 0/1
    validity byte per row (invalid slots: zero rows, flag 0)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tok = tl.program_id(1)
    cols = tl.arange(0, _D)
    main_start = tl.load(main_indptr_ptr + tok)
    main_len = tl.load(main_indptr_ptr + tok + 1) - main_start
    if HAS_EXTRA:
        extra_start = tl.load(extra_indptr_ptr + tok)
        total = main_len + tl.load(extra_indptr_ptr + tok + 1) - extra_start
    else:
        extra_start = 0
        total = main_len
    base = main_start + extra_start
    for k0 in range(pid * BLOCK_N, total, nprog * BLOCK_N):
        code, sbyte, rope_bits, valid = _load_key_tile(
            k0, total, main_cache_ptr, main_idx_ptr, main_start, main_len, main_stride0,
            main_rows, extra_cache_ptr, extra_idx_ptr, extra_start, extra_stride0, extra_rows,
            HAS_EXTRA, ALIGNED, MAIN_BS, EXTRA_BS, BLOCK_N)
        k = _build_key_rows(code, sbyte, rope_bits, HW_FP8, BLOCK_N, DECODE)
        j = k0 + tl.arange(0, BLOCK_N)
        live = j < total
        row = (base + j).to(tl.int64)
        tl.store(ws_ptr + row[:, None] * _D + cols[None, :], k.to(tl.bfloat16),
                 mask=live[:, None])
        tl.store(valid_ptr + row, valid.to(tl.uint8), mask=live)


@triton.jit
def _attend_rows_halves(q_row_ptr, q_stride1, heads, hmask, ws_ptr, valid_ptr, ws_base, lo, hi,
                        qk_scale, DOT_FP32: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """Phase 2's loop over workspace rows [lo, hi) with Q, the keys and the output split at
    dim 256 (``Tile.qk_halves``; the step is kernels/qk_halves.py's). Returns (m, l,
    acc [BLOCK_H, 512]) as the main loop leaves them."""
    D: tl.constexpr = _D
    HD: tl.constexpr = _D // 2
    hc = tl.arange(0, HD)
    qa = tl.load(q_row_ptr + heads[:, None] * q_stride1 + hc[None, :], mask=hmask[:, None],
                 other=0.0)
    qb = tl.load(q_row_ptr + heads[:, None] * q_stride1 + HD + hc[None, :],
                 mask=hmask[:, None], other=0.0)
    if DOT_FP32:
        qa = qa.to(tl.float32)
        qb = qb.to(tl.float32)
    m_i = tl.full((BLOCK_H,), NEG_LARGE, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc_a = tl.zeros((BLOCK_H, HD), tl.float32)
    acc_b = tl.zeros((BLOCK_H, HD), tl.float32)
    for k0 in tl.range(lo, hi, BLOCK_N):
        j = k0 + tl.arange(0, BLOCK_N)
        live = j < hi
        row = (ws_base + j).to(tl.int64)
        ka = tl.load(ws_ptr + row[:, None] * D + hc[None, :], mask=live[:, None], other=0.0)
        kb = tl.load(ws_ptr + row[:, None] * D + HD + hc[None, :], mask=live[:, None],
                     other=0.0)
        valid = tl.load(valid_ptr + row, mask=live, other=0) != 0
        m_i, l_i, acc_a, acc_b = halves_step(qa, qb, ka, kb, valid, m_i, l_i, acc_a, acc_b,
                                             qk_scale, DOT_FP32)
    # [BLOCK_H, 256, 2] -> [BLOCK_H, 2, 256] -> [BLOCK_H, 512]: half a, then half b.
    acc = tl.reshape(tl.permute(tl.join(acc_a, acc_b), (0, 2, 1)), (BLOCK_H, D))
    return m_i, l_i, acc


# Arguments that vary with the batch or the cache size rather than the model are not
# specialized: otherwise Triton compiles one binary per divisibility class of each (a head
# count of 8 under TP 8, a split count of 5, a cache of 1001 blocks), which vLLM's warmup
# cannot enumerate and a request then compiles (vllm.deepinfer.warmup; the launch-key test
# in tests/test_warmup_coverage.py). None of them feeds an address a vector load relies on.
@triton.jit(do_not_specialize=["main_rows", "extra_rows", "num_heads", "num_splits"])
def _sparse_mla_decode_kernel(
    q_ptr, main_cache_ptr, main_idx_ptr, main_indptr_ptr,
    extra_cache_ptr, extra_idx_ptr, extra_indptr_ptr,
    sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, pos_ptr, cs_ptr, ws_ptr, valid_ptr,
    q_stride0, q_stride1, out_stride0, out_stride1, main_stride0, extra_stride0,
    main_rows, extra_rows, cs_stride,
    qk_scale, num_heads, num_splits,
    HAS_EXTRA: tl.constexpr, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr,
    INV_ROPE: tl.constexpr, HW_FP8: tl.constexpr, DOT_FP32: tl.constexpr, ALIGNED: tl.constexpr,
    MAIN_BS: tl.constexpr, EXTRA_BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr, PREDEQUANT: tl.constexpr, QK_HALVES: tl.constexpr,
):
    """Grid (head tiles, splits, tokens). ``qk_scale`` = softmax scale * log2(e).

    SPLIT: write unnormalized (acc, m, l) of this split to the fp32 workspaces (m in the
    log2 domain, before the sink); else finish (sink, normalize, inverse RoPE) and store
    bf16. PREDEQUANT: the keys come as bf16 rows of ``_predequant_kernel``'s workspace
    (``ws_ptr``, validity bytes ``valid_ptr``) instead of records; with QK_HALVES their
    loop is ``_attend_rows_halves`` (``Tile.qk_halves``). DOT_FP32 is an
    interpreter-only switch: the Triton interpreter computes bf16 ``tl.dot`` on raw bit
    patterns, so there the dots take fp32 operands.
    """
    D: tl.constexpr = _D
    NOPE: tl.constexpr = _NOPE
    pid_h = tl.program_id(0)
    split = tl.program_id(1)
    tok = tl.program_id(2)

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    cols = tl.arange(0, D)
    # Row offsets in int64: tok * q_stride0 (heads * 512) passes 2^31 - 1 from 65,536 decode
    # tokens at 64 heads (the output's rows alike).
    q = tl.load(q_ptr + tok.to(tl.int64) * q_stride0 + heads[:, None] * q_stride1
                + cols[None, :], mask=hmask[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    main_start = tl.load(main_indptr_ptr + tok)
    main_len = tl.load(main_indptr_ptr + tok + 1) - main_start
    if HAS_EXTRA:
        extra_start = tl.load(extra_indptr_ptr + tok)
        total = main_len + tl.load(extra_indptr_ptr + tok + 1) - extra_start
    else:
        extra_start = 0
        total = main_len
    # This split's slice of the virtual list [main keys, extra keys], BLOCK_N aligned.
    span = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
    lo = split * span
    hi = tl.minimum(lo + span, total)

    m_i = tl.full((BLOCK_H,), NEG_LARGE, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    ws_base = main_start + extra_start  # this token's first workspace row (PREDEQUANT)
    if PREDEQUANT and QK_HALVES:
        m_i, l_i, acc = _attend_rows_halves(
            q_ptr + tok.to(tl.int64) * q_stride0, q_stride1, heads, hmask, ws_ptr, valid_ptr,
            ws_base, lo, hi, qk_scale, DOT_FP32, BLOCK_H, BLOCK_N)
    else:
        if PREFETCH and not PREDEQUANT:  # the first tile's bytes; each iteration the next's
            code, sbyte, rope_bits, valid = _load_key_tile(
                lo, hi, main_cache_ptr, main_idx_ptr, main_start, main_len, main_stride0,
                main_rows, extra_cache_ptr, extra_idx_ptr, extra_start, extra_stride0, extra_rows,
                HAS_EXTRA, ALIGNED, MAIN_BS, EXTRA_BS, BLOCK_N)
        for k0 in tl.range(lo, hi, BLOCK_N):
            if PREDEQUANT:
                j = k0 + tl.arange(0, BLOCK_N)
                live = j < hi
                row = (ws_base + j).to(tl.int64)
                k = tl.load(ws_ptr + row[:, None] * D + cols[None, :], mask=live[:, None],
                            other=0.0)
                cur_valid = tl.load(valid_ptr + row, mask=live, other=0) != 0
                if DOT_FP32:
                    k = k.to(tl.float32)
            else:
                if PREFETCH:
                    cur_code, cur_sbyte, cur_rope, cur_valid = code, sbyte, rope_bits, valid
                    code, sbyte, rope_bits, valid = _load_key_tile(
                        k0 + BLOCK_N, hi, main_cache_ptr, main_idx_ptr, main_start, main_len,
                        main_stride0, main_rows, extra_cache_ptr, extra_idx_ptr, extra_start,
                        extra_stride0, extra_rows, HAS_EXTRA, ALIGNED, MAIN_BS, EXTRA_BS,
                        BLOCK_N)
                else:
                    cur_code, cur_sbyte, cur_rope, cur_valid = _load_key_tile(
                        k0, hi, main_cache_ptr, main_idx_ptr, main_start, main_len, main_stride0,
                        main_rows, extra_cache_ptr, extra_idx_ptr, extra_start, extra_stride0,
                        extra_rows, HAS_EXTRA, ALIGNED, MAIN_BS, EXTRA_BS, BLOCK_N)
                # One [BLOCK_N, 512] operand (chunks 0..6 NoPE bytes times their scale,
                # chunk 7 the bf16 RoPE tail), NaN-scrubbed.
                k = _build_key_rows(cur_code, cur_sbyte, cur_rope, HW_FP8, BLOCK_N)
                if not DOT_FP32:
                    k = k.to(tl.bfloat16)

            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(cur_valid[None, :], s, NEG_LARGE)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            p = tl.where(cur_valid[None, :], p, 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
            m_i = m_new

    if SPLIT:
        ml = (tok * num_splits + split) * num_heads + heads
        tl.store(part_m_ptr + ml, m_i, mask=hmask)
        tl.store(part_l_ptr + ml, l_i, mask=hmask)
        tl.store(part_acc_ptr + ml.to(tl.int64)[:, None] * D + cols[None, :], acc,
                 mask=hmask[:, None])
    else:
        if HAS_SINK:
            sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * LOG2E
            m_f = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_f)
            l_i = l_i * alpha + tl.exp2(sink - m_f)
            acc = acc * alpha[:, None]
        inv_l = tl.where(l_i > 0.0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
        o = acc * inv_l[:, None]
        if INV_ROPE:
            o = _inv_rope_gptj(o, pos_ptr, cs_ptr, cs_stride, tok, BLOCK_H, D, NOPE)
        tl.store(out_ptr + tok.to(tl.int64) * out_stride0 + heads[:, None] * out_stride1
                 + cols[None, :], o.to(tl.bfloat16), mask=hmask[:, None])


@triton.jit(do_not_specialize=["num_heads", "num_splits"])  # see the decode kernel
def _sparse_mla_decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, sink_ptr, out_ptr, pos_ptr, cs_ptr,
    out_stride0, out_stride1, cs_stride, num_heads, num_splits,
    HAS_SINK: tl.constexpr, INV_ROPE: tl.constexpr, SPLITS_P2: tl.constexpr,
    UNROLL: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Grid (head tiles, tokens): combine the splits' (acc, m, l), add the sink, normalize,
    optional inverse RoPE, store bf16. SPLITS_P2 >= num_splits (power of two): every
    split's (m, l) is read in one load; the [BLOCK_H, 512] partials UNROLL at a time."""
    D: tl.constexpr = _D
    NOPE: tl.constexpr = _NOPE
    pid_h = tl.program_id(0)
    tok = tl.program_id(1)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    cols = tl.arange(0, D)
    base = tok * num_splits * num_heads + heads

    sp = tl.arange(0, SPLITS_P2)
    ml = base[None, :] + sp[:, None] * num_heads
    ml_mask = (sp < num_splits)[:, None] & hmask[None, :]
    m_all = tl.load(part_m_ptr + ml, mask=ml_mask, other=NEG_LARGE)
    m_f = tl.max(m_all, axis=0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * LOG2E
        m_f = tl.maximum(m_f, sink)
    l_f = tl.sum(tl.exp2(m_all - m_f[None, :]) * tl.load(part_l_ptr + ml, mask=ml_mask, other=0.0),
                 axis=0)
    if HAS_SINK:
        l_f += tl.exp2(sink - m_f)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    for s0 in range(0, num_splits, UNROLL):
        for u in tl.static_range(UNROLL):  # independent loads in flight
            idx = base + (s0 + u) * num_heads
            ok = hmask & (s0 + u < num_splits)
            w = tl.exp2(tl.load(part_m_ptr + idx, mask=ok, other=NEG_LARGE) - m_f)
            w = tl.where(ok, w, 0.0)
            acc += w[:, None] * tl.load(part_acc_ptr + idx.to(tl.int64)[:, None] * D + cols[None, :],
                                        mask=ok[:, None], other=0.0)
    inv_l = tl.where(l_f > 0.0, 1.0 / tl.maximum(l_f, 1e-30), 0.0)
    o = acc * inv_l[:, None]
    if INV_ROPE:
        o = _inv_rope_gptj(o, pos_ptr, cs_ptr, cs_stride, tok, BLOCK_H, D, NOPE)
    tl.store(out_ptr + tok.to(tl.int64) * out_stride0 + heads[:, None] * out_stride1
             + cols[None, :], o.to(tl.bfloat16), mask=hmask[:, None])


# ----------------------------------------------------------------------------- host side
_BF16, _U8 = (torch.bfloat16,), (torch.uint8,)


def _check_cache(cache, name: str, device) -> None:
    check_tensor(cache, name, dtypes=_U8, ndim=3, device=device)
    check(cache.shape[2] == RECORD_BYTES and cache.stride(2) == 1
          and cache.stride(1) == RECORD_BYTES, name,
          lambda: f"expected [blocks, block_size, {RECORD_BYTES}] uint8 pages with contiguous "
          f"records, got shape {tuple(cache.shape)} strides {cache.stride()}")


def _ragged(indices, indptr, tokens: int, indices_name: str, indptr_name: str, device):
    """The int32 lists the kernels read. int64 lists are narrowed safely: a slot outside
    [0, 2^31 - 1] becomes -1 (skipped, as every invalid slot is; a plain cast would wrap
    2^32 + 3 onto slot 3), and the indptr values, at most ``indices.numel()``, fit once the
    list is within INDEX_LIMIT, which is checked here (no device sync either way)."""
    check_tensor(indices, indices_name, dtypes=INDEX_DTYPES, ndim=1, device=device)
    check_tensor(indptr, indptr_name, dtypes=INDEX_DTYPES, ndim=1, device=device)
    check(indptr.numel() == tokens + 1, indptr_name,
          lambda: f"expected {tokens + 1} entries (tokens + 1), got {indptr.numel()}")
    check(indices.numel() <= INDEX_LIMIT, indices_name,
          lambda: f"{indices.numel()} entries, more than the {INDEX_LIMIT} the decode's int32 "
          "list offsets can address")
    if indices.dtype != torch.int32:
        indices = torch.where((indices >= 0) & (indices <= 2 ** 31 - 1), indices,
                              -1).to(torch.int32)
    return indices.contiguous(), indptr.to(torch.int32).contiguous()


_PREDEQUANT_VAR = envs.feature_variable(PREDEQUANT_FEATURE)


def _predequant_switched_on(variant: str) -> bool:
    """Whether decode_predequant is on for ``variant``. Launchers run on every layer and
    envs.enabled costs ~6 us on the CI machine, so without DEEPINFER_DECODE_PREDEQUANT and
    DEEPINFER_DISABLE in the environment the answer is the feature's default (read at call
    time); with either, envs.enabled decides (and rejects a malformed value)."""
    if _PREDEQUANT_VAR not in os.environ and "DEEPINFER_DISABLE" not in os.environ:
        return variant in envs.FEATURES[PREDEQUANT_FEATURE].default_on
    return envs.enabled(PREDEQUANT_FEATURE, variant)


def select_tile(variant: str | None, tokens: int, predequant: bool | None = None) -> str:
    """The TILES row a launch of ``tokens`` decode tokens runs. ``variant`` names a row, None
    meaning this process's variant. A variant's own row ("sm80", "sm86", "cpu") gives way to
    its two-phase row ("<variant>-2p") when decode_predequant is on for it (the default;
    DEEPINFER_DECODE_PREDEQUANT=0 or DEEPINFER_DISABLE turns it off) and ``tokens`` >=
    PREDEQUANT_MIN_TOKENS: a host-side choice per launch shape, so fixed for each CUDA graph
    vLLM captures. ``predequant`` True/False forces the variant's two-phase / single-phase
    row (benchmarks, tests). Any other row ("sm80-2p", a benchmark's own) runs as named."""
    name = arch.table_key(variant, TILES)
    two = f"{name}-2p"
    if name not in arch.VARIANTS or two not in TILES:  # a named row, or a hardware-e4m3 one
        if predequant is not None and predequant != TILES[name].predequant:
            raise ValueError(f"predequant: tile row {name!r} has predequant="
                             f"{TILES[name].predequant}, asked for {predequant}")
        return name
    if predequant is None:
        predequant = tokens >= PREDEQUANT_MIN_TOKENS and _predequant_switched_on(name)
    return two if predequant else name


def launch_tiles(variant: str) -> tuple[str, ...]:
    """Every TILES row select_tile can give launches of ``variant`` under the current
    environment (what the JIT warmup compiles): the variant's own row, and its two-phase
    row where decode_predequant is on."""
    name = arch.table_key(variant, TILES)
    two = f"{name}-2p"
    if name in arch.VARIANTS and two in TILES and _predequant_switched_on(name):
        return name, two
    return (name,)


def choose_num_splits(tokens: int, head_tiles: int, avg_keys: float, tile: Tile,
                      sm_count: int) -> int:
    """Split-K factor (measured on H200, docs/sparse-mla-decode.md): split only while the
    grid stays within one wave of ``sm_count * tile.ctas_per_sm`` CTAs, then snap down to
    the fewest splits that give the same key tiles per CTA (every split costs a prologue,
    a partial store and reduce work). 1 (no workspace, no reduce) once the grid fills it."""
    slots = sm_count * tile.ctas_per_sm
    base = max(1, tokens * head_tiles)
    key_tiles = max(1, math.ceil(avg_keys / tile.block_n))
    most = max(1, min(slots // base, key_tiles))
    tiles_per_split = math.ceil(key_tiles / most)
    return math.ceil(key_tiles / tiles_per_split)


def uses_gluon(tile: Tile, heads: int) -> bool:
    """Whether a launch of ``heads`` heads on ``tile`` runs phase 2 as the Gluon kernel. A
    Gluon row that cannot (no Gluon in this Triton, the interpreter, fewer heads than its
    program holds) runs the Triton phase 2; either way it says which kernel runs, once per
    reason."""
    if not (tile.predequant and tile.gluon_heads):
        return False
    if not glk.AVAILABLE:
        _gluon_fallback("this Triton has no Gluon")
    elif arch.interpreting():
        _gluon_fallback("the Triton interpreter runs no Gluon kernel")
    elif heads < tile.gluon_heads:
        _gluon_fallback(f"{heads} heads, fewer than the {tile.gluon_heads} of one program")
    else:
        arch.log_once("sparse_mla_decode", "a Gluon phase-2 row runs the Gluon kernel",
                      f"{tile.gluon_heads} heads per program")
        return True
    return False


def _gluon_fallback(reason: str) -> None:
    arch.log_once("sparse_mla_decode", "a Gluon phase-2 row runs the Triton phase 2", reason)


def phase2_tile(tile: Tile, heads: int) -> Tile:
    """The tile whose head and key blocks and residency the launch plan uses: ``tile``, or
    the Gluon kernel's (``gluon_heads`` heads x 16 keys, its warps and CTAs per SM)."""
    if not uses_gluon(tile, heads):
        return tile
    g = tile.gluon_heads
    return dataclasses.replace(tile, block_h=g, block_n=glk.BLOCK_N, num_warps=glk.warps(g),
                               ctas_per_sm=glk.ctas_per_sm(g))


def launch_plan(tokens: int, heads: int, avg_keys: float, tile: Tile, sm_count: int,
                num_kv_splits: int | None = None) -> tuple[int, int]:
    """(heads per program, split count) for one launch."""
    tile = phase2_tile(tile, heads)
    # Fewer heads than the tile: shrink it (tl.dot needs at least 16 rows).
    block_h = max(16, min(tile.block_h, triton.next_power_of_2(heads)))
    if num_kv_splits is None:
        num_kv_splits = choose_num_splits(tokens, triton.cdiv(heads, block_h), avg_keys, tile,
                                          sm_count)
    return block_h, num_kv_splits


def scratch_specs(tokens: int, heads: int, rows: int, num_splits: int, predequant: bool,
                  need_out: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The buffers one launch uses besides its inputs, as (name, shape, dtype), in the order
    a ``workspace`` gets them: the bf16 output [tokens, heads, 512] when the caller gives no
    ``out``; with ``num_splits`` > 1 the fp32 split partials part_m, part_l [tokens, splits,
    heads] and part_acc [tokens, splits, heads, 512]; in the two-phase path the bf16 rows
    ws [rows, 512] and their validity bytes valid [rows] (``rows`` = the index entries of
    all tokens, main + extra; at least 1)."""
    f32, bf16 = torch.float32, torch.bfloat16
    specs = []
    if need_out:
        specs.append(("out", (tokens, heads, HEAD_DIM), bf16))
    if num_splits > 1:
        specs += [("part_m", (tokens, num_splits, heads), f32),
                  ("part_l", (tokens, num_splits, heads), f32),
                  ("part_acc", (tokens, num_splits, heads, HEAD_DIM), f32)]
    if predequant:
        r = max(rows, 1)
        specs += [("ws", (r, HEAD_DIM), bf16), ("valid", (r,), torch.uint8)]
    return specs


def scratch_plan(name: str, tokens: int, heads: int, rows: int, sm_count: int,
                 num_kv_splits: int | None = None, need_out: bool = True):
    """(heads per program, split count, ``scratch_specs``) of a launch of ``tokens`` >= 1
    tokens x ``heads`` >= 1 heads over ``rows`` index entries on the TILES row ``name``
    (what ``select_tile`` chose): the plan the launcher runs, shared with the profile run's
    reservation (vllm.deepinfer.reserve)."""
    tile = TILES[name]
    block_h, splits = launch_plan(tokens, heads, rows / tokens, tile, sm_count, num_kv_splits)
    return block_h, splits, scratch_specs(tokens, heads, rows, splits, tile.predequant,
                                          need_out)


def _scratch(specs, workspace, dev) -> dict[str, torch.Tensor]:
    """The launch's buffers: allocated, or the views ``workspace(shapes)`` returns (one
    call for all of them, as vLLM's ``get_simultaneous``: they are used at the same time),
    each checked against its spec."""
    if not specs:
        return {}
    if workspace is None:
        return {n: torch.empty(s, dtype=d, device=dev) for n, s, d in specs}
    views = list(workspace([(s, d) for _, s, d in specs]))
    check(len(views) == len(specs), "workspace",
          lambda: f"returned {len(views)} buffers for {len(specs)} requests")
    for (n, s, d), v in zip(specs, views):
        check_tensor(v, f"workspace[{n}]", dtypes=(d,), ndim=len(s), device=dev,
                     contiguous=True)
        check(tuple(v.shape) == s, f"workspace[{n}]",
              lambda v=v, s=s: f"expected shape {s}, got {tuple(v.shape)}")
    return {n: v for (n, _, _), v in zip(specs, views)}


def sparse_attn_decode(q, main_cache, main_indices, main_indptr, scale, attn_sink,
                       nope_head_dim, rope_head_dim, extra_cache=None, extra_indices=None,
                       extra_indptr=None, out=None, inv_rope_positions=None,
                       inv_rope_cos_sin_cache=None, *, num_kv_splits=None, variant=None,
                       predequant=None, workspace=None):
    """Sparse MLA decode over 584-byte records; returns ``out`` [tokens, heads, 512] bf16.

    Arguments as upstream's ``_rocm_sparse_attn_decode_ragged_triton``: ``q`` [tokens,
    heads, 512] bf16; ``main_cache``/``extra_cache`` [blocks, block_size, 584] uint8, rows
    addressed by slot = block * block_size + pos (pages through ``cache.stride(0)``);
    ``*_indices`` ragged int32 slot lists with ``*_indptr`` [tokens + 1] (entries < 0 or
    out of range are skipped); ``attn_sink`` [heads] float or None; ``scale`` the softmax
    scale. The extra triple is given entirely or not at all.

    ``inv_rope_positions`` [tokens] (with ``inv_rope_cos_sin_cache`` [P, 64] = cos | sin):
    the output's dims 448..511 get the inverse GPT-J RoPE, applied exactly once, in the
    no-split path and the split path alike (upstream's CUDA fallback ignores it).

    ``num_kv_splits``: None picks the split-K factor from the SM count and key count
    (``choose_num_splits``); an int forces it (tests). ``variant``: tile/fp8 variant,
    None meaning ``arch.current().name``; "cpu" runs the sm80 code in the interpreter. On
    sm80/sm86/cpu, launches of PREDEQUANT_MIN_TOKENS tokens or more run in two phases
    (``select_tile``); ``predequant`` True/False forces two / one phase there.

    ``workspace``: None allocates the launch's buffers (``scratch_specs``: split partials,
    two-phase rows, and ``out`` when not given); a callable ``workspace([(shape, dtype),
    ...])`` returning one view per request (vLLM's ``get_simultaneous``: the served path,
    vllm.deepinfer.reserve) supplies them instead, ``out`` included, so the result may be
    a view of that workspace: read it before the workspace's next use.
    """
    name = arch.table_key(variant, TILES)
    check_mla_query(q, nope_head_dim, rope_head_dim, scale)
    dev = q.device
    tokens, heads, _ = q.shape
    name = select_tile(name, tokens, predequant)
    v = arch.VARIANTS[name.split("-")[0]]  # "sm80-2p": the sm80 variant's fp8 and tiles
    tile = TILES[name]
    predequant = tile.predequant
    _check_cache(main_cache, "main_cache", dev)
    main_indices, main_indptr = _ragged(main_indices, main_indptr, tokens, "main_indices",
                                        "main_indptr", dev)
    has_extra = extra_cache is not None
    check((extra_indices is None) != has_extra and (extra_indptr is None) != has_extra,
          "extra_cache/extra_indices/extra_indptr", "give all three or none")
    if has_extra:
        _check_cache(extra_cache, "extra_cache", dev)
        extra_indices, extra_indptr = _ragged(extra_indices, extra_indptr, tokens,
                                              "extra_indices", "extra_indptr", dev)
    else:
        extra_cache, extra_indices, extra_indptr = main_cache, main_indices, main_indptr
    has_sink = attn_sink is not None
    if has_sink:
        check_tensor(attn_sink, "attn_sink", dtypes=FLOAT_DTYPES, ndim=1, device=dev)
        check(attn_sink.numel() == heads, "attn_sink",
              lambda: f"expected [{heads}] (one per head), got {tuple(attn_sink.shape)}")
        attn_sink = attn_sink.contiguous()
    inv_rope = inv_rope_positions is not None
    check((inv_rope_cos_sin_cache is not None) == inv_rope,
          "inv_rope_positions/inv_rope_cos_sin_cache", "give both or neither")
    if inv_rope:
        check_tensor(inv_rope_positions, "inv_rope_positions", dtypes=INDEX_DTYPES, ndim=1,
                     device=dev)
        check(inv_rope_positions.numel() == tokens, "inv_rope_positions",
              lambda: f"expected [{tokens}], got {tuple(inv_rope_positions.shape)}")
        check_tensor(inv_rope_cos_sin_cache, "inv_rope_cos_sin_cache", dtypes=FLOAT_DTYPES,
                     ndim=2, device=dev)
        check(inv_rope_cos_sin_cache.shape[1] == ROPE_DIM
              and inv_rope_cos_sin_cache.stride(1) == 1, "inv_rope_cos_sin_cache",
              lambda: f"expected [positions, {ROPE_DIM}] = cos | sin with a contiguous last "
              f"dim, got shape {tuple(inv_rope_cos_sin_cache.shape)}")
        inv_rope_positions = inv_rope_positions.contiguous()
    if out is not None:
        check_tensor(out, "out", dtypes=_BF16, ndim=3, device=dev)
        check(out.shape == q.shape and out.stride(2) == 1, "out",
              lambda: f"expected {tuple(q.shape)} with a contiguous last dim, got shape "
              f"{tuple(out.shape)} strides {out.stride()}")
    if num_kv_splits is not None:
        check(isinstance(num_kv_splits, int) and num_kv_splits >= 1, "num_kv_splits",
              lambda: f"expected an int >= 1, got {num_kv_splits!r}")
    check(workspace is None or callable(workspace), "workspace",
          lambda: f"expected None or a callable, got {type(workspace).__name__}")
    if tokens == 0 or heads == 0:
        return out if out is not None else torch.empty(tokens, heads, HEAD_DIM,
                                                       dtype=torch.bfloat16, device=dev)

    # Average keys per token from the index sizes (rows / tokens): no device sync, as
    # upstream does. The two-phase rows: one per index entry of every token.
    rows = main_indices.numel() + (extra_indices.numel() if has_extra else 0)
    avg_keys = rows / tokens
    check(not predequant or rows <= INDEX_LIMIT, "main_indices/extra_indices",
          lambda: f"{rows} entries together, more than the {INDEX_LIMIT} the two-phase "
          "decode's int32 workspace row offsets (main_indptr[t] + extra_indptr[t]) can address")
    block_h, num_kv_splits, specs = scratch_plan(name, tokens, heads, rows, arch.sm_count(dev),
                                                 num_kv_splits, need_out=out is None)
    bufs = _scratch(specs, workspace, dev)
    if out is None:
        out = bufs["out"]
    head_tiles = triton.cdiv(heads, block_h)
    split = num_kv_splits > 1
    cs_stride = inv_rope_cos_sin_cache.stride(0) if inv_rope else 0
    main_rows = main_cache.shape[0] * main_cache.shape[1]
    extra_rows = extra_cache.shape[0] * extra_cache.shape[1]
    # 16-byte vector loads of the records need 16-byte aligned rows: 576 * pos is, the page
    # base is when the cache pointer and the page stride are.
    aligned = all(c.data_ptr() % 16 == 0 and c.stride(0) % 16 == 0
                  for c in (main_cache, extra_cache))
    qk_scale = float(scale) * LOG2E.value
    gluon = uses_gluon(tile, heads)

    if predequant:
        # One bf16 row and one validity byte per (token, key): rows of token t start at
        # main_indptr[t] + extra_indptr[t] (both prefix sums), sized from the index lists
        # (numel(), no device sync). Cost: rows x (1 KiB + 1 B), e.g. a 512-token batch x
        # 640 keys 320 MiB, x (8192 + 128) keys (V4 C128A, 1M) 4.1 GiB. Served launches take
        # them from vLLM's workspace (``workspace``), grown to the worst case in the profile
        # run (vllm.deepinfer.reserve); without one they are allocated per call (inside a
        # CUDA-graph capture, from the graph's private pool).
        ws, valid = bufs["ws"], bufs["valid"]
        per_token = max(1, min(triton.cdiv(max(1, int(avg_keys)), tile.block_n),
                               triton.cdiv(PREDEQUANT_PROGRAMS_PER_SM * arch.sm_count(dev),
                                           tokens)))

    def run(t0: int, t1: int) -> None:
        """Tokens [t0, t1): every per-token tensor as that chunk's rows (the whole tensors
        when the chunk is the launch); index lists, caches and the two-phase workspace
        whole (indptr values and workspace rows are absolute)."""
        whole = t0 == 0 and t1 == tokens
        n = t1 - t0

        def rows_of(t):
            return t if whole else t[t0:t1]
        mp = main_indptr if whole else main_indptr[t0:t1 + 1]
        ep = extra_indptr if whole else extra_indptr[t0:t1 + 1]
        qc, oc = rows_of(q), rows_of(out)
        # Unused arguments get stand-ins of the dtypes the warmup compiles for
        # (vllm.deepinfer.warmup._stand_ins): ``out`` for unsplit partials, a missing sink,
        # the cos/sin cache without inverse RoPE and a one-phase launch's workspace rows;
        # ``main_indptr`` for absent positions and validity bytes.
        pm, pl, pa = ((rows_of(bufs["part_m"]), rows_of(bufs["part_l"]),
                       rows_of(bufs["part_acc"])) if split else (oc, oc, oc))
        sink_arg = attn_sink if has_sink else oc
        pos_arg = rows_of(inv_rope_positions) if inv_rope else mp
        cs_arg = inv_rope_cos_sin_cache if inv_rope else oc
        ws_arg, valid_arg = (ws, valid) if predequant else (oc, mp)
        if predequant:
            _predequant_kernel[(per_token, n)](
                main_cache, main_indices, mp, extra_cache, extra_indices, ep,
                ws, valid, main_cache.stride(0), extra_cache.stride(0), main_rows, extra_rows,
                HAS_EXTRA=has_extra, HW_FP8=v.hw_fp8, ALIGNED=aligned,
                MAIN_BS=main_cache.shape[1], EXTRA_BS=extra_cache.shape[1],
                BLOCK_N=PREDEQUANT_BLOCK_N, DECODE=PREDEQUANT_DECODES[tile.predequant_decode],
                num_warps=PREDEQUANT_WARPS, num_stages=1)
        if gluon:
            glk.attend_rows(
                (head_tiles, num_kv_splits, n), qc, ws_arg, valid_arg, mp, ep, sink_arg, oc,
                pm, pl, pa, pos_arg, cs_arg, cs_stride, qk_scale, heads, num_kv_splits,
                has_extra=has_extra, has_sink=has_sink, split=split,
                inv_rope=inv_rope and not split, block_h=tile.gluon_heads)
        else:
            _sparse_mla_decode_kernel[(head_tiles, num_kv_splits, n)](
                qc, main_cache, main_indices, mp, extra_cache, extra_indices, ep,
                sink_arg, oc, pm, pl, pa, pos_arg, cs_arg, ws_arg, valid_arg,
                qc.stride(0), qc.stride(1), oc.stride(0), oc.stride(1),
                main_cache.stride(0), extra_cache.stride(0), main_rows, extra_rows, cs_stride,
                qk_scale, heads, num_kv_splits,
                HAS_EXTRA=has_extra, HAS_SINK=has_sink, SPLIT=split,
                INV_ROPE=inv_rope and not split, HW_FP8=v.hw_fp8, DOT_FP32=arch.interpreting(),
                ALIGNED=aligned, MAIN_BS=main_cache.shape[1], EXTRA_BS=extra_cache.shape[1],
                BLOCK_H=block_h, BLOCK_N=tile.block_n, PREFETCH=tile.prefetch,
                PREDEQUANT=predequant, QK_HALVES=predequant and tile.qk_halves,
                num_warps=tile.num_warps, num_stages=tile.num_stages)
        if split:
            rbh = tile.reduce_block_h
            _sparse_mla_decode_reduce_kernel[(triton.cdiv(heads, rbh), n)](
                pm, pl, pa, sink_arg, oc, pos_arg, cs_arg,
                oc.stride(0), oc.stride(1), cs_stride, heads, num_kv_splits,
                HAS_SINK=has_sink, INV_ROPE=inv_rope,
                SPLITS_P2=triton.next_power_of_2(num_kv_splits),
                UNROLL=REDUCE_UNROLL, BLOCK_H=rbh, num_warps=tile.reduce_warps)

    for t0 in range(0, tokens, GRID_TOKENS):
        run(t0, min(tokens, t0 + GRID_TOKENS))
    return out


# ----------------------------------------------------------------------------- compile gate
_MAIN_SIG = {
    "q_ptr": "*bf16", "main_cache_ptr": "*u8", "main_idx_ptr": "*i32", "main_indptr_ptr": "*i32",
    "extra_cache_ptr": "*u8", "extra_idx_ptr": "*i32", "extra_indptr_ptr": "*i32",
    "sink_ptr": "*fp32", "out_ptr": "*bf16", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
    "part_acc_ptr": "*fp32", "pos_ptr": "*i64", "cs_ptr": "*fp32", "ws_ptr": "*bf16",
    "valid_ptr": "*u8",
    **{k: "i32" for k in ("q_stride0", "q_stride1", "out_stride0", "out_stride1",
                          "main_stride0", "extra_stride0", "main_rows", "extra_rows",
                          "cs_stride")},
    "qk_scale": "fp32", "num_heads": "i32", "num_splits": "i32",
    **{k: "constexpr" for k in ("HAS_EXTRA", "HAS_SINK", "SPLIT", "INV_ROPE", "HW_FP8",
                                "DOT_FP32", "ALIGNED", "MAIN_BS", "EXTRA_BS", "BLOCK_H",
                                "BLOCK_N", "PREFETCH", "PREDEQUANT", "QK_HALVES")},
}
_PREDEQUANT_SIG = {
    "main_cache_ptr": "*u8", "main_idx_ptr": "*i32", "main_indptr_ptr": "*i32",
    "extra_cache_ptr": "*u8", "extra_idx_ptr": "*i32", "extra_indptr_ptr": "*i32",
    "ws_ptr": "*bf16", "valid_ptr": "*u8",
    **{k: "i32" for k in ("main_stride0", "extra_stride0", "main_rows", "extra_rows")},
    **{k: "constexpr" for k in ("HAS_EXTRA", "HW_FP8", "ALIGNED", "MAIN_BS", "EXTRA_BS",
                                "BLOCK_N", "DECODE")},
}
_REDUCE_SIG = {
    "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "sink_ptr": "*fp32",
    "out_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32",
    **{k: "i32" for k in ("out_stride0", "out_stride1", "cs_stride", "num_heads", "num_splits")},
    **{k: "constexpr" for k in ("HAS_SINK", "INV_ROPE", "SPLITS_P2", "UNROLL", "BLOCK_H")},
}
# Variants the gate builds ("sm80" also covers sm_86; sm86's tile is sm80's).
GATE_VARIANTS = ("sm80", "sm89", "sm90", "sm100")
# Block sizes the gate builds with (constexpr in the kernel): the production SWA page and the
# entries of a ratio-1 V4.1 compressed page as the Ampere path serves it (kv_page64: 64-token
# pages, so 64 entries; 32 at ratio 2, 128 with DEEPINFER_KV_PAGE64=0: the warmup compiles
# those; the tile's shared memory does not depend on it).
GATE_SWA_PAGE = shapes.SWA_PAGE
GATE_COMPRESSED_PAGE = shapes.compressed_entries(shapes.COMPRESSED_PAGE["sm80"], 1)
# Split-count bucket the gate builds the reduce with (512 + 128 keys in 64-key tiles: <= 16).
GATE_SPLITS_P2 = 16


def _register() -> None:
    # The dense -> ragged conversion that builds the decode's lists (its own module).
    add_provider("vllm.deepinfer.kernels.ragged_indices")
    for v in GATE_VARIANTS:
        t = TILES[v]
        for split in (False, True):
            register(GateSpec(
                name=f"sparse_mla_decode.{'partial' if split else 'direct'}[{v}]",
                kernel=_sparse_mla_decode_kernel, signature=_MAIN_SIG,
                constexprs=dict(HAS_EXTRA=True, HAS_SINK=True, SPLIT=split, INV_ROPE=not split,
                                HW_FP8=arch.VARIANTS[v].hw_fp8, DOT_FP32=False, ALIGNED=True,
                                MAIN_BS=GATE_SWA_PAGE, EXTRA_BS=GATE_COMPRESSED_PAGE,
                                BLOCK_H=t.block_h, BLOCK_N=t.block_n, PREFETCH=t.prefetch,
                                PREDEQUANT=False, QK_HALVES=False),
                variants=(v,), num_warps=t.num_warps, num_stages=t.num_stages, feature=FEATURE))
        register(GateSpec(
            name=f"sparse_mla_decode.reduce[{v}]", kernel=_sparse_mla_decode_reduce_kernel,
            signature=_REDUCE_SIG, constexprs=dict(HAS_SINK=True, INV_ROPE=True,
                                                   SPLITS_P2=GATE_SPLITS_P2, UNROLL=REDUCE_UNROLL,
                                                   BLOCK_H=t.reduce_block_h),
            variants=(v,), num_warps=t.reduce_warps, num_stages=1, feature=FEATURE))
    # The two-phase Ampere path: its attention kernel (bf16 rows, both split modes) and its
    # dequantizing first phase, on sm_80 (and sm_86).
    t = TILES["sm80-2p"]
    for split in (False, True):
        register(GateSpec(
            name=f"sparse_mla_decode.{'partial' if split else 'direct'}[sm80-2p]",
            kernel=_sparse_mla_decode_kernel, signature=_MAIN_SIG,
            constexprs=dict(HAS_EXTRA=True, HAS_SINK=True, SPLIT=split, INV_ROPE=not split,
                            HW_FP8=False, DOT_FP32=False, ALIGNED=True, MAIN_BS=GATE_SWA_PAGE,
                            EXTRA_BS=GATE_COMPRESSED_PAGE, BLOCK_H=t.block_h, BLOCK_N=t.block_n,
                            PREFETCH=False, PREDEQUANT=True, QK_HALVES=t.qk_halves),
            variants=("sm80",), num_warps=t.num_warps, num_stages=t.num_stages, feature=FEATURE))
    register(GateSpec(
        name="sparse_mla_decode.predequant[sm80-2p]", kernel=_predequant_kernel,
        signature=_PREDEQUANT_SIG,
        constexprs=dict(HAS_EXTRA=True, HW_FP8=False, ALIGNED=True, MAIN_BS=GATE_SWA_PAGE,
                        EXTRA_BS=GATE_COMPRESSED_PAGE, BLOCK_N=PREDEQUANT_BLOCK_N,
                        DECODE=PREDEQUANT_DECODES[t.predequant_decode]),
        variants=("sm80",), num_warps=PREDEQUANT_WARPS, num_stages=1, feature=FEATURE))
    if glk.AVAILABLE:  # phase 2 as the Gluon kernel (Tile.gluon_heads)
        for g in glk.HEADS:
            for split in (False, True):
                register(GateSpec(
                    name=f"sparse_mla_decode.gluon{g}.{'partial' if split else 'direct'}"
                         "[sm80-2p]",
                    kernel=glk._attend_rows_kernel, signature=glk.SIGNATURE,
                    constexprs=dict(HAS_EXTRA=True, HAS_SINK=True, SPLIT=split,
                                    INV_ROPE=not split, DSPLIT=glk.DSPLIT, H=g),
                    variants=("sm80",), num_warps=glk.warps(g), num_stages=1, feature=FEATURE,
                    aligned_pointers=True))

_register()
