"""A few-row matrix product for x86 CPUs: ``y = x @ w.T`` for 1-8 rows of ``x`` (up to :data:`AMX_ROWS`
on the AMX tiles), each weight row read once for all of them: with AVX2+FMA (the engine's ``"avx2"``
kernel, bf16 or fp32 weights), with AVX-512 BF16 (``"avx512bf16"``, bf16 only: :func:`gemv_bf16`), on
AMX tiles (:func:`gemv_amx`), and with int8 weights for speculator heads (:func:`gemv_q8`).

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

The AVX-512 BF16 kernel (CPUs with ``avx512_bf16``: AMD Zen 4 and later, Intel Cooper Lake,
Sapphire Rapids and later) multiplies bf16 pairs into fp32 sums with one instruction per 32
inputs (``vdpbf16ps``) and no widening, one weight row at a time against up to 8 rows of ``x``
(two independent sums per row over alternating blocks of 32 inputs: the instruction's latency is
hidden; several weight rows per pass measured slower), and rounds the outputs to bf16 itself. On a
2-core AMD EPYC with avx512_bf16 (docs/results.md, twenty-second session) it streams SmolLM2-135M's
matrices at 1 row in 7.4-8.2 ms at 1 thread against oneDNN's 9.9-10.9. It prefetches the weights
ahead into L2 (a non-temporal hint until the twenty-fifth session lost the prefetched lines in
several-row steps; see the kernel's comment). Numerics: each output is one
thread's fp32 sum in a fixed order whatever the row count and thread count, as above; the inputs
are the activations' bf16 values as they are (ATen's bf16 products take the same inputs). Where
vdpbf16ps is slow (Intel Sapphire/Emerald Rapids: half a zmm FMA's rate, so 4-8 rows of x are bound
by it) passes of 2-8 rows run the same sums as fp32 FMAs, bit for bit the instruction's
(:func:`fma_rows` checks that and times both on the CPU it runs on; thirty-fifth session: the default
head's tree steps 1.06-1.07x faster on a 2-core Xeon, outputs unchanged).

The AMX kernel (``"amx"``, :func:`gemv_amx`; Intel Sapphire Rapids and later, Linux grants the tile
state on request) computes the same products on the tile unit: x's rows (up to 16) are the A tile,
read in place, and the weights, packed once (:func:`amx_pack`) so that each 32-input x 16-output tile
is one contiguous KB, the B tiles. A tile product does 16 rows' work per weight load, so 2-8 rows cost
nearly what one does: on a 2-core Xeon with AMX (thirty-second session) SmolLM2-135M's forward at 1 /
4 / 8 tokens took 1.00x / 0.87x / 0.69x the AVX-512 kernel's time (the one-row parity needed the L1
prefetch below); with x as the A tile (thirty-sixth session; before, x^T was the B tile, packed per
call, and each output stored alone) 5 rows cost 1.0-1.1x one row in cache instead of 1.3-1.7x. Numerics:
each output is the tile product's fp32 sum in its fixed order (denormals flushed), whatever the row
and thread count, so plain steps and verifications agree bit for bit when both run on it; its sums
differ from the AVX-512 kernel's in the last bits, so the engine never mixes the two for one model. The
engine keeps products of up to :data:`AMX_ROWS` rows on it (trees of that many nodes, short prompts:
one pass over the weights serves every group of 16 rows).

The int8 kernel (:func:`gemv_q8`, weights from :func:`q8_pack`; a speculator head's drafting products only,
never a target's: ``PreparedLinears(int8=True)``) reads half the bytes of the bf16 one: one int8 weight row
and its fp32 scale, each row of x quantized to int16 by its own scale, the products summed exactly in int32
by VNNI's ``vpdpwssd``. A head's drafting step reads its weights from L3 every step and is bound by those
bytes (thirty-eighth session: the one-call draft 0.75-0.79 -> 0.45-0.56 ms replayed on a 2-core Xeon); its
outputs differ from the bf16 weights' by the rounding, which the verifier never sees (it judges the drafts).

Build: the C sources below are compiled once per machine by :func:`.native.build` (``cc -O3
-fopenmp`` with ``-mavx2 -mfma`` or the AVX-512 BF16 flags, cached by source hash, OpenMP shared
with torch). No compiler, no AVX2/FMA, or a
failed build: the kernel is unavailable and the engine's measured choice simply leaves it out
(:func:`unavailable_reason`).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import choices
from .native import AMX_BF16, AVX512_BF16, PRELUDE, build, kernel_dir, ptr
from .timing import best_seconds

__all__ = ["AMX_ROWS", "MAX_ROWS", "amx_available", "amx_pack", "amx_supports", "amx_unavailable_reason", "available",
           "bf16_available", "bf16_unavailable_reason", "configure", "fma_exact", "fma_rows", "gemv", "gemv_bf16",
           "keep_bits", "set_fma_rows",
           "gemv_amx", "unavailable_reason"]

MAX_ROWS = 8  # rows handled in one pass over the weights (accumulators held in registers)
#: rows the AMX kernel takes as a few-row product (engine.kernel_for): its A tile holds 16 rows of x and a block's
#: weights serve every group of 16 from the caches, so up to this many rows still read the weights once; a tree
#: verification of that many nodes then runs on a plain step's kernel (the same bits per row; thirty-ninth session)
AMX_ROWS = 64

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


# y[r, o] = sum_i x[r, i] * w[o, i] for all n rows of x (bf16 [n, in]), w bf16 [out, in], bias bf16
# [out] or NULL, y bf16 [n, out]. Work unit: 32 weight rows x up to 8 rows of x at a time, the weight
# rows read from memory once for all of them (they stay in L1 across the chunks of 8 rows).
_SOURCE_BF16 = r"""
#include <immintrin.h>
/* weights are read 4096 elements ahead with a prefetch into L2 (T1), so streaming ~270 MB of them
   overlaps the products. A non-temporal hint (NTA) was used before (1.10-1.20x per decode step
   against no prefetch, twenty-third session), but with several rows of x (a verification, a batch)
   each weight line is used for longer and the non-temporal lines were evicted before use: a
   4-token verification cost 1.14-1.28x a plain step, with T1 0.94-1.05x. Plain decoding with T1:
   as fast at 2 threads, ~6% faster at 1 (paired runs); the default head's tree@2/4 on Spec-Bench
   1.27x / 1.45x plain at 2 / 1 threads where NTA gave 1.15x / 1.12x (docs/results.md,
   twenty-fifth session). One row of x (a plain decode step) streams fastest with the prefetch 2048
   elements ahead: SmolLM2-135M's matrices 4-12% faster than at 4096 on a 2-core Zen 5 EPYC at 1 and 2
   threads, while 2-5 rows lose 10-35% at 512-2048 (twenty-eighth session). */
