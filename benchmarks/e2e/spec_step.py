"""--steps spec of benchmarks/e2e/e2e.py: speculative decoding served by vLLM through the
Ampere path (the a100 mode) and upstream's Hopper path, eager, under vLLM's default CUDA
graphs, and in the zero-compile form with the sm_80 audit (run_spec.py, one engine per
process, alone on the GPU unless --spec-parallel).

Cases (SPEC_CASES): V4.1 with DSpark k = 5 (v41-dspark-mini), V4 with MTP (v4-mtp-mini; k = 1,
its one trained step, num_nextn_predict_layers) and with DSpark k = 5 (v4-dspark-mini), and
vLLM's ngram speculator (k = 5, prompt_lookup_min 2 / max 5: target-only multi-token
verification, real acceptance on repetitive prompts where random-weight drafters accept
little) on the target-only minis. The speculative configs' targets are the minis' own
(make_checkpoint draws every tensor from its name and the seed; tests/test_e2e_spec.py
checks the target tables and draws are equal), so one non-speculative engine per model
family, mode and form (PLAIN_OF) scores every speculative output of that family.

Per (family, mode, form) a group runs in order: each speculative engine, then the plain
engine, which scores their outputs (spec_rule.py: the rule, its noise and the control).
Groups in priority order: form (eager, graphs, nocompile), family, mode; the nocompile form
only in the a100 mode. --deadline drops the tail: an engine starts only when its estimate
(ENGINE_S) fits in what is left.

Rows: kernel="spec_decode" per (case, mode, form, batch) with plain's figures of the same
batch beside; kernel="spec_rule" per (case, mode, form); kernel="spec_sm80_audit" and
"spec_zero_compile" per case from the nocompile form, naming the kernels the speculative
engine ran that its plain engine did not (and those compiled inside the speculator's
propose, the audit's region "draft"). Speeds are H200 figures: the a100 mode runs an A100's
kernel selection on the H200, not an A100.
"""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import spec_rule
from e2e_models import MODELS, SPEC_MODELS

HERE = Path(__file__).resolve().parent

NGRAM = dict(k=5, lookup_min=2, lookup_max=5)
# (model whose checkpoint the speculative engine serves, method, k)
SPEC_CASES = tuple((m, meth, k) for m, (meth, k) in SPEC_MODELS.items()) + (
    ("v41-mini", "ngram", NGRAM["k"]), ("v4-mini", "ngram", NGRAM["k"]))
# The target-only model whose non-speculative engine scores each case (the same target).
PLAIN_OF = {"v41-dspark-mini": "v41-mini", "v4-mtp-mini": "v4-mini",
            "v4-dspark-mini": "v4-mini", "v41-mini": "v41-mini", "v4-mini": "v4-mini"}
SPEC_MODES = ("a100", "upstream")
SPEC_FORMS = ("eager", "graphs", "nocompile")
SPEC_BATCHES = (1, 4, 16)
SPEC_KV_GIB = 4.0   # fixed KV cache: no memory-profiling comparison, no start-up lock
# Estimated seconds per engine, cold (process start, load, compile/capture or the JIT
# warmup, the rule prompts, the decode windows): the mini models' nocompile engines loaded
# in 58-116 s cold and 11-14 s with a warm Triton cache (zero_compile rows, load_seconds, of
# benchmarks/results/h200-2026-12-01-e2e-nocompile-5ddee71.json and ...-e2e-d80f014.json);
# --quick takes ~20 s off the work. Graphs: the DSpark graphs engine of
# benchmarks/results/h200-2026-12-02-e2e-spec-3e2842d.json took 361 s with --quick (engine
# init 275 s: torch.compile, vLLM's JIT warmup, capture), so 380 less the quick saving.
# nocompile, --quick, one engine at a time on one machine at 5efd4ba: engine construction
# (load_seconds of the spec_zero_compile rows of
# benchmarks/results/h200-2026-12-02-e2e-spec-5efd4ba.json, vLLM's JIT warmup included)
# 263 s for V4.1 DSpark on the fresh machine, 144 s for V4 DSpark (V4's kernels still cold),
# 49 s for V4 MTP after it; the engine process adds the rule prompts and the decode windows.
# 150 is a warm-cache figure, so a fresh machine's first engine needs a device call of its own.
ENGINE_S = {"eager": 90, "graphs": 380, "nocompile": 150}
QUICK_SAVES_S = 20
# The limit of one engine process (a stuck engine must not eat the GPU call). nocompile: at
# a7effd6 on a fresh machine (empty Triton and TileLang caches) two speculative nocompile
# engines started side by side (--spec-parallel 2) were both still starting when the
# earlier 400 s limit stopped them; one engine alone gets most of a device call.
ENGINE_TIMEOUT_S = {"eager": 300, "graphs": 480, "nocompile": 560}
# Goal of the issue: the verify step with k = 5 costs at most 1.5x a plain decode step at
# batch 1 and 4 in the A100-faithful mode.
GOAL = dict(k=5, batches=(1, 4), max_ratio=1.5, mode="a100")


