/* Skinny bf16 matmuls for the CPU: y[t, n] = sum_k x[t, k] * w[n, k] for a few rows t.
 *
 * Why: at decode sizes (1-64 rows) oneDNN's and MKL's bf16 matmuls run far below this
 * machine's memory bandwidth (a 512x512 weight read from cache: ~66 us, about 8 GB/s), and
 * a decode step is ~100 such calls. Here each weight row is streamed once per pass of up to
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

#define FEATS 4  /* a thread's share of a weight's rows is whole blocks of FEATS rows */

#ifdef __AVX512F__
#define TOKENS 8 /* rows of x per pass over a weight's rows */
#define STACK_PACK 8192 /* elements of x's packed copy held on the stack, not the heap */
/* weight bytes a thread takes every pass over before the next: 64 KB, or 16 rows where
 * those are more (k above 2,048) */
#define BLOCK_BYTES (64 << 10)

/* The accumulator of weight row r and row j of x in a group of R weight rows x T rows of x
 * (T * R <= 16): the slot whose sum reduce16 puts in lane j * R + r, so that each row of x's R
 * sums come out in consecutive lanes (lane 4q + p of reduce16 is slot 4p + q's sum). */
#define SLOT(R, r, j) (4 * (((j) * (R) + (r)) % 4) + ((j) * (R) + (r)) / 4)

/* Prefetching for the later passes over a block of weight rows: they read it from cache, so
 * the memory would idle; each prefetches line `part` of every `share` 64-byte lines of the
 * next block's rows (row n + rows for row n, while below `end`; `share` = the later passes),
 * so the next block's first pass finds them in cache. Measured (one call from Python, weights
 * cold, alternating with the kernel before, outputs bit-equal; a 2-core Zen 4 EPYC): 32 rows
 * of x through the LM head (8,192 x 512) 954-970 -> 822-841 us, 3,072 x 512 347 -> 307,
 * 512 x 512 66 -> 60; 16 rows through the LM head 584 -> 509. */
typedef struct {
    long rows, end;
    int share, part;
} Ahead;

/* Weight bytes ahead of the passes over weight rows in address order (one_row, group_rows
 * with P = 1) that they prefetch; 0: none. Those passes read the weight from memory, except
 * the one-row tails of the later passes (9, 17, ... rows of x), which read it from cache
 * and prefetch too, for nothing. A prefetch never faults and never changes a sum; its
 * address is formed as an integer, since it may lie past the weight's end. build.py sets
 * it per CPU vendor, as measured on one CPU of each:
 * - a 2-core AMD EPYC (Zen 4), weights from DRAM: the hardware prefetchers follow the one
 *   address-ordered stream, and prefetching 4 rows ahead (4 KB at k = 512) as well cost
 *   bandwidth (a decode step of `small`, one request, 2.39-2.53 -> 2.31-2.35 ms without; 4
 *   requests 5.46-5.66 -> 5.30-5.36; a model-shaped sequence of 63 weights, 51 MB, 30-31 ->
 *   35-38 GB/s, where a plain read of the same shares took 36-37);
 * - a 2-core Intel Xeon (AMX; 2 MB of L2 a core, a 300 MB L3 that holds `small`'s weights):
 *   without it the same kind of sequence (57 weights, 53.5 MB, one row of x) read at 45-54
 *   GB/s where a plain read of the same shares takes 64; 4 KB ahead, 60-66 GB/s (2 KB: 62-64,
 *   8 KB: 62); from DRAM (2 GB of copies in turn) 23 -> 32 GB/s. */
#ifndef STREAM_AHEAD
#define STREAM_AHEAD 0
#endif
#define PREFETCH_AHEAD(p)                                                                      \
    _mm_prefetch((const char *)((uintptr_t)(p) + STREAM_AHEAD), _MM_HINT_T0)

