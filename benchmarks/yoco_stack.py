"""The attention of every layer of DeepSeek-V4.1 (upstream's 40-layer topology) for one step,
with cross-layer metadata reuse (vllm.deepinfer.yoco) on and off.

A harness, not the model: what vLLM's Ampere attention classes run per layer
(overlay/vllm/deepinfer/attention/common.py ``_ampere_decode`` / ``_ampere_prefill``), mirrored
without vLLM and driven through the same ``yoco`` keys, over upstream's layout: 40 layers,
compress ratios 0 (layers 0-1), 2 (2-19) and 1 (20-39), KV sources 2, 8, 14, 20, index sources
2, 8, 14, 20, 24, 28, 32, 36 (``LAYOUT``). Per layer:

decode   the SWA window's ragged lists (upstream's ``build_ragged_indices_from_dense``: count
         kernel, cumsum, compact kernel), and for compressed layers upstream's
         ``_compute_global_topk_indices_and_lens_kernel`` then the same conversion of the
         global top-k; our ``sparse_mla_decode``.
prefill  (index sources) the indexer's K gather (a torch stand-in for vLLM's C++
         ``cp_gather_indexer_k_quant_cache``), our compressed gather (offset 0) and SWA gather
         (offset N), our combiner, upstream's bf16 prefill (dense -> ragged, then
         ``_sparse_attn_prefill_ragged_kernel``) and its inverse RoPE.

Reuse on: the products the yoco keys name are built by the first layer of their group; off:
by every layer (upstream's behaviour). The index sources' top-k (from their indexer, the same
either way and not timed here) is published into one shared buffer before their layer, as
their indexer does (a copy, in both modes).

Caches, block tables and inputs come from benchmarks/one_layer.py's ``Layer`` (one per KV
source, one for the SWA-only layers; every layer has its own SWA cache and queries). Used by
benchmarks/suites/yoco.py (H200) and tests/test_yoco_stack.py (CPU, interpreter, tiny sizes:
outputs identical with reuse on and off, launches counted).
"""
from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from pathlib import Path

