/* FP8 e4m3 weights with 128x128 block scales (DeepSeek-V3's native format) read in place by
 * the skinny matmuls: no bf16 copy of a weight, in memory or per call.
 *
 * The reference is dequantise-then-multiply: W = bf16(float(q) * scale_inv[block]) (Linear.
 * dense_weight), then bf16 products summed in float32. A block's 128 possible magnitudes give
 * 128 possible dequantised values, so each (scale row, column block) gets a lookup table of
 * them, built when a thread reaches that scale row (`build_tables`: 128 products rounded to
 * bf16 exactly as torch rounds them, so the table holds the reference's own bf16 weights,
 * bit for bit), and 64 weights at a time are widened with two byte lookups (vpermi2b, one for
 * each byte of the bf16 value), the sign bit put back, and the bytes interleaved into words.
 * The words then go through the same vdpbf16ps sums, in the same order, as cpu_matvec.c's
 * bf16 kernel on the dequantised weight: an FP8 matmul's result is bit for bit that kernel's
 * on `dense_weight` up to REGISTER_ROWS rows (at any count with `skinny_order`), and within
 * float32 summation order of torch's F.linear on it.
 *
 * Rows of x: up to REGISTER_ROWS, each weight chunk is widened in registers and used at once,
 * TOKENS rows of x per pass (decode steps: the weight bytes are read once, half the bf16
 * kernel's traffic). More rows (prefill chunks, busy experts), cpu_gemm.c's GEMM: a strip of
 * weight rows is widened once into a cache-resident bf16 tile and multiplied there. Each
 * output's sum then runs over the column pairs in order: another order than the skinny
 * kernels' (within float32 summation order of it, as oneDNN's is for bf16). With
 * `skinny_order` (the model's batch invariance) every row count takes the skinny kernels'
 * order instead, through a bf16 tile of TILE rows.
 */
#include <string.h>

#include "cpu_kernels.h"

/* vpermb / vpermi2b (AVX512-VBMI) in this file's functions only: the rest of the library runs
 * on CPUs without them (cpu_kernels.py uses this file only where the CPU has VBMI). */
#pragma GCC target("avx512vbmi")

#define TOKENS 4 /* rows of x per pass (cpu_matvec.c's bf16 kernel takes up to 8) */
#define PREFETCH 4 /* weight rows ahead */
#define TILE 16  /* weight rows widened per scratch tile */
#ifndef REGISTER_ROWS
#define REGISTER_ROWS 16 /* most rows of x widened in registers (in passes of TOKENS rows) */
#endif
#define TABLE 256 /* bytes per (scale row, column block): 128 low bytes, 128 high bytes */

/* float32 value of each e4m3fn magnitude (sign bit clear): 0..126 finite, 127 NaN */
static float e4m3_magnitude(int i) {
    const int e = (i >> 3) & 15, m = i & 7;
    if (i == 127) return NAN;
    return e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
}

static float MAGNITUDES[128];

__attribute__((constructor)) static void init_magnitudes(void) {
    for (int i = 0; i < 128; i++) MAGNITUDES[i] = e4m3_magnitude(i);
}

/* tables [nbk][TABLE] for one scale row (scale [nbk]): entry i of block b is
 * bf16(MAGNITUDES[i] * scale[b]), rounded as round_bf16 (torch's float -> bf16) rounds. */
static void build_tables(const float *scale, long nbk, uint8_t *tables) {
    for (long b = 0; b < nbk; b++) {
        const __m512 s = _mm512_set1_ps(scale[b]);
        uint8_t *t = tables + b * TABLE;
        for (int i = 0; i < 128; i += 16) {
            const __m512i r = rne32(_mm512_mul_ps(_mm512_loadu_ps(MAGNITUDES + i), s));
            _mm_storeu_si128((__m128i *)(t + i), _mm512_cvtepi32_epi8(r));
            _mm_storeu_si128((__m128i *)(t + 128 + i), _mm512_cvtepi32_epi8(_mm512_srli_epi32(r, 8)));
        }
    }
}

/* The byte order that makes the in-lane byte interleave (unpacklo/hi_epi8) give words in
 * element order: lane l's low 8 bytes are elements 8l..8l+7, its high 8 bytes 32+8l..32+8l+7. */
static inline __m512i interleave_order(void) {
    uint8_t order[64];
    for (int l = 0; l < 4; l++)
        for (int j = 0; j < 8; j++) {
            order[16 * l + j] = (uint8_t)(8 * l + j);
            order[16 * l + 8 + j] = (uint8_t)(32 + 8 * l + j);
        }
    return _mm512_loadu_si512(order);
}

/* A column block's table in registers */
typedef struct {
    __m512i lo0, lo1, hi0, hi1;
} Table;

static inline Table load_table(const uint8_t *t) {
    Table r = {_mm512_loadu_si512(t), _mm512_loadu_si512(t + 64), _mm512_loadu_si512(t + 128),
               _mm512_loadu_si512(t + 192)};
    return r;
}

