"""Production shapes: the DeepSeek-V4.1 / V4 sizes the kernels are built, tested, benchmarked
and warmed up at, named once.

Record sizes (512-dim heads, 584-byte records, 128-dim index keys) live in
``vllm.deepinfer.kv_record``; this module holds the model and cache geometry around them.
``PRODUCTION`` lists one ``LayerShape`` per distinct attention layer kind; tests iterate
over it (scaled down where the Triton interpreter would be too slow) and the benchmark
suites time it. Nothing here is measured: every value is the model's or vLLM 0.33.0's.
"""
from __future__ import annotations

import dataclasses

__all__ = ["ModelShape", "LayerShape", "V41", "V4", "PRODUCTION", "SWA_PAGE", "COMPRESSED_PAGE",
           "UPSTREAM_COMPRESSED_PAGE", "KV_PAGE64", "compressed_page", "compressed_entries",
           "V4_LOGICAL_BLOCK", "by_name"]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Sizes of one model's attention (config.json of the released checkpoints)."""
    name: str
    heads: int            # num_attention_heads (per rank at TP 1)
    window: int           # sliding_window: SWA keys per query
    topk: int             # index_topk of the indexer layers
    index_heads: int      # index_n_heads
    ratios: tuple         # distinct per-layer compress ratios (0: SWA only)
    swa_page: int         # tokens per SWA cache page
    o_groups: int         # o_groups of the grouped o_proj
    hidden: int | None = None   # hidden_size (o_proj output); None: not used by our tests
    o_rank: int | None = None   # o_lora_rank
    # Columns per fp8 scale of the o_proj input quantization (upstream's inverse RoPE + fp8
    # quant of the attention output) and of the wo_a block scales.
    o_quant_group: int = 128


# DeepSeek-V4.1: ratios 0 (SWA only), 1 and 2 (vllm/models/deepseek_v41/attention.py rejects
# others); top-k 512; SWA pages of 32 tokens (the block_size its attention passes to
# DeepseekV4SWACache).
V41 = ModelShape("v41", heads=64, window=128, topk=512, index_heads=64, ratios=(0, 1, 2),
                 swa_page=32, o_groups=8, hidden=5120, o_rank=1024)
# DeepSeek-V4: C4A layers (ratio 4, indexer top-k 512) and C128A layers (ratio 128, top-k =
# every compressed position, up to 8192 at 1M context); its SWA-only layers run as ratio 1
# with top-k 0. SWA pages: DeepseekV4SWACache's default block_size, 64.
V4 = ModelShape("v4", heads=64, window=128, topk=512, index_heads=64, ratios=(0, 4, 128),
                swa_page=64, o_groups=8)

# V4.1's SWA page, the one the decode kernel is compiled for by the gate and the warmup.
SWA_PAGE = V41.swa_page
# V4.1 compressed / index-K cache pages, in tokens, as upstream's backends ask for them: 64 on
# SM90 and 128 elsewhere (get_supported_kernel_block_sizes of DeepseekV4SparseMLABackend,
# models/deepseek_v41/sparse_mla.py, and of DeepseekV41IndexerBackend,
# v1/attention/backends/mla/indexer.py). The Ampere path keeps these with DEEPINFER_KV_PAGE64=0.
UPSTREAM_COMPRESSED_PAGE = {"sm80": 128, "sm86": 128, "sm89": 128, "sm90": 64, "sm100": 128,
                            "cpu": 128}
# The page both V4.1 caches of the Ampere path ask for with the kv_page64 feature (on by
# default): upstream's SM90 page. With it vLLM packs the Ampere path's caches exactly as
# upstream's SM90 layout (same groups, pool block and KV tokens: tests/test_kv_planner_vllm.py);
# with 128 it holds fewer tokens (attention/ampere_v41.py, DeepinferAmpereV41MLASparseBackend).
KV_PAGE64 = 64
# V4.1's compressed / index-K page, in tokens, on each variant with the defaults: KV_PAGE64
# everywhere (the Ampere path with kv_page64 on; upstream's own classes take 64 on SM90 too).
COMPRESSED_PAGE = {v: KV_PAGE64 for v in UPSTREAM_COMPRESSED_PAGE}
# V4 pages hold 256 tokens (models/deepseek_v4/sparse_mla.py), so 256 // ratio compressed
# entries: 64 for C4A, 2 for C128A.
V4_LOGICAL_BLOCK = 256


def compressed_page(variant: str, kv_page64: bool | None = None) -> int:
    """V4.1's compressed / index-K page (tokens) the Ampere path serves on ``variant``:
    ``KV_PAGE64`` with the kv_page64 feature, else upstream's page for the capability vLLM
    sees (the variant's: the A100-faithful mode's emulated 8.0 resolves to sm80).
    ``kv_page64`` None: the feature as the environment has it (vllm.deepinfer.envs)."""
    if variant not in UPSTREAM_COMPRESSED_PAGE:
        raise ValueError(f"compressed_page: unknown variant {variant!r}; known: "
                         f"{', '.join(UPSTREAM_COMPRESSED_PAGE)}")
    if kv_page64 is None:
        from vllm.deepinfer import envs  # stdlib only
        kv_page64 = envs.enabled("kv_page64", variant)
    return KV_PAGE64 if kv_page64 else UPSTREAM_COMPRESSED_PAGE[variant]


def compressed_entries(page_tokens: int, ratio: int) -> int:
    """Entries in one page of a ratio-``ratio`` V4.1 cache of ``page_tokens`` tokens: each
    entry holds ``ratio`` tokens (MLAAttentionSpec.tokens_per_state), so the cache tensors
    are [blocks, page_tokens // ratio, record] (the decode's EXTRA_BS, the writers'
    CACHE_BLOCK, the gather's block_size)."""
    if ratio <= 0 or page_tokens % ratio:
        raise ValueError(f"compressed_entries: a {page_tokens}-token page does not hold whole "
                         f"ratio-{ratio} entries")
    return page_tokens // ratio


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One attention layer kind: what its kernels see per query token."""
    name: str
    model: ModelShape
    ratio: int            # compress ratio (0: SWA only)
    topk: int             # compressed keys per query token (0 without a compressed cache)

    @property
    def heads(self) -> int:
        return self.model.heads

    @property
    def window(self) -> int:
        return self.model.window

    @property
    def keys(self) -> int:
        """Keys a decode token attends to: the SWA window, then the compressed top-k."""
        return self.window + self.topk

    @property
    def has_indexer(self) -> bool:
        return self.ratio > 0 and self.ratio < 128


# Every layer kind of both models. V4's C128A top-k is the 1M-context width (8192).
PRODUCTION = (
    LayerShape("v41.swa", V41, ratio=0, topk=0),
    LayerShape("v41.c1", V41, ratio=1, topk=V41.topk),
    LayerShape("v41.c2", V41, ratio=2, topk=V41.topk),
    LayerShape("v4.c4a", V4, ratio=4, topk=V4.topk),
    LayerShape("v4.c128a", V4, ratio=128, topk=8192),
)


def by_name(name: str) -> LayerShape:
    for s in PRODUCTION:
        if s.name == name:
            return s
    raise ValueError(f"shape: {name!r} is not one of {', '.join(s.name for s in PRODUCTION)}")