/* Weight rows [n, n + R) for T rows of x, P weight rows side by side (T, R, P compile-time
 * constants in each caller, T * R <= 16, so the 16 accumulators stay in registers). Each
 * output's sum is the one this file has always computed: lane by lane over the chunks of k in
 * order, then the lanes added in _mm512_reduce_add_ps's pairs (reduce16 adds the same pairs
 * for 16 sums at once), rounded once to bf16 (rne16: round_bf16's bits).
 *
 * P = 1, one weight row at a time in address order, for weights read from memory: rows read
 * side by side, chunk by chunk (1 KB apart for k = 512), defeat the hardware prefetchers.
 * Measured on a 2-core AMD EPYC (Zen 4), one row of x, weights cold from DRAM: 4 rows side by
 * side read 512x512 at 15 GB/s and 8192x512 at 17, one row at a time 26 and 28 (a plain read:
 * 22-31). Software prefetch on this pass (and in one_row) depends on the CPU (see
 * STREAM_AHEAD). P = 2 for weights in cache, where the loads are the limit: each chunk of x
 * loaded once for two weight rows. Why groups: a row's sums reduced alone cost ~10 shuffles
 * and adds, its result rounded and stored one scalar at a time, about as much as the row's
 * dot products at k = 256-512 from cache; a group's 16 sums take 45 operations and one
 * rounding.
 * Measured (the 7 MoE layers' routed experts of a 32-request step of `small`, one expert hot
 * in cache for all, so the arithmetic alone): 3.45 ms a step before, 3.25 in groups, 2.75 in
 * groups with P = 2; from DRAM, P = 2 was 30% slower than P = 1. */
static inline __attribute__((always_inline)) void group_rows(const uint16_t *xp, const uint16_t *w,
                                                              long k, const Sink *y, const int T,
                                                              const int R, const int P, long n,
                                                              const Ahead *ahead) {
    const long k_full = k & ~31L;
    const __mmask32 tail = (__mmask32)((1ULL << (k - k_full)) - 1);
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; r += P) {
        const int rows = R - r < P ? R - r : P;
        const uint16_t *xc = xp;
        const uint16_t *w0 = w + (n + r) * k, *w1 = w0 + (rows > 1 ? k : 0);
        /* a later pass: the same rows of the next block, a share of their lines (see Ahead) */
        const int next0 = P > 1 && n + r + ahead->rows < ahead->end;
        const int next1 = P > 1 && rows > 1 && n + r + 1 + ahead->rows < ahead->end;
        const long skip = ahead->rows * k;
        for (long kk = 0; kk < k_full; kk += 32, xc += T * 32) {
            if (P > 1 && (kk >> 5) % ahead->share == ahead->part) {
                if (next0) _mm_prefetch((const char *)(w0 + skip + kk), _MM_HINT_T0);
                if (next1) _mm_prefetch((const char *)(w1 + skip + kk), _MM_HINT_T0);
            }
            if (P == 1 && STREAM_AHEAD) PREFETCH_AHEAD(w0 + kk);
            const __m512bh wv0 = (__m512bh)_mm512_loadu_si512(w0 + kk);
            __m512bh wv1 = wv0;
            if (rows > 1) wv1 = (__m512bh)_mm512_loadu_si512(w1 + kk);
#pragma GCC unroll 16
            for (int j = 0; j < T; j++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xc + j * 32);
                acc[SLOT(R, r, j)] = _mm512_dpbf16_ps(acc[SLOT(R, r, j)], wv0, xv);
                if (rows > 1)
                    acc[SLOT(R, r + 1, j)] = _mm512_dpbf16_ps(acc[SLOT(R, r + 1, j)], wv1, xv);
            }
        }
        if (tail) { /* x's copy is zero past k, as the masked load of x was */
#pragma GCC unroll 2
            for (int q = 0; q < rows; q++) {
                const __m512i wv = _mm512_maskz_loadu_epi16(tail, w + (n + r + q) * k + k_full);
#pragma GCC unroll 16
                for (int j = 0; j < T; j++)
                    acc[SLOT(R, r + q, j)] =
                        _mm512_dpbf16_ps(acc[SLOT(R, r + q, j)], (__m512bh)wv,
                                         (__m512bh)_mm512_loadu_si512(xc + j * 32));
            }
        }
    }
    uint16_t sums[16];
    _mm256_storeu_si256((__m256i *)sums, rne16(reduce16(acc)));
#pragma GCC unroll 16
    for (int j = 0; j < T; j++) {
        if (y->acc) { /* store()'s weighted add, for R features of one row of x */
            float *dst = y->acc + y->tok[j] * y->ldy + n;
            const float wt = y->wt[j];
            for (int r = 0; r < R; r++) dst[r] += bf16_to_float(sums[j * R + r]) * wt;
        } else {
            __builtin_memcpy(y->y + j * y->ldy + n, sums + j * R, R * sizeof(uint16_t));
        }
    }
}

