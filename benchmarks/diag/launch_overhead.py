"""Host time per call of every kernel launcher of ``vllm.deepinfer`` (eager, after warmup).

Usage (on a CUDA machine; no vLLM needed):

    PYTHONPATH=<a copy of overlay/> python benchmarks/diag/launch_overhead.py --out PATH.json

Imports only ``vllm.deepinfer...`` from whatever ``PYTHONPATH`` says (this script never adds
the repository's overlay/ to ``sys.path``), and calls only the launchers' public functions
with arguments every version of the package takes, so one command can measure an older
copy of the package and the current one side by side (``meta.package`` records which file
was imported). ``meta.commit`` is ``DEEPINFER_COMMIT`` when set, else ``git rev-parse HEAD``
of this checkout.

Inputs are small (one decode token, a few rows), so each call's GPU work is shorter than its
host time and the figure is the Python + Triton launch cost: ``calls`` back-to-back calls
timed on the wall clock before the device is synchronized, repeated ``repeats`` times;
rows give the median and the minimum over the repeats, in microseconds per call. Variants
``sm80`` (what an A100 runs; here on the measuring GPU) and ``sm90``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

VARIANTS = ("sm80", "sm90")
# Attention and index heads of the inputs: V4.1's 64 (tests run the builders with fewer).
HEADS = 64


def _commit() -> str:
    env = os.environ.get("DEEPINFER_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse",
                              "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def _codes(shape, dev, gen):
    """Random e4m3 bytes without the NaN codes (0x7F / 0xFF)."""
    b = torch.randint(0, 256, shape, dtype=torch.int32, device=dev, generator=gen)
    return torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)


def _cos_sin(positions: int, dev) -> torch.Tensor:
    ang = torch.arange(positions, device=dev, dtype=torch.float32)[:, None] * torch.rand(
        32, device=dev)[None, :]
    return torch.cat([ang.cos(), ang.sin()], 1).contiguous()


def _records(blocks: int, page: int, dev, gen) -> torch.Tensor:
    """A [blocks, page, 584] cache of valid records (scale bytes 120..134)."""
    c = _codes((blocks, page * 584), dev, gen)
    scales = c[:, page * 576:].view(blocks, page, 8)
    scales[..., :7] = torch.randint(120, 135, (blocks, page, 7), dtype=torch.uint8, device=dev,
                                    generator=gen)
    scales[..., 7] = 0
    rope = c[:, :page * 576].view(blocks, page, 576)[..., 448:].view(torch.bfloat16)
    rope.copy_(torch.randn(rope.shape, device=dev, generator=gen))
    return c.view(blocks, page, 584)


# ----------------------------------------------------------------------------- launchers
def decode(dev, gen):
    """One V4.1 decode token of a ratio-1 layer: ``HEADS`` heads, SWA window 128 (32-token pages) +
    top-k 512 (64-token pages), sink, inverse RoPE, caller's ``out``."""
    from vllm.deepinfer.kernels import sparse_mla_decode as m
    q = torch.randn(1, HEADS, 512, device=dev, generator=gen).to(torch.bfloat16)
    main, extra = _records(8, 32, dev, gen), _records(16, 64, dev, gen)
    i32 = dict(dtype=torch.int32, device=dev)
    args = (q, main, torch.arange(128, **i32), torch.tensor([0, 128], **i32), 512 ** -0.5,
            torch.randn(HEADS, device=dev, generator=gen), 448, 64)
    kw = dict(extra_cache=extra, extra_indices=torch.randperm(1024, **i32)[:512],
              extra_indptr=torch.tensor([0, 512], **i32), out=torch.empty_like(q),
              inv_rope_positions=torch.tensor([300], dtype=torch.int64, device=dev),
              inv_rope_cos_sin_cache=_cos_sin(512, dev))
    return lambda v: m.sparse_attn_decode(*args, **kw, variant=v)


def kv_gather(dev, gen):
    """One request gathering 256 tokens of 64-token pages."""
    from vllm.deepinfer.kernels import kv_gather as m
    i32 = dict(dtype=torch.int32, device=dev)
    out = torch.empty(1, 256, 512, dtype=torch.bfloat16, device=dev)
    cache = _records(6, 64, dev, gen)
    seq, gl = torch.tensor([300], **i32), torch.tensor([256], **i32)
    bt = torch.tensor([[5, 1, 3, 0, 2]], **i32)
    return lambda v: m.dequantize_and_gather_k_cache(out, cache, seq, gl, bt, 64, 0,
                                                     max_gather_len=256, variant=v)


