/* Skinny bf16 matmuls for the CPU: y[t, n] = sum_k x[t, k] * w[n, k] for a few rows t.
 *
 * Why: at decode sizes (1-16 rows) oneDNN's and MKL's bf16 matmuls run far below this
 * machine's memory bandwidth (a 512x512 weight read from cache: ~66 us, about 8 GB/s), and
 * a decode step is ~100 such calls. Here each weight row is streamed once per block of
 * TOKENS rows of x and multiplied with AVX512-BF16 dot products (vdpbf16ps), accumulating in
 * float32 and rounding once to bf16 (round to nearest even), as oneDNN does.
 *
 * Each output element's sum runs in the same order whatever the number of rows, the row's
 * position or the thread count: a row's result never depends on what else shares the call.
 *
 * Parallel over output features with OpenMP; the process's OpenMP runtime is torch's own
 * (libgomp.so.1 is already loaded when this library is), so the two share one thread pool.
 */
#include "cpu_kernels.h"

#define TOKENS 4 /* rows of x per pass over a weight block */
#define FEATS 4  /* weight rows per block */
#ifndef PREFETCH
#define PREFETCH 4 /* blocks of rows ahead */
#endif

static inline Sink sink_rows(Sink s, long r) {
    if (s.acc) {
        s.tok += r;
        s.wt += r;
    } else {
        s.y += r * s.ldy;
    }
    return s;
}

static inline void store(const Sink *s, int j, long n, float sum) {
    const uint16_t b = round_bf16(sum);
    if (s->acc) {
        const float v = bf16_to_float(b) * s->wt[j];
        s->acc[s->tok[j] * s->ldy + n] += v;
    } else {
        s->y[j * s->ldy + n] = b;
    }
}

/* Rows [n0, n1) of one weight for T rows of x (T <= TOKENS, a compile-time constant in each
 * caller so the accumulators stay in registers). k_full: K rounded down to 32; the tail is
 * read with a mask. A last partial block of rows (n1 - n < FEATS) reads whole blocks of
 * FEATS rows only when they exist (`w_rows`), else row by row. */
static inline __attribute__((always_inline)) void block_rows(
    const uint16_t *x, long ldx, const uint16_t *w, long k, const Sink *y, const int T, long n0,
    long n1) {
    const long k_full = k & ~31L;
    const __mmask32 tail = (__mmask32)((1ULL << (k - k_full)) - 1);
    long n = n0;
    for (; n + FEATS <= n1; n += FEATS) {
        __m512 acc[FEATS][TOKENS];
        for (int i = 0; i < FEATS; i++)
            for (int j = 0; j < T; j++) acc[i][j] = _mm512_setzero_ps();
        const uint16_t *wr = w + n * k;
        for (long kk = 0; kk < k_full; kk += 32) {
            __m512i xv[TOKENS];
            for (int j = 0; j < T; j++) xv[j] = _mm512_loadu_si512(x + j * ldx + kk);
            for (int i = 0; i < FEATS; i++) {
                /* the next block's rows, PREFETCH blocks ahead: the hardware prefetcher alone
                 * reached ~13 GB/s on these short streams */
                _mm_prefetch((const char *)(wr + (PREFETCH * FEATS + i) * k + kk), _MM_HINT_T0);
                const __m512i wv = _mm512_loadu_si512(wr + i * k + kk);
                for (int j = 0; j < T; j++)
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv, (__m512bh)xv[j]);
            }
        }
        if (tail) {
            __m512i xv[TOKENS];
            for (int j = 0; j < T; j++)
                xv[j] = _mm512_maskz_loadu_epi16(tail, x + j * ldx + k_full);
            for (int i = 0; i < FEATS; i++) {
                const __m512i wv = _mm512_maskz_loadu_epi16(tail, wr + i * k + k_full);
                for (int j = 0; j < T; j++)
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv, (__m512bh)xv[j]);
            }
        }
        for (int i = 0; i < FEATS; i++)
            for (int j = 0; j < T; j++)
                store(y, j, n + i, _mm512_reduce_add_ps(acc[i][j]));
    }
    for (; n < n1; n++) { /* the last rows, one at a time */
        __m512 acc[TOKENS];
        for (int j = 0; j < T; j++) acc[j] = _mm512_setzero_ps();
        const uint16_t *wr = w + n * k;
        for (long kk = 0; kk < k_full; kk += 32) {
            const __m512i wv = _mm512_loadu_si512(wr + kk);
            for (int j = 0; j < T; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)wv,
                                          (__m512bh)_mm512_loadu_si512(x + j * ldx + kk));
        }
        if (tail) {
            const __m512i wv = _mm512_maskz_loadu_epi16(tail, wr + k_full);
            for (int j = 0; j < T; j++)
                acc[j] = _mm512_dpbf16_ps(
                    acc[j], (__m512bh)wv,
                    (__m512bh)_mm512_maskz_loadu_epi16(tail, x + j * ldx + k_full));
        }
        for (int j = 0; j < T; j++) store(y, j, n, _mm512_reduce_add_ps(acc[j]));
    }
}

