"""The OpenAI API of a running ``vllm serve``, through the ``openai`` Python client, for
benchmarks/e2e/serve.py: completions and chat completions, streamed and not, with logprobs,
n > 1 and a stop string; then bad requests (a prompt over max_model_len, malformed JSON, an
unknown model name, max_tokens 0), each of which must get a 4xx while the server keeps
answering /health with 200. One row per check (kernel="serve_api").

Prompts are words of the checkpoint tokenizer's vocabulary (tools/ckptgen/tokenizer.py:
id i is the word "t{i}" away from the special ids at the low end), so the prompt token count
is known: the words plus the BOS the server's tokenizer adds. Generation runs with
ignore_eos (vLLM's extension), so every request produces exactly max_tokens tokens.
"""
from __future__ import annotations

import json
import math
import time

from serve_proc import health, http

GEN = 12          # tokens per generated choice
CHAT_GEN = 8
PROMPT_WORDS = 32
FIRST_WORD = 1000   # prompt words t1000, t1001, ... (ids far from the special ones)
TIMEOUT_S = 120.0
STOP_TRIES = 3


def words(n: int, start: int = FIRST_WORD) -> str:
    return " ".join(f"t{start + i}" for i in range(n))


def _client(base_url: str, timeout: float):
    from openai import OpenAI
    return OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0, timeout=timeout)


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def _greedy_top(tok_lp: float, tops: list[float]) -> bool:
    """A greedy token's logprob is the largest of its position's top logprobs."""
    return bool(tops) and math.isfinite(tok_lp) and tok_lp <= 0 and \
        abs(tok_lp - max(tops)) <= 1e-3


