"""Pipeline splits of DeepSeek-V4.1 (overlay/vllm/deepinfer/pp_split.py) on the PATCHED vLLM
tree, CPU only. Run by tests/test_pp_split.py in a subprocess:

    CUDA_VISIBLE_DEVICES= PYTHONPATH=build/patched python tests/pp_split_probe.py

One JSON object on the last stdout line:

* ``splits``: per config (the e2e configs' topologies and upstream's 40-layer V4.1 layout) and
  pipeline size, the stage sizes vLLM's own ``get_pp_indices`` builds with
  VLLM_PP_LAYER_PARTITION unset, the check's verdict (None or its message), and, when
  refused, the suggested VLLM_PP_LAYER_PARTITION set and fed back through
  ``get_pp_indices``: its sizes and verdict.
* ``env``: a cutting VLLM_PP_LAYER_PARTITION a user set (its message names it), and one that
  does not sum to the layers (vLLM's own ValueError, untouched).
* ``construct``: Ampere V4.1 attention layers built as vLLM builds a stage (tiny geometry, the
  configs' topology, pipeline_parallel_size 2): the stage's first layer under a cutting split
  (our PipelineSplitError), the same with our check switched off (upstream's own
  NotImplementedError: which message, from which layer), and a stage of the suggested split
  built layer by layer (no error).
Not collected by pytest (no ``test_`` prefix).
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "benchmarks" / "e2e" / "configs"
TOPOLOGY = ("num_hidden_layers", "compress_ratios", "kv_source_layer_ids",
            "index_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks")
# Upstream's V4.1 layout (tests/test_yoco.py, benchmarks/yoco_stack.py): 40 layers, ratios 0 /
# 2 / 1, KV sources 2, 8, 14, 20, index sources 2 ... 36, the candidate source at 20 (its
# later ratio-1 indexers 24/28/32/36 mask with it: models/deepseek_v41/nvidia/model.py), and
# three trailing draft entries.
REAL_V41 = dict(num_hidden_layers=40, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
                kv_source_layer_ids=[2, 8, 14, 20],
                index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
                candidate_source_layer_id=20, candidate_topk_blocks=16)
MODELS = ("v41-tput", "v41-long", "v41-dspark-mini", "v41-mini", "v4-mini", "v4-long")
PPS = (2, 3, 4)


def topology(name: str) -> dict:
    if name == "v41-real":
        return dict(REAL_V41)
    c = json.loads((CONFIGS / name / "config.json").read_text())
    c = c.get("text_config", c)
    return {k: c[k] for k in TOPOLOGY if k in c}


def _verdict(hf, sizes, where=""):
    from vllm.deepinfer import pp_split
    try:
        pp_split.check(hf, sizes, where, os.environ.get(pp_split.ENV) or None)
    except pp_split.PipelineSplitError as e:
        return str(e)
    return None


def splits() -> dict:
    from vllm.deepinfer import pp_split
    os.environ.pop(pp_split.ENV, None)
    out = {}
    for name in (*MODELS, "v41-real"):
        topo = topology(name)
        hf = SimpleNamespace(**topo)
        L = int(hf.num_hidden_layers)
        per = {}
        for pp in PPS:
            sizes = pp_split.stage_sizes(L, pp)
            row = dict(sizes=sizes, verdict=_verdict(hf, sizes))
            fix = pp_split.nearest_split(L, sizes, pp_split.groups(pp_split.links(hf)))
            row["suggested"] = fix
            if row["verdict"] is not None and fix is not None:
                os.environ[pp_split.ENV] = ",".join(map(str, fix))
                try:
                    fs = pp_split.stage_sizes(L, pp)
                    row.update(suggested_sizes=fs, suggested_verdict=_verdict(hf, fs))
                finally:
                    os.environ.pop(pp_split.ENV, None)
            per[str(pp)] = row
        out[name] = dict(layers=L, groups=pp_split.groups(pp_split.links(hf)), pp=per)
    return out


def env_cases() -> dict:
    from vllm.deepinfer import pp_split
    hf = SimpleNamespace(**topology("v41-tput"))
    out = {}
    os.environ[pp_split.ENV] = "4,8"
    try:
        sizes = pp_split.stage_sizes(12, 2)
        out["cutting"] = dict(sizes=sizes, verdict=_verdict(hf, sizes, "model.layers.4.attn"))
        os.environ[pp_split.ENV] = "5,5"
        try:
            pp_split.stage_sizes(12, 2)
            out["bad_sum"] = None
        except ValueError as e:
            out["bad_sum"] = f"{type(e).__name__}: {e}"
    finally:
        os.environ.pop(pp_split.ENV, None)
    return out


# --------------------------------------------------------------------------- construction
def _stage(name: str, partition: str | None, layers, check_on: bool = True) -> dict:
    """Build ``layers`` in order, as make_layers builds one stage, on a fresh config with the
    topology of ``name`` and pipeline_parallel_size 2 (VLLM_PP_LAYER_PARTITION=partition)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.deepinfer import pp_split
    from vllm.deepinfer.attention import selector

    from spec_decode_common import vllm_config
    vcfg = vllm_config("deepseek_v41", 0, None, False, "cpu")
    for k, v in topology(name).items():
        setattr(vcfg.model_config.hf_config, k, v)
    vcfg.parallel_config.pipeline_parallel_size = 2
    hf = vcfg.model_config.hf_config
    buf = torch.full((64, hf.index_topk), -1, dtype=torch.int32)
    cand = torch.full((64, hf.candidate_topk_blocks), -1, dtype=torch.int32)
    saved = pp_split.check_layer
    if not check_on:
        pp_split.check_layer = lambda *a, **k: None
    if partition is None:
        os.environ.pop(pp_split.ENV, None)
    else:
        os.environ[pp_split.ENV] = partition
    built = []
    try:
        with set_current_vllm_config(vcfg):
            for i in layers:
                selector.ampere_class("deepseek_v41")(
                    vcfg, prefix=f"model.layers.{i}.attn", topk_indices_buffer=buf,
                    aux_stream_list=None, candidate_block_buffer=cand)
                built.append(i)
    except Exception as e:  # noqa: BLE001 - what the engine would see
        return dict(error=type(e).__name__, message=str(e), built=built,
                    at=f"model.layers.{layers[len(built)]}.attn")
    finally:
        pp_split.check_layer = saved
        os.environ.pop(pp_split.ENV, None)
    return dict(error=None, built=built)


