"""Per-rank shapes on one GPU in benchmarks/e2e (e2e.py --models): the configs of one rank of
TP 2 / 4 / 8 of the agreement models, the runs e2e.py starts for them and the rows it writes
(CPU, with tests/test_e2e_orchestration.py's stand-in for the engines), and the fp32
reference at a rank's heads and o_groups: the ranks of a tiny model, each run as a model of
its own, sum to the whole model's attention output."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "benchmarks" / "e2e" / "configs"
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))
sys.path.insert(0, str(REPO / "tools"))
import e2e  # noqa: E402
import e2e_models as em  # noqa: E402
import make_checkpoint as MC  # noqa: E402
import reference as R  # noqa: E402
from test_e2e_orchestration import _fake_run, _main  # noqa: E402

PER_RANK = {"v41-tp2-mini": ("v41-mini", 2, 32, 4), "v41-tp4-mini": ("v41-mini", 4, 16, 2),
            "v41-tp8-mini": ("v41-mini", 8, 8, 1), "v4-tp2-mini": ("v4-mini", 2, 32, 4),
            "v4-tp4-mini": ("v4-mini", 4, 16, 2), "v4-tp8-mini": ("v4-mini", 8, 8, 1)}


def _text(raw: dict) -> dict:
    return raw.get("text_config", raw)


# ----------------------------------------------------------------------------- configs
def test_per_rank_models_are_registered():
    assert {n: v[:2] for n, v in PER_RANK.items()} == em.PER_RANK_MODELS
    for name, (base, _, _, _) in PER_RANK.items():
        assert em.MODELS[name] == (name, em.MODELS[base][1])  # the agreement model's format
        # e2e.py's _split_tag reads a run tag by the first model name it starts with.
        assert not any(name.startswith(other + "-") for other in em.MODELS if other != name)
        assert e2e._split_tag(f"{name}-a100-agree-eager") == (name, ["a100", "agree", "eager"])


@pytest.mark.parametrize("name", sorted(PER_RANK))
def test_configs_are_a_rank_of_the_agreement_model(name):
    """configs/<name>/config.json is per_rank_config of the agreement model's config: heads
    and o_groups divided by the TP degree (8 heads per group at every degree), every other
    field (index heads, ranks, layers, experts) the same."""
    base, tp, heads, groups = PER_RANK[name]
    raw = json.loads((CONFIGS / name / "config.json").read_text())
    base_raw = json.loads((CONFIGS / base / "config.json").read_text())
    assert raw == em.per_rank_config(base_raw, tp)
    t, b = _text(raw), _text(base_raw)
    assert (t["num_attention_heads"], t["o_groups"]) == (heads, groups)
    assert em.per_rank_heads(name) == (heads, groups)
    assert t["num_attention_heads"] // t["o_groups"] == b["num_attention_heads"] // b["o_groups"]
    assert t["index_n_heads"] == b["index_n_heads"] == 64
    rest = {k: v for k, v in t.items() if k not in ("num_attention_heads", "o_groups")}
    assert rest == {k: v for k, v in b.items() if k not in ("num_attention_heads", "o_groups")}
    with pytest.raises(ValueError, match="do not split"):
        em.per_rank_config(base_raw, 16)  # 8 o_groups do not split 16 ways


@pytest.mark.parametrize("name", ["v41-tp8-mini", "v4-tp8-mini"])
def test_checkpoint_table_at_a_rank(name):
    """The checkpoint tool's tensor table of a TP-8 rank: wq_b 8 x 512 rows, one o_group
    (wo_a [256, 4096], wo_b [hidden, 256]), an 8-entry sink; the indexer's 64 heads kept."""
    cfg = MC.load_config(CONFIGS / name)
    fmt = em.MODELS[name][1]
    tab = {n: tuple(s) for n, s, _ in MC.checkpoint_table(cfg, fmt)}
    hd, orank, hidden = (cfg.need(k) for k in ("head_dim", "o_lora_rank", "hidden_size"))
    assert tab["layers.0.attn.attn_sink"] == (8,)
    assert tab["layers.0.attn.wq_b.weight"] == (8 * hd, cfg.need("q_lora_rank"))
    assert tab["layers.0.attn.wo_a.weight"] == (orank, 8 * hd)
    assert tab["layers.0.attn.wo_b.weight"] == (hidden, orank)
    iq = next(n for n in tab if n.endswith("attn.indexer.wq_b.weight"))
    assert tab[iq][0] == 64 * cfg.need("index_head_dim")


