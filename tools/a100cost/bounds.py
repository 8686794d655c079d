"""The model proper: a launch's cycles on the busiest SM (issue, each pipe, tensor, the
simulated latency), occupancy, and a workload's predicted time against the roofline."""
from __future__ import annotations

import collections
import dataclasses
import math

from .builds import Code
from .gpus import GPU
from .scheduler import pipe_costs, simulate


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch of a workload: its grid and how often each loop runs."""
    code: Code
    programs: int
    # Trips per program of each loop, by index into code.loops (largest first); loops not
    # named run once per program.
    trips: dict
    # Share of programs that run the whole kernel; the others leave at the guarded EXIT
    # number ``exit_ordinal`` (an early return) and run only the code before it.
    active: float = 1.0
    exit_ordinal: int = 0

    def weight(self, region: int) -> float:
        return 1.0 if region < 0 else float(self.trips.get(region, 1))


def occupancy(code: Code, gpu: GPU) -> int:
    """Resident CTAs per SM: warps, registers (256-register warp allocation granules),
    shared memory (1 KiB reserved per CTA) and the CTA limit."""
    regs_warp = math.ceil(code.regs * 32 / 256) * 256
    by_regs = gpu.regs_per_sm // (regs_warp * code.num_warps)
    by_smem = gpu.smem_per_sm // (code.shared + 1024) if code.shared else gpu.max_ctas_per_sm
    by_warps = gpu.max_warps_per_sm // code.num_warps
    return max(1, min(gpu.max_ctas_per_sm, by_regs, by_smem, by_warps))


def _region_cycles(code: Code, gpu: GPU, warps: int, scale: float, cache: dict) -> dict:
    """Simulated cycles of each region for ``warps`` warps on one scheduler: straight-line
    code once; a loop as (first iteration, each further iteration) from three passes."""
    key = (code.key or id(code), code.name, code.cc, gpu.name, warps, scale)
    if key not in cache:
        wpc = max(1, code.num_warps // gpu.rates["issue"])
        out = {}
        for r, insts in code.regions().items():
            if r < 0:
                out[r] = (simulate(insts, gpu, warps, int(wpc), 1, scale)[0], 0.0)
            else:
                d = simulate(insts, gpu, warps, int(wpc), 3, scale)
                out[r] = (d[0], (d[2] - d[0]) / 2)
        cache[key] = out
    return cache[key]


_SIM_CACHE: dict = {}


def launch_bounds(launch: Launch, gpu: GPU, latency_scale: float = 1.0) -> dict:
    """Cycles on the busiest SM for one launch: the throughput bounds (issue, each pipe,
    tensor) from the weighted instruction counts, and ``simulated``, the scheduler
    simulation of the resident warps round after round."""
    code = launch.code
    regions = code.regions()
    head = code.head(launch.exit_ordinal) if launch.active < 1.0 else []
    full = launch.active if head else 1.0
    work: dict[str, float] = collections.defaultdict(float)  # per warp, pipe units
    for r, insts in list(regions.items()) + [(-2, head)]:
        w = (1.0 - full) if r == -2 else full * launch.weight(r)
        for ins in insts:
            for p, c in pipe_costs(ins, gpu).items():
                if p == "tensor_flops" and ins.base == "HGMMA":
                    p = "wgmma_flops"
                work[p] += w * c
    R = occupancy(code, gpu)
    per_sm = math.ceil(launch.programs / gpu.sms)
    resident = min(per_sm, R)
    warps = per_sm * code.num_warps
    issue_rate = min(gpu.rates["issue"], resident * code.num_warps)
    out = {"issue": warps * work["issue"] / issue_rate}
    for p in ("fma", "fmaheavy", "alu", "xu", "fp16", "lsu"):
        out[p] = warps * work[p] / gpu.rates[p]
    out["tensor"] = warps * (work["tensor_flops"] / gpu.tensor_flops_per_clk + (
        work["wgmma_flops"] / gpu.wgmma_flops_per_clk if work["wgmma_flops"] else 0.0))
    sim = 0.0
    left = per_sm
    while left > 0:
        ctas = min(left, R)
        k = math.ceil(ctas * code.num_warps / gpu.rates["issue"])
        cyc = _region_cycles(code, gpu, k, latency_scale, _SIM_CACHE)
        sim += full * sum(first + max(0.0, launch.weight(r) - 1) * each
                          for r, (first, each) in cyc.items() if launch.weight(r) > 0)
        if head:
            wpc = max(1, code.num_warps // gpu.rates["issue"])
            sim += (1.0 - full) * simulate(head, gpu, k, int(wpc), 1, latency_scale)[0]
        left -= ctas
    out["simulated"] = sim
    flops = launch.programs * code.num_warps * (work["tensor_flops"] + work["wgmma_flops"])
    return {"cycles": out, "occupancy": R, "programs_per_sm": per_sm, "flops": flops,
            "per_warp": dict(work)}


@dataclasses.dataclass
class Workload:
    """A measured (or predicted) shape: its launches and the bytes it must move."""
    kernel: str
    variant: str
    shape: dict
    launches: list
    bytes: float   # bytes the problem must move (the roofline limit's)
    flops: float   # useful FLOPs (for the roofline limit and TFLOP/s)
    # DRAM bytes this implementation moves (the memory bound); None: ``bytes``.
    traffic: float | None = None


def predict(wl: Workload, gpu: GPU, latency_scale: float = 1.0) -> dict:
    """Predicted time (us) of ``wl`` on ``gpu``, the bound that sets it, the roofline limit."""
    total_us = 0.0
    parts = []
    for ln in wl.launches:
        b = launch_bounds(ln, gpu, latency_scale)
        cyc = b["cycles"]
        sm_bound, sm_cycles = max(cyc.items(), key=lambda kv: kv[1])
        sm_us = sm_cycles / (gpu.clock_ghz * 1e3)
        parts.append({"kernel": ln.code.name, "programs": ln.programs,
                      "occupancy": b["occupancy"], "bound": sm_bound, "sm_us": sm_us,
                      "bounds_us": {k: v / (gpu.clock_ghz * 1e3) for k, v in cyc.items()}})
        total_us += gpu.launch_us + sm_us
    traffic = wl.bytes if wl.traffic is None else wl.traffic
    mem_us = traffic / (gpu.hbm_gbps * gpu.hbm_efficiency) * 1e-3
    launch_total = gpu.launch_us * len(wl.launches)
    bound = max(parts, key=lambda p: p["sm_us"])["bound"] if parts else "memory"
    if mem_us + launch_total > total_us:
        total_us, bound = mem_us + launch_total, "memory"
    limit_us = max(wl.bytes / gpu.hbm_gbps * 1e-3,
                   wl.flops / (gpu.tensor_flops_per_clk * gpu.sms * gpu.clock_ghz) * 1e-3)
    return {"us": total_us, "bound": bound, "memory_us": mem_us, "limit_us": limit_us,
            "launches": parts}
