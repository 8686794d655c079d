"""CPU stand-ins for benchmarks/e2e/run.py --task long (tests/test_e2e_long.py, and the
subprocess it kills): a vLLM engine that prefills in chunks and decodes as the real one
schedules, an LLM around it (generate with prompt logprobs, collective_rpc, vllm_config),
torch.cuda's memory and sync calls, and a stage profiler fed with kernel names of the real
paths. Not collected by pytest (no ``test_`` prefix)."""
from __future__ import annotations

import importlib.util
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
# What the stand-in LLM reports as vLLM's KV capacity, and its memory peaks.
KV_TOKENS = 5_123_456
KV_BLOCKS = 20_013
AVAILABLE_BYTES = 96 * GIB
PEAK_ALLOCATED = 3 * GIB
PEAK_RESERVED = 4 * GIB
DEVICE_TOTAL, DEVICE_FREE = 140 * GIB, 20 * GIB
# torch's pool at a request's end (the rest of the device's used memory is outside torch),
# vLLM's budget (gpu_memory_utilization 0.80 x total) and its profile's activation peak.
RESERVED_END = 118 * GIB
REQUESTED = 112 * GIB
PROFILE_ACTIVATION = 2 * GIB
# Each memory_snapshot call shows one more segment of this size (a request's new segment).
SEGMENT = 3 * 2 ** 20
# The profiled prefill's kernels: (name, microseconds), stages as run.kernel_stage places them.
KERNELS = (("void deep_gemm::sm90_fp8_mqa_logits<64, 128>", 500.0),   # indexer_logits
           ("_cand_logits_kernel", 100.0),                            # indexer_logits
           ("top_k_per_row_prefill", 80.0),                           # topk
           ("_sparse_mla_prefill_kernel", 300.0),                     # attention
           ("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT", 200.0),      # gemm
           ("moe_wna16_marlin_gemm_kernel", 50.0),                    # gemm
           ("_fused_save_compress_norm_kernel", 40.0),                # rest
           ("Memcpy HtoD (Pageable -> Device)", 10.0))                # rest
STAGE_US = {"indexer_logits": 600.0, "topk": 80.0, "attention": 300.0, "gemm": 250.0,
            "rest": 50.0}


