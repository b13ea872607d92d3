/* Routed experts at prefill sizes on Intel AMX: bf16 tiles, float32 accumulators.
 *
 * Why: a prefill chunk gives every expert a few dozen rows. oneDNN then either loops over
 * the experts (~80 us of call overhead each) or runs one batched matmul over blocks padded
 * to the busiest expert's rows (measured on the `small` model, 256 tokens: 4.4 ms per MoE
 * layer for ~0.4 GMAC, where one dense oneDNN matmul of the same size takes ~0.7 ms). Here
 * each expert's rows run through its weight, pre-packed in AMX's pair-interleaved layout,
 * in one call for all experts, with no padding beyond a tile of rows.
 *
 * A weight [n, k] is packed as tiles of 16 output features x 32 inputs:
 *   packed[nb][kb][r][2c + i] = w[16 nb + c][32 kb + 2 r + i]     (r < 16, c < 16, i < 2)
 * so that one tile-load gives tdpbf16ps its B operand. n and k must be multiples of 32.
 *
 * Each output element is a float32 sum of exact bf16 products, in AMX's order (pairs, then
 * 16 pairs per tile step), rounded once to bf16: within one bf16 ulp of the other paths,
 * as the grouped batched matmul this replaces is. Results go through the same sinks as
 * cpu_matvec.c's (bf16 rows, or the weighted per-token float32 sum of the MoE), threads
 * owning disjoint output features, so the sum's order over rows is the rows' order; or
 * (mci_amx_packed_linear, one weight) disjoint blocks of rows, which a weighted sum allows
 * only where no two rows add into the same token's sum (the shared experts: row r, token r).
 * Either way each output element is computed whole by one thread, so its bits never depend
 * on the split. */
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_kernels.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Ask the kernel for the AMX tile state (once per process; oneDNN asks too). 0 when granted. */
int mci_amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void configure_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* w [experts, n, k] bf16 -> out in the tile layout above, expert after expert. */
void mci_amx_pack(const uint16_t *w, long experts, long n, long k, uint16_t *out) {
#pragma omp parallel for schedule(static)
    for (long e = 0; e < experts; e++) {
        const uint16_t *we = w + e * n * k;
        uint16_t *oe = out + e * n * k;
        for (long nb = 0; nb < n / 16; nb++)
            for (long kb = 0; kb < k / 32; kb++) {
                uint16_t *tile = oe + (nb * (k / 32) + kb) * 512;
                for (long r = 0; r < 16; r++)
                    for (long c = 0; c < 16; c++)
                        for (long i = 0; i < 2; i++)
                            tile[r * 32 + 2 * c + i] = we[(16 * nb + c) * k + 32 * kb + 2 * r + i];
            }
    }
}

/* 32 rows of a (row stride lda elements) x 32 output columns: two tile columns b0, b1 of a
 * packed B operand (kblocks tiles of 1 KB each, in k order) -> c [32][32] float32. */
