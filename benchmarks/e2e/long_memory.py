"""Memory figures of the long step (run_long): the peak of one request against vLLM's budget,
the allocator's history of a request (DEEPINFER_LONG_MEMORY_TRACE) and what stays resident
after start-up, with the code that allocated it. torch is imported inside the functions."""
from __future__ import annotations

GIB = float(1 << 30)


# Segments the caching allocator created during one request, largest first, kept in its
# memory figures: what grew past the memory vLLM's profile run measured shows by size.
LONG_NEW_SEGMENTS = 8
# DEEPINFER_LONG_MEMORY_TRACE=<MiB>: record the allocator's history during the first timed
# request (torch.cuda.memory._record_memory_history, Python frames) and keep every
# allocation of at least that many MiB with the frames that made it ("memory_trace"): which
# code allocates past the budget. Off by default (it slows the request).
MEMORY_TRACE_ENV = "DEEPINFER_LONG_MEMORY_TRACE"
# DEEPINFER_LONG_RESIDENT_TRACE=<MiB>: record the history from before the engine is built
# until the warm-up requests end, not during the timed requests (their TTFTs stay
# unperturbed), and name the code of each resident block group of at least that many MiB
# after load and after the warm-up. DEEPINFER_LONG_MEMORY_TRACE implies it.
RESIDENT_TRACE_ENV = "DEEPINFER_LONG_RESIDENT_TRACE"
MEMORY_TRACE_FRAMES = 8


def _env_mib(name: str) -> float | None:
    import os
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        return float(v)
    except ValueError:
        raise SystemExit(f"{name}={v!r}: expected a size in MiB (e.g. 64)") from None


def memory_trace_mib() -> float | None:
    """DEEPINFER_LONG_MEMORY_TRACE in MiB: trace the first timed request (None: off)."""
    return _env_mib(MEMORY_TRACE_ENV)


def resident_trace_mib() -> float | None:
    """The smallest resident group to name from the start-up trace: DEEPINFER_LONG_RESIDENT_TRACE,
    else DEEPINFER_LONG_MEMORY_TRACE (None: no start-up trace)."""
    v = _env_mib(RESIDENT_TRACE_ENV)
    return v if v is not None else memory_trace_mib()


def trace_allocations(snapshot: dict, min_mib: float) -> list[dict]:
    """The allocations of at least ``min_mib`` MiB in a torch.cuda.memory._snapshot()'s
    device traces, largest first: size, whether it was freed within the trace, and the
    innermost frames that are not torch's own."""
    out = []
    for trace in snapshot.get("device_traces", []):
        freed = {e["addr"] for e in trace if e.get("action") == "free_completed"}
        for e in trace:
            if e.get("action") != "alloc" or e.get("size", 0) < min_mib * 2 ** 20:
                continue
            out.append(dict(mib=round(e["size"] / 2 ** 20, 1), freed=e["addr"] in freed,
                            frames=_frames(e)))
    return sorted(out, key=lambda a: -a["mib"])


def _frames(e: dict) -> list[str]:
    return [f"{'/'.join(f['filename'].split('/')[-3:])}:{f['line']} {f['name']}"
            for f in e.get("frames", []) if "/torch/" not in f["filename"]][:MEMORY_TRACE_FRAMES]


def start_resident_trace() -> bool:
    """DEEPINFER_LONG_RESIDENT_TRACE or DEEPINFER_LONG_MEMORY_TRACE set: record the
    allocator's history (Python frames) from before the engine is built, so that
    ``memory_checkpoint`` can say which code allocated the memory that stays resident after
    start-up. Returns whether it started."""
    if resident_trace_mib() is None:
        return False
    import torch
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    return True


def resident_blocks(snapshot: dict, min_mib: float) -> list[dict]:
    """The blocks allocated when the snapshot was taken, grouped by their innermost frames
    outside torch (the allocation's code), largest total first: count and MiB per group,
    groups under ``min_mib`` MiB in total left out. Blocks allocated before the history
    started have no frames (group [])."""
    groups: dict = {}
    for seg in snapshot.get("segments", []):
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            key = tuple(_frames(blk)[:4])
            g = groups.setdefault(key, [0, 0])
            g[0] += 1
            g[1] += blk.get("size", 0)
    out = [dict(mib=round(b / 2 ** 20, 1), count=n, frames=list(k))
           for k, (n, b) in groups.items() if b >= min_mib * 2 ** 20]
    return sorted(out, key=lambda g: -g["mib"])


# CU_LIMIT_STACK_SIZE of the CUDA driver API (cuda.h: CUlimit, 0x00).
_CU_LIMIT_STACK_SIZE = 0


def stack_limit_bytes(lib=None) -> int | None:
    """The current context's per-thread stack limit (cuCtxGetLimit(CU_LIMIT_STACK_SIZE)),
    None where the driver library or the call is unavailable. The driver raises this limit for
    a launch whose kernel needs more local memory than it allows and never lowers it again,
    and it backs the limit for every thread the device can hold: memory outside torch's pool
    that grows while serving (V4 at baa82d6: 2.45 GiB during the warm-up requests, both
    modes, benchmarks/results/h200-2026-12-03-e2e-long-baa82d6.json) is this reservation
    when the limit grew with it. ``lib``: a stand-in for libcuda in tests."""
    import ctypes
    try:
        lib = lib or ctypes.CDLL("libcuda.so.1")
        size = ctypes.c_size_t(0)
        rc = lib.cuCtxGetLimit(ctypes.byref(size), _CU_LIMIT_STACK_SIZE)
    except (OSError, AttributeError):
        return None
    return int(size.value) if rc == 0 else None


