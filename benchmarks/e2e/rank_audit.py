"""A vLLM worker extension (``worker_extension_cls="rank_audit.RankAudit"``) for engines of more
than one GPU: what each rank holds, and the sm_80 audit (audit.py) recorded inside each
worker process, where the model runs at TP > 1 or PP > 1.

run.py's ``--audit`` installs audit.Recorder in its own process, which at one GPU is the
worker's (VLLM_ENABLE_V1_MULTIPROCESSING=0 with the uniprocess executor); at TP 2 or PP 2 the
model runs in worker processes of vLLM's multiprocess executor, which that recorder never
sees. vLLM resolves the extension in every worker and calls ``init_worker_extension(worker)``
after the worker's ``init_device`` and before the model is built (v1/worker/worker_base.py),
so a Recorder installed there records the model's construction, vLLM's warmup and capture
("load"), then, switched by the driver through ``collective_rpc``, the served requests
("serve"). With ``E2E_RANK_AUDIT`` unset only ``deepinfer_rank_info`` answers.

Always (audit or not), counted per rank: every call of vLLM's
``PrefillRowShard.exchange_topk`` (model_executor/layers/sparse_attn_indexer.py) and the rows
it gathered, so a run says whether the prefill indexer's TP row shard executed at all; and
every call into the TP and PP groups' collective implementations (PyNCCL, the custom
all-reduce, torch symmetric memory, FlashInfer's all-reduce), split by whether the current
stream was capturing a CUDA graph: Python does not run at replay, so the "captured" counts
are the collectives inside the graphs, by implementation.

Methods (called as ``llm.collective_rpc("<name>")``; prefixed so they cannot collide with the
worker's own attributes, which vLLM asserts):
  deepinfer_rank_info         ranks, device, layer range and attention classes of this rank
  deepinfer_rank_counters     the row shard's exchanges and rows, the collectives' calls
  deepinfer_rank_audit_phase  set the recorder's phase ("serve", "after")
  deepinfer_rank_audit_check  audit.check of this rank's recorder (compiles each recorded
                              Triton kernel for sm_80 and sm_86: seconds to minutes)
The speculator's ``propose`` of this rank, if any, is recorded as the region "draft".
Standard library at import; vLLM and torch are imported inside the worker's calls.
"""
from __future__ import annotations

import collections
import contextlib
import os

ENV = "E2E_RANK_AUDIT"
_REC: list = []   # this process's Recorder (one worker per process)
_COUNTS: collections.Counter = collections.Counter()


def count_row_shard() -> bool:
    """Wrap PrefillRowShard.exchange_topk of this process to count its calls and rows."""
    try:
        from vllm.model_executor.layers import sparse_attn_indexer as sai
    except Exception:  # noqa: BLE001 - a vLLM without it: nothing to count
        return False
    cls = getattr(sai, "PrefillRowShard", None)
    if cls is None or getattr(cls.exchange_topk, "_deepinfer_counted", False):
        return cls is not None
    orig = cls.exchange_topk

    def exchange_topk(self, *a, **k):
        _COUNTS["row_shard_exchanges"] += 1
        _COUNTS["row_shard_rows"] += int(sum(self.sizes))
        return orig(self, *a, **k)
    exchange_topk._deepinfer_counted = True
    cls.exchange_topk = exchange_topk
    return True


def _recorder():
    return _REC[0] if _REC else None


def _wrap_propose(worker, rec) -> bool:
    spec = getattr(getattr(worker, "model_runner", None), "speculator", None)
    if spec is None or getattr(spec, "_deepinfer_rank_region", False):
        return False
    orig = spec.propose

    def propose(*a, **k):
        with rec.in_region("draft"):
            return orig(*a, **k)
    spec.propose = propose
    spec._deepinfer_rank_region = True
    return True


def _model(worker):
    runner = getattr(worker, "model_runner", None)
    return getattr(runner, "model", None)


def _layer_range(model) -> tuple[int, int] | None:
    """(start_layer, end_layer) of the first module that has them (vLLM's make_layers)."""
    if model is None:
        return None
    for mod in model.modules():
        if hasattr(mod, "start_layer") and hasattr(mod, "end_layer"):
            return int(mod.start_layer), int(mod.end_layer)
    return None


# The collective implementations of vLLM's CudaCommunicator and the methods counted.
COLLECTIVES = (("pynccl", "pynccl_comm", ("all_reduce", "all_gather", "all_gatherv",
                                          "reduce_scatter", "reduce_scatterv", "send", "recv",
                                          "broadcast")),
               ("custom_ar", "ca_comm", ("custom_all_reduce",)),
               ("symm_mem", "symm_mem_comm", ("all_reduce",)),
               ("flashinfer_ar", "fi_ar_comm", ("all_reduce",)))


