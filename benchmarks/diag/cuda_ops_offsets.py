"""Value checks of the two upstream CUDA C++ ops of the path whose row offsets are 32-bit
(docs/long-context.md, "CUDA C++ ops"). A wrapped offset of these kernels lands inside the
same allocation (a lower row), so compute-sanitizer's memcheck reports nothing: the checks
compare values with torch instead.

Usage (a CUDA GPU with vLLM 0.33.0 installed; the overlay is not needed):

    python benchmarks/diag/cuda_ops_offsets.py --out benchmarks/results/<gpu>-<date>-cuda-ops-offsets-<commit>.json
    python benchmarks/diag/cuda_ops_offsets.py --dry-run     # any machine: the plan only

Checks (one row each: {check, shape, branch, ok, bad_rows, wrapped_rows, detail, seconds}):

* ``topk_filtered``: ``torch.ops._C.persistent_topk`` (k 512) over fp32 logits
  [4,100, 1,048,576] (a V4.1 ratio-1 index layer's decode logits at max_model_len 1,048,576),
  every row 4,096 keys long, max_seq_len 4,096. More than 64 rows in a batch shorter than
  98,304 tokens take ``FilteredTopKUnifiedKernel`` on a device with >= 128 KiB of opt-in
  shared memory (csrc/topk.cu:41-61); its row offset ``bid * max_len`` is uint32
  (csrc/persistent_topk.cuh:1083). Read in the source: rows 4,096 and up come back with the
  selection of row r - 4,096 (``wrapped_rows``), so ``ok`` false on vLLM 0.33.0.
* ``topk_sampled``: the same buffer, rows 98,304 keys long, max_seq_len 98,304: the
  ``sampled_topk_kernel`` branch (int64 row offset, csrc/sampled_topk.cuh:153); the control.
* ``topk_chunked``: the ``topk_filtered`` call made in row chunks whose largest local offset
  stays below 2^32 (logits / lengths / output views): the fix the doc proposes.
* ``rms_norm``: ``torch.ops._C.rms_norm`` on bf16 [1,048,577, 4096] (one token more than a
  1,048,576-token step at hidden 4096): ``out + blockIdx.x * hidden_size`` is uint32
  (csrc/layernorm_kernels.cu:77), so row 1,048,576 writes row 0 and the last row is never
  written (the output starts as NaN). Rows 0, 1,048,575 and 1,048,576 are compared with an
  fp32 torch reference (bf16 tolerance 0.05).

Time and memory (estimated, not measured): under two minutes including vLLM's import; about
17 GiB of GPU memory at once (the logits buffer is 16.0 GiB, torch.empty, only the first
4,096 or 98,304 columns of each row written; the rms_norm input and output 8 GiB each, after
the logits are freed). Exit status 0 when every check ran (``ok`` false is a finding, not an
error), 1 when a check raised.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import traceback

import diag_meta

TOPK = 512
WIDTH = 1 << 20            # max_model_len // ratio of a V4.1 ratio-1 index layer at 1M
ROWS = 4100                # decode rows: past the first wrapped row (4,096 at this width)
SHORT = 4096               # keys per row: a batch shorter than the sampled branch's 98,304
LONG = 98304               # vllm::sampled_topk::kMinSampledLength<512>
HIDDEN = 4096
NORM_ROWS = (1 << 32) // HIDDEN + 1   # 1,048,577: one row past 2^32 / hidden
U32 = 1 << 32


def first_wrapped_row(width: int) -> int:
    """The first row r whose uint32 offset r * width reaches 2^32."""
    return -(-U32 // width)


def chunk_rows(width: int) -> int:
    """Rows per launch so that the largest local offset (rows - 1) * width stays < 2^32."""
    return (U32 - 1) // width + 1


def plan() -> list[dict]:
    return [
        {"check": "topk_filtered", "shape": [ROWS, WIDTH], "row_len": SHORT, "max_seq_len": SHORT,
         "first_wrapped_row": first_wrapped_row(WIDTH)},
        {"check": "topk_sampled", "shape": [ROWS, WIDTH], "row_len": LONG, "max_seq_len": LONG},
        {"check": "topk_chunked", "shape": [ROWS, WIDTH], "row_len": SHORT, "max_seq_len": SHORT,
         "chunk_rows": chunk_rows(WIDTH)},
        {"check": "rms_norm", "shape": [NORM_ROWS, HIDDEN], "first_wrapped_row": NORM_ROWS - 1},
    ]


def topk_branch(rows: int, max_seq_len: int, optin: int) -> str:
    """Which kernel persistent_topk (k 512) launches (csrc/topk.cu:41-61)."""
    if rows > 64 and max_seq_len >= LONG and optin >= 144 * 1024:
        return "sampled_topk_kernel"
    if rows > 32 and optin >= 128 * 1024:
        return "FilteredTopKUnifiedKernel"
    return "persistent_topk_kernel"


def _distinct_rows(torch, rows: int, n: int, device):
    """[rows, n] fp32 with distinct values in each row (a random permutation of 0..n-1), so the
    top-k is unique and a selection can be compared as a set."""
    return torch.rand(rows, n, device=device).argsort(dim=1).to(torch.float32)


def _compare(torch, got, ref, first_wrap: int | None) -> tuple[list[int], list[int]]:
    g = got.to(torch.int64).sort(dim=1).values
    r = ref.sort(dim=1).values
    bad = (g != r).any(dim=1).nonzero().flatten().tolist()
    wrapped = []
    if first_wrap is not None:
        for row in bad:
            if row >= first_wrap and torch.equal(g[row], r[row - first_wrap]):
                wrapped.append(row)
    return bad, wrapped


def run_topk(torch, logits, n: int, max_seq_len: int, chunk: int | None, optin: int) -> dict:
    rows = logits.shape[0]
    vals = _distinct_rows(torch, rows, n, logits.device)
    logits[:, :n].copy_(vals)
    ref = vals.topk(TOPK, dim=1).indices
    del vals
    lengths = torch.full((rows,), n, dtype=torch.int32, device=logits.device)
    out = torch.full((rows, TOPK), -2, dtype=torch.int32, device=logits.device)
    ws = torch.zeros(1 << 20, dtype=torch.uint8, device=logits.device)
    step = chunk or rows
    branches = []
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        branches.append(topk_branch(r1 - r0, max_seq_len, optin))
        torch.ops._C.persistent_topk(logits[r0:r1], lengths[r0:r1], out[r0:r1], ws, TOPK,
                                     max_seq_len)
    torch.cuda.synchronize()
    first_wrap = None if chunk else first_wrapped_row(logits.stride(0))
    bad, wrapped = _compare(torch, out, ref, first_wrap)
    return {"branch": sorted(set(branches)), "ok": not bad, "bad_rows": bad[:16],
            "n_bad_rows": len(bad), "wrapped_rows": wrapped[:16], "n_wrapped_rows": len(wrapped)}


def run_rms_norm(torch, rows: int = NORM_ROWS, hidden: int = HIDDEN, dev: str = "cuda") -> dict:
    x = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=dev)
    probe = [0, rows - 2, rows - 1]
    x[probe] = torch.randn(len(probe), hidden, device=dev).to(torch.bfloat16)
    w = torch.ones(hidden, dtype=torch.bfloat16, device=dev)
    out = torch.full_like(x, float("nan"))
    torch.ops._C.rms_norm(out, x, w, 1e-6)
    torch.cuda.synchronize()
    xf = x[probe].float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(dim=1, keepdim=True) + 1e-6)).to(torch.bfloat16).float()
    detail, bad = {}, []
    for i, row in enumerate(probe):
        o = out[row].float()
        written = bool(torch.isfinite(o).all())
        err = float((o - ref[i]).abs().max()) if written else None
        detail[str(row)] = {"written": written, "max_abs_err": err}
        if not written or err > 0.05:
            bad.append(row)
    # Row 0 overwritten by the last row's result (the two blocks race for it).
    o0 = out[0].float()
    detail["row0_holds_last_row"] = bool(torch.isfinite(o0).all()
                                         and float((o0 - ref[2]).abs().max()) <= 0.05)
    return {"branch": ["rms_norm_kernel<bf16, 8, 2, true>"], "ok": not bad, "bad_rows": bad,
            "n_bad_rows": len(bad), "wrapped_rows": [], "n_wrapped_rows": 0, "detail": detail}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="results JSON")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--only", choices=[p["check"] for p in plan()], action="append")
    args = ap.parse_args(argv)
    todo = [p for p in plan() if not args.only or p["check"] in args.only]
    if args.dry_run:
        print(json.dumps(todo, indent=1))
        return 0

    import torch
    try:
        import vllm._C  # noqa: F401  (registers torch.ops._C)
    except ImportError:
        import vllm._custom_ops  # noqa: F401
    import vllm

    props = torch.cuda.get_device_properties(0)
    optin = int(getattr(props, "shared_memory_per_block_optin", 0))
    rows_out, failed = [], False
    logits = None
    for p in todo:
        t0 = time.perf_counter()
        row = dict(p)
        try:
            if p["check"].startswith("topk"):
                if logits is None:
                    logits = torch.empty(ROWS, WIDTH, dtype=torch.float32, device="cuda")
                row.update(run_topk(torch, logits, p["row_len"], p["max_seq_len"],
                                    p.get("chunk_rows"), optin))
            else:
                logits = None
                torch.cuda.empty_cache()
                row.update(run_rms_norm(torch))
            row["error"] = None
        except Exception as exc:  # noqa: BLE001 - one row per check, the rest still run
            failed = True
            row.update({"ok": None, "error": f"{type(exc).__name__}: {exc}"})
            traceback.print_exc()
        row["seconds"] = round(time.perf_counter() - t0, 3)
        rows_out.append(row)
        print(json.dumps({k: row.get(k) for k in ("check", "branch", "ok", "n_bad_rows",
                                                  "n_wrapped_rows", "error", "seconds")}),
              flush=True)

    meta = {"gpu": torch.cuda.get_device_name(0), "shared_memory_per_block_optin": optin,
            "torch": torch.__version__, "triton": diag_meta.version("triton"),
            "commit": diag_meta.commit(),
            "vllm": getattr(vllm, "__version__", None),
            "python": platform.python_version(),
            "date": datetime.date.today().isoformat(),
            "note": "value checks of upstream CUDA C++ ops (docs/long-context.md, CUDA C++ ops)"}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "rows": rows_out}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
