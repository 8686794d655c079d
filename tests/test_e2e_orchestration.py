"""benchmarks/e2e/e2e.py on CPU with a stand-in for the engine runs: which runs it starts, in
what order, that a --deadline drops the tail and says so, and that the results file pairs the
runs it finds (agreement, cross-layer reuse on/off)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))
import e2e  # noqa: E402


def _fake_run(tokens_by_mode: dict, started: list, delay: float = 0.0):
    """A stand-in for `sh`: writes what run.py would for an agree/tput command."""
    def sh(cmd, log, env=None, timeout=None):
        if e2e._left() < 30:
            return 125
        if "make_checkpoint.py" in " ".join(map(str, cmd)):
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text("{}")
            return 0
        if "reference.py" in " ".join(map(str, cmd)):
            out = Path(cmd[cmd.index("--out") + 1])
            started.append((out.stem, False, False))
            json.dump(dict(mode="fp32_reference", prompts=[dict(
                prompt_len=3, prompt=[[5, -0.5, -1.0], [7, -0.4, -2.0]], generated=[])]),
                open(out, "w"))
            return 0
        mode = cmd[cmd.index("--mode") + 1]
        out = Path(cmd[cmd.index("--out") + 1])
        started.append((out.stem, "--kv-cache-gib" in cmd, "--audit" in cmd))
        time.sleep(delay)
        if "--task" in cmd and cmd[cmd.index("--task") + 1] == "tput":
            json.dump(dict(load_seconds=1.0, rows=[dict(phase="decode", batch=1, prompt_len=512,
                                                        tokens_per_s=10.0, seconds=1.0)]),
                      open(out, "w"))
            return 0
        tok = tokens_by_mode.get(mode, 5)
        run = dict(mode=mode, gpu="NVIDIA H200", commit="abc1234", load_seconds=1.0,
                   prompts=[dict(prompt_len=3, prompt=[[tok, -0.5, -1.0], [7, -0.4, -2.0]],
                                 generated=[[9, -0.1, []], [tok, -0.2, []]])])
        if "--repeat" in cmd:  # a second generation in the same process
            tok2 = tokens_by_mode.get(mode + "#2", tok)
            run["repeats"] = [[dict(prompt_len=3, prompt=[[tok2, -0.5, -1.0], [7, -0.4, -2.0]],
                                    generated=[[9, -0.1, []], [tok2, -0.2, []]])]]
        if mode.endswith("_verify"):  # DEEPINFER_YOCO_VERIFY=1: every hit compared
            run["yoco_totals"] = {f"{k}.{c}": 2 for k in ("decode_indices", "swa_ragged",
                                                          "combine", "gather", "indexer_k")
                                  for c in ("hit", "verify_equal")}
        if "--toggle-yoco" in cmd:  # once more in the same process, reuse off
            tok3 = tokens_by_mode.get(mode + "#off", tok)
            run["noyoco_in_process"] = [dict(prompt_len=3, prompt=[[tok3, -0.5, -1.0],
                                                                   [7, -0.4, -2.0]],
                                             generated=[[9, -0.1, []], [tok3, -0.2, []]])]
        if "--jit-warmup" in cmd:
            run["audit"] = dict(zero_compile=True, serve_compiles=[], compiles_by_phase={},
                                failed=[], triton_kernels=[], cuda_ops=[],
                                deep_gemm_calls=0, tilelang_compiles=0)
        json.dump(run, open(out, "w"))
        return 0
    return sh


def _main(monkeypatch, tmp_path, argv, sh):
    monkeypatch.setattr(e2e, "sh", sh)
    monkeypatch.setattr(e2e, "_DEADLINE", [float("inf")])
    monkeypatch.setattr(e2e, "STAGGER_S", 0)
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--work", str(tmp_path / "w"),
                                      "--results", str(tmp_path / "r"), *argv])
    assert e2e.main() == 0
    (res,) = (tmp_path / "r").glob("*.json")
    return json.load(open(res))


def test_each_run_once_in_priority_order(monkeypatch, tmp_path):
    started = []
    out = _main(monkeypatch, tmp_path, ["--steps", "ckpt,agree,graphs,yoco,nocompile",
                                        "--parallel", "1"], _fake_run({}, started))
    stems = [s for s, _, _ in started]
    assert len(stems) == len(set(stems)), "a run was started twice"
    # 6 eager agreement + 4 graphs (a100, upstream) + 4 reuse verify + 10 sorted-top-k reuse
    # on/off/rerun + 2 nocompile + 2 sm90 graphs
    assert len(stems) == 28
    assert stems[:6] == [f"{n}-{m}-agree-eager" for n in e2e.AGREE_MODELS for m in e2e.MODES]
    assert stems[-2:] == [f"{n}-sm90-agree-graphs" for n in e2e.AGREE_MODELS]
    assert all(kv for _, kv, _ in started), "agreement engines get a fixed KV cache size"
    audited = {s for s, _, a in started if a}
    assert audited == {f"{n}-a100-agree-eager" for n in e2e.AGREE_MODELS} | {
        f"{n}-a100-nocompile" for n in e2e.AGREE_MODELS}
    kinds = {(r["kernel"], r["variant"]) for r in out["rows"]}
    assert ("e2e_agreement", "a100_vs_upstream") in kinds
    assert ("yoco_e2e", "a100_det_vs_a100_det_noyoco") in kinds
    assert ("yoco_e2e", "a100_det_vs_a100_det_rerun") in kinds
    assert ("zero_compile", "a100") in kinds
    verify = [r for r in out["rows"] if r["kernel"] == "yoco_verify"]
    assert {(r["shape"]["model"], r["variant"]) for r in verify} == {
        (n, m) for n in e2e.AGREE_MODELS for m in ("a100_verify", "sm90_verify")}
    assert all(r["passed"] for r in verify)
    assert out["meta"]["failed_runs"] == []


def test_agreement_rows_see_a_disagreement(monkeypatch, tmp_path):
    started = []
    out = _main(monkeypatch, tmp_path, ["--steps", "ckpt,agree", "--parallel", "3"],
                _fake_run({"upstream": 6}, started))
    rows = {(r["shape"]["model"], r["variant"]): r for r in out["rows"]
            if r["kernel"] == "e2e_agreement"}
    assert rows[("v41-mini", "a100_vs_sm90")]["top1_agree"] == 1.0
    assert rows[("v41-mini", "a100_vs_upstream")]["top1_agree"] == 0.5
    assert not rows[("v41-mini", "a100_vs_upstream")]["detail"]["within_tolerance"]


def test_deadline_drops_the_tail_and_says_so(monkeypatch, tmp_path):
    started = []
    sh = _fake_run({}, started, delay=0.2)
    monkeypatch.setattr(e2e, "sh", sh)

    def main_with_short_deadline():
        # 30.5 s: the first run starts, later ones find under 30 s left.
        argv = ["--steps", "ckpt,agree", "--parallel", "1", "--deadline", "30.3"]
        return _main(monkeypatch, tmp_path, argv, sh)
    out = main_with_short_deadline()
    assert 1 <= len(started) < 6
    assert len(out["meta"]["failed_runs"]) == 6 - len(started)
    assert all(f.endswith("/eager") for f in out["meta"]["failed_runs"])


def test_existing_outputs_are_not_run_again(monkeypatch, tmp_path):
    started = []
    _main(monkeypatch, tmp_path, ["--steps", "ckpt,agree", "--parallel", "2"],
          _fake_run({}, started))
    first = len(started)
    for f in (tmp_path / "r").glob("*.json"):
        f.unlink()
    out = _main(monkeypatch, tmp_path, ["--steps", "ckpt,agree,yoco", "--parallel", "2"],
                _fake_run({}, started))
    again = [s for s, _, _ in started[first:]]
    assert sorted(again) == sorted(f"{n}-{m}-agree-eager" for n in e2e.AGREE_MODELS
                                   for m in e2e.YOCO_MODES)
    assert any(r["kernel"] == "yoco_e2e" and r["identical"] for r in out["rows"])


@pytest.mark.parametrize("flag,kv", [([], True), (["--profile-memory"], False)])
def test_profile_memory_switch(monkeypatch, tmp_path, flag, kv):
    started = []
    _main(monkeypatch, tmp_path, ["--steps", "ckpt,agree", "--parallel", "6", *flag],
          _fake_run({}, started))
    assert {k for _, k, _ in started} == {kv}


def _agree(mode, rows):
    return dict(mode=mode, prompts=[dict(prompt_len=len(rows) + 1, generated=[],
                                         prompt=[[t, -0.5, lp] for t, lp in rows])])


@pytest.mark.parametrize("a100_lp,passed", [(-1.00, True), (-1.05, True), (-1.40, False)])
def test_reference_check_uses_upstreams_own_spread(tmp_path, a100_lp, passed):
    """a100 passes when no further from the fp32 reference than upstream, within the spread
    of upstream's eager and CUDA-graph runs against the same reference."""
    ref = _agree("fp32_reference", [(1, -1.0), (2, -2.0)])
    json.dump(ref, open(tmp_path / "v41-mini-ref.json", "w"))
    runs = {("v41-mini", "upstream", True): _agree("upstream", [(1, -1.1), (2, -2.0)]),
            ("v41-mini", "upstream", False): _agree("upstream", [(1, -1.0), (2, -2.0)]),
            ("v41-mini", "a100", True): _agree("a100", [(1, a100_lp), (2, -2.0)])}
    rows = e2e.reference_rows(tmp_path, runs)
    (check,) = [r for r in rows if r["kernel"] == "e2e_reference_check"]
    assert check["margin"]["max_abs_dlogprob"] == pytest.approx(0.1)
    assert check["passed"] is passed
    assert {r["variant"] for r in rows if r["kernel"] == "e2e_vs_fp32_reference"} == {
        "upstream", "a100"}


