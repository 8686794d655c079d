"""The yoco scenario of tests/vllm_import_probe.py: cross-layer metadata reuse
(vllm.deepinfer.yoco) through the real V4.1 Ampere class on CPU (interpreter, sm80).

A miniature of upstream's V4.1 layout: six layers, compress ratios [0, 2, 2, 1, 1, 1], KV
sources 1 and 3, index sources 1, 3 and 4 (layer 4 reads layer 3's cache with its own top-k,
as upstream's 24..36 read layer 20's). One forward over all six layers on a mixed batch
(two decode requests and one prefill request of a few tokens after cached context), run twice
with the same caches and inputs: reuse on (default) and DEEPINFER_YOCO_REUSE=0. The index
sources' top-k is written into the shared ``topk_indices_buffer`` just before their layer, as
their indexer does. Recorded: every layer's output bytes of both runs, the calls of the three
metadata builders (upstream's ``compute_global_topk_indices_and_lens``, the compressed gather,
the combiner) per run, and the StepCache's builds and hits; and the decode's dense -> ragged index conversions. The
same again with two SWA cache groups, the layers alternating between them as vLLM
interleaves them, each group with its own block table and buffers.

Imported only inside the probe process (it imports vLLM).
"""
from __future__ import annotations

import collections
import dataclasses
import os
from types import SimpleNamespace

RATIOS = [0, 2, 2, 1, 1, 1]
KV_SOURCES = [1, 3]
INDEX_SOURCES = [1, 3, 4]
SWA_BS, COMP_BS, TOPK_W, WINDOW = 32, 64, 64, 128
DECODE_POS = (150, 90)          # one decode token per request
PREFILL_CTX, PREFILL_Q = 60, 5  # one prefill request: 5 new tokens after 60 cached


def _hf_config():
    from vllm_probe_common import hf_config
    cfg = hf_config("deepseek_v41")
    cfg.num_hidden_layers = len(RATIOS)
    cfg.compress_ratios = RATIOS
    cfg.kv_source_layer_ids = KV_SOURCES
    cfg.index_source_layer_ids = INDEX_SOURCES
    return cfg


