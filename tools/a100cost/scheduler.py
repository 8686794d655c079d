"""One instruction's work per execution pipe, and the per-scheduler simulation of warps
issuing a stream of instructions (stall counts, scoreboards, pipe occupancy, barriers)."""
from __future__ import annotations

import collections

from .gpus import GPU
from .sass import Inst, access_bytes, hmma_flops


def pipe_costs(ins: Inst, gpu: GPU) -> dict[str, float]:
    """Work this warp instruction puts on each pipe, in units of the pipe's rate (so pipe
    time = cost / rate). Every instruction also costs one issue slot."""
    c: dict[str, float] = {"issue": 1.0}
    cls, base = ins.cls, ins.base
    if cls == "hmma":
        c["tensor_flops"] = float(hmma_flops(ins))
    elif cls == "fp32":
        if base in ("FFMA", "FADD", "FMUL", "FMUL32I", "FADD32I", "FFMA32I"):
            c["fma"] = 1.0
        else:  # compare, select, min/max: the ALU on Volta and later
            c["alu"] = 1.0
    elif cls == "fp16":
        c["fp16"] = 1.0
    elif cls == "int":
        if base in ("IMAD", "IMUL", "IMAD32I"):
            wide = ".WIDE" in ins.op
            c["fma"] = 2.0 if wide else 1.0       # 64-bit result: two passes
            c["fmaheavy"] = c["fma"]
        elif base in ("FLO", "POPC", "BREV"):
            c["xu"] = 1.0                          # 16 per SM per clock
        else:
            c["alu"] = 1.0
    elif cls == "conv":
        if base == "F2FP" or (base == "I2FP" and gpu.i2fp_on_alu):
            c["alu"] = 1.0                         # packed fp32 -> bf16/fp16, sm_90 I2FP
        else:
            c["xu"] = 1.0
    elif cls == "mufu":
        c["xu"] = 1.0
    elif cls in ("lds", "sts", "ldg", "stg"):
        c["lsu"] = max(1.0, access_bytes(ins) / 128.0)
    elif cls == "shfl":
        c["lsu"] = 1.0
    return c


def _latency_class(ins: Inst) -> str:
    if ins.base in ("LDL", "STL"):
        return "l1"                                # register spills: L1-resident
    if ins.cls == "ldg":
        return "dram"
    if ins.cls == "lds":
        return "smem"
    if ins.cls == "hmma":
        return "hmma"
    if ins.cls in ("conv", "mufu") or ins.base in ("FLO", "POPC", "BREV"):
        return "xu"
    if ins.cls == "shfl":
        return "shfl"
    if ins.base in ("S2R", "CS2R", "S2UR"):
        return "s2r"
    if ins.base in ("LDC", "ULDC"):
        return "ldc"
    return "other"


# Cycles after issue at which a read scoreboard clears (sources read out).
_READ_RELEASE = 8


def _pipe_slots(ins: Inst, gpu: GPU) -> tuple[tuple[str, ...], float]:
    """(pipes the instruction may go to, cycles it occupies one on one scheduler). A pipe's
    per-scheduler occupancy is schedulers * cost / (its per-SM rate); the L1 (lsu) is
    shared by the SM and is taken as split evenly between the schedulers."""
    costs = pipe_costs(ins, gpu)
    q = gpu.rates["issue"]
    if "tensor_flops" in costs:
        rate = gpu.wgmma_flops_per_clk if ins.base == "HGMMA" else gpu.tensor_flops_per_clk
        return ("tensor",), costs["tensor_flops"] / (rate / q)
    if "fmaheavy" in costs:
        return ("fmaheavy",), q * costs["fmaheavy"] / gpu.rates["fmaheavy"]
    if "fma" in costs:  # FP32: either half of the FMA pipe where there are two
        halves = ("fmaheavy", "fmalite") if gpu.rates["fma"] > gpu.rates["fmaheavy"] else (
            "fmaheavy",)
        return halves, q * costs["fma"] / (gpu.rates["fma"] / len(halves))
    for p in ("alu", "xu", "fp16", "lsu"):
        if p in costs:
            return (p,), q * costs[p] / gpu.rates[p]
    return (), 0.0


