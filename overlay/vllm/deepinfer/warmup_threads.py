"""How many TileLang builds the JIT warmup runs at once (feature ``warmup_threads``).

vLLM 0.33.0's JIT warmup builds Triton owners in a thread pool and every other owner one
after another (model_executor/warmup/jit_warmup.py, ``JitWarmupRegistry.warmup``). On the
Ampere path that serial part is TileLang. On a fresh H200 machine the A100-faithful server's
warmup took 150.6 s; from the progress lines of its log (the run behind
benchmarks/results/h200-2026-12-02-e2e-serve-5c66855.json), V4.1's mHC epilogue owner
(``MHCPreNormKernel``, 13 keys) took about 56 s of it and our tensor-core projection
(``MhcTcProjection``, 7 keys, one build after another) about 41 s.

A TileLang build is an elaboration (Python, under the interpreter lock) and then a TVM
lowering plus an nvcc run, which TileLang's own ``par_compile`` runs on worker threads.
Upstream's epilogue owner already uses it with ``min(4, keys)`` workers. With the feature on:
- that owner gets ``workers(keys, 4)`` workers (patch 0032);
- our projection's keys are elaborated one after another, then built by ``par_compile``
  (``mhc.kernels.compile_tc_many``).

Measured on the 2-core CPU machine (benchmarks/diag/warmup_threads.py,
benchmarks/results/cpu-2026-12-02-warmup-threads-7716a8b.json), four projection keys for
sm_80, each form with an empty TileLang cache: 19.2 s one after another, 10.6 s through
par_compile on two workers, the same CUDA source per key (also tests/test_warmup_threads.py).
``DEEPINFER_WARMUP_THREADS=0`` gives upstream's 4 workers and builds our keys one at a time.
"""
from __future__ import annotations

import logging
import os

from vllm.deepinfer import routing

logger = logging.getLogger("vllm.deepinfer")
_LOGGED: list[bool] = []

FEATURE = "warmup_threads"
# At most this many builds at once per process. A tensor-parallel node warms one process per
# GPU at the same time, so eight ranks run at most 64 nvcc processes together.
MAX_THREADS = 8


def workers(n_keys: int, off: int = 1, cpus: int | None = None) -> int:
    """Builds at once for ``n_keys`` keys: ``off`` (capped at ``n_keys``) when the feature is
    off, else up to MAX_THREADS and the machine's CPU count."""
    if n_keys < 2:
        return 1
    if not routing.use(FEATURE):
        return max(1, min(off, n_keys))
    cpus = os.cpu_count() if cpus is None else cpus
    n = max(1, min(MAX_THREADS, cpus or 1, n_keys))
    if not _LOGGED:
        _LOGGED.append(True)
        logger.info("deepinfer: warmup_threads: TileLang mHC warmup builds on up to %d workers "
                    "(%d CPUs; DEEPINFER_WARMUP_THREADS=0 keeps upstream's counts)",
                    min(MAX_THREADS, cpus or 1), cpus or 1)
    return n
