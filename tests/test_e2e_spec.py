"""e2e.py --steps spec on CPU, with stand-ins for the engines (benchmarks/e2e/spec_step.py,
spec_rule.py): the plan and its order, the commands run_spec.py accepts, the deadline, the
target identity the plain engines rest on, the rule (passes, violations, noise-explained
mismatches, the three noise terms, missing data, the control), and the rows the step writes
from the engines' outputs. run_spec.py's own pieces: tests/test_e2e_spec_engine.py. The
engines themselves run on a GPU (docs/e2e.md, *Speculative decoding*)."""
from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tools"))
import charts  # noqa: E402
import e2e  # noqa: E402
import run_spec  # noqa: E402
import spec_rule  # noqa: E402
import spec_step  # noqa: E402

R = spec_rule


# ----------------------------------------------------------------------------- plan
def _opts(**kw):
    base = dict(cases=list(spec_step.SPEC_CASES), modes=list(spec_step.SPEC_MODES),
                forms=list(spec_step.SPEC_FORMS), quick=False, parallel=1, rerun=False,
                plan_only=False)
    base.update(kw)
    return base


def test_cases_and_families():
    cases = {(m, meth): k for m, meth, k in spec_step.SPEC_CASES}
    assert cases == {("v41-dspark-mini", "dspark"): 5, ("v4-mtp-mini", "mtp"): 1,
                     ("v4-dspark-mini", "dspark"): 5, ("v41-mini", "ngram"): 5,
                     ("v4-mini", "ngram"): 5}
    assert set(spec_step.PLAIN_OF.values()) == {"v41-mini", "v4-mini"}
    assert all(spec_step.PLAIN_OF[m].split("-")[0] == m.split("-")[0] for m, _ in cases)


@pytest.mark.parametrize("spec_model", ["v41-dspark-mini", "v4-mtp-mini", "v4-dspark-mini"])
def test_speculative_checkpoints_carry_the_plain_models_target(spec_model):
    """PLAIN_OF's premise: make_checkpoint draws each tensor from (seed, name, its Spec), so
    equal target Specs are equal tensors; the speculative configs' targets (every tensor but
    the draft's mtp.*) are the plain model's, in every format, dense routing applied."""
    import inspect
    import make_checkpoint as mk
    base = spec_step.PLAIN_OF[spec_model]
    assert list(inspect.signature(mk.draw).parameters) == ["spec", "seed"]
    configs = REPO / "benchmarks" / "e2e" / "configs"
    over = {"num_experts_per_tok": 8}
    want = mk.tensor_specs(mk.load_config(configs / base, over))
    got = mk.tensor_specs(mk.load_config(configs / spec_model, over))
    draft = [t for t in got if t.name.startswith("mtp.")]
    assert draft and [t for t in got if not t.name.startswith("mtp.")] == want
    fmt = e2e.MODELS[spec_model][1]
    assert fmt == e2e.MODELS[base][1]
    small = min(want, key=lambda t: math.prod(t.shape))
    a, b = mk.materialize(small, fmt, 0), mk.materialize(got[got.index(small)], fmt, 0)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
                                        for k in a)


