"""KV-cache capacity and topology planner for 1M-token DeepSeek V3.2 / V4 / V4.1 contexts.

Pure Python standard library: no torch, no vLLM, no GPU. Two layers of answers:

1. Cache arithmetic. Bytes per token and per sequence of each layer type (V3.2-style MLA +
   indexer; V4 c4a / c128a / sliding-window-only; V4.1 compress ratio 0/1/2 with YOCO
   KV-source sharing) for bf16, the 584-byte fp8 record and the fp8/fp4 indexer caches,
   both the way the published figures count them (exact tokens, no paging) and the way
   vLLM 0.33.0 pages them (256-token logical blocks, per-type page sizes with alignment
   padding, page-size buckets).
2. Topology planning. Weights per GPU for a TP x PP layout with a per-stage layer split,
   the KV budget left under a memory-utilization fraction, and how many KV tokens and 1M
   sequences fit. Every number that is not derived from the upstream source is an
   assumption, listed in ``MODEL_FACTS`` / ``Topology`` and echoed in each plan's output.

Upstream file references are relative to the ``vllm/`` package of vLLM 0.33.0.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------
KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
CONTEXT_1M = 1 << 20  # 1,048,576 tokens: the "1M" of the published figures

# --------------------------------------------------------------------------------------
# Cache record sizes: bytes per stored state (one token, or one compressed token)
# --------------------------------------------------------------------------------------
# DeepSeek-V3.2 MLA latent: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values.
V32_LATENT_DIM = 576
# V4 / V4.1 compressed and SWA KV: head_dim 512 (448 NoPE + 64 RoPE), one latent per state;
# MLAAttentionSpec has head_size_v=0, so bf16 pages hold 512 x 2 B per state
# (v1/kv_cache_interface.py: AttentionSpec.state_content_size_bytes, MLAAttentionSpec).
V4_HEAD_DIM = 512
# Indexer key width (config.index_head_dim, "# 128" in models/deepseek_v4/attention.py).
INDEXER_HEAD_DIM = 128
BF16 = 2  # bytes per bf16 value

# V3.2 fp8_ds_mla row: 512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE = 656 B
# (v1/attention/backends/mla/flashmla_sparse.py, the FlashMLA sparse cache-format note).
V32_FP8_RECORD = 512 + 4 * 4 + 64 * BF16
# V4 (and V4.1 off SM100) fp8_ds_mla record: 448 fp8 NoPE + 64 bf16 RoPE + 7 UE8M0 scales
# + 1 pad byte = 584 B (models/deepseek_v4/attention.py: state_content_bytes=584).
V4_FP8_RECORD = 448 + 64 * BF16 + 8
# V4.1 on SM100 only: 512 fp8 + 16 UE8M0 = 528 B; nvfp4_ds_mla compressed record 288 B
# (models/deepseek_v41/attention.py: swa_bytes_per_token, compressed_bytes_per_token).
V41_MXFP8_RECORD = 528
V41_NVFP4_COMPRESSED_RECORD = 288

# Indexer K cache row (models/deepseek_v41/attention.py::_indexer_k_cache_head_dim and
# models/deepseek_v4/attention.py::DeepseekV4Indexer): fp8 = 128 fp8 + one fp32 scale per
# 128 = 132 B; MXFP4 = 64 packed bytes + one UE8M0 per 32 values = 68 B. bf16 (256 B) is
# the published accounting only; upstream has no bf16 indexer cache.
INDEXER_RECORD = {
    "bf16": INDEXER_HEAD_DIM * BF16,
    "fp8": INDEXER_HEAD_DIM + INDEXER_HEAD_DIM // 128 * 4,
    "fp4": INDEXER_HEAD_DIM // 2 + INDEXER_HEAD_DIM // 32,
}
ATTN_DTYPES = ("bf16", "fp8", "mxfp8", "nvfp4")  # the last two: V4.1 on SM100 only
INDEXER_DTYPES = tuple(INDEXER_RECORD)

# Compressor state rows are fp32 [kv_state, score_state] (models/deepseek_v4/compressor.py,
# models/deepseek_v41/compressor.py: state_dim = 2 * coff * head_dim, dtype float32).
FP32 = 4

# --------------------------------------------------------------------------------------
# Paging facts of vLLM 0.33.0
# --------------------------------------------------------------------------------------
# V4 sparse MLA kernels take 256-token pages (models/deepseek_v4/sparse_mla.py:
# get_supported_kernel_block_sizes -> [256]); the compressor comment "[256//4, head_dim]"
# in models/deepseek_v4/compressor.py. V4.1 uses the same logical block here; its kernel
# blocks are 128 tokens off SM90 (models/deepseek_v41/sparse_mla.py).
LOGICAL_BLOCK = 256
# Sliding-window pages: V4 uses DeepseekV4SWACache's default block_size=64
# (v1/attention/backends/mla/sparse_swa.py); V4.1 passes block_size=32.
SWA_BLOCK = {"v4": 64, "v41": 32}
# Packed 584 B-record (fp8_ds_mla) pages are padded to 576 B multiples, plain ones and the
# V4.1 SM100 records to 512 B (alignment=576 if uses_fp8_ds_mla_layout else 512 in the V4
# specs; kv_page_alignment = 512 if kv_mxfp8 else 576 in models/deepseek_v41/attention.py;
# padding: v1/kv_cache_interface.py::_apply_alignment_padding).
PACKED_ALIGNMENT = 576
PLAIN_ALIGNMENT = 512
# V4 CompressorStateCache block sizes: 4 rows (C4), 8 rows (C128); V4.1's ring is
# max(8, next_pow2(num_speculative_tokens + 2)) rows, 8 without speculative decoding.
V4_STATE_BLOCK = {4: 4, 128: 8}
V41_RING_ROWS = 8
# vLLM defaults used for the per-request reservation (config/scheduler.py,
# engine/arg_utils.py: 2048 batched tokens for the API server on <70 GiB or A100 GPUs;
# config/cache.py: gpu_memory_utilization 0.92).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92


class PlannerInputError(ValueError):
    """Bad planner input; ``field`` names the offending input."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------
