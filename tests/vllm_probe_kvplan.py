"""vLLM 0.33.0's own KV-cache planning of a served DeepSeek config, on a CPU-only machine: the
probe tests/test_kv_planner_vllm.py checks tools/kvplan/packing.py against. Run in a
subprocess, one process for every (config, path):

    CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched python tests/vllm_probe_kvplan.py REQUEST

REQUEST is a JSON object: ``configs`` (config.json paths), ``paths`` (keys of ``PATHS``),
``max_model_lens``, ``kv_gib`` (the "Available KV cache memory" figures to size for),
``chunk`` (max_num_batched_tokens), ``max_num_seqs``. The last stdout line is one JSON object:
``results[config][path]`` with the resolved block size and layout, every layer's spec, the
cache groups, the bytes of one pool block and, per max_model_len and memory, the blocks,
blocks per request, concurrency and the "KV cache size" in tokens vLLM would log.

What runs is vLLM's code, in the order a served engine runs it:

* the attention layers of every decoder layer are built from the served config with the
  class the model's own selector picks (``_select_dsv4_attn_cls`` of models/deepseek_v41 or
  models/deepseek_v4 ``nvidia/model.py``: ours below SM90, upstream's FlashMLA class on SM90
  with ``DEEPINFER_DISABLE=all``). Only the projection widths (hidden size, heads, LoRA
  ranks, o-groups, indexer heads) are shrunk to keep the weights small: no
  ``get_kv_cache_spec`` reads them (models/deepseek_v41/attention.py:1206 and :1274,
  models/deepseek_v41/compressor.py:229, v1/attention/backends/mla/sparse_swa.py
  DeepseekV4SWACache.get_kv_cache_spec, models/deepseek_v4/attention.py:862 and :911,
  models/deepseek_v4/compressor.py:179 read head_dim, index_head_dim, the compress ratio,
  the window, the cache dtype and the block size only);
* ``Platform.update_block_size_for_backend`` (v1/executor/uniproc_executor.py calls it
  after load_model) resolves ``cache_config.block_size`` from the backends'
  ``get_supported_kernel_block_sizes``;
* the specs are collected as ``GPUModelRunner.get_kv_cache_spec`` does (every
  AttentionLayerBase, ``customize_attention_spec`` on attention specs);
* the layout (``resolve_kv_cache_layout`` over the backends' supported layouts), the
  groups (``get_global_kv_cache_groups``), the configs (``get_kv_cache_configs``) and the
  capacity (``get_kv_cache_capacity``, the figure ``update_kv_cache_capacity`` logs).

Paths (``PATHS``): ``ampere128`` is the Ampere V4.1 path with DEEPINFER_KV_PAGE64=0
(upstream's pages off SM90, as before 7f9e907), ``ampere64`` the path as the tree has it
(feature kv_page64 on: the compressed-KV and the index-K backends both ask for 64-token
pages), ``ampere64-idx128`` the same with the index-K backend forced back to upstream's 128
(the tree from 7f9e907 to 8213d15, a what-if now), ``upstream-sm90`` upstream's own classes
on SM90. Not collected by pytest (no ``test_`` prefix).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

from vllm_probe_common import cpu_platform, dist_init, fake_capability

# path -> (device capability vLLM sees, environment, page the Ampere V4.1 index-K backend is
# forced to: None keeps the tree's)
PATHS = {
    "ampere128": ((8, 0), {"DEEPINFER_KV_PAGE64": "0"}, None),
    "ampere64": ((8, 0), {}, None),
    "ampere64-idx128": ((8, 0), {}, 128),
    "upstream-sm90": ((9, 0), {"DEEPINFER_DISABLE": "all"}, None),
}
# Projection widths of the layers the probe builds (no KV spec reads them, module doc).
SMALL_DIMS = dict(hidden_size=256, num_attention_heads=8, q_lora_rank=128, o_lora_rank=128,
                  o_groups=2, index_n_heads=4)
# V4 layer types as the HF DeepseekV4Config names them (tests/vllm_probe_common.py hf_config;
# transformers_utils/deepseek_v4_utils.py reads them back as compress ratios).
V4_LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention",
                  128: "heavily_compressed_attention"}
GIB = 1 << 30


def set_capability(major: int, minor: int) -> None:
    """The capability on the platform instance and its class: ``is_device_capability_family``
    (which the V4.1 backends' kernel block sizes ask) is a classmethod reading
    ``cls.get_device_capability`` (platforms/interface.py)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    fake_capability(major, minor)
    cap = DeviceCapability(major, minor)
    type(current_platform).get_device_capability = classmethod(lambda cls, device_id=0: cap)


def load_text_config(path: str) -> dict:
    with open(path) as f:
        raw = json.load(f)
    tc = dict(raw.get("text_config") or raw)
    tc.update(SMALL_DIMS)
    tc.setdefault("rope_parameters", {"rope_type": "default",
                                      "rope_theta": tc.get("rope_theta", 10000)})
    if tc.get("model_type") == "deepseek_v4":
        tc["layer_types"] = [V4_LAYER_TYPES[r] for r in tc["compress_ratios"]]
        tc["compress_rates"] = {v: k for k, v in V4_LAYER_TYPES.items()}
    return tc


def engine_config(tc: dict, max_model_len: int, chunk: int, max_num_seqs: int):
    import torch
    from vllm.config import DeviceConfig, VllmConfig
    hf = SimpleNamespace(**tc)
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    cfg.model_config = SimpleNamespace(
        hf_config=hf, hf_text_config=hf, max_model_len=max_model_len,
        original_max_model_len=max_model_len, dtype=torch.bfloat16, is_hybrid=False,
        use_mla=True, supports_kv_cache_grouping=False)
    # --kv-cache-dtype auto, as benchmarks/e2e/run.py serves: the layers resolve it to the
    # packed fp8_ds_mla record and write it back (models/deepseek_v41/attention.py
    # _resolve_dsv4_kv_cache_dtype).
    cfg.cache_config.cache_dtype = "auto"
    cfg.scheduler_config.max_num_batched_tokens = chunk
    cfg.scheduler_config.max_num_seqs = max_num_seqs
    # What VllmConfig decides on CUDA (config/vllm.py): the hybrid KV cache manager stays on
    # (CudaPlatform.support_hybrid_kv_cache), async scheduling is on (the uniproc executor
    # supports it), so vLLM.max_in_flight_tokens = 2 x max_num_batched_tokens.
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    cfg.scheduler_config.async_scheduling = True
    # config/vllm.py: 5 up to 256K tokens of context, else 2.
    cfg.attention_config.sparse_mla_prefill_workspace_factor = (
        5 if max_model_len <= 256 * 1024 else 2)
    return cfg


def build_layers(cfg, tc: dict) -> str:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.nvidia import model as m4
    from vllm.models.deepseek_v41.nvidia import model as m41
    v4 = tc.get("model_type") == "deepseek_v4"
    with set_current_vllm_config(cfg):
        cls = (m4 if v4 else m41)._select_dsv4_attn_cls(cfg)
        topk = torch.full((8, tc["index_topk"]), -1, dtype=torch.int32)
        kw = {} if v4 else {"candidate_block_buffer": torch.full(
            (8, max(1, tc.get("candidate_topk_blocks", 0))), -1, dtype=torch.int32)}
        for i in range(tc["num_hidden_layers"]):
            cls(cfg, prefix=f"model.layers.{i}.attn", topk_indices_buffer=topk,
                aux_stream_list=None, **kw)
    return cls.__name__


def index_sources(cfg) -> dict:
    """Every layer with an indexer: its K cache's prefix, whether it owns it (V4's indexers
    always do), the cache's class, and whether it is the object the forward context holds
    under that prefix (a non-owning V4.1 index source shares its kv source's)."""
    ctx = cfg.compilation_config.static_forward_context
    out = {}
    for name, mod in ctx.items():
        idx = getattr(mod, "indexer", None)
        if idx is not None and hasattr(idx, "k_cache"):
            k = idx.k_cache
            out[name] = [k.prefix, bool(getattr(idx, "owns_k", True)), type(k).__name__,
                         ctx.get(k.prefix) is k]
    return out


def collect_specs(cfg, backends: dict | None = None) -> dict:
    """GPUModelRunner.get_kv_cache_spec (v1/worker/gpu_model_runner.py); ``backends`` gets
    each cache's (backend class, kernel block sizes)."""
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec
    specs = {}
    for name, mod in get_layers_from_vllm_config(cfg, AttentionLayerBase).items():
        spec = mod.get_kv_cache_spec(cfg)
        if spec:
            if isinstance(spec, AttentionSpec):
                spec = customize_attention_spec(mod.get_attn_backend(), spec)
            specs[name] = spec
            if backends is not None:
                b = mod.get_attn_backend()
                backends[name] = [b.__name__, [int(x) if isinstance(x, int) else str(x)
                                               for x in b.get_supported_kernel_block_sizes()]]
    return specs


def describe_spec(spec) -> dict:
    return {"type": type(spec).__name__, "block_size": spec.block_size,
            "page_size_bytes": spec.page_size_bytes,
            "tokens_per_state": int(getattr(spec, "tokens_per_state", 1)),
            "sliding_window": getattr(spec, "sliding_window", None),
            "block_stride_alignment": spec.get_block_stride_alignment()}


def plan(cfg, specs: dict, max_model_lens, kv_gib) -> dict:
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts,
                                                  resolve_kv_cache_layout)
    from vllm.v1.core.kv_cache_planning import (_pool_bytes_per_block,
                                                get_global_kv_cache_groups,
                                                get_kv_cache_configs)
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    register_all_kvcache_specs(cfg)
    layouts = [x.name for x in get_supported_kv_cache_layouts(get_current_attn_backends(cfg))]
    layout = resolve_kv_cache_layout(cfg, [layouts], list(specs.values()))
    groups = get_global_kv_cache_groups(cfg, [dict(specs)])
    out = {"layout": layout.name,
           "groups": [{"block_size": g.kv_cache_spec.block_size, "layers": list(g.layer_names),
                       "page_size_bytes": g.kv_cache_spec.page_size_bytes} for g in groups],
           "bytes_per_block": _pool_bytes_per_block(cfg, groups), "capacity": {}}
    for length in max_model_lens:
        cfg.model_config.max_model_len = cfg.model_config.original_max_model_len = length
        per = out["capacity"][str(length)] = {}
        for gib in kv_gib:
            kc = get_kv_cache_configs(cfg, [dict(specs)], [int(gib * GIB)], groups)[0]
            tokens, concurrency = get_kv_cache_capacity(cfg, kc)
            per[str(gib)] = {"num_blocks": kc.num_blocks, "tokens": tokens,
                             "concurrency": concurrency,
                             "blocks_per_request": round(kc.num_blocks / concurrency)}
    return out


