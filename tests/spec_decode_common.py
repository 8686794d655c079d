"""What tests/spec_decode_layer_probe.py's cases share: the platform (on CPU
vllm_probe_common's faked SM80 one), the tiny or real V4.1/V4 configs with a speculative
config, the Ampere layers and upstream's metadata builders (``Model``), the caches of a
batch (``Caches``), ``CommonAttentionMetadata`` of a decode batch and the metadata the
builders make of it (``build_md``), and the plain-torch reference of a token's attention.
Imports vLLM only inside functions (the probe sets the interpreter up first)."""
from __future__ import annotations

import tempfile
from types import SimpleNamespace

V4_BLOCK = 256       # V4 compressed pages: 64 C4A / 2 C128A entries (upstream's 256-token block)
V41_BLOCK = 64       # V4.1 compressed / index-K pages (kv_page64)
BLOCK_TABLE_WIDTH = 256  # the index-K builder's block_table_width (pages per request)


def _setup(device: str):
    import torch
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.worker.workspace import init_workspace_manager

    from vllm_probe_common import cpu_platform, dist_init
    if device == "cpu":
        cpu_platform()
        # The indexer builder sizes DeepGEMM's schedule by the SM count (unused without it).
        from vllm.platforms import current_platform
        current_platform.num_compute_units = lambda device_id=0: 1
    dist_init(tempfile.mkdtemp(prefix="deepinfer-spec-probe-"),
              VllmConfig(device_config=DeviceConfig(device=device)))
    torch.set_default_dtype(torch.bfloat16)
    init_workspace_manager(torch.device(device))


def hf_config(model: str, real: bool):
    """The tiny configs of tests/vllm_probe_common.py (or the real attention sizes), V4.1
    with a candidate source, as the released model orders them: layer 1 (ratio 2, KV and
    index source), layer 2 (ratio 1, KV and index source, the candidate source: writes
    candidate blocks), layer 3 (ratio 1, reads layer 2's KV and index keys, its own
    indexer masked to layer 2's candidate blocks)."""
    from vllm_probe_common import hf_config as tiny
    cfg = tiny(model)
    cfg.num_nextn_predict_layers = 1  # V4's MTP block / the draft's stages follow the backbone
    if real:
        cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank = 4096, 64, 1024
        cfg.o_lora_rank, cfg.o_groups, cfg.index_topk, cfg.index_n_heads = 1024, 8, 512, 64
        cfg.max_position_embeddings = 65536
    if model == "deepseek_v41":
        cfg.num_hidden_layers, cfg.compress_ratios = 4, [0, 2, 1, 1]
        cfg.kv_source_layer_ids, cfg.index_source_layer_ids = [1, 2], [1, 2, 3]
        cfg.candidate_source_layer_id = 2
        # Candidates cover more than top-k + one block, as the released 16 x 64 >= 512 + 64
        # do: a masked row always keeps at least top-k keys (the top-k then never selects
        # a masked -inf key).
        cfg.candidate_topk_blocks, cfg.candidate_block_size = (6, 16) if not real else (16, 64)
    return cfg


def vllm_config(model: str, k: int, method: str | None, real: bool, device: str):
    """vllm_probe_common's config with a speculative config of ``k`` tokens: what the
    builders and layers read of it (SpeculativeConfig itself wants a model folder)."""
    from vllm.config import DeviceConfig, VllmConfig
    cfg = VllmConfig(device_config=DeviceConfig(device=device))
    max_len = 65536 if real else 4096
    cfg.model_config = SimpleNamespace(hf_config=hf_config(model, real), max_model_len=max_len,
                                       dtype="bfloat16")
    cfg.cache_config.cache_dtype = "fp8_ds_mla"
    cfg.cache_config.block_size = V41_BLOCK if model == "deepseek_v41" else V4_BLOCK
    cfg.attention_config.sparse_mla_prefill_workspace_factor = 5
    cfg.scheduler_config.max_num_batched_tokens = 2048
    cfg.scheduler_config.max_num_seqs = 64
    if method is not None:
        dspark = method == "dspark"
        cfg.speculative_config = SimpleNamespace(
            num_speculative_tokens=k, method=method, parallel_drafting=False,
            enable_adaptive_verification=False, use_dspark=lambda: dspark,
            use_eagle=lambda: True, draft_model_config=None)
    return cfg


