"""fp8-free writers (vllm.deepinfer.kernels.fp8_writers_v41 / _v4) against upstream vLLM 0.33.0.

Every case runs the upstream kernel (build/upstream_kernels, launched as upstream's host
code launches it), our sm80 variant (software e4m3 cast) and our sm90 variant (hardware
cast; emulated by the interpreter on CPU) on the same inputs and compares raw bytes:
ours == upstream for both variants, and sm80 == sm90 (the software cast equals the cast
Triton emits for fp8e4nv on these inputs). Inputs are fresh random values plus edge rows:
all zeros (the amax floor), large and tiny magnitudes (positive scale exponents, e4m3
subnormals), and exact e4m3 rounding ties. The interpreter's bf16 rounding is wrong (it
truncates) the same way for upstream and ours, so they are compared with each other only.

The interpreter's own fp32 -> fp8e4nv conversion is not the hardware's: it rounds half
up without carrying into the exponent and does not saturate. The ``exact_hw_fp8_cast``
fixture replaces it, for this module, with what ``cvt.rn.satfinite.e4m3x2.f32`` does
(round to nearest even, saturate to +-448), computed by torch. Upstream and our sm90
variant run through it; our sm80 variant never uses it. On a GPU (the H200 benchmark
suite) the real instruction is used and the same byte comparisons are made.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from edges import ODD_PAGES, invalid_slots
from vllm.deepinfer import kv_record as rec
from vllm.deepinfer.kernels import fp8_writers_v4 as v4
from vllm.deepinfer.kernels import fp8_writers_v41 as v41

VARIANTS = ("sm80", "sm90")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    ab, bb = _bytes(a).flatten(), _bytes(b).flatten()
    bad = (ab != bb).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.numel()} bytes differ, first at {bad[:8].flatten().tolist()}"


def _on(device, *tensors):
    """The test inputs (made on CPU by a seeded generator) on the test device."""
    return tuple(t.to(device) for t in tensors)


def _edge_rows(n_rows: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows with per-64-block magnitudes from 2^-20 to 2^12, then the edge rows."""
    x = torch.randn(n_rows, dim, generator=gen)
    mag = torch.exp2(torch.randint(-20, 13, (n_rows, dim // 64), generator=gen).float())
    x = x * mag.repeat_interleave(64, dim=1)
    x[0] = 0.0                                    # amax floor
    x[1, ::3] = 0.0                               # zeros inside a block
    # A 448 peak makes the scale 2^0; the rest are e4m3 ties (normal and subnormal) that
    # round-to-nearest-even must settle: 1.0625 -> 1.0, 1.1875 -> 1.25, 2^-10 -> 0, 3*2^-10 -> 2^-8.
    ties = torch.tensor([448.0, 1.0625, 1.1875, -2.125, 2.0 ** -10, 3 * 2.0 ** -10, -5 * 2.0 ** -10, 0.5])
    x[2] = ties.repeat(dim // ties.numel())
    x[3] = x[3].sign() * 3e4                      # large: scale exponent > 0
    return x


def _cos_sin(max_pos: int, rope: int, gen: torch.Generator) -> torch.Tensor:
    ang = torch.rand(max_pos, rope // 2, generator=gen) * 6.3
    return torch.cat([ang.cos(), ang.sin()], dim=1).float().contiguous()


pytestmark = pytest.mark.usefixtures("exact_hw_fp8_cast")  # conftest.py


@pytest.fixture(scope="module")
def up(upstream):
    return {m: importlib.import_module(f"upstream_kernels.{m}")
            for m in ("v41_fused_compress", "v41_indexer_k_store", "v4_inv_rope_fp8",
                      "v4_fused_indexer_q")}


# ----------------------------------------------------------------- V4.1 compressed KV insert
def _with_invalid_slots(slots: torch.Tensor, rows: int, at) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, upstream's) slot mappings: ours holds every invalid slot value of
    tests/edges.py at the rows ``at`` (rows that write); upstream, which would write out of
    bounds for the ones past the cache, gets its padding slot -1 there instead."""
    bad = invalid_slots(rows)
    ours, theirs = slots.clone(), slots.clone()
    ours[list(at)[:len(bad)]] = torch.tensor(bad, dtype=slots.dtype)
    theirs[list(at)[:len(bad)]] = -1
    return ours, theirs


def _paged_buffer(num_blocks: int, block: int, row_bytes: int, gen: torch.Generator):
    """Random bytes, and a view of them as pages one 64-byte pad apart (V4.1 pages share a
    physical block, so a page stride is not block * row_bytes)."""
    page = block * row_bytes + 64
    buf = torch.randint(0, 256, (num_blocks * page,), generator=gen, dtype=torch.uint8)
    return buf, lambda b: b.as_strided((num_blocks, block, row_bytes), (page, row_bytes, 1))


@pytest.mark.parametrize("compress_ratio,block", [(1, 16), (2, 16), (1, ODD_PAGES[1])])
def test_rope_quant_insert_584_matches_upstream(up, compress_ratio, block, device):
    gen = torch.Generator().manual_seed(41 + compress_ratio + block)
    n, nblocks = 48, 4
    latent = _edge_rows(n, 512, gen).to(torch.bfloat16)
    positions = torch.randint(0, 200, (n,), generator=gen, dtype=torch.int64)
    positions[:14] = torch.arange(14) * compress_ratio + compress_ratio - 1  # edge rows write
    slots = torch.randperm(nblocks * block, generator=gen)[:n].to(torch.int64)
    slots[5] = -1
    slots, up_slots = _with_invalid_slots(slots, nblocks * block, range(8, 14))
    cos_sin = _cos_sin(256, 64, gen)
    base, pages = _paged_buffer(nblocks, block, rec.RECORD_BYTES, gen)
    latent, positions, slots, up_slots, cos_sin, base = _on(device, latent, positions, slots,
                                                            up_slots, cos_sin, base)

    ref = base.clone()
    cache = pages(ref)
    up["v41_fused_compress"]._rope_quant_insert_kernel[(n,)](
        latent, positions, cos_sin, cache, up_slots, COS_STRIDE=cos_sin.stride(0),
        CACHE_STRIDE=cache.stride(0), CACHE_BLOCK=cache.shape[1], COMPRESS_RATIO=compress_ratio,
        SANITIZE_CACHE_NANS=False, num_warps=4)
    assert not torch.equal(ref, base)
    outs = {}
    for v in VARIANTS:
        outs[v] = base.clone()
        v41.rope_quant_insert(latent, positions, cos_sin, pages(outs[v]), slots, compress_ratio,
                              variant=v)
        _assert_same(outs[v], ref, f"{v} vs upstream")  # every byte, page padding included
    _assert_same(outs["sm80"], outs["sm90"], "sm80 vs sm90")


def test_rope_quant_insert_584_decodes_to_reference(device):
    """Our record, read back by the plain-torch reader, equals kv_record's quantizer."""
    gen = torch.Generator().manual_seed(7)
    latent = _edge_rows(6, 512, gen).to(torch.bfloat16)
    cos_sin = _cos_sin(8, 64, gen)
    positions = torch.zeros(6, dtype=torch.int64)
    slots = torch.arange(6, dtype=torch.int64)
    cache = rec.new_cache(1, 8).to(device)
    v41.rope_quant_insert(*_on(device, latent, positions, cos_sin), cache, slots.to(device), 1,
                          variant="sm80")
    cache = cache.cpu()
    expect = rec.new_cache(1, 8)
    rec.insert_rows(expect, slots, latent.float())
    # NoPE bytes and scales against the torch quantizer (the RoPE part is rotated by us).
    got, want = rec.read_records(cache, slots), rec.read_records(expect, slots)
    assert torch.equal(got[:, :rec.NOPE_DIM], want[:, :rec.NOPE_DIM])
    assert torch.equal(got[:, rec.DATA_BYTES:], want[:, rec.DATA_BYTES:])


# ----------------------------------------------------------------- V4.1 indexer K store
@pytest.mark.parametrize("compress_ratio,mx_scale,block", [
    (1, False, 8), (2, False, 8), (2, True, 8), (1, False, ODD_PAGES[2])])
def test_indexer_k_store_matches_upstream(up, compress_ratio, mx_scale, block, device):
    gen = torch.Generator().manual_seed(100 + compress_ratio + mx_scale + block)
    n, nblocks, row = 40, 6, rec.INDEX_RECORD_BYTES
    k_pre = _edge_rows(n, 128, gen).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(128, generator=gen)).to(torch.bfloat16)
    positions = torch.randint(0, 100, (n,), generator=gen, dtype=torch.int64)
    positions[:12] = torch.arange(12) * compress_ratio + compress_ratio - 1
    slots = torch.randperm(nblocks * block, generator=gen)[:n].to(torch.int64)
    slots[4] = -1
    slots, up_slots = _with_invalid_slots(slots, nblocks * block, range(6, 12))
    cos_sin = _cos_sin(128, 64, gen)
    eps = 1e-6
    base = torch.randint(0, 256, (nblocks, block, row), generator=gen, dtype=torch.uint8)
    k_pre, weight, positions, slots, up_slots, cos_sin, base = _on(
        device, k_pre, weight, positions, slots, up_slots, cos_sin, base)

    ref = base.clone()
    up["v41_indexer_k_store"]._indexer_k_norm_rope_quant_store_kernel[(n,)](
        k_pre, k_pre.stride(0), positions, weight, eps, cos_sin, cos_sin.stride(0), ref, up_slots,
        ref.shape[1], HEAD_SIZE=128, ROPE_HEAD_DIM=64, COMPRESS_RATIO=compress_ratio,
        TOKEN_STRIDE=128, SCALE_DIM=4, KV_BLOCK_STRIDE=ref.stride(0), FP8_MAX=448.0,
        USE_FP4=False, MX_SCALE=mx_scale, SHUFFLE=False, BLOCK_TILE_SIZE=16, HEAD_TILE_SIZE=16,
        num_warps=1)
    assert not torch.equal(ref, base)
    outs = {}
    for v in VARIANTS:
        outs[v] = base.clone()
        v41.indexer_k_norm_rope_store(k_pre, positions, cos_sin, weight, eps, outs[v], slots,
                                      compress_ratio, False, mx_scale=mx_scale, variant=v)
        _assert_same(outs[v], ref, f"{v} vs upstream")
    _assert_same(outs["sm80"], outs["sm90"], "sm80 vs sm90")


# ----------------------------------------------------------------- V4 inverse RoPE + quant
def _upstream_inv_rope(up, o, positions, cos_sin, n_groups, hpg, qgs, packed, quantize):
    """Upstream's buffers and launch (fused_inv_rope_fp8_quant + its kernel launcher)."""
    t, h, hd = o.shape
    d, blocks, chunks = hpg * hd, hpg * hd // qgs, hd // qgs
    padded = -(-t // 4) * 4 if quantize else t
    inner = ((blocks + 3) // 4 if packed else blocks) if quantize else 0
    out = torch.empty((n_groups, t, d), dtype=torch.float8_e4m3fn if quantize else o.dtype,
                      device=o.device)
    sdt = torch.int32 if packed else torch.float32
    sc = (torch.empty(n_groups * inner * padded, dtype=sdt, device=o.device).as_strided(
        (n_groups, t, inner), (inner * padded, 1, padded)) if quantize
          else torch.empty(0, dtype=sdt, device=o.device))
    up["v4_inv_rope_fp8"].FusedInvRopeFP8QuantKernel_kernel[(padded, h)](
        o, positions, cos_sin, out, sc, t, heads_per_group=hpg, o_stride_token=o.stride(0),
        o_stride_head=o.stride(1), cache_stride_pos=cos_sin.stride(0), out_stride_group=out.stride(0),
        out_stride_token=out.stride(1), scale_stride_group=sc.stride(0) if quantize else 0,
        scale_stride_k=sc.stride(2) if quantize else 0, fp8_max=448.0, eps=1e-10,
        QUANT_GROUP_SIZE=qgs, CHUNKS_PER_HEAD=chunks, NOPE_DIM=hd - 64, HALF_ROPE=32,
        QUANTIZE=quantize, TMA_ALIGNED_SCALES=packed, launch_pdl=False, num_stages=1, num_warps=1)
    return out, sc


@pytest.mark.parametrize("packed,quantize", [(False, True), (True, True), (False, False)])
def test_inv_rope_fp8_quant_matches_upstream(up, packed, quantize, device):
    gen = torch.Generator().manual_seed(200 + 2 * packed + quantize)
    t, n_groups, hpg = 5, 2, 2  # 5 tokens: the scale buffer has 3 padding rows
    o = _edge_rows(t * n_groups * hpg, 512, gen).reshape(t, n_groups * hpg, 512).to(torch.bfloat16)
    positions = torch.randint(0, 64, (t,), generator=gen, dtype=torch.int64)
    cos_sin = _cos_sin(64, 64, gen)
    o, positions, cos_sin = _on(device, o, positions, cos_sin)
    ref_out, ref_sc = _upstream_inv_rope(up, o, positions, cos_sin, n_groups, hpg, 128, packed, quantize)
    res = {}
    for v in VARIANTS:
        out, sc = v4.fused_inv_rope_fp8_quant(o, positions, cos_sin, n_groups, hpg,
                                              tma_aligned_scales=packed, quantize=quantize, variant=v)
        assert out.shape == (t, n_groups, hpg * 512)
        assert out.dtype == (torch.float8_e4m3fn if quantize else o.dtype)
        _assert_same(out.transpose(0, 1), ref_out, f"{v} values vs upstream")
        if quantize:
            # The whole scale storage, padding rows included.
            _assert_same(sc.transpose(0, 1).as_strided((sc.untyped_storage().nbytes() // 4,), (1,)),
                         ref_sc.as_strided((ref_sc.untyped_storage().nbytes() // 4,), (1,)),
                         f"{v} scales vs upstream")
        res[v] = (out, sc)
    _assert_same(res["sm80"][0], res["sm90"][0], "sm80 vs sm90 values")


# ----------------------------------------------------------------- V4 indexer Q
def test_indexer_q_rope_quant_matches_upstream(up, device):
    gen = torch.Generator().manual_seed(300)
    t, h, hd = 8, 8, 128
    q = _edge_rows(t * h, hd, gen).reshape(t, h, hd).to(torch.bfloat16)
    positions = torch.randint(0, 64, (t,), generator=gen, dtype=torch.int64)
    cos_sin = _cos_sin(64, 64, gen)
    weights = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    sm_scale, head_scale = 128 ** -0.5, 4 ** -0.5
    q, positions, cos_sin, weights = _on(device, q, positions, cos_sin, weights)
    ref_q = torch.empty(t, h, hd, dtype=torch.float8_e4m3fn, device=device)
    ref_w = torch.empty(t, h, dtype=torch.float32, device=device)
    up["v4_fused_indexer_q"].FusedIndexerQRopeQuantTritonKernel_kernel[(t, h)](
        positions, q, q.stride(0), q.stride(1), cos_sin, cos_sin.stride(0), 32,
        ref_q, ref_q.stride(0), ref_q.stride(1), hd, weights, weights.stride(0), sm_scale,
        head_scale, ref_w, ref_w.stride(0), FP8_MAX=448.0, USE_FNUZ=False,
        USE_EXPLICIT_FMA=False, num_warps=1)
    res = {}
    for v in VARIANTS:
        res[v] = v4.fused_indexer_q_rope_quant(positions, q, cos_sin, weights, sm_scale, head_scale,
                                               variant=v)
        _assert_same(res[v][0], ref_q, f"{v} q vs upstream")
        _assert_same(res[v][1], ref_w, f"{v} weights vs upstream")
    _assert_same(res["sm80"][0], res["sm90"][0], "sm80 vs sm90")
    # variant=None resolves to this machine's variant ("cpu": the software cast; on the
    # H200 "sm90"); sm80 == sm90 was asserted above, so either must match.
    q8, w = v4.fused_indexer_q_rope_quant(positions, q, cos_sin, weights, sm_scale, head_scale)
    _assert_same(q8, res["sm80"][0], "default variant vs sm80")


# ----------------------------------------------------------------- input validation
def test_validation_names_the_tensor():
    latent = torch.zeros(4, 512, dtype=torch.bfloat16)
    pos = torch.zeros(4, dtype=torch.int64)
    cs = torch.zeros(8, 64)
    with pytest.raises(ValueError, match="kv_cache"):
        v41.rope_quant_insert(latent, pos, cs, torch.zeros(2, 8, 528, dtype=torch.uint8), pos, 1)
    with pytest.raises(ValueError, match="latent"):
        v41.rope_quant_insert(latent.float(), pos, cs, rec.new_cache(2, 8), pos, 1)
    with pytest.raises(ValueError, match="compress_ratio"):
        v41.rope_quant_insert(latent, pos, cs, rec.new_cache(2, 8), pos, 4)
    with pytest.raises(ValueError, match="k_cache"):
        v41.indexer_k_norm_rope_store(torch.zeros(4, 128, dtype=torch.bfloat16), pos, cs,
                                      torch.ones(128), 1e-6, torch.zeros(2, 8, 128, dtype=torch.uint8),
                                      pos, 1, False)
    with pytest.raises(NotImplementedError):
        v41.indexer_k_norm_rope_store(torch.zeros(4, 128, dtype=torch.bfloat16), pos, cs,
                                      torch.ones(128), 1e-6, torch.zeros(2, 8, 132, dtype=torch.uint8),
                                      pos, 1, True)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        v4.fused_inv_rope_fp8_quant(torch.zeros(2, 4, 512, dtype=torch.bfloat16), pos, cs.double(), 2, 2)
    with pytest.raises(ValueError, match="o"):
        v4.fused_inv_rope_fp8_quant(torch.zeros(2, 4, 512, dtype=torch.bfloat16), pos, cs, 3, 2)
    with pytest.raises(ValueError, match="index_weights"):
        v4.fused_indexer_q_rope_quant(pos, torch.zeros(4, 2, 128, dtype=torch.bfloat16), cs,
                                      torch.zeros(4, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="variant"):
        v4.fused_indexer_q_rope_quant(pos, torch.zeros(4, 2, 128, dtype=torch.bfloat16), cs,
                                      torch.zeros(4, 2), 1.0, 1.0, variant="sm70")
