"""vllm.deepinfer.kernels.topk_swa: bit-identical (int32) to upstream's combiners.

Upstream references, launched as upstream launches them (a -1 fill, then grid
(num_reqs, workers)): V4.1 ``CombineTopkSwaIndicesKernel`` for ratios 0/1/2; for V4's ratios 4
and 128 the V4 ROCm ``_combine_topk_swa_indices_kernel`` (same semantics as V4.1: invalid
top-k entries -> -1, window clamped to the gathered range) on every input, and the V4 CUDA
``CombineTopkSwaIndicesKernel`` on the inputs where its semantics agree (all top-k entries
valid, gather_len = seq_len). Upstream uses 256 (V4.1, V4 CUDA) or 128 (V4 ROCm) workers per
request; each worker strides over the request's tokens, so the count cannot change the result,
and the tests launch 4 (the interpreter costs about 0.7 ms per program instance).
Inputs are built on the CPU, run on the ``device`` fixture's device, compared on the CPU.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from edges import invalid_slots
from vllm.deepinfer.kernels import shapes
from vllm.deepinfer.kernels import topk_swa as ts

WORKERS = 4
# V4 layer kinds with a compressed cache: (ratio, top-k) of the production shapes.
V4_COMPRESSED = [(s.ratio, s.topk) for s in shapes.PRODUCTION if s.model is shapes.V4 and s.ratio]


def _pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def _alloc(num_tokens, width, out, device):
    if out is None:
        return (torch.full((num_tokens, width), -1, dtype=torch.int32, device=device),
                torch.empty(num_tokens, dtype=torch.int32, device=device))
    out[0].fill_(-1)
    return out


def up_v41(upstream, topk_indices, qsl, seq, gl, window, ratio, topk, M, N, out=None):
    up = importlib.import_module(upstream.__name__ + ".v41_cache_utils")
    ci, cl = _alloc(topk_indices.shape[0], ts.combined_width(topk, window), out, topk_indices.device)
    up.CombineTopkSwaIndicesKernel_kernel[(seq.shape[0], WORKERS)](
        ci, ci.stride(0), cl, topk_indices, topk_indices.stride(0), qsl, seq, gl, M, N,
        TOP_K=topk, COMPRESS_RATIO=ratio, WINDOW_SIZE=window,
        PADDED_TOP_K=_pow2(topk_indices.shape[-1]))
    return ci, cl


def up_v4_cuda(upstream, topk_indices, qsl, seq, gl, window, ratio, topk, M, N):
    up = importlib.import_module(upstream.__name__ + ".v4_cache_utils")
    ci, cl = _alloc(topk_indices.shape[0], ts.combined_width(topk, window), None, topk_indices.device)
    up.CombineTopkSwaIndicesKernel_kernel[(seq.shape[0], WORKERS)](
        ci, ci.stride(0), cl, topk_indices, topk_indices.stride(0), qsl, seq, gl,
        topk_indices, topk_indices, M, N, TOP_K=topk, COMPRESS_RATIO=ratio, WINDOW_SIZE=window,
        IMAGE_WIDTH=0, PADDED_TOP_K=_pow2(topk_indices.shape[-1]))
    return ci, cl


def up_v4_rocm(upstream, topk_indices, qsl, seq, gl, window, ratio, topk, M, N):
    up = importlib.import_module(upstream.__name__ + ".v4_rocm_combine")
    ci, cl = _alloc(topk_indices.shape[0], ts.combined_width(topk, window), None, topk_indices.device)
    up._combine_topk_swa_indices_kernel[(seq.shape[0], WORKERS)](
        ci, ci.stride(0), cl, topk_indices, topk_indices.stride(0), qsl, seq, gl,
        topk_indices, topk_indices, M, N, TOP_K=topk, COMPRESS_RATIO=ratio, WINDOW_SIZE=window,
        SWA_WIDTH=window, TOPK_WIDTH=topk_indices.shape[-1],
        PADDED_TOP_K=_pow2(topk_indices.shape[-1]), PADDED_SWA_WIDTH=_pow2(window),
        HAS_IMAGE=False)
    return ci, cl


def make_batch(gen, device, window, topk_width, N, *, q_base=7, invalid=True, short_gather=True):
    """A ragged prefill chunk: a request starting from position 0 (before the first
    compression boundary), a continuation with full context, an empty request, a request whose
    gathered range is shorter than the window, and a long-context one. query_start_loc does
    not start at 0. Top-k entries include -1, values >= N and the int32 extremes when
    ``invalid`` (tests/edges.py)."""
    q_lens = [12, 9, 0, 7, 5]
    seq = [12, 400, 50, 300, 5000]
    gl = [12, 400, 50, (window // 3 + 2) if short_gather else 300, 5000]
    qsl = torch.tensor([q_base] + [q_base + sum(q_lens[:i + 1]) for i in range(len(q_lens))],
                       dtype=torch.int32)
    T = sum(q_lens)
    tk = torch.randint(0, N, (T, topk_width), dtype=torch.int32, generator=gen)
    if invalid:
        tk[torch.rand(T, topk_width, generator=gen) < 0.1] = -1
        big = torch.rand(T, topk_width, generator=gen) < 0.05
        tk[big] = N + torch.randint(0, 1000, (int(big.sum()),), dtype=torch.int32, generator=gen)
        bad = torch.tensor(invalid_slots(N), dtype=torch.int32)
        for t in range(T):  # every invalid value in every row, at random columns
            tk[t, torch.randperm(topk_width, generator=gen)[:len(bad)]] = bad
    return tuple(t.to(device) for t in (tk, qsl, torch.tensor(seq, dtype=torch.int32),
                                        torch.tensor(gl, dtype=torch.int32)))


def assert_same(ours, ref):
    assert ours[0].dtype == torch.int32 and ours[1].dtype == torch.int32
    assert ours[0].shape == ref[0].shape
    assert torch.equal(ours[0].cpu(), ref[0].cpu())
    assert torch.equal(ours[1].cpu(), ref[1].cpu())


# --------------------------------------------------------------------------- V4.1
@pytest.mark.parametrize("ratio", shapes.V41.ratios)
@pytest.mark.parametrize("window", [64, 128, 256])
def test_v41_matches_upstream(upstream, device, ratio, window):
    gen = torch.Generator().manual_seed(ratio * 1000 + window)
    topk_width, N, M = 512, 2600, 9000
    topk = 0 if ratio == 0 else topk_width  # what the V4.1 layers pass
    tk, qsl, seq, gl = make_batch(gen, device, window, topk_width, N)
    ref = up_v41(upstream, tk, qsl, seq, gl, window, ratio, topk, M, N)
    assert_same(ts.combine_topk_swa_indices(tk, qsl, seq, gl, window, ratio, topk, M, N,
                                            variant="sm80"), ref)


@pytest.mark.parametrize("variant", ["sm80", "sm90"])
def test_v41_workspace_with_garbage(upstream, device, variant):
    """A caller's workspace full of garbage: every column and length is (re)written."""
    gen = torch.Generator().manual_seed(1)
    window, ratio, topk, N, M = 128, 1, 512, 2600, 9000
    tk, qsl, seq, gl = make_batch(gen, device, window, topk, N)
    T, W = tk.shape[0], ts.combined_width(topk, window)
    ws = (torch.randint(-2**31, 2**31 - 1, (T, W), dtype=torch.int32, generator=gen).to(device),
          torch.randint(-2**31, 2**31 - 1, (T,), dtype=torch.int32, generator=gen).to(device))
    ref = up_v41(upstream, tk, qsl, seq, gl, window, ratio, topk, M, N,
                 out=(ws[0].clone(), ws[1].clone()))
    ours = ts.combine_topk_swa_indices(tk, qsl, seq, gl, window, ratio, topk, M, N, out=ws,
                                       variant=variant)
    assert ours[0] is ws[0] and ours[1] is ws[1]
    assert_same(ours, ref)


