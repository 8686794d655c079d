"""Probes that import the PATCHED vLLM 0.33.0 source tree (build/patched) on a CPU-only
machine. Run by tests/test_vllm_import.py in a subprocess, one process per scenario:

    CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched python tests/vllm_import_probe.py SCENARIO

and print one JSON object (the last stdout line): every check the scenario ran, under its
key, with its value or its exception. Not collected by pytest (no ``test_`` prefix) and
importing nothing from vLLM at module level, so the test process itself never imports vLLM
(it imports this module for ``SCENARIOS``). ``CUDA_VISIBLE_DEVICES=""`` matters: with a
visible GPU driver missing, ``vllm.triton_utils`` would swap in a placeholder Triton.

Layout: each scenario is a top-level ``scenario_<name>`` function registered in
``SCENARIOS``; it sets up what its checks share (faked platform, configs, built layers) and
records each check, a top-level function called with that state. Shared setup lives in
tests/vllm_probe_common.py; the forward scenario (its step builder and torch reference) in
tests/vllm_probe_forward.py; the writers scenario's checks in tests/vllm_probe_writers.py.

Scenarios:
    selector   _select_dsv4_attn_cls of both models under faked capabilities, env switches
               and explicit backends
    construct  the Ampere classes of both models built for real (tiny configs) with
               FlashMLA, DeepGEMM and CuTeDSL absent, plus what their forward refuses
    writers    the patched upstream fp8 writers routed to ours on sm80 (interpreter), the
               has_cutedsl capability gate, our JIT warmup registration, the DeepGEMM
               logits and pack_seq routes
    forward    the Ampere classes' decode and prefill forward_mqa on CPU tensors
               (interpreter, sm80) against plain torch (tests/vllm_probe_forward.py)
    yoco       cross-layer metadata reuse through six V4.1 Ampere layers in upstream's
               layout in miniature, reuse on and off (tests/vllm_probe_yoco.py)
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from types import SimpleNamespace
from typing import Callable

from vllm_probe_common import (cpu_platform, dist_init, fake_capability, set_env,
                               vllm_config)

RESULTS: dict = {}
SCENARIOS: dict[str, Callable[[], None]] = {}


def scenario(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``scenario_<name>`` under ``<name>``."""
    SCENARIOS[fn.__name__.removeprefix("scenario_")] = fn
    return fn


def record(key: str, fn, *args):
    """Run ``fn(*args)``; store its value, or the exception type and message."""
    try:
        RESULTS[key] = {"ok": True, "value": fn(*args)}
    except BaseException as e:  # noqa: BLE001 - the probe reports everything
        RESULTS[key] = {"ok": False, "error": type(e).__name__, "message": str(e),
                        "trace": traceback.format_exc()[-3000:]}


# --------------------------------------------------------------------------- selector
SELECTOR_CAPS = [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (12, 0)]
SELECTOR_BACKENDS = ("FLASHMLA_SPARSE_DSV4", "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_DSV4",
                     "FLASHMLA_SPARSE_DSV41", "FLASHINFER_MLA_SPARSE_DSV41",
                     "FLASHMLA_MEGA_ATTN_DSV41", "TRITON_MLA",
                     "DEEPINFER_AMPERE_SPARSE_DSV41", "DEEPINFER_AMPERE_SPARSE_DSV4")


def selector_pick(model: str, backend=None, pcp: int = 1) -> str:
    """The class name upstream's (patched) _select_dsv4_attn_cls picks for ``model``."""
    from vllm.models.deepseek_v4.nvidia import model as m4
    from vllm.models.deepseek_v41.nvidia import model as m41
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    cfg = SimpleNamespace(
        attention_config=SimpleNamespace(
            backend=None if backend is None else AttentionBackendEnum[backend]),
        parallel_config=SimpleNamespace(prefill_context_parallel_size=pcp,
                                        tensor_parallel_size=1),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(
            num_attention_heads=64, o_groups=8)))
    return {"deepseek_v41": m41, "deepseek_v4": m4}[model]._select_dsv4_attn_cls(cfg).__name__


