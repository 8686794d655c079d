"""Sparse-indexer MQA logits without DeepGEMM: the scores the V4.1/V4 indexer ranks for top-k.

Upstream's CUDA indexer (``model_executor/layers/sparse_attn_indexer.py``) gets its logits
from DeepGEMM (``vllm.utils.deep_gemm.fp8_fp4_mqa_logits`` for prefill over gathered keys,
``fp8_fp4_paged_mqa_logits`` for decode over the paged index-K cache). DeepGEMM is built for
SM90/SM100 only, so on SM80/SM86 (and SM89) there is no indexer at all. These two functions
take the same arguments and return the same values (FP8 path, fp32 scales, no MX scales):

    logits[r, j] = k_scale[key] * sum_h weights[r, h] * relu(q[r, h, :] . k[key, :])

(``relu`` commutes with the positive scale, as DeepGEMM's reference in
``rocm_aiter_mla_sparse.fp8_mqa_logits_torch`` writes it with the scale inside).

* ``mqa_logits``: keys ``k`` [N, D] e4m3 + ``k_scale`` [N] fp32; row ``i`` sees keys
  ``[ks[i], ke[i])`` and stores key ``ks[i] + j`` at column ``j`` ("compressed" logits,
  [M, max_seqlen_k]).
* ``paged_mqa_logits``: the index-K cache [num_blocks, block_size, D + 4] uint8 (a page is
  block_size * D code bytes, then block_size fp32 scales; pages through ``stride(0)``), a
  block table, per-request context lengths ([B] — row ``j`` of the request's ``next_n`` rows
  sees ``len - next_n + j + 1`` keys — or per row, [B, next_n]); [B * next_n, max_model_len].
Columns past a row's length are not written (DeepGEMM does not clean them either; the top-k
kernels read only each row's valid prefix).

Kernel (one per variant, ``HW_FP8`` constexpr): grid (programs per row, rows). A program
keeps its row's query [H, D] in registers and walks BLOCK_N-key tiles ``pid, pid + P, ...``
of the row's keys: one [BLOCK_N, D] x [D, H] fp16 tensor-core dot per tile with fp32
accumulation (keys on the M side, so the weighted head sum stays inside a warp), relu, the
weighted sum over heads, times the keys' scales. e4m3 -> fp16 is exact: by the hardware
conversion on sm_89+; below it in software, as the value * 2^-8 (see ``_to_fp16``), the two
2^-8 factors coming back as one exact * 2^16. Every product is exact; only the fp32
summation order differs from DeepGEMM's, so results agree to fp32 rounding
(tests/test_indexer_logits.py). The gathered (prefill) form runs two consecutive rows per
program (``FLAT_ROWS_PER_PROGRAM``): each key tile is loaded and decoded once and scored for
both rows (their query ranges' union), with each row's bits those of the one-row form.

e4m3 NaN codes (0x7F/0xFF) decode as NaN in the hardware variant and as +-480 in the
software one; the indexer writers saturate at +-448 and never emit them.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from vllm.deepinfer import arch, compile_gate
from vllm.deepinfer.kernels import shapes
from vllm.deepinfer.kernels.checks import check
from vllm.deepinfer.kv_record import INDEX_HEAD_DIM as HEAD_DIM  # 128-dim index keys/queries
from vllm.deepinfer.kv_record import INDEX_SCALE_BYTES as SCALE_BYTES  # one fp32 per key

__all__ = ["mqa_logits", "paged_mqa_logits", "compile_constexprs", "LogitsTile", "TILES",
           "HEAD_DIM", "FLAT_ROWS_PER_PROGRAM", "GRID_ROWS", "row_chunks", "chunk_args"]


@dataclasses.dataclass(frozen=True)
class LogitsTile:
    block_n: int           # keys per tile (dot N)
    num_warps: int
    num_stages: int
    programs_per_sm: int   # grid cap per row group: rows * programs ~ programs_per_sm * SMs
    # Software decode (no hardware e4m3): Triton's fp8e4b15 conversion instead of the
    # integer shift. Both exact on a GPU; the interpreter gets e4b15 subnormals wrong.
    e4b15: bool = False
    # Gathered (prefill) form: query rows per program, 1 or 2 (FLAT_ROWS_PER_PROGRAM).
    flat_rows: int = 1


# Measured on the H200, GPU time from CUDA graphs, sm80 variant (software decode):
# * tile (benchmarks/results/archive/h200-2026-11-29-one-layer-1687c8b.json, suite indexer_logits):
#   64 keys x 4 warps was fastest of [32, 64, 128] keys x [4, 8] warps — prefill 2048 rows x
#   8192 keys 846 us (64 x 8: 1549; 128 x 8: 923; 32 x 8: 2495), and at the 64-row decode
#   1.5-3x faster than the others. Triton's fp8e4b15 conversion was within 1% of the integer
#   shift, so the shift, exact under the interpreter too, stays.
# * launch (h200-2026-11-29-indexer-logits-sweep-ec29fd8.jsonl): 1 stage and 16 programs
#   per SM — decode 64 x 8192 53.4 us, prefill 815 us; the former 2 stages x 8 programs gave
#   63.1 / 843 us, 3-4 stages 63-72 us, 4 programs per SM 66-70 us.
# sm_80 compile gate: 125-165 registers per thread, 24 KiB shared memory.
# * prefill rows per program (h200-2026-12-01-indexer-logits-rows-2be8c41.jsonl; 128 rows x
#   1M keys, causal): two consecutive rows share each key tile (one load, one e4m3 decode,
#   two dots) -- sm80 8069 -> 5018 us (273 -> 438 TFLOP/s, 63% of the run's 692 TFLOP/s bf16
#   matmul), sm90 5925 -> 4039 us (371 -> 544, 79%); at 128 rows x 128K keys 937 -> 626 and
#   668 -> 502 us; every row's logits bit-equal to the one-row kernel's (and so to the
#   candidate kernel's, kernels/indexer_candidate_logits.py). An earlier two-row trial at 8
#   warps was slower and gave other bits. The one-row grid over tiles and stages
#   (h200-2026-12-01-indexer-logits-long-sweep-c8b2c82.jsonl: 64 or 128 keys, 4 or 8 warps,
#   1-3 stages, 16 per SM) found nothing better for decode (64 x 4, 1 stage: 16 x 1M keys in
#   1321 us sm80 / 1044 us sm90) and at most 1.13x for prefill (3 stages), below the pair's.
FLAT_ROWS_PER_PROGRAM = 2
_TILE = LogitsTile(block_n=64, num_warps=4, num_stages=1, programs_per_sm=16,
                   flat_rows=FLAT_ROWS_PER_PROGRAM)
TILES: dict[str, LogitsTile] = {v: _TILE for v in ("cpu", "sm80", "sm86", "sm89", "sm90", "sm100")}


@triton.jit
def _to_fp16(x, HW_FP8: tl.constexpr, E4B15: tl.constexpr):
    """uint8 e4m3 codes -> fp16 for the dot. With ``HW_FP8`` the hardware conversion (exact
    value); below sm_89 the value * 2^-8: the 7 exponent+mantissa bits shifted into an fp16
    (bias 15 against 7; subnormals land on fp16 subnormals) by integer ops, or by Triton's
    fp8e4b15 -> fp16 conversion of the same bits (``E4B15``). An fp8 dot is not used on
    sm_89+: Triton's Hopper fp8 dot accumulates with reduced precision by default (outside
    the fp32 summation bound on every H200 row of h200-2026-11-29-indexer-logits-fp8dot-
    e86a1d9.json), the fp16 dot accumulates in fp32."""
    if HW_FP8:
        return x.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif E4B15:
        return x.to(tl.float8e4b15, bitcast=True).to(tl.float16)
    else:
        xi = x.to(tl.int16)
        return (((xi & 0x7F) << 7) | ((xi & 0x80) << 8)).to(tl.float16, bitcast=True)


@triton.jit
def _row_query(q_ptr, w_ptr, row64, H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
               HW_FP8: tl.constexpr, E4B15: tl.constexpr):
    """A row's query [H_PAD, D] as fp16 (padded heads zero) and its weights [H_PAD] (times
    2^16 in the software decode, see ``_to_fp16``)."""
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D)
    hmask = h < H
    q = tl.load(q_ptr + row64 * (H * D) + h[:, None] * D + d[None, :],
                mask=hmask[:, None], other=0)
    q = _to_fp16(q, HW_FP8, E4B15)
    w = tl.load(w_ptr + row64 * H + h, mask=hmask, other=0.0)
    if not HW_FP8:
        w = w * 65536.0  # both dot operands carry 2^-8 (see _to_fp16); exact
    return q, w


@triton.jit
def _key_tile(key, valid, k_ptr, kscale_ptr, bt_row, page_stride, block_size,
              D: tl.constexpr, PAGED: tl.constexpr, HW_FP8: tl.constexpr, E4B15: tl.constexpr):
    """The keys ``key`` (request-local positions when ``PAGED``, rows of ``k`` otherwise):
    fp16 [BLOCK_N, D] (see ``_to_fp16``) and fp32 scales [BLOCK_N]."""
    d = tl.arange(0, D)
    if PAGED:
        page = tl.load(bt_row + key // block_size, mask=valid, other=0).to(tl.int64)
        off = key % block_size
        base = k_ptr + page * page_stride
        codes = tl.load(base[:, None] + off[:, None] * D + d[None, :],
                        mask=valid[:, None], other=0)
        scale = tl.load((base + block_size * D + off * 4).to(tl.pointer_type(tl.float32)),
                        mask=valid, other=0.0)
    else:
        key64 = key.to(tl.int64)
        codes = tl.load(k_ptr + key64[:, None] * D + d[None, :], mask=valid[:, None],
                        other=0)
        scale = tl.load(kscale_ptr + key64, mask=valid, other=0.0)
    return _to_fp16(codes, HW_FP8, E4B15), scale


@triton.jit
def _tile_logits(k, scale, q, w):
    """Logits [BLOCK_N] fp32 of a key tile against one row's ``q``/``w``."""
    # Keys on the dot's M side, heads on N: the head sum stays inside a warp.
    s = tl.dot(k, tl.trans(q))  # [BLOCK_N, H_PAD] fp32
    return tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1) * scale


