"""The graph-mode step on CPU (benchmarks/e2e/graph_modes.py, engine_plan.py, run_engine.py)
with stand-ins for vLLM (tests/graph_fakes.py).

What is checked: the engines it plans and their commands (parsed by run_engine.py's and
run.py's own parsers) and environments; the rows, the resolved mode and the downgrade line,
the runtime modes per decode batch, the output check against eager and its verdicts, the
recommendation; the --deadline plan (an engine starts only when its estimate fits, order
kept, the rest left for the next invocation) and the bundle that carries finished engines
to a new work folder; run_engine.py itself in a subprocess on a stand-in vLLM; and vLLM
0.33.0's own resolution of the modes and capture sizes, and the CUDA-graph support our
builders and upstream's report (the patched tree, CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))
sys.path.insert(0, str(TESTS))
import e2e  # noqa: E402
import engine_plan as ep  # noqa: E402
import graph_fakes as G  # noqa: E402
import graph_modes as gm  # noqa: E402
import patched_python  # noqa: E402

MODEL = "v41-tput"


def _main(monkeypatch, tmp_path, argv, sh, budget=float("inf"), work="w"):
    monkeypatch.setattr(e2e, "_left", sh.left_fn(budget))
    monkeypatch.setattr(e2e, "sh", sh)   # the checkpoint goes through e2e.sh
    rc = gm.main(["--work", str(tmp_path / work), "--results", str(tmp_path / "r"),
                  "--skip-overlay-check", *argv], sh=sh)
    assert rc == 0
    (res,) = (tmp_path / "r").glob("*.json")
    out = json.loads(res.read_text())
    res.unlink()
    return out, res.name


def _rows(out, **shape):
    return [r for r in out["rows"] if all(r["shape"].get(k) == v for k, v in shape.items())]


# --------------------------------------------------------------------------- the plan
def test_plan_eager_then_modes_then_capped(tmp_path):
    plan = gm.engines(MODEL, "a100", gm.GRAPH_MODES, list(gm.CAPTURES))
    assert [(e.info["cudagraph_mode"], e.info["capture_sizes"]) for e in plan] == [
        ("NONE", None)] + [(m, c) for c in ("default", "max64") for m in gm.GRAPH_MODES]
    assert len({e.tag for e in plan}) == len({e.cache for e in plan}) == 7
    work = tmp_path / "w"
    base = dict(os.environ, DEEPINFER_DISABLE="all", DEEPINFER_COMMIT="abc1234")
    base.pop("TRITON_CACHE_DIR", None)
    for e in plan:
        opts, args = G.parse_engine_command(ep.command(e, work, work / "ck"))
        assert (args.mode, args.task, args.batches, args.prefill_lens) == (
            "a100", "tput", [1, 8, 32], [1024, 8192])
        assert args.max_model_len == 33280 and args.gpu_mem == 0.85 and args.max_num_seqs == 64
        assert args.eager == e.eager and tuple(opts.check_lens) == gm.CHECK_LENS
        assert opts.check_repeat == (2 if e.eager else 1)
        cc = opts.compilation_config
        if e.eager:
            assert cc is None
        else:
            assert cc["cudagraph_mode"] == e.info["cudagraph_mode"]
            assert cc.get("max_cudagraph_capture_size") == (
                64 if e.info["capture_sizes"] == "max64" else None)
        env = ep.engine_env(e, work, base)
        assert "DEEPINFER_DISABLE" not in env and env["DEEPINFER_COMMIT"] == "abc1234"
        assert env["VLLM_CACHE_ROOT"] == str(work / "cache" / e.cache)
        assert env["TRITON_CACHE_DIR"] == str(work / "cache" / "triton")
    # --quick: vLLM's capture sizes only; unknown names are refused
    assert gm.parse_args(["--quick"]).capture_list == ["default"]
    for bad in (["--modes", "FULLISH"], ["--captures", "max32"], ["--modes", ""]):
        with pytest.raises(SystemExit):
            gm.parse_args(bad)


def test_plan_table_estimates(tmp_path):
    plan = gm.engines(MODEL, "a100", ["PIECEWISE"], ["default"])
    t = ep.plan_table(plan[1:], tmp_path)
    assert [x["start"] for x in t] == ["cold_a100"]
    assert t[0]["estimate_s"] == ep.START_S["cold_a100"] + ep.MEASURE_S + ep.CHECK_S
    # after the eager engine has run here, the sm_80 kernels are in the shared Triton cache
    assert [x["start"] for x in ep.plan_table(plan, tmp_path)] == ["eager", "cold_a100_cached"]
    (tmp_path / "cache" / "triton" / "k").mkdir(parents=True)
    assert ep.plan_table(plan[1:], tmp_path)[0]["start"] == "cold_a100_cached"
    assert ep.parse_start_s("cold=240, warm=30")["cold"] == 240.0
    with pytest.raises(ValueError):
        ep.parse_start_s("hot=1")
    (tmp_path / "cache" / plan[1].cache / "torch_compile_cache" / "k").mkdir(parents=True)
    assert ep.plan_table(plan, tmp_path)[1]["start"] == "warm"
    plan[1].mode = "default"
    (tmp_path / "cache" / plan[1].cache / "torch_compile_cache" / "k").rmdir()
    assert ep.plan_table(plan, tmp_path)[1]["start"] == "cold"


# --------------------------------------------------------------------------- rows
def _speed(tag, args, opts, env, row):
    """FULL modes decode fastest at small batches, PIECEWISE slowest, eager slower still;
    the capped captures as fast as the default ones."""
    if row["phase"] == "prefill":
        return 20000.0
    mode = (opts.compilation_config or {}).get("cudagraph_mode", "NONE")
    per = {"FULL_AND_PIECEWISE": 400.0, "FULL_DECODE_ONLY": 410.0, "PIECEWISE": 300.0,
           "FULL": 400.0, "NONE": 60.0}[mode]
    return per * row["batch"] ** 0.8


def test_rows_verdicts_and_recommendation(monkeypatch, tmp_path):
    sh = G.FastSh(speed=_speed)
    out, name = _main(monkeypatch, tmp_path, [], sh)
    assert name.startswith("h200-") and "-e2e-graph-modes-abc1234" in name
    assert len(sh.started) == 7 and not out["meta"]["failed_runs"]
    rows = out["rows"]
    assert all(r["kernel"] == "graph_mode" for r in rows)
    assert len(rows) == 7 * 5   # 3 decode batches + 2 prefill lengths per engine
    for r in rows:
        s = r["shape"]
        assert set(s) == {"model", "cudagraph_mode", "capture_sizes", "phase", "batch",
                          "prompt_len"}
        assert r["variant"] == ("eager" if r["eager"] else s["cudagraph_mode"])
        assert r["resolved_mode"] == ("NONE" if r["eager"] else s["cudagraph_mode"])
        if s["phase"] == "decode":
            assert r["decode_tokens_per_s"] == r["tokens_per_s"] > 0
            want = {"NONE": "NONE", "PIECEWISE": "PIECEWISE"}.get(s["cudagraph_mode"], "FULL")
            assert r["ran_as"] == [want], (s, r["ran_as"])
        else:
            assert r["decode_tokens_per_s"] is None and r["ran_as"] is None
        assert r["outputs_match_eager"] is (None if r["eager"] else True)
        if not r["eager"]:
            assert r["match_rule"] == "identical" and r["agreement"]["identical"]
            assert r["capture_sizes_resolved"][-1] == (
                64 if s["capture_sizes"] == "max64" else 128)
    rec = out["meta"]["recommendation"]
    assert (rec["cudagraph_mode"], rec["batches"]) == ("FULL_DECODE_ONLY", [1, 8, 32])
    assert rec["vllm_default"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert rec["vllm_default"]["ratio"] == pytest.approx(410 / 400)
    assert out["meta"]["eager_floor"]["identical"] is True


def test_full_mode_downgrade_is_recorded(monkeypatch, tmp_path):
    out, _ = _main(monkeypatch, tmp_path, ["--modes", "FULL", "--quick"], G.FastSh())
    (r,) = _rows(out, cudagraph_mode="FULL", batch=1, phase="decode")
    assert r["variant"] == "FULL" and r["resolved_mode"] == "FULL_AND_PIECEWISE"
    assert len(r["downgrade_log"]) == 1 and "setting cudagraph_mode" in r["downgrade_log"][0]
    (p,) = _rows(out, cudagraph_mode="FULL_AND_PIECEWISE") or [None]
    assert p is None   # only the mode asked for


def test_outputs_that_differ_are_not_recommended(monkeypatch, tmp_path):
    """A mode whose check lands outside the allowance fails the check and is not recommended
    even when it decodes fastest; one inside the eager engine's own spread passes."""
    def check(tag, opts):
        if tag.endswith(gm.EAGER):   # the eager engine repeats itself only to 0.3 logprob
            first = G.check_rows(opts.check_lens)
            return dict(first, repeats=[G.check_rows(opts.check_lens, shift=0.3)["prompts"]])
        if "PIECEWISE-default" in tag and "FULL_AND" not in tag:
            return G.check_rows(opts.check_lens, shift=0.28)   # past e2e.TOL, inside the floor
        if "FULL_DECODE_ONLY" in tag:
            return G.check_rows(opts.check_lens, shift=2.0)    # corrupted
        return G.check_rows(opts.check_lens)

    out, _ = _main(monkeypatch, tmp_path, ["--quick"], G.FastSh(speed=_speed, check=check))
    by = {r["shape"]["cudagraph_mode"]: r for r in _rows(out, batch=1, phase="decode")}
    assert by["FULL_DECODE_ONLY"]["outputs_match_eager"] is False
    assert by["FULL_DECODE_ONLY"]["agreement"]["max_abs_dlogprob"] == pytest.approx(2.0)
    assert by["PIECEWISE"]["outputs_match_eager"] is True
    assert "eager floor" in by["PIECEWISE"]["match_rule"]
    assert by["FULL_AND_PIECEWISE"]["outputs_match_eager"] is True
    assert out["meta"]["eager_floor"]["max_abs_dlogprob"] == pytest.approx(0.3)
    assert out["meta"]["recommendation"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"


def test_match_verdict_rules():
    tol = dict(min_top1_agree=0.98, max_abs_dlogprob=0.25)
    pair = dict(identical=False, top1_agree=0.95, max_abs_dlogprob=0.30)
    assert gm.match_verdict(pair, None, tol)[0] is False
    floor = dict(identical=False, top1_agree=0.94, max_abs_dlogprob=0.36)
    assert gm.match_verdict(pair, floor, tol)[0] is True
    assert gm.match_verdict(dict(pair, top1_agree=0.93), floor, tol)[0] is False
    assert gm.match_verdict(dict(pair, max_abs_dlogprob=0.37), floor, tol)[0] is False
    assert gm.match_verdict(dict(pair, identical=True), None, tol) == (True, "identical")
    assert gm.match_verdict(None, floor, tol)[0] is None


# --------------------------------------------------------------------------- deadline
def test_deadline_starts_only_what_fits_and_resumes(monkeypatch, tmp_path):
    """The stand-in's starts take what engine_plan estimates. The eager engine and one graph
    engine (its sm_80 kernels in the Triton cache by then) fit; the next would not (half of
    its estimate is left), so it and every later engine wait. A second invocation on a new machine (a new work folder)
    resumes from the bundle and runs only the rest, its first graph engine a cold a100 one
    (the new machine's Triton cache is empty)."""
    est = {k: ep.estimate_s(k, gm.engines(MODEL, "a100", ["PIECEWISE"], ["default"])[1])
           for k in ep.START_S}
    sh = G.FastSh(speed=_speed, costs=dict(ep.START_S), measure=ep.MEASURE_S + ep.CHECK_S)
    bundle = tmp_path / "out" / "gm-bundle.json"
    budget = est["eager"] + 1.5 * est["cold_a100_cached"]
    out, _ = _main(monkeypatch, tmp_path, ["--quick", "--bundle", str(bundle)], sh,
                   budget=budget)
    assert sh.started == [f"{MODEL}-graph-a100-eager",
                          f"{MODEL}-graph-a100-FULL_AND_PIECEWISE-default"]
    nd = out["meta"]["failed_runs"]
    assert len(nd) == 2 and all("not started: the deadline" in x for x in nd)
    assert "FULL_DECODE_ONLY" in nd[0] and "the cold_a100_cached start" in nd[0]
    assert {r["shape"]["cudagraph_mode"] for r in out["rows"]} == {"NONE", "FULL_AND_PIECEWISE"}
    saved = json.loads(bundle.read_text())["engines"]
    assert sorted(saved) == sorted(sh.started)
    plan = {t["tag"]: t["start"] for t in out["meta"]["plan"]}
    assert plan[f"{MODEL}-graph-a100-FULL_AND_PIECEWISE-default"] == "cold_a100_cached"

    sh2 = G.FastSh(speed=_speed)
    out2, _ = _main(monkeypatch, tmp_path, ["--quick", "--resume", str(bundle), "--bundle",
                                            str(bundle)], sh2, budget=1000, work="w2")
    plan2 = {t["tag"]: t["start"] for t in out2["meta"]["plan"]}
    assert plan2[f"{MODEL}-graph-a100-FULL_DECODE_ONLY-default"] == "cold_a100"
    assert plan2[f"{MODEL}-graph-a100-PIECEWISE-default"] == "cold_a100_cached"
    assert sh2.started == [f"{MODEL}-graph-a100-FULL_DECODE_ONLY-default",
                           f"{MODEL}-graph-a100-PIECEWISE-default"]
    assert not out2["meta"]["failed_runs"] and len(out2["meta"]["resumed"]) == 2
    assert {r["shape"]["cudagraph_mode"] for r in out2["rows"]} == {"NONE", *gm.GRAPH_MODES}
    assert all(r["outputs_match_eager"] in (None, True) for r in out2["rows"])


def test_failed_engine_is_reported_and_the_plan_goes_on(monkeypatch, tmp_path):
    sh = G.FastSh(fail={f"{MODEL}-graph-a100-FULL_DECODE_ONLY-default"})
    out, _ = _main(monkeypatch, tmp_path, ["--quick"], sh)
    (nd,) = out["meta"]["failed_runs"]
    assert "FULL_DECODE_ONLY" in nd and "rc 1" in nd
    assert len(sh.started) == 4


# --------------------------------------------------------------------------- run_engine.py
def _fake_env(tmp_path) -> dict:
    root = G.write_fake_vllm(tmp_path / "fakevllm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env.update(PYTHONPATH=str(root), E2E_ENGINE_LOCK=str(tmp_path / "lock"),
               CUDA_VISIBLE_DEVICES="")
    return env


def test_run_engine_records_the_resolved_mode_check_and_dispatch(tmp_path):
    """run_engine.py and run.py unchanged, on the stand-in vLLM: a request for FULL is
    lowered with vLLM's warning, which is kept; the check ran at a batch of 12 and the
    decode batches replayed full graphs."""
    ck = tmp_path / "ck"
    G.write_checkpoint(ck)
    out = tmp_path / "o.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "e2e" / "run_engine.py"),
           "--compilation-config", json.dumps({"cudagraph_mode": "FULL",
                                               "max_cudagraph_capture_size": 64}),
           "--check-lens", "7", "33", "300", "--check-gen", "4", "--",
           "--model", str(ck), "--mode", "a100", "--task", "tput", "--out", str(out),
           "--batches", "1", "8", "--prefill-lens", "1024", "--decode-tokens", "8"]
    r = subprocess.run(cmd, env=_fake_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    eng = res["engine"]
    assert eng["graph"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert eng["graph"]["max_capture_size"] == 64 and eng["graph"]["capture_sizes"][-1] == 64
    assert eng["graph"]["min_cg_support"] == "UNIFORM_BATCH"
    assert {g["support"] for g in eng["graph"]["cg_support"]} == {"UNIFORM_BATCH", "ALWAYS"}
    assert any("setting cudagraph_mode=FULL_AND_PIECEWISE" in ln for ln in eng["log"])
    assert gm.downgrade_lines(eng["log"])
    assert [p["prompt_len"] for p in eng["check"]["prompts"]] == [7, 33, 300]
    assert len(eng["check"]["prompts"][0]["generated"]) == 4
    assert res["engine_options"]["compilation_config"]["cudagraph_mode"] == "FULL"
    from run_engine import dispatch_modes
    assert dispatch_modes(eng["dispatch"], 1) == dispatch_modes(eng["dispatch"], 8) == ["FULL"]
    assert dispatch_modes(eng["dispatch"], 3) == ["FULL"]        # the check's decode
    assert [(t["phase"], t["batch"]) for t in res["rows"]] == [
        ("decode", 1), ("decode", 8), ("prefill", 1)]
    assert all(t["tokens_per_s"] > 0 for t in res["rows"])
    assert res["env"]["DEEPINFER_EMULATE_CAPABILITY"] == "8.0"


def test_main_through_run_engine_on_the_stand_in(monkeypatch, tmp_path):
    """graph_modes.py's engines through e2e.sh and run_engine.py (stand-in vLLM): the eager
    reference and one graph mode; the check compares equal and the rows carry it."""
    work = tmp_path / "w"
    G.write_checkpoint(work / f"{MODEL}-mxfp8")
    env = _fake_env(tmp_path)
    for k in ("PYTHONPATH", "E2E_ENGINE_LOCK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(k, env[k])
    monkeypatch.setattr(e2e, "_DEADLINE", [float("inf")])
    assert gm.main(["--work", str(work), "--results", str(tmp_path / "r"), "--quick",
                    "--modes", "PIECEWISE", "--skip-overlay-check"]) == 0
    (res,) = (tmp_path / "r").glob("*.json")
    out = json.loads(res.read_text())
    assert not out["meta"]["failed_runs"], out["meta"]["failed_runs"]
    (r,) = _rows(out, cudagraph_mode="PIECEWISE", batch=8)
    assert r["resolved_mode"] == "PIECEWISE" and r["ran_as"] == ["PIECEWISE"]
    assert r["outputs_match_eager"] is True and r["match_rule"] == "identical"
    (e,) = _rows(out, cudagraph_mode="NONE", batch=1, phase="decode")
    assert e["ran_as"] == ["NONE"] and e["outputs_match_eager"] is None
    assert out["meta"]["gpu"] == "NVIDIA H200" and out["meta"]["vllm"] == "0.33.0"


# --------------------------------------------------------------------------- vLLM itself
PROBE = r'''
import json, logging, sys, types
from vllm.config import CompilationConfig
from vllm.config.compilation import CompilationMode
from vllm.config.vllm import VllmConfig
from vllm.v1.attention.backend import AttentionCGSupport
sys.path.insert(0, sys.argv[1])
import run_engine

msgs = []
class Tap(logging.Handler):
    def emit(self, rec):
        msgs.append(rec.getMessage())
logging.getLogger("vllm").addHandler(Tap())
resolved = {}
for m in sys.argv[2].split(","):
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=m)
    cc.set_splitting_ops_for_v1(all2all_backend="naive")
    resolved[m] = cc.resolve_cudagraph_mode_and_sizes(
        AttentionCGSupport.UNIFORM_BATCH, "DeepinferAmpereV41MLASparseBackend", 1).name

def sizes(cap):
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_cudagraph_capture_size=cap)
    fake = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=False), compilation_config=cc,
        scheduler_config=types.SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=2048),
        uniform_decode_query_len=1, speculative_config=None, performance_mode="balanced",
        num_speculative_tokens=0, parallel_config=types.SimpleNamespace(tensor_parallel_size=1))
    VllmConfig._set_cudagraph_sizes(fake)
    return cc.cudagraph_capture_sizes

from vllm.deepinfer.attention import ampere_v41
from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLABackend
from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekSparseSWAFlashMLABackend
from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend
vc = types.SimpleNamespace(speculative_config=None, num_speculative_tokens=0)

def groups(backends):
    gs = [types.SimpleNamespace(backend=b, layer_names=["l"], kv_cache_spec=None)
          for b in backends]
    runner = types.SimpleNamespace(
        compilation_config=CompilationConfig(), vllm_config=vc,
        cudagraph_dispatcher=types.SimpleNamespace(cudagraph_mode=None, cudagraph_keys={}),
        _attn_group_iterator=lambda: iter(gs))
    return run_engine.worker_graph_info(types.SimpleNamespace(model_runner=runner))

ours = groups([ampere_v41.DeepinferAmpereV41MLASparseBackend,
               ampere_v41.DeepinferAmpereV41SparseSWABackend,
               ampere_v41.DeepinferAmpereV41IndexerBackend])
hopper = groups([DeepseekV4FlashMLABackend, DeepseekSparseSWAFlashMLABackend,
                 DeepseekV41IndexerBackend])
print(json.dumps(dict(resolved=resolved, warnings=[m for m in msgs if "cudagraph_mode" in m],
                      default_sizes=sizes(None), max64_sizes=sizes(64), ours=ours,
                      hopper=hopper)))
'''


def test_vllm_resolves_the_modes_and_sizes_and_builders_report_uniform_batch(tmp_path):
    """vLLM 0.33.0 (patched tree, CPU): against UNIFORM_BATCH the three modes run as asked
    and FULL is lowered to FULL_AND_PIECEWISE with the warning graph_modes.py looks for; the
    capture sizes of run.py's engine (64 sequences, 2,048-token chunks) are 1, 2, 4, 8 ...
    128 by default and end at 64 capped; the Ampere path's V4.1 builders report
    UNIFORM_BATCH, upstream's FlashMLA ones ALWAYS, and the indexer's builder UNIFORM_BATCH
    for both, so both paths resolve against UNIFORM_BATCH."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = patched_python.run_json([str(probe), str(REPO / "benchmarks" / "e2e"),
                                   ",".join(gm.KNOWN_MODES)], env={}, timeout=300)
    assert out["resolved"] == {"FULL_AND_PIECEWISE": "FULL_AND_PIECEWISE",
                               "FULL_DECODE_ONLY": "FULL_DECODE_ONLY",
                               "PIECEWISE": "PIECEWISE", "FULL": "FULL_AND_PIECEWISE"}
    (w,) = out["warnings"]
    assert gm.downgrade_lines([w]) == [w]
    assert out["default_sizes"] == [1, 2, 4] + list(range(8, 129, 8))
    assert out["max64_sizes"] == [1, 2, 4] + list(range(8, 65, 8))
    ours = {g["builder"]: g["support"] for g in out["ours"]["cg_support"]}
    assert ours == {"DeepseekV4SparseMLAMetadataBuilder": "UNIFORM_BATCH",
                    "DeepinferAmpereV41SparseSWAMetadataBuilder": "UNIFORM_BATCH",
                    "DeepseekV32IndexerMetadataBuilder": "UNIFORM_BATCH"}
    hopper = {g["builder"]: g["support"] for g in out["hopper"]["cg_support"]}
    assert hopper == {"DeepseekV4FlashMLAMetadataBuilder": "ALWAYS",
                      "DeepseekSparseSWAFlashMLAMetadataBuilder": "ALWAYS",
                      "DeepseekV32IndexerMetadataBuilder": "UNIFORM_BATCH"}
    assert out["ours"]["min_cg_support"] == out["hopper"]["min_cg_support"] == "UNIFORM_BATCH"


def test_chart_series():
    rows = [dict(kernel="graph_mode", eager=False, outputs_match_eager=True,
                 decode_tokens_per_s=300.0,
                 shape=dict(cudagraph_mode="PIECEWISE", capture_sizes="default",
                            phase="decode", batch=1)),
            dict(kernel="graph_mode", eager=False, outputs_match_eager=False,
                 decode_tokens_per_s=900.0,
                 shape=dict(cudagraph_mode="FULL_DECODE_ONLY", capture_sizes="max64",
                            phase="decode", batch=8)),
            dict(kernel="graph_mode", eager=True, outputs_match_eager=None,
                 decode_tokens_per_s=50.0,
                 shape=dict(cudagraph_mode="NONE", capture_sizes=None, phase="decode",
                            batch=1)),
            dict(kernel="graph_mode", eager=False, decode_tokens_per_s=None,
                 shape=dict(cudagraph_mode="PIECEWISE", capture_sizes="default",
                            phase="prefill", batch=1))]
    assert gm.graph_series(rows) == {"PIECEWISE / default": {1: 300.0},
                                     "FULL_DECODE_ONLY / max64 (outputs differ)": {8: 900.0},
                                     "eager": {1: 50.0}}
