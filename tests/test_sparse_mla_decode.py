"""Unified 512-dim sparse MLA decode (vllm.deepinfer.kernels.sparse_mla_decode).

Reference: an fp32 torch computation over kv_record.read_rows (the package's one record
reader; NaN key entries zeroed as upstream does, sink logit in the softmax denominator, inverse GPT-J RoPE of dims 448..511
when asked). Tolerance, per output element: |ours - ref| <= TOL_ABS + TOL_REL * sum_k p_k |v_k|
(the magnitude of the terms the element sums; >= |ref|). Under the interpreter the kernel
computes in fp32 (DOT_FP32) and only the bf16 output store rounds (the interpreter truncates:
< 2^-7 |ref|); on a GPU, bf16 P adds < 2^-9 sum p|v| and the store rounds to nearest
(2^-9 |ref|), inside the same bound.
"""
from __future__ import annotations

import importlib
import itertools
import math

import pytest
import torch

from edges import INT32_MAX, INT32_MIN, ODD_PAGES, invalid_slots
from vllm.deepinfer import kv_record
from vllm.deepinfer.kernels import sparse_mla_decode as smd

H = 16
NOPE, ROPE, D = kv_record.NOPE_DIM, kv_record.ROPE_DIM, kv_record.HEAD_DIM
TOL_ABS, TOL_REL = 1e-3, 1e-2
# The two code paths: software e4m3 decode (sm80 = cpu tile) and hardware cvt (sm90 tile).
VARIANTS = ["sm80", "sm90"]


# ----------------------------------------------------------------------------- helpers
def make_cache(num_blocks, block_size, device, gen, *, page_pad=0):
    """A cache filled with quantized random rows; ``page_pad`` > 0 gives a page stride
    larger than block_size * 584 (pages of one shared physical block, as V4.1 lays out)."""
    n = num_blocks * block_size
    k = torch.randn(n, D, generator=gen)
    # Per-64-block magnitudes from 2^-6 to 2^5, so the UE8M0 scales differ within a row.
    k[:, :NOPE] *= torch.exp2(torch.randint(-6, 6, (n, 7), generator=gen).float()).repeat_interleave(64, 1)
    nope, scales, rope = kv_record.quantize_rows(k)
    stride = block_size * kv_record.RECORD_BYTES + page_pad
    raw = torch.zeros(num_blocks * stride, dtype=torch.uint8)
    cache = raw.as_strided((num_blocks, block_size, kv_record.RECORD_BYTES),
                           (stride, kv_record.RECORD_BYTES, 1))
    kv_record.write_records(cache, torch.arange(n), nope, scales, rope)
    return raw.to(device).as_strided(cache.shape, cache.stride())


def ragged(lists, device):
    """Ragged int32 slot lists -> (indices, indptr)."""
    indptr = torch.tensor([0, *itertools.accumulate(len(x) for x in lists)], dtype=torch.int32)
    flat = torch.tensor([s for x in lists for s in x], dtype=torch.int32)
    return flat.to(device), indptr.to(device)


def cos_sin_cache(positions, device):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
    ang = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).to(device)


