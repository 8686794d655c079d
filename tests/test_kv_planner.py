"""KV-cache capacity / topology planner: the published DeepSeek-V4 arithmetic, the per-type
page facts taken from vLLM 0.33.0, the V4.1 YOCO accounting, the 6-GPU plans and the CLI's
input errors. Pure arithmetic: no GPU, no torch in the planner, runs in well under a second.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import kvplan as kvp  # tools/kvplan/, the planner library (tools/ is on sys.path: conftest)

REPO = Path(__file__).resolve().parent.parent
V41_CONFIG = REPO / "tools" / "configs" / "deepseek-v4.1-illustrative.json"
TPUT_CONFIG = REPO / "benchmarks" / "e2e" / "configs" / "v41-tput" / "config.json"
M = kvp.CONTEXT_1M
GiB, MiB = kvp.GiB, kvp.MiB
BF16 = kvp.CacheFormat("bf16", "bf16")
FP8_FP4 = kvp.CacheFormat("fp8", "fp4")


@pytest.fixture(scope="module")
def v41():
    return kvp.resolve_model("v4.1", kvp.load_config(V41_CONFIG))


@pytest.fixture(scope="module")
def cli():
    return importlib.import_module("kv_planner")  # tools/ is on sys.path (conftest)


# ---- the published figures ----------------------------------------------------------------
def test_v32_style_stack_bf16():
    layer = kvp.v32_layer(0, BF16)
    assert kvp.layer_bytes_per_token(layer) == 1152 + 256 == 1408
    assert kvp.layer_bytes(layer, M) == 1408 * M
    assert kvp.layer_bytes(layer, M) / GiB == 1.375
    assert round(kvp.stack_bytes(kvp.v32_stack(61, BF16), M) / GiB, 1) == 83.9


def test_v4_layers_bf16():
    stack = kvp.v4_stack(kvp.PUBLISHED_V4_RATIOS, BF16)
    assert kvp.count_labels(stack) == {"c4a": 30, "c128a": 31}
    c4a = next(x for x in stack if x.label == "c4a")
    c128a = next(x for x in stack if x.label == "c128a")
    assert kvp.layer_bytes(c4a, M) == (128 + M // 4) * 1024 + (M // 4) * 256
    assert round(kvp.layer_bytes(c4a, M) / MiB, 1) == 320.1
    assert kvp.layer_bytes(c128a, M) == (128 + M // 128) * 1024
    assert round(kvp.layer_bytes(c128a, M) / MiB, 1) == 8.1


def test_v4_total_reduction_and_quantized():
    f = kvp.published_figures()
    assert round(f["v4_total_bytes_1m"] / GiB, 2) == 9.62
    assert round(f["v4_reduction_x"], 1) == 8.7
    c4a = (128 + M // 4) * 584 + M // 4 * 68
    c128a = (128 + M // 128) * 584
    assert f["v4_fp8_fp4_total_bytes_1m"] == 30 * c4a + 31 * c128a
    assert 0.45 < f["v4_fp8_fp4_fraction_of_bf16"] < 0.55  # "about halves it"


def test_record_sizes_from_upstream_layouts():
    assert kvp.V4_FP8_RECORD == 448 + 64 * 2 + 8 == 584
    assert kvp.V32_FP8_RECORD == 656
    assert kvp.INDEXER_RECORD == {"bf16": 256, "fp8": 132, "fp4": 68}


# ---- V4.1 ---------------------------------------------------------------------------------
def test_v41_yoco_readers_own_no_kv(v41):
    stack = kvp.build_stack(v41, FP8_FP4)
    assert [x.index for x in stack if x.owns_context_cache()] == [2, 8, 14, 20]
    for layer in stack[21:40]:
        assert layer.kv_source == 20 and not layer.owns_context_cache()
        assert kvp.layer_bytes_per_token(layer) == 0
    # three ratio-2 sources + one ratio-1 source, fp8 record + fp4 indexer
    assert kvp.stack_bytes_per_token(stack) == 3 * (584 + 68) / 2 + (584 + 68)


def test_v41_nvfp4_matches_published_890_bytes(v41):
    """DeepSeek's 890 B/token global KV for V4.1 (recipe): nvfp4 compressed + fp4 indexer."""
    stack = kvp.build_stack(v41, kvp.CacheFormat("nvfp4", "fp4"))
    assert kvp.stack_bytes_per_token(stack) == 890