/* Weight row n for one row of x: its sum alone, reduced by _mm512_reduce_add_ps and
 * stored as a scalar. Why not in a group: with one accumulator a row, a group of 4 rows
 * reduces 16 vectors (12 of them zero) for 4 sums, and the batch-1 LM head (8,192 x 512, one
 * call, weights cold) took 190 -> 220 us in groups of 4, 223 -> 249 in groups of 16. */
static inline __attribute__((always_inline)) void one_row(const uint16_t *xp, const uint16_t *w,
                                                           long k, const Sink *y, long n) {
    const long k_full = k & ~31L;
    const __mmask32 tail = (__mmask32)((1ULL << (k - k_full)) - 1);
    const uint16_t *wr = w + n * k;
    __m512 acc = _mm512_setzero_ps();
    for (long kk = 0; kk < k_full; kk += 32) {
        if (STREAM_AHEAD) PREFETCH_AHEAD(wr + kk);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(wr + kk),
                               (__m512bh)_mm512_loadu_si512(xp + kk));
    }
    if (tail) /* x's copy is zero past k */
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + k_full),
                               (__m512bh)_mm512_loadu_si512(xp + k_full));
    store(y, 0, n, _mm512_reduce_add_ps(acc));
}

/* Rows [n0, n1) of one weight for T rows of x (packed by pack_rows): groups of 16 / T weight
 * rows, then what is left one row at a time. */
static inline __attribute__((always_inline)) void block_rows(const uint16_t *xp,
                                                              const uint16_t *w, long k,
                                                              const Sink *y, const int T,
                                                              const int P, long n0, long n1,
                                                              const Ahead *ahead) {
    if (T == 1) { /* one row of x: each weight row reduced on its own (see one_row) */
        for (long n = n0; n < n1; n++) one_row(xp, w, k, y, n);
        return;
    }
    const int R = 16 / T;
    long n = n0;
    for (; n + R <= n1; n += R) group_rows(xp, w, k, y, T, R, P, n, ahead);
    for (; n < n1; n++) group_rows(xp, w, k, y, T, 1, 1, n, ahead);
}

/* T rows of x (row stride ldx) into xp chunk-major: chunk c of row j at xp + (c * T + j) * 32,
 * zero past k. Why: the kernel then reads every row of x through one pointer (T separate row
 * pointers ran out of general registers at T = 8, and the compiler spilled to the stack
 * inside the loop). */
static void pack_rows(const uint16_t *x, long ldx, int T, long k, uint16_t *xp) {
    for (long c = 0; c * 32 < k; c++) {
        const __mmask32 m = k - c * 32 >= 32 ? ~(__mmask32)0 : (__mmask32)((1U << (k - c * 32)) - 1);
        for (int j = 0; j < T; j++)
            _mm512_store_si512(xp + (c * T + j) * 32,
                               _mm512_maskz_loadu_epi16(m, x + j * ldx + c * 32));
    }
}

#define PASS(T)                                                                                \
    (cached ? block_rows(xp, w, k, &yr, T, 2, b0, b1, &ahead)                                  \
            : block_rows(xp, w, k, &yr, T, 1, b0, b1, &ahead))

long mci_packed_size(long m, long k) { /* the last pass holds only its own rows */
    const long pass = 32 * ((k + 31) / 32) * TOKENS;
    return m <= 0 ? 0 : (m - 1) / TOKENS * pass + 32 * ((k + 31) / 32) * ((m - 1) % TOKENS + 1);
}

void mci_pack(const uint16_t *x, long ldx, long m, long k, uint16_t *packed) {
    const long pass = 32 * ((k + 31) / 32) * TOKENS;
    for (long r = 0; r < m; r += TOKENS)
        pack_rows(x + r * ldx, ldx, m - r < TOKENS ? (int)(m - r) : TOKENS, k,
                  packed + r / TOKENS * pass);
}

/* A thread's rows go in blocks of about BLOCK_BYTES, every pass over one block before the
 * next, so that a weight is read from memory once (the first pass, one row at a time) and its
 * later passes find it in cache (two rows side by side); before, each pass read the thread's
 * whole share, which for a large weight (the LM head's 4 MB a thread) came from L3 each time. */
