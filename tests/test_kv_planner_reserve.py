"""The KV planner's reservation arithmetic (tools/kvplan/workspace.py, stdlib only) against
the functions the Ampere path reserves with (overlay/vllm/deepinfer/reserve.py and the
decode launcher's own plan, kernels/sparse_mla_decode.py), run here with torch on CPU:

* the decode scratch: for V4.1 ratio-1/2 layers and V4 C4A/C128A layers at max_model_len
  1M, B 8,192 and 131,072, S 4 and 256 (and a few larger batches), G 512, the planner's bytes
  at every decode size t and its worst case over t <= T equal reserve.py's
  (``decode_scratch``, ``decode_scratch_worst``, which plan every t);
* the indexer's decode logits: ``indexer_logits_specs`` at reserve's R rows and L // ratio
  columns;
* the combined lists: the ``CombineSlab`` buffers ``reserve_combined_lists`` allocates (on
  the meta device: no memory) for each distinct (kind, width) of a stack's layers, widths
  from topk_swa.combined_width;
* the limits (T, R) of ``reserve.Limits`` and the launcher's constants the planner restates.

What is not run here: the layers' own choice of kind ("shared"/"own") and top-k width, which
need vLLM's model classes (attention/common.py ``_combine_kinds``, ``_topk_width``); the
planner restates their rules (workspace.py) and tests/test_reserve.py and
tests/vllm_probe_reserve.py test the layers.
"""
from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import kvplan as kvp  # noqa: E402  tools/kvplan/ (tools/ is on sys.path: conftest)
from vllm.deepinfer import reserve  # noqa: E402
from vllm.deepinfer.kernels import sparse_mla_decode as smd  # noqa: E402
from vllm.deepinfer.kernels import topk_swa  # noqa: E402
from vllm.deepinfer.kv_record import HEAD_DIM  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "benchmarks" / "e2e" / "configs"
L = kvp.CONTEXT_1M
G = 512              # vLLM's largest CUDA graph at 256 sequences off SM100 (config/vllm.py)
A100_SMS = 108
WINDOW = 128
TOPK = 512           # index_topk of the served V4.1 / V4 configs
# (label, ratio, top-k columns): V4.1's ratio-1 and ratio-2 layers, V4's C4A (the indexer's
# top-k) and C128A (every compressed position of L, aligned to 128), a sliding-window layer.
LAYERS = [("v41-c1", 1, TOPK), ("v41-c2", 2, TOPK), ("v4-c4a", 4, TOPK),
          ("v4-c128a", 128, -(-(L // 128) // 128) * 128), ("swa", 0, 0)]
LIMITS = [(b, s, k) for b in (8192, 131072) for s in (4, 256) for k in (0, 1)]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for var in ("DEEPINFER_DECODE_PREDEQUANT", "DEEPINFER_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    reserve.reset_for_tests()
    yield
    reserve.reset_for_tests()


def _limits(b, s, k, g=G):
    return reserve.Limits(max_num_batched_tokens=b, max_num_seqs=s, num_speculative_tokens=k,
                          max_capture_size=g, max_model_len=L)


def _serving(heads, s, k, g=G, variant="sm80", predequant=True):
    return kvp.Serving(heads=heads, index_topk=TOPK, max_num_seqs=s, num_speculative_tokens=k,
                       max_capture_size=g, sm_count=A100_SMS, variant=variant,
                       predequant=predequant)


# ---- the launcher's constants ---------------------------------------------------------------
def test_planner_restates_the_launchers_constants():
    for variant, (one, two) in kvp.DECODE_TILES.items():
        assert smd.launch_tiles(variant) == (variant, f"{variant}-2p")
        for mine, name in ((one, variant), (two, f"{variant}-2p")):
            t = smd.TILES[name]
            assert (mine.block_h, mine.block_n, mine.ctas_per_sm, mine.predequant) == (
                t.block_h, t.block_n, t.ctas_per_sm, t.predequant), name
            assert t.gluon_heads == 0  # the Triton phase 2: its own tile sets the plan
    assert kvp.PREDEQUANT_MIN_TOKENS == smd.PREDEQUANT_MIN_TOKENS
    assert kvp.workspace.HEAD_DIM == HEAD_DIM
    assert kvp.workspace.WORKSPACE_ALIGN == reserve.WORKSPACE_ALIGN
    assert kvp.workspace.RADIX_TOPK_BYTES == reserve.RADIX_TOPK_BYTES
    assert kvp.workspace.COMBINED_ROW_ALIGN == topk_swa.ROW_ALIGN


@pytest.mark.parametrize("b,s,k", LIMITS + [(131072, 8192, 0), (8192, 1, 3)])
@pytest.mark.parametrize("g", (G, 0))
def test_limits_match(b, s, k, g):
    lim, srv = _limits(b, s, k, g), _serving(32, s, k, g)
    assert srv.decode_tokens(b) == lim.decode_tokens
    assert srv.indexer_decode_rows(b) == lim.indexer_decode_rows


# ---- decode scratch ----------------------------------------------------------------------
@pytest.mark.parametrize("heads", (16, 32, 64, 128))
@pytest.mark.parametrize("label,ratio,topk", LAYERS)
def test_decode_scratch_at_every_size(label, ratio, topk, heads):
    """One launch's workspace request, t by t (random sizes past the first 64)."""
    keys = WINDOW + topk
    rng = random.Random(f"{label}-{heads}")
    for t in [*range(1, 65), *rng.sample(range(65, 20000), 40)]:
        specs = reserve.decode_scratch("sm80", t, heads, keys, A100_SMS)
        want = reserve.spec_bytes([(s, d) for _, s, d in specs])
        assert kvp.decode_scratch_bytes(t, heads, keys, A100_SMS, "sm80") == want, (t, keys)


@pytest.mark.parametrize("b,s,k", LIMITS)
@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("label,ratio,topk", LAYERS)
def test_decode_scratch_worst_case(label, ratio, topk, tp, b, s, k):
    heads, keys = 64 // tp, WINDOW + topk
    lim = _limits(b, s, k)
    want = reserve.decode_scratch_worst("sm80", lim.decode_tokens, heads, keys, A100_SMS)
    got = kvp.decode_scratch_worst(_serving(heads, s, k).decode_tokens(b), heads, keys,
                                   A100_SMS, "sm80")
    assert got[0] == want[0], (got, want[:2])


@pytest.mark.parametrize("variant,predequant,sms", [("sm86", True, 84), ("sm80", False, 108),
                                                    ("sm80", True, 132)])
@pytest.mark.parametrize("tokens", (3, 700, 4096, 8192))
def test_decode_scratch_worst_case_other_gpus(monkeypatch, variant, predequant, sms, tokens):
    """Other tile rows, the single-phase path (DEEPINFER_DECODE_PREDEQUANT=0), other SM
    counts, and batches past the SM slots (where the planner stops trying every size)."""
    if not predequant:
        monkeypatch.setenv("DEEPINFER_DECODE_PREDEQUANT", "0")
    for heads, keys in ((64, WINDOW + TOPK), (8, WINDOW), (128, WINDOW + 8192)):
        want = reserve.decode_scratch_worst(variant, tokens, heads, keys, sms)
        got = kvp.decode_scratch_worst(tokens, heads, keys, sms, variant, predequant)
        assert got[0] == want[0], (heads, keys, got, want[:2])


# ---- indexer decode logits ----------------------------------------------------------------
@pytest.mark.parametrize("b,s,k", LIMITS)
@pytest.mark.parametrize("ratio", (1, 2, 4))
def test_indexer_decode_logits(b, s, k, ratio):
    lim = _limits(b, s, k)
    want = reserve.spec_bytes(reserve.indexer_logits_specs(lim.indexer_decode_rows, L // ratio))
    rows = _serving(32, s, k).indexer_decode_rows(b)
    assert kvp.indexer_decode_logits_bytes(ratio, L, rows) == want


# ---- combined lists --------------------------------------------------------------------------
def _stack(name: str):
    cfg = kvp.load_config(CONFIGS / name / "config.json")
    family, model = kvp.family_of(cfg)
    facts = kvp.resolve_model(model, cfg)
    return facts, kvp.build_stack(facts, kvp.CacheFormat("fp8", "fp8"))


@pytest.mark.parametrize("b", (8192, 131072))
@pytest.mark.parametrize("yoco", (True, False))
@pytest.mark.parametrize("name", ("v41-tput", "v41-long", "v4-long"))
def test_combined_lists(name, yoco, b):
    facts, layers = _stack(name)
    srv = _serving(facts.arch["num_attention_heads"], 256, 0)
    slabs = set()
    for x in layers:
        w = topk_swa.combined_width(kvp.layer_topk(x, srv, L), x.window)
        assert kvp.combined_width(x, srv, L) == w
        slabs |= {(kind, w) for kind in kvp.combine_kinds(x, srv, yoco)}
    want = sum(reserve.reserve_combined_lists(kind, w, b, "meta") for kind, w in slabs)
    assert kvp.combined_lists_bytes(layers, srv, L, b, yoco) == want
    if name == "v4-long":  # C4A lists are "own", the others "shared" under reuse
        assert {k for k, _ in slabs} == ({"shared", "own"} if yoco else {"own"})


# ---- the whole reservation of a GPU ----------------------------------------------------------
@pytest.mark.parametrize("b,s,k", LIMITS)
@pytest.mark.parametrize("name", ("v41-tput", "v41-long", "v4-long"))
def test_ampere_reserved_bytes_against_reserve(name, b, s, k):
    """The planner's terms for a whole stack on one GPU against reserve.py's requests of its
    layers: the workspace is the largest request (the prefill and indexer gathers being
    upstream's and the overlay's shapes, tests/test_kv_planner.py), the combined lists add."""
    facts, layers = _stack(name)
    heads = facts.arch["num_attention_heads"]
    srv, lim = _serving(heads, s, k), _limits(b, s, k)
    got = kvp.ampere_reserved_bytes(layers, L, b, srv)
    decode = max(reserve.decode_scratch_worst("sm80", lim.decode_tokens, heads,
                                              kvp.decode_keys_per_token(x, srv, L), A100_SMS)[0]
                 for x in layers)
    logits = max(reserve.spec_bytes(reserve.indexer_logits_specs(lim.indexer_decode_rows,
                                                                 L // x.ratio))
                 for x in layers if x.indexer_record)
    assert got["decode_workspace"] == decode and got["indexer_decode_logits"] == logits
    assert got["workspace"] == max(got["prefill_gather"], got["indexer_k_gather"], decode, logits)
    slabs = {(kind, topk_swa.combined_width(kvp.layer_topk(x, srv, L), x.window))
             for x in layers for kind in kvp.combine_kinds(x, srv, True)}
    combined = sum(reserve.reserve_combined_lists(kd, w, b, "meta") for kd, w in slabs)
    assert got["combined_lists"] == combined
    rest = sum(got[t] for t in ("yoco_gather_buffer", "yoco_indexer_k",
                                "indexer_logits_transient"))
    assert got["total"] == got["workspace"] + combined + rest


def test_v4_c128a_decode_dominates_at_1m():
    """V4's C128A layers decode every compressed position (8,192 at 1M) plus the window: at
    T 512 the two-phase rows alone are 512 x 8,320 KiB (4.06 GiB), past every other request
    of v4-long (the largest prefill gather, a C4A layer's, is 4 x (L/4 + 128 + 8,192) KiB)."""
    facts, layers = _stack("v4-long")
    got = kvp.ampere_reserved_bytes(layers, L, 8192, _serving(64, 256, 0))
    assert got["workspace"] == got["decode_workspace"] > 4 * kvp.GiB
    assert got["decode_workspace"] > got["prefill_gather"]
