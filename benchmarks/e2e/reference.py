# Why this file stays whole: it is one fp32 forward, read top to bottom against upstream --
# loading, the primitives only it uses, Engram hashing, then the Reference model whose
# methods follow the decoder's order -- and each function cites the upstream function it
# re-implements; the tests reach all of it as one module (reference.X).
"""fp32 torch reference forward of the end-to-end test checkpoints (DeepSeek-V4.1 / V4).

    python benchmarks/e2e/reference.py --model CKPT_DIR --lens 7 300 1500 5000 16000 \
        --seed 0 --out REF.json [--threads N] [--device cpu|cuda] [--mimic-kv-fp8]

Reads a checkpoint written by tools/make_checkpoint.py (config.json + safetensors, any of
its formats), dequantizes every tensor to fp32 (fp8 e4m3 blocks with UE8M0 scales, MXFP4
experts, the fp8 Engram tables; bf16 tensors widened) with make_checkpoint's own decoders,
and runs the whole model in fp32 plain torch over each prompt of run.py's ``prompts(lens,
vocab, seed)`` (imported, not copied). It writes the prompt part of run.py's ``agree``
JSON: mode "fp32_reference", per prompt ``prompt_len``, ``prompt`` = per position i >= 1
``[top1_token, top1_logprob, logprob_of_prompt[i]]`` from the distribution after tokens
< i, and ``generated: []`` -- so ``compare.pair(run, ref)`` works unchanged.

What it computes (vLLM 0.33.0 semantics, re-implemented from reading; the upstream
function followed is cited at each function below):
  * DeepSeek-V4.1 (model_type deepseek_v41): the "shifted" mHC of
    models/deepseek_v41/nvidia/model.py::DeepseekV4DecoderLayer.forward -- every sublayer's
    input collapses the hc streams with the pre-mix of the *previous* sublayer (first
    layer: stream 0 = the embedding), coefficients per
    model_executor/kernels/mhc/torch.py::mhc_pre_delayed_torch (Sinkhorn, hc_eps,
    post x2.0), post per ::mhc_post_torch, the RMSNorm of the collapsed input; Engram
    injected between the previous post and the pre of layers in engram_layer_ids
    (common/engram.py::Engram.forward, n-gram hashes as ::_hash_ids_kernel over the token
    map ::build_compressed_token_map of the checkpoint's tokenizer); final collapse with
    the last FFN pre-mix (DeepseekV4Model.forward -> hc_collapse_triton) + norm + head.
    Attention (attention.py): q = wq_b(q_norm(wq_a x)) (no per-head q norm on V4.1),
    kv = kv_norm(wkv x), GPT-J RoPE on the last 64 dims (theta: rope_theta on ratio-0
    layers, compress_rope_theta otherwise; common/rope.py), per-head sink in the softmax
    denominator, scale 512^-0.5, keys = values = the 512-dim rows, keys = the causal
    sliding window of 128 raw rows + the top-k compressed rows of the layer's kv source,
    inverse RoPE of the output, grouped wo_a then wo_b (nvidia/ops/o_proj.py). Compressor
    on kv sources (compressor.py + common/ops/fused_compress_quant_cache.py::
    _fused_save_compress_norm_kernel): ratio 1 = the wkv row, ratio 2 = per-dim softmax
    (wgate scores) pooling of positions (2c, 2c+1), RMSNorm, RoPE at position c*ratio.
    Indexer on index sources (attention.py::DeepseekV4Indexer, sparse_attn_indexer.py):
    keys k_norm(wk(latent)) of the kv source (RoPE'd at c*ratio), queries
    wq_b(qr) RoPE'd at the token position, logits sum_h w_h relu(q_h.k) with
    w = weights_proj(x) * 128^-0.5 * 64^-0.5 over the (p+1)//ratio visible entries; the
    candidate source keeps the 16 best 64-entry blocks by block max (newest block pinned,
    kernels/attention/dsa/candidate_blocks.py), later index sources mask their logits to
    those blocks; top-k 512; consumers reuse the top-k of the largest index source <= them.
    MoE: sqrt(softplus(logits)) scores, selection by score + bias, weights = selected
    scores renormalized x routed_scaling_factor (router/cpu_router.py::
    _sqrtsoftplus_bias_topk), experts w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))
    (activation.py::SiluAndMulWithClamp), plus the shared expert with the same clamp.
  * DeepSeek-V4 (model_type deepseek_v4): non-delayed mHC (models/deepseek_v4/cpu/
    model.py::_forward_unfused_post_pre: collapse with this sublayer's own pre-mix), per-head
    weight-free q RMSNorm, ratio 0 run as ratio 1 (SWA only), compressors with ape and the
    overlapping windows of ratio 4 (common/ops/fused_compress_quant_cache.py::
    _fused_kv_compress_norm_rope_insert_sparse_attn: rows of the previous group read dims
    [0, d), rows of the closing group dims [d, 2d)), C4A with its own indexer compressor
    (head 128) and top-k 512, C128A attending to every visible compressed row, RoPE theta
    compress_rope_theta only on ratio > 1 layers, head: hc_head (sigmoid gates from
    hc_head_fn, kernels/mhc/tilelang_kernels.py::hc_head_fuse_tilelang) + norm + head.

Where it deliberately differs from the served path:
  * Everything is fp32: no bf16 activations or residual streams, no fp8 / MXFP8 activation
    quantization in the linears, no fp8 indexer q / k, no fp8 KV cache records -- the
    "true" value of the same (dequantized) weights. ``--mimic-kv-fp8`` quantizes the KV
    cache as the 584-B record does (NoPE 448 dims to e4m3 with one UE8M0 scale per 64
    values, after a bf16 rounding; RoPE dims to bf16), for the sliding-window rows and the
    compressed rows, so the share of a gap due to cache quantization can be seen. The
    indexer keys / queries stay fp32 even then.
  * Top-k ties and near-ties are resolved by torch.topk in fp32; the served indexer scores
    fp8 values, so selections at the margin can differ (this is part of what is measured).
  * Not modelled (cannot occur in these runs): image sentinel tokens (run.py prompts stay
    below id vocab-100), hash-routed MoE layers (num_hash_layers 0), the candidate
    kernel's packed-column "edge" clamp, MTP layers.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def e2e_run_module():
    """benchmarks/e2e/run.py, loaded by path: a bare `import run` can find benchmarks/run.py
    first when another module put benchmarks/ on sys.path."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("e2e_run", HERE / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
