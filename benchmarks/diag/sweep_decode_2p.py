"""Diagnostic sweep of the two-phase Ampere sparse MLA decode (TILES["sm80-2p"]): phase-2
tiles (heads x keys x warps x stages) and phase-1 settings (keys per tile, warps, programs
per SM, e4m3 decoder), timed as the sparse_mla_decode suite times a launch (CUDA graph per
input copy, replays over a ring larger than twice the L2), 64 heads, top-k 512 + window 128,
tokens 16 / 64 / 128 (benchmarks/suites/sparse_mla_decode.py builds the inputs and the
fp32 reference).

Nothing in the kernel changes: a candidate is a TILES row of its own (named "sm80-2p/..."),
and phase 1's settings are the module constants PREDEQUANT_BLOCK_N / PREDEQUANT_WARPS /
PREDEQUANT_PROGRAMS_PER_SM, which the launcher reads at every call; they are set for the
candidate and restored after it.

Per (candidate, tokens) the GPU run reports ``total`` (both phases, the suite's launch),
and ``phase1`` (the dequantizing kernel alone) and/or ``phase2`` (the attention kernel,
plus the reduce when split) from the launches the launcher makes, recorded once and
replayed one phase at a time (each its own CUDA graph per ring copy). Phase-2 candidates
time total and phase 2, phase-1 candidates total and phase 1, the default row all three.

Before timing, every candidate is compiled for sm_80 (GPUTarget("cuda", 80, 32), with the
launch's specialization, tools/a100_model.py) and dropped if a kernel needs more than
48 KiB of shared memory (``--smem-limit`` to time larger ones on the H200 anyway); the
same build gives the A100 model's predictions (A100-40GB,
and its H200 prediction), written beside the measurements. Both run in worker processes;
then the fitting candidates are compiled for the GPU in parallel (each worker launches
them once), so the timed loop finds them in Triton's cache.

  python benchmarks/diag/sweep_decode_2p.py --out benchmarks/results/h200-DATE-decode-2p-sweep.json
  python benchmarks/diag/sweep_decode_2p.py --model-only --out FILE   # CPU: sm_80 + model
  python benchmarks/diag/sweep_decode_2p.py --sm80-from FILE --out ...  # GPU, no sm_80 builds
  TRITON_INTERPRET=1 python benchmarks/diag/sweep_decode_2p.py --check  # CPU numerics

One JSON line per measurement on stdout, a table at the end; ``--out`` writes
{"meta", "sm80", "rows"}.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO / "tools", REPO / "build", REPO / "overlay", REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

HEADS = 64
TOKENS = (16, 64, 128)
SMEM_LIMIT = 48 * 1024   # sm_80/sm_86 without opt-in: the Ampere variants' budget
MODEL_CACHE = Path(os.environ.get("SWEEP_MODEL_CACHE", "/tmp/deepinfer-sweep-2p-model"))


@dataclasses.dataclass(frozen=True)
class Cand:
    # Phase 2 (the attention kernel with PREDEQUANT on).
    block_h: int = 16
    block_n: int = 16
    warps: int = 4
    stages: int = 2
    # Phase 1 (_predequant_kernel).
    p1_block_n: int = 16
    p1_warps: int = 4
    p1_per_sm: int = 4
    p1_decode: str = "e4b15"
    kind: str = "default"   # "default", "phase2" or "phase1": which phases get timed alone
    # Phase 2's CTAs per SM as the split-K heuristic counts them (choose_num_splits): more
    # slots split the keys of a 64-token batch (256 head-tile CTAs on an H200 at 2 per SM:
    # no split, about 4 warps resident per SM with the 2-warp tile). None: the row's own.
    ctas: int | None = None
    # Phase 2's Q.K^T as two half-dim dots (Tile.qk_halves: two independent mma chains).
    # None: the row's own.
    halves: bool | None = None

    @property
    def name(self) -> str:
        return (f"sm80-2p/h{self.block_h}n{self.block_n}w{self.warps}s{self.stages}"
                + (f"c{self.ctas}" if self.ctas is not None else "")
                + ("" if self.halves is None else ("q2" if self.halves else "q1"))
                + f"/p1n{self.p1_block_n}w{self.p1_warps}x{self.p1_per_sm}{self.p1_decode}")

    def tile(self):
        from vllm.deepinfer.kernels import sparse_mla_decode as smd
        base = smd.TILES["sm80-2p"]
        return dataclasses.replace(base, block_h=self.block_h, block_n=self.block_n,
                                   num_warps=self.warps, num_stages=self.stages,
                                   predequant_decode=self.p1_decode,
                                   ctas_per_sm=base.ctas_per_sm if self.ctas is None
                                   else self.ctas,
                                   qk_halves=base.qk_halves if self.halves is None
                                   else self.halves)

    def phases(self) -> tuple[str, ...]:
        return {"default": ("phase1", "phase2"), "phase2": ("phase2",),
                "phase1": ("phase1",)}[self.kind]


def candidates(wide: bool = False) -> list[Cand]:
    """The default (today's sm80-2p row and phase-1 constants) first; phase-2 tiles with
    today's phase 1; phase-1 settings with today's phase 2; the 2-warp phase 2 (the model's
    pick) with the phase-1 settings the model ranks next. ``wide``: also 64 heads per
    program (only a raised --smem-limit keeps them: not built otherwise)."""
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    t = smd.TILES["sm80-2p"]
    d = Cand(t.block_h, t.block_n, t.num_warps, t.num_stages, smd.PREDEQUANT_BLOCK_N,
             smd.PREDEQUANT_WARPS, smd.PREDEQUANT_PROGRAMS_PER_SM, t.predequant_decode)
    out = [d]
    # 64 heads per program (Q [64, 512] bf16 alone is 64 KiB): only with a raised
    # --smem-limit (what a larger sm_80 budget would buy; the A100 allows 163 KiB per block).
    for h in (16, 32, 64) if wide else (16, 32):
        for n in (16, 32):
            for w in (2, 4, 8):
                for s in (1, 2, 3):
                    c = dataclasses.replace(d, block_h=h, block_n=n, warps=w, stages=s,
                                            kind="phase2")
                    if c.name != d.name:
                        out.append(c)
    out += [dataclasses.replace(d, p1_block_n=32, kind="phase1")]
    out += [dataclasses.replace(d, p1_warps=w, kind="phase1") for w in (2, 8)]
    out += [dataclasses.replace(d, p1_per_sm=k, kind="phase1") for k in (2, 8, 16)]
    out += [dataclasses.replace(d, p1_decode=x, kind="phase1")
            for x in ("int", "f16bits", "e4b15") if x != d.p1_decode]
    # More split-K slots for the shipped phase 2 (the 2-warp tile fits 4 CTAs per SM on an
    # A100 and the H200 by registers and shared memory, 2 on sm86), alone and with phase 1's
    # 16 programs per SM, which the 3dcac6f sweep timed fastest after the decoder.
    out += [dataclasses.replace(d, ctas=k, kind="phase2") for k in (3, 4)]
    out += [dataclasses.replace(d, ctas=4, p1_per_sm=16)]
    # Q.K^T in two independent mma chains (Tile.qk_halves), on the shipped phase 2 and on
    # 4 warps, whose single chain the 2-warp tile was chosen over.
    out += [dataclasses.replace(d, warps=w, halves=not t.qk_halves, kind="phase2")
            for w in (2, 4)]
    out += [dataclasses.replace(d, halves=not t.qk_halves, p1_per_sm=16)]
    return out


@contextlib.contextmanager
def applied(c: Cand):
    """The candidate as a TILES row of its own and phase 1's module constants set."""
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    keep = (smd.PREDEQUANT_BLOCK_N, smd.PREDEQUANT_WARPS, smd.PREDEQUANT_PROGRAMS_PER_SM)
    smd.TILES[c.name] = c.tile()
    smd.PREDEQUANT_BLOCK_N, smd.PREDEQUANT_WARPS = c.p1_block_n, c.p1_warps
    smd.PREDEQUANT_PROGRAMS_PER_SM = c.p1_per_sm
    try:
        yield c.name
    finally:
        smd.PREDEQUANT_BLOCK_N, smd.PREDEQUANT_WARPS, smd.PREDEQUANT_PROGRAMS_PER_SM = keep
        del smd.TILES[c.name]


# ----------------------------------------------------------------------------- sm_80 + model
def sm80_figures(c: Cand, tokens_list=TOKENS) -> dict:
    """sm_80 build of the candidate's launches at each token count (shared bytes, registers,
    per kernel) and the A100 model's predictions (us): A100-40GB and H200, per phase."""
    os.environ.pop("TRITON_INTERPRET", None)
    import a100_model as am
    from a100cost import builds as am_builds  # where the model reads CACHE and _spec
    from a100cost import workloads as am_workloads
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    # Never the shared build/ directory; one folder per pool worker (no two processes
    # write one cache file).
    am_builds.CACHE = MODEL_CACHE / f"w{(mp.current_process()._identity or (0,))[0]}"
    real_spec = am_workloads._spec

    def spec(name, **kw):   # phase 1's warps and keys per tile are not in the gate spec
        s = real_spec(name, **kw)
        if name.startswith("sparse_mla_decode.predequant"):
            s = dataclasses.replace(s, num_warps=c.p1_warps,
                                    constexprs={**s.constexprs, "BLOCK_N": c.p1_block_n})
        return s
    res = {"name": c.name, "kernels": {}, "pred": {}}
    keep = smd.TILES["sm80-2p"]
    kp = (smd.PREDEQUANT_BLOCK_N, smd.PREDEQUANT_PROGRAMS_PER_SM)
    am_workloads._spec = spec
    smd.TILES["sm80-2p"] = c.tile()
    smd.PREDEQUANT_BLOCK_N, smd.PREDEQUANT_PROGRAMS_PER_SM = c.p1_block_n, c.p1_per_sm
    try:
        for t in tokens_list:
            pred = {}
            for gpu, key in ((am.A100_40GB, "a100_40gb"), (am.H200, "h200")):
                wl = am.decode_workload(t, HEADS, 512, 128, "sm80-2p", 80, gpu.sms)
                if key == "a100_40gb":
                    for ln in wl.launches:
                        kn = ln.code.name.split(".")[1].split("[")[0]
                        # Local-memory instructions in the SASS: register spills.
                        spill = sum(i.base in ("LDL", "STL") for i in ln.code.insts)
                        res["kernels"][f"{kn}@{t}"] = {"shared": ln.code.shared,
                                                       "regs": ln.code.regs,
                                                       "spill_insts": spill}
                p = am.predict(wl, gpu)
                parts = [pl["sm_us"] + gpu.launch_us for pl in p["launches"]]
                pred[key] = {"us": round(p["us"], 1), "bound": p["bound"],
                             "phase1_us": round(parts[0], 1),
                             "phase2_us": round(sum(parts[1:]), 1)}
            res["pred"][str(t)] = pred
    except Exception as e:  # a build that fails is a finding, not a crash of the sweep
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        am_workloads._spec = real_spec
        smd.TILES["sm80-2p"] = keep
        smd.PREDEQUANT_BLOCK_N, smd.PREDEQUANT_PROGRAMS_PER_SM = kp
    k = res["kernels"]
    res["max_shared"] = max((v["shared"] for v in k.values()), default=None)
    res["fits_48k"] = "error" not in res and res["max_shared"] is not None and \
        res["max_shared"] <= SMEM_LIMIT
    return res


def _sm80_fits(f: dict, limit: int) -> bool:
    return "error" not in f and f.get("max_shared") is not None and f["max_shared"] <= limit


def _pool_map(fn, items, jobs):
    """fn over items in ``jobs`` spawned processes, results as they finish (in order)."""
    if jobs <= 1:
        yield from map(fn, items)
        return
    with mp.get_context("spawn").Pool(jobs) as pool:
        yield from pool.imap(fn, items, chunksize=1)


# ----------------------------------------------------------------------------- GPU
class _Recorder:
    """Stands in for a kernel: records (kernel, grid, args, kwargs) instead of launching."""

    def __init__(self, real, log):
        self.real, self.log = real, log

    def __getitem__(self, grid):
        return lambda *a, **k: self.log.append((self.real, grid, a, k))


def record_launches(x: dict, name: str, out, num_kv_splits=None):
    """The launches sparse_attn_decode makes for ``x`` (their workspaces kept alive)."""
    import suites.sparse_mla_decode as S
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    log: list = []
    names = ("_predequant_kernel", "_sparse_mla_decode_kernel",
             "_sparse_mla_decode_reduce_kernel")
    real = {n: getattr(smd, n) for n in names}
    try:
        for n in names:
            setattr(smd, n, _Recorder(real[n], log))
        S.ours(x, name, out=out, num_kv_splits=num_kv_splits)
    finally:
        for n in names:
            setattr(smd, n, real[n])
    assert log[0][0] is real["_predequant_kernel"], "phase 1 did not run"
    return log[:1], log[1:]


def _replay_launches(launches):
    for kern, grid, a, k in launches:
        kern[grid](*a, **k)


def _warm(job):
    """Worker: run each candidate once at every token count (compiles it into Triton's
    cache for the main process)."""
    import torch
    import suites.sparse_mla_decode as S
    cands, tokens_list = job
    errs = {}
    for t in tokens_list:
        x = S.make_inputs(torch.device("cuda"), t, HEADS, S.TOPK, S.WINDOW)
        for c in cands:
            with applied(c) as name:
                try:
                    S.ours(x, name)
                    torch.cuda.synchronize()
                except Exception as e:
                    errs[f"{c.name}@{t}"] = f"{type(e).__name__}: {str(e)[:200]}"
    return errs


def gpu_sweep(args, cands: list[Cand], sm80: dict) -> tuple[list[dict], dict]:
    import torch
    from harness import Harness, max_abs_diff
    import suites.sparse_mla_decode as S
    t0 = time.time()
    if args.jobs > 1:
        jobs = [(cands[i::args.jobs], args.tokens) for i in range(min(args.jobs, len(cands)))]
        errs = {}
        for e in _pool_map(_warm, jobs, len(jobs)):
            errs.update(e)
        print(json.dumps({"warm_s": round(time.time() - t0, 1), "warm_errors": errs}),
              flush=True)
    h = Harness(quick=True)
    meta = dict(h.meta, heads=HEADS, topk=S.TOPK, window=S.WINDOW)
    print(json.dumps({"meta": meta}), flush=True)
    rows = []

    def emit(r):   # print, and rewrite --out, after every row: a stopped run keeps them
        rows.append(r)
        print(json.dumps(r), flush=True)
        if args.out:
            write_out(args.out, meta, sm80, rows)
    for tokens in args.tokens:
        keys = S.TOPK + S.WINDOW
        flops = 2 * 2 * tokens * HEADS * keys * 512
        inputs = S.ring_inputs(h, tokens, HEADS)
        ref = S.reference(inputs[0])
        outs = [torch.empty_like(xi["q"]) for xi in inputs]
        for c in cands:
            base = {"tokens": tokens, "heads": HEADS, "cand": c.name, "kind": c.kind,
                    "tile": dataclasses.asdict(c)}
            fig = sm80.get(c.name, {})
            base["sm80_max_shared"] = fig.get("max_shared")
            base["sm80_fits_48k"] = fig.get("fits_48k")
            base["pred_a100_40gb_us"] = fig.get("pred", {}).get(str(tokens), {}).get(
                "a100_40gb", {}).get("us")
            with applied(c) as name:
                try:
                    got = S.ours(inputs[0], name)
                    torch.cuda.synchronize()
                    diff = max_abs_diff(got, ref)
                    rec = [record_launches(inputs[i], name, outs[i])
                           for i in range(len(inputs))]
                    splits = rec[0][1][0][1][1]   # the attention grid's (heads, splits, tokens)
                    us = h.time_ring(S._replay, [
                        S._graph(lambda i=i: S.ours(inputs[i], name, out=outs[i]))
                        for i in range(len(inputs))])
                    r = dict(base, what="total", us=round(us, 3),
                             tflops=round(flops / us / 1e6, 1), max_abs_diff=diff,
                             splits=splits)
                    emit(r)
                    # Phase 1 first: its graphs' first (eager) run fills the workspaces
                    # phase 2 reads.
                    for i in range(len(inputs)):
                        _replay_launches(rec[i][0])
                    for what in ("phase1", "phase2"):
                        if what not in c.phases():
                            continue
                        k = 0 if what == "phase1" else 1
                        us = h.time_ring(S._replay, [
                            S._graph(lambda i=i: _replay_launches(rec[i][k]))
                            for i in range(len(inputs))])
                        r = dict(base, what=what, us=round(us, 3),
                                 kernels=len(rec[0][k]), splits=splits)
                        if what == "phase2":
                            r["tflops"] = round(flops / us / 1e6, 1)
                            # The replayed launches must be the launcher's: same output.
                            r["replay_equal"] = bool(torch.equal(outs[0], got))
                        emit(r)
                    del rec
                except Exception as e:
                    r = dict(base, what="total", error=f"{type(e).__name__}: {str(e)[:200]}")
                    emit(r)
        del inputs, outs
        torch.cuda.empty_cache()
    print(json.dumps({"gpu_sweep_s": round(time.time() - t0, 1)}), flush=True)
    return rows, meta


# ----------------------------------------------------------------------------- CPU numerics
def cpu_check(cands: list[Cand]) -> list[dict]:
    """Interpreter (TRITON_INTERPRET=1): each candidate on a small suite-style shape (4
    tokens, 64 heads, top-k 48 + window 24, so tiles straddle the main/extra boundary),
    against the suite's fp32 reference and bit-for-bit against today's sm80-2p row where
    the candidate keeps phase 2's keys per tile (the interpreter's dots do not depend on
    warps, stages or heads per program; phase 1's settings do not change a value)."""
    import torch
    from harness import max_abs_diff
    import suites.sparse_mla_decode as S
    x = S.make_inputs(torch.device("cpu"), 4, HEADS, 48, 24, seed=1)
    ref = S.reference(x)
    base = {}
    rows = []
    for c in cands:
        for splits in (None, 3):
            with applied(c) as name:
                got = S.ours(x, name, num_kv_splits=splits)
                # The GPU run's phase-alone timings replay the recorded launches: phase 1
                # then phase 2 must give the launcher's output.
                rec_out = torch.zeros_like(got)
                p1, p2 = record_launches(dict(x), name, rec_out, num_kv_splits=splits)
                _replay_launches(p1)
                _replay_launches(p2)
            r = {"cand": c.name, "splits": splits, "max_abs_diff": max_abs_diff(got, ref),
                 "replay_equal": bool(torch.equal(rec_out, got))}
            if c.kind == "default":
                base[splits] = got
            # Two half-dim score dots sum in another order: compared to the reference only.
            if c.block_n == cands[0].block_n and c.halves in (None, cands[0].halves):
                r["bit_equal_default"] = bool(torch.equal(got, base[splits]))
            r["ok"] = (r["max_abs_diff"] < 2e-2 and r["replay_equal"]
                       and r.get("bit_equal_default", True))
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


# ----------------------------------------------------------------------------- report
def table(cands, sm80, rows, limit=SMEM_LIMIT) -> str:
    meas = {(r["cand"], r["tokens"], r["what"]): r for r in rows if "us" in r}
    lines = ["candidate (phase 2 / phase 1)                      smem2 smem1 regs2 regs1 spill2 | "
             "A100 pred 64/128 | H200 meas total us 16/64/128 (p1/p2 at 64) TF@64"]
    for c in cands:
        f = sm80.get(c.name, {})
        k = f.get("kernels", {})
        p2 = k.get("direct@64") or k.get("partial@64") or {}
        p1 = k.get("predequant@64") or {}
        pr = f.get("pred", {})
        a = "/".join(str(pr.get(str(t), {}).get("a100_40gb", {}).get("us", "-"))
                     for t in (64, 128))
        tot = "/".join(str(meas.get((c.name, t, "total"), {}).get("us", "-")) for t in TOKENS)
        ph = "/".join(str(meas.get((c.name, 64, w), {}).get("us", "-"))
                      for w in ("phase1", "phase2"))
        tf = meas.get((c.name, 64, "total"), {}).get("tflops", "-")
        flag = "" if not f or _sm80_fits(f, limit) else f"  DROPPED (sm_80 > {limit} B or no build)"
        lines.append(f"{c.name:50s} {p2.get('shared', '-')!s:>5} {p1.get('shared', '-')!s:>5} "
                     f"{p2.get('regs', '-')!s:>5} {p1.get('regs', '-')!s:>5} "
                     f"{p2.get('spill_insts', '-')!s:>6} | {a:>16} | "
                     f"{tot} ({ph}) {tf}{flag}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write {meta, sm80, rows} JSON here")
    ap.add_argument("--model-only", action="store_true",
                    help="no GPU: sm_80 builds and A100 model predictions only")
    ap.add_argument("--check", action="store_true",
                    help="interpreter numerics of every candidate (TRITON_INTERPRET=1, CPU)")
    ap.add_argument("--skip-sm80", action="store_true",
                    help="time every candidate without the sm_80 build (no drop, no model)")
    ap.add_argument("--sm80-from", help="take the sm_80 figures and predictions from this "
                    "--model-only JSON (same commit) instead of building them here")
    ap.add_argument("--smem-limit", type=int, default=SMEM_LIMIT,
                    help="drop candidates whose sm_80 build needs more shared memory than this "
                    "(bytes; default 48 KiB, the Ampere variants' budget)")
    ap.add_argument("--sm80-jobs", type=int, default=os.cpu_count() or 1,
                    help="worker processes for the sm_80 builds")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="worker processes that compile the candidates for the GPU")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--only", help="only candidates whose name contains one of these "
                    "comma-separated strings")
    args = ap.parse_args(argv)
    cands = candidates(wide=args.smem_limit > SMEM_LIMIT)
    if args.only:
        cands = [c for c in cands if any(o in c.name for o in args.only.split(","))
                 or c.kind == "default"]
    if args.check:
        rows = cpu_check(cands)
        bad = [r for r in rows if not r["ok"]]
        print(f"{len(rows) - len(bad)}/{len(rows)} ok", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"check": rows}, indent=1) + "\n")
        return 1 if bad else 0
    t0 = time.time()
    sm80 = {}
    if args.sm80_from:   # a --model-only file of this commit: no sm_80 builds here
        sm80 = json.loads(Path(args.sm80_from).read_text())["sm80"]
        missing = [c.name for c in cands if c.name not in sm80]
        if missing:
            raise SystemExit(f"--sm80-from: no sm_80 figures for {missing}")
    elif not args.skip_sm80:
        for f in _pool_map(sm80_figures, cands, args.sm80_jobs):
            sm80[f["name"]] = f
            print(json.dumps({"sm80": f}), flush=True)
    if sm80:
        dropped = [c.name for c in cands if not _sm80_fits(sm80[c.name], args.smem_limit)]
        print(json.dumps({"sm80_s": round(time.time() - t0, 1), "smem_limit": args.smem_limit,
                          "dropped": {n: sm80[n].get("max_shared") or sm80[n].get("error")
                                      for n in dropped}}), flush=True)
    run = [c for c in cands if c.name not in sm80 or _sm80_fits(sm80[c.name], args.smem_limit)]
    rows, meta = ([], model_meta()) if args.model_only else gpu_sweep(args, run, sm80)
    print(table(cands, sm80, rows, args.smem_limit), flush=True)
    if args.out:
        write_out(args.out, meta, sm80, rows)
    return 0


def model_meta() -> dict:
    """--model-only: no GPU ran; the file holds sm_80 builds and model predictions."""
    import a100_model as am
    return {**am._meta(("a100-40gb", "h200")),
            "note": "--model-only: sm_80 builds and tools/a100_model.py "
            "predictions (A100-40GB and H200); no GPU ran, nothing here is a measurement"}


def write_out(path, meta, sm80, rows) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "sm80": sm80, "rows": rows}, indent=1) + "\n")
    tmp.replace(p)


if __name__ == "__main__":
    sys.exit(main())
