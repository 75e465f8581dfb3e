"""The one atomic writer: a file or a directory is written beside its destination and swapped
in by rename, so a reader sees the old complete version or the new complete one, never a half.

Scope: :func:`atomic_dir` (directories: checkpoints, exports, dataset shards, the converted
built-in target), :func:`replace_dir` (the swap itself, for a directory several processes filled
under a name they agreed on: training checkpoints), :func:`atomic_file` (a single file written by
name, e.g. a safetensors shard) and :func:`atomic_write_text` (single text files: manifests, run
records).
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
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(src, dst) -> Path:
    """Move the complete directory ``src`` to ``dst``, a sibling; an existing ``dst`` is renamed
    aside first and removed only once ``src`` stands in its place (a directory cannot be renamed
    over a non-empty one), so ``dst`` never holds a mix of the two. Returns ``dst``."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
        os.rename(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(src, dst)
    return dst


@contextlib.contextmanager
def atomic_file(path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` for the block to write by name; when the block
    succeeds it is fsynced and ``os.replace``-d onto ``path``, so ``path`` holds the old content
    or the new, never a part. On error the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data reaches the disk before the rename makes it visible
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` through :func:`atomic_file`. Returns ``path``."""
    path = Path(path)
    with atomic_file(path) as tmp:
        with open(tmp, "w", encoding=encoding) as f:
            f.write(text)
    return path
