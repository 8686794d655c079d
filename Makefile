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
# Caches that outlive a clone, so a fresh clone on a machine that ran verify before rebuilds
# nothing it already built: the pinned vLLM sdist (tools/upstream.py), the venvs keyed by
# their requirements (tools/venv_cache.py; `make VENV_CACHE= ...` builds a private .venv
# instead), and Triton's and TileLang's compile caches. Those two are keyed by what they
# compile (source, target, options, compiler version): a changed kernel is a new entry, and
# the gates read shared memory, registers and instructions from the cached builds.
export DEEPINFER_CACHE ?= $(HOME)/.cache/deepinfer
VENV_CACHE ?= $(DEEPINFER_CACHE)/venvs
export TRITON_CACHE_DIR ?= $(DEEPINFER_CACHE)/triton
export TILELANG_CACHE_DIR ?= $(DEEPINFER_CACHE)/tilelang
# make jobs of `make verify` / `make test`: enough for every independent step to run at once
# (venv + the upstream chain, then the Triton gate, the mHC gate, the exactness tests and the
# second venv stage); on 2 cores they share the CPU, which is busy throughout instead of
# waiting on one step at a time.
STEP_JOBS ?= 4
TIMINGS  := $(BUILD)/timings
# Runs a step and records its start, end and status for the table verify and test print
# (each in a directory of its own, given to their sub-make; a step run alone records here).
STEP_DIR ?= $(TIMINGS)/other
STEP      = $(HOSTPY) tools/steptime.py --dir $(STEP_DIR) run
# Options for the sub-make that runs verify's and test's steps: make does not pass -o and -W
# down to a sub-make, so `make verify STEP_MAKEFLAGS="-o gate"` is how to skip a step there.
STEP_MAKEFLAGS ?=

.PHONY: help venv venv-base upstream upstream-kernels patched combined combined-check overlay apply \
        refresh check-tree gate verify verify-steps verify-exact test test-steps test-suite \
        results-index results-index-check bench gate-mhc charts clean e2e serve-bench

help:
	@echo "make verify   fetch vLLM 0.33.0, apply the series, build the combined patch and overlay,"
	@echo "              run the compile gates and the bit-exactness tests (steps in parallel;"
	@echo "              a table of each step's time at the end)"
	@echo "make test     the whole test suite (CPU: Triton interpreter) and results-index --check"
	@echo "make venv     the test venv (venv-base: without vLLM's import packages)"
	@echo "make results-index   rewrite benchmarks/results/INDEX.md"
	@echo "make apply TREE=path/to/vllm-src    apply the series (all or nothing, verified)"
	@echo "make check-tree TREE=path           is TREE patched exactly as the series says?"
	@echo "make refresh TREE=path              regenerate the patches from an edited tree"
	@echo "make patched  build/patched: the sdist with the series applied (tests/test_vllm_import.py)"
	@echo "make combined | combined-check | overlay | gate | gate-mhc | bench | charts"
	@echo "make e2e | serve-bench   (GPU, vLLM 0.33.0 installed: docs/e2e.md)"

# Two stages, so that the Triton gate and the exactness tests start once torch, Triton and
# pytest are in (stage .ok: requirements-test.txt) while vLLM's import packages go in beside
# them (stage .ok-vllm-import; the mHC gate and make test's vLLM probes need them).
# requirements-vllm-import.txt: the pure-Python packages importing the patched vLLM model
# modules needs (never vLLM itself); torch==2.13.0 stays on the pip line so no CUDA torch
# comes in. Both stages depend on both files: together they key the cached venv.
VENV_REQS := requirements-test.txt requirements-vllm-import.txt
VENV_TOOL  = $(HOSTPY) tools/venv_cache.py --venv $(VENV) --cache "$(VENV_CACHE)" \
             $(addprefix --key-file ,$(VENV_REQS))
$(VENV)/.ok: $(VENV_REQS) tools/venv_cache.py
	$(STEP) venv -- $(VENV_TOOL) --stage ok -- -r requirements-test.txt

