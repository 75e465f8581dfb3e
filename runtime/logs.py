"""The one stderr progress log.

Scope: :func:`stderr_logger`, which the training data modules (``specfoundry.train.data``,
``.prompts``, ``.generation``) and the benchmark (``specfoundry.bench.measure``) use for their
one-line progress messages, prefixed with a name (``[specfoundry.train.data] ...``,
``[bench] ...``) and flushed at once so they interleave correctly with progress bars. In the
runtime because every layer may import the runtime (train and bench may not import each other).
"""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["stderr_logger"]


def stderr_logger(name: str) -> Callable[[str], None]:
    """A ``log(msg)`` that prints ``[name] msg`` to stderr."""

    def log(msg: str) -> None:
        print(f"[{name}] {msg}", file=sys.stderr, flush=True)

    return log
