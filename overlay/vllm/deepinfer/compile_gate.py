"""GPU-free compile gate: every registered Triton kernel, compiled for explicit targets.

Kernel modules call ``register(...)`` at import with the signature and constexprs of each
configuration they launch. ``check(spec, cc)`` compiles it with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` — no GPU needed —
and reports shared memory per CTA, whether the build uses e4m3 (``f8E4M3FN``, Triton's
fp8e4nv) and registers per thread (from the ``cuobjdump`` Triton ships, or one on the PATH). Targets below
sm_89 must use no fp8e4nv and stay inside the variant's shared-memory budget.

    python -m vllm.deepinfer.compile_gate [--json F]   # prints the table; exit 1 on a violation

It must run without TRITON_INTERPRET (the interpreter replaces @triton.jit functions with
Python ones that cannot be compiled); the tests run it in a subprocess.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

from vllm.deepinfer.arch import VARIANTS

HW_FP8_MIN_CC = 89


@dataclasses.dataclass(frozen=True)
class GateSpec:
    name: str
    kernel: Any  # triton JITFunction
    signature: dict[str, str]
    constexprs: dict[str, Any]
    variants: tuple[str, ...]
    num_warps: int = 4
    num_stages: int = 2
    # Features this kernel belongs to (a test of the SM80 path lists them).
    feature: str = ""
    # Build with every pointer argument 16-byte aligned, as Triton specializes a launch on
    # torch allocations. For kernels that cannot compile without it (a cp.async of 16 B
    # needs the alignment proven); the others are gated without hints, their worst case.
    aligned_pointers: bool = False
    # Registers per thread the build may assume (Triton's maxnreg option; None: not set). A
    # warp-specialized kernel sizes its partitions' setmaxnreg budgets from it.
    maxnreg: int | None = None

    @property
    def targets(self) -> tuple[int, ...]:
        out: list[int] = []
        for v in self.variants:
            out += [t for t in VARIANTS[v].gate_targets if t not in out]
            if v == "sm80" and 86 not in out:
                out.append(86)  # sm80 builds double as sm86 builds unless an sm86 spec exists
        return tuple(out)

    def budget(self, cc: int) -> int:
        for v in self.variants:
            if cc in VARIANTS[v].gate_targets:
                return VARIANTS[v].smem_budget
        return VARIANTS["sm86"].smem_budget if cc < HW_FP8_MIN_CC else VARIANTS["sm90"].smem_budget


_REGISTRY: dict[str, GateSpec] = {}
_PROVIDERS: list[str] = []


def register(spec: GateSpec) -> GateSpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] != spec:
        raise ValueError(f"compile gate: {spec.name} registered twice with different specs")
    _REGISTRY[spec.name] = spec
    return spec


def add_provider(module: str) -> None:
    """A module whose import registers kernels; ``specs()`` imports them all."""
    if module not in _PROVIDERS:
        _PROVIDERS.append(module)


# Kernel modules of this package; each registers its specs at import.
for _m in ("vllm.deepinfer.fp8", "vllm.deepinfer.kernels.topk_swa",
           "vllm.deepinfer.kernels.kv_gather", "vllm.deepinfer.kernels.sparse_mla_decode",
           "vllm.deepinfer.kernels.sparse_mla_prefill",
           "vllm.deepinfer.kernels.fp8_writers", "vllm.deepinfer.kernels.fp8_writers_v41",
           "vllm.deepinfer.kernels.fp8_writers_v4", "vllm.deepinfer.kernels.fp8_writers_v4_compress",
           "vllm.deepinfer.kernels.indexer_logits", "vllm.deepinfer.kernels.engram_lookup",
           "vllm.deepinfer.kernels.inverse_rope", "vllm.deepinfer.mhc.decode_fused"):
    add_provider(_m)


def specs() -> list[GateSpec]:
    import importlib
    import importlib.util
    for m in _PROVIDERS:
        if importlib.util.find_spec(m) is not None:
            importlib.import_module(m)
    return sorted(_REGISTRY.values(), key=lambda s: s.name)


@dataclasses.dataclass
class GateResult:
    name: str
    cc: int
    ok: bool
    shared: int | None = None
    budget: int | None = None
    uses_fp8e4nv: bool | None = None
    regs: int | None = None
    num_warps: int | None = None
    error: str = ""


def _regs_from_cubin(cubin: bytes) -> int | None:
    import triton
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    tool = bundled if os.access(bundled, os.X_OK) else shutil.which("cuobjdump")
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                                 text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    m = re.search(r"REG:(\d+)", out)
    return int(m.group(1)) if m else None


def compile_spec(spec: GateSpec, cc: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if getattr(spec.kernel, "is_gluon", lambda: False)():  # a Gluon kernel
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    attrs = None
    if spec.aligned_pointers:
        attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(spec.signature.values())
                 if ty.startswith("*")}
    src = ASTSource(spec.kernel, dict(spec.signature), dict(spec.constexprs), attrs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    if spec.maxnreg is not None:
        options["maxnreg"] = spec.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)


def check(spec: GateSpec, cc: int, want_regs: bool = True) -> GateResult:
    res = GateResult(spec.name, cc, ok=False, budget=spec.budget(cc), num_warps=spec.num_warps)
    try:
        compiled = compile_spec(spec, cc)
    except Exception as e:  # a compile failure is a gate failure, with Triton's message
        res.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        return res
    res.shared = int(compiled.metadata.shared)
    res.uses_fp8e4nv = "f8E4M3FN" in compiled.asm["ttgir"]
    if want_regs and "cubin" in compiled.asm:
        res.regs = _regs_from_cubin(compiled.asm["cubin"])
    problems = []
    if cc < HW_FP8_MIN_CC and res.uses_fp8e4nv:
        problems.append("uses fp8e4nv below sm_89")
    if res.shared > res.budget:
        problems.append(f"shared {res.shared} B > budget {res.budget} B")
    res.error = "; ".join(problems)
    res.ok = not problems
    return res


def format_table(results: list[GateResult]) -> str:
    rows = [f"{'kernel':58s} {'target':7s} {'shared':>8s} {'budget':>8s} {'regs':>5s} {'fp8e4nv':>7s}  status"]
    for r in results:
        rows.append(f"{r.name:58s} sm_{r.cc:<4d} {r.shared if r.shared is not None else '-':>8} "
                    f"{r.budget:>8} {r.regs if r.regs is not None else '-':>5} "
                    f"{str(r.uses_fp8e4nv) if r.uses_fp8e4nv is not None else '-':>7}  "
                    f"{'ok' if r.ok else 'FAIL: ' + r.error}")
    return "\n".join(rows)


def main(argv=None) -> int:
    import argparse
    import json
    import sys
    ap = argparse.ArgumentParser(description="Compile every registered kernel for its targets.")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--no-regs", action="store_true", help="skip the cuobjdump register count")
    ap.add_argument("--targets", default=None,
                    help="comma-separated compute capabilities to build (e.g. 80,86,90); "
                         "default every spec's own targets")
    a = ap.parse_args(argv)
    only = None
    if a.targets:
        try:
            only = {int(t) for t in a.targets.split(",") if t.strip()}
        except ValueError:
            ap.error(f"--targets: expected comma-separated integers like 80,86,90, got {a.targets!r}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("the compile gate needs real Triton compilation: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    results = []
    for spec in specs():
        for cc in spec.targets:
            if only is None or cc in only:
                results.append(check(spec, cc, want_regs=not a.no_regs))
    print(format_table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    bad = [r for r in results if not r.ok]
    print(f"{len(results) - len(bad)} passed, {len(bad)} failed", file=sys.stderr)
    return 1 if bad or not results else 0


if __name__ == "__main__":
    # Run the imported module's main: kernel modules register into vllm.deepinfer.compile_gate,
    # not into this __main__ copy of it.
    from vllm.deepinfer.compile_gate import main as _main
    raise SystemExit(_main())
