"""Probe of patch 0041's candidate route: upstream's ``sparse_attn_indexer`` (the PATCHED
tree) for a V4.1 index source masked to candidate blocks, prefill and decode, with the
candidate_logits feature on and off. Run by tests/test_candidate_logits.py in a subprocess:

    CUDA_VISIBLE_DEVICES= PYTHONPATH=<patched tree> python tests/candidate_logits_probe.py

and prints one JSON object (the last stdout line). Our package is taken from overlay/ (put
first on ``vllm.__path__``), the upstream file from the tree. CPU stand-ins replace what
cannot run here: the C++ K gather and top-k ops (torch versions that record what the top-k
was given) and the CUDA assertion of ``apply_candidate_mask`` (its two Triton kernels,
extracted from the pinned sdist, launched as it launches them). The logits are ours
through patch 0015 (off) or the candidate route (on), under the interpreter, sm80.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("DEEPINFER_BUILD", REPO / "build"))
TOPK, HEADS, PAGE, CBS, NCAND = 16, 4, 16, 8, 5


def _setup():
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["DEEPINFER_ARCH"] = "sm80"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(BUILD))
    import interp_dot   # one summation order per dot whatever the tile (tests/interp_dot.py)
    interp_dot.patch(setattr)
    import torch
    import vllm
    vllm.__path__.insert(0, str(REPO / "overlay" / "vllm"))
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.worker.workspace import init_workspace_manager

    from vllm_probe_common import cpu_platform, dist_init
    cpu_platform()
    dist_init(tempfile.mkdtemp(prefix="deepinfer-cand-probe-"),
              VllmConfig(device_config=DeviceConfig(device="cpu")))
    init_workspace_manager(torch.device("cpu"))


def _cache(g, ctx_lens):
    """An index-K cache holding each request's keys, and its block table."""
    import torch
    pages = [-(-n // PAGE) for n in ctx_lens]
    num = sum(pages) + 1
    b = torch.randint(0, 256, (num, PAGE * 132), generator=g, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)
    sc = torch.exp2(torch.randint(-6, 3, (num, PAGE), generator=g).float())
    b[:, PAGE * 128:] = sc.view(torch.uint8).view(num, -1)
    table = torch.zeros(len(ctx_lens), max(pages), dtype=torch.int32)
    perm = torch.randperm(num, generator=g).to(torch.int32)
    used = 0
    for r, p in enumerate(pages):
        table[r, :p] = perm[used:used + p]
        used += p
    return b.view(num, PAGE, 132), table


def _candidates(g, rows, lens):
    import torch
    cand = torch.full((rows, NCAND), -1, dtype=torch.int32)
    for r, n in enumerate(lens):
        nb = -(-n // CBS)
        pick = torch.randperm(nb, generator=g)[: NCAND - 1].to(torch.int32)
        cand[r, : pick.numel()] = pick
    return cand


class _Stubs:
    """The C++ ops and the CUDA-only mask, replaced for the run; records what ran."""

    def __init__(self, sai):
        import torch
        self.sai, self.calls, self.seen = sai, {"mask": 0, "route": 0}, []
        self.saved = [(sai.ops, "cp_gather_indexer_k_quant_cache"),
                      (sai.ops, "top_k_per_row_prefill"), (sai.ops, "top_k_per_row_decode"),
                      (sai, "_apply_candidate_mask")]
        self.old = [getattr(o, a) for o, a in self.saved]
        uk = importlib.import_module("upstream_kernels.dsa_candidate_blocks")

        def gather(kv_cache, k_quant, k_scale, block_table, cu_seq_lens):
            n = k_quant.shape[0]
            rows = kv_cache[block_table[0].long()].reshape(-1, PAGE * 132)
            codes = rows[:, : PAGE * 128].reshape(-1, 128)[:n]
            scales = rows[:, PAGE * 128:].reshape(-1, 4)[:n]
            k_quant.view(torch.uint8).copy_(codes)
            k_scale.view(torch.uint8).view(-1, 4).copy_(scales)

        def record(logits, ends, out, k):
            self.seen.append((logits.clone(), [int(e) for e in ends]))
            for r, e in enumerate(ends):
                e = int(e)
                sel = (list(range(e)) if e <= k else
                       torch.sort(logits[r, :e], descending=True, stable=True).indices[:k]
                       .tolist())
                out[r].fill_(-1)
                out[r, : len(sel)] = torch.tensor(sel, dtype=torch.int32)

        def topk_prefill(logits, starts, ends, out, rows, s0, s1, k):
            record(logits, ends.tolist(), out, k)

        def topk_decode(logits, next_n, seq_lens, out, rows, s0, s1, k):
            lens = seq_lens.reshape(-1).tolist()
            if len(lens) != rows:
                lens = [max(0, lens[r // next_n] - next_n + 1 + r % next_n) for r in range(rows)]
            record(logits, lens, out, k)

        def mask(logits, row_ks, row_ke, candidates, block_size, row_repeat=1):
            import triton
            self.calls["mask"] += 1
            rows, width = logits.shape
            nblocks = triton.cdiv(width, block_size)
            flags = torch.empty((rows, nblocks + 1), dtype=torch.uint8)
            uk._candidate_flags_kernel[(rows,)](
                candidates, None, flags, *candidates.stride(), 0, width, nblocks, block_size,
                candidates.shape[1], False, row_repeat)
            uk._mask_candidates_kernel[(rows, triton.cdiv(width, 1024))](
                logits, None, row_ke, flags, *logits.stride(), 0, row_ke.stride(0), width,
                nblocks, block_size, False, row_repeat, 1024)

        self.new = [gather, topk_prefill, topk_decode, mask]

    def __enter__(self):
        from vllm.deepinfer import routing
        for (o, a), v in zip(self.saved, self.new):
            setattr(o, a, v)
        self.routing = routing
        self.route_old = (routing.candidate_mqa_logits, routing.candidate_paged_mqa_logits)

        def counted(fn):
            def wrapper(*a, **k):
                out = fn(*a, **k)
                self.calls["route"] += out is not None
                return out
            return wrapper
        routing.candidate_mqa_logits = counted(self.route_old[0])
        routing.candidate_paged_mqa_logits = counted(self.route_old[1])
        return self

    def __exit__(self, *exc):
        for (o, a), v in zip(self.saved, self.old):
            setattr(o, a, v)
        self.routing.candidate_mqa_logits, self.routing.candidate_paged_mqa_logits = \
            self.route_old


def _run(kind: str, on: bool) -> dict:
    import torch
    from vllm.deepinfer import routing
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerMetadata, DeepseekV32IndexerPrefillChunkMetadata,
        DeepseekV32IndexerPrefillMetadata, DeepSeekV32IndexerDecodeMetadata)
    os.environ["DEEPINFER_CANDIDATE_LOGITS"] = "1" if on else "0"
    routing.reset()
    g = torch.Generator().manual_seed(11)
    i32 = dict(dtype=torch.int32)
    prefix = "model.layers.5.attn.indexer.k_cache"
    if kind == "prefill":
        ctx_len, q_len = 70, 6   # one request: rows see 65..70 keys
        cache, table = _cache(g, [ctx_len])
        ke = torch.arange(ctx_len - q_len + 1, ctx_len + 1, **i32)
        chunk = DeepseekV32IndexerPrefillChunkMetadata(
            block_table=table, cu_seqlen_ks=torch.zeros(q_len, **i32), cu_seqlen_ke=ke,
            cu_seq_lens=torch.tensor([0, ctx_len], **i32),
            token_to_seq=torch.zeros(q_len, **i32), total_seq_lens=ctx_len,
            max_seqlen_k=ctx_len, token_start=0, token_end=q_len, num_reqs=1,
            skip_kv_gather=False, local_cu_seq_lens=torch.tensor([0, ctx_len], **i32),
            local_total_seq_lens=ctx_len, max_local_total_seq_lens=ctx_len)
        md = DeepseekV32IndexerMetadata(
            seq_lens=torch.tensor([ctx_len], **i32), max_seq_len=ctx_len,
            slot_mapping=torch.zeros(q_len, dtype=torch.int64), num_decodes=0,
            num_decode_tokens=0, num_prefills=1, num_prefill_tokens=q_len,
            prefill=DeepseekV32IndexerPrefillMetadata(chunks=[chunk]))
        rows, lens = q_len, ke.tolist()
    else:
        ctx_lens, next_n = [23, 61], 2   # native MTP rows: seq_lens [B, next_n]
        cache, table = _cache(g, ctx_lens)
        seq = torch.tensor([[n - next_n + 1 + j for j in range(next_n)] for n in ctx_lens],
                           **i32)
        rows = len(ctx_lens) * next_n
        dec = DeepSeekV32IndexerDecodeMetadata(
            block_table=table, seq_lens=seq,
            decode_lens=torch.full((len(ctx_lens),), next_n, **i32), requires_padding=False,
            schedule_metadata=torch.zeros(1, **i32))
        md = DeepseekV32IndexerMetadata(
            seq_lens=torch.tensor(ctx_lens, **i32), max_seq_len=max(ctx_lens),
            slot_mapping=torch.zeros(rows, dtype=torch.int64), num_decodes=len(ctx_lens),
            num_decode_tokens=rows, num_prefills=0, num_prefill_tokens=0, decode=dec)
        lens = seq.reshape(-1).tolist()
    q = torch.randint(0, 256, (rows, HEADS, 128), generator=g, dtype=torch.int32)
    q = torch.where((q & 0x7F) == 0x7F, q - 1, q).to(torch.uint8).view(torch.float8_e4m3fn)
    w = torch.randn(rows, HEADS, generator=g)
    cand = _candidates(g, rows, lens)
    topk = torch.full((rows, TOPK), -1, **i32)
    ctx = ForwardContext(no_compile_layers={}, attn_metadata={prefix: md}, slot_mapping={})
    with _Stubs(sai) as st, override_forward_context(ctx):
        sai.sparse_attn_indexer(
            torch.zeros(rows, 8), prefix, cache, q, None, None, w, 128, "ue8m0", TOPK, 128,
            128, 256, topk, True, False, False, "", candidate_blocks=cand,
            candidate_block_size=CBS, candidate_write=False)
    logits, ends = st.seen[-1]
    return {"calls": dict(st.calls), "topk": topk.tolist(), "ends": ends,
            "rows": [logits[r, :e].view(torch.int32).tolist() for r, e in enumerate(ends)],
            "kept": [int((logits[r, :e] != float("-inf")).sum()) for r, e in enumerate(ends)]}


def main() -> None:
    out: dict = {}
    try:
        _setup()
        for kind in ("prefill", "decode"):
            out[kind] = {"on": _run(kind, True), "off": _run(kind, False)}
    except BaseException as e:  # noqa: BLE001 - the probe reports everything
        out["error"] = f"{type(e).__name__}: {e}"
        out["trace"] = traceback.format_exc()[-3000:]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
