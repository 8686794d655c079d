"""Combine the compressed top-k indices with the sliding-window indices for sparse prefill.

``combine_topk_swa_indices`` has the signature, semantics and return of upstream V4.1's
(vllm/models/deepseek_v41/common/ops/cache_utils.py): for query token ``t`` of request ``b``
at position ``pos = seq_len - query_len + (t - query_start)``

* ``topk_len = clamp((pos + 1) // compress_ratio, 0, topk)`` (0 when ``compress_ratio == 0``);
  columns ``[0, topk_len)`` hold ``topk_indices[t, j] + M * b``, or -1 where the entry is
  ``< 0`` or ``>= N``;
* ``swa_start = max(pos - window + 1, 0, seq_len - gather_len)``,
  ``swa_len = max(pos - swa_start + 1, 0)``; the next ``swa_len`` columns hold
  ``M * b + N + (swa_start - gather_start) + k``;
* every other column of the row is -1; ``combined_lens[t] = topk_len + swa_len``.

The row width is ``round_up(topk + window_size, 128)`` (FlashMLA sparse prefill wants a
multiple of its 64/128-wide top-k block). ``query_start_loc`` is rebased by its first entry.

Unlike upstream (a ``torch.full(-1)``/``fill_(-1)`` launch, then a (requests x 256 workers)
kernel writing only the valid columns), each query token's row is written once by one program,
in three disjoint column ranges, so there is no fill launch and no column is written twice.
A program owns one token (four or two for the narrow SWA-only rows, see ``TILES``) and finds
its request by counting the ``query_start_loc`` ends at or below it — one vector compare per
128 requests, no precomputed token->request map (which would cost another launch or a host
sync). A caller's ``out`` workspace is overwritten completely; its prior contents never matter.

V4 ratios 4 (top-k 512) and 128 (top-k = the active C128A width, up to 8192) use the same
code. Differences from the V4 kernels (docs/kv-gather-and-combiner.md): the V4 CUDA kernel
neither maps invalid top-k entries to -1 nor clamps the window to the gathered range — the
V4 ROCm kernel and V4.1 do both, and this module follows them; the V4 in-image bidirectional
window (``left_visible``/``right_visible``/``max_image_tokens``) is not supported.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from vllm.deepinfer import arch, compile_gate
from vllm.deepinfer.kernels.checks import check, check_tensor

__all__ = ["combine_topk_swa_indices", "combined_width", "compile_keys", "CombineKey",
           "CombineTile", "TILES", "ROW_ALIGN"]

# FlashMLA sparse prefill asserts topk % B_TOPK == 0 with B_TOPK 64 or 128 (upstream pads
# the combined row to 128 for both); the width must match upstream's exactly.
ROW_ALIGN = 128
# Request-search chunk: query_start_loc is read BLOCK_R entries at a time (one pass for up
# to 128 requests; more requests loop).
BLOCK_R = 128
_VEC = 4  # int32 columns per 16-byte vector
_INT32_MAX = 2**31 - 1
_SCALAR_WIDTH = _INT32_MAX  # the VEC=1 build uses the widest tile row
_I32_MAX = tl.constexpr(_INT32_MAX)  # in-kernel: past any query_start_loc entry (masked lanes)


@dataclasses.dataclass(frozen=True)
class CombineTile:
    max_width: int  # rows up to this many columns use this row
    tokens: int     # query tokens (rows) per program
    block: int      # columns per step (power of two); wider rows loop
    num_warps: int


# Keyed by variant; the first row whose max_width >= the row width is used. Each thread
# moves 4 int32 per step (16-byte loads and stores). Measured on the H200
# (benchmarks/results/h200-2026-11-29-tile-sweep.json, GPU time from CUDA graphs over input
# rings > 2x L2): the 128-wide SWA-only row (516 bytes of traffic per token) wants many tokens
# per program — 16 tokens x 128 columns took 9.6 us at T=32768 where 4 tokens took 12.8 and one
# token per program 32-42 us (programs are too small to hide their launch); the 640-wide
# V4.1/V4-C4A row is fastest as two tokens x 512 columns, two steps (13.2 us at T=8192, vs 13.8
# for one token x 1024 with a masked tail); the 8320-wide V4-C128A row runs 1024-column steps.
# The 256-wide row (window 256, SWA only) was not measured. No fp8 and no shared-memory
# staging, so Ampere and Hopper share the rows.
_TILES = (CombineTile(128, 16, 128, 4), CombineTile(256, 2, 256, 4), CombineTile(1024, 2, 512, 4),
          CombineTile(_INT32_MAX, 1, 1024, 4))
TILES: dict[str, tuple[CombineTile, ...]] = {v: _TILES for v in arch.VARIANTS}


# The per-request metadata arrive as slices of per-step tensors (``query_start_loc[nd + c0:]``,
# ``seq_lens[c0:c1]``) whose alignment changes between chunks: not specialized on it, so one
# warmed binary serves every chunk (tests/test_warmup_coverage.py); they are read as scalars.
@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "M", "N", "topk", "topk_v", "ratio",
                                "window", "width_v"],
            do_not_specialize_on_alignment=["qsl_ptr", "seq_ptr", "gl_ptr"])
def _combine_kernel(ci_ptr, ci_stride, cl_ptr, tk_ptr, tk_stride, qsl_ptr, seq_ptr, gl_ptr,
                    num_tokens, num_reqs, M, N, topk, topk_v, ratio, window, width_v,
                    TOKENS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                    VEC: tl.constexpr):
    # Bounds arrive in units of VEC columns so that masks stay constant over a 16-byte vector.
    width = width_v * VEC      # row width of combined_indices
    topk_read = topk_v * VEC   # top-k columns read: >= topk, <= the width of topk_indices
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    live = t < num_tokens
    cols = tl.arange(0, BLOCK)[None, :]
    in_row = tk_ptr + t.to(tl.int64)[:, None] * tk_stride
    out_row = ci_ptr + t.to(tl.int64)[:, None] * ci_stride
    # The first step's top-k values depend only on t: load them before the request search so
    # both latencies overlap.
    v = tl.load(in_row + cols, mask=live[:, None] & (cols < topk_read), other=-1)

    # Request of each token: the number of requests whose query range ends at or before it.
    tok = tl.load(qsl_ptr) + t
    req = tl.zeros([TOKENS], dtype=tl.int32)
    for r0 in range(0, num_reqs, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        ends = tl.load(qsl_ptr + 1 + rr, mask=rr < num_reqs, other=_I32_MAX)
        req += tl.sum((ends[None, :] <= tok[:, None]).to(tl.int32), 1)
    covered = live & (req < num_reqs)  # False for rows past query_start_loc[-1]
    q_end = tl.load(qsl_ptr + 1 + req, mask=covered, other=0)
    seq_len = tl.load(seq_ptr + req, mask=covered, other=0)
    gather_len = tl.load(gl_ptr + req, mask=covered, other=0)

    pos = seq_len - (q_end - tok)
    gather_start = seq_len - gather_len
    topk_len = tl.where(pos >= 0, tl.minimum((pos + 1) // ratio, topk), 0)
    swa_start = tl.maximum(tl.maximum(pos - (window - 1), 0), gather_start)
    swa_len = tl.maximum(pos - swa_start + 1, 0)
    topk_len = tl.where(covered, topk_len, 0)
    swa_len = tl.where(covered, swa_len, 0)
    swa_end = topk_len + swa_len
    base = M * req
    swa_base = base + N + swa_start - gather_start - topk_len  # value at column c: swa_base + c

    for c0 in range(0, width, BLOCK):
        c = c0 + cols
        tk = tl.where((v >= 0) & (v < N), v + base[:, None], -1)
        val = tl.where(c < topk_len[:, None], tk,
                       tl.where(c < swa_end[:, None], swa_base[:, None] + c, -1))
        tl.store(out_row + c, val, mask=live[:, None] & (c < width))
        nxt = c + BLOCK  # the next step's top-k values
        v = tl.load(in_row + nxt, mask=live[:, None] & (nxt < topk_read), other=-1)
    tl.store(cl_ptr + t, swa_end, mask=live)


# --------------------------------------------------------------------------- host side
def combined_width(topk: int, window_size: int) -> int:
    return -(-(topk + window_size) // ROW_ALIGN) * ROW_ALIGN


def _vec(topk_width: int) -> int:
    # 16-byte vectors need bounds in units of 4 columns. A top-k buffer whose width is not a
    # multiple of 4 (no upstream caller has one) takes the scalar build, since reading up to
    # the next multiple of 4 could pass its end; it always uses the widest tile row.
    return _VEC if topk_width % _VEC == 0 else 1


def _tile(width: int, variant: str | None) -> CombineTile:
    return next(t for t in TILES[arch.table_key(variant, TILES)] if width <= t.max_width)


@functools.lru_cache(maxsize=None)
def _launch_config(topk_width: int, width: int, variant: str | None):
    """(VEC, tile) for a call: pure functions of these, cached (host time)."""
    vec = _vec(topk_width)
    return vec, _tile(width if vec == _VEC else _SCALAR_WIDTH, variant)


_I32 = (torch.int32,)


def _check_inputs(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                  compress_ratio, topk, M, N, out, width) -> None:
    """The launcher's checks (messages formatted only on failure, kernels/checks.py)."""
    check_tensor(topk_indices, "topk_indices", _I32, 2)
    dev = topk_indices.device
    tsh = topk_indices.shape
    check(tsh[1] <= 1 or topk_indices.stride(1) == 1, "topk_indices",
          lambda: f"expected int32 [num_tokens, width] with contiguous rows, got "
          f"{tuple(tsh)} strides {topk_indices.stride()}")
    check_tensor(seq_lens, "seq_lens", _I32, 1, dev, True)
    num_reqs = seq_lens.shape[0]
    check_tensor(query_start_loc, "query_start_loc", _I32, 1, dev, True)
    check(query_start_loc.shape[0] == num_reqs + 1, "query_start_loc",
          lambda: f"expected int32 [{num_reqs + 1}], got {tuple(query_start_loc.shape)}")
    check_tensor(gather_lens, "gather_lens", _I32, 1, dev, True)
    check(gather_lens.shape[0] == num_reqs, "gather_lens",
          lambda: f"expected int32 [{num_reqs}], got {tuple(gather_lens.shape)}")
    check(window_size >= 1, "window_size", lambda: f"must be >= 1, got {window_size}")
    check(compress_ratio >= 0, "compress_ratio", lambda: f"must be >= 0, got {compress_ratio}")
    check(0 <= topk and (compress_ratio == 0 or topk <= tsh[1]), "topk",
          lambda: f"{topk} is negative or wider than topk_indices ({tsh[1]} columns)")
    check(0 <= M <= _INT32_MAX and 0 <= N <= _INT32_MAX, "M/N",
          lambda: f"must fit int32, got M={M} N={N}")
    if out is None:
        return
    ci, cl = out
    check_tensor(ci, "out[0] (combined_indices)", _I32, 2, dev)
    check(ci.shape[0] == tsh[0] and ci.shape[1] == width and ci.stride(1) == 1,
          "out[0] (combined_indices)",
          lambda: f"expected int32 [{tsh[0]}, {width}] with contiguous rows, got "
          f"{tuple(ci.shape)} strides {ci.stride()}")
    check_tensor(cl, "out[1] (combined_lens)", _I32, 1, dev, True)
    check(cl.shape[0] == tsh[0], "out[1] (combined_lens)",
          lambda: f"expected int32 [{tsh[0]}], got {tuple(cl.shape)}")


