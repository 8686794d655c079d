"""Cross-layer metadata reuse ("YOCO") for DeepSeek-V4.1/V4 sparse attention.

In DeepSeek-V4.1 a few layers own the compressed KV cache (``kv_source_layer_ids``) and the
indexer (``index_source_layer_ids``); every other compressed layer reads the cache of the
latest KV source at or below it and the top-k its latest index source published into the
shared ``topk_indices_buffer``. Whatever a layer derives from those alone is identical for
every layer of its group, yet each layer rebuilds it. This module builds it once per forward
and hands the same tensors to the rest of the group:

=====================  =============================================  =====================
product                key (what determines it)                       built by
=====================  =============================================  =====================
decode global indices  (index source, KV source, ratio)               the first layer of the
  (ragged, + lens)     + the batch and compressed metadata            group that decodes
decode SWA lists       the SWA metadata object + the cache's rows     the first layer
  (ragged)             (every layer of one SWA cache group)
combined lists         (index source, ratio, window, top-k) + chunk   first layer per chunk
  (prefill)            + the batch; SWA-only layers
                       share one entry (index source ``None``)
gathered compressed K  (KV source, ratio) + chunk                     the KV source layer
  (prefill)            (rows [0, N) of the chunk's gather buffer)
indexer K gather       the index-K cache (= its KV source) + chunk    the KV-source indexer
  (prefill)
=====================  =============================================  =====================

V4.1's upstream layout (KV sources 2, 8, 14, 20; index sources 2, 8, 14, 20, 24, 28, 32, 36;
ratios 2 then 1) goes from 38 decode global-index builds per step to 8. V4 has no KV sharing
(every compressed layer owns its cache and, for C4A, its indexer), so there only the combined
lists of its SWA-only layers and of the C128A layers that share one metadata object (top-k
from the metadata builder) are reused.

Lifetime and safety
-------------------
* One ``StepCache`` per forward: it hangs off vLLM's ``ForwardContext`` object (a new one per
  ``set_forward_context``, i.e. per model forward, draft steps included), so it is cleared at
  every forward without a hook, and a forward never sees another forward's products.
* Keys hold the identities of the metadata objects the layers read (``id()`` of objects the
  forward context keeps alive), or for the SWA metadata, of which vLLM builds one object
  per cache group, the storage of the batch fields the products read (``batch_tag``), so
  two layers share a product only if they would have read the same bytes; no key depends
  on tensor values.
* CUDA graphs: which lookups hit is a function of the layer sequence and of which metadata
  objects they read, never of data, so a captured forward and every replay run the same
  launches. Products are allocated inside the forward (in the graph's pool during capture)
  and referenced until the forward ends, so no later allocation of the captured forward can
  alias them; under FULL capture no Python runs at replay at all. Eager-break and piecewise
  modes run this Python again at each replay, with the replay's own (new) forward context.
* The gathered compressed K lives in one persistent buffer (``GatherBuffer``), the only one
  that must survive from the KV source's attention to its consumers': vLLM's workspace is
  shared with the indexer and others between layers. Its size is bounded
  (``GATHER_BUFFER_MAX_BYTES``); a chunk that does not fit is gathered into the workspace as
  before, without reuse. It is reserved in the memory-profiling run.
* Chunked prefill: keys carry the chunk's request range and its (N, M) geometry.
  Speculative decode: the decode-token layout is part of the metadata the key names.
  DCP/PCP: the reuse declines (``parallel_reason``); the Ampere classes refuse both anyway.

Switch: feature ``yoco_reuse`` (``DEEPINFER_YOCO_REUSE=0`` turns it off; on by default on every
variant). Importable without vLLM (the forward context is passed in by the callers).

Verification (test switch ``DEEPINFER_YOCO_VERIFY=1``, eager only): at every hit the layer
builds its product again, as it would with reuse off, and the two are compared bit for bit
(``totals()``: ``<kind>.verify_equal`` / ``<kind>.verify_mismatch``; a mismatch is logged
with its key). Inside one forward both builds read the same inputs, so this holds reuse to
identity in a served engine even where two runs of the engine differ (docs/yoco.md).
Ragged products are compared up to their lengths: their buffers' tails are never written.
The two buffer products (gathered compressed K, indexer K) are gathered again in place, so
under verification the layer reads its own build of those.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
from typing import Any, Callable, Hashable

import torch

from vllm.deepinfer import routing

logger = logging.getLogger("vllm.deepinfer")

__all__ = ["FEATURE", "StepCache", "GatherBuffer", "enabled", "step_cache", "reuse",
           "batch_tag", "decode_indices_key", "swa_ragged_key", "combine_key", "gather_key", "indexer_k_key", "totals",
           "reset_totals", "parallel_reason", "gather_buffer", "reserve_gather_buffer",
           "GATHER_BUFFER_MAX_BYTES", "INDEXER_K_MAX_ROWS", "NO_REUSE",
           "indexer_k_rows", "reserve_indexer_k", "prefill_kv", "chunk_order",
           "VERIFY_VARIABLE", "verify_enabled", "same_product", "verify_gather",
           "shared_no_replay_start"]

FEATURE = "yoco_reuse"
# The attribute of vLLM's ForwardContext that holds the forward's StepCache.
_ATTR = "_deepinfer_yoco"

# Product kinds (the first element of every key; counters are kept per kind).
DECODE_INDICES = "decode_indices"
SWA_RAGGED = "swa_ragged"
COMBINE = "combine"
GATHER = "gather"
INDEXER_K = "indexer_k"

# An index source that shares with nobody (V4's C4A layers index themselves): no lookup.
NO_REUSE = object()

# Upper bound of the persistent prefill gather buffer. A chunk's gather is
# size x M rows of 1 KiB (512 bf16) where M = compressed rows + SWA rows of its widest
# request; one 32K-context request at ratio 1 with an 8K chunk is (32768 + 8192 + 127) rows,
# 40 MiB, four such requests 160 MiB. 256 MiB covers the 8K/32K chunks this project
# measures and costs ~0.3% of an 80 GB A100; a wider chunk is gathered into vLLM's
# workspace as before (no reuse), so correctness never depends on the bound.
GATHER_BUFFER_MAX_BYTES = 256 << 20
# Upper bound of the persistent indexer-K gather (rows of 128 e4m3 codes + one fp32 scale,
# 132 B): 512K rows = 66 MiB cover a 512K-token context at ratio 1; longer gathers go to the
# workspace as upstream does.
INDEXER_K_MAX_ROWS = 512 * 1024

_totals: collections.Counter = collections.Counter()

# Test switch (envs.VARIABLES): rebuild every reused product and compare (module docstring).
VERIFY_VARIABLE = "DEEPINFER_YOCO_VERIFY"


def verify_enabled() -> bool:
    """``DEEPINFER_YOCO_VERIFY=1``, read at every call; never while a CUDA graph is being
    captured (the comparison reads values back to the host)."""
    if os.environ.get(VERIFY_VARIABLE, "0").strip() != "1":
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _tensors_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype
                and (a.numel() == 0 or bool(torch.equal(_bits(a), _bits(b)))))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def same_product(kind: str, a: Any, b: Any) -> bool:
    """Whether two builds of one product are the same bit for bit, where they are defined:
    a ragged list ``(flat, indptr)`` (DECODE_INDICES, SWA_RAGGED) up to ``indptr[-1]``
    entries, combined lists ``(indices [T, W], lens [T])`` (COMBINE) up to each row's length;
    anything else (tensors, tuples of them) entirely."""
    if kind in (DECODE_INDICES, SWA_RAGGED) and isinstance(a, tuple) and len(a) == 2 \
            and isinstance(b, tuple) and len(b) == 2 and a[1] is not None and b[1] is not None:
        (fa, ia), (fb, ib) = a, b
        if not _tensors_equal(ia, ib):
            return False
        n = int(ia[-1]) if ia.numel() else 0
        if n > fa.numel() or n > fb.numel():
            return False
        return fa.dtype == fb.dtype and _tensors_equal(fa.reshape(-1)[:n], fb.reshape(-1)[:n])
    if kind == COMBINE and isinstance(a, tuple) and len(a) == 2 and isinstance(b, tuple) \
            and len(b) == 2:
        (xa, la), (xb, lb) = a, b
        if not _tensors_equal(la, lb) or xa.shape != xb.shape or xa.dtype != xb.dtype:
            return False
        if xa.dim() != 2:
            return _tensors_equal(xa, xb)
        cols = torch.arange(xa.shape[1], device=xa.device)
        valid = cols[None, :] < la.reshape(-1, 1).to(cols.device)
        return _tensors_equal(xa[valid], xb[valid])
    return _tensors_equal(a, b)


def _verified(kind: str, key: Any, same: bool) -> None:
    _totals[f"{kind}.verify_{'equal' if same else 'mismatch'}"] += 1
    if not same:
        logger.warning("deepinfer: yoco verify: the reused %s differs from a fresh build "
                       "(key %r)", kind, key)


def enabled() -> bool:
    """The ``yoco_reuse`` feature on this process's variant (decided once per process)."""
    return routing.use(FEATURE)