def test_v41_ratio0_with_nonzero_topk(upstream, device):
    """Ratio 0 with topk > 0 (not what V4.1 passes, but allowed): row width counts topk, no
    top-k columns are emitted."""
    gen = torch.Generator().manual_seed(2)
    tk, qsl, seq, gl = make_batch(gen, device, 128, 512, 2600)
    ref = up_v41(upstream, tk, qsl, seq, gl, 128, 0, 512, 9000, 2600)
    assert_same(ts.combine_topk_swa_indices(tk, qsl, seq, gl, 128, 0, 512, 9000, 2600), ref)


def test_strided_topk_rows_and_odd_width(upstream, device):
    """Top-k rows taken from a wider buffer (stride(0) > width), and a buffer width that is not
    a multiple of 4 (the scalar build)."""
    gen = torch.Generator().manual_seed(4)
    tk, qsl, seq, gl = make_batch(gen, device, 64, 520, 2600)
    for view in (tk[:, :512], tk[:, :510]):
        topk = view.shape[1]
        ref = up_v41(upstream, view, qsl, seq, gl, 64, 2, topk, 9000, 2600)
        assert_same(ts.combine_topk_swa_indices(view, qsl, seq, gl, 64, 2, topk, 9000, 2600), ref)


def test_rows_past_the_last_request(upstream, device):
    """Rows beyond query_start_loc[-1]: -1 like upstream's fill; length 0 (upstream leaves it)."""
    gen = torch.Generator().manual_seed(6)
    tk, qsl, seq, gl = make_batch(gen, device, 128, 512, 2600)
    extra = torch.randint(0, 2600, (3, 512), dtype=torch.int32, generator=gen).to(device)
    tk2 = torch.cat([tk, extra])
    ref = up_v41(upstream, tk2, qsl, seq, gl, 128, 1, 512, 9000, 2600)
    ci, cl = ts.combine_topk_swa_indices(tk2, qsl, seq, gl, 128, 1, 512, 9000, 2600)
    T = tk.shape[0]
    ci, cl, ref = ci.cpu(), cl.cpu(), (ref[0].cpu(), ref[1].cpu())
    assert torch.equal(ci, ref[0])
    assert torch.equal(cl[:T], ref[1][:T])
    assert torch.equal(cl[T:], torch.zeros(3, dtype=torch.int32))