class Model:
    """Six layers of the V4.1 Ampere class, their caches and one mixed batch's metadata."""

    def __init__(self):
        import tempfile

        import torch
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.deepinfer.attention import selector
        from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata
        from vllm.v1.worker.workspace import init_workspace_manager

        import vllm_probe_forward as fwd
        from vllm_probe_common import cpu_platform, dist_init, vllm_config
        cpu_platform()
        dist_init(tempfile.mkdtemp(prefix="deepinfer-probe-"),
                  VllmConfig(device_config=DeviceConfig(device="cpu")))
        torch.set_default_dtype(torch.bfloat16)
        init_workspace_manager(torch.device("cpu"))
        fwd._let_upstream_prefill_run_on_cpu()
        g = self.g = torch.Generator().manual_seed(5)
        i32 = dict(dtype=torch.int32)
        self.vcfg = vllm_config("deepseek_v41")
        self.vcfg.model_config.hf_config = _hf_config()
        cls = selector.ampere_class("deepseek_v41")
        nd, npre = len(DECODE_POS), PREFILL_Q
        n = nd + npre
        self.topk = torch.full((64, TOPK_W), -1, **i32)
        with set_current_vllm_config(self.vcfg):
            self.layers = [cls(self.vcfg, prefix=f"model.layers.{i}.attn",
                               topk_indices_buffer=self.topk, aux_stream_list=None)
                           for i in range(len(RATIOS))]
        seq = [p + 1 for p in DECODE_POS] + [PREFILL_CTX + PREFILL_Q]
        self.positions = torch.tensor(list(DECODE_POS) + list(range(PREFILL_CTX, seq[-1])))
        nb_swa = -(-max(seq) // SWA_BS)
        swa_bt = torch.randperm(3 * nb_swa + 2, generator=g)[: 3 * nb_swa].view(3, nb_swa)
        self.swa_bt = swa_bt.to(torch.int32)
        for layer in self.layers:
            torch.nn.init.normal_(layer.attn_sink, std=1.0, generator=g)
            layer.swa_cache_layer.kv_cache = fwd.records(3 * nb_swa + 2, SWA_BS, g)
        # One compressed cache and block table per KV source; consumers share both.
        self.comp_md = {}
        for src in KV_SOURCES:
            r = RATIOS[src]
            nb_c = -(-(max(seq) // r + 1) // COMP_BS)
            self.layers[src].kv_cache = fwd.records(3 * nb_c + 1, COMP_BS, g)
            bt = torch.randperm(3 * nb_c + 1, generator=g)[: 3 * nb_c].view(3, nb_c)
            self.comp_md[src] = SimpleNamespace(block_table=bt.to(torch.int32),
                                                block_size=COMP_BS * r)
        # Each index source's local top-k rows (decode tokens first, then prefill tokens).
        self.local = {}
        for src in INDEX_SOURCES:
            r = RATIOS[src]
            rows = torch.full((n, TOPK_W), -1, **i32)
            for t, p in enumerate(self.positions.tolist()):
                avail = (p + 1) // r
                k = min(avail, TOPK_W)
                rows[t, :k] = torch.randperm(avail, generator=g)[:k].to(torch.int32)
            self.local[src] = rows
        qsl = [0, 1, 2, 2 + PREFILL_Q]
        gather_len = PREFILL_Q + min(PREFILL_CTX, WINDOW - 1)
        self.swa_md = DeepseekSparseSWAMetadata(
            block_table=self.swa_bt, slot_mapping=torch.zeros(n, dtype=torch.int64),
            block_size=SWA_BS, seq_lens=torch.tensor(seq, **i32),
            query_start_loc=torch.tensor(qsl, **i32), query_start_loc_cpu=torch.tensor(qsl, **i32),
            is_valid_token=torch.ones(n, dtype=torch.bool),
            token_to_req_indices=torch.tensor([0, 1] + [2] * PREFILL_Q, **i32),
            decode_swa_indices=self._swa_indices(self.swa_bt),
            decode_swa_lens=torch.clamp(torch.tensor(DECODE_POS) + 1, max=WINDOW).to(torch.int32),
            num_decodes=nd, num_prefills=1, num_decode_tokens=nd, num_prefill_tokens=npre,
            prefill_seq_lens=torch.tensor(seq[nd:], **i32),
            prefill_seq_lens_cpu=torch.tensor(seq[nd:], **i32),
            prefill_gather_lens=torch.tensor([gather_len], **i32),
            prefill_query_lens_cpu=torch.tensor([PREFILL_Q], **i32),
            prefill_window_size=WINDOW, prefill_max_model_len=self.layers[0].max_model_len,
            prefill_max_num_batched_tokens=self.layers[0].max_num_batched_tokens)
        self.q = [torch.randn(n, layer.padded_heads, 512, generator=g).to(torch.bfloat16)
                  for layer in self.layers]
        # A second SWA cache group, as vLLM builds it (interleaved groups, one builder each):
        # its own block table, slots and buffers holding the same batch values; the batch's
        # common seq_lens and query_start_loc (one storage per step) and views of them.
        bt1 = torch.randperm(3 * nb_swa + 2, generator=g)[: 3 * nb_swa].view(3, nb_swa)
        bt1 = bt1.to(torch.int32)
        md0 = self.swa_md
        self.swa_md_group1 = dataclasses.replace(
            md0, block_table=bt1, slot_mapping=torch.ones(n, dtype=torch.int64),
            decode_swa_indices=self._swa_indices(bt1),
            decode_swa_lens=md0.decode_swa_lens.clone(),
            is_valid_token=md0.is_valid_token.clone(),
            token_to_req_indices=md0.token_to_req_indices.clone(),
            prefill_gather_lens=md0.prefill_gather_lens.clone())
        self.swa_groups = 1

    @staticmethod
    def _swa_indices(block_table):
        import torch

        import vllm_probe_forward as fwd
        swa_idx = torch.full((len(DECODE_POS), WINDOW), -1, dtype=torch.int32)
        for t, p in enumerate(DECODE_POS):
            sl = [fwd.slot(block_table[t], x, SWA_BS)
                  for x in range(max(0, p - WINDOW + 1), p + 1)]
            swa_idx[t, : len(sl)] = torch.tensor(sl, dtype=torch.int32)
        return swa_idx

    def attn_metadata(self) -> dict:
        md = {}
        groups = [self.swa_md, self.swa_md_group1][: self.swa_groups]
        for i, layer in enumerate(self.layers):
            # vLLM's SWA cache groups interleave the layers (layers[i::num_groups]).
            md[layer.swa_cache_layer.prefix] = groups[i % len(groups)]
            if layer.compressed_cache_prefix is not None:
                md[layer.compressed_cache_prefix] = self.comp_md[layer.kv_source_layer_id]
        return md

    def forward(self, calls: collections.Counter):
        """All six layers in one forward context; returns (outputs, the context)."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import ForwardContext, override_forward_context

        import interp_bf16
        ctx = ForwardContext(no_compile_layers={}, attn_metadata=self.attn_metadata(),
                             slot_mapping={})
        saved, outs = [], []

        def set_saving(obj, name, value):
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)
        interp_bf16.patch(set_saving)
        _count_builders(set_saving, calls)
        try:
            with set_current_vllm_config(self.vcfg), override_forward_context(ctx):
                for i, layer in enumerate(self.layers):
                    if i in INDEX_SOURCES:  # the index source's indexer publishes its top-k
                        self.topk[: self.local[i].shape[0]] = self.local[i]
                    out = torch.full_like(self.q[i], 7.0)
                    layer.forward_mqa(self.q[i], None, self.positions, out)
                    outs.append(out)
        finally:
            for obj, name, value in reversed(saved):
                setattr(obj, name, value)
        return outs, ctx


def _count_builders(set_saving, calls: collections.Counter) -> None:
    """Count the metadata builders' calls (each one kernel launch) where the Ampere class
    looks them up (it imports them from the module at every call)."""
    from vllm.deepinfer.attention import common
    from vllm.models.deepseek_v41.common import ops

    def counting(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper
    for name in ("compute_global_topk_indices_and_lens", "dequantize_and_gather_k_cache",
                 "combine_topk_swa_indices"):
        set_saving(ops, name, counting(name, getattr(ops, name)))
    # The decode's dense -> ragged conversions (count + cumsum + compact each).
    name = "build_ragged_indices_from_dense"
    set_saving(common, name, counting(name, getattr(common, name)))


# --------------------------------------------------------------------------- patch 0040
def flashmla_decode() -> dict:
    """Upstream's FlashMLA decode (patch 0040) over five compressed layers of the miniature
    layout, FlashMLA itself replaced by a recorder of what it is handed: reuse on and off
    hand it the same global indices and lens; on builds them 3 times instead of 5 and hands
    the layers of one group the very same tensor."""
    import torch
    from vllm.deepinfer import routing
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.models.deepseek_v41.nvidia import flashmla as fm
    g = torch.Generator().manual_seed(9)
    i32 = dict(dtype=torch.int32)
    n, r_max = 3, 300
    topk = torch.full((8, TOPK_W), -1, **i32)
    local = {src: torch.randint(0, r_max // RATIOS[src], (n, TOPK_W), generator=g).to(torch.int32)
             for src in INDEX_SOURCES}
    comp = {src: SimpleNamespace(block_table=torch.randperm(24, generator=g)[:3 * 8].view(3, 8)
                                 .to(torch.int32), block_size=COMP_BS * RATIOS[src])
            for src in KV_SOURCES}
    swa_md = SimpleNamespace(
        num_decodes=n, num_decode_tokens=n, is_valid_token=torch.tensor([True, False, True]),
        token_to_req_indices=torch.arange(n, **i32), decode_swa_indices=torch.zeros(n, 1, 8, **i32),
        decode_swa_lens=torch.ones(n, **i32), tile_sched_swaonly=object(),
        tile_sched_c1a=object(), tile_sched_c2a=object())

    def layer(i):
        kv = max(s for s in KV_SOURCES if s <= i)
        return SimpleNamespace(
            compress_ratio=RATIOS[i], topk_indices_buffer=topk, use_pcp=False,
            index_source_layer_id=max(s for s in INDEX_SOURCES if s <= i),
            kv_source_layer_id=kv, compressed_cache_prefix=f"model.layers.{kv}.attn",
            swa_cache_layer=SimpleNamespace(kv_cache=torch.zeros(2, SWA_BS, 584, dtype=torch.uint8)),
            scale=0.1, attn_sink=torch.zeros(8))

    def forward():
        seen, builds = [], []
        real_build, real_fmla = fm.compute_global_topk_indices_and_lens, fm.flash_mla_with_kvcache

        def build(*a, **k):
            builds.append(1)
            return real_build(*a, **k)

        def fmla(**kw):
            seen.append((kw["extra_indices_in_kvcache"], kw["extra_topk_length"]))
            return None, None
        fm.compute_global_topk_indices_and_lens, fm.flash_mla_with_kvcache = build, fmla
        ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        try:
            with override_forward_context(ctx):
                for i in range(1, len(RATIOS)):
                    if i in INDEX_SOURCES:
                        topk[:n] = local[i]
                    lay = layer(i)
                    fm.DeepseekV4FlashMLAAttention._forward_decode(
                        lay, torch.zeros(n, 8, 512), torch.zeros(4, COMP_BS, 584, dtype=torch.uint8),
                        swa_md, comp[lay.kv_source_layer_id], False, torch.zeros(n, 8, 512))
        finally:
            fm.compute_global_topk_indices_and_lens, fm.flash_mla_with_kvcache = real_build, real_fmla
        return seen, len(builds)

    routing.reset()
    on, builds_on = forward()
    os.environ["DEEPINFER_YOCO_REUSE"] = "0"
    routing.reset()
    try:
        off, builds_off = forward()
    finally:
        os.environ.pop("DEEPINFER_YOCO_REUSE")
        routing.reset()
    return {"builds_on": builds_on, "builds_off": builds_off,
            "same_values": all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                               for a, b in zip(on, off)) and len(on) == len(off) == 5,
            "shared_tensor": [on[i][0].data_ptr() == on[i - 1][0].data_ptr()
                              for i in range(1, len(on))],
            "masked_token_len": int(on[0][1][1])}


# --------------------------------------------------------------------------- patch 0041
def indexer_k() -> dict:
    """Upstream's ``sparse_attn_indexer`` (patch 0041) for three index sources sharing one
    index-K cache, a prefill of one request split into two query slices (the second
    skips the gather): the K gather (stand-in for the C++ op) runs once on, three times off,
    and the logits (a recorder in DeepGEMM's place) see the same K rows every time."""
    import torch
    from vllm.deepinfer import routing
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerMetadata, DeepseekV32IndexerPrefillChunkMetadata,
        DeepseekV32IndexerPrefillMetadata)
    g = torch.Generator().manual_seed(4)
    i32 = dict(dtype=torch.int32)
    ctx_len, q_len, heads = 40, 6, 4
    cache = torch.randint(0, 255, (4, 16, 132), dtype=torch.uint8, generator=g)

    def chunk(t0, t1, skip):
        return DeepseekV32IndexerPrefillChunkMetadata(
            block_table=torch.tensor([[2, 0, 3]], **i32), cu_seqlen_ks=torch.zeros(t1 - t0, **i32),
            cu_seqlen_ke=torch.full((t1 - t0,), ctx_len, **i32),
            cu_seq_lens=torch.tensor([0, ctx_len], **i32), token_to_seq=torch.zeros(t1 - t0, **i32),
            total_seq_lens=ctx_len, max_seqlen_k=ctx_len, token_start=t0, token_end=t1, num_reqs=1,
            skip_kv_gather=skip, local_cu_seq_lens=torch.tensor([0, ctx_len], **i32),
            local_total_seq_lens=ctx_len, max_local_total_seq_lens=ctx_len)
    md = DeepseekV32IndexerMetadata(
        seq_lens=torch.tensor([ctx_len], **i32), max_seq_len=ctx_len,
        slot_mapping=torch.zeros(q_len, dtype=torch.int64), num_decodes=0, num_decode_tokens=0,
        num_prefills=1, num_prefill_tokens=q_len,
        prefill=DeepseekV32IndexerPrefillMetadata(chunks=[chunk(0, 3, False), chunk(3, q_len, True)]))
    prefix = "model.layers.3.attn.indexer.k_cache"

    def forward():
        gathers, ks = [], []

        def gather(kv_cache, k_quant, k_scale, block_table, cu_seq_lens):
            gathers.append(1)
            rows = kv_cache[block_table[0].long()].reshape(-1, 132)[: k_quant.shape[0]]
            k_quant.view(torch.uint8).copy_(rows[:, :128])
            k_scale.copy_(rows[:, 128:])

        def logits(q, kv, weights, cu_ks, cu_ke, max_seqlen_k):
            ks.append((kv[0].view(torch.uint8).clone(), kv[1].view(torch.uint8).view(-1, 4).clone()))
            return torch.zeros(q[0].shape[0], max_seqlen_k, dtype=torch.float32)
        saved = [(sai.ops, "cp_gather_indexer_k_quant_cache"), (sai, "fp8_fp4_mqa_logits"),
                 (sai.ops, "top_k_per_row_prefill")]
        old = [getattr(o, a) for o, a in saved]
        sai.ops.cp_gather_indexer_k_quant_cache, sai.fp8_fp4_mqa_logits = gather, logits
        sai.ops.top_k_per_row_prefill = lambda *a, **k: None
        ctx = ForwardContext(no_compile_layers={}, attn_metadata={prefix: md}, slot_mapping={})
        try:
            with override_forward_context(ctx):
                for _ in INDEX_SOURCES:  # three index sources, one index-K cache
                    sai.sparse_attn_indexer(
                        torch.zeros(q_len, 8), prefix, cache,
                        torch.zeros(q_len, heads, 128).to(torch.float8_e4m3fn), None, None,
                        torch.ones(q_len, heads), 128, "ue8m0", 16, 128, 4096, 4096,
                        torch.full((q_len, 16), -1, **i32), True, False, False, "")
        finally:
            for (o, a), v in zip(saved, old):
                setattr(o, a, v)
        return len(gathers), ks

    routing.reset()
    n_on, ks_on = forward()
    os.environ["DEEPINFER_YOCO_REUSE"] = "0"
    routing.reset()
    try:
        n_off, ks_off = forward()
    finally:
        os.environ.pop("DEEPINFER_YOCO_REUSE")
        routing.reset()
    want = cache[torch.tensor([2, 0, 3])].reshape(-1, 132)[:ctx_len]
    return {"gathers_on": n_on, "gathers_off": n_off, "logits_calls": [len(ks_on), len(ks_off)],
            "rows_equal": all(torch.equal(v, want[:, :128]) and torch.equal(s, want[:, 128:])
                              for v, s in ks_on + ks_off)}


def run(record) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["DEEPINFER_ARCH"] = "sm80"
    from vllm.deepinfer import routing
    routing.reset()
    model = Model()
    state = {}

    def one(label: str):
        from vllm.deepinfer import yoco
        routing.reset()
        calls: collections.Counter = collections.Counter()
        outs, ctx = model.forward(calls)
        cache = getattr(ctx, "_deepinfer_yoco", None)
        state[label] = outs
        return {"enabled": yoco.enabled(), "calls": dict(calls),
                "builds": dict(cache.builds) if cache else None,
                "hits": dict(cache.hits) if cache else None,
                "finite": all(bool(o.float().isfinite().all()) for o in outs)}

    def on_and_off(prefix: str, on_label: str):
        """Record ``<prefix>on`` (reuse on, outputs kept as ``on_label``) and ``<prefix>off``
        (DEEPINFER_YOCO_REUSE=0, kept as "off")."""
        record(f"{prefix}on", one, on_label)
        os.environ["DEEPINFER_YOCO_REUSE"] = "0"
        try:
            record(f"{prefix}off", one, "off")
        finally:
            os.environ.pop("DEEPINFER_YOCO_REUSE")
            routing.reset()

    on_and_off("yoco/", "on")

    def equal(label="on"):
        import torch
        on, off = state[label], state["off"]
        return [bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
                for a, b in zip(on, off)]
    record("yoco/outputs_equal", equal)

    def verify():
        # DEEPINFER_YOCO_VERIFY=1: every hit built again through the class's own calls and
        # compared (vllm.deepinfer.yoco); the totals say how many compared equal.
        from vllm.deepinfer import yoco
        os.environ[yoco.VERIFY_VARIABLE] = "1"
        try:
            yoco.reset_totals()
            got = one("verify")
            got["totals"] = yoco.totals()
            got["outputs_equal_off"] = equal("verify")
            return got
        finally:
            os.environ.pop(yoco.VERIFY_VARIABLE)
    record("yoco/verify", verify)

    # Two SWA cache groups (layers alternate): the same shares across groups, except the
    # SWA window's lists, which read each group's block table.
    model.swa_groups = 2
    on_and_off("yoco/groups2_", "groups2_on")
    record("yoco/groups2_outputs_equal", equal, "groups2_on")
    record("yoco/groups2_verify", verify)
    model.swa_groups = 1
    record("yoco/flashmla_decode", flashmla_decode)
    record("yoco/indexer_k", indexer_k)