def test_plan_order_groups_and_commands(tmp_path):
    engines = spec_step.plan(tmp_path, _opts())
    tags = [e["tag"] for e in engines]
    # eager before graphs before nocompile; per group the speculative engines, then plain
    forms = [e["form"] for e in engines]
    assert forms == sorted(forms, key=spec_step.SPEC_FORMS.index)
    assert tags[:3] == ["v41-dspark-mini-a100-spec-dspark-eager", "v41-mini-a100-spec-ngram-eager",
                        "v41-mini-a100-specplain-eager"]
    assert tags[3:6] == ["v41-dspark-mini-upstream-spec-dspark-eager",
                         "v41-mini-upstream-spec-ngram-eager", "v41-mini-upstream-specplain-eager"]
    assert tags[6:10] == ["v4-mtp-mini-a100-spec-mtp-eager", "v4-dspark-mini-a100-spec-dspark-eager",
                          "v4-mini-a100-spec-ngram-eager", "v4-mini-a100-specplain-eager"]
    # nocompile: a100 only
    assert {t.split("-spec")[0].rsplit("-", 1)[1] for t in tags if t.endswith("nocompile")} == {"a100"}
    assert len(engines) == 2 * (3 + 4) * 2 + (3 + 4)
    for e in engines:   # every command is one run_spec.py accepts, in its form and role
        args = run_spec.parse_args(e["cmd"][2:])
        assert args.form == e["form"] and Path(args.out) == e["out"]
        assert args.batches == list(spec_step.SPEC_BATCHES)
        assert spec_step.parse_tag(e["out"].stem)[4] == e["form"]
        if args.role == "spec":
            assert (args.method, args.k) in {(m, k) for _, m, k in spec_step.SPEC_CASES}
            if args.method == "ngram":
                assert (args.lookup_min, args.lookup_max) == (2, 5)
            assert Path(args.model).name.split("-")[-1] in ("mxfp8", "fp8")
    plain = next(e for e in engines if e["tag"] == "v4-mini-a100-specplain-eager")
    args = run_spec.parse_args(plain["cmd"][2:])
    assert [Path(f).stem for f in args.score] == [
        "v4-mtp-mini-a100-spec-mtp-eager", "v4-dspark-mini-a100-spec-dspark-eager",
        "v4-mini-a100-spec-ngram-eager"]
    assert Path(args.model).name == "v4-mini-fp8" and args.method is None


def test_parse_tag_round_trip(tmp_path):
    for model, mode, meth, form in (("v41-dspark-mini", "a100", "dspark", "graphs"),
                                    ("v4-mini", "upstream", "ngram", "eager")):
        assert spec_step.parse_tag(spec_step.spec_out(tmp_path, model, mode, meth, form).stem) \
            == (model, mode, "spec", meth, form)
    assert spec_step.parse_tag(spec_step.plain_out(tmp_path, "v4-mini", "a100", "nocompile").stem) \
        == ("v4-mini", "a100", "plain", None, "nocompile")
    assert spec_step.parse_tag("v41-mini-a100-agree-eager") is None
    assert spec_step.parse_tag("v4-mini-a100-nocompile") is None


def test_options_select_and_refuse():
    ap = e2e.argparse.ArgumentParser()
    spec_step.add_spec_args(ap)
    ap.add_argument("--quick", action="store_true")

    def opts(*argv):
        return spec_step.spec_options(ap.parse_args(list(argv)), ap)
    o = opts("--spec-cases", "v4-mtp-mini,v41-mini:ngram", "--spec-forms", "eager")
    assert o["cases"] == [("v4-mtp-mini", "mtp", 1), ("v41-mini", "ngram", 5)]
    assert o["forms"] == ["eager"] and o["modes"] == ["a100", "upstream"]
    for bad in (("--spec-cases", "v41-mini:mtp"), ("--spec-modes", "sm90x"),
                ("--spec-forms", "compiled")):
        with pytest.raises(SystemExit):
            opts(*bad)


def test_run_spec_refuses_bad_roles():
    for argv in (["--role", "spec"], ["--role", "spec", "--method", "dspark"],
                 ["--role", "plain", "--method", "ngram", "--k", "5"]):
        with pytest.raises(SystemExit):
            run_spec.parse_args(["--model", "m", "--mode", "a100", "--out", "o", *argv])
    a = run_spec.parse_args(["--model", "m", "--mode", "a100", "--out", "o", "--role", "plain",
                             "--quick"])
    assert (a.gen, a.decode_tokens, a.k) == (run_spec.QUICK_RULE_GEN,
                                             run_spec.QUICK_DECODE_TOKENS, 0)


