"""The A100 cost model of tools/a100_model.py (docs/a100-model.md), one module per part, in
dependency order (each imports only modules above it):

* ``common``      repository paths, the build folder, ModelError
* ``gpus``        per-SM rates, latencies and device figures (A100 40/80 GB, H200)
* ``sass``        the ``cuobjdump -sass`` parser, instruction classes, loops
* ``scheduler``   each instruction's pipe work; the per-scheduler simulation
* ``builds``      compiling a compile-gate spec for sm_80/sm_90, its SASS, the cache
* ``bounds``      launch bounds on the busiest SM, occupancy, ``predict``
* ``workloads``   the benchmark suites' launches for a shape
* ``validation``  the committed H200 rows predicted, the error, A100 beside them
* ``reports``     decode / prefill prediction tables and the decode chart

This file imports none of them (``from a100cost import sass`` loads only what it names);
tools/a100_model.py is the command and re-exports their names.
"""
