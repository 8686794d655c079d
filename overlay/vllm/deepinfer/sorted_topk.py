"""Sorted indexer top-k rows: a test switch that makes an engine's runs comparable bit for bit.

Upstream's top-k kernels (``persistent_topk``, ``top_k_per_row_prefill``, csrc/) claim each
output slot with ``atomicAdd``, so one set of indices comes back in a different order from
run to run, and every consumer (our decode and prefill, upstream's) sums its keys in that
order. The fp32 sums then differ in their last bits, the next layers' top-k selections flip
where scores nearly tie, and two runs of one engine drift apart (docs/yoco.md: the a100 mode
against itself, 0.943 top-1 agreement in the 4ab26c8 run). With ``DEEPINFER_SORTED_TOPK=1``
the Ampere indexer sorts each row it wrote, ascending with the -1 fill last, so the order no
longer depends on the atomics. Off by default: it costs a sort per index source and forward
and changes nothing a user needs. benchmarks/e2e (``--steps yoco``, run.py's ``*_det``
modes) uses it to hold cross-layer reuse on and off to identity.
"""
from __future__ import annotations

import logging
import os

import torch

VARIABLE = "DEEPINFER_SORTED_TOPK"
logger = logging.getLogger("vllm.deepinfer")


def enabled() -> bool:
    on = os.environ.get(VARIABLE, "0").strip() == "1"
    if on:
        logger.info("deepinfer: %s=1: indexer top-k rows are sorted (test switch: a "
                    "run-to-run identical key order)", VARIABLE)
    return on


def sort_rows_(rows: torch.Tensor) -> torch.Tensor:
    """Sort each row of a 2-D int32/int64 top-k index buffer ascending in place, -1 last."""
    if rows.dim() != 2 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sorted_topk.sort_rows_: rows must be a 2-D int32/int64 index "
                         f"buffer, got shape {tuple(rows.shape)} dtype {rows.dtype}")
    big = torch.iinfo(rows.dtype).max
    s = torch.where(rows < 0, big, rows).sort(dim=-1).values
    rows.copy_(torch.where(s == big, -1, s))
    return rows
