"""The layer and the Ampere path of the one-layer harness: ``Spec`` (layer sizes), ``Step``
(one decode step or prefill chunk), ``Layer`` (random weights, inputs, caches, metadata; its
context rows written by the kernels in setup) and ``AmperePath`` (the timed stages as
closures over preallocated buffers). benchmarks/one_layer.py describes every stage and is the
module to import: it puts overlay/, build/ and benchmarks/ on sys.path first.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import torch
import torch.nn.functional as F
import triton

from one_layer_math import (D, FP8_MAX, IDX_D, NOPE, ROPE, compress_pool, cos_sin_cache,
                            dequant_wo_a)
from vllm.deepinfer import arch, kv_record
from vllm.deepinfer.kernels import fp8_writers_v4 as w4
from vllm.deepinfer.kernels import fp8_writers_v41 as w41
from vllm.deepinfer.kernels import indexer_logits as ilog
from vllm.deepinfer.kernels import kv_gather as kvg
from vllm.deepinfer.kernels import shapes
from vllm.deepinfer.kernels import sparse_mla_decode as smd
from vllm.deepinfer.kernels import sparse_mla_prefill as spm
from vllm.deepinfer.kernels import topk_swa


@dataclasses.dataclass(frozen=True)
class Spec:
    """Layer sizes. Defaults: DeepSeek-V4.1 (``kernels.shapes.V41``) with SM80 page sizes."""
    heads: int = shapes.V41.heads
    window: int = shapes.V41.window
    topk: int = shapes.V41.topk
    swa_page: int = shapes.SWA_PAGE
    comp_page: int = shapes.COMPRESSED_PAGE["sm80"]
    idx_heads: int = shapes.V41.index_heads
    hidden: int = shapes.V41.hidden
    o_groups: int = shapes.V41.o_groups
    o_rank: int = shapes.V41.o_rank
    max_pos: int = 1 << 16   # positions of the cos/sin cache: past every context run here
    eps: float = 1e-6        # RMSNorm epsilon of the compressor and index-key norms


REAL = Spec()


@dataclasses.dataclass(frozen=True)
class Step:
    """``ratio``: compress ratio of the layer; per request ``ctx`` cached tokens and ``q_lens``
    new tokens. ``decode``: all q_lens are 1 and the decode path runs; else the prefill path."""
    ratio: int
    ctx: tuple
    q_lens: tuple

    @property
    def decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    def shape(self) -> dict:
        kind = "decode" if self.decode else "prefill"
        ctx = self.ctx[0] if len(set(self.ctx)) == 1 else f"{min(self.ctx)}-{max(self.ctx)}"
        return dict(kind=kind, ratio=self.ratio, reqs=len(self.ctx), ctx=ctx,
                    tokens=sum(self.q_lens))


def _upstream_prefill():
    return importlib.import_module("upstream_kernels.v41_sparse_prefill")


# ----------------------------------------------------------------------------- the layer
class Layer:
    """Random weights, inputs, caches and metadata of one layer for one step."""

    def __init__(self, spec: Spec, step: Step, dev, seed: int = 0):
        self.spec, self.step, self.dev = spec, step, torch.device(dev)
        s, r = spec, step.ratio
        assert r in (0, 1, 2)
        g = torch.Generator(device="cpu").manual_seed(seed)
        gd = torch.Generator(device=self.dev).manual_seed(seed + 1)

        def randn(*shape, scale=1.0, dtype=torch.float32):
            return (torch.randn(*shape, device=self.dev, generator=gd) * scale).to(dtype)

        R = len(step.ctx)
        self.R = R
        ctx = torch.tensor(step.ctx, dtype=torch.int64)
        ql = torch.tensor(step.q_lens, dtype=torch.int64)
        seq = ctx + ql
        self.seq_cpu, self.ctx_cpu, self.ql_cpu = seq, ctx, ql
        # Every position of every request (position order), and the new tokens among them.
        base = torch.cat([torch.zeros(1, dtype=torch.int64), seq.cumsum(0)[:-1]])
        self.tok_base = base
        req_all = torch.repeat_interleave(torch.arange(R), seq)
        pos_all = torch.arange(int(seq.sum())) - base[req_all]
        new = pos_all >= ctx[req_all]
        self.n_all = int(seq.sum())
        self.new_ids = new.nonzero().flatten().to(self.dev)
        self.req_all, self.pos_all = req_all.to(self.dev), pos_all.to(self.dev)
        self.req_new = req_all[new].to(self.dev)
        self.pos_new = pos_all[new].to(self.dev)
        self.T = int(ql.sum())
        self.qsl = torch.cat([torch.zeros(1, dtype=torch.int64), ql.cumsum(0)]).to(torch.int32).to(self.dev)
        self.seq_lens = seq.to(torch.int32).to(self.dev)
        self.cs = cos_sin_cache(s.max_pos, self.dev)
        assert int(seq.max()) <= s.max_pos

        # ---- SWA cache: pages only for the window tail of each request (block 0: null page).
        W = s.window
        self.swa_first = (ctx - (W - 1)).clamp(min=0)  # first position any new token sees
        sp = s.swa_page
        nlog = -(-int(seq.max()) // sp)
        bt = torch.zeros(R, nlog, dtype=torch.int64)
        nxt = 1
        for i in range(R):
            b0, b1 = int(self.swa_first[i]) // sp, -(-int(seq[i]) // sp)
            bt[i, b0:b1] = torch.arange(nxt, nxt + b1 - b0)
            nxt += b1 - b0
        perm = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(nxt - 1, generator=g)])
        self.swa_bt = perm[bt].to(torch.int32).to(self.dev)
        self.swa_cache = kv_record.new_cache(nxt, sp, self.dev)
        in_swa = pos_all >= self.swa_first[req_all]
        swa_slot = torch.where(in_swa, perm[bt[req_all, pos_all // sp]] * sp + pos_all % sp,
                               torch.full_like(pos_all, -1))
        self.swa_slot_all = swa_slot.to(self.dev)
        self.kv_all = randn(self.n_all, D, dtype=torch.bfloat16)

        # ---- compressed + index-K caches (same block table), all compressed positions.
        self.comp_first = torch.zeros(R, dtype=torch.int64)
        if r > 0:
            cp = s.comp_page
            nc = seq // r
            self.nc_cpu = nc
            self.comp_base = torch.cat([torch.zeros(1, dtype=torch.int64), nc.cumsum(0)[:-1]]).to(self.dev)
            # Pages for every group a position can start, complete or not (with ratio 2
            # the last token may open a group whose record is written later).
            groups = -(-seq // r)
            nlog = max(1, -(-int(groups.max()) // cp))
            nblk = [-(-int(n) // cp) for n in groups]
            bt = torch.zeros(R, nlog, dtype=torch.int64)
            nxt = 1
            for i in range(R):
                bt[i, :nblk[i]] = torch.arange(nxt, nxt + nblk[i])
                nxt += nblk[i]
            perm = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(nxt - 1, generator=g)])
            self.comp_bt = perm[bt].to(torch.int32).to(self.dev)
            self.comp_cache = kv_record.new_cache(nxt, cp, self.dev)
            self.idx_cache = kv_record.new_index_cache(nxt, cp, self.dev)
            c_all = pos_all // r
            self.comp_slot_all = (perm[bt[req_all, c_all // cp]] * cp + c_all % cp).to(self.dev)
            self.kv_score_all = randn(self.n_all, D * (1 if r == 1 else 2))
            self.comp_norm_w = (1 + randn(D, scale=0.1)).to(torch.bfloat16)
            self.latent_all = compress_pool(self.kv_score_all, self.pos_all, r, self.comp_norm_w, s.eps)
            self.k_pre_all = randn(self.n_all, IDX_D, dtype=torch.bfloat16)
            self.k_norm_w = (1 + randn(IDX_D, scale=0.1)).to(torch.bfloat16)
            # Per new token: its causal compressed length and its request's block table row.
            self.idx_lens = ((self.pos_new + 1) // r).to(torch.int32)
            self.max_len = max(1, int(self.idx_lens.max()))
            self.logits_cols = -(-self.max_len // cp) * cp
            self.bt_rows = self.comp_bt[self.req_new].contiguous()
            if not step.decode:
                self._prefill_k_gather_plan(R)

        # ---- new-token inputs and weights.
        H, IH = s.heads, s.idx_heads
        T = self.T
        self.q = randn(T, H, D, dtype=torch.bfloat16)
        self.iq = randn(T, IH, IDX_D, dtype=torch.bfloat16)
        self.iw = randn(T, IH)
        self.sink = randn(H, scale=2.0)
        self.scale = D ** -0.5
        K = H * D // s.o_groups
        w = randn(s.o_groups * s.o_rank, K, scale=0.05)
        rb, cb = -(-w.shape[0] // 128), -(-K // 128)
        wp = F.pad(w, (0, cb * 128 - K, 0, rb * 128 - w.shape[0]))
        amax = wp.reshape(rb, 128, cb, 128).abs().amax((1, 3)).clamp_min(1e-12)
        self.wo_a_scale = amax / FP8_MAX
        s_full = self.wo_a_scale.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :K]
        self.wo_a_fp8 = (w / s_full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        self.wo_a_f32 = dequant_wo_a(self.wo_a_fp8, self.wo_a_scale, s.o_groups, s.o_rank)
        self.wo_a_bf16 = self.wo_a_f32.to(torch.bfloat16)   # cached once, as upstream
        self.wo_b = randn(s.hidden, s.o_groups * s.o_rank, scale=(s.o_groups * s.o_rank) ** -0.5,
                          dtype=torch.bfloat16)

        # ---- new-token slices (contiguous: what the kernels get).
        ids = self.new_ids
        self.kv_new = self.kv_all[ids].contiguous()
        self.swa_slot_new = self.swa_slot_all[ids].contiguous()
        if r > 0:
            self.latent_new = self.latent_all[ids].contiguous()
            self.k_pre_new = self.k_pre_all[ids].contiguous()
            self.comp_slot_new = self.comp_slot_all[ids].contiguous()

        # ---- step metadata (vLLM's builders): SWA window slots per new token (decode), the
        # prefill workspace geometry.
        pos = self.pos_new
        j = torch.arange(W, device=self.dev)
        wpos = pos[:, None] - (W - 1) + j[None, :]
        self.win_pos = wpos
        ok = wpos >= 0
        wp_ = wpos.clamp(min=0)
        swa_bt = self.swa_bt.long()
        slot = swa_bt[self.req_new[:, None], wp_ // sp] * sp + wp_ % sp
        self.win_slots = torch.where(ok, slot, -1).to(torch.int32)
        if step.decode:
            self.swa_idx = self.win_slots.reshape(-1).contiguous()
            self.swa_ptr = (torch.arange(T + 1, device=self.dev) * W).to(torch.int32)
            self.ext_ptr = (torch.arange(T + 1, device=self.dev) * s.topk).to(torch.int32)
        else:
            self.gather_lens_cpu = ql + ctx.clamp(max=W - 1)
            self.gather_lens = self.gather_lens_cpu.to(torch.int32).to(self.dev)
            self.N = int(self.nc_cpu.max()) if r > 0 else 0
            self.M = self.N + int(self.gather_lens_cpu.max())

    # ---- setup: the context's cache rows, written by the same kernels (untimed) ----------
    def fill_context(self, variant: str) -> None:
        s, r = self.spec, self.step.ratio
        old = (self.pos_all < self.step_ctx_all()).nonzero().flatten()
        o_swa = old[self.swa_slot_all[old] >= 0]
        if o_swa.numel():
            w41.rope_quant_insert(self.kv_all[o_swa].contiguous(), self.pos_all[o_swa].contiguous(),
                                  self.cs, self.swa_cache, self.swa_slot_all[o_swa].contiguous(), 1,
                                  variant=variant)
        if r > 0 and old.numel():
            w41.rope_quant_insert(self.latent_all[old].contiguous(), self.pos_all[old].contiguous(),
                                  self.cs, self.comp_cache, self.comp_slot_all[old].contiguous(), r,
                                  variant=variant)
            w41.indexer_k_norm_rope_store(self.k_pre_all[old].contiguous(), self.pos_all[old].contiguous(),
                                          self.cs, self.k_norm_w, s.eps, self.idx_cache,
                                          self.comp_slot_all[old].contiguous(), r, False,
                                          variant=variant)

    def step_ctx_all(self) -> torch.Tensor:
        return self.ctx_cpu.to(self.dev)[self.req_all]

    def _prefill_k_gather_plan(self, R: int) -> None:
        """What vLLM's prefill indexer gathers per chunk (``cp_gather_indexer_k_quant_cache``,
        a CUDA C++ op; a torch stand-in here): every compressed position a request's rows can
        see, request after request, as contiguous codes [N, 128] and fp32 scales [N]; row t
        then sees keys [ks[t], ks[t] + idx_lens[t]) of that buffer."""
        cp = self.spec.comp_page
        req, lens = self.req_new.cpu(), self.idx_lens.cpu()
        n = [int(lens[req == b].max()) if bool((req == b).any()) else 0 for b in range(R)]
        starts = [0]
        for x in n[:-1]:
            starts.append(starts[-1] + x)
        b_of = torch.cat([torch.full((x,), b, dtype=torch.int64) for b, x in enumerate(n)])
        c_of = torch.cat([torch.arange(x, dtype=torch.int64) for x in n])
        page = self.comp_bt.cpu().long()[b_of, c_of // cp]
        self.kg_slots = (page * cp + c_of % cp).to(self.dev)
        self.kg_page, self.kg_row = kv_record.slot_coords(self.kg_slots, cp)
        ks = torch.tensor(starts, dtype=torch.int32)[req.long()]
        self.kg_ks = ks.to(self.dev)
        self.kg_ke = (ks + lens).to(torch.int32).to(self.dev)


# ----------------------------------------------------------------------------- the Ampere path
PREFILL_IMPLS = ("upstream", "ours")


class AmperePath:
    """The stages of one step on one variant, as closures over preallocated buffers (CUDA-graph
    capturable: no host syncs). ``stages`` is the ordered list of (name, fn). ``prefill_impl``:
    whose kernel the ``prefill_attn`` stage runs (``PREFILL_IMPLS``)."""

    def __init__(self, L: Layer, variant: str, prefill_impl: str = "upstream"):
        if prefill_impl not in PREFILL_IMPLS:
            raise ValueError(f"prefill_impl: {prefill_impl!r} is not one of "
                             f"{', '.join(PREFILL_IMPLS)}")
        self.L, self.v, self.prefill_impl = L, variant, prefill_impl
        s, r, T = L.spec, L.step.ratio, L.T
        self.interp = arch.interpreting()
        self.attn = torch.empty(T, s.heads, D, dtype=torch.bfloat16, device=L.dev)
        self.topk_local = torch.full((T, max(s.topk, 4)), -1, dtype=torch.int32, device=L.dev)
        st: list[tuple[str, Callable[[], None]]] = [("swa_insert", self.swa_insert)]
        if r > 0:
            st += [("compress_insert", self.compress_insert), ("indexer_k_store", self.indexer_k_store),
                   ("indexer_q_quant", self.indexer_q_quant)]
            if not L.step.decode:
                st.append(("indexer_k_gather", self.indexer_k_gather))
            st += [("indexer_logits", self.indexer_logits), ("indexer_topk", self.indexer_topk)]
        if L.step.decode:
            if r > 0:
                st.append(("decode_indices", self.decode_indices))
                self.ext_idx = torch.empty(T * s.topk, dtype=torch.int32, device=L.dev)
            st.append(("decode_attn", self.decode_attn))
        else:
            self.ws = torch.empty(L.R, L.M, D, dtype=torch.bfloat16, device=L.dev)
            width = topk_swa.combined_width(s.topk if r > 0 else 0, s.window)
            self.ci = torch.empty(T, width, dtype=torch.int32, device=L.dev)
            self.cl = torch.empty(T, dtype=torch.int32, device=L.dev)
            st += [("kv_gather", self.kv_gather), ("combine", self.combine),
                   ("prefill_attn", self.prefill_attn), ("inv_rope", self.inv_rope)]
            if self.interp and prefill_impl == "upstream":
                self.attn32 = torch.empty(T, s.heads, D, dtype=torch.float32, device=L.dev)
        st.append(("o_proj", self.o_proj))
        self.stages = st

    def run(self) -> None:
        for _, fn in self.stages:
            fn()

    def run_for_check(self) -> None:
        """``run`` plus a copy of the prefill attention rows before the in-place inverse RoPE
        (so ``check`` can compare ``prefill_attn`` and ``inv_rope`` separately)."""
        for name, fn in self.stages:
            fn()
            if name == "prefill_attn":
                self.attn_pre = self._prefill_out().clone()

    def _prefill_out(self) -> torch.Tensor:
        """Where ``prefill_attn`` wrote (fp32 for upstream's kernel under the interpreter)."""
        return self.attn32 if self.interp and self.prefill_impl == "upstream" else self.attn

    # ---- stages -----------------------------------------------------------------------
    def swa_insert(self):
        L = self.L
        w41.rope_quant_insert(L.kv_new, L.pos_new, L.cs, L.swa_cache, L.swa_slot_new, 1,
                              variant=self.v)

    def compress_insert(self):
        L = self.L
        w41.rope_quant_insert(L.latent_new, L.pos_new, L.cs, L.comp_cache, L.comp_slot_new,
                              L.step.ratio, variant=self.v)

    def indexer_k_store(self):
        L = self.L
        w41.indexer_k_norm_rope_store(L.k_pre_new, L.pos_new, L.cs, L.k_norm_w, L.spec.eps,
                                      L.idx_cache, L.comp_slot_new, L.step.ratio, False,
                                      variant=self.v)

    def indexer_q_quant(self):
        L = self.L
        self.q8, self.wout = w4.fused_indexer_q_rope_quant(
            L.pos_new, L.iq, L.cs, L.iw, IDX_D ** -0.5, L.spec.idx_heads ** -0.5, variant=self.v)

    def indexer_logits(self):
        L = self.L
        T, IH = L.T, L.spec.idx_heads
        if L.step.decode:  # vLLM's decode: paged logits over the index-K cache
            self.logits = ilog.paged_mqa_logits(
                self.q8.view(T, 1, IH, IDX_D), L.idx_cache, self.wout, L.idx_lens, L.bt_rows,
                L.logits_cols, variant=self.v)
        else:  # vLLM's prefill: logits over the gathered keys, row t from column 0
            self.logits = ilog.mqa_logits(
                self.q8, self.kg_codes, self.kg_scales, self.wout, L.kg_ks, L.kg_ke,
                L.logits_cols, variant=self.v)

    def indexer_k_gather(self):
        L = self.L
        codes, scales = kv_record.index_views(L.idx_cache)
        self.kg_codes = codes[L.kg_page, L.kg_row]
        self.kg_scales = scales[L.kg_page, L.kg_row]

    def indexer_topk(self):
        L = self.L
        cols = self.logits.shape[1]
        valid = torch.arange(cols, device=L.dev)[None, :] < L.idx_lens[:, None]
        s = self.logits.masked_fill(~valid, float("-inf"))
        k = min(L.spec.topk, cols)
        vals, idx = s.topk(k, dim=1)
        self.topk_local[:, :k] = torch.where(vals == float("-inf"), -1, idx).to(torch.int32)

    def decode_indices(self):
        L = self.L
        cp = L.spec.comp_page
        tk = self.topk_local[:, :L.spec.topk].long()
        safe = tk.clamp(min=0)
        slot = L.comp_bt.long()[L.req_new[:, None], safe // cp] * cp + safe % cp
        self.ext_idx.copy_(torch.where(tk >= 0, slot, -1).reshape(-1))

    def decode_attn(self):
        L = self.L
        ex = {}
        if L.step.ratio > 0:
            ex = dict(extra_cache=L.comp_cache, extra_indices=self.ext_idx, extra_indptr=L.ext_ptr)
        smd.sparse_attn_decode(L.q, L.swa_cache, L.swa_idx, L.swa_ptr, L.scale, L.sink, NOPE, ROPE,
                               **ex, out=self.attn, inv_rope_positions=L.pos_new,
                               inv_rope_cos_sin_cache=L.cs, variant=self.v)

    def kv_gather(self):
        L, s = self.L, self.L.spec
        if L.step.ratio > 0:
            kvg.dequantize_and_gather_k_cache(self.ws, L.comp_cache, L.seq_lens // L.step.ratio, None,
                                              L.comp_bt, s.comp_page, 0, variant=self.v)
        kvg.dequantize_and_gather_k_cache(self.ws, L.swa_cache, L.seq_lens, L.gather_lens, L.swa_bt,
                                          s.swa_page, L.N, variant=self.v)

    def combine(self):
        L, s, r = self.L, self.L.spec, self.L.step.ratio
        topk_swa.combine_topk_swa_indices(self.topk_local, L.qsl, L.seq_lens, L.gather_lens,
                                          s.window, r, s.topk if r > 0 else 0, L.M, L.N,
                                          out=(self.ci, self.cl), variant=self.v)

    def prefill_attn(self):
        """Upstream ``_rocm_sparse_attn_prefill_triton`` (host code mirrored), or ours."""
        L = self.L
        if self.prefill_impl == "ours":
            spm.sparse_attn_prefill(L.q, self.ws.view(-1, D), L.scale, L.sink, NOPE, ROPE,
                                    indices=self.ci, topk_length=self.cl, out=self.attn,
                                    variant=self.v)
            return
        up = _upstream_prefill()
        kv = self.ws.view(-1, D)
        ind, lens = self.ci, self.cl
        nq, width = ind.shape
        num_rows = kv.shape[0]
        # build_ragged_indices_from_dense
        block = min(triton.next_power_of_2(width), 1024)
        counts = torch.empty(nq, dtype=torch.int32, device=L.dev)
        indptr = torch.empty(nq + 1, dtype=torch.int32, device=L.dev)
        block_r = max(1, 1024 // block)
        up._count_valid_row_entries_kernel[(triton.cdiv(nq, block_r),)](
            ind, lens, counts, indptr, ind.stride(0), int(num_rows), nq, width,
            BLOCK_R=block_r, BLOCK_W=block)
        torch.cumsum(counts, dim=0, out=indptr[1:])
        flat = torch.empty(nq * width, dtype=torch.int32, device=L.dev)
        up._compact_dense_row_to_ragged_kernel[(nq,)](
            ind, lens, indptr, flat, ind.stride(0), int(num_rows), width, BLOCK_W=block)
        # _rocm_sparse_attn_prefill_ragged_triton
        q, out = L.q, self.attn
        if self.interp:  # bf16 tl.dot is wrong under the interpreter: fp32 copies, fp32 out
            q, kv, out = q.float(), kv.float(), self.attn32
        H = q.shape[1]
        up._sparse_attn_prefill_ragged_kernel[(nq, triton.cdiv(H, 16))](
            q, kv, flat, indptr, L.sink, out,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
            out.stride(0), out.stride(1), out.stride(2), H, D, kv.shape[0], float(L.scale),
            HAS_ATTN_SINK=True, OUT_DV=out.shape[-1], BLOCK_H=16, BLOCK_D=512, BLOCK_K=16,
            num_warps=4)

    def inv_rope(self):
        """Upstream ``rocm_inverse_rope_rows_`` -> ``_fused_inverse_rope_gptj(o, ..., out=o)``."""
        up = _upstream_prefill()
        L = self.L
        o = self._prefill_out()
        out = self.attn
        up._inverse_rope_gptj_kernel[(L.T, L.spec.heads)](
            o, out, L.pos_new, L.cs, o.stride(0), o.stride(1), out.stride(0), out.stride(1),
            L.cs.stride(0), NOPE=NOPE, HALF=ROPE // 2, BLOCK_NOPE=triton.next_power_of_2(NOPE),
            BLOCK_HALF=triton.next_power_of_2(ROPE // 2))

    def o_proj(self):
        L, s = self.L, self.L.spec
        z = torch.einsum("tgd,grd->tgr", self.attn.view(L.T, s.o_groups, -1), L.wo_a_bf16)
        self.y = F.linear(z.flatten(1), L.wo_b)
