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
    serve = [r for r in rows if r["kernel"] == "serve" and r.get("output_tok_s") is not None]
    if serve:
        written.append(chart_serve(serve, meta, out_dir / f"{path.stem}-serve.png"))
    long_rows = [r for r in rows if r["kernel"] == "long_context"]
    if long_rows:
        written.append(chart_long(long_rows, [r for r in rows if r["kernel"] == "long_context_stage"],
                                  meta, out_dir / f"{path.stem}-long-context.png"))
    spec = [r for r in rows if r["kernel"] == "spec_decode" and r.get("tokens_per_s") is not None]
    if spec:
        written.append(chart_spec(spec, meta, out_dir / f"{path.stem}-spec-decode.png"))
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


def serve_series(rs: list[dict]) -> dict:
    """The serve chart's data (rows kernel="serve"): per (input_len, output_len) and metric
    ("output_tok_s", "ttft_ms_p50", "tpot_ms_p50"), per line key (variant, cuda_graphs) the
    (concurrency, value) points sorted by concurrency. Rows without the value are left out."""
    out: dict = {}
    for r in rs:
        s = r["shape"]
        for what in ("output_tok_s", "ttft_ms_p50", "tpot_ms_p50"):
            if r.get(what) is not None:
                out.setdefault((s["input_len"], s["output_len"]), {}).setdefault(what, {}) \
                    .setdefault((r["variant"], s.get("cuda_graphs", False)), []) \
                    .append((s["concurrency"], r[what]))
    for by_metric in out.values():
        for lines in by_metric.values():
            for pts in lines.values():
                pts.sort()
    return out


def chart_serve(rs: list[dict], meta: dict, out: Path) -> Path:
    """vllm serve measured by vllm bench serve (rows kernel="serve"): output tok/s, TTFT and
    TPOT medians against the concurrency, one row of plots per (input, output) length, one
    line per mode."""
    import matplotlib.pyplot as plt
    d = serve_series(rs)
    shapes = sorted(d)
    metrics = (("output_tok_s", "output tokens/s (higher is better)"),
               ("ttft_ms_p50", "TTFT median, ms"), ("tpot_ms_p50", "TPOT median, ms"))
    fig, axes = plt.subplots(len(shapes), 3, figsize=(16, 4.2 * len(shapes)), squeeze=False)
    for row, shp in zip(axes, shapes):
        for ax, (what, ylabel) in zip(row, metrics):
            for (variant, graphs), pts in d[shp].get(what, {}).items():
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        label=f"{variant}{' graphs' if graphs else ' eager'}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency (vllm bench serve --max-concurrency)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{shp[0]} in / {shp[1]} out", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle(f"vllm serve, {rs[0]['shape']['model']} — {meta.get('gpu')} (vLLM "
                 f"{meta.get('vllm')}; a100 = A100-faithful kernel choice run on this GPU, "
                 "not an A100)", fontsize=9)
    return _save(fig, out)


def long_series(rs: list[dict], stage_rows: list[dict]) -> dict:
    """The long-context chart's data (rows kernel="long_context" / "long_context_stage"):
    per line key (model, variant, cuda_graphs[, batch]) the (prompt_len, value) points sorted
    by length: "ttft" (batch 1, s), "prefill" and "decode" (tokens/s per batch), "peak" (GiB
    allocated, per batch); "stages": per (model, variant, cuda_graphs, prompt_len) the seconds
    of each stage. Failed requests (no value) are left out."""
    out: dict = {"ttft": {}, "prefill": {}, "decode": {}, "peak": {}, "stages": {}}
    for r in rs:
        s = r["shape"]
        key = (s["model"], r["variant"], s.get("cuda_graphs", False))
        n = s["prompt_len"]
        if r.get("tokens_per_s") is not None:
            out[s["phase"]].setdefault(key + (s["batch"],), []).append((n, r["tokens_per_s"]))
        if s["phase"] == "prefill":
            if s["batch"] == 1 and r.get("ttft_s") is not None:
                out["ttft"].setdefault(key, []).append((n, r["ttft_s"]))
            if r.get("peak_gib") is not None:
                out["peak"].setdefault(key + (s["batch"],), []).append((n, r["peak_gib"]))
    for r in stage_rows:
        s = r["shape"]
        if r.get("seconds") is not None:
            k = (s["model"], r["variant"], s.get("cuda_graphs", False), s["prompt_len"])
            out["stages"].setdefault(k, {})[s["stage"]] = r["seconds"]
    for what in ("ttft", "prefill", "decode", "peak"):
        for pts in out[what].values():
            pts.sort()
    return out


