"""Stand-ins for vLLM and nvidia-smi in tests/test_e2e_serve.py: benchmarks/e2e/serve.py runs
them exactly as it runs the real ones (``python -m vllm.entrypoints.cli.main serve ...``, its
benchmark driver importing ``vllm.benchmarks.serve``, ``nvidia-smi --query-...``).

``install(root)`` writes a package ``vllm`` (with a dist-info, version 0.33.0) and a
``bin/nvidia-smi`` under ``root`` whose modules import this file; put ``root`` and tests/ on
PYTHONPATH and ``root/bin`` first on PATH.

The server (``serve``) is a small HTTP server of the OpenAI routes vLLM serves: /health,
/version, /v1/models, /v1/completions and /v1/chat/completions (streamed or not, logprobs,
n, stop strings, ignore_eos), with vLLM's answers to bad requests (400 for malformed JSON, a
prompt over --max-model-len and max_tokens < 1; 404 for an unknown model). It starts an
"engine core" child (same sid), as vLLM does, which exits with it, and registers GPU
memory for both in FAKE_GPU_DIR (one file per pid, read by the fake nvidia-smi, which lists
only live pids). SIGINT shuts it down cleanly. Tokens are the words t<id> of the checkpoint
tokenizer, drawn deterministically from the prompt.

Misbehaviour per mode (the mode is read from the DEEPINFER_* switches serve.py sets):
``FAKE_ACCEPT_BAD=<mode>:<check>,...`` answers that bad request with 200;
``FAKE_LEAVE_CHILD=<mode>,...`` leaves a child that ignores SIGINT and SIGTERM;
``FAKE_CRASH=<mode>,...`` exits with 1 before listening;
``FAKE_IGNORE_SIGINT=<mode>,...`` needs SIGTERM.

The benchmark (``vllm.benchmarks.serve.add_cli_args`` / ``main_async``) sends the run's
requests to the server and saves a result JSON with the keys vLLM 0.33.0 saves, plus
``served_mode`` (which server answered).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent


def install(root: Path) -> None:
    files = {
        "vllm/__init__.py": '__version__ = "0.33.0"\n',
        "vllm/entrypoints/__init__.py": "",
        "vllm/entrypoints/cli/__init__.py": "",
        "vllm/entrypoints/cli/main.py": ("import sys\nfrom serve_fakes import cli_main\n"
                                         "if __name__ == '__main__':\n"
                                         "    sys.exit(cli_main(sys.argv[1:]))\n"),
        "vllm/entrypoints/cli/serve.py": "",
        "vllm/entrypoints/openai/__init__.py": "",
        "vllm/entrypoints/openai/api_server.py": "",
        "model_hosting_container_standards/__init__.py": "",
        "model_hosting_container_standards/sagemaker.py": "",
        "vllm/benchmarks/__init__.py": "",
        "vllm/benchmarks/serve.py": "from serve_fakes import add_cli_args, main_async  # noqa\n",
        "vllm/utils/__init__.py": "",
        "vllm/utils/argparse_utils.py": "from argparse import ArgumentParser as "
                                        "FlexibleArgumentParser  # noqa\n",
        "vllm-0.33.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n",
        "torch-2.11.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n",
        "triton-3.6.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: triton\n"
                                           "Version: 3.6.0\n",
        "bin/nvidia-smi": (f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(HERE)!r})\n"
                           "from serve_fakes import nvidia_smi\n"
                           "sys.exit(nvidia_smi(sys.argv[1:]))\n"),
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (root / "bin" / "nvidia-smi").chmod(0o755)


# --------------------------------------------------------------------------- GPU
BASE_USED_MIB, TOTAL_MIB, PER_PROCESS_MIB = 500, 143771, 1000


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gpu_apps() -> dict[int, int]:
    d = Path(os.environ.get("FAKE_GPU_DIR", "/nonexistent"))
    out = {}
    for f in d.glob("*.mib") if d.is_dir() else []:
        pid = int(f.stem)
        if _alive(pid):
            out[pid] = int(f.read_text())
    return out


def nvidia_smi(argv: list[str]) -> int:
    q = next((a for a in argv if a.startswith("--query")), "")
    apps = gpu_apps()
    if q == "--query-gpu=name":
        print("NVIDIA H200")
    elif q.startswith("--query-gpu=memory.used"):
        print(f"{BASE_USED_MIB + sum(apps.values())}, {TOTAL_MIB}")
    elif q.startswith("--query-compute-apps"):
        for pid, mib in sorted(apps.items()):
            print(f"{pid}, {mib}")
    else:
        return 2
    return 0


def _hold_gpu(pid: int) -> Path | None:
    d = os.environ.get("FAKE_GPU_DIR")
    if not d:
        return None
    p = Path(d) / f"{pid}.mib"
    p.write_text(str(PER_PROCESS_MIB))
    return p


# --------------------------------------------------------------------------- server
def mode_of_env() -> str:
    if os.environ.get("DEEPINFER_EMULATE_CAPABILITY") == "8.0":
        return "a100"
    if os.environ.get("DEEPINFER_DISABLE") == "all":
        return "upstream"
    return "default"


def _flag(name: str, mode: str, what: str | None = None) -> bool:
    items = [x for x in os.environ.get(name, "").split(",") if x]
    return (f"{mode}:{what}" if what else mode) in items


def _words(n: int, key: str, k0: int = 0) -> list[int]:
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return [100 + (h + 7919 * (k0 + k)) % 3000 for k in range(n)]


class Fake:
    def __init__(self, served: str, max_model_len: int, mode: str):
        self.served, self.max_model_len, self.mode = served, max_model_len, mode

    def prompt_tokens(self, body: dict, chat: bool) -> int:
        if chat:
            return 4 + sum(len(str(m.get("content", "")).split()) for m in body["messages"])
        p = body.get("prompt", "")
        if isinstance(p, list):
            return len(p)
        return len(p.split()) + 1   # the BOS the tokenizer adds

    def generate(self, body: dict, chat: bool):
        """[(index, [token ids], text, finish, stop_reason)] per choice, or an error."""
        n = int(body.get("n") or 1)
        gen = body.get("max_tokens") if not chat else body.get("max_tokens",
                                                                body.get("max_completion_tokens"))
        gen = 16 if gen is None else gen
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        key = json.dumps(body.get("messages") if chat else body.get("prompt"))
        out = []
        for i in range(n):
            seed = key + (f"#{i}:{body.get('seed')}" if (body.get("temperature") or 0) > 0
                          else "")
            ids = _words(gen, seed)
            text = "".join(f" t{t}" for t in ids)
            finish, reason = "length", None
            for s in stops:
                j = text.find(s)
                if j >= 0:
                    text, finish, reason = text[:j], "stop", s
                    ids = ids[:len(text.split())]
                    break
            out.append((i, ids, text, finish, reason))
        return out


def _logprob(t: int, k: int) -> float:
    return -0.05 - 0.01 * ((t + k) % 7)


def make_handler(fake: Fake):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, code: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, msg: str) -> None:
            self._send(code, {"error": {"message": msg, "type": "BadRequestError",
                                        "code": code}})

        def do_GET(self):
            if self.path == "/health":
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/version":
                self._send(200, {"version": "0.33.0", "mode": fake.mode})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [
                    {"id": fake.served, "object": "model", "created": 0, "owned_by": "vllm",
                     "max_model_len": fake.max_model_len}]})
            else:
                self._error(404, "no route")

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            chat = self.path == "/v1/chat/completions"
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                return self._error(404, "no route")
            m = fake.mode
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as e:
                if not _flag("FAKE_ACCEPT_BAD", m, "malformed_json"):
                    return self._error(400, f"JSON decode error: {e}")
                body = {"model": fake.served, "prompt": "t1000", "max_tokens": 1}
            if body.get("model") != fake.served and not _flag("FAKE_ACCEPT_BAD", m,
                                                              "unknown_model"):
                return self._error(404, f"The model `{body.get('model')}` does not exist.")
            mt = body.get("max_tokens", 16)
            if mt is not None and mt < 1 and not _flag("FAKE_ACCEPT_BAD", m, "max_tokens_0"):
                return self._error(400, "max_tokens must be at least 1")
            pt = fake.prompt_tokens(body, chat)
            if pt >= fake.max_model_len and not _flag("FAKE_ACCEPT_BAD", m, "prompt_too_long"):
                return self._error(400, f"maximum context length is {fake.max_model_len}")
            if mt is not None and mt < 1:
                body["max_tokens"] = 1
            choices = fake.generate(body, chat)
            usage = {"prompt_tokens": pt, "completion_tokens": sum(len(c[1]) for c in choices),
                     "total_tokens": pt + sum(len(c[1]) for c in choices)}
            if body.get("stream"):
                return self._stream(body, chat, choices, usage)
            out = []
            for i, ids, text, finish, reason in choices:
                c = {"index": i, "finish_reason": finish, "stop_reason": reason}
                lp = self._logprobs(body, chat, ids)
                if chat:
                    c.update(message={"role": "assistant", "content": text}, logprobs=lp)
                else:
                    c.update(text=text, logprobs=lp)
                out.append(c)
            self._send(200, {"id": "cmpl-fake", "object": "chat.completion" if chat else
                             "text_completion", "created": 0, "model": fake.served,
                             "choices": out, "usage": usage})

        def _logprobs(self, body, chat, ids):
            if chat:
                if not body.get("logprobs"):
                    return None
                k = int(body.get("top_logprobs") or 1)
                return {"content": [
                    {"token": f" t{t}", "logprob": _logprob(t, 0), "bytes": None,
                     "top_logprobs": [{"token": f" t{t + j}", "logprob": _logprob(t, 0) - j,
                                       "bytes": None} for j in range(k)]} for t in ids]}
            k = body.get("logprobs")
            if k is None:
                return None
            return {"tokens": [f" t{t}" for t in ids],
                    "token_logprobs": [_logprob(t, 0) for t in ids],
                    "text_offset": list(range(len(ids))),
                    "top_logprobs": [{f" t{t + j}": _logprob(t, 0) - j for j in range(k)}
                                     for t in ids]}

        def _stream(self, body, chat, choices, usage):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()

            def ev(obj):
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()
            kind = "chat.completion.chunk" if chat else "text_completion"
            for i, ids, text, finish, reason in choices:
                parts = [f" t{t}" for t in ids] or [""]
                for j, part in enumerate(parts):
                    last = j == len(parts) - 1
                    c = {"index": i, "finish_reason": finish if last else None,
                         "stop_reason": reason if last else None, "logprobs": None}
                    if chat:
                        c["delta"] = {"role": "assistant", "content": part} if j == 0 else \
                            {"content": part}
                    else:
                        c["text"] = part
                    ev({"id": "cmpl-fake", "object": kind, "created": 0, "model": fake.served,
                        "choices": [c]})
            if (body.get("stream_options") or {}).get("include_usage"):
                ev({"id": "cmpl-fake", "object": kind, "created": 0, "model": fake.served,
                    "choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True
    return H


def _engine_core(parent: int, stubborn: bool) -> None:
    """The child: exits when its parent is gone (stubborn: ignores SIGINT/SIGTERM and
    stays)."""
    if stubborn:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent shuts it down
    mem = _hold_gpu(os.getpid())
    while stubborn or os.getppid() == parent:
        time.sleep(0.1)
    if mem is not None:
        mem.unlink(missing_ok=True)
    os._exit(0)


def serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args, _ = ap.parse_known_args(argv)
    mode = mode_of_env()
    if _flag("FAKE_CRASH", mode):
        print("fake vllm: crash at start", flush=True)
        return 1
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _engine_core(parent, _flag("FAKE_LEAVE_CHILD", mode))
    mem = _hold_gpu(parent)
    fake = Fake(args.served_model_name or args.model, args.max_model_len, mode)
    httpd = ThreadingHTTPServer((args.host, args.port), make_handler(fake))
    httpd.daemon_threads = True
    stop = threading.Event()

    def on_signal(sig, frame):
        if sig == signal.SIGINT and _flag("FAKE_IGNORE_SIGINT", mode):
            return
        stop.set()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    t = threading.Thread(target=httpd.serve_forever, kwargs=dict(poll_interval=0.1),
                         daemon=True)
    t.start()
    print(f"fake vllm {mode} serving {fake.served} on {args.host}:{args.port}", flush=True)
    while not stop.is_set():
        stop.wait(0.2)
    httpd.shutdown()
    if not _flag("FAKE_LEAVE_CHILD", mode):
        os.kill(child, signal.SIGTERM)
        os.waitpid(child, 0)
    if mem is not None:
        mem.unlink(missing_ok=True)
    return 0


# --------------------------------------------------------------------------- benchmark
def add_cli_args(p) -> None:
    for a in ("--backend", "--host", "--endpoint", "--model", "--served-model-name",
              "--tokenizer", "--dataset-name", "--result-dir", "--result-filename",
              "--percentile-metrics", "--metric-percentiles", "--request-rate"):
        p.add_argument(a)
    for a in ("--port", "--random-input-len", "--random-output-len", "--num-prompts",
              "--max-concurrency", "--num-warmups", "--seed"):
        p.add_argument(a, type=int)
    p.add_argument("--random-range-ratio", type=float)
    p.add_argument("--temperature", type=float)
    for a in ("--ignore-eos", "--disable-tqdm", "--save-result"):
        p.add_argument(a, action="store_true")
    p.add_argument("--metadata", nargs="*")


async def main_async(args) -> dict:
    import asyncio
    import urllib.request
    if os.environ.get("FAKE_BENCH_FAIL"):
        raise RuntimeError("fake bench: asked to fail")
    url = f"http://{args.host}:{args.port}"
    mode = json.loads(urllib.request.urlopen(f"{url}/version", timeout=10).read())["mode"]
    prompt = " ".join(f"t{1000 + i}" for i in range(args.random_input_len - 1))

    def one(i):
        body = json.dumps({"model": args.served_model_name, "prompt": prompt + f" t{i}",
                           "max_tokens": args.random_output_len, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{url}{args.endpoint}", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        r = json.loads(urllib.request.urlopen(req, timeout=30).read())
        return time.perf_counter() - t0, r["usage"]["completion_tokens"]
    t0 = time.perf_counter()
    done = [await asyncio.to_thread(one, i) for i in range(args.num_prompts)]
    dur = time.perf_counter() - t0
    out_tok = sum(n for _, n in done)
    lat = sorted(x for x, _ in done)
    res = {"date": "fake", "backend": args.backend, "model_id": args.model,
           "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
           "duration": dur, "completed": len(done), "failed": 0,
           "total_input_tokens": args.random_input_len * len(done),
           "total_output_tokens": out_tok, "request_throughput": len(done) / dur,
           "output_throughput": out_tok / dur,
           "total_token_throughput": (out_tok + args.random_input_len * len(done)) / dur,
           "served_mode": mode}
    for metric, scale in (("ttft", 0.5), ("tpot", 0.1), ("itl", 0.1), ("e2el", 1.0)):
        for p in (50, 90, 99):
            res[f"p{p}_{metric}_ms"] = 1000 * scale * lat[min(len(lat) - 1,
                                                              len(lat) * p // 100)]
        res[f"median_{metric}_ms"] = res[f"p50_{metric}_ms"]
    for kv in args.metadata or []:
        k, _, v = kv.partition("=")
        res[k] = v
    if args.save_result:
        Path(args.result_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.result_dir) / args.result_filename).write_text(json.dumps(res))
    return res


def cli_main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    if argv[:2] == ["bench", "serve"]:
        import asyncio
        p = argparse.ArgumentParser()
        add_cli_args(p)
        asyncio.run(main_async(p.parse_args(argv[2:])))
        return 0
    print(f"fake vllm: unknown command {argv[:2]}", file=sys.stderr)
    return 2
