"""One DeepSeek-V4.1 attention layer through the Ampere path, stage by stage, against plain torch.

A harness, not a model: it starts from already-projected tensors (no wq/wkv/compressor linears)
with random weights and inputs, runs the path vLLM's Ampere attention classes run
(overlay/vllm/deepinfer/attention/common.py: ``_ampere_decode``, ``_ampere_prefill``,
``_o_proj``; the indexer of attention/ampere_v41.py), and checks every stage's output against a
plain-torch fp32 computation of the same math written independently of the kernels. Importable
without vLLM: torch, triton, our overlay package and build/upstream_kernels only.

Layer kinds: compress ratio 0 (SWA only), 1 and 2 (compressed cache + indexer). One step is
either a decode step (one new token per request) or a prefill chunk (requests whose new tokens
follow cached context). The caches of the context are written in setup by the same kernels the
timed stages use (not timed), and checked against the torch reference like the new rows.

Stages (names as they appear in result rows; "ours" = vllm.deepinfer, "upstream" = vLLM 0.33.0
code from build/upstream_kernels, "stand-in" = torch code where vLLM runs a CUDA C++ op or an
op outside the attention path):

``swa_insert``        ours ``fp8_writers_v41.rope_quant_insert`` with compress_ratio=1 into the SWA
                      cache of 584-byte records (GPT-J RoPE of dims 448..511 at the token's
                      position, UE8M0 block fp8 of dims 0..447). In vLLM the SWA insert is a
                      CUDA C++ op that writes the same record; this Triton writer stands in.
(compressor pooling)  stand-in, untimed, shared by both paths: upstream's
                      ``fused_save_compress_norm`` math (models/deepseek_v41/compressor.py and
                      common/ops/fused_compress_quant_cache.py) in torch: ratio 1 takes the
                      token's kv row, ratio 2 pools the group's two rows with a per-dim softmax
                      gate over their scores (sum_i softmax_i(score) * kv_i), then RMSNorm with
                      the compressor norm weight, rounded to bf16, at the group's last token.
``compress_insert``   ours ``rope_quant_insert(latent, positions, cos_sin, comp_cache, slots,
                      ratio)`` (a group's last token writes the record, RoPE at the group's
                      first position).
``indexer_k_store``   ours ``fp8_writers_v41.indexer_k_norm_rope_store`` into the index-K cache
                      [blocks, page, 132] (128 e4m3 codes per token, then the page's fp32 scales).
``indexer_q_quant``   ours ``fp8_writers_v4.fused_indexer_q_rope_quant`` (V4.1 imports V4's op:
                      models/deepseek_v41/common/ops/__init__.py); the per-(token, head) Q scale is
                      folded into the weights with softmax_scale 128**-0.5 and head scale
                      n_heads**-0.5, as DeepseekV4Indexer.forward_q passes them.
``indexer_k_gather``  prefill only; stand-in for vLLM's C++ ``cp_gather_indexer_k_quant_cache``:
                      the index keys (codes and fp32 scales) of every compressed position a
                      request's rows can see, contiguous, request after request.
``indexer_logits``    ours, as vLLM calls it through patch 0015: decode
                      ``kernels.indexer_logits.paged_mqa_logits`` over the index-K cache (one
                      row per request, length (pos + 1) // ratio); prefill ``mqa_logits`` over
                      the gathered keys, row t seeing [ks, ks + (pos + 1) // ratio).
``indexer_topk``      stand-in for vLLM's C++ ``top_k_per_row``: torch.topk over each row's valid
                      columns, -1 where a row has fewer than top-k candidates (a row with at most
                      top-k candidates selects all of them, as upstream does).
decode step:
``decode_indices``    stand-in for upstream's ``compute_global_topk_indices_and_lens`` (a Triton
                      kernel): local top-k positions -> compressed-cache slots through the block
                      table, -1 kept (the decode kernel skips slots < 0, so the per-token lists
                      stay dense: indptr = arange * top-k). The SWA window slots are step
                      metadata (vLLM's metadata builder): built in setup.
``decode_attn``       ours ``sparse_mla_decode.sparse_attn_decode`` over [SWA window] + [top-k
                      compressed] with the sink, inverse RoPE fused into its epilogue.
prefill chunk:
``kv_gather``         ours ``kv_gather.dequantize_and_gather_k_cache`` of the compressed cache
                      (offset 0, N = max seq_len // ratio rows) and of the SWA cache (offset N,
                      gather_len = q_len + min(ctx, window - 1)) into the bf16 workspace.
``combine``           ours ``topk_swa.combine_topk_swa_indices`` (width round_up(topk+W, 128)).
``prefill_attn``      ``prefill_impl="upstream"`` (what vLLM runs with the sparse_mla_prefill
                      feature off, its default from 9.0): upstream's bf16
                      ``_rocm_sparse_attn_prefill_triton``: dense -> ragged
                      (``_count_valid_row_entries_kernel`` + cumsum +
                      ``_compact_dense_row_to_ragged_kernel``) then
                      ``_sparse_attn_prefill_ragged_kernel`` (grid (T, cdiv(H, 16)), BLOCK_H 16,
                      BLOCK_D 512, BLOCK_K 16, 4 warps). ``prefill_impl="ours"`` (the feature
                      on, patch 0003): ``kernels.sparse_mla_prefill.sparse_attn_prefill`` on
                      the combiner's dense rows and lengths, the variant's tile.
``inv_rope``          upstream's ``_inverse_rope_gptj_kernel`` in place, grid (T, H), as
                      ``rocm_inverse_rope_rows_`` launches it (decode rows: the decode epilogue).
``o_proj``            bf16 einsum "tgd,grd->tgr" with wo_a dequantized once to bf16 (fp8 e4m3,
                      128x128 block scales; upstream ``_get_cached_wo_a_bf16``), then wo_b
                      (F.linear, bf16) -> [T, hidden].

Modules: this one (the entry point: ``build``, ``run_case``, ``step_flops``, and every name the
suites use), one_layer_path.py (``Spec``, ``Step``, ``Layer``, ``AmperePath``: the stages
above), one_layer_check.py (references, checks, tolerances) and one_layer_math.py (the torch
math both of those use). Imports run one way, with no circle: this module imports the other
three, path and check import math, check takes path's class names for annotations only.

Interpreter (TRITON_INTERPRET=1, CPU tests): upstream's prefill kernel computes bf16 tl.dot on
raw bit patterns there, so it is given fp32 copies of its bf16 inputs and an fp32 output; our
decode and prefill switch to fp32 dots themselves (DOT_FP32).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "overlay", REPO / "build", REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from one_layer_check import TOL, check, reference_caches  # noqa: E402
from one_layer_math import (D, FP8_MAX, IDX_D, NOPE, ROPE, compress_pool,  # noqa: E402,F401
                            cos_sin_cache, dequant_wo_a)
from one_layer_path import (PREFILL_IMPLS, REAL, AmperePath, Layer, Spec, Step)  # noqa: E402


# ----------------------------------------------------------------------------- one case
def build(spec: Spec, step: Step, dev, variant: str, seed: int = 0,
          prefill_impl: str = "upstream") -> tuple[Layer, AmperePath]:
    L = Layer(spec, step, dev, seed)
    L.fill_context(variant)
    return L, AmperePath(L, variant, prefill_impl)


def run_case(spec: Spec, step: Step, dev, variant: str, seed: int = 0,
             prefill_impl: str = "upstream"):
    """Build, run once, check: (layer, path, results)."""
    L, path = build(spec, step, dev, variant, seed, prefill_impl)
    path.run_for_check()
    if L.dev.type == "cuda":
        torch.cuda.synchronize()
    return L, path, check(path)


def step_flops(L: Layer) -> dict:
    """Matmul FLOPs of the attention and o_proj stages (for tflops fields)."""
    s, r = L.spec, L.step.ratio
    keys = s.window + (s.topk if r > 0 else 0)
    attn = 4.0 * L.T * s.heads * keys * D
    oproj = 2.0 * L.T * (s.heads * D * s.o_rank + s.o_groups * s.o_rank * s.hidden)
    return {"decode_attn": attn, "prefill_attn": attn, "o_proj": oproj}


__all__ = ["Spec", "REAL", "Step", "Layer", "AmperePath", "PREFILL_IMPLS", "build", "run_case",
           "check", "TOL", "step_flops"]
