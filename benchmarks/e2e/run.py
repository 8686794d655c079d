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
import contextlib
import json
import os
import sys
import time

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


def prompts(lens, vocab: int, seed: int) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    # Away from the special ids at both ends of the vocabulary.
    return [torch.randint(100, vocab - 100, (n,), generator=g).tolist() for n in lens]


def _top(lp_dict) -> tuple[int, float]:
    tok = max(lp_dict, key=lambda t: lp_dict[t].logprob)
    return tok, lp_dict[tok].logprob


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
    repeats = [_agree_rows(ps, gen()) for _ in range(max(0, getattr(args, "repeat", 1) - 1))]
    out = dict(seconds=dt, prompts=_agree_rows(ps, outs), yoco_totals=yoco.totals())
    if repeats:
        out["repeats"] = repeats
    if getattr(args, "toggle_yoco", False):
        # Reuse is decided per call from the environment (vllm.deepinfer.yoco.enabled), and
        # the engine runs in this process: the same engine, the same prompts, reuse off.
        prev = os.environ.get("DEEPINFER_YOCO_REUSE")
        os.environ["DEEPINFER_YOCO_REUSE"] = "0"
        try:
            out["noyoco_in_process"] = _agree_rows(ps, gen())
        except Exception as e:  # noqa: BLE001 - the rows above are still worth having
            out["noyoco_in_process_error"] = f"{type(e).__name__}: {e}"
        finally:
            if prev is None:
                os.environ.pop("DEEPINFER_YOCO_REUSE", None)
            else:
                os.environ["DEEPINFER_YOCO_REUSE"] = prev
    return out


def _agree_rows(ps, outs) -> list[dict]:
    rows = []
    for p, o in zip(ps, outs):
        plp = o.prompt_logprobs or []
        prompt_pos = []
        for i in range(1, len(p)):
            d = plp[i] if i < len(plp) else None
            if not d:
                continue
            top_tok, top_lp = _top(d)
            prompt_pos.append([top_tok, top_lp, d[p[i]].logprob if p[i] in d else None])
        c = o.outputs[0]
        gen = []
        for tok, d in zip(c.token_ids, c.logprobs or []):
            gen.append([tok, d[tok].logprob,
                        sorted(((t, v.logprob) for t, v in d.items()), key=lambda x: -x[1])])
        rows.append(dict(prompt_len=len(p), prompt=prompt_pos, generated=gen))
    return rows


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


# --------------------------------------------------------------------------- task long
# Long-context serving (e2e.py --steps long): one engine serves every request of its plan in
# one start and rewrites its output file after each (write_json), so a run stopped at any
# point leaves on disk the requests it finished (result "complete": false).
#
# Prefill chunk (max_num_batched_tokens) of the long task: 8,192, as in the bdbe637 runs that
# served 1M-token prompts (a 1M prefill is 128 engine steps, each chunk's activations fit in
# the memory vLLM leaves outside gpu_memory_utilization 0.80).
LONG_CHUNK = 8192
# Warm-up before the timed requests (served, not timed). With --eager vLLM's JIT warmup is
# off, and the upstream mode skips DeepGEMM's (VLLM_DEEP_GEMM_WARMUP=skip, main), so kernels
# compile on first use; this makes that happen before any clock runs, for a batch of 4 and
# of 1. 12,288 tokens: one full chunk and a partial one, then mixed prefill and decode steps
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


def write_json(path, obj) -> None:
    """Write JSON through a temporary file and a rename: a reader (or a run killed while it
    writes) sees the previous whole file or the new one, never half of one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


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


class _MemWindow:
    """Peak memory of one request: the caching allocator's unused blocks are released and the
    peaks reset before it, so each request's figures are its own whatever ran before."""

    def __enter__(self):
        import torch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.figures: dict = {}
        return self

    def __exit__(self, *exc):
        import torch
        try:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            self.figures = dict(peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                                peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                                device_used_gib=(total - free) / GIB)
        except Exception as e:  # noqa: BLE001 - a dead CUDA context: the error says why
            self.figures = dict(memory_error=f"{type(e).__name__}: {e}")
        return False


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
    return dict(available_kv_cache_memory_bytes=getattr(
        worker, "available_kv_cache_memory_bytes", None), num_blocks=cfg.num_blocks,
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
    (row,) = _agree_rows([p], outs)
    keep = row["prompt"][-args.agree_last:]
    return dict(seconds=dt, last=args.agree_last, prompts=[dict(
        prompt_len=n, first_position=n - len(keep), prompt=keep, generated=row["generated"])])


def long_task(llm, vocab: int, args, result: dict, flush) -> None:
    """--task long: the warm-up, then every request of long_plan in order; ``result`` gains
    "rows" (one per timed request), "agree", "stages" (the profiled prefill's split) and is
    written by ``flush`` after each request."""
    plan = long_plan(args.long_lens, args.b4_lens, args.agree_len, args.decode_tokens,
                     args.chunk)
    result.update(plan=plan, rows=[], complete=False, chunk=args.chunk)
    flush()   # the load's figures (KV capacity) survive a run that dies in the warm-up
    t = time.perf_counter()
    prof = StageProfiler() if args.profile_len else None
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
    flush()
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
        profiled = prof is not None and b == 1 and n == args.profile_len
        ps = prompts([n] * b, vocab, LONG_SEEDS[b])
        with _MemWindow() as mem:
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
