"""Speculative drafts in tools/make_checkpoint.py checkpoints (--spec, tools/ckptgen/spec.py):
DeepSeek-V4 MTP and DeepSeek-V4.1 / V4 DSpark, checked two ways on CPU.

(a) The tensor table and config keys: exact counts derived by hand, the names the draft
    classes load (with the format rules of the target's tables), the config keys --spec adds
    and keeps, the e2e configs equal to their base plus those keys, the refusals, and the
    scales of the drawn values.
(b) vLLM 0.33.0's own classes load the written checkpoints (reduced sizes) through their real
    ``load_weights`` in tests/ckpt_spec_probe.py (a subprocess on the patched tree, like
    tests/checkpoint_load_probe.py): vLLM's SpeculativeConfig picks the draft class from
    the checkpoint folder; every draft parameter but the embedding and head it shares with
    the target is loaded, every mtp.* tensor reaches the draft and no other, the target
    loads the same files as before (skipping mtp.*), the draft's layers are our Ampere
    attention classes, SWA-only; V4.1's method="mtp" is refused by vLLM.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import make_checkpoint as mk
import subproc
from _common import ToolError
from ckptgen import spec as ckspec

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "benchmarks" / "e2e" / "configs"
PROBE = Path(__file__).with_name("ckpt_spec_probe.py")
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))


def _table(config: str, fmt: str, overrides=None, spec=None):
    cfg = mk.load_config(CONFIGS / config, overrides)
    mk.apply_spec(cfg, spec)
    return cfg, {n: (tuple(s), d) for n, s, d in mk.checkpoint_table(cfg, fmt)}


# --------------------------------------------------------------------------- (a) tables
# A draft decoder block is a target layer of the SWA-only kind: 2 norms + 6 mHC + 8
# attention (sink, wq_a, wkv, q_norm, wq_b, kv_norm, wo_a, wo_b) + MoE (gate, gate.bias,
# 8 x 3 experts, 3 shared) = 45 tensors, 32 of them quantized (wq_a, wkv, wq_b, wo_a, wo_b,
# 3 shared, 24 experts), so 32 scales under fp8/mxfp8.
BLOCK, BLOCK_Q = 45, 32
# V4 MTP: one block + e_proj, h_proj, enorm, hnorm, norm, hc_head fn/base/scale (8); e_proj
# and h_proj are quantized.
MTP_BF16 = BLOCK + 8
MTP_Q = MTP_BF16 + BLOCK_Q + 2
# DSpark, 3 stages: main_proj, main_norm + 3 blocks + the last stage's norm, Markov embed
# and head, confidence head (4); main_proj is quantized. V4 adds its hc_head (3).
DSPARK_V41_BF16 = 2 + 3 * BLOCK + 4
DSPARK_V41_Q = DSPARK_V41_BF16 + 3 * BLOCK_Q + 1
DSPARK_V4_BF16 = DSPARK_V41_BF16 + 3
DSPARK_V4_Q = DSPARK_V4_BF16 + 3 * BLOCK_Q + 1


@pytest.mark.parametrize("config,fmt,count", [
    ("v4-mtp-mini", "bf16", MTP_BF16), ("v4-mtp-mini", "fp8", MTP_Q),
    ("v41-dspark-mini", "bf16", DSPARK_V41_BF16), ("v41-dspark-mini", "mxfp8", DSPARK_V41_Q),
    ("v41-dspark-mini", "fp8", DSPARK_V41_Q),
    ("v4-dspark-mini", "bf16", DSPARK_V4_BF16), ("v4-dspark-mini", "fp8", DSPARK_V4_Q)])
def test_draft_tensor_counts(config, fmt, count):
    base = config.split("-")[0] + "-mini"
    _, t = _table(config, fmt)
    _, target = _table(base, fmt)
    draft = {n: v for n, v in t.items() if n.startswith("mtp.")}
    assert len(draft) == count
    # The target's tensors are unchanged by the draft.
    assert {n: v for n, v in t.items() if not n.startswith("mtp.")} == target


def test_draft_names_and_dtypes():
    _, t = _table("v4-mtp-mini", "fp8")
    H = 1024
    assert t["mtp.0.e_proj.weight"] == ((H, H), torch.float8_e4m3fn)
    assert t["mtp.0.e_proj.scale"] == ((H // 128, H // 128), torch.float8_e8m0fnu)
    assert t["mtp.0.hc_head_fn"] == ((4, 4 * H), torch.float32)
    assert t["mtp.0.norm.weight"] == ((H,), torch.bfloat16)
    # SWA only: no compressor or indexer in the block; no embedding or head of its own.
    assert not [n for n in t if n.startswith("mtp.0.") and (".compressor." in n or ".indexer."
                                                          in n or "emb" in n or "head.w" in n)]
    _, t = _table("v41-dspark-mini", "mxfp8")
    V, r = 129280, 256
    assert t["mtp.0.main_proj.weight"] == ((H, 3 * H), torch.float8_e4m3fn)
    assert t["mtp.0.main_proj.scale"] == ((H // 32, 3 * H // 32), torch.float8_e8m0fnu)
    assert t["mtp.2.markov_head.embed.weight"] == ((V, r), torch.bfloat16)
    assert t["mtp.2.markov_head.head.weight"] == ((V, r), torch.bfloat16)
    assert t["mtp.2.confidence_head.proj.weight"] == ((1, H + r), torch.float32)
    assert "mtp.2.norm.weight" in t and "mtp.0.norm.weight" not in t
    assert not [n for n in t if "hc_head" in n]  # V4.1 collapses with the pre-mix
    for i in range(3):
        assert f"mtp.{i}.attn.wkv.weight" in t and f"mtp.{i}.ffn.gate.bias" in t
        assert not [n for n in t if n.startswith(f"mtp.{i}.attn.") and (
            ".compressor." in n or ".indexer." in n)]
    _, t = _table("v4-dspark-mini", "fp8")
    assert t["mtp.2.markov_head.markov_w1.weight"] == ((V, r), torch.bfloat16)
    assert t["mtp.2.markov_head.markov_w2.weight"] == ((V, r), torch.bfloat16)
    assert t["mtp.2.hc_head_base"] == ((4,), torch.float32)


def test_spec_option_adds_the_keys_and_keeps_set_ones():
    cfg = mk.load_config(CONFIGS / "v41-mini", {"n_mtp_layers": 2})
    assert ckspec.spec_method(cfg) is None and ckspec.spec_tensor_specs(cfg) == []
    mk.apply_spec(cfg, "dspark")
    assert ckspec.spec_method(cfg) == "dspark"
    assert {k: cfg.get(k) for k in ckspec.DSPARK_KEYS} == {
        "dspark_target_layer_ids": [2, 5, 8], "dspark_markov_rank": 256,
        "dspark_noise_token_id": 2, "dspark_block_size": 5, "n_mtp_layers": 2}
    assert mk.output_config(cfg, "mxfp8")["text_config"]["dspark_block_size"] == 5
    cfg = mk.load_config(CONFIGS / "v4-mini")
    assert cfg.get("num_nextn_predict_layers") == 0
    mk.apply_spec(cfg, "mtp")
    assert cfg.get("num_nextn_predict_layers") == 1 and ckspec.spec_method(cfg) == "mtp"
    # The model conventions of the target-layer ids: V4.1 reads layer inputs (ids 1..L),
    # V4 layer outputs (ids 0..L-1); both spread over the model.
    assert ckspec.default_target_layers("deepseek_v41", 10) == [2, 5, 8]
    assert ckspec.default_target_layers("deepseek_v4", 6) == [1, 2, 3]
    assert ckspec.default_target_layers("deepseek_v41", 40) == [10, 20, 30]


@pytest.mark.parametrize("config,base,spec", [("v41-dspark-mini", "v41-mini", "dspark"),
                                              ("v4-mtp-mini", "v4-mini", "mtp"),
                                              ("v4-dspark-mini", "v4-mini", "dspark")])
def test_e2e_configs_are_their_base_plus_the_spec_keys(config, base, spec):
    got = mk.load_config(CONFIGS / config)
    want = mk.load_config(CONFIGS / base)
    mk.apply_spec(want, spec)
    assert got.raw == want.raw
    import e2e_models
    assert e2e_models.MODELS[config] == (config, e2e_models.MODELS[base][1])
    method, k = e2e_models.SPEC_MODELS[config]
    assert method == spec and k == (got.get("dspark_block_size") if spec == "dspark" else 1)
    # No model name begins with another's name and "-" (e2e.py's _split_tag).
    names = list(e2e_models.MODELS)
    assert not [(a, b) for a in names for b in names if a != b and a.startswith(b + "-")]


@pytest.mark.parametrize("config,spec,overrides,match", [
    ("v41-mini", "mtp", {}, "V4.1 checkpoints carry DSpark"),
    ("v41-mini", None, {"num_nextn_predict_layers": 1}, "no classic MTP"),
    ("v4-mini", "dspark", {"num_nextn_predict_layers": 1}, "both name their tensors mtp"),
    ("v41-mini", "dspark", {"dspark_target_layer_ids": [0, 5]}, r"within \[1, 10\]"),
    ("v4-mini", "dspark", {"dspark_target_layer_ids": [1, 6]}, r"within \[0, 5\]"),
    ("v4-mini", "dspark", {"dspark_target_layer_ids": [3, 1]}, "increasing"),
    ("v41-mini", "dspark", {"dspark_noise_token_id": 129280}, "outside the vocabulary"),
    ("v41-mini", "dspark", {"dspark_markov_rank": 0}, "dspark_markov_rank must be"),
    ("v41-mini", "dspark", {"draft_vocab_size": 4096}, "full-vocabulary"),
    ("v41-mini", "dspark", {"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1]},
     "SWA-only"),
])
def test_spec_config_errors(config, spec, overrides, match):
    with pytest.raises(ToolError, match=match):
        cfg = mk.load_config(CONFIGS / config, overrides)
        mk.apply_spec(cfg, spec)
        mk.checkpoint_table(cfg, "bf16")


def test_dspark_without_all_keys_is_refused():
    cfg = mk.load_config(CONFIGS / "v41-mini", {"dspark_target_layer_ids": [2, 5]})
    with pytest.raises(ToolError, match="DSpark needs dspark_markov_rank"):
        mk.checkpoint_table(cfg, "bf16")


def test_cli_spec_option(capsys):
    assert mk.main([str(CONFIGS / "v4-mini"), "--spec", "mtp", "--list"]) == 0
    names = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    assert len([n for n in names if n.startswith("mtp.")]) == MTP_BF16
    assert mk.main([str(CONFIGS / "v4-mini"), "--list"]) == 0
    assert not [n for n in capsys.readouterr().out.splitlines() if n.startswith("mtp.")]


def test_draft_value_scales():
    """The drafts' values follow the target's inits: linears N(0, 1/fan_in), norms near 1,
    and a Markov bias (head @ embed[token]) of std ~1 on the draft logits."""
    cfg = mk.load_config(CONFIGS / "v41-dspark-mini", {"vocab_size": 4096})
    specs = {s.name: s for s in mk.tensor_specs(cfg)}
    main = mk.draw(specs["mtp.0.main_proj.weight"], 0).float()
    assert abs(main.std().item() * math.sqrt(main.shape[1]) - 1) < 0.02
    norm = mk.draw(specs["mtp.2.norm.weight"], 0).float()
    assert abs(norm.mean().item() - 1) < 0.01 and norm.std().item() < 0.1
    emb = mk.draw(specs["mtp.2.markov_head.embed.weight"], 0).float()
    head = mk.draw(specs["mtp.2.markov_head.head.weight"], 0).float()
    bias = emb[:64] @ head.T
    assert 0.9 < bias.std().item() < 1.1
    # Drawn by name: the same tensor in the MTP-less target has the same values.
    assert torch.equal(mk.draw(specs["mtp.0.attn.wq_a.weight"], 0),
                       mk.draw(specs["mtp.0.attn.wq_a.weight"], 0))


# --------------------------------------------------------------------------- (b) vLLM probe
@pytest.fixture(scope="module")
def probe():
    """One probe run per test session, shared by the xdist workers."""
    from test_vllm_import import _need_tree, _probe_env
    _need_tree()
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    d = Path(tempfile.gettempdir()) / f"deepinfer-ckpt-spec-probe-{run}"
    d.mkdir(exist_ok=True)
    out = d / "result.json"
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            work = d / "work"
            r = subproc.run([sys.executable, str(PROBE), str(work)], env=_probe_env(),
                            cwd=REPO, cap=600)
            shutil.rmtree(work, ignore_errors=True)
            lines = r.stdout.strip().splitlines()
            if r.returncode != 0 or not lines:
                pytest.fail(f"spec checkpoint probe failed (rc {r.returncode}):\n"
                            f"{r.stderr[-4000:]}")
            out.write_text(lines[-1])
    res = json.loads(out.read_text())
    if not res["_setup"]["ok"]:
        pytest.fail(f"probe setup: {res['_setup']['error']}\n{res['_setup'].get('trace')}")
    return res


CASES = [("v4-mtp-mini", "fp8"), ("v41-dspark-mini", "mxfp8"), ("v41-dspark-mini", "bf16"),
         ("v4-dspark-mini", "fp8")]


def _case(probe, config, fmt) -> dict:
    r = probe[f"{config}/{fmt}"]
    assert r["ok"], f"{config}/{fmt}: {r['error']}\n{r.get('trace', '')}"
    return r


def _overrides(probe, config: str) -> dict:
    return {**probe["_small"], **(probe["_extra"] if "dspark" in config else {})}


@pytest.mark.parametrize("config,fmt", CASES)
def test_vllm_picks_the_draft_class(probe, config, fmt):
    r = _case(probe, config, fmt)
    v41 = config.startswith("v41")
    mtp = "mtp" in config
    assert r["spec"] == {
        "method": "mtp" if mtp else "dspark", "k": 1 if mtp else 5,
        "draft_architectures": ["DeepSeekV4MTPModel" if mtp else
                                "DSparkV41DraftModel" if v41 else "DSparkDraftModel"],
        "draft_model_type": "deepseek_mtp" if mtp else "deepseek_v41" if v41 else "deepseek_v4",
        "use_dspark": not mtp}
    want = ("vllm.models.deepseek_v4.nvidia.mtp.DeepSeekV4MTP" if mtp else
            "vllm.models.deepseek_v41.nvidia.dspark.DSparkDeepseekV4ForCausalLM" if v41 else
            "vllm.models.deepseek_v4.nvidia.dspark.DSparkDeepseekV4ForCausalLM")
    assert r["draft"]["model_class"] == want
    # The keys vLLM read are those written to config.json.
    assert r["config_on_disk"] == r["written_config"]


@pytest.mark.parametrize("config,fmt", CASES)
def test_vllm_draft_loads_every_parameter(probe, config, fmt):
    r = _case(probe, config, fmt)
    d = r["draft"]
    cfg, table = _table(config, fmt, _overrides(probe, config))
    L = cfg.need("num_hidden_layers")
    # Only what the draft shares with the target stays unloaded (vLLM's loaders alias it).
    shared = (["model.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight"]
              if "mtp" in config else ["lm_head.weight", "model.embed_tokens.weight"])
    assert d["params_not_loaded"] == sorted(shared)
    # Every mtp.* tensor reached a draft parameter, every other one (the target's) none.
    assert d["num_tensors"] == len(table) == d["distinct_tensor_addresses"]
    assert d["tensors_not_received"] == sorted(n for n in table if not n.startswith("mtp."))
    # The draft's layers are this project's Ampere attention, SWA-only (V4.1 ratio 0, V4 1).
    v41 = config.startswith("v41")
    cls, ratio = ("DeepinferAmpereV41Attention", 0) if v41 else ("DeepinferAmpereV4Attention", 1)
    n_layers = 1 if "mtp" in config else cfg.need("n_mtp_layers")
    assert sorted(d["attention"].values()) == [[cls, ratio]] * n_layers


@pytest.mark.parametrize("config,fmt", CASES)
def test_vllm_draft_values_are_the_source(probe, config, fmt):
    v = _case(probe, config, fmt)["draft"]["values"]
    assert v["dense_equal"] and all(v["dense_equal"].values()), v["dense_equal"]
    if fmt == "bf16":
        assert v["linear_equal"] is True
    else:
        assert 0 < v["linear_excess"] <= 1, v["linear_excess"]
    if "dspark" in config:
        assert v["confidence_head_kept"] is True  # dropped when its weight is absent
    if config == "v4-dspark-mini":
        assert v["context_wkv_equal"] is True


@pytest.mark.parametrize("config,fmt", [c for c in CASES if c[1] != "bf16"])
def test_vllm_target_loads_the_spec_checkpoint(probe, config, fmt):
    """The target model loads the same files as without a draft; its mapper drops mtp.*."""
    t = _case(probe, config, fmt)["target"]
    _, table = _table(config, fmt, _overrides(probe, config))
    assert t["params_not_loaded"] == []
    assert t["tensors_not_received"] == sorted(n for n in table if n.startswith("mtp."))


def test_vllm_refuses_mtp_for_v41(probe):
    r = probe["v41/mtp"]
    assert r["ok"], r.get("error")
    assert r["refused"] is True
    assert "DeepSeek V4.1 has no classic-MTP draft" in r["message"]
    assert "Use speculative method 'dspark' instead of 'mtp'" in r["message"]
