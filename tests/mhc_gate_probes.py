"""Run in a subprocess by tests/test_mhc_gate.py (CUDA_VISIBLE_DEVICES="", PYTHONPATH=build/patched,
no TRITON_INTERPRET): builds the mHC gate must reject.

    pdl     upstream's fused post + pre kernel traced with PDL on (as on 9.0+) for sm_80: its
            griddepcontrol instructions do not exist below sm_90
    smem    our tensor-core projection at a 128-token tile (80 KiB of shared memory): over
            the 48 KiB Ampere budget
Prints one JSON line: {probe: {ok, error, shared}}.
"""
import json
import sys

from vllm.deepinfer.mhc import gate


def main() -> int:
    tk, wu = gate._bind_tilelang()
    gate._TAP = gate._CubinTap()
    out = {}

    key = tk._MHC_FUSED_TILELANG_KERNEL.CompileKey(hidden_size=1024, hc_mult=4, n_splits=8,
                                                   tile_n=2, n_thr=128)
    tk.ENABLE_PDL = True
    try:
        r = gate.check(tk, wu, gate.GateCase("_MHC_FUSED_TILELANG_KERNEL", key, 1024), 80,
                       48 * 1024)
    finally:
        tk.ENABLE_PDL = False
    out["pdl"] = {"ok": r.ok, "error": r.error, "shared": r.shared}

    # Our tensor-core projection at a 128-token tile: 2 stages x (128x64 bf16 + 32x64 fp32)
    # + the 128x64 fp32 copy = 80 KiB of shared memory.
    from vllm.deepinfer.mhc import kernels
    big = kernels.TcKey(k=1024, n_out=24, block_m=128, n_splits=1)
    r = gate.check(tk, wu, gate.GateCase("prenorm_gemm_tc", big, 256), 80, 48 * 1024)
    out["smem"] = {"ok": r.ok, "error": r.error, "shared": r.shared}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
