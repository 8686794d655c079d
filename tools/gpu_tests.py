"""Run the repository's ``gpu``-marked tests against an installed vLLM and keep the outcome as
a results file (rows kernel="gpu_tests").

The tests that probe vLLM in a subprocess (tests/test_spec_decode_layer.py and the others that
use tests/test_vllm_import.py's probe environment) look for a patched vLLM tree at
``$DEEPINFER_BUILD/patched`` with a ``.ok`` marker. On a GPU machine the vLLM to test is an
installed one (a site directory holding vLLM with this overlay installed, its compiled
extensions and its dependencies), so this command builds a stand-in ``patched`` folder of
links to every entry of that site directory, leaving the site directory itself untouched.

    python tools/gpu_tests.py --site /tmp/site --out benchmarks/results \\
        tests/test_spec_decode_layer.py tests/test_mhc_decode_fused.py

It refuses to start without a CUDA device (the tests would all skip) and without the overlay
installed in the site directory. One row per test file: pass/fail/skip counts from pytest's
JUnit XML, the failing test ids, the return code. The file is named
``<gpu>-<date>-gpu-tests-<commit>.json`` like the other results files.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def stand_in_tree(site: Path, build: Path) -> Path:
    """``build/patched``: a link to each entry of ``site`` and the ``.ok`` marker the tests'
    availability check wants (written last, so it is newer than every patch file)."""
    if not (site / "vllm" / "deepinfer" / "__init__.py").is_file():
        raise SystemExit(f"--site {site}: no vllm/deepinfer in it (install the overlay first: "
                         "tools/install_overlay.py install --vllm-dir <site>/vllm ...)")
    tree = build / "patched"
    tree.mkdir(parents=True, exist_ok=True)
    for entry in site.iterdir():
        link = tree / entry.name
        if not link.exists():
            link.symlink_to(entry.resolve())
    # The other build outputs the tests read (the generated upstream kernels), from the
    # repository's own build folder where it has them.
    for name in ("upstream_kernels",):
        src, dst = REPO / "build" / name, build / name
        if src.is_dir() and not dst.exists():
            dst.symlink_to(src.resolve())
    (tree / ".ok").write_text("stand-in for an installed vLLM: " + str(site) + "\n")
    return tree


def junit_counts(xml_path: Path) -> dict:
    """Counts and failing test ids of one pytest JUnit XML file."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = dict(passed_count=0, failed=0, errors=0, skipped=0, failing=[])
    for s in suites:
        for case in s.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None:
                out["failed"] += 1
                out["failing"].append(name)
            elif case.find("error") is not None:
                out["errors"] += 1
                out["failing"].append(name)
            elif case.find("skipped") is not None:
                out["skipped"] += 1
            else:
                out["passed_count"] += 1
    return out


def gpu_name() -> str:
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: the gpu tests would all skip")
    return torch.cuda.get_device_name()


def commit() -> str:
    c = os.environ.get("DEEPINFER_COMMIT")
    if c:
        return c[:7]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "dev"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="test files (their gpu-marked tests run)")
    ap.add_argument("--site", type=Path, required=True,
                    help="site directory of the installed vLLM with the overlay")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("-k", default=None, help="pytest -k selection")
    args = ap.parse_args(argv)
    for f in args.files:
        if not (REPO / f).is_file():
            ap.error(f"{f}: no such test file")
    name = gpu_name()
    import torch
    import triton
    build = Path(tempfile.mkdtemp(prefix="deepinfer-gpu-tests-"))
    stand_in_tree(args.site.resolve(), build)
    env = dict(os.environ, DEEPINFER_BUILD=str(build))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.site.resolve()),
                                                      env.get("PYTHONPATH", "")]))
    rows = []
    for f in args.files:
        xml = build / (Path(f).stem + ".xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-m", "gpu", f,
               f"--junitxml={xml}"] + (["-k", args.k] if args.k else [])
        r = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True)
        print(r.stdout[-3000:], r.stderr[-2000:], sep="\n", flush=True)
        counts = junit_counts(xml) if xml.is_file() else dict(error="no JUnit XML written")
        rows.append(dict(kernel="gpu_tests", variant="pytest",
                         shape=dict(file=f, commit=commit(), marker="gpu", k=args.k),
                         passed=r.returncode == 0 and counts.get("failed", 1) == 0
                         and counts.get("errors", 1) == 0 and counts.get("passed_count", 0) > 0,
                         returncode=r.returncode, **counts, tail=r.stdout[-1500:]))
    meta = dict(gpu=name, torch=torch.__version__, triton=triton.__version__,
                vllm=_vllm_version(args.site), commit=commit(),
                date=datetime.date.today().isoformat(),
                source_note="tools/gpu_tests.py: pytest -m gpu on each file against the "
                            f"installed vLLM in {args.site}")
    gpu = name.split()[-1].lower() if name.startswith("NVIDIA") else name.replace(" ", "-").lower()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{gpu}-{meta['date']}-gpu-tests-{meta['commit']}.json"
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {out}: " + ", ".join(f"{r['shape']['file']} {'PASS' if r['passed'] else 'FAIL'}"
                                       for r in rows))
    return 0 if all(r["passed"] for r in rows) else 1


def _vllm_version(site: Path) -> str | None:
    for p in site.glob("vllm-*.dist-info"):
        return p.name[len("vllm-"):-len(".dist-info")]
    return None


if __name__ == "__main__":
    sys.exit(main())
