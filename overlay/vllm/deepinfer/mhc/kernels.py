"""TileLang kernels of our own for mHC on Ampere (needs TileLang; vLLM is not imported).

``prenorm_gemm_tc``: the mHC projection on tensor cores. Upstream without DeepGEMM projects
with ``hc_prenorm_gemm_tilelang``, one thread per column and an FMA per (token, output),
one split; the fused post + pre kernel re-reads the fp32 projection weights once per
token. From ``TC_MIN_TOKENS`` tokens on, this kernel computes ``out[s] = x[:, Ks] @ fn[:,
Ks].T`` and ``sqrsum[s] = sum(x[:, Ks]^2)`` for k-slices ``Ks`` with TileLang's ``T.gemm``:
x (bf16, exact in tf32) and fn (fp32, rounded to tf32 by the MMA, as DeepGEMM's
``tf32_hc_prenorm_gemm`` does) meet in tf32 ``mma.sync`` (sm_80 m16n8k8), accumulating in
fp32. The split count is one of ``SPLIT_BUCKETS``; the epilogues are compiled for each
(vllm.deepinfer.mhc.warmup).
"""
# No ``from __future__ import annotations``: TileLang reads the kernel's tensor annotations.
import dataclasses
import functools

# Tile: BLOCK_M tokens x BLOCK_N (the 24 mix outputs, padded to an MMA multiple of 8 and a
# power of two for TileLang's warp partition) x BLOCK_K columns per pipeline stage. Shared
# memory per block: stages x (BLOCK_M x BLOCK_K bf16 + BLOCK_N x BLOCK_K fp32) + the fp32
# copy of the x tile = 2 x (4 KiB + 8 KiB) + 8 KiB = 32 KiB at 32x32x64, inside the 48 KiB
# Ampere budget (vllm.deepinfer.arch).
BLOCK_N = 32
BLOCK_K = 64
THREADS = 128   # 4 warps: TileLang splits the 32x32 accumulator across them
NUM_STAGES = 2  # double-buffered global->shared copies (cp.async on sm_80)
# Split buckets: upstream's compute_mhc_pre_num_splits returns 1, 4 or 16 (its epilogue
# warmup compiles those); 64 more, because a decode batch (one or two token tiles) has no
# other parallelism: 64 k-slices put 64-128 blocks on a 108-SM A100 where 16 would leave
# most SMs idle. The epilogue reads the splits in a serial loop (24 floats per split).
SPLIT_BUCKETS = (1, 4, 16, 64)


@dataclasses.dataclass(frozen=True)
class TcKey:
    k: int          # columns of x (hc_mult * hidden, or hidden for the embedding row)
    n_out: int      # projection outputs (24 at hc_mult 4)
    block_m: int
    n_splits: int


def block_m_for(num_tokens: int) -> int:
    """16 rows (one MMA height) up to 16 tokens, 32 up to 64, 64 above: the smallest tile
    that holds the batch, so small batches waste no MMA rows and large ones reuse each fn
    tile across more tokens."""
    return 16 if num_tokens <= 16 else 32 if num_tokens <= 64 else 64


