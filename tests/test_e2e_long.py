"""The long-context step on CPU: benchmarks/e2e/e2e.py --steps long / long_reference and
benchmarks/e2e/run.py --task long with stand-ins for vLLM (tests/long_fakes.py).

What is checked: the engines and run.py arguments each flag set plans (parsed by run.py's own
parser, so e2e.py's commands are ones run.py accepts); the request plan, its order and the
context it needs against the configs' max_position_embeddings; the decode window and TTFTs of
serve_timed on a chunked-prefill stand-in, and its timeout; the stage split; the results
rows' schema from run.py's real output; partial results when an engine is stopped (in
process, and a run.py process killed with SIGKILL); the agreement rows' alignment with the
fp32 reference; the long configs through make_checkpoint's config path, the reference
forward, and vLLM's own model classes (reduced sizes, same topology)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
CONFIGS = REPO / "benchmarks" / "e2e" / "configs"
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))
sys.path.insert(0, str(TESTS))
import e2e  # noqa: E402
import long_fakes as F  # noqa: E402
import make_checkpoint as mk  # noqa: E402

run = F.run_module()
SMALL_LENS = ["--long-lens", "4096,16384", "--long-agree-len", "4096"]


@pytest.fixture
def fakes(monkeypatch):
    F.install(monkeypatch, run)
    return monkeypatch


# --------------------------------------------------------------------------- e2e stand-in
def _fake_sh(started: list, serve=True, kill=None, ref_shift=0):
    """A stand-in for e2e.sh: checkpoints are a folder with config.json; run.py --task long
    runs run.long_task on the stand-in LLM (``serve``) or writes a bare complete output;
    ``kill`` = (model, mode, prompt length) stops that engine there (rc 124, as sh returns
    for a run past its limit); reference.py writes the rows the stand-in LLM gives,
    ``ref_shift`` positions off."""
    def sh(cmd, log, env=None, timeout=None):
        cmd = [str(c) for c in cmd]
        if e2e._left() < 30:
            return 125
        if "make_checkpoint.py" in " ".join(cmd):
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text("{}")
            started.append(("ckpt", out.name, cmd))
            return 0
        if "reference.py" in " ".join(cmd):
            out = Path(cmd[cmd.index("--out") + 1])
            n = int(cmd[cmd.index("--lens") + 1])
            (p,) = run.prompts([n], 1000, 0)
            at = [min(i + ref_shift, n - 1) for i in range(1, n)]
            rows = [[p[j], F.logprob_of(j), F.logprob_of(j)] for j in at]
            json.dump(dict(mode="fp32_reference", prompts=[dict(prompt_len=n, prompt=rows,
                                                                generated=[])]), open(out, "w"))
            started.append(("ref", out.name, cmd))
            return 0
        args = run.parse_args(cmd[2:])
        name = Path(args.model).name.rsplit("-", 1)[0]
        eager = args.eager or args.jit_warmup
        started.append(("long", (name, args.mode, "eager" if eager else "graphs"), args))
        if not serve:
            run.write_json(args.out, dict(mode=args.mode, complete=True, rows=[], plan=[]))
            return 0
        kill_at = kill[2] if kill and kill[:2] == (name, args.mode) else None
        try:
            F.serve(run, cmd[2:], kill_at=kill_at)
        except F.Killed:
            return 124
        return 0
    return sh


def _main(monkeypatch, tmp_path, argv, sh, work="w"):
    monkeypatch.setattr(e2e, "sh", sh)
    monkeypatch.setattr(e2e, "_DEADLINE", [float("inf")])
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--work", str(tmp_path / work),
                                      "--results", str(tmp_path / "r"), *argv])
    assert e2e.main() == 0
    (res,) = (tmp_path / "r").glob("*.json")
    out = json.load(open(res))
    res.unlink()
    return out, res.name


def _long(started):
    return [(tag, args) for kind, tag, args in started if kind == "long"]


# --------------------------------------------------------------------------- planning
def test_default_flags_plan_four_eager_engines(fakes, tmp_path):
    """--steps ckpt,long: V4.1 and V4, a100 and upstream, eager, every length at batch 1 and
    4, the agreement at 128K, the 1M prefill profiled; dense-routing checkpoints of the long
    configs; a results file of its own."""
    started: list = []
    _, name = _main(fakes, tmp_path, ["--steps", "ckpt,long"], _fake_sh(started, serve=False))
    ckpts = [(n, c) for k, n, c in started if k == "ckpt"]
    assert sorted(n for n, _ in ckpts) == ["v4-long-fp8", "v41-long-mxfp8"]
    for n, c in ckpts:
        text = json.load(open(CONFIGS / n.rsplit("-", 1)[0] / "config.json"))
        text = text.get("text_config", text)
        assert c[c.index("--set") + 1] == f"num_experts_per_tok={text['n_routed_experts']}"
    jobs = _long(started)
    assert [t for t, _ in jobs] == [("v41-long", "a100", "eager"), ("v41-long", "upstream", "eager"),
                                    ("v4-long", "a100", "eager"), ("v4-long", "upstream", "eager")]
    for _, a in jobs:
        # eager, vLLM's JIT warmup kept (run.py --jit-warmup, not --eager)
        assert a.task == "long" and a.jit_warmup and not a.eager
        assert a.gpu_mem == e2e.LONG_GPU_MEM
        assert a.long_lens == [131072, 524288, 1048000] == a.b4_lens
        assert (a.agree_len, a.profile_len, a.decode_tokens, a.chunk) == (131072, 1048000, 64, 8192)
        assert a.max_num_seqs == 4
        # b4 at 1M: 4 x 1,048,000 prompt tokens, the earliest request decodes through 512 steps
        assert a.max_model_len == 1048832
    assert name.startswith("gpu-") and "-e2e-long-" in name


def test_flag_sets_select_engines_and_requests(fakes, tmp_path):
    started: list = []
    sh = _fake_sh(started, serve=False)
    _main(fakes, tmp_path, ["--steps", "long", "--quick", "--long-models", "v41-long",
                            "--long-modes", "a100"], sh, work="w1")
    ((tag, a),) = _long(started)
    assert tag == ("v41-long", "a100", "eager")
    assert a.b4_lens == [131072] and a.decode_tokens == e2e.LONG_QUICK_DECODE
    started.clear()
    _main(fakes, tmp_path, ["--steps", "long", "--long-modes", "upstream,a100", "--long-forms",
                            "eager,graphs", "--long-lens", "1048000,131072",
                            "--long-b4-lens", "", "--long-profile-len", "0",
                            "--long-agree-len", "0"], sh, work="w2")
    jobs = _long(started)
    # eager before graphs, then model, then mode in the order given
    assert [t for t, _ in jobs] == [(n, m, f) for f in ("eager", "graphs")
                                    for n in e2e.LONG_MODELS for m in ("upstream", "a100")]
    for (_, _, form), a in jobs:
        assert a.jit_warmup == (form == "eager") and not a.eager
        assert a.long_lens == [131072, 1048000] and a.b4_lens == []
        assert (a.agree_len, a.profile_len) == (0, 0)
        assert a.max_model_len == 1048320   # 1,048,000 + 64 decode + 2, up to 256


def test_profile_batch_reaches_run_py_and_profiles_the_batch_of_four(fakes, tmp_path):
    """--long-profile-batch 4: run.py gets --profile-batch 4 and profiles the batch of four at
    --long-profile-len (its stage rows name batch 4); the default stays batch 1; a length
    not served as a batch of four is refused."""
    started: list = []
    out, _ = _main(fakes, tmp_path, ["--steps", "long", "--long-models", "v41-long",
                                     "--long-modes", "a100", "--long-lens", "4096,16384",
                                     "--long-b4-lens", "16384", "--long-agree-len", "0",
                                     "--long-profile-len", "16384", "--long-profile-batch", "4"],
                   _fake_sh(started))
    ((_, a),) = _long(started)
    assert a.profile_batch == 4 and a.profile_len == 16384
    stage_batches = {r["shape"]["batch"] for r in out["rows"]
                     if r["kernel"] == "long_context_stage"}
    assert stage_batches == {4}
    profiled = {(r["shape"]["prompt_len"], r["shape"]["batch"]) for r in out["rows"]
                if r["kernel"] == "long_context" and r.get("profiled")}
    assert profiled == {(16384, 4)}
    started.clear()
    _main(fakes, tmp_path, ["--steps", "long", "--long-models", "v41-long", "--long-modes",
                            "a100", "--long-lens", "4096", "--long-agree-len", "0"],
          _fake_sh(started, serve=False), work="w2")
    assert _long(started)[0][1].profile_batch == 1
    with pytest.raises(SystemExit):
        _main(fakes, tmp_path, ["--steps", "long", "--long-lens", "4096,16384",
                                "--long-b4-lens", "4096", "--long-profile-len", "16384",
                                "--long-profile-batch", "4"], _fake_sh([], serve=False),
              work="w3")


@pytest.mark.parametrize("argv", [["--long-modes", "a10"], ["--long-models", "v5-long"],
                                  ["--long-forms", "cudagraphs"], ["--long-b4-lens", "4096"],
                                  ["--long-profile-len", "4096"], ["--long-lens", ""]])
def test_bad_flags_are_refused(fakes, tmp_path, argv):
    with pytest.raises(SystemExit):
        _main(fakes, tmp_path, ["--steps", "long", *argv], _fake_sh([], serve=False))


def test_plan_order_and_context():
    """Shortest first; per length: batch 1, the agreement, batch 4; max_tokens covers the
    decode window after every prefill of the batch; the longest context fits the configs."""
    plan = run.long_plan([1048000, 131072, 524288], [131072, 1048000], 131072, 64, 8192)
    assert [(r["kind"], r["prompt_len"], r["batch"]) for r in plan] == [
        ("timed", 131072, 1), ("agree", 131072, 1), ("timed", 131072, 4),
        ("timed", 524288, 1), ("timed", 1048000, 1), ("timed", 1048000, 4)]
    assert [r["max_tokens"] for r in plan] == [66, 1, 64 + 64 + 2 + 2, 66, 66, 64 + 514 + 2]
    need = run.long_max_model_len(plan)
    assert need == 1048832 and need % 256 == 0
    for name in e2e.LONG_MODELS:
        cfg = mk.load_config(CONFIGS / name)
        assert cfg.need("max_position_embeddings") >= need
    # the agreement length need not be a timed one
    plan = run.long_plan([4096], [], 8192, 8, 8192)
    assert [(r["kind"], r["prompt_len"]) for r in plan] == [("timed", 4096), ("agree", 8192)]


def test_request_timeout_scales_with_prompt_tokens():
    assert run.request_timeout(0) == run.LONG_TIMEOUT_BASE_S
    assert run.request_timeout(2_000_000) == pytest.approx(run.LONG_TIMEOUT_BASE_S
                                                           + 2 * run.LONG_TIMEOUT_S_PER_MTOK)
    assert run.request_timeout(2_000_000, 42.0) == 42.0
    opts = dict(lens=[131072, 1048000], b4_lens=[131072], agree_len=131072, decode_tokens=64,
                request_timeout=None)
    want = e2e.LONG_START_S["graphs"] + sum(run.request_timeout(n) for n in
                                            (131072, 131072, 4 * 131072, 1048000))
    assert e2e.long_run_timeout("graphs", opts) == pytest.approx(want)


# --------------------------------------------------------------------------- run.py pieces
@pytest.mark.parametrize("batch,n", [(1, 20000), (4, 20000), (4, 3000)])
def test_serve_timed_ttft_and_pure_decode_window(fakes, batch, n):
    """TTFTs in arrival order (chunked prefill serves the batch one prompt after another),
    the decode window opens after the last prefill and holds steps x batch tokens."""
    llm = F.LLM(8192)
    ticks = iter(range(10**6))
    r = run.serve_timed(llm, [[1] * n] * batch, 16, 8192, 1e9, clock=lambda: next(ticks))
    assert r["error"] is None
    assert r["decode_tokens"] == 16 * batch and r["decode_tokens_per_s"] > 0
    assert 0 < r["ttft_s"] <= r["ttft_last_s"]
    if batch > 1 and n > 8192:
        assert r["ttft_s"] < r["ttft_last_s"]
    assert r["prefill_tokens_per_s"] == pytest.approx(batch * n / r["ttft_last_s"])
    assert llm.llm_engine.reqs == {}   # aborted once the window closed


def test_serve_timed_timeout_aborts_and_says_where(fakes):
    llm = F.LLM(8192)
    ticks = iter(range(0, 10**8, 10))   # 10 s per clock read
    r = run.serve_timed(llm, [[1] * 100000] * 2, 16, 8192, 60.0, clock=lambda: next(ticks))
    assert r["error"].startswith("timeout: 60 s passed with 0 of 2 requests")
    assert r["ttft_last_s"] is None and r["decode_tokens_per_s"] is None
    assert llm.llm_engine.reqs == {}


def test_serve_timed_profiles_until_the_first_token(fakes):
    llm, prof = F.LLM(8192), F.Profiler(run)
    r = run.serve_timed(llm, [[1] * 20000], 4, 8192, 1e9, prof=prof)
    assert (prof.starts, prof.stops) == (1, 1)
    assert r["stages"]["complete"] and r["stages"]["wall_s"] == r["ttft_s"]


def test_stage_split_sums_by_stage_and_overlap():
    assert [run.kernel_stage(n) for n, _ in F.KERNELS] == [
        "indexer_logits", "indexer_logits", "topk", "attention", "gemm", "gemm", "rest", "rest"]
    assert run.kernel_stage("topk_softplus_sqrt_kernel") == "rest"        # the MoE router's
    assert run.kernel_stage("_compress_sparse_attn_kernel") == "rest"     # a cache writer
    assert run.kernel_stage("_block_scores_kernel") == "topk"             # candidate blocks
    # two streams: b overlaps a; c after a gap
    ev = [("_logits_kernel", 0.0, 100.0), ("nvjet_gemm", 50.0, 150.0),
          ("_sparse_mla_prefill_kernel", 400.0, 500.0)]
    s = run.stage_split(ev, 600e-6)
    assert s["stages"]["indexer_logits"] == pytest.approx(100e-6)
    assert s["stages"]["gemm"] == pytest.approx(100e-6)
    assert s["kernel_s"] == pytest.approx(300e-6) and s["busy_s"] == pytest.approx(250e-6)
    assert s["idle_s"] == pytest.approx(350e-6)
    assert s["top_kernels"][0][1] in run.STAGES and len(s["top_kernels"]) == 3


def test_kv_figures_from_the_engine_and_the_log(fakes):
    import logging
    log = run.KvLog().install()
    try:
        lg = logging.getLogger("vllm.v1.core.kv_cache_utils")
        lg.info("%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: "
                "%.2fx", "GPU", f"{F.KV_TOKENS:,}", "1,048,832", 4.88)
        logging.getLogger("vllm.v1.worker.gpu_worker").info(
            "Available KV cache memory: %s GiB", "96.25")
    finally:
        logging.getLogger("vllm").removeHandler(log.handler)
    assert (log.tokens, log.available_gib) == (F.KV_TOKENS, 96.25)
    kv = run.kv_figures(F.LLM(8192), log)
    assert kv["kv_tokens"] == kv["log_kv_tokens"] == F.KV_TOKENS
    assert kv["num_gpu_blocks"] == F.KV_BLOCKS and kv["block_size"] == 256
    assert kv["available_gib"] == 96.0 and kv["worker"]["tensor_bytes"] == F.AVAILABLE_BYTES
    assert kv["worker"]["groups"] == [dict(spec="SimpleNamespace", layers=2, block_size=256,
                                           page_size_bytes=256 * 584)]


# --------------------------------------------------------------------------- results rows
def test_rows_schema_from_run_output(fakes, tmp_path):
    started: list = []
    out, _ = _main(fakes, tmp_path, ["--steps", "ckpt,long,long_reference", *SMALL_LENS],
                   _fake_sh(started))
    rows = out["rows"]
    long = [r for r in rows if r["kernel"] == "long_context"]
    # 4 engines x (4096 b1, 4096 b4, 16384 b1, 16384 b4) x (prefill, decode)
    assert len(long) == 4 * 4 * 2
    for r in long:
        assert set(r["shape"]) == {"model", "prompt_len", "batch", "phase", "cuda_graphs"}
        assert r["variant"] in e2e.LONG_MODES and r["error"] is None
        assert r["tokens_per_s"] > 0 and r["ttft_s"] > 0
        assert r["peak_gib"] == F.PEAK_ALLOCATED / F.GIB
        assert r["peak_reserved_gib"] == F.PEAK_RESERVED / F.GIB
        assert r["device_used_gib"] == (F.DEVICE_TOTAL - F.DEVICE_FREE) / F.GIB
        # device peak = torch's peak pool + what is outside torch, against vLLM's budget
        outside = (F.DEVICE_TOTAL - F.DEVICE_FREE - F.RESERVED_END) / F.GIB
        assert r["budget_gib"] == F.REQUESTED / F.GIB
        assert r["device_peak_gib"] == F.PEAK_RESERVED / F.GIB + outside
        assert r["over_budget_gib"] == r["device_peak_gib"] - F.REQUESTED / F.GIB
        assert r["profile_activation_gib"] == F.PROFILE_ACTIVATION / F.GIB
        assert r["new_segments_mib"] == [F.SEGMENT / 2 ** 20]
        assert (r["kv_tokens"], r["kv_num_gpu_blocks"], r["kv_block_size"]) == (
            F.KV_TOKENS, F.KV_BLOCKS, 256)
        assert r["kv_available_gib"] == 96.0 and r["run_complete"] is True
        assert r["max_model_len"] == 16384 + 256 and r["chunk"] == 8192
        assert r["max_num_seqs"] == run.LONG_MAX_SEQS
    dec = [r for r in long if r["shape"]["phase"] == "decode"]
    assert all(r["tokens"] == 64 * r["shape"]["batch"] for r in dec)
    assert all(r["timing"] == "engine steps after the last prefill" for r in dec)
    pre = {(r["shape"]["model"], r["variant"], r["shape"]["prompt_len"], r["shape"]["batch"]): r
           for r in long if r["shape"]["phase"] == "prefill"}
    assert pre[("v41-long", "a100", 16384, 1)]["profiled"] is True
    assert pre[("v41-long", "a100", 16384, 4)]["profiled"] is False
    stages = [r for r in rows if r["kernel"] == "long_context_stage"]
    assert len(stages) == 4 * (len(run.STAGES) + 1)
    one = {r["shape"]["stage"]: r for r in stages
           if (r["shape"]["model"], r["variant"]) == ("v4-long", "upstream")}
    assert set(one) == set(run.STAGES) | {"gpu_idle"}
    for st, us in F.STAGE_US.items():
        assert one[st]["seconds"] == pytest.approx(us / 1e6)
        assert [k[1] for k in one[st]["top_kernels"]] == [st] * len(one[st]["top_kernels"])
    assert sum(one[st]["share"] for st in run.STAGES) == pytest.approx(1.0)
    assert one["gpu_idle"]["shape"] == dict(model="v4-long", prompt_len=16384, batch=1,
                                            phase="prefill", stage="gpu_idle", cuda_graphs=False)
    # agreement of the last positions: the modes agree, and so does the aligned reference
    agree = [r for r in rows if r["kernel"] == "long_agreement"]
    assert {(r["shape"]["model"], r["variant"]) for r in agree} == {
        (n, "a100_vs_upstream") for n in e2e.LONG_MODELS}
    assert all(r["top1_agree"] == 1.0 and r["detail"]["prompt_positions"] == 2048
               and r["shape"]["positions"] == [4096 - 2048, 4095] for r in agree)
    refs = [r for r in rows if r["kernel"] == "long_vs_fp32_reference"]
    assert len(refs) == 4 and all(r["max_abs_dlogprob"] == 0.0 for r in refs)
    checks = [r for r in rows if r["kernel"] == "long_reference_check"]
    assert {r["shape"]["model"] for r in checks} == set(e2e.LONG_MODELS)
    assert all(r["passed"] for r in checks)
    # the references ran after every engine, at the agreement length
    kinds = [k for k, _, _ in started if k != "ckpt"]
    assert kinds == ["long"] * 4 + ["ref"] * 2
    assert out["meta"]["gpu"] == "NVIDIA H200" and out["meta"]["commit"] == "abc1234"
    assert out["meta"]["failed_runs"] == []


def test_reference_one_position_off_is_seen(fakes, tmp_path):
    """The reference's rows are taken at the engine's positions: shifted by one, they differ."""
    out, _ = _main(fakes, tmp_path, ["--steps", "ckpt,long,long_reference", "--long-models",
                                     "v41-long", "--long-b4-lens", "", *SMALL_LENS],
                   _fake_sh([], ref_shift=1))
    refs = [r for r in out["rows"] if r["kernel"] == "long_vs_fp32_reference"]
    assert refs and all(r["max_abs_dlogprob"] > 0 and r["top1_agree"] < 0.01 for r in refs)


def test_agreement_keeps_the_last_positions(fakes):
    args = run.parse_args(["--model", "m", "--mode", "a100", "--task", "long", "--out", "o",
                           "--agree-last", "100"])
    a = run.long_agree(F.LLM(8192), 1000, args, 5000)
    (p,) = a["prompts"]
    (want,) = run.prompts([5000], 1000, 0)
    assert p["prompt_len"] == 5000 and p["first_position"] == 4900 and len(p["prompt"]) == 100
    assert p["prompt"][0] == [want[4900], F.logprob_of(4900), F.logprob_of(4900)]
    assert p["prompt"][-1][0] == want[4999]


# --------------------------------------------------------------------------- stopped runs
def test_partial_results_of_a_stopped_engine(fakes, tmp_path):
    """An engine stopped while prefilling its 16K prompt (rc 124): the 4K requests it wrote
    are in the results; the run is listed as not finished, with what is on disk; the next
    invocation leaves the partial output alone unless --long-rerun."""
    started: list = []
    argv = ["--steps", "long", "--long-models", "v41-long", *SMALL_LENS]
    out, _ = _main(fakes, tmp_path, argv, _fake_sh(started, kill=("v41-long", "a100", 16384)))
    got = {(r["variant"], r["shape"]["prompt_len"], r["shape"]["batch"], r["shape"]["phase"])
           for r in out["rows"] if r["kernel"] == "long_context"}
    a100 = {k[1:] for k in got if k[0] == "a100"}
    assert a100 == {(4096, b, ph) for b in (1, 4) for ph in ("prefill", "decode")}
    assert {k[1:] for k in got if k[0] == "upstream"} == {
        (n, b, ph) for n in (4096, 16384) for b in (1, 4) for ph in ("prefill", "decode")}
    assert all(r["run_complete"] is (r["variant"] == "upstream") for r in out["rows"]
               if r["kernel"] == "long_context")
    # the agreement request at 4K came before the stop
    assert any(r["kernel"] == "long_agreement" for r in out["rows"])
    assert out["meta"]["failed_runs"] == [
        "v41-long/a100/long-eager (rc 124; 2 of 4 timed requests on disk)"]
    started.clear()
    out, _ = _main(fakes, tmp_path, argv, _fake_sh(started))
    assert _long(started) == []
    assert out["meta"]["failed_runs"][0].startswith("v41-long/a100/long-eager (partial output")
    out, _ = _main(fakes, tmp_path, argv + ["--long-rerun"], _fake_sh(started))
    assert [t for t, _ in _long(started)] == [("v41-long", "a100", "eager"),
                                              ("v41-long", "upstream", "eager")]
    assert out["meta"]["failed_runs"] == []


HARNESS = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import long_fakes as F
    run = F.run_module()
    F.install(F.Direct(), run)
    F.serve(run, ["--model", "m", "--mode", "a100", "--task", "long", "--out", sys.argv[2],
                  "--long-lens", "4096", "16384", "65536", "--b4-lens", "4096",
                  "--agree-len", "0", "--profile-len", "16384", "--decode-tokens", "8"],
            hang_at=65536)
""")


