"""tools/gpu_tests.py: the stand-in patched tree over an installed vLLM and the JUnit
counts it keeps (CPU)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import gpu_tests  # noqa: E402


def test_stand_in_tree_links_the_site_and_marks_it_ok(tmp_path):
    site = tmp_path / "site"
    (site / "vllm" / "deepinfer").mkdir(parents=True)
    (site / "vllm" / "deepinfer" / "__init__.py").write_text("")
    (site / "tilelang").mkdir()
    tree = gpu_tests.stand_in_tree(site, tmp_path / "b")
    assert tree == tmp_path / "b" / "patched"
    assert (tree / "vllm").is_symlink() and (tree / "tilelang").resolve() == site / "tilelang"
    assert (tree / ".ok").is_file()
    assert not (site / ".ok").exists()
    gpu_tests.stand_in_tree(site, tmp_path / "b")                # again: no error


def test_stand_in_tree_refuses_a_site_without_the_overlay(tmp_path):
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    with pytest.raises(SystemExit, match="no vllm/deepinfer"):
        gpu_tests.stand_in_tree(tmp_path / "site", tmp_path / "b")


def test_junit_counts(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.t" name="a"/>'
        '<testcase classname="tests.t" name="b"><failure message="x"/></testcase>'
        '<testcase classname="tests.t" name="c"><skipped message="s"/></testcase>'
        '<testcase classname="tests.t" name="d"><error message="e"/></testcase>'
        '</testsuite></testsuites>')
    got = gpu_tests.junit_counts(xml)
    assert got == dict(passed_count=1, failed=1, errors=1, skipped=1,
                       failing=["tests.t::b", "tests.t::d"])


def test_refuses_without_a_gpu(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu_tests.main(["tests/test_gpu_tests_tool.py", "--site", "/nonexistent"])
