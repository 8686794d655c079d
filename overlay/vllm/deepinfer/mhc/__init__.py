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
    """Whether V4's first-layer mHC pre projects with TileLang instead of DeepGEMM.

    ``DEEPINFER_MHC=1/0`` decides when set. Otherwise ours runs where the feature is on
    by default (sm80/sm86/sm89), and also wherever vLLM reports DeepGEMM unsupported
    (``is_deep_gemm_supported()`` False, for example a capability reported as 8.0 on a
    Hopper GPU), since upstream's call cannot succeed there. A GPU below 8.0 (no variant
    of ours) stays upstream's.
    """
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
