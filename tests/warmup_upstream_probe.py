"""Run on the patched tree (PYTHONPATH=build/patched, TRITON_INTERPRET=1, no GPU) by
tests/test_warmup_upstream.py: Triton cache keys of the launches upstream's dense -> ragged
conversion and V4.1's candidate-block kernels make over a grid of calls, against the keys
vllm.deepinfer.warmup compiles for them (feature serve_warmup). Prints one JSON line."""
from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_keys import describe, key_of, recording  # noqa: E402

from vllm.deepinfer import warmup as wu  # noqa: E402
from vllm.deepinfer import warmup_upstream as wup  # noqa: E402
from vllm.model_executor.kernels.attention.dsa import candidate_blocks as cb  # noqa: E402
from vllm.v1.attention.ops import rocm_aiter_mla_sparse as rams  # noqa: E402

CC = 80
BLOCK, TOPK_BLOCKS = 64, 16      # the e2e V4.1 configs' candidate geometry


class _FakeCuda(torch.Tensor):
    """CPU tensors that pass the launchers' ``is_cuda`` asserts (launches are recorded, not
    run)."""

    @property
    def is_cuda(self):
        return True


def _cuda(t):
    return t.as_subclass(_FakeCuda)


def signatures_match() -> list[str]:
    bad = []
    for name, (module, kernel) in wup.KERNELS.items():
        fn = getattr(sys.modules[module], kernel).fn
        params = list(inspect.signature(fn).parameters)
        if params != list(wup.SIGNATURES[name]):
            bad.append(f"{name}: upstream {params} vs ours {list(wup.SIGNATURES[name])}")
    return bad


def unspecialized() -> dict:
    out = {}
    for name, (module, kernel) in wup.KERNELS.items():
        k = getattr(sys.modules[module], kernel)
        out[name] = sorted(getattr(k, "kwargs", {}).get("do_not_specialize") or [])
    return out


def launches() -> list:
    with recording(CC) as seen:
        for rows in (1, 2, 3, 16, 17, 64, 129):
            for width in (16, 128, 256, 384, 512, 640, 1024, 2048, 8320):
                for num_rows in (-1, 1, 4096, 4097, 1 << 20):
                    idx = torch.zeros(rows, width, dtype=torch.int32)
                    lens = torch.full((rows,), width, dtype=torch.int32)
                    rams.build_ragged_indices_from_dense(idx, lens, num_rows=num_rows)
        for rows in (1, 2, 3, 17, 64):
            for width in (64, 100, 512, 1000, 4096, 8191):
                logits = _cuda(torch.zeros(rows, width))
                ends = _cuda(torch.full((rows,), width, dtype=torch.int32))
                out = _cuda(torch.full((rows, TOPK_BLOCKS), -1, dtype=torch.int32))
                cb.select_candidate_blocks(logits, None, ends, TOPK_BLOCKS, BLOCK, out)
                cb.apply_candidate_mask(logits, None, ends, out, BLOCK)
                # the prefill chunk's slice of the shared candidate table
                table = _cuda(torch.full((rows + 5, TOPK_BLOCKS), -1, dtype=torch.int32))
                cb.select_candidate_blocks(logits, None, ends, TOPK_BLOCKS, BLOCK, table[5:])
                cb.apply_candidate_mask(logits, None, ends, table[5:], BLOCK)
    return seen


def main() -> None:
    shapes = wu.ModelShapes(window=128, compress_ratios=(0, 1, 2), topk=512, heads=64,
                            model="v41", candidate_block_size=BLOCK,
                            candidate_topk_blocks=TOPK_BLOCKS)
    warm: dict[str, set] = {}
    keys = wu.keys(shapes, "sm80", features=["serve_warmup"])
    for k in keys:
        kern, _ = wu._kernel_and_signature(k.kernel)
        args, ce = wu.warmup_args(k)
        warm.setdefault(kern.fn.__name__, set()).add(
            key_of(kern, args, dict(ce, **wu.launch_options(k)), CC))
    seen = launches()
    uncovered = sorted({describe(kern, key) for kern, key in seen
                        if key not in warm.get(kern.fn.__name__, ())})
    print(json.dumps(dict(signatures=signatures_match(), unspecialized=unspecialized(),
                          launched=sorted({kern.fn.__name__ for kern, _ in seen}),
                          n_launches=len(seen), n_keys=len(keys), uncovered=uncovered)))


if __name__ == "__main__":
    main()
