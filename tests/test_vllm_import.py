"""The PATCHED vLLM 0.33.0 tree, imported on a CPU-only machine: attention routing of
DeepSeek-V4.1/V4 (patches 0004/0005 + vllm.deepinfer.attention.selector) and the Ampere attention
classes (vllm.deepinfer.attention.ampere_v41 / ampere_v4).

vLLM is never imported into this pytest process. Each scenario of tests/vllm_import_probe.py
(its ``SCENARIOS``: top-level ``scenario_*`` functions, which ``test_probe_scenario_runs``
parametrizes over) runs once per test session in a subprocess with ``CUDA_VISIBLE_DEVICES=""`` and
``PYTHONPATH=build/patched`` (the pristine sdist with the series applied and our package
copied in as ``vllm/deepinfer``; ``make patched`` builds it), and the tests read its JSON.
Under pytest-xdist the workers share one run per scenario (a file lock + cache keyed by
the xdist run id).

Needs the packages of requirements-vllm-import.txt (``make venv`` installs them). Without
the tree or those packages the vLLM tests skip, naming what is missing; with
DEEPINFER_REQUIRE_UPSTREAM=1 (set by ``make test``) they fail instead.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

import subproc
import vllm_import_probe
from vllm.deepinfer import envs
from vllm.deepinfer.attention import selector

REPO = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("DEEPINFER_BUILD", REPO / "build"))
PATCHED = BUILD / "patched"
PROBE = Path(__file__).with_name("vllm_import_probe.py")
OVERLAY_PKG = REPO / "overlay" / "vllm" / "deepinfer"
PATCH_DIR = REPO / "patches" / "vllm-0.33.0"
REQUIRE = os.environ.get("DEEPINFER_REQUIRE_UPSTREAM") == "1"

MODELS = ("deepseek_v41", "deepseek_v4")
AMPERE = {"deepseek_v41": "DeepinferAmpereV41Attention", "deepseek_v4": "DeepinferAmpereV4Attention"}
# Import names of requirements-vllm-import.txt (a missing one makes the vLLM tests skip).
IMPORT_DEPS = ("regex", "pydantic", "cbor2", "zmq", "urllib3", "transformers", "aiohttp",
               "requests", "openai_harmony", "openai", "PIL", "pybase64", "cachetools",
               "msgspec", "uvloop", "cpuinfo", "prometheus_client", "xgrammar", "fastapi",
               "partial_json_parser", "llguidance", "einops", "psutil", "cloudpickle",
               "compressed_tensors")


# --------------------------------------------------------------------------- availability
def _stale_files() -> list[str]:
    """Our package files whose copy in the patched tree differs, and patch files newer
    than the tree."""
    stale = []
    tree_pkg = PATCHED / "vllm" / "deepinfer"
    for p in sorted(OVERLAY_PKG.rglob("*.py")):
        q = tree_pkg / p.relative_to(OVERLAY_PKG)
        if not q.is_file() or q.read_bytes() != p.read_bytes():
            stale.append(str(p.relative_to(REPO)))
    ok_time = (PATCHED / ".ok").stat().st_mtime
    stale += [str(p.relative_to(REPO)) for p in sorted(PATCH_DIR.iterdir())
              if p.stat().st_mtime > ok_time]
    return stale


def _unavailable() -> str | None:
    if not (PATCHED / ".ok").is_file():
        return f"{PATCHED} missing: run `make patched` (needs `make upstream`)"
    stale = _stale_files()
    if stale:
        return (f"{PATCHED} is older than {', '.join(stale[:4])}"
                f"{' ...' if len(stale) > 4 else ''}: run `make patched`")
    missing = [m for m in IMPORT_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        return ("vLLM import dependencies missing (" + ", ".join(missing)
                + "): pip install torch==2.13.0 -r requirements-vllm-import.txt (or `make venv`)")
    return None


def _need_tree() -> None:
    why = _unavailable()
    if why:
        if REQUIRE:
            pytest.fail(why)
        pytest.skip(why)


# --------------------------------------------------------------------------- probe runs
def _probe_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("DEEPINFER_") and k != "DEEPINFER_BUILD")
           and k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(PATCHED), PYTHONDONTWRITEBYTECODE="1")
    return env


def _run_probe(scenario: str) -> dict:
    r = subproc.run([sys.executable, str(PROBE), scenario], env=_probe_env(), cwd=REPO, cap=300)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        pytest.fail(f"probe {scenario} failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(lines[-1])


def _probe(scenario: str) -> dict:
    """One probe run per test session, shared by the xdist workers."""
    assert scenario in vllm_import_probe.SCENARIOS, scenario
    _need_tree()
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    d = Path(tempfile.gettempdir()) / f"deepinfer-vllm-import-{run}"
    d.mkdir(exist_ok=True)
    out = d / f"{scenario}.json"
    with open(d / f"{scenario}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            res = _run_probe(scenario)
            out.write_text(json.dumps(res))
        res = json.loads(out.read_text())
    scen = res.get("_scenario", {})
    if not scen.get("ok", False):
        pytest.fail(f"probe {scenario} crashed: {scen.get('error')}: {scen.get('message')}\n"
                    f"{scen.get('trace', '')}")
    return res


@pytest.mark.parametrize("scenario", sorted(vllm_import_probe.SCENARIOS))
def test_probe_scenario_runs(scenario):
    """Every scenario runs to its end in its own process and records its checks (the tests
    below read them); a check that raised is reported by the test that reads it."""
    res = _probe(scenario)
    checks = [k for k in res if not k.startswith("_")]
    assert checks and res["_seconds"] > 0, res.keys()


@pytest.fixture(scope="module")
def sel():
    return _probe("selector")


@pytest.fixture(scope="module")
def built():
    return _probe("construct")


def _value(res: dict, key: str):
    assert key in res, f"probe did not record {key}"
    r = res[key]
    assert r["ok"], f"{key}: {r['error']}: {r['message']}\n{r.get('trace', '')}"
    return r["value"]


def _error(res: dict, key: str) -> tuple[str, str]:
    assert key in res, f"probe did not record {key}"
    r = res[key]
    assert not r["ok"], f"{key}: expected an error, got {r['value']!r}"
    return r["error"], r["message"]


# --------------------------------------------------------------------------- selector, pure
# (selector.decide needs no vLLM: these run everywhere)
@pytest.fixture
def clean_env(monkeypatch):
    for k in ("DEEPINFER_AMPERE_ATTN", "DEEPINFER_DISABLE", "DEEPINFER_ARCH"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 7), (8, 9)])
def test_decide_ampere_below_9(clean_env, model, cap):
    assert selector.decide(model, cap).ampere


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cap", [(9, 0), (10, 0), (10, 3), (12, 0), (7, 5), None])
def test_decide_upstream_elsewhere(clean_env, model, cap):
    assert not selector.decide(model, cap).ampere
    clean_env.setenv("DEEPINFER_AMPERE_ATTN", "1")
    # forced on: the Ampere path on every supported GPU; no device / pre-Ampere: upstream
    assert selector.decide(model, cap).ampere == (cap is not None and cap >= (8, 0))


def test_decide_explicit_backend_messages(clean_env):
    with pytest.raises(selector.BackendUnavailableError,
                       match=r"FLASHMLA_SPARSE_DSV41 cannot run on compute capability 8\.6"):
        selector.decide("deepseek_v41", (8, 6), "FLASHMLA_SPARSE_DSV41", backend_runs=False)
    assert not selector.decide("deepseek_v41", (9, 0), "FLASHMLA_SPARSE_DSV41",
                               backend_runs=True).ampere
    # a backend upstream's DeepSeek selector ignores changes nothing
    assert selector.decide("deepseek_v4", (8, 0), "TRITON_MLA", backend_runs=True).ampere
    clean_env.setenv("DEEPINFER_AMPERE_ATTN", "1")
    with pytest.raises(ValueError, match="FLASHMLA_SPARSE_DSV4 was requested explicitly"):
        selector.decide("deepseek_v4", (9, 0), "FLASHMLA_SPARSE_DSV4", backend_runs=True)


@pytest.mark.parametrize("model", MODELS)
def test_decide_our_backend(clean_env, model):
    ours = selector.OUR_BACKENDS[model]
    other = next(b for m, b in selector.OUR_BACKENDS.items() if m != model)
    for cap in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]:
        assert selector.decide(model, cap, ours).ampere
    with pytest.raises(ValueError, match=f"{other} is the DeepInfer backend of another model"):
        selector.decide(model, (8, 0), other)
    for cap in [(7, 5), None]:
        with pytest.raises(selector.BackendUnavailableError, match=ours):
            selector.decide(model, cap, ours)
    with pytest.raises(ValueError, match="prefill context parallelism"):
        selector.decide(model, (8, 0), ours, pcp=True)
    clean_env.setenv("DEEPINFER_AMPERE_ATTN", "0")
    with pytest.raises(ValueError, match="switches the ampere_attn feature off"):
        selector.decide(model, (8, 0), ours)


def test_envs_explicit(clean_env):
    assert envs.explicit("ampere_attn") is None
    clean_env.setenv("DEEPINFER_AMPERE_ATTN", "1")
    assert envs.explicit("ampere_attn") is True
    clean_env.setenv("DEEPINFER_DISABLE", "all")
    assert envs.explicit("ampere_attn") is False
    clean_env.setenv("DEEPINFER_DISABLE", "")
    clean_env.setenv("DEEPINFER_AMPERE_ATTN", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_AMPERE_ATTN"):
        envs.explicit("ampere_attn")


# --------------------------------------------------------------------------- selector, in vLLM
UPSTREAM_DEFAULT = {(9, 0): "DeepseekV4FlashMLAAttention",
                    # mega attention declines without its kernel build: FlashMLA
                    (10, 0): "DeepseekV4FlashMLAAttention",
                    (12, 0): "DeepseekV4FlashInferSM120Attention"}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cap", ["8.0", "8.6", "8.7", "8.9"])
def test_patched_selector_routes_below_9_to_ampere(sel, model, cap):
    assert _value(sel, f"{model}/{cap}/default") == AMPERE[model]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cap", sorted(UPSTREAM_DEFAULT))
def test_patched_selector_keeps_upstream_choice(sel, model, cap):
    key = f"{model}/{cap[0]}.{cap[1]}"
    assert _value(sel, f"{key}/default") == UPSTREAM_DEFAULT[cap]
    assert _value(sel, f"{key}/off") == UPSTREAM_DEFAULT[cap]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cap", ["8.0", "8.6", "8.9", "9.0", "10.0", "12.0"])
def test_patched_selector_env_switch(sel, model, cap):
    assert _value(sel, f"{model}/{cap}/on") == AMPERE[model]
    if cap.startswith("8."):
        # switched off below 9.0: upstream's (unrunnable) choice comes back, with a warning
        assert _value(sel, f"{model}/{cap}/off") == "DeepseekV4FlashMLAAttention"
        assert _value(sel, f"{model}/{cap}/disable_all") == "DeepseekV4FlashMLAAttention"


IMPOSSIBLE = {"deepseek_v41": ("FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4", "FLASHMLA_SPARSE_DSV41",
                               "FLASHINFER_MLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV41",
                               "FLASHMLA_MEGA_ATTN_DSV41"),
              "deepseek_v4": ("FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4",
                              "FLASHINFER_MLA_SPARSE_DSV4")}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cap", ["8.0", "8.6", "8.9"])
def test_patched_selector_explicit_impossible_backend_fails(sel, model, cap):
    for backend in IMPOSSIBLE[model]:
        err, msg = _error(sel, f"{model}/{cap}/backend={backend}")
        assert err == "BackendUnavailableError"
        assert backend in msg and f"compute capability {cap}" in msg, msg


@pytest.mark.parametrize("model,key,want", [
    ("deepseek_v41", "9.0/backend=FLASHMLA_SPARSE_DSV41", "DeepseekV4FlashMLAAttention"),
    ("deepseek_v41", "10.0/backend=FLASHMLA_MEGA_ATTN_DSV41", "DeepseekV4MegaAttnAttention"),
    ("deepseek_v41", "10.0/backend=FLASHINFER_MLA_SPARSE_DSV41", "DeepseekV4FlashInferMLAAttention"),
    ("deepseek_v4", "9.0/backend=FLASHMLA_SPARSE_DSV4", "DeepseekV4FlashMLAAttention"),
    ("deepseek_v4", "12.0/backend=FLASHINFER_MLA_SPARSE_DSV4", "DeepseekV4FlashInferSM120Attention"),
    # upstream's DeepSeek selectors ignore non-DeepSeek backends; so do we
    ("deepseek_v41", "8.6/backend=TRITON_MLA", "DeepinferAmpereV41Attention"),
    ("deepseek_v4", "8.0/backend=TRITON_MLA", "DeepinferAmpereV4Attention"),
    ("deepseek_v4", "9.0/backend=TRITON_MLA", "DeepseekV4FlashMLAAttention"),
])
def test_patched_selector_explicit_runnable_backend_kept(sel, model, key, want):
    assert _value(sel, f"{model}/{key}") == want


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cap", ["8.0", "8.6", "8.9", "9.0", "10.0", "12.0"])
def test_patched_selector_our_backend_by_name(sel, model, cap):
    """--attention-backend DEEPINFER_AMPERE_SPARSE_DSV41 / _DSV4 (patch 0016) picks the Ampere
    class on every capability from 8.0; the other model's name is an error."""
    ours = {"deepseek_v41": "DEEPINFER_AMPERE_SPARSE_DSV41",
            "deepseek_v4": "DEEPINFER_AMPERE_SPARSE_DSV4"}
    assert _value(sel, f"{model}/{cap}/backend={ours[model]}") == AMPERE[model]
    other = next(b for m, b in ours.items() if m != model)
    err, msg = _error(sel, f"{model}/{cap}/backend={other}")
    assert err == "ValueError" and "another model" in msg


