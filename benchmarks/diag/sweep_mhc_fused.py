#!/usr/bin/env python3
"""Sweep the mHC fused post + pre geometry and the tensor-core crossover on one GPU, to choose
vllm.deepinfer.mhc.FUSED_GEOMETRY and TC_MIN_TOKENS by measurement.

    PYTHONPATH=/tmp/site python3 benchmarks/diag/sweep_mhc_fused.py [--hidden 5120] \
        [--tokens 1,2,4,6,8,12,16,24,32] [--out FILE.jsonl]

Needs what benchmarks/suites/mhc.py needs (vLLM 0.33.0 with the overlay installed, TileLang
0.1.12). For each hidden size and token count it times ``mhc_fused_post_pre_delayed_tilelang``
(GPU time, CUDA graph, as the suite) with DeepGEMM reported absent and PDL off, under:
upstream's own choice (DEEPINFER_MHC=0); every fused geometry (tile_n in 1..12 dividing 24,
n_splits x 128 threads dividing hidden, 4-40 slices) forced through FUSED_GEOMETRY; and the
post + tensor-core projection path. One JSON line per (hidden, T, candidate); the last lines
print the best candidate per T and its speedup over upstream. H200 figures of the Ampere
code, not A100 figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import Harness  # noqa: E402
from suites import mhc as suite  # noqa: E402


def candidates(hidden: int):
    for tile_n in (1, 2, 3, 4, 6, 8, 12):
        for n_splits in (4, 5, 8, 10, 16, 20, 40):
            if hidden % (n_splits * 128) == 0:
                yield (tile_n, n_splits, 128)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", default="5120")
    ap.add_argument("--tokens", default="1,2,4,6,8,12,16,24,32")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    import torch

    from vllm.deepinfer import mhc
    h = Harness(quick=True)
    ops, tk, dg = suite._setup()
    gen = torch.Generator(device=h.dev).manual_seed(0)
    out = open(a.out, "w") if a.out else None
    best: dict = {}
    for hs in (int(v) for v in a.hidden.split(",")):
        w = suite._weights(h.dev, hs, gen)
        for t in (int(v) for v in a.tokens.split(",")):
            per = 2 * t * suite.HC * hs * 2 + t * hs * 2 * 2
            ring = h.copies(lambda: suite._inputs(h.dev, t, hs, gen), per)
            launch = lambda x: suite._fused(ops, w, x)  # noqa: E731
            rows = []
            with suite._Side(dg, ours=False):
                rows.append(("upstream", h.time_graph(launch, ring)))
            saved_geo, saved_tc = dict(mhc.FUSED_GEOMETRY), mhc.TC_MIN_TOKENS
            try:
                with suite._Side(dg, ours=True):
                    mhc.TC_MIN_TOKENS = 1
                    mhc.FUSED_GEOMETRY[hs] = ()
                    rows.append(("post+tc", h.time_graph(launch, ring)))
                    mhc.TC_MIN_TOKENS = 10 ** 9
                    for cfg in candidates(hs):
                        mhc.FUSED_GEOMETRY[hs] = ((10 ** 9, cfg),)
                        rows.append((f"fused{cfg}", h.time_graph(launch, ring)))
            finally:
                mhc.FUSED_GEOMETRY.clear()
                mhc.FUSED_GEOMETRY.update(saved_geo)
                mhc.TC_MIN_TOKENS = saved_tc
            up = rows[0][1]
            for name, us in rows:
                line = {"hidden": hs, "T": t, "candidate": name, "us": round(us, 3),
                        "speedup": round(up / us, 3), "gpu": h.meta["gpu"]}
                print(json.dumps(line), flush=True)
                if out:
                    out.write(json.dumps(line) + "\n")
            name, us = min(rows[1:], key=lambda r: r[1])
            best[(hs, t)] = (name, us, up)
    for (hs, t), (name, us, up) in sorted(best.items()):
        print(f"hidden {hs} T {t:5d}: best {name:24s} {us:8.2f} us  upstream {up:8.2f} us  "
              f"{up / us:5.2f}x")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
