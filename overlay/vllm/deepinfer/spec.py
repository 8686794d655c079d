"""Speculative decoding on the Ampere path: the limit a configuration must fit, checked once
per attention layer at engine start.

``check`` runs in the Ampere attention classes' constructor (attention/common.py
``_ampere_init``): vLLM builds the target's layers and the draft's (V4's MTP block, the DSpark
stages of V4.1 and V4) before it loads weights or sizes the KV cache, so a configuration that
cannot run is refused there with one line naming the limit and the nearest setting that
fits, instead of failing at its first decode step.

What depends on the number of speculative tokens k on this path (vLLM 0.33.0 read; shared
memory measured by compiling for sm_80, tests/test_spec_limits.py):

* Shared memory: nothing grows with k. The decode runs one program per query token over that
  token's own ragged key list with the variant's fixed tile (kernels/sparse_mla_decode.py),
  the indexer logits one program per row (kernels/indexer_logits.py); the Triton kernels whose
  compile-time constants take k (upstream's DSpark input preparation, BLOCK_SIZE
  next_pow2(2k + 1) up to 256; the non-causal SWA rows; the indexer's uniform-decode
  preparation; adaptive verification's refit, BLOCK next_pow2(k)) use 0 to 8 bytes of shared
  memory at every k from 1 to 64 built for sm_80. No k exceeds an A100's (or an sm_86 GPU's)
  shared memory here; the ~200 KB that public Ampere ports report for DSpark k = 7 belongs
  to their kernels, not to these.
* The decode's ragged index lists: for T decode tokens per step and W index columns per
  token a list holds up to T x W entries, and its int32 ``indptr`` addresses at most
  2^31 - 1 (kernels/ragged_indices.py refuses more at the step itself). T grows with k
  (max_num_seqs x (1 + k) tokens, within max_num_batched_tokens and the largest CUDA graph:
  reserve.Limits.decode_tokens), and under DSpark so does W (the non-causal SWA rows,
  window + k rounded up to 64); compressed layers' top-k lists have the top-k width.
* MTP on DeepSeek-V4.1: refused by vLLM itself before any layer is built
  (config/speculative.py: "DeepSeek V4.1 has no classic-MTP draft ... Use speculative
  method 'dspark' instead of 'mtp'"; tests/test_ckpt_spec.py runs it).
"""
from __future__ import annotations

import dataclasses

__all__ = ["INT32_MAX", "SpeculativeLimitError", "dspark_swa_width", "list_entries", "check"]

INT32_MAX = 2 ** 31 - 1
# Upstream's alignment of DSpark's non-causal SWA rows
# (v1/attention/backends/mla/compressor_utils.py, get_dspark_swa_index_width).
_DSPARK_ALIGN = 64


class SpeculativeLimitError(ValueError):
    """A speculative configuration past a limit of the Ampere path."""


def dspark_swa_width(window: int, k: int) -> int:
    """Columns of DSpark's non-causal SWA rows: upstream's get_dspark_swa_index_width."""
    try:
        from vllm.v1.attention.backends.mla.compressor_utils import get_dspark_swa_index_width
    except ImportError:  # the package without vLLM (CPU tests)
        return -(-(max(window, 0) + max(k, 0)) // _DSPARK_ALIGN) * _DSPARK_ALIGN
    return int(get_dspark_swa_index_width(window, k))


def list_entries(limits, window: int, topk_width: int) -> int:
    """The most entries one of a layer's decode index lists holds in a step: T decode
    tokens x the wider of its SWA rows and its top-k rows (0: an SWA-only layer)."""
    swa = window
    if limits.dspark:
        swa = max(swa, dspark_swa_width(window, limits.num_speculative_tokens))
    return limits.decode_tokens * max(swa, topk_width)


def _fits(limits, window: int, topk_width: int) -> bool:
    return list_entries(limits, window, topk_width) <= INT32_MAX


def check(limits, window: int, topk_width: int, where: str = "") -> None:
    """Raise SpeculativeLimitError when ``limits`` (reserve.Limits) with speculative tokens
    make a decode index list pass what its int32 offsets address; the message names the
    limit and the nearest setting that fits (the largest smaller k, else the largest
    max_num_seqs at this k)."""
    k = int(limits.num_speculative_tokens)
    if k <= 0 or _fits(limits, window, topk_width):
        return
    nearest_k = next((j for j in range(k - 1, 0, -1)
                      if _fits(dataclasses.replace(limits, num_speculative_tokens=j),
                               window, topk_width)), None)
    if nearest_k is not None:
        nearest = f"num_speculative_tokens={nearest_k} fits at max_num_seqs={limits.max_num_seqs}"
    else:
        seqs = next((s for s in range(int(limits.max_num_seqs) - 1, 0, -1)
                     if _fits(dataclasses.replace(limits, max_num_seqs=s),
                              window, topk_width)), None)
        nearest = (f"max_num_seqs={seqs} fits at num_speculative_tokens={k}" if seqs
                   else "lower max_num_batched_tokens and the CUDA graph sizes")
    method = "DSpark" if limits.dspark else "speculative decoding"
    raise SpeculativeLimitError(
        f"DeepInfer Ampere attention{' ' + where if where else ''}: {method} with "
        f"num_speculative_tokens={k} gives {limits.decode_tokens} decode tokens per step x "
        f"{list_entries(limits, window, topk_width) // limits.decode_tokens} index columns = "
        f"{list_entries(limits, window, topk_width)} entries in one index list, past the "
        f"2^31 - 1 its int32 offsets address; nearest setting: {nearest}")
