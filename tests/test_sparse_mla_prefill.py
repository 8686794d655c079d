"""Sparse MLA prefill over the gathered bf16 keys (vllm.deepinfer.kernels.sparse_mla_prefill).

Reference: an fp32 torch computation over the same bf16 workspace rows, with upstream's key
semantics (row t's keys: the first ``lens[t]`` entries of its dense row, or its ragged
slice; entries < 0 or >= rows skipped; the sink logit in the softmax denominator; a row
with no valid key gives zeros).

The error bound, per output element, is the one upstream's own kernel meets against that
reference (``test_upstream_meets_the_bound_and_ours_is_as_accurate`` checks it does):
|out - ref| <= TOL_ABS + TOL_REL * sum_k p_k |v_k|, the magnitude of the terms the element
sums (>= |ref|). On a GPU both kernels round P to bf16 (< 2^-9 of sum p|v|) and the output
to bf16 (2^-9 |ref|); interpreted, ours computes in fp32 (DOT_FP32) and only the output
store rounds, by truncation (< 2^-7 |ref|). "Never less accurate than upstream": with both
kernels' bf16 math (interp_bf16 on CPU, the hardware on a GPU) ours' RMS error against the
reference is within ACCURACY_SLACK of upstream's, at every shape tested.

The ``gpu`` tests run the production shapes (V4.1: 64 heads, top-k 512 + window 128; V4
c128a-style top-k 8192; 128 heads) on both tiles beside upstream's real kernel.
"""
from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch

from edges import INT32_MAX, INT32_MIN, invalid_slots
from vllm.deepinfer import envs, kv_record, routing
from vllm.deepinfer.kernels import sparse_mla_prefill as spm
from vllm.deepinfer.kernels import topk_swa

NOPE, ROPE, D = kv_record.NOPE_DIM, kv_record.ROPE_DIM, kv_record.HEAD_DIM
TOL_ABS, TOL_REL = 1e-3, 1e-2
# Ours' RMS error may exceed upstream's by at most this factor. Both round P and the output
# to bf16 the same way; the running max moves once per key tile, and a key that raises it
# gets P = 1 exactly, so tiles of 64 keys (sm90) round slightly more P values than
# upstream's 16: measured in the interpreter's bf16 emulation, RMS ratio 1.00 for the sm80
# tile, 1.006-1.009 for the sm90 tile at 640-key lists and 1.02-1.03 at the 48-key lists
# tested on CPU.
ACCURACY_SLACK = 1.05
# The two shipped tiles: sm80 (16 heads, plain form on 2 warps) and sm90 (64 heads per
# program, 8 warps); test_forms_with_growing_maxima also runs the split_d forms.
VARIANTS = ["sm80", "sm90"]
# On a GPU also the Triton tile the sm90 row falls back to (where sm90 runs the Gluon kernel
# of kernels/sparse_mla_prefill_gluon.py); in the interpreter sm90 is that tile.
GPU_VARIANTS = VARIANTS + ["sm90-triton"]
SCALE = 1.0 / math.sqrt(D)


