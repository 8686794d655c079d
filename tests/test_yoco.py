"""Cross-layer metadata reuse (vllm.deepinfer.yoco) without vLLM: the per-forward cache, its
keys on upstream's real V4.1 layout, the gather and indexer-K buffers. The real V4.1 Ampere
layers with reuse on and off are tests/test_vllm_import.py's yoco tests; the upstream paths
patched to use it (FlashMLA decode, the indexer's K gather) are probed there too."""
from __future__ import annotations

import types

import pytest
import torch

from vllm.deepinfer import routing, yoco

# Upstream's V4.1 layout (40 layers): KV sources and index sources, ratios 0 for layers 0-1,
# 2 for 2-19, 1 for 20-39.
LAYERS = 40
KV_SOURCES = (2, 8, 14, 20)
INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)
RATIOS = [0, 0] + [2] * 18 + [1] * 20


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("DEEPINFER_YOCO_REUSE", raising=False)
    monkeypatch.delenv("DEEPINFER_DISABLE", raising=False)
    routing.reset()
    yoco.reset_totals()
    yield monkeypatch
    routing.reset()


def _off(monkeypatch):
    monkeypatch.setenv("DEEPINFER_YOCO_REUSE", "0")
    routing.reset()


def _sources(layer: int):
    if RATIOS[layer] == 0:
        return None, None
    return (max(s for s in INDEX_SOURCES if s <= layer),
            f"model.layers.{max(s for s in KV_SOURCES if s <= layer)}.attn")


def _forward(ctx, swa_md, comp_md, chunks, built):
    """One forward of the 40-layer layout: what each layer looks up, in layer order."""
    seq = []
    for layer in range(LAYERS):
        idx, kv = _sources(layer)
        r = RATIOS[layer]
        if r:
            key = yoco.decode_indices_key(idx, kv, r, swa_md, comp_md[kv], 3)
            got = yoco.reuse(ctx, key, lambda: built.append(("decode", layer)) or object())
            seq.append(("decode", layer, id(got)))
        for chunk in chunks:
            key = yoco.combine_key(idx, r, 128, 512 if r else 0, swa_md, chunk)
            got = yoco.reuse(ctx, key, lambda: built.append(("combine", layer)) or object())
            seq.append(("combine", layer, id(got)))
    return seq


def _metadata():
    swa = types.SimpleNamespace()
    comp = {f"model.layers.{s}.attn": types.SimpleNamespace() for s in KV_SOURCES}
    return swa, comp


def test_feature_is_on_everywhere_and_switchable(fresh):
    from vllm.deepinfer import envs
    assert yoco.FEATURE in envs.FEATURES
    assert all(envs.enabled(yoco.FEATURE, v) for v in ("sm80", "sm86", "sm89", "sm90", "sm100", "cpu"))
    assert yoco.enabled()
    _off(fresh)
    assert not yoco.enabled()
    assert yoco.step_cache(types.SimpleNamespace()) is None


def test_upstream_layout_decode_builds_8_of_38(fresh):
    swa, comp = _metadata()
    built: list = []
    _forward(types.SimpleNamespace(), swa, comp, [], built)
    assert len(built) == 8 and sorted(layer for _, layer in built) == list(INDEX_SOURCES)
    assert yoco.totals() == {"decode_indices.build": 8, "decode_indices.hit": 30}
    built.clear()
    _off(fresh)
    _forward(types.SimpleNamespace(), swa, comp, [], built)
    assert len(built) == 38  # every compressed layer, as upstream


def test_upstream_layout_prefill_combine_per_chunk(fresh):
    """Per prefill chunk: SWA-only layers 0-1 share one list, each index group one: 9 of 40."""
    swa, comp = _metadata()
    built: list = []
    chunks = [(0, 1, 4096, 4096 + 2175), (1, 3, 100, 400)]
    _forward(types.SimpleNamespace(), swa, comp, chunks, built)
    combine = [layer for kind, layer in built if kind == "combine"]
    assert len(combine) == 9 * len(chunks)
    assert sorted(set(combine)) == [0] + list(INDEX_SOURCES)


def test_each_forward_starts_empty_and_repeats_its_pattern(fresh):
    """The hit/build pattern depends on the layer sequence only: two forwards (new context
    objects, as vLLM makes per forward) build and hit in the same places, each its own."""
    swa, comp = _metadata()
    b1: list = []
    b2: list = []
    s1 = _forward(types.SimpleNamespace(), swa, comp, [(0, 1, 8, 16)], b1)
    s2 = _forward(types.SimpleNamespace(), swa, comp, [(0, 1, 8, 16)], b2)
    assert b1 == b2

    def shape(seq):  # which layers returned the product some earlier layer built
        first: dict = {}
        return [(k, layer, first.setdefault(obj, layer)) for k, layer, obj in seq]
    assert shape(s1) == shape(s2)


