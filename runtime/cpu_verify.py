"""Speculative sampling's verification of one sequence's chain in one C call (AVX-512).

Scope: :func:`~.verify.verify_sampling_chain` for batch 1 with temperature-only sampling (no top-k,
no top-p), on the target's raw bf16 or fp32 logits ``[N, V]`` over a full vocabulary: the target's
probability of each draft token (rows up to the first rejection only), the acceptance test
``u * q(x) < p(x)``, and the one draw of the next token from ``p`` or from the residual
``max(p - q, 0)``. Plain sampled decoding is the same call with no drafts.

Why: the PyTorch path runs ~25 ops over 49k-entry rows per step (softmax of every row, gathers,
the residual, a float64 cumulative sum, a search), ~0.8 ms at one thread on a 2-core AMD EPYC, 7%
of a speculative step of SmolLM2-135M at T=1 (docs/results.md, twenty-fourth session); here it is
two passes over each needed row.

Exactness: the rule is the same rejection sampling, with the same random numbers drawn from the
caller's generator in the same order (the acceptance uniforms in fp32, then one fp64 uniform for the
draw), so the emitted tokens are distributed exactly as the target's own sampling. ``p`` is computed
in fp32 like :func:`~.sampling.probs_from_logits` (the scaled logits minus their maximum,
exponentiated, divided by their sum) but with its own exponential and summation order, so a value
can differ from PyTorch's in its last bits: a token drawn within such a distance of a boundary can
differ from the PyTorch verifier's for the same seed (never the distribution). A needed row whose
scaled logits are not all finite (NaN, or a temperature so small they overflow) is left to the
PyTorch path, which handles it, with the generator's state put back.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cpu_attention
from .native import AVX512_BF16, build, ptr

__all__ = ["available", "sampling_chain"]

_SOURCE = r"""
static inline __m512 ldlog(const void *lg, int bf16, int64_t i, __mmask16 m) {
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        _mm256_maskz_loadu_epi16(m, (const uint16_t *)lg + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)lg + i);
}
static inline __mmask16 tailmask(int64_t V, int64_t i) { return V - i >= 16 ? 0xffff : (__mmask16)((1u << (V - i)) - 1); }

/* l / T; T == 1 skips the division (x / 1 is x exactly: the same bits, and vdivps is slow on 49k-entry rows) */
static inline __m512 scl(__m512 v, __m512 tv, int one) { return one ? v : _mm512_div_ps(v, tv); }

/* row statistics of the scaled logits l / T: their maximum and the sum of exp(l / T - max); 1 when
   they are not all finite (left to the caller's PyTorch path). ex [V]: each exp(l / T - max) kept, so
   that the row's probabilities need only the division by the sum (probs_from) */
static int stats(const void *lg, int bf16, int64_t V, float T, float *mx, float *sum, float *ex) {
    __m512 m = _mm512_set1_ps(-INFINITY), tv = _mm512_set1_ps(T);
    int one = T == 1.0f;
    __mmask16 bad = 0;
    for (int64_t i = 0; i < V; i += 16) {
        __mmask16 k = tailmask(V, i);
        __m512 v = scl(ldlog(lg, bf16, i, k), tv, one);
        bad |= _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q) | _mm512_mask_cmp_ps_mask(k, _mm512_abs_ps(v), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
        m = _mm512_mask_max_ps(m, k, m, v);
    }
    if (bad) return 1;
    *mx = _mm512_reduce_max_ps(m);
    __m512 s = _mm512_setzero_ps(), mv = _mm512_set1_ps(*mx);
    for (int64_t i = 0; i < V; i += 16) {
        __mmask16 k = tailmask(V, i);
        __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(scl(ldlog(lg, bf16, i, k), tv, one), mv)));
        _mm512_mask_storeu_ps(ex + i, k, e);
        s = _mm512_add_ps(s, e);
    }
    *sum = _mm512_reduce_add_ps(s);
    return 0;
}

static inline float prob(const void *lg, int bf16, int64_t x, float T, float mx, float sum) {
    __m512 v = scl(ldlog(lg, bf16, x, 1), _mm512_set1_ps(T), T == 1.0f);
    return _mm512_cvtss_f32(exp512(_mm512_sub_ps(v, _mm512_set1_ps(mx)))) / sum;
}

/* the row's probabilities exp(l / T - mx) / sum from the exponentials stats() kept, in place */
static void probs_from(float *ex, int64_t V, float sum) {
    __m512 inv = _mm512_set1_ps(1.0f / sum);
    for (int64_t i = 0; i < V; i += 16) {
        __mmask16 m = tailmask(V, i);
        _mm512_mask_storeu_ps(ex + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, ex + i), inv));
    }
}

