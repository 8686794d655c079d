"""Units, cache record sizes and the paging facts of vLLM 0.33.0 the planner counts with.

Upstream file references are relative to the ``vllm/`` package of vLLM 0.33.0.
"""
from __future__ import annotations

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
# in models/deepseek_v4/compressor.py.
LOGICAL_BLOCK = 256
# V4.1's compressed and indexer caches: the block vLLM resolves when both backends declare
# 64-token pages -- upstream's classes on SM90 (models/deepseek_v41/sparse_mla.py,
# DeepseekV41IndexerBackend) and the Ampere path as the tree has it (feature kv_page64, on
# by default since 934a453: attention/ampere_v41.py). The per-table ``layers`` command
# pages with it; plans resolve the block per serving path (packing.py; 128 with
# DEEPINFER_KV_PAGE64=0, upstream's pages off SM90).
V41_BLOCK = 64
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
# engine/arg_utils.py get_batch_defaults: 256 sequences on <70 GiB or A100 GPUs; the largest
# CUDA-graph capture size min(max_num_seqs x decode query length x 2, 512) off SM100
# (config/vllm.py), 512 at 256 sequences. The decode reservations are sized from both.
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_CAPTURE_SIZE = 512


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
