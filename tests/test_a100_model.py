"""tools/a100_model.py: the SASS parser, the per-scheduler simulation, the bounds, the GPU
tables, the runtime specialization, and the committed validation against the H200 results.

Everything here runs in well under a minute on CPU; one test compiles a small kernel for
sm_80 and sm_90 in a subprocess (compilation needs TRITON_INTERPRET unset).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import a100_model as m
import subproc

REPO = Path(__file__).resolve().parent.parent
VALIDATION = REPO / "benchmarks" / "results" / "a100-model-validation.json"
DOC = REPO / "docs" / "a100-model.md"


def hi(stall=1, wbar=7, rbar=7, wait=0, low=0x0000000000000000):
    """The high 64 bits of an instruction with these control bits (bits 41..57)."""
    return ((wait << 11 | rbar << 8 | wbar << 5 | stall) << 41) | low


def sass(lines: list[tuple[int, str, int]]) -> str:
    """cuobjdump-style text for (address, instruction, high word) triples."""
    out = ["\tcode for sm_80", "\t\tFunction : probe_kernel"]
    for addr, text, h in lines:
        out.append(f"        /*{addr:04x}*/                   {text} ;"
                   f"        /* 0x0000000000000000 */")
        out.append(f"                                                    /* 0x{h:016x} */")
    return "\n".join(out) + "\n"


# Real sm_80 control words (from the decode kernel's build): IMAD.MOV (stall 2), S2R
# (stall 4, sets scoreboard 0), LDG.E.128 (stall 2, sets scoreboard 3).
REAL = [(0x00, "IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28]", 0x000FE400078E00FF),
        (0x10, "S2R R248, SR_CTAID.X", 0x000E280000002500),
        (0x20, "@P5 LDG.E.128 R8, [R52.64]", 0x000EE4000C1E1D00)]


def test_parse_real_control_words_and_classes():
    insts = m.parse_sass(sass(REAL))["probe_kernel"]
    assert [(i.base, i.cls, i.stall, i.wbar, i.rbar, i.wait) for i in insts] == [
        ("IMAD", "int", 2, 7, 7, 0), ("S2R", "misc", 4, 0, 7, 0), ("LDG", "ldg", 2, 3, 7, 0)]
    assert insts[2].guarded and not insts[0].guarded
    assert insts[2].op == "LDG.E.128" and m.access_bytes(insts[2]) == 512


def test_parse_rejects_missing_control_word():
    text = "\t\tFunction : k\n        /*0000*/   NOP ;   /* 0x0000000000007918 */\n"
    with pytest.raises(m.ModelError, match="no control word"):
        m.parse_sass(text)


def test_loops_from_back_edges_not_the_exit_trap():
    insts = m.parse_sass(sass([
        (0x00, "S2R R0, SR_TID.X", hi()), (0x10, "FFMA R1, R1, R1, R1", hi()),
        (0x20, "FFMA R2, R2, R2, R2", hi()), (0x30, "@P0 BRA 0x10", hi()),
        (0x40, "@P1 EXIT", hi()), (0x50, "EXIT", hi()), (0x60, "BRA 0x60", hi())]))["probe_kernel"]
    loops = m.find_loops(insts)
    assert loops == [m.Loop(0x10, 0x30)]          # BRA 0x60 (to itself) is not a loop
    code = m.Code("probe", 80, 4, 0, 32, insts, loops)
    regions = code.regions()
    assert [i.addr for i in regions[0]] == [0x10, 0x20, 0x30]
    assert len(regions[-1]) == 4
    assert [i.addr for i in code.head(0)] == [0x00, 0x10, 0x20, 0x30, 0x40]
    with pytest.raises(m.ModelError, match="no early exit #1"):
        code.head(1)


def test_tensor_instruction_flops():
    ins = m.parse_sass(sass([(0, "HMMA.16816.F32.BF16 R4, R8, R12, R4", hi()),
                             (0x10, "HGMMA.64x32x16.F32.BF16 R168, gdesc[UR4], R168", hi())]))
    h, g = ins["probe_kernel"]
    assert m.hmma_flops(h) == 2 * 16 * 8 * 16
    assert m.hmma_flops(g) == 2 * 64 * 32 * 16 // 4     # one warp's quarter of the warpgroup


def test_pipe_mapping_differs_where_the_hardware_does():
    i2fp = m.parse_sass(sass([(0, "I2FP.F32.U32 R1, R1", hi())]))["probe_kernel"][0]
    i2f = m.parse_sass(sass([(0, "I2F.U32 R1, R1", hi())]))["probe_kernel"][0]
    assert m.pipe_costs(i2f, m.A100_40GB)["xu"] == 1.0       # quarter-rate conversion
    assert "alu" in m.pipe_costs(i2fp, m.H200)                # sm_90's I2FP: the ALU
    wide = m.parse_sass(sass([(0, "IMAD.WIDE.U32 R2, R1, R1, RZ", hi())]))["probe_kernel"][0]
    assert m.pipe_costs(wide, m.A100_40GB)["fma"] == 2.0


def test_gpu_tables_reproduce_the_datasheets():
    a = m.A100_40GB
    assert abs(a.tensor_tflops - 312) / 312 < 0.01            # dense bf16
    assert abs(a.fp32_tflops() - 19.5) / 19.5 < 0.01
    assert (m.A100_40GB.hbm_gbps, m.A100_80GB.hbm_gbps) == (1555.0, 2039.0)
    assert m.A100_40GB.sms == m.A100_80GB.sms == 108 and m.H200.sms == 132
    assert abs(m.H200.wgmma_flops_per_clk * 132 * 1.83 / 1e3 - 989) / 989 < 0.01


def _stream(n, text="LOP3.LUT R1, R1, R2, RZ, 0xc0, !PT", **kw):
    return m.parse_sass(sass([(16 * k, text, hi(**kw)) for k in range(n)]))["probe_kernel"]


def test_simulation_pipe_rate_and_latency_hiding():
    alu = _stream(20)
    one = m.simulate(alu, m.A100_40GB, 1, 1)[0]
    two = m.simulate(alu, m.A100_40GB, 2, 1)[0]
    # The ALU pipe takes a warp instruction every 2 cycles per scheduler on GA100.
    assert 39 <= one <= 41 and 79 <= two <= 81
    # A load, then an instruction waiting on its scoreboard: DRAM latency, once per warp,
    # overlapped between warps.
    ld = m.parse_sass(sass([(0, "LDG.E R4, [R2.64]", hi(wbar=0)),
                            (0x10, "FADD R4, R4, R4", hi(wait=1))]))["probe_kernel"]
    lat = m.A100_40GB.latency["dram"]
    t1 = m.simulate(ld, m.A100_40GB, 1, 1)[0]
    t4 = m.simulate(ld, m.A100_40GB, 4, 1)[0]
    assert lat <= t1 <= lat + 4 and t4 < 1.05 * t1
    # Halving the latencies halves the wait.
    assert m.simulate(ld, m.A100_40GB, 1, 1, scale=0.5)[0] <= lat / 2 + 4


def test_bounds_waves_memory_and_launch():
    body = _stream(100, "FFMA R1, R1, R1, R1")
    insts = body + m.parse_sass(sass([(16 * 100, "@P0 BRA 0x0", hi())]))["probe_kernel"]
    code = m.Code("probe", 80, 4, 0, 64, insts, m.find_loops(insts))
    gpu = m.A100_40GB
    one = m.launch_bounds(m.Launch(code, gpu.sms, {0: 10}), gpu)
    two = m.launch_bounds(m.Launch(code, gpu.sms + 1, {0: 10}), gpu)
    # One program per SM vs one SM with two: the busiest SM sets the time.
    assert two["programs_per_sm"] == 2 and one["programs_per_sm"] == 1
    assert two["cycles"]["fma"] == pytest.approx(2 * one["cycles"]["fma"])
    # 101 FFMA x 10 trips x 4 warps on a 2-per-clock pipe.
    assert one["cycles"]["fma"] == pytest.approx(10 * 100 * 4 / 2)
    wl = m.Workload("probe", "sm80", {}, [m.Launch(code, gpu.sms, {0: 10})], 0.0, 0.0)
    p = m.predict(wl, gpu)
    sm_us = max(one["cycles"].values()) / (gpu.clock_ghz * 1e3)
    assert p["us"] == pytest.approx(gpu.launch_us + sm_us) and p["bound"] != "memory"
    heavy = m.Workload("probe", "sm80", {}, wl.launches, 1e9, 0.0)   # 1 GB
    q = m.predict(heavy, gpu)
    assert q["bound"] == "memory"
    assert q["us"] == pytest.approx(1e9 / (gpu.hbm_gbps * gpu.hbm_efficiency) * 1e-3
                                    + gpu.launch_us)
    assert q["limit_us"] == pytest.approx(1e9 / gpu.hbm_gbps * 1e-3)


def test_occupancy_limits():
    gpu = m.A100_40GB
    code = m.Code("k", 80, 4, 48 * 1024, 255, [], [])
    assert m.occupancy(code, gpu) == 2          # 255 registers x 128 threads: two CTAs
    small = m.Code("k", 80, 4, 60 * 1024, 32, [], [])
    assert m.occupancy(small, gpu) == 2         # 164 KiB / 61 KiB of shared memory


def test_runtime_specialization_follows_triton():
    """Integers equal to 1 become constants, multiples of 16 get divisibility, pointers are
    aligned, do_not_specialize arguments are left alone (as Triton's launcher does)."""
    from vllm.deepinfer.compile_gate import specs
    spec = {s.name: s for s in specs()}["kv_gather.T16w4.e4b15.R16.gl"]
    sig, constexprs, attrs = m.runtime_attrs(spec, dict(out_s0=1, out_s1=512, page_stride=37376,
                                                        bt_stride=17, num_reqs=32))
    names = [p[0] for p in m._params(spec.kernel)]
    assert sig["out_s0"] == "constexpr" and constexprs["out_s0"] == 1
    assert (names.index("out_s1"),) in attrs and (names.index("page_stride"),) in attrs
    assert (names.index("bt_stride"),) not in attrs
    assert (names.index("num_reqs"),) not in attrs          # do_not_specialize
    assert (names.index("cache_ptr"),) in attrs
    assert m.runtime_attrs(spec, None)[2] == {}


# --------------------------------------------------------------------------- committed
@pytest.fixture(scope="module")
def validation():
    if not VALIDATION.is_file():
        pytest.fail(f"{VALIDATION} missing: run python tools/a100_model.py validate --json ...")
    return json.loads(VALIDATION.read_text())


def test_validation_rows_are_the_committed_measurements(validation):
    """Every validated row carries the measured time of the results file it names, and its
    error is the predicted time over that measurement."""
    cache: dict = {}
    for r in validation["rows"]:
        src = cache.setdefault(r["source"], json.loads(
            (REPO / "benchmarks" / "results" / r["source"]).read_text()))
        match = [x for x in src["rows"] if x["kernel"] == r["kernel"]
                 and x["variant"] == r["variant"] and x["shape"] == r["shape"]]
        assert len(match) == 1, (r["kernel"], r["variant"], r["shape"])
        assert r["measured_h200_us"] == match[0]["ours_us"]
        assert r["error"] == pytest.approx(r["predicted_h200_us"] / r["measured_h200_us"] - 1,
                                           abs=1e-3)
    fams = {(r["kernel"], r["variant"]) for r in validation["rows"]}
    for kernel, variants in m.VALIDATION_VARIANTS.items():
        for v in variants:
            assert (kernel, v) in fams, (kernel, v)


def test_validation_summary_and_docs_agree(validation):
    doc = DOC.read_text()
    for key, s in validation["summary"].items():
        errs = [r["error"] for r in validation["rows"] if f"{r['kernel']}[{r['variant']}]" == key]
        assert s["rows"] == len(errs)
        assert s["max_abs_error"] == pytest.approx(max(abs(e) for e in errs), abs=1e-4)
        line = (f"| {key} | {s['rows']} | {s['median_abs_error'] * 100:.0f}% | "
                f"{s['max_abs_error'] * 100:.0f}% | {s['mean_error'] * 100:+.0f}% |")
        assert line in doc, f"docs/a100-model.md lacks the summary line {line!r}"
    # A100 predictions exist beside every Ampere-path row, and never below the roofline.
    for r in validation["rows"]:
        if r["variant"].startswith("sm80"):
            assert r["predicted_a100_40gb_us"] >= r["a100_40gb_limit_us"]
            assert r["predicted_a100_80gb_us"] >= r["a100_80gb_limit_us"]
            assert r["predicted_a100_40gb_us"] >= r["predicted_a100_80gb_us"] - 1e-6


def test_counts_command_compiles_sm80_and_sm90(tmp_path):
    """A real build of the software e4m3 decoder: on sm_80 its int -> float conversion is
    the quarter-rate I2F, on sm_90 the ALU's I2FP (what makes the H200 kinder to the
    Ampere code than an A100 is)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["DEEPINFER_BUILD"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "overlay"), str(REPO / "tools")])
    outs = {}
    for cc in (80, 90):
        r = subproc.run([sys.executable, str(REPO / "tools" / "a100_model.py"), "counts",
                         "--kernel", "fp8._e4m3_decode_kernel[sm80]", "--cc", str(cc), "--ops"],
                        env=env, cap=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs[cc] = r.stdout
    assert "I2F.U32" in outs[80] and "I2FP" not in outs[80]
    assert "I2FP.F32.U32" in outs[90]
    assert "conv=" in outs[80] and "sm_80" in outs[80]


def test_tool_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "overlay"), str(REPO / "tools")])
    env["DEEPINFER_BUILD"] = "/nonexistent-a100-model-cache"
    r = subproc.run([sys.executable, str(REPO / "tools" / "a100_model.py"), "counts",
                     "--kernel", "fp8._e4m3_decode_kernel[sm80]"], env=env, cap=120)
    assert r.returncode == 2 and "TRITON_INTERPRET" in r.stderr


def test_decode_predictions_file():
    """benchmarks/results/a100-model-decode-predictions.json: the measured H200 decode rows
    of the results file it names, unchanged, plus A100 predictions for every Ampere-path row
    (sm80 measured, sm80-2p predicted only) at or above the A100 limit."""
    data = json.loads((REPO / "benchmarks" / "results" /
                       "a100-model-decode-predictions.json").read_text())
    src = json.loads((REPO / "benchmarks" / "results" / "archive/h200-2026-11-29-final.json").read_text())
    measured = {(r["variant"], json.dumps(r["shape"], sort_keys=True)): r["ours_us"]
                for r in src["rows"] if r["kernel"] == "sparse_mla_decode"}
    seen = set()
    for r in data["rows"]:
        key = (r["variant"], json.dumps(r["shape"], sort_keys=True))
        seen.add(key)
        if r["ours_us"] is not None:
            assert measured[key] == r["ours_us"]
        if r["variant"].startswith("sm80"):
            for part in ("40gb", "80gb"):
                assert r[f"predicted_a100_{part}_us"] >= r[f"a100_{part}_limit_us"] > 0
    assert set(measured) <= seen
    two = [r for r in data["rows"] if r["variant"] == "sm80-2p"]
    assert len(two) == 10 and all(r["ours_us"] is None for r in two)


def test_prefill_model_file():
    """benchmarks/results/a100-model-prefill-cd92e29.json: per row of the prefill suite it
    names, the measured H200 times unchanged, errors = predicted / measured - 1, and for the
    Ampere tile A100 predictions of ours and upstream's kernel at or above the A100 limit,
    with their ratio."""
    data = json.loads((REPO / "benchmarks" / "results" /
                       "a100-model-prefill-cd92e29.json").read_text())
    src = json.loads((REPO / "benchmarks" / "results" / data["meta"]["measured"]).read_text())
    measured = {(r["variant"], json.dumps(r["shape"], sort_keys=True)): r
                for r in src["rows"] if r["kernel"] == "sparse_mla_prefill"}
    assert len(data["rows"]) == len(measured) == 72
    for r in data["rows"]:
        src_row = measured[(r["variant"], json.dumps(r["shape"], sort_keys=True))]
        assert r["measured_h200_us"] == src_row["ours_us"]
        assert r["upstream_measured_h200_us"] == src_row["upstream_us"]
        assert r["error"] == pytest.approx(r["predicted_h200_us"] / r["measured_h200_us"] - 1,
                                           abs=1e-3)
        if r["variant"] == "sm80":
            for g in ("a100_40gb", "a100_80gb"):
                assert r[f"predicted_{g}_us"] >= r[f"{g}_limit_us"]
                assert r[f"predicted_speedup_{g}"] == pytest.approx(
                    r[f"upstream_predicted_{g}_us"] / r[f"predicted_{g}_us"], rel=1e-2)
                # The shipped tile's two Q.K^T chains against the same tile with one.
                assert r[f"predicted_{g}_us_one_chain"] > r[f"predicted_{g}_us"]
    s = data["summary"]
    assert s["sm80"]["rows"] == s["sm90"]["rows"] == 36 and s["upstream"]["rows"] == 72


def test_prefill_workload_sees_the_two_chains():
    """The same prefill launch with the Ampere tile's Q.K^T in one chain and in two
    (Tile.qk_halves): real sm_80 builds (in a process without the interpreter), and the
    model predicts the two-chain build faster on an A100, as the H200 measured it (sweep
    3a8606c)."""
    code = """
import dataclasses, json
import a100_model as m
from vllm.deepinfer.kernels import sparse_mla_prefill as spm
shape = dict(tokens=2048, ctx=65536, topk=512, ratio=2, heads=64, keys=640)
us = {}
for halves in (True, False):
    name = f"sm80-test{int(halves)}"  # the sm80 spec, this row's tile
    spm.TILES[name] = dataclasses.replace(spm.TILES["sm80"], qk_halves=halves)
    wl = m.prefill_workload(shape, name, 80, m._prefill_bytes(shape))
    us[str(halves)] = m.predict(wl, m.A100_40GB)["us"]
print(json.dumps(us))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "overlay"), str(REPO / "tools")])
    r = subproc.run([sys.executable, "-c", code], env=env, cap=600)
    assert r.returncode == 0, r.stderr[-2000:]
    us = json.loads(r.stdout.strip().splitlines()[-1])
    assert us["True"] < 0.9 * us["False"], us


