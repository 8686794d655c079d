"""Plain-torch math of the one-layer harness, shared by the layer setup
(benchmarks/one_layer_path.py: cos/sin cache, the compressor stand-in, wo_a dequantization)
and the references and checks (benchmarks/one_layer_check.py): GPT-J RoPE, RMSNorm, the
kernels' bf16 rounding, record and index-row quantization, written independently of the
kernels. Imports nothing of the harness (torch and the overlay's ``arch`` / ``kv_record``).
"""
from __future__ import annotations

import torch

from vllm.deepinfer import arch, kv_record

D, NOPE, ROPE = kv_record.HEAD_DIM, kv_record.NOPE_DIM, kv_record.ROPE_DIM
FP8_MAX = kv_record.FP8_MAX
IDX_D, IDX_ROPE = kv_record.INDEX_HEAD_DIM, kv_record.INDEX_ROPE_DIM


def cos_sin_cache(max_pos: int, dev) -> torch.Tensor:
    """[max_pos, 64] fp32 = cos (32) | sin (32), GPT-J frequencies, base 10000."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], 1).float().to(dev)


def rope_gptj(x: torch.Tensor, pos: torch.Tensor, cs: torch.Tensor, inverse=False) -> torch.Tensor:
    """GPT-J RoPE of the last 64 dims of fp32 ``x`` [n, ..., d] (pairs (even, odd)) at ``pos``
    [n]: (a c - b s, b c + a s); inverse (a c + b s, b c - a s)."""
    x = x.clone()
    c = cs[pos.long(), :ROPE // 2]
    s = cs[pos.long(), ROPE // 2:]
    while c.ndim < x.ndim:
        c, s = c.unsqueeze(1), s.unsqueeze(1)
    d0 = x.shape[-1] - ROPE
    a, b = x[..., d0::2].clone(), x[..., d0 + 1::2].clone()
    if inverse:
        s = -s
    x[..., d0::2] = a * c - b * s
    x[..., d0 + 1::2] = b * c + a * s
    return x


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 -> fp32 as the kernels' casts do it: round to nearest even on a GPU;
    truncation under the Triton interpreter (which truncates fp32 -> bf16), so that the CPU
    tests can demand identical bytes (tests/test_fp8_writers.py notes the same interpreter
    behaviour)."""
    x = x.float()
    if arch.interpreting():
        return (x.contiguous().view(torch.int32) & -65536).view(torch.float32)
    return x.to(torch.bfloat16).float()


def pow2_scale_exp(amax: torch.Tensor) -> torch.Tensor:
    return torch.ceil(torch.log2(amax.clamp_min(1e-4) / FP8_MAX))


def quantize_records(x: torch.Tensor) -> torch.Tensor:
    """fp32 [n, 512] (RoPE applied) -> record bytes [n, 584] (``kv_record.pack_records``):
    codes and scales from the package's torch reference (``kv_record.quantize_rows``), the
    RoPE values rounded as the kernels round them here."""
    nope, scales, _ = kv_record.quantize_rows(x)
    return kv_record.pack_records(nope, scales, bf16_round(x[:, NOPE:]).to(torch.bfloat16))


def quantize_idx(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., 128] -> (e4m3 codes [..., 128] uint8, power-of-two scale [...] fp32)."""
    e = pow2_scale_exp(x.abs().amax(-1))
    scale = torch.exp2(e)
    codes = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scale


def e4m3_to_float(codes: torch.Tensor) -> torch.Tensor:
    return codes.contiguous().view(torch.float8_e4m3fn).float()


def dequantize(rec: torch.Tensor) -> torch.Tensor:
    """record bytes [n, 584] -> fp32 [n, 512], NaN entries zeroed (as the attention reads them)."""
    return kv_record.dequantize_records(rec, scrub_nan=True)


def compress_pool(kv_score: torch.Tensor, positions: torch.Tensor, ratio: int,
                  norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Stand-in for upstream's compressor pooling (``fused_save_compress_norm``), shared by both
    paths: bf16 latent [n, 512] at every group's last token (other rows zero). ``kv_score``
    [n, ratio == 1 ? 512 : 1024] fp32 (kv | score) for all tokens of each request, in position
    order from position 0 (so a group's earlier token is the previous row)."""
    n = kv_score.shape[0]
    latent = torch.zeros(n, D, dtype=torch.bfloat16, device=kv_score.device)
    last = ((positions + 1) % ratio == 0).nonzero().flatten()
    if ratio == 1:
        pooled = kv_score[last, :D]
    else:
        rows = last[:, None] - (ratio - 1) + torch.arange(ratio, device=last.device)[None, :]
        kv, score = kv_score[rows, :D], kv_score[rows, D:]
        pooled = (kv * torch.softmax(score, dim=1)).sum(1)
    latent[last] = rms_norm(pooled, norm_w, eps).to(torch.bfloat16)
    return latent


def dequant_wo_a(codes: torch.Tensor, scale: torch.Tensor, groups: int, rank: int) -> torch.Tensor:
    """fp8 [groups * rank, K] with [cdiv(rows,128), cdiv(K,128)] block scales -> fp32
    [groups, rank, K] (upstream ``_get_cached_wo_a_bf16`` before its bf16 cast)."""
    rows, cols = codes.shape
    s = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return (codes.float() * s).view(groups, rank, cols)
