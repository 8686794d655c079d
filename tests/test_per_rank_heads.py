"""The attention kernels at the head counts one tensor-parallel rank holds.

vLLM 0.33.0 splits DeepSeek-V4.1/V4 attention by heads: wq_b is column-parallel (64 heads ->
32 / 16 / 8 per rank at TP 2 / 4 / 8; a 128-head model 128 / 64 / 32 / 16), wo_a
column-parallel over o_groups (8 -> 4 / 2 / 1, always 8 heads per group), wo_b row-parallel;
fused_wqa_wkv, the indexer and the compressor are replicated. Upstream's FlashMLA pads Q to
64 or 128 heads; our kernels mask the heads a tile does not fill (16-head tiles at 8 heads,
the Gluon prefill's 64-head tile at 8 to 32 heads). Nothing else changes per rank, so what
is tested here is the head dimension:

* launch plans at 8 to 128 heads on every tile row (a tile never smaller than 16 rows,
  never more than one partly filled tile per token);
* masked rows do not leak: the first 8 heads of a 16-head launch (the same tile) are the
  8-head launch's bytes, whatever the other 8 heads hold (decode one and two phases, sm90
  tile, prefill; on a GPU also the Gluon prefill's 64-head tile at 8 heads);
* decode and prefill at 8, 16 and 32 heads against the fp32 references of
  tests/test_sparse_mla_decode.py / tests/test_sparse_mla_prefill.py, and beside upstream's
  kernels (interpreted with GPU-like bf16 math on CPU, real on a GPU) with the same
  never-less-accurate rule;
* the standalone inverse RoPE (kernels/inverse_rope.py, 16-head programs) on the first
  8 / 16 / 32 heads of a wider tensor: the rows outside the view keep their bytes;
* V4's fused inverse RoPE + fp8 quant (kernels/fp8_writers_v4.py) with 1, 2 and 4 o_groups
  of 8 heads, byte for byte against upstream's kernel; the Ampere attention classes' bf16
  o_proj at one o_group of 8 heads (the patched vLLM, CPU);
* the JIT warmup at every head count: a per-rank config on one GPU warms what a rank of
  the full model warms, and every decode / prefill / inverse-RoPE launch at 8 to 128 heads
  finds a warmed key (tests/launch_keys.py).

The ``gpu`` tests run the production shapes (top-k 512 + window 128 decode over 584-byte
records, prefill lists of 640 keys) on the H200 at 8, 16, 32, 64 and 128 heads. The other
tests run on a GPU too when the file is run there (the ``device`` fixture).
"""
from __future__ import annotations

import importlib
import math
import types

import pytest
import torch

import test_sparse_mla_decode as tsd
import test_sparse_mla_prefill as tsp
from launch_keys import recording
from test_warmup_coverage import (CC, SM_COUNTS, _attention_calls, _decode_calls, _uncovered,
                                  _warm_keys, _zeros, gpu_like)  # noqa: F401 (fixture)
from vllm.deepinfer import kv_record
from vllm.deepinfer import warmup as wu
from vllm.deepinfer.kernels import inverse_rope as ir
from vllm.deepinfer.kernels import sparse_mla_decode as smd
from vllm.deepinfer.kernels import sparse_mla_prefill as spm
from vllm.deepinfer.kernels import sparse_mla_prefill_gluon as glp

NOPE, ROPE, D = kv_record.NOPE_DIM, kv_record.ROPE_DIM, kv_record.HEAD_DIM
# Heads per rank: 64-head models at TP 1 / 2 / 4 / 8, and 128 heads at TP 1.
HEADS = (8, 16, 32, 64, 128)
PER_RANK = (8, 16, 32)          # what TP 8 / 4 / 2 leave of 64 heads
HEADS_PER_GROUP = 8             # 64 heads / 8 o_groups, at every TP degree
SCALE = 1.0 / math.sqrt(D)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).cpu()


def _padded(x: torch.Tensor, heads: int, seed: int, dim: int = 1) -> torch.Tensor:
    """``x`` with random heads appended along ``dim`` up to ``heads``."""
    g = torch.Generator().manual_seed(seed)
    shape = list(x.shape)
    shape[dim] = heads - x.shape[dim]
    extra = (torch.randn(shape, generator=g) * 3).to(x.dtype).to(x.device)
    return torch.cat([x, extra], dim=dim).contiguous()


