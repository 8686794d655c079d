"""Two GPUs: the agreement models, the throughput config and DSpark served at TP2, at PP2 and at
TP1, in the A100-faithful mode and upstream's Hopper path (needs a machine of two GPUs).

    python benchmarks/e2e/topology.py [--work DIR] [--parts agree,reference,graphs,nocompile,
        tput,spec] [--topologies tp2,pp2,tp1] [--models v41-mini,v4-mini] [--modes a100,upstream]
        [--quick] [--parallel N] [--deadline S] [--bundle F --resume F] [--plan] [--no-run]

Each engine is run_topology.py around run.py (or run_spec.py): tensor_parallel_size and
pipeline_parallel_size passed to vLLM, every rank's layers and attention classes recorded, and
in the a100 mode's eager and nocompile engines the sm_80 audit made inside every worker
(rank_audit.py). Topologies (TOPOLOGIES): tp2 (tensor_parallel_size 2), pp2
(pipeline_parallel_size 2 with a split that keeps each V4.1 KV-sharing group on one stage:
PP2_PARTITION, the nearest split vllm.deepinfer.pp_split finds to vLLM's even split, which
cuts a group in every V4.1 config here and which the Ampere path refuses), tp2rs (TP2 with
the prefill indexer's rows sharded over the two ranks from 2 rows on: vLLM's default
threshold of 65,536 rows keeps every prefill of these runs replicated), tp1 (one GPU,
through the same wrapper: the baseline of the same machine); on request tp2nccl and tp2ring
(TP2 with the custom all-reduce off: PyNCCL inside the CUDA graphs; tp2ring with NCCL pinned
to Ring/Simple).

Parts, in priority order (a --deadline drops the tail; finished engines are kept in the work
folder and, with --bundle, in one file carried to the next machine):
  agree      v41-mini and v4-mini (every expert routed), eager, per topology and mode: run.py's
             agreement prompts; the a100 engines with the rank audit
  reference  the fp32 reference of each (reference.py, one GPU; e2e.py's, shared)
  graphs     the same engines under vLLM's default torch.compile + CUDA graphs
  nocompile  the a100 mode at TP2, eager with vLLM's JIT warmup on and the rank audit: no
             Triton or TileLang compile while serving, on any rank
  tput       v41-tput under CUDA graphs: decode tokens/s at batch 1/8/32(/64), prefill 1K/8K
             (/32K), alone on the machine
  spec       V4.1 DSpark k = 5 (v41-dspark-mini) and the engine without speculation that
             scores it (v41-mini), tp2 and pp2, eager, alone on the machine (spec_step.py's
             commands and rows, spec_rule.py's rule)
Rows (shape with {tp, pp} and, at PP > 1, pp_partition; tp2rs adds row_shard_min_rows):
topology_agreement (a100 against upstream per topology and form; each topology against tp1
of the same mode and form, tp2rs also against tp2; with each rank's row-shard exchanges),
topology_vs_fp32_reference and topology_reference_check (refcheck's rule per topology: the a100
mode no further from the reference than upstream, each the mean of its eager and CUDA-graph
runs, within the spread of upstream's runs), topology_sm80_audit and topology_zero_compile
(every rank's audit merged, the per-rank counts beside), topology_tput, topology_spec_decode and
topology_spec_rule; in benchmarks/results/<gpu>-<date>-e2e-topology-<commit>.json. Speeds are
H200 figures: the a100 mode runs an A100's kernel selection on the H200, not an A100.
Standard library at import.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import compare  # noqa: E402
import engine_plan as ep  # noqa: E402
import spec_rule  # noqa: E402
import spec_step  # noqa: E402
from e2e_models import AGREE_MODELS, MODELS, TPUT_MODEL  # noqa: E402
from refcheck import METRICS, reference_check, ref_out  # noqa: E402
from run_topology import NO_MULTICAST  # noqa: E402

# tp2rs: TP2 with the prefill indexer's rows sharded over the ranks from 2 rows on
# (attention_config.indexer_tp_shard_min_rows; vLLM's 65,536 leaves every prefill of these
# runs replicated, so PrefillRowShard never runs at tp2).
ROW_SHARD_MIN_ROWS = 2
# tp2nccl / tp2ring (not in the default list): TP2 with vLLM's custom all-reduce off, so
# every TP all-reduce, those inside the CUDA graphs included, goes through PyNCCL; tp2ring
# with NCCL pinned to the Ring algorithm and the Simple protocol (docs/e2e.md, "Two GPUs":
# what NCCL must do for full CUDA graphs across ranks).
RING_SIMPLE = "NCCL_ALGO=Ring,NCCL_PROTO=Simple"
TOPOLOGIES = {"tp2": dict(tp=2, pp=1), "pp2": dict(tp=1, pp=2),
              "tp2rs": dict(tp=2, pp=1, row_shard_min_rows=ROW_SHARD_MIN_ROWS),
              "tp1": dict(tp=1, pp=1),
              "tp2nccl": dict(tp=2, pp=1, custom_all_reduce=False),
              "tp2ring": dict(tp=2, pp=1, custom_all_reduce=False, nccl_env=RING_SIMPLE)}
DEFAULT_TOPOLOGIES = ("tp2", "pp2", "tp2rs", "tp1")
# The topologies each one's outputs are compared with (same model, mode and form).
AGAINST = {"tp2": ("tp1",), "pp2": ("tp1",), "tp2rs": ("tp1", "tp2"), "tp1": (),
           "tp2nccl": ("tp1", "tp2"), "tp2ring": ("tp1", "tp2", "tp2nccl")}
# vLLM's even PP2 split (get_pp_indices) of each V4.1 config cuts a KV-sharing group (v41-mini
# and v41-dspark-mini 5,5; v41-tput 6,6); vllm.deepinfer.pp_split's nearest split that keeps
# each group on one stage (tests/test_e2e_topology.py checks these against it). V4 shares no
# KV: vLLM's own split (v4-mini 3,3).
PP2_PARTITION = {"v41-mini": "6,4", "v41-dspark-mini": "6,4", "v41-tput": "5,7"}
MODES = ("a100", "upstream")
PARTS = ("agree", "reference", "graphs", "nocompile", "tput", "spec")
SPEC_CASE = ("v41-dspark-mini", "dspark", 5)
SPEC_PLAIN = "v41-mini"
SPEC_TOPOLOGIES = ("tp2", "pp2")
KIND = "e2e-topology"
# Estimated seconds per engine (not measured at TP2 or PP2: the one-GPU figures of e2e.py's
# and spec_step.py's engines plus about 30 s for the workers' start, NCCL and the custom
# all-reduce); TIMEOUT_S the limit of one engine process.
ESTIMATE_S = {"eager": 120, "graphs": 240, "nocompile": 180, "reference": 120, "tput": 360,
              "spec": 150}
TIMEOUT_S = {"eager": 420, "graphs": 600, "nocompile": 480, "reference": 420, "tput": 900,
             "spec": 420}
QUICK_SAVES_S = 20
AGREE_KV_GIB = 4.0
QUICK_LENS = (7, 300, 1500, 5000)
TPUT_ARGS = ("--task", "tput", "--max-model-len", str(32768 + 512), "--gpu-mem", "0.85")
QUICK_TPUT = ("--batches", "1", "8", "32", "--prefill-lens", "1024", "8192")


@dataclasses.dataclass
class Engine:
    tag: str            # file stem of its output and log in the work folder
    part: str
    model: str
    mode: str
    topo: str
    form: str           # eager, graphs, nocompile, tput, reference, spec, plain
    cmd: list
    estimate_s: float
    timeout_s: float
    alone: bool = False  # runs with nothing beside it on the machine
    scored: tuple = ()   # spec outputs a plain engine scores


def shape_of(topo: str, model: str) -> dict:
    t = TOPOLOGIES[topo]
    out = dict(tp=t["tp"], pp=t["pp"])
    if t["pp"] > 1:
        out["pp_partition"] = PP2_PARTITION.get(model)
    if t.get("row_shard_min_rows"):
        out["row_shard_min_rows"] = t["row_shard_min_rows"]
    if "custom_all_reduce" in t:
        out["custom_all_reduce"] = t["custom_all_reduce"]
    if t.get("nccl_env"):
        out["nccl_env"] = t["nccl_env"]
    return out


def topo_args(topo: str, model: str, rank_audit: bool = False, runner: str = "run") -> list:
    t = TOPOLOGIES[topo]
    cmd = [sys.executable, str(HERE / "run_topology.py"), "--tp", str(t["tp"]), "--pp", str(t["pp"])]
    if t["pp"] > 1 and PP2_PARTITION.get(model):
        cmd += ["--pp-partition", PP2_PARTITION[model]]
    if t.get("row_shard_min_rows"):
        cmd += ["--row-shard-min-rows", str(t["row_shard_min_rows"])]
    if t.get("custom_all_reduce") is False:
        cmd.append("--no-custom-all-reduce")
    if t.get("nccl_env"):
        cmd += ["--nccl-env", t["nccl_env"]]
    if rank_audit:
        cmd.append("--rank-audit")
    if runner != "run":
        cmd += ["--runner", runner]
    return cmd + ["--"]


def ckpt(work: Path, model: str) -> Path:
    return work / f"{model}-{MODELS[model][1]}"


def agree_tag(model: str, mode: str, topo: str, form: str) -> str:
    # No "-agree-" in it: e2e.py's results writer reads every *-agree-*.json of its folder.
    return f"topo-{topo}-{model}-{mode}-{form}"


def plan(work: Path, opts: dict) -> list[Engine]:
    """Every engine of the selected parts in priority order."""
    out: list[Engine] = []
    quick = opts["quick"]
    est = {k: v - (QUICK_SAVES_S if quick else 0) for k, v in ESTIMATE_S.items()}
    agree_extra = ["--gpu-mem", str(round(0.9 / max(1, opts["parallel"]), 2)),
                   "--kv-cache-gib", str(AGREE_KV_GIB)]
    if quick:
        agree_extra += ["--lens", *map(str, QUICK_LENS), "--gen", "16"]

    def agree(form):
        for topo in opts["topologies"]:
            for model in opts["models"]:
                for mode in opts["modes"]:
                    tag = agree_tag(model, mode, topo, form)
                    audit = mode == "a100" and form in ("eager", "nocompile")
                    run_args = ["--model", str(ckpt(work, model)), "--mode", mode, "--task",
                                "agree", "--out", str(work / f"{tag}.json"), *agree_extra]
                    if form == "eager":
                        run_args.append("--eager")
                    elif form == "nocompile":
                        run_args.append("--jit-warmup")
                    out.append(Engine(tag, form if form != "eager" else "agree", model, mode,
                                      topo, form, topo_args(topo, model, audit) + run_args,
                                      est[form], TIMEOUT_S[form]))
    for part in PARTS:
        if part not in opts["parts"]:
            continue
        if part == "agree":
            agree("eager")
        elif part == "graphs":
            agree("graphs")
        elif part == "nocompile":
            if "tp2" in opts["topologies"] and "a100" in opts["modes"]:
                for model in opts["models"]:
                    tag = agree_tag(model, "a100", "tp2", "nocompile")
                    run_args = ["--model", str(ckpt(work, model)), "--mode", "a100", "--task",
                                "agree", "--out", str(work / f"{tag}.json"), "--jit-warmup",
                                *agree_extra]
                    out.append(Engine(tag, "nocompile", model, "a100", "tp2", "nocompile",
                                      topo_args("tp2", model, True) + run_args,
                                      est["nocompile"], TIMEOUT_S["nocompile"]))
        elif part == "reference":
            for model in opts["models"]:
                p = ref_out(work, model, False)
                cmd = [sys.executable, str(HERE / "reference.py"), "--model",
                       str(ckpt(work, model)), "--device", "cuda", "--out", str(p)]
                if quick:
                    cmd += ["--lens", *map(str, QUICK_LENS)]
                out.append(Engine(p.stem, "reference", model, "fp32", "tp1", "reference", cmd,
                                  est["reference"], TIMEOUT_S["reference"]))
        elif part == "tput":
            for topo in opts["topologies"]:
                for mode in opts["modes"]:
                    tag = f"topo-{topo}-{TPUT_MODEL}-{mode}-tput"
                    run_args = ["--model", str(ckpt(work, TPUT_MODEL)), "--mode", mode,
                                "--out", str(work / f"{tag}.json"), *TPUT_ARGS,
                                *(QUICK_TPUT if quick else ())]
                    out.append(Engine(tag, "tput", TPUT_MODEL, mode, topo, "tput",
                                      topo_args(topo, TPUT_MODEL) + run_args, est["tput"],
                                      TIMEOUT_S["tput"], alone=True))
        elif part == "spec":
            out += spec_engines(work, opts, est)
    return out


def _with_out(cmd: list, path: Path) -> list:
    cmd = list(cmd)
    cmd[cmd.index("--out") + 1] = str(path)
    return cmd


def spec_engines(work: Path, opts: dict, est: dict) -> list[Engine]:
    """Per topology and mode: the DSpark engine, then the plain engine scoring it (spec_step's
    run_spec.py commands, their outputs named by topology)."""
    out = []
    model, method, k = SPEC_CASE
    sopts = dict(quick=opts["quick"])
    for topo in [t for t in SPEC_TOPOLOGIES if t in opts["topologies"]]:
        for mode in opts["modes"]:
            s_tag = f"topo-{topo}-{model}-{mode}-spec-{method}-eager"
            p_tag = f"topo-{topo}-{SPEC_PLAIN}-{mode}-specplain-eager"
            s_cmd = _with_out(spec_step.spec_command(work, SPEC_CASE, mode, "eager", sopts),
                              work / f"{s_tag}.json")
            p_cmd = _with_out(spec_step.plain_command(work, SPEC_PLAIN, mode, "eager",
                                                      [work / f"{s_tag}.json"], sopts),
                              work / f"{p_tag}.json")
            out.append(Engine(s_tag, "spec", model, mode, topo, "spec",
                              topo_args(topo, model, runner="spec") + s_cmd[2:], est["spec"],
                              TIMEOUT_S["spec"], alone=True))
            out.append(Engine(p_tag, "spec", SPEC_PLAIN, mode, topo, "plain",
                              topo_args(topo, SPEC_PLAIN, runner="spec") + p_cmd[2:],
                              est["spec"], TIMEOUT_S["spec"], alone=True,
                              scored=(work / f"{s_tag}.json",)))
    return out


def engine_env(work: Path, e: Engine, base=None) -> dict:
    """The caller's environment with a vLLM cache root per engine (vLLM's torch.compile key
    does not cover the DEEPINFER_* switches, nor the topology's rank layout), one Triton cache
    for all, and NVLink multicast kept off (run_topology.NO_MULTICAST)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_CACHE_ROOT"] = str(work / "cache" / e.tag)
    env.setdefault("TRITON_CACHE_DIR", str(work / "cache" / "triton"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    for k, v in NO_MULTICAST.items():
        env.setdefault(k, v)
    return env


def _done(work: Path, e: Engine) -> bool:
    if not (work / f"{e.tag}.json").exists():
        return False
    if e.scored:   # a plain engine scores every speculative output that exists
        r = ep.load(work, e) or {}
        return all(p.stem in (r.get("scores") or {}) for p in e.scored if p.exists())
    return True


def run_plan(work: Path, engines: list[Engine], sh, left, parallel: int,
             after=None) -> list[str]:
    """Engines in order: runs of engines that may share the machine (up to ``parallel`` at
    once), then each alone engine by itself. An engine starts only when its estimate fits in
    ``left()``; it and every engine after it wait for the next invocation. ``after()`` runs
    after each engine that ran (the bundle: a call cut short keeps what finished)."""
    missed: list[str] = []
    stop = [False]
    lock = threading.Lock()

    def one(e: Engine) -> None:
        if _done(work, e):
            return
        if stop[0] or left() < e.estimate_s:
            stop[0] = True
            missed.append(f"{e.tag} (not started: ~{e.estimate_s:.0f} s does not fit in the "
                          "deadline)")
            return
        if e.scored and not all(p.exists() for p in e.scored):
            missed.append(f"{e.tag} (not started: no speculative output to score)")
            return
        rc = sh(e.cmd, work / f"{e.tag}.log", env=engine_env(work, e), timeout=e.timeout_s)
        if rc != 0 or not (work / f"{e.tag}.json").exists():
            missed.append(f"{e.tag} (rc {rc}; log {e.tag}.log)")
        if after is not None:
            with lock:
                after()
    batch: list[Engine] = []

    def flush():
        if batch:
            with ThreadPoolExecutor(max(1, parallel)) as pool:
                list(pool.map(one, batch))
            batch.clear()
    for e in engines:
        if e.alone:
            flush()
            one(e)
        else:
            batch.append(e)
    flush()
    return missed


# ----------------------------------------------------------------------------- rows
def _restrict(run: dict, lens) -> dict:
    return dict(run, prompts=[p for p in run["prompts"] if p["prompt_len"] in lens])


def _rank_summary(r: dict) -> list:
    return [dict(rank=x.get("rank"), tp_rank=x.get("tp_rank"), pp_rank=x.get("pp_rank"),
                 layers=x.get("layers"), attention_classes=x.get("attention_classes"),
                 device=x.get("device"), collectives=x.get("collectives"))
            for x in (r.get("ranks") or []) if isinstance(x, dict)]


def _collectives(r: dict) -> list:
    """Per rank, the collectives' calls by group, implementation, method and whether inside
    CUDA-graph capture (rank_audit.count_collectives)."""
    return [{k: v for k, v in c.items() if k.startswith(("tp.", "pp."))}
            for c in (r.get("rank_counters") or []) if isinstance(c, dict)]


def rows_of(work: Path, engines: list[Engine], tol: dict) -> list[dict]:
    runs = {e.tag: ep.load(work, e) for e in engines}
    rows: list[dict] = []
    agree = {(e.model, e.mode, e.topo, e.form): runs[e.tag] for e in engines
             if e.form in ("eager", "graphs") and runs.get(e.tag)}
    for (model, mode, topo, form), r in sorted(agree.items()):
        base = dict(model=model, cuda_graphs=form == "graphs", **shape_of(topo, model))
        if mode == "a100" and (model, "upstream", topo, form) in agree:
            p = compare.pair(r, agree[(model, "upstream", topo, form)])
            rows.append(_agreement("a100_vs_upstream", base, p, tol))
        for other in AGAINST[topo]:
            if (model, mode, other, form) in agree:
                p = compare.pair(r, agree[(model, mode, other, form)])
                rows.append(_agreement(f"{mode}_{topo}_vs_{mode}_{other}", base, p, tol,
                                       r.get("rank_counters")))
        if r.get("audit") and form == "eager":
            rows.append(_audit_row(model, topo, r))
    for model in sorted({m for m, *_ in agree}):
        f = ref_out(work, model, False)
        if not f.exists():
            continue
        ref = json.load(open(f))
        lens = {p["prompt_len"] for p in ref["prompts"]}
        for topo in TOPOLOGIES:
            got = {}
            for (m, mode, t, form), r in agree.items():
                if m != model or t != topo:
                    continue
                p = compare.pair(_restrict(r, lens), ref)
                got[(mode, form == "eager")] = {k: p[k] for k in METRICS}
                rows.append(dict(kernel="topology_vs_fp32_reference", variant=mode,
                                 shape=dict(model=model, cuda_graphs=form == "graphs",
                                            reference=ref["mode"], prompt_lens=sorted(lens),
                                            **shape_of(topo, model)),
                                 **{k: p[k] for k in METRICS}))
            check = reference_check(got, dict(model=model, reference=ref["mode"],
                                              prompt_lens=sorted(lens), **shape_of(topo, model)))
            if check:
                rows.append(dict(check, kernel="topology_reference_check"))
    for e in engines:
        r = runs.get(e.tag)
        if not r:
            continue
        if e.form == "nocompile" and r.get("audit"):
            a = r["audit"]
            rows.append(dict(kernel="topology_zero_compile", variant="a100",
                             shape=dict(model=e.model, jit_warmup=True, **shape_of(e.topo, e.model)),
                             passed=a.get("zero_compile"), serve_compiles=a.get("serve_compiles"),
                             serve_compiles_outside_path=a.get("serve_compiles_outside", []),
                             compiles_by_phase=a.get("compiles_by_phase"),
                             warmup_seconds=a.get("warmup_seconds"),
                             load_seconds=r.get("load_seconds"), failed=a.get("failed"),
                             ranks=_rank_summary(r)))
            rows.append(_audit_row(e.model, e.topo, r, jit_warmup=True))
        elif e.form == "tput":
            for t in r.get("rows") or []:
                rows.append(dict(kernel="topology_tput", variant=e.mode,
                                 shape=dict(model=e.model, phase=t["phase"], batch=t["batch"],
                                            prompt_len=t["prompt_len"],
                                            **shape_of(e.topo, e.model)),
                                 tokens_per_s=t["tokens_per_s"], seconds=t.get("seconds"),
                                 timing=t.get("timing", "whole generate call"),
                                 error=t.get("error"), load_seconds=r.get("load_seconds"),
                                 ranks=_rank_summary(r), collectives=_collectives(r)))
    rows += spec_rows(engines, runs)
    return rows


def _agreement(variant: str, shape: dict, p: dict, tol: dict, counters=None) -> dict:
    ok = p["top1_agree"] >= tol["min_top1_agree"] and p["max_abs_dlogprob"] <= tol["max_abs_dlogprob"]
    row = dict(kernel="topology_agreement", variant=variant, shape=shape,
               top1_agree=p["top1_agree"], max_abs_dlogprob=p["max_abs_dlogprob"],
               mean_abs_dlogprob=p.get("mean_abs_dlogprob"), identical=compare.identical(p),
               within_tolerance=ok, tolerance=tol, detail=p)
    if counters:   # per rank (rank_audit): the row shard's exchanges, the collectives' calls
        row["row_shard_exchanges"] = [c.get("row_shard_exchanges", 0) if isinstance(c, dict)
                                      else None for c in counters]
        row["collectives"] = _collectives(dict(rank_counters=counters))
    return row


def _audit_row(model: str, topo: str, r: dict, jit_warmup: bool = False) -> dict:
    a = r["audit"]
    per_rank = [dict(rank=i, triton_kernels=len(x.get("triton_kernels", [])),
                     cuda_ops=len(x.get("cuda_ops", [])), failed=len(x.get("failed", [])))
                for i, x in enumerate(r.get("rank_audit") or []) if isinstance(x, dict)]
    return dict(kernel="topology_sm80_audit", variant="a100",
                shape=dict(model=model, jit_warmup=jit_warmup, **shape_of(topo, model)),
                triton_kernels=len({t["name"] for t in a.get("triton_kernels", [])}),
                cuda_ops=len({o["op"] for o in a.get("cuda_ops", [])}), failed=a.get("failed"),
                deep_gemm_calls=a.get("deep_gemm_calls"),
                tilelang_compiles=a.get("tilelang_compiles"), per_rank=per_rank,
                ranks=_rank_summary(r), selections=r.get("selections"))


def spec_rows(engines: list[Engine], runs: dict) -> list[dict]:
    out = []
    model, method, k = SPEC_CASE
    for e in engines:
        s = runs.get(e.tag)
        if e.form != "spec" or not s:
            continue
        plain = next((x for x in engines if x.form == "plain" and x.topo == e.topo
                      and x.mode == e.mode), None)
        p = runs.get(plain.tag) if plain else None
        r = spec_rule.rule(s, p, e.tag) if p else dict(
            passed=None, reason="no plain engine of this topology and mode")
        topo = shape_of(e.topo, model)
        out.append(dict(kernel="topology_spec_rule", variant=e.mode,
                        shape=dict(model=model, method=method, k=k, form="eager", **topo),
                        passed=r.get("passed"),
                        control_passed=(r.get("control") or {}).get("passed"),
                        rule_acceptance=(s.get("rule_acceptance") or {}).get("acceptance"),
                        plain_model=SPEC_PLAIN, ranks=_rank_summary(s), detail=r))
        for row in spec_step.decode_rows(model, method, k, e.mode, "eager", s, p, r.get("passed")):
            out.append(dict(row, kernel="topology_spec_decode",
                            shape=dict(row["shape"], **topo)))
    return out


# ----------------------------------------------------------------------------- driver
def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/deepinfer-e2e-topology"))
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--topologies", default=",".join(DEFAULT_TOPOLOGIES),
                    help=f"of {', '.join(TOPOLOGIES)} (default: {', '.join(DEFAULT_TOPOLOGIES)})")
    ap.add_argument("--models", default=",".join(AGREE_MODELS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--quick", action="store_true", help="shorter prompts and fewer shapes")
    ap.add_argument("--parallel", type=int, default=2,
                    help="agreement engines at once (each spans its topology's GPUs)")
    ap.add_argument("--deadline", type=float, default=None)
    ap.add_argument("--bundle", type=Path, default=None,
                    help="write every finished engine's output into this file")
    ap.add_argument("--resume", type=Path, default=None,
                    help="take finished engines' outputs from this bundle first")
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--plan", action="store_true", help="print the engines and estimates")
    ap.add_argument("--no-run", action="store_true", help="rows from the work folder only")
    ap.add_argument("--sparse-routing", action="store_true",
                    help="checkpoints keep the configs' expert top-k (e2e.py's option)")
    args = ap.parse_args(argv)
    for name, known in (("parts", PARTS), ("topologies", TOPOLOGIES), ("modes", MODES),
                        ("models", AGREE_MODELS)):
        vals = _csv(getattr(args, name))
        bad = sorted(set(vals) - set(known))
        if bad or not vals:
            ap.error(f"--{name}: unknown {', '.join(bad) or '(none given)'}; known: "
                     f"{', '.join(known)}")
        setattr(args, name, vals)
    return args


def checkpoints(work: Path, engines: list[Engine], sh, dense: bool) -> None:
    """The engines' checkpoints as e2e.py writes them (spec_step.make_checkpoints: the same
    folders and tools/make_checkpoint.py calls): every expert routed except in the throughput
    config, as e2e.py's agreement, spec and tput checkpoints are."""
    import e2e
    names = sorted({e.model for e in engines})
    routed = [n for n in names if n != TPUT_MODEL]
    spec_step.make_checkpoints(work, routed, sh, e2e.dense_routing if dense else None)
    if TPUT_MODEL in names:
        spec_step.make_checkpoints(work, [TPUT_MODEL], sh, None)


def main(argv=None, sh=None) -> int:
    args = parse_args(argv)
    import e2e
    sh = sh or e2e.sh
    if args.deadline is not None:
        e2e._DEADLINE[0] = time.time() + args.deadline
    opts = dict(parts=args.parts, topologies=args.topologies, models=args.models,
                modes=args.modes, quick=args.quick, parallel=args.parallel)
    work = args.work
    engines = plan(work, opts)
    resumed = ep.load_bundle(args.resume, work, engines) if args.resume else []
    for e in engines:
        print(f"  {'done' if _done(work, e) else f'~{e.estimate_s:.0f} s':>7}  {e.tag}"
              + ("  (alone)" if e.alone else ""), flush=True)
    todo = [e for e in engines if not _done(work, e)]
    print(f"  {len(todo)} of {len(engines)} engines to run, ~{sum(e.estimate_s for e in todo):.0f}"
          f" s one at a time", flush=True)
    if args.plan:
        return 0
    not_done: list[str] = []
    if not args.no_run:
        work.mkdir(parents=True, exist_ok=True)
        checkpoints(work, [e for e in engines if not _done(work, e)], sh, not args.sparse_routing)
        save = (lambda: ep.save_bundle(args.bundle, work, engines)) if args.bundle else None
        try:
            not_done = run_plan(work, engines, sh, e2e._left, args.parallel, after=save)
        finally:
            if save is not None:
                save()
    rows = rows_of(work, engines, e2e.TOL)
    outs = [ep.load(work, e) for e in engines]
    meta = dict(ep.meta_of(outs), date=datetime.date.today().isoformat(), failed_runs=not_done,
                resumed=resumed, topologies={t: TOPOLOGIES[t] for t in args.topologies},
                pp2_partition=PP2_PARTITION, tolerance=e2e.TOL,
                not_run=[e.tag for e in engines if not _done(work, e)],
                note="H200 figures; the a100 mode emulates an A100's kernel selection on the "
                     "H200 (DEEPINFER_EMULATE_CAPABILITY=8.0): its speeds are not A100 speeds")
    if not any(outs):
        print(f"no engine output in {work}: no results file written", flush=True)
        return 0
    out = args.results / ep.results_name(meta, KIND)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {out} ({len(rows)} rows; not done: {not_done or 'none'})", flush=True)
    for r in rows:
        s = r["shape"]
        head = f"  {r['kernel']:27s} {r['variant']:24s} {s.get('model')} tp{s['tp']} pp{s['pp']}"
        if "top1_agree" in r:
            print(f"{head} top1 {r['top1_agree']:.4f} max|dlp| {r['max_abs_dlogprob']:.4f}")
        elif r["kernel"] == "topology_tput":
            print(f"{head} {s['phase']} b{s['batch']} L{s['prompt_len']} "
                  + (f"{r['tokens_per_s']:.1f} tok/s" if r["tokens_per_s"] is not None
                     else f"failed: {r['error']}"))
        elif "passed" in r:
            print(f"{head} passed {r['passed']}")
        else:
            print(f"{head} failed: {r.get('failed') or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
