"""Entry points the patched upstream files call. Each returns False/None when the feature is
off (``vllm.deepinfer.envs``), the GPU is unsupported, or the call is outside what our kernel
covers, and the upstream code then runs unchanged. Decisions are made once per process
(``reset()`` re-reads the environment, for tests).
"""
from __future__ import annotations

import functools
import logging

import torch

from vllm.deepinfer import arch, envs
from vllm.deepinfer.kv_record import RECORD_BYTES

logger = logging.getLogger("vllm.deepinfer")

__all__ = ["use", "cutedsl_allowed", "reset", "kv_gather", "combine_topk_swa_indices",
           "sparse_attn_decode", "sparse_attn_prefill", "mqa_logits", "paged_mqa_logits",
           "candidate_mqa_logits", "candidate_paged_mqa_logits", "pack_fp8_as_bytes",
           "pack_seq_fp8", "unpack_seq",
           "fp8_writers", "rope_quant_insert", "unspecialized", "indexer_k_norm_rope_store",
           "compress_norm_rope_store", "fused_inv_rope_fp8_quant", "fused_indexer_q_rope_quant",
           "CUTEDSL_MIN_CAPABILITY"]

# CuTeDSL's gather kernel is built from sm_89 PTX (cvt to/from e4m3); it cannot run below it.
CUTEDSL_MIN_CAPABILITY = (8, 9)


@functools.cache
def _variant() -> str | None:
    try:
        return arch.current().name
    except arch.UnsupportedGPU:
        return None


@functools.cache
def use(feature: str) -> bool:
    v = _variant()
    on = v is not None and envs.enabled(feature, v)
    logger.debug("deepinfer: %s %s on variant %s", feature, "on" if on else "off", v)
    return on


def unspecialized(names: list[str]) -> list[str]:
    """``do_not_specialize`` names for an upstream Triton kernel (patches 0003 and 0026): ``names``
    unless ``serve_warmup`` is switched off. Decided from the environment alone: it runs at
    import, in the kernel's decorator, before any GPU is queried."""
    return [] if envs.explicit("serve_warmup") is False else list(names)


@functools.cache
def cutedsl_allowed() -> bool:
    """Upstream takes CuTeDSL whenever it imports; only let it where sm_89 code can run."""
    cap = arch.device_capability()
    return cap is None or tuple(cap) >= CUTEDSL_MIN_CAPABILITY


@functools.cache
def cutedsl_usable() -> bool:
    """CuTeDSL allowed here and its package installed: V4's head-512 compressor (patch 0012)
    otherwise takes the Triton launcher instead of failing on ``import cutlass`` (a Hopper
    host without nvidia-cutlass-dsl)."""
    import importlib.util
    return cutedsl_allowed() and importlib.util.find_spec("cutlass") is not None


# DeepGEMM's kernels (GEMMs, MQA logits and their schedule metadata, mHC prenorm) exist for
# SM90 and SM100 only.
DEEP_GEMM_MIN_CAPABILITY = (9, 0)


@functools.cache
def deep_gemm_allowed() -> bool:
    """Patch 0011: upstream tests ``has_deep_gemm()`` (importable) where it means "usable";
    the wheel bundles DeepGEMM, so on an A100 the import succeeds and the first call fails.
    False below capability 9.0 unless ``DEEPINFER_DEEP_GEMM_GATE=0``."""
    cap = arch.device_capability()
    if cap is None or tuple(cap) >= DEEP_GEMM_MIN_CAPABILITY:
        return True
    try:
        on = envs.enabled("deep_gemm_gate", arch.variant_for_capability(tuple(cap)))
    except arch.UnsupportedGPU:
        on = True
    if on:
        logger.info("deepinfer: DeepGEMM hidden (capability %d.%d < 9.0; "
                    "DEEPINFER_DEEP_GEMM_GATE=0 shows it)", *cap)
    return not on


def reset() -> None:
    for f in (_variant, use, cutedsl_allowed, cutedsl_usable, deep_gemm_allowed):
        f.cache_clear()
    arch.reset_for_tests()


