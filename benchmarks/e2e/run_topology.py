"""One engine of run.py or run_spec.py on more than one GPU: tensor_parallel_size and
pipeline_parallel_size passed to vLLM, the pipeline split chosen, each rank's layers and
classes recorded, and the sm_80 audit made in every worker (rank_audit.py). run.py and
run_spec.py are unchanged: this process wraps ``vllm.LLM`` and the runner's serving and
output functions, then runs the runner's ``main`` with the arguments after ``--``.

    python benchmarks/e2e/run_topology.py --tp 2 [--pp 1] [--pp-partition 6,4] [--rank-audit] \
        [--runner run|spec] -- --model DIR --mode a100 --task agree --out F.json [--eager]

What lands in the runner's output:
  topology    {tp, pp, pp_partition, world_size}: what vLLM was given
  ranks       per rank (rank_audit.deepinfer_rank_info): tp/pp rank, device, layer range,
              attention classes
  rank_counters  per rank: the prefill indexer's row-shard exchanges and rows
              (``--row-shard-min-rows`` lowers vLLM's 65,536-row threshold for sharding), and
              the TP/PP collectives' calls per implementation, inside CUDA-graph capture or
              not (``--no-custom-all-reduce`` sends every TP all-reduce to PyNCCL;
              ``--nccl-env`` sets NCCL_* variables for the workers)
  rank_audit  with --rank-audit, per rank: audit.check of the recorder in that worker
  audit       with --rank-audit, the ranks' audits merged (a Triton kernel or op per rank,
              ``failed`` and the compiles while serving of every rank, ``zero_compile`` only
              when every rank compiled nothing while serving); the runner's own in-process
              audit, if it made one, is kept as ``audit_main_process`` (at TP or PP > 1 it
              sees no model code)
The three NVLink-multicast switches the two-GPU machines keep off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1: a program that uses multicast can
put the host's GPUs out of service) are set here where missing, before vLLM is imported; the
workers inherit them. VLLM_PP_LAYER_PARTITION is set to --pp-partition, or removed.
Standard library at import; vLLM and the runner are imported in main.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
PP_ENV = "VLLM_PP_LAYER_PARTITION"
EXTENSION = "rank_audit.RankAudit"
RUNNERS = ("run", "spec")
# The functions each runner's main calls to serve (wrapped to switch the ranks' recorders to
# "serve" around them) and to write its output.
SERVE = {"run": ("agree", "tput", "long_task"), "spec": ("serve_spec", "serve_plain")}


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, rest = argv[:i], argv[i + 1:]
    else:
        own, rest = argv, []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    ap.add_argument("--pp-partition", default=None,
                    help="VLLM_PP_LAYER_PARTITION (layers per stage, comma-separated)")
    ap.add_argument("--row-shard-min-rows", type=int, default=None,
                    help="attention_config.indexer_tp_shard_min_rows (vLLM's default 65,536): "
                    "prefill steps of at least this many rows shard the indexer's rows over "
                    "the TP ranks")
    ap.add_argument("--no-custom-all-reduce", action="store_true",
                    help="disable_custom_all_reduce=True: every TP all-reduce through PyNCCL "
                    "(inside the CUDA graphs too)")
    ap.add_argument("--nccl-env", default="",
                    help="NCCL_* variables for the workers, K=V comma-separated (e.g. "
                    "NCCL_ALGO=Ring,NCCL_PROTO=Simple)")
    ap.add_argument("--rank-audit", action="store_true",
                    help="the sm_80 audit inside every worker (rank_audit.py)")
    ap.add_argument("--runner", choices=RUNNERS, default="run",
                    help="run: benchmarks/e2e/run.py; spec: run_spec.py")
    args = ap.parse_args(own)
    if args.tp < 1 or args.pp < 1:
        ap.error("--tp and --pp are at least 1")
    if args.pp_partition is not None:
        parts = [p for p in args.pp_partition.split(",") if p.strip()]
        if len(parts) != args.pp or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            ap.error(f"--pp-partition {args.pp_partition!r}: {args.pp} positive layer counts")
    args.nccl = {}
    for part in _csv(args.nccl_env):
        k, eq, v = part.partition("=")
        if not eq or not k.startswith("NCCL_") or k in NO_MULTICAST:
            ap.error(f"--nccl-env {part!r}: NCCL_<NAME>=<value>, not {', '.join(NO_MULTICAST)}")
        args.nccl[k] = v
    world = args.tp * args.pp
    if world > 1 and "--audit" in rest:
        ap.error("--audit records in this process, which runs no model code at TP or PP > 1: "
                 "use --rank-audit")
    if args.rank_audit and ("--audit" in rest or (world == 1 and args.runner == "spec"
                                                   and "nocompile" in rest)):
        # At one GPU the worker is this process: two recorders would count everything twice.
        ap.error("--rank-audit and the runner's own audit exclude each other")
    return args, rest


def _csv(text: str) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def environment(args, env=None) -> dict:
    """What this process sets before vLLM is imported (returned; applied by main)."""
    env = dict(os.environ if env is None else env)
    for k, v in NO_MULTICAST.items():
        env.setdefault(k, v)
    env.update(getattr(args, "nccl", {}))
    if args.pp_partition:
        env[PP_ENV] = args.pp_partition
    else:
        env.pop(PP_ENV, None)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(HERE) not in path:   # the workers import rank_audit and audit from here
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), *path])
    if args.rank_audit:
        env["E2E_RANK_AUDIT"] = "1"
    else:
        env.pop("E2E_RANK_AUDIT", None)
    return env


def llm_kwargs(args, kw: dict) -> dict:
    """vllm.LLM keyword arguments with the topology (and the extension) added."""
    kw = dict(kw, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
              worker_extension_cls=EXTENSION)
    if args.row_shard_min_rows is not None:
        kw["attention_config"] = dict(kw.get("attention_config") or {},
                                      indexer_tp_shard_min_rows=args.row_shard_min_rows)
    if args.no_custom_all_reduce:
        kw["disable_custom_all_reduce"] = True
    if args.tp * args.pp > 1:
        kw["distributed_executor_backend"] = "mp"
    return kw


def merge_audits(per_rank: list) -> dict | None:
    """The ranks' audit.check results as one (see the module docstring)."""
    audits = [(i, a) for i, a in enumerate(per_rank) if a]
    if not audits:
        return None
    out: dict = dict(triton_kernels=[], cuda_ops=[], deep_gemm_calls={}, tilelang_compiles={},
                     compiles_by_phase={}, tilelang_by_phase={}, region_ops={},
                     serve_compiles=[], serve_compiles_outside=[], warmup_seconds={},
                     failed=[], ranks=len(audits))
    for i, a in audits:
        out["triton_kernels"] += [dict(t, rank=i) for t in a.get("triton_kernels", [])]
        out["cuda_ops"] += [dict(o, rank=i) for o in a.get("cuda_ops", [])]
        out["serve_compiles"] += [dict(c, rank=i) for c in a.get("serve_compiles", [])]
        out["serve_compiles_outside"] += [dict(c, rank=i)
                                          for c in a.get("serve_compiles_outside", [])]
        out["failed"] += [f"rank {i}: {f}" for f in a.get("failed", [])]
        for key in ("deep_gemm_calls", "tilelang_compiles", "compiles_by_phase",
                    "tilelang_by_phase", "warmup_seconds"):
            for k, v in (a.get(key) or {}).items():
                out[key][k] = out[key].get(k, 0) + v
        for region, ops in (a.get("region_ops") or {}).items():
            dst = out["region_ops"].setdefault(region, {})
            for k, v in ops.items():
                dst[k] = dst.get(k, 0) + v
        out.setdefault("libraries", a.get("libraries"))
    out["zero_compile"] = all(a.get("zero_compile") for _, a in audits)
    return out


