"""Test-only: make vLLM see a GPU of another compute capability.

``DEEPINFER_EMULATE_CAPABILITY=8.0`` (or ``8.6``) makes vLLM's CUDA platform report that
capability for every device (patch 0018 wraps both ``get_device_capability`` methods of
``vllm/platforms/cuda.py``), and ``vllm.deepinfer.arch`` resolves its kernel variant from it.
vLLM then selects its linear, MoE, sampler, attention and DeepGEMM paths exactly as on an
A100 (or RTX 3090) while the kernels run on the GPU that is really there. This is how the
project runs an A100-faithful vLLM on an H200; it proves the *selections* and the sm_80
kernels' numerics, not A100 speed.

Off by default. Never set it in production: a kernel vLLM picks for the emulated capability
may be slower than the device's own, and one that checks the real device may disagree.
Code that reads ``torch.cuda.get_device_capability()`` directly is not affected (the
end-to-end audit, benchmarks/e2e/audit.py, lists what ran).
"""
from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger("vllm.deepinfer")

ENV = "DEEPINFER_EMULATE_CAPABILITY"
# Capabilities an emulation may claim: the ones this project ships a variant for and that a
# smaller GPU than the real one can stand for (vllm.deepinfer.arch._CAPABILITY_TABLE).
ALLOWED = ((8, 0), (8, 6), (8, 7), (8, 9), (9, 0))


def parse(text: str) -> tuple[int, int]:
    """``"8.0"`` / ``"8,0"`` / ``"80"`` -> (8, 0); anything else is a ValueError naming ENV."""
    t = text.strip().replace(",", ".")
    try:
        if "." in t:
            major, minor = (int(x) for x in t.split("."))
        elif t.isdigit() and len(t) == 2:
            major, minor = int(t[0]), int(t[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: expected a capability such as 8.0 or 8.6") from None
    if (major, minor) not in ALLOWED:
        raise ValueError(f"{ENV}={text!r}: can emulate only "
                         f"{', '.join(f'{a}.{b}' for a, b in ALLOWED)}")
    return major, minor


@functools.cache
def emulated() -> tuple[int, int] | None:
    """The capability the environment asks for, or None (no emulation)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    cap = parse(text)
    logger.warning("deepinfer: %s=%d.%d -- vLLM sees every GPU as capability %d.%d "
                   "(test-only A100-faithful mode; kernels still run on the real GPU)",
                   ENV, *cap, *cap)
    return cap


def capability(real: tuple[int, int]) -> tuple[int, int]:
    """What vLLM's platform should report for a device whose real capability is ``real``."""
    cap = emulated()
    return real if cap is None else cap


def reset_for_tests() -> None:
    emulated.cache_clear()