def run_one(config: str, path: str, req: dict) -> dict:
    from vllm.deepinfer import routing
    from vllm.deepinfer.attention import ampere_v41
    from vllm.platforms import current_platform
    cap, env, idx_page = PATHS[path]
    for k in ("DEEPINFER_KV_PAGE64", "DEEPINFER_DISABLE"):
        os.environ.pop(k, None)
    os.environ.update(env)
    routing.reset()
    set_capability(*cap)
    backend = ampere_v41.DeepinferAmpereV41IndexerBackend
    saved = backend.__dict__["get_supported_kernel_block_sizes"]
    if idx_page is not None:
        backend.get_supported_kernel_block_sizes = staticmethod(
            lambda kv_cache_spec=None: [idx_page])
    try:
        tc = load_text_config(config)
        length = max(req["max_model_lens"])
        cfg = engine_config(tc, length, req["chunk"], req["max_num_seqs"])
        cls = build_layers(cfg, tc)
        current_platform.update_block_size_for_backend(cfg)
        backends: dict = {}
        specs = collect_specs(cfg, backends)
        res = {"class": cls, "block_size": cfg.cache_config.block_size,
               "cache_dtype": cfg.cache_config.cache_dtype,
               "specs": {k: describe_spec(v) for k, v in specs.items()},
               "backends": backends, "index_sources": index_sources(cfg)}
        res.update(plan(cfg, specs, req["max_model_lens"], req["kv_gib"]))
        return res
    finally:
        backend.get_supported_kernel_block_sizes = saved


def main() -> int:
    req = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    import torch
    from vllm.config import DeviceConfig, VllmConfig
    cpu_platform()
    dist_init(tempfile.mkdtemp(prefix="deepinfer-kvplan-"),
              VllmConfig(device_config=DeviceConfig(device="cpu")))
    torch.set_default_dtype(torch.bfloat16)
    results: dict = {}
    for config in req["configs"]:
        for path in req["paths"]:
            try:
                value = {"ok": True, "value": run_one(config, path, req)}
            except BaseException as e:  # noqa: BLE001 - the test reports what failed
                value = {"ok": False, "error": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc()[-3000:]}
            results.setdefault(config, {})[path] = value
    sys.stdout.write("\n" + json.dumps({"results": results,
                                        "seconds": round(time.perf_counter() - t0, 1)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