static inline double block_sum(const float *w, int64_t V, int64_t i) {
    __m512 p = _mm512_maskz_loadu_ps(tailmask(V, i), w + i);
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(p));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
    return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

/* one draw from non-negative weights w [V] (any positive total) by the uniform u in [0, 1): the first
   index whose running fp64 sum exceeds u * total, as sampling.sample does (16-entry block sums, in the
   order the total was made; the picked entry is always positive). The block sums of the total are kept
   for the search (up to SF_DRAW_BLOCKS of them, on the stack; a larger vocabulary sums them again). */
#define SF_DRAW_BLOCKS 8192
static int64_t draw(const float *w, int64_t V, double u) {
    double total = 0, run = 0, kept[SF_DRAW_BLOCKS];
    int keep = (V + 15) / 16 <= SF_DRAW_BLOCKS;
    for (int64_t i = 0; i < V; i += 16) {
        double b = block_sum(w, V, i);
        if (keep) kept[i / 16] = b;
        total += b;
    }
    double target = u * total;
    int64_t pick = -1;
    for (int64_t i = 0; i < V && pick < 0; i += 16) {
        double b = keep ? kept[i / 16] : block_sum(w, V, i);
        if (run + b > target) {
            int64_t end = V - i < 16 ? V - i : 16;
            double c = run;
            for (int64_t t = 0; t < end; t++) {
                if (!(w[i + t] > 0)) continue;
                pick = i + t;  /* (the block's last positive entry if rounding keeps c below target) */
                c += w[i + t];
                if (c > target) break;
            }
        }
        run += b;
    }
    if (pick < 0) for (pick = V - 1; pick > 0 && !(w[pick] > 0); pick--) {}  /* rounding past the end */
    return pick;
}

/* q's value at target id t in row i: q spans the target vocabulary (qids NULL, Vq = V), or a draft
   vocabulary whose column j is target id qids[j] (zero at every other id) */
static inline float q_at(const float *q, const int64_t *qids, int64_t Vq, int i, int64_t t) {
    const float *row = q + (int64_t)i * Vq;
    if (!qids) return row[t];
    for (int64_t j = 0; j < Vq; j++)
        if (qids[j] == t) return row[j];
    return 0.0f;
}

/* whether any of r [V] is positive */
static __mmask16 any_positive(const float *r, int64_t V) {
    __mmask16 any = 0;
    for (int64_t i = 0; i < V && !any; i += 16)
        any = _mm512_mask_cmp_ps_mask(tailmask(V, i), _mm512_maskz_loadu_ps(tailmask(V, i), r + i), _mm512_setzero_ps(), _CMP_GT_OQ);
    return any;
}

/* Verify a chain of k drafts x[0..k-1] (node i + 1 = x[i]) against logits rows 0..k (row i: the
   target after node i, V entries, bf16 or fp32, row stride V); q: [k][Vq] the distributions the
   drafts were drawn from (row i for x[i]; over the target vocabulary, or with qids over a draft
   vocabulary, see q_at; NULL: deterministic drafts, q(x) = 1 and a zero residual elsewhere); u: k
   fp32 acceptance uniforms; uf: the fp64 uniform of the final draw. Writes the accepted count and
   the next token; work: 2V floats. 0, or 1 when a needed row is not finite or a qids entry is not a
   target id. */