$(VENV)/.ok-vllm-import: $(VENV)/.ok
	$(STEP) venv-vllm-import -- $(VENV_TOOL) --stage vllm-import -- \
		torch==2.13.0 -r requirements-vllm-import.txt

venv-base: $(VENV)/.ok
venv: $(VENV)/.ok $(VENV)/.ok-vllm-import

upstream: $(UPSTREAM)/.git/HEAD
$(UPSTREAM)/.git/HEAD:
	$(STEP) upstream -- $(HOSTPY) tools/upstream.py fetch --dest $(UPSTREAM)

upstream-kernels: $(KERNELS)/__init__.py
$(KERNELS)/__init__.py: $(UPSTREAM)/.git/HEAD tools/extract_upstream.py
	$(STEP) upstream-kernels -- $(HOSTPY) tools/extract_upstream.py --tree $(UPSTREAM) --out $(KERNELS)

combined: upstream
	$(HOSTPY) tools/patchset.py combine --pristine $(UPSTREAM)

combined-check: upstream
	$(STEP) combined-check -- $(HOSTPY) tools/patchset.py combine --check --pristine $(UPSTREAM)

overlay: upstream
	$(STEP) overlay -- $(HOSTPY) tools/patchset.py overlay --pristine $(UPSTREAM) --out $(BUILD)/overlay

apply:
	@test -n "$(TREE)" || { echo "usage: make apply TREE=path/to/vllm-0.33.0"; exit 2; }
	$(HOSTPY) tools/patchset.py apply --tree "$(TREE)"

check-tree:
	@test -n "$(TREE)" || { echo "usage: make check-tree TREE=path/to/vllm-0.33.0"; exit 2; }
	$(HOSTPY) tools/patchset.py verify --tree "$(TREE)"

refresh:
	@test -n "$(TREE)" || { echo "usage: make refresh TREE=path/to/edited/tree"; exit 2; }
	$(HOSTPY) tools/patchset.py refresh --tree "$(TREE)"

# verify's compile gate builds the Ampere targets and Hopper; sm_89 and sm_100 (documented
# choices, no GPU of theirs has run the kernels) are built by tests/test_compile_gate.py in
# make test, which runs every spec's targets. Cold, the full gate was 3 min 59 s of a
# 4 min 44 s verify on the 2-core machine (30 of its 184 builds are sm_89/sm_100).
GATE_TARGETS ?= 80,86,90
gate: venv-base
	$(STEP) gate -- env -u TRITON_INTERPRET PYTHONPATH=overlay \
		$(PY) -m vllm.deepinfer.compile_gate --targets $(GATE_TARGETS) --json $(BUILD)/gate.json

# mHC TileLang kernels for sm_80/sm_86 (vllm.deepinfer.mhc.gate): imports vLLM's mHC kernels
# from the patched tree (so it needs vLLM's import packages: the full venv); TileLang caches
# builds in TILELANG_CACHE_DIR (above).
gate-mhc: venv $(BUILD)/patched/.ok
	$(STEP) gate-mhc -- env -u TRITON_INTERPRET CUDA_VISIBLE_DEVICES= PYTHONPATH=$(BUILD)/patched \
		$(PY) -m vllm.deepinfer.mhc.gate --json $(BUILD)/gate-mhc.json

