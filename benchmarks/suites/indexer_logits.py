"""indexer_logits suite: the sparse indexer's MQA logits without DeepGEMM.

There is no upstream kernel to time beside ours here: upstream's CUDA indexer calls DeepGEMM
(``fp8_fp4_paged_mqa_logits`` / ``fp8_fp4_mqa_logits``), which is not installed on the GPU
machine and does not exist for SM80/SM86 at all. Rows therefore carry no ``upstream_us`` and
no speedup; they give GPU time (``Harness.time_graph``), the share of the copy roofline for
the bytes the kernel must move and the share of the bf16 matmul rate for its FLOPs, and the
error against an fp64 torch reference of DeepGEMM's formula on sampled rows (``within_bound``:
every sampled logit inside the fp32 summation bound of tests/test_indexer_logits.py).

Shapes (64 heads x 128 dims, 128-token pages as off SM90):
* decode (paged): B requests x one query row, every request with L compressed keys
  (L = 8192 and 65536; B = 1, 16, 64; quick: B = 16, 64 at L = 8192).
* prefill (gathered keys): one chunk of M = 2048 query rows at the end of N = 8192 keys,
  row i seeing keys [0, N - M + i + 1) (causal, ratio 1).
Variants: ``sm80`` (integer decode to fp16, what SM80/SM86 run), ``sm80-e4b15`` (Triton's
fp8e4b15 conversion instead), ``sm90`` (hardware e4m3 dot, what SM89 runs). ``TILE_SWEEP``
times other tiles of the sm80 variant (each with both software decodes) at the B = 64, L = 8192 decode and the prefill shape.

``bytes``: decode = rows x L x (128 + 4) key bytes + rows x L x 4 logit bytes (+ queries);
prefill = the N keys once + every valid logit written. ``flops`` = 2 x 64 x 128 per
(row, key) pair.

Long context (after the rows above; ``long_cases``): L = 128K, 256K, 512K, 1M keys (quick:
128K and 1M), 64 heads x 128 dims:
* ``indexer_logits.paged_long``: decode, B = 16 requests x one row, every request at L;
* ``indexer_logits.flat_long``: prefill, M = 128 rows at the end of N = L keys (upstream's
  chunk bound at 1M: VLLM_SPARSE_INDEXER_MAX_LOGITS_MB = 512 of fp32 logits), causal;
  both for the unmasked kernel (sm80, sm90 variants), with ``tflops`` / ``matmul_share``
  against the bf16 matmul rate measured in the same run and the sampled-row error;
* ``indexer_candidate.paged`` / ``indexer_candidate.flat``: a V4.1 index source masked to
  2048 candidate blocks of 8 (random distinct blocks of the row, the newest always in) at
  the same shapes: ``ours_us`` the candidate-only logits (kernels/indexer_candidate_logits),
  ``upstream_us`` compute-then-mask (our full kernel, then upstream's apply_candidate_mask
  kernels from build/upstream_kernels, launched as it launches them), ``logits_us`` the
  full kernel alone, ``exact`` the two tensors bit-equal over every row's keys. ``flops``
  counts the candidate entries computed (2 x 64 x 128 x rows x 16384), ``full_flops`` the
  full kernel's; ``bytes`` the -inf fill + the candidate keys read.
"""
from __future__ import annotations

import dataclasses

import torch

from harness import Harness

from vllm.deepinfer.kernels import indexer_candidate_logits as icl
from vllm.deepinfer.kernels import indexer_logits as il

H, D, PAGE = 64, il.HEAD_DIM, 128
TILE_SWEEP = [(32, 8), (64, 8), (128, 8)]  # (block_n, num_warps) besides the default (64, 4)
LONG_KEYS = [1 << 17, 1 << 18, 1 << 19, 1 << 20]  # 128K .. 1M compressed keys per row
LONG_DECODE_B = 16      # decode requests at long context (one row each)
# Prefill rows per chunk at long context: upstream caps a chunk's fp32 logits at
# VLLM_SPARSE_INDEXER_MAX_LOGITS_MB = 512 MB, i.e. 128 rows at 1M keys.
LONG_PREFILL_M = 128
CAND_BLOCKS, CAND_BS = 2048, 8  # V4.1's candidate_topk_blocks x candidate_block_size


