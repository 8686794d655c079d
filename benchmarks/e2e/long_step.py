"""--steps long and long_reference of benchmarks/e2e/e2e.py: real-geometry long-context
configs (configs/v41-long, configs/v4-long), one engine per (model, mode, form) alone on the GPU
serving every length of --long-lens in one start (run.py --task long, shortest first). Here:
the step's selection from the flags (long_options), its engines in priority order
(long_jobs), their run.py commands and time limits (long_command, long_run_timeout), running
them (run_long, step_long: e2e.py passes its ``sh`` in), and the results rows read back from
their outputs, partial ones included (long_runs, long_rows, long_agreement_rows). e2e.py
re-exports these names; the fp32 reference of the agreement prompt is e2e.py's
run_reference."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import compare
from e2e_models import LONG_KERNEL, MODELS, MODES
from refcheck import ref_out, reference_check
from run_long import LONG_CHUNK, STAGES, long_plan, request_timeout

HERE = Path(__file__).resolve().parent

# Real-geometry long-context configs, served one engine per (model, mode, form) with every
# prompt length in one start.
LONG_MODELS = ("v41-long", "v4-long")
LONG_MODES = ("a100", "upstream")
LONG_FORMS = ("eager", "graphs")   # graphs: vLLM's default torch.compile + CUDA graphs
# 1,048,000 rather than 1,048,576: the prompt plus the decode window of a batch of 4 (up to
# 580 tokens at a chunk of 8,192, run.py long_max_tokens) stays within 1,048,576 + 1,024.
LONG_LENS = (131072, 524288, 1048000)
LONG_AGREE_LEN = 131072             # agreement (and the fp32 reference) at 128K
# gpu_memory_utilization of a long engine: the bdbe637 runs served 1M prompts with 0.80; the
# 20% outside it holds the prefill chunk's activations and the agreement request's prompt
# logprobs (an 8,192 x 129,280 fp32 block per chunk).
LONG_GPU_MEM = 0.80
GIB = float(1 << 30)
LONG_DECODE = 64                    # decode tokens timed per request
LONG_QUICK_DECODE = 32              # --quick
# Seconds a long engine may spend before its timed requests (load, profile run, KV
# allocation, CUDA-graph capture, the warm-up): v41-tput's graph engines started in 149-342 s
# (results e2e-4ab26c8, e2e-5f462a5, e2e-tput-5ddee71), the mini models' engines with vLLM's
# JIT warmup in 11-116 s; about twice the slowest of each. The long configs' graph engines
# themselves started in 231-343 s (load_seconds of the v41-long a100 / upstream and v4-long a100
# engines behind benchmarks/results/h200-2026-12-03-e2e-long-3099bbc.json, empty or part-warm
# compile caches), inside this limit.
LONG_START_S = {"eager": 300, "graphs": 720}


def _csv(text: str, known, what: str, ap, conv=str) -> list:
    vals = [conv(v) for v in text.split(",") if v.strip()]
    if known is not None:
        bad = sorted(set(map(str, vals)) - set(map(str, known)))
        if bad:
            ap.error(f"--{what}: unknown {', '.join(bad)}; known: {', '.join(map(str, known))}")
    return vals


def long_options(args, ap) -> dict:
    """The long step's selection from the flags: models, modes, forms, prompt lengths, the
    lengths served as a batch of 4, the agreement length, the profiled length, decode tokens.
    --quick: the batch of 4 at the shortest length only and LONG_QUICK_DECODE decode tokens."""
    lens = sorted(_csv(args.long_lens, None, "long-lens", ap, int))
    if not lens or min(lens) <= 0:
        ap.error("--long-lens: give positive prompt lengths, comma-separated")
    if args.long_b4_lens is None:
        b4 = lens[:1] if args.quick else lens
    else:
        b4 = _csv(args.long_b4_lens, lens, "long-b4-lens", ap, int)
    profile = max(lens) if args.long_profile_len is None else args.long_profile_len
    if profile and profile not in lens:
        ap.error(f"--long-profile-len {profile} is not one of --long-lens")
    pbatch = getattr(args, "long_profile_batch", 1)
    if profile and pbatch == 4 and profile not in b4:
        ap.error(f"--long-profile-batch 4: --long-profile-len {profile} is not one of "
                 "--long-b4-lens")
    return dict(models=_csv(args.long_models, LONG_MODELS, "long-models", ap),
                modes=_csv(args.long_modes, MODES, "long-modes", ap),
                forms=_csv(args.long_forms, LONG_FORMS, "long-forms", ap),
                lens=lens, b4_lens=sorted(b4), agree_len=args.long_agree_len,
                profile_len=profile, profile_batch=pbatch,
                decode_tokens=LONG_QUICK_DECODE if args.quick else LONG_DECODE,
                request_timeout=args.long_request_timeout)


def long_jobs(opts: dict) -> list[tuple[str, str, str]]:
    """(model, mode, form) of every long-context engine, in priority order (a --deadline
    drops the tail): eager before CUDA graphs (a graph engine first spends minutes compiling),
    then model, then mode, in the order given."""
    return [(n, m, f) for f in opts["forms"] for n in opts["models"] for m in opts["modes"]]


def _long_out(work: Path, name: str, mode: str, form: str) -> Path:
    return work / f"{name}-{mode}-long-{form}.json"


def _long_tag(stem: str):
    """(model, mode, form) of a long output's file stem, None for other files."""
    parts = stem.rsplit("-", 3)
    if len(parts) == 4 and parts[2] == "long" and parts[0] in MODELS and parts[3] in LONG_FORMS:
        return parts[0], parts[1], parts[3]
    return None


