"""Unified 512-dim sparse MLA decode vs upstream vLLM 0.33.0's CUDA fallback decode.

Upstream: ``_sparse_attn_decode_ragged_kernel`` launched as ``_rocm_sparse_attn_decode_ragged_triton``
launches it off ROCm (grid (tokens, cdiv(heads, 16)), BLOCK_H 16, BLOCK_K 16 for a 512-dim
head, 8 warps, NOPE_BLOCK 512, OCP e4m3). Ours: ``sparse_attn_decode`` with the sm90 variant
(hardware e4m3, Hopper tile), the sm80 variant (software e4m3, the Ampere 48 KiB tile,
here run on Hopper) and sm80-2p (the same in two phases: keys dequantized once per token
into a bf16 workspace, then attended), the split count chosen by the kernel's own heuristic.
``python tools/a100_model.py annotate RESULTS.json`` adds the A100 predictions of the
Ampere rows afterwards (docs/a100-model.md).

Shapes: DeepSeek-V4.1 decode, top-k 512 compressed keys (extra cache, 64-token pages) +
SWA window 128 (main cache, 32-token pages), sink on, 64 and 128 heads, batches of 1, 4,
16, 64, 128 tokens; and a c128a-style 8192 + 128 case. Each token's slots are distinct rows
of its own cache region (top-k: a random subset of twice as many rows).

Row fields: ``flops`` = 2 * 2 * tokens * heads * keys * 512 (QK^T and PV); ``bytes`` = keys
* 584 per token + q + bf16 out; ``exact`` = ours bit-identical to upstream (not expected:
different tiling and exp2-domain softmax); ``max_abs_diff`` = ours vs an fp32 torch
reference computed on the GPU; extra fields ``upstream_max_abs_diff`` (upstream vs the same
reference), ``num_kv_splits``. Timing: each launch (ours: one or two kernels; upstream: one) is
captured in a CUDA graph, as vLLM runs decode, and its replays are timed with ``do_bench``
(median, L2 flushed before each call) over a ring of input copies: GPU time without the
Python launch overhead, which is ~100 us per eager call of ours on the H200.
"""
from __future__ import annotations

import importlib

import torch
import triton

from harness import Harness, bit_equal, max_abs_diff
from vllm.deepinfer import kv_record
from vllm.deepinfer.kernels import shapes
from vllm.deepinfer.kernels import sparse_mla_decode as smd
from vllm.deepinfer.kv_record import HEAD_DIM, NOPE_DIM, RECORD_BYTES, ROPE_DIM

# sm80-2p: the two-phase Ampere decode (dequantize each token's keys once, then attend);
# sm80-2p-h64 / -h32: the same with phase 2 as the Gluon kernel with 64 / 32 heads per
# program (Tile.gluon_heads).
OURS = ("sm90", "sm80", "sm80-2p", "sm80-2p-h64", "sm80-2p-h32")
# V4.1 pages as the measuring GPU (SM90) lays them out: SWA pages, compressed pages.
SWA_PAGE, COMP_PAGE = shapes.V41.swa_page, shapes.compressed_page("sm90")
WINDOW, TOPK = shapes.V41.window, shapes.V41.topk
BATCHES = (1, 4, 16, 64, 128)
C128A = dict(topk=shapes.by_name("v4.c128a").topk, batches=(1, 16, 64))


