"""Checkpoints of tools/make_checkpoint.py loaded by vLLM 0.33.0's own model code, on CPU.
Run by tests/test_make_checkpoint.py in a subprocess:

    CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched python tests/checkpoint_load_probe.py WORK_DIR

For every case of CASES it writes a checkpoint (reduced sizes, same topology as the
config) under WORK_DIR (and deletes it after recording its safetensors headers), builds the model class vLLM's registry names for the config's
architecture -- the DeepSeek-V4.1 vision wrapper with language_model_only, or
DeepseekV4ForCausalLM -- with the quantization config vLLM picks on CUDA
(deepseek_v41.DeepseekV4FP8Config for both models), on a faked SM80 device (this project's
Ampere attention classes), and runs the model's real ``load_weights`` on the safetensors.
Recorded per case: the parameters no tensor reached, the tensors no parameter loader
received, the quant methods built, and vLLM's own dequantization of loaded MXFP4 / MXFP8
parameters against the bf16 source values. Prints one JSON object (the last stdout line).

What is stubbed, and why it does not touch the names or shapes under test: the MoE and
linear *kernel* choices (a CPU machine has none; they only act in
process_weights_after_loading, which is not run), CUDA streams/events and the device
query of the Engram table (construction-time only), Engram's pinned host copy
(cpu_offload=False). Not collected by pytest (no ``test_`` prefix).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = REPO / "benchmarks" / "e2e" / "configs"
# Reduced sizes for a fast CPU run: the layer topology, head_dim 512, the mHC, Engram and
# MoE structure stay those of the config; heads, vocabulary and index heads shrink.
SMALL = {"vocab_size": 4096, "hidden_size": 512, "num_attention_heads": 16, "index_n_heads": 16,
         "n_routed_experts": 4}
# v41-tput keeps its layer roles and q_lora_rank 1280 (not a power of two); 8 heads, a
# 256 o_lora_rank and 256-wide experts keep its projections as small as the minis'.
CASES = [("v41-mini", "bf16", {}), ("v41-mini", "fp8", {}), ("v41-mini", "mxfp8", {}),
         ("v41-tput", "mxfp8", {"num_attention_heads": 8, "o_lora_rank": 256,
                                "moe_intermediate_size": 256}),
         ("v4-mini", "bf16", {}), ("v4-mini", "fp8", {})]

RESULTS: dict = {}


def _stub_platform() -> None:
    import torch
    from vllm_probe_common import _FakeEvent, cpu_platform as _cpu_platform
    _cpu_platform()  # faked SM80 capability, CPU tensors
    torch.cuda.Stream = _FakeEvent  # type: ignore[misc]
    torch.cuda.get_device_properties = lambda *a, **k: SimpleNamespace(  # type: ignore
        multi_processor_count=1)
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]

    class NoKernel:
        """Kernel selection happens at construction; nothing here runs a GEMM."""
        supports_pre_processed_weights = False

        def input_quant_key(self):
            return None

    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as um
    import vllm.model_executor.layers.quantization.fp8 as fp8
    import vllm.model_executor.layers.quantization.modelopt as modelopt
    import vllm.model_executor.layers.quantization.mxfp4 as mxfp4
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    um.select_unquantized_moe_backend = lambda moe_config: (UnquantizedMoeBackend.TRITON,
                                                            TritonExperts)
    # Marlin: what MXFP4 experts run on at SM80 (its size round-up applies here too).
    mxfp4.select_deepseek_v4_mxfp4_moe_backend = lambda moe: (Mxfp4MoeBackend.MARLIN, None)
    modelopt.init_mxfp8_linear_kernel = lambda *a, **k: NoKernel()
    fp8.init_fp8_linear_kernel = lambda *a, **k: NoKernel()


def _vllm_config(ckpt: Path):
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.config.engram import EngramConfig
    from vllm.models.deepseek_v41.quant_config import DeepseekV4FP8Config
    mc = ModelConfig(model=str(ckpt), skip_tokenizer_init=True, dtype="bfloat16",
                     max_model_len=4096, seed=0, language_model_only=True)
    vcfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    vcfg.model_config = mc
    info = {"architecture": mc.hf_config.architectures[0]}
    qc = getattr(mc.hf_config, "quantization_config", None)
    if qc:
        # What ModelConfig._verify_quantization resolves on CUDA (the CPU platform
        # resolves another class), then the class get_quantization_config returns there.
        info["cuda_quant_method"] = DeepseekV4FP8Config.override_quantization_method(
            qc, None, hf_config=mc.hf_config)
        vcfg.quant_config = DeepseekV4FP8Config.from_config(qc)
    vcfg.cache_config.cache_dtype = "fp8_ds_mla"
    vcfg.attention_config.sparse_mla_prefill_workspace_factor = 5
    vcfg.kernel_config.enable_jit_warmup = False
    if getattr(mc.hf_text_config, "engram_layer_ids", None):
        vcfg.engram_config = EngramConfig(cpu_offload=False)
    return vcfg, info


def _model_class(arch: str):
    from vllm.model_executor.models.registry import _VLLM_MODELS
    module, name = _VLLM_MODELS[arch]
    return getattr(importlib.import_module(module), name)


def _read(ckpt: Path):
    from safetensors import safe_open
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(ckpt / fname), "pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _excess(deq, src, kind: str) -> float:
    """max |deq - src| / allowed, with the per-element allowance of the format
    (see make_checkpoint's quantizers): fp8 e4m3 half an ulp (2^-4 relative) or half
    the smallest subnormal step of the block; e2m1 a quarter of the value or of the
    block scale. <= 1 means within the format's rounding error."""
    import torch
    deq, src = deq.float(), src.float()
    err = (deq - src).abs()
    if kind == "e4m3":
        amax = src.abs().amax()
        allowed = src.abs() * 2.0 ** -4 + amax / 448 * 2.0 ** -9
    else:
        allowed = src.abs() * 0.25 + 2 * src.abs().amax() / 6 * 0.25
    return float((err / allowed.clamp_min(1e-30)).max()) if err.numel() else 0.0


def _check_values(model, ckpt_fmt: str, cfg, seed: int) -> dict:
    """vLLM's dequantization of loaded parameters against the tool's bf16 source."""
    import make_checkpoint as mk
    import torch
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (
        dequant_mxfp8_to_bf16,
    )
    params = dict(model.named_parameters())
    root = next(n for n in params if n.endswith("layers.0.attn_norm.weight")).split("layers.0.")[0]
    specs = {s.name: s for s in mk.tensor_specs(cfg)}

    def src(name):
        return mk.draw(specs[name], seed).float()

    out = {}
    wqa, wkv = src("layers.0.attn.wq_a.weight"), src("layers.0.attn.wkv.weight")
    fused_src = torch.cat([wqa, wkv])
    w = params[root + "layers.0.attn.fused_wqa_wkv.weight"]
    if ckpt_fmt == "bf16":
        out["fused_wqa_wkv_equal"] = bool(torch.equal(w.float(), fused_src))
        out["embed_equal"] = bool(torch.equal(
            params[root + "embed_tokens.weight"].float()[: cfg.need("vocab_size")],
            src("embed.weight")))
    elif ckpt_fmt == "mxfp8":
        s = params[root + "layers.0.attn.fused_wqa_wkv.weight_scale"]
        out["scale_param"] = [str(s.dtype), list(s.shape)]
        out["fused_wqa_wkv_excess"] = _excess(dequant_mxfp8_to_bf16(w, s), fused_src, "e4m3")
    else:
        s = params[root + "layers.0.attn.fused_wqa_wkv.weight_scale_inv"]
        out["scale_param"] = [str(s.dtype), list(s.shape)]
        deq = w.float() * s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
        out["fused_wqa_wkv_excess"] = _excess(deq, fused_src, "e4m3")
    if ckpt_fmt != "bf16":
        from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import (
            _dequant_mxfp4_ue8m0_gran32,
        )
        I = cfg.need("moe_intermediate_size")
        H = cfg.need("hidden_size")
        w13 = params[root + "layers.0.ffn.experts.routed_experts.w13_weight"]
        s13 = params[root + "layers.0.ffn.experts.routed_experts.w13_weight_scale"]
        w2 = params[root + "layers.0.ffn.experts.routed_experts.w2_weight"]
        s2 = params[root + "layers.0.ffn.experts.routed_experts.w2_weight_scale"]
        e = cfg.need("n_routed_experts") - 1
        deq13 = _dequant_mxfp4_ue8m0_gran32(w13[e], s13[e]).float()
        deq2 = _dequant_mxfp4_ue8m0_gran32(w2[e], s2[e]).float()
        # w13 holds w1 then w3, each padded to the backend's intermediate size.
        Ip = w13.shape[1] // 2
        out["w13_param"] = [str(w13.dtype), list(w13.shape), str(s13.dtype), list(s13.shape)]
        out["expert_w1_excess"] = _excess(
            deq13[:I, :H], src(f"layers.0.ffn.experts.{e}.w1.weight"), "e2m1")
        out["expert_w3_excess"] = _excess(
            deq13[Ip:Ip + I, :H], src(f"layers.0.ffn.experts.{e}.w3.weight"), "e2m1")
        out["expert_w2_excess"] = _excess(
            deq2[:H, :I], src(f"layers.0.ffn.experts.{e}.w2.weight"), "e2m1")
    eng = list(cfg.get("engram_layer_ids") or [])
    if eng:
        i = eng[0]
        q = params[f"{root}layers.{i}.engram.embed_tokens.weight"]
        s = params[f"{root}layers.{i}.engram.embed_tokens.weight_scale_inv"]
        deq = q.float() * torch.exp2(s.float() - 127).repeat_interleave(32, 1)
        ref = src(f"layers.{i}.engram.embed.weight")
        out["engram_table_excess"] = _excess(deq, ref[: q.shape[0]], "e4m3")
    return out


def _files(ckpt: Path) -> dict:
    """What was written: the safetensors headers, the quantization_config, the tokenizer."""
    from safetensors import safe_open
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    headers = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(ckpt / fname), "pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                headers[key] = [list(sl.get_shape()), sl.get_dtype()]
    cfg = json.loads((ckpt / "config.json").read_text())
    return {"index_names": sorted(index["weight_map"]), "headers": headers,
            "quantization_config": cfg.get("quantization_config"),
            "expert_dtype_top": cfg.get("expert_dtype"),
            "tokenizer": (ckpt / "tokenizer.json").is_file()}


def run_case(config: str, fmt: str, extra: dict, out_dir: Path) -> dict:
    import make_checkpoint as mk
    import torch
    from vllm.config import set_current_vllm_config

    cfg = mk.load_config(CONFIGS / config, {**SMALL, **extra})
    ckpt = out_dir / f"{config}-{fmt}"
    mk.write_checkpoint(cfg, fmt, ckpt, seed=0, threads=2, log=lambda *a: None)
    vcfg, info = _vllm_config(ckpt)
    cls = _model_class(info["architecture"])
    info["model_class"] = f"{cls.__module__}.{cls.__name__}"
    torch.set_default_dtype(torch.bfloat16)
    with set_current_vllm_config(vcfg):
        model = cls(vllm_config=vcfg, prefix="")
    params = dict(model.named_parameters())
    attn = next(m for n, m in model.named_modules() if n.endswith("layers.0.attn"))
    info["attention_class"] = type(attn).__name__
    inner = getattr(model, "language_model", model).model
    info["engram_hash_built"] = getattr(inner, "engram_hash", None) is not None

    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    # Every loader call records what it was handed: a written tensor that no loader
    # received was dropped between the name mapping and the parameters. Loaders get
    # the tensor itself or a view at offset 0 (an e8m0 scale viewed as uint8, a narrow
    # at TP 1), so its data pointer identifies it; the vision wrapper clones the few
    # tensors outside language_model.*, so their bytes identify those. The written
    # tensors are kept alive, so no address is reused.
    seen_ptr: set[int] = set()
    seen_bytes: set[str] = set()
    written: dict = {}
    written_ptr: set[int] = set()

    def fingerprint(t) -> str:
        return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8)
                              .numpy().tobytes()).hexdigest()

    def recording(fn):
        def loader(param, loaded_weight, *a, **k):
            ptr = loaded_weight.data_ptr()
            seen_ptr.add(ptr)
            if ptr not in written_ptr:  # a copy (the wrapper's deferred tensors)
                seen_bytes.add(fingerprint(loaded_weight))
            return fn(param, loaded_weight, *a, **k)
        return loader

    for p in params.values():
        p.weight_loader = recording(getattr(p, "weight_loader", default_weight_loader))

    def weights():
        for name, t in _read(ckpt):
            written[name] = t
            written_ptr.add(t.data_ptr())
            yield name, t

    with set_current_vllm_config(vcfg):
        loaded = model.load_weights(weights())
    info["num_params"] = len(params)
    info["num_tensors"] = len(written)
    info["params_not_loaded"] = sorted(set(params) - set(loaded))
    info["tensors_not_received"] = sorted(
        n for n, t in written.items()
        if t.data_ptr() not in seen_ptr and fingerprint(t) not in seen_bytes)
    info["distinct_tensor_addresses"] = len({t.data_ptr() for t in written.values()})

    def qm(suffix):
        for n, m in model.named_modules():
            if (n.endswith(suffix) or n.endswith(suffix + ".routed_experts")) \
                    and getattr(m, "quant_method", None) is not None:
                return type(m.quant_method).__name__
        return None
    info["quant_methods"] = {s: qm(s) for s in ("layers.0.attn.wq_b", "layers.0.attn.wo_a",
                                                "layers.0.ffn.experts",
                                                "layers.0.ffn.shared_experts.down_proj",
                                                "layers.0.ffn.gate")}
    info["values"] = _check_values(model, fmt, cfg, 0)
    info["files"] = _files(ckpt)
    del model, written
    shutil.rmtree(ckpt, ignore_errors=True)
    return info


