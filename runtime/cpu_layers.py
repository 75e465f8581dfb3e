"""One sequence's decoder layers in one C call (AVX-512 BF16): the engine's decode and small
verification steps, the EAGLE heads' drafting layer, and an EAGLE-3 head's whole proposal
(:func:`eagle3_draft`: the accepted pairs' feature fusion and layer pass, then a chain or EAGLE-2's
greedy tree, drafted without returning to Python; twenty-fourth session).

Scope: Llama-family layers (RMSNorm, fused Q/K/V with an optional bias, rotate-half RoPE, grouped-
query attention over a static cache, SiLU-gated MLP) for 1-:data:`MAX_TOKENS` new tokens of one
sequence, bf16 weights (a speculator head's may be int8, :func:`.cpu_gemv.gemv_q8`: the layer table
says which), activations and cache, on CPUs with ``avx512_bf16``. The matrix products
and the attention are the kernels the engine already runs one by one (:mod:`.cpu_gemv`'s few-row
product, :mod:`.cpu_attention`'s ``sf_attn_rows``; the AMX build scores the attention on the tiles
instead, ``amx_scores``, for every step alike); this module only runs a whole forward's layers
without returning to Python between them.

Why: a decode step of SmolLM2-135M ran ~4,700 PyTorch ops (30 layers x norms, RoPE, casts, slices,
residual adds), ~3-4 ms of a ~13 ms step at one thread on a 2-core AMD EPYC, paid again by every
verification and every head step (docs/results.md, twenty-third session). Here the glue between the
kernels is a few vector loops per layer.

Numerics: the same roundings as the PyTorch path, op for op: bf16 after the norm's fp32 scaling and
again after its weight, after each RoPE product and their sum, after each residual add, after SiLU
and after the gate product; Q widened exactly for the attention, its fp32 output rounded once.
Two reductions are not in PyTorch's order (the norm's sum of squares, and SiLU's exponential is
our polynomial), so a value can differ in its last bf16 bit from the op-by-op path; the engine's
HF parity bound covers it and every step of one sequence (plain or verification) takes this path
alike, so greedy speculation stays equal to plain decoding.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cpu_attention, cpu_gemv, cpu_verify
from .native import AMX_BF16, AVX512_BF16, build, ptr

__all__ = ["MAX_TOKENS", "MAX_TOKENS_AMX", "argmax", "available", "eagle3_draft", "layer_table", "log_softmax",
           "prefill_attention", "rms_norm", "run_layers", "silu_mul", "supports", "unavailable_reason"]

#: most new tokens per call: the few-row product's one pass (more go to the many-row kernel)
MAX_TOKENS = cpu_gemv.MAX_ROWS
#: most new tokens per call on the AMX products (the engine's verification of a larger tree, a short prompt)
MAX_TOKENS_AMX = cpu_gemv.AMX_ROWS

_LAYER = r"""
/* the target's products: on the AMX tiles (weights from cpu_gemv.amx_pack) where the library is built
   with them and the caller asks (amx), else the AVX-512 BF16 kernel */
#ifdef SF_AMX
#define TGEMV(amx, x, w, b, y, n, in, out, keep) \
    do { if (amx) sf_gemv_amx(x, w, b, y, n, in, out, 0); else sf_gemv_dpbf16(x, w, b, y, n, in, out, keep); } while (0)
#else
#define TGEMV(amx, x, w, b, y, n, in, out, keep) sf_gemv_dpbf16(x, w, b, y, n, in, out, keep)
#endif
/* every product here: int8 weights (q8, a speculator head's: cpu_gemv's sf_gemv_q8) or TGEMV's; 0, or 1
   when the int8 product's work buffer could not be allocated */
static inline int lgemv(int q8, int amx, const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int n,
                        int in, int out, int keep) {
    if (q8) return sf_gemv_q8(x, (const uint8_t *)w, b, y, n, in, out, keep);
    TGEMV(amx, x, w, b, y, n, in, out, keep);
    return 0;
}
static inline __m512 ld16(const uint16_t *p) { return wid(_mm256_loadu_si256((const __m256i *)p)); }
static inline void st16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }
static inline __m512 rnd(__m512 v) { return wid((__m256i)_mm512_cvtneps_pbh(v)); }  /* to bf16 and back */

/* y = w * bf16(x * rsqrt(mean(x^2) + eps)), n rows of H (H % 16 == 0) */
static void norm_rows(const uint16_t *x, const uint16_t *w, uint16_t *y, int n, int H, float eps) {
    for (int t = 0; t < n; t++) {
        const uint16_t *xr = x + (int64_t)t * H;
        uint16_t *yr = y + (int64_t)t * H;
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < H; i += 16) { __m512 v = ld16(xr + i); acc = _mm512_fmadd_ps(v, v, acc); }
        __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / H + eps));
        for (int i = 0; i < H; i += 16) st16(yr + i, _mm512_mul_ps(ld16(w + i), rnd(_mm512_mul_ps(ld16(xr + i), r))));
    }
}

/* the same norm for callers in Python: bf16 [n, H] rows, row r scaled by weight r % nw ([nw, H]: an
   EAGLE-3 head's one norm per feature layer over features [.., nw, H]) */
void sf_rms_norm(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t n, int H, float eps, int nw) {
    for (int64_t r = 0; r < n; r++)
        norm_rows(x + r * H, w + (int64_t)(r % nw) * H, y + r * H, 1, H, eps);
}

/* first index of the largest value of each bf16 row [n, V] (a NaN counts as largest, as in torch) */
void sf_argmax_bf16(const uint16_t *x, int64_t n, int64_t V, int64_t *out) {
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = x + r * V;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i bidx = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        int64_t i = 0, at = -1;
        float m = -INFINITY;
        for (; i + 16 <= V; i += 16) {  /* per lane: its largest value and that value's first index */
            __m512 v = ld16(row + i);
            __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            if (nan) { at = i + __builtin_ctz(nan); break; }
            __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, gt, v);
            bidx = _mm512_mask_mov_epi32(bidx, gt, idx);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
        }
        if (at >= 0) { out[r] = at; continue; }
        if (i > 0) {  /* the lanes' largest, its lowest index (all -inf: index 0) */
            m = _mm512_reduce_max_ps(best);
            at = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ), bidx);
        }
        for (; i < V; i++) {  /* the last V % 16 */
            float v = from_bf16(row[i]);
            if (v != v) { at = i; break; }
            if (at < 0 || v > m) { m = v; at = i; }
        }
        out[r] = at;
    }
}