def test_registry_lists_our_backends(sel):
    v = _value(sel, "registry")
    assert v["DEEPINFER_AMPERE_SPARSE_DSV41"] == [
        "vllm.deepinfer.attention.ampere_v41.DeepinferAmpereV41MLASparseBackend",
        "DEEPINFER_AMPERE_SPARSE_DSV41"]
    assert v["DEEPINFER_AMPERE_SPARSE_DSV4"] == [
        "vllm.deepinfer.attention.ampere_v4.DeepinferAmpereV4MLASparseBackend",
        "DEEPINFER_AMPERE_SPARSE_DSV4"]


@pytest.mark.parametrize("model", MODELS)
def test_patched_selector_backend_and_env_conflict(sel, model):
    err, msg = _error(sel, f"{model}/9.0/backend=FLASHMLA_SPARSE_DSV4+on")
    assert err == "ValueError" and "DEEPINFER_AMPERE_ATTN=1" in msg and "FLASHMLA_SPARSE_DSV4" in msg


def test_patched_selector_v41_pcp(sel):
    err, msg = _error(sel, "deepseek_v41/8.0/pcp2")
    assert err == "ValueError" and "prefill context parallelism" in msg and "8.0" in msg
    assert _value(sel, "deepseek_v41/9.0/pcp2") == "DeepseekV4FlashMLAAttention"


