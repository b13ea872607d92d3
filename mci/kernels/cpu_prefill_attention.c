/* Prefill attention's scores and softmax on the CPU: P = softmax(scale * Q K^T) per row, over
 * each row's first limits[r] keys, in one pass, the scores never leaving float32.
 *
 * Why: torch's CPU flash-attention kernel reached ~65 G multiply-adds/s on an AMD EPYC (Zen 5,
 * avx512_bf16, no AMX) for the `small` model's heads (qk 96, v 64), where oneDNN's bf16 matmul
 * reaches ~300-400; a 1,056-token prefill spent 101 of its 190 ms in it. Here the scores run on
 * vdpbf16ps (exact bf16 products, float32 sums), the softmax on the same vector exp as the
 * decode kernel, and the caller multiplies P by V with oneDNN's bf16 matmul
 * (CpuKernels.prefill_attention in cpu_kernels.py).
 *
 * Layouts (bf16 unless noted; G = batch x heads):
 *   q      [B, H, Q, d], d even, unit element stride, any other strides (ld_qb, ld_qh, ld_qr
 *          elements, even: a row's pairs are 4-byte aligned)
 *   kp     [G, Lb, d/2, 16, 2]: keys in blocks of 16, each block pair-interleaved (key j's dims
 *          2t, 2t+1 at [t][j][0..1]), as vdpbf16ps takes them; Lb = ceil(L / 16), zero pad keys
 *          (mci_pack_keys lays keys out so)
 *   limits int64 [B, Q] (ld_limits = Q) or [1, Q] shared (ld_limits = 0): row r of sequence b
 *          sees keys 0 .. limits[b, r] - 1 (causal and pad masks are both such prefixes)
 *   p      [G, Q, Lp] (Lp a multiple of 16, <= 16 Lb, and no limit above it): the
 *          probabilities, rounded once to bf16, zero past each row's limit
 *   lse    float32 [G, Q]: log sum exp of the row's scaled scores (-inf for an empty row)
 * A row's result depends only on its own query, its keys and its limit: each row is computed
 * alone, in the same order of sums, whatever the other rows, the batch or the threads. */
#include <string.h>

#include "cpu_kernels.h"

#define ROWS 8 /* query rows per block: 8 accumulators share each key load */
#define AMX_ROWS_BLOCK 32 /* on AMX: two tiles of 16 query rows share each key tile */

static void scores_block(const uint16_t *q, long ldq, long d, const uint16_t *kp, long nkb,
                         int rows, float scale, float *s, long lds) {
    const long pairs = d / 2;
    const uint32_t *qp[ROWS];
    for (int r = 0; r < ROWS; r++) qp[r] = (const uint32_t *)(q + (r < rows ? r : 0) * ldq);
    for (long kb = 0; kb < nkb; kb++) {
        const uint16_t *kblk = kp + kb * pairs * 32;
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
        for (long t = 0; t < pairs; t++) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512(kblk + t * 32);
            for (int r = 0; r < ROWS; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], kv, (__m512bh)_mm512_set1_epi32((int)qp[r][t]));
        }
        const __m512 vs = _mm512_set1_ps(scale);
        for (int r = 0; r < rows; r++) _mm512_storeu_ps(s + r * lds + kb * 16, _mm512_mul_ps(acc[r], vs));
    }
}

/* The row's softmax; s (its scaled scores) is overwritten with their exps. The maximum runs
 * over 16 lanes, then across them: max is exact, and a NaN score is skipped either way (as
 * the plain loop's comparison skipped it), so mx is the plain loop's. Each exp is computed
 * once (pass 1 keeps it for pass 2), the same vector exp of the same value as before.
 * Measured against the scalar maximum and two exps, alternating in one process on a 2-core
 * Zen 4 EPYC, outputs bit-equal: 992 query rows of 8 heads over a 1,024-token shared prefix
 * (a burst on one system prompt) 16.0 -> 13.2 ms a call, a causal 1,056-token prefill 12.5 ->
 * 11.0 ms. */
static float row_max(const float *s, long limit) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    long l = 0;
    for (; l + 16 <= limit; l += 16) vmax = _mm512_max_ps(_mm512_loadu_ps(s + l), vmax);
    float mx = _mm512_reduce_max_ps(vmax);
    for (; l < limit; l++) mx = s[l] > mx ? s[l] : mx;
    return mx;
}

