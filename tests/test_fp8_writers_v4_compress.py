"""V4 compressed-KV writers (vllm.deepinfer.kernels.fp8_writers_v4_compress) against upstream.

Upstream: vLLM 0.33.0 models/deepseek_v4/common/ops/fused_compress_quant_cache.py,
``_fused_kv_compress_norm_rope_insert_sparse_attn`` (head 512, 584-byte record) and
``_fused_kv_compress_norm_rope_insert_indexer_attn`` (head 128, FP8 indexer row), launched
as upstream's host code launches them.

Two kinds of cases, each on a batch of requests with state pages scattered through a
block table, padded page strides (state and cache), tokens at and off group boundaries,
windows that start before position 0, state-slot and cache-slot -1:

1. Random inputs (fp32 state with per-row magnitudes, an all-zero window, a 1e17 window):
   upstream, our sm80 variant (software e4m3) and our sm90 variant (hardware cast) write
   the same bytes into the whole cache buffer, padding included.
2. Exact inputs, built so that every fp32 operation before the casts is exact on every
   backend (interpreter, GPU approximations, torch): each score column has 1, 2, 4, 8 or
   all "hot" rows at the column maximum and the others 300 below (their exp is 0), the hot
   rows carry the same small integer, the integer rows have sum of squares head * 4^k
   with eps = 0 (so rsqrt is a power of two), the norm weight and cos/sin are few-bit
   dyadics. Then a plain-torch reference of the math (softmax, weighted sum, RMSNorm,
   GPT-J RoPE, torch's e4m3/bf16 casts) must equal upstream and ours byte for byte. The
   cases are checked to contain e4m3 rounding ties, e4m3 subnormals, saturated +-448
   bytes and an all-zero quant block (the 1e-4 amax floor).

On CPU the interpreter's own fp32 -> fp8e4nv conversion is wrong (it rounds half up
without carrying and does not saturate); as in tests/test_fp8_writers.py, this module
replaces it with what ``cvt.rn.satfinite.e4m3x2.f32`` does, for upstream and our sm90
variant; our sm80 variant never uses it. On a GPU without fp8 (sm80/sm86) only our sm80
variant and the torch reference run.
"""
from __future__ import annotations

import importlib
import math
from types import SimpleNamespace

import pytest
import torch

from edges import INT32_MAX, INT32_MIN, ODD_PAGES, invalid_slots
from vllm.deepinfer import kv_record as rec
from vllm.deepinfer.kernels import fp8_writers_v4_compress as v4c

H512, H128, ROPE = 512, 128, 64
ROW512, ROW128 = rec.RECORD_BYTES, rec.INDEX_RECORD_BYTES


def _has_fp8(device) -> bool:
    return torch.device(device).type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9)


def _variants(device) -> tuple[str, ...]:
    return ("sm80", "sm90") if _has_fp8(device) else ("sm80",)


pytestmark = pytest.mark.usefixtures("exact_hw_fp8_cast")  # conftest.py


@pytest.fixture(scope="module")
def up(upstream):
    return importlib.import_module("upstream_kernels.v4_fused_compress")


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    bad = (a.flatten() != b.flatten()).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.numel()} bytes differ, first at {bad[:8].flatten().tolist()}"


