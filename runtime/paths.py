"""Where the runtime caches what it makes once per machine (converted built-in targets, compiled
kernels): ``$SPECFOUNDRY_CACHE``, else ``~/.cache/specfoundry``. A leaf module (no runtime imports),
so the engine's kernels and the model loader share it without an import cycle."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    return Path(os.environ.get("SPECFOUNDRY_CACHE", Path.home() / ".cache" / "specfoundry"))
