"""``vllm bench serve`` for benchmarks/e2e/serve.py: the shapes and request counts measured,
each run's arguments (flags as vLLM 0.33.0's vllm/benchmarks/serve.py and
vllm/benchmarks/datasets/datasets.py define them), the runs themselves, and the rows made
from the result JSON each run saves (--save-result).

The runs go through vLLM's own benchmark code: by default in one process
(``python serve_bench.py --driver PLAN.json``) that parses each run's arguments with vLLM's
parser (``add_cli_args``) and awaits its ``main_async``, exactly what ``vllm bench serve``
does, without importing vLLM again for each of the 8 runs per mode (tens of seconds each on
the H200 host); ``--cli`` runs every one as its own ``vllm bench serve`` process instead.
Standard library only at import (vLLM is imported by the driver).

Result JSON keys read (vLLM 0.33.0 ``benchmark()`` with --metric-percentiles 50,90,99):
p50/p99_ttft_ms, p50/p99_tpot_ms, p50/p99_itl_ms, output_throughput (output tok/s over the
run), completed, failed, duration, request_throughput, total_token_throughput,
max_concurrency, num_prompts.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPES = ((1024, 128), (8192, 256))        # (input tokens, output tokens) per request
CONCURRENCY = (1, 4, 16, 64)
# Requests per run (--num-prompts), per (input, output) and concurrency. At concurrency c>1 a
# run sends about two rounds of c requests, so requests sent after the first ones find the
# batch already full and the rows are not just the ramp from an empty engine; concurrency 1
# rows are latency rows, and 8 (4 for 8K prompts) requests give a stable median (p99 of so
# few samples is their maximum: the rows keep num_prompts). At 8K / concurrency 64 one round
# of 64 requests (512K prompt tokens) is sent: every request already decodes beside ~63
# others once the prefills are through, and a second round would double the longest run.
# --quick halves the rounds where that keeps at least c requests.
NUM_PROMPTS = {
    "full": {(1024, 128): {1: 8, 4: 16, 16: 32, 64: 128},
             (8192, 256): {1: 4, 4: 8, 16: 32, 64: 64}},
    "quick": {(1024, 128): {1: 4, 4: 8, 16: 16, 64: 64},
              (8192, 256): {1: 2, 4: 4, 16: 16, 64: 64}},
}
# Warm-up requests (--num-warmups; vLLM sends them at the run's concurrency before the
# timed requests): up to 4, so kernels a shape compiles on first use (an eager server has no
# JIT warmup) compile outside the timed window, at the cost of about one request's latency;
# --quick sends one.
MAX_WARMUPS = 4
QUICK_WARMUPS = 1
PERCENTILES = "50,90,99"
# Seconds a run may take before it is stopped (the --deadline may allow less).
RUN_CAP_S = {"full": 420.0, "quick": 240.0}


def num_prompts(plan: str, input_len: int, output_len: int, concurrency: int) -> int:
    table = NUM_PROMPTS[plan].get((input_len, output_len), {})
    return table.get(concurrency, 2 * concurrency)


def result_name(input_len: int, output_len: int, concurrency: int) -> str:
    return f"bench-i{input_len}-o{output_len}-c{concurrency}.json"


def bench_args(*, served_name: str, tokenizer: str, host: str, port: int, input_len: int,
               output_len: int, concurrency: int, prompts: int, result_dir: str,
               warmups: int | None = None, seed: int = 0) -> list[str]:
    """The ``vllm bench serve`` arguments of one run (after ``vllm bench serve``)."""
    return ["--backend", "vllm", "--host", host, "--port", str(port),
            "--endpoint", "/v1/completions",
            "--model", served_name, "--served-model-name", served_name,
            "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "0",
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
            "--num-warmups", str(min(concurrency, MAX_WARMUPS) if warmups is None
                                 else warmups),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES,
            "--seed", str(seed), "--disable-tqdm",
            "--save-result", "--result-dir", result_dir,
            "--result-filename", result_name(input_len, output_len, concurrency),
            "--metadata", f"concurrency={concurrency}", f"input_len={input_len}",
            f"output_len={output_len}"]


def _num(v):
    return None if v is None else round(float(v), 3)


def bench_row(*, mode: str, model: str, graphs: bool, input_len: int, output_len: int,
              concurrency: int, prompts: int, result: dict | None, status: dict | None,
              result_file: str | None = None) -> dict:
    """kernel="serve": one ``vllm bench serve`` run. ``passed``: the run finished and every
    request completed."""
    r = result or {}
    status = status or {}
    completed, failed = r.get("completed"), r.get("failed")
    passed = bool(result) and completed == prompts and not failed
    err = status.get("error")
    if result and not passed and not err:
        err = f"{completed} of {prompts} requests completed, {failed} failed"
    return dict(kernel="serve", variant=mode,
                shape=dict(model=model, input_len=input_len, output_len=output_len,
                           concurrency=concurrency, cuda_graphs=graphs),
                ttft_ms_p50=_num(r.get("p50_ttft_ms", r.get("median_ttft_ms"))),
                ttft_ms_p99=_num(r.get("p99_ttft_ms")),
                tpot_ms_p50=_num(r.get("p50_tpot_ms", r.get("median_tpot_ms"))),
                tpot_ms_p99=_num(r.get("p99_tpot_ms")),
                itl_ms_p50=_num(r.get("p50_itl_ms", r.get("median_itl_ms"))),
                itl_ms_p99=_num(r.get("p99_itl_ms")),
                output_tok_s=_num(r.get("output_throughput")),
                total_tok_s=_num(r.get("total_token_throughput")),
                request_s=_num(r.get("request_throughput")),
                num_prompts=prompts, completed=completed, failed=failed,
                duration_s=_num(r.get("duration")), passed=passed, error=err,
                run_seconds=status.get("seconds"), result_file=result_file,
                bench_result=result)


# --------------------------------------------------------------------------- running
def write_plan(path: Path, runs: list[dict], deadline: float) -> None:
    """runs: [{"args": [...], "result": path, "log": path, "status": path, "cap": s}]."""
    Path(path).write_text(json.dumps(dict(deadline=deadline, runs=runs), indent=1))


def _status(path, **kw) -> None:
    Path(path).write_text(json.dumps(kw))


def _left(deadline: float, cap: float) -> float:
    return min(cap, deadline - time.time())


def drive(plan_path: Path) -> int:
    """Every run of a plan through vLLM's benchmark code in this process (the --driver
    entry). A run is skipped once the plan's deadline leaves it under 20 s, and stopped
    (asyncio timeout) at its cap or the deadline; each run writes its status file."""
    import asyncio
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    plan = json.loads(Path(plan_path).read_text())
    for run in plan["runs"]:
        left = _left(plan["deadline"], run["cap"])
        if left < 20:
            _status(run["status"], rc=125, seconds=0.0, error="not started: the deadline")
            continue
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        t0 = time.time()
        rc, err = 0, None
        with open(run["log"], "w") as log, contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):
            try:
                args = parser.parse_args(run["args"])
                asyncio.run(asyncio.wait_for(main_async(args), timeout=left))
            except (asyncio.TimeoutError, TimeoutError):
                rc, err = 124, f"stopped after {left:.0f} s (cap or deadline)"
            except BaseException as e:  # noqa: BLE001 - recorded, the next run goes on
                if isinstance(e, KeyboardInterrupt):
                    raise
                rc, err = 1, f"{type(e).__name__}: {e}"
        _status(run["status"], rc=rc, seconds=round(time.time() - t0, 2), error=err)
        print(f"  [{rc}] {time.time() - t0:6.1f}s {Path(run['result']).parent.name}/"
              f"{Path(run['result']).name}", flush=True)
    return 0


def run_plan(runs: list[dict], plan_path: Path, deadline: float, python: str, env: dict,
             cli: bool = False) -> None:
    """Run every entry of ``runs`` (see write_plan): one driver process, or (``cli``) one
    ``vllm bench serve`` process each. A run without a status file afterwards is marked."""
    if cli:
        for run in runs:
            left = _left(deadline, run["cap"])
            if left < 20:
                _status(run["status"], rc=125, seconds=0.0, error="not started: the deadline")
                continue
            t0 = time.time()
            with open(run["log"], "w") as log:
                try:
                    rc = subprocess.run([python, "-m", "vllm.entrypoints.cli.main", "bench",
                                         "serve", *run["args"]], stdout=log,
                                        stderr=subprocess.STDOUT, env=env,
                                        timeout=left).returncode
                    err = None if rc == 0 else f"vllm bench serve exited with {rc}"
                except subprocess.TimeoutExpired:
                    rc, err = 124, f"stopped after {left:.0f} s (cap or deadline)"
            _status(run["status"], rc=rc, seconds=round(time.time() - t0, 2), error=err)
            print(f"  [{rc}] {time.time() - t0:6.1f}s {Path(run['result']).name}", flush=True)
    elif runs:
        write_plan(plan_path, runs, deadline)
        log = Path(plan_path).with_suffix(".log")
        with open(log, "w") as f:
            try:
                subprocess.run([python, os.path.abspath(__file__), "--driver", str(plan_path)],
                               stdout=f, stderr=subprocess.STDOUT, env=env,
                               timeout=max(30.0, deadline - time.time() + 30))
            except subprocess.TimeoutExpired:
                pass
        print(Path(log).read_text(), end="", flush=True)
    for run in runs:
        if not Path(run["status"]).exists():
            _status(run["status"], rc=None, seconds=None,
                    error="no status: the benchmark process ended before this run")


def read_run(run: dict) -> tuple[dict | None, dict]:
    """(the saved result JSON or None, the status)."""
    status = json.loads(Path(run["status"]).read_text()) if Path(run["status"]).exists() \
        else {"error": "not run"}
    result = None
    if Path(run["result"]).exists():
        try:
            result = json.loads(Path(run["result"]).read_text())
        except json.JSONDecodeError as e:
            status = dict(status, error=f"result file unreadable: {e}")
    elif status.get("rc") == 0:
        status = dict(status, error="the run saved no result file")
    return result, status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--driver", type=Path, required=True,
                    help="run a plan written by write_plan (serve.py starts this)")
    return drive(ap.parse_args(argv).driver)


if __name__ == "__main__":
    sys.exit(main())
