"""The tokenizer every test checkpoint ships (tools/make_checkpoint.py writes it beside the
weights): word-level, one word per vocabulary id, in the Hugging Face ``tokenizers`` format
(tokenizer.json) with a tokenizer_config.json that ``transformers.AutoTokenizer``,
``vllm serve`` and ``vllm bench serve`` load.

Layout over a vocabulary of V ids:

* the config's ``bos_token_id`` / ``eos_token_id`` (DeepSeek's 0 and 1 where the config has
  none) hold DeepSeek's ``<｜begin▁of▁sentence｜>`` / ``<｜end▁of▁sentence｜>``;
* the lowest other ids hold ``<｜▁pad▁｜>``, ``<unk>`` (unknown words: a word-level model needs
  one) and the markers vLLM 0.33.0's DeepSeek prompt encoders write
  (vllm/tokenizers/deepseek_v4_encoding.py, deepseek_v41_encoding.py): ``<｜User｜>``,
  ``<｜Assistant｜>``, ``<think>``, ... as added tokens, so a chat prompt rendered by vLLM's
  default tokenizer mode for these architectures (``deepseek_v4`` / ``deepseek_v41``) maps
  its markers to one id each;
* every other id i is the word ``t{i}``. Text is split on whitespace; decoding joins words
  with single spaces, so ``decode(encode(s)) == s`` for words of the vocabulary joined by
  single spaces, and ``encode(decode(ids)) == ids``.

Encoding adds the BOS id in front (DeepSeek's tokenizers do; ``add_special_tokens=False``
leaves it out). tokenizer_config.json also carries a chat template for the ``hf`` tokenizer
mode and other clients (vLLM's DeepSeek modes render chats with their own encoders), and
``model_max_length`` = the config's ``max_position_embeddings`` (vLLM caps max_model_len at
it: a smaller value would shorten what the long-context runs may serve).

Engram (V4.1): vLLM builds its n-gram token map from this tokenizer
(common/engram.py::build_compressed_token_map: each id's text, NFKC-normalized, lowercased
and stripped, keyed in id order). Every id's text normalizes to a distinct key here, so the
map is the identity and engram_compressed_vocab_size = vocab_size (ckptgen.config checks it).
Runs that pass token ids (the agreement, throughput and long runs) see the same model
whatever the words are.
"""
from __future__ import annotations

import json
from pathlib import Path

