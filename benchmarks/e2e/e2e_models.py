"""The checkpoints and serving modes of benchmarks/e2e/e2e.py, shared by its steps' modules
(long_step.py, refcheck.py): which configs it builds, in which format, and the modes run.py
serves them in."""
from __future__ import annotations

# (name, config folder, checkpoint format)
MODELS = {
    "v41-mini": ("v41-mini", "mxfp8"),
    "v4-mini": ("v4-mini", "fp8"),
    "v41-tput": ("v41-tput", "mxfp8"),
    "v41-long": ("v41-long", "mxfp8"),
    "v4-long": ("v4-long", "fp8"),
    # The minis with a speculative draft in the checkpoint (tools/ckptgen/spec.py); no
    # name here begins with another name and "-" (e2e.py's _split_tag reads run tags).
    "v41-dspark-mini": ("v41-dspark-mini", "mxfp8"),
    "v4-mtp-mini": ("v4-mtp-mini", "fp8"),
    "v4-dspark-mini": ("v4-dspark-mini", "fp8"),
}
# name -> (vLLM speculative method, num_speculative_tokens): DSpark at the block size its
# config declares (dspark_block_size 5), MTP at its one trained step.
SPEC_MODELS = {"v41-dspark-mini": ("dspark", 5), "v4-mtp-mini": ("mtp", 1),
               "v4-dspark-mini": ("dspark", 5)}
AGREE_MODELS = ("v41-mini", "v4-mini")
TPUT_MODEL = "v41-tput"
MODES = ("a100", "sm90", "upstream")

# Per-rank shapes on one GPU: what one rank of TP 2 / 4 / 8 holds of each agreement model.
# vLLM 0.33.0 splits wq_b by heads (column-parallel), wo_a by o_groups (column-parallel) and
# wo_b by its input (row-parallel); fused_wqa_wkv, the indexer and the compressor are
# replicated. So a rank is the model with num_attention_heads and o_groups divided by the TP
# degree (64 -> 32 / 16 / 8 heads, 8 -> 4 / 2 / 1 groups, 8 heads per group throughout) and
# every other size kept (index_n_heads stays 64). name -> (agreement model, TP degree); the
# configs in configs/<name>/ are per_rank_config of the agreement model's
# (tests/test_e2e_per_rank.py checks they still are).
PER_RANK_TPS = (2, 4, 8)
PER_RANK_MODELS = {f"{base.split('-')[0]}-tp{tp}-mini": (base, tp)
                   for base in AGREE_MODELS for tp in PER_RANK_TPS}
MODELS.update({name: (name, MODELS[base][1]) for name, (base, _) in PER_RANK_MODELS.items()})


def per_rank_config(raw: dict, tp: int) -> dict:
    """The config.json of one rank of TP ``tp`` of the model ``raw`` (V4.1 nests its text
    config under "text_config", V4 is flat): heads and o_groups divided by ``tp``."""
    import copy
    out = copy.deepcopy(raw)
    text = out["text_config"] if "text_config" in out else out
    heads, groups = int(text["num_attention_heads"]), int(text["o_groups"])
    if heads % tp or groups % tp:
        raise ValueError(f"{heads} heads / {groups} o_groups do not split {tp} ways")
    text["num_attention_heads"], text["o_groups"] = heads // tp, groups // tp
    return out


# The row kernels of the per-rank models' rows (e2e.py writes them as it writes the 64-head
# models' rows, then renames them here): their own names, so that benchmarks/results/INDEX.md
# keeps a 64-head file as the current agreement, reference and zero-compile results.
PER_RANK_ROWS = (dict(kernel="per_rank_sm80_audit", of="sm80_audit"),
                 dict(kernel="per_rank_agreement", of="e2e_agreement"),
                 dict(kernel="per_rank_vs_fp32_reference", of="e2e_vs_fp32_reference"),
                 dict(kernel="per_rank_reference_check", of="e2e_reference_check"),
                 dict(kernel="per_rank_zero_compile", of="zero_compile"))
PER_RANK_KERNEL = {r["of"]: r["kernel"] for r in PER_RANK_ROWS}
# The long step's 128K agreement rows (long_step.long_agreement_rows), likewise under their
# own names: a long run is not the agreement models' current agreement or reference file.
LONG_ROWS = (dict(kernel="long_agreement", of="e2e_agreement"),
             dict(kernel="long_vs_fp32_reference", of="e2e_vs_fp32_reference"),
             dict(kernel="long_reference_check", of="e2e_reference_check"))
LONG_KERNEL = {r["of"]: r["kernel"] for r in LONG_ROWS}
BASE_KERNEL = {r["kernel"]: r["of"] for r in PER_RANK_ROWS + LONG_ROWS}


def per_rank_rows(rows: list[dict]) -> list[dict]:
    """``rows`` with those of per-rank models under PER_RANK_ROWS' kernels, their shape
    naming the agreement model and TP degree they are a rank of and the rank's heads and
    o_groups."""
    out = []
    for r in rows:
        name = (r.get("shape") or {}).get("model")
        if name in PER_RANK_MODELS and r.get("kernel") in PER_RANK_KERNEL:
            base, tp = PER_RANK_MODELS[name]
            heads, groups = per_rank_heads(name)
            r = dict(r, kernel=PER_RANK_KERNEL[r["kernel"]],
                     shape=dict(r["shape"], rank_of=base, tp=tp, heads=heads, o_groups=groups))
        out.append(r)
    return out


def per_rank_heads(name: str) -> tuple[int, int]:
    """(num_attention_heads, o_groups) of the config in configs/<name>/."""
    import json
    from pathlib import Path
    raw = json.loads((Path(__file__).resolve().parent / "configs" / MODELS[name][0]
                      / "config.json").read_text())
    text = raw.get("text_config", raw)
    return int(text["num_attention_heads"]), int(text["o_groups"])
