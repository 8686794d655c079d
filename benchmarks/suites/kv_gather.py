"""kv_gather suite: ``dequantize_and_gather_k_cache`` (584-byte records) against upstream's
``_dequantize_and_gather_k_kernel``.

Shapes (pages of 64 tokens, scattered by a random block table): one request gathering 16K,
48K, 128K and 1M tokens; ragged batches of 1, 4, 16 and 64 requests (per-request gather
lengths drawn from 1K..16K, seq_len up to 1K longer, so ``gather_len < seq_len``).
``--quick``: 16K and 128K, batches of 4 and 64.

Upstream is launched as ``dequantize_and_gather_k_cache_triton`` does on CUDA: grid
(num_reqs, gather_num_workers(max_gather_len)) with the caller's ``max_gather_len`` (its best
grid; the NVIDIA V4.1 caller passes none and gets 128 workers — that time is the extra field
``upstream_128w_us``). Ours gets the same ``max_gather_len``.

Times: ``ours_us``/``upstream_us`` (and ``upstream_128w_us``) are GPU times
(``Harness.time_graph``); ``*_eager_us`` eager ``do_bench`` times, ``*_host_us`` CPU time per call.

Rows: variant ``sm80`` (the Ampere tile and decoder), ``sm90`` (hardware e4m3), and the
other exact software decoders in the Ampere tile as ``sm80-int`` / ``sm80-e4b15`` (which
decoder the Ampere row should use). ``bytes`` = 584 read + 1024 written per gathered token.
``exact``: bf16 output bit-identical to upstream's (whole buffer, zeros outside the rows).
Data: random e4m3 codes (NaN codes replaced), scale bytes 110..135, random finite RoPE.
"""
from __future__ import annotations

import dataclasses

import torch

from harness import Harness, bit_equal

import upstream_kernels.v41_cache_utils as up
from vllm.deepinfer import kv_record as kr
from vllm.deepinfer.kernels import kv_gather as kg

BLOCK = 64  # tokens per page (upstream's default cache block for the gather)
RECORD = kr.RECORD_BYTES
BYTES_PER_TOKEN = RECORD + kr.HEAD_DIM * 2  # a record read, a bf16 row written


