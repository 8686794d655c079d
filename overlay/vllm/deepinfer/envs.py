"""Per-feature switches: each optimization can be turned off to fall back to upstream.

``DEEPINFER_DISABLE=feat1,feat2`` (or ``all``) turns features off; ``DEEPINFER_<FEATURE>=0``
turns one off, ``=1`` forces it on for a variant where it is off by default (for example
the Ampere attention path on Hopper, so the H200 can run it). Read at call time, so tests
may change the environment.

Strict: every ``DEEPINFER_*`` variable in the environment must be a feature switch
(``FEATURES``) or listed in ``VARIABLES``; ``check_environment()`` (run when
``vllm.deepinfer`` is imported, and by tools/patchset.py apply and tools/install_overlay.py
install) raises ``EnvError`` naming an unknown variable, an unknown name in
``DEEPINFER_DISABLE`` or a switch that is not 0/1, so a misspelt switch fails loudly instead
of leaving a feature in a state nobody asked for. ``DEEPINFER_ENV_CHECK=warn`` turns the
import-time error into a logged warning. A new variable is registered by adding one line to
``VARIABLES`` (tests/test_reliability_envs.py fails for an unregistered one used in the
repository).

Stdlib only at module level: the tools load this file without torch or vLLM.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import os


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    # Variants on which the feature is on unless switched off.
    default_on: frozenset[str]
    what: str


_ALL = frozenset({"sm80", "sm86", "sm89", "sm90", "sm100", "cpu"})
_AMPERE = frozenset({"sm80", "sm86", "cpu"})

FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature("fp8_sw", _AMPERE, "software e4m3/UE8M0 variants of the fp8 writers and readers"),
    Feature("kv_gather", _ALL, "dequantize_and_gather_k_cache (584-byte records)"),
    Feature("topk_swa", _ALL, "combine_topk_swa_indices"),
    Feature("sparse_mla_decode", _ALL, "unified 512-dim sparse MLA decode"),
    # On for the software-e4m3 variants (sm80, sm86, cpu): their decode launches of
    # PREDEQUANT_MIN_TOKENS (4) tokens or more run in two phases (kernels/sparse_mla_decode.py,
    # Tile.predequant, select_tile): 1.1-1.3x faster at 4 tokens, 1.4-2.5x from 16, 5% slower
    # at 1 token x 64 heads, in the H200 run of the sm_80 kernels (benchmarks/results/
    # archive/h200-2026-12-01-sparse_mla_decode-4ab26c8.json; no A100 figures). 0 keeps every launch
    # single-phase. No effect on the hardware-e4m3 variants.
    Feature("decode_predequant", _AMPERE,
            "sparse MLA decode on Ampere: dequantize each key once per token, then attend"),
    # On for the Ampere variants: benchmarks/results/archive/h200-2026-12-01-sweep-prefill-4ab26c8.json
    # timed the sm80 tile (2 warps, plain form) at 1.15-1.17x upstream's
    # _sparse_attn_prefill_ragged_kernel (1654 vs 1909 us at T=2048 / 64 heads, 3245 vs 3774
    # at 128 heads, 5181 vs 6067 at T=512 / top-k 8192) -- H200 timings of the sm_80-targeted
    # tile, built by Triton for sm_90; no Ampere GPU has run it (docs/sparse-mla-prefill.md).
    # Off on sm89/sm100 (the tile is unmeasured on those GPUs) and sm90 (upstream's Hopper
    # classes do not call this prefill; =1 with DEEPINFER_AMPERE_ATTN=1 runs it there).
    # DEEPINFER_SPARSE_MLA_PREFILL=0 keeps upstream's kernel.
    Feature("sparse_mla_prefill", _AMPERE,
            "sparse MLA prefill over the gathered bf16 keys (rocm_sparse_attn_prefill)"),
    # Below capability 9.0 no upstream DeepSeek-V4.1/V4 attention class can run (FlashMLA
    # sparse needs 9.x/10.x, FlashInfer sparse 10.x/12.x), hence on for sm89 too.
    # vllm.deepinfer.attention.selector routes _select_dsv4_attn_cls on it.
    Feature("ampere_attn", _AMPERE | {"sm89"}, "Ampere DeepSeek-V4.1/V4 attention path"),
    # DeepGEMM (upstream's only CUDA indexer logits) is built for SM90/SM100: below 9.0 the
    # sparse indexer has no scorer without ours, hence on for sm89 too.
    Feature("indexer_logits", _AMPERE | {"sm89"},
            "sparse-indexer MQA logits without DeepGEMM (fp8_fp4_[paged_]mqa_logits)"),
    # V4.1 index sources masked to candidate blocks compute logits inside those blocks only
    # (kernels/indexer_candidate_logits.py, patch 0041), with our full kernel's bits in every
    # range a top-k reads, so the selections are upstream's compute-then-mask ones. Taken only
    # where our indexer logits run (indexer_logits on: the bits are our kernel's, not
    # DeepGEMM's), hence on everywhere; 0 computes every logit and masks, as upstream does.
    Feature("candidate_logits", _ALL,
            "V4.1 candidate-masked index sources: logits inside the candidate blocks only"),
    # The vLLM wheel bundles DeepGEMM, so has_deep_gemm() is True on an A100 although
    # DeepGEMM has no kernels below 9.0 (its indexer metadata asserts, its GEMMs fail).
    # On, has_deep_gemm() answers False below capability 9.0 (patch 0011); it never changes
    # the answer from 9.0 up, hence on everywhere.
    Feature("deep_gemm_gate", _ALL, "has_deep_gemm() is False below capability 9.0"),
    # mHC: V4's first-layer pre without DeepGEMM (whose tf32_hc_prenorm_gemm exists only
    # from 9.0) and the Ampere-tuned TileLang configs (vllm.deepinfer.mhc). On for sm89
    # too: it has no DeepGEMM either.
    Feature("mhc", _AMPERE | {"sm89"}, "mHC pre/post on TileLang without DeepGEMM, Ampere configs"),
    # The tensor-core mHC projection above 32 tokens (1.55x to 2.87x upstream's FMA projection
    # from 64 to 1024 tokens, hidden 5120, mhc suite on the H200 with the Ampere builds:
    # benchmarks/results/archive/h200-2026-12-01-mhc-5f462a5.json) and the FUSED_GEOMETRY table
    # (empty: the measured candidate did not win). On for the Ampere variants.
    Feature("mhc_tuned", _AMPERE, "mHC tensor-core projection above 32 tokens, Ampere configs"),
    # 1-32 tokens: mHC post, projection, Sinkhorn and pre-mix of V4.1's shifted and V4's
    # fused boundary in one Triton launch (vllm.deepinfer.mhc.decode_fused, patch 0030)
    # instead of upstream's two TileLang launches. Off on the GPU variants. On the H200
    # (benchmarks/results/h200-2026-12-02-mhc_decode-5f3a658.json) it ran 0.82-1.14x
    # upstream; its residual streams are bit-identical to upstream's in every GPU test case
    # at 3e2842d (benchmarks/results/h200-2026-12-02-gpu-tests-3e2842d.json; docs/mhc.md
    # section 6). DEEPINFER_MHC_DECODE=1 turns it on (needs mhc on too). On for "cpu", where
    # the interpreter tests it.
    Feature("mhc_decode", frozenset({"cpu"}),
            "mHC post + pre of 1-32 tokens in one launch (V4.1, V4)"),
    # Metadata identical across a KV-sharing group is built once per forward
    # (vllm.deepinfer.yoco): the layers compute the same thing either way, hence on
    # everywhere; 0 rebuilds it in every layer, as upstream does.
    Feature("yoco_reuse", _ALL, "cross-layer metadata reuse (YOCO) within one forward"),
    # Upstream's decode top-k forms row x stride in 32 bits (vllm.deepinfer.topk_rows): past
    # 2^31 logits elements the call runs in row chunks of whole requests. Identical below the
    # bound, hence on everywhere; 0 makes every call one upstream call.
    Feature("topk_rows", _ALL, "indexer decode top-k in row chunks within 32-bit offsets"),
    # V4.1's compressed-KV and index-K pages of 64 tokens on the Ampere path (upstream's SM90
    # page) instead of upstream's 128 off SM90 (attention/ampere_v41.py: the MLA backend and
    # DeepinferAmpereV41IndexerBackend). vLLM's own packing fed the real layer specs
    # (tests/test_kv_planner_vllm.py) lays the Ampere path's caches out exactly as upstream's
    # SM90 classes (groups, pool block, tokens) for v41-tput and v41-long. Reported KV tokens
    # in 101.55 GiB against 128-token pages, CPU planning only (no GPU ran it): v41-tput
    # 68,313,610 vs 67,225,551 (+1.6%) at max_model_len 1,048,320 and +4.0% at 524,288 (pool
    # block 93,312 B vs 184,320 B); v41-long +17.1% and +29.6% (69,696 B vs 138,240 B). With
    # only the compressed pages at 64 the pool block became the LCM of the two pages
    # (1,235,520 B) and the cache held 85-89% fewer tokens. On wherever the Ampere class runs
    # (every variant: it only changes our classes' backends; on SM90 it is upstream's own
    # page); the warmup compiles the decode for 64-token pages (warmup.py
    # ModelShapes.v41_pages). DEEPINFER_KV_PAGE64=0 keeps upstream's pages.
    Feature("kv_page64", _ALL, "V4.1 compressed-KV and index-K pages of 64 tokens (Ampere path)"),
    # Upstream helpers the Ampere path launches but vLLM's JIT warmup does not know (the
    # dense -> ragged index conversion, V4.1's candidate-block selection): their per-batch
    # integers are unspecialized (patches 0003 and 0026) and their configurations compiled in the
    # warmup (vllm.deepinfer.warmup), so no request compiles them. The H200 nocompile run
    # (benchmarks/results/archive/h200-2026-12-01-e2e-4ab26c8.json, zero_compile rows) saw each
    # compile while serving. On everywhere: it changes no value, only when compiles happen.
    # Also (vllm.deepinfer.bucket_warmup, patch 0027) DFlash/DSpark's prepare-inputs kernel,
    # whose BLOCK_SIZE moves with the batch: a DSpark engine compiled two of its buckets while
    # serving (benchmarks/results/h200-2026-12-02-e2e-spec-46a68f3.json, spec_zero_compile).
    Feature("serve_warmup", _ALL,
            "upstream ragged/candidate/dflash-prepare helpers unspecialized or warmed"),
    # vLLM's JIT warmup builds non-Triton owners one key at a time; TileLang's mHC owners took
    # about 97 of the 150.6 s warmup of an A100-faithful server on a fresh H200 machine
    # (vllm.deepinfer.warmup_threads). On, V4.1's mHC epilogue owner (patch 0032) and our
    # tensor-core projection build their keys on up to warmup_threads.MAX_THREADS threads:
    # 19.2 -> 10.6 s for four projection keys on the 2-core CPU machine, the same CUDA source
    # per key (benchmarks/results/cpu-2026-12-02-warmup-threads-7716a8b.json). Same kernels
    # either way, hence on everywhere; 0 gives upstream's 4 workers and builds ours in order.
    Feature("warmup_threads", _ALL, "JIT warmup: TileLang mHC keys built on several threads"),
)}


# Every DEEPINFER_* environment variable that is not a feature switch, with one line on what
# it does. Add a line here when you add a variable; nothing else needs to change.
VARIABLES: dict[str, str] = {
    "DEEPINFER_DISABLE": "comma-separated features to switch off, or `all`",
    "DEEPINFER_ARCH": "force a kernel variant (sm80, sm86, sm89, sm90, sm100, cpu)",
    "DEEPINFER_ENV_CHECK": "`error` (default) or `warn`: import's answer to a bad DEEPINFER_*",
    "DEEPINFER_BUILD": "tools and tests: the build directory (default build/)",
    "DEEPINFER_CACHE": "tools/upstream.py and the Makefile: the sdist, venv and compile "
                       "caches (default ~/.cache/deepinfer)",
    "DEEPINFER_VLLM_SDIST": "tools/upstream.py: a local vllm-0.33.0.tar.gz (offline)",
    "DEEPINFER_VLLM_TREE": "tools/upstream.py: a local extracted vLLM 0.33.0 tree (offline)",
    "DEEPINFER_REQUIRE_UPSTREAM": "tests: 1 turns missing build outputs into failures",
    "DEEPINFER_TEST_TIME_SCALE": "tests: multiplies the load-scaled wall-time cap of the "
                                 "subprocesses tests wait on (tests/subproc.py)",
    "DEEPINFER_COMMIT": "benchmarks: the commit recorded in results when git cannot tell",
    "DEEPINFER_LONG_MEMORY_TRACE": "e2e long step: MiB; record allocations of at least that "
                                   "size with their frames during the first timed request, "
                                   "and the code of what stays resident after start-up",
    "DEEPINFER_LONG_RESIDENT_TRACE": "e2e long step: MiB; record the allocator's history from "
                                     "engine start to the end of the warm-up requests only and "
                                     "name the code of resident groups of at least that size",
    "DEEPINFER_SUITE_PART": "benchmarks: i/n runs the i-th of n slices of the "
                            "sparse_mla_prefill suite's full case list",
    "DEEPINFER_EMULATE_CAPABILITY": "test-only: vLLM sees this capability (e.g. 8.0) on any "
                                    "GPU, the A100-faithful mode (vllm.deepinfer.emulate)",
    "DEEPINFER_SORTED_TOPK": "test-only: 1 sorts each indexer top-k row after selection "
                             "(upstream's top-k kernels place entries by atomics, so their "
                             "order, and the attention's summation order, vary run to run)",
    "DEEPINFER_YOCO_VERIFY": "test-only: 1 rebuilds every product cross-layer reuse hands "
                             "out and compares it bit for bit with the reused one "
                             "(vllm.deepinfer.yoco; counts in yoco.totals())",
}

PREFIX = "DEEPINFER_"
ENV_CHECK_MODES = ("error", "warn")


class EnvError(ValueError):
    """A DEEPINFER_* variable that is unknown or malformed (one line, names it)."""


def feature_variable(feature: str) -> str:
    return PREFIX + feature.upper()


def known_variables() -> dict[str, str]:
    """Every DEEPINFER_* variable this package or its tools read, with what it does."""
    out = {feature_variable(f.name): f"0 switches feature {f.name} off, 1 forces it on ({f.what})"
           for f in FEATURES.values()}
    out.update(VARIABLES)
    return out


def _disabled(environ=None) -> set[str]:
    """The names in DEEPINFER_DISABLE; an unknown name is an error (not silently ignored)."""
    env = os.environ if environ is None else environ
    names = {s.strip().lower() for s in env.get("DEEPINFER_DISABLE", "").split(",")} - {""}
    unknown = sorted(names - set(FEATURES) - {"all"})
    if unknown:
        raise EnvError(f"DEEPINFER_DISABLE names unknown feature(s) {', '.join(unknown)}; "
                       f"known: {', '.join(FEATURES)} or all")
    return names


def problems(environ=None) -> list[str]:
    """One line per unknown or malformed DEEPINFER_* variable in ``environ`` (default: ours)."""
    env = os.environ if environ is None else environ
    known = known_variables()
    out = []
    for name in sorted(k for k in env if k.startswith(PREFIX)):
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else ""
            out.append(f"unknown environment variable {name}{hint}: unset it or use one of "
                       f"{', '.join(sorted(known))}")
    try:
        _disabled(env)
    except EnvError as e:
        out.append(str(e))
    for f in FEATURES:
        var = feature_variable(f)
        if var in env and _truthy(env[var]) is None:
            out.append(f"{var}={env[var]!r}: expected 0 or 1")
    mode = env.get("DEEPINFER_ENV_CHECK", "error").strip().lower() or "error"
    if mode not in ENV_CHECK_MODES:
        out.append(f"DEEPINFER_ENV_CHECK={env['DEEPINFER_ENV_CHECK']!r}: expected "
                   f"{' or '.join(ENV_CHECK_MODES)}")
    return out


def check_environment(environ=None) -> None:
    """Raise EnvError (one line) when ``problems()`` finds anything."""
    found = problems(environ)
    if found:
        raise EnvError("; ".join(found))


def check_at_import() -> None:
    """What importing vllm.deepinfer runs: an error unless DEEPINFER_ENV_CHECK=warn.

    An error, not a warning, by default: a serving engineer who misspells a switch
    (DEEPINFER_KVGATHER=0) should not get a server that silently runs the feature anyway."""
    found = problems()
    if not found:
        return
    msg = "; ".join(found)
    if os.environ.get("DEEPINFER_ENV_CHECK", "").strip().lower() == "warn":
        logging.getLogger("vllm.deepinfer").warning(
            "deepinfer: %s (DEEPINFER_ENV_CHECK=warn: continuing)", msg)
        return
    raise EnvError(msg + " (DEEPINFER_ENV_CHECK=warn makes this a warning)")


def _truthy(v: str) -> bool | None:
    v = v.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    return None


def enabled(feature: str, variant: str | None = None) -> bool:
    if feature not in FEATURES:
        raise KeyError(f"unknown deepinfer feature {feature!r}; known: {', '.join(FEATURES)}")
    if variant is None:
        from vllm.deepinfer import arch
        variant = arch.current().name
    disabled = _disabled()
    if "all" in disabled or feature in disabled:
        return False
    own = os.environ.get(f"DEEPINFER_{feature.upper()}")
    if own is not None:
        val = _truthy(own)
        if val is None:
            raise EnvError(f"DEEPINFER_{feature.upper()}={own!r}: expected 0 or 1")
        return val
    return variant in FEATURES[feature].default_on


def explicit(feature: str) -> bool | None:
    """What the environment itself says about ``feature``: True when ``DEEPINFER_<FEATURE>``
    asks for it, False when that variable or ``DEEPINFER_DISABLE`` turns it off, None when
    neither mentions it (the variant's default applies). Lets callers tell an explicit
    request (e.g. ``DEEPINFER_AMPERE_ATTN=1`` on a Hopper GPU) from a default."""
    if feature not in FEATURES:
        raise KeyError(f"unknown deepinfer feature {feature!r}; known: {', '.join(FEATURES)}")
    disabled = _disabled()
    if "all" in disabled or feature in disabled:
        return False
    own = os.environ.get(f"DEEPINFER_{feature.upper()}")
    if own is None:
        return None
    val = _truthy(own)
    if val is None:
        raise EnvError(f"DEEPINFER_{feature.upper()}={own!r}: expected 0 or 1")
    return val


def summary(variant: str) -> str:
    return ", ".join(f"{n}={'on' if enabled(n, variant) else 'off'}" for n in FEATURES)
