"""vllm.deepinfer.kernels.kv_gather: bit-identical to upstream's 584-byte gather and to torch.

Inputs are built on the CPU and moved to the ``device`` fixture's device; results are compared
on the CPU as int16 bit patterns. References: ``kv_record.read_rows`` (torch: fp32 product,
round to nearest even to bf16; RoPE as the raw record bits) and upstream's
``_dequantize_and_gather_k_kernel`` launched as upstream launches it.

On the CPU machine the kernels run in the Triton interpreter, which has two defects the
comparisons work around:
* its fp32 -> bf16 cast truncates instead of rounding to nearest even, and mishandles fp32
  subnormal inputs (it renormalizes them, then clamps the exponent). e4m3 (4 significant
  bits) times a power of two is exact in bf16 (8 significant bits) whenever the product is an
  fp32 normal, and products below 2^-126 need scale bytes < 20 (the writer never stores a
  byte below 105). So, interpreted, the torch comparison covers every element whose fp32
  product is a normal number (or 0, inf) — ``test_skipped_elements_are_subnormal`` proves the
  skipped ones are only those; the upstream comparison (same interpreter, same cast) covers
  every element. On a GPU every element is compared with torch.
* ``float8e4nv`` (our sm90 path and upstream's kernel) decodes the NaN codes 0x7F/0xFF as
  +-480 there: NaN codes are compared with torch on the software paths only (by NaN position:
  bf16 NaN payloads differ between torch, the interpreter and the GPU) and excluded from every
  upstream comparison.
Upstream compiles ``exp2`` to ``ex2.approx.ftz.f32`` on a GPU, which flushes scale byte 0
(2^-127) to 0; ours gives torch's value, so byte 0 is excluded from upstream comparisons.
"""
from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch

from edges import ODD_PAGES
from vllm.deepinfer import kv_record as kr
from vllm.deepinfer.kernels import kv_gather as kg


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def need_hw_fp8(device, variant):
    if variant in ("sm90", "hw") and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("hardware e4m3 needs sm_89+")


# --------------------------------------------------------------------------- helpers
def make_cache(gen, num_blocks, bs, device, *, page_pad=0, scale_lo=100, scale_hi=140,
               nan_codes=True):
    """Random records on ``device``: every e4m3 code (NaN codes optional), scale bytes in
    [lo, hi], random RoPE bits. ``page_pad`` > 0 gives a view whose stride(0) exceeds a page."""
    page = bs * kr.RECORD_BYTES
    buf = torch.randint(0, 256, (num_blocks, page + page_pad), dtype=torch.uint8, generator=gen)
    data = buf[:, :bs * kr.DATA_BYTES].reshape(num_blocks, bs, kr.DATA_BYTES)
    if not nan_codes:
        nope = data[..., :kr.NOPE_DIM]
        nope[(nope & 0x7F) == 0x7F] = 0x7E
    scales = buf[:, bs * kr.DATA_BYTES:page].reshape(num_blocks, bs, kr.SCALE_BYTES)
    scales[..., :7] = torch.randint(scale_lo, scale_hi + 1, (num_blocks, bs, 7), dtype=torch.uint8,
                                    generator=gen)
    scales[..., 7] = 0
    buf = buf.to(device)
    return buf.as_strided((num_blocks, bs, kr.RECORD_BYTES), (page + page_pad, kr.RECORD_BYTES, 1))


def code_table_cache(bs=64, ntok=37):
    """Every e4m3 code in every token, every scale byte 0..255 across the 37 * 7 = 259 groups."""
    cache = kr.new_cache(1, bs)
    data, scales = kr.record_views(cache)
    t = torch.arange(ntok)[:, None]
    data[0, :ntok, :kr.NOPE_DIM] = (torch.arange(kr.NOPE_DIM) + 13 * t) % 256
    data[0, :ntok, kr.NOPE_DIM:] = (torch.arange(2 * kr.ROPE_DIM) * 7 + t) % 256
    scales[0, :ntok, :kr.NUM_SCALES] = (torch.arange(kr.NUM_SCALES) + 7 * t) % 256
    return cache


