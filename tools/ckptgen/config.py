"""A model config.json for the checkpoint tool: loaded with its model kind resolved, CLI
overrides applied, and the topology rules vLLM 0.33.0's model code relies on checked."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from _common import ToolError

from .formats import ENGRAM_SCALE_BLOCK


@dataclass
class ModelConfig:
    """A config.json with the model kind resolved; ``text`` is the dict the model reads
    (V4.1 nests it under "text_config", V4 is flat)."""

    raw: dict
    kind: str  # "deepseek_v41" | "deepseek_v4"
    source: str

    @property
    def text(self) -> dict:
        return self.raw["text_config"] if self.kind == "deepseek_v41" else self.raw

    def get(self, key: str, default=None):
        return self.text.get(key, default)

    def need(self, key: str):
        if key not in self.text:
            where = "text_config" if self.kind == "deepseek_v41" else "the top level"
            raise ToolError(f"{self.source}: {key} missing (expected in {where})")
        return self.text[key]


def load_config(config_dir: Path, overrides: dict | None = None) -> ModelConfig:
    path = Path(config_dir) / "config.json"
    if not path.is_file():
        raise ToolError(f"{path}: no config.json (pass a folder holding one)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ToolError(f"{path}: not valid JSON ({e})") from e
    model_type = raw.get("model_type")
    if model_type == "deepseek_v41":
        if not isinstance(raw.get("text_config"), dict):
            raise ToolError(f"{path}: model_type deepseek_v41 needs a text_config object")
    elif model_type != "deepseek_v4":
        raise ToolError(f"{path}: model_type {model_type!r} is neither deepseek_v41 nor "
                        "deepseek_v4")
    cfg = ModelConfig(copy.deepcopy(raw), model_type, str(path))
    overrides = dict(overrides or {})
    cfg.text.update(overrides)
    if (cfg.get("engram_layer_ids") and "vocab_size" in overrides
            and "engram_compressed_vocab_size" not in overrides):
        # The word-level tokenizer written beside the weights maps every token to its own
        # compressed id (see write_tokenizer).
        cfg.text["engram_compressed_vocab_size"] = cfg.text["vocab_size"]
    check_config(cfg)
    return cfg


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def engram_head_sizes(cfg: ModelConfig) -> list[list[int]]:
    """Bucket count of every (n-gram size, head) pair, per Engram layer: distinct primes
    above engram_vocab_size - 1 handed out in order over the layers, n-gram sizes and
    heads (vLLM's EngramLayout allocates them the same way)."""
    n_layers = len(cfg.get("engram_layer_ids") or [])
    per_layer = (int(cfg.need("engram_max_ngram_size")) - 1) * int(cfg.need("engram_n_heads"))
    primes, c = [], int(cfg.need("engram_vocab_size")) - 1
    while len(primes) < n_layers * per_layer:
        c += 1
        if _is_prime(c):
            primes.append(c)
    return [primes[i * per_layer:(i + 1) * per_layer] for i in range(n_layers)]


def check_config(cfg: ModelConfig) -> None:
    """The topology rules vLLM 0.33.0's model code relies on, one clear error each."""
    src = cfg.source
    L = int(cfg.need("num_hidden_layers"))
    H = int(cfg.need("hidden_size"))
    if H % 512:
        raise ToolError(f"{src}: hidden_size {H} must be a multiple of 512 (the mHC "
                        "prenorm GEMM splits it in 512-wide tiles)")
    if cfg.need("head_dim") != 512 or cfg.need("qk_rope_head_dim") != 64:
        raise ToolError(f"{src}: head_dim must be 512 and qk_rope_head_dim 64 (the "
                        "compressor and the KV record assume them)")
    if int(cfg.need("num_attention_heads")) % int(cfg.need("o_groups")):
        raise ToolError(f"{src}: num_attention_heads must be a multiple of o_groups")
    if int(cfg.get("num_hash_layers", 0) or 0) != 0:
        raise ToolError(f"{src}: num_hash_layers must be 0 (this tool writes no hash-routing "
                        "tid2eid tables)")
    ratios = cfg.need("compress_ratios")
    if len(ratios) < L:
        raise ToolError(f"{src}: compress_ratios has {len(ratios)} entries for {L} layers")
    if cfg.kind == "deepseek_v4":
        bad = [r for r in ratios[:L] if r not in (0, 4, 128)]
        if bad:
            raise ToolError(f"{src}: DeepSeek-V4 compress_ratios must be 0, 4 or 128; got {bad}")
        return
    bad = [r for r in ratios[:L] if r not in (0, 1, 2)]
    if bad:
        raise ToolError(f"{src}: DeepSeek-V4.1 compress_ratios must be 0, 1 or 2; got {bad}")
    kv = sorted(cfg.get("kv_source_layer_ids") or [])
    idx = sorted(cfg.get("index_source_layer_ids") or [])
    if not kv or not idx:
        raise ToolError(f"{src}: kv_source_layer_ids and index_source_layer_ids must be "
                        "non-empty")
    for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", idx)):
        for s in ids:
            if not 0 <= s < L or ratios[s] == 0:
                raise ToolError(f"{src}: {name} entry {s} must be a layer below {L} with "
                                "compress ratio 1 or 2")

    def source(ids, layer):
        below = [s for s in ids if s <= layer]
        return max(below) if below else None

    for i in range(L):
        if ratios[i] == 0:
            continue
        ks, js = source(kv, i), source(idx, i)
        if ks is None or js is None:
            raise ToolError(f"{src}: layer {i} (ratio {ratios[i]}) has no kv source and "
                            "index source at or below it")
        if ratios[ks] != ratios[i] or ratios[js] != ratios[i]:
            raise ToolError(f"{src}: layer {i} has ratio {ratios[i]} but reads kv source {ks} "
                            f"(ratio {ratios[ks]}) and index source {js} (ratio "
                            f"{ratios[js]}); a consumer's ratio must equal its sources'")
        if source(kv, js) != ks:
            # Top-k indices address the compressed cache of the index source's kv source.
            raise ToolError(f"{src}: layer {i} reads kv source {ks} but top-k from index "
                            f"source {js}, whose keys come from kv source {source(kv, js)}")
    cand = int(cfg.get("candidate_source_layer_id", -1))
    if cand >= 0:
        if cand not in idx:
            raise ToolError(f"{src}: candidate_source_layer_id {cand} is not an index source")
        if int(cfg.get("candidate_topk_blocks", 0)) <= 0 or \
                int(cfg.get("candidate_block_size", 0)) <= 0:
            raise ToolError(f"{src}: a candidate source needs candidate_topk_blocks > 0 and "
                            "candidate_block_size > 0")
        for j in idx:
            if j > cand and source(kv, j) != source(kv, cand):
                raise ToolError(f"{src}: index source {j} filters with layer {cand}'s "
                                "candidate blocks but reads a different kv source")
    eng = list(cfg.get("engram_layer_ids") or [])
    if eng:
        for e in eng:
            if not 1 <= e < max(kv):
                raise ToolError(f"{src}: engram layer {e} must lie in [1, {max(kv)}): layer 0 "
                                "never applies Engram and layers from the last kv source "
                                "on run in the decoder replay")
        dim = int(cfg.need("engram_head_dim"))
        if dim % ENGRAM_SCALE_BLOCK or dim & (dim - 1):
            raise ToolError(f"{src}: engram_head_dim {dim} must be a power of two and a "
                            f"multiple of {ENGRAM_SCALE_BLOCK}")
        nums = list(cfg.need("engram_num_embeddings"))
        if len(nums) != len(eng):
            raise ToolError(f"{src}: engram_num_embeddings needs one entry per engram layer")
        for e, n, sizes in zip(eng, nums, engram_head_sizes(cfg)):
            if n < sum(sizes):
                raise ToolError(f"{src}: engram_num_embeddings for layer {e} is {n}, below "
                                f"the {sum(sizes)} rows its hash heads address")
        if cfg.need("engram_compressed_vocab_size") != cfg.need("vocab_size"):
            raise ToolError(f"{src}: engram_compressed_vocab_size must equal vocab_size (the "
                            "written tokenizer maps each token to its own compressed id)")