def test_v41_rejects_unknown_ratio(v41):
    bad = {**v41.arch, "compress_ratios": [4] * 43}
    with pytest.raises(kvp.PlannerInputError) as e:
        kvp.v41_stack(bad, FP8_FP4)
    assert e.value.field in ("compress_ratios", "kv_source_layer_ids")


# ---- pages and buckets --------------------------------------------------------------------
def test_v4_pages_fp8():
    pages = {r.cache: r for r in kvp.page_table(kvp.v4_stack(kvp.PUBLISHED_V4_RATIOS, FP8_FP4))}
    assert pages["c4a.kv"].states_per_page == 64  # 256-token block / ratio 4
    assert pages["c4a.kv"].raw_page_bytes == 64 * 584
    assert pages["c4a.kv"].page_bytes == 37440  # padded to a 576 B multiple
    assert pages["c128a.kv"].page_bytes == 1728
    assert pages["swa"].block_tokens == 64 and pages["swa"].page_bytes == 37440
    buckets = kvp.page_buckets(kvp.v4_stack(kvp.PUBLISHED_V4_RATIOS, FP8_FP4))
    assert buckets[37440] == ["swa", "c4a.kv"]


def test_v41_pages(v41):
    pages = {r.cache: r for r in kvp.page_table(kvp.build_stack(v41, FP8_FP4))}
    assert pages["swa"].block_tokens == 32 and pages["swa"].page_bytes == 19008
    # 64-token blocks: the tree's Ampere path (kv_page64) and upstream's SM90 classes, both
    # backends at 64 (packing.py): 64 x 584 = 37,376 B padded to 65 x 576; the ratio-2
    # page holds 32 states, 18,688 B padded to 33 x 576 (the SWA page's size).
    assert pages["c1.kv"].block_tokens == kvp.V41_BLOCK == kvp.AMPERE_PAGE == 64
    assert pages["c1.kv"].page_bytes == 37440
    assert pages["c2.kv"].states_per_page == 32 and pages["c2.kv"].page_bytes == 19008
    assert pages["c2.compressor_ring"].upstream_spec == "CircularBufferSpec"


# ---- model facts --------------------------------------------------------------------------
@pytest.mark.parametrize("name,published,tol", [("v4-flash", 284, 0.01), ("v4-pro", 1600, 0.03)])
def test_computed_params_match_published(name, published, tol):
    model = kvp.resolve_model(name)
    total = kvp.model_params(model, kvp.build_stack(model, FP8_FP4))["total"] / 1e9
    assert abs(total / published - 1) < tol


def test_v41_params_match_recipe(v41):
    total = kvp.model_params(v41, kvp.build_stack(v41, FP8_FP4))["total"] / 1e9
    assert abs(total / 552 - 1) < 0.01


def test_illustrative_config_is_marked():
    cfg = json.loads(V41_CONFIG.read_text())
    assert "ILLUSTRATIVE" in cfg["_comment"]
    assert cfg["text_config"]["num_hidden_layers"] == 40


# ---- plans --------------------------------------------------------------------------------
def _tp2pp3():
    return kvp.Topology(gpus=6, gpu_mem_gib=64, tp=(2, 2, 2), split=(14, 14, 12))


def test_reference_topology(v41):
    """The tree's Ampere path (64-token pages, the fp8 index-K cache it serves, every
    reservation of reserve.py counted) plans 22% below the 4,648,480 reference; the fp4
    index-K cache the plan used to default to, a what-if on this path, 15% below."""
    p = kvp.plan(v41, _tp2pp3())
    assert p.topology["paging"] == "ampere" and p.cache_format == "attn fp8 + indexer fp8"
    assert p.fits and p.bottleneck().stage == 1  # layers 14-27 hold sources 14 and 20
    assert p.stages[2].replicated_sources == (20,)
    assert any("NotImplementedError" in w for w in p.warnings)
    assert not any("what-if" in w for w in p.warnings)
    gap = kvp.reference_gap(p)
    assert 0.75 < gap.ratio < 0.8
    assert p.stages[1].kv_bytes_per_token == 3 * (584 + 132) / 2 and p.assumptions
    fp4 = kvp.plan(v41, _tp2pp3(), fmt=FP8_FP4)
    assert any("refuses MXFP4" in w and "what-if" in w for w in fp4.warnings)
    assert 0.8 < kvp.reference_gap(fp4).ratio < 0.9
    assert fp4.reported_tokens > p.reported_tokens  # 68 B index-K rows instead of 132