# ----------------------------------------------------------------------------- e2e.py
def test_select_models():
    assert e2e.select_models("agree") == e2e.AGREE_MODELS
    assert e2e.select_models("tp8") == ("v41-tp8-mini", "v4-tp8-mini")
    assert e2e.select_models("per-rank") == tuple(em.PER_RANK_MODELS)
    assert e2e.select_models("tp2,v41-mini,v41-tp2-mini") == ("v41-tp2-mini", "v4-tp2-mini",
                                                              "v41-mini")
    for bad in ("tp16", "v41-tput", ","):
        with pytest.raises(ValueError):
            e2e.select_models(bad)


def _recording(started):
    """_fake_run, also recording every command (the checkpoint ones included)."""
    sh = _fake_run({}, started)
    cmds = []

    def run(cmd, log, env=None, timeout=None):
        cmds.append([str(c) for c in cmd])
        rc = sh(cmd, log, env, timeout)
        if "--audit" in cmd and "--jit-warmup" not in cmd:  # the eager a100 run's audit
            out = Path(cmd[cmd.index("--out") + 1])
            r = json.loads(out.read_text())
            r["audit"] = dict(triton_kernels=[], cuda_ops=[], failed=[], deep_gemm_calls=0,
                              tilelang_compiles=0, compiles_by_phase={})
            out.write_text(json.dumps(r))
        return rc
    return run, cmds


def test_a_tp_degree_runs_what_the_reference_rule_needs(monkeypatch, tmp_path):
    """--models tp8 --agree-modes a100,upstream: both models' TP-8 rank, dense-routed
    checkpoints from their own configs; eager and CUDA-graph runs of a100 and upstream, the
    two references, the zero-compile run; no sm90 run, no 64-head model. Rows under the
    per-rank kernels, in a results file of their own, the reference checks passing."""
    started: list = []
    sh, cmds = _recording(started)
    out = _main(monkeypatch, tmp_path, ["--models", "tp8", "--agree-modes", "a100,upstream",
                                        "--steps", "ckpt,agree,graphs,reference,nocompile",
                                        "--parallel", "1"], sh)
    names = ("v41-tp8-mini", "v4-tp8-mini")
    ckpts = [c for c in cmds if any("make_checkpoint.py" in x for x in c)]
    assert sorted(Path(c[c.index("--format") - 1]).name for c in ckpts) == sorted(names)
    assert all(c[c.index("--set") + 1] == "num_experts_per_tok=8" for c in ckpts)
    stems = [s for s, _, _ in started]
    assert sorted(stems) == sorted(
        [f"{n}-{m}-agree-{f}" for n in names for m in ("a100", "upstream")
         for f in ("eager", "graphs")]
        + [f"{n}-{r}" for n in names for r in ("ref", "ref-kvfp8")]
        + [f"{n}-a100-nocompile" for n in names])
    # The rule's runs first: eager engines, then the plain reference.
    assert stems[:4] == [f"{n}-{m}-agree-eager" for n in names for m in ("a100", "upstream")]
    (res,) = (tmp_path / "r").glob("*.json")
    assert "-e2e-per-rank-" in res.name
    kinds = {r["kernel"] for r in out["rows"]}
    assert kinds == {"per_rank_sm80_audit", "per_rank_agreement", "per_rank_vs_fp32_reference",
                     "per_rank_reference_check", "per_rank_zero_compile"}
    checks = [r for r in out["rows"] if r["kernel"] == "per_rank_reference_check"]
    assert len(checks) == 4 and all(r["passed"] for r in checks)
    assert {(r["shape"]["model"], r["shape"]["rank_of"], r["shape"]["tp"], r["shape"]["heads"],
             r["shape"]["o_groups"]) for r in checks} == {
        ("v41-tp8-mini", "v41-mini", 8, 8, 1), ("v4-tp8-mini", "v4-mini", 8, 8, 1)}
    pairs = {r["variant"] for r in out["rows"] if r["kernel"] == "per_rank_agreement"}
    assert pairs == {"a100_vs_upstream", "a100_eager_vs_graphs", "upstream_eager_vs_graphs"}
    zc = [r for r in out["rows"] if r["kernel"] == "per_rank_zero_compile"]
    assert {r["shape"]["model"] for r in zc} == set(names) and all(r["passed"] for r in zc)
    # --steps none starts nothing and writes the same rows again from the work folder.
    res.unlink()
    n = len(started)
    again = _main(monkeypatch, tmp_path, ["--models", "per-rank", "--steps", "none"], sh)
    assert len(started) == n and again["rows"] == out["rows"]