/* One weight's rows [n0, n1) for all m rows of x, TOKENS rows at a time. */
static void rows_range(const uint16_t *x, long ldx, const uint16_t *w, long k, Sink y, long m,
                       long n0, long n1) {
    for (long r = 0; r < m; r += TOKENS) {
        const uint16_t *xr = x + r * ldx;
        const Sink yr = sink_rows(y, r);
        switch ((m - r) < TOKENS ? (int)(m - r) : TOKENS) {
        case 1: block_rows(xr, ldx, w, k, &yr, 1, n0, n1); break;
        case 2: block_rows(xr, ldx, w, k, &yr, 2, n0, n1); break;
        case 3: block_rows(xr, ldx, w, k, &yr, 3, n0, n1); break;
        default: block_rows(xr, ldx, w, k, &yr, 4, n0, n1); break;
        }
    }
}

/* The share [n0, n1) of n features that thread `id` of `count` takes (whole FEATS blocks). */
static void share(long n, int id, int count, long *n0, long *n1) {
    const long blocks = (n + FEATS - 1) / FEATS;
    const long b0 = blocks * id / count, b1 = blocks * (id + 1) / count;
    *n0 = b0 * FEATS;
    *n1 = b1 * FEATS < n ? b1 * FEATS : n;
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ w [n, k]^T; all bf16, w contiguous. */
void mci_bf16_linear(const uint16_t *x, long ldx, const uint16_t *w, uint16_t *y, long ldy,
                     long m, long n, long k) {
#pragma omp parallel
    {
        long n0, n1;
        share(n, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
        const Sink sink = {y, ldy, 0, 0, 0};
        rows_range(x, ldx, w, k, sink, m, n0, n1);
    }
}

void mci_experts_into(const uint16_t *x, long ldx, const uint16_t *w, Sink y,
                      const int64_t *ids, const int64_t *starts, const int64_t *counts,
                      long segments, long n, long k) {
#pragma omp parallel
    {
        long n0, n1;
        share(n, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
        for (long s = 0; s < segments; s++)
            rows_range(x + starts[s] * ldx, ldx, w + ids[s] * n * k, k, sink_rows(y, starts[s]),
                       counts[s], n0, n1);
    }
}

/* Stacked experts: for each segment s, rows [starts[s], starts[s] + counts[s]) of x and y go
 * through expert ids[s]: w + ids[s] * n * k is that expert's [n, k] weight. */
void mci_bf16_expert_linear(const uint16_t *x, long ldx, const uint16_t *w, uint16_t *y,
                            long ldy, const int64_t *ids, const int64_t *starts,
                            const int64_t *counts, long segments, long n, long k) {
    const Sink sink = {y, ldy, 0, 0, 0};
    mci_experts_into(x, ldx, w, sink, ids, starts, counts, segments, n, k);
}

/* The same, each output row then weighted and added into float32 rows: acc [*, n] (zeroed by
 * the caller) gets acc[tokens[a]] += weights[a] * y[a] for every row a, in row order (each
 * thread owns a slice of the n features, so no two threads touch one element). */
void mci_bf16_expert_linear_combine(const uint16_t *x, long ldx, const uint16_t *w, float *acc,
                                    const int64_t *tokens, const float *weights,
                                    const int64_t *ids, const int64_t *starts,
                                    const int64_t *counts, long segments, long n, long k) {
    const Sink sink = {0, n, acc, tokens, weights};
    mci_experts_into(x, ldx, w, sink, ids, starts, counts, segments, n, k);
}

/* ---- decode attention over latent rows read through slot indices (MLA, absorbed) ---------
 * One query row per sequence (decode): for sequence b and head h,
 *   s[l] = scale * <q[b, h, :], cache[slots[b, l], :]>        l < lens[b]   (float32 sums)
 *   p    = softmax(s)                                         (float32)
 *   out[b, h, :] = sum_l p[l] * cache[slots[b, l], :c]        rounded once to bf16
 * q [B, H, d] bf16 contiguous; cache [rows, d] bf16 (one layer's latent rows); slots [B, lds]
 * int64; out [B, H, c] bf16 contiguous (c <= d: the latent part of each row, the value).
 * The cache is read in place: no gathered copy of the context. Work is split over
 * (sequence, group of heads); each (b, h) is computed alone, in the same order whatever the
 * batch, so a sequence's result never depends on the others. */


#define MAX_HEADS_PER_ITEM 16
#define MAX_LATENT 1024 /* c: DeepSeek-V3 has 512 */

static void attend_one(const uint16_t *q, long d, const uint16_t *cache, const int64_t *slots,
                       long len, long c, float scale, uint16_t *out, int heads, float *scores) {
    const long d_full = d & ~31L;
    const __mmask32 d_tail = (__mmask32)((1ULL << (d - d_full)) - 1);
    /* pass 1: scores [heads][len] */
    for (long l = 0; l < len; l++) {
        const uint16_t *row = cache + slots[l] * d;
        for (int h = 0; h < heads; h++) {
            const uint16_t *qh = q + h * d;
            __m512 acc = _mm512_setzero_ps();
            for (long kk = 0; kk < d_full; kk += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(row + kk),
                                       (__m512bh)_mm512_loadu_si512(qh + kk));
            if (d_tail)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(d_tail, row + d_full),
                                       (__m512bh)_mm512_maskz_loadu_epi16(d_tail, qh + d_full));
            scores[h * len + l] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    /* softmax per head, in place; the sum kept for the end */
    float total[MAX_HEADS_PER_ITEM];
    for (int h = 0; h < heads; h++) {
        float *s = scores + h * len;
        float mx = -INFINITY;
        for (long l = 0; l < len; l++) mx = s[l] > mx ? s[l] : mx;
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        long l = 0;
        for (; l + 16 <= len; l += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + l), vmx));
            _mm512_storeu_ps(s + l, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        if (l < len) {
            const __mmask16 m = (__mmask16)((1u << (len - l)) - 1);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + l), vmx));
            _mm512_mask_storeu_ps(s + l, m, e);
            vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
        }
        total[h] = _mm512_reduce_add_ps(vsum);
    }
    /* pass 2: out[h] = sum_l p[h][l] * row[:c], float32 accumulators in L1 */
    float acc[MAX_HEADS_PER_ITEM][MAX_LATENT] __attribute__((aligned(64)));
    for (int h = 0; h < heads; h++)
        for (long j = 0; j < c; j++) acc[h][j] = 0.0f;
    const long c_full = c & ~15L;
    const __mmask16 c_tail = (__mmask16)((1u << (c - c_full)) - 1);
    for (long l = 0; l < len; l++) {
        const uint16_t *row = cache + slots[l] * d;
        for (long j = 0; j < c_full; j += 16) {
            const __m512 v = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + j))), 16));
            for (int h = 0; h < heads; h++)
                _mm512_store_ps(acc[h] + j, _mm512_fmadd_ps(_mm512_set1_ps(scores[h * len + l]), v,
                                                             _mm512_load_ps(acc[h] + j)));
        }
        if (c_tail) {
            const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(c_tail, row + c_full)), 16));
            for (int h = 0; h < heads; h++)
                _mm512_store_ps(acc[h] + c_full,
                                _mm512_fmadd_ps(_mm512_set1_ps(scores[h * len + l]), v,
                                                _mm512_load_ps(acc[h] + c_full)));
        }
    }
    for (int h = 0; h < heads; h++) {
        const float inv = 1.0f / total[h];
        for (long j = 0; j < c; j++) out[h * c + j] = round_bf16(acc[h][j] * inv);
    }
}

