"""Engines of the graph-mode and Hopper-parity steps (benchmarks/e2e/graph_modes.py,
parity.py): what each engine is, its run_engine.py command and environment, its estimated
wall time, running a list of them in order inside a --deadline, and the bundle that carries
finished engines' outputs from one GPU machine to the next.

Each engine is one run_engine.py process (run.py's engine plus the graph record), alone on
the GPU, with a vLLM cache root of its own name under <work>/cache/: vLLM's torch.compile
cache key covers VLLM_* variables, the traced code and the compilation config, not the
DEEPINFER_* switches, so engines that share a root must share their traced graph
(serve.py gives its modes separate roots for the same reason). Triton's cache is one folder
for every engine (<work>/cache/triton; vLLM otherwise puts it under each compile hash),
keyed by kernel source and target as Triton always keys it: an engine whose vLLM compile
key is new still finds the kernels an engine before it compiled.

Time: the first engine of a cache root compiles (torch.compile, CUDA-graph capture, the
JIT warmup), later ones load. START_S holds the estimates a plan is cut by; they come from
the start-up times run.py recorded for v41-tput (``load_seconds``): a100 graphs 342.5 s and
upstream 149.0 s (benchmarks/results/h200-2026-12-01-e2e-tput-5ddee71.json), a100 168.8 s,
sm90 142.5 s and upstream 30.9 s (benchmarks/results/h200-2026-12-01-e2e-5f462a5.json,
where the machine's caches held kernels of engines before them). "cold_a100" is an a100
engine on a machine whose Triton cache is empty (the sm_80 kernels' JIT warmup compiles
them all), "cold_a100_cached" one that finds them there, "cold" the first start of a cache
root in another mode, "warm" a start that loads its compiled graph, "eager" an
enforce_eager start (no torch.compile, no capture; not measured for v41-tput: the estimate
is a guess). An engine starts only when its estimate fits in
what the deadline leaves; the engines after one that does not fit wait for the next
invocation (order is kept: an A/B alternation is never reordered). ``--start-s`` of the
drivers overrides the estimates (``parse_start_s``).
Standard library only.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Estimated seconds before the timed requests (see the module docstring).
START_S = {"cold_a100": 345.0, "cold_a100_cached": 180.0, "cold": 150.0, "warm": 60.0,
           "eager": 90.0}
MEASURE_S = 45.0      # run.py's tput warm-up, decode at 1/8/32 (best of 2), prefill 1K/8K
CHECK_S = 20.0        # the check prompts (graph_modes.py)
# DEEPINFER_* variables of the caller an engine keeps (serve.py keeps the same); every
# other one is dropped, so an engine's switches are exactly its own.
KEEP_DEEPINFER = ("DEEPINFER_COMMIT", "DEEPINFER_BUILD", "DEEPINFER_CACHE")
# The tput engine of e2e.py's tput step (its max_model_len and memory share), at the
# batches and prompt lengths these steps measure.
TPUT_ARGS = ("--task", "tput", "--max-model-len", str(32768 + 512), "--gpu-mem", "0.85")
BATCHES = (1, 8, 32)
PREFILL_LENS = (1024, 8192)
LOG_TAIL = 120        # lines of each engine's log kept in a bundle


@dataclasses.dataclass
class Engine:
    tag: str                      # file stem of its output and log in the work folder
    mode: str                     # run.py mode (a100, upstream, sm90) or "default"
    cache: str                    # vLLM cache root, a folder name under <work>/cache/
    switches: dict = dataclasses.field(default_factory=dict)   # DEEPINFER_* of its own
    compilation: dict | None = None   # vllm.LLM compilation_config entries
    eager: bool = False
    check_lens: tuple = ()
    check_gen: int = 16
    check_repeat: int = 1
    batches: tuple = BATCHES
    prefill_lens: tuple = PREFILL_LENS
    info: dict = dataclasses.field(default_factory=dict)   # what its rows carry

    def plain(self) -> dict:
        return dataclasses.asdict(self)


def out_path(work: Path, e: Engine) -> Path:
    return work / f"{e.tag}.json"


def log_path(work: Path, e: Engine) -> Path:
    return work / f"{e.tag}.log"


def cache_root(work: Path, e: Engine) -> Path:
    return work / "cache" / e.cache


def triton_cache(work: Path) -> Path:
    return work / "cache" / "triton"


def command(e: Engine, work: Path, ckpt: Path, python: str = sys.executable) -> list[str]:
    """run_engine.py's command line for ``e`` (run.py's arguments after ``--``)."""
    cmd = [python, str(HERE / "run_engine.py")]
    if e.compilation:
        cmd += ["--compilation-config", json.dumps(e.compilation, sort_keys=True)]
    if e.check_lens:
        cmd += ["--check-lens", *map(str, e.check_lens), "--check-gen", str(e.check_gen),
                "--check-repeat", str(e.check_repeat)]
    cmd += ["--", "--model", str(ckpt), "--mode", e.mode, "--out", str(out_path(work, e)),
            *TPUT_ARGS, "--batches", *map(str, e.batches), "--prefill-lens",
            *map(str, e.prefill_lens)]
    if e.eager:
        cmd.append("--eager")
    return cmd


def engine_env(e: Engine, work: Path, base=None) -> dict:
    """The caller's environment without its DEEPINFER_* switches, plus ``e``'s, its vLLM
    cache root and the shared Triton cache (unless the caller names one)."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items()
           if not k.startswith("DEEPINFER_") or k in KEEP_DEEPINFER}
    env.update(e.switches)
    env["VLLM_CACHE_ROOT"] = str(cache_root(work, e))
    env.setdefault("TRITON_CACHE_DIR", str(triton_cache(work)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def compiled(work: Path, e: Engine) -> bool:
    """Whether ``e``'s cache root holds a torch.compile cache (a start would load it)."""
    d = cache_root(work, e) / "torch_compile_cache"
    return d.is_dir() and any(d.iterdir())


def triton_warm(work: Path) -> bool:
    """Whether the shared Triton cache holds kernels (an engine ran on this machine)."""
    d = triton_cache(work)
    return d.is_dir() and any(d.iterdir())


def start_kind(work: Path, e: Engine, done_caches=(), ran=False) -> str:
    """"eager", "warm" (its cache root compiled already, on disk or by an engine of this
    plan before it), "cold_a100" (an a100 graph engine while the Triton cache is empty and
    no engine of this plan ran before it: the sm_80 kernels' JIT warmup compiles them all),
    "cold_a100_cached" (an a100 graph engine after them) or "cold"."""
    if e.eager:
        return "eager"
    if e.cache in done_caches or compiled(work, e):
        return "warm"
    if e.mode == "a100":
        return "cold_a100_cached" if ran or triton_warm(work) else "cold_a100"
    return "cold"


def parse_start_s(text: str | None) -> dict:
    """``--start-s kind=seconds,...`` over START_S."""
    out = dict(START_S)
    for part in (p for p in (text or "").split(",") if p.strip()):
        k, _, v = part.partition("=")
        if k.strip() not in START_S:
            raise ValueError(f"--start-s: {k.strip()!r} is not one of {', '.join(START_S)}")
        out[k.strip()] = float(v)
    return out


def estimate_s(kind: str, e: Engine, start_s=None) -> float:
    start_s = START_S if start_s is None else start_s
    return start_s[kind] + MEASURE_S + (CHECK_S if e.check_lens else 0.0)


def plan_table(engines, work: Path, start_s=None) -> list[dict]:
    """Each engine with its start kind and estimate, as a fresh run of the whole list would
    see them (what is already done is marked so)."""
    out, caches, ran = [], set(), False
    for e in engines:
        done = out_path(work, e).exists()
        kind = start_kind(work, e, caches, ran)
        ran = ran or not done
        if not e.eager:
            caches.add(e.cache)
        out.append(dict(tag=e.tag, mode=e.mode, cache=e.cache, start=kind, done=done,
                        estimate_s=0.0 if done else estimate_s(kind, e, start_s)))
    return out


def run_plan(engines, work: Path, ckpt: Path, sh, left, start_s=None, rerun=False,
             after=None) -> list[str]:
    """Run ``engines`` in order, each by ``sh`` (e2e.sh's signature: cmd, log, env=,
    timeout=). An engine whose output exists is skipped unless ``rerun``. An engine starts
    only when its estimate fits in ``left()``; it and every engine after it are then left
    for the next invocation. ``after(e)`` runs after each finished engine (the bundle).
    Returns what did not finish, one line each."""
    not_done: list[str] = []
    caches: set[str] = set()
    stopped, ran = None, False
    for e in engines:
        out = out_path(work, e)
        if out.exists() and not rerun:
            if not e.eager:
                caches.add(e.cache)
            continue
        kind = start_kind(work, e, caches, ran)
        need = estimate_s(kind, e, start_s)
        if stopped is None and need > left():
            stopped = (f"not started: the deadline left {max(left(), 0):.0f} s, the {kind} "
                       f"start of {e.tag} needs about {need:.0f} s")
        if stopped is not None:
            not_done.append(f"{e.tag} ({stopped})")
            continue
        if out.exists():
            out.unlink()
        work.mkdir(parents=True, exist_ok=True)
        rc = sh(command(e, work, ckpt), log_path(work, e), env=engine_env(e, work),
                timeout=max(2 * need, need + 120))
        ran = True
        if not e.eager:
            caches.add(e.cache)
        if rc != 0 or not out.exists():
            not_done.append(f"{e.tag} (rc {rc}; log {log_path(work, e).name})")
        if after is not None:
            after(e)
    return not_done


def load(work: Path, e: Engine) -> dict | None:
    p = out_path(work, e)
    try:
        return json.loads(p.read_text()) if p.exists() else None
    except (OSError, json.JSONDecodeError):
        return None


# --------------------------------------------------------------------------- the bundle
# A GPU machine is given back between device calls, and with it the work folder. The
# bundle is one JSON file (the device returns a few files only) holding every finished
# engine's output and the tail of its log; --resume unpacks one into the work folder, so a
# plan goes on where the deadline of the call before stopped it.
def save_bundle(path: Path, work: Path, engines) -> int:
    data = {}
    for e in engines:
        r = load(work, e)
        if r is None:
            continue
        log = log_path(work, e)
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL:] if log.exists() else []
        data[e.tag] = dict(out=r, log_tail=tail)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(kind="deepinfer-engine-bundle", engines=data)))
    os.replace(tmp, path)
    return len(data)