def test_per_rank_rows_beside_64_head_rows(monkeypatch, tmp_path):
    """Both kinds in one work folder: one file (-e2e-), the 64-head rows under their kernels,
    the per-rank ones under theirs; the default models are the agreement ones."""
    started: list = []
    sh, _ = _recording(started)
    out = _main(monkeypatch, tmp_path, ["--models", "agree,tp4", "--steps", "ckpt,agree",
                                        "--agree-modes", "a100,upstream"], sh)
    (res,) = (tmp_path / "r").glob("*.json")
    assert "-e2e-per-rank-" not in res.name and "-e2e-" in res.name
    by = {}
    for r in out["rows"]:
        by.setdefault(r["kernel"], set()).add(r["shape"]["model"])
    assert by["e2e_agreement"] == {"v41-mini", "v4-mini"}
    assert by["per_rank_agreement"] == {"v41-tp4-mini", "v4-tp4-mini"}
    assert by["sm80_audit"] == {"v41-mini", "v4-mini"}
    assert by["per_rank_sm80_audit"] == {"v41-tp4-mini", "v4-tp4-mini"}
    assert len(started) == 8


def test_bad_model_and_mode_choices_are_refused(monkeypatch, tmp_path):
    for argv in (["--models", "tp3"], ["--agree-modes", "a100,a10"],
                 ["--models", "tp2", "--steps", "ckpt,yoco"]):
        with pytest.raises(SystemExit):
            _main(monkeypatch, tmp_path, ["--steps", "ckpt,agree", *argv], _fake_run({}, []))


def test_recheck_gives_per_rank_checks(monkeypatch, tmp_path):
    """--recheck of a per-rank results file rebuilds its per_rank_reference_check rows."""
    out = _main(monkeypatch, tmp_path, ["--models", "tp2", "--agree-modes", "a100,upstream",
                                        "--steps", "ckpt,agree,graphs,reference"],
                _fake_run({}, []))
    (res,) = (tmp_path / "r").glob("*.json")
    again = e2e.recheck(res)
    want = [r for r in out["rows"] if r["kernel"] == "per_rank_reference_check"]
    got = {(r["kernel"], r["shape"]["model"], r["shape"]["tp"], r["passed"]) for r in again}
    assert got == {(r["kernel"], r["shape"]["model"], r["shape"]["tp"], r["passed"])
                   for r in want}
    assert got == {("per_rank_reference_check", n, 2, True) for n in ("v41-tp2-mini",
                                                                     "v4-tp2-mini")}


