"""CPU stand-ins for the graph-mode and Hopper-parity steps (benchmarks/e2e/graph_modes.py,
parity.py; tests/test_e2e_graph_modes.py, test_e2e_parity.py). Not collected by pytest.

* ``write_fake_vllm(root)``: a ``vllm`` package for a subprocess (PYTHONPATH=root) in which
  benchmarks/e2e/run_engine.py and run.py run unchanged: an LLM that resolves its
  compilation config as vLLM 0.33.0 does for builders reporting UNIFORM_BATCH (FULL lowered
  to FULL_AND_PIECEWISE with vLLM's warning), captures vLLM's default sizes (1, 2, 4, then
  every 8 up to min(2 x max_num_seqs, 512)) or up to max_cudagraph_capture_size, prefills in
  chunks and decodes as tests/test_e2e_tput.py's stand-in, asks its dispatcher at every step
  as vLLM's model runner does, and gives logprobs that depend on the prompt only, so two
  engines agree bit for bit unless FAKE_SHIFT shifts them.
* ``FastSh``: a stand-in for e2e.sh that writes what run_engine.py would for a command, at
  speeds and check results a test chooses, on a clock a test reads (cold / warm starts by
  whether the engine's vLLM cache root was compiled, as engine_plan.py estimates them).
"""
from __future__ import annotations

import json
import sys
import textwrap
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
E2E = REPO / "benchmarks" / "e2e"
if str(E2E) not in sys.path:
    sys.path.insert(0, str(E2E))