class Model:
    """The Ampere layers of one model under one speculative config, and a builder per cache
    (SWA, compressed, index-K) of each layer."""

    def __init__(self, model: str, k: int, method: str | None, real: bool, device: str,
                 layer_ids, g):
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.deepinfer.attention import selector
        self.model, self.k, self.device, self.g = model, k, torch.device(device), g
        self.vcfg = vllm_config(model, k, method, real, device)
        cls = selector.ampere_class(model)
        topk = self.vcfg.model_config.hf_config.index_topk
        self.topk_buf = torch.full((2048, topk), -1, dtype=torch.int32, device=device)
        hf = self.vcfg.model_config.hf_config
        extra = {}
        if model == "deepseek_v41":
            self.cand_buf = torch.full((2048, hf.candidate_topk_blocks), -1,
                                       dtype=torch.int32, device=device)
            extra["candidate_block_buffer"] = self.cand_buf
        # Upstream's decode top-k in torch (its "torch" backend: the reference implementation,
        # row ends from the layout's seq_lens): the patched source tree has no compiled
        # vllm._C for the CUDA top-k kernels, on a GPU host too.
        self.vcfg.kernel_config.sparse_indexer_topk_backend = "torch"
        self.layers = {}
        with set_current_vllm_config(self.vcfg):
            for i in layer_ids:
                self.layers[i] = cls(self.vcfg, prefix=f"model.layers.{i}.attn",
                                     topk_indices_buffer=self.topk_buf, aux_stream_list=None,
                                     **extra)
                self.layers[i].to(device)
        self.builders = {}

    def builder(self, module, key: str):
        """Upstream's builder for ``module``'s cache (the layer's own backend class), one
        per ``key``."""
        prefix = module.prefix
        from vllm.config import set_current_vllm_config
        if key not in self.builders:
            spec = module.get_kv_cache_spec(self.vcfg)
            backend = module.get_attn_backend()
            cls = backend.get_builder_cls()
            kwargs = {}
            if getattr(cls, "requires_block_table_width", False):
                kwargs["block_table_width"] = BLOCK_TABLE_WIDTH
            with set_current_vllm_config(self.vcfg):
                self.builders[key] = (cls(spec, [prefix], self.vcfg, self.device, **kwargs),
                                      spec)
        return self.builders[key]