def test_engine_kwargs_per_form_and_role():
    def kw(*argv):
        return run_spec.engine_kwargs(run_spec.parse_args(
            ["--model", "m", "--mode", "a100", "--out", "o", *argv]))
    k = kw("--role", "spec", "--method", "ngram", "--k", "5", "--lookup-min", "2",
           "--lookup-max", "5", "--form", "graphs", "--kv-cache-gib", "4")
    assert k["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 5,
                                       "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert "enforce_eager" not in k and "compilation_config" not in k
    assert k["kv_cache_memory_bytes"] == 4 << 30 and k["disable_log_stats"] is False
    assert k["max_num_seqs"] >= max(spec_step.SPEC_BATCHES)
    k = kw("--role", "spec", "--method", "dspark", "--k", "5", "--form", "nocompile")
    assert k["speculative_config"] == {"method": "dspark", "num_speculative_tokens": 5}
    assert k["compilation_config"] == {"mode": 0, "cudagraph_mode": "NONE"}
    k = kw("--role", "plain", "--form", "eager")
    assert "speculative_config" not in k and k["enforce_eager"] is True
    with pytest.raises(ValueError):
        run_spec.speculative_config("eagle", 3)


def test_repetitive_prompts():
    ps = run_spec.repetitive([(64, 8), (20, 20)], 1000, 0)
    assert [len(p) for p in ps] == [64, 20]
    assert ps[0][:8] * 8 == ps[0] and len(set(ps[0])) <= 8
    assert all(100 <= t < 900 for p in ps for t in p)
    assert ps == run_spec.repetitive([(64, 8), (20, 20)], 1000, 0)
    assert run_spec.digest(ps) != run_spec.digest(run_spec.repetitive([(64, 8), (20, 20)], 1000, 1))


def test_plan_estimates_and_quick(tmp_path):
    eng = spec_step.plan(tmp_path, _opts(forms=["eager"], modes=["a100"]))
    quick = spec_step.plan(tmp_path, _opts(forms=["eager"], modes=["a100"], quick=True))
    assert sum(e["estimate_s"] for e in quick) < sum(e["estimate_s"] for e in eng)
    assert all("--quick" in e["cmd"] for e in quick)
    lines = spec_step.plan_lines(eng)
    assert "7 of 7 engines to run" in lines[-1] and f"{7 * spec_step.ENGINE_S['eager']} s" in lines[-1]
    # One model's modes in one 600 s call (eager): the estimate says so.
    v41 = spec_step.plan(tmp_path, _opts(forms=["eager"], cases=[c for c in spec_step.SPEC_CASES
                                                                 if c[0].startswith("v41")]))
    assert sum(e["estimate_s"] for e in v41) <= 600


# ----------------------------------------------------------------------------- the rule
def _row(top1, lp1, top2, lp2, given, glp=None, rank=None):
    if glp is None:
        glp = lp1 if given == top1 else lp2 if given == top2 else lp2 - 1.0
    if rank is None:
        rank = 1 if given == top1 else 2 if given == top2 else 7
    return [top1, lp1, top2, lp2, given, glp, rank]


def _score(outs, truth, margin=1.0, wiggle=0.0, digest="d"):
    """Scored runs of ``outs`` where ``truth[p][j]`` is the top-1 (top-2: truth + 1)."""
    runs = []
    for w in (0.0, wiggle):
        runs.append([[_row(t, -0.5 + w, t + 1, -0.5 - margin + w, o) for o, t in zip(out, tr)]
                     for out, tr in zip(outs, truth)])
    return dict(runs=runs, prompt_noise=[0.0] * len(outs), prompts_digest=digest,
                tokens=[list(o) for o in outs])


def _gen(tokens, lp=-0.5, margin=1.0):
    return dict(tokens=list(tokens), top=[[t, lp, t + 1, lp - margin, lp] for t in tokens])


def _plain(truth, spec_label, spec_outs, wiggle=0.01, margin=1.0, gen_wiggle=0.0):
    return dict(prompts_digest="d",
                generate=[[_gen(t, margin=margin) for t in truth],
                          [_gen(t, -0.5 + gen_wiggle, margin) for t in truth]],
                scores={"plain": _score(truth, truth, margin, wiggle),
                        spec_label: _score(spec_outs, truth, margin, wiggle)})


TRUTH = ((100, 101, 102, 103, 104, 105), (200, 201, 202, 203))   # tuples: never mutated


def test_rule_passes_when_every_token_is_the_top1():
    r = R.rule(dict(outputs=TRUTH, prompts_digest="d"), _plain(TRUTH, "s", TRUTH), "s")
    assert r["passed"] is True and r["violations"] == 0 and r["mismatches"] == 0
    assert r["positions"] == 10 and r["positions_checked"] == 10
    assert r["noise"] == pytest.approx(0.01) and r["threshold"] == pytest.approx(0.02)
    assert r["control"]["passed"] is True


def test_rule_fails_on_a_token_past_the_margin():
    outs = [list(TRUTH[0]), list(TRUTH[1])]
    outs[1][2] = 999   # not the top-1, with a margin of 1.0 >> noise
    r = R.rule(dict(outputs=outs, prompts_digest="d"), _plain(TRUTH, "s", outs), "s")
    assert r["passed"] is False and r["violations"] == 1 and r["mismatches"] == 1
    v = r["first_violations"][0]
    assert (v["prompt"], v["position"], v["token"], v["top1"]) == (1, 2, 999, 202)
    assert v["margin"] == pytest.approx(1.0) and r["given_gap_violations"] == 1
    assert r["outside_top2"] == 1


def test_rule_excuses_a_mismatch_within_the_noise():
    """A flip where the top-1/top-2 margin is within 2 x the measured noise: the engine's
    own variation explains it; the same flip with less noise does not."""
    outs = [list(TRUTH[0]), list(TRUTH[1])]
    outs[0][3] = TRUTH[0][3] + 1   # the top-2
    noisy = _plain(TRUTH, "s", outs, wiggle=0.03, margin=0.05)
    r = R.rule(dict(outputs=outs, prompts_digest="d"), noisy, "s")
    assert r["noise"] == pytest.approx(0.03) and r["threshold"] == pytest.approx(0.06)
    assert r["passed"] is True and r["mismatches"] == 1 and r["noise_explained_mismatches"] == 1
    assert r["positions_checked"] == 0
    quiet = _plain(TRUTH, "s", outs, wiggle=0.02, margin=0.05)   # threshold 0.04 < 0.05
    r = R.rule(dict(outputs=outs, prompts_digest="d"), quiet, "s")
    assert r["passed"] is False and r["violations"] == 1


def test_noise_terms_each_counted():
    p = _plain(TRUTH, "s", TRUTH, wiggle=0.004)
    t = R.noise_terms(p)
    assert t["score_repeat"] == pytest.approx(0.004)
    assert t["generate_repeat"] == 0.0 and t["decode_vs_score"] == 0.0
    # two generations that differ by 0.3 in their logprobs before diverging at token 2
    p["generate"][1] = [_gen(t, -0.8) for t in TRUTH]
    p["generate"][1][0]["tokens"][2] = 5
    assert R.noise_terms(p)["generate_repeat"] == pytest.approx(0.3)
    # the prompt positions' repeat noise counts too
    p["scores"]["s"]["prompt_noise"] = [0.5, None]
    assert R.noise_terms(p)["score_repeat"] == pytest.approx(0.5)
    # decode logprobs against the scoring of the same output
    p["generate"][0][1]["top"][0][1] -= 0.7
    p["generate"][0][1]["top"][0][4] -= 0.7
    assert R.noise_terms(p)["decode_vs_score"] == pytest.approx(0.7)
    assert R.threshold_of(R.noise_terms(p)) == (pytest.approx(0.7), pytest.approx(1.4))


def test_rule_cannot_judge_without_data():
    spec = dict(outputs=TRUTH, prompts_digest="d")
    p = _plain(TRUTH, "s", TRUTH)
    assert R.rule(spec, p, "other")["passed"] is None
    bare = dict(scores={"s": dict(_score(TRUTH, TRUTH), runs=[_score(TRUTH, TRUTH)["runs"][0]])})
    r = R.rule(spec, bare, "s")
    assert r["passed"] is None and "noise" in r["reason"]
    assert R.rule(dict(spec, prompts_digest="x"), p, "s")["passed"] is False


def test_rule_fails_when_the_scored_tokens_are_not_the_outputs():
    p = _plain(TRUTH, "s", TRUTH)
    outs = [TRUTH[0], TRUTH[1][:-1]]   # one token short
    r = R.rule(dict(outputs=outs, prompts_digest="d"), p, "s")
    assert r["passed"] is False and r["misaligned"] >= 1


def test_control_fails_when_plain_disagrees_with_itself():
    p = _plain(TRUTH, "s", TRUTH)
    p["generate"][0][0]["tokens"][1] = 777       # decoded with the logprob its scoring gives
    p["generate"][0][0]["top"][1][4] = -2.5
    p["scores"]["plain"] = _score([g["tokens"] for g in p["generate"][0]], TRUTH, 1.0, 0.01)
    c = R.control(p)
    assert c["passed"] is False and c["violations"] == 1


def test_position_row_reads_vllm_logprob_dicts():
    lp = lambda v, r: types.SimpleNamespace(logprob=v, rank=r)  # noqa: E731
    assert run_spec.position_row({5: lp(-0.1, 1), 6: lp(-2.0, 2)}, 6) == \
        [5, -0.1, 6, -2.0, 6, -2.0, 2]
    assert run_spec.position_row({5: lp(-0.1, 1), 6: lp(-2.0, 2), 9: lp(-7.0, 40)}, 9) == \
        [5, -0.1, 6, -2.0, 9, -7.0, 40]
    assert run_spec.position_row({5: lp(-0.1, 1), 6: lp(-0.1, 2)}, 5)[:3] == [5, -0.1, 6]


# ----------------------------------------------------------------------------- the step
def _spec_result(cmd, truth_of, wrong=None):
    a = run_spec.parse_args(cmd[2:])
    vocab = 1000
    ps = run_spec.repetitive(run_spec.QUICK_RULE_PROMPTS if a.quick else run_spec.RULE_PROMPTS,
                             vocab, a.seed)
    truth = truth_of(ps, a.gen)
    base = dict(gpu="NVIDIA H200", commit="abc1234", torch="2", triton="3", vllm="0.33.0",
                mode=a.mode, form=a.form, role=a.role, k=a.k, beside=a.beside, load_seconds=5.0)
    clock = lambda v: dict(steps=10, verify_us=v, draft_us=30.0 if a.k else None,  # noqa: E731
                           step_us=v + (30.0 if a.k else 0.0), tokens_per_step=1)
    if a.role == "spec":
        outs = [list(t) for t in truth]
        if wrong:
            outs[0][1] = 999
        rows = [dict(batch=b, tokens_per_s=200.0 * b, engine_step_us=900.0, clock=clock(120.0),
                     tokens_per_request_step=1.5,
                     acceptance=dict(acceptance=0.1 * a.k, mean_acceptance_length=1.5,
                                     per_position=[0.5] * a.k)) for b in a.batches]
        r = dict(base, method=a.method, prompts=ps, prompts_digest=run_spec.digest(ps),
                 outputs=outs, rule_acceptance=dict(acceptance=0.25, mean_acceptance_length=2),
                 rows=rows)
    else:
        scores = {"plain": dict(_score(truth, truth, 1.0, 0.01), prompts_digest=run_spec.digest(ps))}
        for f in a.score:
            s = json.load(open(f))
            scores[Path(f).stem] = dict(_score(s["outputs"], truth, 1.0, 0.01),
                                        prompts_digest=run_spec.digest(s["prompts"]))
        r = dict(base, method=None, prompts_digest=run_spec.digest(ps),
                 generate=[[_gen(t) for t in truth]] * 2, scores=scores,
                 rows=[dict(batch=b, tokens_per_s=150.0 * b, engine_step_us=800.0,
                            clock=clock(100.0)) for b in a.batches])
    if a.form == "nocompile":
        kernels = [dict(name="vllm.v1.worker.gpu.block_table._kernel", region=None,
                        sm80="ok", sm86="ok")]
        if a.role == "spec":
            kernels += [dict(name="vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils."
                                  "_rejection_kernel", region=None, sm80="ok", sm86="ok"),
                        dict(name="vllm.v1.worker.gpu.spec_decode.dflash.speculator."
                                  "_prepare_dflash_inputs_kernel", region="draft",
                             sm80="ok", sm86="ok")]
        r["audit"] = dict(triton_kernels=kernels, cuda_ops=[dict(op="_C::marlin_gemm")],
                          failed=[], zero_compile=True, serve_compiles=[],
                          serve_compiles_outside=[], compiles_by_phase={"load": 3},
                          region_ops={"draft": {"_C::marlin_gemm": 4}} if a.role == "spec" else {},
                          deep_gemm_calls={}, tilelang_compiles={})
    return r


def _truth(ps, gen):
    return [[(sum(p) + j) % 500 + 100 for j in range(gen)] for p in ps]


def _fake_sh(started, wrong_methods=()):
    def sh(cmd, log, env=None, timeout=None):
        cmd = [str(c) for c in cmd]
        if "make_checkpoint.py" in " ".join(cmd):
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text("{}")
            started.append(("ckpt", out.name, cmd))
            return 0
        assert env and env["VLLM_CACHE_ROOT"].endswith(Path(cmd[cmd.index("--out") + 1]).stem
                                                       .rsplit("-", 1)[0])
        assert timeout == spec_step.ENGINE_TIMEOUT_S[cmd[cmd.index("--form") + 1]]
        out = Path(cmd[cmd.index("--out") + 1])
        started.append(("engine", out.stem, cmd))
        meth = cmd[cmd.index("--method") + 1] if "--method" in cmd else None
        json.dump(_spec_result(cmd, _truth, wrong=meth in wrong_methods), open(out, "w"))
        return 0
    return sh


def test_step_runs_groups_and_rows(tmp_path, monkeypatch):
    started = []
    opts = _opts(cases=[c for c in spec_step.SPEC_CASES if c[0].startswith("v4-")
                        or c == ("v4-mini", "ngram", 5)], quick=True)
    missed = spec_step.step_spec(tmp_path, opts, sh=_fake_sh(started, wrong_methods=("mtp",)),
                                 dense_routing=lambda d: ["--set", "num_experts_per_tok=8"])
    assert missed == []
    ckpts = [s for s in started if s[0] == "ckpt"]
    assert {c[1] for c in ckpts} == {"v4-mtp-mini-fp8", "v4-dspark-mini-fp8", "v4-mini-fp8"}
    assert all("num_experts_per_tok=8" in c[2] for c in ckpts)
    engines = [s[1] for s in started if s[0] == "engine"]
    assert engines.index("v4-mini-a100-specplain-eager") > engines.index(
        "v4-mtp-mini-a100-spec-mtp-eager")
    rows = spec_step.spec_rows(tmp_path)
    rule = {(r["shape"]["method"], r["variant"], r["shape"]["form"]): r for r in rows
            if r["kernel"] == "spec_rule"}
    assert len(rule) == 3 * (2 + 2 + 1)
    assert rule[("mtp", "a100", "eager")]["passed"] is False   # the wrong token
    assert rule[("mtp", "a100", "eager")]["detail"]["violations"] == 1
    assert rule[("dspark", "a100", "graphs")]["passed"] is True
    assert rule[("ngram", "upstream", "eager")]["control_passed"] is True
    dec = [r for r in rows if r["kernel"] == "spec_decode"]
    assert len(dec) == 3 * 2 * 2 * len(spec_step.SPEC_BATCHES)   # no nocompile decode rows
    d = next(r for r in dec if r["shape"] == dict(model="v4-dspark-mini", method="dspark", k=5,
                                                   batch=4, cuda_graphs=True, form="graphs")
             and r["variant"] == "a100")
    assert d["tokens_per_s"] == 800.0 and d["plain_tokens_per_s"] == 600.0
    assert d["speedup"] == pytest.approx(800 / 600)
    assert d["verify_step_us"] == 120.0 and d["plain_step_us"] == 100.0
    assert d["verify_over_plain"] == pytest.approx(1.2) and d["goal_verify_le_1_5x_plain"] is True
    assert d["acceptance"] == pytest.approx(0.5) and d["rule_passed"] is True
    assert d["timed_alone"] is True
    assert not any("goal_verify_le_1_5x_plain" in r for r in dec
                   if r["shape"]["method"] == "mtp" or r["variant"] == "upstream"
                   or r["shape"]["batch"] == 16)
    aud = [r for r in rows if r["kernel"] == "spec_sm80_audit"]
    assert len(aud) == 3 and all(r["plain_audit"] for r in aud)
    a = next(r for r in aud if r["shape"]["method"] == "dspark")
    assert a["spec_only_triton_kernels"] == sorted([
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils._rejection_kernel",
        "vllm.v1.worker.gpu.spec_decode.dflash.speculator._prepare_dflash_inputs_kernel"])
    assert a["draft_region_triton_kernels"] == [
        "vllm.v1.worker.gpu.spec_decode.dflash.speculator._prepare_dflash_inputs_kernel"]
    assert a["draft_region_ops"] == {"_C::marlin_gemm": 4} and a["spec_only_cuda_ops"] == []
    z = [r for r in rows if r["kernel"] == "spec_zero_compile"]
    assert len(z) == 3 and all(r["passed"] for r in z)
    for r in rows:   # every row prints
        assert spec_step.spec_line(r)
    # a second invocation finds everything done and starts nothing
    started.clear()
    assert spec_step.step_spec(tmp_path, opts, sh=_fake_sh(started)) == []
    assert not [s for s in started if s[0] == "engine"]


def test_plain_serves_again_for_a_case_added_later(tmp_path):
    """A group's plain engine whose output lacks a speculative output of its group that
    exists now (served by a later invocation) is served again, and then scores it."""
    started = []
    sh = _fake_sh(started)
    only_mtp = _opts(cases=[("v4-mtp-mini", "mtp", 1)], forms=["eager"], modes=["a100"])
    assert spec_step.step_spec(tmp_path, only_mtp, sh=sh) == []
    both = _opts(cases=[("v4-mtp-mini", "mtp", 1), ("v4-dspark-mini", "dspark", 5)],
                 forms=["eager"], modes=["a100"])
    started.clear()
    assert spec_step.step_spec(tmp_path, both, sh=sh) == []
    assert [s[1] for s in started if s[0] == "engine"] == [
        "v4-dspark-mini-a100-spec-dspark-eager", "v4-mini-a100-specplain-eager"]
    rule = [r for r in spec_step.spec_rows(tmp_path) if r["kernel"] == "spec_rule"]
    assert sorted(r["shape"]["method"] for r in rule if r["passed"]) == ["dspark", "mtp"]


def test_spec_plan_prints_and_runs_nothing(tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(e2e, "sh", _fake_sh(started))
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--work", str(tmp_path / "w"), "--results",
                                      str(tmp_path / "r"), "--steps", "ckpt,spec", "--spec-plan",
                                      "--spec-forms", "graphs", "--spec-modes", "a100"])
    with pytest.raises(SystemExit) as exc:
        e2e.main()
    assert exc.value.code == 0 and started == [] and not (tmp_path / "r").exists()
    out = capsys.readouterr().out
    assert "~380 s  v41-dspark-mini-a100-spec-dspark-graphs" in out
    assert "7 of 7 engines to run, estimated 2660 s" in out


