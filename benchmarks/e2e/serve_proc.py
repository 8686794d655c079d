"""The processes of benchmarks/e2e/serve.py: a ``vllm serve`` server started with a Unix sid
of its own (setsid), waited on through /health, stopped with SIGINT as a user's Ctrl-C would,
and what it left behind: processes carrying its sid (vLLM's API server spawns its engine core
and workers, which inherit it), and GPU memory (nvidia-smi, else torch.cuda.mem_get_info in a
child process). Standard library only."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

# After SIGINT: how long vLLM's API server may take to shut its engine down and exit, then
# SIGTERM and this long again before SIGKILL of its whole process group. vLLM 0.33.0's
# engine core waits up to VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS for its workers; a clean exit
# takes seconds.
SIGINT_WAIT_S = 60.0
SIGTERM_WAIT_S = 15.0
# After the API server has exited, how long the other processes of its sid may take to
# exit on their own before they count as left behind (and are killed).
LINGER_S = 15.0
# GPU memory counts as returned within this many MiB of the figure before the server
# started (the CUDA driver's own bookkeeping moves by a few MiB).
GPU_TOLERANCE_MIB = 256
# How long the GPU may take to show memory returned after the processes are gone.
GPU_SETTLE_S = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | None = None, timeout: float = 10.0,
         content_type: str = "application/json") -> tuple[int | None, str]:
    """(status, body text) of one request; status None when nothing answered."""
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": content_type} if body is not None
                                 else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, TimeoutError):
        return None, ""


def health(base_url: str, timeout: float = 5.0) -> bool:
    return http("GET", f"{base_url}/health", timeout=timeout)[0] == 200


def sid_pids(sid: int) -> list[int]:
    """Live processes (zombies left out: they hold nothing) whose Unix sid is ``sid``."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name is in parentheses and may hold spaces: split after its last ')'
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != b"Z":
            out.append(int(name))
    return sorted(out)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:300]
    except OSError:
        return ""


