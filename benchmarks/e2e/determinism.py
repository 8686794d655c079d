"""Does one vLLM engine repeat itself? The diagnostics behind docs/e2e.md's section on the
engine's run-to-run variation (why reuse on and off cannot be compared bit for bit there).

    python benchmarks/e2e/determinism.py --work DIR                # GPU: run the cases
    python benchmarks/e2e/determinism.py --summarize DIR --out F   # rows from their outputs

Each case is one benchmarks/e2e/run.py process that generates the same prompts several
times (``--repeat``) and, where named, once more with cross-layer reuse off
(``--toggle-yoco``); a case also varies one condition: the KV caches zeroed before each
generation (``--zero-kv``: a kernel reading memory no request wrote would then repeat),
vLLM's auxiliary CUDA streams off (``--one-stream``), torch's nondeterministic-op warnings
on (``--torch-det``). The checkpoints are the e2e step's (``e2e.py --steps ckpt`` in the
same work folder). Rows kernel="e2e_determinism": per later generation, whether it equals
the first bit for bit, and how far apart they are (compare.pair).
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import compare  # noqa: E402

MODELS = ("v41-mini-mxfp8", "v4-mini-fp8")
# (tag, mode, run.py arguments). The agreement prompts (run.py's AGREE_LENS) or a single
# 300-token prompt: one request, one prefill chunk, nothing else in the batch.
CASES = (
    ("upstream", "upstream", ["--repeat", "2"]),
    ("a100det-300", "a100_det", ["--repeat", "3", "--lens", "300"]),
    ("a100det-300-zero", "a100_det", ["--repeat", "3", "--lens", "300", "--zero-kv"]),
    ("a100det-zero", "a100_det", ["--repeat", "2", "--toggle-yoco", "--zero-kv"]),
    ("a100det-300-1s", "a100_det", ["--repeat", "3", "--lens", "300", "--one-stream"]),
    ("a100det-1s", "a100_det", ["--repeat", "2", "--toggle-yoco", "--one-stream"]),
    ("td", "a100_det", ["--repeat", "2", "--lens", "300", "--torch-det", "--one-stream"]),
)
ENGINE_ARGS = ["--task", "agree", "--eager", "--kv-cache-gib", "4", "--gpu-mem", "0.22"]


def _cmp(first: dict, prompts: list) -> dict:
    p = compare.pair(first, dict(first, prompts=prompts))
    keep = ("top1_agree", "max_abs_dlogprob", "mean_abs_dlogprob", "generated_max_abs_dlogprob",
            "first_divergence", "first_prompt_difference")
    return dict(identical=compare.identical(p), **{k: p[k] for k in keep})


def rows_from(work: Path) -> list[dict]:
    rows = []
    for model in MODELS:
        for tag, mode, extra in CASES:
            f = work / f"{model}-{tag}.json"
            if not f.exists():
                continue
            r = json.load(open(f))
            cmps = [dict(generation=i, reuse=True, **_cmp(r, rep))
                    for i, rep in enumerate(r.get("repeats", []), start=2)]
            if r.get("noyoco_in_process"):
                cmps.append(dict(generation=len(cmps) + 2, reuse=False,
                                 **_cmp(r, r["noyoco_in_process"])))
            row = dict(kernel="e2e_determinism", variant=tag,
                       shape=dict(model=model.rsplit("-", 1)[0], mode=mode,
                                  prompt_lens=[p["prompt_len"] for p in r["prompts"]],
                                  args=extra),
                       gpu=r.get("gpu"), torch=r.get("torch"), triton=r.get("triton"),
                       identical=all(c["identical"] for c in cmps) if cmps else None,
                       against_first=cmps)
            if "--torch-det" in extra:
                log = f.with_suffix(".log")
                text = log.read_text(errors="replace") if log.exists() else ""
                row["torch_nondeterministic_op_warnings"] = (
                    text.count("does not have a deterministic implementation")
                    if log.exists() else None)
            rows.append(row)
    return rows


def run_cases(work: Path, parallel: int) -> None:
    procs = []
    for model in MODELS:
        for tag, mode, extra in CASES:
            out = work / f"{model}-{tag}.json"
            if out.exists():
                continue
            cmd = [sys.executable, "-W", "always", str(HERE / "run.py"), "--model",
                   str(work / model), "--mode", mode, *ENGINE_ARGS, *extra, "--out", str(out)]
            procs.append(subprocess.Popen(cmd, stdout=open(out.with_suffix(".log"), "w"),
                                          stderr=subprocess.STDOUT))
            if len(procs) >= parallel:
                procs.pop(0).wait()
    for p in procs:
        p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, help="e2e work folder with the checkpoints (GPU)")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--summarize", type=Path, help="write rows from this folder's outputs")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--meta", default="{}", help="JSON merged into the results' meta")
    a = ap.parse_args(argv)
    if a.work is None and a.summarize is None:
        ap.error("give --work (run the cases) or --summarize")
    if a.work is not None:
        run_cases(a.work, a.parallel)
    folder = a.summarize or a.work
    rows = rows_from(folder)
    if not rows:
        print(f"no case outputs in {folder}", file=sys.stderr)
        return 1
    meta = dict(date=datetime.date.today().isoformat(),
                gpu=rows[0]["gpu"], torch=rows[0]["torch"], triton=rows[0]["triton"],
                note="H200 figures: whether one engine repeats itself, not a speed")
    meta.update(json.loads(a.meta))
    for r in rows:
        print(f"{r['shape']['model']:9s} {r['variant']:18s} identical={r['identical']}  "
              + "  ".join(f"g{c['generation']}{'' if c['reuse'] else '(off)'} "
                          f"top1 {c['top1_agree']:.4f} max {c['max_abs_dlogprob']:.3f}"
                          for c in r["against_first"]))
    if a.out:
        json.dump(dict(meta=meta, rows=rows), open(a.out, "w"), indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