/* 64 e4m3 bytes (q, in element order) -> their dequantised bf16 values, elements 0..31 in *w0
 * and 32..63 in *w1. */
static inline void widen64(__m512i q, const Table *t, __m512i order, __m512i *w0, __m512i *w1) {
    q = _mm512_permutexvar_epi8(order, q);
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, q, t->lo1);
    __m512i hi = _mm512_permutex2var_epi8(t->hi0, q, t->hi1);
    /* the sign: hi ^ (q & 0x80), as float(q) * scale has it for a scale of either sign */
    hi = _mm512_ternarylogic_epi32(hi, q, _mm512_set1_epi8((char)0x80), 0x78);
    *w0 = _mm512_unpacklo_epi8(lo, hi);
    *w1 = _mm512_unpackhi_epi8(lo, hi);
}

static inline __mmask64 byte_mask(long count) {
    return count >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << count) - 1);
}

static inline __mmask32 word_mask(long count) {
    return count >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << count) - 1);
}

/* One 64-column chunk of a weight row wr for T rows of x (see fp8_block): `left` columns of
 * the chunk are real (64 in the loop; masked loads only in a row's tail, since masked loads
 * and stores are slow on some CPUs). */
static inline __attribute__((always_inline)) void fp8_chunk(
    __m512 acc[TOKENS], const uint16_t *x, long ldx, const uint8_t *wr, long k, const Table *t,
    const int T, long kk, long left, __m512i order) {
    __m512i w0, w1;
    if (left >= 64) {
        _mm_prefetch((const char *)(wr + PREFETCH * k + kk), _MM_HINT_T0);
        widen64(_mm512_loadu_si512(wr + kk), t, order, &w0, &w1);
        for (int j = 0; j < T; j++) {
            const uint16_t *xr = x + j * ldx + kk;
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xr));
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)w1,
                                      (__m512bh)_mm512_loadu_si512(xr + 32));
        }
        return;
    }
    widen64(_mm512_maskz_loadu_epi8(byte_mask(left), wr + kk), t, order, &w0, &w1);
    /* past k: zeros, as the bf16 kernel's masked loads give */
    w0 = _mm512_maskz_mov_epi16(word_mask(left), w0);
    w1 = _mm512_maskz_mov_epi16(word_mask(left > 32 ? left - 32 : 0), w1);
    for (int j = 0; j < T; j++) {
        const uint16_t *xr = x + j * ldx + kk;
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)w0,
                                  (__m512bh)_mm512_maskz_loadu_epi16(word_mask(left), xr));
        if (left > 32)
            acc[j] = _mm512_dpbf16_ps(
                acc[j], (__m512bh)w1,
                (__m512bh)_mm512_maskz_loadu_epi16(word_mask(left - 32), xr + 32));
    }
}

/* Row n of w (its scale row's tables: `tables`) for T rows of x, in registers. One weight row
 * at a time, so the weight is read in address order (why, and the bf16 figures: cpu_matvec.c's
 * group_rows, P = 1; FP8 cold from DRAM on a Zen 4 EPYC, one row of x: 4 rows interleaved read
 * 512x512 at 15 GB/s and 8192x512 at 19, one row at a time 24 and 30). The sums: one float32
 * accumulator per output, fed 32 columns per vdpbf16ps in column order, the tail masked, then
 * reduced: cpu_matvec.c's group_rows, term for term (its reduce16 adds the same pairs). */
static inline __attribute__((always_inline)) void fp8_block(
    const uint16_t *x, long ldx, const uint8_t *w, long k, const uint8_t *tables,
    const Sink *y, const int T, long n, __m512i order) {
    __m512 acc[TOKENS];
    for (int j = 0; j < T; j++) acc[j] = _mm512_setzero_ps();
    const uint8_t *wr = w + n * k;
    const long k_full = k & ~127L;
    for (long kk = 0; kk < k_full; kk += 128) { /* whole column blocks: one table each */
        const Table t = load_table(tables + (kk >> 7) * TABLE);
        fp8_chunk(acc, x, ldx, wr, k, &t, T, kk, 64, order);
        fp8_chunk(acc, x, ldx, wr, k, &t, T, kk + 64, 64, order);
    }
    if (k_full < k) {
        const Table t = load_table(tables + (k_full >> 7) * TABLE);
        for (long kk = k_full; kk < k; kk += 64)
            fp8_chunk(acc, x, ldx, wr, k, &t, T, kk, k - kk, order);
    }
    for (int j = 0; j < T; j++) store(y, j, n, _mm512_reduce_add_ps(acc[j]));
}

