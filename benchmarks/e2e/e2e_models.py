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
}
AGREE_MODELS = ("v41-mini", "v4-mini")
TPUT_MODEL = "v41-tput"
MODES = ("a100", "sm90", "upstream")
