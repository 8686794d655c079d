# DeepInfer-SM80 — one Makefile for the whole pipeline. `make verify` and `make test` do
# everything on a fresh machine (CPU only is fine); `make bench` needs a CUDA GPU.
SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c

VENV     ?= .venv
PY       ?= $(VENV)/bin/python
HOSTPY   ?= python3
BUILD    ?= build
UPSTREAM := $(BUILD)/vllm-0.33.0
KERNELS  := $(BUILD)/upstream_kernels
# pytest workers: the interpreter-heavy kernel tests split across the CPU cores.
JOBS     ?= auto
export DEEPINFER_BUILD := $(abspath $(BUILD))

.PHONY: help venv upstream upstream-kernels patched combined combined-check overlay apply refresh \
        check-tree gate verify verify-exact test bench gate-mhc charts clean e2e

help:
	@echo "make verify   fetch vLLM 0.33.0, apply the series, build the combined patch and overlay,"
	@echo "              run the compile gate and the bit-exactness tests"
	@echo "make test     the whole test suite (CPU: Triton interpreter)"
	@echo "make apply TREE=path/to/vllm-src    apply the series (all or nothing, verified)"
	@echo "make check-tree TREE=path           is TREE patched exactly as the series says?"
	@echo "make refresh TREE=path              regenerate the patches from an edited tree"
	@echo "make patched  build/patched: the sdist with the series applied (tests/test_vllm_import.py)"
	@echo "make combined | combined-check | overlay | gate | gate-mhc | bench | charts"

# requirements-vllm-import.txt: the pure-Python packages importing the patched vLLM model
# modules needs (never vLLM itself); torch==2.13.0 stays on the pip line so no CUDA torch
# comes in.
$(VENV)/.ok: requirements-test.txt requirements-vllm-import.txt
	$(HOSTPY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements-test.txt
	$(VENV)/bin/pip install -q torch==2.13.0 -r requirements-vllm-import.txt
	touch $@

venv: $(VENV)/.ok

upstream: $(UPSTREAM)/.git/HEAD
$(UPSTREAM)/.git/HEAD:
	$(HOSTPY) tools/upstream.py fetch --dest $(UPSTREAM)

upstream-kernels: $(KERNELS)/__init__.py
$(KERNELS)/__init__.py: $(UPSTREAM)/.git/HEAD tools/extract_upstream.py
	$(HOSTPY) tools/extract_upstream.py --tree $(UPSTREAM) --out $(KERNELS)

combined: upstream
	$(HOSTPY) tools/patchset.py combine --pristine $(UPSTREAM)

combined-check: upstream
	$(HOSTPY) tools/patchset.py combine --check --pristine $(UPSTREAM)

overlay: upstream
	$(HOSTPY) tools/patchset.py overlay --pristine $(UPSTREAM) --out $(BUILD)/overlay

apply:
	@test -n "$(TREE)" || { echo "usage: make apply TREE=path/to/vllm-0.33.0"; exit 2; }
	$(HOSTPY) tools/patchset.py apply --tree "$(TREE)"

check-tree:
	@test -n "$(TREE)" || { echo "usage: make check-tree TREE=path/to/vllm-0.33.0"; exit 2; }
	$(HOSTPY) tools/patchset.py verify --tree "$(TREE)"

refresh:
	@test -n "$(TREE)" || { echo "usage: make refresh TREE=path/to/edited/tree"; exit 2; }
	$(HOSTPY) tools/patchset.py refresh --tree "$(TREE)"

gate: venv
	env -u TRITON_INTERPRET PYTHONPATH=overlay $(PY) -m vllm.deepinfer.compile_gate --json $(BUILD)/gate.json

# mHC TileLang kernels for sm_80/sm_86 (vllm.deepinfer.mhc.gate): imports vLLM's mHC kernels
# from the patched tree; TileLang caches builds in $(BUILD)/tilelang-cache.
gate-mhc: venv $(BUILD)/patched/.ok
	env -u TRITON_INTERPRET CUDA_VISIBLE_DEVICES= PYTHONPATH=$(BUILD)/patched \
		$(PY) -m vllm.deepinfer.mhc.gate --json $(BUILD)/gate-mhc.json

# The patched tree: a scratch copy of the pristine sdist with the series applied and our
# package copied in as vllm/deepinfer; tests/test_vllm_import.py imports vLLM from it.
patched: $(BUILD)/patched/.ok
$(BUILD)/patched/.ok: $(UPSTREAM)/.git/HEAD $(wildcard patches/vllm-0.33.0/*) $(shell find overlay -name '*.py')
	rm -rf $(BUILD)/patched
	cp -r $(UPSTREAM) $(BUILD)/patched
	$(HOSTPY) tools/patchset.py apply --tree $(BUILD)/patched
	touch $@

EXACT_TESTS := tests/test_fp8.py tests/test_kv_gather.py tests/test_topk_swa.py \
               tests/test_sparse_mla_decode.py tests/test_fp8_writers.py \
               tests/test_fp8_writers_v4_compress.py

verify-exact: venv upstream-kernels $(BUILD)/patched/.ok combined-check overlay gate gate-mhc
	DEEPINFER_REQUIRE_UPSTREAM=1 $(PY) -m pytest -q -n $(JOBS) $(wildcard $(EXACT_TESTS))

# The OK line is a recipe of its own: under .ONESHELL make echoes a whole recipe before
# running it, so an echo after pytest in the same recipe was printed before the tests ran.
verify: verify-exact
	@echo "verify: OK (series applied and verified, combined patch and RESULTS.sha256 current, overlay built, gate and exactness passed)"

test: venv upstream-kernels $(BUILD)/patched/.ok
	DEEPINFER_REQUIRE_UPSTREAM=1 $(PY) -m pytest -q -n $(JOBS) tests

bench: upstream-kernels
	PYTHONUNBUFFERED=1 $(HOSTPY) benchmarks/run.py $(BENCH_ARGS)

charts:
	$(HOSTPY) benchmarks/charts.py benchmarks/results/*.json

# GPU + an installed vLLM 0.33.0: install the overlay into the vLLM python imports (restoring
# an older install of ours first), then benchmarks/e2e/e2e.py (docs/e2e.md). E2E_ARGS passes
# options through, e.g. E2E_ARGS="--quick" or E2E_ARGS="--steps agree".
e2e: $(BUILD)/overlay/MANIFEST.json
	if $(HOSTPY) tools/install_overlay.py status >/dev/null 2>&1; then \
	  $(HOSTPY) tools/install_overlay.py restore; fi
	$(HOSTPY) tools/install_overlay.py install --overlay $(BUILD)/overlay
	PYTHONUNBUFFERED=1 $(HOSTPY) benchmarks/e2e/e2e.py $(E2E_ARGS)

$(BUILD)/overlay/MANIFEST.json:
	$(MAKE) overlay

clean:
	rm -rf $(BUILD)/patched $(BUILD)/overlay $(KERNELS) $(BUILD)/gate.json $(BUILD)/gate-mhc.json
