"""pack_seq / unpack_seq of the sparse indexer's padded decode layout, with 64-bit offsets.

When a decode batch is not uniform (speculative decoding, a short prefill counted as
decode), upstream's CUDA indexer (model_executor/layers/sparse_attn_indexer.py) packs its
e4m3 decode Q per request into [B, Lmax, heads, 128] with ``pack_seq_triton`` and unpacks
the top-k rows with ``unpack_seq_triton`` (v1/attention/ops/common.py). Patch 0017 runs the
pack on the e4m3 bytes where fp8e4nv cannot compile, through upstream's own kernel, which
forms ``row * D`` in int32 (``in_row * D``, ``(b * Lmax + t) * D``): with D = 64 heads x 128
bytes it passes 2^31 - 1 past 262,144 padded rows, and the unpack of [B, Lmax, top-k] int32
alike past 2^31 / top-k rows. These two functions are written from the layout:

    pack:   out[b, t] = x[start_b + t] for t < len_b, pad for len_b <= t < Lmax,
            start_b = len_0 + ... + len_{b-1}, Lmax = max(len), out [B, Lmax, *x.shape[1:]];
    unpack: out[start_b + t] = packed[b, t] for t < len_b, out [sum(len), *packed.shape[2:]]

(upstream's results, bit for bit: tests/test_int32_hazards.py runs upstream's kernels on the
same inputs). Offsets: the request index and every row index are int64 before they multiply
a stride, and the rows of ``x`` / ``packed`` are addressed through their own strides (a
slice of a wider buffer needs no copy). The starts come from one int64 cumulative sum
instead of upstream's per-program loop over the lengths before it. Grid (requests, row
blocks, column blocks): axis 0 holds the requests (2^31 - 1); axes 1 and 2 hold
Lmax / BLOCK_T and D / BLOCK_D, within CUDA's 65,535 for Lmax up to 4M and D up to 4M
elements. Like upstream, both read the lengths on the host (Lmax and the unpacked row
count: one device sync), and check with the same read that the lengths fit the input.

The pack moves bytes (uint8, or a 1-byte float type viewed as bytes) with an integer pad in
[0, 255] (the fp8 path pads 0, +0.0: padded rows are masked by the context lengths and
dropped by the unpack); the unpack moves any 1-, 2-, 4- or 8-byte dtype.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from vllm.deepinfer.compile_gate import GateSpec, register
from vllm.deepinfer.kernels.checks import check, check_tensor

__all__ = ["pack_seq_bytes", "unpack_seq", "BLOCK_T", "BLOCK_D", "NUM_WARPS",
           "PACK_SIGNATURE", "UNPACK_SIGNATURE"]

# Upstream's tile (64 rows x 64 columns, 4 warps): the same programs per launch.
BLOCK_T = 64
BLOCK_D = 64
NUM_WARPS = 4

# Per-step integers (Lmax, strides of sliced inputs; D only varies with the model but is
# cheap to leave runtime) and the lengths and starts (slices of per-step metadata) are
# unspecialized: one compile per dtype (and pad).
_PACK_INTS = ["D", "lmax", "src_stride0", "dst_stride0", "dst_stride1"]
_UNPACK_INTS = ["D", "src_stride0", "src_stride1", "dst_stride0"]


@triton.jit(do_not_specialize=_PACK_INTS, do_not_specialize_on_alignment=["len_ptr", "start_ptr"])
def _pack_kernel(src_ptr, dst_ptr, len_ptr, start_ptr, D, lmax, src_stride0, dst_stride0,
                 dst_stride1, PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, row block, column block): rows t < Lmax of request b, x[start_b + t]
    where t < len_b, else PAD."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.load(len_ptr + b)
    start = tl.load(start_ptr + b)
    dmask = d < D
    src = src_ptr + (start + t)[:, None] * src_stride0 + d[None, :]
    v = tl.load(src, mask=(t < n)[:, None] & dmask[None, :], other=PAD)
    dst = dst_ptr + b * dst_stride0 + t[:, None] * dst_stride1 + d[None, :]
    tl.store(dst, v, mask=(t < lmax)[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=_UNPACK_INTS,
            do_not_specialize_on_alignment=["len_ptr", "start_ptr"])
def _unpack_kernel(src_ptr, dst_ptr, len_ptr, start_ptr, D, src_stride0, src_stride1,
                   dst_stride0, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, row block, column block): packed[b, t] to out[start_b + t], t < len_b."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.load(len_ptr + b)
    start = tl.load(start_ptr + b)
    mask = (t < n)[:, None] & (d < D)[None, :]
    v = tl.load(src_ptr + b * src_stride0 + t[:, None] * src_stride1 + d[None, :], mask=mask)
    tl.store(dst_ptr + (start + t)[:, None] * dst_stride0 + d[None, :], v, mask=mask)


def _lengths(lengths: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(int32 lengths, int64 exclusive starts, max, sum): max and sum in one host read."""
    check_tensor(lengths, "lengths", dtypes=(torch.int32, torch.int64), ndim=1, device=device)
    check(lengths.numel() >= 1, "lengths", "expected one length per request, got none")
    lens = lengths.to(torch.int32).contiguous()
    ends = torch.cumsum(lengths, 0, dtype=torch.int64)
    lo, lmax, total = torch.stack([lengths.min().to(torch.int64), lengths.max().to(torch.int64),
                                   ends[-1]]).tolist()
    check(lo >= 0, "lengths", lambda: f"a length of {lo} (expected >= 0)")
    return lens, ends - lens, lmax, total