/* rotate-half RoPE of one head (D % 32 == 0) with bf16 roundings after each product and the sum */
static inline __m512 rope16(const uint16_t *h, const uint16_t *c, const uint16_t *s, int d, int D) {
    int half = D / 2;
    __m512 x = ld16(h + d);
    __m512 r = d < half ? _mm512_sub_ps(_mm512_setzero_ps(), ld16(h + d + half)) : ld16(h + d - half);
    return rnd(_mm512_add_ps(rnd(_mm512_mul_ps(x, ld16(c + d))), rnd(_mm512_mul_ps(r, ld16(s + d)))));
}

/* tokens t0..t1-1 (rows of the fused Q/K/V product qkv [n][(hq + 2 hkv) D] and of cos/sin [n][D]): Q with RoPE
   to fp32 qf [n][hq][D], K with RoPE written to the cache at column past + t (head h at K + h * s_head, [cap][D]
   rows), V copied there (V + h * s_head); rounded as PyTorch's bf16 ops round (rope16) */
static inline void rope_rows(const uint16_t *qkv, int t0, int t1, int hq, int hkv, int D, const uint16_t *cs,
                             const uint16_t *sn, float *qf, uint16_t *K, uint16_t *V, int64_t s_head, int past) {
    int64_t nqkv = (int64_t)(hq + 2 * hkv) * D;
    for (int t = t0; t < t1; t++) {
        const uint16_t *row = qkv + (int64_t)t * nqkv, *c = cs + (int64_t)t * D, *s = sn + (int64_t)t * D;
        for (int hh = 0; hh < hq; hh++)
            for (int d = 0; d < D; d += 16)
                _mm512_storeu_ps(qf + ((int64_t)t * hq + hh) * D + d, rope16(row + hh * D, c, s, d, D));
        for (int hh = 0; hh < hkv; hh++) {
            uint16_t *kr = K + hh * s_head + (int64_t)(past + t) * D, *vr = V + hh * s_head + (int64_t)(past + t) * D;
            for (int d = 0; d < D; d += 16) st16(kr + d, rope16(row + (hq + hh) * D, c, s, d, D));
            for (int d = 0; d < D; d++) vr[d] = row[(hq + hkv + hh) * D + d];
        }
    }
}

/* the MLP's m = bf16(silu(gate)) * up, rounded as PyTorch's two bf16 ops round: n rows of gu [gate I | up I] ->
   m [n, I] (I % 16 == 0) */
static inline void silu_mul_rows(const uint16_t *gu, uint16_t *m, int64_t n, int I) {
    for (int64_t t = 0; t < n; t++)
        for (int i = 0; i < I; i += 16) {
            __m512 g = ld16(gu + t * 2 * I + i), u = ld16(gu + t * 2 * I + I + i);
            __m512 ax = _mm512_abs_ps(g), e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), ax));  /* exp(-|g|) <= 1 */
            __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
            __m512 sig = _mm512_mask_mul_ps(inv, neg, inv, e);  /* sigmoid: 1/(1+e) or e/(1+e) */
            st16(m + t * I + i, _mm512_mul_ps(rnd(_mm512_mul_ps(g, sig)), u));
        }
}

/* the same for callers in Python (the engine's many-row steps: a prompt's prefill, a batch), rows split over
   the threads when there are many: gu [n][V = 2I] -> m [n][I] */
void sf_silu_mul(const uint16_t *gu, int64_t n, int64_t V, uint16_t *m) {
    int I = (int)(V / 2);
    _Pragma("omp parallel for if (n * I >= 16384)")
    for (int64_t t = 0; t < n; t++) silu_mul_rows(gu + t * V, m + t * I, 1, I);
}

/* a prompt's causal attention for callers in Python from the layer's fused Q/K/V product (see rope_rows; rows
   split over the threads when there are many), then sf_attn_causal over the cache; qf and of fp32 work buffers
   [n][hq][D]; out bf16 [n][hq D]. 0, or 1 when the attention's work buffer could not be allocated. */
int sf_prefill_attention(const uint16_t *qkv, int n, int hq, int hkv, int D, const uint16_t *cs, const uint16_t *sn,
                         uint16_t *K, uint16_t *V, int64_t s_head, int past, float scale, float *qf, float *of,
                         uint16_t *out) {
    _Pragma("omp parallel for if (n >= 32)")
    for (int t = 0; t < n; t++) rope_rows(qkv, t, t + 1, hq, hkv, D, cs, sn, qf, K, V, s_head, past);
    if (sf_attn_causal(qf, K, V, s_head, past, n, hq, hkv, D, scale, of)) return 1;
    _Pragma("omp parallel for if (n >= 32)")
    for (int64_t i = 0; i < (int64_t)n * hq * D; i += 16) st16(out + i, _mm512_loadu_ps(of + i));
    return 0;
}

/* n new tokens of one sequence through L layers. Weights per layer (wp[l * 8 + j]): input norm
   (0: xin is the attention input, l == 0 only), Wqkv [(hq + 2 hkv) D, in], its bias or 0, Wo [H, hq D],
   post-attention norm, Wgu [2I, H], Wdown [H, I], then 1 when the four matrices are int8 (sf_gemv_q8's
   layout), else 0. x [n, H] the residual stream (updated in place);
   cos/sin [n, D]; K of layer l, head h at kv + l * s_layer + h * s_head ([cap, D] rows), V s_kv
   further; the new tokens' entries written at past..past+n-1; blk [n][n] (uint8) which new
   columns each token sees, 0 = causal (bw > 0: blk [n][bw] over the last bw columns, earlier drafts
   of a head's tree included); feats [n][nf][H] gets x at the input of layer fl[f]. wb
   (bf16) and wf (fp32) are work buffers (sizes: run_layers). kt (or NULL): K also stored transposed per
   16-column block for the attention's scores (layer l, head h at kt + l * t_layer + h * t_head, see
   sf_attn_rows); its columns kt_from..past+n-1 are written here from K, the new ones included. 0, or 1
   when the attention's work buffer could not be allocated (the step is then void). */
