"""The speculative-decoding draft of a checkpoint: its config keys and tensors, as vLLM
0.33.0's draft model classes load them from the target's own checkpoint (paths relative to
``vllm/`` in the pinned sdist).

* ``mtp`` (DeepSeek-V4 only): ``num_nextn_predict_layers`` >= 1 MTP blocks, each
  ``mtp.{j}.`` + ``e_proj`` / ``h_proj`` [H, H] (quantized linears), ``enorm`` / ``hnorm``,
  ``norm`` (the shared head's norm), ``hc_head_{fn,base,scale}`` and one decoder block of
  compress ratio 1 (SWA only: attention, mHC, MoE). The embedding and the LM head are the
  target's (``DeepSeekV4MTP`` in models/deepseek_v4/nvidia/mtp.py; vLLM's eagle loader
  shares both). V4.1 has no classic MTP: config/speculative.py refuses ``method="mtp"``.
* ``dspark`` (V4.1 and V4): ``n_mtp_layers`` stages ``mtp.{i}.`` of one decoder block each
  (SWA only: V4.1 ratio 0, V4 ratio 1), ``mtp.0.main_proj`` [H, H * len(ids)] (quantized)
  and ``mtp.0.main_norm`` combining the target's hidden states at
  ``dspark_target_layer_ids``; the last stage holds the head stack: ``norm``, the Markov
  head (V4.1 names its factors ``markov_head.embed`` / ``markov_head.head``, V4
  ``markov_head.markov_w1`` / ``markov_w2``; [V, dspark_markov_rank], bf16), the
  confidence head ``confidence_head.proj`` [1, H + rank] fp32, and on V4 the
  ``hc_head_*`` (V4.1 collapses the hc copies with the last block's pre-mix instead).
  ``DSparkDeepseekV4ForCausalLM`` in models/deepseek_v41/nvidia/dspark.py and
  models/deepseek_v4/nvidia/dspark.py; V4 also derives its context projection from the
  stages' ``attn.wkv`` while loading (no tensor of its own).

A config declares its draft by its keys (``dspark_target_layer_ids`` -> DSpark;
``num_nextn_predict_layers`` >= 1 on V4 -> MTP); ``apply_spec`` adds the keys of a method
with the defaults below where the config lacks them (make_checkpoint --spec). The values are
drawn like the target's (make_checkpoint's inits): linears N(0, 1/fan_in), norms near 1,
the Markov embedding N(0, 1) and its projection N(0, 1/rank), so the Markov bias on the
draft logits has std ~1 beside the head's logits of std 3.
"""
from __future__ import annotations

import torch

from _common import ToolError

from .tensors import Spec, _attn_common, _layer_common, _lin, _moe, _norm

SPEC_METHODS = ("mtp", "dspark")
# DSpark defaults (make_checkpoint --spec dspark): the block of 5 draft tokens the public
# Ampere ports serve (k = 5), 3 stages (upstream's default when n_mtp_layers is absent), a
# Markov head of rank 256, and a noise token inside every vocabulary this tool writes.
DSPARK_BLOCK_SIZE = 5
DSPARK_STAGES = 3
DSPARK_MARKOV_RANK = 256
DSPARK_NOISE_TOKEN_ID = 2
DSPARK_TARGET_LAYERS = 3
DSPARK_KEYS = ("dspark_target_layer_ids", "dspark_markov_rank", "dspark_noise_token_id",
               "dspark_block_size", "n_mtp_layers")


def default_target_layers(kind: str, num_layers: int, n: int = DSPARK_TARGET_LAYERS) -> list[int]:
    """``n`` target layers spread evenly over the model, in each model's id convention:
    V4.1 reads the stream entering layer id (ids in [1, L]; eagle3_utils uses them as
    they are), V4 the output of layer id (ids in [0, L), shifted by one there)."""
    ids = sorted({max(1, round(num_layers * (j + 1) / (n + 1))) for j in range(n)})
    return ids if kind == "deepseek_v41" else [i - 1 for i in ids]


def spec_method(cfg) -> str | None:
    """The draft the config declares: "dspark", "mtp" or None."""
    if cfg.get("dspark_target_layer_ids"):
        return "dspark"
    if int(cfg.get("num_nextn_predict_layers", 0) or 0) > 0 and cfg.kind == "deepseek_v4":
        return "mtp"
    return None


def apply_spec(cfg, method: str | None) -> None:
    """Add ``method``'s config keys where the config lacks them (keys set in the config or
    by --set stay), then check the result."""
    if method is None:
        return
    if method not in SPEC_METHODS:
        raise ToolError(f"--spec {method!r}: choose one of {', '.join(SPEC_METHODS)}")
    text = cfg.text
    if method == "mtp":
        if cfg.kind != "deepseek_v4":
            raise ToolError(f"{cfg.source}: --spec mtp is DeepSeek-V4's draft; DeepSeek-V4.1 "
                            "checkpoints carry DSpark stages (vLLM refuses method='mtp' for "
                            "V4.1): use --spec dspark")
        if int(text.get("num_nextn_predict_layers", 0) or 0) < 1:
            text["num_nextn_predict_layers"] = 1
    else:
        L = int(cfg.need("num_hidden_layers"))
        defaults = {"dspark_target_layer_ids": default_target_layers(cfg.kind, L),
                    "dspark_markov_rank": DSPARK_MARKOV_RANK,
                    "dspark_noise_token_id": DSPARK_NOISE_TOKEN_ID,
                    "dspark_block_size": DSPARK_BLOCK_SIZE, "n_mtp_layers": DSPARK_STAGES}
        for key, value in defaults.items():
            text.setdefault(key, value)
    check_spec(cfg)