# ----------------------------------------------------------------------------- helpers
def make(seed, *, tokens, heads, rows, width, invalid=0.0, device="cpu", scale_rows=None):
    """q [T, H, 512], workspace kv [rows, 512] (bf16), dense indices [T, width] with some
    invalid entries, sink [H]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(rows, D, generator=g)
    if scale_rows is not None:
        kv = kv * scale_rows[:, None]
    kv = kv.to(torch.bfloat16)
    idx = torch.randint(0, rows, (tokens, width), generator=g, dtype=torch.int32)
    if invalid:
        bad = torch.rand(tokens, width, generator=g) < invalid
        vals = torch.tensor(invalid_slots(rows), dtype=torch.int64)
        pick = vals[torch.randint(0, len(vals), (int(bad.sum()),), generator=g)]
        idx[bad] = pick.to(torch.int32)
    sink = torch.randn(heads, generator=g) * 2
    return tuple(x.to(device) for x in (q, kv, idx, sink))


def key_lists(idx, lens):
    """Upstream's dense semantics: row t's first lens[t] entries (clamped to the width)."""
    width = idx.shape[1]
    return [idx[t, :min(max(int(lens[t]), 0), width)].tolist() for t in range(idx.shape[0])]


def reference(q, kv, lists, sink, scale=SCALE):
    """fp32 (out [T, H, 512], sum_k p_k |v_k|)."""
    q, kv = q.cpu().float(), kv.cpu().float()
    T, H, _ = q.shape
    out, mag = torch.zeros(T, H, D), torch.zeros(T, H, D)
    for t, lst in enumerate(lists):
        s = torch.tensor([x for x in lst if 0 <= x < kv.shape[0]], dtype=torch.int64)
        k = kv[s]
        logits = (q[t] @ k.T) * scale
        if sink is not None:
            logits = torch.cat([logits, sink.cpu().float()[:, None]], dim=1)
        if logits.shape[1] == 0:
            continue
        p = torch.softmax(logits, dim=1)[:, :k.shape[0]]
        out[t], mag[t] = p @ k, p @ k.abs()
    return out, mag


def excess(ours, ref):
    """max over elements of |ours - ref| - bound (<= 0: within the bound)."""
    ref, mag = ref
    o = ours.float().cpu()[..., :ref.shape[-1]]
    r, m = ref[..., :o.shape[-1]], mag[..., :o.shape[-1]]
    return float(((o - r).abs() - (TOL_ABS + TOL_REL * m)).max())


def assert_close(ours, ref):
    assert ours.dtype == torch.bfloat16
    assert not torch.isnan(ours.float()).any()
    assert excess(ours, ref) <= 0, (
        f"max abs diff {(ours.float().cpu()[..., :ref[0].shape[-1]] - ref[0][..., :ours.shape[-1]]).abs().max():.4g}"
        f" exceeds {TOL_ABS} + {TOL_REL} * sum p|v|")


def rms(ours, ref):
    return float(((ours.float().cpu() - ref[0]) ** 2).mean().sqrt())


def run(q, kv, idx, lens, sink, variant, **kw):
    return spm.sparse_attn_prefill(q, kv, SCALE, sink, NOPE, ROPE, indices=idx,
                                   topk_length=lens, variant=variant, **kw)


@pytest.fixture
def tile_rows(monkeypatch):
    """Add rows to TILES for one test (the benchmarks' way of running other tiles)."""
    def add(name, **changes):
        base = changes.pop("base", "sm80")
        monkeypatch.setitem(spm.TILES, name, dataclasses.replace(spm.TILES[base], **changes))
        return name
    return add


# ----------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("variant", VARIANTS)
def test_dense_lists_with_invalid_entries(device, variant):
    # Lists of 0, 1, 17 (a partial tile), 40 and past-the-width entries; -1, the int32
    # extremes and the first rows past the workspace inside them.
    q, kv, idx, sink = make(1, tokens=5, heads=20, rows=90, width=40, invalid=0.3,
                            device=device)
    lens = torch.tensor([0, 1, 17, 40, 55], dtype=torch.int32, device=device)
    out = run(q, kv, idx, lens, sink, variant)
    assert out.shape == (5, 20, D)
    assert_close(out, reference(q, kv, key_lists(idx.cpu(), lens), sink))


def test_ragged_lists_equal_dense_lists(device):
    # The same key lists given ragged: the same keys in the same order, the same bytes.
    q, kv, idx, sink = make(2, tokens=4, heads=16, rows=70, width=33, invalid=0.2,
                            device=device)
    lens = torch.tensor([33, 5, 0, 20], dtype=torch.int32, device=device)
    dense = run(q, kv, idx, lens, sink, "sm80")
    lists = key_lists(idx.cpu(), lens)
    flat = torch.tensor([x for lst in lists for x in lst], dtype=torch.int32, device=device)
    ptr = torch.tensor([0] + [sum(map(len, lists[:i + 1])) for i in range(len(lists))],
                       dtype=torch.int32, device=device)
    ragged = spm.sparse_attn_prefill(q, kv, SCALE, sink, NOPE, ROPE, ragged_indices=flat,
                                     ragged_indptr=ptr, variant="sm80")
    assert torch.equal(dense.view(torch.int16), ragged.view(torch.int16))
    # int64 indices and lengths (upstream accepts both): same bytes.
    wide = run(q, kv, idx.long(), lens.long(), sink, "sm80")
    assert torch.equal(dense.view(torch.int16), wide.view(torch.int16))


def test_length_semantics(device):
    # Negative lengths: no key; lengths past the width: the whole row; topk_length None:
    # upstream's default, as many entries as the row has entries >= 0 (so a -1 early in the
    # row drops the row's last valid entry, as upstream's compaction does).
    q, kv, idx, sink = make(3, tokens=3, heads=16, rows=50, width=24, device=device)
    idx[1, 2] = -1
    out = run(q, kv, idx, torch.tensor([-4, 1000, 24], dtype=torch.int32, device=device),
              sink, "sm80")
    assert torch.equal(out[0].float().cpu(), torch.zeros(16, D))
    assert_close(out, reference(q, kv, [[], idx[1].tolist(), idx[2].tolist()], sink))
    default = run(q, kv, idx, None, sink, "sm80")
    want = run(q, kv, idx, (idx >= 0).sum(1).to(torch.int32), sink, "sm80")
    assert torch.equal(default.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(default[1].view(torch.int16), out[1].view(torch.int16))


@pytest.mark.parametrize("variant,heads", [("sm80", 20), ("sm90", 80), ("sm90", 128)])
def test_head_tiles(device, variant, heads):
    # sm80: 16-head tiles with a masked remainder; sm90: 64-head tiles (80 heads: a second,
    # mostly masked tile; 128: the V4 c128a head count, two full tiles).
    q, kv, idx, sink = make(4, tokens=2, heads=heads, rows=60, width=70, invalid=0.1,
                            device=device)
    lens = torch.tensor([70, 29], dtype=torch.int32, device=device)
    assert_close(run(q, kv, idx, lens, sink, variant),
                 reference(q, kv, key_lists(idx.cpu(), lens), sink))


@pytest.mark.parametrize("with_sink", [True, False])
@pytest.mark.parametrize("variant", VARIANTS)
def test_all_invalid_rows_give_zeros(device, with_sink, variant):
    # Row 0: only invalid entries; row 1: an empty list; row 2: normal.
    q, kv, idx, sink = make(5, tokens=3, heads=16, rows=40, width=6, device=device)
    idx[0] = torch.tensor([-1, 40, 41, INT32_MIN, INT32_MAX, -7], dtype=torch.int32)
    lens = torch.tensor([6, 0, 6], dtype=torch.int32, device=device)
    sink = sink if with_sink else None
    out = run(q, kv, idx, lens, sink, variant)
    assert torch.equal(out[:2].float().cpu(), torch.zeros(2, 16, D))
    assert_close(out, reference(q, kv, key_lists(idx.cpu(), lens), sink))


def test_no_sink_and_strided_workspace(device):
    # attn_sink None; the workspace as a [rows, 1, 512] view with a padded row stride (a
    # multiple of 8 elements: the aligned path) and one that is not (the unaligned path);
    # q and out as slices of larger buffers (strided tokens).
    q, kv, idx, _ = make(6, tokens=3, heads=16, rows=30, width=20, invalid=0.1, device=device)
    lens = torch.tensor([20, 7, 13], dtype=torch.int32, device=device)
    want = reference(q, kv, key_lists(idx.cpu(), lens), None)
    for pad in (8, 3):
        big = torch.zeros(30, D + pad, dtype=torch.bfloat16, device=device)
        big[:, :D] = kv
        view = big[:, :D].unsqueeze(1)
        qbig = torch.zeros(3, 16, D + pad, dtype=torch.bfloat16, device=device)
        qbig[..., :D] = q
        obig = torch.zeros(3, 16, D + pad, dtype=torch.bfloat16, device=device)
        out = spm.sparse_attn_prefill(qbig[..., :D], view, SCALE, None, NOPE, ROPE,
                                      indices=idx, topk_length=lens, out=obig[..., :D],
                                      variant="sm80")
        assert out.data_ptr() == obig.data_ptr()
        assert_close(out, want)
        assert torch.equal(obig[..., D:].float().cpu(), torch.zeros(3, 16, pad))


def test_nope_only_output(device):
    # A 448-wide output (upstream allows nope_head_dim): the first 448 columns of the
    # 512-wide result, nothing written past them.
    q, kv, idx, sink = make(7, tokens=3, heads=16, rows=50, width=30, device=device)
    lens = torch.tensor([30, 2, 17], dtype=torch.int32, device=device)
    full = run(q, kv, idx, lens, sink, "sm80")
    buf = torch.full((3, 16, D), 5.0, dtype=torch.bfloat16, device=device)
    narrow = run(q, kv, idx, lens, sink, "sm80", out=buf[..., :NOPE])
    assert torch.equal(narrow.view(torch.int16), full[..., :NOPE].view(torch.int16))
    assert (buf[..., NOPE:] == 5.0).all()


def _nan_inf_case(device):
    """Token 0 lists a key row with a NaN, token 1 one with an inf, token 2 neither (its
    entries 7 and 9 moved to 8), and head 4 of token 3 has a NaN query element. With this
    seed every score against the inf key is +inf or NaN, so the token's sum is NaN and its
    row zeroed; a head whose score were -inf would instead get 0 * inf = NaN in P.V (as in
    upstream's kernel), which other data can produce."""
    q, kv, idx, sink = make(8, tokens=4, heads=16, rows=40, width=12, device=device)
    idx[0, 3], idx[1, 5] = 7, 9
    idx[2] = torch.where(idx[2] == 7, 8, idx[2])
    idx[2] = torch.where(idx[2] == 9, 8, idx[2])
    kv[7, 100] = float("nan")
    kv[9, 460] = float("inf")
    q[3, 4, 10] = float("nan")
    return q, kv, idx, sink, torch.full((4,), 12, dtype=torch.int32, device=device)


def test_nan_and_inf_rows_give_zeros_as_upstream(device):
    # Upstream's prefill does not scrub NaN key entries: a NaN (or an inf) in a valid key
    # row makes the token's softmax sum NaN, and its where(sum > 0, ..., 0) writes zeros for
    # every head of that token; a NaN query row zeroes that head. Other tokens and heads
    # are unaffected; nothing NaN is written.
    q, kv, idx, sink, lens = _nan_inf_case(device)
    for variant in VARIANTS:
        out = run(q, kv, idx, lens, sink, variant).float().cpu()
        assert not out.isnan().any()
        assert torch.equal(out[:2], torch.zeros(2, 16, D))
        assert torch.equal(out[3, 4], torch.zeros(D))
        assert out[2].abs().sum() > 0 and out[3, 5].abs().sum() > 0
        ref = reference(q[2:], kv, key_lists(idx[2:].cpu(), lens[2:]), sink)
        ok_heads = [h for h in range(16) if h != 4]
        assert excess(out[2:3], (ref[0][:1], ref[1][:1])) <= 0
        assert excess(out[3, ok_heads][None].to(torch.bfloat16),
                      (ref[0][1:2, ok_heads], ref[1][1:2, ok_heads])) <= 0


@pytest.mark.parametrize("variant_form", [("sm80", 1), ("sm80", 2), ("sm80", 4), ("sm90", 1),
                                          ("sm80", "one chain")])
def test_forms_with_growing_maxima(device, tile_rows, variant_form):
    # Every form of the kernel (plain with one or two Q.K^T chains; dims split across 2 or 4
    # warps), on both tiles' shapes.
    # Key magnitudes grow along the first list (x1.5 per 8 rows), so every tile raises the
    # rows' running max and rescales the accumulator; the second list runs the other way
    # (no rescale after the first tile).
    rows = 64
    grow = 1.5 ** (torch.arange(rows, dtype=torch.float32) / 8)
    q, kv, idx, sink = make(9, tokens=3, heads=16, rows=rows, width=64, device=device,
                            scale_rows=grow)
    idx[:] = torch.arange(rows, dtype=torch.int32, device=device)  # ascending magnitude
    idx[1] = idx[1].flip(0)                                        # descending
    lens = torch.tensor([64, 64, 41], dtype=torch.int32, device=device)
    base, split_d = variant_form
    halves = spm.TILES[base].qk_halves and split_d == 1
    split_d = 1 if split_d == "one chain" else split_d
    name = tile_rows(f"test-{base}-{split_d}-{halves}", base=base, split_d=split_d,
                     num_warps=split_d if split_d > 1 else spm.TILES[base].num_warps,
                     qk_halves=halves)
    assert_close(run(q, kv, idx, lens, sink, name),
                 reference(q, kv, key_lists(idx.cpu(), lens), sink))


def test_qk_halves_form_output_and_zero_rows(device, tile_rows):
    """Tile.qk_halves stores the output in two halves: a NoPE-only output gets the first
    448 columns of the 512-wide one and nothing past them; and the zero rows of the one-chain
    form (no valid key, NaN / inf keys and queries). Its accuracy with growing maxima:
    test_forms_with_growing_maxima."""
    halves = tile_rows("test-halves", base="sm80", qk_halves=True)
    one = tile_rows("test-one-chain", base="sm80", qk_halves=False)
    q, kv, idx, sink = make(7, tokens=3, heads=16, rows=50, width=30, invalid=0.2,
                            device=device)
    lens = torch.tensor([30, 2, 17], dtype=torch.int32, device=device)
    full = run(q, kv, idx, lens, sink, halves)
    assert_close(full, reference(q, kv, key_lists(idx.cpu(), lens), sink))
    buf = torch.full((3, 16, D), 5.0, dtype=torch.bfloat16, device=device)
    narrow = run(q, kv, idx, lens, sink, halves, out=buf[..., :NOPE])
    assert torch.equal(narrow.view(torch.int16), full[..., :NOPE].view(torch.int16))
    assert (buf[..., NOPE:] == 5.0).all()
    q, kv, idx, sink, lens = _nan_inf_case(device)
    got = run(q, kv, idx, lens, sink, halves).float().cpu()
    assert not got.isnan().any()
    assert torch.equal(got == 0, run(q, kv, idx, lens, sink, one).float().cpu() == 0)


def test_qk_halves_refuses_the_forms_it_does_not_implement():
    for bad in (dict(split_d=2, num_warps=2), dict(rescale_tau=8.0)):
        with pytest.raises(ValueError, match="qk_halves"):
            dataclasses.replace(spm.TILES["sm80"], qk_halves=True, **bad)


def test_default_variant_runs(device):
    q, kv, idx, sink = make(10, tokens=2, heads=16, rows=30, width=16, device=device)
    lens = torch.tensor([16, 9], dtype=torch.int32, device=device)
    assert_close(run(q, kv, idx, lens, sink, None),
                 reference(q, kv, key_lists(idx.cpu(), lens), sink))


# ----------------------------------------------------------------------------- upstream
def upstream_prefill(up, q, kv, lists, sink, out):
    """Upstream's ``_rocm_sparse_attn_prefill_ragged_triton`` launch of its kernel (the
    compaction keeps the valid entries of each list, in order)."""
    rows = kv.shape[0]
    kept = [[x for x in lst if 0 <= x < rows] for lst in lists]
    flat = torch.tensor([x for lst in kept for x in lst], dtype=torch.int32, device=q.device)
    ptr = torch.tensor([0] + [sum(map(len, kept[:i + 1])) for i in range(len(kept))],
                       dtype=torch.int32, device=q.device)
    T, H, _ = q.shape
    up._sparse_attn_prefill_ragged_kernel[(T, math.ceil(H / 16))](
        q, kv, flat, ptr, sink, out, q.stride(0), q.stride(1), q.stride(2), kv.stride(0),
        kv.stride(1), out.stride(0), out.stride(1), out.stride(2), H, D, rows, SCALE,
        HAS_ATTN_SINK=sink is not None, OUT_DV=out.shape[-1], BLOCK_H=16, BLOCK_D=512,
        BLOCK_K=16, num_warps=4)
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only comparison")
@pytest.mark.parametrize("variant", VARIANTS)
def test_upstream_meets_the_bound_and_ours_is_as_accurate(upstream, monkeypatch, variant):
    """Upstream's kernel and ours, both with GPU-like bf16 math in the interpreter
    (tests/interp_bf16.py: bf16 dots in fp32, RNE casts; ours' DOT_FP32 off so it rounds P
    to bf16 as on a GPU): both within the bound; ours' RMS error within ACCURACY_SLACK of
    upstream's; the same zero rows (all-invalid, NaN key)."""
    import interp_bf16
    up = importlib.import_module("upstream_kernels.v41_sparse_prefill")
    interp_bf16.patch(monkeypatch.setattr)
    monkeypatch.setattr(spm, "_dot_fp32", lambda: False)
    q, kv, idx, sink = make(11, tokens=6, heads=32, rows=80, width=48, invalid=0.15)
    idx[0] = -1
    kv[3, 5] = float("nan")
    idx[1, :4] = torch.tensor([3, 4, 5, 6], dtype=torch.int32)
    lens = torch.tensor([48, 48, 48, 30, 9, 47], dtype=torch.int32)
    lists = key_lists(idx, lens)
    theirs = upstream_prefill(up, q, kv, lists, sink, torch.empty_like(q))
    ours = run(q, kv, idx, lens, sink, variant)
    assert torch.equal(theirs[:2].float(), torch.zeros(2, 32, D))
    assert torch.equal(ours[:2].float(), torch.zeros(2, 32, D))
    ref = reference(q[2:], kv, lists[2:], sink)
    assert excess(theirs[2:], ref) <= 0
    assert excess(ours[2:], ref) <= 0
    assert rms(ours[2:], ref) <= ACCURACY_SLACK * rms(theirs[2:], ref)


# ----------------------------------------------------------------------------- routing
def test_feature_is_on_for_ampere_and_routes(monkeypatch, device):
    # On for sm80, sm86 and the interpreter, off elsewhere (envs.FEATURES' comment: the H200
    # sweep of the sm80 tile); =0 and DEEPINFER_DISABLE turn it off.
    from vllm.deepinfer import arch
    monkeypatch.delenv("DEEPINFER_SPARSE_MLA_PREFILL", raising=False)
    monkeypatch.delenv("DEEPINFER_DISABLE", raising=False)
    assert envs.FEATURES["sparse_mla_prefill"].default_on == {"sm80", "sm86", "cpu"}
    assert [v for v in ("sm80", "sm86", "sm89", "sm90", "sm100", "cpu")
            if envs.enabled("sparse_mla_prefill", v)] == ["sm80", "sm86", "cpu"]
    q, kv, idx, sink = make(12, tokens=2, heads=16, rows=30, width=16, device=device)
    lens = torch.tensor([16, 3], dtype=torch.int32, device=device)
    out = torch.full_like(q, 3.0)
    args = (q, kv.unsqueeze(1), idx, lens, SCALE, D, NOPE, ROPE, sink, out)
    routing.reset()
    try:
        default_on = arch.current().name in {"sm80", "sm86", "cpu"}
        assert routing.sparse_attn_prefill(*args) is default_on
        if not default_on:
            assert (out == 3.0).all()                                # upstream's turn
        monkeypatch.setenv("DEEPINFER_SPARSE_MLA_PREFILL", "1")
        routing.reset()
        assert routing.sparse_attn_prefill(*args) is True
        assert torch.equal(out.view(torch.int16), run(q, kv, idx, lens, sink, None).view(torch.int16))
        # Calls ours does not cover go back to upstream: fp16, another split of the dims,
        # a kv that is not [rows, 1, 512].
        half = (q.half(), kv.half().unsqueeze(1), idx, lens, SCALE, D, NOPE, ROPE, sink,
                out.half())
        assert routing.sparse_attn_prefill(*half) is False
        assert routing.sparse_attn_prefill(q, kv.unsqueeze(1), idx, lens, SCALE, D, 256, 256,
                                           sink, out) is False
        assert routing.sparse_attn_prefill(q, kv, idx, lens, SCALE, D, NOPE, ROPE, sink,
                                           out) is False
        monkeypatch.setenv("DEEPINFER_SPARSE_MLA_PREFILL", "0")
        routing.reset()
        assert routing.sparse_attn_prefill(*args) is False
        monkeypatch.delenv("DEEPINFER_SPARSE_MLA_PREFILL")
        monkeypatch.setenv("DEEPINFER_DISABLE", "sparse_mla_prefill")
        routing.reset()
        assert routing.sparse_attn_prefill(*args) is False
    finally:
        monkeypatch.delenv("DEEPINFER_SPARSE_MLA_PREFILL", raising=False)
        monkeypatch.delenv("DEEPINFER_DISABLE", raising=False)
        routing.reset()


def test_ampere_class_call_shapes(device):
    # What the Ampere classes pass (attention/common.py): the combiner's [T, round_up(topk +
    # window, 128)] rows with its lengths, the workspace as [rows, 1, 512].
    q, kv, _, sink = make(13, tokens=3, heads=16, rows=200, width=8, device=device)
    width = topk_swa.combined_width(8, 16)
    g = torch.Generator().manual_seed(1)
    idx = torch.full((3, width), -1, dtype=torch.int32)
    lens = torch.tensor([24, 10, 0], dtype=torch.int32)
    for t in range(3):
        idx[t, :lens[t]] = torch.randperm(200, generator=g)[:lens[t]].to(torch.int32)
    idx, lens = idx.to(device), lens.to(device)
    out = torch.empty_like(q)
    spm.sparse_attn_prefill(q, kv.unsqueeze(1), SCALE, torch.cat([sink, sink]), NOPE, ROPE,
                            indices=idx, topk_length=lens, out=out, variant="sm80")
    assert_close(out, reference(q, kv, key_lists(idx.cpu(), lens), sink))


# ----------------------------------------------------------------------------- validation
def _args(device):
    q, kv, idx, sink = make(14, tokens=2, heads=16, rows=20, width=8, device=device)
    return dict(q=q, kv=kv, scale=SCALE, attn_sink=sink, nope_head_dim=NOPE,
                rope_head_dim=ROPE, indices=idx,
                topk_length=torch.tensor([8, 3], dtype=torch.int32, device=device))


@pytest.mark.parametrize("name,bad,match", [
    ("q", lambda a: a["q"].float(), "q"),
    ("q", lambda a: a["q"][..., :256], "q"),
    ("kv", lambda a: a["kv"].float(), "kv"),
    ("kv", lambda a: a["kv"][:, :448], "kv"),
    ("indices", lambda a: a["indices"][:1], "indices"),
    ("indices", lambda a: a["indices"].float(), "indices"),
    ("topk_length", lambda a: a["topk_length"][:1], "topk_length"),
    ("attn_sink", lambda a: a["attn_sink"][:4], "attn_sink"),
    ("nope_head_dim", lambda a: 512, "nope_head_dim"),
    ("rope_head_dim", lambda a: 32, "rope_head_dim"),
    ("scale", lambda a: float("nan"), "scale"),
])
def test_validation_names_the_argument(device, name, bad, match):
    a = _args(device)
    a[name] = bad(a)
    with pytest.raises(ValueError, match=f"^{match}"):
        spm.sparse_attn_prefill(**a, variant="sm80")


def test_validation_lists_out_and_variant(device):
    a = _args(device)
    with pytest.raises(ValueError, match="indices/ragged_indices"):
        spm.sparse_attn_prefill(**a, ragged_indices=a["indices"].flatten(), variant="sm80")
    b = dict(a, indices=None, topk_length=None)
    with pytest.raises(ValueError, match="indices/ragged_indices"):
        spm.sparse_attn_prefill(**b, variant="sm80")
    with pytest.raises(ValueError, match="ragged_indptr"):
        spm.sparse_attn_prefill(**b, ragged_indices=a["indices"].flatten(),
                                ragged_indptr=a["topk_length"], variant="sm80")
    with pytest.raises(ValueError, match="^out"):
        spm.sparse_attn_prefill(**a, out=torch.empty(2, 16, 256, dtype=torch.bfloat16,
                                                     device=device), variant="sm80")
    with pytest.raises(ValueError, match="variant"):
        spm.sparse_attn_prefill(**a, variant="sm75")


def test_empty_inputs_return_out(device):
    a = _args(device)
    a["q"], a["indices"], a["topk_length"] = a["q"][:0], a["indices"][:0], a["topk_length"][:0]
    out = spm.sparse_attn_prefill(**a, variant="sm80")
    assert out.shape == (0, 16, D)


# ----------------------------------------------------------------------------- tiles
def test_tiles_fit_their_variant():
    from vllm.deepinfer import arch
    for name, t in spm.TILES.items():
        assert t.block_h >= 16 and t.block_n >= 16, name
        if t.split_d > 1:
            assert t.num_warps == t.split_d and D % t.split_d == 0, name
        if name in arch.VARIANTS and arch.VARIANTS[name].gpu and not arch.VARIANTS[name].hw_fp8:
            # Q and one key tile in shared memory, within the Ampere budget.
            assert (t.block_h + t.block_n) * D * 2 <= arch.VARIANTS[name].smem_budget, name
    assert spm.launch_plan(64, spm.TILES["sm90"]) == (64, 1)
    assert spm.launch_plan(128, spm.TILES["sm90"]) == (64, 2)
    assert spm.launch_plan(64, spm.TILES["sm80"]) == (16, 4)
    assert spm.launch_plan(4, spm.TILES["sm90"]) == (16, 1)


# ----------------------------------------------------------------------------- GPU
def _gpu_case(tokens, heads, topk, window, rows, seed):
    """Production-like lists: per token, top-k distinct compressed rows of a region, then
    its window of consecutive SWA rows; -1 padding past the length, as the combiner
    writes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = topk_swa.combined_width(topk, window)
    q = torch.randn(tokens, heads, D, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(rows, D, device="cuda", generator=g).to(torch.bfloat16)
    comp = torch.rand(tokens, rows - window - tokens, device="cuda", generator=g).argsort(1)[:, :topk]
    swa = (rows - window - tokens) + torch.arange(tokens, device="cuda")[:, None] + \
        torch.arange(window, device="cuda")[None, :]
    idx = torch.full((tokens, width), -1, dtype=torch.int32, device="cuda")
    idx[:, :topk + window] = torch.cat([comp, swa], 1).to(torch.int32)
    lens = torch.full((tokens,), topk + window, dtype=torch.int32, device="cuda")
    lens[0] = window // 2          # a short list
    idx[1, 5] = -1                 # an invalid entry inside a list
    sink = torch.randn(heads, device="cuda", generator=g)
    return q, kv, idx, lens, sink


def _gpu_reference(q, kv, idx, lens, sink):
    """fp32 reference on the GPU, batched over tokens (invalid entries masked)."""
    T, H, _ = q.shape
    width = idx.shape[1]
    valid = (torch.arange(width, device="cuda")[None, :] < lens[:, None]) & (idx >= 0) & \
        (idx < kv.shape[0])
    out = torch.empty(T, H, D, device="cuda")
    mag = torch.empty_like(out)
    for t0 in range(0, T, 64):
        t1 = min(T, t0 + 64)
        k = kv.float()[idx[t0:t1].clamp(min=0).long()]                   # [t, W, D]
        logits = torch.einsum("thd,twd->thw", q[t0:t1].float(), k) * SCALE
        logits = logits.masked_fill(~valid[t0:t1, None, :], float("-inf"))
        logits = torch.cat([logits, sink.float()[None, :, None].expand(t1 - t0, H, 1)], 2)
        p = torch.softmax(logits, 2)[..., :-1]
        out[t0:t1] = torch.einsum("thw,twd->thd", p, k)
        mag[t0:t1] = torch.einsum("thw,twd->thd", p, k.abs())
    return out, mag


@pytest.mark.gpu
@pytest.mark.parametrize("heads,topk,tokens", [(64, 512, 512), (128, 512, 256),
                                               (64, 8192, 64)])
def test_gpu_production_shapes_vs_upstream(upstream, heads, topk, tokens):
    """Both tiles beside upstream's real kernel at production shapes: all within the bound,
    ours' RMS error within ACCURACY_SLACK of upstream's, short and invalid-entry rows
    included."""
    up = importlib.import_module("upstream_kernels.v41_sparse_prefill")
    window = 128
    q, kv, idx, lens, sink = _gpu_case(tokens, heads, topk, window, 2 * topk + 4096, 0)
    ref_out, ref_mag = _gpu_reference(q, kv, idx, lens, sink)
    lists = [idx[t, :lens[t]].tolist() for t in range(tokens)]
    theirs = upstream_prefill(up, q, kv, lists, sink, torch.empty_like(q))
    bound = TOL_ABS + TOL_REL * ref_mag

    def err(o):
        d = (o.float() - ref_out).abs()
        return float((d - bound).max()), float((d ** 2).mean().sqrt())
    up_excess, up_rms = err(theirs)
    assert up_excess <= 0
    for v in GPU_VARIANTS:
        ours = run(q, kv, idx, lens, sink, v)
        torch.cuda.synchronize()
        ex, r = err(ours)
        assert not ours.isnan().any(), v
        assert ex <= 0, (v, ex)
        assert r <= ACCURACY_SLACK * up_rms, (v, r, up_rms)


@pytest.mark.gpu
def test_gpu_semantics_zero_rows_and_nope_output():
    q, kv, idx, lens, sink = _gpu_case(8, 64, 512, 128, 2048, 1)
    idx[2] = -1
    lens[3] = 0
    kv[int(idx[4, 0])] = float("nan")
    for v in GPU_VARIANTS:
        out = run(q, kv, idx, lens, sink, v)
        assert torch.equal(out[2:5].float(), torch.zeros(3, 64, D, device="cuda")), v
        narrow = run(q, kv, idx, lens, sink, v, out=torch.empty(8, 64, NOPE,
                                                                dtype=torch.bfloat16,
                                                                device="cuda"))
        assert torch.equal(narrow.view(torch.int16), out[..., :NOPE].view(torch.int16)), v


# ----------------------------------------------------------------------------- benchmark suite
class _StubHarness:
    """What the suite uses of benchmarks/harness.Harness, on CPU: one input set, each timed
    launch run once (and timed as 1 us)."""
    quick = True

    def __init__(self, dev):
        self.dev = torch.device(dev)
        self.rows = []

    def copies(self, make, bytes_per_copy, max_copies=64):
        return [make()]

    def time_graph(self, launch, inputs, reps=1):
        for x in inputs:
            launch(x)
        return 1.0

    def add(self, kernel, variant, shape, ours_us, upstream_us, **kw):
        self.rows.append(dict(kernel=kernel, variant=variant, shape=shape, ours_us=ours_us,
                              upstream_us=upstream_us, **kw))


def test_suite_code_path_cpu(device, upstream, monkeypatch):
    """The sparse_mla_prefill suite's case on tiny sizes (interpreter, upstream's bf16 math
    emulated): our rows, upstream's kernel and path, the reference sample, the records
    path and the gather all run; the accuracy fields are filled and small."""
    if device != "cpu":
        pytest.skip("CPU smoke of the suite")
    import sys
    from pathlib import Path

    import interp_bf16
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from suites import sparse_mla_prefill as suite
    interp_bf16.patch(monkeypatch.setattr)
    h = _StubHarness(device)
    # 5 tokens after 37 cached, top-k 8 of (37 + 5) // 2 = 21 compressed rows, 16 heads.
    suite._case(h, 5, 37, 8, 2, 16, variants=("sm80",))
    (row,) = h.rows
    assert row["shape"] == dict(tokens=5, ctx=37, topk=8, ratio=2, heads=16,
                                keys=8 + suite.WINDOW)
    assert row["max_abs_diff"] < 0.05 and row["upstream_max_abs_diff"] < 0.05, row
    assert 0.5 < row["rms_ratio"] < ACCURACY_SLACK, row
    for k in ("upstream_path_us", "gather_us", "records_us"):
        assert row[k] == 1.0, k
    assert [c[:3] for c in suite.cases(True)] == [(2048, 64 << 10, 512), (2048, 64 << 10, 8192)]
    assert len(suite.cases(False)) == 36
    halves = suite.cases(False, "1/2") + suite.cases(False, "2/2")
    assert sorted(halves) == sorted(suite.cases(False)) and len(halves) == 36
    with pytest.raises(ValueError, match="DEEPINFER_SUITE_PART"):
        suite.cases(False, "3/2")
    assert row["impl"] == "triton"  # the interpreter runs no Gluon kernel


def test_sweep_loop_mix_reads_the_longest_loop():
    """benchmarks/diag/sweep_prefill.py's SASS reader (the compile-gate instruction mix in
    docs/sparse-mla-prefill.md): the body of the backward branch spanning the most
    instructions, predicated opcodes counted by their base name."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "diag"))
    import sweep_prefill
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
        "        /*0020*/                   BRA 0x10 ;",                      # short loop
        "        /*0030*/                   LDSM.16.M88.4 R8, [R2] ;",
        "        /*0040*/               @P0 HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
        "        /*0050*/              @!P1 LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64] ;",
        "        /*0060*/                   ISETP.GE.AND P0, PT, R0, R5, PT ;",
        "        /*0070*/               @P0 BRA 0x30 ;",                      # the long loop
        "        /*0080*/                   EXIT ;"])
    n, mix = sweep_prefill._loop_mix(sass)
    assert n == 5
    assert mix == {"HMMA": 1, "LDSM": 1, "LDGSTS": 1, "ISETP": 1}
    kq = sweep_prefill._per_kq({"loop_instructions": 480, "loop_mix": {"HMMA": 32}}, 16, 16, 4)
    assert kq == {"instructions": 480.0, "HMMA": 32.0}


