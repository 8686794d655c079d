"""Triton's JIT cache keys, computed on a CPU without compiling or launching anything.

A launch ``kernel[grid](*args, **kwargs)`` on a GPU finds its compiled kernel under
``(specialization, options)``: per argument its type plus Triton's runtime specialization
(an int equal to 1 becomes a constant, other ints and pointers are tagged by divisibility by
16 / 16-byte alignment, unless the kernel lists them in ``do_not_specialize`` /
``do_not_specialize_on_alignment``), plus the launch options passed (``num_warps``,
``num_stages``, ...). ``JITFunction.warmup(...)`` compiles under the same kind of key, with
pointers given as dtypes (always aligned). A launch whose key no warmup produced compiles
while serving.

``key_of`` builds that key with Triton's own binder (``create_function_from_signature``) for
a CUDA target, from the kernel's Python function and decorator arguments, so it works on the
InterpretedFunction objects the CPU tests have. ``recording()`` intercepts every launch of an
interpreted kernel (nothing runs: launchers are called only for the arguments they pass) and
records ``(kernel name, key)``.
"""
from __future__ import annotations

import contextlib
import functools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, MockTensor, create_function_from_signature

# Launch options the JIT adds itself on every run (same for warmup and launch).
_RUNTIME_OPTIONS = ("debug", "instrumentation_mode")


@functools.cache
def _binder(fn, decorator_items: tuple, cc: int):
    jf = JITFunction(fn, **dict(decorator_items))
    backend = make_backend(GPUTarget("cuda", cc, 32))
    return create_function_from_signature(jf.signature, jf.params, backend)


def _fn_and_decorator(kernel):
    if isinstance(kernel, JITFunction):
        return kernel.fn, (("do_not_specialize", tuple(kernel.do_not_specialize)),
                           ("do_not_specialize_on_alignment",
                            tuple(kernel.do_not_specialize_on_alignment)))
    kw = getattr(kernel, "kwargs", {})  # InterpretedFunction keeps the decorator's kwargs
    return kernel.fn, tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                   for k, v in kw.items()
                                   if k in ("do_not_specialize", "do_not_specialize_on_alignment")
                                   and v is not None))


def key_of(kernel, args, kwargs, cc: int = 80) -> tuple:
    """(specialization, options) of ``kernel`` launched (or warmed) with these arguments."""
    fn, deco = _fn_and_decorator(kernel)
    binder = _binder(fn, deco, cc)
    args = [MockTensor.wrap_dtype(a) for a in args]
    _, spec, options = binder(*args, **kwargs)
    opts = tuple(sorted((k, v) for k, v in options.items() if k not in _RUNTIME_OPTIONS))
    return tuple((t, repr(v)) for t, v in spec), opts


def describe(kernel, key: tuple) -> str:
    fn, _ = _fn_and_decorator(kernel)
    import inspect
    names = list(inspect.signature(fn).parameters)
    spec, opts = key
    parts = [f"{n}={t}{'' if v in ('None', repr(None)) else ':' + v}" for n, (t, v) in zip(names, spec)]
    return f"{fn.__name__}({', '.join(parts)}; {dict(opts)})"


@contextlib.contextmanager
def recording(cc: int = 80, execute: bool = False):
    """Record (kernel, key) of every interpreted kernel launch; launches do not run unless
    ``execute``."""
    from triton.runtime.interpreter import InterpretedFunction
    seen: list = []
    orig = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            seen.append((self, key_of(self, args, kwargs, cc)))
        if execute:
            return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None
    InterpretedFunction.run = run
    try:
        yield seen
    finally:
        InterpretedFunction.run = orig


__all__ = ["key_of", "describe", "recording", "triton"]