def pack_cache(k: torch.Tensor, page: int) -> torch.Tensor:
    """[n, 512] -> [ceil(n / page), page, 584] uint8 records (upstream's writer quantization);
    rows past n are zero records."""
    cache = kv_record.new_cache(-(-k.shape[0] // page), page, k.device)
    kv_record.insert_rows(cache, torch.arange(k.shape[0], device=k.device), k)
    return cache


def make_inputs(dev, tokens: int, heads: int, topk: int, window: int, seed: int = 0) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    region = 2 * topk  # each token's compressed rows
    k_main = torch.randn(tokens * window, HEAD_DIM, device=dev, generator=g)
    k_extra = torch.randn(tokens * region, HEAD_DIM, device=dev, generator=g)
    main = pack_cache(k_main, SWA_PAGE)
    extra = pack_cache(k_extra, COMP_PAGE)
    main_idx = torch.arange(tokens * window, device=dev, dtype=torch.int32)
    sel = torch.rand(tokens, region, device=dev, generator=g).argsort(dim=1)[:, :topk]
    extra_idx = (sel + torch.arange(tokens, device=dev)[:, None] * region).to(torch.int32).reshape(-1)
    return dict(
        q=(torch.randn(tokens, heads, HEAD_DIM, device=dev, generator=g)).to(torch.bfloat16),
        main_cache=main, main_indices=main_idx,
        main_indptr=torch.arange(tokens + 1, device=dev, dtype=torch.int32) * window,
        extra_cache=extra, extra_indices=extra_idx,
        extra_indptr=torch.arange(tokens + 1, device=dev, dtype=torch.int32) * topk,
        attn_sink=torch.randn(heads, device=dev, generator=g),
        scale=HEAD_DIM ** -0.5)


def reference(x: dict) -> torch.Tensor:
    """fp32 torch decode on the GPU (each token: its window rows then its top-k rows)."""
    q = x["q"].float()
    T, H, _ = q.shape
    km = kv_record.read_rows(x["main_cache"], x["main_indices"], scrub_nan=True).reshape(
        T, -1, HEAD_DIM)
    ke = kv_record.read_rows(x["extra_cache"], x["extra_indices"], scrub_nan=True).reshape(
        T, -1, HEAD_DIM)
    k = torch.cat([km, ke], 1)
    logits = torch.einsum("thd,tkd->thk", q, k) * x["scale"]
    logits = torch.cat([logits, x["attn_sink"].float()[None, :, None].expand(T, H, 1)], 2)
    p = torch.softmax(logits, dim=2)[..., :-1]
    return torch.einsum("thk,tkd->thd", p, k)


def ours(x: dict, variant: str, out=None, num_kv_splits=None) -> torch.Tensor:
    # Each row times the tile it names: "sm80" the single-phase path at every batch (by
    # default sm80 launches of smd.PREDEQUANT_MIN_TOKENS tokens or more run as "sm80-2p").
    return smd.sparse_attn_decode(
        x["q"], x["main_cache"], x["main_indices"], x["main_indptr"], x["scale"], x["attn_sink"],
        NOPE_DIM, ROPE_DIM, x["extra_cache"], x["extra_indices"], x["extra_indptr"], out=out,
        num_kv_splits=num_kv_splits, variant=variant,
        predequant=smd.TILES[variant].predequant)


def upstream(x: dict, out: torch.Tensor) -> torch.Tensor:
    up = importlib.import_module("upstream_kernels.mla_sparse_decode")
    q, mc, ec = x["q"], x["main_cache"], x["extra_cache"]
    T, H, _ = q.shape
    up._sparse_attn_decode_ragged_kernel[(T, triton.cdiv(H, 16))](
        q, mc, x["main_indices"], x["main_indptr"], ec, x["extra_indices"], x["extra_indptr"],
        x["attn_sink"], out, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        mc.stride(0), ec.stride(0), mc.shape[0] * mc.shape[1], ec.shape[0] * ec.shape[1],
        mc.shape[1], ec.shape[1], x["scale"], H,
        HAS_ATTN_SINK=True, HAS_EXTRA=True, NOPE_DIM=NOPE_DIM, NOPE_BLOCK=512, ROPE_DIM=ROPE_DIM,
        IS_FNUZ_MAIN=False, IS_FNUZ_EXTRA=False, BLOCK_H=16, BLOCK_K=16, num_warps=8)
    return out


def ring_inputs(h: Harness, tokens: int, heads: int, topk: int = TOPK,
                window: int = WINDOW) -> list[dict]:
    """Fresh random inputs, as many copies as the harness's ring needs (over twice the L2),
    at most 8; the sweeps in benchmarks/diag use the same."""
    per_copy = tokens * (window + 2 * topk) * RECORD_BYTES + tokens * heads * HEAD_DIM * 2
    return h.copies(lambda: make_inputs(h.dev, tokens, heads, topk, window,
                                        seed=torch.randint(0, 1 << 30, ()).item()), per_copy,
                    max_copies=8)


def _case(h: Harness, tokens: int, heads: int, topk: int, window: int) -> None:
    keys = topk + window
    shape = dict(tokens=tokens, heads=heads, topk=topk, window=window)
    flops = 2 * 2 * tokens * heads * keys * HEAD_DIM
    nbytes = tokens * keys * RECORD_BYTES + 2 * (2 * tokens * heads * HEAD_DIM)
    inputs = ring_inputs(h, tokens, heads, topk, window)
    x = inputs[0]
    ref = reference(x)
    out_up = upstream(x, torch.empty_like(x["q"]))
    up_diff = max_abs_diff(out_up, ref)
    outs = [torch.empty_like(xi["q"]) for xi in inputs]
    up_us = h.time_ring(_replay, [_graph(lambda i=i: upstream(inputs[i], outs[i]))
                                  for i in range(len(inputs))])
    for v in OURS:
        got = ours(x, v)
        _, splits = smd.launch_plan(tokens, heads, float(keys), smd.TILES[v], h.sm_count)
        us = h.time_ring(_replay, [_graph(lambda i=i, v=v: ours(inputs[i], v, out=outs[i]))
                                   for i in range(len(inputs))])
        h.add("sparse_mla_decode", v, shape, us, up_us, bytes=nbytes, flops=flops,
              exact=bit_equal(got, out_up), max_abs_diff=max_abs_diff(got, ref),
              upstream_max_abs_diff=up_diff, num_kv_splits=splits)
    del inputs, outs
    torch.cuda.empty_cache()


def _graph(fn) -> torch.cuda.CUDAGraph:
    """``fn`` (already compiled) captured in a CUDA graph, as vLLM runs decode."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _replay(g: torch.cuda.CUDAGraph) -> None:
    g.replay()


def run(h: Harness) -> None:
    batches = (1, 64) if h.quick else BATCHES
    for heads in (64, 128):
        for t in batches:
            _case(h, t, heads, TOPK, WINDOW)
    for t in ((16,) if h.quick else C128A["batches"]):
        _case(h, t, 64, C128A["topk"], WINDOW)
