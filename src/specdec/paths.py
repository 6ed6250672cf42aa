"""Where specdec keeps what it computes once per machine: converted models, kernel and
prefill measurements (a leaf module, so the runtime and the model loaders both read it
without importing each other)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Directory of specdec's converted-model cache (``$SPECDEC_CACHE`` or ``~/.cache/specdec``)."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")
