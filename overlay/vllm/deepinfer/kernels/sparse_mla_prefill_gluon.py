"""Sparse MLA prefill for Hopper with producer and consumer warpgroups (Gluon, wgmma).

The Triton sm90 tile of kernels/sparse_mla_prefill.py runs every step of a key tile in the
same 8 warps: gather, Q.K^T (which both warpgroups compute whole: 1.5x the useful tensor
work), softmax, P.V. Its steps take turns and it reaches about 31% of the H200's bf16 matmul
rate (docs/sparse-mla-prefill.md). This kernel gives each step its own warps:

* work items (token, 64-head tile): one program owns 64 heads of one token (wgmma's M) at
  a time, one program per SM takes items p, p + programs, ... (``PERSISTENT``);
* a producer warpgroup gathers the token's key rows from the bf16 workspace with cp.async
  into four shared-memory buffers, two 64-key blocks x two 256-dim halves, and signals each
  buffer on an mbarrier when its copies land (``cp.async.mbarrier.arrive``);
* consumer warpgroup 0 takes the even key blocks, consumer 1 the odd ones: each computes its
  block's whole 64 x 64 score tile (Q.K^T over 512 dims, Q and K from shared memory), so no
  score is computed twice and the two blocks' wgmmas run side by side;
* the softmax max is chained through shared memory (WG0 publishes its running max, WG1
  folds in its block's and publishes the pair's max, WG0 rescales its P to it), so both
  warpgroups keep the same running max;
* each consumer owns half of the 512 output columns: WG0 accumulates P0.V0[:, :256] (P from
  registers) and P1.V1[:, :256] (WG1's P from shared memory), WG1 the other half
  (128 fp32 accumulator registers each);
* buffer reuse is signalled back to the producer by mbarriers; the softmax sums of the two
  consumers are added once, at the end.

The hand-off order (which warpgroup frees which half-buffer when) follows the one
FlashMLA's sm90 sparse prefill describes for the same 64-head x 64-key blocks (its
``csrc/sm90/prefill/sparse``); this is a separate implementation in Gluon over this
project's inputs: dense rows with lengths or ragged lists (as ``_sparse_mla_prefill_kernel``
takes them), entries < 0 or >= rows skipped, the per-head sink in the denominator, zeros
where the softmax sum is not positive, a 448- or 512-wide output.

Gluon has no interpreter and warp specialization needs sm_90: CPU tests compile it for
sm_90 (compile gate) and check its selection; its numerics are tested on a GPU
(tests/test_sparse_mla_prefill_gluon.py).
"""
from __future__ import annotations

import triton

try:  # Gluon ships with Triton 3.6; the Triton tile serves where it is missing.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared,
                                                                  mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only with an older Triton
    gluon = gl = async_copy = fence_async_shared = mbarrier = None
    warpgroup_mma = warpgroup_mma_wait = None
    AVAILABLE = False

__all__ = ["AVAILABLE", "BLOCK_H", "BLOCK_N", "NUM_WARPS", "SIGNATURE", "MAXNREG", "MIN_CC",
           "PERSISTENT", "attend", "gate_constexprs", "programs"]

# Heads per program: wgmma's M for one warpgroup. Fewer heads are masked rows.
BLOCK_H = 64
# Keys per block (one consumer's score tile is [64 heads, 64 keys]). Shared memory: Q
# [64, 512] bf16 64 KiB + two blocks of [64, 512] bf16 128 KiB + two P tiles [64, 64] bf16
# 16 KiB = 208 KiB of the 227 KiB an sm_90 block may have (the build: 214,872 B with the
# published maxima, the sums and the barriers), so no deeper ring fits.
BLOCK_N = 64
# Warps of the default partition (consumer warpgroup 0); the two workers (consumer 1 and
# the producer) add 4 each: 12 warps, 384 threads.
NUM_WARPS = 4
# Register budget: 65,536 per SM / 384 threads = 170, rounded down to the 8-register
# granularity of setmaxnreg. Consumer 1 gets CONSUMER_REGS, the producer PRODUCER_REGS and
# consumer 0 the rest: 168 * 3 - 216 - 48 = 240. A consumer holds a [64, 256] fp32
# accumulator (128 registers) and a [64, 64] fp32 score tile (32); consumer 0 also holds the
# next block's scores while its last P.V runs. The producer holds 4 row offsets per block.
# Read from the sm_90 SASS (Triton 3.6): consumer 1 uses up to 210 registers, consumer 0 up
# to 237, the producer 42, no spills; 224 / 40 (consumer 0: 240) spills 1 value in consumer 1
# and 1 in the producer.
MAXNREG = 168
CONSUMER_REGS = 216
PRODUCER_REGS = 48
# Warp specialization and wgmma: sm_90 and later (the kernel is built for sm_90a).
MIN_CC = 90
# One program per SM looping over work items (token, 64-head tile), so the next item's Q
# and first key blocks load while this item's last P.V and epilogue run; False: one program
# per item. H200 sweep at 7ee19c4 (benchmarks/results/h200-2026-12-01-sweep-prefill-gws-
# 7ee19c4.json): 4-5% faster at 2048 new tokens after 64K (438 vs 458 us at 64 heads, 845
# vs 892 at 128), 3% with 208-key lists (249 vs 256), 2% slower at 512 tokens with top-k
# 8192 (1018 vs 1001: 512 items on 132 SMs leave the same last round either way).
PERSISTENT = True