# ----------------------------------------------------------------------------- plans
# (block_h, head tiles per token) of the shipped rows at 8 / 16 / 32 / 64 / 128 heads.
DECODE_PLANS = {
    **{row: {h: (16, -(-h // 16)) for h in HEADS}
       for row in ("sm80", "sm86", "sm80-2p", "sm86-2p", "sm89", "sm100")},
    "sm90": {8: (16, 1), 16: (16, 1), 32: (32, 1), 64: (64, 1), 128: (64, 2)},
}
PREFILL_PLANS = {
    **{row: {h: (16, -(-h // 16)) for h in HEADS} for row in ("sm80", "sm86", "sm89", "sm100")},
    **{row: {8: (16, 1), 16: (16, 1), 32: (32, 1), 64: (64, 1), 128: (64, 2)}
       for row in ("sm90", "sm90-triton")},
}


@pytest.mark.parametrize("heads", HEADS)
def test_decode_plans_at_every_head_count(heads):
    """The shipped rows' head tiles per rank (a tile never under 16 rows, tl.dot's
    minimum); on every row at most one partly filled tile per token; a Gluon phase-2 row
    below its program's head count plans as its Triton row."""
    for name, want in DECODE_PLANS.items():
        block_h, _ = smd.launch_plan(4, heads, 640.0, smd.TILES[name], 132)
        assert (block_h, -(-heads // block_h)) == want[heads], name
    for name, tile in smd.TILES.items():
        block_h, splits = smd.launch_plan(4, heads, 640.0, tile, 132)
        tiles = -(-heads // block_h)
        assert block_h >= 16 and block_h & (block_h - 1) == 0, name
        assert (tiles - 1) * block_h < heads <= tiles * block_h, name
        assert splits >= 1
        if tile.gluon_heads and heads < tile.gluon_heads:
            assert not smd.uses_gluon(tile, heads)
            base = smd.TILES[name.rsplit("-h", 1)[0]]
            assert (block_h, splits) == smd.launch_plan(4, heads, 640.0, base, 132), name
    # The reduce's head block (8) tiles every per-rank count exactly.
    assert all(h % smd.TILES["sm80-2p"].reduce_block_h == 0 for h in HEADS)


@pytest.mark.parametrize("heads", HEADS)
def test_prefill_plans_at_every_head_count(heads):
    for name, want in PREFILL_PLANS.items():
        assert spm.launch_plan(heads, spm.TILES[name]) == want[heads], name
    for name, tile in spm.TILES.items():
        block_h, tiles = spm.launch_plan(heads, tile)
        assert (tiles - 1) * block_h < heads <= tiles * block_h, name
    # The Gluon producer/consumer kernel: 64-head work items, rows past the heads masked.
    assert glp.BLOCK_H == 64


# ----------------------------------------------------------------------------- decode, CPU
DECODE_ROWS = [("sm80", False), ("sm80", True), ("sm90", None)]   # (variant, predequant)


def _decode(q, mc, mi, mp, sink, ex, *, variant, predequant, splits, inv_rope):
    pos = cs = None
    kw = {}
    if inv_rope:
        cs = tsd.cos_sin_cache(4096, q.device)
        pos = torch.randint(0, 4096, (q.shape[0],),
                            generator=torch.Generator().manual_seed(7)).to(q.device)
        kw = dict(inv_rope_positions=pos, inv_rope_cos_sin_cache=cs)
    return smd.sparse_attn_decode(q, mc, mi, mp, SCALE, sink, NOPE, ROPE, **ex, **kw,
                                  num_kv_splits=splits, variant=variant, predequant=predequant)


@pytest.mark.parametrize("variant,predequant", DECODE_ROWS)
@pytest.mark.parametrize("heads", PER_RANK)
def test_decode_per_rank_heads_meet_the_reference(device, variant, predequant, heads):
    """Decode at 8 / 16 / 32 heads, one and two phases (sm80) and the hardware-e4m3 tile
    (sm90), split and unsplit, with the fused inverse RoPE: within the fp32 reference bound
    of tests/test_sparse_mla_decode.py."""
    q, mc, mi, mp, sink, ex = tsd.setup(device, 31 + heads, main_lens=[7, 30, 64],
                                        extra_lens=[40, 0, 90], heads=heads, invalid=0.1)
    for splits, inv_rope in ((1, False), (3, True)):
        ours, ref = tsd.run_both(q, mc, mi, mp, sink, ex, variant=variant, splits=splits,
                                 inv_rope=inv_rope, device=device, predequant=predequant)
        assert ours.shape == (3, heads, D)
        tsd.assert_close(ours, ref)


@pytest.mark.parametrize("variant,predequant", DECODE_ROWS)
def test_decode_masked_heads_do_not_leak(device, variant, predequant):
    """8 heads run the 16-row tile with 8 rows masked: the output equals, bit for bit, the
    first 8 heads of a 16-head launch (same tile, same splits) whose other 8 heads hold large
    random queries and sinks."""
    q, mc, mi, mp, sink, ex = tsd.setup(device, 41, main_lens=[12, 33], extra_lens=[70, 5],
                                        heads=8, invalid=0.1)
    q16, sink16 = _padded(q, 16, 1), _padded(sink, 16, 2, dim=0)
    for splits, inv_rope in ((1, True), (2, False)):
        kw = dict(variant=variant, predequant=predequant, splits=splits, inv_rope=inv_rope)
        eight = _decode(q, mc, mi, mp, sink, ex, **kw)
        sixteen = _decode(q16, mc, mi, mp, sink16, ex, **kw)
        assert torch.equal(_bits(eight), _bits(sixteen[:, :8]))
        assert not torch.equal(_bits(sixteen[:, 8:]), torch.zeros_like(_bits(sixteen[:, 8:])))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only comparison")
def test_decode_8_heads_beside_upstream_in_interpreter(upstream, monkeypatch):
    """8 heads through upstream's CUDA fallback decode (its 16-head program masked to 8),
    interpreted with GPU-like bf16 math, and through ours: both within the reference bound,
    ours' RMS error within the prefill's ACCURACY_SLACK of upstream's."""
    import interp_bf16
    up = importlib.import_module("upstream_kernels.mla_sparse_decode")
    interp_bf16.patch(monkeypatch.setattr)
    heads = 8
    q, mc, mi, mp, sink, ex = tsd.setup("cpu", 43, main_lens=[9, 20, 31],
                                        extra_lens=[24, 5, 50], invalid=0.2, heads=heads)
    ec, ei, ep = ex["extra_cache"], ex["extra_indices"], ex["extra_indptr"]
    theirs = torch.empty_like(q)
    up._sparse_attn_decode_ragged_kernel[(q.shape[0], 1)](
        q, mc, mi, mp, ec, ei, ep, sink, theirs,
        q.stride(0), q.stride(1), theirs.stride(0), theirs.stride(1), mc.stride(0),
        ec.stride(0), mc.shape[0] * mc.shape[1], ec.shape[0] * ec.shape[1], mc.shape[1],
        ec.shape[1], SCALE, heads,
        HAS_ATTN_SINK=True, HAS_EXTRA=True, NOPE_DIM=NOPE, NOPE_BLOCK=512, ROPE_DIM=ROPE,
        IS_FNUZ_MAIN=False, IS_FNUZ_EXTRA=False, BLOCK_H=16, BLOCK_K=16, num_warps=8)
    ref, mag = tsd.reference(q, mc, mi, mp, SCALE, sink, ec, ei, ep, magnitude=True)
    tsd.assert_close(theirs, (ref, mag))
    for predequant in (False, True):
        ours = smd.sparse_attn_decode(q, mc, mi, mp, SCALE, sink, NOPE, ROPE, **ex,
                                      num_kv_splits=1, variant="sm80", predequant=predequant)
        tsd.assert_close(ours, (ref, mag))
        assert tsp.rms(ours, (ref, mag)) <= tsp.ACCURACY_SLACK * tsp.rms(theirs, (ref, mag))


# ----------------------------------------------------------------------------- prefill, CPU
@pytest.mark.parametrize("variant", ["sm80", "sm90"])
@pytest.mark.parametrize("heads", PER_RANK)
def test_prefill_per_rank_heads_meet_the_reference(device, variant, heads):
    """Prefill at 8 / 16 / 32 heads (sm80's 16-head tile; in the interpreter sm90 is its
    Triton tile, 16 or 32 rows here): dense lists with invalid entries and ragged lists
    (the same bytes) within the fp32 reference bound."""
    q, kv, idx, sink = tsp.make(50 + heads, tokens=4, heads=heads, rows=90, width=48,
                                invalid=0.15, device=device)
    lens = torch.tensor([48, 17, 0, 33], dtype=torch.int32, device=device)
    dense = tsp.run(q, kv, idx, lens, sink, variant)
    tsp.assert_close(dense, tsp.reference(q, kv, tsp.key_lists(idx.cpu(), lens), sink))
    assert torch.equal(dense[2].float().cpu(), torch.zeros(heads, D))
    flat = torch.cat([idx[t, :lens[t]] for t in range(4)])
    indptr = torch.zeros(5, dtype=torch.int32, device=device)
    indptr[1:] = lens.cumsum(0)
    ragged = spm.sparse_attn_prefill(q, kv, SCALE, sink, NOPE, ROPE, ragged_indices=flat,
                                     ragged_indptr=indptr, variant=variant)
    assert torch.equal(_bits(ragged), _bits(dense))


@pytest.mark.parametrize("variant", ["sm80", "sm90"])
def test_prefill_masked_heads_do_not_leak(device, variant):
    q, kv, idx, sink = tsp.make(61, tokens=3, heads=8, rows=70, width=40, invalid=0.1,
                                device=device)
    lens = torch.tensor([40, 23, 9], dtype=torch.int32, device=device)
    eight = tsp.run(q, kv, idx, lens, sink, variant)
    sixteen = tsp.run(_padded(q, 16, 3), kv, idx, lens, _padded(sink, 16, 4, dim=0), variant)
    assert torch.equal(_bits(eight), _bits(sixteen[:, :8]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only comparison")
@pytest.mark.parametrize("variant", ["sm80", "sm90"])
def test_prefill_8_heads_beside_upstream_in_interpreter(upstream, monkeypatch, variant):
    """As test_sparse_mla_prefill's upstream comparison, at 8 heads: upstream's 16-head
    program masked to 8 and ours, both with GPU-like bf16 math, both within the bound, ours'
    RMS error within ACCURACY_SLACK of upstream's."""
    import interp_bf16
    up = importlib.import_module("upstream_kernels.v41_sparse_prefill")
    interp_bf16.patch(monkeypatch.setattr)
    monkeypatch.setattr(spm, "_dot_fp32", lambda: False)
    q, kv, idx, sink = tsp.make(62, tokens=5, heads=8, rows=80, width=48, invalid=0.15)
    lens = torch.tensor([48, 48, 30, 9, 47], dtype=torch.int32)
    lists = tsp.key_lists(idx, lens)
    theirs = tsp.upstream_prefill(up, q, kv, lists, sink, torch.empty_like(q))
    ours = tsp.run(q, kv, idx, lens, sink, variant)
    ref = tsp.reference(q, kv, lists, sink)
    assert tsp.excess(theirs, ref) <= 0 and tsp.excess(ours, ref) <= 0
    assert tsp.rms(ours, ref) <= tsp.ACCURACY_SLACK * tsp.rms(theirs, ref)


# ----------------------------------------------------------------------------- inverse RoPE
@pytest.mark.parametrize("heads", PER_RANK)
def test_inverse_rope_on_the_first_heads_of_a_wider_tensor(device, heads):
    """forward_mqa's standalone inverse RoPE of rows [rotated:, :n_local_heads] (16-head
    programs): the rotated lanes within one bf16 rounding of the fp32 rotation, the NoPE
    lanes unchanged, and every row outside the view (other heads, rows before ``rotated``)
    keeps its bytes."""
    g = torch.Generator().manual_seed(70 + heads)
    tokens, rotated, width = 5, 2, 64
    whole = (torch.randn(tokens, width, D, generator=g) * 4).to(torch.bfloat16).to(device)
    before = whole.clone()
    cs = tsd.cos_sin_cache(4096, device)
    pos = torch.randint(0, 4096, (tokens,), generator=g).to(device)
    ir.inverse_rope_rows_(whole[rotated:, :heads], pos[rotated:], cs, ROPE)
    want = tsd.inverse_rope_ref(before[rotated:, :heads].float().cpu(), pos[rotated:].cpu(),
                                cs.cpu())
    got = whole[rotated:, :heads].float().cpu()
    assert torch.equal(_bits(whole[rotated:, :heads, :NOPE]), _bits(before[rotated:, :heads, :NOPE]))
    err = (got[..., NOPE:] - want[..., NOPE:]).abs()
    assert (err <= 2.0 ** -7 * want[..., NOPE:].abs() + 1e-6).all(), err.max()
    assert not torch.equal(_bits(whole[rotated:, :heads]), _bits(before[rotated:, :heads]))
    assert torch.equal(_bits(whole[rotated:, heads:]), _bits(before[rotated:, heads:]))
    assert torch.equal(_bits(whole[:rotated]), _bits(before[:rotated]))


# ----------------------------------------------------------------------------- o_groups
@pytest.mark.usefixtures("exact_hw_fp8_cast")
@pytest.mark.parametrize("n_groups", [1, 2, 4])
def test_inv_rope_fp8_quant_per_rank_groups_match_upstream(upstream, device, n_groups):
    """V4's o_proj input per rank: n_groups of 8 heads (TP 8 / 4 / 2: 1 / 2 / 4 groups),
    5 tokens (3 padding rows of the TMA-aligned scales), plain and packed UE8M0 scales:
    values and the whole scale storage equal upstream's kernel byte for byte, sm80 (software
    e4m3) and sm90 (hardware cast) alike."""
    import test_fp8_writers as tfw
    from vllm.deepinfer.kernels import fp8_writers_v4 as v4
    up = {"v4_inv_rope_fp8": importlib.import_module("upstream_kernels.v4_inv_rope_fp8")}
    gen = torch.Generator().manual_seed(80 + n_groups)
    t, hpg = 5, HEADS_PER_GROUP
    o = tfw._edge_rows(t * n_groups * hpg, D, gen).reshape(t, n_groups * hpg, D)
    o = o.to(torch.bfloat16)
    positions = torch.randint(0, 64, (t,), generator=gen, dtype=torch.int64)
    cos_sin = tfw._cos_sin(64, ROPE, gen)
    o, positions, cos_sin = tfw._on(device, o, positions, cos_sin)
    for packed in (False, True):
        ref_out, ref_sc = tfw._upstream_inv_rope(up, o, positions, cos_sin, n_groups, hpg, 128,
                                                 packed, True)
        for v in ("sm80", "sm90"):
            out, sc = v4.fused_inv_rope_fp8_quant(o, positions, cos_sin, n_groups, hpg,
                                                  tma_aligned_scales=packed, variant=v)
            assert out.shape == (t, n_groups, hpg * D)
            tfw._assert_same(out.transpose(0, 1), ref_out, f"{v} values, {n_groups} groups")
            n = sc.untyped_storage().nbytes() // 4
            tfw._assert_same(sc.transpose(0, 1).as_strided((n,), (1,)),
                             ref_sc.as_strided((ref_sc.untyped_storage().nbytes() // 4,), (1,)),
                             f"{v} scales, {n_groups} groups")


# ----------------------------------------------------------------------------- attention classes
# tests/vllm_import_probe.py's construct scenario with one rank of TP 8's attention: 8 heads in
# one o_group (the probe's own configs have 8 heads in 2 groups). Its o_proj checks then run
# the Ampere classes' bf16 wo_a copy and einsum at groups = 1, heads_per_group = 8.
_ONE_GROUP = r"""
import sys
sys.path.insert(0, sys.argv[2])
import vllm_probe_common as c
base = c.hf_config
def hf(model):
    h = base(model)
    h.num_attention_heads, h.o_groups = 8, 1
    return h
c.hf_config = hf
import vllm_import_probe as p
for name in ("o_proj", "wo_a_fp8_survives_repack"):
    def shaped(layer, vcfg, f=getattr(p, name)):
        return dict(f(layer, vcfg), heads=layer.n_local_heads, groups=layer.n_local_groups)
    setattr(p, name, shaped)
sys.exit(p.main())
"""


def test_ampere_classes_at_one_o_group():
    """The V4.1 and V4 Ampere attention classes built by the patched vLLM (CPU) with 8 heads
    in one o_group: the o_proj (wo_a dequantized to bf16 once, [1, o_rank, 8 x 512]) within
    the probe's bound of the fp32 reference, from bf16 and from fp8 wo_a weights."""
    import json
    import sys

    import subproc
    import test_vllm_import as tvi
    tvi._need_tree()
    r = subproc.run([sys.executable, "-c", _ONE_GROUP, "construct", str(tvi.REPO / "tests")],
                    env=tvi._probe_env(), cwd=tvi.REPO, cap=300)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    res = json.loads(lines[-1])
    assert res["_scenario"]["ok"], res["_scenario"]
    for model in tvi.MODELS:
        for key in ("o_proj", "o_proj_fp8_wo_a"):
            v = tvi._value(res, f"{model}/{key}")
            assert (v["heads"], v["groups"]) == (8, 1), (model, key, v)
            assert v["max_abs_err"] <= 0.02 * v["ref_scale"] + 1e-3, (model, key, v)
        assert tvi._value(res, f"{model}/o_proj")["cached_bf16"]
        assert tvi._value(res, f"{model}/layer1")["padded_heads"] == 8


# ----------------------------------------------------------------------------- warmup
def _hf(heads, groups, **kw):
    base = dict(sliding_window=128, index_topk=512, num_attention_heads=heads,
                o_groups=groups, index_n_heads=64, compress_ratios=[0, 0, 2, 2, 1, 1])
    base.update(kw)
    return types.SimpleNamespace(**base)


def _vcfg(hf, tp):
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=hf, max_model_len=65536),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp))


@pytest.mark.parametrize("variant", ["sm80", "sm86", "sm90"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_per_rank_config_warms_what_a_rank_warms(variant, tp):
    """A config holding one rank's heads, served on one GPU (TP 1), gives the JIT warmup the
    shapes of a rank of the full model at TP ``tp``: the same keys, every feature; the
    indexer keeps its 64 replicated heads either way."""
    full = wu.model_shapes(_vcfg(_hf(64, 8), tp))
    rank = wu.model_shapes(_vcfg(_hf(64 // tp, 8 // tp), 1))
    assert rank == full and rank.heads == 64 // tp and rank.index_heads == 64
    feats = [f for f in wu._KEYS if f != "serve_warmup"]
    assert wu.keys(rank, variant, features=feats) == wu.keys(full, variant, features=feats)


def _shapes(heads):
    return [wu.ModelShapes(window=128, compress_ratios=ratios, topk=512, heads=heads,
                           model=model, max_model_len=ctx)
            for model, ratios, ctx in (("v41", (0, 1, 2), 8192), ("v4", (1, 4, 128), 1 << 20))]


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="launches are intercepted in the interpreter (tests/launch_keys.py)")
@pytest.mark.parametrize("variant", ["sm80", "sm90"])
@pytest.mark.parametrize("heads", HEADS)
def test_attention_launches_are_warmed_at_every_head_count(variant, heads, gpu_like):
    """Every decode (both phases where they run), prefill and standalone inverse-RoPE
    launch at ``heads`` heads, over the batch sizes, pages and SM counts of
    tests/test_warmup_coverage.py (rows starting at every decode count the step can have:
    the positions' alignment moves), finds a key the warmup of a ``heads``-head model
    compiled."""
    for shapes in _shapes(heads):
        warm = _warm_keys(shapes, variant)
        with recording(CC[variant]) as seen:
            for sms in SM_COUNTS[::2]:
                gpu_like(sms)
                for call in _decode_calls(shapes, variant):
                    call()
            for call in _attention_calls(shapes, variant):
                call()
            cs = torch.zeros(4096, ROPE)
            for tokens, rotated in ((1, 0), (3, 1), (77, 3), (64, 64 - 5)):
                out = _zeros((tokens, heads, D), torch.bfloat16)
                pos = _zeros((tokens,), torch.int64)
                ir.inverse_rope_rows_(out[rotated:, :heads], pos[rotated:], cs, ROPE)
        names = {k.fn.__name__ for k, _ in seen}
        assert {"_sparse_mla_decode_kernel", "_sparse_mla_prefill_kernel",
                "_inverse_rope_rows_kernel"} <= names
        assert not _uncovered(seen, warm), "\n".join(_uncovered(seen, warm))


# ----------------------------------------------------------------------------- GPU
def _gpu_decode_case(tokens, heads, seed):
    """Decode over production geometry: SWA pages of 32 records, the window's 128 keys,
    compressed pages of 64 entries and top-k 512 of them, a few invalid slots."""
    return tsd.setup("cuda", seed, main_lens=[128] * tokens, extra_lens=[512] * tokens,
                     main_bs=32, extra_bs=64, main_blocks=64, extra_blocks=96, invalid=0.02,
                     heads=heads)


def _upstream_decode(up, q, mc, mi, mp, sink, ex):
    ec, ei, ep = ex["extra_cache"], ex["extra_indices"], ex["extra_indptr"]
    out = torch.empty_like(q)
    up._sparse_attn_decode_ragged_kernel[(q.shape[0], -(-q.shape[1] // 16))](
        q, mc, mi, mp, ec, ei, ep, sink, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), mc.stride(0), ec.stride(0),
        mc.shape[0] * mc.shape[1], ec.shape[0] * ec.shape[1], mc.shape[1], ec.shape[1], SCALE,
        q.shape[1], HAS_ATTN_SINK=True, HAS_EXTRA=True, NOPE_DIM=NOPE, NOPE_BLOCK=512,
        ROPE_DIM=ROPE, IS_FNUZ_MAIN=False, IS_FNUZ_EXTRA=False, BLOCK_H=16, BLOCK_K=16,
        num_warps=8)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_decode_per_rank_heads_vs_upstream(upstream, heads, tokens):
    """Production decode shapes at 8 to 128 heads: upstream's fallback decode (16-head
    programs, masked) and ours on every row a launch can take (sm80 one and two phases,
    sm90), each with the split count its heuristic picks: all within the fp32 reference
    bound, ours' RMS error within ACCURACY_SLACK of upstream's."""
    up = importlib.import_module("upstream_kernels.mla_sparse_decode")
    q, mc, mi, mp, sink, ex = _gpu_decode_case(tokens, heads, 100 + heads + tokens)
    ref = tsd.reference(q, mc, mi, mp, SCALE, sink, ex["extra_cache"], ex["extra_indices"],
                        ex["extra_indptr"], magnitude=True)
    theirs = _upstream_decode(up, q, mc, mi, mp, sink, ex)
    torch.cuda.synchronize()
    tsd.assert_close(theirs, ref)
    up_rms = tsp.rms(theirs, ref)
    for variant, predequant in DECODE_ROWS:
        ours = smd.sparse_attn_decode(q, mc, mi, mp, SCALE, sink, NOPE, ROPE, **ex,
                                      variant=variant, predequant=predequant)
        torch.cuda.synchronize()
        tsd.assert_close(ours, ref)
        assert tsp.rms(ours, ref) <= tsp.ACCURACY_SLACK * up_rms, (variant, predequant)


@pytest.mark.gpu
@pytest.mark.parametrize("variant,predequant", DECODE_ROWS)
def test_gpu_decode_masked_heads_do_not_leak(variant, predequant):
    q, mc, mi, mp, sink, ex = _gpu_decode_case(8, 8, 120)
    q16, sink16 = _padded(q, 16, 5), _padded(sink, 16, 6, dim=0)
    for splits, inv_rope in ((1, True), (4, False)):
        kw = dict(variant=variant, predequant=predequant, splits=splits, inv_rope=inv_rope)
        eight = _decode(q, mc, mi, mp, sink, ex, **kw)
        sixteen = _decode(q16, mc, mi, mp, sink16, ex, **kw)
        assert torch.equal(_bits(eight), _bits(sixteen[:, :8]))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", PER_RANK)
def test_gpu_gluon_decode_rows_at_per_rank_heads(heads):
    """The benchmark's Gluon phase-2 rows (sm80-2p-h64 / -h32): at 32 heads the h32 row runs
    the Gluon kernel within the reference bound; below a row's program size it runs the
    Triton phase 2, the sm80-2p row's bytes."""
    from vllm.deepinfer.kernels import sparse_mla_decode_gluon as glk
    if not glk.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    q, mc, mi, mp, sink, ex = _gpu_decode_case(16, heads, 130 + heads)
    ref = tsd.reference(q, mc, mi, mp, SCALE, sink, ex["extra_cache"], ex["extra_indices"],
                        ex["extra_indptr"], magnitude=True)
    kw = dict(predequant=None, splits=2, inv_rope=False)
    tri = _decode(q, mc, mi, mp, sink, ex, variant="sm80-2p", **kw)
    for row in ("sm80-2p-h64", "sm80-2p-h32"):
        got = _decode(q, mc, mi, mp, sink, ex, variant=row, **kw)
        tsd.assert_close(got, ref)
        if heads < smd.TILES[row].gluon_heads:
            assert not smd.uses_gluon(smd.TILES[row], heads)
            assert torch.equal(_bits(got), _bits(tri)), row
    assert smd.uses_gluon(smd.TILES["sm80-2p-h32"], 32)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", PER_RANK)
@pytest.mark.parametrize("topk,tokens", [(512, 512), (8192, 64)])
def test_gpu_prefill_per_rank_heads_vs_upstream(upstream, heads, topk, tokens):
    """tests/test_sparse_mla_prefill.py's production-shape comparison at 8 / 16 / 32 heads:
    every tile (sm80, sm90 = the Gluon kernel on Hopper with its 64-head tile masked,
    sm90-triton) within the bound, RMS within ACCURACY_SLACK of upstream's kernel."""
    up = importlib.import_module("upstream_kernels.v41_sparse_prefill")
    q, kv, idx, lens, sink = tsp._gpu_case(tokens, heads, topk, 128, 2 * topk + 4096, heads)
    ref_out, ref_mag = tsp._gpu_reference(q, kv, idx, lens, sink)
    lists = [idx[t, :lens[t]].tolist() for t in range(tokens)]
    theirs = tsp.upstream_prefill(up, q, kv, lists, sink, torch.empty_like(q))
    bound = tsp.TOL_ABS + tsp.TOL_REL * ref_mag

    def err(o):
        d = (o.float() - ref_out).abs()
        return float((d - bound).max()), float((d ** 2).mean().sqrt())
    up_excess, up_rms = err(theirs)
    assert up_excess <= 0
    for v in tsp.GPU_VARIANTS:
        ours = tsp.run(q, kv, idx, lens, sink, v)
        torch.cuda.synchronize()
        ex, r = err(ours)
        assert not ours.isnan().any(), v
        assert ex <= 0, (v, ex)
        assert r <= tsp.ACCURACY_SLACK * up_rms, (v, r, up_rms)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", PER_RANK)
def test_gpu_prefill_masked_rows_of_the_64_head_tile(heads):
    """The Gluon producer/consumer kernel (and each Triton tile) at 8 / 16 / 32 heads: the
    first rows of a 64-head launch whose other heads hold random queries, bit for bit, on
    the tiles whose head block is the same at both counts (Gluon: 64 rows always)."""
    q, kv, idx, lens, sink = tsp._gpu_case(64, heads, 512, 128, 5120, 7)
    wide_q, wide_sink = _padded(q, 64, 8), _padded(sink, 64, 9, dim=0)
    for v in tsp.GPU_VARIANTS:
        tile = spm.TILES[v]
        gluon = spm.uses_gluon_ws(tile, q.device, True)
        if not gluon and spm.launch_plan(heads, tile)[0] != spm.launch_plan(64, tile)[0]:
            continue  # another head block: another summation shape, not comparable bitwise
        few = tsp.run(q, kv, idx, lens, sink, v)
        wide = tsp.run(wide_q, kv, idx, lens, wide_sink, v)
        assert torch.equal(_bits(few), _bits(wide[:, :heads])), v
