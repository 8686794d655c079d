"""The planner's paging model (tools/kvplan/packing.py) against vLLM 0.33.0's own KV-cache
planning, run on CPU by tests/vllm_probe_kvplan.py in a subprocess (the PATCHED tree,
``CUDA_VISIBLE_DEVICES=""``; vLLM is never imported into this process): for every served
long-context config under benchmarks/e2e/configs (v41-tput, v41-long, v4-long) and every
serving path (the Ampere V4.1 path with 128-token pages as before 7f9e907, with the tree's
kv_page64, with the indexer at 64 too, upstream's classes on SM90), the same block size,
cache specs, cache groups, pool block, blocks per request and reported KV tokens; and vLLM's
own functions against the figures the H200 logged at bdbe637.

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
# probe path -> the planner's paging of the same serving path (packing.PAGINGS)
PATHS = {"ampere128": "ampere-128", "ampere64": "ampere", "ampere64-idx64": "ampere-64-idx64",
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


@pytest.mark.parametrize("config", CONFIGS)
def test_vllm_layout_of_the_trees_kv_page64(vllm_plans, config):
    """V4.1: with the compressed-KV backend at 64 and upstream's indexer-K backend at 128 the
    block stays 128 and the pool block is padded to the LCM of the 64-token pages; with the
    indexer at 64 too the layout is upstream's SM90 one. V4 (256-token pages) is unaffected."""
    now = _value(vllm_plans, config, "ampere64")
    fixed = _value(vllm_plans, config, "ampere64-idx64")
    sm90 = _value(vllm_plans, config, "upstream-sm90")
    if config.startswith("v41"):
        assert now["block_size"] == 128
        widest = max(g["page_size_bytes"] for g in now["groups"])
        assert now["bytes_per_block"] == 1_235_520 > 5 * widest
        assert fixed["block_size"] == 64
    for key in ("block_size", "bytes_per_block", "capacity"):
        assert fixed[key] == sm90[key]
    assert ([(g["block_size"], g["page_size_bytes"]) for g in fixed["groups"]]
            == [(g["block_size"], g["page_size_bytes"]) for g in sm90["groups"]])
    if config.startswith("v4-"):
        assert now["capacity"] == sm90["capacity"] == _value(vllm_plans, config, "ampere128")["capacity"]
