"""How long the JIT warmup's TileLang builds of the mHC tensor-core projection take one after
another and on worker threads (feature ``warmup_threads``, vllm.deepinfer.mhc.kernels
``compile_tc_many``), on this machine, for sm_80, each form with a TileLang cache of its own.
No GPU is needed: TileLang lowers and nvcc compiles for an explicit target.

    python benchmarks/diag/warmup_threads.py --out benchmarks/results/cpu-<date>-warmup-threads-<commit>.json
    python benchmarks/diag/warmup_threads.py --dry-run      # the keys and forms only

Rows ``kernel="warmup_threads"``: per form (``serial``: compile_tc per key; ``par``:
compile_tc_many with ``workers`` threads) the wall seconds for KEYS, and the sha256 of each
key's CUDA source (the forms must agree).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import diag_meta  # noqa: E402 (this folder: the script's own)

REPO = diag_meta.REPO
# The projection keys V4.1 at hidden 4096 takes above 32 tokens on a 108-SM A100
# (k = 4 x 4096 columns): token tiles of 32 and 64 rows at each split count it picks.
KEYS = ((16384, 24, 64, 1), (16384, 24, 64, 4), (16384, 24, 64, 16), (16384, 24, 32, 64))

_CHILD = r"""
import hashlib, json, os, sys, time
sys.path.insert(0, os.path.join(sys.argv[1], "overlay"))
from tilelang import tvm
from vllm.deepinfer.mhc import kernels
keys = [kernels.TcKey(*k) for k in json.loads(sys.argv[3])]
workers = int(sys.argv[2])
kernels._kernel_factory()
with tvm.target.Target({"kind": "cuda", "arch": "sm_80"}):
    t0 = time.perf_counter()
    if workers > 1:
        kernels.compile_tc_many(keys, workers)
    else:
        for k in keys:
            kernels.compile_tc(k)
    wall = time.perf_counter() - t0
    src = [kernels.compile_tc(k).get_kernel_source() for k in keys]
print(json.dumps(dict(seconds=wall, sha256=[hashlib.sha256(s.encode()).hexdigest() for s in src])))
"""


def measure(workers: int, keys=KEYS) -> dict:
    """Build ``keys`` (TcKey fields) for sm_80 in a fresh process with an empty TileLang cache:
    one at a time (``workers`` 1) or through compile_tc_many; ``{seconds, sha256}``."""
    with tempfile.TemporaryDirectory(prefix="warmup-threads-") as d:
        script = Path(d) / "child.py"
        script.write_text(_CHILD)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
        env.update(CUDA_VISIBLE_DEVICES="", TILELANG_CACHE_DIR=str(Path(d) / "cache"))
        r = subprocess.run([sys.executable, str(script), str(REPO), str(workers),
                            json.dumps(keys)], env=env, capture_output=True, text=True,
                           timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-3000:])
        return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="results JSON")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dry-run", action="store_true", help="print the keys and forms, exit")
    args = ap.parse_args(argv)
    forms = [("serial", 1), ("par", max(2, args.workers))]
    if args.dry_run:
        print(json.dumps(dict(keys=KEYS, forms=forms)))
        return 0
    rows = []
    for form, workers in forms:
        got = measure(workers)
        rows.append(dict(kernel="warmup_threads", variant=form,
                         shape=dict(keys=len(KEYS), target="sm_80", workers=workers),
                         seconds=round(got["seconds"], 2), sha256=got["sha256"]))
        print(f"{form:6} workers {workers}: {got['seconds']:.1f} s", flush=True)
    same = rows[0]["sha256"] == rows[1]["sha256"]
    for r in rows:
        r["same_source_as_serial"] = same
    print(f"same CUDA source per key: {same}")
    meta = dict(gpu="none (a CPU machine; TileLang builds for sm_80, no GPU involved)",
                torch=diag_meta.version("torch"), triton=diag_meta.version("triton"),
                tilelang=diag_meta.version("tilelang"), commit=diag_meta.commit(),
                cpus=os.cpu_count(), date=datetime.date.today().isoformat(),
                keys=[dict(zip(("k", "n_out", "block_m", "n_splits"), k)) for k in KEYS])
    if args.out:
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
