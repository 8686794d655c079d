"""DeepSeek-V4.1 fp8 writers without fp8e4nv: compressed-KV insert and indexer K store.

``rope_quant_insert`` replaces upstream's ``rope_quant_insert`` for the 584-byte record
(``_rope_quant_insert_kernel``, models/deepseek_v41/common/ops/fused_compress_quant_cache.py):
GPT-J RoPE + UE8M0 block quantization + paged insert of one compressed latent per group.
``indexer_k_norm_rope_store`` replaces the FP8 path of upstream's ``indexer_k_norm_rope_store``
(``_indexer_k_norm_rope_quant_store_kernel``, .../indexer_k_store.py): k_norm RMSNorm + RoPE
+ per-token power-of-two fp8 quantization + paged store.

Each kernel runs upstream's fp32 op sequence; e4m3 bytes come from
``fp8.cvt_f32_to_e4m3(x, HW_FP8)``. Slots < 0 (padding) are skipped as upstream skips them;
so are slots past the cache (upstream would write out of bounds there). Paths with no SM80
use are not ported (they raise):
the 528/288-byte records and plain FlashInfer rows (SM100 layouts), the MXFP4 indexer
cache (needs the sm_100 e2m1 cvt) and ROCm's tiled indexer layout.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.deepinfer import arch
from vllm.deepinfer import kv_record as rec
from vllm.deepinfer.fp8 import cvt_f32_to_e4m3
from vllm.deepinfer.kernels import shapes
from vllm.deepinfer.kernels.checks import INDEX_DTYPES, check, check_tensor
from vllm.deepinfer.kernels.fp8_writers import (AMAX_FLOOR, FP8_MAX, UE8M0_MAX, register_writer,
                                                rope_tail_pairs, store_fp8_key_row)
from vllm.deepinfer.kv_record import TL_HEAD_DIM

__all__ = ["rope_quant_insert", "indexer_k_norm_rope_store"]

# Warps per program, per variant. One program per token: the compressed-KV insert keeps
# upstream's 4 (a 512-wide row, no sum reduction, so any count gives the same bytes). The
# indexer K store reduces a 128-wide sum of squares; Triton's reduction tree, and so the
# fp32 rounding of that sum, depends on the warp count, so it stays at upstream's 1.
_INSERT_WARPS = {"cpu": 4, "sm80": 4, "sm86": 4, "sm89": 4, "sm90": 4, "sm100": 4}
_INDEXER_K_WARPS = {"cpu": 1, "sm80": 1, "sm86": 1, "sm89": 1, "sm90": 1, "sm100": 1}

# V4.1 indexer keys: 128 dims, the last 64 rotated, one 4-byte scale (kv_record's index-K row).
INDEXER_HEAD_DIM, INDEXER_ROPE_DIM = rec.INDEX_HEAD_DIM, rec.INDEX_ROPE_DIM
_INDEXER_SCALE_BYTES = rec.INDEX_SCALE_BYTES
_BF16, _U8 = (torch.bfloat16,), (torch.uint8,)
_COS_SIN_DTYPES = (torch.float32, torch.bfloat16)


# ----------------------------------------------------------------- compressed KV insert
@triton.jit(do_not_specialize=["num_slots"])
def _rope_quant_insert_584_kernel(
    latent, positions, cos_sin, cache, cache_slots, num_slots,
    COS_STRIDE: tl.constexpr, CACHE_STRIDE: tl.constexpr, CACHE_BLOCK: tl.constexpr,
    COMPRESS_RATIO: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    NOPE: tl.constexpr, QBLOCK: tl.constexpr, HW_FP8: tl.constexpr,
):
    """One program per token: a group's last token writes the group's 584-byte record."""
    t = tl.program_id(0)
    slot = tl.load(cache_slots + t)
    if (slot < 0) | (slot >= num_slots):
        return
    position = tl.load(positions + t)
    if (position + 1) % COMPRESS_RATIO != 0:
        return
    HEAD: tl.constexpr = TL_HEAD_DIM
    NBLK: tl.constexpr = HEAD // QBLOCK
    d = tl.arange(0, HEAD)
    x = tl.load(latent + t.to(tl.int64) * HEAD + d).to(tl.float32)
    page = cache + (slot // CACHE_BLOCK).to(tl.int64) * CACHE_STRIDE
    row = slot % CACHE_BLOCK
    data = page + row * DATA_BYTES
    scale_dst = page + CACHE_BLOCK * DATA_BYTES + row * SCALE_BYTES

    # NoPE: one UE8M0 scale per 64 dims. All 8 blocks are computed (a 512-wide tile);
    # the RoPE block's bytes and scale are dropped by the masks.
    blocks = tl.reshape(x, (NBLK, QBLOCK))
    amax = tl.maximum(tl.max(tl.abs(blocks), 1), AMAX_FLOOR)
    exponent = tl.ceil(tl.log2(amax * (1.0 / FP8_MAX)))
    scaled = tl.clamp(blocks * tl.reshape(tl.exp2(-exponent), (NBLK, 1)), -FP8_MAX, FP8_MAX)
    tl.store(data + d, tl.reshape(cvt_f32_to_e4m3(scaled, HW_FP8), (HEAD,)), d < NOPE)
    b = tl.arange(0, NBLK)
    encoded = tl.minimum(tl.maximum(exponent + 127.0, 0.0), UE8M0_MAX)
    # 7 scale bytes, then the record's zero pad byte.
    tl.store(scale_dst + b, tl.where(b < NOPE // QBLOCK, encoded, 0.0).to(tl.uint8))

    # RoPE dims: GPT-J rotation at the group's first position, stored as bf16.
    even, odd = tl.split(tl.reshape(x, (HEAD // 2, 2)))
    cs_row = cos_sin + (position // COMPRESS_RATIO * COMPRESS_RATIO) * COS_STRIDE
    re, ro = rope_tail_pairs(even, odd, cs_row, HEAD // 2, NOPE // 2, (HEAD - NOPE) // 2)
    rope_dst = (data + NOPE).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope_dst + d - NOPE, tl.interleave(re, ro).to(tl.bfloat16), d >= NOPE)


def rope_quant_insert(latent: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor, compress_ratio: int,
                      fp8_scale: torch.Tensor | None = None, *, variant: str | None = None) -> None:
    """RoPE + quantize + insert compressed latents into the 584-byte paged KV cache.

    Same arguments and bytes as upstream's ``rope_quant_insert`` with a ``uint8`` cache of
    584-byte records. ``fp8_scale`` belongs to the plain FlashInfer rows and must be None.
    """
    v = arch.resolve(variant)
    check_tensor(latent, "latent", dtypes=_BF16, ndim=2)
    check(latent.shape[1] == rec.HEAD_DIM and latent.is_contiguous(), "latent",
          lambda: (f"expected a contiguous [tokens, {rec.HEAD_DIM}] tensor, got shape "
          f"{tuple(latent.shape)} strides {latent.stride()}"))
    dev = latent.device
    check_tensor(positions, "positions", dtypes=INDEX_DTYPES, ndim=1, device=dev)
    check_tensor(slot_mapping, "slot_mapping", dtypes=INDEX_DTYPES, ndim=1, device=dev)
    check(slot_mapping.is_contiguous() and positions.is_contiguous(), "slot_mapping/positions",
          "must be contiguous")
    check_tensor(cos_sin_cache, "cos_sin_cache", dtypes=_COS_SIN_DTYPES, ndim=2, device=dev)
    check(cos_sin_cache.shape[1] == rec.ROPE_DIM and cos_sin_cache.stride(1) == 1, "cos_sin_cache",
          lambda: f"expected [max_pos, {rec.ROPE_DIM}] with unit inner stride, got {tuple(cos_sin_cache.shape)}")
    check_tensor(kv_cache, "kv_cache", dtypes=_U8, ndim=3, device=dev)
    check(kv_cache.shape[2] == rec.RECORD_BYTES, "kv_cache",
          lambda: (f"record width {kv_cache.shape[2]}: only the {rec.RECORD_BYTES}-byte record has an "
          "fp8-free variant (528/288-byte records and plain rows are SM100/FlashInfer layouts)"))
    check(kv_cache.stride(2) == 1 and kv_cache.stride(1) == rec.RECORD_BYTES, "kv_cache",
          lambda: f"each page must be {rec.RECORD_BYTES}*block_size contiguous bytes, strides {kv_cache.stride()}")
    check(fp8_scale is None, "fp8_scale", "only used by plain fp8 rows; must be None for 584-byte records")
    check(compress_ratio in (1, 2), "compress_ratio", lambda: f"{compress_ratio}, expected 1 or 2")
    num_tokens = slot_mapping.numel()
    check(num_tokens <= min(latent.shape[0], positions.numel()), "slot_mapping",
          lambda: f"{num_tokens} slots but latent has {latent.shape[0]} rows, positions {positions.numel()}")
    if num_tokens == 0:
        return
    _rope_quant_insert_584_kernel[(num_tokens,)](
        latent, positions, cos_sin_cache, kv_cache, slot_mapping,
        kv_cache.shape[0] * kv_cache.shape[1], COS_STRIDE=cos_sin_cache.stride(0), CACHE_STRIDE=kv_cache.stride(0),
        CACHE_BLOCK=kv_cache.shape[1], COMPRESS_RATIO=compress_ratio,
        DATA_BYTES=rec.DATA_BYTES, SCALE_BYTES=rec.SCALE_BYTES, NOPE=rec.NOPE_DIM,
        QBLOCK=rec.QUANT_BLOCK, HW_FP8=v.hw_fp8, num_warps=_INSERT_WARPS[v.name])


# ----------------------------------------------------------------- indexer K store
@triton.jit(do_not_specialize=["num_slots"])
def _indexer_k_store_fp8_kernel(
    k_pre, k_pre_stride, positions, norm_weight, eps, cos_sin, cos_stride,
    cache, cache_slots, cache_block, num_slots,
    HEAD: tl.constexpr, ROPE: tl.constexpr, COMPRESS_RATIO: tl.constexpr,
    BLOCK_STRIDE: tl.constexpr, SCALE_BYTES: tl.constexpr, MX_SCALE: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """One program per token: a group's last token stores the group's fp8 index key."""
    t = tl.program_id(0)
    slot = tl.load(cache_slots + t)
    if (slot < 0) | (slot >= num_slots):
        return
    position = tl.load(positions + t)
    if (position + 1) % COMPRESS_RATIO != 0:
        return
    d = tl.arange(0, HEAD)

    # k_norm in fp32, rounded through bf16 like the reference.
    k = tl.load(k_pre + t.to(tl.int64) * k_pre_stride + d).to(tl.float32)
    w = tl.load(norm_weight + d).to(tl.float32)
    variance = tl.sum(k * k, axis=0) / HEAD
    k = (k * tl.rsqrt(variance + eps) * w).to(tl.bfloat16).to(tl.float32)

    # GPT-J RoPE of the last ROPE dims at the group's first position; bf16 round trip.
    even, odd = tl.split(tl.reshape(k, (HEAD // 2, 2)))
    cs_row = cos_sin + (position // COMPRESS_RATIO) * COMPRESS_RATIO * cos_stride
    re, ro = rope_tail_pairs(even, odd, cs_row, HEAD // 2, (HEAD - ROPE) // 2, ROPE // 2)
    re = re.to(tl.bfloat16).to(tl.float32)
    ro = ro.to(tl.bfloat16).to(tl.float32)
    # Upstream rounds the interleaved row through bf16 once more (exact: already bf16).
    x = tl.interleave(re, ro).to(tl.bfloat16).to(tl.float32)

    # One power-of-two scale for the whole key.
    page = cache + (slot // cache_block).to(tl.int64) * BLOCK_STRIDE
    store_fp8_key_row(x, page, slot % cache_block, cache_block, HEAD, SCALE_BYTES, MX_SCALE,
                      HW_FP8)


def indexer_k_norm_rope_store(k_pre: torch.Tensor, positions: torch.Tensor,
                              cos_sin_cache: torch.Tensor, rms_norm_weight: torch.Tensor,
                              rms_norm_eps: float, k_cache: torch.Tensor,
                              kv_slot_mapping: torch.Tensor, compress_ratio: int,
                              use_fp4_cache: bool, *, mx_scale: bool = False,
                              variant: str | None = None) -> None:
    """k_norm -> RoPE -> fp8 quant -> paged store of V4.1 index keys (upstream's FP8 path).

    ``mx_scale`` is what upstream reads from ``mqa_logits_use_mx_scales()`` (True only on
    SM100): the scale is stored as four packed UE8M0 bytes instead of an fp32.
    """
    v = arch.resolve(variant)
    if use_fp4_cache:
        raise NotImplementedError("use_fp4_cache: the MXFP4 indexer cache needs the sm_100 e2m1 "
                                  "cvt; there is no fp8-free variant of it")
    check_tensor(k_pre, "k_pre", dtypes=_BF16, ndim=2)
    check(k_pre.shape[1] == INDEXER_HEAD_DIM and k_pre.stride(1) == 1, "k_pre",
          lambda: f"expected [tokens, {INDEXER_HEAD_DIM}] with unit inner stride, got {tuple(k_pre.shape)}")
    dev = k_pre.device
    check_tensor(positions, "positions", dtypes=INDEX_DTYPES, ndim=1, device=dev)
    check_tensor(kv_slot_mapping, "kv_slot_mapping", dtypes=INDEX_DTYPES, ndim=1, device=dev)
    check_tensor(cos_sin_cache, "cos_sin_cache", dtypes=_COS_SIN_DTYPES, ndim=2, device=dev)
    check(cos_sin_cache.shape[1] == INDEXER_ROPE_DIM and cos_sin_cache.stride(1) == 1,
          "cos_sin_cache", lambda: f"expected [max_pos, {INDEXER_ROPE_DIM}], got {tuple(cos_sin_cache.shape)}")
    check_tensor(rms_norm_weight, "rms_norm_weight", ndim=1, device=dev)
    check(rms_norm_weight.numel() == INDEXER_HEAD_DIM and rms_norm_weight.is_contiguous(),
          "rms_norm_weight", lambda: f"expected {INDEXER_HEAD_DIM} contiguous values")
    row_bytes = INDEXER_HEAD_DIM + _INDEXER_SCALE_BYTES
    check_tensor(k_cache, "k_cache", dtypes=_U8, ndim=3, device=dev)
    check(k_cache.shape[2] == row_bytes and k_cache.stride(2) == 1 and k_cache.stride(1) == row_bytes,
          "k_cache", lambda: (f"expected [blocks, block_size, {row_bytes}] with contiguous pages, got "
          f"{tuple(k_cache.shape)} strides {k_cache.stride()}"))
    check(compress_ratio in (1, 2), "compress_ratio", lambda: f"{compress_ratio}, expected 1 or 2")
    num_tokens = kv_slot_mapping.numel()
    check(num_tokens <= min(k_pre.shape[0], positions.numel()), "kv_slot_mapping",
          lambda: f"{num_tokens} slots but k_pre has {k_pre.shape[0]} rows, positions {positions.numel()}")
    if num_tokens == 0:
        return
    _indexer_k_store_fp8_kernel[(num_tokens,)](
        k_pre, k_pre.stride(0), positions, rms_norm_weight, rms_norm_eps,
        cos_sin_cache, cos_sin_cache.stride(0), k_cache, kv_slot_mapping, k_cache.shape[1],
        k_cache.shape[0] * k_cache.shape[1], HEAD=INDEXER_HEAD_DIM, ROPE=INDEXER_ROPE_DIM, COMPRESS_RATIO=compress_ratio,
        BLOCK_STRIDE=k_cache.stride(0), SCALE_BYTES=_INDEXER_SCALE_BYTES, MX_SCALE=mx_scale,
        HW_FP8=v.hw_fp8, num_warps=_INDEXER_K_WARPS[v.name])


# ----------------------------------------------------------------- compile gate
# The launches at V4.1 shapes: the Ampere path's compressed / index-K pages (kv_page64: 64
# tokens, page // ratio entries each), a [max_pos, 64] fp32 cos_sin cache, the V4.1 compress
# ratios that have a compressor (1 and 2). Served launches take CACHE_BLOCK from the cache
# and CACHE_STRIDE / BLOCK_STRIDE from its stride(0) (vLLM's pool block), both fixed per
# engine; they compiled during load in the H200 nocompile run at d80f014 (warmup.py
# _writer_keys), which no later run has rechecked with 64-token pages.
_PAGE_TOKENS = shapes.COMPRESSED_PAGE["sm80"]
for _cr in (r for r in shapes.V41.ratios if r > 0):
    _PAGE = shapes.compressed_entries(_PAGE_TOKENS, _cr)
    register_writer(
        f"v41.rope_quant_insert_584.cr{_cr}", _rope_quant_insert_584_kernel,
        {"latent": "*bf16", "positions": "*i64", "cos_sin": "*fp32", "cache": "*u8",
         "cache_slots": "*i64", "num_slots": "i32", "COS_STRIDE": "constexpr", "CACHE_STRIDE": "constexpr",
         "CACHE_BLOCK": "constexpr", "COMPRESS_RATIO": "constexpr", "DATA_BYTES": "constexpr",
         "SCALE_BYTES": "constexpr", "NOPE": "constexpr", "QBLOCK": "constexpr"},
        {"COS_STRIDE": rec.ROPE_DIM, "CACHE_STRIDE": _PAGE * rec.RECORD_BYTES, "CACHE_BLOCK": _PAGE,
         "COMPRESS_RATIO": _cr, "DATA_BYTES": rec.DATA_BYTES, "SCALE_BYTES": rec.SCALE_BYTES,
         "NOPE": rec.NOPE_DIM, "QBLOCK": rec.QUANT_BLOCK},
        {v: _INSERT_WARPS[v] for v in ("sm80", "sm90")})
    register_writer(
        f"v41.indexer_k_store_fp8.cr{_cr}", _indexer_k_store_fp8_kernel,
        {"k_pre": "*bf16", "k_pre_stride": "i32", "positions": "*i64", "norm_weight": "*bf16",
         "eps": "fp32", "cos_sin": "*fp32", "cos_stride": "i32", "cache": "*u8",
         "cache_slots": "*i64", "cache_block": "i32", "num_slots": "i32", "HEAD": "constexpr", "ROPE": "constexpr",
         "COMPRESS_RATIO": "constexpr", "BLOCK_STRIDE": "constexpr", "SCALE_BYTES": "constexpr",
         "MX_SCALE": "constexpr"},
        {"HEAD": INDEXER_HEAD_DIM, "ROPE": INDEXER_ROPE_DIM, "COMPRESS_RATIO": _cr,
         "BLOCK_STRIDE": _PAGE * (INDEXER_HEAD_DIM + _INDEXER_SCALE_BYTES),
         "SCALE_BYTES": _INDEXER_SCALE_BYTES, "MX_SCALE": False},
        {v: _INDEXER_K_WARPS[v] for v in ("sm80", "sm90")})
