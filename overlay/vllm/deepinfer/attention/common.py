"""What the DeepSeek-V4.1 and V4 Ampere attention classes share.

Ported from upstream's ROCm Triton path (``models/deepseek_v41/amd/rocm.py``,
``models/deepseek_v4/amd/rocm.py``; Apache-2.0, the vLLM project), without importing those
modules: they import ``vllm.platforms.rocm`` at module level. The kernels come from
``v1/attention/ops/rocm_aiter_mla_sparse.py`` (pure Triton, no aiter on CUDA) and, through
the series, from ``vllm.deepinfer.kernels``:

* decode: ``rocm_sparse_attn_decode`` -> ``_rocm_sparse_attn_decode_ragged_triton``, which
  patch 0003 routes to ``vllm.deepinfer.kernels.sparse_mla_decode`` (inverse RoPE applied
  once, fused into the epilogue);
* prefill: ``dequantize_and_gather_k_cache`` and ``combine_topk_swa_indices`` (patches
  0001/0002 route them to ``kernels.kv_gather`` / ``kernels.topk_swa``), then upstream's
  bf16 ``rocm_sparse_attn_prefill`` Triton kernel (no fp8);
* o_proj: bf16 einsum against wo_a dequantized once at weight-loading time
  (``rocm_inv_rope_einsum``), then wo_b.

The indexer's logits come from ``vllm.deepinfer.kernels.indexer_logits`` through patch
0015 (upstream's ``sparse_attn_indexer`` op itself is unchanged).

Nothing here may be silently wrong: a path that is not implemented raises
``NotImplementedError`` naming what is missing (docs/ampere-path.md lists them).
"""
from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from vllm.deepinfer import arch, reserve, routing, sorted_topk, spec, step_limits, yoco
from vllm.deepinfer.kernels.inverse_rope import inverse_rope_rows_
# Ours, not upstream's function of the same name: the same lists with int64 offsets, and a
# host check where a batch's lists would pass what the decode's int32 indptr can address.
from vllm.deepinfer.kernels.ragged_indices import build_ragged_indices_from_dense
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (
    _get_cached_wo_a_bf16,
    rocm_inv_rope_einsum,
    rocm_sparse_attn_decode,
    rocm_sparse_attn_prefill,
)
from vllm.v1.worker.workspace import current_workspace_manager

logger = logging.getLogger("vllm.deepinfer")

DOC = "docs/ampere-path.md"


def not_implemented(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"DeepInfer Ampere attention path: {what} is not implemented yet (see {DOC}); "
        "nothing was computed")


# --------------------------------------------------------------------------- SWA metadata
class NoTileSchedulerMixin:
    """SWA metadata builder mixin: never plans FlashMLA tiles.

    Upstream's ``DeepseekSparseSWAMetadataBuilder.build_tile_scheduler`` calls FlashMLA's
    ``get_mla_metadata()`` on every step with decode tokens (FlashMLA is not built for
    SM80). The Ampere decode is ragged and needs no tile plan; the all-None answer is what
    upstream itself returns on ROCm/XPU/SM12x."""

    def build_tile_scheduler(self, num_decode_tokens: int):
        return super().build_tile_scheduler(0)  # type: ignore[misc]


