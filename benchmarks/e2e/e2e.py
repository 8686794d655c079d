"""`make e2e`: DeepSeek-V4.1 and V4 served end to end by vLLM itself on this GPU.

    python benchmarks/e2e/e2e.py [--work DIR] [--steps ckpt,agree,graphs,tput] [--quick]

Why this file stays whole: it is the driver of every step, one job list in priority order
under one --deadline and one results writer over every step's outputs; the steps' own logic
lives in their modules (long_step.py, refcheck.py, spec_step.py, e2e_models.py).

1. ckpt    deterministic random-weight checkpoints (tools/make_checkpoint.py) of the configs in
           benchmarks/e2e/configs/, in the published formats (V4.1: MXFP8 linears + MXFP4
           experts; V4: fp8 [128,128] linears + MXFP4 experts).
2. agree   each model, eager, in three modes (benchmarks/e2e/run.py): a100 (A100-faithful,
           with the sm_80 audit), sm90 (our path, Hopper kernels), upstream (FlashMLA +
           DeepGEMM). Greedy tokens and top-20 logprobs; pairs compared (compare.py).
3. graphs  the same for a100 and upstream with vLLM's default torch.compile + CUDA graphs.
4. tput    decode tokens/s (batch 1, 8, 32, 64) and prefill tokens/s (1K, 8K, 32K) on the
           throughput config, one process per mode.
5. yoco     each model, eager, with the indexer's top-k rows sorted (run.py's *_det modes):
           cross-layer reuse off (a100_det_noyoco, sm90_det_noyoco) and a second a100 run
           (a100_det_rerun): greedy tokens and logprobs must equal the reuse-on runs (rows
           kernel="yoco_e2e"; the rerun pair is the run-to-run floor).
6. nocompile  each model in the a100 mode, eager but with vLLM's JIT warmup on
           (run.py --jit-warmup --audit): after the warmup, the served requests (chunked
           prefill, decode, mixed batches, every compress ratio) must compile no Triton or
           TileLang kernel; rows kernel="zero_compile" with what compiled and the warmup time.
7. reference  the fp32 torch reference of each agreement checkpoint (reference.py, on this
           GPU in fp32 with TF32 off), plain and with the KV rows rounded as the fp8 record
           does; rows kernel="e2e_vs_fp32_reference" per run and kernel="e2e_reference_check"
           per model: the a100 mode no further from the reference than upstream's path.
8. long    real-geometry long-context configs (configs/v41-long, configs/v4-long), one engine
           per (model, mode, form) alone on the GPU serving every length of --long-lens in one
           start (run.py --task long, shortest first): TTFT, prefill and decode tokens/s at
           that context (batch 1; batch 4 at --long-b4-lens), peak memory, vLLM's KV
           capacity (rows kernel="long_context"), the longest prefill split by stage
           (kernel="long_context_stage"), the last 2,048 positions of a 128K prompt per mode
           (kernel="e2e_agreement"). Partial outputs of stopped engines are reported.
9. long_reference  the fp32 reference of that 128K prompt (reference.py on this GPU); rows
           kernel="e2e_vs_fp32_reference" and "e2e_reference_check" for the long models.
10. spec   speculative decoding (spec_step.py, run_spec.py; --spec-* options): rows
           kernel="spec_decode", "spec_rule", "spec_sm80_audit", "spec_zero_compile".
--models picks the models of the agree, graphs, reference and nocompile steps (and yoco's):
the agreement models (default), or per-rank shapes: configs/v41-tp{2,4,8}-mini and
v4-tp{2,4,8}-mini hold one rank of TP 2 / 4 / 8 of v41-mini / v4-mini (32 / 16 / 8 heads,
4 / 2 / 1 o_groups; e2e_models.PER_RANK_MODELS), served on this one GPU at TP 1 and held to
the same rules; their rows take the per_rank_* kernels (e2e_models.PER_RANK_ROWS) and, alone,
a results file of their own (-e2e-per-rank-). --agree-modes narrows the agree and graphs
steps' modes (the reference rule needs a100 and upstream).
Writes benchmarks/results/<gpu>-<date>-e2e-<commit>.json (rows: e2e, e2e_agreement,
sm80_audit, ...; -e2e-long- when only the long steps ran); benchmarks/charts.py draws them.
Engines of the agreement steps run side by side on the GPU (--parallel), the throughput and
long-context ones alone.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import compare  # noqa: E402
# The checkpoints and modes, the long step and the reference check live in their own modules;
# their names are re-exported here (the tests use them as e2e.<name>).
from e2e_models import (  # noqa: E402
    AGREE_MODELS, BASE_KERNEL, MODELS, MODES, PER_RANK_MODELS, PER_RANK_TPS, TPUT_MODEL,
    per_rank_rows)
from long_step import (  # noqa: E402,F401
    LONG_AGREE_LEN, LONG_DECODE, LONG_FORMS, LONG_GPU_MEM, LONG_LENS, LONG_MODELS, LONG_MODES,
    LONG_QUICK_DECODE, LONG_START_S, long_agreement_rows, long_command, long_jobs,
    long_options, long_rows, long_run_timeout, long_runs, run_long, step_long)
from refcheck import (  # noqa: E402,F401
    METRICS, recheck, ref_out, reference_check, reference_rows)
from spec_step import (  # noqa: E402
    add_spec_args, spec_line, spec_options, spec_rows, spec_sample, step_spec)

# --steps yoco: reuse on against off, and the run-to-run floor (a second a100 run), all with
# the indexer's top-k rows sorted (run.py's *_det modes): without that, two runs of one
# engine already differ (docs/yoco.md). Pairs of the unsorted modes from earlier runs in the
# work folder are reported too.
YOCO_MODES = ("a100_verify", "sm90_verify",
              "a100_det", "a100_det_noyoco", "a100_det_rerun", "sm90_det", "sm90_det_noyoco")
# Product kinds every verify run must have compared at least once (rows kernel="yoco_verify"):
# the agreement prompts decode and prefill in chunks on every compressed layer. V4 shares no
# KV source, so its gathers and indexer K are never reused (docs/yoco.md).
VERIFY_KINDS = {"v41-mini": ("decode_indices", "swa_ragged", "combine", "gather", "indexer_k"),
                "v4-mini": ("swa_ragged",)}
# The reuse-on a100 run of --steps yoco also generates its prompts a second time in the same
# process: were that identical while a second process differs, the run-to-run variation
# comes from process state (allocation, caches, heuristics), not from the kernels' math.
# The same runs, and sm90_det's, then generate once more with reuse off (run.py
# --toggle-yoco): reuse on against off within one process, where the engine's own
# run-to-run variation between processes does not enter.
REPEAT_MODES = ("a100_det", "sm90_det")
# --steps tput beyond MODES: the A100-faithful engine with the one-launch mHC decode kernel
# forced off and on (run.py), whose decode rows make the served decode-step comparison of
# that kernel (rows kernel="mhc_decode_served").
TPUT_EXTRA_MODES = ("a100_mhcdec_off", "a100_mhcdec_on")
REPEAT_MODE = REPEAT_MODES[0]
YOCO_PAIRS = (("a100_det", "a100_det_noyoco"), ("sm90_det", "sm90_det_noyoco"),
              ("a100_det", "a100_det_rerun"),
              ("a100", "a100_noyoco"), ("sm90", "sm90_noyoco"), ("a100", "a100_rerun"))
# Tolerances (docs/e2e.md says why): teacher-forced prompt positions.
TOL = {"min_top1_agree": 0.98, "max_abs_dlogprob": 0.25}
STAGGER_S = 25
RUN_TIMEOUT_S = int(os.environ.get("E2E_RUN_TIMEOUT", "420"))
# KV cache of an agreement engine (vLLM's kv_cache_memory_bytes). The mini models' caches
# for one 16K prompt plus the short ones take well under 1 GiB; with a fixed size vLLM skips
# the free-memory comparison of its profile run, so engines start side by side without the
# start-up lock (run.py) and without staggering.
AGREE_KV_GIB = 4.0
QUICK_LENS = (7, 300, 1500, 5000)   # --quick: agreement (and reference) prompt lengths
_DEADLINE = [float("inf")]   # time.time() after which no run starts and running ones stop


def _left() -> float:
    return _DEADLINE[0] - time.time()


def sh(cmd: list[str], log: Path, env=None, timeout=None) -> int:
    if _left() < 30:
        with open(log, "w") as f:
            f.write("not started: the --deadline left under 30 s\n")
        print(f"  [skip] deadline {log.stem}", flush=True)
        return 125
    timeout = min(timeout or float("inf"), _left())
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"  [{rc}] {time.time() - t0:6.1f}s {log.stem}", flush=True)
    return rc


def dense_routing(cfg_dir: Path) -> list[str]:
    """--set overrides that route every token to every expert.

    With random weights the router's top-k sits on near-ties, so a rounding difference
    anywhere upstream flips an expert choice and the run diverges: upstream's own eager and
    CUDA-graph runs of v41-mini agreed on only 90% of top-1 tokens with top-2 of 8 experts
    (archive/h200-2026-12-01-e2e-814f4ac.json). With all experts selected the MoE is a continuous
    function of its input (Marlin MoE still runs, with top-k = all), so agreement measures the
    kernels, not the routing's discontinuity. --sparse-routing keeps the configs' top-k."""
    text = json.load(open(cfg_dir / "config.json"))
    text = text.get("text_config", text)
    return ["--set", f"num_experts_per_tok={text['n_routed_experts']}"]


def make_checkpoints(work: Path, names, dense: bool) -> None:
    for name in names:
        cfg, fmt = MODELS[name]
        out = work / f"{name}-{fmt}"
        if (out / "config.json").exists():
            continue
        # The long models serve an agreement prompt too; with every expert selected their MoE
        # also does 8 x 512 intermediate columns per token, nearer the released V4.1's 7 x 2048
        # than top-2 of 8.
        extra = (dense_routing(HERE / "configs" / cfg)
                 if dense and name in AGREE_MODELS + LONG_MODELS + tuple(PER_RANK_MODELS)
                 else [])
        sh([sys.executable, str(REPO / "tools" / "make_checkpoint.py"),
            str(HERE / "configs" / cfg), "--format", fmt, "--out", str(out), *extra],
           work / f"ckpt-{name}.log")


def _out(work: Path, name: str, mode: str, form: str) -> Path:
    if form.startswith("reference"):
        return ref_out(work, name, form.endswith("kvfp8"))
    if form == "nocompile":
        return work / f"{name}-{mode}-nocompile.json"
    return work / f"{name}-{mode}-agree-{form}.json"


def run_job(work: Path, name: str, mode: str, form: str, extra=(), lens=None) -> Path | None:
    """One agreement engine: form "eager", "graphs" (vLLM's defaults) or "nocompile" (eager
    with vLLM's JIT warmup on, and the audit of what compiles while serving)."""
    if form.startswith("reference"):  # lens: the agreement prompts' (None: run.py's default)
        return run_reference(work, name, form.endswith("kvfp8"), lens)
    if form != "nocompile":
        return run_mode(work, name, mode, "agree", form == "eager", extra)
    cfg, fmt = MODELS[name]
    out = _out(work, name, mode, form)
    rc = sh([sys.executable, str(HERE / "run.py"), "--model", str(work / f"{name}-{fmt}"),
             "--mode", mode, "--task", "agree", "--jit-warmup", "--audit", "--out", str(out),
             *extra], work / f"{name}-{mode}-nocompile.log", timeout=RUN_TIMEOUT_S)
    return out if rc == 0 and out.exists() else None


def run_reference(work: Path, name: str, kv_fp8: bool, lens=None) -> Path | None:
    cfg, fmt = MODELS[name]
    out = ref_out(work, name, kv_fp8)
    cmd = [sys.executable, str(HERE / "reference.py"), "--model", str(work / f"{name}-{fmt}"),
           "--device", "cuda", "--out", str(out)]
    if lens:
        cmd += ["--lens", *map(str, lens)]
    if kv_fp8:
        cmd.append("--mimic-kv-fp8")
    rc = sh(cmd, work / f"{out.stem}.log", timeout=RUN_TIMEOUT_S)
    return out if rc == 0 and out.exists() else None


def verify_row(name: str, mode: str, totals: dict) -> dict:
    """kernel="yoco_verify": every product cross-layer reuse handed out while serving was
    built again and compared bit for bit (DEEPINFER_YOCO_VERIFY=1). Passes when nothing
    differed and each kind the model reuses was compared."""
    kinds = sorted({k.split(".")[0] for k in totals})
    per = {k: dict(hits=totals.get(f"{k}.hit", 0), builds=totals.get(f"{k}.build", 0),
                   equal=totals.get(f"{k}.verify_equal", 0),
                   mismatch=totals.get(f"{k}.verify_mismatch", 0)) for k in kinds}
    need = VERIFY_KINDS.get(name, ())
    missing = [k for k in need if per.get(k, {}).get("equal", 0) == 0]
    mismatches = sum(v["mismatch"] for v in per.values())
    unverified = [k for k, v in per.items() if v["hits"] != v["equal"] + v["mismatch"]]
    return dict(kernel="yoco_verify", variant=mode, shape=dict(model=name, eager=True),
                passed=mismatches == 0 and not missing and not unverified,
                mismatches=mismatches, compared=sum(v["equal"] + v["mismatch"]
                                                    for v in per.values()),
                kinds_not_compared=missing, hits_not_compared=unverified, per_kind=per)


def run_mode(work: Path, name: str, mode: str, task: str, eager: bool, extra=()) -> Path | None:
    cfg, fmt = MODELS[name]
    tag = f"{name}-{mode}-{task}-{'eager' if eager else 'graphs'}"
    out = work / f"{tag}.json"
    cmd = [sys.executable, str(HERE / "run.py"), "--model", str(work / f"{name}-{fmt}"),
           "--mode", mode, "--task", task, "--out", str(out), *extra]
    if mode in REPEAT_MODES and task == "agree":
        # in-process rerun (rows kernel="e2e_repeat"), then reuse off in the same process
        cmd += ["--repeat", "2", "--toggle-yoco"]
    if eager:
        cmd.append("--eager")
    if mode == "a100" and eager and task == "agree":
        cmd.append("--audit")
    rc = sh(cmd, work / f"{tag}.log", timeout=RUN_TIMEOUT_S)
    return out if rc == 0 and out.exists() else None


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


# --models: names of the agreement-style models, or these groups of them.
MODEL_GROUPS = {"agree": AGREE_MODELS, "per-rank": tuple(PER_RANK_MODELS),
                **{f"tp{tp}": tuple(n for n, (_, t) in PER_RANK_MODELS.items() if t == tp)
                   for tp in PER_RANK_TPS}}


def select_models(spec: str) -> tuple[str, ...]:
    """The models ``--models`` names (comma-separated names of AGREE_MODELS and
    PER_RANK_MODELS, or MODEL_GROUPS), in order, each once."""
    out: list[str] = []
    for part in (p for p in spec.split(",") if p):
        for name in MODEL_GROUPS.get(part, (part,)):
            if name not in AGREE_MODELS and name not in PER_RANK_MODELS:
                raise ValueError(f"unknown model {name!r}; known: "
                                 f"{', '.join([*MODEL_GROUPS, *AGREE_MODELS, *PER_RANK_MODELS])}")
            if name not in out:
                out.append(name)
    if not out:
        raise ValueError("no model named")
    return tuple(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/deepinfer-e2e")
    ap.add_argument("--steps", default="ckpt,agree,graphs,tput,nocompile,reference")
    ap.add_argument("--models", default="agree",
                    help="models of the agree, graphs, reference, nocompile and yoco steps: "
                    "names or groups (agree: v41-mini,v4-mini; per-rank: every per-rank "
                    "shape; tp2, tp4, tp8: both models' rank of that TP), comma-separated")
    ap.add_argument("--agree-modes", default=",".join(MODES),
                    help="modes of the agree and graphs steps (default: all of MODES; "
                    "the reference check needs a100 and upstream)")
    ap.add_argument("--parallel", type=int, default=3, help="agreement engines at once")
    ap.add_argument("--quick", action="store_true", help="shorter prompts and fewer shapes")
    ap.add_argument("--yoco-modes", default=",".join(YOCO_MODES),
                    help="the yoco step's run.py modes, comma-separated (default: all of "
                    "YOCO_MODES; REPEAT_MODES among them also rerun and toggle reuse in "
                    "process)")
    ap.add_argument("--tput-modes", default=",".join(MODES),
                    help="the tput step's modes, comma-separated (default: all of MODES; "
                    f"also {', '.join(TPUT_EXTRA_MODES)})")
    ap.add_argument("--tput-batches", default=None,
                    help="the tput step's decode batch sizes, comma-separated (default: "
                    "run.py's; --quick: 1,8,32)")
    ap.add_argument("--tput-prefill-lens", default=None,
                    help="the tput step's prefill lengths, comma-separated ('' for none; "
                    "default: run.py's; --quick: 1024,8192)")
    ap.add_argument("--sparse-routing", action="store_true",
                    help="agreement checkpoints keep the configs' expert top-k (see dense_routing)")
    ap.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from now after which no run starts and running ones are "
                    "stopped; results are then written from what finished")
    ap.add_argument("--profile-memory", action="store_true",
                    help="agreement engines size their KV cache by vLLM's memory profiling "
                    "(then start-up is serialized by a lock and staggered) instead of a "
                    f"fixed {AGREE_KV_GIB:g} GiB")
    ap.add_argument("--recheck", type=Path, default=None,
                    help="apply the reference check to an earlier results file's "
                    "e2e_vs_fp32_reference rows, print the rows as JSON and exit")
    g = ap.add_argument_group("long step (--steps long, long_reference)")
    g.add_argument("--long-models", default=",".join(LONG_MODELS))
    g.add_argument("--long-modes", default=",".join(LONG_MODES), help="of MODES")
    g.add_argument("--long-forms", default="eager",
                   help="eager and/or graphs (vLLM's default torch.compile + CUDA graphs)")
    g.add_argument("--long-lens", default=",".join(map(str, LONG_LENS)),
                   help="prompt lengths, each served at batch 1 (shortest first)")
    g.add_argument("--long-b4-lens", default=None,
                   help="of --long-lens, those also served as a batch of 4 (default: all; "
                   "--quick: the shortest; '' for none)")
    g.add_argument("--long-agree-len", type=int, default=LONG_AGREE_LEN,
                   help="agreement prompt length (last 2,048 positions; 0: none)")
    g.add_argument("--long-profile-len", type=int, default=None,
                   help="the batch-1 prefill split by stage (default: the longest; 0: none)")
    g.add_argument("--long-profile-batch", type=int, default=1, choices=(1, 4),
                   help="the batch of --long-profile-len that is profiled (4: needs the "
                   "length in --long-b4-lens)")
    g.add_argument("--long-request-timeout", type=float, default=None,
                   help="seconds per request (default: run.py's length-scaled limit)")
    g.add_argument("--long-rerun", action="store_true",
                   help="run long engines again whose output exists (complete or partial)")
    add_spec_args(ap)
    args = ap.parse_args()
    if args.recheck is not None:
        print(json.dumps(recheck(args.recheck), indent=1))
        return 0
    if args.deadline is not None:
        _DEADLINE[0] = time.time() + args.deadline
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    steps = set(args.steps.split(","))
    try:
        models = select_models(args.models)
    except ValueError as e:
        ap.error(f"--models: {e}")
    if "yoco" in steps and set(models) & set(PER_RANK_MODELS):
        ap.error("--steps yoco serves the agreement models only (its rows have no per-rank "
                 "kind); drop the per-rank models or the yoco step")
    agree_modes = [m for m in args.agree_modes.split(",") if m]
    if not agree_modes or sorted(set(agree_modes) - set(MODES)):
        ap.error(f"--agree-modes: unknown {', '.join(sorted(set(agree_modes) - set(MODES)))}; "
                 f"known: {', '.join(MODES)}")
    long_opts = long_options(args, ap) if steps & {"long", "long_reference"} else None
    spec_opts = spec_options(args, ap) if "spec" in steps else None
    agree_extra = ["--gpu-mem", str(round(0.9 / args.parallel, 2))]
    if not args.profile_memory:
        agree_extra += ["--kv-cache-gib", str(AGREE_KV_GIB)]
    stagger = STAGGER_S if args.profile_memory else 0
    lens = QUICK_LENS if args.quick else None
    if args.quick:
        agree_extra += ["--lens", *map(str, QUICK_LENS), "--gen", "16"]

    tput_modes = [m for m in args.tput_modes.split(",") if m]
    tput_known = (*MODES, *TPUT_EXTRA_MODES)
    if sorted(set(tput_modes) - set(tput_known)):
        ap.error(f"--tput-modes: unknown {', '.join(sorted(set(tput_modes) - set(tput_known)))}; "
                 f"known: {', '.join(tput_known)}")
    if "ckpt" in steps:
        # The agreement models serve every step but tput.
        agree_needed = bool(steps & {"agree", "reference", "graphs", "yoco", "nocompile"})
        make_checkpoints(work, (set(models) if agree_needed else set())
                         | ({TPUT_MODEL} if "tput" in steps else set())
                         | (set(long_opts["models"]) if long_opts else set()),
                         dense=not args.sparse_routing)
    # Jobs in priority order (a --deadline drops the tail): (model, mode, form), form one of
    # "eager", "graphs", "nocompile".
    jobs: list[tuple[str, str, str]] = []
    if "agree" in steps:
        jobs += [(n, m, "eager") for n in models for m in MODES if m in agree_modes]
    # The fp32 reference runs beside the engines (a few GiB of the GPU's memory; the agreement
    # engines have a fixed KV cache).
    if "reference" in steps:
        jobs += [(n, "fp32", "reference") for n in models]
    if "graphs" in steps:
        jobs += [(n, m, "graphs") for n in models for m in ("a100", "upstream")
                 if m in agree_modes]
    if "yoco" in steps:
        yoco_modes = [m for m in args.yoco_modes.split(",") if m]
        unknown = sorted(set(yoco_modes) - set(YOCO_MODES))
        if unknown:
            ap.error(f"--yoco-modes: unknown {', '.join(unknown)}; known: {', '.join(YOCO_MODES)}")
        jobs += [(n, m, "eager") for n in models for m in yoco_modes]
    if "nocompile" in steps:
        jobs += [(n, "a100", "nocompile") for n in models]
    if "reference" in steps:
        jobs += [(n, "fp32", "reference_kvfp8") for n in models]
    if "graphs" in steps:
        jobs += [(n, "sm90", "graphs") for n in models if "sm90" in agree_modes]
    jobs = [j for i, j in enumerate(jobs) if j not in jobs[:i] and not _out(work, *j).exists()]

    def job(ij):
        i, j = ij
        # Staggered starts (--profile-memory only): an engine profiling its memory while
        # another one frees memory trips vLLM's memory-profiling check.
        time.sleep(stagger * (i % args.parallel) if i < args.parallel else 0)
        return j, run_job(work, *j, agree_extra, lens)
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        outs = list(pool.map(job, enumerate(jobs)))
    if args.profile_memory:  # a run that failed beside others is tried once more alone
        outs = [(j, p or run_job(work, *j, agree_extra, lens)) for j, p in outs]
    not_done = [f"{n}/{m}/{form}" for (n, m, form), p in outs if not p]
    tput_outs = []
    if "tput" in steps:
        extra = ["--max-model-len", str(32768 + 512), "--gpu-mem", "0.85"]
        # Given sizes win over --quick's; neither given: run.py's defaults.
        batches = args.tput_batches if args.tput_batches is not None \
            else ("1,8,32" if args.quick else None)
        lens_ = args.tput_prefill_lens if args.tput_prefill_lens is not None \
            else ("1024,8192" if args.quick else None)
        if batches is not None:
            extra += ["--batches", *[b for b in batches.split(",") if b]]
        if lens_ is not None:
            extra += ["--prefill-lens", *[n for n in lens_.split(",") if n]]
        for m in tput_modes:
            if (work / f"{TPUT_MODEL}-{m}-tput-graphs.json").exists():
                continue
            p = run_mode(work, TPUT_MODEL, m, "tput", False, extra)
            if not p:
                not_done.append(f"{TPUT_MODEL}/{m}/tput")
    if "long" in steps:
        not_done += step_long(work, long_opts, args.long_rerun, sh=sh)
    if "long_reference" in steps and long_opts["agree_len"]:
        # After the engines, alone on the GPU: the fp32 reference of the agreement prompt.
        for n in long_opts["models"]:
            if not ref_out(work, n, False).exists() and not run_reference(
                    work, n, False, [long_opts["agree_len"]]):
                not_done.append(f"{n}/fp32/reference")
    if "spec" in steps:
        not_done += step_spec(work, spec_opts, sh=sh, left=_left,
                              dense_routing=None if args.sparse_routing else dense_routing)
    # Results from every run in the work folder, earlier invocations' too (so the steps can
    # run as separate commands and still land in one file).
    outs, tput_outs = [], []
    for f in sorted(work.glob("*-agree-*.json")):
        name, rest = _split_tag(f.stem)
        mode, _, form = rest
        outs.append(((name, mode, form == "eager"), f))
    for m in (*MODES, *TPUT_EXTRA_MODES):
        f = work / f"{TPUT_MODEL}-{m}-tput-graphs.json"
        if f.exists():
            tput_outs.append((m, f))
    write_results(args, work, outs, tput_outs, not_done)
    return 0


def mhc_decode_served_rows(rows: list[dict]) -> list[dict]:
    """The served decode-step comparison of the one-launch mHC decode kernel: per decode
    batch that both tput modes of TPUT_EXTRA_MODES measured, the engine step time with the
    kernel off and on (a decode step of batch b makes b tokens: step_us = b / tokens_per_s)
    and their ratio (``speedup`` > 1: the kernel on is faster)."""
    off_m, on_m = TPUT_EXTRA_MODES
    by = {(r["variant"], r["shape"]["batch"]): r for r in rows
          if r.get("kernel") == "e2e" and r["shape"].get("phase") == "decode"
          and r["variant"] in TPUT_EXTRA_MODES and r.get("tokens_per_s")}
    out = []
    for (mode, b), off in sorted(by.items(), key=lambda kv: kv[0][1]):
        on = by.get((on_m, b))
        if mode != off_m or on is None:
            continue
        off_us, on_us = b / off["tokens_per_s"] * 1e6, b / on["tokens_per_s"] * 1e6
        out.append(dict(kernel="mhc_decode_served", variant="a100",
                        shape=dict(model=off["shape"]["model"], batch=b,
                                   prompt_len=off["shape"]["prompt_len"]),
                        off_step_us=round(off_us, 1), on_step_us=round(on_us, 1),
                        off_tokens_per_s=off["tokens_per_s"], on_tokens_per_s=on["tokens_per_s"],
                        speedup=round(off_us / on_us, 4), timing=off.get("timing")))
    return out


def _split_tag(stem: str):
    for name in MODELS:
        if stem.startswith(name + "-"):
            return name, stem[len(name) + 1:].split("-")
    raise ValueError(stem)


def _meta(sample: dict) -> dict:
    return {k: sample.get(k) for k in ("gpu", "torch", "triton", "vllm", "commit")}


def write_results(args, work: Path, outs, tput_outs, not_done=()) -> None:
    runs = {j: json.load(open(p)) for j, p in outs if p}
    # Runs this invocation started that did not finish (failed, timed out or dropped by the
    # deadline); their logs are in the work folder.
    rows, failed_runs = [], list(not_done)
    for (name, mode, eager), r in runs.items():
        if "audit" in r:
            a = r["audit"]
            rows.append(dict(kernel="sm80_audit", variant="a100", shape=dict(model=name),
                             triton_kernels=len(a["triton_kernels"]),
                             cuda_ops=len(a["cuda_ops"]), failed=a["failed"],
                             deep_gemm_calls=a["deep_gemm_calls"],
                             tilelang_compiles=a["tilelang_compiles"],
                             compiles_by_phase=a["compiles_by_phase"],
                             selections=r.get("selections"), detail=a))
    for name in AGREE_MODELS + tuple(PER_RANK_MODELS):
        for eager in (True, False):
            got = {m: runs.get((name, m, eager)) for m in MODES}
            for a, b in (("a100", "upstream"), ("sm90", "upstream"), ("a100", "sm90")):
                if got[a] and got[b]:
                    p = compare.pair(got[a], got[b])
                    p["within_tolerance"] = (p["top1_agree"] >= TOL["min_top1_agree"]
                                             and p["max_abs_dlogprob"] <= TOL["max_abs_dlogprob"])
                    rows.append(dict(kernel="e2e_agreement", variant=f"{a}_vs_{b}",
                                     shape=dict(model=name, cuda_graphs=not eager),
                                     top1_agree=p["top1_agree"],
                                     max_abs_dlogprob=p["max_abs_dlogprob"], detail=p,
                                     spread=compare.spread(got[a]), tolerance=TOL))
        for on, off in YOCO_PAIRS:
            a, b = runs.get((name, on, True)), runs.get((name, off, True))
            if a and b:
                p = compare.pair(a, b)
                same = compare.identical(p)
                rows.append(dict(kernel="yoco_e2e", variant=f"{on}_vs_{off}",
                                 shape=dict(model=name, eager=True), identical=same,
                                 top1_agree=p["top1_agree"],
                                 max_abs_dlogprob=p["max_abs_dlogprob"], detail=p))
        for (n, mode, eager), r in runs.items():
            if n != name or not r.get("repeats"):
                continue
            for i, rep in enumerate(r["repeats"], start=2):
                p = compare.pair(r, dict(r, prompts=rep))
                same = compare.identical(p)
                rows.append(dict(kernel="e2e_repeat", variant=f"{mode}_run1_vs_run{i}",
                                 shape=dict(model=name, eager=eager, same_process=True),
                                 identical=same, top1_agree=p["top1_agree"],
                                 max_abs_dlogprob=p["max_abs_dlogprob"], detail=p))
        for (n, mode, eager), r in runs.items():
            if n != name or not mode.endswith("_verify") or "yoco_totals" not in r:
                continue
            rows.append(verify_row(name, mode, r["yoco_totals"]))
        for (n, mode, eager), r in runs.items():
            if n != name or not (r.get("noyoco_in_process") or r.get("noyoco_in_process_error")):
                continue
            row = dict(kernel="yoco_e2e", variant=f"{mode}_in_process_on_vs_off",
                       shape=dict(model=name, eager=eager, same_process=True))
            if r.get("noyoco_in_process"):
                p = compare.pair(r, dict(r, prompts=r["noyoco_in_process"]))
                row.update(identical=compare.identical(p), top1_agree=p["top1_agree"],
                           max_abs_dlogprob=p["max_abs_dlogprob"], detail=p)
            else:
                row.update(identical=None, error=r["noyoco_in_process_error"])
            rows.append(row)
        for m in MODES:  # the noise floor: one mode, eager against CUDA graphs
            if runs.get((name, m, True)) and runs.get((name, m, False)):
                p = compare.pair(runs[(name, m, True)], runs[(name, m, False)])
                rows.append(dict(kernel="e2e_agreement", variant=f"{m}_eager_vs_graphs",
                                 shape=dict(model=name), top1_agree=p["top1_agree"],
                                 max_abs_dlogprob=p["max_abs_dlogprob"], detail=p))
    rows += reference_rows(work, runs)
    lruns = long_runs(work)
    rows += long_rows(lruns) + long_agreement_rows(work, lruns) + spec_rows(work)
    for f in sorted(work.glob("*-a100-nocompile.json")):
        r = json.load(open(f))
        a = r["audit"]
        rows.append(dict(kernel="zero_compile", variant="a100",
                         shape=dict(model=f.stem.split("-a100-")[0], jit_warmup=True),
                         passed=a["zero_compile"], serve_compiles=a["serve_compiles"],
                         serve_compiles_outside_path=a.get("serve_compiles_outside", []),
                         tilelang_by_phase=a.get("tilelang_by_phase"),
                         compiles_by_phase=a["compiles_by_phase"],
                         warmup_seconds=a.get("warmup_seconds"), load_seconds=r["load_seconds"],
                         failed=a["failed"]))
    for mode, p in tput_outs:
        r = json.load(open(p))
        for t in r["rows"]:
            rows.append(dict(kernel="e2e", variant=mode,
                             shape=dict(model=TPUT_MODEL, phase=t["phase"], batch=t["batch"],
                                        prompt_len=t["prompt_len"]),
                             tokens_per_s=t["tokens_per_s"], seconds=t.get("seconds"),
                             timing=t.get("timing", "whole generate call"),
                             error=t.get("error"), load_seconds=r["load_seconds"]))
    rows += mhc_decode_served_rows(rows)
    # The machine and versions: from an agreement run, else from a tput or nocompile run (each
    # run.py result records them).
    sample = next(iter(runs.values()), None) or {}
    if not sample:
        for p in [p for _, p in tput_outs] + sorted(work.glob("*-a100-nocompile.json")):
            sample = json.load(open(p))
            break
    if not sample:
        sample = next(iter(lruns.values()), None) or spec_sample(work)
    # The per-rank models' rows under their own kernels (e2e_models.PER_RANK_ROWS).
    rows = per_rank_rows(rows)
    meta = dict(_meta(sample), date=datetime.date.today().isoformat(), failed_runs=failed_runs,
                note="H200 figures; the a100 mode emulates an A100's kernel selection on the "
                     "H200 (DEEPINFER_EMULATE_CAPABILITY=8.0): its speeds are not A100 speeds")
    gpu = (sample.get("gpu") or "gpu").split()[-1].lower()
    # A run of the long step alone gets its own file name (its rows come from its work folder).
    kind = "e2e-long" if set(args.steps.split(",")) <= {"ckpt", "long", "long_reference"} \
        else "e2e"
    kind = "e2e-spec" if set(args.steps.split(",")) <= {"ckpt", "spec"} else kind
    # Rows of per-rank models alone: a file of their own beside a 64-head run's.
    if rows and all((r.get("shape") or {}).get("model") in PER_RANK_MODELS for r in rows):
        kind = "e2e-per-rank"
    out = Path(args.results) / f"{gpu}-{meta['date']}-{kind}-{(sample.get('commit') or 'dev')[:7]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(dict(meta=meta, rows=rows), open(out, "w"), indent=1)
    print(f"wrote {out} ({len(rows)} rows; failed runs: {failed_runs or 'none'})")
    for row in rows:
        k = BASE_KERNEL.get(row["kernel"], row["kernel"])  # per-rank rows print as theirs
        if k == "e2e_agreement":
            print(f"  {row['shape']}  {row['variant']:24s} top1 {row['top1_agree']:.4f}  "
                  f"max|dlp| {row['max_abs_dlogprob']:.4f}")
        elif k in ("yoco_e2e", "e2e_repeat"):
            print(f"  {row['shape']}  {row['variant']:24s} identical {row['identical']}  "
                  f"max|dlp| {row['max_abs_dlogprob']:.4g}")
        elif k == "zero_compile":
            w = row.get("warmup_seconds") or {}
            print(f"  zero compile {row['shape']['model']}: "
                  f"{'PASS' if row['passed'] else 'FAIL'}, {len(row['serve_compiles'])} "
                  f"compile(s) while serving; JIT warmup {w.get('vllm_jit_warmup', 0):.1f}s "
                  f"of which ours {w.get('deepinfer_keys', 0):.1f}s")
        elif k == "e2e_vs_fp32_reference":
            print(f"  {row['shape']['model']} {row['shape']['reference']:22s} {row['variant']:9s}"
                  f" graphs={row['shape']['cuda_graphs']!s:5s} top1 {row['top1_agree']:.4f} "
                  f"max|dlp| {row['max_abs_dlogprob']:.4f} mean {row['mean_abs_dlogprob']:.4f}")
        elif k == "e2e_reference_check":
            print(f"  reference check {row['shape']['model']} {row['shape']['reference']}: "
                  f"{'PASS' if row['passed'] else 'FAIL'} a100 {row['a100']} upstream "
                  f"{row['upstream']} margin {row['margin']}")
        elif k == "yoco_verify":
            print(f"  yoco verify {row['shape']['model']} {row['variant']}: "
                  f"{'PASS' if row['passed'] else 'FAIL'}, {row['compared']} reused "
                  f"products compared, {row['mismatches']} differ; not compared: "
                  f"{row['kinds_not_compared'] or 'none'}")
        elif k == "long_context":
            s = row["shape"]
            print(f"  {s['model']} {row['variant']:9s} graphs={s['cuda_graphs']!s:5s} "
                  f"{s['phase']:7s} L{s['prompt_len']:<8d} b{s['batch']}: "
                  + (f"{row['tokens_per_s']:10.1f} tok/s  ttft {_fmt(row['ttft_s'], '.2f')} s"
                     f"  peak {_fmt(row['peak_gib'], '.1f')} GiB  kv {row['kv_tokens']}"
                     if row["tokens_per_s"] is not None else f"failed: {row['error']}"))
        elif k == "long_context_stage":
            s = row["shape"]
            print(f"  {s['model']} {row['variant']:9s} graphs={s['cuda_graphs']!s:5s} stage "
                  f"L{s['prompt_len']} {s['stage']:15s} "
                  + ("n/a" if row["seconds"] is None else f"{row['seconds']:.2f} s"))
        elif k == "e2e":
            print(f"  {row['variant']:9s} {row['shape']['phase']:8s} b{row['shape']['batch']:<3d} "
                  f"L{row['shape']['prompt_len']:<6d} "
                  + (f"{row['tokens_per_s']:10.1f} tok/s" if row["tokens_per_s"] is not None
                     else f"failed: {row['error']}"))
        elif k.startswith("spec_"):
            print(spec_line(row))
        elif k == "long_memory_checkpoint":
            s, over = row["shape"], row.get("resident_over_gib")
            print(f"  {s['model']} {row['variant']:9s} resident {s['at']:12s} "
                  f"{row['resident_gib']:.2f} GiB, vLLM's accounting "
                  f"{_fmt(row.get('vllm_expected_gib'), '.2f')} GiB, over "
                  f"{_fmt(over, '+.2f')} GiB, outside torch {row['outside_torch_gib']:.2f} GiB"
                  + (f", stack limit {row['stack_limit_bytes']} B"
                     if row.get("stack_limit_bytes") is not None else ""))
        else:
            print(f"  audit {row['shape']['model']}: {row['triton_kernels']} Triton kernels, "
                  f"{row['cuda_ops']} ops, failed: {row['failed'] or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
