"""JIT warmup keys (vllm.deepinfer.warmup): derived from the model config, the same
configurations the launchers pick, and — on a GPU — compiled so that a real launch of the
model's shapes finds its kernel already built (no compile on the first request)."""
from __future__ import annotations

import inspect
import types

import pytest
import torch

from vllm.deepinfer import warmup as wu
from vllm.deepinfer.kernels import indexer_logits as il
from vllm.deepinfer.kernels import kv_gather as kg
from vllm.deepinfer.kernels import shapes as sh
from vllm.deepinfer.kernels import sparse_mla_decode as smd
from vllm.deepinfer.kernels import sparse_mla_prefill as spm
from vllm.deepinfer.kernels import topk_swa as ts


def _config(tp=1, **hf):
    base = dict(sliding_window=128, index_topk=512, num_attention_heads=64)
    base.update(hf)
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(**base)),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp))


def test_model_shapes_v41_and_v4():
    v41 = wu.model_shapes(_config(compress_ratios=[0, 1, 2, 1, 0, 2]))
    assert v41 == wu.ModelShapes(window=128, compress_ratios=(0, 1, 2), topk=512, heads=64)
    v4 = wu.model_shapes(_config(tp=2, compress_rates={"c4a": 4, "c128a": 128},
                                 layer_types=["swa", "c4a", "c128a", "c4a"]))
    assert v4.compress_ratios == (0, 4, 128) and v4.heads == 32 and v4.model == "v4"
    assert v4.swa_page == 64 and v4.extra_page(4, "sm80") == 64 and v4.extra_page(128, "sm80") == 2
    assert v41.swa_page == 32 and v41.extra_page(1, "sm90") == 64
    # V4's C128A top-k covers every compressed position: 1M tokens -> 8192
    assert wu.ModelShapes(128, (4, 128), 512, 64, model="v4", max_model_len=1 << 20).c128a_topk == 8192
    with pytest.raises(ValueError, match="hf_config"):
        wu.model_shapes(types.SimpleNamespace(model_config=None))


@pytest.mark.parametrize("variant", ["sm80", "sm90"])
def test_keys_are_the_launchers_configurations(variant, monkeypatch):
    monkeypatch.delenv("DEEPINFER_KV_PAGE64", raising=False)
    monkeypatch.delenv("DEEPINFER_DISABLE", raising=False)
    shapes = wu.ModelShapes(window=128, compress_ratios=(0, 1, 2), topk=512, heads=64)
    got = wu.keys(shapes, variant, features=["kv_gather", "topk_swa", "sparse_mla_decode"])
    gather = [k for k in got if k.kernel == "kv_gather"]
    assert {k.constexprs for k in gather} == {tuple(sorted(k.constexprs().items()))
                                              for k in kg.compile_keys(variant)}
    combine = [k for k in got if k.kernel == "topk_swa"]
    assert {k.constexprs for k in combine} == {
        tuple(sorted(k.constexprs().items())) for k in ts.compile_keys(128, [0, 1, 2], 512, variant)}
    decode = [dict(k.constexprs) for k in got if k.kernel == "decode"]
    tile = smd.TILES[variant]
    assert {d["HAS_EXTRA"] for d in decode} == {False, True}   # ratio 0 and ratio > 0 layers
    assert all(d["BLOCK_N"] == tile.block_n and d["MAIN_BS"] == wu.SWA_BLOCK for d in decode)
    # V4.1 with kv_page64 (on by default): 64-token pages, 64 entries at ratio 1 and 32 at
    # ratio 2 (ModelShapes.extra_pages).
    assert {d["EXTRA_BS"] for d in decode if d["HAS_EXTRA"]} == {64, 32}
    # An unsplit launch passes ``out`` (bf16) for its partials: the warmup passes the same.
    unsplit = [k for k in got if k.kernel == "decode" and not dict(k.constexprs)["SPLIT"]]
    assert unsplit and all(dict(k.ptrs)["part_m_ptr"] == "bf16" for k in unsplit)
    assert any(k.kernel == "decode_reduce" for k in got)


