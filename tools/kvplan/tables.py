"""GitHub-markdown text tables of plans, layer types, pages and page-size buckets."""
from __future__ import annotations

from typing import Any

from .accounting import layer_type_table, page_buckets, page_table
from .layers import Layer
from .planning import Plan
from .sizes import CONTEXT_1M, GiB, KiB, MiB


# --------------------------------------------------------------------------------------
# Text tables
# --------------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:,.3f} {unit}"
    return f"{n:,.0f} B"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def plan_table(plans: list[Plan]) -> str:
    rows = []
    for p in plans:
        for st in p.stages:
            rows.append([p.label or p.model, st.stage, st.layers, st.tp, f"{st.weights_gib:.1f}",
                         f"{st.reserve_gib:.1f}", f"{st.kv_budget_gib:.2f}",
                         f"{st.kv_bytes_per_token:,.0f}", f"{st.kv_tokens:,}", f"{st.seqs:.2f}",
                         ",".join(map(str, st.replicated_sources)) or "-"])
    return table(["topology", "stage", "layers", "TP", "weights GiB/GPU", "reserve GiB/GPU",
                  "KV budget GiB/GPU", "KV B/token", "KV tokens", "1M seqs", "replica of"], rows)


def summary_table(plans: list[Plan]) -> str:
    rows = [[p.label or p.model, "yes" if p.fits else "no", p.bottleneck().stage,
             f"{p.kv_tokens:,}", f"{p.reported_tokens:,}", f"{p.seqs:.2f}"] for p in plans]
    return table(["topology", "fits", "bottleneck stage", "KV tokens (raw)",
                  "KV tokens (vLLM-reported)", "1M sequences"], rows)


# workspace.py's terms as reserved_table shows them: (StagePlan.reserved key, header).
RESERVED_COLUMNS = (
    ("prefill_gather", "prefill gather"), ("indexer_k_gather", "indexer K gather"),
    ("decode_workspace", "decode scratch"), ("indexer_decode_logits", "decode logits"),
    ("workspace", "workspace (max)"), ("yoco_gather_buffer", "yoco gather"),
    ("yoco_indexer_k", "yoco index K"), ("indexer_logits_transient", "indexer logits"),
    ("combined_lists", "combined lists"))


def reserved_table(plans: list[Plan]) -> str:
    """Each stage's reservations (MiB): the workspace is the largest of the four requests
    before it; the total adds the five after it."""
    rows = []
    for p in plans:
        for st in p.stages:
            r = st.reserved
            total = r.get("workspace", 0) + sum(r.get(k, 0) for k, _ in RESERVED_COLUMNS[5:])
            rows.append([p.label or p.model, st.stage,
                         *(f"{r.get(k, 0) / MiB:,.1f}" for k, _ in RESERVED_COLUMNS),
                         f"{total / MiB:,.1f}"])
    return table(["topology", "stage", *(h for _, h in RESERVED_COLUMNS), "total"], rows)


def layer_type_markdown(layers: list[Layer], n_tokens: int = CONTEXT_1M) -> str:
    rows = [[r.label, r.count, f"{r.bytes_per_token:,.2f}", fmt_bytes(r.seq_bytes),
             fmt_bytes(r.state_bytes) if r.state_bytes else "-", r.reads or "-"]
            for r in layer_type_table(layers, n_tokens)]
    return table(["layer type", "layers", "B/token", f"per sequence at {n_tokens:,}",
                  "compressor state (not published)", "reads"], rows)


def page_markdown(layers: list[Layer]) -> str:
    rows = [[r.cache, r.upstream_spec, r.block_tokens, r.states_per_page, r.record_bytes,
             f"{r.raw_page_bytes:,}", f"{r.page_bytes:,}", r.layers] for r in page_table(layers)]
    return table(["cache", "upstream spec", "block tokens", "states/page", "record B",
                  "raw page B", "page B (padded)", "layers"], rows)


def bucket_markdown(layers: list[Layer]) -> str:
    rows = [[f"{size:,}", ", ".join(names)] for size, names in page_buckets(layers).items()]
    return table(["page B", "cache types"], rows)