def selector_registry() -> dict:
    """Patch 0016: our backend names resolve to our backend classes."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    out = {}
    for name in ("DEEPINFER_AMPERE_SPARSE_DSV41", "DEEPINFER_AMPERE_SPARSE_DSV4"):
        cls = AttentionBackendEnum[name].get_class()
        out[name] = [cls.__module__ + "." + cls.__name__, cls.get_name()]
    return out


@scenario
def scenario_selector() -> None:
    for model in ("deepseek_v41", "deepseek_v4"):
        for cap in SELECTOR_CAPS:
            fake_capability(*cap)
            key = f"{model}/{cap[0]}.{cap[1]}"
            for env in ("default", "on", "off", "disable_all"):
                set_env(DEEPINFER_AMPERE_ATTN={"on": "1", "off": "0"}.get(env),
                        DEEPINFER_DISABLE="all" if env == "disable_all" else None)
                record(f"{key}/{env}", selector_pick, model)
            set_env(DEEPINFER_AMPERE_ATTN=None, DEEPINFER_DISABLE=None)
            for b in SELECTOR_BACKENDS:
                record(f"{key}/backend={b}", selector_pick, model, b)
            set_env(DEEPINFER_AMPERE_ATTN="1")
            record(f"{key}/backend=FLASHMLA_SPARSE_DSV4+on", selector_pick, model,
                   "FLASHMLA_SPARSE_DSV4")
            set_env(DEEPINFER_AMPERE_ATTN=None)
            record(f"{key}/pcp2", selector_pick, model, None, 2)
    fake_capability(None)
    record("deepseek_v41/none/default", selector_pick, "deepseek_v41")
    record("registry", selector_registry)
    fake_capability(7, 5)
    record("deepseek_v41/7.5/default", selector_pick, "deepseek_v41")


# --------------------------------------------------------------------------- construct
CONSTRUCT_LAYERS = {"deepseek_v41": [0, 1, 2, 3], "deepseek_v4": [0, 1, 2]}


def construct_layer(cls, vcfg, i: int, topk, built: dict) -> dict:
    """Build layer ``i`` of class ``cls`` (kept in ``built``) and describe it."""
    layer = cls(vcfg, prefix=f"model.layers.{i}.attn", topk_indices_buffer=topk,
                aux_stream_list=None)
    built[i] = layer
    return {
        "class": type(layer).__name__,
        "compress_ratio": layer.compress_ratio,
        "padded_heads": layer.padded_heads,
        "backend": layer.get_attn_backend().get_name(),
        "kernel_block_sizes": [int(b) for b in
                               layer.get_attn_backend().get_supported_kernel_block_sizes()],
        "swa_builder": layer.swa_cache_layer.get_attn_backend().get_builder_cls().__name__,
        "indexer": None if layer.indexer is None else type(layer.indexer).__name__,
        # The index-K cache (a kv-source index layer's own, else shared): class, backend.
        "index_cache": None if layer.indexer is None else index_cache_view(layer.indexer.k_cache),
        "indexer_op": None if layer.indexer is None
        else type(layer.indexer.indexer_op).__name__,
        "has_compressor": layer.compressor is not None,
        "wo_a_is_bmm": bool(getattr(layer.wo_a, "is_bmm", False)),
        # The aux-stream overlap (indexer / compressor / projections) is upstream's: no
        # class of ours redefines the methods that run it.
        "stream_methods_ours": sorted(
            m for c in type(layer).__mro__ if c.__module__.startswith("vllm.deepinfer")
            for m in ("_prepare_and_attn", "_prepare_and_attn_eager",
                      "_run_parallel_input_projections", "forward")
            if m in vars(c)),
        "indexer_init_ours": layer.indexer is not None and any(
            "__init__" in vars(c) for c in type(layer.indexer).__mro__
            if c.__module__.startswith("vllm.deepinfer")),
    }


def index_cache_view(cache) -> dict:
    backend = cache.get_attn_backend()
    return {"class": type(cache).__name__, "backend": backend.get_name(),
            "backend_class": backend.__name__,
            "builder": backend.get_builder_cls().__name__,
            "upstream_builder": _upstream_index_builder(),
            "kernel_block_sizes": [int(b) for b in backend.get_supported_kernel_block_sizes()]}


def _upstream_index_builder() -> str:
    from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend
    return DeepseekV41IndexerBackend.get_builder_cls().__name__


@scenario
def scenario_construct() -> None:
    import tempfile

    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.deepinfer.attention import selector
    from vllm.utils import deep_gemm, import_utils
    from vllm.v1.attention.ops import flashmla

    cpu_platform()
    RESULTS["absent"] = {
        "deep_gemm": bool(deep_gemm.has_deep_gemm()),
        "cutedsl": bool(import_utils.has_cutedsl()),
        "flashmla": bool(flashmla._is_flashmla_available()[0]),
    }
    dist_init(tempfile.mkdtemp(prefix="deepinfer-probe-"),
              VllmConfig(device_config=DeviceConfig(device="cpu")))
    torch.set_default_dtype(torch.bfloat16)
    for model, ids in CONSTRUCT_LAYERS.items():
        cls, vcfg = selector.ampere_class(model), vllm_config(model)
        built: dict = {}
        with set_current_vllm_config(vcfg):
            topk = torch.full((64, 64), -1, dtype=torch.int32)
            for i in ids:
                record(f"{model}/layer{i}", construct_layer, cls, vcfg, i, topk, built)
        RESULTS[f"{model}/built"] = sorted(built)
        if not built:
            continue
        layer = built[max(built)]
        record(f"{model}/profile_run_zeroes_output", profile_run, layer, vcfg)
        record(f"{model}/o_proj", o_proj, layer, vcfg)
        record(f"{model}/o_proj_fp8_wo_a", wo_a_fp8_survives_repack, layer, vcfg)
        record(f"{model}/decode_without_our_kernel", decode_needs_our_kernel, layer)
        idx_layer = next((b for b in built.values() if b.indexer is not None), None)
        if idx_layer is not None:
            record(f"{model}/indexer_scoring", indexer_scoring, idx_layer, vcfg)
            record(f"{model}/indexer_scorer_off", indexer_scorer_switched_off, idx_layer, vcfg)


_ROWS = 3  # tokens of the construct checks' forward calls


def profile_run(layer, vcfg) -> bool:
    """The profile run (no metadata) zeroes the output."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.v1.worker.workspace import init_workspace_manager
    try:
        init_workspace_manager(torch.device("cpu"))
    except Exception:  # already initialised
        pass
    q = torch.randn(_ROWS, layer.padded_heads, layer.head_dim, dtype=torch.bfloat16)
    out = torch.full_like(q, 7.0)
    ctx = ForwardContext(no_compile_layers={}, attn_metadata=None, slot_mapping={})
    with set_current_vllm_config(vcfg), override_forward_context(ctx):
        layer.forward_mqa(q, None, torch.arange(_ROWS, dtype=torch.int64), out)
    return bool((out == 0).all())