def topk_swa(dev, gen):
    """16 prefill tokens of one request, V4.1 ratio 1 (top-k 512, window 128), caller's out."""
    from vllm.deepinfer.kernels import topk_swa as m
    i32 = dict(dtype=torch.int32, device=dev)
    tk = torch.randint(0, 1000, (16, 512), generator=gen, device=dev).to(torch.int32)
    qsl, seq, gl = (torch.tensor([0, 16], **i32), torch.tensor([1016], **i32),
                    torch.tensor([143], **i32))
    out = (torch.empty(16, 640, **i32), torch.empty(16, **i32))
    return lambda v: m.combine_topk_swa_indices(tk, qsl, seq, gl, 128, 1, 512, 1143, 1000,
                                                out=out, variant=v)


def paged_mqa_logits(dev, gen):
    """One decode row, ``HEADS`` index heads, 256 keys in 64-token pages."""
    from vllm.deepinfer.kernels import indexer_logits as m
    q = _codes((1, 1, HEADS, 128), dev, gen).view(torch.float8_e4m3fn)
    cache = _codes((5, 64, 132), dev, gen)
    cache.view(5, -1)[:, 64 * 128:] = torch.ones(5, 64, device=dev).view(torch.uint8).view(5, -1)
    w = torch.randn(1, HEADS, device=dev, generator=gen)
    ctx = torch.tensor([256], dtype=torch.int32, device=dev)
    bt = torch.tensor([[4, 0, 2, 1]], dtype=torch.int32, device=dev)
    return lambda v: m.paged_mqa_logits(q, cache, w, ctx, bt, 256, variant=v)


def mqa_logits(dev, gen):
    """16 prefill rows over 256 gathered keys."""
    from vllm.deepinfer.kernels import indexer_logits as m
    q = _codes((16, HEADS, 128), dev, gen).view(torch.float8_e4m3fn)
    k = _codes((256, 128), dev, gen).view(torch.float8_e4m3fn)
    ks = torch.ones(256, device=dev)
    w = torch.randn(16, HEADS, device=dev, generator=gen)
    s0 = torch.zeros(16, dtype=torch.int32, device=dev)
    s1 = torch.arange(241, 257, dtype=torch.int32, device=dev)
    return lambda v: m.mqa_logits(q, k, ks, w, s0, s1, 256, variant=v)


def rope_quant_insert(dev, gen):
    """4 tokens into the 584-byte cache (64-token pages), ratio 1."""
    from vllm.deepinfer.kernels import fp8_writers_v41 as m
    latent = torch.randn(4, 512, device=dev, generator=gen).to(torch.bfloat16)
    pos = torch.arange(100, 104, device=dev)
    cache = torch.zeros(2, 64, 584, dtype=torch.uint8, device=dev)
    cs = _cos_sin(512, dev)
    slots = torch.tensor([3, 70, 9, 100], device=dev)
    return lambda v: m.rope_quant_insert(latent, pos, cs, cache, slots, 1, variant=v)


def indexer_k_store(dev, gen):
    """4 index keys into the 132-byte index-K cache (64-token pages), ratio 1."""
    from vllm.deepinfer.kernels import fp8_writers_v41 as m
    k = torch.randn(4, 128, device=dev, generator=gen).to(torch.bfloat16)
    pos = torch.arange(100, 104, device=dev)
    w = torch.ones(128, dtype=torch.bfloat16, device=dev)
    cache = torch.zeros(2, 64, 132, dtype=torch.uint8, device=dev)
    cs = _cos_sin(512, dev)
    slots = torch.tensor([3, 70, 9, 100], device=dev)
    return lambda v: m.indexer_k_norm_rope_store(k, pos, cs, w, 1e-6, cache, slots, 1, False,
                                                 variant=v)


