"""Run in a subprocess by test_compile_gate.py (no TRITON_INTERPRET): kernels the gate must reject."""
import sys

import triton
import triton.language as tl

from vllm.deepinfer import compile_gate


@triton.jit
def _fp8_probe(x_ptr, y_ptr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + o)
    tl.store(y_ptr + o, x.to(tl.float8e4nv, bitcast=True).to(tl.float32))


@triton.jit
def _big_dot_probe(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m = tl.arange(0, M)[:, None]
    n = tl.arange(0, N)[None, :]
    k = tl.arange(0, K)
    a = tl.load(a_ptr + m * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n)
    tl.store(c_ptr + m * N + n, tl.dot(a, b))


def main() -> int:
    fp8 = compile_gate.GateSpec("probe.fp8e4nv", _fp8_probe, {"x_ptr": "*u8", "y_ptr": "*fp32",
                                "BLOCK": "constexpr"}, {"BLOCK": 64}, ("sm80",), feature="probe")
    r80, r90 = compile_gate.check(fp8, 80, False), compile_gate.check(fp8, 90, False)
    assert not r80.ok and "fp8e4nv" in r80.error, r80
    assert r90.ok and r90.uses_fp8e4nv, r90
    big = compile_gate.GateSpec("probe.bigdot", _big_dot_probe,
                                {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "M": "constexpr",
                                 "N": "constexpr", "K": "constexpr"}, {"M": 128, "N": 256, "K": 256},
                                ("sm80",), feature="probe")
    r = compile_gate.check(big, 80, False)
    assert not r.ok and "budget" in r.error and r.shared > 48 * 1024, r
    print("probes ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