def test_patched_selector_no_device_or_pre_ampere(sel):
    assert _value(sel, "deepseek_v41/none/default") == "DeepseekV4FlashMLAAttention"
    assert _value(sel, "deepseek_v41/7.5/default") == "DeepseekV4FlashMLAAttention"


# --------------------------------------------------------------------------- Ampere classes
def test_probe_has_no_flashmla_deepgemm_cutedsl(built):
    assert built["absent"] == {"deep_gemm": False, "cutedsl": False, "flashmla": False}


LAYERS = {  # layer id -> (compress ratio, indexer?, compressor?)
    "deepseek_v41": {0: (0, False, False), 1: (1, True, True), 2: (2, True, True),
                     3: (1, False, False)},
    "deepseek_v4": {0: (1, False, False), 1: (4, True, True), 2: (128, False, True)},
}


@pytest.mark.parametrize("model", MODELS)
def test_ampere_classes_construct(built, model):
    for i, (ratio, has_indexer, has_compressor) in LAYERS[model].items():
        v = _value(built, f"{model}/layer{i}")
        assert v["class"] == AMPERE[model]
        assert v["compress_ratio"] == ratio
        assert v["padded_heads"] == 8  # no FlashMLA head padding
        assert v["backend"] == ("DEEPINFER_AMPERE_SPARSE_DSV41" if model == "deepseek_v41"
                                else "DEEPINFER_AMPERE_SPARSE_DSV4")
        assert v["swa_builder"].startswith("DeepinferAmpere")  # never plans FlashMLA tiles
        # Compressed pages: V4.1 upstream's SM90 page of 64 tokens (feature kv_page64; upstream
        # asks for 128 off SM90), V4 256; V4.1's index-K cache the same 64 through our subclass
        # of upstream's backend, which keeps its name and builder.
        assert v["kernel_block_sizes"] == ([64] if model == "deepseek_v41" else [256])
        idx = v["index_cache"]
        assert (idx is None) == (not has_indexer)
        if idx:
            assert (idx["class"], idx["backend"], idx["kernel_block_sizes"]) == (
                ("DeepinferAmpereV41IndexerCache", "DEEPSEEK_V41_INDEXER", [64])
                if model == "deepseek_v41" else ("DeepseekV4IndexerCache", "DEEPSEEK_V4_INDEXER", [256]))
            assert idx["builder"] == idx["upstream_builder"]
        assert (v["indexer_op"] == "DeepinferAmpereSparseAttnIndexer") == has_indexer
        assert v["has_compressor"] == has_compressor
        assert v["wo_a_is_bmm"] is False
        # Upstream's aux-stream overlap runs unchanged (indexer beside the KV compression).
        assert v["stream_methods_ours"] == [] and v["indexer_init_ours"] is False


