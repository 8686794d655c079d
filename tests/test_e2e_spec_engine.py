"""benchmarks/e2e/run_spec.py's pieces and main on CPU (the engine of e2e.py --steps spec;
tests/test_e2e_spec.py covers the step): the step clock's verify / draft split, the hooks on
vLLM's V2 model runner and its speculator, the decode window over a stand-in engine that
accepts draft tokens, vLLM's spec-decode counters, the audit's regions and its sm_80 builds
held to the 48 KiB shared-memory budget (compiled for sm_80 in a subprocess, no GPU), and
run_spec.py's main for both roles in subprocesses on a stand-in vLLM (tests/spec_fakes.py)."""
from __future__ import annotations

import json
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))
sys.path.insert(0, str(REPO / "tests"))
import audit  # noqa: E402
import run_spec  # noqa: E402
import spec_rule  # noqa: E402
import subproc  # noqa: E402


# ----------------------------------------------------------------------------- run_spec pieces
class _Ev:
    clock = [0.0]

    def record(self):
        _Ev.clock[0] += 1.0
        self.t = _Ev.clock[0]

    def elapsed_time(self, other):
        return other.t - self.t

    def synchronize(self):
        pass


def test_step_clock_splits_verify_and_draft():
    c = run_spec.StepClock(event=_Ev, capturing=lambda: False)
    c.step_start(6, 1)            # off: not recorded
    c.step_end()
    c.on = True
    for _ in range(3):
        c.step_start(12, 2)
        c.draft_start()
        c.draft_end()
        c.step_end()
    c.step_start(3, 3)            # plain step, other batch size
    c.step_end()
    s = c.summary(0, len(c.records), 2)
    assert s["steps"] == 3 and s["tokens_per_step"] == 12
    assert (s["verify_us"], s["draft_us"], s["step_us"]) == (1e3, 1e3, 3e3)
    assert c.summary(0, len(c.records), 3)["draft_us"] is None
    cap = run_spec.StepClock(event=_Ev, capturing=lambda: True)
    cap.on = True
    cap.step_start(1, 1)
    cap.step_end()
    assert cap.records == [] and c.summary(0, 0) == dict(steps=0)


def test_install_hooks_wraps_the_model_runner_and_the_speculator():
    calls = []

    class Spec:
        def propose(self, *a, **k):
            calls.append(("propose", rec.region))
            return "draft"

    class Runner:
        def execute_model(self, so):
            calls.append(("execute", so.total_num_scheduled_tokens))
            return None

        def sample_tokens(self, g=None):
            self.speculator.propose()
            return "out"
    mr = types.SimpleNamespace(GPUModelRunner=Runner, init_speculator=lambda *a, **k: Spec())
    rec = audit.Recorder()
    clock = run_spec.StepClock(event=_Ev, capturing=lambda: False)
    assert run_spec.install_hooks(clock, rec, mr=mr)
    r = Runner()
    r.speculator = mr.init_speculator(None, None, None)
    clock.on = True
    so = types.SimpleNamespace(total_num_scheduled_tokens=12, num_scheduled_tokens={"a": 6, "b": 6})
    r.execute_model(so)
    assert r.sample_tokens() == "out"
    assert calls == [("execute", 12), ("propose", "draft")] and rec.region is None
    (rr,) = clock.records
    assert rr["n_tokens"] == 12 and rr["n_reqs"] == 2 and {"draft0", "draft1", "end"} <= set(rr)
    r.execute_model(types.SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={}))
    r.sample_tokens()
    assert len(clock.records) == 1   # an empty step is not a step


class _SpecEngine:
    """Prefills CHUNK tokens per step; a decoding request gets 1 + accepted tokens per step
    (accepted cycles through ``accept``); the model-runner hooks are called as vLLM's are."""

    def __init__(self, chunk, clock, accept=(0,), metrics=None):
        self.chunk, self.clock, self.accept, self.reqs, self.n = chunk, clock, accept, {}, 0
        self.metrics = metrics

    def add_request(self, rid, prompt, sp):
        self.reqs[rid] = dict(left=len(prompt["prompt_token_ids"]), toks=0, max=sp.max_tokens)

    def has_unfinished_requests(self):
        return any(r["toks"] < r["max"] for r in self.reqs.values())

    def abort_request(self, ids):
        for i in ids:
            self.reqs.pop(i, None)

    def step(self):
        dec = [r for r in self.reqs.values() if r["left"] == 0 and r["toks"] < r["max"]]
        self.clock.step_start(len(dec) or 1, len(dec) or 1)
        self.clock.draft_start()
        self.clock.draft_end()
        self.clock.step_end()
        for r in dec:
            a = self.accept[self.n % len(self.accept)]
            self.n += 1
            r["toks"] = min(r["max"], r["toks"] + 1 + a)
            if self.metrics is not None:
                self.metrics.update(drafts=self.metrics["drafts"] + 1,
                                    draft_tokens=self.metrics["draft_tokens"] + 5,
                                    accepted=self.metrics["accepted"] + a)
        budget = self.chunk
        for r in self.reqs.values():
            if r["left"] and budget:
                take = min(budget, r["left"])
                r["left"] -= take
                budget -= take
                if r["left"] == 0:
                    r["toks"] = 1
        return [types.SimpleNamespace(request_id=k, outputs=[types.SimpleNamespace(
            token_ids=[0] * r["toks"])]) for k, r in self.reqs.items()]


