"""What a vLLM forward launches, and whether each piece can run on Ampere (sm_80/sm_86).

``Recorder`` is installed in the process that runs the engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)
before the model is built, and records:

* every Triton compile (``triton.knobs.runtime.jit_cache_hook``: called before each compile a
  process makes, with the kernel's signature, constexprs and options), tagged with the phase
  it happened in (``load`` = engine start and vLLM's warmup, ``serve`` = generate calls);
* every call of an op of vLLM's extension namespaces (``torch.ops._C``, ``_moe_C``,
  ``_flashmla_C``, ...: each op replaced by a counting stand-in before the model is built)
  during the served requests. Code that kept a reference to an op before the recorder was
  installed is not seen;
* every call into DeepGEMM (its module functions wrapped) and every TileLang compile;
* the time vLLM's JIT warmup takes, and our kernels' share of it;
* the region a compile or an op call happened in, where the caller marks one
  (``Recorder.in_region``: run_spec.py marks the speculator's propose as "draft"), so the
  rows of an engine with speculation on name the draft's kernels.

Zero compile while serving: every Triton JIT cache miss and TileLang compile of the 'serve'
phase is a failure (``serve_compile_failures``, listed with its full key). Only meaningful
with vLLM's JIT warmup on: ``enforce_eager=True`` switches it off (vllm/config/vllm.py), so
run.py's ``--jit-warmup`` runs eagerly through compilation mode NONE and no CUDA graphs
instead.

``check(...)`` then compiles each recorded Triton kernel for sm_80 and sm_86 with the very
signature and constexprs it launched with (``triton.compile`` with an explicit target, as the
compile gate does), within the Ampere variants' 48 KiB shared-memory budget (the compile
gate's, arch.VARIANTS; more is a failure) and without fp8e4nv in its TTGIR, and lists the SM architectures of the cubins each op's extension carries
(``cuobjdump --list-elf``; per extension library, not per kernel symbol). DeepGEMM and FlashMLA
calls count as Ampere failures outright: neither has sm_80 kernels.

Limits, stated in the results: Triton kernels that torch.compile (Inductor) generates compile
in worker processes and are not seen (run the audit with enforce_eager); Inductor generates
them for the device it runs on. TileLang kernels are listed by name; their sm_80 builds are
checked by the compile gate, not here.
"""
from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import subprocess

import torch

# Namespaces of ops that are torch's own (not an extension's kernels).
_TORCH_NS_PREFIXES = ("_c10d", "_quantized", "_nested", "_test", "_prims", "_inductor",
                      "_dtensor", "_native", "_functorch", "_higher_order")
_TORCH_NS = {"aten", "prims", "prim", "_c10d_functional", "c10d", "profiler", "inductor",
             "higher_order", "_dynamo", "debugprims", "quantized_decomposed"}
# Extensions with no sm_80 kernels at all.
_NO_AMPERE_NS = {"_flashmla_C", "_flashmla_extension_C"}


class _CountingOp:
    """Stands in for ``torch.ops.<ns>.<op>``: counts calls (also through ``.default`` and the
    other overloads) while the recorder is serving, then calls the real op."""

    def __init__(self, rec: "Recorder", name: str, packet):
        self._rec, self._name, self._packet = rec, name, packet

    def __call__(self, *a, **k):
        if self._rec.phase == "serve":
            self._rec.ops[self._name] += 1
            if self._rec.region is not None:
                self._rec.region_ops[self._rec.region][self._name] += 1
        return self._packet(*a, **k)

    def __getattr__(self, attr):
        target = getattr(self._packet, attr)
        if attr in getattr(self._packet, "overloads", lambda: [])():
            return _CountingOp(self._rec, self._name, target)
        return target