# ----------------------------------------------------------------------------- options
def add_spec_args(ap) -> None:
    g = ap.add_argument_group("spec step (--steps spec: speculative decoding)")
    g.add_argument("--spec-cases", default=",".join(f"{m}:{meth}" for m, meth, _ in SPEC_CASES),
                   help="model:method pairs of SPEC_CASES, comma-separated (a model name "
                   "alone takes all its cases)")
    g.add_argument("--spec-modes", default=",".join(SPEC_MODES))
    g.add_argument("--spec-forms", default=",".join(SPEC_FORMS),
                   help="eager, graphs (vLLM's default CUDA graphs), nocompile (a100 only: "
                   "JIT warmup on, the audit)")
    g.add_argument("--spec-parallel", type=int, default=1,
                   help="groups of engines at once (their timings then are not alone on "
                   "the GPU, and the rows say so)")
    g.add_argument("--spec-rerun", action="store_true",
                   help="serve engines again whose output exists")
    g.add_argument("--spec-plan", action="store_true",
                   help="print the spec step's engines and estimates, run nothing")


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def spec_options(args, ap) -> dict:
    cases = []
    for part in _csv(args.spec_cases):
        model, _, meth = part.partition(":")
        got = [c for c in SPEC_CASES if c[0] == model and (not meth or c[1] == meth)]
        if not got:
            ap.error(f"--spec-cases: unknown {part!r}; known: "
                     + ", ".join(f"{m}:{x}" for m, x, _ in SPEC_CASES))
        cases += [c for c in got if c not in cases]
    modes, forms = _csv(args.spec_modes), _csv(args.spec_forms)
    for what, vals, known in (("modes", modes, SPEC_MODES), ("forms", forms, SPEC_FORMS)):
        bad = sorted(set(vals) - set(known))
        if bad or not vals:
            ap.error(f"--spec-{what}: unknown {', '.join(bad) or '(none given)'}; "
                     f"known: {', '.join(known)}")
    return dict(cases=cases, modes=modes, forms=forms, quick=bool(args.quick),
                parallel=max(1, args.spec_parallel), rerun=bool(args.spec_rerun),
                plan_only=bool(getattr(args, "spec_plan", False)))


# ----------------------------------------------------------------------------- engines
def spec_out(work: Path, model: str, mode: str, method: str, form: str) -> Path:
    return work / f"{model}-{mode}-spec-{method}-{form}.json"


def plain_out(work: Path, model: str, mode: str, form: str) -> Path:
    return work / f"{model}-{mode}-specplain-{form}.json"


def parse_tag(stem: str):
    """(model, mode, role, method, form) of a spec output's file stem; None for others."""
    for name in sorted(MODELS, key=len, reverse=True):
        if not stem.startswith(name + "-"):
            continue
        parts = stem[len(name) + 1:].split("-")
        if len(parts) == 4 and parts[1] == "spec" and parts[3] in SPEC_FORMS:
            return name, parts[0], "spec", parts[2], parts[3]
        if len(parts) == 3 and parts[1] == "specplain" and parts[2] in SPEC_FORMS:
            return name, parts[0], "plain", None, parts[2]
        return None
    return None