def inv_rope_fp8_quant(dev, gen):
    """4 decode tokens' attention output, ``HEADS`` heads in 8 o groups, 128-wide fp8 blocks."""
    from vllm.deepinfer.kernels import fp8_writers_v4 as m
    o = torch.randn(4, HEADS, 512, device=dev, generator=gen).to(torch.bfloat16)
    pos = torch.arange(100, 104, device=dev)
    cs = _cos_sin(512, dev)
    return lambda v: m.fused_inv_rope_fp8_quant(o, pos, cs, 8, HEADS // 8, variant=v)


def indexer_q_rope_quant(dev, gen):
    """4 tokens' index queries, ``HEADS`` heads x 128 dims."""
    from vllm.deepinfer.kernels import fp8_writers_v4 as m
    q = torch.randn(4, HEADS, 128, device=dev, generator=gen).to(torch.bfloat16)
    pos = torch.arange(100, 104, device=dev)
    cs = _cos_sin(512, dev)
    w = torch.randn(4, HEADS, device=dev, generator=gen).to(torch.bfloat16)
    return lambda v: m.fused_indexer_q_rope_quant(pos, q, cs, w, 128 ** -0.5, HEADS ** -0.5,
                                                  variant=v)


def _compressor(dev, gen, head: int):
    """V4 compressor, ratio 4 with overlap: 4 tokens (one group boundary) of one request."""
    from vllm.deepinfer.kernels import fp8_writers_v4_compress as m
    block, row = 8, 2 * 2 * head
    state = torch.randn(4, block, row, device=dev, generator=gen)
    i32 = dict(dtype=torch.int32, device=dev)
    pos = torch.arange(4, 8, device=dev)
    record = 584 if head == 512 else 132
    cache = torch.zeros(2, 64, record, dtype=torch.uint8, device=dev)
    layout = (64, 576, 8) if head == 512 else (128, 128, 4)
    kw = dict(state_cache=state, num_actual=4, token_to_req_indices=torch.zeros(4, **i32),
              positions=pos, slot_mapping=torch.arange(4, 8, device=dev),
              block_table=torch.tensor([[0, 1, 2, 3]], **i32), block_size=block,
              state_width=row // 2, cos_sin_cache=_cos_sin(512, dev), kv_cache=cache,
              k_cache_metadata=SimpleNamespace(slot_mapping=torch.tensor([-1, -1, -1, 1],
                                                                          device=dev)),
              pdl_kwargs={}, head_dim=head, rope_head_dim=64, compress_ratio=4, overlap=True,
              use_fp4_cache=False, rms_norm_weight=torch.ones(head, dtype=torch.bfloat16,
                                                              device=dev),
              rms_norm_eps=1e-6, quant_block=layout[0], token_stride=layout[1],
              scale_dim=layout[2])
    return lambda v: m.compress_norm_rope_store_triton(**kw, variant=v)


LAUNCHERS = {
    "sparse_mla_decode.sparse_attn_decode": decode,
    "kv_gather.dequantize_and_gather_k_cache": kv_gather,
    "topk_swa.combine_topk_swa_indices": topk_swa,
    "indexer_logits.paged_mqa_logits": paged_mqa_logits,
    "indexer_logits.mqa_logits": mqa_logits,
    "fp8_writers_v41.rope_quant_insert": rope_quant_insert,
    "fp8_writers_v41.indexer_k_norm_rope_store": indexer_k_store,
    "fp8_writers_v4.fused_inv_rope_fp8_quant": inv_rope_fp8_quant,
    "fp8_writers_v4.fused_indexer_q_rope_quant": indexer_q_rope_quant,
    "fp8_writers_v4_compress.compress_norm_rope_store_triton[head512]":
        lambda d, g: _compressor(d, g, 512),
    "fp8_writers_v4_compress.compress_norm_rope_store_triton[head128]":
        lambda d, g: _compressor(d, g, 128),
}


def host_us(fn, calls: int, repeats: int) -> list[float]:
    """Microseconds per call of ``repeats`` runs of ``calls`` back-to-back calls (wall clock
    up to the last launch; the device is synchronized between runs)."""
    for _ in range(20):  # compile and warm every cache first
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((t1 - t0) / calls * 1e6)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_overhead: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    import vllm.deepinfer as pkg
    dev = torch.device("cuda")
    meta = {"gpu": torch.cuda.get_device_name(dev),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(dev))),
            "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "commit": _commit(),
            "package": str(Path(pkg.__file__).resolve().parent),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "calls": args.calls, "repeats": args.repeats}
    rows = []
    for name, build in LAUNCHERS.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        for v in VARIANTS:
            row = {"launcher": name, "variant": v}
            try:
                fn = build(dev, gen)
                times = host_us(lambda: fn(v), args.calls, args.repeats)
                row.update(host_us_median=round(statistics.median(times), 2),
                           host_us_min=round(min(times), 2))
            except Exception as e:  # one launcher's failure must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
