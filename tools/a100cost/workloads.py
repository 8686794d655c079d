"""Workloads: the launches (grid, loop trips, bytes, FLOPs) of the benchmark suites'
kernels for a shape, built from the kernels' own tile tables and launch plans."""
from __future__ import annotations

import dataclasses
import math
import sys

from .bounds import Launch, Workload
from .builds import Code, _spec, code_for
from .common import BUILD, ModelError, _overlay_on_path


def _main_loop(code: Code) -> int:
    if not code.loops:
        raise ModelError(f"{code.name} sm_{code.cc}: no loop in the machine code")
    return 0


def decode_workload(tokens: int, heads: int, topk: int, window: int, variant: str, cc: int,
                    sms: int, kernel_variant: str | None = None) -> Workload:
    """The decode suite's launch (benchmarks/suites/sparse_mla_decode.py): sink on, no
    inverse RoPE, SWA pages of 32 and compressed pages of 64 (as measured), each token's
    compressed rows in a region of twice top-k; the split count from the kernel's own
    heuristic for ``sms`` SMs."""
    _overlay_on_path()
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    from vllm.deepinfer.kernels import sparse_mla_decode_gluon as glk
    from vllm.deepinfer.kv_record import HEAD_DIM, RECORD_BYTES
    tv = kernel_variant or variant
    tile = smd.TILES[tv]
    keys = topk + window
    block_h, splits = smd.launch_plan(tokens, heads, float(keys), tile, sms)
    split = splits > 1
    swa_page, comp_page = 32, 64
    gluon_heads = tile.gluon_heads if smd.uses_gluon(tile, heads) else 0
    if gluon_heads:  # phase 2 as the Gluon kernel (its gate spec, INV_ROPE off)
        tile = smd.phase2_tile(tile, heads)
        spec = dataclasses.replace(
            _spec(f"sparse_mla_decode.gluon{gluon_heads}.{'partial' if split else 'direct'}"
                  "[sm80-2p]", INV_ROPE=False, DSPLIT=glk.DSPLIT),
            num_warps=glk.warps(gluon_heads))
    else:
        spec = dataclasses.replace(
            _spec(f"sparse_mla_decode.{'partial' if split else 'direct'}[{tv}]", INV_ROPE=False,
                  MAIN_BS=swa_page, EXTRA_BS=comp_page, BLOCK_H=block_h, BLOCK_N=tile.block_n,
                  QK_HALVES=tile.predequant and tile.qk_halves),
            num_warps=tile.num_warps, num_stages=tile.num_stages)
    ints = dict(q_stride0=heads * HEAD_DIM, q_stride1=HEAD_DIM, out_stride0=heads * HEAD_DIM,
                out_stride1=HEAD_DIM, main_stride0=swa_page * RECORD_BYTES,
                extra_stride0=comp_page * RECORD_BYTES,
                main_rows=-(-tokens * window // swa_page) * swa_page,
                extra_rows=-(-tokens * 2 * topk // comp_page) * comp_page, cs_stride=0,
                num_heads=heads, num_splits=splits)
    code = code_for(spec, cc, {k: v for k, v in ints.items() if k in spec.signature})
    head_tiles = math.ceil(heads / block_h)
    span = math.ceil(math.ceil(keys / splits) / tile.block_n) * tile.block_n
    trips = math.ceil(min(span, keys) / tile.block_n)
    launches = []
    traffic = None
    if tile.predequant:
        # Phase 1: each token's keys dequantized once into bf16 rows (+1 validity byte).
        # Rows derived from sm80-2p ("sm80-2p-h64", a sweep's) share its registered phase 1.
        pv = "sm80-2p" if tv.startswith("sm80-2p") else tv
        pspec = _spec(f"sparse_mla_decode.predequant[{pv}]", MAIN_BS=swa_page,
                      EXTRA_BS=comp_page, DECODE=smd.PREDEQUANT_DECODES[tile.predequant_decode])
        pcode = code_for(pspec, cc, {k: ints[k] for k in ("main_stride0", "extra_stride0",
                                                           "main_rows", "extra_rows")})
        bn = smd.PREDEQUANT_BLOCK_N
        per_token = max(1, min(math.ceil(keys / bn),
                               math.ceil(smd.PREDEQUANT_PROGRAMS_PER_SM * sms / tokens)))
        launches.append(Launch(pcode, per_token * tokens,
                               {_main_loop(pcode): math.ceil(math.ceil(keys / bn) / per_token)}))
        ws = tokens * keys * (HEAD_DIM * 2 + 1)
        # The workspace is written once and read back (once from DRAM; the other head
        # tiles of a token find it in L2).
        traffic = tokens * keys * RECORD_BYTES + 2 * ws + 2 * (2 * tokens * heads * HEAD_DIM)
    launches.append(Launch(code, head_tiles * splits * tokens, {_main_loop(code): trips}))
    if split:
        rspec = _spec(f"sparse_mla_decode.reduce[{tv.split('-')[0]}]", INV_ROPE=False,
                      SPLITS_P2=1 << (splits - 1).bit_length())
        rcode = code_for(rspec, cc, dict(out_stride0=heads * HEAD_DIM, out_stride1=HEAD_DIM,
                                         cs_stride=0, num_heads=heads, num_splits=splits))
        rtrips = {0: math.ceil(splits / smd.REDUCE_UNROLL)} if rcode.loops else {}
        launches.append(Launch(rcode, math.ceil(heads / tile.reduce_block_h) * tokens, rtrips))
    nbytes = tokens * keys * RECORD_BYTES + 2 * (2 * tokens * heads * HEAD_DIM)
    flops = 2 * 2 * tokens * heads * keys * HEAD_DIM
    return Workload("sparse_mla_decode", variant,
                    dict(tokens=tokens, heads=heads, topk=topk, window=window),
                    launches, nbytes, flops, traffic)


def gather_workload(shape: dict, variant: str, cc: int, sms: int) -> Workload:
    """The kv_gather suite's launch: pages of 64 tokens, gather lengths passed. Ragged rows'
    per-request lengths are not in the results: their tiles are counted from the total (a
    request's last partial tile is lost: <= 1 tile per request) and the block table's row
    stride is taken as not a multiple of 16."""
    _overlay_on_path()
    from vllm.deepinfer.kernels import kv_gather as kg
    from vllm.deepinfer.kv_record import HEAD_DIM, RECORD_BYTES
    tile = kg.TILES[variant.split("-")[0]]
    decode = variant.split("-")[1] if "-" in variant else tile.decode
    reqs, tokens = shape["reqs"], shape["tokens"]
    page = 64
    bucket = next(b for b in (16, 128, 1024) if reqs <= b)
    spec = _spec(f"kv_gather.T{tile.tokens}w{tile.num_warps}.{tile.decode}.R{bucket}.gl",
                 DECODE={"int": 0, "f16bits": 1, "e4b15": 2, "hw": 3}[decode])
    # Longest gather: the whole row for one request; the suite draws ragged lengths below 16K.
    max_len = tokens if reqs == 1 else 16 << 10
    ints = dict(out_s0=max_len * HEAD_DIM, out_s1=HEAD_DIM, page_stride=page * RECORD_BYTES,
                bt_stride=-(-max_len // page) if reqs == 1 else 17)
    code = code_for(spec, cc, ints)
    tiles = math.ceil(tokens / tile.tokens) + (reqs - 1 if shape.get("ragged") else 0)
    programs = max(1, min(reqs * math.ceil(max_len / tile.tokens), tile.programs_per_sm * sms))
    trips = tiles / programs
    return Workload("kv_gather", variant, shape, [Launch(code, programs, {_main_loop(code): trips})],
                    tokens * (RECORD_BYTES + 2 * HEAD_DIM), 0.0)


def indexer_workload(kind: str, shape: dict, variant: str, cc: int, sms: int) -> Workload:
    """The indexer_logits suite's launches (64 heads x 128 dims, 128-token pages)."""
    _overlay_on_path()
    from vllm.deepinfer.kernels import indexer_logits as il
    base = variant.split("-")[0]
    tile = il.TILES[base]
    e4b15 = variant.endswith("e4b15")
    H, D = shape["H"], shape["D"]
    page = 128
    if kind == "paged":
        rows, L = shape["B"], shape["L"]
        spec = _spec(f"indexer_logits.paged[{base}]", E4B15=e4b15)
        keys_per_row = [L] * rows
        nbytes = rows * L * (D + 8) + rows * H * (D + 4)
        ints = dict(page_stride=page * (D + 4))
    else:
        M, N = shape["M"], shape["N"]
        spec = _spec(f"indexer_logits.flat[{base}]", E4B15=e4b15)
        rows, L = M, N
        keys_per_row = [N - M + i + 1 for i in range(M)]
        nbytes = N * (D + 4) + sum(keys_per_row) * 4 + M * H * (D + 4)
        ints = dict(page_stride=0)
    code = code_for(spec, cc, ints)
    P = max(1, min(math.ceil(L / tile.block_n), math.ceil(tile.programs_per_sm * sms / rows)))
    # Tiles of a row are shared round-robin by its P programs; many rows' programs spread
    # over the SMs, so the average row's trips stand for all.
    trips = sum(math.ceil(math.ceil(k / tile.block_n) / P) for k in keys_per_row) / rows
    flops = 2.0 * H * D * sum(keys_per_row)
    return Workload(f"indexer_logits.{kind}", variant, shape,
                    [Launch(code, P * rows, {_main_loop(code): trips})], nbytes, flops)


def writer_workload(kernel: str, shape: dict, variant: str, cc: int, nbytes: float) -> Workload:
    """One program per token, no loop (the V4.1 writers of the fp8_writers suite); with
    compress ratio r only every r-th token writes, the others leave at the ratio check."""
    ratio = shape["ratio"]
    page = 128
    if kernel == "v41_rope_quant_insert":
        name, ints = f"fp8_writers.v41.rope_quant_insert_584.cr{ratio}", {}
    else:
        name = f"fp8_writers.v41.indexer_k_store_fp8.cr{ratio}"
        ints = dict(k_pre_stride=128, cos_stride=64, cache_block=page)
    code = code_for(_spec(f"{name}[{variant}]"), cc, ints)
    # Early exits in address order: the slot check (0), then the ratio check (1).
    return Workload(kernel, variant, shape,
                    [Launch(code, shape["tokens"], {}, active=1.0 / ratio, exit_ordinal=1)],
                    nbytes, 0.0)


def prefill_workload(shape: dict, variant: str, cc: int, nbytes: float) -> Workload:
    """The sparse_mla_prefill suite's launch of ours (benchmarks/suites/sparse_mla_prefill.py):
    dense rows of ``shape["keys"]`` entries per token (the row's mean list length), sink on,
    a 512-wide output, an aligned workspace; grid tokens x head tiles, one loop trip per key
    tile. ``nbytes``: the bytes the suite counts for the row (Q, output, the workspace rows
    and the index lists)."""
    _overlay_on_path()
    from vllm.deepinfer.kernels import sparse_mla_prefill as spm
    from vllm.deepinfer.kv_record import HEAD_DIM
    tile = spm.TILES[variant]
    if tile.gluon_ws:
        raise ModelError(f"sparse_mla_prefill row {variant!r} runs the warp-specialized Gluon "
                         "kernel, whose partitions the model does not simulate (its Triton "
                         "tile is row 'sm90-triton')")
    T, H, keys = shape["tokens"], shape["heads"], shape["keys"]
    block_h, head_tiles = spm.launch_plan(H, tile)
    width = -(-(shape["topk"] + shape.get("window", 128)) // 128) * 128
    spec = dataclasses.replace(
        _spec(f"sparse_mla_prefill[{variant.split('-')[0]}]",
              **spm.gate_constexprs(dataclasses.replace(tile, block_h=block_h))),
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    ints = dict(q_stride0=H * HEAD_DIM, q_stride1=HEAD_DIM, kv_stride0=HEAD_DIM,
                idx_stride0=width, out_stride0=H * HEAD_DIM, out_stride1=HEAD_DIM,
                num_rows=3, num_heads=H, head_tiles=head_tiles, width=width)
    code = code_for(spec, cc, ints)
    trips = math.ceil(keys / tile.block_n)
    flops = 2.0 * 2 * T * H * keys * HEAD_DIM
    return Workload("sparse_mla_prefill", variant, shape,
                    [Launch(code, T * head_tiles, {_main_loop(code): trips})], nbytes, flops)


def upstream_prefill_workload(shape: dict, cc: int, nbytes: float) -> Workload:
    """Upstream's ``_sparse_attn_prefill_ragged_kernel`` as ``_rocm_sparse_attn_prefill_
    ragged_triton`` launches it (grid (T, cdiv(H, 16)), BLOCK_H 16, BLOCK_K 16, 4 warps,
    Triton's default 3 stages), from build/upstream_kernels (tools/extract_upstream.py)."""
    import importlib
    from vllm.deepinfer.compile_gate import GateSpec
    from vllm.deepinfer.kv_record import HEAD_DIM
    if str(BUILD) not in sys.path:
        sys.path.insert(0, str(BUILD))
    try:
        fn = importlib.import_module(
            "upstream_kernels.v41_sparse_prefill")._sparse_attn_prefill_ragged_kernel
    except ImportError as e:
        raise ModelError(f"upstream's prefill kernel: {e} (run `make upstream-kernels`)")
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "kv_indices_ptr": "*i32",
            "kv_indptr_ptr": "*i32", "attn_sink_ptr": "*fp32", "out_ptr": "*bf16"}
    const = dict(HAS_ATTN_SINK=True, OUT_DV=HEAD_DIM, BLOCK_H=16, BLOCK_D=HEAD_DIM,
                 BLOCK_K=16)
    sig = {n: ptrs.get(n, "constexpr" if n in const else "fp32" if n == "scale" else "i32")
           for n in fn.arg_names}
    spec = GateSpec(name="upstream._sparse_attn_prefill_ragged_kernel", kernel=fn,
                    signature=sig, constexprs=const, variants=(), num_warps=4, num_stages=3)
    T, H, keys = shape["tokens"], shape["heads"], shape["keys"]
    ints = dict(q_stride_t=H * HEAD_DIM, q_stride_h=HEAD_DIM, q_stride_d=1,
                kv_stride_n=HEAD_DIM, kv_stride_d=1, out_stride_t=H * HEAD_DIM,
                out_stride_h=HEAD_DIM, out_stride_d=1, num_heads=H, head_dim=HEAD_DIM,
                num_kv=3)
    code = code_for(spec, cc, ints)
    flops = 2.0 * 2 * T * H * keys * HEAD_DIM
    return Workload("sparse_mla_prefill", "upstream", shape,
                    [Launch(code, T * math.ceil(H / 16), {_main_loop(code): math.ceil(keys / 16)})],
                    nbytes, flops)


def _prefill_bytes(shape: dict) -> float:
    """What one prefill launch must move: Q and the output (bf16), the chunk's workspace
    rows (N = (ctx + T) // ratio compressed rows, then T + min(ctx, 127) SWA rows, 1 KiB
    each) and the index lists (int32 rows of top-k + window entries)."""
    _overlay_on_path()
    from vllm.deepinfer.kv_record import HEAD_DIM
    T, ctx, H = shape["tokens"], shape["ctx"], shape["heads"]
    rows = (ctx + T) // shape["ratio"] + T + min(ctx, 127)
    return 2.0 * T * H * HEAD_DIM * 2 + rows * HEAD_DIM * 2 + T * (shape["topk"] + 128) * 4
