#!/usr/bin/env python3
"""KV-cache capacity and topology planner for 1M-token DeepSeek V3.2 / V4 / V4.1 contexts.

Subcommands (each takes --json for machine-readable output):
  published   reproduce the published V3.2-vs-V4 KV arithmetic
  layers      per-layer-type bytes, page sizes and page-size buckets of a model's stack
  plan        weights per GPU, KV budget, KV tokens and 1M sequences for one TP x PP layout
  compare     the 6 x 64 GiB comparison (TP2 x PP3 14,14,12 / PP6 / TP2 + TP4) and the
              gap to the 4,648,480-token reference
  predict     the KV tokens vLLM reports for a served config.json, given the KV memory it
              logged ("Available KV cache memory: X GiB"): cache groups, pool block, blocks
              per request, e.g. predict --config benchmarks/e2e/configs/v41-tput/config.json
              --kv-gib 101.55 --path ampere (the tree's 64-token pages; --page 128 is
              DEEPINFER_KV_PAGE64=0)
  chart       render docs/img/topology-1m-context.png (needs matplotlib)

Bad input exits with status 2 and a message on stderr naming the field.
The logic lives in the package tools/kvplan/ beside this command (stdlib only: no torch,
no vLLM, no GPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
# The planner library sits beside this command; put its folder on the path also when the
# file is run by path from elsewhere (runpy.run_path does not add it).
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import kvplan as kvp  # noqa: E402

DEFAULT_V41_CONFIG = REPO / "tools" / "configs" / "deepseek-v4.1-illustrative.json"
PROG = "kv_planner"
# predict's defaults: the long-context engine of benchmarks/e2e/run.py --task long (chunked
# prefill of 8,192 tokens; max_model_len 1,048,320 = the 1,048,000-token prompt plus its
# 66-token decode window, rounded up to 256: run.py long_max_model_len).
PREDICT_CHUNK = 8192
PREDICT_MAX_MODEL_LEN = 1_048_320


# --------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------
def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="v4.1",
                   help=f"one of {', '.join(kvp.model_names())} (default v4.1)")
    p.add_argument("--config", help="config.json overriding/supplying the architecture "
                   f"(v4.1 default: {DEFAULT_V41_CONFIG.relative_to(REPO)}, illustrative)")


def _add_cache_args(p: argparse.ArgumentParser, attn: str, indexer: str) -> None:
    p.add_argument("--attn-dtype", default=attn, help=f"{'|'.join(kvp.ATTN_DTYPES)} (default {attn})")
    p.add_argument("--indexer-dtype", default=indexer,
                   help=f"{'|'.join(kvp.INDEXER_DTYPES)} (default {indexer})")


def _add_topology_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, help="GPU count (default: sum of the per-stage TP sizes)")
    p.add_argument("--gpu-mem-gib", type=float, default=64.0, help="memory per GPU in GiB (default 64)")
    p.add_argument("--tp", default="1", help="TP size, or one per stage: '2' or '2,4' (default 1)")
    p.add_argument("--pp", type=int, help="pipeline stages (default: len(--split) or len(--tp))")
    p.add_argument("--split", help="layers per stage, e.g. 14,14,12 (default: even)")
    p.add_argument("--util", type=float, default=kvp.DEFAULT_GPU_MEMORY_UTILIZATION,
                   help="gpu_memory_utilization (default %(default)s, vLLM 0.33.0's default)")
    p.add_argument("--base-reserve-gib", type=float, default=2.0,
                   help="per-GPU activations/graphs/NCCL/context reserve (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=kvp.DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--max-model-len", type=int, default=kvp.CONTEXT_1M)
    p.add_argument("--cross-stage-kv", default="replicate",
                   help="V4.1 readers whose kv source is on another stage: replicate|reject")
    p.add_argument("--engram-on-gpu", action="store_true", help="V4.1 Engram tables resident on GPU")
    p.add_argument("--load-draft", action="store_true", help="load the MTP/DSpark drafter")
    _add_serving_args(p)
    _add_paging_arg(p)


def _add_serving_args(p: argparse.ArgumentParser) -> None:
    """The limits the Ampere path's decode reservations are sized from (workspace.py)."""
    p.add_argument("--max-num-seqs", type=int, default=kvp.DEFAULT_MAX_NUM_SEQS,
                   help="max_num_seqs (default %(default)s, vLLM's on <70 GiB GPUs)")
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="speculative tokens per decode step (default 0)")
    p.add_argument("--max-capture-size", type=int, default=kvp.DEFAULT_MAX_CAPTURE_SIZE,
                   help="largest CUDA-graph capture size, 0 for eager (default %(default)s)")
    p.add_argument("--sm-count", type=int, default=kvp.A100_SM_COUNT,
                   help="SMs per GPU, for the decode's split-K plan (default %(default)s, A100)")
    p.add_argument("--decode-variant", default="sm80",
                   help=f"decode tile rows: {'|'.join(kvp.DECODE_TILES)} (default sm80)")


