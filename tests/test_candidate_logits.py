"""Candidate-only indexer logits (vllm.deepinfer.kernels.indexer_candidate_logits) against
upstream's compute-then-mask: our full logits (kernels.indexer_logits, what patch 0015 answers
DeepGEMM's calls with) followed by upstream's ``apply_candidate_mask``.

The mask is applied twice over: by a plain-torch statement of its rule (``_mask_rule``:
always) and by upstream's own two Triton kernels, extracted from the pinned sdist
(``upstream`` fixture; under the interpreter on CPU), launched as ``apply_candidate_mask``
launches them with row starts None. The candidate-only tensor must equal the masked one bit
for bit inside every range a top-k reads (each row's ``[0, keys seen)``; in decode also up to
the mask's row bound, where both hold -inf), and the top-k selections taken from both must be
identical index sets. Selections are taken by two top-k rules of our own: torch.topk and a
stable sort (ties to the lower column); both see the same bits from both tensors, so their
ties (exact duplicates placed in the data, and the -inf entries a row with fewer kept keys
than k must pick among) resolve the same way. Inputs cover rows with fewer keys than k, an
empty row, candidate blocks past the row's causal limit, past the logits width (upstream
keeps column width - 1 for those), duplicated and -1 ids, block sizes that do not divide the
64-key tile, and the decode layouts (one length per request with next_n rows, one per row).
"""
from __future__ import annotations

import pytest
import torch

from vllm.deepinfer import envs, kv_record, routing
from vllm.deepinfer.kernels import indexer_candidate_logits as icl
from vllm.deepinfer.kernels import indexer_logits as il

