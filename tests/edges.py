"""Edge values every kernel test runs through (production shapes: vllm.deepinfer.kernels.shapes).

* ``ODD_PAGES``: cache page sizes that are not powers of two, so ``slot // page`` and
  ``slot % page`` take the general division (production pages are 32, 64, 128 tokens, where
  the compiler may use shifts and masks), and page strides that are not multiples of 16.
* ``invalid_slots(rows)``: slot values a kernel must skip (attention reads) or not write
  (writers): -1 (vLLM's padding slot), the int32 extremes, and the first slots past the cache.
"""
from __future__ import annotations

INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1
# 2: a page of two tokens (every slot is a page edge); 61 and 69: primes around the 64-token
# page, one below and one above it.
ODD_PAGES = (2, 61, 69)


def invalid_slots(rows: int) -> tuple[int, ...]:
    """Out-of-cache slots for a cache of ``rows`` slots (blocks * page)."""
    return (-1, INT32_MIN, INT32_MAX, rows, rows + 3)
