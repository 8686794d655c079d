"""V4 compressed-KV writers vs upstream vLLM 0.33.0, at DeepSeek-V4 shapes.

``fp8_writers_v4_compress.compress_norm_rope_store_triton`` (our sm80 variant: software
e4m3, the Ampere code; our sm90 variant: hardware cast) against upstream's Triton kernels
of models/deepseek_v4/common/ops/fused_compress_quant_cache.py, run on the same inputs:

- ``v4_compress_c4a``: head 512, ratio 4 with overlap (8-row windows), 4-row fp32 state
  pages, 584-byte records in 64-entry pages (``_fused_kv_compress_norm_rope_insert_sparse_attn``);
- ``v4_compress_c128a``: head 512, ratio 128 (128-row windows), 8-row state pages,
  2-entry pages (same upstream kernel);
- ``v4_compress_indexer``: head 128, ratio 4 with overlap, 132-byte FP8 rows in 64-entry
  pages (``_fused_kv_compress_norm_rope_insert_indexer_attn``, fp32 scales).

Page sizes follow upstream's dispatch for 256-token cache blocks (256 // ratio entries)
with the 576-byte page alignment of ``fp8_ds_mla``. Two batches: a decode step of 64
requests, each token at a group boundary (every program pools and writes), and a prefill
chunk of one request (16384 tokens, 4096 with --quick; one token in ``ratio`` writes).
``exact``: every byte of the cache buffer (page padding included) equals upstream's.
``bytes``: what a launch must move: the boundary tokens' window rows (kv and score, fp32),
the records written, the per-token metadata. Times: ``ours_us``/``upstream_us`` GPU time
(launches captured in a CUDA graph), ``*_eager_us``/``*_host_us`` eager and host time per
call; ours go through the public function (input checks included).

Upstream on CUDA writes head 512 with a CuTeDSL kernel, not this Triton one; the Triton
kernel is the baseline because it is what we port (the CuTeDSL one does not build for
sm_80 either). The H200 is Hopper: these rows show the Ampere code computes upstream's
bytes, not A100 timings.
"""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

from harness import Harness, bit_equal
from vllm.deepinfer import kv_record as rec
from vllm.deepinfer.kernels import fp8_writers_v4_compress as v4c

OURS = ("sm80", "sm90")
CACHE_BLOCK_TOKENS = 256   # V4 cache block (tokens); compressed pages hold 256 // ratio
ALIGN = 576                # fp8_ds_mla page alignment (bytes)
MAX_POS = 65536            # cos_sin_cache rows
DECODE_REQS = 64
ROPE = v4c.ROPE_HEAD_DIM

# name -> (head, ratio, overlap, state rows per page, record bytes)
CONFIGS = {
    "v4_compress_c4a": (512, 4, True, 4, rec.RECORD_BYTES),
    "v4_compress_c128a": (512, 128, False, 8, rec.RECORD_BYTES),
    "v4_compress_indexer": (128, 4, True, 4, 128 + 4),
}


def _up():
    return importlib.import_module("upstream_kernels.v4_fused_compress")