def test_killed_run_py_leaves_its_finished_requests(tmp_path):
    """run.py's long task in a process killed with SIGKILL while it serves the 64K prompt: its
    output is whole JSON with the three requests before it and "complete": false."""
    out = tmp_path / "long.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.Popen([sys.executable, "-c", HARNESS, str(TESTS), str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        rows = []
        while time.time() < deadline and p.poll() is None:
            if out.exists():
                rows = json.load(open(out)).get("rows", [])
                if len(rows) == 3:
                    break
            time.sleep(0.2)
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.5)   # it is in the 64K prefill now, sleeping
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    r = json.load(open(out))
    assert r["complete"] is False
    assert [(q["prompt_len"], q["batch"]) for q in r["rows"]] == [(4096, 1), (4096, 4),
                                                                   (16384, 1)]
    assert r["stages"]["prompt_len"] == 16384 and r["rows"][2]["profiled"]
    assert [q["prompt_len"] for q in r["plan"]] == [4096, 4096, 16384, 65536]
    assert not list(tmp_path.glob("long.json.tmp*"))


# --------------------------------------------------------------------------- configs
def _layer_names(table, i):
    return {n for n, _, _ in table if n.startswith(f"layers.{i}.")}


def test_v41_long_config_has_the_real_geometry_and_roles():
    cfg = mk.load_config(CONFIGS / "v41-long")
    c = cfg.text
    assert (c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["sliding_window"],
            c["index_topk"], c["index_n_heads"], c["index_head_dim"]) == (
        4096, 64, 512, 128, 512, 64, 128)
    assert (c["q_lora_rank"], c["o_lora_rank"], c["o_groups"], c["hc_mult"]) == (1280, 1024, 8, 4)
    ratios, kv = c["compress_ratios"], set(c["kv_source_layer_ids"])
    idx, cand = set(c["index_source_layer_ids"]), c["candidate_source_layer_id"]
    assert {1, 2} <= set(ratios)
    # KV sharing: a layer of each ratio that reads another layer's KV
    assert {ratios[i] for i in range(len(ratios)) if ratios[i] and i not in kv} == {1, 2}
    masked = [j for j in idx if j > cand]
    assert len(masked) >= 2 and cand in kv
    t = mk.checkpoint_table(cfg, "mxfp8")
    for j in masked:   # index-only sources: no K of their own (they read the candidate's)
        names = _layer_names(t, j)
        assert f"layers.{j}.attn.indexer.wq_b.weight" in names
        assert f"layers.{j}.attn.indexer.wk.weight" not in names
    assert f"layers.{cand}.attn.indexer.wk.weight" in _layer_names(t, cand)
    dense = mk.load_config(CONFIGS / "v41-long", {"num_experts_per_tok": c["n_routed_experts"]})
    assert dense.need("num_experts_per_tok") == 8


