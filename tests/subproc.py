"""Wait on a test's child process by its progress, not by a fixed wall time.

``run(argv, cap=...)`` is ``subprocess.run(argv, capture_output=True, text=True)`` for tests,
with two limits in place of ``timeout=``:

* **stall**: the child is killed when, for ``stall`` seconds, it has written nothing to
  stdout or stderr *and* its process group (it runs in a session of its own, so pool
  workers, nvcc and cuobjdump count) has used no CPU time. A child that computes silently
  (a compile gate prints its table only at the end) is making progress; one blocked on a
  lock or a pipe nobody writes is not.
* **cap**: a livelock (spinning without end) is caught by ``cap`` seconds of wall time —
  the caller's generous figure for an idle machine — multiplied by the machine's load
  (``os.getloadavg()[0] / os.cpu_count()``, the highest seen while the child runs, at least
  1) and by ``DEEPINFER_TEST_TIME_SCALE`` (default 1; raise it on a slow machine).

On either limit the whole process group is killed and ``Stalled`` (a
``subprocess.TimeoutExpired``) is raised; its message says which limit fired and ends with
the tail of the child's stdout and stderr, so a pytest failure shows where the child was.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

# No output and no CPU tick (10 ms of CPU on Linux) for this long is a hang: a runnable
# process gets CPU within a scheduler period (milliseconds) even on a 2-core machine with
# several CPU-bound processes, and the longest legitimate idle wait in the suite — a probe
# blocked on the build-cache lock of a sibling compiling the same TileLang kernel — lasts
# one compile (under a minute). Four minutes leaves room for both and still fails a hung
# child long before CI's limit.
STALL_S = 240.0
# How often the CPU time of the child's process group is sampled.
POLL_S = 1.0
# Characters of each stream quoted in a failure message: enough for a Python traceback.
TAIL_CHARS = 4000
# After the child exits, how long descendants that kept its pipes open may keep them open
# before they are killed (a child's daemons must not hold a test forever).
LINGER_S = 10.0


class Stalled(subprocess.TimeoutExpired):
    """The child was killed for making no progress or for running past its scaled cap."""

    def __init__(self, cmd, seconds: float, why: str, stdout: str, stderr: str):
        super().__init__(cmd, seconds, output=stdout, stderr=stderr)
        self.why = why

    def __str__(self) -> str:
        return (f"{_short(self.cmd)}: killed after {self.timeout:.0f} s: {self.why}\n"
                f"--- stdout (tail) ---\n{_tail(self.output)}\n"
                f"--- stderr (tail) ---\n{_tail(self.stderr)}")


def _short(cmd) -> str:
    parts = [cmd] if isinstance(cmd, str) else [str(c) for c in cmd]
    text = " ".join(p if len(p) <= 80 else p[:77] + "..." for p in parts)
    return text if len(text) <= 300 else text[:297] + "..."


def _tail(s) -> str:
    if not s:
        return "(empty)"
    return s if len(s) <= TAIL_CHARS else "..." + s[-TAIL_CHARS:]


def time_scale() -> float:
    """DEEPINFER_TEST_TIME_SCALE times the machine's load per core (each at least 1)."""
    try:
        user = float(os.environ.get("DEEPINFER_TEST_TIME_SCALE", "1") or 1)
    except ValueError:
        raise ValueError("DEEPINFER_TEST_TIME_SCALE must be a number") from None
    return max(1.0, user) * load_scale()


def load_scale() -> float:
    """The 1-minute load average per CPU core, at least 1 (1 where it cannot be read)."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def group_cpu_ticks(sid: int) -> int | None:
    """CPU clock ticks (user + system, own and of reaped children) of every process in the
    session ``sid``; None where /proc cannot be read (then only output counts as progress)."""
    total, seen = 0, False
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited between listdir and open
            continue
        # the command name is in parentheses and may hold spaces: split after its last ')'
        fields = stat[stat.rfind(b")") + 2:].split()
        # fields[0] is field 3 (state): session is field 6, utime..cstime fields 14-17
        if len(fields) < 15 or int(fields[3]) != sid:
            continue
        seen = True
        total += sum(int(x) for x in fields[11:15])
    return total if seen else None


def run(args, *, cap: float, env=None, cwd=None, input=None, text: bool = True,
        stall: float = STALL_S) -> subprocess.CompletedProcess:
    """Run ``args`` to its end, capturing stdout and stderr; kill it (and everything it
    started) on ``stall`` seconds without progress or ``cap`` x ``time_scale()`` seconds in
    all, raising ``Stalled``. ``input`` (str or bytes) is written to its stdin; without it
    stdin is /dev/null, so a child that reads stdin sees its end instead of waiting."""
    if cap <= 0 or stall <= 0:
        raise ValueError(f"cap ({cap}) and stall ({stall}) must be positive")
    proc = subprocess.Popen(args, env=env, cwd=cwd, start_new_session=True,
                            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}
    last_output = [time.monotonic()]

    def reader(name: str, stream) -> None:
        fd = stream.fileno()
        while True:
            try:
                b = os.read(fd, 65536)
            except OSError:
                break
            if not b:
                break
            chunks[name].append(b)
            last_output[0] = time.monotonic()
        stream.close()

    threads = [threading.Thread(target=reader, args=(n, s), daemon=True)
               for n, s in (("out", proc.stdout), ("err", proc.stderr))]
    if input is not None:
        data = input.encode() if isinstance(input, str) else input

        def writer() -> None:
            try:
                proc.stdin.write(data)
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        threads.append(threading.Thread(target=writer, daemon=True))
    for t in threads:
        t.start()

    def decoded(name: str):
        raw = b"".join(chunks[name])
        return raw.decode("utf-8", "replace") if text else raw

    def kill_group() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    start = time.monotonic()
    scale = time_scale()
    ticks = group_cpu_ticks(proc.pid)
    last_cpu = start
    why = ""
    try:
        while True:
            try:
                proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            t = group_cpu_ticks(proc.pid)
            if t is not None and t != ticks:
                ticks, last_cpu = t, now
            scale = max(scale, time_scale())
            quiet = now - max(last_output[0], last_cpu)
            if quiet > stall:
                why = (f"no output and no CPU use for {quiet:.0f} s (stall limit {stall:.0f} s)")
                break
            if now - start > cap * scale:
                why = (f"ran past its limit of {cap * scale:.0f} s (cap {cap:.0f} s x time "
                       f"scale {scale:.2f}: load per core and DEEPINFER_TEST_TIME_SCALE)")
                break
    except BaseException:  # KeyboardInterrupt, a failing reader: leave no child behind
        kill_group()
        proc.wait()
        raise
    if why:
        kill_group()
        proc.wait()
        for t in threads:
            t.join(timeout=LINGER_S)
        raise Stalled(args, time.monotonic() - start, why, decoded("out"), decoded("err"))
    for t in threads[:2]:
        t.join(timeout=LINGER_S)
    if any(t.is_alive() for t in threads[:2]):  # descendants still hold the pipes open
        kill_group()
        for t in threads[:2]:
            t.join(timeout=LINGER_S)
    return subprocess.CompletedProcess(args, proc.returncode, decoded("out"), decoded("err"))
