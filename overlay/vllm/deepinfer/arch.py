"""Kernel-variant selection from the device's compute capability.

Resolved once, at import, without initializing CUDA: the capability is read through
NVML (as vLLM's NVML platform does) and only falls back to ``torch.cuda`` when CUDA is
already initialized in this process or NVML is unavailable. ``DEEPINFER_ARCH=<variant>``
forces a variant; under ``TRITON_INTERPRET=1`` a forced GPU variant runs its own Triton
kernels on CPU tensors, which is how CPU tests cover the sm80 and sm90 code.

Per-architecture settings live in ``VARIANTS`` (one row per variant); kernel modules
keep their own tile tables keyed by variant name. Every kernel module resolves its
``variant=`` argument with ``resolve`` and sizes its grids with ``sm_count``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os

logger = logging.getLogger("vllm.deepinfer")

__all__ = ["Variant", "VARIANTS", "UnsupportedGPU", "variant_for_capability", "device_capability",
           "interpreting", "resolve_variant", "current", "reason", "resolve", "table_key", "sm_count",
           "INTERPRETER_SMS", "reset_for_tests"]


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    # Triton compile target (major*10+minor) used by the compile gate for this variant.
    gate_targets: tuple[int, ...]
    # Hardware e4m3 conversion (cvt e4m3x2) exists from sm_89 on; below it Triton refuses
    # fp8e4nv, so the kernels decode/encode e4m3 in software (vllm.deepinfer.fp8).
    hw_fp8: bool
    # Shared memory a kernel may take per CTA. 48 KiB keeps two CTAs per SM on SM86
    # (100 KiB of shared memory per SM, 99 KiB per block) and is the static limit
    # without opt-in; SM80 has 164 KiB per SM but we hold the same budget so one
    # build serves both. Hopper/Blackwell tiles are sized on the H200 instead.
    smem_budget: int
    # Whether this variant runs on a GPU (False: CPU tensors, Triton interpreter).
    gpu: bool
    description: str


KIB = 1024
VARIANTS: dict[str, Variant] = {
    "sm80": Variant("sm80", (80,), False, 48 * KIB, True, "Ampere GA100: A100, A800, A30"),
    "sm86": Variant("sm86", (86,), False, 48 * KIB, True,
                    "Ampere GA10x: RTX 3090/3090 Ti, A6000, A40, A10 (and 8.7 Orin)"),
    "sm89": Variant("sm89", (89,), True, 99 * KIB, True, "Ada: hardware fp8, GA10x-sized SM"),
    "sm90": Variant("sm90", (90,), True, 227 * KIB, True, "Hopper: H100, H200, H800"),
    # 10.x (B200/GB200) and 12.x (RTX 50xx, RTX PRO 6000) share the sm100 variant: both
    # have hardware fp8 and run the Hopper-tuned Triton kernels; 12.x has 99 KiB of shared
    # memory per block, so the variant's budget is the smaller of the two. Neither has been
    # measured by this project (docs/architecture.md).
    "sm100": Variant("sm100", (100,), True, 99 * KIB, True, "Blackwell 10.x and 12.x"),
    "cpu": Variant("cpu", (), False, 0, False, "no GPU: Triton interpreter on CPU tensors"),
}

# (major, minor) -> variant. Anything not listed below 8.0 is unsupported (no bf16 mma).
_CAPABILITY_TABLE: dict[tuple[int, int], str] = {
    (8, 0): "sm80", (8, 6): "sm86", (8, 7): "sm86", (8, 9): "sm89", (9, 0): "sm90",
}
_MAJOR_TABLE: dict[int, str] = {10: "sm100", 11: "sm100", 12: "sm100"}


class UnsupportedGPU(RuntimeError):
    pass


def variant_for_capability(cap: tuple[int, int] | None) -> str:
    if cap is None:
        return "cpu"
    if cap in _CAPABILITY_TABLE:
        return _CAPABILITY_TABLE[cap]
    if cap[0] in _MAJOR_TABLE:
        return _MAJOR_TABLE[cap[0]]
    raise UnsupportedGPU(
        f"compute capability {cap[0]}.{cap[1]} is not supported by vllm.deepinfer "
        f"(supported: 8.0, 8.6, 8.7, 8.9, 9.0, 10.x, 12.x)")


# --------------------------------------------------------------------------- capability
def _nvml_capability() -> tuple[int, int] | None:
    """Capability of the first visible device via NVML, or None (no driver / no device)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return None
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        handle = ctypes.c_void_p()
        first = (visible or "0").split(",")[0].strip()
        if first.isdigit():
            rc = nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(int(first)), ctypes.byref(handle))
        else:  # GPU-/MIG- UUID form
            rc = nvml.nvmlDeviceGetHandleByUUID(first.encode(), ctypes.byref(handle))
        if rc != 0:
            return None
        major, minor = ctypes.c_int(), ctypes.c_int()
        if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)):
            return None
        return (major.value, minor.value)
    finally:
        nvml.nvmlShutdown()


