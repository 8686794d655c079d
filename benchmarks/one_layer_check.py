"""Plain-torch side of the one-layer harness (benchmarks/one_layer.py): the per-stage
references and the checks with their tolerances, over the math of one_layer_math.py (written
independently of the kernels). It reads the layer and the path (one_layer_path.py) and is
imported by one_layer.py; it imports neither of those at run time (one_layer_path only for
type names), so the modules form no import circle.

Checks (``check``; each stage row carries ``ok``, ``max_abs_diff``, ``tol`` and extra errors):

* caches (swa_insert, compress_insert): every written record compared with records quantized
  in torch (fp32 RoPE, UE8M0 scale 2^ceil(log2(max(amax, 1e-4) / 448)), e4m3 round-to-nearest-
  even). NoPE code bytes and scale bytes must be identical; RoPE bf16 values within 1 bf16 ulp of the rotated pair's norm
  (2^-7 |ref|: the Triton interpreter truncates fp32->bf16 and Triton may contract a*c - b*s
  into an FMA; on the GPU they are expected bit-identical, ``mismatch_bytes`` says).
* index keys / index queries: dequantized values within one e4m3 step of the torch values
  (|d| <= 2^-3 |ref| + 2^-9 scale: the kernels round through bf16 twice, which the interpreter
  truncates), folded weights within 1e-6 relative; ``mismatch_bytes`` reported.
* indexer_logits: |d| <= 4e-3 * sum_h |w_h| |q_h . k| s_k + 1e-6 (fp32 accumulation order; one
  bf16 ulp of the terms' magnitude as slack), against torch logits computed from the bytes the
  path wrote (stage-local).
* indexer_topk: sets equal up to near-ties: an index in the symmetric difference must have a
  reference logit within the logits tolerance of the row's k-th largest reference value.
* kv_gather / combine: bit-identical to torch (exact e4m3 x 2^k products; combine's formula).
* attention (decode_attn; prefill_attn before and inv_rope after the inverse RoPE): the torch
  reference attends over the reference caches (torch-quantized records) at the top-k set the
  path chose, window rows [max(0, pos - W + 1), pos], sink in the denominator, then the inverse
  GPT-J RoPE: |d| <= 1e-3 + 1e-2 * sum_k p_k |v_k| per element (tests/test_sparse_mla_decode.py's
  bound; a rotated lane's magnitude is its pair's sum).
* o_proj: stage-local (fp32 o_proj of the path's attention rows) and ``final`` (the fp32 chain
  from the reference attention): relative Frobenius error <= 1e-2 and max |d| <= 2e-2 max|ref|
  (bf16 level: bf16 attention rows, bf16 wo_a, bf16 intermediate z).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from one_layer_math import (D, IDX_D, IDX_ROPE, NOPE, bf16_round, dequantize, e4m3_to_float,
                            quantize_idx, quantize_records, rms_norm, rope_gptj)
from vllm.deepinfer import kv_record

if TYPE_CHECKING:  # annotations only: one_layer_path imports nothing of this module
    from one_layer_path import AmperePath, Layer

# Tolerances per check, each derived in the module docstring.
TOL = dict(
    rope_rel=2.0 ** -7,
    idx_rel=2.0 ** -3, idx_sub=2.0 ** -9, weights_rel=1e-6,
    logits_rel=4e-3, logits_abs=1e-6,
    attn_abs=1e-3, attn_rel=1e-2,
    oproj_frob=1e-2, oproj_max=2e-2,
)


# ----------------------------------------------------------------------------- references
def reference_caches(L: Layer) -> dict:
    """Torch quantization of every row the path writes (setup and new tokens), fp32 math."""
    s, r = L.spec, L.step.ratio
    out = {}
    sw = (L.swa_slot_all >= 0).nonzero().flatten()
    x = rope_gptj(L.kv_all[sw].float(), L.pos_all[sw], L.cs)
    out["swa_ids"], out["swa_rec"] = sw, quantize_records(x)
    if r > 0:
        last = ((L.pos_all + 1) % r == 0).nonzero().flatten()
        grp = L.pos_all[last] // r * r
        x = rope_gptj(L.latent_all[last].float(), grp, L.cs)
        out["comp_ids"], out["comp_rec"] = last, quantize_records(x)
        k = bf16_round(rms_norm(L.k_pre_all[last].float(), L.k_norm_w, s.eps))
        k = bf16_round(rope_gptj(k, grp, L.cs))
        out["idx_codes"], out["idx_scale"] = quantize_idx(k)
        # Dequantized rows by (request, compressed position): global id comp_base[req] + c.
        gid = L.comp_base[L.req_all[last]] + L.pos_all[last] // r
        nc = int(L.nc_cpu.sum())
        rows = torch.zeros(nc, D, device=L.dev)
        rows[gid] = dequantize(out["comp_rec"])
        out["comp_rows"] = rows
    rows = torch.zeros(L.n_all, D, device=L.dev)  # SWA rows by global token id (tail only)
    rows[sw] = dequantize(out["swa_rec"])
    out["swa_rows"] = rows
    return out


def reference_q(L: Layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [T, IH, 128] uint8, scale [T, IH], folded weights [T, IH]) of the index queries."""
    s = L.spec
    x = L.iq.float()
    x = bf16_round(rope_gptj(x, L.pos_new, L.cs))
    x[..., :IDX_D - IDX_ROPE] = L.iq[..., :IDX_D - IDX_ROPE].float()
    codes, scale = quantize_idx(x)
    w = L.iw * scale * (IDX_D ** -0.5) * (s.idx_heads ** -0.5)
    return codes, scale, w


