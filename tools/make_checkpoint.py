#!/usr/bin/env python3
"""Deterministic random-weight checkpoints for DeepSeek-V4.1 / DeepSeek-V4 model configs.

    python tools/make_checkpoint.py CONFIG_DIR --format {bf16,fp8,mxfp8} --out DIR
                                    [--seed N] [--set KEY=JSON ...] [--list]

CONFIG_DIR holds a Hugging Face config.json (benchmarks/e2e/configs/*). The output folder
gets config.json (with the "quantization_config" of the format), safetensors shards plus
model.safetensors.index.json under the tensor names of the published checkpoints (the
names vLLM's ``load_weights`` and ``hf_to_vllm_mapper`` take as input), and, when the
model has Engram layers, a word-level tokenizer (vLLM builds Engram's n-gram token map
from the model's tokenizer at start-up).

Formats (the published layouts; see benchmarks/e2e/README.md):
  bf16   no quantization_config: linears and routed experts bf16, mHC/sink/bias fp32.
  fp8    DeepSeek-V4 style: fp8 e4m3 linears in [128, 128] blocks with UE8M0
         (float8_e8m0fnu) ``.scale``, MXFP4 routed experts (e2m1 pairs in uint8, one
         UE8M0 scale per 32 inputs).
  mxfp8  DeepSeek-V4.1 style: fp8 e4m3 linears in [32, 32] blocks with UE8M0 ``.scale``,
         MXFP4 routed experts. V4.1 configs only (V4's quant config has no MXFP8 path).
Under every format the Engram tables are fp8 rows with one UE8M0 scale per 32 values
(the only layout vLLM's Engram embedding stores), and the modules vLLM builds without a
quantization config (router gate, compressors, indexer weights_proj / wk) stay bf16.

Every tensor is drawn from a generator seeded by (--seed, tensor name), rounded to bf16,
and the fp8 / mxfp8 checkpoints quantize those same bf16 values. Scales are realistic:
linears N(0, 1/fan_in), norms near 1, embeddings N(0, 1), small sinks and biases, mHC
mixing parameters that keep the Sinkhorn iteration well conditioned.

--set KEY=JSON overrides a text-config field before writing (for example
``--set vocab_size=4096`` for a fast CPU test); with Engram on, the word-level tokenizer
has one token per vocabulary entry, so engram_compressed_vocab_size follows vocab_size
unless it is set explicitly. --list prints the tensor table (name, shape, dtype) and
writes nothing. torch is required; safetensors only for writing.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ToolError, run_main  # noqa: E402

FORMATS = ("bf16", "fp8", "mxfp8")
# Block shapes of the linear weight scales, [rows, cols] of the weight per scale: the
# published DeepSeek-V4 fp8 checkpoints use 128x128 blocks; V4.1's MXFP8 linears 32x32
# (vLLM's _linear_scale_param_name keys the MXFP8 path off exactly [32, 32]).
LINEAR_BLOCK = {"fp8": (128, 128), "mxfp8": (32, 32)}
# MXFP4 (OCP microscaling): 32 e2m1 values share one UE8M0 scale along the input dim.
MXFP4_BLOCK = 32
# Engram tables: fp8 rows with one UE8M0 scale per 32 values (ParallelEngramEmbedding's
# block_size default, the only one vLLM 0.33.0 builds).
ENGRAM_SCALE_BLOCK = 32
# Largest finite magnitudes of the element formats: e4m3fn and e2m1.
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# The e2m1 magnitudes by code (bit 3 is the sign), low nibble = even element.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Floor of a block's amax before taking its scale exponent (all-zero blocks); the same
# floor the UE8M0 KV-record encoder uses.
AMAX_FLOOR = 1e-4

# Initial-value scales (see the module docstring).
# Norm weights: 1 + N(0, NORM_JITTER) -- trained RMSNorm gains sit near 1.
NORM_JITTER = 0.05
# LM head: logits of std HEAD_LOGIT_STD for a unit-RMS final hidden state, so the
# next-token distribution is peaked (top logprob a few nats above -ln(vocab)) and greedy
# tokens are decisive, as in a trained model; 1/sqrt(hidden) would give logits of std 1.
HEAD_LOGIT_STD = 3.0
# Attention sinks (one fp32 logit per head, added to the softmax denominator): small
# against the q.k/sqrt(d) scores, which are O(1).
SINK_STD = 0.5
# Router e_score_correction_bias: a small selection-only offset.
GATE_BIAS_STD = 0.01
# V4 compressor position bias (ape), added to the pooling scores: small.
APE_STD = 0.02
# mHC: fn rows N(0, 1/(hc*hidden)) make the RMS-normed mixes ~N(0, 1); hc_scale in
# [HC_SCALE_LO, HC_SCALE_HI] keeps their input-dependent part mild; pre/post bases
# N(0, HC_BASE_STD) (sigmoids around 0.5 / post around 1); the residual-mix base is
# HC_COMB_DIAG on the diagonal plus N(0, HC_BASE_STD) noise, so each stream keeps most
# of itself (softmax row diag ~0.7 at hc_mult 4) and the Sinkhorn normalization
# converges in a few iterations.
HC_SCALE_LO, HC_SCALE_HI = 0.1, 0.3
HC_BASE_STD = 0.5
HC_COMB_DIAG = 2.0
# Engram table rows: embedding-like values, N(0, 1).
ENGRAM_ROW_STD = 1.0
# Default shard size of the safetensors files (bytes of tensor data): one shard is held
# in memory while it is written, and 2 GiB keeps each mini checkpoint in a single file.
SHARD_BYTES = 2 << 30
# Default cap on the tensors drawn in parallel: the draw is memory-bound past a few
# threads, and each thread holds up to two tensors in flight.
MAX_THREADS = 8


# --------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    """A config.json with the model kind resolved; ``text`` is the dict the model reads
    (V4.1 nests it under "text_config", V4 is flat)."""

    raw: dict
    kind: str  # "deepseek_v41" | "deepseek_v4"
    source: str

    @property
    def text(self) -> dict:
        return self.raw["text_config"] if self.kind == "deepseek_v41" else self.raw

    def get(self, key: str, default=None):
        return self.text.get(key, default)

    def need(self, key: str):
        if key not in self.text:
            where = "text_config" if self.kind == "deepseek_v41" else "the top level"
            raise ToolError(f"{self.source}: {key} missing (expected in {where})")
        return self.text[key]


def load_config(config_dir: Path, overrides: dict | None = None) -> ModelConfig:
    path = Path(config_dir) / "config.json"
    if not path.is_file():
        raise ToolError(f"{path}: no config.json (pass a folder holding one)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ToolError(f"{path}: not valid JSON ({e})") from e
    model_type = raw.get("model_type")
    if model_type == "deepseek_v41":
        if not isinstance(raw.get("text_config"), dict):
            raise ToolError(f"{path}: model_type deepseek_v41 needs a text_config object")
    elif model_type != "deepseek_v4":
        raise ToolError(f"{path}: model_type {model_type!r} is neither deepseek_v41 nor "
                        "deepseek_v4")
    cfg = ModelConfig(copy.deepcopy(raw), model_type, str(path))
    overrides = dict(overrides or {})
    cfg.text.update(overrides)
    if (cfg.get("engram_layer_ids") and "vocab_size" in overrides
            and "engram_compressed_vocab_size" not in overrides):
        # The word-level tokenizer written beside the weights maps every token to its own
        # compressed id (see write_tokenizer).
        cfg.text["engram_compressed_vocab_size"] = cfg.text["vocab_size"]
    check_config(cfg)
    return cfg


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def engram_head_sizes(cfg: ModelConfig) -> list[list[int]]:
    """Bucket count of every (n-gram size, head) pair, per Engram layer: distinct primes
    above engram_vocab_size - 1 handed out in order over the layers, n-gram sizes and
    heads (vLLM's EngramLayout allocates them the same way)."""
    n_layers = len(cfg.get("engram_layer_ids") or [])
    per_layer = (int(cfg.need("engram_max_ngram_size")) - 1) * int(cfg.need("engram_n_heads"))
    primes, c = [], int(cfg.need("engram_vocab_size")) - 1
    while len(primes) < n_layers * per_layer:
        c += 1
        if _is_prime(c):
            primes.append(c)
    return [primes[i * per_layer:(i + 1) * per_layer] for i in range(n_layers)]


def check_config(cfg: ModelConfig) -> None:
    """The topology rules vLLM 0.33.0's model code relies on, one clear error each."""
    src = cfg.source
    L = int(cfg.need("num_hidden_layers"))
    H = int(cfg.need("hidden_size"))
    if H % 512:
        raise ToolError(f"{src}: hidden_size {H} must be a multiple of 512 (the mHC "
                        "prenorm GEMM splits it in 512-wide tiles)")
    if cfg.need("head_dim") != 512 or cfg.need("qk_rope_head_dim") != 64:
        raise ToolError(f"{src}: head_dim must be 512 and qk_rope_head_dim 64 (the "
                        "compressor and the KV record assume them)")
    if int(cfg.need("num_attention_heads")) % int(cfg.need("o_groups")):
        raise ToolError(f"{src}: num_attention_heads must be a multiple of o_groups")
    if int(cfg.get("num_hash_layers", 0) or 0) != 0:
        raise ToolError(f"{src}: num_hash_layers must be 0 (this tool writes no hash-routing "
                        "tid2eid tables)")
    ratios = cfg.need("compress_ratios")
    if len(ratios) < L:
        raise ToolError(f"{src}: compress_ratios has {len(ratios)} entries for {L} layers")
    if cfg.kind == "deepseek_v4":
        bad = [r for r in ratios[:L] if r not in (0, 4, 128)]
        if bad:
            raise ToolError(f"{src}: DeepSeek-V4 compress_ratios must be 0, 4 or 128; got {bad}")
        return
    bad = [r for r in ratios[:L] if r not in (0, 1, 2)]
    if bad:
        raise ToolError(f"{src}: DeepSeek-V4.1 compress_ratios must be 0, 1 or 2; got {bad}")
    kv = sorted(cfg.get("kv_source_layer_ids") or [])
    idx = sorted(cfg.get("index_source_layer_ids") or [])
    if not kv or not idx:
        raise ToolError(f"{src}: kv_source_layer_ids and index_source_layer_ids must be "
                        "non-empty")
    for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", idx)):
        for s in ids:
            if not 0 <= s < L or ratios[s] == 0:
                raise ToolError(f"{src}: {name} entry {s} must be a layer below {L} with "
                                "compress ratio 1 or 2")

    def source(ids, layer):
        below = [s for s in ids if s <= layer]
        return max(below) if below else None

    for i in range(L):
        if ratios[i] == 0:
            continue
        ks, js = source(kv, i), source(idx, i)
        if ks is None or js is None:
            raise ToolError(f"{src}: layer {i} (ratio {ratios[i]}) has no kv source and "
                            "index source at or below it")
        if ratios[ks] != ratios[i] or ratios[js] != ratios[i]:
            raise ToolError(f"{src}: layer {i} has ratio {ratios[i]} but reads kv source {ks} "
                            f"(ratio {ratios[ks]}) and index source {js} (ratio "
                            f"{ratios[js]}); a consumer's ratio must equal its sources'")
        if source(kv, js) != ks:
            # Top-k indices address the compressed cache of the index source's kv source.
            raise ToolError(f"{src}: layer {i} reads kv source {ks} but top-k from index "
                            f"source {js}, whose keys come from kv source {source(kv, js)}")
    cand = int(cfg.get("candidate_source_layer_id", -1))
    if cand >= 0:
        if cand not in idx:
            raise ToolError(f"{src}: candidate_source_layer_id {cand} is not an index source")
        if int(cfg.get("candidate_topk_blocks", 0)) <= 0 or \
                int(cfg.get("candidate_block_size", 0)) <= 0:
            raise ToolError(f"{src}: a candidate source needs candidate_topk_blocks > 0 and "
                            "candidate_block_size > 0")
        for j in idx:
            if j > cand and source(kv, j) != source(kv, cand):
                raise ToolError(f"{src}: index source {j} filters with layer {cand}'s "
                                "candidate blocks but reads a different kv source")
    eng = list(cfg.get("engram_layer_ids") or [])
    if eng:
        for e in eng:
            if not 1 <= e < max(kv):
                raise ToolError(f"{src}: engram layer {e} must lie in [1, {max(kv)}): layer 0 "
                                "never applies Engram and layers from the last kv source "
                                "on run in the decoder replay")
        dim = int(cfg.need("engram_head_dim"))
        if dim % ENGRAM_SCALE_BLOCK or dim & (dim - 1):
            raise ToolError(f"{src}: engram_head_dim {dim} must be a power of two and a "
                            f"multiple of {ENGRAM_SCALE_BLOCK}")
        nums = list(cfg.need("engram_num_embeddings"))
        if len(nums) != len(eng):
            raise ToolError(f"{src}: engram_num_embeddings needs one entry per engram layer")
        for e, n, sizes in zip(eng, nums, engram_head_sizes(cfg)):
            if n < sum(sizes):
                raise ToolError(f"{src}: engram_num_embeddings for layer {e} is {n}, below "
                                f"the {sum(sizes)} rows its hash heads address")
        if cfg.need("engram_compressed_vocab_size") != cfg.need("vocab_size"):
            raise ToolError(f"{src}: engram_compressed_vocab_size must equal vocab_size (the "
                            "written tokenizer maps each token to its own compressed id)")


# --------------------------------------------------------------------------- tensor table
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


# --------------------------------------------------------------------------- values
def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, tensor name): values do not depend on the
    order or presence of other tensors."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def draw(spec: Spec, seed: int) -> torch.Tensor:
    """The tensor's values in its bf16-checkpoint dtype (bf16 or fp32)."""
    g = torch.Generator().manual_seed(name_seed(seed, spec.name))
    shape, init = spec.shape, spec.init

    def normal(mean=0.0, std=1.0):
        return torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=g)

    if init == "fan_in":
        x = normal(std=1.0 / math.sqrt(shape[-1]))
    elif init == "norm":
        x = normal(1.0, NORM_JITTER)
    elif init == "embed":
        x = normal()
    elif init == "head":
        x = normal(std=HEAD_LOGIT_STD / math.sqrt(shape[-1]))
    elif init == "sink":
        x = normal(std=SINK_STD)
    elif init == "gate_bias":
        x = normal(std=GATE_BIAS_STD)
    elif init == "ape":
        x = normal(std=APE_STD)
    elif init == "engram_row":
        x = normal(std=ENGRAM_ROW_STD)
    elif init == "hc_scale":
        x = torch.empty(shape).uniform_(HC_SCALE_LO, HC_SCALE_HI, generator=g)
    elif init == "hc_head_base":
        x = normal(std=HC_BASE_STD)
    elif init.startswith("hc_base:"):
        hc = int(init.split(":")[1])
        x = normal(std=HC_BASE_STD)
        x[2 * hc:] += HC_COMB_DIAG * torch.eye(hc).flatten()
    else:  # pragma: no cover - a Spec built above with an unknown init
        raise AssertionError(init)
    return x.to(spec.dtype)