def kv_gather(out: torch.Tensor, k_cache: torch.Tensor, seq_lens, gather_lens, block_table,
              block_size: int, offset: int, use_fnuz: bool = False,
              max_gather_len: int | None = None) -> bool:
    """Run our dequantize-and-gather; False when upstream must handle the call."""
    if use_fnuz or k_cache.shape[-1] != RECORD_BYTES or not use("kv_gather"):
        return False
    from vllm.deepinfer.kernels.kv_gather import dequantize_and_gather_k_cache
    dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size,
                                  offset, max_gather_len=max_gather_len)
    return True


def combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens,
                             window_size: int, compress_ratio: int, topk: int, M: int, N: int,
                             out=None, *, left_visible=None, right_visible=None,
                             max_image_tokens: int = 0):
    """Our combiner's (indices, lens), or None (image visibility is upstream's alone)."""
    if left_visible is not None or right_visible is not None or max_image_tokens:
        return None
    if not use("topk_swa"):
        return None
    from vllm.deepinfer.kernels.topk_swa import combine_topk_swa_indices as ours
    return ours(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                compress_ratio, topk, M, N, out=out)


def sparse_attn_decode(q, main_cache, main_indices, main_indptr, scale, attn_sink,
                       nope_head_dim, rope_head_dim, extra_cache=None, extra_indices=None,
                       extra_indptr=None, out=None, inv_rope_positions=None,
                       inv_rope_cos_sin_cache=None, *, out_mxfp8=None,
                       extra_cache_nan_free: bool = False):
    """Our unified decode's output, or None. Applies the inverse RoPE exactly once when
    ``inv_rope_positions`` is given (the upstream CUDA fallback drops it)."""
    if out_mxfp8 is not None or extra_cache_nan_free or torch.version.hip is not None:
        return None
    if main_cache.shape[-1] != RECORD_BYTES or not use("sparse_mla_decode"):
        return None
    from vllm.deepinfer import reserve
    from vllm.deepinfer.kernels.sparse_mla_decode import sparse_attn_decode as ours
    # Split partials, two-phase rows and the output: views of vLLM's workspace, which the
    # profile run grew to the decode's worst case (vllm.deepinfer.reserve).
    return ours(q, main_cache, main_indices, main_indptr, scale, attn_sink, nope_head_dim,
                rope_head_dim, extra_cache=extra_cache, extra_indices=extra_indices,
                extra_indptr=extra_indptr, out=out, inv_rope_positions=inv_rope_positions,
                inv_rope_cos_sin_cache=inv_rope_cos_sin_cache,
                workspace=reserve.decode_workspace())


# Upstream's ragged prefill (``_sparse_attn_prefill_ragged_kernel``) and its dense -> ragged
# conversion form their element offsets in int32: ``query * q.stride(0)`` (heads x 512), the
# output's alike, ``row * indices.stride(0)`` and an int32 indptr over rows x width entries.
_UPSTREAM_PREFILL_LIMIT = 2 ** 31 - 1


def _last_offset(t: torch.Tensor) -> int:
    """The element offset of ``t``'s last element from its first (its strides' reach)."""
    return sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) if t.numel() else 0


def _check_upstream_prefill(q, output, indices, ragged_indices, why: str, fix: str) -> None:
    """Before upstream's ragged prefill takes a call (``why``: the reason it does): refuse,
    naming the tensor, one whose int32 offsets would wrap (q's last element is 2^31 - 1 at
    65,536 query rows x 64 heads x 512: from 65,537 rows, 32,769 at 128 heads), where
    upstream would read and write outside its tensors. Dense indices count rows x width
    (the largest value its int32 indptr can take), a ragged list its entries."""
    from vllm.deepinfer.kernels.checks import fail
    reach = [("q", _last_offset(q)), ("output", _last_offset(output))]
    if ragged_indices is not None:
        reach.append(("ragged_indices", ragged_indices.numel()))
    elif indices is not None and indices.dim():
        # Its conversion's row offsets, and the rows x width entries of its int32 indptr.
        reach.append(("indices", max(_last_offset(indices), indices.numel())))
    for name, n in reach:
        if n > _UPSTREAM_PREFILL_LIMIT:
            fail(name, f"this sparse MLA prefill call reaches offset or count {n}, past the "
                 f"{_UPSTREAM_PREFILL_LIMIT} (2^31 - 1) of the int32 offsets of upstream's "
                 f"ragged prefill kernel, which takes the call because {why}; {fix} or "
                 "prefill fewer tokens per step (max_num_batched_tokens)")


