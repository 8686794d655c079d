"""No compile while serving, proven on a CPU: every launch our kernels make over a grid of
realistic calls finds, in Triton's JIT cache, a key that vLLM's warmup compiled
(vllm.deepinfer.warmup).

Both sides are Triton's own cache keys (tests/launch_keys.py: argument types, the runtime
specialization of ints and pointers, the launch options), computed for a CUDA target
without a GPU: the warmup's from ``warmup_args(key)`` as ``JITFunction.warmup`` binds them,
the launches' from the real launchers called with production geometry (V4.1: SWA pages of
32; compressed and index-K pages of 64 tokens with kv_page64, upstream's 128 (64 on sm90)
without it, page // ratio entries each; V4: SWA 64, C4A 64, C128A 2), head counts of TP 1
to 8, batch sizes from 1 to past the request buckets, chunks that start at odd requests (the
metadata slices that move pointer alignment) and the SM counts of A100, A10/A40/RTX 3090 and
H200. Launches are intercepted, not run, so the grid costs milliseconds. A launch outside
the warmup is printed with its full key (what to add to the warmup or to the kernel's
``do_not_specialize``).
"""
from __future__ import annotations

import functools
import itertools

import pytest
import torch

from launch_keys import describe, key_of, recording
from vllm.deepinfer import arch
from vllm.deepinfer import warmup as wu
from vllm.deepinfer.kernels import indexer_logits as il
from vllm.deepinfer.kernels import kv_gather as kg
from vllm.deepinfer.kernels import sparse_mla_decode as smd
from vllm.deepinfer.kernels import sparse_mla_prefill as spm
from vllm.deepinfer.kernels import topk_swa as ts
from vllm.deepinfer.kv_record import new_cache

VARIANTS = ("sm80", "sm90")
# SM counts: A100 108, RTX 3090 82, A10 72, H200 132.
SM_COUNTS = (108, 82, 72, 132)
CC = {"sm80": 80, "sm90": 90}
I32 = dict(dtype=torch.int32)
# V4.1's compressed / index-K page in tokens as vLLM resolves it for the Ampere path, by the
# kv_page64 feature: on, the 64 both of our backends declare (attention/ampere_v41.py; the
# construct probe of tests/test_vllm_import.py checks them); off, upstream's 128 off SM90 and
# 64 on SM90. A ratio-r cache holds page // r entries per page (MLAAttentionSpec
# tokens_per_state); V4's pages hold 256 tokens.
V41_PAGE_TOKENS = {True: {"sm80": 64, "sm90": 64}, False: {"sm80": 128, "sm90": 64}}
V4_PAGE_TOKENS = 256


def _entries(shapes, ratio, variant, page64=True):
    if shapes.model == "v41":
        return V41_PAGE_TOKENS[page64][variant] // ratio
    return V4_PAGE_TOKENS // ratio


@pytest.fixture(params=[True, False], ids=["kv_page64", "page64_off"])
def page64(request, monkeypatch):
    """kv_page64 on (the default) or DEEPINFER_KV_PAGE64=0."""
    monkeypatch.delenv("DEEPINFER_DISABLE", raising=False)
    if request.param:
        monkeypatch.delenv("DEEPINFER_KV_PAGE64", raising=False)
    else:
        monkeypatch.setenv("DEEPINFER_KV_PAGE64", "0")
    return request.param


def _models(variant, tps=(1,)):
    """ModelShapes of V4.1 and V4 (64 heads, split by TP); V4 at 8K and 1M context (its C128A
    top-k width follows the context; nothing of V4.1's does)."""
    return [wu.ModelShapes(window=128, compress_ratios=ratios, topk=512, heads=64 // tp,
                           model=model, max_model_len=ctx)
            for model, ratios, ctxs in (("v41", (0, 1, 2), (8192,)),
                                        ("v4", (1, 4, 128), (8192, 1 << 20)))
            for ctx in ctxs for tp in tps]


