"""Sparse MLA prefill over the gathered bf16 keys vs upstream vLLM 0.33.0's bf16 prefill kernel.

Upstream: ``_sparse_attn_prefill_ragged_kernel`` launched as ``_rocm_sparse_attn_prefill_ragged_triton``
launches it (grid (T, cdiv(H, 16)), BLOCK_H 16, BLOCK_D 512, BLOCK_K 16, 4 warps) on ragged
indices; ``upstream_us`` times the kernel alone (the ragged indices built once, outside the
timing), ``upstream_path_us`` the whole ``_rocm_sparse_attn_prefill_triton`` (dense -> ragged
compaction: ``_count_valid_row_entries_kernel`` + cumsum + ``_compact_dense_row_to_ragged_kernel``,
then the kernel), which is what vLLM runs and what ours replaces. Ours:
``kernels.sparse_mla_prefill.sparse_attn_prefill`` on the dense rows: the sm90 row (the Gluon
producer/consumer kernel, 64 heads per work item, wgmma), the sm90-triton row (the Triton
tile it falls back to: 64 heads per program, wgmma) and the sm80 tile (16 heads x 16 keys on
2 warps, Q.K^T as two half-dim mma chains; the Ampere 48 KiB tile, here run on Hopper).
``impl`` says which kernel a row ran ("gluon_ws" or "triton").

Shapes: one request, T new tokens (512, 2048, 8192) after ``ctx`` cached ones (8K, 64K,
1M), 64 and 128 heads, window 128, and two kinds of compressed layer: top-k 512 over a
ratio-2 cache (V4.1's c2 layers; c1 and V4's c4a read the same lists over a longer or
shorter cache) and top-k 8192 over a ratio-128 cache (V4's c128a: every compressed position
up to 8192, so short contexts give short lists). The workspace is what the gather writes:
the N = (ctx + T) // ratio compressed rows, then the T + min(ctx, 127) SWA rows of the
chunk. Row t's list, as the combiner writes it: min(topk, N) compressed rows (a random
subset, drawn per token; all of them when N <= top-k), then its window rows (128 once the
position is past 127); width round_up(topk + 128, 128), -1 past the length.

Row fields: ``flops`` = 2 * 2 * heads * 512 * (keys summed over the chunk's rows) (QK^T and
PV); ``tflops`` /
``matmul_share`` against the bf16 matmul rate measured in the same run; ``max_abs_diff`` =
ours vs an fp32 torch reference on SAMPLE tokens spread over the chunk,
``upstream_max_abs_diff`` the same for upstream, ``rms_ratio`` = ours' RMS error / upstream's
there (tests/test_sparse_mla_prefill.py states the bound); ``exact`` null (different tiling and
an exp2-domain softmax: not bit-identical). The key-source question (gathered bf16 rows or the
584-byte records; for sm80 and sm90 only): ``gather_us`` = our kv_gather writing this case's
workspace from record caches (the compressed cache in 64-token pages, the SWA cache in 32-token pages),
``records_us`` = our sparse_mla_decode kernel (the same variant) attending over the same
lists straight from those records, one split; ours reading the workspace costs ``ours_us +
gather_us`` against ``records_us``. Timing: each launch captured in a CUDA graph, replays
timed by ``do_bench`` (median, L2 flushed before each replay) over a ring of input copies
(``Harness.time_graph``): GPU time, no Python launch overhead.
"""
from __future__ import annotations

import importlib

import torch
import triton

from harness import Harness, max_abs_diff
from vllm.deepinfer import kv_record
from vllm.deepinfer.kernels import kv_gather as kvg
from vllm.deepinfer.kernels import shapes
from vllm.deepinfer.kernels import sparse_mla_decode as smd
from vllm.deepinfer.kernels import sparse_mla_prefill as spm
from vllm.deepinfer.kernels import topk_swa
from vllm.deepinfer.kv_record import HEAD_DIM, NOPE_DIM, ROPE_DIM

# sm90: the Gluon producer/consumer kernel where it runs (the row's ``impl`` says which ran);
# sm90-triton: the Triton tile it falls back to.
OURS = ("sm90", "sm90-triton", "sm80")
TOKENS = (512, 2048, 8192)
CONTEXTS = (8 << 10, 64 << 10, 1 << 20)
# (top-k, compress ratio): V4.1's c2 layers; V4's c128a (top-k = every compressed position
# up to the 1M-context width).
LAYERS = ((shapes.V41.topk, 2), (shapes.by_name("v4.c128a").topk, 128))
HEADS = (64, 128)
WINDOW = shapes.V41.window
# Pages of the record caches the gather and the records path read (SM90 layout).
SWA_PAGE, COMP_PAGE = shapes.V41.swa_page, shapes.compressed_page("sm90")
# Tokens whose rows are compared with the fp32 reference (spread over the chunk): the
# reference reads [SAMPLE, keys, 512] fp32 at once, 1.1 GB at 8320 keys.
SAMPLE = 64
SCALE = HEAD_DIM ** -0.5


