"""The cache records of DeepSeek-V4.1/V4 (V4, and V4.1 off SM100): layouts, sizes, and the
plain-torch pack/unpack every test, suite and harness uses as its reference.

KV record, 584 bytes per token. Page of ``bs`` tokens: token ``i`` data at ``i*576`` — bytes
[0,448) e4m3fn NoPE values, [448,576) 64 bf16 RoPE values — and its scales at
``bs*576 + i*8``: 7 UE8M0 bytes (one per 64 NoPE dims) then one zero pad byte. Pages are
addressed through ``cache.stride(0)`` (V4.1 pages can share one physical block), never
``bs*584``.

Index-K record (the sparse indexer's key cache, FP8 path), 132 bytes per token. Page of
``bs`` tokens: token ``i``'s 128 e4m3 codes at ``i*128``, its fp32 scale at ``bs*128 + i*4``.

The torch functions here are the references the kernel tests compare against; they follow
upstream's encoder (``quantize_and_insert_k_kernel``): scale ``2^ceil(log2(max(amax,1e-4)/448))``,
value ``clamp(x/scale, -448, 448)`` rounded to e4m3fn, scale byte ``clamp(e+127, 0, 255)``;
decode ``e4m3 * 2^(byte-127)`` (computed in float64, so byte 0 gives the fp32 subnormal
2^-127 and byte 255 gives inf, as the kernels' bit-shift decode does). Every function is
vectorized over the slots (no Python loop per row).
"""
from __future__ import annotations

import torch
import triton.language as tl

__all__ = [
    "NOPE_DIM", "ROPE_DIM", "HEAD_DIM", "QUANT_BLOCK", "NUM_SCALES", "SCALE_BYTES", "DATA_BYTES",
    "RECORD_BYTES", "FP8_MAX", "AMAX_FLOOR", "INDEX_HEAD_DIM", "INDEX_ROPE_DIM",
    "INDEX_SCALE_BYTES", "INDEX_RECORD_BYTES", "quantize_rows", "new_cache", "new_index_cache",
    "slot_coords", "record_views", "read_records", "pack_records", "write_records",
    "insert_rows", "dequantize_records", "read_rows", "index_views", "read_index_rows",
    "write_index_rows",
]

# ----------------------------------------------------------------------------- KV record
NOPE_DIM = 448                           # e4m3 dims of a 512-dim head
ROPE_DIM = 64                            # bf16 dims (the rotated tail)
HEAD_DIM = NOPE_DIM + ROPE_DIM           # 512
QUANT_BLOCK = 64                         # NoPE dims per UE8M0 scale
NUM_SCALES = NOPE_DIM // QUANT_BLOCK     # 7
SCALE_BYTES = 8                          # 7 scales + 1 pad: 8-byte aligned scale rows
DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM     # 576: e4m3 codes then bf16 RoPE
RECORD_BYTES = DATA_BYTES + SCALE_BYTES  # 584
FP8_MAX = 448.0                          # largest finite e4m3fn magnitude
# Below this amax a block gets the floor's scale 2^-22 instead of a zero division (upstream).
AMAX_FLOOR = 1e-4

# ----------------------------------------------------------------------------- index-K record
INDEX_HEAD_DIM = 128                     # V4.1/V4 index_head_dim
INDEX_ROPE_DIM = 64                      # rotated tail of an index key
INDEX_SCALE_BYTES = 4                    # one fp32 scale (or 4 packed UE8M0 bytes on SM100)
INDEX_RECORD_BYTES = INDEX_HEAD_DIM + INDEX_SCALE_BYTES  # 132

# The same sizes as Triton constexprs: a @triton.jit function may read a module global only
# when it is one. Kernels import these (never literals).
TL_HEAD_DIM = tl.constexpr(HEAD_DIM)
TL_NOPE_DIM = tl.constexpr(NOPE_DIM)
TL_QUANT_BLOCK = tl.constexpr(QUANT_BLOCK)
TL_NUM_SCALES = tl.constexpr(NUM_SCALES)
TL_DATA_BYTES = tl.constexpr(DATA_BYTES)
TL_SCALE_BYTES = tl.constexpr(SCALE_BYTES)
# A key row is handled as [8, 64]: the 7 NoPE chunks of one scale each, then the RoPE tail,
# which is exactly one chunk wide. Kernels rely on it.
assert ROPE_DIM == QUANT_BLOCK and NUM_SCALES * QUANT_BLOCK == NOPE_DIM


def quantize_rows(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, 512] -> (nope e4m3 bytes [n, 448] u8, scale bytes [n, 8] u8, rope [n, 64] bf16)."""
    if k.ndim != 2 or k.shape[1] != HEAD_DIM:
        raise ValueError(f"k: must be [n, {HEAD_DIM}], got {tuple(k.shape)}")
    x = k[:, :NOPE_DIM].float().reshape(-1, NUM_SCALES, QUANT_BLOCK)
    amax = x.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    e = torch.ceil(torch.log2(amax / FP8_MAX))
    q = (x / torch.exp2(e)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scales = torch.zeros(k.shape[0], SCALE_BYTES, dtype=torch.uint8, device=k.device)
    scales[:, :NUM_SCALES] = (e + 127).clamp(0, 255).to(torch.uint8)
    return q.view(torch.uint8).reshape(-1, NOPE_DIM), scales, k[:, NOPE_DIM:].to(torch.bfloat16)


def new_cache(num_blocks: int, block_size: int, device="cpu") -> torch.Tensor:
    return torch.zeros(num_blocks, block_size, RECORD_BYTES, dtype=torch.uint8, device=device)


def slot_coords(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, position in page) int64 of flat slots (slot = page * block_size + position)."""
    slots = slots.reshape(-1).long()
    return slots // block_size, slots % block_size