#define SF_PF 4096
#define SF_PF1 2048
#define SF_PF_HINT _MM_HINT_T1
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint16_t to_bf16(float f) {  /* round to nearest even (finite values) */
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7f800000u) == 0x7f800000u) return (uint16_t)(v.u >> 16) | ((v.u & 0xffff) ? 0x40 : 0);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}
static inline float from_bf16(uint16_t h) { union { uint32_t u; float f; } v = { (uint32_t)h << 16 }; return v.f; }
/* to_bf16 of 16 lanes (round to nearest even; infinities and NaNs as to_bf16 has them) */
static inline __m256i bf16x16(__m512 f) {
    __m512i u = _mm512_castps_si512(f), ex = _mm512_set1_epi32(0x7f800000);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                  _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))), 16);
    __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, ex), ex);
    __m512i s = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_maskz_mov_epi32(
        _mm512_test_epi32_mask(u, _mm512_set1_epi32(0xffff)), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, special, s));
}

/* Each output's 16 lanes of fp32 sums are added as _mm512_reduce_add_ps adds them (lanes i and i + 8, then
   i and i + 4, i and i + 2, i and i + 1), but for a group of 16 outputs at once, a transposed reduction:
   45 shuffles and adds and one vector rounding and store per 16 outputs, where each output alone took a
   reduction of 8 instructions and a scalar rounding and store. The same pairs of the same values are
   added (fp32 addition commutes), so every output keeps its bits. It runs as the outputs finish
   (sf_take: output j of a group pairs with j - 1 when j is odd, that pair with the one before when
   j % 4 == 3, ...), spread over the group. Measured on a 2-core Zen 4 (fifty-third session, whole
   generations in one process, with 4-5 rows on one weight row per pass, below): plain decoding's steps
   (one row of x) 8.79 -> 8.54 ms at 2 threads, 12.72 -> 12.07 at 1; the default head's verification
   steps (4-6 rows) 10.19 -> 9.91 and 14.62 -> 13.49 ms. */
typedef struct { __m512 p[4][8]; } sf_group;  /* per level and row of x: the partial result waiting for its pair */

/* output g0 + j's fp32 lanes v[r] for the rows r < rows of x; at j == 15 the group's cnt outputs are
   stored: y[r, g0 + j] = to_bf16(total + bias[g0 + j]) (+ 0 without a bias, as before) */
static inline void sf_take(sf_group *st, __m512 *v, int rows, int j, int cnt, const uint16_t *bias, uint16_t *y,
                           int out, int g0) {
    /* a: the earlier partial, v[r] the later; q: 128-bit quarters */
    if (!(j & 1)) { for (int r = 0; r < rows; r++) st->p[0][r] = v[r]; return; }
    for (int r = 0; r < rows; r++) {  /* lanes i + i + 8: [a q0+q2, a q1+q3, v q0+q2, v q1+q3] */
        __m512 a = st->p[0][r];
        v[r] = _mm512_add_ps(_mm512_shuffle_f32x4(a, v[r], 0x44), _mm512_shuffle_f32x4(a, v[r], 0xee));
    }
    if (!(j & 2)) { for (int r = 0; r < rows; r++) st->p[1][r] = v[r]; return; }
    for (int r = 0; r < rows; r++) {  /* + lanes i + 4: quarter k holds output 4 (j / 4) + k's four partial sums */
        __m512 a = st->p[1][r];
        v[r] = _mm512_add_ps(_mm512_shuffle_f32x4(a, v[r], 0x88), _mm512_shuffle_f32x4(a, v[r], 0xdd));
    }
    if (!(j & 4)) { for (int r = 0; r < rows; r++) st->p[2][r] = v[r]; return; }
    for (int r = 0; r < rows; r++) {  /* + lanes i + 2, within each quarter */
        __m512 a = st->p[2][r];
        v[r] = _mm512_add_ps(_mm512_shuffle_ps(a, v[r], 0x44), _mm512_shuffle_ps(a, v[r], 0xee));
    }
    if (!(j & 8)) { for (int r = 0; r < rows; r++) st->p[3][r] = v[r]; return; }
    __mmask16 m = (__mmask16)((1u << cnt) - 1);
    __m512 bv = _mm512_setzero_ps();
    if (bias) bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + g0)), 16));
    for (int r = 0; r < rows; r++) {  /* + lanes i + 1: lane 4k + m holds output 4m + k's total, put back in order */
        __m512 a = st->p[3][r];
        __m512 t = _mm512_add_ps(_mm512_shuffle_ps(a, v[r], 0x88), _mm512_shuffle_ps(a, v[r], 0xdd));
        t = _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), t);
        _mm256_mask_storeu_epi16(y + (int64_t)r * out + g0, m, bf16x16(_mm512_add_ps(t, bv)));
    }
}

/* a group of cnt < 16 outputs (a matrix's last): zeros in its empty places, then it is stored */
static inline void sf_finish(sf_group *st, int rows, int cnt, const uint16_t *bias, uint16_t *y, int out, int g0) {
    __m512 z[8];
    for (int j = cnt; j < 16; j++) {
        for (int r = 0; r < 8; r++) z[r] = _mm512_setzero_ps();
        sf_take(st, z, rows, j, cnt, bias, y, out, g0);
    }
}

/* the output loop of the few-row kernels (ROWS, ROWSF): the input's split into full blocks of 32 (body) and
   the masked rest (tail, m); groups of 16 outputs for sf_take; per output (o, its weight row wr) the two
   sums a0, a1 zeroed, the body (the macro's other arguments) run, their sum handed to sf_take; a last
   group of fewer than 16 finished by sf_finish */
#define SF_OUTPUTS(N, ...)                                                                           \
    int tail = in % 32, body = in - tail;                                                            \
    __mmask32 m = (__mmask32)((1ull << tail) - 1);                                                   \
    sf_group st;  /* a group's partial sums (sf_take) */                                             \
    for (int g0 = o0; g0 < o1; g0 += 16) {                                                           \
        int g1 = g0 + 16 < o1 ? g0 + 16 : o1;                                                        \
        for (int o = g0; o < g1; o++) {                                                              \
            const uint16_t *wr = w + (int64_t)o * in;                                                \
            __m512 a0[N], a1[N];                                                                     \
            _Pragma("GCC unroll 8") for (int r = 0; r < N; r++) {                                    \
                a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps();                            \
            }                                                                                        \
            __VA_ARGS__                                                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < N; r++) a0[r] = _mm512_add_ps(a0[r], a1[r]); \
            sf_take(&st, a0, N, o - g0, g1 - g0, bias, y, out, g0);                                  \
        }                                                                                            \
        if (g1 - g0 < 16) sf_finish(&st, N, g1 - g0, bias, y, out, g0);                              \
    }