def _warm_keys(shapes, variant):
    out: dict[str, set] = {}
    # Upstream helpers' keys (serve_warmup) need vLLM itself: tests/test_warmup_upstream.py.
    ours = [f for f in wu._KEYS if f != "serve_warmup"]
    for k in wu.keys(shapes, variant, features=ours, sm_count=max(SM_COUNTS)):
        kern, _ = wu._kernel_and_signature(k.kernel)
        args, ce = wu.warmup_args(k)
        out.setdefault(kern.fn.__name__, set()).add(
            key_of(kern, args, dict(ce, **wu.launch_options(k)), CC[variant]))
    return out


@pytest.fixture
def gpu_like(monkeypatch):
    """Launchers as on a GPU: the interpreter's fp32-dot switch off, the SM count set."""
    monkeypatch.setattr(arch, "interpreting", lambda: False)

    def set_sms(n):
        monkeypatch.setattr(arch, "sm_count", lambda device=None: n)
    return set_sms


def _uncovered(seen, warm) -> list[str]:
    return sorted({describe(kern, key) for kern, key in seen
                   if key not in warm.get(kern.fn.__name__, ())})


# ----------------------------------------------------------------------------- decode
@functools.cache
def _zeros(shape: tuple, dtype=torch.int32):
    """Launches are not run: one read-only tensor per shape serves every call."""
    return torch.zeros(shape, dtype=dtype)


def _decode_calls(shapes, variant, page64=True):
    swa_bs = shapes.swa_page
    heads = shapes.heads
    # Odd block counts: the row counts the kernel bounds-checks against are not multiples of 16.
    swa = new_cache(101, swa_bs)
    cs = torch.zeros(4096, 64)  # fp32 cos | sin (upstream's V4 rotary cache)
    # Both sides of the two-phase threshold (sm80: single phase below it, two phases from it).
    batches = (1, 3, smd.PREDEQUANT_MIN_TOKENS, 64)
    for ratio, tokens in itertools.product(shapes.compress_ratios, batches):
        q = _zeros((tokens, heads, 512), torch.bfloat16)
        mi = _zeros((tokens * shapes.window,))
        mp = torch.arange(tokens + 1, **I32) * shapes.window
        pos = _zeros((tokens,), torch.int64)
        kw = {}
        if not shapes.swa_only(ratio):
            width = shapes.c128a_topk if ratio >= 128 else shapes.topk
            kw = dict(extra_cache=new_cache(33, _entries(shapes, ratio, variant, page64)),
                      extra_indices=_zeros((tokens * width,)),
                      extra_indptr=torch.arange(tokens + 1, **I32) * width)
        yield lambda: smd.sparse_attn_decode(
            q, swa, mi, mp, 0.04, torch.zeros(heads), 448, 64, **kw, inv_rope_positions=pos,
            inv_rope_cos_sin_cache=cs, variant=variant)


@pytest.mark.parametrize("variant,switch", [("sm80", None), ("sm80", "0"), ("sm90", None)])
def test_decode_launches_are_warmed(variant, switch, page64, gpu_like, monkeypatch):
    """sm80 by default: single-phase launches below PREDEQUANT_MIN_TOKENS tokens, two-phase
    ones (the "-2p" tile and its first phase) from it, both warmed;
    DEEPINFER_DECODE_PREDEQUANT=0: single phase at every batch, and the warmup drops the
    two-phase keys. sm90: single phase only. V4.1's compressed pages with kv_page64 on
    (64-token pages: 64 and 32 entries) and off."""
    if switch is not None:
        monkeypatch.setenv("DEEPINFER_DECODE_PREDEQUANT", switch)
    rows = set()
    select = smd.select_tile

    def spy(*a, **kw):
        row = select(*a, **kw)
        rows.add(row)
        return row
    monkeypatch.setattr(smd, "select_tile", spy)
    two_phase = variant == "sm80" and switch is None
    for shapes in _models(variant, tps=(1, 2, 4, 8)):
        warm = _warm_keys(shapes, variant)
        assert ("_predequant_kernel" in warm) == two_phase
        with recording(CC[variant]) as seen:
            for sms in SM_COUNTS:
                gpu_like(sms)
                for call in _decode_calls(shapes, variant, page64):
                    call()
        names = {k.fn.__name__ for k, _ in seen}
        assert names == {"_sparse_mla_decode_kernel", "_sparse_mla_decode_reduce_kernel"} | (
            {"_predequant_kernel"} if two_phase else set())
        assert not _uncovered(seen, warm), "\n".join(_uncovered(seen, warm))
    assert rows == ({variant, f"{variant}-2p"} if two_phase else {variant})


