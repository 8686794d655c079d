"""tools/make_checkpoint.py: random-weight DeepSeek-V4.1 / V4 checkpoints in the published
layouts, checked three ways on CPU.

(a) The tensor table: exact tensor counts derived by hand from the layer roles of each
    config (docstrings below), the dtype/shape rules of every format, the names and
    shapes the Hugging Face transformers DeepseekV4 implementation expects of a
    published V4 checkpoint (its own rename table and model, built on the meta device),
    and the safetensors files the writer produced (header = table).
(b) vLLM 0.33.0's own model classes load the written checkpoints (reduced sizes, same
    topology) through their real ``load_weights`` in tests/checkpoint_load_probe.py
    (a subprocess with PYTHONPATH=build/patched, like tests/test_vllm_import.py): no
    parameter left unset, no written tensor dropped, the expected quant methods, the
    Engram tokenizer accepted, and vLLM's dequantization of loaded MXFP4/MXFP8 params
    within the format's rounding error of the bf16 source.
(c) Quantization round trips (fp8 blocks, MXFP4) against decoders written here from the
    format definitions, minimal power-of-two scales, idempotence, determinism.
"""
from __future__ import annotations

import fcntl
import importlib.util
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

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "benchmarks" / "e2e" / "configs"
PROBE = Path(__file__).with_name("checkpoint_load_probe.py")


# --------------------------------------------------------------------------- (a) tables
def table(config: str, fmt: str, overrides=None):
    return mk.checkpoint_table(mk.load_config(CONFIGS / config, overrides), fmt)


# v41-mini, layer by layer (config: ratios 0 0 2 2 2 2 1 1 1 1, kv sources 2 4 6,
# index sources 2 4 6 8, engram 1 4). Every layer: 2 norms + 6 mHC + 8 attention
# (sink, wq_a, wkv, q_norm, wq_b, kv_norm, wo_a, wo_b) + MoE (gate, gate.bias, 8 x 3
# experts, 3 shared) = 45. Ratio-2 kv sources 2, 4: compressor wkv, wgate, norm (3);
# ratio-1 kv source 6: wkv, norm (2). Index sources: wq_b, weights_proj (2), plus wk,
# k_norm (2) on kv sources. Engram layers: embed + scale, wkv, q_weight, k_weight (5).
# Top level: embed, norm, head, image_start/end/newline (6).
V41_BF16 = 10 * 45 + (3 + 3 + 2) + 4 * 2 + 3 * 2 + 2 * 5 + 6
# Quantized formats add one scale per quantized linear: per layer wq_a, wkv, wq_b,
# wo_a, wo_b, 3 shared, 24 experts (32); indexer wq_b (4 layers); engram wkv (2 layers).
V41_QUANT = V41_BF16 + 10 * 32 + 4 + 2
# v4-mini (ratios 0 4 128 4 128 4): 45 per layer; compressor (ape, wkv, wgate, norm) on
# the 5 compressed layers; C4A layers 1 3 5 add the indexer (wq_b, weights_proj and its
# own 4-tensor compressor = 6). Top: embed, norm, head, hc_head fn/base/scale (6).
V4_BF16 = 6 * 45 + 5 * 4 + 3 * 6 + 6
V4_QUANT = V4_BF16 + 6 * 32 + 3


@pytest.mark.parametrize("config,fmt,count", [
    ("v41-mini", "bf16", V41_BF16), ("v41-mini", "fp8", V41_QUANT),
    ("v41-mini", "mxfp8", V41_QUANT), ("v4-mini", "bf16", V4_BF16),
    ("v4-mini", "fp8", V4_QUANT)])
def test_tensor_counts(config, fmt, count):
    t = table(config, fmt)
    assert len(t) == count
    assert len({n for n, _, _ in t}) == count  # no duplicate names


def _roles_v41(config: str) -> dict[int, set[str]]:
    c = json.loads((CONFIGS / config / "config.json").read_text())["text_config"]
    kv, idx = set(c["kv_source_layer_ids"]), set(c["index_source_layer_ids"])
    roles = {}
    for i in range(c["num_hidden_layers"]):
        r = set()
        if i in kv:
            r.add(f"kv{c['compress_ratios'][i]}")
        if i in idx:
            r.add("idx")
        if i in c["engram_layer_ids"]:
            r.add("engram")
        roles[i] = r
    return roles


