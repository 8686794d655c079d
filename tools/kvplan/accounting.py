"""Bytes per token and per sequence of layers and stacks (the published method), page
tables and page-size buckets (the way vLLM pages them), and the published DeepSeek-V4
figures reproduced."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .layers import CacheFormat, Layer, v4_stack, v32_stack
from .sizes import CONTEXT_1M


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
    """Sum of the caches' own max_memory_usage_bytes at ``max_len``: the reservation without
    the block-outermost packing, whose pool blocks are as wide as the widest cache group
    (packing.py has vLLM's per-request blocks and reported tokens)."""
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