def _o_proj_ref(layer, attn, wo_a):
    """Per-group einsum against ``wo_a`` [g * r, k] fp32, then wo_b, in fp32."""
    import torch
    g, r = layer.n_local_groups, layer.o_lora_rank
    z = torch.einsum("tgd,grd->tgr",
                     attn[:, :layer.n_local_heads].reshape(attn.shape[0], g, -1).float(),
                     wo_a.view(g, r, -1))
    return z.flatten(1) @ layer.wo_b.weight.float().t()


def o_proj(layer, vcfg) -> dict:
    import torch
    from vllm.config import set_current_vllm_config
    torch.nn.init.normal_(layer.wo_a.weight, std=0.02)
    torch.nn.init.normal_(layer.wo_b.weight, std=0.02)
    layer.wo_a.quant_method.process_weights_after_loading(layer.wo_a)
    attn = torch.randn(_ROWS, layer.padded_heads, layer.head_dim, dtype=torch.bfloat16)
    with set_current_vllm_config(vcfg):
        y = layer._o_proj(attn, torch.arange(_ROWS, dtype=torch.int64))
    ref = _o_proj_ref(layer, attn, layer.wo_a.weight.float())
    return {"shape": list(y.shape), "max_abs_err": float((y.float() - ref).abs().max()),
            "ref_scale": float(ref.abs().max()),
            "cached_bf16": getattr(layer.wo_a, "_dsv4_wo_a_bf16", None) is not None}