def record_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a [blocks, bs, 584] cache as (data [blocks, bs, 576], scale bytes [blocks, bs,
    8]) over the same storage: pages through ``cache.stride(0)``, a page's scales after its
    data region."""
    nb, bs, st, off = cache.shape[0], cache.shape[1], cache.stride(0), cache.storage_offset()
    return (cache.as_strided((nb, bs, DATA_BYTES), (st, DATA_BYTES, 1), off),
            cache.as_strided((nb, bs, SCALE_BYTES), (st, SCALE_BYTES, 1), off + bs * DATA_BYTES))


def read_records(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Record bytes [n, 584] (576 data bytes, then 8 scale bytes) at ``slots``."""
    page, row = slot_coords(slots.to(cache.device), cache.shape[1])
    data, scales = record_views(cache)
    return torch.cat([data[page, row], scales[page, row]], 1)


def pack_records(nope: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Record parts (``quantize_rows``'s outputs) -> record bytes [n, 584] in the order
    ``read_records`` returns them: 448 codes, 64 bf16 RoPE values, 8 scale bytes."""
    n = nope.shape[0]
    return torch.cat([nope.reshape(n, NOPE_DIM).view(torch.uint8),
                      rope.reshape(n, ROPE_DIM).to(torch.bfloat16).contiguous().view(torch.uint8),
                      scales.reshape(n, SCALE_BYTES).view(torch.uint8)], 1)


def write_records(cache: torch.Tensor, slots: torch.Tensor, nope: torch.Tensor,
                  scales: torch.Tensor, rope: torch.Tensor) -> None:
    """Write raw record parts (``quantize_rows``'s outputs) at ``slots`` of ``cache``."""
    rec = pack_records(nope, scales, rope).to(cache.device)
    page, row = slot_coords(slots.to(cache.device), cache.shape[1])
    data_v, scale_v = record_views(cache)
    data_v[page, row] = rec[:, :DATA_BYTES]
    scale_v[page, row] = rec[:, DATA_BYTES:]


def insert_rows(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    """Quantize ``k`` [n, 512] like upstream's writer and store it at ``slots``."""
    write_records(cache, slots, *quantize_rows(k))


def dequantize_records(rec: torch.Tensor, *, scrub_nan: bool = False) -> torch.Tensor:
    """Record bytes [n, 584] -> fp32 [n, 512]: e4m3 value * 2^(byte-127), RoPE as stored.
    ``scrub_nan``: NaN entries (e4m3 0x7F/0xFF, bf16 NaN) become 0, as upstream's attention
    kernels treat key rows."""
    n = rec.shape[0]
    codes = rec[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float()
    scale = torch.exp2(rec[:, DATA_BYTES:DATA_BYTES + NUM_SCALES].double() - 127).float()
    nope = (codes.reshape(n, NUM_SCALES, QUANT_BLOCK) * scale[..., None]).reshape(n, NOPE_DIM)
    rope = rec[:, NOPE_DIM:DATA_BYTES].contiguous().view(torch.bfloat16).float()
    out = torch.cat([nope, rope], 1)
    return torch.where(out.isnan(), 0.0, out) if scrub_nan else out


def read_rows(cache: torch.Tensor, slots: torch.Tensor, *, scrub_nan: bool = False) -> torch.Tensor:
    """Dequantized rows fp32 [n, 512] at ``slots`` (see ``dequantize_records``)."""
    return dequantize_records(read_records(cache, slots), scrub_nan=scrub_nan)


# ----------------------------------------------------------------------------- index-K rows
def new_index_cache(num_blocks: int, block_size: int, device="cpu") -> torch.Tensor:
    return torch.zeros(num_blocks, block_size, INDEX_RECORD_BYTES, dtype=torch.uint8,
                       device=device)


def index_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a [blocks, bs, 132] index-K cache as (codes [blocks, bs, 128] uint8, scales
    [blocks, bs] fp32) over the same storage (pages through ``cache.stride(0)``)."""
    nb, bs, st, off = cache.shape[0], cache.shape[1], cache.stride(0), cache.storage_offset()
    codes = cache.as_strided((nb, bs, INDEX_HEAD_DIM), (st, INDEX_HEAD_DIM, 1), off)
    sbytes = cache.as_strided((nb, bs * INDEX_SCALE_BYTES), (st, 1), off + bs * INDEX_HEAD_DIM)
    return codes, sbytes.view(torch.float32)


def read_index_rows(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [n, 128] uint8, scales [n] fp32) of the index keys at ``slots``."""
    page, row = slot_coords(slots.to(cache.device), cache.shape[1])
    codes, scales = index_views(cache)
    return codes[page, row], scales[page, row]


def write_index_rows(cache: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor,
                     scales: torch.Tensor) -> None:
    """Store index keys (codes [n, 128] uint8 or e4m3, fp32 scales [n]) at ``slots``."""
    page, row = slot_coords(slots.to(cache.device), cache.shape[1])
    codes_v, scales_v = index_views(cache)
    codes_v[page, row] = codes.reshape(-1, INDEX_HEAD_DIM).view(torch.uint8).to(cache.device)
    scales_v[page, row] = scales.reshape(-1).to(device=cache.device, dtype=torch.float32)
