"""The indexer cases of tests/spec_decode_layer_probe.py: one decode step through upstream's
indexer builder and ``sparse_attn_indexer`` op (our logits through patch 0015, the padded
layout's Q through patch 0017), then the layer's decode on the top-k it wrote; CPU stand-ins
for the candidate-block kernels' CUDA assertion. Imports vLLM only inside functions."""
from __future__ import annotations

from spec_decode_common import (BLOCK_TABLE_WIDTH, Caches, Model, _positions, _q, build_md,
                                common_md, compare, init_sink, reference_out, run_layer,
                                tables)


def _candidate_ops_on_cpu() -> None:
    """CPU only: upstream's candidate-block selection and mask (model_executor/kernels/
    attention/dsa/candidate_blocks.py, Triton) assert ``logits.is_cuda`` before launching;
    the interpreter runs them on CPU tensors, so their logits go in as a Tensor subclass
    that says "CUDA" (the launches are upstream's, unchanged)."""
    import torch
    from vllm.model_executor.layers import sparse_attn_indexer as sai

    class SaysCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    for name in ("_apply_candidate_mask", "_select_candidate_blocks"):
        fn = getattr(sai, name)

        def wrapped(logits, *a, _fn=fn, **k):
            return _fn(logits.as_subclass(SaysCuda), *a, **k)
        setattr(sai, name, wrapped)