def long_command(work: Path, name: str, mode: str, form: str, opts: dict) -> list[str]:
    cfg, fmt = MODELS[name]
    cmd = [sys.executable, str(HERE / "run.py"), "--model", str(work / f"{name}-{fmt}"),
           "--mode", mode, "--task", "long", "--out", str(_long_out(work, name, mode, form)),
           "--long-lens", *map(str, opts["lens"]), "--b4-lens", *map(str, opts["b4_lens"]),
           "--agree-len", str(opts["agree_len"]), "--profile-len", str(opts["profile_len"]),
           "--profile-batch", str(opts.get("profile_batch", 1)),
           "--decode-tokens", str(opts["decode_tokens"]), "--gpu-mem", str(LONG_GPU_MEM)]
    if opts["request_timeout"]:
        cmd += ["--request-timeout", str(opts["request_timeout"])]
    if form == "eager":
        # No torch.compile and no CUDA graphs, with vLLM's JIT kernel warmup kept (run.py
        # --jit-warmup; --eager would turn it off). Without it, a timed request compiles
        # what the warm-up requests did not meet: at 3e2842d the batch of four at 131K
        # (v41-long, a100) spent 29 s of its 36.7 s compiling two TileLang mHC kernels for
        # a new token-count bucket, the GPU idle 32.6 s
        # (benchmarks/results/h200-2026-12-02-e2e-long-3e2842d.json).
        cmd.append("--jit-warmup")
    return cmd


def long_run_timeout(form: str, opts: dict) -> float:
    """The process limit of one long engine: start-up, warm-up, and every planned request's
    own limit (run.py request_timeout)."""
    plan = long_plan(opts["lens"], opts["b4_lens"], opts["agree_len"], opts["decode_tokens"],
                     LONG_CHUNK)
    return LONG_START_S[form] + sum(
        request_timeout(r["prompt_len"] * r["batch"], opts["request_timeout"]) for r in plan)


def run_long(work: Path, name: str, mode: str, form: str, opts: dict, sh) -> tuple[int, Path]:
    """One long-context engine (run.py --task long), started by ``sh`` (e2e.sh: the deadline,
    the log, the limit). Its output is read whatever the exit status: run.py rewrites it after
    every request, so a run stopped by its limit or the deadline (rc 124) still leaves the
    requests it finished."""
    out = _long_out(work, name, mode, form)
    rc = sh(long_command(work, name, mode, form, opts), work / f"{out.stem}.log",
            timeout=long_run_timeout(form, opts))
    return rc, out


