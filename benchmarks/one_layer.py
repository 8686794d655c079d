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
``prefill_attn``      upstream's bf16 ``_rocm_sparse_attn_prefill_triton``: dense -> ragged
                      (``_count_valid_row_entries_kernel`` + cumsum +
                      ``_compact_dense_row_to_ragged_kernel``) then
                      ``_sparse_attn_prefill_ragged_kernel`` (grid (T, cdiv(H, 16)), BLOCK_H 16,
                      BLOCK_D 512, BLOCK_K 16, 4 warps) — the kernel the brief calls
                      ``_sparse_attn_prefill_kernel`` is named ``..._ragged_kernel`` in 0.33.0.
``inv_rope``          upstream's ``_inverse_rope_gptj_kernel`` in place, grid (T, H), as
                      ``rocm_inverse_rope_rows_`` launches it (decode rows: the decode epilogue).
``o_proj``            bf16 einsum "tgd,grd->tgr" with wo_a dequantized once to bf16 (fp8 e4m3,
                      128x128 block scales; upstream ``_get_cached_wo_a_bf16``), then wo_b
                      (F.linear, bf16) -> [T, hidden].

Checks (``check``; each stage row carries ``ok``, ``max_abs_diff``, ``tol`` and extra errors):

* caches (swa_insert, compress_insert): every written record compared with records quantized
  in torch (fp32 RoPE, UE8M0 scale 2^ceil(log2(max(amax, 1e-4) / 448)), e4m3 round-to-nearest-
  even). NoPE code bytes and scale bytes must be identical; RoPE bf16 values within 1 bf16 ulp of the rotated pair's norm
  (2^-7 |ref|: the Triton interpreter truncates fp32->bf16 and Triton may contract a*c - b*s
  into an FMA; on the GPU they are expected bit-identical, ``mismatch_bytes`` says).
* index keys / index queries: dequantized values within one e4m3 step of the torch values
  (|d| <= 2^-3 |ref| + 2^-9 scale: the kernels round through bf16 twice, which the interpreter
  truncates), folded weights within 1e-6 relative; ``mismatch_bytes`` reported.
