"""Dense -> ragged index lists for the Ampere decode, with 64-bit offsets.

The Ampere decode (attention/common.py, ``_ampere_decode``) reads each token's SWA-window
slots and, in compressed layers, its global top-k slots as ragged lists: one flat int32 list
of the valid slots of every token, back to back, and an int32 ``indptr``. Upstream builds
them with ``build_ragged_indices_from_dense`` (v1/attention/ops/rocm_aiter_mla_sparse.py),
whose two kernels form ``row * stride(0)`` in int32 and whose ``indptr`` is int32: at
262,144 decode tokens x 8,192 columns a full batch's count is 2^31, past the indptr, and from
the next row on the row offsets pass 2^31 - 1 (sooner for a row slice of a wider buffer); the
lists come out wrong without an error. This module is our conversion, written from its
contract:

    indices [R, W] (trailing dims flattened, as upstream's ``reshape(R, -1)``), lengths [R]
    (any int dtype, on any device; moved to the indices' device as int32), num_rows:
    entry (r, c) is kept when c < lengths[r] (and c < W), its value v >= 0, and, when
    num_rows >= 0, v < num_rows. The kept values of row r, in column order, are
    flat[indptr[r] : indptr[r + 1]]; indptr[0] = 0, indptr[r + 1] - indptr[r] is row r's
    count. flat is int32 [R * W] (R * W, not the kept count: the decode sizes its two-phase
    rows and picks its split from flat.numel(), with no device sync), written only in its
    first indptr[R] entries; indptr is int32 [R + 1]. An empty ``indices`` gives flat [0] and
    indptr zeros.

The written prefix of ``flat`` and all of ``indptr`` are upstream's bits at every size where
upstream's int32 products fit (tests/test_ragged_indices.py runs upstream's kernels as its
host code does). What differs:

* offsets: the row index is int64 before it multiplies ``stride(0)`` (any row stride: a view
  of a wider buffer), and the output offset ``indptr[r] + rank`` is int64;
* int64 values: upstream casts them to int32 before filtering, so 2^32 + 5 becomes slot 5;
  here a value is compared in its own dtype and values above 2^31 - 1 are dropped (only
  reachable with int64 indices: the decode's lists are int32 slots);
* a non-unit column stride is made contiguous first (upstream's kernels assume unit
  columns);
* the host check: R * W, the most entries the rows can keep, must be at most 2^31 - 1, the
  largest count the decode's int32 ``indptr`` (and its int32 list offsets) can address. Past
  it ``build_ragged_indices_from_dense`` raises ``ValueError`` naming the tensor (the
  ``name`` argument), before any launch: the lists could not be addressed by the decode
  even when built. The flat list alone is then 8 GiB and the two-phase decode's bf16 rows
  2 TiB, so no served configuration is refused that could have run.

Kernels: a counting pass (one program per row, ``BLOCK_W`` columns per step up to the row's
length), ``torch.cumsum`` of the counts into ``indptr[1:]``, a compaction pass (one program
per row: each step's kept entries ranked by a cumulative sum, stored at indptr[r] + the
entries already written). Rows are grid axis 0 (up to 2^31 - 1 programs). All runtime
integers and the pointers' alignment are unspecialized, so one compile of each kernel
(vllm.deepinfer.warmup, feature ``ampere_attn``) serves every batch.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from vllm.deepinfer.compile_gate import GateSpec, register
from vllm.deepinfer.kernels.checks import check, check_tensor

__all__ = ["build_ragged_indices_from_dense", "INT32_MAX", "BLOCK_W", "NUM_WARPS", "NUM_STAGES",
           "COUNT_SIGNATURE", "COMPACT_SIGNATURE", "gate_constexprs"]

# Largest count (and list offset) the decode's int32 indptr can hold.
INT32_MAX = 2 ** 31 - 1
# Columns per step: 1024 int32 is 8 per thread over 4 warps (two 16-byte loads). The rows
# served are 128-column multiples up to 8,320 (V4's C128A top-k at 1M plus the window):
# 1 to 9 steps per row, upstream's step count for the same rows (its block is
# min(next_pow2(W), 1024)). One value for every width: one compile per kernel.
BLOCK_W = 1024
NUM_WARPS = 4
NUM_STAGES = 1  # one load per step, nothing to overlap it with


# Every integer varies with the batch or the layer (row count, width, row stride, the KV
# row bound), and the indices and lengths come as slices of per-step metadata: none is
# specialized, so the warmup's one compile per kernel covers every launch.
_UNSPECIALIZED = ["stride0", "width", "num_rows_limit"]
_UNALIGNED = ["idx_ptr", "len_ptr"]


@triton.jit
def _keep(vals, cols, row_len, num_rows_limit):
    """The entries a row keeps (see the module doc), compared in the values' own dtype."""
    keep = (cols < row_len) & (vals >= 0) & (vals <= 2147483647)
    return keep & ((num_rows_limit < 0) | (vals < num_rows_limit))