if AVAILABLE:
    @gluon.jit
    def _key_list(ptr_ptr, tok, idx_stride0, width, DENSE: gl.constexpr):
        """(first index entry, key count) of token ``tok``'s list (as the Triton kernel's
        ``_key_list``)."""
        if DENSE:
            start = tok * idx_stride0
            n = gl.minimum(gl.maximum(gl.load(ptr_ptr + tok), 0), width).to(gl.int32)
        else:
            start = gl.load(ptr_ptr + tok).to(gl.int64)
            n = (gl.load(ptr_ptr + tok + 1) - start).to(gl.int32)
        return start, n

    @gluon.jit
    def _block_slots(idx_ptr, start, k0, n, num_rows, N: gl.constexpr, L: gl.constexpr):
        """Workspace rows [N] (layout L) of keys k0 .. k0 + N of the list and their validity
        (inside the list, 0 <= row < num_rows)."""
        j = k0 + gl.arange(0, N, L)
        slot = gl.load(idx_ptr + start + j, mask=j < n, other=-1)
        return slot, (slot >= 0) & (slot < num_rows)

    @gluon.jit
    def _block_valid(idx_ptr, start, k0, n, num_rows, N: gl.constexpr, COL: gl.constexpr):
        """Validity [N] (layout COL) of keys k0 .. k0 + N of the list."""
        _, ok = _block_slots(idx_ptr, start, k0, n, num_rows, N, COL)
        return ok

    @gluon.jit
    def _opaque_zero(x):
        """0, as a value the compiler cannot see through (one mov per call). A shared-memory
        buffer index built from it is recomputed where it is used, so the wgmma descriptors of
        the loop are not all hoisted out of it: 76 of them per iteration, which overflow the
        uniform registers and then spill (seen in the sm_90 SASS before this)."""
        return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _block_rows(idx_ptr, start, k0, n, num_rows, kv_stride0, RL: gl.constexpr):
        """Row offsets (elements) and validity [64] (layout RL) of keys k0 .. k0 + 64 of the
        list; invalid keys point at row 0 and are not copied."""
        slot, ok = _block_slots(idx_ptr, start, k0, n, num_rows, 64, RL)
        return gl.where(ok, slot, 0).to(gl.int64) * kv_stride0, ok

    @gluon.jit
    def _copy_half(buf, kv_ptr, off, ok, col0, LD: gl.constexpr):
        """cp.async dims [col0, col0 + 256) of 64 key rows into ``buf`` [64, 256] (invalid
        rows: zeros, cp.async's src-size 0)."""
        cols = col0 + gl.arange(0, 256, gl.SliceLayout(0, LD))
        rows = gl.multiple_of(kv_ptr + off, 16)
        async_copy.async_copy_global_to_shared(buf, rows[:, None] + cols[None, :],
                                               mask=ok[:, None])

    @gluon.jit
    def _producer(q_ptr, kv_ptr, idx_ptr, ptr_ptr, q_stride0, q_stride1, kv_stride0,
                  idx_stride0, num_rows, num_heads, head_tiles, num_tokens, width, q_smem,
                  k_smem, bars, DENSE: gl.constexpr):
        """For each work item (token, 64-head tile) of this program: gather Q once the
        consumers are done with the previous item's, then each pair of key blocks into the
        four half-buffers."""
        H: gl.constexpr = 64
        N: gl.constexpr = 64
        HD: gl.constexpr = 256
        # 8 bf16 (16 B) per copy; 8 threads cover 128 B of a row, a warp 4 rows: each thread
        # copies 4 rows x 4 vectors of a half-buffer and keeps 4 row offsets per block.
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        RL: gl.constexpr = gl.SliceLayout(1, LD)
        g = 0  # key-block pairs this program has gathered (the buffer barriers' phases)
        it = 0  # work items (the Q barriers' phases)
        for w in range(gl.program_id(0), num_tokens * head_tiles, gl.num_programs(0)):
            tok = (w // head_tiles).to(gl.int64)
            heads = (w % head_tiles) * H + gl.arange(0, H, RL)
            q_off = tok * q_stride0 + heads.to(gl.int64) * q_stride1
            hmask = heads < num_heads
            mbarrier.wait(bars.index(15), (it & 1) ^ 1)  # both consumers done with Q
            _copy_half(q_smem.index(0), q_ptr, q_off, hmask, 0, LD)
            _copy_half(q_smem.index(1), q_ptr, q_off, hmask, HD, LD)
            async_copy.mbarrier_arrive(bars.index(0), increment_count=False)

            start, n = _key_list(ptr_ptr, tok, idx_stride0, width, DENSE)
            pairs = gl.cdiv(n, 2 * N)
            for pair in range(pairs):
                ph = (g + pair) & 1
                # Both blocks' rows first: the index loads are not behind the buffer waits.
                off0, ok0 = _block_rows(idx_ptr, start, pair * 2 * N, n, num_rows, kv_stride0,
                                        RL)
                off1, ok1 = _block_rows(idx_ptr, start, pair * 2 * N + N, n, num_rows,
                                        kv_stride0, RL)
                # Half-buffer b = 2 * block + half; ready barrier 1 + b, free barrier 5 + b.
                # Filled in the order the consumers free them: block 0's left half (WG0,
                # after its first P.V), block 1's right half and block 0's right half (WG1,
                # after its two P.V), block 1's left half (WG0, last).
                mbarrier.wait(bars.index(5 + 0), ph ^ 1)
                _copy_half(k_smem.index(0), kv_ptr, off0, ok0, 0, LD)
                async_copy.mbarrier_arrive(bars.index(1 + 0), increment_count=False)
                mbarrier.wait(bars.index(5 + 3), ph ^ 1)
                _copy_half(k_smem.index(3), kv_ptr, off1, ok1, HD, LD)
                async_copy.mbarrier_arrive(bars.index(1 + 3), increment_count=False)
                mbarrier.wait(bars.index(5 + 1), ph ^ 1)
                _copy_half(k_smem.index(1), kv_ptr, off0, ok0, HD, LD)
                async_copy.mbarrier_arrive(bars.index(1 + 1), increment_count=False)
                mbarrier.wait(bars.index(5 + 2), ph ^ 1)
                _copy_half(k_smem.index(2), kv_ptr, off1, ok1, 0, LD)
                async_copy.mbarrier_arrive(bars.index(1 + 2), increment_count=False)
            g += pairs
            it += 1

    @gluon.jit
    def _epilogue(o, m_run, l_run, l_smem, bars, w, it, sink_ptr, out_ptr, out_stride0,
                  out_stride1, num_heads, head_tiles, WG: gl.constexpr, HAS_SINK: gl.constexpr,
                  OUT_D: gl.constexpr, ACC_O: gl.constexpr):
        """Add the other consumer's softmax sum, apply the sink and store this consumer's
        256 output columns of work item ``w`` (this program's ``it``-th). The sums pass
        through a buffer per item parity: an item without keys reaches its epilogue
        straight after the previous one's, while the other consumer may still read that
        one's sum."""
        H: gl.constexpr = 64
        HD: gl.constexpr = 256
        ROW: gl.constexpr = gl.SliceLayout(1, ACC_O)
        L2E: gl.constexpr = 1.4426950408889634
        l_smem.index(2 * (it & 1) + WG).store(l_run)
        mbarrier.arrive(bars.index(13 + WG), count=1)
        mbarrier.wait(bars.index(14 - WG), it & 1)
        l_run = l_run + l_smem.index(2 * (it & 1) + 1 - WG).load(ROW)

        tok = (w // head_tiles).to(gl.int64)
        heads = (w % head_tiles) * H + gl.arange(0, H, ROW)
        hmask = heads < num_heads
        if HAS_SINK:
            sink = gl.load(sink_ptr + heads, mask=hmask, other=0.0).to(gl.float32) * L2E
            m_f = gl.maximum(m_run, sink)
            alpha = gl.exp2(m_run - m_f)
            l_f = l_run * alpha + gl.exp2(sink - m_f)
            factor = alpha / gl.maximum(l_f, 1.0e-30)
        else:
            l_f = l_run
            factor = 1.0 / gl.maximum(l_f, 1.0e-30)
        factor = gl.where(l_f > 0.0, factor, 0.0)
        o = o * factor[:, None]
        o = gl.where((l_f > 0.0)[:, None], o, 0.0)
        cols = WG * HD + gl.arange(0, HD, gl.SliceLayout(0, ACC_O))
        rows = out_ptr + tok * out_stride0 + heads.to(gl.int64) * out_stride1
        gl.store(rows[:, None] + cols[None, :], o.to(gl.bfloat16),
                 mask=hmask[:, None] & (cols[None, :] < OUT_D))

    @gluon.jit
    def _softmax_step(s, valid, m_ref, m_run, l_run, o, qk_scale, ACC_O: gl.constexpr):
        """Mask and scale the block's scores, take the new running max m_new = max(m_ref,
        block max) and return (p, m_new, l_run, o) with l_run and o rescaled to m_new."""
        NEG: gl.constexpr = -3.4028234663852886e38  # the Triton kernel's NEG_LARGE
        s = gl.where(valid[None, :], s * qk_scale, NEG)
        m_new = gl.maximum(m_ref, gl.max(s, axis=1))
        alpha = gl.exp2(m_run - m_new)
        p = gl.where(valid[None, :], gl.exp2(s - m_new[:, None]), 0.0)
        l_run = l_run * alpha + gl.sum(p, axis=1)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, ACC_O))[:, None]
        return p, m_new, l_run, o

    @gluon.jit
    def _consumer(idx_ptr, ptr_ptr, sink_ptr, out_ptr, idx_stride0, out_stride0, out_stride1,
                  num_rows, num_heads, head_tiles, num_tokens, width, qk_scale, q_smem, k_smem,
                  p_smem, m_smem, l_smem, bars, WG: gl.constexpr, DENSE: gl.constexpr,
                  HAS_SINK: gl.constexpr, OUT_D: gl.constexpr):
        """Consumer warpgroup WG (0: even key blocks, output columns [0, 256); 1: odd
        blocks, columns [256, 512)) over this program's work items. Barriers as
        ``_prefill_ws_kernel`` numbers them; the buffer barriers' phases follow the count
        of key-block pairs ``g`` this program has run, the per-item ones the item count."""
        H: gl.constexpr = 64
        N: gl.constexpr = 64
        HD: gl.constexpr = 256
        NEG: gl.constexpr = -3.4028234663852886e38
        ACC_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, N, 16])
        ACC_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HD, 16])
        P_A: gl.constexpr = gl.DotOperandLayout(0, ACC_O, 2)
        ROW: gl.constexpr = gl.SliceLayout(1, ACC_S)
        COL: gl.constexpr = gl.SliceLayout(0, ACC_S)
        OROW: gl.constexpr = gl.SliceLayout(1, ACC_O)

        g = 0
        it = 0
        for w in range(gl.program_id(0), num_tokens * head_tiles, gl.num_programs(0)):
            tok = (w // head_tiles).to(gl.int64)
            start, n = _key_list(ptr_ptr, tok, idx_stride0, width, DENSE)
            pairs = gl.cdiv(n, 2 * N)
            m_run = gl.full([H], NEG, gl.float32, ROW)
            l_run = gl.zeros([H], gl.float32, ROW)
            o = gl.zeros([H, HD], gl.float32, ACC_O)
            mbarrier.wait(bars.index(0), it & 1)  # this item's Q landed
            if WG == 0:
                # WG0 computes each next block's scores at the end of the pair before it
                # (its left half first: the producer refills that buffer first), so they
                # overlap the pair's last P.V.
                s = gl.zeros([H, N], gl.float32, ACC_S)
                valid = gl.zeros([N], gl.int1, COL)
                if pairs > 0:
                    z = _opaque_zero(w)
                    mbarrier.wait(bars.index(1), g & 1)
                    mbarrier.wait(bars.index(2), g & 1)
                    sa = warpgroup_mma(q_smem.index(z), k_smem.index(z).permute((1, 0)), s,
                                       use_acc=False, is_async=True)
                    sa = warpgroup_mma(q_smem.index(z + 1), k_smem.index(z + 1).permute((1, 0)),
                                       sa, is_async=True)
                    valid = _block_valid(idx_ptr, start, 0, n, num_rows, N, COL)
                    s = warpgroup_mma_wait(0, deps=[sa])
                for pair in range(pairs):
                    ph = (g + pair) & 1
                    z = _opaque_zero(pair)
                    p, m_new, l_run, o = _softmax_step(s, valid, m_run, m_run, l_run, o,
                                                       qk_scale, ACC_O)
                    m_smem.index(0).store(m_new)
                    mbarrier.arrive(bars.index(9), count=1)  # WG0's max is published
                    # P0 . V0[:, :256] from registers.
                    o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_A),
                                      k_smem.index(z), o, is_async=True)
                    o = warpgroup_mma_wait(0, deps=[o])
                    mbarrier.arrive(bars.index(5 + 0), count=1)  # block 0, left half: free
                    mbarrier.wait(bars.index(10), ph)  # the pair's max (WG1 folded its in)
                    m_pair = m_smem.index(1).load(ROW)
                    beta = gl.exp2(m_new - m_pair)
                    p_smem.index(z).store((p * beta[:, None]).to(gl.bfloat16))
                    fence_async_shared()
                    mbarrier.arrive(bars.index(11), count=1)  # P0 (at the pair's max) shared
                    l_run = l_run * beta
                    o = o * gl.convert_layout(beta, OROW)[:, None]
                    m_run = m_pair
                    mbarrier.wait(bars.index(12), ph)  # WG1's P1
                    oa = warpgroup_mma(p_smem.index(z + 1), k_smem.index(z + 2), o,
                                       is_async=True)
                    if pair + 1 < pairs:
                        mbarrier.wait(bars.index(1), ph ^ 1)
                        sa = warpgroup_mma(q_smem.index(z), k_smem.index(z).permute((1, 0)),
                                           gl.zeros([H, N], gl.float32, ACC_S), use_acc=False,
                                           is_async=True)
                        valid = _block_valid(idx_ptr, start, (2 * pair + 2) * N, n, num_rows,
                                             N, COL)
                        o = warpgroup_mma_wait(1, deps=[oa])
                        mbarrier.arrive(bars.index(5 + 2), count=1)  # block 1, left: free
                        mbarrier.wait(bars.index(2), ph ^ 1)
                        sa = warpgroup_mma(q_smem.index(z + 1),
                                           k_smem.index(z + 1).permute((1, 0)), sa,
                                           is_async=True)
                        s = warpgroup_mma_wait(0, deps=[sa])
                    else:
                        o = warpgroup_mma_wait(0, deps=[oa])
                        mbarrier.arrive(bars.index(5 + 2), count=1)
            else:
                for pair in range(pairs):
                    ph = (g + pair) & 1
                    z = _opaque_zero(pair)
                    # Right half first: WG1 frees it before its left half comes back.
                    mbarrier.wait(bars.index(4), ph)
                    sa = warpgroup_mma(q_smem.index(z + 1), k_smem.index(z + 3).permute((1, 0)),
                                       gl.zeros([H, N], gl.float32, ACC_S), use_acc=False,
                                       is_async=True)
                    mbarrier.wait(bars.index(3), ph)
                    sa = warpgroup_mma(q_smem.index(z), k_smem.index(z + 2).permute((1, 0)), sa,
                                       is_async=True)
                    valid = _block_valid(idx_ptr, start, (2 * pair + 1) * N, n, num_rows, N,
                                         COL)
                    s = warpgroup_mma_wait(0, deps=[sa])
                    mbarrier.wait(bars.index(9), ph)  # WG0's max
                    p, m_new, l_run, o = _softmax_step(s, valid, m_smem.index(0).load(ROW),
                                                       m_run, l_run, o, qk_scale, ACC_O)
                    m_smem.index(1).store(m_new)
                    mbarrier.arrive(bars.index(10), count=1)  # the pair's max is published
                    o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_A),
                                      k_smem.index(z + 3), o, is_async=True)
                    p_smem.index(z + 1).store(p.to(gl.bfloat16))
                    fence_async_shared()
                    mbarrier.arrive(bars.index(12), count=1)  # P1 is shared
                    mbarrier.wait(bars.index(11), ph)  # WG0's P0
                    o = warpgroup_mma(p_smem.index(z), k_smem.index(z + 1), o, is_async=True)
                    o = warpgroup_mma_wait(1, deps=[o])
                    mbarrier.arrive(bars.index(5 + 3), count=1)  # block 1, right half: free
                    o = warpgroup_mma_wait(0, deps=[o])
                    mbarrier.arrive(bars.index(5 + 1), count=1)  # block 0, right half: free
                    m_run = m_new
            # Every Q.K^T of this item is done: the producer may load the next item's Q
            # while this one's epilogue runs.
            mbarrier.arrive(bars.index(15), count=1)
            _epilogue(o, gl.convert_layout(m_run, OROW), gl.convert_layout(l_run, OROW),
                      l_smem, bars, w, it, sink_ptr, out_ptr, out_stride0, out_stride1,
                      num_heads, head_tiles, WG, HAS_SINK, OUT_D, ACC_O)
            g += pairs
            it += 1

    @gluon.jit
    def _consumer1(q_ptr, kv_ptr, idx_ptr, ptr_ptr, sink_ptr, out_ptr, q_stride0, q_stride1,
                   kv_stride0, idx_stride0, out_stride0, out_stride1, num_rows, num_heads,
                   head_tiles, num_tokens, width, qk_scale, q_smem, k_smem, p_smem, m_smem,
                   l_smem, bars, DENSE: gl.constexpr, HAS_SINK: gl.constexpr,
                   OUT_D: gl.constexpr):
        _consumer(idx_ptr, ptr_ptr, sink_ptr, out_ptr, idx_stride0, out_stride0, out_stride1,
                  num_rows, num_heads, head_tiles, num_tokens, width, qk_scale, q_smem, k_smem,
                  p_smem, m_smem, l_smem, bars, 1, DENSE, HAS_SINK, OUT_D)

    @gluon.jit
    def _producer_part(q_ptr, kv_ptr, idx_ptr, ptr_ptr, sink_ptr, out_ptr, q_stride0,
                       q_stride1, kv_stride0, idx_stride0, out_stride0, out_stride1, num_rows,
                       num_heads, head_tiles, num_tokens, width, qk_scale, q_smem, k_smem,
                       p_smem, m_smem, l_smem, bars, DENSE: gl.constexpr,
                       HAS_SINK: gl.constexpr, OUT_D: gl.constexpr):
        _producer(q_ptr, kv_ptr, idx_ptr, ptr_ptr, q_stride0, q_stride1, kv_stride0,
                  idx_stride0, num_rows, num_heads, head_tiles, num_tokens, width, q_smem,
                  k_smem, bars, DENSE)

    @gluon.jit(do_not_specialize=["num_rows", "num_heads", "head_tiles", "num_tokens"])
    def _prefill_ws_kernel(
        q_ptr, kv_ptr, idx_ptr, ptr_ptr, sink_ptr, out_ptr,
        q_stride0, q_stride1, kv_stride0, idx_stride0, out_stride0, out_stride1,
        num_rows, num_heads, head_tiles, num_tokens, width, qk_scale,
        DENSE: gl.constexpr, HAS_SINK: gl.constexpr, OUT_D: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """Grid (programs,), 4 + 4 + 4 warps: program p runs work items p, p + programs, ...
        of the num_tokens * head_tiles (token w // head_tiles, 64-head tile w % head_tiles).
        Arguments as ``_sparse_mla_prefill_kernel``'s (``qk_scale`` = softmax scale *
        log2(e))."""
        H: gl.constexpr = 64
        N: gl.constexpr = 64
        HD: gl.constexpr = 256
        QK_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                     rank=2)
        VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        # Q halves [2][64, 256]; key half-buffers [block * 2 + half][64 keys, 256 dims];
        # the two shared P tiles; the published maxima and the final sums.
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, H, HD], QK_SMEM)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [4, N, HD], QK_SMEM)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, H, N], QK_SMEM)
        m_smem = gl.allocate_shared_memory(gl.float32, [2, H], VEC)
        l_smem = gl.allocate_shared_memory(gl.float32, [4, H], VEC)
        # Barriers: 0 Q ready; 1-4 half-buffer ready (cp.async arrivals of the producer's
        # 128 threads); 5-8 half-buffer free; 9 WG0's max; 10 the pair's max; 11 P0 shared;
        # 12 P1 shared; 13, 14 WG0's / WG1's final sum; 15 Q free (both consumers).
        bars = gl.allocate_shared_memory(gl.int64, [16, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(5):
            mbarrier.init(bars.index(i), count=128)
        for i in gl.static_range(5, 15):
            mbarrier.init(bars.index(i), count=1)
        mbarrier.init(bars.index(15), count=2)

        gl.warp_specialize([
            (_consumer, (idx_ptr, ptr_ptr, sink_ptr, out_ptr, idx_stride0, out_stride0,
                         out_stride1, num_rows, num_heads, head_tiles, num_tokens, width,
                         qk_scale, q_smem, k_smem, p_smem, m_smem, l_smem, bars, 0, DENSE,
                         HAS_SINK, OUT_D)),
            (_consumer1, (q_ptr, kv_ptr, idx_ptr, ptr_ptr, sink_ptr, out_ptr, q_stride0,
                          q_stride1, kv_stride0, idx_stride0, out_stride0, out_stride1,
                          num_rows, num_heads, head_tiles, num_tokens, width, qk_scale, q_smem,
                          k_smem, p_smem, m_smem, l_smem, bars, DENSE, HAS_SINK, OUT_D)),
            (_producer_part, (q_ptr, kv_ptr, idx_ptr, ptr_ptr, sink_ptr, out_ptr, q_stride0,
                              q_stride1, kv_stride0, idx_stride0, out_stride0, out_stride1,
                              num_rows, num_heads, head_tiles, num_tokens, width, qk_scale,
                              q_smem, k_smem, p_smem, m_smem, l_smem, bars, DENSE, HAS_SINK,
                              OUT_D)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
else:  # pragma: no cover
    _prefill_ws_kernel = None

# Compile-gate signature (pointer dtypes as the launcher passes them).
SIGNATURE = {
    "q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "ptr_ptr": "*i32",
    "sink_ptr": "*fp32", "out_ptr": "*bf16",
    **{k: "i32" for k in ("q_stride0", "q_stride1", "kv_stride0", "idx_stride0",
                          "out_stride0", "out_stride1", "num_rows", "num_heads", "head_tiles",
                          "num_tokens", "width")},
    "qk_scale": "fp32",
    **{k: "constexpr" for k in ("DENSE", "HAS_SINK", "OUT_D", "CONSUMER_REGS",
                                "PRODUCER_REGS")},
}


def gate_constexprs(dense: bool = True) -> dict:
    """Constexprs of a production launch (sink, 512-wide output)."""
    return dict(DENSE=dense, HAS_SINK=True, OUT_D=512, CONSUMER_REGS=CONSUMER_REGS,
                PRODUCER_REGS=PRODUCER_REGS)


def programs(items: int, sm_count: int, persistent: bool = PERSISTENT) -> int:
    """Grid size for ``items`` work items: one program per SM (each loops over its items),
    or one per item when not ``persistent``."""
    return max(1, min(items, sm_count)) if persistent else max(1, items)


def attend(q, kv, idx, ptr, sink, out, idx_stride0, width, qk_scale, *, dense, has_sink,
           sm_count, persistent=PERSISTENT):
    """Launch over every (token, 64-head tile) (the caller validated the arguments and
    checked 16-byte alignment of q, kv and out rows)."""
    tokens, heads = q.shape[0], q.shape[1]
    head_tiles = triton.cdiv(heads, BLOCK_H)
    grid = programs(tokens * head_tiles, sm_count, persistent)
    _prefill_ws_kernel[(grid,)](
        q, kv, idx, ptr, sink, out,
        q.stride(0), q.stride(1), kv.stride(0), idx_stride0, out.stride(0), out.stride(1),
        kv.shape[0], heads, head_tiles, tokens, width, qk_scale,
        DENSE=dense, HAS_SINK=has_sink, OUT_D=out.shape[2], CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=NUM_WARPS, maxnreg=MAXNREG)
    return out
