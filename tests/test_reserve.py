"""Serving buffers reserved before vLLM sizes the KV cache (vllm.deepinfer.reserve).

What is checked, per buffer:

* decode scratch (kernels/sparse_mla_decode): for random and extreme layer geometries the
  profile run's reservation is exactly the largest request the real launcher makes over every
  decode batch up to ``Limits.decode_tokens`` (the launcher is stopped at its workspace
  request, so no kernel runs for the large shapes); the launcher computes the same bytes in a
  caller's workspace as with its own buffers, and checks what the workspace hands it;
* indexer decode logits (kernels/indexer_logits): ``Limits.indexer_decode_rows`` bounds every
  row layout a batch can take, and the launchers write into a caller's buffer unchanged;
* combined lists (kernels/topk_swa): the persistent buffers hold every chunk of a V4.1-like
  layer sequence without one list overwriting another that cross-layer reuse keeps alive;
* after vLLM locks its workspace, a request past the reservation raises ReservationError
  naming the buffer instead of allocating (a stand-in manager here; the real one, and real
  layers' profile run, in tests/vllm_probe_reserve.py through ``test_vllm_profile_run``).
"""
from __future__ import annotations

import itertools
import logging
import random
from types import SimpleNamespace

import pytest
import torch

from vllm.deepinfer import arch, reserve, yoco
from vllm.deepinfer.kernels import indexer_logits as il
from vllm.deepinfer.kernels import sparse_mla_decode as smd
from vllm.deepinfer.kernels import topk_swa
from vllm.deepinfer.kv_record import HEAD_DIM, NOPE_DIM, RECORD_BYTES, ROPE_DIM


@pytest.fixture(autouse=True)
def _clean():
    reserve.reset_for_tests()
    yield
    reserve.reset_for_tests()


class _Stop(Exception):
    pass


def _requested(variant, tokens, heads, swa_w, topk_w, sm_count, monkeypatch) -> int:
    """The workspace bytes the real decode launcher asks for (routed call: no ``out``),
    stopped before any kernel runs."""
    monkeypatch.setattr(arch, "sm_count", lambda device: sm_count)
    seen = []

    def workspace(specs):
        seen.append(list(specs))
        raise _Stop

    q = torch.zeros(tokens, heads, HEAD_DIM, dtype=torch.bfloat16)
    cache = torch.zeros(1, 64, RECORD_BYTES, dtype=torch.uint8)
    i32 = dict(dtype=torch.int32)
    main = torch.zeros(tokens * swa_w, **i32)
    main_ptr = torch.arange(tokens + 1, **i32) * swa_w
    extra = {}
    if topk_w:
        extra = dict(extra_cache=cache, extra_indices=torch.zeros(tokens * topk_w, **i32),
                     extra_indptr=torch.arange(tokens + 1, **i32) * topk_w)
    try:
        smd.sparse_attn_decode(q, cache, main, main_ptr, 0.04, None, NOPE_DIM, ROPE_DIM,
                               **extra, variant=variant, workspace=workspace)
    except _Stop:
        pass
    assert len(seen) == 1  # the routed call gives no ``out``: there is always a request
    return reserve.spec_bytes(seen[0])


# (variant, heads, SWA width, top-k width, SMs, largest decode batch): production geometries
# (V4.1 C4A-like 512 top-k; V4 C128A at 1M: 8192 top-k; SWA only; sm90's 64-head tile) and
# random ones.
_FIXED = [("sm80", 64, 128, 512, 108, 40), ("sm80", 128, 128, 8192, 108, 10),
          ("sm86", 16, 128, 0, 84, 40), ("sm90", 64, 128, 1024, 132, 24),
          ("cpu", 8, 128, 64, 1, 40), ("sm80", 8, 256, 2048, 46, 20)]