FAKE_VLLM = '''
"""Stand-in vLLM for run_engine.py / run.py subprocess tests (tests/graph_fakes.py)."""
import enum
import logging
import os
import time
import types

import torch

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
__version__ = "0.33.0"
CHUNK = 2048
_log = logging.getLogger("vllm.config.compilation")


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = 3
    FULL_AND_PIECEWISE = 4


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _LP:
    def __init__(self, v):
        self.logprob = v


def _lp(tok, i):
    return -1.0 - ((tok * 31 + i) % 89) / 100.0 + float(os.environ.get("FAKE_SHIFT", "0"))


class _Desc:
    def __init__(self, n):
        self.num_tokens = n


class _Dispatcher:
    def __init__(self, mode, sizes):
        self.cudagraph_mode, self.sizes = mode, sizes
        full = mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY)
        pw = mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.PIECEWISE)
        self.cudagraph_keys = {CUDAGraphMode.FULL: {_Desc(s) for s in sizes} if full else set(),
                               CUDAGraphMode.PIECEWISE: {_Desc(s) for s in sizes} if pw else set()}

    def dispatch(self, num_tokens, uniform_decode=False, has_lora=False, **kw):
        fit = [s for s in self.sizes if s >= num_tokens]
        if not fit or self.cudagraph_mode == CUDAGraphMode.NONE:
            return CUDAGraphMode.NONE, _Desc(num_tokens)
        if uniform_decode and self.cudagraph_keys[CUDAGraphMode.FULL]:
            return CUDAGraphMode.FULL, _Desc(fit[0])
        if self.cudagraph_keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, _Desc(fit[0])
        return CUDAGraphMode.NONE, _Desc(num_tokens)


class _Builder:
    _support = "UNIFORM_BATCH"

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        return types.SimpleNamespace(name=cls._support)


class DeepseekV4SparseMLAMetadataBuilder(_Builder):
    pass


class DeepseekV32IndexerMetadataBuilder(_Builder):
    pass


class DeepseekV4CompressorMetadataBuilder(_Builder):
    _support = "ALWAYS"


def _backend(name, builder):
    return type(name, (), {"get_builder_cls": staticmethod(lambda: builder)})


class _Engine:
    def __init__(self, dispatcher):
        self.reqs, self.d = {}, dispatcher

    def add_request(self, rid, prompt, sp):
        self.reqs[rid] = dict(left=len(prompt["prompt_token_ids"]), toks=0, max=sp.max_tokens)
        return rid + "-0a1b"

    def has_unfinished_requests(self):
        return any(r["toks"] < r["max"] for r in self.reqs.values())

    def abort_request(self, ids):
        for i in ids:
            self.reqs.pop(i, None)

    def step(self):
        budget, dec, pre = CHUNK, 0, 0
        for r in self.reqs.values():
            if r["left"] == 0 and r["toks"] < r["max"]:
                r["toks"] += 1
                dec += 1
        for r in self.reqs.values():
            if r["left"] and budget:
                take = min(budget, r["left"])
                r["left"] -= take
                budget -= take
                pre += take
                if r["left"] == 0:
                    r["toks"] = 1
        self.d.dispatch(dec + pre, uniform_decode=pre == 0 and dec > 0)
        time.sleep(0.0001)
        return [types.SimpleNamespace(request_id=k, outputs=[types.SimpleNamespace(
            token_ids=[0] * r["toks"])]) for k, r in self.reqs.items()]


class LLM:
    def __init__(self, model=None, enforce_eager=False, compilation_config=None,
                 max_num_seqs=64, max_num_batched_tokens=CHUNK, **kw):
        cc = dict(compilation_config or {})
        asked = CUDAGraphMode.NONE if enforce_eager else CUDAGraphMode[
            cc.get("cudagraph_mode", "FULL_AND_PIECEWISE")]
        mode = asked
        if asked == CUDAGraphMode.FULL:
            _log.warning("CUDAGraphMode.FULL is not supported with "
                         "DeepinferAmpereV41MLASparseBackend backend (support: "
                         "AttentionCGSupport.UNIFORM_BATCH); setting "
                         "cudagraph_mode=FULL_AND_PIECEWISE")
            mode = CUDAGraphMode.FULL_AND_PIECEWISE
        top = cc.get("max_cudagraph_capture_size") or min(2 * max_num_seqs, 512)
        sizes = [] if mode == CUDAGraphMode.NONE else sorted(
            {s for s in [1, 2, 4] + list(range(8, 257, 8)) if s <= top})
        logging.getLogger("vllm.compilation").warning("Graph capturing finished in 1 secs")
        self.kw = kw
        d = _Dispatcher(mode, sizes)
        groups = [types.SimpleNamespace(backend=_backend("DeepinferAmpereV41MLASparseBackend",
                                                         DeepseekV4SparseMLAMetadataBuilder),
                                        layer_names=["a"] * 10, kv_cache_spec=None),
                  types.SimpleNamespace(backend=_backend("DeepseekV41IndexerBackend",
                                                         DeepseekV32IndexerMetadataBuilder),
                                        layer_names=["i"] * 4, kv_cache_spec=None),
                  types.SimpleNamespace(backend=_backend("DeepseekV4CompressorBackend",
                                                         DeepseekV4CompressorMetadataBuilder),
                                        layer_names=["c"] * 10, kv_cache_spec=None)]
        runner = types.SimpleNamespace(
            compilation_config=types.SimpleNamespace(
                cudagraph_mode=mode, cudagraph_capture_sizes=sizes,
                max_cudagraph_capture_size=max(sizes) if sizes else 0,
                mode=types.SimpleNamespace(name="VLLM_COMPILE"), splitting_ops=["vllm::x"]),
            cudagraph_dispatcher=d, vllm_config=None, _attn_group_iterator=lambda: iter(groups))
        self.worker = types.SimpleNamespace(model_runner=runner)
        self.llm_engine = _Engine(d)

    def collective_rpc(self, fn, *a, **kw):
        return [fn(self.worker)]

    def generate(self, prompts, sp, use_tqdm=False):
        d = self.worker.model_runner.cudagraph_dispatcher
        d.dispatch(sum(len(p["prompt_token_ids"]) for p in prompts))
        for _ in range(sp.max_tokens - 1):
            d.dispatch(len(prompts), uniform_decode=True)
        outs = []
        for q in prompts:
            p = q["prompt_token_ids"]
            plp = [None] + [{p[i]: _LP(_lp(p[i], i)), 5: _LP(-9.0)} for i in range(1, len(p))]
            gen = [5 + (sum(p) + j) % 7 for j in range(sp.max_tokens)]
            outs.append(types.SimpleNamespace(prompt_logprobs=plp, outputs=[
                types.SimpleNamespace(token_ids=gen,
                                      logprobs=[{t: _LP(_lp(t, j))} for j, t in enumerate(gen)])]))
        return outs
'''

