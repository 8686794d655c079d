"""The validation: every committed H200 measurement of the covered kernels predicted from
the sm_90 build of the same code, the error reported, A100 predictions beside; the
metadata every output of the tool carries."""
from __future__ import annotations

import dataclasses
import json
import subprocess

from .bounds import Workload, predict
from .common import REPO, RESULTS, ModelError
from .gpus import A100_40GB, A100_80GB, GPUS, H200
from .workloads import decode_workload, gather_workload, indexer_workload, writer_workload


# ============================================================================ validation
# Committed H200 measurements the validation reads (GPU time from CUDA graphs), with the
# kernel families the model covers. The kernels' jitted code is the code of this commit
# (only named constants changed since these runs; docs/a100-model.md).
VALIDATION_SOURCES = {
    "sparse_mla_decode": "archive/h200-2026-11-29-final.json",
    "kv_gather": "archive/h200-2026-11-29-final.json",
    "v41_rope_quant_insert": "archive/h200-2026-11-29-final.json",
    "v41_indexer_k_store": "archive/h200-2026-11-29-final.json",
    "indexer_logits.paged": "archive/h200-2026-11-29-ampere-path-2f0f2b5.json",
    "indexer_logits.flat": "archive/h200-2026-11-29-ampere-path-2f0f2b5.json",
}
# Variants validated per family: the Ampere code path (software e4m3) compiled for sm_90,
# and for the decode also the Hopper variant (hardware e4m3, wgmma).
VALIDATION_VARIANTS = {
    "sparse_mla_decode": ("sm80", "sm90"), "kv_gather": ("sm80", "sm80-int"),
    "v41_rope_quant_insert": ("sm80",), "v41_indexer_k_store": ("sm80",),
    "indexer_logits.paged": ("sm80", "sm80-e4b15"), "indexer_logits.flat": ("sm80", "sm80-e4b15"),
}


def measured_rows() -> list[dict]:
    rows = []
    for kernel, fname in VALIDATION_SOURCES.items():
        data = json.loads((RESULTS / fname).read_text())
        for r in data["rows"]:
            if r.get("kernel") == kernel and r.get("variant") in VALIDATION_VARIANTS[kernel]:
                rows.append({**r, "source": fname, "commit": data["meta"]["commit"]})
    return rows


def workload_for_row(r: dict, cc: int, sms: int) -> Workload:
    k, v, s = r["kernel"], r["variant"], r["shape"]
    if k == "sparse_mla_decode":
        return decode_workload(s["tokens"], s["heads"], s["topk"], s["window"], v, cc, sms)
    if k == "kv_gather":
        return gather_workload(s, v, cc, sms)
    if k.startswith("indexer_logits."):
        return indexer_workload(k.split(".")[1], s, v, cc, sms)
    if k.startswith("v41_"):
        return writer_workload(k, s, v.split("-")[0], cc, r["bytes"])
    raise ModelError(f"no workload for kernel {k!r}")


