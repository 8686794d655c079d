"""Diagnostic sweep (H200): sm90 tiles of the unified sparse MLA decode, timed as the
sparse_mla_decode suite times them (each launch captured in a CUDA graph, replays over an
input ring), 64 heads, top-k 512 + window 128. One JSON line per measurement."""
import json, sys, traceback
sys.path.insert(0, "benchmarks")
import torch
from harness import Harness, max_abs_diff
import suites.sparse_mla_decode as S
from vllm.deepinfer.kernels import sparse_mla_decode as smd

h = Harness(quick=True)
print(json.dumps({"meta": h.meta}), flush=True)
# (variant, block_h, block_n, warps, stages, ctas_per_sm, prefetch)
cands = [("sm90", 64, 64, 8, 1, 1, False), ("sm90", 64, 64, 8, 1, 1, True),
         ("sm90", 64, 32, 8, 1, 1, True), ("sm90", 64, 32, 8, 1, 2, True),
         ("sm90", 64, 64, 8, 2, 1, True), ("sm90", 64, 128, 8, 1, 1, True),
         ("sm90", 64, 32, 4, 1, 2, True),
         ("sm80", 16, 16, 4, 1, 2, False), ("sm80", 16, 16, 4, 1, 2, True),
         ("sm80", 16, 32, 4, 1, 2, True)]
for heads in (64,):
    for tokens in (1, 16, 64, 128):
        keys = S.TOPK + S.WINDOW
        flops = 2 * 2 * tokens * heads * keys * 512
        inputs = S.ring_inputs(h, tokens, heads)
        ref = S.reference(inputs[0])
        outs = [torch.empty_like(xi["q"]) for xi in inputs]
        for var, bh, bn, w, st, cps, pf in cands:
            orig = smd.TILES[var]
            smd.TILES[var] = smd.Tile(block_h=bh, block_n=bn, num_warps=w, num_stages=st,
                                      ctas_per_sm=cps, prefetch=pf)
            row = {"tokens": tokens, "heads": heads, "variant": var,
                   "tile": [bh, bn, w, st, cps, pf]}
            try:
                got = S.ours(inputs[0], var)
                torch.cuda.synchronize()
                row["max_abs_diff"] = max_abs_diff(got, ref)
                us = h.time_ring(S._replay, [S._graph(lambda i=i: S.ours(inputs[i], var, out=outs[i]))
                                             for i in range(len(inputs))])
                row.update(us=round(us, 3), tflops=round(flops / us / 1e6, 1),
                           splits=smd.launch_plan(tokens, heads, float(keys), smd.TILES[var], h.sm_count)[1])
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            smd.TILES[var] = orig
            print(json.dumps(row), flush=True)
        del inputs, outs
        torch.cuda.empty_cache()
