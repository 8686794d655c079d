"""bf16 arithmetic as a GPU does it, for kernels run under the Triton interpreter.

The interpreter stores bf16 as raw uint16 and runs numpy arithmetic and matmul on the bits,
and truncates fp32 -> bf16. ``patch(setattr)`` makes bf16 binary ops and dots compute in
fp32 and every fp32 -> bf16 conversion round to nearest even. ``setattr`` is pytest's
``monkeypatch.setattr`` (undone after the test) or the builtin (a probe process). Used by
tests/test_sparse_mla_decode.py and tests/vllm_probe_forward.py (upstream's bf16 prefill).
"""
from __future__ import annotations


def patch(setattr) -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as itp

    def to_f32(h):
        return (h.data.astype(np.uint32) << 16).view(np.float32)

    def to_bf16(x):
        b = np.asarray(x, dtype=np.float32).view(np.uint32)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.astype(np.uint16)

    builder = itp.InterpreterBuilder
    orig_binary, orig_dot, orig_trunc = builder.binary_op, builder.create_dot, builder.create_fp_trunc

    def fp_trunc(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return itp.TensorHandle(to_bf16(src.data), tl.bfloat16)
        return orig_trunc(self, src, dst_type)

    def binary_op(self, lhs, rhs, op):
        if lhs.dtype.scalar == tl.bfloat16 and op in (np.add, np.multiply, np.subtract, np.divide):
            return itp.TensorHandle(to_bf16(op(to_f32(lhs), to_f32(rhs))), tl.bfloat16)
        return orig_binary(self, lhs, rhs, op)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            return itp.TensorHandle(np.matmul(to_f32(a), to_f32(b)) + d.data, d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    setattr(builder, "binary_op", binary_op)
    setattr(builder, "create_dot", create_dot)
    setattr(builder, "create_fp_trunc", fp_trunc)
