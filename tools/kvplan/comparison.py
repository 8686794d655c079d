"""The 6 x 64 GiB comparison (TP2 x PP3, PP6, TP2 + TP4) and the gap to the
4,648,480-token reference."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .layers import CacheFormat
from .models import ModelFacts
from .planning import SERVED_AMPERE_FORMAT, Plan, Topology, even_split, plan, search_split
from .sizes import GiB
from .weights import WeightDtypes


# --------------------------------------------------------------------------------------
# The 6-GPU comparison
# --------------------------------------------------------------------------------------
# Reference point: 6 GA100 64 GB GPUs, TP2 x PP3, split 14,14,12 -> 4,648,480 GPU-resident
# KV tokens (~4.43 sequences of 1M). The split sums to 40: the V4.1 stack (V4-Flash has 43
# layers, V4-Pro 61).
REFERENCE_TOKENS = 4_648_480
REFERENCE_SPLIT = (14, 14, 12)
REFERENCE_GPUS = 6
REFERENCE_GPU_MEM_GIB = 64.0  # assumed 64 GiB (65,536 MiB), as "80 GB" A100s have 80 GiB


def six_gpu_topologies(num_layers: int) -> list[Topology]:
    """TP2 x PP3 (14,14,12 for a 40-layer stack), PP6 (searched split) and an asymmetric
    TP2 + TP4 pipeline, on 6 x 64 GiB."""
    base = dict(gpus=REFERENCE_GPUS, gpu_mem_gib=REFERENCE_GPU_MEM_GIB)
    tp2pp3 = REFERENCE_SPLIT if num_layers == sum(REFERENCE_SPLIT) else even_split(num_layers, 3)
    # Asymmetric: a TP2 stage then a TP4 stage with a 14:26 (about 1:2) layer split; for
    # V4.1 the cut at layer 14 keeps every kv-sharing group (2, 8 | 14, 20) in one stage.
    first = round(num_layers * 14 / 40)
    return [
        Topology(tp=(2, 2, 2), split=tp2pp3, label="TP2 x PP3", **base),
        Topology(tp=(1,) * 6, split=even_split(num_layers, 6), label="PP6", **base),
        Topology(tp=(2, 4), split=(first, num_layers - first), label="TP2 + TP4 (PP2)", **base),
    ]


def compare_six_gpus(model: ModelFacts, dtypes: WeightDtypes = WeightDtypes(),
                     fmt: CacheFormat = SERVED_AMPERE_FORMAT, **overrides) -> list[Plan]:
    plans = []
    for topo in six_gpu_topologies(model.arch["num_hidden_layers"]):
        topo = dataclasses.replace(topo, **overrides)
        if topo.label == "PP6":
            p = search_split(model, topo, dtypes, fmt)
            p.label = f"PP6 (split {','.join(map(str, p.topology['split']))})"
            plans.append(p)
        else:
            plans.append(plan(model, topo, dtypes, fmt))
    return plans


@dataclass(frozen=True)
class ReferenceGap:
    reference_tokens: int
    planned_tokens: int
    ratio: float                 # planned / reference
    kv_gib_gap_per_gpu: float    # extra non-KV memory per GPU the reference implies
    implied_util: float          # gpu_memory_utilization that would reproduce the reference


def reference_applies(model: ModelFacts) -> bool:
    """The reference split 14,14,12 only fits a 40-layer stack (V4.1)."""
    return model.arch["num_hidden_layers"] == sum(REFERENCE_SPLIT)


def reference_gap(p: Plan, target_tokens: int = REFERENCE_TOKENS) -> ReferenceGap:
    """How far a plan's vLLM-reported tokens are from the reference, in per-GPU GiB of
    memory on the bottleneck stage and as an equivalent gpu_memory_utilization."""
    st = p.bottleneck()
    topo = p.topology
    needed = target_tokens / topo["max_model_len"] * st.request_bytes / GiB
    gap = st.kv_budget_gib - needed
    util = topo["util"] - gap / topo["gpu_mem_gib"]
    return ReferenceGap(target_tokens, p.reported_tokens, p.reported_tokens / target_tokens, gap, util)
