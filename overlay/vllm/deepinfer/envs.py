"""Per-feature switches: each optimization can be turned off to fall back to upstream.

``DEEPINFER_DISABLE=feat1,feat2`` (or ``all``) turns features off; ``DEEPINFER_<FEATURE>=0``
turns one off, ``=1`` forces it on for a variant where it is off by default (for example
the Ampere attention path on Hopper, so the H200 can run it). Read at call time, so tests
may change the environment.
"""
from __future__ import annotations

import dataclasses
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
    # Below capability 9.0 no upstream DeepSeek-V4.1/V4 attention class can run (FlashMLA
    # sparse needs 9.x/10.x, FlashInfer sparse 10.x/12.x), hence on for sm89 too.
    # vllm.deepinfer.attention.selector routes _select_dsv4_attn_cls on it.
    Feature("ampere_attn", _AMPERE | {"sm89"}, "Ampere DeepSeek-V4.1/V4 attention path"),
    # DeepGEMM (upstream's only CUDA indexer logits) is built for SM90/SM100: below 9.0 the
    # sparse indexer has no scorer without ours, hence on for sm89 too.
    Feature("indexer_logits", _AMPERE | {"sm89"},
            "sparse-indexer MQA logits without DeepGEMM (fp8_fp4_[paged_]mqa_logits)"),
    # mHC: V4's first-layer pre without DeepGEMM (whose tf32_hc_prenorm_gemm exists only
    # from 9.0) and the Ampere-tuned TileLang configs (vllm.deepinfer.mhc). On for sm89
    # too: it has no DeepGEMM either.
    Feature("mhc", _AMPERE | {"sm89"}, "mHC pre/post on TileLang without DeepGEMM, Ampere configs"),
)}


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
    disabled = {s.strip().lower() for s in os.environ.get("DEEPINFER_DISABLE", "").split(",")}
    if "all" in disabled or feature in disabled:
        return False
    own = os.environ.get(f"DEEPINFER_{feature.upper()}")
    if own is not None:
        val = _truthy(own)
        if val is None:
            raise ValueError(f"DEEPINFER_{feature.upper()}={own!r}: expected 0 or 1")
        return val
    return variant in FEATURES[feature].default_on


def explicit(feature: str) -> bool | None:
    """What the environment itself says about ``feature``: True when ``DEEPINFER_<FEATURE>``
    asks for it, False when that variable or ``DEEPINFER_DISABLE`` turns it off, None when
    neither mentions it (the variant's default applies). Lets callers tell an explicit
    request (e.g. ``DEEPINFER_AMPERE_ATTN=1`` on a Hopper GPU) from a default."""
    if feature not in FEATURES:
        raise KeyError(f"unknown deepinfer feature {feature!r}; known: {', '.join(FEATURES)}")
    disabled = {s.strip().lower() for s in os.environ.get("DEEPINFER_DISABLE", "").split(",")}
    if "all" in disabled or feature in disabled:
        return False
    own = os.environ.get(f"DEEPINFER_{feature.upper()}")
    if own is None:
        return None
    val = _truthy(own)
    if val is None:
        raise ValueError(f"DEEPINFER_{feature.upper()}={own!r}: expected 0 or 1")
    return val


def summary(variant: str) -> str:
    return ", ".join(f"{n}={'on' if enabled(n, variant) else 'off'}" for n in FEATURES)