# ----------------------------------------------------------------------------- loop knobs
@pytest.mark.parametrize("base,split_d,tau", [("sm80", 1, 8.0), ("sm80", 2, 8.0),
                                              ("sm90", 1, 8.0), ("sm90", 1, 1.0)])
def test_deferred_rescale_matches_the_reference(device, tile_rows, base, split_d, tau):
    # Tile.rescale_tau (sweep_prefill.py's sm90-tau8): the running max moves only when a key
    # tile passes it by more than tau (log2 units). The growing-maxima lists of
    # test_forms_with_growing_maxima (some tiles pass the max by less than tau, so P runs
    # above 1 with the stale max; others rescale), and random lists with invalid entries;
    # same bound as the other tests.
    name = tile_rows(f"test-tau-{base}-{split_d}-{tau}", base=base, split_d=split_d,
                     num_warps=split_d if split_d > 1 else spm.TILES[base].num_warps,
                     rescale_tau=tau, qk_halves=False)  # qk_halves has no deferred rescale
    rows = 64
    grow = 1.5 ** (torch.arange(rows, dtype=torch.float32) / 8)
    q, kv, idx, sink = make(9, tokens=3, heads=16, rows=rows, width=64, device=device,
                            scale_rows=grow)
    idx[:] = torch.arange(rows, dtype=torch.int32, device=device)
    idx[1] = idx[1].flip(0)
    lens = torch.tensor([64, 64, 41], dtype=torch.int32, device=device)
    assert_close(run(q, kv, idx, lens, sink, name),
                 reference(q, kv, key_lists(idx.cpu(), lens), sink))
    q, kv, idx, sink = make(10, tokens=3, heads=16, rows=50, width=80, invalid=0.3,
                            device=device)
    lens = torch.tensor([80, 0, 37], dtype=torch.int32, device=device)
    assert_close(run(q, kv, idx, lens, sink, name),
                 reference(q, kv, key_lists(idx.cpu(), lens), sink))


