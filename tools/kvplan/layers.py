"""Cache kinds, the cache formats, and the decoder layers and stacks of each architecture
family (V3.2-style MLA, V4 c4a / c128a / SWA, V4.1 with YOCO kv sources)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import PlannerInputError
from .sizes import (ATTN_DTYPES, BF16, FP32, INDEXER_DTYPES, INDEXER_HEAD_DIM, INDEXER_RECORD,
                    LOGICAL_BLOCK, PACKED_ALIGNMENT, PLAIN_ALIGNMENT, SWA_BLOCK, V4_FP8_RECORD,
                    V4_HEAD_DIM, V4_STATE_BLOCK, V32_FP8_RECORD, V32_LATENT_DIM, V41_MXFP8_RECORD,
                    V41_BLOCK, V41_NVFP4_COMPRESSED_RECORD, V41_RING_ROWS, cdiv, round_up)


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
        """Per-request reservation of this cache alone (``max_memory_usage_bytes``; vLLM's
        pool blocks pad it to the widest cache group, packing.py):
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
    layer whose compressed + indexer caches it reads instead of owning them; ``ratio`` is
    its compress ratio (0: sliding window only; readers keep theirs) and ``window`` its
    sliding window (the prefill gather workspace is sized from both). ``indexer_record``:
    the index-K row of the indexer the layer runs (0: none) -- V4's C4A layers and V4.1's
    index sources, also those that read their kv source's index-K cache instead of owning
    one (the reservations of workspace.py are per indexer that runs)."""

    index: int
    label: str
    caches: tuple[CacheKind, ...]
    kv_source: int | None = None
    ratio: int = 0
    window: int = 0
    indexer_record: int = 0

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
        return Layer(index, "swa", tuple(caches), window=window)
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
    indexer = INDEXER_RECORD[fmt.indexer] if ratio == 4 else 0
    return Layer(index, label, tuple(caches), ratio=ratio, window=window, indexer_record=indexer)


def v41_layer(index: int, ratio: int, kv_source: int | None, index_source: bool,
              fmt: CacheFormat, window: int = 128, block: int = V41_BLOCK) -> Layer:
    """DeepSeek-V4.1 layer (models/deepseek_v41/attention.py): every layer keeps a SWA cache;
    only kv-source layers own a compressed cache (ratio 1 or 2), an indexer K cache (if
    they are index sources too) and, for ratio 2, the compressor ring. Consumers read the
    caches of ``kv_source`` = max(kv_source_layer_ids <= layer)."""
    caches = [_swa_cache(fmt, "v41", window)]
    if ratio == 0:
        return Layer(index, "swa", tuple(caches), window=window)
    if ratio not in (1, 2):
        raise PlannerInputError("compress_ratios", f"layer {index}: V4.1 ratio {ratio} not in (0, 1, 2)")
    # Every index source runs an indexer (models/deepseek_v41/attention.py is_index_source),
    # also one that reads the index-K cache of the kv source below it.
    indexer = INDEXER_RECORD[fmt.indexer] if index_source else 0
    if kv_source != index:
        return Layer(index, f"c{ratio}-reader", tuple(caches), kv_source=kv_source,
                     ratio=ratio, window=window, indexer_record=indexer)
    align = _alignment(fmt)
    caches.append(CacheKind(f"c{ratio}.kv", _v4_compressed_record(fmt, "v41"), "context",
                            tokens_per_state=ratio, block_tokens=block, alignment=align))
    # Only kv sources own an indexer K cache (models/deepseek_v41/attention.py: non-owning
    # index sources share the K cache of the kv source below them).
    if index_source:
        caches.append(CacheKind(f"c{ratio}.indexer", INDEXER_RECORD[fmt.indexer], "context",
                                tokens_per_state=ratio, block_tokens=block, alignment=align))
    if ratio == 2:
        # Ring of the open group's [kv, score] fp32 rows, one block a request
        # (models/deepseek_v41/compressor.py::CompressorStateCache -> CircularBufferSpec).
        caches.append(CacheKind("c2.compressor_ring", 2 * V4_HEAD_DIM * FP32, "ring",
                                rows=V41_RING_ROWS, block_tokens=V41_RING_ROWS,
                                published=False, upstream_spec="CircularBufferSpec"))
    return Layer(index, f"c{ratio}-source", tuple(caches), kv_source=index, ratio=ratio,
                 window=window, indexer_record=indexer)


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