def _up():
    return importlib.import_module("upstream_kernels.v41_sparse_prefill")


def make_case(dev, tokens: int, ctx: int, topk: int, ratio: int, heads: int, seed: int) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    n_comp = (ctx + tokens) // ratio
    k = min(topk, n_comp)
    # The SWA gather: positions [first, ctx + tokens), gather_len = tokens + min(ctx, W - 1).
    first = ctx - min(ctx, WINDOW - 1)
    rows = n_comp + ctx + tokens - first
    width = topk_swa.combined_width(topk, WINDOW)
    idx = torch.full((tokens, width), -1, dtype=torch.int32, device=dev)
    for t0 in range(0, tokens, 64):
        t1 = min(tokens, t0 + 64)
        if k == n_comp:
            comp = torch.arange(n_comp, device=dev).expand(t1 - t0, n_comp)
        else:
            comp = torch.rand(t1 - t0, n_comp, device=dev, generator=g).topk(k, dim=1).indices
        idx[t0:t1, :k] = comp.to(torch.int32)
    # Token t (position ctx + t) sees positions [pos - wl + 1, pos], wl = min(W, pos + 1).
    pos = ctx + torch.arange(tokens, device=dev)
    wl = (pos + 1).clamp(max=WINDOW)
    j = torch.arange(WINDOW, device=dev)[None, :]
    win = n_comp + (pos - wl + 1 - first)[:, None] + j
    idx[:, k:k + WINDOW] = torch.where(j < wl[:, None], win, -1).to(torch.int32)
    return dict(
        q=torch.randn(tokens, heads, HEAD_DIM, device=dev, generator=g).to(torch.bfloat16),
        kv=torch.randn(rows, HEAD_DIM, device=dev, generator=g).to(torch.bfloat16),
        idx=idx, lens=(k + wl).to(torch.int32), wl=wl,
        sink=torch.randn(heads, device=dev, generator=g), n_comp=n_comp, k=k, ctx=ctx,
        first=first)


def ours(x: dict, variant: str, out=None) -> torch.Tensor:
    return spm.sparse_attn_prefill(x["q"], x["kv"], SCALE, x["sink"], NOPE_DIM, ROPE_DIM,
                                   indices=x["idx"], topk_length=x["lens"], out=out,
                                   variant=variant)


def upstream_ragged(x: dict):
    """Upstream's ``build_ragged_indices_from_dense`` (its kernels, host code mirrored)."""
    up = _up()
    ind, lens = x["idx"], x["lens"]
    nq, width = ind.shape
    block = min(triton.next_power_of_2(width), 1024)
    counts = torch.empty(nq, dtype=torch.int32, device=ind.device)
    indptr = torch.empty(nq + 1, dtype=torch.int32, device=ind.device)
    block_r = max(1, 1024 // block)
    up._count_valid_row_entries_kernel[(triton.cdiv(nq, block_r),)](
        ind, lens, counts, indptr, ind.stride(0), int(x["kv"].shape[0]), nq, width,
        BLOCK_R=block_r, BLOCK_W=block)
    torch.cumsum(counts, dim=0, out=indptr[1:])
    flat = torch.empty(nq * width, dtype=torch.int32, device=ind.device)
    up._compact_dense_row_to_ragged_kernel[(nq,)](
        ind, lens, indptr, flat, ind.stride(0), int(x["kv"].shape[0]), width, BLOCK_W=block)
    return flat, indptr


def upstream_kernel(x: dict, flat, indptr, out) -> torch.Tensor:
    """``_rocm_sparse_attn_prefill_ragged_triton``'s launch of upstream's kernel."""
    q, kv = x["q"], x["kv"]
    T, H, _ = q.shape
    _up()._sparse_attn_prefill_ragged_kernel[(T, triton.cdiv(H, 16))](
        q, kv, flat, indptr, x["sink"], out, q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1), out.stride(0), out.stride(1), out.stride(2), H, HEAD_DIM,
        kv.shape[0], SCALE, HAS_ATTN_SINK=True, OUT_DV=out.shape[-1], BLOCK_H=16,
        BLOCK_D=HEAD_DIM, BLOCK_K=16, num_warps=4)
    return out