def local_memory_figures(stack: int | None, sms: int, threads_per_sm: int) -> dict:
    """The stack limit and what backing it for every resident thread takes
    (limit x threads per SM x SMs, GiB): an estimate of the driver's local-memory
    reservation, to set beside the memory outside torch's pool."""
    if stack is None or not sms or not threads_per_sm:
        return dict(stack_limit_bytes=stack, local_memory_estimate_gib=None)
    return dict(stack_limit_bytes=stack,
                local_memory_estimate_gib=stack * threads_per_sm * sms / GIB)


def memory_checkpoint(resident_mib: float | None = None, stop: bool = True) -> dict:
    """Torch's allocated and reserved memory and the memory outside torch's pool now (after
    releasing the allocator's unused blocks); with ``resident_mib`` also the resident blocks
    by allocating code (``resident_blocks``), after which the history recording stops unless
    ``stop`` is False (a later checkpoint takes it on)."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    out = dict(allocated_gib=torch.cuda.memory_allocated() / GIB,
               reserved_gib=torch.cuda.memory_reserved() / GIB,
               outside_torch_gib=(total - free - torch.cuda.memory_reserved()) / GIB)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    out.update(local_memory_figures(stack_limit_bytes(), props.multi_processor_count,
                                    getattr(props, "max_threads_per_multi_processor", None)))
    if resident_mib is not None:
        try:
            out["resident"] = resident_blocks(torch.cuda.memory._snapshot(), resident_mib)
        finally:
            if stop:
                torch.cuda.memory._record_memory_history(enabled=None)
    return out


def trace_peak(snapshot: dict, min_mib: float) -> dict | None:
    """The moment of the trace when the most bytes allocated inside it were live (blocks
    allocated before the trace started, the KV cache and the weights, are not counted), and
    the blocks of at least ``min_mib`` MiB live then, largest first, with their frames: what
    coexists at the request's activation peak, which the profile run must have reserved."""
    best = None
    for trace in snapshot.get("device_traces", []):
        live: dict = {}
        total = peak = 0
        at = None
        for i, e in enumerate(trace):
            act = e.get("action")
            if act == "alloc":
                live[e["addr"]] = e
                total += e.get("size", 0)
                if total > peak:
                    peak, at = total, i
            elif act == "free_completed" and e["addr"] in live:
                total -= live.pop(e["addr"]).get("size", 0)
        if at is None or (best is not None and peak <= best[0]):
            continue
        alive: dict = {}
        for e in trace[:at + 1]:
            if e.get("action") == "alloc":
                alive[e["addr"]] = e
            elif e.get("action") == "free_completed":
                alive.pop(e["addr"], None)
        big = sorted((e for e in alive.values() if e.get("size", 0) >= min_mib * 2 ** 20),
                     key=lambda e: -e["size"])
        best = (peak, dict(peak_mib=round(peak / 2 ** 20, 1), live_blocks=len(alive),
                           large=[dict(mib=round(e["size"] / 2 ** 20, 1), frames=_frames(e))
                                  for e in big]))
    return None if best is None else best[1]


def _segments() -> dict[int, int]:
    import torch
    return {s["address"]: s["total_size"] for s in torch.cuda.memory_snapshot()}


class _MemWindow:
    """Peak memory of one request: the caching allocator's unused blocks are released and the
    peaks reset before it, so each request's figures are its own whatever ran before. Also
    the memory outside torch's pool at its end (device used minus torch reserved: CUDA
    context, NCCL, cuBLAS workspaces), so that the device peak can be set against vLLM's
    budget (gpu_memory_utilization x total), and the largest segments created during it."""

    def __init__(self, trace_mib: float | None = None):
        self.trace_mib = trace_mib

    def __enter__(self):
        import torch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.figures: dict = {}
        if self.trace_mib is not None:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        try:
            self._before = _segments()
        except Exception:  # noqa: BLE001 - the segment list is a diagnostic
            self._before = None
        return self

    def __exit__(self, *exc):
        import torch
        try:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            self.figures = dict(peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                                peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                                device_used_gib=(total - free) / GIB,
                                outside_torch_gib=(total - free - torch.cuda.memory_reserved())
                                / GIB)
            if self._before is not None:
                new = sorted((size for a, size in _segments().items()
                              if a not in self._before), reverse=True)
                self.figures["new_segments_mib"] = [round(x / 2 ** 20, 1)
                                                    for x in new[:LONG_NEW_SEGMENTS]]
            if self.trace_mib is not None:
                snap = torch.cuda.memory._snapshot()
                self.figures["memory_trace"] = trace_allocations(snap, self.trace_mib)
                self.figures["memory_trace_peak"] = trace_peak(snap, self.trace_mib)
                torch.cuda.memory._record_memory_history(enabled=None)
        except Exception as e:  # noqa: BLE001 - a dead CUDA context: the error says why
            self.figures = dict(memory_error=f"{type(e).__name__}: {e}")
        return False
