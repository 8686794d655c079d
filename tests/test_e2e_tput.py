"""benchmarks/e2e/run.py's decode timing on CPU with a stand-in engine that prefills in chunks
and overlaps the first requests' decode with the later prefills, as vLLM's chunked prefill does:
the timed window must hold only steps where the whole batch decodes."""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _run_module():
    spec = importlib.util.spec_from_file_location("e2e_run_tput", REPO / "benchmarks/e2e/run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Engine:
    """Prefills CHUNK prompt tokens per step in arrival order; a request whose prompt is done
    gets its first token in that step and one more token in every later step."""

    def __init__(self, chunk: int):
        self.chunk, self.reqs, self.log = chunk, {}, []

    def add_request(self, rid, prompt, sp):
        self.reqs[rid] = dict(left=len(prompt["prompt_token_ids"]), toks=0, max=sp.max_tokens)
        return rid + "-0a1b"   # vLLM returns its internal id; outputs carry the given one

    def has_unfinished_requests(self):
        return any(r["toks"] < r["max"] for r in self.reqs.values())

    def abort_request(self, ids):
        for i in ids:
            self.reqs.pop(i, None)

    def step(self):
        budget, decoding = self.chunk, 0
        for r in self.reqs.values():
            if r["left"] == 0 and r["toks"] < r["max"]:
                r["toks"] += 1
                decoding += 1
        for r in self.reqs.values():
            if r["left"] and budget:
                take = min(budget, r["left"])
                r["left"] -= take
                budget -= take
                if r["left"] == 0:
                    r["toks"] = 1
        self.log.append((decoding, budget < self.chunk))
        return [types.SimpleNamespace(request_id=k, outputs=[types.SimpleNamespace(
            token_ids=[0] * r["toks"])]) for k, r in self.reqs.items()]


@pytest.mark.parametrize("batch,prompt", [(1, 512), (8, 512), (64, 512), (3, 5000)])
def test_decode_window_is_pure_decode(monkeypatch, batch, prompt):
    run = _run_module()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        SamplingParams=lambda **kw: types.SimpleNamespace(**kw)))
    eng = _Engine(run.CHUNK)
    llm = types.SimpleNamespace(llm_engine=eng)
    steps = 16
    r = run.decode_steps_per_s(llm, [[1] * prompt] * batch, steps)
    assert r["tokens"] == steps * batch
    assert r["tokens_per_s"] > 0
    # The stand-in's log: the steps after the last prefill decode the whole batch.
    last_prefill = max(i for i, (_, pre) in enumerate(eng.log) if pre)
    window = eng.log[last_prefill + 1:last_prefill + 1 + steps]
    assert len(window) == steps and all(d == batch and not pre for d, pre in window)


def test_decode_window_not_reached_is_an_error(monkeypatch):
    run = _run_module()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        SamplingParams=lambda **kw: types.SimpleNamespace(**kw)))

    class Stalled(_Engine):
        def step(self):   # never produces a token, then gives up
            for r in self.reqs.values():
                r["max"] -= 1
            return []

    llm = types.SimpleNamespace(llm_engine=Stalled(run.CHUNK))
    with pytest.raises(RuntimeError, match="decode window not reached"):
        run.decode_steps_per_s(llm, [[1] * 10] * 2, 4)


def test_agree_repeats_the_generation_in_the_same_process(monkeypatch):
    """--repeat 2: agree() generates the same prompts twice and keeps the second as
    ``repeats``; a stand-in engine whose second generation differs shows up there."""
    run = _run_module()
    # agree() resets vllm.deepinfer.yoco's totals: import it before vllm is stood in for
    # (alone, this test would otherwise find no vllm.deepinfer under the stand-in)
    from vllm.deepinfer import yoco  # noqa: F401
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        SamplingParams=lambda **kw: types.SimpleNamespace(**kw)))
    lp = lambda v: types.SimpleNamespace(logprob=v)  # noqa: E731

    class LLM:
        calls = 0

        def generate(self, prompts, sp, use_tqdm=False):
            LLM.calls += 1
            shift = 0.0 if LLM.calls == 1 else -0.25
            return [types.SimpleNamespace(
                prompt_logprobs=[None] + [{t: lp(-1.0 + shift)} for t in p["prompt_token_ids"][1:]],
                outputs=[types.SimpleNamespace(token_ids=[7], logprobs=[{7: lp(-0.5)}])])
                for p in prompts]
    args = types.SimpleNamespace(lens=[3, 5], seed=0, gen=1, repeat=1)
    once = run.agree(LLM(), 1000, args)
    assert "repeats" not in once and LLM.calls == 1
    LLM.calls = 0
    args.repeat = 2
    twice = run.agree(LLM(), 1000, args)
    assert LLM.calls == 2 and len(twice["repeats"]) == 1
    first, second = twice["prompts"], twice["repeats"][0]
    assert [p["prompt_len"] for p in first] == [p["prompt_len"] for p in second] == [3, 5]
    assert first[0]["prompt"][0][1] == -1.0 and second[0]["prompt"][0][1] == -1.25
