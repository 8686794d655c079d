"""How vLLM 0.33.0 packs a model's KV caches into one block pool, re-derived for the planner:
the block size the backends resolve, every cache's spec (page bytes, stride alignment), the
cache groups of the block-outermost packing, the bytes of one pool block, the blocks one
request reserves, and the "GPU KV cache size: N tokens" figure vLLM logs.

The rules, each from the upstream function it restates (files relative to ``vllm/``):

* block size (platforms/interface.py ``_preferred_block_size_for_backends``): 16 if every
  attention backend accepts it, else the smallest LCM of one declared size per backend that
  every backend accepts (a size is accepted when it is a multiple of a declared one). The
  V4.1 compressed-KV and indexer-K backends declare a fixed page each, the sliding-window
  backend multiples of 32, the compressor multiples of 1;
* the spec of a compressed or indexer cache gets ``block_stride_alignment =
  MultipleOf(its backend's page)`` (v1/worker/utils.py ``customize_attention_spec``); when
  that page is smaller than the block, the pool block must be a multiple of the cache's
  page at the backend's page (``KVCacheSpec.get_block_stride_alignment``);
* packing (v1/core/kv_cache_planning.py ``_get_packed_kv_cache_groups``, the BLHNC layout
  the V4 backends declare): caches of one type (full; sliding window of one width; ring)
  and block size form a bucket; a bucket is balanced when each of its page sizes has the
  same number of caches. If some balanced bucket mixes page sizes, every balanced bucket is
  split into groups of R pattern repeats, R between the largest such bucket's repeat count
  and the largest count, chosen to pad least (``_approximate_gcd``); the widest group sets
  the anchor, and ring buckets (and sliding-window ones when nothing is split by repeats)
  are split into as many groups as needed for each to fit in the anchor;
* one pool block holds every group's pages side by side: its bytes are the widest group's,
  rounded up to the LCM of every cache's stride alignment (``_get_kv_cache_bytes_per_block``);
  every group draws its blocks from the pool, so a narrower group's block is padded;
* a request reserves, per group, ceil(max_model_len / block) blocks (full), ceil(min(window
  - 1 + in-flight tokens, max_model_len) / block) + 1 (sliding window) or 1 (ring)
  (``max_memory_usage_bytes`` of the specs, ``get_max_concurrency_for_kv_cache_config``);
  vLLM logs int(num_blocks / blocks per request x max_model_len) tokens
  (v1/core/kv_cache_utils.py ``get_kv_cache_capacity``), num_blocks = available // block
  bytes (the smallest over pipeline stages).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from .errors import PlannerInputError
from .layers import Layer
from .sizes import cdiv, round_up

# vLLM's CacheConfig.DEFAULT_BLOCK_SIZE (config/cache.py): the block size if every backend
# takes it.
DEFAULT_BLOCK_SIZE = 16
# Kernel pages upstream declares: V4 sparse MLA and V4 indexer 256 tokens
# (models/deepseek_v4/sparse_mla.py, v1/attention/backends/mla/indexer.py
# DeepseekV4IndexerBackend); V4.1's 64 on SM90 and 128 elsewhere
# (models/deepseek_v41/sparse_mla.py, DeepseekV41IndexerBackend).
V4_KERNEL_PAGE = 256
V41_KERNEL_PAGE_SM90 = 64
V41_KERNEL_PAGE_OFF_SM90 = 128
# The sliding-window backend takes any multiple of 32 tokens, the compressor any size
# (v1/attention/backends/mla/sparse_swa.py DeepseekSparseSWABackend, the compressors'
# CompressorBackend).
SWA_KERNEL_MULTIPLE = 32


class MultipleOf(NamedTuple):
    """A backend's "any multiple of ``base``" kernel block size (vLLM's MultipleOf)."""
    base: int


def _accepts(sizes, block: int) -> bool:
    return any(block % (s.base if isinstance(s, MultipleOf) else s) == 0 for s in sizes)


def resolve_block_size(backend_sizes: list[list]) -> int:
    """cache_config.block_size from the attention backends' declared kernel block sizes
    (a list per backend; module doc)."""
    if all(_accepts(sizes, DEFAULT_BLOCK_SIZE) for sizes in backend_sizes):
        return DEFAULT_BLOCK_SIZE
    bases = [[s.base if isinstance(s, MultipleOf) else s for s in sizes] or [1]
             for sizes in backend_sizes]
    candidates = {1}
    for options in bases:
        candidates = {math.lcm(c, o) for c in candidates for o in options}
    for block in sorted(candidates):
        if all(_accepts(sizes, block) for sizes in backend_sizes):
            return block
    raise PlannerInputError("paging", f"the backends share no block size: {backend_sizes}")


# --------------------------------------------------------------------------------------
# Serving paths: the kernel pages their backends declare
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Paging:
    """The V4.1 kernel pages of one serving path's compressed-KV and indexer-K backends
    (V4 takes 256 for both on every path)."""

    name: str
    v41_kv_page: int
    v41_indexer_page: int
    note: str = ""

    def backend_sizes(self, family: str) -> list[list]:
        if family == "v4":
            kv = idx = V4_KERNEL_PAGE
        else:
            kv, idx = self.v41_kv_page, self.v41_indexer_page
        return [[kv], [idx], [MultipleOf(SWA_KERNEL_MULTIPLE)], [MultipleOf(1)]]

    def kernel_page(self, family: str, indexer: bool) -> int:
        if family == "v4":
            return V4_KERNEL_PAGE
        return self.v41_indexer_page if indexer else self.v41_kv_page


# The pages of the Ampere V4.1 path as the tree has it (feature kv_page64, on by default
# since 934a453; attention/ampere_v41.py, envs.py): its compressed-KV backend and its index-K
# backend (DeepinferAmpereV41IndexerBackend) both declare 64 tokens, so the block resolves
# to 64 and vLLM packs the caches exactly as upstream's SM90 classes
# (tests/test_kv_planner_vllm.py, vLLM's own packing).
AMPERE_PAGE = 64

PAGINGS: dict[str, Paging] = {p.name: p for p in (
    Paging("ampere", AMPERE_PAGE, AMPERE_PAGE,
           "Ampere V4.1 path as the tree has it (934a453, kv_page64 on): compressed KV and "
           "index K both 64 tokens, packed as upstream's SM90 layout"),
    Paging("ampere-128", V41_KERNEL_PAGE_OFF_SM90, V41_KERNEL_PAGE_OFF_SM90,
           "Ampere V4.1 path with DEEPINFER_KV_PAGE64=0: upstream's 128-token pages off SM90"),
    # A what-if, no longer any path's default: the compressed page alone at 64 with the
    # index-K backend at upstream's 128 (the tree from 7f9e907 to 8213d15). The block
    # resolves to 128 and the 64-token kernel pages inside it pad the pool block to the LCM
    # of the compressed caches' 64-token page strides.
    Paging("ampere-64-idx128", AMPERE_PAGE, V41_KERNEL_PAGE_OFF_SM90,
           "what-if: the compressed page alone at 64, index K at 128 (7f9e907..8213d15); "
           "the pool block pads to the LCM of the 64-token page strides"),
    Paging("upstream-sm90", V41_KERNEL_PAGE_SM90, V41_KERNEL_PAGE_SM90,
           "upstream's FlashMLA classes on SM90"),
)}


def paging_for(path: str, page: int | None = None, indexer_page: int | None = None) -> Paging:
    """The paging of ``path`` (ampere | upstream-sm90 | a PAGINGS key); for ``ampere``,
    ``page`` is the compressed-KV page (default the tree's 64; 128 is DEEPINFER_KV_PAGE64=0)
    and ``indexer_page`` the index-K page (default ``page``: the path asks one page for
    both caches; 64 with 128 is the ``ampere-64-idx128`` what-if)."""
    if path in PAGINGS and path != "ampere":
        p = PAGINGS[path]
        if page not in (None, p.v41_kv_page) or indexer_page not in (None, p.v41_indexer_page):
            raise PlannerInputError("page", f"{path} declares pages {p.v41_kv_page}/"
                                    f"{p.v41_indexer_page}; got {page}/{indexer_page}")
        return p
    if path != "ampere":
        raise PlannerInputError("path", f"unknown path {path!r}; expected ampere, "
                                f"{', '.join(k for k in PAGINGS if k != 'ampere')}")
    kv = AMPERE_PAGE if page is None else page
    idx = kv if indexer_page is None else indexer_page
    for v, what in ((kv, "page"), (idx, "indexer_page")):
        if v <= 0 or v % SWA_KERNEL_MULTIPLE:
            raise PlannerInputError(what, f"must be a positive multiple of {SWA_KERNEL_MULTIPLE}, got {v}")
    named = next((p for p in PAGINGS.values() if p.name.startswith("ampere")
                  and (p.v41_kv_page, p.v41_indexer_page) == (kv, idx)), None)
    return named or Paging(f"ampere-{kv}-idx{idx}", kv, idx, "Ampere V4.1 path, pages as given")


# --------------------------------------------------------------------------------------
# Specs
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheSpec:
    """One cache as vLLM specs it. kind: "full" (MLAAttentionSpec), "window"
    (SlidingWindowMLASpec) or "ring" (CircularBufferSpec); ``kernel_page`` is the
    MultipleOf(...) stride alignment ``customize_attention_spec`` gives it (None: none)."""

    name: str
    kind: str
    block_size: int
    state_bytes: int
    tokens_per_state: int = 1
    alignment: int | None = None
    window: int = 0
    kernel_page: int | None = None

    def page_bytes_at(self, block: int) -> int:
        raw = block // self.tokens_per_state * self.state_bytes
        return round_up(raw, self.alignment) if self.alignment else raw

    @property
    def page_bytes(self) -> int:
        return self.page_bytes_at(self.block_size)

    @property
    def stride_alignment(self) -> int:
        if self.kernel_page is None:
            return 1
        k = math.gcd(self.kernel_page, self.block_size)
        return 1 if k == self.block_size else self.page_bytes_at(k)

    @property
    def type_key(self) -> tuple:
        """Caches with one key share a bucket (UniformTypeKVCacheSpecs.is_uniform_type)."""
        return (self.kind, self.block_size, self.window if self.kind == "window" else 0)

    def pages_per_request(self, max_model_len: int, in_flight: int) -> int:
        if self.kind == "full":
            return cdiv(max_model_len, self.block_size)
        if self.kind == "window":
            return cdiv(min(self.window - 1 + in_flight, max_model_len), self.block_size) + 1
        return 1


def served_specs(layers: list[Layer], family: str, paging: Paging,
                 prefix: str = "") -> tuple[int, list[CacheSpec]]:
    """(block size, specs) of a stack served with ``paging``: context caches take the
    resolved block and their backend's kernel page; windows and rings keep their own
    blocks (layers.py)."""
    block = resolve_block_size(paging.backend_sizes(family))
    specs = []
    for layer in layers:
        for c in layer.caches:
            name = f"{prefix}{layer.index}.{c.name}"
            if c.growth == "context":
                specs.append(CacheSpec(name, "full", block, c.record_bytes, c.tokens_per_state,
                                       c.alignment, kernel_page=paging.kernel_page(
                                           family, c.name.endswith(".indexer"))))
            elif c.growth == "window":
                specs.append(CacheSpec(name, "window", c.block_tokens, c.record_bytes, 1,
                                       c.alignment, window=c.window))
            else:
                specs.append(CacheSpec(name, "ring", c.rows, c.record_bytes, 1, c.alignment))
    return block, specs


# --------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    specs: tuple[CacheSpec, ...]

    @property
    def block_size(self) -> int:
        return self.specs[0].block_size

    @property
    def kind(self) -> str:
        return self.specs[0].kind

    def page_bytes(self, names: frozenset | None = None) -> int:
        return sum(s.page_bytes for s in self.specs if names is None or s.name in names)

    def pages_per_request(self, max_model_len: int, in_flight: int) -> int:
        return max(s.pages_per_request(max_model_len, in_flight) for s in self.specs)


@dataclass(frozen=True)
class Packing:
    groups: tuple[Group, ...]

    @property
    def specs(self) -> list[CacheSpec]:
        return [s for g in self.groups for s in g.specs]

    def bytes_per_block(self, names=None) -> int:
        """One pool block on a worker holding the caches ``names`` (all: None)."""
        names = None if names is None else frozenset(names)
        widest = max(g.page_bytes(names) for g in self.groups)
        held = [s for s in self.specs if names is None or s.name in names]
        return round_up(widest, math.lcm(*(s.stride_alignment for s in held))) if held else 0

    def blocks_per_request(self, max_model_len: int, in_flight: int) -> int:
        return sum(g.pages_per_request(max_model_len, in_flight) for g in self.groups)


def approximate_gcd(values: list[int], lower: int) -> int:
    """The repeat count R in [lower, max(values)] padding ``values`` up to multiples of R
    least; ties go to the larger R (the rule of ``_approximate_gcd``)."""
    best, best_pad = max(1, lower), None
    for d in range(max(1, lower), max(values) + 1):
        pad = sum(-x % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def pack(specs: list[CacheSpec]) -> Packing:
    """The cache groups of the block-outermost packing (module doc)."""
    if len({s.page_bytes for s in specs}) <= 1:
        raise PlannerInputError("specs", "one page size for every cache: vLLM groups these "
                                "without packing (not modelled here)")
    buckets: dict[tuple, list[CacheSpec]] = {}
    for s in specs:
        buckets.setdefault(s.type_key, []).append(s)
    info = []
    for members in buckets.values():
        by_page: dict[int, list[CacheSpec]] = {}
        for s in members:
            by_page.setdefault(s.page_bytes, []).append(s)
        balanced = len({len(v) for v in by_page.values()}) == 1
        info.append((members, by_page, balanced, max(len(v) for v in by_page.values())))
    floor = max((n for _, by_page, bal, n in info if bal and len(by_page) > 1), default=0)
    repeats = approximate_gcd([n for _, _, bal, n in info if bal], floor) if floor else None

    def is_state(members) -> bool:
        return members[0].kind == "ring" or (repeats is None and members[0].kind == "window")

    def n_groups(balanced: bool, n: int) -> int:
        return cdiv(n, repeats) if balanced and repeats else 1

    anchor = max(sum(cdiv(len(v), len(m) if is_state(m) else n_groups(bal, n)) * page
                     for page, v in by_page.items()) for m, by_page, bal, n in info)
    groups = []
    for members, by_page, balanced, n in info:
        count = n_groups(balanced, n)
        if is_state(members):
            fit = max(anchor // members[0].page_bytes, 1)
            count = max(count, cdiv(len(members), fit))
        if count == 1:
            groups.append(Group(tuple(members)))
            continue
        pattern = list(zip(*by_page.values()))
        for i in range(count):
            groups.append(Group(tuple(s for rep in pattern[i::count] for s in rep)))
    return Packing(tuple(groups))


# --------------------------------------------------------------------------------------
# Capacity
# --------------------------------------------------------------------------------------
# Concurrent batches of one engine: async scheduling (on by default, config/vllm.py) keeps
# two in flight on one pipeline stage; with PP the V1 model runner turns it off and keeps
# pp (VllmConfig.max_concurrent_batches).
ASYNC_BATCHES = 2


def in_flight_tokens(max_num_batched_tokens: int, pp: int = 1) -> int:
    """VllmConfig.max_in_flight_tokens of the default engine."""
    return (ASYNC_BATCHES if pp == 1 else pp) * max_num_batched_tokens


@dataclass(frozen=True)
class Capacity:
    bytes_per_block: int
    num_blocks: int
    blocks_per_request: int
    concurrency: float
    tokens: int          # what vLLM logs as "GPU KV cache size"


def capacity(packing: Packing, kv_bytes: list[int], max_model_len: int, in_flight: int,
             stage_names: list | None = None) -> Capacity:
    """vLLM's KV capacity for the memory each worker has for KV (``kv_bytes``, one entry
    per pipeline stage; ``stage_names`` the cache names each holds, None: all)."""
    names = stage_names or [None] * len(kv_bytes)
    if len(names) != len(kv_bytes):
        raise PlannerInputError("kv_bytes", f"{len(kv_bytes)} stages' memory, {len(names)} stages")
    per = [packing.bytes_per_block(n) for n in names]
    if not any(per):
        raise PlannerInputError("stage_names", "no stage holds a cache")
    num_blocks = min(int(b) // p for b, p in zip(kv_bytes, per) if p)
    blocks = packing.blocks_per_request(max_model_len, in_flight)
    conc = num_blocks / blocks
    return Capacity(max(per), num_blocks, blocks, conc, int(conc * max_model_len))