def test_reference_runs_beside_the_engines_and_lands_in_the_results(monkeypatch, tmp_path):
    started: list = []
    res = _main(monkeypatch, tmp_path, ["--steps", "ckpt,agree,reference", "--parallel", "1"],
                _fake_run({}, started))
    names = [s for s, _, _ in started]
    assert names.index("v41-mini-ref") > names.index("v4-mini-upstream-agree-eager")
    assert names.index("v41-mini-ref") < names.index("v41-mini-ref-kvfp8")
    checks = [r for r in res["rows"] if r["kernel"] == "e2e_reference_check"]
    assert {r["shape"]["reference"] for r in checks} == {"fp32_reference"}
    assert len(checks) == 4 and all(r["passed"] for r in checks)


def _two_runs_each(tmp_path):
    """A reference and two runs (eager, graphs) of a100 and of upstream: a100's eager run a
    little further than upstream's, its graph run closer."""
    ref = _agree("fp32_reference", [(1, -1.0), (2, -2.0)])
    json.dump(ref, open(tmp_path / "v41-mini-ref.json", "w"))
    return {("v41-mini", "upstream", True): _agree("upstream", [(1, -1.10), (2, -2.0)]),
            ("v41-mini", "upstream", False): _agree("upstream", [(1, -1.14), (2, -2.0)]),
            ("v41-mini", "a100", True): _agree("a100", [(1, -1.16), (2, -2.0)]),
            ("v41-mini", "a100", False): _agree("a100", [(1, -1.09), (2, -2.0)])}


