"""benchmarks/diag/launch_overhead.py (the H200 host-time measurement of every launcher): each
launcher it times accepts the inputs it builds, run once here on CPU tensors (interpreter),
so the GPU run cannot fail on an argument. The script itself needs a GPU."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "diag" / "launch_overhead.py"


def _script():
    spec = importlib.util.spec_from_file_location("launch_overhead", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


LO = _script()


def test_script_names_every_public_launcher():
    """Every launcher function of the kernel modules is timed (one row per public entry
    point that launches a kernel)."""
    timed = {name.split("[")[0] for name in LO.LAUNCHERS}
    from vllm.deepinfer.kernels import (fp8_writers_v4, fp8_writers_v4_compress,
                                        fp8_writers_v41, indexer_logits, kv_gather,
                                        sparse_mla_decode, topk_swa)
    launchers = {
        "sparse_mla_decode": [sparse_mla_decode.sparse_attn_decode],
        "kv_gather": [kv_gather.dequantize_and_gather_k_cache],
        "topk_swa": [topk_swa.combine_topk_swa_indices],
        "indexer_logits": [indexer_logits.paged_mqa_logits, indexer_logits.mqa_logits],
        "fp8_writers_v41": [fp8_writers_v41.rope_quant_insert,
                            fp8_writers_v41.indexer_k_norm_rope_store],
        "fp8_writers_v4": [fp8_writers_v4.fused_inv_rope_fp8_quant,
                           fp8_writers_v4.fused_indexer_q_rope_quant],
        "fp8_writers_v4_compress": [fp8_writers_v4_compress.compress_norm_rope_store_triton],
    }
    want = {f"{m}.{f.__name__}" for m, fs in launchers.items() for f in fs}
    assert timed == want


@pytest.mark.parametrize("name", list(LO.LAUNCHERS))
def test_launcher_inputs_are_accepted(device, monkeypatch, name):
    if device != "cpu":
        pytest.skip("the script itself runs on the GPU")
    monkeypatch.setattr(LO, "HEADS", 16)  # a quarter of the interpreted programs
    fn = LO.LAUNCHERS[name](torch.device("cpu"), torch.Generator().manual_seed(0))
    fn("sm80")  # raises on any argument the launcher refuses


def test_commit_from_environment(monkeypatch):
    monkeypatch.setenv("DEEPINFER_COMMIT", "abc123")
    assert LO._commit() == "abc123"