@pytest.mark.parametrize("model", MODELS)
def test_ampere_profile_run(built, model):
    assert _value(built, f"{model}/profile_run_zeroes_output") is True


@pytest.mark.parametrize("model", MODELS)
def test_ampere_o_proj_bf16(built, model):
    v = _value(built, f"{model}/o_proj")
    assert v["cached_bf16"] and v["max_abs_err"] <= 0.02 * v["ref_scale"] + 1e-3, v


@pytest.mark.parametrize("model", MODELS)
def test_ampere_o_proj_fp8_wo_a_copied_before_repack(built, model):
    v = _value(built, f"{model}/o_proj_fp8_wo_a")
    assert v["refused_without_copy"] and "no bf16 copy" in v["refused_without_copy"]
    assert v["max_abs_err"] <= 0.02 * v["ref_scale"] + 1e-3, v


@pytest.mark.parametrize("model", MODELS)
def test_ampere_decode_refuses_upstream_fp8_fallback(built, model):
    v = _value(built, f"{model}/decode_without_our_kernel")
    assert v["feature_on"] is True
    for variant in ("cpu", "sm80"):
        assert str(v[variant]).startswith("RuntimeError") and "sparse_mla_decode" in v[variant]
    assert v["sm90"] is False  # hardware fp8: upstream's fallback, standalone inverse RoPE


