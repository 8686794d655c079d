"""vllm.deepinfer.bucket_warmup: the first launch of a wrapped upstream kernel compiles its
other size buckets on the launch's own arguments (patch 0027 wraps DFlash/DSpark's
``_prepare_dflash_inputs_kernel``, whose BLOCK_SIZE moved into buckets no warmup compiled
on the H200)."""
from __future__ import annotations

import pytest

import patched_python
from vllm.deepinfer import bucket_warmup as bw


def test_pow2_buckets():
    assert bw.pow2_buckets(6, 256) == [8, 16, 32, 64, 128, 256]
    assert bw.pow2_buckets(1, 4) == [1, 2, 4]
    assert bw.pow2_buckets(300, 256) == []
    with pytest.raises(ValueError, match="power of two"):
        bw.pow2_buckets(1, 100)


def test_dflash_buckets_cover_every_launch_choice():
    """prepare_dflash_inputs: BLOCK_SIZE = min(256, next_pow2(q + num_query_per_req)) for a
    longest query q >= 1: every value it can pick is among the buckets, and nothing else."""
    for nq in (1, 2, 5, 6, 8, 200, 300):
        picks = set()
        for q in range(1, 5000):
            n = q + nq
            p = 1
            while p < n:
                p *= 2
            picks.add(min(256, p))
        assert set(bw.dflash_prepare_buckets({"num_query_per_req": nq})) == picks, nq


class FakeKernel:
    """Records launches and compile-only warmups the way a JITFunction is called."""
    __name__ = "fake_kernel"
    arg_names = ["x_ptr", "n", "MODE", "BLOCK"]
    constexprs = [2, 3]

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **k: self.calls.append(("launch", grid, a, k))

    def warmup(self, *a, grid, **k):
        self.calls.append(("warmup", grid, a, k))


def _buckets(bound):
    return bw.pow2_buckets(bound["n"], 8)


def test_first_launch_compiles_the_other_buckets(monkeypatch):
    monkeypatch.delenv("DEEPINFER_SERVE_WARMUP", raising=False)
    monkeypatch.delenv("DEEPINFER_DISABLE", raising=False)
    k = FakeKernel()
    w = bw.BucketWarmup(k, "BLOCK", _buckets)
    w[(3, 1)]("ptr", 2, MODE=0, BLOCK=4)
    assert k.calls[0] == ("launch", (3, 1), ("ptr", 2), dict(MODE=0, BLOCK=4))
    assert k.calls[1:] == [("warmup", (3, 1), ("ptr", 2), dict(MODE=0, BLOCK=b)) for b in (2, 8)]
    k.calls.clear()
    w[(1,)]("ptr", 2, MODE=0, BLOCK=8)          # same other constexprs: launch only
    assert [c[0] for c in k.calls] == ["launch"]
    k.calls.clear()
    w[(1,)]("ptr", 5, MODE=1, BLOCK=8)          # a new MODE: its buckets compile once
    assert [(c[0], c[3]["BLOCK"]) for c in k.calls] == [("launch", 8)]
    assert w.arg_names == k.arg_names and w.__name__ == "fake_kernel"


def test_new_setting_of_other_constexprs_warms_again(monkeypatch):
    monkeypatch.delenv("DEEPINFER_SERVE_WARMUP", raising=False)
    k = FakeKernel()
    w = bw.BucketWarmup(k, "BLOCK", lambda b: [1, 2, 4])
    w[(1,)]("p", 1, MODE=0, BLOCK=1)
    w[(1,)]("p", 1, MODE=1, BLOCK=2)
    assert [(c[0], c[3]["MODE"], c[3]["BLOCK"]) for c in k.calls] == [
        ("launch", 0, 1), ("warmup", 0, 2), ("warmup", 0, 4),
        ("launch", 1, 2), ("warmup", 1, 1), ("warmup", 1, 4)]


def test_switch_off_and_capture_defer(monkeypatch):
    k = FakeKernel()
    w = bw.BucketWarmup(k, "BLOCK", lambda b: [1, 2])
    monkeypatch.setenv("DEEPINFER_SERVE_WARMUP", "0")
    w[(1,)]("p", 1, MODE=0, BLOCK=1)
    assert [c[0] for c in k.calls] == ["launch"]
    monkeypatch.delenv("DEEPINFER_SERVE_WARMUP")
    monkeypatch.setattr(bw, "_capturing", lambda: True)
    w[(1,)]("p", 1, MODE=0, BLOCK=1)
    assert [c[0] for c in k.calls] == ["launch", "launch"]
    monkeypatch.setattr(bw, "_capturing", lambda: False)
    w[(1,)]("p", 1, MODE=0, BLOCK=1)             # outside capture: now it compiles
    assert [c[0] for c in k.calls] == ["launch", "launch", "launch", "warmup"]