def totals() -> dict[str, int]:
    """Builds and hits per product kind since the last ``reset_totals()`` (every forward of
    this process): ``{"decode_indices.build": 8, "decode_indices.hit": 30, ...}``."""
    return dict(_totals)


def reset_totals() -> None:
    _totals.clear()


def parallel_reason(dcp: int = 1, pcp: int = 1) -> str | None:
    """Why reuse must decline under this parallelism, or None. With DCP each rank holds a
    shard of the context and the indexer merges top-k across ranks; with PCP each rank
    attends its own query slice with its own gathered cache: the products are per rank
    and per layer kind in ways the keys above do not name."""
    if dcp > 1:
        return f"decode context parallelism (DCP {dcp})"
    if pcp > 1:
        return f"prefill context parallelism (PCP {pcp})"
    return None


class StepCache:
    """What the layers of one forward share. ``get(key, build)`` returns the entry under
    ``key`` or stores ``build()`` there. Keys whose second element (the group tag) is an
    int are V4.1 index sources, which increase through the layers: when a larger one
    appears, entries of smaller ones can never be read again and are dropped, so at most one
    index group's products (plus the tag-less and metadata-tagged ones) are alive."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, Any] = {}
        self._group = -1
        self.builds: collections.Counter = collections.Counter()
        self.hits: collections.Counter = collections.Counter()
        # The key of the compressed rows the gather buffer holds in this forward, if any.
        self.gather_holder: Hashable | None = None
        self.indexer_k_holder: Hashable | None = None
        # Where the last gathering indexer chunk put its rows ("own" buffer or None).
        self.indexer_k_last: str | None = None
        # DEEPINFER_YOCO_VERIFY: (key, copy of the gather view) awaiting verify_gather.
        self.gather_snapshot: tuple | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def _advance(self, tag: Any) -> None:
        if isinstance(tag, int) and not isinstance(tag, bool) and tag > self._group:
            self._group = tag
            stale = [k for k in self._entries
                     if isinstance(k[1], int) and not isinstance(k[1], bool) and k[1] < tag]
            for k in stale:
                del self._entries[k]

    def get(self, key: tuple, build: Callable[[], Any]) -> Any:
        self._advance(key[1])
        hit = self._entries.get(key)
        if hit is not None:
            self.count(key[0], hit=True)
            if verify_enabled():
                _verified(key[0], key, same_product(key[0], hit, build()))
            return hit
        value = build()
        self._entries[key] = value
        self.count(key[0], hit=False)
        return value

    def count(self, kind: str, hit: bool) -> None:
        (self.hits if hit else self.builds)[kind] += 1
        _totals[f"{kind}.{'hit' if hit else 'build'}"] += 1


def step_cache(forward_context: Any) -> StepCache | None:
    """This forward's cache (created on first use), or None when the feature is off or
    there is no forward context (profile runs without one, tests)."""
    if forward_context is None or not enabled():
        return None
    cache = getattr(forward_context, _ATTR, None)
    if cache is None:
        cache = StepCache()
        setattr(forward_context, _ATTR, cache)
    return cache


def reuse(forward_context: Any, key: tuple | None, build: Callable[[], Any]) -> Any:
    """``build()`` once per forward and ``key``; every call when the feature is off or the
    key is None (a layer that shares with nobody)."""
    cache = step_cache(forward_context) if key is not None else None
    return build() if cache is None else cache.get(key, build)


# ----------------------------------------------------------------------------- keys
def _tag(index_source: Any) -> Any:
    return index_source


def _span(t: Any) -> Any:
    """Where a tensor's bytes are (storage address, shape, strides); None for None."""
    if t is None:
        return None
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()))


