"""A stand-in ``vllm`` package in which benchmarks/e2e/run_spec.py's main runs unchanged in a
subprocess (tests/test_e2e_spec.py). Not collected by pytest.

The stand-in LLM records the keyword arguments it was built with (FAKE_LLM_LOG), builds a
model runner of the stand-in ``vllm.v1.worker.gpu.model_runner`` (so run_spec's hooks wrap it
as they wrap vLLM's V2 runner) with a speculator when ``speculative_config`` is given, and
generates greedily from a fixed next-token function of the context: a speculative engine
produces the same tokens as a plain one, ``accept`` extra tokens per decode step, and counts
drafts as vLLM's spec-decode counters do. Prompt and sample logprobs report the top-2 and the
given token; each generate call shifts them by FAKE_NOISE x (call number % 2), so two runs of
one engine differ by that much. torch.cuda's events, sync and device name are stood in for.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

INIT = '''
"""Stand-in vLLM for run_spec.py (tests/spec_fakes.py)."""
import json
import os
import types

import torch


class _Ev:
    n = [0.0]

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        _Ev.n[0] += 1.0
        self.t = _Ev.n[0]

    def elapsed_time(self, other):
        return other.t - self.t

    def synchronize(self):
        pass


torch.cuda.Event = _Ev
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.is_current_stream_capturing = lambda: False
torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
__version__ = "0.33.0"
NOISE = float(os.environ.get("FAKE_NOISE", "0.001"))
ACCEPT = int(os.environ.get("FAKE_ACCEPT", "2"))


def truth(ctx):
    return (sum(ctx[-3:]) * 31 + len(ctx)) % 500 + 100


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.__dict__.setdefault("logprobs", None)
        self.__dict__.setdefault("prompt_logprobs", None)


class _LP:
    def __init__(self, v, r):
        self.logprob, self.rank = v, r


def _dist(ctx, given, shift):
    top = truth(ctx)
    d = {top: _LP(-0.5 + shift, 1), top + 1: _LP(-1.7 + shift, 2)}
    if given not in d:
        d[given] = _LP(-6.0 + shift, 40)
    return d


class _Engine:
    def __init__(self, llm):
        self.llm, self.reqs = llm, {}

    def add_request(self, rid, prompt, sp):
        self.reqs[rid] = dict(ctx=list(prompt["prompt_token_ids"]), n=0, max=sp.max_tokens,
                              left=len(prompt["prompt_token_ids"]))

    def has_unfinished_requests(self):
        return any(r["n"] < r["max"] for r in self.reqs.values())

    def abort_request(self, ids):
        for i in ids:
            self.reqs.pop(i, None)

    def step(self):
        live = {k: r for k, r in self.reqs.items() if r["n"] < r["max"]}
        dec = [r for r in live.values() if not r["left"]]
        so = types.SimpleNamespace(
            total_num_scheduled_tokens=max(1, len(dec) * (1 + self.llm.k)),
            num_scheduled_tokens={k: 1 for k, r in live.items() if not r["left"]} or {"p": 1})
        self.llm.runner.execute_model(so)
        self.llm.runner.sample_tokens(None)
        for r in dec:
            for _ in range(1 + (ACCEPT if self.llm.k else 0)):
                if r["n"] < r["max"]:
                    r["ctx"].append(truth(r["ctx"]))
                    r["n"] += 1
            if self.llm.k:
                self.llm.counts["drafts"] += 1
                self.llm.counts["draft_tokens"] += self.llm.k
                self.llm.counts["accepted"] += ACCEPT
        for r in live.values():   # the whole prompt in one step
            if r["left"]:
                r["left"] = 0
                r["ctx"].append(truth(r["ctx"]))
                r["n"] = 1
        return [types.SimpleNamespace(request_id=k, outputs=[types.SimpleNamespace(
            token_ids=[0] * r["n"])]) for k, r in self.reqs.items()]


class LLM:
    def __init__(self, model=None, speculative_config=None, **kw):
        log = os.environ.get("FAKE_LLM_LOG")
        if log:
            with open(log, "a") as f:
                f.write(json.dumps(dict(kw, model=model,
                                        speculative_config=speculative_config)) + "\\n")
        from vllm.v1.worker.gpu import model_runner as mr
        self.runner = mr.GPUModelRunner()
        self.k = (speculative_config or {}).get("num_speculative_tokens", 0)
        self.runner.speculator = mr.init_speculator(None, None, None) if self.k else None
        self.counts = dict(drafts=0, draft_tokens=0, accepted=0)
        self.llm_engine = _Engine(self)
        self.calls = 0

    def get_metrics(self):
        c = self.counts
        out = [types.SimpleNamespace(name="vllm:spec_decode_num_" + n, value=c[k])
               for n, k in (("drafts", "drafts"), ("draft_tokens", "draft_tokens"),
                            ("accepted_tokens", "accepted"))]
        return out + [types.SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos",
                                            values=[c["accepted"]] + [0] * (self.k - 1))]

    def generate(self, prompts, sp, use_tqdm=False):
        shift = NOISE * (self.calls % 2)
        self.calls += 1
        outs = []
        for p in prompts:
            ctx = list(p["prompt_token_ids"])
            plp = None
            if sp.prompt_logprobs:
                plp = [None] + [_dist(ctx[:i], ctx[i], shift) for i in range(1, len(ctx))]
            toks, lps = [], []
            for _ in range(sp.max_tokens):
                t = truth(ctx)
                if sp.logprobs:
                    lps.append(_dist(ctx, t, shift))
                toks.append(t)
                ctx.append(t)
            if self.k:   # as the engine's steps would count them
                n = -(-(sp.max_tokens - 1) // (1 + ACCEPT))
                for key, v in (("drafts", n), ("draft_tokens", n * self.k),
                               ("accepted", n * ACCEPT)):
                    self.counts[key] += v
            outs.append(types.SimpleNamespace(prompt_logprobs=plp, outputs=[
                types.SimpleNamespace(token_ids=toks, logprobs=lps if sp.logprobs else None)]))
        return outs
'''

RUNNER = '''
class GPUModelRunner:
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        return None

    def sample_tokens(self, grammar_output=None):
        if self.speculator is not None:
            self.speculator.propose()
        return None


class _Speculator:
    def propose(self, *a, **k):
        return None


def init_speculator(vllm_config, device, req_states):
    return _Speculator()
'''

PLATFORMS = '''
import types
current_platform = types.SimpleNamespace(get_device_capability=lambda: (8, 0))
'''

ARCH = '''
import types
def current():
    return types.SimpleNamespace(name="sm80")
'''


def write_fake_vllm(root: Path) -> Path:
    """The stand-in package under ``root`` (put ``root`` first on PYTHONPATH)."""
    files = {"vllm/__init__.py": INIT, "vllm/platforms/__init__.py": PLATFORMS,
             "vllm/deepinfer/__init__.py": "", "vllm/deepinfer/arch.py": ARCH,
             "vllm/v1/__init__.py": "", "vllm/v1/worker/__init__.py": "",
             "vllm/v1/worker/gpu/__init__.py": "", "vllm/v1/worker/gpu/model_runner.py": RUNNER}
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root
