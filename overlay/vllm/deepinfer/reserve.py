"""Memory the Ampere path needs while serving, reserved before vLLM sizes the KV cache.

vLLM sizes the KV cache from what is free after its profile run (a forward of
``max_num_batched_tokens`` tokens without attention metadata: our layers take the
``attn_metadata is None`` branch of ``AmpereAttentionMixin.forward_mqa``). A buffer that is
allocated only while serving, and grows with the context, the batch or a CUDA graph's size,
is taken out of memory the KV cache already holds: a 1M-token request can then fail after
start-up. Every such buffer of this package is therefore either a view of vLLM's workspace
(``vllm.v1.worker.workspace``: one scratch per GPU that grows to the largest request of the
profile run and is locked once the CUDA graphs are captured) or a persistent buffer of our
own allocated in the profile run, and the profile run asks for each at its worst case:

=====================  ==========================  =========================================
buffer                 where                       worst case reserved (per GPU)
=====================  ==========================  =========================================
decode scratch         vLLM workspace, one         max over T = 1 .. T_dec of the launch's
(kernels/              ``get_simultaneous`` per    own request at T tokens (``decode_scratch``;
sparse_mla_decode)     launch                      its terms below)
indexer decode logits  vLLM workspace, after a     a(2^20) + R_idx * W * 4
(kernels/              1 MiB region left to the
indexer_logits)        decode top-k's own
                       workspace request
combined lists         persistent per-device       one per (kind, W_c) of the model's layers:
(kernels/topk_swa)     buffers (``CombineSlab``)   a(R_pre * W_c * 4) + R_pre * 4
=====================  ==========================  =========================================

with a(x) = round_up(x, 256) (vLLM aligns each view of one ``get_simultaneous`` call so), and

* T_dec = min(max_num_batched_tokens, max(max_num_seqs * (1 + k), G)): the decode tokens one
  forward hands a layer — max_num_seqs requests of 1 + k query tokens each (k speculative
  tokens), or a CUDA graph padded to its capture size (G the largest), never more than the
  step's budget (``Limits.decode_tokens``);
* decode scratch at T tokens, H heads, K = SWA width + top-k width keys per token (the dense
  index rows the decode's ragged lists are built from: T * K entries): the bf16 output
  a(T * H * 1024); with S > 1 split-K partials (S from the launch plan) 2 a(T * S * H * 4) +
  a(T * S * H * 2048); in the two-phase path (Ampere, T >= 4) a(T * K * 1024) + a(T * K);
* R_idx = max(T_dec, min(max_num_seqs, T_dec) * (1 + k)): rows of the indexer's decode
  logits (one per decode token, or the padded layout's requests x next_n), W = the
  indexer's ``max_model_len`` (max_model_len // compress ratio) fp32 columns
  (``Limits.indexer_decode_rows``);
* R_pre = max_num_batched_tokens (the prefill tokens of one step), W_c = round_up(top-k +
  window (+ V4's max_image_tokens), 128) (``topk_swa.combined_width``), kind "shared" for
  lists that cross-layer reuse (vllm.deepinfer.yoco) keeps alive through the forward and
  "own" for lists used by one layer only.

The workspace is shared with the prefill gather ([4, M, 512] bf16), upstream's indexer and
others: its size is the largest of all these requests, not their sum; the combined-list
buffers are additional. After vLLM locks its workspace (the end of ``capture_model``), a
request larger than what was reserved raises ``ReservationError`` naming the buffer, instead
of allocating; before that (tests, harnesses without a profile run) a missing reservation
means the kernels allocate as they always did. With ``enforce_eager`` (cudagraph mode NONE)
vLLM 0.33.0 never locks its workspace: a request past it would then grow it, as upstream's
own requests do; the reservations above are worst cases, so none should.

Every reservation call is idempotent: later dummy runs without attention metadata (CUDA-graph
warm-up, data-parallel padding) make the same requests, which fit.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Hashable, Sequence

import torch

logger = logging.getLogger("vllm.deepinfer")

__all__ = ["ReservationError", "Limits", "WORKSPACE_ALIGN", "RADIX_TOPK_BYTES", "aligned",
           "spec_bytes", "decode_scratch", "decode_scratch_worst", "reserve_decode_scratch",
           "decode_workspace", "indexer_logits_specs", "reserve_indexer_logits",
           "indexer_decode_logits", "CombineSlab", "combine_slab", "reserve_combined_lists",
           "combined_lists_out", "serving_locked", "reset_for_tests"]

# vLLM's WorkspaceManager.get_simultaneous starts every view at a multiple of 256 bytes
# (v1/worker/workspace.py): the bytes a set of views takes is the sum of these roundings.
WORKSPACE_ALIGN = 256
# The decode top-k (model_executor/layers/indexer_topk.py, ``cooperative``/``persistent``)
# asks the workspace for RADIX_TOPK_WORKSPACE_SIZE bytes (1 MiB in vLLM 0.33.0) while it
# reads the logits: they are placed after that many bytes so the two never overlap. Read
# from vLLM when it imports (``_radix_bytes``); this is the pinned version's value.
RADIX_TOPK_BYTES = 1024 * 1024

Spec = tuple[tuple[int, ...], torch.dtype]


class ReservationError(RuntimeError):
    """A serving-time request for a buffer larger than the profile run reserved."""


def aligned(nbytes: int) -> int:
    return -(-int(nbytes) // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def spec_bytes(specs: Sequence[Spec]) -> int:
    """The workspace bytes one ``get_simultaneous(*specs)`` takes."""
    return sum(aligned(_nbytes(s, d)) for s, d in specs)


# ----------------------------------------------------------------------------- limits
@dataclasses.dataclass(frozen=True)
class Limits:
    """The engine limits the worst cases are computed from."""
    max_num_batched_tokens: int
    max_num_seqs: int
    num_speculative_tokens: int = 0
    # The largest CUDA-graph capture size (0: no graphs).
    max_capture_size: int = 0
    max_model_len: int = 0
    # DSpark speculation widens the decode's SWA index rows (sparse_swa.py).
    dspark: bool = False

    @property
    def decode_tokens(self) -> int:
        """T_dec (module doc)."""
        per_step = self.max_num_seqs * (1 + self.num_speculative_tokens)
        return max(1, min(self.max_num_batched_tokens, max(per_step, self.max_capture_size)))

    @property
    def indexer_decode_rows(self) -> int:
        """R_idx (module doc): the unpadded layout has a row per decode token; the padded
        one (pack_seq) B requests x next_n rows, B <= min(max_num_seqs, T_dec) and next_n
        <= 1 + k."""
        t = self.decode_tokens
        return max(t, min(self.max_num_seqs, t) * (1 + self.num_speculative_tokens))

    @property
    def prefill_tokens(self) -> int:
        """R_pre (module doc)."""
        return self.max_num_batched_tokens

    @classmethod
    def from_vllm_config(cls, cfg: Any) -> "Limits":
        sched = cfg.scheduler_config
        spec = getattr(cfg, "speculative_config", None)
        k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
        dspark = False
        if spec is not None and callable(getattr(spec, "use_dspark", None)):
            dspark = bool(spec.use_dspark())
        comp = getattr(cfg, "compilation_config", None)
        sizes = [int(getattr(comp, "max_cudagraph_capture_size", 0) or 0)]
        for name in ("cudagraph_capture_sizes", "decoder_replay_cudagraph_capture_sizes"):
            sizes.extend(int(s) for s in (getattr(comp, name, None) or ()))
        model = getattr(cfg, "model_config", None)
        return cls(max_num_batched_tokens=int(sched.max_num_batched_tokens),
                   max_num_seqs=int(sched.max_num_seqs), num_speculative_tokens=k,
                   max_capture_size=max(sizes), dspark=dspark,
                   max_model_len=int(getattr(model, "max_model_len", 0) or 0))


# ----------------------------------------------------------------------------- vLLM's workspace
@functools.cache
def _workspace_module():
    try:
        from vllm.v1.worker import workspace
    except ImportError:  # the package without vLLM (CPU tests)
        return None
    return workspace


def _manager():
    ws = _workspace_module()
    if ws is None or not ws.is_workspace_manager_initialized():
        return None
    return ws.current_workspace_manager()


def serving_locked() -> bool:
    """Whether vLLM has locked its workspace (start-up is over: every reservation made)."""
    mgr = _manager()
    return mgr is not None and mgr.is_locked()


def _describe(specs: Sequence[Spec], names: Sequence[str] | None = None) -> str:
    names = names or [f"#{i}" for i in range(len(specs))]
    return ", ".join(f"{n} {list(s)} {str(d).removeprefix('torch.')}"
                     for n, (s, d) in zip(names, specs))


def _views(mgr, specs: Sequence[Spec], what: str) -> list[torch.Tensor]:
    """``mgr.get_simultaneous(*specs)``; after the lock, a request past the workspace's size
    raises ReservationError (vLLM's own AssertionError names only the calling frame)."""
    try:
        return mgr.get_simultaneous(*specs)
    except AssertionError as e:
        if not mgr.is_locked():
            raise
        raise ReservationError(
            f"{what}: {_describe(specs)} ({spec_bytes(specs)} bytes) is larger than what the "
            f"profile run reserved in vLLM's workspace ({e}); the worst case is computed from "
            "max_num_batched_tokens, max_num_seqs, the speculative tokens, the largest CUDA "
            "graph and max_model_len (vllm.deepinfer.reserve)") from e


@functools.cache
def _workspace_callable(mgr, what: str) -> Callable[[Sequence[Spec]], list[torch.Tensor]]:
    return lambda specs: _views(mgr, specs, what)


def decode_workspace(what: str = "sparse_mla_decode scratch"):
    """The ``workspace=`` argument of ``sparse_mla_decode.sparse_attn_decode`` for a served
    launch: views of vLLM's workspace, or None without a workspace manager (the launcher
    then allocates)."""
    mgr = _manager()
    return None if mgr is None else _workspace_callable(mgr, what)


# ----------------------------------------------------------------------------- decode scratch
def decode_scratch(variant: str, tokens: int, heads: int, keys_per_token: int,
                   sm_count: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """What one decode launch of ``tokens`` tokens x ``heads`` heads over ``keys_per_token``
    index entries per token asks of the workspace (the routed call: no ``out`` given), by the
    launcher's own plan (``sparse_mla_decode.select_tile`` and ``scratch_plan``)."""
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    name = smd.select_tile(variant, tokens)
    return smd.scratch_plan(name, tokens, heads, tokens * keys_per_token, sm_count)[2]


@functools.lru_cache(maxsize=256)
def _decode_worst(variant: str, max_tokens: int, heads: int, keys_per_token: int,
                  sm_count: int, tiles: tuple[str, ...]):
    best = (0, 0, [])
    for t in range(1, max_tokens + 1):
        specs = decode_scratch(variant, t, heads, keys_per_token, sm_count)
        n = spec_bytes([(s, d) for _, s, d in specs])
        if n > best[0]:
            best = (n, t, specs)
    return best


def decode_scratch_worst(variant: str, max_tokens: int, heads: int, keys_per_token: int,
                         sm_count: int):
    """(bytes, tokens, specs) of the largest ``decode_scratch`` over 1 .. ``max_tokens``
    tokens: the split count and the one- or two-phase row change with the batch, so every
    size is planned (host arithmetic only; cached per layer geometry and environment)."""
    from vllm.deepinfer.kernels import sparse_mla_decode as smd
    return _decode_worst(variant, int(max_tokens), int(heads), int(keys_per_token),
                         int(sm_count), smd.launch_tiles(variant))


def reserve_decode_scratch(limits: Limits, variant: str, heads: int, keys_per_token: int,
                           device: torch.device) -> int:
    """Profile run: grow vLLM's workspace to the decode's worst case (returns its bytes;
    0 without a workspace manager)."""
    from vllm.deepinfer import arch
    mgr = _manager()
    if mgr is None:
        return 0
    n, _, specs = decode_scratch_worst(variant, limits.decode_tokens, heads, keys_per_token,
                                       arch.sm_count(device))
    if specs:
        _views(mgr, [(s, d) for _, s, d in specs], "sparse_mla_decode scratch (profile run)")
    return n


# ----------------------------------------------------------------------------- indexer logits
@functools.cache
def _radix_bytes() -> int:
    try:
        from vllm.model_executor.layers.indexer_topk import RADIX_TOPK_WORKSPACE_SIZE
    except ImportError:
        return RADIX_TOPK_BYTES
    return int(RADIX_TOPK_WORKSPACE_SIZE)


def indexer_logits_specs(rows: int, width: int) -> list[Spec]:
    """One ``get_simultaneous`` call for the decode logits [rows, width] fp32: the first
    view is left to the decode top-k's own 1 MiB request (which lands at the workspace's
    start), the logits are the second."""
    return [((_radix_bytes(),), torch.uint8), ((int(rows), int(width)), torch.float32)]


def reserve_indexer_logits(limits: Limits, width: int, device: torch.device) -> int:
    """Profile run: grow vLLM's workspace to the indexer's worst-case decode logits
    (returns the bytes; 0 without a workspace manager)."""
    mgr = _manager()
    if mgr is None:
        return 0
    specs = indexer_logits_specs(limits.indexer_decode_rows, width)
    _views(mgr, specs, "indexer decode logits (profile run)")
    return spec_bytes(specs)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` name one GPU when the current device is 0 (torch.device
    equality compares the index, which a bare ``cuda`` lacks)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return a.index == b.index
    cur = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (cur if a.index is None else a.index) == (cur if b.index is None else b.index)


def indexer_decode_logits(rows: int, width: int, device: torch.device) -> torch.Tensor | None:
    """The ``out=`` of a served ``indexer_logits.paged_mqa_logits`` call: a [rows, width]
    fp32 view of vLLM's workspace, or None without a workspace manager (the launcher then
    allocates). Safe because upstream's decode branch holds no workspace view when it asks
    for the logits, and the only workspace request between them and their last read is the
    top-k's (the first view of ``indexer_logits_specs``)."""
    mgr = _manager()
    if mgr is None:
        return None
    views = _views(mgr, indexer_logits_specs(rows, width), "indexer decode logits")
    out = views[1]
    if not _same_device(out.device, torch.device(device)):
        raise ReservationError(f"indexer decode logits: vLLM's workspace is on {out.device}, "
                               f"the query on {device}")
    return out


# ----------------------------------------------------------------------------- combined lists
@dataclasses.dataclass
class CombineSlab:
    """The persistent buffer of one kind of combined (top-k + SWA) lists: room for ``rows``
    prefill tokens of up to ``width`` int32 columns, plus their lengths. A chunk of prefill
    tokens [qs, qe) takes indices ``flat[qs * w : qe * w]`` (w its own width <= ``width``)
    and lengths ``lens[qs:qe]``: the chunks of one step never overlap, so lists that
    cross-layer reuse keeps alive through the forward stay intact."""
    flat: torch.Tensor
    lens: torch.Tensor
    rows: int
    width: int

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * 4 + self.lens.numel() * 4


_SLABS: dict[tuple[str, str, int], CombineSlab] = {}
# The forward context attribute holding this forward's owners of the "shared" slabs.
_OWNERS_ATTR = "_deepinfer_combine_owners"
_WARNED: set = set()


def _dev(device) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def combine_slab(kind: str, width: int, device) -> CombineSlab | None:
    return _SLABS.get((_dev(device), kind, int(width)))


def reserve_combined_lists(kind: str, width: int, rows: int, device) -> int:
    """Profile run: allocate (or grow) the ``kind`` buffer for ``rows`` tokens of ``width``
    columns on ``device``; returns its bytes."""
    key = (_dev(device), kind, int(width))
    slab = _SLABS.get(key)
    if slab is None or slab.rows < rows:
        flat = torch.empty(int(rows) * int(width), dtype=torch.int32, device=device)
        lens = torch.empty(int(rows), dtype=torch.int32, device=device)
        slab = _SLABS[key] = CombineSlab(flat, lens, int(rows), int(width))
    return slab.nbytes


def _owner(key: tuple) -> tuple:
    """A combine key (yoco.combine_key) without its chunk: what one set of rows serves."""
    return key[:6] + key[7:]


def _int_tag(owner: tuple) -> int | None:
    tag = owner[1]
    return tag if isinstance(tag, int) and not isinstance(tag, bool) else None


def _warn_once(reason: str, key: Hashable | None = None) -> None:
    """Log ``reason`` the first time ``key`` (default: the reason) is met. The owners a
    reason names carry per-step object ids, so a reason alone would log every step: the
    v4-long engine at 3099bbc logged one such line 208 times in one run."""
    key = reason if key is None else key
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning("deepinfer: combined lists allocated outside their reservation: %s",
                       reason)


def _claim(forward_context: Any, slot: Hashable, owner: tuple, qs: int, qe: int) -> bool:
    """Whether ``owner`` may write rows [qs, qe) of a "shared" slab in this forward. A slab
    serves one owner at a time: a V4.1 index group (int tag) gives way to a later one
    (yoco drops the earlier group's lists when the next appears); any other second owner,
    and a second build of rows already built (DEEPINFER_YOCO_VERIFY's rebuild), is
    refused, and that build allocates as before."""
    if forward_context is None:
        return False
    owners = getattr(forward_context, _OWNERS_ATTR, None)
    if owners is None:
        owners = {}
        setattr(forward_context, _OWNERS_ATTR, owners)
    held = owners.get(slot)
    if held is not None and held[0] != owner:
        old, new = _int_tag(held[0]), _int_tag(owner)
        if old is None or new is None or new <= old:
            _warn_once(f"two live lists of one kind ({held[0][:5]} and {owner[:5]})",
                       key=("second owner", slot))
            return False
        held = None
    if held is None:
        held = owners[slot] = (owner, [])
    if any(qs < e and s < qe for s, e in held[1]):
        return False
    held[1].append((qs, qe))
    return True


def combined_lists_out(forward_context: Any, key: tuple | None, shared: bool,
                       slab_width: int, qs: int, qe: int, width: int, device):
    """The ``out=`` of one prefill chunk's combine: (indices [qe - qs, width], lens
    [qe - qs]) views of the reserved slab of its kind ("shared" when cross-layer reuse keeps
    the lists, ``key`` being their yoco key; "own" otherwise), or None where the kernels
    allocate as before: no reservation and vLLM's workspace not locked (no profile run),
    or a second live owner of a shared slab (logged once). With the workspace locked, a
    chunk the reservation does not hold raises ReservationError."""
    kind = "shared" if shared and key is not None else "own"
    slab = combine_slab(kind, slab_width, device)
    n = qe - qs
    if slab is None or qe > slab.rows or width > slab.width or n < 0:
        if serving_locked():
            have = "none" if slab is None else f"{slab.rows} tokens x {slab.width} columns"
            raise ReservationError(
                f"combined lists ({kind}, width {slab_width}): prefill tokens [{qs}, {qe}) x "
                f"{width} columns exceed the profile run's reservation ({have}); reserved "
                "for max_num_batched_tokens prefill tokens (vllm.deepinfer.reserve)")
        return None
    if kind == "shared" and not _claim(forward_context, (kind, slab_width), _owner(key), qs,
                                       qe):
        return None
    return slab.flat[qs * width: qe * width].view(n, width), slab.lens[qs:qe]


def reset_for_tests() -> None:
    _SLABS.clear()
    _WARNED.clear()
    _decode_worst.cache_clear()
    _workspace_callable.cache_clear()
    _workspace_module.cache_clear()
    _radix_bytes.cache_clear()
