"""Feature serve_warmup (patches 0003 and 0026 + vllm/deepinfer/warmup_upstream.py): the upstream helpers
the Ampere path launches and vLLM's JIT warmup does not know compile in our warmup, not while
serving. On the patched tree in a subprocess (tests/warmup_upstream_probe.py): our signature
tables equal the upstream kernels' parameters, the per-batch integers are unspecialized
(and specialized again, as upstream ships them, with DEEPINFER_SERVE_WARMUP=0), and every
launch over a grid of row counts, widths and KV row bounds finds a warmup key."""
from __future__ import annotations

import functools
from pathlib import Path

from patched_python import run_json

PROBE = Path(__file__).with_name("warmup_upstream_probe.py")


@functools.cache
def _probe(switch: str | None) -> dict:
    env = dict(TRITON_INTERPRET="1", DEEPINFER_ARCH="sm80")
    if switch is not None:
        env["DEEPINFER_SERVE_WARMUP"] = switch
    return run_json([str(PROBE)], env)


def test_signature_tables_match_upstream():
    assert _probe(None)["signatures"] == []


def test_per_batch_integers_unspecialized():
    u = _probe(None)["unspecialized"]
    assert u["count_valid_rows"] == ["num_queries", "num_rows_limit"]
    assert u["compact_rows"] == ["num_rows_limit"]
    assert u["candidate_scores"] == ["nblocks", "stride_row", "stride_scores", "width"]
    assert u["candidate_mask"] == ["nblocks", "stride_row", "width"]


def test_switch_off_restores_upstream_specialization():
    u = _probe("0")["unspecialized"]
    assert u["count_valid_rows"] == [] and u["compact_rows"] == []
    assert u["candidate_scores"] == ["nblocks", "width"]
    assert u["candidate_mask"] == ["nblocks", "width"]


def test_every_launch_is_warmed():
    r = _probe(None)
    assert set(r["launched"]) == {
        "_count_valid_row_entries_kernel", "_compact_dense_row_to_ragged_kernel",
        "_block_scores_kernel", "_store_candidates_kernel", "_candidate_flags_kernel",
        "_mask_candidates_kernel"}
    assert r["n_launches"] > 300
    assert r["uncovered"] == [], "\n".join(r["uncovered"][:20])


def test_without_the_patch_launches_escape_the_warmup():
    """The check can fail: with upstream's specialization the same grid leaves launches
    outside the warmup (what the H200 nocompile run saw)."""
    assert _probe("0")["uncovered"]
