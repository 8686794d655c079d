"""The sparse indexer's decode top-k in row chunks whose offsets fit 32 bits.

vLLM 0.33.0's decode top-k kernels address the logits as ``row * stride`` in 32-bit
integers (csrc/persistent_topk.cuh, ``FilteredTopKUnifiedKernel`` and
``persistent_topk_kernel``: uint32 x uint32; docs/long-context.md, "CUDA C++ ops"). The
decode logits are [rows, max_model_len // ratio] fp32, so at a 1M context on a ratio-1 layer
(stride 2^20 elements) row 4,096 wraps to row 0 and is silently scored from another row's
logits. vLLM accepts such batches (max_num_seqs 4,097, or 1,024 sequences with 4 speculative
tokens). ``indexer_decode_topk`` runs the top-k on views of whole requests whose last
element offset stays below 2^31 (a view's row 0 is its own first row, so every in-kernel
product is small); calls that fit run as one call, exactly as upstream does.

Switch: feature ``topk_rows`` (on everywhere: it changes nothing below the bound);
``DEEPINFER_TOPK_ROWS=0`` makes every call one upstream call again.
"""
from __future__ import annotations

from typing import Callable

import torch

from vllm.deepinfer import routing

FEATURE = "topk_rows"
# Offsets of the kernel stay below 2^31 (int32- and uint32-safe).
OFFSET_LIMIT = 2 ** 31


def row_chunks(rows: int, stride: int, width: int, next_n: int,
               limit: int | None = None) -> list[tuple[int, int]]:
    """(first request, request count) of each chunk: whole requests of ``next_n`` rows, as
    many as keep ``(rows_in_chunk - 1) * stride + width`` below ``limit`` (default
    OFFSET_LIMIT); one chunk when all of ``rows`` fit."""
    limit = OFFSET_LIMIT if limit is None else limit
    if rows <= 0:
        return []
    next_n = max(1, next_n)
    requests = -(-rows // next_n)
    if (rows - 1) * stride + width < limit:
        return [(0, requests)]
    fit_rows = max(1, (limit - 1 - width) // max(1, stride) + 1)
    per = max(1, fit_rows // next_n)
    if (per * next_n - 1) * stride + width >= limit:
        raise ValueError(f"indexer decode top-k: one request's {next_n} logits rows of stride "
                         f"{stride} pass 2^31 elements; no chunking keeps the kernel's "
                         "32-bit offsets")
    return [(b, min(per, requests - b)) for b in range(0, requests, per)]


def indexer_decode_topk(topk: Callable, logits: torch.Tensor, seq_lens: torch.Tensor,
                        next_n: int, topk_indices: torch.Tensor, topk_tokens: int,
                        max_seq_len) -> None:
    """``topk(logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len)`` (upstream's
    SparseIndexerTopk) over row chunks of whole requests (module doc). ``seq_lens``: one
    entry (or a row of ``next_n``) per request."""
    rows = logits.shape[0]
    chunks = (row_chunks(rows, logits.stride(0), logits.shape[1], next_n)
              if routing.use(FEATURE) else [])
    if len(chunks) <= 1:
        topk(logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len)
        return
    n = max(1, next_n)
    for b, count in chunks:
        r0, r1 = b * n, min(rows, (b + count) * n)
        topk(logits[r0:r1], seq_lens[b:b + count], next_n, topk_indices[r0:r1], topk_tokens,
             max_seq_len)
