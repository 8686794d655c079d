"""The writers scenario's checks (tests/vllm_import_probe.py runs them in a subprocess with
the patched vLLM tree on PYTHONPATH, TRITON_INTERPRET=1 and DEEPINFER_ARCH=sm80): each
patched upstream function, called as vLLM calls it, must give the bytes our kernel gives
when called directly. Imported only inside the probe process (it imports vLLM)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm.deepinfer import arch, routing
from vllm.deepinfer import kv_record as rec
from vllm.deepinfer.kernels import fp8_writers_v4 as ours4
from vllm.deepinfer.kernels import fp8_writers_v41 as ours41


def same(a, b):
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def cos_sin(n, g):
    ang = torch.rand(n, 32, generator=g) * 6.3
    return torch.cat([ang.cos(), ang.sin()], 1).contiguous()


def v41_insert(g):
    from vllm.models.deepseek_v41.common.ops import fused_compress_quant_cache as up
    n = 12
    latent = (torch.randn(n, 512, generator=g) * 4).to(torch.bfloat16)
    pos = torch.arange(n, dtype=torch.int64)
    slots = torch.arange(n, dtype=torch.int64)
    cs = cos_sin(64, g)
    a, b = rec.new_cache(2, 16), rec.new_cache(2, 16)
    up.rope_quant_insert(latent, pos, cs, a, slots, 1)
    ours41.rope_quant_insert(latent, pos, cs, b, slots, 1, variant="sm80")
    return {"same": same(a, b), "written": bool(a.any())}


def v41_indexer_k(g):
    from vllm.models.deepseek_v41.common.ops import indexer_k_store as up
    n = 10
    k = torch.randn(n, 128, generator=g).to(torch.bfloat16)
    w = torch.ones(128, dtype=torch.bfloat16)
    pos = torch.arange(n, dtype=torch.int64)
    slots = torch.arange(n, dtype=torch.int64)
    cs = cos_sin(64, g)
    a = torch.zeros(2, 8, 132, dtype=torch.uint8)
    b = a.clone()
    up.indexer_k_norm_rope_store(k, pos, cs, w, 1e-6, a, slots, 1, False)
    ours41.indexer_k_norm_rope_store(k, pos, cs, w, 1e-6, b, slots, 1, False, variant="sm80")
    return {"same": same(a, b), "written": bool(a.any())}


def v4_indexer_q(g):
    from vllm.models.deepseek_v4.common.ops import fused_indexer_q as up
    t, h = 4, 4
    q = torch.randn(t, h, 128, generator=g).to(torch.bfloat16)
    pos = torch.arange(t, dtype=torch.int64)
    cs = cos_sin(16, g)
    w = torch.randn(t, h, generator=g).to(torch.bfloat16)
    qa, wa = up.fused_indexer_q_rope_quant(pos, q, cs, w, 0.1, 0.5)
    qb, wb = ours4.fused_indexer_q_rope_quant(pos, q, cs, w, 0.1, 0.5, variant="sm80")
    return {"same": same(qa, qb) and same(wa, wb)}


def v4_inv_rope(g):
    import importlib  # (the ops package re-exports a function under the module's name)
    up = importlib.import_module("vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant")
    t, groups, hpg = 3, 2, 2
    o = torch.randn(t, groups * hpg, 512, generator=g).to(torch.bfloat16)
    pos = torch.arange(t, dtype=torch.int64)
    cs = cos_sin(16, g)
    # The custom op's body (the function the patch routes), called as the op calls it.
    d, blocks = hpg * 512, hpg * 512 // 128
    out_a, sc_a = up._fused_inv_rope_fp8_quant_kernel_impl(
        o, pos, cs, hpg, 128, 4, 448, 32, False, 448.0, 4, t, groups, d, blocks, True)
    out_b, sc_b = ours4.fused_inv_rope_fp8_quant(o, pos, cs, groups, hpg, variant="sm80")
    return {"same": same(out_a, out_b.transpose(0, 1)) and same(sc_a, sc_b.transpose(0, 1)),
            "shape": list(out_a.shape)}


def v4_compressor_launcher():
    from vllm.models.deepseek_v4.common.ops import fused_compress_quant_cache as up
    seen = {}
    orig = routing.compress_norm_rope_store
    routing.compress_norm_rope_store = lambda **kw: seen.update(kw) or True
    try:
        names = ["state_cache", "num_actual", "token_to_req_indices", "positions",
                 "slot_mapping", "block_table", "block_size", "state_width",
                 "cos_sin_cache", "kv_cache", "k_cache_metadata", "pdl_kwargs", "head_dim",
                 "rope_head_dim", "compress_ratio", "overlap", "use_fp4_cache",
                 "rms_norm_weight", "rms_norm_eps", "quant_block", "token_stride",
                 "scale_dim"]
        args = {n: i for i, n in enumerate(names)}
        args["use_fp4_cache"] = False
        up.compress_norm_rope_store_triton(**args)
    finally:
        routing.compress_norm_rope_store = orig
    return {"passed": sorted(k for k in seen if seen[k] == args.get(k, seen[k])),
            "mx_scale": seen.get("mx_scale")}


def cutedsl_gate():
    from vllm.utils import import_utils
    orig_mod, orig_cap = import_utils._has_module, arch.device_capability
    import_utils._has_module = lambda name: True
    out = {}
    try:
        for cap in ((8, 0), (8, 6), (8, 9), (9, 0)):
            arch.device_capability = lambda cap=cap: cap
            routing.cutedsl_allowed.cache_clear()
            out[f"{cap[0]}.{cap[1]}"] = import_utils.has_cutedsl()
    finally:
        import_utils._has_module, arch.device_capability = orig_mod, orig_cap
        routing.cutedsl_allowed.cache_clear()
    return out


def warmup_registration():
    from vllm.deepinfer import warmup
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(
            compress_ratios=[0, 1, 2], sliding_window=128, index_topk=512,
            num_attention_heads=64)),
        parallel_config=SimpleNamespace(tensor_parallel_size=1))
    reg = JitWarmupRegistry(cfg)
    with reg.activate():
        ok = warmup.register_with_vllm()
        warmup.register_with_vllm()  # a second layer: deduplicated
    kernel = warmup._vllm_kernel()
    keys = kernel.get_warmup_keys(cfg)
    return {"registered": ok, "entries": len(reg),
            "kernels": sorted({k.kernel for k in keys}), "keys": len(keys)}


def deep_gemm_logits():
    """Patch 0015: vllm.utils.deep_gemm's MQA-logits entry points return our kernel's
    logits for FP8 calls; an MX call (bf16 weights, SM100) still goes to DeepGEMM
    (absent here, so upstream's 'DeepGEMM backend is not available' error)."""
    from vllm.deepinfer.kernels import indexer_logits as il
    from vllm.utils import deep_gemm
    g = torch.Generator().manual_seed(3)

    def codes(*shape):
        b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
        return torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)
    q = codes(2, 1, 4, 128).view(torch.float8_e4m3fn)
    cache = codes(3, 64, 132)
    cache.view(3, -1)[:, 64 * 128:] = torch.full((3, 64), 0.5).view(torch.uint8)
    w = torch.randn(2, 4, generator=g)
    ctx = torch.tensor([70, 5], dtype=torch.int32)
    bt = torch.tensor([[2, 0], [1, 0]], dtype=torch.int32)
    got = deep_gemm.fp8_fp4_paged_mqa_logits((q, None), cache.unsqueeze(2), w, ctx, bt,
                                             None, 80)
    want = il.paged_mqa_logits(q, cache, w, ctx, bt, 80, variant="sm80")
    paged_equal = all(torch.equal(got[r, :n].view(torch.int32), want[r, :n].view(torch.int32))
                      for r, n in enumerate((70, 5)))
    qf = codes(3, 4, 128).view(torch.float8_e4m3fn)
    k, ks = codes(50, 128).view(torch.float8_e4m3fn), torch.rand(50, generator=g) + 0.5
    wf = torch.randn(3, 4, generator=g)
    s0 = torch.tensor([0, 0, 20], dtype=torch.int32)
    s1 = torch.tensor([1, 20, 50], dtype=torch.int32)
    got = deep_gemm.fp8_fp4_mqa_logits((qf, None), (k, ks), wf, s0, s1, 30)
    want = il.mqa_logits(qf, k, ks, wf, s0, s1, 30, variant="sm80")
    flat_equal = all(torch.equal(got[r, :n].view(torch.int32), want[r, :n].view(torch.int32))
                     for r, n in enumerate((1, 20, 30)))
    try:
        deep_gemm.fp8_fp4_paged_mqa_logits((q, None), cache.unsqueeze(2), w.bfloat16(), ctx,
                                           bt, None, 80)
        mx = "ours"
    except Exception as e:  # DeepGEMM's missing-backend error
        mx = type(e).__name__ + ": " + str(e)[:80]
    return {"paged_equal": paged_equal, "flat_equal": flat_equal, "mx_call": mx}


