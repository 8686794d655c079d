"""A Triton-interpreter dot whose per-element summation order does not depend on the tile shape.

The interpreter runs ``tl.dot`` as numpy's matmul, and numpy's OpenBLAS picks its kernels
by CPU and by matrix shape: on an AVX2 machine (OpenBLAS core "Haswell") the same row and
column can sum in a different order in products of different shapes, a few ulps apart (the
candidate-logits tests failed so), while with the SSE3 kernels ("Prescott") they passed. A GPU's MMA sums each element in
the same order whatever the tile. Tests that compare two kernels tiling the same dot
differently bit for bit (the candidate-only indexer logits against the full kernel masked,
tests/test_candidate_logits.py) therefore patch the interpreter's dot with this one: fp32
products of the (fp16-widened) operands summed in k order, the same for every shape.
``setattr`` is pytest's ``monkeypatch.setattr`` or the builtin (a probe process).
"""
from __future__ import annotations


def patch(setattr) -> None:
    import numpy as np
    from triton.runtime import interpreter as itp

    builder = itp.InterpreterBuilder
    orig = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or d.data.dtype != np.float32:
            return orig(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_w, b_w = _widened(a), _widened(b)
        acc = d.data.astype(np.float32, copy=True)
        for k in range(a_w.shape[1]):
            acc = acc + a_w[:, k:k + 1] * b_w[k:k + 1, :]
        return itp.TensorHandle(acc, d.dtype.scalar)

    def _widened(h):
        import triton.language as tl
        x = h.data
        if h.dtype.primitive_bitwidth == 8 and h.dtype.is_floating():
            x = itp._convert_float(x, h.dtype, tl.float16, None).view(np.float16)
        elif h.dtype.scalar == tl.bfloat16:
            x = (x.astype(np.uint32) << 16).view(np.float32)
        return x.astype(np.float32)

    setattr(builder, "create_dot", create_dot)
