"""H200 sweep of the two-phase decode's Gluon phase 2 (Tile.gluon_heads: rows sm80-2p-h64 and
sm80-2p-h32) against the Triton phase 2, over split counts. (At 5535209 the same script swept
Q.K^T dim slices, at d4d1dd1 warps per head group, ``DSPLIT``; both since fixed.)

Each row times the whole decode (both phases) of one setting, captured in a CUDA graph and
replayed under ``triton.testing.do_bench`` (median, L2 flushed), over 4 input copies in turn,
V4.1 shapes (top-k 512 + window 128, sink) at 64 heads. Prints a table; ``--out`` writes JSON.

    PYTHONPATH=overlay:benchmarks python benchmarks/diag/sweep_decode_gluon.py --out F.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from suites.sparse_mla_decode import TOPK, WINDOW, _graph, make_inputs, ours  # noqa: E402
from vllm.deepinfer.kernels import sparse_mla_decode as smd  # noqa: E402


def time_setting(inputs, row, splits) -> float:
    outs = [torch.empty_like(x["q"]) for x in inputs]
    graphs = [_graph(lambda x=x, o=o: ours(x, row, out=o, num_kv_splits=splits))
              for x, o in zip(inputs, outs)]
    state = {"i": 0}

    def step():
        graphs[state["i"] % len(graphs)].replay()
        state["i"] += 1
    return triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median") * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--heads", type=int, default=64)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for t in args.tokens:
        inputs = [make_inputs(dev, t, args.heads, TOPK, WINDOW, seed=s) for s in range(4)]
        settings = []
        for row in ("sm80-2p", "sm80-2p-h64", "sm80-2p-h32"):
            _, auto = smd.launch_plan(t, args.heads, float(TOPK + WINDOW), smd.TILES[row], sms)
            settings += [(row, sp, sp == auto) for sp in sorted({1, 2, 4, auto})]
        for row, sp, is_auto in settings:
            us = time_setting(inputs, row, sp)
            r = dict(tokens=t, heads=args.heads, row=row, splits=sp, us=us, auto=is_auto)
            rows.append(r)
            print(f"{t:5d} {row:12s} splits={sp} {us:9.1f} us"
                  f"{'  (auto)' if r['auto'] else ''}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                    triton=triton.__version__, commit=os.environ.get("DEEPINFER_COMMIT", "?"),
                    shapes=dict(topk=TOPK, window=WINDOW, heads=args.heads), sms=sms)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
