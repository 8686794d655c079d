"""The 584-byte DeepSeek-V4 KV record (V4, and V4.1 off SM100) and plain-torch pack/unpack.

Page of ``bs`` tokens: token ``i`` data at ``i*576`` — bytes [0,448) e4m3fn NoPE values,
[448,576) 64 bf16 RoPE values — and its scales at ``bs*576 + i*8``: 7 UE8M0 bytes (one per
64 NoPE dims) then one zero pad byte. Pages are addressed through ``cache.stride(0)``
(V4.1 pages can share one physical block), never ``bs*584``.

The torch functions here are the references the kernel tests compare against; they follow
upstream's encoder (``quantize_and_insert_k_kernel``): scale ``2^ceil(log2(max(amax,1e-4)/448))``,
value ``clamp(x/scale, -448, 448)`` rounded to e4m3fn, scale byte ``clamp(e+127, 0, 255)``.
"""
from __future__ import annotations

import torch

NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM  # 512
QUANT_BLOCK = 64
NUM_SCALES = NOPE_DIM // QUANT_BLOCK  # 7
SCALE_BYTES = 8  # 7 scales + 1 pad
DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
RECORD_BYTES = DATA_BYTES + SCALE_BYTES  # 584
FP8_MAX = 448.0


def quantize_rows(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, 512] -> (nope e4m3 bytes [n, 448] u8, scale bytes [n, 8] u8, rope [n, 64] bf16)."""
    if k.ndim != 2 or k.shape[1] != HEAD_DIM:
        raise ValueError(f"k must be [n, {HEAD_DIM}], got {tuple(k.shape)}")
    x = k[:, :NOPE_DIM].float().reshape(-1, NUM_SCALES, QUANT_BLOCK)
    amax = x.abs().amax(dim=-1).clamp_min(1e-4)
    e = torch.ceil(torch.log2(amax / FP8_MAX))
    q = (x / torch.exp2(e)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scales = torch.zeros(k.shape[0], SCALE_BYTES, dtype=torch.uint8, device=k.device)
    scales[:, :NUM_SCALES] = (e + 127).clamp(0, 255).to(torch.uint8)
    return q.view(torch.uint8).reshape(-1, NOPE_DIM), scales, k[:, NOPE_DIM:].to(torch.bfloat16)


def new_cache(num_blocks: int, block_size: int, device="cpu") -> torch.Tensor:
    return torch.zeros(num_blocks, block_size, RECORD_BYTES, dtype=torch.uint8, device=device)


def write_records(cache: torch.Tensor, slots: torch.Tensor, nope: torch.Tensor,
                  scales: torch.Tensor, rope: torch.Tensor) -> None:
    """Write raw record parts at flat ``slots`` (block * block_size + pos) of ``cache``."""
    bs = cache.shape[1]
    flat = cache.as_strided((cache.shape[0], bs * RECORD_BYTES), (cache.stride(0), 1))
    for j, slot in enumerate(slots.tolist()):
        b, i = divmod(int(slot), bs)
        page = flat[b]
        page[i * DATA_BYTES: i * DATA_BYTES + NOPE_DIM] = nope[j]
        page[i * DATA_BYTES + NOPE_DIM: (i + 1) * DATA_BYTES] = rope[j].contiguous().view(torch.uint8)
        page[bs * DATA_BYTES + i * SCALE_BYTES: bs * DATA_BYTES + (i + 1) * SCALE_BYTES] = scales[j]


def insert_rows(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    """Quantize ``k`` [n, 512] like upstream's writer and store it at ``slots``."""
    write_records(cache, slots, *quantize_rows(k))


def read_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Dequantize records at ``slots`` to fp32 [n, 512]: e4m3 value * 2^(byte-127), RoPE as is."""
    bs = cache.shape[1]
    flat = cache.as_strided((cache.shape[0], bs * RECORD_BYTES), (cache.stride(0), 1))
    out = torch.empty(len(slots), HEAD_DIM, dtype=torch.float32, device=cache.device)
    for j, slot in enumerate(slots.tolist()):
        b, i = divmod(int(slot), bs)
        page = flat[b]
        nope = page[i * DATA_BYTES: i * DATA_BYTES + NOPE_DIM].view(torch.float8_e4m3fn).float()
        sc = page[bs * DATA_BYTES + i * SCALE_BYTES: bs * DATA_BYTES + i * SCALE_BYTES + NUM_SCALES]
        scale = torch.exp2(sc.double() - 127).float()
        out[j, :NOPE_DIM] = (nope.reshape(NUM_SCALES, QUANT_BLOCK) * scale[:, None]).reshape(-1)
        out[j, NOPE_DIM:] = page[i * DATA_BYTES + NOPE_DIM: (i + 1) * DATA_BYTES].view(torch.bfloat16).float()
    return out
