#!/usr/bin/env python3
"""A100 cost model from the machine code of our Triton kernels (docs/a100-model.md).

No Ampere GPU is available to this project, so this tool predicts what an A100 would take
for a kernel from what can be known without one: the sm_80 build of the kernel (the same
``triton.compile`` the compile gate runs, then ``cuobjdump -sass``) and the A100's published
per-SM throughputs, latencies and memory bandwidth. The same code, compiled for sm_90 and
fed the H200's figures, predicts the H200 times this project has measured; the error of those
predictions is the model's validation (``validate``).

For one launch (grid, loop trip counts, bytes) the model takes, per warp, every SASS
instruction of the kernel weighted by how often it runs (straight-line code once, a loop's
body once per trip) and computes, for the busiest SM:

* issue: warp instructions / (schedulers with a warp, 1 instruction per clock each);
* pipes: per execution pipe (FP32/IMAD ``fma``, integer/logic ``alu``, conversions and
  MUFU ``xu``, shared/global/shuffle L1 wavefronts ``lsu``, tensor FLOPs ``tensor``) the
  work over the pipe's published rate;
* latency: one warp's run through the code alone, simulated from the stall counts and
  scoreboard waits the compiler wrote into each instruction's control bits, with published
  latencies for the variable-latency operations (DRAM, shared memory, conversions, MUFU),
  times the rounds of resident CTAs the SM runs one after another;

the SM time is the largest of these; the kernel time is the larger of the SM time and the
bytes over the achievable DRAM bandwidth, plus a fixed launch time. ``limit`` is the
roofline of the same launch: max(bytes / peak DRAM bandwidth, FLOPs / tensor rate).

    python tools/a100_model.py counts   --kernel decode.sm80 --cc 80 [--ops]
    python tools/a100_model.py validate [--json F] [--markdown F]
    python tools/a100_model.py decode   [--variant sm80 ...] [--measured F] [--json F] [--chart P]
    python tools/a100_model.py annotate RESULTS.json [--out F] [--chart PNG]

It compiles kernels, so it needs the real Triton (no TRITON_INTERPRET) and the overlay on
the path (the tool puts it there); no GPU. Compiled SASS is cached under build/a100_model/
keyed by the kernel's source hash, constexprs, target and Triton version.
"""
# The model lives in the package tools/a100cost/ beside this file, one module per part
# (common: paths and ModelError; gpus: the GPU tables; sass: the SASS parser; scheduler: pipe
# costs and the scheduler simulation; builds: compiling and caching kernels; bounds: launch
# bounds and ``predict``; workloads: the suites' launches; validation: the H200 validation;
# reports: decode and prefill prediction tables). This file is the command, and it re-exports
# the package's names (``import a100_model as m; m.predict(...)``). Those are copies: to change
# what the model reads, set it where it is read (``a100cost.builds.CACHE``,
# ``a100cost.workloads._spec``).
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
# The package sits beside this command; its folder goes on the path also when the file is
# loaded by path from elsewhere.
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

from a100cost.bounds import (Launch, Workload, launch_bounds, occupancy,  # noqa: E402,F401
                             predict)
from a100cost.builds import (CACHE, Code, _params, _spec, _spec_key, code_for,  # noqa: E402,F401
                             compile_code, runtime_attrs)
from a100cost.common import BUILD, REPO, RESULTS, ModelError  # noqa: E402,F401
from a100cost.gpus import A100_40GB, A100_80GB, GPU, GPUS, H200  # noqa: E402,F401
from a100cost.reports import (DECODE_BATCHES, ONE_CHAIN, annotate_rows,  # noqa: E402,F401
                              decode_chart, decode_predictions, prefill_rows)
from a100cost.sass import (CLASSES, Inst, Loop, access_bytes, classify,  # noqa: E402,F401
                           decode_control, find_loops, hmma_flops, parse_sass)
from a100cost.scheduler import pipe_costs, simulate  # noqa: E402,F401
from a100cost.validation import (VALIDATION_SOURCES, VALIDATION_VARIANTS,  # noqa: E402,F401
                                 _meta, measured_rows, validate, validation_markdown,
                                 workload_for_row)