void mci_packed_rows_range(const uint16_t *packed, const uint16_t *w, long k, Sink y, long m,
                           long n0, long n1) {
    const long pass = 32 * ((k + 31) / 32) * TOKENS;
    const long fit = BLOCK_BYTES / (k > 0 ? 2 * k : 2); /* weight rows */
    const long block = m <= TOKENS ? n1 - n0 : fit < 16 ? 16 : (fit + 15) & ~15L;
    /* the later passes that prefetch: those of 2 or more rows of x (a last pass of one row
     * goes through one_row, which reads its rows alone) */
    const int later = (int)((m - 1) / TOKENS) - (m > TOKENS && (m - 1) % TOKENS == 0);
    for (long b0 = n0; b0 < n1; b0 += block) {
        const long b1 = b0 + block < n1 ? b0 + block : n1;
        for (long r = 0; r < m; r += TOKENS) {
            const uint16_t *xp = packed + r / TOKENS * pass;
            const Sink yr = sink_rows(y, r);
            const int cached = r > 0;
            const Ahead ahead = {block, n1, later > 0 ? later : 1, cached ? (int)(r / TOKENS) - 1 : 0};
            switch ((m - r) < TOKENS ? (int)(m - r) : TOKENS) {
            case 1: PASS(1); break;
            case 2: PASS(2); break;
            case 3: PASS(3); break;
            case 4: PASS(4); break;
            case 5: PASS(5); break;
            case 6: PASS(6); break;
            case 7: PASS(7); break;
            default: PASS(8); break;
            }
        }
    }
}

/* One weight's rows [n0, n1) for all m rows of x: x packed (on the stack where small; one row
 * of whole chunks is its own packed copy), then mci_packed_rows_range. */
void mci_rows_range(const uint16_t *x, long ldx, const uint16_t *w, long k, Sink y, long m,
                    long n0, long n1) {
    if (n1 <= n0 || m <= 0) return;
    if (m == 1 && k % 32 == 0) {
        mci_packed_rows_range(x, w, k, y, m, n0, n1);
        return;
    }
    const long size = mci_packed_size(m, k);
    uint16_t stack[size > STACK_PACK || size == 0 ? 1 : size] __attribute__((aligned(64)));
    uint16_t *packed = size > STACK_PACK ? aligned_alloc(64, sizeof(uint16_t) * size) : stack;
    mci_pack(x, ldx, m, k, packed);
    mci_packed_rows_range(packed, w, k, y, m, n0, n1);
    if (packed != stack) free(packed);
}
#undef PASS

#else /* AVX2 (cpu_avx2.h): the same sums, lane for lane, with 256-bit registers */
#define TOKENS 4 /* rows of x per pass over a weight's rows */
#define PREFETCH 4 /* weight rows ahead */

/* Accumulate one 32-element chunk of the weight row against T widened rows of x. */
#define MCI_CHUNK(T, LOAD)                                                                     \
    {                                                                                          \
        __m256i lo, hi;                                                                        \
        LOAD;                                                                                  \
        const __m256 lo_odd = mci_odd8(lo), lo_even = mci_even8(lo);                           \
        const __m256 hi_odd = mci_odd8(hi), hi_even = mci_even8(hi);                           \
        _Pragma("GCC unroll 4") for (int j = 0; j < T; j++) {                                  \
            const float *xc = xw + (j * chunks + c) * 32;                                      \
            acc[j][0] = _mm256_fmadd_ps(lo_odd, _mm256_loadu_ps(xc), acc[j][0]);               \
            acc[j][0] = _mm256_fmadd_ps(lo_even, _mm256_loadu_ps(xc + 8), acc[j][0]);          \
            acc[j][1] = _mm256_fmadd_ps(hi_odd, _mm256_loadu_ps(xc + 16), acc[j][1]);          \
            acc[j][1] = _mm256_fmadd_ps(hi_even, _mm256_loadu_ps(xc + 24), acc[j][1]);         \
        }                                                                                      \
    }

/* Weight row n for T widened rows of x: acc[j] holds lanes 0-7 and 8-15 of cpu_matvec's
 * 16-lane accumulator, so each output's sum is the AVX-512 kernel's. A row's last chunk (k
 * not a multiple of 32) is read through a zero-padded copy.
 *
 * One weight row at a time, in address order, as group_rows above with P = 1 (why: there). This build on
 * the same Zen 4 EPYC: cold 512x512 15 -> 26 GB/s, 8192x512 17 -> 31; a batch-1 step of
 * `small` 5.0 -> 3.3 ms. */
