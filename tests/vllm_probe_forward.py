"""The forward scenario of tests/vllm_import_probe.py: the Ampere classes' ``forward_mqa`` on
CPU tensors under the interpreter, decode and prefill, against plain-torch sparse attention
over the same records (``reference``): V4.1 layers of ratio 0 (SWA only) and 1; V4 layers of
ratio 1 (SWA only), 4 (C4A: indexer top-k) and 128 (C128A: top-k from the metadata).

Decode: metadata built by hand (the fields the decode reads); besides the reference, the
output must equal, byte for byte, our decode kernel called directly on ragged index lists
built here: the class's glue (upstream's top-k translation and dense -> ragged helpers,
patch 0003, scale, sink, the inverse RoPE applied once) hands the kernel what it should.
Prefill: upstream's real ``DeepseekSparseSWAMetadata`` (its chunk plan), our gather and
combiner, upstream's bf16 prefill kernel (DEEPINFER_SPARSE_MLA_PREFILL=0: the feature is on
by default on sm80), the standalone inverse RoPE; then the same with =1, where patch 0003
routes the prefill to our kernel.

Imported only inside the probe process (it imports vLLM); ``run`` sets the interpreter up.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

# Cache geometry of the probe's layers: V4.1's SWA pages (32), compressed pages of 64 tokens
# (a page boundary inside every compressed context here), top-k width 64 (the tiny
# configs' index_topk), the models' SWA window.
SWA_BS, COMP_BS, TOPK_W, WINDOW = 32, 64, 64, 128
MODELS = {"deepseek_v41": (0, 1), "deepseek_v4": (0, 1, 2)}


class Probe:
    """What every forward check shares: the built layers, their configs, one generator."""

    def __init__(self):
        import tempfile

        import torch
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.deepinfer.attention import selector
        from vllm.v1.worker.workspace import init_workspace_manager

        from vllm_probe_common import cpu_platform, dist_init, vllm_config
        cpu_platform()
        dist_init(tempfile.mkdtemp(prefix="deepinfer-probe-"),
                  VllmConfig(device_config=DeviceConfig(device="cpu")))
        torch.set_default_dtype(torch.bfloat16)
        init_workspace_manager(torch.device("cpu"))
        _let_upstream_prefill_run_on_cpu()
        self.g = torch.Generator().manual_seed(11)
        self.built, self.vcfgs = {}, {}
        for model, ids in MODELS.items():
            cls, self.vcfgs[model] = selector.ampere_class(model), vllm_config(model)
            with set_current_vllm_config(self.vcfgs[model]):
                buf = torch.full((64, TOPK_W), -1, dtype=torch.int32)
                for i in ids:
                    self.built[model, i] = cls(self.vcfgs[model], prefix=f"model.layers.{i}.attn",
                                               topk_indices_buffer=buf, aux_stream_list=None)


def _let_upstream_prefill_run_on_cpu() -> None:
    """Upstream's prefill launcher refuses CPU tensors (it guards real launches); the
    interpreter runs them. Its inputs go in as a Tensor subclass that says "not CPU"."""
    import torch
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ras
    launch = ras._rocm_sparse_attn_prefill_ragged_triton

    class NotCpu(torch.Tensor):
        @property
        def is_cpu(self):
            return False

    def launch_not_cpu(q, kv, indices, indptr, *a, **k):
        return launch(*[t.as_subclass(NotCpu) for t in (q, kv, indices, indptr)], *a, **k)
    ras._rocm_sparse_attn_prefill_ragged_triton = launch_not_cpu


def records(num_blocks: int, bs: int, g):
    """A cache of valid 584-byte records (kv_record's page layout) from random rows."""
    import torch
    from vllm.deepinfer import kv_record
    cache = kv_record.new_cache(num_blocks, bs)
    kv_record.insert_rows(cache, torch.arange(num_blocks * bs),
                          torch.randn(num_blocks * bs, kv_record.HEAD_DIM, generator=g))
    return cache


def reference(layer, q_t, keys, p):
    """Plain-torch sparse MLA of one token: softmax over the keys with the sink in the
    denominator, values = keys, then the inverse GPT-J RoPE of dims 448.. at ``p``."""
    import torch
    from vllm.deepinfer.kv_record import NOPE_DIM, ROPE_DIM
    sink = layer.attn_sink.float()[: layer.n_local_heads]
    sc = (q_t.float() @ keys.T) * layer.scale
    m = torch.maximum(sc.max(1).values, sink)
    w = torch.exp(sc - m[:, None])
    o = (w @ keys) / (w.sum(1) + torch.exp(sink - m))[:, None]
    cs = layer.rotary_emb.cos_sin_cache.float()
    c, s_ = cs[p, :ROPE_DIM // 2], cs[p, ROPE_DIM // 2:]
    a, b = o[:, NOPE_DIM::2].clone(), o[:, NOPE_DIM + 1::2].clone()
    o[:, NOPE_DIM::2], o[:, NOPE_DIM + 1::2] = a * c + b * s_, b * c - a * s_
    return o


def slot(table_row, c: int, bs: int) -> int:
    return int(table_row[c // bs]) * bs + c % bs


class Step:
    """One layer's caches, top-k and metadata for ``positions`` (one request per decode
    token, or one prefill request); ``keys[t]`` = the fp32 keys token t attends to,
    compressed first, as the reference reads them."""

    def __init__(self, probe: Probe, model: str, i: int, positions, decode: bool):
        import torch
        from vllm.deepinfer import kv_record
        g, i32 = probe.g, dict(dtype=torch.int32)
        layer = self.layer = probe.built[model, i]
        self.probe, self.model, self.positions, n = probe, model, positions, len(positions)
        torch.nn.init.normal_(layer.attn_sink, std=1.0, generator=g)
        r = layer.compress_ratio
        swa_only = r == 0 if model == "deepseek_v41" else r <= 1
        max_pos = int(positions.max())
        reqs = n if decode else 1
        nb_swa = -(-(max_pos + 1) // SWA_BS)
        self.swa = records(reqs * nb_swa + 2, SWA_BS, g)
        layer.swa_cache_layer.kv_cache = self.swa
        self.swa_bt = torch.randperm(reqs * nb_swa + 2, generator=g)[: reqs * nb_swa]
        self.swa_bt = self.swa_bt.view(reqs, nb_swa).to(torch.int32)
        self.keys = []
        for t, p in enumerate(positions.tolist()):
            row = self.swa_bt[t if decode else 0]
            sl = [slot(row, x, SWA_BS) for x in range(max(0, p - WINDOW + 1), p + 1)]
            self.keys.append(kv_record.read_rows(self.swa, torch.tensor(sl)))
        self.comp = self.comp_md = None
        self.extra_lists = None
        if swa_only:
            return
        nb_c = -(-((max_pos + 1) // r + 1) // COMP_BS)
        self.comp = records(reqs * nb_c + 1, COMP_BS, g)
        layer.kv_cache = self.comp
        comp_bt = torch.randperm(reqs * nb_c + 1, generator=g)[: reqs * nb_c]
        comp_bt = comp_bt.view(reqs, nb_c).to(torch.int32)
        self.comp_md = SimpleNamespace(block_table=comp_bt, block_size=COMP_BS * r)
        local = torch.full((n, TOPK_W), -1, **i32)
        self.extra_lists = []
        for t, p in enumerate(positions.tolist()):
            avail = (p + 1) // r
            k = min(avail, TOPK_W)
            # C128A selects every compressed position (upstream's metadata); the indexer
            # layers a random subset.
            chosen = (torch.arange(k) if r == 128 else
                      torch.randperm(avail, generator=g)[:k]).to(torch.int32)
            local[t, :k] = chosen
            row = comp_bt[t if decode else 0]
            sl = [slot(row, c, COMP_BS) for c in chosen.tolist()]
            self.extra_lists.append(sl)
            self.keys[t] = torch.cat([kv_record.read_rows(self.comp, torch.tensor(
                sl, dtype=torch.int64)), self.keys[t]])
        if r == 128:
            if decode:
                glob = torch.full((n, TOPK_W), -1, **i32)
                for t, sl in enumerate(self.extra_lists):
                    glob[t, : len(sl)] = torch.tensor(sl, **i32)
                self.comp_md.c128a_global_decode_topk_indices = glob.view(n, 1, -1)
                self.comp_md.c128a_decode_topk_lens = torch.tensor(
                    [len(x) for x in self.extra_lists], **i32)
            else:
                self.comp_md.c128a_prefill_topk_indices = local
        else:
            layer.topk_indices_buffer[:n] = local

    def metadata(self, swa_md) -> dict:
        layer = self.layer
        attn = {layer.swa_cache_layer.prefix: swa_md}
        if self.comp_md is not None:
            key = layer.compressed_cache_prefix if self.model == "deepseek_v41" else layer.prefix
            attn[key] = self.comp_md
        return attn

    def run(self, attn, q, *, bf16_like_gpu: bool):
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import ForwardContext, override_forward_context

        import interp_bf16
        out = torch.full_like(q, 7.0)
        ctx = ForwardContext(no_compile_layers={}, attn_metadata=attn, slot_mapping={})
        saved = []

        def set_saving(obj, name, value):
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)
        if bf16_like_gpu:  # upstream's bf16 prefill kernel
            interp_bf16.patch(set_saving)
        try:
            with (set_current_vllm_config(self.probe.vcfgs[self.model]),
                  override_forward_context(ctx)):
                self.layer.forward_mqa(q, None, self.positions, out)
        finally:
            for obj, name, value in reversed(saved):
                setattr(obj, name, value)
        return out

    def errors(self, q, out) -> dict:
        worst, ref_max = 0.0, 0.0
        for t, p in enumerate(self.positions.tolist()):
            o = reference(self.layer, q[t], self.keys[t], p)
            worst = max(worst, float((out[t].float() - o).abs().max()))
            ref_max = max(ref_max, float(o.abs().max()))
        return {"ratio": self.layer.compress_ratio, "max_abs_err": worst,
                "ref_max": ref_max, "finite": bool(out.float().isfinite().all())}


def decode(probe: Probe, model: str, i: int) -> dict:
    """Three decode tokens at positions 150, 40, 300 (one request each)."""
    import torch
    from vllm.deepinfer import routing
    from vllm.deepinfer.kv_record import NOPE_DIM, ROPE_DIM
    i32 = dict(dtype=torch.int32)
    positions = torch.tensor([150, 40, 300], dtype=torch.int64)
    n = len(positions)
    st = Step(probe, model, i, positions, decode=True)
    layer = st.layer
    lens = torch.clamp(positions + 1, max=WINDOW).to(torch.int32)
    swa_idx = torch.full((n, WINDOW), -1, **i32)
    for t, p in enumerate(positions.tolist()):
        sl = [slot(st.swa_bt[t], x, SWA_BS) for x in range(max(0, p - WINDOW + 1), p + 1)]
        swa_idx[t, : len(sl)] = torch.tensor(sl, **i32)
    md = SimpleNamespace(num_decode_tokens=n, num_decodes=n, num_prefills=0,
                         decode_swa_indices=swa_idx, decode_swa_lens=lens,
                         token_to_req_indices=torch.arange(n, **i32),
                         is_valid_token=torch.ones(n, dtype=torch.bool))
    q = torch.randn(n, layer.padded_heads, 512, generator=probe.g).to(torch.bfloat16)
    out = st.run(st.metadata(md), q, bf16_like_gpu=False)
    extra = {}
    if st.extra_lists is not None:
        flat = [x for sl in st.extra_lists for x in sl]
        ptr = [0]
        for sl in st.extra_lists:
            ptr.append(ptr[-1] + len(sl))
        extra = dict(extra_cache=st.comp, extra_indices=torch.tensor(flat, **i32),
                     extra_indptr=torch.tensor(ptr, **i32))
    main = torch.cat([swa_idx[t, : lens[t]] for t in range(n)])
    indptr = torch.tensor([0] + list(lens.long().cumsum(0)), **i32)
    want = routing.sparse_attn_decode(
        q, st.swa, main, indptr, layer.scale, layer.attn_sink, NOPE_DIM, ROPE_DIM, **extra,
        inv_rope_positions=positions, inv_rope_cos_sin_cache=layer.rotary_emb.cos_sin_cache)
    res = st.errors(q, out)
    res["bytes_equal"] = torch.equal(out.view(torch.int16), want.view(torch.int16))
    return res


def prefill(probe: Probe, model: str, i: int) -> dict:
    """One request: 20 new tokens after 300 cached."""
    import torch
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata
    i32 = dict(dtype=torch.int32)
    ctx_len, q_len = 300, 20
    seq = ctx_len + q_len
    positions = torch.arange(ctx_len, seq, dtype=torch.int64)
    st = Step(probe, model, i, positions, decode=False)
    layer = st.layer
    md = DeepseekSparseSWAMetadata(
        block_table=st.swa_bt, slot_mapping=torch.zeros(q_len, dtype=torch.int64),
        block_size=SWA_BS, seq_lens=torch.tensor([seq], **i32),
        query_start_loc=torch.tensor([0, q_len], **i32),
        query_start_loc_cpu=torch.tensor([0, q_len], **i32),
        is_valid_token=torch.ones(q_len, dtype=torch.bool),
        token_to_req_indices=torch.zeros(q_len, **i32),
        num_prefills=1, num_prefill_tokens=q_len,
        prefill_seq_lens=torch.tensor([seq], **i32),
        prefill_seq_lens_cpu=torch.tensor([seq], **i32),
        prefill_gather_lens=torch.tensor([q_len + min(ctx_len, WINDOW - 1)], **i32),
        prefill_query_lens_cpu=torch.tensor([q_len], **i32),
        prefill_window_size=WINDOW, prefill_max_model_len=layer.max_model_len,
        prefill_max_num_batched_tokens=layer.max_num_batched_tokens)
    q = torch.randn(q_len, layer.padded_heads, 512, generator=probe.g).to(torch.bfloat16)
    out = st.run(st.metadata(md), q, bf16_like_gpu=True)
    return st.errors(q, out)


def _prefill_switched(probe: Probe, model: str, i: int, switch: str) -> dict:
    """``prefill`` with DEEPINFER_SPARSE_MLA_PREFILL=``switch``, counting the calls of our
    kernel and of upstream's ragged launcher (both of upstream's prefill paths reach it)."""
    from vllm.deepinfer import routing
    from vllm.deepinfer.kernels import sparse_mla_prefill as spm
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ras
    calls = {"ours": 0, "upstream": 0}
    ours, theirs = spm.sparse_attn_prefill, ras._rocm_sparse_attn_prefill_ragged_triton

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped
    os.environ["DEEPINFER_SPARSE_MLA_PREFILL"] = switch
    routing.reset()
    spm.sparse_attn_prefill = count("ours", ours)
    ras._rocm_sparse_attn_prefill_ragged_triton = count("upstream", theirs)
    try:
        res = prefill(probe, model, i)
    finally:
        spm.sparse_attn_prefill, ras._rocm_sparse_attn_prefill_ragged_triton = ours, theirs
        del os.environ["DEEPINFER_SPARSE_MLA_PREFILL"]
        routing.reset()
    return {**res, "calls": calls}


def prefill_upstream(probe: Probe, model: str, i: int) -> dict:
    """``prefill`` with DEEPINFER_SPARSE_MLA_PREFILL=0 (the feature is on by default on
    sm80): upstream's bf16 prefill kernel runs, ours never."""
    return _prefill_switched(probe, model, i, "0")


def prefill_ours(probe: Probe, model: str, i: int) -> dict:
    """``prefill`` with DEEPINFER_SPARSE_MLA_PREFILL=1: patch 0003 hands upstream's
    rocm_sparse_attn_prefill call to our kernel (counted), upstream's ragged launcher never
    runs."""
    return _prefill_switched(probe, model, i, "1")


def run(record) -> None:
    """The scenario: every layer of both models, decode then prefill (upstream's prefill
    kernel, then ours through patch 0003)."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["DEEPINFER_ARCH"] = "sm80"
    probe = Probe()
    for model, ids in MODELS.items():
        for i in ids:
            record(f"forward/{model}/decode_layer{i}", decode, probe, model, i)
            record(f"forward/{model}/prefill_layer{i}", prefill_upstream, probe, model, i)
            record(f"forward/{model}/prefill_ours_layer{i}", prefill_ours, probe, model, i)
