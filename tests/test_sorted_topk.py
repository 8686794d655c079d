"""vllm.deepinfer.sorted_topk: the test switch that orders indexer top-k rows."""
import pytest
import torch

from vllm.deepinfer import sorted_topk


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_rows_sorted_with_the_fill_last_and_the_set_kept(dtype):
    g = torch.Generator().manual_seed(0)
    rows = torch.stack([torch.randperm(1000, generator=g)[:16] for _ in range(8)]).to(dtype)
    rows[1, 5:] = -1          # a short row: -1 fill, scattered by the shuffle below
    rows[2, :] = -1           # an empty row
    rows[3, :] = torch.arange(16)  # already sorted
    rows = rows[:, torch.randperm(16, generator=g)]
    before = [sorted(r.tolist()) for r in rows]
    out = sorted_topk.sort_rows_(rows)
    assert out.data_ptr() == rows.data_ptr()
    for r, b in zip(rows.tolist(), before):
        valid = [x for x in r if x >= 0]
        assert valid == sorted(valid) and r == valid + [-1] * (len(r) - len(valid))
        assert sorted(r) == b
    assert rows[2].eq(-1).all() and rows[3].equal(torch.arange(16, dtype=dtype))


def test_two_orders_of_one_set_sort_to_the_same_bytes():
    a = torch.tensor([[7, 3, -1, 9, 1]], dtype=torch.int32)
    b = torch.tensor([[9, -1, 1, 7, 3]], dtype=torch.int32)
    assert torch.equal(sorted_topk.sort_rows_(a).view(torch.uint8),
                       sorted_topk.sort_rows_(b).view(torch.uint8))


def test_a_view_of_a_larger_buffer_is_sorted_in_place():
    buf = torch.tensor([[3, 1, 2], [9, 8, 7], [6, 5, 4]], dtype=torch.int32)
    sorted_topk.sort_rows_(buf[:2])
    assert buf.tolist() == [[1, 2, 3], [7, 8, 9], [6, 5, 4]]


@pytest.mark.parametrize("bad", [torch.zeros(4, dtype=torch.int32),
                                 torch.zeros(2, 3, dtype=torch.float32)])
def test_bad_buffers_are_refused(bad):
    with pytest.raises(ValueError, match="rows must be a 2-D int32/int64"):
        sorted_topk.sort_rows_(bad)


def test_switch(monkeypatch):
    monkeypatch.delenv("DEEPINFER_SORTED_TOPK", raising=False)
    assert not sorted_topk.enabled()
    monkeypatch.setenv("DEEPINFER_SORTED_TOPK", "1")
    assert sorted_topk.enabled()