# --------------------------------------------------------------------------- quantization
def ue8m0_exponent(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """Power-of-two scale exponent per block: the smallest e with amax / 2^e <= fmt_max
    (no element saturates), clamped to UE8M0's range."""
    return torch.ceil(torch.log2(amax.clamp_min(AMAX_FLOOR) / fmt_max)).clamp(-127, 127)


def e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    return (e.to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> fp32 powers of two (byte b is 2^(b-127); 255 would be NaN)."""
    b = s.view(torch.uint8).to(torch.int32)
    return torch.exp2((b - 127).to(torch.float32))


def _blocks(w: torch.Tensor, bn: int, bk: int, name: str) -> torch.Tensor:
    n, k = w.shape
    if n % bn or k % bk:
        raise ToolError(f"{name}: shape {tuple(w.shape)} is not a multiple of the "
                        f"[{bn}, {bk}] quantization block; change the config dimension")
    return w.reshape(n // bn, bn, k // bk, bk)


def quantize_fp8_blocks(w: torch.Tensor, bn: int, bk: int, name: str = "tensor"
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 weight + UE8M0 scale per [bn, bk] block: w ~= q * scale."""
    x = _blocks(w.float(), bn, bk, name)
    e = ue8m0_exponent(x.abs().amax(dim=(1, 3)), E4M3_MAX)
    q = (x / torch.exp2(e)[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
    return q, e8m0_from_exponent(e)


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    bn, bk = n // scale.shape[0], k // scale.shape[1]
    s = e8m0_to_float(scale).repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return q.float() * s


def quantize_mxfp4(w: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 as vLLM's Mxfp4MoEMethod loads it: [N, K/2] uint8 (element 2j in the low
    nibble, 2j+1 in the high; nibble = sign << 3 | e2m1 magnitude code) and [N, K/32]
    UE8M0 scales; values round to the nearest e2m1 magnitude."""
    n, k = w.shape
    x = _blocks(w.float(), 1, MXFP4_BLOCK, name).reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    e = ue8m0_exponent(x.abs().amax(dim=2), E2M1_MAX)
    y = (x / torch.exp2(e)[..., None]).reshape(n, k)
    grid = torch.tensor(E2M1_GRID)
    mids = (grid[1:] + grid[:-1]) / 2
    mag = torch.bucketize(y.abs(), mids).to(torch.uint8)
    code = mag | ((y < 0) & (mag > 0)).to(torch.uint8) << 3
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), e8m0_from_exponent(e)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(E2M1_GRID)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).to(torch.int64)
    vals = grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return vals * e8m0_to_float(scale).repeat_interleave(MXFP4_BLOCK, -1)


def materialize(spec: Spec, fmt: str, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one Spec under a format: ``name`` (and ``.scale``)."""
    w = draw(spec, seed)
    scale_name = spec.name[: -len(".weight")] + ".scale" if spec.name.endswith(".weight") \
        else None
    if spec.kind == "engram_table":
        q, s = quantize_fp8_blocks(w, 1, ENGRAM_SCALE_BLOCK, spec.name)
        return {spec.name: q, scale_name: s}
    if fmt == "bf16" or spec.kind == "dense":
        return {spec.name: w}
    if spec.kind == "expert":
        q, s = quantize_mxfp4(w, spec.name)
        return {spec.name: q, scale_name: s}
    q, s = quantize_fp8_blocks(w, *LINEAR_BLOCK[fmt], spec.name)
    return {spec.name: q, scale_name: s}


def quantization_config(cfg: ModelConfig, fmt: str) -> dict | None:
    """The config.json "quantization_config" the published checkpoints declare."""
    if fmt == "bf16":
        return None
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
          "scale_fmt": "ue8m0", "weight_block_size": list(LINEAR_BLOCK[fmt])}
    if cfg.kind == "deepseek_v41":
        # DeepseekV41Config lifts expert_dtype out of the quantization config.
        qc["expert_dtype"] = "fp4"
    return qc


def output_config(cfg: ModelConfig, fmt: str) -> dict:
    raw = copy.deepcopy(cfg.raw)
    raw.pop("quantization_config", None)
    # Any 4.x version tells transformers' tokenizer loader this is no Mistral checkpoint
    # (without the field it warns about a "Mistral regex" for every local tokenizer).
    raw.setdefault("transformers_version", "4.57.1")
    qc = quantization_config(cfg, fmt)
    if qc is not None:
        raw["quantization_config"] = qc
    if cfg.kind == "deepseek_v4" and fmt != "bf16":
        # DeepseekV4FP8Config keys the expert method and the e8m0 linear scales off it.
        raw["expert_dtype"] = "fp4"
    return raw


def checkpoint_table(cfg: ModelConfig, fmt: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every written tensor, without drawing values."""
    out = []
    for spec in tensor_specs(cfg):
        n, k = spec.shape[0], spec.shape[-1]
        if spec.kind == "engram_table":
            out += [(spec.name, spec.shape, torch.float8_e4m3fn),
                    (spec.name[:-7] + ".scale", (n, k // ENGRAM_SCALE_BLOCK),
                     torch.float8_e8m0fnu)]
        elif fmt == "bf16" or spec.kind == "dense":
            out.append((spec.name, spec.shape, spec.dtype))
        elif spec.kind == "expert":
            out += [(spec.name, (n, k // 2), torch.uint8),
                    (spec.name[:-7] + ".scale", (n, k // MXFP4_BLOCK), torch.float8_e8m0fnu)]
        else:
            bn, bk = LINEAR_BLOCK[fmt]
            out += [(spec.name, spec.shape, torch.float8_e4m3fn),
                    (spec.name[:-7] + ".scale", (n // bn, k // bk), torch.float8_e8m0fnu)]
    return out


# --------------------------------------------------------------------------- writing
def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer with tokens "t0" .. "t{V-1}": each normalizes to a distinct
    string, so vLLM's Engram compressed vocabulary has exactly vocab_size entries."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ImportError as e:
        raise ToolError("Engram layers need a tokenizer beside the weights and writing it "
                        "needs the `tokenizers` package (pip install tokenizers)") from e
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0",
         "model_max_length": 1 << 20}, indent=2) + "\n")


def _materialize_all(specs: list[Spec], fmt: str, seed: int, threads: int):
    """materialize() of every Spec, in order, on a thread pool (torch releases the GIL;
    each tensor has its own generator, so the values do not depend on the schedule).
    At most 2 * threads tensors are in flight, which bounds the memory."""
    if threads <= 1:
        for spec in specs:
            yield materialize(spec, fmt, seed)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()
        for spec in specs:
            pending.append(pool.submit(materialize, spec, fmt, seed))
            if len(pending) >= 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def write_checkpoint(cfg: ModelConfig, fmt: str, out: Path, seed: int = 0,
                     shard_bytes: int = SHARD_BYTES, threads: int | None = None,
                     log=print) -> dict:
    """Write config.json, the shards and their index (and the tokenizer for Engram)."""
    if fmt not in FORMATS:
        raise ToolError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt == "mxfp8" and cfg.kind != "deepseek_v41":
        raise ToolError(f"{cfg.source}: --format mxfp8 is the DeepSeek-V4.1 layout; "
                        "DeepSeek-V4 checkpoints use --format fp8")
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ToolError("writing needs the `safetensors` package (pip install "
                        "'safetensors>=0.6.2'; 0.6 added the F8_E8M0 dtype)") from e
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ToolError(f"--out {out}: folder exists and is not empty; pick a new folder")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(output_config(cfg, fmt), indent=2) + "\n")
    if cfg.get("engram_layer_ids"):
        write_tokenizer(out, int(cfg.need("vocab_size")))

    specs = tensor_specs(cfg)
    if threads is None:
        threads = max(1, min(MAX_THREADS, torch.get_num_threads()))
    shards: list[list[str]] = []
    weight_map: dict[str, str] = {}
    current: dict[str, torch.Tensor] = {}
    current_bytes = total = 0

    def flush():
        nonlocal current, current_bytes
        if not current:
            return
        shards.append(list(current))
        path = out / f"_shard{len(shards)}.safetensors"
        save_file(current, str(path), metadata={"format": "pt"})
        path.chmod(0o644)  # safetensors creates 0600; the engine may run as another user
        current, current_bytes = {}, 0

    for tensors in _materialize_all(specs, fmt, seed, threads):
        for name, t in tensors.items():
            t = t.contiguous()
            nbytes = t.numel() * t.element_size()
            if current and current_bytes + nbytes > shard_bytes:
                flush()
            current[name] = t
            current_bytes += nbytes
            total += nbytes
    flush()
    n = len(shards)
    for k, names in enumerate(shards, 1):
        final = f"model-{k:05d}-of-{n:05d}.safetensors"
        (out / f"_shard{k}.safetensors").rename(out / final)
        weight_map.update({name: final for name in names})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    log(f"wrote {out}: {cfg.kind} {fmt}, {len(weight_map)} tensors, {total / 2**20:.1f} MiB "
        f"in {n} shard(s), seed {seed}")
    return {"tensors": len(weight_map), "bytes": total, "shards": n}


# --------------------------------------------------------------------------- CLI
def parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ToolError(f"--set {item!r}: expected KEY=VALUE (VALUE in JSON, e.g. "
                            "vocab_size=4096 or engram_layer_ids=[])")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise ToolError(f"--set {item!r}: VALUE is not JSON ({e})") from e
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config_dir", type=Path)
    ap.add_argument("--format", choices=FORMATS, default="bf16")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    ap.add_argument("--shard-mb", type=int, default=SHARD_BYTES >> 20)
    ap.add_argument("--threads", type=int, default=None,
                    help="tensors drawn in parallel (default: torch's thread count, "
                    f"at most {MAX_THREADS})")
    ap.add_argument("--list", action="store_true", help="print the tensor table only")
    args = ap.parse_args(argv)
    cfg = load_config(args.config_dir, parse_set(args.set))
    if args.list:
        for name, shape, dtype in checkpoint_table(cfg, args.format):
            print(f"{name}\t{list(shape)}\t{str(dtype).removeprefix('torch.')}")
        return 0
    if args.out is None:
        raise ToolError("--out DIR is required (or --list)")
    write_checkpoint(cfg, args.format, args.out, args.seed, args.shard_mb << 20, args.threads)
    return 0


if __name__ == "__main__":
    run_main(main)