def _metric_llm(eng, m):
    def get_metrics():
        return [types.SimpleNamespace(name="vllm:spec_decode_num_drafts", value=m["drafts"]),
                types.SimpleNamespace(name="vllm:spec_decode_num_draft_tokens",
                                      value=m["draft_tokens"]),
                types.SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens",
                                      value=m["accepted"]),
                types.SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos",
                                      values=[m["accepted"], 0, 0, 0, 0])]
    return types.SimpleNamespace(llm_engine=eng, get_metrics=get_metrics)


@pytest.mark.parametrize("batch,accept", [(1, (0,)), (4, (4, 0)), (16, (1, 2, 3))])
def test_decode_window_counts_speculative_tokens(monkeypatch, batch, accept):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        SamplingParams=lambda **kw: types.SimpleNamespace(**kw)))
    clock = run_spec.StepClock(event=_Ev, capturing=lambda: False)
    m = dict(drafts=0, draft_tokens=0, accepted=0)
    eng = _SpecEngine(run_spec.run.CHUNK, clock, accept, m)
    steps = 12
    r = run_spec.decode_window(_metric_llm(eng, m), [[1] * 300] * batch, steps, clock, k=5)
    assert r["tokens"] >= steps * batch
    mean = 1 + sum(accept) / len(accept)
    assert r["engine_steps"] == r["clock"]["steps"] == r["engine_step_calls"]
    assert abs(r["engine_steps"] - steps / mean) <= 1.5
    assert r["tokens_per_request_step"] == pytest.approx(r["tokens"] / (r["engine_steps"] * batch))
    acc = r["acceptance"]
    assert acc["draft_tokens"] == 5 * acc["drafts"] and acc["drafts"] == r["engine_steps"] * batch
    assert acc["acceptance"] == pytest.approx(acc["accepted"] / acc["draft_tokens"])
    assert acc["mean_acceptance_length"] == pytest.approx(1 + acc["accepted"] / acc["drafts"])
    assert clock.on is False


def test_counters_without_metrics():
    class NoStats:
        def get_metrics(self):
            raise AssertionError("Stat logging disabled")
    assert run_spec.spec_counters(NoStats()) is None
    assert run_spec.acceptance(None, None)["acceptance"] is None
    a = run_spec.acceptance(dict(drafts=1, draft_tokens=5, accepted=2, per_pos=[1, 1]),
                            dict(drafts=3, draft_tokens=15, accepted=6, per_pos=[3, 2, 1]))
    assert a["acceptance"] == pytest.approx(0.4) and a["mean_acceptance_length"] == 3.0
    assert a["per_position"] == [1.0, 0.5, 0.5]


# ----------------------------------------------------------------------------- audit
def test_audit_regions_tag_compiles_and_ops():
    rec = audit.Recorder()

    def compile_(name):
        module, _, fn = name.rpartition(".")
        rec._triton_hook(key="k", repr=None,
                         fn=types.SimpleNamespace(module=module, name=fn, jit_function=None),
                         compile={"signature": {"p": "*i32"}, "constants": {"B": 8},
                                  "configs": [{}], "num_warps": 4, "num_stages": 1},
                         is_manual_warmup=False, already_compiled=False)
    with rec.in_region("draft"):
        compile_("vllm.v1.worker.gpu.spec_decode.x._prep")
    with rec.serving():
        op = audit._CountingOp(rec, "_C::fused_deepseek_v4_kv_rope_insert", lambda *a: 7)
        assert op() == 7
        with rec.in_region("draft"):
            assert op() == 7 and rec.region == "draft"
            compile_("vllm.v1.worker.gpu.spec_decode.x._sample")
        assert rec.region is None
    assert rec.ops["_C::fused_deepseek_v4_kv_rope_insert"] == 2
    assert dict(rec.region_ops["draft"]) == {"_C::fused_deepseek_v4_kv_rope_insert": 1}
    assert {e["name"]: e["region"] for e in rec.triton.values()} == {
        "vllm.v1.worker.gpu.spec_decode.x._prep": "draft",
        "vllm.v1.worker.gpu.spec_decode.x._sample": "draft"}
    assert rec.serve_compiles[0]["region"] == "draft"
    assert len(audit.serve_compile_failures(rec)) == 1   # a draft kernel compiled while serving


