"""The speculative limits of the Ampere path (overlay/vllm/deepinfer/spec.py) on the PATCHED
vLLM tree, CPU only. Run by tests/test_spec_limits.py in a subprocess (no interpreter: it
compiles):

    CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched python tests/spec_limits_probe.py

Two parts, one JSON object on the last stdout line:

* ``construct``: Ampere attention layers built as vLLM builds them at engine start, under
  speculative configs that fit and that do not (spec.check in ``_ampere_init``): the
  exception type and message, or None.
* ``dspark_width``: spec.dspark_swa_width through upstream's own function, per k;
* ``smem``: every Triton kernel whose compile-time constants depend on the number of
  speculative tokens k on this path (upstream's, as the speculators launch them), compiled
  for sm_80 with ``compile_gate.compile_spec`` at several k: shared memory per CTA in bytes.
Not collected by pytest (no ``test_`` prefix).
"""
from __future__ import annotations

import inspect
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

KS = (1, 2, 5, 7, 8, 16, 32)


def construct(model: str, layer_id: int, k: int, max_num_seqs: int, batched: int) -> dict:
    """One layer built under a DSpark config of k tokens and these engine limits."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.deepinfer.attention import selector

    from spec_decode_common import vllm_config
    vcfg = vllm_config(model, k, "dspark", False, "cpu")
    vcfg.scheduler_config.max_num_seqs = max_num_seqs
    vcfg.scheduler_config.max_num_batched_tokens = batched
    buf = torch.full((64, vcfg.model_config.hf_config.index_topk), -1, dtype=torch.int32)
    try:
        with set_current_vllm_config(vcfg):
            layer = selector.ampere_class(model)(vcfg, prefix=f"model.layers.{layer_id}.attn",
                                                 topk_indices_buffer=buf, aux_stream_list=None)
    except Exception as e:  # noqa: BLE001 - what the engine would see
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "class": type(layer).__name__, "ratio": int(layer.compress_ratio),
            "decode_tokens": layer._reserve_limits.decode_tokens}


def _sig(fn, types: dict, default: str) -> dict:
    return {n: types.get(n, default) for n in inspect.signature(fn.fn).parameters}


def smem_scan() -> dict:
    """Shared memory (bytes, sm_80) of the k-dependent kernels at each k in KS."""
    import triton
    from vllm.deepinfer.compile_gate import GateSpec, compile_spec
    from vllm.v1.attention.backends.mla import indexer as ix
    from vllm.v1.attention.backends.mla import sparse_swa as ss
    from vllm.v1.worker.gpu.spec_decode import acceptance_estimator as ae
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dfs

    def build(name, kernel, sig, const, warps=4):
        spec = GateSpec(name=name, kernel=kernel, signature=sig, constexprs=const,
                        variants=("sm80",), num_warps=warps)
        return int(compile_spec(spec, 80).metadata.shared)

    # patch 0027 wraps it (vllm.deepinfer.bucket_warmup): the JITFunction is .kernel
    prep = getattr(dfs._prepare_dflash_inputs_kernel, "kernel", dfs._prepare_dflash_inputs_kernel)
    prep_t = {n: ("*i64" if n.endswith("_ptr") else "i32")
              for n in inspect.signature(prep.fn).parameters}
    prep_t.update({n: "constexpr" for n in ("SAMPLE_FROM_ANCHOR", "PAD_SLOT_ID", "CP_SIZE",
                                             "CP_INTERLEAVE", "BLOCK_SIZE")},
                  out_temperature_ptr="*fp32", temperature_ptr="*fp32",
                  out_is_padding_ptr="*i1")
    nc = ss.ComputeDSparkNoncausalSWAIndicesKernel.kernel
    nc_t = _sig(nc, {"is_valid_token_ptr": "*i1", "TRITON_BLOCK_SIZE": "constexpr"}, "i32")
    nc_t.update({n: "*i32" for n in nc_t if n.endswith("_ptr") and n != "is_valid_token_ptr"})
    pud = ix.PrepareUniformDecodeKernel.kernel
    pud_t = _sig(pud, {"BLOCK_SIZE": "constexpr"}, "i32")
    pud_t.update({n: "*i32" for n in pud_t if n.endswith("_ptr")})
    refit_t = _sig(ae._refit_kernel, {n: "constexpr" for n in (
        "NUM_SPECULATIVE_STEPS", "L2", "DAMPING", "BLOCK")}, "i32")
    refit_t.update({n: "*fp32" for n in refit_t if n.endswith("_ptr")})
    out: dict = {}
    for k in KS:
        out[str(k)] = {
            # BLOCK_SIZE = min(256, next_pow2(max target query 1 + k + k query tokens)).
            "dflash._prepare_dflash_inputs_kernel": build(
                "prep", prep, prep_t, dict(SAMPLE_FROM_ANCHOR=True, PAD_SLOT_ID=-1, CP_SIZE=1,
                                           CP_INTERLEAVE=1,
                                           BLOCK_SIZE=min(256, triton.next_power_of_2(2 * k + 1)))),
            # index_width (window + k rounded up to 64) is a runtime argument.
            "sparse_swa.ComputeDSparkNoncausalSWAIndicesKernel": build(
                "nc", nc, nc_t, dict(TRITON_BLOCK_SIZE=1024)),
            # max_decode_len (1 + k) is a runtime argument in its compile key.
            "indexer.PrepareUniformDecodeKernel": build("pud", pud, pud_t,
                                                        dict(BLOCK_SIZE=1024)),
            "acceptance_estimator._refit_kernel": build(
                "refit", ae._refit_kernel, refit_t,
                dict(NUM_SPECULATIVE_STEPS=k, L2=1e-3, DAMPING=16.0,
                     BLOCK=triton.next_power_of_2(k))),
        }
    return out


def main() -> int:
    res: dict = {}
    try:
        from spec_decode_common import _setup
        _setup("cpu")
        # DSpark k = 5 as served, and the limit: 2^21 sequences x (1 + 7) tokens x 192
        # non-causal columns pass 2^31 - 1 (k = 4: 2^21 x 5 x 192 does not).
        cases = {"v41_swa_k5": ("deepseek_v41", 0, 5, 256, 8192),
                 "v41_swa_k7_huge": ("deepseek_v41", 0, 7, 1 << 21, 1 << 24),
                 "v4_c128a_k5": ("deepseek_v4", 2, 5, 256, 8192),
                 "v4_swa_k7_huge": ("deepseek_v4", 0, 7, 1 << 21, 1 << 24)}
        res["construct"] = {key: construct(*args) for key, args in cases.items()}
        # spec.dspark_swa_width through upstream's get_dspark_swa_index_width.
        from vllm.deepinfer import spec
        res["dspark_width"] = {str(k): spec.dspark_swa_width(128, k) for k in KS}
        res["smem"] = smem_scan()
    except BaseException as e:  # noqa: BLE001 - the probe reports everything
        res["error"] = f"{type(e).__name__}: {e}"
        res["trace"] = traceback.format_exc()[-4000:]
    sys.stdout.write("\n" + json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("DEEPINFER_ARCH", "sm80")
    sys.exit(main())