def slots_of(seq_len, gather_len, block_row, bs):
    pos = torch.arange(seq_len - gather_len, seq_len)
    return block_row.cpu()[pos // bs].long() * bs + pos % bs


def reference(cache, slots):
    """(bf16 bits [n, 512] int16, fp32 NoPE products [n, 448], scale byte per NoPE value)."""
    rec = kr.read_records(cache.cpu(), slots)
    f = kr.dequantize_records(rec)
    bits = f.to(torch.bfloat16).view(torch.int16)
    bits[:, kr.NOPE_DIM:] = rec[:, kr.NOPE_DIM:kr.DATA_BYTES].contiguous().view(torch.int16)
    sbytes = rec[:, kr.DATA_BYTES:kr.DATA_BYTES + kr.NUM_SCALES].repeat_interleave(
        kr.QUANT_BLOCK, 1)
    return bits, f[:, :kr.NOPE_DIM], sbytes


def comparable(f32):
    """Elements whose bf16 result this backend's cast gets right (all of them on a GPU)."""
    if not interpreted():
        return torch.ones_like(f32, dtype=torch.bool)
    return (f32.abs() >= 2.0 ** -126) | (f32 == 0) | f32.isinf()


def assert_matches_reference(got_bf16, cache, slots):
    """Bit equality with torch (NaN codes by NaN position)."""
    want, f32, _ = reference(cache, slots)
    got_bf16 = got_bf16.cpu()
    got = got_bf16.contiguous().view(torch.int16)
    nan = f32.isnan()
    assert torch.equal(got_bf16[:, :kr.NOPE_DIM].isnan(), nan)
    cmp = comparable(f32) & ~nan
    assert torch.equal(got[:, :kr.NOPE_DIM][cmp], want[:, :kr.NOPE_DIM][cmp])
    assert torch.equal(got[:, kr.NOPE_DIM:], want[:, kr.NOPE_DIM:])


def assert_matches_upstream(got_bf16, up_bf16, cache, slots):
    """Bit equality with upstream's output rows, except NaN results and scale byte 0."""
    _, f32, sbytes = reference(cache, slots)
    got = got_bf16.cpu().contiguous().view(torch.int16)
    up = up_bf16.cpu().contiguous().view(torch.int16)
    keep = ~f32.isnan() & (sbytes != 0)
    assert torch.equal(got[:, :kr.NOPE_DIM][keep], up[:, :kr.NOPE_DIM][keep])
    assert torch.equal(got[:, kr.NOPE_DIM:], up[:, kr.NOPE_DIM:])


def run_upstream(upstream, out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
                 max_gather_len=None):
    """Upstream's launch of _dequantize_and_gather_k_kernel for 584-byte records on CUDA
    (dequantize_and_gather_k_cache_triton): grid (num_reqs, gather_num_workers)."""
    up = importlib.import_module(upstream.__name__ + ".v41_cache_utils")
    workers = 128 if max_gather_len is None else max(128, min(8192, -(-max_gather_len // 8)))
    up._dequantize_and_gather_k_kernel[(seq_lens.shape[0], workers)](
        out, out.stride(0), out.stride(1), k_cache, seq_lens, block_table, offset, gather_lens,
        max_blocks_per_seq=block_table.shape[-1], fp8_dim=kr.NOPE_DIM, bf16_dim=kr.ROPE_DIM,
        scale_dim=kr.SCALE_BYTES, quant_block=kr.QUANT_BLOCK, cache_block_size=block_size,
        token_data_size=kr.DATA_BYTES, block_stride=k_cache.stride(0), output_dim=kr.HEAD_DIM,
        fp8_max=kr.FP8_MAX, n_quant_blocks=kr.NUM_SCALES, use_fnuz=False)


def i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("bs,variant", [(64, "sm80"), (128, "sm90")])
def test_ragged_batch_matches_torch_and_upstream(upstream, device, bs, variant):
    """Several requests of different lengths, gather_len < seq_len, a gather crossing a page,
    offset > 0, an output that is a slice of a larger buffer (stride(0), stride(1) not the
    dense ones), pages addressed through a stride(0) larger than a page, e4m3 NaN codes on the
    software path."""
    need_hw_fp8(device, variant)
    gen = torch.Generator().manual_seed(bs)
    nb = 12
    cache = make_cache(gen, nb, bs, device, page_pad=48, nan_codes=variant == "sm80")
    seq = i32([bs + 37, 21, 2 * bs + 5], device)
    gl = i32([61, 21, 40], device)  # request 0 crosses a page
    bt = torch.stack([torch.randperm(nb, generator=gen)[:4] for _ in range(3)]).to(torch.int32)
    bt = bt.to(device)
    offset = 5
    big = torch.full((4, 120, 3 * 512), -7.0, dtype=torch.bfloat16, device=device)
    sentinel = big.clone()
    up_big = big.clone()
    out = big[:3, 2:2 + offset + 64, 512:1024]
    up_out = up_big[:3, 2:2 + offset + 64, 512:1024]

    kg.dequantize_and_gather_k_cache(out, cache, seq, gl, bt, bs, offset, variant=variant)
    run_upstream(upstream, up_out, cache, seq, gl, bt, bs, offset)

    for b in range(3):
        n = int(gl[b])
        slots = slots_of(int(seq[b]), n, bt[b], bs)
        assert_matches_reference(out[b, offset:offset + n], cache, slots)
        assert_matches_upstream(out[b, offset:offset + n], up_out[b, offset:offset + n], cache, slots)
    touched = torch.zeros(big.shape, dtype=torch.bool)
    for b in range(3):
        touched[b, 2 + offset:2 + offset + int(gl[b]), 512:1024] = True
    assert torch.equal(big.cpu().view(torch.int16)[~touched], sentinel.cpu().view(torch.int16)[~touched])


def test_gather_lens_none_and_max_gather_len(upstream, device):
    gen = torch.Generator().manual_seed(3)
    bs, nb = 64, 6
    cache = make_cache(gen, nb, bs, device, nan_codes=False)
    seq = i32([70, 9], device)
    bt = i32([[4, 1], [2, 0]], device)
    out = torch.zeros(2, 80, 512, dtype=torch.bfloat16, device=device)
    ref = torch.zeros_like(out)
    kg.dequantize_and_gather_k_cache(out, cache, seq, None, bt, bs, 0, max_gather_len=70,
                                     variant="sm80")
    run_upstream(upstream, ref, cache, seq, None, bt, bs, 0, max_gather_len=70)
    assert torch.equal(out.cpu().view(torch.int16), ref.cpu().view(torch.int16))
    for b in range(2):
        n = int(seq[b])
        assert_matches_reference(out[b, :n], cache, slots_of(n, n, bt[b], bs))


@pytest.mark.parametrize("lo,hi", [(1, 20), (230, 254)])
@pytest.mark.parametrize("variant", ["sm80", "sm90"])
def test_scale_byte_extremes(upstream, device, lo, hi, variant):
    """Scale bytes at both ends: bf16 subnormal products (1..20); products up to overflow
    (254 with |x| = 448 is inf in fp32, upstream too)."""
    need_hw_fp8(device, variant)
    gen = torch.Generator().manual_seed(lo)
    bs = 64
    cache = make_cache(gen, 2, bs, device, scale_lo=lo, scale_hi=hi, nan_codes=False)
    seq = i32([48], device)
    bt = i32([[1]], device)
    out = torch.zeros(1, 48, 512, dtype=torch.bfloat16, device=device)
    ref = torch.zeros_like(out)
    kg.dequantize_and_gather_k_cache(out, cache, seq, None, bt, bs, 0, variant=variant)
    run_upstream(upstream, ref, cache, seq, None, bt, bs, 0)
    assert torch.equal(out.cpu().view(torch.int16), ref.cpu().view(torch.int16))
    assert_matches_reference(out[0], cache, slots_of(48, 48, bt[0], bs))


def test_skipped_elements_are_subnormal():
    """The products the interpreted torch comparison skips are fp32 subnormals (< 2^-126),
    which only scale bytes below 20 produce; every normal product is exact in bf16, so the
    rounding mode cannot matter for the compared ones."""
    codes = torch.arange(256, dtype=torch.uint8)
    x = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float()
    for byte in range(0, 255):
        p = x * torch.exp2(torch.tensor(byte - 127.0, dtype=torch.float64)).float()
        keep = (p.abs() >= 2.0 ** -126) | (p == 0) | p.isinf()
        assert torch.equal(p[keep].to(torch.bfloat16).float(), p[keep])
        if byte >= 20:
            assert keep.all()


@pytest.mark.parametrize("decode", ["int", "f16bits", "e4b15", "hw"])
def test_every_code_and_scale_byte(monkeypatch, upstream, device, decode):
    """All 256 e4m3 codes under all 256 scale bytes (0: 2^-127; 255: inf, and 0 * inf = NaN),
    through each decoder in the Ampere tile, against torch and upstream."""
    need_hw_fp8(device, decode)
    monkeypatch.setitem(kg.TILES, "cpu", dataclasses.replace(kg.TILES["cpu"], decode=decode))
    bs, ntok = 64, 37
    cache = code_table_cache(bs, ntok).to(device)
    seq = i32([ntok], device)
    bt = i32([[0]], device)
    out = torch.zeros(1, ntok, 512, dtype=torch.bfloat16, device=device)
    kg.dequantize_and_gather_k_cache(out, cache, seq, None, bt, bs, 0, variant="cpu")
    slots = torch.arange(ntok)
    ref = torch.zeros_like(out)
    run_upstream(upstream, ref, cache, seq, None, bt, bs, 0)
    if decode == "hw" and interpreted():  # fp8e4nv reads NaN codes as +-480 (module doc)
        want, f32, _ = reference(cache, slots)
        nope = kr.read_records(cache.cpu(), slots)[:, :kr.NOPE_DIM]
        nan_code = (nope & 0x7F) == 0x7F
        ok = ~nan_code & ~f32.isnan() & comparable(f32)
        got = out[0].cpu().view(torch.int16)
        assert torch.equal(got[:, :kr.NOPE_DIM][ok], want[:, :kr.NOPE_DIM][ok])
        assert torch.equal(got[:, kr.NOPE_DIM:], want[:, kr.NOPE_DIM:])
    else:
        assert_matches_reference(out[0], cache, slots)
    assert_matches_upstream(out[0], ref[0], cache, slots)


@pytest.mark.parametrize("bs", ODD_PAGES)
def test_odd_page_sizes(upstream, device, bs):
    """Pages that are not powers of two (the kernel divides positions by a runtime block
    size) with a page stride that is not a multiple of 16 (but even: the bf16 RoPE values
    need 2-byte alignment, see test_odd_page_stride_is_refused): gathers that start mid-page
    and cross several pages, against torch and upstream."""
    gen = torch.Generator().manual_seed(bs)
    seq_lens = [bs + 40, 3 * bs + 1]
    blocks = -(-max(seq_lens) // bs)
    nb = blocks + 3
    cache = make_cache(gen, nb, bs, device, page_pad=6, nan_codes=False)
    assert cache.stride(0) % 16 != 0 and cache.stride(0) % 2 == 0
    seq = i32(seq_lens, device)
    gl = i32([bs + 5, 2 * bs], device)
    bt = torch.stack([torch.randperm(nb, generator=gen)[:blocks] for _ in range(2)])
    bt = bt.to(torch.int32).to(device)
    out = torch.zeros(2, 2 * bs + 8, 512, dtype=torch.bfloat16, device=device)
    ref = torch.zeros_like(out)
    kg.dequantize_and_gather_k_cache(out, cache, seq, gl, bt, bs, 3, variant="sm80")
    run_upstream(upstream, ref, cache, seq, gl, bt, bs, 3)
    assert torch.equal(out.cpu().view(torch.int16), ref.cpu().view(torch.int16))
    for b in range(2):
        n = int(gl[b])
        assert_matches_reference(out[b, 3:3 + n], cache, slots_of(int(seq[b]), n, bt[b], bs))


def test_many_requests_split_across_launches(device):
    """More requests than the largest request bucket (1024): launched in slices."""
    gen = torch.Generator().manual_seed(11)
    bs, nb = 64, 4
    cache = make_cache(gen, nb, bs, device, nan_codes=False)
    R = 1030
    live = [0, 700, 1023, 1024, 1029]
    gl_cpu = torch.zeros(R, dtype=torch.int32)
    gl_cpu[live] = torch.tensor([3, 5, 1, 2, 4], dtype=torch.int32)
    bt = torch.randint(0, nb, (R, 1), dtype=torch.int32, generator=gen).to(device)
    out = torch.zeros(R, 6, 512, dtype=torch.bfloat16, device=device)
    kg.dequantize_and_gather_k_cache(out, cache, torch.full((R,), 5, dtype=torch.int32, device=device),
                                     gl_cpu.to(device), bt, bs, 1, variant="sm80")
    for b in live:
        n = int(gl_cpu[b])
        assert_matches_reference(out[b, 1:1 + n], cache, slots_of(5, n, bt[b], bs))
    written = out.cpu().view(torch.int16).ne(0).any(-1).sum(-1)
    assert written[[b for b in range(R) if b not in live]].sum() == 0


def test_medium_batch_bucket(upstream, device):
    """20 requests (the 128-request bucket), some empty, one longer than a page, a tiny grid."""
    gen = torch.Generator().manual_seed(5)
    bs, nb = 64, 8
    cache = make_cache(gen, nb, bs, device, nan_codes=False)
    R = 20
    seq = torch.randint(1, 100, (R,), dtype=torch.int32, generator=gen)
    seq[3] = 130
    gl = torch.minimum(seq, torch.randint(0, 12, (R,), dtype=torch.int32, generator=gen))
    gl[3] = 70
    bt = torch.randint(0, nb, (R, 3), dtype=torch.int32, generator=gen).to(device)
    seq, gl = seq.to(device), gl.to(device)
    out = torch.zeros(R, 72, 512, dtype=torch.bfloat16, device=device)
    ref = torch.zeros_like(out)
    kg.dequantize_and_gather_k_cache(out, cache, seq, gl, bt, bs, 2, variant="sm80", sm_count=3)
    run_upstream(upstream, ref, cache, seq, gl, bt, bs, 2)
    assert torch.equal(out.cpu().view(torch.int16), ref.cpu().view(torch.int16))


# --------------------------------------------------------------------------- validation
def _args(**over):
    a = dict(out=torch.zeros(1, 8, 512, dtype=torch.bfloat16), k_cache=kr.new_cache(2, 64),
             seq_lens=torch.tensor([8], dtype=torch.int32), gather_lens=None,
             block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=64, offset=0)
    a.update(over)
    return a


@pytest.mark.parametrize("over,name", [
    (dict(k_cache=torch.zeros(2, 64, 528, dtype=torch.uint8)), "k_cache"),
    (dict(k_cache=torch.zeros(2, 64, 584, dtype=torch.int8)), "k_cache"),
    (dict(out=torch.zeros(1, 8, 512, dtype=torch.float32)), "out"),
    (dict(out=torch.zeros(1, 8, 448, dtype=torch.bfloat16)), "out"),
    (dict(out=torch.zeros(1, 512, 8, dtype=torch.bfloat16).transpose(1, 2)), "out"),
    (dict(seq_lens=torch.tensor([8], dtype=torch.int64)), "seq_lens"),
    (dict(gather_lens=torch.tensor([8, 8], dtype=torch.int32)), "gather_lens"),
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int64)), "block_table"),
    (dict(offset=9), "offset"),
    (dict(block_size=128), "k_cache"),
])
def test_validation_names_the_tensor(over, name):
    with pytest.raises(ValueError, match=name):
        kg.dequantize_and_gather_k_cache(**_args(**over), variant="sm80")


def test_checks_accept_valid_inputs():
    # The per-call checks pass good inputs (a gather_lens tensor, an offset at the end of the
    # output) and reject a wrong record width and a missing tensor.
    kg._check_inputs(**_args())
    kg._check_inputs(**_args(gather_lens=torch.tensor([8], dtype=torch.int32), offset=8))
    with pytest.raises(ValueError, match="^k_cache: "):
        kg._check_inputs(**_args(k_cache=torch.zeros(2, 64, 528, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="^out: expected a torch.Tensor"):
        kg._check_inputs(**_args(out=None))


def test_benchmark_tile_rows_are_variants(monkeypatch, device):
    """A row added to TILES under its own name (the suite's sm80-int / sm80-e4b15 rows) runs
    by that name and gives the sm80 row's bytes."""
    monkeypatch.setitem(kg.TILES, "sm80-int", dataclasses.replace(kg.TILES["sm80"], decode="int"))
    cache = make_cache(torch.Generator().manual_seed(2), 2, 64, device, nan_codes=False)
    outs = []
    for v in ("sm80", "sm80-int"):
        outs.append(torch.zeros(1, 9, 512, dtype=torch.bfloat16, device=device))
        kg.dequantize_and_gather_k_cache(outs[-1], cache, i32([9], device), None,
                                         i32([[1]], device), 64, 0, variant=v)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert outs[0].view(torch.int16).ne(0).any()


def test_fnuz_and_unknown_variant():
    with pytest.raises(NotImplementedError, match="ROCm"):
        kg.dequantize_and_gather_k_cache(**_args(), use_fnuz=True)
    with pytest.raises(ValueError, match="sm75"):
        kg.dequantize_and_gather_k_cache(**_args(), variant="sm75")


def test_compile_keys_cover_registered_specs():
    from vllm.deepinfer import compile_gate
    specs = {(tuple(sorted(s.constexprs.items())), s.num_warps) for s in compile_gate.specs()
             if s.kernel is kg._gather_kernel}
    for v in ("sm80", "sm86", "sm89", "sm90", "sm100"):
        keys = kg.compile_keys(v)
        assert len(keys) == 6
        for k in keys:
            assert (tuple(sorted(k.constexprs().items())), k.num_warps) in specs, (v, k)


def test_odd_page_stride_is_refused():
    """An odd page stride would make the kernel read bf16 at odd addresses (a CUDA
    "misaligned address" on the H200): the launcher refuses it, naming k_cache."""
    gen = torch.Generator().manual_seed(0)
    cache = make_cache(gen, 4, 16, "cpu", page_pad=5, nan_codes=False)
    out = torch.zeros(1, 16, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_cache.*odd"):
        kg.dequantize_and_gather_k_cache(out, cache, i32([16], "cpu"), None,
                                         torch.zeros(1, 1, dtype=torch.int32), 16, 0,
                                         variant="sm80")
