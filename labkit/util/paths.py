"""Where labkit keeps what it makes or fetches outside the repository."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$LABKIT_CACHE`, or ~/.cache/labkit: models, tokenizers and compiled kernels live here."""
    root = os.environ.get("LABKIT_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "labkit"
