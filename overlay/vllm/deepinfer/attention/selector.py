"""Which attention class a DeepSeek-V4.1/V4 decoder layer gets on CUDA.

Patches 0004 (V4.1) and 0005 (V4) make upstream's ``_select_dsv4_attn_cls``
(``models/deepseek_v41/nvidia/model.py``, ``models/deepseek_v4/nvidia/model.py``) call
:func:`select_dsv4_attn_cls` first; a ``None`` answer means "upstream decides", exactly as
before the patch.

The rules (``decide`` holds them, free of vLLM so they are testable on their own):

* Capability below 9.0 (8.0, 8.6, 8.7, 8.9): no upstream class can run -- FlashMLA sparse
  is built for 9.x/10.x, FlashInfer sparse MLA for 10.x/12.x, mega attention for 10.x --
  so the layer gets the DeepInfer Ampere class (feature ``ampere_attn``, on by default for
  sm80/sm86/sm89).
* 9.0, 10.x, 12.x: upstream's choice, unless ``DEEPINFER_AMPERE_ATTN=1`` asks for the
  Ampere path (how the H200 runs it).
* An explicitly requested DeepSeek-V4 backend (``--attention-backend`` /
  ``attention_config.backend``) wins over the default, but one whose backend class cannot
  run on this capability fails at once with a message naming the backend and the
  capability, instead of later inside a kernel launch. Asking for such a backend and for
  ``DEEPINFER_AMPERE_ATTN=1`` at once is a conflict and fails too.
* ``--attention-backend DEEPINFER_AMPERE_SPARSE_DSV41`` (V4: ``..._DSV4``; patch 0016 lists
  them in ``AttentionBackendEnum``) asks for the Ampere class on any capability from 8.0,
  as ``DEEPINFER_AMPERE_ATTN=1`` does. The other model's name, a capability below 8.0,
  prefill context parallelism, or the feature switched off by the environment fail with a
  message naming the backend.
* ``DEEPINFER_AMPERE_ATTN=0`` (or ``DEEPINFER_DISABLE=ampere_attn|all``) below 9.0 hands
  the choice back to upstream with a warning: upstream then picks FlashMLA, which cannot
  run there.
* Capabilities below 8.0, or no CUDA device: upstream decides.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging

from vllm.deepinfer import arch, envs

logger = logging.getLogger("vllm.deepinfer")

FEATURE = "ampere_attn"
# Below this capability every upstream DeepSeek-V4.1/V4 attention class is unrunnable.
UPSTREAM_MIN_CAPABILITY = (9, 0)

# model key -> (module, attention class, name in messages)
MODELS: dict[str, tuple[str, str, str]] = {
    "deepseek_v41": ("vllm.deepinfer.attention.ampere_v41", "DeepinferAmpereV41Attention",
                     "DeepSeek-V4.1"),
    "deepseek_v4": ("vllm.deepinfer.attention.ampere_v4", "DeepinferAmpereV4Attention",
                    "DeepSeek-V4"),
}

# The AttentionBackendEnum members each upstream selector maps to a DeepSeek-V4 class
# (others are ignored by upstream's selector, or rejected by it with its own message:
# FLASHINFER_MLA_SPARSE / FLASHINFER_MLA_SPARSE_SM120).
DSV4_BACKENDS: dict[str, frozenset[str]] = {
    "deepseek_v41": frozenset({
        "FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4", "FLASHMLA_SPARSE_DSV41",
        "FLASHINFER_MLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV41", "FLASHMLA_MEGA_ATTN_DSV41",
    }),
    "deepseek_v4": frozenset({
        "FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4",
    }),
}


# Our own AttentionBackendEnum names (patch 0016), one per model; the backend classes'
# get_name() (attention/ampere_v41.py, ampere_v4.py) return the same strings.
OUR_BACKENDS: dict[str, str] = {
    "deepseek_v41": "DEEPINFER_AMPERE_SPARSE_DSV41",
    "deepseek_v4": "DEEPINFER_AMPERE_SPARSE_DSV4",
}


class BackendUnavailableError(ValueError):
    """An explicitly requested attention backend cannot run on this GPU."""


@dataclasses.dataclass(frozen=True)
class Decision:
    ampere: bool  # True: the DeepInfer Ampere class; False: upstream's selector decides
    reason: str


def _cap_str(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"


def decide(model: str, capability: tuple[int, int] | None, backend: str | None = None,
           backend_runs: bool | None = None, pcp: bool = False) -> Decision:
    """The routing decision. ``backend``: the explicitly requested AttentionBackendEnum
    name, or None; ``backend_runs``: whether that backend's class supports
    ``capability`` (ignored without ``backend``); ``pcp``: prefill context parallelism
    is on (V4.1: upstream requires FlashMLA then). Raises BackendUnavailableError for
    an explicit backend that cannot run, and ValueError for conflicting requests."""
    if model not in MODELS:
        raise KeyError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    name = MODELS[model][2]
    ours = backend is not None and backend in OUR_BACKENDS.values()
    if ours and backend != OUR_BACKENDS[model]:
        raise ValueError(f"{name}: attention backend {backend} is the DeepInfer backend of "
                         f"another model; use {OUR_BACKENDS[model]}")
    if capability is None:
        if ours:
            raise BackendUnavailableError(f"{name}: attention backend {backend} needs a CUDA "
                                          "device (none was found)")
        return Decision(False, "no CUDA device capability")
    cap = (int(capability[0]), int(capability[1]))
    try:
        variant = arch.variant_for_capability(cap)
    except arch.UnsupportedGPU as e:
        if ours:
            raise BackendUnavailableError(
                f"{name}: attention backend {backend} cannot run on compute capability "
                f"{_cap_str(cap)}: {e}") from None
        return Decision(False, str(e))
    v = arch.VARIANTS[variant]
    below = cap < UPSTREAM_MIN_CAPABILITY
    asked = envs.explicit(FEATURE)
    on = envs.enabled(FEATURE, variant)
    where = f"compute capability {_cap_str(cap)} ({v.description})"

    if ours:
        if asked is False:
            raise ValueError(
                f"{name}: attention backend {backend} was requested explicitly and the "
                "environment switches the ampere_attn feature off (DEEPINFER_AMPERE_ATTN=0 / "
                "DEEPINFER_DISABLE); unset one of the two")
        if pcp:
            raise ValueError(
                f"{name}: attention backend {backend} does not support prefill context "
                "parallelism (upstream's only PCP backend is FlashMLA sparse attention)")
        return Decision(True, f"attention backend {backend} requested explicitly")

    if backend is not None and backend in DSV4_BACKENDS[model]:
        if asked:
            raise ValueError(
                f"{name}: attention backend {backend} was requested explicitly and "
                f"DEEPINFER_AMPERE_ATTN=1 asks for the DeepInfer Ampere attention path; "
                f"unset one of the two")
        if not backend_runs:
            hint = (" Leave the attention backend unset to use the DeepInfer Ampere path."
                    if below and on else "")
            raise BackendUnavailableError(
                f"{name}: attention backend {backend} cannot run on {where}: its backend "
                f"class does not support this capability.{hint}")
        return Decision(False, f"attention backend {backend} requested explicitly")

    if pcp:
        if below or asked:
            raise ValueError(
                f"{name} with prefill context parallelism needs FlashMLA sparse attention "
                f"(upstream's only PCP backend), which "
                + (f"cannot run on {where}" if below else "DEEPINFER_AMPERE_ATTN=1 replaces")
                + "; the DeepInfer Ampere attention path does not support PCP")
        return Decision(False, "prefill context parallelism: upstream FlashMLA")

    if on:
        why = ("DEEPINFER_AMPERE_ATTN=1" if asked else
               f"{where} is below {_cap_str(UPSTREAM_MIN_CAPABILITY)}: no upstream "
               f"{name} attention class runs there")
        return Decision(True, why)
    if below:
        return Decision(False, f"the ampere_attn feature is off on {where}; upstream picks "
                               "FlashMLA sparse attention, which cannot run there")
    return Decision(False, f"{where}: upstream's choice")


def ampere_class(model: str):
    """The DeepInfer Ampere attention class for ``model`` (imports vLLM)."""
    module, cls, _ = MODELS[model]
    return getattr(importlib.import_module(module), cls)


_logged: set[tuple[str, str]] = set()


def _log_once(level: int, model: str, msg: str) -> None:
    if (model, msg) not in _logged:
        _logged.add((model, msg))
        logger.log(level, msg)


def _capability():
    from vllm.platforms import current_platform
    cap = current_platform.get_device_capability()
    return None if cap is None else (cap.major, cap.minor)


def _backend_runs(backend, capability: tuple[int, int]) -> bool:
    from vllm.platforms.interface import DeviceCapability
    cls = backend.get_class()
    return bool(cls.supports_compute_capability(DeviceCapability(*capability)))


def select_dsv4_attn_cls(vllm_config, model: str):
    """The Ampere attention class, or None to let upstream's ``_select_dsv4_attn_cls`` pick.

    Called by patches 0004/0005 with ``model`` "deepseek_v41" or "deepseek_v4"; reads the
    capability the way upstream does (``current_platform.get_device_capability()``).
    """
    cap = _capability()
    backend = vllm_config.attention_config.backend
    bname = None if backend is None else backend.name
    runs = None
    if cap is not None and bname is not None and bname in DSV4_BACKENDS[model]:
        runs = _backend_runs(backend, cap)
    pcp = (model == "deepseek_v41"
           and vllm_config.parallel_config.prefill_context_parallel_size > 1)
    d = decide(model, cap, bname, runs, pcp)
    if d.ampere:
        cls = ampere_class(model)
        _log_once(logging.INFO, model,
                  f"deepinfer: {MODELS[model][2]} attention -> {cls.__name__} ({d.reason})")
        return cls
    if cap is not None and cap < UPSTREAM_MIN_CAPABILITY and cap >= (8, 0):
        _log_once(logging.WARNING, model, f"deepinfer: {MODELS[model][2]}: {d.reason}")
    return None