@pytest.mark.parametrize("config", ["v41-mini", "v41-tput"])
def test_v41_layer_names_follow_roles(config):
    """Per layer, the module-level names present are exactly those of its roles."""
    names = {n for n, _, _ in table(config, "bf16")}
    for i, roles in _roles_v41(config).items():
        p = f"layers.{i}."
        has = lambda s: (p + s) in names  # noqa: E731
        assert has("attn.wq_a.weight") and has("hc_ffn_fn") and has("ffn.gate.bias")
        assert has("attn.compressor.wkv.weight") == bool(roles & {"kv1", "kv2"}), i
        assert has("attn.compressor.wgate.weight") == ("kv2" in roles), i
        assert has("attn.indexer.wq_b.weight") == ("idx" in roles), i
        assert has("attn.indexer.wk.weight") == ("idx" in roles and bool(roles & {"kv1", "kv2"}))
        assert has("engram.embed.weight") == ("engram" in roles), i
        assert not has("attn.compressor.ape")  # V4.1's compressor has no position bias


def _quantized_kind(name: str) -> str | None:
    if ".experts." in name and ".shared_experts." not in name:
        return "expert"
    if name.endswith(".engram.embed.weight"):
        return "engram"
    if any(s in name for s in (".attn.wq_a.", ".attn.wkv.", ".attn.wq_b.", ".attn.wo_a.",
                               ".attn.wo_b.", ".indexer.wq_b.", ".shared_experts.",
                               ".engram.wkv.")):
        return "linear"
    return None


@pytest.mark.parametrize("config,fmt", [("v41-mini", "bf16"), ("v41-mini", "fp8"),
                                        ("v41-mini", "mxfp8"), ("v41-tput", "mxfp8"),
                                        ("v4-mini", "bf16"), ("v4-mini", "fp8")])
