"""The headline figures of benchmarks/results/INDEX.md: one short line per group, computed
from the current file's rows of that group alone (benchmarks/results_index.py renders them).

Standard library only, like results_index.py. The functions read a results file through the
attributes ``rows`` (the rows list) and ``data`` (the whole file) of results_index.Result;
this module does not import results_index (it imports this one).
"""
from __future__ import annotations

import json
import re
import statistics

# e2e row kernels of the per-rank shapes (e2e.py --models per-rank, benchmarks/e2e/
# e2e_models.PER_RANK_ROWS) -> the e2e.py step that writes them. results_index.E2E_STEP
# includes them; they are kept here because results_index.py is at its 600-line limit
# (tests/test_layout.py).
PER_RANK_STEP = {"per_rank_sm80_audit": "agree --models per-rank (sm_80 audit)",
                 "per_rank_agreement": "agree, graphs --models per-rank",
                 "per_rank_vs_fp32_reference": "reference --models per-rank",
                 "per_rank_reference_check": "reference --models per-rank (check)",
                 "per_rank_zero_compile": "nocompile --models per-rank"}
# e2e row kernels of the long step's 128K agreement (benchmarks/e2e/e2e_models.LONG_ROWS):
# their own names, so that a long run does not become the current agreement or reference
# file of the agreement models.
LONG_STEP = {"long_agreement": "long (agreement at 128K)",
             "long_vs_fp32_reference": "long_reference (128K)",
             "long_reference_check": "long_reference (128K, check)"}
# Rows of the CUDA-graph-mode and Hopper-parity drivers (benchmarks/e2e/graph_modes.py,
# parity.py; docs/e2e.md).
DRIVER_STEP = {"graph_mode": "graph_modes.py", "hopper_parity": "parity.py"}
# Rows of the speculative-decoding step (benchmarks/e2e/spec_step.py, e2e.py --steps spec).
SPEC_STEP = {"spec_decode": "spec", "spec_rule": "spec (the rule)",
             "spec_sm80_audit": "spec (sm_80 audit, speculation on)",
             "spec_zero_compile": "spec (zero compile, speculation on)"}
# Rows of the two-GPU step (benchmarks/e2e/topology.py; docs/e2e.md "Two GPUs"): their own
# names, so that a TP2 / PP2 file is not the current one-GPU agreement or throughput file.
TOPOLOGY_STEP = {"topology_agreement": "topology.py (agreement)",
                 "topology_vs_fp32_reference": "topology.py (reference)",
                 "topology_reference_check": "topology.py (reference check)",
                 "topology_sm80_audit": "topology.py (sm_80 audit per rank)",
                 "topology_zero_compile": "topology.py (zero compile per rank)",
                 "topology_tput": "topology.py (throughput)",
                 "topology_spec_decode": "topology.py (DSpark)",
                 "topology_spec_rule": "topology.py (DSpark rule)"}
EXTRA_STEP = {**PER_RANK_STEP, **LONG_STEP, **DRIVER_STEP, **SPEC_STEP, **TOPOLOGY_STEP}


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _f(x: float, nd: int = 2) -> str:
    return f"{x:.{nd}f}"


def _count(rows, key) -> str | None:
    vals = [row.get(key) for row in rows if isinstance(row.get(key), bool)]
    return f"{sum(vals)}/{len(vals)}" if vals else None


def _by_variant(rows) -> dict[str, list]:
    out: dict[str, list] = {}
    for row in rows:
        out.setdefault(str(row.get("variant")), []).append(row)
    return out


def headline_suite(rows: list) -> str:
    parts = []
    for v, rs in sorted(_by_variant(rows).items()):
        sp = [row["speedup"] for row in rs if _num(row.get("speedup"))]
        if sp:
            parts.append(f"{v} ×{_f(statistics.median(sp))} (min ×{_f(min(sp))}, {len(sp)})")
    out = []
    if parts:
        out.append("speedup vs upstream, median: " + ", ".join(parts))
    for key, label in (("exact", "bit-exact"), ("ok", "within tolerance"),
                       ("within_bound", "within bound"), ("identical", "identical")):
        c = _count(rows, key)
        if c:
            out.append(f"{label} {c}")
    return "; ".join(out) or f"{len(rows)} rows"


def _shape(row) -> dict:
    s = row.get("shape")
    return s if isinstance(s, dict) else {}