def combine_topk_swa_indices(
    topk_indices: torch.Tensor,     # [num_tokens, >= topk] int32, chunk-local
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32, global (rebased by entry 0)
    seq_lens: torch.Tensor,         # [num_reqs] int32
    gather_lens: torch.Tensor,      # [num_reqs] int32
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    variant: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream V4.1 ``combine_topk_swa_indices`` (see module doc): returns
    ``(combined_indices [num_tokens, round_up(topk + window_size, 128)] int32,
    combined_lens [num_tokens] int32)``, written into ``out`` when given.

    Rows past ``query_start_loc[-1] - query_start_loc[0]`` (upstream leaves them -1 and their
    length unwritten) get all -1 and length 0. ``variant`` picks the tile row (None: this
    process's variant).
    """
    width = combined_width(topk, window_size)
    _check_inputs(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                  compress_ratio, topk, M, N, out, width)
    num_tokens = topk_indices.shape[0]
    vec, tile = _launch_config(topk_indices.shape[1], width,
                               variant if variant is not None else arch.current().name)
    if out is None:
        dev = topk_indices.device
        combined_indices = torch.empty(num_tokens, width, dtype=torch.int32, device=dev)
        combined_lens = torch.empty(num_tokens, dtype=torch.int32, device=dev)
    else:
        combined_indices, combined_lens = out
    if num_tokens == 0:
        return combined_indices, combined_lens
    topk_eff = topk if compress_ratio > 0 else 0
    _combine_kernel[(triton.cdiv(num_tokens, tile.tokens),)](
        combined_indices, combined_indices.stride(0), combined_lens, topk_indices,
        topk_indices.stride(0), query_start_loc, seq_lens, gather_lens, num_tokens,
        seq_lens.shape[0], M, N, topk_eff, -(-topk_eff // vec), max(compress_ratio, 1),
        window_size, width // vec, TOKENS=tile.tokens, BLOCK=tile.block, BLOCK_R=BLOCK_R,
        VEC=vec, num_warps=tile.num_warps, num_stages=1)
    return combined_indices, combined_lens


# --------------------------------------------------------------------------- warmup keys
@dataclasses.dataclass(frozen=True)
class CombineKey:
    """One compiled configuration of ``_combine_kernel``. Everything else (top-k, ratio,
    window, M, N, request count, row width) is a runtime argument."""
    TOKENS: int
    BLOCK: int
    BLOCK_R: int
    VEC: int
    num_warps: int

    def constexprs(self) -> dict:
        return {"TOKENS": self.TOKENS, "BLOCK": self.BLOCK, "BLOCK_R": self.BLOCK_R,
                "VEC": self.VEC}


def compile_keys(window_size: int, compress_ratios, topk: int,
                 variant: str | None = None) -> list[CombineKey]:
    """The configurations a model with these layer ratios launches. ``topk`` is the top-k
    width: index_topk for V4.1 and V4-C4A; for V4 pass the largest C128A width (up to 8192)
    when it is larger. Ratios are the config's (0 for SWA-only layers, which V4 runs as ratio
    1 with top-k 0). Ratio 0 rows are round_up(window, 128) wide, ratios 1-4 rows
    round_up(topk + window, 128); a C128A (ratio >= 128) row's top-k width is the batch's
    active width, 128 .. topk in steps of 128, so every row width in that range counts."""
    name = arch.table_key(variant, TILES)
    vec = _vec(topk)
    widths: set[int] = set()
    for r in {int(r) for r in compress_ratios}:
        if r == 0:
            widths.add(combined_width(0, window_size))
        elif r < 128:
            widths.add(combined_width(topk, window_size))
        else:
            widths.update(combined_width(k, window_size)
                          for k in range(ROW_ALIGN, topk + ROW_ALIGN, ROW_ALIGN))
    keys: list[CombineKey] = []
    for w in sorted(widths):
        t = _tile(w if vec == _VEC else _SCALAR_WIDTH, name)
        key = CombineKey(t.tokens, t.block, BLOCK_R, vec, t.num_warps)
        if key not in keys:
            keys.append(key)
    return keys


_SIGNATURE = {
    "ci_ptr": "*i32", "ci_stride": "i32", "cl_ptr": "*i32", "tk_ptr": "*i32", "tk_stride": "i32",
    "qsl_ptr": "*i32", "seq_ptr": "*i32", "gl_ptr": "*i32", "num_tokens": "i32",
    "num_reqs": "i32", "M": "i32", "N": "i32", "topk": "i32", "topk_v": "i32", "ratio": "i32",
    "window": "i32", "width_v": "i32", "TOKENS": "constexpr", "BLOCK": "constexpr",
    "BLOCK_R": "constexpr", "VEC": "constexpr",
}


def _register() -> None:
    # Every tile row with 16-byte vectors, plus the scalar build (widest row only), for the
    # Ampere targets and the hardware-fp8 ones (the rows are the same today).
    builds = [(t, _VEC) for t in _TILES] + [(_TILES[-1], 1)]
    for t, vec in builds:
        for tag, variants in (("sm80", ("sm80",)), ("sm90", ("sm89", "sm90", "sm100"))):
            compile_gate.register(compile_gate.GateSpec(
                name=f"topk_swa.{tag}.T{t.tokens}B{t.block}.V{vec}", kernel=_combine_kernel,
                signature=_SIGNATURE,
                constexprs={"TOKENS": t.tokens, "BLOCK": t.block, "BLOCK_R": BLOCK_R, "VEC": vec},
                variants=variants, num_warps=t.num_warps, num_stages=1, feature="topk_swa"))


_register()