/* N rows of x against one weight row at a time (N a literal constant in each instance: fixed-size
   arrays, loops of constant bounds, so the loops unroll and the sums stay in registers). Two sums
   per row (even and odd blocks of 32 inputs: two independent chains hide the instruction's
   latency), added at the end and handed to sf_take: the same order for every N. Several weight rows
   per pass measured slower (1.2-2.6x at 1-4 rows); two at 4-5 rows were 3-6% faster while each output
   was reduced alone (twenty-eighth session), 3-6% slower once sf_take reduced 16 together (an engine
   step of 4 rows, weights streamed, 1 and 2 threads; whole generations: the default head's
   verification steps 1.03-1.04x faster without them, fifty-third session). */
#define ROWS(N)                                                                                      \
static void rows##N(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int in, \
                    int out, int o0, int o1, int pf) {                                               \
    SF_OUTPUTS(N,                                                                                    \
    int i = 0;                                                                                       \
    for (; i + 64 <= body; i += 64) {                                                                \
        if (pf) {                                                                                    \
            _mm_prefetch((const char *)(wr + i + pf), SF_PF_HINT);                                   \
            _mm_prefetch((const char *)(wr + i + pf + 32), SF_PF_HINT);                              \
        }                                                                                            \
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + i);                                          \
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + i + 32);                                     \
        /* kept in registers: without this GCC reloads the weights once per row of x */              \
        __asm__("" : "+v"(w0), "+v"(w1));                                                            \
        _Pragma("GCC unroll 8") for (int r = 0; r < N; r++) {                                        \
            a0[r] = _mm512_dpbf16_ps(a0[r], w0, (__m512bh)_mm512_loadu_si512(x + (int64_t)r * in + i)); \
            a1[r] = _mm512_dpbf16_ps(a1[r], w1, (__m512bh)_mm512_loadu_si512(x + (int64_t)r * in + i + 32)); \
        }                                                                                            \
    }                                                                                                \
    if (i < body) { /* one more full block of 32 */                                                  \
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + i);                                          \
        __asm__("" : "+v"(w0));                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < N; r++)                                          \
            a0[r] = _mm512_dpbf16_ps(a0[r], w0, (__m512bh)_mm512_loadu_si512(x + (int64_t)r * in + i)); \
        i += 32;                                                                                     \
    }                                                                                                \
    if (tail) { /* the last in % 32 inputs: masked loads, zeros elsewhere */                         \
        __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(m, wr + i);                                 \
        _Pragma("GCC unroll 8") for (int r = 0; r < N; r++)                                          \
            a1[r] = _mm512_dpbf16_ps(a1[r], w1, (__m512bh)_mm512_maskz_loadu_epi16(m, x + (int64_t)r * in + i)); \
    }                                                                                                \
    )                                                                                                \
}
ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)

typedef void (*rows_fn)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int, int, int, int, int);
static const rows_fn ROWS_FN[9] = {0, rows1, rows2, rows3, rows4, rows5, rows6, rows7, rows8};

/* The same sums with fp32 FMAs: where vdpbf16ps is slow (Intel Sapphire/Emerald Rapids: one per two
   cycles, half the rate of a zmm FMA; measured 87 against 176 GFLOP/s per core, thirty-fifth session)
   several rows of x are bound by it (4 rows: 1.26x one row's time, 8 rows: 1.7x, weights streamed).
   vdpbf16ps adds a lane's odd pair product, then its even one, each rounded to fp32 (RNE, denormals
   flushed); bf16 products are exact in fp32, so two FMAs in that order (odd, then even; under DAZ/FTZ,
   which sf_gemv_dpbf16 sets for both paths) give the same bits: the weights are widened by a shift
   (even elements) and a mask (odd ones), x is widened once per call into the same split
   (xs: per block of 32 inputs its 16 odd elements, then its 16 even ones, zeros past the end). Each
   lane's chain and the blocks' order are ROWS(N)'s, so a row's outputs are the same bits on either
   path (sf_gemv_fma_exact checks it on this CPU before the path is used). Streamed weights are also
   prefetched into L1 SF_PF_L1 elements ahead: 4-5 rows of SmolLM2's matrices 0.88-0.97x the vdpbf16ps
   path's time with it, ~1.0x without (the vdpbf16ps path with the same L1 prefetch: 1.02-1.14x). */
#define SF_PF_L1 512
/* one block of 32 inputs (w: its 32 bf16 weights) into the sums a[r] of n rows of xs (ROWSF's split, row r
   at xs + r * inp): the odd products first, then the even ones */
