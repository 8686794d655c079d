"""Where the A100 cost model finds things (the repository, the committed results, the
build folder) and its one error type."""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
BUILD = Path(os.environ.get("DEEPINFER_BUILD", REPO / "build"))


class ModelError(Exception):
    """A failure the user can act on (one line, printed without a traceback)."""


def _overlay_on_path() -> None:
    p = str(REPO / "overlay")
    if p not in sys.path:
        sys.path.insert(0, p)