static inline __attribute__((always_inline)) void row_avx2(const float *xw, long chunks,
                                                           const uint16_t *w, long k,
                                                           const Sink *y, const int T, long n) {
    const long full = k / 32;
    __m256 acc[T][2];
    _Pragma("GCC unroll 4") for (int j = 0; j < T; j++) acc[j][0] = acc[j][1] =
        _mm256_setzero_ps();
    const uint16_t *wr = w + n * k;
    long c = 0;
    for (; c < full; c++) {
        MCI_CHUNK(T, {
            /* PREFETCH rows ahead */
            _mm_prefetch((const char *)(wr + PREFETCH * k + c * 32), _MM_HINT_T0);
            lo = _mm256_loadu_si256((const __m256i *)(wr + c * 32));
            hi = _mm256_loadu_si256((const __m256i *)(wr + c * 32 + 16));
        })
    }
    if (c < chunks) {
        MCI_CHUNK(T, {
            uint16_t part[32] = {0};
            __builtin_memcpy(part, wr + c * 32, (k - c * 32) * sizeof(uint16_t));
            lo = _mm256_loadu_si256((const __m256i *)part);
            hi = _mm256_loadu_si256((const __m256i *)(part + 16));
        })
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < T; j++)
        store(y, j, n, mci_reduce_halves(acc[j][0], acc[j][1]));
}

/* One weight's rows [n0, n1) for all m rows of x, TOKENS rows at a time. */
void mci_rows_range(const uint16_t *x, long ldx, const uint16_t *w, long k, Sink y, long m,
                    long n0, long n1) {
    const long chunks = (k + 31) / 32;
    float *xw = malloc(sizeof(float) * 32 * chunks * (m < TOKENS ? m : TOKENS));
    for (long r = 0; r < m; r += TOKENS) {
        const int t = (m - r) < TOKENS ? (int)(m - r) : TOKENS;
        mci_widen_rows(x + r * ldx, ldx, t, k, xw);
        const Sink yr = sink_rows(y, r);
        switch (t) {
        case 1: for (long n = n0; n < n1; n++) row_avx2(xw, chunks, w, k, &yr, 1, n); break;
        case 2: for (long n = n0; n < n1; n++) row_avx2(xw, chunks, w, k, &yr, 2, n); break;
        case 3: for (long n = n0; n < n1; n++) row_avx2(xw, chunks, w, k, &yr, 3, n); break;
        default: for (long n = n0; n < n1; n++) row_avx2(xw, chunks, w, k, &yr, 4, n); break;
        }
    }
    free(xw);
}
#endif

/* The share [n0, n1) of n features that thread `id` of `count` takes (whole FEATS blocks). */
void mci_share(long n, int id, int count, long *n0, long *n1) {
    const long blocks = (n + FEATS - 1) / FEATS;
    const long b0 = blocks * id / count, b1 = blocks * (id + 1) / count;
    *n0 = b0 * FEATS;
    *n1 = b1 * FEATS < n ? b1 * FEATS : n;
}

