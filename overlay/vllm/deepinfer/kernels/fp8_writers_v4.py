"""DeepSeek-V4 fp8 writers without fp8e4nv (V4.1 calls both of them too).

``fused_inv_rope_fp8_quant`` replaces upstream's function of that name
(``FusedInvRopeFP8QuantKernel.kernel``, models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py):
GPT-J inverse RoPE of the attention output + 128-wide power-of-two block fp8 quantization
for the o_proj einsum. ``fused_indexer_q_rope_quant`` replaces the Triton FP8 path of
upstream's function of that name (``FusedIndexerQRopeQuantTritonKernel.kernel``,
.../fused_indexer_q.py): RoPE + per-(token, head) fp8 quantization of the indexer Q with
the scale folded into the head weights.

Each kernel runs upstream's fp32 op sequence; e4m3 bytes come from
``fp8.cvt_f32_to_e4m3(x, HW_FP8)``. Not ported: the MXFP4 indexer Q (needs the sm_100
e2m1 cvt), PDL launches (sm90+ only; they change no value).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.deepinfer import arch, kv_record
from vllm.deepinfer.fp8 import cvt_f32_to_e4m3
from vllm.deepinfer.kernels import shapes
from vllm.deepinfer.kernels.checks import INDEX_DTYPES, check, check_tensor
from vllm.deepinfer.kernels.fp8_writers import FP8_MAX, gptj_rotate, register_writer

__all__ = ["fused_inv_rope_fp8_quant", "fused_indexer_q_rope_quant"]

# Warps per program, per variant: upstream's single warp for one (token, head) row. Neither
# kernel has a floating-point sum (max reductions and an integer scale pack are order-free),
# so the count could change per variant without changing a byte; the benchmark suite
# measures it on the H200.
_INV_ROPE_WARPS = {"cpu": 1, "sm80": 1, "sm86": 1, "sm89": 1, "sm90": 1, "sm100": 1}
_INDEXER_Q_WARPS = {"cpu": 1, "sm80": 1, "sm86": 1, "sm89": 1, "sm90": 1, "sm100": 1}

# Upstream's block-absmax floor for the o_proj quantization (its ``eps``): an all-zero
# block gets the finite scale 2^ceil(log2(1e-10/448)).
_INV_ROPE_EPS = tl.constexpr(1e-10)
# The indexer Q's amax floor, as upstream (and the K side) use it.
_INDEXER_AMAX_FLOOR = tl.constexpr(1e-4)
# DeepGEMM reads scales from rows padded to 16 bytes: the token count rounds up to a
# multiple of 16 / sizeof(scale) = 4 (upstream's get_tma_aligned_size(num_tokens, 4)).
_TMA_ALIGN_TOKENS = 4
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_F32 = (torch.float32,)
_COS_SIN_DTYPES = (torch.float32, torch.bfloat16)


# ----------------------------------------------------------------- inverse RoPE + quant
@triton.jit(do_not_specialize=["num_tokens", "scale_stride_k"])
def _inv_rope_quant_kernel(
    o, positions, cos_sin, out, scale_out, num_tokens,
    o_stride_token, o_stride_head, cos_stride, out_stride_group, out_stride_token,
    scale_stride_group, scale_stride_k,
    HEADS_PER_GROUP: tl.constexpr, QUANT_GROUP: tl.constexpr, CHUNKS: tl.constexpr,
    NOPE: tl.constexpr, HALF_ROPE: tl.constexpr, QUANTIZE: tl.constexpr,
    PACKED_UE8M0: tl.constexpr, HW_FP8: tl.constexpr,
):
    """Program (token, head): inverse RoPE of one head row, then its CHUNKS fp8 blocks."""
    token = tl.program_id(0).to(tl.int64)
    gh = tl.program_id(1).to(tl.int64)
    g = gh // HEADS_PER_GROUP
    first_chunk = (gh % HEADS_PER_GROUP) * CHUNKS
    # Scales of token t, chunk k live at group base + t + k * scale_stride_k.
    scale_row = scale_out + g * scale_stride_group.to(tl.int64) + token
    k_stride = scale_stride_k.to(tl.int64)
    if token >= num_tokens:  # padding rows of the TMA-aligned scale buffer: zero scales
        if QUANTIZE:
            if PACKED_UE8M0:
                p = tl.arange(0, CHUNKS // 4)
                tl.store(scale_row + (first_chunk // 4 + p) * k_stride,
                         tl.zeros((CHUNKS // 4,), dtype=tl.int32))
            else:
                c = tl.arange(0, CHUNKS)
                tl.store(scale_row + (first_chunk + c) * k_stride,
                         tl.zeros((CHUNKS,), dtype=tl.float32))
        return

    HEAD: tl.constexpr = CHUNKS * QUANT_GROUP
    d = tl.arange(0, HEAD)
    src = o + token * o_stride_token.to(tl.int64) + gh * o_stride_head.to(tl.int64)
    x = tl.load(src + d).to(tl.float32)
    # Inverse GPT-J RoPE on dims >= NOPE: each lane reads its pair partner (d ^ 1).
    is_rope = d >= NOPE
    r = d - NOPE
    partner = tl.load(src + (d ^ 1), mask=is_rope, other=0.0).to(tl.float32)
    cs_row = cos_sin + tl.load(positions + token) * cos_stride.to(tl.int64)
    ci = tl.maximum(r >> 1, 0)
    c = tl.load(cs_row + ci, mask=is_rope, other=1.0)
    s = tl.load(cs_row + HALF_ROPE + ci, mask=is_rope, other=0.0)
    x_add = x * c + partner * s
    x_sub = x * c - partner * s
    x = tl.where(is_rope, tl.where((r & 1) == 0, x_add, x_sub), x)

    dst = (out + g * out_stride_group.to(tl.int64) + token * out_stride_token.to(tl.int64)
           + first_chunk * QUANT_GROUP)
    if not QUANTIZE:
        tl.store(dst + d, x)
        return

    absmax = tl.maximum(tl.max(tl.reshape(tl.abs(x), (CHUNKS, QUANT_GROUP)), axis=1), _INV_ROPE_EPS)
    scales = tl.exp2(tl.ceil(tl.log2(absmax * (1.0 / FP8_MAX))))
    per_dim = tl.reshape(tl.broadcast_to(tl.reshape(scales, (CHUNKS, 1)), (CHUNKS, QUANT_GROUP)),
                         (HEAD,))
    tl.store(dst + d, cvt_f32_to_e4m3(tl.clamp(x / per_dim, -FP8_MAX, FP8_MAX), HW_FP8))
    if PACKED_UE8M0:  # SM100: four UE8M0 exponents per int32
        ue8m0 = (scales.to(tl.int32, bitcast=True) >> 23) & 0xFF
        packed = tl.sum(tl.reshape(ue8m0, (CHUNKS // 4, 4)) << (tl.arange(0, 4)[None, :] * 8), axis=1)
        p = tl.arange(0, CHUNKS // 4)
        tl.store(scale_row + (first_chunk // 4 + p) * k_stride, packed)
    else:
        c = tl.arange(0, CHUNKS)
        tl.store(scale_row + (first_chunk + c) * k_stride, scales)


def fused_inv_rope_fp8_quant(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                             n_groups: int, heads_per_group: int,
                             nope_dim: int = kv_record.NOPE_DIM, rope_dim: int = kv_record.ROPE_DIM,
                             quant_group_size: int = shapes.V41.o_quant_group,
                             tma_aligned_scales: bool = False, quantize: bool = True, *,
                             variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse RoPE + block fp8 quantization; same arguments and results as upstream.

    Returns (rotated output [T, G, heads_per_group*head_dim] float8_e4m3fn (o.dtype when
    not quantizing), scales [T, G, blocks] fp32, or int32 packed UE8M0 when
    ``tma_aligned_scales``; empty when not quantizing), both transposed views of
    [G, T, ...] buffers as upstream returns them.
    """
    v = arch.resolve(variant)
    check_tensor(o, "o", dtypes=_FLOATS, ndim=3)
    num_tokens, num_heads, head_dim = o.shape
    check(o.stride(2) == 1, "o", lambda: f"needs a unit inner stride, strides {o.stride()}")
    check(num_heads == n_groups * heads_per_group, "o",
          lambda: f"{num_heads} heads != n_groups {n_groups} * heads_per_group {heads_per_group}")
    check(head_dim == nope_dim + rope_dim and rope_dim % 2 == 0, "o",
          lambda: f"head_dim {head_dim} != nope_dim {nope_dim} + rope_dim {rope_dim} (even)")
    check(head_dim % quant_group_size == 0, "quant_group_size",
          lambda: f"{quant_group_size} does not divide head_dim {head_dim}")
    chunks = head_dim // quant_group_size
    check(triton.next_power_of_2(chunks) == chunks and
          triton.next_power_of_2(quant_group_size) == quant_group_size, "quant_group_size",
          lambda: f"{quant_group_size} and head_dim/{quant_group_size} must be powers of two")
    check(not (quantize and tma_aligned_scales) or chunks % 4 == 0, "tma_aligned_scales",
          lambda: f"packed UE8M0 needs head_dim/quant_group_size ({chunks}) divisible by 4")
    check_tensor(positions, "positions", dtypes=INDEX_DTYPES, ndim=1, device=o.device)
    check(positions.numel() >= num_tokens, "positions", lambda: f"{positions.numel()} < {num_tokens} tokens")
    check_tensor(cos_sin_cache, "cos_sin_cache", dtypes=_F32, ndim=2, device=o.device)
    check(cos_sin_cache.shape[1] == rope_dim and cos_sin_cache.stride(1) == 1, "cos_sin_cache",
          lambda: f"expected [max_pos, {rope_dim}] with unit inner stride, got {tuple(cos_sin_cache.shape)}")

    d = heads_per_group * head_dim
    blocks = d // quant_group_size
    padded_tokens = triton.cdiv(num_tokens, _TMA_ALIGN_TOKENS) * _TMA_ALIGN_TOKENS if quantize else num_tokens
    scale_inner = ((blocks + 3) // 4 if tma_aligned_scales else blocks) if quantize else 0
    scale_dtype = torch.int32 if tma_aligned_scales else torch.float32
    out_buf = torch.empty((n_groups, num_tokens, d), dtype=torch.uint8 if quantize else o.dtype,
                          device=o.device)
    if quantize:
        scale_buf = torch.empty(n_groups * scale_inner * padded_tokens, dtype=scale_dtype,
                                device=o.device).as_strided(
            (n_groups, num_tokens, scale_inner), (scale_inner * padded_tokens, 1, padded_tokens))
    else:
        scale_buf = torch.empty(0, dtype=scale_dtype, device=o.device)
    if padded_tokens > 0:
        _inv_rope_quant_kernel[(padded_tokens, num_heads)](
            o, positions, cos_sin_cache, out_buf, scale_buf, num_tokens,
            o.stride(0), o.stride(1), cos_sin_cache.stride(0), out_buf.stride(0), out_buf.stride(1),
            scale_buf.stride(0) if quantize else 0, scale_buf.stride(2) if quantize else 0,
            HEADS_PER_GROUP=heads_per_group, QUANT_GROUP=quant_group_size, CHUNKS=chunks,
            NOPE=nope_dim, HALF_ROPE=rope_dim // 2, QUANTIZE=quantize,
            PACKED_UE8M0=tma_aligned_scales, HW_FP8=v.hw_fp8, num_warps=_INV_ROPE_WARPS[v.name],
            num_stages=1)
    if quantize:
        out_buf = out_buf.view(torch.float8_e4m3fn)
    return out_buf.transpose(0, 1), (scale_buf.transpose(0, 1) if quantize else scale_buf)


# ----------------------------------------------------------------- indexer Q
@triton.jit
def _indexer_q_quant_kernel(
    positions, q, q_stride0, q_stride1, cos_sin, cos_stride,
    q_out, out_stride0, out_stride1,
    weights, weights_stride, softmax_scale, head_scale, weights_out, weights_out_stride,
    HALF_ROT: tl.constexpr, HEAD: tl.constexpr, HW_FP8: tl.constexpr,
):
    """Program (token, head): RoPE the trailing 2*HALF_ROT dims, one fp8 scale per row."""
    NOPE: tl.constexpr = HEAD - 2 * HALF_ROT
    tl.static_assert(NOPE >= 0)
    # int64 before any stride: tok * q_stride0 (heads * 128) passes 2^31 - 1 from 262,144
    # tokens at 64 index heads; the same holds for the uint8 output's rows.
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(positions + tok)
    i = tl.arange(0, HALF_ROT)
    c = tl.load(cos_sin + pos * cos_stride + i).to(tl.float32)
    s = tl.load(cos_sin + pos * cos_stride + i + HALF_ROT).to(tl.float32)
    src = q + tok * q_stride0 + head * q_stride1
    x_even = tl.load(src + NOPE + i * 2).to(tl.float32)
    x_odd = tl.load(src + NOPE + i * 2 + 1).to(tl.float32)
    r_even, r_odd = gptj_rotate(x_even, x_odd, c, s)
    # fp32 -> bf16 -> fp32 before the absmax, as the unfused reference rounds.
    r_even = r_even.to(tl.bfloat16).to(tl.float32)
    r_odd = r_odd.to(tl.bfloat16).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(r_even)), tl.max(tl.abs(r_odd)))
    if NOPE > 0:
        n = tl.arange(0, NOPE)
        x_nope = tl.load(src + n).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x_nope)))
    scale = tl.div_rn(tl.maximum(amax, _INDEXER_AMAX_FLOOR), FP8_MAX)
    scale = tl.exp2(tl.ceil(tl.log2(scale)))

    # No clamp (as upstream): |x| / scale <= 448 by construction, and both casts saturate.
    dst = q_out + tok * out_stride0 + head * out_stride1
    if NOPE > 0:
        tl.store(dst + n, cvt_f32_to_e4m3(tl.div_rn(x_nope, scale), HW_FP8))
    tl.store(dst + NOPE + i * 2, cvt_f32_to_e4m3(tl.div_rn(r_even, scale), HW_FP8))
    tl.store(dst + NOPE + i * 2 + 1, cvt_f32_to_e4m3(tl.div_rn(r_odd, scale), HW_FP8))

    # The per-(token, head) scale is folded into the logits weights.
    w = tl.load(weights + tok * weights_stride + head).to(tl.float32)
    w *= scale
    w *= softmax_scale
    w *= head_scale
    tl.store(weights_out + tok * weights_out_stride + head, w)


