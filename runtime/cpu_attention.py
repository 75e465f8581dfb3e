"""Decode attention on x86 CPUs: for the serving batch (AVX2+FMA, :func:`slot_attention`: every row
over its own columns, with its own number of new tokens, in one call and without padding), and for
one sequence's decode and verification steps (AVX-512 BF16, :func:`decode_attention`) and its prompt's
prefill (the same kernel over the causal triangle, :func:`prefill_attention`).

Why: a serving step attends ``B`` rows of unequal committed length, each with a few new tokens (1
for plain decoding, a draft's nodes otherwise). PyTorch's CPU SDPA treats each call as a blocked
GEMM: measured for 32 rows of 80-500 columns, bf16, 1 thread (docs/results.md, eleventh session),
it was ~49% of a plain 32-row step of SmolLM2-135M, mostly fixed work per column whatever the
query count, and rows of unequal length had to be split into ranges (:func:`.serving.slots.row_groups`)
and padded to a common width and draft length. Here each (row, KV head) pair reads only its row's
columns once for all of its ``g * n`` query rows (the ``g`` query heads of that KV head times the
row's real tokens).

Numerics: scores and the softmax in fp32 (K, V and Q widened exactly from bf16), the output
rounded once to the cache's dtype, as SDPA does; the exponential is a polynomial accurate to a
few fp32 ulps; masked columns weigh exactly 0. Results equal SDPA's within fp32 rounding, not
bit for bit.

Layout: ``q`` flat ``[T, hq, D]`` (the step's real tokens, row ``b``'s ``counts[b]`` tokens
from ``first[b]``); the cache ``[slots, hkv, capacity, D]`` (K and V, any slot/head strides,
columns contiguous); row ``b``'s token ``t`` sees columns ``0 .. lengths[b]-1`` and, among the
row's new columns ``lengths[b] + j``, those where ``block[b, t, j]``. Built by
:func:`.native.build`; :func:`available` says whether it runs here.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .native import AVX512_BF16, PRELUDE, build


def _exp_poly(op: str, vec: str) -> str:
    """The C body shared by the kernels' exp(x) (x <= 0, Cephes-style): from ``n = round(x / ln 2)``,
    ``p = e^r`` for ``r = x - n ln 2`` (``|r| <= ln2/2``) as a polynomial accurate to a few fp32 ulps;
    the caller scales by ``2^n``. ``op``: the intrinsics' prefix (``_mm256``/``_mm512``)."""
    return f"""
    {vec} r = {op}_fnmadd_ps(n, {op}_set1_ps(0.693359375f), x);
    r = {op}_fnmadd_ps(n, {op}_set1_ps(-2.12194440e-4f), r);
    {vec} p = {op}_set1_ps(1.9875691500e-4f);
    p = {op}_fmadd_ps(p, r, {op}_set1_ps(1.3981999507e-3f));
    p = {op}_fmadd_ps(p, r, {op}_set1_ps(8.3334519073e-3f));
    p = {op}_fmadd_ps(p, r, {op}_set1_ps(4.1665795894e-2f));
    p = {op}_fmadd_ps(p, r, {op}_set1_ps(1.6666665459e-1f));
    p = {op}_fmadd_ps(p, r, {op}_set1_ps(5.0000001201e-1f));
    p = {op}_fmadd_ps(p, {op}_mul_ps(r, r), {op}_add_ps(r, {op}_set1_ps(1.0f)));"""


