"""benchmarks/diag/prefill_tilelang_sm90.py: its --gate lowers and compiles the TileLang sm_90
sparse prefill without a GPU (skipped where TileLang or nvcc is missing), and a torch
emulation of its tiling (64-key tiles, the score tile split into two 32-column halves whose
row max / sum are combined, exp2-domain online softmax, sink, masks, clamped gather of
invalid entries) matches the suite's fp32 reference on CPU."""
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch

import subproc

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "benchmarks" / "diag" / "prefill_tilelang_sm90.py"


def _probe():
    spec = importlib.util.spec_from_file_location("prefill_tilelang_sm90", PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gate_sm90a(tmp_path):
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc missing")
    r = subproc.run([sys.executable, str(PROBE), "--gate", "--out", str(tmp_path / "g.json")],
                    cap=120,
                    env={"CUDA_VISIBLE_DEVICES": "", "TILELANG_CACHE_DIR": str(tmp_path / "c"),
                         "PATH": __import__("os").environ["PATH"]})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    import json
    g = json.loads((tmp_path / "g.json").read_text())
    assert g["wgmma_in_source"] and g["shared_dynamic_bytes"] <= 227 * 1024
    # disjoint warpgroup work: a 64 x 32 score block and a 64 x 256 output block each
    assert sorted(map(tuple, g["wgmma_shapes"])) == [("64", "256", "16"), ("64", "32", "16")]
    assert g.get("spill_store_bytes", 0) == 0


def _emulate(q, kv, idx, lens, sink, scale, m, bn=64):
    """The probe kernel's math per (token, 64-head group), in fp32 with bf16 P."""
    T_, H, D = q.shape
    rows = kv.shape[0]
    out = torch.zeros(T_, H, D)
    qk = scale * m.LOG2E
    for t in range(T_):
        n = int(min(max(int(lens[t]), 0), idx.shape[1]))
        mi = torch.full((H,), m.NEG_LARGE)
        li = torch.zeros(H)
        acc = torch.zeros(H, D)
        for it in range(-(-n // bn)):
            j = it * bn + torch.arange(bn)
            slot = idx[t, j.clamp(max=idx.shape[1] - 1)].long()
            valid = (j < n) & (slot >= 0) & (slot < rows)
            k = kv[slot.clamp(0, rows - 1)].float()
            s = q[t].float() @ k.T
            s = torch.where(valid[None, :], s * qk, torch.tensor(m.NEG_LARGE))
            # two warpgroups: 32 columns each, row max combined across them
            mx = torch.maximum(s[:, :bn // 2].amax(1), s[:, bn // 2:].amax(1))
            mnew = torch.maximum(mi, mx)
            alpha = torch.exp2(mi - mnew)
            p = torch.where(valid[None, :], torch.exp2(s - mnew[:, None]), torch.tensor(0.0))
            li = li * alpha + p[:, :bn // 2].sum(1) + p[:, bn // 2:].sum(1)
            acc = acc * alpha[:, None]
            pb = p.to(torch.bfloat16).float()
            acc[:, :D // 2] += pb @ k[:, :D // 2]
            acc[:, D // 2:] += pb @ k[:, D // 2:]
            mi = mnew
        sk = sink.float() * m.LOG2E
        mf = torch.maximum(mi, sk)
        lf = li * torch.exp2(mi - mf) + torch.exp2(sk - mf)
        fac = torch.exp2(mi - mf) / lf.clamp(min=m.MIN_DENOM)
        ok = (li > 0) & (lf > 0)
        out[t] = torch.where(ok[:, None], acc * fac[:, None], torch.tensor(0.0))
    return out.to(torch.bfloat16)


def test_tiling_emulation_matches_reference():
    m = _probe()
    g = torch.Generator().manual_seed(0)
    T_, H, D, rows, width = 6, 64, 512, 300, 192
    q = torch.randn(T_, H, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(rows, D, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, rows + 3, (T_, width), generator=g, dtype=torch.int32)
    lens = torch.tensor([0, 1, 70, 128, 150, 192], dtype=torch.int32)
    idx[2, :] = -1  # a row whose keys are all invalid: zeros
    sink = torch.randn(H, generator=g)
    scale = D ** -0.5
    got = _emulate(q, kv, idx, lens, sink, scale, m).float()
    # the suite's reference semantics (fp32, sink in the denominator, masked entries)
    ref = torch.zeros(T_, H, D)
    for t in range(T_):
        n = int(lens[t])
        sl = idx[t, :n].long()
        sl = sl[(sl >= 0) & (sl < rows)]
        if len(sl) == 0:
            continue
        k = kv[sl].float()
        lg = torch.cat([q[t].float() @ k.T * scale, sink[:, None]], 1)
        ref[t] = torch.softmax(lg, 1)[:, :-1] @ k
    assert got[0].abs().max() == 0 and got[2].abs().max() == 0
    assert (got - ref).abs().max() < 2e-2