def common_md(reqs, block_table, page: int, device, causal=True, pad_tokens: int = 0):
    """CommonAttentionMetadata of a decode batch: ``reqs`` = [(seq_len, q_len)], the new
    tokens last in each request, slots through ``block_table`` [R, pages] of ``page``-token
    pages. A request (0, 0) is a CUDA graph's padding request; ``pad_tokens`` rows after the
    real tokens are the graph's padding tokens (slot -1, position 0), counted in
    num_actual_tokens as in a padded batch."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    i32 = dict(dtype=torch.int32)
    qsl = [0]
    for _, q in reqs:
        qsl.append(qsl[-1] + q)
    pos, slots = [], []
    for r, (s, q) in enumerate(reqs):
        for p in range(s - q, s):
            pos.append(p)
            slots.append(int(block_table[r, p // page]) * page + p % page)
    pos += [0] * pad_tokens
    slots += [-1] * pad_tokens
    seq = torch.tensor([s for s, _ in reqs], **i32)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, **i32, device=device),
        query_start_loc_cpu=torch.tensor(qsl, **i32),
        seq_lens=seq.to(device), num_reqs=len(reqs), num_actual_tokens=len(slots),
        max_query_len=max(q for _, q in reqs), max_seq_len=int(seq.max()),
        block_table_tensor=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        causal=causal, positions=torch.tensor(pos, dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=seq.clone())


def records(num_blocks: int, bs: int, g, device):
    from vllm.deepinfer import kv_record
    import torch
    cache = kv_record.new_cache(num_blocks, bs)
    kv_record.insert_rows(cache, torch.arange(num_blocks * bs),
                          torch.randn(num_blocks * bs, kv_record.HEAD_DIM, generator=g))
    return cache.to(device)


def tables(n_req: int, pages: int, g, spare: int = 1):
    """[n_req, pages] of distinct random page ids (a few pages spare)."""
    import torch
    perm = torch.randperm(n_req * pages + spare, generator=g)[: n_req * pages]
    return perm.view(n_req, pages).to(torch.int32), n_req * pages + spare


def run_layer(m: Model, layer, attn_md: dict, q, positions):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import ForwardContext, override_forward_context
    out = torch.full_like(q, 7.0)
    ctx = ForwardContext(no_compile_layers={}, attn_metadata=attn_md, slot_mapping={})
    with set_current_vllm_config(m.vcfg), override_forward_context(ctx):
        layer.forward_mqa(q, None, positions, out)
    return out


class Caches:
    """One model's caches for a batch: an SWA cache per layer (one block table: vLLM's SWA
    group), the compressed caches (a block table per cache group), random records."""

    def __init__(self, m: Model, n_req: int, max_seq: int):
        self.m, self.n_req = m, n_req
        g, dev = m.g, m.device
        # The SWA page each layer's cache module was built with (V4 64 tokens, V4.1 32).
        self.swa_bs = next(iter(m.layers.values())).swa_cache_layer.block_size
        pages = -(-max_seq // self.swa_bs)
        self.swa_bt, nb = tables(n_req, pages, g)
        self.swa = {}
        for i, layer in m.layers.items():
            self.swa[i] = records(nb, self.swa_bs, g, dev)
            layer.swa_cache_layer.kv_cache = self.swa[i]
        self.comp_bt, self.comp = {}, {}
        for i, layer in m.layers.items():
            r = layer.compress_ratio
            if layer._swa_only() or not self._owns_cache(layer):
                continue
            block = m.vcfg.cache_config.block_size
            entries = block // r
            bt, nb = tables(n_req, -(-(max_seq // r + 1) // entries), g)
            self.comp_bt[i], self.comp[i] = bt, records(nb, entries, g, dev)
            layer.kv_cache = self.comp[i]

    @staticmethod
    def _owns_cache(layer) -> bool:
        return getattr(layer, "is_kv_source", True)

    def source(self, layer) -> int:
        """The layer id whose compressed cache ``layer`` reads."""
        if self.m.model == "deepseek_v41":
            return int(layer.kv_source_layer_id)
        return int(layer.prefix.split(".")[2])


def _keys_swa(cache, bt_row, lo: int, hi: int):
    import torch
    from vllm.deepinfer import kv_record
    bs = cache.shape[1]
    sl = [int(bt_row[p // bs]) * bs + p % bs for p in range(lo, hi)]
    return kv_record.read_rows(cache, torch.tensor(sl, dtype=torch.int64, device=cache.device))


def _keys_comp(cache, bt_row, local, entries: int):
    import torch
    from vllm.deepinfer import kv_record
    sl = [int(bt_row[c // entries]) * entries + c % entries for c in local]
    return kv_record.read_rows(cache, torch.tensor(sl, dtype=torch.int64, device=cache.device))


def build_md(m: Model, c: Caches, reqs, req_rows, causal=True, tag="a", pad_tokens=0):
    """The forward's attention metadata dict: upstream's builders over ``reqs`` =
    [(seq_len, q_len)] whose pages are rows ``req_rows`` of the block tables. A builder's
    metadata are views of its persistent buffers (valid until its next build, as in vLLM),
    so batches compared side by side take builders of their own (``tag``)."""
    import torch
    attn, built = {}, {}
    swa_md = None
    for i, layer in m.layers.items():
        swa = layer.swa_cache_layer
        if swa_md is None:
            b, _ = m.builder(swa, f"{tag}/swa")
            cm = common_md(reqs, c.swa_bt[req_rows], c.swa_bs, m.device, causal,
                           pad_tokens)
            swa_md = b.build(0, cm)
            built["swa"] = (b, cm)
        attn[swa.prefix] = swa_md
    for i, layer in m.layers.items():
        if layer._swa_only():
            continue
        src = c.source(layer)
        owner = m.layers[src]
        key = owner.prefix
        if key not in attn:
            b, spec = m.builder(owner, f"{tag}/{key}")
            cm = common_md(reqs, c.comp_bt[src][req_rows], spec.block_size, m.device, causal,
                           pad_tokens)
            attn[key] = b.build(0, cm)
    return attn, built


def _topk_fill(m: Model, layer, positions, g):
    """Random causal top-k rows (compressed positions < (p + 1) // ratio) for the layers
    whose top-k the test writes itself (V4 C4A, V4.1 without the indexer)."""
    import torch
    r = layer.compress_ratio
    width = m.topk_buf.shape[1]
    rows = []
    for t, p in enumerate(positions):
        avail = (p + 1) // r
        kk = min(avail, width)
        chosen = torch.randperm(avail, generator=g)[:kk].to(torch.int32)
        m.topk_buf[t].fill_(-1)
        m.topk_buf[t, :kk] = chosen.to(m.device)
        rows.append(chosen.tolist())
    return rows


def reference_out(m: Model, c: Caches, layer_id: int, q, reqs, req_rows, topk_rows, causal):
    """Plain torch per token over the keys its metadata must select."""
    from vllm_probe_forward import reference
    layer = m.layers[layer_id]
    W = layer.window_size
    worst, ref_max, t = 0.0, 0.0, 0
    outs = []
    for (s, ql), row in zip(reqs, req_rows):
        for j in range(ql):
            p = s - ql + j
            lo, hi = (max(0, p - W + 1), p + 1) if causal else (max(0, s - ql - W), s)
            keys = _keys_swa(c.swa[layer_id], c.swa_bt[row], lo, hi)
            if not layer._swa_only():
                src = c.source(layer)
                r = layer.compress_ratio
                entries = m.vcfg.cache_config.block_size // r
                local = (list(range((p + 1) // r)) if m.model == "deepseek_v4" and r == 128
                         else topk_rows[t])
                import torch
                keys = torch.cat([_keys_comp(c.comp[src], c.comp_bt[src][row], local, entries),
                                  keys])
            outs.append(reference(layer, q[t], keys.float(), p))
            t += 1
    return outs


def compare(out, refs) -> dict:
    worst = max(float((out[t].float() - o.to(out.device)).abs().max()) for t, o in enumerate(refs))
    ref_max = max(float(o.abs().max()) for o in refs)
    return {"max_abs_err": worst, "ref_max": ref_max,
            "finite": bool(out.float().isfinite().all())}


def init_sink(layer, g) -> None:
    """Random attention sinks (drawn on the CPU generator, copied to the layer's device)."""
    import torch
    layer.attn_sink.data.copy_(torch.randn(layer.attn_sink.shape, generator=g,
                                           dtype=torch.float32))


def _q(m: Model, layer, n: int):
    import torch
    return torch.randn(n, layer.padded_heads, 512, generator=m.g).to(torch.bfloat16).to(m.device)


def _positions(reqs):
    return [p for s, q in reqs for p in range(s - q, s)]