@triton.jit
def _key_logits(q, w, key, valid, k_ptr, kscale_ptr, bt_row, page_stride, block_size,
                D: tl.constexpr, PAGED: tl.constexpr, HW_FP8: tl.constexpr,
                E4B15: tl.constexpr):
    """Logits [BLOCK_N] fp32 of the keys ``key`` against one row's ``q``/``w``. Shared by
    the kernel below and the candidate-block kernel (kernels/indexer_candidate_logits.py):
    the same code at the same tile gives every (row, key) the same bits in both, and so does
    the two-row form (``ROWS``), which runs ``_tile_logits`` twice on one ``_key_tile``."""
    k, scale = _key_tile(key, valid, k_ptr, kscale_ptr, bt_row, page_stride, block_size, D,
                         PAGED, HW_FP8, E4B15)
    return _tile_logits(k, scale, q, w)


@triton.jit
def _row_length(row, start_ptr, end_ptr, next_n, PAGED: tl.constexpr,
                CTX_PER_ROW: tl.constexpr):
    """(request, first key, keys seen) of a logits row (see the module doc)."""
    if PAGED:
        req = row // next_n
        if CTX_PER_ROW:
            length = tl.load(end_ptr + row)
        else:
            length = tl.load(end_ptr + req) - next_n + 1 + row % next_n
        start = 0
    else:
        req = 0
        start = tl.load(start_ptr + row)
        length = tl.load(end_ptr + row) - start
    return req, start, length


