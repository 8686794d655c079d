"""Diagnostic sweep (H200): gather and combiner tile candidates, GPU time from CUDA graphs
over input rings > 2x L2, next to a device copy moving the same bytes (the size-matched
roofline). Prints one JSON line per measurement. Not a results file; the chosen rows go into
the kernels' TILES tables with a comment pointing at the output kept in benchmarks/results/."""
import dataclasses, json, sys
sys.path.insert(0, "benchmarks")
import torch
from harness import Harness
import suites.kv_gather as skg
import suites.topk_swa as sts
from vllm.deepinfer.kernels import kv_gather as kg, topk_swa as ts

h = Harness(quick=True)
print(json.dumps({"meta": h.meta}), flush=True)
dev = h.dev
gen = torch.Generator(device=dev)
print(json.dumps({"copy_GBps": h.copy_gbps}), flush=True)


def same_size_copy(nbytes):
    half = nbytes // 2
    ins = h.copies(lambda: (torch.empty(half, dtype=torch.uint8, device=dev),
                            torch.empty(half, dtype=torch.uint8, device=dev)), nbytes)
    return h.time_graph(lambda x: x[1].copy_(x[0]), ins)


for n in [16384, 49152, 131072]:
    gen.manual_seed(n)
    nbytes = n * skg.BYTES_PER_TOKEN
    inputs = h.copies(lambda: skg._make(dev, [n], [n], gen), nbytes * 2)
    cp = same_size_copy(nbytes)
    print(json.dumps({"gather_copy_us": cp, "tokens": n}), flush=True)
    for tokens, warps, pps, dec in [(16, 8, 32, "hw"), (8, 4, 32, "hw"), (32, 8, 16, "hw"),
                                    (16, 4, 16, "hw"), (16, 8, 8, "hw"), (32, 16, 8, "hw"),
                                    (8, 4, 32, "f16bits"), (8, 4, 32, "e4b15"), (16, 8, 32, "e4b15"),
                                    (16, 4, 16, "e4b15"), (8, 2, 32, "e4b15")]:
        kg.TILES["sweep"] = kg.GatherTile(tokens, warps, pps, dec)
        us = h.time_graph(lambda x: skg._ours(x, "sweep", n), inputs)
        print(json.dumps({"gather": n, "tile": [tokens, warps, pps, dec], "us": round(us, 3),
                          "share": round(nbytes / us / 1e3 / h.copy_gbps, 3),
                          "vs_copy": round(cp / us, 3)}), flush=True)
    del inputs
    torch.cuda.empty_cache()

for T, ratio in [(8192, 1), (8192, 0), (32768, 0), (1536, 1)]:
    topk = 512 if ratio else 0
    width = ts.combined_width(topk, sts.WINDOW)
    nbytes = sts._bytes([T], [sts.CONTEXT], ratio, topk, width)
    inputs = h.copies(lambda: sts._make(dev, gen, [T], [sts.CONTEXT], 512, ratio),
                      T * (512 + 2 * width) * 4)
    cp = same_size_copy(nbytes)
    print(json.dumps({"combine_copy_us": cp, "T": T, "ratio": ratio}), flush=True)
    for tokens, block, warps in [(1, 1024, 4), (1, 512, 4), (2, 1024, 8), (2, 512, 4), (4, 256, 4),
                                 (1, 256, 2), (4, 128, 4), (8, 128, 4), (16, 128, 4), (8, 128, 8),
                                 (32, 128, 8), (16, 128, 8)]:
        if block < width and block < 512:
            continue
        ts.TILES["sweep"] = (ts.CombineTile(2**31 - 1, tokens, block, warps),)
        ts._launch_config.cache_clear()
        us = h.time_graph(lambda x: sts._ours(x, ratio, topk, "sweep"), inputs)
        print(json.dumps({"combine": [T, ratio], "tile": [tokens, block, warps], "us": round(us, 3),
                          "share": round(nbytes / us / 1e3 / h.copy_gbps, 3),
                          "vs_copy": round(cp / us, 3)}), flush=True)
    del inputs