_SOURCE = PRELUDE + r"""
#include <math.h>
#include <stdlib.h>

/* exp(x) for x <= 0 (scores minus their max), Cephes-style: 2^n * p(r), |r| <= ln2/2 */
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
""" + _exp_poly("_mm256", "__m256") + r"""
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* the 8 lane sums of a[0..7] as one vector */
static inline __m256 hsum8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#define MAXD 256
#define BLK 8

/* columns c0 .. c0+7 of X (K or V) widened to fp32 into kb (zeros past the row's nc columns) */
#define WIDEN(X, LOAD)                                                                                     \
    for (int j = 0; j < BLK; j++)                                                                    \
        for (int d = 0; d < D; d += 8)                                                               \
            _mm256_store_ps(kb + j * D + d, j < nc ? LOAD(X + (int64_t)(c0 + j) * D + d) : _mm256_setzero_ps())

#define ATTN(NAME, KT, LOAD)                                                                         \
int NAME(const float *q, const KT *kc, const KT *vc, int64_t s_slot, int64_t s_head,                \
         const int32_t *lens, const int32_t *counts, const int32_t *first, const uint8_t *block,     \
         int n, int B, int hq, int hkv, int D, float scale, float *out) {                            \
    int g = hq / hkv, failed = 0;                                                                    \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                                 \
    for (int bh = 0; bh < B * hkv; bh++) {                                                           \
        int b = bh / hkv, h = bh % hkv, L = lens[b], c = counts[b], W = L + c, G = g * c;            \
        int WP = (W + BLK - 1) / BLK * BLK;                                                          \
        const KT *K = kc + b * s_slot + h * s_head, *V = vc + b * s_slot + h * s_head;              \
        float *sc = (float *)aligned_alloc(32, sizeof(float) * (size_t)G * (size_t)WP);              \
        if (!sc) { _Pragma("omp atomic write") failed = 1; continue; }  /* reported: see check()  */  \
        float kb[BLK * MAXD] __attribute__((aligned(32)));                                           \
        float inv[8 * 64];  /* 1 / softmax sum per query row (G <= 8 * 64) */                        \
        __m256 vmax[8 * 64];                                                                         \
        const __m256 ninf = _mm256_set1_ps(-INFINITY), vs = _mm256_set1_ps(scale);                   \
        for (int r = 0; r < G; r++) vmax[r] = ninf;                                                  \
        /* scores, 8 columns at a time: K widened once for all G query rows (r = gi * c + t) */      \
        for (int c0 = 0; c0 < W; c0 += BLK) {                                                        \
            int nc = W - c0 < BLK ? W - c0 : BLK;                                                    \
            WIDEN(K, LOAD);                                                                             \
            int edge = c0 + BLK > L;  /* a block with new (tree-masked) or missing columns */        \
            for (int gi = 0; gi < g; gi++)                                                           \
                for (int t = 0; t < c; t++) {                                                        \
                    int r = gi * c + t;                                                              \
                    const float *qr = q + ((int64_t)(first[b] + t) * hq + h * g + gi) * D;           \
                    __m256 acc[BLK];                                                                 \
                    for (int j = 0; j < BLK; j++) acc[j] = _mm256_setzero_ps();                      \
                    for (int d = 0; d < D; d += 8) {                                                 \
                        __m256 qv = _mm256_loadu_ps(qr + d);                                         \
                        for (int j = 0; j < BLK; j++)                                                \
                            acc[j] = _mm256_fmadd_ps(qv, _mm256_load_ps(kb + j * D + d), acc[j]);    \
                    }                                                                                \
                    __m256 sv = _mm256_mul_ps(hsum8(acc), vs);                                       \
                    float *s = sc + (int64_t)r * WP + c0;                                            \
                    _mm256_storeu_ps(s, sv);                                                         \
                    if (edge) {                                                                      \
                        for (int j = 0; j < BLK; j++) {                                              \
                            int col = c0 + j;                                                        \
                            if (col >= W || (col >= L && !block[((int64_t)b * n + t) * n + (col - L)])) \
                                s[j] = -INFINITY;                                                    \
                        }                                                                            \
                        sv = _mm256_loadu_ps(s);                                                     \
                    }                                                                                \
                    vmax[r] = _mm256_max_ps(vmax[r], sv);                                            \
                }                                                                                    \
        }                                                                                            \
        /* exp(score - max) in place; masked columns (-inf) weigh exactly 0 */                       \
        for (int r = 0; r < G; r++) {                                                                \
            float buf[8], mx = -INFINITY, sum = 0.f;                                                 \
            _mm256_storeu_ps(buf, vmax[r]);                                                          \
            for (int j = 0; j < 8; j++) mx = buf[j] > mx ? buf[j] : mx;                              \
            __m256 m = _mm256_set1_ps(mx), tot = _mm256_setzero_ps();                                \
            float *s = sc + (int64_t)r * WP;                                                         \
            for (int j = 0; j < WP; j += 8) {                                                        \
                __m256 x = _mm256_load_ps(s + j);                                                    \
                __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), exp256(_mm256_sub_ps(x, m))); \
                _mm256_store_ps(s + j, e);                                                           \
                tot = _mm256_add_ps(tot, e);                                                         \
            }                                                                                        \
            _mm256_storeu_ps(buf, tot);                                                              \
            for (int j = 0; j < 8; j++) sum += buf[j];                                               \
            inv[r] = 1.0f / sum;                                                                     \
        }                                                                                            \
        /* out = P V / sum: V widened 8 columns at a time, 64 outputs of a query row in registers */ \
        for (int gi = 0; gi < g; gi++)                                                               \
            for (int t = 0; t < c; t++) {                                                            \
                float *o = out + ((int64_t)(first[b] + t) * hq + h * g + gi) * D;                    \
                for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());         \
            }                                                                                        \
        for (int c0 = 0; c0 < W; c0 += BLK) {                                                        \
            int nc = W - c0 < BLK ? W - c0 : BLK;                                                    \
            WIDEN(V, LOAD);                                                                             \
            for (int gi = 0; gi < g; gi++)                                                           \
                for (int t = 0; t < c; t++) {                                                        \
                    const float *p = sc + (int64_t)(gi * c + t) * WP + c0;                           \
                    float *o = out + ((int64_t)(first[b] + t) * hq + h * g + gi) * D;                \
                    for (int d0 = 0; d0 < D; d0 += 64) {                                             \
                        int dn = D - d0 < 64 ? D - d0 : 64;                                          \
                        __m256 acc[8];                                                               \
                        for (int k = 0; k < dn / 8; k++) acc[k] = _mm256_loadu_ps(o + d0 + 8 * k);   \
                        for (int j = 0; j < BLK; j++) {                                              \
                            __m256 pj = _mm256_broadcast_ss(p + j);                                  \
                            for (int k = 0; k < dn / 8; k++)                                         \
                                acc[k] = _mm256_fmadd_ps(pj, _mm256_load_ps(kb + j * D + d0 + 8 * k), acc[k]); \
                        }                                                                            \
                        for (int k = 0; k < dn / 8; k++) _mm256_storeu_ps(o + d0 + 8 * k, acc[k]);   \
                    }                                                                                \
                }                                                                                    \
        }                                                                                            \
        for (int gi = 0; gi < g; gi++)                                                               \
            for (int t = 0; t < c; t++) {                                                            \
                float *o = out + ((int64_t)(first[b] + t) * hq + h * g + gi) * D;                    \
                __m256 iv = _mm256_set1_ps(inv[gi * c + t]);                                         \
                for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), iv)); \
            }                                                                                        \
        free(sc);                                                                                    \
    }                                                                                                \
    return failed;                                                                                   \
}
ATTN(sf_attn_bf16, uint16_t, ld_bf16)
ATTN(sf_attn_f32, float, ld_f32)
"""

