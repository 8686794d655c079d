"""Hopper parity: the overlay's defaults against upstream's own path on this GPU, alternated
so that run-to-run spread is known, and the defaults with one feature off at a time.

    python benchmarks/e2e/parity.py [--work DIR] [--repeats 3] [--deadline S]
        [--bundle F --resume F] [--bisect [--bisect-features a,b] [--bisect-repeats 1]]
        [--plan]
    python benchmarks/e2e/parity.py --chart RESULTS.json [--out benchmarks/results/charts]

Engines (run_engine.py: run.py's tput engine, vLLM's default torch.compile + CUDA graphs),
each alone on the GPU, in this order:
  A/B       "default" (the overlay installed, no DEEPINFER_* switch: what a Hopper user who
            installs it gets) and "upstream" (DEEPINFER_DISABLE=all), alternating:
            default, upstream, default, upstream, ... for --repeats rounds. Each has its own
            vLLM cache root (engine_plan.py: the compile cache key does not cover the
            switches), so the first engine of each compiles and the others load.
  bisect    (--bisect) the default mode with one feature off (DEEPINFER_DISABLE=<feature>),
            one engine per feature on by default for --arch (overlay/vllm/deepinfer/envs.py),
            most suspected first (SUSPECTS). They share the default mode's cache root: every
            one of these features is decided inside a custom op (the attention, the indexer,
            the cache writers), at import (a Triton kernel's specialization) or at engine
            construction, not in the code torch.compile traces, so their traced graph is the
            default mode's; --bisect-own-cache gives each a root of its own.
Each engine measures decode tokens/s at batch 1, 8 and 32 (512-token prompts, 64 timed
steps, best of two) and prefill tokens/s at 1,024 and 8,192 tokens, as the tput step does.

Rows kernel="hopper_parity": one per engine and shape (shape {model, phase, batch or
prompt_len, repeat, disabled_feature}, tokens_per_s), and per variant and shape a summary
(repeat "all": n, min, median, max over the repeats) with a verdict against upstream's
spread: "faster" (the median above upstream's fastest repeat), "within_spread" (between its
slowest and fastest) or "slower" (below its slowest); the default mode's summaries pass
unless slower. Bisect summaries also carry the verdict against the default mode's spread (a
feature whose removal lands above it is what the default mode pays for). Results:
benchmarks/results/<gpu>-<date>-e2e-hopper-parity-<commit>.json.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import engine_plan as ep  # noqa: E402
from e2e_models import MODELS, TPUT_MODEL  # noqa: E402
from run_engine import dispatch_modes  # noqa: E402

KIND = "e2e-hopper-parity"
DEFAULT, UPSTREAM = "default", "upstream"
REPEATS = 3
# Features on by default on sm90, most suspected first for the default mode's decode at
# batch 1-8 on Hopper, by reading the code (docs/e2e.md, "Hopper parity", says why): the
# one that changes decode kernels' code, then the one that changes the decode graph's
# launches, then host-side calls, then prefill-only and inert ones. Features of the arch
# not named here follow in envs.py's order.
SUSPECTS = ("serve_warmup", "yoco_reuse", "candidate_logits", "topk_rows", "kv_gather",
            "topk_swa", "sparse_mla_decode", "kv_page64", "deep_gemm_gate")


def load_envs():
    """overlay/vllm/deepinfer/envs.py by path (standard library only; no vLLM needed)."""
    name = "deepinfer_envs_for_parity"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, REPO / "overlay" / "vllm" / "deepinfer" / "envs.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod     # its dataclasses look their module up while defined
        spec.loader.exec_module(mod)
    return sys.modules[name]


def default_on(arch: str) -> list[str]:
    """The features on by default for ``arch``, in SUSPECTS order, then envs.py's."""
    feats = load_envs().FEATURES
    on = [n for n, f in feats.items() if arch in f.default_on]
    return [n for n in SUSPECTS if n in on] + [n for n in on if n not in SUSPECTS]


def variant_of(feature: str | None) -> str:
    return DEFAULT if feature is None else f"{DEFAULT}-no-{feature}"


def engines(model: str, repeats: int, bisect=(), bisect_repeats: int = 1,
            own_cache: bool = False) -> list[ep.Engine]:
    """A/B rounds (default first in each), then the bisect variants."""
    out = []
    for r in range(1, repeats + 1):
        for v, mode, sw in ((DEFAULT, DEFAULT, {}),
                            (UPSTREAM, UPSTREAM, {})):
            out.append(ep.Engine(tag=f"{model}-parity-{v}-r{r}", mode=mode,
                                 cache=f"parity-{v}", switches=dict(sw),
                                 info=dict(variant=v, repeat=r, disabled_feature=None)))
    for f in bisect:
        v = variant_of(f)
        for r in range(1, bisect_repeats + 1):
            out.append(ep.Engine(tag=f"{model}-parity-{v}-r{r}", mode=DEFAULT,
                                 cache=f"parity-{v}" if own_cache else f"parity-{DEFAULT}",
                                 switches={"DEEPINFER_DISABLE": f},
                                 info=dict(variant=v, repeat=r, disabled_feature=f)))
    return out


