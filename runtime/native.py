"""Building and loading the runtime's small C kernels (x86 AVX2+FMA, AVX-512 BF16 or AMX, OpenMP).

Scope: compile a kernel's C source once per machine with the system C compiler into
``~/.cache/specfoundry/kernels/<source hash>/`` and load it with ctypes; say why when that cannot
be done. The kernels themselves live with their callers (:mod:`.cpu_gemv`, :mod:`.cpu_attention`).
Also :func:`release_free_memory`, glibc's ``malloc_trim`` for long-running servers, and
:func:`available_memory`.

OpenMP: the kernels use the OpenMP runtime torch already loaded (same ``libgomp.so.1``), so
``torch.set_num_threads`` governs them too. No compiler, no AVX2/FMA, or a failed build: the
kernel is unavailable and its caller keeps the library path (the reason is reported). A kernel
for a wider instruction set names the CPU flags it needs and its compiler flags (``isa``, e.g.
:data:`AVX512_BF16`): on a CPU without them it is unavailable, never mis-built.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .paths import cache_dir

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
#: the instruction set the kernels are built for unless they say otherwise: (CPU flags, compiler flags)
AVX2 = ({"avx2", "fma"}, ("-mavx2", "-mfma"))
#: AVX-512 with the BF16 dot product (vdpbf16ps): AMD Zen 4+, Intel Cooper Lake / Sapphire Rapids+
#: (and VNNI's int16 dot product for the heads' int8 weights: every CPU with avx512_bf16 has it)
AVX512_BF16 = ({"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"},
               ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni"))
#: AVX-512 BF16 plus AMX tiles with the BF16 tile product (Intel Sapphire Rapids and later)
AMX_BF16 = (AVX512_BF16[0] | {"amx_tile", "amx_bf16"}, AVX512_BF16[1] + ("-mamx-tile", "-mamx-bf16"))

#: the kernels' common C start: 8 bf16 (widened exactly: a shift) or fp32 values as one fp32 vector
PRELUDE = r"""
#include <immintrin.h>
#include <stdint.h>

static inline __m256 ld_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 ld_f32(const float *p) { return _mm256_loadu_ps(p); }
"""


def ptr(t) -> int | None:
    """A tensor's address for a kernel's pointer argument, None (NULL) for an optional one not given."""
    return None if t is None else t.data_ptr()


def cpu_info(field: str) -> str | None:
    """The first CPU's ``field`` line of /proc/cpuinfo (``flags``, ``model name``), None where absent."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    return set((cpu_info("flags") or "").split())


def kernel_dir(source: str) -> Path:
    """Where a kernel's library is kept: keyed by its source, so an edit rebuilds it."""
    return cache_dir() / "kernels" / hashlib.sha256(source.encode()).hexdigest()[:16]


def build(name: str, source: str, functions: dict[str, list],
          isa: tuple[set[str], tuple[str, ...]] = AVX2) -> tuple[ctypes.CDLL | None, str | None]:
    """``lib<name>.so`` from ``source`` (built once, then loaded) with ``functions`` (C name ->
    ctypes argument types, each returning void) declared; ``(library, None)`` or ``(None, why not)``.
    ``isa``: the CPU flags the kernel needs and the compiler flags that enable them."""
    needs, isa_flags = isa
    missing = sorted(needs - cpu_flags())
    if missing:
        return None, f"the CPU lacks {'/'.join(missing)} (or /proc/cpuinfo is unreadable)"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc/gcc) on PATH"
    out = kernel_dir(source + " ".join(isa_flags)) / f"lib{name}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src, lib = Path(tmp) / f"{name}.c", Path(tmp) / f"lib{name}.so"
            src.write_text(source)
            run = subprocess.run([cc, *FLAGS, *isa_flags, str(src), "-o", str(lib), "-lm"], capture_output=True, text=True)
            if run.returncode != 0:
                return None, f"building the {name} kernel failed: {run.stderr.strip()[:300]}"
            os.replace(lib, out)  # atomic: a concurrent builder's copy is as good as ours
    try:
        lib = ctypes.CDLL(str(out))
    except OSError as exc:
        return None, f"loading the {name} kernel failed: {exc}"
    for fname, argtypes in functions.items():
        fn = getattr(lib, fname)
        fn.restype = None
        fn.argtypes = argtypes
    return lib, None


def available_memory() -> int | None:
    """Bytes of memory Linux says are available now (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_free_memory() -> bool:
    """Give memory the allocator holds but no longer uses back to the system (glibc
    ``malloc_trim(0)``, every arena); False where the C library has no such call. Why: a server's
    steps allocate tensors of ever-changing sizes from several threads; glibc keeps the freed
    blocks (measured at 32 clients: RSS 4.47 GB, 4.12 GB after a trim of ~12 ms, docs/results.md
    eleventh session), which a soak reads as growth."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