REPO = HERE.parent.parent
for _p in (str(REPO / "tools"), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from ckptgen.config import _is_prime  # noqa: E402
from ckptgen.formats import dequantize_fp8_blocks, dequantize_mxfp4  # noqa: E402

ROPE_DIM = 64
HC_POST_MULT = 2.0          # hc_post_alpha in both decoder layers
E4M3_MAX = 448.0
KV_QUANT_BLOCK = 64         # 584-B record: one UE8M0 scale per 64 NoPE dims
ENGRAM_CLAMP = 1e-6         # Engram.clamp_value
MEM_ELEMS = 1 << 25         # bound on the largest temporary (elements) per chunk


# --------------------------------------------------------------------------- loading
class Model:
    """Config + fp32 weights of one checkpoint directory."""

    def __init__(self, ckpt: str | Path, device: str = "cpu"):
        self.dir = Path(ckpt)
        raw = json.loads((self.dir / "config.json").read_text())
        self.raw = raw
        self.kind = raw.get("model_type")
        if self.kind not in ("deepseek_v41", "deepseek_v4"):
            raise SystemExit(f"{ckpt}: model_type {self.kind!r} is not deepseek_v41/v4")
        self.cfg = raw["text_config"] if self.kind == "deepseek_v41" else raw
        self.device = torch.device(device)
        self.w = load_weights(self.dir, self.device)

    def c(self, key, default=None):
        return self.cfg.get(key, default)


def load_weights(d: Path, device) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor as fp32; ``X.weight`` + ``X.scale`` pairs dequantized
    (uint8 = MXFP4 experts, e4m3 = fp8 blocks incl. the Engram tables)."""
    from safetensors import safe_open
    files = sorted(d.glob("*.safetensors"))
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                raw[k] = sf.get_tensor(k)
    out = {}
    for k, t in raw.items():
        if k.endswith(".scale") and k[:-6] + ".weight" in raw:
            continue
        sk = k[:-7] + ".scale" if k.endswith(".weight") else None
        if sk is not None and sk in raw:
            s = raw[sk]
            if t.dtype == torch.uint8:
                v = dequantize_mxfp4(t, s)
            else:
                v = dequantize_fp8_blocks(t, s)
        else:
            v = t.float()
        out[k] = v.to(device).contiguous()
    return out


# --------------------------------------------------------------------------- primitives
def rms_norm(x, w=None, eps=1e-6):
    """model_executor/layers/layernorm.py::RMSNorm.forward_native in fp32."""
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def rope_cos_sin(theta: float, positions: torch.Tensor):
    """cos/sin [N, 32] of rotary_embedding/deepseek_scaling_rope.py::
    DeepseekV4ScalingRotaryEmbedding with factor 1 and mscale 0 (= plain RoPE)."""
    inv = 1.0 / (theta ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32,
                                        device=positions.device) / ROPE_DIM))
    f = positions.to(torch.float32)[:, None] * inv[None, :]
    return f.cos(), f.sin()


def rope_gptj(x, cos, sin, inverse=False):
    """GPT-J (interleaved) RoPE on the last 64 dims; cos/sin [N, 32] broadcast over the
    middle dims of x [N, ..., D] (fused_compress_quant_cache.py::_rope_quant_insert_kernel,
    fused_inv_rope_fp8_quant.py for the inverse)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    head, rot = x[..., :-ROPE_DIM], x[..., -ROPE_DIM:]
    e, o = rot[..., 0::2], rot[..., 1::2]
    r = torch.stack((e * c - o * s, o * c + e * s), dim=-1).flatten(-2)
    return torch.cat((head, r), dim=-1)


def qdq_kv_record(x):
    """The 584-B KV record round trip (--mimic-kv-fp8): bf16, then NoPE dims -> e4m3 with
    a UE8M0 scale per 64 (e = ceil(log2(max(amax, 1e-4) / 448))), RoPE dims bf16
    (fused_compress_quant_cache.py::_rope_quant_insert_kernel)."""
    x = x.to(torch.bfloat16).float()
    if x.numel() == 0:  # no compressed row yet (a V4 C128A layer under 128 tokens)
        return x
    nope, rot = x[..., :-ROPE_DIM], x[..., -ROPE_DIM:]
    b = nope.reshape(*nope.shape[:-1], -1, KV_QUANT_BLOCK)
    e = torch.ceil(torch.log2(b.abs().amax(-1, keepdim=True).clamp_min(1e-4) / E4M3_MAX))
    q = (b * torch.exp2(-e)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return torch.cat((((q * torch.exp2(e)).reshape(nope.shape)), rot), dim=-1)


def mhc_coeffs(residual, fn, scale, base, eps, iters):
    """pre [T, hc], post [T, hc], comb [T, hc, hc] of
    model_executor/kernels/mhc/torch.py::mhc_pre_delayed_torch (== mhc_pre_torch's)."""
    hc = residual.shape[1]
    x = residual.flatten(1)
    mixes = (x @ fn.t()) * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc]) * HC_POST_MULT
    comb = mixes[:, 2 * hc:].view(-1, hc, hc) * scale[2] + base[2 * hc:].view(1, hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_post(x, residual, post, comb):
    """model_executor/kernels/mhc/torch.py::mhc_post_torch."""
    return torch.einsum("tij,tih->tjh", comb, residual) + post[:, :, None] * x[:, None, :]


def hc_collapse(residual, pre):
    return (pre[:, :, None] * residual).sum(1)


def swiglu_clamp(g, u, limit):
    """activation.py::SiluAndMulWithClamp.forward_native."""
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return F.silu(g) * u


def route_sqrtsoftplus(logits, bias, top_k, scaling):
    """router/cpu_router.py::_sqrtsoftplus_bias_topk (dsv4_topk.py): weights
    sqrt(softplus), selection by weight + bias, renormalized, x routed_scaling_factor."""
    s = torch.sqrt(F.softplus(logits, threshold=20.0))
    ids = torch.topk(s + bias if bias is not None else s, top_k, dim=-1).indices
    w = s.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * scaling
    return w, ids


# --------------------------------------------------------------------------- engram
def engram_token_map(ckpt: Path, vocab: int):
    """common/engram.py::build_compressed_token_map over the checkpoint's tokenizer."""
    from tokenizers import Regex, Tokenizer, normalizers
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(), normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel), normalizers.Strip(),
        normalizers.Replace(sentinel, " ")])
    n = tok.get_vocab_size(with_added_tokens=True)
    key_to_new: dict[str, int] = {}
    lookup = [0] * n
    for tid in range(n):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(tid)
        else:
            normalized = norm.normalize_str(text)
            key = normalized if normalized else text
        lookup[tid] = key_to_new.setdefault(key, len(key_to_new))
    return torch.tensor(lookup, dtype=torch.int64), len(key_to_new)