int sf_layers(int n, int L, int H, int hq, int hkv, int D, int I, float eps, float scale, const int64_t *wp,
               const uint16_t *xin, int in_dim, uint16_t *x, const uint16_t *cs, const uint16_t *sn, uint16_t *kv,
               int64_t s_layer, int64_t s_kv, int64_t s_head, int past, const uint8_t *blk, const int32_t *fl,
               int nf, uint16_t *feats, uint16_t *wb, float *wf, int bw, int keep,
               uint16_t *kt, int64_t t_layer, int64_t t_head, int kt_from, int amx) {
    int nqkv = (hq + 2 * hkv) * D, wide = in_dim > H ? in_dim : H;
    uint16_t *h = wb, *qkv = h + (int64_t)n * wide, *ao = qkv + (int64_t)n * nqkv, *o = ao + (int64_t)n * hq * D;
    uint16_t *gu = o + (int64_t)n * H, *m = gu + (int64_t)n * 2 * I;
    float *qf = wf, *of = qf + (int64_t)n * hq * D;
    int32_t lens = past, counts = n, first = 0;
    for (int l = 0; l < L; l++) {
        const int64_t *p = wp + (int64_t)l * 8;
        int q8 = (int)p[7];
        for (int f = 0; f < nf; f++)
            if (fl[f] == l)
                for (int t = 0; t < n; t++)
                    for (int i = 0; i < H; i++) feats[((int64_t)t * nf + f) * H + i] = x[(int64_t)t * H + i];
        const uint16_t *ain = xin;
        int k_in = in_dim;
        if (p[0]) { norm_rows(x, (const uint16_t *)p[0], h, n, H, eps); ain = h; k_in = H; }
        if (lgemv(q8, amx, ain, (const uint16_t *)p[1], (const uint16_t *)p[2], qkv, n, k_in, nqkv, keep)) return 1;
        uint16_t *K = kv + l * s_layer, *V = K + s_kv;
        rope_rows(qkv, 0, n, hq, hkv, D, cs, sn, qf, K, V, s_head, past);
        uint16_t *Kt = kt ? kt + l * t_layer : 0;
        if (Kt) {  /* the columns not yet transposed: after a prompt's prefill many (split by head), then the few new */
            int cols = past + n - kt_from;
            _Pragma("omp parallel for if (cols * hkv > 512)")
            for (int hh = 0; hh < hkv; hh++)
                for (int c = kt_from; c < past + n; c++) kt_column(K + hh * s_head, Kt + hh * t_head, c, D);
        }
        if (attn_rows(qf, K, V, 0, s_head, &lens, &counts, &first, blk, bw ? bw : n, 1, hq, hkv, D, scale, of, bw,
                      Kt, t_head, amx))
            return 1;
        for (int64_t i = 0; i < (int64_t)n * hq * D; i += 16) st16(ao + i, _mm512_loadu_ps(of + i));
        if (lgemv(q8, amx, ao, (const uint16_t *)p[3], 0, o, n, hq * D, H, keep)) return 1;
        for (int64_t i = 0; i < (int64_t)n * H; i += 16) st16(x + i, _mm512_add_ps(ld16(x + i), ld16(o + i)));
        norm_rows(x, (const uint16_t *)p[4], h, n, H, eps);
        if (lgemv(q8, amx, h, (const uint16_t *)p[5], 0, gu, n, H, 2 * I, keep)) return 1;
        silu_mul_rows(gu, m, n, I);
        if (lgemv(q8, amx, m, (const uint16_t *)p[6], 0, o, n, I, H, keep)) return 1;
        for (int64_t i = 0; i < (int64_t)n * H; i += 16) st16(x + i, _mm512_add_ps(ld16(x + i), ld16(o + i)));
    }
    return 0;
}

/* log-probabilities of one bf16 row (fp32: x - max - log(sum exp(x - max))) */
static void log_softmax_row(const uint16_t *lg, int64_t V, float *out) {
    __m512 m = _mm512_set1_ps(-INFINITY), s = _mm512_setzero_ps();
    for (int64_t i = 0; i < V; i += 16) m = _mm512_mask_max_ps(m, tailmask(V, i), m, ldlog(lg, 1, i, tailmask(V, i)));
    __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    for (int64_t i = 0; i < V; i += 16)
        s = _mm512_add_ps(s, _mm512_maskz_mov_ps(tailmask(V, i), exp512(_mm512_sub_ps(ldlog(lg, 1, i, tailmask(V, i)), mv))));
    __m512 ls = _mm512_set1_ps(logf(_mm512_reduce_add_ps(s)));
    for (int64_t i = 0; i < V; i += 16)
        _mm512_mask_storeu_ps(out + i, tailmask(V, i), _mm512_sub_ps(_mm512_sub_ps(ldlog(lg, 1, i, tailmask(V, i)), mv), ls));
}

/* the drafting trees' log-probabilities for Python callers: n bf16 rows [n][V] -> fp32 */
void sf_log_softmax_bf16(const uint16_t *x, int64_t n, int64_t V, float *out) {
    for (int64_t r = 0; r < n; r++) log_softmax_row(x + r * V, V, out + r * V);
}

/* the k largest of x [V] in descending order, equal values by lowest index (k <= V) */
static void topk_row(const float *x, int64_t V, int k, int64_t *idx, float *val) {
    int cnt = 0;
    for (int64_t i = 0; i < V; i++) {
        float v = x[i];
        if (cnt == k && !(v > val[k - 1])) continue;
        int pos = cnt < k ? cnt : k - 1;
        while (pos > 0 && v > val[pos - 1]) { val[pos] = val[pos - 1]; idx[pos] = idx[pos - 1]; pos--; }
        val[pos] = v; idx[pos] = i;
        if (cnt < k) cnt++;
    }
}

static void sort_idx(int64_t *a, int n) {  /* ascending, n small */
    for (int i = 1; i < n; i++) { int64_t v = a[i]; int j = i; while (j > 0 && a[j - 1] > v) { a[j] = a[j - 1]; j--; } a[j] = v; }
}

/* EAGLE-2's greedy tree from the root's head output h (runtime/drafters/eagle.py _grow_greedy, the
   same steps): per depth the frontier's log-probabilities and each node's k best children, then the
   k best new nodes by cumulative score expanded by one layer step (each sees its ancestors among the
   drafts), finally the budget best nodes (ties: lowest index) in creation order. Writes tokens (target
   ids) and parents (0 = root, else the kept node number from 1) of the kept nodes, returns how many,
   or -1 (a failed allocation). Draft K/V are written at past.. on (left uncommitted). */
