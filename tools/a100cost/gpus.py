"""Per-SM throughputs, latencies and device figures of the A100 (40 and 80 GB) and the
H200, with their sources."""
from __future__ import annotations

import dataclasses


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
