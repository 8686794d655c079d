#!/usr/bin/env python3
"""Load checkpoints written by tools/make_checkpoint.py in vLLM and generate a few tokens.

    python benchmarks/e2e/check_load.py CHECKPOINT_DIR [CHECKPOINT_DIR ...]
                                        [--tokens 8] [--json OUT.json] [--no-track]

Needs a CUDA GPU and vLLM 0.33.0 installed (with or without this project's overlay).
Each checkpoint runs in its own Python process (a fresh engine each time), with
VLLM_USE_FLASHINFER_SAMPLER=0 and VLLM_ENABLE_V1_MULTIPROCESSING=0 unless the caller set
them, as

    vllm.LLM(model=DIR, skip_tokenizer_init=True, language_model_only=True,
             enforce_eager=True, max_model_len=4096, gpu_memory_utilization=0.5,
             max_num_seqs=8, seed=0,
             model_loader_extra_config={"enable_weights_track": True})

``enable_weights_track`` makes vLLM's loader raise on every parameter the checkpoint
left unset (it only does so for unquantized models by default); a tensor name the model
does not know raises in ``load_weights`` either way. A failure prints the exception
text in full.

Then two prompts of token ids (40 and 2100 tokens, see prompts()) are generated
greedily (8 tokens, logprobs=5, ignore_eos) and the script reports, per prompt, the tokens and the mean top-1
logprob against -ln(vocab), the logprob of a uniform distribution: random weights at
realistic scales give a peaked distribution (top-1 several nats above uniform);
vLLM's ``load_format="dummy"`` weights give a nearly uniform one. The verdict line
says SPREAD when the mean top-1 logprob is at least SPREAD_NATS above -ln(vocab).
Exit status 0 only if every checkpoint loaded, generated and showed spread.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

# A checkpoint "has spread" when its mean top-1 logprob is this many nats above the
# uniform -ln(vocab): e^2 ~ 7x more likely than uniform. The make_checkpoint head scale
# (logits of std ~3) puts it near 8-9 nats above; dummy weights stay within ~0.1.
SPREAD_NATS = 2.0
# Longer than 4 x 512 tokens: the C4A indexer (top-k 512 of n/4 entries) then selects too.
LONG_PROMPT = 2100
# The engine settings of the end-to-end comparison runs.
LLM_KWARGS = dict(skip_tokenizer_init=True, language_model_only=True, enforce_eager=True,
                  max_model_len=4096, gpu_memory_utilization=0.5, max_num_seqs=8, seed=0)


def prompts(vocab: int) -> list[list[int]]:
    """Two deterministic prompts of token ids in [2, min(vocab, 129000)), below every
    image-sentinel id (V4: 129257, V4.1: 129264) and the eos id 1: 40 tokens (sliding
    window only) and LONG_PROMPT tokens, past the 128-token window and past the indexer's
    top-k of 512 compressed entries at ratios 1, 2 and 4, so the indexer selects."""
    top = min(vocab, 129000) - 2
    a = [(7 + 31 * i) % top + 2 for i in range(40)]
    b = [(11 + 97 * i * i) % top + 2 for i in range(LONG_PROMPT)]
    return [a, b]


def vocab_size(ckpt: Path) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    return int(cfg.get("text_config", cfg).get("vocab_size") or cfg["vocab_size"])


def run_one(ckpt: Path, tokens: int, track: bool) -> dict:
    """Load and generate in this process; returns the summary dict."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    res: dict = {"checkpoint": str(ckpt), "loaded": False, "generated": False}
    t0 = time.time()
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as e:  # noqa: BLE001
        res["error"] = f"vllm import failed: {type(e).__name__}: {e}"
        return res
    kwargs = dict(LLM_KWARGS)
    if track:
        kwargs["model_loader_extra_config"] = {"enable_weights_track": True}
    try:
        llm = LLM(model=str(ckpt), **kwargs)
    except BaseException as e:  # noqa: BLE001 - report everything, in full
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        return res
    res["loaded"] = True
    res["load_s"] = round(time.time() - t0, 1)
    try:
        res["attention"] = sorted(set(llm.apply_model(
            lambda m: type(next(mod for name, mod in m.named_modules()
                                if name.endswith("layers.0.attn"))).__name__)))
    except Exception as e:  # noqa: BLE001 - informative only
        res["attention"] = f"unknown ({type(e).__name__})"
    V = vocab_size(ckpt)
    uniform = -math.log(V)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=5, ignore_eos=True,
                        detokenize=False)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(V)], sp,
                            use_tqdm=False)
    except BaseException as e:  # noqa: BLE001
        res["error"] = f"generate: {type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        return res
    res["generated"] = True
    res["uniform_logprob"] = round(uniform, 3)
    res["prompts"] = []
    for out in outs:
        c = out.outputs[0]
        top1 = [max(step.values(), key=lambda lp: lp.logprob).logprob for step in c.logprobs]
        top5 = [{int(t): round(lp.logprob, 4) for t, lp in step.items()} for step in c.logprobs]
        res["prompts"].append({"tokens": list(c.token_ids),
                               "mean_top1_logprob": round(sum(top1) / len(top1), 3),
                               "top5": top5})
    worst = min(p["mean_top1_logprob"] for p in res["prompts"])
    res["spread_nats"] = round(worst - uniform, 3)
    res["spread"] = worst - uniform >= SPREAD_NATS
    res["total_s"] = round(time.time() - t0, 1)
    return res


