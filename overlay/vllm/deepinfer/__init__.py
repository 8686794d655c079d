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


def _announce() -> None:
    try:
        v = arch.current()
    except arch.UnsupportedGPU as e:
        _logger.warning("deepinfer: %s; every feature falls back to upstream vLLM", e)
        return
    _logger.info("deepinfer %s: kernel variant %s (%s; %s); features: %s", __version__, v.name,
                 arch.reason(), v.description, envs.summary(v.name))


_announce()