/* One row's probabilities (cpu_kernels.h); mx: its maximum over its first `limit` scores
 * (row_max's value) */
void mci_softmax_probs(float *s, long limit, float mx, long lp, uint16_t *p, float *lse) {
    long l;
    const __m512 vmx = _mm512_set1_ps(mx);
    /* pass 1: the sum of exps (the same vector order for every row of this limit) */
    __m512 vsum = _mm512_setzero_ps();
    for (l = 0; l + 16 <= limit; l += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + l), vmx));
        _mm512_storeu_ps(s + l, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (l < limit) {
        const __mmask16 m = (__mmask16)((1u << (limit - l)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + l), vmx)));
        _mm512_mask_storeu_ps(s + l, m, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    const float total = _mm512_reduce_add_ps(vsum);
    *lse = limit > 0 ? mx + logf(total) : -INFINITY;
    /* pass 2: normalised, rounded once, zeros past the limit */
    const __m512 inv = _mm512_set1_ps(limit > 0 ? 1.0f / total : 0.0f);
    for (l = 0; l + 16 <= lp; l += 16) {
        __m512 e = _mm512_setzero_ps();
        if (l < limit) {
            const __mmask16 m = limit - l >= 16 ? (__mmask16)0xffff
                                                : (__mmask16)((1u << (limit - l)) - 1);
            e = _mm512_maskz_loadu_ps(m, s + l);
        }
        _mm256_storeu_si256((__m256i *)(p + l), round16(_mm512_mul_ps(e, inv)));
    }
}

static void softmax_row(float *s, long limit, long lp, uint16_t *p, float *lse) {
    mci_softmax_probs(s, limit, row_max(s, limit), lp, p, lse);
}

/* Work item `item` of (group, block of `per` query rows): sets its group, first row, row
 * count and limits, and returns the most keys any of its rows sees, at most cap. */
static long item_keys(long item, long blocks, long per, long nq, const int64_t *limits,
                      long heads, long ld_limits, long cap, long *g, long *r0, int *rows,
                      const int64_t **lim) {
    *g = item / blocks;
    *r0 = (item % blocks) * per;
    *rows = (int)(nq - *r0 < per ? nq - *r0 : per);
    *lim = limits + (*g / heads) * ld_limits + *r0;
    long kend = 0;
    for (int r = 0; r < *rows; r++) kend = (*lim)[r] > kend ? (*lim)[r] : kend;
    return kend > cap ? cap : kend; /* the caller's promise; never read past it */
}

/* Returns 0, or -1 for what it does not take: odd d or q strides, q or kp not 4-byte aligned
 * (a pair is read as one dword), Lp not a multiple of 16 or above 16 Lb. */
int mci_bf16_prefill_attention_probs(const uint16_t *q, long ld_qb, long ld_qh, long ld_qr,
                                     const uint16_t *kp, const int64_t *limits, long ld_limits,
                                     long groups, long heads, long nq, long d, long lb, long lp,
                                     float scale, uint16_t *p, float *lse) {
    if (d % 2 || lp % 16 || lp > lb * 16 || (ld_qb | ld_qh | ld_qr) % 2 ||
        ((uintptr_t)q | (uintptr_t)kp) % 4)
        return -1;
    const long blocks = (nq + ROWS - 1) / ROWS;
#pragma omp parallel
    {
        float *s = (float *)aligned_alloc(64, (size_t)ROWS * lb * 16 * sizeof(float) + 64);
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < groups * blocks; item++) {
            long g, r0;
            int rows;
            const int64_t *lim;
            const long kend = item_keys(item, blocks, ROWS, nq, limits, heads, ld_limits, lp, &g,
                                        &r0, &rows, &lim); /* at most P's row */
            const long nkb = (kend + 15) / 16;
            const uint16_t *qg = q + (g / heads) * ld_qb + (g % heads) * ld_qh;
            scores_block(qg + r0 * ld_qr, ld_qr, d, kp + g * lb * (d / 2) * 32, nkb, rows, scale,
                         s, lb * 16);
            for (int r = 0; r < rows; r++) {
                const long limit = lim[r] < nkb * 16 ? lim[r] : nkb * 16;
                softmax_row(s + r * lb * 16, limit, lp, p + (g * nq + r0 + r) * lp,
                            lse + g * nq + r0 + r);
            }
        }
        free(s);
    }
    return 0;
}

