"""One vLLM engine of e2e.py --steps spec (spec_step.py), with or without speculative decoding.

    python benchmarks/e2e/run_spec.py --model DIR --mode a100 --form eager --role spec \
        --method dspark --k 5 --out S.json
    python benchmarks/e2e/run_spec.py --model DIR --mode a100 --form eager --role plain \
        --score S.json [...] --out P.json

Modes are run.py's (the environment is set before vLLM is imported, so one process per
engine). Forms: ``eager`` (enforce_eager), ``graphs`` (vLLM's default torch.compile + CUDA
graphs), ``nocompile`` (eager with vLLM's JIT warmup on, compilation mode NONE and no CUDA
graphs, and the sm_80 audit: audit.py's Recorder, with the speculator's ``propose`` recorded
as the region "draft").

--role spec: ``speculative_config`` {method, num_speculative_tokens[, prompt_lookup_min/max]}.
  1. the rule prompts (repetitive: a random segment repeated, so ngram drafts find matches,
     and one without repetition), greedy, ``--gen`` tokens each: ``outputs``, and the
     acceptance over them from vLLM's spec-decode counters (``llm.get_metrics()``:
     vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens / _per_pos);
  2. decode at each of --batches (repetitive prompts of --decode-prompt tokens): tokens/s on
     the engine steps after the last prefill (run.py's window), the engine steps in it, the
     acceptance in it, and per step CUDA-event times (``StepClock``): verify = the model
     runner's execute_model entry to the speculator's propose (target forward of 1 + k tokens
     per request, rejection sampling), draft = propose, step = entry to sample_tokens' return.
--role plain: no speculation.
  1. its own greedy generation of the rule prompts, twice in this process, with the top-2
     logprobs of each generated token (``generate``);
  2. every --score file's prompts + outputs, and its own output (label "plain"), scored
     teacher-forced with prompt_logprobs=2, twice (``scores``: the output positions' rows and
     the prompt positions' largest run-to-run difference);
  3. the same decode measurement (step = execute_model entry to sample_tokens' return).
spec_rule.py judges the outputs; spec_step.py writes the rows.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import statistics
import sys
import time
from itertools import zip_longest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.append(HERE)
from run_common import prompts, write_json  # noqa: E402


def _sibling_run():
    """run.py of this folder (run.MODES, the engine gate, selections). Imported by its path:
    another module named ``run`` earlier on sys.path (benchmarks/run.py, when a test put
    benchmarks/ first) must not stand in for it."""
    import importlib.util
    path = os.path.join(HERE, "run.py")
    for name in ("run", "e2e_run"):
        m = sys.modules.get(name)
        if m is not None and os.path.abspath(getattr(m, "__file__", "") or "") == path:
            return m
    spec = importlib.util.spec_from_file_location("e2e_run", path)
    m = importlib.util.module_from_spec(spec)
    sys.modules["e2e_run"] = m
    spec.loader.exec_module(m)
    return m


run = _sibling_run()

FORMS = ("eager", "graphs", "nocompile")
METHODS = ("dspark", "mtp", "ngram")
# Rule prompts: (length, period of the repeated segment; period == length: no repetition).
RULE_PROMPTS = ((64, 8), (300, 24), (1500, 100), (200, 200))
QUICK_RULE_PROMPTS = ((64, 8), (300, 24), (200, 200))
RULE_GEN, QUICK_RULE_GEN = 48, 32
BATCHES = (1, 4, 16)
DECODE_PROMPT, DECODE_PERIOD = 256, 16
DECODE_TOKENS, QUICK_DECODE_TOKENS = 64, 32
MAX_MODEL_LEN = 4096
MAX_NUM_SEQS = 16
TOPN = 2   # prompt_logprobs / logprobs of the rule
SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
                 "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


# ----------------------------------------------------------------------------- inputs
def speculative_config(method: str | None, k: int, lookup_min: int | None = None,
                       lookup_max: int | None = None) -> dict | None:
    """vLLM's speculative_config for LLM(...); None without speculation."""
    if method is None:
        return None
    if method not in METHODS:
        raise ValueError(f"unknown speculative method {method!r}; known: {', '.join(METHODS)}")
    cfg = {"method": method, "num_speculative_tokens": int(k)}
    if method == "ngram":
        cfg.update(prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max)
    return cfg