def load_bundle(path: Path, work: Path, engines) -> list[str]:
    """Write the bundle's outputs of ``engines`` into ``work`` where they are missing;
    returns the tags written."""
    if not path.exists():
        return []
    data = json.loads(path.read_text()).get("engines", {})
    wrote = []
    work.mkdir(parents=True, exist_ok=True)
    for e in engines:
        d = data.get(e.tag)
        if d is None or out_path(work, e).exists():
            continue
        out_path(work, e).write_text(json.dumps(d["out"]))
        if not log_path(work, e).exists():
            log_path(work, e).write_text("\n".join(d.get("log_tail", [])) + "\n")
        wrote.append(e.tag)
    return wrote


def meta_of(outputs) -> dict:
    """The machine and versions from the first engine output that has them."""
    for r in outputs:
        if r:
            return {k: r.get(k) for k in ("gpu", "torch", "triton", "vllm", "commit")}
    return {}


def results_name(meta: dict, kind: str) -> str:
    gpu = (meta.get("gpu") or "gpu").split()[-1].lower()
    return f"{gpu}-{meta['date']}-{kind}-{(meta.get('commit') or 'dev')[:7]}.json"


def run_driver(args, plan, work: Path, sh, e2e, start_s=None, todo=None,
               overlay_why: str = "") -> list[str]:
    """What graph_modes.py and parity.py run after planning: the overlay check (unless
    ``args.skip_overlay_check``), the checkpoint of ``args.model`` (through e2e.sh), then the
    engines of ``todo`` (default ``plan``), saving ``args.bundle`` after each; the engines
    that did not finish."""
    if not args.skip_overlay_check:
        from serve import overlay_status
        ov = overlay_status(sys.executable)
        if ov["rc"] != 0:
            raise SystemExit("the overlay is not installed in this python's vLLM "
                             f"(tools/install_overlay.py status: rc {ov['rc']}){overlay_why}"
                             f"\n{ov['text']}")
    from e2e_models import MODELS
    _, fmt = MODELS[args.model]
    work.mkdir(parents=True, exist_ok=True)
    e2e.make_checkpoints(work, [args.model], dense=False)
    bundle = (lambda _e: save_bundle(args.bundle, work, plan)) if args.bundle else None
    not_done = run_plan(plan if todo is None else todo, work, work / f"{args.model}-{fmt}", sh,
                        e2e._left, start_s, rerun=args.rerun, after=bundle)
    if args.bundle:
        save_bundle(args.bundle, work, plan)
    return not_done


def prepare(args, plan, width: int = 48):
    """The planning half of graph_modes.py / parity.py: the engines ``args.resume`` restores,
    the start-up estimates of ``args.start_s`` (SystemExit on a bad one), and the plan table
    printed; returns (resumed, start_s, table)."""
    resumed = load_bundle(args.resume, args.work, plan) if args.resume else []
    try:
        start_s = parse_start_s(args.start_s)
    except ValueError as e:
        raise SystemExit(str(e))
    table = plan_table(plan, args.work, start_s)
    for t in table:
        print(f"  {t['tag']:{width}s} {'done' if t['done'] else t['start']:16s} "
              f"~{t['estimate_s']:4.0f} s", flush=True)
    return resumed, start_s, table

