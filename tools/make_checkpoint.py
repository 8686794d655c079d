#!/usr/bin/env python3
"""Deterministic random-weight checkpoints for DeepSeek-V4.1 / DeepSeek-V4 model configs.

    python tools/make_checkpoint.py CONFIG_DIR --format {bf16,fp8,mxfp8} --out DIR
                                    [--seed N] [--set KEY=JSON ...] [--list]
                                    [--spec {mtp,dspark}]

CONFIG_DIR holds a Hugging Face config.json (benchmarks/e2e/configs/*). The output folder
gets config.json (with the "quantization_config" of the format), safetensors shards plus
model.safetensors.index.json under the tensor names of the published checkpoints (the
names vLLM's ``load_weights`` and ``hf_to_vllm_mapper`` take as input), and a word-level
tokenizer over the vocabulary (tools/ckptgen/tokenizer.py: ``vllm serve`` and ``vllm bench
serve`` need one, and vLLM builds Engram's n-gram token map from it at start-up).

Formats (the published layouts; see benchmarks/e2e/README.md):
  bf16   no quantization_config: linears and routed experts bf16, mHC/sink/bias fp32.
  fp8    DeepSeek-V4 style: fp8 e4m3 linears in [128, 128] blocks with UE8M0
         (float8_e8m0fnu) ``.scale``, MXFP4 routed experts (e2m1 pairs in uint8, one
         UE8M0 scale per 32 inputs).
  mxfp8  DeepSeek-V4.1 style: fp8 e4m3 linears in [32, 32] blocks with UE8M0 ``.scale``,
         MXFP4 routed experts. V4.1 configs only (V4's quant config has no MXFP8 path).
Under every format the Engram tables are fp8 rows with one UE8M0 scale per 32 values
(the only layout vLLM's Engram embedding stores), and the modules vLLM builds without a
quantization config (router gate, compressors, indexer weights_proj / wk) stay bf16.

Every tensor is drawn from a generator seeded by (--seed, tensor name), rounded to bf16,
and the fp8 / mxfp8 checkpoints quantize those same bf16 values. Scales are realistic:
linears N(0, 1/fan_in), norms near 1, embeddings N(0, 1), small sinks and biases, mHC
mixing parameters that keep the Sinkhorn iteration well conditioned.

--set KEY=JSON overrides a text-config field before writing (for example
``--set vocab_size=4096`` for a fast CPU test); with Engram on, the word-level tokenizer
has one token per vocabulary entry, so engram_compressed_vocab_size follows vocab_size
unless it is set explicitly. --list prints the tensor table (name, shape, dtype) and
writes nothing. torch is required; safetensors only for writing.
"""
# The config loading, the tensor table and the formats' encoders / decoders live in the
# package tools/ckptgen/ beside this file; this command draws the values, quantizes them per
# format and writes the shards, and re-exports the package's names for its importers.
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ToolError, run_main  # noqa: E402
from ckptgen.config import (ModelConfig, check_config, engram_head_sizes,  # noqa: E402,F401
                            load_config)
from ckptgen.formats import (E2M1_GRID, E2M1_MAX, E4M3_MAX, ENGRAM_SCALE_BLOCK,  # noqa: E402,F401
                             FORMATS, LINEAR_BLOCK, MXFP4_BLOCK, dequantize_fp8_blocks,
                             dequantize_mxfp4, e8m0_from_exponent, e8m0_to_float,
                             quantize_fp8_blocks, quantize_mxfp4, ue8m0_exponent)
from ckptgen.spec import SPEC_METHODS, apply_spec, spec_tensor_specs  # noqa: E402
from ckptgen.tensors import Spec, v4_layer_specs, v41_layer_specs  # noqa: E402,F401
from ckptgen.tensors import tensor_specs as target_tensor_specs  # noqa: E402
from ckptgen.tokenizer import write_for_config, write_tokenizer  # noqa: E402,F401

