"""Triton kernels, one module per kernel family; each module keeps a tile table keyed by
variant name and registers its configurations with ``vllm.deepinfer.compile_gate``."""
