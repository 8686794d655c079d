"""What the Ampere path reserves per GPU in vLLM's profile run, before vLLM sizes the KV
cache from the memory left: the terms, each from the code that asks for it (files under
``overlay/vllm/deepinfer/`` named without that prefix; upstream files relative to vLLM
0.33.0's ``vllm/``). The arithmetic is restated here without torch; tests/
test_kv_planner_reserve.py checks it against reserve.py's own functions.

vLLM's workspace (v1/worker/workspace.py) is one buffer per GPU that grows to the largest
``get_simultaneous`` request of the profile run (each view starting at a multiple of 256 B,
a(x) = round_up(x, 256)), so the requests below that live in it count once, as their
maximum:

* prefill gather, every Ampere layer (attention/common.py
  ``AmpereAttentionMixin._prefill_workspace_shapes``): ``[PREFILL_CHUNK_SIZE, M, 512]``
  bf16 with M = ceil(max_model_len / ratio) + window + max_num_batched_tokens (no
  compressed rows in sliding-window-only layers): 4 x (L + 128 + 8,192) KiB = 4.03 GiB for
  a ratio-1 layer at L = 1,048,576;
* upstream's indexer K gather, every indexer (model_executor/layers/sparse_attn_indexer.py:
  values, scales and the radix top-k's 1 MiB) for ``get_max_prefill_buffer_size //
  ratio`` rows = max_model_len x (576 * 2 // 132) x factor / ratio
  (v1/attention/backends/mla/indexer.py; factor: config/vllm.py);
* the decode scratch (reserve.py ``reserve_decode_scratch``), every Ampere layer: the
  largest request of the decode launcher's own plan (kernels/sparse_mla_decode.py
  ``select_tile``, ``launch_plan``, ``scratch_specs``) over t = 1 .. T decode tokens,
  T = min(B, max(S (1 + k), G)) (B max_num_batched_tokens, S max_num_seqs, k speculative
  tokens, G the largest CUDA-graph capture size), with K = window + top-k index entries
  per token (window alone in sliding-window-only layers): a(t H 1024) for the bf16
  output, 2 a(t s H 4) + a(t s H 2048) for s > 1 split-K partials, a(t K 1024) + a(t K)
  for the two-phase rows (t >= 4 on sm80/sm86);
* the indexer's decode logits (reserve.py ``reserve_indexer_logits``), every indexer:
  a(1 MiB) (the decode top-k's own request) + a(R x floor(L / ratio) x 4), R = max(T,
  min(S, T) (1 + k)).

Outside the workspace, so they add: the cross-layer gather buffer of layers reading a KV
source (yoco.py ``reserve_gather_buffer``: the layer's prefill gather, at most
``GATHER_BUFFER_MAX_BYTES``), the persistent indexer-K rows (yoco.py ``reserve_indexer_k``,
patch 0041: the indexer's rows, at most ``INDEXER_K_MAX_ROWS``), the combined index lists
(reserve.py ``CombineSlab``: one per distinct (kind, W) of the layers a GPU runs, B x W x 4
+ B x 4 bytes, W = round_up(top-k (+ V4's max_image_tokens) + window, 128) and kind
"shared" where cross-layer reuse keeps the lists, "own" otherwise), and the indexer's
transient logits (sparse_attn_indexer.py allocates VLLM_SPARSE_INDEXER_MAX_LOGITS_MB while
the workspace is held, so the profile's peak includes it).

Not modelled: DSpark's wider decode SWA rows (speculation with a DSpark drafter), a
benchmark's named tile rows, the Gluon phase 2 (no sm80/sm86 row selects it).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import PlannerInputError
from .layers import Layer
from .sizes import DEFAULT_MAX_CAPTURE_SIZE, DEFAULT_MAX_NUM_SEQS, MiB, cdiv, round_up

# AmpereAttentionMixin.PREFILL_CHUNK_SIZE (attention/common.py, upstream V4.1's value):
# requests per prefill chunk, the first dimension of the gather workspace.
PREFILL_CHUNK_SIZE = 4
# One latent row: head_dim 512 (kv_record.HEAD_DIM); bf16 in the gather and in the decode's
# output and two-phase rows, fp32 in its split-K partial accumulators.
HEAD_DIM = 512
LATENT_ROW_BYTES = HEAD_DIM * 2
# vLLM's workspace starts every view of one request at a multiple of 256 B
# (v1/worker/workspace.py; reserve.py WORKSPACE_ALIGN).
WORKSPACE_ALIGN = 256
# The radix top-k's share of the indexer's profile request and the first view of the decode
# logits request (RADIX_TOPK_WORKSPACE_SIZE in model_executor/layers/indexer_topk.py, 1 MiB
# in vLLM 0.33.0; reserve.py RADIX_TOPK_BYTES).
RADIX_TOPK_BYTES = 1 * MiB
# get_max_prefill_buffer_size: max_model_len x (576 * 2 // 132) x factor indexer rows
# (v1/attention/backends/mla/indexer.py).
PREFILL_BUFFER_ENTRIES_PER_TOKEN = 576 * 2 // 132  # = 8
# Indexer scales per row: one fp32 (fp8 rows) or four UE8M0 (MXFP4 rows, one per 32
# values): 4 B either way (sparse_attn_indexer.py _gather_workspace_shapes).
INDEXER_SCALE_BYTES = 4
# VLLM_SPARSE_INDEXER_MAX_LOGITS_MB (envs.py default 512): the indexer's dummy logits.
INDEXER_LOGITS_BYTES = 512 * MiB
# yoco.py: bound of the persistent prefill gather buffer and of the persistent
# indexer-K rows.
GATHER_BUFFER_MAX_BYTES = 256 * MiB
INDEXER_K_MAX_ROWS = 512 * 1024
# Combined lists: int32 columns, rows padded to 128 columns (kernels/topk_swa.py ROW_ALIGN,
# upstream's FlashMLA prefill B_TOPK).
COMBINED_ROW_ALIGN = 128
INDEX_BYTES = 4
# V4's C128A layers take every compressed position of max_model_len as top-k, in the
# metadata builder's alignment (models/deepseek_v4/sparse_mla.py _C128A_TOPK_ALIGNMENT;
# attention/ampere_v4.py _topk_width).
C128A_TOPK_ALIGNMENT = 128
# An A100's SMs (GA100 as sold: 108 of 128 enabled); the decode's split heuristic fills
# sm_count x ctas_per_sm slots (arch.sm_count reads the device's).
A100_SM_COUNT = 108


# --------------------------------------------------------------------------------------
# The decode launcher's plan (kernels/sparse_mla_decode.py)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeTile:
    """The fields of a sparse_mla_decode ``Tile`` its scratch depends on."""
    block_h: int
    block_n: int
    ctas_per_sm: int
    predequant: bool


# sparse_mla_decode.TILES: (the variant's own row, its "-2p" row); tests compare them.
DECODE_TILES: dict[str, tuple[DecodeTile, DecodeTile]] = {
    "sm80": (DecodeTile(16, 16, 2, False), DecodeTile(16, 16, 4, True)),
    "sm86": (DecodeTile(16, 16, 2, False), DecodeTile(16, 16, 2, True)),
}
# sparse_mla_decode.PREDEQUANT_MIN_TOKENS: launches of at least this many tokens take the
# two-phase row while feature decode_predequant is on (the default on sm80/sm86).
PREDEQUANT_MIN_TOKENS = 4
# launch_plan: tl.dot needs at least 16 rows, so the head block never shrinks below 16.
MIN_BLOCK_H = 16


def _aligned(n: int) -> int:
    return round_up(int(n), WORKSPACE_ALIGN)


def _next_pow2(n: int) -> int:
    return 1 << (max(1, int(n)) - 1).bit_length()


def decode_tile(variant: str, tokens: int, predequant: bool = True) -> DecodeTile:
    """``select_tile``: the two-phase row from PREDEQUANT_MIN_TOKENS tokens on."""
    if variant not in DECODE_TILES:
        raise PlannerInputError("variant", f"unknown {variant!r}; expected one of "
                                f"{tuple(DECODE_TILES)}")
    one, two = DECODE_TILES[variant]
    return two if predequant and tokens >= PREDEQUANT_MIN_TOKENS else one


def decode_splits(tokens: int, heads: int, keys_per_token: int, tile: DecodeTile,
                  sm_count: int) -> int:
    """``launch_plan`` / ``choose_num_splits``: split the keys while the grid stays within
    one wave of sm_count x ctas_per_sm programs, then the fewest splits with the same key
    tiles per program."""
    block_h = max(MIN_BLOCK_H, min(tile.block_h, _next_pow2(heads)))
    base = max(1, tokens * cdiv(heads, block_h))
    key_tiles = max(1, cdiv(keys_per_token, tile.block_n))
    most = max(1, min(sm_count * tile.ctas_per_sm // base, key_tiles))
    return cdiv(key_tiles, cdiv(key_tiles, most))


def decode_scratch_bytes(tokens: int, heads: int, keys_per_token: int,
                         sm_count: int = A100_SM_COUNT, variant: str = "sm80",
                         predequant: bool = True) -> int:
    """The workspace bytes one decode launch of ``tokens`` tokens asks for (``scratch_specs``
    of its plan, routed: no ``out`` given)."""
    tile = decode_tile(variant, tokens, predequant)
    n = _aligned(tokens * heads * HEAD_DIM * 2)
    splits = decode_splits(tokens, heads, keys_per_token, tile, sm_count)
    if splits > 1:
        part = tokens * splits * heads
        n += 2 * _aligned(part * 4) + _aligned(part * HEAD_DIM * 4)
    if tile.predequant:
        rows = max(tokens * keys_per_token, 1)
        n += _aligned(rows * HEAD_DIM * 2) + _aligned(rows)
    return n


def decode_scratch_worst(max_tokens: int, heads: int, keys_per_token: int,
                         sm_count: int = A100_SM_COUNT, variant: str = "sm80",
                         predequant: bool = True) -> tuple[int, int]:
    """(bytes, tokens) of the largest decode request over 1 .. ``max_tokens`` tokens
    (reserve.py ``decode_scratch_worst``). Past sm_count x ctas_per_sm tokens no launch
    splits and every term grows with the tokens, so only the sizes up to there and
    ``max_tokens`` itself are planned: the same maximum as trying every size."""
    decode_tile(variant, 1, predequant)  # refuses an unknown variant by name
    slots = sm_count * max(t.ctas_per_sm for t in DECODE_TILES[variant])
    best = (0, 0)
    for t in [*range(1, min(max_tokens, slots) + 1), max_tokens]:
        n = decode_scratch_bytes(t, heads, keys_per_token, sm_count, variant, predequant)
        if n > best[0]:
            best = (n, t)
    return best


# --------------------------------------------------------------------------------------
# The engine's limits and the layers' geometry
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Serving:
    """What reserve.py's worst cases are sized from besides the layers and max_model_len /
    max_num_batched_tokens (reserve.py ``Limits``), and the decode's GPU."""
    heads: int                                  # query heads per GPU (heads / TP)
    index_topk: int                             # config index_topk: top-k columns
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    num_speculative_tokens: int = 0
    max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE  # 0: no CUDA graphs (eager)
    max_image_tokens: int = 0                   # V4 vision: vision_max_n_token
    sm_count: int = A100_SM_COUNT
    variant: str = "sm80"
    predequant: bool = True                     # feature decode_predequant

    def decode_tokens(self, max_num_batched_tokens: int) -> int:
        """T (``Limits.decode_tokens``)."""
        per_step = self.max_num_seqs * (1 + self.num_speculative_tokens)
        return max(1, min(max_num_batched_tokens, max(per_step, self.max_capture_size)))

    def indexer_decode_rows(self, max_num_batched_tokens: int) -> int:
        """R (``Limits.indexer_decode_rows``)."""
        t = self.decode_tokens(max_num_batched_tokens)
        return max(t, min(self.max_num_seqs, t) * (1 + self.num_speculative_tokens))