/* Returns 0, or -1 when the shapes exceed this kernel's fixed buffers (caller falls back). */
int mci_bf16_latent_decode_attention(const uint16_t *q, const uint16_t *cache,
                                     const int64_t *slots, long ldslots, const int64_t *lens,
                                     long batch, long heads, long d, long c, float scale,
                                     uint16_t *out) {
    if (c > MAX_LATENT || d > 4 * MAX_LATENT) return -1;
    const int threads = omp_get_max_threads();
    /* few sequences: split the heads too, so every thread has work */
    long per = heads;
    if (batch < threads) per = (heads * batch + threads - 1) / threads;
    if (per > MAX_HEADS_PER_ITEM) per = MAX_HEADS_PER_ITEM;
    if (per < 1) per = 1;
    const long groups = (heads + per - 1) / per;
    long max_len = 0;
    for (long b = 0; b < batch; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
#pragma omp parallel
    {
        float *scores = (float *)aligned_alloc(64, ((per * max_len * 4 + 63) / 64) * 64 + 64);
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < batch * groups; item++) {
            const long b = item / groups, h0 = (item % groups) * per;
            const int nh = (int)((heads - h0) < per ? (heads - h0) : per);
            attend_one(q + (b * heads + h0) * d, d, cache, slots + b * ldslots, lens[b], c, scale,
                       out + (b * heads + h0) * c, nh, scores);
        }
        free(scores);
    }
    return 0;
}

