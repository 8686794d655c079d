"""KV-cache capacity / topology planner: the published DeepSeek-V4 arithmetic, the per-type
page facts taken from vLLM 0.33.0, the V4.1 YOCO accounting, the 6-GPU plans and the CLI's
input errors. Pure arithmetic: no GPU, no torch in the planner, runs in well under a second.
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvplan as kvp  # tools/kvplan/, the planner library (tools/ is on sys.path: conftest)

REPO = Path(__file__).resolve().parent.parent
V41_CONFIG = REPO / "tools" / "configs" / "deepseek-v4.1-illustrative.json"
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
    assert pages["c1.kv"].page_bytes == 149760
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
    p = kvp.plan(v41, _tp2pp3())
    assert p.fits and p.bottleneck().stage == 1  # layers 14-27 hold sources 14 and 20
    assert p.stages[2].replicated_sources == (20,)
    assert any("NotImplementedError" in w for w in p.warnings)
    gap = kvp.reference_gap(p)
    assert 0.9 < gap.ratio < 1.2  # within ~10% of the 4,648,480 reference
    assert p.assumptions


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


def test_cli_text_commands(cli, capsys):
    assert cli.main(["published"]) == 0
    assert "90,060,095,488 B = 83.9 GiB" in capsys.readouterr().out
    assert cli.main(["layers", "--model", "v4-pro"]) == 0
    assert "320.125 MiB" in capsys.readouterr().out
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
