"""The tokenizer every test checkpoint ships (tools/ckptgen/tokenizer.py, written by
tools/make_checkpoint.py): its layout over the vocabulary, encode/decode round trips through
``tokenizers`` and ``transformers.AutoTokenizer``, the chat template, the identity Engram
token map (vLLM 0.33.0's own build_compressed_token_map, taken from the pristine source), and
what ``vllm serve`` / ``vllm bench serve`` do with it: vLLM's DeepSeek tokenizer modes render
chats whose markers are single tokens, and vLLM's random benchmark dataset draws prompts of
exactly the asked length (the patched tree, in a subprocess)."""
from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests"))
from _common import ToolError  # noqa: E402
from ckptgen import tokenizer as T  # noqa: E402

import make_checkpoint as mk  # noqa: E402
import patched_python  # noqa: E402

CONFIGS = REPO / "benchmarks" / "e2e" / "configs"
ALL_CONFIGS = sorted(CONFIGS.glob("*/config.json")) + sorted((REPO / "tools" / "configs")
                                                             .glob("*.json"))
UPSTREAM = REPO / "build" / "vllm-0.33.0" / "vllm"
V = 4096


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    T.write_tokenizer(d, V, 0, 1, 65536)
    return d


def _upstream_source(rel: str) -> str:
    p = UPSTREAM / rel
    if not p.is_file():
        patched_python._skip_or_fail(f"{p} missing: run `make upstream`")
    return p.read_text()


# --------------------------------------------------------------------------- layout
def test_vocabulary_covers_every_id_once_with_the_config_ids():
    for bos, eos in ((0, 1), (7, 3)):
        vocab = T.vocabulary(V, bos, eos)
        assert sorted(vocab.values()) == list(range(V))
        assert vocab[T.BOS] == bos and vocab[T.EOS] == eos
        named = T.token_ids(V, bos, eos)
        # the others on the lowest free ids, in order
        others = [named[n] for n in T.SPECIAL + T.MARKERS if n not in (T.BOS, T.EOS)]
        assert others == [i for i in range(len(named)) if i not in (bos, eos)][:len(others)]
        for i in range(V):
            if i not in named.values():
                assert vocab[f"t{i}"] == i
        assert f"t{bos}" not in vocab


def test_layout_refusals():
    with pytest.raises(ToolError, match="both 0"):
        T.token_ids(V, 0, 0)
    with pytest.raises(ToolError, match="outside the vocabulary"):
        T.token_ids(V, 0, V)
    with pytest.raises(ToolError, match="needs more than"):
        T.token_ids(len(T.SPECIAL + T.MARKERS), 0, 1)


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.parent.name if
                         p.name == "config.json" else p.stem)
def test_spec_of_every_shipped_config(path):
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config", cfg)
    s = T.tokenizer_spec(cfg)
    assert s["vocab_size"] == text["vocab_size"]
    assert s["bos_id"] == cfg.get("bos_token_id", T.DEFAULT_BOS_ID)
    assert s["eos_id"] == cfg.get("eos_token_id", T.DEFAULT_EOS_ID)
    assert s["model_max_length"] == text["max_position_embeddings"]
    # the whole vocabulary builds, and its Engram compressed size is the vocabulary's (the
    # planner's illustrative config states none)
    if text.get("engram_layer_ids") and "engram_compressed_vocab_size" in text:
        assert text["engram_compressed_vocab_size"] == s["vocab_size"]
    tok = T.build(s["vocab_size"], s["bos_id"], s["eos_id"])
    assert tok.get_vocab_size(with_added_tokens=True) == s["vocab_size"]


