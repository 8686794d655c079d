"""The end-to-end audit's zero-compile check (benchmarks/e2e/audit.py), without vLLM or a GPU:
a Triton JIT cache miss or a TileLang compile while serving is a failure naming the kernel and
its full key; the same compile while loading (vLLM's warmup) is not. The check itself runs on
the H200 (benchmarks/e2e/e2e.py --steps ckpt,nocompile)."""
from __future__ import annotations

import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "e2e"))
import audit  # noqa: E402


def _compile(rec, name="vllm.deepinfer.kernels.kv_gather._gather_kernel", warps=4):
    module, _, fn = name.rpartition(".")
    rec._triton_hook(key="k", repr=None,
                     fn=types.SimpleNamespace(module=module, name=fn, jit_function=None),
                     compile={"signature": {"out_ptr": "*bf16", "n": "i32"},
                              "constants": {"BLOCK": 16}, "configs": [{(0,): [["tt.divisibility", 16]]}],
                              "num_warps": warps, "num_stages": 1},
                     is_manual_warmup=False, already_compiled=False)


def test_compiles_while_loading_pass():
    rec = audit.Recorder()
    _compile(rec)
    assert rec.compiles == {"load": 1} and audit.serve_compile_failures(rec) == []


def test_compiles_while_serving_fail_with_their_key():
    rec = audit.Recorder()
    _compile(rec)
    with rec.serving():
        _compile(rec)
        _compile(rec)
        _compile(rec, "vllm.v1.worker.utils._zero_kv_blocks_kernel", warps=8)
    failures = audit.serve_compile_failures(rec)
    assert len(failures) == 2 and rec.compiles == {"load": 1, "serve": 3}
    gather = next(f for f in failures if "_gather_kernel" in f)
    assert gather.startswith("compiled while serving (2x): triton vllm.deepinfer")
    assert "BLOCK" in gather and "tt.divisibility" in gather and "num_warps=4" in gather
    assert any("_zero_kv_blocks_kernel" in f and "num_warps=8" in f for f in failures)


def test_tilelang_compiles_while_serving_fail():
    rec = audit.Recorder()
    rec.tilelang_by_phase["load"] += 3
    assert audit.serve_compile_failures(rec) == []
    rec.tilelang_by_phase["serve"] += 1
    assert audit.serve_compile_failures(rec) == [
        "compiled while serving: 1 TileLang kernel(s)"]


def test_sampler_compiles_are_listed_apart_not_excused_silently():
    """vLLM's logprob kernels compile on the first logprobs request on any GPU: outside the
    Ampere path, so they do not fail the check, but check() lists them."""
    rec = audit.Recorder()
    with rec.serving():
        _compile(rec, "vllm.v1.worker.gpu.sample.logprob._topk_log_softmax_kernel")
    assert audit.serve_compile_failures(rec) == []
    assert [c["name"] for c in rec.serve_compiles if audit.outside_path(c)] == [
        "vllm.v1.worker.gpu.sample.logprob._topk_log_softmax_kernel"]
    with rec.serving():
        _compile(rec, "vllm.v1.attention.ops.rocm_aiter_mla_sparse._count_valid_row_entries_kernel")
    assert len(audit.serve_compile_failures(rec)) == 1
