"""One run.py engine with what the graph-mode and Hopper-parity steps need on top of it
(benchmarks/e2e/graph_modes.py, parity.py): a compilation config passed to vLLM, the mode
"default" (the overlay's defaults on this GPU: no switch set), a greedy check of a few
prompts before the timed requests, and a record of the CUDA-graph mode vLLM resolved and
dispatched. run.py itself is unchanged: this process registers the mode, wraps ``vllm.LLM``
and runs ``run.main`` with the arguments after ``--``.

    python benchmarks/e2e/run_engine.py [--compilation-config JSON] [--check-lens N ...]
        [--check-gen N] [--check-repeat N] -- --model DIR --mode a100 --task tput --out F.json

What lands in run.py's output under "engine":
  graph     vLLM's resolved compilation config, read from the worker after start-up:
            ``cudagraph_mode`` (what it runs: vLLM may lower a requested mode, logging why),
            the capture sizes, the dispatcher's graph keys, and every attention group's
            metadata builder with the CUDA-graph support it reports (AttentionCGSupport:
            vLLM resolves the mode against the lowest of them)
  log       vLLM's log lines about CUDA graphs and compilation (the downgrade warning when
            there is one, capture and compile times)
  check     run.py's agree rows of the --check-lens prompts, generated in one call before
            the engine's first generate call (run.py's warm-up; decode at a batch of
            len(--check-lens)); "repeats" with --check-repeat 2 (the in-process floor, as
            run.py --repeat)
  dispatch  how often the dispatcher chose each runtime mode, per (mode, tokens, uniform
            decode), from the end of start-up to the output (run.py's warm-up, the check
            and the timed requests): which graphs the decode batches replayed
Standard library at import; vLLM, torch and run.py's engine are imported in main.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# The mode this wrapper adds to run.py's: the overlay's defaults, no DEEPINFER_* switch.
DEFAULT_MODE = "default"
# vLLM log records kept (message substrings, case-insensitive).
LOG_PATTERNS = ("cudagraph", "cuda graph", "cudagraphmode", "graph capturing",
                "torch.compile", "compilation", "piecewise")
LOG_KEEP = 60


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, rest = argv[:i], argv[i + 1:]
    else:
        own, rest = [], argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compilation-config", type=json.loads, default=None,
                    help="JSON object merged into vllm.LLM's compilation_config")
    ap.add_argument("--check-lens", type=int, nargs="*", default=[],
                    help="prompt lengths of the greedy check (none: no check)")
    ap.add_argument("--check-gen", type=int, default=16)
    ap.add_argument("--check-repeat", type=int, default=1)
    ap.add_argument("--check-seed", type=int, default=0)
    return ap.parse_args(own), rest


# --------------------------------------------------------------------------- worker side
# These run in the worker through LLM.collective_rpc (in this process: run.py sets
# VLLM_ENABLE_V1_MULTIPROCESSING=0); each returns plain data.
def _name(x) -> str | None:
    if x is None:
        return None
    return getattr(x, "name", None) or str(x)


def worker_graph_info(worker) -> dict:
    """The CUDA-graph configuration the worker runs with, and each attention group's
    metadata builder with the support it reports. Parts that cannot be read are reported
    as errors, not raised."""
    r = worker.model_runner
    out: dict = {}
    try:
        cc = r.compilation_config
        out.update(cudagraph_mode=_name(cc.cudagraph_mode),
                   capture_sizes=list(cc.cudagraph_capture_sizes or []),
                   max_capture_size=cc.max_cudagraph_capture_size,
                   compilation_mode=_name(getattr(cc, "mode", None)),
                   splitting_ops=list(getattr(cc, "splitting_ops", None) or []))
    except Exception as e:  # noqa: BLE001 - reported
        out["config_error"] = f"{type(e).__name__}: {e}"
    try:
        d = r.cudagraph_dispatcher
        out["dispatcher_mode"] = _name(d.cudagraph_mode)
        out["graph_keys"] = {_name(m): sorted({k.num_tokens for k in keys})
                             for m, keys in d.cudagraph_keys.items() if keys}
    except Exception as e:  # noqa: BLE001
        out["dispatcher_error"] = f"{type(e).__name__}: {e}"
    groups = []
    try:
        for g in r._attn_group_iterator():
            b = g.backend.get_builder_cls()
            row = dict(backend=g.backend.__name__, builder=b.__name__,
                       layers=len(g.layer_names))
            try:
                row["support"] = _name(b.get_cudagraph_support(r.vllm_config, g.kv_cache_spec))
            except Exception as e:  # noqa: BLE001
                row["support_error"] = f"{type(e).__name__}: {e}"
            groups.append(row)
    except Exception as e:  # noqa: BLE001
        out["groups_error"] = f"{type(e).__name__}: {e}"
    out["cg_support"] = groups
    levels = ("NEVER", "UNIFORM_SINGLE_TOKEN_DECODE", "UNIFORM_BATCH", "ALWAYS")
    seen = [g["support"] for g in groups if g.get("support") in levels]
    out["min_cg_support"] = min(seen, key=levels.index) if seen else None
    return out


def install_dispatch_counter(worker) -> bool:
    """Count the dispatcher's answers from now on (``read_dispatch_counts``)."""
    d = worker.model_runner.cudagraph_dispatcher
    if getattr(d, "_deepinfer_counts", None) is not None:
        return True
    counts: dict[str, int] = {}
    orig = d.dispatch

    def dispatch(num_tokens, *a, **kw):
        mode, desc = orig(num_tokens, *a, **kw)
        uniform = kw.get("uniform_decode", a[0] if a else False)
        key = f"{_name(mode)}|{int(num_tokens)}|{int(bool(uniform))}"
        counts[key] = counts.get(key, 0) + 1
        return mode, desc
    d.dispatch = dispatch
    d._deepinfer_counts = counts
    return True