# Cache kinds and layers
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheKind:
    """One cache tensor a layer owns.

    growth: "context" (one state per ``tokens_per_state`` tokens of the sequence),
    "window" (only the last ``window`` tokens, one state per token) or "ring" (a fixed
    ``rows`` rows per sequence). ``published`` says whether the published arithmetic
    counts it (compressor state is not counted there).
    """

    name: str
    record_bytes: int
    growth: str
    tokens_per_state: int = 1
    window: int = 0
    rows: int = 0
    block_tokens: int = LOGICAL_BLOCK
    alignment: int | None = None
    published: bool = True
    upstream_spec: str = "MLAAttentionSpec"

    def bytes_per_token(self) -> float:
        """Marginal bytes per extra context token (0 for bounded caches)."""
        return self.record_bytes / self.tokens_per_state if self.growth == "context" else 0.0

    def bytes_for(self, n_tokens: int) -> int:
        """Exact bytes for a sequence of ``n_tokens`` (the published method: no paging)."""
        if self.growth == "context":
            return n_tokens // self.tokens_per_state * self.record_bytes
        if self.growth == "window":
            return min(n_tokens, self.window) * self.record_bytes
        return self.rows * self.record_bytes

    def states_per_page(self) -> int:
        return self.block_tokens // self.tokens_per_state if self.growth == "context" else self.block_tokens

    def page_bytes(self) -> int:
        """Page size as vLLM sizes it: states per block x record, padded to the alignment."""
        raw = self.states_per_page() * self.record_bytes
        return round_up(raw, self.alignment) if self.alignment else raw

    def paged_bytes_per_request(self, max_len: int, in_flight_tokens: int) -> int:
        """Per-request reservation as vLLM counts it (``max_memory_usage_bytes``):
        full specs cdiv(max_len, block) pages; sliding windows
        cdiv(window - 1 + in_flight, block) + 1 pages; a ring one page
        (v1/kv_cache_interface.py: FullAttentionSpec, SlidingWindowSpec, CircularBufferSpec)."""
        if self.growth == "context":
            return cdiv(max_len, self.block_tokens) * self.page_bytes()
        if self.growth == "window":
            tokens = min(self.window - 1 + in_flight_tokens, max_len)
            return (cdiv(tokens, self.block_tokens) + 1) * self.page_bytes()
        return self.page_bytes()