def check_spec(cfg) -> None:
    """The rules vLLM's draft classes rely on, one clear error each."""
    method = spec_method(cfg)
    src = cfg.source
    L = int(cfg.need("num_hidden_layers"))
    nextn = int(cfg.get("num_nextn_predict_layers", 0) or 0)
    if method is None:
        if nextn > 0 and cfg.kind == "deepseek_v41":
            raise ToolError(f"{src}: num_nextn_predict_layers {nextn} on DeepSeek-V4.1 needs "
                            "the DSpark keys (dspark_target_layer_ids, ...): V4.1 has no "
                            "classic MTP draft; use --spec dspark")
        return
    if method == "mtp":
        return
    if nextn > 0 and cfg.kind == "deepseek_v4":
        raise ToolError(f"{src}: DSpark and MTP both name their tensors mtp.*; set "
                        "num_nextn_predict_layers 0 for a DSpark checkpoint")
    missing = [k for k in DSPARK_KEYS if cfg.get(k) is None]
    if missing:
        raise ToolError(f"{src}: DSpark needs {', '.join(missing)} (make_checkpoint --spec "
                        "dspark adds the defaults)")
    ids = list(cfg.get("dspark_target_layer_ids"))
    lo, hi = (1, L) if cfg.kind == "deepseek_v41" else (0, L - 1)
    if ids != sorted(set(ids)) or ids[0] < lo or ids[-1] > hi:
        raise ToolError(f"{src}: dspark_target_layer_ids {ids} must be distinct, increasing "
                        f"and within [{lo}, {hi}] ({cfg.kind}'s aux-layer convention)")
    for key in ("dspark_markov_rank", "dspark_block_size", "n_mtp_layers"):
        if int(cfg.get(key)) < 1:
            raise ToolError(f"{src}: {key} must be >= 1")
    if not 0 <= int(cfg.get("dspark_noise_token_id")) < int(cfg.need("vocab_size")):
        raise ToolError(f"{src}: dspark_noise_token_id {cfg.get('dspark_noise_token_id')} "
                        f"is outside the vocabulary [0, {cfg.need('vocab_size')})")
    if cfg.get("draft_vocab_size") not in (None, cfg.need("vocab_size")):
        raise ToolError(f"{src}: draft_vocab_size must equal vocab_size (a full-vocabulary "
                        "draft; this tool writes no draft-to-target token map)")
    if int(cfg.get("dspark_n_routed_experts", 0) or 0) not in (0, int(cfg.need("n_routed_experts"))):
        raise ToolError(f"{src}: dspark_n_routed_experts other than n_routed_experts is not "
                        "written by this tool")
    if cfg.kind == "deepseek_v41":
        ratios = list(cfg.need("compress_ratios"))[L:]
        if any(int(r) for r in ratios):
            raise ToolError(f"{src}: compress_ratios entries past the backbone ({ratios}) "
                            "must be 0: the DSpark stages this tool writes are SWA-only")


def _block(p: str, cfg) -> list[Spec]:
    """One SWA-only decoder block (V4.1 ratio 0 / V4 ratio 1): norms, mHC, attention
    without compressor or indexer, MoE."""
    return _layer_common(p, cfg) + _attn_common(p, cfg) + _moe(p, cfg)


def _hc_head(p: str, cfg) -> list[Spec]:
    H, hc = cfg.need("hidden_size"), cfg.need("hc_mult")
    return [Spec(f"{p}hc_head_fn", (hc, hc * H), torch.float32, "dense", "fan_in"),
            Spec(f"{p}hc_head_base", (hc,), torch.float32, "dense", "hc_head_base"),
            Spec(f"{p}hc_head_scale", (1,), torch.float32, "dense", "hc_scale")]


def mtp_specs(cfg) -> list[Spec]:
    H = cfg.need("hidden_size")
    out: list[Spec] = []
    for j in range(int(cfg.need("num_nextn_predict_layers"))):
        p = f"mtp.{j}."
        out += _block(p, cfg)
        out += [_lin(f"{p}e_proj.weight", H, H), _lin(f"{p}h_proj.weight", H, H),
                _norm(f"{p}enorm.weight", H), _norm(f"{p}hnorm.weight", H),
                _norm(f"{p}norm.weight", H)]
        out += _hc_head(p, cfg)
    return out


def dspark_specs(cfg) -> list[Spec]:
    H, V = cfg.need("hidden_size"), cfg.need("vocab_size")
    r = int(cfg.need("dspark_markov_rank"))
    n = int(cfg.need("n_mtp_layers"))
    ids = list(cfg.need("dspark_target_layer_ids"))
    out = [_lin("mtp.0.main_proj.weight", H, H * len(ids)), _norm("mtp.0.main_norm.weight", H)]
    for i in range(n):
        out += _block(f"mtp.{i}.", cfg)
    last = f"mtp.{n - 1}."
    w1, w2 = (("embed", "head") if cfg.kind == "deepseek_v41" else ("markov_w1", "markov_w2"))
    out += [_norm(f"{last}norm.weight", H),
            Spec(f"{last}markov_head.{w1}.weight", (V, r), torch.bfloat16, "dense", "embed"),
            Spec(f"{last}markov_head.{w2}.weight", (V, r), torch.bfloat16, "dense", "fan_in"),
            Spec(f"{last}confidence_head.proj.weight", (1, H + r), torch.float32, "dense",
                 "fan_in")]
    if cfg.kind == "deepseek_v4":
        out += _hc_head(last, cfg)
    return out


def spec_tensor_specs(cfg) -> list[Spec]:
    """The draft's tensors (after the target's in the checkpoint); none without a draft."""
    check_spec(cfg)
    method = spec_method(cfg)
    if method == "mtp":
        return mtp_specs(cfg)
    if method == "dspark":
        return dspark_specs(cfg)
    return []
