/* Matmuls of many rows on AVX512-BF16 (prefill chunks, busy routed experts): a GEMM whose
 * outputs need no horizontal sums. A strip of STRIP weight rows, as bf16 rows (read in place,
 * or widened from FP8 by cpu_fp8.c into a tile), is packed pair-interleaved and multiplied
 * with MR rows of x at a time, each x pair broadcast against 16 outputs per vdpbf16ps. Each
 * output's sum runs over the column pairs in order, whatever the number of rows: a row's
 * result never depends on the other rows of the call. That order is not the skinny kernels'
 * (cpu_matvec.c: 16 lanes reduced at the end), so the two agree within float32 summation
 * order, as oneDNN's matmul does with either.
 *
 * Where it runs: FP8 weights above REGISTER_ROWS rows (cpu_fp8.c), and routed experts with
 * more tokens than the skinny kernels take, where the CPU has no AMX (cpu_moe.c). Measured on
 * a 2-core Zen 4 EPYC: 132 rows x a 512x512 weight at 266 GFLOP/s (FP8, widening included),
 * oneDNN's bf16 matmul at 289. */
#include "cpu_kernels.h"

#define STRIP 32 /* weight rows per GEMM strip: two vectors of 16 outputs */
#define MR 8      /* rows of x per GEMM microkernel: 16 accumulators hide vdpbf16ps's latency */
#define MC 128    /* rows of x per pass over a group of strips (they stay in L2 meanwhile) */

/* tile rows [count][k] (bf16, row-major) -> packed [ceil(k/2)][STRIP] dwords: (rows[f][2p],
 * rows[f][2p + 1]) at [p][f]; zero past `count` rows and past k. */
static void pack_pairs(const uint16_t *tile, long count, long k, uint32_t *packed) {
    const long pairs = (k + 1) / 2;
    if (!(k & 1) && count == STRIP) { /* whole rows of dwords: 16x16 transposes */
        for (long f0 = 0; f0 < STRIP; f0 += 16)
            for (long p0 = 0; p0 < pairs; p0 += 16) {
                const int left = pairs - p0 < 16 ? (int)(pairs - p0) : 16;
                const __mmask16 m = (__mmask16)((1u << left) - 1);
                __m512i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = _mm512_maskz_loadu_epi32(m, (const int *)(tile + (f0 + i) * k) + p0);
                transpose16(r);
                for (int c = 0; c < left; c++)
                    _mm512_storeu_si512(packed + (p0 + c) * STRIP + f0, r[c]);
            }
        return;
    }
    for (long p = 0; p < pairs; p++)
        for (long f = 0; f < STRIP; f++) {
            uint32_t v = 0;
            if (f < count) {
                const uint16_t lo = tile[f * k + 2 * p];
                const uint16_t hi = 2 * p + 1 < k ? tile[f * k + 2 * p + 1] : 0;
                v = lo | (uint32_t)hi << 16;
            }
            packed[p * STRIP + f] = v;
        }
}

/* Outputs [0, count) of a packed strip for T rows of x into the sink (its columns from the
 * strip's first weight row). */
