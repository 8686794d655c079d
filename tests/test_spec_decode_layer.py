"""Speculative decoding at the layer level through the Ampere attention classes
(tests/spec_decode_layer_probe.py, a subprocess on the patched tree; metadata from upstream's
own builders):

* the verify step of MTP (V4, k = 1) and DSpark (V4.1 and V4, k = 5): 1 + k causal query
  tokens per request through SWA-only, V4 C4A and C128A, V4.1 ratio-1 and ratio-2 layers:
  plain torch within the forward tolerance of tests/test_vllm_import.py, and bit-equal to
  the same positions decoded as one-token requests; each token's own window and, in C128A,
  its own compressed count (a block straddling a multiple of 128);
* DSpark's draft block (k tokens, non-causal) through a draft layer: the non-causal rows
  ``[prefix - window, seq_len)`` padded to a multiple of 64, against plain torch, and the
  in-place refresh of the same metadata (``update_draft_decode_metadata``) equal to a fresh
  build, bit for bit;
* the indexer's decode layouts: native next_n = 2 rows (k = 1), padded through pack_seq
  (patch 0017; a CUDA graph's padding request), flattened (k = 5, uniform and padded):
  every token's logits row has its own causal length and plain torch's values, the top-k
  rows are those rows' top-k (V4.1: within the candidate source's blocks, the newest block
  pinned), the layer's decode reads them, and the layouts agree bit for bit.

The ``gpu`` tests run the same probe on a CUDA device at the real attention sizes (64 heads,
top-k 512, contexts up to 9,000) in the A100-faithful mode (DEEPINFER_EMULATE_CAPABILITY=8.0,
the sm80 kernels: every check above) and with the device's own variant (the layouts there
are the device's: only each token's results are checked).
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

import subproc

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).with_name("spec_decode_layer_probe.py")
# tests/test_vllm_import.py's forward tolerance: max |ours - torch| <= TOL * max(1, |ref|).
FORWARD_TOL = 1e-2
# Indexer logits against plain torch, relative to each row's largest (fp32 summation order).
LOGITS_TOL = 1e-5
# The same on the native Hopper kind ("gpu"): there the logits are DeepGEMM's
# fp8_fp4_paged_mqa_logits (our indexer_logits feature is on for Ampere and sm89 only), an
# fp8 tensor-core product whose error is not fp32 summation order: 2.4e-4 of the row's
# largest at v4/indexer_native_k1 on the H200 at f895c39
# (benchmarks/results/h200-2026-12-03-gpu-tests-f895c39.json), four times under this bound.
DEEPGEMM_LOGITS_TOL = 1e-3
WINDOW = 128
VERIFY = {"v4/mtp_k1": 1, "v4/dspark_k5_verify": 5, "v41/dspark_k5_verify": 5}
DRAFTS = {"v4/dspark_draft_k5": ("deepseek_v4", 1), "v41/dspark_draft_k5": ("deepseek_v41", 0)}
LAYOUTS = ("native_k1", "padded_k1", "flat_k5", "flat_padded_k5")


def _run(kind: str) -> dict:
    """One probe run per test session and kind ("cpu", "gpu-sm80", "gpu"), shared by the
    xdist workers."""
    from test_vllm_import import PATCHED, _need_tree, _probe_env
    _need_tree()
    env = _probe_env()
    args = [sys.executable, str(PROBE)]
    if kind.startswith("gpu"):
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.update(PYTHONPATH=str(PATCHED))
        if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
        if kind == "gpu-sm80":
            # The A100-faithful mode: vLLM sees capability 8.0 (patch 0018), so the indexer
            # builder picks the layouts it picks on an A100; the sm80 kernels run.
            env.update(DEEPINFER_ARCH="sm80", DEEPINFER_EMULATE_CAPABILITY="8.0")
        args += ["--device", "cuda", "--real"]
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    d = Path(tempfile.gettempdir()) / f"deepinfer-spec-layer-{run}"
    d.mkdir(exist_ok=True)
    out = d / f"{kind}.json"
    with open(d / f"{kind}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            r = subproc.run(args, env=env, cwd=REPO, cap=900)
            lines = r.stdout.strip().splitlines()
            if r.returncode != 0 or not lines:
                pytest.fail(f"spec decode probe ({kind}) failed (rc {r.returncode}):\n"
                            f"{r.stderr[-4000:]}")
            out.write_text(lines[-1])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cpu(device):
    if device != "cpu":
        pytest.skip("the interpreter sizes; the gpu tests cover CUDA")
    return _run("cpu")


def _case(res: dict, key: str) -> dict:
    r = res[key]
    assert r["ok"], f"{key}: {r['error']}\n{r.get('trace', '')}"
    return r


# --------------------------------------------------------------------------- the checks
def check_verify(res: dict, key: str, exact_single: bool = True) -> None:
    r = _case(res, key)
    k = VERIFY[key]
    md, pos = r["swa_md"], r["positions"]
    n_req = len(pos) // (1 + k)
    # Every request is one decode of 1 + k tokens (threshold 1 + k), no prefill.
    assert (md["num_decodes"], md["num_decode_tokens"], md["num_prefills"]) == \
        (n_req, n_req * (1 + k), 0)
    assert md["threshold"] == 1 + k and md["width"] == WINDOW
    # Each token's window ends at its own position.
    assert md["decode_swa_lens"] == [min(p + 1, WINDOW) for p in pos]
    for i, layer in r["layers"].items():
        assert layer["finite"] and layer["ref_max"] > 0.1, (key, i, layer)
        assert layer["max_abs_err"] <= FORWARD_TOL * max(1.0, layer["ref_max"]), (key, i, layer)
        if exact_single:
            assert layer["single_bits_equal"] is True, (key, i)
        if "c128a_lens" in layer:
            assert layer["ratio"] == 128
            assert layer["c128a_lens"] == [(p + 1) // 128 for p in pos]
    ratios = sorted(layer["ratio"] for layer in r["layers"].values())
    return ratios


def check_draft(res: dict, key: str) -> None:
    r = _case(res, key)
    model, ratio = DRAFTS[key]
    k = 5
    assert r["ratio"] == ratio  # the draft layer after the backbone: SWA only
    md = r["swa_md"]
    width = -(-(WINDOW + k) // 64) * 64
    assert md["width"] == md["decode_swa_width"] == width == 192
    # Non-causal: every token of a block sees [max(prefix - window, 0), seq_len).
    lens = md["decode_swa_lens"]
    assert len(lens) == md["num_decode_tokens"] and len(set(lens[:k])) == 1
    assert len(set(lens[k:])) == 1
    for part in ("first", "refreshed"):
        v = r[part]
        assert v["finite"] and v["ref_max"] > 0.1
        assert v["max_abs_err"] <= FORWARD_TOL * max(1.0, v["ref_max"]), (key, part, v)
    # The check tells the two apart: causal rows for the same block miss the later tokens.
    v = r["causal_rows_error"]
    assert v["max_abs_err"] > 5 * FORWARD_TOL * max(1.0, v["ref_max"]), v
    # The refresh follows the new batch (37 tokens further in): a short context's rows grow.
    assert r["refreshed"]["lens"][0] == lens[0] + 37 and r["refreshed"]["lens"][-1] == lens[-1]
    assert r["refreshed_equals_fresh_build"] is True


def check_layout(res: dict, key: str, ampere: bool = True) -> None:
    """``ampere``: the layouts vLLM picks on an Ampere GPU (no native next_n > 2 without
    Hopper's DeepGEMM); otherwise only each token's rows and results are checked."""
    r = _case(res, key)
    lay = r["layout"]
    layout = key.split("/indexer_")[1]
    n_tok = len(r["positions"])
    if not ampere:
        pass
    elif layout == "native_k1":
        assert not lay["use_flattening"] and not lay["requires_padding"]
        assert lay["seq_lens_shape"] == [lay["num_decodes"], 2]
    elif layout == "padded_k1":
        # A CUDA graph's padding request: decode lens [2, 2, 0], Q packed per request.
        assert not lay["use_flattening"] and lay["requires_padding"]
        assert lay["decode_lens"] == [2, 2, 0] and lay["seq_lens_shape"] == [3, 2]
    else:
        # next_n = 6 has no native kernel without DeepGEMM: one row per token.
        assert lay["use_flattening"] and not lay["requires_padding"]
        assert lay["seq_lens_shape"] == [lay["num_decode_tokens"], 1]
        assert lay["decode_lens"] == [1] * lay["num_decode_tokens"]
        assert lay["num_decode_tokens"] == n_tok + r["pad_tokens"]
    v41 = key.startswith("v41")
    assert sorted(r["layers"]) == (["2", "3"] if v41 else ["1"])
    for i, layer in r["layers"].items():
        assert layer["length_mismatch"] == [], (key, i)
        tol = LOGITS_TOL if ampere else DEEPGEMM_LOGITS_TOL
        assert layer["logits_err_vs_row_max"] <= tol, (key, i, layer)
        assert layer["finite_where_expected"] is True, (key, i)
        assert layer["topk_is_the_rows_topk"] is True, (key, i)
        assert layer["topk_within_candidates"] is True, (key, i)
        d = layer["decode"]
        assert d["finite"] and d["max_abs_err"] <= FORWARD_TOL * max(1.0, d["ref_max"]), (key, i)
        assert layer["decode_pad_rows_zero"] is True
        if v41 and i == "2":
            assert layer["newest_block_pinned"] is True


def check_layouts_agree(res: dict, model: str, bits: bool) -> None:
    """The same requests in every layout: the same logits rows, top-k and decode output."""
    runs = {lay: _case(res, f"{model}/indexer_{lay}") for lay in LAYOUTS
            if f"{model}/indexer_{lay}" in res}
    assert len(runs) >= 3, sorted(runs)
    base = next(iter(runs.values()))
    for lay, r in runs.items():
        assert r["positions"] == base["positions"]
        for i, layer in r["layers"].items():
            assert layer["logits_rows_digest"] == base["layers"][i]["logits_rows_digest"], (lay, i)
            if bits:
                assert layer["topk_digest"] == base["layers"][i]["topk_digest"], (lay, i)
                assert layer["decode_digest"] == base["layers"][i]["decode_digest"], (lay, i)


# --------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("key", sorted(VERIFY))
def test_verify_step(cpu, key):
    ratios = check_verify(cpu, key)
    want = {"v4/mtp_k1": [1, 4, 128], "v4/dspark_k5_verify": [128],
            "v41/dspark_k5_verify": [1, 2]}[key]
    assert ratios == want


@pytest.mark.parametrize("key", sorted(DRAFTS))
def test_dspark_draft_block(cpu, key):
    check_draft(cpu, key)


@pytest.mark.parametrize("key", ["v4/indexer_native_k1", "v4/indexer_padded_k1",
                                 "v4/indexer_flat_k5", "v4/indexer_flat_padded_k5",
                                 "v41/indexer_native_k1", "v41/indexer_padded_k1",
                                 "v41/indexer_flat_k5"])
def test_indexer_decode_layout(cpu, key):
    check_layout(cpu, key)


@pytest.mark.parametrize("model", ["v4", "v41"])
def test_indexer_layouts_agree_bit_for_bit(cpu, model):
    check_layouts_agree(cpu, model, bits=True)


def test_probe_stays_short(cpu):
    # The CPU probe's own budget (the interpreter): the test file stays near a minute.
    assert cpu["_seconds"] < 150, cpu["_seconds"]


@pytest.mark.parametrize("argv, env, hidden", [
    ([], {}, ""),
    (["--device", "cpu"], {}, ""),
    (["--device", "cuda", "--real"], {}, None),
    (["--device=cuda"], {}, None),
    (["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": "1"}, "1"),
    ([], {"CUDA_VISIBLE_DEVICES": "0"}, "0"),
])
def test_probe_hides_gpus_only_for_the_cpu_run(argv, env, hidden):
    # The gpu cases' probe must see the GPU its caller leaves visible.
    sys.path.insert(0, str(PROBE.parent))
    from spec_decode_layer_probe import hide_gpus_for_cpu_run
    hide_gpus_for_cpu_run(argv, env)
    assert env.get("CUDA_VISIBLE_DEVICES") == hidden


# --------------------------------------------------------------------------- GPU
@pytest.fixture(scope="module", params=["gpu-sm80", "gpu"])
def gpu(request, device):
    if device != "cuda":
        pytest.skip("needs a CUDA GPU")
    return request.param, _run(request.param)


@pytest.mark.gpu
def test_real_size_verify_steps(gpu):
    _, res = gpu
    for key in VERIFY:
        check_verify(res, key)


@pytest.mark.gpu
def test_real_size_dspark_draft_blocks(gpu):
    _, res = gpu
    for key in DRAFTS:
        check_draft(res, key)


@pytest.mark.gpu
def test_real_size_indexer_layouts(gpu):
    kind, res = gpu
    for key in [k for k in res if "/indexer_" in k]:
        check_layout(res, key, ampere=kind == "gpu-sm80")
    for model in ("v4", "v41"):
        # The logits rows must agree bit for bit; torch.topk on CUDA may order tied keys
        # differently per launch, so the top-k sets are checked per layout above.
        check_layouts_agree(res, model, bits=False)
