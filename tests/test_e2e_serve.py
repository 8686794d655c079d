"""benchmarks/e2e/serve.py on CPU with stand-ins for `vllm serve`, `vllm bench serve` and
nvidia-smi (tests/serve_fakes.py): the whole run of three modes (servers side by side,
healthy, the API checks through the `openai` client, the benchmark runs alternating the modes,
SIGINT, nothing left, GPU memory returned, the results file); the failures it must report
(a bad request answered 200, a child left behind, a server that never starts, the deadline);
the rows made from vLLM's result JSON; the server's settings and switches per mode; and the
`vllm bench serve` / `vllm serve` arguments parsed by vLLM 0.33.0's own parsers (the patched
tree, in a subprocess)."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
E2E = REPO / "benchmarks" / "e2e"
sys.path.insert(0, str(E2E))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
import patched_python  # noqa: E402
import serve  # noqa: E402
import serve_bench  # noqa: E402
import serve_fakes  # noqa: E402
import serve_proc  # noqa: E402
import subproc  # noqa: E402
from run import CHUNK  # noqa: E402

CONFIG = REPO / "benchmarks" / "e2e" / "configs" / "v41-tput" / "config.json"


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """The fake vLLM package and nvidia-smi, a checkpoint folder (config.json only: the fake
    loads no weights; serve.py writes its tokenizer), and the environment to run them."""
    d = tmp_path_factory.mktemp("serve")
    serve_fakes.install(d / "root")
    (d / "ck").mkdir()
    (d / "ck" / "config.json").write_text(CONFIG.read_text())
    (d / "gpu").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "FAKE_"))}
    env.update(PYTHONPATH=f"{d / 'root'}{os.pathsep}{REPO / 'tests'}",
               PATH=f"{d / 'root' / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               FAKE_GPU_DIR=str(d / "gpu"), DEEPINFER_COMMIT="abc1234def",
               DEEPINFER_ARCH="sm80", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return dict(dir=d, env=env)


def _serve(fake, tag: str, *extra: str, env: dict | None = None, cap: float = 120):
    work, results = fake["dir"] / f"work-{tag}", fake["dir"] / f"results-{tag}"
    r = subproc.run([sys.executable, str(E2E / "serve.py"), "--checkpoint",
                     str(fake["dir"] / "ck"), "--work", str(work), "--results", str(results),
                     "--quick", "--skip-overlay-check", "--shapes", "64x8,128x4",
                     "--concurrency", "1,4", *extra],
                    env={**fake["env"], **(env or {})}, cap=cap)
    files = sorted(results.glob("*.json"))
    data = json.loads(files[0].read_text()) if files else None
    return r, data, work


def _rows(data, kernel):
    return [r for r in data["rows"] if r["kernel"] == kernel]


def _fake_processes(marker: str) -> list[int]:
    """Live processes whose command line names ``marker``."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            cmd = serve_proc.cmdline(int(pid))
            if marker in cmd and serve_fakes._alive(int(pid)):
                out.append(int(pid))
    return out


# --------------------------------------------------------------------------- the whole run
@pytest.fixture(scope="module")
def happy(fake):
    return _serve(fake, "happy", "--modes", "a100,upstream,default")