def test_reference_topology_with_the_trees_paging(v41):
    """64-token pages on both V4.1 backends: the block is 64 tokens and the groups, pool
    block and blocks per request are upstream's SM90 ones; 128-token pages
    (DEEPINFER_KV_PAGE64=0) hold about as many tokens here; the what-if with only the
    compressed page at 64 pads the pool block to the LCM of the 64-token page strides."""
    p = kvp.plan(v41, _tp2pp3())
    sm90 = kvp.plan(v41, dataclasses.replace(_tp2pp3(), paging="upstream-sm90"))
    assert p.packing["groups"] == sm90.packing["groups"]
    assert p.packing["bytes_per_block"] == sm90.packing["bytes_per_block"]
    assert {g["block_size"] for g in p.packing["groups"] if g["kind"] == "full"} == {64}
    # the pool block is the widest group's page: the full group (10 caches), the SWA groups
    # (8 caches, 152,064 B) padded to it
    widest = max(g["page_bytes"] for g in p.packing["groups"])
    assert p.packing["bytes_per_block"] == widest == 163_008
    assert not any("LCM" in w for w in p.warnings)
    old = kvp.plan(v41, dataclasses.replace(_tp2pp3(), paging="ampere-128"))
    assert {g["block_size"] for g in old.packing["groups"] if g["kind"] == "full"} == {128}
    assert abs(p.reported_tokens / old.reported_tokens - 1) < 0.01
    half = kvp.plan(v41, dataclasses.replace(_tp2pp3(), paging="ampere-64-idx128"))
    assert half.packing["bytes_per_block"] == math.lcm(19008, 37440) == 1_235_520
    assert any("LCM of the compressed caches' kernel-page strides" in w for w in half.warnings)
    assert half.reported_tokens < 0.15 * p.reported_tokens
    assert half.kv_tokens == p.kv_tokens  # the raw per-token count knows no pool blocks


def test_cross_stage_reject(v41):
    with pytest.raises(kvp.PlannerInputError) as e:
        kvp.plan(v41, kvp.Topology(gpus=6, gpu_mem_gib=64, tp=(2, 2, 2), split=(14, 14, 12),
                                   cross_stage_kv="reject"))
    assert e.value.field == "split"


def test_six_gpu_comparison(v41):
    plans = kvp.compare_six_gpus(v41)
    assert [p.label.split(" (split")[0] for p in plans] == ["TP2 x PP3", "PP6", "TP2 + TP4 (PP2)"]
    assert all(p.fits for p in plans)
    assert plans[2].stages[1].tp == 4  # the cut at 14 keeps every YOCO group in one stage:
    assert not any("NotImplementedError" in w for w in plans[2].warnings)
    assert any("tensor_parallel_size" in w for w in plans[2].warnings)
    assert plans[1].seqs > plans[0].seqs and plans[2].seqs > plans[0].seqs


def test_v4_pro_does_not_fit_six_gpus():
    plans = kvp.compare_six_gpus(kvp.resolve_model("v4-pro"))
    assert not any(p.fits for p in plans)


@pytest.mark.parametrize("kwargs,field", [
    (dict(split=(14, 14, 13)), "split"),
    (dict(tp=(3, 3, 3), gpus=9), "tp"),
    (dict(gpus=8), "gpus"),
    (dict(util=1.5), "util"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_capture_size=-1), "max_capture_size"),
    (dict(decode_variant="sm90"), "decode_variant"),
])
def test_plan_input_errors(v41, kwargs, field):
    topo = kvp.Topology(**{**dict(gpus=6, gpu_mem_gib=64, tp=(2, 2, 2), split=(14, 14, 12)), **kwargs})
    with pytest.raises(kvp.PlannerInputError) as e:
        kvp.plan(v41, topo)
    assert e.value.field == field


