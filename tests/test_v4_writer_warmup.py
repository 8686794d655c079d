"""Patch 0010: vLLM's JIT warmup must not compile upstream's fp8e4nv inverse-RoPE + quant kernel
where our fp8-free writer replaces it (found on the H200 by the nocompile run of the A100-faithful
mode: the warmup compiled FusedInvRopeFP8QuantKernel, which fails to build for sm_80/sm_86), and
must keep upstream's keys where upstream's kernel runs. Runs the patched tree in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("DEEPINFER_BUILD", REPO / "build"))
PATCHED = BUILD / "patched"

PROBE = r"""
import json, sys
from types import SimpleNamespace as NS
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
major, minor = map(int, sys.argv[1].split("."))
current_platform.get_device_capability = lambda device_id=0: DeviceCapability(major, minor)
current_platform.is_arch_support_pdl = lambda: False
import importlib
m = importlib.import_module('vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant')
cfg = NS(model_config=NS(hf_config=NS(num_attention_heads=64, o_groups=8, head_dim=512,
                                      qk_rope_head_dim=64)),
         parallel_config=NS(tensor_parallel_size=1))
print(json.dumps(len(m.FusedInvRopeFP8QuantKernel().get_warmup_keys(cfg))))
"""


def _keys(capability: str, env: dict) -> int:
    if not (PATCHED / ".ok").is_file():
        msg = "build/patched missing: run `make patched`"
        if os.environ.get("DEEPINFER_REQUIRE_UPSTREAM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    full = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    full.update(env, PYTHONPATH=str(PATCHED), CUDA_VISIBLE_DEVICES="")
    full.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", PROBE, capability], env=full, capture_output=True,
                       text=True, timeout=300, cwd=str(REPO))
    last = (r.stderr.strip().splitlines() or [""])[-1]
    if r.returncode != 0 and last.startswith("ModuleNotFoundError"):
        if os.environ.get("DEEPINFER_REQUIRE_UPSTREAM") == "1":
            pytest.fail(r.stderr[-2000:])
        pytest.skip(last)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_no_upstream_fp8_warmup_keys_where_our_writer_runs():
    assert _keys("8.0", {"DEEPINFER_ARCH": "sm80"}) == 0


def test_upstream_keys_kept_where_upstream_runs():
    assert _keys("9.0", {"DEEPINFER_DISABLE": "all"}) >= 1
