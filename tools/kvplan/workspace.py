"""What the Ampere path reserves per GPU in vLLM's profile run, before vLLM sizes the KV
cache from the memory left: the terms, each from the code that asks for it.

vLLM's workspace (v1/worker/workspace.py) is one buffer per GPU that grows to the largest
``get_simultaneous`` request of the profile run (each view starting at a multiple of 256 B),
so the requests below that live in it count once, as their maximum:

* prefill gather, every Ampere layer (overlay attention/common.py
  ``AmpereAttentionMixin._prefill_workspace_shapes``): ``[PREFILL_CHUNK_SIZE, M, 512]``
  bf16 with M = ceil(max_model_len / ratio) + window + max_num_batched_tokens (no
  compressed rows in sliding-window-only layers): 4 x (L + 128 + 8,192) KiB = 4.03 GiB for
  a ratio-1 layer at L = 1,048,576;
* upstream's indexer K gather, every indexer (model_executor/layers/sparse_attn_indexer.py:
  values, scales and the radix top-k's 1 MiB) for ``get_max_prefill_buffer_size //
  ratio`` rows = max_model_len x (576 * 2 // 132) x factor / ratio
  (v1/attention/backends/mla/indexer.py; factor: config/vllm.py);
* the decode scratch and the indexer's decode logits (overlay reserve.py): parameters of
  ``ampere_reserved_bytes`` until the planner has their formulas.

Outside the workspace, so they add: the cross-layer gather buffer of layers reading a KV
source (overlay yoco.py ``reserve_gather_buffer``: the layer's prefill gather, at most
``GATHER_BUFFER_MAX_BYTES``), the persistent indexer-K rows (yoco.py ``reserve_indexer_k``,
patch 0041: the indexer's rows, at most ``INDEXER_K_MAX_ROWS``), the combined index lists
(overlay reserve.py ``CombineSlab``: a parameter), and the indexer's transient logits
(sparse_attn_indexer.py allocates VLLM_SPARSE_INDEXER_MAX_LOGITS_MB while the workspace
is held, so the profile's peak includes it).
"""
from __future__ import annotations

from .layers import Layer
from .sizes import MiB, cdiv, round_up

# AmpereAttentionMixin.PREFILL_CHUNK_SIZE (overlay attention/common.py, upstream V4.1's
# value): requests per prefill chunk, the first dimension of the gather workspace.
PREFILL_CHUNK_SIZE = 4
# One gathered latent row: head_dim 512 in bf16.
LATENT_ROW_BYTES = 512 * 2
# vLLM's workspace starts every view of one request at a multiple of 256 B
# (v1/worker/workspace.py; overlay reserve.py WORKSPACE_ALIGN).
WORKSPACE_ALIGN = 256
# The radix top-k's share of the indexer's profile request (RADIX_TOPK_WORKSPACE_SIZE in
# model_executor/layers/sparse_attn_indexer.py, 1 MiB in vLLM 0.33.0).
RADIX_TOPK_BYTES = 1 * MiB
# get_max_prefill_buffer_size: max_model_len x (576 * 2 // 132) x factor indexer rows
# (v1/attention/backends/mla/indexer.py).
PREFILL_BUFFER_ENTRIES_PER_TOKEN = 576 * 2 // 132  # = 8
# Indexer scales per row: one fp32 (fp8 rows) or four UE8M0 (MXFP4 rows, one per 32
# values): 4 B either way (sparse_attn_indexer.py _gather_workspace_shapes).
INDEXER_SCALE_BYTES = 4
# VLLM_SPARSE_INDEXER_MAX_LOGITS_MB (envs.py default 512): the indexer's dummy logits.
INDEXER_LOGITS_BYTES = 512 * MiB
# overlay yoco.py: bound of the persistent prefill gather buffer and of the persistent
# indexer-K rows.
GATHER_BUFFER_MAX_BYTES = 256 * MiB
INDEXER_K_MAX_ROWS = 512 * 1024


def workspace_factor(max_model_len: int) -> int:
    """sparse_mla_prefill_workspace_factor (config/vllm.py): 5 up to 256K tokens, else 2."""
    return 5 if max_model_len <= 256 * 1024 else 2


