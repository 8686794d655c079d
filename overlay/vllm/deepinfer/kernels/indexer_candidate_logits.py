"""V4.1 index sources masked to candidate blocks: logits computed inside the candidate blocks
only, in the layout upstream's compute-then-mask produces.

DeepSeek-V4.1's two-level selection: the candidate-source indexer publishes, per query row,
``candidate_topk_blocks`` block ids of ``candidate_block_size`` compressed positions
(``select_candidate_blocks`` in upstream's model_executor/kernels/attention/dsa/
candidate_blocks.py, -1 padded); every later index source computes its logits over all of
the row's keys, then ``apply_candidate_mask`` writes -inf outside those blocks, then the row
top-k runs. At a 1M-token context a ratio-1 index layer computes ~1M logits per row to keep
at most 2048 x 8 of them.

Here the same masked logits come from computing only the kept entries:

* ``_prepare_kernel`` writes -inf over each row's ``[0, end)`` (clipped to the width),
  ``end`` being the row bound upstream's mask uses: ``ke - ks`` in prefill; in decode the
  context length of the row (``context_lens`` [B, next_n]) or of its request ([B] / [B, 1],
  the ``row_repeat`` case), which bounds the row's own key count; and lists the row's
  candidate ids that can hold a stored logit (the -1 padding and blocks wholly past the
  row's keys dropped), with their count;
* ``_candidate_logits_kernel`` then walks the listed slots (block ``j`` of the list, offset
  ``o``: column ``id[j] * block + o``) in tiles of BLOCK_N and stores the logit of every
  slot whose column lies inside the row's keys, with the arithmetic of
  ``indexer_logits._logits_kernel`` (the shared ``_row_query`` / ``_key_logits`` helpers at
  the variant's tile), so each stored entry has the bits the full kernel gives it. Work per
  row: the listed ids x block logits, at most the candidate list's and (duplicate ids
  aside) about the row's keys when it has fewer.

What is kept is what upstream's mask keeps: a column ``c < min(end, width)`` of a candidate
block (ids < 0 ignored, duplicates harmless), and, where a candidate block starts at or past
the logits width, column ``width - 1`` (upstream's "packed-column clamp": its flag kernel
maps such blocks to an edge flag that keeps the last column). Kept columns past the row's
own key count hold -inf here; upstream leaves the full kernel's unwritten values there, and
no top-k reads them (decode rows of a request see ``len - next_n + 1 + j`` keys; every
top-k reads ``[0, that)``).

So inside every range a top-k reads, the tensor is bit-for-bit upstream's masked logits,
and the top-k that follows selects what it selects from upstream's tensor, ties included:
equal values, the -inf entries a short row or a sparse candidate list leaves, NaN rows —
whatever order the top-k kernel gives them, it is given the same input. Past ``end`` the
tensor is not written (upstream's mask writes -inf up to the width; the unmasked index
sources leave that region unwritten too, and no consumer reads it). Work: rows x
candidate slots logits instead of rows x keys; bytes: the -inf fill (rows x keys x 4, what
upstream's mask writes too) and the keys of the candidate blocks.

Why not a compact [rows, slots] matrix with an index map: the top-k would then see other
input than upstream's (other columns, without the -inf entries it picks for short or
sparse rows), and the same selections would rest on reproducing each top-k kernel's tie
order; the layout kept here makes the equality hold for any top-k. The fill's bytes are
~1/4000 of the FLOPs saved per skipped key (16384 FLOP for 4 bytes).
tests/test_candidate_logits.py checks the bits and the selections against the full kernel
followed by upstream's mask kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.deepinfer import arch, compile_gate
from vllm.deepinfer.kernels import indexer_logits as il
from vllm.deepinfer.kernels import shapes
from vllm.deepinfer.kernels.checks import check
from vllm.deepinfer.kernels.indexer_logits import (_key_logits, _row_length, _row_query,
                                                   HEAD_DIM, SCALE_BYTES)

__all__ = ["candidate_mqa_logits", "candidate_paged_mqa_logits", "compile_constexprs",
           "prepare_constexprs", "FILL_BLOCK", "FILL_WARPS", "FILL_PROGRAMS_PER_SM",
           "LIST_BLOCK"]

# -inf fill: 1024 fp32 per program step = 8 per thread of 4 warps (two 16-byte stores), and
# FILL_PROGRAMS_PER_SM programs per SM over all rows (a pure store stream, sized to keep every
# SM busy; not timed apart from the logits kernel: the suite's indexer_candidate rows time
# both, e.g. 128 rows x 1M keys, 512 MB of -inf, in 362 us sm80 / 333 us sm90 in all,
# benchmarks/results/h200-2026-12-01-indexer_logits-2be8c41.json).
FILL_BLOCK = 1024
FILL_WARPS = 4
FILL_PROGRAMS_PER_SM = 8
# Candidate ids compacted per step (V4.1 lists 2048 per row: two steps).
LIST_BLOCK = 1024


@triton.jit(do_not_specialize=["out_stride", "next_n", "width", "cand_stride", "n_cand",
                               "cand_bs"],
            do_not_specialize_on_alignment=["start_ptr", "end_ptr", "cand_ptr"])
def _prepare_kernel(out_ptr, out_stride, start_ptr, end_ptr, next_n, width, cand_ptr,
                    cand_stride, n_cand, cand_bs, list_ptr, count_ptr,
                    PAGED: tl.constexpr, CTX_PER_ROW: tl.constexpr, BLOCK: tl.constexpr,
                    LIST: tl.constexpr):
    """-inf over the row's [0, mask end); program 0 of the row also writes the row's list
    of candidate ids that can hold a stored logit (in list order: those with a column below
    the row's key count, and ids starting past the width when the row reaches column
    width - 1) and their count, so the logits kernel runs no tile of -1 padding or of blocks
    past the causal limit."""
    row = tl.program_id(1)
    row64 = row.to(tl.int64)
    if PAGED:
        if CTX_PER_ROW:
            end = tl.load(end_ptr + row)
        else:
            end = tl.load(end_ptr + row // next_n)  # the request's length (row_repeat)
    else:
        end = tl.load(end_ptr + row) - tl.load(start_ptr + row)
    end = tl.minimum(end, width)
    out_row = out_ptr + row64 * out_stride
    c = tl.arange(0, BLOCK)
    for b in range(tl.program_id(0) * BLOCK, end, tl.num_programs(0) * BLOCK):
        tl.store(out_row + b + c, float("-inf"), mask=b + c < end)
    if tl.program_id(0) == 0:
        _, _, length = _row_length(row, start_ptr, end_ptr, next_n, PAGED, CTX_PER_ROW)
        length = tl.minimum(length, width)
        cand_row = cand_ptr + row64 * cand_stride
        list_row = list_ptr + row64 * n_cand
        j = tl.arange(0, LIST)
        count = 0
        for j0 in range(0, n_cand, LIST):
            blk = tl.load(cand_row + j0 + j, mask=j0 + j < n_cand, other=-1)
            first = blk.to(tl.int64) * cand_bs
            keep = (blk >= 0) & ((first < length) | ((first >= width) & (length >= width)))
            keep = keep.to(tl.int32)
            tl.store(list_row + count + tl.cumsum(keep, axis=0) - 1, blk, mask=keep != 0)
            count += tl.sum(keep, axis=0)
        tl.store(count_ptr + row, count)


# Per-call integers unspecialized (one compile per constexpr set, warmed by
# vllm.deepinfer.warmup), ``page_stride`` specialized as in _logits_kernel (16-byte pages);
# the row bounds are slices of per-step metadata: their alignment is not specialized.
@triton.jit(do_not_specialize=["out_stride", "bt_stride", "block_size", "next_n", "n_cand",
                               "cand_bs", "width"],
            do_not_specialize_on_alignment=["start_ptr", "end_ptr", "bt_ptr"])
def _candidate_logits_kernel(out_ptr, out_stride, q_ptr, w_ptr, start_ptr, end_ptr, k_ptr,
                             kscale_ptr, bt_ptr, bt_stride, page_stride, block_size, next_n,
                             list_ptr, count_ptr, n_cand, cand_bs, width,
                             H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
                             BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                             CTX_PER_ROW: tl.constexpr, HW_FP8: tl.constexpr,
                             E4B15: tl.constexpr):
    row = tl.program_id(1)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    req, start, length = _row_length(row, start_ptr, end_ptr, next_n, PAGED, CTX_PER_ROW)
    length = tl.minimum(length, width)
    slots = tl.load(count_ptr + row) * cand_bs
    ntiles = tl.cdiv(slots, BLOCK_N)
    if pid < ntiles:
        row64 = row.to(tl.int64)
        q, w = _row_query(q_ptr, w_ptr, row64, H, H_PAD, D, HW_FP8, E4B15)
        n = tl.arange(0, BLOCK_N)
        out_row = out_ptr + row64 * out_stride
        bt_row = bt_ptr + req.to(tl.int64) * bt_stride
        list_row = list_ptr + row64 * n_cand
        for t in range(pid, ntiles, nprog):
            slot = t * BLOCK_N + n
            listed = slot < slots
            blk = tl.load(list_row + slot // cand_bs, mask=listed, other=0)
            off = slot % cand_bs
            first = blk.to(tl.int64) * cand_bs
            past = first >= width  # upstream's edge flag: keeps column width - 1
            col = tl.where(past, width - 1, first + off).to(tl.int32)
            valid = listed & ((off == 0) | ~past) & (col < length)
            logit = _key_logits(q, w, start + col, valid, k_ptr, kscale_ptr, bt_row,
                                page_stride, block_size, D, PAGED, HW_FP8, E4B15)
            tl.store(out_row + col, logit, mask=valid)


# --------------------------------------------------------------------------- launchers
def _check_candidates(candidates: torch.Tensor, block_size: int, rows: int, q) -> None:
    check(candidates.dtype == torch.int32 and candidates.dim() == 2
          and candidates.shape[0] == rows and candidates.shape[1] >= 1
          and (candidates.stride(1) == 1 or candidates.shape[1] == 1), "candidates",
          lambda: f"expected int32 [{rows}, candidate_topk_blocks] with contiguous rows, got "
          f"{candidates.dtype} {tuple(candidates.shape)} strides {candidates.stride()}")
    check(candidates.device == q.device, "candidates",
          lambda: f"on {candidates.device}, q on {q.device}")
    check(isinstance(block_size, int) and block_size >= 1, "block_size",
          lambda: f"candidate block size {block_size!r}, expected an int >= 1")


def candidate_mqa_logits(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                         weights: torch.Tensor, cu_seqlen_ks: torch.Tensor,
                         cu_seqlen_ke: torch.Tensor, max_seqlen_k: int,
                         candidates: torch.Tensor, block_size: int, *,
                         variant: str | None = None, sm_count: int | None = None,
                         tile: il.LogitsTile | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """``indexer_logits.mqa_logits`` followed by upstream's ``apply_candidate_mask`` (row
    starts None, row ends ``ke - ks``), computed inside ``candidates`` [M, K] (int32 block
    ids, -1 padded) of ``block_size`` columns only: fp32 [M, max_seqlen_k], row ``i``
    written over ``[0, ke[i] - ks[i])`` (module doc). ``out`` takes a caller's buffer."""
    check(q.dim() == 3, "q", lambda: f"expected [M, H, {HEAD_DIM}], got {tuple(q.shape)}")
    rows = q.shape[0]
    heads, dim = il._check_q_w(q, weights, rows)
    qb = il._as_codes(q, "q")
    kb, k_scale = il._check_flat_keys(k, k_scale, dim)
    for name, t in (("cu_seqlen_ks", cu_seqlen_ks), ("cu_seqlen_ke", cu_seqlen_ke)):
        check(t.dtype == torch.int32 and t.dim() == 1 and t.numel() == rows
              and t.is_contiguous(), name, lambda t=t: f"expected contiguous int32 [{rows}], "
              f"got {t.dtype} {tuple(t.shape)}")
    _check_candidates(candidates, block_size, rows, q)
    return _launch(q, rows, heads, max_seqlen_k, "max_seqlen_k",
                   (("k", k), ("k_scale", k_scale), ("weights", weights),
                    ("cu_seqlen_ks", cu_seqlen_ks), ("cu_seqlen_ke", cu_seqlen_ke)),
                   (qb, weights, cu_seqlen_ks, cu_seqlen_ke, kb, k_scale, cu_seqlen_ks, 0, 0, 1,
                    1), candidates, block_size, paged=False, per_row=False, variant=variant,
                   tile=tile, sm_count=sm_count, out=out)