/* Keys k [B, H, L, d] (unit element stride, even strides ld_b, ld_h, ld_l elements; a stride
 * of 0 repeats, as torch's expand does) -> kp (4-byte aligned; -1 where it is not, or d or a
 * stride is odd)
 * [B * H, Lb, d/2, 16, 2], the layout above, keys past L zero. One pass: torch's copy of the
 * same permutation (its innermost run two elements long) took ~2.7 ms for `small`'s 4,096-token
 * prefill chunk of one layer on a 2-core Zen 4 EPYC. */
int mci_pack_keys(const uint16_t *k, long ld_b, long ld_h, long ld_l, long batch, long heads,
                  long length, long d, uint16_t *kp) {
    if (d % 2 || (ld_b | ld_h | ld_l) % 2 || (uintptr_t)kp % 4) return -1;
    const long pairs = d / 2, lb = (length + 15) / 16;
#pragma omp parallel for schedule(static) if (batch * heads * lb * pairs >= 4096)
    for (long item = 0; item < batch * heads * lb; item++) {
        const long g = item / lb, blk = item % lb;
        const uint16_t *src = k + (g / heads) * ld_b + (g % heads) * ld_h;
        uint32_t *dst = (uint32_t *)(kp + item * pairs * 32);
        long done = 0; /* pairs packed 16 at a time: a 16 x 16 dword transpose */
#ifdef __AVX512F__
        for (; done + 16 <= pairs; done += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                const long l = blk * 16 + j;
                r[j] = l < length ? _mm512_loadu_si512(src + l * ld_l + 2 * done)
                                  : _mm512_setzero_si512();
            }
            transpose16(r); /* r[p] lane j: key j's pair done + p */
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + (done + p) * 16, r[p]);
        }
#endif
        for (int j = 0; j < 16; j++) {
            const long l = blk * 16 + j;
            if (l >= length) {
                for (long t = done; t < pairs; t++) dst[t * 16 + j] = 0;
                continue;
            }
            const uint16_t *row = src + l * ld_l;
            for (long t = done; t < pairs; t++) {
                uint32_t pair;
                __builtin_memcpy(&pair, row + 2 * t, 4);
                dst[t * 16 + j] = pair;
            }
        }
    }
    return 0;
}

/* ---- The whole of it on AMX tiles (a CPU with AMX-BF16) ----------------------------------------
 * Why: on a 2-core Xeon with AMX-BF16 the scores above run on vdpbf16ps at ~200 GFLOP/s a
 * core pair, where AMX tiles reached 1.4-2.2 TFLOP/s a core (a 32 x 32 block loop, operands
 * in L1 or L2); and P, written to memory by the kernel above and read back by the caller's
 * bmm, is 16 MB a layer for 992 query rows of 8 heads over a 1,024-token shared prefix.
 * Here, for each block of 32 query rows: the scores on AMX (cpu_amx.c's mci_amx_scores: the
 * packed keys are AMX's B layout as they stand), the same softmax as above
 * (mci_softmax_probs: P rounded once to bf16, zero past the row's keys), and P times V on AMX
 * (mci_amx_pv) from P still in this thread's cache, each output rounded once to bf16. Each
 * row's maximum score comes from the scores' scaling pass (the value row_max gives: a maximum
 * is exact in any order), sparing the softmax a pass: measured, 992 query rows of 8 heads
 * over 1,024 keys 2.89-3.08 -> 2.60-2.87 ms a call, 1,056 causal rows 1.99-2.03 -> 1.82-1.98
 * ms (the two builds alternating, medians of 200 calls, 2-core Xeon).
 *
 * What differs from the path above: each score is a float32 sum of exact bf16 products in
 * AMX's order, not vdpbf16ps's (AMX's order inside a tile step cannot be had on vdpbf16ps:
 * cpu_amx.c), so a score may differ in its last float32 bits, and P V's sums are AMX's order
 * where the bmm's are oneDNN's: outputs agree within one bf16 rounding. As above, a row's
 * result depends only on its own query, its keys and its limit, whatever the other rows, the
 * batch or the threads (tests/test_cpu_kernels.py).
 *
 * Layouts: q, kp, limits and lse as mci_bf16_prefill_attention_probs's; d and dv multiples of
 * 32; vp [G, dv/16, Lc, 16, 16, 2] (mci_pack_values; Lc = ceil(L / 32), so Lb = ceil(L / 16)
 * gives Lc = ceil(Lb / 2)); out [G, Q, dv] bf16. Returns 0, or -1 for what it does not take. */
