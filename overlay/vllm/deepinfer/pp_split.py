"""Pipeline-parallel layer splits of DeepSeek-V4.1: a split that cuts a KV-sharing group apart
is refused at engine start, in one line naming the layers cut apart and a split that works.

What upstream does (vLLM 0.33.0, ``models/deepseek_v41/attention.py``). In V4.1 only the
``kv_source_layer_ids`` own a compressed-KV cache and an index-K cache; every other compressed
layer reads the cache of the latest KV source at or below it (``max(s for s in
kv_source_layer_ids if s <= layer)``), and the top-k of the latest index source at or below
it from the model's ``topk_indices_buffer``. Pipeline stages are contiguous layer ranges:
``make_layers`` builds layers ``get_pp_indices(num_hidden_layers, pp_rank, pp_size)``
(``vllm/distributed/utils.py``: ``VLLM_PP_LAYER_PARTITION`` when set, else an even split
whose remainder goes to the stages before the last). A layer finds its source by name in the
compilation config's ``static_forward_context``, which holds only its own stage's layers, so
when the source sits on an earlier stage the consumer's constructor raises
``NotImplementedError`` -- at model construction in the worker of the consumer's stage,
before any weight is loaded:

* an index source that is not a KV source (its index-K cache lives on the KV source),
  ~line 458: "Indexer K cache source <prefix> not found on this rank; PP splits inside a
  v4.1 kv-sharing group are not supported.";
* any other compressed consumer, ~line 605: "Compressed-KV source <prefix> not found on this
  rank; PP splits inside a v4.1 kv-sharing group are not supported."

Only the workers whose stage starts inside a group raise (the stages before it load on and
wait for them); the message names one layer of one stage and no split that would work. Two
relations upstream does not check on CUDA (its ROCm class checks the first): an index
consumer reads the top-k of its index source from its own stage's ``topk_indices_buffer``,
and an index source after ``candidate_source_layer_id`` masks its scores with the candidate
blocks of its own stage's ``candidate_block_buffer``; a stage without the source would read a
buffer nothing wrote. ``links`` lists all four; a stage boundary that cuts any of them is
refused here.

``check_layer`` runs in the Ampere V4.1 attention class before upstream's constructor
(attention/ampere_v41.py), so every stage's first layer refuses the split with the same line,
before upstream's own check could raise at a later stage's first consumer. It computes every
stage's range through vLLM's own ``get_pp_indices`` and suggests the split nearest to it
(boundaries moved the least; then the smallest largest stage; then the later cut, which keeps
vLLM's habit of loading the last stage lightest) whose every stage starts outside a group, as
``VLLM_PP_LAYER_PARTITION=...``. The DSpark draft is built with pipeline_parallel_size 1
(``v1/worker/gpu/spec_decode/dspark/utils.py``) and its layers sit past num_hidden_layers:
nothing is checked for them.

DeepSeek-V4 has no KV sharing (every compressed layer owns its compressor, cache and, for
ratio 4, its indexer: ``models/deepseek_v4/attention.py``; no ``kv_source_layer_ids``), so
``links`` is empty for it and every split passes. Importable without vLLM (``stage_sizes``
imports vLLM's function when called).
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Sequence

__all__ = ["PipelineSplitError", "Link", "links", "groups", "stage_sizes", "cut_links",
           "stage_starts", "nearest_split", "check", "check_layer"]

ENV = "VLLM_PP_LAYER_PARTITION"
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class PipelineSplitError(ValueError):
    """A pipeline split that puts a V4.1 layer on another stage than a layer it reads."""


@dataclasses.dataclass(frozen=True)
class Link:
    """Layer ``reader`` reads ``what`` of layer ``source`` (``source < reader``)."""
    reader: int
    source: int
    what: str


def _ids(hf, name: str) -> list[int]:
    return sorted(int(i) for i in (getattr(hf, name, None) or ()))


def _ratio(hf, layer: int) -> int:
    ratios = getattr(hf, "compress_ratios", None)
    # Upstream: layers past the list (the draft's) are pure sliding window.
    return int(ratios[layer]) if ratios is not None and layer < len(ratios) else 0


def _latest(ids: list[int], layer: int) -> int | None:
    below = [s for s in ids if s <= layer]
    return below[-1] if below else None


def links(hf) -> list[Link]:
    """Every cross-layer read of the backbone (``hf``: vLLM's flattened V4.1 config), as
    upstream's V4.1 attention wires them; empty without ``kv_source_layer_ids`` (V4)."""
    kv, idx = _ids(hf, "kv_source_layer_ids"), _ids(hf, "index_source_layer_ids")
    if not kv:
        return []
    cand = int(getattr(hf, "candidate_source_layer_id", -1) or -1)
    has_cand = cand >= 0 and int(getattr(hf, "candidate_topk_blocks", 0) or 0) > 0
    out = []
    for layer in range(int(hf.num_hidden_layers)):
        if _ratio(hf, layer) == 0:
            continue
        src = _latest(kv, layer)
        if src is None:  # upstream fails on its own (no source at or below the layer)
            continue
        if layer not in kv:
            out.append(Link(layer, src, "compressed KV"))
            if layer in idx:
                out.append(Link(layer, src, "index keys"))
        isrc = _latest(idx, layer)
        if isrc is not None and isrc != layer:
            out.append(Link(layer, isrc, "index top-k"))
        if has_cand and layer in idx and cand < layer:
            out.append(Link(layer, cand, "candidate blocks"))
    return out


def groups(lks: Sequence[Link]) -> list[tuple[int, int]]:
    """The layer ranges [first, last] each of which must stay on one stage: a source and its
    readers, overlapping ranges merged."""
    spans = sorted({(lk.source, lk.reader) for lk in lks})
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def stage_sizes(num_layers: int, pp: int,
                get_indices: Callable[[int, int, int], tuple[int, int]] | None = None
                ) -> list[int]:
    """Layers per stage as vLLM builds them: ``get_pp_indices`` for every rank (its own
    ValueError for a malformed VLLM_PP_LAYER_PARTITION)."""
    if get_indices is None:
        from vllm.distributed.utils import get_pp_indices as get_indices
    out = []
    for rank in range(pp):
        start, end = get_indices(num_layers, rank, pp)
        out.append(int(end) - int(start))
    return out


def _starts(sizes: Sequence[int]) -> list[int]:
    """First layer of each stage after the first."""
    out, acc = [], 0
    for n in sizes[:-1]:
        acc += int(n)
        out.append(acc)
    return out


def cut_links(lks: Sequence[Link], sizes: Sequence[int]) -> list[tuple[Link, int, int]]:
    """(link, reader's stage, source's stage) for every link the split ``sizes`` cuts."""
    bounds = [0, *_starts(sizes), sum(sizes)]

    def stage(layer: int) -> int:
        return next(s for s in range(len(sizes)) if layer < bounds[s + 1])
    return [(lk, stage(lk.reader), stage(lk.source)) for lk in lks
            if stage(lk.reader) != stage(lk.source)]


def stage_starts(num_layers: int, grps: Sequence[tuple[int, int]]) -> list[int]:
    """Layers a stage other than the first may start at: 1 .. num_layers - 1, none inside a
    group (a group's first layer may start a stage)."""
    return [b for b in range(1, num_layers) if not any(lo < b <= hi for lo, hi in grps)]


def nearest_split(num_layers: int, sizes: Sequence[int],
                  grps: Sequence[tuple[int, int]]) -> list[int] | None:
    """The split into ``len(sizes)`` stages of at least one layer each, every stage starting
    outside a group, nearest to ``sizes``: least total movement of the stage boundaries, then
    the smallest largest stage, then the later boundaries. None when none exists."""
    want = _starts(sizes)
    allowed = stage_starts(num_layers, grps)
    if len(want) > len(allowed):
        return None
    if not want:
        return [num_layers]
    # best[j][b]: (cost, largest stage so far, -boundaries) of boundaries 0..j ending at b.
    best: list[dict[int, tuple]] = []
    for j, w in enumerate(want):
        row: dict[int, tuple] = {}
        for b in allowed:
            if j == 0:
                row[b] = (abs(b - w), b, (-b,), (b,))
                continue
            cands = [(c + abs(b - w), max(m, b - p), neg + (-b,), path + (b,))
                     for p, (c, m, neg, path) in best[j - 1].items() if p < b]
            if cands:
                row[b] = min(cands)
        best.append(row)
    ends = [(c, max(m, num_layers - path[-1]), neg, path) for c, m, neg, path in best[-1].values()]
    if not ends:
        return None
    path = min(ends)[3]
    bounds = [0, *path, num_layers]
    return [bounds[i + 1] - bounds[i] for i in range(len(sizes))]


def _ranges(layers: Sequence[int]) -> str:
    """[6, 7, 9] -> '6-7, 9'."""
    out, run = [], []
    for x in sorted(set(layers)):
        if run and x == run[-1] + 1:
            run.append(x)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [x]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def check(hf, sizes: Sequence[int], where: str = "", partition_env: str | None = None) -> None:
    """Raise PipelineSplitError when the split ``sizes`` (layers per stage) puts a layer on
    another stage than a layer it reads. One line: the split, each source with the layers of
    later stages that read it, and the nearest split that keeps every group on one stage."""
    lks = links(hf)
    cut = cut_links(lks, sizes)
    if not cut:
        return
    num_layers = int(hf.num_hidden_layers)
    by_source: dict[int, dict] = {}
    for lk, rs, ss in cut:
        d = by_source.setdefault(lk.source, dict(stage=ss, readers={}, what=[]))
        d["readers"].setdefault(rs, set()).add(lk.reader)
        if lk.what not in d["what"]:
            d["what"].append(lk.what)
    parts = []
    for src, d in sorted(by_source.items()):
        readers = "; ".join(
            f"layer{'s' if len(ls) > 1 else ''} {_ranges(sorted(ls))} (stage {rs})"
            for rs, ls in sorted(d["readers"].items()))
        one = sum(map(len, d["readers"].values())) == 1
        what = d["what"]
        what = ", ".join(what[:-1]) + " and " + what[-1] if len(what) > 1 else what[0]
        parts.append(f"{readers} read{'s' if one else ''} the {what} of layer {src} "
                     f"(stage {d['stage']})")
    split = ",".join(map(str, sizes))
    how = (f"{ENV}={partition_env}" if partition_env
           else f"{split} (vLLM's even split; {ENV} unset)")
    grps = groups(lks)
    fix = nearest_split(num_layers, sizes, grps)
    if fix is not None:
        nearest = f"a split that keeps every group on one stage: {ENV}={','.join(map(str, fix))}"
    else:
        starts = stage_starts(num_layers, grps)
        nearest = (f"no split into {len(sizes)} stages keeps every group on one stage (a stage "
                   f"may start only at layer {_ranges(starts) or 'none'}): use "
                   f"pipeline_parallel_size <= {len(starts) + 1}")
    raise PipelineSplitError(
        f"DeepInfer Ampere attention{' ' + where if where else ''}: pipeline split {how} cuts "
        f"DeepSeek-V4.1 KV-sharing groups apart: {'; '.join(parts)}; {nearest}")


def check_layer(vllm_config, prefix: str = "") -> None:
    """The check as the V4.1 attention constructor runs it: nothing at pipeline size 1 or for
    a layer past the backbone (the draft's); else the split vLLM builds (stage_sizes)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp <= 1:
        return
    hf = vllm_config.model_config.hf_config
    num_layers = int(hf.num_hidden_layers)
    m = _LAYER.search(f".{prefix}.")
    if m is not None and int(m.group(1)) >= num_layers:
        return
    check(hf, stage_sizes(num_layers, pp), prefix, os.environ.get(ENV) or None)
