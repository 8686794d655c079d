"""The Ampere path's 32-bit hazards in upstream's ragged prefill and pack/unpack (split out
of tests/test_int32_hazards.py, which holds the ragged lists, decode and indexer-logits
launches; its docstring describes every hazard).

* Upstream's ragged prefill (DEEPINFER_SPARSE_MLA_PREFILL=0) forms ``query * heads * 512``
  in int32: routing.sparse_attn_prefill refuses such calls instead of letting upstream wrap.
* pack_seq / unpack_seq on bytes (patch 0017): upstream's kernels form ``row * D`` in int32
  (past 262,144 padded rows at D = 8,192); kernels/pack_seq.py is the int64 kernel, tested
  against upstream's kernels and at rows 2^31 elements apart.
"""
from __future__ import annotations

import pytest
import torch

# The probe runner and the int32 bound are test_int32_hazards.py's (its boundary cases share
# tests/int32_hazard_probe.py).
from test_int32_hazards import INT32_MAX, _probe  # noqa: F401


# ----------------------------------------------------------------------------- upstream prefill
@pytest.fixture
def prefill_off(monkeypatch):
    from vllm.deepinfer import routing
    monkeypatch.setenv("DEEPINFER_SPARSE_MLA_PREFILL", "0")
    routing.reset()
    yield routing
    monkeypatch.delenv("DEEPINFER_SPARSE_MLA_PREFILL")
    routing.reset()


def _prefill_args(tokens, heads, *, width=640, ragged=False, dtype=torch.bfloat16):
    """Shapes only (meta tensors: nothing is allocated): q/output [tokens, heads, 512], kv
    [rows, 1, 512], dense indices [tokens, width] or a ragged list of tokens x width."""
    meta = dict(device="meta")
    q = torch.empty(tokens, heads, 512, dtype=dtype, **meta)
    kv = torch.empty(4096, 1, 512, dtype=dtype, **meta)
    idx = torch.empty(tokens, width, dtype=torch.int32, **meta)
    lens = torch.empty(tokens, dtype=torch.int32, **meta)
    out = torch.empty_like(q)
    extra = dict(ragged_indices=idx.view(-1), ragged_indptr=torch.empty(
        tokens + 1, dtype=torch.int32, **meta)) if ragged else {}
    return (q, kv, None if ragged else idx, None if ragged else lens, 0.04, 512, 448, 64,
            None, out), extra


@pytest.mark.parametrize("tokens,heads,ragged", [(65537, 64, False), (32769, 128, True),
                                                 (1 << 20, 64, True)])
def test_upstream_prefill_refused_past_int32(prefill_off, tokens, heads, ragged):
    """DEEPINFER_SPARSE_MLA_PREFILL=0 hands the call to upstream's kernel, whose
    query x heads x 512 offsets wrap past 65,536 rows at 64 heads (row 65,536 starts at
    2^31): refused, naming q and the bound and saying how to turn the feature back on."""
    args, kw = _prefill_args(tokens, heads, ragged=ragged)
    with pytest.raises(ValueError, match=r"^q: this sparse MLA prefill call reaches offset or "
                       r"count \d+, past the 2147483647 .* because the sparse_mla_prefill feature "
                       r"is off; turn it on \(DEEPINFER_SPARSE_MLA_PREFILL=1"):
        prefill_off.sparse_attn_prefill(*args, **kw)


@pytest.mark.parametrize("tokens,heads", [(65536, 64), (32768, 128), (1, 64)])
def test_upstream_prefill_takes_calls_within_int32(prefill_off, tokens, heads):
    """One row fewer: q's last element is at exactly 2^31 - 1; upstream's turn."""
    args, kw = _prefill_args(tokens, heads, width=512)
    assert prefill_off.sparse_attn_prefill(*args, **kw) is False


def test_upstream_prefill_refuses_wide_index_lists(prefill_off):
    """Within q's bound, but rows x width of the dense indices past int32 (upstream's
    conversion and indptr): refused naming the indices."""
    args, kw = _prefill_args(16384, 16, width=131072)
    with pytest.raises(ValueError, match=r"^indices: this sparse MLA prefill call reaches "
                       r"offset or count 2147483648"):
        prefill_off.sparse_attn_prefill(*args, **kw)


