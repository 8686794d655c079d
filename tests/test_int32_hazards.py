"""The Ampere path's remaining 32-bit and launch-size hazards, each with its fix.

* Dense -> ragged index lists (kernels/ragged_indices.py, used by attention/common.py's
  decode): upstream's ``build_ragged_indices_from_dense`` forms ``row * stride(0)`` in int32
  and keeps an int32 ``indptr``: wrong lists past 262,144 decode tokens x 8,192 columns.
  Ours gives upstream's bits wherever upstream's products fit, stays right with rows 2^31
  elements apart (a boundary case per process, tests/int32_hazard_probe.py; upstream's is a
  strict xfail: it crashes), and refuses a batch whose lists the decode's int32 ``indptr``
  could not address, naming the tensor.
* Launch size: CUDA takes at most 65,535 programs on grid axes y and z. The decode puts its
  tokens there (attention kernel z, two-phase first phase and reduce y), the indexer logits
  their rows (y). The launchers now run chunks of at most that many tokens / rows; with the
  bound lowered by its module constant the chunked launches give the unchunked bits.
* The decode's ``_ragged`` cast int64 lists to int32 unchecked: a slot of 2^32 + 3 became
  slot 3. Out-of-range int64 slots are now dropped (skipped, as the decode skips any
  invalid slot) and lists the int32 offsets cannot address are refused by name.
* Upstream's ragged prefill (DEEPINFER_SPARSE_MLA_PREFILL=0) forms ``query * heads * 512``
  in int32: routing.sparse_attn_prefill refuses such calls instead of letting upstream wrap.
* pack_seq / unpack_seq on bytes (patch 0017): upstream's kernels form ``row * D`` in int32
  (past 262,144 padded rows at D = 8,192). Patch 0017 routes both calls to
  kernels/pack_seq.py, the int64 kernels, tested here against upstream's kernels and at rows
  2^31 elements apart (the routing itself: tests/test_vllm_import.py).

The tests marked ``gpu`` launch just past the real bound (65,537 decode tokens, 65,537 paged
and 131,075 gathered logits rows) on a CUDA device; on a CPU they are skipped.
"""
from __future__ import annotations

import ast
import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import subproc
import torch

from vllm.deepinfer.kernels import ragged_indices as ri

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "tests" / "int32_hazard_probe.py"
INT32_MAX = 2 ** 31 - 1


