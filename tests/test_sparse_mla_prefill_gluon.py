"""The Hopper producer/consumer prefill kernel (kernels/sparse_mla_prefill_gluon.py, the
``sm90`` row of kernels/sparse_mla_prefill.py, ``Tile.gluon_ws``; ``sm90-triton`` is the
Triton tile it falls back to).

On CPU: its selection and fallback (the row runs the sm90 Triton tile where the Gluon
kernel cannot run, and says why once), and its sm_90 build (shared memory within the
227 KiB of an sm_90 block, the wgmmas per consumer loop, no local memory, the register
split). Gluon has no interpreter, so its numerics are tested on a GPU: at production shapes
beside upstream's kernel by test_sparse_mla_prefill's GPU tests (the sm90 row is this
kernel on sm_90); here, against the fp32 reference bound, lists whose maxima grow across
many block pairs (the running max is handed between the two consumer warpgroups every
pair); lengths that leave a pair half empty; dense and ragged lists; head counts that leave
rows of a 64-head tile unused; no sink; a strided workspace; the zero rows (no valid key,
NaN key) and a NoPE-only output; programs that loop over many items against one program
per item, bit for bit.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from compiled import run_json
from test_sparse_mla_prefill import (NOPE, D, _gpu_case, assert_close, key_lists, make,
                                     reference, run, tile_rows)  # noqa: F401 (fixture)
from vllm.deepinfer import arch
from vllm.deepinfer.kernels import sparse_mla_prefill as spm
from vllm.deepinfer.kernels import sparse_mla_prefill_gluon as glp

ROW = "sm90"
TRITON_ROW = "sm90-triton"

hopper = pytest.mark.skipif(not (torch.cuda.is_available()
                                 and torch.cuda.get_device_capability()[0] >= 9),
                            reason="the Gluon kernel runs on sm_90 and later only")


# ----------------------------------------------------------------------------- CPU
def test_row_is_the_sm90_tile_plus_the_switch():
    t = spm.TILES[ROW]
    assert t.gluon_ws and not spm.TILES[TRITON_ROW].gluon_ws
    assert dataclasses.replace(t, gluon_ws=False) == spm.TILES[TRITON_ROW]
    assert not spm.uses_gluon_ws(spm.TILES[TRITON_ROW], torch.device("cpu"), True)


def test_fallback_is_logged_once_per_reason(monkeypatch, caplog):
    arch.log_once.cache_clear()
    t = spm.TILES[ROW]
    with caplog.at_level(logging.INFO, logger="vllm.deepinfer"):
        assert not spm.uses_gluon_ws(t, torch.device("cpu"), True)
        assert not spm.uses_gluon_ws(t, torch.device("cpu"), False)
        monkeypatch.setattr(glp, "AVAILABLE", False)
        assert not spm.uses_gluon_ws(t, torch.device("cpu"), True)
    msgs = [r.getMessage() for r in caplog.records if "producer/consumer" in r.getMessage()]
    head = "deepinfer: sparse_mla_prefill: the Gluon producer/consumer row runs the Triton tile"
    assert msgs == [f"{head} (the Triton interpreter runs no Gluon kernel)",
                    f"{head} (this Triton has no Gluon)"]
    arch.log_once.cache_clear()


@pytest.mark.skipif(not glp.AVAILABLE, reason="this Triton has no Gluon")
def test_choice_on_a_cuda_device_is_logged_once_per_reason(monkeypatch, caplog):
    """Off the interpreter, with the device's capability faked: below 9.0 and with unaligned
    rows the row runs the Triton tile, on 9.0 the Gluon kernel; each says so once."""
    arch.log_once.cache_clear()
    monkeypatch.setattr(arch, "interpreting", lambda: False)
    cc = {"v": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc["v"])
    t, dev = spm.TILES[ROW], torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="vllm.deepinfer"):
        assert not spm.uses_gluon_ws(t, torch.device("cpu"), True)
        assert not spm.uses_gluon_ws(t, dev, True)
        assert not spm.uses_gluon_ws(t, dev, True)
        cc["v"] = (9, 0)
        assert not spm.uses_gluon_ws(t, dev, False)
        assert spm.uses_gluon_ws(t, dev, True)
        assert spm.uses_gluon_ws(t, dev, True)
    msgs = [r.getMessage() for r in caplog.records if "producer/consumer" in r.getMessage()]
    head = "deepinfer: sparse_mla_prefill: the Gluon producer/consumer row runs the Triton tile"
    assert msgs == [f"{head} (tensors on cpu, not on a CUDA device)",
                    f"{head} (compute capability 8.0: warp specialization needs 9.0)",
                    f"{head} (q, kv or out rows not 16-byte aligned)",
                    "deepinfer: sparse_mla_prefill: the sm90 row runs the Gluon "
                    "producer/consumer kernel (compute capability 9.0)"]
    arch.log_once.cache_clear()


def test_row_runs_the_triton_tile_where_gluon_cannot(device):
    """In the interpreter (and on CPU tensors) the row's output is the Triton tile's, bit
    for bit: the same kernel runs."""
    if device != "cpu":
        pytest.skip("the fallback is exercised on CPU")
    q, kv, idx, sink = make(3, tokens=3, heads=16, rows=70, width=80, invalid=0.1,
                            device=device)
    lens = torch.tensor([80, 33, 0], dtype=torch.int32)
    a = run(q, kv, idx, lens, sink, ROW)
    b = run(q, kv, idx, lens, sink, TRITON_ROW)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


_BUILD = r"""
import json, re, subprocess, tempfile, triton
from vllm.deepinfer.kernels import sparse_mla_prefill as spm
from vllm.deepinfer.compile_gate import compile_spec
k = compile_spec(spm.gluon_ws_spec(), 90)
bin_ = triton.__path__[0] + "/backends/nvidia/bin/"
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(k.asm["cubin"]); f.flush()
    sass = subprocess.run([bin_ + "cuobjdump", "-sass", f.name], capture_output=True,
                          text=True).stdout
    ru = subprocess.run([bin_ + "cuobjdump", "--dump-resource-usage", f.name],
                        capture_output=True, text=True).stdout
