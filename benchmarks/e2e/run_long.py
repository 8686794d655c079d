"""benchmarks/e2e/run.py's --task long (e2e.py --steps long): the request plan of one
long-context engine (long_plan, long_max_model_len, request_timeout), a batch served with its
TTFTs and decode window timed on the engine's steps (serve_timed), the prefill split by stage
(kernel_stage, stage_split, StageProfiler), each request's memory peaks, vLLM's KV capacity
(KvLog reads its log lines, kv_figures the engine), the agreement request and the task
itself (long_task). run.py re-exports these names; e2e.py's long step (long_step.py) plans
its engines and their time limits with long_plan and request_timeout. torch and vLLM are
imported only inside the functions that use them.
"""
from __future__ import annotations

import contextlib
import time

from long_memory import (  # noqa: F401 - names of this module before the split
    LONG_NEW_SEGMENTS, MEMORY_TRACE_ENV, MEMORY_TRACE_FRAMES, _MemWindow, _frames, _segments,
    memory_checkpoint, memory_trace_mib, resident_blocks, resident_trace_mib,
    start_resident_trace,
    trace_allocations, trace_peak)
from run_common import agree_rows, prompts

# Long-context serving (e2e.py --steps long): one engine serves every request of its plan in
# one start and rewrites its output file after each (write_json), so a run stopped at any
# point leaves on disk the requests it finished (result "complete": false).
#
# Prefill chunk (max_num_batched_tokens) of the long task: 8,192, as in the bdbe637 runs that
# served 1M-token prompts (a 1M prefill is 128 engine steps, each chunk's activations fit in
# the memory vLLM leaves outside gpu_memory_utilization 0.80).
LONG_CHUNK = 8192
# Warm-up before the timed requests (served, not timed). The upstream mode skips DeepGEMM's
# JIT warmup (VLLM_DEEP_GEMM_WARMUP=skip, main), and with --eager vLLM's own is off too, so
# kernels compile on first use; this makes most of that happen before any clock runs, for a
# batch of 4 and of 1. It cannot meet every token count a timed step has (the long step
# therefore serves its eager form with --jit-warmup, long_step.long_command). 12,288 tokens: one full chunk and a partial one, then mixed prefill and decode steps
# in the batch of 4; and past every selection threshold of the long configs: ratio-2 layers
# hold 6,144 compressed entries (> top-k 512), ratio-1 ones 12,288 and C4A ones 3,072 (> the
# 1,024 entries of 16 candidate blocks of 64), C128A 96.
LONG_WARMUP_LEN = 12288
LONG_WARMUP_STEPS = 8
# max_num_seqs of a long engine: the largest batch its plan serves. What the Ampere path
# reserves for decode grows with it (vllm.deepinfer.reserve: indexer decode logits of
# max_num_seqs rows x max_model_len / ratio columns, 1M wide here), and so do the CUDA graphs
# vLLM captures (up to twice max_num_seqs by default).
LONG_MAX_SEQS = 4
# Agreement on the last 2,048 prompt positions of the agreement prompt (the window).
LONG_AGREE_LAST = 2048
# Per-request time limit: LONG_TIMEOUT_BASE_S plus LONG_TIMEOUT_S_PER_MTOK per million prompt
# tokens of the request (all of its prompts). 150 s per million is three times the 49.7 s TTFT
# of a 1M prompt in the a100 mode on the 12-layer v41-tput config (bdbe637, eager); the base
# covers the decode window and the first steps.
LONG_TIMEOUT_BASE_S = 60.0
LONG_TIMEOUT_S_PER_MTOK = 150.0
# Seeds of the timed prompts per batch size (the agreement prompt uses --seed, as
# reference.py does, so the two draw the same tokens).
LONG_SEEDS = {1: 300, 4: 400}
LONG_WARMUP_SEED = 7
GIB = float(1 << 30)


