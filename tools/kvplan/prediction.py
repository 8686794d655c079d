"""The KV tokens vLLM 0.33.0 reports for a served config ("GPU KV cache size: N tokens"),
given the memory it had for the KV cache (its "Available KV cache memory: X GiB" line): the
served model's caches (fp8_ds_mla records, vLLM's default fp8 indexer), packed the way the
serving path's backends make vLLM pack them (packing.py), sized as vLLM sizes them.

Checked against vLLM's own planning functions on CPU (tests/test_kv_planner_vllm.py) and
against the bdbe637 H200 figures (tests/test_kv_planner.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import PlannerInputError
from .layers import CacheFormat
from .models import build_stack, resolve_model
from .packing import Paging, capacity, in_flight_tokens, pack, served_specs
from .sizes import GiB

# config.json model_type -> (planner family, model facts the config overrides).
FAMILIES = {"deepseek_v41": ("v41", "v4.1"), "deepseek_v4": ("v4", "v4-flash")}
# What vLLM serves with --kv-cache-dtype auto: the layers resolve it to the packed
# fp8_ds_mla record (models/deepseek_v41/attention.py _resolve_dsv4_kv_cache_dtype), and the
# indexer K cache is fp8 unless attention_config.indexer_kv_dtype asks for MXFP4
# (v1/attention/backends/mla/indexer.py dsa_indexer_uses_fp4).
SERVED_FORMAT = CacheFormat("fp8", "fp8")


def family_of(config: dict[str, Any]) -> tuple[str, str]:
    """(family, model name) of a flattened config.json."""
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise PlannerInputError("config", f"model_type {kind!r}: expected one of {tuple(FAMILIES)}")
    return FAMILIES[kind]


@dataclass(frozen=True)
class Prediction:
    model: str
    paging: str
    block_size: int
    max_model_len: int
    in_flight_tokens: int
    kv_bytes: int
    groups: list[dict[str, Any]]
    bytes_per_block: int
    widest_group_bytes: int
    blocks_per_request: int
    num_blocks: int
    concurrency: float
    tokens: int
    reported: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def error(self) -> float | None:
        """tokens / reported - 1."""
        return None if not self.reported else self.tokens / self.reported - 1


def predict(config: dict[str, Any], kv_gib: float, paging: Paging, max_model_len: int,
            max_num_batched_tokens: int, fmt: CacheFormat = SERVED_FORMAT, pp: int = 1,
            reported: int | None = None) -> Prediction:
    """vLLM's reported KV tokens for ``config`` served with ``paging`` in ``kv_gib`` GiB of
    KV memory per GPU (one pipeline stage; with ``pp`` > 1 only the in-flight tokens
    change: the per-stage memory is what each stage logs)."""
    if kv_gib <= 0:
        raise PlannerInputError("kv_gib", f"must be positive, got {kv_gib}")
    if max_model_len <= 0 or max_num_batched_tokens <= 0:
        raise PlannerInputError("max_model_len", "max_model_len and max_num_batched_tokens "
                                f"must be positive, got {max_model_len}, {max_num_batched_tokens}")
    family, name = family_of(config)
    model = resolve_model(name, config)
    block, specs = served_specs(build_stack(model, fmt), family, paging)
    packing = pack(specs)
    in_flight = in_flight_tokens(max_num_batched_tokens, pp)
    kv_bytes = int(kv_gib * GiB)
    cap = capacity(packing, [kv_bytes], max_model_len, in_flight)
    groups = [{"kind": g.kind, "block_size": g.block_size, "caches": len(g.specs),
               "page_bytes": g.page_bytes(),
               "blocks_per_request": g.pages_per_request(max_model_len, in_flight)}
              for g in packing.groups]
    widest = max(g["page_bytes"] for g in groups)
    notes = [paging.note] if paging.note else []
    if cap.bytes_per_block > widest:
        stride = ", ".join(sorted({f"{s.name.split('.', 1)[1]} {s.stride_alignment:,} B"
                                   for s in specs if s.stride_alignment > 1}))
        notes.append(f"pool block {cap.bytes_per_block:,} B > widest group {widest:,} B: rounded "
                     f"to the LCM of the kernel-page strides ({stride})")
    return Prediction(model.name, paging.name, block, max_model_len, in_flight, kv_bytes, groups,
                      cap.bytes_per_block, widest, cap.blocks_per_request, cap.num_blocks,
                      cap.concurrency, cap.tokens, reported, notes)