# --------------------------------------------------------------------------- rows
def _size_key(t: dict) -> tuple[str, str, int]:
    return (t["phase"], "batch", t["batch"]) if t["phase"] == "decode" else \
        (t["phase"], "prompt_len", t["prompt_len"])


def repeat_rows(e: ep.Engine, r: dict, model: str) -> list[dict]:
    eng = r.get("engine") or {}
    graph = eng.get("graph") or {}
    rows = []
    for t in r.get("rows", []):
        phase, size, n = _size_key(t)
        rows.append(dict(
            kernel="hopper_parity", variant=e.info["variant"],
            shape={"model": model, "phase": phase, size: n, "repeat": e.info["repeat"],
                   "disabled_feature": e.info["disabled_feature"]},
            tokens_per_s=t.get("tokens_per_s"), seconds=t.get("seconds"),
            timing=t.get("timing", "whole generate call"), error=t.get("error"),
            load_seconds=r.get("load_seconds"), resolved_mode=graph.get("cudagraph_mode"),
            ran_as=(dispatch_modes(eng.get("dispatch") or {}, t["batch"])
                    if phase == "decode" else None),
            min_cg_support=graph.get("min_cg_support"),
            deepinfer_variant=r.get("deepinfer_variant"),
            capability_seen_by_vllm=r.get("capability_seen_by_vllm"), switches=e.switches,
            mode=r.get("mode")))
    return rows


def spread(values: list[float]) -> dict:
    return dict(n=len(values), min=min(values), median=statistics.median(values),
                max=max(values))


def verdict(values: list[float], ref: list[float]) -> str:
    """Where the median of ``values`` falls against ``ref``'s range."""
    med = statistics.median(values)
    if med > max(ref):
        return "faster"
    if med >= min(ref):
        return "within_spread"
    return "slower"


def summary_rows(rows: list[dict]) -> list[dict]:
    """Per (variant, phase, size): the spread over the repeats and the verdicts."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["tokens_per_s"] is None:
            continue
        s = r["shape"]
        size = "batch" if "batch" in s else "prompt_len"
        groups.setdefault((r["variant"], s["phase"], size, s[size], s["disabled_feature"],
                           s["model"]), []).append(r)
    vals = {k: [r["tokens_per_s"] for r in rs] for k, rs in groups.items()}

    def ref_of(key, variant):
        return vals.get((variant, *key[1:4], None, key[5]))
    out = []
    for key, v in vals.items():
        variant, phase, size, n, feat, model = key
        row = dict(kernel="hopper_parity", variant=variant,
                   shape={"model": model, "phase": phase, size: n, "repeat": "all",
                          "disabled_feature": feat},
                   tokens_per_s=statistics.median(v), spread=spread(v),
                   repeats=sorted(r["shape"]["repeat"] for r in groups[key]))
        up = ref_of(key, UPSTREAM)
        if variant != UPSTREAM and up:
            row["vs_upstream"] = dict(verdict=verdict(v, up), upstream=spread(up),
                                      ratio_median=statistics.median(v) / statistics.median(up))
        if variant == DEFAULT:
            row["passed"] = None if not up else row["vs_upstream"]["verdict"] != "slower"
        d = ref_of(key, DEFAULT)
        if feat is not None and d:
            row["vs_default"] = dict(verdict=verdict(v, d), default=spread(d),
                                     ratio_median=statistics.median(v) / statistics.median(d))
        out.append(row)
    return out


def rows_of(plan, work: Path, model: str) -> list[dict]:
    rows = []
    for e in plan:
        r = ep.load(work, e)
        if r:
            rows += repeat_rows(e, r, model)
    return rows + summary_rows(rows)


def verdicts(rows: list[dict]) -> dict:
    """meta.verdicts: the default mode's shapes by verdict, and the bisect variants whose
    median lands above the default mode's spread."""
    out: dict = {"faster": [], "within_spread": [], "slower": [], "attributable": []}
    for r in rows:
        s = r["shape"]
        if s["repeat"] != "all":
            continue
        label = f"{s['phase']} " + (f"b{s['batch']}" if "batch" in s else f"L{s['prompt_len']}")
        if r["variant"] == DEFAULT and "vs_upstream" in r:
            out[r["vs_upstream"]["verdict"]].append(label)
        if s["disabled_feature"] and r.get("vs_default", {}).get("verdict") == "faster":
            out["attributable"].append(f"{s['disabled_feature']}: {label}")
    return out


