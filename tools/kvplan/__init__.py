"""KV-cache capacity and topology planner for 1M-token DeepSeek V3.2 / V4 / V4.1 contexts.

Pure Python standard library: no torch, no vLLM, no GPU. Two layers of answers:

1. Cache arithmetic. Bytes per token and per sequence of each layer type (V3.2-style MLA +
   indexer; V4 c4a / c128a / sliding-window-only; V4.1 compress ratio 0/1/2 with YOCO
   KV-source sharing) for bf16, the 584-byte fp8 record and the fp8/fp4 indexer caches,
   both the way the published figures count them (exact tokens, no paging) and the way
   vLLM 0.33.0 pages them (per-type page sizes with alignment padding, and the cache groups
   of its block-outermost packing with the KV tokens it reports, ``packing``).
2. Topology planning. Weights per GPU for a TP x PP layout with a per-stage layer split,
   the KV budget left under a memory-utilization fraction, and how many KV tokens and 1M
   sequences fit. Every number that is not derived from the upstream source is an
   assumption, listed in ``MODEL_FACTS`` / ``Topology`` and echoed in each plan's output.

Upstream file references are relative to the ``vllm/`` package of vLLM 0.33.0.

A tool's library, not runtime code: nothing in vLLM imports it; tools/kv_planner.py is its
command. The modules, in dependency order (each imports only modules above it):

* ``errors``      PlannerInputError
* ``sizes``       units, cache record sizes, vLLM's paging facts
* ``layers``      cache kinds, cache formats, the layers and stacks of each family
* ``accounting``  bytes per token / sequence, page tables, page-size buckets, the
                  published figures
* ``models``      model facts (architectures and their sources), config loading
* ``weights``     bytes per parameter, parameters per layer
* ``packing``     vLLM's block size, cache specs, block-outermost packing and KV capacity
* ``workspace``   what the Ampere path reserves before vLLM sizes the KV cache (overlay
                  reserve.py's worst cases restated: decode scratch, decode logits,
                  combined lists, beside the prefill and indexer gathers)
* ``prediction``  the KV tokens vLLM reports for a served config and its KV memory
* ``planning``    Topology, per-stage plans, the split search
* ``comparison``  the 6-GPU comparison and the gap to the reference
* ``tables``      markdown tables

This package re-exports their public names, so ``import kvplan as kvp; kvp.plan(...)``.
"""
from __future__ import annotations

from .errors import PlannerInputError
from .sizes import (ATTN_DTYPES, BF16, CONTEXT_1M, DEFAULT_GPU_MEMORY_UTILIZATION,
                    DEFAULT_MAX_CAPTURE_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS,
                    DEFAULT_MAX_NUM_SEQS, FP32, INDEXER_DTYPES, INDEXER_HEAD_DIM,
                    INDEXER_RECORD, LOGICAL_BLOCK, PACKED_ALIGNMENT, PLAIN_ALIGNMENT,
                    SWA_BLOCK, V32_FP8_RECORD, V32_LATENT_DIM, V41_MXFP8_RECORD,
                    V41_NVFP4_COMPRESSED_RECORD, V41_RING_ROWS, V4_FP8_RECORD, V4_HEAD_DIM,
                    V4_STATE_BLOCK, V41_BLOCK, GiB, KiB, MiB, cdiv, round_up)
from .layers import (CacheFormat, CacheKind, Layer, v32_layer, v32_stack, v41_layer, v41_stack,
                     v4_layer, v4_stack)
from .accounting import (PUBLISHED_V32_LAYERS, PUBLISHED_V4_RATIOS, LayerTypeRow, PageRow,
                         count_labels, layer_bytes, layer_bytes_per_token, layer_type_table,
                         page_buckets, page_table, paged_request_bytes, published_figures,
                         stack_bytes, stack_bytes_per_token)
from .models import (MODEL_FACTS, REQUIRED_ARCH_FIELDS, V4_FLASH_ARCH, V4_PRO_ARCH, ModelFacts,
                     build_stack, load_config, model_names, resolve_model)
from .weights import (DENSE_DTYPES, EXPERT_DTYPES, WEIGHT_BYTES, LayerParams, WeightDtypes,
                      layer_params, model_params)
from .packing import (AMPERE_PAGE, PAGINGS, Capacity, CacheSpec, Group, MultipleOf, Packing, Paging,
                      approximate_gcd, capacity, in_flight_tokens, pack, paging_for,
                      resolve_block_size, served_specs)
from .workspace import (A100_SM_COUNT, DECODE_TILES, GATHER_BUFFER_MAX_BYTES,
                        INDEXER_K_MAX_ROWS, INDEXER_LOGITS_BYTES,
                        PREFILL_BUFFER_ENTRIES_PER_TOKEN, PREFILL_CHUNK_SIZE,
                        PREDEQUANT_MIN_TOKENS, DecodeTile, Serving, ampere_reserved_bytes,
                        combine_kinds, combined_lists_bytes, combined_width,
                        decode_keys_per_token, decode_scratch_bytes, decode_scratch_worst,
                        decode_splits, indexer_decode_logits_bytes, indexer_gather_bytes,
                        layer_topk, prefill_gather_bytes, workspace_factor)