def test_keys_name_the_metadata_objects():
    """Two layers share only if they read the very same metadata objects."""
    a, b = types.SimpleNamespace(), types.SimpleNamespace()
    k = yoco.decode_indices_key(20, "L20", 1, a, a, 4)
    assert k == yoco.decode_indices_key(20, "L20", 1, a, a, 4)
    assert k != yoco.decode_indices_key(20, "L20", 1, b, a, 4)
    assert k != yoco.decode_indices_key(24, "L20", 1, a, a, 4)
    assert k != yoco.decode_indices_key(20, "L20", 2, a, a, 4)
    assert yoco.decode_indices_key(yoco.NO_REUSE, "L", 1, a, a, 4) is None
    assert yoco.combine_key(20, 1, 128, 512, a, (0, 1, 2, 3), yoco.NO_REUSE) is None
    assert yoco.combine_key(20, 1, 128, 512, a, (0, 1, 2, 3)) != \
        yoco.combine_key(20, 1, 128, 512, a, (0, 1, 2, 4))


def test_older_index_groups_are_dropped():
    """Index sources increase through the layers: a group's entries go when the next
    group's first lookup comes; SWA-only (None) and metadata-tagged entries stay."""
    c = yoco.StepCache()
    md = types.SimpleNamespace()
    c.get(("combine", None, 0), object)
    c.get(("combine", ("c128a", 1), 0), object)
    c.get(("decode_indices", 2, 0), object)
    c.get(("decode_indices", 8, 0), object)
    assert len(c) == 3 and ("decode_indices", 2, 0) not in c._entries
    del md


def test_reuse_off_builds_every_time(fresh):
    _off(fresh)
    ctx = types.SimpleNamespace()
    n = []
    for _ in range(3):
        yoco.reuse(ctx, ("decode_indices", 2, 0), lambda: n.append(1) or 1)
    assert len(n) == 3 and not hasattr(ctx, "_deepinfer_yoco")


def test_parallel_reason():
    assert yoco.parallel_reason() is None
    assert "DCP" in yoco.parallel_reason(dcp=2) and "PCP" in yoco.parallel_reason(pcp=2)


# ----------------------------------------------------------------------------- gather buffer
def test_prefill_kv_holds_compressed_rows_across_layers(fresh):
    ctx = types.SimpleNamespace()
    ws = torch.zeros(4 * 64 * 8)
    fallback = lambda: ws[: 2 * 16 * 8].view(2, 16, 8)  # noqa: E731
    key = yoco.gather_key("L20", 1, object(), object(), (0, 2, 10, 16))
    kv, have = yoco.prefill_kv(ctx, key, 2, 16, 8, "cpu", fallback)
    assert not have and kv.data_ptr() != ws.data_ptr()
    kv[:, :10] = 3.0                       # the KV source gathers its compressed rows
    kv[:, 10:] = 1.0                       # and its SWA rows
    kv2, have2 = yoco.prefill_kv(ctx, key, 2, 16, 8, "cpu", fallback)
    assert have2 and kv2.data_ptr() == kv.data_ptr() and bool((kv2[:, :10] == 3.0).all())
    other = yoco.gather_key("L14", 2, object(), object(), (0, 2, 10, 16))
    _, have3 = yoco.prefill_kv(ctx, other, 2, 16, 8, "cpu", fallback)
    assert not have3                       # another KV source took the buffer
    _, have4 = yoco.prefill_kv(ctx, key, 2, 16, 8, "cpu", fallback)
    assert not have4                       # ... so this one regathers
    # A new forward never sees the last one's rows.
    _, have5 = yoco.prefill_kv(types.SimpleNamespace(), key, 2, 16, 8, "cpu", fallback)
    assert not have5
    # No key (SWA-only layer) or feature off: the workspace, always gathered.
    assert yoco.prefill_kv(ctx, None, 2, 16, 8, "cpu", fallback)[0].data_ptr() == ws.data_ptr()
    _off(fresh)
    kv6, have6 = yoco.prefill_kv(ctx, key, 2, 16, 8, "cpu", fallback)
    assert not have6 and kv6.data_ptr() == ws.data_ptr()