* indexer_logits: |d| <= 4e-3 * sum_h |w_h| |q_h . k| s_k + 1e-6 (fp32 accumulation order; one
  bf16 ulp of the terms' magnitude as slack), against torch logits computed from the bytes the
  path wrote (stage-local).
* indexer_topk: sets equal up to near-ties: an index in the symmetric difference must have a
  reference logit within the logits tolerance of the row's k-th largest reference value.
* kv_gather / combine: bit-identical to torch (exact e4m3 x 2^k products; combine's formula).
* attention (decode_attn; prefill_attn before and inv_rope after the inverse RoPE): the torch
  reference attends over the reference caches (torch-quantized records) at the top-k set the
  path chose, window rows [max(0, pos - W + 1), pos], sink in the denominator, then the inverse
  GPT-J RoPE: |d| <= 1e-3 + 1e-2 * sum_k p_k |v_k| per element (tests/test_sparse_mla_decode.py's
  bound; a rotated lane's magnitude is its pair's sum).
* o_proj: stage-local (fp32 o_proj of the path's attention rows) and ``final`` (the fp32 chain
  from the reference attention): relative Frobenius error <= 1e-2 and max |d| <= 2e-2 max|ref|
  (bf16 level: bf16 attention rows, bf16 wo_a, bf16 intermediate z).

Interpreter (TRITON_INTERPRET=1, CPU tests): upstream's prefill kernel computes bf16 tl.dot on
raw bit patterns there, so it is given fp32 copies of its bf16 inputs and an fp32 output; our
decode switches to fp32 dots itself (DOT_FP32).
"""
from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import triton

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "overlay", REPO / "build"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from vllm.deepinfer import arch, kv_record  # noqa: E402
from vllm.deepinfer.kernels import fp8_writers_v4 as w4  # noqa: E402
from vllm.deepinfer.kernels import fp8_writers_v41 as w41  # noqa: E402
from vllm.deepinfer.kernels import indexer_logits as ilog  # noqa: E402
from vllm.deepinfer.kernels import kv_gather as kvg  # noqa: E402
from vllm.deepinfer.kernels import sparse_mla_decode as smd  # noqa: E402
from vllm.deepinfer.kernels import topk_swa  # noqa: E402

D, NOPE, ROPE = 512, 448, 64
REC = 584            # bytes per KV record: 576 data + 8 scale bytes
DATA = 576
FP8_MAX = 448.0
IDX_D, IDX_ROPE = 128, 64
IDX_REC = IDX_D + 4  # 128 e4m3 codes + one fp32 scale per token

TOL = dict(
    rope_rel=2.0 ** -7,
    idx_rel=2.0 ** -3, idx_sub=2.0 ** -9, weights_rel=1e-6,
    logits_rel=4e-3, logits_abs=1e-6,
    attn_abs=1e-3, attn_rel=1e-2,
    oproj_frob=1e-2, oproj_max=2e-2,
)


@dataclasses.dataclass(frozen=True)
class Spec:
    """Layer sizes. Defaults: DeepSeek-V4.1 with SM80 page sizes."""
    heads: int = 64
    window: int = 128
    topk: int = 512
    swa_page: int = 32
    comp_page: int = 128
    idx_heads: int = 64
    hidden: int = 5120
    o_groups: int = 8
    o_rank: int = 1024
    max_pos: int = 1 << 16
    eps: float = 1e-6


REAL = Spec()


@dataclasses.dataclass(frozen=True)
class Step:
    """``ratio``: compress ratio of the layer; per request ``ctx`` cached tokens and ``q_lens``
    new tokens. ``decode``: all q_lens are 1 and the decode path runs; else the prefill path."""
    ratio: int
    ctx: tuple
    q_lens: tuple

    @property
    def decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    def shape(self) -> dict:
        kind = "decode" if self.decode else "prefill"
        ctx = self.ctx[0] if len(set(self.ctx)) == 1 else f"{min(self.ctx)}-{max(self.ctx)}"
        return dict(kind=kind, ratio=self.ratio, reqs=len(self.ctx), ctx=ctx,
                    tokens=sum(self.q_lens))


def _upstream_prefill():
    return importlib.import_module("upstream_kernels.v41_sparse_prefill")


# ----------------------------------------------------------------------------- torch math
def cos_sin_cache(max_pos: int, dev) -> torch.Tensor:
    """[max_pos, 64] fp32 = cos (32) | sin (32), GPT-J frequencies, base 10000."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], 1).float().to(dev)


def rope_gptj(x: torch.Tensor, pos: torch.Tensor, cs: torch.Tensor, inverse=False) -> torch.Tensor:
    """GPT-J RoPE of the last 64 dims of fp32 ``x`` [n, ..., d] (pairs (even, odd)) at ``pos``
    [n]: (a c - b s, b c + a s); inverse (a c + b s, b c - a s)."""
    x = x.clone()
    c = cs[pos.long(), :ROPE // 2]
    s = cs[pos.long(), ROPE // 2:]
    while c.ndim < x.ndim:
        c, s = c.unsqueeze(1), s.unsqueeze(1)
    d0 = x.shape[-1] - ROPE
    a, b = x[..., d0::2].clone(), x[..., d0 + 1::2].clone()
    if inverse:
        s = -s
    x[..., d0::2] = a * c - b * s
    x[..., d0 + 1::2] = b * c + a * s
    return x


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 -> fp32 as the kernels' casts do it: round to nearest even on a GPU;
    truncation under the Triton interpreter (which truncates fp32 -> bf16), so that the CPU
    tests can demand identical bytes (tests/test_fp8_writers.py notes the same interpreter
    behaviour)."""
    x = x.float()
    if arch.interpreting():
        return (x.contiguous().view(torch.int32) & -65536).view(torch.float32)
    return x.to(torch.bfloat16).float()


def pow2_scale_exp(amax: torch.Tensor) -> torch.Tensor:
    return torch.ceil(torch.log2(amax.clamp_min(1e-4) / FP8_MAX))


def quantize_records(x: torch.Tensor) -> torch.Tensor:
    """fp32 [n, 512] (RoPE applied) -> record bytes [n, 584]: 448 e4m3 codes, 64 bf16, 7 UE8M0
    scale bytes, a zero pad byte. Codes and scales: the package's torch reference
    (``kv_record.quantize_rows``); the RoPE values rounded as the kernels round them here."""
    nope, scales, _ = kv_record.quantize_rows(x)
    out = torch.empty(x.shape[0], REC, dtype=torch.uint8, device=x.device)
    out[:, :NOPE] = nope
    out[:, NOPE:DATA] = bf16_round(x[:, NOPE:]).to(torch.bfloat16).contiguous().view(torch.uint8)
    out[:, DATA:] = scales
    return out


def dequant_records(rec: torch.Tensor) -> torch.Tensor:
    """record bytes [n, 584] -> fp32 [n, 512] (e4m3 * 2^(byte - 127); NaN entries zeroed)."""
    n = rec.shape[0]
    codes = rec[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(n, 7, 64)
    sc = torch.exp2(rec[:, DATA:DATA + 7].float() - 127.0)
    nope = (codes * sc[..., None]).reshape(n, NOPE)
    rope = rec[:, NOPE:DATA].contiguous().view(torch.bfloat16).float()
    return torch.nan_to_num(torch.cat([nope, rope], 1), nan=0.0)


def quantize_idx(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., 128] -> (e4m3 codes [..., 128] uint8, power-of-two scale [...] fp32)."""
    e = pow2_scale_exp(x.abs().amax(-1))
    scale = torch.exp2(e)
    codes = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scale


def _e4m3(codes: torch.Tensor) -> torch.Tensor:
    return codes.contiguous().view(torch.float8_e4m3fn).float()


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.as_strided((cache.shape[0], cache.stride(0)), (cache.stride(0), 1))


def record_index(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Flat byte offsets [n, 584] of the records at ``slots`` (data bytes then scale bytes)."""
    bs = cache.shape[1]
    page, row = (slots // bs).long(), (slots % bs).long()
    base = page * cache.stride(0)
    j = torch.arange(DATA, device=slots.device)
    data = base[:, None] + row[:, None] * DATA + j[None, :]
    k = torch.arange(8, device=slots.device)
    sc = base[:, None] + bs * DATA + row[:, None] * 8 + k[None, :]
    return torch.cat([data, sc], 1)


def read_records(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return _flat(cache).reshape(-1)[record_index(cache, slots)]


def idx_index(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bs = cache.shape[1]
    page, row = (slots // bs).long(), (slots % bs).long()
    base = page * cache.stride(0)
    codes = base[:, None] + row[:, None] * IDX_D + torch.arange(IDX_D, device=slots.device)[None, :]
    sc = base[:, None] + bs * IDX_D + row[:, None] * 4 + torch.arange(4, device=slots.device)[None, :]
    return codes, sc


def read_idx(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [n, 128] uint8, scales [n] fp32) of the index keys at ``slots``."""
    ci, si = idx_index(cache, slots)
    flat = _flat(cache).reshape(-1)
    return flat[ci], flat[si].contiguous().view(torch.float32).reshape(-1)


def compress_pool(kv_score: torch.Tensor, positions: torch.Tensor, ratio: int,
                  norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Stand-in for upstream's compressor pooling (``fused_save_compress_norm``), shared by both
    paths: bf16 latent [n, 512] at every group's last token (other rows zero). ``kv_score``
    [n, ratio == 1 ? 512 : 1024] fp32 (kv | score) for all tokens of each request, in position
    order from position 0 (so a group's earlier token is the previous row)."""
    n = kv_score.shape[0]
    latent = torch.zeros(n, D, dtype=torch.bfloat16, device=kv_score.device)
    last = ((positions + 1) % ratio == 0).nonzero().flatten()
    if ratio == 1:
        pooled = kv_score[last, :D]
    else:
        rows = last[:, None] - (ratio - 1) + torch.arange(ratio, device=last.device)[None, :]
        kv, score = kv_score[rows, :D], kv_score[rows, D:]
        pooled = (kv * torch.softmax(score, dim=1)).sum(1)
    latent[last] = rms_norm(pooled, norm_w, eps).to(torch.bfloat16)
    return latent


def dequant_wo_a(codes: torch.Tensor, scale: torch.Tensor, groups: int, rank: int) -> torch.Tensor:
    """fp8 [groups * rank, K] with [cdiv(rows,128), cdiv(K,128)] block scales -> fp32
    [groups, rank, K] (upstream ``_get_cached_wo_a_bf16`` before its bf16 cast)."""
    rows, cols = codes.shape
    s = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return (codes.float() * s).view(groups, rank, cols)


# ----------------------------------------------------------------------------- the layer
class Layer:
    """Random weights, inputs, caches and metadata of one layer for one step."""

    def __init__(self, spec: Spec, step: Step, dev, seed: int = 0):
        self.spec, self.step, self.dev = spec, step, torch.device(dev)
        s, r = spec, step.ratio
        assert r in (0, 1, 2)
        g = torch.Generator(device="cpu").manual_seed(seed)
        gd = torch.Generator(device=self.dev).manual_seed(seed + 1)

        def randn(*shape, scale=1.0, dtype=torch.float32):
            return (torch.randn(*shape, device=self.dev, generator=gd) * scale).to(dtype)

        R = len(step.ctx)
        self.R = R
        ctx = torch.tensor(step.ctx, dtype=torch.int64)
        ql = torch.tensor(step.q_lens, dtype=torch.int64)
        seq = ctx + ql
        self.seq_cpu, self.ctx_cpu, self.ql_cpu = seq, ctx, ql
        # Every position of every request (position order), and the new tokens among them.
        base = torch.cat([torch.zeros(1, dtype=torch.int64), seq.cumsum(0)[:-1]])
        self.tok_base = base
        req_all = torch.repeat_interleave(torch.arange(R), seq)
        pos_all = torch.arange(int(seq.sum())) - base[req_all]
        new = pos_all >= ctx[req_all]
        self.n_all = int(seq.sum())
        self.new_ids = new.nonzero().flatten().to(self.dev)
        self.req_all, self.pos_all = req_all.to(self.dev), pos_all.to(self.dev)
        self.req_new = req_all[new].to(self.dev)
        self.pos_new = pos_all[new].to(self.dev)
        self.T = int(ql.sum())
        self.qsl = torch.cat([torch.zeros(1, dtype=torch.int64), ql.cumsum(0)]).to(torch.int32).to(self.dev)
        self.seq_lens = seq.to(torch.int32).to(self.dev)
        self.cs = cos_sin_cache(s.max_pos, self.dev)
        assert int(seq.max()) <= s.max_pos

        # ---- SWA cache: pages only for the window tail of each request (block 0: null page).
        W = s.window
        self.swa_first = (ctx - (W - 1)).clamp(min=0)  # first position any new token sees
        sp = s.swa_page
        nlog = -(-int(seq.max()) // sp)
        bt = torch.zeros(R, nlog, dtype=torch.int64)
        nxt = 1
        for i in range(R):
            b0, b1 = int(self.swa_first[i]) // sp, -(-int(seq[i]) // sp)
            bt[i, b0:b1] = torch.arange(nxt, nxt + b1 - b0)
            nxt += b1 - b0
        perm = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(nxt - 1, generator=g)])
        self.swa_bt = perm[bt].to(torch.int32).to(self.dev)
        self.swa_cache = torch.zeros(nxt, sp, REC, dtype=torch.uint8, device=self.dev)
        in_swa = pos_all >= self.swa_first[req_all]
        swa_slot = torch.where(in_swa, perm[bt[req_all, pos_all // sp]] * sp + pos_all % sp,
                               torch.full_like(pos_all, -1))
        self.swa_slot_all = swa_slot.to(self.dev)
        self.kv_all = randn(self.n_all, D, dtype=torch.bfloat16)

        # ---- compressed + index-K caches (same block table), all compressed positions.
        self.comp_first = torch.zeros(R, dtype=torch.int64)
        if r > 0:
            cp = s.comp_page
            nc = seq // r
            self.nc_cpu = nc
            self.comp_base = torch.cat([torch.zeros(1, dtype=torch.int64), nc.cumsum(0)[:-1]]).to(self.dev)
            # Pages for every group a position can start, complete or not (with ratio 2
            # the last token may open a group whose record is written later).
            groups = -(-seq // r)
            nlog = max(1, -(-int(groups.max()) // cp))
            nblk = [-(-int(n) // cp) for n in groups]
            bt = torch.zeros(R, nlog, dtype=torch.int64)
            nxt = 1
            for i in range(R):
                bt[i, :nblk[i]] = torch.arange(nxt, nxt + nblk[i])
                nxt += nblk[i]
            perm = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(nxt - 1, generator=g)])
            self.comp_bt = perm[bt].to(torch.int32).to(self.dev)
            self.comp_cache = torch.zeros(nxt, cp, REC, dtype=torch.uint8, device=self.dev)
            self.idx_cache = torch.zeros(nxt, cp, IDX_REC, dtype=torch.uint8, device=self.dev)
            c_all = pos_all // r
            self.comp_slot_all = (perm[bt[req_all, c_all // cp]] * cp + c_all % cp).to(self.dev)
            self.kv_score_all = randn(self.n_all, D * (1 if r == 1 else 2))
            self.comp_norm_w = (1 + randn(D, scale=0.1)).to(torch.bfloat16)
            self.latent_all = compress_pool(self.kv_score_all, self.pos_all, r, self.comp_norm_w, s.eps)
            self.k_pre_all = randn(self.n_all, IDX_D, dtype=torch.bfloat16)
            self.k_norm_w = (1 + randn(IDX_D, scale=0.1)).to(torch.bfloat16)
            # Per new token: its causal compressed length and its request's block table row.
            self.idx_lens = ((self.pos_new + 1) // r).to(torch.int32)
            self.max_len = max(1, int(self.idx_lens.max()))
            self.logits_cols = -(-self.max_len // cp) * cp
            self.bt_rows = self.comp_bt[self.req_new].contiguous()
            if not step.decode:
                self._prefill_k_gather_plan(R)

        # ---- new-token inputs and weights.
        H, IH = s.heads, s.idx_heads
        T = self.T
        self.q = randn(T, H, D, dtype=torch.bfloat16)
        self.iq = randn(T, IH, IDX_D, dtype=torch.bfloat16)
        self.iw = randn(T, IH)
        self.sink = randn(H, scale=2.0)
        self.scale = D ** -0.5
        K = H * D // s.o_groups
        w = randn(s.o_groups * s.o_rank, K, scale=0.05)
        rb, cb = -(-w.shape[0] // 128), -(-K // 128)
        wp = F.pad(w, (0, cb * 128 - K, 0, rb * 128 - w.shape[0]))
        amax = wp.reshape(rb, 128, cb, 128).abs().amax((1, 3)).clamp_min(1e-12)
        self.wo_a_scale = amax / FP8_MAX
        s_full = self.wo_a_scale.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :K]
        self.wo_a_fp8 = (w / s_full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        self.wo_a_f32 = dequant_wo_a(self.wo_a_fp8, self.wo_a_scale, s.o_groups, s.o_rank)
        self.wo_a_bf16 = self.wo_a_f32.to(torch.bfloat16)   # cached once, as upstream
        self.wo_b = randn(s.hidden, s.o_groups * s.o_rank, scale=(s.o_groups * s.o_rank) ** -0.5,
                          dtype=torch.bfloat16)

        # ---- new-token slices (contiguous: what the kernels get).
        ids = self.new_ids
        self.kv_new = self.kv_all[ids].contiguous()
        self.swa_slot_new = self.swa_slot_all[ids].contiguous()
        if r > 0:
            self.latent_new = self.latent_all[ids].contiguous()
            self.k_pre_new = self.k_pre_all[ids].contiguous()
            self.comp_slot_new = self.comp_slot_all[ids].contiguous()

        # ---- step metadata (vLLM's builders): SWA window slots per new token (decode), the
        # prefill workspace geometry.
        pos = self.pos_new
        j = torch.arange(W, device=self.dev)
        wpos = pos[:, None] - (W - 1) + j[None, :]
        self.win_pos = wpos
        ok = wpos >= 0
        wp_ = wpos.clamp(min=0)
        swa_bt = self.swa_bt.long()
        slot = swa_bt[self.req_new[:, None], wp_ // sp] * sp + wp_ % sp
        self.win_slots = torch.where(ok, slot, -1).to(torch.int32)
        if step.decode:
            self.swa_idx = self.win_slots.reshape(-1).contiguous()
            self.swa_ptr = (torch.arange(T + 1, device=self.dev) * W).to(torch.int32)
            self.ext_ptr = (torch.arange(T + 1, device=self.dev) * s.topk).to(torch.int32)
        else:
            self.gather_lens_cpu = ql + ctx.clamp(max=W - 1)
            self.gather_lens = self.gather_lens_cpu.to(torch.int32).to(self.dev)
            self.N = int(self.nc_cpu.max()) if r > 0 else 0
            self.M = self.N + int(self.gather_lens_cpu.max())

    # ---- setup: the context's cache rows, written by the same kernels (untimed) ----------
    def fill_context(self, variant: str) -> None:
        s, r = self.spec, self.step.ratio
        old = (self.pos_all < self.step_ctx_all()).nonzero().flatten()
        o_swa = old[self.swa_slot_all[old] >= 0]
        if o_swa.numel():
            w41.rope_quant_insert(self.kv_all[o_swa].contiguous(), self.pos_all[o_swa].contiguous(),
                                  self.cs, self.swa_cache, self.swa_slot_all[o_swa].contiguous(), 1,
                                  variant=variant)
        if r > 0 and old.numel():
            w41.rope_quant_insert(self.latent_all[old].contiguous(), self.pos_all[old].contiguous(),
                                  self.cs, self.comp_cache, self.comp_slot_all[old].contiguous(), r,
                                  variant=variant)
            w41.indexer_k_norm_rope_store(self.k_pre_all[old].contiguous(), self.pos_all[old].contiguous(),
                                          self.cs, self.k_norm_w, s.eps, self.idx_cache,
                                          self.comp_slot_all[old].contiguous(), r, False,
                                          variant=variant)

    def step_ctx_all(self) -> torch.Tensor:
        return self.ctx_cpu.to(self.dev)[self.req_all]


    def _prefill_k_gather_plan(self, R: int) -> None:
        """What vLLM's prefill indexer gathers per chunk (``cp_gather_indexer_k_quant_cache``,
        a CUDA C++ op; a torch stand-in here): every compressed position a request's rows can
        see, request after request, as contiguous codes [N, 128] and fp32 scales [N]; row t
        then sees keys [ks[t], ks[t] + idx_lens[t]) of that buffer."""
        cp = self.spec.comp_page
        req, lens = self.req_new.cpu(), self.idx_lens.cpu()
        n = [int(lens[req == b].max()) if bool((req == b).any()) else 0 for b in range(R)]
        starts = [0]
        for x in n[:-1]:
            starts.append(starts[-1] + x)
        b_of = torch.cat([torch.full((x,), b, dtype=torch.int64) for b, x in enumerate(n)])
        c_of = torch.cat([torch.arange(x, dtype=torch.int64) for x in n])
        page = self.comp_bt.cpu().long()[b_of, c_of // cp]
        base = page * self.idx_cache.stride(0)
        row = c_of % cp
        self.kg_code_idx = (base[:, None] + row[:, None] * IDX_D
                            + torch.arange(IDX_D)[None, :]).to(self.dev)
        self.kg_scale_idx = (base[:, None] + cp * IDX_D + row[:, None] * 4
                             + torch.arange(4)[None, :]).to(self.dev)
        self.kg_slots = (page * cp + row).to(self.dev)  # for the check, via read_idx
        ks = torch.tensor(starts, dtype=torch.int32)[req.long()]
        self.kg_ks = ks.to(self.dev)
        self.kg_ke = (ks + lens).to(torch.int32).to(self.dev)


# ----------------------------------------------------------------------------- the Ampere path
class AmperePath:
    """The stages of one step on one variant, as closures over preallocated buffers (CUDA-graph
    capturable: no host syncs). ``stages`` is the ordered list of (name, fn)."""

    def __init__(self, L: Layer, variant: str):
        self.L, self.v = L, variant
        s, r, T = L.spec, L.step.ratio, L.T
        self.interp = arch.interpreting()
        self.attn = torch.empty(T, s.heads, D, dtype=torch.bfloat16, device=L.dev)
        self.topk_local = torch.full((T, max(s.topk, 4)), -1, dtype=torch.int32, device=L.dev)
        st: list[tuple[str, Callable[[], None]]] = [("swa_insert", self.swa_insert)]
        if r > 0:
            st += [("compress_insert", self.compress_insert), ("indexer_k_store", self.indexer_k_store),
                   ("indexer_q_quant", self.indexer_q_quant)]
            if not L.step.decode:
                st.append(("indexer_k_gather", self.indexer_k_gather))
            st += [("indexer_logits", self.indexer_logits), ("indexer_topk", self.indexer_topk)]
        if L.step.decode:
            if r > 0:
                st.append(("decode_indices", self.decode_indices))
                self.ext_idx = torch.empty(T * s.topk, dtype=torch.int32, device=L.dev)
            st.append(("decode_attn", self.decode_attn))
        else:
            self.ws = torch.empty(L.R, L.M, D, dtype=torch.bfloat16, device=L.dev)
            width = topk_swa.combined_width(s.topk if r > 0 else 0, s.window)
            self.ci = torch.empty(T, width, dtype=torch.int32, device=L.dev)
            self.cl = torch.empty(T, dtype=torch.int32, device=L.dev)
            st += [("kv_gather", self.kv_gather), ("combine", self.combine),
                   ("prefill_attn", self.prefill_attn), ("inv_rope", self.inv_rope)]
            if self.interp:
                self.attn32 = torch.empty(T, s.heads, D, dtype=torch.float32, device=L.dev)
        st.append(("o_proj", self.o_proj))
        self.stages = st

    def run(self) -> None:
        for _, fn in self.stages:
            fn()

    def run_for_check(self) -> None:
        """``run`` plus a copy of the prefill attention rows before the in-place inverse RoPE
        (so ``check`` can compare ``prefill_attn`` and ``inv_rope`` separately)."""
        for name, fn in self.stages:
            fn()
            if name == "prefill_attn":
                self.attn_pre = (self.attn32 if self.interp else self.attn).clone()

    # ---- stages -----------------------------------------------------------------------
    def swa_insert(self):
        L = self.L
        w41.rope_quant_insert(L.kv_new, L.pos_new, L.cs, L.swa_cache, L.swa_slot_new, 1,
                              variant=self.v)

    def compress_insert(self):
        L = self.L
        w41.rope_quant_insert(L.latent_new, L.pos_new, L.cs, L.comp_cache, L.comp_slot_new,
                              L.step.ratio, variant=self.v)

    def indexer_k_store(self):
        L = self.L
        w41.indexer_k_norm_rope_store(L.k_pre_new, L.pos_new, L.cs, L.k_norm_w, L.spec.eps,
                                      L.idx_cache, L.comp_slot_new, L.step.ratio, False,
                                      variant=self.v)

    def indexer_q_quant(self):
        L = self.L
        self.q8, self.wout = w4.fused_indexer_q_rope_quant(
            L.pos_new, L.iq, L.cs, L.iw, IDX_D ** -0.5, L.spec.idx_heads ** -0.5, variant=self.v)

    def indexer_logits(self):
        L = self.L
        T, IH = L.T, L.spec.idx_heads
        if L.step.decode:  # vLLM's decode: paged logits over the index-K cache
            self.logits = ilog.paged_mqa_logits(
                self.q8.view(T, 1, IH, IDX_D), L.idx_cache, self.wout, L.idx_lens, L.bt_rows,
                L.logits_cols, variant=self.v)
        else:  # vLLM's prefill: logits over the gathered keys, row t from column 0
            self.logits = ilog.mqa_logits(
                self.q8, self.kg_codes, self.kg_scales, self.wout, L.kg_ks, L.kg_ke,
                L.logits_cols, variant=self.v)

    def indexer_k_gather(self):
        L = self.L
        flat = _flat(L.idx_cache).reshape(-1)
        self.kg_codes = flat[L.kg_code_idx]
        self.kg_scales = flat[L.kg_scale_idx].view(torch.float32).reshape(-1)

    def indexer_topk(self):
        L = self.L
        cols = self.logits.shape[1]
        valid = torch.arange(cols, device=L.dev)[None, :] < L.idx_lens[:, None]
        s = self.logits.masked_fill(~valid, float("-inf"))
        k = min(L.spec.topk, cols)
        vals, idx = s.topk(k, dim=1)
        self.topk_local[:, :k] = torch.where(vals == float("-inf"), -1, idx).to(torch.int32)

    def decode_indices(self):
        L = self.L
        cp = L.spec.comp_page
        tk = self.topk_local[:, :L.spec.topk].long()
        safe = tk.clamp(min=0)
        slot = L.comp_bt.long()[L.req_new[:, None], safe // cp] * cp + safe % cp
        self.ext_idx.copy_(torch.where(tk >= 0, slot, -1).reshape(-1))

    def decode_attn(self):
        L = self.L
        ex = {}
        if L.step.ratio > 0:
            ex = dict(extra_cache=L.comp_cache, extra_indices=self.ext_idx, extra_indptr=L.ext_ptr)
        smd.sparse_attn_decode(L.q, L.swa_cache, L.swa_idx, L.swa_ptr, L.scale, L.sink, NOPE, ROPE,
                               **ex, out=self.attn, inv_rope_positions=L.pos_new,
                               inv_rope_cos_sin_cache=L.cs, variant=self.v)

    def kv_gather(self):
        L, s = self.L, self.L.spec
        if L.step.ratio > 0:
            kvg.dequantize_and_gather_k_cache(self.ws, L.comp_cache, L.seq_lens // L.step.ratio, None,
                                              L.comp_bt, s.comp_page, 0, variant=self.v)
        kvg.dequantize_and_gather_k_cache(self.ws, L.swa_cache, L.seq_lens, L.gather_lens, L.swa_bt,
                                          s.swa_page, L.N, variant=self.v)

    def combine(self):
        L, s, r = self.L, self.L.spec, self.L.step.ratio
        topk_swa.combine_topk_swa_indices(self.topk_local, L.qsl, L.seq_lens, L.gather_lens,
                                          s.window, r, s.topk if r > 0 else 0, L.M, L.N,
                                          out=(self.ci, self.cl), variant=self.v)

    def prefill_attn(self):
        """Upstream ``_rocm_sparse_attn_prefill_triton`` (host code mirrored)."""
        up = _upstream_prefill()
        L = self.L
        kv = self.ws.view(-1, D)
        ind, lens = self.ci, self.cl
        nq, width = ind.shape
        num_rows = kv.shape[0]
        # build_ragged_indices_from_dense
        block = min(triton.next_power_of_2(width), 1024)
        counts = torch.empty(nq, dtype=torch.int32, device=L.dev)
        indptr = torch.empty(nq + 1, dtype=torch.int32, device=L.dev)
        block_r = max(1, 1024 // block)
        up._count_valid_row_entries_kernel[(triton.cdiv(nq, block_r),)](
            ind, lens, counts, indptr, ind.stride(0), int(num_rows), nq, width,
            BLOCK_R=block_r, BLOCK_W=block)
        torch.cumsum(counts, dim=0, out=indptr[1:])
        flat = torch.empty(nq * width, dtype=torch.int32, device=L.dev)
        up._compact_dense_row_to_ragged_kernel[(nq,)](
            ind, lens, indptr, flat, ind.stride(0), int(num_rows), width, BLOCK_W=block)
        # _rocm_sparse_attn_prefill_ragged_triton
        q, out = L.q, self.attn
        if self.interp:  # bf16 tl.dot is wrong under the interpreter: fp32 copies, fp32 out
            q, kv, out = q.float(), kv.float(), self.attn32
        H = q.shape[1]
        up._sparse_attn_prefill_ragged_kernel[(nq, triton.cdiv(H, 16))](
            q, kv, flat, indptr, L.sink, out,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
            out.stride(0), out.stride(1), out.stride(2), H, D, kv.shape[0], float(L.scale),
            HAS_ATTN_SINK=True, OUT_DV=out.shape[-1], BLOCK_H=16, BLOCK_D=512, BLOCK_K=16,
            num_warps=4)

    def inv_rope(self):
        """Upstream ``rocm_inverse_rope_rows_`` -> ``_fused_inverse_rope_gptj(o, ..., out=o)``."""
        up = _upstream_prefill()
        L = self.L
        o = self.attn32 if self.interp else self.attn
        out = self.attn
        up._inverse_rope_gptj_kernel[(L.T, L.spec.heads)](
            o, out, L.pos_new, L.cs, o.stride(0), o.stride(1), out.stride(0), out.stride(1),
            L.cs.stride(0), NOPE=NOPE, HALF=ROPE // 2, BLOCK_NOPE=triton.next_power_of_2(NOPE),
            BLOCK_HALF=triton.next_power_of_2(ROPE // 2))

    def o_proj(self):
        L, s = self.L, self.L.spec
        z = torch.einsum("tgd,grd->tgr", self.attn.view(L.T, s.o_groups, -1), L.wo_a_bf16)
        self.y = F.linear(z.flatten(1), L.wo_b)


# ----------------------------------------------------------------------------- references
def reference_caches(L: Layer) -> dict:
    """Torch quantization of every row the path writes (setup and new tokens), fp32 math."""
    s, r = L.spec, L.step.ratio
    out = {}
    sw = (L.swa_slot_all >= 0).nonzero().flatten()
    x = rope_gptj(L.kv_all[sw].float(), L.pos_all[sw], L.cs)
    out["swa_ids"], out["swa_rec"] = sw, quantize_records(x)
    if r > 0:
        last = ((L.pos_all + 1) % r == 0).nonzero().flatten()
        grp = L.pos_all[last] // r * r
        x = rope_gptj(L.latent_all[last].float(), grp, L.cs)
        out["comp_ids"], out["comp_rec"] = last, quantize_records(x)
        k = bf16_round(rms_norm(L.k_pre_all[last].float(), L.k_norm_w, s.eps))
        k = bf16_round(rope_gptj(k, grp, L.cs))
        out["idx_codes"], out["idx_scale"] = quantize_idx(k)
        # Dequantized rows by (request, compressed position): global id comp_base[req] + c.
        gid = L.comp_base[L.req_all[last]] + L.pos_all[last] // r
        nc = int(L.nc_cpu.sum())
        rows = torch.zeros(nc, D, device=L.dev)
        rows[gid] = dequant_records(out["comp_rec"])
        out["comp_rows"] = rows
    rows = torch.zeros(L.n_all, D, device=L.dev)  # SWA rows by global token id (tail only)
    rows[sw] = dequant_records(out["swa_rec"])
    out["swa_rows"] = rows
    return out


def reference_q(L: Layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [T, IH, 128] uint8, scale [T, IH], folded weights [T, IH]) of the index queries."""
    s = L.spec
    x = L.iq.float()
    x = bf16_round(rope_gptj(x, L.pos_new, L.cs))
    x[..., :IDX_D - IDX_ROPE] = L.iq[..., :IDX_D - IDX_ROPE].float()
    codes, scale = quantize_idx(x)
    w = L.iw * scale * (IDX_D ** -0.5) * (s.idx_heads ** -0.5)
    return codes, scale, w


def reference_logits(L: Layer, q8: torch.Tensor, wout: torch.Tensor, idx_cache: torch.Tensor,
                     cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, cols], magnitude [T, cols]) from the given fp8 Q, folded weights and index-K
    cache (columns >= the row's length: -inf / 0). logit = sum_h w_h relu(q_h . k) s_k."""
    cp = L.spec.comp_page
    T = L.T
    q = _e4m3(q8.view(torch.uint8) if q8.dtype != torch.uint8 else q8)  # [T, IH, 128]
    w = wout.float()
    logits = torch.full((T, cols), float("-inf"), device=L.dev)
    mag = torch.zeros(T, cols, device=L.dev)
    bt = L.comp_bt.long()
    for i in range(L.R):
        rows = (L.req_new == i).nonzero().flatten()
        if rows.numel() == 0:
            continue
        n = int(L.nc_cpu[i])
        c = torch.arange(n, device=L.dev)
        codes, ks = read_idx(idx_cache, bt[i, c // cp] * cp + c % cp)
        k = _e4m3(codes)
        for a in range(0, rows.numel(), 128):
            rr = rows[a:a + 128]
            sdot = torch.einsum("thd,jd->thj", q[rr], k)           # [t, IH, n]
            lg = (w[rr][:, :, None] * sdot.clamp(min=0)).sum(1) * ks[None, :]
            mg = (w[rr][:, :, None].abs() * sdot.abs()).sum(1) * ks[None, :]
            lens = L.idx_lens[rr].long()
            ok = c[None, :] < lens[:, None]
            logits[rr, :n] = torch.where(ok, lg, float("-inf"))
            mag[rr, :n] = torch.where(ok, mg, 0.0)
    return logits, mag


def reference_attention(L: Layer, ref: dict, topk_local: torch.Tensor | None,
                        chunk: int = 128) -> tuple[torch.Tensor, ...]:
    """(out fp32 [T, H, 512] after inverse RoPE, magnitude sum_k p_k |v_k| [T, H, 512], the same
    two before the inverse RoPE) over the
    reference caches: window rows [max(0, pos-W+1), pos] plus the compressed rows ``topk_local``
    chose (-1 skipped), sink in the softmax denominator."""
    s, r = L.spec, L.step.ratio
    T, H = L.T, s.heads
    out = torch.empty(T, H, D, device=L.dev)
    mag, out_pre, mag_pre = torch.empty_like(out), torch.empty_like(out), torch.empty_like(out)
    tb = L.tok_base.to(L.dev)
    for a in range(0, T, chunk):
        t = torch.arange(a, min(T, a + chunk), device=L.dev)
        req, wpos = L.req_new[t], L.win_pos[t]
        ok = wpos >= 0
        keys = ref["swa_rows"][(tb[req][:, None] + wpos.clamp(min=0))]
        if r > 0:
            tk = topk_local[t, :s.topk].long()
            ok = torch.cat([ok, tk >= 0], 1)
            keys = torch.cat([keys, ref["comp_rows"][L.comp_base[req][:, None] + tk.clamp(min=0)]], 1)
        keys = torch.where(ok[..., None], keys, 0.0)
        sc = torch.einsum("thd,tkd->thk", L.q[t].float(), keys) * L.scale
        sc = sc.masked_fill(~ok[:, None, :], float("-inf"))
        sc = torch.cat([sc, L.sink.float()[None, :, None].expand(len(t), H, 1)], 2)
        p = torch.softmax(sc, 2)[..., :-1]
        o = torch.einsum("thk,tkd->thd", p, keys)
        mg = torch.einsum("thk,tkd->thd", p, keys.abs())
        out[t] = rope_gptj(o, L.pos_new[t], L.cs, inverse=True)
        out_pre[t], mag_pre[t] = o, mg
        pair = mg[..., NOPE::2] + mg[..., NOPE + 1::2]  # a rotated lane mixes its pair
        mg[..., NOPE::2], mg[..., NOPE + 1::2] = pair, pair
        mag[t] = mg
    return out, mag, out_pre, mag_pre


def o_proj_ref(L: Layer, attn: torch.Tensor) -> torch.Tensor:
    s = L.spec
    z = torch.einsum("tgd,grd->tgr", attn.float().view(L.T, s.o_groups, -1), L.wo_a_f32)
    return z.flatten(1) @ L.wo_b.float().t()


# ----------------------------------------------------------------------------- checks
def _bytes_mismatch(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


def _rec_check(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Record bytes [n, 584]: NoPE codes + scale bytes identical, RoPE within 1 bf16 ulp."""
    codes_scales_equal = torch.equal(got[:, :NOPE], ref[:, :NOPE]) and torch.equal(got[:, DATA:], ref[:, DATA:])
    gr = got[:, NOPE:DATA].contiguous().view(torch.bfloat16).float()
    rr = ref[:, NOPE:DATA].contiguous().view(torch.bfloat16).float()
    d = (gr - rr).abs()
    # One bf16 ulp of the rotated pair's norm (GPT-J pairs 2i, 2i+1): a rotation keeps the
    # norm, and an output that cancels (a*c - b*s small against a, b) carries the rounding
    # of its operands, up to ulp(|pair|), not ulp of its own small value.
    pair = rr.view(rr.shape[0], -1, 2).norm(dim=-1).repeat_interleave(2, dim=-1)
    rope_ok = bool((d <= TOL["rope_rel"] * torch.maximum(pair, gr.abs())).all())
    dg, dr = dequant_records(got), dequant_records(ref)
    return dict(ok=codes_scales_equal and rope_ok, exact=torch.equal(got, ref),
                mismatch_bytes=_bytes_mismatch(got, ref), rows=got.shape[0],
                max_abs_diff=float((dg - dr).abs().max()) if got.numel() else 0.0,
                nope_scale_bytes_equal=codes_scales_equal, rope_max_abs_diff=float(d.max()) if d.numel() else 0.0,
                tol="NoPE+scale bytes equal; RoPE |d| <= 2^-7 max(|pair|, |got|) (1 bf16 ulp of the rotated pair)")


def _idx_check(codes, scale, rcodes, rscale) -> dict:
    """fp8 rows with one power-of-two scale: dequantized |d| <= 2^-3 |ref| + 2^-9 scale_ref."""
    g = _e4m3(codes) * scale[..., None]
    r = _e4m3(rcodes) * rscale[..., None]
    d = (g - r).abs()
    bound = TOL["idx_rel"] * r.abs() + TOL["idx_sub"] * rscale[..., None]
    return dict(ok=bool((d <= bound).all()), exact=torch.equal(codes, rcodes) and torch.equal(scale, rscale),
                mismatch_bytes=_bytes_mismatch(codes, rcodes) + _bytes_mismatch(scale, rscale),
                max_abs_diff=float(d.max()) if d.numel() else 0.0,
                tol="|d| <= 2^-3 |ref| + 2^-9 scale (one e4m3 step)")


def _close(got: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, rel: float, abs_: float) -> dict:
    d = (got.float() - ref).abs()
    bound = abs_ + rel * mag
    finite = bool(torch.isfinite(got.float()).all())
    return dict(ok=finite and bool((d <= bound).all()), max_abs_diff=float(d.max()) if d.numel() else 0.0,
                max_excess=float((d - bound).max()) if d.numel() else 0.0,
                tol=f"|d| <= {abs_} + {rel} * magnitude")


def _oproj_close(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = got.float() - ref
    frob = float(d.norm() / ref.norm().clamp_min(1e-30))
    mx = float(d.abs().max())
    ok = bool(torch.isfinite(got.float()).all()) and frob <= TOL["oproj_frob"] and \
        mx <= TOL["oproj_max"] * float(ref.abs().max())
    return dict(ok=ok, max_abs_diff=mx, rel_frob=frob, ref_max=float(ref.abs().max()),
                tol=f"rel Frobenius <= {TOL['oproj_frob']}, max |d| <= {TOL['oproj_max']} max|ref|")


def _topk_check(sel: torch.Tensor, ref_logits: torch.Tensor, mag: torch.Tensor, lens: torch.Tensor,
                topk: int) -> dict:
    """Sets equal up to near-ties (see module doc)."""
    T, cols = ref_logits.shape
    k = min(topk, cols)
    rv, ri = ref_logits.topk(k, dim=1)
    sel, rv, ri, lens = sel.cpu(), rv.cpu(), ri.cpu(), lens.cpu()
    ref_logits, mag = ref_logits.cpu(), mag.cpu()
    n_sym = 0
    worst = 0.0
    ok = True
    for t in range(T):
        n = min(int(lens[t]), topk)
        got = set(x for x in sel[t].tolist() if x >= 0)
        want = set(ri[t, :n].tolist()) if n else set()
        if len(got) != n or any(x >= int(lens[t]) for x in got):
            ok = False
            continue
        diff = got ^ want
        if not diff:
            continue
        n_sym += len(diff)
        kth = float(rv[t, n - 1])
        idx = torch.tensor(sorted(diff))
        gap = (ref_logits[t, idx] - kth).abs()
        tol = TOL["logits_rel"] * mag[t, idx] + TOL["logits_abs"]
        worst = max(worst, float((gap - tol).max()))
        ok = ok and bool((gap <= tol).all())
    return dict(ok=ok, sym_diff=n_sym, max_excess=worst, max_abs_diff=None,
                tol="set equal; symmetric-difference entries within the logits tolerance of the k-th value")


def check(path: AmperePath, ref: dict | None = None) -> dict[str, dict]:
    """Run-once results of ``path`` (``path.run_for_check()`` done) against the torch references:
    {stage: {ok, max_abs_diff, tol, ...}} plus "final" (end-to-end o_proj)."""
    L = path.L
    s, r = L.spec, L.step.ratio
    ref = ref if ref is not None else reference_caches(L)
    res: dict[str, dict] = {}
    ids = ref["swa_ids"]
    got = read_records(L.swa_cache, L.swa_slot_all[ids])
    res["swa_insert"] = _rec_check(got, ref["swa_rec"])
    if r > 0:
        ids = ref["comp_ids"]
        res["compress_insert"] = _rec_check(read_records(L.comp_cache, L.comp_slot_all[ids]),
                                            ref["comp_rec"])
        codes, sc = read_idx(L.idx_cache, L.comp_slot_all[ids])
        res["indexer_k_store"] = _idx_check(codes, sc, ref["idx_codes"], ref["idx_scale"])
        rq, rs, rw = reference_q(L)
        q8 = path.q8.view(torch.uint8)
        c = _idx_check(q8, rs, rq, rs)
        wd = (path.wout - rw).abs()
        c["weights_max_rel_diff"] = float((wd / rw.abs().clamp_min(1e-30)).max())
        c["ok"] = c["ok"] and bool((wd <= TOL["weights_rel"] * rw.abs()).all())
        c["exact"] = torch.equal(q8, rq) and torch.equal(path.wout, rw)
        c["tol"] += "; weights |d| <= 1e-6 |ref|"
        res["indexer_q_quant"] = c
        if not L.step.decode:
            codes, scales = read_idx(L.idx_cache, L.kg_slots)
            same = torch.equal(path.kg_codes, codes) and torch.equal(
                path.kg_scales.view(torch.int32), scales.view(torch.int32))
            res["indexer_k_gather"] = dict(ok=same, exact=same, rows=int(codes.shape[0]),
                                           tol="bit-identical to the records at the slots")
        lg_ref, mag = reference_logits(L, path.q8, path.wout, L.idx_cache, L.logits_cols)
        ok = torch.arange(L.logits_cols, device=L.dev)[None, :] < L.idx_lens.long()[:, None]
        got_l = torch.where(ok, path.logits[:, :L.logits_cols].float(), 0.0)
        c = _close(got_l, torch.where(ok, lg_ref, 0.0), mag, TOL["logits_rel"], TOL["logits_abs"])
        res["indexer_logits"] = c
        res["indexer_topk"] = _topk_check(path.topk_local[:, :s.topk], lg_ref, mag, L.idx_lens, s.topk)
    tk = path.topk_local if r > 0 else None
    att_ref, att_mag, pre_ref, pre_mag = reference_attention(L, ref, tk)
    if L.step.decode:
        if r > 0:
            cp = s.comp_page
            t = path.topk_local[:, :s.topk].long()
            want = torch.where(t >= 0, L.comp_bt.long()[L.req_new[:, None], t.clamp(min=0) // cp] * cp
                               + t.clamp(min=0) % cp, -1)
            res["decode_indices"] = dict(ok=torch.equal(path.ext_idx.long(), want.reshape(-1)),
                                         max_abs_diff=None, tol="exact")
        res["decode_attn"] = _close(path.attn, att_ref, att_mag, TOL["attn_rel"], TOL["attn_abs"])
    else:
        res["kv_gather"] = _gather_check(path)
        res["combine"] = _combine_check(path)
        pre = getattr(path, "attn_pre", None)
        if pre is not None:
            res["prefill_attn"] = _close(pre, pre_ref, pre_mag, TOL["attn_rel"], TOL["attn_abs"])
        else:
            res["prefill_attn"] = dict(ok=None, max_abs_diff=None, tol="not checked: run_for_check "
                                       "keeps the rows before the in-place inverse RoPE")
        res["inv_rope"] = _close(path.attn, att_ref, att_mag, TOL["attn_rel"], TOL["attn_abs"])
    res["o_proj"] = _oproj_close(path.y, o_proj_ref(L, path.attn))
    res["final"] = _oproj_close(path.y, o_proj_ref(L, att_ref))
    return res


def _gather_check(path: AmperePath) -> dict:
    """The workspace against torch dequantization of the bytes in the caches."""
    L, s, r = path.L, path.L.spec, path.L.step.ratio
    bad = 0
    mx = 0.0
    for b in range(L.R):
        parts = []
        if r > 0:
            n = int(L.nc_cpu[b])
            c = torch.arange(n, device=L.dev)
            slots = L.comp_bt.long()[b, c // s.comp_page] * s.comp_page + c % s.comp_page
            parts.append((0, dequant_records(read_records(L.comp_cache, slots))))
        gl, sl = int(L.gather_lens_cpu[b]), int(L.seq_cpu[b])
        p = torch.arange(sl - gl, sl, device=L.dev)
        slots = L.swa_bt.long()[b, p // s.swa_page] * s.swa_page + p % s.swa_page
        parts.append((L.N, dequant_records(read_records(L.swa_cache, slots))))
        for off, rows in parts:
            got = path.ws[b, off:off + rows.shape[0]]
            want = rows.to(torch.bfloat16)
            bad += _bytes_mismatch(got, want)
            mx = max(mx, float((got.float() - want.float()).abs().max()) if rows.numel() else 0.0)
    return dict(ok=bad == 0, exact=bad == 0, mismatch_bytes=bad, max_abs_diff=mx, tol="bit-identical")


def _combine_check(path: AmperePath) -> dict:
    """Upstream V4.1 combine formula in torch (kernels/topk_swa.py module doc)."""
    L, s, r = path.L, path.L.spec, path.L.step.ratio
    W, topk = s.window, (s.topk if r > 0 else 0)
    b = L.req_new.long()
    pos = L.pos_new.long()
    sl, gl = L.seq_lens.long()[b], L.gather_lens.long()[b]
    n = ((pos + 1) // max(r, 1)).clamp(max=topk) if r > 0 else torch.zeros_like(pos)
    gstart = sl - gl
    start = torch.maximum(torch.maximum(pos - W + 1, torch.zeros_like(pos)), gstart)
    sw = (pos - start + 1).clamp(min=0)
    col = torch.arange(path.ci.shape[1], device=L.dev)[None, :]
    tk = path.topk_local.long()
    tkc = torch.gather(tk, 1, col.clamp(max=tk.shape[1] - 1).expand(L.T, -1))
    tkv = torch.where((tkc < 0) | (tkc >= L.N), -1, tkc + L.M * b[:, None])
    swv = L.M * b[:, None] + L.N + (start - gstart)[:, None] + (col - n[:, None])
    want = torch.where(col < n[:, None], tkv,
                       torch.where(col < (n + sw)[:, None], swv, -1)).to(torch.int32)
    lens = (n + sw).to(torch.int32)
    ok = torch.equal(want, path.ci) and torch.equal(lens, path.cl)
    return dict(ok=ok, exact=ok, max_abs_diff=None, tol="bit-identical")


# ----------------------------------------------------------------------------- one case
def build(spec: Spec, step: Step, dev, variant: str, seed: int = 0) -> tuple[Layer, AmperePath]:
    L = Layer(spec, step, dev, seed)
    L.fill_context(variant)
    return L, AmperePath(L, variant)


def run_case(spec: Spec, step: Step, dev, variant: str, seed: int = 0):
    """Build, run once, check: (layer, path, results)."""
    L, path = build(spec, step, dev, variant, seed)
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


__all__ = ["Spec", "REAL", "Step", "Layer", "AmperePath", "build", "run_case", "check", "TOL",
           "step_flops"]
