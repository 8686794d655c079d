"""Engine limits the Ampere path refuses at start, where an upstream CUDA op it launches
would otherwise wrap a 32-bit offset silently.

vLLM 0.33.0's ``rms_norm_kernel`` (csrc/layernorm_kernels.cu:77) writes its output row at
``blockIdx.x * hidden_size`` in 32 bits, and V4's final norm runs it over every token of a
step ([max_num_batched_tokens, hidden]): at hidden 4096 row 1,048,576 lands on row 0
(docs/long-context.md, "CUDA C++ ops"). vLLM accepts any ``max_num_batched_tokens``; the
Ampere attention layers refuse the ones past the bound when they are built.
"""
from __future__ import annotations

OUT_OFFSET_LIMIT = 2 ** 32


class StepLimitError(ValueError):
    """A per-step size an upstream op on the path cannot address."""


def max_norm_tokens(hidden: int) -> int:
    """The most tokens per step whose norm output rows stay within 32-bit offsets."""
    return (OUT_OFFSET_LIMIT - 1) // max(1, hidden) + 1 if hidden > 0 else 0


def check_norm_rows(max_num_batched_tokens: int, hidden: int, where: str = "") -> None:
    """Raise StepLimitError when a step of ``max_num_batched_tokens`` rows of ``hidden``
    would wrap rms_norm's output offset; the message names the limit and the setting that
    fits."""
    if hidden <= 0 or max_num_batched_tokens <= max_norm_tokens(hidden):
        return
    raise StepLimitError(
        f"DeepInfer Ampere attention{' ' + where if where else ''}: max_num_batched_tokens="
        f"{max_num_batched_tokens} x hidden {hidden} passes the 2^32 output offsets of vLLM's "
        f"rms_norm kernel (row {max_norm_tokens(hidden)} would overwrite row 0); nearest "
        f"setting: max_num_batched_tokens={max_norm_tokens(hidden)}")