def _probe(device: str, *args: str) -> dict:
    r = subproc.run([sys.executable, str(PROBE), *args, "--device", device], cap=300)
    assert r.returncode == 0, (f"{' '.join(args)}: exit {r.returncode} (a negative code is "
                               f"the signal that killed it)\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _upstream_built() -> bool:
    return (REPO / "build" / "upstream_kernels" / "__init__.py").is_file()


# ----------------------------------------------------------------------------- ragged lists
def _upstream_ragged(indices, lengths, num_rows):
    import int32_hazard_probe as hp
    return hp.upstream_ragged(indices, lengths, num_rows)


def _same_lists(ours, theirs):
    (f0, p0), (f1, p1) = ours, theirs
    assert p0.dtype == p1.dtype == torch.int32 and f0.dtype == f1.dtype == torch.int32
    assert torch.equal(p0.cpu(), p1.cpu())
    assert f0.shape == f1.shape  # R * W: the decode sizes its plan from numel()
    n = int(p0[-1])
    assert torch.equal(f0[:n].cpu(), f1[:n].cpu())


def _dense(rows, width, seed, device, *, lo=-3, hi=600, dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (rows, width), generator=g, dtype=dtype).to(device)


@pytest.mark.parametrize("rows,width,lens,num_rows", [
    (5, 128, [128, 7, 0, 200, 64], 500),      # a window row: full, short, empty, past W
    (4, 1100, [1100, 1025, 1024, 3], 550),    # past one 1024-column step
    (3, 16, [16, 5, -2], -1),                 # no KV bound: every value >= 0 kept
    (6, 1, [1, 0, 1, 1, 5, 1], 300),
    (2, 640, [640, 333], 0),                  # a bound of 0 rows keeps nothing
])
def test_ragged_matches_upstream_bits(upstream, device, rows, width, lens, num_rows):
    dense = _dense(rows, width, rows * width, device)
    lengths = torch.tensor(lens, dtype=torch.int32, device=device)
    _same_lists(ri.build_ragged_indices_from_dense(dense, lengths, num_rows=num_rows),
                _upstream_ragged(dense, lengths, num_rows))


def test_ragged_matches_upstream_on_views_and_dtypes(upstream, device):
    """[T, 1, W] rows (the SWA metadata's shape), a row slice of a wider buffer, int64
    indices and lengths (values inside int32), lengths on another device."""
    base = _dense(7, 300, 3, device)
    lengths = torch.tensor([300, 10, 299, 0, 150, 1, 77], dtype=torch.int32, device=device)
    cases = [(base.view(7, 1, 300), lengths), (base[:, :200], lengths.clamp(max=200)),
             (base.long(), lengths.long()), (base, lengths.cpu())]
    for dense, lens in cases:
        _same_lists(ri.build_ragged_indices_from_dense(dense, lens, num_rows=590),
                    _upstream_ragged(dense, lens, 590))


def test_ragged_drops_int64_values_past_int32(upstream, device):
    """Upstream casts int64 values to int32 before it filters them: 2^32 + 3 is kept as
    slot 3. Ours drops what int32 cannot hold, and otherwise matches."""
    dense = torch.tensor([[4, 2 ** 32 + 3, 9, -(2 ** 32) + 1, 2 ** 31]], dtype=torch.int64,
                         device=device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    flat, indptr = ri.build_ragged_indices_from_dense(dense, lens, num_rows=-1)
    assert indptr.tolist() == [0, 2] and flat[:2].tolist() == [4, 9]
    _, up_indptr = _upstream_ragged(dense, lens, -1)
    assert up_indptr.tolist() == [0, 4]  # 2^32 + 3 -> 3 and -2^32 + 1 -> 1 are "valid" there


def test_ragged_empty(device):
    lens = torch.zeros(0, dtype=torch.int32, device=device)
    flat, indptr = ri.build_ragged_indices_from_dense(
        torch.zeros(0, 1, 128, dtype=torch.int32, device=device), lens, num_rows=10)
    assert flat.numel() == 0 and indptr.tolist() == [0]
    flat, indptr = ri.build_ragged_indices_from_dense(
        torch.zeros(3, 0, dtype=torch.int32, device=device),
        torch.ones(3, dtype=torch.int32, device=device))
    assert flat.numel() == 0 and indptr.tolist() == [0, 0, 0, 0]


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("a kernel was launched for lists past the int32 bound")


def test_ragged_refuses_lists_past_int32_naming_the_tensor(monkeypatch, device):
    """262,144 decode tokens x 8,192 columns = 2^31 entries: one past what an int32 indptr
    holds. Refused before any allocation or launch (stride-0 inputs: no memory)."""
    monkeypatch.setattr(ri, "_count_kernel", _NoLaunch())
    monkeypatch.setattr(ri, "_compact_kernel", _NoLaunch())
    dense = torch.zeros(1, 1, dtype=torch.int32, device=device).expand(262144, 8192)
    lens = torch.zeros(1, dtype=torch.int32, device=device).expand(262144)
    with pytest.raises(ValueError, match=r"^decode_swa_indices: 262144 rows x 8192 columns = "
                       r"2147483648 entries, more than the 2147483647"):
        ri.build_ragged_indices_from_dense(dense, lens, num_rows=100, name="decode_swa_indices")
    # One row fewer fits (checked only: the launch is refused by the stand-in above).
    with pytest.raises(AssertionError, match="was launched"):
        ri.build_ragged_indices_from_dense(dense[:262143], lens[:262143], num_rows=100)


@pytest.mark.parametrize("mutate,match", [
    (lambda d, l: (d.float(), l), r"^indices: dtype torch.float32"),
    (lambda d, l: (d, l[:2]), r"^indices lengths: expected one length per row \(3\)"),
])
def test_ragged_validation_names_the_tensor(device, mutate, match):
    args = mutate(_dense(3, 8, 1, device), torch.ones(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=match):
        ri.build_ragged_indices_from_dense(*args)


RAGGED_BOUNDARY = [
    ("ragged", "ours"),
    pytest.param("ragged", "upstream", marks=[
        pytest.mark.xfail(strict=True, reason="upstream's ragged conversion offsets are int32"),
        pytest.mark.skipif(not _upstream_built(), reason="build/upstream_kernels missing")]),
]


@pytest.mark.parametrize("case,variant", RAGGED_BOUNDARY)
def test_ragged_rows_past_int32(device, case, variant):
    r = _probe(device, case, variant)
    assert r["prev_offset"] <= INT32_MAX < r["last_offset"], r
    assert r["equal"], f"{case} {variant}: rows past 2^31 elements differ from the compact run"


def test_ampere_decode_builds_lists_with_ours():
    """attention/common.py takes build_ragged_indices_from_dense from our module, not from
    upstream's rocm_aiter_mla_sparse, and calls it for both lists with a tensor name."""
    src = (REPO / "overlay" / "vllm" / "deepinfer" / "attention" / "common.py").read_text()
    tree = ast.parse(src)
    sources = {a.asname or a.name: n.module for n in ast.walk(tree)
               if isinstance(n, ast.ImportFrom) for a in n.names}
    assert sources["build_ragged_indices_from_dense"] == "vllm.deepinfer.kernels.ragged_indices"
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "build_ragged_indices_from_dense"]
    assert len(calls) == 2 and all(any(k.arg == "name" for k in c.keywords) for c in calls)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="launches are recorded from the interpreter's kernels (CPU)")
@pytest.mark.parametrize("variant,cc", [("sm80", 80), ("sm90", 90)])
def test_ragged_launches_are_warmed(variant, cc):
    """Every conversion the decode makes (SWA rows [T, 1, W] and top-k rows [T, K], the
    lengths and rows sliced at odd tokens, KV bounds of any size) finds the key
    vllm.deepinfer.warmup compiles for the ampere_attn feature: two keys in all."""
    from launch_keys import describe, key_of, recording
    from vllm.deepinfer import warmup as wu
    warm = set()
    for k in wu.keys(wu.ModelShapes(window=128, compress_ratios=(0, 1, 2), topk=512, heads=64),
                     variant, features=["ampere_attn"]):
        if k.kernel.startswith("ragged_"):
            kern, _ = wu._kernel_and_signature(k.kernel)
            args, ce = wu.warmup_args(k)
            warm.add((kern.fn.__name__, key_of(kern, args, dict(ce, **wu.launch_options(k)), cc)))
    assert {name for name, _ in warm} == {"_count_kernel", "_compact_kernel"} and len(warm) == 2
    with recording(cc) as seen:
        for tokens, width, start, kv_rows in [(1, 128, 0, 32 * 1001), (7, 128, 3, 64),
                                              (64, 640, 1, 1 << 22), (3, 8320, 0, 17),
                                              (513, 1, 5, 2 ** 31 - 1)]:
            buf = torch.zeros(start + tokens, 1, width, dtype=torch.int32)
            lens = torch.ones(start + tokens + 1, dtype=torch.int32)
            ri.build_ragged_indices_from_dense(buf[start:], lens[start + 1:], num_rows=kv_rows)
            ri.build_ragged_indices_from_dense(buf[start:, 0], lens[start:-1], num_rows=kv_rows)
    assert seen and {k.fn.__name__ for k, _ in seen} == {"_count_kernel", "_compact_kernel"}
    missing = sorted({describe(k, key) for k, key in seen if (k.fn.__name__, key) not in warm})
    assert not missing, "\n".join(missing)


# ----------------------------------------------------------------------------- decode launches
def _decode_inputs(tokens, device, *, seed=3, heads=16, int64=False):
    from vllm.deepinfer import kv_record
    g = torch.Generator().manual_seed(seed)
    D = kv_record.HEAD_DIM

    def cache(blocks, bs):
        n = blocks * bs
        nope, scales, rope = kv_record.quantize_rows(torch.randn(n, D, generator=g))
        c = kv_record.new_cache(blocks, bs)
        kv_record.write_records(c, torch.arange(n), nope, scales, rope)
        return c.to(device)

    def lists(counts, rows):
        idx = torch.randint(-1, rows, (sum(counts),), generator=g, dtype=torch.int32)
        ptr = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32)
        dt = torch.int64 if int64 else torch.int32
        return idx.to(dt).to(device), ptr.to(dt).to(device)

    main, extra = cache(2, 32), cache(2, 64)
    mi, mp = lists([20, 3, 17, 0, 33][:tokens] + [9] * max(0, tokens - 5), 64)
    ei, ep = lists([24, 40, 1, 16, 7][:tokens] + [5] * max(0, tokens - 5), 128)
    q = torch.randn(tokens, heads, D, generator=g).to(torch.bfloat16).to(device)
    sink = torch.randn(heads, generator=g).to(device)
    pos = torch.randint(0, 1024, (tokens,), generator=g).to(device)
    ang = torch.rand(1024, 32, generator=g) * 6.3
    cs = torch.cat([ang.cos(), ang.sin()], dim=1).to(device)
    return dict(q=q, main_cache=main, main_indices=mi, main_indptr=mp, sink=sink, extra=extra,
                extra_indices=ei, extra_indptr=ep, pos=pos, cs=cs)


