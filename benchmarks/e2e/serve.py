"""`make serve-bench`: a model served the way users serve it, by `vllm serve` behind the
OpenAI API, measured with vLLM's own benchmark client, in three modes on this GPU.

    python benchmarks/e2e/serve.py [--model v41-tput] [--modes a100,upstream,default]
                                   [--quick] [--eager | --graphs] [--deadline S] [--serial]

Per mode (a100: DEEPINFER_EMULATE_CAPABILITY=8.0, the A100-faithful kernel choice;
upstream: DEEPINFER_DISABLE=all; default: the overlay's defaults on this GPU, no switch set):

1. `vllm serve CKPT` with the offline e2e's engine settings (benchmarks/e2e/run.py: the
   language model only, chunked prefill of 2,048 tokens, no prefix caching, up to 64
   sequences, VLLM_USE_FLASHINFER_SAMPLER=0, VLLM_DEEP_GEMM_WARMUP=skip) and a fixed KV
   cache, started with a Unix sid of its own (setsid); /health polled until 200.
2. The OpenAI API through the `openai` client (serve_api.py): completions and chat
   completions, streamed and not, logprobs, n > 1, a stop string; bad requests (a prompt
   over max_model_len, malformed JSON, an unknown model, max_tokens 0) must each get a 4xx
   with /health still 200 after each. Rows kernel="serve_api".
3. `vllm bench serve` (serve_bench.py): the random dataset at 1,024 in / 128 out and 8,192 in
   / 256 out, concurrency 1, 4, 16 and 64, each run's --save-result JSON kept in the work
   folder and in its row. Rows kernel="serve": ttft/tpot p50 and p99, itl p99, output tok/s.
4. SIGINT, then wait; no process carrying the server's sid may be left, and its GPU memory
   must come back (nvidia-smi, else torch.cuda.mem_get_info). Rows kernel="serve_lifecycle"
   per mode and "serve_gpu_memory" per group of servers.

The servers start side by side (their start-ups overlap; --serial: one at a time), each with
its share of the GPU's memory, and the benchmark runs go one at a time, alternating the modes
at each (shape, concurrency), so no two measurements overlap and a --deadline drops the same
tail of every mode. Each mode gets its own vLLM cache root (VLLM_CACHE_ROOT): vLLM's
torch.compile cache key covers VLLM_* variables and the traced code, not DEEPINFER_* ones,
so modes sharing a cache could load each other's compiled graphs.

Writes benchmarks/results/<gpu>-<date>-e2e-serve-<commit>.json (meta: gpu, torch, triton,
vllm, commit; rows of this run's modes plus those of other modes found in the work folder at
the same commit and graph form) and prints a summary; benchmarks/charts.py draws the serve
rows. The overlay must be installed into the vLLM this python imports for the a100 and
default modes (`make serve-bench` installs it; tools/install_overlay.py).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tools"))
import serve_api  # noqa: E402
import serve_bench  # noqa: E402
import serve_proc  # noqa: E402
from e2e_models import MODELS, TPUT_MODEL  # noqa: E402
from run import CHUNK, MODES as RUN_MODES  # noqa: E402
from run_common import write_json  # noqa: E402

SERVE_MODES = {"a100": dict(RUN_MODES["a100"]), "upstream": dict(RUN_MODES["upstream"]),
               "default": {}}
# What run.py sets for every engine (besides the mode's switches).
ENGINE_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_DEEP_GEMM_WARMUP": "skip"}
# DEEPINFER_* variables of the caller that reach the server; every other one is dropped, so a
# mode's switches are exactly SERVE_MODES[mode].
KEEP_DEEPINFER = ("DEEPINFER_COMMIT", "DEEPINFER_BUILD", "DEEPINFER_CACHE")
# The longest benchmark request (8,192 + 256 tokens) with room; the over-length check sends
# more than this.
MAX_MODEL_LEN = 9216
MAX_NUM_SEQS = 64
# A fixed KV cache per server: 64 requests of 8,448 tokens need ~0.8 GiB of v41-tput's
# cache; with a fixed size vLLM skips the free-memory comparison of its profile run, so the
# servers can start side by side (run.py's agreement engines do the same).
KV_CACHE_GIB = 8.0
GPU_MEM = 0.85          # gpu_memory_utilization of one server alone; shared when side by side
START_TIMEOUT_S = 900.0
# Seconds kept back at the deadline for stopping the servers and writing the results.
STOP_RESERVE_S = 90.0
_DEADLINE = [float("inf")]


def _left() -> float:
    return _DEADLINE[0] - time.time()


# --------------------------------------------------------------------------- setup
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=TPUT_MODEL, choices=sorted(MODELS),
                    help="an e2e model (benchmarks/e2e/e2e_models.py), built in --work "
                    "when missing")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="serve this checkpoint folder instead of --model's")
    ap.add_argument("--modes", default=",".join(SERVE_MODES))
    ap.add_argument("--work", type=Path, default=Path("/tmp/deepinfer-e2e"))
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--quick", action="store_true",
                    help="fewer requests per run (serve_bench.NUM_PROMPTS) and, unless "
                    "--graphs, eager servers: one model in three modes in ~9 minutes")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--eager", action="store_true",
                   help="no torch.compile and no CUDA graphs, vLLM's JIT kernel warmup kept "
                   "(EAGER_COMPILATION)")
    g.add_argument("--graphs", action="store_true",
                   help="vLLM's default torch.compile + CUDA graphs (the default without "
                   "--quick)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from now: no benchmark run starts after it less "
                    f"{STOP_RESERVE_S:.0f} s, the servers are stopped and the results "
                    "written from what finished")
    ap.add_argument("--serial", action="store_true",
                    help="one server at a time (start, check, benchmark, stop)")
    ap.add_argument("--bench-cli", action="store_true",
                    help="each benchmark run as its own `vllm bench serve` process")
    ap.add_argument("--shapes", default=",".join(f"{i}x{o}" for i, o in serve_bench.SHAPES),
                    help="INPUTxOUTPUT token counts, comma-separated")
    ap.add_argument("--concurrency", default=",".join(map(str, serve_bench.CONCURRENCY)))
    ap.add_argument("--no-bench", action="store_true", help="API checks only")
    ap.add_argument("--no-api", action="store_true", help="benchmark runs only")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    ap.add_argument("--kv-cache-gib", type=float, default=KV_CACHE_GIB)
    ap.add_argument("--gpu-mem", type=float, default=None,
                    help=f"gpu_memory_utilization per server (default {GPU_MEM} shared "
                    "among the servers running side by side)")
    ap.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S)
    ap.add_argument("--skip-preflight", action="store_true",
                    help="start the servers without first importing SERVE_IMPORTS")
    ap.add_argument("--stop-linger", type=float, default=serve_proc.LINGER_S,
                    help="seconds the other processes of a stopped server (its sid) may "
                    "take to exit before they count as left behind")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="one more `vllm serve` argument (repeatable), e.g. "
                    "--server-arg=--compilation-config='{...}'")
    ap.add_argument("--python", default=sys.executable,
                    help="the python whose vLLM serves and benchmarks (default: this one)")
    ap.add_argument("--nvidia-smi", default="nvidia-smi")
    ap.add_argument("--skip-overlay-check", action="store_true",
                    help="run the a100/default modes without the overlay installed")
    args = ap.parse_args(argv)
    args.graphs = args.graphs or not (args.eager or args.quick)
    args.plan = "quick" if args.quick else "full"
    args.mode_list = [m for m in args.modes.split(",") if m]
    bad = sorted(set(args.mode_list) - set(SERVE_MODES))
    if bad or not args.mode_list:
        ap.error(f"--modes: unknown {', '.join(bad) or '(none)'}; known: "
                 f"{', '.join(SERVE_MODES)}")
    try:
        args.shape_list = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        args.conc_list = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error("--shapes takes INPUTxOUTPUT,... and --concurrency N,...")
    return args


def form(args) -> str:
    return "graphs" if args.graphs else "eager"


def prepare_checkpoint(args) -> tuple[Path, str]:
    """(checkpoint folder, its label). A missing e2e checkpoint is written as e2e.py writes
    it; a tokenizer of an older layout (no chat template) is rewritten in place."""
    from ckptgen import tokenizer as tok
    if args.checkpoint is not None:
        ckpt, label = args.checkpoint, args.checkpoint.name
    else:
        cfg, fmt = MODELS[args.model]
        ckpt, label = args.work / f"{args.model}-{fmt}", args.model
        if not (ckpt / "config.json").exists():
            print(f"checkpoint {ckpt}: writing", flush=True)
            r = subprocess.run([sys.executable, str(REPO / "tools" / "make_checkpoint.py"),
                                str(HERE / "configs" / cfg), "--format", fmt, "--out",
                                str(ckpt)], capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"make_checkpoint failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    if not (ckpt / "config.json").exists():
        raise SystemExit(f"{ckpt}: no config.json")
    if not tok.is_current(ckpt):
        print(f"checkpoint {ckpt}: tokenizer rewritten (layout {tok.LAYOUT_VERSION})",
              flush=True)
        tok.write_for_config(ckpt, json.loads((ckpt / "config.json").read_text()))
    return ckpt, label


def commit() -> str:
    c = os.environ.get("DEEPINFER_COMMIT")
    if c:
        return c
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "dev"
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--",
                                "overlay", "benchmarks", "tools"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return "dev"


def versions(python: str) -> dict:
    """torch / triton / vllm of the serving python (package metadata: nothing imported)."""
    code = ("import importlib.metadata as m, json\nout = {}\n"
            "for p in ('torch', 'triton', 'vllm', 'openai', 'transformers', 'tokenizers'):\n"
            "    try: out[p] = m.version(p)\n    except Exception: out[p] = None\n"
            "print(json.dumps(out))")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001
        return {p: _version(p) for p in ("torch", "triton", "vllm")}


def _version(p: str):
    try:
        return importlib.metadata.version(p)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_name(nvidia_smi: str) -> str | None:
    try:
        r = subprocess.run([nvidia_smi, "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        names = [n.strip() for n in r.stdout.splitlines() if n.strip()]
        sel = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        if sel.isdigit() and int(sel) < len(names):
            return names[int(sel)]
        return names[0] if names else None
    except (OSError, subprocess.TimeoutExpired):
        return None


# Modules `vllm serve` imports beyond what `import vllm` and the offline engine load: the CLI
# and the API server (uvicorn, watchfiles, prometheus_fastapi_instrumentator, ...), the
# benchmark client, and the SageMaker router's model_hosting_container_standards, which
# vLLM 0.33.0 imports only when it builds the app (entrypoints/serve/sagemaker/api_router.py),
# after the engine has started: on the H200 at 5c66855 a trimmed install failed there after
# 243 s of engine start-up (benchmarks/results/h200-2026-12-02-e2e-serve-5c66855.json). So
# they are imported once, in the serving python, before any server starts.
SERVE_IMPORTS = ("vllm.entrypoints.cli.main", "vllm.entrypoints.cli.serve",
                 "vllm.entrypoints.openai.api_server", "vllm.benchmarks.serve",
                 "model_hosting_container_standards.sagemaker")


def preflight(python: str, env: dict, modules=SERVE_IMPORTS) -> dict:
    """Import each of ``modules`` in ``python`` (one process); ``{"missing": {module:
    error}}``, empty when all import."""
    code = ("import importlib, json, sys\nbad = {}\n"
            "for m in sys.argv[1:]:\n"
            "    try: importlib.import_module(m)\n"
            "    except BaseException as e: bad[m] = f'{type(e).__name__}: {e}'[:300]\n"
            "print(json.dumps(bad))")
    try:
        r = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True,
                           timeout=300, env=env)
        lines = r.stdout.strip().splitlines()
        missing = json.loads(lines[-1]) if lines else {"(python)": r.stderr.strip()[-300:]}
    except Exception as e:  # noqa: BLE001
        missing = {"(python)": f"{type(e).__name__}: {e}"}
    return dict(missing=missing)


def overlay_status(python: str) -> dict:
    r = subprocess.run([python, str(REPO / "tools" / "install_overlay.py"), "status"],
                       capture_output=True, text=True, timeout=120)
    return dict(rc=r.returncode, text=(r.stdout + r.stderr).strip()[-600:])


def server_env(mode: str, work: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DEEPINFER_") or k in KEEP_DEEPINFER}
    env.update(ENGINE_ENV)
    env.update(SERVE_MODES[mode])
    env["VLLM_CACHE_ROOT"] = str(work / "serve-cache" / mode)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# The eager form: no torch.compile and no CUDA graphs, as --enforce-eager, but vLLM's JIT
# kernel warmup stays on (--enforce-eager turns it off, config/vllm.py). Without the warmup
# every kernel compiles on first use while serving: on the H200 at 3e2842d an eager
# A100-faithful engine stalled 29 s inside one timed request compiling two TileLang mHC
# kernels for a token-count bucket its warm-up had not met (GPU idle 32.6 of 36.7 s,
# benchmarks/results/h200-2026-12-02-e2e-long-3e2842d.json).
EAGER_COMPILATION = {"mode": 0, "cudagraph_mode": "NONE"}


def server_argv(args, ckpt: Path, served: str, port: int, gpu_mem: float) -> list[str]:
    argv = [args.python, "-m", "vllm.entrypoints.cli.main", "serve", str(ckpt),
            "--host", args.host, "--port", str(port), "--served-model-name", served,
            "--language-model-only", "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(CHUNK),
            "--enable-chunked-prefill", "--no-enable-prefix-caching",
            "--gpu-memory-utilization", f"{gpu_mem:.3f}",
            "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30))),
            "--seed", "0", "--disable-uvicorn-access-log"]
    if not args.graphs:
        argv += ["--compilation-config", json.dumps(EAGER_COMPILATION)]
    return argv + list(args.server_arg)


def mode_dir(args, label: str, mode: str) -> Path:
    return args.work / "serve" / f"{label}-{form(args)}" / mode


# --------------------------------------------------------------------------- one group
class Ctx:
    """What a group of servers needs: the arguments, checkpoint, label and run facts."""

    def __init__(self, args, ckpt: Path, label: str, meta: dict):
        self.args, self.ckpt, self.label, self.meta = args, ckpt, label, meta
        self.served = label
        self.not_done: list[str] = []


def run_group(ctx: Ctx, modes: list[str], gpu_mem: float) -> list[dict]:
    """Start the servers of ``modes`` side by side, check their API, run the benchmark
    (alternating the modes), stop them; returns every row (also written per mode)."""
    args = ctx.args
    servers: dict[str, serve_proc.Server] = {}
    for mode in modes:
        d = mode_dir(args, ctx.label, mode)
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("*.json"):
            old.unlink()
        port = serve_proc.free_port(args.host)
        while port in {int(x.base_url.rsplit(":", 1)[1]) for x in servers.values()}:
            port = serve_proc.free_port(args.host)
        argv = server_argv(args, ctx.ckpt, ctx.served, port, gpu_mem)
        servers[mode] = serve_proc.Server(mode, argv, server_env(mode, args.work),
                                          d / "server.log", f"http://{args.host}:{port}")
    before = serve_proc.gpu_memory(args.nvidia_smi, args.python)
    for mode, s in servers.items():
        print(f"[{mode}] starting: {' '.join(s.argv[1:6])} ... port {s.base_url}", flush=True)
        s.start()
    waits = {}

    def wait(mode):
        s = servers[mode]
        waits[mode] = s.wait_healthy(max(0.0, min(args.start_timeout,
                                                  _left() - STOP_RESERVE_S)))
    ts = [threading.Thread(target=wait, args=(m,)) for m in modes]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    healthy = [m for m in modes if waits[m]["healthy"]]
    for m in modes:
        w = waits[m]
        print(f"[{m}] {'healthy' if w['healthy'] else 'NOT healthy'} after "
              f"{w['start_seconds']:.1f} s{'' if w['healthy'] else ': ' + w['error']}",
              flush=True)
        if not w["healthy"]:
            ctx.not_done.append(f"{m}/start")
    reading = serve_proc.gpu_memory(args.nvidia_smi, args.python)
    visible = {m: bool(reading and reading.get("apps") and
                       set(reading["apps"]) & servers[m].seen_pids) for m in modes}
    served_version = {m: _served_version(servers[m].base_url) for m in healthy}

    rows: dict[str, list[dict]] = {m: [] for m in modes}
    if not args.no_api:
        for m in healthy:
            if _left() < STOP_RESERVE_S + 30:
                ctx.not_done.append(f"{m}/api")
                continue
            rs = serve_api.api_rows(servers[m].base_url, ctx.served, args.max_model_len, m,
                                    ctx.label, deadline=_DEADLINE[0] - STOP_RESERVE_S)
            rows[m] += rs
            print(f"[{m}] {serve_api.summary(rs)}", flush=True)
            servers[m].note_pids()
    if not args.no_bench:
        for m, rs in bench_group(ctx, {m: servers[m] for m in healthy}).items():
            rows[m] += rs
    health_after = {m: serve_proc.health(servers[m].base_url) for m in healthy}
    for s in servers.values():
        s.note_pids()
    stops: dict[str, dict] = {}

    def stop(mode):
        stops[mode] = servers[mode].stop(linger=args.stop_linger)
    ts = [threading.Thread(target=stop, args=(m,)) for m in modes]
    for t in ts:
        t.start()
    for t in ts:
        t.join()

    def read():
        return serve_proc.gpu_memory(args.nvidia_smi, args.python)
    for m in modes:
        s = servers[m]
        st, w = stops[m], waits[m]
        # Read while anything it left still runs (one reading: it would not return), then
        # end those processes so nothing outlives the benchmark.
        mem = serve_proc.memory_returned(before, read, s.seen_pids if visible[m] else set(),
                                         others_alive=len(modes) > 1,
                                         settle=0.0 if st.get("leftover") else _settle())
        st["alive_after_kill"] = s.kill_leftovers()
        passed = bool(w["healthy"] and health_after.get(m) and st.get("clean_exit")
                      and not st.get("leftover") and mem["returned"] is not False)
        rows[m].append(dict(
            kernel="serve_lifecycle", variant=m,
            shape=dict(model=ctx.label, cuda_graphs=args.graphs), passed=passed,
            start_seconds=w["start_seconds"], healthy=w["healthy"], start_error=w["error"],
            health_after_bench=health_after.get(m), served_vllm=served_version.get(m),
            stop=st, gpu_memory=mem, gpu_pids_listed=visible[m], pids_seen=sorted(
                s.seen_pids), server_argv=s.argv[1:], log=str(s.log_path),
            env={k: v for k, v in sorted(s.env.items())
                 if k.startswith(("DEEPINFER_", "VLLM_", "CUDA_VISIBLE"))}))
        print(f"[{m}] stopped by {'+'.join(st.get('signals') or ['-'])} in "
              f"{st.get('stop_seconds')} s, exit {st.get('exit_code')}, "
              f"{len(st.get('leftover') or [])} process(es) left, GPU memory returned: "
              f"{mem['returned']} ({mem['checked']})", flush=True)
    final = serve_proc.memory_returned(before, read, set(), others_alive=False,
                                       settle=_settle())
    group_row = dict(kernel="serve_gpu_memory", variant="+".join(modes),
                     shape=dict(model=ctx.label, cuda_graphs=args.graphs),
                     passed=final["returned"] is not False, **final)
    for m in modes:
        out = rows[m] + ([group_row] if m == modes[-1] else [])
        write_json(mode_dir(args, ctx.label, m) / "rows.json",
                   dict(commit=ctx.meta["commit"], form=form(args), mode=m,
                        run_id=ctx.meta["run_id"], rows=out))
    return [r for m in modes for r in rows[m]] + [group_row]


def _settle() -> float:
    """How long the GPU may take to show memory returned: GPU_SETTLE_S, less near the
    deadline."""
    return max(0.0, min(serve_proc.GPU_SETTLE_S, _left() - 15))


def _served_version(base_url: str):
    status, body = serve_proc.http("GET", f"{base_url}/version", timeout=10)
    try:
        return json.loads(body).get("version") if status == 200 else None
    except (json.JSONDecodeError, AttributeError):
        return None


def bench_group(ctx: Ctx, servers: dict) -> dict[str, list[dict]]:
    """The benchmark runs of every healthy server: each (shape, concurrency) in turn, the
    modes alternating within it."""
    args = ctx.args
    runs, keys = [], []
    for i, o in args.shape_list:
        for c in args.conc_list:
            for m, s in servers.items():
                d = mode_dir(args, ctx.label, m)
                n = serve_bench.num_prompts(args.plan, i, o, c)
                name = serve_bench.result_name(i, o, c)
                port = int(s.base_url.rsplit(":", 1)[1])
                runs.append(dict(
                    args=serve_bench.bench_args(
                        served_name=ctx.served, tokenizer=str(ctx.ckpt), host=args.host,
                        port=port, input_len=i, output_len=o, concurrency=c, prompts=n,
                        result_dir=str(d),
                        warmups=serve_bench.QUICK_WARMUPS if args.quick else None),
                    result=str(d / name), log=str(d / name.replace(".json", ".log")),
                    status=str(d / name.replace(".json", ".status.json")),
                    cap=serve_bench.RUN_CAP_S[args.plan]))
                keys.append((m, i, o, c, n))
    plan = args.work / "serve" / f"{ctx.label}-{form(args)}" / \
        f"plan-{'+'.join(servers)}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    serve_bench.run_plan(runs, plan, _DEADLINE[0] - STOP_RESERVE_S, args.python, env,
                         cli=args.bench_cli)
    out: dict[str, list[dict]] = {m: [] for m in servers}
    for run, (m, i, o, c, n) in zip(runs, keys):
        result, status = serve_bench.read_run(run)
        row = serve_bench.bench_row(mode=m, model=ctx.label, graphs=args.graphs, input_len=i,
                                    output_len=o, concurrency=c, prompts=n, result=result,
                                    status=status, result_file=Path(run["result"]).name)
        out[m].append(row)
        if not row["passed"]:
            ctx.not_done.append(f"{m}/bench-i{i}-o{o}-c{c}")
    return out


# --------------------------------------------------------------------------- results
def collect(args, label: str, meta: dict, ran: list[str]) -> tuple[list[dict], list[str]]:
    """Rows of the modes run now (written by this invocation: ``run_id``), then those of
    other modes in the work folder at the same commit and graph form (a run of one mode per
    invocation still lands in one file)."""
    rows, merged = [], []
    base = args.work / "serve" / f"{label}-{form(args)}"
    for m in SERVE_MODES:
        f = base / m / "rows.json"
        if not f.exists():
            continue
        d = json.loads(f.read_text())
        if m in ran and d.get("run_id") != meta["run_id"]:
            continue   # asked for now but not run (the deadline): an older file's rows
        if m not in ran and (d.get("commit") != meta["commit"] or d.get("form") != form(args)):
            continue
        if m not in ran:
            merged.append(m)
        rows += d["rows"]
    return rows, merged


def write_results(args, meta: dict, rows: list[dict]) -> Path:
    gpu = (meta.get("gpu") or "gpu").split()[-1].lower()
    out = args.results / f"{gpu}-{meta['date']}-e2e-serve-{(meta['commit'] or 'dev')[:7]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return out


def print_summary(rows: list[dict]) -> None:
    for r in rows:
        s = r["shape"]
        if r["kernel"] == "serve":
            print(f"  {r['variant']:8s} in {s['input_len']:>5} out {s['output_len']:>4} "
                  f"c{s['concurrency']:<3d} " + (
                      f"{r['output_tok_s'] or 0:9.1f} tok/s  ttft p50 {r['ttft_ms_p50']} / "
                      f"p99 {r['ttft_ms_p99']} ms  tpot p50 {r['tpot_ms_p50']} / p99 "
                      f"{r['tpot_ms_p99']} ms  itl p99 {r['itl_ms_p99']} ms"
                      if r["passed"] else f"FAILED: {r['error']}"), flush=True)
        elif r["kernel"] == "serve_api" and not r["passed"]:
            print(f"  {r['variant']:8s} API {s['check']}: FAILED {r['error'] or r['detail']}")
        elif r["kernel"] in ("serve_lifecycle", "serve_gpu_memory"):
            print(f"  {r['variant']:8s} {r['kernel']}: {'PASS' if r['passed'] else 'FAIL'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    if args.deadline is not None:
        _DEADLINE[0] = t0 + args.deadline
    args.work.mkdir(parents=True, exist_ok=True)
    ver = versions(args.python)
    gpu = gpu_name(args.nvidia_smi)
    meta = dict(gpu=gpu, torch=ver.get("torch"), triton=ver.get("triton"),
                vllm=ver.get("vllm"), commit=commit(),
                date=datetime.date.today().isoformat(), packages=ver,
                run_id=f"{os.getpid()}-{t0:.3f}",
                note=f"{gpu or 'this GPU'}'s figures; the a100 mode emulates an A100's kernel "
                     "selection on this GPU (DEEPINFER_EMULATE_CAPABILITY=8.0): its speeds "
                     "are not A100 speeds")
    if set(args.mode_list) - {"upstream"}:
        ov = overlay_status(args.python)
        meta["overlay_status"] = ov
        if ov["rc"] != 0 and not args.skip_overlay_check:
            raise SystemExit(f"the overlay is not installed in the vLLM of {args.python} "
                             f"(tools/install_overlay.py status: rc {ov['rc']}): the a100 "
                             "and default modes would serve upstream; `make serve-bench` "
                             f"installs it\n{ov['text']}")
    if not args.skip_preflight:
        pf = preflight(args.python, server_env(args.mode_list[0], args.work))
        meta["preflight"] = pf
        if pf["missing"]:
            raise SystemExit(
                "vllm serve cannot run in " + args.python + ": " + "; ".join(
                    f"{m}: {e}" for m, e in pf["missing"].items()) + " (install vLLM's "
                "serving dependencies; --skip-preflight starts the servers anyway)")
    ckpt, label = prepare_checkpoint(args)
    groups = [[m] for m in args.mode_list] if args.serial else [args.mode_list]
    ctx = Ctx(args, ckpt, label, meta)
    for group in groups:
        if _left() < STOP_RESERVE_S + 60:
            ctx.not_done += [f"{m}/not started: the deadline" for m in group]
            continue
        gpu_mem = args.gpu_mem or round(GPU_MEM / len(group), 3)
        run_group(ctx, group, gpu_mem)
    rows, merged = collect(args, label, meta, args.mode_list)
    meta.update(model=label, checkpoint=str(ckpt), modes=args.mode_list, merged_modes=merged,
                cuda_graphs=args.graphs, plan=args.plan, serial=args.serial,
                bench=("vllm bench serve (one process per run)" if args.bench_cli else
                       "vllm bench serve's code, one process for every run (serve_bench.py)"),
                num_prompts={f"{i}x{o}": {c: serve_bench.num_prompts(args.plan, i, o, c)
                                          for c in args.conc_list}
                             for i, o in args.shape_list},
                server=dict(max_model_len=args.max_model_len, max_num_seqs=MAX_NUM_SEQS,
                            max_num_batched_tokens=CHUNK, kv_cache_gib=args.kv_cache_gib,
                            prefix_caching=False, extra=args.server_arg),
                mode_env=SERVE_MODES, engine_env=ENGINE_ENV, not_done=ctx.not_done,
                wall_seconds=round(time.time() - t0, 1))
    out = write_results(args, meta, rows)
    print(f"wrote {out} ({len(rows)} rows; not done: {ctx.not_done or 'none'})", flush=True)
    print_summary(rows)
    failed = [r for r in rows if r.get("passed") is False]
    return 1 if failed or ctx.not_done else 0


if __name__ == "__main__":
    sys.exit(main())