def groups(opts: dict) -> list[dict]:
    """Engine groups in priority order: per (form, family, mode), the speculative engines of
    the selected cases, then the plain engine of their family."""
    out = []
    families = list(dict.fromkeys(PLAIN_OF[m] for m, _, _ in opts["cases"]))
    for form in opts["forms"]:
        for fam in families:
            for mode in opts["modes"]:
                if form == "nocompile" and mode != "a100":
                    continue
                cases = [c for c in opts["cases"] if PLAIN_OF[c[0]] == fam]
                out.append(dict(family=fam, mode=mode, form=form, cases=cases))
    return out


def engine_estimate(form: str, quick: bool) -> float:
    return ENGINE_S[form] - (QUICK_SAVES_S if quick else 0)


def spec_command(work: Path, case, mode: str, form: str, opts: dict, beside: int = 1) -> list:
    model, method, k = case
    cmd = [sys.executable, str(HERE / "run_spec.py"), "--model", str(ckpt_dir(work, model)),
           "--mode", mode, "--form", form, "--role", "spec", "--method", method, "--k", str(k),
           "--out", str(spec_out(work, model, mode, method, form)),
           "--kv-cache-gib", str(SPEC_KV_GIB), "--gpu-mem", str(round(0.9 / beside, 2)),
           "--beside", str(beside), "--batches", *map(str, SPEC_BATCHES)]
    if method == "ngram":
        cmd += ["--lookup-min", str(NGRAM["lookup_min"]), "--lookup-max", str(NGRAM["lookup_max"])]
    if opts["quick"]:
        cmd.append("--quick")
    return cmd


def plain_command(work: Path, family: str, mode: str, form: str, scored: list[Path],
                  opts: dict, beside: int = 1) -> list:
    cmd = [sys.executable, str(HERE / "run_spec.py"), "--model", str(ckpt_dir(work, family)),
           "--mode", mode, "--form", form, "--role", "plain",
           "--out", str(plain_out(work, family, mode, form)),
           "--kv-cache-gib", str(SPEC_KV_GIB), "--gpu-mem", str(round(0.9 / beside, 2)),
           "--beside", str(beside), "--batches", *map(str, SPEC_BATCHES)]
    if scored:
        cmd += ["--score", *map(str, scored)]
    if opts["quick"]:
        cmd.append("--quick")
    return cmd


def ckpt_dir(work: Path, model: str) -> Path:
    return work / f"{model}-{MODELS[model][1]}"