# The fields of vLLM's DeepseekSparseSWAMetadata that a batch_tag names.
_BATCH_SCALARS = ("block_size", "decode_swa_width", "prefill_window_size", "num_decodes",
                  "num_prefills", "num_decode_tokens", "num_prefill_tokens",
                  "max_decode_query_len")
_BATCH_TENSORS = ("query_start_loc", "seq_lens", "prefill_left_visible",
                  "prefill_right_visible")


def batch_tag(swa_metadata: Any) -> tuple:
    """The batch a layer's SWA metadata describes, apart from the KV cache group it belongs to.

    vLLM splits the SWA caches of the model's layers into interleaved cache groups
    (``layers[i::num_groups]``, v1/core/kv_cache_planning.py), and each group's builder
    builds its own metadata object; neighbouring layers, which share an index and a KV
    source, therefore hold different SWA metadata objects. Of those, only the block table
    and the slot mapping belong to the group. What the shared products read
    (``token_to_req_indices``, ``is_valid_token`` = slot mapping >= 0,
    ``prefill_seq_lens``, ``prefill_gather_lens``, the chunk plan) each builder computes from
    the batch's common metadata (one ``query_start_loc`` and ``seq_lens`` storage per step)
    and its spec (block size, window): the same bytes in every group. (A padded token's
    slot is -1 in every group.) The replay starts vLLM's V4.1 model state hands the SWA
    builders (``replay_start``) are not part of this tag: ``prefill_gather_lens`` and the SWA
    windows depend on them, so ``combine_key`` names them apart. This tag names the other
    inputs, so layers of different groups share what they would compute alike; the SWA
    window's own lists (``swa_ragged_key``) read the group's block table and stay per
    object. An object without these fields is named by its identity."""
    if not all(hasattr(swa_metadata, f) for f in _BATCH_SCALARS + _BATCH_TENSORS):
        return ("object", id(swa_metadata))
    return ((type(swa_metadata).__qualname__,)
            + tuple(getattr(swa_metadata, f) for f in _BATCH_SCALARS)
            + tuple(_span(getattr(swa_metadata, f)) for f in _BATCH_TENSORS))


