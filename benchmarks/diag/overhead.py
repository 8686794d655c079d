"""Diagnostic: host time per call vs GPU time (do_bench eager, CUDA graph, profiler)."""
import sys, time, json, os
sys.path.insert(0, "benchmarks")
import torch, triton
from harness import Harness
import suites.kv_gather as skg
import suites.topk_swa as sts

dev = torch.device("cuda")
gen = torch.Generator(device=dev)

def host_us(fn, n=300):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t) / n * 1e6

def graph_us(fn, n=20):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn()
    return triton.testing.do_bench(lambda: g.replay(), warmup=10, rep=50, return_mode="median") * 1e3 / n

def prof_us(fn, n=20):
    fn(); torch.cuda.synchronize()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n): fn()
        torch.cuda.synchronize()
    tot = {}
    for e in p.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0):
            tot[e.key[:40]] = round(e.device_time_total / n, 2) if hasattr(e, "device_time_total") else round(e.cuda_time_total / n, 2)
    return tot

def bench(name, fn):
    r = {"name": name,
         "host_us": round(host_us(fn), 2),
         "dobench_us": round(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3, 2),
         "graph_us": round(graph_us(fn), 2),
         "prof": prof_us(fn)}
    print(json.dumps(r), flush=True)

for n in [16384, 131072]:
    gen.manual_seed(n)
    x = skg._make(dev, [n], [n], gen)
    bench(f"gather up {n}", lambda: skg._upstream(x, n))
    for v in ["sm80", "sm90"]:
        bench(f"gather {v} {n}", lambda: skg._ours(x, v, n))

for T, ratio in [(1536, 1), (1536, 2), (1536, 0), (8192, 1)]:
    topk = 512
    x = sts._make(dev, gen, [T], [4096], topk, ratio)
    bench(f"combine up T{T} r{ratio}", lambda: sts._upstream(x, ratio, topk if ratio else 0))
    for v in ["sm80", "sm90"]:
        bench(f"combine {v} T{T} r{ratio}", lambda: sts._ours(x, ratio, topk if ratio else 0, v))

# pure validation / python costs
from vllm.deepinfer.kernels import kv_gather as kg
x = skg._make(dev, [16384], [16384], gen)
t = time.perf_counter()
for _ in range(1000):
    kg._check_inputs(x["out"], x["cache"], x["seq"], x["gl"], x["bt"], 64, 0)
print("gather checks us", (time.perf_counter() - t) * 1e3)