def test_reference_check_judges_each_engine_by_all_its_runs(tmp_path):
    """The V4.1 case of the 5f462a5 run in miniature: a100's eager run is a little further
    from the reference than upstream's eager run, beyond upstream's own spread (the first form
    of the rule fails), but a100's CUDA-graph run is closer than upstream's: over both runs
    a100 is within upstream's own run-to-run spread."""
    runs = _two_runs_each(tmp_path)
    (check,) = [r for r in e2e.reference_rows(tmp_path, runs)
                if r["kernel"] == "e2e_reference_check"]
    assert check["passed_eager_only"] is False
    assert check["margin"]["max_abs_dlogprob"] == pytest.approx(0.04)
    assert check["a100_spread"]["max_abs_dlogprob"] == pytest.approx(0.07)
    assert check["a100"]["max_abs_dlogprob"] == pytest.approx(0.125)
    assert check["upstream"]["max_abs_dlogprob"] == pytest.approx(0.12)
    assert check["passed"] is True
    # Further than upstream's spread allows (a100's own wider spread does not widen it).
    runs[("v41-mini", "a100", False)] = _agree("a100", [(1, -1.30), (2, -2.0)])
    (check,) = [r for r in e2e.reference_rows(tmp_path, runs)
                if r["kernel"] == "e2e_reference_check"]
    assert check["passed"] is False