def reference_logits(L: Layer, q8: torch.Tensor, wout: torch.Tensor, idx_cache: torch.Tensor,
                     cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, cols], magnitude [T, cols]) from the given fp8 Q, folded weights and index-K
    cache (columns >= the row's length: -inf / 0). logit = sum_h w_h relu(q_h . k) s_k."""
    cp = L.spec.comp_page
    T = L.T
    q = e4m3_to_float(q8.view(torch.uint8) if q8.dtype != torch.uint8 else q8)  # [T, IH, 128]
    w = wout.float()
    logits = torch.full((T, cols), float("-inf"), device=L.dev)
    mag = torch.zeros(T, cols, device=L.dev)
    bt = L.comp_bt.long()
    for i in range(L.R):
        rows = (L.req_new == i).nonzero().flatten()
        if rows.numel() == 0:
            continue
        n = int(L.nc_cpu[i])
        c = torch.arange(n, device=L.dev)
        codes, ks = kv_record.read_index_rows(idx_cache, bt[i, c // cp] * cp + c % cp)
        k = e4m3_to_float(codes)
        for a in range(0, rows.numel(), 128):
            rr = rows[a:a + 128]
            sdot = torch.einsum("thd,jd->thj", q[rr], k)           # [t, IH, n]
            lg = (w[rr][:, :, None] * sdot.clamp(min=0)).sum(1) * ks[None, :]
            mg = (w[rr][:, :, None].abs() * sdot.abs()).sum(1) * ks[None, :]
            lens = L.idx_lens[rr].long()
            ok = c[None, :] < lens[:, None]
            logits[rr, :n] = torch.where(ok, lg, float("-inf"))
            mag[rr, :n] = torch.where(ok, mg, 0.0)
    return logits, mag


def reference_attention(L: Layer, ref: dict, topk_local: torch.Tensor | None,
                        chunk: int = 128) -> tuple[torch.Tensor, ...]:
    """(out fp32 [T, H, 512] after inverse RoPE, magnitude sum_k p_k |v_k| [T, H, 512], the same
    two before the inverse RoPE) over the
    reference caches: window rows [max(0, pos-W+1), pos] plus the compressed rows ``topk_local``
    chose (-1 skipped), sink in the softmax denominator."""
    s, r = L.spec, L.step.ratio
    T, H = L.T, s.heads
    out = torch.empty(T, H, D, device=L.dev)
    mag, out_pre, mag_pre = torch.empty_like(out), torch.empty_like(out), torch.empty_like(out)
    tb = L.tok_base.to(L.dev)
    for a in range(0, T, chunk):
        t = torch.arange(a, min(T, a + chunk), device=L.dev)
        req, wpos = L.req_new[t], L.win_pos[t]
        ok = wpos >= 0
        keys = ref["swa_rows"][(tb[req][:, None] + wpos.clamp(min=0))]
        if r > 0:
            tk = topk_local[t, :s.topk].long()
            ok = torch.cat([ok, tk >= 0], 1)
            keys = torch.cat([keys, ref["comp_rows"][L.comp_base[req][:, None] + tk.clamp(min=0)]], 1)
        keys = torch.where(ok[..., None], keys, 0.0)
        sc = torch.einsum("thd,tkd->thk", L.q[t].float(), keys) * L.scale
        sc = sc.masked_fill(~ok[:, None, :], float("-inf"))
        sc = torch.cat([sc, L.sink.float()[None, :, None].expand(len(t), H, 1)], 2)
        p = torch.softmax(sc, 2)[..., :-1]
        o = torch.einsum("thk,tkd->thd", p, keys)
        mg = torch.einsum("thk,tkd->thd", p, keys.abs())
        out[t] = rope_gptj(o, L.pos_new[t], L.cs, inverse=True)
        out_pre[t], mag_pre[t] = o, mg
        pair = mg[..., NOPE::2] + mg[..., NOPE + 1::2]  # a rotated lane mixes its pair
        mg[..., NOPE::2], mg[..., NOPE + 1::2] = pair, pair
        mag[t] = mg
    return out, mag, out_pre, mag_pre


def o_proj_ref(L: Layer, attn: torch.Tensor) -> torch.Tensor:
    s = L.spec
    z = torch.einsum("tgd,grd->tgr", attn.float().view(L.T, s.o_groups, -1), L.wo_a_f32)
    return z.flatten(1) @ L.wo_b.float().t()


# ----------------------------------------------------------------------------- checks
def _bytes_mismatch(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


def _rec_check(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Record bytes [n, 584]: NoPE codes + scale bytes identical, RoPE within 1 bf16 ulp."""
    data = kv_record.DATA_BYTES
    codes_scales_equal = torch.equal(got[:, :NOPE], ref[:, :NOPE]) and torch.equal(got[:, data:], ref[:, data:])
    gr = got[:, NOPE:data].contiguous().view(torch.bfloat16).float()
    rr = ref[:, NOPE:data].contiguous().view(torch.bfloat16).float()
    d = (gr - rr).abs()
    # One bf16 ulp of the rotated pair's norm (GPT-J pairs 2i, 2i+1): a rotation keeps the
    # norm, and an output that cancels (a*c - b*s small against a, b) carries the rounding
    # of its operands, up to ulp(|pair|), not ulp of its own small value.
    pair = rr.view(rr.shape[0], -1, 2).norm(dim=-1).repeat_interleave(2, dim=-1)
    rope_ok = bool((d <= TOL["rope_rel"] * torch.maximum(pair, gr.abs())).all())
    dg, dr = dequantize(got), dequantize(ref)
    return dict(ok=codes_scales_equal and rope_ok, exact=torch.equal(got, ref),
                mismatch_bytes=_bytes_mismatch(got, ref), rows=got.shape[0],
                max_abs_diff=float((dg - dr).abs().max()) if got.numel() else 0.0,
                nope_scale_bytes_equal=codes_scales_equal, rope_max_abs_diff=float(d.max()) if d.numel() else 0.0,
                tol="NoPE+scale bytes equal; RoPE |d| <= 2^-7 max(|pair|, |got|) (1 bf16 ulp of the rotated pair)")


def _idx_check(codes, scale, rcodes, rscale) -> dict:
    """fp8 rows with one power-of-two scale: dequantized |d| <= 2^-3 |ref| + 2^-9 scale_ref."""
    g = e4m3_to_float(codes) * scale[..., None]
    r = e4m3_to_float(rcodes) * rscale[..., None]
    d = (g - r).abs()
    bound = TOL["idx_rel"] * r.abs() + TOL["idx_sub"] * rscale[..., None]
    return dict(ok=bool((d <= bound).all()), exact=torch.equal(codes, rcodes) and torch.equal(scale, rscale),
                mismatch_bytes=_bytes_mismatch(codes, rcodes) + _bytes_mismatch(scale, rscale),
                max_abs_diff=float(d.max()) if d.numel() else 0.0,
                tol="|d| <= 2^-3 |ref| + 2^-9 scale (one e4m3 step)")


def _close(got: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, rel: float, abs_: float) -> dict:
    d = (got.float() - ref).abs()
    bound = abs_ + rel * mag
    finite = bool(torch.isfinite(got.float()).all())
    return dict(ok=finite and bool((d <= bound).all()), max_abs_diff=float(d.max()) if d.numel() else 0.0,
                max_excess=float((d - bound).max()) if d.numel() else 0.0,
                tol=f"|d| <= {abs_} + {rel} * magnitude")


def _oproj_close(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = got.float() - ref
    frob = float(d.norm() / ref.norm().clamp_min(1e-30))
    mx = float(d.abs().max())
    ok = bool(torch.isfinite(got.float()).all()) and frob <= TOL["oproj_frob"] and \
        mx <= TOL["oproj_max"] * float(ref.abs().max())
    return dict(ok=ok, max_abs_diff=mx, rel_frob=frob, ref_max=float(ref.abs().max()),
                tol=f"rel Frobenius <= {TOL['oproj_frob']}, max |d| <= {TOL['oproj_max']} max|ref|")


def _topk_check(sel: torch.Tensor, ref_logits: torch.Tensor, mag: torch.Tensor, lens: torch.Tensor,
                topk: int) -> dict:
    """Sets equal up to near-ties (see module doc)."""
    T, cols = ref_logits.shape
    k = min(topk, cols)
    rv, ri = ref_logits.topk(k, dim=1)
    sel, rv, ri, lens = sel.cpu(), rv.cpu(), ri.cpu(), lens.cpu()
    ref_logits, mag = ref_logits.cpu(), mag.cpu()
    n_sym = 0
    worst = 0.0
    ok = True
    for t in range(T):
        n = min(int(lens[t]), topk)
        got = set(x for x in sel[t].tolist() if x >= 0)
        want = set(ri[t, :n].tolist()) if n else set()
        if len(got) != n or any(x >= int(lens[t]) for x in got):
            ok = False
            continue
        diff = got ^ want
        if not diff:
            continue
        n_sym += len(diff)
        kth = float(rv[t, n - 1])
        idx = torch.tensor(sorted(diff))
        gap = (ref_logits[t, idx] - kth).abs()
        tol = TOL["logits_rel"] * mag[t, idx] + TOL["logits_abs"]
        worst = max(worst, float((gap - tol).max()))
        ok = ok and bool((gap <= tol).all())
    return dict(ok=ok, sym_diff=n_sym, max_excess=worst, max_abs_diff=None,
                tol="set equal; symmetric-difference entries within the logits tolerance of the k-th value")


def check(path: AmperePath, ref: dict | None = None) -> dict[str, dict]:
    """Run-once results of ``path`` (``path.run_for_check()`` done) against the torch references:
    {stage: {ok, max_abs_diff, tol, ...}} plus "final" (end-to-end o_proj)."""
    L = path.L
    s, r = L.spec, L.step.ratio
    ref = ref if ref is not None else reference_caches(L)
    res: dict[str, dict] = {}
    ids = ref["swa_ids"]
    got = kv_record.read_records(L.swa_cache, L.swa_slot_all[ids])
    res["swa_insert"] = _rec_check(got, ref["swa_rec"])
    if r > 0:
        ids = ref["comp_ids"]
        res["compress_insert"] = _rec_check(kv_record.read_records(L.comp_cache, L.comp_slot_all[ids]),
                                            ref["comp_rec"])
        codes, sc = kv_record.read_index_rows(L.idx_cache, L.comp_slot_all[ids])
        res["indexer_k_store"] = _idx_check(codes, sc, ref["idx_codes"], ref["idx_scale"])
        rq, rs, rw = reference_q(L)
        q8 = path.q8.view(torch.uint8)
        c = _idx_check(q8, rs, rq, rs)
        wd = (path.wout - rw).abs()
        c["weights_max_rel_diff"] = float((wd / rw.abs().clamp_min(1e-30)).max())
        c["ok"] = c["ok"] and bool((wd <= TOL["weights_rel"] * rw.abs()).all())
        c["exact"] = torch.equal(q8, rq) and torch.equal(path.wout, rw)
        c["tol"] += "; weights |d| <= 1e-6 |ref|"
        res["indexer_q_quant"] = c
        if not L.step.decode:
            codes, scales = kv_record.read_index_rows(L.idx_cache, L.kg_slots)
            same = torch.equal(path.kg_codes, codes) and torch.equal(
                path.kg_scales.view(torch.int32), scales.view(torch.int32))
            res["indexer_k_gather"] = dict(ok=same, exact=same, rows=int(codes.shape[0]),
                                           tol="bit-identical to the records at the slots")
        lg_ref, mag = reference_logits(L, path.q8, path.wout, L.idx_cache, L.logits_cols)
        ok = torch.arange(L.logits_cols, device=L.dev)[None, :] < L.idx_lens.long()[:, None]
        got_l = torch.where(ok, path.logits[:, :L.logits_cols].float(), 0.0)
        c = _close(got_l, torch.where(ok, lg_ref, 0.0), mag, TOL["logits_rel"], TOL["logits_abs"])
        res["indexer_logits"] = c
        res["indexer_topk"] = _topk_check(path.topk_local[:, :s.topk], lg_ref, mag, L.idx_lens, s.topk)
    tk = path.topk_local if r > 0 else None
    att_ref, att_mag, pre_ref, pre_mag = reference_attention(L, ref, tk)
    if L.step.decode:
        if r > 0:
            cp = s.comp_page
            t = path.topk_local[:, :s.topk].long()
            want = torch.where(t >= 0, L.comp_bt.long()[L.req_new[:, None], t.clamp(min=0) // cp] * cp
                               + t.clamp(min=0) % cp, -1)
            res["decode_indices"] = dict(ok=torch.equal(path.ext_idx.long(), want.reshape(-1)),
                                         max_abs_diff=None, tol="exact")
        res["decode_attn"] = _close(path.attn, att_ref, att_mag, TOL["attn_rel"], TOL["attn_abs"])
    else:
        res["kv_gather"] = _gather_check(path)
        res["combine"] = _combine_check(path)
        pre = getattr(path, "attn_pre", None)
        if pre is not None:
            res["prefill_attn"] = _close(pre, pre_ref, pre_mag, TOL["attn_rel"], TOL["attn_abs"])
        else:
            res["prefill_attn"] = dict(ok=None, max_abs_diff=None, tol="not checked: run_for_check "
                                       "keeps the rows before the in-place inverse RoPE")
        res["inv_rope"] = _close(path.attn, att_ref, att_mag, TOL["attn_rel"], TOL["attn_abs"])
    res["o_proj"] = _oproj_close(path.y, o_proj_ref(L, path.attn))
    res["final"] = _oproj_close(path.y, o_proj_ref(L, att_ref))
    return res


def _gather_check(path: AmperePath) -> dict:
    """The workspace against torch dequantization of the bytes in the caches."""
    L, s, r = path.L, path.L.spec, path.L.step.ratio
    bad = 0
    mx = 0.0
    for b in range(L.R):
        parts = []
        if r > 0:
            n = int(L.nc_cpu[b])
            c = torch.arange(n, device=L.dev)
            slots = L.comp_bt.long()[b, c // s.comp_page] * s.comp_page + c % s.comp_page
            parts.append((0, dequantize(kv_record.read_records(L.comp_cache, slots))))
        gl, sl = int(L.gather_lens_cpu[b]), int(L.seq_cpu[b])
        p = torch.arange(sl - gl, sl, device=L.dev)
        slots = L.swa_bt.long()[b, p // s.swa_page] * s.swa_page + p % s.swa_page
        parts.append((L.N, dequantize(kv_record.read_records(L.swa_cache, slots))))
        for off, rows in parts:
            got = path.ws[b, off:off + rows.shape[0]]
            want = rows.to(torch.bfloat16)
            bad += _bytes_mismatch(got, want)
            mx = max(mx, float((got.float() - want.float()).abs().max()) if rows.numel() else 0.0)
    return dict(ok=bad == 0, exact=bad == 0, mismatch_bytes=bad, max_abs_diff=mx, tol="bit-identical")


def _combine_check(path: AmperePath) -> dict:
    """Upstream V4.1 combine formula in torch (kernels/topk_swa.py module doc)."""
    L, s, r = path.L, path.L.spec, path.L.step.ratio
    W, topk = s.window, (s.topk if r > 0 else 0)
    b = L.req_new.long()
    pos = L.pos_new.long()
    sl, gl = L.seq_lens.long()[b], L.gather_lens.long()[b]
    n = ((pos + 1) // max(r, 1)).clamp(max=topk) if r > 0 else torch.zeros_like(pos)
    gstart = sl - gl
    start = torch.maximum(torch.maximum(pos - W + 1, torch.zeros_like(pos)), gstart)
    sw = (pos - start + 1).clamp(min=0)
    col = torch.arange(path.ci.shape[1], device=L.dev)[None, :]
    tk = path.topk_local.long()
    tkc = torch.gather(tk, 1, col.clamp(max=tk.shape[1] - 1).expand(L.T, -1))
    tkv = torch.where((tkc < 0) | (tkc >= L.N), -1, tkc + L.M * b[:, None])
    swv = L.M * b[:, None] + L.N + (start - gstart)[:, None] + (col - n[:, None])
    want = torch.where(col < n[:, None], tkv,
                       torch.where(col < (n + sw)[:, None], swv, -1)).to(torch.int32)
    lens = (n + sw).to(torch.int32)
    ok = torch.equal(want, path.ci) and torch.equal(lens, path.cl)
    return dict(ok=ok, exact=ok, max_abs_diff=None, tol="bit-identical")