def test_whole_run_three_modes(fake, happy):
    r, data, work = happy
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    meta = data["meta"]
    assert (meta["gpu"], meta["torch"], meta["triton"], meta["vllm"], meta["commit"]) == \
        ("NVIDIA H200", "2.11.0", "3.6.0", "0.33.0", "abc1234def")
    assert meta["modes"] == ["a100", "upstream", "default"] and meta["not_done"] == []
    assert meta["cuda_graphs"] is False and meta["plan"] == "quick"   # --quick: eager
    name = sorted((fake["dir"] / "results-happy").glob("*.json"))[0].name
    assert name.startswith("h200-") and name.endswith("-e2e-serve-abc1234.json")
    serve_rows = _rows(data, "serve")
    assert len(serve_rows) == 3 * 2 * 2
    for row in serve_rows:
        s, b = row["shape"], row["bench_result"]
        assert row["passed"] and row["error"] is None
        # the result vLLM's benchmark saved, from the server of the row's own mode
        assert b["served_mode"] == row["variant"]
        assert int(b["concurrency"]) == s["concurrency"] and b["max_concurrency"] == \
            s["concurrency"]
        assert row["num_prompts"] == serve_bench.num_prompts("quick", s["input_len"],
                                                             s["output_len"], s["concurrency"])
        assert row["completed"] == row["num_prompts"]
        assert row["ttft_ms_p50"] == round(b["p50_ttft_ms"], 3)
        assert row["output_tok_s"] == round(b["output_throughput"], 3)
        d = work / "serve" / "ck-eager" / row["variant"]
        assert json.loads((d / row["result_file"]).read_text()) == b
    api = _rows(data, "serve_api")
    assert len(api) == 3 * len(serve.serve_api.Checks.GOOD + serve.serve_api.Checks.BAD)
    assert [r["shape"]["check"] for r in api if not r["passed"]] == []
    for r in api:
        if r["shape"]["check"].startswith("bad_"):
            assert 400 <= r["detail"]["status"] < 500 and r["detail"]["health_after"]
    life = _rows(data, "serve_lifecycle")
    assert [r["variant"] for r in life] == ["a100", "upstream", "default"]
    for r in life:
        assert r["passed"] and r["stop"]["signals"] == ["SIGINT"] and r["stop"]["exit_code"] == 0
        assert r["stop"]["leftover"] == [] and len(r["pids_seen"]) == 2
        assert r["gpu_memory"]["returned"] is True and r["gpu_memory"]["checked"] == ["pids"]
    (mem,) = _rows(data, "serve_gpu_memory")
    assert mem["passed"] and mem["checked"] == ["total"]
    assert mem["after_used_mib"] == serve_fakes.BASE_USED_MIB
    assert _fake_processes(str(fake["dir"] / "ck")) == []


