"""Prediction tables: A100 decode predictions, A100 annotations of a results file's decode
rows, the decode chart, and the model rows of a sparse_mla_prefill results file."""
from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

from .bounds import predict
from .common import _overlay_on_path
from .gpus import A100_40GB, A100_80GB, H200
from .workloads import _prefill_bytes, decode_workload, prefill_workload, upstream_prefill_workload


# ============================================================================ decode table
DECODE_BATCHES = (1, 4, 16, 64, 128)


def decode_predictions(variant: str) -> list[dict]:
    """A100 predictions (40 and 80 GB) for the decode suite's shapes (64 and 128 heads,
    top-k 512 + window 128), with the A100 roofline limit beside each."""
    rows = []
    for heads in (64, 128):
        for t in DECODE_BATCHES:
            wl = decode_workload(t, heads, 512, 128, variant, 80, A100_40GB.sms)
            p40, p80 = predict(wl, A100_40GB), predict(wl, A100_80GB)
            rows.append({"tokens": t, "heads": heads, "variant": variant,
                         "predicted_a100_40gb_us": round(p40["us"], 2),
                         "a100_40gb_limit_us": round(p40["limit_us"], 2),
                         "predicted_a100_80gb_us": round(p80["us"], 2),
                         "a100_80gb_limit_us": round(p80["limit_us"], 2),
                         "bound": p40["bound"],
                         "tflops_a100_40gb": round(wl.flops / p40["us"] * 1e-6, 1)})
    return rows


# ============================================================================ annotate
def annotate_rows(rows: list[dict], sms_h200: int = H200.sms) -> int:
    """Add the A100 predictions beside every decode row of the Ampere code path (variants
    named sm80...): ``predicted_a100_40gb_us``, ``predicted_a100_80gb_us`` and the roofline
    limits ``a100_40gb_limit_us`` / ``a100_80gb_limit_us`` (max of bytes over the peak HBM
    bandwidth and FLOPs over the tensor rate), plus ``predicted_h200_us`` (the model on the
    H200 row itself: its error is the check). Returns the number of rows annotated."""
    _overlay_on_path()
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    n = 0
    for r in rows:
        if r.get("kernel") != "sparse_mla_decode" or r.get("variant") not in smd.TILES:
            continue
        s = r["shape"]
        if r["variant"].startswith("sm80"):
            a = decode_workload(s["tokens"], s["heads"], s["topk"], s["window"], r["variant"],
                                80, A100_40GB.sms)
            p40, p80 = predict(a, A100_40GB), predict(a, A100_80GB)
            r["predicted_a100_40gb_us"] = round(p40["us"], 2)
            r["predicted_a100_80gb_us"] = round(p80["us"], 2)
            r["a100_40gb_limit_us"] = round(p40["limit_us"], 2)
            r["a100_80gb_limit_us"] = round(p80["limit_us"], 2)
            r["a100_bound"] = p40["bound"]
        h = decode_workload(s["tokens"], s["heads"], s["topk"], s["window"], r["variant"], 90,
                            sms_h200)
        r["predicted_h200_us"] = round(predict(h, H200)["us"], 2)
        n += 1
    return n