def _rows(t: torch.Tensor, lead: int) -> tuple[torch.Tensor, int]:
    """``t`` as [*t.shape[:lead], D] with a contiguous last dim (a view where its inner dims
    are contiguous, else a copy), and D."""
    D = math.prod(t.shape[lead:])
    v = t.reshape(*t.shape[:lead], D) if D else t.reshape(*t.shape[:lead], 0)
    if D > 1 and v.stride(-1) != 1:
        v = v.contiguous()
    return v, D


def pack_seq_bytes(x: torch.Tensor, lengths: torch.Tensor, pad: int = 0, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Upstream ``pack_seq_triton`` on bytes: [N, ...] uint8 (or a 1-byte float type, moved
    as its bytes and returned in its dtype) -> [B, Lmax, ...], request b's ``lengths[b]`` rows
    then ``pad`` bytes (module doc). ``out``: a caller's [B, Lmax, ...] buffer of x's dtype
    with contiguous rows."""
    check_tensor(x, "x", ndim=None)
    check(x.element_size() == 1 and x.dim() >= 1, "x",
          lambda: f"expected [N, ...] of a 1-byte dtype, got {x.dtype} {tuple(x.shape)}")
    check(isinstance(pad, int) and 0 <= pad <= 255, "pad",
          lambda: f"expected an int byte in [0, 255], got {pad!r}")
    lens, starts, lmax, total = _lengths(lengths, x.device)
    check(total <= x.shape[0], "lengths",
          lambda: f"sum to {total}, more than x's {x.shape[0]} rows")
    src, D = _rows(x.view(torch.uint8), 1)
    shape = (lens.numel(), lmax, *x.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    check_tensor(out, "out", dtypes=(x.dtype,), device=x.device, contiguous=True)
    check(tuple(out.shape) == shape, "out",
          lambda: f"expected {shape}, got {tuple(out.shape)}")
    if lmax and D:
        _pack_kernel[(lens.numel(), triton.cdiv(lmax, BLOCK_T), triton.cdiv(D, BLOCK_D))](
            src, out.view(torch.uint8), lens, starts, D, lmax, src.stride(0), lmax * D, D,
            PAD=pad, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=NUM_WARPS, num_stages=1)
    return out


def unpack_seq(packed: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Upstream ``unpack_seq_triton``: [B, Lmax, ...] -> [sum(lengths), ...], request b's
    first ``lengths[b]`` rows, back to back (module doc). Any 1/2/4/8-byte dtype."""
    check_tensor(packed, "packed")
    check(packed.dim() >= 2 and packed.element_size() in (1, 2, 4, 8), "packed",
          lambda: f"expected [B, Lmax, ...] of a 1/2/4/8-byte dtype, got {packed.dtype} "
          f"{tuple(packed.shape)}")
    lens, starts, lmax, total = _lengths(lengths, packed.device)
    B, L = packed.shape[0], packed.shape[1]
    check(lens.numel() == B and lmax <= L, "lengths",
          lambda: f"{lens.numel()} lengths up to {lmax} for {B} requests of {L} rows")
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    src, D = _rows(packed.view(as_int[packed.element_size()]), 2)
    out = torch.empty((total, *packed.shape[2:]), dtype=packed.dtype, device=packed.device)
    dst = out.view(as_int[packed.element_size()]).view(total, D)
    if total and D:
        _unpack_kernel[(B, triton.cdiv(lmax, BLOCK_T), triton.cdiv(D, BLOCK_D))](
            src, dst, lens, starts, D, src.stride(0), src.stride(1), D,
            BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=NUM_WARPS, num_stages=1)
    return out


# ----------------------------------------------------------------------------- compile gate
PACK_SIGNATURE = {"src_ptr": "*u8", "dst_ptr": "*u8", "len_ptr": "*i32", "start_ptr": "*i64",
                  **{k: "i32" for k in _PACK_INTS}, "PAD": "constexpr",
                  "BLOCK_T": "constexpr", "BLOCK_D": "constexpr"}
UNPACK_SIGNATURE = {"src_ptr": "*i32", "dst_ptr": "*i32", "len_ptr": "*i32",
                    "start_ptr": "*i64", **{k: "i32" for k in _UNPACK_INTS},
                    "BLOCK_T": "constexpr", "BLOCK_D": "constexpr"}

register(GateSpec(name="pack_seq.pack_bytes", kernel=_pack_kernel, signature=PACK_SIGNATURE,
                  constexprs={"PAD": 0, "BLOCK_T": BLOCK_T, "BLOCK_D": BLOCK_D},
                  variants=("sm80",), num_warps=NUM_WARPS, num_stages=1, feature="fp8_sw"))
register(GateSpec(name="pack_seq.unpack", kernel=_unpack_kernel, signature=UNPACK_SIGNATURE,
                  constexprs={"BLOCK_T": BLOCK_T, "BLOCK_D": BLOCK_D}, variants=("sm80",),
                  num_warps=NUM_WARPS, num_stages=1, feature="fp8_sw"))