def test_servers_get_their_modes_switches(happy):
    _, data, _ = happy
    life = {r["variant"]: r for r in _rows(data, "serve_lifecycle")}
    deepinfer = {m: {k: v for k, v in r["env"].items() if k.startswith("DEEPINFER_")
                     and k != "DEEPINFER_COMMIT"} for m, r in life.items()}
    # the caller's DEEPINFER_ARCH=sm80 reaches no server: a mode's switches are its own
    assert deepinfer == {"a100": {"DEEPINFER_EMULATE_CAPABILITY": "8.0"},
                         "upstream": {"DEEPINFER_DISABLE": "all"}, "default": {}}
    roots = {r["env"]["VLLM_CACHE_ROOT"] for r in life.values()}
    assert len(roots) == 3
    for r in life.values():
        assert r["env"]["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
        argv = r["server_argv"]
        assert argv[:4] == ["-m", "vllm.entrypoints.cli.main", "serve", argv[3]]
        for flag in ("--language-model-only", "--no-enable-prefix-caching",
                     "--enable-chunked-prefill", "--compilation-config"):
            assert flag in argv
        # eager without --enforce-eager, which would also turn vLLM's JIT warmup off
        assert "--enforce-eager" not in argv
        assert json.loads(argv[argv.index("--compilation-config") + 1]) == \
            {"mode": 0, "cudagraph_mode": "NONE"}
        assert argv[argv.index("--max-num-batched-tokens") + 1] == str(CHUNK)


def test_benchmark_runs_alternate_the_modes(happy):
    _, _, work = happy
    (plan,) = (work / "serve" / "ck-eager").glob("plan-*.json")
    order = [(Path(r["result"]).parent.name, Path(r["result"]).name)
             for r in json.loads(plan.read_text())["runs"]]
    assert [m for m, _ in order[:3]] == ["a100", "upstream", "default"]
    # each (shape, concurrency) for every mode before the next one
    names = [n for _, n in order]
    assert names == [n for n in dict.fromkeys(names) for _ in range(3)]
    assert names[0] == serve_bench.result_name(64, 8, 1)


def test_failures_are_reported(fake):
    """One server answers max_tokens 0 with 200, one leaves a child behind that ignores
    SIGINT and SIGTERM, one never starts; one at a time (--serial), API checks only."""
    r, data, _ = _serve(fake, "bad", "--modes", "a100,upstream,default", "--serial",
                        "--no-bench", "--stop-linger", "3",
                        env=dict(FAKE_ACCEPT_BAD="a100:max_tokens_0",
                                               FAKE_LEAVE_CHILD="upstream",
                                               FAKE_CRASH="default"))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    api = {(x["variant"], x["shape"]["check"]): x for x in _rows(data, "serve_api")}
    assert not api[("a100", "bad_max_tokens_0")]["passed"]
    assert api[("a100", "bad_max_tokens_0")]["detail"]["status"] == 200
    assert all(x["passed"] for k, x in api.items() if k != ("a100", "bad_max_tokens_0"))
    assert not any(m == "default" for m, _ in api)
    life = {x["variant"]: x for x in _rows(data, "serve_lifecycle")}
    assert life["a100"]["passed"]
    up = life["upstream"]
    assert not up["passed"] and len(up["stop"]["leftover"]) == 1
    assert up["stop"]["alive_after_kill"] == []
    # read while the child still held its memory: not returned, by pid and in total
    assert up["gpu_memory"]["returned"] is False and up["gpu_memory"]["checked"] == \
        ["pids", "total"]
    assert not life["default"]["passed"] and not life["default"]["healthy"]
    assert "exited with 1" in life["default"]["start_error"]
    assert "default/start" in data["meta"]["not_done"]
    assert _serve_rows_empty(data)
    assert _fake_processes(str(fake["dir"] / "ck")) == []


def _serve_rows_empty(data) -> bool:
    return _rows(data, "serve") == []


def test_deadline_too_short_starts_nothing(fake):
    """Under STOP_RESERVE_S + 60 s left, no server starts; the results file says so. (A
    deadline reached inside the benchmark: test_bench_cli_and_driver_give_the_same_result_files.)"""
    r, data, work = _serve(fake, "late", "--modes", "upstream", "--deadline", "30")
    assert r.returncode == 1
    assert data["rows"] == []
    assert data["meta"]["not_done"] == ["upstream/not started: the deadline"]
    assert not (work / "serve" / "ck-eager" / "upstream" / "server.log").exists()


def test_preflight_names_a_missing_serving_module_before_any_server(fake, tmp_path):
    """A serving python that lacks a module `vllm serve` imports only when it builds the app
    (the SageMaker router's) is refused before any server starts, naming the module."""
    shadow = tmp_path / "shadow" / "model_hosting_container_standards"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    (shadow / "sagemaker.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'jmespath'\")\n")
    env = {"PYTHONPATH": f"{tmp_path / 'shadow'}{os.pathsep}{fake['env']['PYTHONPATH']}"}
    r, data, work = _serve(fake, "preflight", "--modes", "upstream", env=env)
    assert r.returncode != 0 and data is None
    assert "model_hosting_container_standards.sagemaker" in r.stderr and "jmespath" in r.stderr
    assert not (work / "serve").exists()
    # the happy runs imported every module first and recorded it
    assert serve.preflight(sys.executable, fake["env"]) == {"missing": {}}


def test_results_merge_other_modes_of_the_same_commit(fake, happy):
    """A later invocation running one mode reports the work folder's other modes too, when
    they ran at the same commit and graph form."""
    _, _, work = happy
    r = subproc.run([sys.executable, str(E2E / "serve.py"), "--checkpoint",
                     str(fake["dir"] / "ck"), "--work", str(work), "--results",
                     str(fake["dir"] / "results-merge"), "--quick", "--skip-overlay-check",
                     "--modes", "upstream", "--no-bench", "--no-api"],
                    env=fake["env"], cap=120)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(next((fake["dir"] / "results-merge").glob("*.json")).read_text())
    assert data["meta"]["merged_modes"] == ["a100", "default"]
    assert {x["variant"] for x in _rows(data, "serve")} == {"a100", "default"}
    assert {x["variant"] for x in _rows(data, "serve_lifecycle")} == \
        {"a100", "upstream", "default"}
    other = dict(fake["env"], DEEPINFER_COMMIT="fff0000")
    r = subproc.run([sys.executable, str(E2E / "serve.py"), "--checkpoint",
                     str(fake["dir"] / "ck"), "--work", str(work), "--results",
                     str(fake["dir"] / "results-other"), "--quick", "--skip-overlay-check",
                     "--modes", "upstream", "--no-bench", "--no-api"], env=other, cap=120)
    data = json.loads(next((fake["dir"] / "results-other").glob("*.json")).read_text())
    assert data["meta"]["merged_modes"] == []
    # a mode asked for but not run (the deadline) contributes no rows of an older file
    r = subproc.run([sys.executable, str(E2E / "serve.py"), "--checkpoint",
                     str(fake["dir"] / "ck"), "--work", str(work), "--results",
                     str(fake["dir"] / "results-stale"), "--quick", "--skip-overlay-check",
                     "--modes", "upstream", "--deadline", "30"], env=fake["env"], cap=120)
    data = json.loads(next((fake["dir"] / "results-stale").glob("*.json")).read_text())
    assert {x["variant"] for x in data["rows"]} == {"a100", "default", "a100+upstream+default"}


# --------------------------------------------------------------------------- pieces
def test_bench_cli_and_driver_give_the_same_result_files(fake, tmp_path):
    """run_plan through one `vllm bench serve` process per run (--bench-cli) against a live
    fake server; a run whose deadline has passed is marked, not run."""
    port = serve_proc.free_port()
    env = dict(fake["env"], DEEPINFER_DISABLE="all")
    s = serve_proc.Server("upstream", [sys.executable, "-m", "vllm.entrypoints.cli.main",
                                       "serve", "ck", "--port", str(port),
                                       "--served-model-name", "m"], env,
                          tmp_path / "s.log", f"http://127.0.0.1:{port}")
    s.start()
    try:
        assert s.wait_healthy(30)["healthy"]
        runs = []
        for c in (1, 2):
            name = serve_bench.result_name(16, 4, c)
            runs.append(dict(args=serve_bench.bench_args(
                served_name="m", tokenizer="ck", host="127.0.0.1", port=port, input_len=16,
                output_len=4, concurrency=c, prompts=2, result_dir=str(tmp_path)),
                result=str(tmp_path / name), log=str(tmp_path / f"{c}.log"),
                status=str(tmp_path / f"{c}.status.json"), cap=60.0))
        serve_bench.run_plan(runs, tmp_path / "plan.json", time.time() + 300, sys.executable,
                             fake["env"], cli=True)
        for run in runs:
            result, status = serve_bench.read_run(run)
            assert status["rc"] == 0 and result["served_mode"] == "upstream", status
        late = [dict(runs[0], status=str(tmp_path / "late.status.json"))]
        serve_bench.run_plan(late, tmp_path / "plan2.json", time.time() + 5, sys.executable,
                             fake["env"])
        assert "deadline" in serve_bench.read_run(late[0])[1]["error"]
    finally:
        st = s.stop()
    assert st["clean_exit"] and st["leftover"] == []


def test_driver_runs_vllms_own_benchmark_code(fake, tmp_path):
    """The driver with vLLM 0.33.0's vllm/benchmarks/serve.py (the patched tree) against the
    fake server: its random dataset over the checkpoint tokenizer, streamed requests, and the
    result JSON it saves, whose keys the rows read."""
    if not (patched_python.PATCHED / ".ok").is_file():
        patched_python._skip_or_fail("build/patched missing: run `make patched`")
    sys.path.insert(0, str(REPO / "tools"))
    from ckptgen import tokenizer as tok
    ck = tmp_path / "ck"
    ck.mkdir()
    tok.write_for_config(ck, json.loads(CONFIG.read_text()))
    port = serve_proc.free_port()
    s = serve_proc.Server("upstream", [sys.executable, "-m", "vllm.entrypoints.cli.main",
                                       "serve", str(ck), "--port", str(port),
                                       "--served-model-name", "m"],
                          dict(fake["env"], DEEPINFER_DISABLE="all"), tmp_path / "s.log",
                          f"http://127.0.0.1:{port}")
    s.start()
    try:
        assert s.wait_healthy(30)["healthy"]
        name = serve_bench.result_name(64, 8, 4)
        run = dict(args=serve_bench.bench_args(
            served_name="m", tokenizer=str(ck), host="127.0.0.1", port=port, input_len=64,
            output_len=8, concurrency=4, prompts=8, result_dir=str(tmp_path)),
            result=str(tmp_path / name), log=str(tmp_path / "b.log"),
            status=str(tmp_path / "b.status.json"), cap=120.0)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
        env.update(PYTHONPATH=str(patched_python.PATCHED), CUDA_VISIBLE_DEVICES="")
        serve_bench.run_plan([run], tmp_path / "plan.json", time.time() + 240, sys.executable,
                             env)
        result, status = serve_bench.read_run(run)
        assert status["rc"] == 0, (status, Path(run["log"]).read_text()[-3000:])
    finally:
        s.stop()
    row = serve_bench.bench_row(mode="upstream", model="m", graphs=False, input_len=64,
                                output_len=8, concurrency=4, prompts=8, result=result,
                                status=status)
    assert row["passed"] and result["completed"] == 8 and result["max_concurrency"] == 4
    for k in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p99",
              "output_tok_s"):
        assert row[k] is not None and row[k] > 0, k
    # vLLM counts the BOS its server adds out of the prompt; the server saw 64 tokens each
    assert result["total_input_tokens"] == 8 * 64
    assert result["total_output_tokens"] == 8 * 8


