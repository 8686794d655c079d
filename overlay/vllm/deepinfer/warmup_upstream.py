"""Warmup keys of upstream vLLM helpers that the Ampere path launches but vLLM's JIT warmup
does not know, so that no request compiles them (feature ``serve_warmup``).

The H200 nocompile run (benchmarks/results/archive/h200-2026-12-01-e2e-4ab26c8.json, rows
``zero_compile``) saw these compile while serving, after vLLM's warmup:
  * the dense -> ragged index conversion (``build_ragged_indices_from_dense`` in
    v1/attention/ops/rocm_aiter_mla_sparse.py), which the Ampere decode runs for its SWA and
    top-k lists: its row count and KV row bound took new integer specializations per batch,
    and row widths not seen in the warmup set new block constexprs;
  * V4.1's candidate-block selection (model_executor/kernels/attention/dsa/
    candidate_blocks.py), run by the candidate source's indexer and masked by its consumers:
    upstream registers no warmup for it on any GPU, and its logits row stride moves with the
    context length.
Patches 0003 (the conversion) and 0026 (the candidate kernels) unspecialize those per-batch integers (``routing.unspecialized``); the keys below
compile what is left: one configuration per row-width block class for the conversion, and
the candidate kernels with the config's block size and candidate count, as the CUDA indexer
calls them (no row starts, one row per token, fp32 logits, no DeepSelect below 9.0).

Signatures follow the upstream kernels' parameter order (vLLM 0.33.0); a test checks them
against the sdist source. Integer values given in a key's ``ints`` are the ones the launches
pass where Triton would specialize them (unit strides as 1, absent row starts as None and
their stride as 0); the others take ``warmup._INT``.
"""
from __future__ import annotations

__all__ = ["SIGNATURES", "KERNELS", "ragged_keys", "candidate_keys", "RAGGED_BLOCKS"]

_RAGGED = "vllm.v1.attention.ops.rocm_aiter_mla_sparse"
_CANDIDATES = "vllm.model_executor.kernels.attention.dsa.candidate_blocks"

SIGNATURES: dict[str, dict[str, str]] = {
    "count_valid_rows": {
        "indices_ptr": "*i32", "lengths_ptr": "*i32", "counts_ptr": "*i32", "indptr_ptr": "*i32",
        "indices_stride0": "i32", "num_rows_limit": "i32", "num_queries": "i32",
        "row_width": "i32", "BLOCK_R": "constexpr", "BLOCK_W": "constexpr"},
    "compact_rows": {
        "indices_ptr": "*i32", "lengths_ptr": "*i32", "indptr_ptr": "*i32", "out_ptr": "*i32",
        "indices_stride0": "i32", "num_rows_limit": "i32", "row_width": "i32",
        "BLOCK_W": "constexpr"},
    "candidate_scores": {
        "logits": "*fp32", "starts": "*i32", "ends": "*i32", "scores": "*fp32",
        "valid_blocks": "*i32", "stride_row": "i32", "stride_col": "i32", "stride_start": "i32",
        "stride_end": "i32", "stride_scores": "i32", "width": "i32", "nblocks": "i32",
        "BLOCK_SIZE": "constexpr", "HAS_STARTS": "constexpr", "ROW_REPEAT": "constexpr",
        "TILE": "constexpr", "FULL_WIDTH": "constexpr"},
    "candidate_store": {
        "values": "*fp32", "indices": "*i64", "output": "*i32", "out_stride_row": "i32",
        "out_stride_col": "i32", "k": "i32", "OUT_K": "constexpr", "TILE": "constexpr"},
    "candidate_flags": {
        "candidates": "*i32", "starts": "*i32", "flags": "*u8", "stride_row": "i32",
        "stride_col": "i32", "stride_start": "i32", "width": "i32", "nblocks": "i32",
        "BLOCK_SIZE": "constexpr", "K": "constexpr", "HAS_STARTS": "constexpr",
        "ROW_REPEAT": "constexpr"},
    "candidate_mask": {
        "logits": "*fp32", "starts": "*i32", "ends": "*i32", "flags": "*u8",
        "stride_row": "i32", "stride_col": "i32", "stride_start": "i32", "stride_end": "i32",
        "width": "i32", "nblocks": "i32", "BLOCK_SIZE": "constexpr",
        "HAS_STARTS": "constexpr", "ROW_REPEAT": "constexpr", "TILE": "constexpr"},
}

# warmup kernel name -> (upstream module, jit function)
KERNELS: dict[str, tuple[str, str]] = {
    "count_valid_rows": (_RAGGED, "_count_valid_row_entries_kernel"),
    "compact_rows": (_RAGGED, "_compact_dense_row_to_ragged_kernel"),
    "candidate_scores": (_CANDIDATES, "_block_scores_kernel"),
    "candidate_store": (_CANDIDATES, "_store_candidates_kernel"),
    "candidate_flags": (_CANDIDATES, "_candidate_flags_kernel"),
    "candidate_mask": (_CANDIDATES, "_mask_candidates_kernel"),
}

# The conversion's block is min(next_pow2(row width), 1024) with 1024 // block rows per
# program. Rows on the Ampere path are 128-column multiples (the SWA window, top-k lists,
# combined top-k + window rows) or wider; every class from 16 up is compiled so that a
# narrower list (a small window) is covered too: 7 classes x 2 kernels of a few hundred
# instructions each.
RAGGED_BLOCKS = (16, 32, 64, 128, 256, 512, 1024)
# Row strides and widths the conversion passes are multiples of 16 (see above): _INT.


def ragged_keys(key_cls) -> list:
    out = []
    for block in RAGGED_BLOCKS:
        out.append(key_cls("count_valid_rows",
                           (("BLOCK_R", max(1, 1024 // block)), ("BLOCK_W", block)), None, None))
        out.append(key_cls("compact_rows", (("BLOCK_W", block),), None, None))
    return out


def candidate_keys(key_cls, block_size: int, topk_blocks: int) -> list:
    """V4.1's candidate kernels as sparse_attn_indexer launches them on CUDA below 9.0."""
    if block_size <= 0 or topk_blocks <= 0:
        return []
    no_starts = (("starts", None), ("stride_start", 0))
    return [
        key_cls("candidate_scores", (("BLOCK_SIZE", block_size), ("FULL_WIDTH", True),
                                     ("HAS_STARTS", False), ("ROW_REPEAT", 1), ("TILE", 128)),
                None, None, ints=no_starts + (("stride_col", 1), ("stride_end", 1))),
        key_cls("candidate_store", (("OUT_K", topk_blocks), ("TILE", 256)), None, None,
                ints=(("out_stride_row", topk_blocks), ("out_stride_col", 1))),
        key_cls("candidate_flags", (("BLOCK_SIZE", block_size), ("HAS_STARTS", False),
                                    ("K", topk_blocks), ("ROW_REPEAT", 1)), None, None,
                ints=no_starts + (("stride_row", topk_blocks), ("stride_col", 1))),
        key_cls("candidate_mask", (("BLOCK_SIZE", block_size), ("HAS_STARTS", False),
                                   ("ROW_REPEAT", 1), ("TILE", 1024)), None, None,
                ints=no_starts + (("stride_col", 1), ("stride_end", 1))),
    ]
