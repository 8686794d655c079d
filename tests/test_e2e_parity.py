"""The Hopper-parity step on CPU (benchmarks/e2e/parity.py, engine_plan.py, run_engine.py)
with stand-ins for vLLM (tests/graph_fakes.py).

What is checked: the A/B/A/B order and the bisect variants (the features on by default for
sm90, read from overlay/vllm/deepinfer/envs.py, most suspected first), their commands and
switches, and whose compile cache each uses; the rows per repeat, the spread and the
verdicts per shape (default within upstream's spread, slower, faster; a bisect variant above
the default mode's spread); the --deadline plan with warm starts for a cache root compiled
by an engine before it, and the bundle; run_engine.py's "default" mode and DEEPINFER_DISABLE
reaching the engine process (stand-in vLLM)."""
from __future__ import annotations

import json
import os
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
import parity  # noqa: E402

MODEL = "v41-tput"
# Two features on by default for sm90 (the two most suspected while they are).
F1, F2 = parity.default_on("sm90")[:2]


def _main(monkeypatch, tmp_path, argv, sh, budget=float("inf"), work="w"):
    monkeypatch.setattr(e2e, "_left", sh.left_fn(budget))
    monkeypatch.setattr(e2e, "sh", sh)
    assert parity.main(["--work", str(tmp_path / work), "--results", str(tmp_path / "r"),
                        "--skip-overlay-check", *argv], sh=sh) == 0
    (res,) = (tmp_path / "r").glob("*.json")
    out = json.loads(res.read_text())
    res.unlink()
    return out, res.name


def _summary(out, variant, **shape):
    (r,) = [r for r in out["rows"] if r["variant"] == variant and r["shape"]["repeat"] == "all"
            and all(r["shape"].get(k) == v for k, v in shape.items())]
    return r


# --------------------------------------------------------------------------- the plan
def test_features_on_by_default_for_sm90_in_suspect_order():
    """The bisect's features are envs.py's sm90 defaults, SUSPECTS' order first; every name
    in SUSPECTS is a feature (a rename must reach the list)."""
    envs = parity.load_envs()
    on = parity.default_on("sm90")
    assert set(on) == {n for n, f in envs.FEATURES.items() if "sm90" in f.default_on}
    assert len(on) == len(set(on)) and on
    ranked = [n for n in on if n in parity.SUSPECTS]
    assert on[:len(ranked)] == sorted(ranked, key=parity.SUSPECTS.index)
    assert set(parity.SUSPECTS) <= set(envs.FEATURES)
    assert "ampere_attn" not in on and "fp8_sw" in parity.default_on("sm80")


