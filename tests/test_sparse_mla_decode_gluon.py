"""Phase 2 as the Gluon kernel with 64 or 32 heads per program (kernels/sparse_mla_decode_gluon.py,
``Tile.gluon_heads``, rows sm80-2p-h64 and sm80-2p-h32).

On CPU: its selection (heads, interpreter, rows) and its sm_80 / sm_86 builds (<= 40 KiB of
shared memory, no local memory) — Gluon has no interpreter, so its numerics are tested on a
GPU only: against the fp32 reference bound every decode variant meets, and within one bf16
rounding of the Triton phase 2 of the same row, over split and unsplit launches, inverse
RoPE, invalid slots, NaN bytes, empty rows, head counts that do not fill a 64-head tile, and
a strided Q.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from compiled import run_json
from test_sparse_mla_decode import TOL_ABS, TOL_REL, D, assert_close, run_both, setup
from test_sparse_mla_decode_predequant import odd_pages_extreme_slots_nan
from vllm.deepinfer import arch
from vllm.deepinfer.kernels import sparse_mla_decode as smd
from vllm.deepinfer.kernels import sparse_mla_decode_gluon as glk

ROW = "sm80-2p-h64"
TRITON_ROW = "sm80-2p"  # the same row with the Triton phase 2

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon runs on a GPU only")


def near(got, tri, ref):
    """The Gluon and Triton phase 2 sum the scores in other fp32 orders: both meet the
    reference bound, and they differ by at most that bound (outputs that cancel to near
    zero can move by a few bf16 ulps, so a relative check on the pair alone is too tight)."""
    assert_close(tri, ref)
    _, mag = ref
    err = (got.float() - tri.float()).abs().cpu()
    assert (err <= TOL_ABS + TOL_REL * mag).all(), err.max()


@pytest.mark.parametrize("g", [64, 32])
def test_selection(g):
    row = f"sm80-2p-h{g}"
    t = smd.TILES[row]
    assert dataclasses.replace(t, gluon_heads=0) == smd.TILES[TRITON_ROW]
    assert not smd.uses_gluon(smd.TILES[TRITON_ROW], 64)
    assert not smd.uses_gluon(t, g - 1)
    if glk.AVAILABLE and not arch.interpreting():
        assert smd.uses_gluon(t, g)
        p = smd.phase2_tile(t, 128)
        assert (p.block_h, p.block_n, p.num_warps) == (g, 16, g // 8)
        assert p.ctas_per_sm == {64: 1, 32: 2}[g]
    else:  # the interpreter runs the Triton phase 2
        assert not smd.uses_gluon(t, 128)
    # Fewer heads: the Triton phase 2's plan.
    assert smd.launch_plan(8, 16, 640.0, t, 132) == smd.launch_plan(8, 16, 640.0,
                                                                    smd.TILES[TRITON_ROW], 132)


def test_fallback_is_logged_once_per_reason(monkeypatch, caplog):
    import logging
    arch.log_once.cache_clear()
    monkeypatch.setattr(glk, "AVAILABLE", False)
    t = smd.TILES["sm80-2p-h64"]
    with caplog.at_level(logging.INFO, logger="vllm.deepinfer"):
        assert not smd.uses_gluon(t, 64)
        assert not smd.uses_gluon(t, 128)
    msgs = [r.getMessage() for r in caplog.records if "Gluon phase-2 row" in r.getMessage()]
    assert msgs == ["deepinfer: sparse_mla_decode: a Gluon phase-2 row runs the Triton phase 2 "
                    "(this Triton has no Gluon)"]
    # The plan is then the Triton phase 2's.
    assert smd.launch_plan(64, 64, 640.0, t, 108) == smd.launch_plan(
        64, 64, 640.0, smd.TILES[TRITON_ROW], 108)
    assert not smd.uses_gluon(smd.TILES[TRITON_ROW], 64)  # not a Gluon row: nothing to say
    arch.log_once.cache_clear()


@pytest.mark.skipif(not glk.AVAILABLE or arch.interpreting(), reason="Gluon on a GPU only")
def test_launch_plan_counts_the_gluon_residency():
    t64, t32 = smd.TILES["sm80-2p-h64"], smd.TILES["sm80-2p-h32"]
    # 64 heads, 64 tokens: one CTA per SM at 64 heads (split twice on 132 SMs, not on 108),
    # two at 32 heads (128 CTAs fill 108 x 2 slots unsplit).
    assert smd.launch_plan(64, 64, 640.0, t64, 132) == (64, 2)
    assert smd.launch_plan(64, 64, 640.0, t64, 108) == (64, 1)
    assert smd.launch_plan(64, 64, 640.0, t32, 108) == (32, 1)


_BUILD = """
import json, subprocess, sys, tempfile
import triton
from vllm.deepinfer import compile_gate
out = {}
for s in compile_gate.specs():
    if not s.name.startswith("sparse_mla_decode.gluon"):
        continue
    for cc in s.targets:
        k = compile_gate.compile_spec(s, cc)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([triton.__path__[0] + "/backends/nvidia/bin/cuobjdump",
                                   "-sass", f.name], capture_output=True, text=True).stdout
        out[f"{s.name}@{cc}"] = dict(shared=k.metadata.shared,
                                     hmma=sass.count("HMMA.16816.F32.BF16"),
                                     local=sass.count("LDL") + sass.count("STL"))