static inline void sf_fma_block(__m512i w, const float *xs, int inp, __m512 *a, int n) {
    __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
    __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    _Pragma("GCC unroll 8") for (int r = 0; r < n; r++) {
        const float *xr = xs + (int64_t)r * inp;
        a[r] = _mm512_fmadd_ps(wo, _mm512_load_ps(xr), a[r]);
        a[r] = _mm512_fmadd_ps(we, _mm512_load_ps(xr + 16), a[r]);
    }
}
#define ROWSF(N)                                                                                     \
static void rowsf##N(const float *xs, int inp, const uint16_t *w, const uint16_t *bias, uint16_t *y, \
                     int in, int out, int o0, int o1, int pf) {                                      \
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);                                          \
    SF_OUTPUTS(N,                                                                                    \
    int i = 0;                                                                                       \
    for (; i + 64 <= body; i += 64) {                                                                \
        if (pf) {                                                                                    \
            _mm_prefetch((const char *)(wr + i + pf), SF_PF_HINT);                                   \
            _mm_prefetch((const char *)(wr + i + pf + 32), SF_PF_HINT);                              \
            _mm_prefetch((const char *)(wr + i + SF_PF_L1), _MM_HINT_T0);                            \
            _mm_prefetch((const char *)(wr + i + SF_PF_L1 + 32), _MM_HINT_T0);                       \
        }                                                                                            \
        __m512i w0 = _mm512_loadu_si512(wr + i), w1 = _mm512_loadu_si512(wr + i + 32);               \
        __m512 w0o = _mm512_castsi512_ps(_mm512_and_si512(w0, hi));                                  \
        __m512 w0e = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));                                 \
        __m512 w1o = _mm512_castsi512_ps(_mm512_and_si512(w1, hi));                                  \
        __m512 w1e = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));                                 \
        __asm__("" : "+v"(w0o), "+v"(w0e), "+v"(w1o), "+v"(w1e));                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < N; r++) {                                        \
            const float *xr = xs + (int64_t)r * inp + i;                                             \
            a0[r] = _mm512_fmadd_ps(w0o, _mm512_load_ps(xr), a0[r]);                                 \
            a1[r] = _mm512_fmadd_ps(w1o, _mm512_load_ps(xr + 32), a1[r]);                            \
            a0[r] = _mm512_fmadd_ps(w0e, _mm512_load_ps(xr + 16), a0[r]);                            \
            a1[r] = _mm512_fmadd_ps(w1e, _mm512_load_ps(xr + 48), a1[r]);                            \
        }                                                                                            \
    }                                                                                                \
    if (i < body) { sf_fma_block(_mm512_loadu_si512(wr + i), xs + i, inp, a0, N); i += 32; }        \
    if (tail) sf_fma_block(_mm512_maskz_loadu_epi16(m, wr + i), xs + i, inp, a1, N);                 \
    )                                                                                                \
}
ROWSF(1) ROWSF(2) ROWSF(3) ROWSF(4) ROWSF(5) ROWSF(6) ROWSF(7) ROWSF(8)
typedef void (*rowsf_fn)(const float *, int, const uint16_t *, const uint16_t *, uint16_t *, int, int, int, int, int);
static const rowsf_fn ROWSF_FN[9] = {0, rowsf1, rowsf2, rowsf3, rowsf4, rowsf5, rowsf6, rowsf7, rowsf8};

/* which chunk sizes (rows of x per pass, 1-8) take the FMA path: none until sf_gemv_set_fma says
   (runtime/cpu_gemv.py times both paths on this CPU) */
static unsigned char sf_fma_rows[9];
void sf_gemv_set_fma(const unsigned char *use) { for (int k = 0; k < 9; k++) sf_fma_rows[k] = use[k] ? 1 : 0; }

#define SF_MXCSR_DAZ_FTZ 0x8040u

/* x [n, in] bf16 -> xs [n, inp] fp32 in ROWSF's split (inp = in rounded up to 32) */
static void split_rows(const uint16_t *x, float *xs, int n, int in, int inp) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int r = 0; r < n; r++)
        for (int i = 0; i < in; i += 32) {
            int left = in - i;
            __mmask32 m = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << left) - 1);
            __m512i v = _mm512_maskz_loadu_epi16(m, x + (int64_t)r * in + i);
            _mm512_store_ps(xs + (int64_t)r * inp + i, _mm512_castsi512_ps(_mm512_and_si512(v, hi)));
            _mm512_store_ps(xs + (int64_t)r * inp + i + 16, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
        }
}

/* 1 when two FMAs (odd pair product, then even) under DAZ/FTZ give vdpbf16ps's bits on this CPU: bf16
   values over the whole exponent range (denormals, zeros and products that underflow included),
   sums of 64 blocks, every lane compared */
int sf_gemv_fma_exact(void) {
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | SF_MXCSR_DAZ_FTZ);
    uint64_t s = 0x9E3779B97F4A7C15ull;
    int same = 1;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int trial = 0; trial < 256 && same; trial++) {
        __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
        int lo = trial % 4 == 0 ? 0 : trial % 4 == 1 ? 100 : 120, span = trial % 4 == 3 ? 20 : 40;
        for (int blk = 0; blk < 64; blk++) {
            uint16_t wv[32], xv[32];
            for (int j = 0; j < 32; j++) {
                s = s * 6364136223846793005ull + 1442695040888963407ull;
                uint32_t r = (uint32_t)(s >> 32);
                /* sign, an exponent in [lo, lo + span) (0: denormal or zero), 7 mantissa bits */
                wv[j] = (uint16_t)(((r & 1) << 15) | (((lo + (r >> 1) % span) & 0xff) << 7) | ((r >> 9) & 0x7f));
                xv[j] = (uint16_t)((((r >> 16) & 1) << 15) | (((lo + (r >> 17) % span) & 0xff) << 7) | ((r >> 25) & 0x7f));
            }
            __m512i w = _mm512_loadu_si512(wv), x = _mm512_loadu_si512(xv);
            a = _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)x);
            b = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, hi)), _mm512_castsi512_ps(_mm512_and_si512(x, hi)), b);
            b = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), b);
        }
        same = _mm512_cmpneq_epi32_mask(_mm512_castps_si512(a), _mm512_castps_si512(b)) == 0;
    }
    _mm_setcsr(csr);
    return same;
}

/* keep's bits (the products' callers pass them through): SF_KEEP: the weights are read again soon (a
   speculator head's, every step): plain loads, no prefetch ahead (they are read from the caches, not
   streamed); SF_FMA2: passes of 2 rows of x over streamed weights take the FMA path (the caller
   measured it faster there: runtime/engine.py, where vdpbf16ps streams 2 rows ~1.2x slower than 1 or
   3 on a Zen 4 at 1 thread, fifty-first session; the same bits either way) */
#define SF_KEEP 1
#define SF_FMA2 2
static inline int fma_pass(int k, int keep) { return sf_fma_rows[k] || (k == 2 && (keep & SF_FMA2)); }

/* outputs in chunks of 32 per thread task; within a chunk every 8 rows of x in turn. keep: SF_KEEP and
   SF_FMA2 above */
void sf_gemv_dpbf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int n, int in, int out,
                    int keep) {
    int pf = (keep & SF_KEEP) ? 0 : n == 1 ? SF_PF1 : SF_PF;  /* how far ahead the weights are prefetched (0: not) */
    int inp = (in + 31) / 32 * 32, fma = 0;
    for (int r0 = 0; r0 < n; r0 += 8) fma |= fma_pass(n - r0 < 8 ? n - r0 : 8, keep);
    float *xs = fma ? (float *)aligned_alloc(64, sizeof(float) * (size_t)n * (size_t)inp) : 0;
    if (xs) split_rows(x, xs, n, in, inp);  /* (no memory: the vdpbf16ps path, the same bits) */
    _Pragma("omp parallel")
    {
        /* both paths' fp32 arithmetic outside vdpbf16ps (FMAs, the final sums) under DAZ/FTZ, as
           vdpbf16ps does its own: the same bits on either (the thread's own mode restored after) */
        unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | SF_MXCSR_DAZ_FTZ);
        _Pragma("omp for schedule(static)")
        for (int c = 0; c < (out + 31) / 32; c++) {
            int o0 = c * 32, o1 = o0 + 32 < out ? o0 + 32 : out;
            for (int r0 = 0; r0 < n; r0 += 8) {
                int k = n - r0 < 8 ? n - r0 : 8;
                if (xs && fma_pass(k, keep))
                    ROWSF_FN[k](xs + (int64_t)r0 * inp, inp, w, bias, y + (int64_t)r0 * out, in, out, o0, o1, pf);
                else
                    ROWS_FN[k](x + (int64_t)r0 * in, w, bias, y + (int64_t)r0 * out, in, out, o0, o1, pf);
            }
        }
        _mm_setcsr(csr);
    }
    free(xs);
}