_RNG = random.Random(7)
_RANDOM = [(_RNG.choice(["sm80", "sm86", "sm90", "cpu"]), _RNG.choice([8, 16, 32, 64, 128]),
            _RNG.choice([128, 256]), _RNG.choice([0, 512, 1024, 2048]),
            _RNG.choice([1, 46, 84, 108, 132]), _RNG.randint(1, 24)) for _ in range(6)]


@pytest.mark.parametrize("variant,heads,swa_w,topk_w,sms,max_tokens", _FIXED + _RANDOM)
def test_decode_reservation_is_the_largest_launch(variant, heads, swa_w, topk_w, sms,
                                                  max_tokens, monkeypatch):
    """Every batch of 1 .. max_tokens decode tokens asks for no more than the reservation,
    and the largest asks for exactly it (the reservation is the launcher's own plan)."""
    worst, at, specs = reserve.decode_scratch_worst(variant, max_tokens, heads,
                                                    swa_w + topk_w, sms)
    asked = [_requested(variant, t, heads, swa_w, topk_w, sms, monkeypatch)
             for t in range(1, max_tokens + 1)]
    assert max(asked) == worst, (asked, worst)
    assert asked[at - 1] == worst
    assert all(a <= worst for a in asked)
    assert {n for n, _, _ in specs} >= {"out"}


def test_decode_reservation_at_1m_context(monkeypatch):
    """V4's C128A layer at 1M tokens (8192 + 128 keys per token), 64 heads, an A100's SMs:
    the two-phase rows alone take 2.03 GiB at 256 decode tokens and 4.06 GiB at a 512-token
    graph (the issue's figures); the reservation for a 512-token engine holds them, and
    the launcher's requests at the sizes around its split and phase changes fit."""
    keys, heads = 8192 + 128, 64
    limits = reserve.Limits(max_num_batched_tokens=8192, max_num_seqs=256,
                            max_capture_size=512, max_model_len=1 << 20)
    assert limits.decode_tokens == 512
    worst, at, specs = reserve.decode_scratch_worst("sm80", limits.decode_tokens, heads, keys,
                                                    108)
    ws = dict((n, s) for n, s, _ in specs)["ws"]
    assert at == 512 and ws == (512 * keys, HEAD_DIM)
    assert worst >= 512 * keys * (2 * HEAD_DIM + 1) > 4.06 * 2**30
    assert 256 * keys * 2 * HEAD_DIM > 2.03 * 2**30
    for t in (1, 3, 4, 5, 16, 64, 255, 256, 511, 512):
        assert _requested("sm80", t, heads, 128, 8192, 108, monkeypatch) <= worst


def _batches(max_seqs, k, budget):
    """Every decode batch shape (query lengths 1 .. 1 + k, up to max_seqs requests, at most
    budget tokens) as (requests, tokens, longest query)."""
    for n in range(1, max_seqs + 1):
        for lens in itertools.combinations_with_replacement(range(1, k + 2), n):
            if sum(lens) <= budget:
                yield n, sum(lens), max(lens)


@pytest.mark.parametrize("max_seqs,k,budget,capture", [
    (4, 0, 16, 0), (4, 2, 16, 8), (5, 3, 12, 16), (3, 1, 64, 32), (6, 1, 5, 0)])
def test_limits_bound_every_decode_batch(max_seqs, k, budget, capture):
    """Decode tokens a layer sees (padded to a capture size <= the largest when it fits)
    and indexer rows (requests x longest query in the padded layout) stay within Limits."""
    lim = reserve.Limits(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                         num_speculative_tokens=k, max_capture_size=min(capture, budget))
    for n, tokens, longest in _batches(max_seqs, k, budget):
        padded = min(capture, budget) if tokens <= min(capture, budget) else tokens
        assert padded <= lim.decode_tokens
        assert max(padded, n * longest) <= lim.indexer_decode_rows


