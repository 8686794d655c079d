"""The tensor table: every tensor of a DeepSeek-V4.1 / V4 checkpoint before quantization
(published names, shapes, bf16-layout dtypes, kind, how its values are drawn), per layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass(frozen=True)
class Spec:
    """One checkpoint tensor before quantization.

    kind: linear (block-quantized under fp8/mxfp8), expert (MXFP4 under fp8/mxfp8),
    dense (never quantized), engram_table (always fp8 rows + UE8M0 per 32).
    init: how its values are drawn (see draw()).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    init: str


def _lin(name, out_f, in_f, kind="linear"):
    return Spec(name, (out_f, in_f), torch.bfloat16, kind, "fan_in")


def _norm(name, n):
    return Spec(name, (n,), torch.bfloat16, "dense", "norm")


def _mhc(prefix: str, hc: int, H: int, parts: tuple[str, ...]) -> list[Spec]:
    mix = (2 + hc) * hc
    out = []
    for p in parts:
        out += [Spec(f"{prefix}hc_{p}_fn", (mix, hc * H), torch.float32, "dense", "fan_in"),
                Spec(f"{prefix}hc_{p}_base", (mix,), torch.float32, "dense", f"hc_base:{hc}"),
                Spec(f"{prefix}hc_{p}_scale", (3,), torch.float32, "dense", "hc_scale")]
    return out


def _moe(p: str, cfg: ModelConfig) -> list[Spec]:
    H, E, I = cfg.need("hidden_size"), cfg.need("n_routed_experts"), cfg.need("moe_intermediate_size")
    out = [Spec(f"{p}ffn.gate.weight", (E, H), torch.bfloat16, "dense", "fan_in")]
    if cfg.get("topk_method") == "noaux_tc":
        out.append(Spec(f"{p}ffn.gate.bias", (E,), torch.float32, "dense", "gate_bias"))
    for e in range(E):
        out += [_lin(f"{p}ffn.experts.{e}.w1.weight", I, H, "expert"),
                _lin(f"{p}ffn.experts.{e}.w2.weight", H, I, "expert"),
                _lin(f"{p}ffn.experts.{e}.w3.weight", I, H, "expert")]
    ns = cfg.get("n_shared_experts")
    if ns:
        Is = I * ns
        out += [_lin(f"{p}ffn.shared_experts.w1.weight", Is, H),
                _lin(f"{p}ffn.shared_experts.w2.weight", H, Is),
                _lin(f"{p}ffn.shared_experts.w3.weight", Is, H)]
    return out