def _codes(shape, dev):
    b = torch.randint(0, 256, shape, dtype=torch.int32, device=dev)
    return torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)


def _decode_inputs(dev, B, L):
    pages = -(-L // PAGE)
    cache = _codes((B * pages, PAGE, D + 4), dev)
    # Scales: powers of two as the indexer K store writes them.
    sc = torch.exp2(torch.randint(-8, 2, (B * pages, PAGE), device=dev).float())
    cache.view(B * pages, -1)[:, PAGE * D:] = sc.view(torch.uint8).view(B * pages, -1)
    table = torch.randperm(B * pages, device=dev, dtype=torch.int64).to(torch.int32).view(B, pages)
    return {"q": _codes((B, 1, H, D), dev), "cache": cache, "table": table,
            "w": torch.randn(B, H, device=dev) * 0.1,
            "ctx": torch.full((B,), L, dtype=torch.int32, device=dev), "L": L}


def _prefill_inputs(dev, M, N):
    ks = torch.zeros(M, dtype=torch.int32, device=dev)
    ke = torch.arange(N - M + 1, N + 1, dtype=torch.int32, device=dev)
    return {"q": _codes((M, H, D), dev), "k": _codes((N, D), dev),
            "s": torch.exp2(torch.randint(-8, 2, (N,), device=dev).float()),
            "w": torch.randn(M, H, device=dev) * 0.1, "ks": ks, "ke": ke, "N": N}


def _f(x):
    return x.view(torch.float8_e4m3fn).to(torch.float64)


def _check_rows(got_rows, qs, ws, keys_list, scales_list):
    """(max abs err, all within the fp32 summation bound) over sampled rows."""
    worst, ok = 0.0, True
    for got, q, w, k, s in zip(got_rows, qs, ws, keys_list, scales_list):
        q64, k64, w64, s64 = _f(q), _f(k), w.double(), s.double()
        want = ((k64 @ q64.T).clamp_min(0) * w64).sum(1) * s64
        bound = (H + D) * 2.0 ** -24 * ((k64.abs() @ q64.abs().T) * w64.abs()).sum(1) * s64
        err = (got.double() - want).abs()
        worst = max(worst, float(err.max()))
        ok = ok and bool((err <= bound).all())
    return worst, ok


def _paged_keys(x, b):
    pages = x["table"][b].long()
    blk = x["cache"][pages].view(-1, PAGE * (D + 4))
    keys = blk[:, : PAGE * D].reshape(-1, D)[: x["L"]]
    sc = blk[:, PAGE * D:].contiguous().view(torch.float32).reshape(-1)[: x["L"]]
    return keys, sc


def _sweep():
    """Other sm80 tiles, with the integer decode and with fp8e4b15."""
    return [(dataclasses.replace(il.TILES["sm80"], block_n=bn, num_warps=nw, e4b15=e4),
             f"-bn{bn}w{nw}" + ("-e4b15" if e4 else "")) for bn, nw in TILE_SWEEP
            for e4 in (False, True)]


VARIANTS = [("sm80", None), ("sm80-e4b15", dataclasses.replace(il.TILES["sm80"], e4b15=True)),
            ("sm90", None)]


def run(h: Harness) -> None:
    dev = h.dev
    decode_shapes = ([(16, 8192), (64, 8192)] if h.quick else
                     [(1, 8192), (16, 8192), (64, 8192), (1, 65536), (16, 65536), (64, 65536)])
    for B, L in decode_shapes:
        bytes_one = B * L * (D + 8) + B * H * (D + 4)
        ring = h.copies(lambda: _decode_inputs(dev, B, L), bytes_one, max_copies=16)
        for name, tile in VARIANTS:
            variant = name.split("-")[0]
            tiles = [(tile, "")]
            if name == "sm80" and (B, L) == (64, 8192):
                tiles += _sweep()
            for t, tag in tiles:
                def launch(x, t=t, variant=variant):
                    return il.paged_mqa_logits(x["q"], x["cache"], x["w"], x["ctx"], x["table"],
                                               x["L"], variant=variant, tile=t)
                x = ring[0]
                out = launch(x)
                rows = [0, B - 1] if B > 1 else [0]
                ks = [_paged_keys(x, b) for b in rows]
                err, ok = _check_rows([out[b] for b in rows], [x["q"][b, 0] for b in rows],
                                      [x["w"][b] for b in rows], [k for k, _ in ks],
                                      [s for _, s in ks])
                us = h.time_graph(launch, ring)
                h.add("indexer_logits.paged", name + tag, {"B": B, "L": L, "H": H, "D": D},
                      us, None, bytes=bytes_one, flops=2.0 * H * D * B * L,
                      max_abs_diff=err, within_bound=ok)
    M, N = (2048, 8192)
    valid = sum(range(N - M + 1, N + 1))
    bytes_one = N * (D + 4) + valid * 4 + M * H * (D + 4)
    ring = h.copies(lambda: _prefill_inputs(dev, M, N), bytes_one, max_copies=8)
    for name, tile in VARIANTS:
        variant = name.split("-")[0]
        tiles = [(tile, "")]
        if name == "sm80":
            tiles += _sweep()
        for t, tag in tiles:
            def launch(x, t=t, variant=variant):
                return il.mqa_logits(x["q"], x["k"], x["s"], x["w"], x["ks"], x["ke"], N,
                                     variant=variant, tile=t)
            x = ring[0]
            out = launch(x)
            rows = [0, M // 2, M - 1]
            err, ok = _check_rows([out[i, : int(x["ke"][i])] for i in rows],
                                  [x["q"][i] for i in rows], [x["w"][i] for i in rows],
                                  [x["k"][: int(x["ke"][i])] for i in rows],
                                  [x["s"][: int(x["ke"][i])] for i in rows])
            us = h.time_graph(launch, ring)
            h.add("indexer_logits.flat", name + tag, {"M": M, "N": N, "H": H, "D": D}, us, None,
                  bytes=bytes_one, flops=2.0 * H * D * valid, max_abs_diff=err, within_bound=ok)
    _run_long(h)


# --------------------------------------------------------------------------- long context
def long_cases(quick: bool) -> list[int]:
    return [LONG_KEYS[0], LONG_KEYS[-1]] if quick else list(LONG_KEYS)


def _candidates(dev, lens):
    """[rows, CAND_BLOCKS] int32: distinct random blocks of each row's keys, the newest
    block always listed (the candidate source pins it), -1 past the row's block count."""
    rows = len(lens)
    out = torch.full((rows, CAND_BLOCKS), -1, dtype=torch.int32, device=dev)
    for r, n in enumerate(lens):
        nb = -(-n // CAND_BS)
        k = min(CAND_BLOCKS, nb)
        pick = torch.rand(nb, device=dev).topk(k).indices.to(torch.int32)
        if not bool((pick == nb - 1).any()):
            pick[0] = nb - 1
        out[r, :k] = pick
    return out


def _upstream_mask(logits, ends, candidates, row_repeat=1):
    """upstream apply_candidate_mask (row starts None), its two kernels as it launches them."""
    import triton
    import upstream_kernels.dsa_candidate_blocks as ucb
    rows, width = logits.shape
    nblocks = triton.cdiv(width, CAND_BS)
    flags = torch.empty((rows, nblocks + 1), device=logits.device, dtype=torch.uint8)
    ucb._candidate_flags_kernel[(rows,)](
        candidates, None, flags, *candidates.stride(), 0, width, nblocks, CAND_BS,
        candidates.shape[1], False, row_repeat)
    ucb._mask_candidates_kernel[(rows, triton.cdiv(width, 1024))](
        logits, None, ends, flags, *logits.stride(), 0, ends.stride(0), width, nblocks,
        CAND_BS, False, row_repeat, 1024)
    return logits


def _rows_equal(a, b, lens) -> bool:
    return all(bool(torch.equal(a[r, :n].view(torch.int32), b[r, :n].view(torch.int32)))
               for r, n in enumerate(lens))


def _run_long(h: Harness) -> None:
    dev = h.dev
    for L in long_cases(h.quick):
        B = LONG_DECODE_B
        bytes_one = B * L * (D + 8) + B * H * (D + 4)
        x = _decode_inputs(dev, B, L)
        x["cand"] = _candidates(dev, [L] * B)
        ring = [x]
        lens = [L] * B
        cand_bytes = B * L * 4 + B * CAND_BLOCKS * CAND_BS * (D + 4)
        for variant in ("sm80", "sm90"):
            def full(x, variant=variant):
                return il.paged_mqa_logits(x["q"], x["cache"], x["w"], x["ctx"], x["table"],
                                           x["L"], variant=variant)

            def masked(x, full=full):
                return _upstream_mask(full(x), x["ctx"], x["cand"])

            def cand(x, variant=variant):
                return icl.candidate_paged_mqa_logits(
                    x["q"], x["cache"], x["w"], x["ctx"], x["table"], x["L"], x["cand"],
                    CAND_BS, variant=variant)
            out = full(x)
            rows = [0, B - 1]
            ks = [_paged_keys(x, b) for b in rows]
            err, ok = _check_rows([out[b] for b in rows], [x["q"][b, 0] for b in rows],
                                  [x["w"][b] for b in rows], [k for k, _ in ks],
                                  [s for _, s in ks])
            full_us = h.time_graph(full, ring)
            h.add("indexer_logits.paged_long", variant, {"B": B, "L": L, "H": H, "D": D},
                  full_us, None, bytes=bytes_one, flops=2.0 * H * D * B * L,
                  max_abs_diff=err, within_bound=ok)
            exact = _rows_equal(cand(x), masked(x), lens)
            h.add("indexer_candidate.paged", variant,
                  {"B": B, "L": L, "H": H, "D": D, "blocks": CAND_BLOCKS, "block": CAND_BS},
                  h.time_graph(cand, ring), h.time_graph(masked, ring), bytes=cand_bytes,
                  flops=2.0 * H * D * B * CAND_BLOCKS * CAND_BS, exact=exact,
                  logits_us=round(full_us, 3), full_flops=2.0 * H * D * B * L)
        del x, ring
        M, N = LONG_PREFILL_M, L
        x = _prefill_inputs(dev, M, N)
        ends = x["ke"] - x["ks"]
        lens = ends.tolist()
        x["cand"] = _candidates(dev, lens)
        ring = [x]
        valid = sum(lens)
        bytes_one = N * (D + 4) + valid * 4 + M * H * (D + 4)
        cand_bytes = valid * 4 + M * CAND_BLOCKS * CAND_BS * (D + 4)
        for variant in ("sm80", "sm90"):
            def full(x, variant=variant, N=N):
                return il.mqa_logits(x["q"], x["k"], x["s"], x["w"], x["ks"], x["ke"], N,
                                     variant=variant)

            def masked(x, full=full, ends=ends):
                return _upstream_mask(full(x), ends, x["cand"])

            def cand(x, variant=variant, N=N):
                return icl.candidate_mqa_logits(x["q"], x["k"], x["s"], x["w"], x["ks"],
                                                x["ke"], N, x["cand"], CAND_BS,
                                                variant=variant)
            out = full(x)
            rows = [0, M - 1]
            err, ok = _check_rows([out[i, : lens[i]] for i in rows], [x["q"][i] for i in rows],
                                  [x["w"][i] for i in rows], [x["k"][: lens[i]] for i in rows],
                                  [x["s"][: lens[i]] for i in rows])
            full_us = h.time_graph(full, ring)
            h.add("indexer_logits.flat_long", variant, {"M": M, "N": N, "H": H, "D": D},
                  full_us, None, bytes=bytes_one, flops=2.0 * H * D * valid,
                  max_abs_diff=err, within_bound=ok)
            exact = _rows_equal(cand(x), masked(x), lens)
            h.add("indexer_candidate.flat", variant,
                  {"M": M, "N": N, "H": H, "D": D, "blocks": CAND_BLOCKS, "block": CAND_BS},
                  h.time_graph(cand, ring), h.time_graph(masked, ring), bytes=cand_bytes,
                  flops=2.0 * H * D * M * CAND_BLOCKS * CAND_BS, exact=exact,
                  logits_us=round(full_us, 3), full_flops=2.0 * H * D * valid)
        del x, ring
