"""Atomic directory writes: build a directory beside its destination, then swap it in with
renames, so a reader sees the old complete directory or the new complete one, never a half.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def atomic_dir(out, replaceable: Callable[[Path], bool], what: str) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; when the block succeeds it replaces ``out``.

    An existing ``out`` is replaced only when it is an empty directory or ``replaceable(out)``
    says it is one of ours (``what`` names that kind in the refusal); on error the temporary
    directory is removed and ``out`` is untouched.
    """
    out = Path(out)
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or replaceable(out))):
        raise FileExistsError(f"{out} exists and is not {what}; refusing to replace it")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=parent))
    try:
        yield tmp
        if out.exists():
            old = parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
