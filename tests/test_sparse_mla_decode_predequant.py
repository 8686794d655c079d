"""The two-phase Ampere decode (Tile.predequant: rows "sm80-2p"/"sm86-2p"/"cpu-2p", which
sm80/sm86/cpu launches of PREDEQUANT_MIN_TOKENS tokens or more take unless
DEEPINFER_DECODE_PREDEQUANT=0), and that selection.

Phase 1 writes each token's keys once as bf16 rows; phase 2 is the same attention kernel
reading them. Every key value is exact in bf16 (an e4m3 code times a power of two, or a bf16
RoPE value), so both paths feed the dots the same operands: with one Q.K^T dot (``Q1``, the
shipped row with ``qk_halves`` off) the outputs must be equal bit for bit under the
interpreter. The shipped rows sum the scores of two half-dim dots (``Tile.qk_halves``), another
fp32 order: they, and every row on a GPU (where the two-phase tile is pipelined over 2 stages
and may order its MMAs differently), must meet the fp32 reference bound of
tests/test_sparse_mla_decode.py and differ from one phase by at most one bf16 rounding. Runs
under the interpreter on CPU (~15 s); the same tests run natively on a GPU (``device``
fixture).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from edges import INT32_MAX, INT32_MIN, ODD_PAGES
from test_sparse_mla_decode import (D, NOPE, ROPE, assert_close, make_cache, ragged, run_both,
                                    setup)
from vllm.deepinfer import envs
from vllm.deepinfer.kernels import sparse_mla_decode as smd


# The shipped two-phase row with one Q.K^T dot (qk_halves off), as a row of its own.
Q1 = "sm80-2p-q1"


@pytest.fixture(autouse=True)
def _one_chain_row(monkeypatch):
    assert smd.TILES["sm80-2p"].qk_halves  # the shipped row; Q1 differs from it in that only
    monkeypatch.setitem(smd.TILES, Q1, dataclasses.replace(smd.TILES["sm80-2p"],
                                                           qk_halves=False))


def same(two, one):
    """Bit-equal under the interpreter; on a GPU within one bf16 rounding of the larger
    value."""
    if two.device.type == "cpu":
        return torch.equal(two, one)
    a, b = two.float(), one.float()
    return bool(((a - b).abs() <= 2.0 ** -7 * torch.maximum(a.abs(), b.abs()) + 1e-6).all())


def _pair(device, *args, splits, inv_rope=False, **kw):
    """(shipped two-phase output, Q1's, one-phase output, reference) for one setup."""
    q, mc, mi, mp, sink, ex = setup(device, *args, **kw)
    two, ref = run_both(q, mc, mi, mp, sink, ex, variant="sm80-2p", splits=splits,
                        inv_rope=inv_rope, device=device)
    q1, _ = run_both(q, mc, mi, mp, sink, ex, variant=Q1, splits=splits,
                     inv_rope=inv_rope, device=device)
    one, _ = run_both(q, mc, mi, mp, sink, ex, variant="sm80", splits=splits,
                      inv_rope=inv_rope, device=device, predequant=False)
    return two, q1, one, ref


def check_pair(two, q1, one, ref):
    """Q1 (one Q.K^T dot) gives the one-phase bytes (interpreter); the shipped row (two
    half-dim dots, another fp32 order: outputs that cancel to near zero can move by a few
    bf16 ulps) meets the fp32 reference bound every decode variant meets."""
    assert_close(q1, ref)
    assert same(q1, one)
    assert_close(two, ref)
    assert not torch.equal(two, torch.zeros_like(two))


@pytest.mark.parametrize("splits,inv_rope", [(1, False), (1, True), (3, True), (2, False)])
def test_matches_one_phase(device, splits, inv_rope):
    # -1 and out-of-range slots in both lists, tiles straddling the main/extra boundary,
    # tokens of different key counts (their workspace rows are contiguous per token).
    check_pair(*_pair(device, 3, main_lens=[21, 5, 40], extra_lens=[30, 44, 9],
                      invalid=0.3, splits=splits, inv_rope=inv_rope))


@pytest.mark.parametrize("splits", [1, 2])
def test_swa_only_and_topk_only(device, splits):
    check_pair(*_pair(device, 1, main_lens=[1, 3, 20, 37], splits=splits))
    check_pair(*_pair(device, 2, main_lens=[0, 0, 0], extra_lens=[50, 7, 33], splits=splits))


def odd_pages_extreme_slots_nan(device, main_lens, extra_lens, **kw):
    """A setup with odd page sizes, padded page strides, 35% invalid slots, INT32_MIN and
    INT32_MAX slots in both lists and an e4m3 NaN byte in a valid key (phase 1 scrubs it to 0,
    as the one-phase path does)."""
    q, mc, mi, mp, sink, ex = setup(device, 13, main_lens=main_lens, extra_lens=extra_lens,
                                    main_bs=ODD_PAGES[0], extra_bs=ODD_PAGES[1], main_blocks=3,
                                    extra_blocks=2, invalid=0.35, page_pad=40, **kw)
    for lst in (mi, ex["extra_indices"]):
        lst[2], lst[5] = INT32_MIN, INT32_MAX
    raw = mc.as_strided((mc.shape[0], mc.shape[1] * 584), (mc.stride(0), 1))
    slot = next(int(s) for s in mi.tolist() if 0 <= s < mc.shape[0] * mc.shape[1])
    b, i = divmod(slot, mc.shape[1])
    raw[b, i * 576 + 7] = 0x7F
    return q, mc, mi, mp, sink, ex


def test_odd_pages_extreme_slots_nan_and_empty_rows(device):
    q, mc, mi, mp, sink, ex = odd_pages_extreme_slots_nan(device, [9, 26, 0], [31, 4, 0])
    for splits in (1, 2):
        two, ref = run_both(q, mc, mi, mp, sink, ex, variant="sm80-2p", splits=splits,
                            device=device)
        q1, _ = run_both(q, mc, mi, mp, sink, ex, variant=Q1, splits=splits, device=device)
        one, _ = run_both(q, mc, mi, mp, sink, ex, variant="sm80", splits=splits, device=device,
                          predequant=False)
        check_pair(two, q1, one, ref)
        for out in (two, q1):
            assert torch.equal(out[2].float().cpu(), torch.zeros_like(out[2].float().cpu()))


def test_phase_one_rows_and_validity(device):
    """The workspace itself: token t's rows start at main_indptr[t] + extra_indptr[t], hold
    the dequantized keys (kv_record's reference decode, NaN scrubbed) and a 0/1 flag."""
    gen = torch.Generator().manual_seed(21)
    mc = make_cache(2, 32, device, gen)
    ec = make_cache(2, 64, device, gen)
    mi, mp = ragged([[3, -1, 40], [63]], device)
    ei, ep = ragged([[5, 127, 128], []], device)
    rows = mi.numel() + ei.numel()
    ws = torch.full((rows, D), 7.0, dtype=torch.bfloat16, device=device)
    valid = torch.full((rows,), 9, dtype=torch.uint8, device=device)
    smd._predequant_kernel[(2, 2)](
        mc, mi, mp, ec, ei, ep, ws, valid, mc.stride(0), ec.stride(0), 64, 128,
        HAS_EXTRA=True, HW_FP8=False, ALIGNED=True, MAIN_BS=32, EXTRA_BS=64, BLOCK_N=16,
        DECODE=0, num_warps=4, num_stages=1)
    from vllm.deepinfer import kv_record
    order = [(mc, 3), (mc, -1), (mc, 40), (ec, 5), (ec, 127), (ec, 128), (mc, 63)]
    for r, (cache, slot) in enumerate(order):
        ok = 0 <= slot < cache.shape[0] * cache.shape[1]
        assert int(valid[r]) == int(ok), r
        want = (kv_record.read_rows(cache, torch.tensor([slot], device=device), scrub_nan=True)
                if ok else torch.zeros(1, D, device=device))
        assert torch.equal(ws[r].float().cpu(), want[0].float().cpu()), r


def test_default_is_on_for_the_software_e4m3_variants():
    assert envs.FEATURES["decode_predequant"].default_on == frozenset({"sm80", "sm86", "cpu"})
    assert smd.PREDEQUANT_MIN_TOKENS == 4  # benchmarks/results/h200-2026-12-01-*.json


@pytest.mark.parametrize("variant", ["sm80", "sm86", "cpu"])
def test_selection_follows_the_threshold_and_the_switch(variant, monkeypatch):
    """Below PREDEQUANT_MIN_TOKENS the variant's own (single-phase) row, from it the "-2p"
    row; DEEPINFER_DECODE_PREDEQUANT=0 or DEEPINFER_DISABLE: single phase at every batch
    (=1 changes nothing: the feature is on there already); ``predequant=`` forces either; a
    named "-2p" row is always two-phase; hardware-e4m3 variants never are."""
    n = smd.PREDEQUANT_MIN_TOKENS
    two = f"{variant}-2p"
    for env in ({}, {"DEEPINFER_DECODE_PREDEQUANT": "1"}):
        for k, val in env.items():
            monkeypatch.setenv(k, val)
        assert [smd.select_tile(variant, t) for t in (1, n - 1, n, n + 1, 512)] == \
            [variant, variant, two, two, two]
        assert smd.launch_tiles(variant) == (variant, two)
    for k, val in (("DEEPINFER_DECODE_PREDEQUANT", "0"),
                   ("DEEPINFER_DISABLE", "decode_predequant")):
        monkeypatch.delenv("DEEPINFER_DECODE_PREDEQUANT", raising=False)
        monkeypatch.setenv(k, val)
        assert {smd.select_tile(variant, t) for t in (1, n, 512)} == {variant}
        assert smd.launch_tiles(variant) == (variant,)
        assert smd.select_tile(variant, 1, predequant=True) == two   # forced
        assert smd.select_tile(two, 1) == two                        # named
        monkeypatch.delenv(k)
    assert smd.select_tile(variant, 512, predequant=False) == variant
    assert smd.select_tile(two, 1, predequant=True) == two
    with pytest.raises(ValueError, match="predequant"):
        smd.select_tile(two, 512, predequant=False)
    for hw in ("sm89", "sm90", "sm100"):
        assert smd.select_tile(hw, 512) == hw and smd.launch_tiles(hw) == (hw,)
        with pytest.raises(ValueError, match="predequant"):
            smd.select_tile(hw, 512, predequant=True)
    monkeypatch.setenv("DEEPINFER_DECODE_PREDEQUANT", "maybe")
    with pytest.raises(envs.EnvError, match="DEEPINFER_DECODE_PREDEQUANT"):
        smd.select_tile(variant, n)


def test_launch_runs_phase_one_from_the_threshold(device, monkeypatch):
    """The launcher follows select_tile: the workspace kernel runs for a batch of
    PREDEQUANT_MIN_TOKENS tokens and not for one token less, nor with the switch off; the
    output is the single-phase one either way."""
    n = smd.PREDEQUANT_MIN_TOKENS
    q, mc, mi, mp, sink, ex = setup(device, 8, main_lens=[25, 40, 3, 17],
                                    extra_lens=[20, 10, 0, 33])
    assert q.shape[0] == n
    scale = 1.0 / math.sqrt(D)
    calls = []
    real = smd._predequant_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(smd, "_predequant_kernel", Spy())

    def run(tokens, **kw):
        sub = dict(extra_cache=ex["extra_cache"], extra_indices=ex["extra_indices"],
                   extra_indptr=ex["extra_indptr"][:tokens + 1])
        return smd.sparse_attn_decode(q[:tokens], mc, mi, mp[:tokens + 1], scale, sink, NOPE,
                                      ROPE, **sub, variant="sm80", **kw)
    one = run(n, predequant=False)
    assert calls == []
    two = run(n)
    assert len(calls) == 1 and calls[0][1] == n
    run(n - 1)
    assert len(calls) == 1
    monkeypatch.setenv("DEEPINFER_DECODE_PREDEQUANT", "0")
    off = run(n)
    assert len(calls) == 1 and torch.equal(off, one)
    named = smd.sparse_attn_decode(q, mc, mi, mp, scale, sink, NOPE, ROPE, **ex,
                                   variant="sm80-2p")
    assert len(calls) == 2   # the tile row asks for it explicitly
    assert torch.equal(named, two)  # the threshold picked exactly that row


def test_unknown_two_phase_row_is_refused(device):
    q, mc, mi, mp, sink, ex = setup(device, 8, main_lens=[3])
    with pytest.raises(ValueError, match="variant"):
        smd.sparse_attn_decode(q, mc, mi, mp, 0.1, sink, NOPE, ROPE, variant="sm90-2p")