def test_limits_from_vllm_config():
    cfg = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=128),
        speculative_config=SimpleNamespace(num_speculative_tokens=3, use_dspark=lambda: True),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=None,
                                           cudagraph_capture_sizes=[1, 2, 4, 512],
                                           decoder_replay_cudagraph_capture_sizes=None),
        model_config=SimpleNamespace(max_model_len=1 << 20))
    lim = reserve.Limits.from_vllm_config(cfg)
    assert (lim.num_speculative_tokens, lim.max_capture_size, lim.dspark) == (3, 512, True)
    assert lim.decode_tokens == 512 and lim.indexer_decode_rows == 512
    assert lim.prefill_tokens == 8192 and lim.max_model_len == 1 << 20


# ----------------------------------------------------------------------------- workspace views
class _Arena:
    """vLLM's get_simultaneous in miniature (views at 256-byte offsets of one buffer);
    records every request."""

    def __init__(self, nbytes):
        self.buf = torch.zeros(nbytes, dtype=torch.uint8)
        self.requests = []

    def __call__(self, specs):
        self.requests.append(list(specs))
        views, off = [], 0
        for shape, dtype in specs:
            n = reserve._nbytes(shape, dtype)
            views.append(self.buf[off: off + n].view(dtype).view(shape))
            off += reserve.aligned(n)
        assert off <= self.buf.numel()
        return views

    def holds(self, t):
        base = self.buf.data_ptr()
        return base <= t.data_ptr() < base + self.buf.numel()


def _decode_inputs(tokens, heads, g):
    from test_sparse_mla_decode import cos_sin_cache, make_cache, ragged
    cache = make_cache(4, 16, "cpu", g)
    lists = [torch.randperm(64, generator=g)[: 10 + 3 * t].tolist() for t in range(tokens)]
    idx, ptr = ragged(lists, "cpu")
    q = (torch.randn(tokens, heads, HEAD_DIM, generator=g) * 0.3).to(torch.bfloat16)
    pos = torch.tensor([5 + t for t in range(tokens)], dtype=torch.int64)
    return q, cache, idx, ptr, pos, cos_sin_cache(64, "cpu")


@pytest.mark.parametrize("variant,tokens,splits", [("cpu", 5, 1), ("cpu", 5, 2), ("cpu", 2, 2)])
def test_decode_in_a_callers_workspace(variant, tokens, splits):
    """Same bytes as with the launcher's own buffers, and every buffer (the output too) is
    the workspace's: the two-phase rows (5 tokens), the split partials (2 splits)."""
    g = torch.Generator().manual_seed(3)
    q, cache, idx, ptr, pos, cs = _decode_inputs(tokens, 16, g)
    sink = torch.randn(16, generator=g)
    args = (q, cache, idx, ptr, 0.05, sink, NOPE_DIM, ROPE_DIM)
    kw = dict(inv_rope_positions=pos, inv_rope_cos_sin_cache=cs, num_kv_splits=splits,
              variant=variant)
    want = smd.sparse_attn_decode(*args, **kw)
    arena = _Arena(8 << 20)
    got = smd.sparse_attn_decode(*args, **kw, workspace=arena)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert arena.holds(got) and len(arena.requests) == 1
    names = {"out"} | ({"part_m", "part_l", "part_acc"} if splits > 1 else set()) \
        | ({"ws", "valid"} if tokens >= smd.PREDEQUANT_MIN_TOKENS else set())
    assert len(arena.requests[0]) == len(names)


