"""Feature ``warmup_threads`` (vllm.deepinfer.warmup_threads): how many TileLang builds the JIT
warmup runs at once, our projection's keys built by TileLang's par_compile with the same CUDA
source as one at a time, and patch 0032 handing the worker count to upstream's epilogue
owner."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from vllm.deepinfer import routing, warmup_threads
import patched_python
import subproc

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


_BUILD = r"""
import hashlib, json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "overlay"))
from tilelang import tvm
from vllm.deepinfer.mhc import kernels
keys = [kernels.TcKey(k=2048, n_out=24, block_m=16, n_splits=1),
        kernels.TcKey(k=2048, n_out=24, block_m=64, n_splits=4),
        kernels.TcKey(k=4096, n_out=24, block_m=32, n_splits=16)]
with tvm.target.Target({"kind": "cuda", "arch": "sm_80"}):
    if sys.argv[2] == "par":
        kernels.compile_tc_many(keys, 3)
        assert set(kernels._BUILT) == set(keys)
    src = [kernels.compile_tc(k).get_kernel_source() for k in keys]
print(json.dumps([hashlib.sha256(s.encode()).hexdigest() for s in src]))
"""


def test_par_compile_builds_the_same_kernels(tmp_path):
    """Three projection keys for sm_80, each run with a TileLang cache of its own: built by
    compile_tc_many (elaborated in turn, par_compile on three threads) and one at a time by
    compile_tc: the same CUDA source per key."""
    if importlib.util.find_spec("tilelang") is None:
        pytest.skip("tilelang missing: pip install -r requirements-test.txt (or `make venv`)")
    script = tmp_path / "build.py"
    script.write_text(_BUILD)
    out = {}
    for mode in ("par", "serial"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
        env.update(CUDA_VISIBLE_DEVICES="", TILELANG_CACHE_DIR=str(tmp_path / f"cache-{mode}"))
        r = subproc.run([sys.executable, str(script), str(REPO), mode], env=env, cap=600)
        assert r.returncode == 0, r.stderr[-3000:]
        out[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["par"] == out["serial"] and len(set(out["par"])) == 3


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