static inline void block_32x32(const uint16_t *a, long lda, const uint16_t *b0,
                               const uint16_t *b1, long kblocks, float *c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (long kb = 0; kb < kblocks; kb++) {
        _tile_loadd(4, a + kb * 32, lda * 2);
        _tile_loadd(5, a + 16 * lda + kb * 32, lda * 2);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
}

/* block_32x32's first 16 rows (c [16][32]): the same sums, for a block whose other rows are
 * not wanted (a decode work item of 16 heads or fewer, an expert's last 16 rows or fewer). */
static inline void block_16x32(const uint16_t *a, long lda, const uint16_t *b0,
                               const uint16_t *b1, long kblocks, float *c) {
    _tile_zero(0);
    _tile_zero(1);
    for (long kb = 0; kb < kblocks; kb++) {
        _tile_loadd(4, a + kb * 32, lda * 2);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
}

/* The first `rows` rows of c [32][32] (output features n0 .. n0 + 31) into the sink, as
 * cpu_matvec.c's store() does element by element. */
static inline void store_block(const Sink *s, long rows, long n0, const float *c) {
    for (long r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++) {
            const __m256i b = round16(_mm512_load_ps(c + r * 32 + 16 * h));
            if (s->acc) {
                const __m512 v = widen16(b);
                float *acc = s->acc + s->tok[r] * s->ldy + n0 + 16 * h;
                _mm512_storeu_ps(acc, _mm512_add_ps(_mm512_loadu_ps(acc),
                                                    _mm512_mul_ps(v, _mm512_set1_ps(s->wt[r]))));
            } else {
                _mm256_storeu_si256((__m256i *)(s->y + r * s->ldy + n0 + 16 * h), b);
            }
        }
}

/* A block's first `rows` rows of c [32][32], gate features in its first 16 columns and the
 * matching up features in its last 16 (a gate_up weight packed interleaved: cpu_kernels.h),
 * into the sink's bf16 rows as 16 activations from column f0: each of g and u rounded to
 * bf16 as store_block would store them, then silu_mul16, so the same bits as storing both
 * and running cpu_moe.c's silu_mul over them. */
static inline void store_gated(const Sink *s, long rows, long f0, const float *c) {
    for (long r = 0; r < rows; r++) {
        const __m256i g = round16(_mm512_load_ps(c + r * 32));
        const __m256i u = round16(_mm512_load_ps(c + r * 32 + 16));
        _mm256_storeu_si256((__m256i *)(s->y + r * s->ldy + f0), silu_mul16(g, u));
    }
}

/* For each segment s, rows [starts[s], starts[s] + counts[s]) of x [*, k] (row stride ldx)
 * through expert ids[s] of the packed weights [experts, n, k], into the sink y (row r of
 * the segment is sink row starts[s] + r): the outputs, or with `gated` their SiLU-gated
 * activations (store_gated). n and k multiples of 32. */
static inline void experts_into(const uint16_t *x, long ldx, const uint16_t *packed, Sink y,
                                const int64_t *ids, const int64_t *starts,
                                const int64_t *counts, long segments, long n, long k,
                                int gated, int by_rows) {
    const long kblocks = k / 32, pairs = n / 32;
#pragma omp parallel
    {
        configure_tiles();
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
        /* each thread's share: output pairs of every block of rows, or (by_rows) every pair
         * of its blocks of rows */
        const long p0 = by_rows ? 0 : pairs * id / count;
        const long p1 = by_rows ? pairs : pairs * (id + 1) / count;
        uint16_t *pad = aligned_alloc(64, 32 * k * sizeof(uint16_t));
        float c[32 * 32] __attribute__((aligned(64)));
        for (long s = 0; s < segments; s++) {
            const uint16_t *wp = packed + ids[s] * n * k;
            const long blocks = (counts[s] + 31) / 32;
            const long b0 = by_rows ? blocks * id / count : 0;
            const long b1 = by_rows ? blocks * (id + 1) / count : blocks;
            for (long r0 = 32 * b0; r0 < counts[s] && r0 < 32 * b1; r0 += 32) {
                const long rows = counts[s] - r0 < 32 ? counts[s] - r0 : 32;
                /* a last block of 16 rows or fewer runs on half the tiles: the same sums for
                 * its rows (each row's sum never depends on the others), half the work */
                const long height = rows > 16 ? 32 : 16;
                const uint16_t *a = x + (starts[s] + r0) * ldx;
                long lda = ldx;
                if (rows < height) { /* the segment's last rows, zero-padded to a block */
                    for (long r = 0; r < height; r++) {
                        if (r < rows)
                            memcpy(pad + r * k, a + r * ldx, k * sizeof(uint16_t));
                        else
                            memset(pad + r * k, 0, k * sizeof(uint16_t));
                    }
                    a = pad;
                    lda = k;
                }
                const Sink block = sink_rows(y, starts[s] + r0);
                for (long p = p0; p < p1; p++) {
                    const uint16_t *b0 = wp + 2 * p * kblocks * 512;
                    if (height == 32)
                        block_32x32(a, lda, b0, b0 + kblocks * 512, kblocks, c);
                    else
                        block_16x32(a, lda, b0, b0 + kblocks * 512, kblocks, c);
                    if (gated)
                        store_gated(&block, rows, 16 * p, c);
                    else
                        store_block(&block, rows, 32 * p, c);
                }
            }
        }
        free(pad);
        _tile_release();
    }
}

void mci_amx_experts_into(const uint16_t *x, long ldx, const uint16_t *packed, Sink y,
                          const int64_t *ids, const int64_t *starts, const int64_t *counts,
                          long segments, long n, long k) {
    experts_into(x, ldx, packed, y, ids, starts, counts, segments, n, k, 0, 0);
}

/* (cpu_kernels.h) One weight, every row: the threads split the blocks of rows, each reading
 * only its own rows of x and the whole weight (a few hundred KB: in its L2), not every row
 * for half the outputs. */
void mci_amx_packed_linear(const uint16_t *x, long ldx, const uint16_t *packed, Sink y, long m,
                           long n, long k, int gated) {
    const int64_t id = 0, start = 0, count = m;
    experts_into(x, ldx, packed, y, &id, &start, &count, 1, n, k, gated, 1);
}

/* (cpu_kernels.h) The activations straight from the tiles: no [rows, 2 inter] output written
 * and read back by a separate pass. */
void mci_amx_gated_experts_into(const uint16_t *x, long ldx, const uint16_t *packed, Sink y,
                                const int64_t *ids, const int64_t *starts,
                                const int64_t *counts, long segments, long n, long k) {
    experts_into(x, ldx, packed, y, ids, starts, counts, segments, n, k, 1, 0);
}

/* ---- Decode-sized matmuls, the weight read in place ------------------------------------------
 * Why: from a few rows on, the skinny kernels' vdpbf16ps is the limit on a CPU with AMX
 * (one such port a core): a 1,536 x 512 weight, cold, took 184 us at 8 rows and 271 at 32 on
 * the skinny kernels, 73 and 77 here (a 2-core Xeon with AMX-BF16). Where it runs:
 * cpu_kernels.py's AMX_ROWS. AMX needs no packed copy of
 * the weight for this: its rows are the A operand, 16 rows of 32 inputs a tile, loaded in
 * place with the row stride; x is the B operand, packed per call (16 tokens a tile, pairs
 * interleaved), and each C tile [16 features][16 tokens] is transposed on the way out.
 *
 * Each output's sum is AMX's over k in tile order, rounded once to bf16 (rne16: round_bf16's
 * bits), whatever m, the thread count or the share: a row's result never depends on the
 * other rows of the call. The same bits as mci_amx_experts_into on its packed copy, but for
 * results below float32's normal range, which that kernel's round16 flushes to zero. It is not the skinny kernels' sum (AMX's accumulation inside a
 * tile step cannot be reproduced with vdpbf16ps: measured, 70% of float32 sums differ in the
 * last bits), so the two agree within float32 summation order, one bf16 rounding apart. */

/* A tile loads read 16 rows 64 bytes at a time, 2k bytes apart: the hardware
 * prefetchers do not follow that, so while a block of 32 weight rows is multiplied, the next
 * block of the thread's share (up to 32 rows of k bf16, contiguous) is prefetched into L2 in
 * address order, 1/kblocks of it per k step. Measured (cold 1,536 x 512 weights, median us a call; the whole 32-request step of
 * `small` alternating in separate processes): 1 row 71-73 -> 62-63, 8 rows 74-75 -> 68-69;
 * the step 13.85 / 15.62 / 15.17 -> 13.96 / 14.23 / 13.81 ms. */

/* x [m, k] (row stride ldx) -> B tiles: tile (tb, kb) holds 16 pair-rows x 16 tokens,
 * packed[((tb * kblocks + kb) * 16 + p) * 16 + t] = pair p of chunk kb of token 16 tb + t
 * (zero past m). */
static void pack_tokens(const uint16_t *x, long ldx, long m, long k, uint32_t *packed) {
    const long kblocks = k / 32;
    for (long tb = 0; tb * 16 < m; tb++)
        for (long kb = 0; kb < kblocks; kb++) {
            __m512i r[16];
            for (int t = 0; t < 16; t++)
                r[t] = 16 * tb + t < m ? _mm512_loadu_si512(x + (16 * tb + t) * ldx + 32 * kb)
                                       : _mm512_setzero_si512();
            transpose16(r);
            for (int p = 0; p < 16; p++)
                _mm512_store_si512(packed + ((tb * kblocks + kb) * 16 + p) * 16, r[p]);
        }
}

/* C tile c [16 features][16 tokens] -> the sink's rows t0 .. t0 + tokens - 1, features
 * [n, n + feats). */
static void store_transposed(const Sink *s, const float *c, long t0, long tokens, long n,
                             int feats) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(c + 16 * i);
    transpose16(r);
    const __mmask16 keep = feats >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << feats) - 1);
    for (long t = 0; t < tokens; t++) {
        const __m256i b = rne16(_mm512_castsi512_ps(r[t]));
        if (s->acc) { /* store()'s weighted add: the bf16 value times the weight, then added */
            float *acc = s->acc + s->tok[t0 + t] * s->ldy + n;
            const __m512 v = _mm512_mul_ps(widen16(b), _mm512_set1_ps(s->wt[t0 + t]));
            _mm512_mask_storeu_ps(acc, keep, _mm512_add_ps(_mm512_maskz_loadu_ps(keep, acc), v));
        } else {
            _mm256_mask_storeu_epi16(s->y + (t0 + t) * s->ldy + n, keep, b);
        }
    }
}