def simulate(insts: list, gpu: GPU, warps: int, warps_per_cta: int, passes: int = 1,
             scale: float = 1.0) -> list[float]:
    """One SM sub-partition (scheduler) running ``warps`` warps through ``insts`` (in
    address order, no branch taken) ``passes`` times: each cycle at most one instruction
    issues, from the oldest ready warp; a warp is ready when its previous instruction's
    stall count has elapsed, the scoreboards it waits on are clear (variable-latency
    results arrive after ``gpu.latency`` cycles times ``scale``) and its pipe is free.
    ``BAR`` waits for the scheduler's warps of the same CTA. Returns the cycle at which
    the last warp finished each pass."""
    n = len(insts)
    if n == 0 or warps == 0:
        return [0.0] * passes
    slots = [_pipe_slots(i, gpu) for i in insts]
    lat = [gpu.latency[_latency_class(i)] * scale for i in insts]
    per_cta = max(1, min(warps, warps_per_cta))
    pc = [0] * warps                       # position in the unrolled stream
    t_next = [0.0] * warps
    ready = [[0.0] * 6 for _ in range(warps)]
    blocked = [False] * warps
    bar_wait: dict = {}                    # (cta, k) -> [arrived warps, max arrival]
    bar_count = [0] * warps
    pipe_free: dict = collections.defaultdict(float)
    tensor_busy = 0.0
    sched_free = 0.0
    total = n * passes
    done_at = [0.0] * passes
    finished = [0] * passes
    while True:
        best, best_t = -1, None
        for w in range(warps):
            if pc[w] >= total or blocked[w]:
                continue
            i = pc[w] % n
            ins = insts[i]
            e = t_next[w]
            if ins.wait:
                for b in range(6):
                    if ins.wait >> b & 1 and ready[w][b] > e:
                        e = ready[w][b]
            if ins.base == "WARPGROUP" and ".DEPBAR" in ins.op:
                e = max(e, tensor_busy + gpu.latency["hmma"] * scale)
            pipes, _ = slots[i]
            if pipes:
                e = max(e, min(pipe_free[p] for p in pipes))
            if best_t is None or e < best_t:
                best, best_t = w, e
        if best < 0:
            break
        w = best
        i = pc[w] % n
        ins = insts[i]
        t = max(best_t, sched_free)
        sched_free = t + 1
        pipes, occ = slots[i]
        if pipes:
            p = min(pipes, key=lambda q: pipe_free[q])
            pipe_free[p] = max(pipe_free[p], t) + occ
            if p == "tensor":
                tensor_busy = pipe_free[p]
        if ins.wbar != 7:
            ready[w][ins.wbar] = max(ready[w][ins.wbar], t + lat[i])
        if ins.rbar != 7:
            ready[w][ins.rbar] = max(ready[w][ins.rbar], t + _READ_RELEASE)
        t_next[w] = t + max(1, ins.stall)
        pc[w] += 1
        if ins.base == "BAR":
            cta = w // per_cta
            key = (cta, bar_count[w])
            bar_count[w] += 1
            arrived = bar_wait.setdefault(key, [[], 0.0])
            arrived[0].append(w)
            arrived[1] = max(arrived[1], t)
            members = min(per_cta, warps - cta * per_cta)
            if len(arrived[0]) == members:
                for v in arrived[0]:
                    blocked[v] = False
                    t_next[v] = max(t_next[v], arrived[1] + gpu.latency["bar"] * scale)
                del bar_wait[key]
            else:
                blocked[w] = True
        if pc[w] % n == 0:
            k = pc[w] // n - 1
            finished[k] += 1
            done_at[k] = max(done_at[k], t_next[w])
    return done_at