def candidate_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                               context_lens: torch.Tensor, block_table: torch.Tensor,
                               max_model_len: int, candidates: torch.Tensor, block_size: int,
                               *, variant: str | None = None, sm_count: int | None = None,
                               tile: il.LogitsTile | None = None,
                               out: torch.Tensor | None = None) -> torch.Tensor:
    """``indexer_logits.paged_mqa_logits`` followed by upstream's decode
    ``apply_candidate_mask`` (row ends: the context lengths, repeated over a request's
    ``next_n`` rows when there is one per request), computed inside ``candidates``
    [B * next_n, K] only (module doc). ``out`` takes a caller's buffer."""
    check(q.dim() == 4, "q",
          lambda: f"expected [B, next_n, H, {HEAD_DIM}], got {tuple(q.shape)}")
    batch, next_n = q.shape[0], q.shape[1]
    rows = batch * next_n
    heads, dim = il._check_q_w(q, weights, rows)
    qb = il._as_codes(q, "q")
    kv_cache, page = il._check_paged_cache(kv_cache, dim)
    shape = tuple(context_lens.shape)
    per_row = next_n > 1 and shape == (batch, next_n)
    check(context_lens.dtype == torch.int32 and context_lens.is_contiguous()
          and (per_row or shape == (batch,) or (next_n == 1 and shape == (batch, 1))),
          "context_lens", lambda: f"expected contiguous int32 [{batch}] or [{batch}, {next_n}]"
          f", got {context_lens.dtype} {shape}")
    check(block_table.dtype == torch.int32 and block_table.dim() == 2
          and block_table.shape[0] >= batch and block_table.shape[1] >= 1
          and block_table.stride(1) == 1, "block_table",
          lambda: f"expected int32 [>= {batch}, max_blocks] with contiguous rows, got "
          f"{block_table.dtype} {tuple(block_table.shape)}")
    _check_candidates(candidates, block_size, rows, q)
    return _launch(q, rows, heads, max_model_len, "max_model_len",
                   (("kv_cache", kv_cache), ("weights", weights),
                    ("context_lens", context_lens), ("block_table", block_table)),
                   (qb, weights, context_lens, context_lens, kv_cache, kv_cache, block_table,
                    block_table.stride(0), kv_cache.stride(0), page, next_n),
                   candidates, block_size, paged=True, per_row=per_row, variant=variant,
                   tile=tile, sm_count=sm_count, out=out)