class Checks:
    """The checks against one server; ``run()`` returns the rows."""

    def __init__(self, base_url: str, model: str, max_model_len: int, mode: str,
                 model_label: str, timeout: float = TIMEOUT_S,
                 deadline: float = float("inf")):
        self.base, self.model, self.max_model_len = base_url, model, max_model_len
        self.mode, self.label, self.deadline = mode, model_label, deadline
        self.c = _client(base_url, max(10.0, min(timeout, deadline - time.time())))
        self.rows: list[dict] = []

    def _row(self, check: str, fn) -> dict:
        t0 = time.monotonic()
        row = dict(kernel="serve_api", variant=self.mode,
                   shape=dict(model=self.label, check=check))
        if time.time() > self.deadline:
            row.update(passed=False, error="not run: the deadline", detail={}, seconds=0.0)
            self.rows.append(row)
            return row
        try:
            detail = fn() or {}
            row.update(passed=bool(detail.pop("_passed", True)), error=None, detail=detail)
        except AssertionError as e:
            row.update(passed=False, error=f"check failed: {e}", detail={})
        except Exception as e:  # noqa: BLE001 - one check failing is a row, not a crash
            row.update(passed=False, error=f"{type(e).__name__}: {e}"[:2000], detail={})
        row["seconds"] = round(time.monotonic() - t0, 3)
        self.rows.append(row)
        return row

    # ---------------------------------------------------------------- good requests
    def models(self):
        ms = self.c.models.list().data
        ids = [m.id for m in ms]
        _need(self.model in ids, f"{self.model} not among served models {ids}")
        m = next(m for m in ms if m.id == self.model)
        mml = getattr(m, "max_model_len", None)
        _need(mml in (None, self.max_model_len), f"max_model_len {mml} != {self.max_model_len}")
        return dict(models=ids, max_model_len=mml)

    def _complete(self, **kw):
        kw.setdefault("extra_body", {"ignore_eos": True})
        return self.c.completions.create(model=self.model, **kw)

    def completion(self):
        r = self._complete(prompt=words(PROMPT_WORDS), max_tokens=GEN, temperature=0)
        ch = r.choices[0]
        _need(ch.finish_reason == "length", f"finish_reason {ch.finish_reason!r}")
        _need(r.usage.completion_tokens == GEN, f"completion_tokens {r.usage.completion_tokens}")
        _need(r.usage.prompt_tokens == PROMPT_WORDS + 1,
              f"prompt_tokens {r.usage.prompt_tokens} != {PROMPT_WORDS} words + BOS")
        _need(isinstance(ch.text, str) and ch.text.strip() != "", f"text {ch.text!r}")
        return dict(text=ch.text, usage=r.usage.model_dump())

    def completion_token_ids(self):
        """A prompt of token ids, as the agreement runs pass them: no BOS added."""
        ids = list(range(FIRST_WORD, FIRST_WORD + PROMPT_WORDS))
        r = self._complete(prompt=ids, max_tokens=GEN, temperature=0)
        _need(r.usage.prompt_tokens == PROMPT_WORDS, f"prompt_tokens {r.usage.prompt_tokens}")
        _need(r.usage.completion_tokens == GEN, f"completion_tokens {r.usage.completion_tokens}")
        return dict(text=r.choices[0].text)

    def completion_stream(self):
        chunks, text, finish, usage = 0, "", None, None
        for ev in self._complete(prompt=words(PROMPT_WORDS), max_tokens=GEN, temperature=0,
                                 stream=True, stream_options={"include_usage": True}):
            if ev.choices:
                chunks += 1
                text += ev.choices[0].text or ""
                finish = ev.choices[0].finish_reason or finish
            if ev.usage is not None:
                usage = ev.usage
        _need(chunks >= 2, f"{chunks} chunks with choices")
        _need(finish == "length", f"finish_reason {finish!r}")
        _need(usage is not None and usage.completion_tokens == GEN, f"usage {usage}")
        _need(text.strip() != "", "no text streamed")
        return dict(chunks=chunks, text=text)

    def completion_logprobs(self):
        r = self._complete(prompt=words(PROMPT_WORDS), max_tokens=GEN, temperature=0,
                           logprobs=3)
        lp = r.choices[0].logprobs
        _need(lp is not None and len(lp.tokens) == GEN and len(lp.token_logprobs) == GEN,
              f"logprobs for {len(lp.tokens) if lp else 0} of {GEN} tokens")
        _need(len(lp.top_logprobs) == GEN, "top_logprobs per token")
        for i, (t, v, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
            _need(1 <= len(top) <= 4, f"position {i}: {len(top)} top logprobs")
            _need(_greedy_top(v, list(top.values())),
                  f"position {i}: greedy token {t!r} logprob {v} is not the top of {top}")
        return dict(token_logprobs=lp.token_logprobs)

    def completion_n(self):
        r = self._complete(prompt=words(PROMPT_WORDS), max_tokens=GEN, temperature=1.0,
                           n=3, seed=1)
        idx = sorted(c.index for c in r.choices)
        _need(idx == [0, 1, 2], f"choice indices {idx}")
        _need(r.usage.completion_tokens == 3 * GEN,
              f"completion_tokens {r.usage.completion_tokens}")
        _need(all(c.finish_reason == "length" for c in r.choices), "finish reasons")
        return dict(texts=[c.text for c in r.choices])

    def completion_stop(self):
        """Greedy text A; a stop string s taken from its second half; the same request with
        stop=[s] must end with finish_reason "stop" exactly where s first occurs in A. Two
        generations of one engine may differ (docs/e2e.md); a request whose text left A's
        before s is asked again, up to STOP_TRIES times."""
        tries = []
        for _ in range(STOP_TRIES):
            a = self._complete(prompt=words(PROMPT_WORDS), max_tokens=GEN,
                               temperature=0).choices[0].text
            ws = a.split()
            _need(len(ws) >= 4, f"too few words to pick a stop string from: {a!r}")
            stop = " " + ws[len(ws) // 2 + 1]
            cut = a.find(stop)
            _need(cut >= 0, f"{stop!r} not found in {a!r}")
            b = self._complete(prompt=words(PROMPT_WORDS), max_tokens=GEN, temperature=0,
                               stop=[stop]).choices[0]
            tries.append(dict(text=a, stop=stop, stopped_text=b.text,
                              finish_reason=b.finish_reason,
                              stop_reason=getattr(b, "stop_reason", None)))
            if b.text == a[:cut]:
                _need(b.finish_reason == "stop", f"finish_reason {b.finish_reason!r}")
                _need(getattr(b, "stop_reason", stop) == stop,
                      f"stop_reason {getattr(b, 'stop_reason', None)!r}")
                return dict(tries=tries)
            _need(stop not in b.text, f"{stop!r} in the stopped text {b.text!r}")
            _need(not a.startswith(b.text) or b.finish_reason == "stop",
                  f"stopped before {stop!r} without finish_reason stop: {b.text!r}")
        raise AssertionError(f"the greedy text differed in each of {STOP_TRIES} tries: {tries}")

    def _chat(self, **kw):
        kw.setdefault("extra_body", {"ignore_eos": True})
        kw.setdefault("temperature", 0)
        return self.c.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": words(16)}],
            max_tokens=CHAT_GEN, **kw)

    def chat(self):
        r = self._chat()
        ch = r.choices[0]
        _need(ch.message.role == "assistant", f"role {ch.message.role!r}")
        _need(isinstance(ch.message.content, str), f"content {ch.message.content!r}")
        _need(ch.finish_reason == "length", f"finish_reason {ch.finish_reason!r}")
        _need(r.usage.completion_tokens == CHAT_GEN,
              f"completion_tokens {r.usage.completion_tokens}")
        _need(r.usage.prompt_tokens > 16, f"prompt_tokens {r.usage.prompt_tokens}")
        return dict(content=ch.message.content, usage=r.usage.model_dump())

    def chat_stream(self):
        chunks, text, finish, usage = 0, "", None, None
        for ev in self._chat(stream=True, stream_options={"include_usage": True}):
            if ev.choices:
                chunks += 1
                text += ev.choices[0].delta.content or ""
                finish = ev.choices[0].finish_reason or finish
            if ev.usage is not None:
                usage = ev.usage
        _need(chunks >= 2, f"{chunks} chunks with choices")
        _need(finish == "length", f"finish_reason {finish!r}")
        _need(usage is not None and usage.completion_tokens == CHAT_GEN, f"usage {usage}")
        return dict(chunks=chunks, text=text)

    def chat_logprobs(self):
        r = self._chat(logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
        _need(content is not None and len(content) == CHAT_GEN,
              f"logprobs for {len(content or [])} of {CHAT_GEN} tokens")
        for i, t in enumerate(content):
            _need(1 <= len(t.top_logprobs) <= 2, f"position {i}: {len(t.top_logprobs)} tops")
            _need(_greedy_top(t.logprob, [x.logprob for x in t.top_logprobs]),
                  f"position {i}: greedy logprob {t.logprob} not the top")
        return dict(logprobs=[t.logprob for t in content])

    def chat_n(self):
        r = self._chat(n=2, temperature=1.0, seed=1)
        _need(sorted(c.index for c in r.choices) == [0, 1], f"{len(r.choices)} choices")
        return dict(contents=[c.message.content for c in r.choices])

    # ---------------------------------------------------------------- bad requests
    def _rejected(self, send) -> dict:
        """``send()`` returns an HTTP status (or raises the client's status error); the
        check passes on a 4xx with /health still 200 afterwards."""
        from openai import APIStatusError
        try:
            status, body = send()
        except APIStatusError as e:
            status, body = e.status_code, str(e)[:500]
        alive = health(self.base)
        ok = status is not None and 400 <= status < 500 and alive
        return dict(status=status, body=(body or "")[:500], health_after=alive, _passed=ok)

    def bad_prompt_too_long(self):
        n = self.max_model_len + 8

        def send():
            self._complete(prompt=words(n, start=FIRST_WORD), max_tokens=1, temperature=0)
            return 200, "accepted"
        return dict(self._rejected(send), prompt_words=n)

    def bad_malformed_json(self):
        return self._rejected(lambda: http(
            "POST", f"{self.base}/v1/completions",
            body=b'{"model": "' + self.model.encode() + b'", "prompt": "t1000", "max_tok',
            timeout=30))

    def bad_unknown_model(self):
        def send():
            self.c.completions.create(model="no-such-model", prompt=words(4), max_tokens=1)
            return 200, "accepted"
        return self._rejected(send)

    def bad_max_tokens_0(self):
        def send():
            self._complete(prompt=words(4), max_tokens=0)
            return 200, "accepted"
        return self._rejected(send)

    def serves_after_bad_requests(self):
        r = self._complete(prompt=words(8), max_tokens=4, temperature=0)
        _need(r.usage.completion_tokens == 4, f"completion_tokens {r.usage.completion_tokens}")
        _need(health(self.base), "/health after the bad requests")
        return dict(text=r.choices[0].text)

    GOOD = ("models", "completion", "completion_token_ids", "completion_stream",
            "completion_logprobs", "completion_n", "completion_stop", "chat", "chat_stream",
            "chat_logprobs", "chat_n")
    BAD = ("bad_prompt_too_long", "bad_malformed_json", "bad_unknown_model",
           "bad_max_tokens_0", "serves_after_bad_requests")

    def run(self) -> list[dict]:
        for name in self.GOOD + self.BAD:
            self._row(name, getattr(self, name))
        return self.rows


def api_rows(base_url: str, served_name: str, max_model_len: int, mode: str,
             model_label: str, deadline: float = float("inf")) -> list[dict]:
    """Every check against one server (those past ``deadline``, a time.time(), are rows
    that say so); a client that cannot be made is one failed row."""
    try:
        checks = Checks(base_url, served_name, max_model_len, mode, model_label,
                        deadline=deadline)
    except Exception as e:  # noqa: BLE001 - e.g. no `openai` package in this python
        return [dict(kernel="serve_api", variant=mode, shape=dict(model=model_label,
                                                                  check="client"),
                     passed=False, error=f"{type(e).__name__}: {e}", detail={})]
    return checks.run()


def summary(rows: list[dict]) -> str:
    bad = [r["shape"]["check"] for r in rows if not r["passed"]]
    return f"{len(rows) - len(bad)}/{len(rows)} API checks passed" + \
        (f"; failed: {', '.join(bad)}" if bad else "")


if __name__ == "__main__":   # a manual run against a server: serve_api.py URL MODEL MAXLEN
    import sys
    print(json.dumps(api_rows(sys.argv[1], sys.argv[2], int(sys.argv[3]), "manual",
                              sys.argv[2]), indent=1))
