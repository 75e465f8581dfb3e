"""The one progress log of the training data pipeline.

Scope: :func:`stderr_logger`, which the data modules (:mod:`.data`, :mod:`.prompts`,
:mod:`.generation`) use for their one-line progress messages, prefixed with the module name
(``[specfoundry.train.data] ...``) and flushed at once so they interleave correctly with
progress bars.
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