@triton.jit(do_not_specialize=_UNSPECIALIZED, do_not_specialize_on_alignment=_UNALIGNED)
def _count_kernel(idx_ptr, len_ptr, count_ptr, indptr_ptr, stride0, width, num_rows_limit,
                  BLOCK_W: tl.constexpr):
    """Program r: the number of entries row r keeps, into count[r]; program 0 also writes
    indptr[0] = 0 (the cumulative sum fills indptr[1:])."""
    row = tl.program_id(0).to(tl.int64)
    if row == 0:
        tl.store(indptr_ptr, 0)
    row_len = tl.minimum(tl.load(len_ptr + row), width)
    base = idx_ptr + row * stride0
    c = tl.arange(0, BLOCK_W)
    acc = tl.zeros((BLOCK_W,), tl.int32)
    for c0 in range(0, row_len, BLOCK_W):
        cols = c0 + c
        vals = tl.load(base + cols, mask=cols < row_len, other=-1)
        acc += _keep(vals, cols, row_len, num_rows_limit).to(tl.int32)
    tl.store(count_ptr + row, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=_UNSPECIALIZED, do_not_specialize_on_alignment=_UNALIGNED)
def _compact_kernel(idx_ptr, len_ptr, indptr_ptr, out_ptr, stride0, width, num_rows_limit,
                    BLOCK_W: tl.constexpr):
    """Program r: row r's kept values, in column order, to out[indptr[r] ...]."""
    row = tl.program_id(0).to(tl.int64)
    row_len = tl.minimum(tl.load(len_ptr + row), width)
    base = idx_ptr + row * stride0
    # The next output slot: indptr[r] plus the entries already written, in int64.
    dst = tl.load(indptr_ptr + row).to(tl.int64)
    c = tl.arange(0, BLOCK_W)
    for c0 in range(0, row_len, BLOCK_W):
        cols = c0 + c
        vals = tl.load(base + cols, mask=cols < row_len, other=-1)
        keep = _keep(vals, cols, row_len, num_rows_limit)
        k = keep.to(tl.int32)
        rank = tl.cumsum(k, axis=0) - 1
        tl.store(out_ptr + dst + rank, vals.to(tl.int32), mask=keep)
        dst += tl.sum(k, axis=0)


def build_ragged_indices_from_dense(indices: torch.Tensor, lengths: torch.Tensor,
                                    num_rows: int = -1, *, name: str = "indices"
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat int32 [R * W], indptr int32 [R + 1]) of ``indices`` [R, ...] int32/int64 and
    ``lengths`` [R]: the arguments and results of upstream's function of this name (module
    doc), with int64 offsets. ``name`` names ``indices`` in errors (the caller's tensor:
    ``decode_swa_indices``, the global top-k). Raises ``ValueError`` when R * W passes
    INT32_MAX (what the decode's int32 lists can address)."""
    check_tensor(indices, name, dtypes=(torch.int32, torch.int64))
    check(indices.dim() >= 1, name, "expected [rows, ...], got a 0-dim tensor")
    rows, width = indices.shape[0], math.prod(indices.shape[1:])
    check_tensor(lengths, f"{name} lengths")
    check(lengths.numel() == rows, f"{name} lengths",
          lambda: f"expected one length per row ({rows}), got shape {tuple(lengths.shape)}")
    check(isinstance(num_rows, int), "num_rows", lambda: f"expected an int, got {num_rows!r}")
    check(rows * width <= INT32_MAX, name,
          lambda: f"{rows} rows x {width} columns = {rows * width} entries, more than the "
          f"{INT32_MAX} (2^31 - 1) the decode's int32 ragged lists (indptr and list offsets) "
          "can address; lower max_num_seqs or the speculative tokens per step")
    dev = indices.device
    indptr = torch.empty(rows + 1, dtype=torch.int32, device=dev)
    if rows == 0 or width == 0:
        indptr.zero_()
        return torch.empty(0, dtype=torch.int32, device=dev), indptr
    if lengths.dtype != torch.int32:
        # Lengths past the width keep the whole row: clamp before narrowing (an int64 length
        # of 2^32 would otherwise become 0).
        lengths = lengths.clamp(max=width)
    lengths = lengths.to(device=dev, dtype=torch.int32).reshape(-1).contiguous()
    indices = indices.reshape(rows, width)
    if width > 1 and indices.stride(1) != 1:
        indices = indices.contiguous()
    counts = torch.empty(rows, dtype=torch.int32, device=dev)
    flat = torch.empty(rows * width, dtype=torch.int32, device=dev)
    limit = int(num_rows)
    _count_kernel[(rows,)](indices, lengths, counts, indptr, indices.stride(0), width, limit,
                           BLOCK_W=BLOCK_W, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    torch.cumsum(counts, dim=0, out=indptr[1:])
    _compact_kernel[(rows,)](indices, lengths, indptr, flat, indices.stride(0), width, limit,
                             BLOCK_W=BLOCK_W, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return flat, indptr


# ----------------------------------------------------------------------------- compile gate
COUNT_SIGNATURE = {"idx_ptr": "*i32", "len_ptr": "*i32", "count_ptr": "*i32",
                   "indptr_ptr": "*i32", "stride0": "i32",
                   "width": "i32", "num_rows_limit": "i32", "BLOCK_W": "constexpr"}
COMPACT_SIGNATURE = {"idx_ptr": "*i32", "len_ptr": "*i32", "indptr_ptr": "*i32",
                     "out_ptr": "*i32", "stride0": "i32", "width": "i32",
                     "num_rows_limit": "i32", "BLOCK_W": "constexpr"}


def gate_constexprs() -> dict:
    return {"BLOCK_W": BLOCK_W}


for _name, _kernel, _sig in (("ragged_indices.count", _count_kernel, COUNT_SIGNATURE),
                             ("ragged_indices.compact", _compact_kernel, COMPACT_SIGNATURE)):
    register(GateSpec(name=_name, kernel=_kernel, signature=_sig, constexprs=gate_constexprs(),
                      variants=("sm80", "sm90"), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
                      feature="ampere_attn"))
