"""Boundary cases of tests/test_offsets_int64.py, one per process (a kernel whose int32 offset
wraps reads or writes outside its tensors, which can kill the process).

    python tests/offset_probe.py CASE VARIANT [--device cpu|cuda]

Each case builds inputs whose row offsets cross 2^31 - 1 elements with a handful of rows:
the rows sit ``stride(0)`` elements apart in one large buffer (on CPU ``torch.empty`` only
reserves it: the pages of the few rows written are the only ones committed), so
``row * stride(0)`` passes 2^31 while the grid stays a few programs. The same launch on a
compact copy of the rows is the expectation: the far run must write the same bits. The last
stdout line is a JSON object with ``equal`` (and details).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

if "cuda" not in sys.argv:  # CPU tensors: the Triton interpreter (before Triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "overlay", HERE.parent / "build"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

INT32_MAX = 2 ** 31 - 1


def far_stride(rows: int) -> int:
    """A row stride (elements, a multiple of 64) putting row ``rows - 1`` just past 2^31 - 1
    and every earlier row below it: only the last row's offset wraps in int32."""
    s = -(-(INT32_MAX + 1) // (rows - 1))
    return -(-s // 64) * 64


def far_view(compact: torch.Tensor, stride0: int) -> torch.Tensor:
    """``compact``'s values in rows ``stride0`` elements apart (inner dims contiguous)."""
    compact = compact.contiguous()
    n, inner = compact.shape[0], compact[0].numel()
    assert stride0 >= inner
    buf = torch.empty((n - 1) * stride0 + inner, dtype=compact.dtype, device=compact.device)
    v = buf.as_strided(compact.shape, (stride0, *compact.stride()[1:]))
    v.copy_(compact)
    return v


def offsets(rows: int, stride0: int) -> dict:
    """What a result reports about its layout: the last row's element offset (past 2^31 - 1)
    and the one before it (inside int32)."""
    return {"last_offset": (rows - 1) * stride0, "prev_offset": (rows - 2) * stride0}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN payloads compare equal)."""
    return t.contiguous().view(torch.uint8).cpu()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _cos_sin(positions: int, dim: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    ang = torch.rand(positions, dim // 2, generator=g) * 6.3
    return torch.cat([ang.cos(), ang.sin()], dim=1).to(device)


# ----------------------------------------------------------------------------- inverse RoPE
def inverse_rope(variant: str, device) -> dict:
    """``variant``: "ours" (kernels.inverse_rope) or "upstream" (the kernel behind
    rocm_inverse_rope_rows_, launched as _fused_inverse_rope_gptj launches it)."""
    g = torch.Generator().manual_seed(1)
    T, H, D, R = 3, 20, 512, 64  # 20 heads: two head blocks of ours, the second masked
    o = torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(device)
    pos = torch.tensor([7, 100, 3], dtype=torch.int64, device=device)
    cs = _cos_sin(128, R, device)
    far = far_view(o, far_stride(T))
    want = o.clone()
    if variant == "ours":
        from vllm.deepinfer.kernels.inverse_rope import inverse_rope_rows_
        inverse_rope_rows_(want, pos, cs, R)
        inverse_rope_rows_(far, pos, cs, R)
    elif variant == "upstream":
        up = importlib.import_module("upstream_kernels.v41_sparse_prefill")
        for x in (want, far):
            up._inverse_rope_gptj_kernel[(T, H)](
                x, x, pos, cs, x.stride(0), x.stride(1), x.stride(0), x.stride(1), cs.stride(0),
                NOPE=D - R, HALF=R // 2, BLOCK_NOPE=512, BLOCK_HALF=R // 2)
    else:
        raise SystemExit(f"inverse_rope: variant {variant!r}, expected ours or upstream")
    return {"equal": same_bits(far, want), **offsets(T, far.stride(0))}


# ----------------------------------------------------------------------------- indexer Q
def indexer_q(variant: str, device) -> dict:
    """V4 indexer Q RoPE + fp8 quant (kernels.fp8_writers_v4), index_q rows far apart."""
    from vllm.deepinfer.kernels import fp8_writers_v4 as v4
    g = torch.Generator().manual_seed(2)
    T, H, D = 3, 2, 128
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(device)
    w = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    pos = torch.tensor([5, 60, 31], dtype=torch.int64, device=device)
    cs = _cos_sin(64, 64, device)
    args = (0.125, 0.5)
    q8, w8 = v4.fused_indexer_q_rope_quant(pos, q, cs, w, *args, variant=variant)
    far = far_view(q, far_stride(T))
    q8f, w8f = v4.fused_indexer_q_rope_quant(pos, far, cs, w, *args, variant=variant)
    return {"equal": same_bits(q8f, q8) and same_bits(w8f, w8), **offsets(T, far.stride(0))}


# ----------------------------------------------------------------------------- decode
def decode(case: str, device) -> dict:
    """Sparse MLA decode (kernels.sparse_mla_decode). ``case`` is PATH:FAR. PATH: direct (one
    phase, no split: the attention kernel stores), split (one phase, 2 splits: the reduce
    kernel stores), 2p (two phases), 2p-split. FAR: which rows lie far apart, q or out."""
    from vllm.deepinfer import kv_record
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    paths = {"direct": (False, 1), "split": (False, 2), "2p": (True, 1), "2p-split": (True, 2)}
    path, _, which = case.partition(":")
    if path not in paths or which not in ("q", "out"):
        raise SystemExit(f"decode: {case!r}, expected PATH:q or PATH:out with PATH one of "
                         f"{', '.join(paths)}")
    predequant, splits = paths[path]
    g = torch.Generator().manual_seed(3)
    T, H, D = 3, 16, kv_record.HEAD_DIM

    def cache(blocks, bs):
        n = blocks * bs
        nope, scales, rope = kv_record.quantize_rows(torch.randn(n, D, generator=g))
        c = kv_record.new_cache(blocks, bs)
        kv_record.write_records(c, torch.arange(n), nope, scales, rope)
        return c.to(device)

    def lists(n_keys, rows):
        idx = torch.randint(0, rows, (T * n_keys,), generator=g, dtype=torch.int32)
        ptr = torch.arange(0, T * n_keys + 1, n_keys, dtype=torch.int32)
        return idx.to(device), ptr.to(device)

    main, extra = cache(2, 32), cache(2, 64)
    mi, mp = lists(20, 64)
    ei, ep = lists(24, 128)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(device)
    sink = torch.randn(H, generator=g).to(device)
    pos = torch.tensor([9, 900, 77], dtype=torch.int64, device=device)
    cs = _cos_sin(1024, 64, device)

    # Two phases are an Ampere row: on a GPU of another variant the sm80 kernels run.
    variant = "sm80" if predequant and device.type == "cuda" else None

    def run(qq, out):
        return smd.sparse_attn_decode(
            qq, main, mi, mp, 1.0 / math.sqrt(D), sink, kv_record.NOPE_DIM, kv_record.ROPE_DIM,
            extra_cache=extra, extra_indices=ei, extra_indptr=ep, out=out,
            inv_rope_positions=pos, inv_rope_cos_sin_cache=cs, num_kv_splits=splits,
            predequant=predequant, variant=variant)

    want = run(q, None)
    stride = far_stride(T)
    qf = far_view(q, stride) if which == "q" else q
    outf = far_view(torch.zeros_like(q), stride) if which == "out" else torch.zeros_like(q)
    got = run(qf, outf)
    return {"equal": got is outf and same_bits(outf, want), **offsets(T, stride)}


# ----------------------------------------------------------------------------- V4 compressor
def compress(head: str, device) -> dict:
    """V4 compressed-KV writer (kernels.fp8_writers_v4_compress) with the state block table's
    request rows far apart: ``head`` 512 (the 584-byte record) or 128 (the indexer row)."""
    t4c = importlib.import_module("test_fp8_writers_v4_compress")
    s = t4c._to(t4c._scenario(int(head), 4, True, 4, 16, seed=11), device)
    want = t4c._run_ours(s, "sm80")
    reqs = s.block_table.shape[0]  # 4: the last request's row is the one past 2^31
    far = SimpleNamespace(**vars(s))
    far.block_table = far_view(s.block_table, far_stride(reqs))
    got = t4c._run_ours(far, "sm80")
    return {"equal": same_bits(got, want), **offsets(reqs, far.block_table.stride(0))}


CASES = {"inverse_rope": inverse_rope, "indexer_q": indexer_q, "decode": decode,
         "compress": compress}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("variant")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    res = CASES[a.case](a.variant, torch.device(a.device))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