# the AVX-512 BF16 kernel (sf_attn_rows: decode_attention's one row, slot_attention's rows of a bf16
# cache): scores by vdpbf16ps (2 per column for D = 64) into 16 partial sums per column, the 16
# columns of a block reduced together by one transposed sum; fp32 softmax; P V in fp32 against V
# widened exactly; one (row, KV head, part of its query rows) per task. The layer kernel's AMX build scores
# against the transposed K on the tiles instead (amx_scores: forwards 1.00-1.02x faster at 100-300 columns,
# 1.02-1.04x at 800 on a 2-core Xeon, thirty-sixth session)
_SOURCE_DECODE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
static inline __m512 exp512(__m512 x) {  /* x <= 0 */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
""" + _exp_poly("_mm512", "__m512") + r"""
    return _mm512_scalef_ps(p, n);
}
static inline __m512 wid(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#define SF_ROWS_MAX 8  /* query rows per task */
static inline void scores_row(const __m512bh *qb, const uint16_t *Kh, int D, int c0, int nc, float scale, float *dst) {
    __m512 v[16];
    if (nc == 16) {
        const uint16_t *kr = Kh + (int64_t)c0 * D;
        _Pragma("GCC unroll 16") for (int j = 0; j < 16; j++) {
            __m512 a = _mm512_setzero_ps();
            for (int k = 0; k < D / 32; k++)
                a = _mm512_dpbf16_ps(a, qb[k], (__m512bh)_mm512_loadu_si512(kr + (int64_t)j * D + 32 * k));
            v[j] = a;
        }
    } else {
        for (int j = 0; j < 16; j++) {
            const uint16_t *kr = Kh + (int64_t)(c0 + (j < nc ? j : 0)) * D;
            __m512 a = _mm512_setzero_ps();
            for (int k = 0; k < D / 32; k++)
                a = _mm512_dpbf16_ps(a, qb[k], (__m512bh)_mm512_loadu_si512(kr + 32 * k));
            v[j] = a;
        }
    }
    __m512 t8[8], u[4];
    for (int j = 0; j < 8; j++)
        t8[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++)
        u[j] = _mm512_add_ps(_mm512_shuffle_ps(t8[2 * j], t8[2 * j + 1], 0x44), _mm512_shuffle_ps(t8[2 * j], t8[2 * j + 1], 0xEE));
    __m512 p0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    __m512 p1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(p0, p1, 0x88), _mm512_shuffle_f32x4(p0, p1, 0xDD));
    _mm512_store_ps(dst, _mm512_mul_ps(s, _mm512_set1_ps(scale)));
}
/* P rows' scores of one 16-column block of K stored transposed (Kb: [D/2 pairs][16 columns][2] bf16,
   see sf_attn_rows): per pair of dimensions one K vector serves every row, each row's query pair is
   broadcast, two sums per row (even and odd pairs, added at the end): no per-column reduction.
   qp: the rows' queries as bf16 pairs, row r at qp + r * 128. Each column's sum runs in the same order
   whatever P, so a row's scores are the same bits in any grouping. */
#define SCORES_T(P)                                                                                  \
static inline void scores_t##P(const uint32_t *qp, int D, const uint16_t *Kb, float scale, float *sc, int64_t WP, int c0) { \
    __m512 a0[P], a1[P];                                                                             \
    _Pragma("GCC unroll 8") for (int r = 0; r < P; r++) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); } \
    for (int k = 0; k < D / 2; k += 2) {                                                             \
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(Kb + (int64_t)k * 32);                            \
        __m512bh k1 = (__m512bh)_mm512_loadu_si512(Kb + (int64_t)k * 32 + 32);                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < P; r++) {                                        \
            a0[r] = _mm512_dpbf16_ps(a0[r], (__m512bh)_mm512_set1_epi32((int)qp[r * 128 + k]), k0);   \
            a1[r] = _mm512_dpbf16_ps(a1[r], (__m512bh)_mm512_set1_epi32((int)qp[r * 128 + k + 1]), k1); \
        }                                                                                            \
    }                                                                                                \
    _Pragma("GCC unroll 8") for (int r = 0; r < P; r++)                                              \
        _mm512_store_ps(sc + r * WP + c0, _mm512_mul_ps(_mm512_add_ps(a0[r], a1[r]), _mm512_set1_ps(scale))); \
}
SCORES_T(1) SCORES_T(2) SCORES_T(3) SCORES_T(4) SCORES_T(5) SCORES_T(6) SCORES_T(7) SCORES_T(8)

/* column c of one head's K row-major ([cap][D]) into its transposed copy Kt ([cap/16][D/2][16][2]) */
static inline void kt_column(const uint16_t *K, uint16_t *Kt, int c, int D) {
    const uint32_t *src = (const uint32_t *)(K + (int64_t)c * D);
    uint32_t *dst = (uint32_t *)(Kt + (int64_t)(c / 16) * 16 * D) + c % 16;
    for (int k = 0; k < D / 2; k++) dst[k * 16] = src[k];
}