# ----------------------------------------------------------------- scenario
def _scenario(head: int, cr: int, overlap: bool, state_block: int, kv_block: int, seed: int,
              layout: str = "mixed") -> SimpleNamespace:
    """A batch: request 0 a prefill chunk from position 0 (early windows, page edges,
    non-boundary tokens), request 1 two deep boundaries and a non-boundary token,
    request 2 one boundary whose window is all zeros, request 3 one whose window is 1e17.
    ``layout="boundaries"`` keeps only boundary tokens (the exact cases)."""
    gen = torch.Generator().manual_seed(seed)
    coff = 1 + overlap
    window = coff * cr
    reqs = [list(range(2 * cr + 3)), [5 * cr - 1, 9 * cr - 1, 9 * cr + 1], [3 * cr - 1], [2 * cr - 1]]
    if layout == "boundaries":
        reqs = [[p for p in r if (p + 1) % cr == 0] for r in reqs]
    tok_req = [r for r, ps in enumerate(reqs) for _ in ps]
    tok_pos = [p for ps in reqs for p in ps]
    n = len(tok_pos)

    # State pages: a shuffled pool, rows of 2 * coff * head fp32, pages padded by 16 floats.
    pages_per_req = [max(ps) // state_block + 1 for ps in reqs]
    max_pages = max(pages_per_req)
    num_pages = sum(pages_per_req) + 2
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    block_table = torch.zeros(len(reqs), max_pages + 1, dtype=torch.int32)  # unused entries 0
    at = 0
    for r, k in enumerate(pages_per_req):
        block_table[r, :k] = perm[at:at + k]
        at += k
    row = 2 * coff * head
    page_floats = state_block * row + 16
    backing = torch.randn(num_pages * page_floats, generator=gen)
    state = backing.as_strided((num_pages, state_block, row), (page_floats, row, 1))
    # Per-row magnitudes 2^-8..2^8 for kv; scores of O(4).
    mag = torch.exp2(torch.randint(-8, 9, (num_pages, state_block, 1), generator=gen).float())
    state[..., : coff * head] *= mag
    state[..., coff * head:] *= 4.0

    def window_rows(r, p):
        q = torch.arange(p - window + 1, p + 1)
        keep = q >= 0
        half = (torch.arange(window) >= cr).long() * overlap
        q, half = q[keep], half[keep]
        return block_table[r, q // state_block].long(), q % state_block, half

    def set_window(r, p, fn):
        pg, off, half = window_rows(r, p)
        cols = half[:, None] * head + torch.arange(head)[None, :]
        state.index_put_((pg[:, None], off[:, None], cols), fn(state[pg[:, None], off[:, None], cols]))

    set_window(2, reqs[2][0], torch.zeros_like)
    set_window(3, reqs[3][0], lambda x: torch.where(x < 0, -1e17, 1e17) * (1 + x.abs().frac()))

    state_slots = torch.arange(n, dtype=torch.int64)
    kv_pages = -(-n // kv_block) + 1
    kv_slots = torch.randperm(kv_pages * kv_block, generator=gen)[:n].to(torch.int64)
    boundary = [i for i, p in enumerate(tok_pos) if (p + 1) % cr == 0]
    state_slots[boundary[1]] = -1
    kv_slots[boundary[2]] = -1
    up_kv_slots = kv_slots.clone()
    if layout == "mixed":
        # The int32 extremes and the first slot past the cache (tests/edges.py). A state slot
        # only marks padding (< 0: skip), so INT32_MAX there writes like any other slot; a
        # cache slot past the cache is skipped by ours, where upstream, given -1 there
        # instead, would write out of bounds.
        state_slots[boundary[0]] = INT32_MAX
        state_slots[next(i for i, p in enumerate(tok_pos) if (p + 1) % cr)] = INT32_MIN
        for b, bad in zip(boundary[3:], invalid_slots(kv_pages * kv_block)[1:]):
            kv_slots[b], up_kv_slots[b] = bad, -1

    row_bytes = ROW512 if head == H512 else ROW128
    page_bytes = kv_block * row_bytes + 64
    cache_base = torch.randint(0, 256, (kv_pages * page_bytes,), generator=gen, dtype=torch.uint8)
    ang = torch.rand(max(tok_pos) + 1, ROPE // 2, generator=gen) * 6.3
    return SimpleNamespace(
        head=head, cr=cr, overlap=overlap, state_block=state_block, n=n, gen=gen,
        positions=torch.tensor(tok_pos, dtype=torch.int64),
        token_to_req=torch.tensor(tok_req, dtype=torch.int32),
        state=state, backing=backing, block_table=block_table, state_slots=state_slots,
        kv_slots=kv_slots, up_kv_slots=up_kv_slots, cache_base=cache_base, row_bytes=row_bytes,
        pages=lambda b: b.as_strided((kv_pages, kv_block, row_bytes), (page_bytes, row_bytes, 1)),
        cos_sin=torch.cat([ang.cos(), ang.sin()], dim=1).contiguous(),
        weight=(1 + 0.25 * torch.randn(head, generator=gen)).to(torch.bfloat16),
        eps=1e-6, window_rows=window_rows, mx_scale=False)


def _to(s: SimpleNamespace, device) -> SimpleNamespace:
    s = SimpleNamespace(**vars(s))
    pad = s.state.stride(0)
    s.backing = s.backing.to(device)
    s.state = s.backing.as_strided(tuple(s.state.shape), (pad, s.state.shape[2], 1))
    for k in ("positions", "token_to_req", "block_table", "state_slots", "kv_slots",
              "up_kv_slots", "cache_base", "cos_sin", "weight"):
        setattr(s, k, getattr(s, k).to(device))
    return s


# ----------------------------------------------------------------- launches
def _run_ours(s, variant: str) -> torch.Tensor:
    out = s.cache_base.clone()
    sparse = s.head == H512
    v4c.compress_norm_rope_store_triton(
        s.state, s.n, s.token_to_req, s.positions, s.state_slots, s.block_table, s.state_block,
        s.state.shape[2] // 2, s.cos_sin, s.pages(out), SimpleNamespace(slot_mapping=s.kv_slots),
        {}, s.head, ROPE, s.cr, s.overlap, False, s.weight, s.eps,
        rec.QUANT_BLOCK if sparse else H128, rec.DATA_BYTES if sparse else H128,
        rec.SCALE_BYTES if sparse else 4, mx_scale=s.mx_scale, variant=variant)
    return out


def _run_upstream(up, s) -> torch.Tensor:
    out = s.cache_base.clone()
    cache = s.pages(out)
    args = (s.state, s.state.stride(0), s.state.stride(1), s.token_to_req, s.positions,
            s.state_slots, s.block_table, s.block_table.stride(0), s.state_block, s.weight, s.eps,
            s.cos_sin, s.cos_sin.stride(0), cache, s.up_kv_slots, cache.shape[1])
    common = dict(HEAD_SIZE=s.head, TRITON_BLOCK_SIZE=s.head, STATE_WIDTH=s.state.shape[2] // 2,
                  COMPRESS_RATIO=s.cr, OVERLAP=s.overlap, ROPE_HEAD_DIM=ROPE, FP8_MAX=448.0,
                  KV_BLOCK_STRIDE=cache.stride(0))
    if s.head == H512:  # compress_norm_rope_store_triton's head-512 launch
        up._fused_kv_compress_norm_rope_insert_sparse_attn[(s.n,)](
            *args, QUANT_BLOCK=64, TOKEN_STRIDE=576, SCALE_DIM=8, SANITIZE_CACHE_NANS=False,
            num_warps=4, **common)
    else:  # FusedKVCompressNormRopeInsertIndexerTritonKernel's launch
        up._fused_kv_compress_norm_rope_insert_indexer_attn[(s.n,)](
            *args, QUANT_BLOCK=128, TOKEN_STRIDE=128, SCALE_DIM=4, MX_SCALE=s.mx_scale,
            num_warps=1, **common)
    return out


# ----------------------------------------------------------------- plain-torch reference
_INV_FP8_MAX = torch.tensor(1.0 / 448.0, dtype=torch.float32)


def _e4m3_quant(x: torch.Tensor, blocks: int):
    """Power-of-two block scales (amax floor 1e-4) and e4m3 bytes, as the writers compute."""
    xb = x.view(blocks, -1)
    amax = xb.abs().amax(dim=1).clamp_min(1e-4)
    e = torch.ceil(torch.log2(amax * _INV_FP8_MAX.to(x.device)))
    scaled = (xb * torch.exp2(-e)[:, None]).clamp(-448.0, 448.0)
    return e, scaled.flatten(), scaled.to(torch.float8_e4m3fn).view(torch.uint8).flatten()


def _reference(s) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected cache bytes, every pre-cast e4m3 input) by plain torch, token by token."""
    out = s.cache_base.clone()
    cache = s.pages(out)
    head, nope = s.head, s.head - ROPE
    sw = s.state.shape[2] // 2
    scaled_all = []
    for t in range(s.n):
        p = int(s.positions[t])
        if s.state_slots[t] < 0 or (p + 1) % s.cr or s.kv_slots[t] < 0:
            continue
        pg, off, half = s.window_rows(int(s.token_to_req[t]), p)
        pg, off, half = pg.to(out.device), off.to(out.device), half.to(out.device)
        cols = half[:, None] * head + torch.arange(head, device=out.device)[None, :]
        kv = s.state[pg[:, None], off[:, None], cols]
        score = s.state[pg[:, None], off[:, None], cols + sw]
        pooled = (kv * torch.softmax(score, dim=0)).sum(dim=0)  # rows before 0 are absent
        normed = pooled * torch.rsqrt((pooled * pooled).sum() / head + s.eps) * s.weight.float()
        # GPT-J RoPE at the group's first position. The NoPE pairs go through the same
        # expressions with (cos, sin) = (1, 0), as in the kernels: odd * 1 + even * 0
        # turns a -0 into +0, which the indexer's fp8 bytes show.
        cp = p // s.cr * s.cr
        one, zero = torch.ones(nope // 2, device=out.device), torch.zeros(nope // 2, device=out.device)
        cos = torch.cat([one, s.cos_sin[cp, : ROPE // 2].float()])
        sin = torch.cat([zero, s.cos_sin[cp, ROPE // 2:].float()])
        even, odd = normed[0::2], normed[1::2]
        rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=1).flatten()
        rope = rotated[nope:]
        slot = int(s.kv_slots[t])
        page = cache[slot // cache.shape[1]].flatten()
        r = slot % cache.shape[1]
        if head == H512:
            e, scaled, q = _e4m3_quant(normed.bfloat16().float(), head // rec.QUANT_BLOCK)
            page[r * 576: r * 576 + nope] = q[:nope]
            page[r * 576 + nope: r * 576 + 576] = rope.bfloat16().view(torch.uint8)
            sc = (e + 127).clamp(0, 255).to(torch.uint8)
            sc[rec.NUM_SCALES] = 0
            page[cache.shape[1] * 576 + r * 8: cache.shape[1] * 576 + r * 8 + 8] = sc
            scaled_all.append(scaled[:nope])
        else:
            x = rotated.bfloat16().float()
            e, scaled, q = _e4m3_quant(x, 1)
            page[r * head: r * head + head] = q
            scale = torch.exp2(e)
            if s.mx_scale:
                scale = ((scale.view(torch.int32) >> 23) & 0xFF) * 0x01010101
            at = cache.shape[1] * head + r * 4
            page[at: at + 4] = scale.view(torch.uint8)
            scaled_all.append(scaled)
    return out, torch.cat(scaled_all)


def _four_squares(n: int) -> list[int]:
    for a in range(math.isqrt(n), -1, -1):
        for b in range(min(a, math.isqrt(n - a * a)), -1, -1):
            for c in range(min(b, math.isqrt(n - a * a - b * b)), -1, -1):
                d = math.isqrt(n - a * a - b * b - c * c)
                if a * a + b * b + c * c + d * d == n:
                    return [a, b, c, d]
    raise AssertionError(n)


def _make_exact(s) -> None:
    """Overwrite the boundary windows, the weight and cos/sin with exact inputs (module doc)."""
    gen, head, nope = s.gen, s.head, s.head - ROPE
    sw = s.state.shape[2] // 2
    # Shared norm weight: NoPE dims +-{1, 1.5} * 2^E with E per 64-block in [-20, 12] and
    # some dims 8 or 12 binades lower (e4m3 subnormals after scaling); one all-zero block
    # (the amax floor, head 512 only); the 8 fix-up dims powers of two; RoPE dims
    # +-{0.5, 1, 2}.
    blk = torch.randint(-20, 13, (head // 64,), generator=gen)
    if head == H128:  # keep the NoPE fix-ups above the RoPE dims (the row's one amax)
        blk[0] = blk[0].abs() // 2 + 4
    blk = blk.repeat_interleave(64)
    drop = torch.tensor([0, 0, 0, -8, -12])[torch.randint(0, 5, (head,), generator=gen)]
    mant = torch.tensor([1.0, 1.5])[torch.randint(0, 2, (head,), generator=gen)]
    sign = torch.randint(0, 2, (head,), generator=gen) * 2 - 1
    w = sign * mant * torch.exp2((blk + drop).float())
    fix = torch.arange(nope - 8, nope)
    w[fix] = sign[fix] * torch.exp2(blk[fix].float())
    w[nope:] = sign[nope:] * torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (ROPE,), generator=gen)]
    if head == H512:
        w[128:192] = 0.0
    s.weight = w.to(torch.bfloat16)
    assert torch.equal(s.weight.float(), w)
    s.cos_sin = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0])[
        torch.randint(0, 7, s.cos_sin.shape, generator=gen)]
    s.eps = 0.0

    for t in range(s.n):
        p = int(s.positions[t])
        if (p + 1) % s.cr:
            continue
        # Integer row c: NoPE in [-23, 23], RoPE in [-7, 7], then 8 fix-up dims (<= 224)
        # bring sum(c^2) to head * 4^k, so RMSNorm's rsqrt is exactly 2^-k.
        while True:
            c = torch.randint(-23, 24, (head,), generator=gen)
            c[nope:] = torch.randint(-7, 8, (ROPE,), generator=gen)
            c[fix] = 0
            rest = int((c * c).sum())
            k = 0
            while head * 4 ** k < rest:
                k += 1
            need = head * 4 ** k - rest
            # The first fix-up is 7 * 2^i, the largest value of its block (head 512) or
            # row (head 128): that block's amax is 448 * 2^j and its peak byte saturates.
            top = max((7 << i for i in range(6) if (7 << i) ** 2 <= need), default=0)
            vals = [top]
            need -= top * top
            for _ in range(3):
                a = min(top, math.isqrt(need))
                vals.append(a)
                need -= a * a
            vals += _four_squares(need)
            if top and max(vals) <= top:
                break
        c[fix] = torch.tensor(vals) * (torch.randint(0, 2, (8,), generator=gen) * 2 - 1)
        assert int((c * c).sum()) == head * 4 ** k

        pg, off, half = s.window_rows(int(s.token_to_req[t]), p)
        rows = pg.numel()
        cols = half[:, None] * head + torch.arange(head)[None, :]
        m_choices = [m for m in (1, 2, 4, 8, rows) if m <= rows and m & (m - 1) == 0]
        m = torch.tensor(m_choices)[torch.randint(0, len(m_choices), (head,), generator=gen)]
        hot = torch.rand(rows, head, generator=gen).argsort(dim=0).argsort(dim=0) < m[None, :]
        top = torch.randn(head, generator=gen).expand(rows, head)
        junk = torch.rand(rows, head, generator=gen) * 1e3  # >= 0: cold products are +0
        kv = torch.where(hot, c.float().expand(rows, head), junk)
        score = torch.where(hot, top, top - 300.0)
        s.state.index_put_((pg[:, None], off[:, None], cols), kv)
        s.state.index_put_((pg[:, None], off[:, None], cols + sw), score)


def _check_edges(scaled: torch.Tensor, head: int) -> None:
    """The exact cases must reach the cast's edges: ties, subnormals, +-448."""
    a = scaled.abs().double()
    assert (a == 448.0).any(), "no saturated (+-448) value"
    assert ((a > 0) & (a < 2.0 ** -6)).any(), "no e4m3 subnormal"
    # A tie: halfway between two e4m3 neighbours (normal spacing 2^(e-3), subnormal 2^-9).
    e = torch.floor(torch.log2(a.clamp_min(2.0 ** -6)))
    step = torch.exp2(e - 3)
    frac = a / step * 2
    assert ((frac == torch.round(frac)) & (torch.round(frac) % 2 == 1) & (a < 448)).any(), "no tie"
    if head == H512:
        assert (scaled == 0).sum() >= 64, "no zero block"


# ----------------------------------------------------------------- tests
# (ratio, overlap, state block, cache block): V4's c4a (overlap, 4-row state pages, 64-entry
# cache pages) and c128a (no overlap, 8-row pages, 2-entry pages), plus page sizes that do
# not divide the window, single-entry pages and ratio 4 without overlap.
SPARSE_CASES = [(4, True, 4, 64), (4, True, 3, 1), (4, False, 5, 16), (128, False, 8, 2),
                (128, False, 5, 1), (4, True, ODD_PAGES[0], ODD_PAGES[2])]


@pytest.mark.parametrize("cr,overlap,state_block,kv_block", SPARSE_CASES,
                         ids=[f"cr{c[0]}-ov{int(c[1])}-sb{c[2]}-kb{c[3]}" for c in SPARSE_CASES])
def test_sparse_attn_matches_upstream(up, device, cr, overlap, state_block, kv_block):
    s = _to(_scenario(H512, cr, overlap, state_block, kv_block, seed=cr + 10 * state_block + kv_block),
            device)
    outs = {v: _run_ours(s, v) for v in _variants(device)}
    assert not torch.equal(outs["sm80"], s.cache_base)
    if _has_fp8(device):
        ref = _run_upstream(up, s)
        for v, o in outs.items():
            _assert_same(o, ref, f"{v} vs upstream")  # every byte, page padding included
        _assert_same(outs["sm80"], outs["sm90"], "sm80 vs sm90")


@pytest.mark.parametrize("mx_scale", [False, True])
@pytest.mark.parametrize("state_block,kv_block", [(4, 64), (3, ODD_PAGES[0]), (5, ODD_PAGES[1])])
def test_indexer_matches_upstream(up, device, mx_scale, state_block, kv_block):
    s = _to(_scenario(H128, 4, True, state_block, kv_block, seed=50 + state_block + mx_scale), device)
    s.mx_scale = mx_scale
    outs = {v: _run_ours(s, v) for v in _variants(device)}
    assert not torch.equal(outs["sm80"], s.cache_base)
    if _has_fp8(device):
        ref = _run_upstream(up, s)
        for v, o in outs.items():
            _assert_same(o, ref, f"{v} vs upstream")
        _assert_same(outs["sm80"], outs["sm90"], "sm80 vs sm90")


EXACT_CASES = [(H512, 4, True, 4, 16), (H512, 128, False, 8, 2), (H128, 4, True, 3, 16)]


@pytest.mark.parametrize("head,cr,overlap,state_block,kv_block", EXACT_CASES,
                         ids=[f"h{c[0]}-cr{c[1]}" for c in EXACT_CASES])
def test_matches_torch_reference_exactly(up, device, head, cr, overlap, state_block, kv_block):
    s = _scenario(head, cr, overlap, state_block, kv_block, seed=7 * cr + head, layout="boundaries")
    _make_exact(s)
    s = _to(s, device)
    expect, scaled = _reference(s)
    _check_edges(scaled.cpu(), head)
    for v in _variants(device):
        _assert_same(_run_ours(s, v), expect, f"{v} vs torch reference")
    if _has_fp8(device):
        _assert_same(_run_upstream(up, s), expect, "upstream vs torch reference")


def test_indexer_mx_scale_matches_torch_reference(device):
    s = _scenario(H128, 4, True, 4, 8, seed=99, layout="boundaries")
    _make_exact(s)
    s = _to(s, device)
    s.mx_scale = True
    expect, _ = _reference(s)
    _assert_same(_run_ours(s, "sm80"), expect, "sm80 (mx scales) vs torch reference")


def test_default_variant_and_empty_batch(device):
    s = _to(_scenario(H128, 4, True, 4, 16, seed=3), device)
    if device == "cpu":  # variant=None resolves to "cpu" here: the software cast
        out = s.cache_base.clone()
        v4c.compress_norm_rope_store_triton(
            s.state, s.n, s.token_to_req, s.positions, s.state_slots, s.block_table,
            s.state_block, s.state.shape[2] // 2, s.cos_sin, s.pages(out),
            SimpleNamespace(slot_mapping=s.kv_slots), {"launch_pdl": False}, H128, ROPE, 4, True,
            False, s.weight, s.eps, 128, 128, 4)
        _assert_same(out, _run_ours(s, "sm80"), "default variant vs sm80")
    s.n = 0
    _assert_same(_run_ours(s, "sm80"), s.cache_base, "num_actual 0 writes nothing")


def _call(**over):
    s = _scenario(H512, 4, True, 4, 16, seed=1)
    kw = dict(state_cache=s.state, num_actual=s.n, token_to_req_indices=s.token_to_req,
              positions=s.positions, slot_mapping=s.state_slots, block_table=s.block_table,
              block_size=4, state_width=s.state.shape[2] // 2, cos_sin_cache=s.cos_sin,
              kv_cache=s.pages(s.cache_base.clone()),
              k_cache_metadata=SimpleNamespace(slot_mapping=s.kv_slots), pdl_kwargs={},
              head_dim=H512, rope_head_dim=ROPE, compress_ratio=4, overlap=True,
              use_fp4_cache=False, rms_norm_weight=s.weight, rms_norm_eps=1e-6, quant_block=64,
              token_stride=576, scale_dim=8)
    kw.update(over)
    v4c.compress_norm_rope_store_triton(**kw)


def test_validation_names_the_tensor():
    s = _scenario(H512, 4, True, 4, 16, seed=1)
    bad = [
        (dict(state_cache=s.state.to(torch.bfloat16)), "state_cache"),
        (dict(state_width=100), "state_width"),
        (dict(kv_cache=torch.zeros(4, 16, 528, dtype=torch.uint8)), "kv_cache"),
        (dict(kv_cache=torch.zeros(4, 16, 584, dtype=torch.uint8)[:, :, :584].transpose(0, 1)), "kv_cache"),
        (dict(positions=s.positions[:3]), "positions"),
        (dict(k_cache_metadata=SimpleNamespace()), "k_cache_metadata.slot_mapping"),
        (dict(block_table=s.block_table.float()), "block_table"),
        (dict(cos_sin_cache=s.cos_sin[:, :32]), "cos_sin_cache"),
        (dict(rms_norm_weight=s.weight[:128]), "rms_norm_weight"),
        (dict(compress_ratio=6), "compress_ratio"),
        (dict(num_actual=-1), "num_actual"),
        (dict(block_size=0), "block_size"),
        (dict(slot_mapping=s.state_slots[::2]), "slot_mapping"),
        (dict(head_dim=256), "head_dim"),
        (dict(token_stride=512), "token_stride"),
        (dict(rope_head_dim=32), "rope_head_dim"),
        (dict(variant="sm70"), "variant"),
    ]
    for over, name in bad:
        with pytest.raises(ValueError, match=name):
            _call(**over)
    with pytest.raises(NotImplementedError):
        _call(store_full_kv=True)
    with pytest.raises(NotImplementedError):  # MXFP4 indexer cache
        si = _scenario(H128, 4, True, 4, 16, seed=2)
        _call(state_cache=si.state, head_dim=H128, use_fp4_cache=True, rms_norm_weight=si.weight,
              quant_block=32, token_stride=64, scale_dim=4)