/* Int8 weights (a speculator head's, q8_pack): each weight row [in] int8 followed by its fp32 scale s_o
   (4 bytes; rows in + 4 bytes apart), in % 32 == 0. Each row of x is quantized to int16 by its own
   scale sx_r = max|x_r| / 32767 (round to nearest even), the int16 x int16 products summed exactly in
   int32 by vpdpwssd (32 inputs per instruction, the int8 weights sign-extended on the way) and moved
   into fp32 every SF_Q8_FLUSH inputs, before a lane could overflow (127 * 32767 * 2 per instruction);
   y[r, o] = bf16(sum * (sx_r * s_o) + bias[o]). Each output is one thread's sums in a fixed order,
   whatever the row and thread count. A row of x that is not finite gives NaN outputs. Half the bf16
   weights' bytes: the head's products, read from L3 every drafting step, are bound by those bytes
   (thirty-eighth session: 1.85x the bf16 products' speed on a head's matrices at 2 threads). */
#define SF_Q8_FLUSH 8192
#define SF_Q8_PF 1024
#define ROWSQ(N)                                                                                     \
static void rowsq##N(const int16_t *xq, int inp, const float *sx, const uint8_t *w, const uint16_t *bias, \
                     uint16_t *y, int in, int out, int o0, int o1, int pf) {                         \
    int64_t stride = (int64_t)in + 4;                                                                \
    for (int o = o0; o < o1; o++) {                                                                  \
        const int8_t *wr = (const int8_t *)(w + (int64_t)o * stride);                                \
        __m512 f[N];                                                                                 \
        _Pragma("GCC unroll 8") for (int r = 0; r < N; r++) f[r] = _mm512_setzero_ps();             \
        for (int c0 = 0; c0 < in; c0 += SF_Q8_FLUSH) {                                               \
            int c1 = c0 + SF_Q8_FLUSH < in ? c0 + SF_Q8_FLUSH : in, i = c0;                          \
            __m512i a0[N], a1[N];                                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < N; r++) {                                    \
                a0[r] = _mm512_setzero_si512(); a1[r] = _mm512_setzero_si512();                      \
            }                                                                                        \
            for (; i + 64 <= c1; i += 64) {                                                          \
                if (pf) _mm_prefetch((const char *)(wr + i + pf), SF_PF_HINT);                       \
                __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + i)));    \
                __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + i + 32))); \
                _Pragma("GCC unroll 8") for (int r = 0; r < N; r++) {                                \
                    const int16_t *xr = xq + (int64_t)r * inp + i;                                   \
                    a0[r] = _mm512_dpwssd_epi32(a0[r], w0, _mm512_load_si512(xr));                  \
                    a1[r] = _mm512_dpwssd_epi32(a1[r], w1, _mm512_load_si512(xr + 32));             \
                }                                                                                    \
            }                                                                                        \
            if (i < c1) {                                                                            \
                __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + i)));    \
                _Pragma("GCC unroll 8") for (int r = 0; r < N; r++)                                  \
                    a0[r] = _mm512_dpwssd_epi32(a0[r], w0, _mm512_load_si512(xq + (int64_t)r * inp + i)); \
            }                                                                                        \
            _Pragma("GCC unroll 8") for (int r = 0; r < N; r++)                                      \
                f[r] = _mm512_add_ps(f[r], _mm512_add_ps(_mm512_cvtepi32_ps(a0[r]), _mm512_cvtepi32_ps(a1[r]))); \
        }                                                                                            \
        float so, bv = bias ? from_bf16(bias[o]) : 0.0f;                                             \
        memcpy(&so, wr + in, 4);                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < N; r++)                                          \
            y[(int64_t)r * out + o] = to_bf16(_mm512_reduce_add_ps(f[r]) * (sx[r] * so) + bv);       \
    }                                                                                                \
}
ROWSQ(1) ROWSQ(2) ROWSQ(3) ROWSQ(4) ROWSQ(5) ROWSQ(6) ROWSQ(7) ROWSQ(8)
typedef void (*rowsq_fn)(const int16_t *, int, const float *, const uint8_t *, const uint16_t *, uint16_t *, int, int,
                         int, int, int);
static const rowsq_fn ROWSQ_FN[9] = {0, rowsq1, rowsq2, rowsq3, rowsq4, rowsq5, rowsq6, rowsq7, rowsq8};

/* y [n, out] bf16 = x [n, in] bf16 times the int8 weights w (layout above) plus bias; keep as in
   sf_gemv_dpbf16 (no prefetch ahead). 0, or 1 when the work buffer could not be allocated. */
