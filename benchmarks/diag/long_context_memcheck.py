"""Every kernel of ``vllm.deepinfer`` on the Ampere path, launched once at long-context sizes,
for ``compute-sanitizer --tool memcheck`` (no 32-bit offset may wrap at any size vLLM accepts).

Usage (a CUDA machine; torch and Triton, no vLLM; overlay/ on PYTHONPATH):

    PYTHONPATH=overlay compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python benchmarks/diag/long_context_memcheck.py --out benchmarks/results/<gpu>-<date>-memcheck-<commit>.json
    python benchmarks/diag/long_context_memcheck.py --dry-run     # any machine: the plan only
    python benchmarks/diag/long_context_memcheck.py --toy --out F # CPU: toy sizes, interpreter

Groups of launches (one launch per kernel and shape, kernel-level calls of our launchers):

* ``prefill-300k``: one V4.1 ratio-1 layer's step of a 300K-token prompt, its last 131,072
  tokens (max_num_batched_tokens 131,072), 64 heads, top-k 512 + window 128: the compressed-KV
  insert and the index-K store, the indexer Q quant, V4's C4A compressor writers (head 512 and
  the indexer's 128), the two KV gathers (300,000 compressed rows, 131,199 SWA rows) into the
  [1, 431,200, 512] workspace, the top-k/SWA combiner, one chunk of the indexer's prefill
  logits (447 rows x 300,000 keys: vLLM's 512 MiB logits bound), the sparse MLA prefill over
  all 131,072 tokens, the inverse RoPE of its output, and the Engram lookup.
* ``decode-1m``: a 256-token decode step at 1M context for V4.1 ratio 1 and 2 and V4 C4A and
  C128A (top-k 512, C128A 8,192): the decode in the path the launcher picks (two phases on
  sm80) and in one phase, a 4-token decode that splits its keys (the reduce kernel), the
  indexer's paged logits over 1M / ratio keys, and the writers of the step.
* ``boundary``: each product that was 32-bit before it was fixed, just past 2^31 elements:
  the indexer Q quant at 262,145 tokens x 64 index heads, the one-phase decode at 32,769
  tokens x 128 heads (at 64 heads its bound, 65,536 tokens, lies past the 65,535 tokens one
  decode launch takes: CUDA's grid limit), the V4 compressor with 8,193 requests over a
  262,144-column state block table (the inverse RoPE's is inside ``prefill-300k``: 131,072
  rows x 64 heads).

Every KV cache of a group is a view of one pool of 6 GiB (the index-K caches of one of
3 GiB), pages placed at its top, so page offsets pass 2^31 bytes as in a cache of tens of
millions of tokens; V4's C128A pages are 141,696 bytes apart (vLLM's padded page, H200 e2e
run). Where cheap, a launch is followed by a spot check: the last rows recomputed by the same
launcher from compact copies of their inputs must come back with the same bits (``spot``:
true / false / null where none). ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` is set (before torch is
imported) so that every tensor is its own allocation and memcheck sees any access outside it.

Time: on the H200 at 94e0f91 (benchmarks/results/h200-2026-12-01-memcheck-94e0f91.json) the
three groups under memcheck took 50 s (boundary and decode-1m, Triton compiles included) and
32 s (prefill-300k, compiled kernels cached); allow a few minutes on a cold cache. GPU memory
(not measured): the prefill group holds about 30 GB at once (its q and output, 8.6 GB each,
and the 9 GiB of pools). ``--only GROUP`` runs one group.
``--variant`` picks the tile/fp8 variant (default sm80: the Ampere code paths; on an H200 these
are the sm_80-targeted kernels built for sm_90, not A100 figures). Results: one row per launch
``{kernel, group, shape, ok, spot, seconds, error}``; the exit status is 1 when a row failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")  # memcheck: one tensor, one allocation

# Kernel names of the rows (the launcher, and the path where one launcher has several).
KERNELS = (
    "fp8_writers_v41.rope_quant_insert", "fp8_writers_v41.indexer_k_store",
    "fp8_writers_v4.indexer_q", "fp8_writers_v4_compress.kv", "fp8_writers_v4_compress.indexer",
    "kv_gather", "topk_swa", "indexer_logits.mqa", "indexer_logits.paged", "sparse_mla_prefill",
    "inverse_rope", "engram_lookup", "sparse_mla_decode", "sparse_mla_decode.1p",
    "sparse_mla_decode.split",
)
INT32_MAX = 2 ** 31 - 1
NOPE, ROPE, D = 448, 64, 512
REC, IREC = 584, 132  # bytes per KV record, per index-K row


@dataclasses.dataclass(frozen=True)
class Sizes:
    heads: int = 64                 # attention heads per rank (V4.1/V4 at TP 1)
    index_heads: int = 64           # indexer heads
    window: int = 128               # SWA keys
    topk: int = 512                 # index top-k
    c128a_topk: int = 8192          # V4 C128A top-k at 1M context (1M / 128)
    prefill_tokens: int = 131072    # max_num_batched_tokens
    prefill_context: int = 300_000  # the prompt's length at the end of the step
    logits_rows: int = 447          # rows of one prefill logits chunk: 512 MiB / (4 B x 300K)
    decode_tokens: int = 256
    decode_context: int = 1 << 20
    split_tokens: int = 4           # a decode small enough to split its keys
    pool_bytes: int = 6 << 30       # the KV pool (584-byte records)
    index_pool_bytes: int = 3 << 30  # the index-K pool (132-byte rows)
    engram_rows: int = 4_500_000    # Engram table rows of 512 e4m3 bytes: 2.3 GB
    engram_heads: int = 8
    # Boundary launches: the first size past 2^31 of each product fixed to int64.
    b_indexer_tokens: int = 262_145       # x 64 heads x 128
    # x 128 heads x 512 (at 64 heads the bound, 65,536 tokens, is past the decode grid's
    # 65,535 tokens per launch: CUDA's grid z limit)
    b_decode_tokens: int = 32_769
    b_decode_heads: int = 128
    b_compress_reqs: int = 8_193          # x 262,144 block-table columns
    b_compress_cols: int = 262_144        # 1M positions / 4-token state pages


FULL = Sizes()
# CPU, Triton interpreter: every launch and spot check of the script at a few programs each.
TOY = Sizes(heads=16, index_heads=16, window=16, topk=32, c128a_topk=64, prefill_tokens=8,
            prefill_context=300, logits_rows=3, decode_tokens=4, decode_context=2048,
            split_tokens=2, pool_bytes=4 << 20, index_pool_bytes=1 << 20, engram_rows=300,
            engram_heads=2, b_indexer_tokens=3, b_decode_tokens=3, b_decode_heads=32,
            b_compress_reqs=3, b_compress_cols=64)


@dataclasses.dataclass
class Case:
    kernel: str
    group: str
    shape: dict
    run: Callable  # (ctx) -> True / False (spot check) or None


# ----------------------------------------------------------------------------- helpers
class Ctx:
    """Device, variant, a seeded generator and the group's pools (built on first use)."""

    def __init__(self, dev, variant: str, sz: Sizes):
        import torch
        self.torch, self.dev, self.variant, self.sz = torch, dev, variant, sz
        self.gen = torch.Generator(device=dev).manual_seed(0)
        self._pools: dict = {}

    def i32(self, x):
        return self.torch.as_tensor(x, dtype=self.torch.int32, device=self.dev)

    def i64(self, x):
        return self.torch.as_tensor(x, dtype=self.torch.int64, device=self.dev)

    def randn(self, *shape, dtype=None):
        return self.torch.randn(shape, device=self.dev, generator=self.gen,
                                dtype=dtype or self.torch.float32)

    def randint(self, lo, hi, *shape, dtype=None):
        t = self.torch.randint(lo, hi, shape, device=self.dev, generator=self.gen)
        return t if dtype is None else t.to(dtype)

    def codes(self, n: int):
        """Bytes 0x20..0x3f: finite e4m3 codes, UE8M0 bytes, bf16 halves and fp32 quarters."""
        return self.torch.randint(0x20, 0x40, (n,), dtype=self.torch.uint8, device=self.dev,
                                  generator=self.gen)

    def pool(self, name: str, nbytes: int):
        if name not in self._pools:
            self._pools[name] = self.codes(nbytes)
        return self._pools[name]

    def kv_cache(self, page: int, page_stride: int | None = None):
        """[blocks, page, 584] over the KV pool (page_stride bytes apart, default dense)."""
        stride = page_stride or page * REC
        pool = self.pool("kv", self.sz.pool_bytes)
        blocks = (pool.numel() - page * REC) // stride + 1
        return pool.as_strided((blocks, page, REC), (stride, REC, 1))

    def index_cache(self, page: int):
        pool = self.pool("index", self.sz.index_pool_bytes)
        blocks = pool.numel() // (page * IREC)
        return pool[: blocks * page * IREC].view(blocks, page, IREC)

    def cos_sin(self, positions: int):
        ang = self.torch.rand(positions, ROPE // 2, device=self.dev, generator=self.gen) * 6.3
        return self.torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()

    def top_pages(self, cache, n: int):
        """Block-table row of ``n`` pages: the cache's top pages, last first (page offsets
        past 2^31 bytes in a pool of several GiB)."""
        blocks = cache.shape[0]
        assert n <= blocks, f"pool too small: {n} pages asked, {blocks} there"
        return self.i32(list(range(blocks - 1, blocks - 1 - n, -1)))


def same_bits(a, b) -> bool:
    import torch
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def slots_of(bt_row, positions, page: int):
    return (bt_row[positions // page].long() * page + positions % page)


# ----------------------------------------------------------------------------- prefill
def _prefill_cases(sz: Sizes) -> list[Case]:
    T, H, ctx_len = sz.prefill_tokens, sz.heads, sz.prefill_context
    p0 = ctx_len - T  # first position of the step
    width = -(-(sz.topk + sz.window) // 128) * 128
    m = ctx_len + sz.window + T  # workspace rows: compressed, then the SWA run, then slack
    swa_gather = T + sz.window - 1
    page, swa_page = 64, 32
    g = "prefill-300k"

    def positions(c):
        return c.torch.arange(p0, ctx_len, device=c.dev)

    def rope_quant_insert(c):
        from vllm.deepinfer.kernels import fp8_writers_v41 as w
        cache = c.kv_cache(page)
        bt = c.top_pages(cache, -(-ctx_len // page))
        pos = positions(c)
        latent = c.randn(T, D, dtype=c.torch.bfloat16)
        cs = c.cos_sin(ctx_len)
        slots = slots_of(bt, pos, page)
        w.rope_quant_insert(latent, pos, cs, cache, slots, 1, variant=c.variant)
        small = c.torch.zeros(1, page, REC, dtype=c.torch.uint8, device=c.dev)
        w.rope_quant_insert(latent[-1:], pos[-1:], cs, small, slots[:1] * 0, 1, variant=c.variant)
        return _same_record(cache, int(slots[-1]), small, REC)

    def indexer_k_store(c):
        from vllm.deepinfer.kernels import fp8_writers_v41 as w
        cache = c.index_cache(page)
        bt = c.top_pages(cache, -(-ctx_len // page))
        pos = positions(c)
        k = c.randn(T, 128, dtype=c.torch.bfloat16)
        cs, nw = c.cos_sin(ctx_len), c.randn(128, dtype=c.torch.bfloat16)
        slots = slots_of(bt, pos, page)
        w.indexer_k_norm_rope_store(k, pos, cs, nw, 1e-6, cache, slots, 1, False,
                                    variant=c.variant)
        small = c.torch.zeros(1, page, IREC, dtype=c.torch.uint8, device=c.dev)
        w.indexer_k_norm_rope_store(k[-1:], pos[-1:], cs, nw, 1e-6, small, slots[:1] * 0, 1,
                                    False, variant=c.variant)
        return _same_record(cache, int(slots[-1]), small, IREC)

    def engram(c):
        from vllm.deepinfer.kernels.engram_lookup import engram_lookup
        rows, heads = sz.engram_rows, sz.engram_heads
        table = c.codes(rows * 512).view(rows, 512)
        scales = c.torch.full((rows, 16), 127, dtype=c.torch.uint8, device=c.dev)
        ids = rows - 1 - c.randint(0, min(1000, rows), T, heads)  # the table's last rows
        out = c.torch.empty(T * heads, 512, dtype=c.torch.bfloat16, device=c.dev)
        kw = dict(head_start=0, local_heads=heads, total_heads=heads, dim=512, quant_block=32,
                  sorted_rows=False, variant=c.variant)
        engram_lookup(table, scales, ids, ids, out, 0, rows, T * heads, grid=528, **kw)
        one = c.torch.empty(heads, 512, dtype=c.torch.bfloat16, device=c.dev)
        engram_lookup(table, scales, ids[-1:].contiguous(), ids, one, 0, rows, heads, grid=1,
                      **kw)
        return same_bits(out[-heads:], one)

    # Shared by the gather, combine, logits, prefill and inverse RoPE rows (built once).
    state: dict = {}

    def workspace(c):
        if "kv" not in state:
            state["kv"] = c.torch.empty(1, m, D, dtype=c.torch.bfloat16, device=c.dev)
        return state["kv"]

    def gather(c):
        from vllm.deepinfer import kv_record
        from vllm.deepinfer.kernels import kv_gather as kg
        kv = workspace(c)
        comp, swa = c.kv_cache(page), c.kv_cache(swa_page)
        bt_c = c.top_pages(comp, -(-ctx_len // page))[None]
        bt_s = c.top_pages(swa, -(-ctx_len // swa_page))[None]
        kg.dequantize_and_gather_k_cache(kv, comp, c.i32([ctx_len]), None, bt_c, page, 0,
                                         variant=c.variant)
        kg.dequantize_and_gather_k_cache(kv, swa, c.i32([ctx_len]), c.i32([swa_gather]), bt_s,
                                         swa_page, ctx_len, max_gather_len=swa_gather,
                                         variant=c.variant)
        last = c.torch.arange(ctx_len - 4, ctx_len, device=c.dev)
        ok = c.torch.equal(kv[0, ctx_len - 4: ctx_len].float(),
                           kv_record.read_rows(comp, slots_of(bt_c[0], last, page)))
        ok &= c.torch.equal(kv[0, ctx_len + swa_gather - 4: ctx_len + swa_gather].float(),
                            kv_record.read_rows(swa, slots_of(bt_s[0], last, swa_page)))
        return bool(ok)

    def combine(c):
        from vllm.deepinfer.kernels import topk_swa as ts
        tk = c.randint(0, ctx_len, T, sz.topk, dtype=c.torch.int32)
        args = (sz.window, 1, sz.topk, m, ctx_len)
        ci, cl = ts.combine_topk_swa_indices(tk, c.i32([0, T]), c.i32([ctx_len]),
                                             c.i32([swa_gather]), *args, variant=c.variant)
        state["indices"], state["lens"] = ci, cl
        ci1, cl1 = ts.combine_topk_swa_indices(tk[-1:], c.i32([T - 1, T]), c.i32([ctx_len]),
                                               c.i32([swa_gather]), *args, variant=c.variant)
        return same_bits(ci[-1:], ci1) and same_bits(cl[-1:], cl1)

    def logits(c):
        from vllm.deepinfer.kernels import indexer_logits as il
        R, Hi = sz.logits_rows, sz.index_heads
        q = c.codes(R * Hi * 128).view(R, Hi, 128)
        k, ks = c.codes(ctx_len * 128).view(ctx_len, 128), c.randn(ctx_len).abs()
        w = c.randn(R, Hi)
        ke = c.i32(list(range(ctx_len - R + 1, ctx_len + 1)))  # causal: the step's last rows
        zero = c.torch.zeros(R, dtype=c.torch.int32, device=c.dev)
        out = il.mqa_logits(q, k, ks, w, zero, ke, ctx_len, variant=c.variant)
        one = il.mqa_logits(q[-1:], k, ks, w[-1:], zero[-1:], ke[-1:], ctx_len, variant=c.variant)
        return same_bits(out[-1:], one)

    def prefill(c):
        from vllm.deepinfer.kernels import sparse_mla_prefill as spm
        if "indices" not in state:
            combine(c)
        if "kv" not in state:
            gather(c)
        kv = state["kv"].view(-1, D)
        q = c.randn(T, H, D, dtype=c.torch.bfloat16)
        sink = c.randn(H)
        out = c.torch.empty_like(q)
        scale = 1 / math.sqrt(D)
        spm.sparse_attn_prefill(q, kv, scale, sink, NOPE, ROPE, indices=state["indices"],
                                topk_length=state["lens"], out=out, variant=c.variant)
        one = spm.sparse_attn_prefill(q[-1:].clone(), kv, scale, sink, NOPE, ROPE,
                                      indices=state["indices"][-1:],
                                      topk_length=state["lens"][-1:], variant=c.variant)
        state["out"], state["positions"] = out, positions(c)
        del q
        return same_bits(out[-1:], one)

    def inverse_rope(c):
        from vllm.deepinfer.kernels.inverse_rope import inverse_rope_rows_
        out = state.pop("out", None)
        if out is None:
            out = c.randn(T, H, D, dtype=c.torch.bfloat16)
        pos, cs = positions(c), c.cos_sin(ctx_len)
        last = out[-2:].clone()
        inverse_rope_rows_(out, pos, cs, ROPE)
        inverse_rope_rows_(last, pos[-2:], cs, ROPE)
        state.clear()  # frees the workspace and the indices
        return same_bits(out[-2:], last)

    th = dict(tokens=T, heads=H)
    return [
        Case("fp8_writers_v41.rope_quant_insert", g,
             dict(tokens=T, cache_pages=page, context=ctx_len, pool_bytes=sz.pool_bytes),
             rope_quant_insert),
        Case("fp8_writers_v41.indexer_k_store", g,
             dict(tokens=T, cache_pages=page, context=ctx_len, pool_bytes=sz.index_pool_bytes),
             indexer_k_store),
        Case("fp8_writers_v4.indexer_q", g, dict(tokens=T, heads=sz.index_heads, dim=128),
             lambda c: _indexer_q(c, T)),
        Case("fp8_writers_v4_compress.kv", g, dict(tokens=T, ratio=4, head=512, context=ctx_len),
             lambda c: _compress(c, 512, T, ctx_len)),
        Case("fp8_writers_v4_compress.indexer", g,
             dict(tokens=T, ratio=4, head=128, context=ctx_len),
             lambda c: _compress(c, 128, T, ctx_len)),
        Case("kv_gather", g, dict(compressed_rows=ctx_len, swa_rows=swa_gather,
                                  workspace=[1, m, D]), gather),
        Case("topk_swa", g, dict(tokens=T, topk=sz.topk, window=sz.window, width=width), combine),
        Case("indexer_logits.mqa", g, dict(rows=sz.logits_rows, heads=sz.index_heads,
                                           keys=ctx_len), logits),
        Case("sparse_mla_prefill", g, dict(**th, keys=width, workspace_rows=m), prefill),
        Case("inverse_rope", g, dict(**th, max_offset=(T - 1) * H * D + (H - 1) * D + D - 1),
             inverse_rope),
        Case("engram_lookup", g, dict(tokens=T, heads=sz.engram_heads, table_rows=sz.engram_rows),
             engram),
    ]


def _indexer_q(c, T: int) -> bool:
    from vllm.deepinfer.kernels import fp8_writers_v4 as v4
    Hi = c.sz.index_heads
    q = c.randn(T, Hi, 128, dtype=c.torch.bfloat16)
    w = c.randn(T, Hi, dtype=c.torch.bfloat16)
    pos = c.randint(0, 4096, T)
    cs = c.cos_sin(4096)
    q8, w8 = v4.fused_indexer_q_rope_quant(pos, q, cs, w, 0.125, 0.5, variant=c.variant)
    q1, w1 = v4.fused_indexer_q_rope_quant(pos[-1:], q[-1:].clone(), cs, w[-1:].clone(), 0.125,
                                           0.5, variant=c.variant)
    return same_bits(q8[-1:], q1) and same_bits(w8[-1:], w1)


def _compress(c, head: int, T: int, ctx_len: int, *, reqs: int = 1, cols: int | None = None):
    """V4 C4A compressor writer (overlap on, 4-token state pages) for ``T`` tokens ending at
    ``ctx_len`` of one request, or (``reqs`` > 1) one group-closing token per request over a
    ``cols``-column state block table."""
    from vllm.deepinfer.kernels import fp8_writers_v4_compress as v4c
    torch = c.torch
    cr, sb = 4, 4
    coff = 2
    row = 2 * coff * head
    if reqs == 1:
        pos = torch.arange(ctx_len - T, ctx_len, device=c.dev)
        tok_req = torch.zeros(T, dtype=torch.int32, device=c.dev)
        # State pages only where the step's windows (T + 7 positions) read: the block
        # table's last columns.
        pages = (T + 8) // sb + 2
        cols = -(-ctx_len // sb)
        bt = torch.zeros(1, cols, dtype=torch.int32, device=c.dev)
        bt[0, cols - pages:] = torch.arange(pages, dtype=torch.int32, device=c.dev)
    else:
        T = reqs
        pos = torch.full((T,), 4 * cols - 1, dtype=torch.int64, device=c.dev)  # the last group
        tok_req = torch.arange(T, dtype=torch.int32, device=c.dev)
        pages = 2
        bt = torch.zeros(reqs, cols, dtype=torch.int32, device=c.dev)  # every row: pages 0/1
        bt[:, -2:] = torch.tensor([0, 1], dtype=torch.int32, device=c.dev)
    state = c.randn(pages, sb, row)
    if head == 512:
        cache, rb, layout = c.kv_cache(64), REC, (64, 576, 8)
    else:
        cache, rb, layout = c.index_cache(64), IREC, (128, 128, 4)
    boundary = (pos + 1) % cr == 0
    n_out = int(boundary.sum())
    top = cache.shape[0] * 64
    kv_slots = torch.full((T,), -1, dtype=torch.int64, device=c.dev)
    kv_slots[boundary] = top - 1 - torch.arange(n_out, device=c.dev)  # the cache's top rows
    cs = c.cos_sin(int(pos.max()) + 1)
    nw = c.randn(head, dtype=torch.bfloat16)

    def run(idx, kvc, slots):
        v4c.compress_norm_rope_store_triton(
            state, idx.numel(), tok_req[idx], pos[idx], torch.zeros_like(pos[idx]), bt, sb,
            row // 2, cs, kvc, SimpleNamespace(slot_mapping=slots), {}, head, ROPE, cr, True,
            False, nw, 1e-6, *layout, variant=c.variant)

    run(torch.arange(T, device=c.dev), cache, kv_slots)
    last = int(boundary.nonzero()[-1])
    small = torch.zeros(1, 64, rb, dtype=torch.uint8, device=c.dev)
    run(torch.tensor([last], device=c.dev), small, torch.zeros(1, dtype=torch.int64, device=c.dev))
    return _same_record(cache, int(kv_slots[last]), small, rb)


def _same_record(cache, slot: int, small, row_bytes: int) -> bool:
    """Whether record ``slot`` of the paged ``cache`` (a page: block_size value rows, then
    block_size scale rows) holds the bytes of record 0 of the one-page ``small``."""
    page = cache.shape[1]
    vb, sb = (576, 8) if row_bytes == REC else (128, 4)  # value bytes, scale bytes per row
    pg, r = cache[slot // page].reshape(-1), slot % page
    one = small.reshape(-1)
    return (same_bits(pg[r * vb: (r + 1) * vb], one[:vb])
            and same_bits(pg[page * vb + r * sb: page * vb + (r + 1) * sb],
                          one[page * vb: page * vb + sb]))


# ----------------------------------------------------------------------------- decode
# (name, compress ratio, top-k, SWA page, compressed page, compressed page stride in bytes
# (None: dense), index-K page (None: no indexer))
def _layers(sz: Sizes):
    return (("v41.c1", 1, sz.topk, 32, 64, None, 64), ("v41.c2", 2, sz.topk, 32, 64, None, 64),
            ("v4.c4a", 4, sz.topk, 64, 64, None, 64),
            ("v4.c128a", 128, sz.c128a_topk, 64, 2, 141_696 if sz is FULL else None, None))


def _decode(c, tokens, ratio, topk, swa_page, page, stride, *, predequant=None, splits=None,
            check=True, heads=None):
    """One decode launch of ``tokens`` tokens, window + top-k keys each, slots spread over
    the pool's top (the SWA cache's last window pages, the compressed cache's top 1M / ratio
    rows)."""
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    torch, sz = c.torch, c.sz
    H = heads or sz.heads
    swa, comp = c.kv_cache(swa_page), c.kv_cache(page, stride)
    swa_rows, comp_rows = swa.shape[0] * swa_page, comp.shape[0] * page
    span = min(comp_rows, sz.decode_context // ratio)
    mi = (swa_rows - 1 - c.randint(0, 4 * sz.window, tokens * sz.window)).to(torch.int32)
    ei = (comp_rows - 1 - c.randint(0, span, tokens * topk)).to(torch.int32)
    mp = torch.arange(0, tokens * sz.window + 1, sz.window, dtype=torch.int32, device=c.dev)
    ep = torch.arange(0, tokens * topk + 1, topk, dtype=torch.int32, device=c.dev)
    q = c.randn(tokens, H, D, dtype=torch.bfloat16)
    sink = c.randn(H)
    pos = sz.decode_context - 1 - c.randint(0, 1000, tokens)
    cs = c.cos_sin(sz.decode_context)
    kw = dict(inv_rope_cos_sin_cache=cs, variant=c.variant, predequant=predequant)
    out = smd.sparse_attn_decode(q, swa, mi, mp, 1 / math.sqrt(D), sink, NOPE, ROPE,
                                 extra_cache=comp, extra_indices=ei, extra_indptr=ep,
                                 inv_rope_positions=pos, num_kv_splits=splits, **kw)
    if not check:
        return None
    # The last token alone, same tile and split count as the launch took.
    name = smd.select_tile(c.variant, tokens, predequant)
    tile = smd.TILES[name]
    avg = (mi.numel() + ei.numel()) / tokens
    _, n_splits = smd.launch_plan(tokens, H, avg, tile, _sm_count(c), splits)
    one = smd.sparse_attn_decode(
        q[-1:].clone(), swa, mi[-sz.window:].clone(), mp[:2], 1 / math.sqrt(D), sink, NOPE, ROPE,
        extra_cache=comp, extra_indices=ei[-topk:].clone(), extra_indptr=ep[:2],
        inv_rope_positions=pos[-1:], num_kv_splits=n_splits,
        **dict(kw, predequant=tile.predequant))
    return same_bits(out[-1:], one)


def _sm_count(c) -> int:
    from vllm.deepinfer import arch
    return arch.sm_count(c.dev)


def _paged_logits(c, ratio: int, page: int) -> bool:
    from vllm.deepinfer.kernels import indexer_logits as il
    torch, sz = c.torch, c.sz
    B, Hi = sz.decode_tokens, sz.index_heads
    keys = sz.decode_context // ratio
    cache = c.index_cache(page)
    bt = c.top_pages(cache, -(-keys // page))[None].expand(B, -1).contiguous()
    q = c.codes(B * Hi * 128).view(B, 1, Hi, 128)
    w = c.randn(B, Hi)
    lens = torch.full((B,), keys, dtype=torch.int32, device=c.dev)
    out = il.paged_mqa_logits(q, cache, w, lens, bt, keys, variant=c.variant)
    one = il.paged_mqa_logits(q[-1:].clone(), cache, w[-1:].clone(), lens[-1:], bt[-1:], keys,
                              variant=c.variant)
    return same_bits(out[-1:], one)


def _decode_cases(sz: Sizes) -> list[Case]:
    g = "decode-1m"
    T, ctx = sz.decode_tokens, sz.decode_context
    cases: list[Case] = []
    for name, ratio, topk, swa_page, page, stride, ipage in _layers(sz):
        shape = dict(layer=name, tokens=T, heads=sz.heads, context=ctx, keys=sz.window + topk,
                     pages=[swa_page, page], page_stride=stride or page * REC)
        args = (ratio, topk, swa_page, page, stride)
        cases.append(Case("sparse_mla_decode", g, shape,
                          lambda c, a=args: _decode(c, T, *a)))
        cases.append(Case("sparse_mla_decode.1p", g, shape,
                          lambda c, a=args: _decode(c, T, *a, predequant=False)))
        cases.append(Case("sparse_mla_decode.split", g, dict(shape, tokens=sz.split_tokens),
                          lambda c, a=args: _decode(c, sz.split_tokens, *a)))
        if ipage is not None:
            cases.append(Case("indexer_logits.paged", g,
                              dict(layer=name, rows=T, heads=sz.index_heads, context=ctx,
                                   keys=ctx // ratio),
                              lambda c, r=ratio, p=ipage: _paged_logits(c, r, p)))
    cases.append(Case("fp8_writers_v4.indexer_q", g, dict(tokens=T, heads=sz.index_heads,
                                                          context=ctx),
                      lambda c: _indexer_q(c, T)))
    cases.append(Case("fp8_writers_v4_compress.kv", g, dict(tokens=T, ratio=4, head=512,
                                                            context=ctx),
                      lambda c: _compress(c, 512, T, ctx)))
    return cases


# ----------------------------------------------------------------------------- boundary
def _boundary_cases(sz: Sizes) -> list[Case]:
    g = "boundary"
    ti, td, rq, cols = sz.b_indexer_tokens, sz.b_decode_tokens, sz.b_compress_reqs, sz.b_compress_cols
    return [
        Case("fp8_writers_v4.indexer_q", g,
             dict(tokens=ti, heads=sz.index_heads, dim=128,
                  max_offset=(ti - 1) * sz.index_heads * 128 + sz.index_heads * 128 - 1),
             lambda c: _indexer_q(c, ti)),
        Case("sparse_mla_decode.1p", g,
             dict(tokens=td, heads=sz.b_decode_heads, keys=sz.window + sz.topk,
                  max_offset=(td - 1) * sz.b_decode_heads * D + sz.b_decode_heads * D - 1),
             lambda c: _decode(c, td, 1, sz.topk, 32, 64, None, predequant=False,
                               heads=sz.b_decode_heads)),
        Case("fp8_writers_v4_compress.kv", g,
             dict(requests=rq, block_table_cols=cols, max_offset=(rq - 1) * cols + cols - 1),
             lambda c: _compress(c, 512, 0, 0, reqs=rq, cols=cols)),
    ]


def plan(sz: Sizes, only: str | None = None) -> list[Case]:
    cases = _prefill_cases(sz) + _decode_cases(sz) + _boundary_cases(sz)
    return [c for c in cases if only is None or c.group == only]


# ----------------------------------------------------------------------------- main
def _commit() -> str:
    env = os.environ.get("DEEPINFER_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse",
                              "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON summary here")
    ap.add_argument("--dry-run", action="store_true", help="build the plan only (no tensors)")
    ap.add_argument("--toy", action="store_true",
                    help="toy sizes on CPU under the Triton interpreter (the script's own check)")
    ap.add_argument("--only", choices=("prefill-300k", "decode-1m", "boundary"))
    ap.add_argument("--variant", default=None, help="tile/fp8 variant (default sm80; cpu with --toy)")
    a = ap.parse_args(argv)
    sz = TOY if a.toy else FULL
    if a.toy:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    cases = plan(sz, a.only)
    meta = {"script": "benchmarks/diag/long_context_memcheck.py", "commit": _commit(),
            "date": datetime.date.today().isoformat(), "dry_run": a.dry_run, "toy": a.toy,
            "sizes": dataclasses.asdict(sz), "python": platform.python_version(),
            "PYTORCH_NO_CUDA_MEMORY_CACHING": os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING")}
    rows = []
    print(f"{'group':14s} {'kernel':36s} shape")
    if a.dry_run:
        for c in cases:
            print(f"{c.group:14s} {c.kernel:36s} {json.dumps(c.shape)}")
            rows.append(dict(kernel=c.kernel, group=c.group, shape=c.shape, ok=None, spot=None,
                             seconds=None, error=None))
    else:
        import torch
        dev = torch.device("cpu" if a.toy else "cuda")
        variant = a.variant or ("cpu" if a.toy else "sm80")
        meta.update(variant=variant, torch=torch.__version__,
                    gpu=None if a.toy else torch.cuda.get_device_name(dev))
        import triton
        meta["triton"] = triton.__version__
        ctx = Ctx(dev, variant, sz)
        group = None
        for c in cases:
            if c.group != group:  # pools are per group: free the last group's
                ctx, group = Ctx(dev, variant, sz), c.group
            t0 = time.perf_counter()
            row = dict(kernel=c.kernel, group=c.group, shape=c.shape, ok=False, spot=None,
                       seconds=None, error=None)
            try:
                row["spot"] = c.run(ctx)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                row["ok"] = row["spot"] is not False
            except Exception as e:  # one failing launch must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
            row["seconds"] = round(time.perf_counter() - t0, 3)
            print(f"{c.group:14s} {c.kernel:36s} {json.dumps(c.shape)} ok={row['ok']} "
                  f"spot={row['spot']} {row['seconds']} s", flush=True)
            rows.append(row)
            if a.out:  # after every row: a run stopped part way keeps what it did
                Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    if a.out:
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    bad = [r for r in rows if r["ok"] is False]
    print(f"{len(rows)} launches planned" if a.dry_run else
          f"{len(rows) - len(bad)} of {len(rows)} launches ok", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