# Initial-value scales (see the module docstring).
# Norm weights: 1 + N(0, NORM_JITTER) -- trained RMSNorm gains sit near 1.
NORM_JITTER = 0.05
# LM head: logits of std HEAD_LOGIT_STD for a unit-RMS final hidden state, so the
# next-token distribution is peaked (top logprob a few nats above -ln(vocab)) and greedy
# tokens are decisive, as in a trained model; 1/sqrt(hidden) would give logits of std 1.
HEAD_LOGIT_STD = 3.0
# Attention sinks (one fp32 logit per head, added to the softmax denominator): small
# against the q.k/sqrt(d) scores, which are O(1).
SINK_STD = 0.5
# Router e_score_correction_bias: a small selection-only offset.
GATE_BIAS_STD = 0.01
# V4 compressor position bias (ape), added to the pooling scores: small.
APE_STD = 0.02
# mHC: fn rows N(0, 1/(hc*hidden)) make the RMS-normed mixes ~N(0, 1); hc_scale in
# [HC_SCALE_LO, HC_SCALE_HI] keeps their input-dependent part mild; pre/post bases
# N(0, HC_BASE_STD) (sigmoids around 0.5 / post around 1); the residual-mix base is
# HC_COMB_DIAG on the diagonal plus N(0, HC_BASE_STD) noise, so each stream keeps most
# of itself (softmax row diag ~0.7 at hc_mult 4) and the Sinkhorn normalization
# converges in a few iterations.
HC_SCALE_LO, HC_SCALE_HI = 0.1, 0.3
HC_BASE_STD = 0.5
HC_COMB_DIAG = 2.0
# Engram table rows: embedding-like values, N(0, 1).
ENGRAM_ROW_STD = 1.0
# Default shard size of the safetensors files (bytes of tensor data): one shard is held
# in memory while it is written, and 2 GiB keeps each mini checkpoint in a single file.
SHARD_BYTES = 2 << 30
# Default cap on the tensors drawn in parallel: the draw is memory-bound past a few
# threads, and each thread holds up to two tensors in flight.
MAX_THREADS = 8


# --------------------------------------------------------------------------- values
def tensor_specs(cfg: ModelConfig) -> list[Spec]:
    """The target's tensors, then the speculative draft's the config declares
    (ckptgen/spec.py: V4 MTP, V4.1/V4 DSpark; none without one)."""
    return target_tensor_specs(cfg) + spec_tensor_specs(cfg)


def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, tensor name): values do not depend on the
    order or presence of other tensors."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def draw(spec: Spec, seed: int) -> torch.Tensor:
    """The tensor's values in its bf16-checkpoint dtype (bf16 or fp32)."""
    g = torch.Generator().manual_seed(name_seed(seed, spec.name))
    shape, init = spec.shape, spec.init

    def normal(mean=0.0, std=1.0):
        return torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=g)

    if init == "fan_in":
        x = normal(std=1.0 / math.sqrt(shape[-1]))
    elif init == "norm":
        x = normal(1.0, NORM_JITTER)
    elif init == "embed":
        x = normal()
    elif init == "head":
        x = normal(std=HEAD_LOGIT_STD / math.sqrt(shape[-1]))
    elif init == "sink":
        x = normal(std=SINK_STD)
    elif init == "gate_bias":
        x = normal(std=GATE_BIAS_STD)
    elif init == "ape":
        x = normal(std=APE_STD)
    elif init == "engram_row":
        x = normal(std=ENGRAM_ROW_STD)
    elif init == "hc_scale":
        x = torch.empty(shape).uniform_(HC_SCALE_LO, HC_SCALE_HI, generator=g)
    elif init == "hc_head_base":
        x = normal(std=HC_BASE_STD)
    elif init.startswith("hc_base:"):
        hc = int(init.split(":")[1])
        x = normal(std=HC_BASE_STD)
        x[2 * hc:] += HC_COMB_DIAG * torch.eye(hc).flatten()
    else:  # pragma: no cover - a Spec built above with an unknown init
        raise AssertionError(init)
    return x.to(spec.dtype)


