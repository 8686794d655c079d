"""vllm.deepinfer.arch / envs: variant tables, forcing, and per-feature fallbacks."""
import os
import sys

import pytest

import subproc
from vllm.deepinfer import arch, envs


@pytest.mark.parametrize("cap,name", [
    ((8, 0), "sm80"), ((8, 6), "sm86"), ((8, 7), "sm86"), ((8, 9), "sm89"), ((9, 0), "sm90"),
    ((10, 0), "sm100"), ((10, 3), "sm100"), ((12, 0), "sm100"), (None, "cpu"),
])
def test_capability_table(cap, name):
    assert arch.variant_for_capability(cap) == name


@pytest.mark.parametrize("cap", [(7, 5), (7, 0), (6, 1)])
def test_unsupported_capability_names_it(cap):
    with pytest.raises(arch.UnsupportedGPU, match=f"{cap[0]}.{cap[1]}"):
        arch.variant_for_capability(cap)


def test_ampere_has_no_hw_fp8_and_48k_budget():
    for v in ("sm80", "sm86"):
        assert not arch.VARIANTS[v].hw_fp8
        assert arch.VARIANTS[v].smem_budget == 48 * 1024
    for v in ("sm89", "sm90", "sm100"):
        assert arch.VARIANTS[v].hw_fp8


def test_forced_variant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ARCH", "sm80")
    v, why = arch.resolve_variant()
    assert v.name == "sm80" and why == "DEEPINFER_ARCH"
    monkeypatch.setenv("DEEPINFER_ARCH", "sm75")
    with pytest.raises(ValueError, match="sm75"):
        arch.resolve_variant()


def test_interpreter_without_force_is_cpu(monkeypatch):
    monkeypatch.delenv("DEEPINFER_ARCH", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert arch.resolve_variant()[0].name == "cpu"


def test_feature_switches(monkeypatch):
    monkeypatch.delenv("DEEPINFER_DISABLE", raising=False)
    monkeypatch.delenv("DEEPINFER_AMPERE_ATTN", raising=False)
    assert envs.enabled("ampere_attn", "sm80")
    assert not envs.enabled("ampere_attn", "sm90")
    monkeypatch.setenv("DEEPINFER_AMPERE_ATTN", "1")
    assert envs.enabled("ampere_attn", "sm90")
    monkeypatch.setenv("DEEPINFER_DISABLE", "topk_swa")
    assert not envs.enabled("topk_swa", "sm80") and envs.enabled("kv_gather", "sm80")
    monkeypatch.setenv("DEEPINFER_DISABLE", "all")
    assert not any(envs.enabled(f, "sm80") for f in envs.FEATURES)
    monkeypatch.setenv("DEEPINFER_DISABLE", "")
    monkeypatch.setenv("DEEPINFER_KV_GATHER", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_KV_GATHER"):
        envs.enabled("kv_gather", "sm80")
    with pytest.raises(KeyError, match="nope"):
        envs.enabled("nope", "sm80")


def _import_log(env_extra):
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "overlay"),
               **env_extra)
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout);"
            "import vllm.deepinfer; import sys; print('triton' in sys.modules, 'vllm.platforms' in sys.modules);"
            "import torch; print(torch.cuda.is_initialized())")
    return subproc.run([sys.executable, "-c", code], env=env, cap=120)


def test_import_logs_one_line_and_needs_no_vllm():
    r = _import_log({"DEEPINFER_ARCH": "sm86", "DEEPINFER_DISABLE": "topk_swa"})
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "deepinfer" in ln]
    assert len(lines) == 1, r.stdout
    assert "variant sm86" in lines[0] and "topk_swa=off" in lines[0] and "kv_gather=on" in lines[0]
    # no vLLM imported, CUDA not initialized by the variant resolution
    assert r.stdout.splitlines()[-2:] == ["False False", "False"]


@pytest.mark.parametrize("variant,warned", [("sm80", True), ("sm86", True), ("sm90", False)])
def test_switching_off_an_fp8_replacement_on_ampere_warns(variant, warned):
    # Below sm_89 upstream's fallbacks for these features cannot compile: say so at import.
    r = _import_log({"DEEPINFER_ARCH": variant, "DEEPINFER_DISABLE": "kv_gather,fp8_sw"})
    assert r.returncode == 0, r.stderr
    warn = [ln for ln in r.stdout.splitlines() if "fp8e4nv" in ln]
    assert bool(warn) == warned, r.stdout
    if warned:
        assert "fp8_sw, kv_gather switched off on " + variant in warn[0]


@pytest.mark.parametrize("variant,warned", [("sm80", True), ("sm89", True), ("sm90", False)])
def test_switching_off_indexer_logits_below_sm90_warns(variant, warned):
    r = _import_log({"DEEPINFER_ARCH": variant, "DEEPINFER_INDEXER_LOGITS": "0"})
    assert r.returncode == 0, r.stderr
    warn = [ln for ln in r.stdout.splitlines() if "DeepGEMM" in ln]
    assert bool(warn) == warned, r.stdout