def _launch(q, rows: int, heads: int, width: int, width_name: str, tensors, args, candidates,
            block_size: int, *, paged: bool, per_row: bool, variant, tile, sm_count,
            out) -> torch.Tensor:
    for name, t in tensors:
        check(t.device == q.device, name, lambda t=t: f"on {t.device}, q on {q.device}")
    check(width >= 0, width_name, lambda: f"{width} < 0")
    out = il._output(out, rows, width, q)  # a caller's buffer, checked, or a new one
    if rows == 0 or width == 0:
        return out
    v = arch.resolve(variant, il.TILES)
    tile = tile or il.TILES[v.name]
    sms = sm_count if sm_count is not None else arch.sm_count(q.device)
    # args: q, w, start, end, k, kscale, bt, bt_stride, page_stride, page, next_n
    next_n = args[10]
    n_cand = candidates.shape[1]
    ids = torch.empty(rows, n_cand, dtype=torch.int32, device=q.device)
    count = torch.empty(rows, dtype=torch.int32, device=q.device)
    fill_programs = max(1, min(triton.cdiv(width, FILL_BLOCK),
                               triton.cdiv(FILL_PROGRAMS_PER_SM * sms, rows)))
    programs = il._programs(tile, rows, n_cand * block_size, q.device, sms)
    # Rows on grid axis y in both kernels: chunks of at most il.GRID_ROWS rows (whole
    # requests), each with the whole launch's programs per row: the same bits.
    for r0, r1 in il.row_chunks(rows, 1, next_n if paged else 1):
        whole = r1 - r0 == rows
        a = args if whole else il.chunk_args(args, r0, r1, paged, next_n)
        o, c, i, n = ((out, candidates, ids, count) if whole else
                      (out[r0:r1], candidates[r0:r1], ids[r0:r1], count[r0:r1]))
        _prepare_kernel[(fill_programs, r1 - r0)](
            o, out.stride(0), a[2], a[3], next_n, width, c, candidates.stride(0), n_cand,
            block_size, i, n, PAGED=paged, CTX_PER_ROW=per_row, BLOCK=FILL_BLOCK,
            LIST=LIST_BLOCK, num_warps=FILL_WARPS)
        _candidate_logits_kernel[(programs, r1 - r0)](
            o, out.stride(0), *a, i, n, n_cand, block_size, width, H=heads,
            H_PAD=max(16, triton.next_power_of_2(heads)), D=HEAD_DIM, BLOCK_N=tile.block_n,
            PAGED=paged, CTX_PER_ROW=per_row, HW_FP8=v.hw_fp8, E4B15=tile.e4b15,
            num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


# --------------------------------------------------------------------------- compile gate
_SIGNATURE = dict(il._SIGNATURE)
for _name in ("n_rows", "H", "H_PAD", "D", "BLOCK_N", "PAGED", "CTX_PER_ROW", "HW_FP8", "E4B15",
              "ROWS"):
    del _SIGNATURE[_name]  # the full kernel's own, or re-added below in the kernel's order
_SIGNATURE.update({"list_ptr": "*i32", "count_ptr": "*i32", "n_cand": "i32", "cand_bs": "i32",
                   "width": "i32", "H": "constexpr", "H_PAD": "constexpr", "D": "constexpr",
                   "BLOCK_N": "constexpr", "PAGED": "constexpr", "CTX_PER_ROW": "constexpr",
                   "HW_FP8": "constexpr", "E4B15": "constexpr"})
_PREPARE_SIGNATURE = {
    "out_ptr": "*fp32", "out_stride": "i32", "start_ptr": "*i32", "end_ptr": "*i32",
    "next_n": "i32", "width": "i32", "cand_ptr": "*i32", "cand_stride": "i32", "n_cand": "i32",
    "cand_bs": "i32", "list_ptr": "*i32", "count_ptr": "*i32", "PAGED": "constexpr",
    "CTX_PER_ROW": "constexpr", "BLOCK": "constexpr", "LIST": "constexpr"}


def compile_constexprs(variant: str, heads: int = shapes.V41.index_heads) -> list[dict]:
    """The candidate kernel's constexpr sets on ``variant``: those of the full kernel
    (``indexer_logits.compile_constexprs``: paged per request, paged per row, flat), one row
    per program."""
    return [{k: v for k, v in c.items() if k != "ROWS"}
            for c in il.compile_constexprs(variant, heads)]


def prepare_constexprs() -> list[dict]:
    """The fill/list kernel's constexpr sets (the same three layouts)."""
    return [{"PAGED": paged, "CTX_PER_ROW": per_row, "BLOCK": FILL_BLOCK, "LIST": LIST_BLOCK}
            for paged, per_row in ((True, False), (True, True), (False, False))]


def _tag(c: dict) -> str:
    return ("paged" + (".per_row" if c["CTX_PER_ROW"] else "")) if c["PAGED"] else "flat"


def _register() -> None:
    for v in ("sm80", "sm90"):
        tile = il.TILES[v]
        for c in compile_constexprs(v):
            compile_gate.register(compile_gate.GateSpec(
                name=f"indexer_candidate_logits.{_tag(c)}[{v}]",
                kernel=_candidate_logits_kernel, signature=_SIGNATURE, constexprs=c,
                variants=(v,), num_warps=tile.num_warps, num_stages=tile.num_stages,
                feature="candidate_logits"))
    for c in prepare_constexprs():
        compile_gate.register(compile_gate.GateSpec(
            name=f"indexer_candidate_prepare.{_tag(c)}", kernel=_prepare_kernel,
            signature=_PREPARE_SIGNATURE, constexprs=c, variants=("sm80", "sm90"),
            num_warps=FILL_WARPS, num_stages=1, feature="candidate_logits"))


_register()
