"""Speculative-draft checkpoints of tools/make_checkpoint.py (--spec, tools/ckptgen/spec.py)
loaded by vLLM 0.33.0's own draft model classes, on CPU. Run by tests/test_ckpt_spec.py in a
subprocess:

    CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched python tests/ckpt_spec_probe.py WORK_DIR

Per case (reduced sizes, the topology of the e2e config) it writes a checkpoint, builds
vLLM's real ``SpeculativeConfig`` for it (the draft ModelConfig read from the same folder,
its hf_config rewritten by upstream: DeepSeekV4MTPModel, DSparkDraftModel,
DSparkV41DraftModel), constructs the class vLLM's registry names for the draft on a faked
SM80 device (tests/checkpoint_load_probe.py's stubs: no kernels run) and runs its real
``load_weights`` on the safetensors; then the target's class on the same files. Recorded:
the parameters no tensor reached, the tensors no loader received, the attention classes and
compress ratios of the draft's layers, vLLM's dequantization of a loaded draft linear
against the tool's bf16 source, exact copies of the dense draft tensors, and the speculative
config vLLM derived (method, k, whether V4.1's method="mtp" is refused and with what).
Prints one JSON object (the last stdout line). Not collected by pytest (no ``test_`` prefix).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import checkpoint_load_probe as clp  # noqa: E402  (stubs, config, reader, excess)

# (e2e config, format, speculative method, num_speculative_tokens, also load the target)
CASES = [("v4-mtp-mini", "fp8", "mtp", 1, True),
         ("v41-dspark-mini", "mxfp8", "dspark", 5, True),
         ("v41-dspark-mini", "bf16", "dspark", 5, False),
         ("v4-dspark-mini", "fp8", "dspark", 5, True)]
# Fewer stages than the e2e configs' 3 keep the probe short; one is enough for the names
# of every stage-indexed tensor except the head stack, so two.
EXTRA = {"n_mtp_layers": 2}
RESULTS: dict = {}


def _load(cls, vcfg, ckpt: Path) -> tuple[dict, object]:
    """Construct ``cls`` and run its load_weights on the checkpoint, recording which written
    tensors reached a parameter loader, as tests/checkpoint_load_probe.py does: by data
    pointer (loaders get the tensor or a view at offset 0; the V4 DSpark loader's context
    projection a detached alias), by bytes for the copies V4.1's vision wrapper makes."""
    import hashlib

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    torch.set_default_dtype(torch.bfloat16)
    with set_current_vllm_config(vcfg):
        model = cls(vllm_config=vcfg, prefix="")
    params = dict(model.named_parameters())
    seen_ptr: set[int] = set()
    seen_bytes: set[str] = set()
    written: dict = {}
    written_ptr: set[int] = set()

    def fingerprint(t) -> str:
        return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8)
                              .numpy().tobytes()).hexdigest()

    def recording(fn):
        def loader(param, loaded_weight, *a, **k):
            seen_ptr.add(loaded_weight.data_ptr())
            if loaded_weight.data_ptr() not in written_ptr:
                seen_bytes.add(fingerprint(loaded_weight))
            return fn(param, loaded_weight, *a, **k)
        return loader
    for p in params.values():
        p.weight_loader = recording(getattr(p, "weight_loader", default_weight_loader))

    def weights():
        for name, t in clp._read(ckpt):
            written[name] = t
            written_ptr.add(t.data_ptr())
            yield name, t
    with set_current_vllm_config(vcfg):
        loaded = model.load_weights(weights())
    attn = {n: (type(m).__name__, int(getattr(m, "compress_ratio", -1)))
            for n, m in model.named_modules() if n.endswith(".attn")}
    info = {"model_class": f"{type(model).__module__}.{type(model).__name__}",
            "num_params": len(params), "num_tensors": len(written),
            "distinct_tensor_addresses": len({t.data_ptr() for t in written.values()}),
            "params_not_loaded": sorted(set(params) - set(loaded)),
            "tensors_not_received": sorted(
                n for n, t in written.items()
                if t.data_ptr() not in seen_ptr and fingerprint(t) not in seen_bytes),
            "attention": attn}
    return info, model


def _draft_values(model, cfg, fmt: str, method: str, ckpt: Path) -> dict:
    """The draft's loaded parameters against the tool's source values."""
    import make_checkpoint as mk
    import torch
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (
        dequant_mxfp8_to_bf16,
    )
    params = dict(model.named_parameters())
    specs = {s.name: s for s in mk.tensor_specs(cfg)}
    src = lambda n: mk.draw(specs[n], 0)  # noqa: E731
    out: dict = {}
    if method == "mtp":
        L = cfg.need("num_hidden_layers")
        lin, pname = "mtp.0.e_proj.weight", f"model.layers.{L}.e_proj"
        dense = {"mtp.0.hc_head_fn": f"model.layers.{L}.hc_head_fn",
                 "mtp.0.norm.weight": f"model.layers.{L}.shared_head.norm.weight",
                 "mtp.0.enorm.weight": f"model.layers.{L}.enorm.weight"}
    else:
        last = int(cfg.need("n_mtp_layers")) - 1
        w1, w2 = ("embed", "head") if cfg.kind == "deepseek_v41" else ("markov_w1", "markov_w2")
        lin, pname = "mtp.0.main_proj.weight", "model.main_proj"
        dense = {f"mtp.{last}.markov_head.{w1}.weight": "model.markov_head.markov_w1.weight",
                 f"mtp.{last}.markov_head.{w2}.weight": "model.markov_head.markov_w2.weight",
                 f"mtp.{last}.confidence_head.proj.weight":
                     "model.confidence_head.proj.weight",
                 f"mtp.{last}.norm.weight": "model.norm.weight",
                 "mtp.0.main_norm.weight": "model.main_norm.weight"}
        out["confidence_head_kept"] = model.model.confidence_head is not None
    out["dense_equal"] = {k: bool(torch.equal(params[v].detach(), src(k))) for k, v in
                          dense.items()}
    w = params[pname + ".weight"]
    if fmt == "bf16":
        out["linear_equal"] = bool(torch.equal(w.float(), src(lin).float()))
    elif fmt == "mxfp8":
        s = params[pname + ".weight_scale"]
        out["linear_excess"] = clp._excess(dequant_mxfp8_to_bf16(w, s), src(lin), "e4m3")
    else:
        s = params[pname + ".weight_scale_inv"]
        deq = w.float() * s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
        out["linear_excess"] = clp._excess(deq, src(lin), "e4m3")
    if method == "dspark" and cfg.kind == "deepseek_v4":
        # The context projection stacks every stage's attn.wkv as loaded (bytes).
        ctx = params["model.context_wkv_proj.weight"].detach()
        rows = {n: t for n, t in clp._read(ckpt) if n.endswith(".attn.wkv.weight")}
        hd = cfg.need("head_dim")
        out["context_wkv_equal"] = all(
            torch.equal(ctx[i * hd:(i + 1) * hd].view(torch.uint8),
                        rows[f"mtp.{i}.attn.wkv.weight"].view(torch.uint8))
            for i in range(int(cfg.need("n_mtp_layers"))))
    return out