def _inputs(dev, head, cr, overlap, state_block, row_bytes, positions_per_req):
    """One input set: a state cache holding every window row, block tables, the cache."""
    coff = 1 + overlap
    window = coff * cr
    reqs = len(positions_per_req)
    # State pages per request: only those the windows touch are distinct, the rest map to 0.
    first = [max(0, min(ps) - window + 1) // state_block for ps in positions_per_req]
    last = [max(ps) // state_block for ps in positions_per_req]
    counts = [b - a + 1 for a, b in zip(first, last)]
    num_pages = sum(counts) + 1
    width = 2 * coff * head
    state = torch.randn(num_pages, state_block, width, device=dev)
    state[..., coff * head:] *= 4.0
    block_table = torch.zeros(reqs, max(last) + 1, dtype=torch.int32, device=dev)
    at = 1
    for r in range(reqs):
        block_table[r, first[r]:last[r] + 1] = torch.arange(at, at + counts[r], device=dev)
        at += counts[r]
    positions = torch.cat([torch.as_tensor(ps) for ps in positions_per_req]).to(dev, torch.int64)
    token_to_req = torch.cat([torch.full((len(ps),), r, dtype=torch.int32)
                              for r, ps in enumerate(positions_per_req)]).to(dev)
    n = positions.numel()
    boundary = (positions + 1) % cr == 0
    entries = max(1, CACHE_BLOCK_TOKENS // cr)
    written = int(boundary.sum())
    kv_pages = -(-written // entries) + 1
    page = -(-entries * row_bytes // ALIGN) * ALIGN
    kv_slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
    kv_slots[boundary] = torch.arange(written, device=dev)
    backing = torch.zeros(kv_pages * page, dtype=torch.uint8, device=dev)
    return SimpleNamespace(
        state=state, block_table=block_table, positions=positions, token_to_req=token_to_req,
        state_slots=torch.arange(n, dtype=torch.int64, device=dev), kv_slots=kv_slots,
        backing=backing, cache=backing.as_strided((kv_pages, entries, row_bytes), (page, row_bytes, 1)),
        n=n, written=written)


def _row(h: Harness, name: str, batch: str, positions_per_req, cs, weight) -> None:
    head, cr, overlap, state_block, row_bytes = CONFIGS[name]
    dev, up = h.dev, _up()
    sparse = head == 512
    window = (1 + overlap) * cr

    def make():
        return _inputs(dev, head, cr, overlap, state_block, row_bytes, positions_per_req)

    def upstream(x):
        c = x.cache
        args = (x.state, x.state.stride(0), x.state.stride(1), x.token_to_req, x.positions,
                x.state_slots, x.block_table, x.block_table.stride(0), state_block, weight, 1e-6,
                cs, cs.stride(0), c, x.kv_slots, c.shape[1])
        common = dict(HEAD_SIZE=head, TRITON_BLOCK_SIZE=head, STATE_WIDTH=x.state.shape[2] // 2,
                      COMPRESS_RATIO=cr, OVERLAP=overlap, ROPE_HEAD_DIM=ROPE, FP8_MAX=448.0,
                      KV_BLOCK_STRIDE=c.stride(0))
        if sparse:  # compress_norm_rope_store_triton's head-512 launch
            up._fused_kv_compress_norm_rope_insert_sparse_attn[(x.n,)](
                *args, QUANT_BLOCK=64, TOKEN_STRIDE=576, SCALE_DIM=8, SANITIZE_CACHE_NANS=False,
                num_warps=4, **common)
        else:  # FusedKVCompressNormRopeInsertIndexerTritonKernel's launch (MX_SCALE off SM100)
            up._fused_kv_compress_norm_rope_insert_indexer_attn[(x.n,)](
                *args, QUANT_BLOCK=128, TOKEN_STRIDE=128, SCALE_DIM=4, MX_SCALE=False,
                num_warps=1, **common)

    def ours(x, v):
        v4c.compress_norm_rope_store_triton(
            x.state, x.n, x.token_to_req, x.positions, x.state_slots, x.block_table, state_block,
            x.state.shape[2] // 2, cs, x.cache, SimpleNamespace(slot_mapping=x.kv_slots),
            {"launch_pdl": False}, head, ROPE, cr, overlap, False, weight, 1e-6,
            64 if sparse else 128, 576 if sparse else 128, 8 if sparse else 4, variant=v)

    launches = {"upstream": upstream, **{v: (lambda x, v=v: ours(x, v)) for v in OURS}}

    def outputs(x, who):
        x.backing.zero_()
        launches[who](x)
        return x.backing.clone()

    probe = make()
    state_bytes = probe.state.numel() * 4
    # Each boundary token reads its window's kv and score halves (2 * head fp32 per row)
    # and block-table entries, and writes one record; every token reads position and slot.
    nbytes = (probe.written * (window * 2 * head * 4 + row_bytes + 4 + 8 + window // state_block * 4)
              + probe.n * 16 + head * 2)
    # Enough input sets for a ring over twice the L2 (the extra first set is dropped).
    inputs = [probe] + h.copies(make, state_bytes + probe.backing.numel())[1:]
    ref = outputs(inputs[0], "upstream")
    up_t = h.timings(upstream, inputs)
    shape = {"batch": batch, "tokens": probe.n, "written": probe.written, "head": head,
             "ratio": cr}
    for v in OURS:
        exact = bit_equal(outputs(inputs[0], v), ref)
        t = h.timings(launches[v], inputs)
        h.add(name, v, shape, t["gpu"], up_t["gpu"], bytes=nbytes, exact=exact,
              **h.launch_fields(t, up_t))


def run(h: Harness) -> None:
    torch.manual_seed(0)
    ang = torch.rand(MAX_POS, ROPE // 2, device=h.dev) * 6.3
    cs = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()
    prefill = 4096 if h.quick else 16384
    for name, (head, cr, _, _, _) in CONFIGS.items():
        weight = (1 + 0.1 * torch.randn(head, device=h.dev)).to(torch.bfloat16)
        # Decode: request r at a group boundary somewhere in a 32K context.
        decode = [[(1000 + 397 * r) // cr * cr + cr - 1] for r in range(DECODE_REQS)]
        _row(h, name, "decode", decode, cs, weight)
        _row(h, name, "prefill", [list(range(prefill))], cs, weight)
