#!/usr/bin/env python3
"""A100 cost model from the machine code of our Triton kernels (docs/a100-model.md).

No Ampere GPU is available to this project, so this tool predicts what an A100 would take
for a kernel from what can be known without one: the sm_80 build of the kernel (the same
``triton.compile`` the compile gate runs, then ``cuobjdump -sass``) and the A100's published
per-SM throughputs, latencies and memory bandwidth. The same code, compiled for sm_90 and
fed the H200's figures, predicts the H200 times this project has measured; the error of those
predictions is the model's validation (``validate``).

For one launch (grid, loop trip counts, bytes) the model takes, per warp, every SASS
instruction of the kernel weighted by how often it runs (straight-line code once, a loop's
body once per trip) and computes, for the busiest SM:

* issue: warp instructions / (schedulers with a warp, 1 instruction per clock each);
* pipes: per execution pipe (FP32/IMAD ``fma``, integer/logic ``alu``, conversions and
  MUFU ``xu``, shared/global/shuffle L1 wavefronts ``lsu``, tensor FLOPs ``tensor``) the
  work over the pipe's published rate;
* latency: one warp's run through the code alone, simulated from the stall counts and
  scoreboard waits the compiler wrote into each instruction's control bits, with published
  latencies for the variable-latency operations (DRAM, shared memory, conversions, MUFU),
  times the rounds of resident CTAs the SM runs one after another;

the SM time is the largest of these; the kernel time is the larger of the SM time and the
bytes over the achievable DRAM bandwidth, plus a fixed launch time. ``limit`` is the
roofline of the same launch: max(bytes / peak DRAM bandwidth, FLOPs / tensor rate).

    python tools/a100_model.py counts   --kernel decode.sm80 --cc 80 [--ops]
    python tools/a100_model.py validate [--json F] [--markdown F]
    python tools/a100_model.py decode   [--variant sm80 ...] [--measured F] [--json F] [--chart P]
    python tools/a100_model.py annotate RESULTS.json [--out F] [--chart PNG]

It compiles kernels, so it needs the real Triton (no TRITON_INTERPRET) and the overlay on
the path (the tool puts it there); no GPU. Compiled SASS is cached under build/a100_model/
keyed by the kernel's source hash, constexprs, target and Triton version.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
BUILD = Path(os.environ.get("DEEPINFER_BUILD", REPO / "build"))
CACHE = BUILD / "a100_model"
PROG = "a100_model"


class ModelError(Exception):
    """A failure the user can act on (one line, printed without a traceback)."""


# ============================================================================ GPU figures
@dataclasses.dataclass(frozen=True)
class GPU:
    """Per-SM throughputs (warp instructions per SM per clock), latencies (cycles) and
    device figures of one GPU. Sources are given where the table is filled in."""
    name: str
    sms: int
    clock_ghz: float
    hbm_gbps: float              # peak DRAM bandwidth
    hbm_efficiency: float        # share of the peak a streaming kernel reaches
    tensor_flops_per_clk: float  # mma.sync (HMMA) dense bf16 FLOPs per SM per clock
    wgmma_flops_per_clk: float   # wgmma (HGMMA) dense bf16 FLOPs per SM per clock (0: none)
    rates: dict                  # pipe -> warp instructions per SM per clock
    latency: dict                # variable-latency class -> cycles
    regs_per_sm: int
    smem_per_sm: int             # shared memory usable by CTAs per SM, bytes
    max_warps_per_sm: int
    max_ctas_per_sm: int
    launch_us: float             # fixed time of one kernel of a replayed CUDA graph
    i2fp_on_alu: bool            # sm_90's I2FP (int -> fp32) runs on the ALU pipe

    @property
    def tensor_tflops(self) -> float:
        return self.tensor_flops_per_clk * self.sms * self.clock_ghz / 1e3

    def fp32_tflops(self) -> float:
        return self.rates["fma"] * 32 * 2 * self.sms * self.clock_ghz / 1e3


# Issue: four schedulers per SM, one warp instruction per clock each (every GPU here).
_SCHEDULERS = 4
# Ampere GA100 (A100 whitepaper; CUDA C Programming Guide, "Throughput of Native Arithmetic
# Instructions", compute capability 8.0, results per clock per SM / 32 = warp instructions):
# FP32 add/mul/fma 64 -> 2; 32-bit integer add/logic/shift/compare 64 -> 2 (the alu pipe;
# IMAD runs on the fma pipe at the same rate); conversions and MUFU 16 -> 0.5; fp16x2 256
# results -> 4 (the issue rate); shared memory / L1 128 bytes per clock -> one 128-byte
# wavefront per clock; shuffles 32 -> 1.
_A100_RATES = {"issue": _SCHEDULERS, "fma": 2.0, "fmaheavy": 2.0, "alu": 2.0, "xu": 0.5,
               "fp16": 4.0, "lsu": 1.0}
# Latencies in cycles of the operations whose results the hardware tracks with scoreboards
# (the rest are in the compiler's stall counts). Published pointer-chasing and
# microbenchmark figures (Jia et al., "Dissecting the Ampere GPU architecture via
# microbenchmarking", GTC 2021; Abdelkhalik et al., arXiv 2208.11174) put an A100 DRAM
# access near 450-500 cycles, an L2 hit near 200, shared memory 23-30, an HMMA.16816 near
# 32; conversions and MUFU ~20. These are the model's least certain inputs: `validate`
# reports the error again with every latency scaled by 0.7 and 1.3.
_A100_LATENCY = {"dram": 480, "l1": 35, "smem": 30, "hmma": 32, "xu": 20, "shfl": 30, "s2r": 25,
                 "ldc": 30, "bar": 20, "other": 20}
_A100_COMMON = dict(
    sms=108,                 # SXM4 A100 (both memory sizes): 108 SMs enabled
    clock_ghz=1.41,          # boost clock, the clock of NVIDIA's peak figures
    # 1024 dense bf16 FMA per SM per clock (4 third-generation tensor cores x 256):
    # 108 x 2048 x 1.41 GHz = 312 TFLOP/s, the datasheet figure.
    tensor_flops_per_clk=2048.0, wgmma_flops_per_clk=0.0,
    rates=_A100_RATES, latency=_A100_LATENCY,
    regs_per_sm=65536, smem_per_sm=164 * 1024, max_warps_per_sm=64, max_ctas_per_sm=32,
    # Same fixed cost per graph-replayed kernel as measured on the H200 (below): launch
    # latency is a host/driver/front-end figure, not an SM one. Assumed, not measured.
    launch_us=2.0, i2fp_on_alu=False,
    # STREAM-like copies reach ~88% of the DRAM peak on the H200 here (4251 of 4800 GB/s,
    # benchmarks/results/*.json meta.copy_bandwidth_GBps); the A100 is assumed alike.
    hbm_efficiency=0.886,
)
A100_40GB = GPU(name="A100-SXM4-40GB", hbm_gbps=1555.0, **_A100_COMMON)  # HBM2, datasheet
A100_80GB = GPU(name="A100-SXM4-80GB", hbm_gbps=2039.0, **_A100_COMMON)  # HBM2e, datasheet
# Hopper GH100 as the H200 SXM (132 SMs, 1980 MHz max SM clock, HBM3e 4.8 TB/s). Rates from
# the same Programming Guide table at 9.0: FP32 128 -> 4 (IMAD only on the heavy half: 2),
# integer 64 -> 2, conversions/MUFU 16 -> 0.5. wgmma: 4096 dense bf16 FLOPs per SM per clock
# (989 TFLOP/s at 1830 MHz, the datasheet figure). The mma.sync rate of Hopper is not
# published; it is taken as half of wgmma's (Ampere's per-SM rate), an assumption that only
# matters where the tensor pipe binds (it binds nowhere in the validation).
H200 = GPU(name="H200-SXM", sms=132, clock_ghz=1.98, hbm_gbps=4800.0, hbm_efficiency=0.886,
           tensor_flops_per_clk=2048.0, wgmma_flops_per_clk=4096.0,
           rates={"issue": _SCHEDULERS, "fma": 4.0, "fmaheavy": 2.0, "alu": 2.0, "xu": 0.5,
                  "fp16": 4.0, "lsu": 1.0},
           # Luo et al. (arXiv 2402.13499) measure Hopper latencies in cycles close to
           # Ampere's; at the higher clock a DRAM access is taken as ~560 cycles.
           latency={"dram": 560, "l1": 35, "smem": 30, "hmma": 32, "xu": 20, "shfl": 30, "s2r": 25,
                    "ldc": 30, "bar": 20, "other": 20},
           regs_per_sm=65536, smem_per_sm=228 * 1024, max_warps_per_sm=64, max_ctas_per_sm=32,
           # The smallest graph-timed kernels in the committed H200 results (the V4.1
           # writers at 64 tokens: ~0.1 us of work) take 2.5-2.9 us; 2.0 us of it is taken
           # as the fixed cost of a replayed kernel (the one calibrated constant).
           launch_us=2.0, i2fp_on_alu=True)
GPUS = {"a100-40gb": A100_40GB, "a100-80gb": A100_80GB, "h200": H200}


# ============================================================================ SASS
@dataclasses.dataclass(frozen=True)
class Inst:
    addr: int
    text: str       # the instruction without predicate guard, e.g. "LDG.E.128 R4, [R2.64]"
    op: str         # mnemonic with modifiers, e.g. "LDG.E.128"
    base: str       # mnemonic, e.g. "LDG"
    stall: int      # control bits: cycles before this warp's next instruction may issue
    wbar: int       # scoreboard set when the result is written (7: none)
    rbar: int       # scoreboard set when the sources are read (7: none)
    wait: int       # mask of scoreboards waited on before issue
    cls: str        # instruction class (CLASSES)
    guarded: bool = False  # under a predicate (@P / @!P)


CLASSES = ("hmma", "fp32", "fp16", "int", "conv", "mufu", "lds", "sts", "ldg", "stg", "shfl",
           "sync", "ctrl", "misc")
_CLASS_OF = {}
for _c, _ops in {
    "hmma": "HMMA HGMMA IMMA DMMA",
    "fp32": "FFMA FADD FMUL FMNMX FSETP FSEL FSET FCHK FSWZADD FMUL32I FADD32I FFMA32I",
    "fp16": "HADD2 HFMA2 HMUL2 HMNMX2 HSETP2 HSET2",
    "int": "IMAD IMUL IADD3 IADD LOP3 LOP SHF SHL SHR ISETP ISET SEL LEA IMNMX IABS MOV PRMT "
           "BMSK SGXT P2R R2P PLOP3 VIADD VIMNMX VIADDMNMX IDP FLO POPC BREV IMAD32I IADD32I "
           "LOP32I MOV32I",
    "conv": "F2F F2I I2F F2FP I2FP FRND I2I",
    "mufu": "MUFU",
    "lds": "LDS LDSM",
    "sts": "STS",
    "ldg": "LDG LDGSTS LD LDL",
    "stg": "STG ST STL RED ATOM ATOMG ATOMS",
    "shfl": "SHFL",
    "sync": "BAR DEPBAR WARPSYNC MEMBAR ARRIVES LDGDEPBAR WARPGROUP ERRBAR CCTL SYNCS",
    "ctrl": "BRA EXIT BSSY BSYNC NOP CALL RET JMP BREAK YIELD BRX JMX KILL",
}.items():
    for _o in _ops.split():
        _CLASS_OF[_o] = _c

_INST_RE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]{16}) \*/")
_HI_RE = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
_FUNC_RE = re.compile(r"Function\s*:\s*(\S+)")


def classify(base: str) -> str:
    return _CLASS_OF.get(base, "misc")


def decode_control(hi: int) -> tuple[int, int, int, int]:
    """(stall, write scoreboard, read scoreboard, wait mask) from the high 64 bits of a
    Volta+ instruction (control bits 105..125 of the 128)."""
    c = hi >> 41
    return c & 0xF, (c >> 5) & 7, (c >> 8) & 7, (c >> 11) & 0x3F


def parse_sass(text: str) -> dict[str, list[Inst]]:
    """``cuobjdump -sass`` output -> {function name: instructions in address order}."""
    funcs: dict[str, list[Inst]] = {}
    cur: list[Inst] | None = None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        fm = _FUNC_RE.search(line)
        if fm:
            cur = funcs.setdefault(fm.group(1), [])
            continue
        m = _INST_RE.search(line)
        if m is None or cur is None:
            continue
        hm = _HI_RE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if hm is None:
            raise ModelError(f"SASS line {i + 1}: no control word after {line.strip()!r}")
        body = m.group(2).strip()
        guarded = body.startswith("@")
        if guarded:
            body = body.split(None, 1)[1]
        op = body.split()[0]
        base = op.split(".")[0]
        stall, wbar, rbar, wait = decode_control(int(hm.group(1), 16))
        cur.append(Inst(int(m.group(1), 16), body, op, base, stall, wbar, rbar, wait,
                        classify(base), guarded))
    return funcs


@dataclasses.dataclass(frozen=True)
class Loop:
    start: int   # address of the first instruction (the back edge's target)
    end: int     # address of the back-edge branch

    def contains(self, addr: int) -> bool:
        return self.start <= addr <= self.end


def find_loops(insts: list[Inst]) -> list[Loop]:
    """Loops from backward branches, largest first (one per back-edge target)."""
    spans: dict[int, int] = {}
    for ins in insts:
        if ins.base == "BRA":
            m = re.search(r"BRA\s+(?:`\(\S+\)\s*)?(0x[0-9a-f]+)", ins.text)
            if m:
                tgt = int(m.group(1), 16)
                # A branch to itself is the trap after EXIT, not a loop.
                if tgt < ins.addr:
                    spans[tgt] = max(spans.get(tgt, 0), ins.addr)
    loops = [Loop(s, e) for s, e in spans.items()]
    return sorted(loops, key=lambda lp: (-(lp.end - lp.start), lp.start))


def hmma_flops(ins: Inst) -> int:
    """Dense FLOPs of one warp's tensor instruction (HGMMA: the warp's quarter)."""
    m = re.search(r"\.(\d+)x(\d+)x(\d+)", ins.op)
    if ins.base == "HGMMA" and m:
        return 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) // 4
    m = re.search(r"\.(\d)(\d)(\d+)\b", ins.op)  # HMMA.16816 / .1688 / .884
    if m:
        digits = ins.op.split(".")[1]
        shapes = {"16816": (16, 8, 16), "1688": (16, 8, 8), "884": (8, 8, 4), "16832": (16, 8, 32)}
        if digits in shapes:
            a, b, c = shapes[digits]
            return 2 * a * b * c
    raise ModelError(f"unknown tensor instruction shape: {ins.text}")


def access_bytes(ins: Inst) -> int:
    """Bytes one warp moves through L1/shared memory for a memory instruction."""
    if ins.base == "LDSM":
        n = 4 if ".4" in ins.op.split(".M88")[-1] else 2 if ".2" in ins.op.split(".M88")[-1] else 1
        return 128 * n
    width = 4
    for mod, w in ((".128", 16), (".64", 8), (".U8", 1), (".S8", 1), (".U16", 2), (".S16", 2)):
        if mod in ins.op:
            width = w
            break
    return 32 * width


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


# ============================================================================ kernels
@dataclasses.dataclass
class Code:
    """One compiled kernel: its SASS and resource use."""
    name: str
    cc: int
    num_warps: int
    shared: int
    regs: int
    insts: list
    loops: list
    key: str = ""   # build identity (kernel source, constexprs, specialization, target)

    def region_of(self, ins: Inst) -> int:
        """Index of the innermost loop holding ``ins`` (-1: straight-line code)."""
        best, size = -1, None
        for i, lp in enumerate(self.loops):
            if lp.contains(ins.addr) and (size is None or lp.end - lp.start < size):
                best, size = i, lp.end - lp.start
        return best

    def regions(self) -> dict[int, list[Inst]]:
        out: dict[int, list[Inst]] = collections.defaultdict(list)
        for ins in self.insts:
            out[self.region_of(ins)].append(ins)
        return out

    def head(self, exit_ordinal: int) -> list[Inst]:
        """Instructions up to and including the ``exit_ordinal``-th guarded EXIT (an early
        return, counted from 0 in address order): what a program leaving there runs."""
        exits = [k for k, i in enumerate(self.insts) if i.base == "EXIT" and i.guarded]
        if exit_ordinal >= len(exits):
            raise ModelError(f"{self.name} sm_{self.cc}: no early exit #{exit_ordinal} "
                             f"({len(exits)} guarded EXITs)")
        return self.insts[:exits[exit_ordinal] + 1]

    def class_counts(self, region: int) -> dict[str, int]:
        return dict(collections.Counter(i.cls for i in self.regions().get(region, [])))


def _triton_tool(name: str) -> str:
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.access(path, os.X_OK):
        raise ModelError(f"{path}: missing; Triton's NVIDIA backend ships {name}")
    return path


def runtime_attrs(spec, ints: dict | None) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as Triton's launcher would specialize ``spec``'s
    kernel for a call with the integer arguments ``ints`` (name -> value): pointers are
    16-byte aligned (torch allocations), an integer equal to 1 becomes a constant, one
    divisible by 16 gets ``tt.divisibility`` (unless the kernel lists it in
    ``do_not_specialize``). The compile gate builds without these hints; the kernels ran
    with them, and they decide, e.g., whether record loads are vectorized."""
    sig, constexprs, attrs = dict(spec.signature), dict(spec.constexprs), {}
    if ints is None:
        return sig, constexprs, attrs
    for idx, (name, no_spec, no_align) in enumerate(_params(spec.kernel)):
        t = sig.get(name)
        if t is None or t == "constexpr":
            continue
        if t.startswith("*"):
            if not no_align:
                attrs[(idx,)] = [["tt.divisibility", 16]]
        elif t[0] in "iu" and name in ints and not no_spec:
            v = ints[name]
            if v == 1:
                sig[name] = "constexpr"
                constexprs[name] = 1
            elif v % 16 == 0:
                attrs[(idx,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs


def _params(kernel) -> list[tuple[str, bool, bool]]:
    """(name, do_not_specialize, do_not_specialize_on_alignment) per kernel parameter, from
    a JITFunction or (under TRITON_INTERPRET) the InterpretedFunction standing in for it."""
    if hasattr(kernel, "params"):
        return [(p.name, bool(p.do_not_specialize), bool(p.do_not_specialize_on_alignment))
                for p in kernel.params]
    names = list(kernel.arg_names)
    kw = getattr(kernel, "kwargs", {}) or {}

    def listed(key):
        return {names[x] if isinstance(x, int) else x for x in (kw.get(key) or ())}
    ns, na = listed("do_not_specialize"), listed("do_not_specialize_on_alignment")
    return [(n, n in ns, n in na) for n in names]


def _spec_key(spec, cc: int, ints: dict | None = None) -> str:
    import triton
    sig, constexprs, attrs = runtime_attrs(spec, ints)
    h = hashlib.sha256()
    for part in (spec.kernel.cache_key, json.dumps(constexprs, sort_keys=True, default=str),
                 json.dumps(sig, sort_keys=True), sorted(attrs), spec.num_warps,
                 spec.num_stages, cc, triton.__version__):
        h.update(str(part).encode())
    return h.hexdigest()[:24]


def compile_code(spec, cc: int, ints: dict | None = None, use_cache: bool = True) -> Code:
    """Compile a compile-gate spec for sm_``cc`` (specialized for the integer arguments
    ``ints`` as Triton's launcher would) and parse its SASS (cached)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise ModelError("TRITON_INTERPRET is set: the model compiles real kernels; unset it")
    key = _spec_key(spec, cc, ints)
    cached = CACHE / f"{key}.json"
    if use_cache and cached.is_file():
        d = json.loads(cached.read_text())
        sass, shared, regs = d["sass"], d["shared"], d["regs"]
    else:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        sig, constexprs, attrs = runtime_attrs(spec, ints)
        if getattr(spec.kernel, "is_gluon", lambda: False)():  # a Gluon kernel
            from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
        compiled = triton.compile(ASTSource(spec.kernel, sig, constexprs, attrs),
                                  target=GPUTarget("cuda", cc, 32),
                                  options={"num_warps": spec.num_warps,
                                           "num_stages": spec.num_stages})
        shared = int(compiled.metadata.shared)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            sass = subprocess.run([_triton_tool("cuobjdump"), "-sass", f.name],
                                  capture_output=True, text=True, timeout=300).stdout
            res = subprocess.run([_triton_tool("cuobjdump"), "--dump-resource-usage", f.name],
                                 capture_output=True, text=True, timeout=300).stdout
        m = re.search(r"REG:(\d+)", res)
        regs = int(m.group(1)) if m else 255
        if use_cache:
            CACHE.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps({"name": spec.name, "cc": cc, "ints": ints,
                                          "sass": sass, "shared": shared, "regs": regs}))
    funcs = parse_sass(sass)
    if len(funcs) != 1:
        raise ModelError(f"{spec.name} sm_{cc}: expected one function in the cubin, got "
                         f"{sorted(funcs)}")
    insts = next(iter(funcs.values()))
    return Code(spec.name, cc, spec.num_warps, shared, regs, insts, find_loops(insts), key)


# ============================================================================ model
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


# ============================================================================ workloads
def _overlay_on_path() -> None:
    p = str(REPO / "overlay")
    if p not in sys.path:
        sys.path.insert(0, p)


def _spec(name: str, **constexprs):
    """A registered compile-gate spec, with constexprs overridden (benchmark launches)."""
    _overlay_on_path()
    from vllm.deepinfer import compile_gate
    specs = {s.name: s for s in compile_gate.specs()}
    if name not in specs:
        raise ModelError(f"kernel spec {name!r} is not registered; known: "
                         f"{', '.join(sorted(specs))}")
    s = specs[name]
    return dataclasses.replace(s, constexprs={**s.constexprs, **constexprs}) if constexprs else s


_CODES: dict = {}


def code_for(spec, cc: int, ints: dict | None = None) -> Code:
    key = (_spec_key(spec, cc, ints), spec.name)
    if key not in _CODES:
        _CODES[key] = compile_code(spec, cc, ints)
    return _CODES[key]


def _main_loop(code: Code) -> int:
    if not code.loops:
        raise ModelError(f"{code.name} sm_{code.cc}: no loop in the machine code")
    return 0


def decode_workload(tokens: int, heads: int, topk: int, window: int, variant: str, cc: int,
                    sms: int, kernel_variant: str | None = None) -> Workload:
    """The decode suite's launch (benchmarks/suites/sparse_mla_decode.py): sink on, no
    inverse RoPE, SWA pages of 32 and compressed pages of 64 (as measured), each token's
    compressed rows in a region of twice top-k; the split count from the kernel's own
    heuristic for ``sms`` SMs."""
    _overlay_on_path()
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    from vllm.deepinfer.kernels import sparse_mla_decode_gluon as glk
    from vllm.deepinfer.kv_record import HEAD_DIM, RECORD_BYTES
    tv = kernel_variant or variant
    tile = smd.TILES[tv]
    keys = topk + window
    block_h, splits = smd.launch_plan(tokens, heads, float(keys), tile, sms)
    split = splits > 1
    swa_page, comp_page = 32, 64
    gluon_heads = tile.gluon_heads if smd.uses_gluon(tile, heads) else 0
    if gluon_heads:  # phase 2 as the Gluon kernel (its gate spec, INV_ROPE off)
        tile = smd.phase2_tile(tile, heads)
        spec = dataclasses.replace(
            _spec(f"sparse_mla_decode.gluon{gluon_heads}.{'partial' if split else 'direct'}"
                  "[sm80-2p]", INV_ROPE=False, DSPLIT=glk.DSPLIT),
            num_warps=glk.warps(gluon_heads))
    else:
        spec = dataclasses.replace(
            _spec(f"sparse_mla_decode.{'partial' if split else 'direct'}[{tv}]", INV_ROPE=False,
                  MAIN_BS=swa_page, EXTRA_BS=comp_page, BLOCK_H=block_h, BLOCK_N=tile.block_n,
                  QK_HALVES=tile.predequant and tile.qk_halves),
            num_warps=tile.num_warps, num_stages=tile.num_stages)
    ints = dict(q_stride0=heads * HEAD_DIM, q_stride1=HEAD_DIM, out_stride0=heads * HEAD_DIM,
                out_stride1=HEAD_DIM, main_stride0=swa_page * RECORD_BYTES,
                extra_stride0=comp_page * RECORD_BYTES,
                main_rows=-(-tokens * window // swa_page) * swa_page,
                extra_rows=-(-tokens * 2 * topk // comp_page) * comp_page, cs_stride=0,
                num_heads=heads, num_splits=splits)
    code = code_for(spec, cc, {k: v for k, v in ints.items() if k in spec.signature})
    head_tiles = math.ceil(heads / block_h)
    span = math.ceil(math.ceil(keys / splits) / tile.block_n) * tile.block_n
    trips = math.ceil(min(span, keys) / tile.block_n)
    launches = []
    traffic = None
    if tile.predequant:
        # Phase 1: each token's keys dequantized once into bf16 rows (+1 validity byte).
        # Rows derived from sm80-2p ("sm80-2p-h64", a sweep's) share its registered phase 1.
        pv = "sm80-2p" if tv.startswith("sm80-2p") else tv
        pspec = _spec(f"sparse_mla_decode.predequant[{pv}]", MAIN_BS=swa_page,
                      EXTRA_BS=comp_page, DECODE=smd.PREDEQUANT_DECODES[tile.predequant_decode])
        pcode = code_for(pspec, cc, {k: ints[k] for k in ("main_stride0", "extra_stride0",
                                                           "main_rows", "extra_rows")})
        bn = smd.PREDEQUANT_BLOCK_N
        per_token = max(1, min(math.ceil(keys / bn),
                               math.ceil(smd.PREDEQUANT_PROGRAMS_PER_SM * sms / tokens)))
        launches.append(Launch(pcode, per_token * tokens,
                               {_main_loop(pcode): math.ceil(math.ceil(keys / bn) / per_token)}))
        ws = tokens * keys * (HEAD_DIM * 2 + 1)
        # The workspace is written once and read back (once from DRAM; the other head
        # tiles of a token find it in L2).
        traffic = tokens * keys * RECORD_BYTES + 2 * ws + 2 * (2 * tokens * heads * HEAD_DIM)
    launches.append(Launch(code, head_tiles * splits * tokens, {_main_loop(code): trips}))
    if split:
        rspec = _spec(f"sparse_mla_decode.reduce[{tv.split('-')[0]}]", INV_ROPE=False,
                      SPLITS_P2=1 << (splits - 1).bit_length())
        rcode = code_for(rspec, cc, dict(out_stride0=heads * HEAD_DIM, out_stride1=HEAD_DIM,
                                         cs_stride=0, num_heads=heads, num_splits=splits))
        rtrips = {0: math.ceil(splits / smd.REDUCE_UNROLL)} if rcode.loops else {}
        launches.append(Launch(rcode, math.ceil(heads / tile.reduce_block_h) * tokens, rtrips))
    nbytes = tokens * keys * RECORD_BYTES + 2 * (2 * tokens * heads * HEAD_DIM)
    flops = 2 * 2 * tokens * heads * keys * HEAD_DIM
    return Workload("sparse_mla_decode", variant,
                    dict(tokens=tokens, heads=heads, topk=topk, window=window),
                    launches, nbytes, flops, traffic)


def gather_workload(shape: dict, variant: str, cc: int, sms: int) -> Workload:
    """The kv_gather suite's launch: pages of 64 tokens, gather lengths passed. Ragged rows'
    per-request lengths are not in the results: their tiles are counted from the total (a
    request's last partial tile is lost: <= 1 tile per request) and the block table's row
    stride is taken as not a multiple of 16."""
    _overlay_on_path()
    from vllm.deepinfer.kernels import kv_gather as kg
    from vllm.deepinfer.kv_record import HEAD_DIM, RECORD_BYTES
    tile = kg.TILES[variant.split("-")[0]]
    decode = variant.split("-")[1] if "-" in variant else tile.decode
    reqs, tokens = shape["reqs"], shape["tokens"]
    page = 64
    bucket = next(b for b in (16, 128, 1024) if reqs <= b)
    spec = _spec(f"kv_gather.T{tile.tokens}w{tile.num_warps}.{tile.decode}.R{bucket}.gl",
                 DECODE={"int": 0, "f16bits": 1, "e4b15": 2, "hw": 3}[decode])
    # Longest gather: the whole row for one request; the suite draws ragged lengths below 16K.
    max_len = tokens if reqs == 1 else 16 << 10
    ints = dict(out_s0=max_len * HEAD_DIM, out_s1=HEAD_DIM, page_stride=page * RECORD_BYTES,
                bt_stride=-(-max_len // page) if reqs == 1 else 17)
    code = code_for(spec, cc, ints)
    tiles = math.ceil(tokens / tile.tokens) + (reqs - 1 if shape.get("ragged") else 0)
    programs = max(1, min(reqs * math.ceil(max_len / tile.tokens), tile.programs_per_sm * sms))
    trips = tiles / programs
    return Workload("kv_gather", variant, shape, [Launch(code, programs, {_main_loop(code): trips})],
                    tokens * (RECORD_BYTES + 2 * HEAD_DIM), 0.0)


def indexer_workload(kind: str, shape: dict, variant: str, cc: int, sms: int) -> Workload:
    """The indexer_logits suite's launches (64 heads x 128 dims, 128-token pages)."""
    _overlay_on_path()
    from vllm.deepinfer.kernels import indexer_logits as il
    base = variant.split("-")[0]
    tile = il.TILES[base]
    e4b15 = variant.endswith("e4b15")
    H, D = shape["H"], shape["D"]
    page = 128
    if kind == "paged":
        rows, L = shape["B"], shape["L"]
        spec = _spec(f"indexer_logits.paged[{base}]", E4B15=e4b15)
        keys_per_row = [L] * rows
        nbytes = rows * L * (D + 8) + rows * H * (D + 4)
        ints = dict(page_stride=page * (D + 4))
    else:
        M, N = shape["M"], shape["N"]
        spec = _spec(f"indexer_logits.flat[{base}]", E4B15=e4b15)
        rows, L = M, N
        keys_per_row = [N - M + i + 1 for i in range(M)]
        nbytes = N * (D + 4) + sum(keys_per_row) * 4 + M * H * (D + 4)
        ints = dict(page_stride=0)
    code = code_for(spec, cc, ints)
    P = max(1, min(math.ceil(L / tile.block_n), math.ceil(tile.programs_per_sm * sms / rows)))
    # Tiles of a row are shared round-robin by its P programs; many rows' programs spread
    # over the SMs, so the average row's trips stand for all.
    trips = sum(math.ceil(math.ceil(k / tile.block_n) / P) for k in keys_per_row) / rows
    flops = 2.0 * H * D * sum(keys_per_row)
    return Workload(f"indexer_logits.{kind}", variant, shape,
                    [Launch(code, P * rows, {_main_loop(code): trips})], nbytes, flops)


def writer_workload(kernel: str, shape: dict, variant: str, cc: int, nbytes: float) -> Workload:
    """One program per token, no loop (the V4.1 writers of the fp8_writers suite); with
    compress ratio r only every r-th token writes, the others leave at the ratio check."""
    ratio = shape["ratio"]
    page = 128
    if kernel == "v41_rope_quant_insert":
        name, ints = f"fp8_writers.v41.rope_quant_insert_584.cr{ratio}", {}
    else:
        name = f"fp8_writers.v41.indexer_k_store_fp8.cr{ratio}"
        ints = dict(k_pre_stride=128, cos_stride=64, cache_block=page)
    code = code_for(_spec(f"{name}[{variant}]"), cc, ints)
    # Early exits in address order: the slot check (0), then the ratio check (1).
    return Workload(kernel, variant, shape,
                    [Launch(code, shape["tokens"], {}, active=1.0 / ratio, exit_ordinal=1)],
                    nbytes, 0.0)


def prefill_workload(shape: dict, variant: str, cc: int, nbytes: float) -> Workload:
    """The sparse_mla_prefill suite's launch of ours (benchmarks/suites/sparse_mla_prefill.py):
    dense rows of ``shape["keys"]`` entries per token (the row's mean list length), sink on,
    a 512-wide output, an aligned workspace; grid tokens x head tiles, one loop trip per key
    tile. ``nbytes``: the bytes the suite counts for the row (Q, output, the workspace rows
    and the index lists)."""
    _overlay_on_path()
    from vllm.deepinfer.kernels import sparse_mla_prefill as spm
    from vllm.deepinfer.kv_record import HEAD_DIM
    tile = spm.TILES[variant]
    if tile.gluon_ws:
        raise ModelError(f"sparse_mla_prefill row {variant!r} runs the warp-specialized Gluon "
                         "kernel, whose partitions the model does not simulate (its Triton "
                         "tile is row 'sm90-triton')")
    T, H, keys = shape["tokens"], shape["heads"], shape["keys"]
    block_h, head_tiles = spm.launch_plan(H, tile)
    width = -(-(shape["topk"] + shape.get("window", 128)) // 128) * 128
    spec = dataclasses.replace(
        _spec(f"sparse_mla_prefill[{variant.split('-')[0]}]",
              **spm.gate_constexprs(dataclasses.replace(tile, block_h=block_h))),
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    ints = dict(q_stride0=H * HEAD_DIM, q_stride1=HEAD_DIM, kv_stride0=HEAD_DIM,
                idx_stride0=width, out_stride0=H * HEAD_DIM, out_stride1=HEAD_DIM,
                num_rows=3, num_heads=H, head_tiles=head_tiles, width=width)
    code = code_for(spec, cc, ints)
    trips = math.ceil(keys / tile.block_n)
    flops = 2.0 * 2 * T * H * keys * HEAD_DIM
    return Workload("sparse_mla_prefill", variant, shape,
                    [Launch(code, T * head_tiles, {_main_loop(code): trips})], nbytes, flops)


def upstream_prefill_workload(shape: dict, cc: int, nbytes: float) -> Workload:
    """Upstream's ``_sparse_attn_prefill_ragged_kernel`` as ``_rocm_sparse_attn_prefill_
    ragged_triton`` launches it (grid (T, cdiv(H, 16)), BLOCK_H 16, BLOCK_K 16, 4 warps,
    Triton's default 3 stages), from build/upstream_kernels (tools/extract_upstream.py)."""
    import importlib
    from vllm.deepinfer.compile_gate import GateSpec
    from vllm.deepinfer.kv_record import HEAD_DIM
    if str(BUILD) not in sys.path:
        sys.path.insert(0, str(BUILD))
    try:
        fn = importlib.import_module(
            "upstream_kernels.v41_sparse_prefill")._sparse_attn_prefill_ragged_kernel
    except ImportError as e:
        raise ModelError(f"upstream's prefill kernel: {e} (run `make upstream-kernels`)")
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "kv_indices_ptr": "*i32",
            "kv_indptr_ptr": "*i32", "attn_sink_ptr": "*fp32", "out_ptr": "*bf16"}
    const = dict(HAS_ATTN_SINK=True, OUT_DV=HEAD_DIM, BLOCK_H=16, BLOCK_D=HEAD_DIM,
                 BLOCK_K=16)
    sig = {n: ptrs.get(n, "constexpr" if n in const else "fp32" if n == "scale" else "i32")
           for n in fn.arg_names}
    spec = GateSpec(name="upstream._sparse_attn_prefill_ragged_kernel", kernel=fn,
                    signature=sig, constexprs=const, variants=(), num_warps=4, num_stages=3)
    T, H, keys = shape["tokens"], shape["heads"], shape["keys"]
    ints = dict(q_stride_t=H * HEAD_DIM, q_stride_h=HEAD_DIM, q_stride_d=1,
                kv_stride_n=HEAD_DIM, kv_stride_d=1, out_stride_t=H * HEAD_DIM,
                out_stride_h=HEAD_DIM, out_stride_d=1, num_heads=H, head_dim=HEAD_DIM,
                num_kv=3)
    code = code_for(spec, cc, ints)
    flops = 2.0 * 2 * T * H * keys * HEAD_DIM
    return Workload("sparse_mla_prefill", "upstream", shape,
                    [Launch(code, T * math.ceil(H / 16), {_main_loop(code): math.ceil(keys / 16)})],
                    nbytes, flops)


# ============================================================================ validation
# Committed H200 measurements the validation reads (GPU time from CUDA graphs), with the
# kernel families the model covers. The kernels' jitted code is the code of this commit
# (only named constants changed since these runs; docs/a100-model.md).
VALIDATION_SOURCES = {
    "sparse_mla_decode": "h200-2026-11-29-final.json",
    "kv_gather": "h200-2026-11-29-final.json",
    "v41_rope_quant_insert": "h200-2026-11-29-final.json",
    "v41_indexer_k_store": "h200-2026-11-29-final.json",
    "indexer_logits.paged": "h200-2026-11-29-ampere-path-2f0f2b5.json",
    "indexer_logits.flat": "h200-2026-11-29-ampere-path-2f0f2b5.json",
}
# Variants validated per family: the Ampere code path (software e4m3) compiled for sm_90,
# and for the decode also the Hopper variant (hardware e4m3, wgmma).
VALIDATION_VARIANTS = {
    "sparse_mla_decode": ("sm80", "sm90"), "kv_gather": ("sm80", "sm80-int"),
    "v41_rope_quant_insert": ("sm80",), "v41_indexer_k_store": ("sm80",),
    "indexer_logits.paged": ("sm80", "sm80-e4b15"), "indexer_logits.flat": ("sm80", "sm80-e4b15"),
}


def measured_rows() -> list[dict]:
    rows = []
    for kernel, fname in VALIDATION_SOURCES.items():
        data = json.loads((RESULTS / fname).read_text())
        for r in data["rows"]:
            if r.get("kernel") == kernel and r.get("variant") in VALIDATION_VARIANTS[kernel]:
                rows.append({**r, "source": fname, "commit": data["meta"]["commit"]})
    return rows


def workload_for_row(r: dict, cc: int, sms: int) -> Workload:
    k, v, s = r["kernel"], r["variant"], r["shape"]
    if k == "sparse_mla_decode":
        return decode_workload(s["tokens"], s["heads"], s["topk"], s["window"], v, cc, sms)
    if k == "kv_gather":
        return gather_workload(s, v, cc, sms)
    if k.startswith("indexer_logits."):
        return indexer_workload(k.split(".")[1], s, v, cc, sms)
    if k.startswith("v41_"):
        return writer_workload(k, s, v.split("-")[0], cc, r["bytes"])
    raise ModelError(f"no workload for kernel {k!r}")


def validate(latency_scales=(0.7, 1.0, 1.3)) -> dict:
    """Predict every committed H200 measurement of the covered kernels from the sm_90 build
    of the same code and report the error; then the A100 predictions of the same shapes."""
    rows = []
    for r in measured_rows():
        wl = workload_for_row(r, 90, H200.sms)
        preds = {sc: predict(wl, H200, sc) for sc in latency_scales}
        p = preds[1.0]
        if r["variant"].startswith("sm80"):  # hardware-e4m3 variants do not build for sm_80
            a_wl = workload_for_row(r, 80, A100_40GB.sms)
            a40, a80 = predict(a_wl, A100_40GB), predict(a_wl, A100_80GB)
        else:
            a40 = a80 = None
        rows.append({
            "kernel": r["kernel"], "variant": r["variant"], "shape": r["shape"],
            "source": r["source"], "measured_commit": r["commit"],
            "measured_h200_us": r["ours_us"], "predicted_h200_us": round(p["us"], 3),
            "error": round(p["us"] / r["ours_us"] - 1.0, 4),
            "bound": p["bound"],
            "error_latency_x0.7": round(preds[latency_scales[0]]["us"] / r["ours_us"] - 1, 4),
            "error_latency_x1.3": round(preds[latency_scales[-1]]["us"] / r["ours_us"] - 1, 4),
            "h200_launches": p["launches"],
            "predicted_a100_40gb_us": a40 and round(a40["us"], 3),
            "predicted_a100_80gb_us": a80 and round(a80["us"], 3),
            "a100_40gb_limit_us": a40 and round(a40["limit_us"], 3),
            "a100_80gb_limit_us": a80 and round(a80["limit_us"], 3),
            "a100_bound": a40 and a40["bound"],
        })
    summary = {}
    for fam in sorted({(r["kernel"], r["variant"]) for r in rows}):
        errs = [r["error"] for r in rows if (r["kernel"], r["variant"]) == fam]
        summary[f"{fam[0]}[{fam[1]}]"] = {
            "rows": len(errs),
            "median_abs_error": round(sorted(abs(e) for e in errs)[len(errs) // 2], 4),
            "max_abs_error": round(max(abs(e) for e in errs), 4),
            "mean_error": round(sum(errs) / len(errs), 4)}
    return {"meta": _meta(), "rows": rows, "summary": summary}


def _meta() -> dict:
    import triton
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"tool": "tools/a100_model.py", "commit": commit, "triton": triton.__version__,
            "gpus": {k: dataclasses.asdict(g) for k, g in GPUS.items()}}


def _shape_label(shape: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items() if k != "ragged") + (
        ",ragged" if shape.get("ragged") else "")


def validation_markdown(res: dict) -> str:
    out = ["| kernel | variant | shape | H200 measured µs | H200 predicted µs | error | bound "
           "| A100 40GB µs | A100 80GB µs |",
           "|---|---|---|---|---|---|---|---|---|"]
    def us(v):
        return "-" if v is None else f"{v:.1f}"

    for r in res["rows"]:
        out.append(f"| {r['kernel']} | {r['variant']} | {_shape_label(r['shape'])} | "
                   f"{r['measured_h200_us']:.1f} | {r['predicted_h200_us']:.1f} | "
                   f"{r['error'] * 100:+.0f}% | {r['bound']} | {us(r['predicted_a100_40gb_us'])} | "
                   f"{us(r['predicted_a100_80gb_us'])} |")
    out += ["", "| kernel[variant] | rows | median abs error | max abs error | mean error |",
            "|---|---|---|---|---|"]
    for k, s in res["summary"].items():
        out.append(f"| {k} | {s['rows']} | {s['median_abs_error'] * 100:.0f}% | "
                   f"{s['max_abs_error'] * 100:.0f}% | {s['mean_error'] * 100:+.0f}% |")
    return "\n".join(out) + "\n"


# ============================================================================ decode table
DECODE_BATCHES = (1, 4, 16, 64, 128)


def decode_predictions(variant: str) -> list[dict]:
    """A100 predictions (40 and 80 GB) for the decode suite's shapes (64 and 128 heads,
    top-k 512 + window 128), with the A100 roofline limit beside each."""
    rows = []
    for heads in (64, 128):
        for t in DECODE_BATCHES:
            wl = decode_workload(t, heads, 512, 128, variant, 80, A100_40GB.sms)
            p40, p80 = predict(wl, A100_40GB), predict(wl, A100_80GB)
            rows.append({"tokens": t, "heads": heads, "variant": variant,
                         "predicted_a100_40gb_us": round(p40["us"], 2),
                         "a100_40gb_limit_us": round(p40["limit_us"], 2),
                         "predicted_a100_80gb_us": round(p80["us"], 2),
                         "a100_80gb_limit_us": round(p80["limit_us"], 2),
                         "bound": p40["bound"],
                         "tflops_a100_40gb": round(wl.flops / p40["us"] * 1e-6, 1)})
    return rows


# ============================================================================ annotate
def annotate_rows(rows: list[dict], sms_h200: int = H200.sms) -> int:
    """Add the A100 predictions beside every decode row of the Ampere code path (variants
    named sm80...): ``predicted_a100_40gb_us``, ``predicted_a100_80gb_us`` and the roofline
    limits ``a100_40gb_limit_us`` / ``a100_80gb_limit_us`` (max of bytes over the peak HBM
    bandwidth and FLOPs over the tensor rate), plus ``predicted_h200_us`` (the model on the
    H200 row itself: its error is the check). Returns the number of rows annotated."""
    _overlay_on_path()
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    n = 0
    for r in rows:
        if r.get("kernel") != "sparse_mla_decode" or r.get("variant") not in smd.TILES:
            continue
        s = r["shape"]
        if r["variant"].startswith("sm80"):
            a = decode_workload(s["tokens"], s["heads"], s["topk"], s["window"], r["variant"],
                                80, A100_40GB.sms)
            p40, p80 = predict(a, A100_40GB), predict(a, A100_80GB)
            r["predicted_a100_40gb_us"] = round(p40["us"], 2)
            r["predicted_a100_80gb_us"] = round(p80["us"], 2)
            r["a100_40gb_limit_us"] = round(p40["limit_us"], 2)
            r["a100_80gb_limit_us"] = round(p80["limit_us"], 2)
            r["a100_bound"] = p40["bound"]
        h = decode_workload(s["tokens"], s["heads"], s["topk"], s["window"], r["variant"], 90,
                            sms_h200)
        r["predicted_h200_us"] = round(predict(h, H200)["us"], 2)
        n += 1
    return n


def decode_chart(rows: list[dict], title: str, out: Path) -> Path:
    """Decode rows: measured H200 time per variant, predicted A100 (40/80 GB) time of the
    Ampere variants and the A100 limit, per shape (log scale). Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r.get("kernel") == "sparse_mla_decode"]
    labels = list(dict.fromkeys(f"T={r['shape']['tokens']},H={r['shape']['heads']},"
                                f"k={r['shape']['topk']}" for r in rows))

    def label(r):
        return f"T={r['shape']['tokens']},H={r['shape']['heads']},k={r['shape']['topk']}"

    series: dict = collections.OrderedDict()
    for r in rows:
        if r.get("ours_us") is not None:
            series.setdefault(f"H200 measured {r['variant']}", {})[label(r)] = r["ours_us"]
        elif r.get("predicted_h200_us") is not None:
            series.setdefault(f"H200 predicted {r['variant']}", {})[label(r)] = \
                r["predicted_h200_us"]
        if r.get("predicted_a100_40gb_us") is not None:
            series.setdefault(f"A100-40GB predicted {r['variant']}", {})[label(r)] = \
                r["predicted_a100_40gb_us"]
            series.setdefault(f"A100-80GB predicted {r['variant']}", {})[label(r)] = \
                r["predicted_a100_80gb_us"]
    limit40 = {label(r): r["a100_40gb_limit_us"] for r in rows if r.get("a100_40gb_limit_us")}
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(labels) + 3), 5))
    width = 0.8 / max(1, len(series))
    for k, (name, vals) in enumerate(series.items()):
        ax.bar([x - 0.4 + width * (k + 0.5) for x in range(len(labels))],
               [vals.get(lab) or 0 for lab in labels], width, label=name)
    ax.plot(range(len(labels)), [limit40.get(lab, float("nan")) for lab in labels], "k_",
            markersize=18, label="A100-40GB limit (bytes/HBM, FLOPs/tensor)")
    ax.set_xticks(list(range(len(labels))))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("µs (lower is better)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ============================================================================ CLI
def _counts(args) -> int:
    if args.kernel in _NAMED:
        code = _NAMED[args.kernel](args.cc)
    else:
        code = code_for(_spec(args.kernel), args.cc)
    print(f"{code.name} sm_{code.cc}: {len(code.insts)} instructions, {code.num_warps} warps, "
          f"{code.regs} registers, {code.shared} B shared, loops (largest first): "
          f"{[(hex(lp.start), hex(lp.end)) for lp in code.loops]}")
    regs = code.regions()
    for r in sorted(regs):
        c = collections.Counter(i.cls for i in regs[r])
        label = "straight-line" if r < 0 else f"loop {r}"
        print(f"  {label:14s} {len(regs[r]):5d}  " + "  ".join(
            f"{k}={c[k]}" for k in CLASSES if c.get(k)))
        if args.ops:
            ops = collections.Counter(i.op for i in regs[r])
            print("      " + "  ".join(f"{o}={n}" for o, n in ops.most_common()))
    return 0


_NAMED = {
    # Shorthands for the counts command (any registered spec name works too): the decode
    # kernel as the suite launches it at 64 tokens x 64 heads, specialized like that call.
    "decode.sm80": lambda cc: decode_workload(64, 64, 512, 128, "sm80", cc,
                                              H200.sms if cc >= 90 else A100_40GB.sms)
    .launches[0].code,
    "decode.sm90": lambda cc: decode_workload(64, 64, 512, 128, "sm90", cc, H200.sms)
    .launches[0].code,
}


def _validate(args) -> int:
    res = validate()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    md = validation_markdown(res)
    if args.markdown:
        Path(args.markdown).write_text(md)
    print(md)
    return 0


def _decode(args) -> int:
    """A100 predictions of the decode suite's shapes for each --variant; with --measured,
    the H200 decode rows of that results file (annotated) come first, so the JSON and the
    chart put measurement and prediction side by side."""
    variants = args.variant or ["sm80"]
    rows: list[dict] = []
    if args.measured:
        src = json.loads(Path(args.measured).read_text())
        rows = [dict(r, source=Path(args.measured).name) for r in src["rows"]
                if r.get("kernel") == "sparse_mla_decode"]
        annotate_rows(rows, int(src["meta"].get("sm_count") or H200.sms))
    have = {(r["variant"], json.dumps(r["shape"], sort_keys=True)) for r in rows}
    for v in variants:
        for p in decode_predictions(v):
            shape = dict(tokens=p["tokens"], heads=p["heads"], topk=512, window=128)
            if (v, json.dumps(shape, sort_keys=True)) in have:
                continue
            h = decode_workload(p["tokens"], p["heads"], 512, 128, v, 90, H200.sms)
            rows.append({"kernel": "sparse_mla_decode", "variant": v, "shape": shape,
                         "ours_us": None, "predicted_h200_us": round(predict(h, H200)["us"], 2),
                         **{k: p[k] for k in ("predicted_a100_40gb_us", "predicted_a100_80gb_us",
                                              "a100_40gb_limit_us", "a100_80gb_limit_us")},
                         "a100_bound": p["bound"], "tflops_a100_40gb": p["tflops_a100_40gb"]})
    out = {"meta": {**_meta(), "note": "predicted_* are model predictions (tools/a100_model.py);"
                    " ours_us are H200 measurements where present"}, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(r["variant"], r["shape"]["tokens"], r["shape"]["heads"], r["shape"]["topk"],
              r.get("ours_us"), r.get("predicted_h200_us"), r.get("predicted_a100_40gb_us"),
              r.get("predicted_a100_80gb_us"), r.get("a100_40gb_limit_us"))
    if args.chart:
        print(decode_chart(rows, "sparse_mla_decode — H200 measured (where present), A100 "
                           "predicted by tools/a100_model.py", Path(args.chart)))
    return 0


def _annotate(args) -> int:
    path = Path(args.results)
    data = json.loads(path.read_text())
    n = annotate_rows(data["rows"], int(data.get("meta", {}).get("sm_count") or H200.sms))
    data.setdefault("meta", {})["a100_model"] = {
        "tool": "tools/a100_model.py annotate", "commit": _meta()["commit"],
        "note": "predicted_a100_* are model predictions, not measurements"}
    out = Path(args.out) if args.out else path
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"annotated {n} decode rows -> {out}")
    if args.chart:
        print(decode_chart(data["rows"], f"sparse_mla_decode — H200 measured, A100 predicted "
                           f"({path.name})", Path(args.chart)))
    return 0


def _prefill_bytes(shape: dict) -> float:
    """What one prefill launch must move: Q and the output (bf16), the chunk's workspace
    rows (N = (ctx + T) // ratio compressed rows, then T + min(ctx, 127) SWA rows, 1 KiB
    each) and the index lists (int32 rows of top-k + window entries)."""
    _overlay_on_path()
    from vllm.deepinfer.kv_record import HEAD_DIM
    T, ctx, H = shape["tokens"], shape["ctx"], shape["heads"]
    rows = (ctx + T) // shape["ratio"] + T + min(ctx, 127)
    return 2.0 * T * H * HEAD_DIM * 2 + rows * HEAD_DIM * 2 + T * (shape["topk"] + 128) * 4


# A row of the prefill tile table the model adds for itself: the Ampere tile with
# qk_halves off (the spec is sm80's; prefill_workload takes the tile from the row).
ONE_CHAIN = "sm80-one-chain"


def prefill_rows(data: dict) -> list[dict]:
    """Model rows for a sparse_mla_prefill results file: for each measured row (ours sm80 /
    sm90 and, in the same row, upstream's kernel) the model's H200 time from the sm_90
    build and its error; for the Ampere tile, A100 predictions of ours and of upstream's
    kernel from their sm_80 builds, the limit, the predicted ratio, and ours with one Q.K^T
    chain (``*_one_chain``, when the shipped tile has two). Rows that ran the Gluon
    producer/consumer kernel (``impl`` "gluon_ws") are skipped: the model does not simulate
    warp-specialized kernels. An ``sm90`` row without ``impl`` (files from before that
    kernel) ran the Triton tile, modelled as ``sm90-triton``."""
    _overlay_on_path()
    from vllm.deepinfer.kernels import sparse_mla_prefill as spm
    spm.TILES.setdefault(ONE_CHAIN, dataclasses.replace(spm.TILES["sm80"], qk_halves=False))
    out = []
    for r in data["rows"]:
        if (r.get("kernel") != "sparse_mla_prefill"
                or r.get("variant") not in ("sm80", "sm90", "sm90-triton")
                or r.get("impl") == "gluon_ws"):
            continue
        sh = r["shape"]
        nb = float(r["bytes"]) if r.get("bytes") else _prefill_bytes(sh)
        model_variant = "sm90-triton" if r["variant"] == "sm90" else r["variant"]
        ours = predict(prefill_workload(sh, model_variant, 90, nb), H200)
        up = predict(upstream_prefill_workload(sh, 90, nb), H200)
        row = {"kernel": "sparse_mla_prefill", "variant": r["variant"], "shape": sh,
               "measured_h200_us": r["ours_us"], "predicted_h200_us": round(ours["us"], 2),
               "error": round(ours["us"] / r["ours_us"] - 1, 4), "bound": ours["bound"],
               "upstream_measured_h200_us": r["upstream_us"],
               "upstream_predicted_h200_us": round(up["us"], 2),
               "upstream_error": round(up["us"] / r["upstream_us"] - 1, 4)}
        if r["variant"] == "sm80":
            for name, gpu in (("a100_40gb", A100_40GB), ("a100_80gb", A100_80GB)):
                a = predict(prefill_workload(sh, "sm80", 80, nb), gpu)
                if spm.TILES["sm80"].qk_halves:  # the same tile with one Q.K^T chain
                    one = predict(prefill_workload(sh, ONE_CHAIN, 80, nb), gpu)
                    row[f"predicted_{name}_us_one_chain"] = round(one["us"], 2)
                u = predict(upstream_prefill_workload(sh, 80, nb), gpu)
                row.update({f"predicted_{name}_us": round(a["us"], 2),
                            f"upstream_predicted_{name}_us": round(u["us"], 2),
                            f"{name}_limit_us": round(a["limit_us"], 2),
                            f"predicted_speedup_{name}": round(u["us"] / a["us"], 3),
                            f"{name}_bound": a["bound"]})
        out.append(row)
    return out


def _prefill(args) -> int:
    path = Path(args.measured)
    data = json.loads(path.read_text())
    rows = prefill_rows(data)
    if not rows:
        raise ModelError(f"{path}: no sparse_mla_prefill rows")
    errs = collections.defaultdict(list)
    for r in rows:
        errs[r["variant"]].append(r["error"])
        errs["upstream"].append(r["upstream_error"])
    summary = {k: {"rows": len(v), "median_abs_error": round(sorted(map(abs, v))[len(v) // 2], 4),
                   "max_abs_error": round(max(map(abs, v)), 4),
                   "mean_error": round(sum(v) / len(v), 4)} for k, v in errs.items()}
    out = {"meta": {**_meta(), "measured": path.name, "measured_commit": data["meta"].get("commit"),
                    "note": "predicted_* are model predictions (tools/a100_model.py), not "
                    "measurements; measured_* are the H200 times of the results file"},
           "rows": rows, "summary": summary}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print("| variant | T | ctx | top-k | heads | H200 meas / pred µs (error) | upstream H200 meas / "
          "pred µs (error) | A100-40GB ours / upstream µs (×) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["shape"]
        a100 = (f"{r['predicted_a100_40gb_us']:.0f} / {r['upstream_predicted_a100_40gb_us']:.0f} "
                f"({r['predicted_speedup_a100_40gb']:.2f}×)" if r["variant"] == "sm80" else "–")
        print(f"| {r['variant']} | {s['tokens']} | {s['ctx']} | {s['topk']} | {s['heads']} | "
              f"{r['measured_h200_us']:.0f} / {r['predicted_h200_us']:.0f} ({r['error']:+.0%}) | "
              f"{r['upstream_measured_h200_us']:.0f} / {r['upstream_predicted_h200_us']:.0f} "
              f"({r['upstream_error']:+.0%}) | {a100} |")
    print(json.dumps(summary))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("counts", help="SASS instruction classes per region of one kernel")
    c.add_argument("--kernel", required=True, help="compile-gate spec name or a shorthand: "
                   + ", ".join(_NAMED))
    c.add_argument("--cc", type=int, default=80)
    c.add_argument("--ops", action="store_true", help="also count each mnemonic")
    v = sub.add_parser("validate", help="predict the committed H200 rows; A100 beside them")
    v.add_argument("--json")
    v.add_argument("--markdown")
    d = sub.add_parser("decode", help="A100 predictions for the decode suite's shapes")
    d.add_argument("--variant", action="append", help="decode tile row (repeatable; sm80)")
    d.add_argument("--measured", help="an H200 results file whose decode rows go first")
    d.add_argument("--json")
    d.add_argument("--chart", help="PNG chart of the rows (needs matplotlib)")
    n = sub.add_parser("annotate", help="add A100 predictions to a results file's decode rows")
    n.add_argument("results", help="a benchmarks/results/*.json file")
    n.add_argument("--out", help="write here instead of in place")
    n.add_argument("--chart", help="also draw the decode chart (PNG; needs matplotlib)")
    f = sub.add_parser("prefill", help="model rows for a sparse_mla_prefill results file: "
                       "H200 error of ours and upstream's kernel, A100 predictions of both")
    f.add_argument("--measured", required=True, help="a benchmarks/results/*.json file")
    f.add_argument("--json")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(f"{PROG}: TRITON_INTERPRET is set: the model compiles real kernels; unset it",
              file=sys.stderr)
        return 2
    try:
        return {"counts": _counts, "validate": _validate, "decode": _decode,
                "annotate": _annotate, "prefill": _prefill}[a.cmd](a)
    except ModelError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
