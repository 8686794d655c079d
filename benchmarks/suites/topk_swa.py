"""topk_swa suite: ``combine_topk_swa_indices`` against upstream's combiner, -1 fill included.

Shapes (window 128): V4.1 ratios 1, 2 (top-k 512) and 0 (SWA only: top-k 0, as the V4.1
layers call it) for one request whose chunk of T = 1536, 8192 and 32768 query tokens follows
4096 tokens of context; ragged batches of 1, 4, 16 and 64 requests sharing T = 8192 tokens
(ratio 1); V4 ratios 4 (top-k 512) and 128 (top-k 8192) at T = 8192. ``--quick``: T = 1536 and
8192, batches of 4 and 64, no V4 rows.

Upstream, as the NVIDIA callers run it with their workspace: ``combined_indices.fill_(-1)``
then the kernel on grid (num_reqs, 256 workers) — V4.1 ``CombineTopkSwaIndicesKernel`` for
ratios 0-2, V4 ``CombineTopkSwaIndicesKernel`` (IMAGE_WIDTH 0) for 4 and 128; its time
includes the fill. Ours writes the same workspace with no fill. Top-k entries are valid
indices below N (the V4 CUDA kernel does not map invalid ones to -1), about 3% -1.

Times: ``ours_us``/``upstream_us`` are GPU times (``Harness.time_graph``: launches captured in a
CUDA graph); ``*_eager_us`` are eager ``do_bench`` times and ``*_host_us`` the CPU time per call
(upstream's includes its fill launch).

``bytes`` = what the operation must move: the valid top-k entries read (sum of topk_len * 4),
every output row written (width * 4) and the lengths (4 per token). ``exact``: indices and
lengths bit-identical to upstream's. Rows for variants ``sm80`` and ``sm90`` (same kernel and
tile today).
"""
from __future__ import annotations

import torch

from harness import Harness, bit_equal

import upstream_kernels.v4_cache_utils as up4
import upstream_kernels.v41_cache_utils as up41
from vllm.deepinfer.kernels import topk_swa as ts

WINDOW = 128
CONTEXT = 4096
UPSTREAM_WORKERS = 256  # _COMBINE_TOPK_SWA_NUM_WORKERS / CombineTopkSwaIndicesKernel.NUM_WORKERS


def _pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def _make(dev, gen, q_lens, ctx, topk_width, ratio):
    R = len(q_lens)
    T = sum(q_lens)
    seq = [c + q for c, q in zip(ctx, q_lens)]
    N = max(1, max(seq) // max(ratio, 1))
    tk = torch.randint(0, N, (T, topk_width), dtype=torch.int32, device=dev, generator=gen)
    tk[torch.rand(T, topk_width, device=dev, generator=gen) < 0.03] = -1
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    width = ts.combined_width(topk_width if ratio > 0 else 0, WINDOW)
    return {
        "tk": tk, "qsl": qsl, "seq": torch.tensor(seq, dtype=torch.int32, device=dev),
        "gl": torch.tensor(seq, dtype=torch.int32, device=dev), "N": N, "M": N + max(seq),
        "ws": (torch.empty(T, width, dtype=torch.int32, device=dev),
               torch.empty(T, dtype=torch.int32, device=dev)),
        "ws_up": (torch.empty(T, width, dtype=torch.int32, device=dev),
                  torch.empty(T, dtype=torch.int32, device=dev)),
        "R": R,
    }


def _upstream(x, ratio, topk):
    ci, cl = x["ws_up"]
    ci.fill_(-1)
    common = (ci, ci.stride(0), cl, x["tk"], x["tk"].stride(0), x["qsl"], x["seq"], x["gl"])
    grid = (x["R"], UPSTREAM_WORKERS)
    if ratio in (0, 1, 2):
        up41.CombineTopkSwaIndicesKernel_kernel[grid](
            *common, x["M"], x["N"], TOP_K=topk, COMPRESS_RATIO=ratio, WINDOW_SIZE=WINDOW,
            PADDED_TOP_K=_pow2(x["tk"].shape[-1]))
    else:
        up4.CombineTopkSwaIndicesKernel_kernel[grid](
            *common, x["tk"], x["tk"], x["M"], x["N"], TOP_K=topk, COMPRESS_RATIO=ratio,
            WINDOW_SIZE=WINDOW, IMAGE_WIDTH=0, PADDED_TOP_K=_pow2(x["tk"].shape[-1]))


def _ours(x, ratio, topk, variant):
    ts.combine_topk_swa_indices(x["tk"], x["qsl"], x["seq"], x["gl"], WINDOW, ratio, topk,
                                x["M"], x["N"], out=x["ws"], variant=variant)


def _bytes(q_lens, ctx, ratio, topk, width):
    n = 0
    for q, c in zip(q_lens, ctx):
        pos = torch.arange(c, c + q)
        if ratio > 0:
            n += int(torch.clamp((pos + 1) // ratio, max=topk).sum()) * 4
        n += q * (width * 4 + 4)
    return n


def _cases(quick):
    """(shape, query lens, context lens, ratio, top-k width) per row."""
    Ts = [1536, 8192] if quick else [1536, 8192, 32768]
    batches = [4, 64] if quick else [1, 4, 16, 64]
    cases = []
    for T in Ts:
        for ratio in (1, 2, 0):
            cases.append(({"T": T, "reqs": 1, "ratio": ratio, "topk": 512}, [T], [CONTEXT], ratio, 512))
    gen = torch.Generator().manual_seed(0)
    for R in batches:
        cuts = sorted(torch.randint(0, 8192, (R - 1,), generator=gen).tolist())
        q_lens = [b - a for a, b in zip([0] + cuts, cuts + [8192])]
        ctx = torch.randint(0, 16384, (R,), generator=gen).tolist()
        cases.append(({"T": 8192, "reqs": R, "ratio": 1, "topk": 512, "ragged": True}, q_lens, ctx, 1, 512))
    if not quick:
        cases.append(({"T": 8192, "reqs": 1, "ratio": 4, "topk": 512}, [8192], [CONTEXT], 4, 512))
        cases.append(({"T": 8192, "reqs": 1, "ratio": 128, "topk": 8192}, [8192], [1 << 20], 128, 8192))
    return cases


def run(h: Harness) -> None:
    dev = h.dev
    gen = torch.Generator(device=dev)
    for shape, q_lens, ctx, ratio, topk_width in _cases(h.quick):
        topk = topk_width if ratio > 0 else 0  # what the layers pass
        width = ts.combined_width(topk, WINDOW)
        nbytes = _bytes(q_lens, ctx, ratio, topk, width)
        gen.manual_seed(sum(q_lens) + ratio)
        per_copy = sum(q_lens) * (topk_width + 2 * width) * 4
        inputs = h.copies(lambda: _make(dev, gen, q_lens, ctx, topk_width, ratio), per_copy)
        up_t = h.timings(lambda x: _upstream(x, ratio, topk), inputs)
        x = inputs[0]
        _upstream(x, ratio, topk)
        for variant in ("sm80", "sm90"):
            t = h.timings(lambda x: _ours(x, ratio, topk, variant), inputs)
            x["ws"][0].fill_(7)
            x["ws"][1].fill_(7)
            _ours(x, ratio, topk, variant)
            exact = bit_equal(x["ws"][0], x["ws_up"][0]) and bit_equal(x["ws"][1], x["ws_up"][1])
            h.add("topk_swa", variant, shape, t["gpu"], up_t["gpu"], bytes=nbytes, exact=exact,
                  width=width, **h.launch_fields(t, up_t))
        del inputs, x
