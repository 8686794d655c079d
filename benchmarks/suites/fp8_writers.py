"""fp8-free writers vs the upstream vLLM 0.33.0 fp8 writers, at DeepSeek-V4.1 shapes.

For each writer (vllm.deepinfer.kernels.fp8_writers_v41 / _v4) the upstream kernel and
our sm80 variant (software e4m3 cast, the Ampere code) and sm90 variant (hardware cast)
run on the same inputs; the outputs (cache bytes, fp8 values, scales, weights) are
compared byte for byte against upstream, and each is timed over an input ring larger than
twice the L2 (``ours_us``/``upstream_us``: GPU time, launches captured in a CUDA graph;
``*_eager_us``/``*_host_us``: eager time and CPU time per call). All are memory-bound: ``bytes`` counts what a launch must read and write.
Shapes: hidden 5120, 64 heads of 512 (448 NoPE + 64 RoPE), 8 o groups, 128-token cache
pages, indexer heads of 128 (64 heads for the Q side); prefill-sized and decode-sized
token counts.
"""
from __future__ import annotations

import importlib

import torch

from harness import Harness, bit_equal
from vllm.deepinfer import kv_record as rec
from vllm.deepinfer.kernels import fp8_writers_v4 as v4
from vllm.deepinfer.kernels import fp8_writers_v41 as v41

OURS = ("sm80", "sm90")
PAGE = 128          # compressed/indexer cache block size off SM90 (tokens per page)
MAX_POS = 65536     # cos_sin_cache rows
HEADS, GROUPS = 64, 8
INDEX_HEADS, INDEX_DIM = 64, 128


def _up(name: str):
    return importlib.import_module(f"upstream_kernels.{name}")


def _cos_sin(dev) -> torch.Tensor:
    ang = torch.rand(MAX_POS, 32, device=dev) * 6.3
    return torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()


def _row(h: Harness, kernel: str, shape: dict, nbytes: int, inputs: list, launches: dict,
         outputs) -> None:
    """Time upstream and our variants on ``inputs``; compare ``outputs(x, who)`` bytes."""
    ref = outputs(inputs[0], "upstream")
    up_t = h.timings(lambda x: launches["upstream"](x), inputs)
    for v in OURS:
        got = outputs(inputs[0], v)
        exact = all(bit_equal(a, b) for a, b in zip(got, ref))
        t = h.timings(lambda x, v=v: launches[v](x), inputs)
        h.add(kernel, v, shape, t["gpu"], up_t["gpu"], bytes=nbytes, exact=exact,
              **h.launch_fields(t, up_t))