# --------------------------------------------------------------------------- round trips
def test_tokenizers_round_trip(small):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(small / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == V
    named = T.token_ids(V)
    g = __import__("random").Random(0)
    ids = [g.randrange(len(named), V) for _ in range(200)]
    text = " ".join(f"t{i}" for i in ids)
    enc = tok.encode(text)
    assert enc.ids == [0] + ids                       # BOS in front
    assert tok.encode(text, add_special_tokens=False).ids == ids
    assert tok.decode(enc.ids) == text                # special tokens skipped
    assert tok.decode(enc.ids, skip_special_tokens=False) == T.BOS + " " + text
    # any ids, markers and special tokens included, survive decode then encode
    mixed = [5, 100, named["<｜User｜>"], 200, named[T.EOS], 300, named["<think>"]]
    assert tok.encode(tok.decode(mixed, skip_special_tokens=False),
                      add_special_tokens=False).ids == mixed
    # markers are matched inside text; unknown words are <unk>
    assert tok.encode("<｜User｜>t100 hello<｜Assistant｜>", add_special_tokens=False).ids == \
        [named["<｜User｜>"], 100, named[T.UNK], named["<｜Assistant｜>"]]
    # whitespace of any kind splits words
    assert tok.encode("t100\n\tt200  t300", add_special_tokens=False).ids == [100, 200, 300]


def test_auto_tokenizer_loads_and_renders_chats(small):
    transformers = pytest.importorskip("transformers")
    a = transformers.AutoTokenizer.from_pretrained(str(small))
    named = T.token_ids(V)
    assert len(a) == V
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id, a.unk_token_id) == \
        (named[T.BOS], named[T.EOS], named[T.PAD], named[T.UNK])
    assert sorted(a.all_special_ids) == sorted(named[s] for s in T.SPECIAL)
    assert a.model_max_length == 65536
    assert a.num_special_tokens_to_add() == 1
    ids = [100, 101, 4095, 2000]
    assert a.encode("t100 t101 t4095 t2000") == [0] + ids
    assert a.decode([0] + ids, skip_special_tokens=True) == "t100 t101 t4095 t2000"
    msgs = [{"role": "system", "content": "t50"}, {"role": "user", "content": "t100 t200"},
            {"role": "assistant", "content": "t300"}, {"role": "user", "content": "t400"}]
    text = a.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (f"{T.BOS}t50<｜User｜>t100 t200<｜Assistant｜>t300{T.EOS}"
                    "<｜User｜>t400<｜Assistant｜>")
    out = a.apply_chat_template(msgs, add_generation_prompt=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    u, s = named["<｜User｜>"], named["<｜Assistant｜>"]
    assert list(ids) == [0, 50, u, 100, 200, s, 300, 1, u, 400, s]   # one BOS, no unk


def test_is_current_tells_the_old_engram_tokenizer(tmp_path, small):
    assert T.is_current(small)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}))
    assert not T.is_current(tmp_path)
    assert not T.is_current(tmp_path / "none")


# --------------------------------------------------------------------------- Engram
def _upstream_token_map():
    """vLLM 0.33.0's common/engram.py::build_compressed_token_map, compiled from the pristine
    source alone (importing the module needs vLLM's runtime)."""
    src = _upstream_source("models/deepseek_v41/common/engram.py")
    fn = next(n for n in ast.parse(src).body
              if isinstance(n, ast.FunctionDef) and n.name == "build_compressed_token_map")
    ns: dict = {}
    exec(compile(ast.Module([fn], []), "engram.py", "exec"), ns)
    return ns["build_compressed_token_map"]


def test_engram_token_map_is_the_identity(small):
    transformers = pytest.importorskip("transformers")
    build_map = _upstream_token_map()
    lookup, n = build_map(transformers.AutoTokenizer.from_pretrained(str(small)))
    assert n == V and lookup == list(range(V))
    # the project's copy of the map (the fp32 reference) agrees
    sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))
    import reference
    ref, rn = reference.engram_token_map(small, V)
    assert rn == V and ref.tolist() == list(range(V))