def sparse_attn_prefill(q, kv, indices, topk_length, scale, head_dim: int, nope_head_dim: int,
                        rope_head_dim: int, attn_sink, output, ragged_indices=None,
                        ragged_indptr=None) -> bool:
    """Patch 0003: upstream's ``rocm_sparse_attn_prefill`` asks here first. True: our
    prefill (``kernels.sparse_mla_prefill``) wrote ``output``; False: upstream's runs (ROCm,
    the feature off, or a call outside what ours covers: non-bf16, not 448 + 64 dims).
    On CUDA, a call upstream's kernel would address past int32 raises ``ValueError`` instead
    of going to it (``_check_upstream_prefill``): it is refused, not routed to ours, since
    the feature switch is an explicit request for upstream's kernel (A/B runs)."""
    if torch.version.hip is not None:
        return False
    if not use("sparse_mla_prefill"):
        _check_upstream_prefill(q, output, indices, ragged_indices,
                                "the sparse_mla_prefill feature is off",
                                "turn it on (DEEPINFER_SPARSE_MLA_PREFILL=1, or drop its =0 / "
                                "DEEPINFER_DISABLE entry)")
        return False
    if kv.dim() != 3 or kv.shape[1] != 1 or head_dim != kv.shape[-1]:
        return False  # upstream's own assertions name these
    from vllm.deepinfer.kernels import sparse_mla_prefill as spm
    if not spm.covers(q, kv, output, nope_head_dim, rope_head_dim):
        _check_upstream_prefill(q, output, indices, ragged_indices,
                                "our prefill does not cover it",
                                "give ours what it covers (bf16 q, kv and output, 448 + 64 "
                                "dims)")
        return False
    if ragged_indices is not None and ragged_indptr is not None:
        spm.sparse_attn_prefill(q, kv, scale, attn_sink, nope_head_dim, rope_head_dim,
                                ragged_indices=ragged_indices, ragged_indptr=ragged_indptr,
                                out=output)
    elif indices is not None:
        spm.sparse_attn_prefill(q, kv, scale, attn_sink, nope_head_dim, rope_head_dim,
                                indices=indices.reshape(indices.shape[0], -1),
                                topk_length=topk_length, out=output)
    else:
        return False
    return True


# ----------------------------------------------------------------------------- indexer logits
# vllm.utils.deep_gemm's two MQA-logits entry points (patch 0015) ask here first. Ours covers
# their FP8 path: Q as (e4m3 values, None) with the per-token scale folded into fp32
# weights, fp32 key scales. MXFP4 Q/K, MX (UE8M0-packed) scales and SM100's varlen
# ``indices`` stay DeepGEMM's.
def _fp8_q(q) -> bool:
    return (isinstance(q, tuple) and len(q) == 2 and q[1] is None
            and q[0].dtype == torch.float8_e4m3fn)


def mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k: int):
    """Our ``fp8_fp4_mqa_logits`` result, or None (DeepGEMM's call)."""
    if not _fp8_q(q) or kv[1].dtype != torch.float32 or not use("indexer_logits"):
        return None
    from vllm.deepinfer.kernels.indexer_logits import mqa_logits as ours
    return ours(q[0], kv[0], kv[1], weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k)


def paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, max_model_len: int,
                     indices=None):
    """Our ``fp8_fp4_paged_mqa_logits`` result, or None (DeepGEMM's call). The schedule
    metadata DeepGEMM plans is not needed (our grid is sized per call)."""
    if indices is not None or not _fp8_q(q) or weights.dtype != torch.float32:
        return None
    if not use("indexer_logits"):
        return None
    from vllm.deepinfer import reserve
    from vllm.deepinfer.kernels.indexer_logits import paged_mqa_logits as ours
    # The [B * next_n, max_model_len] fp32 logits: a view of vLLM's workspace, reserved at
    # the worst case in the profile run (vllm.deepinfer.reserve).
    out = reserve.indexer_decode_logits(q[0].shape[0] * q[0].shape[1], max_model_len,
                                        q[0].device) if q[0].dim() == 4 else None
    return ours(q[0], kv_cache, weights, context_lens, block_tables, max_model_len, out=out)