import torch
import triton

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "overlay", REPO / "build", REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import one_layer as ol  # noqa: E402
from vllm.deepinfer import arch, kv_record, routing, yoco  # noqa: E402
from vllm.deepinfer.kernels import kv_gather as kvg  # noqa: E402
from vllm.deepinfer.kernels import sparse_mla_decode as smd  # noqa: E402
from vllm.deepinfer.kernels import topk_swa  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which layers own the compressed cache and the indexer (V4.1's config fields)."""
    ratios: tuple
    kv_sources: tuple
    index_sources: tuple

    def kv_source(self, layer: int) -> int | None:
        return None if self.ratios[layer] == 0 else max(s for s in self.kv_sources if s <= layer)

    def index_source(self, layer: int) -> int | None:
        return None if self.ratios[layer] == 0 else max(s for s in self.index_sources if s <= layer)


# Upstream's V4.1 layout (vllm/models/deepseek_v41: kv_source_layer_ids,
# index_source_layer_ids; ratios 0 / 2 / 1 as the illustrative config in tools/configs).
LAYOUT = Layout(ratios=(0, 0) + (2,) * 18 + (1,) * 20, kv_sources=(2, 8, 14, 20),
                index_sources=(2, 8, 14, 20, 24, 28, 32, 36))


def _up(name: str):
    return importlib.import_module(f"upstream_kernels.{name}")


def build_ragged(indices: torch.Tensor, lens: torch.Tensor, num_rows: int):
    """Upstream ``build_ragged_indices_from_dense`` (rocm_aiter_mla_sparse.py), host code
    mirrored: count kernel, cumsum, compact kernel. Returns (flat indices, indptr)."""
    up = _up("v41_sparse_prefill")
    ind = indices.reshape(indices.shape[0], -1)
    lens = lens.to(torch.int32).reshape(-1).contiguous()
    nq, width = ind.shape
    block = min(triton.next_power_of_2(width), 1024)
    counts = torch.empty(nq, dtype=torch.int32, device=ind.device)
    indptr = torch.empty(nq + 1, dtype=torch.int32, device=ind.device)
    block_r = max(1, 1024 // block)
    up._count_valid_row_entries_kernel[(triton.cdiv(nq, block_r),)](
        ind, lens, counts, indptr, ind.stride(0), int(num_rows), nq, width,
        BLOCK_R=block_r, BLOCK_W=block)
    torch.cumsum(counts, dim=0, out=indptr[1:])
    flat = torch.empty(nq * width, dtype=torch.int32, device=ind.device)
    up._compact_dense_row_to_ragged_kernel[(nq,)](
        ind, lens, indptr, flat, ind.stride(0), int(num_rows), width, BLOCK_W=block)
    return flat, indptr


def global_topk(local: torch.Tensor, req: torch.Tensor, bt: torch.Tensor, block_size: int,
                valid: torch.Tensor):
    """Upstream V4.1 ``compute_global_topk_indices_and_lens`` (host code mirrored)."""
    up = _up("v41_cache_utils")
    n = local.shape[0]
    out = torch.empty_like(local)
    lens = torch.empty(n, dtype=torch.int32, device=local.device)
    up._compute_global_topk_indices_and_lens_kernel[(n,)](
        out, out.stride(0), lens, local, local.stride(0), local.shape[-1], req, bt, bt.stride(0),
        block_size, valid, TRITON_BLOCK_SIZE=1024)
    return out, lens


class Stack:
    """Caches, inputs and metadata of every layer of ``layout`` for one step."""

    def __init__(self, spec: ol.Spec, ctx: tuple, q_lens: tuple, dev, variant: str,
                 layout: Layout = LAYOUT, seed: int = 0):
        self.spec, self.layout, self.variant, self.dev = spec, layout, variant, torch.device(dev)
        self.decode = all(q == 1 for q in q_lens)
        # One Layer per distinct (KV source, ratio) owner, and one for the SWA-only layers.
        owners = {None: ol.Layer(spec, ol.Step(0, ctx, q_lens), dev, seed)}
        for s in layout.kv_sources:
            owners[s] = ol.Layer(spec, ol.Step(layout.ratios[s], ctx, q_lens), dev, seed + 1 + s)
        for L in owners.values():
            L.fill_context(variant)
        self.owner = owners
        base = owners[None]
        self.T = base.T
        g = torch.Generator(device=self.dev).manual_seed(seed + 100)
        # One SWA geometry for every layer (vLLM builds one SWA metadata per step: one block
        # table, one set of window slots), each layer with its own copy of the cache.
        self.swa = [base.swa_cache.clone() for _ in layout.ratios]
        qshape = (self.T, spec.heads, ol.D)
        self.q = [torch.randn(qshape, generator=g, device=self.dev).to(torch.bfloat16)
                  if self.decode or i == 0 else None for i in range(len(layout.ratios))]
        # Each index source's local top-k rows (what its indexer publishes).
        self.local = {}
        for s in layout.index_sources:
            L = owners[layout.kv_source(s)]
            r = layout.ratios[s]
            avail = ((L.pos_new + 1) // r).clamp(min=1)
            rnd = torch.rand(self.T, spec.topk, generator=g, device=self.dev)
            cols = torch.arange(spec.topk, device=self.dev)[None, :]
            pick = (rnd * avail[:, None]).long()
            self.local[s] = torch.where(cols < avail[:, None], pick, -1).to(torch.int32)
        self.topk_buf = torch.full((self.T, spec.topk), -1, dtype=torch.int32, device=self.dev)
        self.req = base.req_new.to(torch.int32).contiguous()
        self.valid = torch.ones(self.T, dtype=torch.bool, device=self.dev)
        self.win_lens = torch.full((self.T,), spec.window, dtype=torch.int32, device=self.dev)
        self.comp_md = {s: types.SimpleNamespace(name=f"model.layers.{s}.attn")
                        for s in layout.kv_sources}
        if not self.decode:
            # vLLM's workspace: the widest chunk gather, and the indexer's K gather.
            rows = max(L.R * L.M for L in owners.values())
            self.ws = torch.empty(rows * ol.D, dtype=torch.bfloat16, device=self.dev)
            self.attn = torch.empty(self.T, spec.heads, ol.D, dtype=torch.bfloat16,
                                    device=self.dev)
            krows = max(int(owners[s].kg_slots.numel()) for s in layout.kv_sources)
            self.kg_ws = torch.empty(krows, 128, dtype=torch.uint8, device=self.dev)
        self.outs: list = [None] * len(layout.ratios)

    # ---- one step -------------------------------------------------------------------------
    def step(self, reuse: bool, keep: bool = False) -> types.SimpleNamespace:
        """Every layer's attention once; a new forward context (a fresh yoco cache). With
        ``keep`` each layer's output is kept (``self.outs``) for comparison."""
        fc = types.SimpleNamespace()
        step_md = types.SimpleNamespace()  # the step's SWA metadata object: one per step
        if not reuse:
            fc = None
        for i, r in enumerate(self.layout.ratios):
            if i in self.layout.index_sources:
                self.topk_buf.copy_(self.local[i])  # the index source publishes its top-k
            out = (self._decode if self.decode else self._prefill)(i, r, fc, step_md)
            if keep:
                self.outs[i] = out.clone()
        return fc

    def _decode(self, i, r, fc, step_md):
        s, v = self.spec, self.variant
        kv_src = self.layout.kv_source(i)
        L = self.owner[kv_src]
        swa = self.swa[i]
        rows = swa.shape[0] * swa.shape[1]
        main = yoco.reuse(fc, yoco.swa_ragged_key(step_md, rows),
                          lambda: build_ragged(self.owner[None].win_slots, self.win_lens, rows))
        extra = {}
        if r:
            crows = L.comp_cache.shape[0] * L.comp_cache.shape[1]
            key = yoco.decode_indices_key(self.layout.index_source(i), kv_src, r, step_md,
                                          self.comp_md[kv_src], self.T) + (crows,)

            def build():
                glob, lens = global_topk(self.topk_buf, self.req, L.comp_bt, s.comp_page,
                                         self.valid)
                return build_ragged(glob, lens, crows)
            ind, ptr = yoco.reuse(fc, key, build)
            extra = dict(extra_cache=L.comp_cache, extra_indices=ind, extra_indptr=ptr)
        return smd.sparse_attn_decode(self.q[i], swa, main[0], main[1], L.scale, L.sink,
                                      ol.NOPE, ol.ROPE, **extra, inv_rope_positions=L.pos_new,
                                      inv_rope_cos_sin_cache=L.cs, variant=v)

    def _prefill(self, i, r, fc, step_md):
        s, v = self.spec, self.variant
        kv_src = self.layout.kv_source(i)
        L = self.owner[kv_src]
        N, M = (L.N, L.M) if r else (0, L.M)
        chunk = (0, L.R, N, M)
        if i in self.layout.index_sources:
            self._indexer_k_gather(i, L, fc)
        key = None if not r else yoco.gather_key(kv_src, r, self.comp_md[kv_src], step_md, chunk)
        kv, have = yoco.prefill_kv(fc, key, L.R, M, ol.D, self.dev,
                                   lambda: self.ws[: L.R * M * ol.D].view(L.R, M, ol.D))
        if r and not have:
            kvg.dequantize_and_gather_k_cache(kv, L.comp_cache, L.seq_lens // r, None, L.comp_bt,
                                              s.comp_page, 0, variant=v)
            yoco.verify_gather(fc, kv, N)  # DEEPINFER_YOCO_VERIFY only
        base = self.owner[None]
        kvg.dequantize_and_gather_k_cache(kv, self.swa[i], base.seq_lens, base.gather_lens,
                                          base.swa_bt, s.swa_page, N, variant=v)
        topk = s.topk if r else 0
        ci, cl = yoco.reuse(
            fc, yoco.combine_key(self.layout.index_source(i), r, s.window, topk, step_md, chunk),
            lambda: topk_swa.combine_topk_swa_indices(self.topk_buf, L.qsl, L.seq_lens,
                                                      L.gather_lens, s.window, r, topk, M, N,
                                                      variant=v))
        self._attend(L, kv.view(-1, ol.D), ci, cl)
        return self.attn

    def _indexer_k_gather(self, i, L, fc):
        """Stand-in for vLLM's C++ K gather, through the yoco path patch 0041 adds."""
        codes, scales = kv_record.index_views(L.idx_cache)
        n = L.kg_slots.numel()
        ws_v = self.kg_ws[:n]
        ws_s = torch.empty(n, 4, dtype=torch.uint8, device=self.dev)

        def gather(vals, scl):
            vals.copy_(codes[L.kg_page, L.kg_row])
            scl.copy_(scales[L.kg_page, L.kg_row].view(torch.uint8).view(-1, 4))
        yoco.indexer_k_rows(fc, f"{self.comp_md[self.layout.kv_source(i)].name}.indexer.k_cache",
                            L, ws_v, ws_s, gather, gathers=True)

    def _attend(self, L, kv, ci, cl):
        """Upstream's bf16 prefill and inverse RoPE (one_layer.AmperePath's mirror)."""
        up = _up("v41_sparse_prefill")
        s = self.spec
        flat, indptr = build_ragged(ci, cl, kv.shape[0])
        q, out = self.q[0], self.attn
        H = q.shape[1]
        up._sparse_attn_prefill_ragged_kernel[(ci.shape[0], triton.cdiv(H, 16))](
            q, kv, flat, indptr, L.sink, out,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
            out.stride(0), out.stride(1), out.stride(2), H, ol.D, kv.shape[0], float(L.scale),
            HAS_ATTN_SINK=True, OUT_DV=out.shape[-1], BLOCK_H=16, BLOCK_D=512, BLOCK_K=16,
            num_warps=4)
        up._inverse_rope_gptj_kernel[(L.T, s.heads)](
            out, out, L.pos_new, L.cs, out.stride(0), out.stride(1), out.stride(0),
            out.stride(1), L.cs.stride(0), NOPE=ol.NOPE, HALF=ol.ROPE // 2,
            BLOCK_NOPE=triton.next_power_of_2(ol.NOPE), BLOCK_HALF=triton.next_power_of_2(ol.ROPE // 2))


def feature_on() -> bool:
    """yoco.reuse looks at the yoco_reuse feature; the stack passes no context when off."""
    routing.reset()
    return yoco.enabled()


__all__ = ["Layout", "LAYOUT", "Stack", "build_ragged", "global_topk", "feature_on", "arch"]