static inline __attribute__((always_inline)) void gemm_rows(
    const uint16_t *x, long ldx, long k, const uint32_t *packed, long count, const Sink *y,
    const int T) {
    __m512 acc[MR][2];
    for (int j = 0; j < T; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    const long whole = k / 2; /* column pairs inside k; an odd k has one more, half zero */
    for (long p = 0; p < whole; p++) {
        const __m512i w0 = _mm512_loadu_si512(packed + p * STRIP);
        const __m512i w1 = _mm512_loadu_si512(packed + p * STRIP + 16);
        for (int j = 0; j < T; j++) {
            int pair;
            __builtin_memcpy(&pair, x + j * ldx + 2 * p, 4);
            const __m512i xb = _mm512_set1_epi32(pair);
            acc[j][0] = _mm512_dpbf16_ps(acc[j][0], (__m512bh)xb, (__m512bh)w0);
            acc[j][1] = _mm512_dpbf16_ps(acc[j][1], (__m512bh)xb, (__m512bh)w1);
        }
    }
    if (k & 1) {
        const __m512i w0 = _mm512_loadu_si512(packed + whole * STRIP);
        const __m512i w1 = _mm512_loadu_si512(packed + whole * STRIP + 16);
        for (int j = 0; j < T; j++) {
            const __m512i xb = _mm512_set1_epi32(x[j * ldx + k - 1]);
            acc[j][0] = _mm512_dpbf16_ps(acc[j][0], (__m512bh)xb, (__m512bh)w0);
            acc[j][1] = _mm512_dpbf16_ps(acc[j][1], (__m512bh)xb, (__m512bh)w1);
        }
    }
    for (int j = 0; j < T; j++) {
        if (!y->acc && count == STRIP) { /* bf16 rows: 16 at a time, round_bf16's bits */
            _mm256_storeu_si256((__m256i *)(y->y + j * y->ldy), rne16(acc[j][0]));
            _mm256_storeu_si256((__m256i *)(y->y + j * y->ldy + 16), rne16(acc[j][1]));
            continue;
        }
        if (count == STRIP) { /* weighted into float32 rows: store()'s steps, 16 at a time */
            float *row = y->acc + y->tok[j] * y->ldy;
            const __m512 wt = _mm512_set1_ps(y->wt[j]);
            for (int h = 0; h < 2; h++) {
                const __m512 v = _mm512_mul_ps(widen16(rne16(acc[j][h])), wt);
                _mm512_storeu_ps(row + 16 * h, _mm512_add_ps(_mm512_loadu_ps(row + 16 * h), v));
            }
            continue;
        }
        float sums[STRIP];
        _mm512_storeu_ps(sums, acc[j][0]);
        _mm512_storeu_ps(sums + 16, acc[j][1]);
        for (long f = 0; f < count; f++) store(y, j, f, sums[f]);
    }
}

#define PACKED_BYTES (256 << 10) /* most bytes of packed strips held at once, per thread */

/* Strips are packed once per group of strips (at most PACKED_BYTES), and every MC rows of x
 * pass over the group: a segment of up to MC rows (a busy expert's) packs each strip once. */
void mci_gemm(const uint16_t *x, long ldx, long k, Sink y, long m, long n0, long n1,
              const GemmRows *rows) {
    const long per_strip = STRIP * ((k + 1) / 2); /* dwords of one packed strip */
    const long strips = (n1 - n0 + STRIP - 1) / STRIP;
    if (strips <= 0 || m <= 0) return;
    long group = PACKED_BYTES / (long)(sizeof(uint32_t) * per_strip);
    if (group < 1) group = 1;
    if (group > strips) group = strips;
    uint16_t *tile = malloc(sizeof(uint16_t) * STRIP * k);
    uint32_t *packed = malloc(sizeof(uint32_t) * per_strip * group);
    for (long g0 = n0; g0 < n1; g0 += group * STRIP) {
        const long g1 = g0 + group * STRIP < n1 ? g0 + group * STRIP : n1;
        for (long s0 = g0; s0 < g1; s0 += STRIP) {
            const long s1 = s0 + STRIP < g1 ? s0 + STRIP : g1;
            pack_pairs(rows->strip(rows, s0, s1, tile), s1 - s0, k,
                       packed + (s0 - g0) / STRIP * per_strip);
        }
        for (long c0 = 0; c0 < m; c0 += MC) {
            const long c1 = c0 + MC < m ? c0 + MC : m;
            for (long s0 = g0; s0 < g1; s0 += STRIP) {
                const long count = (s0 + STRIP < g1 ? s0 + STRIP : g1) - s0;
                const uint32_t *strip = packed + (s0 - g0) / STRIP * per_strip;
                Sink ys = sink_rows(y, c0);
                if (ys.acc) ys.acc += s0;
                else ys.y += s0;
                for (long r = c0; r < c1; r += MR) {
                    const Sink yr = sink_rows(ys, r - c0);
                    const uint16_t *xr = x + r * ldx;
                    switch (c1 - r < MR ? (int)(c1 - r) : MR) {
                    case 1: gemm_rows(xr, ldx, k, strip, count, &yr, 1); break;
                    case 2: gemm_rows(xr, ldx, k, strip, count, &yr, 2); break;
                    case 3: gemm_rows(xr, ldx, k, strip, count, &yr, 3); break;
                    case 4: gemm_rows(xr, ldx, k, strip, count, &yr, 4); break;
                    case 5: gemm_rows(xr, ldx, k, strip, count, &yr, 5); break;
                    case 6: gemm_rows(xr, ldx, k, strip, count, &yr, 6); break;
                    case 7: gemm_rows(xr, ldx, k, strip, count, &yr, 7); break;
                    default: gemm_rows(xr, ldx, k, strip, count, &yr, 8); break;
                    }
                }
            }
        }
    }
    free(packed);
    free(tile);
}

/* A bf16 weight's rows are the strip itself: read in place, no tile. */
typedef struct {
    GemmRows base;
    const uint16_t *w;
    long k;
} Bf16Rows;

static const uint16_t *bf16_strip(const GemmRows *self, long s0, long s1, uint16_t *tile) {
    (void)s1, (void)tile;
    const Bf16Rows *b = (const Bf16Rows *)self;
    return b->w + s0 * b->k;
}

void mci_bf16_gemm(const uint16_t *x, long ldx, const uint16_t *w, long k, Sink y, long m,
                   long n0, long n1) {
    const Bf16Rows rows = {{bf16_strip}, w, k};
    mci_gemm(x, ldx, k, y, m, n0, n1, &rows.base);
}