/* ---- RMSNorm ------------------------------------------------------------------------------
 * y[r] = (x[r] * 1/sqrt(mean(x[r]^2) + eps)) * w, computed in float32 and rounded once to the
 * output dtype, as mci/layers/norm.py does; the sum of squares is accumulated in another
 * order (and with fused multiply-adds), so a row's scale can differ from torch's in the last
 * float32 bit. x: float32 or bf16 rows
 * (row stride ldx elements), w: bf16 [n], y: float32 or bf16 [rows, n] contiguous. */

static inline __m512 load16(const void *p, int bf16, __mmask16 m) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    return _mm512_maskz_loadu_ps(m, p);
}

void mci_rms_norm(const void *x, long ldx, int x_bf16, const uint16_t *w, void *y, int y_bf16,
                  long rows, long n, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 32)
    for (long r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * ldx * (x_bf16 ? 2 : 4);
        __m512 ss = _mm512_setzero_ps();
        for (long j = 0; j < n; j += 16) {
            const __mmask16 m = (n - j) >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
            const __m512 v = load16(xr + j * (x_bf16 ? 2 : 4), x_bf16, m);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps);
        const __m512 vs = _mm512_set1_ps(scale);
        for (long j = 0; j < n; j += 16) {
            const __mmask16 m = (n - j) >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
            const __m512 v = load16(xr + j * (x_bf16 ? 2 : 4), x_bf16, m);
            const __m512 out = _mm512_mul_ps(_mm512_mul_ps(v, vs), load16(w + j, 1, m));
            if (y_bf16) {
                float tmp[16];
                _mm512_storeu_ps(tmp, out);
                uint16_t *yr = (uint16_t *)y + r * n + j;
                for (int i = 0; i < 16 && j + i < n; i++) yr[i] = round_bf16(tmp[i]);
            } else {
                _mm512_mask_storeu_ps((float *)y + r * n + j, m, out);
            }
        }
    }
}

/* ---- rotary embedding and the latent cache write (MLA) ------------------------------------
 * rope(v)[i] = v1[i] * cos[i] - v2[i] * sin[i],  rope(v)[h + i] = v2[i] * cos[i] + v1[i] * sin[i]
 * (h = r/2 pairs; interleaved checkpoints pair (2i, 2i+1), the others (i, i + h)): each product
 * and the sum rounded in float32, as mci/layers/rotary.py computes them, then rounded once to
 * bf16. */
static inline void rope_row(const uint16_t *v, const float *cos, const float *sin, long r,
                            int interleave, uint16_t *out) {
    const long h = r / 2;
    for (long i = 0; i < h; i++) {
        const float a = bf16_to_float(interleave ? v[2 * i] : v[i]);
        const float b = bf16_to_float(interleave ? v[2 * i + 1] : v[h + i]);
        const float ac = a * cos[i], bs = b * sin[i], bc = b * cos[i], as = a * sin[i];
        out[i] = round_bf16(ac - bs);
        out[h + i] = round_bf16(bc + as);
    }
}

/* x [T, H, r] bf16 (strides ldt per token, ldh per head) -> out [T, H, r] bf16 contiguous;
 * cos/sin [T, r/2] float32. */
void mci_rope_heads(const uint16_t *x, long ldt, long ldh, const float *cos, const float *sin,
                    long tokens, long heads, long r, int interleave, uint16_t *out) {
#pragma omp parallel for schedule(static) if (tokens * heads >= 256)
    for (long t = 0; t < tokens; t++)
        for (long hd = 0; hd < heads; hd++)
            rope_row(x + t * ldt + hd * ldh, cos + t * (r / 2), sin + t * (r / 2), r, interleave,
                     out + (t * heads + hd) * r);
}

/* The new latent rows of a step, written straight into one layer's cache: for token t,
 * cache[slots[t]] = [ rmsnorm(latent[t, :c]) * w | rope(latent[t, c:c+r]) ], each part rounded
 * once to bf16 (the norm as mci_rms_norm computes it: within float32 rounding of the eager
 * norm; the rope part bit for bit). latent [T, c + r] bf16 with row
 * stride ld; cache [*, c + r] bf16 contiguous. */
void mci_write_latent_rows(const uint16_t *latent, long ld, const uint16_t *w, float eps,
                           const float *cos, const float *sin, int interleave,
                           uint16_t *cache, const int64_t *slots, long tokens, long c, long r) {
    const long d = c + r;
#pragma omp parallel for schedule(static) if (tokens >= 64)
    for (long t = 0; t < tokens; t++) {
        uint16_t *row = cache + slots[t] * d;
        mci_rms_norm(latent + t * ld, ld, 1, w, row, 1, 1, c, eps);
        rope_row(latent + t * ld + c, cos + t * (r / 2), sin + t * (r / 2), r, interleave, row + c);
    }
}
