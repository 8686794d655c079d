"""Diagnostic sweep (H200): indexer-logits launch options, GPU time from CUDA graphs.

    python3 benchmarks/diag/sweep_indexer_logits.py [--out F.jsonl]
    python3 benchmarks/diag/sweep_indexer_logits.py --long [--keys 131072 1048576] [--out F.jsonl]

Default: num_stages and programs per SM for the sm80 variant (software decode) at the
64 x 8192 decode and the 2048 x 8192 prefill of benchmarks/suites/indexer_logits.py (input
rings > 2x L2). ``--long``: the unmasked kernel at long context, B = 16 decode rows and
M = 128 prefill rows x each of ``--keys`` (default 1M) keys, over tiles (keys per tile,
warps), stages and programs per SM, and for prefill rows per program (1, or 2 sharing each
key tile, with whether each row's bits equal the one-row 64 x 4 kernel's), for the sm80 and
sm90 variants, each with its TFLOP/s and share of the bf16 matmul rate measured in the same
run; then the suite's long-context rows (candidate-only beside compute-then-mask). One JSON line per measurement (stdout, and
``--out``); the chosen row goes into kernels/indexer_logits.py's TILES with a comment
pointing at the committed results file.
"""
import argparse
import dataclasses
import json
import sys

import torch

sys.path.insert(0, "benchmarks")

# Long-context grid: (keys per tile, warps) x stages x programs per SM. 64 x 4 / 1 stage /
# 16 per SM is the current tile (indexer_logits.TILES); 128-key tiles halve the query
# reloads per key, 2-3 stages overlap the key loads with the dot at long rows.
LONG_TILES = [(64, 4), (64, 8), (128, 4), (128, 8)]
LONG_STAGES = [1, 2, 3]
LONG_PPS = [16, 32]
# Prefill rows per program (LogitsTile.flat_rows): 1, or 2 sharing each key tile.
LONG_FLAT_ROWS = [1, 2]


def _emit(out, row):
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def _short(h, out):
    import suites.indexer_logits as sil
    from vllm.deepinfer.kernels import indexer_logits as il
    dev = h.dev
    B, L = 64, 8192
    dec = h.copies(lambda: sil._decode_inputs(dev, B, L), B * L * (il.HEAD_DIM + 8),
                   max_copies=16)
    M, N = 2048, 8192
    pre = h.copies(lambda: sil._prefill_inputs(dev, M, N), N * 132 + M * N * 2, max_copies=8)
    base = il.TILES["sm80"]
    for stages in (1, 2, 3, 4):
        for pps in (4, 8, 16, 32):
            for bn, nw in ((64, 4), (128, 8)):
                t = dataclasses.replace(base, num_stages=stages, programs_per_sm=pps,
                                        block_n=bn, num_warps=nw)
                d_us = h.time_graph(lambda x: il.paged_mqa_logits(
                    x["q"], x["cache"], x["w"], x["ctx"], x["table"], x["L"], variant="sm80",
                    tile=t), dec)
                p_us = h.time_graph(lambda x: il.mqa_logits(
                    x["q"], x["k"], x["s"], x["w"], x["ks"], x["ke"], N, variant="sm80",
                    tile=t), pre)
                _emit(out, {"stages": stages, "pps": pps, "bn": bn, "warps": nw,
                            "decode_us": round(d_us, 2), "prefill_us": round(p_us, 2)})


def _long(h, out, keys):
    import suites.indexer_logits as sil
    from vllm.deepinfer.kernels import indexer_logits as il
    dev = h.dev
    for L in keys:
        B, M = sil.LONG_DECODE_B, sil.LONG_PREFILL_M
        dec = [sil._decode_inputs(dev, B, L)]
        pre = [sil._prefill_inputs(dev, M, L)]
        x = pre[0]
        lens = (x["ke"] - x["ks"]).tolist()
        valid = sum(lens)
        d_fl, p_fl = 2.0 * sil.H * sil.D * B * L, 2.0 * sil.H * sil.D * valid
        for variant in ("sm80", "sm90"):
            base = il.TILES[variant]
            ref = il.mqa_logits(x["q"], x["k"], x["s"], x["w"], x["ks"], x["ke"], L,
                                variant=variant, tile=dataclasses.replace(base, flat_rows=1))
            for (bn, nw) in LONG_TILES:
                for stages in LONG_STAGES:
                    for pps in LONG_PPS:
                        t = dataclasses.replace(base, block_n=bn, num_warps=nw,
                                                num_stages=stages, programs_per_sm=pps)
                        row = {"L": L, "variant": variant, "bn": bn, "warps": nw,
                               "stages": stages, "pps": pps}
                        try:
                            d_us = h.time_graph(lambda x: il.paged_mqa_logits(
                                x["q"], x["cache"], x["w"], x["ctx"], x["table"], x["L"],
                                variant=variant, tile=t), dec)
                        except Exception as e:  # a tile that does not compile: say so
                            _emit(out, dict(row, error=f"{type(e).__name__}: {str(e)[:200]}"))
                            continue
                        _emit(out, dict(row, form="decode", B=B, us=round(d_us, 2),
                                        tflops=round(d_fl / d_us / 1e6, 1),
                                        matmul_share=round(d_fl / d_us / 1e6 / h.matmul_tflops,
                                                           4)))
                        for fr in LONG_FLAT_ROWS:
                            tf = dataclasses.replace(t, flat_rows=fr)
                            got = il.mqa_logits(x["q"], x["k"], x["s"], x["w"], x["ks"],
                                                x["ke"], L, variant=variant, tile=tf)
                            same = all(bool(torch.equal(got[r, :n].view(torch.int32),
                                                        ref[r, :n].view(torch.int32)))
                                       for r, n in enumerate(lens))
                            p_us = h.time_graph(lambda x: il.mqa_logits(
                                x["q"], x["k"], x["s"], x["w"], x["ks"], x["ke"], L,
                                variant=variant, tile=tf), pre)
                            _emit(out, dict(row, form="prefill", M=M, flat_rows=fr,
                                            us=round(p_us, 2),
                                            tflops=round(p_fl / p_us / 1e6, 1),
                                            matmul_share=round(
                                                p_fl / p_us / 1e6 / h.matmul_tflops, 4),
                                            same_bits_as_one_row_64x4=same))
                            del got
            del ref
        del dec, pre


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", action="store_true", help="the long-context grid")
    ap.add_argument("--keys", type=int, nargs="+", default=[1 << 20],
                    help="--long: keys per row (default 1048576)")
    ap.add_argument("--no-suite-rows", action="store_true",
                    help="--long: skip the suite's long-context rows after the grid")
    ap.add_argument("--out", help="also write the JSON lines here")
    a = ap.parse_args(argv)
    from harness import Harness
    h = Harness(quick=True)
    out = open(a.out, "w") if a.out else None
    try:
        _emit(out, {"meta": h.meta})
        if a.long:
            _long(h, out, a.keys)
            if not a.no_suite_rows:
                import suites.indexer_logits as sil
                h.quick = False
                start = len(h.rows)
                sil._run_long(h)
                for row in h.rows[start:]:
                    _emit(out, row)
        else:
            _short(h, out)
    finally:
        if out is not None:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
