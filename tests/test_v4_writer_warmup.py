"""Patch 0010: vLLM's JIT warmup must not compile upstream's fp8e4nv inverse-RoPE + quant kernel
where our fp8-free writer replaces it (found on the H200 by the nocompile run of the A100-faithful
mode: the warmup compiled FusedInvRopeFP8QuantKernel, which fails to build for sm_80/sm_86), and
must keep upstream's keys where upstream's kernel runs. Runs the patched tree in a subprocess."""
from __future__ import annotations

from patched_python import run_json

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
    return run_json(["-c", PROBE, capability], env, timeout=300)


def test_no_upstream_fp8_warmup_keys_where_our_writer_runs():
    assert _keys("8.0", {"DEEPINFER_ARCH": "sm80"}) == 0


def test_upstream_keys_kept_where_upstream_runs():
    assert _keys("9.0", {"DEEPINFER_DISABLE": "all"}) >= 1
