"""The one atomic writer: a file or a directory is written beside its destination and swapped
in by rename, so a reader sees the old complete version or the new complete one, never a half.

Scope: :func:`atomic_dir` (directories: checkpoints, exports, dataset shards, the converted
built-in target) and :func:`atomic_write_text` (single files: manifests, run records).
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


def atomic_write_text(path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` through a temporary sibling and ``os.replace`` (flushed and
    fsynced first): ``path`` holds the old content or the new, never a part. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding=encoding) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