def test_prefill_model_leaves_the_gluon_kernel_out(monkeypatch):
    """The sm90 row runs the warp-specialized Gluon kernel, which the model does not
    simulate: its workload is refused with a message naming the Triton row, and results rows
    that ran it (``impl`` gluon_ws) are skipped, not modelled as the Triton tile."""
    import a100_model as m
    shape = dict(tokens=2048, ctx=65536, topk=512, ratio=2, heads=64, keys=640)
    with pytest.raises(m.ModelError, match="sm90-triton"):
        m.prefill_workload(shape, "sm90", 90, m._prefill_bytes(shape))
    row = {"kernel": "sparse_mla_prefill", "variant": "sm90", "impl": "gluon_ws",
           "shape": shape, "ours_us": 450.0, "upstream_us": 1900.0}
    assert m.prefill_rows({"rows": [row]}) == []


# --------------------------------------------------------------------------- provenance
def _provenance_missing(meta: dict) -> list[str]:
    """What benchmarks/results_index.py's --check would say the meta lacks."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import results_index as ri
    return [k for k in ri.REQUIRED if not (isinstance(meta.get(k), str) and meta[k].strip())]


def test_meta_records_gpu_torch_triton_and_commit():
    import subprocess

    import torch
    import triton
    meta = m._meta()
    assert _provenance_missing(meta) == []
    assert meta["gpu"] == "model (no GPU ran): A100-SXM4-40GB, A100-SXM4-80GB, H200-SXM"
    assert meta["torch"] == torch.__version__ and meta["triton"] == triton.__version__
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert meta["commit"] == head and head
    assert set(meta["gpus"]) == set(m.GPUS)          # the tables, whatever was predicted
    # The diagnostic scripts name only the GPUs they predict.
    assert m._meta(("a100-40gb",))["gpu"] == "model (no GPU ran): A100-SXM4-40GB"
    assert set(m._meta(("a100-40gb",))["gpus"]) == set(m.GPUS)
    with pytest.raises(m.ModelError, match="a100-40"):
        m._meta(("a100-40",))
    # The committed files' wording, completed by hand before the writer recorded it.
    for f in sorted((REPO / "benchmarks" / "results").glob("a100-model-*.json")):
        assert json.loads(f.read_text())["meta"]["gpu"].startswith("model (no GPU ran): "), f.name


def test_meta_without_torch_says_not_imported(monkeypatch):
    """A process where torch cannot be imported still writes a torch field (not a made-up
    version)."""
    monkeypatch.setitem(sys.modules, "torch", None)     # import torch -> ImportError
    meta = m._meta()
    assert meta["torch"] == "not imported"
    assert _provenance_missing(meta) == []


def test_written_files_carry_the_provenance(tmp_path, monkeypatch):
    """What the decode and validate commands write (their model work stubbed out: the
    writing path is what is under test) carries gpu, torch, triton and commit."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # nothing is compiled here
    monkeypatch.setattr(m, "decode_predictions", lambda v: [])
    monkeypatch.setattr(m, "validate", lambda: {"meta": m._meta(), "rows": [], "summary": {}})
    dec, val = tmp_path / "decode.json", tmp_path / "validation.json"
    assert m.main(["decode", "--json", str(dec)]) == 0
    assert m.main(["validate", "--json", str(val)]) == 0
    for f in (dec, val):
        meta = json.loads(f.read_text())["meta"]
        assert _provenance_missing(meta) == [], f.name
        assert meta["gpu"].startswith("model (no GPU ran): ")
    assert "ours_us are H200 measurements" in json.loads(dec.read_text())["meta"]["note"]