/* sum_col p[r][col] * V[col] for G rows at once (KD = D / 16 vectors per V row); columns with p == 0 skipped per row */
#define PV_GROUP(G, KD)                                                                              \
static void pv##G##_##KD(float *const *sp, const uint16_t *Vh, int W, const float *inv, float *const *o) { \
    __m512 acc[G][KD];                                                                               \
    _Pragma("GCC unroll 16") for (int r = 0; r < G; r++)                                             \
        _Pragma("GCC unroll 16") for (int k = 0; k < KD; k++) acc[r][k] = _mm512_setzero_ps();       \
    for (int col = 0; col < W; col++) {                                                              \
        const uint16_t *vr = Vh + (int64_t)col * KD * 16;                                            \
        __m512 v[KD];                                                                                \
        _Pragma("GCC unroll 16") for (int k = 0; k < KD; k++) v[k] = wid(_mm256_loadu_si256((const __m256i *)(vr + 16 * k))); \
        _Pragma("GCC unroll 16") for (int r = 0; r < G; r++) {                                       \
            float p = sp[r][col];                                                                    \
            if (p == 0.0f) continue;                                                                 \
            __m512 pv = _mm512_set1_ps(p);                                                           \
            _Pragma("GCC unroll 16") for (int k = 0; k < KD; k++) acc[r][k] = _mm512_fmadd_ps(pv, v[k], acc[r][k]); \
        }                                                                                            \
    }                                                                                                \
    _Pragma("GCC unroll 16") for (int r = 0; r < G; r++) {                                           \
        __m512 iv = _mm512_set1_ps(inv[r]);                                                          \
        _Pragma("GCC unroll 16") for (int k = 0; k < KD; k++) _mm512_storeu_ps(o[r] + 16 * k, _mm512_mul_ps(acc[r][k], iv)); \
    }                                                                                                \
}
PV_GROUP(4, 4) PV_GROUP(2, 4) PV_GROUP(2, 8) PV_GROUP(1, 4) PV_GROUP(1, 8)
static void pv_one(const float *sp, const uint16_t *Vh, int W, int D, float inv, float *o) {
    __m512 acc[16];
    for (int k = 0; k < D / 16; k++) acc[k] = _mm512_setzero_ps();
    for (int col = 0; col < W; col++) {
        float p = sp[col];
        if (p == 0.0f) continue;
        __m512 pv = _mm512_set1_ps(p);
        const uint16_t *vr = Vh + (int64_t)col * D;
        for (int k = 0; k < D / 16; k++)
            acc[k] = _mm512_fmadd_ps(pv, wid(_mm256_loadu_si256((const __m256i *)(vr + 16 * k))), acc[k]);
    }
    __m512 iv = _mm512_set1_ps(inv);
    for (int k = 0; k < D / 16; k++) _mm512_storeu_ps(o + 16 * k, _mm512_mul_ps(acc[k], iv));
}

#ifdef SF_AMX
/* the transposed scores of P rows (scores_tP's inputs) on the AMX tiles, for the AMX build's own steps
   (thirty-sixth session): per 16-column block one tile product per 32 dimensions (A: the P rows' query
   pairs, B: the block's K pairs as stored, C: P x 16 fp32 sums) where scores_tP takes P * D / 16
   vdpbf16ps; scaled after. Each row's sums are the tile unit's in one fixed order whatever P and the
   block's place, so a token's scores are the same bits in a plain step and in a verification; they
   differ in their last bits from scores_tP's, which the AMX build never mixes with (the engine runs
   every step of a model on one build). */