def inverse_rope_ref(o, pos, cs):
    o = o.clone()
    c, s = cs[pos.long(), :ROPE // 2], cs[pos.long(), ROPE // 2:]
    a, b = o[..., NOPE::2].clone(), o[..., NOPE + 1::2].clone()
    o[..., NOPE::2] = a * c[:, None, :] + b * s[:, None, :]
    o[..., NOPE + 1::2] = b * c[:, None, :] - a * s[:, None, :]
    return o


def reference(q, main_cache, main_idx, main_ptr, scale, sink, extra_cache=None, extra_idx=None,
              extra_ptr=None, pos=None, cs=None, magnitude=False):
    """fp32 [tokens, heads, 512]; with ``magnitude`` also sum_k p_k |v_k| (the size of the
    terms each output element sums, what bf16 rounding of P is relative to)."""
    q, main_idx, main_ptr = q.cpu().float(), main_idx.cpu(), main_ptr.cpu()
    caches = [(main_cache.cpu(), main_idx, main_ptr)]
    if extra_cache is not None:
        caches.append((extra_cache.cpu(), extra_idx.cpu(), extra_ptr.cpu()))
    out = torch.zeros(q.shape[0], q.shape[1], D)
    mag = torch.zeros_like(out)
    for t in range(q.shape[0]):
        rows = []
        for cache, idx, ptr in caches:
            s = idx[int(ptr[t]):int(ptr[t + 1])].long()
            s = s[(s >= 0) & (s < cache.shape[0] * cache.shape[1])]
            if len(s):
                rows.append(kv_record.read_rows(cache, s, scrub_nan=True))
        k = torch.cat(rows) if rows else torch.zeros(0, D)
        logits = (q[t] @ k.T) * scale
        if sink is not None:
            logits = torch.cat([logits, sink.cpu().float()[:, None]], dim=1)
        if logits.shape[1] == 0:
            continue
        p = torch.softmax(logits, dim=1)[:, :k.shape[0]]
        out[t] = p @ k
        mag[t] = p @ k.abs()
    if pos is not None:
        out = inverse_rope_ref(out, pos.cpu(), cs.cpu())
        pair = mag[..., NOPE::2] + mag[..., NOPE + 1::2]  # a rotated lane mixes its pair
        mag[..., NOPE::2], mag[..., NOPE + 1::2] = pair, pair
    return (out, mag) if magnitude else out


def assert_close(ours, ref):
    """``ref``: the reference output, or (output, magnitude) from reference(magnitude=True)."""
    ref, mag = ref if isinstance(ref, tuple) else (ref, None)
    assert ours.dtype == torch.bfloat16
    o = ours.float().cpu()
    assert not torch.isnan(o).any()
    err = (o - ref).abs()
    bound = TOL_ABS + TOL_REL * (ref.abs() if mag is None else mag)
    assert (err <= bound).all(), (
        f"max abs diff {err.max():.4g}, worst excess {(err - bound).max():.4g} "
        f"(bound {TOL_ABS} + {TOL_REL} * {'|ref|' if mag is None else 'sum p|v|'})")


def setup(device, seed, *, main_lens, extra_lens=None, main_bs=32, extra_bs=64, main_blocks=4,
          extra_blocks=3, invalid=0.0, page_pad=0, heads=H):
    gen = torch.Generator().manual_seed(seed)
    T = len(main_lens)
    q = torch.randn(T, heads, D, generator=gen).to(torch.bfloat16).to(device)
    mc = make_cache(main_blocks, main_bs, device, gen, page_pad=page_pad)

    def lists(lens, nrows):
        out = []
        bad_values = torch.tensor(invalid_slots(nrows))
        for n in lens:
            s = torch.randint(0, nrows, (n,), generator=gen)
            bad = torch.rand(n, generator=gen) < invalid
            s[bad] = bad_values[torch.randint(0, len(bad_values), (int(bad.sum()),),
                                              generator=gen)]
            out.append(s.tolist())
        return out

    mi, mp = ragged(lists(main_lens, main_blocks * main_bs), device)
    ex = {}
    if extra_lens is not None:
        ec = make_cache(extra_blocks, extra_bs, device, gen)
        ei, ep = ragged(lists(extra_lens, extra_blocks * extra_bs), device)
        ex = dict(extra_cache=ec, extra_indices=ei, extra_indptr=ep)
    sink = (torch.randn(heads, generator=gen) * 2).to(device)
    return q, mc, mi, mp, sink, ex


def run_both(q, mc, mi, mp, sink, ex, *, variant, splits, inv_rope=False, device="cpu",
             predequant=None):
    scale = 1.0 / math.sqrt(D)
    kw = {}
    pos = cs = None
    if inv_rope:
        cs = cos_sin_cache(4096, device)
        pos = torch.randint(0, 4096, (q.shape[0],), generator=torch.Generator().manual_seed(7)).to(device)
        kw = dict(inv_rope_positions=pos, inv_rope_cos_sin_cache=cs)
    ours = smd.sparse_attn_decode(q, mc, mi, mp, scale, sink, NOPE, ROPE, **ex, **kw,
                                  num_kv_splits=splits, variant=variant, predequant=predequant)
    ref = reference(q, mc, mi, mp, scale, sink, ex.get("extra_cache"), ex.get("extra_indices"),
                    ex.get("extra_indptr"), pos, cs, magnitude=True)
    return ours, ref


@pytest.fixture(autouse=True)
def _single_phase(monkeypatch):
    """This module tests the single-phase path: sm80/cpu launches of PREDEQUANT_MIN_TOKENS
    tokens or more would otherwise run in two phases (tests/test_sparse_mla_decode_predequant.py
    tests those, and the selection)."""
    monkeypatch.setenv("DEEPINFER_DECODE_PREDEQUANT", "0")


# ----------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("splits", [1, 3])
def test_swa_only_near_sequence_start(device, variant, splits):
    # Few keys per token (positions near the start), several tokens, no extra cache.
    q, mc, mi, mp, sink, ex = setup(device, 1, main_lens=[1, 3, 20, 37])
    ours, ref = run_both(q, mc, mi, mp, sink, ex, variant=variant, splits=splits, device=device)
    assert_close(ours, ref)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("splits", [1, 2])
def test_topk_only_empty_main(device, variant, splits):
    q, mc, mi, mp, sink, ex = setup(device, 2, main_lens=[0, 0, 0], extra_lens=[50, 7, 33])
    ours, ref = run_both(q, mc, mi, mp, sink, ex, variant=variant, splits=splits, device=device)
    assert_close(ours, ref)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("splits,inv_rope", [(1, False), (1, True), (4, True), (2, False)])
def test_swa_plus_topk_invalid_entries(device, variant, splits, inv_rope):
    # -1 and out-of-range slots inside both lists; tiles straddle the main/extra boundary.
    q, mc, mi, mp, sink, ex = setup(device, 3, main_lens=[21, 5, 40], extra_lens=[30, 44, 9],
                                    invalid=0.3)
    ours, ref = run_both(q, mc, mi, mp, sink, ex, variant=variant, splits=splits,
                         inv_rope=inv_rope, device=device)
    assert_close(ours, ref)


@pytest.mark.parametrize("main_bs,extra_bs", [(ODD_PAGES[0], ODD_PAGES[1]),
                                               (ODD_PAGES[2], ODD_PAGES[0])])
def test_odd_page_sizes_and_extreme_slots(device, main_bs, extra_bs):
    # Pages that are not powers of two (general division of the slot) with page strides that
    # are not 16-byte multiples, and every invalid slot value (INT32_MIN, INT32_MAX, the
    # first slots past the cache, -1) in both lists; split and unsplit.
    q, mc, mi, mp, sink, ex = setup(device, 13, main_lens=[9, 26], extra_lens=[31, 4],
                                    main_bs=main_bs, extra_bs=extra_bs, main_blocks=3,
                                    extra_blocks=2, invalid=0.35)
    for lst in (mi, ex["extra_indices"]):  # both extremes in each list, whatever was drawn
        lst[2], lst[5] = INT32_MIN, INT32_MAX
    for splits in (1, 2):
        ours, ref = run_both(q, mc, mi, mp, sink, ex, variant="sm80", splits=splits,
                             inv_rope=splits == 2, device=device)
        assert_close(ours, ref)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("splits,inv_rope", [(1, True), (3, False)])
def test_prefetch_matches_no_prefetch(device, monkeypatch, prefetch, splits, inv_rope):
    # The register double-buffered key loop (Tile.prefetch) against the reference, with
    # invalid slots and tiles straddling the main/extra boundary; the last prefetch reads
    # past the split's end (masked).
    import dataclasses
    for v in ("sm80", "sm90", "cpu"):
        monkeypatch.setitem(smd.TILES, v, dataclasses.replace(smd.TILES[v], prefetch=prefetch))
    q, mc, mi, mp, sink, ex = setup(device, 5, main_lens=[21, 0, 40], extra_lens=[30, 44, 9],
                                    invalid=0.3)
    ours, ref = run_both(q, mc, mi, mp, sink, ex, variant="sm80", splits=splits,
                         inv_rope=inv_rope, device=device)
    assert_close(ours, ref)


@pytest.mark.parametrize("variant,heads", [("sm90", 64), ("sm90", 80), ("sm80", 20)])
def test_head_tiles(device, variant, heads):
    # sm90: one program owns 64 heads (80 heads: a second, partly masked head tile);
    # sm80: 16-head tiles with a masked remainder.
    q, mc, mi, mp, sink, ex = setup(device, 12, main_lens=[7, 30], extra_lens=[40, 0],
                                    heads=heads, invalid=0.1)
    for splits in (1, 2):
        ours, ref = run_both(q, mc, mi, mp, sink, ex, variant=variant, splits=splits,
                             inv_rope=splits == 2, device=device)
        assert_close(ours, ref)


@pytest.mark.parametrize("with_sink", [True, False])
@pytest.mark.parametrize("splits", [1, 3])
def test_all_invalid_rows_give_zeros(device, with_sink, splits):
    # Row 0: only invalid slots; row 1: no keys at all; row 2: normal.
    gen = torch.Generator().manual_seed(4)
    mc = make_cache(2, 32, device, gen)
    q = torch.randn(3, H, D, generator=gen).to(torch.bfloat16).to(device)
    mi, mp = ragged([[-1, 64, 1000, -5], [], [3, 9, 60]], device)
    sink = torch.randn(H, generator=gen).to(device) if with_sink else None
    scale = 1.0 / math.sqrt(D)
    out = smd.sparse_attn_decode(q, mc, mi, mp, scale, sink, NOPE, ROPE, num_kv_splits=splits,
                                 variant="sm80")
    assert not torch.isnan(out.float()).any()
    assert torch.equal(out[:2].float().cpu(), torch.zeros(2, H, D))
    assert_close(out, reference(q, mc, mi, mp, scale, sink, magnitude=True))


@pytest.mark.parametrize("splits", [1, 2])
def test_no_sink_and_shared_page_stride(device, splits):
    # attn_sink None; cache pages through a stride larger than block_size*584 and not a
    # multiple of 16 (the unaligned-load path).
    q, mc, mi, mp, _, ex = setup(device, 5, main_lens=[12, 30], extra_lens=[17, 3], page_pad=40)
    assert mc.stride(0) % 16 != 0
    ours, ref = run_both(q, mc, mi, mp, None, ex, variant="sm80", splits=splits, device=device)
    assert_close(ours, ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_nan_keys_are_scrubbed(device, variant):
    # An e4m3 NaN byte (0x7F) in a NoPE column and a bf16 NaN in a RoPE column: upstream
    # zeroes NaN key entries, so does the reference.
    if variant == "sm90" and device == "cpu":
        pytest.skip("the interpreter's fp8 conversion (sm90 path on CPU) reads 0x7F as 480")
    q, mc, mi, mp, sink, ex = setup(device, 6, main_lens=[9, 4])
    raw = mc.as_strided((mc.shape[0], mc.shape[1] * kv_record.RECORD_BYTES), (mc.stride(0), 1))
    slot = int(mi[0])
    b, i = divmod(slot, mc.shape[1])
    raw[b, i * kv_record.DATA_BYTES + 5] = 0x7F
    raw[b, i * kv_record.DATA_BYTES + NOPE + 2 * 3: i * kv_record.DATA_BYTES + NOPE + 2 * 3 + 2] = \
        torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8).to(raw.device)
    for splits in (1, 2):
        ours, ref = run_both(q, mc, mi, mp, sink, ex, variant=variant, splits=splits, device=device)
        assert_close(ours, ref)


def test_inverse_rope_applied_once_in_both_paths(device):
    q, mc, mi, mp, sink, ex = setup(device, 8, main_lens=[25, 40], extra_lens=[20, 10])
    plain, ref = run_both(q, mc, mi, mp, sink, ex, variant="sm80", splits=1, device=device)
    direct, ref_rot = run_both(q, mc, mi, mp, sink, ex, variant="sm80", splits=1, inv_rope=True,
                               device=device)
    split, _ = run_both(q, mc, mi, mp, sink, ex, variant="sm80", splits=3, inv_rope=True,
                        device=device)
    assert_close(direct, ref_rot)
    assert_close(split, ref_rot)
    # NoPE dims are untouched by the rotation; the RoPE dims really changed.
    assert torch.equal(direct[..., :NOPE], plain[..., :NOPE])
    assert not torch.allclose(direct[..., NOPE:].float(), plain[..., NOPE:].float(), atol=1e-2)


def test_default_split_choice_runs(device):
    q, mc, mi, mp, sink, ex = setup(device, 9, main_lens=[33, 2], extra_lens=[10, 60])
    ours, ref = run_both(q, mc, mi, mp, sink, ex, variant=None, splits=None, device=device)
    assert_close(ours, ref)


# ----------------------------------------------------------------------------- split heuristic
def test_choose_num_splits():
    t = smd.TILES["sm90"]  # 64-key tiles, one CTA per SM
    # One token, 640 keys (10 key tiles): one tile per CTA.
    assert smd.choose_num_splits(1, 1, 640, t, 132) == 10
    # 16 tokens: at most 8 splits fit one wave; 2 tiles per split need only 5 splits.
    assert smd.choose_num_splits(16, 1, 640, t, 132) == 5
    # 64 tokens: 2 splits (128 CTAs); 3 would need a second wave.
    assert smd.choose_num_splits(64, 1, 640, t, 132) == 2
    # The grid already fills the GPU: no split (direct bf16 output, no reduce launch).
    assert smd.choose_num_splits(128, 1, 640, t, 132) == 1
    assert smd.choose_num_splits(128, 2, 640, t, 132) == 1
    # Never more splits than key tiles; one split when there are no keys.
    assert smd.choose_num_splits(1, 1, 10, t, 132) == 1
    assert smd.choose_num_splits(1, 1, 0, t, 132) == 1


# ----------------------------------------------------------------------------- validation
def _args(device):
    q, mc, mi, mp, sink, ex = setup(device, 10, main_lens=[3], extra_lens=[2])
    return dict(q=q, main_cache=mc, main_indices=mi, main_indptr=mp, scale=0.04, attn_sink=sink,
                nope_head_dim=NOPE, rope_head_dim=ROPE, **ex)


@pytest.mark.parametrize("name,bad,match", [
    ("q", lambda a: a["q"].float(), "q"),
    ("q", lambda a: a["q"][..., :256], "q"),
    ("main_cache", lambda a: a["main_cache"].view(torch.int8), "main_cache"),
    ("main_cache", lambda a: a["main_cache"][..., :576], "main_cache"),
    ("main_indptr", lambda a: a["main_indptr"][:1], "main_indptr"),
    ("main_indices", lambda a: a["main_indices"].float(), "main_indices"),
    ("extra_indptr", lambda a: None, "give all three"),
    ("attn_sink", lambda a: a["attn_sink"][:4], "attn_sink"),
    ("nope_head_dim", lambda a: 512, "nope_head_dim"),
    ("rope_head_dim", lambda a: 32, "rope_head_dim"),
])
def test_validation_names_the_tensor(device, name, bad, match):
    a = _args(device)
    a[name] = bad(a)
    with pytest.raises(ValueError, match=match):
        smd.sparse_attn_decode(**a, variant="sm80")


def test_validation_inv_rope_pair_out_and_variant(device):
    a = _args(device)
    with pytest.raises(ValueError, match="inv_rope"):
        smd.sparse_attn_decode(**a, inv_rope_positions=torch.zeros(1, dtype=torch.int64,
                                                                   device=device))
    with pytest.raises(ValueError, match="out"):
        smd.sparse_attn_decode(**a, out=torch.empty(1, H, D, device=device))
    with pytest.raises(ValueError, match="variant"):
        smd.sparse_attn_decode(**a, variant="sm75")
    with pytest.raises(ValueError, match="num_kv_splits"):
        smd.sparse_attn_decode(**a, num_kv_splits=0)


def test_out_buffer_is_written_and_returned(device):
    a = _args(device)
    out = torch.full((1, H, D), 7.0, dtype=torch.bfloat16, device=device)
    assert smd.sparse_attn_decode(**a, out=out, variant="sm80") is out
    assert not (out == 7.0).all()


# ----------------------------------------------------------------------------- upstream
def _patch_interpreter_bf16(monkeypatch):
    """bf16 math as on a GPU for the upstream kernel run interpreted (tests/interp_bf16.py)."""
    import interp_bf16
    interp_bf16.patch(monkeypatch.setattr)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only comparison")
def test_matches_upstream_fallback_in_interpreter(upstream, monkeypatch):
    """Upstream's CUDA fallback (``_sparse_attn_decode_ragged_kernel``, launched as
    ``_rocm_sparse_attn_decode_ragged_triton`` launches it) run interpreted, bf16 math
    emulated in fp32 with RNE; ours and upstream both within tolerance of each other."""
    up = importlib.import_module("upstream_kernels.mla_sparse_decode")
    _patch_interpreter_bf16(monkeypatch)
    q, mc, mi, mp, sink, ex = setup("cpu", 11, main_lens=[9, 20], extra_lens=[24, 5], invalid=0.2)
    scale = 1.0 / math.sqrt(D)
    T = q.shape[0]
    out_up = torch.empty_like(q)
    ec, ei, ep = ex["extra_cache"], ex["extra_indices"], ex["extra_indptr"]
    up._sparse_attn_decode_ragged_kernel[(T, math.ceil(H / 16))](
        q, mc, mi, mp, ec, ei, ep, sink, out_up,
        q.stride(0), q.stride(1), out_up.stride(0), out_up.stride(1), mc.stride(0), ec.stride(0),
        mc.shape[0] * mc.shape[1], ec.shape[0] * ec.shape[1], mc.shape[1], ec.shape[1], scale, H,
        HAS_ATTN_SINK=True, HAS_EXTRA=True, NOPE_DIM=NOPE, NOPE_BLOCK=512, ROPE_DIM=ROPE,
        IS_FNUZ_MAIN=False, IS_FNUZ_EXTRA=False, BLOCK_H=16, BLOCK_K=16, num_warps=8)
    ours = smd.sparse_attn_decode(q, mc, mi, mp, scale, sink, NOPE, ROPE, **ex, num_kv_splits=1,
                                  variant="sm80")
    ref, mag = reference(q, mc, mi, mp, scale, sink, ec, ei, ep, magnitude=True)
    assert_close(out_up, (ref, mag))  # the emulation is faithful enough to serve as a reference
    assert_close(ours, (out_up.float(), mag))