def test_negative_positions_give_empty_rows(upstream, device):
    """Warmup-style batches where query_len > seq_len put positions below zero."""
    tk = torch.zeros(6, 512, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 6], dtype=torch.int32, device=device)
    seq = torch.tensor([3], dtype=torch.int32, device=device)
    gl = torch.tensor([3], dtype=torch.int32, device=device)
    ref = up_v41(upstream, tk, qsl, seq, gl, 128, 2, 512, 100, 50)
    ours = ts.combine_topk_swa_indices(tk, qsl, seq, gl, 128, 2, 512, 100, 50)
    assert_same(ours, ref)
    assert ours[1][:3].cpu().tolist() == [0, 0, 0]


# --------------------------------------------------------------------------- V4
@pytest.mark.parametrize("ratio,topk", V4_COMPRESSED)
def test_v4_matches_rocm_kernel(upstream, device, ratio, topk):
    gen = torch.Generator().manual_seed(ratio)
    N, M = 40, 8200
    tk, qsl, seq, gl = make_batch(gen, device, 128, topk, N)
    ref = up_v4_rocm(upstream, tk, qsl, seq, gl, 128, ratio, topk, M, N)
    assert_same(ts.combine_topk_swa_indices(tk, qsl, seq, gl, 128, ratio, topk, M, N), ref)


@pytest.mark.parametrize("ratio,topk", V4_COMPRESSED)
def test_v4_matches_cuda_kernel_where_semantics_agree(upstream, device, ratio, topk):
    gen = torch.Generator().manual_seed(ratio + 1)
    N, M = 1300, 8200
    tk, qsl, seq, gl = make_batch(gen, device, 128, topk, N, invalid=False, short_gather=False)
    gl = seq.clone()  # the V4 CUDA kernel does not clamp the window to the gathered range
    ref = up_v4_cuda(upstream, tk, qsl, seq, gl, 128, ratio, topk, M, N)
    assert_same(ts.combine_topk_swa_indices(tk, qsl, seq, gl, 128, ratio, topk, M, N,
                                            variant="sm90"), ref)


