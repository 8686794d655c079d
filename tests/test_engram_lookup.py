"""Engram table lookup without fp8e4nv (kernels/engram_lookup.py) against a plain-torch
reference of upstream's semantics, bit for bit; on a GPU with vLLM importable, also against
upstream's own ``_engram_lookup_kernel``."""
from __future__ import annotations

import pytest
import torch

import interp_bf16
from vllm.deepinfer.kernels.engram_lookup import engram_lookup


def make_table(rows, dim, qb, gen):
    codes = torch.randint(0, 256, (rows, dim), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(100, 140, (rows, dim // qb), generator=gen, dtype=torch.int32)
    scales = scales.to(torch.uint8)
    scales[0, 0] = 0      # byte 0: the shift decodes it as 0.0
    scales[1, :] = 255    # largest exponent
    codes[2, :4] = torch.tensor([0x7F, 0xFF, 0x80, 0x00], dtype=torch.uint8)  # NaN, -NaN, -0, 0
    return codes, scales


def reference(codes, scales, ids, sorted_dst, out, vocab_start, vocab_end, num_rows, *,
              head_start, local_heads, total_heads, dim, quant_block, sorted_rows):
    rows = torch.arange(num_rows)
    if sorted_rows:
        local = ids[:num_rows].long()
        dst = sorted_dst[:num_rows].long()
        owned = (local >= 0) & (local < vocab_end - vocab_start)
    else:
        head = head_start + rows % local_heads
        token = rows // local_heads
        in_table = head < total_heads
        index = torch.full((num_rows,), -1, dtype=torch.long)
        index[in_table] = ids[token[in_table], head[in_table]].long()
        owned = in_table & (index >= vocab_start) & (index < vocab_end)
        local, dst = index - vocab_start, rows
    local = torch.where(owned, local, 0)
    code = torch.where(owned[:, None], codes[local], 0)
    sbyte = torch.where(owned[:, None], scales[local], 0)
    if out.dtype == torch.uint8:
        width = dim + dim // quant_block
        flat = out.view(-1)
        base = dst // local_heads * out.stride(0) + dst % local_heads * width
        for r in range(num_rows):
            b = int(base[r])
            flat[b:b + dim] = code[r]
            flat[b + dim:b + width] = sbyte[r]
    else:
        scale = (sbyte.to(torch.int32) << 23).view(torch.float32)
        val = code.view(torch.float8_e4m3fn).float().repeat_interleave(1, 1)
        val = val * scale.repeat_interleave(quant_block, 1)
        out.view(-1, dim)[dst] = val.to(torch.bfloat16)
    return out


CASES = [
    # (tokens, local_heads, total_heads, head_start, sorted, packed)
    (5, 4, 4, 0, False, False),
    (7, 4, 6, 4, False, False),   # second shard: heads 4..7, only 4..5 exist
    (3, 8, 8, 0, False, True),
    (6, 4, 4, 0, True, False),
    (4, 4, 4, 0, True, True),
]


@pytest.mark.parametrize("variant", ["sm80", "sm90"])
@pytest.mark.parametrize("tokens,local_heads,total_heads,head_start,sorted_rows,packed", CASES)
def test_bit_exact(monkeypatch, device, variant, tokens, local_heads, total_heads, head_start,
                   sorted_rows, packed):
    if device == "cpu":
        if variant != "sm80":
            pytest.skip("the hardware-cvt variant needs a GPU")
        interp_bf16.patch(monkeypatch.setattr)
    gen = torch.Generator().manual_seed(tokens * 131 + local_heads)
    dim, qb, vocab_rows, vocab_start = 64, 32, 50, 1000
    codes, scales = make_table(vocab_rows, dim, qb, gen)
    vocab_end = vocab_start + vocab_rows
    num_rows = tokens * local_heads
    if sorted_rows:
        ids = torch.randint(-3, vocab_rows + 3, (num_rows,), generator=gen)  # some not owned
        sorted_dst = torch.randperm(num_rows, generator=gen).to(torch.int32)
    else:
        ids = torch.randint(vocab_start - 5, vocab_end + 5, (tokens, total_heads + 2),
                            generator=gen)
        ids[0, :] = torch.iinfo(torch.int64).min  # far out of range
        ids[-1, :] = vocab_start                  # first row of the table (scale byte 0)
        sorted_dst = torch.zeros(1, dtype=torch.int32)
    if packed:
        width = dim + dim // qb
        out = torch.full((tokens, local_heads * width + 3), 0xAB, dtype=torch.uint8)
    else:
        out = torch.full((num_rows, dim), 7.0, dtype=torch.bfloat16)
    ref = reference(codes, scales, ids, sorted_dst, out.clone(), vocab_start, vocab_end,
                    num_rows, head_start=head_start, local_heads=local_heads,
                    total_heads=total_heads, dim=dim, quant_block=qb, sorted_rows=sorted_rows)
    got = out.to(device)
    engram_lookup(codes.to(device), scales.to(device), ids.to(device), sorted_dst.to(device),
                  got, vocab_start, vocab_end, num_rows, head_start=head_start,
                  local_heads=local_heads, total_heads=total_heads, dim=dim, quant_block=qb,
                  sorted_rows=sorted_rows, grid=3, variant=variant)
    got = got.cpu()
    if packed:
        assert torch.equal(got, ref)
    else:
        # NaN codes (0x7F/0xFF) stay NaN; their payload is the converting instruction's own
        # (GPU cvt gives 0x7FFF, torch 0x7FC0), so NaNs are compared as NaN and every other
        # value bit for bit. The GPU test against upstream's kernel compares NaN bits too.
        nan = torch.isnan(ref.float())
        assert torch.equal(torch.isnan(got.float()), nan)
        assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


def test_bad_inputs(device):
    codes = torch.zeros(4, 64, dtype=torch.uint8)
    scales = torch.zeros(4, 2, dtype=torch.uint8)
    ids = torch.zeros(1, 4, dtype=torch.int64)
    out = torch.zeros(4, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="out"):
        engram_lookup(codes, scales, ids, ids, out, 0, 4, 4, head_start=0, local_heads=4,
                      total_heads=4, dim=64, quant_block=32, sorted_rows=False, grid=1)
    with pytest.raises(ValueError, match="scales"):
        engram_lookup(codes, scales.float(), ids, ids, out.bfloat16(), 0, 4, 4, head_start=0,
                      local_heads=4, total_heads=4, dim=64, quant_block=32, sorted_rows=False,
                      grid=1)


@pytest.mark.gpu
def test_against_upstream_kernel():
    """Upstream's kernel (hardware e4m3 on the H200) and ours (both variants): same bytes."""
    try:
        from vllm.models.deepseek_v41.common import engram as up
    except Exception as e:  # vLLM not installed on this machine
        pytest.skip(f"vLLM not importable: {e}")
    gen = torch.Generator().manual_seed(5)
    dim, qb, rows, tokens, heads = 512, 32, 4096, 300, 8
    codes, scales = make_table(rows, dim, qb, gen)
    ids = torch.randint(-10, rows + 10, (tokens, heads), generator=gen).cuda()
    codes, scales = codes.cuda(), scales.cuda()
    ref = torch.empty(tokens * heads, dim, dtype=torch.bfloat16, device="cuda")
    up._engram_lookup_kernel[(64,)](
        codes.view(torch.float8_e4m3fn), scales, ids, ids, ref, 0, rows, tokens * heads,
        ids.stride(0), ids.stride(1), HEAD_START=0, LOCAL_HEADS=heads, TOTAL_HEADS=heads,
        DIM=dim, QUANT_BLOCK=qb, BLOCK_R=16, GRID=64, SORTED=False, PACKED=False,
        OUT_STRIDE=dim, PEER_ROWS=0)
    for variant in ("sm80", "sm90"):
        got = torch.empty_like(ref)
        engram_lookup(codes, scales, ids, ids, got, 0, rows, tokens * heads, head_start=0,
                      local_heads=heads, total_heads=heads, dim=dim, quant_block=qb,
                      sorted_rows=False, grid=64, variant=variant)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), variant