def fused_indexer_q_rope_quant(positions: torch.Tensor, index_q: torch.Tensor,
                               index_q_cos_sin_cache: torch.Tensor, index_weights: torch.Tensor,
                               index_weights_softmax_scale: float, index_weights_head_scale: float,
                               use_fp4: bool = False, weights_out_dtype: torch.dtype = torch.float32,
                               *, variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE + fp8 quantization of the indexer Q; returns (q float8_e4m3fn [T, H, D], weights_out).

    ``weights_out = index_weights * q_scale * softmax_scale * head_scale`` (fp32), as
    upstream's FP8 path (e4m3fn, FP8_MAX 448: the CUDA branch of upstream).
    """
    v = arch.resolve(variant)
    if use_fp4:
        raise NotImplementedError("use_fp4: the MXFP4 indexer Q needs the sm_100 e2m1 cvt; "
                                  "there is no fp8-free variant of it")
    check(weights_out_dtype == torch.float32, "weights_out_dtype",
          lambda: f"{weights_out_dtype}: the FP8 path writes float32 weights")
    check_tensor(index_q, "index_q", dtypes=_FLOATS, ndim=3)
    num_tokens, num_heads, head_dim = index_q.shape
    dev = index_q.device
    check(index_q.stride(2) == 1, "index_q", lambda: f"needs a unit inner stride, strides {index_q.stride()}")
    check_tensor(positions, "positions", dtypes=INDEX_DTYPES, ndim=1, device=dev)
    check(positions.numel() == num_tokens, "positions",
          lambda: f"{positions.numel()} positions for {num_tokens} tokens")
    check_tensor(index_q_cos_sin_cache, "index_q_cos_sin_cache", dtypes=_COS_SIN_DTYPES, ndim=2,
                 device=dev)
    rot = index_q_cos_sin_cache.shape[1]
    nope = head_dim - rot
    check(index_q_cos_sin_cache.stride(1) == 1 and rot % 2 == 0 and nope >= 0, "index_q_cos_sin_cache",
          lambda: f"shape {tuple(index_q_cos_sin_cache.shape)} does not fit head_dim {head_dim}")
    for n, dim in (("index_q_cos_sin_cache", rot // 2), ("index_q", nope)):
        check(dim == 0 or triton.next_power_of_2(dim) == dim, n,
              lambda: f"half rotary dim {rot // 2} and NoPE dim {nope} must be powers of two")
    check_tensor(index_weights, "index_weights", ndim=2, device=dev)
    check(tuple(index_weights.shape) == (num_tokens, num_heads) and index_weights.stride(1) == 1,
          "index_weights", lambda: (f"expected [{num_tokens}, {num_heads}] with unit inner stride, got "
          f"{tuple(index_weights.shape)}"))
    q_out = torch.empty(index_q.shape, dtype=torch.uint8, device=dev)
    weights_out = torch.empty_like(index_weights, dtype=weights_out_dtype)
    if num_tokens > 0 and num_heads > 0:
        _indexer_q_quant_kernel[(num_tokens, num_heads)](
            positions, index_q, index_q.stride(0), index_q.stride(1),
            index_q_cos_sin_cache, index_q_cos_sin_cache.stride(0),
            q_out, q_out.stride(0), q_out.stride(1),
            index_weights, index_weights.stride(0), index_weights_softmax_scale,
            index_weights_head_scale, weights_out, weights_out.stride(0),
            HALF_ROT=rot // 2, HEAD=head_dim, HW_FP8=v.hw_fp8, num_warps=_INDEXER_Q_WARPS[v.name])
    return q_out.view(torch.float8_e4m3fn), weights_out


# ----------------------------------------------------------------- compile gate
# V4.1/V4 shapes: 512-dim heads (448 + 64), 128-wide quant groups, 8 heads per o group
# (64 heads / 8 groups); indexer Q heads of 128 dims with 64 rotated.
_V41 = shapes.V41
for _packed in (False, True):
    register_writer(
        f"v4.inv_rope_fp8_quant{'.ue8m0' if _packed else ''}", _inv_rope_quant_kernel,
        {"o": "*bf16", "positions": "*i64", "cos_sin": "*fp32", "out": "*u8",
         "scale_out": "*i32" if _packed else "*fp32", "num_tokens": "i32",
         "o_stride_token": "i32", "o_stride_head": "i32", "cos_stride": "i32",
         "out_stride_group": "i32", "out_stride_token": "i32", "scale_stride_group": "i32",
         "scale_stride_k": "i32", "HEADS_PER_GROUP": "constexpr", "QUANT_GROUP": "constexpr",
         "CHUNKS": "constexpr", "NOPE": "constexpr", "HALF_ROPE": "constexpr",
         "QUANTIZE": "constexpr", "PACKED_UE8M0": "constexpr"},
        {"HEADS_PER_GROUP": _V41.heads // _V41.o_groups, "QUANT_GROUP": _V41.o_quant_group,
         "CHUNKS": kv_record.HEAD_DIM // _V41.o_quant_group, "NOPE": kv_record.NOPE_DIM,
         "HALF_ROPE": kv_record.ROPE_DIM // 2, "QUANTIZE": True, "PACKED_UE8M0": _packed},
        {v: _INV_ROPE_WARPS[v] for v in ("sm80", "sm90")}, num_stages=1)
register_writer(
    "v4.indexer_q_rope_quant", _indexer_q_quant_kernel,
    {"positions": "*i64", "q": "*bf16", "q_stride0": "i32", "q_stride1": "i32", "cos_sin": "*fp32",
     "cos_stride": "i32", "q_out": "*u8", "out_stride0": "i32", "out_stride1": "i32",
     "weights": "*bf16", "weights_stride": "i32", "softmax_scale": "fp32", "head_scale": "fp32",
     "weights_out": "*fp32", "weights_out_stride": "i32", "HALF_ROT": "constexpr",
     "HEAD": "constexpr"},
    {"HALF_ROT": kv_record.INDEX_ROPE_DIM // 2, "HEAD": kv_record.INDEX_HEAD_DIM},
    {v: _INDEXER_Q_WARPS[v] for v in ("sm80", "sm90")})
