"""Input checks shared by every kernel launcher.

A launcher runs on every layer of every step, so its checks are on the host's critical path:
the conditions are evaluated and a message is formatted only when one fails (``what`` is a
string or a callable building it). Every failure is one ``ValueError`` line,
``"<argument>: <what is wrong and what was expected>"``, naming the tensor or argument the
caller passed. ``benchmarks/diag/launch_overhead.py`` measures the launchers' host time.
"""
from __future__ import annotations

import math

import torch

from vllm.deepinfer.kv_record import HEAD_DIM, NOPE_DIM, ROPE_DIM

__all__ = ["check", "check_tensor", "check_mla_query", "fail", "INDEX_DTYPES", "FLOAT_DTYPES"]

# Slot lists, positions, lengths: upstream passes int32 or int64.
INDEX_DTYPES = (torch.int32, torch.int64)
# Attention sinks and cos/sin caches: any float type the model keeps them in.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check(ok: bool, name: str, what) -> None:
    """Raise ``ValueError("name: what")`` unless ``ok``; ``what`` may be a callable (called
    only on failure, so no message is formatted on the good path)."""
    if not ok:
        raise ValueError(f"{name}: {what() if callable(what) else what}")


def fail(name: str, what: str):
    """Raise ``ValueError("name: what")`` (for a branch already known to be bad)."""
    raise ValueError(f"{name}: {what}")


def check_tensor(t, name: str, dtypes: tuple | None = None, ndim: int | None = None,
                 device: torch.device | None = None, contiguous: bool = False) -> None:
    """``t`` is a tensor with one of ``dtypes``, ``ndim`` dims, on ``device``, contiguous when
    asked (each test skipped when None/False). One combined test on the good path; the
    failing condition is named only after it fails."""
    if (isinstance(t, torch.Tensor) and (dtypes is None or t.dtype in dtypes)
            and (ndim is None or t.dim() == ndim) and (device is None or t.device == device)
            and (not contiguous or t.is_contiguous())):
        return
    if not isinstance(t, torch.Tensor):
        fail(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(name, f"dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if ndim is not None and t.dim() != ndim:
        fail(name, f"expected {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        fail(name, f"on {t.device}, expected {device}")
    fail(name, f"must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def check_mla_query(q, nope_head_dim: int, rope_head_dim: int, scale) -> None:
    """The sparse MLA attention kernels' query and head geometry (decode and prefill):
    bf16 [tokens, heads, 512] with a contiguous last dim, 448 NoPE + 64 RoPE dims, a finite
    softmax scale."""
    check_tensor(q, "q", dtypes=(torch.bfloat16,), ndim=3)
    check(q.shape[2] == HEAD_DIM and q.stride(2) == 1, "q",
          lambda: f"expected [tokens, heads, {HEAD_DIM}] with a contiguous last dim, got "
          f"shape {tuple(q.shape)} strides {q.stride()}")
    check(nope_head_dim == NOPE_DIM, "nope_head_dim",
          lambda: f"must be {NOPE_DIM}, got {nope_head_dim}")
    check(rope_head_dim == ROPE_DIM, "rope_head_dim",
          lambda: f"must be {ROPE_DIM}, got {rope_head_dim}")
    check(isinstance(scale, (int, float)) and math.isfinite(scale), "scale",
          lambda: f"expected a finite float, got {scale!r}")