def upstream_path(x: dict, out) -> torch.Tensor:
    flat, indptr = upstream_ragged(x)
    return upstream_kernel(x, flat, indptr, out)


def reference(x: dict, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 rows of ``tokens`` (invalid entries masked, sink in the denominator)."""
    q, kv, idx, lens, sink = x["q"], x["kv"], x["idx"], x["lens"], x["sink"]
    H = q.shape[1]
    out = torch.empty(len(tokens), H, HEAD_DIM, device=q.device)
    for i0 in range(0, len(tokens), 8):
        t = tokens[i0:i0 + 8]
        ind = idx[t]
        valid = (torch.arange(ind.shape[1], device=q.device)[None, :] < lens[t][:, None]) & \
            (ind >= 0) & (ind < kv.shape[0])
        k = kv.float()[ind.clamp(min=0).long()]
        logits = torch.einsum("thd,twd->thw", q[t].float(), k) * SCALE
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        logits = torch.cat([logits, sink.float()[None, :, None].expand(len(t), H, 1)], 2)
        out[i0:i0 + 8] = torch.einsum("thw,twd->thd", torch.softmax(logits, 2)[..., :-1], k)
    return out


# ----------------------------------------------------------------------------- records path
def records_case(x: dict) -> dict:
    """The same keys as 584-byte records (the compressed cache in COMP_PAGE pages, the SWA
    cache in SWA_PAGE pages, identity block tables, block 0 of the SWA table a null page),
    the lists as cache slots, and what the gather needs to rebuild the workspace."""
    dev, kv, n_comp = x["q"].device, x["kv"], x["n_comp"]
    T = x["q"].shape[0]
    comp_pages = -(-n_comp // COMP_PAGE)
    comp = kv_record.new_cache(comp_pages, COMP_PAGE, dev)
    kv_record.insert_rows(comp, torch.arange(n_comp, device=dev), kv[:n_comp])
    # SWA positions [first, ctx + T) of a sequence of ctx + T tokens.
    seq, first = x["ctx"] + T, x["first"]
    p0 = first // SWA_PAGE
    swa_pages = -(-seq // SWA_PAGE) - p0
    swa = kv_record.new_cache(swa_pages + 1, SWA_PAGE, dev)
    swa_bt = torch.zeros(1, -(-seq // SWA_PAGE), dtype=torch.int32, device=dev)
    swa_bt[0, p0:] = torch.arange(1, swa_pages + 1, dtype=torch.int32, device=dev)
    pos = torch.arange(first, seq, device=dev)
    swa_slots = (swa_bt[0, pos // SWA_PAGE].long() * SWA_PAGE + pos % SWA_PAGE)
    kv_record.insert_rows(swa, swa_slots, kv[n_comp:])
    k = x["k"]
    comp_idx = x["idx"][:, :k].reshape(-1).contiguous()          # row r = slot r (identity)
    win = x["idx"][:, k:k + WINDOW]                              # workspace rows, -1 padded
    main_idx = swa_slots[(win[win >= 0] - n_comp).long()].to(torch.int32).contiguous()
    main_ptr = torch.zeros(T + 1, dtype=torch.int32, device=dev)
    main_ptr[1:] = x["wl"].cumsum(0)
    return dict(
        q=x["q"], sink=x["sink"], comp=comp, swa=swa, main_idx=main_idx, main_ptr=main_ptr,
        extra_idx=comp_idx, extra_ptr=(torch.arange(T + 1, device=dev) * k).to(torch.int32),
        comp_bt=torch.arange(comp_pages, dtype=torch.int32, device=dev)[None, :],
        swa_bt=swa_bt, n_comp=n_comp,
        # The gather's per-request lengths, on the device before any graph capture.
        comp_lens=torch.tensor([n_comp], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([seq], dtype=torch.int32, device=dev),
        gather_lens=torch.tensor([seq - first], dtype=torch.int32, device=dev),
        ws=torch.empty_like(kv)[None])


def records_attn(r: dict, variant: str, out) -> torch.Tensor:
    # predequant=False: straight from the records (two phases would stage T x keys bf16 rows).
    return smd.sparse_attn_decode(r["q"], r["swa"], r["main_idx"], r["main_ptr"], SCALE,
                                  r["sink"], NOPE_DIM, ROPE_DIM, r["comp"], r["extra_idx"],
                                  r["extra_ptr"], out=out, num_kv_splits=1, variant=variant,
                                  predequant=False)


def gather(r: dict, variant: str) -> None:
    """Our kv_gather rebuilding the workspace, as ``_ampere_prefill`` calls it per chunk."""
    kvg.dequantize_and_gather_k_cache(r["ws"], r["comp"], r["comp_lens"], None, r["comp_bt"],
                                      COMP_PAGE, 0, variant=variant)
    kvg.dequantize_and_gather_k_cache(r["ws"], r["swa"], r["seq_lens"], r["gather_lens"],
                                      r["swa_bt"], SWA_PAGE, r["n_comp"], variant=variant)


# ----------------------------------------------------------------------------- one case
def _case(h: Harness, tokens: int, ctx: int, topk: int, ratio: int, heads: int,
          variants=OURS, with_records: bool = True) -> None:
    per_copy = (tokens * heads * HEAD_DIM * 2 * 2 + ((ctx + tokens) // ratio + tokens) * HEAD_DIM * 2
                + tokens * topk_swa.combined_width(topk, WINDOW) * 4)
    inputs = h.copies(lambda: make_case(h.dev, tokens, ctx, topk, ratio, heads,
                                        seed=int(torch.randint(0, 1 << 30, ()))), per_copy,
                      max_copies=8)
    x = inputs[0]
    keys = x["k"] + WINDOW   # per token once past the first 127 positions
    shape = dict(tokens=tokens, ctx=ctx, topk=topk, ratio=ratio, heads=heads, keys=keys)
    flops = 2 * 2 * heads * HEAD_DIM * int(x["lens"].sum())
    sample = torch.linspace(0, tokens - 1, min(SAMPLE, tokens), device=h.dev).long()
    ref = reference(x, sample)
    outs = [torch.empty_like(xi["q"]) for xi in inputs]
    ragged = [upstream_ragged(xi) for xi in inputs]
    got_up = upstream_kernel(x, *ragged[0], outs[0])[sample].clone()
    up_diff = max_abs_diff(got_up, ref)
    up_rms = float(((got_up.float() - ref) ** 2).mean().sqrt())
    up_us = h.time_graph(lambda i: upstream_kernel(inputs[i], *ragged[i], outs[i]),
                         list(range(len(inputs))))
    path_us = h.time_graph(lambda i: upstream_path(inputs[i], outs[i]), list(range(len(inputs))))
    del ragged
    rec = records_case(x) if with_records else None
    for v in variants:
        got = ours(x, v, out=outs[0])[sample].clone()
        us = h.time_graph(lambda i: ours(inputs[i], v, out=outs[i]), list(range(len(inputs))))
        extra = {"impl": "gluon_ws" if spm.uses_gluon_ws(spm.TILES[v], x["q"].device, True)
                 else "triton"}
        if rec is not None and v in smd.TILES:  # the decode variant of the same name
            extra["gather_us"] = round(h.time_graph(lambda _: gather(rec, v), [None]), 3)
            rout = torch.empty_like(x["q"])
            extra["records_us"] = round(h.time_graph(lambda _: records_attn(rec, v, rout),
                                                     [None]), 3)
            del rout
        h.add("sparse_mla_prefill", v, shape, us, up_us, flops=flops,
              exact=None, max_abs_diff=max_abs_diff(got, ref), upstream_max_abs_diff=up_diff,
              rms_ratio=round(float(((got.float() - ref) ** 2).mean().sqrt()) / up_rms, 4)
              if up_rms else None,
              upstream_path_us=round(path_us, 3), **extra)
    del inputs, outs, rec
    torch.cuda.empty_cache()


def cases(quick: bool, part: str | None = None) -> list[tuple]:
    """(tokens, ctx, topk, ratio, heads) of the run; --quick: T 2048 at 64K, both layers,
    64 heads. ``part`` "i/n" (env DEEPINFER_SUITE_PART): the i-th of n slices of the full
    list, so a run that would outlast one device command can be split."""
    if quick:
        return [(2048, 64 << 10, topk, ratio, 64) for topk, ratio in LAYERS]
    full = [(t, c, topk, ratio, hd) for topk, ratio in LAYERS for hd in HEADS
            for c in CONTEXTS for t in TOKENS]
    if part:
        i, n = (int(x) for x in part.split("/"))
        if not 1 <= i <= n:
            raise ValueError(f"DEEPINFER_SUITE_PART={part!r}: expected i/n with 1 <= i <= n")
        full = full[i - 1::n]
    return full


def case_order(shape: dict) -> int:
    """Position of a row's shape in the full case list (benchmarks/merge_results.py puts
    the rows of split runs back in this order)."""
    key = tuple(shape[k] for k in ("tokens", "ctx", "topk", "ratio", "heads"))
    return cases(False).index(key)


def run(h: Harness) -> None:
    import os
    for case in cases(h.quick, os.environ.get("DEEPINFER_SUITE_PART")):
        _case(h, *case)
