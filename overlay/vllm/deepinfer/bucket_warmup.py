"""Compile every size bucket of an upstream Triton kernel at its first launch.

Some upstream kernels take a power-of-two block constexpr chosen from the batch at each
launch, and vLLM's JIT warmup registers none of them: the first request whose size falls in
a new bucket then compiles while serving. Seen on the H200: the DSpark engine (v41-dspark-mini,
k = 5, the a100 mode, nocompile form) compiled ``_prepare_dflash_inputs_kernel``
(v1/worker/gpu/spec_decode/dflash/speculator.py, shared by DFlash and DSpark) twice while
serving, ``BLOCK_SIZE`` 64 and 256, after three buckets had compiled during start-up
(benchmarks/results/h200-2026-12-02-e2e-spec-46a68f3.json, rows ``spec_zero_compile`` and
``spec_sm80_audit``). Its launcher picks ``BLOCK_SIZE = min(256, next_pow2(longest query +
num_query_per_req))``.

``BucketWarmup`` wraps such a kernel (one statement of patch 0027 after its definition). A launch
runs as before; the first launch of each configuration of the other constexprs then compiles
the remaining buckets with ``JITFunction.warmup`` on the same arguments, so every integer
specialization and pointer dtype is exactly the launch's own. vLLM's start-up dummy runs
make that first launch, before any request. A launch during CUDA-graph capture defers it to
the next launch outside capture.

Switch: feature ``serve_warmup`` (on everywhere: it changes no value, only when the compiles
happen); ``DEEPINFER_SERVE_WARMUP=0`` leaves the kernel to compile on demand.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence

logger = logging.getLogger("vllm.deepinfer")

__all__ = ["BucketWarmup", "pow2_buckets", "dflash_prepare_buckets", "FEATURE"]

FEATURE = "serve_warmup"


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """The powers of two from next_pow2(lo) to hi (hi a power of two)."""
    if hi < 1 or hi & (hi - 1):
        raise ValueError(f"pow2_buckets: hi={hi} is not a power of two")
    p = 1
    while p < max(1, lo):
        p *= 2
    out = []
    while p <= hi:
        out.append(p)
        p *= 2
    return out


# prepare_dflash_inputs' cap on BLOCK_SIZE (vLLM 0.33.0: ``min(256, next_pow2(...))``).
DFLASH_BLOCK_CAP = 256


def dflash_prepare_buckets(bound: dict[str, Any]) -> list[int]:
    """BLOCK_SIZE values ``prepare_dflash_inputs`` can pick: every query is at least one
    token long, so from next_pow2(1 + num_query_per_req) up to the cap."""
    return pow2_buckets(min(1 + int(bound["num_query_per_req"]), DFLASH_BLOCK_CAP),
                        DFLASH_BLOCK_CAP)


class BucketWarmup:
    """A Triton kernel whose ``param`` constexpr is one of ``buckets(bound arguments)``:
    indexed by a grid it launches as the kernel does, and the first launch of each setting of
    its other constexprs compiles the other buckets. ``fn`` is the kernel, as in Triton's own
    wrappers; other attribute reads go to the kernel."""

    def __init__(self, kernel: Any, param: str,
                 buckets: Callable[[dict[str, Any]], Iterable[int]]):
        self.kernel = kernel
        # Triton's wrappers (Autotuner, Heuristics) name their inner kernel ``fn``, and
        # Triton unwraps ``.fn`` until it reaches the JITFunction (get_jit_fn_file_line).
        self.fn = kernel
        self.param = param
        self.buckets = buckets
        self.warmed: set = set()
        names = list(getattr(kernel, "arg_names", ()))
        if param not in names:
            raise ValueError(f"BucketWarmup: {getattr(kernel, '__name__', kernel)!r} has no "
                             f"argument {param!r}")
        self.arg_names = names
        self.constexprs = [names[i] for i in getattr(kernel, "constexprs", ())]
        # The other constexprs, by name and position: a launch's key, read without binding
        # every argument (this runs on every launch of a per-step kernel).
        self._others = [(n, names.index(n)) for n in self.constexprs if n != param]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            out = launch(*args, **kwargs)
            self._warm(grid, args, kwargs)
            return out
        return run

    def _bound(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = dict(zip(self.arg_names, args))
        bound.update(kwargs)
        return bound

    def _key(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
        return tuple(repr(kwargs[n] if n in kwargs else args[i] if i < len(args) else None)
                     for n, i in self._others)

    def _warm(self, grid, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        key = self._key(args, kwargs)
        if key in self.warmed:
            return
        from vllm.deepinfer import envs
        if not envs.enabled(FEATURE) or _capturing():
            return
        self.warmed.add(key)
        bound = self._bound(args, kwargs)
        own = bound.get(self.param)
        todo = [b for b in self.buckets(bound) if b != own]
        name = getattr(self.kernel, "__name__", "kernel")
        try:
            for b in todo:
                self.kernel.warmup(*args, grid=grid, **{**kwargs, self.param: b})
        except Exception as e:  # noqa: BLE001 - the launch ran; a bucket compiles on demand
            logger.warning("deepinfer: compiling the other %s buckets of %s failed (%s: %s); "
                           "they compile when first launched", self.param, name,
                           type(e).__name__, e)
            return
        logger.info("deepinfer: compiled %s=%s of %s at its first launch (%s ran it)",
                    self.param, todo, name, own)


def _capturing() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - no CUDA: nothing is capturing
        return False
