#!/usr/bin/env python3
"""PNG charts from benchmark results: one chart per kernel, ours vs upstream per shape.

    python benchmarks/charts.py benchmarks/results/FILE.json [...] [--out benchmarks/results/charts]

Needs matplotlib (not needed anywhere else); run it where the JSON is, not on the GPU.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def _label(shape: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def chart(path: Path, out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["rows"]
    by_kernel: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("ours_us") is not None:
            by_kernel[r["kernel"]].append(r)
    written = []
    for kernel, rs in by_kernel.items():
        labels = list(dict.fromkeys(_label(r["shape"]) for r in rs))
        variants = list(dict.fromkeys(r["variant"] for r in rs))
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) + 3), 4.5))
        width = 0.8 / (len(variants) + 1)
        up = {}
        for r in rs:
            if r.get("upstream_us") is not None:
                up.setdefault(_label(r["shape"]), r["upstream_us"])
        xs = range(len(labels))
        ax.bar([x - 0.4 + width / 2 for x in xs], [up.get(lab, 0) for lab in labels], width,
               label="upstream 0.33.0", color="#999999")
        for i, v in enumerate(variants):
            vals = {(_label(r["shape"])): r["ours_us"] for r in rs if r["variant"] == v}
            ax.bar([x - 0.4 + width * (i + 1.5) for x in xs], [vals.get(lab, 0) for lab in labels],
                   width, label=f"ours ({v})")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("µs (median, lower is better)")
        ax.set_yscale("log")
        ax.set_title(f"{kernel} — {meta['gpu']} (torch {meta['torch']}, triton {meta['triton']})",
                     fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out = out_dir / f"{path.stem}-{kernel}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "charts")
    a = ap.parse_args(argv)
    for p in a.results:
        for w in chart(p, a.out):
            print(w)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