from a100cost.workloads import (_prefill_bytes, decode_workload,  # noqa: E402,F401
                                gather_workload, indexer_workload, prefill_workload,
                                upstream_prefill_workload, writer_workload)

PROG = "a100_model"


# ============================================================================ CLI
def _counts(args) -> int:
    if args.kernel in _NAMED:
        code = _NAMED[args.kernel](args.cc)
    else:
        code = code_for(_spec(args.kernel), args.cc)
    print(f"{code.name} sm_{code.cc}: {len(code.insts)} instructions, {code.num_warps} warps, "
          f"{code.regs} registers, {code.shared} B shared, loops (largest first): "
          f"{[(hex(lp.start), hex(lp.end)) for lp in code.loops]}")
    regs = code.regions()
    for r in sorted(regs):
        c = collections.Counter(i.cls for i in regs[r])
        label = "straight-line" if r < 0 else f"loop {r}"
        print(f"  {label:14s} {len(regs[r]):5d}  " + "  ".join(
            f"{k}={c[k]}" for k in CLASSES if c.get(k)))
        if args.ops:
            ops = collections.Counter(i.op for i in regs[r])
            print("      " + "  ".join(f"{o}={n}" for o, n in ops.most_common()))
    return 0


_NAMED = {
    # Shorthands for the counts command (any registered spec name works too): the decode
    # kernel as the suite launches it at 64 tokens x 64 heads, specialized like that call.
    "decode.sm80": lambda cc: decode_workload(64, 64, 512, 128, "sm80", cc,
                                              H200.sms if cc >= 90 else A100_40GB.sms)
    .launches[0].code,
    "decode.sm90": lambda cc: decode_workload(64, 64, 512, 128, "sm90", cc, H200.sms)
    .launches[0].code,
}


def _validate(args) -> int:
    res = validate()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    md = validation_markdown(res)
    if args.markdown:
        Path(args.markdown).write_text(md)
    print(md)
    return 0


def _decode(args) -> int:
    """A100 predictions of the decode suite's shapes for each --variant; with --measured,
    the H200 decode rows of that results file (annotated) come first, so the JSON and the
    chart put measurement and prediction side by side."""
    variants = args.variant or ["sm80"]
    rows: list[dict] = []
    if args.measured:
        src = json.loads(Path(args.measured).read_text())
        rows = [dict(r, source=Path(args.measured).name) for r in src["rows"]
                if r.get("kernel") == "sparse_mla_decode"]
        annotate_rows(rows, int(src["meta"].get("sm_count") or H200.sms))
    have = {(r["variant"], json.dumps(r["shape"], sort_keys=True)) for r in rows}
    for v in variants:
        for p in decode_predictions(v):
            shape = dict(tokens=p["tokens"], heads=p["heads"], topk=512, window=128)
            if (v, json.dumps(shape, sort_keys=True)) in have:
                continue
            h = decode_workload(p["tokens"], p["heads"], 512, 128, v, 90, H200.sms)
            rows.append({"kernel": "sparse_mla_decode", "variant": v, "shape": shape,
                         "ours_us": None, "predicted_h200_us": round(predict(h, H200)["us"], 2),
                         **{k: p[k] for k in ("predicted_a100_40gb_us", "predicted_a100_80gb_us",
                                              "a100_40gb_limit_us", "a100_80gb_limit_us")},
                         "a100_bound": p["bound"], "tflops_a100_40gb": p["tflops_a100_40gb"]})
    out = {"meta": {**_meta(), "note": "predicted_* are model predictions (tools/a100_model.py);"
                    " ours_us are H200 measurements where present"}, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(r["variant"], r["shape"]["tokens"], r["shape"]["heads"], r["shape"]["topk"],
              r.get("ours_us"), r.get("predicted_h200_us"), r.get("predicted_a100_40gb_us"),
              r.get("predicted_a100_80gb_us"), r.get("a100_40gb_limit_us"))
    if args.chart:
        print(decode_chart(rows, "sparse_mla_decode — H200 measured (where present), A100 "
                           "predicted by tools/a100_model.py", Path(args.chart)))
    return 0


def _annotate(args) -> int:
    path = Path(args.results)
    data = json.loads(path.read_text())
    n = annotate_rows(data["rows"], int(data.get("meta", {}).get("sm_count") or H200.sms))
    data.setdefault("meta", {})["a100_model"] = {
        "tool": "tools/a100_model.py annotate", "commit": _meta()["commit"],
        "note": "predicted_a100_* are model predictions, not measurements"}
    out = Path(args.out) if args.out else path
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"annotated {n} decode rows -> {out}")
    if args.chart:
        print(decode_chart(data["rows"], f"sparse_mla_decode — H200 measured, A100 predicted "
                           f"({path.name})", Path(args.chart)))
    return 0


