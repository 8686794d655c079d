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



def _save(fig, out: Path) -> Path:
    """Lay out, write (110 dpi) and close a figure; returns its path."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

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
    tput = [r for r in rows if r["kernel"] == "e2e" and r.get("tokens_per_s") is not None]
    if tput:
        written.append(chart_e2e(tput, meta, out_dir / f"{path.stem}-throughput.png"))
    if "yoco" in by_kernel:
        written.append(chart_yoco(by_kernel.pop("yoco"), meta, out_dir / f"{path.stem}-yoco.png"))
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
        _x_labels(ax, labels, "µs (median, lower is better)")
        ax.set_yscale("log")
        ax.set_title(f"{kernel} — {meta['gpu']} (torch {meta['torch']}, triton {meta['triton']})",
                     fontsize=9)
        ax.legend(fontsize=8)
        written.append(_save(fig, out_dir / f"{path.stem}-{kernel}.png"))
    return written


def _x_labels(ax, labels, ylabel: str, rotation: int = 35, fontsize: int = 7) -> None:
    ax.set_xticks(list(range(len(labels))))
    ax.set_xticklabels(labels, rotation=rotation, ha="right" if rotation else "center",
                       fontsize=fontsize)
    ax.set_ylabel(ylabel)


def chart_e2e(rs: list[dict], meta: dict, out: Path) -> Path:
    """vLLM serving throughput per mode (rows kernel="e2e"): decode per batch, prefill per
    prompt length, tokens/s (higher is better)."""
    import matplotlib.pyplot as plt
    phases = list(dict.fromkeys(r["shape"]["phase"] for r in rs))
    fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4.5), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        sel = [r for r in rs if r["shape"]["phase"] == phase]
        key = "batch" if phase == "decode" else "prompt_len"
        labels = list(dict.fromkeys(r["shape"][key] for r in sel))
        variants = list(dict.fromkeys(r["variant"] for r in sel))
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            vals = {r["shape"][key]: r["tokens_per_s"] for r in sel if r["variant"] == v}
            ax.bar([x - 0.4 + width * (i + 0.5) for x in range(len(labels))],
                   [vals.get(lab, 0) for lab in labels], width, label=v)
        _x_labels(ax, [f"{key} {lab}" for lab in labels], "tokens/s (higher is better)",
                  rotation=0, fontsize=8)
        ax.set_title(phase, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"vLLM serving throughput, {rs[0]['shape']['model']} — {meta['gpu']} "
                 f"(a100 = A100-faithful kernel choice run on this GPU, not an A100)", fontsize=9)
    return _save(fig, out)


def chart_yoco(rs: list[dict], meta: dict, out: Path) -> Path:
    """Cross-layer reuse: step time off/on per shape and variant (left), kernel launches per
    step off/on (right)."""
    import matplotlib.pyplot as plt
    labels = list(dict.fromkeys(_label(r["shape"]) for r in rs))
    variants = list(dict.fromkeys(r["variant"] for r in rs))
    fig, (ax_t, ax_n) = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(labels) + 4), 4.8))
    width = 0.8 / (2 * len(variants))
    xs = range(len(labels))
    for i, v in enumerate(variants):
        by = {_label(r["shape"]): r for r in rs if r["variant"] == v}
        for j, (mode, hatch) in enumerate((("off", ""), ("on", "//"))):
            k = 2 * i + j
            pos = [x - 0.4 + width * (k + 0.5) for x in xs]
            ax_t.bar(pos, [by[lab][f"us_{mode}"] if lab in by else 0 for lab in labels], width,
                     hatch=hatch, label=f"{v} reuse {mode}", color=f"C{i}", alpha=0.55 + 0.45 * j)
            ax_n.bar(pos, [by[lab][f"launches_{mode}"] if lab in by else 0 for lab in labels],
                     width, hatch=hatch, label=f"{v} reuse {mode}", color=f"C{i}",
                     alpha=0.55 + 0.45 * j)
    for ax, what in ((ax_t, "µs per step (median, eager)"), (ax_n, "CUDA kernels per step")):
        _x_labels(ax, labels, what)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle(f"DeepSeek-V4.1 attention, 40 layers, cross-layer metadata reuse — {meta['gpu']} "
                 f"(torch {meta['torch']}, triton {meta['triton']})", fontsize=9)
    return _save(fig, out)


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