def step_long(work: Path, opts: dict, rerun: bool = False, *, sh) -> list[str]:
    """--steps long: the engines of long_jobs one after another, each alone on the GPU (its
    timings are its own), each started by ``sh`` (e2e.sh, passed in at the call so that a
    stand-in for it reaches here). An engine whose output exists is not served again unless
    ``rerun``. Returns the engines that did not finish, each with what of it is on disk."""
    not_done = []
    for name, mode, form in long_jobs(opts):
        tag = f"{name}/{mode}/long-{form}"
        out = _long_out(work, name, mode, form)
        have = _load(out) if out.exists() else None
        if have is not None and not rerun:
            if not have.get("complete"):
                not_done.append(f"{tag} (partial output kept: {_long_progress(have)}; "
                                "--long-rerun serves it again)")
            continue
        rc, out = run_long(work, name, mode, form, opts, sh)
        r = _load(out) if out.exists() else None
        if rc != 0 or r is None or not r.get("complete"):
            not_done.append(f"{tag} (rc {rc}; {_long_progress(r)})")
    return not_done


def _long_progress(r) -> str:
    if not r:
        return "no output"
    planned = [q for q in r.get("plan", []) if q["kind"] == "timed"]
    return f"{len(r.get('rows', []))} of {len(planned)} timed requests on disk"


def _load(p: Path):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return None


def long_runs(work: Path) -> dict:
    """Every long output in the work folder, earlier invocations' too: (model, mode, form) ->
    run.py's result (partial ones included, "complete": false)."""
    out = {}
    for f in sorted(work.glob("*-long-*.json")):
        tag = _long_tag(f.stem)
        r = _load(f) if tag else None
        if r is not None:
            out[tag] = r
    return out


def long_rows(runs: dict) -> list[dict]:
    """Rows kernel="long_context" (per request: a prefill row, TTFT and prefill tokens/s, and a
    decode row, decode tokens/s at that context on engine steps) and kernel="long_context_stage"
    (the profiled prefill, one row per stage and one for the GPU's idle time)."""
    rows = []
    for (name, mode, form), r in runs.items():
        kv = r.get("kv") or {}
        common = dict(variant=mode, kv_tokens=kv.get("kv_tokens"),
                      kv_available_gib=kv.get("available_gib"),
                      kv_num_gpu_blocks=kv.get("num_gpu_blocks"),
                      kv_block_size=kv.get("block_size"),
                      kv_max_concurrency=kv.get("kv_max_concurrency"),
                      max_model_len=r.get("max_model_len"), chunk=r.get("chunk"),
                      max_num_seqs=r.get("max_num_seqs"),
                      gpu_memory_utilization=r.get("gpu_memory_utilization"),
                      load_seconds=r.get("load_seconds"), run_complete=r.get("complete", False))
        for q in r.get("rows", []):
            shape = lambda phase: dict(model=name, prompt_len=q["prompt_len"],  # noqa: E731
                                       batch=q["batch"], phase=phase,
                                       cuda_graphs=form == "graphs")
            mem = dict(peak_gib=q.get("peak_allocated_gib"),
                       peak_reserved_gib=q.get("peak_reserved_gib"),
                       device_used_gib=q.get("device_used_gib"),
                       **memory_budget(kv, q))
            rows.append(dict(kernel="long_context", shape=shape("prefill"), **common,
                             ttft_s=q.get("ttft_s"), ttft_last_s=q.get("ttft_last_s"),
                             tokens_per_s=q.get("prefill_tokens_per_s"),
                             tokens=q.get("prompt_tokens"), **mem,
                             profiled=q.get("profiled", False), error=q.get("error"),
                             timing="wall clock from arrival to first token; tokens/s: all "
                                    "prompt tokens over the batch's last TTFT"))
            rows.append(dict(kernel="long_context", shape=shape("decode"), **common,
                             ttft_s=q.get("ttft_s"), tokens_per_s=q.get("decode_tokens_per_s"),
                             tokens=q.get("decode_tokens"), seconds=q.get("decode_seconds"),
                             **mem, error=q.get("error"),
                             timing="engine steps after the last prefill"))
        st = r.get("stages")
        if st:
            base = dict(model=name, prompt_len=st["prompt_len"], batch=st["batch"],
                        phase="prefill", cuda_graphs=form == "graphs")
            tot = st.get("kernel_s") or 0.0
            sc = dict(variant=mode, wall_s=st.get("wall_s"), kernel_s=tot,
                      busy_s=st.get("busy_s"), kernels=st.get("kernels"),
                      parse_s=st.get("parse_s"), complete=st.get("complete"))
            for stage in STAGES:
                sec = st["stages"].get(stage, 0.0)
                rows.append(dict(kernel="long_context_stage", shape=dict(base, stage=stage),
                                 seconds=sec, share=sec / tot if tot else None, **sc,
                                 top_kernels=[k for k in st.get("top_kernels", [])
                                              if k[1] == stage],
                                 what="CUDA kernel seconds (summed over streams)"))
            idle = st.get("idle_s")
            rows.append(dict(kernel="long_context_stage", shape=dict(base, stage="gpu_idle"),
                             seconds=idle, share=(idle / st["wall_s"]) if idle is not None
                             and st.get("wall_s") else None, **sc,
                             what="wall time with no kernel running (host gaps)"))
        rows += memory_checkpoint_rows(name, mode, form, r)
    return rows


