"""JIT warmup of the Ampere mHC path: every TileLang compile key it dispatches is compiled
before serving (vLLM's ``JitWarmupRegistry``), none at request time.

Upstream registers its mHC kernels for the DeepGEMM path: the epilogues with DeepGEMM's
split buckets, and (V4 only) the FMA prenorm GEMM at hc_mult 4. The Ampere path also
dispatches: our tensor-core projection (``kernels.TcKey`` per token bucket), the epilogues
at that projection's split counts, TileLang's prenorm GEMM at hc_mult 1 for first-layer
batches under ``TC_MIN_TOKENS``, (V4.1) the fused post + pre kernel, which V4.1's model
never registers, and the one-launch decode kernel of 1-32 tokens
(``decode_fused.DecodeKey`` per token class, form and slice width; ``decode_keys``).
Upstream's two epilogue owners hand their registrations here (``register_v4`` from
``MhcPreBigFuseTileLangKernel.register_warmup``, patch 0031;
``register_v41`` from ``MHCPreNormKernel.register_warmup``, patch 0032), and their key
lists gain our split counts (``projection_splits``).

Key enumeration is pure Python (tests run it on a CPU); registration imports vLLM.
"""
from __future__ import annotations

import functools
import types
from typing import Any

from vllm.deepinfer import mhc
from vllm.deepinfer.mhc import kernels

# SM counts the split choice is enumerated for when no GPU is visible (CPU tests, the compile
# gate): A100/A800 (108), A30 (56), RTX 3090 / A6000 / A40 (82, 84, 84), A10 (72).
AMPERE_SM_COUNTS = (108, 56, 82, 84, 72)


def tc_keys(k: int, n_out: int, max_tokens: int, sm_counts=None) -> list[kernels.TcKey]:
    """Every tensor-core projection key a batch of up to ``max_tokens`` tokens can take."""
    if not kernels.supported(k, n_out) or max_tokens < mhc.TC_MIN_TOKENS:
        return []
    if sm_counts is None:
        sm_counts = _visible_sm_counts()
    out: list[kernels.TcKey] = []
    for sm in sm_counts:
        for t in range(mhc.TC_MIN_TOKENS, max_tokens + 1):
            key = kernels.key_for(t, k, n_out, sm)
            if key not in out:
                out.append(key)
    return out


def projection_splits(k: int, n_out: int, max_tokens: int, sm_counts=None) -> set[int]:
    """Split counts our projection writes for ``k`` columns (the epilogue compiles per
    count)."""
    if not mhc.first_layer_on_tilelang(_deep_gemm_supported()):
        return set()
    return {key.n_splits for key in tc_keys(k, n_out, max_tokens, sm_counts)}


def decode_keys(hidden: int, max_tokens: int, *, sinkhorn: int, delayed: bool,
                use_pre_in: bool = True, write_aux: bool = False,
                sm_counts=None) -> list:
    """Every ``decode_fused.DecodeKey`` a boundary of ``hidden`` columns can launch for
    batches of up to ``max_tokens`` tokens (none with the mhc or mhc_decode feature off)."""
    from vllm.deepinfer.mhc import decode_fused
    if not decode_fused.enabled():
        return []
    if sm_counts is None:
        sm_counts = _visible_sm_counts()
    return decode_fused.warmup_keys(hidden, max_tokens, sm_counts, sinkhorn=sinkhorn,
                                    delayed=delayed, use_pre_in=use_pre_in,
                                    write_aux=write_aux)


def _visible_sm_counts() -> tuple[int, ...]:
    try:
        import torch
        if torch.cuda.is_available():
            return (mhc.sm_count(torch.cuda.current_device()),)
    except Exception:  # pragma: no cover - broken torch install
        pass
    return AMPERE_SM_COUNTS


def _deep_gemm_supported() -> bool:
    try:
        from vllm.utils.deep_gemm import is_deep_gemm_supported
    except ImportError:
        return False
    return bool(is_deep_gemm_supported())


def _config(max_tokens: int):
    """A stand-in vllm_config for upstream owners whose keys read only the token budget."""
    return types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=max_tokens))


# ----------------------------------------------------------------------------- vLLM glue
@functools.cache
def _tc_owner():
    from vllm.model_executor.warmup.jit_warmup import VllmJitKernel

    class MhcTcProjection(VllmJitKernel[kernels.TcKey]):
        CompileKey = kernels.TcKey

        def get_warmup_keys(self, *, k: int, n_out: int, max_tokens: int) -> list:
            return tc_keys(k, n_out, max_tokens)

        def compile(self, key: kernels.TcKey) -> None:
            kernels.compile_tc(key)

        def compile_many(self, compile_keys) -> None:
            from vllm.deepinfer import warmup_threads
            keys = list(compile_keys)
            kernels.compile_tc_many(keys, warmup_threads.workers(len(keys)))

    return MhcTcProjection()