def read_dispatch_counts(worker) -> dict[str, int]:
    return dict(getattr(worker.model_runner.cudagraph_dispatcher, "_deepinfer_counts", {}))


def dispatch_modes(counts: dict[str, int], num_tokens: int, uniform: bool = True) -> list[str]:
    """The runtime modes the dispatcher chose for batches of ``num_tokens`` tokens (uniform
    decode batches by default: every request one token)."""
    out = set()
    for key, n in counts.items():
        mode, tok, uni = key.split("|")
        if n and int(tok) == num_tokens and bool(int(uni)) == uniform:
            out.add(mode)
    return sorted(out)


# --------------------------------------------------------------------------- process side
class LogTap(logging.Handler):
    """Keeps vLLM's log records about CUDA graphs and compilation."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            return
        low = msg.lower()
        if any(p in low for p in LOG_PATTERNS) and len(self.lines) < LOG_KEEP:
            self.lines.append(f"{record.levelname} {record.name}: {msg}"[:600])


def merged_compilation(kw: dict, extra: dict | None) -> dict:
    """vllm.LLM keyword arguments with ``extra`` merged into compilation_config."""
    if not extra:
        return kw
    cc = dict(kw.get("compilation_config") or {})
    cc.update(extra)
    return dict(kw, compilation_config=cc)


def wrap_llm(base, opts, state: dict, vocab_of, agree):
    """A subclass of vLLM's LLM that passes ``opts.compilation_config``, records the graph
    configuration and installs the dispatch counter once started, and runs the check
    prompts at its first ``generate`` (so run.py's ``load_seconds`` stays the start-up's
    alone; ``state`` holds what goes into the output)."""
    class EngineLLM(base):
        def __init__(self, *a, **kw):
            kw = merged_compilation(kw, opts.compilation_config)
            state["llm_kwargs"] = {k: v for k, v in kw.items()
                                   if isinstance(v, (int, float, str, bool, dict, type(None)))}
            t0 = time.perf_counter()
            super().__init__(*a, **kw)
            state["start_seconds"] = time.perf_counter() - t0
            state["llm"] = self
            self._deepinfer_check = list(opts.check_lens)
            self._deepinfer_model = kw.get("model") or (a[0] if a else None)
            try:
                state["graph"] = self.collective_rpc(worker_graph_info)[0]
            except Exception as e:  # noqa: BLE001 - the timed rows are still worth having
                state["graph"] = dict(error=f"{type(e).__name__}: {e}")
            try:
                self.collective_rpc(install_dispatch_counter)
            except Exception as e:  # noqa: BLE001
                state["dispatch_error"] = f"{type(e).__name__}: {e}"

        def generate(self, *a, **kw):
            if self._deepinfer_check:
                lens, self._deepinfer_check = self._deepinfer_check, []
                ns = SimpleNamespace(lens=lens, seed=opts.check_seed, gen=opts.check_gen,
                                     repeat=opts.check_repeat, zero_kv=False, toggle_yoco=False)
                t0 = time.perf_counter()
                try:
                    state["check"] = agree(self, vocab_of(self._deepinfer_model), ns)
                except Exception as e:  # noqa: BLE001
                    state["check"] = dict(error=f"{type(e).__name__}: {e}")
                state["check_seconds"] = time.perf_counter() - t0
            return super().generate(*a, **kw)
    return EngineLLM


def engine_record(state: dict, tap: LogTap) -> dict:
    """What goes into run.py's output under "engine"."""
    out = {k: state[k] for k in ("graph", "check", "check_seconds", "start_seconds",
                                 "llm_kwargs", "dispatch_error") if k in state}
    llm = state.get("llm")
    if llm is not None and "dispatch_error" not in state:
        try:
            out["dispatch"] = llm.collective_rpc(read_dispatch_counts)[0]
        except Exception as e:  # noqa: BLE001
            out["dispatch_error"] = f"{type(e).__name__}: {e}"
    out["log"] = list(tap.lines)
    return out


def vocab_size(model_dir: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int((cfg.get("text_config") or cfg)["vocab_size"])


def main(argv=None) -> int:
    opts, rest = parse_args(argv)
    import run
    run.MODES.setdefault(DEFAULT_MODE, {})
    args = run.parse_args(rest)
    # What run.main sets before it imports vLLM, set here first because vLLM is imported
    # here first (the mode's switches must be in place when vllm.deepinfer resolves its
    # variant); run.main sets the same again.
    os.environ.update(run.MODES[args.mode])
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    tap = LogTap()
    logging.getLogger("vllm").addHandler(tap)
    state: dict = {}
    vllm.LLM = wrap_llm(vllm.LLM, opts, state, vocab_size, run.agree)
    write = run.write_json

    def write_with_engine(path, obj):
        if str(path) == str(args.out) and isinstance(obj, dict):
            obj = dict(obj, engine=engine_record(state, tap), engine_options=dict(
                compilation_config=opts.compilation_config, check_lens=opts.check_lens,
                check_gen=opts.check_gen, check_repeat=opts.check_repeat))
        write(path, obj)
    run.write_json = write_with_engine
    sys.argv = [str(HERE / "run.py"), *rest]
    return run.main()


if __name__ == "__main__":
    sys.exit(main())
