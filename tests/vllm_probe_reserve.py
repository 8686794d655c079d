"""Probe of tests/test_reserve.py::test_vllm_profile_run, run in a subprocess on the patched
vLLM tree (``PYTHONPATH=build/patched``) with this checkout's ``vllm.deepinfer`` in front of the
tree's copy, so the probe checks the package as it is here:

    CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched python tests/vllm_probe_reserve.py

1. builds the forward scenario's V4.1 (ratios 0, 1) and V4 (1, 4, 128) Ampere layers
   (tests/vllm_probe_forward.py: tiny configs, vLLM's real WorkspaceManager on the CPU);
2. runs each layer's profile-run branch (``forward_mqa`` without attention metadata) and
   reports what vLLM's workspace and our combined-list buffers hold against each layer's
   worst cases (vllm.deepinfer.reserve);
3. locks the workspace as vLLM does after capturing its CUDA graphs, then serves a decode and
   a prefill through every layer (plain torch within tolerance, the decode's own bytes), the
   decode scratch, the indexer logits and the combined lists coming from the reservations;
4. asks for more than was reserved: ReservationError.

Prints one JSON object (the last stdout line). Not collected by pytest (no ``test_`` prefix).
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Outputs are bf16 of magnitude ~1: tests/test_vllm_import.py's FORWARD_TOL (about one bf16
# ulp of the largest output).
FORWARD_TOL = 1e-2


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _indexer_decode(mgr, used) -> dict:
    """A decode's indexer logits through patch 0015 (upstream's DeepGEMM entry point): our
    kernel's values, written into vLLM's locked workspace."""
    import torch
    from vllm.deepinfer.kernels import indexer_logits as il
    from vllm.utils import deep_gemm
    g = torch.Generator().manual_seed(3)

    def codes(*shape):
        b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
        return torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)
    q = codes(2, 1, 4, 128).view(torch.float8_e4m3fn)
    cache = codes(3, 64, 132)
    cache.view(3, -1)[:, 64 * 128:] = torch.full((3, 64), 0.5,
                                                 dtype=torch.float32).view(torch.uint8)
    w = torch.randn(2, 4, generator=g, dtype=torch.float32)
    ctx = torch.tensor([70, 5], dtype=torch.int32)
    bt = torch.tensor([[2, 0], [1, 0]], dtype=torch.int32)
    used["views"].clear()
    got = deep_gemm.fp8_fp4_paged_mqa_logits((q, None), cache.unsqueeze(2), w, ctx, bt, None, 80)
    want = il.paged_mqa_logits(q, cache, w, ctx, bt, 80, variant="sm80")
    ws = mgr._current_workspaces[0]
    inside = ws.data_ptr() <= got.data_ptr() < ws.data_ptr() + ws.numel()
    equal = all(torch.equal(got[r, :n].view(torch.int32), want[r, :n].view(torch.int32))
                for r, n in enumerate((70, 5)))
    return {"ok": bool(inside and equal and "indexer decode logits" in used["views"]),
            "in_workspace": inside, "equal": equal, "views": list(used["views"])}


def main() -> dict:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["DEEPINFER_ARCH"] = "sm80"
    import vllm
    vllm.__path__.insert(0, str(REPO / "overlay" / "vllm"))  # this checkout's package
    import torch

    import vllm_probe_forward as fwd
    from vllm.config import set_current_vllm_config
    from vllm.deepinfer import arch, reserve
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.v1.worker import workspace as vws

    probe = fwd.Probe()
    mgr = vws.current_workspace_manager()
    res: dict = {"layers": {}, "package": reserve.__file__}
    needs = {}
    for (model, i), layer in probe.built.items():
        q = torch.zeros(8, layer.padded_heads, 512, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        ctx = ForwardContext(no_compile_layers={}, attn_metadata=None, slot_mapping={})
        with set_current_vllm_config(probe.vcfgs[model]), override_forward_context(ctx):
            layer.forward_mqa(q, None, torch.arange(8), out)
        lim = layer._reserve_limits
        worst = reserve.decode_scratch_worst(
            "sm80", lim.decode_tokens, q.shape[1], layer._decode_keys_per_token(),
            arch.sm_count(q.device))[0]
        op = getattr(getattr(layer, "indexer", None), "indexer_op", None)
        logits = 0 if op is None else reserve.spec_bytes(
            reserve.indexer_logits_specs(lim.indexer_decode_rows, op.max_model_len))
        slabs = []
        for kind in sorted(layer._combine_kinds()):
            slab = reserve.combine_slab(kind, layer._combine_slab_width(), q.device)
            if slab is not None and slab.rows >= lim.prefill_tokens:
                slabs.append([kind, slab.width, slab.rows])
        needs[f"{model}/{i}"] = {"decode_worst": worst, "logits": logits, "slabs": slabs,
                                 "decode_tokens": lim.decode_tokens,
                                 "logits_width": None if op is None else op.max_model_len}
    size = mgr._current_workspaces[0].numel()  # bytes (uint8) after the profile run
    for name, n in needs.items():
        res["layers"][name] = {**n, "workspace": size}
    vws.lock_workspace()

    # Served after the lock: count what came from the reservations.
    used = {"views": [], "combine": []}
    views, lists_out = reserve._views, reserve.combined_lists_out

    def counting_views(m, specs, what):
        used["views"].append(what)
        return views(m, specs, what)

    def counting_lists(*a, **k):
        got = lists_out(*a, **k)
        used["combine"].append(got is not None)
        return got
    reserve._views = counting_views
    reserve.combined_lists_out = counting_lists
    reserve._workspace_callable.cache_clear()
    served = {}
    for (model, i) in probe.built:
        for step, fn in (("decode", fwd.decode), ("prefill", fwd.prefill_ours)):
            name = f"{model}/{i}/{step}"
            used["views"].clear()
            used["combine"].clear()
            try:
                v = fn(probe, model, i)
                ok = (v["finite"] and v["max_abs_err"] <= FORWARD_TOL * max(1.0, v["ref_max"])
                      and v.get("bytes_equal", True))
                if step == "decode":
                    ok = ok and "sparse_mla_decode scratch" in used["views"]
                else:
                    ok = ok and bool(used["combine"]) and all(used["combine"])
                served[name] = {"ok": bool(ok), "value": v, "views": list(used["views"]),
                                "combine_reserved": list(used["combine"])}
            except Exception as e:  # noqa: BLE001 - reported
                served[name] = {"ok": False, "error": _err(e),
                                "trace": traceback.format_exc()[-2000:]}
    try:
        served["indexer/decode"] = _indexer_decode(mgr, used)
    except Exception as e:  # noqa: BLE001 - reported
        served["indexer/decode"] = {"ok": False, "error": _err(e),
                                    "trace": traceback.format_exc()[-2000:]}
    res["served"] = served
    reserve._views, reserve.combined_lists_out = views, lists_out

    # Past the reservation.
    past = {}
    layer = probe.built["deepseek_v41", 1]
    t = 4 * layer._reserve_limits.decode_tokens
    specs = reserve.decode_scratch("sm80", t, layer.padded_heads,
                                   layer._decode_keys_per_token(), 1)
    try:
        reserve.decode_workspace()([(s, d) for _, s, d in specs])
        past["decode"] = "allocated"
    except Exception as e:  # noqa: BLE001 - reported
        past["decode"] = _err(e)
    width = needs["deepseek_v41/1"]["logits_width"] or 4096
    try:
        reserve.indexer_decode_logits(size // (4 * width) + 1, width, torch.device("cpu"))
        past["logits"] = "allocated"
    except Exception as e:  # noqa: BLE001 - reported
        past["logits"] = _err(e)
    res["past"] = past

    # The decode top-k's own request lands before the logits.
    rows = layer._reserve_limits.indexer_decode_rows
    logits = reserve.indexer_decode_logits(rows, width, torch.device("cpu"))
    radix, = mgr.get_simultaneous(((reserve.RADIX_TOPK_BYTES,), torch.uint8))
    a0, a1 = radix.data_ptr(), radix.data_ptr() + radix.numel()
    b0 = logits.data_ptr()
    b1 = b0 + logits.numel() * logits.element_size()
    res["radix_disjoint"] = a1 <= b0 or b1 <= a0
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        out = main()
    except Exception as e:  # noqa: BLE001 - the test reports it
        out = {"error": _err(e), "trace": traceback.format_exc()[-3000:]}
    print(json.dumps(out, default=str))