class SharedNoReplayStartMixin:
    """SWA metadata builder mixin: every builder's ``no_replay_start`` (upstream's zeros for
    a batch built without replay starts) is one tensor (``yoco.shared_no_replay_start``), so
    cross-layer reuse keys of layers in different SWA cache groups agree over one batch and
    their combined lists come from the reserved slab (vllm.deepinfer.reserve)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        own = getattr(self, "no_replay_start", None)
        if isinstance(own, torch.Tensor):
            self.no_replay_start = yoco.shared_no_replay_start(own)


# --------------------------------------------------------------------------- indexer op
class DeepinferAmpereSparseAttnIndexer(SparseAttnIndexer):
    """The indexer's scoring op without DeepGEMM.

    Built as upstream's ``SparseAttnIndexer`` is, but its constructor skips the "requires
    DeepGEMM" gate and the fp8 pack-kernel warmups (fp8e4nv does not compile below sm_89).
    Scoring is upstream's own ``sparse_attn_indexer`` custom op, unchanged: its two DeepGEMM
    calls (``fp8_fp4_mqa_logits``, ``fp8_fp4_paged_mqa_logits``) are routed by patch 0015
    to ``vllm.deepinfer.kernels.indexer_logits``; the K gather, the candidate-block masks
    and the per-row top-k are upstream's (CUDA C++ ops and fp32 Triton, no fp8 type). The
    padded decode layout (spec decode, or a short prefill counted as decode) packs the e4m3
    Q with ``pack_seq_triton``, which patch 0017 runs on the bytes where fp8e4nv cannot
    compile; its uint8 pack/unpack kernels are registered for warmup here, as upstream does
    for its MXFP4 cache.
    """

    def __init__(self, k_cache, quant_block_size: int, scale_fmt: str, topk_tokens: int,
                 head_dim: int, max_model_len: int, max_total_seq_len: int,
                 topk_indices_buffer: torch.Tensor, skip_k_cache_insert: bool = False,
                 use_fp4_cache: bool = False, compress_ratio: int = 1,
                 candidate_blocks: torch.Tensor | None = None, candidate_block_size: int = 0,
                 candidate_write: bool = False):
        from vllm.config import get_current_vllm_config
        CustomOp.__init__(self)  # not SparseAttnIndexer.__init__: it demands DeepGEMM on CUDA
        # The attributes upstream's 0.33.0 constructor sets, in its order.
        self.k_cache = k_cache
        self.quant_block_size = quant_block_size
        self.scale_fmt = scale_fmt
        self.topk_tokens = topk_tokens
        self.head_dim = head_dim
        self.max_model_len = max_model_len
        self.max_total_seq_len = max_total_seq_len
        self.topk_indices_buffer = topk_indices_buffer
        self.skip_k_cache_insert = skip_k_cache_insert
        self.use_fp4_cache = use_fp4_cache
        self.compress_ratio = compress_ratio
        self.candidate_blocks = candidate_blocks
        self.candidate_block_size = candidate_block_size
        self.candidate_write = candidate_write
        self.dense_mha_metadata_layer_name = ""
        vllm_config = get_current_vllm_config()
        parallel_config = vllm_config.parallel_config
        # Test-only (vllm.deepinfer.sorted_topk): read once, so compiled graphs see a constant.
        self._sorted_topk = sorted_topk.enabled()
        self.topk_backend = vllm_config.kernel_config.sparse_indexer_topk_backend
        self._parallel_config = parallel_config
        self.dcp_world_size = parallel_config.decode_context_parallel_size
        if self.dcp_world_size > 1:
            raise not_implemented("decode context parallelism (DCP) in the sparse indexer")
        self.dcp_rank = 0
        self.use_pcp = parallel_config.prefill_context_parallel_size > 1
        self.pcp_shard_decode_requests = parallel_config.pcp_shard_decode_requests
        if use_fp4_cache:
            raise not_implemented("the MXFP4 indexer cache (indexer_kv_dtype='mxfp4'; "
                                  "e2m1 conversion needs sm_100)")
        if not routing.use("indexer_logits"):
            from vllm.utils.import_utils import has_deep_gemm
            if not has_deep_gemm():
                raise RuntimeError(
                    "DeepInfer Ampere sparse indexer: the indexer_logits feature is switched "
                    "off (DEEPINFER_INDEXER_LOGITS=0 / DEEPINFER_DISABLE) and DeepGEMM is not "
                    "available, so nothing could score the indexer; unset the switch")
        if vllm_config.kernel_config.enable_jit_warmup:
            from vllm.v1.attention.ops.common import (_PACK_SEQ_TRITON_KERNEL,
                                                      _UNPACK_SEQ_TRITON_KERNEL)
            as_bytes = routing.use("fp8_sw")  # what pack_seq_triton will launch (0017)
            _PACK_SEQ_TRITON_KERNEL.register_warmup(
                dtype=torch.uint8 if as_bytes else torch.float8_e4m3fn,
                pad_value=0 if as_bytes else -float("inf"))
            _UNPACK_SEQ_TRITON_KERNEL.register_warmup()

    def _score(self, hidden_states, q_quant, k, weights):
        out = SparseAttnIndexer.forward_cuda(self, hidden_states, q_quant, k, weights)
        if self._sorted_topk:
            sorted_topk.sort_rows_(self.topk_indices_buffer[: hidden_states.shape[0]])
        return out

    forward_native = _score
    forward_cuda = _score
    forward_hip = _score
    forward_cpu = _score
    forward_xpu = _score


class NoSparseMQAIndexer:
    """Stands in for ``SparseMQAIndexer`` (``indexer_sparse_logits``, candidate-block
    scoring over an MXFP4 cache); not available on the Ampere path."""

    weights_dtype = torch.float32

    def __init__(self, *args, **kwargs):
        raise not_implemented("attention_config.indexer_sparse_logits (MXFP4 candidate "
                              "scoring)")


# --------------------------------------------------------------------------- wo_a in bf16
def install_wo_a_bf16_cache(layer) -> None:
    """Dequantize wo_a to bf16 once, from the weights as loaded, before the linear's own
    post-load processing runs.

    The bf16 o_proj (``rocm_inv_rope_einsum``) reads ``wo_a.weight`` as a plain
    [groups * o_rank, K] fp8 matrix with block scales. On SM80/SM86 vLLM's fp8 linear
    kernels (Marlin W8A16 and friends) repack that weight in ``process_weights_after_loading``,
    after which it could not be read that way: so the cache upstream's helper keeps
    (``wo_a._dsv4_wo_a_bf16``) is filled from the raw weights first.
    """
    wo_a = layer.wo_a
    wo_a.is_bmm = False  # the CUDA-only grouped-BMM kernel is never used (as on ROCm)
    qm = getattr(wo_a, "quant_method", None)
    if qm is None:
        return
    orig = qm.process_weights_after_loading
    groups, rank = layer.n_local_groups, layer.o_lora_rank
    hidden = layer.n_local_heads * layer.head_dim // groups

    def process_weights_after_loading(module):
        if module is wo_a:
            _get_cached_wo_a_bf16(wo_a, groups, rank, hidden)
        return orig(module)

    qm.process_weights_after_loading = process_weights_after_loading


def wo_a_bf16(layer) -> torch.Tensor:
    """The bf16 wo_a [groups, o_rank, K] the o_proj multiplies with."""
    cached = getattr(layer.wo_a, "_dsv4_wo_a_bf16", None)
    if cached is not None:
        return cached
    if layer.wo_a.weight.element_size() == 1:
        raise RuntimeError(
            f"{layer.prefix}: wo_a holds fp8 weights but no bf16 copy was made when they "
            "were loaded (install_wo_a_bf16_cache); refusing to read a weight that the "
            "linear's post-load processing may have repacked")
    return _get_cached_wo_a_bf16(layer.wo_a, layer.n_local_groups, layer.o_lora_rank,
                                 layer.n_local_heads * layer.head_dim // layer.n_local_groups)


# --------------------------------------------------------------------------- the layer body
class AmpereAttentionMixin:
    """forward_mqa / decode / prefill / o_proj of the Ampere classes. The model-specific
    subclass supplies ``_swa_only()``, ``_compressed_metadata(attn_metadata)``,
    ``_compressed_cache()``, ``_decode_topk(...)`` and ``_prefill_topk(...)``."""

    # The layer writes [tokens, n_local_heads, 512] bf16; no FlashMLA head padding.
    PREFILL_CHUNK_SIZE: ClassVar[int] = 4

    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        return num_heads

    # ---- checks done once at construction -------------------------------------------
    def _ampere_init(self) -> None:
        if getattr(self, "use_pcp", False):
            raise not_implemented("prefill context parallelism (PCP)")
        if self.kv_cache_dtype != "fp8_ds_mla":
            raise not_implemented(f"kv-cache dtype {self.kv_cache_dtype!r} (only the "
                                  "584-byte fp8_ds_mla record)")
        if getattr(self, "kv_mxfp8", False):
            raise not_implemented("the 528-byte V4.1 MXFP8 record (SM100 only)")
        install_wo_a_bf16_cache(self)
        self._ampere_variant = self._resolve_variant()
        from vllm.config import get_current_vllm_config
        # The engine limits the profile run's reservations are sized from.
        cfg = get_current_vllm_config()
        self._reserve_limits = reserve.Limits.from_vllm_config(cfg)
        # Upstream's rms_norm wraps past 2^32 output elements per step (step_limits.py).
        hidden = getattr(getattr(cfg, "model_config", None), "get_hidden_size", None)
        if callable(hidden):
            step_limits.check_norm_rows(self._reserve_limits.max_num_batched_tokens,
                                        hidden(), self.prefix)
        # Speculative decoding's limit on this path, refused here at engine start (spec.py).
        if self._reserve_limits.num_speculative_tokens:
            spec.check(self._reserve_limits, self.window_size,
                       0 if self._swa_only() else self._topk_width(), self.prefix)

    @staticmethod
    def _resolve_variant() -> str | None:
        try:
            return arch.current().name
        except arch.UnsupportedGPU:
            return None

    def _decode_fuses_inv_rope(self) -> bool:
        """Our decode applies the inverse RoPE once in its epilogue. Upstream's CUDA
        fallback ignores ``inv_rope_positions`` yet reports the rows as rotated, so with
        the feature off the rotation is done separately; below sm_89 upstream's fallback
        cannot even compile (fp8e4nv)."""
        if routing.use("sparse_mla_decode"):
            return True
        v = self._ampere_variant
        if v is not None and not arch.VARIANTS[v].hw_fp8:
            raise RuntimeError(
                "DeepInfer Ampere attention needs the sparse_mla_decode feature on "
                f"variant {v}: upstream's Triton decode fallback loads fp8e4nv, which "
                "Triton refuses below sm_89 (unset DEEPINFER_SPARSE_MLA_DECODE=0 / "
                "DEEPINFER_DISABLE)")
        return False

    # ---- forward --------------------------------------------------------------------
    def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                    output: torch.Tensor) -> None:
        assert isinstance(output, torch.Tensor) and output.shape == q.shape, (
            f"output buffer {getattr(output, 'shape', None)} must match q {q.shape}")
        assert output.dtype == q.dtype == torch.bfloat16
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:
            # Profile/dummy run: reserve the prefill gather workspace, as upstream does,
            # and the cross-layer gather buffer (vllm.deepinfer.yoco) of compressed layers.
            shapes = self._prefill_workspace_shapes(q)
            current_workspace_manager().get_simultaneous(*shapes)
            if not self._swa_only() and self._yoco_kv_source() is not None:
                (dims, _), = shapes
                yoco.reserve_gather_buffer(dims[0] * dims[1] * dims[2] * 2, q.device)
            self._reserve_serving_buffers(q)
            output.zero_()
            return
        if not isinstance(attn_metadata, dict):
            raise not_implemented("micro-batched (list) attention metadata")
        swa_metadata = attn_metadata.get(self.swa_cache_layer.prefix)
        assert swa_metadata is not None
        comp_metadata = self._compressed_metadata(attn_metadata)
        swa_only = self._swa_only()
        comp_cache = None if swa_only else self._compressed_cache()

        nd_tok = swa_metadata.num_decode_tokens
        if swa_metadata.num_prefills > 0:
            self._ampere_prefill(q[nd_tok:], positions[nd_tok:], comp_cache,
                                 self.swa_cache_layer.kv_cache, output[nd_tok:],
                                 comp_metadata, swa_metadata)
        rotated = 0
        if swa_metadata.num_decodes > 0 and nd_tok > 0:
            rotated = self._ampere_decode(q[:nd_tok], positions[:nd_tok], comp_cache,
                                          swa_metadata, comp_metadata, swa_only,
                                          output[:nd_tok])
        # Rows the decode epilogue did not rotate (prefill rows, unfused decode) get the
        # standalone inverse RoPE here, so _o_proj always sees rotated rows: ours
        # (kernels/inverse_rope.py), whose row offsets are int64 (upstream's
        # rocm_inverse_rope_rows_ wraps past 65,536 rows at 64 heads).
        if rotated < output.shape[0]:
            inverse_rope_rows_(output[rotated:, : self.n_local_heads, :],
                               positions[rotated: output.shape[0]],
                               self.rotary_emb.cos_sin_cache, self.rope_head_dim)

    # ---- reservations made in the profile run (vllm.deepinfer.reserve) ---------------
    def _reserve_serving_buffers(self, q: torch.Tensor) -> None:
        """Profile run: the worst case of every buffer that grows with the context, the
        batch or a CUDA graph while serving — the decode's scratch and the indexer's decode
        logits in vLLM's workspace, the prefill combined lists in persistent buffers — so
        that vLLM sizes the KV cache around them."""
        limits = self._reserve_limits
        if routing.use("sparse_mla_decode") and self._ampere_variant is not None:
            reserve.reserve_decode_scratch(limits, self._ampere_variant, q.shape[1],
                                           self._decode_keys_per_token(), q.device)
        op = getattr(getattr(self, "indexer", None), "indexer_op", None)
        if op is not None and routing.use("indexer_logits"):
            reserve.reserve_indexer_logits(limits, op.max_model_len, q.device)
        for kind in self._combine_kinds():
            reserve.reserve_combined_lists(kind, self._combine_slab_width(),
                                           limits.prefill_tokens, q.device)
        arch.log_once("reserve", f"serving buffers reserved for {limits.decode_tokens} decode "
                      f"and {limits.prefill_tokens} prefill tokens per step",
                      "profile run; DEEPINFER_SPARSE_MLA_DECODE=0 / DEEPINFER_INDEXER_LOGITS=0 "
                      "fall back to upstream's kernels and allocations")

    def _decode_keys_per_token(self) -> int:
        """K of vllm.deepinfer.reserve: the dense index width a decode token's ragged lists
        are built from (T * K entries for T tokens): the SWA rows (DSpark's wider
        non-causal rows when it speculates) plus, in compressed layers, the top-k width."""
        width = self.window_size
        limits = self._reserve_limits
        if limits.dspark:
            from vllm.v1.attention.backends.mla.compressor_utils import (
                get_dspark_swa_index_width)
            width = max(width, get_dspark_swa_index_width(width, limits.num_speculative_tokens))
        return width + (0 if self._swa_only() else self._topk_width())

    def _combine_width(self, top_k: int) -> int:
        """A combined row's width for ``top_k`` top-k columns (upstream's: V4 widens it by
        max_image_tokens)."""
        from vllm.deepinfer.kernels.topk_swa import combined_width
        return combined_width(top_k + getattr(self, "max_image_tokens", 0), self.window_size)

    def _combine_slab_width(self) -> int:
        return self._combine_width(0 if self._swa_only() else self._topk_width())

    def _combine_kinds(self) -> set[str]:
        """The combined-list buffers this layer's prefill can use: "shared" where
        cross-layer reuse keeps its lists, "own" where they serve this layer alone (a
        layer that shares with nobody, reuse off, V4's image batches)."""
        swa_only = self._swa_only()
        shared = yoco.enabled() and self._yoco_index_source(None, swa_only) is not yoco.NO_REUSE
        kinds = {"shared" if shared else "own"}
        if getattr(self, "max_image_tokens", 0):
            kinds.add("own")  # image visibility is never shared (_yoco_extra)
        return kinds

    def _prefill_workspace_shapes(self, q: torch.Tensor):
        n = 0 if self._swa_only() else -(-self.max_model_len // self.compress_ratio)
        m = n + self.window_size + self.max_num_batched_tokens
        return [((self.PREFILL_CHUNK_SIZE, m, q.shape[-1]), torch.bfloat16)]

    def _ampere_decode(self, q, positions, comp_cache, swa_metadata, comp_metadata,
                       swa_only: bool, output) -> int:
        """Returns how many leading rows came back inverse-RoPE'd."""
        # The ragged index lists the decode reads, built once per forward (yoco): the SWA
        # window's for every layer reading this SWA metadata, the global top-k's for a
        # KV-sharing group (the dense -> ragged conversion, which the decode would otherwise
        # run in every layer; ours: kernels/ragged_indices.py, int64 offsets where
        # upstream's wrap past 262,144 tokens x 8,192 columns).
        fc = get_forward_context()
        swa_cache = self.swa_cache_layer.kv_cache
        swa_rows = swa_cache.shape[0] * swa_cache.shape[1]
        swa_ragged = yoco.reuse(fc, yoco.swa_ragged_key(swa_metadata, swa_rows), lambda: (
            build_ragged_indices_from_dense(swa_metadata.decode_swa_indices,
                                            swa_metadata.decode_swa_lens, num_rows=swa_rows,
                                            name="decode_swa_indices")))
        topk_ragged = (None, None)
        if not swa_only:
            extra_rows = comp_cache.shape[0] * comp_cache.shape[1]

            def build_topk():
                indices, lens = self._decode_topk(swa_metadata, comp_metadata)
                return build_ragged_indices_from_dense(indices, lens, num_rows=extra_rows,
                                                       name="decode global top-k indices")
            key = self._yoco_decode_key(swa_metadata, comp_metadata)
            topk_ragged = yoco.reuse(fc, None if key is None else key + (extra_rows,),
                                     build_topk)
        fuse = self._decode_fuses_inv_rope()
        return rocm_sparse_attn_decode(
            q=q, kv_cache=comp_cache, swa_k_cache=swa_cache,
            swa_only=swa_only, topk_indices=None, topk_lens=None,
            swa_indices=swa_metadata.decode_swa_indices, swa_lens=swa_metadata.decode_swa_lens,
            swa_ragged_indices=swa_ragged[0], swa_ragged_indptr=swa_ragged[1],
            topk_ragged_indices=topk_ragged[0], topk_ragged_indptr=topk_ragged[1],
            attn_sink=self.attn_sink, scale=self.scale,
            head_dim=self.head_dim, nope_head_dim=self.nope_head_dim,
            rope_head_dim=self.rope_head_dim, output=output,
            inv_rope_positions=positions if fuse else None,
            inv_rope_cos_sin_cache=self.rotary_emb.cos_sin_cache if fuse else None)

    def _ampere_prefill(self, q, positions, comp_cache, swa_cache, output, comp_metadata,
                        swa_metadata) -> None:
        # Local import: both models' cache_utils are routed (patches 0001/0002).
        gather, combine = self._cache_ops()
        swa_only = comp_metadata is None or self._swa_only()
        nd = swa_metadata.num_decodes
        nd_tok = swa_metadata.num_decode_tokens
        n_pre = swa_metadata.num_prefill_tokens
        seq_lens, gather_lens = swa_metadata.prefill_seq_lens, swa_metadata.prefill_gather_lens
        qsl_cpu, qsl = swa_metadata.query_start_loc_cpu, swa_metadata.query_start_loc
        assert seq_lens is not None and gather_lens is not None
        assert qsl_cpu is not None and qsl is not None
        base = qsl_cpu[nd]
        topk_indices, top_k = self._prefill_topk(swa_metadata, comp_metadata, nd_tok, n_pre,
                                                 swa_only)
        plan = self._prefill_chunk_plan(swa_metadata, swa_only)
        assert plan, "prefill chunk plan must be non-empty when num_prefills > 0"
        kv_rows = current_workspace_manager().get_simultaneous(
            *self._prefill_workspace_shapes(q))[0].view(-1, q.shape[-1])
        # Cross-layer reuse (yoco): the compressed rows of a chunk's gather and its combined
        # lists are built once per forward by the first layer of their group.
        fc = get_forward_context()

        kv_source = None if swa_only else self._yoco_kv_source()

        def gather_key(chunk):
            return None if kv_source is None else yoco.gather_key(
                kv_source, self.compress_ratio, comp_metadata, swa_metadata, chunk)
        for c0, c1, chunk_n, chunk_m in yoco.chunk_order(fc, plan, gather_key):
            size = c1 - c0
            chunk = (c0, c1, chunk_n, chunk_m)
            kv, have_compressed = yoco.prefill_kv(
                fc, gather_key(chunk), size, chunk_m, q.shape[-1], q.device,
                lambda: kv_rows[: size * chunk_m].view(size, chunk_m, -1))
            if not swa_only and not have_compressed:
                block_table = comp_metadata.block_table[nd:]
                gather(kv[:size], comp_cache, seq_lens=seq_lens[c0:c1] // self.compress_ratio,
                       gather_lens=None, block_table=block_table[c0:c1],
                       block_size=comp_metadata.block_size // self.compress_ratio, offset=0)
                yoco.verify_gather(fc, kv[:size], chunk_n)  # DEEPINFER_YOCO_VERIFY only
            gather(kv[:size], swa_cache, seq_lens=seq_lens[c0:c1],
                   gather_lens=gather_lens[c0:c1],
                   block_table=swa_metadata.block_table[nd:][c0:c1],
                   block_size=swa_metadata.block_size, offset=chunk_n)
            qs = int(qsl_cpu[nd + c0] - base)
            qe = int(qsl_cpu[nd + c1] - base)
            extra = self._combine_extra_args(swa_metadata, nd_tok, qs, qe)
            ckey = yoco.combine_key(
                self._yoco_index_source(comp_metadata, swa_only), self.compress_ratio,
                self.window_size, top_k, swa_metadata, chunk, self._yoco_extra(extra))
            # The lists go to rows [qs, qe) of the buffer the profile run reserved for their
            # kind (vllm.deepinfer.reserve); None: the combiner allocates them.
            indices, lens = yoco.reuse(fc, ckey, lambda: combine(
                topk_indices[qs:qe], qsl[nd + c0: nd + c1 + 1], seq_lens[c0:c1],
                gather_lens[c0:c1], self.window_size, self.compress_ratio, top_k, chunk_m,
                chunk_n, out=reserve.combined_lists_out(
                    fc, ckey, yoco.step_cache(fc) is not None, self._combine_slab_width(), qs,
                    qe, self._combine_width(top_k), q.device), **extra))
            rocm_sparse_attn_prefill(
                q=q[qs:qe], kv=kv.view(-1, 1, q.shape[-1]), indices=indices,
                topk_length=lens, scale=self.scale, head_dim=self.head_dim,
                nope_head_dim=self.nope_head_dim, rope_head_dim=self.rope_head_dim,
                attn_sink=self.attn_sink, output=output[qs:qe])

    def _combine_extra_args(self, swa_metadata, nd_tok: int, qs: int, qe: int) -> dict[str, Any]:
        return {}

    # ---- cross-layer reuse keys (vllm.deepinfer.yoco) ---------------------------------
    # The model-specific subclass names its sources: ``_yoco_index_source`` (who wrote the
    # top-k rows this layer reads: an index-source layer id, a metadata object's tag, None
    # for SWA-only layers, yoco.NO_REUSE for a layer that shares with nobody) and
    # ``_yoco_kv_source`` (whose compressed cache it reads; None: a cache nobody shares).
    def _yoco_decode_key(self, swa_metadata, comp_metadata):
        return yoco.decode_indices_key(
            self._yoco_index_source(comp_metadata, False), self._yoco_kv_source(),
            self.compress_ratio, swa_metadata, comp_metadata, swa_metadata.num_decode_tokens)

    @staticmethod
    def _yoco_extra(extra: dict[str, Any]):
        """What else a combine call reads: per-token image visibility is not shared."""
        if extra.get("left_visible") is not None or extra.get("right_visible") is not None:
            return yoco.NO_REUSE
        return extra.get("max_image_tokens", 0) or None

    # ---- o_proj ---------------------------------------------------------------------
    def _o_proj(self, attn_out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not isinstance(attn_out, torch.Tensor):
            raise not_implemented("a quantized (MXFP8) attention output")
        o = attn_out[:, : self.n_local_heads, :]
        wo_a_bf16(self)  # fails loudly when the bf16 copy is missing (see wo_a_bf16)
        # forward_mqa already applied the inverse RoPE to every row.
        z = rocm_inv_rope_einsum(self.rotary_emb, o, positions, self.rope_head_dim,
                                 self.n_local_groups, self.o_lora_rank, self.wo_a,
                                 inverse_rope=False)
        return self._ampere_wo_b(z.flatten(1))

    def _ampere_wo_b(self, z: torch.Tensor) -> torch.Tensor:
        wo_b_proj = getattr(self, "_wo_b_proj", None)  # V4.1 (GEMM-RS aware)
        return wo_b_proj(z) if wo_b_proj is not None else self.wo_b(z)
