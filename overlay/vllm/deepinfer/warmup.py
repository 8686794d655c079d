"""JIT warmup of the deepinfer kernels, and their registration with vLLM's JIT warmup.

vLLM 0.33.0 compiles its Triton kernels before serving: layers call
``<kernel>.register_warmup()`` on ``VllmJitKernel`` objects while the model is built (inside
``JitWarmupRegistry.capture``), and the runner then compiles every registered kernel's
``get_warmup_keys(vllm_config)``. Our kernels join that list through ``register_with_vllm``
(called by the patched V4.1/V4 attention layers next to upstream's own registrations, and by
the Ampere attention class), so no request pays a Triton compile.

The warmup keys are the configurations a model can launch, derived from its config
(``ModelShapes``): the gather's request buckets with and without ``gather_lens``, the
combiner's row widths for the model's compress ratios, window and top-k, and the decode's
(extra cache or not, split or not, inverse RoPE or not) with the cache block sizes of this
GPU, and the prefill's one configuration (dense combiner rows, sink, 512-wide output; its
row, head and head-tile counts are unspecialized). Each key compiles with ``JITFunction.warmup`` (Triton's compile-only launch) from the
kernel's signature table (the one the compile gate uses): pointers as dtypes, integers as 16
(the "multiple of 16" specialization every stride, row count and head count here takes at
runtime) except where the kernel sees 1 (``num_splits`` of an unsplit decode).

Nothing here imports vLLM except ``register_with_vllm``; ``keys``/``compile_key`` need only
torch and Triton (and a GPU to compile for).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Iterable

from vllm.deepinfer import arch, envs
from vllm.deepinfer.kernels.shapes import SWA_PAGE, compressed_page

logger = logging.getLogger("vllm.deepinfer")

# Representative integer for specialized int arguments: strides, row counts and head counts
# of these kernels are multiples of 16 in every model configuration we serve (128-column
# combined rows, 512-dim heads, 584 x block-size pages with block sizes 32/64/128, 64 heads).
_INT = 16
# Cache block sizes (tokens per page) the decode is compiled for: V4.1's SWA pages and its
# compressed/indexer pages on each variant (kernels/shapes.py).
SWA_BLOCK = SWA_PAGE


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """What the warmup keys depend on, read from the model config."""
    window: int
    compress_ratios: tuple[int, ...]  # distinct per-layer ratios (0 = SWA only)
    topk: int                          # index_topk
    heads: int                         # attention heads on this rank
    index_heads: int = 64              # indexer heads (replicated, not split by TP)


def model_shapes(vllm_config: Any) -> ModelShapes:
    """ModelShapes of a vLLM config (DeepSeek-V4.1 ``compress_ratios`` or V4
    ``compress_rates`` + ``layer_types``); attention heads divided by the TP size."""
    model_config = getattr(vllm_config, "model_config", None)
    hf = getattr(model_config, "hf_config", None)
    if hf is None:
        raise ValueError("vllm_config.model_config.hf_config is missing")
    ratios = getattr(hf, "compress_ratios", None)
    if ratios is None:
        rates = getattr(hf, "compress_rates", None) or {}
        ratios = [rates.get(t, 0) for t in getattr(hf, "layer_types", [])]
    ratios = tuple(sorted({int(r) for r in ratios} or {0}))
    tp = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
    heads = int(getattr(hf, "num_attention_heads", 64))
    return ModelShapes(window=int(getattr(hf, "sliding_window", 128) or 128),
                       compress_ratios=ratios, topk=int(getattr(hf, "index_topk", 0) or 0),
                       heads=max(1, heads // tp),
                       index_heads=int(getattr(hf, "index_n_heads", 64) or 64))


@dataclasses.dataclass(frozen=True)
class WarmupKey:
    """One compile of one kernel: its constexprs and launch options (hashable)."""
    kernel: str                            # a key of _KERNELS
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int
    num_stages: int
    ints_one: tuple[str, ...] = ()         # int arguments the runtime passes as 1


def _gather_keys(shapes: ModelShapes, variant: str) -> list[WarmupKey]:
    from vllm.deepinfer.kernels import kv_gather as kg
    return [WarmupKey("kv_gather", tuple(sorted(k.constexprs().items())), k.num_warps, 1)
            for k in kg.compile_keys(variant)]


def _combine_keys(shapes: ModelShapes, variant: str) -> list[WarmupKey]:
    from vllm.deepinfer.kernels import topk_swa as ts
    return [WarmupKey("topk_swa", tuple(sorted(k.constexprs().items())), k.num_warps, 1)
            for k in ts.compile_keys(shapes.window, shapes.compress_ratios, shapes.topk,
                                     variant)]


def _decode_keys(shapes: ModelShapes, variant: str) -> list[WarmupKey]:
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    tile = smd.TILES[variant]
    block_h, _ = smd.launch_plan(1, shapes.heads, 1.0, tile, 1, num_kv_splits=1)
    extra_bs = compressed_page(variant)
    has_extra = sorted({r > 0 for r in shapes.compress_ratios})
    keys = []
    for extra in has_extra:
        for split in (False, True):
            for inv_rope in (False, True):
                c = dict(HAS_EXTRA=extra, HAS_SINK=True, SPLIT=split,
                         INV_ROPE=inv_rope and not split, HW_FP8=arch.VARIANTS[variant].hw_fp8,
                         DOT_FP32=False, ALIGNED=True, MAIN_BS=SWA_BLOCK,
                         EXTRA_BS=extra_bs if extra else SWA_BLOCK, BLOCK_H=block_h,
                         BLOCK_N=tile.block_n, PREFETCH=tile.prefetch)
                key = WarmupKey("decode", tuple(sorted(c.items())), tile.num_warps,
                                tile.num_stages, () if split else ("num_splits",))
                if key not in keys:
                    keys.append(key)
    # The reduce, for every split-count bucket the heuristic can pick on this GPU class.
    for p2 in (2, 4, 8, 16):
        for inv_rope in (False, True):
            c = dict(HAS_SINK=True, INV_ROPE=inv_rope, SPLITS_P2=p2, UNROLL=smd.REDUCE_UNROLL,
                     BLOCK_H=tile.reduce_block_h)
            keys.append(WarmupKey("decode_reduce", tuple(sorted(c.items())), tile.reduce_warps, 1))
    return keys


def _prefill_keys(shapes: ModelShapes, variant: str) -> list[WarmupKey]:
    """The Ampere classes' prefill call (attention/common.py through patch 0003): dense
    combiner rows with lengths, the sink, a 512-wide output, an aligned workspace."""
    from vllm.deepinfer.kernels import sparse_mla_prefill as spm
    tile = spm.TILES[variant]
    block_h, _ = spm.launch_plan(shapes.heads, tile)
    c = spm.gate_constexprs(dataclasses.replace(tile, block_h=block_h))
    return [WarmupKey("prefill", tuple(sorted(c.items())), tile.num_warps, tile.num_stages)]


def _indexer_logits_keys(shapes: ModelShapes, variant: str) -> list[WarmupKey]:
    if not any(r > 0 for r in shapes.compress_ratios) or shapes.topk <= 0:
        return []  # no indexer in this model
    from vllm.deepinfer.kernels import indexer_logits as il
    tile = il.TILES[variant]
    return [WarmupKey("indexer_logits", tuple(sorted(c.items())), tile.num_warps,
                      tile.num_stages) for c in il.compile_constexprs(variant, shapes.index_heads)]


# feature (vllm.deepinfer.envs) -> key builder
_KEYS: dict[str, Callable[[ModelShapes, str], list[WarmupKey]]] = {
    "kv_gather": _gather_keys,
    "topk_swa": _combine_keys,
    "sparse_mla_decode": _decode_keys,
    "sparse_mla_prefill": _prefill_keys,
    "indexer_logits": _indexer_logits_keys,
}


def keys(shapes: ModelShapes, variant: str | None = None,
         features: Iterable[str] | None = None) -> list[WarmupKey]:
    """Every warmup key of the enabled features (all of ours when ``features`` is None and
    no env switch turns one off) on ``variant`` (None: this process's)."""
    name = variant if variant is not None else arch.current().name
    out: list[WarmupKey] = []
    for feature, build in _KEYS.items():
        if features is not None and feature not in features:
            continue
        if features is None and not envs.enabled(feature, name):
            continue
        out.extend(build(shapes, name))
    return out


# warmup kernel name -> (module, jit function, signature table the compile gate also uses)
_KERNELS: dict[str, tuple[str, str, str]] = {
    "kv_gather": ("vllm.deepinfer.kernels.kv_gather", "_gather_kernel", "_SIGNATURE"),
    "topk_swa": ("vllm.deepinfer.kernels.topk_swa", "_combine_kernel", "_SIGNATURE"),
    "decode": ("vllm.deepinfer.kernels.sparse_mla_decode", "_sparse_mla_decode_kernel",
               "_MAIN_SIG"),
    "decode_reduce": ("vllm.deepinfer.kernels.sparse_mla_decode",
                      "_sparse_mla_decode_reduce_kernel", "_REDUCE_SIG"),
    "indexer_logits": ("vllm.deepinfer.kernels.indexer_logits", "_logits_kernel", "_SIGNATURE"),
    "prefill": ("vllm.deepinfer.kernels.sparse_mla_prefill", "_sparse_mla_prefill_kernel",
                "_SIG"),
}


def _kernel_and_signature(name: str):
    import importlib
    if name not in _KERNELS:
        raise ValueError(f"unknown warmup kernel {name!r}; known: {', '.join(_KERNELS)}")
    module, kernel, sig = _KERNELS[name]
    m = importlib.import_module(module)
    return getattr(m, kernel), getattr(m, sig)


_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "u8": "uint8", "i32": "int32",
           "i64": "int64", "fp16": "float16"}