def test_unknown_param_is_refused():
    with pytest.raises(ValueError, match="no argument 'BLOCK_N'"):
        bw.BucketWarmup(FakeKernel(), "BLOCK_N", lambda b: [1])


def test_real_jit_function_sees_launch_then_compile_only_runs(monkeypatch):
    """Against Triton's own JITFunction: the launch is run(warmup=False) and each other bucket
    run(warmup=True) with the launch's arguments, as JITFunction.warmup makes it."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    def body(x_ptr, n, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), n)

    kern = JITFunction(body)   # not triton.jit: the tests run under TRITON_INTERPRET
    seen = []
    monkeypatch.setattr(kern, "run", lambda *a, grid, warmup, **k: seen.append(
        (grid, warmup, a, k)))
    monkeypatch.delenv("DEEPINFER_SERVE_WARMUP", raising=False)
    w = bw.BucketWarmup(kern, "BLOCK", lambda b: [16, 32, 64])
    w[(2,)]("X", 7, BLOCK=32)
    assert [(s[1], s[3]["BLOCK"]) for s in seen] == [(False, 32), (True, 16), (True, 64)]
    assert all(s[0] == (2,) and s[2][1] == 7 for s in seen)


PROBE = r'''
import json
from vllm.v1.worker.gpu.spec_decode.dflash import speculator as s
from vllm.deepinfer import bucket_warmup as bw
k = s._prepare_dflash_inputs_kernel
print(json.dumps(dict(kind=type(k).__name__, param=k.param, inner=type(k.kernel).__name__,
                      fn_is_kernel=k.fn is k.kernel,
                      names=k.arg_names, constexprs=k.constexprs,
                      buckets=k.buckets({"num_query_per_req": 5}))))
'''


def test_patched_vllm_wraps_the_dflash_prepare_kernel():
    got = patched_python.run_json(["-c", PROBE], env={})
    assert got["kind"] == "BucketWarmup" and got["param"] == "BLOCK_SIZE"
    assert got["inner"] == "JITFunction" and got["fn_is_kernel"]
    assert "num_query_per_req" in got["names"] and "BLOCK_SIZE" in got["constexprs"]
    assert got["buckets"] == [8, 16, 32, 64, 128, 256]


def test_a_failed_warmup_leaves_the_launch_and_is_logged(monkeypatch, caplog):
    """A bucket that fails to compile at the first launch does not fail that launch (it ran
    already): a warning names the kernel, and the buckets compile on demand later."""
    monkeypatch.delenv("DEEPINFER_SERVE_WARMUP", raising=False)
    k = FakeKernel()

    def boom(*a, grid, **kw):
        raise RuntimeError("ptxas died")
    k.warmup = boom
    w = bw.BucketWarmup(k, "BLOCK", lambda b: [1, 2])
    with caplog.at_level("WARNING", logger="vllm.deepinfer"):
        w[(1,)]("p", 1, MODE=0, BLOCK=1)
    assert [c[0] for c in k.calls] == ["launch"]
    assert "fake_kernel" in caplog.text and "ptxas died" in caplog.text


def test_warmed_launches_skip_the_switch_and_the_binding(monkeypatch):
    """Once a setting is warmed, later launches (one per draft step) only form the key: the
    feature switch is not read again."""
    monkeypatch.delenv("DEEPINFER_SERVE_WARMUP", raising=False)
    k = FakeKernel()
    w = bw.BucketWarmup(k, "BLOCK", lambda b: [1, 2])
    w[(1,)]("p", 1, MODE=0, BLOCK=1)
    from vllm.deepinfer import envs

    def no_env(*a, **kw):
        raise AssertionError("the switch was read on a warmed launch")
    monkeypatch.setattr(envs, "enabled", no_env)
    w[(1,)]("p", 3, 0, 2)                      # positional constexprs: the same key
    assert [c[0] for c in k.calls] == ["launch", "warmup", "launch"]
