#!/usr/bin/env python3
"""Join the results files of one suite run split across device commands
(``DEEPINFER_SUITE_PART=i/n``) into one file.

    python3 benchmarks/merge_results.py --out F.json PART1.json PART2.json ...

The parts must come from the same GPU, torch, Triton and commit. With ``--suite NAME`` whose
module has ``case_order(shape)``, rows are put back in the suite's case order (stable: the
variants of a case keep their order). Rows keep the rates they
were computed with (``matmul_share`` and ``roofline_share`` against the bf16 matmul and copy
rates each part measured); the merged meta keeps the first part's and lists every part's
rates and date under ``parts``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SAME = ("gpu", "torch", "triton", "commit", "suites")
PER_PART = ("date", "bf16_matmul_TFLOPs", "copy_bandwidth_GBps")


def merge(parts: list[dict], names: list[str], order=None) -> dict:
    if not parts:
        raise ValueError("no parts given")
    first = parts[0]["meta"]
    for name, p in zip(names, parts):
        for k in SAME:
            if p["meta"].get(k) != first.get(k):
                raise ValueError(f"{name}: meta {k!r} is {p['meta'].get(k)!r}, the first part's "
                                 f"is {first.get(k)!r}: not parts of one run")
        if p["meta"].get("failed_suites"):
            raise ValueError(f"{name}: failed suites {p['meta']['failed_suites']}")
    meta = dict(first, parts=[dict({k: p["meta"].get(k) for k in PER_PART}, file=n)
                              for n, p in zip(names, parts)])
    rows = [r for p in parts for r in p["rows"]]
    if order is not None:
        rows.sort(key=lambda r: order(r["shape"]))
    return {"meta": meta, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--suite", help="order rows by benchmarks/suites/SUITE.py's case_order")
    a = ap.parse_args(argv)
    order = None
    if a.suite:
        import importlib
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        order = importlib.import_module(f"suites.{a.suite}").case_order
    try:
        out = merge([json.loads(p.read_text()) for p in a.parts], [p.name for p in a.parts],
                    order)
    except ValueError as e:
        print(f"merge_results: {e}", file=sys.stderr)
        return 2
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out} ({len(out['rows'])} rows from {len(a.parts)} parts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