def test_uncovered_prefill_refused_past_int32(monkeypatch):
    """Feature on, but a call ours does not cover (fp16) goes to upstream: refused too."""
    from vllm.deepinfer import routing
    monkeypatch.setenv("DEEPINFER_SPARSE_MLA_PREFILL", "1")
    routing.reset()
    try:
        args, kw = _prefill_args(65537, 64, dtype=torch.float16)
        with pytest.raises(ValueError, match=r"^q: .* because our prefill does not cover it"):
            routing.sparse_attn_prefill(*args, **kw)
        small, kw = _prefill_args(4, 64, dtype=torch.float16)
        assert routing.sparse_attn_prefill(*small, **kw) is False
    finally:
        monkeypatch.delenv("DEEPINFER_SPARSE_MLA_PREFILL")
        routing.reset()


# ----------------------------------------------------------------------------- pack / unpack
@pytest.fixture(scope="module")
def upstream_pack(tmp_path_factory):
    """Upstream's ``PackSeqTritonKernel.kernel`` and ``UnpackSeqTritonKernel.kernel``
    (v1/attention/ops/common.py), cut out of the pinned source by tools/extract_upstream.py's
    extractor into a module of this test's own (Triton needs a source file)."""
    import importlib.util

    from _common import UPSTREAM_TREE
    from extract_upstream import HEADER_IMPORTS, Extractor
    if not (UPSTREAM_TREE / "vllm" / "v1" / "attention" / "ops" / "common.py").is_file():
        pytest.skip(f"{UPSTREAM_TREE} missing: run `make upstream`")
    ex = Extractor(UPSTREAM_TREE)
    for qn in ("PackSeqTritonKernel.kernel", "UnpackSeqTritonKernel.kernel"):
        ex.emit("vllm/v1/attention/ops/common.py", qn)
    path = tmp_path_factory.mktemp("upstream") / "upstream_pack_seq.py"
    path.write_text("\n".join([*HEADER_IMPORTS, "", *ex.chunks]))
    spec = importlib.util.spec_from_file_location("upstream_pack_seq", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _upstream_pack(up, x, lengths, pad):
    """upstream pack_seq_triton's uint8 path (its host code: reshape to [N, D], Lmax from
    the lengths, grid (B, Lmax / 64, D / 64), 4 warps, 2 stages)."""
    import triton
    x2 = x.reshape(x.shape[0], -1)
    B, D, lmax = lengths.numel(), x2.shape[1], int(lengths.max())
    out = torch.empty(B, lmax, D, dtype=torch.uint8, device=x.device)
    up.PackSeqTritonKernel_kernel[(B, triton.cdiv(lmax, 64), triton.cdiv(D, 64))](
        x2, out, lengths.int(), x2.shape[0], D, lmax, PAD_VALUE=pad, PAD_IS_UINT8=True,
        BLOCK_T=64, BLOCK_D=64, num_warps=4, num_stages=2)
    return out.reshape(B, lmax, *x.shape[1:])


def _upstream_unpack(up, packed, lengths):
    import triton
    B, lmax = packed.shape[:2]
    p3 = packed.reshape(B, lmax, -1)
    D = p3.shape[2]
    out = torch.empty(int(lengths.sum()), D, dtype=packed.dtype, device=packed.device)
    up.UnpackSeqTritonKernel_kernel[(B, triton.cdiv(lmax, 64), triton.cdiv(D, 64))](
        p3, out, lengths.int(), B, lmax, D, BLOCK_T=64, BLOCK_D=64, num_warps=4, num_stages=2)
    return out.reshape(-1, *packed.shape[2:])


@pytest.mark.parametrize("lens,inner,pad", [
    ([2, 1, 3], (4, 32), 0),        # the indexer's [tokens, heads, 128] e4m3 Q, small
    ([70, 0, 5], (2, 100), 7),      # a row block past 64, an empty request, D not 64-aligned
    ([1], (1,), 255),
])
def test_pack_matches_upstream_bits(upstream_pack, device, lens, inner, pad):
    from vllm.deepinfer.kernels import pack_seq as ps
    g = torch.Generator().manual_seed(sum(lens) + pad)
    lengths = torch.tensor(lens, dtype=torch.int32, device=device)
    x = torch.randint(0, 256, (sum(lens) + 2, *inner), generator=g, dtype=torch.int32)
    x = x.to(torch.uint8).to(device)
    got = ps.pack_seq_bytes(x, lengths, pad)
    assert torch.equal(got.cpu(), _upstream_pack(upstream_pack, x, lengths, pad).cpu())
    e4m3 = ps.pack_seq_bytes(x.view(torch.float8_e4m3fn), lengths)
    assert e4m3.dtype == torch.float8_e4m3fn
    assert torch.equal(e4m3.view(torch.uint8).cpu(),
                       _upstream_pack(upstream_pack, x, lengths, 0).cpu())


@pytest.mark.parametrize("dtype,lens,inner", [
    (torch.int32, [2, 1, 3], (40,)),     # the top-k rows
    (torch.int32, [66, 3], (5, 3)),
    (torch.bfloat16, [1, 0, 2], (70,)),
    (torch.uint8, [3], (9,)),
])
def test_unpack_matches_upstream_bits(upstream_pack, device, dtype, lens, inner):
    from vllm.deepinfer.kernels import pack_seq as ps
    g = torch.Generator().manual_seed(len(lens) * 7 + inner[0])
    lengths = torch.tensor(lens, dtype=torch.int32, device=device)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (len(lens), max(lens) + 1, *inner, size), generator=g,
                        dtype=torch.int32).to(torch.uint8)
    packed = raw.view(dtype).squeeze(-1).to(device)  # random bits of the dtype
    got = ps.unpack_seq(packed, lengths)
    want = _upstream_unpack(upstream_pack, packed, lengths)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8).cpu(),
                                              want.view(torch.uint8).cpu())


