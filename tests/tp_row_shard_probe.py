"""The prefill indexer's rows sharded over TP ranks (vLLM 0.33.0's PrefillRowShard, patched
tree), on CPU. Run by tests/test_tp_row_shard.py in a subprocess:

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched \
        python tests/tp_row_shard_probe.py

``sparse_attn_indexer`` (model_executor/layers/sparse_attn_indexer.py) scores a prefill chunk's
rows, ranks each row's top-k into ``topk_indices_buffer`` and, when the metadata builder gave
``row_shard_sizes``, scores on each TP rank only ``PrefillRowShard.narrow``'s rows, then
``exchange_topk`` all-gathers every rank's final indices into global row order. The loop
body is replayed here through upstream's own functions, per rank in turn:

* the chunks: ``DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks`` and
  ``build_prefill_chunk_metadata`` (its Triton kernel under the interpreter), a small logits
  budget so requests are split into query sub-chunks;
* the row shard sizes: ``balanced_prefill_row_shard`` (TP 2, 4, 8) and hand-chosen uneven
  ones; ``PrefillRowShard.from_metadata`` / ``narrow`` / ``exchange_topk``;
* the logits: ``vllm.utils.deep_gemm.fp8_fp4_mqa_logits`` as the indexer calls it (patch
  0015 answers it with vllm.deepinfer.kernels.indexer_logits, the Ampere path's scorer, under
  the interpreter) after ``mqa_logits_mx_inputs`` and through ``as_fp32_logits``; and,
  separately, upstream's torch reference ``fp8_mqa_logits_torch``
  (v1/attention/ops/rocm_aiter_mla_sparse.py), row by row, converted to the same compressed
  layout;
* the top-k: a stand-in for the CUDA op ``top_k_per_row_prefill`` (not built for CPU): per
  row, every key when a row has at most k, else a stable descending sort's first k (ties to
  the lower column); the gathered K: a stand-in for ``cp_gather_indexer_k_quant_cache``
  (each request's compressed keys, concatenated in chunk order);
* the all-gather: ``get_tp_group().all_gatherv`` emulated by threads, one per rank, meeting
  at a barrier (no NCCL); a control gathers in reversed rank order.

One JSON object on the last stdout line: per case and scorer, per row-shard layout, whether
every rank's buffer after the exchange equals the unsharded buffer bit for bit, the rows each
rank scored, and the control's result. Not collected by pytest.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

HEADS, DIM, TOPK = 8, 128, 16
# (name, compress ratio, decode tokens before the prefill rows, prefill query lengths,
#  context before each prefill, logits budget in elements)
CASES = (
    ("ratio2", 2, 2, (37, 5, 56, 11), (60, 0, 100, 12), 1500),
    ("ratio1", 1, 0, (20, 33), (0, 40), 900),
    ("ratio4", 4, 3, (64, 7), (300, 9), 1200),
)


def _codes(shape, g):
    import torch
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)   # no NaN codes (the writers never emit them)
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def make_case(ratio, n_dec, qlens, ctx, seed):
    """Inputs of one step: n_dec one-token decode requests, then the prefill requests."""
    import torch
    g = torch.Generator().manual_seed(seed)
    dec_seq = [17 + 5 * i for i in range(n_dec)]
    q_all = [1] * n_dec + list(qlens)
    seq = dec_seq + [c + q for c, q in zip(ctx, qlens)]
    qsl = torch.tensor([0] + q_all, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_t = torch.tensor(seq, dtype=torch.int32)
    comp = seq_t // ratio if ratio > 1 else seq_t
    tokens = int(qsl[-1])
    keys = [(_codes((int(n), DIM), g),
             torch.exp2(torch.randint(-8, 4, (int(n),), generator=g).to(torch.float32)))
            for n in comp.tolist()]
    q = _codes((tokens, HEADS, DIM), g)
    w = torch.randn(tokens, HEADS, generator=g, dtype=torch.float32)
    # Exact duplicate keys (codes and scale), so rows have tied logits the top-k must order:
    # every key from the 9th on repeats one of the first 8 or is new, alternately.
    for kq, sc in keys:
        dup = torch.arange(8, max(8, kq.shape[0]), 2)
        kq[dup], sc[dup] = kq[dup % 8], sc[dup % 8]
    return dict(ratio=ratio, n_dec=n_dec, qsl=qsl, seq=seq_t, comp=comp, keys=keys, q=q, w=w,
                tokens=tokens)


def chunks(case, logits_budget):
    """The step's prefill chunks as upstream's builder makes them."""
    import torch
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerMetadataBuilder, build_prefill_chunk_metadata)
    nd = case["n_dec"]
    qlens = torch.diff(case["qsl"][nd:])
    specs = DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks(
        case["comp"][nd:], qlens, 1 << 20, logits_budget * 4, request_offset=nd)
    table = torch.zeros(len(case["seq"]), 4, dtype=torch.int32)
    out = []
    for req, qs in specs:
        md = build_prefill_chunk_metadata(
            req.start, req.stop, case["qsl"], case["qsl"], case["seq"], case["comp"],
            case["comp"], table, case["ratio"], query_slice=qs,
            skip_kv_gather=qs.start > 0)
        if md is not None:
            out.append(md)
    return out


def gathered_keys(case, chunk):
    """cp_gather_indexer_k_quant_cache's result for the chunk: its requests' compressed keys
    in order (rows [cu_seq_lens[i], cu_seq_lens[i + 1]) are request i's)."""
    import torch
    first = int(torch.searchsorted(case["qsl"], torch.tensor(chunk.token_start), right=True)) - 1
    reqs = range(first, first + chunk.num_reqs)
    kq = torch.cat([case["keys"][r][0] for r in reqs])
    ks = torch.cat([case["keys"][r][1] for r in reqs])
    assert kq.shape[0] == chunk.total_seq_lens
    return kq, ks


def topk_standin(logits, row_ends, out, k):
    """top_k_per_row_prefill with row starts 0: per row its first row_end columns."""
    import torch
    out.fill_(-1)
    for r in range(logits.shape[0]):
        n = int(row_ends[r])
        if n <= k:
            sel = torch.arange(n)
        else:
            sel = torch.sort(logits[r, :n], descending=True, stable=True).indices[:k]
        out[r, :sel.numel()] = sel.to(torch.int32)


def logits_ours(q, kq, kscale, w, ks, ke, max_k):
    from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
    from vllm.utils.deep_gemm import fp8_fp4_mqa_logits, mqa_logits_mx_inputs
    q_scale, w = mqa_logits_mx_inputs(q, None, w)
    return as_fp32_logits(fp8_fp4_mqa_logits((q, q_scale), (kq, kscale), w, ks, ke, max_k),
                          ke - ks)


def logits_reference(q, kq, kscale, w, ks, ke, max_k):
    """Upstream's fp8_mqa_logits_torch ([M, N] by key position), as compressed rows, one row
    per call: batched, its bf16 einsum on CPU gives a row bits that depend on the rows
    computed with it (a property of the reference, not of the sharding), so a row's logits
    must come from a call of that row alone for the comparison to be about the sharding."""
    import torch
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_mqa_logits_torch
    rows = [fp8_mqa_logits_torch(q[i:i + 1], (kq, kscale), w[i:i + 1], ks[i:i + 1],
                                 ke[i:i + 1]) for i in range(q.shape[0])]
    full = torch.cat(rows) if rows else torch.empty(0, kq.shape[0])
    cols = ks.to(torch.int64)[:, None] + torch.arange(max_k)[None, :]
    valid = cols < ke.to(torch.int64)[:, None]
    out = torch.gather(full, 1, cols.clamp_max(max(full.shape[1] - 1, 0)))
    return out.masked_fill(~valid, float("-inf"))


SCORERS = {"ours": logits_ours, "reference": logits_reference}


def score(case, chs, scorer, buf, shard=None, scored=None, ties=None):
    """sparse_attn_indexer's prefill loop body (CUDA path, no candidates, no DCP) on one
    rank: narrow to the shard's rows, score, top-k into ``buf``. ``ties``: a list that gets
    the rows whose k-th and (k + 1)-th largest logits are equal (the top-k's tie order
    decides those)."""
    import torch
    for chunk in chs:
        kq, kscale = gathered_keys(case, chunk)
        ks, ke = chunk.cu_seqlen_ks, chunk.cu_seqlen_ke
        r0, r1 = chunk.token_start, chunk.token_end
        if shard is not None:
            narrowed = shard.narrow(chunk)
            if narrowed is None:
                continue
            r0, r1, ks, ke = narrowed
        out = buf[r0:r1, :TOPK]
        if r1 == r0:
            continue
        logits = SCORERS[scorer](case["q"][r0:r1], kq, kscale, case["w"][r0:r1], ks, ke,
                                 chunk.max_seqlen_k)
        assert logits.dtype == torch.float32 and logits.shape[0] == r1 - r0
        topk_standin(logits, ke - ks, out, TOPK)
        if scored is not None:
            scored.append(r1 - r0)
        if ties is not None:
            for r, e in enumerate((ke - ks).tolist()):
                if e > TOPK:
                    v = torch.sort(logits[r, :e], descending=True).values
                    if v[TOPK - 1] == v[TOPK]:
                        ties.append(r0 + r)


class _Group:
    """get_tp_group() of one emulated rank: all_gatherv through a barrier of threads."""

    def __init__(self, rank, world, slots, barrier, reverse=False):
        self.rank, self.world, self.slots, self.barrier = rank, world, slots, barrier
        self.reverse = reverse

    def all_gatherv(self, t, dim=0, sizes=None):
        import torch
        assert dim == 0 and sizes is not None and t.shape[0] == sizes[self.rank], (
            t.shape, sizes, self.rank)
        self.slots[self.rank] = t.clone()
        self.barrier.wait()
        order = range(self.world - 1, -1, -1) if self.reverse else range(self.world)
        out = torch.cat([self.slots[r] for r in order], dim=0)
        self.barrier.wait()
        return out


def sharded(case, chs, scorer, sizes, controls=()):
    """Every rank's buffer after scoring its rows and exchange_topk, the rows each rank
    scored, each rank's row bounds; and per control (a _Group option, e.g. reverse=True) the
    buffers that exchange gives from the same scored rows."""
    import torch
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    world = len(sizes)
    md = SimpleNamespace(row_shard_sizes=list(sizes))
    bufs, shards, rows = [], [], []
    rank_of = {}
    sai_rank, sai_group = sai.get_tensor_model_parallel_rank, sai.get_tp_group
    local = threading.local()
    try:
        sai.get_tensor_model_parallel_rank = lambda: local.rank
        for r in range(world):
            local.rank = r
            shard = sai.PrefillRowShard.from_metadata(md, case["n_dec"])
            buf = torch.full((case["tokens"], TOPK), -1, dtype=torch.int32)
            scored: list[int] = []
            score(case, chs, scorer, buf, shard, scored)
            bufs.append(buf)
            shards.append(shard)
            rows.append(sum(scored))
        sai.get_tp_group = lambda: local.group
        ctl = [_exchange(shards, [b.clone() for b in bufs], local, **kw) for kw in controls]
        _exchange(shards, bufs, local)
        rank_of = {r: (s.start, s.stop) for r, s in enumerate(shards)}
    finally:
        sai.get_tensor_model_parallel_rank, sai.get_tp_group = sai_rank, sai_group
    return bufs, rows, rank_of, ctl


def _exchange(shards, bufs, local, **group_kw):
    """exchange_topk on every rank at once, one thread per rank."""
    world = len(shards)
    slots = [None] * world
    barrier = threading.Barrier(world)
    errors = []

    def rank_main(r):
        local.group = _Group(r, world, slots, barrier, **group_kw)
        try:
            shards[r].exchange_topk(bufs[r], TOPK)
        except BaseException as e:  # noqa: BLE001
            errors.append(f"rank {r}: {type(e).__name__}: {e}")
            barrier.abort()
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return bufs


def run_case(name, ratio, n_dec, qlens, ctx, budget, seed):
    import torch
    from vllm.v1.attention.backends.mla.indexer import balanced_prefill_row_shard
    case = make_case(ratio, n_dec, qlens, ctx, seed)
    chs = chunks(case, budget)
    rows = sum(qlens)
    layouts = {}
    for tp in (2, 4, 8):
        sizes = balanced_prefill_row_shard(case["seq"][n_dec:], torch.tensor(qlens), ratio, tp, 1)
        layouts[f"balanced_tp{tp}"] = sizes
    layouts["uneven_1_rest_1"] = [1, rows - 2, 1]
    out = dict(rows=rows, decode_tokens=n_dec, chunks=[
        dict(token_start=c.token_start, token_end=c.token_end, num_reqs=c.num_reqs,
             max_seqlen_k=c.max_seqlen_k) for c in chs], scorers={})
    for scorer in SCORERS:
        full = torch.full((case["tokens"], TOPK), -1, dtype=torch.int32)
        ties: list[int] = []
        score(case, chs, scorer, full, ties=ties)
        res = dict(selected=int((full[n_dec:] >= 0).sum()), rows_with_ties=len(ties),
                   layouts={})
        for lname, sizes in layouts.items():
            ctl_kw = ({"reverse": True},) if lname == "uneven_1_rest_1" else ()
            bufs, scored, bounds, ctl = sharded(case, chs, scorer, sizes, ctl_kw)
            res["layouts"][lname] = dict(
                sizes=list(sizes), scored_rows=scored, bounds=bounds,
                equal=[bool(torch.equal(b, full)) for b in bufs])
            if ctl:
                res["control_reversed_equal"] = [bool(torch.equal(b, full)) for b in ctl[0]]
        out["scorers"][scorer] = res
    return out


def main() -> int:
    res: dict = {}
    try:
        from vllm_probe_common import cpu_platform
        cpu_platform()
        from vllm.deepinfer import routing
        res["indexer_logits_routed"] = bool(routing.use("indexer_logits"))
        # benchmarks/e2e/rank_audit.py's counter of the row shard, on the real class.
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "e2e"))
        import rank_audit
        res["counter_installed"] = rank_audit.count_row_shard()
        res["cases"] = {c[0]: run_case(*c, seed=i) for i, c in enumerate(CASES)}
        res["counted"] = dict(rank_audit._COUNTS)
    except BaseException as e:  # noqa: BLE001 - the probe reports everything
        res["error"] = f"{type(e).__name__}: {e}"
        res["trace"] = traceback.format_exc()[-4000:]
    sys.stdout.write("\n" + json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("DEEPINFER_ARCH", "sm80")
    sys.exit(main())