@dataclass(frozen=True)
class Layer:
    """A decoder layer: its type label, the caches it owns, and (V4.1 YOCO consumers) the
    layer whose compressed + indexer caches it reads instead of owning them."""

    index: int
    label: str
    caches: tuple[CacheKind, ...]
    kv_source: int | None = None

    def owns_context_cache(self) -> bool:
        return any(c.growth == "context" for c in self.caches)


@dataclass(frozen=True)
class CacheFormat:
    """attn: bf16 | fp8 (584/656 B records) | mxfp8 | nvfp4 (V4.1 SM100 records);
    indexer: bf16 | fp8 | fp4."""

    attn: str = "bf16"
    indexer: str = "bf16"

    def __post_init__(self):
        if self.attn not in ATTN_DTYPES:
            raise PlannerInputError("attn_dtype",
                                    f"unknown {self.attn!r}; expected one of {ATTN_DTYPES}")
        if self.indexer not in INDEXER_DTYPES:
            raise PlannerInputError("indexer_dtype",
                                    f"unknown {self.indexer!r}; expected one of {INDEXER_DTYPES}")

    @property
    def packed(self) -> bool:
        """The 584 B fp8_ds_mla record, whose pages are padded to 576 B multiples."""
        return self.attn == "fp8"

    def label(self) -> str:
        return f"attn {self.attn} + indexer {self.indexer}"


def _alignment(fmt: CacheFormat) -> int:
    return PACKED_ALIGNMENT if fmt.packed else PLAIN_ALIGNMENT


def _v4_swa_record(fmt: CacheFormat, family: str) -> int:
    if fmt.attn == "bf16":
        return V4_HEAD_DIM * BF16
    if fmt.attn in ("mxfp8", "nvfp4"):
        if family != "v41":
            raise PlannerInputError("attn_dtype", f"{fmt.attn} records exist only for V4.1 (SM100)")
        return V41_MXFP8_RECORD
    return V4_FP8_RECORD


def _v4_compressed_record(fmt: CacheFormat, family: str) -> int:
    if fmt.attn == "nvfp4":
        _v4_swa_record(fmt, family)  # validates the family
        return V41_NVFP4_COMPRESSED_RECORD
    return _v4_swa_record(fmt, family)


# --------------------------------------------------------------------------------------
# Layer builders (one per architecture family)
# --------------------------------------------------------------------------------------
def v32_layer(index: int, fmt: CacheFormat) -> Layer:
    """DeepSeek-V3.2-style layer: full-length MLA latent + full-length indexer K
    (models/deepseek_v32/attention.py). No sliding window, no compression."""
    if fmt.attn not in ("bf16", "fp8"):
        raise PlannerInputError("attn_dtype", f"{fmt.attn} is not a V3.2 cache format")
    record = V32_LATENT_DIM * BF16 if fmt.attn == "bf16" else V32_FP8_RECORD
    # V3.2's FlashMLA sparse backend pages 64 tokens (v1/attention/backends/mla/flashmla_sparse.py).
    mla = CacheKind("mla.kv", record, "context", block_tokens=64)
    idx = CacheKind("mla.indexer", INDEXER_RECORD[fmt.indexer], "context", block_tokens=64)
    return Layer(index, "mla", (mla, idx))


def _swa_cache(fmt: CacheFormat, family: str, window: int) -> CacheKind:
    return CacheKind("swa", _v4_swa_record(fmt, family), "window", window=window,
                     block_tokens=SWA_BLOCK[family], alignment=_alignment(fmt),
                     upstream_spec="SlidingWindowMLASpec")