def _decode(a, *, extra=True, inv_rope=True, splits=1, predequant=False, **kw):
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    from vllm.deepinfer.kv_record import HEAD_DIM, NOPE_DIM, ROPE_DIM
    ex = dict(extra_cache=a["extra"], extra_indices=a["extra_indices"],
              extra_indptr=a["extra_indptr"]) if extra else {}
    rope = dict(inv_rope_positions=a["pos"], inv_rope_cos_sin_cache=a["cs"]) if inv_rope else {}
    return smd.sparse_attn_decode(
        a["q"], a["main_cache"], a["main_indices"], a["main_indptr"], 1.0 / math.sqrt(HEAD_DIM),
        a["sink"], NOPE_DIM, ROPE_DIM, num_kv_splits=splits, predequant=predequant,
        variant="cpu" if a["q"].device.type == "cpu" else "sm80", **ex, **rope, **kw)


def _bits(t):
    return t.contiguous().view(torch.int16).cpu()


@pytest.mark.parametrize("predequant,splits,extra,inv_rope", [
    (False, 1, True, True), (False, 2, True, True), (True, 1, True, True),
    (True, 2, False, True), (False, 1, False, False), (True, 1, True, False)])
def test_decode_chunks_tokens_past_the_grid_bound(monkeypatch, device, predequant, splits,
                                                  extra, inv_rope):
    """GRID_TOKENS lowered to 2: five tokens run as chunks of 2, 2 and 1 (per-token views,
    absolute index lists and workspace rows), same bits as one launch, in every path:
    one and two phases, split (the reduce's rows too) or not, with and without the extra
    list and the inverse RoPE, into a caller's ``out``."""
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    a = _decode_inputs(5, device)
    kw = dict(predequant=predequant, splits=splits, extra=extra, inv_rope=inv_rope)
    want = _decode(a, **kw)
    launches = []
    orig = smd._sparse_mla_decode_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return orig[grid]
    monkeypatch.setattr(smd, "GRID_TOKENS", 2)
    monkeypatch.setattr(smd, "_sparse_mla_decode_kernel", Counting())
    out = torch.full_like(a["q"], 7.0)
    got = _decode(a, out=out, **kw)
    assert got is out and torch.equal(_bits(got), _bits(want))
    assert [g[2] for g in launches] == [2, 2, 1]  # tokens on axis z, at most GRID_TOKENS