static void amx_scores(const uint32_t *qp, int P, int D, const uint16_t *Kt, int W, float scale, float *sc, int64_t WP) {
    sf_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = P; c.colsb[0] = 64;   /* C: P rows x 16 columns (fp32) */
    c.rows[1] = P; c.colsb[1] = 64;   /* A: P rows x 16 query pairs */
    c.rows[2] = 16; c.colsb[2] = 64;  /* B: 16 K pairs x 16 columns */
    _tile_loadconfig(&c);
    for (int c0 = 0; c0 < W; c0 += 16) {
        const uint16_t *Kb = Kt + (int64_t)c0 * D;
        _tile_zero(0);
        for (int k = 0; k < D / 32; k++) {
            _tile_loadd(1, qp + 16 * k, 512);  /* row r at qp + r * 128 pairs */
            _tile_loadd(2, Kb + (int64_t)k * 512, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, sc + c0, (int)(WP * 4));
    }
    _tile_release();
    __m512 sv = _mm512_set1_ps(scale);
    for (int r = 0; r < P; r++)
        for (int64_t j = 0; j < WP; j += 16)
            _mm512_store_ps(sc + r * WP + j, _mm512_mul_ps(_mm512_load_ps(sc + r * WP + j), sv));
}
#endif

/* rows b < B of a slot cache, each over its own columns: q fp32 [T][hq][D] (row b's counts[b] tokens
   from flat index first[b]); K, V bf16 [slot][hkv][cap][D] (strides s_slot, s_head elements); row b
   sees columns 0..lens[b]-1 and, among its new columns lens[b]+j, those where block[b][t][j] (uint8
   [B][nb][nb]; NULL = causal); out fp32 [T][hq][D]. D % 32 == 0, D <= 256. bw > 0 (one row, a drafting
   head's tree): the block [n][bw] covers the last bw columns (the new ones and earlier drafts), nb == bw.
   One task per (row b, kv head h, part of the g * counts[b] query rows that share that kv head): the
   part's rows score each 16-column chunk of K while it is in L1, and their P V sums run together (one
   widened V row feeds up to 4 rows at D = 64, 2 at D = 128: independent sums, not one latency-bound
   chain). Each query row's sums run in the same order whatever the grouping, so a token's output is
   the same bits in any step (measured 1.2-1.5x the one-task-per-query-head version at 1-8 tokens,
   400-1000 columns: docs/results.md, twenty-fourth session). Ktc (one sequence, B == 1; else NULL): the
   same K also stored transposed per 16-column block, [hkv][cap/16][D/2][16][2] (head stride t_head
   elements, every block of the W columns present): the scores then take one K vector per pair of
   dimensions for all of a task's rows and need no per-column reduction (2x faster scores at 3-5 rows
   over 700-1500 columns, docs/results.md, twenty-eighth session). */
static int attn_rows(const float *q, const uint16_t *Kc, const uint16_t *Vc, int64_t s_slot, int64_t s_head,
                     const int32_t *lens, const int32_t *counts, const int32_t *first, const uint8_t *blk, int nb,
                     int B, int hq, int hkv, int D, float scale, float *out, int bw, const uint16_t *Ktc, int64_t t_head,
                     int amx) {
    int g = hq / hkv, failed = 0, rmax = 0;
    for (int b = 0; b < B; b++) rmax = g * counts[b] > rmax ? g * counts[b] : rmax;
    int np = (rmax + SF_ROWS_MAX - 1) / SF_ROWS_MAX, want = 2 * omp_get_max_threads();
    /* few tasks (one sequence, several threads): smaller parts, at least two tasks per thread */
    if (B * hkv * np < want) np = (want + B * hkv - 1) / (B * hkv);
    if (np > rmax) np = rmax;
    if (np < 1) np = 1;
    int ps = (rmax + np - 1) / np;
    _Pragma("omp parallel for schedule(dynamic, 1)")
    for (int task = 0; task < B * hkv * np; task++) {
        /* the last parts first: in a causal prefill they see the most columns (dynamic schedule) */
        int b = task / (hkv * np), h = task / np % hkv, part = np - 1 - task % np;
        int n = counts[b], R = g * n, r0 = part * ps, r1 = r0 + ps < R ? r0 + ps : R;
        if (r0 >= r1) continue;
        int P = r1 - r0, W = lens[b] + n, WP = (W + 15) / 16 * 16;
        int L = bw ? W - bw : lens[b];
        /* causal (no block): the part's rows see no column past its last token's (Wt), and columns before
           its first token's own (Lm) need no mask; masked columns weigh exactly 0, so skipping them leaves
           every sum's bits as they were */
        int Wt = blk ? W : L + (r1 - 1) / g + 1, WPt = (Wt + 15) / 16 * 16, Lm = blk ? L : L + r0 / g + 1;
        const uint16_t *Kh = Kc + b * s_slot + h * s_head, *Vh = Vc + b * s_slot + h * s_head;
        const uint8_t *block = blk ? blk + (int64_t)b * nb * nb : 0;
        const float *qb0 = q + (int64_t)first[b] * hq * D;
        float *ob0 = out + (int64_t)first[b] * hq * D;
        int TL = (16 + W - L + 15) / 16 * 16;  /* the softmax sum's tail, in a plain step's order (below) */
        float *sc = (float *)aligned_alloc(64, sizeof(float) * ((size_t)P * WP + TL));
        if (!sc) { _Pragma("omp atomic write") failed = 1; continue; }
        int tt[SF_ROWS_MAX], hh[SF_ROWS_MAX];
        __m512bh qb[SF_ROWS_MAX][8];  /* each row's query as bf16 pairs, converted once */
        uint32_t qpair[SF_ROWS_MAX][128];  /* the same pairs in memory, broadcast one by one (Ktc) */
        for (int r = 0; r < P; r++) {
            tt[r] = (r0 + r) / g; hh[r] = h * g + (r0 + r) % g;
            const float *qr = qb0 + ((int64_t)tt[r] * hq + hh[r]) * D;
            for (int k = 0; k < D / 32; k++)
                qb[r][k] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qr + 32 * k + 16), _mm512_loadu_ps(qr + 32 * k));
            if (Ktc) for (int k = 0; k < D / 32; k++) _mm512_storeu_si512(qpair[r] + 16 * k, (__m512i)qb[r][k]);
        }
#ifdef SF_AMX
        int tiles = Ktc && amx;
        if (tiles) amx_scores(qpair[0], P, D, Ktc + h * t_head, Wt, scale, sc, WP);
#else
        int tiles = 0;
        (void)amx;
#endif
        for (int c0 = 0; c0 < Wt; c0 += 16) {
            int nc = Wt - c0 < 16 ? Wt - c0 : 16;
            if (Ktc && !tiles) {  /* columns past W in the last block are masked below */
                const uint16_t *Kb = Ktc + h * t_head + (int64_t)c0 * D;
                switch (P) {
                case 1: scores_t1(qpair[0], D, Kb, scale, sc, WP, c0); break;
                case 2: scores_t2(qpair[0], D, Kb, scale, sc, WP, c0); break;
                case 3: scores_t3(qpair[0], D, Kb, scale, sc, WP, c0); break;
                case 4: scores_t4(qpair[0], D, Kb, scale, sc, WP, c0); break;
                case 5: scores_t5(qpair[0], D, Kb, scale, sc, WP, c0); break;
                case 6: scores_t6(qpair[0], D, Kb, scale, sc, WP, c0); break;
                case 7: scores_t7(qpair[0], D, Kb, scale, sc, WP, c0); break;
                default: scores_t8(qpair[0], D, Kb, scale, sc, WP, c0);
                }
            }
            for (int r = 0; r < P; r++) {
                float *sp = sc + (int64_t)r * WP;
                if (!Ktc) scores_row(qb[r], Kh, D, c0, nc, scale, sp + c0);
                if (c0 + 16 > Lm)
                    for (int j = 0; j < 16; j++) {
                        int col = c0 + j, t = tt[r];
                        if (col >= W || (col >= L && !(block ? block[t * nb + (col - L)] : (col - L) <= t))) sp[c0 + j] = -INFINITY;
                    }
            }
        }
        float inv[SF_ROWS_MAX], *sps[SF_ROWS_MAX], *os[SF_ROWS_MAX];
        for (int r = 0; r < P; r++) {
            float *sp = sc + (int64_t)r * WP;
            __m512 m = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < WPt; j += 16) m = _mm512_max_ps(m, _mm512_load_ps(sp + j));
            float mx = _mm512_reduce_max_ps(m);
            __m512 mv = _mm512_set1_ps(mx), tot = _mm512_setzero_ps(), ninf = _mm512_set1_ps(-INFINITY);
            int Lb = L / 16 * 16, t = tt[r], k = 0;
            for (int j = 0; j < WPt; j += 16) {
                __m512 x = _mm512_load_ps(sp + j);
                __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
                __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(x, mv)));
                _mm512_store_ps(sp + j, e);
                if (j < Lb || !block) tot = _mm512_add_ps(tot, e);
            }
            /* the rest of the sum over the columns a plain step at this token's position sees, in its
               lanes and order: the prefix's last partial block, then the visible new columns (a tree's
               ancestors and the node itself) moved next to it, as the commit will put them. So a tree
               node's sum (and P V, whose nonzero terms already run in that order) is a plain step's,
               bit for bit (an earlier kernel summed in cache order: a tree's bf16 near-ties). Causal (no
               block): those columns already lie in that order from Lb and the row's later ones are exact
               zeros, so the loop above has summed them as the gather would (a prefill's rows: no scalar
               pass over their columns). */
            if (block) {
                float *tl = sc + (int64_t)P * WP;
                for (int c = Lb; c < L; c++) tl[k++] = sp[c];
                for (int c = L; c < Wt; c++)
                    if (block[t * nb + (c - L)]) tl[k++] = sp[c];
                for (; k % 16; k++) tl[k] = 0.0f;
                for (int j = 0; j < k; j += 16) tot = _mm512_add_ps(tot, _mm512_load_ps(tl + j));
            }
            inv[r] = 1.0f / _mm512_reduce_add_ps(tot);
            sps[r] = sp;
            os[r] = ob0 + ((int64_t)tt[r] * hq + hh[r]) * D;
        }
        int r = 0;
        if (D == 64) {
            for (; r + 4 <= P; r += 4) pv4_4(sps + r, Vh, Wt, inv + r, os + r);
            for (; r + 2 <= P; r += 2) pv2_4(sps + r, Vh, Wt, inv + r, os + r);
            for (; r < P; r++) pv1_4(sps + r, Vh, Wt, inv + r, os + r);
        } else if (D == 128) {
            for (; r + 2 <= P; r += 2) pv2_8(sps + r, Vh, Wt, inv + r, os + r);
            for (; r < P; r++) pv1_8(sps + r, Vh, Wt, inv + r, os + r);
        }
        for (; r < P; r++) pv_one(sps[r], Vh, Wt, D, inv[r], os[r]);
        free(sc);
    }
    return failed;
}
int sf_attn_rows(const float *q, const uint16_t *Kc, const uint16_t *Vc, int64_t s_slot, int64_t s_head,
                  const int32_t *lens, const int32_t *counts, const int32_t *first, const uint8_t *blk, int nb,
                  int B, int hq, int hkv, int D, float scale, float *out, int bw) {
    return attn_rows(q, Kc, Vc, s_slot, s_head, lens, counts, first, blk, nb, B, hq, hkv, D, scale, out, bw, 0, 0, 0);
}
/* a causal prefill of one sequence: n tokens whose K/V are written at past (q fp32 [n][hq][D], K and V
   [hkv][cap][D] with head stride s_head), token t seeing columns 0 .. past + t. K is first copied transposed
   per 16-column block into a work buffer (zeros past the last column), so the scores take one K vector per
   pair of dimensions for all of a part's rows (scores_tP), and each part scores only up to its last
   token's column: the triangle, not the square. */
