"""Topology planning: a TP x PP layout with a per-stage layer split, the 1M-context
workspaces, weights and KV budget per stage, KV tokens and 1M sequences, the split search."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .accounting import stack_bytes_per_token
from .errors import PlannerInputError
from .layers import CacheFormat, Layer
from .models import ModelFacts, build_stack
from .packing import PAGINGS, Packing, in_flight_tokens, pack, served_specs
from .sizes import (CONTEXT_1M, DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_MAX_CAPTURE_SIZE,
                    DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, GiB, SWA_BLOCK)
from .weights import WEIGHT_BYTES, WeightDtypes, layer_params
from .workspace import (A100_SM_COUNT, DECODE_TILES, Serving, ampere_reserved_bytes,
                        workspace_factor)

# What the Ampere path serves: the 584 B fp8_ds_mla record and the fp8 index-K cache (it
# refuses the MXFP4 one: attention/common.py DeepinferAmpereSparseAttnIndexer).
SERVED_AMPERE_FORMAT = CacheFormat("fp8", "fp8")


# --------------------------------------------------------------------------------------
# Topology planning
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """A TP x PP layout. ``tp`` has one entry per pipeline stage (asymmetric TP allowed)."""

    gpus: int
    gpu_mem_gib: float
    tp: tuple[int, ...]
    split: tuple[int, ...]
    util: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # Per-GPU memory that is neither weights, KV nor the 1M-context workspaces above:
    # peak activations of the profiling run at 2048 batched tokens, CUDA graphs, NCCL
    # buffers, the CUDA context, the sampler. An assumption (vLLM measures it at start-up).
    base_reserve_gib: float = 2.0
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = CONTEXT_1M
    # The decode reservations' limits (workspace.py Serving; vLLM's defaults on <70 GiB
    # GPUs): sequences, speculative tokens, the largest CUDA graph (0: eager), the SMs.
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    num_speculative_tokens: int = 0
    max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE
    sm_count: int = A100_SM_COUNT
    decode_variant: str = "sm80"
    # V4.1 YOCO readers whose kv source sits on another stage: "replicate" plans a copy of
    # the source's compressed + indexer cache on the reader's stage; "reject" fails like
    # upstream 0.33.0 does.
    cross_stage_kv: str = "replicate"
    engram_on_gpu: bool = False   # V4.1 Engram tables resident (else host/UVA offload)
    load_draft: bool = False      # speculative-decoding drafter (MTP / DSpark) on last stage
    label: str = ""
    # The serving path's kernel pages (packing.PAGINGS): "ampere" is the Ampere path as the
    # tree has it (64-token compressed-KV and index-K pages, kv_page64 on since 934a453).
    paging: str = "ampere"

    @property
    def pp(self) -> int:
        return len(self.split)


def parse_int_list(text: str, field_name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError as e:
        raise PlannerInputError(field_name, f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v <= 0 for v in values):
        raise PlannerInputError(field_name, f"expected positive integers, got {text!r}")
    return values


def even_split(num_layers: int, pp: int) -> tuple[int, ...]:
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if i < extra else 0) for i in range(pp))


def validate_topology(topo: Topology, model: ModelFacts) -> None:
    arch = model.arch
    n = arch["num_hidden_layers"]
    if not 0 < topo.util <= 1:
        raise PlannerInputError("util", f"must be in (0, 1], got {topo.util}")
    if topo.gpu_mem_gib <= 0:
        raise PlannerInputError("gpu_mem_gib", f"must be positive, got {topo.gpu_mem_gib}")
    if len(topo.tp) != topo.pp:
        raise PlannerInputError("tp", f"{len(topo.tp)} TP sizes for {topo.pp} pipeline stages")
    if sum(topo.split) != n:
        raise PlannerInputError(
            "split", f"layer split {','.join(map(str, topo.split))} sums to {sum(topo.split)}, "
            f"but {model.name} has {n} layers")
    if sum(topo.tp) != topo.gpus:
        raise PlannerInputError("gpus", f"the stages use {sum(topo.tp)} GPUs (sum of TP sizes), "
                                f"{topo.gpus} given")
    for tp in sorted(set(topo.tp)):
        for key in ("num_attention_heads", "o_groups"):
            if arch[key] % tp:
                raise PlannerInputError("tp", f"TP {tp} does not divide {key}={arch[key]} of {model.name}")
    if topo.paging not in PAGINGS:
        raise PlannerInputError("paging", f"unknown {topo.paging!r}; expected one of {tuple(PAGINGS)}")
    if topo.decode_variant not in DECODE_TILES:
        raise PlannerInputError("decode_variant", f"unknown {topo.decode_variant!r}; expected "
                                f"one of {tuple(DECODE_TILES)}")
    for name in ("max_num_seqs", "sm_count", "max_num_batched_tokens", "max_model_len"):
        if getattr(topo, name) <= 0:
            raise PlannerInputError(name, f"must be positive, got {getattr(topo, name)}")
    for name in ("num_speculative_tokens", "max_capture_size"):
        if getattr(topo, name) < 0:
            raise PlannerInputError(name, f"must be >= 0, got {getattr(topo, name)}")
    if topo.cross_stage_kv not in ("replicate", "reject"):
        raise PlannerInputError("cross_stage_kv", f"expected replicate|reject, got {topo.cross_stage_kv!r}")


def stage_ranges(split: tuple[int, ...]) -> list[range]:
    out, start = [], 0
    for n in split:
        out.append(range(start, start + n))
        start += n
    return out


def stage_caches(layers: list[Layer], ids: range) -> tuple[list[Layer], list[int]]:
    """Layers whose caches a stage holds: its own, plus a replica of each kv source that a
    reader in this stage needs from another stage. Returns (layers, replicated source ids)."""
    held = [layers[i] for i in ids]
    foreign = sorted({x.kv_source for x in held
                      if x.kv_source is not None and x.kv_source not in ids})
    replicas = [_context_only(layers[s]) for s in foreign]
    return held + replicas, foreign


def _context_only(layer: Layer) -> Layer:
    """The source's compressed + indexer caches (what a remote reader needs)."""
    return dataclasses.replace(layer, label=f"replica of layer {layer.index}",
                               caches=tuple(c for c in layer.caches if c.growth == "context"))


