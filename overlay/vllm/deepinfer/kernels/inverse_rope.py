"""In-place inverse GPT-J RoPE of attention output rows, with 64-bit row offsets.

The Ampere attention classes (attention/common.py, ``forward_mqa``) rotate back every output
row that no decode epilogue rotated (the prefill rows) before the o_proj. Upstream's kernel
for it (``_inverse_rope_gptj_kernel`` behind ``rocm_inverse_rope_rows_``,
v1/attention/ops/rocm_aiter_mla_sparse.py) forms ``token * stride(0) + head * stride(1)`` in
int32: with stride(0) = heads * 512 that passes 2^31 - 1 from 65,536 rows at 64 heads per rank
(131,072 at 32), and the kernel then reads and writes outside the tensor. This kernel is
written from the rotation itself:

    for each row [token, head] and pair k < rope_dim / 2 of its last rope_dim lanes,
    with (a, b) = (lane NOPE + 2k, lane NOPE + 2k + 1), c = cos_sin[pos, k],
    s = cos_sin[pos, rope_dim / 2 + k] and NOPE = head_dim - rope_dim:
        a' = a * c + b * s
        b' = b * c - a * s

in fp32, stored as bf16 into the same lanes (the inverse of the forward rotation
``a * c - b * s``, ``b * c + a * s``; DeepSeek-V4's cos_sin_cache keeps cos in its first
half, sin in its second). The NoPE lanes are neither read nor written: for a bf16 row the
upstream kernel's pass-through of them is a bf16 -> bf16 copy, so the result is the same
bytes. Both lanes of a pair are read before either is stored, and each program owns its own
rows, so the in-place update is safe.

Offsets: the token index is int64 before it multiplies a stride, the head index is int64
before it multiplies its stride, and the position is int64 before it multiplies the cache's
row stride; no other product grows with the batch. Grid (tokens, head blocks); 2^31 - 1
tokens is the grid's own limit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.deepinfer.compile_gate import GateSpec, register
from vllm.deepinfer.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check, check_tensor
from vllm.deepinfer.kv_record import HEAD_DIM, ROPE_DIM

__all__ = ["inverse_rope_rows_", "BLOCK_H", "NUM_WARPS", "NUM_STAGES", "SIGNATURE",
           "gate_constexprs"]

# Heads per program: 16 heads x 64 RoPE lanes is 1,024 bf16 (2 KiB) read and written per
# program, 8 lanes (one 16-byte vector) per thread over 4 warps; a 64-head token takes four
# programs. Not tuned: the whole pass moves 256 bytes per (token, head) (128 in, 128 out)
# where upstream's moves 2 KiB (all 512 lanes in and out).
BLOCK_H = 16
NUM_WARPS = 4
NUM_STAGES = 1  # no loop to pipeline
_BF16 = (torch.bfloat16,)


# num_heads varies with tensor parallelism (64 / TP heads per rank) and the positions come
# as ``positions[rotated:]``, whose 16-byte alignment follows the decode token count: both
# unspecialized, so one compile (vllm.deepinfer.warmup's key) serves every batch; the strides
# (multiples of 512 and 64 elements) stay specialized, the same for every batch.
@triton.jit(do_not_specialize=["num_heads"], do_not_specialize_on_alignment=["pos_ptr"])
def _inverse_rope_rows_kernel(o_ptr, pos_ptr, cs_ptr, o_stride0, o_stride1, cs_stride,
                              num_heads, NOPE: tl.constexpr, HALF: tl.constexpr,
                              BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (token, head block): rotate lanes NOPE .. NOPE + 2 * HALF of BLOCK_H rows."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    k = tl.arange(0, BLOCK_HALF)
    kmask = k < HALF
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cs_row = cs_ptr + pos * cs_stride
    c = tl.load(cs_row + k, mask=kmask, other=1.0).to(tl.float32)
    s = tl.load(cs_row + HALF + k, mask=kmask, other=0.0).to(tl.float32)
    # [BLOCK_H, BLOCK_HALF, 2]: pair k of a row is its lanes NOPE + 2k and NOPE + 2k + 1.
    lane = 2 * k[:, None] + tl.arange(0, 2)[None, :]
    rows = o_ptr + tok * o_stride0 + heads.to(tl.int64) * o_stride1 + NOPE
    ptrs = rows[:, None, None] + lane[None, :, :]
    mask = hmask[:, None, None] & kmask[None, :, None]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    a, b = tl.split(x)
    a_out = a * c[None, :] + b * s[None, :]
    b_out = b * c[None, :] - a * s[None, :]
    tl.store(ptrs, tl.join(a_out, b_out).to(tl.bfloat16), mask=mask)


def inverse_rope_rows_(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       rope_head_dim: int) -> None:
    """Inverse GPT-J RoPE of the last ``rope_head_dim`` lanes of every row of ``o``, in place.

    ``o`` bf16 [tokens, heads, head_dim] with a contiguous last dim (any row strides: a view
    of the attention output); ``positions`` [>= tokens] int32/int64, token t's position at
    ``positions[t]``; ``cos_sin_cache`` [max_pos, rope_head_dim] float, cos | sin, unit inner
    stride. Arguments as upstream's ``rocm_inverse_rope_rows_``; the result is the bytes its
    bf16 path writes (module docstring), with int64 offsets.
    """
    check_tensor(o, "o", dtypes=_BF16, ndim=3)
    tokens, heads, head_dim = o.shape
    check(o.stride(2) == 1, "o", lambda: f"needs a contiguous last dim, got shape "
          f"{tuple(o.shape)} strides {o.stride()}")
    check(isinstance(rope_head_dim, int) and rope_head_dim > 0 and rope_head_dim % 2 == 0
          and rope_head_dim <= head_dim, "rope_head_dim",
          lambda: f"{rope_head_dim!r}: expected an even int in (0, {head_dim}] (the row's "
          "head_dim)")
    dev = o.device
    check_tensor(positions, "positions", dtypes=INDEX_DTYPES, ndim=1, device=dev)
    check(positions.numel() >= tokens, "positions",
          lambda: f"{positions.numel()} positions for {tokens} rows")
    check_tensor(cos_sin_cache, "cos_sin_cache", dtypes=FLOAT_DTYPES, ndim=2, device=dev)
    check(cos_sin_cache.shape[1] == rope_head_dim and cos_sin_cache.stride(1) == 1,
          "cos_sin_cache", lambda: f"expected [max_pos, {rope_head_dim}] = cos | sin with a "
          f"unit inner stride, got shape {tuple(cos_sin_cache.shape)} strides "
          f"{cos_sin_cache.stride()}")
    if tokens == 0 or heads == 0:
        return
    if positions.stride(0) != 1:
        positions = positions.contiguous()
    half = rope_head_dim // 2
    _inverse_rope_rows_kernel[(tokens, triton.cdiv(heads, BLOCK_H))](
        o, positions, cos_sin_cache, o.stride(0), o.stride(1), cos_sin_cache.stride(0), heads,
        NOPE=head_dim - rope_head_dim, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=BLOCK_H, num_warps=NUM_WARPS, num_stages=NUM_STAGES)


# ----------------------------------------------------------------------------- compile gate
SIGNATURE = {"o_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "o_stride0": "i32",
             "o_stride1": "i32", "cs_stride": "i32", "num_heads": "i32", "NOPE": "constexpr",
             "HALF": "constexpr", "BLOCK_HALF": "constexpr", "BLOCK_H": "constexpr"}


def gate_constexprs() -> dict:
    """The production launch: 512-dim rows, the last 64 lanes rotated."""
    return {"NOPE": HEAD_DIM - ROPE_DIM, "HALF": ROPE_DIM // 2, "BLOCK_HALF": ROPE_DIM // 2,
            "BLOCK_H": BLOCK_H}


register(GateSpec(name="inverse_rope_rows", kernel=_inverse_rope_rows_kernel,
                  signature=SIGNATURE, constexprs=gate_constexprs(), variants=("sm80", "sm90"),
                  num_warps=NUM_WARPS, num_stages=NUM_STAGES, feature="ampere_attn"))