# --------------------------------------------------------------------------- chart
def parity_series(rows: list[dict]) -> dict:
    """Per shape label: per variant, the tokens/s of each repeat (the chart's points)."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        s = r["shape"]
        if r["kernel"] != "hopper_parity" or s["repeat"] == "all" or r["tokens_per_s"] is None:
            continue
        label = f"{s['phase']} " + (f"b{s['batch']}" if "batch" in s else f"L{s['prompt_len']}")
        out.setdefault(label, {}).setdefault(r["variant"], []).append(r["tokens_per_s"])
    return out


def chart(rows: list[dict], meta: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = parity_series(rows)
    labels = list(data)
    fig, axes = plt.subplots(1, len(labels), figsize=(2.6 * len(labels) + 1, 4.2), squeeze=False)
    for ax, label in zip(axes[0], labels):
        per = data[label]
        names = [v for v in (DEFAULT, UPSTREAM) if v in per] + sorted(
            v for v in per if v not in (DEFAULT, UPSTREAM))
        for i, v in enumerate(names):
            ys = per[v]
            ax.plot([i] * len(ys), ys, "o", ms=4)
            ax.vlines(i, min(ys), max(ys))
        ax.set_xticks(list(range(len(names))))
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=6)
        ax.set_title(label, fontsize=8)
    axes[0][0].set_ylabel("tokens/s (each repeat; higher is better)")
    fig.suptitle(f"Hopper parity, {rows[0]['shape']['model']} — {meta.get('gpu')} "
                 f"(vLLM {meta.get('vllm')})", fontsize=9)
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
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--bisect", action="store_true",
                    help="after the A/B rounds, the default mode with one feature off each")
    ap.add_argument("--bisect-features", default=None,
                    help="comma-separated features (default: every one on for --arch, "
                    "most suspected first)")
    ap.add_argument("--bisect-repeats", type=int, default=1)
    ap.add_argument("--bisect-own-cache", action="store_true",
                    help="each bisect variant compiles into a cache root of its own")
    ap.add_argument("--arch", default="sm90", help="the variant whose defaults are bisected")
    ap.add_argument("--deadline", type=float, default=None)
    ap.add_argument("--bundle", type=Path, default=None)
    ap.add_argument("--resume", type=Path, default=None)
    ap.add_argument("--start-s", default=None, metavar="KIND=S,...",
                    help="start-up estimates over engine_plan.START_S (cold_a100, cold, warm, "
                    "eager), e.g. cold=240 after a call's load_seconds said so")
    ap.add_argument("--rerun", action="store_true")
    ap.add_argument("--plan", action="store_true", help="print the engines and estimates")
    ap.add_argument("--no-run", action="store_true",
                    help="start nothing: write the results from the work folder and --resume")
    ap.add_argument("--skip-overlay-check", action="store_true")
    ap.add_argument("--chart", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "charts")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.bisect_repeats < 1:
        ap.error("--repeats and --bisect-repeats take 1 or more")
    on = default_on(args.arch) if args.bisect or args.bisect_features else []
    if args.bisect_features is not None:
        asked = [f for f in args.bisect_features.split(",") if f]
        bad = sorted(set(asked) - set(on))
        if bad or not asked:
            ap.error(f"--bisect-features: {', '.join(bad) or '(none)'} not on by default for "
                     f"{args.arch}; those that are: {', '.join(on)}")
        on = asked
    args.bisect_list = on
    return args


def main(argv=None, sh=None) -> int:
    args = parse_args(argv)
    if args.chart is not None:
        d = json.loads(args.chart.read_text())
        rows = [r for r in d["rows"] if r["kernel"] == "hopper_parity"]
        print(chart(rows, d["meta"], args.out / f"{args.chart.stem}-hopper-parity.png"))
        return 0
    import e2e
    sh = sh or e2e.sh
    if args.deadline is not None:
        e2e._DEADLINE[0] = time.time() + args.deadline
    plan = engines(args.model, args.repeats, args.bisect_list, args.bisect_repeats,
                   args.bisect_own_cache)
    work = args.work
    resumed, start_s, table = ep.prepare(args, plan, width=48)
    if args.plan:
        return 0
    not_done = [] if args.no_run else ep.run_driver(
        args, plan, work, sh, e2e, start_s,
        overlay_why=": the default mode would serve upstream")
    rows = rows_of(plan, work, args.model)
    outs = [ep.load(work, e) for e in plan]
    meta = dict(ep.meta_of(outs), date=datetime.date.today().isoformat(), failed_runs=not_done,
                resumed=resumed, plan=table, repeats=args.repeats, bisect=args.bisect_list,
                verdicts=verdicts(rows),
                note="H200 figures of the overlay's defaults on Hopper (no emulation) "
                     "against DEEPINFER_DISABLE=all, engines alternated")
    out = args.results / ep.results_name(meta, KIND)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {out} ({len(rows)} rows; not done: {not_done or 'none'})", flush=True)
    for r in rows:
        s = r["shape"]
        if s["repeat"] != "all":
            continue
        size = f"b{s['batch']}" if "batch" in s else f"L{s['prompt_len']}"
        sp = r["spread"]
        vs = r.get("vs_upstream", {})
        print(f"  {r['variant']:28s} {s['phase']:7s} {size:6s} n{sp['n']} "
              f"{sp['min']:9.1f} / {sp['median']:9.1f} / {sp['max']:9.1f} tok/s"
              + (f"  vs upstream x{vs['ratio_median']:.3f} {vs['verdict']}" if vs else ""),
              flush=True)
    print(f"verdicts: {meta['verdicts']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