void mci_weight_rows(const uint16_t *x, long ldx, const Weight *w, long k, Sink y, long m,
                     long n0, long n1) {
    if (w->scale)
        mci_fp8_rows_range(x, ldx, w, k, y, m, n0, n1);
    else if (w->amx_rows && m >= w->amx_rows && k % 32 == 0)
        mci_amx_rows_range(x, ldx, (const uint16_t *)w->data, k, y, m, n0, n1);
    else
        mci_rows_range(x, ldx, (const uint16_t *)w->data, k, y, m, n0, n1);
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ w [n, k]^T; w contiguous. */
void mci_linear(const uint16_t *x, long ldx, const Weight *w, uint16_t *y, long ldy, long m,
                long n, long k) {
    TEAM_WORK({
        long n0, n1;
        mci_share(n, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
        const Sink sink = {y, ldy, 0, 0, 0};
        mci_weight_rows(x, ldx, w, k, sink, m, n0, n1);
    });
}

void mci_experts_into(const uint16_t *x, long ldx, const Weight *w, Sink y,
                      const int64_t *ids, const int64_t *starts, const int64_t *counts,
                      long segments, long n, long k, long gemm_above) {
    TEAM_WORK({
        long n0, n1;
        mci_share(n, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
        for (long s = 0; s < segments; s++) {
            const Weight we = expert_weight(w, ids[s], n, k);
            const uint16_t *xs = x + starts[s] * ldx;
            const Sink ys = sink_rows(y, starts[s]);
            if (counts[s] > gemm_above && !we.scale)
                mci_bf16_gemm(xs, ldx, (const uint16_t *)we.data, k, ys, counts[s], n0, n1);
            else
                mci_weight_rows(xs, ldx, &we, k, ys, counts[s], n0, n1);
        }
    });
}

/* Stacked experts: for each segment s, rows [starts[s], starts[s] + counts[s]) of x and y go
 * through expert ids[s] (`expert_weight`: that expert's [n, k] weight); bf16 segments of more
 * than gemm_above rows on the GEMM (mci_experts_into). */
void mci_expert_linear(const uint16_t *x, long ldx, const Weight *w, uint16_t *y,
                       long ldy, const int64_t *ids, const int64_t *starts,
                       const int64_t *counts, long segments, long n, long k, long gemm_above) {
    const Sink sink = {y, ldy, 0, 0, 0};
    mci_experts_into(x, ldx, w, sink, ids, starts, counts, segments, n, k, gemm_above);
}

/* The same, each output row then weighted and added into float32 rows: acc [*, n] (zeroed by
 * the caller) gets acc[tokens[a]] += weights[a] * y[a] for every row a, in row order (each
 * thread owns a slice of the n features, so no two threads touch one element). */
void mci_expert_linear_combine(const uint16_t *x, long ldx, const Weight *w, float *acc,
                               const int64_t *tokens, const float *weights,
                               const int64_t *ids, const int64_t *starts,
                               const int64_t *counts, long segments, long n, long k,
                               long gemm_above) {
    const Sink sink = {0, n, acc, tokens, weights};
    mci_experts_into(x, ldx, w, sink, ids, starts, counts, segments, n, k, gemm_above);
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

void mci_rms_norm_row(const void *x, int x_bf16, const uint16_t *w, void *y, int y_bf16, long n,
                      float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (long j = 0; j < n; j += 16) {
        const __mmask16 m = (n - j) >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 v = load16((const char *)x + j * (x_bf16 ? 2 : 4), x_bf16, m);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps);
    const __m512 vs = _mm512_set1_ps(scale);
    for (long j = 0; j < n; j += 16) {
        const __mmask16 m = (n - j) >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 v = load16((const char *)x + j * (x_bf16 ? 2 : 4), x_bf16, m);
        const __m512 out = _mm512_mul_ps(_mm512_mul_ps(v, vs), load16(w + j, 1, m));
        if (y_bf16) {
#ifdef __AVX512F__
            _mm256_mask_storeu_epi16((uint16_t *)y + j, m, rne16(out));
#else
            float tmp[16];
            _mm512_storeu_ps(tmp, out);
            for (int i = 0; i < 16 && j + i < n; i++) ((uint16_t *)y)[j + i] = round_bf16(tmp[i]);
#endif
        } else {
            _mm512_mask_storeu_ps((float *)y + j, m, out);
        }
    }
}

/* The residual sum and its RMSNorm in one pass over each row (mci/layers/norm.py's
 * add_then_norm): sum = x + a (x float32 [rows, n], row stride ldx; a bf16 or float32 [rows,
 * n] contiguous, widened exactly; one float32 rounding, as torch's x + a), then mci_rms_norm's
 * row of sum into y. The same bits as the add and the norm called one after the other, the
 * row read once from L1 instead of twice from memory. */
void mci_add_rms_norm(const float *x, long ldx, const void *a, int a_bf16, float *sum,
                      const uint16_t *w, void *y, int y_bf16, long rows, long n, float eps) {
    PARALLEL_FOR(rows >= 32, for (long r = 0; r < rows; r++), {
        const float *xr = x + r * ldx;
        const char *ar = (const char *)a + r * n * (a_bf16 ? 2 : 4);
        float *sr = sum + r * n;
        for (long j = 0; j < n; j += 16) {
            const __mmask16 m =
                (n - j) >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
            const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, xr + j),
                                           load16(ar + j * (a_bf16 ? 2 : 4), a_bf16, m));
            _mm512_mask_storeu_ps(sr + j, m, v);
        }
        mci_rms_norm_row(sr, 0, w, (char *)y + r * n * (y_bf16 ? 2 : 4), y_bf16, n, eps);
    });
}

void mci_rms_norm(const void *x, long ldx, int x_bf16, const uint16_t *w, void *y, int y_bf16,
                  long rows, long n, float eps) {
    PARALLEL_FOR(rows >= 32, for (long r = 0; r < rows; r++), {
        mci_rms_norm_row((const char *)x + r * ldx * (x_bf16 ? 2 : 4), x_bf16, w,
                         (char *)y + r * n * (y_bf16 ? 2 : 4), y_bf16, n, eps);
    });
}