int sf_gemv_q8(const uint16_t *x, const uint8_t *w, const uint16_t *bias, uint16_t *y, int n, int in, int out,
               int keep) {
    int pf = (keep & SF_KEEP) ? 0 : SF_Q8_PF;
    int16_t *xq = (int16_t *)aligned_alloc(64, sizeof(int16_t) * (size_t)n * (size_t)in + 64);
    float *sx = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!xq || !sx) { free(xq); free(sx); return 1; }
    for (int r = 0; r < n; r++) {  /* each row's scale and its int16 values */
        const uint16_t *xr = x + (int64_t)r * in;
        __m512 m = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (int i = 0; i < in; i += 16) {
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xr + i))), 16));
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            m = _mm512_max_ps(m, _mm512_abs_ps(v));
        }
        float amax = nan ? __builtin_nanf("") : _mm512_reduce_max_ps(m);
        sx[r] = amax > 0 && amax <= 3.4e38f ? amax / 32767.0f : amax == 0 ? 0.0f : __builtin_nanf("");
        __m512 inv = _mm512_set1_ps(amax > 0 && amax <= 3.4e38f ? 32767.0f / amax : 0.0f);
        for (int i = 0; i < in; i += 16) {
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xr + i))), 16));
            _mm256_store_si256((__m256i *)(xq + (int64_t)r * in + i), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv))));
        }
    }
    _Pragma("omp parallel for schedule(static)")
    for (int c = 0; c < (out + 31) / 32; c++) {
        int o0 = c * 32, o1 = o0 + 32 < out ? o0 + 32 : out;
        for (int r0 = 0; r0 < n; r0 += 8) {
            int k = n - r0 < 8 ? n - r0 : 8;
            ROWSQ_FN[k](xq + (int64_t)r0 * in, in, sx + r0, w, bias, y + (int64_t)r0 * out, in, out, o0, o1, pf);
        }
    }
    free(xq); free(sx);
    return 0;
}
"""

# The same products on Intel's AMX tiles (TDPBF16PS): rows of x are the A tile (up to 16 rows x 32 inputs,
# read in place), the weights the B tiles (16 input pairs x 16 outputs, packed once); fp32 sums in the C tiles.
_SOURCE_AMX = r"""
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
/* the packed weights are prefetched ahead of the tile loads (one prefetch per line, 2 KB per 32 inputs
   of a block pair): into L2 SF_AMX_PF bytes ahead and into L1 SF_AMX_PF0 ahead. Tile loads leave the
   memory latency exposed: with no prefetch one row of x ran 5-10% slower than the AVX-512 kernel on
   SmolLM2-135M's matrices, with L2 alone 2-5% (4-32 KB ahead alike), with both as fast (2-core Xeon
   with AMX, docs/results.md thirty-second session). */
#define SF_AMX_PF 8192
#define SF_AMX_PF0 4096

/* Linux hands out the AMX tile state only on request (once per process) */
long sf_amx_permit(void) { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */); }

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } sf_tilecfg;

/* one group of rows of x (A tile A, configured for its row count) times a block pair's B tiles (2, 3) into
   the C tiles C0 and C1, then stored to cb: a macro because the tile intrinsics take their tile numbers as
   constants (it reads sf_gemv_amx's nkb, pf, g, wb, xg, in and cb) */
#define SF_AMX_GROUP(C0, C1, A)                                                                                  \
    do {                                                                                                         \
        _tile_zero(C0);                                                                                          \
        _tile_zero(C1);                                                                                          \
        for (int kb = 0; kb < nkb; kb++) {                                                                       \
            if (pf && g == 0) {  /* the block's weights stream in once, for its first group */                  \
                const char *pp = (const char *)(wb + kb * 1024);                                                 \
                for (int q = 0; q < 32; q++) _mm_prefetch(pp + SF_AMX_PF + q * 64, _MM_HINT_T1);                 \
                for (int q = 0; q < 32; q++) _mm_prefetch(pp + SF_AMX_PF0 + q * 64, _MM_HINT_T0);                \
            }                                                                                                    \
            _tile_loadd(A, xg + kb * 32, 2 * in);                                                                \
            _tile_loadd(2, wb + kb * 1024, 64);                                                                  \
            _tile_loadd(3, wb + kb * 1024 + 512, 64);                                                            \
            _tile_dpbf16ps(C0, A, 2);                                                                            \
            _tile_dpbf16ps(C1, A, 3);                                                                            \
        }                                                                                                        \
        _tile_stored(C0, cb[0], 64);                                                                             \
        _tile_stored(C1, cb[1], 64);                                                                             \
    } while (0)

/* y[r, o] = sum_i x[r, i] * w[o, i] + bias[o] for the n rows of x (bf16 [n, in], read in place: up to 16
   rows are one A tile); wp the weights packed [out/32][in/32][2][16 input pairs][16 outputs][2] (amx_pack:
   each B tile one contiguous KB, a block pair's tiles read in address order); y bf16 [n, out]; in % 32
   == 0, out % 32 == 0. Each output is the tile product's fp32 sum over the inputs in one fixed order,
   whatever n and the thread count (a row's bits do not depend on the rows beside it). Why x is the A
   tile (thirty-sixth session): the other way round (weights as A, x^T as B) needed x packed per call
   on one thread and each output stored alone: 5 rows cost 1.3-1.7x one row in cache, here 1.0-1.1x,
   the same bits. The prefetches run for a block's first group of rows only: the later groups find its
   weights in cache, and 64 prefetch instructions per 32 inputs for every group of a 700-row prefill
   cost 30% of its products' time (thirty-seventh session). Full groups of 16 rows use tiles 0, 1 (C) and 4
   (A), a last group of fewer rows its own 5, 6 and 7, so the tiles are configured once per call: a
   configuration per group change (16 rows, then the rest, in every block) cost a 24-row product ~1.3x
   a 16-row one (thirty-ninth session). */
