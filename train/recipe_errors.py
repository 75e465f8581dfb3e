"""Recipe errors: :class:`RecipeError` and the small helpers its messages are written with.

Scope: the one exception every recipe problem is raised as (all problems of a recipe together,
each a ``(key path, text)`` pair), the "did you mean" suggestion and the short rendering of a
wrong value. Imports nothing else of the project, so the schema, the launcher checks and the
loader can all use it.
"""

from __future__ import annotations

import difflib
from typing import Sequence

__all__ = ["RecipeError", "suggest", "got"]


class RecipeError(ValueError):
    """Every problem found in one recipe, in one message. ``problems`` holds ``(key path, text)``."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = list(problems)
        if len(problems) == 1:
            msg = f"invalid recipe {source}: {_fmt_problem(*problems[0])}"
        else:
            lines = "\n".join(f"  - {_fmt_problem(p, t)}" for p, t in problems)
            msg = f"invalid recipe {source}: {len(problems)} problems\n{lines}"
        super().__init__(msg)


def _fmt_problem(path: str, text: str) -> str:
    # unknown-key messages already name their section; the rest lead with the key path
    return text if not path or text.startswith("unknown key") else f"{path}: {text}"


def suggest(word, options: Sequence) -> str:
    """``"; did you mean 'x'?"`` for the closest option, or ``""``."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def got(value) -> str:
    """A wrong value as a message shows it: ``str 'eight'``, ``bool True``, ``null``."""
    if value is None:
        return "null"
    r = repr(value)
    return f"{type(value).__name__} {r if len(r) <= 40 else r[:37] + '...'}"
