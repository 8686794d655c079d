#!/usr/bin/env python3
"""Time the steps of a make run and print where the time went (stdlib only).

    python tools/steptime.py [--dir DIR] reset
    python tools/steptime.py [--dir DIR] run NAME -- CMD [ARG...]
    python tools/steptime.py [--dir DIR] report [--title TEXT]

``run`` executes CMD (its output and exit status pass through unchanged) and records NAME's
start, end and exit status in DIR/NAME.json (DIR: build/timings). ``report`` prints one row
per step recorded since ``reset``, in start order: when it started after the first step,
how long it took, and its result; then the wall time from the first start to the last end
beside the sum of the steps (steps run in parallel overlap). A step make found up to date
did not run and has no row. ``make verify`` and ``make test`` print this table last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("DEEPINFER_BUILD", "build")) / "timings"


def _fmt(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s"


def reset(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for p in d.glob("*.json"):
        p.unlink()


def run(d: Path, name: str, cmd: list[str]) -> int:
    if not cmd:
        raise SystemExit("steptime run: no command after --")
    if "/" in name or not name:
        raise SystemExit(f"steptime run: bad step name {name!r}")
    d.mkdir(parents=True, exist_ok=True)
    start = time.time()
    try:
        rc = subprocess.call(cmd)
    except OSError as e:  # command not found: a failed step, recorded as such
        print(f"steptime: {name}: {e}", file=sys.stderr)
        rc = 127
    except KeyboardInterrupt:
        rc = 130
    rec = {"name": name, "start": start, "end": time.time(), "rc": rc, "cmd": cmd}
    tmp = d / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, d / f"{name}.json")
    return rc


def load(d: Path) -> list[dict]:
    recs = []
    for p in sorted(d.glob("*.json")):
        try:
            recs.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(recs, key=lambda r: (r["start"], r["name"]))


def table(recs: list[dict], title: str = "steps") -> str:
    if not recs:
        return f"{title}: no step ran (all up to date)"
    t0 = min(r["start"] for r in recs)
    t1 = max(r["end"] for r in recs)
    width = max(len("step"), *(len(r["name"]) for r in recs))
    rows = [f"{title} (in start order; a step make found up to date has no row):",
            f"  {'step':{width}s}  {'start':>9s}  {'time':>12s}  result"]
    for r in recs:
        res = "ok" if r["rc"] == 0 else f"FAILED (exit {r['rc']})"
        rows.append(f"  {r['name']:{width}s}  {'+' + _fmt(r['start'] - t0):>9s}  "
                    f"{_fmt(r['end'] - r['start']):>12s}  {res}")
    busy = sum(r["end"] - r["start"] for r in recs)
    rows.append(f"  wall {_fmt(t1 - t0)} for {_fmt(busy)} of steps"
                + (f" ({busy / (t1 - t0):.1f} at a time on average)" if t1 > t0 else ""))
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the records live")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("reset")
    r = sub.add_parser("run")
    r.add_argument("name")
    r.add_argument("command", nargs=argparse.REMAINDER)
    rep = sub.add_parser("report")
    rep.add_argument("--title", default="steps")
    a = ap.parse_args(argv)
    if a.cmd == "reset":
        reset(a.dir)
        return 0
    if a.cmd == "run":
        cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
        return run(a.dir, a.name, cmd)
    print(table(load(a.dir), a.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