def test_recheck_rebuilds_the_check_from_a_results_file(tmp_path):
    """--recheck: the per-run distances of an earlier file give the same check row as the
    runs themselves."""
    runs = _two_runs_each(tmp_path)
    rows = e2e.reference_rows(tmp_path, runs)
    f = tmp_path / "old.json"
    json.dump(dict(meta={}, rows=rows), open(f, "w"))
    (again,) = e2e.recheck(f)
    (check,) = [r for r in rows if r["kernel"] == "e2e_reference_check"]
    assert again["source"] == "old.json"
    assert {k: again[k] for k in check} == check


@pytest.mark.parametrize("second,identical", [(5, True), (6, False)])
def test_yoco_step_reruns_a100_in_the_same_process(monkeypatch, tmp_path, second, identical):
    """--steps yoco: the reuse-on a100 run generates its prompts twice in one process; rows
    kernel="e2e_repeat" say whether the two generations are identical."""
    started = []
    out = _main(monkeypatch, tmp_path, ["--steps", "ckpt,yoco", "--parallel", "2"],
                _fake_run({e2e.REPEAT_MODE + "#2": second}, started))
    rows = [r for r in out["rows"] if r["kernel"] == "e2e_repeat"]
    assert {r["shape"]["model"] for r in rows} == set(e2e.AGREE_MODELS)
    assert all(r["variant"] == f"{e2e.REPEAT_MODE}_run1_vs_run2" for r in rows
               if r["variant"].startswith(e2e.REPEAT_MODE + "_run"))
    assert {r["variant"] for r in rows} == {f"{m}_run1_vs_run2" for m in e2e.REPEAT_MODES}
    assert all(r["identical"] is identical for r in rows
               if r["variant"].startswith(e2e.REPEAT_MODE + "_run"))


@pytest.mark.parametrize("off,identical", [(5, True), (6, False)])
def test_yoco_step_toggles_reuse_in_the_same_process(monkeypatch, tmp_path, off, identical):
    """--steps yoco: the repeat modes generate once more with reuse off in the same process;
    rows kernel="yoco_e2e", variant "<mode>_in_process_on_vs_off" say whether on and off are
    identical there."""
    out = _main(monkeypatch, tmp_path, ["--steps", "ckpt,yoco", "--parallel", "2"],
                _fake_run({m + "#off": off for m in e2e.REPEAT_MODES}, []))
    rows = [r for r in out["rows"] if r["kernel"] == "yoco_e2e"
            and r["variant"].endswith("_in_process_on_vs_off")]
    assert {(r["shape"]["model"], r["variant"]) for r in rows} == {
        (n, f"{m}_in_process_on_vs_off") for n in e2e.AGREE_MODELS for m in e2e.REPEAT_MODES}
    assert all(r["identical"] is identical and r["shape"]["same_process"] for r in rows)



