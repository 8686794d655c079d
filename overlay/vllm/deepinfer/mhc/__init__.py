"""mHC (manifold-constrained hyper-connections) without DeepGEMM, for Ampere.

vLLM 0.33.0 runs DeepSeek-V4.1/V4's mHC through TileLang on NVIDIA GPUs
(``vllm/model_executor/kernels/mhc/tilelang.py``). One call cannot run below capability
9.0: V4's first-layer ``mhc_pre_broadcast_tilelang`` passes ``use_tilelang_fallback=False``
to its projection, which therefore always calls DeepGEMM's ``tf32_hc_prenorm_gemm`` (built
for SM90/SM100 only). Patch 0030 asks ``broadcast_prenorm_gemm`` here first: it projects
the embedding row (``T x hidden``) with TileLang's prenorm GEMM at ``hc_mult=1`` — the call
V4.1's own first layer (``mhc_pre_delayed_tilelang``) makes for the same broadcast
projection when DeepGEMM is absent — and returns ``(mixes [1, T, N], sqrsum [1, T])``
with one split, which upstream's broadcast epilogue then consumes unchanged.

The decision is pure Python (``first_layer_on_tilelang``); the launch imports vLLM's
kernel objects lazily, so this package stays importable without vLLM. Switch:
``DEEPINFER_MHC=0`` (or ``DEEPINFER_DISABLE=mhc``) leaves every call to upstream.
"""
from __future__ import annotations

import functools
import logging

from vllm.deepinfer import envs, routing

logger = logging.getLogger("vllm.deepinfer")

FEATURE = "mhc"
# The Ampere configs (FUSED_GEOMETRY, the tensor-core projection from TC_MIN_TOKENS): on for
# sm80/sm86 as measured by the mhc suite (DEEPINFER_MHC_TUNED=0 turns them off; docs/mhc.md).
TUNED_FEATURE = "mhc_tuned"
# TileLang's prenorm GEMM gives each thread K / n_thr elements; its launcher picks
# n_thr = 512 (1024 under 128 tokens when K % 1024 == 0) and asserts K % n_thr == 0.
PRENORM_K_MULTIPLE = 512


@functools.cache
def _warned_upstream() -> bool:
    logger.warning("deepinfer: mhc switched off while DeepGEMM is unavailable: upstream's V4 "
                   "first-layer mHC pre calls DeepGEMM's tf32_hc_prenorm_gemm and will fail "
                   "(unset DEEPINFER_MHC=0 / DEEPINFER_DISABLE=mhc)")
    return True


def first_layer_on_tilelang(deep_gemm_supported: bool) -> bool:
    """Whether our mHC path runs (V4's first-layer pre with TileLang instead of DeepGEMM; the
    tensor-core projection; the Ampere geometry is ``routing.use`` alone).

    ``DEEPINFER_MHC=1/0`` decides when set. Otherwise ours runs where the feature is on
    by default (sm80/sm86/sm89), and also wherever vLLM reports DeepGEMM unsupported
    (``is_deep_gemm_supported()`` False, for example a capability reported as 8.0 on a
    Hopper GPU), since upstream's call cannot succeed there. A GPU below 8.0 (no variant
    of ours) and ROCm stay upstream's.
    """
    import torch
    if torch.version.hip is not None:  # ROCm runs mHC through its own (AITER) kernels
        return False
    explicit = envs.explicit(FEATURE)
    if explicit is not None:
        if not explicit and not deep_gemm_supported:
            _warned_upstream()
        return explicit
    if routing._variant() is None:
        return False
    return routing.use(FEATURE) or not deep_gemm_supported


def broadcast_prenorm_gemm(x, fn_broadcast, deep_gemm_supported: bool):
    """Patch 0030: the projection of ``mhc_pre_broadcast_tilelang`` without DeepGEMM.

    ``x``: the bf16 embedding rows ``[T, hidden]``; ``fn_broadcast``: the fp32 projection
    summed over the hc copies, ``[N, hidden]``. Returns ``(mixes [1, T, N] fp32,
    sqrsum [1, T] fp32)`` — ``mixes = x @ fn_broadcast.T``, ``sqrsum = sum(x^2)``, one
    split — or None when upstream's DeepGEMM call should run.
    """
    if not first_layer_on_tilelang(deep_gemm_supported):
        return None
    import torch
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"mhc broadcast pre: residual must be a contiguous bf16 [T, hidden] "
                         f"tensor, got {tuple(x.shape)} {x.dtype}")
    hidden = x.shape[1]
    if fn_broadcast.dtype != torch.float32 or fn_broadcast.dim() != 2 \
            or fn_broadcast.shape[1] != hidden:
        raise ValueError(f"mhc broadcast pre: fn_broadcast must be fp32 [N, {hidden}], got "
                         f"{tuple(fn_broadcast.shape)} {fn_broadcast.dtype}")
    if hidden % PRENORM_K_MULTIPLE:
        raise ValueError(f"mhc broadcast pre: hidden_size {hidden} is not a multiple of "
                         f"{PRENORM_K_MULTIPLE} (TileLang's prenorm GEMM splits it across "
                         f"{PRENORM_K_MULTIPLE} threads); set DEEPINFER_MHC=0 on a GPU with "
                         f"DeepGEMM")
    num_tokens = x.shape[0]
    if projection_on_tc(num_tokens, hidden, fn_broadcast.shape[0], deep_gemm_supported):
        from vllm.deepinfer.mhc import kernels
        return kernels.prenorm_gemm_tc(x, fn_broadcast, sm_count(x.device))
    out = torch.empty(1, num_tokens, fn_broadcast.shape[0], dtype=torch.float32,
                      device=x.device)
    sqrsum = torch.empty(1, num_tokens, dtype=torch.float32, device=x.device)
    if num_tokens:
        from vllm.model_executor.kernels.mhc.tilelang_kernels import (
            _HC_PRENORM_GEMM_TILELANG_KERNEL,
        )
        # hidden_size=hidden, hc_mult=1: the kernel reads x as [T, 1 * hidden].
        _HC_PRENORM_GEMM_TILELANG_KERNEL(x, fn_broadcast, out, sqrsum, hidden, 1)
    return out, sqrsum