def test_gather_buffer_bound_and_reallocation(fresh):
    buf = yoco.GatherBuffer(max_bytes=2 * 16 * 8 * 2)
    assert buf.view(2, 16, 8, "cpu") is not None and buf.generation == 1
    assert buf.view(2, 17, 8, "cpu") is None          # over the bound: caller falls back
    assert buf.view(1, 16, 8, "cpu") is not None and buf.generation == 1  # fits: no realloc
    buf.max_bytes *= 4
    buf.view(4, 16, 8, "cpu")
    assert buf.generation == 2                        # grown: holds nothing any more
    buf.reserve(10 << 30, "cpu")                      # capped by max_bytes
    assert buf.tensor.numel() * 2 <= buf.max_bytes


def test_chunk_order_puts_the_held_chunk_first(fresh):
    ctx = types.SimpleNamespace()
    plan = [(0, 1, 8, 16), (1, 2, 8, 16), (2, 3, 8, 16)]

    def key_of(c):
        return yoco.gather_key("L20", 1, None, None, c)
    assert yoco.chunk_order(ctx, plan, key_of) == plan
    yoco.prefill_kv(ctx, key_of(plan[2]), 1, 16, 8, "cpu", lambda: None)
    assert yoco.chunk_order(ctx, plan, key_of) == [plan[2], plan[0], plan[1]]


# ----------------------------------------------------------------------------- indexer K
def _indexer_call(ctx, prefix, chunks, cache_rows, calls, ws):
    """What upstream's chunk loop does with the rows (patch 0041)."""
    seen = []
    for chunk, gathers in chunks:
        kq, ks = ws[0][: chunk.rows], ws[1][: chunk.rows]

        def gather(v, s):
            calls.append(prefix)
            v.copy_(cache_rows[0][: v.shape[0]])
            s.copy_(cache_rows[1][: s.shape[0]])
        v, s = yoco.indexer_k_rows(ctx, prefix, chunk, kq, ks, gather, gathers=gathers)
        seen.append((v.clone(), s.clone(), v.data_ptr()))
    return seen


def test_indexer_k_gather_shared_by_index_sources_of_one_kv_source(fresh):
    rows = 40
    cache_rows = (torch.randint(0, 255, (rows, 128), dtype=torch.uint8),
                  torch.randint(0, 255, (rows, 4), dtype=torch.uint8))
    ws = (torch.zeros(64, 128, dtype=torch.uint8), torch.zeros(64, 4, dtype=torch.uint8))
    c0 = types.SimpleNamespace(rows=rows)
    c1 = types.SimpleNamespace(rows=rows)     # a second query slice: skip_kv_gather
    chunks = [(c0, True), (c1, False)]
    ctx = types.SimpleNamespace()
    calls: list = []
    first = _indexer_call(ctx, "L20.k", chunks, cache_rows, calls, ws)
    ws[0].zero_()  # another layer rewrites the workspace in between
    second = _indexer_call(ctx, "L20.k", chunks, cache_rows, calls, ws)
    assert calls == ["L20.k"]                  # index sources 20 and 24: one gather
    for v, s, _ in first + second:
        assert torch.equal(v, cache_rows[0]) and torch.equal(s, cache_rows[1])
    other = _indexer_call(ctx, "L8.k", chunks, cache_rows, calls, ws)
    assert calls == ["L20.k", "L8.k"]
    assert torch.equal(other[1][0], cache_rows[0])
    # Off: the workspace, one gather per index source, the same rows.
    _off(fresh)
    calls.clear()
    ctx = types.SimpleNamespace()
    off = _indexer_call(ctx, "L20.k", chunks, cache_rows, calls, ws)
    off += _indexer_call(ctx, "L20.k", chunks, cache_rows, calls, ws)
    assert calls == ["L20.k"] * 2
    for v, s, ptr in off:
        assert torch.equal(v, cache_rows[0]) and ptr == ws[0].data_ptr()


def test_indexer_k_too_wide_or_not_shareable_uses_the_workspace(fresh, monkeypatch):
    monkeypatch.setattr(yoco, "INDEXER_K_MAX_ROWS", 8)
    ws = (torch.zeros(64, 128, dtype=torch.uint8), torch.zeros(64, 4, dtype=torch.uint8))
    calls: list = []
    c = types.SimpleNamespace(rows=16)
    ctx = types.SimpleNamespace()
    for _ in range(2):
        v, _ = yoco.indexer_k_rows(ctx, "L20.k", c, ws[0][:16], ws[1][:16],
                                   lambda v, s: calls.append(1), gathers=True)
        assert v.data_ptr() == ws[0].data_ptr()
    v, _ = yoco.indexer_k_rows(ctx, "L20.k", c, ws[0][:4], ws[1][:4],
                               lambda v, s: calls.append(1), gathers=True, shareable=False)
    assert len(calls) == 3 and v.data_ptr() == ws[0].data_ptr()