from _common import ToolError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
UNK = "<unk>"
# Special tokens (skipped by decode(skip_special_tokens=True); vLLM's random benchmark
# dataset draws none of them).
SPECIAL = (BOS, EOS, PAD, UNK)
# The markers of vLLM 0.33.0's DeepSeek-V4 / V4.1 prompt encoders and renderer
# (tokenizers/deepseek_v4*_encoding.py, renderers/deepseek_v4.py's FIM tokens): added tokens,
# not special, as DeepSeek's own tokenizers keep them in decoded text.
MARKERS = ("<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<think>", "</think>",
           "<｜latest_reminder｜>", "<｜deepseek_image｜>", "｜DSML｜",
           "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>",
           "<｜read_url｜>", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")
# DeepSeek's ids where a config names none.
DEFAULT_BOS_ID, DEFAULT_EOS_ID = 0, 1
# Where a config has no max_position_embeddings.
DEFAULT_MAX_LENGTH = 1 << 20
# tokenizer_config.json's "deepinfer_tokenizer": the layout above. A checkpoint written
# before it (an Engram-only tokenizer of words t0..t{V-1}, no chat template) lacks the key:
# benchmarks/e2e/serve.py rewrites such a tokenizer in place (is_current / write_tokenizer).
LAYOUT_VERSION = 2
# For the hf tokenizer mode: DeepSeek's turn layout with this vocabulary's markers.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")


def _first_id(value, default: int) -> int:
    if isinstance(value, list):   # HF configs may list several EOS ids: the first is the token
        value = value[0] if value else None
    return default if value is None else int(value)


def tokenizer_spec(config: dict) -> dict:
    """vocab_size, bos_id, eos_id and model_max_length of a config.json dict (V4.1 nests the
    model under "text_config"; the token ids stand at its top level, V4 is flat)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

    def pick(key):
        return config.get(key, text.get(key))
    if "vocab_size" not in text:
        raise ToolError("config has no vocab_size: the tokenizer needs one")
    return dict(vocab_size=int(text["vocab_size"]),
                bos_id=_first_id(pick("bos_token_id"), DEFAULT_BOS_ID),
                eos_id=_first_id(pick("eos_token_id"), DEFAULT_EOS_ID),
                model_max_length=int(text.get("max_position_embeddings") or DEFAULT_MAX_LENGTH))


def token_ids(vocab_size: int, bos_id: int = DEFAULT_BOS_ID,
              eos_id: int = DEFAULT_EOS_ID) -> dict[str, int]:
    """Every special token and marker with its id (BOS and EOS at theirs, the others on the
    lowest free ids in the order of SPECIAL + MARKERS)."""
    names = SPECIAL + MARKERS
    for what, i in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
        if not 0 <= i < vocab_size:
            raise ToolError(f"{what} {i} lies outside the vocabulary of {vocab_size}")
    if bos_id == eos_id:
        raise ToolError(f"bos_token_id and eos_token_id are both {bos_id}: the tokenizer "
                        "needs two ids")
    if vocab_size < len(names) + 1:
        raise ToolError(f"vocab_size {vocab_size}: the tokenizer needs more than "
                        f"{len(names)} ids (its special tokens and markers)")
    out = {BOS: bos_id, EOS: eos_id}
    free = (i for i in range(vocab_size) if i not in (bos_id, eos_id))
    for name in names:
        if name not in out:
            out[name] = next(free)
    return out


def vocabulary(vocab_size: int, bos_id: int = DEFAULT_BOS_ID,
               eos_id: int = DEFAULT_EOS_ID) -> dict[str, int]:
    """word -> id for every id: the special tokens and markers, "t{i}" elsewhere."""
    named = token_ids(vocab_size, bos_id, eos_id)
    taken = set(named.values())
    vocab = {f"t{i}": i for i in range(vocab_size) if i not in taken}
    vocab.update(named)
    return vocab


def build(vocab_size: int, bos_id: int = DEFAULT_BOS_ID, eos_id: int = DEFAULT_EOS_ID):
    """The ``tokenizers.Tokenizer`` of the layout above."""
    try:
        from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    except ImportError as e:
        raise ToolError("writing the checkpoint's tokenizer needs the `tokenizers` package "
                        "(pip install tokenizers)") from e
    tok = Tokenizer(models.WordLevel(vocabulary(vocab_size, bos_id, eos_id), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Already in the vocabulary, so these keep their ids; as added tokens they are matched in
    # text before the whitespace split ("<｜User｜>t5" is two tokens).
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in MARKERS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)])
    return tok


def tokenizer_config(model_max_length: int = DEFAULT_MAX_LENGTH) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
            "pad_token": PAD, "unk_token": UNK, "add_bos_token": True, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
            "chat_template": CHAT_TEMPLATE, "deepinfer_tokenizer": LAYOUT_VERSION}


def write_tokenizer(out: Path, vocab_size: int, bos_id: int = DEFAULT_BOS_ID,
                    eos_id: int = DEFAULT_EOS_ID,
                    model_max_length: int = DEFAULT_MAX_LENGTH) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json into ``out`` (replacing any there);
    returns their paths."""
    out = Path(out)
    tok = build(vocab_size, bos_id, eos_id)
    paths = [out / "tokenizer.json", out / "tokenizer_config.json"]
    tok.save(str(paths[0]))
    paths[1].write_text(json.dumps(tokenizer_config(model_max_length), indent=2,
                                   ensure_ascii=False) + "\n")
    for p in paths:
        p.chmod(0o644)
    return paths


def write_for_config(out: Path, config: dict) -> list[Path]:
    """write_tokenizer with the vocabulary, ids and length of a config.json dict."""
    s = tokenizer_spec(config)
    return write_tokenizer(out, s["vocab_size"], s["bos_id"], s["eos_id"],
                           s["model_max_length"])


def is_current(ckpt: Path) -> bool:
    """Whether ``ckpt`` holds a tokenizer of this layout (LAYOUT_VERSION)."""
    try:
        cfg = json.loads((Path(ckpt) / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (Path(ckpt) / "tokenizer.json").is_file() and \
        cfg.get("deepinfer_tokenizer") == LAYOUT_VERSION
