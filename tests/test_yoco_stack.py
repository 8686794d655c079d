"""benchmarks/yoco_stack.py on a CPU (interpreter), V4.1's layout in miniature: every layer's
attention output has the same bytes with cross-layer reuse on and off, and the metadata
kernels launch once per group instead of once per layer (the H200 suite,
benchmarks/suites/yoco.py, times the 40-layer stack)."""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import interp_bf16  # noqa: E402
from launch_keys import recording  # noqa: E402

SMALL = dict(heads=16, window=16, topk=16, swa_page=8, comp_page=16, idx_heads=4, hidden=64,
             o_groups=2, o_rank=32, max_pos=512)


@pytest.fixture(scope="module")
def ys():
    import upstream_kernels  # noqa: F401 - build/upstream_kernels (make upstream-kernels)
    import yoco_stack
    return yoco_stack


def _launches(stack, reuse):
    counts: collections.Counter = collections.Counter()
    with recording(execute=True) as seen:
        fc = stack.step(reuse, keep=True)
    for kern, _ in seen:
        counts[kern.fn.__name__] += 1
    return counts, [o.clone() for o in stack.outs], fc


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_stack_outputs_identical_and_launches_fewer(ys, decode, monkeypatch):
    import one_layer as ol
    interp_bf16.patch(monkeypatch.setattr)
    layout = ys.Layout(ratios=(0, 2, 2, 1, 1, 1), kv_sources=(1, 3), index_sources=(1, 3, 4))
    spec = ol.Spec(**SMALL)
    ctx, q = ((40, 25), (1, 1)) if decode else ((24,), (3,))
    st = ys.Stack(spec, ctx, q, "cpu", "sm80", layout)
    off, out_off, _ = _launches(st, reuse=False)
    on, out_on, fc = _launches(st, reuse=True)
    for i, (a, b) in enumerate(zip(out_off, out_on)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"layer {i} differs"
        assert bool(a.float().isfinite().all())
    if decode:
        # global top-k: per compressed layer (5) -> per (index source, KV source, ratio) (3);
        # dense -> ragged (count + compact): SWA per layer (6) -> 1, top-k 5 -> 3.
        assert off["_compute_global_topk_indices_and_lens_kernel"] == 5
        assert on["_compute_global_topk_indices_and_lens_kernel"] == 3
        assert off["_count_valid_row_entries_kernel"] == 11 and on["_count_valid_row_entries_kernel"] == 4
        assert off["_sparse_mla_decode_kernel"] == on["_sparse_mla_decode_kernel"] == 6
        assert fc._deepinfer_yoco.builds == {"swa_ragged": 1, "decode_indices": 3}
    else:
        # compressed gathers 5 -> 2 (+ 6 SWA gathers each way); combined lists 6 -> 4.
        assert off["_gather_kernel"] == 11 and on["_gather_kernel"] == 8
        assert off["_combine_kernel"] == 6 and on["_combine_kernel"] == 4
        assert off["_sparse_attn_prefill_ragged_kernel"] == on["_sparse_attn_prefill_ragged_kernel"] == 6
        b = fc._deepinfer_yoco.builds
        assert b["gather"] == 2 and b["combine"] == 4 and b["indexer_k"] == 2
    assert sum(on.values()) < sum(off.values())


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_stack_verify_mode_finds_every_reused_product_equal(ys, decode, monkeypatch):
    """DEEPINFER_YOCO_VERIFY=1: every hit is built again and compared; on the miniature
    layout every comparison is equal and the outputs are still those of reuse off."""
    import one_layer as ol
    from vllm.deepinfer import yoco
    interp_bf16.patch(monkeypatch.setattr)
    layout = ys.Layout(ratios=(0, 2, 2, 1, 1, 1), kv_sources=(1, 3), index_sources=(1, 3, 4))
    ctx, q = ((40, 25), (1, 1)) if decode else ((24,), (3,))
    st = ys.Stack(ol.Spec(**SMALL), ctx, q, "cpu", "sm80", layout)
    _, out_off, _ = _launches(st, reuse=False)
    monkeypatch.setenv("DEEPINFER_YOCO_VERIFY", "1")
    yoco.reset_totals()
    _, out_on, _ = _launches(st, reuse=True)
    t = yoco.totals()
    for a, b in zip(out_off, out_on):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not [k for k in t if k.endswith(".verify_mismatch")], t
    kinds = ("swa_ragged", "decode_indices") if decode else ("gather", "combine", "indexer_k")
    for kind in kinds:
        assert t.get(f"{kind}.verify_equal", 0) == t.get(f"{kind}.hit", 0) > 0, (kind, t)