def test_v4_long_config_has_c4a_and_c128a_layers():
    cfg = mk.load_config(CONFIGS / "v4-long")
    c = cfg.text
    assert (c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["sliding_window"],
            c["index_topk"], c["q_lora_rank"], c["o_lora_rank"]) == (
        4096, 64, 512, 128, 512, 1024, 1024)
    ratios = c["compress_ratios"][:c["num_hidden_layers"]]
    assert ratios.count(4) >= 2 and ratios.count(128) >= 2
    t = mk.checkpoint_table(cfg, "fp8")
    for i, r in enumerate(ratios):
        names = _layer_names(t, i)
        assert (f"layers.{i}.attn.indexer.wq_b.weight" in names) == (r == 4)
        assert (f"layers.{i}.attn.compressor.ape" in names) == (r > 0)


V41_TINY = dict(vocab_size=512, hidden_size=512, num_attention_heads=8, o_groups=8,
                q_lora_rank=128, o_lora_rank=64, sliding_window=8, index_topk=16,
                index_n_heads=4, moe_intermediate_size=128, num_experts_per_tok=8,
                candidate_topk_blocks=8, candidate_block_size=4)


def test_reference_forward_runs_the_v41_long_topology(tmp_path):
    """reference.py (the long_reference step) on the v41-long roles at tiny sizes, past
    every selection threshold (top-k 16 of ratio-2 and ratio-1 entries, 8 candidate blocks of
    4): finite logprobs for every position, and causal (a changed last token leaves the rows
    before it)."""
    import torch
    import reference as R
    cfg = mk.load_config(CONFIGS / "v41-long", V41_TINY)
    # bf16: the reference reads every format through the same dequantized fp32 weights
    mk.write_checkpoint(cfg, "bf16", tmp_path / "ck", seed=0, threads=1, log=lambda *a: None)
    ref = R.Reference(R.Model(tmp_path / "ck"))
    toks = torch.randint(100, 400, (120,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        rows = ref.logprob_rows(toks)
        toks2 = toks.clone()
        toks2[-1] = (toks2[-1] + 1) % 400
        rows2 = ref.logprob_rows(toks2)
    assert len(rows) == 119
    assert all(-1e3 < lp <= 0 for _, lp, _ in rows)
    assert [r[:2] for r in rows[:-1]] == [r[:2] for r in rows2[:-1]]


def test_vllm_loads_the_long_configs(tmp_path):
    """vLLM 0.33.0's own model classes (patched tree, faked SM80) load reduced-size checkpoints
    of both long configs (same layer roles) with no parameter left unset and no tensor
    dropped: tests/checkpoint_load_probe.py with these cases."""
    from test_vllm_import import _need_tree, _probe_env
    _need_tree()
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[2])
        import checkpoint_load_probe as P
        small = {"num_attention_heads": 8, "o_lora_rank": 256, "moe_intermediate_size": 256}
        P.CASES = [("v41-long", "mxfp8", small), ("v4-long", "fp8", small)]
        sys.argv = [sys.argv[0], sys.argv[1]]
        sys.exit(P.main())
    """)
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "w"), str(TESTS)],
                       env=_probe_env(), cwd=REPO, capture_output=True, text=True, timeout=900)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    res = json.loads(lines[-1])
    assert res["_setup"]["ok"], res["_setup"]
    for case in ("v41-long/mxfp8", "v4-long/fp8"):
        c = res[case]
        assert c["ok"], (case, c.get("error"), c.get("trace"))
        assert c["params_not_loaded"] == [] and c["tensors_not_received"] == []
        assert c["attention_class"] == ("DeepinferAmpereV41Attention" if case.startswith("v41")
                                        else "DeepinferAmpereV4Attention")


# --------------------------------------------------------------------------- chart data
def test_chart_series_of_the_long_rows(fakes, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import charts
    out, _ = _main(fakes, tmp_path, ["--steps", "ckpt,long", "--long-models", "v4-long",
                                     *SMALL_LENS], _fake_sh([]))
    rows = out["rows"]
    d = charts.long_series([r for r in rows if r["kernel"] == "long_context"],
                           [r for r in rows if r["kernel"] == "long_context_stage"])
    key = ("v4-long", "a100", False)
    assert [n for n, _ in d["ttft"][key]] == [4096, 16384]
    assert [n for n, _ in d["decode"][key + (4,)]] == [4096, 16384]
    assert d["peak"][key + (1,)] == [(4096, 3.0), (16384, 3.0)]
    assert d["stages"][key + (16384,)]["attention"] == pytest.approx(300e-6)
    pytest.importorskip("matplotlib")
    res = tmp_path / "res.json"
    json.dump(out, open(res, "w"))
    written = charts.chart(res, tmp_path / "charts")
    assert any(p.name.endswith("-long-context.png") for p in written)