@pytest.mark.parametrize("model", MODELS)
def test_ampere_indexer_scoring_is_upstreams_op(built, model):
    """Scoring is upstream's sparse_attn_indexer (logits routed by patch 0015), for uniform
    and padded decode layouts alike."""
    v = _value(built, f"{model}/indexer_scoring")
    assert v["uniform"] == v["padded"] == v["ragged"] == "upstream"
    assert v["delegated_to_self"] is True


@pytest.mark.parametrize("model", MODELS)
def test_ampere_indexer_refuses_without_any_scorer(built, model):
    err, msg = _error(built, f"{model}/indexer_scorer_off")
    assert err == "RuntimeError" and "indexer_logits" in msg and "DeepGEMM" in msg, msg


def test_patched_pack_seq_routes_to_ours(writers):
    v = _value(writers, "writers.pack_seq_fp8")
    assert v == {"dtype": "torch.float8_e4m3fn", "shape": [3, 3, 4, 128], "bytes_equal": True,
                 "unpack_equal": True, "ours_calls": {"pack": 1, "unpack": 1}}


def test_patched_deep_gemm_logits_route_to_ours(writers):
    v = _value(writers, "writers.deep_gemm_logits")
    assert v["paged_equal"] is True and v["flat_equal"] is True
    assert v["mx_call"] != "ours" and "DeepGEMM" in v["mx_call"], v["mx_call"]