def layer_topk(layer: Layer, serving: Serving, max_model_len: int) -> int:
    """Top-k columns of a layer's decode and prefill rows (``_topk_width``): 0 in
    sliding-window-only layers, every aligned compressed position in V4's C128A layers,
    the indexer's top-k otherwise."""
    if layer.ratio == 0:
        return 0
    if layer.ratio == 128:
        return round_up(cdiv(max_model_len, layer.ratio), C128A_TOPK_ALIGNMENT)
    return serving.index_topk


def decode_keys_per_token(layer: Layer, serving: Serving, max_model_len: int) -> int:
    """K (``_decode_keys_per_token``): the window plus the top-k columns."""
    return layer.window + layer_topk(layer, serving, max_model_len)


def combined_width(layer: Layer, serving: Serving, max_model_len: int) -> int:
    """W of the layer's combined-list buffer (``_combine_slab_width``)."""
    return round_up(layer_topk(layer, serving, max_model_len) + serving.max_image_tokens
                    + layer.window, COMBINED_ROW_ALIGN)


def combine_kinds(layer: Layer, serving: Serving, yoco: bool) -> set[str]:
    """``_combine_kinds``: "shared" where cross-layer reuse keeps the lists (every V4.1
    layer, V4's sliding-window-only and C128A layers), "own" otherwise (V4's C4A layers,
    which index themselves; reuse off) and for V4's image batches."""
    kinds = {"shared" if yoco and layer.ratio != 4 else "own"}
    if serving.max_image_tokens:
        kinds.add("own")
    return kinds