def test_unknown_model():
    with pytest.raises(kvp.PlannerInputError) as e:
        kvp.resolve_model("v5")
    assert e.value.field == "model"


# ---- CLI ----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,field", [
    (["plan", "--model", "v9"], "model"),
    (["plan", "--model", "v4.1", "--tp", "2", "--split", "14,14,13"], "split"),
    (["plan", "--model", "v4-flash", "--tp", "2", "--pp", "3", "--split", "14,14,12"], "split"),
    (["plan", "--model", "v4.1", "--tp", "3", "--pp", "2"], "tp"),
    (["plan", "--model", "v4.1", "--tp", "2,4", "--split", "14,26", "--gpus", "8"], "gpus"),
    (["plan", "--model", "v4.1", "--config", "/nonexistent/config.json"], "config"),
    (["layers", "--model", "v4-pro", "--attn-dtype", "int3"], "attn_dtype"),
    (["plan", "--model", "v4.1", "--tp", "2", "--pp", "3", "--sm-count", "0"], "sm_count"),
    (["plan", "--model", "v4.1", "--tp", "2", "--pp", "3", "--decode-variant", "sm70"],
     "decode_variant"),
])
def test_cli_bad_input(cli, capsys, argv, field):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kv_planner: error: {field}:")


def test_cli_plan_json(cli, capsys):
    assert cli.main(["plan", "--model", "v4.1", "--tp", "2", "--split", "14,14,12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["topology"]["split"] == [14, 14, 12] and len(out["stages"]) == 3
    assert any("ILLUSTRATIVE" in a for a in out["assumptions"])
    # the tree's defaults: 64-token pages, the fp8 index-K cache, vLLM's decode limits
    assert out["topology"]["paging"] == "ampere" and out["cache_format"].endswith("indexer fp8")
    assert (out["topology"]["max_num_seqs"], out["topology"]["max_capture_size"]) == (256, 512)
    st = out["stages"][1]["reserved"]
    assert st["decode_workspace"] > 0 and st["combined_lists"] > 0
    assert st["workspace"] == max(st[k] for k in ("prefill_gather", "indexer_k_gather",
                                                  "decode_workspace", "indexer_decode_logits"))
    # the reservations follow the decode limits: eager and 8 sequences shrink the scratch
    assert cli.main(["plan", "--model", "v4.1", "--tp", "2", "--split", "14,14,12", "--json",
                     "--max-capture-size", "0", "--max-num-seqs", "8"]) == 0
    small = json.loads(capsys.readouterr().out)["stages"][1]["reserved"]
    assert small["decode_workspace"] < st["decode_workspace"] / 20


def test_cli_text_commands(cli, capsys):
    assert cli.main(["published"]) == 0
    assert "90,060,095,488 B = 83.9 GiB" in capsys.readouterr().out
    assert cli.main(["layers", "--model", "v4-pro"]) == 0
    assert "320.125 MiB" in capsys.readouterr().out
    assert cli.main(["plan", "--model", "v4.1", "--tp", "2", "--split", "14,14,12"]) == 0
    text = capsys.readouterr().out
    assert "| decode scratch | decode logits | workspace (max) |" in text
    assert "the decode scratch at up to 512 decode tokens" in text
    assert cli.main(["compare", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reference_applies"] and out["reference_gap"]["reference_tokens"] == 4_648_480


def test_cli_entry_point_exit_code_and_no_torch():
    """The real script: exit status 2 on bad input, and the planner loads without torch."""
    r = subprocess.run([sys.executable, str(REPO / "tools" / "kv_planner.py"), "plan", "--model", "v9"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "error: model:" in r.stderr and not r.stdout
    code = ("import runpy, sys; sys.argv = ['x', 'published', '--json']; "
            f"runpy.run_path({str(REPO / 'tools' / 'kv_planner.py')!r}, run_name='not_main'); "
            "assert 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# ---- vLLM's packing (tools/kvplan/packing.py) ---------------------------------------------
def test_block_size_resolution():
    M = kvp.MultipleOf
    # The tree's V4.1 Ampere path (kv_page64): 64 (compressed KV), 64 (index K), 32x (SWA),
    # 1x (compressor): 64; the what-if with index K at 128: 128.
    assert kvp.resolve_block_size([[64], [64], [M(32)], [M(1)]]) == 64
    assert kvp.resolve_block_size([[64], [128], [M(32)], [M(1)]]) == 128
    assert kvp.resolve_block_size([[256], [256], [M(32)], [M(1)]]) == 256
    assert kvp.resolve_block_size([[M(16)], [M(1)]]) == 16  # every backend takes the default
    assert kvp.resolve_block_size([[96], [M(64)]]) == 192


def test_approximate_gcd_pads_least_and_prefers_larger():
    assert kvp.approximate_gcd([5, 2, 2, 2], 2) == 2      # v4-long: pad 1
    assert kvp.approximate_gcd([7, 1, 1], 1) == 1         # v41-long: every SWA layer alone
    assert kvp.approximate_gcd([6, 3], 3) == 3            # pad 0 at 3, ties go larger
    assert kvp.approximate_gcd([4, 4], 1) == 4


def _tput_specs(paging: str):
    model = kvp.resolve_model("v4.1", kvp.load_config(TPUT_CONFIG))
    return kvp.served_specs(kvp.build_stack(model, kvp.CacheFormat("fp8", "fp8")), "v41",
                            kvp.PAGINGS[paging])


def test_stride_alignment_of_split_kernel_pages():
    block, specs = _tput_specs("ampere-64-idx128")
    assert block == 128
    by = {s.name: s for s in specs}
    # 64-token kernel pages inside a 128-token block: the 64-token page (32 or 64 states of
    # 584 B, padded to 576 B multiples); the indexer's 128-token page is the block itself.
    assert by["2.c2.kv"].stride_alignment == 19008 and by["8.c1.kv"].stride_alignment == 37440
    assert by["2.c2.indexer"].stride_alignment == 1 and by["0.swa"].stride_alignment == 1
    for paging in ("ampere", "upstream-sm90"):  # kernel page = block: no stride alignment
        block, specs = _tput_specs(paging)
        assert block == 64 and all(s.stride_alignment == 1 for s in specs)


@pytest.mark.parametrize("paging,groups,block_bytes", [
    ("ampere-128", [(32, 6, 114048), (32, 6, 114048), (128, 6, 184320), (8, 2, 65536)], 184320),
    ("ampere-64-idx128", [(32, 6, 114048), (32, 6, 114048), (128, 6, 184320), (8, 2, 65536)],
     1235520),
    ("ampere", [(32, 4, 76032)] * 3 + [(64, 6, 93312), (8, 2, 65536)], 93312),
    ("upstream-sm90", [(32, 4, 76032)] * 3 + [(64, 6, 93312), (8, 2, 65536)], 93312),
])
def test_tput_packing(paging, groups, block_bytes):
    """v41-tput's groups as vLLM logs them at bdbe637: (32, 32, 128, 8) for the A100-faithful
    engine (128-token pages), (32, 32, 32, 64, 8) for upstream's SM90 path, which the tree's
    64-token pages reproduce. The pool block is the widest group's page (the full group);
    the narrower groups' blocks are padded to it."""
    packing = kvp.pack(_tput_specs(paging)[1])
    assert [(g.block_size, len(g.specs), g.page_bytes()) for g in packing.groups] == groups
    assert packing.bytes_per_block() == block_bytes


# ---- predict: the bdbe637 H200 figures (v41-tput, eager, chunk 8,192, utilization 0.80) -----
BDBE637_AMPERE = (101.55, 60_444_651)      # GiB vLLM had for KV, tokens it reported
BDBE637_UPSTREAM = (100.24, 67_434_907)


def _predict(paging, gib, length=1_048_320, reported=None):
    return kvp.predict(kvp.load_config(TPUT_CONFIG), gib, paging, length, 8192, reported=reported)


def test_predict_upstream_sm90_bdbe637():
    gib, reported = BDBE637_UPSTREAM
    pr = _predict(kvp.paging_for("upstream-sm90"), gib, reported=reported)
    assert [g["block_size"] for g in pr.groups] == [32, 32, 32, 64, 8]
    assert abs(pr.error) < 0.01
    assert abs(pr.error) < 1e-4  # 100.24 is rounded to 0.005 GiB: 5e-5 of it


def test_predict_ampere_128_bdbe637():
    """The A100-faithful engine's figure is reproduced at max_model_len 524,288, not at the
    1,048,320 that reproduces upstream's: at one max_model_len the two layouts differ by 1.6%
    per GiB, not 12% (the 1,034 sliding-window blocks a request reserves, at 16,384 in-flight
    tokens, weigh more at 512K)."""
    gib, reported = BDBE637_AMPERE
    paging = kvp.paging_for("ampere", 128)
    assert paging.name == "ampere-128"
    at_512k = _predict(paging, gib, 524_288, reported)
    assert [g["block_size"] for g in at_512k.groups] == [32, 32, 128, 8]
    assert abs(at_512k.error) < 0.01 and abs(at_512k.error) < 1e-4
    at_1m = _predict(paging, gib, reported=reported)
    assert 0.10 < at_1m.error < 0.12
    upstream = _predict(kvp.paging_for("upstream-sm90"), gib)
    assert 0.01 < upstream.tokens / at_1m.tokens - 1 < 0.02


def test_predict_trees_ampere_paging_and_the_what_if():
    gib = BDBE637_AMPERE[0]
    now = _predict(kvp.paging_for("ampere"), gib)       # kv_page64 as the tree has it
    assert now.paging == "ampere" and now.block_size == 64
    assert kvp.paging_for("ampere") is kvp.PAGINGS["ampere"]
    assert (kvp.PAGINGS["ampere"].v41_kv_page, kvp.PAGINGS["ampere"].v41_indexer_page) == (64, 64)
    assert kvp.paging_for("ampere", 64, 64) is kvp.PAGINGS["ampere"]
    upstream = _predict(kvp.paging_for("upstream-sm90"), gib)
    assert now.groups == upstream.groups and now.tokens == upstream.tokens
    assert now.bytes_per_block == now.widest_group_bytes == 93_312
    assert not any("LCM" in n for n in now.notes)
    half = _predict(kvp.paging_for("ampere", 64, 128), gib)  # the compressed page alone
    assert half.paging == "ampere-64-idx128" and half.block_size == 128
    assert half.bytes_per_block == 1_235_520 and half.widest_group_bytes == 184_320
    assert any("LCM" in n for n in half.notes)
    assert half.tokens < 0.15 * now.tokens
    old = _predict(kvp.paging_for("ampere", 128), gib)  # DEEPINFER_KV_PAGE64=0
    assert old.paging == "ampere-128" and now.tokens > old.tokens


def test_predict_input_errors():
    with pytest.raises(kvp.PlannerInputError) as e:
        kvp.paging_for("sm70")
    assert e.value.field == "path"
    with pytest.raises(kvp.PlannerInputError) as e:
        kvp.paging_for("ampere", 100)
    assert e.value.field == "page"
    with pytest.raises(kvp.PlannerInputError) as e:
        kvp.paging_for("upstream-sm90", 128)
    assert e.value.field == "page"
    with pytest.raises(kvp.PlannerInputError) as e:
        _predict(kvp.paging_for("ampere"), 0)
    assert e.value.field == "kv_gib"
    with pytest.raises(kvp.PlannerInputError) as e:
        kvp.predict({"model_type": "llama"}, 1.0, kvp.paging_for("ampere"), 1024, 1024)
    assert e.value.field == "config"


def test_cli_predict(cli, capsys):
    argv = ["predict", "--config", str(TPUT_CONFIG), "--kv-gib", "100.24", "--path",
            "upstream-sm90", "--reported", "67434907"]
    assert cli.main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 67_432_371 and abs(out["error"]) < 1e-4
    assert [g["block_size"] for g in out["groups"]] == [32, 32, 32, 64, 8]
    assert cli.main(argv) == 0
    assert "predicted GPU KV cache size: 67,432,371 tokens" in capsys.readouterr().out
    assert cli.main(["predict", "--config", str(TPUT_CONFIG), "--kv-gib", "1", "--path",
                     "ampere", "--page", "48"]) == 2
    assert capsys.readouterr().err.startswith("kv_planner: error: page:")
    # --path ampere without pages: the tree's, which lay the caches out as upstream's SM90
    assert cli.main(["predict", "--config", str(TPUT_CONFIG), "--kv-gib", "100.24", "--json"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["paging"] == "ampere" and tree["block_size"] == 64
    assert tree["tokens"] == 67_432_371


# ---- what the Ampere path reserves (tools/kvplan/workspace.py) -----------------------------
# (tests/test_kv_planner_reserve.py checks these terms against overlay reserve.py's own
# functions, with torch)
def _tput_stack():
    model = kvp.resolve_model("v4.1", kvp.load_config(TPUT_CONFIG))
    return model, kvp.build_stack(model, kvp.CacheFormat("fp8", "fp8"))


def _serving(**kw):
    return kvp.Serving(**{"heads": 64, "index_topk": 512, **kw})


def test_prefill_gather_is_the_ampere_request():
    # [4, ceil(L / ratio) + window + chunk, 512] bf16 (attention/common.py)
    assert kvp.prefill_gather_bytes(1, 128, M, 8192) == 4 * (M + 128 + 8192) * 1024
    assert round(kvp.prefill_gather_bytes(1, 128, M, 8192) / GiB, 2) == 4.03
    assert kvp.prefill_gather_bytes(2, 128, M, 8192) == 4 * (M // 2 + 128 + 8192) * 1024
    assert kvp.prefill_gather_bytes(0, 128, M, 8192) == 4 * (128 + 8192) * 1024


def test_serving_limits():
    """T = min(B, max(S (1 + k), G)), R = max(T, min(S, T) (1 + k)) (reserve.Limits)."""
    srv = _serving()
    assert srv.decode_tokens(8192) == 512 and srv.indexer_decode_rows(8192) == 512
    assert _serving(max_num_seqs=4, max_capture_size=0).decode_tokens(8192) == 4
    assert _serving(max_num_seqs=4096).decode_tokens(2048) == 2048          # the step's budget
    spec = _serving(max_num_seqs=300, num_speculative_tokens=2)
    assert spec.decode_tokens(8192) == 900 and spec.indexer_decode_rows(8192) == 900
    short = _serving(max_num_seqs=300, num_speculative_tokens=2, max_capture_size=0)
    assert short.decode_tokens(600) == 600 and short.indexer_decode_rows(600) == 900


def test_decode_scratch_terms():
    """Two-phase rows from 4 tokens, split-K partials while the grid is under one wave."""
    keys = 128 + 512
    # one token x 32 heads (two 16-head tiles): 2 x 2 = 4 programs of 216 slots; 40 key
    # tiles, split 40 ways: output 32 KiB, partials 2 x 5 KiB + 40 x 32 x 2 KiB
    one = kvp.decode_scratch_bytes(1, 32, keys)
    assert one == 32 * 1024 + 2 * 40 * 32 * 4 + 40 * 32 * 2048
    assert kvp.decode_splits(1, 32, keys, kvp.DECODE_TILES["sm80"][0], 108) == 40
    # 512 tokens fill the 432 two-phase slots: no split; output + bf16 rows + validity
    t = 512
    assert kvp.decode_scratch_bytes(t, 32, keys) == t * 32 * 1024 + t * keys * 1024 + t * keys
    assert kvp.decode_scratch_worst(t, 32, keys) == (t * 32 * 1024 + t * keys * 1025, t)
    single = kvp.decode_scratch_bytes(t, 32, keys, predequant=False)
    assert single == t * 32 * 1024
    with pytest.raises(kvp.PlannerInputError) as e:
        kvp.decode_scratch_bytes(4, 32, keys, variant="sm90")
    assert e.value.field == "variant"


def test_ampere_reserved_bytes_terms():
    _, stack = _tput_stack()
    srv = _serving()
    r = kvp.ampere_reserved_bytes(stack, M, 8192, srv)
    assert r["prefill_gather"] == kvp.prefill_gather_bytes(1, 128, M, 8192)
    # upstream's indexer gather: L x 8 x factor 2 rows of 128 + 4 B, and the radix's 1 MiB
    rows = M * 8 * 2
    assert r["indexer_k_gather"] == rows * 128 + rows * 4 + MiB
    # decode: 512 tokens x (128 + 512) keys, 64 heads; logits: 512 rows x L fp32 + 1 MiB
    assert r["decode_workspace"] == 512 * 64 * 1024 + 512 * 640 * 1025
    assert r["indexer_decode_logits"] == MiB + 512 * M * 4
    assert r["workspace"] == max(r["prefill_gather"], r["indexer_k_gather"],
                                 r["decode_workspace"], r["indexer_decode_logits"])
    assert r["workspace"] == r["prefill_gather"]  # shared: the largest request, not the sum
    assert r["yoco_gather_buffer"] == kvp.GATHER_BUFFER_MAX_BYTES
    assert r["yoco_indexer_k"] == kvp.INDEXER_K_MAX_ROWS * 132
    # combined lists: "shared" widths 128 (sliding-window layers) and 640 (top-k + window),
    # 8,192 rows of int32 each plus their lengths; outside the workspace, so they add
    assert r["combined_lists"] == 8192 * (128 + 640) * 4 + 2 * 8192 * 4
    assert r["total"] == (r["workspace"] + r["yoco_gather_buffer"] + r["yoco_indexer_k"]
                          + kvp.INDEXER_LOGITS_BYTES + r["combined_lists"])
    off = kvp.ampere_reserved_bytes(stack, M, 8192, srv, yoco=False)
    assert off["yoco_gather_buffer"] == off["yoco_indexer_k"] == 0
    assert off["combined_lists"] == r["combined_lists"]  # the same widths, kind "own"
    up = kvp.ampere_reserved_bytes(stack, M, 8192, srv, ampere=False)
    assert up["decode_workspace"] == up["indexer_decode_logits"] == up["combined_lists"] == 0
    assert up["total"] == r["workspace"] + kvp.INDEXER_LOGITS_BYTES
    swa_only = [x for x in stack if x.ratio == 0]
    got = kvp.ampere_reserved_bytes(swa_only, M, 8192, srv)
    # no compressed rows to gather: the decode's 512 x 128 two-phase rows are the largest
    assert got["decode_workspace"] == 512 * 64 * 1024 + 512 * 128 * 1025
    assert got["workspace"] == got["decode_workspace"] > kvp.prefill_gather_bytes(0, 128, M, 8192)
    assert got["total"] == got["decode_workspace"] + 8192 * 129 * 4


def test_non_owning_index_sources_reserve_an_indexer():
    """v41-tput's layer 10 is an index source reading layer 8's index-K cache: a GPU running
    it reserves the indexer's requests; layers 9 and 11 run none."""
    _, stack = _tput_stack()
    assert stack[10].indexer_record == 132 and not stack[10].owns_context_cache()
    assert stack[9].indexer_record == stack[11].indexer_record == 0
    srv = _serving()
    with_10 = kvp.ampere_reserved_bytes(stack[9:12], M, 8192, srv)
    without = kvp.ampere_reserved_bytes([stack[9], stack[11]], M, 8192, srv)
    assert with_10["indexer_decode_logits"] == MiB + 512 * M * 4
    assert with_10["indexer_logits_transient"] == kvp.INDEXER_LOGITS_BYTES
    assert without["indexer_decode_logits"] == without["indexer_k_gather"] == 0
    assert without["indexer_logits_transient"] == 0


def test_plan_reserves_the_ampere_workspace(v41):
    topo = _tp2pp3()
    p = kvp.plan(v41, topo)
    layers = kvp.build_stack(v41, kvp.SERVED_AMPERE_FORMAT)
    held, _ = kvp.stage_caches(layers, range(14, 28))  # holds the ratio-1 source, layer 20
    srv = kvp.serving_for(v41, topo, 2)
    assert (srv.heads, srv.index_topk, srv.max_num_seqs, srv.max_capture_size) == (32, 512, 256, 512)
    want = kvp.ampere_reserved_bytes(held, M, kvp.DEFAULT_MAX_NUM_BATCHED_TOKENS, srv)
    assert want["workspace"] == want["prefill_gather"] > 4 * GiB
    assert 0 < want["decode_workspace"] < want["indexer_decode_logits"] < want["workspace"]
    assert p.stages[1].reserve_gib * GiB == pytest.approx(2 * GiB + want["total"])
    assert p.stages[1].reserved == {k: v for k, v in want.items() if k != "total"}