def engine_env(work: Path, tag: str, base=None) -> dict:
    """The caller's environment with a vLLM cache root per engine (vLLM's torch.compile cache
    key does not cover the DEEPINFER_* switches, so two modes must not share one) and one
    Triton cache for all (keyed by kernel source and target)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_CACHE_ROOT"] = str(work / "cache" / f"spec-{tag}")
    env.setdefault("TRITON_CACHE_DIR", str(work / "cache" / "triton"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def plan(work: Path, opts: dict) -> list[dict]:
    """Every engine of the step in order: tag, command, estimate, done (output exists)."""
    out, beside = [], opts["parallel"]
    for g in groups(opts):
        mode, form = g["mode"], g["form"]
        scored = []
        for case in g["cases"]:
            p = spec_out(work, case[0], mode, case[1], form)
            scored.append(p)
            out.append(dict(tag=p.stem, out=p, group=(g["family"], mode, form),
                            cmd=spec_command(work, case, mode, form, opts, beside),
                            model=case[0], form=form,
                            estimate_s=engine_estimate(form, opts["quick"]),
                            done=p.exists() and not opts["rerun"]))
        p = plain_out(work, g["family"], mode, form)
        out.append(dict(tag=p.stem, out=p, group=(g["family"], mode, form),
                        cmd=plain_command(work, g["family"], mode, form, scored, opts, beside),
                        model=g["family"], form=form,
                        estimate_s=engine_estimate(form, opts["quick"]), scored=scored,
                        done=not opts["rerun"] and _scored_all(p, scored)))
    return out


def _scored_all(plain: Path, scored: list[Path]) -> bool:
    """Whether the plain output exists and scored each of the group's speculative outputs
    that exists (one that a later invocation served is scored by serving plain again)."""
    r = _load(plain) if plain.exists() else None
    if r is None:
        return False
    have = set(r.get("scores") or {})
    return all(f.stem in have for f in scored if f.exists())


def _when(e: dict) -> str:
    return "done" if e["done"] else f"~{e['estimate_s']:.0f} s"


def plan_lines(engines: list[dict]) -> list[str]:
    todo = [e for e in engines if not e["done"]]
    lines = [f"  {_when(e):>7}  {e['tag']}" for e in engines]
    lines.append(f"  spec step: {len(todo)} of {len(engines)} engines to run, estimated "
                 f"{sum(e['estimate_s'] for e in todo):.0f} s one at a time")
    return lines


def make_checkpoints(work: Path, models, sh, dense_routing=None) -> None:
    """The step's checkpoints (tools/make_checkpoint.py), every expert routed when
    ``dense_routing`` (e2e.dense_routing) is given, as the agreement checkpoints are."""
    for name in models:
        cfg, fmt = MODELS[name]
        out = ckpt_dir(work, name)
        if (out / "config.json").exists():
            continue
        extra = dense_routing(HERE / "configs" / cfg) if dense_routing else []
        sh([sys.executable, str(HERE.parent.parent / "tools" / "make_checkpoint.py"),
            str(HERE / "configs" / cfg), "--format", fmt, "--out", str(out), *extra],
           work / f"ckpt-{name}.log")


def step_spec(work: Path, opts: dict, *, sh, left=lambda: float("inf"),
              dense_routing=None) -> list[str]:
    """Run the step's engines (``sh``: e2e.sh, with its deadline; ``left``: seconds the
    deadline leaves). Returns the engines that did not finish or did not start. With
    --spec-plan it prints the plan and ends the process (no results file is written)."""
    engines = plan(work, opts)
    print("\n".join(plan_lines(engines)), flush=True)
    if opts.get("plan_only"):
        raise SystemExit(0)
    models = list(dict.fromkeys([m for m, _, _ in opts["cases"]]
                                + [PLAIN_OF[m] for m, _, _ in opts["cases"]]))
    make_checkpoints(work, models, sh, dense_routing)
    by_group: dict = {}
    for e in engines:
        by_group.setdefault(e["group"], []).append(e)
    stop = [False]   # once an engine does not fit, none after it starts (order is kept)

    def run_group(es) -> list[str]:
        missed = []
        for e in es:
            if e["done"] and (e.get("scored") is None or _scored_all(e["out"], e["scored"])):
                continue   # (a plain engine is checked again: its group may have grown)
            if stop[0] or left() < e["estimate_s"]:
                stop[0] = True
                missed.append(f"{e['tag']} (not started: ~{e['estimate_s']:.0f} s does not "
                              "fit in the deadline)")
                continue
            form = e["form"]
            rc = sh(e["cmd"], work / f"{e['tag']}.log",
                    env=engine_env(work, e["tag"].replace("-" + form, "")),
                    timeout=ENGINE_TIMEOUT_S[form])
            if rc != 0 or not e["out"].exists():
                missed.append(f"{e['tag']} (rc {rc})")
        return missed
    with ThreadPoolExecutor(opts["parallel"]) as pool:
        return [m for ms in pool.map(run_group, by_group.values()) for m in ms]


# ----------------------------------------------------------------------------- rows
def _load(p: Path):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return None


def spec_results(work: Path) -> dict:
    """(model, mode, role, method, form) -> run_spec.py's result, for every output found."""
    out = {}
    for f in sorted(work.glob("*-spec*-*.json")):
        tag = parse_tag(f.stem)
        r = _load(f) if tag else None
        if r is not None:
            out[tag] = dict(r, _stem=f.stem)
    return out