# --------------------------------------------------------------------------- forward
@pytest.fixture(scope="module")
def forward():
    return _probe("forward")


# Outputs are bf16 of magnitude ~1 (random unit rows): 1e-2 x max(1, |ref|) is about one bf16
# ulp of the largest output; the measured errors are 2e-3 - 6e-3 (fp32 reference).
FORWARD_TOL = 1e-2
FORWARD_LAYERS = [("deepseek_v41", 0, 0), ("deepseek_v41", 1, 1), ("deepseek_v4", 0, 1),
                  ("deepseek_v4", 1, 4), ("deepseek_v4", 2, 128)]  # (model, layer, ratio)


@pytest.mark.parametrize("model,layer,ratio", FORWARD_LAYERS)
def test_ampere_forward_decode(forward, model, layer, ratio):
    """forward_mqa's decode on CPU (interpreter, sm80): plain torch within tolerance, and
    the same bytes as our kernel called directly (the class's glue is right)."""
    v = _value(forward, f"forward/{model}/decode_layer{layer}")
    assert v["ratio"] == ratio and v["finite"] is True and v["ref_max"] > 0.1
    assert v["bytes_equal"] is True
    assert v["max_abs_err"] <= FORWARD_TOL * max(1.0, v["ref_max"]), v


@pytest.mark.parametrize("model,layer,ratio", FORWARD_LAYERS)
def test_ampere_forward_prefill(forward, model, layer, ratio):
    """forward_mqa's prefill with upstream's real SWA metadata (chunk plan), our gather and
    combiner, upstream's bf16 prefill kernel (DEEPINFER_SPARSE_MLA_PREFILL=0: ours never
    ran), the inverse RoPE: plain torch within tolerance."""
    v = _value(forward, f"forward/{model}/prefill_layer{layer}")
    assert v["calls"]["upstream"] >= 1 and v["calls"]["ours"] == 0, v["calls"]
    assert v["ratio"] == ratio and v["finite"] is True and v["ref_max"] > 0.1
    assert v["max_abs_err"] <= FORWARD_TOL * max(1.0, v["ref_max"]), v


# --------------------------------------------------------------------------- yoco
@pytest.fixture(scope="module")
def yoco_probe():
    return _probe("yoco")


def test_yoco_reuse_outputs_identical(yoco_probe):
    """Six V4.1 Ampere layers (ratios 0,2,2,1,1,1; KV sources 1,3; index sources 1,3,4), one
    mixed forward: every layer's output has the same bytes with reuse on and off."""
    on, off = _value(yoco_probe, "yoco/on"), _value(yoco_probe, "yoco/off")
    assert on["enabled"] is True and off["enabled"] is False
    assert on["finite"] and off["finite"]
    assert _value(yoco_probe, "yoco/outputs_equal") == [True] * 6


