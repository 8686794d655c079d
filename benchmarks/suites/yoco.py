"""yoco suite: the attention of DeepSeek-V4.1's 40 layers (upstream's KV/index-source layout)
for one step, cross-layer metadata reuse (vllm.deepinfer.yoco) off and on.

benchmarks/yoco_stack.py builds the stack (real V4.1 sizes: 64 heads x 512, window 128, top-k
512; SWA pages of 32; compressed pages of 128 for the sm80 rows, 64 for the sm90 rows, as vLLM
allocates them on those GPUs) and runs what the Ampere classes run per layer: decode (ragged
SWA lists, global top-k + its ragged form, our decode) or a prefill chunk (the indexer's K
gather on index sources, our compressed + SWA gathers and combiner, upstream's bf16 prefill and
inverse RoPE). Off: every layer builds its metadata (upstream's behaviour); on: once per group.

Cases: decode at batch 1, 16 and 64 with 8192 cached tokens per request; one prefill chunk of
2048 new tokens at 8K and 32K total context. ``--quick``: decode batch 1 and 16 at 4096, the
8K prefill. Variants ``sm80`` (our software-e4m3 kernels: what an A100 runs, here on Hopper)
and ``sm90``.

Rows: kernel ``yoco``, shape {phase, batch, ctx, q_len, layers}. ``launches_off`` /
``launches_on``: CUDA kernels of one step (torch.profiler, memsets/copies excluded; the
publication copies of the index sources' top-k, the same in both modes, included);
``triton_launches_off/on`` the Triton ones among them; ``us_off`` / ``us_on``: eager step
time (do_bench median: host launch cost included, as when the attention runs in vLLM's eager
breaks); for decode also ``graph_us_off/on`` (the step captured in one CUDA graph: GPU time
only, as under FULL CUDA graphs). ``ours_us`` = us_on, ``upstream_us`` = us_off.
``identical``: every layer's output has the same bytes in both modes. ``builds`` / ``hits``:
the yoco cache's per product kind. All times are H200 measurements, ``sm80`` rows included:
not A100 numbers.
"""
from __future__ import annotations

import gc

import torch
import triton

import one_layer as ol
import yoco_stack as ys
from harness import Harness

VARIANTS = ("sm80", "sm90")
LAYERS = len(ys.LAYOUT.ratios)


def cases(quick: bool) -> list[tuple[str, tuple, tuple]]:
    dec_ctx = 4096 if quick else 8192
    out = [("decode", (dec_ctx,) * b, (1,) * b) for b in ((1, 16) if quick else (1, 16, 64))]
    for total in ((8192,) if quick else (8192, 32768)):
        out.append(("prefill", (total - 2048,), (2048,)))
    return out


def count_launches(fn) -> tuple[int, int]:
    """(CUDA kernels, Triton kernels) one call of ``fn`` launches."""
    from torch.profiler import ProfilerActivity, profile
    n_triton = [0]
    old = triton.knobs.runtime.launch_enter_hook

    def hook(*a, **k):
        n_triton[0] += 1
    triton.knobs.runtime.launch_enter_hook = hook
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.launch_enter_hook = old
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset", "[memory]"))]
    return len(kernels), n_triton[0]


def run_case(h: Harness, variant: str, phase: str, ctx: tuple, q_lens: tuple) -> None:
    spec = ol.Spec(comp_page=64 if variant == "sm90" else 128)
    st = ys.Stack(spec, ctx, q_lens, h.dev, variant)
    st.step(False, keep=True)
    off_out = [o.clone() for o in st.outs]
    fc = st.step(True, keep=True)
    identical = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                    for a, b in zip(off_out, st.outs))
    cache = fc._deepinfer_yoco
    del off_out
    st.outs = [None] * LAYERS
    launches = {m: count_launches(lambda m=m: st.step(m)) for m in (False, True)}
    us = {m: h.time_ring(lambda _, m=m: st.step(m), [None]) for m in (False, True)}
    extra = {}
    if phase == "decode":
        for m in (False, True):
            extra[f"graph_us_{'on' if m else 'off'}"] = round(
                h.time_graph(lambda _, m=m: st.step(m), [None]), 3)
    shape = dict(phase=phase, batch=len(ctx), ctx=ctx[0] + q_lens[0], q_len=q_lens[0],
                 layers=LAYERS)
    h.add("yoco", variant, shape, us[True], us[False],
          launches_off=launches[False][0], launches_on=launches[True][0],
          triton_launches_off=launches[False][1], triton_launches_on=launches[True][1],
          us_off=round(us[False], 3), us_on=round(us[True], 3), identical=identical,
          builds=dict(cache.builds), hits=dict(cache.hits), **extra)
    del st
    gc.collect()
    torch.cuda.empty_cache()


def run(h: Harness) -> None:
    for variant in VARIANTS:
        for phase, ctx, q_lens in cases(h.quick):
            run_case(h, variant, phase, ctx, q_lens)
