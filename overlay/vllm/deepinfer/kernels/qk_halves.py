"""One online-softmax step over a key tile with Q.K^T as two half-dim dots.

Shared by the two mma.sync tiles that take ``Tile.qk_halves``: phase 2 of the two-phase
Ampere decode (kernels/sparse_mla_decode.py) and the Ampere prefill tile
(kernels/sparse_mla_prefill.py). With 16 heads x 16 keys on 2 warps each warp owns one m16n8
score tile, so one Q.K^T over 512 dims is a chain of 32 dependent HMMAs through one
accumulator. Two dots over dims [0, 256) and [256, 512), each scaled before the sum (so
Triton does not fold one into the other's accumulator), are two independent chains that the
SASS interleaves; the output is kept in the two halves. Measured on the H200 in both modules'
tile comments and docs (docs/sparse-mla-decode.md, docs/sparse-mla-prefill.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["halves_start", "halves_step"]

# The kernels' finite "minus infinity" for masked scores (upstream's value; see
# sparse_mla_prefill.NEG_LARGE).
NEG_LARGE = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def halves_start(q_rows, hmask, DOT_FP32: tl.constexpr, BLOCK_H: tl.constexpr):
    """Q's two halves from the row pointers ``q_rows`` [BLOCK_H] (masked heads read 0) and the
    loop's initial state: (qa, qb, m_i, l_i, acc_a, acc_b)."""
    HD: tl.constexpr = 256
    hc = tl.arange(0, HD)
    qa = tl.load(q_rows[:, None] + hc[None, :], mask=hmask[:, None], other=0.0)
    qb = tl.load(q_rows[:, None] + HD + hc[None, :], mask=hmask[:, None], other=0.0)
    if DOT_FP32:
        qa = qa.to(tl.float32)
        qb = qb.to(tl.float32)
    return (qa, qb, tl.full((BLOCK_H,), NEG_LARGE, tl.float32), tl.zeros((BLOCK_H,), tl.float32),
            tl.zeros((BLOCK_H, HD), tl.float32), tl.zeros((BLOCK_H, HD), tl.float32))


@triton.jit
def halves_step(qa, qb, ka, kb, valid, m_i, l_i, acc_a, acc_b, qk_scale,
                DOT_FP32: tl.constexpr):
    """Scores of keys ``ka | kb`` ([BLOCK_N, 256] each; ``valid`` [BLOCK_N]) against
    ``qa | qb`` ([BLOCK_H, 256] each), masked, then the running max ``m_i``, sum ``l_i`` and
    the two output halves updated. ``qk_scale`` = softmax scale * log2(e). DOT_FP32: the
    interpreter's fp32 operands (its bf16 dots are wrong). Returns (m_i, l_i, acc_a, acc_b)."""
    if DOT_FP32:
        ka = ka.to(tl.float32)
        kb = kb.to(tl.float32)
    s = tl.dot(qa, tl.trans(ka)) * qk_scale + tl.dot(qb, tl.trans(kb)) * qk_scale
    s = tl.where(valid[None, :], s, NEG_LARGE)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    p = tl.where(valid[None, :], p, 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(ka.dtype)
    acc_a = tl.dot(p, ka, acc_a * alpha[:, None])
    acc_b = tl.dot(p, kb, acc_b * alpha[:, None])
    return m_new, l_i, acc_a, acc_b