def decode_indices_key(index_source: Any, kv_source: Any, ratio: int, swa_metadata: Any,
                       comp_metadata: Any, num_tokens: int) -> tuple | None:
    """Decode global top-k indices and lens: the index source's local top-k (shared
    ``topk_indices_buffer``) mapped through the KV source's block table at the ratio's block
    size, masked by the step's valid tokens (``batch_tag``)."""
    if index_source is NO_REUSE:
        return None
    return (DECODE_INDICES, _tag(index_source), kv_source, int(ratio), batch_tag(swa_metadata),
            id(comp_metadata), int(num_tokens))


def swa_ragged_key(swa_metadata: Any, num_rows: int) -> tuple:
    """The decode's ragged SWA-window lists: the step's SWA metadata object (one per SWA
    cache group: the lists hold slots of the group's block table) and the cache's row count
    (slots past it are dropped), shared by the layers of one group."""
    return (SWA_RAGGED, None, id(swa_metadata), int(num_rows))


def combine_key(index_source: Any, ratio: int, window: int, topk: int, swa_metadata: Any,
                chunk: tuple[int, int, int, int], extra: Hashable = None) -> tuple | None:
    """One prefill chunk's combined (top-k + SWA) lists. ``chunk`` = (first request, end
    request, N, M) of the layer's chunk plan; ``extra`` names anything else the lists read
    (V4's image visibility: such calls are not shared, pass NO_REUSE).

    The lists' SWA part follows the metadata's ``prefill_gather_lens``, which the replay
    starts clamp: under vLLM 0.33.0's decoder SWA bounded replay (eager V4.1 prefill steps,
    models/deepseek_v41/decoder_replay_layers.py) the first replay layer's metadata carries
    the batch's replay starts and the later replay layers' each trimmed request's kept start,
    over one kept batch (one ``batch_tag``). So the key names the replay starts' storage: the
    groups of one forward get views of one buffer and still share; a builder given none uses
    its ``no_replay_start``, which the Ampere builders take from shared_no_replay_start (one
    storage for every group), so those groups share too."""
    if index_source is NO_REUSE or extra is NO_REUSE:
        return None
    return (COMBINE, _tag(index_source), int(ratio), int(window), int(topk),
            batch_tag(swa_metadata), tuple(int(x) for x in chunk),
            _span(getattr(swa_metadata, "replay_start", None)), extra)


