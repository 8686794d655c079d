"""Boundary cases of tests/test_int32_hazards.py that need inputs past 2^31 elements, one per
process (an offset that wraps reads or writes outside its tensor, which can kill the process).

    python tests/int32_hazard_probe.py CASE VARIANT [--device cpu|cuda]

As in tests/offset_probe.py (whose ``far_stride`` / ``far_view`` these reuse): a handful of
rows sit ``stride(0)`` elements apart in one large buffer (on CPU ``torch.empty`` only
reserves it), so ``row * stride(0)`` passes 2^31 - 1 with a grid of a few programs, and the
same launch on a compact copy is the expectation. The last stdout line is a JSON object with
``equal`` and the offsets.

Cases:
* ``ragged ours|upstream``: the dense -> ragged conversion (kernels/ragged_indices.py, or
  upstream's two kernels launched as its host code launches them) of index rows far apart;
* ``pack ours``, ``unpack ours``: kernels/pack_seq.py with the input's token rows / the
  packed batches far apart. Upstream's pack/unpack kernels have no case here: they address
  their tensors as contiguous [rows, D], so their wrap needs (rows) x D past 2^31 elements and
  a grid over all of it (half a million programs at D = 8,192), out of the interpreter's
  reach (their int32 products are plain in the source: ``in_row[:, None] * D``,
  ``(pid_b * Lmax + off_t)[:, None] * D``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "cuda" not in sys.argv:  # CPU tensors: the Triton interpreter (before Triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "overlay", HERE.parent / "build"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from offset_probe import far_stride, far_view, offsets, same_bits  # noqa: E402


def upstream_ragged(indices, lengths, num_rows: int):
    """Upstream ``build_ragged_indices_from_dense``: its two kernels (build/upstream_kernels)
    launched as its host code launches them (count, cumsum, compact)."""
    import importlib

    import triton
    up = importlib.import_module("upstream_kernels.v41_sparse_prefill")
    ind = indices.reshape(indices.shape[0], -1)
    lens = lengths.to(device=ind.device, dtype=torch.int32).reshape(-1).contiguous()
    nq, width = ind.shape
    block = min(triton.next_power_of_2(width), 1024) if width > 0 else 1
    counts = torch.empty(nq, dtype=torch.int32, device=ind.device)
    indptr = torch.empty(nq + 1, dtype=torch.int32, device=ind.device)
    if nq > 0 and width > 0:
        block_r = max(1, 1024 // block)
        up._count_valid_row_entries_kernel[(triton.cdiv(nq, block_r),)](
            ind, lens, counts, indptr, ind.stride(0), int(num_rows), nq, width,
            BLOCK_R=block_r, BLOCK_W=block)
    else:
        counts.zero_()
        indptr.zero_()
    torch.cumsum(counts, dim=0, out=indptr[1:])
    if ind.numel() == 0:
        return torch.empty(0, dtype=torch.int32, device=ind.device), indptr
    flat = torch.empty(nq * width, dtype=torch.int32, device=ind.device)
    up._compact_dense_row_to_ragged_kernel[(nq,)](
        ind, lens, indptr, flat, ind.stride(0), int(num_rows), width, BLOCK_W=block)
    return flat, indptr


def ragged(variant: str, device) -> dict:
    from vllm.deepinfer.kernels import ragged_indices as ri
    g = torch.Generator().manual_seed(21)
    R, W, rows = 3, 200, 5000
    dense = torch.randint(-3, rows + 40, (R, W), generator=g, dtype=torch.int32).to(device)
    lens = torch.tensor([200, 57, 133], dtype=torch.int32, device=device)
    build = {"ours": lambda x: ri.build_ragged_indices_from_dense(x, lens, num_rows=rows),
             "upstream": lambda x: upstream_ragged(x, lens, rows)}[variant]
    flat, indptr = build(dense)
    far = far_view(dense, far_stride(R))
    flat_f, indptr_f = build(far)
    n = int(indptr[-1])
    return {"equal": same_bits(indptr_f, indptr) and same_bits(flat_f[:n], flat[:n]),
            **offsets(R, far.stride(0))}


def _pack_inputs(device):
    g = torch.Generator().manual_seed(22)
    lengths = torch.tensor([2, 1, 3], dtype=torch.int32, device=device)
    x = torch.randint(0, 256, (6, 4, 32), generator=g, dtype=torch.uint8).to(device)
    return x, lengths


def pack(variant: str, device) -> dict:
    """kernels/pack_seq.py's pack of e4m3 bytes with the input's token rows far apart."""
    if variant != "ours":
        raise SystemExit(f"pack: variant {variant!r}, expected ours")
    from vllm.deepinfer.kernels import pack_seq as ps
    g = torch.Generator().manual_seed(22)
    lengths = torch.tensor([2, 1, 3], dtype=torch.int32, device=device)
    x = torch.randint(0, 256, (6, 4, 32), generator=g, dtype=torch.uint8).to(device)
    want = ps.pack_seq_bytes(x, lengths)
    far = far_view(x, far_stride(x.shape[0]))
    got = ps.pack_seq_bytes(far, lengths)
    return {"equal": same_bits(got, want), **offsets(x.shape[0], far.stride(0))}


def unpack(variant: str, device) -> dict:
    """kernels/pack_seq.py's unpack of int32 top-k rows with the packed batches far apart."""
    if variant != "ours":
        raise SystemExit(f"unpack: variant {variant!r}, expected ours")
    from vllm.deepinfer.kernels import pack_seq as ps
    g = torch.Generator().manual_seed(23)
    lengths = torch.tensor([2, 1, 3], dtype=torch.int32, device=device)
    packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 3, 40), generator=g,
                           dtype=torch.int32).to(device)
    want = ps.unpack_seq(packed, lengths)
    far = far_view(packed, far_stride(packed.shape[0]))
    got = ps.unpack_seq(far, lengths)
    return {"equal": same_bits(got, want), **offsets(packed.shape[0], far.stride(0))}


CASES = {"ragged": ragged, "pack": pack, "unpack": unpack}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("variant")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    print(json.dumps(CASES[a.case](a.variant, torch.device(a.device))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
