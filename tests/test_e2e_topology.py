"""The two-GPU step on CPU (benchmarks/e2e/topology.py, run_topology.py, rank_audit.py).

What is checked: the PP2 splits (vllm.deepinfer.pp_split's nearest split to vLLM's even one,
which the Ampere path refuses); the engines the step plans and their commands, parsed by
run_topology.py's, run.py's and run_spec.py's own parsers; run_topology's environment (NVLink
multicast kept off, the pipeline split, the workers' import path), vLLM keyword arguments and
the ranks' audits merged; run_topology.py around run.py in a subprocess on a stand-in vLLM
whose LLM builds the worker extension per rank and answers collective_rpc by method name; and
the rows and results file from a stand-in e2e.sh. Nothing here runs on two GPUs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
E2E = REPO / "benchmarks" / "e2e"
sys.path.insert(0, str(E2E))
import graph_fakes as G  # noqa: E402
import run_topology as rt  # noqa: E402
import topology as topo  # noqa: E402
from pp_split_probe import topology as config_topology  # noqa: E402
from vllm.deepinfer import pp_split as ps  # noqa: E402

RUN = G.e2e_run()


def _run_spec():
    """run_spec imported against benchmarks/e2e/run.py (benchmarks/run.py is also "run")."""
    prev = sys.modules.get("run")
    sys.modules["run"] = RUN
    try:
        import run_spec
    finally:
        if prev is not None:
            sys.modules["run"] = prev
        else:
            sys.modules.pop("run", None)
    return run_spec


# --------------------------------------------------------------------------- PP2 splits
@pytest.mark.parametrize("model", sorted(topo.PP2_PARTITION))
def test_pp2_splits_keep_groups_whole_and_are_the_nearest(model):
    hf = SimpleNamespace(**config_topology(model))
    L = hf.num_hidden_layers
    even = [L - L // 2, L // 2]   # what get_pp_indices builds at PP2 (tests/test_pp_split.py)
    with pytest.raises(ps.PipelineSplitError):
        ps.check(hf, even)
    sizes = [int(x) for x in topo.PP2_PARTITION[model].split(",")]
    ps.check(hf, sizes)
    assert sizes == ps.nearest_split(L, even, ps.groups(ps.links(hf)))


def test_v4_needs_no_split():
    hf = SimpleNamespace(**config_topology("v4-mini"))
    ps.check(hf, [3, 3])
    assert "v4-mini" not in topo.PP2_PARTITION


# --------------------------------------------------------------------------- the plan
def _opts(**kw):
    base = dict(parts=list(topo.PARTS), topologies=list(topo.DEFAULT_TOPOLOGIES), models=["v41-mini",
                "v4-mini"], modes=list(topo.MODES), quick=False, parallel=2)
    return {**base, **kw}


def _parse(e):
    cmd = [str(c) for c in e.cmd]
    assert cmd[1].endswith("run_topology.py"), cmd[:3]
    args, rest = rt.parse_args(cmd[2:])
    runner = _run_spec() if args.runner == "spec" else RUN
    return args, runner.parse_args(rest)


def test_plan_order_tags_and_commands(tmp_path):
    work = tmp_path / "w"
    es = topo.plan(work, _opts())
    tags = [e.tag for e in es]
    assert len(tags) == len(set(tags))
    assert not any("-agree-" in t for t in tags)   # e2e.py's writer reads *-agree-*.json
    parts = [e.part for e in es]
    assert parts == sorted(parts, key=["agree", "reference", "graphs", "nocompile", "tput",
                                       "spec"].index)
    n = dict(agree=2 * 2 * 4, graphs=2 * 2 * 4, reference=2, nocompile=2, tput=2 * 4, spec=2 * 2 * 2)
    assert {p: parts.count(p) for p in n} == n
    for e in es:
        if e.form == "reference":
            assert e.cmd[1].endswith("reference.py") and "--device" in e.cmd
            continue
        args, r = _parse(e)
        t = topo.TOPOLOGIES[e.topo]
        assert (args.tp, args.pp) == (t["tp"], t["pp"]), e.tag
        assert Path(r.out) == work / f"{e.tag}.json"
        assert r.mode == e.mode
        want_split = topo.PP2_PARTITION.get(e.model) if t["pp"] > 1 else None
        assert args.pp_partition == want_split, e.tag
        assert args.row_shard_min_rows == (2 if e.topo == "tp2rs" else None), e.tag
        assert not args.no_custom_all_reduce and args.nccl == {}
        assert args.rank_audit == (e.mode == "a100" and e.form in ("eager", "nocompile")), e.tag
        if e.form == "eager":
            assert r.eager and r.task == "agree"
        elif e.form == "graphs":
            assert not r.eager and not r.jit_warmup
        elif e.form == "nocompile":
            assert r.jit_warmup and not r.eager and e.topo == "tp2" and not r.audit
        elif e.form == "tput":
            assert r.task == "tput" and e.alone and e.model == "v41-tput"
        elif e.form in ("spec", "plain"):
            assert args.runner == "spec" and e.alone and e.topo in ("tp2", "pp2")
            assert r.form == "eager"
            if e.form == "spec":
                assert (r.method, r.k, r.role) == ("dspark", 5, "spec")
                assert e.model == "v41-dspark-mini"
            else:
                assert r.role == "plain" and [Path(s) for s in r.score] == list(e.scored)
                assert e.model == "v41-mini"


def test_plan_selection_and_quick(tmp_path):
    es = topo.plan(tmp_path, _opts(parts=["agree", "tput"], topologies=["tp2"], modes=["a100"],
                                   quick=True))
    assert [e.tag for e in es] == ["topo-tp2-v41-mini-a100-eager", "topo-tp2-v4-mini-a100-eager",
                                   "topo-tp2-v41-tput-a100-tput"]
    _, r = _parse(es[0])
    assert r.lens == list(topo.QUICK_LENS) and r.gen == 16
    _, r = _parse(es[-1])
    assert r.batches == [1, 8, 32] and r.prefill_lens == [1024, 8192]
    assert es[0].estimate_s == topo.ESTIMATE_S["eager"] - topo.QUICK_SAVES_S


def test_nccl_topologies(tmp_path):
    es = topo.plan(tmp_path, _opts(parts=["graphs"], topologies=["tp2nccl", "tp2ring"],
                                   models=["v41-mini"], modes=["a100"]))
    (a, _), (b, _) = (_parse(e) for e in es)
    assert a.no_custom_all_reduce and a.nccl == {}
    assert b.no_custom_all_reduce and b.nccl == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
    assert topo.shape_of("tp2ring", "v41-mini") == dict(
        tp=2, pp=1, custom_all_reduce=False, nccl_env=topo.RING_SIMPLE)
    env = rt.environment(b, {})
    assert env["NCCL_ALGO"] == "Ring" and env["NCCL_PROTO"] == "Simple"
    assert set(topo.AGAINST) == set(topo.TOPOLOGIES)


def test_cli_refuses_unknown_names():
    with pytest.raises(SystemExit):
        topo.parse_args(["--topologies", "tp4"])
    with pytest.raises(SystemExit):
        topo.parse_args(["--parts", "agree,serve"])


# --------------------------------------------------------------------------- run_topology
def test_run_topology_arguments():
    a, rest = rt.parse_args(["--tp", "2", "--", "--model", "m", "--mode", "a100", "--out", "o"])
    assert (a.tp, a.pp, a.runner) == (2, 1, "run") and rest[:2] == ["--model", "m"]
    for bad in (["--pp", "2", "--pp-partition", "5"], ["--pp", "2", "--pp-partition", "0,10"],
                ["--tp", "2", "--", "--audit"], ["--rank-audit", "--", "--audit"],
                ["--rank-audit", "--runner", "spec", "--", "--form", "nocompile"], ["--tp", "0"],
                ["--nccl-env", "ALGO=Ring"], ["--nccl-env", "NCCL_NVLS_ENABLE=1"]):
        with pytest.raises(SystemExit):
            rt.parse_args(bad)
    # at TP2 the spec runner's own in-process audit sees no model code: the rank audit is it
    rt.parse_args(["--tp", "2", "--rank-audit", "--runner", "spec", "--", "--form", "nocompile"])


def test_environment_keeps_multicast_off_and_sets_the_split():
    a, _ = rt.parse_args(["--pp", "2", "--pp-partition", "6,4", "--rank-audit"])
    env = rt.environment(a, {"PYTHONPATH": "/x", "NCCL_NVLS_ENABLE": "0",
                             "VLLM_PP_LAYER_PARTITION": "5,5"})
    assert env["VLLM_PP_LAYER_PARTITION"] == "6,4"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(E2E), "/x"]
    assert env["E2E_RANK_AUDIT"] == "1"
    for k, v in rt.NO_MULTICAST.items():
        assert env[k] == v
    # a caller's own value is kept; a stale split and audit switch are removed
    a, _ = rt.parse_args(["--tp", "2"])
    env = rt.environment(a, {"NCCL_NVLS_ENABLE": "0", "VLLM_PP_LAYER_PARTITION": "5,5",
                             "E2E_RANK_AUDIT": "1"})
    assert "VLLM_PP_LAYER_PARTITION" not in env and "E2E_RANK_AUDIT" not in env
    assert rt.llm_kwargs(a, {"model": "m"}) == dict(
        model="m", tensor_parallel_size=2, pipeline_parallel_size=1,
        worker_extension_cls="rank_audit.RankAudit", distributed_executor_backend="mp")
    a, _ = rt.parse_args(["--tp", "2", "--row-shard-min-rows", "2"])
    assert rt.llm_kwargs(a, {"attention_config": {"x": 1}})["attention_config"] == dict(
        x=1, indexer_tp_shard_min_rows=2)
    a, _ = rt.parse_args([])
    assert "distributed_executor_backend" not in rt.llm_kwargs(a, {})


def test_topology_engines_keep_multicast_off(tmp_path, monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    (e,) = topo.plan(tmp_path, _opts(parts=["tput"], topologies=["tp2"], modes=["upstream"]))
    env = topo.engine_env(tmp_path, e, {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    assert {k: env[k] for k in rt.NO_MULTICAST} == rt.NO_MULTICAST
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache" / e.tag)


def _audit(kernels, failed=(), serve=()):
    return dict(triton_kernels=[dict(name=k) for k in kernels], cuda_ops=[dict(op="_C::x")],
                deep_gemm_calls={}, tilelang_compiles={}, compiles_by_phase={"load": 3},
                tilelang_by_phase={}, region_ops={"draft": {"_C::x": 2}},
                serve_compiles=[dict(name=s) for s in serve], serve_compiles_outside=[],
                warmup_seconds={"vllm_jit_warmup": 1.5}, failed=list(failed),
                zero_compile=not serve, libraries={})


def test_merge_audits():
    m = rt.merge_audits([_audit(["a", "b"]), _audit(["a"], failed=["op y"], serve=["k"]), None])
    assert m["ranks"] == 2 and m["zero_compile"] is False
    assert [(t["name"], t["rank"]) for t in m["triton_kernels"]] == [("a", 0), ("b", 0), ("a", 1)]
    assert m["failed"] == ["rank 1: op y"]
    assert m["compiles_by_phase"] == {"load": 6} and m["region_ops"] == {"draft": {"_C::x": 4}}
    assert rt.merge_audits([_audit(["a"]), _audit(["a"])])["zero_compile"] is True
    assert rt.merge_audits([None, None]) is None


FAKE_TOPOLOGY_LLM = '''

_OneGpuLLM = LLM


class LLM(_OneGpuLLM):
    """The stand-in with ranks: the worker extension mixed into one worker per rank (vLLM's
    WorkerWrapperBase), init_worker_extension called on each, collective_rpc by name."""

    def __init__(self, *a, tensor_parallel_size=1, pipeline_parallel_size=1,
                 worker_extension_cls="", distributed_executor_backend=None, **kw):
        super().__init__(*a, **kw)
        import importlib
        import json
        mod, _, name = worker_extension_cls.rpartition(".")
        ext = getattr(importlib.import_module(mod), name)
        base = self.worker
        cls = type("Worker", (ext,), {})
        self.workers = []
        for r in range(tensor_parallel_size * pipeline_parallel_size):
            w = cls()
            w.__dict__.update(vars(base))
            w.rank = w.local_rank = r
            ext.init_worker_extension(w)
            self.workers.append(w)
        with open(os.environ["FAKE_LLM_RECORD"], "w") as f:
            json.dump(dict(tp=tensor_parallel_size, pp=pipeline_parallel_size,
                           ext=worker_extension_cls, backend=distributed_executor_backend,
                           env={k: os.environ.get(k) for k in (
                               "VLLM_PP_LAYER_PARTITION", "NCCL_NVLS_ENABLE",
                               "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                               "E2E_RANK_AUDIT")}), f)

    def collective_rpc(self, method, args=(), **kw):
        if isinstance(method, str):
            return [getattr(w, method)(*args) for w in self.workers]
        return [method(w, *args) for w in self.workers]

    def apply_model(self, fn):
        return [fn(types.SimpleNamespace(named_modules=lambda: iter(())))]
'''


def test_run_topology_around_run_py_on_the_stand_in(tmp_path):
    """run_topology.py and run.py unchanged, on a stand-in vLLM with two ranks: vLLM gets the
    topology and the extension, the workers the split and the multicast switches; the output
    carries the topology, both ranks, both rank audits and their merge; the recorders were
    switched to "serve" around the requests."""
    root = G.write_fake_vllm(tmp_path / "fakevllm")
    init = root / "vllm" / "__init__.py"
    init.write_text(init.read_text() + textwrap.dedent(FAKE_TOPOLOGY_LLM))
    ck = tmp_path / "ck"
    G.write_checkpoint(ck)
    out, rec = tmp_path / "o.json", tmp_path / "llm.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")
           and k not in rt.NO_MULTICAST and k != "VLLM_PP_LAYER_PARTITION"}
    env.update(PYTHONPATH=str(root), E2E_ENGINE_LOCK=str(tmp_path / "lock"),
               CUDA_VISIBLE_DEVICES="", FAKE_LLM_RECORD=str(rec), TRITON_INTERPRET="1")
    cmd = [sys.executable, str(E2E / "run_topology.py"), "--pp", "2", "--pp-partition", "6,4",
           "--rank-audit", "--", "--model", str(ck), "--mode", "a100", "--task", "agree",
           "--out", str(out), "--eager", "--lens", "7", "33", "--gen", "4",
           "--kv-cache-gib", "1"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(rec.read_text())
    assert (got["tp"], got["pp"], got["backend"]) == (1, 2, "mp")
    assert got["ext"] == "rank_audit.RankAudit"
    assert got["env"] == {"VLLM_PP_LAYER_PARTITION": "6,4", "NCCL_NVLS_ENABLE": "0",
                          "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                          "E2E_RANK_AUDIT": "1"}
    res = json.loads(out.read_text())
    assert res["topology"] == dict(tp=1, pp=2, pp_partition="6,4", world_size=2,
                                   row_shard_min_rows=None, custom_all_reduce=True, nccl_env={})
    # the stand-in has no PrefillRowShard and no process groups: nothing counted or wrapped
    assert res["rank_counters"] == [{"collectives_wrapped": 0}] * 2
    assert [x["rank"] for x in res["ranks"]] == [0, 1] and all(x["audit"] for x in res["ranks"])
    assert len(res["rank_audit"]) == 2 and res["audit"]["ranks"] == 2
    assert res["audit"]["zero_compile"] is True
    assert [p["prompt_len"] for p in res["prompts"]] == [7, 33]
    assert "audit_main_process" not in res   # run.py's own audit was not asked for


# --------------------------------------------------------------------------- rows
def _agree_out(lens, shift=0.0, audit=None, mode="a100"):
    r = dict(G.check_rows(lens, shift), mode=mode, gpu="NVIDIA H200", torch="t", triton="tr",
             vllm="0.33.0", commit="abc1234", load_seconds=10.0,
             ranks=[dict(rank=0, tp_rank=0, pp_rank=0, layers=[0, 6]),
                    dict(rank=1, tp_rank=0, pp_rank=1, layers=[6, 10])])
    if audit is not None:
        r["audit"], r["rank_audit"] = audit, [audit, audit]
    return r


class _StandInSh:
    """e2e.sh's signature: writes each engine's output (no engine runs)."""

    def __init__(self, work, shifts):
        self.work, self.shifts, self.ran = work, shifts, []

    def __call__(self, cmd, log, env=None, timeout=None):
        cmd = [str(c) for c in cmd]
        Path(log).write_text("stand-in\n")
        if "make_checkpoint.py" in " ".join(cmd):
            G.write_checkpoint(Path(cmd[cmd.index("--out") + 1]))
            return 0
        out = Path(cmd[cmd.index("--out") + 1])
        self.ran.append(out.stem)
        lens = (7, 300)
        if cmd[1].endswith("reference.py"):
            r = _agree_out(lens, 0.01, mode="fp32")
        elif "--task" in cmd and cmd[cmd.index("--task") + 1] == "tput":
            r = dict(_agree_out(lens), rows=[dict(phase="decode", batch=1, prompt_len=512,
                                                  tokens_per_s=50.0, seconds=1.0)])
        else:
            a100 = "a100" in out.stem
            audit = rt.merge_audits([_audit(["k"]), _audit(["k"])]) if a100 and (
                "eager" in out.stem or "nocompile" in out.stem) else None
            r = _agree_out(lens, self.shifts.get(out.stem, 0.0), audit)
            if "--row-shard-min-rows" in cmd:
                r["rank_counters"] = [dict(row_shard_exchanges=5), dict(row_shard_exchanges=5)]
        out.write_text(json.dumps(r))
        return 0


def test_main_rows_and_results_file(tmp_path, monkeypatch):
    import e2e
    monkeypatch.setattr(e2e, "_DEADLINE", [float("inf")])
    work = tmp_path / "w"
    shifts = {"topo-tp2-v41-mini-upstream-eager": 0.001, "topo-tp2-v41-mini-a100-graphs": 0.002}
    sh = _StandInSh(work, shifts)
    assert topo.main(["--work", str(work), "--results", str(tmp_path / "r"), "--models",
                      "v41-mini", "--parts", "agree,reference,graphs,nocompile,tput",
                      "--topologies", "tp2,tp2rs,tp1", "--parallel", "1"], sh=sh) == 0
    (res,) = (tmp_path / "r").glob("*-e2e-topology-abc1234.json")
    d = json.loads(res.read_text())
    assert d["meta"]["gpu"] == "NVIDIA H200" and d["meta"]["not_run"] == []
    rows = d["rows"]
    kinds = {r["kernel"] for r in rows}
    assert kinds == {"topology_agreement", "topology_vs_fp32_reference",
                     "topology_reference_check", "topology_sm80_audit", "topology_zero_compile",
                     "topology_tput"}
    assert all({"tp", "pp"} <= set(r["shape"]) for r in rows)
    (a,) = [r for r in rows if r["kernel"] == "topology_agreement" and r["variant"] ==
            "a100_vs_upstream" and r["shape"]["tp"] == 2 and not r["shape"]["cuda_graphs"]
            and "row_shard_min_rows" not in r["shape"]]
    assert a["max_abs_dlogprob"] == pytest.approx(0.001) and a["within_tolerance"]
    assert a["identical"] is False
    vs1 = [r for r in rows if r["variant"] == "a100_tp2_vs_a100_tp1"]
    assert {r["shape"]["cuda_graphs"]: r["identical"] for r in vs1} == {False: True, True: False}
    rs = [r for r in rows if r["variant"] == "a100_tp2rs_vs_a100_tp2"]
    assert len(rs) == 2 and all(r["row_shard_exchanges"] == [5, 5] for r in rs)
    assert all(r["shape"]["row_shard_min_rows"] == 2 for r in rs)
    checks = [r for r in rows if r["kernel"] == "topology_reference_check"]
    assert sorted((r["shape"]["tp"], r["shape"].get("row_shard_min_rows", 0)) for r in checks) == [
        (1, 0), (2, 0), (2, 2)]
    assert all(r["a100_runs"] == 2 and r["upstream_runs"] == 2 for r in checks)
    (z,) = [r for r in rows if r["kernel"] == "topology_zero_compile"]
    assert z["passed"] is True and z["shape"]["tp"] == 2 and z["ranks"][1]["pp_rank"] == 1
    audits = [r for r in rows if r["kernel"] == "topology_sm80_audit"]
    assert sorted((r["shape"]["tp"], r["shape"]["jit_warmup"], "row_shard_min_rows" in r["shape"])
                  for r in audits) == [(1, False, False), (2, False, False), (2, False, True),
                                       (2, True, False)]
    assert all(r["triton_kernels"] == 1 and len(r["per_rank"]) == 2 for r in audits)
    assert len([r for r in rows if r["kernel"] == "topology_tput"]) == 2 * 3
    # a second invocation runs nothing (every output exists)
    n = len(sh.ran)
    topo.main(["--work", str(work), "--results", str(tmp_path / "r"), "--models", "v41-mini",
               "--parts", "agree,reference,graphs,nocompile,tput", "--topologies",
               "tp2,tp2rs,tp1"], sh=sh)
    assert len(sh.ran) == n


def test_deadline_leaves_the_tail_in_order(tmp_path, monkeypatch):
    import e2e
    monkeypatch.setattr(e2e, "_DEADLINE", [0.0])
    monkeypatch.setattr(e2e, "_left", lambda: topo.ESTIMATE_S["eager"] + 1)
    work = tmp_path / "w"
    sh = _StandInSh(work, {})
    topo.main(["--work", str(work), "--results", str(tmp_path / "r"), "--models", "v41-mini",
               "--parts", "agree,tput", "--topologies", "tp2", "--modes", "a100"], sh=sh)
    # the agree engine fits; tput (~360 s) does not and is reported, not started
    assert sh.ran == ["topo-tp2-v41-mini-a100-eager"]
    (res,) = (tmp_path / "r").glob("*.json")
    meta = json.loads(res.read_text())["meta"]
    assert meta["not_run"] == ["topo-tp2-v41-tput-a100-tput"]
    assert "not started" in meta["failed_runs"][0]


def test_collectives_are_counted_by_implementation_and_capture(monkeypatch):
    """rank_audit.count_collectives on stand-in TP and PP communicators: each call counted
    under its group, implementation and method, "captured" while the stream captures (the
    collectives inside the CUDA graphs), "eager" otherwise; wrapping twice wraps nothing."""
    import types

    import torch

    import rank_audit as ra
    calls = []

    class Comm:
        disabled = False

        def __init__(self, name):
            self.name = name

        def all_reduce(self, x):
            calls.append((self.name, "all_reduce"))
            return x

        def custom_all_reduce(self, x):
            calls.append((self.name, "custom_all_reduce"))
            return x
    tp = types.SimpleNamespace(world_size=2, device_communicator=types.SimpleNamespace(
        pynccl_comm=Comm("tp-nccl"), ca_comm=Comm("tp-ca"), symm_mem_comm=None))
    pp = types.SimpleNamespace(world_size=2, device_communicator=types.SimpleNamespace(
        pynccl_comm=Comm("pp-nccl")))
    ps_mod = types.ModuleType("vllm.distributed.parallel_state")
    ps_mod.get_tp_group, ps_mod.get_pp_group = (lambda: tp), (lambda: pp)
    dist = types.ModuleType("vllm.distributed")
    dist.parallel_state = ps_mod
    monkeypatch.setitem(sys.modules, "vllm.distributed", dist)
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", ps_mod)
    monkeypatch.setattr(ra, "_COUNTS", type(ra._COUNTS)())
    assert sorted(ra.count_collectives()) == ["pp.pynccl.all_reduce",
                                              "tp.custom_ar.custom_all_reduce",
                                              "tp.pynccl.all_reduce"]
    assert ra.count_collectives() == []
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    dc = tp.device_communicator
    dc.ca_comm.custom_all_reduce(1)
    capturing[0] = True
    dc.ca_comm.custom_all_reduce(1)
    dc.pynccl_comm.all_reduce(1)
    pp.device_communicator.pynccl_comm.all_reduce(1)
    assert dict(ra._COUNTS) == {"tp.custom_ar.custom_all_reduce.eager": 1,
                                "tp.custom_ar.custom_all_reduce.captured": 1,
                                "tp.pynccl.all_reduce.captured": 1,
                                "pp.pynccl.all_reduce.captured": 1}
    assert len(calls) == 4   # the real methods ran
    st = ra.collectives_state()
    assert st["tp"]["custom_ar"] == {"disabled": False} and "symm_mem" not in st["tp"]


def test_bundle_is_written_after_each_engine_and_resumed(tmp_path, monkeypatch):
    import e2e
    monkeypatch.setattr(e2e, "_DEADLINE", [float("inf")])
    work, bundle = tmp_path / "w", tmp_path / "b.json"
    seen = []

    class Sh(_StandInSh):
        def __call__(self, cmd, log, env=None, timeout=None):
            if bundle.exists():
                seen.append(sorted(json.loads(bundle.read_text())["engines"]))
            return super().__call__(cmd, log, env, timeout)
    sh = Sh(work, {})
    args = ["--results", str(tmp_path / "r"), "--models", "v41-mini", "--parts", "agree",
            "--topologies", "tp2", "--parallel", "1"]
    topo.main(["--work", str(work), "--bundle", str(bundle), *args], sh=sh)
    # before the second engine, the bundle held the first
    assert seen[-1] == ["topo-tp2-v41-mini-a100-eager"]
    # a new machine (empty work folder) resumes from the bundle and runs nothing
    sh2 = _StandInSh(tmp_path / "w2", {})
    topo.main(["--work", str(tmp_path / "w2"), "--resume", str(bundle), *args], sh=sh2)
    assert sh2.ran == [] and not list((tmp_path / "w2").glob("*-mxfp8"))   # no checkpoint
