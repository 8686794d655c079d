"""Strict switches: every DEEPINFER_* variable is a feature switch or a line of
``envs.VARIABLES``; anything else, an unknown name in DEEPINFER_DISABLE or a switch that is
not 0/1 is an error naming it (at import of vllm.deepinfer, and in the tools). Driven by the
registry, so a variable added there is covered here without editing this file; a variable
used somewhere in the repository but not registered fails the last test.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

from vllm.deepinfer import envs
from reliability_fakes import REPO, clean_env
import subproc

FEATURE_VARS = {envs.feature_variable(f) for f in envs.FEATURES}
# Values a registered variable may take in these tests (anything for the free-form ones).
SAMPLE = {"DEEPINFER_DISABLE": "kv_gather, topk_swa", "DEEPINFER_ENV_CHECK": "warn"}


def test_registry_is_one_line_per_variable():
    assert envs.VARIABLES and not (set(envs.VARIABLES) & FEATURE_VARS)
    for name, what in envs.VARIABLES.items():
        assert re.fullmatch(r"DEEPINFER_[A-Z0-9_]+", name), name
        assert what.strip() and "\n" not in what, name
    assert set(envs.known_variables()) == FEATURE_VARS | set(envs.VARIABLES)


@pytest.mark.parametrize("name", sorted(envs.known_variables()))
def test_every_known_variable_is_accepted(name):
    value = "0" if name in FEATURE_VARS else SAMPLE.get(name, "1")
    assert envs.problems({name: value}) == []


@pytest.mark.parametrize("typo, meant", [("DEEPINFER_KVGATHER", "DEEPINFER_KV_GATHER"),
                                         ("DEEPINFER_DISABLED", "DEEPINFER_DISABLE"),
                                         ("DEEPINFER_AMPERE_ATN", "DEEPINFER_AMPERE_ATTN")])
def test_unknown_variable_names_itself_the_likely_one_and_all_known(typo, meant):
    (line,) = envs.problems({typo: "0"})
    assert f"unknown environment variable {typo} (did you mean {meant}?)" in line
    for known in envs.known_variables():
        assert known in line
    with pytest.raises(envs.EnvError, match=typo):
        envs.check_environment({typo: "0"})


def test_disable_with_an_unknown_feature_is_an_error(monkeypatch):
    monkeypatch.setenv("DEEPINFER_DISABLE", "bogus,kv_gather")
    with pytest.raises(envs.EnvError, match="DEEPINFER_DISABLE names unknown feature.*bogus"):
        envs.enabled("topk_swa", "sm80")
    with pytest.raises(envs.EnvError, match="bogus"):
        envs.explicit("topk_swa")
    for ok in ("", "all", " kv_gather , TOPK_SWA ", "kv_gather,"):
        monkeypatch.setenv("DEEPINFER_DISABLE", ok)
        envs.enabled("kv_gather", "sm80")


@pytest.mark.parametrize("name", sorted(FEATURE_VARS))
def test_feature_switch_must_be_0_or_1(name):
    (line,) = envs.problems({name: "maybe"})
    assert line == f"{name}='maybe': expected 0 or 1"
    for ok in ("0", "1", "true", "off"):
        assert envs.problems({name: ok}) == []


def _import(**extra):
    env = clean_env(PYTHONPATH=str(REPO / "overlay"), TRITON_INTERPRET="1", **extra)
    code = ("import logging, sys; logging.basicConfig(stream=sys.stderr, level=logging.WARNING);"
            "import vllm.deepinfer; print('imported')")
    return subproc.run([sys.executable, "-c", code], env=env, cap=120)


def test_import_fails_loudly_on_a_misspelt_switch():
    r = _import(DEEPINFER_KVGATHER="0")
    assert r.returncode != 0 and "imported" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm.deepinfer.envs.EnvError: unknown environment variable "
                           "DEEPINFER_KVGATHER (did you mean DEEPINFER_KV_GATHER?)"), last
    assert "DEEPINFER_ENV_CHECK=warn" in last


def test_import_with_env_check_warn_logs_and_continues():
    r = _import(DEEPINFER_KVGATHER="0", DEEPINFER_ENV_CHECK="warn")
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr
    assert "DEEPINFER_KVGATHER" in r.stderr and "continuing" in r.stderr


# Where a name is used as an environment variable: os.environ / getenv / setenv / delenv
# with a literal, or NAME= (shell, docs, Makefile, keyword arguments), export NAME, -e NAME.
_USES = [re.compile(p) for p in (
    r"""environ(?:\.get|\.setdefault|\.pop)?\(\s*["'](DEEPINFER_[A-Z0-9_]+)["']""",
    r"""environ\[\s*["'](DEEPINFER_[A-Z0-9_]+)["']""",
    r"""(?:getenv|setenv|delenv)\(\s*["'](DEEPINFER_[A-Z0-9_]+)["']""",
    r"""\b(DEEPINFER_[A-Z0-9_]+)=(?!=)""",
    r"""\bexport\s+(DEEPINFER_[A-Z0-9_]+)""",
    r"""\s-e\s+(DEEPINFER_[A-Z0-9_]+)""",
)]
# Deliberate misspellings in the docs and tests of this very check.
_TYPOS = {"DEEPINFER_KVGATHER", "DEEPINFER_DISABLED", "DEEPINFER_AMPERE_ATN"}


def test_every_deepinfer_variable_used_in_the_repository_is_registered():
    known = envs.known_variables()
    where: dict[str, str] = {}
    roots = [REPO / d for d in ("overlay", "tools", "tests", "benchmarks", "docs", ".ci")]
    files = [p for r in roots if r.is_dir() for p in r.rglob("*")
             if p.is_file() and p.suffix in {".py", ".md", ".sh", ".json", ".txt", ""}
             and "__pycache__" not in p.parts]
    files += [REPO / "Makefile", REPO / "README.md"]
    files += sorted((REPO / "patches").rglob("*.patch"))
    for f in files:
        text = f.read_text(errors="replace")
        for rx in _USES:
            for m in rx.finditer(text):
                where.setdefault(m.group(1), str(f.relative_to(REPO)))
    unregistered = {n: w for n, w in where.items() if n not in known and n not in _TYPOS}
    assert not unregistered, (
        "DEEPINFER_* variables used but not registered: "
        + ", ".join(f"{n} (in {w})" for n, w in sorted(unregistered.items()))
        + " -- add a line to VARIABLES in overlay/vllm/deepinfer/envs.py (or a Feature)")
    assert {"DEEPINFER_BUILD", "DEEPINFER_ARCH", "DEEPINFER_DISABLE"} <= set(where)  # scan works