int sf_attn_causal(const float *q, const uint16_t *Kc, const uint16_t *Vc, int64_t s_head, int past, int n,
                   int hq, int hkv, int D, float scale, float *out) {
    int W = past + n, nb16 = (W + 15) / 16;
    int64_t t_head = (int64_t)nb16 * 16 * D;
    uint16_t *Kt = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)(hkv * t_head));
    if (!Kt) return 1;
    _Pragma("omp parallel for collapse(2) if (W * hkv > 512)")
    for (int h = 0; h < hkv; h++)
        for (int b16 = 0; b16 < nb16; b16++) {
            for (int c = 16 * b16; c < 16 * b16 + 16 && c < W; c++) kt_column(Kc + h * s_head, Kt + h * t_head, c, D);
            if (16 * b16 + 16 > W) {
                uint32_t *dst = (uint32_t *)(Kt + h * t_head + (int64_t)b16 * 16 * D);
                for (int k = 0; k < D / 2; k++)
                    for (int j = W - 16 * b16; j < 16; j++) dst[k * 16 + j] = 0;
            }
        }
    int lens = past, counts = n, first = 0;
    int failed = attn_rows(q, Kc, Vc, 0, s_head, &lens, &counts, &first, 0, n, 1, hq, hkv, D, scale, out, 0, Kt, t_head, 0);
    free(Kt);
    return failed;
}
"""

#: most new tokens per sequence :func:`decode_attention` takes (decode steps, drafts, small trees;
#: a prefill runs :func:`prefill_attention`)
DECODE_MAX_TOKENS = 16

MAX_HEAD_DIM = 256
MAX_QUERY_ROWS = 8 * 64  # g * tokens of one row: the kernel's per-(row, head) buffers (inv, vmax)


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    args = [p, p, p, i64, i64, p, p, p, p, i32, i32, i32, i32, i32, ctypes.c_float, p]
    return _returning_int(build("sfattn", _SOURCE, {"sf_attn_bf16": args, "sf_attn_f32": args}),
                          "sf_attn_bf16", "sf_attn_f32")


@functools.lru_cache(maxsize=1)
def _load_decode() -> tuple[ctypes.CDLL | None, str | None]:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return _returning_int(build("sfattnrows", _SOURCE_DECODE,
                                {"sf_attn_rows": [p, p, p, i64, i64, p, p, p, p, i32, i32, i32, i32, i32, ctypes.c_float, p, i32],
                                 "sf_attn_causal": [p, p, p, i64, i32, i32, i32, i32, i32, ctypes.c_float, p]},
                                isa=AVX512_BF16), "sf_attn_rows", "sf_attn_causal")


def _returning_int(built: tuple, *names: str) -> tuple:
    """Declare ``names`` of a built library as returning the kernels' status (0, or 1 when a work
    buffer could not be allocated: see :func:`check`)."""
    if built[0] is not None:
        for name in names:
            getattr(built[0], name).restype = ctypes.c_int
    return built


def check(status: int) -> None:
    """Raise on a kernel's non-zero status: its per-task work buffer (scores of the row's query rows
    over its columns) could not be allocated, and the tasks that lacked one were skipped."""
    if status:
        raise MemoryError("the attention kernel could not allocate its score buffer")


def decode_supports(layer_kv: torch.Tensor, batch: int, n: int) -> bool:
    """Whether :func:`decode_attention` runs a step of ``n`` new tokens on this ``[2, B, hkv,
    capacity, D]`` cache layer: one sequence, bf16 on CPU, D a multiple of 32 (<= 256), at most
    :data:`DECODE_MAX_TOKENS` tokens, and the kernel built here."""
    return 1 <= n <= DECODE_MAX_TOKENS and _one_bf16_sequence(layer_kv, batch)


def _one_bf16_sequence(layer_kv: torch.Tensor, batch: int) -> bool:
    """What the one-sequence kernels need of a ``[2, B, hkv, capacity, D]`` cache layer: one sequence,
    bf16 on CPU, D a multiple of 32 (<= 256), columns contiguous, and the kernels built here."""
    D = layer_kv.shape[-1]
    return (batch == 1 and layer_kv.device.type == "cpu" and layer_kv.dtype == torch.bfloat16 and D % 32 == 0
            and D <= MAX_HEAD_DIM and layer_kv.stride(-1) == 1 and layer_kv.stride(-2) == D
            and _load_decode()[0] is not None)


def decode_attention(layer_kv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int,
                     block: torch.Tensor | None, scale: float) -> torch.Tensor:
    """:func:`..kvcache.attend` for one sequence on a bf16 cache (:func:`decode_supports`): writes
    ``k``/``v`` ``[1, n, hkv, D]`` at ``past``, attends ``q`` ``[1, n, hq, D]`` over the first
    ``past`` columns and, among the new ones, what ``block`` ``[1, n, n]`` allows (None: causal).
    Each query row is computed alone (its own scores, softmax and sum; masked columns weigh exactly
    0, the softmax sum runs over the visible columns in a plain step's order), so a chain's token or a
    tree's node gets the same bits as when it is decoded alone after the commit (tested);
    equal to SDPA within bf16 rounding, measured closer to float64 than SDPA's."""
    n, hq, D = q.shape[1], q.shape[2], q.shape[3]
    qf, out, keys, values = _one_sequence_step(layer_kv, q, k, v, past)
    b8 = None if block is None or n == 1 else block.reshape(n, n).to(torch.uint8).contiguous()
    i32 = [ctypes.c_int32(v) for v in (past, n, 0)]
    check(_load_decode()[0].sf_attn_rows(qf.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0),
                                         keys.stride(1), *(ctypes.addressof(v) for v in i32),
                                         None if b8 is None else b8.data_ptr(), n, 1, hq, keys.shape[1], D,
                                         float(scale), out.data_ptr(), 0))
    return out.view(1, n, hq * D).to(layer_kv.dtype)


