"""The planner's paging model (tools/kvplan/packing.py) against vLLM 0.33.0's own KV-cache
planning, run on CPU by tests/vllm_probe_kvplan.py in a subprocess (the PATCHED tree,
``CUDA_VISIBLE_DEVICES=""``; vLLM is never imported into this process): for every served
long-context config under benchmarks/e2e/configs (v41-tput, v41-long, v4-long) and every
serving path (the Ampere V4.1 path with 128-token pages as before 7f9e907 (kv_page64 off),
the tree's path (kv_page64 on: compressed-KV and index-K pages of 64 tokens), the same with
the index-K pages forced back to 128 as from 7f9e907 to 8213d15, upstream's classes on SM90),
the same block size, cache specs, cache groups, pool block, blocks per request and reported
KV tokens; vLLM's own functions against the figures the H200 logged at bdbe637; and the
tree's layout against upstream's SM90 one. The planner names the four ``ampere-128``,
``ampere`` (the tree's default), ``ampere-64-idx128`` (a what-if) and ``upstream-sm90``.

Skips like tests/test_vllm_import.py when the patched tree or vLLM's import dependencies
are missing or the tree is older than overlay/ (``make patched``); fails instead with
DEEPINFER_REQUIRE_UPSTREAM=1.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import kvplan as kvp  # tools/kvplan/ (tools/ is on sys.path: conftest)
import subproc
from test_vllm_import import REQUIRE, _probe_env, _unavailable

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).with_name("vllm_probe_kvplan.py")
CONFIG_DIR = REPO / "benchmarks" / "e2e" / "configs"
CONFIGS = tuple(c for c in ("v41-tput", "v41-long", "v4-long")
                if (CONFIG_DIR / c / "config.json").is_file())
# probe path -> the planner's paging of the same pages (packing.PAGINGS: "ampere" is the
# tree's 64 / 64, "ampere-64-idx128" the what-if with only the compressed page at 64)
PATHS = {"ampere128": "ampere-128", "ampere64": "ampere", "ampere64-idx128": "ampere-64-idx128",
         "upstream-sm90": "upstream-sm90"}
# max_model_len of run.py --task long (1,048,320) and 512K; the KV memory the two bdbe637
# engines logged.
LENGTHS = (1_048_320, 524_288)
KV_GIB = (101.55, 100.24)
CHUNK = 8192          # the long engines' max_num_batched_tokens (run.py LONG_CHUNK)
MAX_NUM_SEQS = 64     # run.py: max(64, *batches)
SPEC_KIND = {"MLAAttentionSpec": "full", "SlidingWindowMLASpec": "window",
             "CircularBufferSpec": "ring"}


@pytest.fixture(scope="module")
def vllm_plans() -> dict:
    why = _unavailable()
    if why:
        if REQUIRE:
            pytest.fail(why)
        pytest.skip(why)
    assert CONFIGS, f"no served config under {CONFIG_DIR}"
    req = {"configs": [str((CONFIG_DIR / c / "config.json").relative_to(REPO)) for c in CONFIGS],
           "paths": list(PATHS), "max_model_lens": list(LENGTHS), "kv_gib": list(KV_GIB),
           "chunk": CHUNK, "max_num_seqs": MAX_NUM_SEQS}
    r = subproc.run([sys.executable, str(PROBE), json.dumps(req)], env=_probe_env(), cwd=REPO,
                    cap=300)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        pytest.fail(f"probe failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
    results = json.loads(lines[-1])["results"]
    return {Path(cfg).parent.name: per for cfg, per in results.items()}


def _value(vllm_plans, config: str, path: str) -> dict:
    r = vllm_plans[config][path]
    assert r["ok"], f"{config} {path}: {r['error']}\n{r['trace']}"
    return r["value"]


def _planner(config: str, paging: str):
    cfg = kvp.load_config(CONFIG_DIR / config / "config.json")
    family, name = kvp.family_of(cfg)
    layers = kvp.build_stack(kvp.resolve_model(name, cfg), kvp.CacheFormat("fp8", "fp8"))
    block, specs = kvp.served_specs(layers, family, kvp.PAGINGS[paging])
    return block, specs, kvp.pack(specs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("config", CONFIGS)
def test_planner_packs_like_vllm(vllm_plans, config, path):
    v = _value(vllm_plans, config, path)
    block, specs, packing = _planner(config, PATHS[path])
    assert v["cache_dtype"] == "fp8_ds_mla" and v["layout"] == "BLHNC"
    assert block == v["block_size"]
    want = sorted((SPEC_KIND[s["type"]], s["block_size"], s["page_size_bytes"],
                   s["block_stride_alignment"]) for s in v["specs"].values())
    assert sorted((s.kind, s.block_size, s.page_bytes, s.stride_alignment) for s in specs) == want
    assert (sorted((g.block_size, len(g.specs), g.page_bytes()) for g in packing.groups)
            == sorted((g["block_size"], len(g["layers"]), g["page_size_bytes"]) for g in v["groups"]))
    assert packing.bytes_per_block() == v["bytes_per_block"]
    for length in LENGTHS:
        for gib in KV_GIB:
            got = v["capacity"][str(length)][str(gib)]
            mine = kvp.capacity(packing, [int(gib * kvp.GiB)], length, kvp.in_flight_tokens(CHUNK))
            assert mine.blocks_per_request == got["blocks_per_request"]
            assert mine.num_blocks == got["num_blocks"]
            assert abs(mine.tokens / got["tokens"] - 1) < 0.01, (length, gib)
            assert mine.tokens == got["tokens"]


def test_vllm_reproduces_the_bdbe637_figures(vllm_plans):
    """vLLM's own functions fed the v41-tput specs give the H200's figures: upstream's SM90
    engine (67,434,907 tokens in 100.24 GiB) at max_model_len 1,048,320, the A100-faithful
    engine (60,444,651 in 101.55 GiB, 128-token pages) only at 524,288."""
    if "v41-tput" not in CONFIGS:
        pytest.skip("benchmarks/e2e/configs/v41-tput missing")
    up = _value(vllm_plans, "v41-tput", "upstream-sm90")["capacity"]
    assert abs(up["1048320"]["100.24"]["tokens"] / 67_434_907 - 1) < 0.01
    amp = _value(vllm_plans, "v41-tput", "ampere128")
    assert [g["block_size"] for g in amp["groups"]] == [32, 32, 128, 8]
    assert abs(amp["capacity"]["524288"]["101.55"]["tokens"] / 60_444_651 - 1) < 0.01
    assert amp["capacity"]["1048320"]["101.55"]["tokens"] / 60_444_651 - 1 > 0.10


def _layout(v: dict) -> dict:
    """What vLLM's packing decides, without layer names' owners: block size, every cache's
    spec, the groups (block, layers, page bytes), the pool block, the capacity."""
    return {"block_size": v["block_size"], "layout": v["layout"],
            "specs": v["specs"], "bytes_per_block": v["bytes_per_block"],
            "groups": [(g["block_size"], sorted(g["layers"]), g["page_size_bytes"])
                       for g in v["groups"]],
            "capacity": v["capacity"]}


def _index_k_caches(v: dict) -> dict:
    return {k: b for k, b in v["backends"].items() if k.endswith(".indexer.k_cache")}


@pytest.mark.parametrize("config", CONFIGS)
def test_vllm_layout_of_the_trees_kv_page64(vllm_plans, config):
    """The tree's Ampere path (kv_page64 on by default) packs exactly as upstream's SM90
    classes: same block size, specs, groups (with their layers), pool block and KV tokens at
    every max_model_len and memory, so it holds at least as many tokens. V4.1: the block is
    64 tokens and every index-K cache is served by our backend asking for 64. The planner's
    default paging ("ampere", and ``paging_for("ampere")`` with no pages given) is this
    layout."""
    tree = _value(vllm_plans, config, "ampere64")
    sm90 = _value(vllm_plans, config, "upstream-sm90")
    assert kvp.paging_for("ampere") is kvp.PAGINGS[PATHS["ampere64"]]
    block, _, packing = _planner(config, "ampere")
    assert block == tree["block_size"] and packing.bytes_per_block() == tree["bytes_per_block"]
    assert tree["class"].startswith("DeepinferAmpere") and not sm90["class"].startswith("Deepinfer")
    assert _layout(tree) == _layout(sm90)
    for length in LENGTHS:
        for gib in KV_GIB:
            assert (tree["capacity"][str(length)][str(gib)]["tokens"]
                    >= sm90["capacity"][str(length)][str(gib)]["tokens"])
    if config.startswith("v41"):
        assert tree["block_size"] == 64
        idx = _index_k_caches(tree)
        assert idx and all(b == ["DeepinferAmpereV41IndexerBackend", [64]] for b in idx.values())
        assert set(idx) == set(_index_k_caches(sm90))


V41_CONFIGS = [c for c in CONFIGS if c.startswith("v41")]


@pytest.mark.parametrize("config", V41_CONFIGS)
def test_vllm_index_sources_share_our_index_cache(vllm_plans, config):
    """Every index source of the Ampere path holds the forward context's index-K cache of its
    kv source, of our class: the owners their own, the non-owning ones (v41-tput layer 10,
    v41-long layers 4 and 6) the owner's object. With kv_page64 off the same caches ask for
    upstream's 128."""
    cfg = kvp.load_config(CONFIG_DIR / config / "config.json")
    cfg = cfg.get("text_config", cfg)
    kv_src, idx_src = cfg["kv_source_layer_ids"], cfg["index_source_layer_ids"]
    for path, page in (("ampere64", 64), ("ampere128", 128)):
        v = _value(vllm_plans, config, path)
        got = v["index_sources"]
        assert sorted(got) == sorted(f"model.layers.{i}.attn" for i in idx_src)
        for i in idx_src:
            owner = max(s for s in kv_src if s <= i)
            prefix, owns, cls, in_ctx = got[f"model.layers.{i}.attn"]
            assert prefix == f"model.layers.{owner}.attn.indexer.k_cache" and owns == (i in kv_src)
            assert cls == "DeepinferAmpereV41IndexerCache" and in_ctx is True
        assert any(i not in kv_src for i in idx_src)  # a non-owning index source was checked
        assert all(b == ["DeepinferAmpereV41IndexerBackend", [page]]
                   for b in _index_k_caches(v).values())