def serving_for(model: ModelFacts, topo: Topology, tp: int) -> Serving:
    """The reservations' limits on a GPU of a TP-``tp`` stage (workspace.py)."""
    arch = model.arch
    vision = arch.get("vision_max_n_token", 0) if arch.get("vision_n_layers", 0) else 0
    return Serving(heads=arch["num_attention_heads"] // tp,
                   index_topk=int(arch.get("index_topk", 0) or 0),
                   max_num_seqs=topo.max_num_seqs,
                   num_speculative_tokens=topo.num_speculative_tokens,
                   max_capture_size=topo.max_capture_size,
                   max_image_tokens=int(vision or 0) if model.family == "v4" else 0,
                   sm_count=topo.sm_count, variant=topo.decode_variant)


def workspace_bytes(held: list[Layer], topo: Topology, model: ModelFacts,
                    tp: int) -> dict[str, int]:
    """What a stage's GPUs reserve before vLLM sizes the KV cache (workspace.py), by term;
    upstream's path (paging upstream-sm90) has only its own prefill and indexer requests."""
    ampere = topo.paging.startswith("ampere")
    return ampere_reserved_bytes(held, topo.max_model_len, topo.max_num_batched_tokens,
                                 serving_for(model, topo, tp), yoco=ampere, ampere=ampere)


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: str
    tp: int
    weights_gib: float
    reserve_gib: float           # base reserve + the Ampere path's reservations
    kv_budget_gib: float
    kv_bytes_per_token: float
    request_bytes: int           # vLLM's per-request reservation at max_model_len (packed)
    kv_tokens: int               # raw tokens that fit (per-token bytes, no per-seq overhead)
    seqs: float                  # max_model_len sequences that fit (vLLM concurrency)
    replicated_sources: tuple[int, ...] = ()
    block_bytes: int = 0         # one pool block on this stage (packing.py)
    num_blocks: int = 0          # pool blocks this stage's budget holds
    reserved: dict[str, int] = field(default_factory=dict)  # workspace.py's terms, bytes


@dataclass
class Plan:
    model: str
    label: str
    topology: dict[str, Any]
    cache_format: str
    stages: list[StagePlan]
    kv_tokens: int = 0           # min over stages: GPU-resident KV tokens of the pipeline
    seqs: float = 0.0            # min over stages: max_model_len sequences
    reported_tokens: int = 0     # what vLLM logs: int(seqs * max_model_len)
    packing: dict[str, Any] = field(default_factory=dict)  # groups, blocks per request
    fits: bool = True
    warnings: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def bottleneck(self) -> StagePlan:
        return min(self.stages, key=lambda st: st.seqs)


