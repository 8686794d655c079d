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