def wo_a_fp8_survives_repack(layer, vcfg) -> dict:
    """fp8 wo_a with 128x128 block scales: the bf16 copy is made from the weights as loaded,
    so a post-load repack (here: zeroing) cannot corrupt the o_proj; without the copy the
    layer refuses to read the fp8 weight."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.deepinfer.attention.common import wo_a_bf16
    g, r = layer.n_local_groups, layer.o_lora_rank
    k = layer.n_local_heads * layer.head_dim // g
    torch.manual_seed(0)
    w = torch.randn(g * r, k, dtype=torch.float32) * 0.05
    scale = torch.rand(g * r // 128, k // 128) + 0.5
    big = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    w8 = (w / big).to(torch.float8_e4m3fn)
    wo_a = layer.wo_a
    wo_a.weight = torch.nn.Parameter(w8.clone(), requires_grad=False)
    wo_a.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
    if hasattr(wo_a, "_dsv4_wo_a_bf16"):
        del wo_a._dsv4_wo_a_bf16
    try:
        wo_a_bf16(layer)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    wo_a.quant_method.process_weights_after_loading(wo_a)
    wo_a.weight.data.view(torch.uint8).zero_()  # a "repack" after the copy was taken
    attn = torch.randn(_ROWS, layer.padded_heads, layer.head_dim, dtype=torch.bfloat16)
    with set_current_vllm_config(vcfg):
        y = layer._o_proj(attn, torch.arange(_ROWS, dtype=torch.int64))
    ref = _o_proj_ref(layer, attn, w8.float() * big)
    return {"refused_without_copy": refused, "max_abs_err": float((y.float() - ref).abs().max()),
            "ref_scale": float(ref.abs().max())}


def decode_needs_our_kernel(layer) -> dict:
    """With our decode switched off, the layer refuses the software-fp8 variants (upstream's
    fallback kernel loads fp8e4nv) and keeps upstream's path on hardware fp8."""
    from vllm.deepinfer import routing
    os.environ["DEEPINFER_SPARSE_MLA_DECODE"] = "0"
    routing.reset()
    out = {}
    try:
        for v in ("cpu", "sm80", "sm90"):
            layer._ampere_variant = v
            try:
                out[v] = layer._decode_fuses_inv_rope()
            except RuntimeError as e:
                out[v] = "RuntimeError: " + str(e)
    finally:
        os.environ.pop("DEEPINFER_SPARSE_MLA_DECODE")
        routing.reset()
        layer._ampere_variant = layer._resolve_variant()
    out["feature_on"] = layer._decode_fuses_inv_rope()
    return out


