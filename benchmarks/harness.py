"""Benchmark harness: one process on one GPU times our kernels beside the upstream vLLM 0.33.0
kernels they replace, at the same shapes, and writes one JSON file of rows.

Timing: ``triton.testing.do_bench`` median over a ring of input copies larger than twice the
L2 so no call finds its inputs cached. ``time_graph`` (the kernel's GPU time: the ring's
launches captured in one CUDA graph, replays timed) is what rows report as ``ours_us`` /
``upstream_us`` for the memory-bound kernels; ``time_ring`` (eager launches, host time
included where it exceeds the kernel's) and ``host_us`` (CPU time per call) are reported
beside it, because on the H200 host one Triton launch costs ~40 us of Python
(benchmarks/diag/overhead.py), more than most of these kernels take on the GPU.
Roofline: the device-to-device copy bandwidth and the bf16 matmul rate are measured in the
same run; a memory-bound row reports ``bytes / time / copy_bw``, a matmul-bound row
``tflops / matmul_tflops``. The row schema is documented in benchmarks/README.md.
"""
from __future__ import annotations

import datetime as _dt
import itertools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent
for p in (REPO / "overlay", REPO / "build", REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

COPY_BYTES = 1 << 30  # 1 GiB source: far past any L2, long enough to time at ~4 TB/s.
MATMUL_N = 8192       # the square bf16 GEMM quoted for H100/H200 peak measurements.


def _commit() -> str:
    env_commit = os.environ.get("DEEPINFER_COMMIT")
    if env_commit:
        return env_commit
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "overlay",
                                "benchmarks", "tools"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:
        return "unknown"


def _do_bench(fn: Callable[[], Any]) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


class Harness:
    def __init__(self, quick: bool = False):
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks need a CUDA GPU")
        self.quick = quick
        self.dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(self.dev)
        self.sm_count = props.multi_processor_count
        self.l2_bytes = getattr(props, "L2_cache_size", 64 << 20)
        import triton
        self.meta = {
            "gpu": torch.cuda.get_device_name(self.dev),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(self.dev))),
            "sm_count": self.sm_count,
            "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "commit": _commit(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "deepinfer_arch": os.environ.get("DEEPINFER_ARCH", ""),
        }
        self.rows: list[dict] = []
        self.out: Path | None = None   # set by benchmarks/run.py: rewritten after each row
        self.copy_gbps = self.measure_copy()
        self.matmul_tflops = self.measure_matmul()
        self.meta["copy_bandwidth_GBps"] = round(self.copy_gbps, 1)
        self.meta["bf16_matmul_TFLOPs"] = round(self.matmul_tflops, 1)

    # ---------------------------------------------------------------- rooflines
    def measure_copy(self) -> float:
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=self.dev)
        dst = torch.empty_like(src)
        us = _do_bench(lambda: dst.copy_(src))
        del src, dst
        return 2 * COPY_BYTES / (us * 1e-6) / 1e9  # read + write

    def measure_matmul(self) -> float:
        a = torch.randn(MATMUL_N, MATMUL_N, device=self.dev, dtype=torch.bfloat16)
        b = torch.randn(MATMUL_N, MATMUL_N, device=self.dev, dtype=torch.bfloat16)
        us = _do_bench(lambda: a @ b)
        del a, b
        return 2 * MATMUL_N ** 3 / (us * 1e-6) / 1e12

    # ---------------------------------------------------------------- timing
    def copies(self, make: Callable[[], Any], bytes_per_copy: int, max_copies: int = 64) -> list:
        """Enough independent input sets (``make()`` each) to exceed twice the L2."""
        n = max(1, min(max_copies, -(-2 * self.l2_bytes // max(1, bytes_per_copy))))
        return [make() for _ in range(n)]

    def time_ring(self, launch: Callable[[Any], Any], inputs: list) -> float:
        """Median microseconds of ``launch(x)``, x cycling through ``inputs`` (eager: where the
        host launch path is slower than the kernel, this is host time)."""
        ring = itertools.cycle(inputs)
        return _do_bench(lambda: launch(next(ring)))

    def time_graph(self, launch: Callable[[Any], Any], inputs: list, reps: int = 1) -> float:
        """GPU microseconds per ``launch(x)``: one CUDA graph holding ``launch(x)`` for every
        x of the ring (``reps`` times), its replays timed by ``do_bench`` (median), divided
        by the launches per replay. Host launch cost is out of the measurement; the ring
        (> 2x L2) keeps every launch's inputs out of the cache, as in ``time_ring``."""
        for x in inputs[:2]:
            launch(x)  # compile outside the capture
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm the allocator on a side stream, as torch asks
            launch(inputs[0])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                for x in inputs:
                    launch(x)
        us = _do_bench(graph.replay) / (reps * len(inputs))
        del graph
        return us

    def timings(self, launch: Callable[[Any], Any], inputs: list) -> dict:
        """``{"gpu": time_graph, "eager": time_ring, "host": host_us}`` in microseconds."""
        return {"gpu": self.time_graph(launch, inputs), "eager": self.time_ring(launch, inputs),
                "host": self.host_us(launch, inputs[0])}

    @staticmethod
    def launch_fields(ours: dict, upstream: dict) -> dict:
        """The eager and host times of a row, beside its GPU times (``ours_us``...)."""
        return {"ours_eager_us": _r(ours["eager"]), "upstream_eager_us": _r(upstream["eager"]),
                "ours_host_us": _r(ours["host"]), "upstream_host_us": _r(upstream["host"])}

    @staticmethod
    def host_us(launch: Callable[[Any], Any], x: Any, calls: int = 200) -> float:
        """Host (CPU) microseconds per ``launch(x)`` call: ``calls`` back-to-back launches
        timed on the wall clock before the device is synchronized (the GPU work of one call
        must be shorter than its host time for this to be the host's cost alone; suites
        pass their smallest input)."""
        import time
        for _ in range(10):
            launch(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            launch(x)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / calls * 1e6

    # ---------------------------------------------------------------- rows
    def add(self, kernel: str, variant: str, shape: dict, ours_us: float | None,
            upstream_us: float | None, *, bytes: int | None = None, flops: float | None = None,
            exact: bool | None = None, max_abs_diff: float | None = None, **extra) -> dict:
        row = {
            "kernel": kernel, "variant": variant, "shape": shape,
            "ours_us": _r(ours_us), "upstream_us": _r(upstream_us),
            "speedup": _r(upstream_us / ours_us) if ours_us and upstream_us else None,
            "bytes": bytes,
            "roofline_share": None, "upstream_roofline_share": None,
            "tflops": None, "matmul_share": None,
            "exact": exact, "max_abs_diff": max_abs_diff,
        }
        if bytes is not None:
            if ours_us:
                row["roofline_share"] = _r(bytes / (ours_us * 1e-6) / 1e9 / self.copy_gbps, 4)
            if upstream_us:
                row["upstream_roofline_share"] = _r(bytes / (upstream_us * 1e-6) / 1e9 / self.copy_gbps, 4)
        if flops is not None and ours_us:
            row["tflops"] = _r(flops / (ours_us * 1e-6) / 1e12)
            row["matmul_share"] = _r(row["tflops"] / self.matmul_tflops, 4)
            if upstream_us:
                row["upstream_tflops"] = _r(flops / (upstream_us * 1e-6) / 1e12)
        row.update(extra)
        self.rows.append(row)
        print(_fmt_row(row), flush=True)
        if self.out is not None:   # every row on disk at once: a run stopped midway keeps it
            self.write(self.out)
        return row

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"meta": self.meta, "rows": self.rows}, indent=1) + "\n")
        tmp.replace(path)
        return path


def _r(x, nd: int = 3):
    return None if x is None else round(float(x), nd)


def _fmt_row(r: dict) -> str:
    shape = ",".join(f"{k}={v}" for k, v in r["shape"].items())
    share = f"{r['roofline_share']:.0%}" if r.get("roofline_share") is not None else (
        f"{r['tflops']}TF" if r.get("tflops") is not None else "-")
    return (f"{r['kernel']:22s} {r['variant']:6s} {shape:44s} ours {r['ours_us']!s:>9} us  "
            f"upstream {r['upstream_us']!s:>9} us  x{r['speedup']!s:6}  {share:>7}  "
            f"exact={r['exact']} maxdiff={r['max_abs_diff']}")


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.float() - b.float()).abs()
    d = torch.nan_to_num(d, nan=float("inf")) if (a.isnan() != b.isnan()).any() else torch.nan_to_num(d, nan=0.0)
    return float(d.max()) if d.numel() else 0.0


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
