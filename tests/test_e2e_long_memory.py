"""The long step's memory figures (benchmarks/e2e/long_memory.py): the allocator history of a
request (DEEPINFER_LONG_MEMORY_TRACE), what was live at its peak, and what stays resident
after start-up, on fake allocator snapshots."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "e2e"))


def test_memory_trace_keeps_large_allocations_with_their_frames():
    """DEEPINFER_LONG_MEMORY_TRACE: the allocator history's allocations of at least the
    threshold, largest first, with the frames outside torch that made them."""
    mib = 2 ** 20
    frames = [dict(filename="/x/torch/nn/functional.py", line=1, name="linear"),
              dict(filename="/site/vllm/model_executor/layers/sparse_attn_indexer.py",
                   line=503, name="_prefill")]
    snap = {"device_traces": [[
        dict(action="alloc", addr=1, size=512 * mib, frames=frames),
        dict(action="alloc", addr=2, size=8 * mib, frames=frames),
        dict(action="free_completed", addr=1, size=512 * mib, frames=[]),
        dict(action="alloc", addr=3, size=1024 * mib, frames=[])]]}
    import run_long
    got = run_long.trace_allocations(snap, 64)
    assert got == [dict(mib=1024.0, freed=False, frames=[]),
                   dict(mib=512.0, freed=True,
                        frames=["model_executor/layers/sparse_attn_indexer.py:503 _prefill"])]


def test_memory_trace_peak_lists_what_coexists_at_the_peak():
    """The trace's activation peak: the bytes allocated inside the trace live at once, and
    the large blocks live at that moment (a block freed before the peak is not among them)."""
    mib = 2 ** 20
    fr = [dict(filename="/site/vllm/deepinfer/kernels/indexer_logits.py", line=429,
               name="_output")]
    snap = {"device_traces": [[
        dict(action="alloc", addr=1, size=512 * mib, frames=fr),
        dict(action="free_completed", addr=1, size=512 * mib, frames=[]),
        dict(action="alloc", addr=2, size=256 * mib, frames=[]),
        dict(action="alloc", addr=3, size=300 * mib, frames=fr),
        dict(action="alloc", addr=4, size=1 * mib, frames=[]),
        dict(action="free_completed", addr=3, size=300 * mib, frames=[]),
        dict(action="free_completed", addr=9, size=5 * mib, frames=[])]]}
    import run_long
    got = run_long.trace_peak(snap, 64)
    assert got == dict(peak_mib=557.0, live_blocks=3,
                       large=[dict(mib=300.0,
                                   frames=["deepinfer/kernels/indexer_logits.py:429 _output"]),
                              dict(mib=256.0, frames=[])])
    assert run_long.trace_peak({"device_traces": [[]]}, 64) is None


def test_resident_blocks_group_what_stays_allocated_by_its_code():
    """The resident memory after start-up, by allocating code: only allocated blocks count,
    grouped by their innermost frames outside torch, small groups left out."""
    mib = 2 ** 20
    ws = [dict(filename="/site/vllm/v1/worker/workspace.py", line=90, name="_grow"),
          dict(filename="/x/torch/cuda/memory.py", line=1, name="empty")]
    snap = {"segments": [
        dict(blocks=[dict(state="active_allocated", size=300 * mib, frames=ws),
                     dict(state="inactive", size=900 * mib, frames=ws),
                     dict(state="active_allocated", size=200 * mib, frames=ws)]),
        dict(blocks=[dict(state="active_allocated", size=2048 * mib),
                     dict(state="active_allocated", size=8 * mib,
                          frames=[dict(filename="/a/b/c.py", line=3, name="f")])])]}
    import run_long
    got = run_long.resident_blocks(snap, 64)
    assert got == [dict(mib=2048.0, count=1, frames=[]),
                   dict(mib=500.0, count=2, frames=["v1/worker/workspace.py:90 _grow"])]


def test_resident_trace_switch_and_its_default(monkeypatch):
    """DEEPINFER_LONG_RESIDENT_TRACE alone traces start-up only (the timed requests stay
    untraced); DEEPINFER_LONG_MEMORY_TRACE implies it; a value that is not a size is refused
    with the variable's name."""
    import pytest
    import long_memory as lm
    monkeypatch.delenv(lm.MEMORY_TRACE_ENV, raising=False)
    monkeypatch.delenv(lm.RESIDENT_TRACE_ENV, raising=False)
    assert lm.resident_trace_mib() is None and lm.memory_trace_mib() is None
    monkeypatch.setenv(lm.RESIDENT_TRACE_ENV, "32")
    assert lm.resident_trace_mib() == 32.0 and lm.memory_trace_mib() is None
    monkeypatch.delenv(lm.RESIDENT_TRACE_ENV)
    monkeypatch.setenv(lm.MEMORY_TRACE_ENV, "64")
    assert lm.resident_trace_mib() == 64.0
    monkeypatch.setenv(lm.RESIDENT_TRACE_ENV, "lots")
    with pytest.raises(SystemExit, match=lm.RESIDENT_TRACE_ENV):
        lm.resident_trace_mib()