# ----------------------------------------------------------------------------- prefill
def _chunks(num_reqs):
    """The attention layers' chunk loop: requests [c0, c1) after ``nd`` decodes."""
    for nd, c0, c1 in ((0, 0, num_reqs), (3, 1, num_reqs), (1, 2, num_reqs)):
        if c1 > c0:
            yield nd, c0, c1


def _prefill_calls(shapes, variant, page64=True):
    for num_reqs in (1, 17, 130):  # the gather's request buckets: 16, 128, 1024
        seq = torch.full((num_reqs + 3,), 300, **I32)
        gl = torch.full((num_reqs + 3,), 200, **I32)
        qsl = torch.arange(num_reqs + 4, **I32) * 50
        bt = torch.zeros(num_reqs + 3, 37, **I32)  # an odd number of blocks per request
        topk = torch.zeros(50 * (num_reqs + 3), 512, **I32)
        for nd, c0, c1 in _chunks(num_reqs):
            n = c1 - c0
            for ratio in shapes.compress_ratios:
                out = _zeros((n, 700, 512), torch.bfloat16)
                swa = new_cache(50, shapes.swa_page)

                def swa_gather(out=out, swa=swa, nd=nd, c0=c0, c1=c1):
                    kg.dequantize_and_gather_k_cache(
                        out, swa, seq[c0:c1], gl[c0:c1], bt[nd:][c0:c1], shapes.swa_page, 400,
                        variant=variant)
                yield swa_gather
                if not shapes.swa_only(ratio):
                    page = _entries(shapes, ratio, variant, page64)
                    comp = new_cache(50, page)

                    def comp_gather(out=out, comp=comp, nd=nd, c0=c0, c1=c1, page=page, r=ratio):
                        kg.dequantize_and_gather_k_cache(
                            out, comp, seq[c0:c1] // r, None, bt[nd:][c0:c1], page, 0,
                            variant=variant)
                    yield comp_gather
                # C128A: the step's active width, a power of two from 128 up to the model's
                widths = [0] if shapes.swa_only(ratio) else (
                    [shapes.topk] if ratio < 128 else
                    sorted({min(w, shapes.c128a_topk) for w in (128, 256, 1024, 8192)}))
                for w in widths:
                    tk = topk if w <= 512 else _zeros((topk.shape[0], w))

                    def combine(tk=tk, w=w, r=ratio, nd=nd, c0=c0, c1=c1):
                        qs, qe = int(qsl[nd + c0] - qsl[nd]), int(qsl[nd + c1] - qsl[nd])
                        ts.combine_topk_swa_indices(
                            tk[qs:qe], qsl[nd + c0: nd + c1 + 1], seq[c0:c1], gl[c0:c1],
                            shapes.window, r, w, 700, 300, variant=variant)
                    yield combine


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_gather_and_combine_launches_are_warmed(variant, page64, gpu_like):
    for shapes in _models(variant):
        warm = _warm_keys(shapes, variant)
        with recording(CC[variant]) as seen:
            gpu_like(108)  # the SM count sizes the grid only, which is not part of the key
            for call in _prefill_calls(shapes, variant, page64):
                call()
        names = {k.fn.__name__ for k, _ in seen}
        assert names == {"_gather_kernel", "_combine_kernel"}
        assert not _uncovered(seen, warm), "\n".join(_uncovered(seen, warm))