def stage_weight_bytes(model: ModelFacts, layers: list[Layer], ids: range, tp: int,
                       dtypes: WeightDtypes, first: bool, last: bool, topo: Topology) -> float:
    """Weight bytes on one GPU of a stage."""
    arch = model.arch
    eb, db = WEIGHT_BYTES[dtypes.expert], WEIGHT_BYTES[dtypes.dense]
    total = 0.0
    for i in ids:
        p = layer_params(arch, layers[i])
        total += p.expert * eb / tp + p.dense_tp * db / tp + p.dense_rep * db
    vocab_h = arch["vocab_size"] * arch["hidden_size"]
    total += (first + last) * vocab_h * WEIGHT_BYTES[dtypes.embed] / tp  # vocab-parallel
    if topo.engram_on_gpu and model.engram_params_b:
        total += _engram_bytes(model, ids, dtypes) / tp
    if topo.load_draft and last and model.draft_params_b:
        total += model.draft_params_b * 1e9 * eb / tp
    return total


def _engram_bytes(model: ModelFacts, ids: range, dtypes: WeightDtypes) -> float:
    """Engram tables of the layers in ``ids`` (row-sharded across TP, split evenly
    between the engram layers)."""
    engram_layers = list(model.arch.get("engram_layer_ids") or [])
    if not engram_layers:
        return 0.0
    here = sum(1 for i in engram_layers if i in ids)
    return model.engram_params_b * 1e9 * WEIGHT_BYTES[dtypes.engram] * here / len(engram_layers)


def plan(model: ModelFacts, topo: Topology, dtypes: WeightDtypes = WeightDtypes(),
         fmt: CacheFormat = SERVED_AMPERE_FORMAT, layers: list[Layer] | None = None) -> Plan:
    """Weights per GPU, KV budget, KV tokens and 1M sequences per stage and overall.
    ``layers`` (the stack for ``fmt``) may be passed in to skip rebuilding it."""
    validate_topology(topo, model)
    layers = layers or build_stack(model, fmt)
    result = Plan(model.name, topo.label, dataclasses.asdict(topo), fmt.label(), [])
    ranges = stage_ranges(topo.split)
    staged = []
    for s, ids in enumerate(ranges):
        held, foreign = stage_caches(layers, ids)
        if foreign:
            _cross_stage(result, topo, s, ids, foreign, layers)
        weights = stage_weight_bytes(model, layers, ids, topo.tp[s], dtypes, s == 0,
                                     s == len(ranges) - 1, topo)
        staged.append((s, ids, held, foreign, weights))
    packing, names = _stage_packing(model, topo, staged)
    for s, ids, held, foreign, weights in staged:
        result.stages.append(_stage_plan(model, s, ids, topo, held, foreign, weights, packing,
                                         names[s]))
    if len(set(topo.tp)) > 1:
        result.warnings.append(
            f"per-stage TP sizes {'/'.join(map(str, topo.tp))}: vLLM 0.33.0 has one "
            "tensor_parallel_size for every pipeline stage (config/parallel.py), so an asymmetric "
            "layout needs two engines with a hand-off or a patched launcher; planned as if supported")
    if topo.paging.startswith("ampere") and fmt.indexer != "fp8":
        result.warnings.append(
            f"indexer {fmt.indexer}: the Ampere path serves only the fp8 index-K cache (it "
            "refuses MXFP4: attention/common.py DeepinferAmpereSparseAttnIndexer; upstream has "
            "no bf16 one); planned as a what-if")
    _summarize(result, topo, packing)
    result.assumptions = plan_assumptions(model, topo, dtypes, fmt)
    return result


def _stage_packing(model: ModelFacts, topo: Topology, staged) -> tuple[Packing, list[list[str]]]:
    """vLLM groups the caches of the whole model (get_global_kv_cache_groups); each stage's
    pool block holds the pages of its own caches. Replicas get names of their own."""
    paging = PAGINGS[topo.paging]
    specs, names = [], []
    for s, ids, held, foreign, _ in staged:
        own = [x for x in held if x.index in ids]
        reps = [x for x in held if x.index not in ids]
        mine = served_specs(own, model.family, paging)[1]
        mine += served_specs(reps, model.family, paging, prefix=f"stage{s}.replica.")[1]
        specs += mine
        names.append([c.name for c in mine])
    return pack(specs), names