def test_yoco_modes_selects_the_yoco_step_engines(monkeypatch, tmp_path):
    """--yoco-modes runs only the named modes of the yoco step; an unknown name is refused."""
    started = []
    _main(monkeypatch, tmp_path, ["--steps", "ckpt,yoco", "--yoco-modes", "a100_det,sm90_det"],
          _fake_run({}, started))
    assert sorted(s[0] for s in started) == sorted(
        f"{n}-{m}-agree-eager" for n in e2e.AGREE_MODELS for m in ("a100_det", "sm90_det"))
    with pytest.raises(SystemExit):
        _main(monkeypatch, tmp_path, ["--steps", "yoco", "--yoco-modes", "a100_nope"],
              _fake_run({}, []))


def test_verify_row_passes_only_when_every_hit_compared_equal():
    """rows kernel="yoco_verify" (run.py's *_verify modes): nothing differed, every hit was
    compared, and each kind the model reuses was compared at least once."""
    ok = {"decode_indices.build": 3, "decode_indices.hit": 5, "decode_indices.verify_equal": 5,
          "swa_ragged.hit": 2, "swa_ragged.verify_equal": 2, "combine.hit": 1,
          "combine.verify_equal": 1, "gather.hit": 4, "gather.verify_equal": 4,
          "indexer_k.hit": 2, "indexer_k.verify_equal": 2}
    row = e2e.verify_row("v41-mini", "a100_verify", ok)
    assert row["passed"] and row["compared"] == 14 and row["mismatches"] == 0
    assert row["per_kind"]["decode_indices"] == dict(hits=5, builds=3, equal=5, mismatch=0)
    bad = dict(ok, **{"gather.verify_equal": 3, "gather.verify_mismatch": 1})
    assert e2e.verify_row("v41-mini", "a100_verify", bad)["mismatches"] == 1
    assert not e2e.verify_row("v41-mini", "a100_verify", bad)["passed"]
    missing = {k: v for k, v in ok.items() if not k.startswith("indexer_k")}
    r = e2e.verify_row("v41-mini", "a100_verify", missing)
    assert not r["passed"] and r["kinds_not_compared"] == ["indexer_k"]
    uncompared = dict(ok, **{"combine.hit": 2})
    r = e2e.verify_row("v41-mini", "a100_verify", uncompared)
    assert not r["passed"] and r["hits_not_compared"] == ["combine"]
    assert e2e.verify_row("v4-mini", "sm90_verify",
                          {"swa_ragged.hit": 1, "swa_ragged.verify_equal": 1})["passed"]


def test_tput_only_run_takes_its_meta_from_the_tput_run_and_its_modes(monkeypatch, tmp_path):
    """--steps ckpt,tput --tput-modes a100: only the throughput checkpoint is written, only the
    a100 engine runs, and the results file names the GPU and commit of that run."""
    started = []
    sh = _fake_run({}, started)

    def sh_tput(cmd, log, env=None, timeout=None):
        rc = sh(cmd, log, env, timeout)
        if "--task" in cmd and cmd[cmd.index("--task") + 1] == "tput":
            out = Path(cmd[cmd.index("--out") + 1])
            r = json.load(open(out))
            json.dump(dict(r, gpu="NVIDIA H200", commit="abc1234", torch="2.11"), open(out, "w"))
        return rc
    res = _main(monkeypatch, tmp_path, ["--steps", "ckpt,tput", "--tput-modes", "a100"],
                sh_tput)
    assert [s[0] for s in started] == [f"{e2e.TPUT_MODEL}-a100-tput-graphs"]
    ckpts = sorted(p.name for p in (tmp_path / "w").iterdir() if p.is_dir())
    assert ckpts == [f"{e2e.TPUT_MODEL}-{e2e.MODELS[e2e.TPUT_MODEL][1]}"]
    assert res["meta"]["gpu"] == "NVIDIA H200" and res["meta"]["commit"] == "abc1234"
    assert [r["variant"] for r in res["rows"] if r["kernel"] == "e2e"] == ["a100"]
    with pytest.raises(SystemExit):
        _main(monkeypatch, tmp_path / "bad", ["--steps", "tput", "--tput-modes", "a10"], sh_tput)