def run_module():
    spec = importlib.util.spec_from_file_location("e2e_run_long_fakes",
                                                  REPO / "benchmarks" / "e2e" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def logprob_of(i: int) -> float:
    """The stand-in's logprob of prompt position i (also the fake reference's): it depends on
    the position, so rows compared one position apart differ."""
    return -1.0 - (i % 97) / 100.0


class Killed(BaseException):
    """What a SIGKILL is to the in-process tests: nothing after it runs."""


class Engine:
    """Chunked prefill in arrival order, ``chunk`` prompt tokens per step; a request whose
    prompt is done gets its first token in that step and one more token in every later step.
    ``kill_at``: a step prefilling a prompt of that length raises Killed; ``hang_at``: it
    sleeps for an hour (the subprocess test kills it there)."""

    def __init__(self, chunk: int, kill_at=None, hang_at=None):
        self.chunk, self.reqs = chunk, {}
        self.kill_at, self.hang_at = kill_at, hang_at
        self.added: list[tuple[int, int]] = []   # (prompt length, max_tokens) per request

    def add_request(self, rid, prompt, sp):
        n = len(prompt["prompt_token_ids"])
        self.reqs[rid] = dict(n=n, left=n, toks=0, max=sp.max_tokens)
        self.added.append((n, sp.max_tokens))
        return rid + "-0a1b"   # vLLM returns its internal id; outputs carry the given one

    def has_unfinished_requests(self):
        return any(r["toks"] < r["max"] for r in self.reqs.values())

    def abort_request(self, ids):
        for i in ids:
            self.reqs.pop(i, None)

    def step(self):
        for r in self.reqs.values():
            if r["left"] and r["n"] == self.kill_at:
                raise Killed(f"killed while prefilling {r['n']} tokens")
            if r["left"] and r["n"] == self.hang_at:
                time.sleep(3600)
        budget = self.chunk
        for r in self.reqs.values():
            if r["left"] == 0 and r["toks"] < r["max"]:
                r["toks"] += 1
        for r in self.reqs.values():
            if r["left"] and budget:
                take = min(budget, r["left"])
                r["left"] -= take
                budget -= take
                if r["left"] == 0:
                    r["toks"] = 1
        return [types.SimpleNamespace(request_id=k, outputs=[types.SimpleNamespace(
            token_ids=[0] * r["toks"])]) for k, r in self.reqs.items()]


class LLM:
    def __init__(self, chunk: int, max_model_len: int = 1 << 20, **kw):
        cc = types.SimpleNamespace(kv_cache_size_tokens=KV_TOKENS, kv_cache_max_concurrency=4.9,
                                   num_gpu_blocks=KV_BLOCKS, block_size=256)
        eng = Engine(chunk, **kw)
        eng.vllm_config = types.SimpleNamespace(
            cache_config=cc, model_config=types.SimpleNamespace(max_model_len=max_model_len))
        self.llm_engine = eng
        self.generated: list[int] = []

    def generate(self, prompts, sp, use_tqdm=False):
        lp = lambda v: types.SimpleNamespace(logprob=v)  # noqa: E731
        outs = []
        for q in prompts:
            p = q["prompt_token_ids"]
            self.generated.append(len(p))
            plp = [None] + [{p[i]: lp(logprob_of(i))} for i in range(1, len(p))]
            outs.append(types.SimpleNamespace(prompt_logprobs=plp, outputs=[
                types.SimpleNamespace(token_ids=[7], logprobs=[{7: lp(-0.5)}])]))
        return outs

    def collective_rpc(self, fn):
        spec = types.SimpleNamespace(block_size=256, page_size_bytes=256 * 584)
        worker = types.SimpleNamespace(
            available_kv_cache_memory_bytes=AVAILABLE_BYTES, requested_memory=REQUESTED,
            total_consumed=REQUESTED - AVAILABLE_BYTES - PROFILE_ACTIVATION,
            peak_activation_memory=PROFILE_ACTIVATION, cudagraph_memory_estimate=0,
            model_runner=types.SimpleNamespace(kv_cache_config=types.SimpleNamespace(
                num_blocks=KV_BLOCKS,
                kv_cache_tensors=[types.SimpleNamespace(size=AVAILABLE_BYTES // 2)] * 2,
                kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec,
                                                       layer_names=["a", "b"])])))
        return [fn(worker)]


class Profiler:
    """Stands in for run.StageProfiler: the KERNELS once each, laid end to end from t = 0, and
    a 100 us gap before the last one."""

    def __init__(self, run):
        self.run, self.starts, self.stops = run, 0, 0

    def start(self):
        self.starts += 1

    def stop(self, wall_s):
        self.stops += 1
        events, t = [], 0.0
        for i, (name, us) in enumerate(KERNELS):
            if i == len(KERNELS) - 1:
                t += 100.0
            events.append((name, t, t + us))
            t += us
        return dict(self.run.stage_split(events, wall_s), parse_s=0.01)


class Direct:
    """monkeypatch's setattr / setitem for a process that is not a test."""

    def setattr(self, obj, name, value):
        setattr(obj, name, value)

    def setitem(self, mapping, key, value):
        mapping[key] = value


def _growing_snapshot():
    segments: list = []

    def snapshot():
        segments.append(dict(address=len(segments), total_size=SEGMENT))
        return list(segments)
    return snapshot


def install(patch, run) -> None:
    """torch.cuda's calls the long task makes, a ``vllm`` module with SamplingParams, and the
    stand-in profiler in ``run``."""
    import torch
    for name, value in (("synchronize", lambda *a: None), ("empty_cache", lambda: None),
                        ("reset_peak_memory_stats", lambda *a: None),
                        ("max_memory_allocated", lambda *a: PEAK_ALLOCATED),
                        ("max_memory_reserved", lambda *a: PEAK_RESERVED),
                        ("mem_get_info", lambda *a: (DEVICE_FREE, DEVICE_TOTAL)),
                        ("memory_reserved", lambda *a: RESERVED_END),
                        ("memory_snapshot", _growing_snapshot())):
        patch.setattr(torch.cuda, name, value)
    patch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        SamplingParams=lambda **kw: types.SimpleNamespace(**kw)))
    patch.setattr(run, "StageProfiler", lambda: Profiler(run))


def serve(run, argv, llm=None, **engine_kw) -> dict:
    """What run.py main does for --task long after the engine started, with the stand-in LLM:
    the result dict, written to --out after every request."""
    args = run.parse_args(argv)
    llm = llm or LLM(args.chunk, args.max_model_len, **engine_kw)
    result = dict(mode=args.mode, task="long", eager=args.eager, model=args.model,
                  gpu="NVIDIA H200", torch="2.11", triton="3.6.0", vllm="0.33.0",
                  commit="abc1234", load_seconds=12.5, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs,
                  kv=run.kv_figures(llm, None))
    run.long_task(llm, 1000, args, result, lambda: run.write_json(args.out, result))
    run.write_json(args.out, result)
    return result