def spec_sample(work: Path) -> dict:
    """A result of the step (for the results file's meta), {} when none."""
    return next(iter(spec_results(work).values()), {})


def _by_batch(rows) -> dict:
    return {r["batch"]: r for r in rows or [] if r.get("tokens_per_s") is not None}


def _ratio(a, b):
    return a / b if a is not None and b else None


def decode_rows(model, method, k, mode, form, s: dict, p: dict | None, rule_passed) -> list:
    out = []
    plain = _by_batch((p or {}).get("rows"))
    for b, r in sorted(_by_batch(s.get("rows")).items()):
        q = plain.get(b)
        c, qc = r.get("clock") or {}, (q or {}).get("clock") or {}
        acc = r.get("acceptance") or {}
        verify = c.get("verify_us")
        plain_step = qc.get("step_us")
        row = dict(kernel="spec_decode", variant=mode,
                   shape=dict(model=model, method=method, k=k, batch=b,
                              cuda_graphs=form == "graphs", form=form),
                   acceptance=acc.get("acceptance"),
                   mean_acceptance_length=acc.get("mean_acceptance_length"),
                   acceptance_per_position=acc.get("per_position"),
                   tokens_per_request_step=r.get("tokens_per_request_step"),
                   verify_step_us=verify, draft_step_us=c.get("draft_us"),
                   spec_step_us=c.get("step_us"), engine_step_us=r.get("engine_step_us"),
                   plain_step_us=plain_step,
                   plain_engine_step_us=(q or {}).get("engine_step_us"),
                   verify_over_plain=_ratio(verify, plain_step),
                   tokens_per_s=r["tokens_per_s"],
                   plain_tokens_per_s=(q or {}).get("tokens_per_s"),
                   speedup=_ratio(r["tokens_per_s"], (q or {}).get("tokens_per_s")),
                   rule_passed=rule_passed,
                   timing=("CUDA events per model-runner step (verify: execute_model entry "
                           "to propose; draft: propose; step: entry to sample_tokens' end)"
                           if c.get("steps") else "engine steps' wall time only"),
                   timed_alone=s.get("beside", 1) == 1 and (p or {}).get("beside", 1) == 1,
                   load_seconds=s.get("load_seconds"))
        if k == GOAL["k"] and b in GOAL["batches"] and mode == GOAL["mode"]:
            row["goal_verify_le_1_5x_plain"] = (None if row["verify_over_plain"] is None
                                               else row["verify_over_plain"] <= GOAL["max_ratio"])
        out.append(row)
    for r in s.get("rows") or []:
        if r.get("tokens_per_s") is None:
            out.append(dict(kernel="spec_decode", variant=mode,
                            shape=dict(model=model, method=method, k=k, batch=r.get("batch"),
                                       cuda_graphs=form == "graphs", form=form),
                            tokens_per_s=None, error=r.get("error"), rule_passed=rule_passed))
    return out


def _kernels(audit: dict) -> set:
    return {t["name"] for t in audit.get("triton_kernels", [])}


def _ops(audit: dict) -> set:
    return {o["op"] for o in audit.get("cuda_ops", [])}