@functools.cache
def _decode_owner():
    from vllm.deepinfer.mhc import decode_fused
    from vllm.model_executor.warmup.jit_warmup import VllmJitKernel

    class MhcDecodeFused(VllmJitKernel[decode_fused.DecodeKey]):
        CompileKey = decode_fused.DecodeKey

        def get_warmup_keys(self, *, hidden: int, max_tokens: int, sinkhorn: int,
                            delayed: bool, use_pre_in: bool = True,
                            write_aux: bool = False) -> list:
            return decode_keys(hidden, max_tokens, sinkhorn=sinkhorn, delayed=delayed,
                               use_pre_in=use_pre_in, write_aux=write_aux)

        def compile(self, key) -> None:
            decode_fused.compile_key(key)

    return MhcDecodeFused()


def _register_decode(hidden_size: int, hc_mult: int, max_tokens: int, sinkhorn, *,
                     delayed: bool, use_pre_in: bool = True, write_aux: bool = False) -> None:
    from vllm.deepinfer.mhc import decode_fused
    if hc_mult != decode_fused.HC or sinkhorn is None or not decode_fused.enabled():
        return
    _decode_owner().register_warmup(hidden=hidden_size, max_tokens=max_tokens,
                                    sinkhorn=int(sinkhorn), delayed=delayed,
                                    use_pre_in=use_pre_in, write_aux=write_aux)


def _register_projection(hidden_size: int, hc_mult: int, k: int, max_tokens: int) -> None:
    n_out = hc_mult * (hc_mult + 2)
    if kernels.supported(k, n_out) and max_tokens >= mhc.TC_MIN_TOKENS:
        _tc_owner().register_warmup(k=k, n_out=n_out, max_tokens=max_tokens)
    if k == hidden_size:
        # First layer under TC_MIN_TOKENS: TileLang's prenorm GEMM over the embedding row.
        from vllm.model_executor.kernels.mhc.tilelang_kernels import (
            _HC_PRENORM_GEMM_TILELANG_KERNEL,
        )
        _HC_PRENORM_GEMM_TILELANG_KERNEL.register_warmup(
            _config(min(max_tokens, mhc.TC_MIN_TOKENS - 1)), hidden_size=hidden_size,
            hc_mult=1, n_out=n_out)


def _active() -> bool:
    return mhc.first_layer_on_tilelang(_deep_gemm_supported())


def register_v4(vllm_config: Any, *, hidden_size: int, hc_mult: int,
                include_broadcast_splits: bool = False, sinkhorn_repeat: int | None = None,
                **_: Any) -> None:
    """V4 layer: our projection over the hc stream (and the embedding row on the first
    layer) and the one-launch decode kernel of its fused boundaries; the fused kernel and
    upstream's FMA GEMM are registered by the model itself."""
    if not _active():
        return
    max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
    _register_projection(hidden_size, hc_mult, hc_mult * hidden_size, max_tokens)
    _register_decode(hidden_size, hc_mult, max_tokens, sinkhorn_repeat, delayed=False)
    if include_broadcast_splits:
        _register_projection(hidden_size, hc_mult, hidden_size, max_tokens)


def register_v41(*, max_tokens: int, hidden_size: int, hc_mult: int, rms_numel: int,
                 split_mode: str = "fused", sinkhorn_repeat: int | None = None,
                 use_pre_mix_in: bool = True, write_aux: bool = False, **_: Any) -> None:
    """V4.1 layer (one call per epilogue variant): our projection over ``rms_numel``
    columns, the fused post + pre kernel V4.1's model does not register, and (hc stream
    variants) the one-launch decode kernel of the shifted boundary in the same form."""
    if not _active() or split_mode != "fused":
        return
    _register_projection(hidden_size, hc_mult, rms_numel, max_tokens)
    if rms_numel == hc_mult * hidden_size:
        _register_decode(hidden_size, hc_mult, max_tokens, sinkhorn_repeat, delayed=True,
                         use_pre_in=use_pre_mix_in, write_aux=write_aux)
        from vllm.model_executor.kernels.mhc.tilelang_kernels import _MHC_FUSED_TILELANG_KERNEL
        _MHC_FUSED_TILELANG_KERNEL.register_warmup(_config(max_tokens), hidden_size=hidden_size,
                                                  hc_mult=hc_mult)


def v4_epilogue_keys(keys: list, vllm_config: Any, *, hidden_size: int, hc_mult: int,
                     include_broadcast_splits: bool = False, **_: Any) -> list:
    """``MhcPreBigFuseTileLangKernel.get_warmup_keys`` plus the same keys at our projection's
    split counts (patch 0031)."""
    import dataclasses
    if not _active():
        return keys
    max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
    n_out = hc_mult * (hc_mult + 2)
    extra = {False: projection_splits(hc_mult * hidden_size, n_out, max_tokens),
             True: ({1} | projection_splits(hidden_size, n_out, max_tokens))
             if include_broadcast_splits else set()}
    out = list(keys)
    for key in keys:
        for s in sorted(extra[key.is_broadcast]):
            new = dataclasses.replace(key, n_splits=s)
            if new not in out:
                out.append(new)
    return out