def test_results_index_groups_per_rank_rows_apart():
    """benchmarks/results/INDEX.md gives each per-rank row kernel a step of its own (so a
    per-rank file never supersedes a 64-head one), named after the step that writes the
    64-head kind; the headlines read them as they read the 64-head kinds."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import results_headlines as rh
    import results_index as ri
    # the renamed kinds (EXTRA_STEP also holds the kernels of other drivers' steps)
    assert set(rh.PER_RANK_STEP) | set(rh.LONG_STEP) == set(em.BASE_KERNEL)
    assert set(em.BASE_KERNEL) <= set(rh.EXTRA_STEP)
    assert set(rh.PER_RANK_STEP) == {r["kernel"] for r in em.PER_RANK_ROWS}
    for kernel in rh.PER_RANK_STEP:
        base = em.BASE_KERNEL[kernel]
        assert ri.E2E_STEP[kernel].startswith(ri.E2E_STEP[base].split(" (")[0]), kernel
    check = dict(kernel="per_rank_reference_check", variant="a100_vs_upstream", passed=False,
                 shape=dict(model="v4-tp8-mini"))
    assert rh.headline_e2e("per_rank_reference_check", [check]).startswith("passed 0/1")
    agree = dict(kernel="per_rank_agreement", variant="a100_vs_upstream", top1_agree=0.95,
                 shape=dict(model="v4-tp8-mini"))
    assert "a100_vs_upstream 0.950" in rh.headline_e2e("per_rank_agreement", [agree])


# ----------------------------------------------------------------------------- reference
# A tiny V4.1 and V4 (test_e2e_reference.py's sizes) with 16 heads in 2 o_groups: a rank of
# TP 2 holds 8 heads and one group, as a rank of TP 8 of the 64-head models does.
TINY = dict(vocab_size=512, hidden_size=512, num_attention_heads=16, o_groups=2,
            q_lora_rank=128, o_lora_rank=64, sliding_window=8, index_topk=16,
            index_n_heads=4, moe_intermediate_size=128, num_experts_per_tok=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    out = {}
    for name, cfgdir, fmt, ov in (("v41", "v41-mini", "mxfp8",
                                   dict(TINY, candidate_topk_blocks=8, candidate_block_size=4)),
                                  ("v4", "v4-mini", "fp8", TINY)):
        cfg = MC.load_config(CONFIGS / cfgdir, ov)
        MC.write_checkpoint(cfg, fmt, d / name, seed=0, threads=1, log=lambda *a: None)
        out[name] = R.Reference(R.Model(d / name))
    return out


def _rank(ref, tp: int, r: int):
    """Rank ``r`` of TP ``tp`` of ``ref`` as a Reference of its own: heads and groups divided,
    wq_b's rows, the sink, wo_a's rows of its groups and wo_b's columns of them sliced as
    vLLM's column- and row-parallel linears shard them; the rest replicated."""
    rank = copy.copy(ref)
    rank.nh, rank.G = ref.nh // tp, ref.G // tp
    hd, orank = ref.hd, ref.orank
    h0, h1 = r * rank.nh, (r + 1) * rank.nh
    g0, g1 = r * rank.G * orank, (r + 1) * rank.G * orank
    w = dict(ref.w)
    for i in range(ref.L):
        p = f"layers.{i}.attn."
        w[p + "wq_b.weight"] = ref.w[p + "wq_b.weight"][h0 * hd:h1 * hd]
        w[p + "attn_sink"] = ref.w[p + "attn_sink"][h0:h1]
        w[p + "wo_a.weight"] = ref.w[p + "wo_a.weight"][g0:g1]
        w[p + "wo_b.weight"] = ref.w[p + "wo_b.weight"][:, g0:g1]
    rank.w = w
    return rank


@pytest.mark.parametrize("model", ["v41", "v4"])
def test_reference_ranks_sum_to_the_whole_model(tiny, model):
    """Every attention layer (SWA only, compressed with the indexer selecting, V4's C4A and
    C128A): the two ranks' outputs, each computed by the reference as a model of 8 heads and
    one o_group, sum to the 16-head model's output (the all-reduce after wo_b), and each
    rank's share is a real part of it."""
    ref = tiny[model]
    assert (ref.nh, ref.G) == (16, 2)
    ranks = [_rank(ref, 2, r) for r in range(2)]
    assert [(k.nh, k.G) for k in ranks] == [(8, 1), (8, 1)]
    T = 80   # past the tiny top-k (16) at ratio 1, 2 and 4: the indexer selects
    x = torch.randn(T, ref.H, generator=torch.Generator().manual_seed(3))
    ctx = [{"comp": {}, "index_k": {}, "topk": {}} for _ in range(3)]
    with torch.inference_mode():
        for i in range(ref.L):
            whole = ref.attention(i, x, ctx[0])
            parts = [k.attention(i, x, c) for k, c in zip(ranks, ctx[1:])]
            scale = float(whole.abs().max())
            assert scale > 0
            err = float((parts[0] + parts[1] - whole).abs().max())
            assert err <= 1e-5 * scale, (i, err, scale)
            for p in parts:
                assert float((p - whole).abs().max()) > 1e-3 * scale, i


def test_reference_runs_a_per_rank_checkpoint(tmp_path):
    """A checkpoint written from configs/v4-tp8-mini (tiny vocabulary and hidden size, the
    rank's 8 heads and one o_group kept; an o_lora_rank of one fp8 block): the reference reads
    those shapes and its logprob rows are finite."""
    ov = {k: v for k, v in TINY.items() if k not in ("num_attention_heads", "o_groups")}
    ov["o_lora_rank"] = 128
    cfg = MC.load_config(CONFIGS / "v4-tp8-mini", ov)
    MC.write_checkpoint(cfg, "fp8", tmp_path / "ck", seed=0, threads=1, log=lambda *a: None)
    ref = R.Reference(R.Model(tmp_path / "ck"))
    assert (ref.nh, ref.G) == (8, 1)
    with torch.inference_mode():
        rows = ref.logprob_rows(torch.arange(3, 40))
    assert len(rows) == 36 and all(torch.isfinite(torch.tensor(r[1:])).all() for r in rows)