def pack_seq_fp8():
    """Patch 0017: pack_seq_triton of an e4m3 tensor and unpack_seq_triton go to
    vllm.deepinfer.kernels.pack_seq on sm80 (64-bit offsets; the pack pads 0)."""
    from vllm.deepinfer.kernels import pack_seq as ps
    from vllm.v1.attention.ops.common import pack_seq_triton, unpack_seq_triton
    calls = {"pack": 0, "unpack": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper
    ps.pack_seq_bytes = counted("pack", ps.pack_seq_bytes)
    ps.unpack_seq = counted("unpack", ps.unpack_seq)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (7, 4, 128), generator=g, dtype=torch.int32)
    x = torch.where((x & 0x7F) == 0x7F, x - 1, x).to(torch.uint8).view(torch.float8_e4m3fn)
    lengths = torch.tensor([3, 1, 3], dtype=torch.int32)
    out = pack_seq_triton(x, lengths)
    want = torch.zeros(3, 3, 4, 128, dtype=torch.uint8)
    starts = [0, 3, 4]
    for b, (s0, n) in enumerate(zip(starts, lengths.tolist())):
        want[b, :n] = x[s0:s0 + n].view(torch.uint8)
    topk = torch.randint(-1, 1 << 20, (3, 3, 16), generator=g, dtype=torch.int32)
    rows = unpack_seq_triton(topk, lengths)
    want_rows = torch.cat([topk[b, :n] for b, n in enumerate(lengths.tolist())])
    return {"dtype": str(out.dtype), "shape": list(out.shape),
            "bytes_equal": torch.equal(out.view(torch.uint8), want),
            "unpack_equal": torch.equal(rows, want_rows), "ours_calls": calls}