def memory_checkpoint_rows(name: str, mode: str, form: str, r: dict) -> list[dict]:
    """Rows kernel="long_memory_checkpoint": what was resident after the engine was built and
    after the warm-up requests (torch's allocations plus the memory outside its pool) against
    what vLLM's accounting left resident (what the device held at its first reading, plus
    total_consumed after its profile run, plus the KV cache it sized); resident_over_gib > 0
    is memory that became resident after the profile run. With the start-up trace
    (DEEPINFER_LONG_RESIDENT_TRACE) also the resident blocks by allocating code."""
    worker = (r.get("kv") or {}).get("worker") or {}
    b = worker.get("budget") or {}
    kv_bytes = worker.get("available_kv_cache_memory_bytes")
    init = b.get("init_used_memory")
    expected = (None if b.get("total_consumed") is None or kv_bytes is None
                else (b["total_consumed"] + kv_bytes + (init or 0)) / GIB)
    rows = []
    for at in ("after_load", "after_warmup"):
        m = r.get(f"memory_{at}")
        if not m or "allocated_gib" not in m:
            continue
        held = m["allocated_gib"] + m["outside_torch_gib"]
        rows.append(dict(kernel="long_memory_checkpoint", variant=mode,
                         shape=dict(model=name, at=at, cuda_graphs=form == "graphs"),
                         allocated_gib=m["allocated_gib"], reserved_gib=m["reserved_gib"],
                         outside_torch_gib=m["outside_torch_gib"], resident_gib=held,
                         vllm_expected_gib=expected,
                         resident_over_gib=None if expected is None else held - expected,
                         resident=m.get("resident"),
                         stack_limit_bytes=m.get("stack_limit_bytes"),
                         local_memory_estimate_gib=m.get("local_memory_estimate_gib"),
                         init_used_gib=None if init is None else init / GIB,
                         what="torch allocated + memory outside torch's pool, against the "
                              "device's use at vLLM's first reading + total_consumed + KV "
                              "cache bytes"))
    return rows


