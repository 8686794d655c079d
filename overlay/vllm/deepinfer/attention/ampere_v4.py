"""DeepSeek-V4 attention on Ampere: ``DeepinferAmpereV4Attention``.

The V4 twin of ``ampere_v41``: what ``models/deepseek_v4/nvidia/model.py::
_select_dsv4_attn_cls`` gets below capability 9.0 (or with DEEPINFER_AMPERE_ATTN=1).
Layers: compress ratio 1 (SWA only), 4 (C4A: indexer top-k 512) and 128 (C128A: top-k
from the metadata builder). Ported from ``models/deepseek_v4/amd/rocm.py`` (not imported).
"""
from __future__ import annotations

from vllm.deepinfer import yoco
from vllm.deepinfer.attention.common import (
    AmpereAttentionMixin,
    DeepinferAmpereSparseAttnIndexer,
    NoTileSchedulerMixin,
    SharedNoReplayStartMixin,
)
from vllm.models.deepseek_v4.attention import DeepseekV4Attention, DeepseekV4Indexer
from vllm.models.deepseek_v4.sparse_mla import (
    DeepseekV4SparseMLABackend,
    DeepseekV4SparseMLAMetadataBuilder,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.mla.sparse_swa import (
    DeepseekSparseSWABackend,
    DeepseekSparseSWAMetadataBuilder,
)

BACKEND_NAME = "DEEPINFER_AMPERE_SPARSE_DSV4"


class DeepinferAmpereV4SparseSWAMetadataBuilder(NoTileSchedulerMixin,
                                                SharedNoReplayStartMixin,
                                                DeepseekSparseSWAMetadataBuilder):
    """V4 SWA metadata without FlashMLA tile plans (``get_mla_metadata`` never runs), with
    one no-replay-start tensor for every SWA cache group (SharedNoReplayStartMixin)."""


class DeepinferAmpereV4SparseSWABackend(DeepseekSparseSWABackend):
    @staticmethod
    def get_builder_cls() -> type[DeepinferAmpereV4SparseSWAMetadataBuilder]:
        return DeepinferAmpereV4SparseSWAMetadataBuilder


class DeepinferAmpereV4MLASparseBackend(DeepseekV4SparseMLABackend):
    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type[DeepseekV4SparseMLAMetadataBuilder]:
        return DeepseekV4SparseMLAMetadataBuilder

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major >= 8


class DeepinferAmpereV4Indexer(DeepseekV4Indexer):
    """V4 C4A indexer without DeepGEMM: upstream's forward (wq_b, the Q quant and the
    indexer compressor, which patches 0008/0009 route to our fp8-free writers), scored by
    ``DeepinferAmpereSparseAttnIndexer`` (logits from our kernel). The profile run is
    upstream's too, so the indexer reserves its workspace and logits memory as upstream
    does."""

    def _get_attn_cls(self):
        return DeepinferAmpereSparseAttnIndexer

    def _register_q_quant_warmup(self) -> None:
        # Upstream registers the fp8 (or MXFP4) Triton Q-quant warmup; it cannot compile
        # below sm_89, and on the Ampere path the Q quant is our writer (patch 0009).
        return None


class DeepinferAmpereV4Attention(AmpereAttentionMixin, DeepseekV4Attention):
    """DeepSeek-V4 sparse MLA attention for SM80/SM86 (and SM89; any GPU with
    DEEPINFER_AMPERE_ATTN=1): 584-byte fp8_ds_mla records, ragged decode, bf16 o_proj."""

    backend_cls = DeepinferAmpereV4MLASparseBackend
    swa_backend_cls = DeepinferAmpereV4SparseSWABackend

    def _get_indexer_cls(self, vllm_config):
        return DeepinferAmpereV4Indexer

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ampere_init()

    # ---- model-specific pieces of the shared forward ----------------------------------
    def _swa_only(self) -> bool:
        return self.compress_ratio <= 1

    def _compressed_metadata(self, attn_metadata):
        return attn_metadata.get(self.prefix)

    def _compressed_cache(self):
        return self.kv_cache

    @staticmethod
    def _cache_ops():
        from vllm.models.deepseek_v4.common.ops import (
            combine_topk_swa_indices,
            dequantize_and_gather_k_cache,
        )
        return dequantize_and_gather_k_cache, combine_topk_swa_indices

    def _decode_topk(self, swa_metadata, comp_metadata):
        assert comp_metadata is not None
        if self.compress_ratio == 128:
            # C128A: global indices precomputed by the metadata builder.
            return (comp_metadata.c128a_global_decode_topk_indices,
                    comp_metadata.c128a_decode_topk_lens)
        from vllm.models.deepseek_v4.common.ops import compute_global_topk_indices_and_lens
        assert swa_metadata.is_valid_token is not None and self.topk_indices_buffer is not None
        n, nd = swa_metadata.num_decode_tokens, swa_metadata.num_decodes
        return compute_global_topk_indices_and_lens(
            self.topk_indices_buffer[:n], swa_metadata.token_to_req_indices,
            comp_metadata.block_table[:nd], comp_metadata.block_size // self.compress_ratio,
            swa_metadata.is_valid_token[:n])

    def _prefill_topk(self, swa_metadata, comp_metadata, nd_tok: int, n_pre: int,
                      swa_only: bool):
        assert self.topk_indices_buffer is not None
        if swa_only:
            return self.topk_indices_buffer[nd_tok:], 0
        if self.compress_ratio == 4:
            topk = self.topk_indices_buffer[nd_tok:][:n_pre]
        else:
            topk = comp_metadata.c128a_prefill_topk_indices
        assert topk is not None
        return topk, topk.shape[-1]

    def _prefill_chunk_plan(self, swa_metadata, swa_only: bool):
        return swa_metadata.get_prefill_chunk_plan(
            compress_ratio=self.compress_ratio, prefill_chunk_size=self.PREFILL_CHUNK_SIZE)

    def _topk_width(self) -> int:
        """Top-k columns of a compressed layer's decode and prefill rows (reservations):
        C4A the indexer's; C128A at most every compressed position of max_model_len, in
        the metadata builder's alignment (its c128a_max_compressed)."""
        if self.compress_ratio == 128:
            from vllm.models.deepseek_v4.sparse_mla import _C128A_TOPK_ALIGNMENT as align
            positions = -(-self.max_model_len // self.compress_ratio)
            return -(-positions // align) * align
        assert self.topk_indices_buffer is not None
        return self.topk_indices_buffer.shape[-1]

    # ---- cross-layer reuse (vllm.deepinfer.yoco) --------------------------------------
    # V4 shares no KV cache and each C4A layer indexes itself: only what the SWA-only layers
    # and the C128A layers reading one metadata object (top-k from the metadata builder)
    # derive is the same across layers (their combined lists, the C128A decode's ragged
    # lists), besides the SWA window's ragged lists, which every layer shares.
    def _yoco_index_source(self, comp_metadata, swa_only: bool):
        if swa_only:
            return None
        if self.compress_ratio == 128:
            return ("c128a", id(comp_metadata))
        return yoco.NO_REUSE

    def _yoco_kv_source(self):
        return None

    def _combine_extra_args(self, swa_metadata, nd_tok: int, qs: int, qe: int):
        left, right = swa_metadata.prefill_left_visible, swa_metadata.prefill_right_visible
        return {
            "max_image_tokens": self.max_image_tokens,
            "left_visible": None if left is None else left[nd_tok + qs: nd_tok + qe],
            "right_visible": None if right is None else right[nd_tok + qs: nd_tok + qe],
        }