int mci_amx_prefill_attention(const uint16_t *q, long ld_qb, long ld_qh, long ld_qr,
                              const uint16_t *kp, const uint16_t *vp, const int64_t *limits,
                              long ld_limits, long groups, long heads, long nq, long d, long dv,
                              long lb, long lc, float scale, uint16_t *out, float *lse) {
    if (d % 32 || dv % 32 || lc != (lb + 1) / 2 || (ld_qb | ld_qh | ld_qr) % 2 ||
        ((uintptr_t)q | (uintptr_t)kp) % 4)
        return -1;
    const long per = AMX_ROWS_BLOCK, blocks = (nq + per - 1) / per;
    /* the row strides of the scores and of P: 64 bytes more than the keys, so the 32 rows a
     * tile store writes or a tile load reads do not all fall in the same L1 sets (at 1,024
     * keys the scores' rows were 4 KB apart: 992 rows of 8 heads took 4.0 ms, 2.9 with it) */
    const long lds = lb * 16 + 16, width = lc * 32 + 32;
#pragma omp parallel
    {
        float *s = (float *)aligned_alloc(64, sizeof(float) * per * lds + 64);
        /* P of the block. Rows past a partial block's last hold an earlier block's P (zero at
         * first: never uninitialised memory); an AMX output row depends only on its own P row,
         * and only the block's rows are stored. */
        uint16_t *pb = (uint16_t *)calloc((size_t)per * width, sizeof(uint16_t));
        uint16_t *pad = NULL; /* a last block of fewer than 32 rows, zero below */
        float mx[AMX_ROWS_BLOCK]; /* each row's maximum score, from the scores' pass */
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < groups * blocks; item++) {
            long g, r0;
            int rows;
            const int64_t *lim;
            const long kend = item_keys(item, blocks, per, nq, limits, heads, ld_limits, lb * 16,
                                        &g, &r0, &rows, &lim); /* at most the packed keys */
            const long nkb = (kend + 15) / 16, nkc = (kend + 31) / 32;
            const uint16_t *qg = q + (g / heads) * ld_qb + (g % heads) * ld_qh, *qb;
            long ldq = ld_qr;
            if (rows == per) {
                qb = qg + r0 * ld_qr;
            } else {
                if (!pad) pad = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * per * d);
                memset(pad, 0, sizeof(uint16_t) * per * d);
                for (int r = 0; r < rows; r++)
                    memcpy(pad + r * d, qg + (r0 + r) * ld_qr, sizeof(uint16_t) * d);
                qb = pad;
                ldq = d;
            }
            long limit[AMX_ROWS_BLOCK];
            for (int r = 0; r < per; r++) limit[r] = r < rows && lim[r] < nkb * 16 ? lim[r] : nkb * 16;
            mci_amx_scores(qb, ldq, d, kp + g * lb * (d / 2) * 32, nkb, scale, s, lds, limit,
                           mx);
            for (int r = 0; r < rows; r++)
                mci_softmax_probs(s + r * lds, limit[r], mx[r], nkc * 32, pb + r * width,
                                 lse + g * nq + r0 + r);
            mci_amx_pv(pb, width, vp + g * lc * dv * 32, lc, nkc, dv, rows,
                       out + (g * nq + r0) * dv, dv);
        }
        free(pad);
        free(pb);
        free(s);
    }
    return 0;
}

/* Values v [B, H, L, dv] (unit element stride, any other strides, 0 repeating) -> vp
 * [B * H, dv/16, Lc, 16, 16, 2] (Lc = ceil(L / 32)): for each 16 value columns and 32 keys,
 * the pairs of keys interleaved, as AMX's B operand takes them (vp[g][ct][kc][p][c][i] =
 * v[g][32 kc + 2 p + i][16 ct + c]), keys past L zero. dv a multiple of 16; -1 where not. */
