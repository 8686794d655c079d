#!/usr/bin/env python3
"""Run benchmark suites on a GPU and write one JSON results file.

    python benchmarks/run.py [--suite NAME ...] [--quick] [--out benchmarks/results/FILE.json]

Each suite (benchmarks/suites/<name>.py, a ``run(h: Harness)`` function) times our kernel
variants and the upstream vLLM 0.33.0 kernel at the same shapes in this one process; the
upstream kernels come from build/upstream_kernels (tools/extract_upstream.py), generated
from the pinned sdist — nothing of vLLM is installed or imported.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, Harness  # noqa: E402

SUITES = ["topk_swa", "kv_gather", "fp8", "fp8_writers", "fp8_writers_v4_compress",
          "sparse_mla_decode", "sparse_mla_prefill", "indexer_logits", "one_layer", "mhc",
          "mhc_decode", "yoco"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", action="append", choices=SUITES, help="default: all suites present")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    names = a.suite or [s for s in SUITES if (REPO / "benchmarks" / "suites" / f"{s}.py").is_file()]
    h = Harness(quick=a.quick)
    print(f"# {h.meta['gpu']}  torch {h.meta['torch']}  triton {h.meta['triton']}  "
          f"commit {h.meta['commit']}\n# copy {h.copy_gbps:.0f} GB/s   bf16 matmul "
          f"{h.matmul_tflops:.0f} TFLOP/s", flush=True)
    failed = []
    gpu = h.meta["gpu"].lower().replace("nvidia ", "").replace(" ", "-")
    out = a.out or REPO / "benchmarks" / "results" / f"{gpu}-{dt.date.today().isoformat()}.json"
    h.meta["suites"] = names
    h.out = out
    for name in names:
        try:
            importlib.import_module(f"suites.{name}").run(h)
        except Exception:
            traceback.print_exc()
            failed.append(name)
    h.meta["failed_suites"] = failed
    print(f"wrote {h.write(out)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