def _spec_config(vcfg, method: str, k: int):
    from vllm.config.speculative import SpeculativeConfig
    return SpeculativeConfig(method=method, num_speculative_tokens=k,
                             target_model_config=vcfg.model_config,
                             target_parallel_config=vcfg.parallel_config)


def run_case(config: str, fmt: str, method: str, k: int, target: bool, out_dir: Path) -> dict:
    import make_checkpoint as mk
    cfg = mk.load_config(clp.CONFIGS / config,
                         {**clp.SMALL, **(EXTRA if method == "dspark" else {})})
    ckpt = out_dir / f"{config}-{fmt}"
    mk.write_checkpoint(cfg, fmt, ckpt, seed=0, threads=2, log=lambda *a: None)
    info: dict = {"written_config": {key: cfg.get(key) for key in (
        "num_nextn_predict_layers", "dspark_target_layer_ids", "dspark_markov_rank",
        "dspark_noise_token_id", "dspark_block_size", "n_mtp_layers")}}
    on_disk = json.loads((ckpt / "config.json").read_text())
    on_disk = on_disk.get("text_config", on_disk)
    info["config_on_disk"] = {key: on_disk.get(key) for key in info["written_config"]}
    vcfg, _ = clp._vllm_config(ckpt)
    t = time.perf_counter()
    sc = _spec_config(vcfg, method, k)
    info["spec_config_seconds"] = round(time.perf_counter() - t, 2)
    dmc = sc.draft_model_config
    info["spec"] = {"method": sc.method, "k": sc.num_speculative_tokens,
                    "draft_architectures": list(dmc.architectures),
                    "draft_model_type": dmc.hf_config.model_type,
                    "use_dspark": bool(sc.use_dspark())}
    vcfg.speculative_config = sc
    draft, model = _load(clp._model_class(dmc.architectures[0]), vcfg, ckpt)
    draft["values"] = _draft_values(model, cfg, fmt, method, ckpt)
    info["draft"] = draft
    del model
    if target:
        vcfg.speculative_config = None
        info["target"], model = _load(clp._model_class(vcfg.model_config.architectures[0]),
                                      vcfg, ckpt)
        del model
    shutil.rmtree(ckpt, ignore_errors=True)
    return info


def v41_mtp_refused(out_dir: Path) -> dict:
    """method="mtp" on a V4.1 checkpoint (with its DSpark stages): vLLM's own refusal."""
    import make_checkpoint as mk
    cfg = mk.load_config(clp.CONFIGS / "v41-dspark-mini", {**clp.SMALL, **EXTRA})
    ckpt = out_dir / "v41-refusal"
    # The tensors play no part in the refusal: only config.json is read.
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(mk.output_config(cfg, "bf16")))
    vcfg, _ = clp._vllm_config(ckpt)
    try:
        _spec_config(vcfg, "mtp", 1)
    except ValueError as e:
        return {"refused": True, "message": str(e)}
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    return {"refused": False}


def main() -> int:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        clp._stub_platform()
        from vllm.config import DeviceConfig, VllmConfig
        from vllm_probe_common import dist_init
        dist_init(str(out_dir), VllmConfig(device_config=DeviceConfig(device="cpu")))
        RESULTS["_setup"] = {"ok": True}
    except BaseException as e:  # noqa: BLE001 - the probe reports everything
        RESULTS["_setup"] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc()[-3000:]}
    if RESULTS["_setup"]["ok"]:
        jobs = [(f"{c}/{f}", run_case, (c, f, m, k, tg, out_dir)) for c, f, m, k, tg in CASES]
        jobs.append(("v41/mtp", v41_mtp_refused, (out_dir,)))
        for key, fn, args in jobs:
            t = time.perf_counter()
            try:
                RESULTS[key] = {"ok": True, **fn(*args)}
            except BaseException as e:  # noqa: BLE001
                RESULTS[key] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                "trace": traceback.format_exc()[-3000:]}
            RESULTS[key]["seconds"] = round(time.perf_counter() - t, 2)
    RESULTS["_seconds"] = round(time.perf_counter() - t0, 2)
    RESULTS["_small"] = clp.SMALL
    RESULTS["_extra"] = EXTRA
    sys.stdout.write("\n" + json.dumps(RESULTS) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    sys.exit(main())
