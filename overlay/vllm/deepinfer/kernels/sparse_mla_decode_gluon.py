"""Phase 2 of the two-phase Ampere decode with 64 or 32 heads per program (Gluon, mma.sync).

The Triton phase 2 (kernels/sparse_mla_decode.py, ``Tile.predequant``) gives each program
16 heads of a token: Triton keeps Q in shared memory, and within 48 KiB per CTA on sm_80 a
wider head tile does not fit or spills, so each decoded key tile is read from L2 and staged
in shared memory four times per token (64 heads) and every HMMA's Q fragment is reloaded
from shared memory.

This kernel is written in Gluon (Triton's layout-explicit dialect, ``mma_v2`` = mma.sync),
which lets the tile be split the way the register file allows: H / 16 x 2 warps for H heads
per program, warp (c, g) holds heads [16 g, 16 g + 16) and dims [256 c, 256 c + 256). Each
warp keeps its Q slice in registers for the whole loop (64 registers) and owns the same
slice of the output (128 fp32 registers). Q.K^T is a batched mma over the two dim halves
(layout [2, H, keys], warps [2, H / 16, 1]) whose two partial score tiles are summed across
warps through shared memory; P.V then runs on each warp's own half of the dims. A key tile
is copied once per program into shared memory (cp.async, two stages) and read by all its
heads. Rows ``sm80-2p-h64`` / ``sm80-2p-h32`` of kernels/sparse_mla_decode.py select it
(``Tile.gluon_heads``); it is not the default (docs/sparse-mla-decode.md says why).

Inputs are phase 1's workspace rows and validity bytes (``_predequant_kernel``); outputs are
those of ``_sparse_mla_decode_kernel``: with SPLIT the (m, l, acc) partials for the
reduce kernel, else sink, normalization, optional inverse GPT-J RoPE and the bf16 store.
Same semantics: invalid rows get probability 0, a token with no valid key gives zeros.
The scores sum in another fp32 order than the Triton kernels (partial sums of the two dim
halves, then the scale); the tests hold it to the same fp32 reference bound.

Gluon has no interpreter: CPU tests compile it for sm_80/sm_86 (compile gate) and check
its selection; its numerics are tested on a GPU (tests/test_sparse_mla_decode_gluon.py).
"""
from __future__ import annotations

import triton

try:  # Gluon ships with Triton 3.6; the Triton phase 2 serves where it is missing.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only with an older Triton
    gluon = gl = async_copy = mma_v2 = None
    AVAILABLE = False

__all__ = ["AVAILABLE", "BLOCK_H", "BLOCK_N", "DSPLIT", "HEADS", "SIGNATURE", "attend_rows",
           "ctas_per_sm", "warps"]

# Heads per program (``H``): 64 (one program per token of a 64-head model) or 32 (two). The
# warps are H / 16 head groups of 16 rows (m16n8k16) times DSPLIT across the dims.
BLOCK_H = 64
HEADS = (32, 64)
# Warps per head group, each owning 512 / DSPLIT dims of Q and of the output. 2: Q 64 and
# output 128 registers per thread (about 253 in all, no spill). 4 (16 warps at 64 heads,
# <= 128 registers) spills and was 25-40% slower on the H200 (benchmarks/results/
# h200-2026-12-01-decode-h64-sweep-d4d1dd1.json: 108.3 vs 84.6 us at 64 tokens x 64 heads).
DSPLIT = 2
# Keys per tile: two stages of [16 keys, 512] bf16 (32 KiB) plus the cross-warp score sum's
# scratch ([DSPLIT, H, 16] fp32: 8 KiB at 64 heads, 4 at 32) make 40 (36) KiB on sm_80,
# inside the 48 KiB budget; 32 keys would need 72 KiB.
BLOCK_N = 16
# Q.K^T as 2 or 4 dots over slices of each half's dims (more independent mma chains) was
# timed by the H200 sweep at 5535209 (benchmarks/results/h200-2026-12-01-decode-h64-sweep-
# 5535209.json, 64 heads, top-k 512 + window 128, both phases): 1-5% slower than one dot at
# 16, 64 and 128 tokens with the chosen splits (64 tokens: 84.1 / 87.5 / 88.4 us); removed.