def splits_for(num_tokens: int, k: int, block_m: int, sm_count: int) -> int:
    """The largest bucket whose grid (token tiles x splits) stays within about two waves of
    blocks on ``sm_count`` SMs and leaves each split at least four BLOCK_K steps."""
    m_tiles = -(-num_tokens // block_m)
    best = 1
    for s in SPLIT_BUCKETS:
        if m_tiles * s <= 2 * sm_count and k % (s * BLOCK_K) == 0 and k // s >= 4 * BLOCK_K:
            best = s
    return best


def key_for(num_tokens: int, k: int, n_out: int, sm_count: int) -> TcKey:
    bm = block_m_for(num_tokens)
    return TcKey(k=k, n_out=n_out, block_m=bm, n_splits=splits_for(num_tokens, k, bm, sm_count))


def supported(k: int, n_out: int) -> bool:
    return k % BLOCK_K == 0 and 0 < n_out <= BLOCK_N


@functools.cache
def _kernel_factory():
    import tilelang
    import tilelang.language as T

    @tilelang.jit(pass_configs={tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
                                tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True})
    def prenorm_gemm_tc(k: int, n_out: int, block_m: int, n_splits: int):
        m = T.dynamic("num_tokens")
        k_per_split = k // n_splits
        k_steps = k_per_split // BLOCK_K

        @T.prim_func
        def mhc_prenorm_gemm_tc(x: T.Tensor((m, k), T.bfloat16),
                                fn: T.Tensor((n_out, k), T.float32),
                 out: T.Tensor((n_splits, m, n_out), T.float32),
                 sqrsum: T.Tensor((n_splits, m), T.float32)):
            with T.Kernel(T.ceildiv(m, block_m), n_splits, threads=THREADS) as (bx, bs):
                x_s = T.alloc_shared((block_m, BLOCK_K), T.bfloat16)
                a_s = T.alloc_shared((block_m, BLOCK_K), T.float32)
                b_s = T.alloc_shared((BLOCK_N, BLOCK_K), T.float32)
                acc = T.alloc_fragment((block_m, BLOCK_N), T.float32)
                sq = T.alloc_fragment((block_m, BLOCK_K), T.float32)
                sq_row = T.alloc_fragment((block_m,), T.float32)
                T.clear(acc)
                T.clear(sq)
                k0 = bs * k_per_split
                for kk in T.Pipelined(k_steps, num_stages=NUM_STAGES):
                    T.copy(x[bx * block_m, k0 + kk * BLOCK_K], x_s)
                    T.copy(fn[0, k0 + kk * BLOCK_K], b_s)
                    for i, j in T.Parallel(block_m, BLOCK_K):
                        v = T.cast(x_s[i, j], T.float32)
                        a_s[i, j] = v
                        sq[i, j] += v * v
                    T.gemm(a_s, b_s, acc, transpose_B=True)
                T.reduce_sum(sq, sq_row, dim=1)
                for i, j in T.Parallel(block_m, BLOCK_N):
                    if bx * block_m + i < m and j < n_out:
                        out[bs, bx * block_m + i, j] = acc[i, j]
                for i in T.Parallel(block_m):
                    if bx * block_m + i < m:
                        sqrsum[bs, bx * block_m + i] = sq_row[i]

        return mhc_prenorm_gemm_tc

    return prenorm_gemm_tc


# Kernels built by compile_tc_many (TileLang's par_compile does not fill the JIT wrapper's own
# call cache), looked up first by compile_tc.
_BUILT: dict = {}


def compile_tc(key: TcKey):
    """The compiled kernel for ``key`` (TileLang caches builds on disk and in process)."""
    built = _BUILT.get(key)
    if built is not None:
        return built
    return _kernel_factory()(key.k, key.n_out, key.block_m, key.n_splits)


def compile_tc_many(keys, num_workers: int) -> None:
    """Build every key of ``keys`` (the JIT warmup): elaborated one after another, then
    lowered and compiled by TileLang's ``par_compile`` on ``num_workers`` threads, for the
    target of the surrounding ``tvm.target.Target`` context if any (worker threads do not
    see the caller's context), else the wrapper's own ("auto": the visible GPU)."""
    missing = [k for k in dict.fromkeys(keys) if k not in _BUILT]
    if num_workers < 2 or len(missing) < 2:
        for k in missing:
            compile_tc(k)
        return
    from tilelang import tvm
    from tilelang.jit import par_compile   # the module's function; tilelang.jit is the decorator
    jit = _kernel_factory()
    funcs = [jit.get_tir(k.k, k.n_out, k.block_m, k.n_splits) for k in missing]
    target = tvm.target.Target.current(allow_none=True) or jit.target
    built = par_compile(
        funcs, out_idx=jit.out_idx, execution_backend=jit.execution_backend, target=target,
        target_host=jit.target_host, verbose=jit.verbose, pass_configs=jit.pass_configs,
        compile_flags=jit.compile_flags, num_workers=num_workers)
    _BUILT.update(zip(missing, built, strict=True))


def prenorm_gemm_tc(x, fn, sm_count: int):
    """``(out [S, T, N], sqrsum [S, T])`` fp32 for x ``[T, K]`` bf16 and fn ``[N, K]`` fp32."""
    import torch
    num_tokens, k = x.shape
    key = key_for(num_tokens, k, fn.shape[0], sm_count)
    out = torch.empty(key.n_splits, num_tokens, fn.shape[0], dtype=torch.float32,
                      device=x.device)
    sqrsum = torch.empty(key.n_splits, num_tokens, dtype=torch.float32, device=x.device)
    if num_tokens:
        compile_tc(key)(x, fn, out, sqrsum)
    return out, sqrsum