def materialize(spec: Spec, fmt: str, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one Spec under a format: ``name`` (and ``.scale``)."""
    w = draw(spec, seed)
    scale_name = spec.name[: -len(".weight")] + ".scale" if spec.name.endswith(".weight") \
        else None
    if spec.kind == "engram_table":
        q, s = quantize_fp8_blocks(w, 1, ENGRAM_SCALE_BLOCK, spec.name)
        return {spec.name: q, scale_name: s}
    if fmt == "bf16" or spec.kind == "dense":
        return {spec.name: w}
    if spec.kind == "expert":
        q, s = quantize_mxfp4(w, spec.name)
        return {spec.name: q, scale_name: s}
    q, s = quantize_fp8_blocks(w, *LINEAR_BLOCK[fmt], spec.name)
    return {spec.name: q, scale_name: s}


def quantization_config(cfg: ModelConfig, fmt: str) -> dict | None:
    """The config.json "quantization_config" the published checkpoints declare."""
    if fmt == "bf16":
        return None
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
          "scale_fmt": "ue8m0", "weight_block_size": list(LINEAR_BLOCK[fmt])}
    if cfg.kind == "deepseek_v41":
        # DeepseekV41Config lifts expert_dtype out of the quantization config.
        qc["expert_dtype"] = "fp4"
    return qc


def output_config(cfg: ModelConfig, fmt: str) -> dict:
    raw = copy.deepcopy(cfg.raw)
    raw.pop("quantization_config", None)
    # Any 4.x version tells transformers' tokenizer loader this is no Mistral checkpoint
    # (without the field it warns about a "Mistral regex" for every local tokenizer).
    raw.setdefault("transformers_version", "4.57.1")
    qc = quantization_config(cfg, fmt)
    if qc is not None:
        raw["quantization_config"] = qc
    if cfg.kind == "deepseek_v4" and fmt != "bf16":
        # DeepseekV4FP8Config keys the expert method and the e8m0 linear scales off it.
        raw["expert_dtype"] = "fp4"
    return raw


def checkpoint_table(cfg: ModelConfig, fmt: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every written tensor, without drawing values."""
    out = []
    for spec in tensor_specs(cfg):
        n, k = spec.shape[0], spec.shape[-1]
        if spec.kind == "engram_table":
            out += [(spec.name, spec.shape, torch.float8_e4m3fn),
                    (spec.name[:-7] + ".scale", (n, k // ENGRAM_SCALE_BLOCK),
                     torch.float8_e8m0fnu)]
        elif fmt == "bf16" or spec.kind == "dense":
            out.append((spec.name, spec.shape, spec.dtype))
        elif spec.kind == "expert":
            out += [(spec.name, (n, k // 2), torch.uint8),
                    (spec.name[:-7] + ".scale", (n, k // MXFP4_BLOCK), torch.float8_e8m0fnu)]
        else:
            bn, bk = LINEAR_BLOCK[fmt]
            out += [(spec.name, spec.shape, torch.float8_e4m3fn),
                    (spec.name[:-7] + ".scale", (n // bn, k // bk), torch.float8_e8m0fnu)]
    return out


# --------------------------------------------------------------------------- writing
def _materialize_all(specs: list[Spec], fmt: str, seed: int, threads: int):
    """materialize() of every Spec, in order, on a thread pool (torch releases the GIL;
    each tensor has its own generator, so the values do not depend on the schedule).
    At most 2 * threads tensors are in flight, which bounds the memory."""
    if threads <= 1:
        for spec in specs:
            yield materialize(spec, fmt, seed)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()
        for spec in specs:
            pending.append(pool.submit(materialize, spec, fmt, seed))
            if len(pending) >= 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def write_checkpoint(cfg: ModelConfig, fmt: str, out: Path, seed: int = 0,
                     shard_bytes: int = SHARD_BYTES, threads: int | None = None,
                     log=print) -> dict:
    """Write config.json, the tokenizer, the shards and their index."""
    if fmt not in FORMATS:
        raise ToolError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt == "mxfp8" and cfg.kind != "deepseek_v41":
        raise ToolError(f"{cfg.source}: --format mxfp8 is the DeepSeek-V4.1 layout; "
                        "DeepSeek-V4 checkpoints use --format fp8")
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ToolError("writing needs the `safetensors` package (pip install "
                        "'safetensors>=0.6.2'; 0.6 added the F8_E8M0 dtype)") from e
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ToolError(f"--out {out}: folder exists and is not empty; pick a new folder")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(output_config(cfg, fmt), indent=2) + "\n")
    write_for_config(out, cfg.raw)   # ckptgen/tokenizer.py: every checkpoint ships one

    specs = tensor_specs(cfg)
    if threads is None:
        threads = max(1, min(MAX_THREADS, torch.get_num_threads()))
    shards: list[list[str]] = []
    weight_map: dict[str, str] = {}
    current: dict[str, torch.Tensor] = {}
    current_bytes = total = 0

    def flush():
        nonlocal current, current_bytes
        if not current:
            return
        shards.append(list(current))
        path = out / f"_shard{len(shards)}.safetensors"
        save_file(current, str(path), metadata={"format": "pt"})
        path.chmod(0o644)  # safetensors creates 0600; the engine may run as another user
        current, current_bytes = {}, 0

    for tensors in _materialize_all(specs, fmt, seed, threads):
        for name, t in tensors.items():
            t = t.contiguous()
            nbytes = t.numel() * t.element_size()
            if current and current_bytes + nbytes > shard_bytes:
                flush()
            current[name] = t
            current_bytes += nbytes
            total += nbytes
    flush()
    n = len(shards)
    for k, names in enumerate(shards, 1):
        final = f"model-{k:05d}-of-{n:05d}.safetensors"
        (out / f"_shard{k}.safetensors").rename(out / final)
        weight_map.update({name: final for name in names})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    log(f"wrote {out}: {cfg.kind} {fmt}, {len(weight_map)} tensors, {total / 2**20:.1f} MiB "
        f"in {n} shard(s), seed {seed}")
    return {"tensors": len(weight_map), "bytes": total, "shards": n}


# --------------------------------------------------------------------------- CLI
def parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ToolError(f"--set {item!r}: expected KEY=VALUE (VALUE in JSON, e.g. "
                            "vocab_size=4096 or engram_layer_ids=[])")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise ToolError(f"--set {item!r}: VALUE is not JSON ({e})") from e
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config_dir", type=Path)
    ap.add_argument("--format", choices=FORMATS, default="bf16")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    ap.add_argument("--shard-mb", type=int, default=SHARD_BYTES >> 20)
    ap.add_argument("--threads", type=int, default=None,
                    help="tensors drawn in parallel (default: torch's thread count, "
                    f"at most {MAX_THREADS})")
    ap.add_argument("--list", action="store_true", help="print the tensor table only")
    ap.add_argument("--spec", choices=SPEC_METHODS, default=None,
                    help="add a speculative draft's config keys (defaults where the "
                    "config lacks them) and tensors: V4 MTP or V4.1/V4 DSpark "
                    "(ckptgen/spec.py); a config with the keys gets them anyway")
    args = ap.parse_args(argv)
    cfg = load_config(args.config_dir, parse_set(args.set))
    apply_spec(cfg, args.spec)
    if args.list:
        for name, shape, dtype in checkpoint_table(cfg, args.format):
            print(f"{name}\t{list(shape)}\t{str(dtype).removeprefix('torch.')}")
        return 0
    if args.out is None:
        raise ToolError("--out DIR is required (or --list)")
    write_checkpoint(cfg, args.format, args.out, args.seed, args.shard_mb << 20, args.threads)
    return 0


if __name__ == "__main__":
    run_main(main)