def _upstream_workers(max_gather_len):
    # vllm/models/deepseek_v41/common/ops/cache_utils.py gather_num_workers
    if max_gather_len is None:
        return 128
    return max(128, min(8192, -(-max_gather_len // 8)))


def _upstream(x, max_gather_len):
    out = x["out_up"]
    up._dequantize_and_gather_k_kernel[(x["seq"].shape[0], _upstream_workers(max_gather_len))](
        out, out.stride(0), out.stride(1), x["cache"], x["seq"], x["bt"], 0, x["gl"],
        max_blocks_per_seq=x["bt"].shape[-1], fp8_dim=kr.NOPE_DIM, bf16_dim=kr.ROPE_DIM,
        scale_dim=kr.SCALE_BYTES, quant_block=kr.QUANT_BLOCK, cache_block_size=BLOCK,
        token_data_size=kr.DATA_BYTES, block_stride=x["cache"].stride(0), output_dim=kr.HEAD_DIM,
        fp8_max=kr.FP8_MAX, n_quant_blocks=kr.NUM_SCALES, use_fnuz=False)


def _make(dev, gather_lens, seq_lens, gen):
    R = len(seq_lens)
    max_blocks = -(-max(seq_lens) // BLOCK)
    nb = sum(-(-s // BLOCK) for s in seq_lens) + 1
    cache = torch.randint(0, 256, (nb, BLOCK, RECORD), dtype=torch.uint8, device=dev,
                          generator=gen)
    data, sc = kr.record_views(cache)
    nope = data[..., :kr.NOPE_DIM]
    nope[(nope & 0x7F) == 0x7F] = 0x7E  # no NaN codes in real caches
    rope = torch.randn(nb, BLOCK, kr.ROPE_DIM, device=dev, generator=gen).to(torch.bfloat16)
    data[..., kr.NOPE_DIM:] = rope.view(torch.uint8)
    sc[..., :kr.NUM_SCALES] = torch.randint(110, 136, (nb, BLOCK, kr.NUM_SCALES),
                                            dtype=torch.uint8, device=dev, generator=gen)
    sc[..., kr.NUM_SCALES:] = 0
    perm = torch.randperm(nb, device=dev, generator=gen).to(torch.int32)
    bt = torch.zeros(R, max_blocks, dtype=torch.int32, device=dev)
    used = 0
    for r, s in enumerate(seq_lens):
        n = -(-s // BLOCK)
        bt[r, :n] = perm[used:used + n]
        used += n
    max_gl = max(gather_lens)
    return {
        "cache": cache, "bt": bt,
        "seq": torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        "gl": torch.tensor(gather_lens, dtype=torch.int32, device=dev),
        "out": torch.zeros(R, max_gl, kr.HEAD_DIM, dtype=torch.bfloat16, device=dev),
        "out_up": torch.zeros(R, max_gl, kr.HEAD_DIM, dtype=torch.bfloat16, device=dev),
    }


def _ours(x, variant, max_gather_len):
    kg.dequantize_and_gather_k_cache(x["out"], x["cache"], x["seq"], x["gl"], x["bt"], BLOCK, 0,
                                     max_gather_len=max_gather_len, variant=variant)


def _cases(quick):
    """(shape, gather_lens, seq_lens) per row group."""
    singles = [16 << 10, 128 << 10] if quick else [16 << 10, 48 << 10, 128 << 10, 1 << 20]
    batches = [4, 64] if quick else [1, 4, 16, 64]
    cases = [({"reqs": 1, "tokens": n}, [n], [n]) for n in singles]
    gen = torch.Generator().manual_seed(0)
    for R in batches:
        gl = torch.randint(1 << 10, 16 << 10, (R,), generator=gen).tolist()
        extra = torch.randint(0, 1 << 10, (R,), generator=gen).tolist()
        cases.append(({"reqs": R, "tokens": sum(gl), "ragged": True}, gl,
                      [g + e for g, e in zip(gl, extra)]))
    return cases


def run(h: Harness) -> None:
    dev = h.dev
    gen = torch.Generator(device=dev)
    # The other exact Ampere decoders, in the Ampere tile, under their own names.
    extra_rows = {f"sm80-{d}": dataclasses.replace(kg.TILES["sm80"], decode=d)
                  for d in ("int", "e4b15") if d != kg.TILES["sm80"].decode}
    kg.TILES.update(extra_rows)
    try:
        for shape, gls, seqs in _cases(h.quick):
            tokens = sum(gls)
            max_gl = max(gls)
            gen.manual_seed(tokens)
            inputs = h.copies(lambda: _make(dev, gls, seqs, gen), tokens * BYTES_PER_TOKEN * 2)
            up_t = h.timings(lambda x: _upstream(x, max_gl), inputs)
            up128_us = h.time_graph(lambda x: _upstream(x, None), inputs)
            x = inputs[0]
            x["out_up"].zero_()
            _upstream(x, max_gl)
            for variant in ["sm80", "sm90", *extra_rows]:
                t = h.timings(lambda x: _ours(x, variant, max_gl), inputs)
                x["out"].zero_()
                _ours(x, variant, max_gl)
                h.add("kv_gather", variant, shape, t["gpu"], up_t["gpu"],
                      bytes=tokens * BYTES_PER_TOKEN, exact=bit_equal(x["out"], x["out_up"]),
                      upstream_128w_us=round(up128_us, 3),
                      tile=dataclasses.asdict(kg.TILES[variant]), **h.launch_fields(t, up_t))
            del inputs, x
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        for k in extra_rows:
            kg.TILES.pop(k, None)
