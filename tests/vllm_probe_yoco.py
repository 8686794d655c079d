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
the combiner) per run, and the StepCache's builds and hits.

Imported only inside the probe process (it imports vLLM).
"""
from __future__ import annotations

import collections
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
        swa_idx = torch.full((nd, WINDOW), -1, **i32)
        for t, p in enumerate(DECODE_POS):
            sl = [fwd.slot(self.swa_bt[t], x, SWA_BS) for x in range(max(0, p - WINDOW + 1), p + 1)]
            swa_idx[t, : len(sl)] = torch.tensor(sl, **i32)
        qsl = [0, 1, 2, 2 + PREFILL_Q]
        gather_len = PREFILL_Q + min(PREFILL_CTX, WINDOW - 1)
        self.swa_md = DeepseekSparseSWAMetadata(
            block_table=self.swa_bt, slot_mapping=torch.zeros(n, dtype=torch.int64),
            block_size=SWA_BS, seq_lens=torch.tensor(seq, **i32),
            query_start_loc=torch.tensor(qsl, **i32), query_start_loc_cpu=torch.tensor(qsl, **i32),
            is_valid_token=torch.ones(n, dtype=torch.bool),
            token_to_req_indices=torch.tensor([0, 1] + [2] * PREFILL_Q, **i32),
            decode_swa_indices=swa_idx,
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

    def attn_metadata(self) -> dict:
        md = {}
        for layer in self.layers:
            md[layer.swa_cache_layer.prefix] = self.swa_md  # one SWA group: one object
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
    from vllm.models.deepseek_v41.common import ops

    def counting(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper
    for name in ("compute_global_topk_indices_and_lens", "dequantize_and_gather_k_cache",
                 "combine_topk_swa_indices"):
        set_saving(ops, name, counting(name, getattr(ops, name)))


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

    record("yoco/on", one, "on")
    os.environ["DEEPINFER_YOCO_REUSE"] = "0"
    try:
        record("yoco/off", one, "off")
    finally:
        os.environ.pop("DEEPINFER_YOCO_REUSE")
        routing.reset()

    def equal():
        import torch
        on, off = state["on"], state["off"]
        return [bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
                for a, b in zip(on, off)]
    record("yoco/outputs_equal", equal)