void sf_gemv_amx(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y, int n, int in, int out,
                 int keep) {
    int nkb = in / 32, ng = (n + 15) / 16, rest = n % 16, pf = !(keep & SF_KEEP);
    _Pragma("omp parallel")
    {
        sf_tilecfg c;
        float cb[2][256] __attribute__((aligned(64)));
        int configured = 0;
        _Pragma("omp for schedule(static)")
        for (int b = 0; b < out / 32; b++) {
            if (!configured) {  /* B tiles 2, 3: 16 rows of 64 bytes; A and C tiles: their group's rows of 64 bytes */
                memset(&c, 0, sizeof c);
                c.palette = 1;
                for (int t = 2; t < 4; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
                if (n >= 16) { c.rows[0] = c.rows[1] = c.rows[4] = 16; c.colsb[0] = c.colsb[1] = c.colsb[4] = 64; }
                if (rest) for (int t = 5; t < 8; t++) { c.rows[t] = rest; c.colsb[t] = 64; }
                _tile_loadconfig(&c);
                configured = 1;
            }
            const uint16_t *wb = wp + (int64_t)b * 32 * in;
            for (int g = 0; g < ng; g++) {
                int nj = n - g * 16 < 16 ? n - g * 16 : 16;
                const uint16_t *xg = x + (int64_t)g * 16 * in;
                if (nj == 16)
                    SF_AMX_GROUP(0, 1, 4);
                else
                    SF_AMX_GROUP(5, 6, 7);
                for (int t = 0; t < 2; t++) {  /* row j of C tile t: outputs o..o+15 of x's row j */
                    int o = b * 32 + t * 16;
                    __m512 bv = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                        _mm256_loadu_si256((const __m256i *)(bias + o))), 16)) : _mm512_setzero_ps();
                    for (int j = 0; j < nj; j++)
                        _mm256_storeu_si256((__m256i *)(y + (int64_t)(g * 16 + j) * out + o),
                                            bf16x16(_mm512_add_ps(_mm512_load_ps(cb[t] + j * 16), bv)));
                }
            }
        }
        if (configured) _tile_release();
    }
}
"""


@functools.lru_cache(maxsize=1)
def _load_bf16() -> tuple[ctypes.CDLL | None, str | None]:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib, why = build("sfgemvbf16", _SOURCE_BF16, {"sf_gemv_dpbf16": [p, p, p, p, i, i, i, i],
                                                  "sf_gemv_q8": [p, p, p, p, i, i, i, i]}, isa=AVX512_BF16)
    if lib is not None:
        lib.sf_gemv_q8.restype = ctypes.c_int
    return lib, why


def set_fma_rows(lib: ctypes.CDLL, rows) -> None:
    """Make the AVX-512 BF16 kernel in ``lib`` (any library built with :data:`_SOURCE_BF16`) compute
    passes of ``rows`` rows of x (of 1-8) with fp32 FMAs, the others with vdpbf16ps (the same bits
    where ``sf_gemv_fma_exact`` holds: :func:`fma_rows` only chooses it there)."""
    lib.sf_gemv_set_fma((ctypes.c_ubyte * 9)(*[int(k in rows) for k in range(9)]))


@functools.lru_cache(maxsize=1)
def fma_exact() -> bool:
    """Whether two fp32 FMAs (a pair's odd product, then its even one, under DAZ/FTZ) give vdpbf16ps's
    bits on this CPU (``sf_gemv_fma_exact``): where not, the AVX-512 BF16 kernel never takes its FMA path."""
    lib = _load_bf16()[0]
    return lib is not None and bool(lib.sf_gemv_fma_exact())


@functools.lru_cache(maxsize=1)
def fma_rows() -> tuple[int, ...]:
    """The passes of 2-8 rows of x the AVX-512 BF16 kernel runs with fp32 FMAs on this CPU (set in its
    library here; :func:`configure` sets it in the others): all of them where the FMA path computes 4
    and 8 rows faster than vdpbf16ps on weights in cache (the compute that several rows add to a
    streamed product; on a 2-core Intel Xeon with AMX, where vdpbf16ps runs at half a zmm FMA's rate,
    0.7-0.8x in cache, and streamed with its L1 prefetch 4-5 rows 0.88-0.97x: docs/results.md,
    thirty-fifth session; on an AMD Zen 5, where vdpbf16ps runs at twice an FMA's rate, it would lose),
    none elsewhere, and only where the two paths give the same bits (:func:`fma_exact`), so that
    the choice never shows in a result. One row (a plain decode step, bound by the weights' stream)
    always keeps vdpbf16ps."""
    if not fma_exact():
        return ()
    lib = _load_bf16()[0]

    def measure() -> list[int]:
        gen = torch.Generator().manual_seed(0)  # (the caller's random stream untouched)
        w = torch.randn(1024, 576, generator=gen).to(torch.bfloat16)  # 1.2 MB: in the threads' L2 caches
        xs = {k: torch.randn(k, 576, generator=gen).to(torch.bfloat16) for k in (4, 8)}
        y = torch.empty(8, 1024, dtype=torch.bfloat16)
        best = {False: float("inf"), True: float("inf")}
        # rounds alternating the paths (a machine slowing down slows both); 12 of them (~40 ms), as the
        # choice is kept per machine: timed afresh in each process, 1 of 16 chose vdpbf16ps on a quiet
        # 2-core Xeon where the FMAs are faster (forty-seventh session)
        for _ in range(12):
            for fma in best:
                set_fma_rows(lib, (4, 8) if fma else ())
                best[fma] = min(best[fma], best_seconds(lambda: [
                    lib.sf_gemv_dpbf16(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), k, 576, 1024, 1)
                    for k, x in xs.items() for _ in range(4)], 2))
        return list(range(2, MAX_ROWS + 1)) if best[True] < best[False] else []

    # kept per machine (runtime/choices.py): the same path in every process, so the same speed
    rows, _ = choices.kept("fma-rows", {"source": kernel_dir(_SOURCE_BF16).name}, measure,
                           lambda v: isinstance(v, list) and all(isinstance(k, int) and 2 <= k <= MAX_ROWS for k in v))
    chosen = tuple(rows)
    set_fma_rows(lib, chosen)
    return chosen


def configure(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (built with :data:`_SOURCE_BF16`) with the AVX-512 BF16 kernel's paths chosen here
    (:func:`fma_rows`)."""
    set_fma_rows(lib, fma_rows())
    return lib


def bf16_unavailable_reason() -> str | None:
    """None when the AVX-512 BF16 kernel can run here, else why not."""
    return _load_bf16()[1]


def bf16_available() -> bool:
    return _load_bf16()[0] is not None


def q8_pack(w: torch.Tensor) -> torch.Tensor:
    """A weight ``[out, in]`` as :func:`gemv_q8` reads it: uint8 ``[out, in + 4]``, each row its int8
    values ``round(w / s)`` then its fp32 scale ``s = max|w_row| / 127`` (symmetric, per output; a
    zero row has scale 0). The product differs from the bf16 weights' by the rounding (<= s / 2 per
    weight): for a speculator head's drafting only, where the verifier judges whatever it drafts."""
    if w.dim() != 2 or w.shape[1] % 32:
        raise ValueError(f"q8_pack takes a matrix with a multiple of 32 inputs, got {tuple(w.shape)}")
    wf = w.detach().to("cpu", torch.float32)
    s = wf.abs().amax(1) / 127
    q = torch.round(wf / s.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)).clamp_(-127, 127)
    q = q.where(s.unsqueeze(1) > 0, torch.zeros(()))
    return torch.cat([q.to(torch.int8).view(torch.uint8), s.view(torch.uint8).view(-1, 4)], 1).contiguous()


def gemv_q8(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, keep: bool = False) -> torch.Tensor:
    """``x @ dequant(w).T + b`` for bf16 ``x`` ``[..., in]`` and a :func:`q8_pack` weight, each row of
    ``x`` quantized to int16 (its own scale) and the sums exact in int32, rounded once to bf16 (the
    kernel's comment). ``keep`` as in :func:`gemv_bf16`."""
    lib = _load_bf16()[0]
    if lib is None:
        raise RuntimeError(f"the avx512bf16 kernel is unavailable: {bf16_unavailable_reason()}")
    out_f, in_f = w.shape[0], w.shape[1] - 4
    if w.dtype != torch.uint8 or not w.is_contiguous() or x.dtype != torch.bfloat16 or x.shape[-1] != in_f \
            or in_f % 32:
        raise ValueError(f"gemv_q8 takes bf16 inputs [..., in] and a q8_pack weight, got x {x.dtype} "
                         f"{tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}")
    x2 = x.reshape(-1, in_f).contiguous()
    n = x2.shape[0]
    y = torch.empty(n, out_f, dtype=torch.bfloat16)
    if n:
        bias = None if b is None else b.to(torch.bfloat16).contiguous()
        if lib.sf_gemv_q8(x2.data_ptr(), w.data_ptr(), ptr(bias), y.data_ptr(), n, in_f, out_f, int(keep)):
            raise MemoryError("gemv_q8: the work buffer could not be allocated")
    return y.view(*x.shape[:-1], out_f)


def bf16_supports(w: torch.Tensor) -> bool:
    """Whether :func:`gemv_bf16` takes weight ``w`` (a contiguous CPU bf16 matrix, an even number of inputs)."""
    return w.device.type == "cpu" and w.dim() == 2 and w.dtype == torch.bfloat16 and w.is_contiguous() \
        and w.shape[1] % 2 == 0


def keep_bits(keep: bool, fma2: bool) -> int:
    """The C kernels' ``keep`` argument: ``SF_KEEP`` (1) for weights read again every step, ``SF_FMA2``
    (2) for 2-row passes over streamed weights on the FMA path, only where :func:`fma_exact`."""
    return int(keep) | (2 if fma2 and fma_exact() else 0)


def gemv_bf16(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, keep: bool = False,
              fma2: bool = False) -> torch.Tensor:
    """``F.linear(x, w, b)`` for bf16 ``x`` ``[..., in]`` and bf16 ``w`` with the AVX-512 BF16 kernel:
    fp32 sums (bias added before the one rounding to bf16), any row count (8 at a time over each
    block of weight rows, read from memory once). ``keep``: ``w`` is read again every step (a
    speculator head's): plain loads, no prefetch ahead (it is read from the caches, not streamed).
    ``fma2``: passes of 2 rows over streamed weights take the FMA path (the same bits, where
    :func:`fma_exact`; else ignored)."""
    lib = _load_bf16()[0]
    if lib is None:
        raise RuntimeError(f"the avx512bf16 kernel is unavailable: {bf16_unavailable_reason()}")
    fma_rows()  # (its paths chosen once, on first use)
    if not bf16_supports(w) or x.dtype != torch.bfloat16:
        raise ValueError(f"the avx512bf16 kernel takes bf16 inputs and contiguous CPU bf16 weights with an even "
                         f"number of inputs, got x {x.dtype}, w {w.dtype} {tuple(w.shape)}")
    out_f, in_f = w.shape
    x2 = x.reshape(-1, in_f).contiguous()
    n = x2.shape[0]
    y = torch.empty(n, out_f, dtype=torch.bfloat16)
    if n:
        bias = None if b is None else b.to(torch.bfloat16).contiguous()
        lib.sf_gemv_dpbf16(x2.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                           n, in_f, out_f, keep_bits(keep, fma2))
    return y.view(*x.shape[:-1], out_f)


@functools.lru_cache(maxsize=1)
def _load_amx() -> tuple[ctypes.CDLL | None, str | None]:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib, why = build("sfgemvamx", _SOURCE_BF16 + _SOURCE_AMX, {"sf_gemv_amx": [p, p, p, p, i, i, i, i]}, isa=AMX_BF16)
    if lib is None:
        return None, why
    lib.sf_amx_permit.restype = ctypes.c_long
    if lib.sf_amx_permit() != 0:
        return None, "the kernel asked Linux for the AMX tile state and was refused (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return lib, None


def amx_unavailable_reason() -> str | None:
    """None when the AMX kernel can run here, else why not."""
    return _load_amx()[1]


def amx_available() -> bool:
    return _load_amx()[0] is not None


def amx_supports(w: torch.Tensor) -> bool:
    """Whether :func:`amx_pack` takes weight ``w`` (a CPU bf16 matrix, inputs and outputs multiples of 32)."""
    return w.device.type == "cpu" and w.dim() == 2 and w.dtype == torch.bfloat16 and w.shape[0] % 32 == 0 \
        and w.shape[1] % 32 == 0


def amx_pack(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[out, in]`` in the AMX kernel's layout ``[out/32, in/32, 2, 16, 16, 2]``: each B tile (32
    inputs as 16 pairs x 16 outputs) one contiguous KB, a block pair's tiles in the order the kernel
    reads them."""
    if not amx_supports(w):
        raise ValueError(f"the amx kernel takes CPU bf16 weights with multiples of 32 inputs and outputs, "
                         f"got {w.dtype} {tuple(w.shape)}")
    o, i = w.shape
    return w.reshape(o // 32, 2, 16, i // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def gemv_amx(x: torch.Tensor, wp: torch.Tensor, b: torch.Tensor | None = None, keep: bool = False) -> torch.Tensor:
    """``F.linear(x, w, b)`` for bf16 ``x`` ``[..., in]`` with ``wp = amx_pack(w)`` on the AMX tiles:
    fp32 sums (bias added before the one rounding to bf16), any row count (16 at a time), each row's
    result the same bits whatever rows come with it. ``keep``: no prefetch ahead (weights read from
    the caches)."""
    lib = _load_amx()[0]
    if lib is None:
        raise RuntimeError(f"the amx kernel is unavailable: {amx_unavailable_reason()}")
    if wp.dim() != 6 or wp.dtype != torch.bfloat16 or not wp.is_contiguous() or x.dtype != torch.bfloat16:
        raise ValueError(f"the amx kernel takes bf16 inputs and weights from amx_pack, got x {x.dtype}, "
                         f"w {wp.dtype} {tuple(wp.shape)}")
    out_f, in_f = wp.shape[0] * 32, wp.shape[1] * 32
    x2 = x.reshape(-1, in_f).contiguous()
    n = x2.shape[0]
    y = torch.empty(n, out_f, dtype=torch.bfloat16)
    if n:
        bias = None if b is None else b.to(torch.bfloat16).contiguous()
        lib.sf_gemv_amx(x2.data_ptr(), wp.data_ptr(), ptr(bias), y.data_ptr(), n, in_f, out_f, int(keep))
    return y.view(*x.shape[:-1], out_f)


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