def warps(block_h: int) -> int:
    """Warps of a ``block_h``-head program."""
    return block_h // 16 * DSPLIT


def ctas_per_sm(block_h: int) -> int:
    """Resident programs per SM: the builds use about 255 registers per thread, so 8 warps
    (65,536 registers) per SM on sm_80, sm_86 and sm_90; shared memory (<= 40 KiB each)
    allows at least 2 on each."""
    return max(1, 8 // warps(block_h))


if AVAILABLE:
    @gluon.jit(do_not_specialize=["num_heads", "num_splits"])
    def _attend_rows_kernel(
        q_ptr, ws_ptr, valid_ptr, main_indptr_ptr, extra_indptr_ptr, sink_ptr, out_ptr,
        part_m_ptr, part_l_ptr, part_acc_ptr, pos_ptr, cs_ptr,
        q_stride0, q_stride1, out_stride0, out_stride1, cs_stride,
        qk_scale, num_heads, num_splits,
        HAS_EXTRA: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
        INV_ROPE: gl.constexpr, DSPLIT: gl.constexpr, H: gl.constexpr,
    ):
        """Grid (cdiv(heads, H), splits, tokens), H / 16 * DSPLIT warps. ``qk_scale`` =
        softmax scale * log2(e)."""
        N: gl.constexpr = 16
        D: gl.constexpr = 512
        HD: gl.constexpr = D // DSPLIT  # dims per slice
        NEG: gl.constexpr = -3.4028234663852886e38  # the decode kernels' NEG_LARGE
        L2E: gl.constexpr = 1.4426950408889634
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0],
                                                      warps_per_cta=[DSPLIT, H // 16, 1],
                                                      instr_shape=[1, 16, 8])
        DOT_A: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
        DOT_B: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        # Global loads: 8 bf16 (16 B) per thread along the dims.
        TD: gl.constexpr = HD // 8 if HD < 256 else 32
        LD: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // TD, TD],
                                            [DSPLIT, H // 16, 1], [2, 1, 0])
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0])
        S2: gl.constexpr = gl.SliceLayout(0, MMA)       # [H, N] summed scores
        ROW: gl.constexpr = gl.SliceLayout(1, S2)       # [H]
        COL: gl.constexpr = gl.SliceLayout(0, S2)       # [N]

        pid_h = gl.program_id(0)
        split = gl.program_id(1)
        tok = gl.program_id(2)

        main_start = gl.load(main_indptr_ptr + tok)
        main_len = gl.load(main_indptr_ptr + tok + 1) - main_start
        if HAS_EXTRA:
            extra_start = gl.load(extra_indptr_ptr + tok)
            total = main_len + gl.load(extra_indptr_ptr + tok + 1) - extra_start
        else:
            extra_start = 0
            total = main_len
        span = gl.cdiv(gl.cdiv(total, num_splits), N) * N
        lo = split * span
        hi = gl.minimum(lo + span, total)
        base = (main_start + extra_start).to(gl.int64)  # this token's first workspace row

        # Q [DSPLIT, H, HD]: slice c of head h is q[tok, h, HD c : HD c + HD].
        lc = gl.arange(0, DSPLIT, gl.SliceLayout(1, gl.SliceLayout(2, LD)))
        lh = gl.arange(0, H, gl.SliceLayout(0, gl.SliceLayout(2, LD)))
        ld = gl.arange(0, HD, gl.SliceLayout(0, gl.SliceLayout(1, LD)))
        heads_ld = pid_h * H + lh
        q_off = (lc[:, None, None] * HD + heads_ld[None, :, None].to(gl.int64) * q_stride1
                 + ld[None, None, :])
        q = gl.load(q_ptr + tok.to(gl.int64) * q_stride0 + q_off,
                    mask=(heads_ld < num_heads)[None, :, None], other=0.0)
        q = gl.convert_layout(q, DOT_A)

        # Key tiles [stage][slice, key, dim]; row j of the token is ws[base + j].
        kbuf = gl.allocate_shared_memory(gl.bfloat16, [2, DSPLIT, N, HD], SMEM)
        ln = gl.arange(0, N, gl.SliceLayout(0, gl.SliceLayout(2, LD)))
        k_off = lc[:, None, None] * HD + ln[None, :, None].to(gl.int64) * D + ld[None, None, :]
        rows = ws_ptr + base * D
        async_copy.async_copy_global_to_shared(kbuf.index(0), rows + lo * D + k_off,
                                               mask=((lo + ln) < hi)[None, :, None])
        async_copy.commit_group()

        vn = gl.arange(0, N, COL)
        m_i = gl.full([H], NEG, gl.float32, ROW)
        l_i = gl.zeros([H], gl.float32, ROW)
        acc = gl.zeros([DSPLIT, H, HD], gl.float32, MMA)
        it = 0
        for k0 in range(lo, hi, N):
            nxt = k0 + N
            # Masked lanes are zero-filled (cp.async src-size 0): rows past the list are
            # zeros, never stale or uninitialized shared memory (P = 0 times NaN is NaN).
            async_copy.async_copy_global_to_shared(kbuf.index((it + 1) % 2),
                                                   rows + nxt * D + k_off,
                                                   mask=((nxt + ln) < hi)[None, :, None])
            async_copy.commit_group()
            async_copy.wait_group(1)
            gl.thread_barrier()  # every thread's copies of this tile have landed
            kt = kbuf.index(it % 2)
            s3 = mma_v2(q, kt.permute([0, 2, 1]).load(DOT_B),
                        gl.zeros([DSPLIT, H, N], gl.float32, MMA))
            s = gl.sum(s3, axis=0) * qk_scale
            live = (k0 + vn) < hi
            valid = gl.load(valid_ptr + base + k0 + vn, mask=live, other=0) != 0
            s = gl.where(valid[None, :], s, NEG)
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[:, None])
            p = gl.where(valid[None, :], p, 0.0)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            p3 = gl.zeros([DSPLIT, H, N], gl.bfloat16, MMA) + gl.expand_dims(p.to(gl.bfloat16), 0)
            alpha3 = gl.expand_dims(gl.expand_dims(alpha, 1), 0)
            acc = mma_v2(gl.convert_layout(p3, DOT_A), kt.load(DOT_B), acc * alpha3)
            gl.thread_barrier()  # every warp is done with this stage before it is refilled
            it += 1
        async_copy.wait_group(0)

        oc = gl.arange(0, DSPLIT, gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
        oh = gl.arange(0, H, gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        od = gl.arange(0, HD, gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
        heads = pid_h * H + oh
        hmask3 = (heads < num_heads)[None, :, None]
        cols = oc[:, None, None] * HD + od[None, None, :]
        if SPLIT:
            hr = pid_h * H + gl.arange(0, H, ROW)
            ml = (tok * num_splits + split) * num_heads + hr
            # Every dim-slice warp holds m and l: the stores write equal values.
            gl.store(part_m_ptr + ml, m_i, mask=hr < num_heads)
            gl.store(part_l_ptr + ml, l_i, mask=hr < num_heads)
            ml3 = ((tok * num_splits + split) * num_heads + heads).to(gl.int64)
            gl.store(part_acc_ptr + ml3[None, :, None] * D + cols, acc, mask=hmask3)
        else:
            if HAS_SINK:
                hr = pid_h * H + gl.arange(0, H, ROW)
                sink = gl.load(sink_ptr + hr, mask=hr < num_heads, other=0.0).to(gl.float32)
                sink = sink * L2E
                m_f = gl.maximum(m_i, sink)
                a_f = gl.exp2(m_i - m_f)
                l_i = l_i * a_f + gl.exp2(sink - m_f)
                acc = acc * gl.expand_dims(gl.expand_dims(a_f, 1), 0)
            inv_l = gl.where(l_i > 0.0, 1.0 / gl.maximum(l_i, 1e-30), 0.0)
            o = acc * gl.expand_dims(gl.expand_dims(inv_l, 1), 0)
            if INV_ROPE:
                o = _inv_rope_gptj_slices(o, pos_ptr, cs_ptr, cs_stride, tok, DSPLIT, H)
            gl.store(out_ptr + tok.to(gl.int64) * out_stride0
                     + heads[None, :, None].to(gl.int64) * out_stride1 + cols,
                     o.to(gl.bfloat16), mask=hmask3)

    @gluon.jit
    def _inv_rope_gptj_slices(o, pos_ptr, cs_ptr, cs_stride, tok, DSPLIT: gl.constexpr,
                           H: gl.constexpr):
        """The decode kernel's inverse GPT-J RoPE (kernels/sparse_mla_decode.py
        ``_inv_rope_gptj``) on the [DSPLIT, H, 512 / DSPLIT] fp32 output slices: pair
        c * HD / 2 + p of the 256 is RoPE pair k = that - 224 when k >= 0. Each thread holds
        both columns of a pair (mma.sync accumulators hold column pairs), so the split and join
        stay in registers."""
        OL: gl.constexpr = o.type.layout
        HP: gl.constexpr = 256 // DSPLIT  # pairs per slice
        even, odd = gl.split(gl.reshape(o, [DSPLIT, H, HP, 2]))
        PL: gl.constexpr = even.type.layout
        pc = gl.arange(0, DSPLIT, gl.SliceLayout(1, gl.SliceLayout(2, PL)))
        pk = gl.arange(0, HP, gl.SliceLayout(0, gl.SliceLayout(1, PL)))
        k = pc[:, None, None] * HP + pk[None, None, :] - 224
        is_rope = k >= 0
        k = gl.maximum(k, 0)
        row = cs_ptr + gl.load(pos_ptr + tok).to(gl.int64) * cs_stride
        cos = gl.load(row + k, mask=is_rope, other=1.0).to(gl.float32)
        sin = gl.load(row + 32 + k, mask=is_rope, other=0.0).to(gl.float32)
        o = gl.reshape(gl.join(even * cos + odd * sin, odd * cos - even * sin),
                       [DSPLIT, H, 512 // DSPLIT])
        return gl.convert_layout(o, OL)  # the same placement: no data moves
else:  # pragma: no cover
    _attend_rows_kernel = None

# Compile-gate and model signature (pointer dtypes as the launcher passes them).
SIGNATURE = {
    "q_ptr": "*bf16", "ws_ptr": "*bf16", "valid_ptr": "*u8", "main_indptr_ptr": "*i32",
    "extra_indptr_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16", "part_m_ptr": "*fp32",
    "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "pos_ptr": "*i64", "cs_ptr": "*fp32",
    **{k: "i32" for k in ("q_stride0", "q_stride1", "out_stride0", "out_stride1", "cs_stride")},
    "qk_scale": "fp32", "num_heads": "i32", "num_splits": "i32",
    **{k: "constexpr" for k in ("HAS_EXTRA", "HAS_SINK", "SPLIT", "INV_ROPE", "DSPLIT", "H")},
}


def attend_rows(grid, q, ws, valid, main_indptr, extra_indptr, sink, out, part_m, part_l,
                    part_acc, pos, cs, cs_stride, qk_scale, heads, num_splits, *, has_extra,
                    has_sink, split, inv_rope, dsplit=None, block_h=None):
    """Launch the kernel (arguments as the Triton phase 2's; the caller validated them)."""
    _attend_rows_kernel[grid](
        q, ws, valid, main_indptr, extra_indptr, sink, out, part_m, part_l, part_acc, pos, cs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cs_stride,
        qk_scale, heads, num_splits,
        HAS_EXTRA=has_extra, HAS_SINK=has_sink, SPLIT=split, INV_ROPE=inv_rope,
        DSPLIT=dsplit or DSPLIT, H=block_h or BLOCK_H,
        num_warps=(block_h or BLOCK_H) // 16 * (dsplit or DSPLIT))