def v4_layer(index: int, ratio: int, fmt: CacheFormat, window: int = 128) -> Layer:
    """DeepSeek-V4 layer (models/deepseek_v4/attention.py): every layer keeps a SWA cache;
    ratio 4 (c4a) adds a compressed cache + an indexer K cache (only C4A has an indexer)
    and their compressor states; ratio 128 (c128a) adds a compressed cache + state."""
    caches = [_swa_cache(fmt, "v4", window)]
    if ratio <= 1:
        return Layer(index, "swa", tuple(caches))
    if ratio not in (4, 128):
        raise PlannerInputError("compress_ratios", f"layer {index}: V4 ratio {ratio} not in (0, 4, 128)")
    label = f"c{ratio}a"
    align = _alignment(fmt)
    caches.append(CacheKind(f"{label}.kv", _v4_compressed_record(fmt, "v4"), "context",
                            tokens_per_state=ratio, alignment=align))
    # Compressor state: coff = 2 for ratio 4 (overlapping windows), 1 for ratio 128; one
    # fp32 row of 2*coff*head_dim per token, kept for a window of coff*ratio tokens
    # (models/deepseek_v4/compressor.py::CompressorStateCache / DeepseekCompressor).
    coff = 2 if ratio == 4 else 1
    caches.append(CacheKind(f"{label}.compressor_state", 2 * coff * V4_HEAD_DIM * FP32, "window",
                            window=coff * ratio, block_tokens=V4_STATE_BLOCK[ratio],
                            alignment=align, published=False, upstream_spec="SlidingWindowMLASpec"))
    if ratio == 4:
        caches.append(CacheKind("c4a.indexer", INDEXER_RECORD[fmt.indexer], "context",
                                tokens_per_state=4, alignment=align))
        caches.append(CacheKind("c4a.indexer_compressor_state", 2 * coff * INDEXER_HEAD_DIM * FP32,
                                "window", window=coff * ratio, block_tokens=V4_STATE_BLOCK[4],
                                alignment=align, published=False,
                                upstream_spec="SlidingWindowMLASpec"))
    return Layer(index, label, tuple(caches))


def v41_layer(index: int, ratio: int, kv_source: int | None, index_source: bool,
              fmt: CacheFormat, window: int = 128) -> Layer:
    """DeepSeek-V4.1 layer (models/deepseek_v41/attention.py): every layer keeps a SWA cache;
    only kv-source layers own a compressed cache (ratio 1 or 2), an indexer K cache (if
    they are index sources too) and, for ratio 2, the compressor ring. Consumers read the
    caches of ``kv_source`` = max(kv_source_layer_ids <= layer)."""
    caches = [_swa_cache(fmt, "v41", window)]
    if ratio == 0:
        return Layer(index, "swa", tuple(caches))
    if ratio not in (1, 2):
        raise PlannerInputError("compress_ratios", f"layer {index}: V4.1 ratio {ratio} not in (0, 1, 2)")
    if kv_source != index:
        return Layer(index, f"c{ratio}-reader", tuple(caches), kv_source=kv_source)
    align = _alignment(fmt)
    caches.append(CacheKind(f"c{ratio}.kv", _v4_compressed_record(fmt, "v41"), "context",
                            tokens_per_state=ratio, alignment=align))
    if index_source:
        caches.append(CacheKind(f"c{ratio}.indexer", INDEXER_RECORD[fmt.indexer], "context",
                                tokens_per_state=ratio, alignment=align))
    if ratio == 2:
        # Ring of the open group's [kv, score] fp32 rows, one block a request
        # (models/deepseek_v41/compressor.py::CompressorStateCache -> CircularBufferSpec).
        caches.append(CacheKind("c2.compressor_ring", 2 * V4_HEAD_DIM * FP32, "ring",
                                rows=V41_RING_ROWS, block_tokens=V41_RING_ROWS,
                                published=False, upstream_spec="CircularBufferSpec"))
    return Layer(index, f"c{ratio}-source", tuple(caches), kv_source=index)


# --------------------------------------------------------------------------------------
# Stacks
# --------------------------------------------------------------------------------------
def v32_stack(num_layers: int, fmt: CacheFormat) -> list[Layer]:
    return [v32_layer(i, fmt) for i in range(num_layers)]


def v4_stack(compress_ratios: list[int], fmt: CacheFormat, window: int = 128) -> list[Layer]:
    return [v4_layer(i, r, fmt, window) for i, r in enumerate(compress_ratios)]


def v41_stack(arch: dict[str, Any], fmt: CacheFormat) -> list[Layer]:
    """Build the V4.1 stack from config fields (compress_ratios, kv_source_layer_ids,
    index_source_layer_ids, sliding_window), validating the YOCO topology."""
    n = int(arch["num_hidden_layers"])
    ratios = list(arch["compress_ratios"])[:n]
    if len(ratios) < n:
        raise PlannerInputError("compress_ratios", f"{len(ratios)} entries for {n} layers")
    sources = sorted(arch.get("kv_source_layer_ids") or [])
    index_sources = set(arch.get("index_source_layer_ids") or sources)
    layers = []
    for i, r in enumerate(ratios):
        src = _kv_source_for(i, r, sources, ratios)
        layers.append(v41_layer(i, r, src, i in index_sources, fmt, arch.get("sliding_window", 128)))
    return layers


