"""The checkpoints and serving modes of benchmarks/e2e/e2e.py, shared by its steps' modules
(long_step.py, refcheck.py): which configs it builds, in which format, and the modes run.py
serves them in."""
from __future__ import annotations

# (name, config folder, checkpoint format)
MODELS = {
    "v41-mini": ("v41-mini", "mxfp8"),
    "v4-mini": ("v4-mini", "fp8"),
    "v41-tput": ("v41-tput", "mxfp8"),
    "v41-long": ("v41-long", "mxfp8"),
    "v4-long": ("v4-long", "fp8"),
    # The minis with a speculative draft in the checkpoint (tools/ckptgen/spec.py); no
    # name here begins with another name and "-" (e2e.py's _split_tag reads run tags).
    "v41-dspark-mini": ("v41-dspark-mini", "mxfp8"),
    "v4-mtp-mini": ("v4-mtp-mini", "fp8"),
    "v4-dspark-mini": ("v4-dspark-mini", "fp8"),
}
# name -> (vLLM speculative method, num_speculative_tokens): DSpark at the block size its
# config declares (dspark_block_size 5), MTP at its one trained step.
SPEC_MODELS = {"v41-dspark-mini": ("dspark", 5), "v4-mtp-mini": ("mtp", 1),
               "v4-dspark-mini": ("dspark", 5)}
AGREE_MODELS = ("v41-mini", "v4-mini")
TPUT_MODEL = "v41-tput"
MODES = ("a100", "sm90", "upstream")