def long_max_tokens(prompt_tokens: int, batch: int, steps: int, chunk: int) -> int:
    """max_tokens of a timed request: the decode window (``steps``), plus for a batch the
    tokens its earliest request decodes while the later ones still prefill (one per engine
    step, one chunk per step), plus slack. A request that finished early would end the window
    before it is reached."""
    prefill_steps = -(-prompt_tokens // chunk) + 2 if batch > 1 else 0
    return steps + prefill_steps + 2


def long_plan(lens, b4_lens, agree_len: int, steps: int, chunk: int) -> list[dict]:
    """The requests of one long-context engine, in serving order.

    Per prompt length, shortest first: the timed batch of 1 (TTFT, prefill tokens/s, decode
    tokens/s at that context), the agreement request where the length is ``agree_len``, then
    the timed batch of 4 where the length is in ``b4_lens``. Shortest first: a failure at the
    longest prompt (out of memory, or a fault that takes the CUDA context with it) then costs
    no other length; when a deadline stops the engine, what is on disk is every length below
    the one it was serving; and every prompt meets kernels that the warm-up and the shorter
    prompts compiled. What it costs: a deadline that is too short loses the longest prompt
    first (serve it alone with e2e.py --long-lens)."""
    plan = []
    want = sorted(set(lens) | ({agree_len} if agree_len else set()))
    for n in want:
        if n in lens:
            plan.append(dict(kind="timed", prompt_len=n, batch=1,
                             max_tokens=long_max_tokens(n, 1, steps, chunk)))
        if n == agree_len:
            plan.append(dict(kind="agree", prompt_len=n, batch=1, max_tokens=1))
        if n in lens and n in b4_lens:
            plan.append(dict(kind="timed", prompt_len=n, batch=4,
                             max_tokens=long_max_tokens(4 * n, 4, steps, chunk)))
    return plan


def long_max_model_len(plan) -> int:
    """The longest context a planned request reaches (prompt + max_tokens), rounded up to
    256 tokens (V4's KV page)."""
    need = max(r["prompt_len"] + r["max_tokens"] for r in plan)
    return -(-need // 256) * 256


def request_timeout(prompt_tokens: int, fixed: float | None = None) -> float:
    return fixed if fixed else LONG_TIMEOUT_BASE_S + LONG_TIMEOUT_S_PER_MTOK * prompt_tokens / 1e6


# Stages of a prefill, by CUDA kernel name (lower case, first match wins). Kernels whose
# names carry more than one hint are placed by the order: the indexer's logits before the
# GEMMs (DeepGEMM's fp8_mqa_logits is a "deep_gemm::" kernel; the indexer's key gather
# _dequantize_and_gather_k_kernel feeds the logits), MoE routing and the compressors before
# top-k and attention (topk_softplus_sqrt is the router's, _compress_sparse_attn_kernel writes
# the compressed cache); the candidate-block kernels (block scores, flags, masks) are
# selection, so top-k. Names from vLLM 0.33.0's and this overlay's kernels; anything
# unmatched, copies and memsets included, is "rest". The 40 costliest kernels are listed with
# their stage in every split, so a misplaced one shows.
STAGES = ("indexer_logits", "topk", "attention", "gemm", "rest")
STAGE_PATTERNS = (
    ("indexer_logits", r"mqa_logits|indexer_logits|_logits_kernel|sparse_logits|"
                       r"cand_logits|candidate_logits|upcast_logits|gather_k_"),
    ("rest", r"softplus|router|moe_align|compress"),
    ("topk", r"top_?k|radix|sort|candidate|block_scores|_combine_kernel"),
    ("attention", r"mla|flash|attn|attention|fmha|_attend|prefill_ws|_gather_kernel|"
                  r"predequant"),
    ("gemm", r"gemm|gemv|marlin|cutlass|nvjet|xmma|cublas|wgmma|matmul|fused_moe|"
             r"moe_wna16|grouped_mm"),
)
TOP_KERNELS = 40


def kernel_stage(name: str) -> str:
    import re
    low = name.lower()
    for stage, rx in STAGE_PATTERNS:
        if re.search(rx, low):
            return stage
    return "rest"


def stage_split(events, wall_s) -> dict:
    """Seconds of CUDA kernel time per stage from ``events`` = (name, start_us, end_us) of
    every kernel (several streams: the sum can exceed the wall time). ``busy_s`` is the union
    of the kernels' intervals, ``idle_s`` the wall time the GPU ran none (host gaps)."""
    per: dict[str, list] = {}
    spans = []
    for name, s, e in events:
        d = per.setdefault(name, [0.0, 0])
        d[0] += e - s
        d[1] += 1
        spans.append((s, e))
    stages = dict.fromkeys(STAGES, 0.0)
    for name, (us, _) in per.items():
        stages[kernel_stage(name)] += us / 1e6
    busy, end = 0.0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    kernel_s = sum(stages.values())
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return dict(wall_s=wall_s, kernel_s=kernel_s, busy_s=busy / 1e6,
                idle_s=None if wall_s is None else max(0.0, wall_s - busy / 1e6),
                kernels=len(spans), stages=stages,
                top_kernels=[[n, kernel_stage(n), us / 1e6, c] for n, (us, c) in top],
                patterns=[list(p) for p in STAGE_PATTERNS])


class StageProfiler:
    """torch.profiler, CUDA activity only (no CPU ops, shapes or stacks: the least overhead),
    from a request's arrival to its first token; the engine runs in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), so every kernel of the forward is on the trace."""

    def __init__(self):
        self._p = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        self._p = profile(activities=[ProfilerActivity.CUDA])
        self._p.__enter__()

    def stop(self, wall_s) -> dict:
        import torch
        torch.cuda.synchronize()
        t = time.perf_counter()
        self._p.__exit__(None, None, None)
        cuda = torch.autograd.DeviceType.CUDA
        events = [(e.name, e.time_range.start, e.time_range.end) for e in self._p.events()
                  if e.device_type == cuda]
        out = stage_split(events, wall_s)
        out["parse_s"] = time.perf_counter() - t
        self._p = None
        return out


def serve_timed(llm, ps, steps: int, chunk: int, timeout_s: float, prof=None,
                clock=time.perf_counter) -> dict:
    """Serve the prompts ``ps`` together, stepping vLLM's engine by hand: each request's TTFT
    (arrival to first token; the batch arrives at once, and chunked prefill serves it in
    order), prefill tokens/s (all prompt tokens over the last TTFT), then decode tokens/s at
    that context on the engine steps after the last prefill, as decode_steps_per_s times them.
    ``prof`` (StageProfiler) runs until every request has its first token. Past
    ``timeout_s`` the requests are aborted and the result says how far it got."""
    from vllm import SamplingParams
    import torch
    eng = llm.llm_engine
    n = len(ps)
    total = sum(len(p) for p in ps)
    mt = long_max_tokens(total, n, steps, chunk)
    sp = SamplingParams(max_tokens=mt, min_tokens=mt, temperature=0.0, ignore_eos=True,
                        detokenize=False)
    ids = [f"long-{time.monotonic_ns()}-{i}" for i in range(n)]
    counts = dict.fromkeys(ids, 0)
    first: dict[str, float] = {}
    out: dict = dict(prompt_tokens=total, max_tokens=mt, timeout_s=timeout_s, error=None)
    torch.cuda.synchronize()
    if prof is not None:
        try:
            prof.start()
        except Exception as e:  # noqa: BLE001 - the request is still worth timing
            out["profile_error"] = f"{type(e).__name__}: {e}"
            prof = None
    t_add = clock()
    for rid, p in zip(ids, ps):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    t0 = s0 = t1 = s1 = None
    tot = 0
    try:
        while eng.has_unfinished_requests():
            for o in eng.step():
                key = o.request_id if o.request_id in counts else next(
                    (k for k in ids if o.request_id.startswith(k + "-")), None)
                if key is not None:
                    counts[key] = len(o.outputs[0].token_ids)
            new = [k for k in ids if counts[k] >= 1 and k not in first]
            if new:
                torch.cuda.synchronize()
                now = clock() - t_add
                first.update(dict.fromkeys(new, now))
                if prof is not None and len(first) == n:
                    out["stages"] = dict(prof.stop(now), complete=True)
                    prof = None
            tot = sum(counts.values())
            if t0 is None and len(first) == n:
                torch.cuda.synchronize()
                t0, s0 = clock(), tot
            elif t0 is not None and t1 is None and tot >= s0 + steps * n:
                torch.cuda.synchronize()
                t1, s1 = clock(), tot
                eng.abort_request(list(ids))
            if t1 is None and clock() - t_add > timeout_s:
                out["error"] = (f"timeout: {timeout_s:.0f} s passed with {len(first)} of {n} "
                                "requests past their prefill"
                                + ("" if t0 is None else f", {tot - s0} of {steps * n} "
                                   "decode tokens timed"))
                eng.abort_request(list(ids))
                break
    except BaseException:
        # The engine may live on (the next request of the plan): leave it empty, and leave no
        # profiler running.
        with contextlib.suppress(Exception):
            if prof is not None:
                prof.stop(None)
        with contextlib.suppress(Exception):
            eng.abort_request(list(ids))
        raise
    if prof is not None:   # stopped before every request had its first token
        out["stages"] = dict(prof.stop(None), complete=False)
    if t1 is None and out["error"] is None:
        out["error"] = f"decode window not reached: counts {sorted(counts.values())}"
    out.update(ttft_s=first.get(ids[0]),
               ttft_last_s=max(first.values()) if len(first) == n else None)
    out["prefill_tokens_per_s"] = total / out["ttft_last_s"] if out["ttft_last_s"] else None
    if t1 is not None:
        out.update(decode_tokens=s1 - s0, decode_seconds=t1 - t0,
                   decode_tokens_per_s=(s1 - s0) / (t1 - t0),
                   timing="engine steps after the last prefill")
    else:
        out.update(decode_tokens=None, decode_seconds=None, decode_tokens_per_s=None)
    return out


class KvLog:
    """vLLM's own KV-capacity log lines ("GPU KV cache size: N tokens", "Available KV cache
    memory: X GiB"), caught on the "vllm" logger (install after `import vllm`, which configures
    that logger)."""

    def __init__(self):
        import logging
        import re
        self.tokens = self.available_gib = None
        log = self

        class _H(logging.Handler):
            def emit(self, record):
                try:
                    msg = record.getMessage()
                except Exception:  # noqa: BLE001
                    return
                m = re.search(r"KV cache size: ([\d,]+) tokens", msg)
                if m:
                    log.tokens = int(m.group(1).replace(",", ""))
                m = re.search(r"Available KV cache memory: ([\d.]+) GiB", msg)
                if m:
                    log.available_gib = float(m.group(1))
        self.handler = _H(level=logging.INFO)

    def install(self) -> "KvLog":
        import logging
        lg = logging.getLogger("vllm")
        if lg.level > logging.INFO or lg.level == logging.NOTSET:
            lg.setLevel(logging.INFO)
        lg.addHandler(self.handler)
        return self


def _kv_worker_figures(worker) -> dict:
    """The worker's KV allocation (run through LLM.collective_rpc): what vLLM reserved."""
    cfg = worker.model_runner.kv_cache_config
    groups = []
    for g in cfg.kv_cache_groups:
        spec = g.kv_cache_spec
        try:
            page = spec.page_size_bytes
        except Exception:  # noqa: BLE001 - a spec without one
            page = None
        groups.append(dict(spec=type(spec).__name__, layers=len(g.layer_names),
                           block_size=getattr(spec, "block_size", None), page_size_bytes=page))
    # vLLM's budget and its profile run's measurements (gpu_worker.determine_available_memory):
    # requested = gpu_memory_utilization x total; KV = requested - total_consumed - activation
    # peak (the transient torch peak of the profile run, with the CUDA-graph estimate).
    budget = {k: getattr(worker, k, None) for k in (
        "requested_memory", "total_consumed", "peak_activation_memory",
        "cudagraph_memory_estimate")}
    # What the device held when vLLM took its first reading (the CUDA context and NCCL of
    # this process, anything else on the GPU): vLLM's total_consumed counts from there, and
    # gpu_memory_utilization x total does not include it.
    snap = getattr(worker, "init_snapshot", None)
    if snap is not None:
        budget.update(init_used_memory=snap.total_memory - snap.free_memory,
                      init_torch_memory=getattr(snap, "torch_memory", None))
    return dict(available_kv_cache_memory_bytes=getattr(
        worker, "available_kv_cache_memory_bytes", None), budget=budget,
        num_blocks=cfg.num_blocks,
        tensor_bytes=sum(t.size for t in cfg.kv_cache_tensors), groups=groups)


def kv_figures(llm, log: KvLog | None) -> dict:
    """vLLM's KV capacity as it reports it: kv_tokens is the "GPU KV cache size" figure
    (cache_config.kv_cache_size_tokens = max concurrency x max_model_len), with the blocks,
    block size, available memory and the worker's allocation behind it."""
    out: dict = {}
    try:
        vc = llm.llm_engine.vllm_config
        cc = vc.cache_config
        out.update(kv_tokens=getattr(cc, "kv_cache_size_tokens", None),
                   kv_max_concurrency=getattr(cc, "kv_cache_max_concurrency", None),
                   num_gpu_blocks=getattr(cc, "num_gpu_blocks", None),
                   block_size=getattr(cc, "block_size", None),
                   max_model_len=vc.model_config.max_model_len)
    except Exception as e:  # noqa: BLE001 - the figures below may still be there
        out["config_error"] = f"{type(e).__name__}: {e}"
    if log is not None:
        out.update(log_kv_tokens=log.tokens, log_available_gib=log.available_gib)
        if out.get("kv_tokens") is None:
            out["kv_tokens"] = log.tokens
    try:
        w = llm.collective_rpc(_kv_worker_figures)[0]
        out["worker"] = w
        b = w.get("available_kv_cache_memory_bytes")
        out["available_gib"] = b / GIB if b is not None else log.available_gib if log else None
    except Exception as e:  # noqa: BLE001
        out["worker_error"] = f"{type(e).__name__}: {e}"
        out["available_gib"] = log.available_gib if log else None
    return out


def long_agree(llm, vocab: int, args, n: int) -> dict:
    """The agreement request: run.py's agree prompt of length ``n`` (``prompts([n], vocab,
    seed)``, the one reference.py draws), teacher-forced, keeping the last ``args.agree_last``
    prompt positions in agree's layout (``first_position``: the position of the first kept row,
    rows predict positions first_position .. n-1). prompt_logprobs=1: the rows need only the
    top-1 token and the prompt token's logprob."""
    from vllm import SamplingParams
    (p,) = prompts([n], vocab, args.seed)
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1,
                        detokenize=False)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    (row,) = agree_rows([p], outs)
    keep = row["prompt"][-args.agree_last:]
    return dict(seconds=dt, last=args.agree_last, prompts=[dict(
        prompt_len=n, first_position=n - len(keep), prompt=keep, generated=row["generated"])])


def long_task(llm, vocab: int, args, result: dict, flush, profiler=None) -> None:
    """--task long: the warm-up, then every request of long_plan in order; ``result`` gains
    "rows" (one per timed request), "agree", "stages" (the profiled prefill's split) and is
    written by ``flush`` after each request. ``profiler``: what makes the stage profiler
    (default StageProfiler; run.py passes its own name, which the tests replace)."""
    plan = long_plan(args.long_lens, args.b4_lens, args.agree_len, args.decode_tokens,
                     args.chunk)
    result.update(plan=plan, rows=[], complete=False, chunk=args.chunk)
    # What stays resident after start-up, against vLLM's accounting (kv figures); with the
    # start-up trace on, the history runs on through the warm-up requests.
    resident = resident_trace_mib() if getattr(args, "resident_trace", False) else None
    try:
        result["memory_after_load"] = memory_checkpoint(resident, stop=False)
    except Exception as e:  # noqa: BLE001 - a diagnostic
        result["memory_after_load"] = dict(error=f"{type(e).__name__}: {e}")
    flush()   # the load's figures (KV capacity) survive a run that dies in the warm-up
    t = time.perf_counter()
    prof = (profiler or StageProfiler)() if args.profile_len else None
    warm = prompts([LONG_WARMUP_LEN] * 4, vocab, LONG_WARMUP_SEED)
    try:
        serve_timed(llm, warm, LONG_WARMUP_STEPS, args.chunk, request_timeout(0, 600))
        # Batch 1, under the profiler when one will run: its start-up cost and any failure of
        # it show here, not in a timed request.
        w1 = serve_timed(llm, warm[:1], LONG_WARMUP_STEPS, args.chunk,
                         request_timeout(0, 600), prof=prof)
        if w1.get("stages"):
            result["warmup_profile_parse_s"] = w1["stages"]["parse_s"]
    except Exception as e:  # noqa: BLE001 - the timed requests may still serve
        result["warmup_error"] = f"{type(e).__name__}: {e}"
        prof = None
    result["warmup_seconds"] = time.perf_counter() - t
    try:
        result["memory_after_warmup"] = memory_checkpoint(resident)
    except Exception as e:  # noqa: BLE001 - a diagnostic
        result["memory_after_warmup"] = dict(error=f"{type(e).__name__}: {e}")
        if resident is not None:   # the timed requests must not run under the recording
            import torch
            torch.cuda.memory._record_memory_history(enabled=None)
    flush()
    traced = False   # DEEPINFER_LONG_MEMORY_TRACE applies to the first timed request
    for req in plan:
        n, b = req["prompt_len"], req["batch"]
        if req["kind"] == "agree":
            try:
                result["agree"] = long_agree(llm, vocab, args, n)
            except Exception as e:  # noqa: BLE001
                result["agree_error"] = f"{type(e).__name__}: {e}"
            print(f"agree {n}: {result.get('agree_error') or 'done'}", flush=True)
            flush()
            continue
        profiled = (prof is not None and b == getattr(args, "profile_batch", 1)
                    and n == args.profile_len)
        ps = prompts([n] * b, vocab, LONG_SEEDS[b])
        trace = memory_trace_mib() if not traced else None
        traced = True
        with _MemWindow(trace) as mem:
            try:
                r = serve_timed(llm, ps, args.decode_tokens, args.chunk,
                                request_timeout(n * b, args.request_timeout),
                                prof=prof if profiled else None)
            except Exception as e:  # noqa: BLE001 - the next requests may still serve
                r = dict(error=f"{type(e).__name__}: {e}")
        del ps
        stages = r.pop("stages", None)
        if stages is not None:
            result["stages"] = dict(prompt_len=n, batch=b, **stages)
        # profiled: this TTFT ran under the profiler (its CUPTI overhead is in it)
        row = dict(prompt_len=n, batch=b, profiled=stages is not None, **r, **mem.figures)
        result["rows"].append(row)
        print(f"long {n} x{b}: ttft {row.get('ttft_s')} s, prefill "
              f"{row.get('prefill_tokens_per_s')} tok/s, decode "
              f"{row.get('decode_tokens_per_s')} tok/s, peak "
              f"{row.get('peak_allocated_gib')} GiB, error {row.get('error')}", flush=True)
        flush()
    result["complete"] = True