def _kv_source_for(i: int, ratio: int, sources: list[int], ratios: list[int]) -> int | None:
    if ratio == 0:
        return None
    below = [s for s in sources if s <= i]
    if not below:
        raise PlannerInputError("kv_source_layer_ids", f"compressed layer {i} has no kv source <= {i}")
    src = below[-1]
    if ratios[src] != ratio:
        raise PlannerInputError("compress_ratios",
                                f"layer {i} (ratio {ratio}) reads layer {src} (ratio {ratios[src]})")
    return src


# --------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------
def layer_bytes_per_token(layer: Layer) -> float:
    return sum(c.bytes_per_token() for c in layer.caches)


def layer_bytes(layer: Layer, n_tokens: int, published_only: bool = True) -> int:
    """Exact bytes one sequence of ``n_tokens`` keeps in ``layer``'s own caches."""
    return sum(c.bytes_for(n_tokens) for c in layer.caches if c.published or not published_only)


def stack_bytes(layers: list[Layer], n_tokens: int, published_only: bool = True) -> int:
    return sum(layer_bytes(layer, n_tokens, published_only) for layer in layers)


def stack_bytes_per_token(layers: list[Layer]) -> float:
    return sum(layer_bytes_per_token(layer) for layer in layers)


def count_labels(layers: list[Layer]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.label] = counts.get(layer.label, 0) + 1
    return counts


@dataclass(frozen=True)
class LayerTypeRow:
    label: str
    count: int
    bytes_per_token: float
    seq_bytes: int          # published method, at n_tokens
    state_bytes: int        # compressor state / ring per sequence (not published)
    reads: str = ""


def layer_type_table(layers: list[Layer], n_tokens: int = CONTEXT_1M) -> list[LayerTypeRow]:
    """One row per distinct layer type (label) of a stack."""
    rows: dict[str, LayerTypeRow] = {}
    for layer in layers:
        if layer.label in rows:
            r = rows[layer.label]
            rows[layer.label] = dataclasses.replace(r, count=r.count + 1)
            continue
        unpublished = layer_bytes(layer, n_tokens, False) - layer_bytes(layer, n_tokens)
        reads = f"layer {layer.kv_source}'s cache" if layer.kv_source not in (None, layer.index) else ""
        rows[layer.label] = LayerTypeRow(layer.label, 1, layer_bytes_per_token(layer),
                                         layer_bytes(layer, n_tokens), unpublished, reads)
    return list(rows.values())


# --------------------------------------------------------------------------------------
# Pages and page-size buckets
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PageRow:
    cache: str
    upstream_spec: str
    block_tokens: int
    states_per_page: int
    record_bytes: int
    raw_page_bytes: int
    page_bytes: int
    layers: int


def page_table(layers: list[Layer]) -> list[PageRow]:
    """Per cache type: block tokens, states per page, raw and padded page bytes."""
    seen: dict[str, PageRow] = {}
    for layer in layers:
        for c in layer.caches:
            if c.name in seen:
                seen[c.name] = dataclasses.replace(seen[c.name], layers=seen[c.name].layers + 1)
                continue
            raw = c.states_per_page() * c.record_bytes
            seen[c.name] = PageRow(c.name, c.upstream_spec, c.block_tokens, c.states_per_page(),
                                   c.record_bytes, raw, c.page_bytes(), 1)
    return list(seen.values())


def page_buckets(layers: list[Layer]) -> dict[int, list[str]]:
    """Cache types grouped by identical (padded) page size, largest first: types in one
    bucket can share one block pool without further padding. Upstream then packs the
    buckets into KV cache groups (v1/core/kv_cache_planning.py: get_kv_cache_groups,
    _get_packed_kv_cache_groups, unify_kv_cache_spec_page_size)."""
    buckets: dict[int, list[str]] = {}
    for row in page_table(layers):
        buckets.setdefault(row.page_bytes, []).append(row.cache)
    return dict(sorted(buckets.items(), reverse=True))


def paged_request_bytes(layers: list[Layer], max_len: int, in_flight_tokens: int) -> int:
    """Bytes vLLM reserves per request at ``max_len`` (sum of max_memory_usage_bytes)."""
    return sum(c.paged_bytes_per_request(max_len, in_flight_tokens)
               for layer in layers for c in layer.caches)