static int eagle3_tree(int depth, int k, int budget, const uint16_t *h, const int64_t *wp, const uint16_t *inw,
                       const uint16_t *hnw, const uint16_t *onw, const uint16_t *lmw, int Vd, const int64_t *d2t,
                       const uint16_t *emb, int H, int hq, int hkv, int D, int I, float eps, float scale, uint16_t *kv,
                       int64_t s_kv, int64_t s_head, int past, const uint16_t *cs, const uint16_t *sn, int64_t *tokens,
                       int64_t *parents, uint16_t *wb, float *wf, uint16_t *lb, int keep, int q8) {
    int M = k + (depth - 1) * k * k, Smax = (depth - 1) * k + 1;
    uint16_t *fh = lb, *xs = fh + (int64_t)k * H, *xin = xs + (int64_t)k * H, *hn = xin + (int64_t)k * 2 * H;
    uint16_t *lgt = hn + (int64_t)k * H, *csb = lgt + (int64_t)k * Vd, *snb = csb + (int64_t)k * D;
    float *lp = (float *)malloc(sizeof(float) * ((size_t)Vd + 2 * M)), *score = lp + Vd, *tv = score + M;  /* tv: up to M */
    int64_t *ctok = (int64_t *)malloc(sizeof(int64_t) * ((size_t)3 * M + 4 * k)), *cpar = ctok + M, *sel = cpar + M;
    int64_t *fidx = sel + M, *ti = fidx + k;
    uint8_t *frows = (uint8_t *)calloc((size_t)2 * k * Smax + (size_t)k * (Smax + k), 1), *nrows = frows + (size_t)k * Smax;
    uint8_t *blk = nrows + (size_t)k * Smax;
    int nkeep = -1;
    if (!lp || !ctok || !frows) goto done;
    float fscore[64];
    int m = 1, S = 0, nc = 0;
    int64_t nn = 1;
    for (int i = 0; i < H; i++) fh[i] = h[i];
    fidx[0] = 0; fscore[0] = 0.0f;
    for (int d = 1; d <= depth; d++) {
        norm_rows(fh, onw, hn, m, H, eps);
        if (lgemv(q8, 0, hn, lmw, 0, lgt, m, H, Vd, keep)) goto done;
        int first = nc;
        for (int r = 0; r < m; r++) {
            log_softmax_row(lgt + (int64_t)r * Vd, Vd, lp);
            topk_row(lp, Vd, k, ti, tv);
            for (int j = 0; j < k; j++) {
                ctok[nc] = d2t ? d2t[ti[j]] : ti[j];
                cpar[nc] = fidx[r];
                score[nc] = fscore[r] + tv[j];
                nc++;
            }
        }
        int64_t first_id = nn;
        nn += (int64_t)m * k;
        if (d == depth) break;
        int ne = k < m * k ? k : m * k;
        topk_row(score + first, (int64_t)m * k, ne, sel, tv);
        sort_idx(sel, ne);
        /* one layer step of the ne chosen nodes: (their parent's output, their token) at position d - 1 */
        for (int e = 0; e < ne; e++) {
            int r = (int)(sel[e] / k);
            for (int i = 0; i < H; i++) xs[(int64_t)e * H + i] = fh[(int64_t)r * H + i];
            norm_rows(emb + ctok[first + sel[e]] * H, inw, xin + (int64_t)e * 2 * H, 1, H, eps);
            norm_rows(fh + (int64_t)r * H, hnw, xin + (int64_t)e * 2 * H + H, 1, H, eps);
            for (int i = 0; i < D; i++) { csb[(int64_t)e * D + i] = cs[(int64_t)(d - 1) * D + i]; snb[(int64_t)e * D + i] = sn[(int64_t)(d - 1) * D + i]; }
            for (int c = 0; c < S; c++) nrows[(size_t)e * Smax + c] = frows[(size_t)r * Smax + c];
            for (int c = 0; c < ne; c++) nrows[(size_t)e * Smax + S + c] = c == e;
        }
        int W = S + ne;
        for (int e = 0; e < ne; e++) for (int c = 0; c < W; c++) blk[(size_t)e * W + c] = nrows[(size_t)e * Smax + c];
        if (sf_layers(ne, 1, H, hq, hkv, D, I, eps, scale, wp, xin, 2 * H, xs, csb, snb, kv, 0, s_kv, s_head, past + S,
                      ne == 1 && S == 0 ? 0 : blk, 0, 0, 0, wb, wf, S ? W : 0, keep, 0, 0, 0, 0, 0))
            goto done;
        for (int e = 0; e < ne; e++) {
            for (int i = 0; i < H; i++) fh[(int64_t)e * H + i] = xs[(int64_t)e * H + i];
            for (int c = 0; c < W; c++) frows[(size_t)e * Smax + c] = nrows[(size_t)e * Smax + c];
            fidx[e] = first_id + sel[e];
            fscore[e] = score[first + sel[e]];
        }
        S = W;
        m = ne;
    }
    nkeep = budget < nc ? budget : nc;
    topk_row(score, nc, nkeep, sel, tv);
    sort_idx(sel, nkeep);
    for (int i = 0; i < nkeep; i++) {  /* node numbers: candidate c is node c + 1; kept ones renumbered */
        tokens[i] = ctok[sel[i]];
        int64_t p = cpar[sel[i]], np = 0;
        for (int j = 0; j < i && p; j++) if (sel[j] + 1 == p) { np = j + 1; break; }
        parents[i] = np;
    }
done:
    free(lp); free(ctok); free(frows);
    return nkeep;
}

/* An EAGLE-3 head's drafting for one sequence (eagle3_draft below): first the n queued committed
   pairs (n may be 0): their raw target features [n][F][H] normed per feature layer (weights fnw
   [F][H]) and fused by fc (fcw [H][F*H]), then the decoder layer (table row wp; attention input
   cat(norm(embed(qid)), norm(fused)), residual the fused feature) causally at past..past+n-1, the
   last output the new root hidden h [H]; then a greedy chain of depth tokens from h: the output
   norm (onw), the draft-vocabulary logits (lmw [Vd][H]), their argmax mapped by d2t (NULL: the
   identity) into tokens[d], and for each but the last draft one layer step of (h, token) at the
   next position. cs/sn [n + max(depth - 1, 0)][D]: RoPE at past.. on. Each piece is the op the Python path
   runs (the same C norms and products), so the drafts are the same bits. wb/wf: sf_layers' work
   buffers for max(n, 1) rows; lb: bf16 work of n*F*H + n*H + max(n, 1)*2H + H + Vd. keep: the
   weights' reads without the prefetch ahead (off by default from Python: the target's stream between two
   drafts leaves the head's weights out of the caches).
   temp > 0: each draft is drawn (cpu_verify's draw, by the fp64 uniform uq[d]) from the draft
   distribution softmax(logits / temp), written to qout [depth][Vd] for the verifier; 2 when a
   row's scaled logits are not finite (nothing committed: the caller takes its PyTorch path).
   tk > 0: instead of a chain, EAGLE-2's greedy tree (eagle3_tree: top-k tk, at most budget nodes),
   its kept nodes' tokens and parents written, their count to nout. q8: fcw and lmw are int8 (sf_gemv_q8's
   layout; the layer's format is its table row's). */
