"""GPU-free compile gate for the mHC TileLang kernels on Ampere (sm_80, sm_86).

vLLM 0.33.0 runs mHC on NVIDIA GPUs through TileLang kernels
(vllm/model_executor/kernels/mhc/tilelang_kernels.py, warmup.py). This gate compiles every
compile key the Ampere path dispatches — each kernel object's own ``dispatch`` evaluated at
decode and prefill token counts (``TOKENS``), hidden sizes 4096/5120/7168 and hc_mult 4,
with DeepGEMM absent (so the projection is TileLang's prenorm GEMM, one split, and V4's
first layer runs it at hc_mult=1 through vllm.deepinfer.mhc) — through upstream's own
compile-only warmup path (``VllmTileLangJitKernel.compile``: storage-less tensors, no
launch), with TileLang's target set to ``{"kind": "cuda", "arch": "sm_8x"}``.

For each build it reports registers (``cuobjdump --dump-resource-usage`` on the cubin),
shared memory (static from the cubin plus the dynamic size the host stub launches with) and
fails on: a compile error, shared memory over the 48 KiB Ampere budget
(vllm.deepinfer.arch), a cubin not built for the target, or an sm_90-only instruction in
the device source (wgmma, TMA ``cp.async.bulk``, ``setmaxnreg``, ``griddepcontrol`` — PDL,
which upstream enables only from 9.0). PDL is read from the kernels module as the Ampere
platform sets it (off: the gate runs on vLLM's CPU platform, where it is off too; the gate
asserts so).

    CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched python -m vllm.deepinfer.mhc.gate \
        [--json F] [--set ci|full] [--targets 80,86] [--jobs N]

``--set ci`` (``make gate-mhc``) compiles a representative set (``_ci_targets``: every
kernel function in every code-changing form at hidden 5120 for both targets, the
hidden-dividing geometries of 4096/7168 for sm_80); ``--set full`` compiles every key of
every hidden size for both targets. TileLang caches builds in ``TILELANG_CACHE_DIR``
(``make`` and tests/conftest.py set ``$DEEPINFER_CACHE/tilelang``, by default
~/.cache/deepinfer/tilelang; left unset, the gate uses build/tilelang-cache): a second
run costs seconds. Needs vLLM's source tree importable (build/patched: the pinned sdist with
the series applied), TileLang 0.1.12 and nvcc.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any

HIDDEN_SIZES = (4096, 5120, 7168)
HC_MULT = 4
# Token counts the Ampere path meets: decode batches (1..32 covers every fused post+pre
# geometry band) and prefill chunks (the prenorm GEMM changes form at 128 and 1024 tokens).
TOKENS = (1, 2, 4, 6, 8, 12, 15, 16, 24, 32, 33, 64, 127, 128, 512, 1023, 1024, 8192)
TARGETS = (80, 86)
# DeepSeek-V4/V4.1 mHC constants that enter compile keys (config.json: rms_norm_eps,
# hc_eps, hc_sinkhorn_iters; hc_post_alpha is 2.0 in both models' code). The values only
# become immediates in the code; any value compiles alike.
EPS = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult_value=2.0,
           sinkhorn_repeat=20)
NORM_EPS = 1e-6
# Instructions that exist only from sm_90 (device source mnemonics / CUDA intrinsics).
SM90_ONLY = ("wgmma", "cp.async.bulk", "setmaxnreg", "griddepcontrol",
             "cudaGridDependencySynchronize", "cudaTriggerProgrammaticLaunchCompletion")


@dataclasses.dataclass(frozen=True)
class GateCase:
    kernel: str     # the upstream kernel object (module attribute) or ours
    key: Any        # its compile key (a frozen dataclass)
    hidden: int

    @property
    def name(self) -> str:
        if callable(self.key):
            return self.kernel
        fields = dataclasses.asdict(self.key) if dataclasses.is_dataclass(self.key) else self.key
        short = {k: v for k, v in fields.items() if k not in EPS and k != "norm_eps"}
        return f"{self.kernel}({','.join(f'{k}={v}' for k, v in short.items())})"


@dataclasses.dataclass
class GateResult:
    name: str
    kernel: str
    hidden: int
    cc: int
    ok: bool
    seconds: float = 0.0
    regs: int | None = None
    shared_static: int | None = None
    shared_dynamic: int | None = None
    local: int | None = None  # spill/stack bytes per thread (0: no register spills)
    budget: int | None = None
    sm90_only: list[str] = dataclasses.field(default_factory=list)
    source_sha256: str = ""  # of TileLang's CUDA device source (sm_80 vs sm_86 comparisons)
    error: str = ""

    @property
    def shared(self) -> int | None:
        if self.shared_static is None:
            return None
        return self.shared_static + (self.shared_dynamic or 0)


# ----------------------------------------------------------------------------- setup
def _bind_tilelang():
    """Make vLLM's TileLang helpers see TileLang as they do on a CUDA platform (on vLLM's CPU
    platform they leave ``T``/``tilelang`` unbound), with the CUDA pass configs, before the
    kernels module is imported and decorates its kernels."""
    # The Ampere path's routing (vllm.deepinfer.mhc): the sm80 variant, DeepGEMM absent.
    os.environ.setdefault("DEEPINFER_ARCH", "sm80")
    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(
        os.environ.get("DEEPINFER_BUILD", "build"), "tilelang-cache"))
    import tilelang
    import tilelang.language as T
    import vllm.tilelang_utils as tu
    tu.T, tu.tilelang = T, tilelang
    cfg = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
           tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
           tilelang.PassConfigKey.TL_PTXAS_REGISTER_USAGE_LEVEL: 10}  # as upstream on CUDA
    tu._get_pass_configs = lambda: dict(cfg)
    import vllm.model_executor.kernels.mhc.tilelang_kernels as tk
    import vllm.model_executor.kernels.mhc.warmup as wu
    if tk.ENABLE_PDL:
        raise RuntimeError("mhc gate: the kernels module enabled PDL; Ampere builds have it off")
    # compute_num_split reads the GPU's SM count; the Ampere path (no DeepGEMM) only uses it
    # for split-k sizes DeepGEMM would take, which the gate does not compile.
    tk.compute_num_split = lambda block_k, k, grid: 1
    return tk, wu


def cases(tk, wu, hidden_sizes=HIDDEN_SIZES, tokens=TOKENS) -> list[GateCase]:
    """Every compile key the Ampere path dispatches, one per distinct key: upstream's kernel
    objects' ``dispatch`` with vllm.deepinfer.mhc's routing in force (the fused geometry of
    FUSED_GEOMETRY, the tensor-core projection from TC_MIN_TOKENS tokens, TileLang's FMA
    prenorm GEMM below it, no DeepGEMM)."""
    from vllm.deepinfer import mhc
    from vllm.deepinfer.mhc import kernels, warmup
    out: list[GateCase] = []

    def add(kernel, key, hidden):
        c = GateCase(kernel, key, hidden)
        if c not in out:
            out.append(c)

    n_out = HC_MULT * (HC_MULT + 2)
    max_tokens = max(tokens)
    for h in hidden_sizes:
        splits = {1}
        for t in tokens:
            if tk.mhc_fused_post_pre_split_config(t, h, HC_MULT) is not None:
                key = tk._MHC_FUSED_TILELANG_KERNEL.dispatch(num_tokens=t, hidden_size=h,
                                                             hc_mult=HC_MULT)
                splits.add(key.n_splits)
                add("_MHC_FUSED_TILELANG_KERNEL", key, h)
            # Projections without DeepGEMM: the hc stream (K = 4h) and the first layers'
            # embedding row (K = h: V4.1's mhc_pre_delayed_tilelang, V4's broadcast pre).
            for hc in (HC_MULT, 1):
                if not mhc.projection_on_tc(t, hc * h, n_out, deep_gemm_supported=False):
                    add("_HC_PRENORM_GEMM_TILELANG_KERNEL",
                        tk._HC_PRENORM_GEMM_TILELANG_KERNEL.dispatch(
                            num_tokens=t, hc_hidden_size=hc * h, hidden_size=h, hc_mult=hc,
                            n_out=n_out), h)
        for hc in (HC_MULT, 1):
            for key in warmup.tc_keys(hc * h, n_out, max_tokens, warmup.AMPERE_SM_COUNTS):
                add("prenorm_gemm_tc", key, h)
                splits.add(key.n_splits)
        add("_MHC_POST_TILELANG_KERNEL", tk._MHC_POST_TILELANG_KERNEL.dispatch(
            hidden_size=h, hc_mult=HC_MULT), h)
        add("_HC_HEAD_FUSED_TILELANG_KERNEL", tk._HC_HEAD_FUSED_TILELANG_KERNEL.dispatch(
            hidden_size=h, hc_mult=HC_MULT, rms_eps=EPS["rms_eps"], hc_eps=EPS["hc_pre_eps"]), h)
        # V4 epilogues (mhc_pre / fused post+pre with RMSNorm; the first-layer broadcast).
        for n in sorted(splits):
            add("_MHC_PRE_BIG_FUSE_TILELANG_KERNEL", tk._MHC_PRE_BIG_FUSE_TILELANG_KERNEL.dispatch(
                hidden_size=h, hc_mult=HC_MULT, n_splits=n, is_broadcast=False,
                use_norm_weight=True, norm_eps=NORM_EPS, **EPS), h)
            add("_MHC_PRE_BIG_FUSE_TILELANG_KERNEL", tk._MHC_PRE_BIG_FUSE_TILELANG_KERNEL.dispatch(
                hidden_size=h, hc_mult=HC_MULT, n_splits=n, is_broadcast=True,
                use_norm_weight=True, norm_eps=NORM_EPS, broadcast_norm_eps=NORM_EPS, **EPS), h)
        # V4.1 delayed epilogue (MHC_PRE_NORM_KERNEL), the variants its model registers:
        # broadcast embedding (hidden-wide row, stream 0), hc stream with and without the
        # carried pre-mix; fused split_mode (the overlap modes need DeepGEMM on SM100).
        for rms_numel, pre_in in ((h, False), (HC_MULT * h, False), (HC_MULT * h, True)):
            for n in sorted(splits):
                add("MHC_PRE_NORM_KERNEL", wu.MHC_PRE_NORM_KERNEL.dispatch(
                    n_splits=n, hidden_size=h, norm_eps=NORM_EPS, hc_mult=HC_MULT,
                    use_pre_mix_in=pre_in, rms_numel=rms_numel, **EPS), h)
    return out


# CI (``--set ci``): each TileLang kernel function the Ampere path dispatches, in each flag
# form that changes its code, at hidden 5120 for sm_80 and sm_86 — the epilogues at one
# split (the split count is a serial loop bound), V4.1's delayed epilogue in its per-layer
# form (carried pre-mix over the hc stream), the tensor-core GEMM at its largest tile (the
# one at the shared-memory budget) for both targets and its smaller tiles for sm_80; at 4096
# and 7168 the geometries that divide hidden (fused post + pre, FMA prenorm GEMM) for
# sm_80. About 3 CPU-minutes from an empty cache (each build lowers through TileLang and
# runs nvcc; the epilogues take 25-60 s each), under one from a filled TileLang cache
# (``TILELANG_CACHE_DIR``: ~/.cache/deepinfer/tilelang under ``make``). ``--set full``
# compiles every key for both targets (about 200 builds).
CI_HIDDEN = 5120
CI_OTHER_HIDDEN_KERNELS = ("_MHC_FUSED_TILELANG_KERNEL", "_HC_PRENORM_GEMM_TILELANG_KERNEL")


def _ci_targets(c: GateCase, targets) -> tuple[int, ...]:
    """The CI targets of a case (none: full set only)."""
    k, key = c.kernel, c.key
    if c.hidden != CI_HIDDEN:
        return (targets[0],) if k in CI_OTHER_HIDDEN_KERNELS else ()
    if k in ("_MHC_PRE_BIG_FUSE_TILELANG_KERNEL", "MHC_PRE_NORM_KERNEL") and key.n_splits != 1:
        return ()
    if k == "MHC_PRE_NORM_KERNEL" and not (key.use_pre_mix_in and key.rms_numel > c.hidden):
        return ()
    if k == "prenorm_gemm_tc":
        if key.k != HC_MULT * c.hidden or key.n_splits != max(kernels_split_buckets()):
            return ()
        return tuple(targets) if key.block_m == 64 else (targets[0],)
    return tuple(targets)


def kernels_split_buckets() -> tuple[int, ...]:
    from vllm.deepinfer.mhc import kernels
    return kernels.SPLIT_BUCKETS


def plan(all_cases: list[GateCase], which: str, targets=TARGETS) -> list[tuple[GateCase, int]]:
    if which == "full":
        return [(c, cc) for c in all_cases for cc in targets]
    if which != "ci":
        raise ValueError(f"--set {which!r}: expected ci or full")
    return [(c, cc) for c in all_cases for cc in _ci_targets(c, targets)]


# ----------------------------------------------------------------------------- compile
def _cuobjdump() -> str | None:
    try:
        import triton
        bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                               "cuobjdump")
        if os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def _resource_usage(cubin_path: str) -> tuple[int | None, int | None, str, int | None]:
    """(registers, static shared bytes, sm target, local bytes) of a cubin, from cuobjdump."""
    tool = _cuobjdump()
    if tool is None:
        return None, None, "", None
    out = subprocess.run([tool, "--dump-resource-usage", cubin_path], capture_output=True,
                         text=True, timeout=120).stdout
    sass = subprocess.run([tool, "-sass", cubin_path], capture_output=True, text=True,
                          timeout=120).stdout
    regs = max((int(r) for r in re.findall(r"REG:(\d+)", out)), default=None)
    shared = max((int(s) for s in re.findall(r"SHARED:(\d+)", out)), default=None)
    m = re.search(r"code for (sm_\d+)", sass)
    local = max((int(a) + int(b) for a, b in re.findall(r"STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)),
                default=None)
    return regs, shared, (m.group(1) if m else ""), local


class _CubinTap:
    """Records the CUDA-binary cache key TileLang computes while building (its cubin lands at
    ``CUDABinaryCache.get_path(key, "cubin")``). A build served whole from TileLang's kernel
    cache computes none; its facts then come from the record this gate wrote next to the
    cache the first time (keyed by device source and target)."""

    def __init__(self):
        from tilelang.cache.cuda_binary_cache import CUDABinaryCache
        self.cls = CUDABinaryCache
        self.keys: list[str] = []
        orig = CUDABinaryCache.__dict__["make_key"].__func__
        tap = self

        def make_key(cls, **kw):
            key = orig(cls, **kw)
            if kw.get("compile_format") == "cubin":
                tap.keys.append(key)
            return key
        CUDABinaryCache.make_key = classmethod(make_key)

    def facts(self, device_source: str, cc: int) -> tuple:
        import hashlib
        import json
        root = os.path.join(self.cls._get_namespace_root(), "deepinfer-gate")
        os.makedirs(root, exist_ok=True)
        rec = os.path.join(root, hashlib.sha256(device_source.encode()).hexdigest()
                           + f"-sm_{cc}.json")
        path = self.cls.get_path(self.keys[-1], "cubin") if self.keys else None
        if path and os.path.exists(path):
            got = _resource_usage(path)
            if got[0] is not None:  # written whole, then renamed: parallel gates read it
                tmp = f"{rec}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(got, f)
                os.replace(tmp, rec)
            return got
        if os.path.exists(rec):
            with open(rec) as f:
                got = json.load(f)
            if len(got) == 4:
                return tuple(got)
        return None, None, "", None


_CALL = re.compile(r"TVMFFIFunctionCall\((\w+)_packed, \(TVMFFIAny\*\) stack_ffi_any, (\d+)")


def _dynamic_shared(host_source: str, device_source: str) -> int:
    """Dynamic shared bytes each kernel is launched with: TVM's host stub passes the launch
    parameters last (grid, block, then the dynamic shared size when the kernel uses
    ``buf_dyn_shmem``)."""
    if "buf_dyn_shmem" not in device_source:
        return 0
    kernels = set(re.findall(r"__global__ void(?: __launch_bounds__\([^)]*\))? (\w+)\(",
                             device_source))
    best = 0
    for m in _CALL.finditer(host_source):
        if m.group(1) not in kernels:
            continue
        nargs = int(m.group(2))
        head = host_source[:m.start()]
        v = re.findall(rf"stack_ffi_any\)\[{nargs - 1}\]\.v_int64\) = \(\(int64_t\)(\d+)\)", head)
        if not v:
            raise ValueError(f"mhc gate: dynamic shared size of {m.group(1)} not a constant")
        best = max(best, int(v[-1]))
    return best


def check(tk, wu, case: GateCase, cc: int, budget: int) -> GateResult:
    from tilelang import tvm
    import vllm.model_executor.warmup.jit_warmup_tilelang_helper as helper
    res = GateResult(case.name, case.kernel, case.hidden, cc, ok=False, budget=budget)
    built: list = []
    tap = _TAP
    tap.keys.clear()

    def capture(jit_impl, *args, **kwargs):
        built.append(jit_impl.compile(*args, **kwargs))

    owner = getattr(wu if case.kernel == "MHC_PRE_NORM_KERNEL" else tk, case.kernel, None)
    t0 = time.time()
    try:
        with tvm.target.Target({"kind": "cuda", "arch": f"sm_{cc}"}):
            if callable(case.key):  # a probe: a function returning a compiled kernel
                built.append(case.key())
            elif case.kernel == "prenorm_gemm_tc":
                from vllm.deepinfer.mhc import kernels
                built.append(kernels.compile_tc(case.key))
            elif case.kernel == "MHC_PRE_NORM_KERNEL":
                built.append(owner.kernel.compile(**dataclasses.asdict(case.key)))
            else:
                saved, helper.compile_tilelang = helper.compile_tilelang, capture
                try:
                    owner._warming_key = case.key
                    owner(**owner.warmup_inputs(case.key))
                finally:
                    owner._warming_key = None
                    helper.compile_tilelang = saved
        kernel = built[-1]
        device = kernel.get_kernel_source()
        import hashlib
        res.source_sha256 = hashlib.sha256(device.encode()).hexdigest()
        res.regs, res.shared_static, arch, res.local = tap.facts(device, cc)
        res.sm90_only = [s for s in SM90_ONLY if s in device]
        res.shared_dynamic = _dynamic_shared(kernel.get_host_source(), device)
    except Exception as e:  # a compile failure is a gate failure, with its message
        res.seconds = round(time.time() - t0, 2)
        res.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
        return res
    res.seconds = round(time.time() - t0, 2)
    problems = []
    if res.sm90_only:
        problems.append(f"sm_90-only instructions {res.sm90_only}")
    if arch and arch != f"sm_{cc}":
        problems.append(f"cubin built for {arch}, not sm_{cc}")
    if res.shared is None:
        problems.append("shared memory not reported (cuobjdump missing)")
    elif res.shared > budget:
        problems.append(f"shared {res.shared} B > budget {budget} B")
    res.error = "; ".join(problems)
    res.ok = not problems
    return res


def format_table(results: list[GateResult]) -> str:
    rows = [f"{'kernel / key':100s} {'hidden':>6s} {'target':7s} {'regs':>5s} {'spill':>5s} "
            f"{'shared':>7s} {'budget':>7s} {'s':>6s}  status"]
    for r in results:
        rows.append(f"{r.name[:100]:100s} {r.hidden:>6d} sm_{r.cc:<4d} "
                    f"{r.regs if r.regs is not None else '-':>5} "
                    f"{r.local if r.local is not None else '-':>5} "
                    f"{r.shared if r.shared is not None else '-':>7} {r.budget:>7} "
                    f"{r.seconds:>6.1f}  {'ok' if r.ok else 'FAIL: ' + r.error}")
    return "\n".join(rows)


_TAP: _CubinTap | None = None
_PLAN: dict[str, list] = {}


def _worker(args):
    global _TAP
    which, index, cc = args
    tk, wu = _bind_tilelang()
    if _TAP is None:
        _TAP = _CubinTap()
    if which not in _PLAN:
        _PLAN[which] = plan(cases(tk, wu), which)
    case = _PLAN[which][index][0]
    from vllm.deepinfer.arch import VARIANTS
    return check(tk, wu, case, cc, VARIANTS["sm86"].smem_budget)


def main(argv=None) -> int:
    import argparse
    import json
    ap = argparse.ArgumentParser(description="Compile the Ampere mHC TileLang kernels.")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--set", default="ci", choices=("ci", "full"))
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="parallel compiles (each runs nvcc)")
    ap.add_argument("--list", action="store_true", help="print the plan and exit")
    a = ap.parse_args(argv)
    try:
        tk, wu = _bind_tilelang()
    except ImportError as e:
        print(f"mhc gate: needs vLLM's source tree (PYTHONPATH=build/patched) and TileLang "
              f"0.1.12: {e}", file=sys.stderr)
        return 2
    todo = plan(cases(tk, wu), a.set)
    if a.list:
        for c, cc in todo:
            print(f"{c.name} hidden={c.hidden} sm_{cc}")
        print(f"{len(todo)} builds", file=sys.stderr)
        return 0
    t0 = time.time()
    jobs = [(a.set, i, cc) for i, (_, cc) in enumerate(todo)]
    if a.jobs > 1:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(a.jobs) as pool:
            results = pool.map(_worker, jobs, chunksize=1)
    else:
        results = [_worker(j) for j in jobs]
    print(format_table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dict(dataclasses.asdict(r), shared=r.shared) for r in results], f,
                      indent=1)
    bad = [r for r in results if not r.ok]
    print(f"mhc gate: {len(results) - len(bad)} passed, {len(bad)} failed "
          f"({time.time() - t0:.0f} s)", file=sys.stderr)
    return 1 if bad or not results else 0


if __name__ == "__main__":
    from vllm.deepinfer.mhc.gate import main as _main
    raise SystemExit(_main())