# --------------------------------------------------------------------------------------
# Published figures (DeepSeek-V4 report arithmetic)
# --------------------------------------------------------------------------------------
# The published comparison: a V3.2-style 61-layer stack vs a V4 stack of 30 c4a + 31
# c128a layers (the V4-Pro ratio pattern, see MODEL_FACTS), both bf16 at 1M tokens,
# with a 128-token window.
PUBLISHED_V32_LAYERS = 61
PUBLISHED_V4_RATIOS = [128, 128] + [4, 128] * 29 + [4]


def published_figures() -> dict[str, float]:
    """Reproduce the published numbers; values in bytes unless the key says otherwise."""
    bf16 = CacheFormat("bf16", "bf16")
    v32 = v32_stack(PUBLISHED_V32_LAYERS, bf16)
    v4 = v4_stack(PUBLISHED_V4_RATIOS, bf16)
    v4_q = v4_stack(PUBLISHED_V4_RATIOS, CacheFormat("fp8", "fp4"))
    c4a = next(x for x in v4 if x.label == "c4a")
    c128a = next(x for x in v4 if x.label == "c128a")
    v32_total = stack_bytes(v32, CONTEXT_1M)
    v4_total = stack_bytes(v4, CONTEXT_1M)
    v4_q_total = stack_bytes(v4_q, CONTEXT_1M)
    return {
        "v32_bytes_per_token_per_layer": layer_bytes_per_token(v32[0]),
        "v32_layer_bytes_1m": layer_bytes(v32[0], CONTEXT_1M),
        "v32_total_bytes_1m": v32_total,
        "v4_c4a_layer_bytes_1m": layer_bytes(c4a, CONTEXT_1M),
        "v4_c128a_layer_bytes_1m": layer_bytes(c128a, CONTEXT_1M),
        "v4_total_bytes_1m": v4_total,
        "v4_reduction_x": v32_total / v4_total,
        "v4_fp8_fp4_total_bytes_1m": v4_q_total,
        "v4_fp8_fp4_fraction_of_bf16": v4_q_total / v4_total,
    }


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


# --------------------------------------------------------------------------------------
# Topology planning
# --------------------------------------------------------------------------------------
# 1M-context workspaces vLLM reserves per GPU during its profiling run (so they come out
# of the KV budget):
# - sparse_mla_prefill_workspace_factor: 2 when max_model_len > 256K, else 5
#   (config/vllm.py);
# - indexer K-gather workspace: get_max_prefill_buffer_size = max_model_len *
#   (576 * 2 // 132) * factor entries, divided by the layer's compress ratio, each entry
#   one indexer row (v1/attention/backends/mla/indexer.py; _gather_workspace_shapes in
#   model_executor/layers/sparse_attn_indexer.py);
# - sparse-MLA prefill workspace: factor * max_model_len * 576 * 2 B (the sizing the
#   indexer.py comment gives for the FlashMLA sparse workspace; assumed the same for the
#   SM80 Triton path);
# - a dummy logits tensor of VLLM_SPARSE_INDEXER_MAX_LOGITS_MB = 512 MiB (envs.py).
PREFILL_BUFFER_ENTRIES_PER_TOKEN = 576 * 2 // 132  # = 8
MLA_WORKSPACE_BYTES_PER_TOKEN = 576 * 2
INDEXER_LOGITS_BYTES = 512 * MiB


def workspace_factor(max_model_len: int) -> int:
    return 5 if max_model_len <= 256 * 1024 else 2


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
    # V4.1 YOCO readers whose kv source sits on another stage: "replicate" plans a copy of
    # the source's compressed + indexer cache on the reader's stage; "reject" fails like
    # upstream 0.33.0 does.
    cross_stage_kv: str = "replicate"
    engram_on_gpu: bool = False   # V4.1 Engram tables resident (else host/UVA offload)
    load_draft: bool = False      # speculative-decoding drafter (MTP / DSpark) on last stage
    label: str = ""

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