print(json.dumps(dict(shared=k.metadata.shared, hgmma=sass.count("HGMMA."),
                      local=sass.count("LDL") + sass.count("STL"),
                      stack=int(re.search(r"STACK:(\d+)", ru).group(1)),
                      setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)",
                                                       k.asm["ptx"]))))))
"""


@pytest.mark.skipif(not glp.AVAILABLE, reason="this Triton has no Gluon")
def test_hopper_build():
    """sm_90 build (in a subprocess: TRITON_INTERPRET, set for the CPU suite, replaces jit
    functions): within an sm_90 block's 227 KiB; each consumer's loop issues 40 wgmmas
    (Q.K^T: 32 of 64 x 64 x 16; P.V: 2 x 4 of 64 x 256 x 16), 80 in the two consumer
    partitions; no local memory; the partitions take the register split of the module."""
    import json
    import os
    import sys
    from pathlib import Path

    import subproc
    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(repo / "overlay")
    r = subproc.run([sys.executable, "-c", _BUILD], env=env, cap=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert 208 * 1024 <= got["shared"] <= 227 * 1024, got
    assert got["hgmma"] == 40 + 40 + 32, got
    assert got["local"] == 0 and got["stack"] == 0, got
    regs = {int(n) for _, n in got["setmaxnreg"]}
    assert {glp.CONSUMER_REGS, glp.PRODUCER_REGS} <= regs, got
    assert 3 * glp.MAXNREG - glp.CONSUMER_REGS - glp.PRODUCER_REGS in regs, got


# ----------------------------------------------------------------------------- GPU
@hopper
@pytest.mark.gpu
def test_sm90_row_runs_the_gluon_kernel_on_hopper():
    """On sm_90 the sm90 row runs this kernel at production launches (aligned rows), so
    test_sparse_mla_prefill's GPU tests (production shapes beside upstream's kernel, zero
    rows, NoPE-only output) test it there; sm90-triton keeps the Triton tile in them."""
    assert spm.uses_gluon_ws(spm.TILES[ROW], torch.device("cuda"), True)
    assert not spm.uses_gluon_ws(spm.TILES[TRITON_ROW], torch.device("cuda"), True)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("order", ["ascending", "descending", "alternating"])
def test_growing_maxima_over_many_pairs(order):
    """Key magnitudes grow along the list (x1.5 per 32 rows) so the running max moves in
    every block and is handed between the consumers every pair; lengths that end inside a
    pair, inside a block, and at a pair boundary."""
    rows = 700
    grow = 1.5 ** (torch.arange(rows, dtype=torch.float32) / 32)
    q, kv, idx, sink = make(11, tokens=4, heads=64, rows=rows, width=rows, device="cuda",
                            scale_rows=grow)
    base = torch.arange(rows, dtype=torch.int32, device="cuda")
    if order == "descending":
        base = base.flip(0)
    elif order == "alternating":  # big and small keys in turn: WG1's block raises WG0's max
        base = torch.stack([base[: rows // 2].flip(0), base[rows // 2:]], 1).flatten()
    idx[:] = base
    lens = torch.tensor([700, 640, 257, 128], dtype=torch.int32, device="cuda")
    assert_close(run(q, kv, idx, lens, sink, ROW),
                 reference(q, kv, key_lists(idx.cpu(), lens), sink))


@hopper
@pytest.mark.gpu
def test_ragged_heads_no_sink_strided_workspace():
    """Ragged lists equal the dense ones bit for bit; 80 heads (the second 64-head tile has
    16 live rows); no sink; a workspace whose row stride is not 512."""
    q, kv, idx, sink = make(12, tokens=6, heads=80, rows=300, width=200, invalid=0.15,
                            device="cuda")
    lens = torch.tensor([200, 0, 64, 65, 129, 199], dtype=torch.int32, device="cuda")
    wide = torch.zeros(kv.shape[0], D + 64, dtype=kv.dtype, device="cuda")
    wide[:, :D] = kv
    kvs = wide[:, :D]
    for s in (sink, None):
        dense = run(q, kvs, idx, lens, s, ROW)
        assert_close(dense, reference(q, kv, key_lists(idx.cpu(), lens), s))
        flat = torch.cat([idx[t, :lens[t]] for t in range(6)])
        indptr = torch.zeros(7, dtype=torch.int32, device="cuda")
        indptr[1:] = lens.cumsum(0)
        ragged = spm.sparse_attn_prefill(q, kvs, spm_scale(), s, NOPE, D - NOPE,
                                         ragged_indices=flat, ragged_indptr=indptr, variant=ROW)
        assert torch.equal(ragged.view(torch.int16), dense.view(torch.int16))


def spm_scale():
    from test_sparse_mla_prefill import SCALE
    return SCALE


@hopper
@pytest.mark.gpu
def test_zero_rows_and_nope_output():
    """As test_sparse_mla_prefill's GPU semantics test: a row of invalid entries, a zero
    length and a NaN key row give zeros; a 448-wide output is the 512-wide one's first 448
    columns, bit for bit."""
    q, kv, idx, lens, sink = _gpu_case(8, 64, 512, 128, 2048, 1)
    idx[2] = -1
    lens[3] = 0
    kv[int(idx[4, 0])] = float("nan")
    out = run(q, kv, idx, lens, sink, ROW)
    assert torch.equal(out[2:5].float(), torch.zeros(3, 64, D, device="cuda"))
    assert out[5:].abs().sum() > 0 and not out.isnan().any()
    narrow = run(q, kv, idx, lens, sink, ROW,
                 out=torch.empty(8, 64, NOPE, dtype=torch.bfloat16, device="cuda"))
    assert torch.equal(narrow.view(torch.int16), out[..., :NOPE].view(torch.int16))


@hopper
@pytest.mark.gpu
def test_unaligned_rows_fall_back_to_the_triton_tile():
    """A Q whose rows are not 16-byte aligned runs the Triton tile, with the same result as
    the sm90-triton row."""
    q, kv, idx, sink = make(13, tokens=3, heads=64, rows=200, width=150, device="cuda")
    lens = torch.tensor([150, 90, 10], dtype=torch.int32, device="cuda")
    wide = torch.zeros(3, 64, D + 1, dtype=q.dtype, device="cuda")
    wide[..., :D] = q
    qs = wide[..., :D]
    assert not arch.interpreting()
    a = run(qs, kv, idx, lens, sink, ROW)
    b = run(qs, kv, idx, lens, sink, TRITON_ROW)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("sms", [1, 2, 5])
def test_programs_that_loop_over_items_match_one_program_per_item(monkeypatch, tile_rows, sms):
    """One program per SM loops over (token, head tile) items, carrying the buffer
    barriers' phases across them: with 1, 2 and 5 programs (many items each, items without
    keys among them, lengths that end mid-pair) the output equals, bit for bit, the launch
    with one program per item (the same arithmetic per item), which meets the reference."""
    from vllm.deepinfer import arch as arch_mod
    q, kv, idx, sink = make(14, tokens=9, heads=128, rows=400, width=330, invalid=0.1,
                            device="cuda")
    lens = torch.tensor([330, 0, 64, 0, 0, 129, 300, 1, 200], dtype=torch.int32,
                        device="cuda")
    per_item = tile_rows("test-per-item", base=ROW, persistent=False)
    want = run(q, kv, idx, lens, sink, per_item)
    assert_close(want, reference(q, kv, key_lists(idx.cpu(), lens), sink))
    monkeypatch.setattr(arch_mod, "sm_count", lambda device=None: sms)
    assert glp.programs(9 * 2, sms) == sms
    got = run(q, kv, idx, lens, sink, ROW)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
