"""A few-row matrix product for x86 CPUs with AVX2+FMA: ``y = x @ w.T`` for 1-8 rows of ``x``,
each weight row read once for all of them (the engine's ``"avx2"`` kernel).

Why: on a CPU the target's matrix products for a decode step or a small verification are
weight-streaming work, but the library kernels treat a few rows as a GEMM. Measured on a 2-core
AMD EPYC with AVX2 only (no avx512, so no oneDNN bf16; docs/results.md, eighth session), all of
SmolLM2-135M's matrices once, 1 thread: ATen bf16 43 / 76 / 146 ms for 1 / 2 / 4 rows, oneDNN fp32
81-92 ms; this kernel bf16 38 / 40 / 44 ms. A flat cost over 1-8 rows is what lets a verification
of a few draft tokens cost about what a plain step does.

Numerics: every output element is one thread's sequential fp32 sum over ``in`` (8 lanes, then
a fixed horizontal add), whatever the row count and thread count, so a token's logits are the
same bits in a plain step and in a verification (ATen and oneDNN pick other kernels for other
row counts, which is where bf16 near-ties between a plain and a speculative run come from).
bf16 weights are widened exactly (a shift); products accumulate in fp32 like ATen's.

Build: the C source below is compiled once per machine by :func:`.native.build` (``cc -O3 -mavx2
-mfma -fopenmp``, cached by source hash, OpenMP shared with torch). No compiler, no AVX2/FMA, or a
failed build: the kernel is unavailable and the engine's measured choice simply leaves it out
(:func:`unavailable_reason`).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .native import PRELUDE, build

__all__ = ["MAX_ROWS", "available", "gemv", "unavailable_reason"]

MAX_ROWS = 8  # rows handled in one pass over the weights (accumulators held in registers)

_SOURCE = PRELUDE + r"""
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* y[r, o] = sum_i x[r, i] * w[o, i] for r < n <= 8; x fp32 [n, in], w [out, in], y fp32 [n, out];
   in % 8 == 0. One output row per iteration: each weight row is streamed once for all n rows. */
#define GEMV(NAME, WT, LOAD)                                                                  \
void NAME(const float *x, const WT *w, float *y, int n, int in, int out) {                    \
    _Pragma("omp parallel for schedule(static, 16)")                                          \
    for (int o = 0; o < out; o++) {                                                            \
        const WT *wr = w + (int64_t)o * in;                                                    \
        __m256 acc[8];                                                                         \
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();                              \
        for (int i = 0; i < in; i += 8) {                                                      \
            __m256 wv = LOAD(wr + i);                                                          \
            for (int r = 0; r < n; r++)                                                        \
                acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (int64_t)r * in + i), acc[r]);  \
        }                                                                                      \
        for (int r = 0; r < n; r++) y[(int64_t)r * out + o] = hsum(acc[r]);                    \
    }                                                                                          \
}
GEMV(sf_gemv_bf16, uint16_t, ld_bf16)
GEMV(sf_gemv_f32, float, ld_f32)
"""


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return build("sfgemv", _SOURCE, {"sf_gemv_bf16": args, "sf_gemv_f32": args})


def unavailable_reason() -> str | None:
    """None when the kernel can run here, else why not."""
    return _load()[1]


def available() -> bool:
    return _load()[0] is not None


def supports(w: torch.Tensor) -> bool:
    """Whether :func:`gemv` takes weight ``w`` (a contiguous CPU bf16/fp32 matrix, in % 8 == 0)."""
    return (w.device.type == "cpu" and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float32)
            and w.is_contiguous() and w.shape[1] % 8 == 0)


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for ``x`` ``[..., in]`` with at most :data:`MAX_ROWS` rows, in ``w``'s
    dtype (accumulated in fp32, rounded once); more rows are done :data:`MAX_ROWS` at a time."""
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(f"the avx2 kernel is unavailable: {unavailable_reason()}")
    if not supports(w):  # (the engine only measures it on weights it supports)
        raise ValueError(f"the avx2 kernel takes contiguous CPU bf16/fp32 weights with a multiple of 8 inputs, "
                         f"got {w.dtype} {tuple(w.shape)}")
    out_f, in_f = w.shape
    xf = x.reshape(-1, in_f).to(torch.float32).contiguous()
    n = xf.shape[0]
    y = torch.empty(n, out_f, dtype=torch.float32)
    fn = lib.sf_gemv_bf16 if w.dtype == torch.bfloat16 else lib.sf_gemv_f32
    for r0 in range(0, n, MAX_ROWS):
        k = min(MAX_ROWS, n - r0)
        fn(xf[r0].data_ptr(), w.data_ptr(), y[r0].data_ptr(), k, in_f, out_f)
    if b is not None:
        y += b  # before the one rounding, as F.linear does
    y = y.to(w.dtype) if w.dtype != torch.float32 else y
    return y.view(*x.shape[:-1], out_f)