def report(res: dict) -> None:
    name = res["checkpoint"]
    if not res["loaded"]:
        print(f"[{name}] LOAD FAILED: {res.get('error')}\n{res.get('traceback', '')}")
        return
    if not res["generated"]:
        print(f"[{name}] loaded in {res['load_s']} s, GENERATE FAILED: {res.get('error')}\n"
              f"{res.get('traceback', '')}")
        return
    print(f"[{name}] loaded in {res['load_s']} s, attention {res.get('attention')}")
    for i, p in enumerate(res["prompts"]):
        print(f"  prompt {i}: tokens {p['tokens']}  mean top-1 logprob "
              f"{p['mean_top1_logprob']} (uniform {res['uniform_logprob']})")
    verdict = "SPREAD" if res["spread"] else "FLAT"
    print(f"  {verdict}: worst mean top-1 logprob is {res['spread_nats']} nats above uniform "
          f"(threshold {SPREAD_NATS})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--json", type=Path, help="write every summary to this file")
    ap.add_argument("--no-track", action="store_true",
                    help="leave vLLM's weight tracking at its default")
    ap.add_argument("--_child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for c in args.checkpoints:
        if not (c / "config.json").is_file():
            print(f"error: {c}: no config.json (write one with tools/make_checkpoint.py)",
                  file=sys.stderr)
            return 2
    if args._child is not None:
        res = run_one(args.checkpoints[0], args.tokens, not args.no_track)
        args._child.write_text(json.dumps(res))
        return 0
    results = []
    for c in args.checkpoints:
        out = Path(f"/tmp/check_load_{os.getpid()}_{len(results)}.json")
        cmd = [sys.executable, __file__, str(c), "--tokens", str(args.tokens), "--_child",
               str(out)] + (["--no-track"] if args.no_track else [])
        rc = subprocess.run(cmd).returncode
        if out.is_file():
            res = json.loads(out.read_text())
            out.unlink()
        else:
            res = {"checkpoint": str(c), "loaded": False, "generated": False,
                   "error": f"child process exited {rc} without a result"}
        results.append(res)
        report(res)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    ok = all(r["loaded"] and r["generated"] and r.get("spread") for r in results)
    print("ALL OK" if ok else "SOME FAILED: " + ", ".join(
        r["checkpoint"] for r in results
        if not (r["loaded"] and r["generated"] and r.get("spread"))))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