# The patched tree: a scratch copy of the pristine sdist with the series applied and our
# package copied in as vllm/deepinfer; tests/test_vllm_import.py imports vLLM from it.
patched: $(BUILD)/patched/.ok
$(BUILD)/patched/.ok: $(UPSTREAM)/.git/HEAD $(wildcard patches/vllm-0.33.0/*) $(shell find overlay -name '*.py')
	$(STEP) patched -- $(SHELL) -eu -c 'rm -rf $(BUILD)/patched; cp -r $(UPSTREAM) $(BUILD)/patched; \
		$(HOSTPY) tools/patchset.py apply --tree $(BUILD)/patched'
	touch $@

EXACT_TESTS := tests/test_fp8.py tests/test_kv_gather.py tests/test_topk_swa.py \
               tests/test_sparse_mla_decode.py tests/test_fp8_writers.py \
               tests/test_fp8_writers_v4_compress.py

# The exactness tests alone (they need torch, Triton and the generated upstream kernels).
verify-exact: venv-base upstream-kernels
	$(STEP) exact-tests -- env DEEPINFER_REQUIRE_UPSTREAM=1 \
		$(PY) -m pytest -q -n $(JOBS) $(wildcard $(EXACT_TESTS))

# Every check of verify, as independent as their inputs allow (make -j runs them at once).
verify-steps: $(BUILD)/patched/.ok combined-check overlay gate gate-mhc verify-exact

# verify runs the steps in a sub-make so that it can print the timing table whether they pass
# or fail; -Otarget prints each step's output whole when it ends. The recipe is silent (its
# first line's @ covers the whole .ONESHELL recipe): echoing it would print the OK line
# before the steps ran. The OK line only follows a sub-make that passed.
verify:
	@$(HOSTPY) tools/steptime.py --dir $(TIMINGS)/verify reset
	rc=0
	$(MAKE) --no-print-directory -j$(STEP_JOBS) --output-sync=target $(STEP_MAKEFLAGS) \
		STEP_DIR=$(TIMINGS)/verify verify-steps || rc=$$?
	$(HOSTPY) tools/steptime.py --dir $(TIMINGS)/verify report --title "make verify steps"
	if [ $$rc -ne 0 ]; then echo "verify: FAILED (a step above failed: exit $$rc)"; exit $$rc; fi
	echo "verify: OK (series applied and verified, combined patch and RESULTS.sha256 current, overlay built, gate and exactness passed)"

# --durations: the slowest tests are listed at the end, so a slow suite says where it went.
test-suite: venv upstream-kernels $(BUILD)/patched/.ok
	$(STEP) pytest -- env DEEPINFER_REQUIRE_UPSTREAM=1 \
		$(PY) -m pytest -q -n $(JOBS) --durations=20 tests

results-index:
	$(HOSTPY) benchmarks/results_index.py --write

results-index-check:
	$(STEP) results-index-check -- $(HOSTPY) benchmarks/results_index.py --check

test-steps: results-index-check test-suite

# Like verify: a sub-make (-k: the suite runs even when the index check fails), then the
# table. Output is synchronized by line, so pytest's progress shows as it goes.
test:
	@$(HOSTPY) tools/steptime.py --dir $(TIMINGS)/test reset
	rc=0
	$(MAKE) --no-print-directory -k -j$(STEP_JOBS) --output-sync=line $(STEP_MAKEFLAGS) \
		STEP_DIR=$(TIMINGS)/test test-steps || rc=$$?
	$(HOSTPY) tools/steptime.py --dir $(TIMINGS)/test report --title "make test steps"
	if [ $$rc -ne 0 ]; then echo "test: FAILED (exit $$rc)"; exit $$rc; fi

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

# GPU + an installed vLLM 0.33.0: the overlay installed as for e2e, then
# benchmarks/e2e/serve.py (docs/e2e.md, "Serving through vllm serve"): `vllm serve` in the
# a100, upstream and default modes, its OpenAI API checked, `vllm bench serve` at 1K/128 and
# 8K/256, concurrency 1-64. SERVE_ARGS passes options, e.g. SERVE_ARGS="--quick".
serve-bench: $(BUILD)/overlay/MANIFEST.json
	if $(HOSTPY) tools/install_overlay.py status >/dev/null 2>&1; then \
	  $(HOSTPY) tools/install_overlay.py restore; fi
	$(HOSTPY) tools/install_overlay.py install --overlay $(BUILD)/overlay
	PYTHONUNBUFFERED=1 $(HOSTPY) benchmarks/e2e/serve.py $(SERVE_ARGS)

$(BUILD)/overlay/MANIFEST.json:
	$(MAKE) overlay

clean:
	rm -rf $(BUILD)/patched $(BUILD)/overlay $(KERNELS) $(BUILD)/gate.json $(BUILD)/gate-mhc.json \
		$(TIMINGS)