@pytest.mark.parametrize("variant", ["sm80", "sm86", "sm90", "sm100"])
def test_v41_pages_follow_kv_page64(variant, monkeypatch):
    """The compressed pages the decode is warmed for: kv_page64 on (default) 64-token pages
    on every variant; off, upstream's pages, which follow the capability vLLM sees (a
    variant forced by DEEPINFER_ARCH can differ from it), so 64 and 128. Entries per page are
    page // ratio; V4 keeps 256 // ratio."""
    monkeypatch.delenv("DEEPINFER_KV_PAGE64", raising=False)
    monkeypatch.delenv("DEEPINFER_DISABLE", raising=False)
    v41 = wu.ModelShapes(window=128, compress_ratios=(0, 1, 2), topk=512, heads=64)
    v4 = wu.ModelShapes(window=128, compress_ratios=(1, 4, 128), topk=512, heads=64, model="v4")
    assert sh.compressed_page(variant) == sh.KV_PAGE64 == 64
    assert v41.v41_pages(variant) == (64,)
    assert v41.extra_pages(1, variant) == (64,) and v41.extra_pages(2, variant) == (32,)
    assert v41.extra_page(2, variant) == 32
    assert v4.extra_pages(4, variant) == (64,) and v4.extra_pages(128, variant) == (2,)

    def extras():
        return {dict(k.constexprs)["EXTRA_BS"] for k in wu.keys(v41, variant,
                                                                features=["sparse_mla_decode"])
                if k.kernel == "decode" and dict(k.constexprs)["HAS_EXTRA"]}
    assert extras() == {64, 32}
    monkeypatch.setenv("DEEPINFER_KV_PAGE64", "0")
    assert sh.compressed_page(variant) == (64 if variant == "sm90" else 128)
    assert v41.v41_pages(variant) == (64, 128)
    assert v41.extra_pages(1, variant) == (64, 128) and v41.extra_pages(2, variant) == (32, 64)
    assert extras() == {128, 64, 32}
    monkeypatch.setenv("DEEPINFER_DISABLE", "kv_page64")
    monkeypatch.delenv("DEEPINFER_KV_PAGE64")
    assert v41.v41_pages(variant) == (64, 128)


def test_compressed_entries_refuses_partial_entries():
    assert sh.compressed_entries(64, 2) == 32 and sh.compressed_entries(128, 1) == 128
    with pytest.raises(ValueError, match="whole ratio-3 entries"):
        sh.compressed_entries(64, 3)
    with pytest.raises(ValueError, match="unknown variant 'sm70'"):
        sh.compressed_page("sm70")


def test_decode_keys_cover_both_phases_where_predequant_is_on(monkeypatch):
    """sm80 (decode_predequant on by default): the single-phase tile of small batches and the
    two-phase tile of batches from PREDEQUANT_MIN_TOKENS with its first phase, per cache
    geometry; DEEPINFER_DECODE_PREDEQUANT=0 and the hardware-e4m3 sm90 keep the first only."""
    shapes = wu.ModelShapes(window=128, compress_ratios=(0, 1, 2), topk=512, heads=64)

    def decode_keys(variant):
        got = wu.keys(shapes, variant, features=["sparse_mla_decode"])
        assert len(got) == len(set(got))
        return got
    got = decode_keys("sm80")
    one, two = smd.TILES["sm80"], smd.TILES["sm80-2p"]
    attn = {(dict(k.constexprs)["PREDEQUANT"], k.num_stages) for k in got if k.kernel == "decode"}
    assert attn == {(False, one.num_stages), (True, two.num_stages)}
    first = [dict(k.constexprs) for k in got if k.kernel == "decode_predequant"]
    assert {c["HAS_EXTRA"] for c in first} == {False, True}
    assert all(c["DECODE"] == smd.PREDEQUANT_DECODES[two.predequant_decode]
               and c["BLOCK_N"] == smd.PREDEQUANT_BLOCK_N and not c["HW_FP8"] for c in first)
    # Two-phase attention launches read the workspace: no stand-in for ws/valid.
    assert all("valid_ptr" not in dict(k.ptrs) for k in got
               if k.kernel == "decode" and dict(k.constexprs)["PREDEQUANT"])
    monkeypatch.setenv("DEEPINFER_DECODE_PREDEQUANT", "0")
    off = decode_keys("sm80")
    assert off == [k for k in got if k.kernel != "decode_predequant"
                   and not dict(k.constexprs).get("PREDEQUANT")]
    monkeypatch.delenv("DEEPINFER_DECODE_PREDEQUANT")
    assert all(k.kernel != "decode_predequant" and not dict(k.constexprs).get("PREDEQUANT")
               for k in decode_keys("sm90"))


def test_v4_decode_uses_v4_pages():
    """V4's SWA pages hold 64 tokens and its compressed pages 256 // ratio entries (C4A 64,
    C128A 2): its decode keys carry those, not V4.1's 32 / 128."""
    v4 = wu.ModelShapes(window=128, compress_ratios=(1, 4, 128), topk=512, heads=64, model="v4")
    decode = [dict(k.constexprs) for k in wu.keys(v4, "sm80", features=["sparse_mla_decode"])
              if k.kernel == "decode"]
    assert {d["MAIN_BS"] for d in decode} == {64}
    assert {d["EXTRA_BS"] for d in decode if d["HAS_EXTRA"]} == {64, 2}


