"""Checkpoint formats: the linear block shapes, the element formats' limits, and the
UE8M0 / fp8-block / MXFP4 encoders and decoders (tools/make_checkpoint.py writes with the
encoders; benchmarks/e2e/reference.py reads checkpoints back with the decoders)."""
from __future__ import annotations

import torch

from _common import ToolError

FORMATS = ("bf16", "fp8", "mxfp8")
# Block shapes of the linear weight scales, [rows, cols] of the weight per scale: the
# published DeepSeek-V4 fp8 checkpoints use 128x128 blocks; V4.1's MXFP8 linears 32x32
# (vLLM's _linear_scale_param_name keys the MXFP8 path off exactly [32, 32]).
LINEAR_BLOCK = {"fp8": (128, 128), "mxfp8": (32, 32)}
# MXFP4 (OCP microscaling): 32 e2m1 values share one UE8M0 scale along the input dim.
MXFP4_BLOCK = 32
# Engram tables: fp8 rows with one UE8M0 scale per 32 values (ParallelEngramEmbedding's
# block_size default, the only one vLLM 0.33.0 builds).
ENGRAM_SCALE_BLOCK = 32
# Largest finite magnitudes of the element formats: e4m3fn and e2m1.
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# The e2m1 magnitudes by code (bit 3 is the sign), low nibble = even element.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Floor of a block's amax before taking its scale exponent (all-zero blocks); the same
# floor the UE8M0 KV-record encoder uses.
AMAX_FLOOR = 1e-4


def ue8m0_exponent(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """Power-of-two scale exponent per block: the smallest e with amax / 2^e <= fmt_max
    (no element saturates), clamped to UE8M0's range."""
    return torch.ceil(torch.log2(amax.clamp_min(AMAX_FLOOR) / fmt_max)).clamp(-127, 127)


def e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    return (e.to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> fp32 powers of two (byte b is 2^(b-127); 255 would be NaN)."""
    b = s.view(torch.uint8).to(torch.int32)
    return torch.exp2((b - 127).to(torch.float32))


def _blocks(w: torch.Tensor, bn: int, bk: int, name: str) -> torch.Tensor:
    n, k = w.shape
    if n % bn or k % bk:
        raise ToolError(f"{name}: shape {tuple(w.shape)} is not a multiple of the "
                        f"[{bn}, {bk}] quantization block; change the config dimension")
    return w.reshape(n // bn, bn, k // bk, bk)


def quantize_fp8_blocks(w: torch.Tensor, bn: int, bk: int, name: str = "tensor"
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 weight + UE8M0 scale per [bn, bk] block: w ~= q * scale."""
    x = _blocks(w.float(), bn, bk, name)
    e = ue8m0_exponent(x.abs().amax(dim=(1, 3)), E4M3_MAX)
    q = (x / torch.exp2(e)[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
    return q, e8m0_from_exponent(e)


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    bn, bk = n // scale.shape[0], k // scale.shape[1]
    s = e8m0_to_float(scale).repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return q.float() * s


def quantize_mxfp4(w: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 as vLLM's Mxfp4MoEMethod loads it: [N, K/2] uint8 (element 2j in the low
    nibble, 2j+1 in the high; nibble = sign << 3 | e2m1 magnitude code) and [N, K/32]
    UE8M0 scales; values round to the nearest e2m1 magnitude."""
    n, k = w.shape
    x = _blocks(w.float(), 1, MXFP4_BLOCK, name).reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    e = ue8m0_exponent(x.abs().amax(dim=2), E2M1_MAX)
    y = (x / torch.exp2(e)[..., None]).reshape(n, k)
    grid = torch.tensor(E2M1_GRID)
    mids = (grid[1:] + grid[:-1]) / 2
    mag = torch.bucketize(y.abs(), mids).to(torch.uint8)
    code = mag | ((y < 0) & (mag > 0)).to(torch.uint8) << 3
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), e8m0_from_exponent(e)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(E2M1_GRID)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).to(torch.int64)
    vals = grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return vals * e8m0_to_float(scale).repeat_interleave(MXFP4_BLOCK, -1)