def validate(latency_scales=(0.7, 1.0, 1.3)) -> dict:
    """Predict every committed H200 measurement of the covered kernels from the sm_90 build
    of the same code and report the error; then the A100 predictions of the same shapes."""
    rows = []
    for r in measured_rows():
        wl = workload_for_row(r, 90, H200.sms)
        preds = {sc: predict(wl, H200, sc) for sc in latency_scales}
        p = preds[1.0]
        if r["variant"].startswith("sm80"):  # hardware-e4m3 variants do not build for sm_80
            a_wl = workload_for_row(r, 80, A100_40GB.sms)
            a40, a80 = predict(a_wl, A100_40GB), predict(a_wl, A100_80GB)
        else:
            a40 = a80 = None
        rows.append({
            "kernel": r["kernel"], "variant": r["variant"], "shape": r["shape"],
            "source": r["source"], "measured_commit": r["commit"],
            "measured_h200_us": r["ours_us"], "predicted_h200_us": round(p["us"], 3),
            "error": round(p["us"] / r["ours_us"] - 1.0, 4),
            "bound": p["bound"],
            "error_latency_x0.7": round(preds[latency_scales[0]]["us"] / r["ours_us"] - 1, 4),
            "error_latency_x1.3": round(preds[latency_scales[-1]]["us"] / r["ours_us"] - 1, 4),
            "h200_launches": p["launches"],
            "predicted_a100_40gb_us": a40 and round(a40["us"], 3),
            "predicted_a100_80gb_us": a80 and round(a80["us"], 3),
            "a100_40gb_limit_us": a40 and round(a40["limit_us"], 3),
            "a100_80gb_limit_us": a80 and round(a80["limit_us"], 3),
            "a100_bound": a40 and a40["bound"],
        })
    summary = {}
    for fam in sorted({(r["kernel"], r["variant"]) for r in rows}):
        errs = [r["error"] for r in rows if (r["kernel"], r["variant"]) == fam]
        summary[f"{fam[0]}[{fam[1]}]"] = {
            "rows": len(errs),
            "median_abs_error": round(sorted(abs(e) for e in errs)[len(errs) // 2], 4),
            "max_abs_error": round(max(abs(e) for e in errs), 4),
            "mean_error": round(sum(errs) / len(errs), 4)}
    return {"meta": _meta(), "rows": rows, "summary": summary}


# meta.gpu of every file the model writes: the GPUs whose times it predicts, after this prefix
# (the wording of the committed a100-model-*.json files), so that no reader of the file or of
# benchmarks/results/INDEX.md takes a prediction for a measurement on that GPU.
MODEL_GPU_PREFIX = "model (no GPU ran): "
# meta.torch / meta.triton when the package cannot be imported: still a value, so the file
# says what it knows instead of leaving the provenance field empty.
NOT_IMPORTED = "not imported"


def _version(module: str) -> str:
    """module.__version__, or NOT_IMPORTED when the module cannot be imported."""
    try:
        mod = __import__(module)
    except ImportError:
        return NOT_IMPORTED
    return str(getattr(mod, "__version__", "") or NOT_IMPORTED)


def _meta(predicted=None) -> dict:
    """The provenance of a file the model writes: the tool, the commit, the modelled GPUs
    (``predicted``: keys of GPUS, default all of them) in ``gpu``, the torch and Triton the
    process would use, and the GPU tables themselves (all of GPUS, whatever was predicted)."""
    keys = list(GPUS) if predicted is None else list(predicted)
    unknown = [k for k in keys if k not in GPUS]
    if unknown or not keys:
        raise ModelError(f"_meta(predicted={predicted!r}): not GPUs of the model "
                         f"(GPUS has {', '.join(GPUS)})")
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"tool": "tools/a100_model.py", "commit": commit or "unknown",
            "gpu": MODEL_GPU_PREFIX + ", ".join(GPUS[k].name for k in keys),
            "torch": _version("torch"), "triton": _version("triton"),
            "gpus": {k: dataclasses.asdict(g) for k, g in GPUS.items()}}


def _shape_label(shape: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items() if k != "ragged") + (
        ",ragged" if shape.get("ragged") else "")


def validation_markdown(res: dict) -> str:
    out = ["| kernel | variant | shape | H200 measured µs | H200 predicted µs | error | bound "
           "| A100 40GB µs | A100 80GB µs |",
           "|---|---|---|---|---|---|---|---|---|"]
    def us(v):
        return "-" if v is None else f"{v:.1f}"

    for r in res["rows"]:
        out.append(f"| {r['kernel']} | {r['variant']} | {_shape_label(r['shape'])} | "
                   f"{r['measured_h200_us']:.1f} | {r['predicted_h200_us']:.1f} | "
                   f"{r['error'] * 100:+.0f}% | {r['bound']} | {us(r['predicted_a100_40gb_us'])} | "
                   f"{us(r['predicted_a100_80gb_us'])} |")
    out += ["", "| kernel[variant] | rows | median abs error | max abs error | mean error |",
            "|---|---|---|---|---|"]
    for k, s in res["summary"].items():
        out.append(f"| {k} | {s['rows']} | {s['median_abs_error'] * 100:.0f}% | "
                   f"{s['max_abs_error'] * 100:.0f}% | {s['mean_error'] * 100:+.0f}% |")
    return "\n".join(out) + "\n"
