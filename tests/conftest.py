"""Test setup: our overlay package on the path, the Triton interpreter where there is no GPU,
the generated upstream kernels (tools/extract_upstream.py) importable as ``upstream_kernels``.

Markers: ``gpu`` (needs a CUDA device; skipped without one), ``slow`` (run by ``make test``
too, but kept small). On a CPU-only machine ``TRITON_INTERPRET=1`` is set before any
kernel module is imported, so the @triton.jit functions run on CPU tensors.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("DEEPINFER_BUILD", REPO / "build"))
sys.path.insert(0, str(REPO / "overlay"))
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(BUILD))

import torch  # noqa: E402

# The compile caches `make verify` fills (Makefile: DEEPINFER_CACHE), so a bare pytest run
# after it reuses its Triton and TileLang builds; make exports the same values.
_CACHE = Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer"))
os.environ.setdefault("TRITON_CACHE_DIR", str(_CACHE / "triton"))
os.environ.setdefault("TILELANG_CACHE_DIR", str(_CACHE / "tilelang"))

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_GPU else "cpu"


@pytest.fixture(scope="session")
def upstream():
    """The generated module namespace of upstream vLLM 0.33.0 kernels.

    ``make test`` generates it first; a bare pytest run without it skips, unless
    DEEPINFER_REQUIRE_UPSTREAM=1 (set by the Makefile) turns the absence into a failure.
    """
    import importlib
    if not (BUILD / "upstream_kernels" / "__init__.py").is_file():
        msg = "build/upstream_kernels missing: run `make upstream-kernels`"
        if os.environ.get("DEEPINFER_REQUIRE_UPSTREAM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return importlib.import_module("upstream_kernels")


@pytest.fixture(scope="module")
def exact_hw_fp8_cast():
    """Under the interpreter, replace its fp32 -> fp8e4nv conversion (round half up without
    carry into the exponent, no saturation) with what ``cvt.rn.satfinite.e4m3x2.f32`` does:
    round to nearest even, saturate to +-448, NaN -> 0x7F (computed by torch). Upstream's
    kernels and our hardware-cast variants run through it; our software cast never does. On a
    GPU nothing is replaced. Modules opt in with ``pytestmark = usefixtures(...)``."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    orig = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            q = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
            q[x.isnan()] = 0x7F  # cvt.satfinite gives the canonical NaN 0x7F
            return q.numpy()
        return orig(data, src, dst, rounding_mode)

    interpreter._convert_float = convert
    yield
    interpreter._convert_float = orig
