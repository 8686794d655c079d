"""The prefill indexer's rows sharded over TP ranks, on CPU through vLLM 0.33.0's own functions
(tests/tp_row_shard_probe.py on the patched tree, Triton interpreter): each rank scores only
``PrefillRowShard.narrow``'s rows of each chunk and ranks their top-k; ``exchange_topk``
all-gathers the final indices (the all-gather emulated by one thread per rank); every rank's
buffer must then equal the unsharded buffer bit for bit.

Row shards: ``balanced_prefill_row_shard`` at TP 2, 4 and 8 (uneven by construction: rows are
balanced by indexer work) and a hand-chosen [1, rest, 1]; chunks from upstream's chunker with a
small logits budget, so shards start and end inside chunks and requests are split into query
sub-chunks; decode tokens before the prefill rows (the shard's offset); ratios 1, 2 and 4;
duplicate keys, so the top-k breaks ties. Scorers: our Ampere logits
(vllm.deepinfer.kernels.indexer_logits, reached through ``fp8_fp4_mqa_logits`` as patch 0015
routes it) and upstream's torch reference ``fp8_mqa_logits_torch`` (row by row: batched, its
CPU bf16 einsum gives a row's bits that depend on the rows computed with it). The top-k is a
stand-in for the CUDA op (stable sort, ties to the lower column). A control gathers in reversed
rank order and must differ.

What this does not show: the NCCL all-gather itself (PyNCCL ``all_gatherv``) and the engine
path that enables the shard on a GPU (``tp_prefill_row_sharding_supported``: CUDA, TP > 1,
PyNCCL on, no FULL mixed-batch graphs, at least ``indexer_tp_shard_min_rows`` = 65,536 prefill
rows by default; V4.1's indexers from the candidate source on keep their rows replicated).
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

import subproc

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).with_name("tp_row_shard_probe.py")
CASES = ("ratio2", "ratio1", "ratio4")
LAYOUTS = ("balanced_tp2", "balanced_tp4", "balanced_tp8", "uneven_1_rest_1")


@pytest.fixture(scope="module")
def probe():
    from test_vllm_import import _need_tree, _probe_env
    _need_tree()
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    d = Path(tempfile.gettempdir()) / f"deepinfer-tp-row-shard-{run}"
    d.mkdir(exist_ok=True)
    out = d / "result.json"
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            env = dict(_probe_env(), TRITON_INTERPRET="1", DEEPINFER_ARCH="sm80")
            r = subproc.run([sys.executable, str(PROBE)], env=env, cwd=REPO, cap=300)
            lines = r.stdout.strip().splitlines()
            if r.returncode != 0 or not lines:
                pytest.fail(f"row shard probe failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
            out.write_text(lines[-1])
    res = json.loads(out.read_text())
    assert "error" not in res, f"{res.get('error')}\n{res.get('trace')}"
    return res


def test_our_logits_are_what_the_indexer_calls(probe):
    # patch 0015: fp8_fp4_mqa_logits answered by vllm.deepinfer.kernels.indexer_logits
    assert probe["indexer_logits_routed"] is True


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("scorer", ("ours", "reference"))
def test_gathered_shards_equal_unsharded_bit_for_bit(probe, case, scorer):
    c = probe["cases"][case]
    s = c["scorers"][scorer]
    assert s["selected"] > 0
    assert sorted(s["layouts"]) == sorted(LAYOUTS)
    for name, lay in s["layouts"].items():
        sizes = lay["sizes"]
        assert sum(sizes) == c["rows"] and min(sizes) >= 1, (name, sizes)
        # Every rank, after the exchange, holds the unsharded buffer (int32 bits).
        assert lay["equal"] == [True] * len(sizes), (case, scorer, name)
        # Each rank scored exactly its own rows, no more.
        assert lay["scored_rows"] == sizes, (name, lay["scored_rows"])
        # Its rows follow the decode tokens, contiguous, in rank order.
        bounds = [tuple(lay["bounds"][str(r)]) for r in range(len(sizes))]
        assert bounds[0][0] == c["decode_tokens"]
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("case", CASES)
def test_layouts_cover_what_they_claim(probe, case):
    c = probe["cases"][case]
    lay = c["scorers"]["ours"]["layouts"]
    assert len(lay["balanced_tp8"]["sizes"]) == 8
    assert len(set(lay["balanced_tp8"]["sizes"])) > 1          # uneven row counts
    assert lay["uneven_1_rest_1"]["sizes"][0] == 1
    assert len(c["chunks"]) >= 4                               # several chunks per step
    # Some rank starts strictly inside a chunk (narrow cuts the chunk's causal bounds).
    starts = {tuple(b)[0] for la in lay.values() for b in la["bounds"].values()}
    assert any(ch["token_start"] < s < ch["token_end"] for s in starts for ch in c["chunks"])


def test_the_e2e_counter_counts_every_exchange(probe):
    """benchmarks/e2e/rank_audit.py counts vLLM's exchange_topk calls and rows (what a GPU run
    reports to say the sharded path ran): here every emulated rank's call, controls included."""
    assert probe["counter_installed"] is True
    calls = rows = 0
    for c in probe["cases"].values():
        for s in c["scorers"].values():
            for lay in s["layouts"].values():
                calls += len(lay["sizes"])
                rows += len(lay["sizes"]) * c["rows"]
            calls += len(s["control_reversed_equal"])
            rows += len(s["control_reversed_equal"]) * c["rows"]
    assert probe["counted"] == {"row_shard_exchanges": calls, "row_shard_rows": rows}


def test_ties_were_broken_and_the_control_differs(probe):
    for case in CASES:
        for scorer, s in probe["cases"][case]["scorers"].items():
            assert s["control_reversed_equal"] == [False, False, False], (case, scorer)
    assert sum(s["rows_with_ties"] for c in probe["cases"].values()
               for s in c["scorers"].values()) > 0
