"""Feature ``warmup_threads`` (vllm.deepinfer.warmup_threads): how many TileLang builds the JIT
warmup runs at once, our projection's keys built by TileLang's par_compile with the same CUDA
source as one at a time, and patch 0032 handing the worker count to upstream's epilogue
owner."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from vllm.deepinfer import routing, warmup_threads
import patched_python

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ARCH", "sm80")
    monkeypatch.delenv("DEEPINFER_WARMUP_THREADS", raising=False)
    routing.reset()
    yield
    routing.reset()


def test_workers_follow_the_switch_keys_and_cpus(monkeypatch):
    w = warmup_threads.workers
    assert w(0) == w(1) == 1 and w(1, off=4) == 1
    assert w(13, off=4, cpus=16) == warmup_threads.MAX_THREADS == 8
    assert w(13, off=4, cpus=2) == 2 and w(3, off=4, cpus=16) == 3
    assert w(13, off=4, cpus=None) == min(8, os.cpu_count() or 1)
    monkeypatch.setenv("DEEPINFER_WARMUP_THREADS", "0")
    routing.reset()
    # off: upstream's own count (4 for its epilogue owner), ours one at a time
    assert w(13, off=4, cpus=16) == 4 and w(3, off=4, cpus=16) == 3
    assert w(7, cpus=16) == 1


def test_par_compile_builds_the_same_kernels():
    """Three projection keys for sm_80, each form in a process with a TileLang cache of its
    own (benchmarks/diag/warmup_threads.py measure): built by compile_tc_many (elaborated in
    turn, par_compile on three threads) and one at a time by compile_tc: the same CUDA source
    per key."""
    if importlib.util.find_spec("tilelang") is None:
        pytest.skip("tilelang missing: pip install -r requirements-test.txt (or `make venv`)")
    sys.path.insert(0, str(REPO / "benchmarks" / "diag"))
    import warmup_threads as diag
    keys = ((2048, 24, 16, 1), (2048, 24, 64, 4), (4096, 24, 32, 16))
    par, serial = diag.measure(3, keys), diag.measure(1, keys)
    assert par["sha256"] == serial["sha256"] and len(set(par["sha256"])) == 3


_EPILOGUE = r"""
import dataclasses, json
from vllm.model_executor.kernels.mhc import warmup as w
calls = []
class Fake:
    @staticmethod
    def par_compile(configs, num_workers):
        calls.append(num_workers)
        return [object() for _ in configs]
owner = w.MHCPreNormKernel()
owner.kernel = Fake()
key = w.MHCPreNormKernel.CompileKey(hidden_size=4096, rms_eps=1e-6, hc_pre_eps=1e-6,
    hc_sinkhorn_eps=1e-6, hc_post_mult_value=2.0, sinkhorn_repeat=20, norm_eps=1e-6,
    n_splits=1, hc_mult=4, use_pre_mix_in=True, rms_numel=16384)
keys = [dataclasses.replace(key, n_splits=s) for s in range(1, 14)]
owner.compile_many(keys)
print(json.dumps(dict(workers=calls, built=len(owner._compiled_cache))))
"""


@pytest.mark.parametrize("switch,want", [(None, None), ("0", 4)])
def test_patched_epilogue_owner_takes_the_worker_count(tmp_path, switch, want):
    """Patch 0032: upstream's V4.1 epilogue owner builds 13 keys with warmup_threads.workers
    (upstream's min(4, keys) with the feature off)."""
    probe = tmp_path / "probe.py"
    probe.write_text(_EPILOGUE)
    env = dict(DEEPINFER_ARCH="sm80")
    if switch is not None:
        env["DEEPINFER_WARMUP_THREADS"] = switch
    got = patched_python.run_json([str(probe)], env=env, timeout=300)
    cpus = os.cpu_count() or 1
    assert got == dict(workers=[want or min(8, cpus, 13)], built=13)
