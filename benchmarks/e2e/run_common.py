"""What the tasks of benchmarks/e2e/run.py share: the prompts they serve (reference.py draws
the same ones, through run.prompts), the agreement rows' layout (the agree task's and the long
task's agreement request) and the writer of their JSON outputs. Standard library only at
import; torch is imported where the prompts are drawn."""
from __future__ import annotations

import json
import os


def prompts(lens, vocab: int, seed: int) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    # Away from the special ids at both ends of the vocabulary.
    return [torch.randint(100, vocab - 100, (n,), generator=g).tolist() for n in lens]


def top_logprob(lp_dict) -> tuple[int, float]:
    tok = max(lp_dict, key=lambda t: lp_dict[t].logprob)
    return tok, lp_dict[tok].logprob


def agree_rows(ps, outs) -> list[dict]:
    """agree's layout, per prompt: ``prompt`` rows [top-1 token, its logprob, the prompt
    token's logprob] for positions 1 .. len - 1, ``generated`` rows [token, logprob, the
    top-K (token, logprob) pairs]."""
    rows = []
    for p, o in zip(ps, outs):
        plp = o.prompt_logprobs or []
        prompt_pos = []
        for i in range(1, len(p)):
            d = plp[i] if i < len(plp) else None
            if not d:
                continue
            top_tok, top_lp = top_logprob(d)
            prompt_pos.append([top_tok, top_lp, d[p[i]].logprob if p[i] in d else None])
        c = o.outputs[0]
        gen = []
        for tok, d in zip(c.token_ids, c.logprobs or []):
            gen.append([tok, d[tok].logprob,
                        sorted(((t, v.logprob) for t, v in d.items()), key=lambda x: -x[1])])
        rows.append(dict(prompt_len=len(p), prompt=prompt_pos, generated=gen))
    return rows


def write_json(path, obj) -> None:
    """Write JSON through a temporary file and a rename: a reader (or a run killed while it
    writes) sees the previous whole file or the new one, never half of one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)