def gather_key(kv_source: Any, ratio: int, comp_metadata: Any, swa_metadata: Any,
               chunk: tuple[int, int, int, int]) -> tuple:
    """The compressed rows [0, N) of one prefill chunk's gather: the KV source's cache read
    through its block table at the ratio's block size."""
    return (GATHER, None, kv_source, int(ratio), id(comp_metadata), batch_tag(swa_metadata),
            tuple(int(x) for x in chunk))


def indexer_k_key(k_cache_prefix: str, chunk: Any) -> tuple:
    """One indexer prefill chunk's K gather from the index-K cache ``k_cache_prefix`` (owned
    by a KV source; the index sources after it share it)."""
    return (INDEXER_K, None, k_cache_prefix, id(chunk))


# ----------------------------------------------------------------------------- gather buffer
@dataclasses.dataclass
class GatherBuffer:
    """The persistent bf16 prefill gather buffer (one per device).

    A chunk's gather is a [size, M, 512] view: for request r, rows [0, N) hold the
    compressed keys (shared by the KV source's group), rows [N, M) the layer's own SWA
    keys. Only layers with a compressed cache use it; their SWA gather writes rows [N, M)
    and leaves [0, N) alone, so the compressed rows survive from the KV source's layer to
    its consumers as long as nobody else writes them (vLLM's workspace is shared with the
    indexer and others between layers: hence a buffer of our own). ``generation`` counts
    reallocations: a reallocated buffer holds nothing."""
    tensor: torch.Tensor | None = None
    max_bytes: int = GATHER_BUFFER_MAX_BYTES
    generation: int = 0

    def view(self, size: int, m: int, dim: int, device, dtype=torch.bfloat16):
        """A [size, m, dim] view, or None when it would exceed ``max_bytes``."""
        need = size * m * dim
        if need * torch.finfo(dtype).bits // 8 > self.max_bytes:
            return None
        t = self.tensor
        if t is None or t.numel() < need or t.device != _device(device) or t.dtype != dtype:
            self.tensor = t = torch.empty(need, dtype=dtype, device=device)
            self.generation += 1
        return t[:need].view(size, m, dim)

    def reserve(self, nbytes: int, device, dtype=torch.bfloat16) -> None:
        """Allocate up to ``min(nbytes, max_bytes)`` now (the memory-profiling run), so the
        KV-cache sizing that follows accounts for it."""
        n = min(int(nbytes), self.max_bytes) * 8 // torch.finfo(dtype).bits
        t = self.tensor
        if n > 0 and (t is None or t.numel() < n or t.device != _device(device)):
            self.tensor = torch.empty(n, dtype=dtype, device=device)
            self.generation += 1