def _prefill(args) -> int:
    path = Path(args.measured)
    data = json.loads(path.read_text())
    rows = prefill_rows(data)
    if not rows:
        raise ModelError(f"{path}: no sparse_mla_prefill rows")
    errs = collections.defaultdict(list)
    for r in rows:
        errs[r["variant"]].append(r["error"])
        errs["upstream"].append(r["upstream_error"])
    summary = {k: {"rows": len(v), "median_abs_error": round(sorted(map(abs, v))[len(v) // 2], 4),
                   "max_abs_error": round(max(map(abs, v)), 4),
                   "mean_error": round(sum(v) / len(v), 4)} for k, v in errs.items()}
    out = {"meta": {**_meta(), "measured": path.name, "measured_commit": data["meta"].get("commit"),
                    "note": "predicted_* are model predictions (tools/a100_model.py), not "
                    "measurements; measured_* are the H200 times of the results file"},
           "rows": rows, "summary": summary}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print("| variant | T | ctx | top-k | heads | H200 meas / pred µs (error) | upstream H200 meas / "
          "pred µs (error) | A100-40GB ours / upstream µs (×) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["shape"]
        a100 = (f"{r['predicted_a100_40gb_us']:.0f} / {r['upstream_predicted_a100_40gb_us']:.0f} "
                f"({r['predicted_speedup_a100_40gb']:.2f}×)" if r["variant"] == "sm80" else "–")
        print(f"| {r['variant']} | {s['tokens']} | {s['ctx']} | {s['topk']} | {s['heads']} | "
              f"{r['measured_h200_us']:.0f} / {r['predicted_h200_us']:.0f} ({r['error']:+.0%}) | "
              f"{r['upstream_measured_h200_us']:.0f} / {r['upstream_predicted_h200_us']:.0f} "
              f"({r['upstream_error']:+.0%}) | {a100} |")
    print(json.dumps(summary))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("counts", help="SASS instruction classes per region of one kernel")
    c.add_argument("--kernel", required=True, help="compile-gate spec name or a shorthand: "
                   + ", ".join(_NAMED))
    c.add_argument("--cc", type=int, default=80)
    c.add_argument("--ops", action="store_true", help="also count each mnemonic")
    v = sub.add_parser("validate", help="predict the committed H200 rows; A100 beside them")
    v.add_argument("--json")
    v.add_argument("--markdown")
    d = sub.add_parser("decode", help="A100 predictions for the decode suite's shapes")
    d.add_argument("--variant", action="append", help="decode tile row (repeatable; sm80)")
    d.add_argument("--measured", help="an H200 results file whose decode rows go first")
    d.add_argument("--json")
    d.add_argument("--chart", help="PNG chart of the rows (needs matplotlib)")
    n = sub.add_parser("annotate", help="add A100 predictions to a results file's decode rows")
    n.add_argument("results", help="a benchmarks/results/*.json file")
    n.add_argument("--out", help="write here instead of in place")
    n.add_argument("--chart", help="also draw the decode chart (PNG; needs matplotlib)")
    f = sub.add_parser("prefill", help="model rows for a sparse_mla_prefill results file: "
                       "H200 error of ours and upstream's kernel, A100 predictions of both")
    f.add_argument("--measured", required=True, help="a benchmarks/results/*.json file")
    f.add_argument("--json")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(f"{PROG}: TRITON_INTERPRET is set: the model compiles real kernels; unset it",
              file=sys.stderr)
        return 2
    try:
        return {"counts": _counts, "validate": _validate, "decode": _decode,
                "annotate": _annotate, "prefill": _prefill}[a.cmd](a)
    except ModelError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