def test_engram_token_map_identity_at_full_size(tmp_path):
    """A shipped V4.1 config's whole vocabulary (129,280 ids) keys to distinct texts."""
    transformers = pytest.importorskip("transformers")
    cfg = json.loads((CONFIGS / "v41-tput" / "config.json").read_text())
    T.write_for_config(tmp_path, cfg)
    lookup, n = _upstream_token_map()(transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json")))
    assert n == cfg["text_config"]["engram_compressed_vocab_size"] == len(lookup)
    assert lookup == list(range(n))


# --------------------------------------------------------------------------- the writer
def test_every_checkpoint_ships_the_tokenizer(tmp_path):
    """make_checkpoint writes it for a model without Engram too (V4), from the config's ids
    and vocabulary (--set overrides included)."""
    tiny = dict(vocab_size=512, hidden_size=512, num_attention_heads=8, o_groups=8,
                q_lora_rank=128, o_lora_rank=64, sliding_window=8, index_topk=16,
                index_n_heads=4, moe_intermediate_size=128, num_experts_per_tok=2,
                num_hidden_layers=2, n_routed_experts=2)
    cfg = mk.load_config(CONFIGS / "v4-mini", tiny)
    assert not cfg.get("engram_layer_ids")
    mk.write_checkpoint(cfg, "bf16", tmp_path / "ck", seed=0, threads=1, log=lambda *a: None)
    assert T.is_current(tmp_path / "ck")
    tc = json.loads((tmp_path / "ck" / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == T.CHAT_TEMPLATE and tc["model_max_length"] == 65536
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tmp_path / "ck" / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 512
    assert tok.token_to_id(T.BOS) == 0 and tok.token_to_id(T.EOS) == 1


# --------------------------------------------------------------------------- vLLM 0.33.0
def test_markers_cover_vllms_deepseek_encoders():
    """Every "<｜...｜>" / "<think>" marker literal of vLLM's DeepSeek prompt encoders and
    renderer is a token of ours (a chat renders no marker as <unk>)."""
    found = set()
    for rel in ("tokenizers/deepseek_v4_encoding.py", "tokenizers/deepseek_v41_encoding.py",
                "renderers/deepseek_v4.py"):
        src = _upstream_source(rel)
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= set(re.findall(r"<｜[^｜<>]+｜>|</?think>", node.value))
    assert found >= {T.BOS, T.EOS, "<｜User｜>", "<｜Assistant｜>"}
    assert found <= set(T.SPECIAL + T.MARKERS), sorted(found - set(T.SPECIAL + T.MARKERS))


_VLLM_PROBE = r"""
import json, sys
from vllm.tokenizers import get_tokenizer
from vllm.benchmarks.datasets.datasets import RandomDataset
d = sys.argv[1]
out = {}
msgs = [{"role": "user", "content": "t100 t200"}]
for mode in ("deepseek_v41", "deepseek_v4", "hf"):
    t = get_tokenizer(d, tokenizer_mode=mode)
    ids = t.apply_chat_template(msgs, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = t.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    out[mode] = dict(len=len(t), ids=ids, text=text)
t = get_tokenizer(d, tokenizer_mode="auto")
reqs = RandomDataset(random_seed=0).sample(tokenizer=t, num_requests=4, input_len=64,
                                           output_len=8)
out["random"] = [dict(prompt_len=r.prompt_len,
                      server_len=len(t.encode(r.prompt)),
                      words=r.prompt.split()[:3]) for r in reqs]
print(json.dumps(out))
"""


def test_vllm_tokenizer_modes_and_random_dataset(small, tmp_path):
    """vLLM's own code on the patched tree: the DeepSeek modes ``vllm serve`` defaults to for
    these architectures, and ``hf``, render a chat whose markers are single tokens with the
    content's words intact; vLLM's random dataset (``vllm bench serve --dataset-name random``)
    draws prompts the server encodes to exactly the asked length: the dataset counts the
    BOS the server adds (num_special_tokens_to_add) out of its prompt_len."""
    probe = tmp_path / "probe.py"
    probe.write_text(_VLLM_PROBE)
    r = patched_python.run_json([str(probe), str(small)], env={}, timeout=300)
    named = T.token_ids(V)
    for mode in ("deepseek_v41", "deepseek_v4", "hf"):
        m = r[mode]
        assert m["len"] == V, mode
        assert m["ids"][0] == 0 and m["ids"].count(0) == 1, mode   # one BOS
        i = m["ids"].index(named["<｜User｜>"])
        assert m["ids"][i + 1:i + 4] == [100, 200, named["<｜Assistant｜>"]], mode
        for marker in set(re.findall(r"<｜[^｜<>]+｜>|</?think>", m["text"])):
            assert named[marker] in m["ids"], (mode, marker)
    for q in r["random"]:
        assert q["prompt_len"] == 64 - 1 and q["server_len"] == 64, q
        assert all(re.fullmatch(r"t\d+|<[^ ]+>", w) for w in q["words"]), q
