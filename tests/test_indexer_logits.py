"""Sparse-indexer MQA logits (vllm.deepinfer.kernels.indexer_logits) against a plain-torch
reference of DeepGEMM's formula, for the paged (decode) and the gathered (prefill) forms.

The reference decodes the e4m3 bytes with torch and sums in fp64: every product is exact in
the kernels (e4m3 x e4m3 in an fp16/fp8 dot with fp32 accumulation), so the only difference
is fp32 summation order — bounded here by 1e-5 relative to the row's magnitude.
"""
from __future__ import annotations

import pytest
import torch

from edges import ODD_PAGES
from vllm.deepinfer import kv_record
from vllm.deepinfer.kernels import indexer_logits as il
from vllm.deepinfer.kernels import shapes

D = il.HEAD_DIM
# Variants with a software decode (what sm80/sm86 run) everywhere; hardware e4m3 on a GPU.
VARIANTS = ["sm80"] + (["sm90"] if torch.cuda.is_available() else [])


def _codes(shape, gen, device):
    """Random e4m3 bytes, NaN codes (0x7F/0xFF) excluded, every other code possible."""
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)
    return b.to(torch.uint8).to(device)


def _f(codes):
    return codes.view(torch.float8_e4m3fn).to(torch.float64)


def _ref_rows(q_codes, w, keys, scales):
    """q [H, D] codes, w [H], keys [N, D] codes, scales [N] -> ([N] fp64 logits, [N] fp32
    error bound). The bound is the standard one for fp32 sums of D then H terms in any order,
    (D + H) * 2^-24 * sum_h |w_h| * sum_d |q_hd k_d| * scale (products are exact)."""
    q, k = _f(q_codes), _f(keys)
    w64, s64 = w.to(torch.float64), scales.to(torch.float64)
    want = ((k @ q.T).clamp_min(0) * w64[None, :]).sum(1) * s64
    mag = ((k.abs() @ q.abs().T) * w64.abs()[None, :]).sum(1) * s64
    return want, (q.shape[1] + q.shape[0]) * 2.0 ** -24 * mag