def chart_long(rs: list[dict], stage_rows: list[dict], meta: dict, out: Path) -> Path:
    """Long-context serving per model and mode: TTFT, decode tokens/s at that context and peak
    memory against the prompt length (batch 4 dashed), and the profiled prefill by stage."""
    import matplotlib.pyplot as plt
    d = long_series(rs, stage_rows)
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
    lab = lambda k: f"{k[0]} {k[1]}{' graphs' if k[2] else ''}"  # noqa: E731
    for ax, what, ylabel in ((axes[0], "ttft", "TTFT s (batch 1, lower is better)"),
                             (axes[1], "decode", "decode tokens/s at that context"),
                             (axes[2], "peak", "peak GiB allocated (KV cache included)")):
        for k, pts in d[what].items():
            style = "--" if len(k) > 3 and k[3] != 1 else "-"
            name = lab(k) + (f" b{k[3]}" if len(k) > 3 else "")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    ax = axes[3]
    keys = list(d["stages"])
    names = list(dict.fromkeys(st for v in d["stages"].values() for st in v))
    bottom = [0.0] * len(keys)
    for st in names:
        vals = [d["stages"][k].get(st, 0.0) for k in keys]
        ax.bar(range(len(keys)), vals, bottom=bottom, label=st)
        bottom = [b + v for b, v in zip(bottom, vals)]
    _x_labels(ax, [f"{lab(k)} L{k[3]}" for k in keys], "s of the prefill (kernel time per stage)")
    ax.legend(fontsize=7)
    fig.suptitle(f"Long-context serving — {meta.get('gpu')} (a100 = A100-faithful kernel choice "
                 "run on this GPU, not an A100)", fontsize=9)
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


def spec_series(rs: list[dict]) -> dict:
    """The speculative-decoding chart's data (rows kernel="spec_decode"): per panel (model,
    method, k) and per line (variant, cuda_graphs) the (batch, speculative tokens/s, plain
    tokens/s, verify / plain step) points sorted by batch."""
    out: dict = {}
    for r in rs:
        s = r["shape"]
        out.setdefault((s["model"], s["method"], s["k"]), {}).setdefault(
            (r["variant"], s.get("cuda_graphs", False)), []).append(
            (s["batch"], r["tokens_per_s"], r.get("plain_tokens_per_s"),
             r.get("verify_over_plain")))
    for lines in out.values():
        for pts in lines.values():
            pts.sort()
    return out


def chart_spec(rs: list[dict], meta: dict, out: Path) -> Path:
    """Speculative decoding served by vLLM: decode tokens/s with and without speculation per
    batch (top), the verify step over a plain decode step (bottom, the 1.5x goal marked)."""
    import matplotlib.pyplot as plt
    d = spec_series(rs)
    panels = sorted(d)
    fig, axes = plt.subplots(2, len(panels), figsize=(4.6 * len(panels), 7.5), squeeze=False)
    for i, key in enumerate(panels):
        ax_t, ax_r = axes[0][i], axes[1][i]
        for j, ((variant, graphs), pts) in enumerate(sorted(d[key].items())):
            label = f"{variant}{' graphs' if graphs else ' eager'}"
            xs = [p[0] for p in pts]
            ax_t.plot(xs, [p[1] for p in pts], marker="o", color=f"C{j}", label=f"{label} spec")
            nan = float("nan")   # a missing figure is a gap, not a zero
            ax_t.plot(xs, [nan if p[2] is None else p[2] for p in pts], marker="x", ls="--",
                      color=f"C{j}", label=f"{label} plain")
            ax_r.plot(xs, [nan if p[3] is None else p[3] for p in pts], marker="o",
                      color=f"C{j}", label=label)
        ax_r.axhline(1.5, color="#999999", ls=":", lw=1, label="goal 1.5x")
        if not any(p[3] is not None for pts in d[key].values() for p in pts):
            # no plain engine ran: an empty panel saying so (a log axis over no data fails)
            ax_r.text(0.5, 0.5, "no plain engine in this run", ha="center", va="center",
                      transform=ax_r.transAxes, fontsize=8)
            ax_r.set_xlim(0.8, 2 * max(p[0] for pts in d[key].values() for p in pts))
        for ax, what in ((ax_t, "decode tokens/s (higher is better)"),
                         (ax_r, "verify step / plain step")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.set_ylabel(what)
            ax.legend(fontsize=6)
        ax_t.set_title(f"{key[0]} {key[1]} k={key[2]}", fontsize=9)
    fig.suptitle(f"Speculative decoding in vLLM — {meta.get('gpu')}\n(a100 = A100-faithful "
                 "kernel choice run on this GPU, not an A100)", fontsize=9)
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