print(json.dumps(out))
"""


@pytest.mark.skipif(not glk.AVAILABLE, reason="this Triton has no Gluon")
def test_ampere_builds_fit():
    """The compile gate's specs (32 and 64 heads, direct and partial) for sm_80 and sm_86:
    within 48 KiB, 64 HMMAs per warp and key tile (32 for Q.K^T, 32 for P.V), no local
    memory (spills). Built in a subprocess: TRITON_INTERPRET (set for the CPU suite)
    replaces jit functions."""
    got = run_json(_BUILD)
    assert sorted(got) == sorted(f"sparse_mla_decode.gluon{g}.{m}[sm80-2p]@{cc}"
                                 for g in (32, 64) for m in ("direct", "partial")
                                 for cc in (80, 86))
    for name, f in got.items():
        assert f["shared"] <= 48 * 1024, (name, f)
        assert f["hmma"] == 64, (name, f)
        assert f["local"] == 0, (name, f)


def _both(seed, *, heads, splits, inv_rope=False, q_pad=0, row=ROW, **kw):
    """(h64 output, Triton phase 2 output, reference) for one setup on the GPU."""
    q, mc, mi, mp, sink, ex = setup("cuda", seed, heads=heads, **kw)
    if q_pad:  # a Q whose head stride is not 512
        wide = torch.zeros(q.shape[0], heads, D + q_pad, dtype=q.dtype, device=q.device)
        wide[..., :D] = q
        q = wide[..., :D]
    got, ref = run_both(q, mc, mi, mp, sink, ex, variant=row, splits=splits, inv_rope=inv_rope,
                        device="cuda")
    tri, _ = run_both(q, mc, mi, mp, sink, ex, variant=TRITON_ROW, splits=splits,
                      inv_rope=inv_rope, device="cuda")
    return got, tri, ref


@gpu
@pytest.mark.parametrize("row", ["sm80-2p-h64", "sm80-2p-h32"])
@pytest.mark.parametrize("heads", [64, 128, 96])
@pytest.mark.parametrize("splits,inv_rope", [(1, False), (1, True), (3, True), (2, False)])
def test_matches_reference_and_triton_phase2(row, heads, splits, inv_rope):
    # Invalid slots in both lists, tiles straddling the main/extra boundary, tokens of
    # different key counts, 96 heads: a half-empty last head tile at 64 heads per program.
    got, tri, ref = _both(3, heads=heads, splits=splits, inv_rope=inv_rope, row=row,
                          main_lens=[21, 5, 40, 128], extra_lens=[30, 44, 9, 512], invalid=0.3,
                          extra_blocks=12)
    assert smd.uses_gluon(smd.TILES[row], heads)
    assert_close(got, ref)
    near(got, tri, ref)
    assert not torch.equal(got, torch.zeros_like(got))


@gpu
@pytest.mark.parametrize("row", ["sm80-2p-h64", "sm80-2p-h32"])
@pytest.mark.parametrize("splits", [1, 2])
def test_swa_only_empty_rows_and_strided_q(row, splits):
    # A token with no keys gives zeros (the sink only).
    got, tri, ref = _both(5, heads=64, splits=splits, main_lens=[0, 7, 33, 16], invalid=0.0,
                          q_pad=64, row=row)
    assert_close(got, ref)
    near(got, tri, ref)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@gpu
@pytest.mark.parametrize("row", ["sm80-2p-h64", "sm80-2p-h32"])
def test_odd_pages_extreme_slots_nan_and_all_invalid_rows(row):
    q, mc, mi, mp, sink, ex = odd_pages_extreme_slots_nan("cuda", [9, 26, 0, 12],
                                                          [31, 4, 0, 20], heads=64)
    for splits in (1, 2):
        got, ref = run_both(q, mc, mi, mp, sink, ex, variant=row, splits=splits, device="cuda")
        tri, _ = run_both(q, mc, mi, mp, sink, ex, variant=TRITON_ROW, splits=splits,
                          device="cuda")
        assert_close(got, ref)
        near(got, tri, ref)
        assert torch.equal(got[2], torch.zeros_like(got[2]))  # a token without keys
    # Every slot invalid, no sink: zeros.
    bad = dict(ex, extra_indices=torch.full_like(ex["extra_indices"], -1))
    got, _ = run_both(q, mc, torch.full_like(mi, -1), mp, None, bad, variant=row, splits=1,
                      device="cuda")
    assert torch.equal(got, torch.zeros_like(got))
