"""The indexer decode top-k in row chunks (vllm.deepinfer.topk_rows, patch 0041): upstream's
top-k kernels form row x stride in 32 bits (docs/long-context.md, "CUDA C++ ops"), so a call
past 2^31 logits elements is split into views of whole requests, each within the bound.
The top-k here is a stand-in that records what each call sees and computes the per-row
top-k the way the kernels do from their own row 0: the chunked result must equal the
unchunked one bit for bit, and every call's last offset must stay below the bound."""
from __future__ import annotations

import pytest
import torch

from vllm.deepinfer import routing, topk_rows as tr


def _reference_topk(calls, limit):
    def topk(logits, seq_lens, next_n, out, k, max_seq_len):
        rows, width = logits.shape
        last = (rows - 1) * logits.stride(0) + width - 1
        calls.append(dict(rows=rows, requests=seq_lens.shape[0], last=last))
        assert last < limit, "a call's offsets pass the kernel's 32-bit bound"
        assert seq_lens.shape[0] * max(1, next_n) >= rows
        lens = seq_lens.reshape(seq_lens.shape[0], -1)
        for r in range(rows):   # row r of this call: request r // next_n, its own length
            b, j = divmod(r, max(1, next_n))
            n = int(lens[b, min(j, lens.shape[1] - 1)])
            vals = logits[r, :n]
            top = torch.topk(vals, min(k, n)).indices.to(torch.int32)
            out[r].fill_(-1)
            out[r, :top.numel()] = top
    return topk


@pytest.fixture(autouse=True)
def _switch(monkeypatch):
    monkeypatch.delenv("DEEPINFER_TOPK_ROWS", raising=False)
    monkeypatch.delenv("DEEPINFER_DISABLE", raising=False)
    routing.reset()
    yield
    routing.reset()


def test_chunks_of_whole_requests_within_the_bound():
    # 1M-wide rows (ratio 1 at 1M context): 2,047 rows fit below 2^31
    assert tr.row_chunks(4097, 1 << 20, 1 << 20, 1) == [(0, 2047), (2047, 2047), (4094, 3)]
    assert tr.row_chunks(2047, 1 << 20, 1 << 20, 1) == [(0, 2047)]
    # next_n 6 (1 + k speculative rows): whole requests, 341 per chunk
    ch = tr.row_chunks(6 * 700, 1 << 20, 1 << 20, 6)
    assert ch[0] == (0, 341) and sum(c for _, c in ch) == 700
    assert all((c * 6 - 1) * (1 << 20) + (1 << 20) < tr.OFFSET_LIMIT for _, c in ch)
    assert tr.row_chunks(0, 10, 10, 1) == []
    with pytest.raises(ValueError, match="no chunking"):
        tr.row_chunks(8, 1 << 29, 1 << 29, 8)


@pytest.mark.parametrize("next_n", [1, 2, 3])
def test_chunked_equals_one_call(monkeypatch, next_n):
    """A small bound stands in for 2^31: 10 requests x next_n rows of 50 columns, stride 64."""
    limit = 64 * 7
    monkeypatch.setattr(tr, "OFFSET_LIMIT", limit)
    g = torch.Generator().manual_seed(next_n)
    reqs = 10
    rows = reqs * next_n
    logits = torch.randn(rows, 64, generator=g)[:, :50]
    seq_lens = torch.randint(5, 51, (reqs, next_n) if next_n > 1 else (reqs,), generator=g,
                             dtype=torch.int32)
    want = torch.full((rows, 8), -7, dtype=torch.int32)
    _reference_topk([], 1 << 40)(logits, seq_lens, next_n, want, 8, 50)
    calls: list = []
    got = torch.full((rows, 8), -7, dtype=torch.int32)
    tr.indexer_decode_topk(_reference_topk(calls, limit), logits, seq_lens, next_n, got, 8, 50)
    assert len(calls) > 1 and sum(c["rows"] for c in calls) == rows
    assert all(c["rows"] % next_n == 0 for c in calls[:-1])
    assert torch.equal(got, want)


def test_switch_off_is_one_call(monkeypatch):
    """DEEPINFER_TOPK_ROWS=0: the same over-the-bound call is one upstream call."""
    monkeypatch.setattr(tr, "OFFSET_LIMIT", 64 * 7)
    logits = torch.zeros(10, 64)[:, :50]
    args = (torch.full((10,), 50, dtype=torch.int32), 1, torch.zeros(10, 8, dtype=torch.int32),
            8, 50)
    calls: list = []
    tr.indexer_decode_topk(lambda *a: calls.append(a[0].shape[0]), logits, *args)
    assert calls == [7, 3]
    monkeypatch.setenv("DEEPINFER_TOPK_ROWS", "0")
    routing.reset()
    calls.clear()
    tr.indexer_decode_topk(lambda *a: calls.append(a[0].shape[0]), logits, *args)
    assert calls == [10]


def test_norm_rows_refused_past_32_bit_output_offsets():
    """vLLM's rms_norm writes row x hidden in 32 bits (vllm.deepinfer.step_limits): the
    Ampere layers refuse a step size past it, naming the setting that fits."""
    from vllm.deepinfer import step_limits as sl
    assert sl.max_norm_tokens(4096) == 1 << 20
    assert sl.max_norm_tokens(7168) == 599_187
    sl.check_norm_rows(1 << 20, 4096)            # 1,048,576 tokens fit at 4096
    with pytest.raises(sl.StepLimitError, match="max_num_batched_tokens=1048576"):
        sl.check_norm_rows((1 << 20) + 1, 4096, "layers.3.attn")
    with pytest.raises(sl.StepLimitError, match="max_num_batched_tokens=599187"):
        sl.check_norm_rows(1 << 20, 7168)
    # the bound itself: the kernel's product is the row's start, row x hidden
    n = sl.max_norm_tokens(7168)
    assert (n - 1) * 7168 < 2 ** 32 <= n * 7168
