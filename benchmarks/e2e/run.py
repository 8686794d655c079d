"""One vLLM engine, one mode: serve a model and write what it produced (and, for the
A100-faithful mode, the sm_80 audit) to JSON. Run once per mode: the mode's environment must
be set before vLLM is imported, so every mode is its own process (benchmarks/e2e/e2e.py runs
them all).

    python benchmarks/e2e/run.py --model DIR --mode a100 --task agree --out F.json [--eager]

Modes (the overlay must be installed into the vLLM this python imports):
  a100      DEEPINFER_EMULATE_CAPABILITY=8.0: vLLM selects every kernel as on an A100
            (Marlin linears and MoE, no FlashMLA/DeepGEMM/CuTeDSL, our attention class with
            its sm80 kernels); the kernels run on this GPU.
  sm90      our attention path with its sm90 kernels on the real capability
            (DEEPINFER_AMPERE_ATTN=1 DEEPINFER_ARCH=sm90).
  upstream  every DeepInfer feature off (DEEPINFER_DISABLE=all): upstream's own path
            (on Hopper: FlashMLA + DeepGEMM).
  a100_noyoco, sm90_noyoco   the same with cross-layer reuse off (DEEPINFER_YOCO_REUSE=0)
  a100_rerun                 a100 again (run-to-run floor)
  a100_verify, sm90_verify   reuse on, every reused product rebuilt and compared bit for bit
                             in the forward (DEEPINFER_YOCO_VERIFY=1; result 'yoco_totals')
  a100_det, sm90_det, a100_det_noyoco, sm90_det_noyoco, a100_det_rerun
                             the same with the indexer's top-k rows sorted
                             (DEEPINFER_SORTED_TOPK=1: a run-to-run identical key order)
                             and cuBLAS's workspace pinned (CUBLAS_WORKSPACE_CONFIG)
  a100_mhcdec_on, a100_mhcdec_off
                             a100 with the one-launch mHC decode kernel forced on / off
                             (DEEPINFER_MHC_DECODE=1 / 0)
Tasks:
  agree     greedy generation with top-K logprobs of prompt and generated tokens
  tput      decode tokens/s at several batch sizes and prefill tokens/s at several lengths
  long      long-context serving (e2e.py --steps long): per prompt length of --long-lens, TTFT,
            prefill tokens/s and decode tokens/s at that context (batch 1, and 4 at
            --b4-lens), peak GPU memory, vLLM's KV capacity; the prefill at --profile-len
            split by stage (torch.profiler); agreement rows of the last --agree-last prompt
            positions at --agree-len. Output rewritten after every request ("complete").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:   # loaded by path (reference.py, the tests): its siblings import
    sys.path.append(HERE)
import run_long  # noqa: E402
from run_common import agree_rows, prompts, write_json  # noqa: E402,F401 - re-exported
# The long task's names, re-exported: e2e.py's tests and long_fakes use them as run.<name>.
from run_long import (  # noqa: E402,F401
    GIB, LONG_AGREE_LAST, LONG_CHUNK, LONG_MAX_SEQS, LONG_SEEDS, LONG_TIMEOUT_BASE_S,
    LONG_TIMEOUT_S_PER_MTOK, LONG_WARMUP_LEN, LONG_WARMUP_SEED, LONG_WARMUP_STEPS, STAGES,
    STAGE_PATTERNS, TOP_KERNELS, KvLog, StageProfiler, kernel_stage, kv_figures, long_agree,
    long_max_model_len, long_max_tokens, long_plan, request_timeout, serve_timed, stage_split)

MODES = {
    "a100": {"DEEPINFER_EMULATE_CAPABILITY": "8.0"},
    "sm90": {"DEEPINFER_AMPERE_ATTN": "1", "DEEPINFER_ARCH": "sm90"},
    "upstream": {"DEEPINFER_DISABLE": "all"},
    # Cross-layer reuse off (docs/yoco.md): the same engine must produce the same tokens and
    # logprobs; "a100_rerun" is the a100 mode again, the run-to-run floor of that comparison.
    "a100_noyoco": {"DEEPINFER_EMULATE_CAPABILITY": "8.0", "DEEPINFER_YOCO_REUSE": "0"},
    "sm90_noyoco": {"DEEPINFER_AMPERE_ATTN": "1", "DEEPINFER_ARCH": "sm90",
                    "DEEPINFER_YOCO_REUSE": "0"},
    "a100_rerun": {"DEEPINFER_EMULATE_CAPABILITY": "8.0"},
}
# The one-launch mHC decode kernel (docs/mhc.md section 6) explicitly on and off in the
# A100-faithful engine, whatever the feature's default: the tput step's served decode-step
# comparison (e2e.py --tput-modes a100_mhcdec_off,a100_mhcdec_on).
MODES["a100_mhcdec_on"] = dict(MODES["a100"], DEEPINFER_MHC_DECODE="1")
MODES["a100_mhcdec_off"] = dict(MODES["a100"], DEEPINFER_MHC_DECODE="0")
# Cross-layer reuse with every reused product built again and compared bit for bit inside
# the forward (DEEPINFER_YOCO_VERIFY=1, eager): the check that holds reuse to identity in
# a served engine, where two generations of one engine already differ (docs/e2e.md).
MODES["a100_verify"] = dict(MODES["a100"], DEEPINFER_YOCO_VERIFY="1")
MODES["sm90_verify"] = dict(MODES["sm90"], DEEPINFER_YOCO_VERIFY="1")
# The same comparisons with the indexer's top-k rows sorted (DEEPINFER_SORTED_TOPK=1, a test
# switch): upstream's top-k kernels order their output by atomics, so two runs of one engine
# sum the same keys in different orders and, through the next layers' top-k, drift apart
# (the 4ab26c8 run: a100 against a100_rerun, 0.943 top-1). Sorted, the rerun pair shows
# whether the engine is deterministic, and the reuse on/off pairs can be held to identity.
# The d80f014 run showed sorting alone is not enough (docs/e2e.md: reruns first differ at
# prompt positions 27-160, where every compressed key is selected anyway). The _det modes
# therefore also pin cuBLAS's workspace (CUBLAS_WORKSPACE_CONFIG, PyTorch's recipe for
# run-to-run identical cuBLAS results when several streams are in use: V4/V4.1 run an aux
# stream); untested on a GPU so far.
for _m in ("a100", "sm90", "a100_noyoco", "sm90_noyoco", "a100_rerun"):
    _base, _, _rest = _m.partition("_")
    MODES[f"{_base}_det{'_' + _rest if _rest else ''}"] = dict(
        MODES[_m], DEEPINFER_SORTED_TOPK="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
del _m, _base, _rest
# Prompt lengths for agreement: a short one, one past the 128-token SWA window, one whose
# compressed context (ratio 1: L, ratio 2: L/2 entries) exceeds top-k 512 so the indexer
# selects, and long ones that chunked prefill splits (max_num_batched_tokens below).
AGREE_LENS = (7, 300, 1500, 5000, 16000)
CHUNK = 2048          # max_num_batched_tokens: prompts over it are prefilled in chunks
TOPK_LOGPROBS = 20


def _zero_kv_caches(worker) -> int:
    """Zero every KV cache tensor of a worker (run through LLM.collective_rpc)."""
    import torch
    n = 0
    for t in worker.model_runner.kv_caches:
        for x in (t if isinstance(t, (list, tuple)) else (t,)):
            if isinstance(x, torch.Tensor):
                x.zero_()
                n += 1
    torch.cuda.synchronize()
    return n


def agree(llm, vocab: int, args) -> dict:
    """Greedy generation with top-K logprobs; ``args.repeat`` > 1 generates the same
    prompts again in this process (``repeats``: whether one engine is deterministic within a
    process, apart from whether two processes agree)."""
    from vllm import SamplingParams
    ps = prompts(args.lens, vocab, args.seed)
    sp = SamplingParams(max_tokens=args.gen, temperature=0.0, logprobs=TOPK_LOGPROBS,
                        prompt_logprobs=TOPK_LOGPROBS, detokenize=False)
    from vllm.deepinfer import yoco
    yoco.reset_totals()  # what the load's profile and warmup runs counted is not served
    zero = getattr(args, "zero_kv", False)

    def gen():
        if zero:  # every generation starts from the same cache contents
            llm.collective_rpc(_zero_kv_caches)
        return llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    t0 = time.perf_counter()
    outs = gen()
    dt = time.perf_counter() - t0
    repeats = [agree_rows(ps, gen()) for _ in range(max(0, getattr(args, "repeat", 1) - 1))]
    out = dict(seconds=dt, prompts=agree_rows(ps, outs), yoco_totals=yoco.totals())
    if repeats:
        out["repeats"] = repeats
    if getattr(args, "toggle_yoco", False):
        # Reuse is decided per call from the environment (vllm.deepinfer.yoco.enabled), and
        # the engine runs in this process: the same engine, the same prompts, reuse off.
        prev = os.environ.get("DEEPINFER_YOCO_REUSE")
        os.environ["DEEPINFER_YOCO_REUSE"] = "0"
        try:
            out["noyoco_in_process"] = agree_rows(ps, gen())
        except Exception as e:  # noqa: BLE001 - the rows above are still worth having
            out["noyoco_in_process_error"] = f"{type(e).__name__}: {e}"
        finally:
            if prev is None:
                os.environ.pop("DEEPINFER_YOCO_REUSE", None)
            else:
                os.environ["DEEPINFER_YOCO_REUSE"] = prev
    return out




def _timed_generate(llm, ps, max_tokens):
    from vllm import SamplingParams
    import torch
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0,
                        ignore_eos=True, detokenize=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def decode_steps_per_s(llm, ps, steps: int) -> dict:
    """Decode tokens/s of a batch of len(ps), timed directly on vLLM's engine steps.

    The prompts are enqueued, and the engine is stepped by hand. Once every request has its
    first token (all prefill chunks are done), the clock starts; it stops once the batch has
    produced `steps` more tokens per request. Every step in that window is a pure decode step
    of the whole batch: max_tokens leaves room for the requests whose prefill finished early,
    so none finishes inside the window. (Subtracting a prefill-only run from a full run does
    not work: chunked prefill overlaps the first requests' decode with the later prefills.)
    """
    from vllm import SamplingParams
    import torch
    eng = llm.llm_engine
    prefill_steps = -(-sum(len(p) for p in ps) // CHUNK) + 2
    sp = SamplingParams(max_tokens=steps + prefill_steps + 2, min_tokens=steps + prefill_steps + 2,
                        temperature=0.0, ignore_eos=True, detokenize=False)
    # Straight to the engine with cumulative outputs (LLM.enqueue asks for final outputs only,
    # and the window needs every request's count after every step).
    # Outputs carry the id given here; add_request returns vLLM's internal one (with a suffix
    # of its own), so outputs are matched to these ids and aborts use them (external ids).
    ids = [f"decode-tput-{time.monotonic_ns()}-{i}" for i in range(len(ps))]
    for rid, p in zip(ids, ps):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    counts = {i: 0 for i in ids}
    t0 = s0 = None
    t1 = s1 = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            key = o.request_id if o.request_id in counts else next(
                (k for k in ids if o.request_id.startswith(k + "-")), None)
            if key is not None:
                counts[key] = len(o.outputs[0].token_ids)
        total = sum(counts.values())
        if t0 is None and all(c >= 1 for c in counts.values()):
            torch.cuda.synchronize()
            t0, s0 = time.perf_counter(), total
        elif t0 is not None and t1 is None and total >= s0 + steps * len(ps):
            torch.cuda.synchronize()
            t1, s1 = time.perf_counter(), total
            eng.abort_request(list(ids))
    if t1 is None:
        raise RuntimeError(f"decode window not reached: counts {sorted(counts.values())}")
    return dict(tokens=s1 - s0, seconds=t1 - t0, tokens_per_s=(s1 - s0) / (t1 - t0))


def tput(llm, vocab: int, args) -> list[dict]:
    rows = []
    warm = prompts([256] * 2, vocab, 1)
    _timed_generate(llm, warm, 8)
    for b in args.batches:
        ps = prompts([args.decode_prompt] * b, vocab, 100 + b)
        try:
            best = max((decode_steps_per_s(llm, ps, args.decode_tokens) for _ in range(2)),
                       key=lambda r: r["tokens_per_s"])
        except Exception as e:  # noqa: BLE001 - the prefill rows are still worth having
            best = dict(error=f"{type(e).__name__}: {e}", tokens_per_s=None)
            print(f"decode batch {b}: FAILED {best['error']}", flush=True)
            rows.append(dict(phase="decode", batch=b, prompt_len=args.decode_prompt, **best))
            continue
        rows.append(dict(phase="decode", batch=b, prompt_len=args.decode_prompt,
                         timing="engine steps after the last prefill", **best))
        print(f"decode batch {b}: {rows[-1]['tokens_per_s']:.1f} tok/s", flush=True)
    for n in args.prefill_lens:
        ps = prompts([n], vocab, 200 + n)
        t = min(_timed_generate(llm, ps, 1) for _ in range(2))
        rows.append(dict(phase="prefill", batch=1, prompt_len=n, tokens=n, seconds=t,
                         tokens_per_s=n / t))
        print(f"prefill {n}: {rows[-1]['tokens_per_s']:.1f} tok/s", flush=True)
    return rows


def long_task(llm, vocab: int, args, result: dict, flush) -> None:
    """run_long.long_task with the stage profiler this module names (a test stands one in
    for run.StageProfiler)."""
    run_long.long_task(llm, vocab, args, result, flush, profiler=StageProfiler)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=sorted(MODES), required=True)
    ap.add_argument("--task", choices=("agree", "tput", "long"), default="agree")
    ap.add_argument("--out", required=True)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile, "
                    "no CUDA graphs); the sm_80 audit runs only in this form")
    ap.add_argument("--audit", action="store_true", help="record and check what ran (a100)")
    ap.add_argument("--jit-warmup", action="store_true",
                    help="eager execution with vLLM's JIT warmup kept on (compilation mode "
                    "NONE, no CUDA graphs; --eager would switch the warmup off): the form the "
                    "zero-compile check runs in")
    ap.add_argument("--gen", type=int, default=32, help="generated tokens per prompt (agree)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="agree: generate the same prompts this many times in this process "
                    "(the result's 'repeats' hold the later ones)")
    ap.add_argument("--toggle-yoco", action="store_true",
                    help="agree: after the repeats, generate the same prompts once more in "
                    "this process with cross-layer reuse off (DEEPINFER_YOCO_REUSE=0); the "
                    "result's 'noyoco_in_process' holds them")
    ap.add_argument("--zero-kv", action="store_true",
                    help="agree: zero every KV cache tensor before each generation (whether "
                    "repeats differ because a kernel reads cache memory no request wrote)")
    ap.add_argument("--one-stream", action="store_true",
                    help="diagnostic: no auxiliary CUDA streams (vLLM's parallel pairs run "
                    "in order on one stream)")
    ap.add_argument("--torch-det", action="store_true",
                    help="diagnostic: torch.use_deterministic_algorithms(warn_only=True), so "
                    "torch ops without a deterministic CUDA implementation name themselves")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: 16640 (agree, tput); long: what its plan reaches "
                    "(long_max_model_len)")
    ap.add_argument("--chunk", type=int, default=None,
                    help=f"max_num_batched_tokens (default {CHUNK}; long: {LONG_CHUNK})")
    ap.add_argument("--long-lens", type=int, nargs="*", default=[131072, 524288, 1048000],
                    help="long: prompt lengths, each served at batch 1")
    ap.add_argument("--b4-lens", type=int, nargs="*", default=[131072],
                    help="long: the lengths also served as a batch of 4")
    ap.add_argument("--agree-len", type=int, default=131072,
                    help="long: length of the agreement prompt (0: none)")
    ap.add_argument("--agree-last", type=int, default=LONG_AGREE_LAST,
                    help="long: prompt positions of the agreement prompt kept (the last ones)")
    ap.add_argument("--profile-len", type=int, default=1048000,
                    help="long: the batch-1 prefill of this length is split by stage "
                    "(torch.profiler; 0: none)")
    ap.add_argument("--profile-batch", type=int, default=1, choices=(1, 4),
                    help="long: the batch of --profile-len that is profiled (4: the batch of "
                    "four, whose steps mix decode tokens and prefill chunks)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help=f"default: max(64, --batches) (agree, tput); long: {LONG_MAX_SEQS}")
    ap.add_argument("--request-timeout", type=float, default=None,
                    help="long: seconds per request (default: request_timeout's "
                    "length-scaled limit)")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64])
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-lens", type=int, nargs="*", default=[1024, 8192, 32768])
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="fixed KV cache size (vLLM's kv_cache_memory_bytes): vLLM then skips "
                    "the memory-profiling comparison, so engines can start side by side "
                    "without taking the start-up lock")
    ap.add_argument("--dummy", action="store_true", help="vLLM's dummy weights (no checkpoint)")
    ap.add_argument("--lens", type=int, nargs="*", default=list(AGREE_LENS),
                    help="prompt lengths for agree")
    return ap


def parse_args(argv=None, ap=None) -> argparse.Namespace:
    """run.py's arguments with the task-dependent defaults filled in (e2e.py's tests parse the
    commands it builds with this)."""
    args = (ap or parser()).parse_args(argv)
    if args.chunk is None:
        args.chunk = LONG_CHUNK if args.task == "long" else CHUNK
    if args.max_num_seqs is None:
        args.max_num_seqs = LONG_MAX_SEQS if args.task == "long" else max(64, *args.batches)
    if args.max_model_len is None:
        args.max_model_len = (long_max_model_len(long_plan(
            args.long_lens, args.b4_lens, args.agree_len, args.decode_tokens, args.chunk))
            if args.task == "long" else 16384 + 256)
    return args


def main() -> int:
    ap = parser()
    args = parse_args(None, ap)

    os.environ.update(MODES[args.mode])
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")   # no flashinfer in the kit
    # DeepGEMM's JIT warmup compiles ~600 kernels in the upstream mode (over 4 minutes for
    # v4-mini on the H200); skipped, they compile on first use. Numerics are unchanged.
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"          # engine in this process
    rec = None
    if args.audit:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from audit import Recorder
        rec = Recorder().install()

    import torch
    import vllm
    from vllm import LLM
    kvlog = KvLog().install() if args.task == "long" else None
    if args.torch_det:
        # Diagnostic: torch ops with a nondeterministic CUDA implementation warn by name.
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.one_stream:
        # Diagnostic: every maybe_execute_in_parallel pair runs in order on the current
        # stream, and vLLM's shared aux stream is None (before the model modules import).
        import vllm.utils.multi_stream_utils as msu
        import vllm.utils.torch_utils as tu
        _par = msu.maybe_execute_in_parallel
        msu.maybe_execute_in_parallel = lambda f0, f1, e0, e1, aux_stream=None: _par(
            f0, f1, e0, e1, None)
        tu.aux_stream = lambda: None
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    t0 = time.perf_counter()
    # Engram builds its n-gram token map from the model's tokenizer (the checkpoint writer
    # ships a word-level one when the model has Engram layers); otherwise skip it.
    has_tok = any(os.path.exists(os.path.join(args.model, f))
                  for f in ("tokenizer.json", "tokenizer_config.json"))
    eager_kw: dict = dict(enforce_eager=args.eager)
    if args.jit_warmup:
        if args.eager:
            ap.error("--jit-warmup and --eager exclude each other (--eager turns the warmup off)")
        eager_kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "NONE"}
    # Engines run side by side (e2e.py --parallel): vLLM's memory profiling fails when another
    # process releases GPU memory meanwhile, so start-up and exit take one lock in turn. With a
    # fixed KV cache size vLLM does not compare free memory before and after its profile run
    # (v1/worker/gpu_worker.py determine_available_memory), so no lock is needed.
    gate = _EngineGate(enabled=args.kv_cache_gib is None)
    gate.acquire()
    if args.task == "long":   # DEEPINFER_LONG_MEMORY_TRACE: frames of what stays resident
        args.resident_trace = run_long.start_resident_trace()
    if args.kv_cache_gib is not None:
        eager_kw["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    llm = LLM(model=args.model, skip_tokenizer_init=not has_tok, language_model_only=True,
              **eager_kw, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.chunk, enable_chunked_prefill=True,
              gpu_memory_utilization=args.gpu_mem, max_num_seqs=args.max_num_seqs,
              seed=args.seed, enable_prefix_caching=False,
              load_format="dummy" if args.dummy else "auto")
    load_s = time.perf_counter() - t0
    gate.release()
    from vllm.platforms import current_platform
    from vllm.deepinfer import arch
    result = dict(mode=args.mode, task=args.task, eager=args.eager or args.jit_warmup,
                  jit_warmup=args.jit_warmup, model=args.model,
                  model_config=cfg, load_seconds=load_s,
                  env={k: os.environ.get(k) for k in sorted(os.environ)
                       if k.startswith(("DEEPINFER_", "VLLM_", "CUBLAS_"))},
                  gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  vllm=vllm.__version__, capability_seen_by_vllm=list(
                      current_platform.get_device_capability()),
                  deepinfer_variant=arch.current().name,
                  commit=os.environ.get("DEEPINFER_COMMIT", ""))
    import triton
    result["triton"] = triton.__version__
    if rec is not None:
        ctx = rec.serving()
        ctx.__enter__()
    try:
        if args.task == "agree":
            result.update(agree(llm, vocab, args))
        elif args.task == "long":
            result.update(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                          gpu_memory_utilization=args.gpu_mem, kv=kv_figures(llm, kvlog))
            long_task(llm, vocab, args, result, lambda: write_json(args.out, result))
        else:
            result["rows"] = tput(llm, vocab, args)
    finally:
        if rec is not None:
            ctx.__exit__(None, None, None)
    if rec is not None:
        from audit import check
        result["audit"] = check(rec)
        result["selections"] = selections(llm)
        print("audit failed:", result["audit"]["failed"] or "none", flush=True)
        print("compiled while serving:", len(result["audit"]["serve_compiles"]),
              "| warmup seconds:", result["audit"]["warmup_seconds"], flush=True)
    write_json(args.out, result)
    print(f"{args.mode} {args.task}: load {load_s:.1f}s -> {args.out}", flush=True)
    gate.acquire()  # held until this process is gone and its GPU memory with it
    os._exit(0)


class _EngineGate:
    """An exclusive file lock shared by the engines of one machine (see its use in main)."""
    PATH = os.environ.get("E2E_ENGINE_LOCK", "/tmp/deepinfer-e2e-engine.lock")

    def __init__(self, enabled: bool = True):
        self.f = open(self.PATH, "a") if enabled else None

    def acquire(self):
        if self.f is not None:
            import fcntl
            fcntl.flock(self.f, fcntl.LOCK_EX)

    def release(self):
        if self.f is not None:
            import fcntl
            fcntl.flock(self.f, fcntl.LOCK_UN)


def selections(llm) -> dict:
    """Which classes vLLM chose for attention, linears and MoE (module type names)."""
    out: dict = {}

    def visit(model):
        import collections
        kinds = collections.Counter()
        for name, mod in model.named_modules():
            qm = getattr(mod, "quant_method", None)
            if qm is not None:
                kinds[f"{type(mod).__name__}:{type(qm).__name__}"] += 1
            if "Attention" in type(mod).__name__ and name.count(".") <= 4:
                kinds[f"attention:{type(mod).__name__}"] += 1
            kernel = getattr(mod, "kernel", None) or getattr(qm, "kernel", None)
            if kernel is not None and not isinstance(kernel, (int, str)):
                kinds[f"kernel:{type(kernel).__name__}"] += 1
        return dict(kinds)
    try:
        out = llm.apply_model(visit)[0]
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out = {"error": f"{type(e).__name__}: {e}"}
    return out


if __name__ == "__main__":
    sys.exit(main())
