"""DeepSeek-V4 compressed-KV writers without fp8e4nv: compress -> RMSNorm -> RoPE -> fp8 -> insert.

``compress_norm_rope_store_triton`` replaces upstream's function of that name
(models/deepseek_v4/common/ops/fused_compress_quant_cache.py) for its two fp8 kernels:

- head 512 (the c4a/c128a attention KV): ``_fused_kv_compress_norm_rope_insert_sparse_attn``,
  the 584-byte record (448 e4m3 NoPE + 64 bf16 RoPE + 7 UE8M0 scales and a pad byte);
- head 128 (the c4a indexer K): ``_fused_kv_compress_norm_rope_insert_indexer_attn``, the
  132-byte FP8 row (128 e4m3 + one fp32 scale, or four packed UE8M0 bytes with ``mx_scale``).

Both gather the (1 + overlap) * compress_ratio fp32 state rows of a group through the
state block table, pool them with a per-column softmax of the scores, RMSNorm the pooled
row, rotate its last 64 dims (GPT-J, at the group's first position), quantize and store
it: one kernel, one program per token, as upstream. Each runs upstream's fp32 op sequence;
the e4m3 bytes come from ``fp8.cvt_f32_to_e4m3(x, HW_FP8)``.

Which upstream path reaches them on CUDA (models/deepseek_v4/compressor.py): the indexer
(head 128) always takes ``compress_norm_rope_store_triton``; head 512 takes the CuTeDSL
compressor (``_SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL``), whose inline
``cvt.rn.satfinite.e4m3x2.f32`` needs sm_89, so on SM80/SM86 the head-512 write has no
upstream kernel at all; our head-512 path is the port of upstream's Triton kernel for it
(the one ROCm/XPU run) and accepts the CuTeDSL call's extra keywords, so the routing can
call it in either place. Not ported: the MXFP4 indexer cache (``use_fp4_cache``, needs the
sm_100 e2m1 cvt), the plain full-cache rows (``store_full_kv``: FlashInfer layouts, not
used on Ampere), the ROCm-only two-stage split (``compress_norm_rope_store_two_stage_triton``:
``_prefer_two_stage_compressor()`` is ``is_rocm()``), gfx950's NaN sanitizing and PDL.
See docs/fp8-writers.md.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from vllm.deepinfer import arch
from vllm.deepinfer import kv_record as rec
from vllm.deepinfer.fp8 import cvt_f32_to_e4m3
from vllm.deepinfer.kernels import shapes
from vllm.deepinfer.kernels.checks import INDEX_DTYPES, check, check_tensor, fail
from vllm.deepinfer.kernels.fp8_writers import (AMAX_FLOOR, FP8_MAX, UE8M0_MAX, register_writer,
                                                rope_tail_pairs, store_fp8_key_row)

__all__ = ["compress_norm_rope_store_triton", "launch_constexprs"]

# Warps per program, per variant. Both kernels reduce with floating-point sums (the
# softmax denominator, the pooled sum over the window's rows, the RMSNorm sum of squares);
# Triton's reduction tree, and so the fp32 rounding, follows the layout, which follows the
# warp count. Every variant keeps upstream's count: 4 for head 512, 1 for the indexer.
_SPARSE_ATTN_WARPS = {"cpu": 4, "sm80": 4, "sm86": 4, "sm89": 4, "sm90": 4, "sm100": 4}
_INDEXER_WARPS = {"cpu": 1, "sm80": 1, "sm86": 1, "sm89": 1, "sm90": 1, "sm100": 1}


SPARSE_ATTN_HEAD_DIM = rec.HEAD_DIM        # 512: 448 NoPE + 64 RoPE
INDEXER_HEAD_DIM = rec.INDEX_HEAD_DIM      # V4 index_head_dim (128)
ROPE_HEAD_DIM = rec.ROPE_DIM               # qk_rope_head_dim, the rotated tail of both heads
INDEXER_QUANT_BLOCK = rec.INDEX_HEAD_DIM   # one fp8 scale per index key
INDEXER_SCALE_BYTES = rec.INDEX_SCALE_BYTES  # one fp32 (or four packed UE8M0 bytes, MX scales)
STATE_DTYPE = torch.float32                # upstream's CompressorStateCache asserts fp32


# ----------------------------------------------------------------- shared: pool + RMSNorm
@triton.jit
def _pool_and_norm(state, state_stride0, state_stride1, req, position, block_table,
                   block_table_stride, block_size, norm_weight, eps,
                   HEAD: tl.constexpr, STATE_WIDTH: tl.constexpr,
                   COMPRESS_RATIO: tl.constexpr, OVERLAP: tl.constexpr):
    """Softmax-pooled window of state rows, RMSNormed: [HEAD] fp32, upstream's op sequence.

    The window is the (1 + OVERLAP) * COMPRESS_RATIO positions ending at ``position``;
    rows before position 0 are masked (score -inf, kv 0). A state row holds kv in
    [0, STATE_WIDTH) and scores in [STATE_WIDTH, 2 * STATE_WIDTH); with OVERLAP the
    older group's rows use the first HEAD columns of each half and the newer group's
    the second.
    """
    WINDOW: tl.constexpr = (1 + OVERLAP) * COMPRESS_RATIO
    rows = tl.arange(0, WINDOW)
    pos = position - WINDOW + 1 + rows
    valid = pos >= 0
    # int64 request row: req * block_table_stride passes 2^31 - 1 from 8,192 requests at a 1M
    # max_model_len (4-token state pages: 262,144 block-table columns).
    page = tl.load(block_table + req.to(tl.int64) * block_table_stride + pos // block_size,
                   mask=valid, other=0)
    row = pos % block_size
    head_offset = (rows >= COMPRESS_RATIO).to(tl.int32) * HEAD
    row_base = state + page.to(tl.int64) * state_stride0 + row * state_stride1 + head_offset
    d = tl.arange(0, HEAD)
    src = row_base[:, None] + d[None, :]
    score = tl.load(src + STATE_WIDTH, mask=valid[:, None], other=float("-inf"))
    score = tl.softmax(score, dim=0)
    kv = tl.load(src, mask=valid[:, None], other=0.0)
    pooled = tl.sum(kv * score, axis=0)

    w = tl.load(norm_weight + d).to(tl.float32)
    variance = tl.sum(pooled * pooled, axis=0) / HEAD
    return pooled * tl.rsqrt(variance + eps) * w


# ----------------------------------------------------------------- head 512: 584-byte record
# block_size (the state cache's) and the page stride are runtime values: vLLM pads V4's
# compressed pages to the largest page of the model (C128A's 2-entry pages were 141,696
# bytes in the H200 e2e run, not 2 x 584), so a constexpr stride or a specialized block size
# compiled again while serving (benchmarks/results/archive/h200-2026-12-01-e2e-4ab26c8.json,
# zero_compile). Strides are multiples of 576 bytes: one "divisible by 16" build. The
# entries per page (cache_block: 64 for C4A, 2 for C128A) are unspecialized too: the
# 5f462a5 run still compiled C128A's 2-entry form while serving. The block table's row
# stride (blocks per request: max_model_len over the state block size) varies with the
# configuration, so it is unspecialized as in the indexer's kernel; and the C128A form, which
# vLLM's load need not launch, is compiled by the JIT warmup (vllm.deepinfer.warmup,
# _writer_keys; the d80f014 run compiled it while serving).
@triton.jit(do_not_specialize=["num_slots", "block_size", "cache_block", "block_table_stride"])
def _compress_sparse_attn_kernel(
    state, state_stride0, state_stride1,
    token_to_req, positions, state_slots, block_table, block_table_stride, block_size,
    norm_weight, eps, cos_sin, cos_stride,
    cache, cache_slots, cache_block, num_slots, cache_stride,
    HEAD: tl.constexpr, STATE_WIDTH: tl.constexpr, COMPRESS_RATIO: tl.constexpr,
    OVERLAP: tl.constexpr, ROPE: tl.constexpr, QBLOCK: tl.constexpr,
    DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """One program per token; a group's last token writes the group's 584-byte record."""
    t = tl.program_id(0)
    if tl.load(state_slots + t) < 0:
        return
    position = tl.load(positions + t)
    if (position + 1) % COMPRESS_RATIO != 0:
        return
    normed = _pool_and_norm(state, state_stride0, state_stride1, tl.load(token_to_req + t),
                            position, block_table, block_table_stride, block_size,
                            norm_weight, eps, HEAD, STATE_WIDTH, COMPRESS_RATIO, OVERLAP)
    # The cache slot is read after the pooling, as upstream does. Reading it first would
    # skip the gather for slot -1 (padding) tokens, but the sm_90 build then took 7 more
    # registers at ratio 4 and more spill at ratio 128; in this order both builds use
    # exactly upstream's registers and stack.
    slot = tl.load(cache_slots + t)
    if (slot < 0) | (slot >= num_slots):  # padding, or past the cache: nothing to write
        return

    NOPE: tl.constexpr = HEAD - ROPE
    NBLK: tl.constexpr = HEAD // QBLOCK
    d = tl.arange(0, HEAD)
    page = cache + (slot // cache_block).to(tl.int64) * cache_stride
    row = slot % cache_block
    data = page + row * DATA_BYTES
    scale_dst = page + cache_block * DATA_BYTES + row * SCALE_BYTES

    # NoPE: the normed row rounded through bf16, one UE8M0 scale per QBLOCK dims. All
    # NBLK blocks are computed (one tile); the RoPE block's bytes and scale are masked.
    blocks = tl.reshape(normed.to(tl.bfloat16).to(tl.float32), (NBLK, QBLOCK))
    amax = tl.maximum(tl.max(tl.abs(blocks), axis=1), AMAX_FLOOR)
    exponent = tl.ceil(tl.log2(amax * (1.0 / FP8_MAX)))
    scaled = tl.clamp(blocks * tl.reshape(tl.exp2(-exponent), (NBLK, 1)), -FP8_MAX, FP8_MAX)
    tl.store(data + d, tl.reshape(cvt_f32_to_e4m3(scaled, HW_FP8), (HEAD,)), mask=d < NOPE)
    b = tl.arange(0, NBLK)
    encoded = tl.maximum(tl.minimum(exponent + 127.0, UE8M0_MAX), 0.0)
    # NOPE // QBLOCK scale bytes, then the record's zero pad byte.
    tl.store(scale_dst + b, tl.where(b < NOPE // QBLOCK, encoded, 0.0).to(tl.uint8))

    # RoPE: GPT-J rotation of the (unrounded) normed row at the group's first position.
    even, odd = tl.split(tl.reshape(normed, (HEAD // 2, 2)))
    cs_row = cos_sin + (position // COMPRESS_RATIO * COMPRESS_RATIO) * cos_stride
    re, ro = rope_tail_pairs(even, odd, cs_row, HEAD // 2, NOPE // 2, ROPE // 2)
    rope_dst = (data + NOPE).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope_dst + d - NOPE, tl.interleave(re, ro).to(tl.bfloat16), mask=d >= NOPE)


# ----------------------------------------------------------------- head 128: indexer FP8 row
@triton.jit(do_not_specialize=["state_stride0", "state_stride1", "block_table_stride", "eps",
                               "cos_stride", "num_slots", "block_size", "cache_block"])
def _compress_indexer_kernel(
    state, state_stride0, state_stride1,
    token_to_req, positions, state_slots, block_table, block_table_stride, block_size,
    norm_weight, eps, cos_sin, cos_stride,
    cache, cache_slots, cache_block, num_slots, cache_stride,
    HEAD: tl.constexpr, STATE_WIDTH: tl.constexpr, COMPRESS_RATIO: tl.constexpr,
    OVERLAP: tl.constexpr, ROPE: tl.constexpr, SCALE_BYTES: tl.constexpr,
    MX_SCALE: tl.constexpr, HW_FP8: tl.constexpr,
):
    """One program per token; a group's last token stores the group's fp8 index key."""
    t = tl.program_id(0)
    if tl.load(state_slots + t) < 0:
        return
    position = tl.load(positions + t)
    if (position + 1) % COMPRESS_RATIO != 0:
        return
    normed = _pool_and_norm(state, state_stride0, state_stride1, tl.load(token_to_req + t),
                            position, block_table, block_table_stride, block_size,
                            norm_weight, eps, HEAD, STATE_WIDTH, COMPRESS_RATIO, OVERLAP)
    slot = tl.load(cache_slots + t)
    if (slot < 0) | (slot >= num_slots):  # padding, or past the cache: nothing to write
        return

    # GPT-J RoPE of the last ROPE dims, then the whole key rounded through bf16.
    even, odd = tl.split(tl.reshape(normed, (HEAD // 2, 2)))
    cs_row = cos_sin + (position // COMPRESS_RATIO * COMPRESS_RATIO) * cos_stride
    re, ro = rope_tail_pairs(even, odd, cs_row, HEAD // 2, (HEAD - ROPE) // 2, ROPE // 2)
    x = tl.interleave(re, ro).to(tl.bfloat16).to(tl.float32)

    # One power-of-two scale for the key (a single HEAD-wide quant block).
    page = cache + (slot // cache_block).to(tl.int64) * cache_stride
    store_fp8_key_row(x, page, slot % cache_block, cache_block, HEAD, SCALE_BYTES, MX_SCALE,
                      HW_FP8)


# ----------------------------------------------------------------- host side
def _is_pow2(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


_U8 = (torch.uint8,)
_STATE = (STATE_DTYPE,)
_F32_BF16 = (torch.float32, torch.bfloat16)


def _check_cache(kv_cache, name: str, row_bytes: int, dev) -> None:
    check_tensor(kv_cache, name, dtypes=_U8, ndim=3, device=dev)
    check(kv_cache.shape[2] == row_bytes, name,
          lambda: f"expected [blocks, block_size, {row_bytes}], got {tuple(kv_cache.shape)}")
    # Within a page the kernel addresses block_size * row_bytes contiguous bytes (values
    # first, then scales); pages may be further apart (shared physical blocks).
    st = kv_cache.stride()
    check(st[2] == 1 and st[1] == row_bytes and st[0] >= kv_cache.shape[1] * row_bytes, name,
          lambda: f"each page must be {row_bytes}*block_size contiguous bytes, strides {st}")


def compress_norm_rope_store_triton(
    state_cache: torch.Tensor, num_actual: int, token_to_req_indices: torch.Tensor,
    positions: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
    block_size: int, state_width: int, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
    k_cache_metadata: Any, pdl_kwargs: dict, head_dim: int, rope_head_dim: int,
    compress_ratio: int, overlap: bool, use_fp4_cache: bool, rms_norm_weight: torch.Tensor,
    rms_norm_eps: float, quant_block: int, token_stride: int, scale_dim: int, *,
    mx_scale: bool = False, store_full_kv: bool = False, store_full_fp8: bool = False,
    fp8_scale: torch.Tensor | None = None, variant: str | None = None,
) -> None:
    """Compress -> RMSNorm -> RoPE -> fp8 quant -> paged insert; upstream's arguments and bytes.

    ``head_dim`` 512 writes the 584-byte attention record, 128 the 132-byte FP8 indexer
    row. ``mx_scale`` is what upstream reads from ``mqa_logits_use_mx_scales()`` for the
    indexer (True only on SM100). ``store_full_kv``/``store_full_fp8``/``fp8_scale`` are
    the CuTeDSL compressor's keywords (the head-512 call site on CUDA); only the
    ``fp8_ds_mla`` record (``store_full_kv=False``) exists here. ``pdl_kwargs`` is
    accepted and ignored (PDL changes no value and SM80 has none).
    """
    v = arch.resolve(variant)
    del pdl_kwargs
    if store_full_kv or store_full_fp8 or fp8_scale is not None:
        raise NotImplementedError("store_full_kv/store_full_fp8: the plain full-cache rows are a "
                                  "FlashInfer layout; only the fp8_ds_mla record has an fp8-free writer")
    if head_dim == SPARSE_ATTN_HEAD_DIM:
        layout = (rec.QUANT_BLOCK, rec.DATA_BYTES, rec.SCALE_BYTES)
        if use_fp4_cache:
            fail("use_fp4_cache", "the MXFP4 cache is for the indexer (head 128) only")
        row_bytes = rec.RECORD_BYTES
    elif head_dim == INDEXER_HEAD_DIM:
        if use_fp4_cache:
            raise NotImplementedError("use_fp4_cache: the MXFP4 indexer cache needs the sm_100 "
                                      "e2m1 cvt; there is no fp8-free variant of it")
        layout = (INDEXER_QUANT_BLOCK, head_dim, INDEXER_SCALE_BYTES)
        row_bytes = head_dim + INDEXER_SCALE_BYTES
    else:
        fail("head_dim", f"{head_dim}, expected {SPARSE_ATTN_HEAD_DIM} (attention KV) or "
                         f"{INDEXER_HEAD_DIM} (indexer K)")
    if (quant_block, token_stride, scale_dim) != layout:
        fail("quant_block/token_stride/scale_dim", f"({quant_block}, {token_stride}, {scale_dim}); "
             f"the {row_bytes}-byte row of head {head_dim} has {layout}")
    if rope_head_dim != ROPE_HEAD_DIM:
        fail("rope_head_dim", f"{rope_head_dim}, expected {ROPE_HEAD_DIM}")
    if not _is_pow2(compress_ratio):
        fail("compress_ratio", f"{compress_ratio}: the window is a power-of-two tile (V4 uses 4 and 128)")
    overlap = bool(overlap)
    coff = 1 + overlap
    if not (isinstance(num_actual, int) and num_actual >= 0):
        fail("num_actual", f"{num_actual!r}, expected an int >= 0")
    if not (isinstance(block_size, int) and block_size >= 1):
        fail("block_size", f"{block_size!r}, expected a positive int")

    check_tensor(state_cache, "state_cache", dtypes=_STATE, ndim=3)
    dev = state_cache.device
    if state_cache.stride(2) != 1:
        fail("state_cache", f"needs a unit inner stride, strides {state_cache.stride()}")
    if not (coff * head_dim <= state_width <= state_cache.shape[2] - coff * head_dim):
        fail("state_width", f"{state_width}: kv [0, {coff * head_dim}) and scores [state_width, "
             f"state_width + {coff * head_dim}) must fit a state row of {state_cache.shape[2]} "
             "without overlapping")
    kv_slots = getattr(k_cache_metadata, "slot_mapping", None)
    for n, t in (("token_to_req_indices", token_to_req_indices), ("positions", positions),
                 ("slot_mapping", slot_mapping), ("k_cache_metadata.slot_mapping", kv_slots)):
        check_tensor(t, n, dtypes=INDEX_DTYPES, ndim=1, device=dev)
        if not t.is_contiguous():
            fail(n, "must be contiguous")
        if t.numel() < num_actual:
            fail(n, f"{t.numel()} entries for num_actual {num_actual}")
    check_tensor(block_table, "block_table", dtypes=INDEX_DTYPES, ndim=2, device=dev)
    if block_table.stride(1) != 1:
        fail("block_table", f"needs a unit inner stride, strides {block_table.stride()}")
    check_tensor(cos_sin_cache, "cos_sin_cache", dtypes=_F32_BF16, ndim=2, device=dev)
    if cos_sin_cache.shape[1] != rope_head_dim or cos_sin_cache.stride(1) != 1:
        fail("cos_sin_cache", f"expected [max_pos, {rope_head_dim}] with unit inner stride, got "
             f"{tuple(cos_sin_cache.shape)} strides {cos_sin_cache.stride()}")
    check_tensor(rms_norm_weight, "rms_norm_weight", dtypes=_F32_BF16, ndim=1, device=dev)
    if rms_norm_weight.numel() != head_dim or not rms_norm_weight.is_contiguous():
        fail("rms_norm_weight", f"expected {head_dim} contiguous values, got shape "
             f"{tuple(rms_norm_weight.shape)}")
    _check_cache(kv_cache, "kv_cache", row_bytes, dev)
    if num_actual == 0:
        return

    args = (state_cache, state_cache.stride(0), state_cache.stride(1),
            token_to_req_indices, positions, slot_mapping, block_table, block_table.stride(0),
            block_size, rms_norm_weight, rms_norm_eps, cos_sin_cache, cos_sin_cache.stride(0),
            kv_cache, kv_slots, kv_cache.shape[1], kv_cache.shape[0] * kv_cache.shape[1],
            kv_cache.stride(0))
    common = dict(HEAD=head_dim, STATE_WIDTH=state_width, COMPRESS_RATIO=compress_ratio,
                  OVERLAP=overlap, ROPE=rope_head_dim, HW_FP8=v.hw_fp8)
    if head_dim == SPARSE_ATTN_HEAD_DIM:
        _compress_sparse_attn_kernel[(num_actual,)](
            *args, QBLOCK=quant_block, DATA_BYTES=token_stride, SCALE_BYTES=scale_dim,
            num_warps=_SPARSE_ATTN_WARPS[v.name], **common)
    else:
        _compress_indexer_kernel[(num_actual,)](
            *args, SCALE_BYTES=scale_dim, MX_SCALE=bool(mx_scale),
            num_warps=_INDEXER_WARPS[v.name], **common)


# ----------------------------------------------------------------- compile gate
# The launches at V4 shapes: fp32 state pages of 4 rows (c4) / 8 rows (c128) as
# CompressorStateCache allocates them, compressed pages of any 576-byte-aligned stride, a bf16 norm weight
# and an fp32 [max_pos, 64] cos_sin cache. Upstream's overlap rule: on for ratio 4 only.
_SIG = {"state": "*fp32", "state_stride0": "i32", "state_stride1": "i32", "token_to_req": "*i32",
        "positions": "*i64", "state_slots": "*i64", "block_table": "*i32",
        "block_table_stride": "i32", "block_size": "i32", "norm_weight": "*bf16", "eps": "fp32",
        "cos_sin": "*fp32", "cos_stride": "i32", "cache": "*u8", "cache_slots": "*i64",
        "cache_block": "i32", "num_slots": "i32", "cache_stride": "i32", "HEAD": "constexpr",
        "STATE_WIDTH": "constexpr", "COMPRESS_RATIO": "constexpr", "OVERLAP": "constexpr",
        "ROPE": "constexpr"}
def launch_constexprs(ratio: int, head: int) -> dict:
    """The constexprs (HW_FP8 aside) of a V4 compressor launch at ``ratio``: the 584-byte KV
    row (``head`` 512) or the C4A indexer's K row (128). The compile gate and the JIT warmup
    (vllm.deepinfer.warmup._writer_keys) both build from it."""
    ov = ratio == 4  # upstream's overlap rule
    common = {"HEAD": head, "STATE_WIDTH": (1 + ov) * head, "COMPRESS_RATIO": ratio,
              "OVERLAP": ov, "ROPE": ROPE_HEAD_DIM}
    if head == SPARSE_ATTN_HEAD_DIM:
        return {**common, "QBLOCK": rec.QUANT_BLOCK, "DATA_BYTES": rec.DATA_BYTES,
                "SCALE_BYTES": rec.SCALE_BYTES}
    return {**common, "SCALE_BYTES": INDEXER_SCALE_BYTES, "MX_SCALE": False}


# The page stride is a runtime argument (a multiple of vLLM's 576-byte page alignment).
for _cr in (r for r in shapes.V4.ratios if r > 0):
    register_writer(
        f"v4.compress_sparse_attn.cr{_cr}", _compress_sparse_attn_kernel,
        {**_SIG, "QBLOCK": "constexpr", "DATA_BYTES": "constexpr", "SCALE_BYTES": "constexpr"},
        launch_constexprs(_cr, SPARSE_ATTN_HEAD_DIM),
        {v: _SPARSE_ATTN_WARPS[v] for v in ("sm80", "sm90")})
# The indexer exists on the c4a layers only.
register_writer(
    "v4.compress_indexer_fp8.cr4", _compress_indexer_kernel,
    {**_SIG, "SCALE_BYTES": "constexpr", "MX_SCALE": "constexpr"},
    launch_constexprs(4, INDEXER_HEAD_DIM),
    {v: _INDEXER_WARPS[v] for v in ("sm80", "sm90")})