@triton.jit
def _pair_logits(out_ptr, out_stride, q_ptr, w_ptr, start_ptr, end_ptr, k_ptr, kscale_ptr,
                 n_rows, H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, HW_FP8: tl.constexpr, E4B15: tl.constexpr):
    """Gathered form, program group g = rows 2g and 2g + 1 (the second absent past the
    last row): tiles of the union of their key ranges, each loaded and decoded once and
    scored for both rows; each row stores the keys of its own range."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r0 = tl.program_id(1) * 2
    has1 = r0 + 1 < n_rows
    r1 = tl.minimum(r0 + 1, n_rows - 1)
    s0 = tl.load(start_ptr + r0)
    e0 = tl.load(end_ptr + r0)
    s1 = tl.load(start_ptr + r1)
    e1 = tl.load(end_ptr + r1)
    lo = tl.minimum(s0, s1)
    hi = tl.maximum(e0, e1)
    ntiles = tl.cdiv(hi - lo, BLOCK_N)
    if pid < ntiles:
        q0, w0 = _row_query(q_ptr, w_ptr, r0.to(tl.int64), H, H_PAD, D, HW_FP8, E4B15)
        q1, w1 = _row_query(q_ptr, w_ptr, r1.to(tl.int64), H, H_PAD, D, HW_FP8, E4B15)
        n = tl.arange(0, BLOCK_N)
        out0 = out_ptr + r0.to(tl.int64) * out_stride
        out1 = out_ptr + r1.to(tl.int64) * out_stride
        for t in range(pid, ntiles, nprog):
            key = lo + t * BLOCK_N + n
            k, scale = _key_tile(key, key < hi, k_ptr, kscale_ptr, k_ptr, 0, 1, D, False,
                                 HW_FP8, E4B15)
            tl.store(out0 + key - s0, _tile_logits(k, scale, q0, w0),
                     mask=(key >= s0) & (key < e0))
            tl.store(out1 + key - s1, _tile_logits(k, scale, q1, w1),
                     mask=(key >= s1) & (key < e1) & has1)


# Runtime integers that vary per call are not specialized (no ==1 / %16 variants), so one
# compile per constexpr set covers every call and the JIT warmup (vllm.deepinfer.warmup) can
# build them all. ``page_stride`` stays specialized: pages are 16-byte multiples (128 x 132
# bytes and vLLM's aligned pages), and without that alignment fact the key loads lose their
# 16-byte vectors (the decode rows of the H200 suite went from 62 to 83 us when it was
# unspecialized at 80aad4c; archive/h200-2026-11-29-one-layer-1687c8b.json has the slow rows).
# The row bounds and the block table come as slices of per-step metadata (a TP rank's row
# window, the decode rows of a mixed batch) whose 16-byte alignment varies: not specialized
# on it, so vLLM's warmup covers every launch (tests/test_warmup_coverage.py); they are read
# a word per row / per key tile.
@triton.jit(do_not_specialize=["out_stride", "bt_stride", "block_size", "next_n", "n_rows"],
            do_not_specialize_on_alignment=["start_ptr", "end_ptr", "bt_ptr"])
def _logits_kernel(out_ptr, out_stride, q_ptr, w_ptr, start_ptr, end_ptr, k_ptr, kscale_ptr,
                   bt_ptr, bt_stride, page_stride, block_size, next_n, n_rows,
                   H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGED: tl.constexpr, CTX_PER_ROW: tl.constexpr,
                   HW_FP8: tl.constexpr, E4B15: tl.constexpr, ROWS: tl.constexpr):
    if ROWS == 2:  # gathered form only: rows 2g and 2g + 1 share every key tile
        _pair_logits(out_ptr, out_stride, q_ptr, w_ptr, start_ptr, end_ptr, k_ptr,
                     kscale_ptr, n_rows, H, H_PAD, D, BLOCK_N, HW_FP8, E4B15)
        return
    row = tl.program_id(1)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    req, start, length = _row_length(row, start_ptr, end_ptr, next_n, PAGED, CTX_PER_ROW)
    ntiles = tl.cdiv(length, BLOCK_N)
    if pid < ntiles:
        row64 = row.to(tl.int64)
        q, w = _row_query(q_ptr, w_ptr, row64, H, H_PAD, D, HW_FP8, E4B15)
        n = tl.arange(0, BLOCK_N)
        out_row = out_ptr + row64 * out_stride
        bt_row = bt_ptr + req.to(tl.int64) * bt_stride
        for t in range(pid, ntiles, nprog):
            col = t * BLOCK_N + n
            valid = col < length
            logit = _key_logits(q, w, start + col, valid, k_ptr, kscale_ptr, bt_row,
                                page_stride, block_size, D, PAGED, HW_FP8, E4B15)
            tl.store(out_row + col, logit, mask=valid)


# --------------------------------------------------------------------------- launchers
_INDEX = (torch.int32,)
# Programs per launch on grid axis y, where the rows are (one per program in the paged form,
# FLAT_ROWS_PER_PROGRAM in the gathered one; the candidate kernels' rows too). CUDA allows at
# most 65,535 there; a prefill chunk has up to max_num_batched_tokens rows (1,048,576), a
# decode B x next_n. Launches of more run in row chunks (``row_chunks``), each with the
# programs per row of the whole launch: the same bits. 65,520 = 4,095 x 16, the largest
# multiple of 16 within the limit, so chunks start 16 rows apart and every per-row tensor's
# chunk keeps the whole tensor's 16-byte alignment (the kernels compiled for the unchunked
# launch serve them).
GRID_ROWS = 65520


def row_chunks(rows: int, rows_per_y: int, unit: int) -> list[tuple[int, int]]:
    """[r0, r1) chunks of ``rows`` rows, each at most GRID_ROWS programs on y (``rows_per_y``
    rows per program) and a multiple of ``unit`` rows (a request's next_n rows, a program's
    row pair) — of 16 units where the bound allows; a single chunk when the launch fits."""
    if triton.cdiv(rows, rows_per_y) <= GRID_ROWS:
        return [(0, rows)]
    most = GRID_ROWS * rows_per_y
    step = most // (16 * unit) * 16 * unit or most // unit * unit
    check(step > 0, "next_n", lambda: f"{unit} rows per request do not fit one launch's "
          f"{GRID_ROWS} programs on grid axis y")
    return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


def chunk_args(args: tuple, r0: int, r1: int, paged: bool, next_n: int) -> tuple:
    """The launch arguments (q, w, start, end, k, k_scale, block table, bt_stride,
    page_stride, block_size, next_n) of rows [r0, r1): per-row tensors sliced to the chunk,
    per-request ones (paged: context lengths, block table, q's batch dim) to its requests;
    keys and caches whole."""
    q, w, start, end, k, kscale, bt, *rest = args
    if paged:
        b0, b1 = r0 // next_n, r1 // next_n
        return (q[b0:b1], w[r0:r1], start[b0:b1], end[b0:b1], k, kscale, bt[b0:b1], *rest)
    return (q[r0:r1], w[r0:r1], start[r0:r1], end[r0:r1], k, kscale, bt[r0:r1], *rest)


def _as_codes(t: torch.Tensor, name: str) -> torch.Tensor:
    check(t.dtype in (torch.float8_e4m3fn, torch.uint8), name,
          lambda: f"expected float8_e4m3fn (or its uint8 bytes), got {t.dtype}")
    check(t.is_contiguous(), name, "must be contiguous")
    return t.view(torch.uint8)


def _programs(tile: LogitsTile, rows: int, max_len: int, device: torch.device,
              sm_count: int | None) -> int:
    sms = sm_count if sm_count is not None else arch.sm_count(device)  # 1 on CPU
    return max(1, min(triton.cdiv(max_len, tile.block_n),
                      triton.cdiv(tile.programs_per_sm * sms, max(rows, 1))))


def _check_q_w(q: torch.Tensor, weights: torch.Tensor, rows: int) -> tuple[int, int]:
    heads, dim = q.shape[-2], q.shape[-1]
    check(dim == HEAD_DIM, "q", lambda: f"head dim {dim}, expected {HEAD_DIM}")
    check(1 <= heads <= 128, "q", lambda: f"{heads} heads, expected 1..128")
    check(weights.dtype == torch.float32 and weights.dim() == 2
          and tuple(weights.shape) == (rows, heads) and weights.is_contiguous(), "weights",
          lambda: f"expected contiguous fp32 [{rows}, {heads}], got {weights.dtype} "
          f"{tuple(weights.shape)}")
    return heads, dim


def mqa_logits(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
               cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor, max_seqlen_k: int, *,
               variant: str | None = None, sm_count: int | None = None,
               tile: LogitsTile | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """DeepGEMM ``fp8_mqa_logits`` (FP8 path): fp32 [M, max_seqlen_k], row ``i`` holding keys
    ``[ks[i], ke[i])`` from column 0 (see module doc). ``max_seqlen_k`` must bound
    ``ke - ks``; it sizes the output and the grid. ``tile`` overrides the variant's tile.
    ``out``: a caller's fp32 [M, max_seqlen_k] buffer (contiguous rows) instead of a new
    one."""
    check(q.dim() == 3, "q", lambda: f"expected [M, H, {HEAD_DIM}], got {tuple(q.shape)}")
    rows = q.shape[0]
    heads, dim = _check_q_w(q, weights, rows)
    qb = _as_codes(q, "q")
    kb, k_scale = _check_flat_keys(k, k_scale, dim)
    for name, t in (("cu_seqlen_ks", cu_seqlen_ks), ("cu_seqlen_ke", cu_seqlen_ke)):
        check(t.dtype in _INDEX and t.dim() == 1 and t.numel() == rows and t.is_contiguous(),
              name, lambda t=t: f"expected contiguous int32 [{rows}], got {t.dtype} "
              f"{tuple(t.shape)}")
    return _launch(q, rows, heads, max_seqlen_k, "max_seqlen_k",
                   (("k", k), ("k_scale", k_scale), ("weights", weights),
                    ("cu_seqlen_ks", cu_seqlen_ks), ("cu_seqlen_ke", cu_seqlen_ke)),
                   (qb, weights, cu_seqlen_ks, cu_seqlen_ke, kb, k_scale, cu_seqlen_ks, 0, 0, 1,
                    1), paged=False, per_row=False, variant=variant, tile=tile,
                   sm_count=sm_count, out=out)


def _check_flat_keys(k: torch.Tensor, k_scale: torch.Tensor, dim: int):
    """The gathered keys [N, D] as e4m3 codes and their N fp32 scales (uint8 bytes viewed as
    fp32); fails naming ``k`` or ``k_scale``."""
    check(k.dim() == 2 and k.shape[1] == dim, "k", lambda: f"expected [N, {dim}], got {tuple(k.shape)}")
    kb = _as_codes(k, "k")
    if k_scale.dtype == torch.uint8:
        k_scale = k_scale.view(torch.float32)
    k_scale = k_scale.reshape(-1)
    check(k_scale.dtype == torch.float32 and k_scale.numel() == k.shape[0]
          and k_scale.is_contiguous(), "k_scale",
          lambda: f"expected {k.shape[0]} contiguous fp32 scales, got {k_scale.dtype} "
          f"{k_scale.numel()}")
    return kb, k_scale


def _check_paged_cache(kv_cache: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """The index-K cache as [num_blocks, block_size, D + 4] uint8 (DeepGEMM's 4-D one-head view
    squeezed) with contiguous pages, and its block size; fails naming ``kv_cache``."""
    if kv_cache.dim() == 4:  # DeepGEMM's [num_blocks, block_size, 1, D + 4] view
        check(kv_cache.shape[2] == 1, "kv_cache", lambda: f"4-D cache must have one head, got "
              f"{tuple(kv_cache.shape)}")
        kv_cache = kv_cache.squeeze(2)
    check(kv_cache.dtype == torch.uint8 and kv_cache.dim() == 3
          and kv_cache.shape[2] == dim + SCALE_BYTES, "kv_cache",
          lambda: f"expected uint8 [num_blocks, block_size, {dim + SCALE_BYTES}], got "
          f"{kv_cache.dtype} {tuple(kv_cache.shape)}")
    block_size = kv_cache.shape[1]
    check(kv_cache.stride(2) == 1 and kv_cache.stride(1) == dim + SCALE_BYTES
          and (kv_cache.shape[0] <= 1 or kv_cache.stride(0) >= block_size * (dim + SCALE_BYTES)),
          "kv_cache", lambda: f"pages must be contiguous, got strides {kv_cache.stride()}")
    return kv_cache, block_size


def paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                     context_lens: torch.Tensor, block_table: torch.Tensor, max_model_len: int,
                     *, variant: str | None = None, sm_count: int | None = None,
                     tile: LogitsTile | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """DeepGEMM ``fp8_paged_mqa_logits`` (FP8 path): fp32 [B * next_n, max_model_len] over
    the paged index-K cache (see module doc). ``max_model_len`` must bound every context
    length (as DeepGEMM requires). ``tile`` overrides the variant's tile (benchmarks).
    ``out``: a caller's fp32 [B * next_n, max_model_len] buffer (contiguous rows; served
    decodes pass a view of vLLM's workspace, vllm.deepinfer.reserve) instead of a new one."""
    check(q.dim() == 4, "q", lambda: f"expected [B, next_n, H, {HEAD_DIM}], got {tuple(q.shape)}")
    batch, next_n = q.shape[0], q.shape[1]
    rows = batch * next_n
    heads, dim = _check_q_w(q, weights, rows)
    qb = _as_codes(q, "q")
    kv_cache, block_size = _check_paged_cache(kv_cache, dim)
    shape = tuple(context_lens.shape)
    per_row = next_n > 1 and shape == (batch, next_n)
    check(context_lens.dtype in _INDEX and context_lens.is_contiguous()
          and (per_row or shape == (batch,) or (next_n == 1 and shape == (batch, 1))),
          "context_lens", lambda: f"expected contiguous int32 [{batch}] or [{batch}, {next_n}], got "
          f"{context_lens.dtype} {shape}")
    check(block_table.dtype in _INDEX and block_table.dim() == 2
          and block_table.shape[0] >= batch and block_table.shape[1] >= 1
          and block_table.stride(1) == 1, "block_table",
          lambda: f"expected int32 [>= {batch}, max_blocks] with contiguous rows, got "
          f"{block_table.dtype} {tuple(block_table.shape)}")
    return _launch(q, rows, heads, max_model_len, "max_model_len",
                   (("kv_cache", kv_cache), ("weights", weights),
                    ("context_lens", context_lens), ("block_table", block_table)),
                   (qb, weights, context_lens, context_lens, kv_cache, kv_cache, block_table,
                    block_table.stride(0), kv_cache.stride(0), block_size, next_n),
                   paged=True, per_row=per_row, variant=variant, tile=tile, sm_count=sm_count,
                   out=out)


def _output(out, rows: int, width: int, q) -> torch.Tensor:
    """The [rows, width] fp32 logits: ``out`` checked, or a new tensor. Its rows may be
    strided (the kernel takes ``out.stride(0)``); each row's columns are contiguous."""
    if out is None:
        return torch.empty(rows, width, dtype=torch.float32, device=q.device)
    check(isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.dim() == 2
          and tuple(out.shape) == (rows, width) and out.device == q.device
          and (out.stride(1) == 1 or width <= 1) and (rows <= 1 or out.stride(0) >= width),
          "out", lambda: f"expected fp32 [{rows}, {width}] on {q.device} with contiguous rows, "
          f"got {getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}"
          f" strides {out.stride() if isinstance(out, torch.Tensor) else ()} on "
          f"{getattr(out, 'device', None)}")
    return out


def _launch(q, rows: int, heads: int, width: int, width_name: str, tensors, args, *,
            paged: bool, per_row: bool, variant, tile, sm_count, out=None) -> torch.Tensor:
    """Device checks, the [rows, width] fp32 output, and the launch (both forms)."""
    for name, t in tensors:
        check(t.device == q.device, name, lambda t=t: f"on {t.device}, q on {q.device}")
    check(width >= 0, width_name, lambda: f"{width} < 0")
    out = _output(out, rows, width, q)
    if rows == 0 or width == 0:
        return out
    v = arch.resolve(variant, TILES)
    tile = tile or TILES[v.name]
    row_groups = 1 if paged else tile.flat_rows  # rows per program
    groups = triton.cdiv(rows, row_groups)
    programs = _programs(tile, groups, width, q.device, sm_count)
    next_n = args[10]
    for r0, r1 in row_chunks(rows, row_groups, next_n if paged else row_groups):
        whole = r1 - r0 == rows
        _logits_kernel[(programs, triton.cdiv(r1 - r0, row_groups))](
            out if whole else out[r0:r1], out.stride(0),
            *(args if whole else chunk_args(args, r0, r1, paged, next_n)), r1 - r0, H=heads,
            H_PAD=max(16, triton.next_power_of_2(heads)), D=HEAD_DIM, BLOCK_N=tile.block_n,
            PAGED=paged, CTX_PER_ROW=per_row, HW_FP8=v.hw_fp8, E4B15=tile.e4b15,
            ROWS=row_groups, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


# --------------------------------------------------------------------------- compile gate
_SIGNATURE = {
    "out_ptr": "*fp32", "out_stride": "i32", "q_ptr": "*u8", "w_ptr": "*fp32",
    "start_ptr": "*i32", "end_ptr": "*i32", "k_ptr": "*u8", "kscale_ptr": "*fp32",
    "bt_ptr": "*i32", "bt_stride": "i32", "page_stride": "i32", "block_size": "i32",
    "next_n": "i32", "n_rows": "i32", "H": "constexpr", "H_PAD": "constexpr", "D": "constexpr",
    "BLOCK_N": "constexpr", "PAGED": "constexpr", "CTX_PER_ROW": "constexpr",
    "HW_FP8": "constexpr", "E4B15": "constexpr", "ROWS": "constexpr",
}


def compile_constexprs(variant: str, heads: int = shapes.V41.index_heads) -> list[dict]:
    """The constexpr sets a model with ``heads`` index heads launches on ``variant``: paged
    (one length per request, and per row for native multi-token decode) and flat (its rows
    per program: the tile's ``flat_rows``)."""
    tile = TILES[variant]
    return [{"H": heads, "H_PAD": max(16, triton.next_power_of_2(heads)), "D": HEAD_DIM,
             "BLOCK_N": tile.block_n, "PAGED": paged, "CTX_PER_ROW": per_row,
             "HW_FP8": arch.VARIANTS[variant].hw_fp8, "E4B15": tile.e4b15,
             "ROWS": 1 if paged else tile.flat_rows}
            for paged, per_row in ((True, False), (True, True), (False, False))]


def _register() -> None:
    # The candidate-block variant (its own module) builds on this kernel's helpers.
    compile_gate.add_provider("vllm.deepinfer.kernels.indexer_candidate_logits")
    # The indexer's padded decode layout (pack of the e4m3 Q, unpack of the top-k rows).
    compile_gate.add_provider("vllm.deepinfer.kernels.pack_seq")
    # V4.1/V4 indexers: 64 heads x 128 dims (compile_constexprs' default).
    for v in ("sm80", "sm90"):
        tile = TILES[v]
        for c in compile_constexprs(v):
            tag = ("paged" + (".per_row" if c["CTX_PER_ROW"] else "")) if c["PAGED"] else "flat"
            compile_gate.register(compile_gate.GateSpec(
                name=f"indexer_logits.{tag}[{v}]", kernel=_logits_kernel, signature=_SIGNATURE,
                constexprs=c, variants=(v,), num_warps=tile.num_warps,
                num_stages=tile.num_stages, feature="indexer_logits"))


_register()
