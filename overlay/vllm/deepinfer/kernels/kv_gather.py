"""Dequantize-and-gather of the paged 584-byte K cache (DeepSeek-V4, V4.1 off SM100).

``dequantize_and_gather_k_cache`` has the signature and semantics of upstream's
``dequantize_and_gather_k_cache_triton`` (vllm/models/deepseek_v41/common/ops/cache_utils.py)
for the 584-byte record: for request ``b`` and ``i < gather_len[b]`` (``seq_len[b]`` when
``gather_lens`` is None), token ``pos = seq_len - gather_len + i`` of the request's pages is
written to ``out[b, offset + i, :]`` as bf16 — NoPE dims ``e4m3 * 2^(scale_byte - 127)``,
RoPE dims copied bit for bit.

Design (docs/kv-gather-and-combiner.md):
* The work is flattened over all requests into tiles of ``tokens`` consecutive tokens of one
  request; a grid sized from the SM count walks the tiles (``for tile in range(pid, total,
  nprog)``). Each program computes every request's tile count and their prefix sum once
  (one vector load of the lengths), and finds a tile's request with one vector compare — no
  host sync, and ragged batches stay balanced (upstream gives every request the same number
  of workers).
* A tile is a [tokens, 8, 64] block: groups ``g < 7`` hold the 448 e4m3 bytes (8-byte
  vector loads feeding 16-byte bf16 stores in the same register layout), multiplied by the
  group's UE8M0 scale (one [tokens, 8] load, decoded by bit shift, ``fp8.ue8m0_to_f32``);
  the 64 RoPE values are copied as int16 bits. Stores go straight through ``out``'s strides;
  page, block-table and output offsets are int64.
* The product ``e4m3 * 2^k`` is exact in fp32 and rounded once to bf16, as upstream does
  (``x_f32 * exp2(byte - 127)`` then ``.to(bf16)``), so the outputs are bit-identical.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from vllm.deepinfer import arch, compile_gate, fp8
from vllm.deepinfer.kernels.checks import check, check_tensor
from vllm.deepinfer.kv_record import HEAD_DIM, RECORD_BYTES
from vllm.deepinfer.kv_record import TL_DATA_BYTES as _DATA  # 576 data bytes per record
from vllm.deepinfer.kv_record import TL_NOPE_DIM as _NOPE  # 448 e4m3 values, then bf16 RoPE
from vllm.deepinfer.kv_record import TL_NUM_SCALES as _GROUPS  # 7 UE8M0 groups of 64
from vllm.deepinfer.kv_record import TL_QUANT_BLOCK as _CHUNK  # 64 values per scale
from vllm.deepinfer.kv_record import TL_SCALE_BYTES as _SCALE  # 8 scale bytes (7 + pad)

__all__ = ["dequantize_and_gather_k_cache", "compile_keys", "GatherKey", "GatherTile", "TILES"]

# e4m3 decoders (the DECODE constexpr), all exact (tests/test_fp8.py, tests/test_kv_gather.py):
# fp8.e4m3_to_f32 ("int"), fp8.e4m3_to_f32_f16bits, fp8.e4m3_to_f32_e4b15, and the hardware
# conversion ("hw", sm_89+ only).
_DECODES = {"int": 0, "f16bits": 1, "e4b15": 2, "hw": 3}


@dataclasses.dataclass(frozen=True)
class GatherTile:
    # Tokens per tile (power of two): a tile moves tokens * 584 B in and tokens * 1 KiB out.
    tokens: int
    num_warps: int
    # Grid cap: programs = min(upper bound on tiles, programs_per_sm * SMs); each program
    # walks tiles pid, pid + programs, ... Several waves of resident programs keep the
    # wave-quantization loss small (<= ~11% for 4-16 resident CTAs per SM) while a program
    # still amortizes its prologue (the request lengths' prefix sum) over its tiles.
    programs_per_sm: int
    decode: str


# Measured on the H200 (benchmarks/results/h200-2026-11-29-tile-sweep.json, GPU time from
# CUDA graphs over input rings > 2x L2, 16K/48K/128K tokens): [16 tokens, 4 warps, 16
# programs/SM] was best or within 2% of best for both decoders — hardware cvt 11.7/28.2/65.8 us
# (53/66/75% of the 1 GiB copy bandwidth, 74/80/84% of a copy of the same bytes), e4b15
# 12.0/28.4/65.8 us. The previous rows ([16, 8, 32] hw; [8, 4, 32] f16bits) were 1-14% slower.
# [16, 8, 64] over 128 threads is 64 values per thread (eight 8-byte e4m3 loads, eight 16-byte
# bf16 stores), ~9.3 KB loaded per tile. Ampere decodes with fp8.e4m3_to_f32_e4b15 (bytes as
# Triton's fp8e4b15, exponent rebased by one multiply): on the H200 it beat f16bits by 5-12%
# and the integer unpack by 7-15% in this tile; fp8.e4m3_to_f32 spends ~13 integer ops and a
# quarter-rate int->float conversion per value. No Ampere GPU here: on an A100 (2.4x less
# bandwidth per SM-cycle than the H200) the decoder costs relatively less, not more.
_AMPERE_TILE = GatherTile(tokens=16, num_warps=4, programs_per_sm=16, decode="e4b15")
_HW_FP8_TILE = GatherTile(tokens=16, num_warps=4, programs_per_sm=16, decode="hw")
TILES: dict[str, GatherTile] = {
    "sm80": _AMPERE_TILE, "sm86": _AMPERE_TILE, "cpu": _AMPERE_TILE,
    "sm89": _HW_FP8_TILE, "sm90": _HW_FP8_TILE, "sm100": _HW_FP8_TILE,
}

# Requests handled by one launch, bucketed so only three request-vector widths compile.
# A larger batch is split into launches of at most the last bucket (requests are independent).
_REQ_BUCKETS = (16, 128, 1024)


# Not specialized: per-batch integers, and the metadata pointers, which the attention layers
# pass as slices of per-step tensors (``seq_lens[c0:c1]``, ``block_table[nd:][c0:c1]``) whose
# 16-byte alignment changes from chunk to chunk; vLLM's warmup compiles one binary per
# configuration, and a launch whose key differs would compile while serving
# (tests/test_warmup_coverage.py). They are read a few words per program: no vector loads lost.
@triton.jit(do_not_specialize=["num_reqs", "block_size", "offset", "bt_stride"],
            do_not_specialize_on_alignment=["seq_ptr", "gl_ptr", "bt_ptr"])
def _gather_kernel(out_ptr, out_s0, out_s1, cache_ptr, page_stride, seq_ptr, gl_ptr, bt_ptr,
                   bt_stride, num_reqs, block_size, offset,
                   TOKENS: tl.constexpr, BLOCK_R: tl.constexpr, HAS_GATHER_LENS: tl.constexpr,
                   DECODE: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # Every request's tile count and their inclusive prefix sum, once per program.
    r = tl.arange(0, BLOCK_R)
    seq = tl.load(seq_ptr + r, mask=r < num_reqs, other=0)
    if HAS_GATHER_LENS:
        glen = tl.load(gl_ptr + r, mask=r < num_reqs, other=0)
    else:
        glen = seq
    ntiles = (tl.maximum(glen, 0) + TOKENS - 1) // TOKENS
    cum = tl.cumsum(ntiles, 0)
    total = tl.sum(ntiles, 0)

    t = tl.arange(0, TOKENS)
    # A token's 512 values as [8, 64]: groups 0..6 the NoPE values (one scale each), group 7
    # the RoPE tail (one group wide).
    g3 = tl.arange(0, _GROUPS + 1)[None, :, None]
    # 8 contiguous values per thread: an 8-byte e4m3 load feeds one 16-byte bf16 store with
    # no register shuffle through shared memory between them.
    c3 = tl.max_contiguous(tl.arange(0, _CHUNK), 8)[None, None, :]
    c2 = tl.arange(0, _CHUNK)[None, :]
    g2 = tl.arange(0, _GROUPS + 1)[None, :]
    out16 = out_ptr.to(tl.pointer_type(tl.int16))
    for tile in range(pid, total, nprog):
        # Request of this tile: the number of requests whose tiles all lie below it.
        done = cum <= tile
        b = tl.sum(done.to(tl.int32), 0)
        first_tile = tl.sum(tl.where(done, ntiles, 0), 0)
        seq_b = tl.load(seq_ptr + b)
        if HAS_GATHER_LENS:
            gl_b = tl.load(gl_ptr + b)
        else:
            gl_b = seq_b
        i = (tile - first_tile) * TOKENS + t  # index in the request's gathered run
        tmask = i < gl_b
        pos = seq_b - gl_b + i
        blk = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + pos // block_size, mask=tmask, other=0)
        slot = pos % block_size
        page = cache_ptr + blk.to(tl.int64) * page_stride
        data = page + slot * _DATA
        scales = page + block_size * _DATA + slot * _SCALE  # after the page's data region
        row = out16 + b.to(tl.int64) * out_s0 + (offset + i).to(tl.int64) * out_s1

        # NoPE: groups 0..6 of the [TOKENS, 8, 64] tile.
        nmask = tmask[:, None, None] & (g3 < _GROUPS)
        x = tl.load(data[:, None, None] + g3 * _CHUNK + c3, mask=nmask, other=0)
        sb = tl.load(scales[:, None] + g2, mask=tmask[:, None] & (g2 < _GROUPS),
                     other=127)  # [TOKENS, 8]
        s = fp8.ue8m0_to_f32(sb)[:, :, None]
        if DECODE == 0:
            xf = fp8.e4m3_to_f32(x)
        elif DECODE == 1:
            xf = fp8.e4m3_to_f32_f16bits(x)
        elif DECODE == 2:
            xf = fp8.e4m3_to_f32_e4b15(x)
        else:
            xf = fp8.cvt_e4m3_to_f32(x, True)
        y = (xf * s).to(tl.bfloat16).to(tl.int16, bitcast=True)
        tl.store(row[:, None, None] + g3 * _CHUNK + c3, y, mask=nmask)

        # RoPE: 64 bf16 values after the NoPE bytes, copied as int16 bits.
        rope = (data + _NOPE).to(tl.pointer_type(tl.int16))
        rv = tl.load(rope[:, None] + c2, mask=tmask[:, None], other=0)
        tl.store(row[:, None] + _NOPE + c2, rv, mask=tmask[:, None])


# --------------------------------------------------------------------------- host side
def _req_bucket(num_reqs: int) -> int:
    for b in _REQ_BUCKETS:
        if num_reqs <= b:
            return b
    return _REQ_BUCKETS[-1]


_BF16, _U8, _I32 = (torch.bfloat16,), (torch.uint8,), (torch.int32,)


def _check_inputs(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset) -> None:
    """The launcher's checks (messages formatted only on failure, kernels/checks.py). Shapes
    and strides are read once per tensor (each ``stride()`` call costs host time)."""
    check_tensor(out, "out", _BF16, 3)
    dev = out.device
    osh, ost = out.shape, out.stride()
    check(osh[2] == HEAD_DIM and ost[2] == 1, "out",
          lambda: f"expected bf16 [num_reqs, tokens, {HEAD_DIM}] with a contiguous last dim, got "
          f"{tuple(osh)} strides {ost}")
    check_tensor(k_cache, "k_cache", _U8, 3, dev)
    ksh, kst = k_cache.shape, k_cache.stride()
    check(ksh[2] == RECORD_BYTES and kst[2] == 1 and (ksh[1] <= 1 or kst[1] == RECORD_BYTES)
          and block_size >= 1 and (ksh[0] <= 1 or kst[0] >= block_size * RECORD_BYTES),
          "k_cache", lambda: f"expected [num_blocks, block_size, {RECORD_BYTES}] (584-byte records "
          f"only) with contiguous pages of block_size={block_size} records, got shape "
          f"{tuple(ksh)} strides {kst}")
    # The 64 RoPE values are bf16 read in place: an odd page stride puts them at odd
    # addresses, which no GPU load can read (CUDA "misaligned address", seen on the H200).
    # vLLM's pages are multiples of 576 bytes.
    check(ksh[0] <= 1 or kst[0] % 2 == 0, "k_cache",
          lambda: f"page stride {kst[0]} bytes is odd: the bf16 RoPE values need 2-byte alignment")
    check_tensor(seq_lens, "seq_lens", _I32, 1, dev, True)
    num_reqs = seq_lens.shape[0]
    if gather_lens is not None:
        check_tensor(gather_lens, "gather_lens", _I32, 1, dev, True)
        check(gather_lens.shape[0] == num_reqs, "gather_lens",
              lambda: f"expected int32 [{num_reqs}], got {tuple(gather_lens.shape)}")
    check_tensor(block_table, "block_table", _I32, 2, dev)
    check(block_table.shape[0] >= num_reqs and block_table.stride(1) == 1, "block_table",
          lambda: f"expected int32 [>= {num_reqs}, max_blocks] with contiguous rows, got "
          f"{tuple(block_table.shape)} strides {block_table.stride()}")
    check(osh[0] >= num_reqs, "out", lambda: f"has {osh[0]} rows for {num_reqs} requests")
    check(0 <= offset <= osh[1], "offset", lambda: f"{offset} outside [0, {osh[1]}]")


def dequantize_and_gather_k_cache(
    out: torch.Tensor,            # [num_reqs, max_num_tokens, 512] bf16
    k_cache: torch.Tensor,        # [num_blocks, block_size, 584] uint8
    seq_lens: torch.Tensor,       # [num_reqs] int32
    gather_lens: torch.Tensor | None,  # [num_reqs] int32, None: the whole sequence
    block_table: torch.Tensor,    # [num_reqs, max_blocks_per_seq] int32
    block_size: int,
    offset: int,
    use_fnuz: bool = False,
    max_gather_len: int | None = None,
    *,
    variant: str | None = None,
    sm_count: int | None = None,
) -> None:
    """Upstream ``dequantize_and_gather_k_cache_triton`` for 584-byte records (see module doc).

    ``max_gather_len`` (a host-side bound on ``gather_lens``, as upstream takes it) only
    sizes the grid; without it the bound is ``out.shape[1] - offset``. ``variant`` picks the
    tile/decoder row (None: this process's variant; "cpu" behaves as "sm80"); ``sm_count``
    overrides the cached SM count of ``out``'s device.
    """
    if use_fnuz:
        raise NotImplementedError(
            "use_fnuz=True reads FNUZ e4m3 (ROCm gfx942 caches); vllm.deepinfer serves CUDA "
            "only — route this call to upstream vLLM")
    _check_inputs(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset)
    tile = TILES[arch.table_key(variant, TILES)]
    num_reqs = seq_lens.shape[0]
    cap = out.shape[1] - offset
    if max_gather_len is not None:
        cap = min(cap, max_gather_len)
    if num_reqs == 0 or cap <= 0:
        return
    sms = sm_count if sm_count is not None else arch.sm_count(out.device)
    step = _REQ_BUCKETS[-1]
    for r0 in range(0, num_reqs, step):
        r1 = min(num_reqs, r0 + step)
        n = r1 - r0
        # Views only when a batch needs several launches (a view costs ~1 us of host time).
        part = (lambda t: t) if n == num_reqs else (lambda t: t[r0:r1])
        grid = (max(1, min(n * triton.cdiv(cap, tile.tokens), tile.programs_per_sm * sms)),)
        _gather_kernel[grid](
            part(out), out.stride(0), out.stride(1), k_cache, k_cache.stride(0),
            part(seq_lens), part(gather_lens if gather_lens is not None else seq_lens),
            part(block_table), block_table.stride(0), n, block_size, offset,
            TOKENS=tile.tokens, BLOCK_R=_req_bucket(n), HAS_GATHER_LENS=gather_lens is not None,
            DECODE=_DECODES[tile.decode], num_warps=tile.num_warps, num_stages=1)


# --------------------------------------------------------------------------- warmup keys
@dataclasses.dataclass(frozen=True)
class GatherKey:
    """One compiled configuration of ``_gather_kernel`` (its constexprs and launch options)."""
    TOKENS: int
    BLOCK_R: int
    HAS_GATHER_LENS: bool
    DECODE: int
    num_warps: int

    def constexprs(self) -> dict:
        return {"TOKENS": self.TOKENS, "BLOCK_R": self.BLOCK_R,
                "HAS_GATHER_LENS": self.HAS_GATHER_LENS, "DECODE": self.DECODE}


def compile_keys(variant: str | None = None) -> list[GatherKey]:
    """Every configuration a model can launch on ``variant``: three request buckets, with and
    without ``gather_lens`` (compressed gathers pass None). Block size, offset, strides and
    request count are runtime arguments, so nothing else multiplies the keys."""
    tile = TILES[arch.table_key(variant, TILES)]
    return [GatherKey(tile.tokens, br, has, _DECODES[tile.decode], tile.num_warps)
            for br in _REQ_BUCKETS for has in (True, False)]


_SIGNATURE = {
    "out_ptr": "*bf16", "out_s0": "i32", "out_s1": "i32", "cache_ptr": "*u8",
    "page_stride": "i32", "seq_ptr": "*i32", "gl_ptr": "*i32", "bt_ptr": "*i32",
    "bt_stride": "i32", "num_reqs": "i32", "block_size": "i32", "offset": "i32",
    "TOKENS": "constexpr", "BLOCK_R": "constexpr", "HAS_GATHER_LENS": "constexpr",
    "DECODE": "constexpr",
}


def _register() -> None:
    # One set of specs per distinct tile of the table, compiled for the variants that use it.
    by_tile: dict[GatherTile, list[str]] = {}
    for v, tile in TILES.items():
        if v != "cpu":
            by_tile.setdefault(tile, []).append(v)
    for tile, variants in by_tile.items():
        gate_variants = tuple(v for v in variants if v != "sm86") or ("sm80",)  # sm80 covers sm_86
        tag = f"T{tile.tokens}w{tile.num_warps}.{tile.decode}"
        for br in _REQ_BUCKETS:
            for has in (True, False):
                compile_gate.register(compile_gate.GateSpec(
                    name=f"kv_gather.{tag}.R{br}.{'gl' if has else 'nogl'}",
                    kernel=_gather_kernel, signature=_SIGNATURE,
                    constexprs={"TOKENS": tile.tokens, "BLOCK_R": br, "HAS_GATHER_LENS": has,
                                "DECODE": _DECODES[tile.decode]},
                    variants=gate_variants, num_warps=tile.num_warps, num_stages=1,
                    feature="kv_gather"))


_register()