def test_yoco_reuse_builds_once_per_group(yoco_probe):
    """Decode global indices (and their ragged form): one build per (index source, KV source,
    ratio) = {(1,1,2), (3,3,1), (4,3,1)}, not one per compressed layer (5); the SWA window's
    ragged lists: one, not one per layer (6); compressed gathers: one per KV source (2, not
    5); combined lists: SWA-only + three index groups (4, not 6). Each layer still gathers its
    own SWA rows (6)."""
    on, off = _value(yoco_probe, "yoco/on"), _value(yoco_probe, "yoco/off")
    assert off["calls"] == {"compute_global_topk_indices_and_lens": 5,
                            "build_ragged_indices_from_dense": 6 + 5,
                            "dequantize_and_gather_k_cache": 5 + 6,
                            "combine_topk_swa_indices": 6}
    assert on["calls"] == {"compute_global_topk_indices_and_lens": 3,
                           "build_ragged_indices_from_dense": 1 + 3,
                           "dequantize_and_gather_k_cache": 2 + 6,
                           "combine_topk_swa_indices": 4}
    assert on["builds"] == {"decode_indices": 3, "swa_ragged": 1, "gather": 2, "combine": 4}
    assert on["hits"] == {"decode_indices": 2, "swa_ragged": 5, "gather": 3, "combine": 2}
    assert off["builds"] is None  # off: no cache is even created


def test_yoco_verify_mode_through_the_ampere_class(yoco_probe):
    """DEEPINFER_YOCO_VERIFY=1 on the same forward: each of the 12 hits is built again by
    the layer's own calls (the prefill's compressed gather included, through
    common.py's verify_gather) and equals the reused product bit for bit; the outputs are
    still reuse-off's."""
    v = _value(yoco_probe, "yoco/verify")
    t = v["totals"]
    assert v["outputs_equal_off"] == [True] * 6
    assert not [k for k in t if k.endswith(".verify_mismatch")], t
    assert {k: t.get(f"{k}.verify_equal") for k in v["hits"]} == v["hits"] == {
        "decode_indices": 2, "swa_ragged": 5, "gather": 3, "combine": 2}


def test_yoco_reuse_across_swa_cache_groups(yoco_probe):
    """vLLM puts neighbouring layers' SWA caches in different cache groups, each with its own
    metadata object: the same layers alternating between two groups (own block tables and
    buffers, the batch's common storage) still share every product but the SWA window's
    lists (one per group), with outputs the same bytes as reuse off and every hit rebuilt
    equal under DEEPINFER_YOCO_VERIFY=1."""
    on, off = _value(yoco_probe, "yoco/groups2_on"), _value(yoco_probe, "yoco/groups2_off")
    assert on["calls"] == {"compute_global_topk_indices_and_lens": 3,
                           "build_ragged_indices_from_dense": 2 + 3,
                           "dequantize_and_gather_k_cache": 2 + 6,
                           "combine_topk_swa_indices": 4}
    assert off["calls"]["compute_global_topk_indices_and_lens"] == 5
    assert on["builds"] == {"decode_indices": 3, "swa_ragged": 2, "gather": 2, "combine": 4}
    assert on["hits"] == {"decode_indices": 2, "swa_ragged": 4, "gather": 3, "combine": 2}
    assert _value(yoco_probe, "yoco/groups2_outputs_equal") == [True] * 6
    v = _value(yoco_probe, "yoco/groups2_verify")
    t = v["totals"]
    assert not [k for k in t if k.endswith(".verify_mismatch")], t
    assert {k: t.get(f"{k}.verify_equal") for k in v["hits"]} == v["hits"] == on["hits"]
    assert v["outputs_equal_off"] == [True] * 6