# ----------------------------------------------------------------------------- projection
# From this many tokens on, the mHC projection (x [T, K] @ fn.T with the squared sum) runs on
# tensor cores (vllm.deepinfer.mhc.kernels.prenorm_gemm_tc) instead of upstream's per-thread
# FMA kernels: the fused post + pre kernel reads all of fn (24 x K fp32) once per token,
# the tensor-core GEMM once per 16-64 tokens. Measured (mhc suite, H200, Ampere builds,
# hidden 5120; benchmarks/results/archive/h200-2026-12-01-mhc-5f462a5.json): post + tensor-core
# projection against upstream's fused kernel 0.79x at 16 tokens, 0.85x at 24, 0.99x at 32;
# against upstream's post + FMA projection (no fused kernel above 32) 1.55x at 64, 1.80x at
# 128, 2.87x at 1024. So the tensor cores take over where upstream's fused kernel ends.
TC_MIN_TOKENS = 33


def sm_count(device) -> int:
    import torch
    from vllm.deepinfer import arch
    return arch.sm_count(torch.device(device))


def projection_on_tc(num_tokens: int, k: int, n_out: int, deep_gemm_supported: bool) -> bool:
    """Whether the projection of ``num_tokens`` rows of ``k`` columns runs on our
    tensor-core GEMM (the mhc feature on, or DeepGEMM absent; enough tokens; a shape the
    kernel tiles)."""
    if (num_tokens < TC_MIN_TOKENS or not routing.use(TUNED_FEATURE)
            or not first_layer_on_tilelang(deep_gemm_supported)):
        return False
    from vllm.deepinfer.mhc import kernels
    return kernels.supported(k, n_out)


def prenorm_gemm(x, fn, deep_gemm_supported: bool):
    """Patch 0030: the mHC projection ``(mixes [S, T, N], sqrsum [S, T])`` on tensor cores,
    or None (upstream's DeepGEMM or TileLang FMA projection runs). ``S`` is one of
    ``kernels.SPLIT_BUCKETS``; the epilogues sum the splits."""
    if not projection_on_tc(x.shape[0], x.shape[1], fn.shape[0], deep_gemm_supported):
        return None
    import torch
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or fn.dtype != torch.float32 \
            or not fn.is_contiguous() or fn.shape[1] != x.shape[1]:
        raise ValueError(f"mhc projection: x must be contiguous bf16 [T, K] and fn contiguous "
                         f"fp32 [N, K]; got x {tuple(x.shape)} {x.dtype}, fn "
                         f"{tuple(fn.shape)} {fn.dtype}")
    from vllm.deepinfer.mhc import kernels
    return kernels.prenorm_gemm_tc(x, fn, sm_count(x.device))


# ----------------------------------------------------------------------------- fused geometry
# The fused post + pre-norm GEMM (upstream's ``mhc_fused_tilelang``) launches a grid of
# (tokens, 24 / tile_n projection tiles, n_splits k-slices) blocks of n_thr threads; each
# thread walks hidden / (n_splits * n_thr) columns of its slice. Upstream tunes the geometry
# on GB300 (tilelang_kernels.py: (2, 8, 128) under 16 tokens, (6, 8, 128) for 16..32, no
# fused kernel above 32). ``mhc_fused_post_pre_split_config`` — upstream's one source of
# truth for the dispatch, the compile key and the launch — asks ``fused_post_pre_config``
# first (patch 0031); ``UPSTREAM`` means upstream's own rule decides.
UPSTREAM = object()

# hidden -> ((max_tokens, (tile_n, n_splits, n_thr)), ...), ascending; tokens above the
# last band take no fused kernel (upstream's post kernel, then the tensor-core projection).
# Empty: the candidate for 5120 (six projection rows per block over eight 640-column slices
# under 16 tokens instead of upstream's (2, 8, 128)) measured 0.91x to 1.01x of upstream's
# geometry from 1 to 12 tokens (mhc suite, H200, archive/h200-2026-12-01-mhc-5f462a5.json), so
# upstream's geometry stays at every hidden size. A measured winner goes here.
FUSED_GEOMETRY: dict[int, tuple[tuple[int, tuple[int, int, int]], ...]] = {}


def fused_post_pre_config(num_tokens: int, hidden_size: int, hc_mult: int):
    """Patch 0031: the Ampere ``(tile_n, n_splits, n_thr)`` of the fused post + pre-norm GEMM,
    None (no fused kernel at this token count), or ``UPSTREAM``."""
    bands = FUSED_GEOMETRY.get(hidden_size)
    if bands is None or hc_mult != 4 or not routing.use(FEATURE) or not routing.use(TUNED_FEATURE):
        return UPSTREAM
    for max_tokens, (tile_n, n_splits, n_thr) in bands:
        if num_tokens <= max_tokens:
            # The kernel drops projection tiles and k-slices it cannot fill evenly.
            if (hc_mult * (hc_mult + 2)) % tile_n or hidden_size % (n_splits * n_thr):
                raise ValueError(f"vllm.deepinfer.mhc.FUSED_GEOMETRY[{hidden_size}]: "
                                 f"{(tile_n, n_splits, n_thr)} does not tile 24 projections "
                                 f"x {hidden_size} columns; fix the table")
            return tile_n, n_splits, n_thr
    return None