class Recorder:
    def __init__(self):
        self.phase = "load"
        self.triton: dict[tuple, dict] = {}
        self.compiles = collections.Counter()   # phase -> Triton compiles
        self.ops: collections.Counter = collections.Counter()
        self.deep_gemm: collections.Counter = collections.Counter()
        self.tilelang: collections.Counter = collections.Counter()
        self.tilelang_by_phase: collections.Counter = collections.Counter()
        # Every JIT cache miss while serving, with its full key (what the warmup lacked).
        self.serve_compiles: list[dict] = []
        # Seconds of vLLM's JIT warmup, and of our kernels' share of it.
        self.warmup_seconds: collections.Counter = collections.Counter()
        # The region the caller marked (in_region), and the op calls per region while serving.
        self.region: str | None = None
        self.region_ops: dict = collections.defaultdict(collections.Counter)
        self._prev_hook = None

    # ---------------------------------------------------------------- install
    def install(self) -> "Recorder":
        import triton
        self._prev_hook = triton.knobs.runtime.jit_cache_hook
        triton.knobs.runtime.jit_cache_hook = self._triton_hook
        self._wrap_deep_gemm()
        self._wrap_tilelang()
        self._wrap_ops()
        self._time_warmup()
        return self

    def _time_warmup(self):
        """Time vLLM's JIT warmup (JitWarmupRegistry.warmup) and our keys' compiles in it."""
        import time
        try:
            from vllm.deepinfer import warmup as ours
            from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
        except ImportError:
            return
        rec = self

        def timed(name, f):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    rec.warmup_seconds[name] += time.perf_counter() - t0
                    rec.warmup_seconds[name + "_calls"] += 1
            return wrapper
        JitWarmupRegistry.warmup = timed("vllm_jit_warmup", JitWarmupRegistry.warmup)
        ours.compile_key = timed("deepinfer_keys", ours.compile_key)

    def _wrap_ops(self):
        """Every op of vLLM's extension namespaces: importing vLLM's platform loads them."""
        import importlib
        from vllm.platforms import current_platform
        current_platform.get_device_capability()  # resolving the platform loads vllm._C*
        for mod in ("vllm._custom_ops", "vllm._moe_C_stable_libtorch", "vllm._moe_C",
                    "vllm._flashmla_C", "vllm._flashmla_extension_C"):
            try:
                importlib.import_module(mod)  # each registers its op namespace
            except Exception:  # noqa: BLE001 - an extension this build lacks
                pass
        for qual in torch._C._dispatch_get_all_op_names():
            ns, _, rest = qual.partition("::")
            if (ns in _TORCH_NS or ns.startswith(_TORCH_NS_PREFIXES) or not rest
                    or not ns.startswith("_")):
                continue
            op = rest.split(".")[0]
            try:
                space = getattr(torch.ops, ns)
                packet = getattr(space, op)
            except (AttributeError, RuntimeError):
                continue
            if not isinstance(packet, _CountingOp):
                setattr(space, op, _CountingOp(self, f"{ns}::{op}", packet))

    def _triton_hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        self.compiles[self.phase] += 1
        name = f"{fn.module}.{fn.name}"
        sig = compile["signature"]
        if self.phase == "serve":
            self.serve_compiles.append(dict(
                name=name, signature={str(a): str(b) for a, b in sig.items()},
                constants=repr_constants(compile["constants"]),
                specialization=str(compile["configs"][0]), num_warps=compile["num_warps"],
                num_stages=compile["num_stages"], region=self.region))
        k = (name, tuple(sorted((str(a), str(b)) for a, b in sig.items())),
             repr_constants(compile["constants"]), compile["num_warps"], compile["num_stages"])
        if k not in self.triton:
            self.triton[k] = dict(name=name, jit=fn.jit_function, signature=dict(sig),
                                  constants=compile["constants"], attrs=compile["configs"][0],
                                  num_warps=compile["num_warps"],
                                  num_stages=compile["num_stages"], phase=self.phase,
                                  region=self.region)
        if self._prev_hook is not None:
            return self._prev_hook(key=key, repr=repr, fn=fn, compile=compile,
                                   is_manual_warmup=is_manual_warmup,
                                   already_compiled=already_compiled)
        return None

    def _wrap_deep_gemm(self):
        import importlib
        for mod in ("deep_gemm", "vllm.third_party.deep_gemm"):
            try:
                m = importlib.import_module(mod)
            except Exception:
                continue
            for attr in dir(m):
                f = getattr(m, attr)
                if attr.startswith("_") or not callable(f) or isinstance(f, type):
                    continue
                setattr(m, attr, self._counting(self.deep_gemm, f"{mod}.{attr}", f))

    def _wrap_tilelang(self):
        try:
            import tilelang
        except Exception:
            return
        orig = tilelang.compile

        def compile_(func, *a, **k):
            self.tilelang[getattr(func, "__name__", None) or str(getattr(func, "attrs", {})
                                                                  .get("global_symbol", "?"))] += 1
            self.tilelang_by_phase[self.phase] += 1
            return orig(func, *a, **k)
        tilelang.compile = compile_

    @staticmethod
    def _counting(counter, name, f):
        def wrapper(*a, **k):
            counter[name] += 1
            return f(*a, **k)
        wrapper.__wrapped__ = f
        return wrapper

    # ---------------------------------------------------------------- phases
    def in_region(self, name: str):
        """Context: compiles and op calls inside it are tagged ``name`` (nests; restores)."""
        import contextlib

        @contextlib.contextmanager
        def _region():
            prev, self.region = self.region, name
            try:
                yield
            finally:
                self.region = prev
        return _region()

    def serving(self):
        """Context for served requests: phase 'serve' (compiles and op calls counted)."""
        rec = self

        class _Ctx:
            def __enter__(self_inner):
                rec.phase = "serve"

            def __exit__(self_inner, *exc):
                rec.phase = "after"
        return _Ctx()