def test_yoco_patched_flashmla_decode(yoco_probe):
    """Patch 0040: upstream's FlashMLA decode over five compressed layers hands FlashMLA the
    same global indices and lens with reuse on and off, built 3 times instead of 5; the
    layers of one (index source, KV source, ratio) group get the very same tensor; an
    invalid token still gets length 0."""
    v = _value(yoco_probe, "yoco/flashmla_decode")
    assert v["builds_on"] == 3 and v["builds_off"] == 5 and v["same_values"] is True
    # layers 1,2 | 3 | 4,5: shared within a group, not across groups
    assert v["shared_tensor"] == [True, False, False, True]
    assert v["masked_token_len"] == 0


def test_yoco_patched_indexer_k_gather(yoco_probe):
    """Patch 0041: three index sources sharing one index-K cache, a prefill split into two
    query slices: the K gather runs once (three times off) and every logits call reads the
    cache's rows."""
    v = _value(yoco_probe, "yoco/indexer_k")
    assert v == {"gathers_on": 1, "gathers_off": 3, "logits_calls": [6, 6], "rows_equal": True}


@pytest.mark.parametrize("model,layer,ratio", FORWARD_LAYERS)
def test_ampere_forward_prefill_routed_to_ours(forward, model, layer, ratio):
    """The same prefill with DEEPINFER_SPARSE_MLA_PREFILL=1: patch 0003 sent every chunk to
    our kernel (upstream's ragged launcher never ran), plain torch within tolerance."""
    v = _value(forward, f"forward/{model}/prefill_ours_layer{layer}")
    assert v["calls"]["ours"] >= 1 and v["calls"]["upstream"] == 0, v["calls"]
    assert v["ratio"] == ratio and v["finite"] is True and v["ref_max"] > 0.1
    assert v["max_abs_err"] <= FORWARD_TOL * max(1.0, v["ref_max"]), v


# --------------------------------------------------------------------------- fp8 writers
@pytest.fixture(scope="module")
def writers():
    return _probe("writers")


@pytest.mark.parametrize("key", ["v41_rope_quant_insert", "v41_indexer_k_store"])
def test_patched_v41_writers_route_to_ours(writers, key):
    # The patched upstream function, called on sm80 (interpreter), wrote exactly the bytes
    # our fp8-free writer writes (and something was written).
    got = _value(writers, f"writers.{key}")
    assert got == {"same": True, "written": True}


@pytest.mark.parametrize("key", ["v4_indexer_q", "v4_inv_rope"])
def test_patched_v4_writers_route_to_ours(writers, key):
    assert _value(writers, f"writers.{key}")["same"] is True


def test_patched_v4_compressor_launcher_passes_every_argument(writers):
    got = _value(writers, "writers.v4_compressor_launcher")
    assert len(got["passed"]) == 23 and got["mx_scale"] is False  # 22 upstream args + mx_scale


def test_has_cutedsl_gated_below_8_9(writers):
    # With the cutlass package "present", CuTeDSL counts only from capability 8.9.
    assert _value(writers, "writers.has_cutedsl") == {"8.0": False, "8.6": False,
                                                      "8.9": True, "9.0": True}


def test_deepinfer_kernels_register_with_vllm_jit_warmup(writers):
    got = _value(writers, "writers.warmup")
    assert got["registered"] is True and got["entries"] == 1  # two layers, one registration
    # Ours (sm80: prefill, the two-phase decode's first phase; ampere_attn: inverse RoPE and
    # dense -> ragged; fp8_sw: patch 0017's pack / unpack) and upstream's ragged conversion
    # (serve_warmup: compact_rows, count_valid_rows). No candidate blocks in the probe's
    # model: no candidate-logits kernel, ours or upstream's, is registered.
    assert got["kernels"] == ["compact_rows", "count_valid_rows", "decode", "decode_predequant",
                              "decode_reduce", "indexer_logits", "inverse_rope", "kv_gather",
                              "pack_seq_pack", "pack_seq_unpack", "prefill", "ragged_compact",
                              "ragged_count", "topk_swa"]
    assert got["keys"] > 0