int mci_pack_values(const uint16_t *v, long ld_b, long ld_h, long ld_l, long batch, long heads,
                    long length, long dv, uint16_t *vp) {
    if (dv % 16) return -1;
    const long lc = (length + 31) / 32, cols = dv / 16;
#pragma omp parallel for schedule(static) if (batch * heads * lc * dv >= 4096)
    for (long item = 0; item < batch * heads * lc; item++) {
        const long g = item / lc, kc = item % lc;
        const uint16_t *src = v + (g / heads) * ld_b + (g % heads) * ld_h;
        uint16_t *dst = vp + (g * cols * lc + kc) * 512; /* column tile 0's chunk kc */
#ifdef __AVX512F__
        /* a pair of keys' 16 columns at a time: key 2p's in each dword's low half */
        for (int p = 0; p < 16; p++) {
            const long l0 = kc * 32 + 2 * p;
            for (long ct = 0; ct < cols; ct++) {
                const __m512i a = l0 < length ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                    (const __m256i *)(src + l0 * ld_l + ct * 16)))
                                              : _mm512_setzero_si512();
                const __m512i b = l0 + 1 < length
                                      ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                            (const __m256i *)(src + (l0 + 1) * ld_l + ct * 16)))
                                      : _mm512_setzero_si512();
                _mm512_storeu_si512(dst + ct * lc * 512 + p * 32,
                                    _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
            }
        }
#else
        for (int j = 0; j < 32; j++) { /* key 32 kc + j: pair row j / 2, slot j % 2 */
            const long l = kc * 32 + j;
            for (long ct = 0; ct < cols; ct++)
                for (int c = 0; c < 16; c++)
                    dst[ct * lc * 512 + (j / 2) * 32 + c * 2 + j % 2] =
                        l < length ? src[l * ld_l + ct * 16 + c] : 0;
        }
#endif
    }
    return 0;
}

/* Cascade attention's merge (mci/layers/attention.py's _cascade): for query row i = b Q + q
 * and head h, the partial results over the shared prefix, first[h][i] ([1, H, N, dv]), and
 * over the sequence's own positions, second[b][h][q] ([B, H, Q, dv]), weighted by their
 * softmax masses wf, ws (float32 [N, H]):
 *     out[i][h] = (first * wf + second * ws) / (wf + ws)   -> bf16 [N, H, dv]
 * with torch's roundings (each product, the sum, the divisor and the quotient rounded once
 * to float32, then to bf16 by round_bf16): the same bits as the torch ops it replaces for
 * every number (a NaN keeps its sign and payload here; the weights are never NaN: one of
 * each pair is exactly 1), in one pass instead of ~8 over [N, H, dv] float32 temporaries.
 * Unit element stride; strides in elements. */
void mci_merge_partials(const uint16_t *first, long f_ldh, long f_ldn, const uint16_t *second,
                        long s_ldb, long s_ldh, long s_ldq, long q_len, const float *wf,
                        const float *ws, long n, long heads, long dv, uint16_t *out) {
#pragma omp parallel for schedule(static) if (n * heads * dv >= PARALLEL_ELEMENTS)
    for (long i = 0; i < n; i++) {
        const long b = i / q_len, q = i % q_len;
        for (long h = 0; h < heads; h++) {
            const float a = wf[i * heads + h], c = ws[i * heads + h], d = a + c;
            const uint16_t *x = first + h * f_ldh + i * f_ldn;
            const uint16_t *y = second + b * s_ldb + h * s_ldh + q * s_ldq;
            uint16_t *o = out + (i * heads + h) * dv;
            long j = 0;
#ifdef __AVX512F__
            const __m512 va = _mm512_set1_ps(a), vc = _mm512_set1_ps(c), vd = _mm512_set1_ps(d);
            for (; j + 16 <= dv; j += 16) {
                const __m512 px = _mm512_mul_ps(widen16(_mm256_loadu_si256((const __m256i *)(x + j))), va);
                const __m512 py = _mm512_mul_ps(widen16(_mm256_loadu_si256((const __m256i *)(y + j))), vc);
                _mm256_storeu_si256((__m256i *)(o + j),
                                    rne16(_mm512_div_ps(_mm512_add_ps(px, py), vd)));
            }
#endif
            for (; j < dv; j++) {
                const float px = bf16_to_float(x[j]) * a, py = bf16_to_float(y[j]) * c;
                o[j] = round_bf16((px + py) / d);
            }
        }
    }
}