def _stage_plan(model: ModelFacts, s: int, ids: range, topo: Topology, held: list[Layer],
                foreign: list[int], weights: float, packing: Packing,
                names: list[str]) -> StagePlan:
    in_flight = in_flight_tokens(topo.max_num_batched_tokens, topo.pp)
    reserved = workspace_bytes(held, topo, model, topo.tp[s])
    reserve = topo.base_reserve_gib * GiB + reserved["total"]
    budget = max(topo.util * topo.gpu_mem_gib * GiB - weights - reserve, 0.0)
    per_token = stack_bytes_per_token(held)
    block = packing.bytes_per_block(names)
    blocks = packing.blocks_per_request(topo.max_model_len, in_flight)
    num_blocks = int(budget // block) if block else 0
    tokens = int(budget // per_token) if per_token else 0
    return StagePlan(s, f"{ids.start}-{ids.stop - 1}", topo.tp[s], weights / GiB, reserve / GiB,
                     budget / GiB, per_token, block * blocks, tokens, num_blocks / blocks,
                     tuple(foreign), block, num_blocks,
                     {k: v for k, v in reserved.items() if k != "total"})


def _cross_stage(result: Plan, topo: Topology, s: int, ids: range, foreign: list[int],
                 layers: list[Layer]) -> None:
    readers = [i for i in ids if layers[i].kv_source in foreign]
    who = (f"layer {readers[0]} reads" if len(readers) == 1
           else f"layers {readers[0]}-{readers[-1]} read")
    msg = (f"stage {s}: {who} the KV of layer "
           f"{', '.join(map(str, foreign))} on an earlier stage; upstream 0.33.0 raises "
           "NotImplementedError ('PP splits inside a v4.1 kv-sharing group are not supported', "
           "models/deepseek_v41/attention.py)")
    if topo.cross_stage_kv == "reject":
        raise PlannerInputError("split", msg)
    result.warnings.append(msg + "; planned with a replica of that layer's compressed + indexer "
                           "cache on this stage (assumes the overlay ships the source latent with "
                           "the PP activations)")


def _summarize(result: Plan, topo: Topology, packing: Packing) -> None:
    for st in result.stages:
        if st.kv_budget_gib <= 0:
            result.fits = False
            result.warnings.append(
                f"stage {st.stage}: weights {st.weights_gib:.1f} GiB + reserve {st.reserve_gib:.1f} GiB "
                f"exceed {topo.util:g} x {topo.gpu_mem_gib:g} GiB per GPU; does not fit")
    result.kv_tokens = min(st.kv_tokens for st in result.stages)
    result.seqs = min(st.seqs for st in result.stages)
    result.reported_tokens = int(result.seqs * topo.max_model_len)
    in_flight = in_flight_tokens(topo.max_num_batched_tokens, topo.pp)
    widest = max(g.page_bytes() for g in packing.groups)
    result.packing = {
        "paging": topo.paging,
        "groups": [{"kind": g.kind, "block_size": g.block_size, "caches": len(g.specs),
                    "page_bytes": g.page_bytes(),
                    "blocks_per_request": g.pages_per_request(topo.max_model_len, in_flight)}
                   for g in packing.groups],
        "bytes_per_block": packing.bytes_per_block(),
        "blocks_per_request": packing.blocks_per_request(topo.max_model_len, in_flight)}
    if packing.bytes_per_block() > 2 * widest:
        result.warnings.append(
            f"paging {topo.paging}: the pool block is {packing.bytes_per_block():,} B for a widest "
            f"group of {widest:,} B (the LCM of the compressed caches' kernel-page strides, "
            "packing.py): the V4.1 index-K backend's page differs from the compressed KV's")


def plan_assumptions(model: ModelFacts, topo: Topology, dtypes: WeightDtypes,
                     fmt: CacheFormat) -> list[str]:
    """Every assumption behind a plan, in words."""
    factor = workspace_factor(topo.max_model_len)
    serving = serving_for(model, topo, topo.tp[0])
    a = [
        f"model facts: {model.source}; parameters computed from config shapes (mHC and norms ignored)",
        f"weights: experts {dtypes.expert} ({WEIGHT_BYTES[dtypes.expert]:.4f} B/param incl. scales), "
        f"dense {dtypes.dense} ({WEIGHT_BYTES[dtypes.dense]:.4f} B/param), embedding/LM head "
        f"{dtypes.embed}; experts and wq_b/wo_a/wo_b sharded by TP; low-rank input projections, "
        "compressor, indexer and router replicated; embedding on the first stage, LM head on the last",
        f"KV cache: {fmt.label()}; MLA caches have one KV head, so every TP rank of a stage holds "
        "the whole stage's KV (max_tp_shards=1)",
        f"memory: {topo.gpu_mem_gib:g} GiB per GPU x gpu_memory_utilization {topo.util:g}, minus "
        f"weights, minus a {topo.base_reserve_gib:g} GiB base reserve (activations at "
        f"{topo.max_num_batched_tokens} batched tokens, CUDA graphs, NCCL, CUDA context), minus "
        "what the Ampere path reserves in the profile run (workspace.py, overlay reserve.py: "
        "vLLM's workspace at its largest request -- the prefill gather 4 x (L/ratio + window + "
        f"batched tokens) x 1 KiB, the indexer K gather (factor {factor}), the decode scratch "
        f"at up to {serving.decode_tokens(topo.max_num_batched_tokens)} decode tokens "
        f"(max_num_seqs {topo.max_num_seqs}, {topo.num_speculative_tokens} speculative tokens, "
        f"largest CUDA graph {topo.max_capture_size}; {topo.decode_variant} tiles, "
        f"{topo.sm_count} SMs) or the indexer's decode logits "
        f"({serving.indexer_decode_rows(topo.max_num_batched_tokens)} rows x L/ratio fp32) --, "
        "plus the combined index lists, the cross-layer gather buffer and indexer-K rows, the "
        "512 MiB indexer logits" + ("" if topo.paging.startswith("ampere") else
                                    "; upstream's path: its prefill and indexer requests only")
        + ")",
        f"paging {topo.paging} ({PAGINGS[topo.paging].note}): vLLM's block-outermost packing of "
        f"the cache groups (packing.py), SWA blocks of {SWA_BLOCK[model.family]}; a request "
        f"reserves its groups' blocks at max_model_len {topo.max_model_len:,} with "
        f"{in_flight_tokens(topo.max_num_batched_tokens, topo.pp):,} in-flight tokens "
        "(VllmConfig.max_in_flight_tokens: two batches with async scheduling, pp with PP)",
        "kv_tokens = KV budget / marginal bytes per token (bottleneck stage); seqs = pool blocks / "
        "blocks per request (vLLM's max concurrency); reported_tokens = int(seqs x max_model_len), "
        "the figure vLLM logs as 'GPU KV cache size'",
        "each pipeline stage sizes its own pool; the pipeline is limited by its worst stage",
    ]
    if model.family == "v41":
        a.append("V4.1 Engram tables " + ("resident on GPU (row-sharded across TP)" if topo.engram_on_gpu
                                         else "offloaded to host memory (engram cpu_offload, as the "
                                         "upstream recipe does on 80 GB GPUs)"))
    a.append("speculative-decoding drafter " + ("loaded on the last stage" if topo.load_draft
                                                else "not loaded"))
    if topo.num_speculative_tokens and model.family == "v41":
        a.append("decode reservations with speculative tokens: a DSpark drafter's wider decode "
                 "SWA rows (reserve.py Limits.dspark) are not modelled (workspace.py)")
    return a


def search_split(model: ModelFacts, topo: Topology, dtypes: WeightDtypes = WeightDtypes(),
                 fmt: CacheFormat = SERVED_AMPERE_FORMAT, slack: int = 1) -> Plan:
    """The best plan over layer splits within ``slack`` layers of an even split: most 1M
    sequences, then fewest cross-stage replicas, then the lightest heaviest stage."""
    n = model.arch["num_hidden_layers"]
    layers = build_stack(model, fmt)
    candidates = [plan(model, dataclasses.replace(topo, split=split), dtypes, fmt, layers)
                  for split in _near_even_splits(n, topo.pp, slack)]
    return max(candidates, key=_split_rank)


def _split_rank(p: Plan) -> tuple[float, int, float]:
    replicas = sum(len(st.replicated_sources) for st in p.stages)
    return (round(p.seqs, 6), -replicas, -max(st.weights_gib for st in p.stages))


def _near_even_splits(n: int, pp: int, slack: int):
    base = n // pp
    choices = range(max(1, base - slack), base + slack + 2)

    def rec(prefix: tuple[int, ...], left: int):
        if len(prefix) == pp - 1:
            if left in choices:
                yield prefix + (left,)
            return
        for c in choices:
            if c < left:
                yield from rec(prefix + (c,), left - c)

    yield from rec((), n)