def _aligned(n: int) -> int:
    return round_up(int(n), WORKSPACE_ALIGN)


def prefill_gather_bytes(ratio: int, window: int, max_model_len: int,
                         max_num_batched_tokens: int) -> int:
    """One Ampere layer's prefill gather request (``_prefill_workspace_shapes``)."""
    compressed = cdiv(max_model_len, ratio) if ratio > 0 else 0
    rows = compressed + window + max_num_batched_tokens
    return _aligned(PREFILL_CHUNK_SIZE * rows * LATENT_ROW_BYTES)


def indexer_rows(ratio: int, max_model_len: int) -> int:
    """The indexer's prefill gather rows (``max_total_seq_len`` of the V4/V4.1 indexers)."""
    buffer = max_model_len * PREFILL_BUFFER_ENTRIES_PER_TOKEN * workspace_factor(max_model_len)
    return buffer // ratio


def indexer_gather_bytes(ratio: int, record_bytes: int, max_model_len: int) -> int:
    """Upstream's indexer profile request: values, scales, the radix top-k's share."""
    rows = indexer_rows(ratio, max_model_len)
    return (_aligned(rows * (record_bytes - INDEXER_SCALE_BYTES))
            + _aligned(rows * INDEXER_SCALE_BYTES) + _aligned(RADIX_TOPK_BYTES))


def _indexers(layers: list[Layer]) -> list[tuple[int, int]]:
    """(ratio, record bytes) of every indexer K cache the layers own."""
    return [(c.tokens_per_state, c.record_bytes) for x in layers for c in x.caches
            if c.name.endswith(".indexer")]


def ampere_reserved_bytes(held: list[Layer], max_model_len: int, max_num_batched_tokens: int,
                          *, yoco: bool = True, decode_workspace_bytes: int = 0,
                          indexer_decode_logits_bytes: int = 0,
                          combined_lists_bytes: int = 0) -> dict[str, int]:
    """Bytes the Ampere path reserves on a GPU holding ``held`` (layers that run there;
    planner replicas of a remote KV source, labelled "replica ...", run nothing), by term,
    with ``workspace`` (the largest workspace request) and ``total``.

    ``decode_workspace_bytes`` (the decode scratch's worst case), ``indexer_decode_logits_
    bytes`` (both in vLLM's workspace) and ``combined_lists_bytes`` (persistent) stand for
    the reservations of overlay reserve.py; they default to 0 until the planner computes
    them (pass the figures reserve.py logs meanwhile). ``yoco``: the cross-layer reuse
    feature (yoco_reuse, on by default on the Ampere path; upstream has neither buffer)."""
    running = [x for x in held if not x.label.startswith("replica")]
    prefill = max((prefill_gather_bytes(x.ratio, x.window, max_model_len,
                                        max_num_batched_tokens) for x in running), default=0)
    indexers = _indexers(running)
    indexer = max((indexer_gather_bytes(r, rec, max_model_len) for r, rec in indexers),
                  default=0)
    out = {"prefill_gather": prefill, "indexer_k_gather": indexer,
           "decode_workspace": int(decode_workspace_bytes),
           "indexer_decode_logits": int(indexer_decode_logits_bytes)}
    out["workspace"] = max(out.values())
    readers = [x for x in running if x.ratio > 0 and x.kv_source is not None]
    gather = max((prefill_gather_bytes(x.ratio, x.window, max_model_len, max_num_batched_tokens)
                  for x in readers), default=0)
    out["yoco_gather_buffer"] = min(gather, GATHER_BUFFER_MAX_BYTES) if yoco else 0
    out["yoco_indexer_k"] = max((min(indexer_rows(r, max_model_len), INDEXER_K_MAX_ROWS) * rec
                                 for r, rec in indexers), default=0) if yoco else 0
    out["indexer_logits_transient"] = INDEXER_LOGITS_BYTES if indexers else 0
    out["combined_lists"] = int(combined_lists_bytes)
    out["total"] = (out["workspace"] + out["yoco_gather_buffer"] + out["yoco_indexer_k"]
                    + out["indexer_logits_transient"] + out["combined_lists"])
    return out