def workspace_bytes(held: list[Layer], topo: Topology) -> dict[str, float]:
    """The 1M-context workspaces a stage's GPUs reserve (see the constants above)."""
    factor = workspace_factor(topo.max_model_len)
    indexers = [c for x in held for c in x.caches if c.name.endswith(".indexer")]
    sparse = any(x.owns_context_cache() for x in held)
    out = {"indexer_k_gather": 0.0, "sparse_mla_prefill": 0.0, "indexer_logits": 0.0}
    if indexers:
        ratio = min(c.tokens_per_state for c in indexers)
        entries = topo.max_model_len * PREFILL_BUFFER_ENTRIES_PER_TOKEN * factor // ratio
        out["indexer_k_gather"] = entries * max(c.record_bytes for c in indexers)
        out["indexer_logits"] = INDEXER_LOGITS_BYTES
    if sparse:
        out["sparse_mla_prefill"] = factor * topo.max_model_len * MLA_WORKSPACE_BYTES_PER_TOKEN
    return out


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: str
    tp: int
    weights_gib: float
    reserve_gib: float           # base reserve + 1M-context workspaces
    kv_budget_gib: float
    kv_bytes_per_token: float
    request_bytes: int           # vLLM-style per-request reservation at max_model_len
    kv_tokens: int               # raw tokens that fit (per-token bytes, no per-seq overhead)
    seqs: float                  # max_model_len sequences that fit (vLLM concurrency)
    replicated_sources: tuple[int, ...] = ()


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
         fmt: CacheFormat = CacheFormat("fp8", "fp4"), layers: list[Layer] | None = None) -> Plan:
    """Weights per GPU, KV budget, KV tokens and 1M sequences per stage and overall.
    ``layers`` (the stack for ``fmt``) may be passed in to skip rebuilding it."""
    validate_topology(topo, model)
    layers = layers or build_stack(model, fmt)
    result = Plan(model.name, topo.label, dataclasses.asdict(topo), fmt.label(), [])
    ranges = stage_ranges(topo.split)
    for s, ids in enumerate(ranges):
        held, foreign = stage_caches(layers, ids)
        if foreign:
            _cross_stage(result, topo, s, ids, foreign, layers)
        weights = stage_weight_bytes(model, layers, ids, topo.tp[s], dtypes, s == 0,
                                     s == len(ranges) - 1, topo)
        result.stages.append(_stage_plan(s, ids, topo, held, foreign, weights))
    if len(set(topo.tp)) > 1:
        result.warnings.append(
            f"per-stage TP sizes {'/'.join(map(str, topo.tp))}: vLLM 0.33.0 has one "
            "tensor_parallel_size for every pipeline stage (config/parallel.py), so an asymmetric "
            "layout needs two engines with a hand-off or a patched launcher; planned as if supported")
    _summarize(result, topo)
    result.assumptions = plan_assumptions(model, topo, dtypes, fmt)
    return result


def _stage_plan(s: int, ids: range, topo: Topology, held: list[Layer], foreign: list[int],
                weights: float) -> StagePlan:
    in_flight = topo.pp * topo.max_num_batched_tokens  # VllmConfig.max_in_flight_tokens
    reserve = topo.base_reserve_gib * GiB + sum(workspace_bytes(held, topo).values())
    budget = max(topo.util * topo.gpu_mem_gib * GiB - weights - reserve, 0.0)
    per_token = stack_bytes_per_token(held)
    request = paged_request_bytes(held, topo.max_model_len, in_flight)
    tokens = int(budget // per_token) if per_token else 0
    seqs = budget / request if request else 0.0
    return StagePlan(s, f"{ids.start}-{ids.stop - 1}", topo.tp[s], weights / GiB, reserve / GiB,
                     budget / GiB, per_token, request, tokens, seqs, tuple(foreign))


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


def _summarize(result: Plan, topo: Topology) -> None:
    for st in result.stages:
        if st.kv_budget_gib <= 0:
            result.fits = False
            result.warnings.append(
                f"stage {st.stage}: weights {st.weights_gib:.1f} GiB + reserve {st.reserve_gib:.1f} GiB "
                f"exceed {topo.util:g} x {topo.gpu_mem_gib:g} GiB per GPU; does not fit")
    result.kv_tokens = min(st.kv_tokens for st in result.stages)
    result.seqs = min(st.seqs for st in result.stages)
    result.reported_tokens = int(result.seqs * topo.max_model_len)


def plan_assumptions(model: ModelFacts, topo: Topology, dtypes: WeightDtypes,
                     fmt: CacheFormat) -> list[str]:
    """Every assumption behind a plan, in words."""
    factor = workspace_factor(topo.max_model_len)
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
        f"{topo.max_num_batched_tokens} batched tokens, CUDA graphs, NCCL, CUDA context), minus the "
        f"1M-context workspaces (workspace factor {factor}: indexer K-gather, sparse-MLA prefill, "
        "512 MiB indexer logits)",
        f"paging: {LOGICAL_BLOCK}-token logical blocks for compressed/indexer caches, SWA blocks of "
        f"{SWA_BLOCK[model.family]}, alignment padding as upstream; per-request reservation at "
        f"max_model_len {topo.max_model_len:,} with {topo.pp} x {topo.max_num_batched_tokens} in-flight "
        "tokens for sliding windows (VllmConfig.max_in_flight_tokens)",
        "kv_tokens = KV budget / marginal bytes per token (bottleneck stage); seqs = KV budget / "
        "per-request reservation (vLLM's max concurrency); reported_tokens = int(seqs x max_model_len), "
        "the figure vLLM logs as 'GPU KV cache size'",
        "each pipeline stage sizes its own pool; the pipeline is limited by its worst stage",
    ]
    if model.family == "v41":
        a.append("V4.1 Engram tables " + ("resident on GPU (row-sharded across TP)" if topo.engram_on_gpu
                                         else "offloaded to host memory (engram cpu_offload, as the "
                                         "upstream recipe does on 80 GB GPUs)"))
    a.append("speculative-decoding drafter " + ("loaded on the last stage" if topo.load_draft
                                                else "not loaded"))
    return a


