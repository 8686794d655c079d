"""tests/subproc.py: a child is waited on while it makes progress (output or CPU time of its
process group) and killed, with its whole group and a failure naming the limit and quoting
its output, when it stalls or runs past its load-scaled cap."""
from __future__ import annotations

import os
import sys
import time

import pytest

import subproc

PY = sys.executable


def test_returns_like_subprocess_run():
    r = subproc.run([PY, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
                     "sys.exit(3)"], cap=60)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
    r = subproc.run([PY, "-c", "import sys; print(sys.stdin.read().upper())"], cap=60,
                    input="hello")
    assert r.stdout == "HELLO\n"
    # without input, stdin is at its end: a child reading it does not wait
    r = subproc.run([PY, "-c", "import sys; print(repr(sys.stdin.read()))"], cap=60)
    assert r.stdout == "''\n"
    r = subproc.run([PY, "-c", "import os; print(os.getcwd(), os.environ['X'])"], cap=60,
                    cwd="/", env=dict(os.environ, X="y"), text=False)
    assert r.stdout == b"/ y\n"


def test_a_silent_child_that_computes_is_not_stalled():
    """No output for three times the stall limit, but CPU time keeps rising: progress."""
    r = subproc.run([PY, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass\n"
                     "print('done')"], cap=120, stall=2.0)
    assert r.returncode == 0 and r.stdout == "done\n"


def test_a_child_that_keeps_writing_is_not_stalled():
    r = subproc.run([PY, "-c", "import time\nfor i in range(6):\n print(i, flush=True)\n"
                     " time.sleep(0.5)"], cap=120, stall=2.0)
    assert r.stdout.split() == [str(i) for i in range(6)]


def test_a_hung_child_is_killed_with_its_group_and_its_output_quoted(tmp_path):
    """It prints, starts a grandchild, then sleeps: no output and no CPU is a stall; the
    grandchild (same process group) dies with it, and the message quotes both streams."""
    pidfile = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen(['sleep', '300'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
            "print('before the hang', flush=True)\n"
            "print('TRACE-ON-STDERR', file=sys.stderr, flush=True)\n"
            "time.sleep(300)\n")
    t0 = time.monotonic()
    with pytest.raises(subproc.Stalled) as e:
        subproc.run([PY, "-c", code], cap=600, stall=2.0)
    took = time.monotonic() - t0
    assert took < 60, took  # the stall limit fired, not the cap
    msg = str(e.value)
    assert "no output and no CPU use" in msg and "stall limit 2 s" in msg, msg
    assert "before the hang" in msg and "TRACE-ON-STDERR" in msg, msg
    assert e.value.output.startswith("before the hang")
    gpid = int(pidfile.read_text())
    for _ in range(50):  # SIGKILLed; its parent was killed too, so init reaps it
        try:
            os.kill(gpid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{gpid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {gpid} still running after the stall kill")


def test_a_spinning_child_is_killed_at_its_scaled_cap(monkeypatch):
    monkeypatch.setenv("DEEPINFER_TEST_TIME_SCALE", "1")
    t0 = time.monotonic()
    with pytest.raises(subproc.Stalled) as e:
        subproc.run([PY, "-c", "print('spinning', flush=True)\nwhile True: pass"], cap=2,
                    stall=600)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "ran past its limit" in msg and "cap 2 s" in msg and "spinning" in msg, msg
    # killed at 2 s times the load scale seen while it ran (the machine may be busy)
    assert 2 <= took < 2 * max(subproc.time_scale(), 1.0) * 2 + 10, took


def test_time_scale_is_load_per_core_and_the_user_factor(monkeypatch):
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * cores, 0.0, 0.0))
    monkeypatch.delenv("DEEPINFER_TEST_TIME_SCALE", raising=False)
    assert subproc.load_scale() == pytest.approx(3.0)
    assert subproc.time_scale() == pytest.approx(3.0)
    monkeypatch.setenv("DEEPINFER_TEST_TIME_SCALE", "2.5")
    assert subproc.time_scale() == pytest.approx(7.5)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.0, 0.0))  # idle: never below 1
    assert subproc.time_scale() == pytest.approx(2.5)
    monkeypatch.setenv("DEEPINFER_TEST_TIME_SCALE", "fast")
    with pytest.raises(ValueError, match="DEEPINFER_TEST_TIME_SCALE"):
        subproc.time_scale()


def test_the_cap_grows_with_the_load_seen_while_the_child_runs(monkeypatch):
    """A cap of 1 s at a load of 4 per core allows about 4 s: a 2 s child finishes."""
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0 * cores, 0.0, 0.0))
    monkeypatch.delenv("DEEPINFER_TEST_TIME_SCALE", raising=False)
    r = subproc.run([PY, "-c", "import time; time.sleep(2); print('ok')"], cap=1, stall=60)
    assert r.stdout == "ok\n"


def test_group_cpu_ticks_counts_the_childs_session():
    import subprocess
    p = subprocess.Popen([PY, "-c", "import time\nt = time.time()\n"
                          "while time.time() - t < 1.5: pass\ntime.sleep(30)"],
                         start_new_session=True)
    try:
        time.sleep(2.0)
        ticks = subproc.group_cpu_ticks(p.pid)
        assert ticks is not None and ticks >= 50, ticks  # >= 0.5 s of CPU, in 10 ms ticks
        assert subproc.group_cpu_ticks(2 ** 22 + 12345) is None  # no such session
    finally:
        p.kill()
        p.wait()


def test_a_daemon_holding_the_pipes_does_not_hold_the_test(monkeypatch):
    """The child exits at once but leaves a grandchild with its stdout: after LINGER_S the
    group is killed and the result returned."""
    monkeypatch.setattr(subproc, "LINGER_S", 1.0)
    t0 = time.monotonic()
    r = subproc.run([PY, "-c", "import subprocess; subprocess.Popen(['sleep', '300']); "
                     "print('parent done')"], cap=60)
    assert r.returncode == 0 and r.stdout == "parent done\n"
    assert time.monotonic() - t0 < 30


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="cap"):
        subproc.run([PY, "-c", "pass"], cap=0)
