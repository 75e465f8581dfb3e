"""The target's weights on 2 MB pages: one arena, ``madvise(MADV_HUGEPAGE)`` before first touch.

Scope: the memory the engine (:mod:`.engine`) streams its matrices from on a Linux CPU, nothing
else. A decode step reads every weight once; on the 4 KB pages PyTorch's allocator gets where the
kernel's transparent huge pages are ``madvise`` only (the common default), each 4 KB of weights
costs a TLB miss and the hardware prefetchers stop at every page boundary. Measured on a 2-core
AMD EPYC (Zen 4, fiftieth session, docs/results.md): SmolLM2-135M's matrices streamed by the
one-row AVX-512 BF16 kernel in 11.6 ms on 2 MB pages against 13.9 ms on 4 KB pages at 1 thread
(1.19x), 7.8 against 8.8 ms at 2 threads (1.13x), in one interleaved run.

Where huge pages are off (``never``), not Linux, or ``SPECFOUNDRY_HUGEPAGES=0``, :func:`wanted`
is False and the engine keeps the model's own tensors. The advice is a hint: the kernel may still
back part of the arena with 4 KB pages (fragmented memory); the bytes are the same either way.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys

import torch

ENV = "SPECFOUNDRY_HUGEPAGES"
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``), or None where unknown."""
    try:
        with open(_THP) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def wanted() -> bool:
    """Whether the engine should move its matrices into a huge-page arena here."""
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    return thp_mode() in ("always", "madvise")


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` rounded up to 64 (each tensor starts on a cache line)."""
    return (math.prod(shape) * dtype.itemsize + 63) // 64 * 64


class Arena:
    """Room for tensors of ``shapes`` (``dtype``) in one allocation, 2 MB-aligned and advised as huge
    pages before anything touches it; :meth:`take` hands them out in order, each 64-byte-aligned."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype):
        self.dtype = dtype
        nbytes = sum(_nbytes(tuple(s), dtype) for s in shapes)
        self._raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # not touched yet
        base = self._raw.data_ptr()
        self._pos = (-base) % HUGE_PAGE
        self._end = self._pos + nbytes
        length = nbytes // HUGE_PAGE * HUGE_PAGE
        self.advised = False
        if length:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self.advised = libc.madvise(base + self._pos, length, _MADV_HUGEPAGE) == 0

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` from the arena."""
        nbytes = _nbytes(tuple(shape), self.dtype)
        if self._pos + nbytes > self._end:
            raise ValueError(f"the arena has {self._end - self._pos} bytes left, {nbytes} asked")
        out = self._raw[self._pos:self._pos + nbytes].view(self.dtype)
        self._pos += nbytes
        return out[:math.prod(shape)].view(shape)