def search_split(model: ModelFacts, topo: Topology, dtypes: WeightDtypes = WeightDtypes(),
                 fmt: CacheFormat = CacheFormat("fp8", "fp4"), slack: int = 1) -> Plan:
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
                     fmt: CacheFormat = CacheFormat("fp8", "fp4"), **overrides) -> list[Plan]:
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


# --------------------------------------------------------------------------------------
# Text tables
# --------------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:,.3f} {unit}"
    return f"{n:,.0f} B"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def plan_table(plans: list[Plan]) -> str:
    rows = []
    for p in plans:
        for st in p.stages:
            rows.append([p.label or p.model, st.stage, st.layers, st.tp, f"{st.weights_gib:.1f}",
                         f"{st.reserve_gib:.1f}", f"{st.kv_budget_gib:.2f}",
                         f"{st.kv_bytes_per_token:,.0f}", f"{st.kv_tokens:,}", f"{st.seqs:.2f}",
                         ",".join(map(str, st.replicated_sources)) or "-"])
    return table(["topology", "stage", "layers", "TP", "weights GiB/GPU", "reserve GiB/GPU",
                  "KV budget GiB/GPU", "KV B/token", "KV tokens", "1M seqs", "replica of"], rows)


def summary_table(plans: list[Plan]) -> str:
    rows = [[p.label or p.model, "yes" if p.fits else "no", p.bottleneck().stage,
             f"{p.kv_tokens:,}", f"{p.reported_tokens:,}", f"{p.seqs:.2f}"] for p in plans]
    return table(["topology", "fits", "bottleneck stage", "KV tokens (raw)",
                  "KV tokens (vLLM-reported)", "1M sequences"], rows)


def layer_type_markdown(layers: list[Layer], n_tokens: int = CONTEXT_1M) -> str:
    rows = [[r.label, r.count, f"{r.bytes_per_token:,.2f}", fmt_bytes(r.seq_bytes),
             fmt_bytes(r.state_bytes) if r.state_bytes else "-", r.reads or "-"]
            for r in layer_type_table(layers, n_tokens)]
    return table(["layer type", "layers", "B/token", f"per sequence at {n_tokens:,}",
                  "compressor state (not published)", "reads"], rows)


def page_markdown(layers: list[Layer]) -> str:
    rows = [[r.cache, r.upstream_spec, r.block_tokens, r.states_per_page, r.record_bytes,
             f"{r.raw_page_bytes:,}", f"{r.page_bytes:,}", r.layers] for r in page_table(layers)]
    return table(["cache", "upstream spec", "block tokens", "states/page", "record B",
                  "raw page B", "page B (padded)", "layers"], rows)


def bucket_markdown(layers: list[Layer]) -> str:
    rows = [[f"{size:,}", ", ".join(names)] for size, names in page_buckets(layers).items()]
    return table(["page B", "cache types"], rows)
