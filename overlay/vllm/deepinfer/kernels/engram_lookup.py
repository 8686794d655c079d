"""DeepSeek-V4.1 Engram table lookup without fp8e4nv.

Upstream's ``_engram_lookup_kernel`` (``models/deepseek_v41/common/engram.py``) reads the
e4m3 table through a ``float8_e4m3fn`` pointer, so it does not compile below sm_89. This
kernel computes the same thing from the table's bytes:

* each row ``r`` of the lookup is one (token, local hash head): the table row is
  ``ids[token, HEAD_START + r % LOCAL_HEADS] - vocab_start`` (or, in the sorted form,
  ``ids[r]`` with destination ``sorted_dst[r]``); a row outside ``[vocab_start, vocab_end)``
  or past the table's heads reads zeros;
* unpacked: ``out[dst, :] = bf16(e4m3(value) * 2^(scale_byte - 127))``, the scale decoded as
  the fp32 whose bits are ``byte << 23`` (byte 0 gives 0.0, as upstream's shift does);
* packed (``out`` uint8): the DIM value bytes, then one scale byte per QUANT_BLOCK, at
  ``dst // LOCAL_HEADS * OUT_STRIDE + dst % LOCAL_HEADS * (DIM + DIM // QUANT_BLOCK)``.

The e4m3 decode is ``fp8.cvt_e4m3_to_f32`` (integer on sm80/sm86, hardware from sm_89): the
product and its bf16 rounding are the same fp32 operations upstream performs, so the
output is bit-identical (tests/test_engram_lookup.py; on the H200 against upstream's kernel).
The cross-rank peer-pointer form (``PEER_ROWS``) stays upstream's.
"""
from __future__ import annotations

__all__ = ["engram_lookup"]

import torch
import triton
import triton.language as tl

from vllm.deepinfer import arch, compile_gate
from vllm.deepinfer.kernels.checks import check
from vllm.deepinfer.fp8 import cvt_e4m3_to_f32

# Rows per program: upstream's BLOCK_R (16 rows x DIM bytes keeps a 16-byte vector per thread
# at DIM >= 512 with 4 warps).
BLOCK_R = 16
NUM_WARPS = 4


