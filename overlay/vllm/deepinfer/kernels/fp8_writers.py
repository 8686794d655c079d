"""fp8-free writers for the DeepSeek-V4.1/V4 serving path: shared pieces.

Triton refuses ``fp8e4nv`` below sm_89, so the upstream vLLM 0.33.0 kernels that write
e4m3 bytes (compressed-KV insert, indexer K store, indexer Q quant, inverse RoPE + fp8
quant) do not compile on SM80/SM86. Our variants keep each upstream kernel's fusion and
its exact fp32 op sequence; the only change is the cast, ``fp8.cvt_f32_to_e4m3(x, HW_FP8)``:
integer round-to-nearest-even on sm80/sm86/cpu, the hardware cvt on sm89+.

    fp8_writers_v41.rope_quant_insert          <- v41 _rope_quant_insert_kernel (584 B record)
    fp8_writers_v41.indexer_k_norm_rope_store  <- v41 _indexer_k_norm_rope_quant_store_kernel
    fp8_writers_v4.fused_inv_rope_fp8_quant    <- v4 FusedInvRopeFP8QuantKernel.kernel
    fp8_writers_v4.fused_indexer_q_rope_quant  <- v4 FusedIndexerQRopeQuantTritonKernel.kernel

This module holds what they share: the quantization constants, the GPT-J RoPE of the
trailing pairs, the fp8 key-row store, and compile-gate registration (variants resolve
through ``arch.resolve``, inputs are checked with ``kernels.checks``). See
docs/fp8-writers.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from vllm.deepinfer import arch, kv_record
from vllm.deepinfer.compile_gate import GateSpec, register
from vllm.deepinfer.fp8 import cvt_f32_to_e4m3

__all__ = ["FP8_MAX", "AMAX_FLOOR", "UE8M0_MAX", "GATE_VARIANTS", "FEATURE", "gptj_rotate",
           "rope_tail_pairs", "store_fp8_key_row", "register_writer"]

# Largest finite e4m3fn magnitude; every writer clamps (or scales) into +-FP8_MAX.
# (tl.constexpr: jit functions may read it as a global.)
FP8_MAX = tl.constexpr(kv_record.FP8_MAX)
# Upstream's amax floor for the compressed and indexer caches: an all-zero block gets the
# finite scale 2^ceil(log2(1e-4/448)) = 2^-22 (UE8M0 byte 105) instead of a zero division.
AMAX_FLOOR = tl.constexpr(kv_record.AMAX_FLOOR)
# UE8M0 stores 2^(byte-127); the encoded exponent is clamped into a byte (upstream's CUDA
# bound; its gfx950 path uses 254 to keep the OCP-MX NaN code out, a ROCm-only path).
UE8M0_MAX = tl.constexpr(255.0)
# Variants the compile gate builds each writer for: sm80 (software cast, also built for
# sm_86) and sm90 (hardware cast). sm89/sm100 run the sm90 code path (HW_FP8=True).
GATE_VARIANTS = ("sm80", "sm90")
FEATURE = "fp8_sw"


@triton.jit
def gptj_rotate(even, odd, c, s):
    """GPT-J (interleaved) RoPE of one (even, odd) pair, written as upstream writes it."""
    return even * c - odd * s, odd * c + even * s


@triton.jit
def rope_tail_pairs(even, odd, cs_row, NUM_PAIRS: tl.constexpr, NOPE_PAIRS: tl.constexpr,
                    HALF_ROPE: tl.constexpr):
    """GPT-J RoPE of (even, odd) pairs whose index is >= NOPE_PAIRS, in fp32.

    ``cs_row`` points at one cos_sin_cache row (HALF_ROPE cos, then HALF_ROPE sin). The
    leading NoPE pairs load (cos, sin) = (1, 0), so the same two expressions run on every
    lane, which is how the upstream writers compute it (same ops, same FMA contraction).
    """
    pair = tl.arange(0, NUM_PAIRS) - NOPE_PAIRS
    is_rope = pair >= 0
    idx = tl.maximum(pair, 0)
    c = tl.load(cs_row + idx, is_rope, other=1.0).to(tl.float32)
    s = tl.load(cs_row + HALF_ROPE + idx, is_rope, other=0.0).to(tl.float32)
    return gptj_rotate(even, odd, c, s)


@triton.jit
def store_fp8_key_row(x, page, row, cache_block, HEAD: tl.constexpr, SCALE_BYTES: tl.constexpr,
                      MX_SCALE: tl.constexpr, HW_FP8: tl.constexpr):
    """One indexer key ``x`` [HEAD] fp32 quantized with a single power-of-two scale (upstream's
    FP8 indexer row, V4.1 K store and V4 compressor alike): the e4m3 codes at
    ``page + row * HEAD``, the scale after the page's codes — fp32, or with ``MX_SCALE`` four
    equal UE8M0 bytes (SM100 MQA-logits kernels; upstream's ``pack_ue8m0_x4``)."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_FLOOR)
    exponent = tl.ceil(tl.log2(amax * (1.0 / FP8_MAX)))
    q = tl.clamp(x * tl.exp2(-exponent), -FP8_MAX, FP8_MAX)
    d = tl.arange(0, HEAD)
    tl.store(page + row * HEAD + d, cvt_f32_to_e4m3(q, HW_FP8))
    scale_dst = page + cache_block * HEAD + row * SCALE_BYTES
    scale = tl.exp2(exponent)
    if MX_SCALE:
        ue8m0 = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
        tl.store(scale_dst.to(tl.pointer_type(tl.int32)), ue8m0 * 0x01010101)
    else:
        tl.store(scale_dst.to(tl.pointer_type(tl.float32)), scale)


def register_writer(name: str, kernel, signature: dict[str, str], constexprs: dict,
                    num_warps: dict[str, int], num_stages: int = 2) -> None:
    """Register one launch configuration per gate variant (HW_FP8 follows the variant)."""
    for v in GATE_VARIANTS:
        register(GateSpec(
            name=f"fp8_writers.{name}[{v}]", kernel=kernel,
            signature={**signature, "HW_FP8": "constexpr"},
            constexprs={**constexprs, "HW_FP8": arch.VARIANTS[v].hw_fp8},
            variants=(v,), num_warps=num_warps[v], num_stages=num_stages, feature=FEATURE))