def _add_paging_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--paging", default="ampere",
                   help=f"serving path's kernel pages: {'|'.join(kvp.PAGINGS)} (default ampere: "
                   "the Ampere path as the tree has it, 64-token compressed-KV and index-K "
                   "pages; ampere-128 is DEEPINFER_KV_PAGE64=0, ampere-64-idx128 a what-if)")


def _add_weight_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-dtype", default="fp4", help="fp4|fp8|bf16 (default fp4)")
    p.add_argument("--dense-dtype", default="fp8", help="fp8|bf16 (default fp8)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("published", help="reproduce the published KV arithmetic")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("layers", help="per-layer-type bytes, pages, buckets")
    _add_model_args(p)
    _add_cache_args(p, "bf16", "bf16")
    p.add_argument("--tokens", type=int, default=kvp.CONTEXT_1M, help="sequence length (default 1M)")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("plan", help="plan one TP x PP layout")
    _add_model_args(p)
    _add_cache_args(p, "fp8", "fp8")
    _add_topology_args(p)
    _add_weight_args(p)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("compare", help="the 6 x 64 GiB comparison")
    _add_model_args(p)
    _add_cache_args(p, "fp8", "fp8")
    _add_weight_args(p)
    p.add_argument("--util", type=float, default=kvp.DEFAULT_GPU_MEMORY_UTILIZATION)
    p.add_argument("--base-reserve-gib", type=float, default=2.0)
    _add_paging_arg(p)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("predict", help="vLLM's reported KV tokens for a served config")
    p.add_argument("--config", required=True, help="the served config.json (V4.1 or V4)")
    p.add_argument("--kv-gib", type=float, required=True,
                   help="the KV memory vLLM logged (\"Available KV cache memory: X GiB\")")
    p.add_argument("--path", default="ampere",
                   help=f"ampere|upstream-sm90 (or one of {', '.join(kvp.PAGINGS)}); default ampere")
    p.add_argument("--page", type=int, help="ampere: the compressed-KV kernel page (default "
                   "64, the tree's; 128 is DEEPINFER_KV_PAGE64=0); upstream-sm90 takes 64")
    p.add_argument("--indexer-page", type=int,
                   help="ampere: the index-K kernel page (default --page: the path asks one "
                   "page for both; --page 64 --indexer-page 128 is the ampere-64-idx128 what-if)")
    p.add_argument("--max-model-len", type=int, default=PREDICT_MAX_MODEL_LEN,
                   help="the engine's max_model_len (default %(default)s, run.py --task long)")
    p.add_argument("--max-num-batched-tokens", type=int, default=PREDICT_CHUNK,
                   help="the engine's chunk (default %(default)s)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (in-flight tokens)")
    p.add_argument("--indexer-dtype", default="fp8", help="fp8|fp4 (default fp8, vLLM's)")
    p.add_argument("--reported", type=int, help="vLLM's reported figure, to compare with")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("chart", help="render the topology chart (needs matplotlib)")
    p.add_argument("--out", default=str(REPO / "docs" / "img" / "topology-1m-context.png"))
    p.add_argument("--config", help="V4.1 config.json (default: the illustrative one)")
    return parser


# --------------------------------------------------------------------------------------
# Input resolution
# --------------------------------------------------------------------------------------
def resolve_model(args: argparse.Namespace):
    config_path = args.config
    if config_path is None and args.model == "v4.1":
        config_path = DEFAULT_V41_CONFIG
    config = kvp.load_config(config_path) if config_path else None
    return kvp.resolve_model(args.model, config), config_path


def cache_format(args: argparse.Namespace):
    return kvp.CacheFormat(args.attn_dtype, args.indexer_dtype)


def weight_dtypes(args: argparse.Namespace):
    return kvp.WeightDtypes(expert=args.expert_dtype, dense=args.dense_dtype)


def topology(args: argparse.Namespace, num_layers: int):
    tp = kvp.parse_int_list(args.tp, "tp")
    split = kvp.parse_int_list(args.split, "split") if args.split else None
    pp = args.pp or (len(split) if split else len(tp))
    if pp <= 0:
        raise kvp.PlannerInputError("pp", f"must be positive, got {pp}")
    if split is None:
        split = kvp.even_split(num_layers, pp)
    if len(split) != pp:
        raise kvp.PlannerInputError("split", f"{len(split)} stages in the split, --pp {pp}")
    if len(tp) == 1:
        tp = tp * pp
    gpus = args.gpus if args.gpus is not None else sum(tp)
    label = f"TP{'/'.join(map(str, sorted(set(tp))))} x PP{pp}"
    return kvp.Topology(gpus=gpus, gpu_mem_gib=args.gpu_mem_gib, tp=tp, split=split, util=args.util,
                        base_reserve_gib=args.base_reserve_gib,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, cross_stage_kv=args.cross_stage_kv,
                        engram_on_gpu=args.engram_on_gpu, load_draft=args.load_draft, label=label,
                        paging=args.paging, max_num_seqs=args.max_num_seqs,
                        num_speculative_tokens=args.num_speculative_tokens,
                        max_capture_size=args.max_capture_size, sm_count=args.sm_count,
                        decode_variant=args.decode_variant)


def config_note(model, config_path) -> list[str]:
    if model.family == "v41" and Path(config_path) == DEFAULT_V41_CONFIG:
        return [f"V4.1 architecture from the ILLUSTRATIVE {DEFAULT_V41_CONFIG.relative_to(REPO)} "
                "(not the released config.json)"]
    return [f"architecture overridden by {config_path}"] if config_path else []


# --------------------------------------------------------------------------------------
# Subcommands
# --------------------------------------------------------------------------------------
def cmd_published(args: argparse.Namespace) -> Any:
    f = kvp.published_figures()
    if args.json:
        return f
    GiB, MiB = kvp.GiB, kvp.MiB

    def both(value: float, unit: int, name: str, digits: int) -> str:
        return f"{value:,.0f} B = {value / unit:.{digits}f} {name}"

    rows = [
        ["V3.2-style, bf16: bytes per token per layer",
         f"{f['v32_bytes_per_token_per_layer']:,.0f} B (1152 + 256)", "1408"],
        ["V3.2-style, bf16: per layer at 1M", both(f["v32_layer_bytes_1m"], GiB, "GiB", 3), "~1.375 GiB"],
        ["V3.2-style, bf16: 61 layers at 1M", both(f["v32_total_bytes_1m"], GiB, "GiB", 1), "~83.9 GiB"],
        ["V4 c4a layer, bf16, 1M", both(f["v4_c4a_layer_bytes_1m"], MiB, "MiB", 1), "~320.1 MiB"],
        ["V4 c128a layer, bf16, 1M", both(f["v4_c128a_layer_bytes_1m"], MiB, "MiB", 1), "~8.1 MiB"],
        ["V4 30 c4a + 31 c128a, bf16, 1M", both(f["v4_total_bytes_1m"], GiB, "GiB", 2), "~9.62 GiB"],
        ["V3.2 / V4", f"{f['v4_reduction_x']:.1f}x ({f['v4_reduction_x']:.4f})", "~8.7x less"],
        ["V4, fp8 attention + fp4 indexer, 1M", both(f["v4_fp8_fp4_total_bytes_1m"], GiB, "GiB", 2),
         "about half"],
        ["fp8+fp4 / bf16", f"{f['v4_fp8_fp4_fraction_of_bf16']:.3f}", "~0.5"],
    ]
    return kvp.table(["figure", "planner", "published"], rows)


def cmd_layers(args: argparse.Namespace) -> Any:
    model, config_path = resolve_model(args)
    fmt = cache_format(args)
    layers = kvp.build_stack(model, fmt)
    if args.json:
        return {
            "model": model.name, "cache_format": fmt.label(), "tokens": args.tokens,
            "notes": config_note(model, config_path),
            "layer_types": [_asdict(r) for r in kvp.layer_type_table(layers, args.tokens)],
            "pages": [_asdict(r) for r in kvp.page_table(layers)],
            "page_buckets": {str(k): v for k, v in kvp.page_buckets(layers).items()},
            "bytes_per_token": kvp.stack_bytes_per_token(layers),
            "sequence_bytes": kvp.stack_bytes(layers, args.tokens),
            "sequence_bytes_with_state": kvp.stack_bytes(layers, args.tokens, published_only=False),
        }
    total = kvp.stack_bytes(layers, args.tokens)
    lines = [f"{model.name}, {fmt.label()}, {args.tokens:,} tokens", *config_note(model, config_path), "",
             kvp.layer_type_markdown(layers, args.tokens), "",
             f"stack: {kvp.stack_bytes_per_token(layers):,.2f} B/token, {kvp.fmt_bytes(total)} per sequence "
             f"(+ {kvp.fmt_bytes(kvp.stack_bytes(layers, args.tokens, False) - total)} compressor state)",
             "", "Pages:", kvp.page_markdown(layers), "", "Page-size buckets:", kvp.bucket_markdown(layers)]
    return "\n".join(lines)


def _asdict(obj) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def cmd_plan(args: argparse.Namespace) -> Any:
    model, config_path = resolve_model(args)
    p = kvp.plan(model, topology(args, model.arch["num_hidden_layers"]), weight_dtypes(args),
                 cache_format(args))
    p.assumptions = config_note(model, config_path) + p.assumptions
    if args.json:
        return p.to_dict()
    return render_plans([p])


def render_plans(plans: list, gap=None) -> str:
    out = [kvp.plan_table(plans), "", kvp.summary_table(plans), "",
           "Reserved per GPU before vLLM sizes the KV cache (MiB; workspace.py, overlay reserve.py):",
           kvp.reserved_table(plans)]
    for p in plans:
        for w in p.warnings:
            out.append(f"warning ({p.label}): {w}")
    if gap:
        out += ["", "Against the reference (TP2 x PP3, 14,14,12):",
                kvp.table(["planned (vLLM-reported)", "reference", "planned / reference",
                           "non-KV GiB/GPU the reference implies beyond the plan",
                           "equivalent gpu_memory_utilization"],
                          [[f"{gap.planned_tokens:,}", f"{gap.reference_tokens:,}", f"{gap.ratio:.3f}",
                            f"{gap.kv_gib_gap_per_gpu:.2f}", f"{gap.implied_util:.3f}"]])]
    out += ["", "Assumptions:", *(f"- {a}" for a in plans[0].assumptions)]
    return "\n".join(out)


def cmd_compare(args: argparse.Namespace) -> Any:
    model, config_path = resolve_model(args)
    plans = kvp.compare_six_gpus(model, weight_dtypes(args), cache_format(args), util=args.util,
                                 base_reserve_gib=args.base_reserve_gib, paging=args.paging)
    for p in plans:
        p.assumptions = config_note(model, config_path) + p.assumptions
    applies = kvp.reference_applies(model)
    gap = kvp.reference_gap(plans[0]) if applies else None  # plans[0] is the TP2 x PP3 layout
    if args.json:
        return {"model": model.name, "reference_tokens": kvp.REFERENCE_TOKENS,
                "reference_applies": applies, "plans": [p.to_dict() for p in plans],
                "reference_gap": _asdict(gap) if gap else None}
    ref = (f"reference: TP2 x PP3, split {','.join(map(str, kvp.REFERENCE_SPLIT))}, "
           f"{kvp.REFERENCE_TOKENS:,} GPU-resident KV tokens")
    if not applies:
        ref += (f" -- its split sums to {sum(kvp.REFERENCE_SPLIT)} layers, {model.name} has "
                f"{model.arch['num_hidden_layers']}, so no gap is computed (it is a V4.1 figure)")
    head = f"{model.name} on 6 x {kvp.REFERENCE_GPU_MEM_GIB:g} GiB; {ref}"
    return head + "\n\n" + render_plans(plans, gap)


def cmd_predict(args: argparse.Namespace) -> Any:
    config = kvp.load_config(args.config)
    if args.pp <= 0:
        raise kvp.PlannerInputError("pp", f"must be positive, got {args.pp}")
    paging = kvp.paging_for(args.path, args.page, args.indexer_page)
    pr = kvp.predict(config, args.kv_gib, paging, args.max_model_len, args.max_num_batched_tokens,
                     kvp.CacheFormat("fp8", args.indexer_dtype), args.pp, args.reported)
    if args.json:
        return {**dataclasses.asdict(pr), "error": pr.error, "config": args.config}
    rows = [[g["kind"], g["block_size"], g["caches"], f"{g['page_bytes']:,}",
             f"{g['blocks_per_request']:,}"] for g in pr.groups]
    lines = [f"{pr.model} ({args.config}), paging {pr.paging}: block size {pr.block_size}, "
             f"max_model_len {pr.max_model_len:,}, {pr.in_flight_tokens:,} in-flight tokens", "",
             kvp.table(["group", "block tokens", "caches", "page B", "blocks per request"], rows), "",
             f"pool block: {pr.bytes_per_block:,} B (widest group {pr.widest_group_bytes:,} B)",
             f"KV memory {args.kv_gib:g} GiB = {pr.kv_bytes:,} B -> {pr.num_blocks:,} blocks; "
             f"{pr.blocks_per_request:,} per request; concurrency {pr.concurrency:.2f}",
             f"predicted GPU KV cache size: {pr.tokens:,} tokens"]
    if pr.reported:
        lines.append(f"reported: {pr.reported:,} tokens; predicted / reported - 1 = {pr.error:+.4%}")
    lines += [f"note: {n}" for n in pr.notes]
    return "\n".join(lines)


def cmd_chart(args: argparse.Namespace) -> Any:
    try:
        import matplotlib
    except ImportError:
        raise kvp.PlannerInputError("chart", "matplotlib is not installed (pip install matplotlib)")
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    config = kvp.load_config(args.config or DEFAULT_V41_CONFIG)
    v41 = kvp.resolve_model("v4.1", config)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    _chart_cache(ax1, v41)
    _chart_topologies(ax2, v41)
    fig.suptitle("DeepSeek KV cache at 1,048,576 tokens (kv_planner.py; V4.1 from the illustrative config)")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    return f"wrote {args.out}"


def chart_series(v41) -> list[tuple[str, float]]:
    """(label, GiB per 1M-token sequence) for the left panel."""
    bf16, q = kvp.CacheFormat("bf16", "bf16"), kvp.CacheFormat("fp8", "fp4")
    stacks = [
        ("V3.2-style 61L\nbf16", kvp.v32_stack(61, bf16)),
        ("V4-Pro 61L\nbf16", kvp.v4_stack(kvp.PUBLISHED_V4_RATIOS, bf16)),
        ("V4-Pro 61L\nfp8 + fp4 idx", kvp.v4_stack(kvp.PUBLISHED_V4_RATIOS, q)),
        ("V4-Flash 43L\nfp8 + fp4 idx", kvp.build_stack(kvp.resolve_model("v4-flash"), q)),
        ("V4.1 40L\nfp8 + fp4 idx", kvp.build_stack(v41, q)),
    ]
    return [(label, kvp.stack_bytes(s, kvp.CONTEXT_1M) / kvp.GiB) for label, s in stacks]


def _chart_cache(ax, v41) -> None:
    series = chart_series(v41)
    colors = ["#888888", "#4c72b0", "#55a868", "#55a868", "#c44e52"]
    bars = ax.bar([s[0] for s in series], [s[1] for s in series], color=colors)
    ax.bar_label(bars, fmt="%.2f GiB", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("KV cache per 1M-token sequence (GiB, log)")
    ax.set_title("Per-sequence KV, whole stack (published method)")
    ax.tick_params(axis="x", labelsize=8)


def _chart_topologies(ax, v41) -> None:
    plans = kvp.compare_six_gpus(v41)
    labels = [p.label.replace(" (split", "\n(split") for p in plans]
    bars = ax.bar(labels, [p.reported_tokens / 1e6 for p in plans], color="#4c72b0")
    ax.bar_label(bars, fontsize=8,
                 labels=[f"{p.reported_tokens / 1e6:.2f}M\n{p.seqs:.2f} x 1M" for p in plans])
    ax.axhline(kvp.REFERENCE_TOKENS / 1e6, color="#c44e52", ls="--",
               label=f"reference TP2 x PP3: {kvp.REFERENCE_TOKENS:,}")
    ax.set_ylabel("GPU-resident KV tokens (millions, vLLM-reported)")
    ax.set_title("V4.1 on 6 x 64 GiB, fp8 KV + fp8 indexer (the Ampere path)")
    ax.set_ylim(0, max(p.reported_tokens for p in plans) / 1e6 * 1.25)
    ax.legend(fontsize=8, loc="upper left")
    ax.tick_params(axis="x", labelsize=8)


COMMANDS = {"published": cmd_published, "layers": cmd_layers, "plan": cmd_plan,
            "compare": cmd_compare, "predict": cmd_predict, "chart": cmd_chart}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = COMMANDS[args.cmd](args)
    except kvp.PlannerInputError as e:
        print(f"{PROG}: error: {e.field}: {e.message}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2, default=str) if getattr(args, "json", False) else out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