def _rpc(llm, method: str, *a):
    try:
        return llm.collective_rpc(method, args=a)
    except Exception as e:  # noqa: BLE001 - reported, the run's other outputs still count
        return [dict(error=f"{type(e).__name__}: {e}")]


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    env = environment(args)
    for k in [k for k in os.environ if k not in env]:
        del os.environ[k]
    os.environ.update(env)
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import run
    runner = run
    if args.runner == "spec":
        import run_spec as runner
        rargs = runner.parse_args(rest)
    else:
        rargs = run.parse_args(rest)
    # What the runner's main sets before it imports vLLM, set first because vLLM is imported
    # here first (the mode's switches must be in place when vllm.deepinfer resolves its
    # variant); the runner sets the same again.
    os.environ.update(run.MODES[rargs.mode])
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    state: dict = {}
    base = vllm.LLM

    class TopologyLLM(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **llm_kwargs(args, kw))
            state["llm"] = self
            state["ranks"] = _rpc(self, "deepinfer_rank_info")
    vllm.LLM = TopologyLLM

    def serving(f):
        def wrapper(llm, *a, **k):
            if args.rank_audit:
                _rpc(llm, "deepinfer_rank_audit_phase", "serve")
            try:
                return f(llm, *a, **k)
            finally:
                if args.rank_audit:
                    _rpc(llm, "deepinfer_rank_audit_phase", "after")
        return wrapper
    for name in SERVE[args.runner]:
        if hasattr(runner, name):
            setattr(runner, name, serving(getattr(runner, name)))
    write = runner.write_json
    out_path = str(rargs.out)

    def write_with_topology(path, obj):
        if str(path) == out_path and isinstance(obj, dict):
            obj = dict(obj, topology=dict(tp=args.tp, pp=args.pp, pp_partition=args.pp_partition,
                                          world_size=args.tp * args.pp,
                                          row_shard_min_rows=args.row_shard_min_rows,
                                          custom_all_reduce=not args.no_custom_all_reduce,
                                          nccl_env=dict(args.nccl)),
                       ranks=state.get("ranks"))
            llm = state.get("llm")
            if llm is not None:
                obj["rank_counters"] = _rpc(llm, "deepinfer_rank_counters")
            if args.rank_audit and llm is not None:
                per_rank = _rpc(llm, "deepinfer_rank_audit_check")
                obj["rank_audit"] = per_rank
                if "audit" in obj:
                    obj["audit_main_process"] = obj.pop("audit")
                merged = merge_audits([a if isinstance(a, dict) and "error" not in a else None
                                       for a in per_rank])
                if merged is not None:
                    obj["audit"] = merged
                if "selections" not in obj:   # rank 0's (run.selections)
                    obj["selections"] = run.selections(llm)
        write(path, obj)
    runner.write_json = write_with_topology
    script = "run_spec.py" if args.runner == "spec" else "run.py"
    sys.argv = [str(HERE / script), *rest]
    return runner.main()


if __name__ == "__main__":
    sys.exit(main())