def index_cache(nb: int, entries: int, g, device):
    """A random valid index-K cache [nb, entries, 132]: e4m3 codes (no NaN codes), fp32
    scales of powers of two (candidate_logits_probe's)."""
    import torch
    from vllm.deepinfer import kv_record
    cache = kv_record.new_index_cache(nb, entries)
    codes = torch.randint(0, 256, (nb * entries, 128), generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
    scales = torch.exp2(torch.randint(-6, 3, (nb * entries,), generator=g).float())
    kv_record.write_index_rows(cache, torch.arange(nb * entries), codes, scales)
    return cache.to(device)


def _call_indexer(op, hidden, q, weights):
    """The indexer op as ``SparseAttnIndexer.forward_cuda`` calls it, through the Python
    function the custom op registers (its CUDA dispatch key takes no CPU tensors)."""
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    return sai.sparse_attn_indexer(
        hidden, sai._encode_layer_name(op.k_cache.prefix), op.k_cache.kv_cache, q, None,
        None, weights, op.quant_block_size, op.scale_fmt, op.topk_tokens, op.head_dim,
        op.max_model_len, op.max_total_seq_len, op.topk_indices_buffer,
        op.skip_k_cache_insert, op.use_pcp, op.pcp_shard_decode_requests,
        sai._encode_layer_name(op.dense_mha_metadata_layer_name), op.use_fp4_cache,
        op.dcp_rank, op.dcp_world_size, op._parallel_config.cp_kv_cache_interleave_size,
        False, candidate_blocks=op.candidate_blocks,
        candidate_block_size=op.candidate_block_size, candidate_write=op.candidate_write,
        topk_backend=op.topk_backend)


def _ref_logits(cache, bt_row, n_keys: int, q_t, w_t):
    """Plain-torch indexer logits of one token over its first ``n_keys`` compressed keys:
    scale_j * sum_h w[h] * relu(q[h] . k_j) (kernels/indexer_logits.py)."""
    import torch
    from vllm.deepinfer import kv_record
    entries = cache.shape[1]
    sl = torch.tensor([int(bt_row[j // entries]) * entries + j % entries for j in range(n_keys)],
                      dtype=torch.int64)
    codes, scales = kv_record.read_index_rows(cache, sl)
    k = codes.view(torch.float8_e4m3fn).float().cpu()
    q = q_t.view(torch.float8_e4m3fn).float().cpu()
    return scales.cpu() * (torch.relu(k @ q.T) * w_t.cpu()[None, :]).sum(1)


def indexer_step(model: str, k: int, reqs, real=False, device="cpu", seed=0) -> dict:
    """One decode step through the indexer: upstream's indexer builder picks the layout
    for this k (native next_n = 1 + k rows for next_n <= 2, flattened otherwise; padded
    through pack_seq, patch 0017, when a request holds fewer tokens: a CUDA graph's padding
    request (0, 0), whose padding tokens follow the real ones), upstream's op scores (our
    logits, patch 0015) and selects top-k, then the layer's decode reads the top-k. V4: the
    C4A layer (1); V4.1: the candidate source (2, writes candidate blocks) then its consumer
    (3, masked to them). ``reqs`` = [(seq_len, q_len)]. Every case draws the same caches and
    inputs for the same real requests (three request rows, real tokens first), so layouts
    can be compared bit for bit."""
    import hashlib

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers import indexer_topk
    g = torch.Generator().manual_seed(seed)
    v41 = model == "deepseek_v41"
    ids = [2, 3] if v41 else [1]
    method = "mtp" if k == 1 and not v41 else "dspark"
    m = Model(model, k, method, real, device, ids, g)
    for layer in m.layers.values():
        init_sink(layer, g)
    n_rows = 3
    c = Caches(m, n_rows, max(s for s, _ in reqs))
    owner = m.layers[ids[0]]
    kc = owner.indexer.k_cache
    ratio = owner.compress_ratio
    spec = kc.get_kv_cache_spec(m.vcfg)
    entries = spec.block_size // ratio
    max_keys = max(s for s, _ in reqs) // ratio + 1
    idx_bt, nb = tables(n_rows, -(-max_keys // entries), g)
    # vLLM's block table is as wide as the builder was told (block_table_width): the
    # columns past a request's pages hold 0.
    idx_bt = torch.nn.functional.pad(idx_bt, (0, BLOCK_TABLE_WIDTH - idx_bt.shape[1]))
    kc.kv_cache = index_cache(nb, entries, g, m.device)
    n = sum(q for _, q in reqs)
    # A padded batch holds every request's widest query: its padding rows follow.
    pad = len(reqs) * max(q for _, q in reqs) - n if any(q == 0 for _, q in reqs) else 0
    hidden = m.vcfg.model_config.hf_config.hidden_size
    heads = owner.indexer.n_head
    qcodes = torch.randint(0, 256, (n, heads, 128), generator=g, dtype=torch.int32)
    qcodes = torch.where((qcodes & 0x7F) == 0x7F, qcodes - 1, qcodes).to(torch.uint8)
    qcodes = torch.cat([qcodes, torch.zeros(pad, heads, 128, dtype=torch.uint8)])
    q = qcodes.view(torch.float8_e4m3fn).to(m.device)
    w = torch.cat([torch.randn(n, heads, generator=g, dtype=torch.float32),
                   torch.zeros(pad, heads)]).to(device=m.device, dtype=torch.float32)
    qa = {i: torch.cat([_q(m, m.layers[i], n), torch.zeros(pad, m.layers[i].padded_heads, 512,
                                                           device=m.device)])
          for i in ids}
    rows = list(range(len(reqs)))
    b, _ = m.builder(kc, "idx")
    cm = common_md(reqs, idx_bt[rows], spec.block_size, m.device, pad_tokens=pad)
    idx_md = b.build(0, cm)
    dec = idx_md.decode
    out = {"layout": {"use_flattening": bool(b.use_flattening),
                      "num_decodes": idx_md.num_decodes,
                      "num_decode_tokens": idx_md.num_decode_tokens,
                      "requires_padding": bool(dec.requires_padding),
                      "seq_lens_shape": list(dec.seq_lens.shape),
                      "decode_lens": dec.decode_lens.tolist()},
           "pad_tokens": pad}
    attn, _ = build_md(m, c, reqs, rows, pad_tokens=pad)
    attn[kc.prefix] = idx_md
    seen = []
    orig = indexer_topk.SparseIndexerTopk.forward

    def recording(self, logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len):
        ends = indexer_topk.SparseIndexerTopk._row_ends(seq_lens, next_n, logits.shape[0])
        seen.append({"logits": logits.detach().clone(), "ends": ends.tolist(),
                     "next_n": int(next_n)})
        return orig(self, logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len)
    indexer_topk.SparseIndexerTopk.forward = recording
    positions = _positions(reqs)
    # Token t -> its row in the layout the op scored: (request, offset) in the padded /
    # native [B, next_n] layout, t itself when flattened.
    tok_req = [r for r, (s, q) in enumerate(reqs) for _ in range(q)]
    tok_off = [j for s, q in reqs for j in range(q)]
    per_layer = {}

    def digest(t) -> str:
        return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy()
                              .tobytes()).hexdigest()[:16]
    try:
        for i in ids:
            layer = m.layers[i]
            m.topk_buf.fill_(-1)
            ctx = ForwardContext(no_compile_layers={}, attn_metadata=attn, slot_mapping={})
            with set_current_vllm_config(m.vcfg), override_forward_context(ctx):
                _call_indexer(layer.indexer.indexer_op,
                              torch.zeros(n + pad, hidden, device=m.device), q, w)
            rec = seen[-1]
            next_n = rec["next_n"]
            flat = next_n == 1 and rec["logits"].shape[0] >= n and not dec.requires_padding
            worst, mism, topk_ok, masked_ok, in_cand = 0.0, [], True, True, True
            rows_used, row_bits = [], []
            for t, p in enumerate(positions):
                r = t if flat else tok_req[t] * next_n + tok_off[t]
                rows_used.append(r)
                L = (p + 1) // ratio
                if rec["ends"][r] != L:
                    mism.append((t, rec["ends"][r], L))
                    continue
                ref = _ref_logits(kc.kv_cache, idx_bt[tok_req[t]], L, q[t], w[t])
                got = rec["logits"][r, :L].cpu()
                row_bits.append(digest(got))
                fin = got.isfinite()
                sel = m.topk_buf[t][m.topk_buf[t] >= 0].tolist()
                if v41 and i == 3:
                    # Candidate mask: finite exactly on the candidate blocks layer 2 wrote.
                    cand = set(m.cand_buf[r].tolist()) - {-1}
                    allowed = torch.tensor([j // layer.candidate_block_size in cand
                                            for j in range(L)])
                    masked_ok &= bool(torch.equal(fin, allowed))
                    in_cand &= all(j // layer.candidate_block_size in cand for j in sel)
                else:
                    masked_ok &= bool(fin.all())
                if fin.any():  # error against the row's largest logit (fp32 sums)
                    worst = max(worst, float((got[fin] - ref[fin]).abs().max()
                                             / ref[fin].abs().max().clamp_min(1e-30)))
                # The row's top-k: every key above the k-th value, then keys equal to it
                # (exact ties occur: e4m3 products times power-of-two scales).
                kk = min(m.topk_buf.shape[1], int(fin.sum()))
                vals = got.masked_fill(~fin, float("-inf"))
                kth = vals.topk(kk).values[-1] if kk else float("inf")
                above = set((vals > kth).nonzero().flatten().tolist())
                tied = set((vals == kth).nonzero().flatten().tolist())
                topk_ok &= (len(sel) == len(set(sel)) == kk and above <= set(sel)
                            and set(sel) <= above | tied)
            res = {"next_n": next_n, "rows": int(rec["logits"].shape[0]),
                   "rows_used": rows_used, "length_mismatch": mism,
                   "logits_err_vs_row_max": worst, "finite_where_expected": masked_ok,
                   "topk_is_the_rows_topk": topk_ok, "topk_within_candidates": in_cand,
                   "logits_rows_digest": row_bits, "topk_digest": digest(m.topk_buf[:n])}
            if v41 and i == 2:
                cb = layer.candidate_block_size
                pins = []
                for t, p in enumerate(positions):
                    row = set(m.cand_buf[rows_used[t]].tolist()) - {-1}
                    L = (p + 1) // ratio
                    pins.append((L - 1) // cb in row if L else True)
                res["newest_block_pinned"] = all(pins)
            # The decode reads the rows the indexer wrote (padding rows: no keys, zeros).
            pos_t = torch.tensor(positions + [0] * pad, dtype=torch.int64, device=m.device)
            o = run_layer(m, layer, attn, qa[i], pos_t)
            topk_rows = [m.topk_buf[t][m.topk_buf[t] >= 0].tolist() for t in range(n)]
            res["decode"] = compare(o[:n], reference_out(m, c, i, qa[i][:n], reqs, rows,
                                                         topk_rows, True))
            res["decode_pad_rows_zero"] = bool((o[n:] == 0).all())
            res["decode_digest"] = digest(o[:n])
            per_layer[str(i)] = res
    finally:
        indexer_topk.SparseIndexerTopk.forward = orig
    out["layers"] = per_layer
    out["positions"] = positions
    return out