# V4.1's index sources after the candidate source (patch 0041): upstream computes every logit,
# then masks all but the candidate blocks to -inf. With ``candidate_logits`` on, and only
# where our indexer logits would have answered the DeepGEMM call (the bits are our kernel's),
# the masked logits come from the candidate blocks alone
# (``kernels.indexer_candidate_logits``); None: upstream's compute-then-mask runs.
def _candidates_covered(candidates, block_size: int, rows: int) -> bool:
    return (candidates is not None and block_size > 0 and candidates.dtype == torch.int32
            and candidates.dim() == 2 and candidates.shape[0] >= rows
            and candidates.shape[1] >= 1
            and (candidates.stride(1) == 1 or candidates.shape[1] == 1)
            and use("candidate_logits"))


def candidate_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k: int,
                         candidates, block_size: int):
    """Prefill: ``fp8_fp4_mqa_logits`` + ``apply_candidate_mask`` (row starts None, row ends
    ``ke - ks``) as one result, or None. ``candidates``: the chunk's rows of the candidate
    buffer (None for the candidate source itself and for unmasked index sources)."""
    rows = q[0].shape[0] if isinstance(q, tuple) else -1
    if not _candidates_covered(candidates, block_size, rows):
        return None
    if not _fp8_q(q) or kv[1].dtype != torch.float32 or not use("indexer_logits"):
        return None
    from vllm.deepinfer.kernels.indexer_candidate_logits import candidate_mqa_logits as ours
    return ours(q[0], kv[0], kv[1], weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k,
                candidates[:rows], block_size)


def candidate_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables,
                               max_model_len: int, indices, candidates, block_size: int):
    """Decode: ``fp8_fp4_paged_mqa_logits`` + ``apply_candidate_mask`` (row ends the context
    lengths, ``row_repeat`` = next_n when there is one per request) as one result, or None.
    ``candidates``: the candidate buffer (its first B * next_n rows are read)."""
    rows = q[0].shape[0] * q[0].shape[1] if isinstance(q, tuple) and q[0].dim() == 4 else -1
    if indices is not None or not _candidates_covered(candidates, block_size, rows):
        return None
    if not _fp8_q(q) or weights.dtype != torch.float32 or not use("indexer_logits"):
        return None
    from vllm.deepinfer import reserve
    from vllm.deepinfer.kernels.indexer_candidate_logits import (
        candidate_paged_mqa_logits as ours)
    # The same reserved workspace view as paged_mqa_logits' (vllm.deepinfer.reserve).
    out = reserve.indexer_decode_logits(rows, max_model_len, q[0].device)
    return ours(q[0], kv_cache, weights, context_lens, block_tables, max_model_len,
                candidates[:rows], block_size, out=out)


def pack_fp8_as_bytes(x: torch.Tensor) -> bool:
    """Patch 0017: ``pack_seq_triton`` moves an e4m3 tensor as uint8 bytes (its fp8 load does
    not compile below sm_89)."""
    return x.dtype == torch.float8_e4m3fn and use("fp8_sw")


# Patch 0017 routes pack_seq_triton's e4m3 pack and unpack_seq_triton here: upstream's
# kernels form row offsets in int32 (past 262,144 padded rows at 64 heads x 128 bytes);
# kernels.pack_seq moves the same rows with int64 offsets. None: upstream keeps the call.
def pack_seq_fp8(x: torch.Tensor, lengths: torch.Tensor):
    """``pack_seq_triton`` of an e4m3 tensor on the Ampere path: ours, padded with 0 (+0.0),
    as patch 0017's byte path pads; None elsewhere."""
    if not pack_fp8_as_bytes(x):
        return None
    from vllm.deepinfer.kernels.pack_seq import pack_seq_bytes
    return pack_seq_bytes(x, lengths, 0)


def unpack_seq(packed: torch.Tensor, lengths: torch.Tensor):
    """``unpack_seq_triton`` on the Ampere path (feature ``fp8_sw``): ours; None elsewhere."""
    if torch.version.hip is not None or not use("fp8_sw") or packed.element_size() not in (
            1, 2, 4, 8):
        return None
    from vllm.deepinfer.kernels.pack_seq import unpack_seq as ours
    return ours(packed, lengths)


