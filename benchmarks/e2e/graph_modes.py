"""CUDA-graph modes of the throughput config in the A100-faithful mode: which mode vLLM
runs, whether its outputs match eager's, and decode tokens/s at batch 1, 8 and 32.

    python benchmarks/e2e/graph_modes.py [--work DIR] [--deadline S] [--bundle F --resume F]
        [--modes FULL_AND_PIECEWISE,FULL_DECODE_ONLY,PIECEWISE] [--captures default,max64]
        [--mode a100] [--quick] [--plan]
    python benchmarks/e2e/graph_modes.py --chart RESULTS.json [--out benchmarks/results/charts]

One engine per (cudagraph_mode, capture sizes), each alone on the GPU (run_engine.py: run.py's
tput engine with vLLM's compilation_config set), after one eager engine of the same mode:
  modes     compilation_config.cudagraph_mode: FULL_AND_PIECEWISE (vLLM's default: full
            graphs of uniform decode batches, piecewise graphs around attention for the
            rest), FULL_DECODE_ONLY (full graphs of decode batches, the rest eager),
            PIECEWISE (piecewise graphs only: attention eager at every step); FULL (full
            graphs of every batch) on request. vLLM resolves the mode against the lowest
            CUDA-graph support the attention groups' metadata builders report and lowers it,
            with a warning, where that is less than the mode needs; the resolved mode, the
            warning and the runtime modes the dispatcher chose at each decode batch are
            recorded (run_engine.py).
  captures  "default": vLLM's capture sizes (run.py's engine: max_num_seqs 64, so
            max_cudagraph_capture_size defaults to min(2 x 64, 512) = 128 and the sizes are
            1, 2, 4, 8, 16, ..., 128); "max64": max_cudagraph_capture_size 64 (sizes 1, 2,
            4, 8, ..., 64). Batches 1, 8 and 32 replay a graph of their own size in both.
  check     12 prompts of 7 to 5,000 tokens generated greedily in one call before run.py's
            warm-up (16 tokens each, top-20 logprobs; decode at a batch of 12, padded to the
            compared with the eager engine's (compare.pair): a match is
            bit-identical, or within the larger of the project's fixed tolerance (e2e.TOL)
            and the eager engine's own spread (its two generations of the same prompts,
            in one process).
Rows kernel="graph_mode" (variant = the requested mode, shape {model, cudagraph_mode,
capture_sizes, phase, batch, prompt_len}; resolved_mode, decode_tokens_per_s,
outputs_match_eager, ...) in benchmarks/results/<gpu>-<date>-e2e-graph-modes-<commit>.json,
meta.recommendation: the configuration with the highest decode tokens/s (geometric mean
over the batches) among those whose outputs match. Engine order, start-up estimates and the
bundle that carries finished engines between GPU machines: engine_plan.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import compare  # noqa: E402
import engine_plan as ep  # noqa: E402
from e2e_models import MODELS, TPUT_MODEL  # noqa: E402
from run_engine import dispatch_modes  # noqa: E402

GRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE")
KNOWN_MODES = GRAPH_MODES + ("FULL",)
CAPTURES = {"default": None, "max64": 64}
# Twelve prompts (a decode batch vLLM pads to the captured 16), past the 128-token window,
# past top-k 512 and over one 2,048-token prefill chunk.
CHECK_LENS = (7, 33, 64, 129, 300, 511, 700, 1024, 1500, 2100, 3000, 5000)
CHECK_GEN = 16
EAGER = "eager"
KIND = "e2e-graph-modes"
# vLLM's log lines that say it changed the requested mode (config/compilation.py
# resolve_cudagraph_mode_and_sizes and VllmConfig's checks).
DOWNGRADE_MARKS = ("setting cudagraph_mode", "overriding to", "is not supported with")


def engines(model: str, mode: str, modes, captures) -> list[ep.Engine]:
    """The eager engine (the check's reference), then every mode at vLLM's capture sizes,
    then every mode capped: a --deadline drops the capped ones first."""
    out = [ep.Engine(tag=f"{model}-graph-{mode}-{EAGER}", mode=mode,
                     cache=f"graph-{mode}-{EAGER}", eager=True, check_lens=CHECK_LENS,
                     check_gen=CHECK_GEN, check_repeat=2,
                     info=dict(cudagraph_mode="NONE", capture_sizes=None, requested=EAGER))]
    for cap in captures:
        for m in modes:
            cc = {"cudagraph_mode": m}
            if CAPTURES[cap] is not None:
                cc["max_cudagraph_capture_size"] = CAPTURES[cap]
            out.append(ep.Engine(tag=f"{model}-graph-{mode}-{m}-{cap}", mode=mode,
                                 cache=f"graph-{mode}-{m}-{cap}", compilation=cc,
                                 check_lens=CHECK_LENS, check_gen=CHECK_GEN,
                                 info=dict(cudagraph_mode=m, capture_sizes=cap, requested=m)))
    return out


# --------------------------------------------------------------------------- verdicts
def check_pair(ref: dict, got: dict) -> dict:
    """compare.pair of two check results (run.py agree layout), with identity."""
    p = compare.pair(ref, got)
    p["identical"] = compare.identical(p)
    return p


def eager_floor(eager_check: dict | None) -> dict | None:
    """The eager engine's own spread: its first generation against its second."""
    if not eager_check or not eager_check.get("repeats"):
        return None
    return check_pair(eager_check, dict(eager_check, prompts=eager_check["repeats"][0]))


def match_verdict(pair: dict | None, floor: dict | None, tol: dict) -> tuple[bool | None, str]:
    """(outputs_match_eager, the rule that decided): identical, or top-1 agreement no lower
    and max |dlogprob| no higher than the larger allowance of ``tol`` (e2e.TOL) and the
    eager floor (the eager engine against itself)."""
    if pair is None:
        return None, "no check (engine or eager reference missing)"
    if pair["identical"]:
        return True, "identical"
    top1, dlp = tol["min_top1_agree"], tol["max_abs_dlogprob"]
    if floor is not None:
        top1, dlp = min(top1, floor["top1_agree"]), max(dlp, floor["max_abs_dlogprob"])
    ok = pair["top1_agree"] >= top1 and pair["max_abs_dlogprob"] <= dlp
    return ok, (f"top-1 {pair['top1_agree']:.4f} >= {top1:.4f} and max|dlogprob| "
                f"{pair['max_abs_dlogprob']:.4f} <= {dlp:.4f} (the larger allowance of "
                f"e2e.TOL and {'the eager floor' if floor is not None else 'no eager floor'})")


def downgrade_lines(log: list[str]) -> list[str]:
    return [ln for ln in log or [] if any(m in ln.lower() for m in DOWNGRADE_MARKS)]


def engine_rows(e: ep.Engine, r: dict, model: str, eager_check: dict | None,
                floor: dict | None, tol: dict) -> list[dict]:
    eng = r.get("engine") or {}
    graph = eng.get("graph") or {}
    check = eng.get("check")
    is_eager = e.eager
    if is_eager:
        pair, match, rule = None, None, "the reference"
    elif check and not check.get("error") and eager_check:
        pair = check_pair(eager_check, check)
        match, rule = match_verdict(pair, floor, tol)
    else:
        pair, match, rule = None, None, (check or {}).get("error") or "no check"
    resolved = "NONE" if is_eager else graph.get("cudagraph_mode")
    agreement = None if pair is None else {
        k: pair[k] for k in ("identical", "top1_agree", "max_abs_dlogprob", "mean_abs_dlogprob",
                             "generated_tokens", "generated_same_prefix", "first_divergence")}
    rows = []
    for t in r.get("rows", []):
        decode = t["phase"] == "decode"
        rows.append(dict(
            kernel="graph_mode", variant=e.info["requested"],
            shape=dict(model=model, cudagraph_mode=e.info["cudagraph_mode"],
                       capture_sizes=e.info["capture_sizes"], phase=t["phase"],
                       batch=t["batch"], prompt_len=t["prompt_len"]),
            resolved_mode=resolved,
            decode_tokens_per_s=t.get("tokens_per_s") if decode else None,
            tokens_per_s=t.get("tokens_per_s"), seconds=t.get("seconds"),
            outputs_match_eager=match, match_rule=rule, agreement=agreement,
            ran_as=(dispatch_modes(eng.get("dispatch") or {}, t["batch"]) if decode
                    else None),
            capture_sizes_resolved=graph.get("capture_sizes"),
            max_capture_size=graph.get("max_capture_size"),
            min_cg_support=graph.get("min_cg_support"), cg_support=graph.get("cg_support"),
            downgrade_log=downgrade_lines(eng.get("log")), compilation=e.compilation,
            eager=is_eager, error=t.get("error"), load_seconds=r.get("load_seconds"),
            deepinfer_variant=r.get("deepinfer_variant"), mode=r.get("mode")))
    return rows


def rows_of(plan, work: Path, model: str, tol: dict) -> tuple[list[dict], dict]:
    """Every row the plan's finished outputs give, and the eager floor."""
    outs = {e.tag: ep.load(work, e) for e in plan}
    eager = next((e for e in plan if e.eager), None)
    eager_check = None
    if eager is not None and outs.get(eager.tag):
        c = (outs[eager.tag].get("engine") or {}).get("check")
        eager_check = c if c and not c.get("error") else None
    floor = eager_floor(eager_check)
    rows = []
    for e in plan:
        if outs.get(e.tag):
            rows += engine_rows(e, outs[e.tag], model, eager_check, floor, tol)
    return rows, floor


def recommendation(rows: list[dict]) -> dict | None:
    """The graph configuration with the highest geometric mean of decode tokens/s over the
    batches every configuration measured, among those whose outputs match eager; with its
    figures and vLLM's default configuration's beside them."""
    dec = [r for r in rows if r["shape"]["phase"] == "decode" and not r["eager"]]
    by: dict[tuple, dict[int, float]] = {}
    ok: dict[tuple, bool] = {}
    for r in dec:
        key = (r["shape"]["cudagraph_mode"], r["shape"]["capture_sizes"])
        if r["decode_tokens_per_s"]:
            by.setdefault(key, {})[r["shape"]["batch"]] = r["decode_tokens_per_s"]
        ok[key] = ok.get(key, True) and r["outputs_match_eager"] is True
    if not by:
        return None
    batches = sorted(set.intersection(*(set(v) for v in by.values())))
    if not batches:
        return None

    def gmean(v):
        return math.exp(sum(math.log(v[b]) for b in batches) / len(batches))
    good = {k: v for k, v in by.items() if ok.get(k)}
    if not good:
        return dict(config=None, why="no configuration's outputs matched eager's")
    best = max(good, key=lambda k: gmean(good[k]))
    base = ("FULL_AND_PIECEWISE", "default")
    out = dict(cudagraph_mode=best[0], capture_sizes=best[1], batches=batches,
               decode_tokens_per_s={b: good[best][b] for b in batches},
               geomean_tokens_per_s=gmean(good[best]))
    if base in by:
        out["vllm_default"] = dict(cudagraph_mode=base[0], capture_sizes=base[1],
                                   decode_tokens_per_s={b: by[base][b] for b in batches},
                                   ratio=gmean(good[best]) / gmean(by[base]))
    return out


# --------------------------------------------------------------------------- chart
def graph_series(rows: list[dict]) -> dict:
    """The chart's data: decode tokens/s per configuration label and batch."""
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["kernel"] != "graph_mode" or r["shape"]["phase"] != "decode":
            continue
        if r.get("decode_tokens_per_s") is None:
            continue
        s = r["shape"]
        label = EAGER if r.get("eager") else f"{s['cudagraph_mode']} / {s['capture_sizes']}"
        if r.get("outputs_match_eager") is False:
            label += " (outputs differ)"
        out.setdefault(label, {})[s["batch"]] = r["decode_tokens_per_s"]
    return out


def chart(rows: list[dict], meta: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = graph_series(rows)
    batches = sorted({b for v in data.values() for b in v})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(data), 1)
    for i, (label, v) in enumerate(data.items()):
        ax.bar([x - 0.4 + width * (i + 0.5) for x in range(len(batches))],
               [v.get(b, 0) for b in batches], width, label=label)
    ax.set_xticks(list(range(len(batches))))
    ax.set_xticklabels([f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s (higher is better)")
    ax.set_yscale("log")
    ax.set_title(f"CUDA-graph modes, {rows[0]['shape']['model']} ({rows[0].get('mode')} mode) "
                 f"— {meta.get('gpu')} (vLLM {meta.get('vllm')})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------- driver
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/deepinfer-e2e"))
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--model", default=TPUT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--mode", default="a100", choices=("a100", "sm90", "upstream", "default"),
                    help="the serving mode of every engine (default: the A100-faithful one)")
    ap.add_argument("--modes", default=",".join(GRAPH_MODES))
    ap.add_argument("--captures", default=",".join(CAPTURES))
    ap.add_argument("--quick", action="store_true", help="vLLM's capture sizes only")
    ap.add_argument("--no-eager", action="store_true",
                    help="no eager engine (no output check; its rows come from the work "
                    "folder or the bundle when there)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from now: an engine starts only when its estimate "
                    "(engine_plan.START_S) fits before it; results are written from what "
                    "finished")
    ap.add_argument("--bundle", type=Path, default=None,
                    help="write every finished engine's output here (one JSON file)")
    ap.add_argument("--resume", type=Path, default=None,
                    help="a bundle of an invocation on another machine: its engines are "
                    "not run again")
    ap.add_argument("--start-s", default=None, metavar="KIND=S,...",
                    help="start-up estimates over engine_plan.START_S (cold_a100, cold, warm, "
                    "eager), e.g. cold=240 after a call's load_seconds said so")
    ap.add_argument("--rerun", action="store_true", help="run engines whose output exists")
    ap.add_argument("--plan", action="store_true", help="print the engines and estimates")
    ap.add_argument("--no-run", action="store_true",
                    help="start nothing: write the results from the work folder and --resume")
    ap.add_argument("--skip-overlay-check", action="store_true")
    ap.add_argument("--chart", type=Path, default=None,
                    help="draw a results file's graph_mode rows and exit")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "charts")
    args = ap.parse_args(argv)
    args.mode_list = [m for m in args.modes.split(",") if m]
    args.capture_list = ["default"] if args.quick else [c for c in args.captures.split(",") if c]
    bad = sorted(set(args.mode_list) - set(KNOWN_MODES)) + sorted(
        set(args.capture_list) - set(CAPTURES))
    if bad or not args.mode_list or not args.capture_list:
        ap.error(f"unknown or empty --modes / --captures: {', '.join(bad) or '(none)'}; "
                 f"known: {', '.join(KNOWN_MODES)} / {', '.join(CAPTURES)}")
    return args


def main(argv=None, sh=None) -> int:
    args = parse_args(argv)
    if args.chart is not None:
        d = json.loads(args.chart.read_text())
        rows = [r for r in d["rows"] if r["kernel"] == "graph_mode"]
        print(chart(rows, d["meta"], args.out / f"{args.chart.stem}-graph-modes.png"))
        return 0
    import e2e
    sh = sh or e2e.sh
    if args.deadline is not None:
        e2e._DEADLINE[0] = time.time() + args.deadline
    plan = engines(args.model, args.mode, args.mode_list, args.capture_list)
    work = args.work
    resumed, start_s, table = ep.prepare(args, plan, width=55)
    if args.plan:
        return 0
    not_done: list[str] = []
    if not args.no_run:
        not_done = ep.run_driver(args, plan, work, sh, e2e, start_s,
                                 todo=[e for e in plan if not (args.no_eager and e.eager)])
    rows, floor = rows_of(plan, work, args.model, e2e.TOL)
    outs = [ep.load(work, e) for e in plan]
    meta = dict(ep.meta_of(outs), date=datetime.date.today().isoformat(), failed_runs=not_done,
                resumed=resumed, plan=table, tolerance=e2e.TOL, eager_floor=None if floor is None
                else {k: floor[k] for k in ("identical", "top1_agree", "max_abs_dlogprob",
                                            "mean_abs_dlogprob")},
                check=dict(lens=list(CHECK_LENS), gen=CHECK_GEN),
                recommendation=recommendation(rows),
                note="H200 figures; the a100 mode emulates an A100's kernel selection on the "
                     "H200 (DEEPINFER_EMULATE_CAPABILITY=8.0): its speeds are not A100 speeds")
    out = args.results / ep.results_name(meta, KIND)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {out} ({len(rows)} rows; not done: {not_done or 'none'})", flush=True)
    for r in rows:
        s = r["shape"]
        print(f"  {s['cudagraph_mode']:19s} {str(s['capture_sizes']):7s} {s['phase']:7s} "
              f"b{s['batch']:<3d} L{s['prompt_len']:<5d} ran {r['resolved_mode']} "
              f"{r['ran_as'] or ''} " + (f"{r['tokens_per_s']:9.1f} tok/s"
                                         if r["tokens_per_s"] is not None else
                                         f"failed: {r['error']}")
              + f"  match {r['outputs_match_eager']}", flush=True)
    print(f"recommendation: {meta['recommendation']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