def repetitive(lens_periods, vocab: int, seed: int) -> list[list[int]]:
    """Prompts of the given lengths, each a random segment of its period repeated."""
    segs = prompts([p for _, p in lens_periods], vocab, seed)
    return [(seg * (n // len(seg) + 1))[:n] for seg, (n, _) in zip(segs, lens_periods)]


def digest(ps: list[list[int]]) -> str:
    return hashlib.sha1(json.dumps(ps).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- counters
def spec_counters(llm) -> dict | None:
    """vLLM's spec-decode counters summed over engines (None: metrics unavailable)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - stat logging off, or no such metrics
        return None
    out = dict(drafts=0, draft_tokens=0, accepted=0, per_pos=[])
    for m in metrics:
        key = SPEC_COUNTERS.get(m.name)
        if key:
            out[key] += int(m.value)
        elif m.name == PER_POS:
            out["per_pos"] = [a + b for a, b in zip_longest(out["per_pos"], list(m.values),
                                                            fillvalue=0)]
    return out


def acceptance(before: dict | None, after: dict | None) -> dict:
    """The counters' change between two snapshots: draft-token acceptance rate, mean
    acceptance length (1 + accepted per draft, vLLM's convention) and per position."""
    if before is None or after is None:
        return dict(acceptance=None, error="no spec-decode metrics (llm.get_metrics)")
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    per = [a - b for a, b in zip_longest(after["per_pos"], before["per_pos"], fillvalue=0)]
    return dict(d, acceptance=d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else None,
                mean_acceptance_length=1 + d["accepted"] / d["drafts"] if d["drafts"] else None,
                per_position=[p / d["drafts"] for p in per] if d["drafts"] else None)


# ----------------------------------------------------------------------------- step clock
def _cuda_event():
    import torch
    return torch.cuda.Event(enable_timing=True)


def _capturing() -> bool:
    import torch
    return bool(torch.cuda.is_current_stream_capturing())


class StepClock:
    """CUDA events per model-runner step while ``on``: at execute_model's entry, around the
    speculator's propose, and at sample_tokens' return (install_hooks places the calls)."""

    def __init__(self, event=_cuda_event, capturing=_capturing):
        self.on, self.records, self._cur = False, [], None
        self._event, self._capturing = event, capturing

    def _rec(self):
        ev = self._event()
        ev.record()
        return ev

    def step_start(self, n_tokens: int, n_reqs: int) -> None:
        self._cur = None
        if self.on and not self._capturing():
            self._cur = dict(n_tokens=n_tokens, n_reqs=n_reqs, start=self._rec())

    def draft_start(self) -> None:
        if self._cur is not None:
            self._cur["draft0"] = self._rec()

    def draft_end(self) -> None:
        if self._cur is not None and "draft0" in self._cur:
            self._cur["draft1"] = self._rec()

    def step_end(self) -> None:
        if self._cur is not None:
            self._cur["end"] = self._rec()
            self.records.append(self._cur)
        self._cur = None

    def summary(self, i0: int, i1: int, n_reqs: int | None = None) -> dict:
        """Medians over the steps recorded in [i0, i1) (of ``n_reqs`` requests, if given)."""
        recs = [r for r in self.records[i0:i1] if n_reqs is None or r["n_reqs"] == n_reqs]
        if not recs:
            return dict(steps=0)
        recs[-1]["end"].synchronize()

        def med(f):
            vals = [f(r) for r in recs]
            vals = [v for v in vals if v is not None]
            return statistics.median(vals) * 1e3 if vals else None   # ms -> us
        return dict(steps=len(recs), tokens_per_step=statistics.median(r["n_tokens"] for r in recs),
                    verify_us=med(lambda r: r["start"].elapsed_time(r.get("draft0", r["end"]))),
                    draft_us=med(lambda r: r["draft0"].elapsed_time(r["draft1"])
                                 if "draft1" in r else None),
                    step_us=med(lambda r: r["start"].elapsed_time(r["end"])))


def install_hooks(clock: StepClock, rec=None, mr=None) -> bool:
    """Wrap vLLM's V2 model runner (vllm.v1.worker.gpu.model_runner): execute_model and
    sample_tokens for the clock, and every speculator it builds (init_speculator) so its
    propose is timed and, with an audit Recorder, recorded as the region "draft". Call before
    the LLM is built. False when that runner cannot be imported."""
    if mr is None:
        try:
            import vllm.v1.worker.gpu.model_runner as mr
        except Exception:  # noqa: BLE001 - no V2 runner: engine-step wall times only
            return False
    cls = mr.GPUModelRunner
    orig_exec, orig_sample, orig_init = cls.execute_model, cls.sample_tokens, mr.init_speculator

    @functools.wraps(orig_exec)
    def execute_model(self, scheduler_output, *a, **k):
        n = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        if n:
            clock.step_start(n, len(getattr(scheduler_output, "num_scheduled_tokens", None) or {}))
        return orig_exec(self, scheduler_output, *a, **k)

    @functools.wraps(orig_sample)
    def sample_tokens(self, *a, **k):
        try:
            return orig_sample(self, *a, **k)
        finally:
            clock.step_end()

    @functools.wraps(orig_init)
    def init_speculator(*a, **k):
        spec = orig_init(*a, **k)
        wrap_propose(spec, clock, rec)
        return spec
    cls.execute_model, cls.sample_tokens = execute_model, sample_tokens
    mr.init_speculator = init_speculator
    return True


def wrap_propose(spec, clock: StepClock, rec=None) -> None:
    if spec is None:
        return
    orig = spec.propose

    def propose(*a, **k):
        region = rec.in_region("draft") if rec is not None else contextlib.nullcontext()
        clock.draft_start()
        with region:
            out = orig(*a, **k)
        clock.draft_end()
        return out
    spec.propose = propose


# ----------------------------------------------------------------------------- serving
def _sp(**kw):
    from vllm import SamplingParams
    return SamplingParams(temperature=0.0, detokenize=False, **kw)


def decode_window(llm, ps, steps: int, clock: StepClock, k: int = 0) -> dict:
    """Decode of the batch ``ps`` on the engine steps after the last prefill (run.py's
    decode_steps_per_s), with the engine steps, the clock's per-step times and the
    spec-decode counters of that window. Up to 1 + k tokens per request per step: max_tokens
    leaves room for (1 + k) tokens in every step, so no request finishes inside it."""
    import torch
    eng = llm.llm_engine
    prefill_steps = -(-sum(len(p) for p in ps) // run.CHUNK) + 2
    cap = (steps + prefill_steps + 2) * (1 + k) + 2
    sp = _sp(max_tokens=cap, min_tokens=cap, ignore_eos=True)
    ids = [f"spec-tput-{time.monotonic_ns()}-{i}" for i in range(len(ps))]
    for rid, p in zip(ids, ps):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    counts = {i: 0 for i in ids}
    t0 = t1 = s0 = s1 = None
    m0 = m1 = c0 = c1 = None
    calls = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            key = o.request_id if o.request_id in counts else next(
                (x for x in ids if o.request_id.startswith(x + "-")), None)
            if key is not None:
                counts[key] = len(o.outputs[0].token_ids)
        calls += t0 is not None and t1 is None
        total = sum(counts.values())
        if t0 is None and all(c >= 1 for c in counts.values()):
            torch.cuda.synchronize()
            c0, m0 = spec_counters(llm), len(clock.records)
            clock.on = True
            t0, s0 = time.perf_counter(), total
        elif t0 is not None and t1 is None and total >= s0 + steps * len(ps):
            torch.cuda.synchronize()
            t1, s1 = time.perf_counter(), total
            clock.on = False
            m1, c1 = len(clock.records), spec_counters(llm)
            eng.abort_request(list(ids))
    clock.on = False
    if t1 is None:
        eng.abort_request(list(ids))   # none may stay to share the next window's steps
        raise RuntimeError(f"decode window not reached: counts {sorted(counts.values())}")
    clk = clock.summary(m0, m1, len(ps))
    n_steps = clk["steps"] or calls
    dt = t1 - t0
    return dict(tokens=s1 - s0, seconds=dt, tokens_per_s=(s1 - s0) / dt,
                engine_steps=n_steps, engine_step_calls=calls,
                engine_step_us=dt / n_steps * 1e6 if n_steps else None,
                tokens_per_request_step=(s1 - s0) / (n_steps * len(ps)) if n_steps else None,
                clock=clk, acceptance=acceptance(c0, c1) if k else None)


def tput(llm, vocab: int, args, clock: StepClock, k: int) -> list[dict]:
    rows = []
    decode_window(llm, repetitive([(DECODE_PROMPT, DECODE_PERIOD)] * 2, vocab, 1), 8, clock, k)
    for b in args.batches:
        ps = repetitive([(args.decode_prompt, DECODE_PERIOD)] * b, vocab, 100 + b)
        try:
            got = [decode_window(llm, ps, args.decode_tokens, clock, k)
                   for _ in range(1 if args.quick else 2)]
            best = max(got, key=lambda r: r["tokens_per_s"])
        except Exception as e:  # noqa: BLE001 - the other batches are still worth having
            rows.append(dict(batch=b, tokens_per_s=None, error=f"{type(e).__name__}: {e}"))
            print(f"decode batch {b}: FAILED {rows[-1]['error']}", flush=True)
            continue
        rows.append(dict(batch=b, prompt_len=args.decode_prompt, windows=len(got), **best))
        c = best["clock"]
        print(f"decode batch {b}: {best['tokens_per_s']:.1f} tok/s, {best['engine_steps']} steps"
              f", verify {c.get('verify_us')} us, draft {c.get('draft_us')} us", flush=True)
    return rows


def position_row(d: dict, given: int) -> list:
    """[top-1, lp, top-2, lp, given, lp, rank] of one logprobs dict (token -> Logprob): vLLM
    reports the top TOPN tokens and the given one, so the two highest are the top-1 and
    top-2 whether or not the given token is among them (ties broken by vLLM's rank)."""
    ranked = sorted(d.items(), key=lambda kv: (-kv[1].logprob,
                                               getattr(kv[1], "rank", None) or 0))
    top2 = ranked[1] if len(ranked) > 1 else None
    g = d.get(given)
    return [ranked[0][0], ranked[0][1].logprob, top2[0] if top2 else None,
            top2[1].logprob if top2 else None, given, g.logprob if g else None,
            getattr(g, "rank", None) if g else None]


def generated_rows(out) -> dict:
    """A greedy output's tokens and, per token, [top-1, lp, top-2, lp, the token's lp]."""
    c = out.outputs[0]
    top = []
    for tok, d in zip(c.token_ids, c.logprobs or []):
        r = position_row(d, tok)
        top.append([r[0], r[1], r[2], r[3], r[5]])
    return dict(tokens=list(c.token_ids), top=top)


def score(llm, ps: list[list[int]], outs: list[list[int]]) -> dict:
    """prompt + output teacher-forced, twice: per run, per sequence, the output positions'
    rows; per sequence the prompt positions' largest difference between the two runs."""
    sp = _sp(max_tokens=1, prompt_logprobs=TOPN)
    seqs = [{"prompt_token_ids": p + o} for p, o in zip(ps, outs)]
    runs, plp = [], []
    for _ in range(2):
        res = llm.generate(seqs, sp, use_tqdm=False)
        runs.append([[position_row(r.prompt_logprobs[i], (p + o)[i])
                      for i in range(len(p), len(p) + len(o))]
                     for r, p, o in zip(res, ps, outs)])
        plp.append([[position_row(r.prompt_logprobs[i], p[i]) if r.prompt_logprobs[i] else None
                     for i in range(1, len(p))] for r, p in zip(res, ps)])
    import spec_rule
    prompt_noise = [max((spec_rule.row_diff(a, b) for a, b in zip(xa, xb) if a and b),
                        default=0.0) for xa, xb in zip(*plp)]
    return dict(runs=runs, prompt_noise=prompt_noise, prompts_digest=digest(ps),
                tokens=[list(o) for o in outs])


def rule_prompts(args, vocab: int) -> list[list[int]]:
    return repetitive(QUICK_RULE_PROMPTS if args.quick else RULE_PROMPTS, vocab, args.seed)


def serve_spec(llm, vocab: int, args, clock: StepClock) -> dict:
    ps = rule_prompts(args, vocab)
    c0 = spec_counters(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        _sp(max_tokens=args.gen, min_tokens=args.gen, ignore_eos=True),
                        use_tqdm=False)
    acc = acceptance(c0, spec_counters(llm))
    return dict(prompts=ps, prompts_digest=digest(ps),
                outputs=[list(o.outputs[0].token_ids) for o in outs], rule_acceptance=acc,
                rows=tput(llm, vocab, args, clock, args.k) if not args.skip_tput else [])


def serve_plain(llm, vocab: int, args, clock: StepClock) -> dict:
    ps = rule_prompts(args, vocab)
    sp = _sp(max_tokens=args.gen, min_tokens=args.gen, ignore_eos=True, logprobs=TOPN)
    gens = [[generated_rows(o) for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp,
                                                      use_tqdm=False)] for _ in range(2)]
    scores = {"plain": score(llm, ps, [g["tokens"] for g in gens[0]])}
    for f in args.score:
        try:
            s = json.load(open(f))
            scores[os.path.splitext(os.path.basename(f))[0]] = score(llm, s["prompts"],
                                                                     s["outputs"])
        except Exception as e:  # noqa: BLE001 - the other files are still worth scoring
            scores[os.path.splitext(os.path.basename(f))[0]] = dict(
                error=f"{type(e).__name__}: {e}")
    return dict(prompts_digest=digest(ps), generate=gens, scores=scores,
                rows=tput(llm, vocab, args, clock, 0) if not args.skip_tput else [])


# ----------------------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=sorted(run.MODES), required=True)
    ap.add_argument("--form", choices=FORMS, default="eager")
    ap.add_argument("--role", choices=("spec", "plain"), required=True)
    ap.add_argument("--method", choices=METHODS, default=None)
    ap.add_argument("--k", type=int, default=0, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=None, help="ngram prompt_lookup_min")
    ap.add_argument("--lookup-max", type=int, default=None, help="ngram prompt_lookup_max")
    ap.add_argument("--score", nargs="*", default=[],
                    help="plain: --role spec results whose outputs to score")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gen", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    ap.add_argument("--decode-prompt", type=int, default=DECODE_PROMPT)
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--skip-tput", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--kv-cache-gib", type=float, default=None)
    ap.add_argument("--beside", type=int, default=1,
                    help="engines the caller runs at once (recorded: timings beside others)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    if args.role == "spec" and (args.method is None or args.k <= 0):
        ap.error("--role spec needs --method and --k >= 1")
    if args.role == "plain" and args.method is not None:
        ap.error("--role plain serves without speculation (no --method)")
    if args.gen is None:
        args.gen = QUICK_RULE_GEN if args.quick else RULE_GEN
    if args.decode_tokens is None:
        args.decode_tokens = QUICK_DECODE_TOKENS if args.quick else DECODE_TOKENS
    if args.role == "plain":
        args.k = 0
    return args


def engine_kwargs(args) -> dict:
    """LLM(...) arguments besides the model (run.py's, with speculation and stat logging)."""
    kw = dict(language_model_only=True, max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=run.CHUNK, enable_chunked_prefill=True,
              gpu_memory_utilization=args.gpu_mem, max_num_seqs=MAX_NUM_SEQS, seed=args.seed,
              enable_prefix_caching=False, disable_log_stats=False)
    if args.form == "eager":
        kw["enforce_eager"] = True
    elif args.form == "nocompile":
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "NONE"}
    if args.kv_cache_gib is not None:
        kw["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    sc = speculative_config(args.method if args.role == "spec" else None, args.k,
                            args.lookup_min, args.lookup_max)
    if sc is not None:
        kw["speculative_config"] = sc
    return kw


def main() -> int:
    args = parse_args()
    os.environ.update(run.MODES[args.mode])
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # engine (and model runner) here
    rec = None
    if args.form == "nocompile":
        from audit import Recorder
        rec = Recorder().install()
    clock = StepClock()
    hooked = install_hooks(clock, rec)
    import torch
    import vllm
    from vllm import LLM
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    has_tok = any(os.path.exists(os.path.join(args.model, f))
                  for f in ("tokenizer.json", "tokenizer_config.json"))
    kw = engine_kwargs(args)
    gate = run._EngineGate(enabled=args.kv_cache_gib is None)
    gate.acquire()
    t0 = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=not has_tok, **kw)
    load_s = time.perf_counter() - t0
    gate.release()
    from vllm.platforms import current_platform
    from vllm.deepinfer import arch
    import triton
    result = dict(mode=args.mode, form=args.form, role=args.role, method=args.method, k=args.k,
                  speculative_config=kw.get("speculative_config"), model=args.model,
                  model_config=cfg, load_seconds=load_s, hooks=hooked, beside=args.beside,
                  quick=args.quick, max_num_seqs=MAX_NUM_SEQS,
                  env={k: os.environ.get(k) for k in sorted(os.environ)
                       if k.startswith(("DEEPINFER_", "VLLM_", "CUBLAS_"))},
                  gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, vllm=vllm.__version__,
                  capability_seen_by_vllm=list(current_platform.get_device_capability()),
                  deepinfer_variant=arch.current().name,
                  commit=os.environ.get("DEEPINFER_COMMIT", ""))
    ctx = rec.serving() if rec is not None else contextlib.nullcontext()
    with ctx:
        serve = serve_spec if args.role == "spec" else serve_plain
        result.update(serve(llm, vocab, args, clock))
    if rec is not None:
        from audit import check
        result["audit"] = check(rec)
        result["selections"] = run.selections(llm)
        print("audit failed:", result["audit"]["failed"] or "none", flush=True)
    write_json(args.out, result)
    print(f"{args.mode} {args.form} {args.role} {args.method or ''}: load {load_s:.1f}s -> "
          f"{args.out}", flush=True)
    gate.acquire()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