def engram_layout(cfg: dict):
    """primes [layers, ngram-1, heads] (distinct, drawn in order above engram_vocab_size-1)
    and flat offsets [layers, cols] of common/engram.py::EngramLayout; multipliers
    [layers, max_ngram] of ::compute_hash_multipliers (numpy rng seeded 10007*layer_id)."""
    import numpy as np
    layers = list(cfg["engram_layer_ids"])
    n_max, heads = int(cfg["engram_max_ngram_size"]), int(cfg["engram_n_heads"])
    seen: set[int] = set()
    primes = []
    for _ in layers:
        per = []
        for _ in range(n_max - 1):
            sizes, cur = [], int(cfg["engram_vocab_size"]) - 1
            for _ in range(heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                sizes.append(cur)
            per.append(sizes)
        primes.append(per)
    primes_t = torch.tensor(primes, dtype=torch.int64)
    flat = primes_t.flatten(1)
    offsets = torch.cumsum(flat, 1) - flat
    bound = max(1, (np.iinfo(np.int64).max // int(cfg["engram_compressed_vocab_size"])) // 2)
    mult = []
    for lid in layers:
        g = np.random.default_rng(10007 * lid)
        v = g.integers(low=0, high=bound, size=(n_max,), dtype=np.int64)
        mult.append(torch.tensor(v * 2 + 1))
    return primes_t, offsets, torch.stack(mult)


def engram_hashes(tokens, token_map, pad_id, primes, offsets, mult, j):
    """[T, (n-1)*heads] bucket rows of engram layer index j for one whole sequence
    (common/engram.py::_hash_ids_kernel: rolling XOR of compressed id * multiplier over
    shifts 0..n-1, a position before 0 blocks the rest as pad_id; column
    (shift-1)*heads + h = rolling % prime + offset)."""
    T = tokens.shape[0]
    n_max, heads = mult.shape[1], primes.shape[2]
    src = token_map[tokens]
    pos = torch.arange(T)
    rolling = torch.zeros(T, dtype=torch.int64)
    blocked = torch.zeros(T, dtype=torch.bool)
    cols = []
    for shift in range(n_max):
        lb = pos - shift
        blocked |= lb < 0
        v = torch.where(blocked, torch.full_like(src, pad_id), src[lb.clamp_min(0)])
        rolling = rolling ^ (v * int(mult[j, shift]))
        if shift > 0:
            p = primes[j, shift - 1]                       # [heads]
            off = offsets[j, (shift - 1) * heads:(shift - 1) * heads + heads]
            cols.append(rolling[:, None] % p[None, :] + off[None, :])
    return torch.cat(cols, 1)


# --------------------------------------------------------------------------- the forward
class Reference:
    def __init__(self, model: Model, mimic_kv_fp8: bool = False):
        self.m, self.w, self.cfg = model, model.w, model.cfg
        self.v41 = model.kind == "deepseek_v41"
        c = self.cfg
        self.L = int(c["num_hidden_layers"])
        self.H = int(c["hidden_size"])
        self.hc = int(c["hc_mult"])
        self.nh = int(c["num_attention_heads"])
        self.hd = int(c["head_dim"])
        self.G = int(c["o_groups"])
        self.orank = int(c["o_lora_rank"])
        self.window = int(c["sliding_window"])
        self.topk = int(c["index_topk"])
        self.eps = float(c["rms_norm_eps"])
        self.hc_eps = float(c["hc_eps"])
        self.iters = int(c["hc_sinkhorn_iters"])
        self.ratios = [int(r) for r in c["compress_ratios"][:self.L]]
        self.mimic = mimic_kv_fp8
        self.dev = model.device
        if self.v41:
            self.kv_src = sorted(c.get("kv_source_layer_ids") or [])
            self.idx_src = sorted(c.get("index_source_layer_ids") or [])
            self.cand = int(c.get("candidate_source_layer_id", -1))
            self.cand_blocks = int(c.get("candidate_topk_blocks", 0))
            self.cand_bs = int(c.get("candidate_block_size", 0))
            self.engram_layers = list(c.get("engram_layer_ids") or [])
            if self.engram_layers:
                vocab = int(c["vocab_size"])
                self.token_map, cv = engram_token_map(model.dir, vocab)
                if cv != int(c["engram_compressed_vocab_size"]):
                    raise SystemExit(f"engram: tokenizer gives {cv} compressed ids, config "
                                     f"says {c['engram_compressed_vocab_size']}")
                self.pad_id = int(self.token_map[int(c.get("engram_pad_token_id", 0))])
                self.primes, self.offsets, self.mult = engram_layout(c)

    # ---------------------------------------------------------------- helpers
    def W(self, name):
        return self.w[name]

    def theta(self, i):
        r = self.ratios[i]
        compressed = r > 0 if self.v41 else r > 1   # common/rope.py (V4.1 vs V4)
        return float(self.cfg["compress_rope_theta"] if compressed else self.cfg["rope_theta"])

    def source(self, ids, i):
        below = [s for s in ids if s <= i]
        return max(below) if below else None

    def chunk(self, per_row: int, lo=16, hi=512):
        return int(max(lo, min(hi, MEM_ELEMS // max(per_row, 1))))

    # ---------------------------------------------------------------- compressors
    def v41_compress(self, i, x, T):
        """models/deepseek_v41/compressor.py::DeepseekCompressor.forward +
        fused_save_compress_norm: latent [Nc, 512] (normed, pre-RoPE)."""
        p = f"layers.{i}.attn.compressor."
        r = self.ratios[i]
        kv = x @ self.W(p + "wkv.weight").t()
        if r == 1:
            pooled = kv
        else:
            n = T // 2
            score = x[:2 * n] @ self.W(p + "wgate.weight").t()
            kv2 = kv[:2 * n].view(n, 2, -1)
            pooled = (kv2 * torch.softmax(score.view(n, 2, -1), dim=1)).sum(1)
        return rms_norm(pooled, self.W(p + "norm.weight"), self.eps)

    def v4_compress(self, prefix, x, ratio, d):
        """models/deepseek_v4 compressor (save_partial_states + the compress kernel):
        score += ape[pos % ratio]; ratio 4 overlaps the previous group's rows (dims
        [0, d)) with the closing group's rows (dims [d, 2d)); per-dim softmax pooling,
        RMSNorm. Returns the latent [Nc, d] (pre-RoPE)."""
        T = x.shape[0]
        n = T // ratio
        coff = 2 if ratio == 4 else 1
        kv = x[:n * ratio] @ self.W(prefix + "wkv.weight").t()
        sc = x[:n * ratio] @ self.W(prefix + "wgate.weight").t()
        sc = sc + self.W(prefix + "ape").repeat(n, 1)
        kv = kv.view(n, ratio, coff * d)
        sc = sc.view(n, ratio, coff * d)
        if coff == 2:
            prev_kv = torch.cat((torch.zeros_like(kv[:1, :, :d]), kv[:-1, :, :d]), 0)
            prev_sc = torch.cat((torch.full_like(sc[:1, :, :d], float("-inf")),
                                 sc[:-1, :, :d]), 0)
            kv = torch.cat((prev_kv, kv[:, :, d:]), 1)
            sc = torch.cat((prev_sc, sc[:, :, d:]), 1)
        pooled = (kv * torch.softmax(sc, dim=1)).sum(1)
        return rms_norm(pooled, self.W(prefix + "norm.weight"), self.eps)

    def rope_compressed(self, latent, ratio, theta):
        c = torch.arange(latent.shape[0], device=latent.device) * ratio
        cos, sin = rope_cos_sin(theta, c)
        return rope_gptj(latent, cos, sin)

    # ---------------------------------------------------------------- indexer
    def indexer_topk(self, prefix, x, qr, index_k, ratio, theta, T, cand_mode=None,
                     cand=None):
        """Top-k compressed indices [T, topk] (-1 padded) of one index source
        (attention.py::DeepseekV4Indexer.forward_q + sparse_attn_indexer.py prefill:
        logits, optional candidate blocks, top_k_per_row)."""
        nih, ihd = int(self.cfg["index_n_heads"]), int(self.cfg["index_head_dim"])
        wq = self.W(prefix + "wq_b.weight")
        wts = (x @ self.W(prefix + "weights_proj.weight").t()) * (ihd ** -0.5) * (nih ** -0.5)
        Nc = index_k.shape[0]
        pos = torch.arange(T, device=x.device)
        nvis = (pos + 1) // ratio
        out = torch.full((T, self.topk), -1, dtype=torch.int64, device=x.device)
        new_cand = None
        if cand_mode == "write":
            new_cand = torch.full((T, self.cand_blocks), -1, dtype=torch.int64,
                                  device=x.device)
        if Nc == 0:
            return out, new_cand
        cs = self.chunk(nih * Nc, lo=1, hi=256)
        cos, sin = rope_cos_sin(theta, pos)
        cols = torch.arange(Nc, device=x.device)
        for s in range(0, T, cs):
            e = min(T, s + cs)
            q = (qr[s:e] @ wq.t()).view(e - s, nih, ihd)
            q = rope_gptj(q, cos[s:e], sin[s:e])
            lg = torch.einsum("thd,nd->thn", q, index_k).relu_()
            lg = torch.einsum("thn,th->tn", lg, wts[s:e])
            valid = cols[None, :] < nvis[s:e, None]
            lg = lg.masked_fill(~valid, float("-inf"))
            if cand_mode is not None:
                bs = self.cand_bs
                nb = (Nc + bs - 1) // bs
                pad = nb * bs - Nc
                if cand_mode == "write":
                    blk = F.pad(lg, (0, pad), value=float("-inf")).view(e - s, nb, bs).amax(-1)
                    newest = ((nvis[s:e] - 1).clamp_min(0) // bs)
                    has = nvis[s:e] > 0
                    blk[has, newest[has]] = float("inf")
                    k = min(self.cand_blocks, nb)
                    v, ids = torch.topk(blk, k, dim=-1)
                    ids = torch.where(v > float("-inf"), ids, torch.full_like(ids, -1))
                    new_cand[s:e, :k] = ids
                else:
                    rows = cand[s:e]
                    keep = torch.zeros(e - s, nb + 1, dtype=torch.bool, device=x.device)
                    keep.scatter_(1, torch.where(rows >= 0, rows, torch.full_like(rows, nb)),
                                  True)
                    keep = keep[:, :nb].repeat_interleave(bs, 1)[:, :Nc]
                    lg = lg.masked_fill(~keep, float("-inf"))
            k = min(self.topk, Nc)
            v, ids = torch.topk(lg, k, dim=-1)
            out[s:e, :k] = torch.where(v > float("-inf"), ids, torch.full_like(ids, -1))
        return out, new_cand

    # ---------------------------------------------------------------- attention
    def sparse_attn(self, i, q_fn, kv_swa, comp_k, topk, ratio, T):
        """Sparse MLA with sink (FlashMLA sparse / the Ampere kernels' math): keys =
        values = 512-dim rows; SWA rows p-127..p plus the selected compressed rows
        (``topk`` [T, k] indices, -1 = none) or, when ``topk`` is None, every visible
        compressed row (C128A / short context). Returns o [T, nh, 512] (RoPE'd dims
        still rotated)."""
        sink = self.W(f"layers.{i}.attn.attn_sink")
        scale = self.hd ** -0.5
        W = self.window
        kcap = topk.shape[1] if topk is not None else (comp_k.shape[0] if comp_k is not None else 0)
        cs = self.chunk(max(kcap, 1) * self.hd + self.nh * (kcap + W + 512), lo=8, hi=256)
        out = torch.empty(T, self.nh, self.hd, device=kv_swa.device)
        pos = torch.arange(T, device=kv_swa.device)
        for s in range(0, T, cs):
            e = min(T, s + cs)
            q = q_fn(s, e)                                     # [c, nh, hd]
            ws = max(0, s - W + 1)
            kw = kv_swa[ws:e]                                  # [Lw, hd]
            sw = torch.einsum("chd,ld->chl", q, kw) * scale
            kp = torch.arange(ws, e, device=q.device)
            wmask = (kp[None, :] <= pos[s:e, None]) & (kp[None, :] > pos[s:e, None] - W)
            sw = sw.masked_fill(~wmask[:, None, :], float("-inf"))
            parts_s, parts_v = [sw], [("dense", kw)]
            if comp_k is not None and comp_k.shape[0] > 0:
                if topk is None:
                    sc = torch.einsum("chd,nd->chn", q, comp_k) * scale
                    nvis = (pos[s:e] + 1) // ratio
                    cm = torch.arange(comp_k.shape[0], device=q.device)[None, :] < nvis[:, None]
                    sc = sc.masked_fill(~cm[:, None, :], float("-inf"))
                    parts_s.append(sc)
                    parts_v.append(("dense", comp_k))
                else:
                    idx = topk[s:e]
                    g = comp_k[idx.clamp_min(0)]               # [c, k, hd]
                    sc = torch.einsum("chd,ckd->chk", q, g) * scale
                    sc = sc.masked_fill((idx < 0)[:, None, :], float("-inf"))
                    parts_s.append(sc)
                    parts_v.append(("gather", g))
            m = torch.stack([p.amax(-1) for p in parts_s], -1).amax(-1)
            m = torch.maximum(m, sink[None, :])                # [c, nh]
            den = torch.exp(sink[None, :] - m)
            acc = torch.zeros(e - s, self.nh, self.hd, device=q.device)
            for sc, (kind, v) in zip(parts_s, parts_v):
                pr = torch.exp(sc - m[:, :, None])
                den = den + pr.sum(-1)
                if kind == "dense":
                    acc += torch.einsum("chl,ld->chd", pr, v)
                else:
                    acc += torch.einsum("chk,ckd->chd", pr, v)
            out[s:e] = acc / den[:, :, None]
        return out

    def attention(self, i, x, ctx):
        p = f"layers.{i}.attn."
        T = x.shape[0]
        pos = torch.arange(T, device=x.device)
        theta = self.theta(i)
        cos, sin = rope_cos_sin(theta, pos)
        qr = rms_norm(x @ self.W(p + "wq_a.weight").t(), self.W(p + "q_norm.weight"), self.eps)
        kv = rms_norm(x @ self.W(p + "wkv.weight").t(), self.W(p + "kv_norm.weight"), self.eps)
        kv_r = rope_gptj(kv, cos, sin)
        if self.mimic:
            kv_r = qdq_kv_record(kv_r)
        wq_b = self.W(p + "wq_b.weight")
        v4 = not self.v41

        def q_fn(s, e):
            q = (qr[s:e] @ wq_b.t()).view(e - s, self.nh, self.hd)
            if v4:   # per-head weight-free RMSNorm (fused_qnorm_rope_kv_insert, V4 only)
                q = rms_norm(q, None, self.eps)
            return rope_gptj(q, cos[s:e], sin[s:e])

        ratio = self.ratios[i]
        comp_k, topk = None, None
        if self.v41 and ratio > 0:
            comp_k, topk = self.v41_compressed(i, x, qr, ctx, theta, T)
        elif v4 and ratio > 1:
            comp_k, topk = self.v4_compressed(i, x, qr, theta, T)
        o = self.sparse_attn(i, q_fn, kv_r, comp_k, topk, max(ratio, 1), T)
        o = rope_gptj(o, cos, sin, inverse=True)
        hpg = self.nh // self.G
        wo_a = self.W(p + "wo_a.weight").view(self.G, self.orank, hpg * self.hd)
        z = torch.einsum("tgd,grd->tgr", o.reshape(T, self.G, hpg * self.hd), wo_a)
        return z.reshape(T, -1) @ self.W(p + "wo_b.weight").t()

    def v41_compressed(self, i, x, qr, ctx, theta, T):
        ratio = self.ratios[i]
        ks = self.source(self.kv_src, i)
        js = self.source(self.idx_src, i)
        if i == ks:
            latent = self.v41_compress(i, x, T)
            ck = self.rope_compressed(latent, ratio, theta)
            if self.mimic:
                ck = qdq_kv_record(ck)
            ctx["comp"][i] = ck
            if f"layers.{i}.attn.indexer.wk.weight" in self.w:
                p = f"layers.{i}.attn.indexer."
                k = rms_norm(latent @ self.W(p + "wk.weight").t(), self.W(p + "k_norm.weight"),
                             self.eps)
                ctx["index_k"][i] = self.rope_compressed(k, ratio, theta)
        comp_k = ctx["comp"][ks]
        if comp_k.shape[0] <= self.topk:
            # Short context: every visible entry is selected and no candidate blocks
            # are published (attention.py::DeepseekV4Indexer.forward's
            # _fill_short_context_topk_indices path).
            return comp_k, None
        if i == js:
            mode = None
            if 0 <= self.cand == i:
                mode = "write"
            elif 0 <= self.cand < i:
                mode = "read"
            topk, new_cand = self.indexer_topk(
                f"layers.{i}.attn.indexer.", x, qr, ctx["index_k"][ks], ratio, theta, T,
                cand_mode=mode, cand=ctx.get("cand"))
            if new_cand is not None:
                ctx["cand"] = new_cand
            ctx["topk"][i] = topk
        return comp_k, ctx["topk"][js]

    def v4_compressed(self, i, x, qr, theta, T):
        ratio = self.ratios[i]
        p = f"layers.{i}.attn."
        latent = self.v4_compress(p + "compressor.", x, ratio, self.hd)
        ck = self.rope_compressed(latent, ratio, theta)
        if self.mimic:
            ck = qdq_kv_record(ck)
        topk = None
        if ratio == 4 and ck.shape[0] > self.topk:
            ihd = int(self.cfg["index_head_dim"])
            ik = self.v4_compress(p + "indexer.compressor.", x, ratio, ihd)
            ik = self.rope_compressed(ik, ratio, theta)
            topk, _ = self.indexer_topk(p + "indexer.", x, qr, ik, ratio, theta, T)
        return ck, topk

    # ---------------------------------------------------------------- MoE / engram
    def moe(self, i, x):
        p = f"layers.{i}.ffn."
        c = self.cfg
        E, k = int(c["n_routed_experts"]), int(c["num_experts_per_tok"])
        lim = c.get("swiglu_limit")
        bias = self.w.get(p + "gate.bias")
        w, ids = route_sqrtsoftplus(x @ self.W(p + "gate.weight").t(), bias, k,
                                    float(c.get("routed_scaling_factor", 1.0)))
        dense = torch.zeros(x.shape[0], E, device=x.device).scatter_(1, ids, w)
        out = torch.zeros_like(x)
        for e in range(E):
            rows = (dense[:, e] != 0).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            xe = x[rows]
            q = f"{p}experts.{e}."
            h = swiglu_clamp(xe @ self.W(q + "w1.weight").t(), xe @ self.W(q + "w3.weight").t(), lim)
            out.index_add_(0, rows, (h @ self.W(q + "w2.weight").t()) * dense[rows, e, None])
        if (p + "shared_experts.w1.weight") in self.w:
            q = p + "shared_experts."
            h = swiglu_clamp(x @ self.W(q + "w1.weight").t(), x @ self.W(q + "w3.weight").t(), lim)
            out = out + h @ self.W(q + "w2.weight").t()
        return out

    def engram(self, i, residual, tokens):
        """common/engram.py::Engram.forward + _fused_engram_post_wkv_kernel."""
        j = self.engram_layers.index(i)
        p = f"layers.{i}.engram."
        ids = engram_hashes(tokens.cpu(), self.token_map, self.pad_id, self.primes,
                            self.offsets, self.mult, j).to(residual.device)
        rows = self.W(p + "embed.weight")[ids]            # [T, cols, dim]
        kv = rows.flatten(1) @ self.W(p + "wkv.weight").t()   # [T, (hc+1)*H]
        H, hc = self.H, self.hc
        key = kv[:, :hc * H].view(-1, hc, H)
        val = kv[:, hc * H:]
        qw, kw = self.W(p + "q_weight"), self.W(p + "k_weight")
        hr = torch.rsqrt(residual.square().mean(-1) + self.eps)
        kr = torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (residual * qw[None] * kw[None] * key).sum(-1) * hr * kr * H ** -0.5
        g = torch.sqrt(dot.abs().clamp_min(ENGRAM_CLAMP))
        gate = torch.sigmoid(torch.where(dot < 0, -g, g))
        return residual + gate[:, :, None] * val[:, None, :]

    # ---------------------------------------------------------------- model
    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states [T, H] of one sequence (positions 0..T-1)."""
        tokens = tokens.to(self.dev)
        T = tokens.shape[0]
        emb = self.W("embed.weight")[tokens]
        residual = emb[:, None, :].expand(T, self.hc, self.H).contiguous()
        ctx = {"comp": {}, "index_k": {}, "topk": {}}
        eps, it = self.hc_eps, self.iters
        if self.v41:
            # nvidia/model.py::DeepseekV4DecoderLayer.forward (shifted/delayed mHC).
            pre_mix, pending = None, None
            for i in range(self.L):
                p = f"layers.{i}."
                if pending is not None:
                    residual = hc_post(pending[0], residual, pending[1], pending[2])
                if i in getattr(self, "engram_layers", []) and i > 0:
                    residual = self.engram(i, residual, tokens)
                pre, post, comb = mhc_coeffs(residual, self.W(p + "hc_attn_fn"),
                                             self.W(p + "hc_attn_scale"),
                                             self.W(p + "hc_attn_base"), eps, it)
                li = residual[:, 0] if pre_mix is None else hc_collapse(residual, pre_mix)
                x = self.attention(i, rms_norm(li, self.W(p + "attn_norm.weight"), self.eps), ctx)
                pre_mix = pre
                residual = hc_post(x, residual, post, comb)
                pre, post, comb = mhc_coeffs(residual, self.W(p + "hc_ffn_fn"),
                                             self.W(p + "hc_ffn_scale"),
                                             self.W(p + "hc_ffn_base"), eps, it)
                li = hc_collapse(residual, pre_mix)
                pre_mix = pre
                x = self.moe(i, rms_norm(li, self.W(p + "ffn_norm.weight"), self.eps))
                pending = (x, post, comb)
            residual = hc_post(pending[0], residual, pending[1], pending[2])
            h = hc_collapse(residual, pre_mix)
        else:
            # cpu/model.py::DeepseekV4DecoderLayer._forward_unfused_post_pre.
            for i in range(self.L):
                p = f"layers.{i}."
                for part, norm, fn in (("attn", "attn_norm", self.attention),
                                       ("ffn", "ffn_norm", None)):
                    pre, post, comb = mhc_coeffs(residual, self.W(f"{p}hc_{part}_fn"),
                                                 self.W(f"{p}hc_{part}_scale"),
                                                 self.W(f"{p}hc_{part}_base"), eps, it)
                    li = rms_norm(hc_collapse(residual, pre), self.W(f"{p}{norm}.weight"),
                                  self.eps)
                    x = self.attention(i, li, ctx) if fn else self.moe(i, li)
                    residual = hc_post(x, residual, post, comb)
            # hc_head: tilelang_kernels.py::hc_head_fuse_tilelang
            flat = residual.flatten(1)
            mixes = (flat @ self.W("hc_head_fn").t()) * torch.rsqrt(
                flat.square().mean(-1, keepdim=True) + self.eps)
            pre = torch.sigmoid(mixes * self.W("hc_head_scale")[0] + self.W("hc_head_base")) + eps
            h = hc_collapse(residual, pre)
        return rms_norm(h, self.W("norm.weight"), self.eps)

    def logprob_rows(self, tokens: torch.Tensor):
        """Per position i >= 1: [top1_token, top1_logprob, logprob(tokens[i])] of the
        distribution after tokens[:i] (run.py agree's prompt part)."""
        h = self.hidden(tokens)
        head = self.W("head.weight")
        tgt = tokens.to(self.dev)
        rows = []
        cs = self.chunk(head.shape[0], lo=1, hi=512)
        for s in range(0, h.shape[0] - 1, cs):
            e = min(h.shape[0] - 1, s + cs)
            lp = torch.log_softmax(h[s:e] @ head.t(), dim=-1)
            top_v, top_i = lp.max(-1)
            act = lp.gather(1, tgt[s + 1:e + 1, None]).squeeze(1)
            rows += [[int(a), float(b), float(c)] for a, b, c in
                     zip(top_i.tolist(), top_v.tolist(), act.tolist())]
        return rows


# --------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint dir (make_checkpoint.py)")
    ap.add_argument("--lens", type=int, nargs="*", default=None,
                    help="prompt lengths (default: run.py AGREE_LENS)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", type=int, nargs="*", default=None, metavar="I",
                    help="run only the prompts at these indices of --lens (the prompts are "
                    "still drawn for every length, so each equals run.py's; merge the "
                    "outputs in --lens order before compare.pair)")
    ap.add_argument("--mimic-kv-fp8", action="store_true",
                    help="round the KV cache rows as the 584-B fp8 record does")
    args = ap.parse_args(argv)
    e2e_run = e2e_run_module()
    AGREE_LENS, prompts = e2e_run.AGREE_LENS, e2e_run.prompts
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = Model(args.model, args.device)
    ref = Reference(model, mimic_kv_fp8=args.mimic_kv_fp8)
    load_s = time.perf_counter() - t0
    lens = args.lens if args.lens is not None else list(AGREE_LENS)
    vocab = int(model.cfg["vocab_size"])
    rows = []
    t_all = time.perf_counter()
    with torch.inference_mode():
        for n, p in enumerate(prompts(lens, vocab, args.seed)):
            if args.only is not None and n not in args.only:
                continue
            t = time.perf_counter()
            pr = ref.logprob_rows(torch.tensor(p, dtype=torch.int64))
            dt = time.perf_counter() - t
            rows.append(dict(prompt_len=len(p), prompt=pr, generated=[], seconds=dt))
            print(f"prompt {len(p)}: {dt:.1f}s", flush=True)
    result = dict(mode="fp32_reference_kvfp8" if args.mimic_kv_fp8 else "fp32_reference",
                  task="agree", model=str(args.model), model_config=model.raw,
                  load_seconds=load_s, seconds=time.perf_counter() - t_all,
                  device=args.device, threads=torch.get_num_threads(),
                  mimic_kv_fp8=args.mimic_kv_fp8, torch=torch.__version__, prompts=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"{result['mode']}: load {load_s:.1f}s, forward {result['seconds']:.1f}s -> "
          f"{args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
