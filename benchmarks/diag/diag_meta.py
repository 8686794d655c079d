"""What every diagnostic's results meta records about the code that ran: the commit
(DEEPINFER_COMMIT for a copy of the tree without git, else the checkout's HEAD) and package
versions by distribution name (no import of the package)."""
from __future__ import annotations

import os
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def commit() -> str:
    if os.environ.get("DEEPINFER_COMMIT"):
        return os.environ["DEEPINFER_COMMIT"]
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                         text=True, check=False)
    return out.stdout.strip() or "unknown"


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