def test_ab_order_bisect_commands_and_caches(tmp_path):
    plan = parity.engines(MODEL, 3, ["serve_warmup", "kv_gather"])
    assert [e.tag.split("parity-")[1] for e in plan] == [
        "default-r1", "upstream-r1", "default-r2", "upstream-r2", "default-r3", "upstream-r3",
        "default-no-serve_warmup-r1", "default-no-kv_gather-r1"]
    work = tmp_path / "w"
    base = dict(os.environ, DEEPINFER_EMULATE_CAPABILITY="8.0", DEEPINFER_YOCO_REUSE="0")
    for e in plan:
        opts, args = G.parse_engine_command(ep.command(e, work, work / "ck"))
        assert args.mode == ("upstream" if e.info["variant"] == "upstream" else "default")
        assert (args.task, args.batches, args.prefill_lens, args.eager) == (
            "tput", [1, 8, 32], [1024, 8192], False)
        assert opts.compilation_config is None and not opts.check_lens
        env = ep.engine_env(e, work, base)
        assert not {"DEEPINFER_EMULATE_CAPABILITY", "DEEPINFER_YOCO_REUSE"} & set(env)
        feat = e.info["disabled_feature"]
        assert env.get("DEEPINFER_DISABLE") == feat
        # bisect variants load the default mode's compile cache; A and B have their own
        want = "parity-upstream" if e.info["variant"] == "upstream" else "parity-default"
        assert e.cache == want
    own = parity.engines(MODEL, 1, ["kv_gather"], own_cache=True)
    assert own[-1].cache == "parity-default-no-kv_gather"
    assert parity.parse_args(["--bisect"]).bisect_list == parity.default_on("sm90")
    assert parity.parse_args(["--bisect-features", F2]).bisect_list == [F2]
    for bad in (["--bisect-features", "fp8_sw"], ["--bisect-features", "nope"],
                ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            parity.parse_args(bad)


# --------------------------------------------------------------------------- rows, verdicts
# tokens/s per (variant, phase, size), one value per repeat.
SPEEDS = {
    ("default", "decode", 1): [300, 305, 302], ("upstream", "decode", 1): [330, 337, 335],
    ("default", "decode", 8): [2380, 2400, 2390], ("upstream", "decode", 8): [2380, 2420, 2391],
    ("default", "decode", 32): [7300, 7283, 7310], ("upstream", "decode", 32): [7000, 7063, 7100],
    ("default", "prefill", 1024): [23000, 23500, 23200],
    ("upstream", "prefill", 1024): [23100, 23400, 23600],
    ("default", "prefill", 8192): [54000, 54100, 54200],
    ("upstream", "prefill", 8192): [54000, 54300, 54400],
    (f"default-no-{F1}", "decode", 1): [336],
    (f"default-no-{F2}", "decode", 1): [303],
}


def _speed(tag, args, opts, env, row):
    variant, r = tag.split("parity-")[1].rsplit("-r", 1)
    size = row["batch"] if row["phase"] == "decode" else row["prompt_len"]
    vals = SPEEDS.get((variant, row["phase"], size)) or SPEEDS[("default", row["phase"], size)]
    return float(vals[(int(r) - 1) % len(vals)])


def test_rows_spread_and_verdicts(monkeypatch, tmp_path):
    sh = G.FastSh(speed=_speed)
    out, name = _main(monkeypatch, tmp_path, ["--bisect-features", f"{F1},{F2}"], sh)
    assert "-e2e-hopper-parity-abc1234" in name and not out["meta"]["failed_runs"]
    assert sh.started == [f"{MODEL}-parity-{v}" for v in (
        "default-r1", "upstream-r1", "default-r2", "upstream-r2", "default-r3", "upstream-r3",
        f"default-no-{F1}-r1", f"default-no-{F2}-r1")]
    per = [r for r in out["rows"] if r["shape"]["repeat"] != "all"]
    assert len(per) == 8 * 5
    for r in per:
        s = r["shape"]
        assert r["kernel"] == "hopper_parity"
        assert set(s) == {"model", "phase", "batch" if s["phase"] == "decode" else "prompt_len",
                          "repeat", "disabled_feature"}
        assert r["tokens_per_s"] == _speed(f"x-parity-{r['variant']}-r{s['repeat']}", None,
                                           None, None, dict(s, batch=s.get("batch"),
                                                            prompt_len=s.get("prompt_len")))
    assert {tuple(r["ran_as"]) for r in per if r["shape"]["phase"] == "decode"} == {("FULL",)}
    assert all(r["ran_as"] is None for r in per if r["shape"]["phase"] == "prefill")
    b1 = _summary(out, "default", phase="decode", batch=1)
    assert b1["spread"] == dict(n=3, min=300, median=302, max=305)
    assert b1["vs_upstream"]["verdict"] == "slower" and b1["passed"] is False
    assert b1["vs_upstream"]["ratio_median"] == pytest.approx(302 / 335)
    b8 = _summary(out, "default", phase="decode", batch=8)
    assert b8["vs_upstream"]["verdict"] == "within_spread" and b8["passed"] is True
    b32 = _summary(out, "default", phase="decode", batch=32)
    assert b32["vs_upstream"]["verdict"] == "faster" and b32["passed"] is True
    assert _summary(out, "upstream", phase="decode", batch=1).get("passed") is None
    nsw = _summary(out, f"default-no-{F1}", phase="decode", batch=1)
    assert nsw["shape"]["disabled_feature"] == F1
    assert nsw["vs_default"]["verdict"] == "faster"
    assert nsw["vs_upstream"]["verdict"] == "within_spread"
    assert _summary(out, f"default-no-{F2}", phase="decode", batch=1)["vs_default"][
        "verdict"] == "within_spread"
    v = out["meta"]["verdicts"]
    assert v["slower"] == ["decode b1"] and "decode b32" in v["faster"]
    assert v["attributable"] == [f"{F1}: decode b1"]
    series = parity.parity_series(out["rows"])
    assert series["decode b1"]["default"] == [300.0, 305.0, 302.0]
    assert series["prefill L8192"]["upstream"] == [54000.0, 54300.0, 54400.0]


def test_verdict_edges():
    assert parity.verdict([10], [10, 12]) == "within_spread"
    assert parity.verdict([12], [10, 12]) == "within_spread"
    assert parity.verdict([12.5], [10, 12]) == "faster"
    assert parity.verdict([9.99], [10, 12]) == "slower"
    assert parity.verdict([9, 9, 30], [10, 12]) == "slower"      # the median decides


# --------------------------------------------------------------------------- deadline
def test_deadline_warm_starts_and_bundle(monkeypatch, tmp_path):
    """In 480 s (the stand-in's starts: cold 150 s, warm 60 s, plus 10 s each) the cold
    default and upstream engines and the warm default one start (estimates 195, 195, 105 s
    against 480, 320, 160 s left); the warm upstream one would not (105 s against 90).
    new work folder with the bundle runs the rest, the first of each mode cold again (the
    machine's caches are gone), and never an engine the bundle holds."""
    sh = G.FastSh(speed=_speed)
    bundle = tmp_path / "o" / "parity.json"
    assert (ep.estimate_s("cold", plan_e := parity.engines(MODEL, 1)[0]),
            ep.estimate_s("warm", plan_e)) == (195, 105)
    out, _ = _main(monkeypatch, tmp_path, ["--repeats", "3", "--bundle", str(bundle)], sh,
                   budget=480)
    assert sh.started == [f"{MODEL}-parity-{v}" for v in ("default-r1", "upstream-r1",
                                                         "default-r2")]
    plan = {t["tag"].split("parity-")[1]: t for t in out["meta"]["plan"]}
    assert plan["default-r2"]["start"] == "warm" and plan["upstream-r1"]["start"] == "cold"
    nd = out["meta"]["failed_runs"]
    assert len(nd) == 3 and "upstream-r2" in nd[0] and "warm start" in nd[0]
    b1 = _summary(out, "default", phase="decode", batch=1)
    assert b1["spread"]["n"] == 2 and b1["repeats"] == [1, 2]

    sh2 = G.FastSh(speed=_speed)
    out2, _ = _main(monkeypatch, tmp_path, ["--resume", str(bundle), "--bundle", str(bundle)],
                    sh2, budget=1000, work="w2")
    assert sh2.started == [f"{MODEL}-parity-{v}" for v in ("upstream-r2", "default-r3",
                                                          "upstream-r3")]
    assert not out2["meta"]["failed_runs"]
    assert _summary(out2, "default", phase="decode", batch=1)["spread"]["n"] == 3
    assert _summary(out2, "upstream", phase="decode", batch=1)["spread"]["n"] == 3
    assert sh2.clock == pytest.approx(3 * 10 + 150 + 150 + 60)   # cold, cold, warm
    # --no-run: the results from the bundle alone, nothing started
    sh3 = G.FastSh(speed=_speed)
    out3, _ = _main(monkeypatch, tmp_path, ["--resume", str(bundle), "--no-run"], sh3,
                    work="w3")
    assert sh3.started == [] and not (tmp_path / "w3" / f"{MODEL}-mxfp8").exists()
    assert out3["rows"] == out2["rows"]


# --------------------------------------------------------------------------- run_engine.py
def test_default_and_upstream_modes_reach_the_engine(monkeypatch, tmp_path):
    """Through e2e.sh and run_engine.py on the stand-in vLLM: the default mode runs with no
    DEEPINFER_* switch, upstream with DEEPINFER_DISABLE=all, a bisect variant with its one
    feature; each with its cache root; the caller's switches never reach them."""
    root = G.write_fake_vllm(tmp_path / "fakevllm")
    work = tmp_path / "w"
    G.write_checkpoint(work / f"{MODEL}-mxfp8")
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("E2E_ENGINE_LOCK", str(tmp_path / "lock"))
    monkeypatch.setenv("DEEPINFER_EMULATE_CAPABILITY", "8.0")
    monkeypatch.setattr(e2e, "_DEADLINE", [float("inf")])
    assert parity.main(["--work", str(work), "--results", str(tmp_path / "r"), "--repeats",
                        "1", "--bisect-features", F1, "--skip-overlay-check"]) == 0
    outs = {p.stem.split("parity-")[1]: json.loads(p.read_text())
            for p in work.glob(f"{MODEL}-parity-*.json")}
    assert sorted(outs) == [f"default-no-{F1}-r1", "default-r1", "upstream-r1"]
    for v, r in outs.items():
        env = r["env"]
        assert "DEEPINFER_EMULATE_CAPABILITY" not in env
        assert env.get("DEEPINFER_DISABLE") == {"default-r1": None, "upstream-r1": "all",
                                                f"default-no-{F1}-r1": F1}[v]
        assert env["VLLM_CACHE_ROOT"].endswith("parity-upstream" if "upstream" in v
                                               else "parity-default")
        assert r["mode"] == ("upstream" if "upstream" in v else "default")
        assert r["deepinfer_variant"] == "sm90"
        assert r["engine"]["graph"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
        assert "check" not in r["engine"]
    (res,) = (tmp_path / "r").glob("*.json")
    rows = json.loads(res.read_text())["rows"]
    assert {r["resolved_mode"] for r in rows if r["shape"]["repeat"] != "all"} == {
        "FULL_AND_PIECEWISE"}