# ----------------------------------------------------------------------------- fp8 writers
# Upstream's fp8 writers (Triton kernels that cast to float8_e4m3fn) do not compile below
# sm_89. With the ``fp8_sw`` feature on (default: sm80/sm86) each upstream writer function
# hands its call to our fp8-free variant here, which writes the same bytes; False/None
# means the upstream body runs.
def fp8_writers() -> bool:
    return torch.version.hip is None and use("fp8_sw")


def rope_quant_insert(latent, positions, cos_sin_cache, kv_cache, slot_mapping,
                      compress_ratio: int, fp8_scale=None) -> bool:
    """V4.1 compressed-KV insert into the 584-byte record cache (the other record layouts
    and the plain FlashInfer rows stay upstream's)."""
    if (fp8_scale is not None or kv_cache.dtype != torch.uint8
            or kv_cache.shape[-1] != RECORD_BYTES or not fp8_writers()):
        return False
    from vllm.deepinfer.kernels.fp8_writers_v41 import rope_quant_insert as ours
    ours(latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio)
    return True


def indexer_k_norm_rope_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps,
                              k_cache, kv_slot_mapping, compress_ratio: int,
                              use_fp4_cache: bool, *, mx_scale: bool) -> bool:
    """V4.1 indexer K store, FP8 cache (the MXFP4 cache needs the sm_100 e2m1 cvt)."""
    if use_fp4_cache or not fp8_writers():
        return False
    from vllm.deepinfer.kernels.fp8_writers_v41 import indexer_k_norm_rope_store as ours
    ours(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache,
         kv_slot_mapping, compress_ratio, use_fp4_cache, mx_scale=mx_scale)
    return True


def compress_norm_rope_store(**kwargs) -> bool:
    """V4 compressor's Triton launcher (``compress_norm_rope_store_triton``'s keywords, plus
    ``mx_scale``): the 584-byte attention record and the FP8 indexer row."""
    if kwargs.get("use_fp4_cache") or not fp8_writers():
        return False
    from vllm.deepinfer.kernels.fp8_writers_v4_compress import compress_norm_rope_store_triton
    compress_norm_rope_store_triton(**kwargs)
    return True


def fused_inv_rope_fp8_quant(o, positions, cos_sin_cache, n_groups: int, heads_per_group: int,
                             nope_dim: int, rope_dim: int, quant_group_size: int,
                             tma_aligned_scales: bool, quantize: bool):
    """V4 inverse RoPE + fp8 quant: (out [T, G, D], scales) as upstream returns, or None."""
    if not fp8_writers():
        return None
    from vllm.deepinfer.kernels.fp8_writers_v4 import fused_inv_rope_fp8_quant as ours
    return ours(o, positions, cos_sin_cache, n_groups, heads_per_group, nope_dim, rope_dim,
                quant_group_size, tma_aligned_scales, quantize)


def fused_indexer_q_rope_quant(positions, index_q, index_q_cos_sin_cache, index_weights,
                               index_weights_softmax_scale: float,
                               index_weights_head_scale: float, use_fp4: bool,
                               weights_out_dtype):
    """V4 indexer Q RoPE + fp8 quant with the scale folded into the weights, or None (the
    MXFP4 Q needs the sm_100 e2m1 cvt)."""
    if use_fp4 or not fp8_writers():
        return None
    from vllm.deepinfer.kernels.fp8_writers_v4 import fused_indexer_q_rope_quant as ours
    return ours(positions, index_q, index_q_cos_sin_cache, index_weights,
                index_weights_softmax_scale, index_weights_head_scale, False, weights_out_dtype)


# ----------------------------------------------------------------------------- engram lookup
def engram_lookup(weight, scales, ids, sorted_dst, out, vocab_start: int, vocab_end: int,
                  num_rows: int, **kw) -> bool:
    """Patch 0019: V4.1's Engram table lookup reads the e4m3 table as bytes (upstream's kernel
    takes a float8_e4m3fn pointer, which does not compile below sm_89). Same feature as the
    fp8 writers; False: upstream's kernel runs."""
    if not fp8_writers():
        return False
    from vllm.deepinfer.kernels.engram_lookup import engram_lookup as ours
    ours(weight, scales, ids, sorted_dst, out, vocab_start, vocab_end, num_rows, **kw)
    return True