# --------------------------------------------------------------------------------------
# The terms
# --------------------------------------------------------------------------------------
def workspace_factor(max_model_len: int) -> int:
    """sparse_mla_prefill_workspace_factor (config/vllm.py): 5 up to 256K tokens, else 2."""
    return 5 if max_model_len <= 256 * 1024 else 2


def prefill_gather_bytes(ratio: int, window: int, max_model_len: int,
                         max_num_batched_tokens: int) -> int:
    """One Ampere layer's prefill gather request (``_prefill_workspace_shapes``)."""
    compressed = cdiv(max_model_len, ratio) if ratio > 0 else 0
    rows = compressed + window + max_num_batched_tokens
    return _aligned(PREFILL_CHUNK_SIZE * rows * LATENT_ROW_BYTES)


def indexer_rows(ratio: int, max_model_len: int) -> int:
    """The indexer's prefill gather rows (``max_total_seq_len`` of the V4/V4.1 indexers)."""
    buffer = max_model_len * PREFILL_BUFFER_ENTRIES_PER_TOKEN * workspace_factor(max_model_len)
    return buffer // ratio


def indexer_gather_bytes(ratio: int, record_bytes: int, max_model_len: int) -> int:
    """Upstream's indexer profile request: values, scales, the radix top-k's share."""
    rows = indexer_rows(ratio, max_model_len)
    return (_aligned(rows * (record_bytes - INDEXER_SCALE_BYTES))
            + _aligned(rows * INDEXER_SCALE_BYTES) + _aligned(RADIX_TOPK_BYTES))