def test_decode_grid_bound_is_cuda_limit():
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    assert smd.GRID_TOKENS <= 65535 and smd.GRID_TOKENS % 16 == 0
    assert smd.GRID_TOKENS + 16 > 65535  # the largest such multiple


def test_decode_drops_int64_slots_past_int32(device):
    """A slot of 2^32 + 3 in an int64 list: the old cast made it slot 3 (a valid key);
    now it is skipped, as -1 is."""
    a = _decode_inputs(3, device, int64=True)
    mi = a["main_indices"].clone()
    mi[1] = 2 ** 32 + 3
    as_skipped, as_three = mi.clone(), mi.clone()
    as_skipped[1], as_three[1] = -1, 3
    got = _decode(dict(a, main_indices=mi))
    assert torch.equal(_bits(got), _bits(_decode(dict(a, main_indices=as_skipped))))
    assert not torch.equal(_bits(got), _bits(_decode(dict(a, main_indices=as_three))))


def test_decode_refuses_lists_past_int32_offsets(monkeypatch, device):
    """Lists longer than the kernels' int32 offsets address are refused by name (the bound
    lowered to 60 entries: main 73, extra 88)."""
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    assert smd.INDEX_LIMIT == INT32_MAX
    a = _decode_inputs(5, device)
    monkeypatch.setattr(smd, "INDEX_LIMIT", 60)
    with pytest.raises(ValueError, match=r"^main_indices: 73 entries, more than the 60"):
        _decode(a)
    monkeypatch.setattr(smd, "INDEX_LIMIT", 150)  # each list fits, not both together
    with pytest.raises(ValueError, match=r"^main_indices/extra_indices: 161 entries together"):
        _decode(a, predequant=True)


