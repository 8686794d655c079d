"""one_layer suite: one DeepSeek-V4.1 attention layer through the Ampere path, per stage.

benchmarks/one_layer.py builds the layer (random weights and inputs, real V4.1 sizes: 64 heads x
512, window 128, top-k 512, 64 x 128 indexer, o_proj 8 groups x 1024 -> 5120; SWA pages of 32,
compressed/index pages of 128 as on SM80), runs every stage once, checks each against the
plain-torch reference (tolerances in that module's docstring), then times each stage.

Cases: ratios 0, 1, 2; a decode step (64 requests, 8192 cached tokens each, one new token) and
a prefill chunk (1 request, 2048 new tokens after 6144 cached). ``--quick``: decode 16 x 4096
and prefill 1024 after 3072. Variants: ``sm80`` (software e4m3: what an A100 runs; here on
Hopper) and ``sm90``, passed to every kernel that takes ``variant=``; upstream kernels and the
torch stand-ins are the same code in both. Prefill chunks run twice per variant: with
upstream's bf16 prefill kernel in the ``prefill_attn`` stage (``prefill_impl`` "upstream", the
sparse_mla_prefill feature off: its default from 9.0) and with ours (``prefill_impl`` "ours",
its default on sm80/sm86); decode steps once.

Rows: kernel ``one_layer``, one per stage plus ``stage="total"``. ``ours_us``: GPU time of the
stage (``Harness.time_graph`` with one input set: the stage captured in a CUDA graph, replays
timed by do_bench, which flushes L2 before each replay; the graph replay overhead, a few us, is
included). ``upstream_us`` is null: this is the path, not a comparison. Extra fields:
``stage``; ``impl`` (ours / upstream / stand-in / reference); ``prefill_impl`` (whose prefill
kernel the path ran); ``ok`` (the stage's tolerance
held); ``tol``; ``exact`` where bytes are compared; ``max_abs_diff``; stage-specific errors
(``mismatch_bytes``, ``rel_frob``, ``sym_diff``, ``max_excess``). The total row:
``ours_us`` = sum of the stage times, ``step_graph_us`` = the whole step captured in one graph,
``ok`` = every stage ok, ``final_rel_frob`` / ``final_max_abs_diff`` = the layer output against
the fp32 chain from the reference attention.
All times are H200 (SM90) measurements, ``sm80`` rows included: not A100 numbers.
"""
from __future__ import annotations

import gc

import torch

import one_layer as ol
from harness import Harness

VARIANTS = ("sm80", "sm90")
IMPL = {"swa_insert": "ours", "compress_insert": "ours", "indexer_k_store": "ours",
        "indexer_q_quant": "ours", "indexer_k_gather": "stand-in", "indexer_logits": "ours", "indexer_topk": "stand-in",
        "decode_indices": "stand-in", "decode_attn": "ours", "kv_gather": "ours",
        "combine": "ours", "prefill_attn": "upstream", "inv_rope": "upstream", "o_proj": "torch"}


def cases(quick: bool) -> list:
    if quick:
        dec, pre = (16, 4096), (3072, 1024)
    else:
        dec, pre = (64, 8192), (6144, 2048)
    out = []
    for r in (0, 1, 2):
        out.append(ol.Step(r, (dec[1],) * dec[0], (1,) * dec[0]))
        out.append(ol.Step(r, (pre[0],), (pre[1],)))
    return out


def _time(h, fn) -> float:
    return h.time_graph(lambda _: fn(), [None])


def run_case(h, spec: ol.Spec, step: ol.Step, variants=VARIANTS, seed: int = 0,
             prefill_impls=ol.PREFILL_IMPLS) -> None:
    L = ol.Layer(spec, step, h.dev, seed)
    ref = ol.reference_caches(L)
    flops = ol.step_flops(L)
    shape = step.shape()
    impls = ("upstream",) if step.decode else prefill_impls
    for v, impl in [(v, i) for v in variants for i in impls]:
        L.fill_context(v)
        path = ol.AmperePath(L, v, impl)
        path.run_for_check()
        if L.dev.type == "cuda":
            torch.cuda.synchronize()
        res = ol.check(path, ref)
        total = 0.0
        all_ok = True
        for name, fn in path.stages:
            c = dict(res.get(name, {}))
            us = _time(h, fn)
            total += us or 0.0
            ok = c.pop("ok", None)
            all_ok = all_ok and (ok is not False)
            exact = c.pop("exact", None)
            mad = c.pop("max_abs_diff", None)
            h.add("one_layer", v, shape, us, None, exact=exact, max_abs_diff=mad,
                  flops=flops.get(name), stage=name,
                  impl=impl if name == "prefill_attn" else IMPL[name], prefill_impl=impl,
                  ok=ok, **c)
        step_us = _time(h, path.run)
        fin = res["final"]
        h.add("one_layer", v, shape, total, None, max_abs_diff=fin["max_abs_diff"], stage="total",
              impl="path", prefill_impl=impl, ok=all_ok and fin["ok"], step_graph_us=step_us,
              final_rel_frob=fin["rel_frob"], final_ok=fin["ok"], final_tol=fin["tol"])
        del path
        gc.collect()
    del L, ref
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(h: Harness, spec: ol.Spec = ol.REAL, steps=None, variants=VARIANTS,
        prefill_impls=ol.PREFILL_IMPLS) -> None:
    for step in (steps if steps is not None else cases(h.quick)):
        run_case(h, spec, step, variants, prefill_impls=prefill_impls)