@pytest.mark.parametrize("config", V41_CONFIGS)
def test_vllm_index_k_at_128_pads_the_pool_block(vllm_plans, config):
    """With the compressed pages at 64 and the index-K pages at upstream's 128 (the tree from
    7f9e907 to 8213d15) the block stays 128 tokens and the pool block is the LCM of the
    64-token pages' strides, several times the widest group: the cache holds a small
    fraction of the tokens of either consistent layout."""
    half = _value(vllm_plans, config, "ampere64-idx128")
    tree = _value(vllm_plans, config, "ampere64")
    assert half["block_size"] == 128
    widest = max(g["page_size_bytes"] for g in half["groups"])
    assert half["bytes_per_block"] > 5 * widest
    if config == "v41-tput":
        assert half["bytes_per_block"] == 1_235_520 and tree["bytes_per_block"] == 93_312
    for length in LENGTHS:
        for gib in KV_GIB:
            got = half["capacity"][str(length)][str(gib)]["tokens"]
            assert got < 0.2 * tree["capacity"][str(length)][str(gib)]["tokens"]


@pytest.mark.parametrize("config", V41_CONFIGS)
def test_vllm_kv_page64_against_128_token_pages(vllm_plans, config):
    """kv_page64 against DEEPINFER_KV_PAGE64=0 (upstream's 128-token pages off SM90, the
    A100-faithful engine of bdbe637): the 64-token layout holds more tokens at every
    max_model_len and memory (v41-tput: pool block 93,312 B against 184,320 B)."""
    tree = _value(vllm_plans, config, "ampere64")
    old = _value(vllm_plans, config, "ampere128")
    assert old["block_size"] == 128
    if config == "v41-tput":
        assert old["bytes_per_block"] == 184_320
    for length in LENGTHS:
        for gib in KV_GIB:
            assert (tree["capacity"][str(length)][str(gib)]["tokens"]
                    > old["capacity"][str(length)][str(gib)]["tokens"])


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.startswith("v4-")])
def test_vllm_v4_pages_unaffected(vllm_plans, config):
    """V4 (256-token pages on every path): kv_page64 changes nothing."""
    caps = {p: _value(vllm_plans, config, p)["capacity"] for p in PATHS}
    assert caps["ampere64"] == caps["ampere128"] == caps["ampere64-idx128"] == caps["upstream-sm90"]