# ----------------------------------------------------------------------------- indexer logits
_VARIANT = {"cpu": "cpu", "cuda": "sm80"}  # the interpreter's row, or the Ampere kernels


def _logits_inputs(device, batch, next_n, per_row, seed):
    from vllm.deepinfer import kv_record
    g = torch.Generator().manual_seed(seed)
    heads, D, bs = 16, 128, 16
    lens = [int(x) for x in torch.randint(next_n, 70, (batch,), generator=g)]
    blocks = [-(-n // bs) for n in lens]
    table = torch.zeros(batch, max(blocks), dtype=torch.int32)
    perm = torch.randperm(sum(blocks) + 2, generator=g).to(torch.int32)
    used = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[used:used + n]
        used += n
    cache = torch.randint(0, 127, (sum(blocks) + 2, bs, kv_record.INDEX_RECORD_BYTES),
                          generator=g, dtype=torch.int32).to(torch.uint8)
    cache[:, :, D:] = torch.tensor([0, 0, 0x80, 0x3F], dtype=torch.uint8)  # scales 1.0
    q = torch.randint(0, 127, (batch, next_n, heads, D), generator=g, dtype=torch.int32)
    w = torch.randn(batch * next_n, heads, generator=g)
    if per_row:
        ctx = torch.tensor([[n - next_n + 1 + j for j in range(next_n)] for n in lens],
                           dtype=torch.int32)
    else:
        ctx = torch.tensor(lens, dtype=torch.int32)
    cand = torch.randint(-1, 6, (batch * next_n, 3), generator=g, dtype=torch.int32)
    return dict(q=q.to(torch.uint8).view(torch.float8_e4m3fn).to(device), cache=cache.to(device),
                w=w.to(device), ctx=ctx.to(device), table=table.to(device), width=max(lens) + 3,
                cand=cand.to(device))


def _flat_inputs(device, rows, seed):
    g = torch.Generator().manual_seed(seed)
    heads, D, N = 16, 128, 90
    ks = torch.randint(0, 40, (rows,), generator=g, dtype=torch.int32)
    ke = ks + torch.randint(0, 50, (rows,), generator=g, dtype=torch.int32)
    k = torch.randint(0, 127, (N, D), generator=g, dtype=torch.int32).to(torch.uint8)
    q = torch.randint(0, 127, (rows, heads, D), generator=g, dtype=torch.int32).to(torch.uint8)
    e4m3 = torch.float8_e4m3fn
    return dict(q=q.view(e4m3).to(device), k=k.view(e4m3).to(device),
                ks_=torch.rand(N, generator=g).to(device),
                w=torch.randn(rows, heads, generator=g).to(device),
                ks=ks.to(device), ke=ke.to(device), width=int((ke - ks).max()),
                cand=torch.randint(-1, 8, (rows, 4), generator=g, dtype=torch.int32).to(device))


def _count_launches(monkeypatch, module, names):
    grids = []
    for name in names:
        orig = getattr(module, name)

        class Counting:
            def __getitem__(self, grid, orig=orig, name=name):
                grids.append((name, grid))
                return orig[grid]
        monkeypatch.setattr(module, name, Counting())
    return grids


@pytest.mark.parametrize("form,next_n,per_row,candidates", [
    ("paged", 1, False, False), ("paged", 2, False, False), ("paged", 2, True, False),
    ("flat", 1, False, False), ("paged", 2, False, True), ("paged", 2, True, True),
    ("flat", 1, False, True)])
def test_logits_chunk_rows_past_the_grid_bound(monkeypatch, device, form, next_n, per_row,
                                               candidates):
    """GRID_ROWS lowered to 3: 7 paged requests / 7 prefill rows run as row chunks (whole
    requests; the gathered form's row pairs kept), same bits as one launch, for the full
    kernel and the candidate kernels, into a caller's ``out``."""
    from vllm.deepinfer.kernels import indexer_candidate_logits as icl
    from vllm.deepinfer.kernels import indexer_logits as il

    kw = dict(variant=_VARIANT[device], sm_count=1)

    def run(out):
        if form == "paged":
            a = _logits_inputs(device, 7, next_n, per_row, seed=next_n * 10 + per_row)
            args = (a["q"], a["cache"], a["w"], a["ctx"], a["table"], a["width"])
            if candidates:
                return icl.candidate_paged_mqa_logits(*args, a["cand"], 8, out=out(a), **kw)
            return il.paged_mqa_logits(*args, out=out(a), **kw)
        a = _flat_inputs(device, 7, seed=5)
        args = (a["q"], a["k"], a["ks_"], a["w"], a["ks"], a["ke"], a["width"])
        if candidates:
            return icl.candidate_mqa_logits(*args, a["cand"], 8, out=out(a), **kw)
        return il.mqa_logits(*args, out=out(a), **kw)

    def filled(a):
        rows = a["w"].shape[0]
        return torch.full((rows, a["width"]), 3.5, device=device)
    want = run(filled)
    module, names = ((icl, ["_prepare_kernel", "_candidate_logits_kernel"]) if candidates
                     else (il, ["_logits_kernel"]))
    grids = _count_launches(monkeypatch, module, names)
    monkeypatch.setattr(il, "GRID_ROWS", 3)
    got = run(filled)
    assert torch.equal(got.view(torch.int32).cpu(), want.view(torch.int32).cpu())
    # Every row once, chunks of whole requests (paged) or row pairs (gathered form), each
    # within the bound: 7 requests x next_n 2 in chunks of 2 rows (one request), 7 prefill
    # rows in pairs as 6 + 1 rows (3 + 1 programs), single rows as 3 + 3 + 1.
    rows = 7 * (next_n if form == "paged" else 1)
    per_y = il.FLAT_ROWS_PER_PROGRAM if form == "flat" and not candidates else 1
    step = {("paged", 1): 3, ("paged", 2): 2, ("flat", 1): 3 * per_y}[(form, next_n)]
    want_y = [-(-min(step, rows - r0) // per_y) for r0 in range(0, rows, step)]
    assert [g[1] for _, g in grids] == [y for y in want_y for _ in names]
    assert all(g[0] == grids[0][1][0] for _, g in grids)  # the whole launch's programs per row


def test_logits_row_chunks():
    from vllm.deepinfer.kernels import indexer_logits as il
    assert il.GRID_ROWS <= 65535 and il.GRID_ROWS % 16 == 0 and il.GRID_ROWS + 16 > 65535
    assert il.row_chunks(65520, 1, 1) == [(0, 65520)]
    assert il.row_chunks(131040, 2, 2) == [(0, 131040)]   # the gathered form: two per program
    # 1M prefill rows in pairs: chunks of 131,040 rows (65,520 programs), 16-row multiples.
    chunks = il.row_chunks(1 << 20, 2, 2)
    assert chunks[0] == (0, 131040) and chunks[-1][1] == 1 << 20
    assert all(r0 % 32 == 0 and -(-(r1 - r0) // 2) <= 65535 for r0, r1 in chunks)
    # Decode, 3 rows per request: whole requests, 16 of them per step (65,520 = 1,365 x 48).
    chunks = il.row_chunks(3 * 30000, 1, 3)
    assert all(r0 % 48 == 0 and r1 - r0 <= 65535 and (r1 - r0) % 3 == 0 for r0, r1 in chunks)


# ----------------------------------------------------------------------------- on a GPU
# The real bound: CUDA refuses a launch of more than 65,535 programs on grid y or z
# ("invalid argument", seen on the H200 before the chunking). These launch just past it.
@pytest.mark.gpu
@pytest.mark.parametrize("predequant", [False, True])
def test_gpu_decode_past_65535_tokens(predequant):
    """65,537 decode tokens x 16 heads in one call: it launches (chunks of GRID_TOKENS) and
    every row equals the same tokens decoded in two calls that each fit one launch."""
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    tokens = 65537
    a = _decode_inputs(5, "cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    per = 6
    a["main_indices"] = torch.randint(-1, 64, (tokens * per,), generator=g, device="cuda",
                                      dtype=torch.int32)
    a["main_indptr"] = torch.arange(0, tokens * per + 1, per, dtype=torch.int32, device="cuda")
    a["q"] = torch.randn(tokens, 16, 512, generator=g, device="cuda").to(torch.bfloat16)
    a["pos"] = torch.randint(0, 1024, (tokens,), generator=g, device="cuda")
    got = _decode(a, extra=False, predequant=predequant, splits=1)
    cut = smd.GRID_TOKENS - 16  # a split point that is not the chunk boundary
    parts = []
    for lo, hi in ((0, cut), (cut, tokens)):
        part = dict(a, q=a["q"][lo:hi], pos=a["pos"][lo:hi],
                    main_indptr=a["main_indptr"][lo:hi + 1])
        parts.append(_decode(part, extra=False, predequant=predequant, splits=1))
    torch.cuda.synchronize()
    assert torch.equal(_bits(got), _bits(torch.cat(parts)))


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["paged", "flat"])
def test_gpu_logits_past_65535_rows(form):
    """65,537 paged rows (one per request) / 131,075 gathered rows (65,538 row pairs) in one
    call: it launches and equals the rows computed in two calls that each fit one launch."""
    from vllm.deepinfer.kernels import indexer_logits as il
    kw = dict(variant="sm80", sm_count=132)
    if form == "paged":
        a = _logits_inputs("cuda", 65537, 1, False, seed=1)
        rows, fn = 65537, il.paged_mqa_logits

        def args(lo, hi):
            return (a["q"][lo:hi], a["cache"], a["w"][lo:hi], a["ctx"][lo:hi],
                    a["table"][lo:hi], a["width"])
    else:
        a = _flat_inputs("cuda", 131075, seed=2)
        rows, fn = 131075, il.mqa_logits

        def args(lo, hi):
            return (a["q"][lo:hi], a["k"], a["ks_"], a["w"][lo:hi], a["ks"][lo:hi],
                    a["ke"][lo:hi], a["width"])

    def fill(n):
        return torch.full((n, a["width"]), 3.5, device="cuda")
    got = fn(*args(0, rows), out=fill(rows), **kw)
    cut = 40000
    want = torch.cat([fn(*args(0, cut), out=fill(cut), **kw),
                      fn(*args(cut, rows), out=fill(rows - cut), **kw)])
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