def test_pack_unpack_round_trip_and_checks(device):
    from vllm.deepinfer.kernels import pack_seq as ps
    lengths = torch.tensor([3, 1], dtype=torch.int64, device=device)
    x = torch.arange(8 * 6, dtype=torch.int32).to(torch.uint8).view(8, 6).to(device)
    packed = ps.pack_seq_bytes(x, lengths, 9)
    assert packed.shape == (2, 3, 6) and (packed[1, 1:] == 9).all()
    assert torch.equal(ps.unpack_seq(packed, lengths).cpu(), x[:4].cpu())
    with pytest.raises(ValueError, match=r"^lengths: sum to 9, more than x's 8 rows"):
        ps.pack_seq_bytes(x, torch.tensor([4, 5], device=device))
    with pytest.raises(ValueError, match=r"^x: expected \[N, \.\.\.\] of a 1-byte dtype"):
        ps.pack_seq_bytes(x.float(), lengths)
    with pytest.raises(ValueError, match=r"^pad: expected an int byte"):
        ps.pack_seq_bytes(x, lengths, 256)
    with pytest.raises(ValueError, match=r"^lengths: 2 lengths up to 3 for 2 requests of 2"):
        ps.unpack_seq(packed[:, :2], lengths)


@pytest.mark.parametrize("case", ["pack", "unpack"])
def test_pack_rows_past_int32(device, case):
    """Ours with the input's rows 2^31 elements apart (one process each)."""
    r = _probe(device, case, "ours")
    assert r["prev_offset"] <= INT32_MAX < r["last_offset"], r
    assert r["equal"], f"{case}: rows past 2^31 elements differ from the compact run"


def test_routing_pack_and_unpack(monkeypatch, device):
    """The entry points patch 0017 calls: ours on the Ampere path (fp8_sw),
    None elsewhere (upstream's function keeps the call)."""
    from vllm.deepinfer import routing
    from vllm.deepinfer.kernels import pack_seq as ps
    lengths = torch.tensor([2, 3], dtype=torch.int32, device=device)
    x = torch.randint(0, 256, (5, 2, 8), dtype=torch.int32).to(torch.uint8).to(device)
    e4m3 = x.view(torch.float8_e4m3fn)
    topk = torch.arange(2 * 3 * 4, dtype=torch.int32, device=device).view(2, 3, 4)
    monkeypatch.delenv("DEEPINFER_FP8_SW", raising=False)
    routing.reset()
    try:
        on = routing.use("fp8_sw")
        got = routing.pack_seq_fp8(e4m3, lengths)
        assert (got is not None) == on and routing.pack_seq_fp8(x, lengths) is None
        if on:
            assert got.dtype == torch.float8_e4m3fn and torch.equal(
                got.view(torch.uint8).cpu(), ps.pack_seq_bytes(x, lengths).cpu())
            assert torch.equal(routing.unpack_seq(topk, lengths).cpu(),
                               torch.cat([topk[0, :2], topk[1, :3]]).cpu())
        monkeypatch.setenv("DEEPINFER_FP8_SW", "0")
        routing.reset()
        assert routing.pack_seq_fp8(e4m3, lengths) is None
        assert routing.unpack_seq(topk, lengths) is None
    finally:
        monkeypatch.delenv("DEEPINFER_FP8_SW", raising=False)
        routing.reset()