def gpu_memory(nvidia_smi: str = "nvidia-smi", python: str | None = None) -> dict | None:
    """{"used_mib", "total_mib", "apps": {pid: MiB} or None, "source"} summed over the GPUs
    CUDA_VISIBLE_DEVICES names (all where unset); None where neither nvidia-smi nor torch
    can tell. ``apps`` is None where nvidia-smi's process query failed and with the torch
    fallback (whose figure includes the probe's own CUDA context, the same in every
    reading); inside a container's PID namespace nvidia-smi may list no process at all,
    which is why the pid check applies only to servers whose pids it listed
    (memory_returned)."""
    sel = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    base = [nvidia_smi] + (["-i", sel] if sel else [])
    try:
        mem = subprocess.run(base + ["--query-gpu=memory.used,memory.total",
                                     "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        if mem.returncode == 0 and mem.stdout.strip():
            used = total = 0
            for line in mem.stdout.strip().splitlines():
                u, t = (int(float(x)) for x in line.split(",")[:2])
                used, total = used + u, total + t
            apps_r = subprocess.run(base + ["--query-compute-apps=pid,used_memory",
                                            "--format=csv,noheader,nounits"],
                                    capture_output=True, text=True, timeout=30)
            apps: dict[int, int] | None = {} if apps_r.returncode == 0 else None
            for line in apps_r.stdout.strip().splitlines() if apps is not None else []:
                parts = [x.strip() for x in line.split(",")]
                if len(parts) >= 2 and parts[0].isdigit():
                    try:
                        apps[int(parts[0])] = int(float(parts[1]))
                    except ValueError:
                        pass
            return dict(used_mib=used, total_mib=total, apps=apps, source="nvidia-smi")
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    code = ("import json, torch\nf, t = torch.cuda.mem_get_info()\n"
            "print(json.dumps([f, t]))")
    try:
        r = subprocess.run([python or sys.executable, "-c", code], capture_output=True,
                           text=True, timeout=120)
        free, total = json.loads(r.stdout.strip().splitlines()[-1])
        return dict(used_mib=(total - free) >> 20, total_mib=total >> 20, apps=None,
                    source="torch.cuda.mem_get_info (its own context included)")
    except Exception:  # noqa: BLE001 - no GPU to read: the checks say so
        return None


class Server:
    """One ``vllm serve`` process and the processes carrying its sid."""

    def __init__(self, name: str, argv: list[str], env: dict, log_path, base_url: str):
        self.name, self.argv, self.env = name, list(argv), dict(env)
        self.log_path, self.base_url = log_path, base_url
        self.proc: subprocess.Popen | None = None
        self.t_start = None
        self.seen_pids: set[int] = set()   # every process of its sid seen while it ran
        self.start_info: dict = {}

    def start(self) -> None:
        self.t_start = time.monotonic()
        log = open(self.log_path, "w")
        try:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            log.close()
        self.seen_pids.add(self.proc.pid)

    def note_pids(self) -> None:
        if self.proc is not None:
            self.seen_pids.update(sid_pids(self.proc.pid))

    def wait_healthy(self, timeout: float, poll: float = 1.0) -> dict:
        """Poll /health until 200, the process exits or ``timeout`` seconds pass."""
        end = time.monotonic() + max(0.0, timeout)
        while True:
            rc = self.proc.poll()
            if rc is not None:
                info = dict(healthy=False, exit_code=rc,
                            error=f"exited with {rc} before /health answered")
                break
            if health(self.base_url, timeout=min(5.0, poll + 2)):
                info = dict(healthy=True, exit_code=None, error=None)
                break
            if time.monotonic() >= end:
                info = dict(healthy=False, exit_code=None,
                            error=f"/health did not answer 200 within {timeout:.0f} s")
                break
            time.sleep(poll)
        info["start_seconds"] = round(time.monotonic() - self.t_start, 2)
        self.note_pids()
        self.start_info = info
        return info

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sigint_wait: float = SIGINT_WAIT_S, sigterm_wait: float = SIGTERM_WAIT_S,
             linger: float = LINGER_S) -> dict:
        """SIGINT, wait; SIGTERM, wait; SIGKILL of the process group. Then the other
        processes of its sid get ``linger`` seconds to exit; those still there are
        listed in ``leftover`` (kill_leftovers() ends them, once their GPU memory has been
        read)."""
        if self.proc is None:
            return dict(stopped=False, error="never started")
        self.note_pids()
        sid = self.proc.pid
        t0 = time.monotonic()
        signals = []
        for sig, wait in ((signal.SIGINT, sigint_wait), (signal.SIGTERM, sigterm_wait)):
            if self.proc.poll() is not None:
                break
            signals.append(sig.name)
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            signals.append("SIGKILL(group)")
            _killpg(sid)
            self.proc.wait()
        exit_s = time.monotonic() - t0
        left = sid_pids(sid)
        end = time.monotonic() + linger
        while left and time.monotonic() < end:
            time.sleep(0.5)
            left = sid_pids(sid)
        return dict(stopped=True, exit_code=self.proc.returncode, signals=signals,
                    stop_seconds=round(exit_s, 2), clean_exit=signals == ["SIGINT"],
                    leftover=[dict(pid=p, cmdline=cmdline(p)) for p in left])

    def kill_leftovers(self, wait: float = 5.0) -> list[int]:
        """SIGKILL whatever of its sid is still alive; returns what survived that."""
        if self.proc is None:
            return []
        sid = self.proc.pid
        left = sid_pids(sid)
        if left:
            _killpg(sid)
            for p in left:
                _kill(p)
        end = time.monotonic() + wait
        while left and time.monotonic() < end:
            time.sleep(0.2)
            left = sid_pids(sid)
        return left


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def memory_returned(before: dict | None, read, pids: set[int], others_alive: bool,
                    settle: float = GPU_SETTLE_S, tolerance: int = GPU_TOLERANCE_MIB) -> dict:
    """Whether a stopped server's GPU memory came back: none of ``pids`` in nvidia-smi's
    list (pass the pids only where nvidia-smi listed them while the server ran; an empty set
    skips the test), and (when no other server ran at either reading) the GPU's used
    memory within ``tolerance`` MiB of ``before``. ``read()`` returns a gpu_memory dict; it is
    polled for up to ``settle`` seconds. ``checked`` says which test applied (None: no GPU
    reading at all)."""
    end = time.monotonic() + settle
    while True:
        after = read()
        out = dict(before_used_mib=before and before["used_mib"],
                   after_used_mib=after and after["used_mib"], source=after and after["source"])
        checks, ok = [], True
        if pids and after is not None and after.get("apps") is not None:
            held = sorted(p for p in after["apps"] if p in pids)
            out["held_by_its_pids"] = {p: after["apps"][p] for p in held}
            checks.append("pids")
            ok = ok and not held
        if before is not None and after is not None and not others_alive:
            checks.append("total")
            ok = ok and after["used_mib"] <= before["used_mib"] + tolerance
        out["checked"] = checks or None
        out["returned"] = ok if checks else None
        if ok or time.monotonic() >= end:
            return out
        time.sleep(1.0)
