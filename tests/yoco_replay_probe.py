"""Cross-layer reuse (vllm.deepinfer.yoco) under vLLM 0.33.0's decoder SWA bounded replay,
on the PATCHED tree (CPU, interpreter, sm80). Run by tests/test_yoco_replay.py:

    CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched python tests/yoco_replay_probe.py

and prints one JSON object (the last stdout line).

In eager prefill steps ``DeepseekV41ModelState`` runs the last KV-source layer and the
layers after it on each request's last ``window`` rows only (models/deepseek_v41/
decoder_replay_layers.py). It builds their SWA metadata from one CommonAttentionMetadata of
that kept batch twice: the first replay layer's with the batch's replay starts, the later
replay layers' with each trimmed request's kept start (seq_len - window), so the two give
other ``prefill_gather_lens`` (window + window - 1 against window rows for a long prompt).
Both metadata objects name the same query_start_loc / seq_lens storage, which is what
``yoco.batch_tag`` reads.

The model here: V4.1 layers 2 (ratio 1, the last KV source and an index source) and 3
(ratio 1, reading layer 2's cache and top-k): the layout of v41-mini (layers 6 and 7),
v41-tput (8 and 9) and the released V4.1 (20 and 21-23). One prefill request of ``Q`` =
window kept rows after a long context; layer 2 gets the first replay layer's metadata,
layer 3 the later layers'. Recorded: both metadata's gather lengths and whether their
batch tags agree, every layer's output bits with reuse on against reuse off
(DEEPINFER_YOCO_REUSE=0), the StepCache's hits; and, for the main forward (every SWA group
handed views of one replay-start buffer, as the model state does), whether two groups'
combine keys still agree.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WINDOW = 16         # a small window keeps the interpreter fast; the geometry is the same
CONTEXT = 200       # tokens before the kept rows
Q = WINDOW          # the kept rows of a trimmed prefill request


def _hf_config(model: str, real: bool, base=None):
    cfg = base(model, real)
    if model != "deepseek_v41":
        return cfg
    cfg.num_hidden_layers, cfg.compress_ratios = 4, [0, 2, 1, 1]
    cfg.kv_source_layer_ids, cfg.index_source_layer_ids = [1, 2], [1, 2]
    cfg.candidate_source_layer_id, cfg.candidate_topk_blocks = -1, 0
    cfg.candidate_block_size = 0
    cfg.sliding_window = WINDOW
    return cfg


def _digest(t) -> str:
    import torch
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()
                          .tobytes()).hexdigest()[:16]


def main() -> dict:
    import functools

    import spec_decode_common as sdc
    sdc.hf_config = functools.partial(_hf_config, base=sdc.hf_config)
    import torch
    sdc._setup("cpu")
    from vllm.config import set_current_vllm_config
    from vllm.deepinfer import routing, yoco
    from vllm.forward_context import ForwardContext, override_forward_context

    g = torch.Generator().manual_seed(3)
    m = sdc.Model("deepseek_v41", 0, None, False, "cpu", [2, 3], g)
    for layer in m.layers.values():
        sdc.init_sink(layer, g)
    first, later = m.layers[2], m.layers[3]
    seq = CONTEXT + Q
    reqs = [(seq, Q)]
    c = sdc.Caches(m, 1, seq + 8)
    positions = torch.tensor(sdc._positions(reqs), dtype=torch.int64)
    sdc._topk_fill(m, first, positions.tolist(), g)
    cm = sdc.common_md(reqs, c.swa_bt[[0]], c.swa_bs, "cpu")
    # Two SWA builders (vLLM copies the replay layers' groups and the first replay layer's
    # group, each with builders of its own) over the same kept batch.
    b_first, _ = m.builder(first.swa_cache_layer, "first")
    b_later, _ = m.builder(later.swa_cache_layer, "later")
    batch_start = torch.zeros(1, dtype=torch.int32)             # the batch's replay starts
    kept_start = torch.tensor([seq - WINDOW], dtype=torch.int32)  # a trimmed request's
    md_first = b_first.build(0, cm, replay_start=batch_start)
    md_later = b_later.build(0, cm, replay_start=kept_start)
    b_comp, spec = m.builder(first, "comp")
    comp = b_comp.build(0, sdc.common_md(reqs, c.comp_bt[2][[0]], spec.block_size, "cpu"))
    attn = {first.swa_cache_layer.prefix: md_first, later.swa_cache_layer.prefix: md_later,
            first.prefix: comp}
    qs = {2: sdc._q(m, first, Q), 3: sdc._q(m, later, Q)}

    def run(reuse: bool):
        os.environ["DEEPINFER_YOCO_REUSE"] = "1" if reuse else "0"
        routing.reset()
        ctx = ForwardContext(no_compile_layers={}, attn_metadata=attn, slot_mapping={})
        outs = {}
        with set_current_vllm_config(m.vcfg), override_forward_context(ctx):
            for i in (2, 3):
                out = torch.full_like(qs[i], 7.0)
                m.layers[i].forward_mqa(qs[i], None, positions, out)
                outs[i] = out
        cache = yoco.step_cache(ctx)
        hits = {} if cache is None else dict(cache.hits)
        return outs, hits

    on, hits_on = run(True)
    off, _ = run(False)
    os.environ.pop("DEEPINFER_YOCO_REUSE", None)
    routing.reset()
    # The main forward: every SWA group gets a view of the model state's one buffer.
    shared = torch.zeros(4, dtype=torch.int32)
    b_g1, _ = m.builder(first.swa_cache_layer, "group1")
    b_g2, _ = m.builder(later.swa_cache_layer, "group2")
    md_g1 = b_g1.build(0, cm, replay_start=shared[:1])
    md_g2 = b_g2.build(0, cm, replay_start=shared[:1])
    chunk = (0, 1, 7, 9)
    # Batches built without replay starts (all of V4's, V4.1's graph captures): two groups'
    # builders, each with its upstream no_replay_start, over one batch.
    md_n1 = b_g1.build(0, cm)
    md_n2 = b_g2.build(0, cm)
    v4 = _v4_groups(sdc, g)
    return {
        **v4,
        "v41_no_replay_shared": b_g1.no_replay_start.data_ptr() == b_g2.no_replay_start.data_ptr(),
        "v41_no_replay_combine_keys_equal":
            yoco.combine_key(2, 1, WINDOW, 64, md_n1, chunk)
            == yoco.combine_key(2, 1, WINDOW, 64, md_n2, chunk),
        "v41_no_replay_zeros": bool((md_n1.replay_start == 0).all()),
        "gather_lens_first": md_first.prefill_gather_lens.tolist(),
        "gather_lens_later": md_later.prefill_gather_lens.tolist(),
        "batch_tag_equal": yoco.batch_tag(md_first) == yoco.batch_tag(md_later),
        "replay_combine_keys_equal":
            yoco.combine_key(2, 1, WINDOW, 64, md_first, chunk)
            == yoco.combine_key(2, 1, WINDOW, 64, md_later, chunk),
        "main_combine_keys_equal":
            yoco.combine_key(2, 1, WINDOW, 64, md_g1, chunk)
            == yoco.combine_key(2, 1, WINDOW, 64, md_g2, chunk),
        "bits_on": {str(i): _digest(on[i]) for i in on},
        "bits_off": {str(i): _digest(off[i]) for i in off},
        "max_abs_diff": {str(i): float((on[i].float() - off[i].float()).abs().max())
                         for i in on},
        "hits_on": hits_on,
    }


def _v4_groups(sdc, g) -> dict:
    """V4 (its model state passes no replay starts): the C128A layer's combine key under the
    metadata of two SWA cache groups' builders over one prefill batch, as v4-long's C128A
    layers 2 and 4 (in two groups) key their lists; and whether the reservation's slab
    accepts the second (``reserve._claim``: one owner per slab and forward)."""
    import torch
    from vllm.deepinfer import reserve, yoco
    from vllm.forward_context import ForwardContext
    m = sdc.Model("deepseek_v4", 0, None, False, "cpu", [2], g)
    layer = m.layers[2]
    seq = CONTEXT + Q
    reqs = [(seq, Q)]
    c = sdc.Caches(m, 1, seq + 8)
    cm = sdc.common_md(reqs, c.swa_bt[[0]], c.swa_bs, "cpu")
    b1, _ = m.builder(layer.swa_cache_layer, "v4-group1")
    b2, _ = m.builder(layer.swa_cache_layer, "v4-group2")
    md1, md2 = b1.build(0, cm), b2.build(0, cm)
    comp = object()  # the one compressed metadata object both layers read (keyed by id)
    src = layer._yoco_index_source(comp, False)
    chunk = (0, 1, 7, 9)
    k1 = yoco.combine_key(src, 128, WINDOW, 128, md1, chunk)
    k2 = yoco.combine_key(src, 128, WINDOW, 128, md2, chunk)
    ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
    reserve._WARNED.clear()
    # Two chunks of rows of one slab: the second claimant is another owner unless the keys
    # agree (with equal keys the real forward would not even ask: yoco.reuse hits).
    claims = [reserve._claim(ctx, "slot", reserve._owner(k), lo, lo + Q)
              for k, lo in ((k1, 0), (k2, Q))]
    return {
        "v4_builder": type(b1).__name__,
        "v4_index_source": repr(src[0]),
        "v4_no_replay_shared": b1.no_replay_start.data_ptr() == b2.no_replay_start.data_ptr(),
        "v4_combine_keys_equal": k1 == k2,
        "v4_claims": claims,
        "v4_second_owner_warned": any("two live lists" in w for w in reserve._WARNED),
        "v4_no_replay_zeros": bool((md1.replay_start == 0).all()),
    }


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["DEEPINFER_ARCH"] = "sm80"
    try:
        res = {"ok": True, **main()}
    except Exception as e:  # noqa: BLE001 - reported to the test
        res = {"ok": False, "error": f"{type(e).__name__}: {e}",
               "trace": traceback.format_exc()}
    print(json.dumps(res))
