"""Model facts: the V4-Flash / V4-Pro architectures and the V4.1 entry (its architecture
comes from a config.json), with the source of every field; config loading and the stack
of a resolved model."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .accounting import PUBLISHED_V4_RATIOS
from .errors import PlannerInputError
from .layers import CacheFormat, Layer, v4_stack, v41_stack


# --------------------------------------------------------------------------------------
# Model facts (assumptions where the source cannot tell)
# --------------------------------------------------------------------------------------
# Architecture fields in HF config.json names. Sources:
# - [recipe-flash] recipes/models/deepseek-ai/DeepSeek-V4-Flash*.yaml in the 0.33.0 sdist:
#   284B total / 13B active, 43 layers, 256 routed experts, 6 active, ~160 GB checkpoint.
# - [ratios-flash] tests/transformers_utils/test_deepseek_v4_utils.py: compress_ratios
#   [0, 0] + [4, 128] * 20 + [4] (+ 3 MTP entries) as shipped by V4-Flash-Vision-Exp.
# - [recipe-pro] recipes/models/deepseek-ai/DeepSeek-V4-Pro.yaml: 1.6T total / 49B
#   active, ~865 GB preview checkpoint.
# - [pro-shapes] tests/models/test_dsv4_mono_numerics.py: hidden 7168, q rank 1536,
#   head dim 512, 128 heads, 16 o-groups, o rank 1024, window 128;
#   tests/models/test_dsv4_mono_layers.py: the checkpoint's first ratios 128, 128, 4, 128, 4;
#   tests/kernels/test_ll_bf16_gemm.py: router width 384 ("DSV4-Pro").
# - [published] the DeepSeek-V4 report arithmetic: 30 c4a + 31 c128a layers.
# - [card] public model cards (not in the sdist): V4-Flash hidden 4096, 64 heads, 8 o-groups,
#   q rank 1024, moe_intermediate 2048; V4-Pro moe_intermediate 3072; vocab 129280 for
#   both. These make the computed totals land on 284B and ~1.6T (checked by the tests).
# - [assumed] not in the sdist: the served config's value (benchmarks/e2e/configs/v4-long,
#   index_topk 512, as V4.1's); only the C4A layers' reservations (decode scratch, combined
#   lists, workspace.py) read it.
# - [design] V4.1 attention shapes of vLLM 0.33.0 (tools/configs/README.md, field by field); [recipe-v41]
#   recipes/models/deepseek-ai/DeepSeek-V4.1-Flash.yaml for 40 layers, 384 experts
#   (6 active + 1 shared), kv sources 2/8/14/20, Engram on layers 1 and 14 (196.6B params,
#   FP8), the ~14B DSpark drafter, 552B backbone, 890 B/token global KV.
V4_FLASH_ARCH: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "num_hidden_layers": 43,                     # [recipe-flash]
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4],  # [ratios-flash]
    "hidden_size": 4096,                         # [card]
    "num_attention_heads": 64,                   # [card]
    "head_dim": 512,                             # V4 family, all sources
    "q_lora_rank": 1024,                         # [card]
    "o_lora_rank": 1024,                         # [card]
    "o_groups": 8,                               # [card]
    "n_routed_experts": 256,                     # [recipe-flash]
    "n_shared_experts": 1,                       # [card]
    "moe_intermediate_size": 2048,               # [card]
    "vocab_size": 129280,                        # [card]
    "index_n_heads": 64,                         # models/deepseek_v4/attention.py comment
    "index_head_dim": 128,                       # models/deepseek_v4/attention.py comment
    "index_topk": 512,                           # [assumed] benchmarks/e2e/configs/v4-long
    "sliding_window": 128,                       # [pro-shapes], [design]
}
V4_PRO_ARCH: dict[str, Any] = {
    **V4_FLASH_ARCH,
    "num_hidden_layers": 61,                     # [published]
    "compress_ratios": PUBLISHED_V4_RATIOS,      # [published] + [pro-shapes] first five
    "hidden_size": 7168,                         # [pro-shapes]
    "num_attention_heads": 128,                  # [pro-shapes]
    "q_lora_rank": 1536,                         # [pro-shapes]
    "o_groups": 16,                              # [pro-shapes]
    "n_routed_experts": 384,                     # [pro-shapes]
    "moe_intermediate_size": 3072,               # [card]
}


@dataclass(frozen=True)
class ModelFacts:
    name: str
    family: str                 # "v4" | "v41"
    published_params_b: float   # total parameters as published (billions)
    arch: dict[str, Any]
    draft_params_b: float = 0.0  # MTP / DSpark drafter, loaded only with speculative decoding
    engram_params_b: float = 0.0  # V4.1 Engram tables (FP8)
    source: str = ""


MODEL_FACTS: dict[str, ModelFacts] = {
    "v4-flash": ModelFacts("DeepSeek-V4-Flash", "v4", 284.0, V4_FLASH_ARCH,
                           source="[recipe-flash] 284B/13B (the task brief says 285B); "
                                  "[ratios-flash]; [card]"),
    "v4-pro": ModelFacts("DeepSeek-V4-Pro", "v4", 1600.0, V4_PRO_ARCH,
                         source="[recipe-pro] 1.6T/49B; [pro-shapes]; [published]; [card]"),
    # V4.1: architecture comes from a config.json (tools/configs/ has an illustrative one).
    "v4.1": ModelFacts("DeepSeek-V4.1-Flash", "v41", 552.0, {}, draft_params_b=14.0,
                       engram_params_b=196.6,
                       source="[design]; [recipe-v41] 552B backbone, 196.6B Engram, ~14B DSpark"),
}


def model_names() -> tuple[str, ...]:
    return tuple(MODEL_FACTS)


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a HF config.json; a nested ``text_config`` (V4.1) is flattened on top."""
    p = Path(path)
    if not p.is_file():
        raise PlannerInputError("config", f"no such file: {p}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise PlannerInputError("config", f"{p}: not JSON ({e})") from e
    flat = {k: v for k, v in cfg.items() if k != "text_config"}
    flat.update(cfg.get("text_config") or {})
    return flat


REQUIRED_ARCH_FIELDS = ("num_hidden_layers", "compress_ratios", "hidden_size", "num_attention_heads",
                        "head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts",
                        "moe_intermediate_size", "vocab_size")


def resolve_model(name: str, config: dict[str, Any] | None = None) -> ModelFacts:
    """Model facts by name; a config dict overrides (and for V4.1 supplies) the arch."""
    if name not in MODEL_FACTS:
        raise PlannerInputError("model", f"unknown model {name!r}; expected one of {model_names()}")
    facts = MODEL_FACTS[name]
    arch = {**facts.arch, **(config or {})}
    missing = [k for k in REQUIRED_ARCH_FIELDS if k not in arch]
    if missing:
        what = "config" if facts.family == "v41" else "model"
        raise PlannerInputError(what, f"{facts.name} needs config fields {missing}")
    return dataclasses.replace(facts, arch=arch)


def build_stack(model: ModelFacts, fmt: CacheFormat) -> list[Layer]:
    arch = model.arch
    if model.family == "v41":
        return v41_stack(arch, fmt)
    ratios = list(arch["compress_ratios"])[: arch["num_hidden_layers"]]
    return v4_stack(ratios, fmt, arch.get("sliding_window", 128))