from .planning import (SERVED_AMPERE_FORMAT, Plan, StagePlan, Topology, even_split,
                       parse_int_list, plan, plan_assumptions, search_split, serving_for,
                       stage_caches, stage_ranges, stage_weight_bytes, validate_topology,
                       workspace_bytes)
from .prediction import Prediction, family_of, predict
from .comparison import (REFERENCE_GPUS, REFERENCE_GPU_MEM_GIB, REFERENCE_SPLIT,
                         REFERENCE_TOKENS, ReferenceGap, compare_six_gpus, reference_applies,
                         reference_gap, six_gpu_topologies)
from .tables import (RESERVED_COLUMNS, bucket_markdown, fmt_bytes, layer_type_markdown,
                     page_markdown, plan_table, reserved_table, summary_table, table)

__all__ = ['PlannerInputError', 'KiB', 'MiB', 'GiB', 'CONTEXT_1M', 'V32_LATENT_DIM',
           'V4_HEAD_DIM', 'INDEXER_HEAD_DIM', 'BF16', 'V32_FP8_RECORD', 'V4_FP8_RECORD',
           'V41_MXFP8_RECORD', 'V41_NVFP4_COMPRESSED_RECORD', 'INDEXER_RECORD', 'ATTN_DTYPES',
           'INDEXER_DTYPES', 'FP32', 'LOGICAL_BLOCK', 'SWA_BLOCK', 'PACKED_ALIGNMENT',
           'PLAIN_ALIGNMENT', 'V4_STATE_BLOCK', 'V41_BLOCK', 'V41_RING_ROWS',
           'DEFAULT_MAX_NUM_BATCHED_TOKENS', 'DEFAULT_GPU_MEMORY_UTILIZATION',
           'DEFAULT_MAX_NUM_SEQS', 'DEFAULT_MAX_CAPTURE_SIZE', 'round_up',
           'cdiv', 'CacheKind', 'Layer', 'CacheFormat', 'v32_layer', 'v4_layer', 'v41_layer',
           'v32_stack', 'v4_stack', 'v41_stack', 'layer_bytes_per_token', 'layer_bytes',
           'stack_bytes', 'stack_bytes_per_token', 'count_labels', 'LayerTypeRow',
           'layer_type_table', 'PageRow', 'page_table', 'page_buckets', 'paged_request_bytes',
           'PUBLISHED_V32_LAYERS', 'PUBLISHED_V4_RATIOS', 'published_figures', 'V4_FLASH_ARCH',
           'V4_PRO_ARCH', 'ModelFacts', 'MODEL_FACTS', 'model_names', 'load_config',
           'REQUIRED_ARCH_FIELDS', 'resolve_model', 'build_stack', 'WEIGHT_BYTES',
           'EXPERT_DTYPES', 'DENSE_DTYPES', 'WeightDtypes', 'LayerParams', 'layer_params',
           'model_params', 'AMPERE_PAGE', 'PAGINGS', 'Paging', 'paging_for', 'MultipleOf',
           'resolve_block_size', 'CacheSpec', 'served_specs', 'Group', 'Packing', 'pack',
           'approximate_gcd', 'in_flight_tokens', 'Capacity', 'capacity',
           'PREFILL_CHUNK_SIZE', 'PREFILL_BUFFER_ENTRIES_PER_TOKEN', 'INDEXER_LOGITS_BYTES',
           'GATHER_BUFFER_MAX_BYTES', 'INDEXER_K_MAX_ROWS', 'prefill_gather_bytes',
           'indexer_gather_bytes', 'ampere_reserved_bytes', 'workspace_factor',
           'A100_SM_COUNT', 'DECODE_TILES', 'PREDEQUANT_MIN_TOKENS', 'DecodeTile', 'Serving',
           'combine_kinds', 'combined_lists_bytes', 'combined_width', 'decode_keys_per_token',
           'decode_scratch_bytes', 'decode_scratch_worst', 'decode_splits',
           'indexer_decode_logits_bytes', 'layer_topk', 'SERVED_AMPERE_FORMAT', 'serving_for',
           'Prediction', 'family_of', 'predict', 'Topology', 'parse_int_list',
           'even_split', 'validate_topology', 'stage_ranges', 'stage_caches',
           'workspace_bytes', 'StagePlan', 'Plan', 'stage_weight_bytes', 'plan',
           'plan_assumptions', 'search_split', 'REFERENCE_TOKENS', 'REFERENCE_SPLIT',
           'REFERENCE_GPUS', 'REFERENCE_GPU_MEM_GIB', 'six_gpu_topologies', 'compare_six_gpus',
           'ReferenceGap', 'reference_applies', 'reference_gap', 'fmt_bytes', 'table',
           'plan_table', 'summary_table', 'reserved_table', 'RESERVED_COLUMNS',
           'layer_type_markdown', 'page_markdown',
           'bucket_markdown']