def test_reduce_covers_every_split_bucket():
    """choose_num_splits can pick up to one split per key tile within one wave of CTAs: the
    reduce is warmed for every power of two up to that bound."""
    v41 = wu.ModelShapes(window=128, compress_ratios=(0, 1), topk=512, heads=64)
    p2 = {dict(k.constexprs)["SPLITS_P2"] for k in wu.keys(v41, "sm80", ["sparse_mla_decode"],
                                                              sm_count=108)
          if k.kernel == "decode_reduce"}
    most = -(-(128 + 512) // smd.TILES["sm80"].block_n)  # 40 key tiles
    assert p2 == {2, 4, 8, 16, 32, 64} and max(p2) >= most


@pytest.mark.parametrize("variant", ["sm80", "sm90"])
def test_indexer_logits_keys(variant):
    v41 = wu.ModelShapes(window=128, compress_ratios=(0, 1, 2), topk=512, heads=64)
    got = [k for k in wu.keys(v41, variant, features=["indexer_logits"])]
    assert {k.constexprs for k in got} == {tuple(sorted(c.items()))
                                           for c in il.compile_constexprs(variant)}
    assert all(dict(k.constexprs)["HW_FP8"] is (variant == "sm90") for k in got)
    swa_only = wu.ModelShapes(window=128, compress_ratios=(0,), topk=0, heads=64)
    assert wu.keys(swa_only, variant, features=["indexer_logits"]) == []


@pytest.mark.parametrize("variant,heads", [("sm80", 64), ("sm86", 64), ("sm90", 64),
                                           ("sm90", 128), ("sm90", 16)])
def test_prefill_key_is_the_launchers_configuration(variant, heads):
    from vllm.deepinfer.kernels import sparse_mla_prefill_gluon as glp
    shapes = wu.ModelShapes(window=128, compress_ratios=(0, 1, 2), topk=512, heads=heads)
    keys = wu.keys(shapes, variant, features=["sparse_mla_prefill"])
    tile = spm.TILES[variant]
    # sm90's row runs the Gluon producer/consumer kernel (one key: its launch's constexprs
    # and options, maxnreg included) and falls back to its Triton tile (the other key).
    ws = [k for k in keys if k.kernel == "prefill_ws"]
    assert len(ws) == (1 if tile.gluon_ws and glp.AVAILABLE else 0)
    for k in ws:
        assert dict(k.constexprs) == glp.gate_constexprs()
        assert wu.launch_options(k) == {"num_warps": glp.NUM_WARPS, "maxnreg": glp.MAXNREG}
    (key,) = [k for k in keys if k.kernel == "prefill"]
    c = dict(key.constexprs)
    assert c["BLOCK_H"] == spm.launch_plan(heads, tile)[0]
    assert c["DENSE"] and c["HAS_SINK"] and c["ALIGNED"] and not c["DOT_FP32"]
    assert (c["BLOCK_N"], c["SPLIT_D"], c["OUT_D"]) == (tile.block_n, tile.split_d, 512)
    assert (key.num_warps, key.num_stages) == (tile.num_warps, tile.num_stages)
    # On by default below 9.0 (sm80, sm86): the default key list holds this key; off on sm90.
    default = [k for k in wu.keys(shapes, variant) if k.kernel.startswith("prefill")]
    assert default == ([key] if variant in ("sm80", "sm86") else [])


def test_env_switch_drops_a_feature(monkeypatch):
    shapes = wu.ModelShapes(window=128, compress_ratios=(1,), topk=512, heads=64)
    monkeypatch.setenv("DEEPINFER_DISABLE", "kv_gather")
    names = {k.kernel for k in wu.keys(shapes, "sm80")}
    assert "kv_gather" not in names and "topk_swa" in names


def test_warmup_args_follow_the_signature():
    shapes = wu.ModelShapes(window=128, compress_ratios=(1,), topk=512, heads=64)
    for key in wu.keys(shapes, "sm80", features=["kv_gather", "topk_swa", "sparse_mla_decode",
                                                 "sparse_mla_prefill"]) + \
            wu.keys(shapes, "sm90", features=["sparse_mla_prefill"]):
        args, constexprs = wu.warmup_args(key)
        kernel, sig = wu._kernel_and_signature(key.kernel)
        runtime = [n for n, t in sig.items() if t != "constexpr"]
        assert len(args) == len(runtime)
        assert set(constexprs) == {n for n, t in sig.items() if t == "constexpr"}
        fn = getattr(kernel, "fn", kernel)  # the Python function (interpreter wraps it)
        assert list(inspect.signature(fn).parameters) == list(sig)  # the table is the kernel's


@pytest.mark.gpu
def test_warmed_kernels_are_not_compiled_again_on_launch():
    """Compile the gather, combiner and indexer-logits keys of a V4.1 model, then launch
    them at model shapes: Triton's cache for each kernel must not grow (the launch found its binary)."""
    dev = torch.device("cuda")
    variant = "sm90" if torch.cuda.get_device_capability() >= (8, 9) else "sm80"
    shapes = wu.ModelShapes(window=128, compress_ratios=(0, 1, 2), topk=512, heads=64)
    for key in wu.keys(shapes, variant, features=["kv_gather", "topk_swa", "indexer_logits"]):
        wu.compile_key(key)

    def cache_size(kernel):
        return sum(len(c[0]) for c in kernel.device_caches.values())

    before = (cache_size(kg._gather_kernel), cache_size(ts._combine_kernel),
              cache_size(il._logits_kernel))
    bs, max_blocks = 64, 16 * 4
    cache = torch.zeros(40, bs, 584, dtype=torch.uint8, device=dev)
    out = torch.zeros(2, 256, 512, dtype=torch.bfloat16, device=dev)
    seq = torch.tensor([200, 100], dtype=torch.int32, device=dev)
    bt = torch.zeros(2, max_blocks, dtype=torch.int32, device=dev)
    kg.dequantize_and_gather_k_cache(out, cache, seq, seq, bt, bs, 0, variant=variant)
    topk = torch.zeros(64, 512, dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, 64], dtype=torch.int32, device=dev)
    for ratio in (0, 1, 2):
        ts.combine_topk_swa_indices(topk, qsl, seq[:1], seq[:1], 128, ratio,
                                    512 if ratio else 0, 1000, 100, variant=variant)
    q = torch.zeros(3, 1, 64, 128, dtype=torch.uint8, device=dev)
    icache = torch.zeros(8, 128, 132, dtype=torch.uint8, device=dev)
    il.paged_mqa_logits(q, icache, torch.zeros(3, 64, device=dev),
                        torch.tensor([5, 300, 17], dtype=torch.int32, device=dev),
                        torch.zeros(3, 4, dtype=torch.int32, device=dev), 333, variant=variant)
    il.mqa_logits(q[:, 0], icache[0, :, :128].contiguous(), torch.ones(128, device=dev),
                  torch.zeros(3, 64, device=dev), torch.zeros(3, dtype=torch.int32, device=dev),
                  torch.full((3,), 77, dtype=torch.int32, device=dev), 77, variant=variant)
    torch.cuda.synchronize()
    assert (cache_size(kg._gather_kernel), cache_size(ts._combine_kernel),
            cache_size(il._logits_kernel)) == before


