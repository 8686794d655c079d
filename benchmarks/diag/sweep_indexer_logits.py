"""Diagnostic sweep (H200): indexer-logits launch options for the sm80 variant (software
decode) — num_stages and programs per SM at the 64 x 8192 decode and the 2048 x 8192
prefill of benchmarks/suites/indexer_logits.py. GPU time from CUDA graphs over input rings
> 2x L2. Prints one JSON line per measurement; the chosen row goes into
kernels/indexer_logits.py's TILES with a comment pointing at the committed results."""
import dataclasses, json, sys
sys.path.insert(0, "benchmarks")
from harness import Harness
import suites.indexer_logits as sil
from vllm.deepinfer.kernels import indexer_logits as il

h = Harness(quick=True)
print(json.dumps({"meta": h.meta}), flush=True)
dev = h.dev
B, L = 64, 8192
dec = h.copies(lambda: sil._decode_inputs(dev, B, L), B * L * (il.HEAD_DIM + 8), max_copies=16)
M, N = 2048, 8192
pre = h.copies(lambda: sil._prefill_inputs(dev, M, N), N * 132 + M * N * 2, max_copies=8)
base = il.TILES["sm80"]
for stages in (1, 2, 3, 4):
    for pps in (4, 8, 16, 32):
        for bn, nw in ((64, 4), (128, 8)):
            t = dataclasses.replace(base, num_stages=stages, programs_per_sm=pps, block_n=bn,
                                    num_warps=nw)
            d_us = h.time_graph(lambda x: il.paged_mqa_logits(
                x["q"], x["cache"], x["w"], x["ctx"], x["table"], x["L"], variant="sm80",
                tile=t), dec)
            p_us = h.time_graph(lambda x: il.mqa_logits(
                x["q"], x["k"], x["s"], x["w"], x["ks"], x["ke"], N, variant="sm80", tile=t), pre)
            print(json.dumps({"stages": stages, "pps": pps, "bn": bn, "warps": nw,
                              "decode_us": round(d_us, 2), "prefill_us": round(p_us, 2)}),
                  flush=True)