/* Rows [n0, n1) of w widened into bf16 rows tile [n1 - n0, k]. */
static void widen_rows(const uint8_t *w, long k, const float *scale, long nbk,
                       const int64_t *row_block, long n0, long n1, uint8_t *tables,
                       long *table_row, uint16_t *tile) {
    const __m512i order = interleave_order();
    for (long n = n0; n < n1; n++) {
        if (row_block[n] != *table_row) {
            *table_row = row_block[n];
            build_tables(scale + *table_row * nbk, nbk, tables);
        }
        uint16_t *out = tile + (n - n0) * k;
        const uint8_t *wr = w + n * k;
        long kk = 0;
        for (; kk + 64 <= k; kk += 64) {
            const Table t = load_table(tables + (kk >> 7) * TABLE);
            __m512i w0, w1;
            widen64(_mm512_loadu_si512(wr + kk), &t, order, &w0, &w1);
            _mm512_storeu_si512(out + kk, w0);
            _mm512_storeu_si512(out + kk + 32, w1);
        }
        if (kk < k) {
            const Table t = load_table(tables + (kk >> 7) * TABLE);
            __m512i w0, w1;
            widen64(_mm512_maskz_loadu_epi8(byte_mask(k - kk), wr + kk), &t, order, &w0, &w1);
            _mm512_mask_storeu_epi16(out + kk, word_mask(k - kk), w0);
            if (k - kk > 32) _mm512_mask_storeu_epi16(out + kk + 32, word_mask(k - kk - 32), w1);
        }
    }
}

static void fp8_rows_tokens(const uint16_t *x, long ldx, const uint8_t *w, long k,
                            const float *scale, long nbk, const int64_t *row_block,
                            const Sink *y, const int T, long n0, long n1, uint8_t *tables,
                            long *table_row) {
    const __m512i order = interleave_order();
    long n = n0;
    while (n < n1) {
        if (row_block[n] != *table_row) {
            *table_row = row_block[n];
            build_tables(scale + *table_row * nbk, nbk, tables);
        }
        switch (T) { /* one row at a time, its scale row's tables built above */
        case 1: fp8_block(x, ldx, w, k, tables, y, 1, n, order); break;
        case 2: fp8_block(x, ldx, w, k, tables, y, 2, n, order); break;
        case 3: fp8_block(x, ldx, w, k, tables, y, 3, n, order); break;
        default: fp8_block(x, ldx, w, k, tables, y, 4, n, order); break;
        }
        n++;
    }
}

/* The GEMM's source of bf16 weight rows: the FP8 rows widened into a tile (widen_rows). */
typedef struct {
    GemmRows base;
    const uint8_t *w;
    long k, nbk;
    const float *scale;
    const int64_t *row_block;
    uint8_t *tables;
    long *table_row;
} Fp8Rows;

static const uint16_t *fp8_strip(const GemmRows *self, long s0, long s1, uint16_t *tile) {
    const Fp8Rows *f = (const Fp8Rows *)self;
    widen_rows(f->w, f->k, f->scale, f->nbk, f->row_block, s0, s1, f->tables, f->table_row,
               tile);
    return tile;
}

/* The most rows an FP8 matmul sums in the skinny kernels' order (cpu_kernels.py reads it). */
int mci_fp8_skinny_rows(void) { return REGISTER_ROWS; }

void mci_fp8_rows_range(const uint16_t *x, long ldx, const Weight *wt, long k, Sink y, long m,
                        long n0, long n1) {
    if (n1 <= n0 || m <= 0) return;
    const long nbk = (k + 127) / 128;
    const uint8_t *w = (const uint8_t *)wt->data;
    uint8_t *tables = malloc(nbk * TABLE);
    long table_row = -1;
    if (m <= REGISTER_ROWS) { /* TOKENS rows at a time, each pass widening in registers */
        for (long r = 0; r < m; r += TOKENS) {
            const Sink yr = sink_rows(y, r);
            const int rows = m - r < TOKENS ? (int)(m - r) : TOKENS;
            fp8_rows_tokens(x + r * ldx, ldx, w, k, wt->scale, nbk, wt->row_block, &yr, rows,
                            n0, n1, tables, &table_row);
        }
    } else if (!wt->skinny_order) {
        const Fp8Rows rows = {{fp8_strip}, w, k, nbk, wt->scale, wt->row_block, tables, &table_row};
        mci_gemm(x, ldx, k, y, m, n0, n1, &rows.base);
    } else {
        uint16_t *tile = malloc(sizeof(uint16_t) * TILE * k);
        uint16_t *packed = aligned_alloc(64, sizeof(uint16_t) * mci_packed_size(m, k));
        mci_pack(x, ldx, m, k, packed); /* once for every tile */
        for (long t0 = n0; t0 < n1; t0 += TILE) {
            const long t1 = t0 + TILE < n1 ? t0 + TILE : n1;
            widen_rows(w, k, wt->scale, nbk, wt->row_block, t0, t1, tables, &table_row, tile);
            /* the tile's rows are weight rows t0.. : shift the sink's columns to match */
            Sink ys = y;
            if (ys.acc) ys.acc += t0;
            else ys.y += t0;
            mci_packed_rows_range(packed, tile, k, ys, m, 0, t1 - t0);
        }
        free(packed);
        free(tile);
    }
    free(tables);
}