def indexer_scoring(idx_layer, vcfg) -> dict:
    """Uniform and padded decode steps alike reach upstream's op (SparseAttnIndexer.
    forward_cuda, recorded here instead of run: its kernels need a GPU); the padded layout's
    fp8 Q packing is patch 0017's (writers probe)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    op = idx_layer.indexer.indexer_op
    seen = []
    orig = SparseAttnIndexer.forward_cuda
    SparseAttnIndexer.forward_cuda = lambda self, *a: seen.append(self) or "upstream"
    out = {}
    try:
        for name, pad, tokens in (("uniform", False, 4), ("padded", True, 4), ("ragged", False, 3)):
            decode = SimpleNamespace(requires_padding=pad,
                                     decode_lens=torch.ones(2, dtype=torch.int32))
            md = {op.k_cache.prefix: SimpleNamespace(num_decodes=2, num_decode_tokens=tokens,
                                                     decode=decode)}
            c = ForwardContext(no_compile_layers={}, attn_metadata=md, slot_mapping={})
            with set_current_vllm_config(vcfg), override_forward_context(c):
                out[name] = op(torch.zeros(_ROWS, 8), torch.zeros(_ROWS, 4, 128), None,
                               torch.zeros(_ROWS, 4))
    finally:
        SparseAttnIndexer.forward_cuda = orig
    out["delegated_to_self"] = len(seen) == 3 and all(x is op for x in seen)
    return out


def indexer_scorer_switched_off(idx_layer, vcfg) -> str:
    """indexer_logits off and no DeepGEMM: the op refuses at construction."""
    from vllm.config import set_current_vllm_config
    from vllm.deepinfer import routing
    from vllm.deepinfer.attention.common import DeepinferAmpereSparseAttnIndexer
    op = idx_layer.indexer.indexer_op
    os.environ["DEEPINFER_INDEXER_LOGITS"] = "0"
    routing.reset()
    try:
        with set_current_vllm_config(vcfg):
            DeepinferAmpereSparseAttnIndexer(
                op.k_cache, op.quant_block_size, op.scale_fmt, op.topk_tokens, op.head_dim,
                op.max_model_len, op.max_total_seq_len, op.topk_indices_buffer)
        return "constructed"
    finally:
        os.environ.pop("DEEPINFER_INDEXER_LOGITS")
        routing.reset()


# --------------------------------------------------------------------------- forward
@scenario
def scenario_forward() -> None:
    import vllm_probe_forward
    vllm_probe_forward.run(record)


# --------------------------------------------------------------------------- yoco
@scenario
def scenario_yoco() -> None:
    import vllm_probe_yoco
    vllm_probe_yoco.run(record)


# --------------------------------------------------------------------------- writers
@scenario
def scenario_writers() -> None:
    """The patched upstream fp8 writers hand their calls to ours on sm80 (interpreter, CPU
    tensors): same bytes as calling our writer directly; the CuTeDSL gate; the JIT warmup
    registration; the DeepGEMM logits and pack_seq routes."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["DEEPINFER_ARCH"] = "sm80"
    import torch
    from vllm.deepinfer import routing
    routing.reset()
    g = torch.Generator().manual_seed(3)
    import vllm_probe_writers as w
    record("writers.deep_gemm_logits", w.deep_gemm_logits)
    record("writers.pack_seq_fp8", w.pack_seq_fp8)
    record("writers.v41_rope_quant_insert", w.v41_insert, g)
    record("writers.v41_indexer_k_store", w.v41_indexer_k, g)
    record("writers.v4_indexer_q", w.v4_indexer_q, g)
    record("writers.v4_inv_rope", w.v4_inv_rope, g)
    record("writers.v4_compressor_launcher", w.v4_compressor_launcher)
    record("writers.has_cutedsl", w.cutedsl_gate)
    record("writers.warmup", w.warmup_registration)


def main() -> int:
    name = sys.argv[1]
    if name not in SCENARIOS:
        print(f"scenario: {name!r} is not one of {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    import time
    t0 = time.perf_counter()
    record("_scenario", SCENARIOS[name])
    RESULTS["_seconds"] = round(time.perf_counter() - t0, 2)
    sys.stdout.write("\n" + json.dumps(RESULTS) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