def _close(got, ref):
    want, bound = ref
    err = (got.to(torch.float64) - want).abs()
    assert bool((err <= bound).all()), f"max err {err.max():.3e}, bound there {bound[err.argmax()]:.3e}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("heads,next_n,per_row,block_size,page_pad", [
    (shapes.V41.index_heads, 1, False, 64, 0),
    (16, 1, False, 128, 64),     # page stride larger than a page (padded pages)
    (8, 2, False, 64, 0),        # heads padded to 16 in the dot; two rows per request
    (16, 2, True, 64, 0),        # per-row context lengths [B, next_n]
    # Pages that are not powers of two (a runtime block size), page strides that are not
    # 16-byte multiples; scales stay 4-byte aligned as the cache's fp32 layout requires.
    (16, 1, False, ODD_PAGES[0], 4),
    (8, 2, False, ODD_PAGES[1], 12),
    (16, 2, True, ODD_PAGES[2], 0),
])
def test_paged(device, variant, heads, next_n, per_row, block_size, page_pad):
    gen = torch.Generator().manual_seed(heads * 10 + next_n + block_size)
    lens = [1, 63, 64, 130, 257][: 3 if device == "cpu" else 5]
    B = len(lens)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    page_bytes = block_size * kv_record.INDEX_RECORD_BYTES + page_pad
    flat = _codes((num_blocks * page_bytes,), gen, "cpu")
    cache = flat.as_strided((num_blocks, block_size, kv_record.INDEX_RECORD_BYTES),
                            (page_bytes, kv_record.INDEX_RECORD_BYTES, 1))
    table = torch.zeros(B, max_blocks, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen)
    keys, scales, used = [], [], 0
    for b, n in enumerate(lens):
        keys.append(_codes((n, D), gen, "cpu"))
        scales.append(torch.exp2(torch.randint(-12, 4, (n,), generator=gen).to(torch.float32)))
        pages = -(-n // block_size)
        table[b, :pages] = perm[used:used + pages].to(torch.int32)
        used += pages
        i = torch.arange(n)
        kv_record.write_index_rows(cache, table[b, i // block_size].long() * block_size
                                   + i % block_size, keys[b], scales[b])
    cache = flat.to(device).as_strided(cache.shape, cache.stride())
    q = _codes((B, next_n, heads, D), gen, device)
    w = torch.randn(B * next_n, heads, generator=gen).to(device)
    if per_row:
        ctx = torch.tensor([[max(1, n - next_n + 1 + j) for j in range(next_n)] for n in lens],
                           dtype=torch.int32)
    else:
        ctx = torch.tensor(lens, dtype=torch.int32)
    max_len = max(lens) + 5
    out = il.paged_mqa_logits(q.view(torch.float8_e4m3fn), cache, w, ctx.to(device),
                              table.to(device), max_len, variant=variant, sm_count=2)
    assert out.shape == (B * next_n, max_len) and out.dtype == torch.float32
    for b, n in enumerate(lens):
        for j in range(next_n):
            r = b * next_n + j
            seen = int(ctx[b, j]) if per_row else n - next_n + 1 + j
            want = _ref_rows(q[b, j].cpu(), w[r].cpu(), keys[b][:seen], scales[b][:seen])
            _close(out[r, :seen].cpu(), want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_flat(device, variant):
    gen = torch.Generator().manual_seed(7)
    heads, N = 32, 300
    k = _codes((N, D), gen, device)
    ks_ = torch.exp2(torch.randint(-10, 3, (N,), generator=gen).to(torch.float32))
    # Two requests' rows in one chunk (causal ranges), plus an empty row and a full row.
    ranges = [(0, 1), (0, 70), (0, 71), (100, 100), (100, 230), (0, N), (299, 300)]
    M = len(ranges)
    ks = torch.tensor([a for a, _ in ranges], dtype=torch.int32)
    ke = torch.tensor([b for _, b in ranges], dtype=torch.int32)
    q = _codes((M, heads, D), gen, device)
    w = torch.randn(M, heads, generator=gen).to(device)
    max_k = int((ke - ks).max())
    out = il.mqa_logits(q, k, ks_.to(device).view(-1, 1), w, ks.to(device), ke.to(device), max_k,
                        variant=variant, sm_count=3)
    assert out.shape == (M, max_k)
    for i, (a, b) in enumerate(ranges):
        if b > a:
            _close(out[i, : b - a].cpu(), _ref_rows(q[i].cpu(), w[i].cpu(), k[a:b].cpu(), ks_[a:b]))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("sign_code", [0x38, 0xB8])  # +1.0, -1.0 on the other operand
def test_every_code_exact(device, variant, sign_code):
    """Every non-NaN e4m3 code, subnormals and +-448 included, decoded exactly on both
    operands: logit = relu(+-value) with a single non-zero product per logit."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    n = codes.numel()
    one = torch.zeros(D, dtype=torch.uint8)
    one[0] = sign_code
    want = (_f(codes) * _f(torch.tensor([sign_code], dtype=torch.uint8))).clamp_min(0) + 0.0  # +0, not -0
    # Key side (paged): one query, n keys holding the codes in dim 0.
    kv = torch.zeros(1, n, D + 4, dtype=torch.uint8)
    kv.view(-1)[: n * D].view(n, D)[:, 0] = codes
    kv.view(-1)[n * D:].view(torch.float32)[:] = 1.0
    out = il.paged_mqa_logits(one.view(1, 1, 1, D).to(device), kv.to(device),
                              torch.ones(1, 1, device=device),
                              torch.tensor([n], dtype=torch.int32, device=device),
                              torch.zeros(1, 1, dtype=torch.int32, device=device), n,
                              variant=variant)
    assert torch.equal(out[0].cpu().view(torch.int32), want.float().view(torch.int32))
    # Query side (flat): n rows holding the codes, one key.
    q = torch.zeros(n, 1, D, dtype=torch.uint8)
    q[:, 0, 0] = codes
    z = torch.zeros(n, dtype=torch.int32, device=device)
    out = il.mqa_logits(q.to(device), one.view(1, D).to(device), torch.ones(1, device=device),
                        torch.ones(n, 1, device=device), z, z + 1, 1, variant=variant)
    assert torch.equal(out[:, 0].cpu().view(torch.int32), want.float().view(torch.int32))


def test_bad_inputs_name_the_tensor(device):
    q = torch.zeros(1, 1, 4, 64, dtype=torch.uint8, device=device)
    kv = torch.zeros(2, 64, D + 4, dtype=torch.uint8, device=device)
    w = torch.zeros(1, 4, device=device)
    ctx = torch.ones(1, dtype=torch.int32, device=device)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="^q: head dim 64"):
        il.paged_mqa_logits(q, kv, w, ctx, bt, 8)
    q = torch.zeros(1, 1, 4, D, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="^weights:"):
        il.paged_mqa_logits(q, kv, w.double(), ctx, bt, 8)
    with pytest.raises(ValueError, match="^kv_cache:"):
        il.paged_mqa_logits(q, kv[..., :D], w, ctx, bt, 8)
    with pytest.raises(ValueError, match="^context_lens:"):
        il.paged_mqa_logits(q, kv, w, ctx.long(), bt, 8)
    with pytest.raises(ValueError, match="^block_table:"):
        il.paged_mqa_logits(q, kv, w, ctx, bt[:, :0], 8)
    with pytest.raises(ValueError, match="^block_table:"):
        il.paged_mqa_logits(q, kv, w, ctx, bt.long(), 8)
    with pytest.raises(ValueError, match="^q: expected float8_e4m3fn"):
        il.paged_mqa_logits(q.half(), kv, w, ctx, bt, 8)


@pytest.mark.parametrize("variant", VARIANTS)
def test_flat_two_rows_per_program_same_bits(device, variant):
    """The gathered form's two rows per program (FLAT_ROWS_PER_PROGRAM: one key tile loaded
    and decoded for both) gives every row the bits of the one-row kernel: rows of one
    request, a pair straddling two requests' ranges, an empty row and an odd last row."""
    import dataclasses
    assert il.FLAT_ROWS_PER_PROGRAM == 2 and il.TILES["sm80"].flat_rows == 2
    gen = torch.Generator().manual_seed(9)
    heads, N = 16, 260
    k = _codes((N, D), gen, device)
    s = torch.exp2(torch.randint(-10, 3, (N,), generator=gen).to(torch.float32)).to(device)
    ranges = [(0, 60), (0, 61), (0, 130), (130, 131), (130, 130), (130, 260), (0, 1)]
    ks = torch.tensor([a for a, _ in ranges], dtype=torch.int32, device=device)
    ke = torch.tensor([b for _, b in ranges], dtype=torch.int32, device=device)
    q = _codes((len(ranges), heads, D), gen, device)
    w = torch.randn(len(ranges), heads, generator=gen).to(device)
    width = int((ke - ks).max())
    one = dataclasses.replace(il.TILES[variant], flat_rows=1)
    a = il.mqa_logits(q, k, s, w, ks, ke, width, variant=variant, sm_count=2)
    b = il.mqa_logits(q, k, s, w, ks, ke, width, variant=variant, sm_count=2, tile=one)
    for i, (lo, hi) in enumerate(ranges):
        assert torch.equal(a[i, : hi - lo].cpu().view(torch.int32),
                           b[i, : hi - lo].cpu().view(torch.int32)), i