def test_gather_buffer_device_names_resolve_to_one_device(fresh, monkeypatch):
    """A GPU tensor reports cuda:0 where callers may pass "cuda": compared unresolved they
    differed and the buffer was reallocated (forgetting its rows) on every call, so the H200
    yoco suite reused no prefill gather. Named either way, one buffer, no reallocation."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert yoco._device("cuda") == torch.device("cuda:0") == yoco._device("cuda:0")
    assert yoco._device("cpu:0") == torch.device("cpu")
    assert yoco.gather_buffer("cuda") is yoco.gather_buffer(torch.device("cuda", 0))
    buf = yoco.GatherBuffer(max_bytes=1 << 20)
    buf.view(2, 16, 8, "cpu")
    buf.view(2, 16, 8, "cpu:0")
    buf.view(2, 16, 8, torch.device("cpu"))
    assert buf.generation == 1


# ----------------------------------------------------------------------------- verify mode
def _verify_on(monkeypatch):
    monkeypatch.setenv(yoco.VERIFY_VARIABLE, "1")


def test_verify_off_builds_nothing_again(fresh):
    ctx, builds = types.SimpleNamespace(), []
    key = yoco.swa_ragged_key(object(), 10)
    for _ in range(3):
        yoco.reuse(ctx, key, lambda: builds.append(1) or (torch.zeros(2), torch.zeros(2)))
    assert len(builds) == 1 and not [k for k in yoco.totals() if "verify" in k]


def test_verify_rebuilds_each_hit_and_counts_equal_and_mismatch(fresh):
    _verify_on(fresh)
    ctx = types.SimpleNamespace()
    key = yoco.decode_indices_key(20, "L20", 1, object(), object(), 3)
    value = [torch.tensor([5, 6, 7, 0], dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32)]

    def build():  # a ragged list whose buffer tail is never written: garbage there
        flat = value[0].clone()
        flat[3] = torch.randint(100, 200, ()).item()
        return flat, value[1].clone()
    first = yoco.reuse(ctx, key, build)
    assert yoco.reuse(ctx, key, build) is first
    assert yoco.totals()["decode_indices.verify_equal"] == 1
    value[0][1] = 9                             # a rebuild that differs inside the lengths
    assert yoco.reuse(ctx, key, build) is first  # the reused product is still handed out
    assert yoco.totals()["decode_indices.verify_mismatch"] == 1


def test_same_product_rules():
    i32 = dict(dtype=torch.int32)
    # ragged: up to indptr[-1]; the indptr itself exactly
    a = (torch.tensor([1, 2, 3, 99], **i32), torch.tensor([0, 3], **i32))
    assert yoco.same_product(yoco.SWA_RAGGED, a, (torch.tensor([1, 2, 3, -5], **i32), a[1]))
    assert not yoco.same_product(yoco.SWA_RAGGED, a, (torch.tensor([1, 2, 4, 99], **i32), a[1]))
    assert not yoco.same_product(yoco.SWA_RAGGED, a, (a[0], torch.tensor([0, 2], **i32)))
    # combined lists: each row up to its length; the lengths exactly
    x = torch.tensor([[1, 2, -1], [4, -1, -1]], **i32)
    lens = torch.tensor([2, 1], **i32)
    y = x.clone()
    y[1, 2] = 77
    assert yoco.same_product(yoco.COMBINE, (x, lens), (y, lens))
    y[0, 1] = 3
    assert not yoco.same_product(yoco.COMBINE, (x, lens), (y, lens))
    assert not yoco.same_product(yoco.COMBINE, (x, lens), (x, torch.tensor([2, 2], **i32)))
    # anything else: every bit (-0.0 and 0.0 differ; equal NaN payloads are equal)
    z = torch.tensor([0.0, float("nan")])
    assert yoco.same_product(yoco.GATHER, z, z.clone())
    assert not yoco.same_product(yoco.GATHER, z, torch.tensor([-0.0, float("nan")]))
    assert not yoco.same_product(yoco.GATHER, z, z.double())


def test_verify_prefill_kv_regathers_and_compares(fresh):
    _verify_on(fresh)
    ctx = types.SimpleNamespace()
    ws = torch.zeros(2 * 16 * 8)
    fallback = lambda: ws.view(2, 16, 8)  # noqa: E731
    key = yoco.gather_key("L20", 1, object(), object(), (0, 2, 10, 16))
    kv, have = yoco.prefill_kv(ctx, key, 2, 16, 8, "cpu", fallback)
    assert not have
    kv[:, :10] = 3.0
    kv[:, 10:] = 1.0
    yoco.verify_gather(ctx, kv, 10)              # a miss: nothing to compare
    assert not [k for k in yoco.totals() if "verify" in k]
    kv2, have2 = yoco.prefill_kv(ctx, key, 2, 16, 8, "cpu", fallback)
    assert not have2 and kv2.data_ptr() == kv.data_ptr()   # hit, but gather again
    kv2[:, 10:] = 2.0                            # the consumer's own SWA rows: not compared
    kv2[:, :10] = 3.0
    yoco.verify_gather(ctx, kv2, 10)
    assert yoco.totals()["gather.verify_equal"] == 1 and yoco.totals()["gather.hit"] == 1
    kv3, _ = yoco.prefill_kv(ctx, key, 2, 16, 8, "cpu", fallback)
    kv3[1, 4] = 5.0                              # a regather that differs
    yoco.verify_gather(ctx, kv3, 10)
    assert yoco.totals()["gather.verify_mismatch"] == 1


def test_verify_indexer_k_regathers_and_compares(fresh):
    _verify_on(fresh)
    rows = 40
    cache_rows = (torch.randint(0, 255, (rows, 128), dtype=torch.uint8),
                  torch.randint(0, 255, (rows, 4), dtype=torch.uint8))
    ws = (torch.zeros(64, 128, dtype=torch.uint8), torch.zeros(64, 4, dtype=torch.uint8))
    chunks = [(types.SimpleNamespace(rows=rows), True)]
    ctx, calls = types.SimpleNamespace(), []
    _indexer_call(ctx, "L20.k", chunks, cache_rows, calls, ws)
    second = _indexer_call(ctx, "L20.k", chunks, cache_rows, calls, ws)
    assert calls == ["L20.k"] * 2                # the hit gathered again to compare
    assert yoco.totals()["indexer_k.verify_equal"] == 1
    assert torch.equal(second[0][0], cache_rows[0])
    cache_rows[0][3, 3] ^= 1                      # the cache changed under the reuse
    _indexer_call(ctx, "L20.k", chunks, cache_rows, calls, ws)
    assert yoco.totals()["indexer_k.verify_mismatch"] == 1


def test_batch_tag_names_the_batch_not_the_cache_group():
    """Two SWA metadata objects of one step (two cache groups: own block tables, slots and
    buffers; the batch's common seq_lens / query_start_loc storage) get one tag; another
    batch layout, other storage or another window does not; a plain object is named by
    its identity."""
    import dataclasses

    @dataclasses.dataclass
    class Md:  # the fields of vLLM's DeepseekSparseSWAMetadata that batch_tag reads
        block_table: torch.Tensor
        query_start_loc: torch.Tensor
        seq_lens: torch.Tensor
        block_size: int = 32
        decode_swa_width: int = 128
        prefill_window_size: int = 128
        num_decodes: int = 2
        num_prefills: int = 1
        num_decode_tokens: int = 2
        num_prefill_tokens: int = 5
        max_decode_query_len: int = 1
        prefill_left_visible: torch.Tensor | None = None
        prefill_right_visible: torch.Tensor | None = None

    qsl_buf, seq_buf = torch.arange(16, dtype=torch.int32), torch.arange(16, dtype=torch.int32)
    a = Md(torch.zeros(3, 4), qsl_buf[:4], seq_buf[:3])
    b = Md(torch.ones(3, 4), qsl_buf[:4], seq_buf[:3])   # another group, same step
    assert yoco.batch_tag(a) == yoco.batch_tag(b)
    assert yoco.decode_indices_key(1, "L1", 2, a, "c", 2) == \
        yoco.decode_indices_key(1, "L1", 2, b, "c", 2)
    assert yoco.swa_ragged_key(a, 10) != yoco.swa_ragged_key(b, 10)  # reads the block table
    assert yoco.batch_tag(a) != yoco.batch_tag(Md(a.block_table, qsl_buf[:4].clone(), seq_buf[:3]))
    assert yoco.batch_tag(a) != yoco.batch_tag(Md(a.block_table, qsl_buf[:5], seq_buf[:3]))
    assert yoco.batch_tag(a) != yoco.batch_tag(dataclasses.replace(a, num_decodes=1))
    assert yoco.batch_tag(a) != yoco.batch_tag(dataclasses.replace(a, prefill_window_size=64))
    assert yoco.batch_tag(a) != yoco.batch_tag(
        dataclasses.replace(a, prefill_left_visible=torch.zeros(7, dtype=torch.int32)))
    o = object()
    assert yoco.batch_tag(o) == ("object", id(o)) != yoco.batch_tag(object())