FAKE_PLATFORMS = '''
import types
current_platform = types.SimpleNamespace(get_device_capability=lambda: (9, 0))
'''

FAKE_DEEPINFER = '''
'''

FAKE_ARCH = '''
import os
import types


def current():
    return types.SimpleNamespace(name="sm80" if os.environ.get("DEEPINFER_EMULATE_CAPABILITY")
                                 else "sm90")
'''

FAKE_YOCO = '''
def reset_totals():
    pass


def totals():
    return {}
'''


def write_fake_vllm(root: Path) -> Path:
    """The stand-in ``vllm`` package under ``root`` (put ``root`` on PYTHONPATH)."""
    files = {"vllm/__init__.py": FAKE_VLLM, "vllm/platforms/__init__.py": FAKE_PLATFORMS,
             "vllm/deepinfer/__init__.py": FAKE_DEEPINFER, "vllm/deepinfer/arch.py": FAKE_ARCH,
             "vllm/deepinfer/yoco.py": FAKE_YOCO}
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


def write_checkpoint(out: Path, vocab: int = 1000) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"text_config": {"vocab_size": vocab}}))


# --------------------------------------------------------------------------- fast stand-in
_RUN = []


def e2e_run():
    """benchmarks/e2e/run.py loaded by its path (benchmarks/run.py is also a module named
    "run" on some tests' sys.path)."""
    if not _RUN:
        import importlib.util
        spec = importlib.util.spec_from_file_location("e2e_run_graph_fakes", E2E / "run.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _RUN.append(mod)
    return _RUN[0]


def parse_engine_command(cmd) -> tuple:
    """run_engine.py's own options and run.py's arguments of an engine command."""
    import run_engine
    run = e2e_run()
    run.MODES.setdefault(run_engine.DEFAULT_MODE, {})
    opts, rest = run_engine.parse_args([str(c) for c in cmd[2:]])
    return opts, run.parse_args(rest)


def check_rows(lens, shift: float = 0.0, seed: int = 0, gen: int = 16) -> dict:
    """An agree-layout check result whose logprobs depend on the prompt position only,
    moved by ``shift`` (and every ``flip``-th top-1 token changed when shift is negative)."""
    prompts = []
    for n in lens:
        rows = [[(i * 7) % 97, -1.0 - (i % 89) / 100.0 + shift, -1.0 - (i % 89) / 100.0 + shift]
                for i in range(1, n)]
        gen_rows = [[5, -0.5 + shift, [[5, -0.5 + shift]]] for _ in range(gen)]
        prompts.append(dict(prompt_len=n, prompt=rows, generated=gen_rows))
    return dict(prompts=prompts)


class FastSh:
    """e2e.sh's signature; writes run_engine.py's output for a command without running it.

    ``speed(tag, args, opts, env) -> tokens/s`` per row is called with the row in
    ``args.cur`` (phase, batch, prompt_len); ``check(tag, opts) -> check dict or None``;
    ``resolve(opts) -> (resolved mode, log lines)``. ``clock`` advances by the start kind's
    seconds (``costs``: cold_a100 for an a100 engine before any other on this stand-in's
    machine, as engine_plan estimates it) plus ``measure`` per engine; ``started`` lists
    the engines' tags."""

    def __init__(self, speed=None, check=None, resolve=None, costs=None, measure=10.0,
                 fail=()):
        self.speed = speed or (lambda tag, args, opts, env, row: 100.0 * row["batch"])
        self.check = check
        self.resolve = resolve or _resolve
        self.costs = costs or {"cold": 150.0, "cold_a100": 345.0, "cold_a100_cached": 180.0,
                               "warm": 60.0, "eager": 120.0}
        self.measure, self.fail = measure, set(fail)
        self.clock = 0.0
        self.started: list[str] = []
        self.envs: dict[str, dict] = {}
        self.cmds: dict[str, list] = {}

    def left_fn(self, budget: float):
        return lambda: budget - self.clock

    def __call__(self, cmd, log, env=None, timeout=None):
        cmd = [str(c) for c in cmd]
        if "make_checkpoint.py" in " ".join(cmd):
            write_checkpoint(Path(cmd[cmd.index("--out") + 1]))
            return 0
        opts, args = parse_engine_command(cmd)
        tag = Path(args.out).stem
        root = Path(env["VLLM_CACHE_ROOT"])
        compiled = (root / "torch_compile_cache").is_dir()
        kind = "eager" if args.eager else "warm" if compiled else "cold" \
            if args.mode != "a100" else "cold_a100_cached" if self.started else "cold_a100"
        self.started.append(tag)
        self.envs[tag], self.cmds[tag] = dict(env or {}), cmd
        self.clock += self.costs[kind] + self.measure
        Path(log).write_text(f"fake engine {tag} ({kind})\n")
        if tag in self.fail:
            return 1
        if not args.eager:
            (root / "torch_compile_cache" / "x").mkdir(parents=True, exist_ok=True)
        resolved, lines = ("NONE", []) if args.eager else self.resolve(opts)
        rows = []
        for b in args.batches:
            row = dict(phase="decode", batch=b, prompt_len=args.decode_prompt)
            rows.append(dict(row, timing="engine steps after the last prefill", tokens=64 * b,
                             seconds=1.0, tokens_per_s=self.speed(tag, args, opts, env, row)))
        for n in args.prefill_lens:
            row = dict(phase="prefill", batch=1, prompt_len=n)
            rows.append(dict(row, tokens=n, seconds=1.0,
                             tokens_per_s=self.speed(tag, args, opts, env, row)))
        sizes = [] if resolved == "NONE" else [1, 2, 4] + list(range(8, 129, 8))
        cc = opts.compilation_config or {}
        if cc.get("max_cudagraph_capture_size"):
            sizes = [s for s in sizes if s <= cc["max_cudagraph_capture_size"]]
        dispatch = {}
        for b in list(args.batches) + [len(opts.check_lens)]:
            mode = ("FULL" if resolved in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")
                    else resolved) if b <= max(sizes or [0]) else "NONE"
            dispatch[f"{mode}|{b}|1"] = 64
        check = None
        if opts.check_lens:
            check = self.check(tag, opts) if self.check else check_rows(opts.check_lens)
            if check is not None and opts.check_repeat > 1 and "repeats" not in check:
                check = dict(check, repeats=[check["prompts"]])
        out = dict(mode=args.mode, task="tput", eager=args.eager, model=args.model,
                   gpu="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0", vllm="0.33.0",
                   commit="abc1234", load_seconds=self.costs[kind],
                   deepinfer_variant="sm80" if args.mode == "a100" else "sm90",
                   capability_seen_by_vllm=[8, 0] if args.mode == "a100" else [9, 0],
                   rows=rows, engine=dict(
                       graph=dict(cudagraph_mode=resolved, capture_sizes=sizes,
                                  max_capture_size=max(sizes) if sizes else 0,
                                  min_cg_support="UNIFORM_BATCH",
                                  cg_support=[dict(backend="B", builder="DeepseekV4SparseMLA"
                                                   "MetadataBuilder", support="UNIFORM_BATCH",
                                                   layers=10)]),
                       log=lines, dispatch=dispatch,
                       **({"check": check} if check is not None else {})))
        Path(args.out).write_text(json.dumps(out))
        return 0


def _resolve(opts) -> tuple[str, list[str]]:
    asked = (opts.compilation_config or {}).get("cudagraph_mode", "FULL_AND_PIECEWISE")
    if asked == "FULL":
        return "FULL_AND_PIECEWISE", [
            "WARNING vllm.config.compilation: CUDAGraphMode.FULL is not supported with B "
            "backend (support: AttentionCGSupport.UNIFORM_BATCH); setting "
            "cudagraph_mode=FULL_AND_PIECEWISE"]
    return asked, []


def namespace(**kw):
    return types.SimpleNamespace(**kw)