def test_many_requests_search_loops(upstream, device):
    """More requests than one search step (BLOCK_R), most of them empty."""
    R = ts.BLOCK_R + 40
    q_lens = torch.zeros(R, dtype=torch.int64)
    q_lens[[0, 5, ts.BLOCK_R - 1, ts.BLOCK_R, R - 1]] = torch.tensor([2, 3, 1, 2, 3])
    qsl = (torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32) + 100).to(device)
    seq = torch.full((R,), 200, dtype=torch.int32, device=device)
    gl = torch.full((R,), 200, dtype=torch.int32, device=device)
    T = int(q_lens.sum())
    tk = torch.randint(0, 300, (T, 64), dtype=torch.int32).to(device)
    ref = up_v41(upstream, tk, qsl, seq, gl, 64, 1, 64, 500, 300)
    assert_same(ts.combine_topk_swa_indices(tk, qsl, seq, gl, 64, 1, 64, 500, 300), ref)


# --------------------------------------------------------------------------- validation
def _args(**over):
    a = dict(topk_indices=torch.zeros(4, 512, dtype=torch.int32),
             query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
             seq_lens=torch.tensor([4], dtype=torch.int32),
             gather_lens=torch.tensor([4], dtype=torch.int32),
             window_size=128, compress_ratio=1, topk=512, M=10, N=5)
    a.update(over)
    return a


@pytest.mark.parametrize("over,name", [
    (dict(topk_indices=torch.zeros(4, 512, dtype=torch.int64)), "topk_indices"),
    (dict(topk_indices=torch.zeros(512, 4, dtype=torch.int32).t()), "topk_indices"),
    (dict(query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32)), "query_start_loc"),
    (dict(seq_lens=torch.tensor([4], dtype=torch.int64)), "seq_lens"),
    (dict(gather_lens=torch.tensor([4, 4], dtype=torch.int32)), "gather_lens"),
    (dict(window_size=0), "window_size"),
    (dict(compress_ratio=-1), "compress_ratio"),
    (dict(topk=513), "topk"),
    (dict(out=(torch.zeros(4, 512, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))),
     r"out\[0\]"),
    (dict(out=(torch.zeros(4, 640, dtype=torch.int32), torch.zeros(5, dtype=torch.int32))),
     r"out\[1\]"),
])
def test_validation_names_the_tensor(over, name):
    with pytest.raises(ValueError, match=name):
        ts.combine_topk_swa_indices(**_args(**over))


def test_checks_accept_valid_inputs():
    # The per-call checks pass good inputs, with and without a workspace, and reject a
    # workspace of the wrong width and a top-k wider than its buffer.
    ws = (torch.zeros(4, 640, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    ts._check_inputs(**_args(), out=None, width=640)
    ts._check_inputs(**_args(), out=ws, width=640)
    with pytest.raises(ValueError, match=r"^out\[0\] \(combined_indices\): "):
        ts._check_inputs(**_args(), out=(ws[0][:, :512], ws[1]), width=640)
    with pytest.raises(ValueError, match="^topk: 513 is negative or wider"):
        ts._check_inputs(**_args(topk=513), out=None, width=640)


def test_empty_batch_returns_shaped_outputs():
    ci, cl = ts.combine_topk_swa_indices(**_args(topk_indices=torch.zeros(0, 512, dtype=torch.int32),
                                                 query_start_loc=torch.tensor([3, 3], dtype=torch.int32)))
    assert ci.shape == (0, 640) and cl.shape == (0,)


def test_compile_keys():
    from vllm.deepinfer import compile_gate
    specs = {(tuple(sorted(s.constexprs.items())), s.num_warps) for s in compile_gate.specs()
             if s.kernel is ts._combine_kernel}
    v41, v4, c128a = shapes.V41, shapes.V4, shapes.by_name("v4.c128a")
    v41 = ts.compile_keys(v41.window, v41.ratios, v41.topk, variant="sm80")
    assert [k.BLOCK for k in v41] == [128, 512]           # widths 128 and 640
    v4 = ts.compile_keys(v4.window, v4.ratios, c128a.topk, variant="sm90")
    assert [k.BLOCK for k in v4] == [128, 256, 512, 1024]  # C128A widths 256 .. 8320
    assert [k.VEC for k in ts.compile_keys(128, [1], 510, variant="sm90")] == [1]
    for k in v41 + v4:
        assert (tuple(sorted(k.constexprs().items())), k.num_warps) in specs