# ----------------------------------------------------------------- V4.1 compressed insert
def _rope_quant_insert(h: Harness, tokens: int, ratio: int, cs: torch.Tensor) -> None:
    dev, up = h.dev, _up("v41_fused_compress")
    blocks = -(-tokens // (ratio * PAGE)) + 1

    def make():
        positions = torch.arange(tokens, device=dev, dtype=torch.int64)
        slots = torch.where((positions + 1) % ratio == 0, positions // ratio, -1)
        return dict(latent=torch.randn(tokens, 512, device=dev).to(torch.bfloat16),
                    positions=positions, slots=slots,
                    cache=torch.zeros(blocks, PAGE, rec.RECORD_BYTES, dtype=torch.uint8, device=dev))

    def upstream(x):
        c = x["cache"]
        up._rope_quant_insert_kernel[(tokens,)](
            x["latent"], x["positions"], cs, c, x["slots"], COS_STRIDE=cs.stride(0),
            CACHE_STRIDE=c.stride(0), CACHE_BLOCK=c.shape[1], COMPRESS_RATIO=ratio,
            SANITIZE_CACHE_NANS=False, num_warps=4)

    launches = {"upstream": upstream}
    for v in OURS:
        launches[v] = lambda x, v=v: v41.rope_quant_insert(
            x["latent"], x["positions"], cs, x["cache"], x["slots"], ratio, variant=v)

    def outputs(x, who):
        x["cache"].zero_()
        launches[who](x)
        return [x["cache"].clone()]

    written = tokens // ratio
    nbytes = written * (512 * 2 + rec.RECORD_BYTES + 64 * 4) + tokens * 16
    inputs = h.copies(make, tokens * (1024 + 16) + blocks * PAGE * rec.RECORD_BYTES)
    _row(h, "v41_rope_quant_insert", {"tokens": tokens, "ratio": ratio}, nbytes, inputs,
         launches, outputs)


# ----------------------------------------------------------------- V4.1 indexer K store
def _indexer_k_store(h: Harness, tokens: int, ratio: int, cs: torch.Tensor) -> None:
    dev, up = h.dev, _up("v41_indexer_k_store")
    blocks = -(-tokens // (ratio * PAGE)) + 1
    row = INDEX_DIM + 4
    weight = (1 + 0.1 * torch.randn(INDEX_DIM, device=dev)).to(torch.bfloat16)
    eps = 1e-6

    def make():
        positions = torch.arange(tokens, device=dev, dtype=torch.int64)
        slots = torch.where((positions + 1) % ratio == 0, positions // ratio, -1)
        return dict(k=torch.randn(tokens, INDEX_DIM, device=dev).to(torch.bfloat16),
                    positions=positions, slots=slots,
                    cache=torch.zeros(blocks, PAGE, row, dtype=torch.uint8, device=dev))

    def upstream(x):
        c, k = x["cache"], x["k"]
        up._indexer_k_norm_rope_quant_store_kernel[(tokens,)](
            k, k.stride(0), x["positions"], weight, eps, cs, cs.stride(0), c, x["slots"],
            c.shape[1], HEAD_SIZE=INDEX_DIM, ROPE_HEAD_DIM=64, COMPRESS_RATIO=ratio,
            TOKEN_STRIDE=INDEX_DIM, SCALE_DIM=4, KV_BLOCK_STRIDE=c.stride(0), FP8_MAX=448.0,
            USE_FP4=False, MX_SCALE=False, SHUFFLE=False, BLOCK_TILE_SIZE=16, HEAD_TILE_SIZE=16,
            num_warps=1)

    launches = {"upstream": upstream}
    for v in OURS:
        launches[v] = lambda x, v=v: v41.indexer_k_norm_rope_store(
            x["k"], x["positions"], cs, weight, eps, x["cache"], x["slots"], ratio, False, variant=v)

    def outputs(x, who):
        x["cache"].zero_()
        launches[who](x)
        return [x["cache"].clone()]

    written = tokens // ratio
    nbytes = written * (INDEX_DIM * 2 + row + 64 * 4) + tokens * 16
    inputs = h.copies(make, tokens * (INDEX_DIM * 2 + 16) + blocks * PAGE * row)
    _row(h, "v41_indexer_k_store", {"tokens": tokens, "ratio": ratio}, nbytes, inputs,
         launches, outputs)


# ----------------------------------------------------------------- V4 inverse RoPE + quant
def _inv_rope(h: Harness, tokens: int, cs: torch.Tensor) -> None:
    dev, up = h.dev, _up("v4_inv_rope_fp8")
    hpg, d = HEADS // GROUPS, HEADS // GROUPS * 512
    blocks, padded = d // 128, -(-tokens // 4) * 4

    def make():
        return dict(o=torch.randn(tokens, HEADS, 512, device=dev).to(torch.bfloat16),
                    positions=torch.randint(0, MAX_POS, (tokens,), device=dev))

    def upstream_bufs(x):
        out = torch.empty(GROUPS, tokens, d, dtype=torch.float8_e4m3fn, device=dev)
        sc = torch.empty(GROUPS * blocks * padded, device=dev).as_strided(
            (GROUPS, tokens, blocks), (blocks * padded, 1, padded))
        o = x["o"]
        up.FusedInvRopeFP8QuantKernel_kernel[(padded, HEADS)](
            o, x["positions"], cs, out, sc, tokens, heads_per_group=hpg,
            o_stride_token=o.stride(0), o_stride_head=o.stride(1), cache_stride_pos=cs.stride(0),
            out_stride_group=out.stride(0), out_stride_token=out.stride(1),
            scale_stride_group=sc.stride(0), scale_stride_k=sc.stride(2), fp8_max=448.0, eps=1e-10,
            QUANT_GROUP_SIZE=128, CHUNKS_PER_HEAD=4, NOPE_DIM=448, HALF_ROPE=32, QUANTIZE=True,
            TMA_ALIGNED_SCALES=False, launch_pdl=False, num_stages=1, num_warps=1)
        return out.transpose(0, 1), sc.transpose(0, 1)

    launches = {"upstream": upstream_bufs}
    for v in OURS:
        launches[v] = lambda x, v=v: v4.fused_inv_rope_fp8_quant(
            x["o"], x["positions"], cs, GROUPS, hpg, variant=v)

    def outputs(x, who):
        out, sc = launches[who](x)
        return [out, sc]

    nbytes = tokens * HEADS * 512 * (2 + 1) + tokens * GROUPS * blocks * 4 + tokens * 8
    inputs = h.copies(make, tokens * HEADS * 512 * 2)
    _row(h, "v4_inv_rope_fp8_quant", {"tokens": tokens, "heads": HEADS, "groups": GROUPS},
         nbytes, inputs, launches, outputs)


# ----------------------------------------------------------------- V4 indexer Q
def _indexer_q(h: Harness, tokens: int, cs: torch.Tensor) -> None:
    dev, up = h.dev, _up("v4_fused_indexer_q")
    sm_scale, head_scale = INDEX_DIM ** -0.5, INDEX_HEADS ** -0.5

    def make():
        return dict(q=torch.randn(tokens, INDEX_HEADS, INDEX_DIM, device=dev).to(torch.bfloat16),
                    w=torch.randn(tokens, INDEX_HEADS, device=dev).to(torch.bfloat16),
                    positions=torch.randint(0, MAX_POS, (tokens,), device=dev))

    def upstream(x):
        q, w = x["q"], x["w"]
        q8 = torch.empty_like(q, dtype=torch.float8_e4m3fn)
        wo = torch.empty_like(w, dtype=torch.float32)
        up.FusedIndexerQRopeQuantTritonKernel_kernel[(tokens, INDEX_HEADS)](
            x["positions"], q, q.stride(0), q.stride(1), cs, cs.stride(0), 32, q8, q8.stride(0),
            q8.stride(1), INDEX_DIM, w, w.stride(0), sm_scale, head_scale, wo, wo.stride(0),
            FP8_MAX=448.0, USE_FNUZ=False, USE_EXPLICIT_FMA=False, num_warps=1)
        return q8, wo

    launches = {"upstream": upstream}
    for v in OURS:
        launches[v] = lambda x, v=v: v4.fused_indexer_q_rope_quant(
            x["positions"], x["q"], cs, x["w"], sm_scale, head_scale, variant=v)

    def outputs(x, who):
        return list(launches[who](x))

    nbytes = tokens * INDEX_HEADS * (INDEX_DIM * 3 + 2 + 4) + tokens * (8 + 256)
    inputs = h.copies(make, tokens * INDEX_HEADS * (INDEX_DIM + 1) * 2)
    _row(h, "v4_indexer_q_rope_quant", {"tokens": tokens, "heads": INDEX_HEADS}, nbytes, inputs,
         launches, outputs)


def run(h: Harness) -> None:
    torch.manual_seed(0)
    cs = _cos_sin(h.dev)
    prefill = 4096 if h.quick else 16384
    for tokens in (64, prefill):  # a decode batch, a prefill chunk
        for ratio in (1, 2):
            _rope_quant_insert(h, tokens, ratio, cs)
            _indexer_k_store(h, tokens, ratio, cs)
        _indexer_q(h, tokens, cs)
    # The attention output is 64 KiB per token (64 heads x 512 bf16): a quarter of the
    # prefill chunk already makes one 256 MiB input copy.
    for tokens in (64, prefill // 4):
        _inv_rope(h, tokens, cs)
