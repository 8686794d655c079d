"""Agreement between two end-to-end runs of one model (run.py --task agree outputs).

Per pair: prompt positions (teacher-forced, so every position counts): share of positions
whose top-1 token agrees, max and mean |difference| of the logprob each run gives the actual
next prompt token. Generated tokens: the greedy sequences are compared token by token; the
logprobs of the chosen tokens are compared up to the first divergence (after it the runs
condition on different text). ``first_divergence``: per prompt, the first generated token
that differs; ``first_prompt_difference``: per prompt, the first prompt position whose
logprob differs at all (None: none).

    python benchmarks/e2e/compare.py A.json B.json
"""
from __future__ import annotations

import json
import sys


def pair(a: dict, b: dict) -> dict:
    n = agree = 0
    dmax = dsum = 0.0
    gen_n = gen_same = 0
    gen_dmax = 0.0
    first_div, first_prompt = [], []
    for pa, pb in zip(a["prompts"], b["prompts"]):
        assert pa["prompt_len"] == pb["prompt_len"], "runs used different prompts"
        first = None
        for i, ((ta, _, la), (tb, _, lb)) in enumerate(zip(pa["prompt"], pb["prompt"])):
            n += 1
            agree += ta == tb
            if la is not None and lb is not None:
                d = abs(la - lb)
                dmax, dsum = max(dmax, d), dsum + d
                if d and first is None:
                    first = i
        first_prompt.append(first)
        div = None
        for i, (ga, gb) in enumerate(zip(pa["generated"], pb["generated"])):
            gen_n += 1
            if ga[0] != gb[0]:
                div = i if div is None else div
            elif div is None:
                gen_same += 1
                gen_dmax = max(gen_dmax, abs(ga[1] - gb[1]))
        first_div.append(div)
    return dict(prompt_positions=n, top1_agree=agree / max(n, 1), max_abs_dlogprob=dmax,
                mean_abs_dlogprob=dsum / max(n, 1), generated_tokens=gen_n,
                generated_same_prefix=gen_same, generated_max_abs_dlogprob=gen_dmax,
                first_divergence=first_div, first_prompt_difference=first_prompt)


def identical(p: dict) -> bool:
    """A pair() result's verdict of bit-identity: every prompt position and every generated
    token and logprob."""
    return (p["max_abs_dlogprob"] == 0.0 and p["top1_agree"] == 1.0
            and all(d is None for d in p["first_divergence"])
            and p["generated_max_abs_dlogprob"] == 0.0)


def spread(r: dict) -> dict:
    """How far the logits are from uniform: mean top-1 logprob of the prompt positions."""
    tops = [t[1] for p in r["prompts"] for t in p["prompt"]]
    return dict(mean_top1_logprob=sum(tops) / max(len(tops), 1))


if __name__ == "__main__":
    a, b = (json.load(open(f)) for f in sys.argv[1:3])
    print(json.dumps(dict(pair=f"{a['mode']} vs {b['mode']}", **pair(a, b),
                          spread_a=spread(a), spread_b=spread(b)), indent=1))
