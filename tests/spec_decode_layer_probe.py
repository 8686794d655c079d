"""Speculative decoding at the layer level through the Ampere attention classes, on the
PATCHED vLLM tree: decode steps of 1 + k query tokens per request (MTP's and DSpark's verify
step, causal) and DSpark's draft block (k tokens, non-causal), with the attention metadata
built by upstream's own builders from a ``CommonAttentionMetadata``. Run by
tests/test_spec_decode_layer.py in a subprocess:

    CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched python tests/spec_decode_layer_probe.py \
        [--device cuda --real]

and prints one JSON object (the last stdout line). On CPU the kernels run under the Triton
interpreter (variant sm80) at the tiny sizes of tests/vllm_probe_common.py; with
``--device cuda`` on a GPU (an H200 run: DEEPINFER_ARCH picks the variant) and
``--real`` the layers take the real V4.1/V4 attention sizes (64 heads, window 128, top-k
512) and longer contexts.

What the builders are: upstream's SWA builder through our subclasses
(``DeepinferAmpereV4/V41SparseSWAMetadataBuilder``: decode threshold 1 + k from the
speculative config, per-token causal windows, DSpark's non-causal rows
``[prefix - window, seq_len)`` padded to a multiple of 64 and its in-place refresh
``update_draft_decode_metadata``), the compressed-cache builder
(``DeepseekV4SparseMLAMetadataBuilder``: block table, V4 C128A's per-token top-k), the
indexer builder (``DeepseekV32IndexerMetadataBuilder`` through the V4 / V4.1 index backends:
native next_n rows for next_n in {1, 2}, flattened otherwise, padded when a batch is not
uniform). The caches hold random valid records everywhere a request has context.

Checks per case, all recorded as numbers the test asserts on:
* ``ref``: every token's output against plain torch over the keys its metadata must
  select (its own causal window / the block's non-causal window, its compressed top-k),
  the sink and the inverse RoPE at its position (tests/vllm_probe_forward.reference);
* ``single``: the same positions decoded as one-token requests (each its own request with
  seq_len = position + 1, same pages) in a batch of the same size: bit-equal to the
  multi-token step (causal cases);
* indexer cases (tests/spec_decode_indexer.py): the logits rows and top-k rows of
  upstream's ``sparse_attn_indexer`` (logits from our kernel through patch 0015, the padded
  layout's Q packed through patch 0017; the decode top-k is upstream's own "torch"
  backend: the patched source tree has no compiled vllm._C) against plain-torch logits of
  each token's own causal key range, and the layer's decode reading them.

CPU stand-ins (the interpreter has no CUDA): vllm_probe_common's faked SM80 platform, one
SM for the indexer builder's DeepGEMM schedule (unused without DeepGEMM), and the
candidate-block kernels' logits passed as a tensor that says "CUDA" (their
``assert logits.is_cuda``). Shared pieces: tests/spec_decode_common.py. Not collected by
pytest (no ``test_`` prefix).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_decode_common import (Caches, Model, _positions, _q, _setup, _topk_fill,  # noqa: E402
                                build_md, common_md, compare, init_sink, reference_out,
                                run_layer)
from spec_decode_indexer import _candidate_ops_on_cpu, indexer_step  # noqa: E402

RESULTS: dict = {}


def causal_step(model: str, method: str, k: int, layer_ids, seq_lens, real=False,
                device="cpu", seed=0) -> dict:
    """One verify step: every request has 1 + k query tokens (its bonus token and k drafts,
    causal); then the same positions as one-token requests in a batch of the same size."""
    import torch
    g = torch.Generator().manual_seed(seed)
    m = Model(model, k, method, real, device, layer_ids, g)
    for layer in m.layers.values():
        init_sink(layer, g)
    reqs = [(s, 1 + k) for s in seq_lens]
    c = Caches(m, len(reqs), max(seq_lens))
    positions = _positions(reqs)
    n = len(positions)
    rows = list(range(len(reqs)))
    # The one-token requests: token t of request r is request t with seq_len p + 1.
    single = [(p + 1, 1) for p in positions]
    single_rows = [r for r, (s, q) in enumerate(reqs) for _ in range(q)]
    out = {"tokens": n, "layers": {}}
    md, built = build_md(m, c, reqs, rows)
    md1, _ = build_md(m, c, single, single_rows, tag="single")
    swa_md = md[m.layers[layer_ids[0]].swa_cache_layer.prefix]
    out["swa_md"] = {"num_decodes": swa_md.num_decodes, "num_decode_tokens":
                     swa_md.num_decode_tokens, "num_prefills": swa_md.num_prefills,
                     "decode_swa_lens": swa_md.decode_swa_lens.tolist(),
                     "width": int(swa_md.decode_swa_indices.shape[-1]),
                     "threshold": int(built["swa"][0].decode_threshold)}
    pos_t = torch.tensor(positions, dtype=torch.int64, device=m.device)
    for i in layer_ids:
        layer = m.layers[i]
        q = _q(m, layer, n)
        topk_rows = None
        if not layer._swa_only() and not (model == "deepseek_v4" and layer.compress_ratio == 128):
            topk_rows = _topk_fill(m, layer, positions, g)
        t0 = time.perf_counter()
        o = run_layer(m, layer, md, q, pos_t)
        o1 = run_layer(m, layer, md1, q, pos_t)
        res = compare(o, reference_out(m, c, i, q, reqs, rows, topk_rows, True))
        res["single_bits_equal"] = bool(torch.equal(o.view(torch.int16), o1.view(torch.int16)))
        res["ratio"] = int(layer.compress_ratio)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        if model == "deepseek_v4" and layer.compress_ratio == 128:
            cm = md[layer.prefix]
            res["c128a_lens"] = cm.c128a_decode_topk_lens.tolist()
        out["layers"][str(i)] = res
    out["positions"] = positions
    return out


def dspark_draft(model: str, k: int, seq_lens, real=False, device="cpu", seed=0) -> dict:
    """DSpark's draft block through a draft layer (the layer after the backbone: SWA only,
    V4.1 ratio 0, V4 ratio 1): k query tokens per request, non-causal (every token sees
    the block-anchored window and the whole block); then the in-place refresh of the same
    metadata for another batch of as many tokens (update_draft_decode_metadata), against a
    fresh build of that batch."""
    import torch
    g = torch.Generator().manual_seed(seed)
    L = 4 if model == "deepseek_v41" else 3
    m = Model(model, k, "dspark", real, device, [L], g)
    layer = m.layers[L]
    init_sink(layer, g)
    reqs = [(s, k) for s in seq_lens]
    c = Caches(m, len(reqs), max(seq_lens) + 64)
    rows = list(range(len(reqs)))
    md, built = build_md(m, c, reqs, rows, causal=False)
    swa_md = md[layer.swa_cache_layer.prefix]
    n = sum(q for _, q in reqs)
    q = _q(m, layer, n)
    pos_t = torch.tensor(_positions(reqs), dtype=torch.int64, device=m.device)
    out = {"ratio": int(layer.compress_ratio),
           "swa_md": {"width": int(swa_md.decode_swa_indices.shape[-1]),
                      "decode_swa_width": int(swa_md.decode_swa_width),
                      "decode_swa_lens": swa_md.decode_swa_lens.tolist(),
                      "num_decode_tokens": swa_md.num_decode_tokens,
                      "window": int(layer.window_size)}}
    o = run_layer(m, layer, md, q, pos_t)
    ref = reference_out(m, c, L, q, reqs, rows, None, False)
    out["first"] = compare(o, ref)
    # The control: the same block with causal rows is not the non-causal result.
    causal, _ = build_md(m, c, reqs, rows, causal=True, tag="causal")
    out["causal_rows_error"] = compare(run_layer(m, layer, causal, q, pos_t), ref)
    # Refresh in place for a batch of the same token count: every request 37 tokens on.
    b, cm = built["swa"]
    reqs2 = [(s + 37, k) for s in seq_lens]
    cm2 = common_md(reqs2, c.swa_bt[rows], c.swa_bs, m.device, causal=False)
    cm.seq_lens.copy_(cm2.seq_lens)
    cm.slot_mapping.copy_(cm2.slot_mapping)
    cm.query_start_loc.copy_(cm2.query_start_loc)
    b.update_draft_decode_metadata(swa_md)
    pos2 = torch.tensor(_positions(reqs2), dtype=torch.int64, device=m.device)
    o2 = run_layer(m, layer, md, q, pos2)
    fresh, _ = build_md(m, c, reqs2, rows, causal=False, tag="fresh")
    o3 = run_layer(m, layer, fresh, q, pos2)
    out["refreshed"] = compare(o2, reference_out(m, c, L, q, reqs2, rows, None, False))
    out["refreshed"]["lens"] = swa_md.decode_swa_lens.tolist()
    out["refreshed_equals_fresh_build"] = bool(torch.equal(o2.view(torch.int16),
                                                          o3.view(torch.int16)))
    return out


def record(key: str, fn, *args, **kw):
    t = time.perf_counter()
    try:
        RESULTS[key] = {"ok": True, **fn(*args, **kw)}
    except BaseException as e:  # noqa: BLE001 - the probe reports everything
        RESULTS[key] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                        "trace": traceback.format_exc()[-4000:]}
    RESULTS[key]["seconds"] = round(time.perf_counter() - t, 2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--real", action="store_true")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    if a.device == "cpu":
        # Before anything imports Triton kernels: @triton.jit reads it when it decorates.
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ.setdefault("DEEPINFER_ARCH", "sm80")
    t0 = time.perf_counter()
    _setup(a.device)
    if a.device == "cpu":
        _candidate_ops_on_cpu()
    kw = dict(real=a.real, device=a.device)
    # Contexts: the CPU's keep every layer's top-k below its compressed context; the real
    # sizes' (top-k 512) pass it, as serving does.
    ctx = [3000, 9000] if a.real else [130, 300]
    v4_verify = [2803, 9000] if a.real else [257, 300]    # C128A boundaries inside a block
    draft = [60, 5000] if a.real else [60, 300]           # a context shorter than the window
    idx = [(ctx[0], 2), (ctx[1] + 1, 2)]
    jobs = [
        ("v4/mtp_k1", causal_step, ("deepseek_v4", "mtp", 1, [0, 1, 2], [s + 1 for s in ctx])),
        ("v4/dspark_k5_verify", causal_step, ("deepseek_v4", "dspark", 5,
                                              [1, 2] if a.real else [2], v4_verify)),
        ("v41/dspark_k5_verify", causal_step, ("deepseek_v41", "dspark", 5,
                                               [0, 1, 2] if a.real else [1, 2],
                                               [s + 5 for s in ctx])),
        ("v4/dspark_draft_k5", dspark_draft, ("deepseek_v4", 5, draft)),
        ("v41/dspark_draft_k5", dspark_draft, ("deepseek_v41", 5, draft)),
        ("v4/indexer_native_k1", indexer_step, ("deepseek_v4", 1, idx)),
        ("v4/indexer_padded_k1", indexer_step, ("deepseek_v4", 1, idx + [(0, 0)])),
        ("v4/indexer_flat_k5", indexer_step, ("deepseek_v4", 5, idx)),
        ("v4/indexer_flat_padded_k5", indexer_step, ("deepseek_v4", 5, idx + [(0, 0)])),
        ("v41/indexer_native_k1", indexer_step, ("deepseek_v41", 1, idx)),
        ("v41/indexer_padded_k1", indexer_step, ("deepseek_v41", 1, idx + [(0, 0)])),
        ("v41/indexer_flat_k5", indexer_step, ("deepseek_v41", 5, idx)),
    ]
    if a.real:
        # DSpark's verify layout itself (6 tokens per request, flattened), at real sizes.
        jobs.append(("v41/indexer_flat_k5_full", indexer_step,
                     ("deepseek_v41", 5, [(s, 6) for s, _ in idx])))
    for key, fn, args in jobs:
        if a.only and a.only not in key:
            continue
        record(key, fn, *args, **kw)
    RESULTS["_seconds"] = round(time.perf_counter() - t0, 2)
    sys.stdout.write("\n" + json.dumps(RESULTS) + "\n")
    return 0


def hide_gpus_for_cpu_run(argv, environ) -> None:
    """The CPU run hides every GPU (``CUDA_VISIBLE_DEVICES=""``: vllm.triton_utils would
    otherwise swap in its placeholder Triton where no driver loads), unless the caller set
    the variable. A ``--device cuda`` run leaves the GPUs visible: its caller
    (tests/test_spec_decode_layer.py) drops the variable for it, and hiding them here made
    every gpu case fail with "No CUDA GPUs are available" on the H200 at baa82d6 (the
    provenance note of benchmarks/results/h200-2026-12-03-gpu-tests-f895c39.json)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--device", default="cpu")  # main()'s flag and default
    if ap.parse_known_args(argv)[0].device == "cpu":
        environ.setdefault("CUDA_VISIBLE_DEVICES", "")


if __name__ == "__main__":
    hide_gpus_for_cpu_run(sys.argv[1:], os.environ)
    sys.exit(main())
