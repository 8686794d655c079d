"""Kernel builds: a compile-gate spec compiled for sm_80 / sm_90 as Triton's launcher
would specialize it, its SASS and resource use parsed (``Code``), cached under
build/a100_model/ keyed by the kernel's source hash, constexprs, target and Triton version."""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import tempfile

from .common import BUILD, ModelError, _overlay_on_path
from .sass import Inst, find_loops, parse_sass

CACHE = BUILD / "a100_model"


@dataclasses.dataclass
class Code:
    """One compiled kernel: its SASS and resource use."""
    name: str
    cc: int
    num_warps: int
    shared: int
    regs: int
    insts: list
    loops: list
    key: str = ""   # build identity (kernel source, constexprs, specialization, target)

    def region_of(self, ins: Inst) -> int:
        """Index of the innermost loop holding ``ins`` (-1: straight-line code)."""
        best, size = -1, None
        for i, lp in enumerate(self.loops):
            if lp.contains(ins.addr) and (size is None or lp.end - lp.start < size):
                best, size = i, lp.end - lp.start
        return best

    def regions(self) -> dict[int, list[Inst]]:
        out: dict[int, list[Inst]] = collections.defaultdict(list)
        for ins in self.insts:
            out[self.region_of(ins)].append(ins)
        return out

    def head(self, exit_ordinal: int) -> list[Inst]:
        """Instructions up to and including the ``exit_ordinal``-th guarded EXIT (an early
        return, counted from 0 in address order): what a program leaving there runs."""
        exits = [k for k, i in enumerate(self.insts) if i.base == "EXIT" and i.guarded]
        if exit_ordinal >= len(exits):
            raise ModelError(f"{self.name} sm_{self.cc}: no early exit #{exit_ordinal} "
                             f"({len(exits)} guarded EXITs)")
        return self.insts[:exits[exit_ordinal] + 1]

    def class_counts(self, region: int) -> dict[str, int]:
        return dict(collections.Counter(i.cls for i in self.regions().get(region, [])))


def _triton_tool(name: str) -> str:
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.access(path, os.X_OK):
        raise ModelError(f"{path}: missing; Triton's NVIDIA backend ships {name}")
    return path


def runtime_attrs(spec, ints: dict | None) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as Triton's launcher would specialize ``spec``'s
    kernel for a call with the integer arguments ``ints`` (name -> value): pointers are
    16-byte aligned (torch allocations), an integer equal to 1 becomes a constant, one
    divisible by 16 gets ``tt.divisibility`` (unless the kernel lists it in
    ``do_not_specialize``). The compile gate builds without these hints; the kernels ran
    with them, and they decide, e.g., whether record loads are vectorized."""
    sig, constexprs, attrs = dict(spec.signature), dict(spec.constexprs), {}
    if ints is None:
        return sig, constexprs, attrs
    for idx, (name, no_spec, no_align) in enumerate(_params(spec.kernel)):
        t = sig.get(name)
        if t is None or t == "constexpr":
            continue
        if t.startswith("*"):
            if not no_align:
                attrs[(idx,)] = [["tt.divisibility", 16]]
        elif t[0] in "iu" and name in ints and not no_spec:
            v = ints[name]
            if v == 1:
                sig[name] = "constexpr"
                constexprs[name] = 1
            elif v % 16 == 0:
                attrs[(idx,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs


def _params(kernel) -> list[tuple[str, bool, bool]]:
    """(name, do_not_specialize, do_not_specialize_on_alignment) per kernel parameter, from
    a JITFunction or (under TRITON_INTERPRET) the InterpretedFunction standing in for it."""
    if hasattr(kernel, "params"):
        return [(p.name, bool(p.do_not_specialize), bool(p.do_not_specialize_on_alignment))
                for p in kernel.params]
    names = list(kernel.arg_names)
    kw = getattr(kernel, "kwargs", {}) or {}

    def listed(key):
        return {names[x] if isinstance(x, int) else x for x in (kw.get(key) or ())}
    ns, na = listed("do_not_specialize"), listed("do_not_specialize_on_alignment")
    return [(n, n in ns, n in na) for n in names]


def _spec_key(spec, cc: int, ints: dict | None = None) -> str:
    import triton
    sig, constexprs, attrs = runtime_attrs(spec, ints)
    h = hashlib.sha256()
    for part in (spec.kernel.cache_key, json.dumps(constexprs, sort_keys=True, default=str),
                 json.dumps(sig, sort_keys=True), sorted(attrs), spec.num_warps,
                 spec.num_stages, cc, triton.__version__):
        h.update(str(part).encode())
    return h.hexdigest()[:24]


def compile_code(spec, cc: int, ints: dict | None = None, use_cache: bool = True) -> Code:
    """Compile a compile-gate spec for sm_``cc`` (specialized for the integer arguments
    ``ints`` as Triton's launcher would) and parse its SASS (cached)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise ModelError("TRITON_INTERPRET is set: the model compiles real kernels; unset it")
    key = _spec_key(spec, cc, ints)
    cached = CACHE / f"{key}.json"
    if use_cache and cached.is_file():
        d = json.loads(cached.read_text())
        sass, shared, regs = d["sass"], d["shared"], d["regs"]
    else:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        sig, constexprs, attrs = runtime_attrs(spec, ints)
        if getattr(spec.kernel, "is_gluon", lambda: False)():  # a Gluon kernel
            from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
        compiled = triton.compile(ASTSource(spec.kernel, sig, constexprs, attrs),
                                  target=GPUTarget("cuda", cc, 32),
                                  options={"num_warps": spec.num_warps,
                                           "num_stages": spec.num_stages})
        shared = int(compiled.metadata.shared)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            sass = subprocess.run([_triton_tool("cuobjdump"), "-sass", f.name],
                                  capture_output=True, text=True, timeout=300).stdout
            res = subprocess.run([_triton_tool("cuobjdump"), "--dump-resource-usage", f.name],
                                 capture_output=True, text=True, timeout=300).stdout
        m = re.search(r"REG:(\d+)", res)
        regs = int(m.group(1)) if m else 255
        if use_cache:
            CACHE.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps({"name": spec.name, "cc": cc, "ints": ints,
                                          "sass": sass, "shared": shared, "regs": regs}))
    funcs = parse_sass(sass)
    if len(funcs) != 1:
        raise ModelError(f"{spec.name} sm_{cc}: expected one function in the cubin, got "
                         f"{sorted(funcs)}")
    insts = next(iter(funcs.values()))
    return Code(spec.name, cc, spec.num_warps, shared, regs, insts, find_loops(insts), key)


def _spec(name: str, **constexprs):
    """A registered compile-gate spec, with constexprs overridden (benchmark launches)."""
    _overlay_on_path()
    from vllm.deepinfer import compile_gate
    specs = {s.name: s for s in compile_gate.specs()}
    if name not in specs:
        raise ModelError(f"kernel spec {name!r} is not registered; known: "
                         f"{', '.join(sorted(specs))}")
    s = specs[name]
    return dataclasses.replace(s, constexprs={**s.constexprs, **constexprs}) if constexprs else s


_CODES: dict = {}


def code_for(spec, cc: int, ints: dict | None = None) -> Code:
    key = (_spec_key(spec, cc, ints), spec.name)
    if key not in _CODES:
        _CODES[key] = compile_code(spec, cc, ints)
    return _CODES[key]
