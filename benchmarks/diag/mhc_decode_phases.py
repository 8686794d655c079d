"""Where the one-launch mHC decode kernel's time goes (vllm.deepinfer.mhc.decode_fused): each
CTA's phase stamps (%globaltimer, the kernel's TRACE build), per launch relative to the first
CTA's entry, medians over launches; beside it the untraced kernel's GPU time per call in a
CUDA graph with the Sinkhorn loop at its 20 iterations and at 1 (what the loop costs).

    python benchmarks/diag/mhc_decode_phases.py --out benchmarks/results/<gpu>-<date>-mhc-decode-phases-<commit>.json
    python benchmarks/diag/mhc_decode_phases.py --dry-run      # any machine: the cases only
    python benchmarks/diag/mhc_decode_phases.py --picks scratch # one way of reading the record

``--picks`` (default ``scratch,sum``): each case with decode_fused.SCRATCH_PICKS on
(``scratch``: the summed record stored once and its scalars loaded) and off (``sum``: one
cross-thread reduction per scalar), the two ways the coefficient CTA can read its record.

Needs a CUDA GPU with torch and Triton; not vLLM (the kernel module imports with torch and
Triton alone). Rows (one per form, hidden size, token count and picks):
``{form, hidden, tokens, picks, grid, launches, stamp_ns: {...}, graph_us, graph_us_sinkhorn1}``
where ``stamp_ns`` holds, as medians over launches (ns after the first CTA's entry):
``all_started`` (the last CTA's entry), ``slices_released`` (the last slice CTA's release),
``waiters_passed`` (the last waiter past its wait), ``coef_records`` / ``coef_sinkhorn`` /
``coef_end`` (the last coefficient CTA after its records' sum, after the Sinkhorn loop, at its
end), ``norm_end`` (the last norm CTA's end), ``end`` (the last stamp of the launch), and
``slice_span`` (the median slice CTA's entry-to-release time). %globaltimer's resolution is
the GPU's (1 us on some parts, finer under a profiler): medians over many launches, each
launch's CTAs stamped on one clock. Traced launches run one at a time (a synchronize between
them), so their totals include no overlap with a neighbour; ``graph_us`` is the dispatched
kernel's time back to back.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import diag_meta  # noqa: E402 (this folder: the script's own)

REPO = diag_meta.REPO
sys.path.insert(0, str(REPO / "overlay"))

FORMS = ("v41", "v4")
HIDDEN = (4096, 7168)
TOKENS = (1, 12)          # the T = 12 goal and the smallest batch; one token class
EPS = (1e-6, 1e-6, 1e-6, 2.0)   # rms_eps, hc_pre_eps, hc_sinkhorn_eps, post mult
LAUNCHES = 200
GRAPH_CALLS = 50


PICKS = ("scratch", "sum")


def cases(picks=PICKS):
    return [(f, h, t, p) for f in FORMS for h in HIDDEN for t in TOKENS for p in picks]


def _inputs(t, hidden, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    n = 24
    d = dict(x=torch.randn(t, hidden, generator=g).to(torch.bfloat16),
             res=torch.randn(t, 4, hidden, generator=g).to(torch.bfloat16),
             post=2 * torch.rand(t, 4, 1, generator=g),
             comb=torch.softmax(torch.randn(t, 4, 4, generator=g), -1).contiguous(),
             pre=torch.rand(t, 4, generator=g) + 0.1,
             fn=torch.randn(n, 4 * hidden, generator=g) * (4 * hidden) ** -0.5,
             scale=torch.tensor([0.8, 1.2, 1.5]), base=torch.randn(n, generator=g) * 0.1,
             w=(1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16))
    return {k: v.cuda() for k, v in d.items()}


def _call(df, d, form, iters):
    a = (d["x"], d["res"], d["post"], d["comb"], d["fn"], d["scale"], d["base"], *EPS, iters)
    if form == "v41":
        out = df.delayed(*a, pre_mix=d["pre"], norm_weight=d["w"])
    else:
        out = df.fused(*a, norm_weight=d["w"])
    if out is None:
        raise RuntimeError(f"the decode kernel declined {form} T={d['x'].shape[0]}")
    return out


def _graph_us(df, d, form, iters):
    import torch
    _call(df, d, form, iters)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            _call(df, d, form, iters)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / GRAPH_CALLS)
    return round(sorted(times)[len(times) // 2], 3)


def _median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else None


def _phases(df, d, form, key, tokens):
    """Median stamps of LAUNCHES traced launches, one at a time."""
    import torch
    ws, _ = df._workspace(d["x"].device)
    grid = key.grid(tokens)
    base = df._TRACE_BASE.value
    S, NG = key.slices, key.norm_ctas
    per = {k: [] for k in ("all_started", "slices_released", "waiters_passed", "coef_records",
                           "coef_sinkhorn", "coef_end", "norm_end", "end", "slice_span")}
    df.TRACE_PHASES = True
    try:
        for _ in range(LAUNCHES):
            ws.view(torch.int64)[base:base + grid * 8].zero_()
            _call(df, d, form, 20)
            torch.cuda.synchronize()
            tr = ws.view(torch.int64)[base:base + grid * 8].view(grid, 8).cpu()
            ticket, entry = tr[:, 0], tr[:, 1]
            t0 = int(entry.min())
            rel = (tr - t0).tolist()
            slices = [r for r, tk in zip(rel, ticket.tolist()) if tk < S]
            norms = [r for r, tk in zip(rel, ticket.tolist()) if S <= tk < S + NG * tokens]
            coefs = [r for r, tk in zip(rel, ticket.tolist()) if tk >= S + NG * tokens]
            per["all_started"].append(max(r[1] for r in rel))
            per["slices_released"].append(max(r[3] for r in slices))
            per["slice_span"].append(_median([r[3] - r[1] for r in slices]))
            per["waiters_passed"].append(max(r[3] for r in norms + coefs))
            per["coef_records"].append(max(r[4] for r in coefs))
            per["coef_sinkhorn"].append(max(r[5] for r in coefs))
            per["coef_end"].append(max(r[6] for r in coefs))
            per["norm_end"].append(max(r[6] for r in norms))
            per["end"].append(max(max(r[3] for r in slices), max(r[6] for r in norms + coefs)))
    finally:
        df.TRACE_PHASES = False
    return {k: _median(v) for k, v in per.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="results JSON")
    ap.add_argument("--dry-run", action="store_true", help="print the cases and exit")
    ap.add_argument("--picks", default=",".join(PICKS),
                    help="scratch and/or sum (decode_fused.SCRATCH_PICKS on / off)")
    args = ap.parse_args(argv)
    picks = [p for p in args.picks.split(",") if p]
    if not picks or set(picks) - set(PICKS):
        ap.error(f"--picks {args.picks!r}: expected a comma list of {', '.join(PICKS)}")
    if args.dry_run:
        print(json.dumps([dict(form=f, hidden=h, tokens=t, picks=p)
                          for f, h, t, p in cases(picks)]))
        return 0
    os.environ.setdefault("DEEPINFER_ARCH", "sm80")   # the Ampere build, run on this GPU
    os.environ["DEEPINFER_MHC_DECODE"] = "1"
    import torch
    import triton
    from vllm.deepinfer.mhc import decode_fused as df
    rows = []
    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                triton=triton.__version__, commit=diag_meta.commit(),
                python=platform.python_version(),
                date=datetime.date.today().isoformat(),
                deepinfer_arch=os.environ.get("DEEPINFER_ARCH"),
                note="phase stamps of the mHC decode kernel's TRACE build (%globaltimer); "
                     "H200 figures of the Ampere build, not A100 figures")
    for form, hidden, tokens, pick in cases(picks):
        df.SCRATCH_PICKS = pick == "scratch"
        d = _inputs(tokens, hidden, seed=tokens * 7 + hidden)
        key = df.key_for(tokens, hidden, torch.cuda.get_device_properties(0).multi_processor_count,
                         sinkhorn=20, delayed=form == "v41")
        row = dict(form=form, hidden=hidden, tokens=tokens, picks=pick, grid=key.grid(tokens),
                   slices=key.slices, launches=LAUNCHES,
                   graph_us=_graph_us(df, d, form, 20),
                   graph_us_sinkhorn1=_graph_us(df, d, form, 1),
                   stamp_ns=_phases(df, d, form, key, tokens))
        rows.append(row)
        s = row["stamp_ns"]
        print(f"{form:4} h={hidden} T={tokens:2} {pick:7}  graph {row['graph_us']:6.2f} us "
              f"(sinkhorn 1: {row['graph_us_sinkhorn1']:6.2f})  started {s['all_started']}  "
              f"slice span {s['slice_span']}  released {s['slices_released']}  "
              f"passed {s['waiters_passed']}  records {s['coef_records']}  "
              f"sinkhorn {s['coef_sinkhorn']}  coef end {s['coef_end']}  "
              f"norm end {s['norm_end']}  end {s['end']} ns", flush=True)
        if args.out:   # after every case: a run stopped early keeps what it measured
            Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