def warmup_args(key: WarmupKey) -> tuple[list, dict]:
    """(positional args, keyword constexprs) of ``JITFunction.warmup`` for ``key``."""
    import torch
    _, sig = _kernel_and_signature(key.kernel)
    args = []
    for name, ty in sig.items():
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            args.append(getattr(torch, _DTYPES[ty[1:]]))
        elif ty in ("fp32", "fp16", "bf16"):
            args.append(1.5)
        else:
            args.append(1 if name in key.ints_one else _INT)
    return args, dict(key.constexprs)


def compile_key(key: WarmupKey) -> None:
    """Compile ``key`` for the current GPU without launching it."""
    kernel, _ = _kernel_and_signature(key.kernel)
    args, constexprs = warmup_args(key)
    kernel.warmup(*args, grid=(1,), num_warps=key.num_warps, num_stages=key.num_stages,
                  **constexprs)


# ----------------------------------------------------------------------------- vLLM glue
@functools.cache
def _vllm_kernel():
    """One ``VllmJitKernel`` for all our kernels (built on first use: it needs vLLM)."""
    from vllm.model_executor.warmup.jit_warmup import VllmJitKernel

    class DeepinferJitKernels(VllmJitKernel[WarmupKey]):
        CompileKey = WarmupKey

        def get_warmup_keys(self, vllm_config: Any) -> list[WarmupKey]:
            return keys(model_shapes(vllm_config))

        def compile(self, key: WarmupKey) -> None:
            compile_key(key)

    return DeepinferJitKernels()


def register_with_vllm() -> bool:
    """Register our kernels with the active vLLM JIT warmup registry (a no-op outside
    ``JitWarmupRegistry.capture``, as upstream's ``register_warmup``). False when this GPU
    has no variant of ours or vLLM's warmup module is absent."""
    try:
        name = arch.current().name
    except arch.UnsupportedGPU:
        return False
    if name == "cpu":
        return False
    try:
        kernel = _vllm_kernel()
    except ImportError:
        return False
    kernel.register_warmup()
    logger.debug("deepinfer: JIT warmup registered for variant %s", name)
    return True