def test_decode_workspace_is_checked():
    g = torch.Generator().manual_seed(4)
    q, cache, idx, ptr, _, _ = _decode_inputs(5, 16, g)
    args = (q, cache, idx, ptr, 0.05, None, NOPE_DIM, ROPE_DIM)

    def wrong(k, fix):
        def ws(specs):
            views = _Arena(8 << 20)(specs)
            views[k] = fix(views[k])
            return views
        return ws
    # Requests in order: out, ws, valid (5 tokens: two phases, one split on the interpreter).
    with pytest.raises(ValueError, match=r"workspace\[ws\]: dtype"):
        smd.sparse_attn_decode(*args, variant="cpu", workspace=wrong(1, lambda v: v.float()))
    with pytest.raises(ValueError, match=r"workspace\[valid\]: expected shape"):
        smd.sparse_attn_decode(*args, variant="cpu", workspace=wrong(2, lambda v: v[1:]))
    with pytest.raises(ValueError, match=r"workspace\[out\]: on meta"):
        smd.sparse_attn_decode(*args, variant="cpu",
                               workspace=wrong(0, lambda v: torch.empty_like(v, device="meta")))
    with pytest.raises(ValueError, match=r"workspace: returned 2 buffers for 3"):
        smd.sparse_attn_decode(*args, variant="cpu",
                               workspace=lambda s: _Arena(8 << 20)(s)[:2])
    with pytest.raises(ValueError, match=r"workspace: expected None or a callable"):
        smd.sparse_attn_decode(*args, variant="cpu", workspace=torch.zeros(8))


# ----------------------------------------------------------------------------- indexer logits
def _paged_inputs(g, batch=2, heads=4, blocks=3, bs=16):
    """A paged index-K cache of random codes (NaN codes excluded) and a decode batch."""
    from test_indexer_logits import _codes
    from vllm.deepinfer import kv_record
    ctx = torch.tensor([20, 37][:batch], dtype=torch.int32)
    n = blocks * batch
    cache = _codes((n, bs, kv_record.INDEX_RECORD_BYTES), g, "cpu")
    page = cache.view(n, -1)  # a page: bs x 128 codes, then bs fp32 scales
    page[:, bs * il.HEAD_DIM:].view(torch.float32).copy_(
        torch.exp2(torch.randint(-6, 2, (n, bs), generator=g).float()))
    bt = torch.randperm(n, generator=g).view(batch, blocks).to(torch.int32)
    q = _codes((batch, 1, heads, il.HEAD_DIM), g, "cpu").view(torch.float8_e4m3fn)
    w = torch.rand(batch, heads, generator=g)
    return q, cache, w, ctx, bt


def test_indexer_logits_into_a_callers_buffer():
    g = torch.Generator().manual_seed(5)
    q, cache, w, ctx, bt = _paged_inputs(g)
    want = il.paged_mqa_logits(q, cache, w, ctx, bt, 48, variant="cpu")
    big = torch.full((2, 64), 7.0)
    out = big[:, :48]  # rows strided like a view of a wider buffer
    got = il.paged_mqa_logits(q, cache, w, ctx, bt, 48, variant="cpu", out=out)
    assert got.data_ptr() == big.data_ptr()
    for r, n in enumerate(ctx.tolist()):  # columns past a row's length are not written
        assert torch.equal(got[r, :n], want[r, :n])
    with pytest.raises(ValueError, match=r"out: expected fp32 \[2, 48\]"):
        il.paged_mqa_logits(q, cache, w, ctx, bt, 48, variant="cpu", out=torch.empty(2, 47))
    with pytest.raises(ValueError, match=r"out: expected fp32"):
        il.paged_mqa_logits(q, cache, w, ctx, bt, 48, variant="cpu",
                            out=torch.empty(2, 48, dtype=torch.float16))


def test_indexer_logits_specs_leave_the_topk_its_region():
    specs = reserve.indexer_logits_specs(256, 1 << 20)
    assert specs[0] == ((reserve.RADIX_TOPK_BYTES,), torch.uint8)
    assert specs[1] == ((256, 1 << 20), torch.float32)
    # 1 GiB at 256 rows of a ratio-1 layer at 1M (the figure) plus the 1 MiB region.
    assert reserve.spec_bytes(specs) == (1 << 30) + (1 << 20)


