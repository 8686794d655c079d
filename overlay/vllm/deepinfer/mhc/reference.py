"""Plain-torch fp32 references of vLLM 0.33.0's mHC TileLang operations.

Written from the kernels' own arithmetic (vllm/model_executor/kernels/mhc/tilelang_kernels.py):
the projection ``mixes = x @ fn.T`` with ``sqrsum = sum(x^2)``, the coefficient epilogue
(sigmoid pre/post gates, Sinkhorn-normalised residual mix), the collapse of the hc streams
into the layer input with its fused RMSNorm, the post mapping ``new[j] = post[j] * x +
sum_k comb[k, j] * residual[k]``, and hc_head. Everything is computed in fp32 from the
kernels' bf16/fp32 inputs; bf16 appears only where the kernels themselves round (the
stored residual streams and the layer input), so a kernel result differs from these by
reduction order and tf32/bf16 rounding only. Used by tests and benchmarks as the common
yardstick for upstream's kernels and ours.
"""
from __future__ import annotations

import torch


def prenorm_gemm(x: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x.float() @ fn.T, sum(x.float()^2, -1))`` for x ``[T, K]`` bf16, fn ``[N, K]`` fp32."""
    xf = x.float()
    return xf @ fn.float().T, xf.square().sum(-1)


def coefficients(mixes: torch.Tensor, sqrsum: torch.Tensor, rms_numel: int,
                 hc_scale: torch.Tensor, hc_base: torch.Tensor, rms_eps: float,
                 hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult_value: float,
                 sinkhorn_repeat: int, hc_mult: int):
    """The epilogue's coefficients from one token's projection: ``(pre [T, hc],
    post [T, hc], comb [T, hc, hc])``. ``mixes`` ``[T, N]`` and ``sqrsum`` ``[T]`` are the
    split-summed projection outputs."""
    rms = torch.rsqrt(sqrsum / rms_numel + rms_eps)
    m = mixes * rms[:, None]
    hc = hc_mult
    pre = torch.sigmoid(m[:, :hc] * hc_scale[0] + hc_base[:hc]) + hc_pre_eps
    post = torch.sigmoid(m[:, hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc]) * hc_post_mult_value
    cm = (m[:, 2 * hc:] * hc_scale[2] + hc_base[2 * hc:]).view(-1, hc, hc)
    cm = torch.softmax(cm, dim=-1) + hc_sinkhorn_eps
    cm = cm / (cm.sum(-2, keepdim=True) + hc_sinkhorn_eps)
    for _ in range(sinkhorn_repeat - 1):
        cm = cm / (cm.sum(-1, keepdim=True) + hc_sinkhorn_eps)
        cm = cm / (cm.sum(-2, keepdim=True) + hc_sinkhorn_eps)
    return pre, post, cm


def collapse_norm(streams: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor | None,
                  norm_eps: float, round_before_norm: bool = False) -> torch.Tensor:
    """Layer input: ``sum_j pre[j] * streams[j]`` (streams ``[T, hc, H]``), stored bf16, then
    the fused RMSNorm with ``norm_weight`` (bf16 out). ``round_before_norm``: the delayed
    (V4.1) epilogue squares the bf16-rounded sum; V4's squares the fp32 sum."""
    col = (pre[:, :, None] * streams.float()).sum(1)
    if norm_weight is None:
        return col.to(torch.bfloat16)
    rounded = col.to(torch.bfloat16).float()
    sq = rounded if round_before_norm else col
    r = torch.rsqrt(sq.square().mean(-1, keepdim=True) + norm_eps)
    return (rounded * r * norm_weight.float()).to(torch.bfloat16)


def post(x: torch.Tensor, residual: torch.Tensor, post_mix: torch.Tensor,
         comb_mix: torch.Tensor) -> torch.Tensor:
    """``mhc_post``: new residual streams ``[T, hc, H]`` (fp32; the kernel stores bf16)."""
    pm = post_mix.reshape(residual.shape[0], residual.shape[1]).float()
    return pm[:, :, None] * x.float()[:, None, :] + torch.einsum(
        "tkj,tkh->tjh", comb_mix.float(), residual.float())


def broadcast_pre(x, fn_broadcast, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                  hc_post_mult_value, sinkhorn_repeat, norm_weight, norm_eps, hc_mult):
    """``mhc_pre_broadcast_tilelang`` (V4's first layer): ``(residual_out [T, hc, H] bf16,
    post [T, hc, 1], comb [T, hc, hc], layer_input [T, H] bf16)``."""
    hidden = x.shape[1]
    mixes, sqrsum = prenorm_gemm(x, fn_broadcast)
    pre, post_mix, comb = coefficients(mixes, sqrsum, hidden, hc_scale, hc_base, rms_eps,
                                       hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                                       sinkhorn_repeat, hc_mult)
    streams = x[:, None, :].expand(-1, hc_mult, -1)
    layer_input = collapse_norm(streams, pre, norm_weight, norm_eps)
    return streams.contiguous(), post_mix[:, :, None], comb, layer_input


def fused_post_pre(x, residual, post_mix, comb_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                   hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_weight=None,
                   norm_eps=1e-6, pre_mix=None, delayed=False):
    """``mhc_fused_post_pre_tilelang`` (V4; ``delayed=False``) and
    ``mhc_fused_post_pre_delayed_tilelang`` (V4.1; ``delayed=True``, collapsing with the
    carried ``pre_mix`` — stream 0 when None — and returning the next pre-mix).

    Returns ``(residual_cur bf16 [T, hc, H], post [T, hc, 1], comb [T, hc, hc],
    layer_input bf16 [T, H], next_pre [T, hc])``. The projection reads the bf16-rounded
    new residual, as the kernels do (they store it bf16 and the split-k GEMM reads that)."""
    t, hc, hidden = residual.shape
    new = post(x, residual, post_mix, comb_mix)
    # The fused kernel projects its fp32 registers; the unfused path reads the bf16 store.
    # The difference is one bf16 rounding of the GEMM input, far inside the tolerance.
    new_bf16 = new.to(torch.bfloat16)
    mixes, sqrsum = prenorm_gemm(new_bf16.view(t, hc * hidden), fn)
    pre, pm, comb = coefficients(mixes, sqrsum, hc * hidden, hc_scale, hc_base, rms_eps,
                                 hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                                 sinkhorn_repeat, hc)
    if delayed:
        use = pre_mix.float() if pre_mix is not None else torch.nn.functional.one_hot(
            torch.zeros(t, dtype=torch.long, device=x.device), hc).float()
        layer_input = collapse_norm(new_bf16, use, norm_weight, norm_eps,
                                    round_before_norm=True)
    else:
        layer_input = collapse_norm(new_bf16, pre, norm_weight, norm_eps)
    return new_bf16, pm[:, :, None], comb, layer_input, pre


def hc_head(residual, fn, hc_scale, hc_base, rms_eps, hc_eps):
    """``hc_head_fused_kernel_tilelang``: ``[T, H]`` bf16 from ``[T, hc, H]`` streams."""
    t, hc, hidden = residual.shape
    xf = residual.float().view(t, hc * hidden)
    mixes = xf @ fn.float().T
    rms = torch.rsqrt(xf.square().sum(-1) / (hc * hidden) + rms_eps)
    pre = torch.sigmoid(mixes * rms[:, None] * hc_scale[0] + hc_base) + hc_eps
    return (pre[:, :, None] * residual.float()).sum(1).to(torch.bfloat16)