BUILD_PROBE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import triton, triton.language as tl
    import audit

    @triton.jit
    def small(x_ptr, B: tl.constexpr):
        o = tl.arange(0, B)
        tl.store(x_ptr + o, tl.load(x_ptr + o) + 1)

    @triton.jit
    def big(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        acc = tl.zeros((M, N), tl.float32)
        for i in range(4):
            a = tl.load(a_ptr + m[:, None] * K + k[None, :] + i)
            b = tl.load(b_ptr + k[:, None] * N + n[None, :] + i)
            acc += tl.dot(a, b)
        tl.store(c_ptr + m[:, None] * N + n[None, :], acc)

    out = {}
    for name, fn, sig, const, stages in (
            ("small", small, {"x_ptr": "*i32", "B": "constexpr"}, {"B": 64}, 1),
            ("big", big, {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "M": "constexpr",
                          "N": "constexpr", "K": "constexpr"},
             {"M": 128, "N": 128, "K": 128}, 3)):
        e = dict(jit=fn, signature=sig, constants=const, attrs=None, num_warps=4,
                 num_stages=stages)
        out[name] = {cc: audit.build_for(e, cc) for cc in (80, 90)}
    print(json.dumps(out))
""")


def test_audit_builds_within_the_ampere_shared_memory_budget(tmp_path):
    """build_for compiles for sm_80 (no GPU needed) and fails a kernel whose CTA takes more
    shared memory than the 48 KiB budget; sm_90 is not held to it."""
    import os
    probe = tmp_path / "probe.py"
    probe.write_text(BUILD_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subproc.run([sys.executable, str(probe), str(REPO / "benchmarks" / "e2e")], env=env,
                    cwd=tmp_path, cap=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["small"]["80"]["error"] == "" and out["small"]["80"]["shared"] <= 1024
    big80, big90 = out["big"]["80"], out["big"]["90"]
    assert big80["shared"] > audit.SMEM_BUDGET
    assert f"> {audit.SMEM_BUDGET} B budget" in big80["error"]
    assert "budget" not in big90["error"]


# ----------------------------------------------------------------------------- run_spec.py main
def test_run_spec_main_on_a_stand_in_vllm(tmp_path):
    """run_spec.py itself, both roles, in subprocesses on a stand-in vLLM (tests/spec_fakes.py):
    the LLM's arguments, the hooks on its model runner, the counters, the decode windows, and
    the rule over the two outputs (a stand-in that speculates correctly passes it)."""
    import os
    import spec_fakes
    root = spec_fakes.write_fake_vllm(tmp_path / "fake")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    log = tmp_path / "llm.jsonl"
    env = dict(os.environ, PYTHONPATH=str(root), FAKE_LLM_LOG=str(log), FAKE_ACCEPT="2")
    script = str(REPO / "benchmarks" / "e2e" / "run_spec.py")
    common = ["--model", str(ckpt), "--mode", "a100", "--form", "eager", "--quick",
              "--kv-cache-gib", "1", "--batches", "1", "4"]
    spec_json, plain_json = tmp_path / "v4-mtp-mini-a100-spec-mtp-eager.json", tmp_path / "p.json"
    for extra in (["--role", "spec", "--method", "mtp", "--k", "5", "--out", str(spec_json)],
                  ["--role", "plain", "--score", str(spec_json), "--out", str(plain_json)]):
        r = subproc.run([sys.executable, script, *common, *extra], env=env, cwd=tmp_path, cap=120)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    kws = [json.loads(x) for x in log.read_text().splitlines()]
    assert kws[0]["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 5}
    assert kws[1]["speculative_config"] is None
    assert all(k["enforce_eager"] and k["disable_log_stats"] is False
               and k["kv_cache_memory_bytes"] == 1 << 30 for k in kws)
    s, p = json.load(open(spec_json)), json.load(open(plain_json))
    assert s["hooks"] and s["gpu"] == "NVIDIA H200" and s["k"] == 5 and p["k"] == 0
    assert s["rule_acceptance"]["acceptance"] == pytest.approx(2 / 5)
    for row in s["rows"]:
        assert row["clock"]["steps"] > 0 and row["clock"]["draft_us"] is not None
        assert row["acceptance"]["mean_acceptance_length"] == pytest.approx(3.0)
        assert row["tokens_per_request_step"] == pytest.approx(3.0, abs=0.2)
    assert [r["batch"] for r in p["rows"]] == [1, 4]
    assert all(r["clock"]["draft_us"] is None and r["acceptance"] is None for r in p["rows"])
    assert set(p["scores"]) == {"plain", spec_json.stem}
    rule = spec_rule.rule(s, p, spec_json.stem)
    assert rule["passed"] is True and rule["positions_checked"] == rule["positions"] > 0
    assert rule["noise"] == pytest.approx(0.001) and rule["control"]["passed"] is True