# ----------------------------------------------------------------------------- combined lists
def _fake_combine(out, tokens, width, mark, owners):
    """Stands in for the combiner: writes ``mark`` everywhere into ``out`` (or new
    tensors), so a later overwrite is visible."""
    if out is None:
        owners.append(("allocated", mark))
        out = (torch.empty(tokens, width, dtype=torch.int32),
               torch.empty(tokens, dtype=torch.int32))
    out[0].fill_(mark)
    out[1].fill_(mark)
    return out


def _layer_sequence():
    """V4.1 in miniature: (index-source tag, window, top-k) per layer. SWA-only layers
    (tag None) share their lists all forward; compressed layers share within an index
    group, which the next group replaces (upstream's layout: sources 2, 8, ...)."""
    return [(None, 128, 0), (2, 128, 512), (2, 128, 512), (None, 128, 0), (8, 128, 512),
            (8, 128, 512), (14, 128, 512), (None, 128, 0)]


def test_combined_lists_of_one_forward_share_the_reservation():
    swa_md = SimpleNamespace()  # batch_tag names it by identity: one batch
    chunks = [(0, 2, 64, 300, 0, 5), (2, 3, 64, 300, 5, 12)]  # (c0, c1, N, M, qs, qe)
    rows = 12
    widths = {topk_swa.combined_width(k, w) for _, w, k in _layer_sequence()}
    for wd in widths:
        reserve.reserve_combined_lists("shared", wd, rows, "cpu")
    fc = SimpleNamespace()
    owners, products = [], {}
    mark = itertools.count(1)
    for tag, window, topk in _layer_sequence():
        wd = topk_swa.combined_width(topk, window)
        for c0, c1, n, m, qs, qe in chunks:
            key = yoco.combine_key(tag, 1 if topk else 0, window, topk, swa_md, (c0, c1, n, m))
            v = next(mark)

            def build():
                out = reserve.combined_lists_out(fc, key, True, wd, qs, qe, wd, "cpu")
                return _fake_combine(out, qe - qs, wd, v, owners)
            got = yoco.reuse(fc, key, build)
            products.setdefault(key, (got, int(got[1][0])))
            assert got is products[key][0]
    assert owners == []  # every list in the reservation
    slab = {wd: reserve.combine_slab("shared", wd, "cpu") for wd in widths}
    for key, (got, v) in products.items():
        assert slab[topk_swa.combined_width(key[4], key[3])].flat.data_ptr() \
            <= got[0].data_ptr()
        # The lists yoco still holds at the end of the forward are intact.
        if key[1] in (None, 14):
            assert bool((got[0] == v).all()) and bool((got[1] == v).all()), key


def test_combined_lists_refuse_a_second_live_owner_and_rebuilds():
    reserve.reserve_combined_lists("shared", 640, 8, "cpu")
    fc, md = SimpleNamespace(), SimpleNamespace()
    a = yoco.combine_key(("c128a", 1), 128, 128, 512, md, (0, 1, 4, 8))
    b = yoco.combine_key(("c128a", 2), 128, 128, 512, md, (0, 1, 4, 8))
    assert reserve.combined_lists_out(fc, a, True, 640, 0, 4, 640, "cpu") is not None
    assert reserve.combined_lists_out(fc, b, True, 640, 0, 4, 640, "cpu") is None
    assert reserve.combined_lists_out(fc, a, True, 640, 0, 4, 640, "cpu") is None  # rebuild
    assert reserve.combined_lists_out(fc, a, True, 640, 4, 8, 640, "cpu") is not None
    fc2 = SimpleNamespace()  # the next forward starts over
    assert reserve.combined_lists_out(fc2, b, True, 640, 0, 4, 640, "cpu") is not None
    # An "own" list (not kept across layers) always gets its rows, in its own buffer.
    assert reserve.combined_lists_out(fc, None, True, 640, 0, 4, 640, "cpu") is None
    reserve.reserve_combined_lists("own", 640, 8, "cpu")
    own = reserve.combined_lists_out(fc, None, True, 640, 2, 6, 512, "cpu")
    assert own[0].shape == (4, 512) and own[1].shape == (4,)