def _attention_calls(shapes, variant):
    """The Ampere classes' prefill attention call (attention/common.py, through patch 0003's
    route): q and output rows [qs, qe) of the step's tensors, the chunk's workspace as
    [rows, 1, 512] with an odd row count, the combiner's [T, width] rows and lengths, the
    sink; every combined width the model's layers produce."""
    heads = shapes.heads
    q = _zeros((77, heads, 512), torch.bfloat16)
    out = _zeros((77, heads, 512), torch.bfloat16)
    sink = _zeros((heads,), torch.float32)
    for ratio in shapes.compress_ratios:
        tops = [0] if shapes.swa_only(ratio) else (
            [shapes.topk] if ratio < 128 else
            sorted({min(w, shapes.c128a_topk) for w in (128, 256, 1024, 8192)}))
        for top in tops:
            width = ts.combined_width(top, shapes.window)
            for qs, qe, rows in ((0, 1, 129), (3, 40, 1001), (5, 77, 7777)):
                idx, lens = _zeros((qe - qs, width)), _zeros((qe - qs,))
                kv = _zeros((rows, 1, 512), torch.bfloat16)
                yield lambda qs=qs, qe=qe, idx=idx, lens=lens, kv=kv: spm.sparse_attn_prefill(
                    q[qs:qe], kv, 0.04, sink, 448, 64, indices=idx, topk_length=lens,
                    out=out[qs:qe], variant=variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_attention_launches_are_warmed(variant, gpu_like):
    for shapes in _models(variant, tps=(1, 2, 4, 8)):
        warm = _warm_keys(shapes, variant)
        with recording(CC[variant]) as seen:
            gpu_like(108)
            for call in _attention_calls(shapes, variant):
                call()
        assert {k.fn.__name__ for k, _ in seen} == {"_sparse_mla_prefill_kernel"}
        assert not _uncovered(seen, warm), "\n".join(_uncovered(seen, warm))


# ----------------------------------------------------------------------------- indexer
def _index_caches(variant, page64):
    """Index-K caches [blocks, entries, 132] of ratio 1 and 2: alone (stride(0) one page) and
    as vLLM binds them, a view into the pool whose stride(0) is one pool block (v41-tput:
    93,312 B with 64-token pages, 184,320 B with 128, tests/test_kv_planner_vllm.py)."""
    pool = {64: 93_312, 128: 184_320}[V41_PAGE_TOKENS[page64][variant]]
    for ratio in (1, 2):
        n = V41_PAGE_TOKENS[page64][variant] // ratio
        yield torch.zeros(77, n, 132, dtype=torch.uint8)
        yield torch.zeros(77, pool, dtype=torch.uint8)[:, :n * 132].view(77, n, 132)


@pytest.mark.parametrize("variant", VARIANTS)
def test_indexer_logits_launches_are_warmed(variant, page64, gpu_like):
    shapes = _models(variant)[0]
    warm = _warm_keys(shapes, variant)
    heads = shapes.index_heads
    with recording(CC[variant]) as seen:
        for sms, cache in itertools.product((108, 132), _index_caches(variant, page64)):
            gpu_like(sms)
            for batch, next_n in ((1, 1), (3, 1), (64, 1), (4, 2), (5, 3)):
                rows = batch * next_n
                q = torch.zeros(batch, next_n, heads, 128, dtype=torch.uint8)
                lens = torch.full((batch, next_n) if next_n > 1 else (batch,), 700, **I32)
                bt = torch.zeros(batch + 2, 41, **I32)[1:]
                il.paged_mqa_logits(q, cache, torch.zeros(rows, heads), lens, bt, 8192,
                                    variant=variant)
            for rows, keys in ((1, 100), (7, 3000), (130, 8192)):
                ks = torch.zeros(rows + 3, **I32)
                il.mqa_logits(torch.zeros(rows + 3, heads, 128, dtype=torch.uint8)[3:],
                              torch.zeros(keys, 128, dtype=torch.uint8), torch.ones(keys),
                              torch.zeros(rows + 3, heads)[3:], ks[3:], ks[3:] + keys, keys,
                              variant=variant)
    assert {k.fn.__name__ for k, _ in seen} == {"_logits_kernel"}
    assert not _uncovered(seen, warm), "\n".join(_uncovered(seen, warm))


def test_the_oracle_sees_a_specialization_change():
    """A launch with a head count of 8 on a kernel that specializes it would have compiled
    again: the oracle tells the two keys apart (so the tests above can fail)."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(x_ptr, n):
        tl.store(x_ptr + tl.arange(0, 16), tl.zeros((16,), tl.float32) + n)

    x = torch.zeros(32)
    assert key_of(k, [x, 64], {}) != key_of(k, [x, 8], {})      # divisibility by 16
    assert key_of(k, [x, 64], {}) != key_of(k, [x[1:], 64], {})  # 16-byte alignment
    assert key_of(k, [torch.float32, 16], {}) == key_of(k, [x, 64], {})  # warmup form
    assert key_of(k, [x, 64], {"num_warps": 4}) != key_of(k, [x, 64], {})  # options count


# ----------------------------------------------------------------------------- V4 writers
@pytest.mark.parametrize("variant", ("sm80",))
def test_v4_compressor_writer_launches_are_warmed(variant, gpu_like):
    """V4's compressor writers (fp8_sw, on for the Ampere variants) at C4A and C128A, and the
    C4A indexer's: the H200 nocompile run at d80f014 compiled the C128A writer while serving
    (vLLM's load had not launched it)."""
    from test_fp8_writers_v4_compress import H128, H512, _run_ours, _scenario
    shapes = next(s for s in _models(variant) if s.model == "v4")
    warm = _warm_keys(shapes, variant)
    with recording(CC[variant]) as seen:
        gpu_like(108)
        # (head, ratio, overlap, state rows per page, cache entries per page)
        for head, cr, ov, sb, kb in ((H512, 4, True, 4, 64), (H512, 128, False, 8, 2),
                                     (H128, 4, True, 4, 64)):
            _run_ours(_scenario(head, cr, ov, sb, kb, seed=cr), variant)
    assert {k.fn.__name__ for k, _ in seen} == {"_compress_sparse_attn_kernel",
                                                "_compress_indexer_kernel"}
    assert not _uncovered(seen, warm), "\n".join(_uncovered(seen, warm))
    # V4.1 lists no writer keys (its writers compiled during load in the same run).
    v41 = next(s for s in _models(variant) if s.model == "v41")
    assert not wu._writer_keys(v41, variant, 108)


# ----------------------------------------------------------------------------- pack_seq
@pytest.mark.parametrize("variant", ("sm80",))
def test_indexer_pack_seq_launches_are_warmed(variant, gpu_like):
    """Patch 0017's pack of the indexer's e4m3 decode Q ([tokens, 64 heads, 128] bytes) and
    unpack of its int32 top-k rows ([B, Lmax, top-k]) at the non-uniform decode batches of
    speculative decoding (1 + k rows per request, some requests shorter), inputs sliced at
    odd rows as per-step buffers are."""
    from vllm.deepinfer.kernels import pack_seq as ps
    for shapes in _models(variant):
        warm = _warm_keys(shapes, variant)
        with recording(CC[variant]) as seen:
            gpu_like(108)
            for lens in ([6], [6, 3], [1, 2, 6, 6], [4] * 17):
                lengths = torch.tensor(lens, **I32)
                n = sum(lens)
                q = torch.zeros(n + 3, shapes.index_heads, 128, dtype=torch.uint8)[3:]
                ps.pack_seq_bytes(q.view(torch.float8_e4m3fn), lengths, 0)
                for width in (shapes.topk, 2048):
                    packed = torch.zeros(len(lens), max(lens), width, **I32)
                    ps.unpack_seq(packed, lengths)
        assert {k.fn.__name__ for k, _ in seen} == {"_pack_kernel", "_unpack_kernel"}
        assert not _uncovered(seen, warm), "\n".join(_uncovered(seen, warm))