void mci_amx_rows_range(const uint16_t *x, long ldx, const uint16_t *w, long k, Sink y, long m,
                        long n0, long n1) {
    if (n1 <= n0 || m <= 0) return;
    const long kblocks = k / 32, tblocks = (m + 15) / 16, tile = kblocks * 256;
    uint32_t *bx = aligned_alloc(64, sizeof(uint32_t) * tblocks * tile);
    uint16_t *pad = NULL; /* a last block of fewer than 16 weight rows, zero-padded */
    pack_tokens(x, ldx, m, k, bx);
    configure_tiles();
    float c[4][256] __attribute__((aligned(64)));
    /* feature blocks outside, token blocks inside: each weight row is read once */
    for (long f = n0; f < n1; f += 32) {
        const long left = n1 - f < 32 ? n1 - f : 32;
        const int two_f = left > 16;
        const uint16_t *a0 = w + f * k, *a1 = a0 + 16 * k;
        if (left % 16) { /* the share's last rows: a copy of them, zero below */
            if (!pad) pad = aligned_alloc(64, sizeof(uint16_t) * 16 * k);
            const long whole = left / 16 * 16;
            memset(pad, 0, sizeof(uint16_t) * 16 * k);
            memcpy(pad, w + (f + whole) * k, sizeof(uint16_t) * (left - whole) * k);
            if (whole) a1 = pad;
            else a0 = pad;
        }
        /* the next block's rows of this share (k * 2 bytes each, 64 of them per k step) */
        const long ahead = n1 - f - 32 < 32 ? n1 - f - 32 : 32;
        const char *next = ahead > 0 ? (const char *)(w + (f + 32) * k) : NULL;
        const int f_first = left < 16 ? (int)left : 16, f_second = (int)(left - f_first);
        for (long tb = 0; tb < tblocks; tb += 2) {
            const int two_t = tb + 1 < tblocks;
            const uint32_t *b0 = bx + tb * tile, *b1 = b0 + (two_t ? tile : 0);
            const long t_first = 16 * (tb + 1) < m ? 16 : m - 16 * tb;
            const long t_second = two_t ? (16 * (tb + 2) < m ? 16 : m - 16 * (tb + 1)) : 0;
            _tile_zero(0);
            if (two_t) _tile_zero(1);
            if (two_f) _tile_zero(2);
            if (two_f && two_t) _tile_zero(3);
            for (long kb = 0; kb < kblocks; kb++) {
                if (tb == 0) /* the next block into L2, in address order (see above) */
                    for (long b = 0; b < ahead * 64; b += 64)
                        _mm_prefetch(next + kb * ahead * 64 + b, _MM_HINT_T1);
                _tile_loadd(4, a0 + kb * 32, k * 2);
                _tile_loadd(6, b0 + kb * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two_t) {
                    _tile_loadd(7, b1 + kb * 256, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two_f) {
                    _tile_loadd(5, a1 + kb * 32, k * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two_t) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c[0], 64);
            if (two_t) _tile_stored(1, c[1], 64);
            if (two_f) _tile_stored(2, c[2], 64);
            if (two_f && two_t) _tile_stored(3, c[3], 64);
            store_transposed(&y, c[0], 16 * tb, t_first, f, f_first);
            if (two_t) store_transposed(&y, c[1], 16 * (tb + 1), t_second, f, f_first);
            if (two_f) {
                store_transposed(&y, c[2], 16 * tb, t_first, f + 16, f_second);
                if (two_t) store_transposed(&y, c[3], 16 * (tb + 1), t_second, f + 16, f_second);
            }
        }
    }
    _tile_release();
    free(pad);
    free(bx);
}

/* Prefill attention's scores (cpu_prefill_attention.c) on AMX tiles. Its packed keys
 * [nkb][d/2][16][2] are already AMX's B layout: 16 pair-rows of 16 keys a tile, 32 dims per
 * tile step. The 32 query rows are read in place as A (16 rows x 32 dims a tile); each C tile
 * holds 16 rows x 16 keys and is stored straight into the row's scores, then scaled as the
 * vdpbf16ps path scales (one multiply, one rounding), and each row's maximum over its first
 * limits[r] scores is kept on the way (mx). Each score is a float32 sum of exact
 * bf16 products in AMX's order: within float32 rounding of the vdpbf16ps path's (which sums
 * in another order), and it depends only on its query row and key, whatever the other rows. */
void mci_amx_scores(const uint16_t *q, long ldq, long d, const uint16_t *kp, long nkb,
                    float scale, float *s, long lds, const long *limits, float *mx) {
    const long steps = d / 32, block = d / 2 * 32; /* elements per block of 16 keys */
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 vmax[32];
    for (int r = 0; r < 32; r++) vmax[r] = _mm512_set1_ps(-INFINITY);
    /* rows past the last with keys are neither scaled nor kept (nobody reads them), and the
     * second 16 not computed when none of them has keys (a decode item of 16 heads or fewer) */
    int rows = 32;
    while (rows > 0 && limits[rows - 1] <= 0) rows--;
    const int low = rows > 16;
    configure_tiles();
    for (long kb = 0; kb < nkb; kb += 2) {
        const int two = kb + 1 < nkb;
        const uint16_t *b0 = kp + kb * block, *b1 = b0 + block;
        _tile_zero(0);
        if (low) _tile_zero(2);
        if (two) {
            _tile_zero(1);
            if (low) _tile_zero(3);
        }
        for (long t = 0; t < steps; t++) {
            _tile_loadd(4, q + t * 32, ldq * 2);
            _tile_loadd(6, b0 + t * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (low) {
                _tile_loadd(5, q + 16 * ldq + t * 32, ldq * 2);
                _tile_dpbf16ps(2, 5, 6);
            }
            if (two) {
                _tile_loadd(7, b1 + t * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
                if (low) _tile_dpbf16ps(3, 5, 7);
            }
        }
        float *c = s + kb * 16;
        _tile_stored(0, c, lds * 4);
        if (low) _tile_stored(2, c + 16 * lds, lds * 4);
        if (two) {
            _tile_stored(1, c + 16, lds * 4);
            if (low) _tile_stored(3, c + 16 * lds + 16, lds * 4);
        }
        for (int r = 0; r < rows; r++) /* still in L1: the scale, as the vdpbf16ps path's */
            for (int h = 0; h < 1 + two; h++) {
                const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(c + r * lds + 16 * h), vs);
                _mm512_storeu_ps(c + r * lds + 16 * h, v);
                /* the running maximum over the row's first limits[r] scores; a NaN score
                 * is skipped (max_ps returns its second operand then), as row_max does */
                const long left = limits[r] - (kb + h) * 16;
                if (left > 0) {
                    const __mmask16 m = left >= 16 ? (__mmask16)0xffff
                                                   : (__mmask16)((1u << left) - 1);
                    vmax[r] = _mm512_mask_max_ps(vmax[r], m, v, vmax[r]);
                }
            }
    }
    _tile_release();
    for (int r = 0; r < 32; r++) mx[r] = _mm512_reduce_max_ps(vmax[r]);
}

/* Prefill attention's P times V (cpu_prefill_attention.c) on AMX tiles: 32 rows of P (bf16,
 * row stride ldp elements, zero past each row's keys up to 32 nkc) as A, 32 keys a tile step;
 * the values packed by mci_pack_values ([dv/16][lc][16 pairs][16][2]: AMX's B layout, each
 * column tile's chunks of 32 keys in order) as B, block_32x32's operands. Each output is a
 * float32 sum of exact bf16 products, rounded once to bf16 (rne16, torch's rounding), as the
 * bf16 bmm it replaces; the first `rows` rows go to out (row stride ld_out). dv a multiple of
 * 32, nkc <= lc. */
void mci_amx_pv(const uint16_t *p, long ldp, const uint16_t *vp, long lc, long nkc, long dv,
                int rows, uint16_t *out, long ld_out) {
    float c[32 * 32] __attribute__((aligned(64)));
    configure_tiles();
    for (long ct = 0; ct < dv / 16; ct += 2) {
        const uint16_t *b0 = vp + ct * lc * 512;
        if (rows <= 16) block_16x32(p, ldp, b0, b0 + lc * 512, nkc, c);
        else block_32x32(p, ldp, b0, b0 + lc * 512, nkc, c);
        for (int r = 0; r < rows; r++) {
            uint16_t *o = out + r * ld_out + ct * 16;
            _mm256_storeu_si256((__m256i *)o, rne16(_mm512_load_ps(c + r * 32)));
            _mm256_storeu_si256((__m256i *)(o + 16), rne16(_mm512_load_ps(c + r * 32 + 16)));
        }
    }
    _tile_release();
}
