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
(extra cache or not, split or not, inverse RoPE or not; on sm80/sm86 the single-phase tile
of small batches and the two-phase tile with its first phase, which launches of
``PREDEQUANT_MIN_TOKENS`` tokens or more take unless DEEPINFER_DECODE_PREDEQUANT=0) with the
cache geometry of this GPU (V4.1: SWA pages of 32 tokens; compressed pages of 64 tokens with
the kv_page64 feature, upstream's 128 / 64 without it, holding page // ratio entries each; V4:
SWA 64, C4A 64, C128A 2) and every split count the decode heuristic can pick. Each
key compiles with ``JITFunction.warmup`` (Triton's compile-only launch) from the kernel's
signature table (the one the compile gate uses): pointers as dtypes (the stand-ins a
launcher passes for unused arguments included: the dtype is part of Triton's cache key),
integers as 16 (the "multiple of 16" specialization every stride that stays specialized
takes at runtime); per-batch integers and metadata pointers whose alignment moves with the
chunk are ``do_not_specialize``[``_on_alignment``] in the kernels, and the launch options
are passed exactly as the launchers pass them. tests/test_warmup_coverage.py computes
Triton's cache key of every launch over a grid of realistic calls and of every warmup key,
on a CPU, and checks that the first are among the second. The prefill has one configuration
(dense combiner rows, sink, 512-wide output; its row, head and head-tile counts are
unspecialized).

Nothing here imports vLLM except ``register_with_vllm``; ``keys``/``compile_key`` need only
torch and Triton (and a GPU to compile for).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Iterable

from vllm.deepinfer import arch, envs
from vllm.deepinfer.kernels import shapes
from vllm.deepinfer.kernels.shapes import SWA_PAGE, compressed_entries, compressed_page

logger = logging.getLogger("vllm.deepinfer")

# Representative integer for specialized int arguments: strides and head counts of these
# kernels that stay specialized are multiples of 16 in every model configuration we serve
# (128-column combined rows, 512-dim heads, 584 x block-size pages with block sizes 32/64/128
# and V4's 2-entry C128A pages: 1168 bytes); per-batch integers (token, request, split and
# head counts, block-table strides) are ``do_not_specialize`` in the kernels, so their value
# here does not matter.
_INT = 16
# V4.1's SWA page (tokens), the decode's main cache. Kept for callers of the old name.
SWA_BLOCK = SWA_PAGE
# V4 pages: SWA pages of 64 tokens (kernels/shapes.py); compressed pages hold
# V4_LOGICAL_BLOCK // ratio entries (64 for C4A, 2 for C128A).
# Largest SM count of a GPU these kernels serve (GB300: 160), bounding the split-K factor
# when the warmup does not run on the device itself (tests).
MAX_SMS = 160


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """What the warmup keys depend on, read from the model config."""
    window: int
    compress_ratios: tuple[int, ...]  # distinct per-layer ratios (0 = SWA only)
    topk: int                          # index_topk
    heads: int                         # attention heads on this rank
    index_heads: int = 64              # indexer heads (replicated, not split by TP)
    model: str = "v41"                 # "v41" or "v4": the cache page geometry
    max_model_len: int = 0             # bounds V4's C128A top-k width (0: index_topk)
    candidate_block_size: int = 0      # V4.1's candidate blocks (0: none in this model)
    candidate_topk_blocks: int = 0

    def swa_only(self, ratio: int) -> bool:
        return ratio == 0 if self.model == "v41" else ratio <= 1

    @property
    def swa_page(self) -> int:
        return shapes.V41.swa_page if self.model == "v41" else shapes.V4.swa_page

    def extra_page(self, ratio: int, variant: str) -> int:
        """Entries per page of the compressed cache a ratio-``ratio`` layer decodes, with the
        environment's kv_page64 setting (V4.1: ``shapes.compressed_page(variant) // ratio``)."""
        if self.model == "v41":
            return compressed_entries(compressed_page(variant), ratio)
        return shapes.V4_LOGICAL_BLOCK // ratio

    @staticmethod
    def v41_pages(variant: str) -> tuple[int, ...]:
        """Every V4.1 compressed / index-K page (tokens) the Ampere path can be served with
        on ``variant``. kv_page64 on (the default): ``shapes.KV_PAGE64`` only, whatever
        capability vLLM sees (attention/ampere_v41.py asks for it on both caches). Off:
        upstream's backends pick the page from the capability vLLM sees, which is the
        variant's unless DEEPINFER_ARCH forces another variant, so both of upstream's sizes
        (64 / 128) are warmed, a few compiles more. Before the index-K half of kv_page64 the
        warmup took 64 and 128 on every variant: the H200 nocompile run of the A100-faithful
        mode (benchmarks/results/h200-2026-12-01-e2e-5f462a5.json, zero_compile) had served
        64-entry pages where the sm80 rule said 128."""
        if envs.enabled("kv_page64", variant):
            return (shapes.KV_PAGE64,)
        return tuple(sorted(set(shapes.UPSTREAM_COMPRESSED_PAGE.values())))

    def extra_pages(self, ratio: int, variant: str) -> tuple[int, ...]:
        """Every entries-per-page count of the compressed cache a ratio-``ratio`` layer
        decodes on ``variant``: V4.1 ``page // ratio`` for each of ``v41_pages`` (64-token
        pages: 64 entries at ratio 1, 32 at ratio 2); V4 ``V4_LOGICAL_BLOCK // ratio``."""
        if self.model == "v41":
            return tuple(sorted({compressed_entries(p, ratio) for p in self.v41_pages(variant)}))
        return (self.extra_page(ratio, variant),)

    @property
    def c128a_topk(self) -> int:
        """Widest C128A top-k (V4): every compressed position of the longest request, in
        steps of 128 (upstream's _C128A_TOPK_ALIGNMENT)."""
        if not self.max_model_len:
            return self.topk
        return -(-(-(-self.max_model_len // 128)) // 128) * 128

    @property
    def max_keys(self) -> int:
        """Most keys one decode token attends to: the window plus the widest top-k."""
        wide = self.c128a_topk if any(r >= 128 for r in self.compress_ratios) else 0
        return self.window + max(self.topk, wide)


def model_shapes(vllm_config: Any) -> ModelShapes:
    """ModelShapes of a vLLM config (DeepSeek-V4.1 ``compress_ratios`` or V4
    ``compress_rates`` + ``layer_types``); attention heads divided by the TP size."""
    model_config = getattr(vllm_config, "model_config", None)
    hf = getattr(model_config, "hf_config", None)
    if hf is None:
        raise ValueError("vllm_config.model_config.hf_config is missing")
    ratios = getattr(hf, "compress_ratios", None)
    model = "v41"
    if ratios is None:
        model = "v4"
        rates = getattr(hf, "compress_rates", None) or {}
        ratios = [rates.get(t, 0) for t in getattr(hf, "layer_types", [])]
    ratios = tuple(sorted({int(r) for r in ratios} or {0}))
    tp = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
    heads = int(getattr(hf, "num_attention_heads", 64))
    return ModelShapes(window=int(getattr(hf, "sliding_window", 128) or 128),
                       compress_ratios=ratios, topk=int(getattr(hf, "index_topk", 0) or 0),
                       heads=max(1, heads // tp),
                       index_heads=int(getattr(hf, "index_n_heads", 64) or 64), model=model,
                       max_model_len=int(getattr(model_config, "max_model_len", 0) or 0),
                       candidate_block_size=int(getattr(hf, "candidate_block_size", 0) or 0),
                       candidate_topk_blocks=int(getattr(hf, "candidate_topk_blocks", 0) or 0))


@dataclasses.dataclass(frozen=True)
class WarmupKey:
    """One compile of one kernel: its constexprs and launch options (hashable)."""
    kernel: str                            # a key of _KERNELS
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int | None
    # None: the launcher passes no num_stages (Triton's default applies); the options a
    # launch passes are part of the cache key, so the warmup passes exactly the same.
    num_stages: int | None
    # Pointer arguments the launcher fills with a stand-in of another dtype than the
    # signature's (an unsplit decode passes ``out`` for its unused partials): the dtype is
    # part of Triton's cache key, so the warmup must pass the same.
    ptrs: tuple[tuple[str, str], ...] = ()
    # Integer (or None) values of arguments a launch passes where Triton would specialize
    # them differently from ``_INT`` (unit strides, absent pointers): upstream helpers only.
    ints: tuple[tuple[str, Any], ...] = ()
    # Triton's maxnreg launch option (a warp-specialized kernel's register budget; None: the
    # launcher passes none).
    maxnreg: int | None = None


def _gather_keys(shapes: ModelShapes, variant: str, sm_count: int) -> list[WarmupKey]:
    from vllm.deepinfer.kernels import kv_gather as kg
    return [WarmupKey("kv_gather", tuple(sorted(k.constexprs().items())), k.num_warps, 1)
            for k in kg.compile_keys(variant)]


def _combine_keys(shapes: ModelShapes, variant: str, sm_count: int) -> list[WarmupKey]:
    from vllm.deepinfer.kernels import topk_swa as ts
    topk = shapes.topk
    if shapes.model == "v4" and any(r >= 128 for r in shapes.compress_ratios):
        topk = max(topk, shapes.c128a_topk)
    # V4's SWA-only layers run as ratio 1 with top-k 0: ratio 0 rows for the combiner.
    ratios = {0 if shapes.swa_only(r) else r for r in shapes.compress_ratios}
    return [WarmupKey("topk_swa", tuple(sorted(k.constexprs().items())), k.num_warps, 1)
            for k in ts.compile_keys(shapes.window, ratios, topk, variant)]


def _stand_ins(split: bool, inv_rope: bool, predequant: bool = False
               ) -> tuple[tuple[str, str], ...]:
    """What sparse_mla_decode passes for arguments a launch does not use: ``out`` (bf16) for
    the partials of an unsplit launch, for the cos/sin cache without inverse RoPE and for the
    workspace rows of a one-phase launch, ``main_indptr`` (int32) for the positions and for
    the one-phase launch's validity bytes."""
    ptrs = [] if split else [("part_m_ptr", "bf16"), ("part_l_ptr", "bf16"),
                             ("part_acc_ptr", "bf16")]
    if not inv_rope:
        ptrs += [("pos_ptr", "i32"), ("cs_ptr", "bf16")]
    if not predequant:
        ptrs += [("valid_ptr", "i32")]
    return tuple(ptrs)


def _decode_keys(shapes: ModelShapes, variant: str, sm_count: int) -> list[WarmupKey]:
    """Every tile row a launch on ``variant`` can take (``smd.launch_tiles``): the
    single-phase row and, where decode_predequant is on (sm80, sm86 by default), the two-phase
    row that launches of PREDEQUANT_MIN_TOKENS tokens or more take, with its first phase."""
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    main_bs = shapes.swa_page
    extras = sorted({e for r in shapes.compress_ratios
                     for e in ((None,) if shapes.swa_only(r) else shapes.extra_pages(r, variant))},
                    key=lambda e: -1 if e is None else e)
    keys = []
    for row in smd.launch_tiles(variant):
        tile = smd.TILES[row]
        block_h, _ = smd.launch_plan(1, shapes.heads, 1.0, tile, 1, num_kv_splits=1)
        for extra in extras:
            extra_bs = main_bs if extra is None else extra
            if tile.predequant:
                c = dict(HAS_EXTRA=extra is not None, HW_FP8=arch.VARIANTS[variant].hw_fp8,
                         ALIGNED=True, MAIN_BS=main_bs, EXTRA_BS=extra_bs,
                         BLOCK_N=smd.PREDEQUANT_BLOCK_N,
                         DECODE=smd.PREDEQUANT_DECODES[tile.predequant_decode])
                keys.append(WarmupKey("decode_predequant", tuple(sorted(c.items())),
                                      smd.PREDEQUANT_WARPS, 1))
            for split in (False, True):
                for inv_rope in (False, True):
                    c = dict(HAS_EXTRA=extra is not None, HAS_SINK=True, SPLIT=split,
                             INV_ROPE=inv_rope and not split,
                             HW_FP8=arch.VARIANTS[variant].hw_fp8, DOT_FP32=False, ALIGNED=True,
                             MAIN_BS=main_bs, EXTRA_BS=extra_bs, BLOCK_H=block_h,
                             BLOCK_N=tile.block_n, PREFETCH=tile.prefetch,
                             PREDEQUANT=tile.predequant,
                             QK_HALVES=tile.predequant and tile.qk_halves)
                    keys.append(WarmupKey("decode", tuple(sorted(c.items())), tile.num_warps,
                                          tile.num_stages,
                                          _stand_ins(split, inv_rope, tile.predequant)))
        # The reduce, for every split-count bucket choose_num_splits can pick: at most one
        # split per key tile and no more than one wave of CTAs.
        most = max(1, min(sm_count * tile.ctas_per_sm, -(-shapes.max_keys // tile.block_n)))
        p2 = 2
        while p2 < 2 * most:
            for inv_rope in (False, True):
                c = dict(HAS_SINK=True, INV_ROPE=inv_rope, SPLITS_P2=p2,
                         UNROLL=smd.REDUCE_UNROLL, BLOCK_H=tile.reduce_block_h)
                keys.append(WarmupKey("decode_reduce", tuple(sorted(c.items())),
                                      tile.reduce_warps, None, _stand_ins(True, inv_rope)))
            p2 *= 2
    return list(dict.fromkeys(keys))  # the rows share their reduce keys


def _prefill_keys(shapes: ModelShapes, variant: str, sm_count: int) -> list[WarmupKey]:
    """The Ampere classes' prefill call (attention/common.py through patch 0003): dense
    combiner rows with lengths, the sink, a 512-wide output, an aligned workspace."""
    from vllm.deepinfer.kernels import sparse_mla_prefill as spm
    from vllm.deepinfer.kernels import sparse_mla_prefill_gluon as glp
    tile = spm.TILES[variant]
    block_h, _ = spm.launch_plan(shapes.heads, tile)
    c = spm.gate_constexprs(dataclasses.replace(tile, block_h=block_h))
    # The Triton tile: what the row runs, or what a Gluon row falls back to.
    out = [WarmupKey("prefill", tuple(sorted(c.items())), tile.num_warps, tile.num_stages)]
    if tile.gluon_ws and glp.AVAILABLE:  # the Hopper producer/consumer kernel
        out.append(WarmupKey("prefill_ws", tuple(sorted(glp.gate_constexprs().items())),
                             glp.NUM_WARPS, None, maxnreg=glp.MAXNREG))
    return out


def _indexer_logits_keys(shapes: ModelShapes, variant: str, sm_count: int) -> list[WarmupKey]:
    if not any(r > 0 for r in shapes.compress_ratios) or shapes.topk <= 0:
        return []  # no indexer in this model
    from vllm.deepinfer.kernels import indexer_logits as il
    tile = il.TILES[variant]
    # The paged form reads the scales from the cache pages: it passes the uint8 cache.
    return [WarmupKey("indexer_logits", tuple(sorted(c.items())), tile.num_warps,
                      tile.num_stages, (("kscale_ptr", "u8"),) if c["PAGED"] else ())
            for c in il.compile_constexprs(variant, shapes.index_heads)]


def _candidate_logits_keys(shapes: ModelShapes, variant: str,
                           sm_count: int) -> list[WarmupKey]:
    """V4.1's candidate-masked index sources (kernels/indexer_candidate_logits.py): the
    logits kernel in the three layouts of the full one, and its fill/list kernel."""
    if shapes.candidate_block_size <= 0 or not _indexer_logits_keys(shapes, variant, sm_count):
        return []  # no candidate blocks (V4, V4.1 configs without them) or no indexer
    from vllm.deepinfer.kernels import indexer_candidate_logits as icl
    from vllm.deepinfer.kernels import indexer_logits as il
    tile = il.TILES[variant]
    keys = [WarmupKey("candidate_logits", tuple(sorted(c.items())), tile.num_warps,
                      tile.num_stages, (("kscale_ptr", "u8"),) if c["PAGED"] else ())
            for c in icl.compile_constexprs(variant, shapes.index_heads)]
    return keys + [WarmupKey("candidate_prepare", tuple(sorted(c.items())), icl.FILL_WARPS,
                             None) for c in icl.prepare_constexprs()]


def _writer_keys(shapes: ModelShapes, variant: str, sm_count: int) -> list[WarmupKey]:
    """V4's compressor writers (feature fp8_sw): the attention KV row of each compressed
    ratio and the C4A indexer's K row. Upstream's compressor launches them only for tokens
    that complete a compression window, so vLLM's profile and dummy runs need not compile
    them: the H200 nocompile run at d80f014 (benchmarks/results/h200-2026-12-01-e2e-d80f014
    .json, zero_compile) compiled the C128A writer while serving. V4.1's writers compiled
    during load in the same run and are not listed."""
    if shapes.model != "v4":
        return []
    from vllm.deepinfer.kernels import fp8_writers_v4_compress as v4c
    hw = arch.VARIANTS[variant].hw_fp8
    keys = []
    for r in sorted(r for r in shapes.compress_ratios if r > 1):
        c = dict(v4c.launch_constexprs(r, v4c.SPARSE_ATTN_HEAD_DIM), HW_FP8=hw)
        keys.append(WarmupKey("v4_compress_kv", tuple(sorted(c.items())),
                              v4c._SPARSE_ATTN_WARPS[variant], None))
        if r == 4 and shapes.topk > 0:  # the indexer lives on the C4A layers
            c = dict(v4c.launch_constexprs(4, v4c.INDEXER_HEAD_DIM), HW_FP8=hw)
            keys.append(WarmupKey("v4_compress_indexer", tuple(sorted(c.items())),
                                  v4c._INDEXER_WARPS[variant], None))
    return keys


def _pack_seq_keys(shapes: ModelShapes, variant: str, sm_count: int) -> list[WarmupKey]:
    """Patch 0017's pack of the indexer's e4m3 decode Q and unpack of its int32 top-k rows
    (feature fp8_sw, kernels/pack_seq.py): one configuration each, every integer and the
    lengths / starts pointers unspecialized. vLLM launches them only for a decode batch
    that is not uniform (speculative decoding, a short prefill counted as decode)."""
    from vllm.deepinfer.kernels import pack_seq as ps
    blocks = (("BLOCK_D", ps.BLOCK_D), ("BLOCK_T", ps.BLOCK_T))
    return [WarmupKey("pack_seq_pack", tuple(sorted((*blocks, ("PAD", 0)))), ps.NUM_WARPS, 1),
            WarmupKey("pack_seq_unpack", blocks, ps.NUM_WARPS, 1)]


def _fp8_sw_keys(shapes: ModelShapes, variant: str, sm_count: int) -> list[WarmupKey]:
    return (_writer_keys(shapes, variant, sm_count)
            + _pack_seq_keys(shapes, variant, sm_count))


def _inverse_rope_keys(shapes: ModelShapes, variant: str, sm_count: int) -> list[WarmupKey]:
    """The Ampere classes' standalone inverse RoPE of the rows no decode epilogue rotated
    (attention/common.py, kernels/inverse_rope.py): one configuration (512-dim rows, 64
    rotated lanes); the head count and the positions' alignment are unspecialized."""
    from vllm.deepinfer.kernels import inverse_rope as ir
    return [WarmupKey("inverse_rope", tuple(sorted(ir.gate_constexprs().items())),
                      ir.NUM_WARPS, ir.NUM_STAGES)]


def _ragged_keys(shapes: ModelShapes, variant: str, sm_count: int) -> list[WarmupKey]:
    """The Ampere decode's dense -> ragged conversion (attention/common.py,
    kernels/ragged_indices.py): one configuration per kernel, every integer and the index
    pointers' alignment unspecialized."""
    from vllm.deepinfer.kernels import ragged_indices as ri
    c = tuple(sorted(ri.gate_constexprs().items()))
    return [WarmupKey(k, c, ri.NUM_WARPS, ri.NUM_STAGES) for k in ("ragged_count",
                                                                   "ragged_compact")]


def _ampere_attn_keys(shapes: ModelShapes, variant: str, sm_count: int) -> list[WarmupKey]:
    return (_inverse_rope_keys(shapes, variant, sm_count)
            + _ragged_keys(shapes, variant, sm_count))


def _serve_warmup_keys(shapes: ModelShapes, variant: str, sm_count: int) -> list[WarmupKey]:
    from vllm.deepinfer import warmup_upstream as wu
    keys = wu.ragged_keys(WarmupKey)
    if shapes.model == "v41":
        keys += wu.candidate_keys(WarmupKey, shapes.candidate_block_size,
                                  shapes.candidate_topk_blocks)
    return keys


# feature (vllm.deepinfer.envs) -> key builder
_KEYS: dict[str, Callable[[ModelShapes, str, int], list[WarmupKey]]] = {
    "kv_gather": _gather_keys,
    "topk_swa": _combine_keys,
    "sparse_mla_decode": _decode_keys,
    "sparse_mla_prefill": _prefill_keys,
    "indexer_logits": _indexer_logits_keys,
    "candidate_logits": _candidate_logits_keys,
    "fp8_sw": _fp8_sw_keys,
    "ampere_attn": _ampere_attn_keys,
    "serve_warmup": _serve_warmup_keys,
}


def keys(shapes: ModelShapes, variant: str | None = None,
         features: Iterable[str] | None = None, sm_count: int | None = None) -> list[WarmupKey]:
    """Every warmup key of the enabled features (all of ours when ``features`` is None and
    no env switch turns one off) on ``variant`` (None: this process's) for a GPU of
    ``sm_count`` SMs (None: ``MAX_SMS``, which covers every GPU)."""
    name = variant if variant is not None else arch.current().name
    out: list[WarmupKey] = []
    for feature, build in _KEYS.items():
        if features is not None and feature not in features:
            continue
        if features is None and not envs.enabled(feature, name):
            continue
        out.extend(build(shapes, name, sm_count or MAX_SMS))
    return out


# warmup kernel name -> (module, jit function, signature table the compile gate also uses)
_KERNELS: dict[str, tuple[str, str, str]] = {
    "kv_gather": ("vllm.deepinfer.kernels.kv_gather", "_gather_kernel", "_SIGNATURE"),
    "topk_swa": ("vllm.deepinfer.kernels.topk_swa", "_combine_kernel", "_SIGNATURE"),
    "decode": ("vllm.deepinfer.kernels.sparse_mla_decode", "_sparse_mla_decode_kernel",
               "_MAIN_SIG"),
    "decode_reduce": ("vllm.deepinfer.kernels.sparse_mla_decode",
                      "_sparse_mla_decode_reduce_kernel", "_REDUCE_SIG"),
    "decode_predequant": ("vllm.deepinfer.kernels.sparse_mla_decode", "_predequant_kernel",
                          "_PREDEQUANT_SIG"),
    "indexer_logits": ("vllm.deepinfer.kernels.indexer_logits", "_logits_kernel", "_SIGNATURE"),
    "candidate_logits": ("vllm.deepinfer.kernels.indexer_candidate_logits",
                         "_candidate_logits_kernel", "_SIGNATURE"),
    "candidate_prepare": ("vllm.deepinfer.kernels.indexer_candidate_logits", "_prepare_kernel",
                          "_PREPARE_SIGNATURE"),
    "prefill": ("vllm.deepinfer.kernels.sparse_mla_prefill", "_sparse_mla_prefill_kernel",
                "_SIG"),
    "prefill_ws": ("vllm.deepinfer.kernels.sparse_mla_prefill_gluon", "_prefill_ws_kernel",
                   "SIGNATURE"),
    "v4_compress_kv": ("vllm.deepinfer.kernels.fp8_writers_v4_compress",
                       "_compress_sparse_attn_kernel", "_SIG"),
    "v4_compress_indexer": ("vllm.deepinfer.kernels.fp8_writers_v4_compress",
                            "_compress_indexer_kernel", "_SIG"),
    "pack_seq_pack": ("vllm.deepinfer.kernels.pack_seq", "_pack_kernel", "PACK_SIGNATURE"),
    "pack_seq_unpack": ("vllm.deepinfer.kernels.pack_seq", "_unpack_kernel",
                        "UNPACK_SIGNATURE"),
    "inverse_rope": ("vllm.deepinfer.kernels.inverse_rope", "_inverse_rope_rows_kernel",
                     "SIGNATURE"),
    "ragged_count": ("vllm.deepinfer.kernels.ragged_indices", "_count_kernel",
                     "COUNT_SIGNATURE"),
    "ragged_compact": ("vllm.deepinfer.kernels.ragged_indices", "_compact_kernel",
                       "COMPACT_SIGNATURE"),
}


def _kernel_and_signature(name: str):
    import importlib
    from vllm.deepinfer import warmup_upstream
    if name in warmup_upstream.KERNELS:  # upstream's kernel, our table of its signature
        module, kernel = warmup_upstream.KERNELS[name]
        return (getattr(importlib.import_module(module), kernel),
                warmup_upstream.SIGNATURES[name])
    if name not in _KERNELS:
        raise ValueError(f"unknown warmup kernel {name!r}; known: "
                         f"{', '.join([*_KERNELS, *warmup_upstream.KERNELS])}")
    module, kernel, sig = _KERNELS[name]
    m = importlib.import_module(module)
    return getattr(m, kernel), getattr(m, sig)


_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "u8": "uint8", "i32": "int32",
           "i64": "int64", "fp16": "float16"}


def warmup_args(key: WarmupKey) -> tuple[list, dict]:
    """(positional args, keyword constexprs) of ``JITFunction.warmup`` for ``key``."""
    import torch
    _, sig = _kernel_and_signature(key.kernel)
    ptrs = dict(key.ptrs)
    ints = dict(key.ints)
    args = []
    for name, ty in sig.items():
        if ty == "constexpr":
            continue
        if name in ints:
            args.append(ints[name])
        elif ty.startswith("*"):
            args.append(getattr(torch, _DTYPES[ptrs.get(name, ty[1:])]))
        elif ty in ("fp32", "fp16", "bf16"):
            args.append(1.5)
        else:
            args.append(_INT)
    return args, dict(key.constexprs)


def compile_key(key: WarmupKey) -> None:
    """Compile ``key`` for the current GPU without launching it."""
    kernel, _ = _kernel_and_signature(key.kernel)
    args, constexprs = warmup_args(key)
    kernel.warmup(*args, grid=(1,), **launch_options(key), **constexprs)


def launch_options(key: WarmupKey) -> dict[str, int]:
    """The launch options of ``key``, as its launcher passes them."""
    # None: the launcher passes no num_warps (upstream helpers), Triton's default applies.
    opts = {} if key.num_warps is None else {"num_warps": key.num_warps}
    if key.num_stages is not None:
        opts["num_stages"] = key.num_stages
    if key.maxnreg is not None:
        opts["maxnreg"] = key.maxnreg
    return opts


# ----------------------------------------------------------------------------- vLLM glue
@functools.cache
def _vllm_kernel():
    """One ``VllmJitKernel`` for all our kernels (built on first use: it needs vLLM)."""
    from vllm.model_executor.warmup.jit_warmup import VllmJitKernel

    class DeepinferJitKernels(VllmJitKernel[WarmupKey]):
        CompileKey = WarmupKey

        def get_warmup_keys(self, vllm_config: Any) -> list[WarmupKey]:
            import torch
            sms = arch.sm_count(torch.device("cuda", torch.cuda.current_device())) \
                if torch.cuda.is_available() else None
            return keys(model_shapes(vllm_config), sm_count=sms)

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