def _attn_common(p: str, cfg: ModelConfig) -> list[Spec]:
    H, nh, hd = cfg.need("hidden_size"), cfg.need("num_attention_heads"), cfg.need("head_dim")
    qr, og, orank = cfg.need("q_lora_rank"), cfg.need("o_groups"), cfg.need("o_lora_rank")
    return [
        Spec(f"{p}attn.attn_sink", (nh,), torch.float32, "dense", "sink"),
        _lin(f"{p}attn.wq_a.weight", qr, H),
        _lin(f"{p}attn.wkv.weight", hd, H),
        _norm(f"{p}attn.q_norm.weight", qr),
        _lin(f"{p}attn.wq_b.weight", nh * hd, qr),
        _norm(f"{p}attn.kv_norm.weight", hd),
        _lin(f"{p}attn.wo_a.weight", og * orank, nh * hd // og),
        _lin(f"{p}attn.wo_b.weight", H, og * orank),
    ]


def _layer_common(p: str, cfg: ModelConfig) -> list[Spec]:
    H, hc = cfg.need("hidden_size"), cfg.need("hc_mult")
    return ([_norm(f"{p}attn_norm.weight", H), _norm(f"{p}ffn_norm.weight", H)]
            + _mhc(p, hc, H, ("attn", "ffn")))


def v41_layer_specs(cfg: ModelConfig, i: int) -> list[Spec]:
    p = f"layers.{i}."
    H, hd = cfg.need("hidden_size"), cfg.need("head_dim")
    ratio = cfg.need("compress_ratios")[i]
    kv = set(cfg.get("kv_source_layer_ids") or ())
    idx = set(cfg.get("index_source_layer_ids") or ())
    out = _layer_common(p, cfg) + _attn_common(p, cfg)
    if i in kv:
        # V4.1 compressor: wkv (+ wgate when it pools, ratio 2) and its norm; bf16 (built
        # without a quant config); no position bias.
        out.append(Spec(f"{p}attn.compressor.wkv.weight", (hd, H), torch.bfloat16, "dense",
                        "fan_in"))
        if ratio > 1:
            out.append(Spec(f"{p}attn.compressor.wgate.weight", (hd, H), torch.bfloat16,
                            "dense", "fan_in"))
        out.append(_norm(f"{p}attn.compressor.norm.weight", hd))
    if i in idx:
        nih, ihd, qr = cfg.need("index_n_heads"), cfg.need("index_head_dim"), cfg.need("q_lora_rank")
        out += [_lin(f"{p}attn.indexer.wq_b.weight", nih * ihd, qr),
                Spec(f"{p}attn.indexer.weights_proj.weight", (nih, H), torch.bfloat16,
                     "dense", "fan_in")]
        if i in kv:
            # The K projection of the index keys lives on kv sources only (bf16).
            out += [Spec(f"{p}attn.indexer.wk.weight", (ihd, hd), torch.bfloat16, "dense",
                         "fan_in"),
                    _norm(f"{p}attn.indexer.k_norm.weight", ihd)]
    eng = list(cfg.get("engram_layer_ids") or [])
    if i in eng:
        j = eng.index(i)
        hc, edim = cfg.need("hc_mult"), cfg.need("engram_head_dim")
        cols = (cfg.need("engram_max_ngram_size") - 1) * cfg.need("engram_n_heads")
        rows = cfg.need("engram_num_embeddings")[j]
        out += [Spec(f"{p}engram.embed.weight", (rows, edim), torch.bfloat16, "engram_table",
                     "engram_row"),
                _lin(f"{p}engram.wkv.weight", H * (hc + 1), cols * edim),
                Spec(f"{p}engram.q_weight", (hc, H), torch.bfloat16, "dense", "norm"),
                Spec(f"{p}engram.k_weight", (hc, H), torch.bfloat16, "dense", "norm")]
    return out + _moe(p, cfg)


def v4_layer_specs(cfg: ModelConfig, i: int) -> list[Spec]:
    p = f"layers.{i}."
    H, hd = cfg.need("hidden_size"), cfg.need("head_dim")
    ratio = cfg.need("compress_ratios")[i]
    out = _layer_common(p, cfg) + _attn_common(p, cfg)

    def compressor(q: str, dim: int) -> list[Spec]:
        # C4A overlaps two windows (coff 2), C128A does not; fp32 ape, bf16 projections.
        coff = 2 if ratio == 4 else 1
        return [Spec(f"{q}ape", (ratio, coff * dim), torch.float32, "dense", "ape"),
                Spec(f"{q}wkv.weight", (coff * dim, H), torch.bfloat16, "dense", "fan_in"),
                Spec(f"{q}wgate.weight", (coff * dim, H), torch.bfloat16, "dense", "fan_in"),
                _norm(f"{q}norm.weight", dim)]

    if ratio > 1:
        out += compressor(f"{p}attn.compressor.", hd)
    if ratio == 4:
        nih, ihd, qr = cfg.need("index_n_heads"), cfg.need("index_head_dim"), cfg.need("q_lora_rank")
        out += [_lin(f"{p}attn.indexer.wq_b.weight", nih * ihd, qr),
                Spec(f"{p}attn.indexer.weights_proj.weight", (nih, H), torch.bfloat16,
                     "dense", "fan_in")]
        out += compressor(f"{p}attn.indexer.compressor.", ihd)
    return out + _moe(p, cfg)


def tensor_specs(cfg: ModelConfig) -> list[Spec]:
    """Every tensor of the checkpoint, in write order (published names, bf16 layout)."""
    H, V, hc = cfg.need("hidden_size"), cfg.need("vocab_size"), cfg.need("hc_mult")
    layer = v41_layer_specs if cfg.kind == "deepseek_v41" else v4_layer_specs
    out = [Spec("embed.weight", (V, H), torch.bfloat16, "dense", "embed")]
    for i in range(int(cfg.need("num_hidden_layers"))):
        out += layer(cfg, i)
    out.append(_norm("norm.weight", H))
    if cfg.kind == "deepseek_v4":
        out += [Spec("hc_head_fn", (hc, hc * H), torch.float32, "dense", "fan_in"),
                Spec("hc_head_base", (hc,), torch.float32, "dense", "hc_head_base"),
                Spec("hc_head_scale", (1,), torch.float32, "dense", "hc_scale")]
    out.append(Spec("head.weight", (V, H), torch.bfloat16, "dense", "head"))
    if cfg.kind == "deepseek_v41":
        # vLLM serves DeepseekV41ForCausalLM through its vision wrapper, which owns the
        # three image-span embeddings (fp32) even with language_model_only; the published
        # checkpoint carries them, and the loader's weight tracking requires them.
        out += [Spec(n, (H,), torch.float32, "dense", "embed")
                for n in ("image_start", "image_end", "image_newline")]
    return out
