"""The tput step's served decode-step comparison of the one-launch mHC decode kernel
(benchmarks/e2e/e2e.py mhc_decode_served_rows, run.py's a100_mhcdec_off / _on modes): rows
only for batches both modes measured, step times and their ratio from the modes' tokens/s."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "e2e"))
import e2e  # noqa: E402
import run  # noqa: E402


def _row(mode, batch, tps, phase="decode"):
    return dict(kernel="e2e", variant=mode, tokens_per_s=tps,
                shape=dict(model="v41-tput", phase=phase, batch=batch, prompt_len=512),
                timing="engine steps after the last prefill")


def test_modes_force_the_switch_both_ways():
    off, on = e2e.TPUT_EXTRA_MODES
    assert run.MODES[off]["DEEPINFER_MHC_DECODE"] == "0"
    assert run.MODES[on]["DEEPINFER_MHC_DECODE"] == "1"
    for m in (off, on):   # otherwise the A100-faithful engine
        assert run.MODES[m]["DEEPINFER_EMULATE_CAPABILITY"] == "8.0"


def test_rows_pair_the_modes_by_batch():
    off, on = e2e.TPUT_EXTRA_MODES
    rows = [_row(off, 1, 50.0), _row(on, 1, 55.0), _row(off, 8, 320.0), _row(on, 8, 300.0),
            _row(off, 32, 900.0),                     # no "on" row: no comparison
            _row("a100", 1, 99.0), _row(on, 1024, 5000.0, phase="prefill")]
    out = e2e.mhc_decode_served_rows(rows)
    assert [r["shape"]["batch"] for r in out] == [1, 8]
    r1, r8 = out
    assert r1["kernel"] == "mhc_decode_served" and r1["variant"] == "a100"
    assert r1["off_step_us"] == pytest.approx(1e6 / 50.0, abs=0.1)
    assert r1["on_step_us"] == pytest.approx(1e6 / 55.0, abs=0.1)
    assert r1["speedup"] == pytest.approx(1.1, abs=1e-4)
    assert r8["speedup"] == pytest.approx(300.0 / 320.0, abs=1e-4) and r8["speedup"] < 1


def test_failed_batches_make_no_row():
    off, on = e2e.TPUT_EXTRA_MODES
    assert e2e.mhc_decode_served_rows([_row(off, 1, None), _row(on, 1, 55.0)]) == []
