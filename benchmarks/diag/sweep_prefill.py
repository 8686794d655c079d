#!/usr/bin/env python3
"""Tile sweep of the sparse MLA prefill, and the compile-gate figures behind the tile choice.

    python3 benchmarks/diag/sweep_prefill.py --gate-only [--out F.json]   # CPU: no GPU needed
    python3 benchmarks/diag/sweep_prefill.py [--out F.json]               # GPU: gate + timings
    python3 benchmarks/diag/sweep_prefill.py --sm90-only [--out F.json]   # the wgmma tiles only
    python3 benchmarks/diag/sweep_prefill.py --only sm80,sm80-plain-w2      # named candidates

``--gate-only`` compiles every candidate tile (and upstream's kernel, specialized as Triton
specializes it at runtime: 16-byte aligned pointers, strides divisible by 16, unit strides
constant) for its targets without a GPU and reports shared memory, registers, spill bytes
(cuobjdump's STACK) and the instruction mix of the key loop, per warp and per iteration, read
from the SASS (the longest backward branch's body): mma (HMMA: mma.sync; HGMMA: wgmma),
ldmatrix (LDSM), other shared loads/stores, global loads (LDG) and async copies (LDGSTS), and
the integer/select instructions that address and mask the gathered rows. ``per_kq`` scales the
loop to one key x 64 heads (the work the tiles share), so tiles of different sizes compare.

Without ``--gate-only`` (one CUDA GPU, build/upstream_kernels present) each candidate is also
timed as the sparse_mla_prefill suite times ours (CUDA graph, input ring) at three shapes:
T=2048 new tokens after 64K, top-k 512 + window 128, 64 and 128 heads; T=512 after 1M, top-k
8192 (c128a). Output: one JSON line per measurement, a summary table, and the best row per
family (mma.sync tiles for sm80/sm86, wgmma tiles for sm90) as a ``TILES`` line.
``--sm90-only``: the sm90 candidates and upstream, gated for sm_90 and timed (on an H200 the
run is mostly startup; each candidate x shape is one compile and one CUDA-graph timing), at
a fourth shape too: T=2048 after 8K with top-k 8192 over ratio 128 (208-key lists, where a
program's fixed costs weigh most).
Candidates whose sm_90 SASS is identical to an earlier candidate's are gated but not timed
(``same_sass_as``), and so are those the gate rejects (compile error, shared memory over the
227 KiB an sm_90 block may take).
docs/sparse-mla-prefill.md says how the shipped tiles were chosen.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for p in (REPO / "overlay", REPO / "build", REPO / "benchmarks"):
    sys.path.insert(0, str(p))

from vllm.deepinfer.kernels import sparse_mla_prefill as spm  # noqa: E402

T = spm.Tile
# (name, tile, gate targets). The first of each family is the shipped tile.
CANDIDATES = [
    ("sm80", spm.TILES["sm80"], (80, 86)),
    ("sm80-split4-s3", T(16, 16, 4, 3, split_d=4), (80, 86)),
    ("sm80-split8", T(16, 16, 8, 2, split_d=8), (80, 86)),
    ("sm80-split2-w2", T(16, 16, 2, 2, split_d=2), (80, 86)),
    ("sm80-plain", T(16, 16, 4, 2), (80, 86)),
    # The shipped tile with one Q.K^T chain (qk_halves off): the Ampere tile until 3a8606c.
    ("sm80-plain-w2", T(16, 16, 2, 2), (80, 86)),
    ("sm90", spm.TILES["sm90"], (90,)),
    # The Gluon kernel with one program per work item instead of one per SM.
    ("sm90-per-item", T(64, 64, 8, 2, gluon_ws=True, persistent=False), (90,)),
    # The Triton tile (the sm90 row until the Gluon kernel); the rows below vary it.
    ("sm90-triton", spm.TILES["sm90-triton"], (90,)),
    ("sm90-n32-s3", T(64, 32, 8, 3), (90,)),
    ("sm90-n32-s2", T(64, 32, 8, 2), (90,)),
    ("sm90-n16-s3", T(64, 16, 8, 3), (90,)),
    ("sm90-n64-s1", T(64, 64, 8, 1), (90,)),
    # The key-loop knobs (Tile's warp_spec .. rescale_tau) and warp counts the sweep of
    # 4ab26c8 did not try. Triton 3.6 on sm_90 (the gate's findings): warp_spec and
    # loop_stages=2 give the shipped tile's SASS unchanged (Triton's automatic warp
    # specialization does not transform this loop on Hopper; the kernel's 2 stages already
    # pipeline the loop); unroll=2 needs 332 KiB and spills; 12 warps is refused (powers of 2
    # only); 128 heads x 32 keys on 16 warps fails in ptxas (wgmma needs 158 registers, 16
    # warps allow 128). Those stay as gate-only rows.
    ("sm90-tau8", T(64, 64, 8, 2, rescale_tau=8.0), (90,)),
    ("sm90-ls3", T(64, 64, 8, 2, loop_stages=3), (90,)),
    ("sm90-w4", T(64, 64, 4, 2), (90,)),
    ("sm90-w16", T(64, 64, 16, 2), (90,)),
    ("sm90-ws", T(64, 64, 8, 2, warp_spec=True), (90,)),
    ("sm90-ls2", T(64, 64, 8, 2, loop_stages=2), (90,)),
    ("sm90-u2", T(64, 64, 8, 2, unroll=2), (90,)),
    ("sm90-h128-n32-w16", T(128, 32, 16, 2), (90,)),
]
# Shared memory an Ampere build may use (arch.VARIANTS["sm80"].smem_budget).
AMPERE_BUDGET = 48 * 1024
# The most an sm_90 block may take (arch.VARIANTS["sm90"]'s budget).
HOPPER_BUDGET = 227 * 1024
MIX = ("HMMA", "HGMMA", "LDSM", "LDS", "STS", "LDG", "LDGSTS", "BAR", "MUFU", "FMUL", "FADD",
       "IMAD", "LEA", "ISETP", "SEL", "SHFL", "STL", "LDL")


def _cuobjdump() -> str:
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(tool)


def _loop_mix(sass: str) -> tuple[int, dict]:
    """(instructions, opcode counts) of the longest loop: the body of the backward branch
    that spans the most instructions."""
    ins = [(int(a, 16), t.strip()) for a, t in
           re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best: list[str] = []
    for addr, txt in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if len(body) > len(best):
                best = body
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                              for t in best)
    return len(best), {k: ops[k] for k in MIX if ops[k]}


def _resources(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        ru = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name],
                            capture_output=True, text=True, timeout=120).stdout
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True,
                              timeout=120).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", ru)
    n, mix = _loop_mix(sass)
    # A digest of the instructions alone (no names, addresses or encodings): equal digests
    # mean the same machine code, so the timing skips the later candidate.
    body = "\n".join(t.strip() for t in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass))
    return {"regs": int(m.group(1)) if m else None, "stack": int(m.group(2)) if m else None,
            "loop_instructions": n, "loop_mix": mix,
            "sass_sha": hashlib.sha256(body.encode()).hexdigest()[:16]}


def _per_kq(rec: dict, block_h: int, block_n: int, warps: int) -> dict:
    """Loop figures for one key x 64 heads: per-warp counts x warps / (keys x heads) x 64."""
    f = warps * 64 / (block_n * block_h)
    out = {"instructions": round(rec["loop_instructions"] * f, 1)}
    for k in ("HMMA", "HGMMA", "LDSM"):
        if k in rec["loop_mix"]:
            out[k] = round(rec["loop_mix"][k] * f, 2)
    return out


def gate_ours(name: str, tile, cc: int) -> dict:
    from vllm.deepinfer.compile_gate import GateSpec, compile_spec
    if tile.gluon_ws:
        spec = spm.gluon_ws_spec(name)
    else:
        spec = GateSpec(name=name, kernel=spm._sparse_mla_prefill_kernel, signature=spm._SIG,
                        constexprs=spm.gate_constexprs(tile), variants=("sm80",),
                        num_warps=tile.num_warps, num_stages=tile.num_stages)
    rec = {"name": name, "cc": cc, "tile": list(tile.__dict__.values())}
    try:
        # (a ptxas failure prints the whole PTX to stdout: kept out of the sweep's output)
        with contextlib.redirect_stdout(io.StringIO()):
            k = compile_spec(spec, cc)
    except Exception as e:  # a candidate that does not compile is a result, not a crash
        lines = str(e).strip().splitlines() or [""]
        # ptxas's message ends with its repro command; its "fatal" line says why.
        why = next((ln for ln in lines if "ptxas fatal" in ln), lines[-1]).strip()
        return {**rec, "error": f"{type(e).__name__}: {why[:200]}"}
    rec.update(shared=int(k.metadata.shared), **_resources(k.asm["cubin"]))
    if tile.gluon_ws:
        # The longest loop is one consumer warpgroup's: a pair of 64-key blocks per
        # iteration, run by the 8 consumer warps together.
        rec["per_kq"] = _per_kq(rec, 64, 128, 8)
        rec["persistent"] = tile.persistent
    else:
        rec["per_kq"] = _per_kq(rec, tile.block_h, tile.block_n, tile.num_warps)
    if cc < 89:
        rec["within_ampere_budget"] = rec["shared"] <= AMPERE_BUDGET
    if cc == 90:
        rec["within_hopper_budget"] = rec["shared"] <= HOPPER_BUDGET
    return rec


def gate_upstream(cc: int) -> dict:
    """Upstream's kernel as ``_rocm_sparse_attn_prefill_ragged_triton`` launches it, compiled
    with the specialization Triton gives it at runtime (aligned pointers; q/kv/out strides and
    the head count divisible by 16; the unit strides constant; default 3 stages)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = importlib.import_module("upstream_kernels.v41_sparse_prefill")._sparse_attn_prefill_ragged_kernel
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "kv_indices_ptr": "*i32",
            "kv_indptr_ptr": "*i32", "attn_sink_ptr": "*fp32", "out_ptr": "*bf16"}
    const = dict(q_stride_d=1, kv_stride_d=1, out_stride_d=1, HAS_ATTN_SINK=True, OUT_DV=512,
                 BLOCK_H=16, BLOCK_D=512, BLOCK_K=16)
    sig = {n: ptrs.get(n, "constexpr" if n in const else "fp32" if n == "scale" else "i32")
           for n in fn.arg_names}
    div16 = set(ptrs) | {"q_stride_t", "q_stride_h", "kv_stride_n", "out_stride_t",
                         "out_stride_h", "num_heads", "head_dim"}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", cc, 32),
                       options={"num_warps": 4, "num_stages": 3})
    rec = {"name": "upstream", "cc": cc, "tile": [16, 16, 4, 3, 1],
           "shared": int(k.metadata.shared), **_resources(k.asm["cubin"])}
    rec["per_kq"] = _per_kq(rec, 16, 16, 4)
    return rec


