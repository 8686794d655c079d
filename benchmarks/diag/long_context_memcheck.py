"""Every kernel of ``vllm.deepinfer`` on the Ampere path, launched once at long-context sizes,
for ``compute-sanitizer --tool memcheck`` (no 32-bit offset may wrap at any size vLLM accepts).

Usage (a CUDA machine; torch and Triton, no vLLM; overlay/ on PYTHONPATH):

    PYTHONPATH=overlay compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python benchmarks/diag/long_context_memcheck.py --out benchmarks/results/<gpu>-<date>-memcheck-<commit>.json
    python benchmarks/diag/long_context_memcheck.py --dry-run     # any machine: the plan only
    python benchmarks/diag/long_context_memcheck.py --toy --out F # CPU: toy sizes, interpreter

Groups of launches (one launch per kernel and shape, kernel-level calls of our launchers):

* ``prefill-300k``: one V4.1 ratio-1 layer's step of a 300K-token prompt, its last 131,072
  tokens (max_num_batched_tokens 131,072), 64 heads, top-k 512 + window 128: the compressed-KV
  insert and the index-K store, the indexer Q quant, V4's C4A compressor writers (head 512 and
  the indexer's 128), the two KV gathers (300,000 compressed rows, 131,199 SWA rows) into the
  [1, 431,200, 512] workspace, the top-k/SWA combiner, one chunk of the indexer's prefill
  logits (447 rows x 300,000 keys: vLLM's 512 MiB logits bound), the sparse MLA prefill over
  all 131,072 tokens, the inverse RoPE of its output, and the Engram lookup.
* ``decode-1m``: a 256-token decode step at 1M context for V4.1 ratio 1 and 2 and V4 C4A and
  C128A (top-k 512, C128A 8,192): the decode in the path the launcher picks (two phases on
  sm80) and in one phase, a 4-token decode that splits its keys (the reduce kernel), the
  indexer's paged logits over 1M / ratio keys, and the writers of the step.
* ``boundary``: each product that was 32-bit before it was fixed, just past 2^31 elements:
  the indexer Q quant at 262,145 tokens x 64 index heads, the one-phase decode at 32,769
  tokens x 128 heads (at 64 heads its bound, 65,536 tokens, lies past the 65,535 tokens one
  decode launch takes: CUDA's grid limit), the V4 compressor with 8,193 requests over a
  262,144-column state block table (the inverse RoPE's is inside ``prefill-300k``: 131,072
  rows x 64 heads).

Every KV cache of a group is a view of one pool of 6 GiB (the index-K caches of one of
3 GiB), pages placed at its top, so page offsets pass 2^31 bytes as in a cache of tens of
millions of tokens; V4's C128A pages are 141,696 bytes apart (vLLM's padded page, H200 e2e
run). Where cheap, a launch is followed by a spot check: the last rows recomputed by the same
launcher from compact copies of their inputs must come back with the same bits (``spot``:
true / false / null where none). ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` is set (before torch is
imported) so that every tensor is its own allocation and memcheck sees any access outside it.

Time: on the H200 at 94e0f91 (benchmarks/results/h200-2026-12-01-memcheck-94e0f91.json) the
three groups under memcheck took 50 s (boundary and decode-1m, Triton compiles included) and
32 s (prefill-300k, compiled kernels cached); allow a few minutes on a cold cache. GPU memory
(not measured): the prefill group holds about 30 GB at once (its q and output, 8.6 GB each,
and the 9 GiB of pools). ``--only GROUP`` runs one group.
``--variant`` picks the tile/fp8 variant (default sm80: the Ampere code paths; on an H200 these
are the sm_80-targeted kernels built for sm_90, not A100 figures). Results: one row per launch
``{kernel, group, shape, ok, spot, seconds, error}``; the exit status is 1 when a row failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")  # memcheck: one tensor, one allocation

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:   # loaded by path (tests/test_offsets_int64.py): its sibling
    sys.path.append(str(HERE))
# The launches and their spot checks (the plan below names them); it imports no torch.
import memcheck_launches as launches  # noqa: E402
from memcheck_launches import D, REC, Ctx  # noqa: E402

# Kernel names of the rows (the launcher, and the path where one launcher has several).
KERNELS = (
    "fp8_writers_v41.rope_quant_insert", "fp8_writers_v41.indexer_k_store",
    "fp8_writers_v4.indexer_q", "fp8_writers_v4_compress.kv", "fp8_writers_v4_compress.indexer",
    "kv_gather", "topk_swa", "indexer_logits.mqa", "indexer_logits.paged", "sparse_mla_prefill",
    "inverse_rope", "engram_lookup", "sparse_mla_decode", "sparse_mla_decode.1p",
    "sparse_mla_decode.split",
)
INT32_MAX = 2 ** 31 - 1


@dataclasses.dataclass(frozen=True)
class Sizes:
    heads: int = 64                 # attention heads per rank (V4.1/V4 at TP 1)
    index_heads: int = 64           # indexer heads
    window: int = 128               # SWA keys
    topk: int = 512                 # index top-k
    c128a_topk: int = 8192          # V4 C128A top-k at 1M context (1M / 128)
    prefill_tokens: int = 131072    # max_num_batched_tokens
    prefill_context: int = 300_000  # the prompt's length at the end of the step
    logits_rows: int = 447          # rows of one prefill logits chunk: 512 MiB / (4 B x 300K)
    decode_tokens: int = 256
    decode_context: int = 1 << 20
    split_tokens: int = 4           # a decode small enough to split its keys
    pool_bytes: int = 6 << 30       # the KV pool (584-byte records)
    index_pool_bytes: int = 3 << 30  # the index-K pool (132-byte rows)
    engram_rows: int = 4_500_000    # Engram table rows of 512 e4m3 bytes: 2.3 GB
    engram_heads: int = 8
    # Boundary launches: the first size past 2^31 of each product fixed to int64.
    b_indexer_tokens: int = 262_145       # x 64 heads x 128
    # x 128 heads x 512 (at 64 heads the bound, 65,536 tokens, is past the decode grid's
    # 65,535 tokens per launch: CUDA's grid z limit)
    b_decode_tokens: int = 32_769
    b_decode_heads: int = 128
    b_compress_reqs: int = 8_193          # x 262,144 block-table columns
    b_compress_cols: int = 262_144        # 1M positions / 4-token state pages


FULL = Sizes()
# CPU, Triton interpreter: every launch and spot check of the script at a few programs each.
TOY = Sizes(heads=16, index_heads=16, window=16, topk=32, c128a_topk=64, prefill_tokens=8,
            prefill_context=300, logits_rows=3, decode_tokens=4, decode_context=2048,
            split_tokens=2, pool_bytes=4 << 20, index_pool_bytes=1 << 20, engram_rows=300,
            engram_heads=2, b_indexer_tokens=3, b_decode_tokens=3, b_decode_heads=32,
            b_compress_reqs=3, b_compress_cols=64)


@dataclasses.dataclass
class Case:
    kernel: str
    group: str
    shape: dict
    run: Callable  # (ctx) -> True / False (spot check) or None


# ----------------------------------------------------------------------------- prefill
def _prefill_cases(sz: Sizes) -> list[Case]:
    geo = launches.PrefillGeometry.of(sz)
    run = launches.prefill_launches(sz)
    T, H, ctx_len = geo.tokens, geo.heads, geo.context
    width, m, swa_gather, page = geo.width, geo.workspace_rows, geo.swa_gather, geo.page
    g = "prefill-300k"
    th = dict(tokens=T, heads=H)
    return [
        Case("fp8_writers_v41.rope_quant_insert", g,
             dict(tokens=T, cache_pages=page, context=ctx_len, pool_bytes=sz.pool_bytes),
             run["rope_quant_insert"]),
        Case("fp8_writers_v41.indexer_k_store", g,
             dict(tokens=T, cache_pages=page, context=ctx_len, pool_bytes=sz.index_pool_bytes),
             run["indexer_k_store"]),
        Case("fp8_writers_v4.indexer_q", g, dict(tokens=T, heads=sz.index_heads, dim=128),
             lambda c: launches.launch_indexer_q(c, T)),
        Case("fp8_writers_v4_compress.kv", g, dict(tokens=T, ratio=4, head=512, context=ctx_len),
             lambda c: launches.launch_compress(c, 512, T, ctx_len)),
        Case("fp8_writers_v4_compress.indexer", g,
             dict(tokens=T, ratio=4, head=128, context=ctx_len),
             lambda c: launches.launch_compress(c, 128, T, ctx_len)),
        Case("kv_gather", g, dict(compressed_rows=ctx_len, swa_rows=swa_gather,
                                  workspace=[1, m, D]), run["gather"]),
        Case("topk_swa", g, dict(tokens=T, topk=sz.topk, window=sz.window, width=width),
             run["combine"]),
        Case("indexer_logits.mqa", g, dict(rows=sz.logits_rows, heads=sz.index_heads,
                                           keys=ctx_len), run["logits"]),
        Case("sparse_mla_prefill", g, dict(**th, keys=width, workspace_rows=m), run["prefill"]),
        Case("inverse_rope", g, dict(**th, max_offset=(T - 1) * H * D + (H - 1) * D + D - 1),
             run["inverse_rope"]),
        Case("engram_lookup", g, dict(tokens=T, heads=sz.engram_heads, table_rows=sz.engram_rows),
             run["engram"]),
    ]


# ----------------------------------------------------------------------------- decode
# (name, compress ratio, top-k, SWA page, compressed page, compressed page stride in bytes
# (None: dense), index-K page (None: no indexer))
def _layers(sz: Sizes):
    return (("v41.c1", 1, sz.topk, 32, 64, None, 64), ("v41.c2", 2, sz.topk, 32, 64, None, 64),
            ("v4.c4a", 4, sz.topk, 64, 64, None, 64),
            ("v4.c128a", 128, sz.c128a_topk, 64, 2, 141_696 if sz is FULL else None, None))


def _decode_cases(sz: Sizes) -> list[Case]:
    g = "decode-1m"
    T, ctx = sz.decode_tokens, sz.decode_context
    cases: list[Case] = []
    for name, ratio, topk, swa_page, page, stride, ipage in _layers(sz):
        shape = dict(layer=name, tokens=T, heads=sz.heads, context=ctx, keys=sz.window + topk,
                     pages=[swa_page, page], page_stride=stride or page * REC)
        args = (ratio, topk, swa_page, page, stride)
        cases.append(Case("sparse_mla_decode", g, shape,
                          lambda c, a=args: launches.launch_decode(c, T, *a)))
        cases.append(Case("sparse_mla_decode.1p", g, shape,
                          lambda c, a=args: launches.launch_decode(c, T, *a,
                                                                   predequant=False)))
        cases.append(Case("sparse_mla_decode.split", g, dict(shape, tokens=sz.split_tokens),
                          lambda c, a=args: launches.launch_decode(c, sz.split_tokens, *a)))
        if ipage is not None:
            cases.append(Case("indexer_logits.paged", g,
                              dict(layer=name, rows=T, heads=sz.index_heads, context=ctx,
                                   keys=ctx // ratio),
                              lambda c, r=ratio, p=ipage:
                              launches.launch_paged_logits(c, r, p)))
    cases.append(Case("fp8_writers_v4.indexer_q", g, dict(tokens=T, heads=sz.index_heads,
                                                          context=ctx),
                      lambda c: launches.launch_indexer_q(c, T)))
    cases.append(Case("fp8_writers_v4_compress.kv", g, dict(tokens=T, ratio=4, head=512,
                                                            context=ctx),
                      lambda c: launches.launch_compress(c, 512, T, ctx)))
    return cases


# ----------------------------------------------------------------------------- boundary
def _boundary_cases(sz: Sizes) -> list[Case]:
    g = "boundary"
    ti, td, rq, cols = sz.b_indexer_tokens, sz.b_decode_tokens, sz.b_compress_reqs, sz.b_compress_cols
    return [
        Case("fp8_writers_v4.indexer_q", g,
             dict(tokens=ti, heads=sz.index_heads, dim=128,
                  max_offset=(ti - 1) * sz.index_heads * 128 + sz.index_heads * 128 - 1),
             lambda c: launches.launch_indexer_q(c, ti)),
        Case("sparse_mla_decode.1p", g,
             dict(tokens=td, heads=sz.b_decode_heads, keys=sz.window + sz.topk,
                  max_offset=(td - 1) * sz.b_decode_heads * D + sz.b_decode_heads * D - 1),
             lambda c: launches.launch_decode(c, td, 1, sz.topk, 32, 64, None,
                                              predequant=False, heads=sz.b_decode_heads)),
        Case("fp8_writers_v4_compress.kv", g,
             dict(requests=rq, block_table_cols=cols, max_offset=(rq - 1) * cols + cols - 1),
             lambda c: launches.launch_compress(c, 512, 0, 0, reqs=rq, cols=cols)),
    ]


def plan(sz: Sizes, only: str | None = None) -> list[Case]:
    cases = _prefill_cases(sz) + _decode_cases(sz) + _boundary_cases(sz)
    return [c for c in cases if only is None or c.group == only]


# ----------------------------------------------------------------------------- main
def _commit() -> str:
    """The benchmarks' commit rule (benchmarks/harness.py: DEEPINFER_COMMIT, else git with a
    +dirty mark); imported here, after the allocator settings above took effect."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from harness import _commit as commit
    return commit()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON summary here")
    ap.add_argument("--dry-run", action="store_true", help="build the plan only (no tensors)")
    ap.add_argument("--toy", action="store_true",
                    help="toy sizes on CPU under the Triton interpreter (the script's own check)")
    ap.add_argument("--only", choices=("prefill-300k", "decode-1m", "boundary"))
    ap.add_argument("--variant", default=None, help="tile/fp8 variant (default sm80; cpu with --toy)")
    a = ap.parse_args(argv)
    sz = TOY if a.toy else FULL
    if a.toy:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    cases = plan(sz, a.only)
    meta = {"script": "benchmarks/diag/long_context_memcheck.py", "commit": _commit(),
            "date": datetime.date.today().isoformat(), "dry_run": a.dry_run, "toy": a.toy,
            "sizes": dataclasses.asdict(sz), "python": platform.python_version(),
            "PYTORCH_NO_CUDA_MEMORY_CACHING": os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING")}
    rows = []
    print(f"{'group':14s} {'kernel':36s} shape")
    if a.dry_run:
        for c in cases:
            print(f"{c.group:14s} {c.kernel:36s} {json.dumps(c.shape)}")
            rows.append(dict(kernel=c.kernel, group=c.group, shape=c.shape, ok=None, spot=None,
                             seconds=None, error=None))
    else:
        import torch
        dev = torch.device("cpu" if a.toy else "cuda")
        variant = a.variant or ("cpu" if a.toy else "sm80")
        meta.update(variant=variant, torch=torch.__version__,
                    gpu=None if a.toy else torch.cuda.get_device_name(dev))
        import triton
        meta["triton"] = triton.__version__
        ctx = Ctx(dev, variant, sz)
        group = None
        for c in cases:
            if c.group != group:  # pools are per group: free the last group's
                ctx, group = Ctx(dev, variant, sz), c.group
            t0 = time.perf_counter()
            row = dict(kernel=c.kernel, group=c.group, shape=c.shape, ok=False, spot=None,
                       seconds=None, error=None)
            try:
                row["spot"] = c.run(ctx)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                row["ok"] = row["spot"] is not False
            except Exception as e:  # one failing launch must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
            row["seconds"] = round(time.perf_counter() - t0, 3)
            print(f"{c.group:14s} {c.kernel:36s} {json.dumps(c.shape)} ok={row['ok']} "
                  f"spot={row['spot']} {row['seconds']} s", flush=True)
            rows.append(row)
            if a.out:  # after every row: a run stopped part way keeps what it did
                Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    if a.out:
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    bad = [r for r in rows if r["ok"] is False]
    print(f"{len(rows)} launches planned" if a.dry_run else
          f"{len(rows) - len(bad)} of {len(rows)} launches ok", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
