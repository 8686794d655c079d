"""The launches of benchmarks/diag/long_context_memcheck.py: each row's call of one of our
launchers at its planned size, and its spot check (the last rows launched again from compact
copies of their inputs, same bits). The script holds the plan (sizes, groups, shapes); this
module the tensors: a context with the seeded generator and the group's KV pools (Ctx), the
prefill step's launches, which share one workspace (prefill_launches), and the decode,
compressor and indexer launches the groups share. torch is imported by Ctx, Triton and the
overlay's kernels inside each launch: a --dry-run imports none of them."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Callable

NOPE, ROPE, D = 448, 64, 512  # the attention head: 448 dims without RoPE, 64 with
REC, IREC = 584, 132  # bytes per KV record, per index-K row


# ----------------------------------------------------------------------------- helpers
class Ctx:
    """Device, variant, a seeded generator and the group's pools (built on first use)."""

    def __init__(self, dev, variant: str, sz):
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
@dataclasses.dataclass(frozen=True)
class PrefillGeometry:
    """The prefill step's sizes derived from the plan's (a ``Sizes``): its tokens, heads and
    context, the combined top-k + SWA list's width, the workspace rows and the SWA run."""
    tokens: int
    heads: int
    context: int
    first: int           # first position of the step
    width: int           # combined index list: top-k + window, rounded up to 128
    workspace_rows: int  # compressed, then the SWA run, then slack
    swa_gather: int      # SWA rows gathered: the step's tokens and the window before them
    page: int = 64       # pages (tokens) of the compressed-KV and index-K caches
    swa_page: int = 32   # and of the SWA cache

    @classmethod
    def of(cls, sz) -> "PrefillGeometry":
        T, ctx_len = sz.prefill_tokens, sz.prefill_context
        return cls(tokens=T, heads=sz.heads, context=ctx_len, first=ctx_len - T,
                   width=-(-(sz.topk + sz.window) // 128) * 128,
                   workspace_rows=ctx_len + sz.window + T, swa_gather=T + sz.window - 1)


def prefill_launches(sz) -> dict[str, Callable]:
    """The prefill-300k group's own launches by name (each ``(ctx) -> spot``). The gather,
    combine, logits, prefill and inverse RoPE rows share the workspace, the combined indices
    and the prefill's output (built once; the inverse RoPE frees them)."""
    geo = PrefillGeometry.of(sz)
    T, H, ctx_len, p0 = geo.tokens, geo.heads, geo.context, geo.first
    m, swa_gather = geo.workspace_rows, geo.swa_gather
    page, swa_page = geo.page, geo.swa_page

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
        return same_record(cache, int(slots[-1]), small, REC)

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
        return same_record(cache, int(slots[-1]), small, IREC)

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

    return dict(rope_quant_insert=rope_quant_insert, indexer_k_store=indexer_k_store,
                gather=gather, combine=combine, logits=logits, prefill=prefill,
                inverse_rope=inverse_rope, engram=engram)


# ----------------------------------------------------------------------------- shared
def launch_indexer_q(c, T: int) -> bool:
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


def launch_compress(c, head: int, T: int, ctx_len: int, *, reqs: int = 1,
                    cols: int | None = None):
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
    return same_record(cache, int(kv_slots[last]), small, rb)


def same_record(cache, slot: int, small, row_bytes: int) -> bool:
    """Whether record ``slot`` of the paged ``cache`` (a page: block_size value rows, then
    block_size scale rows) holds the bytes of record 0 of the one-page ``small``."""
    page = cache.shape[1]
    vb, sb = (576, 8) if row_bytes == REC else (128, 4)  # value bytes, scale bytes per row
    pg, r = cache[slot // page].reshape(-1), slot % page
    one = small.reshape(-1)
    return (same_bits(pg[r * vb: (r + 1) * vb], one[:vb])
            and same_bits(pg[page * vb + r * sb: page * vb + (r + 1) * sb],
                          one[page * vb: page * vb + sb]))



def launch_decode(c, tokens, ratio, topk, swa_page, page, stride, *, predequant=None,
                  splits=None, check=True, heads=None):
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
    _, n_splits = smd.launch_plan(tokens, H, avg, tile, sm_count(c), splits)
    one = smd.sparse_attn_decode(
        q[-1:].clone(), swa, mi[-sz.window:].clone(), mp[:2], 1 / math.sqrt(D), sink, NOPE, ROPE,
        extra_cache=comp, extra_indices=ei[-topk:].clone(), extra_indptr=ep[:2],
        inv_rope_positions=pos[-1:], num_kv_splits=n_splits,
        **dict(kw, predequant=tile.predequant))
    return same_bits(out[-1:], one)


def sm_count(c) -> int:
    from vllm.deepinfer import arch
    return arch.sm_count(c.dev)


def launch_paged_logits(c, ratio: int, page: int) -> bool:
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

