"""The test-only capability emulation (emulate.py) and the DeepGEMM capability gate."""
from __future__ import annotations

import pytest

from vllm.deepinfer import arch, emulate, routing


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(emulate.ENV, raising=False)
    monkeypatch.delenv("DEEPINFER_ARCH", raising=False)
    monkeypatch.delenv("DEEPINFER_DEEP_GEMM_GATE", raising=False)
    routing.reset()
    yield
    routing.reset()


@pytest.mark.parametrize("text,cap", [("8.0", (8, 0)), ("8.6", (8, 6)), ("80", (8, 0)),
                                      (" 8,9 ", (8, 9))])
def test_parse(text, cap):
    assert emulate.parse(text) == cap


@pytest.mark.parametrize("text", ["sm80", "8", "7.5", "10.0", "8.0.1", ""])
def test_parse_rejects(text):
    with pytest.raises(ValueError, match=emulate.ENV):
        emulate.parse(text)


def test_off_by_default():
    assert emulate.emulated() is None
    assert emulate.capability((9, 0)) == (9, 0)


def test_emulated_capability_drives_variant(monkeypatch):
    monkeypatch.setenv(emulate.ENV, "8.0")
    monkeypatch.setattr(arch, "_nvml_capability", lambda: (9, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    routing.reset()
    assert emulate.capability((9, 0)) == (8, 0)
    assert arch.device_capability() == (8, 0)
    assert arch.resolve_variant()[0].name == "sm80"


def test_bad_value_is_an_error(monkeypatch):
    monkeypatch.setenv(emulate.ENV, "ampere")
    with pytest.raises(ValueError, match="DEEPINFER_EMULATE_CAPABILITY='ampere'"):
        emulate.capability((9, 0))


@pytest.mark.parametrize("cap,allowed", [((8, 0), False), ((8, 6), False), ((8, 9), False),
                                         ((9, 0), True), ((10, 0), True), (None, True)])
def test_deep_gemm_gate(monkeypatch, cap, allowed):
    monkeypatch.setattr(arch, "device_capability", lambda: cap)
    assert routing.deep_gemm_allowed() is allowed


def test_deep_gemm_gate_switch(monkeypatch):
    monkeypatch.setattr(arch, "device_capability", lambda: (8, 0))
    monkeypatch.setenv("DEEPINFER_DEEP_GEMM_GATE", "0")
    assert routing.deep_gemm_allowed() is True