def _device(device) -> torch.device:
    """``device`` with its index: a tensor on the GPU reports ``cuda:0`` where callers may pass
    ``"cuda"``. Compared unresolved, they differ, and the buffer was reallocated (its rows
    forgotten) on every call: the H200 yoco suite at 5f462a5 reused no prefill gather."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if d.type == "cpu":
        return torch.device("cpu")
    return d


# ----------------------------------------------------------------------------- no-replay starts
_NO_REPLAY: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}


def shared_no_replay_start(own: torch.Tensor) -> torch.Tensor:
    """One zeros tensor per (device, dtype, length) for every SWA metadata builder's
    ``no_replay_start``.

    Upstream's builder allocates its own zeros (the replay start of a batch that replays
    nothing) and hands it to every batch it builds without ``replay_start``: all of V4's
    batches, and V4.1's graph captures. combine_key names the replay starts by their
    storage, so the layers of two SWA cache groups then got different keys over one batch:
    V4's C128A layers (v4-long's layers 2 and 4) each built their own combined lists, and
    the second layer's lists, refused the slab the profile run reserved (reserve._claim's
    second live owner), were allocated outside it on every prefill chunk (the H200 run at
    3099bbc, graphs and eager alike by this reading). Upstream only reads the tensor (it is
    never written), so sharing one is the same bytes under one storage."""
    key = (str(_device(own.device)), own.dtype, int(own.numel()))
    t = _NO_REPLAY.get(key)
    if t is None:
        t = _NO_REPLAY[key] = torch.zeros_like(own)
    return t


_GATHER_BUFFERS: dict[str, GatherBuffer] = {}


def gather_buffer(device) -> GatherBuffer:
    key = str(_device(device))  # one buffer per GPU, however the caller names it
    buf = _GATHER_BUFFERS.get(key)
    if buf is None:
        buf = _GATHER_BUFFERS[key] = GatherBuffer()
    return buf


def reserve_gather_buffer(nbytes: int, device) -> None:
    if enabled():
        gather_buffer(device).reserve(nbytes, device)


def prefill_kv(forward_context: Any, key: tuple | None, size: int, m: int, dim: int, device,
               fallback: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """The [size, m, dim] gather view of one prefill chunk, and whether its compressed rows
    [0, N) already hold what ``key`` (``gather_key``) names in this forward (then the caller
    gathers only its SWA rows). ``fallback()`` (vLLM's workspace view) is used, and False
    returned, when the feature is off, the layer has no compressed cache (``key`` None) or
    the chunk exceeds the buffer's bound; otherwise the caller must gather the compressed
    rows into the returned view, which then holds ``key``."""
    cache = step_cache(forward_context) if key is not None else None
    if cache is None:
        return fallback(), False
    buf = gather_buffer(device)
    kv = buf.view(size, m, dim, device)
    if kv is None:
        return fallback(), False
    held = (buf.generation, key)
    if cache.gather_holder == held:
        cache.count(GATHER, hit=True)
        if verify_enabled():
            # The caller gathers the compressed rows again over this copy's rows and then
            # calls verify_gather, which compares.
            cache.gather_snapshot = (key, kv.clone())
            return kv, False
        return kv, True
    cache.gather_holder = held
    cache.count(GATHER, hit=False)
    return kv, False


def verify_gather(forward_context: Any, kv: torch.Tensor, n: int) -> None:
    """After a layer gathered a chunk's compressed rows into a view that prefill_kv had
    already found holding them (only under DEEPINFER_YOCO_VERIFY=1): compare its rows
    [0, ``n``) (the chunk's N; rows past a request's own count are written by neither
    gather) with what they held before. A no-op otherwise."""
    cache = step_cache(forward_context)
    snap = None if cache is None else cache.gather_snapshot
    if snap is None:
        return
    cache.gather_snapshot = None
    key, before = snap
    _verified(GATHER, key, _tensors_equal(before[:, :n], kv[:, :n]))


def chunk_order(forward_context: Any, plan: list, key_of: Callable[[tuple], tuple | None]):
    """``plan`` with the chunk whose compressed rows the gather buffer holds first (a
    consumer layer then reuses them before its other chunks overwrite them); each chunk
    writes its own output rows, so the order changes no result."""
    cache = step_cache(forward_context)
    if cache is None or cache.gather_holder is None or len(plan) < 2:
        return plan
    held = cache.gather_holder[1]
    first = [c for c in plan if key_of(tuple(c)) == held]
    return first + [c for c in plan if key_of(tuple(c)) != held]


# ----------------------------------------------------------------------------- indexer K
@dataclasses.dataclass
class _IndexerKBuffer:
    values: torch.Tensor | None = None
    scales: torch.Tensor | None = None


_INDEXER_K: dict[str, _IndexerKBuffer] = {}


def _indexer_k_buffer(rows: int, like_values: torch.Tensor,
                      like_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    if rows > INDEXER_K_MAX_ROWS:
        return None
    key = str(like_values.device)
    buf = _INDEXER_K.setdefault(key, _IndexerKBuffer())
    v, s = buf.values, buf.scales
    if (v is None or v.shape[0] < rows or v.shape[1:] != like_values.shape[1:]
            or v.dtype != like_values.dtype or s.shape[1:] != like_scales.shape[1:]):
        cap = max(rows, 0 if v is None else v.shape[0])
        buf.values = v = like_values.new_empty((cap, *like_values.shape[1:]))
        buf.scales = s = like_scales.new_empty((cap, *like_scales.shape[1:]))
    return v[:rows], s[:rows]


def reserve_indexer_k(rows: int, values_spec, scales_spec, device) -> None:
    """Allocate the persistent indexer-K buffer in the memory-profiling run: ``*_spec`` are
    upstream's (shape, dtype) of the workspace gather (rows first)."""
    if not enabled():
        return
    n = min(int(rows), INDEXER_K_MAX_ROWS)
    if n <= 0:
        return
    (vshape, vdtype), (sshape, sdtype) = values_spec, scales_spec
    like_v = torch.empty((0, *vshape[1:]), dtype=vdtype, device=device)
    like_s = torch.empty((0, *sshape[1:]), dtype=sdtype, device=device)
    _indexer_k_buffer(n, like_v, like_s)


def indexer_k_rows(forward_context: Any, k_cache_prefix: str, chunk: Any,
                   k_quant: torch.Tensor, k_scale: torch.Tensor,
                   gather: Callable[[torch.Tensor, torch.Tensor], None], *, gathers: bool,
                   shareable: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The (values, scales) rows an indexer prefill chunk scores (patch 0041, in upstream's
    ``sparse_attn_indexer``); ``k_quant``/``k_scale`` are upstream's workspace views and
    ``gather(values, scales)`` is upstream's K gather into a pair of views.

    ``gathers`` False is a chunk that reads the previous chunk's gather (upstream's
    ``skip_kv_gather``: another query slice of the same requests, or nothing to gather).
    Index sources that share one KV source's index-K cache also share its metadata and
    chunk objects, so the second and later ones get the first one's rows back (key: the
    cache's prefix and the chunk). The rows live in a persistent buffer of their own
    (the workspace is rewritten by other layers in between); a gather wider than
    ``INDEXER_K_MAX_ROWS``, a non-shareable call (DCP/PCP, the caller decides) or the
    feature off gathers into the workspace exactly as upstream."""
    cache = step_cache(forward_context) if shareable else None
    own = None if cache is None else _indexer_k_buffer(k_quant.shape[0], k_quant, k_scale)
    if own is None:
        if cache is not None:
            cache.indexer_k_last = None
        if gathers:
            gather(k_quant, k_scale)
        return k_quant, k_scale
    if not gathers:
        # Upstream reads the workspace's first rows, where the previous chunk of this call
        # gathered; follow that gather wherever it went.
        return own if cache.indexer_k_last == "own" else (k_quant, k_scale)
    key = indexer_k_key(k_cache_prefix, chunk)
    cache.indexer_k_last = "own"
    if cache.indexer_k_holder == key:
        cache.count(INDEXER_K, hit=True)
        if verify_enabled():
            before = (own[0].clone(), own[1].clone())
            gather(*own)
            _verified(INDEXER_K, key, _tensors_equal(before, tuple(own)))
        return own
    gather(*own)
    cache.indexer_k_holder = key
    cache.count(INDEXER_K, hit=False)
    return own