def indexer_decode_logits_bytes(ratio: int, max_model_len: int, rows: int) -> int:
    """``indexer_logits_specs``: the top-k's 1 MiB, then [rows, L // ratio] fp32 (the
    indexer's ``max_model_len``, models/deepseek_v41/attention.py)."""
    return _aligned(RADIX_TOPK_BYTES) + _aligned(rows * (max_model_len // ratio) * 4)


def combined_lists_bytes(running: list[Layer], serving: Serving, max_model_len: int,
                         max_num_batched_tokens: int, yoco: bool = True) -> int:
    """The ``CombineSlab`` buffers of the layers a GPU runs: one per distinct (kind, W),
    each B x W int32 indices + B int32 lengths."""
    slabs = {(kind, combined_width(x, serving, max_model_len))
             for x in running for kind in combine_kinds(x, serving, yoco)}
    b = max_num_batched_tokens
    return sum(b * w * INDEX_BYTES + b * INDEX_BYTES for _, w in slabs)


def _indexers(layers: list[Layer]) -> list[tuple[int, int]]:
    """(ratio, index-K record bytes) of every indexer the layers run."""
    return [(x.ratio, x.indexer_record) for x in layers if x.indexer_record]


def ampere_reserved_bytes(held: list[Layer], max_model_len: int, max_num_batched_tokens: int,
                          serving: Serving, *, yoco: bool = True,
                          ampere: bool = True) -> dict[str, int]:
    """Bytes reserved on a GPU holding ``held`` (layers that run there; planner replicas of
    a remote KV source, labelled "replica ...", run nothing), by term, with ``workspace``
    (the largest workspace request) and ``total``.

    ``yoco``: the cross-layer reuse feature (yoco_reuse, on by default on the Ampere path).
    ``ampere`` False: upstream's path (its prefill gather and indexer requests only; the
    overlay's decode, logits and combined-list reservations and yoco's buffers are 0)."""
    running = [x for x in held if not x.label.startswith("replica")]
    L, B = max_model_len, max_num_batched_tokens
    yoco = yoco and ampere
    indexers = _indexers(running)
    out = {"prefill_gather": max((prefill_gather_bytes(x.ratio, x.window, L, B)
                                  for x in running), default=0),
           "indexer_k_gather": max((indexer_gather_bytes(r, rec, L) for r, rec in indexers),
                                   default=0),
           "decode_workspace": 0, "indexer_decode_logits": 0}
    if ampere:
        t = serving.decode_tokens(B)
        keys = {decode_keys_per_token(x, serving, L) for x in running}
        out["decode_workspace"] = max((decode_scratch_worst(
            t, serving.heads, k, serving.sm_count, serving.variant, serving.predequant)[0]
            for k in keys), default=0)
        rows = serving.indexer_decode_rows(B)
        out["indexer_decode_logits"] = max((indexer_decode_logits_bytes(r, L, rows)
                                            for r, _ in indexers), default=0)
    out["workspace"] = max(out.values())
    readers = [x for x in running if x.ratio > 0 and x.kv_source is not None]
    gather = max((prefill_gather_bytes(x.ratio, x.window, L, B) for x in readers), default=0)
    out["yoco_gather_buffer"] = min(gather, GATHER_BUFFER_MAX_BYTES) if yoco else 0
    out["yoco_indexer_k"] = max((min(indexer_rows(r, L), INDEXER_K_MAX_ROWS) * rec
                                 for r, rec in indexers), default=0) if yoco else 0
    out["indexer_logits_transient"] = INDEXER_LOGITS_BYTES if indexers else 0
    out["combined_lists"] = (combined_lists_bytes(running, serving, L, B, yoco)
                             if ampere else 0)
    out["total"] = (out["workspace"] + out["yoco_gather_buffer"] + out["yoco_indexer_k"]
                    + out["indexer_logits_transient"] + out["combined_lists"])
    return out