def headline_e2e(kernel: str, rows: list) -> str:
    if kernel == "e2e":
        out = []
        for phase, size in (("decode", "batch"), ("prefill", "prompt_len")):
            rs = [r for r in rows if _shape(r).get("phase") == phase and _num(_shape(r).get(size))]
            if not rs:
                continue
            top = max(_shape(r)[size] for r in rs)
            per = [f"{r.get('variant')} {r['tokens_per_s']:.0f}" for r in rs
                   if _shape(r)[size] == top and _num(r.get("tokens_per_s"))]
            out.append(f"{phase} {size} {top} tok/s: " + ", ".join(per))
        return "; ".join(out) or f"{len(rows)} rows"
    if kernel in ("e2e_agreement", "e2e_vs_fp32_reference", "per_rank_agreement",
                  "per_rank_vs_fp32_reference", "long_agreement", "long_vs_fp32_reference"):
        parts = []
        for v, rs in sorted(_by_variant(rows).items()):
            t = [r["top1_agree"] for r in rs if _num(r.get("top1_agree"))]
            if t:
                parts.append(f"{v} {_f(min(t), 3)}")
        return ("top-1 agreement, lowest: " + ", ".join(parts)) if parts else f"{len(rows)} rows"
    if kernel == "graph_mode" and _count(rows, "outputs_match_eager"):
        return f"outputs match eager {_count(rows, 'outputs_match_eager')}"
    if kernel == "spec_decode":
        per = [f"{r.get('variant')} {_shape(r).get('method')} {r['tokens_per_s']:.0f}/"
               f"{r['plain_tokens_per_s']:.0f}" for r in rows if _shape(r).get("batch") == 1
               and _num(r.get("tokens_per_s")) and _num(r.get("plain_tokens_per_s"))]
        return ("batch 1 tok/s, speculative/plain: " + ", ".join(per)) if per \
            else f"{len(rows)} rows"
    if kernel in ("sm80_audit", "per_rank_sm80_audit", "spec_sm80_audit"):
        parts = []
        for r in rows:
            failed = r.get("failed")
            n = len(failed) if isinstance(failed, list) else "?"
            parts.append(f"{_shape(r).get('model', '?')}: {n} failed checks over "
                         f"{r.get('triton_kernels', '?')} Triton kernels, {r.get('cuda_ops', '?')} CUDA ops")
        return "; ".join(parts)
    for key, label in (("passed", "passed"), ("identical", "identical")):
        c = _count(rows, key)
        if c:
            bad = sorted({f"{r.get('variant')}/{_shape(r).get('model', '?')}" for r in rows
                          if r.get(key) is False})
            # Name the failures only while the list stays short.
            return f"{label} {c}" + (f" (not: {', '.join(bad)})" if 0 < len(bad) <= 3 else "")
    return f"{len(rows)} rows"


def headline_tests(rows: list) -> str:
    parts = []
    for r in rows:
        c = _shape(r).get("commit", "")
        n = r.get("tests") or r.get("tests_run")
        counts = ", ".join(f"{r[k]} {w}" for k, w in (("tests_passed", "passed"),
                           ("tests_failed", "failed"), ("tests_skipped", "skipped")) if _num(r.get(k)))
        if counts and n is not None:
            counts += f" of {n}"
        if r.get("passed") is True:
            verdict = "passed" + (f" ({counts})" if counts else "")
        elif r.get("passed") is False:
            verdict = "FAILED" + (f" ({counts})" if counts else "")
        else:
            verdict = ("timed out" if r.get("timed_out") else "no verdict") + \
                      (f" ({counts})" if counts else "")
        parts.append(f"{c}: {verdict}" if c else verdict)
    return "; ".join(parts)


_LABELS = ("cand", "candidate", "row", "impl", "name", "variant", "launcher")
_BETTER = (("vs_upstream", "vs upstream"), ("predicted_speedup", "predicted speedup"),
           ("speedup", "speedup"))


def headline_sweep(r) -> str:
    rows = [x for x in r.rows if isinstance(x, dict)]
    timings = r.data.get("timings")
    if isinstance(timings, list):
        rows = [x for x in timings if isinstance(x, dict)]
    out = [f"{len(rows)} rows"]
    label = next((k for k in _LABELS if any(k in x for x in rows)), None)
    if label:
        out.append(f"{len({json.dumps(x.get(label), sort_keys=True) for x in rows})} {label} values")
    toks = sorted({x.get("tokens", _shape(x).get("tokens")) for x in rows} - {None},
                  key=lambda t: (str(type(t)), t))
    if toks and all(_num(t) for t in toks):
        out.append(f"tokens {toks[0]}–{toks[-1]}" if len(toks) > 1 else f"tokens {toks[0]}")
    for key, name in _BETTER:
        vals = [(x[key], x.get(label)) for x in rows if _num(x.get(key))]
        if vals:
            best = max(vals, key=lambda t: t[0])
            out.append(f"best {name} ×{_f(best[0])}" + (f" ({best[1]})" if best[1] is not None else ""))
            break
    if isinstance(r.data.get("gate"), list):
        out.append(f"{len(r.data['gate'])} gate specs")
    if isinstance(r.data.get("sm80"), dict) and r.data["sm80"]:
        out.append(f"{len(r.data['sm80'])} sm_80 builds")
    return "; ".join(out)


def headline_model(r) -> str:
    summary = r.data.get("summary")
    out = [f"{len(r.rows)} rows"]
    if isinstance(summary, dict):
        errs = [f"{k} {abs(v['median_abs_error']) * 100:.1f}%" for k, v in summary.items()
                if isinstance(v, dict) and _num(v.get("median_abs_error"))]
        if errs:
            out.append("median |error| vs H200 measured: " + ", ".join(errs))
    pred = sorted({m.group(1) for x in r.rows if isinstance(x, dict) for k in x
                   for m in [re.match(r"^predicted_(.+)_us$", k)] if m})
    if pred:
        out.append("predicts " + ", ".join(pred))
    if isinstance(r.data.get("sm80"), dict):
        out.append(f"{len(r.data['sm80'])} sm_80 candidates")
    return "; ".join(out)


def headline(category: str, key: str, r, rows: list) -> str:
    """The headline of group (category, key) for results file r, whose rows in it are rows."""
    if category == "suite":
        return headline_suite(rows)
    if category == "e2e":
        return headline_e2e(key, rows)
    if category == "tests":
        return headline_tests(rows)
    if category == "model":
        return headline_model(r)
    if category == "sweep":
        return headline_sweep(r)
    return f"{len(rows)} rows"