# The timing run's machine and versions (the harness's meta), written with the results.
META: dict = {}
# --only: the candidate names to gate and time (None: all).
ONLY: set | None = None


def _candidates(sm90_only: bool = False) -> list:
    return [c for c in CANDIDATES if (not sm90_only or c[0].startswith("sm90"))
            and (ONLY is None or c[0] in ONLY)]


def gate_all(sm90_only: bool = False) -> list[dict]:
    out = []
    for name, tile, targets in _candidates(sm90_only):
        for cc in targets:
            out.append(gate_ours(name, tile, cc))
    seen = {}
    for r in out:  # the same machine code as an earlier candidate: not timed again
        if "sass_sha" in r:  # (the Gluon kernel's launches differ in their grid alone)
            first = seen.setdefault((r["cc"], r["sass_sha"], r.get("persistent")), r["name"])
            if first != r["name"]:
                r["same_sass_as"] = first
    for cc in ((90,) if sm90_only else (80, 90)):
        try:
            out.append(gate_upstream(cc))
        except ModuleNotFoundError:
            print("build/upstream_kernels missing (make upstream-kernels): upstream skipped",
                  file=sys.stderr)
            break
    return out


def _print_gate(rows: list[dict]) -> None:
    print(f"{'tile':16s} {'target':6s} {'smem':>7s} {'regs':>4s} {'spill':>5s} "
          f"{'loop':>5s} {'/key*64h':>8s} {'mma/kq':>7s} {'ldsm/kq':>7s}  loop mix (per warp)")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:16s} sm_{r['cc']:<3d} {r['error']}")
            continue
        kq = r["per_kq"]
        note = (f"  [same SASS as {r['same_sass_as']}: not timed]" if "same_sass_as" in r
                else "  [over 227 KiB: not timed]" if not r.get("within_hopper_budget", True)
                else "")
        print(f"{r['name']:16s} sm_{r['cc']:<3d} {r['shared']:7d} {r['regs']!s:>4} "
              f"{r['stack']!s:>5} {r['loop_instructions']:5d} {kq['instructions']:8.1f} "
              f"{kq.get('HMMA', kq.get('HGMMA', 0)):7.2f} {kq.get('LDSM', 0):7.2f}  "
              f"{r['loop_mix']}{note}")