def test_bench_row_from_vllms_result_keys():
    res = {"completed": 16, "failed": 0, "duration": 12.5, "num_prompts": 16,
           "max_concurrency": 4, "output_throughput": 163.84, "total_token_throughput": 1474.5,
           "request_throughput": 1.28, "p50_ttft_ms": 40.1234, "p99_ttft_ms": 88.0,
           "p50_tpot_ms": 12.0, "p99_tpot_ms": 14.5, "p50_itl_ms": 11.9, "p99_itl_ms": 30.25,
           "median_ttft_ms": 40.1234}
    row = serve_bench.bench_row(mode="a100", model="v41-tput", graphs=True, input_len=1024,
                                output_len=128, concurrency=4, prompts=16, result=res,
                                status={"rc": 0, "seconds": 13.0}, result_file="x.json")
    assert row["kernel"] == "serve" and row["variant"] == "a100"
    assert row["shape"] == dict(model="v41-tput", input_len=1024, output_len=128,
                                concurrency=4, cuda_graphs=True)
    assert (row["ttft_ms_p50"], row["ttft_ms_p99"], row["tpot_ms_p50"], row["tpot_ms_p99"],
            row["itl_ms_p99"], row["output_tok_s"]) == (40.123, 88.0, 12.0, 14.5, 30.25, 163.84)
    assert row["passed"] and row["error"] is None and row["bench_result"] is res
    # a median where the percentile list lacks 50; failed requests fail the row
    res2 = {k: v for k, v in res.items() if k != "p50_ttft_ms"}
    res2.update(completed=14, failed=2)
    row2 = serve_bench.bench_row(mode="a100", model="m", graphs=False, input_len=1,
                                 output_len=1, concurrency=4, prompts=16, result=res2,
                                 status={"rc": 0})
    assert row2["ttft_ms_p50"] == 40.123 and not row2["passed"]
    assert row2["error"] == "14 of 16 requests completed, 2 failed"
    row3 = serve_bench.bench_row(mode="a100", model="m", graphs=False, input_len=1,
                                 output_len=1, concurrency=1, prompts=4, result=None,
                                 status={"rc": 124, "error": "stopped after 5 s"})
    assert not row3["passed"] and row3["output_tok_s"] is None and "stopped" in row3["error"]