def _one_sequence_step(layer_kv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int):
    """The one-sequence kernels' inputs: ``k``/``v`` ``[1, n, hkv, D]`` written at ``past``; the queries
    as fp32 ``[n, hq, D]``, an fp32 output of that shape, and the layer's K and V."""
    n = q.shape[1]
    layer_kv[0, 0, :, past: past + n].copy_(k[0].transpose(0, 1))
    layer_kv[1, 0, :, past: past + n].copy_(v[0].transpose(0, 1))
    qf = q[0].to(torch.float32).contiguous()
    return qf, torch.empty(qf.shape, dtype=torch.float32), layer_kv[0], layer_kv[1]


def prefill_supports(layer_kv: torch.Tensor, batch: int, n: int) -> bool:
    """Whether :func:`prefill_attention` runs a causal step of ``n`` tokens on this cache layer: what
    :func:`decode_supports` asks, for any number of tokens."""
    return n >= 1 and _one_bf16_sequence(layer_kv, batch)


def prefill_attention(layer_kv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int,
                      scale: float) -> torch.Tensor:
    """A prompt's prefill of one sequence on the decode kernel (:func:`prefill_supports`): writes ``k``/``v``
    ``[1, n, hkv, D]`` at ``past`` and attends ``q`` ``[1, n, hq, D]`` causally (token ``t`` over columns
    ``0 .. past + t``). Each part of the query rows scores only up to its last token's column, against K
    transposed per 16-column block in a work buffer: the causal triangle, 2.2-2.5x SDPA's flash attention
    on a Zen 4 EPYC at 200-700 tokens (docs/results.md, fifty-second session). Numerics are
    :func:`decode_attention`'s (fp32 scores of bf16 inputs, fp32 softmax and sums); a row's output does
    not depend on how many tokens share the call."""
    n, hq, D = q.shape[1], q.shape[2], q.shape[3]
    qf, out, keys, values = _one_sequence_step(layer_kv, q, k, v, past)
    check(_load_decode()[0].sf_attn_causal(qf.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(1), past,
                                           n, hq, keys.shape[1], D, float(scale), out.data_ptr()))
    return out.view(1, n, hq * D).to(layer_kv.dtype)


