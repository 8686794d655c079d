#!/usr/bin/env python3
"""What a larger shared-memory budget would buy the Ampere prefill tile, by the A100 model.

The sm80/sm86 prefill tile (kernels/sparse_mla_prefill.py) keeps within 48 KiB per CTA, which
fixes it at 16 heads x 16 keys. This builds wider tiles for sm_80 (no GPU: Triton compiles for
an explicit target) and predicts them with tools/a100_model.py at the prefill suite's T = 2048
shape (64K context, top-k 512 + window 128, 64 and 128 heads), beside upstream's ragged kernel:
shared memory, registers, spill bytes, predicted A100-40GB time and the ratio to upstream's.
Predictions only; nothing here ran on a GPU.

    python3 benchmarks/diag/prefill_budget_model.py [--out F.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for p in (REPO / "overlay", REPO / "tools"):
    sys.path.insert(0, str(p))

import a100_model as am  # noqa: E402
from vllm.deepinfer.kernels import sparse_mla_prefill as spm  # noqa: E402

T = spm.Tile
# (name, tile): the shipped tile first; then more heads and keys per CTA.
CANDIDATES = [
    ("sm80", spm.TILES["sm80"]),
    ("h16n32w2s2q2", T(16, 32, 2, 2, qk_halves=True)),
    ("h32n16w2s2q2", T(32, 16, 2, 2, qk_halves=True)),
    ("h32n16w4s2q2", T(32, 16, 4, 2, qk_halves=True)),
    ("h32n32w4s2q2", T(32, 32, 4, 2, qk_halves=True)),
    ("h32n32w4s3q2", T(32, 32, 4, 3, qk_halves=True)),
    ("h64n16w4s2q2", T(64, 16, 4, 2, qk_halves=True)),
    ("h64n16w8s2q2", T(64, 16, 8, 2, qk_halves=True)),
    ("h64n32w8s2q2", T(64, 32, 8, 2, qk_halves=True)),
    ("h32n32w8s3q2", T(32, 32, 8, 3, qk_halves=True)),
    ("h32n32w4s4q2", T(32, 32, 4, 4, qk_halves=True)),
    ("h32n64w4s2q2", T(32, 64, 4, 2, qk_halves=True)),
    ("h32n64w4s3q2", T(32, 64, 4, 3, qk_halves=True)),
    ("h16n32w2s3q2", T(16, 32, 2, 3, qk_halves=True)),
    ("h16n64w2s2q2", T(16, 64, 2, 2, qk_halves=True)),
    ("h64n32w8s3q2", T(64, 32, 8, 3, qk_halves=True)),
]
SHAPES = [dict(tokens=2048, ctx=65536, topk=512, ratio=2, heads=h, keys=640) for h in (64, 128)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the model compiles real kernels")
    rows = []
    for sh in SHAPES:
        nb = am._prefill_bytes(sh)
        up = am.predict(am.upstream_prefill_workload(sh, 80, nb), am.A100_40GB)
        for name, tile in CANDIDATES:
            key = f"sm80-budget-{name}"
            spm.TILES[key] = tile
            try:
                wl = am.prefill_workload(sh, key, 80, nb)
                p = am.predict(wl, am.A100_40GB)
            finally:
                del spm.TILES[key]
            code = wl.launches[0].code
            r = dict(candidate=name, tile=dataclasses.asdict(tile), shape=sh,
                     sm80_shared=code.shared, sm80_regs=code.regs,
                     sm80_spill_instructions=sum(1 for i in code.insts if i.base in ("LDL", "STL")),
                     fits_48k=code.shared <= 48 * 1024,
                     predicted_a100_40gb_us=round(p["us"], 1),
                     upstream_predicted_a100_40gb_us=round(up["us"], 1),
                     predicted_speedup=round(up["us"] / p["us"], 2),
                     a100_40gb_limit_us=round(p["limit_us"], 1), bound=p["bound"])
            rows.append(r)
            print(f"{sh['heads']:4d}h {name:14s} shared {code.shared:7d} regs {code.regs} "
                  f"spill-instr {r['sm80_spill_instructions']:4d}  A100 {r['predicted_a100_40gb_us']:8.1f} us"
                  f"  upstream {r['upstream_predicted_a100_40gb_us']:8.1f}  x{r['predicted_speedup']}",
                  flush=True)
    if args.out:
        meta = dict(am._meta(("a100-40gb",)),
                    note="model predictions only (tools/a100_model.py, A100-40GB); "
                    "sm_80 builds on the CPU machine; no GPU ran")
        args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