int sf_eagle3_draft(int n, const uint16_t *feats, const int64_t *qids, int F, const uint16_t *fnw,
                    const uint16_t *fcw, int depth, const int64_t *wp, const uint16_t *inw, const uint16_t *hnw,
                    const uint16_t *onw, const uint16_t *lmw, int Vd, const int64_t *d2t, const uint16_t *emb,
                    int H, int hq, int hkv, int D, int I, float eps, float scale, uint16_t *kv, int64_t s_kv,
                    int64_t s_head, int past, const uint16_t *cs, const uint16_t *sn, uint16_t *h, int64_t *tokens,
                    uint16_t *wb, float *wf, uint16_t *lb, int keep, float temp, const double *uq, float *qout,
                    int tk, int budget, int64_t *parents, int *nout, int q8) {
    int rows = n > 0 ? n : 1;
    uint16_t *nfeat = lb, *x = nfeat + (int64_t)n * F * H, *xin = x + (int64_t)n * H;
    uint16_t *hn = xin + (int64_t)rows * 2 * H, *logits = hn + H;
    if (n > 0) {
        for (int64_t r = 0; r < (int64_t)n * F; r++) norm_rows(feats + r * H, fnw + (r % F) * H, nfeat + r * H, 1, H, eps);
        if (lgemv(q8, 0, nfeat, fcw, 0, x, n, F * H, H, keep)) return 1;
        for (int t = 0; t < n; t++) {
            norm_rows(emb + qids[t] * H, inw, xin + (int64_t)t * 2 * H, 1, H, eps);
            norm_rows(x + (int64_t)t * H, hnw, xin + (int64_t)t * 2 * H + H, 1, H, eps);
        }
        if (sf_layers(n, 1, H, hq, hkv, D, I, eps, scale, wp, xin, 2 * H, x, cs, sn, kv, 0, s_kv, s_head, past,
                      0, 0, 0, 0, wb, wf, 0, keep, 0, 0, 0, 0, 0))
            return 1;
        for (int i = 0; i < H; i++) h[i] = x[(int64_t)(n - 1) * H + i];
        past += n; cs += (int64_t)n * D; sn += (int64_t)n * D;
    }
    if (tk > 0 && depth > 0) {  /* a greedy tree (the queue's work buffers are reused) */
        *nout = eagle3_tree(depth, tk, budget, h, wp, inw, hnw, onw, lmw, Vd, d2t, emb, H, hq, hkv, D, I, eps, scale,
                            kv, s_kv, s_head, past, cs, sn, tokens, parents, wb, wf, lb, keep, q8);
        return *nout < 0;
    }
    for (int d = 0; d < depth; d++) {
        norm_rows(h, onw, hn, 1, H, eps);
        if (lgemv(q8, 0, hn, lmw, 0, logits, 1, H, Vd, keep)) return 1;
        int64_t a;
        if (temp > 0) {  /* sampling: q = softmax(logits / temp) (kept for the verifier), one draw by uq[d] */
            float mx, sum, *qr = qout + (int64_t)d * Vd;
            if (stats(logits, 1, Vd, temp, &mx, &sum, qr)) return 2;
            probs_from(qr, Vd, sum);
            a = draw(qr, Vd, uq[d]);
        } else {
            sf_argmax_bf16(logits, 1, Vd, &a);
        }
        tokens[d] = d2t ? d2t[a] : a;
        if (d + 1 == depth) break;
        norm_rows(emb + tokens[d] * H, inw, xin, 1, H, eps);
        norm_rows(h, hnw, xin + H, 1, H, eps);
        if (sf_layers(1, 1, H, hq, hkv, D, I, eps, scale, wp, xin, 2 * H, h, cs + (int64_t)d * D, sn + (int64_t)d * D,
                      kv, 0, s_kv, s_head, past + d, 0, 0, 0, 0, wb, wf, 0, keep, 0, 0, 0, 0, 0))
            return 1;
    }
    return 0;
}
"""


def _load(amx: bool = False) -> tuple[ctypes.CDLL | None, str | None]:
    """The layer library; ``amx``: the build whose target products can run on the AMX tiles (CPUs with
    them only)."""
    return _built(bool(amx))  # one cache entry per build, however it is asked for (_load() / _load(False))


@functools.lru_cache(maxsize=2)
def _built(amx: bool) -> tuple[ctypes.CDLL | None, str | None]:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    # one library: the few-row product and the attention kernel are compiled in with the layer loop
    source = cpu_gemv._SOURCE_BF16 + cpu_attention._SOURCE_DECODE + cpu_verify._SOURCE + _LAYER
    if amx:
        if not cpu_gemv.amx_available():  # (which also asks Linux for the tile state)
            return None, cpu_gemv.amx_unavailable_reason()
        source = cpu_gemv._SOURCE_BF16 + cpu_gemv._SOURCE_AMX + "#define SF_AMX 1\n" + source[len(cpu_gemv._SOURCE_BF16):]
    args = [i32] * 7 + [f32, f32, p, p, i32, p, p, p, p, i64, i64, i64, i32, p, p, i32, p, p, p, i32, i32] \
        + [p, i64, i64, i32, i32]
    draft = [i32, p, p, i32, p, p, i32, p, p, p, p, p, i32, p, p] + [i32] * 5 + [f32, f32, p, i64, i64, i32] + [p] * 7 \
        + [i32, f32, p, p, i32, i32, p, p, i32]
    fns = {"sf_layers": args, "sf_rms_norm": [p, p, p, i64, i32, f32, i32], "sf_argmax_bf16": [p, i64, i64, p],
           "sf_eagle3_draft": draft, "sf_log_softmax_bf16": [p, i64, i64, p], "sf_silu_mul": [p, i64, i64, p],
           "sf_prefill_attention": [p, i32, i32, i32, i32, p, p, p, p, i64, i32, f32, p, p, p]}
    lib, why = cpu_attention._returning_int(build("sflayersamx" if amx else "sflayers", source, fns,
                                                  isa=AMX_BF16 if amx else AVX512_BF16), "sf_layers", "sf_eagle3_draft",
                                                  "sf_prefill_attention")
    # the few-row products' paths chosen for this CPU (the same bits either way: cpu_gemv.fma_rows)
    return (cpu_gemv.configure(lib) if lib is not None else None), why


def unavailable_reason(amx: bool = False) -> str | None:
    """None when the layer kernel (``amx``: its build on the AMX tiles) can run here, else why not."""
    return _load(amx)[1]


def available(amx: bool = False) -> bool:
    return _load(amx)[0] is not None


def supports(hidden: int, intermediate: int, head_dim: int, dtype: torch.dtype, n: int, amx: bool = False) -> bool:
    """Whether :func:`run_layers` takes ``n`` new tokens of layers of these sizes here (``amx``: on the AMX
    products, which take up to :data:`MAX_TOKENS_AMX`; else :data:`MAX_TOKENS`)."""
    return (dtype == torch.bfloat16 and 1 <= n <= (MAX_TOKENS_AMX if amx else MAX_TOKENS) and hidden % 32 == 0
            and intermediate % 16 == 0 and head_dim % 32 == 0 and head_dim <= cpu_attention.MAX_HEAD_DIM
            and available(amx))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """HF's ``LlamaRMSNorm`` of bf16 ``x`` ``[..., H]`` (the layers' own norm, one C call instead of ~9
    ops), or None where it does not apply (another dtype, H % 16, no kernel, autograd needed). ``w`` ``[H]``, or
    ``[F, H]`` for ``x`` ``[..., F, H]``: one weight per feature layer (an EAGLE-3 head's norms)."""
    H = x.shape[-1]
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return None  # no backward here: training keeps the ops
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or H % 16 or x.device.type != "cpu" \
            or w.shape[-1] != H or w.dim() > 2 or (w.dim() == 2 and (x.dim() < 2 or x.shape[-2] != w.shape[0])):
        return None
    lib = _load()[0]
    if lib is None:
        return None
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty_like(x)
    lib.sf_rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // H, H, float(eps), w.numel() // H)
    return y


def _per_row(x: torch.Tensor, fn: str, out: torch.Tensor) -> torch.Tensor | None:
    """``out`` filled by the C function ``fn(x, rows, V, out)`` over the rows of bf16 ``x`` ``[..., V]``,
    or None where that does not apply (another dtype or device, an empty row, no kernel)."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] == 0:
        return None
    lib = _load()[0]
    if lib is None:
        return None
    x = x.contiguous()
    getattr(lib, fn)(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], out.data_ptr())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(-1)`` of bf16 logits (first maximal index, NaN counting as maximal) in one C pass
    over the bf16 values, or None where it does not apply (another dtype, no kernel)."""
    return _per_row(x, "sf_argmax_bf16", torch.empty(x.shape[:-1], dtype=torch.long))


def log_softmax(x: torch.Tensor) -> torch.Tensor | None:
    """``torch.log_softmax(x.float(), -1)`` of bf16 rows in C (the drafting tree's own: :func:`eagle3_draft`
    ranks with these values, so the step-by-step tree search uses them too), or None where it does
    not apply (another dtype, no kernel)."""
    return _per_row(x, "sf_log_softmax_bf16", torch.empty(x.shape, dtype=torch.float32))


def prefill_attention(layer_kv: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: int,
                      scale: float) -> torch.Tensor:
    """:func:`.cpu_attention.prefill_attention` from the layer's fused Q/K/V product ``qkv`` ``[1, n, hq + 2 hkv,
    D]`` before RoPE (``cos``/``sin`` ``[n, D]``, bf16): the RoPE, the K/V cache writes, the fp32 queries and the
    bf16 output in the same C call as the attention, rounded as those ~8 PyTorch ops per layer round (the layer
    kernel's own loop). Where :func:`.cpu_attention.prefill_supports` and :func:`available` hold."""
    _, n, heads, D = qkv.shape
    hkv = layer_kv.shape[2]
    hq = heads - 2 * hkv
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    work = torch.empty(2, n, hq, D, dtype=torch.float32)
    out = torch.empty(1, n, hq * D, dtype=torch.bfloat16)
    keys, values = layer_kv[0], layer_kv[1]
    cpu_attention.check(_load()[0].sf_prefill_attention(
        qkv.data_ptr(), n, hq, hkv, D, cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
        keys.stride(1), past, float(scale), work[0].data_ptr(), work[1].data_ptr(), out.data_ptr()))
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor | None:
    """``F.silu(gate) * up`` of bf16 ``gu`` ``[..., 2I]`` (gate and up side by side, the engine's fused
    product) in one C pass, rounded as those two bf16 ops round (the layer kernel's own MLP: prefill and
    decode agree), or None where it does not apply (another dtype or device, I % 16, autograd, no kernel)."""
    if gu.dtype != torch.bfloat16 or gu.device.type != "cpu" or gu.shape[-1] % 32 \
            or (torch.is_grad_enabled() and gu.requires_grad):
        return None
    return _per_row(gu, "sf_silu_mul", torch.empty((*gu.shape[:-1], gu.shape[-1] // 2), dtype=gu.dtype))


def layer_table(layers: list[dict], q8: bool = False) -> torch.Tensor:
    """The C side's weight table ``[L, 8]`` (addresses) of layer dicts with keys ``ln1`` (or None),
    ``wqkv``, ``bqkv`` (or None), ``wo``, ``ln2``, ``w_gu``, ``w_down`` (contiguous bf16 tensors; with
    ``q8`` the four matrices are :func:`.cpu_gemv.q8_pack` int8 weights), and the format flag. The
    caller keeps the tensors alive as long as the table."""
    keys = ("ln1", "wqkv", "bqkv", "wo", "ln2", "w_gu", "w_down")
    for w in layers:
        for k in keys:
            t = w[k]
            want = torch.uint8 if q8 and k in ("wqkv", "wo", "w_gu", "w_down") else torch.bfloat16
            if t is not None and (t.dtype != want or not t.is_contiguous() or t.device.type != "cpu"):
                name = "int8 (q8_pack)" if want == torch.uint8 else "bf16"
                raise ValueError(f"layer weight {k} must be a contiguous CPU {name} tensor, got {t.dtype} {tuple(t.shape)}")
    return torch.tensor([[0 if w[k] is None else w[k].data_ptr() for k in keys] + [int(q8)] for w in layers],
                        dtype=torch.int64)


@functools.lru_cache(maxsize=64)
def _layer_list(want: tuple[int, ...]) -> torch.Tensor:
    """The feature layers as the C side's int32 array (read only; made once per list)."""
    return torch.tensor(list(want) or [-1], dtype=torch.int32)


def run_layers(table: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv: torch.Tensor,
               past: int, block: torch.Tensor | None, *, heads: tuple[int, int], intermediate: int, eps: float,
               scale: float, feature_layers: tuple[int, ...] = (), xin: torch.Tensor | None = None,
               keep: bool = False, keys_t: tuple[torch.Tensor, int] | None = None, amx: bool = False,
               fma2: bool = False) -> tuple[torch.Tensor, list]:
    """The layers of ``table`` over the residual stream ``x`` ``[1, n, H]`` (bf16; a new tensor is
    returned, ``x`` is not changed): ``cos``/``sin`` ``[1, n, 1, D]``; ``layer_kv`` the cache
    ``[L, 2, 1, hkv, capacity, D]`` (the new K/V written at ``past``); ``block`` ``[1, n, k]`` bool over
    the last ``k`` columns, the ``n`` new ones included (``k > n``: a drafting head's tree), everything
    before them visible, or None (causal); ``heads`` ``(hq, hkv)``. ``xin`` ``[1, n, in]``: the first layer's attention
    input when its table row has no input norm (an EAGLE-3 head's 2H-wide input). ``keep``: the
    weights are read again every step (a head's): see :func:`.cpu_gemv.gemv_bf16`. ``fma2``: the
    products' passes of 2 rows over the streamed weights take the FMA path (the same bits, where
    :func:`.cpu_gemv.fma_exact`; else ignored; the engine measures which is faster here:
    :meth:`.engine.LlamaEngine._two_rows_on_fma`). ``keys_t``: (K also
    stored transposed per 16-column block, ``[L, hkv, capacity, D]`` as
    :meth:`.kvcache.StaticKVCache.transposed_keys` keeps it, the first column it does not hold yet): the
    attention scores against it, and its columns from there through the new ones are written first.
    ``amx``: ``table``'s matrices are packed for the AMX tiles (:func:`.cpu_gemv.amx_pack`) and the
    products run there. Returns (x after the layers, ``[(i, x at the input of layer i)]`` for
    ``feature_layers`` below ``L``)."""
    lib, why = _load(amx)
    if lib is None:
        raise RuntimeError(f"the layer kernel{' on AMX' if amx else ''} is unavailable: {why}")
    hq, hkv = heads
    L = table.shape[0]
    _, n, H = x.shape
    D = layer_kv.shape[-1]
    if layer_kv.shape[0] != L or layer_kv.shape[2] != 1 or layer_kv.stride(-2) != D or layer_kv.stride(-1) != 1:
        raise ValueError(f"cache {tuple(layer_kv.shape)} does not fit {L} layers of one sequence")
    if past + n > layer_kv.shape[-2]:
        raise ValueError(f"{past} + {n} entries exceed the cache's {layer_kv.shape[-2]}")
    x = x.reshape(n, H).contiguous().clone()
    in_dim = H if xin is None else xin.shape[-1]
    if xin is not None:
        xin = xin.reshape(n, in_dim).contiguous()
    want = [i for i in feature_layers if 0 <= i < L]
    feats = torch.empty(n, max(len(want), 1), H, dtype=torch.bfloat16)
    fl = _layer_list(tuple(want))
    nqkv = (hq + 2 * hkv) * D
    wb = torch.empty(n * (max(in_dim, H) + nqkv + hq * D + H + 3 * intermediate), dtype=torch.bfloat16)
    wf = torch.empty(2 * n * hq * D, dtype=torch.float32)
    c = cos.reshape(n, D).contiguous()
    s = sin.reshape(n, D).contiguous()
    bw = 0 if block is None or block.shape[-1] == n else block.shape[-1]  # a head's tree: earlier drafts too
    if bw and not n < bw <= past + n:
        raise ValueError(f"block over {bw} columns for {n} new tokens after {past}")
    b8 = None if block is None or (n == 1 and not bw) else block.reshape(n, -1).to(torch.uint8).contiguous()
    kt, kt_from = keys_t if keys_t is not None else (None, 0)
    if kt is not None and (kt.shape[0] != L or kt.shape[-1] != D or kt.shape[-2] < (past + n + 15) // 16 * 16
                           or kt.dtype != torch.bfloat16 or not kt.is_contiguous() or not 0 <= kt_from <= past):
        raise ValueError(f"transposed keys {tuple(kt.shape)} (from column {kt_from}) do not fit {L} layers, "
                         f"{past} + {n} entries")
    status = lib.sf_layers(n, L, H, hq, hkv, D, intermediate, float(eps), float(scale), table.data_ptr(),
                           ptr(xin), in_dim, x.data_ptr(), c.data_ptr(), s.data_ptr(),
                           layer_kv.data_ptr(), layer_kv.stride(0), layer_kv.stride(1), layer_kv.stride(3), past,
                           ptr(b8), fl.data_ptr(), len(want), feats.data_ptr(),
                           wb.data_ptr(), wf.data_ptr(), bw, cpu_gemv.keep_bits(keep, fma2), ptr(kt),
                           0 if kt is None else kt.stride(0), 0 if kt is None else kt.stride(1), kt_from, int(amx))
    cpu_attention.check(status)
    return x.view(1, n, H), [(i, feats[:, j].unsqueeze(0)) for j, i in enumerate(want)]


def eagle3_draft(table: torch.Tensor, w: dict, features: torch.Tensor | None, ids: torch.Tensor | None,
                 hidden: torch.Tensor | None, depth: int, layer_kv: torch.Tensor, past: int, cos: torch.Tensor,
                 sin: torch.Tensor, *, heads: tuple[int, int], intermediate: int, eps: float, scale: float,
                 keep: bool = False, temperature: float = 0.0, uniforms: torch.Tensor | None = None,
                 top_k: int = 0, budget: int = 0, root: int | None = None) -> tuple | None:
    """An EAGLE-3 head's drafting step for one sequence in one C call: the queued committed pairs
    (raw target ``features`` ``[n, F, H]`` and next ``ids`` ``[n]``, or None) through the feature
    norms, ``fc`` and the head's layer (their K/V written at ``past``), then a chain of ``depth``
    drafts (or a tree, below) from the last output (or from ``hidden`` ``[H]`` when nothing is queued).
    ``table``: the head layer's :func:`layer_table`; ``w``: bf16 ``fnw`` ``[F, H]``, ``fcw``, ``inw``,
    ``hnw``, ``onw`` (input, hidden and output norms), ``lmw`` ``[Vd, H]`` (``fcw`` and ``lmw`` both
    bf16 or both :func:`.cpu_gemv.q8_pack` int8, as the table's layer may be), ``emb`` ``[V, H]``, and
    ``d2t`` (long ``[Vd]`` or None); ``cos``/``sin`` ``[n + max(depth - 1, 0), D]`` from position ``past``.
    The drafts' K/V are written after the queued pairs' and left uncommitted. ``keep``: as in
    :func:`run_layers` (default off: the head's weights, read every step, are prefetched ahead like the
    target's, since the target's stream between two drafts leaves them out of the caches: the drafting
    call 0.86 -> 0.74 ms at 2 threads and 1.45 -> 1.15 ms at 1 on a 2-core Xeon, 687 -> 672 us on a Zen 5
    EPYC; docs/results.md, thirty-fifth and thirty-first sessions). ``temperature`` > 0: each
    draft is drawn from ``softmax(logits / temperature)`` over the draft vocabulary by one of the
    fp64 ``uniforms`` ``[depth]``. ``top_k`` > 0: EAGLE-2's greedy tree instead of a chain (the
    drafter's ``_grow_greedy``, the same steps and numbers), at most ``budget`` nodes; its step entries
    (up to ``(depth - 1) * top_k``) are written after the queued pairs'. Returns (target ids, the new
    root hidden ``[H]``, the draft distributions ``[depth, Vd]`` fp32 when sampled else None, the tree's
    parents ``[nodes]`` (0 = root, else the kept node's number from 1) else None), or None when sampling
    met a row of non-finite scaled logits. With the ``root`` id: the draft as a
    :class:`~.tree.Draft`'s rows instead, ids ``[1, 1 + nodes]`` (the root first) and parents
    ``[1, 1 + nodes]`` (-1, then a chain's or the tree's), made without a tensor op, the draft
    distributions ``[1 + depth, Vd]`` (the root's row zero), and a fifth entry: the same ids and
    parents as Python lists (:attr:`.tree.Draft.host`)."""
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(f"the layer kernel is unavailable: {unavailable_reason()}")
    hq, hkv = heads
    D = layer_kv.shape[-1]
    n = 0 if ids is None else ids.numel()
    F, H = w["fnw"].shape
    Vd = w["lmw"].shape[0]
    q8 = w["lmw"].dtype == torch.uint8  # int8 weights (cpu_gemv.q8_pack), fc's and the lm head's alike
    if (w["fcw"].dtype == torch.uint8) != q8:
        raise ValueError("eagle3_draft takes fcw and lmw both bf16 or both int8 (q8_pack)")
    if n > MAX_TOKENS or (n == 0 and hidden is None) or (n and tuple(features.shape) != (n, F, H)):
        raise ValueError(f"eagle3_draft takes 1-{MAX_TOKENS} queued pairs with [n, {F}, {H}] features, or a hidden state")
    steps = n + max(depth - 1, 0)  # positions: the queued pairs, every depth but the last
    entries = n + max(depth - 1, 0) * max(top_k, 1)  # a tree writes up to top_k per step
    if top_k > MAX_TOKENS or (top_k and budget < 1):
        raise ValueError(f"a drafting tree takes top_k 1-{MAX_TOKENS} and a node budget, got {top_k}, {budget}")
    if past + entries > layer_kv.shape[-2]:
        raise ValueError(f"{past} + {entries} entries exceed the cache's {layer_kv.shape[-2]}")
    if cos.shape[0] != steps or sin.shape[0] != steps:
        raise ValueError(f"cos/sin need {steps} rows (positions {past}..), got {cos.shape[0]}, {sin.shape[0]}")
    rows = max(n, top_k, 1)
    # the C call writes the new root hidden into h; it reads h only when nothing is queued. Tensor
    # calls that would change nothing are skipped (each costs ~10-40 us on caches a forward flushed)
    h = torch.empty(H, dtype=torch.bfloat16) if hidden is None or n else hidden.reshape(H).clone()
    # ids and parents in one tensor, each row with a slot for the root first (a Draft's layout)
    N = max(depth, budget, 1)
    out = torch.empty(2, N + 1, dtype=torch.long)
    at = out.data_ptr()
    tokens, parents = at + 8, at + 8 * (N + 2)
    nout = ctypes.c_int(0)
    # the work buffers in one allocation (bf16 wb and lb, fp32 wf), each 64-byte aligned
    nqkv = (hq + 2 * hkv) * D
    n_wb = rows * (2 * H + nqkv + hq * D + H + 3 * intermediate)
    tree = top_k * (5 * H + Vd + 2 * D)  # frontier, residuals, inputs, norms, logits, RoPE rows
    n_lb = max(n * F * H + n * H + rows * 2 * H + H + Vd, tree)
    work = torch.empty(2 * n_wb + 2 * n_lb + 8 * rows * hq * D + 192, dtype=torch.uint8)
    wb = -(-work.data_ptr() // 64) * 64
    lb = -(-(wb + 2 * n_wb) // 64) * 64
    wf = -(-(lb + 2 * n_lb) // 64) * 64
    feats = (features if features.is_contiguous() else features.contiguous()) if n else None
    cos, sin = (t if t.is_contiguous() else t.contiguous() for t in (cos, sin))
    qids = None if not n else ids if ids.dtype == torch.long and ids.is_contiguous() else \
        ids.reshape(n).to(torch.long).contiguous()
    sampled = temperature > 0
    if sampled and (uniforms is None or uniforms.dtype != torch.float64 or uniforms.numel() < depth):
        raise ValueError(f"sampling needs {depth} fp64 uniforms")
    # with the root id, q as a Draft's rows: the root's row (zeros, unused) first
    lead = int(root is not None)
    qout = (torch.zeros if lead else torch.empty)(lead + depth, Vd, dtype=torch.float32) if sampled else None
    uq = uniforms.contiguous() if sampled else None
    status = lib.sf_eagle3_draft(
        n, ptr(feats), ptr(qids), F, w["fnw"].data_ptr(), w["fcw"].data_ptr(), depth, table.data_ptr(),
        w["inw"].data_ptr(), w["hnw"].data_ptr(), w["onw"].data_ptr(), w["lmw"].data_ptr(), Vd, ptr(w["d2t"]),
        w["emb"].data_ptr(), H, hq, hkv, D, intermediate, float(eps), float(scale), layer_kv.data_ptr(),
        layer_kv.stride(1), layer_kv.stride(3), past, cos.data_ptr(), sin.data_ptr(), h.data_ptr(), tokens,
        wb, wf, lb, int(keep), float(temperature), ptr(uq), qout.data_ptr() + 4 * lead * Vd if sampled else None, top_k,
        budget, parents, ctypes.byref(nout), int(q8))
    if status == 2:
        return None
    cpu_attention.check(status)
    m = nout.value if top_k else depth
    if root is None:
        return out[0, 1:m + 1], h, qout if not top_k else None, out[1, 1:m + 1] if top_k else None
    # the root's slots written through the buffer's address: cheaper than two indexing ops
    row = (ctypes.c_int64 * (2 * N + 2)).from_address(at)
    row[0], row[N + 1] = root, -1
    if not top_k:
        row[N + 2:N + 2 + m] = range(m)  # a chain: node i's parent is i - 1
    host = (row[:m + 1], row[N + 1:N + 2 + m])  # the same rows as lists, read without a tensor op
    return out[:1, :m + 1], h, qout if not top_k else None, out[1:, :m + 1], host