def test_request_counts_reach_each_concurrency():
    for plan in ("full", "quick"):
        for i, o in serve_bench.SHAPES:
            for c in serve_bench.CONCURRENCY:
                n = serve_bench.num_prompts(plan, i, o, c)
                assert n >= c, (plan, i, o, c)
                assert n <= serve_bench.num_prompts("full", i, o, c)
    # 8K prompts at concurrency 64: one round, not two
    assert serve_bench.num_prompts("full", 8192, 256, 64) == 64


def test_stop_escalates_past_an_ignored_sigint(tmp_path):
    code = ("import signal, time, os\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "pid = os.fork()\nwhile True: time.sleep(0.1)\n")
    s = serve_proc.Server("x", [sys.executable, "-c", code], dict(os.environ),
                          tmp_path / "x.log", "http://127.0.0.1:9")
    s.start()
    time.sleep(0.5)
    s.note_pids()
    assert len(serve_proc.sid_pids(s.proc.pid)) == 2
    st = s.stop(sigint_wait=1.0, sigterm_wait=5.0, linger=1.0)
    assert st["signals"] == ["SIGINT", "SIGTERM"] and not st["clean_exit"]
    assert st["exit_code"] == -signal.SIGTERM
    # the forked child ignores SIGINT too and lives on: listed, then killed
    assert len(st["leftover"]) == 1 and "import signal" in st["leftover"][0]["cmdline"]
    assert s.kill_leftovers() == []
    assert serve_proc.sid_pids(s.proc.pid) == []


def test_wait_healthy_reports_a_silent_server(tmp_path):
    s = serve_proc.Server("x", [sys.executable, "-c", "import time; time.sleep(30)"],
                          dict(os.environ), tmp_path / "x.log",
                          f"http://127.0.0.1:{serve_proc.free_port()}")
    s.start()
    info = s.wait_healthy(1.5, poll=0.2)
    assert not info["healthy"] and "did not answer 200" in info["error"]
    assert s.stop(linger=0.5)["clean_exit"]


def test_memory_returned_rules():
    before = dict(used_mib=500, apps={}, source="t")
    seq = iter([dict(used_mib=2500, apps={11: 1000}, source="t"),
                dict(used_mib=600, apps={}, source="t")])
    m = serve_proc.memory_returned(before, lambda: next(seq), {11}, False, settle=10)
    assert m["returned"] and m["checked"] == ["pids", "total"] and m["after_used_mib"] == 600
    # beside another server only the pids count; no reading at all: not judged
    m = serve_proc.memory_returned(before, lambda: dict(used_mib=9000, apps={12: 1}, source="t"),
                                   {11}, True, settle=0)
    assert m["returned"] and m["checked"] == ["pids"]
    m = serve_proc.memory_returned(before, lambda: dict(used_mib=9000, apps={11: 1},
                                                        source="t"), {11}, True, settle=0)
    assert m["returned"] is False and m["held_by_its_pids"] == {11: 1}
    m = serve_proc.memory_returned(None, lambda: None, {11}, False, settle=0)
    assert m["returned"] is None and m["checked"] is None
    # over the tolerance in total
    m = serve_proc.memory_returned(before, lambda: dict(used_mib=500 + 257, apps=None,
                                                        source="t"), set(), False, settle=0)
    assert m["returned"] is False and m["checked"] == ["total"]


def test_serve_chart_series():
    import charts
    rows = [dict(kernel="serve", variant=v, shape=dict(model="m", input_len=1024,
                                                       output_len=128, concurrency=c,
                                                       cuda_graphs=True),
                 output_tok_s=10.0 * c + (v == "a100"), ttft_ms_p50=5.0, tpot_ms_p50=None)
            for v in ("a100", "upstream") for c in (16, 1, 4)]
    d = charts.serve_series(rows)
    assert d[(1024, 128)]["output_tok_s"][("a100", True)] == [(1, 11.0), (4, 41.0),
                                                              (16, 161.0)]
    assert "tpot_ms_p50" not in d[(1024, 128)]


# --------------------------------------------------------------------------- vLLM's parsers
_PARSE_PROBE = r"""
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.platforms import current_platform
current_platform.device_type = "cpu"   # no GPU here: the engine arguments' defaults ask
bench, server = json.loads(sys.argv[1])
p = FlexibleArgumentParser()
add_cli_args(p)
b = vars(p.parse_args(bench))
s = vars(make_arg_parser(FlexibleArgumentParser()).parse_args(server))
plain = (str, int, float, bool, list, type(None))
keep = lambda d: {k: v for k, v in d.items() if isinstance(v, plain)}
cc = s.get("compilation_config")
seen = dict(cc_mode=str(getattr(cc, "mode", cc)), cc_graphs=str(getattr(cc, "cudagraph_mode", cc)))
print(json.dumps(dict(bench=keep(b), server=dict(keep(s), **seen))))
"""


def test_arguments_parse_with_vllms_own_parsers(tmp_path):
    """The `vllm bench serve` and `vllm serve` arguments serve.py passes exist in vLLM 0.33.0
    and mean what serve.py wants."""
    bench = serve_bench.bench_args(served_name="v41-tput", tokenizer="/ck", host="127.0.0.1",
                                   port=8123, input_len=8192, output_len=256, concurrency=64,
                                   prompts=64, result_dir="/tmp/r")
    args = serve.parse_args(["--quick", "--checkpoint", "/ck"])
    server = serve.server_argv(args, Path("/ck"), "v41-tput", 8124, 0.283)[4:]
    probe = tmp_path / "probe.py"
    probe.write_text(_PARSE_PROBE)
    out = patched_python.run_json([str(probe), json.dumps([bench, server])], env={},
                                  timeout=300)
    b, s = out["bench"], out["server"]
    assert (b["dataset_name"], b["random_input_len"], b["random_output_len"]) == \
        ("random", 8192, 256)
    assert (b["num_prompts"], b["max_concurrency"], b["port"], b["endpoint"]) == \
        (64, 64, 8123, "/v1/completions")
    assert b["save_result"] and b["result_dir"] == "/tmp/r" and b["ignore_eos"]
    assert b["result_filename"] == "bench-i8192-o256-c64.json"
    assert b["metric_percentiles"] == "50,90,99" and b["temperature"] == 0.0
    assert b["tokenizer"] == "/ck" and b["served_model_name"] == "v41-tput"
    assert (s["model_tag"], s["port"], s["served_model_name"]) == ("/ck", 8124, ["v41-tput"])
    assert s["language_model_only"] is True and s["enable_prefix_caching"] is False
    assert (s["max_num_batched_tokens"], s["max_num_seqs"], s["max_model_len"]) == \
        (CHUNK, serve.MAX_NUM_SEQS, serve.MAX_MODEL_LEN)
    # the eager form keeps vLLM's JIT warmup: compilation mode NONE and no CUDA graphs
    # through the compilation config, not --enforce-eager (which turns the warmup off)
    assert s["enforce_eager"] is False and s["enable_chunked_prefill"] is True
    assert s["cc_mode"] in ("0", "CompilationMode.NONE"), s["cc_mode"]
    assert s["cc_graphs"] in ("NONE", "CUDAGraphMode.NONE"), s["cc_graphs"]
    assert s["kv_cache_memory_bytes"] == int(serve.KV_CACHE_GIB * (1 << 30))
    assert abs(s["gpu_memory_utilization"] - 0.283) < 1e-9 and s["seed"] == 0
    graphs = serve.server_argv(serve.parse_args(["--checkpoint", "/ck"]), Path("/ck"), "m",
                               1, 0.85)
    assert "--enforce-eager" not in graphs and "--compilation-config" not in graphs