def device_capability() -> tuple[int, int] | None:
    from vllm.deepinfer import emulate
    if emulate.emulated() is not None:  # test-only A100-faithful mode (emulate.py)
        return emulate.emulated()
    cap = _nvml_capability()
    if cap is not None:
        return cap
    try:
        import torch
        if torch.cuda.is_initialized() or (os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip()
                                           and torch.cuda.is_available()):
            return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]
    except Exception:  # pragma: no cover - broken torch install
        return None
    return None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_variant() -> tuple[Variant, str]:
    """(variant, how it was chosen)."""
    forced = os.environ.get("DEEPINFER_ARCH", "").strip().lower()
    if forced:
        if forced not in VARIANTS:
            raise ValueError(f"DEEPINFER_ARCH={forced!r} is not a variant; choose one of "
                             f"{', '.join(VARIANTS)}")
        return VARIANTS[forced], "DEEPINFER_ARCH"
    if interpreting():
        return VARIANTS["cpu"], "TRITON_INTERPRET=1"
    cap = device_capability()
    return VARIANTS[variant_for_capability(cap)], (
        f"capability {cap[0]}.{cap[1]}" if cap else "no visible CUDA device")


_VARIANT: Variant | None = None
_REASON = ""


def current() -> Variant:
    """The variant in force for this process (resolved on first use, then fixed)."""
    global _VARIANT, _REASON
    if _VARIANT is None:
        _VARIANT, _REASON = resolve_variant()
    return _VARIANT


def reason() -> str:
    current()
    return _REASON


# ----------------------------------------------------------------------------- kernel helpers
def table_key(variant: str | None, table) -> str:
    """The row of a kernel module's table (tiles keyed by variant) a call uses: ``variant``,
    or this process's variant when None. Any key of ``table`` is accepted (benchmarks add
    rows of their own); an unknown one raises one ValueError naming the argument."""
    name = current().name if variant is None else variant
    if name not in table:
        raise ValueError(f"variant: {name!r} is not one of {', '.join(table)}")
    return name


def resolve(variant: str | None, table=None) -> Variant:
    """The variant a kernel call runs: ``variant`` by name, or this process's when None;
    ``table`` (a kernel module's tile table) limits the names to its keys."""
    if variant is None:
        return current()
    return VARIANTS[table_key(variant, VARIANTS if table is None else table)]


# Streaming multiprocessors assumed for CPU tensors (the Triton interpreter): grids sized from
# it stay tiny (each program loops over its share of the work), and split-K never splits.
INTERPRETER_SMS = 1
_SM_COUNTS: dict[int, int] = {}


def sm_count(device) -> int:
    """SMs of ``device`` (a torch.device), read once per CUDA device index and cached (the
    property query costs host time on every launch otherwise); ``INTERPRETER_SMS`` for a
    non-CUDA device."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    index = device.index
    if index is None:
        import torch
        index = torch.cuda.current_device()
    n = _SM_COUNTS.get(index)
    if n is None:
        import torch
        n = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


@functools.cache
def log_once(kernel: str, what: str, reason: str) -> None:
    """Say once per (kernel, what, reason) which kernel a row runs and why: the kernel it
    names, or the one it falls back to (an INFO line of the ``vllm.deepinfer`` logger)."""
    logging.getLogger("vllm.deepinfer").info("deepinfer: %s: %s (%s)", kernel, what, reason)


def reset_for_tests() -> None:
    global _VARIANT, _REASON
    _VARIANT, _REASON = None, ""
    from vllm.deepinfer import emulate
    emulate.reset_for_tests()
