"""Pipeline splits of DeepSeek-V4.1 (overlay/vllm/deepinfer/pp_split.py): a split that cuts a
KV-sharing group apart is refused at engine start in one line naming the layers and a split
that keeps every group on one stage.

* In process (no vLLM): the links upstream's V4.1 attention wires (compressed KV, index keys,
  index top-k, candidate blocks) and the groups they make on the e2e configs and upstream's
  40-layer layout; V4 has none; the nearest split and the one-line message.
* tests/pp_split_probe.py on the patched tree: the stage sizes vLLM's own ``get_pp_indices``
  builds for the configs at PP 2/3/4 (VLLM_PP_LAYER_PARTITION unset and set), each refused
  split's suggestion fed back through ``get_pp_indices`` and passing; the Ampere V4.1 layers
  built as a stage is built: our refusal at every stage's first layer, upstream's own
  NotImplementedError with our check off (which message, which layer), and the suggested
  split's stage built layer by layer.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

import subproc
from vllm.deepinfer import pp_split as ps

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).with_name("pp_split_probe.py")
CONFIGS = REPO / "benchmarks" / "e2e" / "configs"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pp_split_probe import REAL_V41, topology  # noqa: E402


def _hf(name: str) -> SimpleNamespace:
    return SimpleNamespace(**topology(name))


# --------------------------------------------------------------------------- in process
def test_links_follow_upstreams_source_rule():
    lk = ps.links(_hf("v41-tput"))   # ratios 0,0,2x6,1x4; KV 2,5,8; index 2,5,8,10; cand 8
    by = {(x.reader, x.what): x.source for x in lk}
    assert by[(3, "compressed KV")] == 2 and by[(7, "compressed KV")] == 5
    assert (5, "compressed KV") not in by and (2, "compressed KV") not in by  # sources
    assert by[(10, "index keys")] == 8          # an index source that owns no K cache
    assert by[(11, "index top-k")] == 10 and by[(9, "index top-k")] == 8
    assert by[(10, "candidate blocks")] == 8    # index sources after the candidate source
    assert (8, "candidate blocks") not in by
    assert not any(x.reader in (0, 1) for x in lk)   # sliding-window layers read nothing
    assert ps.groups(lk) == [(2, 4), (5, 7), (8, 11)]


@pytest.mark.parametrize("name,groups", [
    ("v41-long", [(1, 2), (3, 6)]),
    ("v41-dspark-mini", [(2, 3), (4, 5), (6, 9)]),
    ("v41-mini", [(2, 3), (4, 5), (6, 9)]),
    ("v41-real", [(2, 7), (8, 13), (14, 19), (20, 39)]),
    ("v4-mini", []), ("v4-long", []),           # V4: no KV sharing, every split passes
])
def test_groups_of_the_configs(name, groups):
    assert ps.groups(ps.links(_hf(name))) == groups


def test_real_layout_allows_only_the_group_starts():
    hf = SimpleNamespace(**REAL_V41)
    assert ps.stage_starts(40, ps.groups(ps.links(hf))) == [1, 2, 8, 14, 20]


@pytest.mark.parametrize("name,sizes,want", [
    ("v41-tput", [6, 6], [5, 7]),
    ("v41-tput", [4, 8], [5, 7]),
    ("v41-tput", [3, 3, 3, 3], [2, 3, 3, 4]),
    ("v41-long", [4, 3], [3, 4]),
    ("v41-dspark-mini", [5, 5], [6, 4]),        # a tie in movement: the later cut
    ("v41-real", [13, 14, 13], [14, 6, 20]),
    ("v41-real", [10, 10, 10, 10], [8, 6, 6, 20]),
    ("v41-long", [2, 2, 2, 1], None),           # 4 stages, 2 allowed starts
])
def test_nearest_split(name, sizes, want):
    hf = _hf(name)
    L = hf.num_hidden_layers
    got = ps.nearest_split(L, sizes, ps.groups(ps.links(hf)))
    assert got == want
    if got is not None:
        assert sum(got) == L and min(got) >= 1
        assert ps.cut_links(ps.links(hf), got) == []


def test_refusal_is_one_line_naming_layers_and_a_split():
    with pytest.raises(ps.PipelineSplitError) as e:
        ps.check(_hf("v41-tput"), [6, 6], "model.layers.6.attn")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == ("DeepInfer Ampere attention model.layers.6.attn: pipeline split 6,6 (vLLM's "
                   "even split; VLLM_PP_LAYER_PARTITION unset) cuts DeepSeek-V4.1 KV-sharing "
                   "groups apart: layers 6-7 (stage 1) read the compressed KV and index top-k "
                   "of layer 5 (stage 0); a split that keeps every group on one stage: "
                   "VLLM_PP_LAYER_PARTITION=5,7")


def test_refusal_names_a_users_partition_and_every_cut():
    with pytest.raises(ps.PipelineSplitError) as e:
        ps.check(_hf("v41-tput"), [3, 3, 3, 3], partition_env="3,3,3,3")
    msg = str(e.value)
    assert "pipeline split VLLM_PP_LAYER_PARTITION=3,3,3,3 cuts" in msg
    assert "layers 3-4 (stage 1) read the compressed KV and index top-k of layer 2 (stage 0)" in msg
    assert "layers 6-7 (stage 2) read" in msg
    assert ("layers 9-11 (stage 3) read the compressed KV, index top-k, index keys and "
            "candidate blocks of layer 8 (stage 2)") in msg
    assert msg.endswith("VLLM_PP_LAYER_PARTITION=2,3,3,4")


def test_refusal_when_no_split_fits_names_the_largest_pipeline():
    with pytest.raises(ps.PipelineSplitError,
                       match=r"no split into 4 stages keeps every group on one stage \(a stage "
                       r"may start only at layer 1, 3\): use pipeline_parallel_size <= 3$"):
        ps.check(_hf("v41-long"), [2, 2, 2, 1])


@pytest.mark.parametrize("name,sizes", [("v41-tput", [5, 7]), ("v41-real", [20, 20]),
                                        ("v41-real", [14, 6, 20]), ("v4-mini", [1, 2, 2, 1]),
                                        ("v41-tput", [12])])
def test_whole_groups_pass(name, sizes):
    ps.check(_hf(name), sizes)


def test_check_layer_skips_pp1_and_the_draft(monkeypatch):
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1),
                          model_config=SimpleNamespace(hf_config=_hf("v41-tput")))
    ps.check_layer(cfg, "model.layers.6.attn")              # PP 1: nothing to check
    ps.check_layer(None, "model.layers.6.attn")
    cfg.parallel_config.pipeline_parallel_size = 2
    calls = []
    monkeypatch.setattr(ps, "stage_sizes", lambda L, pp: calls.append((L, pp)) or [6, 6])
    ps.check_layer(cfg, "model.layers.12.attn")              # past the backbone: the draft's
    assert calls == []
    with pytest.raises(ps.PipelineSplitError, match="model.layers.0.attn"):
        ps.check_layer(cfg, "model.layers.0.attn")
    assert calls == [(12, 2)]


# --------------------------------------------------------------------------- patched tree
@pytest.fixture(scope="module")
def probe():
    from test_vllm_import import _need_tree, _probe_env
    _need_tree()
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    d = Path(tempfile.gettempdir()) / f"deepinfer-pp-split-{run}"
    d.mkdir(exist_ok=True)
    out = d / "result.json"
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            r = subproc.run([sys.executable, str(PROBE)], env=_probe_env(), cwd=REPO, cap=300)
            lines = r.stdout.strip().splitlines()
            if r.returncode != 0 or not lines:
                pytest.fail(f"pp split probe failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
            out.write_text(lines[-1])
    res = json.loads(out.read_text())
    assert "error" not in res, f"{res.get('error')}\n{res.get('trace')}"
    return res


def test_vllm_splits_and_verdicts(probe):
    s = probe["splits"]
    # vLLM's even split, remainder to the stages before the last (get_pp_indices).
    assert s["v41-tput"]["pp"]["2"]["sizes"] == [6, 6]
    assert s["v41-long"]["pp"]["2"]["sizes"] == [4, 3]
    assert s["v41-real"]["pp"]["3"]["sizes"] == [13, 14, 13]
    assert s["v41-real"]["pp"]["2"]["verdict"] is None          # 20,20 cuts at layer 20
    for name in ("v4-mini", "v4-long"):
        assert all(r["verdict"] is None for r in s[name]["pp"].values()), name
    refused = 0
    for name, v in s.items():
        assert [tuple(g) for g in v["groups"]] == ps.groups(ps.links(_hf(name))), name
        for pp, r in v["pp"].items():
            # The probe's verdicts are this module's on vLLM's sizes.
            hf = _hf(name)
            cut = ps.cut_links(ps.links(hf), r["sizes"])
            assert (r["verdict"] is None) == (not cut), (name, pp)
            if r["verdict"] is None:
                continue
            refused += 1
            assert "\n" not in r["verdict"]
            if r["suggested"] is not None:
                # VLLM_PP_LAYER_PARTITION set to the suggestion: vLLM builds exactly it, and
                # it passes.
                assert r["suggested_sizes"] == r["suggested"], (name, pp)
                assert r["suggested_verdict"] is None, (name, pp)
                assert r["verdict"].endswith(
                    "VLLM_PP_LAYER_PARTITION=" + ",".join(map(str, r["suggested"])))
    assert refused >= 12


def test_users_partition_and_vllms_own_errors(probe):
    e = probe["env"]
    assert e["cutting"]["sizes"] == [4, 8]
    assert "pipeline split VLLM_PP_LAYER_PARTITION=4,8 cuts" in e["cutting"]["verdict"]
    assert e["cutting"]["verdict"].endswith("VLLM_PP_LAYER_PARTITION=5,7")
    assert e["bad_sum"].startswith("ValueError: sum(partitions)=10 does not match")


def test_layers_refuse_on_every_stage_before_upstream(probe):
    c = probe["construct"]
    ours = c["tput_stage1_ours"]
    assert ours["error"] == "PipelineSplitError" and ours["at"] == "model.layers.6.attn"
    assert ours["built"] == []
    assert "layers 6-7 (stage 1) read the compressed KV and index top-k of layer 5" in ours["message"]
    # Stage 0 refuses too, at its first layer (upstream builds it and waits).
    assert c["tput_stage0_ours"]["error"] == "PipelineSplitError"
    assert c["tput_stage0_ours"]["message"].split(": ", 1)[1] == ours["message"].split(": ", 1)[1]
    assert c["tput_stage0_upstream"] == {"error": None, "built": [0, 1, 2, 3, 4, 5]}
    # Upstream alone: the consumer's constructor raises, naming one missing source.
    up = c["tput_stage1_upstream"]
    assert up["error"] == "NotImplementedError" and up["at"] == "model.layers.6.attn"
    assert up["message"] == ("Compressed-KV source model.layers.5.attn not found on this rank; "
                             "PP splits inside a v4.1 kv-sharing group are not supported.")
    up = c["long_stage1_upstream"]
    assert up["error"] == "NotImplementedError" and up["at"] == "model.layers.4.attn"
    assert up["message"].startswith("Indexer K cache source model.layers.3.attn.indexer.k_cache "
                                    "not found on this rank")
    assert c["long_stage1_ours"]["error"] == "PipelineSplitError"
    assert c["long_stage1_ours"]["message"].endswith("VLLM_PP_LAYER_PARTITION=3,4")


def test_suggested_split_builds(probe):
    c = probe["construct"]
    assert c["tput_stage1_fixed"] == {"error": None, "built": list(range(5, 12))}
    assert c["long_stage1_fixed"] == {"error": None, "built": [3, 4, 5, 6]}
