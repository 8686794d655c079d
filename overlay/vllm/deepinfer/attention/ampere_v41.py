"""DeepSeek-V4.1 attention on Ampere: ``DeepinferAmpereV41Attention``.

What ``vllm.deepinfer.attention.selector`` returns from ``models/deepseek_v41/nvidia/
model.py::_select_dsv4_attn_cls`` below capability 9.0 (or with DEEPINFER_AMPERE_ATTN=1).
A ``DeepseekV4Attention`` (V4.1) subclass built from the ROCm Triton path's logic
(``models/deepseek_v41/amd/rocm.py``, not imported); it constructs with FlashMLA,
DeepGEMM and CuTeDSL all absent. See ``common`` for the shared forward and
docs/ampere-path.md for what is and is not implemented.
"""
from __future__ import annotations

from vllm.deepinfer import arch, pp_split, routing
from vllm.deepinfer.kernels import shapes
from vllm.deepinfer.attention.common import (
    AmpereAttentionMixin,
    DeepinferAmpereSparseAttnIndexer,
    NoSparseMQAIndexer,
    NoTileSchedulerMixin,
    SharedNoReplayStartMixin,
    not_implemented,
)
from vllm.forward_context import get_forward_context
from vllm.models.deepseek_v41.attention import (
    DeepseekV4Attention,
    DeepseekV4Indexer,
    DeepseekV4IndexerCache,
)
from vllm.models.deepseek_v41.sparse_mla import (
    DeepseekV4SparseMLABackend,
    DeepseekV4SparseMLAMetadataBuilder,
    DeepseekV41SparseSWAMetadataBuilder,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend

BACKEND_NAME = "DEEPINFER_AMPERE_SPARSE_DSV41"
# Compressed-KV and index-K page of the Ampere V4.1 path (feature kv_page64): upstream's SM90
# page (kernels/shapes.py KV_PAGE64), see DeepinferAmpereV41MLASparseBackend.
KV_PAGE_TOKENS = shapes.KV_PAGE64


class DeepinferAmpereV41SparseSWAMetadataBuilder(NoTileSchedulerMixin,
                                                 SharedNoReplayStartMixin,
                                                 DeepseekV41SparseSWAMetadataBuilder):
    """V4.1 SWA metadata without FlashMLA tile plans (``get_mla_metadata`` never runs), with
    one no-replay-start tensor for every SWA cache group (SharedNoReplayStartMixin)."""


class DeepinferAmpereV41SparseSWABackend(DeepseekSparseSWABackend):
    @staticmethod
    def get_builder_cls() -> type[DeepinferAmpereV41SparseSWAMetadataBuilder]:
        return DeepinferAmpereV41SparseSWAMetadataBuilder


class DeepinferAmpereV41MLASparseBackend(DeepseekV4SparseMLABackend):
    """Compressed-KV backend of the Ampere path. Its metadata builder is upstream's
    generic one (block table, compressed slot mapping): nothing FlashMLA-specific."""

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type[DeepseekV4SparseMLAMetadataBuilder]:
        return DeepseekV4SparseMLAMetadataBuilder

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major >= 8

    @classmethod
    def supports_pcp(cls) -> bool:
        return False

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        """Upstream's V4.1 backend asks for 128-token compressed pages off SM90 (FlashMLA's
        SM100 kernels want them) and 64 on SM90. The Ampere path's kernels take any page:
        the gather and the indexer logits as a runtime argument, the decode as a constexpr
        (entries per page) the warmup compiles for each page it can see (warmup.py
        ModelShapes.v41_pages). The page shapes vLLM's packing of the cache groups into one
        pool block (v1/core/kv_cache_planning.py, ``_get_packed_kv_cache_groups``; every
        group's block is padded to the widest). vLLM's own packing fed the real layer specs
        (tests/test_kv_planner_vllm.py, CPU): at max_model_len 1,048,320 in 101.55 GiB the
        128-token layout reports 1.6% fewer KV tokens than upstream's SM90 one on v41-tput
        (pool block 184,320 B against 93,312 B) and 15% fewer on v41-long. With the
        ``kv_page64`` feature (on by default) the Ampere path takes the SM90 page of 64
        tokens for the compressed cache and, through ``DeepinferAmpereV41IndexerBackend``,
        for the index-K cache: the layout is then upstream's SM90 one, byte for byte (with
        the index-K pages left at 128 the pool block is the LCM of the two pages).
        DEEPINFER_KV_PAGE64=0 keeps upstream's choice. docs/topology-1m-context.md."""
        if routing.use("kv_page64"):
            arch.log_once("kv_page64", f"V4.1 compressed KV pages of {KV_PAGE_TOKENS} tokens",
                          "upstream's SM90 packing; DEEPINFER_KV_PAGE64=0 keeps upstream's")
            return [KV_PAGE_TOKENS]
        return DeepseekV4SparseMLABackend.get_supported_kernel_block_sizes(kv_cache_spec)


class DeepinferAmpereV41IndexerBackend(DeepseekV41IndexerBackend):
    """Index-K cache backend of the Ampere path: upstream's ``DeepseekV41IndexerBackend``
    (its name, DEEPSEEK_V41_INDEXER, its metadata builder and cache shape) asking for the
    compressed cache's page. vLLM resolves one block size from every backend's kernel pages
    and packs all cache groups into one pool block (v1/core/kv_cache_planning.py); a 128-token
    index-K page beside 64-token compressed pages makes the pool block the LCM of the two
    (1,235,520 B for v41-tput against 93,312 B with both at 64). The index-K kernels read
    pages through the block table and ``stride(0)``, the page size a runtime argument
    (kernels/indexer_logits.py, indexer_candidate_logits.py: ``block_size`` is
    do_not_specialize; vLLM's cp_gather_indexer_k_quant_cache takes it as an argument)."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        if routing.use("kv_page64"):
            arch.log_once("kv_page64", f"V4.1 index-K pages of {KV_PAGE_TOKENS} tokens",
                          "upstream's SM90 packing; DEEPINFER_KV_PAGE64=0 keeps upstream's")
            return [KV_PAGE_TOKENS]
        return DeepseekV41IndexerBackend.get_supported_kernel_block_sizes(kv_cache_spec)


class DeepinferAmpereV41IndexerCache(DeepseekV4IndexerCache):
    """Upstream's index-K cache whose dense backend is ``DeepinferAmpereV41IndexerBackend``.
    Never constructed: ``DeepinferAmpereV41Attention.__init__`` swaps the class of the cache
    upstream's ``__init__`` built (the pattern upstream's CPU path uses for its indexer
    cache, models/deepseek_v4/cpu/cpu_sparse.py). The sparse-logits backend
    (``indexer_sparse_logits``) is left as upstream's: the Ampere path refuses that mode
    (attention/common.py NoSparseMQAIndexer)."""

    def get_attn_backend(self):
        backend = super().get_attn_backend()
        return DeepinferAmpereV41IndexerBackend if backend is DeepseekV41IndexerBackend \
            else backend


def adopt_index_cache(cache) -> DeepinferAmpereV41IndexerCache:
    """Give the index-K cache ``cache`` (upstream's ``DeepseekV4IndexerCache``, or ours
    already: a non-owning index source shares the kv source's object through the forward
    context) the Ampere path's backend, in place: every layer holding the object (the
    forward context, each indexer and its scoring op) sees the new class."""
    if type(cache) is DeepseekV4IndexerCache:
        cache.__class__ = DeepinferAmpereV41IndexerCache
    elif not isinstance(cache, DeepinferAmpereV41IndexerCache):
        raise TypeError(f"index-K cache {getattr(cache, 'prefix', '?')}: expected upstream's "
                        f"DeepseekV4IndexerCache, got {type(cache).__name__}")
    return cache


class DeepinferAmpereV41Indexer(DeepseekV4Indexer):
    """V4.1 indexer without DeepGEMM: the index-K store goes through our fp8-free writer
    (``kernels.fp8_writers_v41``) where the ``fp8_sw`` feature is on; scoring is
    ``DeepinferAmpereSparseAttnIndexer`` (upstream's op, logits from our kernel). The Q side
    is upstream's (wq_b, then the Q quant patch 0009 routes to our fp8-free writer)."""

    mqa_cls = NoSparseMQAIndexer
    attn_cls = DeepinferAmpereSparseAttnIndexer

    def _produce_k(self, latent, positions, rotary_emb) -> None:
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict) or latent is None:
            return
        if not routing.use("fp8_sw"):
            return super()._produce_k(latent, positions, rotary_emb)
        from vllm.deepinfer.kernels.fp8_writers_v41 import indexer_k_norm_rope_store
        assert self.owns_k
        indexer_metadata = attn_metadata[self.k_cache.prefix]
        k_pre, _ = self.wk(latent)
        indexer_k_norm_rope_store(
            k_pre, positions, rotary_emb.cos_sin_cache, self.k_norm.weight,
            self.k_norm.variance_epsilon, self.k_cache.kv_cache,
            indexer_metadata.slot_mapping, self.compress_ratio, self.use_fp4_kv)