def test_deadline_drops_the_tail_in_order(tmp_path):
    started = []
    budget = [spec_step.ENGINE_S["eager"] * 2.5]

    def left():
        return budget[0]

    def sh(cmd, log, env=None, timeout=None):
        rc = _fake_sh(started)(cmd, log, env, timeout)
        if "run_spec.py" in " ".join(map(str, cmd)):
            budget[0] -= spec_step.ENGINE_S["eager"]
        return rc
    opts = _opts(forms=["eager"], modes=["a100"],
                 cases=[c for c in spec_step.SPEC_CASES if c[0].startswith("v41")])
    missed = spec_step.step_spec(tmp_path, opts, sh=sh, left=left)
    ran = [s[1] for s in started if s[0] == "engine"]
    assert ran == ["v41-dspark-mini-a100-spec-dspark-eager", "v41-mini-a100-spec-ngram-eager"]
    assert len(missed) == 1 and missed[0].startswith("v41-mini-a100-specplain-eager (not started")
    rule = [r for r in spec_step.spec_rows(tmp_path) if r["kernel"] == "spec_rule"]
    assert rule and all(r["passed"] is None for r in rule)   # no plain engine: not judged


def test_e2e_main_writes_a_spec_results_file(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(e2e, "sh", _fake_sh(started))
    monkeypatch.setattr(e2e, "_DEADLINE", [float("inf")])
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--work", str(tmp_path / "w"), "--results",
                                      str(tmp_path / "r"), "--steps", "ckpt,spec", "--quick",
                                      "--spec-cases", "v41-mini:ngram", "--spec-forms", "eager",
                                      "--spec-modes", "a100"])
    assert e2e.main() == 0
    (res,) = (tmp_path / "r").glob("*.json")
    assert res.name.startswith("h200-") and res.name.endswith("-e2e-spec-abc1234.json")
    data = json.load(open(res))
    kinds = sorted({r["kernel"] for r in data["rows"]})
    assert kinds == ["spec_decode", "spec_rule"] and data["meta"]["gpu"] == "NVIDIA H200"
    assert charts.spec_series([r for r in data["rows"] if r["kernel"] == "spec_decode"]) == {
        ("v41-mini", "ngram", 5): {("a100", False): [(1, 200.0, 150.0, 1.2), (4, 800.0, 600.0, 1.2),
                                                     (16, 3200.0, 2400.0, 1.2)]}}