def test_dtype_and_scale_rules(config, fmt):
    """Quantized formats: every quantized linear is e4m3 with a UE8M0 scale per block
    (128x128 fp8, 32x32 mxfp8), experts are packed e2m1 with one scale per 32 inputs;
    everything else keeps its bf16-checkpoint dtype. Engram tables are e4m3 + per-32
    scales in every format."""
    t = {n: (s, d) for n, s, d in table(config, fmt)}
    bf = {n: (s, d) for n, s, d in table(config, "bf16")}
    block = {"fp8": 128, "mxfp8": 32}.get(fmt)
    for name, (shape, dtype) in t.items():
        if name.endswith(".scale"):
            w = name[:-6] + ".weight"
            assert dtype == torch.float8_e8m0fnu and w in t, name
            kind = _quantized_kind(w)
            n, k = bf[w][0]
            want = {"expert": (n, k // 32), "engram": (n, k // 32),
                    "linear": (n // (block or 1), k // (block or 1))}[kind]
            assert tuple(shape) == want, name
            continue
        kind = _quantized_kind(name) if name.endswith(".weight") else None
        if kind == "engram" or (fmt != "bf16" and kind == "linear"):
            assert dtype == torch.float8_e4m3fn and shape == bf[name][0], name
            assert name[:-7] + ".scale" in t
        elif fmt != "bf16" and kind == "expert":
            n, k = bf[name][0]
            assert dtype == torch.uint8 and tuple(shape) == (n, k // 2), name
        else:
            assert (shape, dtype) == bf[name], name
            assert not name.endswith(".weight") or name[:-7] + ".scale" not in t
    # the bf16 checkpoint: mHC, sinks, router bias, ape and image embeddings fp32, the
    # Engram table (its only layout) e4m3 + e8m0, the rest bf16
    for name, (shape, dtype) in bf.items():
        fp32 = ("hc_" in name or name.endswith(("attn_sink", ".gate.bias", ".ape"))
                or name.startswith("image_"))
        want = (torch.float8_e4m3fn if name.endswith("engram.embed.weight") else
                torch.float8_e8m0fnu if name.endswith(".scale") else
                torch.float32 if fp32 else torch.bfloat16)
        assert dtype == want, name


def test_v4_names_match_transformers():
    """The published V4 names, renamed by transformers' own DeepseekV4 checkpoint
    conversion rules, are exactly its model's state dict, at the same shapes (routed
    experts merged as transformers merges them)."""
    tr = pytest.importorskip("transformers")
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter, WeightRenaming, rename_source_key)
    except ImportError as e:
        pytest.skip(f"transformers {tr.__version__} lacks the conversion API: {e}")
    cfg = tr.AutoConfig.from_pretrained(CONFIGS / "v4-mini")
    with torch.device("meta"):
        model = tr.AutoModelForCausalLM.from_config(cfg)
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    rules = get_checkpoint_conversion_mapping("deepseek_v4")
    ren = [r for r in rules if isinstance(r, WeightRenaming)]
    conv = [r for r in rules if isinstance(r, WeightConverter)]
    got: dict[str, tuple] = {}
    for name, shape, _ in table("v4-mini", "bf16"):
        new, _ = rename_source_key(name, ren, conv, base_model_prefix="model",
                                   meta_state_dict=sd)
        got.setdefault(new, []).append(tuple(shape))
    assert set(got) == set(sd)
    c = json.loads((CONFIGS / "v4-mini" / "config.json").read_text())
    E, I, H = c["n_routed_experts"], c["moe_intermediate_size"], c["hidden_size"]
    for key, shapes in got.items():
        if key.endswith("experts.gate_up_proj"):
            assert shapes == [(I, H)] * (2 * E) and sd[key] == (E, 2 * I, H)
        elif key.endswith("experts.down_proj"):
            assert shapes == [(H, I)] * E and sd[key] == (E, H, I)
        else:
            assert shapes == [sd[key]], key


# --------------------------------------------------------------------------- config checks
def _with(config: str, **kv) -> Path:
    d = Path(tempfile.mkdtemp())
    raw = json.loads((CONFIGS / config / "config.json").read_text())
    (raw["text_config"] if "text_config" in raw else raw).update(kv)
    (d / "config.json").write_text(json.dumps(raw))
    return d


@pytest.mark.parametrize("kv,match", [
    ({"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 1]}, r"layer 5 has ratio 1 but reads kv source 4"),
    ({"compress_ratios": [0, 0, 3, 2, 2, 2, 1, 1, 1, 1]}, r"must be 0, 1 or 2; got \[3\]"),
    ({"kv_source_layer_ids": [1, 4, 6]}, r"kv_source_layer_ids entry 1 .* ratio 1 or 2"),
    ({"kv_source_layer_ids": []}, r"must be\s+non-empty"),
    ({"index_source_layer_ids": [2, 4, 6, 8, 9], "candidate_source_layer_id": 4},
     r"index source 6 filters with layer 4's candidate blocks"),
    ({"candidate_topk_blocks": 0}, r"candidate_topk_blocks > 0"),
    ({"engram_layer_ids": [0, 4]}, r"engram layer 0 must lie in \[1, 6\)"),
    ({"engram_layer_ids": [1, 6]}, r"engram layer 6 must lie in \[1, 6\)"),
    ({"engram_num_embeddings": [49795, 50980]}, r"49795, below\s+the 49796 rows"),
    ({"engram_head_dim": 96}, r"engram_head_dim 96 must be a power of two"),
    ({"hidden_size": 1280}, r"hidden_size 1280 must be a multiple of 512"),
    ({"num_hash_layers": 3}, r"num_hash_layers must be 0"),
])
def test_v41_config_errors(kv, match):
    with pytest.raises(ToolError, match=match):
        mk.load_config(_with("v41-mini", **kv))


def test_v4_config_and_format_errors(tmp_path):
    with pytest.raises(ToolError, match=r"must be 0, 4 or 128; got \[2\]"):
        mk.load_config(_with("v4-mini", compress_ratios=[0, 4, 2, 4, 128, 4]))
    cfg = mk.load_config(CONFIGS / "v4-mini")
    with pytest.raises(ToolError, match="--format mxfp8 is the DeepSeek-V4.1 layout"):
        mk.write_checkpoint(cfg, "mxfp8", tmp_path / "x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(ToolError, match="exists and is not empty"):
        mk.write_checkpoint(cfg, "bf16", tmp_path / "full")
    with pytest.raises(ToolError, match="no config.json"):
        mk.load_config(tmp_path)
    with pytest.raises(ToolError, match="expected KEY=VALUE"):
        mk.parse_set(["vocab_size"])
    with pytest.raises(ToolError, match="VALUE is not JSON"):
        mk.parse_set(["engram_layer_ids=[1,"])
    big = mk.load_config(CONFIGS / "v4-mini", {"moe_intermediate_size": 200})
    spec = next(s for s in mk.tensor_specs(big) if s.name.endswith("shared_experts.w2.weight"))
    with pytest.raises(ToolError, match=r"shared_experts.w2.weight: shape \(1024, 200\) is "
                                         r"not a multiple of the \[128, 128\]"):
        mk.materialize(spec, "fp8", 0)


def test_cli_list_and_required_out(capsys):
    assert mk.main([str(CONFIGS / "v41-mini"), "--format", "mxfp8", "--list",
                    "--set", "vocab_size=4096", "--set", "engram_layer_ids=[]"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == ["embed.weight", "[4096, 1024]", "bfloat16"]
    assert not any(".engram." in r[0] for r in rows)
    assert ["layers.2.attn.wq_b.scale", "[1024, 16]", "float8_e8m0fnu"] in rows
    assert len(rows) == V41_QUANT - 2 * 6  # two engram layers: 5 tensors + 1 scale each
    with pytest.raises(ToolError, match="--out DIR is required"):
        mk.main([str(CONFIGS / "v4-mini")])


def test_vocab_override_keeps_engram_tokenizer_in_step():
    cfg = mk.load_config(CONFIGS / "v41-mini", {"vocab_size": 4096})
    assert cfg.get("engram_compressed_vocab_size") == 4096
    with pytest.raises(ToolError, match="must equal vocab_size"):
        mk.load_config(CONFIGS / "v41-mini",
                       {"vocab_size": 4096, "engram_compressed_vocab_size": 5000})


def test_engram_rows_are_the_prime_buckets():
    """engram_num_embeddings of the shipped configs = the rows their hash heads address:
    consecutive primes above engram_vocab_size - 1, 12 per layer (3 n-gram sizes x 4
    heads), computed here by trial division."""
    primes, c = [], 4095
    while len(primes) < 24:
        c += 1
        if all(c % d for d in range(2, int(c ** 0.5) + 1)):
            primes.append(c)
    for config in ("v41-mini", "v41-tput"):
        t = json.loads((CONFIGS / config / "config.json").read_text())["text_config"]
        assert t["engram_num_embeddings"] == [sum(primes[:12]), sum(primes[12:])]


# --------------------------------------------------------------------------- (c) numerics
def _e4m3_decode(q: torch.Tensor) -> torch.Tensor:
    """e4m3fn from its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    b = q.view(torch.uint8).to(torch.int64)
    s = torch.where(b >= 128, -1.0, 1.0)
    e, m = (b >> 3) & 15, (b & 7).double()
    return s * torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))


def _e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """e2m1 from its bits: sign (bit 3), 2 exponent bits (bias 1), 1 mantissa bit."""
    code = code.to(torch.int64)
    s = torch.where(code >= 8, -1.0, 1.0)
    e, m = (code >> 1) & 3, (code & 1).double()
    return s * torch.where(e == 0, m / 2, (1 + m / 2) * 2.0 ** (e - 1))


def _scale(s: torch.Tensor) -> torch.Tensor:
    return 2.0 ** (s.view(torch.uint8).to(torch.float64) - 127)


def _matrix(n, k, seed=0):
    """Rows spanning 12 orders of magnitude, a zero row and outliers."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    w *= 10.0 ** torch.randint(-6, 6, (n, 1), generator=g)
    w[3] = 0
    w[5, 7] = 900.0
    return w.to(torch.bfloat16).float()


@pytest.mark.parametrize("bn,bk", [(128, 128), (32, 32), (1, 32)])
def test_fp8_block_roundtrip(bn, bk):
    w = _matrix(256, 256)
    q, s = mk.quantize_fp8_blocks(w, bn, bk)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.shape == (256 // bn, 256 // bk)
    S = _scale(s).repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    deq = _e4m3_decode(q) * S
    x = w.double()
    # round to nearest: half an ulp (2^-4 relative) or half a subnormal step (2^-10 scale)
    assert ((deq - x).abs() <= x.abs() * 2.0 ** -4 + S * 2.0 ** -10).all()
    assert (deq - x).abs().max() > 0  # it does round
    amax = x.reshape(256 // bn, bn, 256 // bk, bk).abs().amax(dim=(1, 3))
    ratio = amax / _scale(s)
    live = amax > 1e-4
    # the smallest power of two that keeps every element <= 448
    assert (ratio[live] <= 448).all() and (ratio[live] > 224).all()
    assert torch.equal(mk.dequantize_fp8_blocks(q, s), deq.float())
    # idempotent in value (a block whose amax rounds down to exactly 224 * scale takes
    # half the scale the second time, with the same values)
    q2, s2 = mk.quantize_fp8_blocks(deq.float(), bn, bk)
    assert torch.equal(mk.dequantize_fp8_blocks(q2, s2), deq.float())


def test_mxfp4_roundtrip_and_layout():
    w = _matrix(64, 256, seed=1)
    packed, s = mk.quantize_mxfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 128)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (64, 8)
    codes = torch.stack([packed & 15, packed >> 4], -1).flatten(-2)  # low nibble first
    S = _scale(s).repeat_interleave(32, 1)
    deq = _e2m1_decode(codes) * S
    x = w.double()
    grid = _e2m1_decode(torch.arange(16))
    # nearest representable value: no grid point is closer than the one chosen
    y = x / S
    best = (y[..., None] - grid).abs().min(-1).values
    assert ((deq / S - y).abs() <= best + 1e-12).all()
    amax = x.reshape(64, 8, 32).abs().amax(-1)
    live = amax > 1e-4
    ratio = amax / _scale(s)
    assert (ratio[live] <= 6).all() and (ratio[live] > 3).all()
    assert torch.equal(mk.dequantize_mxfp4(packed, s).double(), deq)
    # the packing itself: [0.5, -6] -> low nibble 1, high nibble 0xF -> byte 0xF1
    one = torch.zeros(1, 32)
    one[0, :2] = torch.tensor([0.5, -6.0])
    p1, s1 = mk.quantize_mxfp4(one)
    assert p1[0, 0] == 0xF1 and _scale(s1)[0, 0] == 1.0


@pytest.mark.parametrize("config,name", [
    ("v41-mini", "layers.2.attn.wq_b.weight"), ("v41-mini", "layers.0.ffn.experts.3.w2.weight"),
    ("v41-mini", "layers.4.engram.wkv.weight"), ("v4-mini", "layers.1.attn.indexer.wq_b.weight")])
def test_quantized_formats_share_the_bf16_values(config, name):
    cfg = mk.load_config(CONFIGS / config)
    spec = next(s for s in mk.tensor_specs(cfg) if s.name == name)
    src = mk.materialize(spec, "bf16", 7)[name].float()
    for fmt in ("fp8", "mxfp8") if config == "v41-mini" else ("fp8",):
        t = mk.materialize(spec, fmt, 7)
        q, s = t[name], t[name[:-7] + ".scale"]
        deq = mk.dequantize_mxfp4(q, s) if spec.kind == "expert" else \
            mk.dequantize_fp8_blocks(q, s)
        rel = (deq - src).norm() / src.norm()
        # e2m1 keeps ~2 bits of mantissa, e4m3 3: relative RMS error ~9% and ~2.5%
        assert rel < (0.15 if spec.kind == "expert" else 0.04), (fmt, float(rel))


def test_values_deterministic_and_name_keyed():
    cfg = mk.load_config(CONFIGS / "v4-mini")
    specs = {s.name: s for s in mk.tensor_specs(cfg)}
    a = specs["layers.3.attn.wo_b.weight"]
    x = mk.draw(a, 0)
    assert torch.equal(x, mk.draw(a, 0))
    assert not torch.equal(x, mk.draw(a, 1))
    b = specs["layers.4.attn.wo_b.weight"]
    assert not torch.equal(x, mk.draw(b, 0))  # same shape, other name


def test_initial_scales():
    cfg = mk.load_config(CONFIGS / "v41-mini", {"vocab_size": 8192})
    specs = {s.name: s for s in mk.tensor_specs(cfg)}
    std = lambda n: float(mk.draw(specs[n], 0).float().std())  # noqa: E731
    assert std("layers.2.attn.wq_b.weight") == pytest.approx(1 / math.sqrt(512), rel=0.02)
    assert std("layers.2.attn.wo_a.weight") == pytest.approx(1 / math.sqrt(4096), rel=0.02)
    assert std("embed.weight") == pytest.approx(1.0, rel=0.02)
    assert std("head.weight") == pytest.approx(mk.HEAD_LOGIT_STD / 32, rel=0.02)
    norm = mk.draw(specs["layers.0.attn_norm.weight"], 0).float()
    assert abs(float(norm.mean()) - 1) < 0.01 and float(norm.std()) < 0.1
    sc = mk.draw(specs["layers.3.hc_ffn_scale"], 0)
    assert ((sc >= mk.HC_SCALE_LO) & (sc <= mk.HC_SCALE_HI)).all()


def test_mhc_sinkhorn_converges_with_drawn_parameters():
    """The residual mixing of every layer, built from the drawn fn/base/scale as the
    model builds it (RMS-normed stream @ fn.T, scaled, plus base, softmax then
    alternating row/column normalization for hc_sinkhorn_iters), is doubly stochastic
    within 1e-3 and keeps a dominant diagonal for random unit-RMS streams."""
    cfg = mk.load_config(CONFIGS / "v41-mini")
    specs = {s.name: s for s in mk.tensor_specs(cfg)}
    hc, H = 4, cfg.need("hidden_size")
    x = torch.randn(64, hc * H, generator=torch.Generator().manual_seed(3))
    for i in range(cfg.need("num_hidden_layers")):
        for part in ("attn", "ffn"):
            fn = mk.draw(specs[f"layers.{i}.hc_{part}_fn"], 0)
            base = mk.draw(specs[f"layers.{i}.hc_{part}_base"], 0)
            scale = mk.draw(specs[f"layers.{i}.hc_{part}_scale"], 0)
            mix = (x @ fn.T) * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
            comb = mix[:, 2 * hc:].view(-1, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc)
            comb = torch.softmax(comb, -1)
            for _ in range(cfg.need("hc_sinkhorn_iters")):
                comb = comb / comb.sum(-2, keepdim=True)
                comb = comb / comb.sum(-1, keepdim=True)
            assert (comb.sum(-2) - 1).abs().max() < 1e-3
            diag = comb.diagonal(dim1=-2, dim2=-1)
            assert (diag > comb.sum(-1) / hc).all()


# --------------------------------------------------------------------------- (b) vLLM probe
def _probe_results() -> tuple[dict, Path]:
    """One probe run per test session, shared by the xdist workers."""
    from test_vllm_import import _need_tree, _probe_env
    _need_tree()
    missing = [m for m in ("safetensors", "tokenizers") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: pip install -r requirements-test.txt "
                    "-r requirements-vllm-import.txt (or `make venv`)")
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    d = Path(tempfile.gettempdir()) / f"deepinfer-ckpt-probe-{run}"
    d.mkdir(exist_ok=True)
    out = d / "result.json"
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            work = d / "work"
            r = subproc.run([sys.executable, str(PROBE), str(work)],
                            env=_probe_env(), cwd=REPO, cap=600)
            shutil.rmtree(work, ignore_errors=True)
            lines = r.stdout.strip().splitlines()
            if r.returncode != 0 or not lines:
                pytest.fail(f"checkpoint probe failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
            out.write_text(lines[-1])
    res = json.loads(out.read_text())
    if not res["_setup"]["ok"]:
        pytest.fail(f"probe setup: {res['_setup']['error']}\n{res['_setup'].get('trace')}")
    return res


@pytest.fixture(scope="module")
def probe():
    return _probe_results()


CASES = [("v41-mini", "bf16"), ("v41-mini", "fp8"), ("v41-mini", "mxfp8"),
         ("v41-tput", "mxfp8"), ("v4-mini", "bf16"), ("v4-mini", "fp8")]


def _case(probe, config, fmt) -> dict:
    r = probe[f"{config}/{fmt}"]
    assert r["ok"], f"{config}/{fmt}: {r['error']}\n{r.get('trace', '')}"
    return r


@pytest.mark.parametrize("config,fmt", CASES)
def test_vllm_loads_every_parameter(probe, config, fmt):
    r = _case(probe, config, fmt)
    assert r["params_not_loaded"] == []
    assert r["tensors_not_received"] == []
    assert r["distinct_tensor_addresses"] == r["num_tensors"]
    v41 = config.startswith("v41")
    want_cls = (("vllm.models.deepseek_v41.nvidia.vl_model.DeepseekV41ForCausalLM",
                 "DeepinferAmpereV41Attention") if v41 else
                ("vllm.models.deepseek_v4.nvidia.model.DeepseekV4ForCausalLM",
                 "DeepinferAmpereV4Attention"))
    assert (r["model_class"], r["attention_class"]) == want_cls
    assert r["engram_hash_built"] == v41
    if fmt != "bf16":
        assert r["cuda_quant_method"] == "deepseek_v4_fp8"


@pytest.mark.parametrize("config,fmt", CASES)
def test_vllm_quant_methods(probe, config, fmt):
    linear = {"bf16": "UnquantizedLinearMethod", "fp8": "Fp8LinearMethod",
              "mxfp8": "ModelOptLinearMethod"}[fmt]
    experts = "UnquantizedFusedMoEMethod" if fmt == "bf16" else "Mxfp4MoEMethod"
    assert _case(probe, config, fmt)["quant_methods"] == {
        "layers.0.attn.wq_b": linear, "layers.0.attn.wo_a": linear,
        "layers.0.ffn.experts": experts, "layers.0.ffn.shared_experts.down_proj": linear,
        "layers.0.ffn.gate": "UnquantizedLinearMethod"}


@pytest.mark.parametrize("config,fmt", CASES)
def test_vllm_dequantizes_loaded_params_to_the_source(probe, config, fmt):
    v = _case(probe, config, fmt)["values"]
    if fmt == "bf16":
        assert v["fused_wqa_wkv_equal"] and v["embed_equal"]
    else:
        for k in ("fused_wqa_wkv_excess", "expert_w1_excess", "expert_w3_excess",
                  "expert_w2_excess"):
            assert 0 < v[k] <= 1, (k, v[k])
        assert v["scale_param"][0] == ("torch.uint8" if fmt == "mxfp8"
                                       else "torch.float8_e8m0fnu")
    if config.startswith("v41"):
        assert 0 < v["engram_table_excess"] <= 1


@pytest.mark.parametrize("config,fmt", CASES)
def test_written_files_match_the_table(probe, config, fmt):
    """The safetensors headers and index the writer produced = the tensor table; the
    config's quantization_config and the tokenizer are those of the format/model."""
    f = _case(probe, config, fmt)["files"]
    overrides = {**probe["_small"], **probe["_extra"][f"{config}/{fmt}"]}
    want = {n: (list(s), dt) for n, s, dt in table(config, fmt, overrides)}
    assert f["index_names"] == sorted(want)
    short = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
             torch.float8_e8m0fnu: "F8_E8M0", torch.uint8: "U8"}
    assert f["headers"] == {n: [s, short[dt]] for n, (s, dt) in want.items()}
    qc = f["quantization_config"]
    v41 = config.startswith("v41")
    if fmt == "bf16":
        assert qc is None
    else:
        assert qc["quant_method"] == "fp8" and qc["scale_fmt"] == "ue8m0"
        assert qc["weight_block_size"] == ([32, 32] if fmt == "mxfp8" else [128, 128])
        assert (qc.get("expert_dtype") if v41 else f["expert_dtype_top"]) == "fp4"
    assert f["tokenizer"]   # every checkpoint ships one (ckptgen/tokenizer.py)