def main() -> int:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        _stub_platform()
        from vllm.config import DeviceConfig, VllmConfig
        from vllm_probe_common import dist_init as _dist_init
        _dist_init(str(out_dir), VllmConfig(device_config=DeviceConfig(device="cpu")))
        RESULTS["_setup"] = {"ok": True}
    except BaseException as e:  # noqa: BLE001 - the probe reports everything
        RESULTS["_setup"] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc()[-3000:]}
    if RESULTS["_setup"]["ok"]:
        for config, fmt, extra in CASES:
            t = time.perf_counter()
            try:
                RESULTS[f"{config}/{fmt}"] = {"ok": True,
                                              **run_case(config, fmt, extra, out_dir)}
            except BaseException as e:  # noqa: BLE001
                RESULTS[f"{config}/{fmt}"] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                              "trace": traceback.format_exc()[-3000:]}
            RESULTS[f"{config}/{fmt}"]["seconds"] = round(time.perf_counter() - t, 2)
    RESULTS["_seconds"] = round(time.perf_counter() - t0, 2)
    RESULTS["_small"] = SMALL
    RESULTS["_extra"] = {f"{c}/{f}": e for c, f, e in CASES}
    sys.stdout.write("\n" + json.dumps(RESULTS) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    sys.exit(main())