class DeepinferAmpereV41Attention(AmpereAttentionMixin, DeepseekV4Attention):
    """DeepSeek-V4.1 sparse MLA attention for SM80/SM86 (and SM89; any GPU with
    DEEPINFER_AMPERE_ATTN=1): 584-byte fp8_ds_mla records, ragged decode, bf16 o_proj."""

    backend_cls = DeepinferAmpereV41MLASparseBackend
    swa_backend_cls = DeepinferAmpereV41SparseSWABackend

    def _indexer_cls(self, k_cache: DeepseekV4IndexerCache | None):
        if k_cache is not None and getattr(k_cache, "rocm_mxfp4", False):
            raise not_implemented("the ROCm MXFP4 indexer cache")
        return DeepinferAmpereV41Indexer

    def __init__(self, *args, **kwargs) -> None:
        # A pipeline split inside a KV-sharing group: refused in one line on every stage
        # before upstream's constructor raises at a later stage's first consumer (pp_split).
        pp_split.check_layer(kwargs.get("vllm_config", args[0] if args else None),
                             kwargs.get("prefix", args[1] if len(args) > 1 else ""))
        super().__init__(*args, **kwargs)
        if self.indexer is not None:
            adopt_index_cache(self.indexer.k_cache)
        self._ampere_init()

    # ---- model-specific pieces of the shared forward ----------------------------------
    def _swa_only(self) -> bool:
        return self.compress_ratio == 0

    def _compressed_metadata(self, attn_metadata):
        if self.compressed_cache_prefix is None:
            return None
        return attn_metadata.get(self.compressed_cache_prefix)

    def _compressed_cache(self):
        return self._compressed_kv_cache()

    @staticmethod
    def _cache_ops():
        from vllm.models.deepseek_v41.common.ops import (
            combine_topk_swa_indices,
            dequantize_and_gather_k_cache,
        )
        return dequantize_and_gather_k_cache, combine_topk_swa_indices

    def _decode_topk(self, swa_metadata, comp_metadata):
        from vllm.models.deepseek_v41.common.ops import compute_global_topk_indices_and_lens
        assert comp_metadata is not None and swa_metadata.is_valid_token is not None
        assert self.topk_indices_buffer is not None
        n, nd = swa_metadata.num_decode_tokens, swa_metadata.num_decodes
        # Built once per (index source, KV source, ratio) and forward: common's
        # _ampere_decode looks it up in vllm.deepinfer.yoco before calling this.
        return compute_global_topk_indices_and_lens(
            self.topk_indices_buffer[:n], swa_metadata.token_to_req_indices,
            comp_metadata.block_table[:nd], comp_metadata.block_size // self.compress_ratio,
            swa_metadata.is_valid_token[:n])

    def _prefill_topk(self, swa_metadata, comp_metadata, nd_tok: int, n_pre: int,
                      swa_only: bool):
        assert self.topk_indices_buffer is not None
        topk = self.topk_indices_buffer[nd_tok:][:n_pre]
        return topk, (0 if swa_only else topk.shape[-1])

    def _prefill_chunk_plan(self, swa_metadata, swa_only: bool):
        return swa_metadata.get_prefill_chunk_plan(
            compress_ratio=self.compress_ratio, prefill_chunk_size=self.PREFILL_CHUNK_SIZE,
            has_compressed=not swa_only)

    def _topk_width(self) -> int:
        """Top-k columns of a compressed layer's decode and prefill rows (reservations)."""
        assert self.topk_indices_buffer is not None
        return self.topk_indices_buffer.shape[-1]

    # ---- cross-layer reuse (vllm.deepinfer.yoco) --------------------------------------
    def _yoco_index_source(self, comp_metadata, swa_only: bool):
        """Layers after an index source read the top-k it wrote into the shared buffer."""
        return None if swa_only or self.compress_ratio == 0 else self.index_source_layer_id

    def _yoco_kv_source(self):
        """Consumers read the compressed cache of the KV source at or below them."""
        return self.compressed_cache_prefix