def _timed(rows_gate: list[dict], name: str, targets) -> bool:
    """Whether the candidate is worth a GPU timing: it compiled for all its targets, the
    sm_90 build fits the block's shared memory and is not an earlier candidate's SASS."""
    rows = [r for r in rows_gate if r["name"] == name]
    return bool(rows) and all("error" not in r and "same_sass_as" not in r
                              and r.get("within_hopper_budget", True) for r in rows)


def time_all(rows_gate: list[dict], sm90_only: bool = False) -> list[dict]:
    import torch

    from harness import Harness, max_abs_diff
    import suites.sparse_mla_prefill as S
    h = Harness(quick=True)
    META.update(h.meta)
    print(json.dumps({"meta": h.meta}), flush=True)
    out = []
    shapes = [(2048, 64 << 10, 512, 2, 64), (2048, 64 << 10, 512, 2, 128),
              (512, 1 << 20, 8192, 128, 64)]
    if sm90_only:  # short lists (208 keys: 80 compressed + the window), the fixed costs' share
        shapes.append((2048, 8 << 10, 8192, 128, 64))
    for tokens, ctx, topk, ratio, heads in shapes:
        x = S.make_case(h.dev, tokens, ctx, topk, ratio, heads, seed=0)
        flops = 2 * 2 * heads * 512 * int(x["lens"].sum())
        sample = torch.linspace(0, tokens - 1, 32, device=h.dev).long()
        ref = S.reference(x, sample)
        outb = torch.empty_like(x["q"])
        flat, indptr = S.upstream_ragged(x)
        up_us = h.time_graph(lambda _: S.upstream_kernel(x, flat, indptr, outb), [None])
        base = dict(tokens=tokens, ctx=ctx, topk=topk, heads=heads)
        out.append({**base, "name": "upstream", "us": round(up_us, 2),
                    "tflops": round(flops / up_us / 1e6, 1)})
        print(json.dumps(out[-1]), flush=True)
        for name, tile, targets in _candidates(sm90_only):
            if not _timed(rows_gate, name, targets):
                continue
            t0 = time.perf_counter()
            spm.TILES[f"sweep-{name}"] = tile
            row = {**base, "name": name}
            try:
                got = S.ours(x, f"sweep-{name}", out=outb)[sample]
                row["max_abs_diff"] = max_abs_diff(got, ref)
                us = h.time_graph(lambda _: S.ours(x, f"sweep-{name}", out=outb), [None])
                row.update(us=round(us, 2), tflops=round(flops / us / 1e6, 1),
                           matmul_share=round(flops / us / 1e6 / h.matmul_tflops, 3),
                           vs_upstream=round(up_us / us, 2))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["wall_s"] = round(time.perf_counter() - t0, 1)  # compile + check + timing
            print(json.dumps(row), flush=True)
            out.append(row)
        del x, outb
        torch.cuda.empty_cache()
    print(f"# bf16 matmul {h.matmul_tflops:.0f} TFLOP/s ({h.meta['gpu']})")
    gate = {(r["name"], r["cc"]): r for r in rows_gate}
    for family, cc in ((("sm90", 90),) if sm90_only else (("sm80", 80), ("sm90", 90))):
        fam = [n for n, _, t in _candidates(sm90_only) if n.startswith(family)
               and _timed(rows_gate, n, t)
               and "error" not in gate.get((n, cc), {"error": 1})
               and gate[(n, cc)].get("within_ampere_budget", True)]
        score = {n: sum(r["us"] for r in out if r["name"] == n and "us" in r) for n in fam
                 if all("us" in r for r in out if r["name"] == n)}
        if score:
            best = min(score, key=score.get)
            t = dict(CANDIDATES_BY_NAME[best].__dict__)
            print(f"# best {family} family tile (sum of times over the shapes): {best}: "
                  f"Tile({', '.join(f'{k}={v}' for k, v in t.items())})")
    return out


CANDIDATES_BY_NAME = {n: t for n, t, _ in CANDIDATES}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gate-only", action="store_true", help="compile-gate figures only (CPU)")
    ap.add_argument("--sm90-only", action="store_true",
                    help="the sm90 (wgmma) candidates and upstream only, at sm_90")
    ap.add_argument("--out", type=Path, help="write {gate: [...], timings: [...]} here")
    ap.add_argument("--only", help="comma-separated candidate names (default: all)")
    a = ap.parse_args(argv)
    global ONLY
    if a.only:
        ONLY = set(a.only.split(","))
        unknown = ONLY - set(CANDIDATES_BY_NAME)
        if unknown:
            ap.error(f"--only: unknown {', '.join(sorted(unknown))}")
    t0 = time.perf_counter()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("needs real Triton compilation: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    gate = gate_all(a.sm90_only)
    _print_gate(gate)
    timings = [] if a.gate_only else time_all(gate, a.sm90_only)
    print(f"# wall {time.perf_counter() - t0:.0f} s")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": META, "gate": gate, "timings": timings},
                                    indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
