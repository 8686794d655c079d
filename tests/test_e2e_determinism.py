"""benchmarks/e2e/determinism.py on fake run.py outputs: rows say whether each later
generation equals the first, reuse-off generations are marked, torch's warnings counted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "e2e"))
import determinism  # noqa: E402


def _gen(tok, lp=-0.5):
    return [dict(prompt_len=3, prompt=[[tok, lp, lp], [7, -0.4, -0.4]],
                 generated=[[9, -0.1, []], [tok, -0.2, []]])]


def test_rows_from_case_outputs(tmp_path):
    base = dict(gpu="NVIDIA H200", torch="2.11", triton="3.6")
    json.dump(dict(base, prompts=_gen(5), repeats=[_gen(5), _gen(5, -0.49)]),
              open(tmp_path / "v4-mini-fp8-a100det-300.json", "w"))
    json.dump(dict(base, prompts=_gen(5), repeats=[_gen(5)], noyoco_in_process=_gen(6)),
              open(tmp_path / "v41-mini-mxfp8-a100det-1s.json", "w"))
    json.dump(dict(base, prompts=_gen(5), repeats=[_gen(5)]),
              open(tmp_path / "v41-mini-mxfp8-td.json", "w"))
    (tmp_path / "v41-mini-mxfp8-td.log").write_text(
        "UserWarning: x does not have a deterministic implementation, but you set ...\n")
    rows = {(r["shape"]["model"], r["variant"]): r for r in determinism.rows_from(tmp_path)}
    assert set(rows) == {("v4-mini", "a100det-300"), ("v41-mini", "a100det-1s"),
                         ("v41-mini", "td")}
    r = rows[("v4-mini", "a100det-300")]
    assert [c["identical"] for c in r["against_first"]] == [True, False]
    assert r["identical"] is False and r["against_first"][1]["first_prompt_difference"] == [0]
    r = rows[("v41-mini", "a100det-1s")]
    assert [(c["reuse"], c["identical"]) for c in r["against_first"]] == [(True, True),
                                                                          (False, False)]
    assert rows[("v41-mini", "td")]["torch_nondeterministic_op_warnings"] == 1
    assert rows[("v41-mini", "td")]["identical"] is True