def test_second_owner_warning_is_logged_once_across_forwards(caplog):
    """Each forward's owners carry that step's metadata ids: the warning must not repeat per
    step (at 3099bbc the v4-long engine logged it 208 times)."""
    reserve.reserve_combined_lists("shared", 640, 8, "cpu")
    md = SimpleNamespace()
    with caplog.at_level(logging.WARNING, logger="vllm.deepinfer"):
        for step in range(3):
            fc = SimpleNamespace()
            a = yoco.combine_key(("c128a", 10 * step + 1), 128, 128, 512, md, (0, 1, 4, 8))
            b = yoco.combine_key(("c128a", 10 * step + 2), 128, 128, 512, md, (0, 1, 4, 8))
            assert reserve.combined_lists_out(fc, a, True, 640, 0, 4, 640, "cpu") is not None
            assert reserve.combined_lists_out(fc, b, True, 640, 4, 8, 640, "cpu") is None
    said = [r for r in caplog.records if "two live lists" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


def test_combiner_writes_into_the_reserved_rows():
    """The real combiner fills a reserved chunk exactly as its own buffers."""
    g = torch.Generator().manual_seed(6)
    width = topk_swa.combined_width(64, 128)
    reserve.reserve_combined_lists("own", width, 16, "cpu")
    topk = torch.randint(-1, 200, (3, 64), generator=g, dtype=torch.int32)
    args = (topk, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([300], dtype=torch.int32),
            torch.tensor([130], dtype=torch.int32), 128, 4, 64, 400, 75)
    want = topk_swa.combine_topk_swa_indices(*args, variant="cpu")
    out = reserve.combined_lists_out(SimpleNamespace(), None, False, width, 9, 12, width, "cpu")
    got = topk_swa.combine_topk_swa_indices(*args, out=out, variant="cpu")
    slab = reserve.combine_slab("own", width, "cpu")
    assert got[0].data_ptr() == slab.flat[9 * width:].data_ptr()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ----------------------------------------------------------------------------- after the lock
class _Manager:
    """vLLM's WorkspaceManager as the reservations see it: grows until locked, then asserts."""

    def __init__(self):
        self.size, self.locked = 0, False

    def is_locked(self):
        return self.locked

    def get_simultaneous(self, *specs):
        need = reserve.spec_bytes(specs)
        if need > self.size:
            assert not self.locked, f"Workspace is locked but allocation requires {need}"
            self.size = need
        return _Arena(self.size)(specs)


def test_past_the_reservation_fails_after_the_lock(monkeypatch):
    mgr = _Manager()
    monkeypatch.setattr(reserve, "_manager", lambda: mgr)
    lim = reserve.Limits(max_num_batched_tokens=64, max_num_seqs=8, max_capture_size=16)
    dev = torch.device("cpu")
    n = reserve.reserve_decode_scratch(lim, "cpu", 16, 128 + 64, dev)
    assert mgr.size == n > 0
    wide = 1 << 16  # logits [16, 65536] fp32 + 1 MiB: larger than the decode's scratch
    assert reserve.reserve_indexer_logits(lim, wide, dev) == mgr.size > n
    reserve.reserve_combined_lists("shared", 256, lim.prefill_tokens, dev)
    mgr.locked = True
    ws = reserve.decode_workspace()
    worst = reserve.decode_scratch("cpu", lim.decode_tokens, 16, 192, 1)
    ws([(s, d) for _, s, d in worst])  # the worst case fits
    too_big = reserve.decode_scratch("cpu", 4 * lim.decode_tokens, 16, 192, 1)
    with pytest.raises(reserve.ReservationError, match="sparse_mla_decode scratch"):
        ws([(s, d) for _, s, d in too_big])
    assert reserve.indexer_decode_logits(lim.indexer_decode_rows, wide, dev).shape == (16, wide)
    with pytest.raises(reserve.ReservationError, match="indexer decode logits"):
        reserve.indexer_decode_logits(lim.indexer_decode_rows + 1, wide, dev)
    fc = SimpleNamespace()
    key = yoco.combine_key(None, 0, 128, 0, SimpleNamespace(), (0, 1, 0, 128))
    assert reserve.combined_lists_out(fc, key, True, 256, 0, 64, 256, dev) is not None
    with pytest.raises(reserve.ReservationError, match=r"combined lists \(shared"):
        reserve.combined_lists_out(fc, key, True, 256, 60, 65, 256, dev)
    with pytest.raises(reserve.ReservationError, match=r"combined lists \(own, width 640"):
        reserve.combined_lists_out(fc, None, True, 640, 0, 4, 640, dev)


def test_without_a_workspace_manager_the_kernels_allocate():
    assert reserve.decode_workspace() is None
    assert reserve.indexer_decode_logits(4, 64, torch.device("cpu")) is None
    assert reserve.combined_lists_out(None, None, False, 128, 0, 4, 128, "cpu") is None
    assert reserve.reserve_decode_scratch(reserve.Limits(64, 8), "cpu", 16, 128,
                                          torch.device("cpu")) == 0


# ----------------------------------------------------------------------------- real vLLM
def test_vllm_profile_run(tmp_path):
    """Real V4.1 and V4 Ampere layers (tiny configs) in the patched vLLM tree, with this
    checkout's package: their profile run grows vLLM's workspace to every decode worst case
    and indexer logits, reserves the combined lists; after the lock the served decode and
    prefill run in it, and a request past it raises ReservationError
    (tests/vllm_probe_reserve.py)."""
    from patched_python import run_json
    res = run_json(["tests/vllm_probe_reserve.py"], {})
    assert res.get("error") is None, res
    for name, layer in res["layers"].items():
        assert layer["workspace"] >= layer["decode_worst"] > 0, (name, layer)
        if layer["logits"]:
            assert layer["workspace"] >= layer["logits"], (name, layer)
        assert layer["slabs"], (name, layer)
    assert res["served"] and all(r["ok"] for r in res["served"].values()), res["served"]
    assert res["past"]["decode"].startswith("ReservationError"), res["past"]
    assert res["past"]["logits"].startswith("ReservationError"), res["past"]
    assert res["radix_disjoint"] is True


# ----------------------------------------------------------------------------- GPU (H200)
class _DeviceManager(_Manager):
    """``_Manager`` holding a real buffer on ``device`` (views as vLLM's get_simultaneous)."""

    def __init__(self, device):
        super().__init__()
        self.device, self.buf = device, torch.empty(0, dtype=torch.uint8, device=device)

    def get_simultaneous(self, *specs):
        need = reserve.spec_bytes(specs)
        if need > self.buf.numel():
            assert not self.locked, f"Workspace is locked but allocation requires {need}"
            self.buf = torch.empty(need, dtype=torch.uint8, device=self.device)
        views, off = [], 0
        for shape, dtype in specs:
            n = reserve._nbytes(shape, dtype)
            views.append(self.buf[off: off + n].view(dtype).view(shape))
            off += reserve.aligned(n)
        return views


def _peak_during(fn) -> int:
    """Bytes allocated on the current GPU at the peak of ``fn()`` beyond what was allocated
    before it (what a served call would take out of the KV cache's memory)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


# torch's caching allocator rounds and may keep a launch's small host-visible scratch: a call
# that allocates none of the buffers above stays far below this (they are >= 16 MiB here).
_PEAK_SLACK = 1 << 20


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sm80", "sm90"])
def test_gpu_1m_decode_peak_within_reservation(variant, monkeypatch):
    """V4's C128A layer at 1M context: 256 decode tokens x (8192 + 128) keys, 64 heads (the
    sm80 row runs its two-phase path on the H200 too; H200 memory figures, not an A100's).
    After the profile-run reservation and the lock, the decode allocates nothing; without
    the workspace the same call peaks at its scratch (2.03 GiB of two-phase rows on sm80)."""
    from test_sparse_mla_decode import make_cache
    dev = torch.device("cuda")
    mgr = _DeviceManager(dev)
    monkeypatch.setattr(reserve, "_manager", lambda: mgr)
    lim = reserve.Limits(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=1 << 20)
    tokens, heads, swa_w, topk_w = lim.decode_tokens, 64, 128, 8192
    g = torch.Generator().manual_seed(9)
    swa, comp = make_cache(64, 64, dev, g), make_cache(256, 2, dev, g)
    i32 = dict(dtype=torch.int32, device=dev)
    main = torch.randint(0, 64 * 64, (tokens * swa_w,), generator=g).to(**i32)
    extra = torch.randint(0, 256 * 2, (tokens * topk_w,), generator=g).to(**i32)
    q = torch.randn(tokens, heads, HEAD_DIM, generator=g).to(dev, torch.bfloat16)
    args = (q, swa, main, torch.arange(tokens + 1, **i32) * swa_w, 0.04, None, NOPE_DIM,
            ROPE_DIM, comp, extra, torch.arange(tokens + 1, **i32) * topk_w)
    reserved = reserve.reserve_decode_scratch(lim, variant, heads, swa_w + topk_w, dev)
    mgr.locked = True
    got = []
    assert _peak_during(lambda: got.append(smd.sparse_attn_decode(
        *args, variant=variant, workspace=reserve.decode_workspace()))) <= _PEAK_SLACK
    own = _peak_during(lambda: got.append(smd.sparse_attn_decode(*args, variant=variant)))
    assert torch.equal(got[0], got[1])
    floor = tokens * (swa_w + topk_w) * (2 * HEAD_DIM + 1) if variant == "sm80" else \
        tokens * heads * HEAD_DIM * 2
    assert own >= floor and reserved >= own - _PEAK_SLACK, (own, reserved)


@pytest.mark.gpu
def test_gpu_1m_indexer_logits_peak_within_reservation(monkeypatch):
    """V4.1's ratio-1 indexer at 1M context: decode logits [256, 2^20] fp32 (1 GiB) for 256
    requests of 1M keys each (pages shared between requests). In the reserved workspace view
    the call allocates nothing; on its own it allocates the 1 GiB."""
    dev = torch.device("cuda")
    mgr = _DeviceManager(dev)
    monkeypatch.setattr(reserve, "_manager", lambda: mgr)
    lim = reserve.Limits(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=1 << 20)
    width, rows, heads, bs = 1 << 20, lim.indexer_decode_rows, 64, 64
    from test_indexer_logits import _codes
    from vllm.deepinfer import kv_record
    g = torch.Generator().manual_seed(10)
    pages = 64
    cache = _codes((pages, bs, kv_record.INDEX_RECORD_BYTES), g, "cpu")
    cache.view(pages, -1)[:, bs * il.HEAD_DIM:].view(torch.float32).fill_(2.0 ** -4)
    cache = cache.to(dev)
    bt = (torch.arange(width // bs) % pages).repeat(rows, 1).to(dev, torch.int32)
    q = _codes((rows, 1, heads, il.HEAD_DIM), g, "cpu").view(torch.float8_e4m3fn).to(dev)
    w = torch.rand(rows, heads, generator=g).to(dev)
    ctx = torch.full((rows,), width, dtype=torch.int32, device=dev)
    reserve.reserve_indexer_logits(lim, width, dev)
    mgr.locked = True
    got = []
    assert _peak_during(lambda: got.append(il.paged_mqa_logits(
        q, cache, w, ctx, bt, width, out=reserve.indexer_decode_logits(rows, width, dev)))) \
        <= _PEAK_SLACK
    own = _peak_during(lambda: got.append(il.paged_mqa_logits(q, cache, w, ctx, bt, width)))
    assert own >= rows * width * 4
    assert torch.equal(got[0], got[1])