def audit_rows(model, method, k, s: dict, p: dict | None) -> list:
    """spec_sm80_audit and spec_zero_compile of a nocompile-form speculative engine."""
    a = s["audit"]
    pa = (p or {}).get("audit")
    draft = sorted({t["name"] for t in a.get("triton_kernels", []) if t.get("region") == "draft"})
    shape = dict(model=model, method=method, k=k, jit_warmup=True)
    spec_only = sorted(_kernels(a) - _kernels(pa)) if pa else None
    spec_ops = sorted(_ops(a) - _ops(pa)) if pa else None
    audit = dict(kernel="spec_sm80_audit", variant="a100", shape=shape,
                 triton_kernels=len(a.get("triton_kernels", [])),
                 cuda_ops=len(a.get("cuda_ops", [])), failed=a.get("failed", []),
                 spec_only_triton_kernels=spec_only, spec_only_cuda_ops=spec_ops,
                 draft_region_triton_kernels=draft,
                 draft_region_ops=(a.get("region_ops") or {}).get("draft"),
                 spec_kernel_rows=[t for t in a.get("triton_kernels", [])
                                   if t["name"] in set(spec_only or []) | set(draft)],
                 deep_gemm_calls=a.get("deep_gemm_calls"),
                 tilelang_compiles=a.get("tilelang_compiles"),
                 plain_audit=pa is not None, selections=s.get("selections"))
    zero = dict(kernel="spec_zero_compile", variant="a100", shape=shape,
                passed=a.get("zero_compile"), serve_compiles=a.get("serve_compiles", []),
                serve_compiles_outside_path=a.get("serve_compiles_outside", []),
                compiles_by_phase=a.get("compiles_by_phase"),
                tilelang_by_phase=a.get("tilelang_by_phase"),
                warmup_seconds=a.get("warmup_seconds"), load_seconds=s.get("load_seconds"),
                failed=a.get("failed", []))
    return [audit, zero]


def spec_rows(work: Path) -> list[dict]:
    """Every row of the step from the outputs in the work folder (earlier invocations' too)."""
    res = spec_results(work)
    rows = []
    for (model, mode, role, method, form), s in res.items():
        if role != "spec":
            continue
        k = s.get("k")
        p = res.get((PLAIN_OF.get(model, model), mode, "plain", None, form))
        r = spec_rule.rule(s, p, s["_stem"]) if p else dict(
            passed=None, reason="no plain engine of this family, mode and form")
        acc = s.get("rule_acceptance") or {}
        rows.append(dict(kernel="spec_rule", variant=mode,
                         shape=dict(model=model, method=method, k=k,
                                    cuda_graphs=form == "graphs", form=form),
                         passed=r.get("passed"), rule_acceptance=acc.get("acceptance"),
                         rule_mean_acceptance_length=acc.get("mean_acceptance_length"),
                         control_passed=(r.get("control") or {}).get("passed"),
                         plain_model=PLAIN_OF.get(model, model), detail=r))
        if form != "nocompile":
            rows += decode_rows(model, method, k, mode, form, s, p, r.get("passed"))
        elif s.get("audit"):
            rows += audit_rows(model, method, k, s, p)
    return rows


def _f(v, spec=".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def spec_line(row: dict) -> str:
    """One printed line per row (e2e.py's summary)."""
    s = row["shape"]
    head = f"  {s['model']} {s.get('method')} k={s.get('k')} {row['variant']}"
    if row["kernel"] == "spec_decode":
        if row.get("tokens_per_s") is None:
            return f"{head} {s.get('form')} b{s.get('batch')}: failed: {row.get('error')}"
        return (f"{head} {s['form']} b{s['batch']}: {_f(row['tokens_per_s'])} tok/s "
                f"(plain {_f(row.get('plain_tokens_per_s'))}), acceptance "
                f"{_f(row.get('acceptance'), '.3f')}, verify {_f(row.get('verify_step_us'))} us"
                f" / plain {_f(row.get('plain_step_us'))} us, rule {row.get('rule_passed')}")
    if row["kernel"] == "spec_rule":
        d = row["detail"]
        return (f"{head} {s['form']} rule: {row['passed']} ({d.get('violations', 'n/a')} "
                f"violations over {d.get('positions_checked', 'n/a')} checked positions; "
                f"noise {_f(d.get('noise'), '.4f')}; control {row.get('control_passed')}"
                + (f"; {d['reason']}" if d.get("reason") else "") + ")")
    if row["kernel"] == "spec_zero_compile":
        return (f"{head} zero compile with speculation: "
                f"{'PASS' if row['passed'] else 'FAIL'}, {len(row['serve_compiles'])} "
                "compile(s) while serving")
    return (f"{head} audit with speculation: {row['triton_kernels']} Triton kernels, "
            f"{row['cuda_ops']} ops, spec-only {row.get('spec_only_triton_kernels')}, "
            f"failed: {row['failed'] or 'none'}")