def repr_constants(c) -> str:
    return repr(sorted((str(k), repr(v)) for k, v in dict(c).items()))


# -------------------------------------------------------------------------- checks
# Shared memory per CTA an Ampere build may use: the compile gate's budget of the sm80 and
# sm86 variants (vllm.deepinfer.arch.VARIANTS, 48 KiB each).
SMEM_BUDGET = 48 * 1024


def build_for(entry: dict, cc: int) -> dict:
    """The recorded kernel built for sm_<cc>: ``error`` ('' when it builds, with no sm_90-only
    instruction, no fp8e4nv below sm_89 and shared memory within SMEM_BUDGET below sm_90;
    else the reason), ``shared`` (bytes, None when it did not build)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    try:
        src = ASTSource(entry["jit"], entry["signature"], entry["constants"], entry["attrs"])
        k = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                           options={"num_warps": entry["num_warps"],
                                    "num_stages": entry["num_stages"]})
    except Exception as e:  # noqa: BLE001 - the message is the result
        return dict(error=(str(e).strip().splitlines() or [type(e).__name__])[0][:300],
                    shared=None)
    ptx = k.asm.get("ptx", "")
    bad = [i for i in ("wgmma", "setmaxnreg", "cp.async.bulk.tensor", "griddepcontrol")
           if i in ptx]
    shared = int(getattr(k.metadata, "shared", 0) or 0)
    problems = [f"sm_90-only instruction(s) {bad}"] if bad else []
    if cc < 89 and "f8E4M3FN" in k.asm.get("ttgir", ""):
        problems.append("fp8e4nv below sm_89")
    if cc < 90 and shared > SMEM_BUDGET:
        problems.append(f"shared memory {shared} B > {SMEM_BUDGET} B budget")
    return dict(error="; ".join(problems), shared=shared)


def compile_for(entry: dict, cc: int) -> str:
    """'' when the recorded kernel builds for sm_<cc> (build_for), else why not."""
    return build_for(entry, cc)["error"]


def _cuobjdump() -> str | None:
    import triton
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                           "cuobjdump")
    return bundled if os.access(bundled, os.X_OK) else shutil.which("cuobjdump")


def library_archs() -> dict[str, list[str]]:
    """vLLM extension library basename -> SM architectures of the cubins (and PTX) it holds."""
    import vllm
    tool = _cuobjdump()
    out: dict[str, list[str]] = {}
    for so in sorted(glob.glob(os.path.join(os.path.dirname(vllm.__file__), "*.so"))):
        archs: set[str] = set()
        if tool:
            for flag in ("--list-elf", "--list-ptx"):
                r = subprocess.run([tool, flag, so], capture_output=True, text=True)
                archs |= {m.group(0) for m in re.finditer(r"sm_\d+a?", r.stdout)}
        out[os.path.basename(so)] = sorted(archs)
    return out


def op_libraries(ns: str, libs: dict[str, list[str]]) -> list[str]:
    base = ns.lstrip("_")
    return [so for so in libs if so.lstrip("_").split(".")[0] == base
            or so.lstrip("_").startswith(base + "_stable")]


# vLLM's sampler compiles its logprob kernels on the first request that asks for logprobs,
# on every GPU and with every attention backend (its JIT warmup samples without them): not
# a kernel of the Ampere path. Listed apart (``serve_compiles_outside``), never hidden.
OUTSIDE_AMPERE_PATH = ("vllm.v1.worker.gpu.sample.",)


def outside_path(c: dict) -> bool:
    return c["name"].startswith(OUTSIDE_AMPERE_PATH)


def serve_compile_failures(rec: Recorder) -> list[str]:
    """One line per kernel compiled while serving (after vLLM's warmup): every Triton JIT
    cache miss of the 'serve' phase and every TileLang compile. In the a100 mode everything
    that runs is on the Ampere path, ours and upstream's alike, so none is excused, except
    vLLM's sampler kernels (``OUTSIDE_AMPERE_PATH``), which check() reports apart."""
    out = []
    seen: collections.Counter = collections.Counter()
    for c in rec.serve_compiles:
        if outside_path(c):
            continue
        seen[(c["name"], c["constants"], c["specialization"], c["num_warps"], c["num_stages"])] += 1
    for (name, consts, spec, warps, stages), n in seen.items():
        out.append(f"compiled while serving ({n}x): triton {name} constexprs {consts} "
                   f"specialization {spec} num_warps={warps} num_stages={stages}")
    if rec.tilelang_by_phase.get("serve"):
        out.append(f"compiled while serving: {rec.tilelang_by_phase['serve']} TileLang kernel(s)")
    return out


def check(rec: Recorder, ccs=(80, 86)) -> dict:
    """The audit's findings as a JSON-able dict; ``failed`` lists what cannot run on Ampere."""
    triton_rows, failed = [], []
    for entry in rec.triton.values():
        builds = {cc: build_for(entry, cc) for cc in ccs}
        errs = {cc: b["error"] for cc, b in builds.items()}
        fp8 = any("fp8e4nv" in str(t) for t in entry["signature"].values())
        row = dict(name=entry["name"], phase=entry["phase"], region=entry.get("region"),
                   num_warps=entry["num_warps"], fp8e4nv_arg=fp8,
                   **{f"sm{cc}": (e or "ok") for cc, e in errs.items()},
                   **{f"shared_sm{cc}": b["shared"] for cc, b in builds.items()})
        triton_rows.append(row)
        if any(errs.values()):
            failed.append(f"triton {entry['name']}: " + "; ".join(
                f"sm_{cc}: {e}" for cc, e in errs.items() if e))
    libs = library_archs()
    op_rows = []
    for op, n in sorted(rec.ops.items()):
        ns = op.split("::")[0]
        owners = op_libraries(ns, libs)
        archs = sorted({a for so in owners for a in libs[so]})
        ok = ns not in _NO_AMPERE_NS and (not owners or any(
            a in ("sm_80", "sm_86") or (a.startswith("sm_") and a[3:].isdigit() and int(a[3:]) <= 80)
            for a in archs))
        op_rows.append(dict(op=op, calls=n, libraries=owners, archs=archs, ampere=ok))
        if not ok:
            failed.append(f"op {op}: libraries {owners} carry {archs}")
    for f, n in rec.deep_gemm.items():
        failed.append(f"DeepGEMM {f} called {n}x (no sm_80 kernels)")
    serve = serve_compile_failures(rec)
    return dict(triton_kernels=triton_rows, cuda_ops=op_rows, deep_gemm_calls=dict(rec.deep_gemm),
                tilelang_compiles=dict(rec.tilelang), compiles_by_phase=dict(rec.compiles),
                tilelang_by_phase=dict(rec.tilelang_by_phase),
                region_ops={r: dict(c) for r, c in rec.region_ops.items()},
                serve_compiles=[c for c in rec.serve_compiles if not outside_path(c)],
                serve_compiles_outside=[c for c in rec.serve_compiles if outside_path(c)],
                zero_compile=not serve, warmup_seconds=dict(rec.warmup_seconds),
                libraries=libs, failed=failed + serve)
