"""Weight bytes: bytes per parameter of each checkpoint dtype and the parameters of one
decoder layer split by how tensor parallelism treats them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import PlannerInputError
from .layers import Layer
from .models import ModelFacts
from .sizes import INDEXER_HEAD_DIM


# --------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------
# Bytes per parameter including block scales: MXFP4 = 4 bits + one UE8M0 byte per 32;
# fp8 counted as MXFP8 (one UE8M0 per 32; V4's 128x128-block fp8 is ~1.0, so this is a
# 3% upper bound on dense weights); bf16 = 2. The V4.1 checkpoint table in
# [recipe-v41] uses exactly these formats (MXFP4 experts, MXFP8 dense, UE8M0 scales).
WEIGHT_BYTES = {"fp4": 0.5 + 1 / 32, "fp8": 1 + 1 / 32, "bf16": 2.0}
EXPERT_DTYPES = ("fp4", "fp8", "bf16")
DENSE_DTYPES = ("fp8", "bf16")


@dataclass(frozen=True)
class WeightDtypes:
    expert: str = "fp4"   # routed + shared experts (checkpoint: FP4)
    dense: str = "fp8"    # attention, compressor, indexer, router (checkpoint: FP8)
    embed: str = "bf16"   # embedding and LM head (checkpoint: BF16)
    engram: str = "fp8"   # V4.1 Engram tables (checkpoint: FP8)

    def __post_init__(self):
        for name, value, allowed in (("expert_dtype", self.expert, EXPERT_DTYPES),
                                     ("dense_dtype", self.dense, DENSE_DTYPES),
                                     ("embed_dtype", self.embed, DENSE_DTYPES),
                                     ("engram_dtype", self.engram, DENSE_DTYPES)):
            if value not in allowed:
                raise PlannerInputError(name, f"unknown {value!r}; expected one of {allowed}")


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one layer split by how TP treats them."""

    expert: float       # routed + shared experts, sharded across TP
    dense_tp: float     # attention projections sharded across TP
    dense_rep: float    # replicated on every TP rank

    @property
    def total(self) -> float:
        return self.expert + self.dense_tp + self.dense_rep


def layer_params(arch: dict[str, Any], layer: Layer) -> LayerParams:
    """Parameter count of one decoder layer from config shapes.

    TP-sharded: wq_b, wo_a, wo_b (Column/RowParallelLinear) and the MoE experts (TP shards
    the intermediate dim). Replicated: fused_wqa_wkv (disable_tp=True), compressor
    (disable_tp=True), indexer ("no tensor parallel, just replicated") and router
    (models/deepseek_v4/attention.py, models/deepseek_v41/attention.py, compressor.py).
    mHC mixing weights and norms (<0.1% of a layer) are ignored.
    """
    h, heads, d = arch["hidden_size"], arch["num_attention_heads"], arch["head_dim"]
    q, o_rank, groups = arch["q_lora_rank"], arch["o_lora_rank"], arch["o_groups"]
    experts, inter = arch["n_routed_experts"], arch["moe_intermediate_size"]
    shared = arch.get("n_shared_experts", 1)
    idx_h, idx_d = arch.get("index_n_heads", 64), arch.get("index_head_dim", INDEXER_HEAD_DIM)
    dense_tp = q * heads * d + (heads * d // groups) * (groups * o_rank) + groups * o_rank * h
    rep = h * (q + d) + h * experts
    names = {c.name for c in layer.caches}
    ratio = _layer_ratio(layer)
    if any(n.endswith(".kv") for n in names):  # owns a compressor
        coff = 2 if ratio == 4 else 1
        gated = ratio > 1
        rep += h * coff * d * (2 if gated else 1)
    if any(n.endswith(".indexer") for n in names):
        rep += q * idx_h * idx_d + h * idx_h
        if ratio == 4:  # the V4 indexer has its own (overlapping) compressor
            rep += h * 2 * 2 * idx_d
    expert = (experts + shared) * 3 * h * inter
    return LayerParams(expert, dense_tp, rep)


def _layer_ratio(layer: Layer) -> int:
    for c in layer.caches:
        if c.growth == "context":
            return c.tokens_per_state
    return 0


def model_params(model: ModelFacts, layers: list[Layer]) -> dict[str, float]:
    """Total parameters by component (for the cross-check against the published totals)."""
    per_layer = [layer_params(model.arch, x) for x in layers]
    embed = 2 * model.arch["vocab_size"] * model.arch["hidden_size"]  # embedding + LM head
    return {
        "experts": sum(p.expert for p in per_layer),
        "dense": sum(p.dense_tp + p.dense_rep for p in per_layer),
        "embed_and_head": embed,
        "total": sum(p.total for p in per_layer) + embed,
    }