int sf_verify_sampling_chain(const void *logits, int bf16, int64_t V, int k, float T, const int64_t *x,
                             const float *q, const int64_t *qids, int64_t Vq, const float *u, double uf,
                             float *work, int64_t *accepted, int64_t *next) {
    size_t es = bf16 ? 2 : 4;
    float mx = 0, sum = 1;
    int j = 0;
    for (; j <= k; j++) {  /* the last row whose statistics are taken is the one drawn from */
        const void *row = (const char *)logits + (size_t)j * V * es;
        if (stats(row, bf16, V, T, &mx, &sum, work)) return 1;
        if (j == k) break;
        float px = prob(row, bf16, x[j], T, mx, sum), qx = q ? q_at(q, qids, Vq, j, x[j]) : 1.0f;
        if (!(u[j] * qx < px)) break;  /* rejected: draw from the residual of row j */
    }
    probs_from(work, V, sum);
    if (j < k) {  /* the residual max(p - q, 0), unless it is empty (p <= q everywhere): then p */
        __mmask16 any = 0;
        float *r = work + V;
        for (int64_t i = 0; i < V; i += 16) {
            __mmask16 m = tailmask(V, i);
            __m512 d = _mm512_maskz_loadu_ps(m, work + i);
            if (q && !qids) d = _mm512_sub_ps(d, _mm512_maskz_loadu_ps(m, q + (int64_t)j * V + i));
            d = _mm512_max_ps(d, _mm512_setzero_ps());
            _mm512_mask_storeu_ps(r + i, m, d);
            any |= _mm512_mask_cmp_ps_mask(m, d, _mm512_setzero_ps(), _CMP_GT_OQ);
        }
        if (q && qids) {  /* q over a draft vocabulary: subtract it at its ids only (p - 0 = p elsewhere) */
            const float *qr = q + (int64_t)j * Vq;
            for (int64_t t = 0; t < Vq; t++)
                if (qids[t] < 0 || qids[t] >= V) return 1;  /* not target ids: the PyTorch path says so */
            for (int64_t t = 0; t < Vq; t++) {
                float d = work[qids[t]] - qr[t];
                r[qids[t]] = d > 0.0f ? d : 0.0f;
            }
            any = any_positive(r, V);
        }
        if (!q) {  /* a deterministic draft: q is one at x */
            r[x[j]] = 0.0f;
            any = any_positive(r, V);
        }
        if (any) work = r;
    }
    *accepted = j;
    *next = draw(work, V, uf);
    return 0;
}
"""


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    # exp512 (and the headers) come with the attention kernels' source
    built = build("sfverify", cpu_attention._SOURCE_DECODE + _SOURCE,
                  {"sf_verify_sampling_chain": [p, i32, i64, i32, ctypes.c_float, p, p, p, i64, p, ctypes.c_double, p, p, p]},
                  isa=AVX512_BF16)
    return cpu_attention._returning_int(built, "sf_verify_sampling_chain")


def available() -> bool:
    return _load()[0] is not None


def sampling_chain(tokens: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, temperature: float,
                   generator: torch.Generator | None, q_ids: torch.Tensor | None = None) -> tuple[int, int] | None:
    """Rejection sampling along a chain of one sequence: ``tokens`` ``[N]`` (root first), ``q``
    ``[N, V]`` fp32 (row ``i`` the distribution node ``i`` was drawn from; None: deterministic drafts),
    or ``[N, Vq]`` over a draft vocabulary whose column ``j`` is target id ``q_ids[j]`` (long ``[Vq]``;
    zero at every other id: ``Draft.q_ids``), raw target ``logits`` ``[N, V]`` (bf16 or fp32, CPU).
    Draws the acceptance uniforms and then the final one from ``generator`` as
    :func:`~.verify.verify_sampling_chain` does. Returns (accepted drafts, next token), or None where
    this does not apply (the generator then as it was)."""
    lib = _load()[0]
    N, V = logits.shape
    Vq = V if q_ids is None else q_ids.shape[0]
    if lib is None or logits.device.type != "cpu" or logits.dtype not in (torch.bfloat16, torch.float32) \
            or (q is not None and (q.dtype != torch.float32 or q.shape != (N, Vq))) or not temperature > 0 \
            or (q_ids is not None and (q_ids.dtype != torch.long or q_ids.device.type != "cpu")):
        return None
    logits = logits.contiguous()
    k = N - 1
    x = tokens[1:].to(torch.long).contiguous() if k else None  # a plain step: no drafts to read
    qd = None if q is None else q[1:].contiguous()
    ids = None if q is None or q_ids is None else q_ids.contiguous()
    state = generator.get_state() if generator is not None else torch.random.get_rng_state()
    u = torch.rand(k, 1, generator=generator, dtype=torch.float32).view(k) if k else torch.empty(0)
    uf = float(torch.rand(1, 1, generator=generator, dtype=torch.float64))
    work = torch.empty(2 * V, dtype=torch.float32)
    acc, nxt = ctypes.c_int64(), ctypes.c_int64()
    status = lib.sf_verify_sampling_chain(logits.data_ptr(), int(logits.dtype == torch.bfloat16), V, k,
                                          float(temperature), ptr(x), ptr(qd), ptr(ids), Vq, u.data_ptr(), uf, work.data_ptr(),
                                          ctypes.byref(acc), ctypes.byref(nxt))
    if status:  # a needed row is not finite: give the random numbers back, PyTorch's path handles it
        if generator is not None:
            generator.set_state(state)
        else:
            torch.random.set_rng_state(state)
        return None
    return acc.value, nxt.value