@triton.jit
def _engram_lookup_kernel(weight, scales, ids, sorted_dst, out, vocab_start, vocab_end,
                          num_rows, ids_stride_t, ids_stride_h, GRID,
                          HEAD_START: tl.constexpr, LOCAL_HEADS: tl.constexpr,
                          TOTAL_HEADS: tl.constexpr, DIM: tl.constexpr,
                          QUANT_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                          SORTED: tl.constexpr, PACKED: tl.constexpr, OUT_STRIDE: tl.constexpr,
                          HW_FP8: tl.constexpr):
    cols = tl.arange(0, DIM)
    scale_cols = cols // QUANT_BLOCK
    for base in range(tl.program_id(0) * BLOCK_R, num_rows, GRID * BLOCK_R):
        rows = base + tl.arange(0, BLOCK_R)
        valid = rows < num_rows
        if SORTED:
            local = tl.load(ids + rows, mask=valid, other=-1).to(tl.int64)
            dst = tl.load(sorted_dst + rows, mask=valid, other=0).to(tl.int64)
            owned = valid & (local >= 0) & (local < vocab_end - vocab_start)
        else:
            head = HEAD_START + rows % LOCAL_HEADS
            token = (rows // LOCAL_HEADS).to(tl.int64)
            in_table = valid & (head < TOTAL_HEADS)
            index = tl.load(ids + token * ids_stride_t + head * ids_stride_h, mask=in_table,
                            other=-1).to(tl.int64)
            dst = rows.to(tl.int64)
            owned = in_table & (index >= vocab_start) & (index < vocab_end)
            local = index - vocab_start
        local = tl.where(owned, local, 0)
        code = tl.load(weight + local[:, None] * DIM + cols[None, :], mask=owned[:, None],
                       other=0)
        sbyte = tl.load(scales + local[:, None] * (DIM // QUANT_BLOCK) + scale_cols[None, :],
                        mask=owned[:, None], other=0)
        if PACKED:
            width: tl.constexpr = DIM + DIM // QUANT_BLOCK
            row_off = dst // LOCAL_HEADS * OUT_STRIDE + dst % LOCAL_HEADS * width
            tl.store(out + row_off[:, None] + cols[None, :], code, mask=valid[:, None])
            tl.store(out + row_off[:, None] + DIM + scale_cols[None, :], sbyte,
                     mask=valid[:, None] & (cols[None, :] % QUANT_BLOCK == 0))
        else:
            scale = (sbyte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            value = cvt_e4m3_to_f32(code, HW_FP8) * scale
            tl.store(out + dst[:, None] * DIM + cols[None, :], value.to(tl.bfloat16),
                     mask=valid[:, None])


def engram_lookup(weight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                  sorted_dst: torch.Tensor, out: torch.Tensor, vocab_start: int, vocab_end: int,
                  num_rows: int, *, head_start: int, local_heads: int, total_heads: int,
                  dim: int, quant_block: int, sorted_rows: bool, grid: int,
                  variant: str | None = None) -> None:
    """Upstream's lookup semantics (module docstring); ``weight`` is the e4m3 table
    [rows, dim] (float8_e4m3fn or its uint8 bytes), ``scales`` its UE8M0 bytes
    [rows, dim // quant_block]; ``out`` bf16 [.., dim] or uint8 packed rows."""
    check(weight.dtype in (torch.float8_e4m3fn, torch.uint8), "weight",
          lambda: f"expected float8_e4m3fn or uint8, got {weight.dtype}")
    check(scales.dtype == torch.uint8, "scales",
          lambda: f"expected uint8 UE8M0 bytes, got {scales.dtype}")
    check(out.dtype in (torch.bfloat16, torch.uint8), "out",
          lambda: f"expected bfloat16 or packed uint8, got {out.dtype}")
    check(dim & (dim - 1) == 0 and dim % quant_block == 0, "dim",
          lambda: f"{dim} must be a power of two and a multiple of quant_block {quant_block}")
    check(weight.is_contiguous() and scales.is_contiguous(), "weight/scales",
          "must be contiguous")
    check(ids.dtype in (torch.int32, torch.int64), "ids",
          lambda: f"integer ids expected, got {ids.dtype}")
    hw = arch.resolve(variant).hw_fp8
    if ids.dim() == 2:
        st, sh = ids.stride()
    else:
        st, sh = 0, 0
    _engram_lookup_kernel[(grid,)](
        weight.view(torch.uint8), scales, ids, sorted_dst, out, vocab_start, vocab_end,
        num_rows, st, sh, grid,
        HEAD_START=head_start, LOCAL_HEADS=local_heads, TOTAL_HEADS=total_heads, DIM=dim,
        QUANT_BLOCK=quant_block, BLOCK_R=BLOCK_R, SORTED=bool(sorted_rows),
        PACKED=out.dtype == torch.uint8, OUT_STRIDE=out.stride(0), HW_FP8=hw,
        num_warps=NUM_WARPS)


_SIGNATURE = {
    "weight": "*u8", "scales": "*u8", "ids": "*i64", "sorted_dst": "*i32", "out": "*bf16",
    "vocab_start": "i32", "vocab_end": "i32", "num_rows": "i32", "ids_stride_t": "i32",
    "ids_stride_h": "i32", "GRID": "i32", "HEAD_START": "constexpr", "LOCAL_HEADS": "constexpr",
    "TOTAL_HEADS": "constexpr", "DIM": "constexpr", "QUANT_BLOCK": "constexpr",
    "BLOCK_R": "constexpr", "SORTED": "constexpr", "PACKED": "constexpr",
    "OUT_STRIDE": "constexpr", "HW_FP8": "constexpr",
}


def _register() -> None:
    # Engram tables hold engram_head_dim-wide rows with one UE8M0 byte per 32 values
    # (ParallelEngramEmbedding's default block); the gate builds both output forms at
    # a 512-wide row, the widest the configs use.
    for packed in (False, True):
        for tag, variants, hw in (("sm80", ("sm80",), False), ("sm90", ("sm90",), True)):
            sig = dict(_SIGNATURE, out="*u8" if packed else "*bf16")
            compile_gate.register(compile_gate.GateSpec(
                name=f"engram_lookup.{tag}.{'packed' if packed else 'bf16'}",
                kernel=_engram_lookup_kernel, signature=sig,
                constexprs={"HEAD_START": 0, "LOCAL_HEADS": 8, "TOTAL_HEADS": 8, "DIM": 512,
                            "QUANT_BLOCK": 32, "BLOCK_R": BLOCK_R, "SORTED": False,
                            "PACKED": packed, "OUT_STRIDE": 8 * (512 + 16), "HW_FP8": hw},
                variants=variants, num_warps=NUM_WARPS, num_stages=1, feature="fp8_sw"))


_register()