def decode_chart(rows: list[dict], title: str, out: Path) -> Path:
    """Decode rows: measured H200 time per variant, predicted A100 (40/80 GB) time of the
    Ampere variants and the A100 limit, per shape (log scale). Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r.get("kernel") == "sparse_mla_decode"]
    labels = list(dict.fromkeys(f"T={r['shape']['tokens']},H={r['shape']['heads']},"
                                f"k={r['shape']['topk']}" for r in rows))

    def label(r):
        return f"T={r['shape']['tokens']},H={r['shape']['heads']},k={r['shape']['topk']}"

    series: dict = collections.OrderedDict()
    for r in rows:
        if r.get("ours_us") is not None:
            series.setdefault(f"H200 measured {r['variant']}", {})[label(r)] = r["ours_us"]
        elif r.get("predicted_h200_us") is not None:
            series.setdefault(f"H200 predicted {r['variant']}", {})[label(r)] = \
                r["predicted_h200_us"]
        if r.get("predicted_a100_40gb_us") is not None:
            series.setdefault(f"A100-40GB predicted {r['variant']}", {})[label(r)] = \
                r["predicted_a100_40gb_us"]
            series.setdefault(f"A100-80GB predicted {r['variant']}", {})[label(r)] = \
                r["predicted_a100_80gb_us"]
    limit40 = {label(r): r["a100_40gb_limit_us"] for r in rows if r.get("a100_40gb_limit_us")}
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(labels) + 3), 5))
    width = 0.8 / max(1, len(series))
    for k, (name, vals) in enumerate(series.items()):
        ax.bar([x - 0.4 + width * (k + 0.5) for x in range(len(labels))],
               [vals.get(lab) or 0 for lab in labels], width, label=name)
    ax.plot(range(len(labels)), [limit40.get(lab, float("nan")) for lab in labels], "k_",
            markersize=18, label="A100-40GB limit (bytes/HBM, FLOPs/tensor)")
    ax.set_xticks(list(range(len(labels))))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("µs (lower is better)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# A row of the prefill tile table the model adds for itself: the Ampere tile with
# qk_halves off (the spec is sm80's; prefill_workload takes the tile from the row).
ONE_CHAIN = "sm80-one-chain"


def prefill_rows(data: dict) -> list[dict]:
    """Model rows for a sparse_mla_prefill results file: for each measured row (ours sm80 /
    sm90 and, in the same row, upstream's kernel) the model's H200 time from the sm_90
    build and its error; for the Ampere tile, A100 predictions of ours and of upstream's
    kernel from their sm_80 builds, the limit, the predicted ratio, and ours with one Q.K^T
    chain (``*_one_chain``, when the shipped tile has two). Rows that ran the Gluon
    producer/consumer kernel (``impl`` "gluon_ws") are skipped: the model does not simulate
    warp-specialized kernels. An ``sm90`` row without ``impl`` (files from before that
    kernel) ran the Triton tile, modelled as ``sm90-triton``."""
    _overlay_on_path()
    from vllm.deepinfer.kernels import sparse_mla_prefill as spm
    spm.TILES.setdefault(ONE_CHAIN, dataclasses.replace(spm.TILES["sm80"], qk_halves=False))
    out = []
    for r in data["rows"]:
        if (r.get("kernel") != "sparse_mla_prefill"
                or r.get("variant") not in ("sm80", "sm90", "sm90-triton")
                or r.get("impl") == "gluon_ws"):
            continue
        sh = r["shape"]
        nb = float(r["bytes"]) if r.get("bytes") else _prefill_bytes(sh)
        model_variant = "sm90-triton" if r["variant"] == "sm90" else r["variant"]
        ours = predict(prefill_workload(sh, model_variant, 90, nb), H200)
        up = predict(upstream_prefill_workload(sh, 90, nb), H200)
        row = {"kernel": "sparse_mla_prefill", "variant": r["variant"], "shape": sh,
               "measured_h200_us": r["ours_us"], "predicted_h200_us": round(ours["us"], 2),
               "error": round(ours["us"] / r["ours_us"] - 1, 4), "bound": ours["bound"],
               "upstream_measured_h200_us": r["upstream_us"],
               "upstream_predicted_h200_us": round(up["us"], 2),
               "upstream_error": round(up["us"] / r["upstream_us"] - 1, 4)}
        if r["variant"] == "sm80":
            for name, gpu in (("a100_40gb", A100_40GB), ("a100_80gb", A100_80GB)):
                a = predict(prefill_workload(sh, "sm80", 80, nb), gpu)
                if spm.TILES["sm80"].qk_halves:  # the same tile with one Q.K^T chain
                    one = predict(prefill_workload(sh, ONE_CHAIN, 80, nb), gpu)
                    row[f"predicted_{name}_us_one_chain"] = round(one["us"], 2)
                u = predict(upstream_prefill_workload(sh, 80, nb), gpu)
                row.update({f"predicted_{name}_us": round(a["us"], 2),
                            f"upstream_predicted_{name}_us": round(u["us"], 2),
                            f"{name}_limit_us": round(a["limit_us"], 2),
                            f"predicted_speedup_{name}": round(u["us"] / a["us"], 3),
                            f"{name}_bound": a["bound"]})
        out.append(row)
    return out
