"""benchmarks/merge_results.py: the parts of one split suite run become one results file."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import merge_results as mr  # noqa: E402
from suites import sparse_mla_prefill as suite  # noqa: E402

META = dict(gpu="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0", commit="abc1234",
            suites=["sparse_mla_prefill"], failed_suites=[])


def _part(i, n, matmul):
    rows = [{"kernel": "sparse_mla_prefill", "variant": v,
             "shape": dict(zip(("tokens", "ctx", "topk", "ratio", "heads"), c))}
            for c in suite.cases(False, f"{i}/{n}") for v in ("sm90", "sm80")]
    return {"meta": dict(META, date=f"d{i}", bf16_matmul_TFLOPs=matmul,
                         copy_bandwidth_GBps=4200.0), "rows": rows}


def test_parts_merge_back_into_the_suite_order():
    parts = [_part(1, 2, 690.0), _part(2, 2, 686.0)]
    out = mr.merge(parts, ["a.json", "b.json"], suite.case_order)
    full = [c for c in suite.cases(False) for _ in ("sm90", "sm80")]
    got = [tuple(r["shape"][k] for k in ("tokens", "ctx", "topk", "ratio", "heads"))
           for r in out["rows"]]
    assert got == full
    assert [r["variant"] for r in out["rows"][:2]] == ["sm90", "sm80"]
    assert out["meta"]["commit"] == "abc1234"
    assert [p["bf16_matmul_TFLOPs"] for p in out["meta"]["parts"]] == [690.0, 686.0]
    assert [p["file"] for p in out["meta"]["parts"]] == ["a.json", "b.json"]


@pytest.mark.parametrize("field,value", [("commit", "def5678"), ("gpu", "NVIDIA A100"),
                                         ("failed_suites", ["sparse_mla_prefill"])])
def test_parts_of_different_runs_are_refused(field, value):
    a, b = _part(1, 2, 690.0), _part(2, 2, 686.0)
    b["meta"][field] = value
    with pytest.raises(ValueError, match="b.json"):
        mr.merge([a, b], ["a.json", "b.json"])