def construct() -> dict:
    return {
        # v41-tput at PP2, vLLM's even split 6,6: stage 1 starts at layer 6 (reads layer 5).
        "tput_stage1_ours": _stage("v41-tput", None, [6, 7]),
        "tput_stage0_ours": _stage("v41-tput", None, [0, 1]),
        "tput_stage1_upstream": _stage("v41-tput", None, [6, 7], check_on=False),
        "tput_stage0_upstream": _stage("v41-tput", None, [0, 1, 2, 3, 4, 5], check_on=False),
        # the suggested split 5,7: stage 1 is layers 5-11, built in order.
        "tput_stage1_fixed": _stage("v41-tput", "5,7", list(range(5, 12))),
        # v41-long at PP2, even split 4,3: stage 1 starts at layer 4, an index source reading
        # layer 3's index keys.
        "long_stage1_ours": _stage("v41-long", None, [4, 5, 6]),
        "long_stage1_upstream": _stage("v41-long", None, [4, 5, 6], check_on=False),
        "long_stage1_fixed": _stage("v41-long", "3,4", [3, 4, 5, 6]),
    }


def main() -> int:
    res: dict = {}
    try:
        from spec_decode_common import _setup
        _setup("cpu")
        res["splits"] = splits()
        res["env"] = env_cases()
        res["construct"] = construct()
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