def unavailable_reason() -> str | None:
    """None when the kernel can run here, else why not."""
    return _load()[1]


def available() -> bool:
    return _load()[0] is not None


def supports(cache_layer: torch.Tensor) -> bool:
    """Whether :func:`slot_attention` takes this ``[2, slots, hkv, capacity, D]`` cache layer."""
    D = cache_layer.shape[-1]
    return (cache_layer.device.type == "cpu" and cache_layer.dtype in (torch.bfloat16, torch.float32)
            and D % 8 == 0 and D <= MAX_HEAD_DIM and cache_layer.stride(-1) == 1 and cache_layer.stride(-2) == D)


def rows_kernel(cache_layer: torch.Tensor) -> bool:
    """Whether :func:`slot_attention` runs this cache layer on the AVX-512 BF16 kernel (a bf16 cache,
    ``D % 32 == 0``, a CPU with avx512_bf16) rather than the AVX2 one."""
    return cache_layer.dtype == torch.bfloat16 and cache_layer.shape[-1] % 32 == 0 and _load_decode()[0] is not None


def slot_attention(q: torch.Tensor, layer: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor,
                   first: torch.Tensor, block: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the step's real tokens ``q`` ``[T, hq, D]`` over one cache layer ``[2, slots,
    hkv, capacity, D]`` (K/V of the new tokens already written after each row's ``lengths[b]``):
    row ``b`` has ``counts[b]`` tokens from flat index ``first[b]`` (int32 ``[B]`` tensors), and
    ``block`` ``[B, n, n]`` (bool) says which of the row's new columns each of its tokens sees.
    Returns ``[T, hq*D]`` in the cache's dtype (see the module doc). A bf16 cache with ``D % 32 == 0``
    runs on the AVX-512 BF16 kernel where the CPU has it (:func:`decode_attention`'s, per row)."""
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(f"the attention kernel is unavailable: {unavailable_reason()}")
    if not supports(layer):
        raise ValueError(f"the attention kernel takes a CPU bf16/fp32 cache with head_dim % 8 == 0 and <= "
                         f"{MAX_HEAD_DIM}, got {layer.dtype} {tuple(layer.shape)}")
    T, hq, D = q.shape
    B, n = block.shape[0], block.shape[-1]
    hkv = layer.shape[2]
    if (hq // hkv) * n > MAX_QUERY_ROWS:
        raise ValueError(f"{hq // hkv} query heads per KV head x {n} tokens per row exceed the kernel's "
                         f"{MAX_QUERY_ROWS} query rows")
    qf = q.to(torch.float32).contiguous()
    out = torch.empty(T, hq, D, dtype=torch.float32)
    blk = block.to(torch.uint8).contiguous()
    keys, values = layer[0], layer[1]
    fn = lib.sf_attn_bf16 if layer.dtype == torch.bfloat16 else lib.sf_attn_f32
    extra = ()
    if rows_kernel(layer):  # the AVX-512 BF16 kernel: the same arguments (see decode_attention) and bw = 0
        fn, extra = _load_decode()[0].sf_attn_rows, (0,)
    args = [qf.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1), lengths.data_ptr(),
            counts.data_ptr(), first.data_ptr(), blk.data_ptr(), n, B, hq, hkv, D, float(scale), out.data_ptr()]
    check(fn(*args, *extra))
    return out.view(T, hq * D).to(layer.dtype)