def test_deferred_rescale_keeps_the_zero_row_semantics(device, tile_rows):
    # test_nan_and_inf_rows_give_zeros_as_upstream's case with the deferred rescale: NaN /
    # inf keys zero the token, a NaN query zeroes the head; and rows without a valid key
    # give zeros. Zeros in the same places as the shipped tile's.
    name = tile_rows("test-tau-sem", base="sm90", rescale_tau=8.0)
    q, kv, idx, sink, lens = _nan_inf_case(device)
    out = run(q, kv, idx, lens, sink, name).float().cpu()
    assert not out.isnan().any()
    assert torch.equal(out[:2], torch.zeros(2, 16, D))
    assert torch.equal(out[3, 4], torch.zeros(D))
    assert torch.equal(out == 0, run(q, kv, idx, lens, sink, "sm90").float().cpu() == 0)
    ref = reference(q[2:3], kv, key_lists(idx[2:3].cpu(), lens[2:3]), sink)
    assert excess(out[2:3].to(torch.bfloat16), ref) <= 0
    idx[1] = -1
    lens[0] = 0
    out = run(q, kv, idx, lens, sink, name).float().cpu()
    assert torch.equal(out[:2], torch.zeros(2, 16, D))


def test_loop_knob_defaults_and_constexprs():
    # The shipped tiles leave every key-loop knob off; 0 is passed to tl.range as None.
    for name, t in spm.TILES.items():
        assert (t.warp_spec, t.unroll, t.loop_stages, t.rescale_tau) == (False, 0, 0, 0.0), name
    c = spm.gate_constexprs(spm.TILES["sm90"])
    assert (c["WARP_SPEC"], c["UNROLL"], c["LOOP_STAGES"], c["RESCALE_TAU"]) == (
        False, None, None, 0.0)
    c = spm.gate_constexprs(spm.Tile(64, 64, 8, 2, unroll=2, loop_stages=3, rescale_tau=8))
    assert (c["UNROLL"], c["LOOP_STAGES"], c["RESCALE_TAU"]) == (2, 3, 8.0)


def test_sweep_candidates_and_what_it_times():
    """sweep_prefill.py: unique candidate names, --sm90-only keeps the wgmma family, and the
    timing skips candidates the gate rejected or found identical to an earlier one."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "diag"))
    import sweep_prefill as sp
    names = [n for n, _, _ in sp.CANDIDATES]
    assert len(names) == len(set(names))
    assert sp.CANDIDATES_BY_NAME["sm90"] == spm.TILES["sm90"]
    assert all(n.startswith("sm90") and t == (90,) for n, _, t in sp._candidates(True))
    gate = [{"name": "a", "cc": 90, "within_hopper_budget": True},
            {"name": "b", "cc": 90, "same_sass_as": "a"},
            {"name": "c", "cc": 90, "error": "PTXASError: ..."},
            {"name": "d", "cc": 90, "within_hopper_budget": False},
            {"name": "e", "cc": 80}, {"name": "e", "cc": 86}]
    assert [n for n in "abcdef" if sp._timed(gate, n, (90,))] == ["a", "e"]