def _groups():
    try:
        from vllm.distributed import parallel_state as ps
    except Exception:  # noqa: BLE001
        return []
    out = []
    for name, get in (("tp", ps.get_tp_group), ("pp", ps.get_pp_group)):
        try:
            out.append((name, get()))
        except Exception:  # noqa: BLE001 - not initialized
            continue
    return out


def count_collectives() -> list[str]:
    """Wrap the collective methods of this process's TP and PP communicators (see the module
    docstring); returns what was wrapped."""
    import torch

    def counting(f, key):
        def wrapper(*a, **k):
            try:
                cap = torch.cuda.is_current_stream_capturing()
            except RuntimeError:   # a torch without CUDA
                cap = False
            _COUNTS[f"{key}.{'captured' if cap else 'eager'}"] += 1
            return f(*a, **k)
        wrapper._deepinfer_counted = True
        return wrapper
    done = []
    for gname, g in _groups():
        dc = getattr(g, "device_communicator", None)
        for impl, attr, methods in COLLECTIVES:
            obj = getattr(dc, attr, None)
            for m in methods if obj is not None else ():
                f = getattr(obj, m, None)
                if f is None or getattr(f, "_deepinfer_counted", False):
                    continue
                setattr(obj, m, counting(f, f"{gname}.{impl}.{m}"))
                done.append(f"{gname}.{impl}.{m}")
    return done


def collectives_state() -> dict:
    """Per group: which implementations exist and are enabled (and the custom all-reduce's
    size limit and link), the NCCL version torch reports."""
    out: dict = {}
    for gname, g in _groups():
        dc = getattr(g, "device_communicator", None)
        st = dict(world_size=getattr(g, "world_size", None))
        for impl, attr, _ in COLLECTIVES:
            obj = getattr(dc, attr, None)
            if obj is None:
                continue
            st[impl] = dict(disabled=bool(getattr(obj, "disabled", False)))
            for k in ("max_size", "fully_connected"):
                if hasattr(obj, k):
                    st[impl][k] = getattr(obj, k)
        out[gname] = st
    try:
        import torch
        out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        out["nccl_version_error"] = f"{type(e).__name__}: {e}"
    return out


class RankAudit:
    @staticmethod
    def init_worker_extension(worker) -> None:
        count_row_shard()
        _COUNTS.setdefault("collectives_wrapped", len(count_collectives()))
        if os.environ.get(ENV) != "1" or _REC:
            return
        from audit import Recorder
        _REC.append(Recorder().install())

    def deepinfer_rank_info(self) -> dict:
        out: dict = dict(rank=getattr(self, "rank", None), local_rank=getattr(self, "local_rank", None),
                         pid=os.getpid(), audit=_recorder() is not None)
        try:
            from vllm.distributed import parallel_state as ps
            out.update(tp_rank=ps.get_tensor_model_parallel_rank(),
                       tp_size=ps.get_tensor_model_parallel_world_size(),
                       pp_rank=ps.get_pp_group().rank_in_group,
                       pp_size=ps.get_pp_group().world_size)
        except Exception as e:  # noqa: BLE001 - reported
            out["parallel_error"] = f"{type(e).__name__}: {e}"
        try:
            import torch
            out["device"] = torch.cuda.get_device_name(torch.cuda.current_device())
        except Exception as e:  # noqa: BLE001
            out["device_error"] = f"{type(e).__name__}: {e}"
        model = _model(self)
        rng = _layer_range(model)
        out["layers"] = list(rng) if rng else None
        kinds: collections.Counter = collections.Counter()
        if model is not None:
            for name, mod in model.named_modules():
                if "Attention" in type(mod).__name__ and name.endswith(".attn"):
                    kinds[type(mod).__name__] += 1
        out["attention_classes"] = dict(kinds)
        out["collectives"] = collectives_state()
        rec = _recorder()
        if rec is not None:
            out["draft_region"] = _wrap_propose(self, rec)
        return out

    def deepinfer_rank_counters(self) -> dict:
        return dict(_COUNTS)

    def deepinfer_rank_audit_phase(self, phase: str) -> str | None:
        rec = _recorder()
        if rec is None:
            return None
        rec.phase = phase
        return phase

    def deepinfer_rank_audit_check(self) -> dict | None:
        rec = _recorder()
        if rec is None:
            return None
        from audit import check
        with contextlib.suppress(Exception):
            rec.phase = "after"
        return check(rec)
