"""DeepInfer-SM80: DeepSeek-V4.1/V4 sparse-attention kernels for Ampere and faster paths on
Hopper/Blackwell, as an overlay package of vLLM 0.33.0.

Importable with only torch and triton (PYTHONPATH=overlay); vLLM is not needed here. The
kernel variant is resolved at import (``vllm.deepinfer.arch``) and logged once, with the
features in force (``vllm.deepinfer.envs``).
"""
from __future__ import annotations

import logging

from vllm.deepinfer import arch, envs

__version__ = "0.1.0"
VLLM_VERSION = "0.33.0"

_logger = logging.getLogger("vllm.deepinfer")

# Unknown or malformed DEEPINFER_* variables fail the import, naming them (envs.py).
envs.check_at_import()


def _announce() -> None:
    try:
        v = arch.current()
    except arch.UnsupportedGPU as e:
        _logger.warning("deepinfer: %s; every feature falls back to upstream vLLM", e)
        return
    _logger.info("deepinfer %s: kernel variant %s (%s; %s); features: %s", __version__, v.name,
                 arch.reason(), v.description, envs.summary(v.name))
    if not v.hw_fp8 and v.name != "cpu":
        # What upstream runs in their place loads or stores float8_e4m3fn in Triton, which
        # refuses fp8e4nv below sm_89: switching them off here means a compile error later.
        off = [f for f in _NEEDS_SW_FP8 if not envs.enabled(f, v.name)]
        if off:
            _logger.warning("deepinfer: %s switched off on %s: upstream's Triton kernels for "
                            "them use fp8e4nv, which does not compile below sm_89",
                            ", ".join(off), v.name)
    if v.name in ("sm80", "sm86", "sm89") and not envs.enabled("indexer_logits", v.name):
        # Upstream's only CUDA indexer scorer is DeepGEMM, built for SM90/SM100.
        _logger.warning("deepinfer: indexer_logits switched off on %s: upstream scores the "
                        "sparse indexer with DeepGEMM, which does not exist below sm_90 "
                        "(contexts longer than top-k x compress ratio will fail)", v.name)


# Features whose upstream fallback is an fp8 Triton kernel (unrunnable on sm80/sm86).
_NEEDS_SW_FP8 = ("fp8_sw", "kv_gather", "sparse_mla_decode")


_announce()