@pytest.mark.gpu
def test_warmed_prefill_is_not_compiled_again_on_launch():
    """The prefill keys of a V4.1 model, compiled, then launched as the Ampere classes call
    it (combiner rows, lengths, sink, [rows, 1, 512] workspace) with 64 heads and an odd row
    count: no kernel's cache may grow (on sm90 the launch runs the Gluon producer/consumer
    kernel, whose key the warmup compiled)."""
    from vllm.deepinfer.kernels import sparse_mla_prefill_gluon as glp
    dev = torch.device("cuda")
    variant = "sm90" if torch.cuda.get_device_capability() >= (9, 0) else "sm80"
    shapes = wu.ModelShapes(window=128, compress_ratios=(0, 1, 2), topk=512, heads=64)
    for key in wu.keys(shapes, variant, features=["sparse_mla_prefill"]):
        wu.compile_key(key)
    kernels = [k for k in (spm._sparse_mla_prefill_kernel, glp._prefill_ws_kernel) if k]

    def sizes():
        return [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]
    before = sizes()
    if variant == "sm90" and glp.AVAILABLE:
        assert before[1] >= 1  # the warmup compiled the Gluon kernel
    q = torch.zeros(37, 64, 512, dtype=torch.bfloat16, device=dev)
    kv = torch.zeros(1001, 1, 512, dtype=torch.bfloat16, device=dev)
    idx = torch.zeros(37, 768, dtype=torch.int32, device=dev)
    lens = torch.full((37,), 640, dtype=torch.int32, device=dev)
    spm.sparse_attn_prefill(q, kv, 0.04, torch.zeros(64, device=dev), 448, 64, indices=idx,
                            topk_length=lens, out=torch.empty_like(q), variant=variant)
    torch.cuda.synchronize()
    assert sizes() == before