def memory_budget(kv: dict, q: dict) -> dict:
    """A request's device peak against vLLM's budget: torch's peak reserved pool plus the
    memory outside torch at the request's end, against requested_memory (gpu_memory_utilization
    x total), from which vLLM sized the KV cache after its profile run. over_budget_gib > 0:
    the request used memory the profile run did not measure (it came out of the share
    gpu_memory_utilization leaves to other processes). Empty where a figure is missing."""
    b = (kv.get("worker") or {}).get("budget") or {}
    req, peak, outside = (b.get("requested_memory"), q.get("peak_reserved_gib"),
                          q.get("outside_torch_gib"))
    if req is None or peak is None or outside is None:
        return {}
    device_peak = peak + outside
    init = b.get("init_used_memory")
    return dict(budget_gib=req / GIB, device_peak_gib=device_peak,
                over_budget_gib=device_peak - req / GIB,
                # what was on the device before vLLM's first reading, outside its budget
                init_used_gib=None if init is None else init / GIB,
                over_budget_after_init_gib=None if init is None
                else device_peak - (req + init) / GIB,
                profile_activation_gib=(b.get("peak_activation_memory") or 0) / GIB,
                new_segments_mib=q.get("new_segments_mib"),
                **{k: q[k] for k in ("memory_trace", "memory_trace_peak") if q.get(k)})


def _last_positions(ref: dict, n: int, first: int, count: int):
    """The reference's prompt rows of the length-``n`` prompt for positions ``first`` ..
    ``first + count - 1`` (its rows start at position 1), as one agree-layout prompt."""
    for p in ref.get("prompts", []):
        if p["prompt_len"] == n:
            rows = p["prompt"][first - 1:first - 1 + count]
            if len(rows) == count:
                return dict(prompt_len=n, prompt=rows, generated=[])
    return None


def long_agreement_rows(work: Path, runs: dict) -> list[dict]:
    """The long engines' agreement prompts (the last positions of one prompt of
    --long-agree-len tokens): each pair of modes (kernel="long_agreement"), each run against the
    fp32 reference when --steps long_reference wrote one (kernel="long_vs_fp32_reference"), and
    per model the project's rule (kernel="long_reference_check", reference_check): the rows of
    the agreement step under e2e_models.LONG_ROWS' names."""
    rows = []
    for name in LONG_MODELS:
        got = {(m, f): r["agree"] for (n, m, f), r in runs.items() if n == name and r.get("agree")}
        if not got:
            continue
        a0 = next(iter(got.values()))["prompts"][0]
        n, first, count = a0["prompt_len"], a0["first_position"], len(a0["prompt"])
        pos = dict(prompt_lens=[n], positions=[first, n - 1])
        for form in LONG_FORMS:
            for a, b in (("a100", "upstream"), ("sm90", "upstream"), ("a100", "sm90")):
                if (a, form) in got and (b, form) in got:
                    p = compare.pair(got[(a, form)], got[(b, form)])
                    rows.append(dict(kernel=LONG_KERNEL["e2e_agreement"],
                                     variant=f"{a}_vs_{b}",
                                     shape=dict(model=name, cuda_graphs=form == "graphs", **pos),
                                     top1_agree=p["top1_agree"],
                                     max_abs_dlogprob=p["max_abs_dlogprob"], detail=p))
        ref = _load(ref_out(work, name, False))
        want = _last_positions(ref, n, first, count) if ref else None
        if want is None:
            continue
        ref_run = dict(ref, prompts=[want])
        dist = {}
        for (mode, form), a in got.items():
            ap = a["prompts"][0]
            if (ap["prompt_len"], ap["first_position"], len(ap["prompt"])) != (n, first, count):
                continue
            p = compare.pair(a, ref_run)
            dist[(mode, form == "eager")] = p
            rows.append(dict(kernel=LONG_KERNEL["e2e_vs_fp32_reference"], variant=mode,
                             shape=dict(model=name, cuda_graphs=form == "graphs",
                                        reference=ref["mode"], **pos),
                             top1_agree=p["top1_agree"], max_abs_dlogprob=p["max_abs_dlogprob"],
                             mean_abs_dlogprob=p["mean_abs_dlogprob"], detail=p))
        check = reference_check(dist, dict(model=name, reference=ref["mode"], **pos))
        if check:
            rows.append(dict(check, kernel=LONG_KERNEL["e2e_reference_check"]))
    return rows