def _run(after_load, after_warmup, init=None):
    gib = 1 << 30
    budget = dict(requested_memory=100 * gib, total_consumed=8 * gib,
                  peak_activation_memory=2 * gib)
    if init is not None:
        budget["init_used_memory"] = init * gib
    return dict(kv=dict(worker=dict(budget=budget,
                                    available_kv_cache_memory_bytes=90 * gib)),
                memory_after_load=after_load, memory_after_warmup=after_warmup)


def test_checkpoint_rows_set_resident_memory_against_vllms_accounting():
    """kernel="long_memory_checkpoint": torch allocated + outside torch against the device's
    use at vLLM's first reading + total_consumed + KV bytes, at both checkpoints; a failed
    checkpoint gives no row."""
    import long_step
    load = dict(allocated_gib=97.5, reserved_gib=98.0, outside_torch_gib=1.0,
                resident=[dict(mib=512.0, count=1, frames=["a.py:1 f"])])
    rows = long_step.memory_checkpoint_rows("v41-long", "a100", "eager",
                                            _run(load, dict(error="x"), init=0.5))
    assert len(rows) == 1
    (r,) = rows
    assert r["kernel"] == "long_memory_checkpoint" and r["shape"]["at"] == "after_load"
    assert r["vllm_expected_gib"] == 98.5 and r["resident_gib"] == 98.5
    assert r["resident_over_gib"] == 0.0 and r["init_used_gib"] == 0.5
    assert r["resident"] == load["resident"]
    warm = dict(allocated_gib=98.5, reserved_gib=99.0, outside_torch_gib=1.0)
    rows = long_step.memory_checkpoint_rows("v41-long", "a100", "eager", _run(load, warm))
    assert [r["shape"]["at"] for r in rows] == ["after_load", "after_warmup"]
    # without the first reading (older engines) the expectation counts from zero
    assert rows[1]["vllm_expected_gib"] == 98.0 and rows[1]["resident_over_gib"] == 1.5


def test_budget_separates_what_preceded_vllms_first_reading():
    """The device peak against the budget, with and without what the device held before
    vLLM's first reading (its budget, total x gpu_memory_utilization, excludes it)."""
    import long_step
    kv = _run(None, None, init=0.75)["kv"]
    q = dict(peak_reserved_gib=99.0, outside_torch_gib=2.0)
    got = long_step.memory_budget(kv, q)
    assert got["over_budget_gib"] == 1.0 and got["init_used_gib"] == 0.75
    assert got["over_budget_after_init_gib"] == 0.25
    assert long_step.memory_budget(_run(None, None)["kv"], q)["over_budget_after_init_gib"] is None


def test_stack_limit_is_read_from_the_driver_and_sized_for_every_resident_thread():
    """long_memory.stack_limit_bytes asks cuCtxGetLimit for CU_LIMIT_STACK_SIZE; a missing
    driver or a failing call gives None, never an exception; the estimate backs the limit for
    every thread the device holds."""
    import ctypes

    import long_memory

    class Lib:
        def __init__(self, value, rc=0):
            self.value, self.rc, self.asked = value, rc, None

        def cuCtxGetLimit(self, ptr, limit):
            self.asked = limit
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_size_t))[0] = self.value
            return self.rc

    lib = Lib(9216)
    assert long_memory.stack_limit_bytes(lib) == 9216 and lib.asked == 0
    assert long_memory.stack_limit_bytes(Lib(9216, rc=201)) is None  # CUDA_ERROR_INVALID_CONTEXT
    assert long_memory.stack_limit_bytes(object()) is None           # no such symbol
    f = long_memory.local_memory_figures(9216, 132, 2048)
    assert f["stack_limit_bytes"] == 9216
    assert abs(f["local_memory_estimate_gib"] - 9216 * 2048 * 132 / 2**30) < 1e-12
    assert long_memory.local_memory_figures(None, 132, 2048)["local_memory_estimate_gib"] is None
    assert long_memory.local_memory_figures(1024, 132, None)["local_memory_estimate_gib"] is None


def test_checkpoint_rows_carry_the_stack_limit():
    import long_step
    load = dict(allocated_gib=97.5, reserved_gib=98.0, outside_torch_gib=1.0,
                stack_limit_bytes=1024, local_memory_estimate_gib=0.26)
    (r,) = long_step.memory_checkpoint_rows("v4-long", "a100", "eager", _run(load, None))
    assert r["stack_limit_bytes"] == 1024 and r["local_memory_estimate_gib"] == 0.26
