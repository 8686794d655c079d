"""Cross-layer reuse under vLLM 0.33.0's decoder SWA bounded replay (tests/yoco_replay_probe.py,
a subprocess on the patched tree, CPU).

In eager prefill steps the last KV-source layer and the layers after it run on each
request's last ``window`` rows; the first of them reads SWA metadata built with the batch's
replay starts, the later ones metadata built with each trimmed request's kept start, whose
``prefill_gather_lens`` differ (its SWA gather holds other rows). A layer after the last KV
source that reads its index source (v41-mini's layer 7, v41-tput's 9, the released V4.1's
21-23) must not take the first replay layer's combined lists: its output with reuse on must
be its output with reuse off, bit for bit. Reuse across the SWA cache groups of one forward
(views of one replay-start buffer) must stay.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import subproc

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).with_name("yoco_replay_probe.py")


@pytest.fixture(scope="module")
def res(device):
    if device != "cpu":
        pytest.skip("the interpreter sizes")
    from test_vllm_import import _need_tree, _probe_env
    _need_tree()
    r = subproc.run([sys.executable, str(PROBE)], env=_probe_env(), cwd=REPO, cap=300)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        pytest.fail(f"yoco replay probe failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
    out = json.loads(lines[-1])
    assert out["ok"], f"{out['error']}\n{out.get('trace', '')}"
    return out


def test_replay_metadata_differ_in_gather_rows_under_one_batch_tag(res):
    # The premise: the same kept batch (one batch tag), other SWA gathers.
    assert res["batch_tag_equal"]
    assert res["gather_lens_first"] == [2 * 16 - 1]
    assert res["gather_lens_later"] == [16]


def test_later_replay_layer_does_not_reuse_the_first_ones_combined_lists(res):
    assert not res["replay_combine_keys_equal"]
    assert res["hits_on"].get("combine", 0) == 0, res["hits_on"]
    # The compressed rows (one KV source, no SWA rows) are still shared.
    assert res["hits_on"].get("gather", 0) == 1, res["hits_on"]


def test_outputs_with_reuse_equal_outputs_without(res):
    assert res["bits_on"] == res["bits_off"], res["max_abs_diff"]


def test_groups_of_one_forward_still_share_combined_lists(res):
    assert res["main_combine_keys_equal"]


def test_groups_built_without_replay_starts_share_one_no_replay_buffer(res):
    # V4 passes no replay starts (nor do V4.1's graph captures): each upstream builder's own
    # zeros made two SWA groups' combine keys differ, and v4-long's second C128A layer was
    # refused the reserved slab on every prefill chunk (the H200 run at 3099bbc logged it
    # 208 times). One shared zeros tensor: one key, both claims granted, no warning.
    assert res["v4_builder"] == "DeepinferAmpereV4SparseSWAMetadataBuilder"
    assert res["v4_index_source"] == "'c128a'"
    assert res["v4_no_replay_zeros"] and res["v41_no_replay_zeros"]
    assert res["v4_no_replay_shared"] and res["v41_no_replay_shared"]
    assert res["v4_combine_keys_equal"]
    assert res["v41_no_replay_combine_keys_equal"]
    assert res["v4_claims"] == [True, True]
    assert not res["v4_second_owner_warned"]