D = il.HEAD_DIM
VARIANTS = ["sm80"] + (["sm90"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _ordered_dot(monkeypatch):
    """Under the interpreter, a dot summed in one order whatever the tile shape
    (tests/interp_dot.py): the two kernels compared here tile the same dot differently, and
    numpy's BLAS on an AVX2 CPU sums such tiles a few ulps apart, which no GPU does."""
    if not torch.cuda.is_available():
        import interp_dot
        interp_dot.patch(monkeypatch.setattr)
NEG = float("-inf")


def _codes(shape, gen):
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)
    return b.to(torch.uint8)


def _bits(x):
    return x.contiguous().view(torch.int32)


# --------------------------------------------------------------------------- the mask
def _mask_rule(logits, ends, candidates, block_size, row_repeat=1):
    """upstream apply_candidate_mask's rule (row starts None), in torch: column c of row r
    stays iff c < min(end, width) and (c's block is listed, or c == width - 1 and a listed
    block starts at or past the width); every other column is -inf."""
    logits = logits.cpu()
    rows, width = logits.shape
    out = torch.full_like(logits, NEG)
    for r in range(rows):
        end = min(int(ends[r // row_repeat]), width)
        keep = torch.zeros(width, dtype=torch.bool)
        for b in candidates[r].tolist():
            if b < 0:
                continue
            if b * block_size >= width:
                keep[width - 1] = True
            else:
                keep[b * block_size: (b + 1) * block_size] = True
        keep[end:] = False
        out[r, keep] = logits[r, keep]
    return out


def _upstream_mask(uk, logits, ends, candidates, block_size, row_repeat=1):
    """upstream's apply_candidate_mask, launched as it launches its kernels (row starts
    None), on a copy of ``logits``."""
    import importlib

    import triton
    uk = importlib.import_module(uk.__name__ + ".dsa_candidate_blocks")
    logits = logits.clone()
    rows, width = logits.shape
    nblocks = triton.cdiv(width, block_size)
    flags = torch.empty((rows, nblocks + 1), dtype=torch.uint8, device=logits.device)
    uk._candidate_flags_kernel[(rows,)](
        candidates, None, flags, *candidates.stride(), 0, width, nblocks, block_size,
        candidates.shape[1], False, row_repeat)
    uk._mask_candidates_kernel[(rows, triton.cdiv(width, 1024))](
        logits, None, ends, flags, *logits.stride(), 0, ends.stride(0), width, nblocks,
        block_size, False, row_repeat, 1024)
    return logits


# --------------------------------------------------------------------------- top-k rules
def _topk_sets(logits, lens, k):
    """Per row, the index sets two top-k rules select from ``logits[r, :lens[r]]``, as the
    indexer's kernels do: a row of at most k keys gives all of them, -inf included; a longer
    row its k largest. Rule 1: torch.topk; rule 2: stable sort, ties to the lower column."""
    out = []
    for r, n in enumerate(lens):
        row = logits[r, :n].cpu()
        if n <= k:
            out.append((frozenset(range(n)), frozenset(range(n))))
            continue
        a = frozenset(row.topk(k).indices.tolist())
        b = frozenset(torch.sort(row, descending=True, stable=True).indices[:k].tolist())
        out.append((a, b))
    return out


def _tie_stats(masked, lens, k):
    """(rows whose k-th largest value is tied with an unselected one, rows whose top k
    must take -inf entries): the cases where the top-k's tie order decides the set."""
    cut, inf_pick = 0, 0
    for r, n in enumerate(lens):
        row = masked[r, :n].cpu()
        if n <= k:
            continue
        srt = torch.sort(row, descending=True).values
        if srt[k - 1] == srt[k]:
            cut += 1
            inf_pick += int(srt[k - 1] == NEG)
    return cut, inf_pick


def _compare(ours, masked, lens, ends, k):
    for r, (n, e) in enumerate(zip(lens, ends)):
        e = min(e, ours.shape[1])
        assert torch.equal(_bits(ours[r, :n].cpu()), _bits(masked[r, :n].cpu())), \
            f"row {r}: candidate-only logits differ from compute-then-mask inside [0, {n})"
        # Past the row's keys and up to the mask's bound: -inf in ours (upstream keeps the
        # full kernel's unwritten columns of listed blocks there; no top-k reads them).
        assert bool((ours[r, n:e] == NEG).all()), f"row {r}: [{n}, {e}) not -inf"
    for a, b in zip(_topk_sets(ours, lens, k), _topk_sets(masked, lens, k)):
        assert a == b


def _untouched_past_end(launch, ours, ends):
    """Into a buffer holding a sentinel: the same bits up to each row's end, the sentinel
    past it (nothing is written outside the rows' ranges)."""
    buf = torch.full(ours.shape, 7.0, device=ours.device)
    got = launch(buf)
    assert got.data_ptr() == buf.data_ptr()
    for r, e in enumerate(ends):
        assert torch.equal(_bits(got[r, :e].cpu()), _bits(ours[r, :e].cpu())), r
        assert bool((got[r, e:] == 7.0).all()), f"row {r}: written past its end {e}"


# --------------------------------------------------------------------------- prefill
def _with_duplicates(keys, scales, pairs):
    """Copy key rows (codes and scale) so that equal logits appear in every query row."""
    for src, dst in pairs:
        keys[dst] = keys[src]
        scales[dst] = scales[src]


# (ks, ke) per row: two requests' causal rows in one chunk, an empty row, a row as wide as
# the chunk (its end is the logits width: the edge column is reachable).
RANGES = [(0, 1), (0, 9), (0, 40), (0, 97), (0, 150), (150, 150), (150, 175), (150, 300)]


def _prefill_case(block_size, gen):
    N = 300
    k = _codes((N, D), gen)
    s = torch.exp2(torch.randint(-6, 3, (N,), generator=gen).to(torch.float32))
    # Exact ties: keys 150+3 / 150+40 / 150+41 copy 150+2, 5 copies 4 (row-local columns).
    _with_duplicates(k, s, [(152, 153), (152, 190), (152, 191), (4, 5), (4, 30), (160, 161)])
    M = len(RANGES)
    ks = torch.tensor([a for a, _ in RANGES], dtype=torch.int32)
    ke = torch.tensor([b for _, b in RANGES], dtype=torch.int32)
    width = int((ke - ks).max())
    nblk = -(-width // block_size)
    K = 7
    cand = torch.full((M, K), -1, dtype=torch.int32)
    for r, (a, b) in enumerate(RANGES):
        n = b - a
        valid = list(range(-(-n // block_size))) if n else []
        perm = torch.randperm(len(valid), generator=gen).tolist() if valid else []
        picks = [valid[i] for i in perm[:3] if valid[i] != nblk - 1]
        if n < width:
            picks += [nblk - 1]         # the last block of the width: past the row's limit
        picks += [nblk + 2]             # starts past the width: upstream's edge column
        if valid:
            picks += [picks[0]]         # a duplicate id
        cand[r, :len(picks)] = torch.tensor(picks[:K], dtype=torch.int32)
    # One row whose list holds a single block: fewer kept keys than k, -inf entries picked.
    cand[3] = -1
    cand[3, 3] = 2
    q = _codes((M, 16, D), gen)
    w = torch.randn(M, 16, generator=gen)
    return k, s, ks, ke, width, cand, q, w


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block_size", [8, 5])  # V4.1's 8; 5 does not divide the 64-key tile
def test_prefill_matches_compute_then_mask(device, variant, block_size, upstream):
    gen = torch.Generator().manual_seed(block_size)
    k, s, ks, ke, width, cand, q, w = (t.to(device) if torch.is_tensor(t) else t
                                       for t in _prefill_case(block_size, gen))
    full = il.mqa_logits(q, k, s, w, ks, ke, width, variant=variant, sm_count=2)
    ends = (ke - ks).contiguous()
    rule = _mask_rule(full, ends.cpu(), cand.cpu(), block_size)
    ups = _upstream_mask(upstream, full, ends, cand, block_size)
    lens = ends.tolist()
    for r, n in enumerate(lens):  # the torch rule is upstream's rule
        assert torch.equal(_bits(rule[r, :n].cpu()), _bits(ups[r, :n].cpu())), r
    ours = icl.candidate_mqa_logits(q, k, s, w, ks, ke, width, cand, block_size,
                                    variant=variant, sm_count=2)
    assert ours.shape == full.shape and ours.dtype == torch.float32
    for topk in (4, 16, 33):
        _compare(ours, ups, lens, lens, topk)
    _untouched_past_end(lambda out: icl.candidate_mqa_logits(
        q, k, s, w, ks, ke, width, cand, block_size, variant=variant, sm_count=2, out=out),
        ours, lens)
    # The edge column: the full-width rows keep column width - 1 for their past-width id
    # alone (the block holding that column is not listed).
    for r in (RANGES.index((0, 150)), RANGES.index((150, 300))):
        listed = cand[r].tolist()
        assert (width - 1) // block_size not in listed and max(listed) * block_size >= width
        assert torch.equal(_bits(ours[r, width - 1:].cpu()), _bits(full[r, width - 1:].cpu()))
        first = (width - 1) // block_size * block_size  # the rest of that block: masked
        assert width - 1 > first and bool((ours[r, first:width - 1] == NEG).all())


def test_prefill_ties_and_inf_picks_occur(device):
    """The prefill data does exercise the tie cases (so the equalities above cover them)."""
    gen = torch.Generator().manual_seed(8)
    k, s, ks, ke, width, cand, q, w = (t.to(device) if torch.is_tensor(t) else t
                                       for t in _prefill_case(8, gen))
    full = il.mqa_logits(q, k, s, w, ks, ke, width, variant="sm80", sm_count=2)
    lens = (ke - ks).tolist()
    masked = _mask_rule(full, torch.tensor(lens), cand.cpu(), 8)
    cuts = [_tie_stats(masked, lens, t) for t in (4, 16, 33)]
    assert sum(c for c, _ in cuts) >= 2 and sum(i for _, i in cuts) >= 1, cuts
    # Exact duplicates of a key give equal finite logits in every row that keeps both.
    r = RANGES.index((150, 300))
    assert full[r, 2] == full[r, 3] == full[r, 40] == full[r, 41]


# --------------------------------------------------------------------------- decode
def _paged_case(lens, next_n, per_row, page, block_size, gen):
    B = len(lens)
    pages_per = [-(-n // page) for n in lens]
    num_pages = sum(pages_per) + 2
    cache = _codes((num_pages, page, kv_record.INDEX_RECORD_BYTES), gen)
    table = torch.zeros(B, max(pages_per) + 1, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=gen)
    used = 0
    for b, n in enumerate(lens):
        keys = _codes((n, D), gen)
        sc = torch.exp2(torch.randint(-6, 3, (n,), generator=gen).to(torch.float32))
        if n > 12:
            _with_duplicates(keys, sc, [(3, 4), (3, 11)])  # ties
        table[b, :pages_per[b]] = perm[used:used + pages_per[b]].to(torch.int32)
        used += pages_per[b]
        i = torch.arange(n)
        kv_record.write_index_rows(cache, table[b, i // page].long() * page + i % page, keys, sc)
    rows = B * next_n
    if per_row:
        ctx = torch.tensor([[max(1, n - next_n + 1 + j) for j in range(next_n)] for n in lens],
                           dtype=torch.int32)
        seen = ctx.reshape(-1).tolist()
    else:
        ctx = torch.tensor(lens, dtype=torch.int32)
        seen = [max(0, n - next_n + 1 + j) for n in lens for j in range(next_n)]
    width = max(lens) + 6  # max_model_len: wider than every context
    nblk = -(-width // block_size)
    K = 6
    cand = torch.full((rows, K), -1, dtype=torch.int32)
    for r in range(rows):
        n = lens[r // next_n]
        valid = list(range(-(-n // block_size)))
        perm = torch.randperm(len(valid), generator=gen).tolist()
        picks = [valid[i] for i in perm[:3]] + [nblk - 1, nblk + 1]
        cand[r, :len(picks)] = torch.tensor(picks, dtype=torch.int32)
    q = _codes((B, next_n, 16, D), gen)
    w = torch.randn(rows, 16, generator=gen)
    return cache, table, ctx, seen, width, cand, q, w


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("next_n,per_row,block_size", [
    (1, False, 8),
    (2, False, 8),   # one length per request over next_n rows: upstream's row_repeat
    (2, True, 3),    # one length per row; a block size that does not divide the page
])
def test_decode_matches_compute_then_mask(device, variant, next_n, per_row, block_size,
                                          upstream):
    gen = torch.Generator().manual_seed(10 * next_n + block_size)
    lens = [5, 37, 70]
    cache, table, ctx, seen, width, cand, q, w = _paged_case(lens, next_n, per_row, 16,
                                                             block_size, gen)
    cache, table, ctx, cand, q, w = (t.to(device) for t in (cache, table, ctx, cand, q, w))
    full = il.paged_mqa_logits(q, cache, w, ctx, table, width, variant=variant, sm_count=2)
    # upstream's decode call: vis = seq_lens.reshape(-1), row_repeat = next_n when there is
    # one length per request.
    vis = ctx.reshape(-1).contiguous()
    rows = q.shape[0] * q.shape[1]
    row_repeat = next_n if vis.numel() != rows else 1
    ups = _upstream_mask(upstream, full, vis, cand, block_size, row_repeat)
    rule = _mask_rule(full, vis.cpu(), cand.cpu(), block_size, row_repeat)
    for r, n in enumerate(seen):
        assert torch.equal(_bits(rule[r, :n].cpu()), _bits(ups[r, :n].cpu())), r
    ours = icl.candidate_paged_mqa_logits(q, cache, w, ctx, table, width, cand, block_size,
                                          variant=variant, sm_count=2)
    ends = [int(vis[r // row_repeat]) for r in range(rows)]
    for topk in (3, 9, 20):
        _compare(ours, ups, seen, ends, topk)
    _untouched_past_end(lambda out: icl.candidate_paged_mqa_logits(
        q, cache, w, ctx, table, width, cand, block_size, variant=variant, sm_count=2, out=out),
        ours, ends)


# --------------------------------------------------------------------------- routing
def _route_inputs(device):
    gen = torch.Generator().manual_seed(3)
    k, s, ks, ke, width, cand, q, w = (t.to(device) if torch.is_tensor(t) else t
                                       for t in _prefill_case(8, gen))
    return (q.view(torch.float8_e4m3fn), None), (k.view(torch.float8_e4m3fn), s), w, ks, ke, \
        width, cand


def test_routing_switch(device, monkeypatch):
    """On by default (wherever indexer_logits runs): the routed result is the kernel's;
    DEEPINFER_CANDIDATE_LOGITS=0, indexer_logits off, no candidates (the candidate source,
    unmasked sources) or a call outside the kernel give None: upstream's compute-then-mask."""
    q, kv, w, ks, ke, width, cand = _route_inputs(device)
    monkeypatch.delenv("DEEPINFER_CANDIDATE_LOGITS", raising=False)
    monkeypatch.delenv("DEEPINFER_INDEXER_LOGITS", raising=False)
    monkeypatch.delenv("DEEPINFER_DISABLE", raising=False)
    # sm90: DeepGEMM scores there (indexer_logits off by default), so no candidate route.
    monkeypatch.setenv("DEEPINFER_ARCH", "sm90")
    routing.reset()
    try:
        assert routing.candidate_mqa_logits(q, kv, w, ks, ke, width, cand, 8) is None
        monkeypatch.setenv("DEEPINFER_ARCH", "sm80")  # the Ampere indexer: on by default
        routing.reset()
        assert envs.FEATURES["candidate_logits"].default_on >= {"sm80", "sm86", "cpu"}
        got = routing.candidate_mqa_logits(q, kv, w, ks, ke, width, cand, 8)
        want = icl.candidate_mqa_logits(q[0], kv[0], kv[1], w, ks, ke, width, cand, 8)
        for r, n in enumerate((ke - ks).tolist()):
            assert torch.equal(_bits(got[r, :n].cpu()), _bits(want[r, :n].cpu()))
        assert routing.candidate_mqa_logits(q, kv, w, ks, ke, width, None, 8) is None
        assert routing.candidate_mqa_logits(q, kv, w, ks, ke, width, cand.long(), 8) is None
        assert routing.candidate_mqa_logits((q[0], torch.ones(1)), kv, w, ks, ke, width, cand,
                                             8) is None  # MXFP4-style Q scale: DeepGEMM's
        for var in ("DEEPINFER_CANDIDATE_LOGITS", "DEEPINFER_INDEXER_LOGITS"):
            monkeypatch.setenv(var, "0")
            routing.reset()
            assert routing.candidate_mqa_logits(q, kv, w, ks, ke, width, cand, 8) is None
            assert routing.candidate_paged_mqa_logits(
                (q[0].view(1, *q[0].shape), None), None, w, None, None, width, None, cand,
                8) is None
            monkeypatch.delenv(var)
        monkeypatch.setenv("DEEPINFER_DISABLE", "candidate_logits")
        routing.reset()
        assert routing.candidate_mqa_logits(q, kv, w, ks, ke, width, cand, 8) is None
    finally:
        routing.reset()


def test_routing_decode_indices_stay_upstream(device):
    """SM100's varlen ``indices`` call is DeepGEMM's (as for the unmasked logits)."""
    routing.reset()
    q = (torch.zeros(1, 1, 16, D, dtype=torch.float8_e4m3fn, device=device), None)
    cand = torch.zeros(1, 2, dtype=torch.int32, device=device)
    assert routing.candidate_paged_mqa_logits(q, None, torch.zeros(1, 16, device=device), None,
                                              None, 8, torch.zeros(1), cand, 8) is None


# --------------------------------------------------------------------------- launchers
def test_out_buffer_and_bad_inputs_name_the_tensor(device):
    gen = torch.Generator().manual_seed(5)
    k, s, ks, ke, width, cand, q, w = (t.to(device) if torch.is_tensor(t) else t
                                       for t in _prefill_case(8, gen))
    buf = torch.zeros(len(RANGES), width + 3, device=device)[:, :width]  # padded row stride
    got = icl.candidate_mqa_logits(q, k, s, w, ks, ke, width, cand, 8, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    want = icl.candidate_mqa_logits(q, k, s, w, ks, ke, width, cand, 8)
    for r, n in enumerate((ke - ks).tolist()):
        assert torch.equal(_bits(got[r, :n].cpu()), _bits(want[r, :n].cpu()))
    with pytest.raises(ValueError, match="^out:"):
        icl.candidate_mqa_logits(q, k, s, w, ks, ke, width, cand, 8, out=buf[:, :-1])
    with pytest.raises(ValueError, match="^candidates:"):
        icl.candidate_mqa_logits(q, k, s, w, ks, ke, width, cand.long(), 8)
    with pytest.raises(ValueError, match="^candidates:"):
        icl.candidate_mqa_logits(q, k, s, w, ks, ke, width, cand[:-1], 8)
    with pytest.raises(ValueError, match="^block_size:"):
        icl.candidate_mqa_logits(q, k, s, w, ks, ke, width, cand, 0)
    with pytest.raises(ValueError, match="^cu_seqlen_ke:"):
        icl.candidate_mqa_logits(q, k, s, w, ks, ke.long(), width, cand, 8)
    with pytest.raises(ValueError, match="^q: head dim"):
        icl.candidate_mqa_logits(q[..., :64], k, s, w, ks, ke, width, cand, 8)
    kv = torch.zeros(2, 16, D + 4, dtype=torch.uint8, device=device)
    qd = torch.zeros(1, 1, 16, D, dtype=torch.uint8, device=device)
    ctx = torch.ones(1, dtype=torch.int32, device=device)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    c1 = torch.zeros(1, 2, dtype=torch.int32, device=device)
    w1 = torch.zeros(1, 16, device=device)
    with pytest.raises(ValueError, match="^kv_cache:"):
        icl.candidate_paged_mqa_logits(qd, kv[..., :D], w1, ctx, bt, 8, c1, 8)
    with pytest.raises(ValueError, match="^context_lens:"):
        icl.candidate_paged_mqa_logits(qd, kv, w1, ctx.long(), bt, 8, c1, 8)
    with pytest.raises(ValueError, match="^candidates:"):
        icl.candidate_paged_mqa_logits(qd, kv, w1, ctx, bt, 8, c1[:, :0], 8)


# --------------------------------------------------------------------------- warmup
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="intercepts the interpreter's launches (CPU only)")
@pytest.mark.parametrize("variant", ["sm80", "sm90"])
def test_launches_are_warmed(variant, monkeypatch):
    """No compile while serving (as tests/test_warmup_coverage.py for the other kernels):
    every launch of both kernels over realistic calls (decode batches with and without MTP
    rows, prefill chunks whose row bounds, queries and candidate rows start at odd rows, SM
    counts of A100 and H200) has its Triton cache key among the warmup's; V4 (no candidate
    blocks) warms none."""
    from launch_keys import describe, key_of, recording
    from vllm.deepinfer import arch
    from vllm.deepinfer import warmup as wu
    from vllm.deepinfer.kernels import shapes as sh
    cc = {"sm80": 80, "sm90": 90}[variant]
    v41 = wu.ModelShapes(window=128, compress_ratios=(0, 1, 2), topk=512, heads=64,
                         model="v41", candidate_block_size=8, candidate_topk_blocks=2048)
    v4 = wu.ModelShapes(window=128, compress_ratios=(1, 4, 128), topk=512, heads=64,
                        model="v4")
    assert wu.keys(v4, variant, features=["candidate_logits"]) == []
    warm: dict = {}
    for k in wu.keys(v41, variant, features=["candidate_logits"]):
        kern, _ = wu._kernel_and_signature(k.kernel)
        args, ce = wu.warmup_args(k)
        warm.setdefault(kern.fn.__name__, set()).add(
            key_of(kern, args, dict(ce, **wu.launch_options(k)), cc))
    monkeypatch.setattr(arch, "interpreting", lambda: False)
    page, i32 = sh.compressed_page(variant), dict(dtype=torch.int32)
    cache = torch.zeros(77, page, 132, dtype=torch.uint8)
    buf = torch.zeros(300, 2048, **i32)  # the model's candidate buffer
    with recording(cc) as seen:
        for sms in (108, 132):
            monkeypatch.setattr(arch, "sm_count", lambda device=None, n=sms: n)
            for batch, next_n in ((1, 1), (3, 1), (64, 1), (4, 2), (5, 3)):
                rows = batch * next_n
                q = torch.zeros(batch, next_n, 64, 128, dtype=torch.uint8)
                lens = torch.full((batch, next_n) if next_n > 1 else (batch,), 700, **i32)
                bt = torch.zeros(batch + 2, 41, **i32)[1:]
                icl.candidate_paged_mqa_logits(q, cache, torch.zeros(rows, 64), lens, bt, 8192,
                                               buf[:rows], 8, variant=variant)
            for start, rows, keys in ((0, 1, 100), (3, 7, 3000), (5, 130, 8192)):
                ks = torch.zeros(start + rows, **i32)
                icl.candidate_mqa_logits(
                    torch.zeros(start + rows, 64, 128, dtype=torch.uint8)[start:],
                    torch.zeros(keys, 128, dtype=torch.uint8), torch.ones(keys),
                    torch.zeros(start + rows, 64)[start:], ks[start:], ks[start:] + keys, keys,
                    buf[start:start + rows], 8, variant=variant)
    assert {k.fn.__name__ for k, _ in seen} == {"_prepare_kernel", "_candidate_logits_kernel"}
    missing = sorted({describe(kern, key) for kern, key in seen
                      if key not in warm.get(kern.fn.__name__, ())})
    assert not missing, "\n".join(missing)


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sm80", "sm90"])
def test_gpu_production_shapes_bit_equal(variant, upstream):
    """V4.1's shapes on a GPU: 64 heads, 2048 candidate blocks of 8, top-k 512; a prefill
    chunk of 64 causal rows over 40K keys and a decode of 8 requests x 2 rows at 24K-40K
    keys, full-range random e4m3 inputs: bit-equal to compute-then-mask (upstream's mask
    kernels) over every row's keys, and the same top-512 sets."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    H, K, BS, TOPK = 64, 2048, 8, 512

    def codes(shape):
        b = torch.randint(0, 256, shape, generator=g, device=dev, dtype=torch.int32)
        return torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)

    def cands(rows, lens):
        out = torch.full((rows, K), -1, dtype=torch.int32, device=dev)
        for r, n in enumerate(lens):
            nb = -(-n // BS)
            pick = torch.randperm(nb, generator=g, device=dev)[:K].to(torch.int32)
            out[r, :pick.numel()] = pick
            out[r, -1] = nb - 1  # the newest block, as the candidate source pins it
        return out

    # prefill
    N, M = 40000, 64
    k = codes((N, D))
    s = torch.exp2(torch.randint(-8, 2, (N,), generator=g, device=dev).float())
    ks = torch.zeros(M, dtype=torch.int32, device=dev)
    ke = torch.arange(N - M + 1, N + 1, dtype=torch.int32, device=dev)
    q = codes((M, H, D))
    w = torch.randn(M, H, generator=g, device=dev) * 0.1
    cand = cands(M, ke.tolist())
    full = il.mqa_logits(q, k, s, w, ks, ke, N, variant=variant)
    ups = _upstream_mask(upstream, full, ke, cand, BS)
    ours = icl.candidate_mqa_logits(q, k, s, w, ks, ke, N, cand, BS, variant=variant)
    lens = ke.tolist()
    _compare(ours, ups, lens, lens, TOPK)
    # decode
    B, next_n, PAGE = 8, 2, 128
    lens = [24000 + 2000 * b for b in range(B)]
    pages = [-(-n // PAGE) for n in lens]
    cache = codes((sum(pages), PAGE, D + 4))
    cache.view(sum(pages), -1)[:, PAGE * D:] = torch.exp2(torch.randint(
        -8, 2, (sum(pages), PAGE), generator=g, device=dev).float()).view(torch.uint8).view(
        sum(pages), -1)
    table = torch.zeros(B, max(pages), dtype=torch.int32, device=dev)
    perm = torch.randperm(sum(pages), generator=g, device=dev).to(torch.int32)
    used = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[used:used + p]
        used += p
    ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = codes((B, next_n, H, D))
    w = torch.randn(B * next_n, H, generator=g, device=dev) * 0.1
    seen = [n - next_n + 1 + j for n in lens for j in range(next_n)]
    cand = cands(B * next_n, seen)
    width = max(lens) + 1000
    full = il.paged_mqa_logits(q, cache, w, ctx, table, width, variant=variant)
    ups = _upstream_mask(upstream, full, ctx, cand, BS, next_n)
    ours = icl.candidate_paged_mqa_logits(q, cache, w, ctx, table, width, cand, BS,
                                          variant=variant)
    _compare(ours, ups, seen, [lens[r // next_n] for r in range(B * next_n)], TOPK)


# --------------------------------------------------------------------------- patch 0041
PATCH_0041 = "0041-sparse-attn-indexer-k-gather-once-per-kv-source.patch"
INDEXER_FILE = "vllm/model_executor/layers/sparse_attn_indexer.py"


def _patched_tree():
    """The patched tree (build/patched) when its indexer file is pristine + patch 0041 as
    committed here; else skip (``make patched`` rebuilds it)."""
    import importlib.util
    import os
    import subprocess
    import tempfile
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    build = Path(os.environ.get("DEEPINFER_BUILD", repo / "build"))
    tree, pristine = build / "patched", build / "vllm-0.33.0"
    if not (tree / INDEXER_FILE).is_file() or not (pristine / INDEXER_FILE).is_file():
        pytest.skip(f"{tree} or {pristine} missing: run `make patched`")
    for dep in ("regex", "pydantic", "transformers", "msgspec", "cloudpickle"):
        if importlib.util.find_spec(dep) is None:
            pytest.skip(f"vLLM import dependency {dep} missing (make venv)")
    with tempfile.TemporaryDirectory() as d:
        dst = Path(d) / INDEXER_FILE
        dst.parent.mkdir(parents=True)
        dst.write_bytes((pristine / INDEXER_FILE).read_bytes())
        subprocess.run(["git", "init", "-q", d], check=True)
        subprocess.run(["git", "-C", d, "apply", str(repo / "patches" / "vllm-0.33.0" / PATCH_0041)],
                       check=True)
        if dst.read_bytes() != (tree / INDEXER_FILE).read_bytes():
            pytest.skip(f"{tree} predates patch 0041 as committed: run `make patched`")
    return repo, tree


def test_patched_indexer_routes_masked_sources(upstream):
    """Upstream's sparse_attn_indexer as patched (0041), a masked V4.1 index source, on CPU
    (tests/candidate_logits_probe.py): with candidate_logits on the candidate route scores
    it and upstream's mask never runs; off, the full logits and the mask run; the logits
    the top-k is given are the same bits in every row's range, and so are the selections,
    in prefill (one request, causal rows) and decode (two requests x two MTP rows)."""
    import json
    import os
    import subprocess
    import sys
    repo, tree = _patched_tree()
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("DEEPINFER_") and k != "DEEPINFER_BUILD")
           and k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, str(repo / "tests" / "candidate_logits_probe.py")],
                       env=env, cwd=repo, capture_output=True, text=True, timeout=600)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    res = json.loads(lines[-1])
    assert "error" not in res, res.get("trace")
    for kind in ("prefill", "decode"):
        on, off = res[kind]["on"], res[kind]["off"]
        assert on["calls"] == {"mask": 0, "route": 1}, (kind, on["calls"])
        assert off["calls"] == {"mask": 1, "route": 0}, (kind, off["calls"])
        assert on["ends"] == off["ends"] and on["rows"] == off["rows"], kind
        assert on["topk"] == off["topk"], kind
        # The mask did mask: rows keep fewer entries than they have keys.
        assert any(k < e for k, e in zip(on["kept"], on["ends"])), kind
        assert all(k > 0 for k in on["kept"]), kind
